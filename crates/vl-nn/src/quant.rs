//! Q4K quantization at load speed, byte-identical to candle's `BlockQ4K::from_float`.
//!
//! candle's quantizer allocates a scratch vector per 32-value sub-block and rounds through libm's
//! `roundf` (not inlined without SSE4.1), which made it ~70% of `vl run --quantize q4k`'s load.
//! This is the same algorithm (ggml's `make_qkx1_quants` search, 5 tries), on stack arrays, with
//! an exact branch-free round-half-away-from-zero, reading bf16/f16/f32 rows directly so no f32
//! copy of the weight is ever made. The float operations and their order are candle's, so the
//! bytes are identical for finite weights (tested against candle on random and edge-case rows).

use half::{bf16, f16};

/// Values per Q4K super-block.
pub const QK_K: usize = 256;
/// Bytes per Q4K super-block: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.
pub const Q4K_BLOCK_BYTES: usize = 2 + 2 + 12 + QK_K / 2;

/// `v.round() as i32` (half away from zero, saturating, NaN -> 0) without a libm call.
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let t = v as i32; // truncates toward zero, saturates, NaN -> 0
                      // Exact: for |v| < 2^23, v - trunc(v) is representable; above that v is an integer.
    let f = v - t as f32;
    t.saturating_add((f >= 0.5) as i32 - (f <= -0.5) as i32)
}

/// `nearest_int(v).clamp(0, hi)` for every `v` (NaN -> 0), in a form the compiler vectorizes.
#[inline(always)]
fn round_clamp(v: f32, hi: i32) -> i32 {
    let c = v.max(-1.0).min(hi as f32 + 1.0); // NaN -> -1
                                              // SAFETY: `c` is finite and within [-1, hi + 1], so it fits an i32 (a plain truncating
                                              // conversion the compiler vectorizes, unlike the saturating `as`).
    let t = unsafe { c.to_int_unchecked::<i32>() };
    let f = c - t as f32;
    (t + (f >= 0.5) as i32 - (f <= -0.5) as i32).clamp(0, hi)
}

/// Sub-blocks searched side by side, one per lane: a super-block's eight.
const LANES: usize = QK_K / 32;

/// ggml's `make_qkx1_quants` as candle writes it, (scale, -min) per 32-value sub-block, for the
/// eight sub-blocks of a super-block at once. Each lane performs exactly candle's sequence of
/// float operations on its own sub-block (the sums stay sequential within a lane, so the result
/// is bit-identical); running eight independent chains side by side is what makes it fast. A
/// lane that stops searching (no change, as candle's early `break`) keeps its values.
/// `L` lanes: the sub-blocks of `L / 8` super-blocks (`xs`), lane `8b + j` sub-block j of `xs[b]`.
#[inline(always)]
fn make_qkx1_quants_lanes<const L: usize>(nmax: i32, ntry: usize, xs: &[&[f32; QK_K]]) -> ([f32; L], [f32; L]) {
    const N: usize = 32;
    debug_assert_eq!(xs.len() * LANES, L);
    // xt[i][lane] = value i of sub-block `lane`.
    let mut xt = [[0f32; L]; N];
    for lane in 0..L {
        for i in 0..N {
            xt[i][lane] = xs[lane / LANES][(lane % LANES) * N + i];
        }
    }
    let mut active = [true; L];
    let mut min = [0f32; L];
    let mut iscale = [0f32; L];
    let mut scale = [0f32; L];
    // candle takes min/max by `total_cmp`; without NaNs that differs from a float min/max only
    // in the sign of a zero, which no later step can see (`hi == lo` and `hi - min` treat the
    // two zeros alike). Rows with NaNs quantize to other (equally meaningless) bytes than
    // candle's; nothing here is undefined for them.
    let mut lo = xt[0];
    let mut hi = xt[0];
    for row in &xt[1..] {
        for lane in 0..L {
            lo[lane] = if row[lane] < lo[lane] { row[lane] } else { lo[lane] };
            hi[lane] = if row[lane] > hi[lane] { row[lane] } else { hi[lane] };
        }
    }
    for lane in 0..L {
        let (lo, hi) = (lo[lane], hi[lane]);
        if hi == lo {
            active[lane] = false; // candle returns (0, 0)
            continue;
        }
        min[lane] = lo.min(0.);
        iscale[lane] = nmax as f32 / (hi - min[lane]);
    }
    let mut l = [[0i32; L]; N];
    for _ in 0..ntry {
        if !active.iter().any(|&a| a) {
            break;
        }
        let mut sumlx = [0f32; L];
        let mut suml2 = [0i32; L];
        let mut changed = [0i32; L];
        for i in 0..N {
            for lane in 0..L {
                let v = xt[i][lane];
                let li = round_clamp(iscale[lane] * (v - min[lane]), nmax);
                changed[lane] |= (li != l[i][lane]) as i32;
                l[i][lane] = li;
                sumlx[lane] += (v - min[lane]) * li as f32;
                suml2[lane] += li * li;
            }
        }
        let mut new_scale = [0f32; L];
        for lane in 0..L {
            new_scale[lane] = sumlx[lane] / suml2[lane] as f32;
        }
        let mut sum = [0f32; L];
        for i in 0..N {
            for lane in 0..L {
                sum[lane] += xt[i][lane] - new_scale[lane] * l[i][lane] as f32;
            }
        }
        for lane in 0..L {
            if active[lane] {
                scale[lane] = new_scale[lane];
                let mut m = sum[lane] / N as f32;
                if m > 0.0 {
                    m = 0.0;
                }
                min[lane] = m;
                iscale[lane] = 1.0 / new_scale[lane];
                if changed[lane] == 0 {
                    active[lane] = false;
                }
            }
        }
    }
    let mut neg_min = [0f32; L];
    for lane in 0..L {
        neg_min[lane] = if scale[lane] == 0.0 && min[lane] == 0.0 { 0.0 } else { -min[lane] };
    }
    (scale, neg_min)
}

