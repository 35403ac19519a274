//! Dense products with bf16 operands and f32 sums on AMX tiles (x86_64 CPUs with AMX-BF16:
//! Intel Xeon since Sapphire Rapids), for the reduced-precision path (`--vision-precision bf16`).
//!
//! The weights are rounded to bf16 once, at load, and each call's activations as they are packed
//! (both round to nearest even, as torch's `.to(torch.bfloat16)`); the tiles multiply the bf16
//! values exactly and sum in f32. The error is bf16's rounding of the operands (2^-9 of a value,
//! relative), not the sums'.
//!
//! Why AMX and not AVX512-BF16: on this project's Xeon, `vdpbf16ps` (32 bf16 products a vector)
//! issues once every two cycles against two f32 FMAs a cycle, so it is no faster than f32; one
//! thread's `tdpbf16ps` tiles ran 784 x 1024 by 1024 x 3072 at ~570 GFLOP/s against ~200 for
//! `gemm`'s f32 kernels (docs/performance.md has the measurements).
//!
//! Layouts (a "pair" is two bf16 of consecutive input features in one u32, the even feature in
//! the low half: the VNNI layout `tdpbf16ps` reads its second operand in):
//! - weights `W` [out, in] as panels `[ceil(out / 32)][kp][32]` pairs, `kp` = in rounded up to
//!   `KSTEP`, halved: panel p holds output columns 32p..32p+32 (zero-padded);
//! - activations, per call, rounded to bf16 in tile order: groups of 16 rows, each group's
//!   32-feature steps one after another, each step 16 rows x 64 contiguous bytes (`[rows / 16]
//!   [in / 32][16][32]`, zero-padded to 32 rows and KSTEP features). A tile loaded from
//!   row-major rows (a 2-8 KiB stride) took 16 lines of two L1 sets; contiguous, the linears ran
//!   10-20% faster.
//!
//! A block of 32 rows x 32 columns keeps its f32 sums in four 16 x 16 tiles; each step of 32 input
//! features loads two 16-row tiles of activations and two 16-column tiles of the panel and issues
//! four tile products. A tile's rows are taken `ROW_BLOCK` at a time, so their bf16 rows stay in
//! L2 while every panel of the tile passes over them.

/// Output columns per panel: two 16-column tiles.
pub const NR: usize = 32;
/// Rows per block: two 16-row tiles.
pub const MR: usize = 32;
/// Input features per tile step (64 bytes of bf16, a tile row).
pub const KSTEP: usize = 32;
/// Rows of a tile swept by each panel before the next rows (128 rows of 4096 features: 1 MiB).
#[cfg(target_arch = "x86_64")]
const ROW_BLOCK: usize = 128;

/// Whether this CPU and OS run the tiles: x86_64 with AMX-TILE, AMX-BF16, AVX-512 F/BW/VL and
/// AVX512-BF16 (the activations' rounding), and on Linux the tile state granted to this process
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once). False in the AVX2 stand-in build.
pub fn available() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| {
            if !crate::has_avx512()
                || !std::arch::is_x86_feature_detected!("avx512bw")
                || !std::arch::is_x86_feature_detected!("avx512vl")
                || !std::arch::is_x86_feature_detected!("avx512bf16")
            {
                return false;
            }
            // CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE (`is_x86_feature_detected!`
            // does not take the AMX names on stable Rust).
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain system call with integer arguments; it fails cleanly (non-zero)
            // where the kernel does not grant the tile state.
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        })
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        false
    }
}

/// The float types weights arrive in (exact widening to f32).
pub trait Float: Copy + Send + Sync {
    /// `src` widened into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
}
impl Float for f32 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}
impl Float for half::f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}
impl Float for half::bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

