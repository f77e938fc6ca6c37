//! The GPUs' fused steps behind one face: Qwen3's forward as a fixed sequence of our own
//! kernels on buffers made once (CUDA: `cuda::fused`, a captured graph; Metal: `metal::step`,
//! a planned list of dispatches), which `qwen3.rs` runs instead of candle ops when it can.

use crate::engine::error::Result;
use crate::engine::profile::KernelTime;
use crate::engine::sample::{NonFinite, SampleStep, Sampled};

pub(crate) enum Fused {
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::engine::cuda::fused::FusedQwen3>),
    #[cfg(bot_metal)]
    Metal(Box<crate::engine::metal::step::gpu::MetalStep>),
    /// Keeps the enum inhabited-looking where no GPU is compiled in; never made.
    #[allow(dead_code)]
    Never(std::convert::Infallible),
}

impl Fused {
    /// Runs `ids` at cache position `pos`: the logits of the last position (or of every one)
    /// and, when asked for and the step can, the hidden states as `Qwen3::forward` gives them.
    pub fn forward(
        &mut self,
        ids: &[u32],
        pos: usize,
        all_logits: bool,
        keep_hidden: bool,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let _ = (ids, pos, all_logits, keep_hidden);
        match self {
            #[cfg(feature = "cuda")]
            Fused::Cuda(f) => f.forward(ids, pos, all_logits, keep_hidden),
            #[cfg(bot_metal)]
            Fused::Metal(f) => f.forward(ids, pos, all_logits, keep_hidden),
            Fused::Never(n) => match *n {},
        }
    }

    /// Runs `ids` at `pos` and samples the next token on the GPU.
    pub fn forward_sample(
        &mut self,
        ids: &[u32],
        pos: usize,
        s: &SampleStep,
    ) -> Result<std::result::Result<Sampled, NonFinite>> {
        let _ = (ids, pos, s);
        match self {
            #[cfg(feature = "cuda")]
            Fused::Cuda(f) => f.forward_sample(ids, pos, s),
            #[cfg(bot_metal)]
            Fused::Metal(f) => f.forward_sample(ids, pos, s),
            Fused::Never(n) => match *n {},
        }
    }

    /// Fallbacks the step took since the last call, for the user to hear.
    pub fn take_notes(&mut self) -> Vec<String> {
        match self {
            #[cfg(feature = "cuda")]
            Fused::Cuda(f) => std::mem::take(&mut f.notes),
            #[cfg(bot_metal)]
            Fused::Metal(_) => Vec::new(),
            Fused::Never(n) => match *n {},
        }
    }

    /// Per-kernel GPU timing on or off (CUDA only).
    pub fn set_profiling(&mut self, on: bool) {
        let _ = on;
        match self {
            #[cfg(feature = "cuda")]
            Fused::Cuda(f) => f.set_profiling(on),
            #[cfg(bot_metal)]
            Fused::Metal(_) => {}
            Fused::Never(n) => match *n {},
        }
    }

    pub fn kernel_times(&mut self) -> Result<Vec<KernelTime>> {
        match self {
            #[cfg(feature = "cuda")]
            Fused::Cuda(f) => f.kernel_times(),
            #[cfg(bot_metal)]
            Fused::Metal(_) => Ok(Vec::new()),
            Fused::Never(n) => match *n {},
        }
    }
}
