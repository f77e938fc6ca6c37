//! The CPU backend: quantized matmul kernels (AVX-512/AVX-VNNI and AVX2 on x86-64, NEON on aarch64, a scalar path
//! everywhere; `isa` picks), the packed prompt GEMM, attention over the KV cache and the sampler.

pub mod act;
pub mod amx;
pub mod attention;
pub mod gemm;
pub mod heap;
pub mod isa;
pub mod norm;
pub mod quant;
pub mod sample;
pub mod team;
pub mod vnni;
pub mod x86;