/// bf16 bits of `v`, rounded to nearest even (NaN stays NaN).
pub fn round(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

/// Pairs per panel row for `k` input features.
fn pairs(k: usize) -> usize {
    k.next_multiple_of(KSTEP) / 2
}

/// `u32`s of the panels of an `n` x `k` weight.
pub fn packed_weight_len(n: usize, k: usize) -> usize {
    n.div_ceil(NR) * pairs(k) * NR
}

/// The panels' shape (panels, pair rows, columns) for an `n` x `k` weight.
pub fn packed_weight_shape(n: usize, k: usize) -> (usize, usize, usize) {
    (n.div_ceil(NR), pairs(k), NR)
}

/// `W^T` ([k, n] row-major, how `Dense` keeps its weights) as panels of pairs (layout above),
/// rounded to bf16: each pair row of a panel is two contiguous runs of `W^T`. Parallel over panels on candle's pool.
pub fn pack_weights_t<T: Float>(wt: &[T], n: usize, k: usize) -> Vec<u32> {
    assert!(wt.len() >= n * k, "pack_weights_t: {} floats for {k} x {n}", wt.len());
    let kp = pairs(k);
    let len = packed_weight_len(n, k);
    // Not zeroed first: every u32 (padding included) is written once below, by the thread that
    // owns its panel, so the new pages are faulted in by every thread.
    let mut dst: Vec<u32> = Vec::with_capacity(len);
    let ptr = crate::kernels::SendPtr(dst.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(NR), |range| {
        for p in range {
            let (c0, cols) = (p * NR, NR.min(n - p * NR));
            let (mut wide, mut bits) = ([0f32; 2 * NR], [0u16; 2 * NR]);
            for i in 0..kp {
                let mut row = [0u32; NR];
                if 2 * i < k {
                    // The pair row's even and odd features side by side, widened, then rounded
                    // (vectors where the CPU has them), then interleaved into pairs.
                    T::widen(&wt[2 * i * n + c0..][..cols], &mut wide[..cols]);
                    if 2 * i + 1 < k {
                        T::widen(&wt[(2 * i + 1) * n + c0..][..cols], &mut wide[NR..NR + cols]);
                    } else {
                        wide[NR..].fill(0.0);
                    }
                    round_row(&wide, &mut bits);
                    for (c, o) in row[..cols].iter_mut().enumerate() {
                        *o = bits[c] as u32 | (bits[NR + c] as u32) << 16;
                    }
                }
                // SAFETY: panel p's pair rows belong to this work item, inside the capacity.
                unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), ptr.get().add((p * kp + i) * NR), NR) };
            }
        }
    });
    // SAFETY: the panels cover all `len` values, each written once above.
    unsafe { dst.set_len(len) };
    dst
}

/// `x`: `rows` rows of `k` features into `dst` (refilled) as bf16 tiles (layout above), rounded
/// to nearest even. Parallel over blocks of rows on candle's pool.
pub fn pack_rows(x: &[f32], rows: usize, k: usize, dst: &mut Vec<u16>) {
    assert!(x.len() >= rows * k, "pack_rows: {} floats for {rows} rows of {k}", x.len());
    let kpad = k.next_multiple_of(KSTEP);
    let padded = rows.next_multiple_of(MR);
    let steps = kpad / KSTEP;
    dst.clear();
    dst.resize(padded * kpad, 0);
    let ptr = crate::kernels::SendPtr(dst.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(rows.div_ceil(MR), |range| {
        let mut bits = vec![0u16; kpad];
        for b in range {
            for r in b * MR..rows.min((b + 1) * MR) {
                round_row(&x[r * k..][..k], &mut bits[..k]);
                // Row r's 32-feature steps go to its row of each of its 16-row group's tiles.
                let base = (r / TILE_ROWS) * steps * TILE_ROWS * KSTEP + (r % TILE_ROWS) * KSTEP;
                for (st, chunk) in bits.chunks_exact(KSTEP).enumerate() {
                    // SAFETY: row r's slots of its group's tiles belong to this item (its block
                    // of 32 rows), inside `dst` (padded rows x kpad).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            chunk.as_ptr(),
                            ptr.get().add(base + st * TILE_ROWS * KSTEP),
                            KSTEP,
                        )
                    };
                }
            }
        }
    });
}

/// Rows of an activation (and output) tile.
const TILE_ROWS: usize = 16;

/// `src` rounded to bf16 bits into `dst` (same length).
fn round_row(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx512()
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512bf16")
    {
        // SAFETY: AVX-512 F/BW/VL and AVX512-BF16 checked just above.
        return unsafe { x86::round_row(src, dst) };
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = round(s);
    }
}

