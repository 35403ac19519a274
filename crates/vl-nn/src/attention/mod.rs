//! Bidirectional rotary attention over packed segments (one segment per image or video frame):
//! fused qkv projection, rotary on q and k, attention confined to each segment, output
//! projection. On CPU in f32 the core is `kernels::segment_attention_with` (query and key tiles,
//! online softmax: the live scores are one tile per thread). Elsewhere queries are processed in
//! blocks, so the score matrix resident at once is `heads x query_block x segment_len`, never
//! `heads x segment_len^2`.
//!
//! Modules: `segment` (the vision tower's `SegmentRotaryAttention`), `causal` (the text
//! decoder's causal grouped-query attention, `causal_gqa_attention`), `decode` (its one-row
//! decode step, reading the KV cache in place).

mod causal;
mod decode;
mod segment;

pub use causal::causal_gqa_attention;
pub use decode::decode_attention_many;
pub use segment::SegmentRotaryAttention;
