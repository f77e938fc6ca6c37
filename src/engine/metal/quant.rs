//! Metal forward of the fused quantized matmul and the quantized gather: the MSL of
//! `metal/qmatmul.metal` is compiled once per device at run time; each `QMatrix` is copied to
//! the GPU once, as stored; dispatches follow `metal::plan` (the plans the shim tests run).
//! Never run on a Mac by this project's CI: see docs/macos.md for what is proven and what not.

use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{DType, Layout, MetalDevice, MetalStorage, Shape};
use candle_metal_kernels::metal::{Buffer, ComputePipeline, Library};
use objc2_metal::MTLSize;

use crate::engine::metal::plan::{self, Plan, QParams};
use crate::engine::metal::selftest;
use crate::engine::quant::QMatrix;

/// A `QMatrix` resident on the GPU.
pub struct MetalQMatrix {
    packed: Arc<Buffer>,
    scales: Arc<Buffer>,
    biases: Arc<Buffer>,
}

fn err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("bot metal kernels: {e}"))
}

/// The MSL libraries of this backend, each compiled once per process (one process uses one
/// GPU): the quantized matmuls (`metal/qmatmul.metal`) and the sampler (`metal/sample.metal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lib {
    QMatmul = 0,
    Sample = 1,
    /// `qmatmul.metal` and `step.metal`: the fused step (`metal::step`).
    Step = 2,
}

