//! The one error type of `vl-nn`.

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A layer was given an input whose shape it cannot take; the message names both shapes.
    #[error("{layer}: {message}")]
    Shape { layer: &'static str, message: String },
    /// A path asked for that this CPU or device cannot run; the message says what is missing.
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
