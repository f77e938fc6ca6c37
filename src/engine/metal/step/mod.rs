//! The fused Metal step: Qwen3's forward as a fixed list of our own kernels
//! (`metal/step.metal` after `metal/qmatmul.metal`, and the sampler) on buffers made once,
//! instead of ~25 candle ops a layer: five dispatches a decode layer, eight with an adapter,
//! three a token around them (`plan`'s doc says which). The layout (`layout`) and the plan
//! (`plan`) are plain Rust on every platform; the tests run the planned dispatches under the C++
//! shim on the tiny fixture models against the CPU forward (`tests`), and the GPU encodes the
//! same list (`gpu`, only where Metal exists). The numerics are those of `qwen3.rs` (mlx_lm's
//! Qwen3), the reference and the path of the other devices.

#[cfg(bot_metal)]
pub mod gpu;
pub mod layout;
pub mod plan;
#[cfg(test)]
mod tests;

#[cfg_attr(not(bot_metal), allow(unused_imports))]
pub(crate) use layout::unsupported;
pub use layout::StepModel;
pub use plan::{decode_counts, Dispatch, SampleCall};

/// The MSL of the step's library: the quantized matmuls and gather, then the step's kernels.
pub fn source() -> String {
    format!(
        "{}\n{}",
        crate::engine::metal::plan::SOURCE,
        include_str!("../step.metal")
    )
}