/// The pipeline of kernel `name` in `lib`, compiling the library on first use.
pub(crate) fn pipeline(
    dev: &MetalDevice,
    lib: Lib,
    name: &'static str,
) -> candle_core::Result<ComputePipeline> {
    static LIBS: [OnceLock<std::result::Result<Library, String>>; 3] =
        [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    static PIPES: Mutex<Vec<(Lib, &'static str, ComputePipeline)>> = Mutex::new(Vec::new());
    let library = LIBS[lib as usize]
        .get_or_init(|| {
            let source = match lib {
                Lib::QMatmul => plan::SOURCE.to_string(),
                Lib::Sample => crate::engine::sample::metal_source(),
                Lib::Step => crate::engine::metal::step::source(),
            };
            // the sampler's exp must not be contracted or reordered: fast math off
            let opts = objc2_metal::MTLCompileOptions::new();
            #[allow(deprecated)]
            opts.setFastMathEnabled(lib != Lib::Sample);
            dev.device()
                .new_library_with_source(&source, Some(&opts))
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| err(format!("the MSL source ({lib:?}) did not compile: {e}")))?;
    let mut pipes = PIPES.lock().map_err(err)?;
    if let Some((_, _, p)) = pipes.iter().find(|(l, n, _)| *l == lib && *n == name) {
        return Ok(p.clone());
    }
    let f = library.get_function(name, None).map_err(err)?;
    let p = dev
        .device()
        .new_compute_pipeline_state_with_function(&f)
        .map_err(err)?;
    pipes.push((lib, name, p.clone()));
    Ok(p)
}

/// The matrix on this GPU, uploaded once and kept beside the host matrix.
fn resident(w: &QMatrix, dev: &MetalDevice) -> candle_core::Result<Arc<MetalQMatrix>> {
    let copy = w
        .device_copy
        .get_or_make(|| -> candle_core::Result<MetalQMatrix> {
            Ok(MetalQMatrix {
                packed: dev.new_buffer_with_data(&w.packed[..])?,
                scales: dev.new_buffer_with_data(&w.scales.bytes[..])?,
                biases: dev.new_buffer_with_data(&w.biases.bytes[..])?,
            })
        })?;
    copy.ok_or_else(|| {
        candle_core::Error::Msg(format!("{}: copied to another kind of device", w.name))
    })
}

fn launch(
    dev: &MetalDevice,
    plan: &Plan,
    p: &QParams,
    input: (&Buffer, usize),
    w: &MetalQMatrix,
    out: &Buffer,
) -> candle_core::Result<()> {
    let pipe = pipeline(dev, Lib::QMatmul, plan.kernel)?;
    let guard = dev.command_encoder()?;
    let enc = guard.as_ref();
    enc.set_label(plan.kernel);
    enc.set_compute_pipeline_state(&pipe);
    enc.set_input_buffer(0, Some(input.0), input.1);
    enc.set_input_buffer(1, Some(&w.packed), 0);
    enc.set_input_buffer(2, Some(&w.scales), 0);
    enc.set_input_buffer(3, Some(&w.biases), 0);
    enc.set_output_buffer(4, Some(out), 0);
    enc.set_bytes(5, p);
    let size = |v: [usize; 3]| MTLSize {
        width: v[0],
        height: v[1],
        depth: v[2],
    };
    enc.dispatch_thread_groups(size(plan.grid), size(plan.threads));
    Ok(())
}

/// The load-time self-test's runner (`metal::selftest`) on this GPU: exactly the dispatch the
/// forward makes for the plan, waited for and read back. Compiling the library happens here
/// first, so a source the Metal compiler rejects is a failed variant, not a crash.
pub struct GpuRunner<'a>(pub &'a MetalDevice);

impl selftest::Runner for GpuRunner<'_> {
    fn run(
        &self,
        plan: &Plan,
        p: &QParams,
        input: &[u8],
        w: &QMatrix,
    ) -> std::result::Result<Vec<f32>, String> {
        let dev = self.0;
        let go = || -> candle_core::Result<Vec<f32>> {
            let g = resident(w, dev)?;
            let x = dev.new_buffer_with_data(input)?;
            let len = if plan.kernel == "qgather" {
                p.m * p.k
            } else {
                p.m * p.n
            } as usize;
            let out = dev.new_buffer(len, DType::F32, "bot-selftest")?;
            launch(dev, plan, p, (&x, 0), &g, &out)?;
            match MetalStorage::new(out, dev.clone(), len, DType::F32).to_cpu_storage()? {
                candle_core::CpuStorage::F32(v) => Ok(v),
                _ => candle_core::bail!("the self-test's output is not f32"),
            }
        };
        go().map_err(|e| e.to_string())
    }
}

/// `x (..., cols) -> (..., rows)` on the GPU, f32.
pub fn qmatmul_fwd(
    w: &QMatrix,
    s: &MetalStorage,
    l: &Layout,
) -> candle_core::Result<(MetalStorage, Shape)> {
    if s.dtype() != DType::F32 {
        candle_core::bail!(
            "{}: the Metal qmatmul takes f32 activations, got {:?}",
            w.name,
            s.dtype()
        );
    }
    let Some((o0, o1)) = l.contiguous_offsets() else {
        candle_core::bail!("{}: qmatmul input must be contiguous", w.name);
    };
    let dev = s.device();
    let m = (o1 - o0) / w.cols;
    let p = QParams::new(w, m);
    let g = resident(w, dev)?;
    let out = dev.new_buffer(m * w.rows, DType::F32, "bot-qmatmul")?;
    launch(
        dev,
        &plan::matmul_plan(&p),
        &p,
        (s.buffer(), o0 * 4),
        &g,
        &out,
    )?;
    let mut dims = l.shape().dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = w.rows;
    }
    Ok((
        MetalStorage::new(out, dev.clone(), m * w.rows, DType::F32),
        Shape::from(dims),
    ))
}

/// Rows `ids (L,)` of the table, dequantized: `(L, cols)` f32.
pub fn gather_fwd(
    w: &QMatrix,
    s: &MetalStorage,
    l: &Layout,
) -> candle_core::Result<(MetalStorage, Shape)> {
    if s.dtype() != DType::U32 {
        candle_core::bail!("{}: gather takes U32 ids", w.name);
    }
    let Some((o0, o1)) = l.contiguous_offsets() else {
        candle_core::bail!("{}: gather ids must be contiguous", w.name);
    };
    let dev = s.device();
    let len = o1 - o0;
    let p = QParams::new(w, len);
    let g = resident(w, dev)?;
    let out = dev.new_buffer(len * w.cols, DType::F32, "bot-gather")?;
    launch(
        dev,
        &plan::gather_plan(&p),
        &p,
        (s.buffer(), o0 * 4),
        &g,
        &out,
    )?;
    Ok((
        MetalStorage::new(out, dev.clone(), len * w.cols, DType::F32),
        Shape::from((len, w.cols)),
    ))
}
