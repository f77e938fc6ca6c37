//! The on-device sampler on CUDA: `cuda/sample.cu` (the logic of `kernels/sample.h`, PTX from
//! build.rs), either spread over a grid of up to one block an SM (`sample_grid_f32`, the
//! default) or in one block of 1024 threads (`sample_f32`, the kernel Metal shares).
//! `sample_fwd` runs it on a logits row candle computed (`SampleOp`); the fused step launches
//! the same kernels inside its graph.

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
/// The grid sampler and its threads a block (`GRID_THREADS` in sample.cu).
pub(crate) const GRID_KERNEL: &str = "sample_grid_f32";
pub(crate) const GRID_THREADS: usize = 256;
/// Bytes of the grid sampler's scratch (`GridScratch`, which sample.cu asserts fits). Zeroed
/// once when allocated; every run leaves zero what the next one reads as zero (the barrier's
/// count, the flags, sums and histograms; the barrier's generation only ever counts up and
/// the per-block sums are written before they are read).
pub(crate) const GRID_SCRATCH_BYTES: usize = 131_072;

/// Blocks of the grid sampler for `vocab` logits on `sms` multiprocessors: about 1024 logits
/// a block, never more blocks than SMs (its barriers need every block resident at once) nor
/// than the scratch holds per-block sums for.
pub(crate) fn grid_blocks(vocab: usize, sms: usize) -> usize {
    vocab.div_ceil(1024).min(sms).clamp(1, 1024)
}

/// The multiprocessors of the GPU a stream runs on.
pub(crate) fn multiprocessors(
    stream: &candle_core::cuda_backend::cudarc::driver::CudaStream,
) -> candle_core::Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    Ok(stream
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()? as usize)
}

// SAFETY: `KernelParams` is `#[repr(C)]` plain data laid out as `struct SampleParams`.
unsafe impl DeviceRepr for KernelParams {}

/// The sampler (`sample::op::SampleOp`) on a CUDA logits row starting at element `o0`, over
/// a grid or (`single_block`) in one block; `grid` overrides the grid's blocks and dynamic
/// shared memory (tests).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sample_fwd(
    params: &KernelParams,
    state: &SampleState,
    want_keep: bool,
    single_block: bool,
    grid: Option<(usize, u32)>,
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
    let kernel = if single_block { KERNEL } else { GRID_KERNEL };
    let func = dev
        .get_or_load_custom_func(kernel, MODULE, PTX)?
        .into_cuda_function();
    let stream = dev.cuda_stream();
    let scratch = dev.alloc_zeros::<u8>(if single_block { 8 } else { GRID_SCRATCH_BYTES })?;
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
    if !single_block {
        b.arg(&scratch);
    }
    let (blocks, threads, smem) = match (single_block, grid) {
        (true, _) => (1, THREADS, 0),
        (false, Some((blocks, smem))) => (blocks, GRID_THREADS, smem),
        (false, None) => (
            grid_blocks(vocab, multiprocessors(&stream)?),
            GRID_THREADS,
            0,
        ),
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: smem,
    };
    // SAFETY: the arguments match sample_f32's (or sample_grid_f32's) signature; `work` holds
    // `vocab` floats, `out` 12 bytes plus one per token when the mask is asked for, `scratch`
    // a zeroed GridScratch (per-block sums for up to 1024 blocks). The grid's launch is
    // cooperative: the driver refuses one that cannot be resident all at once (fewer SMs than
    // reported under MPS or a green context) rather than let its barriers wait forever.
    match single_block {
        true => unsafe { b.launch(cfg) }.w()?,
        false => unsafe { b.launch_cooperative(cfg) }.w()?,
    };
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
    fn cuda_grid_sampler_keeps_the_reference_set() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        sample::testutil::check_device_sampler(&dev, |_| {});
    }

    #[test]
    fn cuda_block_sampler_keeps_the_reference_set() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        sample::testutil::check_device_sampler(&dev, |op| op.single_block = true);
    }

    /// A grid whose blocks cannot all be resident at once (here: more than the occupancy
    /// allows with a large shared-memory request) is refused at launch, not started to spin
    /// forever at its first barrier; the context stays usable.
    #[test]
    fn an_oversized_grid_sampler_is_refused() {
        use crate::engine::sample::{op::SampleOp, testutil, Draw, SampleState};
        use candle_core::{DType, Tensor};
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        let cuda = dev.as_cuda_device().expect("a CUDA device");
        let func = cuda
            .get_or_load_custom_func(super::GRID_KERNEL, super::MODULE, super::PTX)
            .expect("the sampler module loads")
            .into_cuda_function();
        // with the static ~19 KB, under the 48 KB a block gets without opting in
        let smem = 28 * 1024;
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(super::GRID_THREADS as u32, smem, None)
            .expect("occupancy");
        let sms = super::multiprocessors(&cuda.cuda_stream()).expect("SM count");
        let blocks = per_sm as usize * sms + 1;
        assert!(per_sm >= 1 && blocks <= 1024, "{per_sm} a SM, {sms} SMs");
        let vocab = 151_936;
        let t = Tensor::zeros((1, vocab), DType::F32, &dev).expect("logits");
        let p = testutil::param_cases()[0].resolve(vocab);
        let mut op = SampleOp::new(
            p,
            SampleState::new(
                Draw {
                    seed: 1,
                    counter: 0,
                },
                &[],
            ),
        );
        op.grid = Some((blocks, smem as u32));
        let err = t
            .apply_op1_no_bwd(&op)
            .expect_err("an oversized cooperative grid");
        eprintln!("{blocks} blocks ({per_sm} a SM on {sms} SMs) refused: {err}");
        op.grid = None;
        let out = t
            .apply_op1_no_bwd(&op)
            .expect("the planned grid still runs");
        assert!(out.to_vec1::<u8>().expect("output").len() >= 12);
    }

    #[test]
    fn grid_blocks_stay_resident() {
        assert_eq!(super::grid_blocks(7, 132), 1);
        assert_eq!(super::grid_blocks(5000, 132), 5);
        assert_eq!(super::grid_blocks(151_936, 132), 132);
        assert_eq!(super::grid_blocks(151_936, 2000), 149);
    }
}
