//! Everything that turns token ids into logits: an mlx_lm model directory (config, MLX 4-bit
//! safetensors) plus an optional mlx_lm LoRA adapter, run as Qwen3 on candle.

pub mod config;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod error;
pub(crate) mod fused;
pub mod layers;
pub mod lora;
pub mod metal;
pub mod profile;
pub mod quant;
pub mod qwen3;
pub mod resident;
pub mod sample;
pub mod synthetic;
pub mod weights;

use std::path::Path;

pub use config::{QuantParams, Qwen3Config};
pub use error::{EngineError, Result};
pub use layers::{CudaStep, ModelOptions, QMatmulRoute};
pub use lora::Adapter;
pub use quant::{Numerics, QMatrix};
pub use qwen3::Qwen3;
pub use weights::WeightStore;

/// Loads `model_dir` (and `adapter_dir`, if given) into a ready model.
pub fn load(model_dir: &Path, adapter_dir: Option<&Path>, opts: &ModelOptions) -> Result<Qwen3> {
    if !model_dir.is_dir() {
        return Err(EngineError::NotADirectory {
            what: "model",
            path: model_dir.to_path_buf(),
        });
    }
    let cfg = Qwen3Config::from_dir(model_dir)?;
    let store =
        WeightStore::open_dir_with(model_dir, resident::Residency::for_device(&opts.device))?;
    let adapter = match adapter_dir {
        Some(d) => {
            if !d.is_dir() {
                return Err(EngineError::NotADirectory {
                    what: "adapter",
                    path: d.to_path_buf(),
                });
            }
            Some(Adapter::load(d, &opts.device)?)
        }
        None => None,
    };
    Qwen3::new(cfg, &store, adapter, opts)
}