fn get_scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Quantizes one super-block of 256 values into its 144 bytes (ggml's `block_q4_K` layout).
pub fn q4k_block(x: &[f32; QK_K], out: &mut [u8; Q4K_BLOCK_BYTES]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above); the function is plain Rust otherwise.
        unsafe { q4k_block_avx2(x, out) };
        return;
    }
    q4k_block_generic(x, out)
}

/// The same code compiled for AVX2 (8 lanes a register; no FMA, so no contraction changes a bit).
///
/// # Safety
/// The CPU has AVX2 (the body is `q4k_block_generic`, safe code compiled for it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q4k_block_avx2(x: &[f32; QK_K], out: &mut [u8; Q4K_BLOCK_BYTES]) {
    q4k_block_generic(x, out)
}

#[inline(always)]
fn q4k_block_generic(x: &[f32; QK_K], out: &mut [u8; Q4K_BLOCK_BYTES]) {
    let (scales, mins) = make_qkx1_quants_lanes::<LANES>(15, 5, &[x]);
    pack_block(x, &scales, &mins, out)
}

/// B super-blocks at once (L = 8 B lanes): their sub-blocks' searches side by side, each lane's
/// operations unchanged. Two (one AVX-512 register a step) or more: each lane's sums are a chain
/// of dependent adds, so several registers of lanes keep the adder busy between a chain's steps.
#[inline(always)]
fn q4k_group_generic<const B: usize, const L: usize>(x: [&[f32; QK_K]; B], out: [&mut [u8; Q4K_BLOCK_BYTES]; B]) {
    debug_assert_eq!(L, B * LANES);
    let (scales, mins) = make_qkx1_quants_lanes::<L>(15, 5, &x);
    let pick = |v: &[f32; L], b: usize| -> [f32; LANES] { std::array::from_fn(|j| v[b * LANES + j]) };
    for (b, o) in out.into_iter().enumerate() {
        pack_block(x[b], &pick(&scales, b), &pick(&mins, b), o);
    }
}

/// A super-block's d, dmin and 12 bytes of 6-bit scales and mins from its sub-blocks'
/// (scale, -min).
#[inline(always)]
fn scale_bytes(scales: &[f32; LANES], mins: &[f32; LANES]) -> (f16, f16, [u8; 12]) {
    let max_scale = scales.iter().fold(0.0f32, |max, &v| v.max(max));
    let max_min = mins.iter().fold(0.0f32, |max, &v| v.max(max));
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };

    let ls = std::array::from_fn(|j| nearest_int(inv_scale * scales[j]).min(63) as u8);
    let lm = std::array::from_fn(|j| nearest_int(inv_min * mins[j]).min(63) as u8);
    (f16::from_f32(max_scale / 63.0), f16::from_f32(max_min / 63.0), scale_min_k4(&ls, &lm))
}

