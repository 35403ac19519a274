//! Causal (grouped-query) attention on CPU f32 slices: the text prefill's, on the segment
//! attention's tile loop (`tile::attend_gemm`).

use crate::cpu::SendPtr;
use crate::kernels::tile::{attend_gemm, for_each_item, tile_rows, HalfRows, Operands, Scratch};
use crate::kernels::{SegmentAttentionShape, TileKernel, KEY_TILE, QUERY_TILE};

/// The keys and values `causal_attention` reads: f32 rows in place, or f16 / bf16 rows (a
/// half-precision KV cache) widened key tile by key tile.
#[derive(Clone, Copy)]
pub(crate) enum KvRows<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [half::f16], &'a [half::f16]),
    Bf16(&'a [half::bf16], &'a [half::bf16]),
}

/// Causal (grouped-query) attention on CPU f32 slices, fused like `segment_attention`: query
/// tiles x heads on candle's pool, key tiles through `gemm` with the online softmax, no score
/// matrix beyond one tile per thread, keys after a tile's last query never read.
///
/// `q`: [heads, new, d] contiguous; key and value rows: `kv_heads` heads, head `g`'s position `j`
/// at `g * head_stride + j * d` in `k` / `v` (a cache's views: `head_stride` is its capacity
/// times `d`),
/// `total` positions of which the last `new` are the queries' own; query head h reads kv head
/// `h / (heads / kv_heads)`. Writes softmax(q k^T / sqrt(d)) v, [heads, new, d], into `out`.
/// The caller checks the shapes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_attention(
    q: &[f32],
    (heads, new, d): (usize, usize, usize),
    kv: KvRows<'_>,
    (kv_heads, head_stride, total): (usize, usize, usize),
    out: &mut [f32],
) {
    assert!(kv_heads > 0 && heads % kv_heads == 0 && new <= total && (kv_heads == 1 || head_stride >= total * d));
    assert!(q.len() >= heads * new * d && out.len() >= heads * new * d);
    let span = (kv_heads - 1) * head_stride + total * d;
    let lens = match kv {
        KvRows::F32(k, v) => (k.len(), v.len()),
        KvRows::F16(k, v) => (k.len(), v.len()),
        KvRows::Bf16(k, v) => (k.len(), v.len()),
    };
    assert!(lens.0 >= span && lens.1 >= span);
    let rep = heads / kv_heads;
    let offset = total - new;
    let shape = SegmentAttentionShape { seq: new, heads, head_dim: d, query_tile: QUERY_TILE, key_tile: KEY_TILE };
    let rows = tile_rows(new, QUERY_TILE, 16);
    // (query tile start, rows), the longest (most keys) first so the pool's tail stays short.
    let mut tiles: Vec<(usize, usize)> = (0..new).step_by(rows).map(|q0| (q0, rows.min(new - q0))).collect();
    tiles.reverse();
    let scale = std::f32::consts::LOG2_E / (d as f32).sqrt();
    let out_ptr = SendPtr(out.as_mut_ptr());
    for_each_item(
        tiles.len() * heads,
        || Scratch::new(shape, TileKernel::Gemm),
        |item, sc| {
            let (q0, m) = tiles[item / heads];
            let h = item % heads;
            let g = h / rep;
            let at = g * head_stride;
            let (k, v, half) = match kv {
                KvRows::F32(k, v) => (k[at..].as_ptr(), v[at..].as_ptr(), None),
                KvRows::F16(k, v) => {
                    (std::ptr::null(), std::ptr::null(), Some(HalfRows::F16(k[at..].as_ptr(), v[at..].as_ptr())))
                }
                KvRows::Bf16(k, v) => {
                    (std::ptr::null(), std::ptr::null(), Some(HalfRows::Bf16(k[at..].as_ptr(), v[at..].as_ptr())))
                }
            };
            let op =
                Operands { q: q[(h * new + q0) * d..].as_ptr(), q_rs: d, q_cs: 1, k, k_rs: d, v, v_rs: d, scale, half };
            // SAFETY: the operands lie inside `q`, `k` and `v` (asserted above; keys past
            // `offset + q0 + m` are not read), and each (tile, head) item writes its own rows.
            unsafe {
                attend_gemm(&op, m, d, total, KEY_TILE, Some(offset + q0), sc);
                sc.write_normalized(m, d, out_ptr.get().add((h * new + q0) * d), d);
            }
        },
    );
}
