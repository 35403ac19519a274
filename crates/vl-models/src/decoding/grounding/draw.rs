//! Boxes and points drawn on an image with their labels (`vl run --draw`): line widths and
//! glyph sizes that follow the image, labels placed so that none overlap, Unifont glyphs.

use image::{Rgb, RgbImage};

use super::{Geometry, PixelShape};

/// Colours shapes are drawn in, in turn (distinct on light and dark images).
pub const PALETTE: [[u8; 3]; 8] = [
    [230, 25, 75],
    [60, 180, 75],
    [0, 130, 200],
    [245, 130, 48],
    [145, 30, 180],
    [70, 240, 240],
    [240, 50, 230],
    [255, 225, 25],
];

/// Line width of drawn boxes for an image of this size: `min(width, height) / 300` rounded, at
/// least 2 px (so 2 px up to 749 px on the short side, 4 px at 1080, 7 px at 2160), at most 32.
pub fn line_width(width: u32, height: u32) -> u32 {
    ((width.min(height) + 150) / 300).clamp(2, 32)
}

/// Scale of label glyphs (GNU Unifont, 16 px tall, drawn `s` x `s` per font pixel):
/// `min(width, height) / 720` rounded, at least 1, at most 8. A label's band is `18 s` px tall
/// (the glyphs and `s` px of margin all round): 18 px up to 1079 px on the short side, 36 px at
/// 1080 to 1799, about a fortieth of the short side above that.
pub fn glyph_scale(width: u32, height: u32) -> u32 {
    ((width.min(height) + 360) / 720).clamp(1, 8)
}

/// Most characters of a label drawn.
pub const MAX_LABEL_CHARS: usize = 64;

/// The Unifont glyph a label character is drawn with: controls and whitespace as a space,
/// characters Unifont lacks (outside the Basic Multilingual Plane: emoji) as U+FFFD.
pub fn label_glyph(ch: char) -> &'static unifont::Glyph {
    let ch = if ch.is_control() || ch.is_whitespace() { ' ' } else { ch };
    unifont::get_glyph(ch).or_else(|| unifont::get_glyph('\u{FFFD}')).expect("Unifont has U+FFFD")
}

/// Pixel size of a drawn label (band included), clipped to the image: 8 font pixels a narrow
/// character, 16 a wide one (CJK), plus a margin of one each side, times `glyph_scale`.
pub fn label_size(label: &str, w: u32, h: u32) -> (u32, u32) {
    let s = glyph_scale(w, h);
    let cells: u32 = label.chars().take(MAX_LABEL_CHARS).map(|c| label_glyph(c).get_width() as u32).sum();
    (((cells + 2) * s).min(w), (18 * s).min(h))
}

/// A rectangle of pixels: top-left corner `(x, y)`, `w` x `h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    pub x: u32,
    pub y: u32,
    pub w: u32,
    pub h: u32,
}

impl Rect {
    /// Whether the two share a pixel.
    pub fn overlaps(&self, o: &Rect) -> bool {
        self.x < o.x + o.w && o.x < self.x + self.w && self.y < o.y + o.h && o.y < self.y + self.h
    }
}

/// Whether a box is drawn as a marker: less than a pixel wide or tall (a zero-width box).
fn degenerate(b: &[f64; 4]) -> bool {
    b[2] - b[0] < 1.0 || b[3] - b[1] < 1.0
}