/// The 12 bytes of eight 6-bit scales and mins (the inverse of `get_scale_min_k4`).
#[inline(always)]
fn scale_min_k4(ls: &[u8; LANES], lm: &[u8; LANES]) -> [u8; 12] {
    let mut sc = [0u8; 12];
    for j in 0..LANES {
        let (ls, lm) = (ls[j], lm[j]);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    sc
}

/// A super-block's bytes from its sub-blocks' (scale, -min).
#[inline(always)]
fn pack_block(x: &[f32; QK_K], scales: &[f32; LANES], mins: &[f32; LANES], out: &mut [u8; Q4K_BLOCK_BYTES]) {
    let (d, dmin, sc) = scale_bytes(scales, mins);
    let mut l = [0u8; QK_K];
    for j in 0..QK_K / 32 {
        let (s, m) = get_scale_min_k4(j, &sc);
        let dj = d.to_f32() * s as f32;
        if dj != 0.0 {
            let dm = dmin.to_f32() * m as f32;
            for ii in 0..32 {
                l[32 * j + ii] = round_clamp((x[32 * j + ii] + dm) / dj, 15) as u8;
            }
        }
    }
    out[0..2].copy_from_slice(&d.to_bits().to_le_bytes());
    out[2..4].copy_from_slice(&dmin.to_bits().to_le_bytes());
    out[4..16].copy_from_slice(&sc);
    let qs = &mut out[16..];
    for j in (0..QK_K).step_by(64) {
        for i in 0..32 {
            qs[(j / 64) * 32 + i] = l[j + i] | (l[j + i + 32] << 4);
        }
    }
}

/// A row of weights in one of the float formats checkpoints are stored in.
#[derive(Clone, Copy)]
pub enum Row<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

impl Row<'_> {
    pub fn len(&self) -> usize {
        match self {
            Row::F32(r) => r.len(),
            Row::BF16(r) => r.len(),
            Row::F16(r) => r.len(),
        }
    }

    fn block(&self, b: usize, dst: &mut [f32; QK_K]) {
        let range = b * QK_K..(b + 1) * QK_K;
        match self {
            Row::F32(r) => dst.copy_from_slice(&r[range]),
            Row::BF16(r) => {
                // A bf16 is the top half of its f32: the widening is a shift (which the compiler
                // vectorizes; `to_f32` it did not).
                for (d, s) in dst.iter_mut().zip(&r[range]) {
                    *d = f32::from_bits((s.to_bits() as u32) << 16);
                }
            }
            Row::F16(r) => {
                for (d, s) in dst.iter_mut().zip(&r[range]) {
                    *d = s.to_f32();
                }
            }
        }
    }
}