/// Rows r0..r1 (r0 a multiple of `MR`), columns c0..c1 (c0 a multiple of `NR`) of `y = x W^T +
/// b`: `rows` packed by `pack_rows`, `panels` by `pack_weights_t` (`k` input features), `y` with
/// row stride `n`, `bias` (n values) added to the sums.
///
/// # Safety
/// `available()` must be true; `y` must have room for r1 rows of `n` and this tile must be
/// written by no one else meanwhile; `rows` must hold r1's block of rows, `panels` c1's panel.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn tile(
    rows: &[u16],
    k: usize,
    panels: &[u32],
    n: usize,
    bias: Option<&[f32]>,
    y: *mut f32,
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
) {
    let (kpad, kp) = (k.next_multiple_of(KSTEP), pairs(k));
    assert!(r0 % MR == 0 && c0 % NR == 0 && r1 > r0 && c1 > c0 && c1 <= n, "bf16::tile {r0}..{r1} x {c0}..{c1}");
    assert!(rows.len() >= r1.next_multiple_of(MR) * kpad && panels.len() >= c1.div_ceil(NR) * kp * NR);
    x86::configure();
    let mut sums = x86::Sums([0.0; 4 * 256]);
    for b0 in (r0..r1).step_by(ROW_BLOCK) {
        let b1 = r1.min(b0 + ROW_BLOCK);
        for c in (c0..c1).step_by(NR) {
            let w = panels.as_ptr().add(c / NR * kp * NR);
            for r in (b0..b1).step_by(MR) {
                x86::block(rows.as_ptr().add(r * kpad), kpad, w, &mut sums);
                // (Rows r..r+32 are groups r/16 and r/16 + 1: contiguous, 16 x kpad each.)
                x86::write(&sums, bias.map(|b| b.as_ptr().add(c)), y.add(r * n + c), n, MR.min(b1 - r), NR.min(c1 - c));
            }
        }
    }
    x86::release();
}

/// Head dimension the tile attention takes (`attention::available`): one 32-feature step pair
/// for the scores, four 16-column output tiles.
pub const ATTENTION_HEAD_DIM: usize = 64;

/// The attention core on AMX tiles (`--vision-precision bf16`): the scores `Q K^T` and the
/// product `P V` with bf16 operands and f32 sums; the online softmax in f32 on the scores, its
/// probabilities rounded to bf16 for `P V`. Keys and values are packed once per call for every
/// head (`pack_keys`, `pack_values`), the queries per tile.
pub mod attention {
    use super::{round_row, ATTENTION_HEAD_DIM as D, KSTEP};

    /// Keys per tile step (two 16-key score tiles).
    const KEYS: usize = 32;

    /// Whether the tile attention runs for head dimension `d` on this CPU.
    pub fn available(d: usize) -> bool {
        d == D && super::available()
    }

    /// Positions rounded up to whole 32-key steps.
    pub fn padded(seq: usize) -> usize {
        seq.next_multiple_of(KEYS)
    }