/// The pixels a shape's drawing covers, within the image `w` x `h` (not empty): a box's span
/// [floor(x1), ceil(x2)) x [floor(y1), ceil(y2)); a point's disc (radius `2 t`, `t` the line
/// width); a zero-width box's marker (a cross of arms `3 t` and width `t` on its centre, with
/// the box's own segment).
pub fn extent(g: &Geometry, w: u32, h: u32) -> Rect {
    let t = line_width(w, h) as i64;
    let (x0, y0, x1, y1) = match *g {
        Geometry::Box(b) if !degenerate(&b) => {
            (b[0].floor() as i64, b[1].floor() as i64, b[2].ceil() as i64, b[3].ceil() as i64)
        }
        Geometry::Box(b) => {
            let (cx, cy) = (((b[0] + b[2]) / 2.0).floor() as i64, ((b[1] + b[3]) / 2.0).floor() as i64);
            let a = 3 * t;
            let (sx0, sy0, sx1, sy1) =
                (b[0].floor() as i64, b[1].floor() as i64, b[2].ceil() as i64, b[3].ceil() as i64);
            ((cx - a).min(sx0), (cy - a).min(sy0), (cx + a + 1).max(sx1), (cy + a + 1).max(sy1))
        }
        Geometry::Point([px, py]) => {
            let (cx, cy, r) = (px.round() as i64, py.round() as i64, 2 * t);
            (cx - r, cy - r, cx + r + 1, cy + r + 1)
        }
    };
    let (w, h) = (w as i64, h as i64);
    let x0 = x0.clamp(0, w - 1);
    let y0 = y0.clamp(0, h - 1);
    let (x1, y1) = (x1.clamp(x0 + 1, w), y1.clamp(y0 + 1, h));
    Rect { x: x0 as u32, y: y0 as u32, w: (x1 - x0) as u32, h: (y1 - y0) as u32 }
}

/// Where each shape's label is drawn (`None`: no label, or no free place left in the image),
/// rectangles that never overlap one another and stay within the image. In shape order, each
/// label goes at its shape's left edge above the shape when there is room, else inside its top
/// edge; when that place is taken, at the nearest free height in the same column (stacked
/// above or below the labels there); when the column is full, in the nearest column beside
/// the labels in the way.
pub fn label_rects(shapes: &[PixelShape], w: u32, h: u32) -> Vec<Option<Rect>> {
    let mut placed: Vec<Rect> = Vec::new();
    let mut out = Vec::with_capacity(shapes.len());
    if w == 0 || h == 0 {
        return vec![None; shapes.len()];
    }
    for s in shapes {
        let Some(label) = &s.label else {
            out.push(None);
            continue;
        };
        let (lw, lh) = label_size(label, w, h);
        let e = extent(&s.geometry, w, h);
        let x = e.x.min(w - lw);
        let above = (e.y >= lh).then(|| e.y - lh);
        let inside = e.y.min(h - lh);
        let free = |r: &Rect, placed: &[Rect]| !placed.iter().any(|p| p.overlaps(r));
        let at = |x, y| Rect { x, y, w: lw, h: lh };
        let want = above.unwrap_or(inside);
        let mut found = [above, Some(inside)].into_iter().flatten().map(|y| at(x, y)).find(|r| free(r, &placed));
        if found.is_none() {
            found = nearest_in_column(&placed, x, want, lw, lh, h).map(|y| at(x, y));
        }
        if found.is_none() {
            // Columns beside the labels in the way, nearest first (a bounded number).
            let mut xs: Vec<u32> =
                placed.iter().flat_map(|p| [p.x + p.w, p.x.saturating_sub(lw)]).filter(|&c| c + lw <= w).collect();
            xs.sort_by_key(|&c| (c.abs_diff(x), c));
            xs.dedup();
            found = xs
                .into_iter()
                .take(32)
                .filter_map(|c| nearest_in_column(&placed, c, want, lw, lh, h).map(|y| at(c, y)))
                .min_by_key(|r| r.x.abs_diff(x) as u64 + r.y.abs_diff(want) as u64);
        }
        if let Some(r) = found {
            placed.push(r);
        }
        out.push(found);
    }
    out
}

/// The free height nearest `want` for a label `lw` x `lh` at column `x` among `placed`, within
/// an image `h` tall.
fn nearest_in_column(placed: &[Rect], x: u32, want: u32, lw: u32, lh: u32, h: u32) -> Option<u32> {
    let mut taken: Vec<(u32, u32)> =
        placed.iter().filter(|p| p.x < x + lw && x < p.x + p.w).map(|p| (p.y, p.y + p.h)).collect();
    taken.sort_unstable();
    let mut best: Option<u32> = None;
    let mut gap_start = 0;
    for (a, b) in taken.into_iter().chain([(h, h)]) {
        if a >= gap_start + lh {
            let y = want.clamp(gap_start, a - lh);
            if best.is_none_or(|c| y.abs_diff(want) < c.abs_diff(want)) {
                best = Some(y);
            }
        }
        gap_start = gap_start.max(b);
    }
    best
}

