//! Index math for patch grids: block-major (merge-block) ordering and bilinear resampling of a
//! square learned table with align_corners semantics. Pure functions, tested with hand-written
//! vectors.

/// (row, col) of every patch of an `h x w` grid, emitted in block-major order: the `merge x merge`
/// patches of each merge block are consecutive, blocks in raster order.
pub fn block_major_positions(h: usize, w: usize, merge: usize) -> Vec<(u32, u32)> {
    let mut out = Vec::with_capacity(h * w);
    for br in 0..h / merge {
        for bc in 0..w / merge {
            for ir in 0..merge {
                for ic in 0..merge {
                    out.push(((br * merge + ir) as u32, (bc * merge + ic) as u32));
                }
            }
        }
    }
    out
}

/// Two taps into a `side`-long axis for target index `i` of `size`, with align_corners = true
/// (endpoints map to 0 and side-1) and border clamping: `[(tap, weight); 2]`. Computed in f32
/// in the same order as the reference so that weights agree to the last bit.
pub(crate) fn bilinear_axis_taps(i: usize, size: usize, side: usize) -> [(usize, f32); 2] {
    let src = (i as f32 * (side - 1) as f32) / (size.max(2) - 1) as f32;
    let floor = src.floor();
    let lo = floor as usize;
    let frac = src - floor;
    let w = |offset: f32| (1.0 - (frac - offset).abs()).max(0.0);
    [(lo.min(side - 1), w(0.0)), ((lo + 1).min(side - 1), w(1.0))]
}

/// For every patch of an `h x w` grid in block-major order: 4 (index, weight) taps into a
/// `side x side` row-major table, the bilinear (align_corners) resample of that table.
pub fn bilinear_taps_block_major(h: usize, w: usize, side: usize, merge: usize) -> Vec<[(usize, f32); 4]> {
    block_major_positions(h, w, merge)
        .into_iter()
        .map(|(r, c)| {
            let rt = bilinear_axis_taps(r as usize, h, side);
            let ct = bilinear_axis_taps(c as usize, w, side);
            [
                (rt[0].0 * side + ct[0].0, rt[0].1 * ct[0].1),
                (rt[0].0 * side + ct[1].0, rt[0].1 * ct[1].1),
                (rt[1].0 * side + ct[0].0, rt[1].1 * ct[0].1),
                (rt[1].0 * side + ct[1].0, rt[1].1 * ct[1].1),
            ]
        })
        .collect()
}

/// Cumulative segment boundaries `[0, l0, l0+l1, ...]` from segment lengths.
pub fn cumulative(lengths: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let mut out = vec![0];
    for l in lengths {
        out.push(out.last().unwrap() + l);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_major_order_of_a_2x4_grid() {
        // Two 2x2 blocks side by side: block (0,0) then block (0,1).
        assert_eq!(
            block_major_positions(2, 4, 2),
            vec![(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
        );
    }

    #[test]
    fn block_major_order_of_a_4x2_grid() {
        assert_eq!(
            block_major_positions(4, 2, 2),
            vec![(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
        );
    }

    #[test]
    fn merge_one_is_raster_order() {
        assert_eq!(block_major_positions(2, 2, 1), vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
    }

    #[test]
    fn align_corners_maps_endpoints_to_endpoints() {
        // 3 targets over a 5-long table: sources 0, 2, 4 exactly.
        assert_eq!(bilinear_axis_taps(0, 3, 5), [(0, 1.0), (1, 0.0)]);
        assert_eq!(bilinear_axis_taps(1, 3, 5), [(2, 1.0), (3, 0.0)]);
        assert_eq!(bilinear_axis_taps(2, 3, 5), [(4, 1.0), (4, 0.0)]);
        // 4 targets over a 3-long table: sources 0, 2/3, 4/3, 2.
        let t = bilinear_axis_taps(1, 4, 3);
        assert_eq!((t[0].0, t[1].0), (0, 1));
        assert!((t[0].1 - 1.0 / 3.0).abs() < 1e-6 && (t[1].1 - 2.0 / 3.0).abs() < 1e-6);
        // A single target reads the first entry.
        assert_eq!(bilinear_axis_taps(0, 1, 4), [(0, 1.0), (1, 0.0)]);
    }

    #[test]
    fn taps_of_an_upsampled_2x2_table() {
        // 2x2 grid from a 3x3 table: the four corners, each with full weight on one tap.
        let taps = bilinear_taps_block_major(2, 2, 3, 2);
        let corner = |t: &[(usize, f32); 4]| t.iter().find(|x| x.1 == 1.0).unwrap().0;
        assert_eq!(taps.iter().map(corner).collect::<Vec<_>>(), vec![0, 2, 6, 8]);
        for t in &taps {
            assert!((t.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
        }
    }

    #[test]
    fn cumulative_lengths() {
        assert_eq!(cumulative([3, 5, 2]), vec![0, 3, 8, 10]);
    }
}