/// Quantizes a row (length a multiple of 256) into `out` (`len / 256 * 144` bytes).
pub fn q4k_row(row: Row<'_>, out: &mut [u8]) {
    assert_eq!(row.len() % QK_K, 0, "q4k_row: row length {} is not a multiple of {QK_K}", row.len());
    let blocks = row.len() / QK_K;
    assert_eq!(out.len(), blocks * Q4K_BLOCK_BYTES, "q4k_row: output size");
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512() {
        // SAFETY: the CPU has AVX-512 F (checked above); the function is plain Rust otherwise.
        unsafe { q4k_row_avx512(row, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        unsafe { q4k_row_avx2(row, out) };
        return;
    }
    let mut buf = [0f32; QK_K];
    for (b, dst) in out.chunks_exact_mut(Q4K_BLOCK_BYTES).enumerate() {
        row.block(b, &mut buf);
        q4k_block(&buf, dst.try_into().expect("144 bytes"));
    }
}

/// Super-blocks `q4k_row_avx512` quantizes at a time (`quant_avx512`, straight from the row).
/// `examples/quant_time 6144 2048` (bf16 -> Q4_K on both cores, best of 3) on a 2-vCPU Zen 4:
/// 39.3-39.9 ms with the portable loops compiled for AVX-512, 17.7-21.8 ms with `quant_avx512`.
#[cfg(target_arch = "x86_64")]
const GROUP: usize = avx512::BLOCKS;

/// `q4k_row` `GROUP` super-blocks at a time with AVX-512 intrinsics, the rest two and one at a
/// time through the portable loops. No FMA contraction (Rust makes none; the one FMA of
/// `quant_avx512` is exact), so the bytes are the same as on every other path.
///
/// # Safety
/// The CPU has AVX-512F and AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn q4k_row_avx512(row: Row<'_>, out: &mut [u8]) {
    let mut bufs = [[0f32; QK_K]; GROUP];
    let blocks = row.len() / QK_K;
    let mut b = 0;
    for dst in out.chunks_mut(GROUP * Q4K_BLOCK_BYTES) {
        let n = dst.len() / Q4K_BLOCK_BYTES;
        let mut outs = dst
            .chunks_exact_mut(Q4K_BLOCK_BYTES)
            .map(|o| <&mut [u8; Q4K_BLOCK_BYTES]>::try_from(o).expect("144 bytes"));
        let mut next = || outs.next().expect("n blocks");
        if n == GROUP {
            let at = b * QK_K..(b + GROUP) * QK_K;
            let outs = std::array::from_fn(|_| next());
            // SAFETY: the CPU has AVX-512 F (this function's contract); each source is the
            // group's GROUP * QK_K values.
            unsafe {
                match row {
                    Row::F32(r) => avx512::q4k_blocks(&r[at], outs),
                    Row::BF16(r) => avx512::q4k_blocks(&r[at], outs),
                    Row::F16(r) => avx512::q4k_blocks(&r[at], outs),
                }
            }
        } else {
            for (i, buf) in bufs.iter_mut().take(n).enumerate() {
                row.block(b + i, buf);
            }
            let mut i = 0;
            while i + 2 <= n {
                q4k_group_generic::<2, { 2 * LANES }>([&bufs[i], &bufs[i + 1]], [next(), next()]);
                i += 2;
            }
            if i < n {
                q4k_block_generic(&bufs[i], next());
            }
        }
        b += n;
    }
    debug_assert_eq!(b, blocks);
}

/// `q4k_row` four super-blocks at a time with AVX2 intrinsics (`quant_avx2`), the rest one at a
/// time through the portable loops.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn q4k_row_avx2(row: Row<'_>, out: &mut [u8]) {
    let mut bufs = [[0f32; QK_K]; avx2::BLOCKS];
    let mut b = 0;
    for dst in out.chunks_mut(avx2::BLOCKS * Q4K_BLOCK_BYTES) {
        let n = dst.len() / Q4K_BLOCK_BYTES;
        for (i, buf) in bufs.iter_mut().take(n).enumerate() {
            row.block(b + i, buf);
        }
        let mut outs = dst
            .chunks_exact_mut(Q4K_BLOCK_BYTES)
            .map(|o| <&mut [u8; Q4K_BLOCK_BYTES]>::try_from(o).expect("144 bytes"));
        if n == avx2::BLOCKS {
            // SAFETY: the CPU has AVX2 and FMA (this function's contract).
            unsafe { avx2::q4k_blocks(&bufs, std::array::from_fn(|_| outs.next().expect("n blocks"))) };
        } else {
            for (buf, o) in bufs.iter().zip(outs) {
                q4k_block_generic(buf, o);
            }
        }
        b += n;
    }
}

#[cfg(target_arch = "x86_64")]
#[path = "quant_avx512.rs"]
mod avx512;

