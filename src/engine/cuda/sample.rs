//! The on-device sampler on CUDA: `cuda/sample.cu` (the logic of `kernels/sample.h`, PTX from
//! build.rs), one block of 1024 threads per token. `sample_fwd` runs it on a logits row candle
//! computed (`SampleOp`); the fused step launches the same kernel inside its graph.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Shape};

use crate::engine::sample::{kernel_out_len, KernelParams, SampleState};

pub(crate) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/sample.ptx"));
pub(crate) const MODULE: &str = "bot_sample";
pub(crate) const KERNEL: &str = "sample_f32";
/// Threads of the one block (the kernel's `__launch_bounds__`).
pub(crate) const THREADS: usize = 1024;

// SAFETY: `KernelParams` is `#[repr(C)]` plain data laid out as `struct SampleParams`.
unsafe impl DeviceRepr for KernelParams {}

/// The sampler (`sample::op::SampleOp`) on a CUDA logits row starting at element `o0`.
pub(crate) fn sample_fwd(
    params: &KernelParams,
    state: &SampleState,
    want_keep: bool,
    s: &CudaStorage,
    o0: usize,
    vocab: usize,
) -> candle_core::Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let x = s.as_cuda_slice::<f32>()?.slice(o0..o0 + vocab);
    // SAFETY: the kernel copies every logit into `work` before reading it.
    let work = unsafe { dev.alloc::<f32>(vocab)? };
    let state = dev.clone_htod(&state.to_bytes())?;
    let n = kernel_out_len(vocab, want_keep);
    let out = dev.alloc_zeros::<u8>(n)?;
    let func = dev
        .get_or_load_custom_func(KERNEL, MODULE, PTX)?
        .into_cuda_function();
    let stream = dev.cuda_stream();
    let (head, keep) = (out.slice(0..12), out.slice(12..n));
    let (v, want_keep) = (vocab as u32, want_keep as u32);
    let mut b = stream.launch_builder(&func);
    b.arg(&x);
    b.arg(&work);
    b.arg(&v);
    b.arg(params);
    b.arg(&state);
    b.arg(&head);
    b.arg(&keep);
    b.arg(&want_keep);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match sample_f32's signature; `work` holds `vocab` floats, `out`
    // 12 bytes plus one per token when the mask is asked for.
    unsafe { b.launch(cfg) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        Shape::from(n),
    ))
}

#[cfg(test)]
mod tests {
    //! The CUDA sampler against the slow reference (a `cuda` build's tests need a GPU).
    use crate::engine::sample;
    use candle_core::Device;

    #[test]
    fn cuda_sampler_keeps_the_reference_set() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        sample::testutil::check_device_sampler(&dev);
    }
}