/// Draws `shapes` (pixels) on `img`, in `PALETTE` order: boxes as outlines `line_width` wide,
/// inside the box's pixel span [floor(x1), ceil(x2)); a box less than a pixel wide or tall as a
/// cross (`extent`); points as a filled disc; then each label on a band of its shape's colour
/// where `label_rects` puts it, in GNU Unifont glyphs (CJK included). Pixels elsewhere are
/// untouched.
pub fn draw(img: &mut RgbImage, shapes: &[PixelShape]) {
    let (w, h) = img.dimensions();
    if w == 0 || h == 0 {
        return;
    }
    let t = line_width(w, h);
    let fill = |img: &mut RgbImage, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb<u8>| {
        for y in y0.max(0)..y1.min(h as i64) {
            for x in x0.max(0)..x1.min(w as i64) {
                img.put_pixel(x as u32, y as u32, c);
            }
        }
    };
    for (i, s) in shapes.iter().enumerate() {
        let c = Rgb(PALETTE[i % PALETTE.len()]);
        match s.geometry {
            Geometry::Box(b) if !degenerate(&b) => {
                let Rect { x: x0, y: y0, w: bw, h: bh } = extent(&s.geometry, w, h);
                let (x1, y1) = (x0 + bw, y0 + bh);
                for y in y0..y1 {
                    for x in x0..x1 {
                        if x < x0 + t || x + t >= x1 || y < y0 + t || y + t >= y1 {
                            img.put_pixel(x, y, c);
                        }
                    }
                }
            }
            Geometry::Box(b) => {
                // The segment, `t` wide, and a cross on its centre.
                let (t, a) = (t as i64, 3 * t as i64);
                let (cx, cy) = (((b[0] + b[2]) / 2.0).floor() as i64, ((b[1] + b[3]) / 2.0).floor() as i64);
                let (sx0, sy0) = (b[0].floor() as i64, b[1].floor() as i64);
                let (sx1, sy1) = ((b[2].ceil() as i64).max(sx0 + 1), (b[3].ceil() as i64).max(sy0 + 1));
                if b[2] - b[0] < 1.0 {
                    fill(img, cx - t / 2, sy0, cx - t / 2 + t, sy1, c);
                }
                if b[3] - b[1] < 1.0 {
                    fill(img, sx0, cy - t / 2, sx1, cy - t / 2 + t, c);
                }
                fill(img, cx - a, cy - t / 2, cx + a + 1, cy - t / 2 + t, c);
                fill(img, cx - t / 2, cy - a, cx - t / 2 + t, cy + a + 1, c);
            }
            Geometry::Point([px, py]) => {
                let r = (t * 2) as i64;
                let (cx, cy) = (px.round() as i64, py.round() as i64);
                for y in (cy - r).max(0)..(cy + r + 1).min(h as i64) {
                    for x in (cx - r).max(0)..(cx + r + 1).min(w as i64) {
                        if (x - cx).pow(2) + (y - cy).pow(2) <= r * r {
                            img.put_pixel(x as u32, y as u32, c);
                        }
                    }
                }
            }
        }
    }
    // Labels last, so no outline crosses one.
    for (i, (s, r)) in shapes.iter().zip(label_rects(shapes, w, h)).enumerate() {
        if let (Some(label), Some(r)) = (&s.label, r) {
            draw_label(img, label, r, Rgb(PALETTE[i % PALETTE.len()]));
        }
    }
}

/// The ink a label is written in on a band of colour `c`: black or white, whichever reads
/// better.
pub fn label_ink(c: Rgb<u8>) -> Rgb<u8> {
    if 299 * c.0[0] as u32 + 587 * c.0[1] as u32 + 114 * c.0[2] as u32 > 128_000 {
        Rgb([0, 0, 0])
    } else {
        Rgb([255, 255, 255])
    }
}

