//! Dense products (and the segment attention's two products) with bf16 operands and f32 sums on AMX tiles (x86_64 CPUs with AMX-BF16:
//! Intel Xeon since Sapphire Rapids), for the reduced-precision path (`--vision-precision bf16`);
//! on CPUs with AVX512-BF16 and no AMX (AMD Zen 4 and Zen 5), the dense products with
//! `vdpbf16ps` on the same operands (`dpbf16`) and the attention in f32.
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
//!
//! Modules: `config` (the tile configuration and state: `ldtilecfg`, `tilerelease`), `pack`
//! (bf16 rounding, the weights' panels and the activations' tiles), `matmul` (a dense product's
//! output tile), `attention` (the segment attention's core on tiles). Whether the CPU and OS run
//! them is `crate::cpu::amx_bf16`, re-exported here as `available`.

pub(crate) mod attention;
#[cfg(target_arch = "x86_64")]
mod config;
pub(crate) mod dpbf16;
#[cfg(target_arch = "x86_64")]
mod matmul;
mod pack;

pub(crate) use crate::cpu::amx_bf16 as available;
#[cfg(target_arch = "x86_64")]
pub(crate) use matmul::tile;
pub(crate) use pack::{pack_rows, pack_weights_t, packed_weight_shape};

/// Whether this CPU runs the dense bf16 products: on AMX tiles, else with AVX512-BF16's
/// `vdpbf16ps` (`dpbf16`; the same operands, products and f32 sums).
pub(crate) fn products_available() -> bool {
    available() || dpbf16::available()
}

/// A dense product's output tile (`matmul::tile`'s contract) on AMX where the CPU has it, else
/// with `vdpbf16ps`.
///
/// # Safety
/// `products_available()`, and `matmul::tile`'s other conditions.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product_tile(
    rows: &[u16],
    k: usize,
    panels: &[u32],
    n: usize,
    bias: Option<&[f32]>,
    y: *mut f32,
    r: (usize, usize),
    c: (usize, usize),
) {
    // SAFETY: the caller's contract; each kernel checks its own operands' sizes.
    unsafe {
        if available() {
            tile(rows, k, panels, n, bias, y, r, c)
        } else {
            dpbf16::tile(rows, k, panels, n, bias, y, r, c)
        }
    }
}

/// Output columns per panel: two 16-column tiles.
pub(crate) const NR: usize = 32;
/// Rows per block: two 16-row tiles.
pub(crate) const MR: usize = 32;
/// Input features per tile step (64 bytes of bf16, a tile row).
pub(crate) const KSTEP: usize = 32;
/// Rows of a tile swept by each panel before the next rows (128 rows of 4096 features: 1 MiB).
#[cfg(target_arch = "x86_64")]
const ROW_BLOCK: usize = 128;

/// Rows of an activation (and output) tile.
const TILE_ROWS: usize = 16;

/// Head dimension the tile attention takes (`attention::available`): one 32-feature step pair
/// for the scores, four 16-column output tiles.
pub(crate) const ATTENTION_HEAD_DIM: usize = 64;
