//! Typed errors of the engine: every message names the file, tensor or field, what was expected
//! and what was found, so a user can tell a broken download from a wrong adapter.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: not a valid safetensors file: {why}")]
    SafetensorsFormat { path: PathBuf, why: String },

    #[error("{path}: tensor `{name}`: {why}")]
    BadTensor {
        path: PathBuf,
        name: String,
        why: String,
    },

    #[error("tensor `{name}` is missing from the model in {dir} ({hint})")]
    MissingTensor {
        dir: PathBuf,
        name: String,
        hint: String,
    },

    #[error("{path}: field `{field}`: {why}")]
    Config {
        path: PathBuf,
        field: String,
        why: String,
    },

    #[error(
        "unsupported quantization mode `{mode}` in {path} (module `{module}`): only MLX `affine` \
         quantization is supported (mxfp4, nvfp4 and mxfp8 are not)"
    )]
    UnsupportedQuantMode {
        mode: String,
        path: PathBuf,
        module: String,
    },

    #[error("adapter {path}: {why}")]
    Adapter { path: PathBuf, why: String },

    #[error(
        "the model produced NaN/Inf logits: its weights or config (norm eps, rope theta, LoRA \
         scale) make the arithmetic overflow; nothing was sampled from them"
    )]
    NonFiniteLogits,

    #[error(
        "{tokens} tokens do not fit the model's context of {max} positions \
         (max_position_embeddings): use a shorter prompt or fewer tokens"
    )]
    ContextFull { tokens: usize, max: usize },

    #[error("{what} directory {path} does not exist or is not a directory")]
    NotADirectory { what: &'static str, path: PathBuf },

    #[error("no model*.safetensors in {dir}: is this an mlx_lm model directory?")]
    NoWeights { dir: PathBuf },

    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },

    #[error(
        "this `bot` was built without {backend} support: rebuild with \
         `cargo build --release --features {feature}`"
    )]
    FeatureDisabled {
        backend: &'static str,
        feature: &'static str,
    },

    /// Metal is compiled in but this Mac cannot run it (old macOS, no or non-Apple GPU).
    #[error("Metal cannot run here: {0}; use --device cpu")]
    MetalUnavailable(crate::engine::metal::guard::MetalUnavailable),

    /// A broken invariant of the engine itself (a bug to report), never a user's mistake.
    #[error("internal error: {0}")]
    Internal(String),

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, EngineError>;

impl EngineError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }
}
