//! Generic vision-language layers on candle. Nothing here knows a model's name: Qwen3-VL (and
//! later models) are composed from these pieces in `vl-models`.

pub mod error;

pub use error::{Error, Result};
