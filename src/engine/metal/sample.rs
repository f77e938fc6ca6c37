//! The on-device sampler on Metal: `metal/sample.metal` with `kernels/sample.h` spliced in
//! (`sample::metal_source`), one threadgroup per token; its logic is tested under
//! `tests/metal_shim`. Never run on a Mac by this project: see docs/macos.md.

use candle_core::backend::BackendStorage;
use candle_core::{DType, MetalStorage, Shape};
use objc2_metal::MTLSize;

use crate::engine::metal::quant::{pipeline, Lib};
use crate::engine::sample::{kernel_out_len, KernelParams, SampleState};

/// Mirrors `struct SampleShape` in `metal/sample.metal`.
#[repr(C)]
struct SampleShape {
    vocab: u32,
    want_keep: u32,
}

/// The sampler (`sample::op::SampleOp`) on a Metal logits row starting at element `o0`.
pub(crate) fn sample_fwd(
    params: &KernelParams,
    state: &SampleState,
    want_keep: bool,
    s: &MetalStorage,
    o0: usize,
    vocab: usize,
) -> candle_core::Result<(MetalStorage, Shape)> {
    let dev = s.device();
    let pipe = pipeline(dev, Lib::Sample, "sample_f32")?;
    // the kernel needs a power of two of threads, up to 1024 (what the pipeline allows)
    let threads = 1usize << pipe.max_total_threads_per_threadgroup().min(1024).ilog2();
    if threads < 32 {
        candle_core::bail!("the Metal sampler needs 32 threads a threadgroup, got {threads}");
    }
    let work = dev.new_buffer(vocab, DType::F32, "bot-sample-work")?;
    let state = dev.new_buffer_with_data(&state.to_bytes())?;
    let n = kernel_out_len(vocab, want_keep);
    let out = dev.new_buffer(n, DType::U8, "bot-sample-out")?;
    let shape = SampleShape {
        vocab: vocab as u32,
        want_keep: want_keep as u32,
    };
    let guard = dev.command_encoder()?;
    let enc = guard.as_ref();
    enc.set_label("sample_f32");
    enc.set_compute_pipeline_state(&pipe);
    enc.set_input_buffer(0, Some(s.buffer()), o0 * 4);
    enc.set_output_buffer(1, Some(&work), 0);
    enc.set_bytes(2, &shape);
    enc.set_bytes(3, params);
    enc.set_input_buffer(4, Some(&state), 0);
    enc.set_output_buffer(5, Some(&out), 0);
    // without the mask the kernel never writes `keep`: bind the same buffer at its start
    enc.set_output_buffer(6, Some(&out), if want_keep { 12 } else { 0 });
    let one = MTLSize {
        width: 1,
        height: 1,
        depth: 1,
    };
    let group = MTLSize {
        width: threads,
        height: 1,
        depth: 1,
    };
    enc.dispatch_thread_groups(one, group);
    drop(guard);
    Ok((
        MetalStorage::new(out, dev.clone(), n, DType::U8),
        Shape::from(n),
    ))
}