    /// `k` ([heads, seq, D] f32, head-major) as score-product operands: per head, per 16-key
    /// group, per 32-feature step, a 16 x 16 tile of pairs (row p: features 2p, 2p+1 of each of
    /// the 16 keys). Keys past `seq` are zero.
    pub fn pack_keys(k: &[f32], heads: usize, seq: usize) -> Vec<u32> {
        let sp = padded(seq);
        let steps = D / KSTEP;
        let mut dst = vec![0u32; heads * sp * D / 2];
        let ptr = crate::kernels::SendPtr(dst.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(heads * sp / 16, |range| {
            let mut bits = [0u16; D];
            for item in range {
                let (h, g) = (item / (sp / 16), item % (sp / 16));
                for j in 0..16 {
                    let key = g * 16 + j;
                    if key >= seq {
                        break;
                    }
                    round_row(&k[(h * seq + key) * D..][..D], &mut bits);
                    for st in 0..steps {
                        for p in 0..16 {
                            let i = st * KSTEP + 2 * p;
                            let v = bits[i] as u32 | (bits[i + 1] as u32) << 16;
                            // SAFETY: head h's group g (16 x D / 2 pairs) belongs to this item.
                            unsafe { ptr.get().add((((h * sp / 16 + g) * steps + st) * 16 + p) * 16 + j).write(v) };
                        }
                    }
                }
            }
        });
        dst
    }

    /// The values (key `j` of head `h` at `v[j * v_rs + h * D..]`, f32) as `P V` operands: per
    /// head, per 32-key step, per 16-column group, a 16 x 16 tile of pairs (row p: keys 2p, 2p+1
    /// of each column). Keys past `seq` are zero.
    pub fn pack_values(v: &[f32], v_rs: usize, heads: usize, seq: usize) -> Vec<u32> {
        let sp = padded(seq);
        let groups = D / 16;
        let mut dst = vec![0u32; heads * sp * D / 2];
        let ptr = crate::kernels::SendPtr(dst.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(heads * sp / KEYS, |range| {
            let mut bits = [[0u16; D]; 2];
            for item in range {
                let (h, st) = (item / (sp / KEYS), item % (sp / KEYS));
                for p in 0..16 {
                    for (e, b) in bits.iter_mut().enumerate() {
                        let key = st * KEYS + 2 * p + e;
                        if key < seq {
                            round_row(&v[key * v_rs + h * D..][..D], b);
                        } else {
                            b.fill(0);
                        }
                    }
                    for g in 0..groups {
                        for c in 0..16 {
                            let col = g * 16 + c;
                            let val = bits[0][col] as u32 | (bits[1][col] as u32) << 16;
                            // SAFETY: head h's step st (D / 2 x 32 pairs) belongs to this item.
                            unsafe {
                                ptr.get().add((((h * sp / KEYS + st) * groups + g) * 16 + p) * 16 + c).write(val)
                            };
                        }
                    }
                }
            }
        });
        dst
    }

    /// Per-thread buffers of `attend`.
    pub struct Scratch {
        s: Vec<f32>,
        p: Vec<u16>,
        q: Vec<u16>,
        o: Vec<f32>,
        max: Vec<f32>,
        sum: Vec<f32>,
    }

    impl Scratch {
        /// For tiles of at most `rows` queries and `keys` keys.
        pub fn new(rows: usize, keys: usize) -> Self {
            let (m, n) = (rows.next_multiple_of(32), keys.next_multiple_of(KEYS) + KEYS);
            Self {
                s: vec![0.0; m * n],
                p: vec![0; m * n],
                q: vec![0; m * D],
                o: vec![0.0; m * D],
                max: vec![0.0; m],
                sum: vec![0.0; m],
            }
        }
    }

    /// Where one work item's operands lie.
    pub struct Tile<'a> {
        /// Rotated, pre-scaled queries transposed per head: feature i of query s of head h at
        /// `q[(h * D + i) * ldq + s]` (scores in base 2).
        pub q: &'a [f32],
        pub ldq: usize,
        /// `pack_keys`, `pack_values` of this call.
        pub keys: &'a [u32],
        pub values: &'a [u32],
        pub seq: usize,
        pub h: usize,
        /// The segment's keys.
        pub s0: usize,
        pub s1: usize,
        /// The tile's queries.
        pub q0: usize,
        pub rows: usize,
        /// Keys per score tile (rounded to 32).
        pub key_tile: usize,
    }

    /// Softmax(q k^T) v for the tile's queries over its segment's keys, normalized, into
    /// `out` (query r's D values at `out + r * out_stride`).
    ///
    /// # Safety
    /// `available(D)`; `sc` made for at least these rows and key tile; those rows of `out` are
    /// the caller's to write; the operands as documented on `Tile`.
    #[cfg(target_arch = "x86_64")]
    pub unsafe fn attend(t: &Tile<'_>, sc: &mut Scratch, out: *mut f32, out_stride: usize) {
        use super::x86;
        let m = t.rows.next_multiple_of(32);
        let steps = D / KSTEP;
        // The queries as bf16 activation tiles ([m / 16][steps][16][32]), padded rows zero.
        sc.q[..m * D].fill(0);
        let mut col = [0f32; D];
        let mut bits = [0u16; D];
        for r in 0..t.rows {
            for (i, c) in col.iter_mut().enumerate() {
                *c = t.q[(t.h * D + i) * t.ldq + t.q0 + r];
            }
            round_row(&col, &mut bits);
            for st in 0..steps {
                let at = ((r / 16) * steps + st) * 512 + (r % 16) * KSTEP;
                sc.q[at..at + KSTEP].copy_from_slice(&bits[st * KSTEP..][..KSTEP]);
            }
        }
        sc.o[..m * D].fill(0.0);
        sc.max[..m].fill(f32::NEG_INFINITY);
        sc.sum[..m].fill(0.0);
        let sp = padded(t.seq);
        let (first, end) = (t.s0 / KEYS * KEYS, t.s1.next_multiple_of(KEYS));
        let width = t.key_tile.next_multiple_of(KEYS).max(KEYS);
        x86::configure();
        let mut k0 = first;
        while k0 < end {
            let n = width.min(end - k0);
            // S = Q K^T, row-major [m][n].
            let kbase = t.keys.as_ptr().add((t.h * sp / 16 + k0 / 16) * steps * 256);
            for r in (0..m).step_by(32) {
                for j in (0..n).step_by(KEYS) {
                    let a = sc.q.as_ptr().add((r / 16) * steps * 512);
                    let b = kbase.add((j / 16) * steps * 256);
                    x86::scores(a, steps, b, sc.s.as_mut_ptr().add(r * n + j), n);
                }
            }
            // The online softmax on each query's row; the probabilities into `P` tiles.
            let (lo, hi) = (t.s0.saturating_sub(k0), (t.s1 - k0).min(n));
            for r in 0..m {
                let row = &mut sc.s[r * n..(r + 1) * n];
                let p_at = |j: usize| ((r / 16) * (n / KEYS) + j / KEYS) * 512 + (r % 16) * KEYS + j % KEYS;
                if r >= t.rows {
                    for j in (0..n).step_by(KEYS) {
                        let at = p_at(j);
                        sc.p[at..at + KEYS].fill(0);
                    }
                    continue;
                }
                let (new_max, acc) = x86::softmax_row(row, lo, hi, sc.max[r], &mut sc.p, &p_at);
                if sc.max[r] == f32::NEG_INFINITY {
                    sc.sum[r] = acc;
                } else {
                    let f = crate::kernels::exp2_nonpositive(sc.max[r] - new_max);
                    sc.sum[r] = sc.sum[r] * f + acc;
                    for y in &mut sc.o[r * D..(r + 1) * D] {
                        *y *= f;
                    }
                }
                sc.max[r] = new_max;
            }
            // O += P V.
            let vbase = t.values.as_ptr().add((t.h * sp / KEYS + k0 / KEYS) * (D / 16) * 256);
            for r in (0..m).step_by(16) {
                x86::values(
                    sc.p.as_ptr().add((r / 16) * (n / KEYS) * 512),
                    n / KEYS,
                    vbase,
                    sc.o.as_mut_ptr().add(r * D),
                );
            }
            k0 += n;
        }
        x86::release();
        for r in 0..t.rows {
            let inv = 1.0 / sc.sum[r];
            let dst = std::slice::from_raw_parts_mut(out.add(r * out_stride), D);
            for (y, x) in dst.iter_mut().zip(&sc.o[r * D..(r + 1) * D]) {
                *y = x * inv;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// Four 16 x 16 tiles of f32 sums (rows 0-15 x columns 0-15, 0-15 x 16-31, 16-31 x 0-15,
    /// 16-31 x 16-31), 64-byte aligned.
    #[repr(C, align(64))]
    pub(super) struct Sums(pub(super) [f32; 4 * 256]);

    /// The tile configuration (palette 1): tmm0-3 sums, tmm4-5 activations, tmm6-7 weights,
    /// each 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct Config {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        bytes_per_row: [u16; 16],
        rows: [u8; 16],
    }

    /// Loads the tile configuration on this thread (each call: other code on the thread, e.g.
    /// candle's AMX kernels, may have loaded its own).
    pub(super) fn configure() {
        let mut c = Config { palette: 1, start_row: 0, reserved: [0; 14], bytes_per_row: [0; 16], rows: [0; 16] };
        for t in 0..8 {
            c.bytes_per_row[t] = 64;
            c.rows[t] = 16;
        }
        // SAFETY: only called where `available()` holds; a valid palette-1 configuration.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &c, options(nostack, readonly)) };
    }

    /// Returns the tile state to its initial one (nothing to save on a context switch).
    pub(super) fn release() {
        // SAFETY: AMX present (as for `configure`).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// The sums of 32 activation rows at `a` (`kpad` bf16 each) against a panel at `w` (`kpad /
    /// 2` rows of 32 pairs), into `sums`.
    ///
    /// # Safety
    /// The tiles configured on this thread (`configure`); `a` and `w` readable for those sizes.
    pub(super) unsafe fn block(a: *const u16, kpad: usize, w: *const u32, sums: &mut Sums) {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        // Group 0 (rows 0-15) at `a`, group 1 at `a + 16 kpad`; each 32-feature step's tile is
        // 16 rows of 64 contiguous bytes.
        let a_stride = super::KSTEP * 2;
        let mut k = 0;
        while k < kpad {
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm6, [{w} + {sw}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{w} + {sw}*1 + 64]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a.add(k * 16),
                a1 = in(reg) a.add(16 * kpad + k * 16),
                w = in(reg) w.add(k / 2 * super::NR),
                sa = in(reg) a_stride,
                sw = in(reg) super::NR * 4,
                options(nostack, readonly),
            );
            k += super::KSTEP;
        }
        asm!(
            "tilestored [{s} + {st}*1], tmm0",
            "tilestored [{s} + {st}*1 + 1024], tmm1",
            "tilestored [{s} + {st}*1 + 2048], tmm2",
            "tilestored [{s} + {st}*1 + 3072], tmm3",
            s = in(reg) sums.0.as_mut_ptr(),
            st = in(reg) 64usize,
            options(nostack),
        );
    }

    /// Four 16 x 16 score tiles: 32 query rows (activation tiles at `a`, `steps` 32-feature
    /// steps per 16-row group) against 32 keys (key tiles at `b`, `steps` per 16-key group), into
    /// `s` (row stride `n` floats).
    ///
    /// # Safety
    /// Tiles configured on this thread; the operands readable, `s` writable for 32 rows.
    pub(super) unsafe fn scores(a: *const u16, steps: usize, b: *const u32, s: *mut f32, n: usize) {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        for st in 0..steps {
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a.add(st * 512),
                a1 = in(reg) a.add((steps + st) * 512),
                b0 = in(reg) b.add(st * 256),
                b1 = in(reg) b.add((steps + st) * 256),
                sa = in(reg) 64usize,
                sb = in(reg) 64usize,
                options(nostack, readonly),
            );
        }
        asm!(
            "tilestored [{s0} + {st}*1], tmm0",
            "tilestored [{s0} + {st}*1 + 64], tmm1",
            "tilestored [{s1} + {st}*1], tmm2",
            "tilestored [{s1} + {st}*1 + 64], tmm3",
            s0 = in(reg) s,
            s1 = in(reg) s.add(16 * n),
            st = in(reg) n * 4,
            options(nostack),
        );
    }

    /// `o` (16 rows of 64 f32) += 16 rows of probabilities (`key_steps` activation tiles at `p`)
    /// times the values (`key_steps` x 4 tiles at `v`).
    ///
    /// # Safety
    /// As `scores`.
    pub(super) unsafe fn values(p: *const u16, key_steps: usize, v: *const u32, o: *mut f32) {
        asm!(
            "tileloadd tmm0, [{o} + {so}*1]",
            "tileloadd tmm1, [{o} + {so}*1 + 64]",
            "tileloadd tmm2, [{o} + {so}*1 + 128]",
            "tileloadd tmm3, [{o} + {so}*1 + 192]",
            o = in(reg) o,
            so = in(reg) 256usize,
            options(nostack, readonly),
        );
        for st in 0..key_steps {
            asm!(
                "tileloadd tmm4, [{p} + {s}*1]",
                "tileloadd tmm5, [{v} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm5",
                "tileloadd tmm6, [{v} + {s}*1 + 1024]",
                "tdpbf16ps tmm1, tmm4, tmm6",
                "tileloadd tmm7, [{v} + {s}*1 + 2048]",
                "tdpbf16ps tmm2, tmm4, tmm7",
                "tileloadd tmm5, [{v} + {s}*1 + 3072]",
                "tdpbf16ps tmm3, tmm4, tmm5",
                p = in(reg) p.add(st * 512),
                v = in(reg) v.add(st * 4 * 256),
                s = in(reg) 64usize,
                options(nostack, readonly),
            );
        }
        asm!(
            "tilestored [{o} + {so}*1], tmm0",
            "tilestored [{o} + {so}*1 + 64], tmm1",
            "tilestored [{o} + {so}*1 + 128], tmm2",
            "tilestored [{o} + {so}*1 + 192], tmm3",
            o = in(reg) o,
            so = in(reg) 256usize,
            options(nostack),
        );
    }

    /// One query's online-softmax step over a score row (`row`, base 2): keys `lo..hi` are its
    /// segment's, the others get probability 0. Returns the new running max (at least `max`)
    /// and the sum of the new probabilities; writes them, rounded to bf16, where `p_at(j)` says
    /// (32 consecutive keys contiguous).
    #[cfg(not(vl_avx2_proxy))]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn softmax_row(
        row: &[f32],
        lo: usize,
        hi: usize,
        max: f32,
        p: &mut [u16],
        p_at: &dyn Fn(usize) -> usize,
    ) -> (f32, f32) {
        let n = row.len();
        let mask = |j: usize| -> __mmask16 {
            let (a, b) = (lo.saturating_sub(j).min(16), hi.saturating_sub(j).min(16));
            if b <= a {
                0
            } else {
                (((1u32 << b) - 1) & !((1u32 << a) - 1)) as u16
            }
        };
        let mut mx = _mm512_set1_ps(max);
        for j in (0..n).step_by(16) {
            let k = mask(j);
            mx = _mm512_mask_max_ps(mx, k, mx, _mm512_loadu_ps(row.as_ptr().add(j)));
        }
        let new_max = _mm512_reduce_max_ps(mx);
        let m = _mm512_set1_ps(new_max);
        let mut acc = _mm512_setzero_ps();
        for j in (0..n).step_by(16) {
            let k = mask(j);
            let e = crate::avx512::exp2(_mm512_sub_ps(_mm512_loadu_ps(row.as_ptr().add(j)), m));
            let e = _mm512_maskz_mov_ps(k, e);
            acc = _mm512_add_ps(acc, e);
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(e));
            _mm256_storeu_si256(p.as_mut_ptr().add(p_at(j)) as *mut __m256i, h);
        }
        (new_max, _mm512_reduce_add_ps(acc))
    }

