//! Real checkpoint geometries (config.json bodies as the hub ships them, transformers 4.57
//! dialect), for benchmarks and tests that need real sizes without the weights.

/// `Qwen/Qwen3-VL-2B-Instruct`'s geometry.
pub const QWEN3_VL_2B: &str = r#"{
  "architectures": ["Qwen3VLForConditionalGeneration"],
  "model_type": "qwen3_vl",
  "image_token_id": 151655, "video_token_id": 151656,
  "vision_start_token_id": 151652, "vision_end_token_id": 151653,
  "tie_word_embeddings": true,
  "text_config": {
    "model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-06, "attention_bias": false,
    "rope_theta": 5000000,
    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": true},
    "tie_word_embeddings": true
  },
  "vision_config": {
    "model_type": "qwen3_vl", "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
    "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "out_hidden_size": 2048, "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [5, 11, 17], "hidden_act": "gelu_pytorch_tanh"
  }
}"#;