/// A label's band of colour `c` filling `r`, its glyphs in `label_ink` from `s` px inside the
/// band's top-left corner, each font pixel an `s` x `s` square, clipped to `r`.
fn draw_label(img: &mut RgbImage, label: &str, r: Rect, c: Rgb<u8>) {
    let (w, h) = img.dimensions();
    let s = glyph_scale(w, h);
    let ink = label_ink(c);
    let (xe, ye) = (r.x + r.w, r.y + r.h);
    for yy in r.y..ye {
        for xx in r.x..xe {
            img.put_pixel(xx, yy, c);
        }
    }
    let mut pen = r.x + s;
    for ch in label.chars().take(MAX_LABEL_CHARS) {
        let g = label_glyph(ch);
        for row in 0..16u32 {
            for col in 0..g.get_width() as u32 {
                if !g.get_pixel(col as usize, row as usize) {
                    continue;
                }
                for dy in 0..s {
                    for dx in 0..s {
                        let (px, py) = (pen + col * s + dx, r.y + s + row * s + dy);
                        if px < xe && py < ye {
                            img.put_pixel(px, py, ink);
                        }
                    }
                }
            }
        }
        pen += g.get_width() as u32 * s;
        if pen >= xe {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grounding::*;

    const Q3: Coords = Coords::Relative(1000.0);

    fn labelled(g: Geometry, label: &str) -> PixelShape {
        PixelShape { geometry: g, label: Some(label.into()) }
    }

    #[test]
    fn box_edges_are_drawn_at_their_pixels_and_nothing_else_changes() {
        let grey = Rgb([100, 100, 100]);
        let mut img = RgbImage::from_pixel(100, 50, grey);
        let shapes = parse(r#"[{"bbox_2d": [100, 200, 500, 600]}]"#, Q3).shapes;
        // 0..1000 of 100 x 50: x 10..50, y 10..30.
        let px = to_pixels(&shapes, Q3, 100, 50, (32, 64));
        assert_eq!(px[0].geometry, Geometry::Box([10.0, 10.0, 50.0, 30.0]));
        draw(&mut img, &px);
        let red = Rgb(PALETTE[0]);
        // Lines 2 px wide, inside the span [10, 50) x [10, 30).
        for (x, y, want) in [
            (10, 20, red),
            (11, 20, red),
            (12, 20, grey),
            (49, 20, red),
            (48, 20, red),
            (47, 20, grey),
            (50, 20, grey),
            (9, 20, grey),
            (30, 10, red),
            (30, 11, red),
            (30, 12, grey),
            (30, 29, red),
            (30, 28, red),
            (30, 27, grey),
            (30, 30, grey),
            (30, 9, grey),
            (10, 10, red),
            (49, 29, red),
        ] {
            assert_eq!(*img.get_pixel(x, y), want, "pixel ({x}, {y})");
        }
        let changed = img.enumerate_pixels().filter(|(_, _, p)| **p != grey).count();
        // The outline: 40 x 20 span less its 36 x 16 inside.
        assert_eq!(changed, 40 * 20 - 36 * 16);
    }

    #[test]
    fn labels_sit_above_their_box_and_points_are_discs() {
        let grey = Rgb([0, 0, 0]);
        let mut img = RgbImage::from_pixel(200, 200, grey);
        let shapes =
            parse(r#"[{"bbox_2d": [250, 500, 750, 900], "label": "cat"}, {"point_2d": [100, 100]}]"#, Q3).shapes;
        draw(&mut img, &to_pixels(&shapes, Q3, 200, 200, (64, 64)));
        // The box spans x 50..150, y 100..180; its label band is 18 px tall above it, (3 x 8 + 2)
        // wide: x 50..76, y 82..100.
        for (x, y) in img.enumerate_pixels().filter(|(_, _, p)| **p != grey).map(|(x, y, _)| (x, y)) {
            let in_box = (50..150).contains(&x) && (100..180).contains(&y);
            let in_label = (50..76).contains(&x) && (82..100).contains(&y);
            // The point at (20, 20): a disc of radius 4.
            let in_point = (x as i64 - 20).pow(2) + (y as i64 - 20).pow(2) <= 16;
            assert!(in_box || in_label || in_point, "pixel ({x}, {y}) changed");
        }
        assert_eq!(*img.get_pixel(50, 82), Rgb(PALETTE[0]), "the label band's corner");
        assert_eq!(*img.get_pixel(20, 20), Rgb(PALETTE[1]), "the point's centre");
        assert_eq!(*img.get_pixel(20, 24), Rgb(PALETTE[1]));
        assert_eq!(*img.get_pixel(20, 25), grey);
    }

    #[test]
    fn line_width_and_label_size_follow_the_short_side() {
        for ((w, h), t, s) in [
            ((100, 50), 2, 1),
            ((640, 480), 2, 1),
            ((1000, 749), 2, 1),
            ((1920, 1080), 4, 2),
            ((3840, 2160), 7, 3),
            ((100_000, 100_000), 32, 8),
        ] {
            assert_eq!((line_width(w, h), glyph_scale(w, h)), (t, s), "{w}x{h}");
            assert_eq!(label_size("ab", w, h), (18 * s, 18 * s), "{w}x{h}");
        }
        // A wide (CJK) character takes two narrow cells; the size is clipped to the image.
        assert_eq!(label_size("猫a", 640, 480), (16 + 8 + 2, 18));
        assert_eq!(label_size(&"x".repeat(60), 100, 10), (100, 10));
    }

    /// Every pixel of each placed label's band is its colour or its ink: no later label (or
    /// shape) drew over it.
    fn assert_bands_intact(img: &RgbImage, shapes: &[PixelShape], rects: &[Option<Rect>]) {
        for (i, (_, r)) in shapes.iter().zip(rects).enumerate() {
            let Some(r) = r else { continue };
            let c = Rgb(PALETTE[i % PALETTE.len()]);
            for y in r.y..r.y + r.h {
                for x in r.x..r.x + r.w {
                    let p = *img.get_pixel(x, y);
                    assert!(p == c || p == label_ink(c), "label {i} {r:?}: pixel ({x}, {y}) is {p:?}");
                }
            }
        }
    }

    #[test]
    fn labels_never_overlap_for_a_seeded_family_of_boxes() {
        use rand::{Rng, SeedableRng};
        let words = ["cat", "dog", "猫", "红色的汽车", "person", "Sign in", "交通信号灯 traffic light", "x", ""];
        for seed in 0..24u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let (w, h) = [(640, 480), (200, 120), (1920, 1080), (64, 40), (3000, 700)][seed as usize % 5];
            let (wf, hf) = (w as f64, h as f64);
            let mut shapes = Vec::new();
            let label = |rng: &mut rand::rngs::StdRng| words[rng.random_range(0..words.len())].to_string();
            // Many random boxes.
            for _ in 0..rng.random_range(20..150) {
                let (x1, y1) = (rng.random_range(0.0..wf), rng.random_range(0.0..hf));
                let (x2, y2) = (rng.random_range(x1..=wf), rng.random_range(y1..=hf));
                shapes.push(labelled(Geometry::Box([x1, y1, x2, y2]), &label(&mut rng)));
            }
            // Nested boxes on one centre.
            for k in 0..12 {
                let (dx, dy) = (wf * k as f64 / 26.0, hf * k as f64 / 26.0);
                shapes.push(labelled(Geometry::Box([dx, dy, wf - dx, hf - dy]), &label(&mut rng)));
            }
            // Boxes touching each edge, along the top edge several side by side.
            for k in 0..8 {
                let x = wf * k as f64 / 10.0;
                shapes.push(labelled(Geometry::Box([x, 0.0, x + wf / 6.0, hf / 3.0]), &label(&mut rng)));
            }
            shapes.push(labelled(Geometry::Box([0.0, hf / 2.0, wf / 5.0, hf]), "left"));
            shapes.push(labelled(Geometry::Box([wf * 0.8, 0.0, wf, hf]), "right"));
            shapes.push(labelled(Geometry::Box([0.0, hf * 0.9, wf, hf]), "bottom"));
            // Identical boxes, zero-width boxes and points.
            for _ in 0..10 {
                shapes.push(labelled(Geometry::Box([wf / 4.0, hf / 4.0, wf / 2.0, hf / 2.0]), "same 同"));
            }
            shapes.push(labelled(Geometry::Box([wf / 3.0, 0.0, wf / 3.0, hf / 2.0]), "zero width"));
            shapes.push(labelled(Geometry::Point([wf, hf]), "corner"));
            shapes.push(labelled(Geometry::Point([0.0, 0.0]), "origin"));
            let rects = label_rects(&shapes, w, h);
            assert_eq!(rects.len(), shapes.len());
            let placed: Vec<Rect> = rects.iter().flatten().copied().collect();
            for (i, a) in placed.iter().enumerate() {
                assert!(a.w > 0 && a.h > 0 && a.x + a.w <= w && a.y + a.h <= h, "seed {seed}: {a:?} outside {w}x{h}");
                for b in &placed[i + 1..] {
                    assert!(!a.overlaps(b), "seed {seed} ({w}x{h}): {a:?} overlaps {b:?}");
                }
            }
            // Where the image has room for every band, every label is drawn.
            let area: u64 = shapes
                .iter()
                .map(|s| label_size(s.label.as_deref().unwrap(), w, h))
                .map(|(a, b)| a as u64 * b as u64)
                .sum();
            if area * 4 < w as u64 * h as u64 {
                assert_eq!(
                    placed.len(),
                    shapes.len(),
                    "seed {seed} ({w}x{h}): {} left out",
                    shapes.len() - placed.len()
                );
            }
            let mut img = RgbImage::from_pixel(w, h, Rgb([128, 128, 128]));
            draw(&mut img, &shapes);
            assert_bands_intact(&img, &shapes, &rects);
        }
    }

    #[test]
    fn labels_go_above_then_inside_then_stacked() {
        let (w, h) = (640, 480);
        let b = Geometry::Box([100.0, 200.0, 300.0, 400.0]);
        let top = Geometry::Box([100.0, 0.0, 300.0, 100.0]);
        let shapes = vec![labelled(b.clone(), "cat"), labelled(b.clone(), "cat"), labelled(b, "cat")];
        let r = label_rects(&shapes, w, h);
        // Above the box, then inside its top edge, then stacked nearest the first place: above it.
        assert_eq!(r[0], Some(Rect { x: 100, y: 182, w: 26, h: 18 }));
        assert_eq!(r[1], Some(Rect { x: 100, y: 200, w: 26, h: 18 }));
        assert_eq!(r[2], Some(Rect { x: 100, y: 164, w: 26, h: 18 }));
        // A box touching the top edge: inside it; a second on the same strip: stacked below.
        let r = label_rects(&[labelled(top.clone(), "a"), labelled(top, "b")], w, h);
        assert_eq!(r[0], Some(Rect { x: 100, y: 0, w: 10, h: 18 }));
        assert_eq!(r[1], Some(Rect { x: 100, y: 18, w: 10, h: 18 }));
        // A label past the right edge is moved into the image.
        let r = label_rects(&[labelled(Geometry::Box([630.0, 100.0, 640.0, 200.0]), "cat")], w, h);
        assert_eq!(r[0], Some(Rect { x: 614, y: 82, w: 26, h: 18 }));
    }

    #[test]
    fn box_edges_are_line_width_across() {
        // 1200 x 900: lines 3 px wide.
        let grey = Rgb([100, 100, 100]);
        let mut img = RgbImage::from_pixel(1200, 900, grey);
        draw(&mut img, &[PixelShape { geometry: Geometry::Box([200.0, 100.0, 800.0, 700.0]), label: None }]);
        let red = Rgb(PALETTE[0]);
        let across_row = |y: u32, xs: std::ops::Range<u32>| xs.filter(|&x| *img.get_pixel(x, y) == red).count();
        let across_col = |x: u32, ys: std::ops::Range<u32>| ys.filter(|&y| *img.get_pixel(x, y) == red).count();
        assert_eq!(line_width(1200, 900), 3);
        assert_eq!(across_row(400, 150..250), 3, "left edge");
        assert_eq!(across_row(400, 750..850), 3, "right edge");
        assert_eq!(across_col(500, 50..150), 3, "top edge");
        assert_eq!(across_col(500, 650..750), 3, "bottom edge");
        assert_eq!(*img.get_pixel(200, 400), red);
        assert_eq!(*img.get_pixel(799, 400), red);
    }

    #[test]
    fn cjk_labels_are_unifont_glyphs() {
        // The reference: the font crate's own glyph bits, each font pixel s x s, from s px inside
        // the band's corner; for 640x480 s = 1, for 1600x1500 s = 2.
        for (w, h, s) in [(640u32, 480u32, 1u32), (1600, 1500, 2)] {
            let label = "红猫 ok";
            let shapes = [labelled(Geometry::Box([100.0, 300.0, 400.0, 450.0]), label)];
            let mut img = RgbImage::from_pixel(w, h, Rgb([20, 20, 20]));
            draw(&mut img, &shapes);
            let r = label_rects(&shapes, w, h)[0].unwrap();
            assert_eq!((r.w, r.h), ((16 + 16 + 8 + 8 + 8 + 2) * s, 18 * s));
            let (band, ink) = (Rgb(PALETTE[0]), label_ink(Rgb(PALETTE[0])));
            let mut pen = 0;
            let mut inked = 0;
            for ch in label.chars() {
                let g = unifont::get_glyph(ch).unwrap();
                for gy in 0..16 {
                    for gx in 0..g.get_width() {
                        let want = if g.get_pixel(gx, gy) { ink } else { band };
                        for (dx, dy) in [(0, 0), (s - 1, 0), (0, s - 1), (s - 1, s - 1)] {
                            let (x, y) = (r.x + s + (pen + gx as u32) * s + dx, r.y + s + gy as u32 * s + dy);
                            assert_eq!(*img.get_pixel(x, y), want, "{ch:?} at {gx},{gy} ({w}x{h})");
                        }
                        inked += usize::from(want == ink);
                    }
                }
                pen += g.get_width() as u32;
            }
            assert!(inked > 100, "{inked} ink pixels");
            // Not the old '?' substitute: the two CJK glyphs differ from each other and from it.
            let q = unifont::get_glyph('?').unwrap();
            for ch in ['红', '猫'] {
                let g = unifont::get_glyph(ch).unwrap();
                assert!(g.is_fullwidth() && (0..16).any(|y| (0..8).any(|x| g.get_pixel(x, y) != q.get_pixel(x, y))));
            }
        }
        // Outside Unifont's plane: U+FFFD; controls: a blank cell.
        assert!(std::ptr::eq(label_glyph('🌊'), unifont::get_glyph('\u{FFFD}').unwrap()));
        assert!(std::ptr::eq(label_glyph('\n'), unifont::get_glyph(' ').unwrap()));
    }

    #[test]
    fn zero_width_and_zero_height_boxes_are_crosses() {
        let grey = Rgb([100, 100, 100]);
        let (red, green) = (Rgb(PALETTE[0]), Rgb(PALETTE[1]));
        let mut img = RgbImage::from_pixel(100, 100, grey);
        // A zero-width box (a vertical segment) and a zero-size one; lines 2 px wide, arms 6 px.
        let shapes = [
            PixelShape { geometry: Geometry::Box([50.0, 20.0, 50.0, 80.0]), label: None },
            PixelShape { geometry: Geometry::Box([20.0, 30.0, 20.0, 30.0]), label: None },
        ];
        draw(&mut img, &shapes);
        let mut want = RgbImage::from_pixel(100, 100, grey);
        let mut fill = |x0: u32, y0: u32, x1: u32, y1: u32, c| {
            for y in y0..y1 {
                for x in x0..x1 {
                    want.put_pixel(x, y, c);
                }
            }
        };
        fill(49, 20, 51, 80, red); // the segment
        fill(44, 49, 57, 51, red); // the cross on its centre (50, 50)
        fill(14, 29, 27, 31, green); // a cross on (20, 30)
        fill(19, 24, 21, 37, green);
        for (x, y, p) in img.enumerate_pixels() {
            assert_eq!(p, want.get_pixel(x, y), "pixel ({x}, {y})");
        }
        assert_eq!(extent(&shapes[1].geometry, 100, 100), Rect { x: 14, y: 24, w: 13, h: 13 });
    }
}
