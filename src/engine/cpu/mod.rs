//! The CPU backend: quantized matmul kernels (AVX-512/AVX-VNNI and AVX2 on x86-64, NEON with sdot and i8mm on aarch64, a scalar path
//! everywhere; `isa` picks), the packed prompt GEMM, attention over the KV cache and the sampler.

pub mod act;
pub mod amx;
pub mod attention;
pub mod gemm;
pub mod heap;
pub mod i8mm;
pub mod isa;
pub mod lora_half;
pub mod norm;
pub mod quant;
pub mod sample;
pub mod team;
pub mod tile16;
pub mod tilecache;
pub mod vnni;
pub mod x86;

/// The f32 values a CPU candle op reads: `s` within its contiguous layout `l`; else an error
/// naming the op.
pub(crate) fn host_f32<'a>(
    op: &str,
    s: &'a candle_core::CpuStorage,
    l: &candle_core::Layout,
) -> candle_core::Result<&'a [f32]> {
    let candle_core::CpuStorage::F32(v) = s else {
        candle_core::bail!("{op} takes f32 tensors");
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: inputs must be contiguous");
    };
    Ok(&v[a..b])
}
