//! The CPU backend: quantized matmul kernels (AVX2 where present, a scalar path everywhere),
//! the packed prompt GEMM, attention over the KV cache and the sampler.

pub mod attention;
pub mod gemm;
pub mod quant;
pub mod sample;
