//! The CUDA backend (feature `cuda`): the quantized matmul as a candle op, the fused decode
//! step on preallocated buffers (captured as a CUDA graph) and the on-device sampler. Kernel
//! sources sit beside this file (`*.cu`) and are compiled to PTX by `build.rs`.

#[cfg(feature = "cuda")]
pub mod fused;
pub mod plan;
#[cfg(feature = "cuda")]
pub mod quant;
#[cfg(feature = "cuda")]
pub mod sample;