    /// The AVX2 stand-in build has no AVX-512 code (`available()` is false there).
    #[cfg(vl_avx2_proxy)]
    pub(super) unsafe fn softmax_row(
        _row: &[f32],
        _lo: usize,
        _hi: usize,
        _max: f32,
        _p: &mut [u16],
        _p_at: &dyn Fn(usize) -> usize,
    ) -> (f32, f32) {
        unreachable!("no tile attention in the AVX2 stand-in build")
    }

    /// `rows` x `cols` of `sums` (plus the bias at the block's first column) into `y` (row
    /// stride `ldy`).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn write(
        sums: &Sums,
        bias: Option<*const f32>,
        y: *mut f32,
        ldy: usize,
        rows: usize,
        cols: usize,
    ) {
        let lo: __mmask16 = if cols >= 16 { 0xffff } else { (1u16 << cols) - 1 };
        let hi: __mmask16 = if cols >= 32 {
            0xffff
        } else if cols > 16 {
            (1u16 << (cols - 16)) - 1
        } else {
            0
        };
        let (b0, b1) = match bias {
            Some(b) => (_mm512_maskz_loadu_ps(lo, b), _mm512_maskz_loadu_ps(hi, b.add(16))),
            None => (_mm512_setzero_ps(), _mm512_setzero_ps()),
        };
        for r in 0..rows {
            let t = (r / 16) * 2;
            let s = sums.0.as_ptr().add(t * 256 + (r % 16) * 16);
            let out = y.add(r * ldy);
            _mm512_mask_storeu_ps(out, lo, _mm512_add_ps(_mm512_load_ps(s), b0));
            if hi != 0 {
                _mm512_mask_storeu_ps(out.add(16), hi, _mm512_add_ps(_mm512_load_ps(s.add(256)), b1));
            }
        }
    }

    /// `src` to bf16 bits, 16 at a time (`vcvtneps2bf16`, round to nearest even).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn round_row(src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i < n {
            let m: __mmask16 = if n - i >= 16 { 0xffff } else { (1u16 << (n - i)) - 1 };
            let v = _mm512_maskz_loadu_ps(m, src.as_ptr().add(i));
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i) as *mut i16, m, h);
            i += 16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The panels from `W` [n, k] row-major, scattered value by value: the reference layout
    /// `pack_weights_t` must produce.
    fn pack_weights(w: &[f32], n: usize, k: usize) -> Vec<u32> {
        assert!(w.len() >= n * k, "pack_weights: {} floats for {n} x {k}", w.len());
        let kp = pairs(k);
        let mut dst = vec![0u32; packed_weight_len(n, k)];
        let ptr = crate::kernels::SendPtr(dst.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(NR), |range| {
            for p in range {
                for c in 0..NR.min(n - p * NR) {
                    let row = &w[(p * NR + c) * k..][..k];
                    for (i, pair) in row.chunks(2).enumerate() {
                        let hi = pair.get(1).map_or(0, |&v| round(v));
                        let v = round(pair[0]) as u32 | (hi as u32) << 16;
                        // SAFETY: panel p's pairs belong to this work item, inside `dst`.
                        unsafe { ptr.get().add((p * kp + i) * NR + c).write(v) };
                    }
                }
            }
        });
        dst
    }

    /// Element (`out` column `c`, input feature `i`) of packed panels, as f32 (for unpacking).
    fn weight_at(panels: &[u32], k: usize, c: usize, i: usize) -> f32 {
        let v = panels[((c / NR) * pairs(k) + i / 2) * NR + c % NR];
        half::bf16::from_bits((v >> (16 * (i % 2))) as u16).to_f32()
    }

    fn rand(seed: u64, std: f32, len: usize) -> Vec<f32> {
        crate::testing::randn(seed, std, len).unwrap().to_vec1().unwrap()
    }

    /// The product of the bf16-rounded operands in f64, as the kernel's exact target.
    fn reference(x: &[f32], w: &[f32], bias: Option<&[f32]>, m: usize, n: usize, k: usize) -> Vec<f64> {
        let r = |v: f32| half::bf16::from_f32(v).to_f64();
        let mut y = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|t| r(x[i * k + t]) * r(w[j * k + t])).sum();
                y[i * n + j] = s + bias.map_or(0.0, |b| b[j] as f64);
            }
        }
        y
    }

    #[test]
    fn rounding_is_to_nearest_even_in_the_scalar_and_vector_paths() {
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0); a hair
        // above goes up; NaN stays NaN.
        let src = [1.0 + 2f32.powi(-8), 1.0 + 2f32.powi(-8) + 2f32.powi(-20), -3.0, f32::NAN];
        let want = [0x3f80u16, 0x3f81, 0xc040];
        let mut got = [0u16; 4];
        round_row(&src, &mut got);
        assert_eq!(&got[..3], &want);
        assert!(half::bf16::from_bits(got[3]).is_nan());
        for (s, w) in src.iter().zip(want) {
            assert_eq!(round(*s), w);
        }
    }

    #[test]
    fn packed_weights_unpack_to_the_rounded_values() {
        let (n, k) = (37, 7);
        let w = rand(3, 1.0, n * k);
        let p = pack_weights(&w, n, k);
        let wt: Vec<f32> = (0..k * n).map(|j| w[(j % n) * k + j / n]).collect();
        assert_eq!(pack_weights_t(&wt, n, k), p);
        for c in 0..n {
            for i in 0..k {
                assert_eq!(weight_at(&p, k, c, i), half::bf16::from_f32(w[c * k + i]).to_f32());
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn tiles_equal_the_rounded_operands_product() {
        // The activations' tile layout, on every CPU: row r's feature i at its group's step tile.
        let (m, k) = (45, 70);
        let x = rand(10, 1.0, m * k);
        let mut rows: Vec<u16> = Vec::new();
        pack_rows(&x, m, k, &mut rows);
        let kpad = k.next_multiple_of(KSTEP);
        assert_eq!(rows.len(), m.next_multiple_of(MR) * kpad);
        for r in 0..m.next_multiple_of(MR) {
            for i in 0..kpad {
                let want = if r < m && i < k { round(x[r * k + i]) } else { 0 };
                let at = ((r / 16) * (kpad / KSTEP) + i / KSTEP) * 16 * KSTEP + (r % 16) * KSTEP + i % KSTEP;
                assert_eq!(rows[at], want, "row {r} feature {i}");
            }
        }
        if !available() {
            // No tiles here: the layer refuses the path (tested in linear.rs).
            return;
        }
        // Ragged in every direction: rows not a multiple of 32 and more than one row block,
        // columns not of 32, features odd; tiles split mid-matrix.
        for &(m, n, k) in &[(1, 1, 1), (13, 33, 5), (45, 70, 301), (300, 64, 67)] {
            let x = rand(11, 1.0, m * k);
            let w = rand(12, 0.5, n * k);
            let bias = rand(13, 1.0, n);
            let panels = pack_weights(&w, n, k);
            let mut rows: Vec<u16> = Vec::new();
            pack_rows(&x, m, k, &mut rows);
            for bias in [None, Some(&bias[..])] {
                let want = reference(&x, &w, bias, m, n, k);
                let mut y = vec![f32::NAN; m * n];
                let rm = (m.div_ceil(2)).next_multiple_of(MR).min(m);
                let cm = (n.div_ceil(2)).next_multiple_of(NR).min(n);
                for (rr, cc) in [((0, rm), (0, cm)), ((0, rm), (cm, n)), ((rm, m), (0, cm)), ((rm, m), (cm, n))] {
                    if rr.0 < rr.1 && cc.0 < cc.1 {
                        // SAFETY: available() checked; disjoint tiles of an m x n output.
                        unsafe { tile(&rows, k, &panels, n, bias, y.as_mut_ptr(), rr, cc) };
                    }
                }
                for (i, (&g, &e)) in y.iter().zip(&want).enumerate() {
                    // f32 sums of exact products: relative to the sum of magnitudes.
                    let scale: f64 = 1.0 + (k as f64).sqrt();
                    assert!(
                        (g as f64 - e).abs() <= 1e-5 * scale,
                        "{m}x{n}x{k} bias {} at {i}: {g} vs {e}",
                        bias.is_some()
                    );
                }
            }
        }
    }
}