#[cfg(target_arch = "x86_64")]
#[path = "quant_avx2.rs"]
mod avx2;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn candle_bytes(x: &[f32]) -> Vec<u8> {
        let t = Tensor::from_slice(x, (x.len() / QK_K, QK_K), &Device::Cpu).unwrap();
        QTensor::quantize(&t, GgmlDType::Q4K).unwrap().data().unwrap().into_owned()
    }

    /// `x` quantized as rows of `blocks` super-blocks (with AVX-512, rows of 8 or more take the
    /// intrinsics a group of 8 at a time and the rest the portable pairs and single blocks; rows
    /// of 1 and 3 only the portable loops).
    fn ours(x: &[f32], blocks: usize) -> Vec<u8> {
        let mut out = vec![0u8; x.len() / QK_K * Q4K_BLOCK_BYTES];
        for (r, o) in x.chunks(blocks * QK_K).zip(out.chunks_mut(blocks * Q4K_BLOCK_BYTES)) {
            q4k_row(Row::F32(r), o);
        }
        out
    }

    #[test]
    fn nearest_int_is_round_half_away() {
        let cases = [
            0.0f32,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            0.49999997,
            -0.49999997,
            14.5,
            15.499999,
            8388607.5,
            8388608.0,
            1e10,
            -1e10,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            2147483520.0,
            2147483648.0,
            -2147483648.0,
            1e-45,
            -1e-45,
        ];
        for v in cases {
            assert_eq!(nearest_int(v), v.round() as i32, "nearest_int({v:e})");
        }
        let mut s = 0x9E3779B97F4A7C15u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = f32::from_bits(s as u32);
            assert_eq!(nearest_int(v), v.round() as i32, "nearest_int({v:e})");
        }
    }

    #[test]
    fn identical_bytes_to_candle() {
        // Gaussian rows at several scales (weight-like), plus heavy-tailed outliers.
        let mut x: Vec<f32> = Vec::new();
        for scale in [1e-3f32, 0.02, 1.0, 50.0] {
            let t = crate::testing::randn(11 + scale.to_bits() as u64, scale, (16, QK_K)).unwrap();
            x.extend(t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        for (i, v) in x.iter_mut().enumerate().step_by(97) {
            *v *= if i % 2 == 0 { 40.0 } else { -40.0 };
        }
        // Edge cases: constant, all zero, one non-zero, all negative, all positive, halves.
        let mut edge = vec![0f32; 8 * QK_K];
        edge[..QK_K].fill(0.25);
        edge[2 * QK_K + 3] = -1.0;
        for (i, v) in edge[3 * QK_K..4 * QK_K].iter_mut().enumerate() {
            *v = -(i as f32) - 1.0;
        }
        for (i, v) in edge[4 * QK_K..5 * QK_K].iter_mut().enumerate() {
            *v = i as f32 * 0.5;
        }
        for (i, v) in edge[5 * QK_K..6 * QK_K].iter_mut().enumerate() {
            *v = (i % 16) as f32 - 7.5;
        }
        for (i, v) in edge[6 * QK_K..7 * QK_K].iter_mut().enumerate() {
            *v = if i % 32 == 0 { 1e-30 } else { 0.0 };
        }
        for (i, v) in edge[7 * QK_K..].iter_mut().enumerate() {
            *v = (i as f32 * 0.37).sin() * 1e4;
        }
        x.extend(edge);
        assert_eq!(x.len() % (72 * QK_K), 0);
        let want = candle_bytes(&x);
        assert_eq!(ours(&x, 1), want, "one super-block a row");
        assert_eq!(ours(&x, 3), want, "three super-blocks a row");
        // Whole groups of `GROUP`, and groups followed by pairs and a single one.
        for blocks in [8, 9, 12, 72] {
            assert_eq!(ours(&x, blocks), want, "{blocks} super-blocks a row");
        }
    }

    #[test]
    fn half_rows_quantize_as_their_f32_widening() {
        // Rows of 2 super-blocks (the pairs), 8 (one AVX-512 group, read straight from the
        // half-precision row) and 9 (a group and a single one).
        let t = crate::testing::randn(3, 0.02, (4, 18 * QK_K)).unwrap();
        let f: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<bf16> = f.iter().map(|&v| bf16::from_f32(v)).collect();
        let h: Vec<f16> = f.iter().map(|&v| f16::from_f32(v)).collect();
        let want_b = candle_bytes(&b.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
        let want_h = candle_bytes(&h.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
        for blocks in [2, 8, 9] {
            let mut got_b = vec![0u8; f.len() / QK_K * Q4K_BLOCK_BYTES];
            let mut got_h = got_b.clone();
            let (n, o) = (blocks * QK_K, blocks * Q4K_BLOCK_BYTES);
            for ((r, g), (rh, gh)) in b.chunks(n).zip(got_b.chunks_mut(o)).zip(h.chunks(n).zip(got_h.chunks_mut(o))) {
                q4k_row(Row::BF16(r), g);
                q4k_row(Row::F16(rh), gh);
            }
            assert_eq!(got_b, want_b, "bf16, {blocks} super-blocks a row");
            assert_eq!(got_h, want_h, "f16, {blocks} super-blocks a row");
        }
    }

    #[test]
    fn groups_of_mixed_sub_blocks_match_candle() {
        // Every sub-block of a group drawn differently (seeded): its own scale over 12 decades,
        // an offset that can make it all negative or all positive, some constant, some with a
        // single spike, some with ties at exact halves of a level, some whose first try meets exact halves. The lanes of one register
        // stop searching at different tries.
        let mut s = 0x2545F4914F6CDD1Du64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut x = Vec::with_capacity(64 * 8 * QK_K);
        for _ in 0..64 * 8 * 8 {
            let kind = next() % 7;
            let scale = 10f32.powi((next() % 13) as i32 - 8);
            let offset = ((next() % 5) as f32 - 2.0) * scale;
            for i in 0..32 {
                let u = (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                x.push(match kind {
                    0 => offset,
                    1 if i == (next() % 32) as usize => 50.0 * scale,
                    2 => (i as f32 * 0.5).floor() * scale * 0.25 + offset,
                    // The first try's levels land on exact halves (min 0, max 15: iscale 1).
                    3 => [0.0, 15.0].get(i).copied().unwrap_or((i % 15) as f32 + 0.5),
                    _ => u * scale + offset,
                });
            }
        }
        let want = candle_bytes(&x);
        assert_eq!(ours(&x, 8), want, "groups of 8");
        assert_eq!(ours(&x, 64), want, "rows of 64");
    }
}
