//! CUDA forward of the fused quantized matmul and the quantized embedding gather: each
//! `QMatrix` is uploaded once, as stored (packed codes, raw scales and biases), and the kernels
//! of `cuda/qmatmul.cu` (PTX built by `build.rs`) run on it. Few rows of x take the fp32 `qmv`
//! kernel (one row at 4 bits: `qmv4`, or `qmv4q` with x rounded to 16-bit integers in the fast
//! mode); many rows take a tensor-core kernel unless the exact kernel is asked for: fp16
//! `qmm4_f16` at 4 bits, TF32 `qmm_tf32` at other widths.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaView, DriverError, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Shape};

use crate::engine::cuda::plan::{self, Matmul};
use crate::engine::quant::QParams;
use crate::engine::quant::{Numerics, QMatrix};

pub(crate) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/qmatmul.ptx"));
pub(crate) const MODULE: &str = "bot_qmatmul";

/// A `QMatrix` resident on one GPU.
pub struct GpuQMatrix {
    pub(crate) packed: CudaSlice<u8>,
    pub(crate) scales: CudaSlice<u8>,
    pub(crate) biases: CudaSlice<u8>,
}

impl GpuQMatrix {
    /// Bytes one pass over the matrix reads.
    pub(crate) fn bytes(&self) -> usize {
        self.packed.len() + self.scales.len() + self.biases.len()
    }
}

/// The kernels' `Epi` (cuda/common.cuh): what is added to each output element. Pointers are
/// device addresses, 0 for none.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Epi {
    pub residual: u64,
    pub lora_t: u64,
    pub lora_bt: u64,
    pub r: i32,
    pub rtot: i32,
    pub seg1: i32,
    pub seg2: i32,
    pub pairs: i32,
    pub swiglu: i32,
    /// LoRA A products made by the decode kernel before the one that needs them (`Epi` in
    /// common.cuh): `feed_acc` and `fed_acc` point at fixed-point words (`FEED_ONE`).
    pub feed_at: u64,
    pub feed_acc: u64,
    pub fed_acc: u64,
    pub feed_r: i32,
    /// Unused: the C struct's last field, named so both layouts list every field.
    pub pad_: i32,
}

// SAFETY: `Epi` is `#[repr(C)]` plain data laid out as the C struct of the same name.
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for Epi {}

/// The matrix on this GPU, uploaded once and kept beside the host matrix.
pub(crate) fn resident(w: &QMatrix, dev: &CudaDevice) -> candle_core::Result<Arc<GpuQMatrix>> {
    let copy = w
        .device_copy
        .get_or_make(|| -> candle_core::Result<GpuQMatrix> {
            Ok(GpuQMatrix {
                packed: dev.clone_htod(&w.packed[..])?,
                scales: dev.clone_htod(&w.scales.bytes[..])?,
                biases: dev.clone_htod(&w.biases.bytes[..])?,
            })
        })?;
    copy.ok_or_else(|| {
        candle_core::Error::Msg(format!("{}: copied to another kind of device", w.name))
    })
}

fn f32_input<'a>(
    w: &QMatrix,
    s: &'a CudaStorage,
    l: &Layout,
) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>> {
    let x = s.as_cuda_slice::<f32>().map_err(|_| {
        candle_core::Error::Msg(format!(
            "{}: the CUDA qmatmul takes f32 activations, got {:?}",
            w.name,
            s.dtype()
        ))
    })?;
    let Some((o0, o1)) = l.contiguous_offsets() else {
        candle_core::bail!("{}: qmatmul input must be contiguous", w.name);
    };
    if o0 % 4 != 0 {
        candle_core::bail!("{}: qmatmul input must start 16-byte aligned", w.name);
    }
    Ok(x.slice(o0..o1))
}

/// The decode kernel on one row of x, as `plan` (a `Matmul::Decode4`) says; `grid` caps the
/// blocks (each then takes several passes, as in the fused step); `epi` is its epilogue.
fn qmv4_fwd(
    dev: &CudaDevice,
    g: &GpuQMatrix,
    p: &QParams,
    plan: Matmul,
    x: &CudaView<'_, f32>,
    grid: Option<usize>,
    epi: Epi,
) -> candle_core::Result<CudaSlice<f32>> {
    let Matmul::Decode4 {
        kernel,
        warps,
        smem,
        passes,
        ..
    } = plan
    else {
        candle_core::bail!("qmv4_fwd: {plan:?} is not a decode plan");
    };
    let func = dev
        .get_or_load_custom_func(kernel, MODULE, PTX)?
        .into_cuda_function();
    let smem = feed_smem(smem, 32 * warps, &epi);
    raise_smem_limit(&func, smem).w()?;
    // SAFETY: every element is written by the kernel below.
    let y = unsafe { dev.alloc::<f32>(p.n as usize)? };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(x);
    b.arg(&g.packed);
    b.arg(&g.scales);
    b.arg(&g.biases);
    b.arg(&y);
    let (no_norm, eps) = (0u64, 0f32);
    for d in [&p.n, &p.k, &p.group_size, &p.sdtype] {
        b.arg(d);
    }
    b.arg(&no_norm);
    b.arg(&eps);
    b.arg(&epi);
    let cfg = LaunchConfig {
        grid_dim: (grid.map_or(passes, |g| g.min(passes)) as u32, 1, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: the arguments match qmv4(q)_m1_r*'s signature; x holds k floats, y n.
    unsafe { b.launch(cfg) }.w()?;
    Ok(y)
}

/// Raises `func`'s dynamic shared memory limit to `bytes`, never lowering it: the candle op
/// path and the fused step share the decode functions, and a launch of the fused step (also
/// from a graph captured earlier) may need more than the candle path's last one.
pub(crate) fn raise_smem_limit(func: &CudaFunction, bytes: usize) -> Result<(), DriverError> {
    let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    if func.get_attribute(attr)? < bytes as i32 {
        func.set_attribute(attr, bytes as i32)?;
    }
    Ok(())
}

/// The dynamic shared memory of a 4-bit decode launch: a kernel making LoRA A products
/// (`Epi::feed_*`) sums its warps' shares through the staging memory, a float a thread at least.
pub(crate) fn feed_smem(smem: usize, threads: usize, epi: &Epi) -> usize {
    if epi.feed_at != 0 {
        smem.max(4 * threads)
    } else {
        smem
    }
}

/// `x (..., cols) -> (..., rows)` on the GPU, as `plan::matmul` says.
pub fn qmatmul_fwd(
    w: &QMatrix,
    numerics: Numerics,
    s: &CudaStorage,
    l: &Layout,
) -> candle_core::Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let (n, k) = (w.rows, w.cols);
    let x = f32_input(w, s, l)?;
    let m = x.len() / k;
    let g = resident(w, dev)?;
    let p = QParams::new(w, m);
    let plan = plan::matmul(&p, numerics, usize::MAX);
    let wrap = |y| {
        Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            out_shape(l, n),
        ))
    };
    if let Matmul::Decode4 { .. } = plan {
        return wrap(qmv4_fwd(dev, &g, &p, plan, &x, None, Epi::default())?);
    }
    // SAFETY: every element is written by the kernels below.
    let y = unsafe { dev.alloc::<f32>(m * n)? };
    // SAFETY: the split kernels write every element of their splits * m * n partials.
    let ws = unsafe { dev.alloc::<f32>(plan.workspace(&p).max(1))? };
    match plan {
        Matmul::PromptF16 { splits } => {
            // SAFETY: x_to_f16p writes all m * k halves and m row scales.
            let (xh, rs) = unsafe { (dev.alloc::<u16>(m * k)?, dev.alloc::<f32>(m)?) };
            let func = dev.get_or_load_custom_func("x_to_f16p", MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&xh);
            b.arg(&rs);
            b.arg(&p.k);
            let (no_norm, eps) = (0u64, 0f32);
            b.arg(&no_norm);
            b.arg(&eps);
            let cfg = LaunchConfig {
                grid_dim: (m as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match x_to_f16p's signature (no norm); x holds m * k floats.
            unsafe { b.launch(cfg) }.w()?;
            let func = dev.get_or_load_custom_func(plan::qmm4_kernel(), MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&xh);
            b.arg(&rs);
            b.arg(&g.packed);
            b.arg(&g.scales);
            b.arg(&g.biases);
            b.arg(&y);
            b.arg(&ws);
            // no cluster: the splits' partials go to ws, for `qmm_reduce`
            let (sp, cluster, epi) = (splits as i32, 0i32, Epi::default());
            for d in [&p.m, &p.n, &p.k, &p.group_size, &p.sdtype, &sp, &cluster] {
                b.arg(d);
            }
            b.arg(&epi);
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(128) as u32, m.div_ceil(64) as u32, splits as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match qmm4_f16's signature; buffers sized above.
            unsafe { b.launch(cfg) }.w()?;
            if splits > 1 {
                reduce(dev, &ws, &y, &p, sp)?;
            }
        }
        Matmul::PromptTf32 { splits } if splits > 1 => {
            let func = dev.get_or_load_custom_func("qmm_tf32_sk", MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&g.packed);
            b.arg(&g.scales);
            b.arg(&g.biases);
            b.arg(&ws);
            let sp = splits as i32;
            for d in [&p.m, &p.n, &p.k, &p.bits, &p.group_size, &p.sdtype, &sp] {
                b.arg(d);
            }
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(64) as u32, (m.div_ceil(64) * splits) as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match qmm_tf32_sk's signature; ws holds splits * m * n.
            unsafe { b.launch(cfg) }.w()?;
            reduce(dev, &ws, &y, &p, sp)?;
        }
        _ => {
            let (name, cfg) = if let Matmul::PromptTf32 { .. } = plan {
                (
                    "qmm_tf32",
                    LaunchConfig {
                        grid_dim: (n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1),
                        block_dim: (128, 1, 1),
                        shared_mem_bytes: 0,
                    },
                )
            } else {
                (
                    "qmv_f32",
                    LaunchConfig {
                        grid_dim: (n.div_ceil(8) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    },
                )
            };
            let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&g.packed);
            b.arg(&g.scales);
            b.arg(&g.biases);
            b.arg(&y);
            // The kernels take the same parameters, in the same order, as the MSL ones.
            let dims = [p.m, p.n, p.k, p.bits, p.group_size, p.sdtype];
            for d in &dims {
                b.arg(d);
            }
            let epi = Epi::default();
            b.arg(&epi);
            // SAFETY: the kernel's arguments match qmatmul.cu's signature; sizes checked above.
            unsafe { b.launch(cfg) }.w()?;
        }
    }
    wrap(y)
}

/// `y = sum of the splits' partials in ws` (qmm_reduce, no epilogue).
fn reduce(
    dev: &CudaDevice,
    ws: &CudaSlice<f32>,
    y: &CudaSlice<f32>,
    p: &QParams,
    splits: i32,
) -> candle_core::Result<()> {
    let func = dev.get_or_load_custom_func("qmm_reduce", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(ws);
    b.arg(y);
    for d in [&p.m, &p.n, &splits] {
        b.arg(d);
    }
    let epi = Epi::default();
    b.arg(&epi);
    let mn = (p.m * p.n) as u32;
    let cfg = LaunchConfig {
        grid_dim: (mn.div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match qmm_reduce's signature; y holds m * n, ws splits * m * n.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// x's shape with the last dimension replaced by `n`.
fn out_shape(l: &Layout, n: usize) -> Shape {
    let mut out = l.shape().dims().to_vec();
    if let Some(last) = out.last_mut() {
        *last = n;
    }
    Shape::from(out)
}

/// The decode kernel's grid for `passes` passes of rows: a block per pass, but no more than fit
/// on the GPU at once (`sms` multiprocessors). Each block stages x once, so a block that takes
/// several passes saves the staging a second wave of blocks would repeat.
pub(crate) fn qmv4_grid(
    f: &CudaFunction,
    passes: usize,
    threads: usize,
    smem: usize,
    sms: usize,
) -> candle_core::Result<usize> {
    let per_sm = f
        .occupancy_max_active_blocks_per_multiprocessor(threads as u32, smem, None)
        .w()? as usize;
    Ok(passes.min((per_sm * sms).max(1)))
}

/// Rows `ids (L,)` of the table, dequantized: `(L, cols)` f32.
pub fn gather_fwd(
    w: &QMatrix,
    s: &CudaStorage,
    l: &Layout,
) -> candle_core::Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let ids = s.as_cuda_slice::<u32>()?;
    let Some((o0, o1)) = l.contiguous_offsets() else {
        candle_core::bail!("{}: gather ids must be contiguous", w.name);
    };
    let ids = ids.slice(o0..o1);
    let (len, k) = (o1 - o0, w.cols);
    let g = resident(w, dev)?;
    // SAFETY: every element is written by the kernel below.
    let out = unsafe { dev.alloc::<f32>(len * k)? };
    let func = dev.get_or_load_custom_func("qgather_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&ids);
    b.arg(&g.packed);
    b.arg(&g.scales);
    b.arg(&g.biases);
    b.arg(&out);
    let p = QParams::new(w, len);
    let dims = [p.k, p.bits, p.group_size, p.sdtype];
    for d in &dims {
        b.arg(d);
    }
    let cfg = LaunchConfig {
        grid_dim: ((k / 16).div_ceil(128) as u32, len as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above; ids were range-checked on the host by the caller.
    unsafe { b.launch(cfg) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        Shape::from((len, k)),
    ))
}

#[cfg(test)]
mod tests {
    //! Kernels against the slow reference on the GPU (a `cuda` build's tests need one).
    use super::*;
    use crate::engine::quant::op::{qmatmul, QGather};
    use crate::engine::quant::testutil::random_qmatrix;
    use crate::engine::weights::Dtype;
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::{Device, Tensor};
    use rand::{Rng, SeedableRng};

    fn rel_err(got: &[f32], want: &[f32]) -> f32 {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        got.iter()
            .zip(want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale
    }

    /// `x (m, cols) @ W^T` through the fast GPU kernels: finite, and within 3e-3 of the
    /// reference.
    fn assert_fast_kernel_matches(
        dev: &Device,
        w: &Arc<QMatrix>,
        x: Vec<f32>,
        m: usize,
        label: &str,
    ) {
        let want = w.matmul_reference(&x, m);
        let xt = Tensor::from_vec(x, (m, w.cols), dev).unwrap();
        let got: Vec<f32> = qmatmul(&xt, w, Numerics::Fast)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(
            got.iter().all(|v| v.is_finite()),
            "{label}: non-finite output"
        );
        let e = rel_err(&got, &want);
        assert!(e <= 3e-3, "{label}: rel err {e:.2e}");
    }

    #[test]
    fn qmatmul_kernels_match_the_reference_on_the_gpu() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for bits in [2, 3, 4, 5, 6, 8] {
            for gs in [32, 64, 128] {
                // 2304 wide takes 3 steps and, from
                // 9 rows on, splits K four ways (qmm_tf32_sk + qmm_reduce; 576 is no whole group)
                for (rows, cols) in [(40, 256), (100, 384), (8, 640), (37, 2304)] {
                    let sd = [Dtype::BF16, Dtype::F16, Dtype::F32][(bits + gs) % 3];
                    let w = Arc::new(random_qmatrix(
                        rows,
                        cols,
                        bits,
                        gs,
                        sd,
                        bits as u64 * 31 + gs as u64,
                    ));
                    for m in [1, 5, 8, 9, 64, 100] {
                        let x: Vec<f32> = (0..m * cols)
                            .map(|_| rng.random_range(-1f32..1.0))
                            .collect();
                        let want = w.matmul_reference(&x, m);
                        let xt = Tensor::from_vec(x, (m, cols), &dev).unwrap();
                        for (kernel, tol) in [(Numerics::Exact, 1e-5), (Numerics::Fast, 3e-3)] {
                            let y = qmatmul(&xt, &w, kernel).unwrap();
                            let got: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
                            let e = rel_err(&got, &want);
                            assert!(
                                e <= tol,
                                "bits {bits} gs {gs} {rows}x{cols} m {m} {kernel:?} {sd}: rel err {e:.2e} > {tol:.0e}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The 4-bit decode kernels with every group size and every scale dtype (bf16, f16, f32:
    /// they carry a step's scale and bias as raw bits and convert them when the step runs),
    /// rows that do not fill the last block, and K of one to several 1024-code steps.
    #[test]
    fn decode_kernels_read_every_scale_dtype_and_group_size() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        for sd in [Dtype::BF16, Dtype::F16, Dtype::F32] {
            for gs in [32, 64, 128] {
                for (rows, cols) in [(37, 1024), (100, 2304), (9, 4096)] {
                    let w = Arc::new(random_qmatrix(rows, cols, 4, gs, sd, gs as u64 + 5));
                    let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1f32..1.0)).collect();
                    let want = w.matmul_reference(&x, 1);
                    let xt = Tensor::from_vec(x, (1, cols), &dev).unwrap();
                    for (kernel, tol) in [(Numerics::Exact, 1e-5), (Numerics::Fast, 3e-3)] {
                        let got: Vec<f32> = qmatmul(&xt, &w, kernel)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1()
                            .unwrap();
                        let e = rel_err(&got, &want);
                        assert!(
                            e <= tol,
                            "{sd} gs {gs} {rows}x{cols} {kernel:?}: rel err {e:.2e} > {tol:.0e}"
                        );
                    }
                }
            }
        }
    }

    /// The fp16 prompt kernel scales each row of x by a power of two before rounding it to fp16:
    /// activations far past fp16's range (65504) and far below its normal range still give
    /// the reference's result.
    #[test]
    fn f16_prompt_kernel_survives_large_and_tiny_activations() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        let w = Arc::new(random_qmatrix(300, 1024, 4, 64, Dtype::BF16, 11));
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for amp in [3e5f32, 1e-7, 1.0] {
            let m = 20;
            let mut x: Vec<f32> = (0..m * 1024).map(|_| rng.random_range(-amp..amp)).collect();
            x[5] = 0.0;
            x[1024..2048].iter_mut().for_each(|v| *v = 0.0); // an all-zero row
            assert_fast_kernel_matches(&dev, &w, x, m, &format!("amp {amp}"));
        }
    }

    /// The fast decode kernel rounds x to 16-bit integers with one scale per 32 values: a
    /// group of zeros, a lone outlier, and amplitudes far from 1 still give the reference's
    /// result.
    #[test]
    fn int16_decode_kernel_survives_zeros_outliers_and_scale() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        let w = Arc::new(random_qmatrix(300, 2048, 4, 64, Dtype::BF16, 13));
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for amp in [3e5f32, 1e-7, 1.0] {
            let mut x: Vec<f32> = (0..2048).map(|_| rng.random_range(-amp..amp)).collect();
            x[32..64].iter_mut().for_each(|v| *v = 0.0);
            x[1000] = amp * 1e3;
            assert_fast_kernel_matches(&dev, &w, x, 1, &format!("amp {amp}"));
        }
    }

    /// The fused step launches no more decode blocks than fit on the GPU, so each block takes
    /// several passes of rows and loads its next pass's first step while it finishes the
    /// current one. Every instance (2 or 4 rows a warp, teams of 1, 2 or 4 warps splitting K,
    /// exact or fast) and block shape the plan can pick, with 1, 3 and 7 blocks and with a
    /// block a pass, on passes whose last one only some warps fill, gives the reference's
    /// result.
    #[test]
    fn decode_kernels_with_fewer_blocks_than_passes() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        let Device::Cuda(cd) = &dev else {
            unreachable!("a CUDA device")
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        // 3072 codes: a team of two or four warps splits three chunks unevenly
        for (rows, cols) in [(300, 2048), (298, 1024), (150, 3072)] {
            let w = random_qmatrix(rows, cols, 4, 64, Dtype::BF16, 17);
            let g = resident(&w, cd).unwrap();
            let p = QParams::new(&w, 1);
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1f32..1.0)).collect();
            let want = w.matmul_reference(&x, 1);
            let xs = cd.clone_htod(&x).unwrap();
            for (kernel, tol) in [(Numerics::Exact, 1e-5), (Numerics::Fast, 3e-3)] {
                for (rows_w, warps, k_warps) in [
                    (4, 4, 1),
                    (2, 4, 1),
                    (2, 8, 1),
                    (2, 16, 1),
                    (4, 8, 1),
                    (2, 8, 2),
                    (2, 32, 2),
                    (2, 16, 4),
                ] {
                    let block = plan::DecodeBlock::new(rows_w, warps, k_warps).unwrap();
                    let plan = plan::decode4_with(rows, cols, kernel, block);
                    for grid in [Some(1), Some(3), Some(7), None] {
                        let y = qmv4_fwd(cd, &g, &p, plan, &xs.slice(..), grid, Epi::default())
                            .unwrap();
                        let got = cd.clone_dtoh(&y).unwrap();
                        let e = rel_err(&got, &want);
                        assert!(
                            e <= tol,
                            "{rows}x{cols} {plan:?} grid {grid:?}: rel err {e:.2e} > {tol:.0e}"
                        );
                    }
                }
            }
        }
    }

    /// The decode kernels' LoRA epilogue (lanes split the ranks, then a warp sum): `B t` added
    /// to each row, two adapters of rank 8 over two output segments and, interleaved, over
    /// even and odd rows; ranks past 32 (40) take a lane twice; every instance and block shape.
    #[test]
    fn decode_kernels_add_the_lora_term() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        let Device::Cuda(cd) = &dev else {
            unreachable!("a CUDA device")
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        let (rows, cols) = (300usize, 3072usize);
        let w = random_qmatrix(rows, cols, 4, 64, Dtype::BF16, 19);
        let g = resident(&w, cd).unwrap();
        let p = QParams::new(&w, 1);
        let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1f32..1.0)).collect();
        let xs = cd.clone_htod(&x).unwrap();
        let stream = cd.cuda_stream();
        for (r, pairs) in [(8usize, false), (8, true), (40, false)] {
            let t: Vec<f32> = (0..2 * r).map(|_| rng.random_range(-1f32..1.0)).collect();
            let bt: Vec<f32> = (0..rows * r)
                .map(|_| rng.random_range(-0.5f32..0.5))
                .collect();
            let mut want = w.matmul_reference(&x, 1);
            for (n, y) in want.iter_mut().enumerate() {
                let seg = if pairs { n & 1 } else { usize::from(n >= 150) };
                *y += (0..r).map(|j| t[seg * r + j] * bt[n * r + j]).sum::<f32>();
            }
            let (ts, bts) = (cd.clone_htod(&t).unwrap(), cd.clone_htod(&bt).unwrap());
            let epi = Epi {
                lora_t: ts.device_ptr(&stream).0,
                lora_bt: bts.device_ptr(&stream).0,
                r: r as i32,
                rtot: 2 * r as i32,
                seg1: 150,
                seg2: rows as i32,
                pairs: pairs as i32,
                ..Epi::default()
            };
            for (kernel, tol) in [(Numerics::Exact, 1e-5), (Numerics::Fast, 3e-3)] {
                for (rows_w, warps, k_warps) in [(2, 16, 1), (4, 8, 1), (2, 32, 2), (2, 16, 4)] {
                    let block = plan::DecodeBlock::new(rows_w, warps, k_warps).unwrap();
                    let plan = plan::decode4_with(rows, cols, kernel, block);
                    for grid in [Some(3), None] {
                        let y = qmv4_fwd(cd, &g, &p, plan, &xs.slice(..), grid, epi).unwrap();
                        let e = rel_err(&cd.clone_dtoh(&y).unwrap(), &want);
                        let label = format!("rank {r} pairs {pairs} {plan:?} grid {grid:?}");
                        assert!(e <= tol, "{label}: rel err {e:.2e} > {tol:.0e}");
                    }
                }
            }
        }
    }

    /// A decode launch raises its function's dynamic shared memory limit and never lowers it:
    /// the fused step launches the same functions with wider rows (from a graph captured
    /// earlier too), which a lowered limit would refuse (CUDA_ERROR_INVALID_VALUE).
    #[test]
    fn decode_launches_never_lower_the_shared_memory_limit() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        let Device::Cuda(cd) = &dev else {
            unreachable!("a CUDA device")
        };
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        let block = plan::DecodeBlock::new(2, 16, 1).unwrap();
        let mut limits = Vec::new();
        // 12288 codes stage 27 KiB of x, 1024 codes 2.3 KiB
        for cols in [12288usize, 1024] {
            let w = random_qmatrix(64, cols, 4, 64, Dtype::BF16, 5);
            let (g, p) = (resident(&w, cd).unwrap(), QParams::new(&w, 1));
            let x = cd.clone_htod(&vec![0.5f32; cols]).unwrap();
            let plan = plan::decode4_with(64, cols, Numerics::Fast, block);
            qmv4_fwd(cd, &g, &p, plan, &x.slice(..), None, Epi::default()).unwrap();
            let Matmul::Decode4 { kernel, .. } = plan else {
                unreachable!("a decode plan")
            };
            let f = cd
                .get_or_load_custom_func(kernel, MODULE, PTX)
                .unwrap()
                .into_cuda_function();
            limits.push(f.get_attribute(attr).unwrap());
        }
        assert!(
            limits[0] >= plan::qmv4q_smem(12288) as i32 && limits[1] == limits[0],
            "limits after the wide and the narrow launch: {limits:?}"
        );
    }

    /// LoRA A products made by the decode kernel before (`Epi::feed_*`, `fed_*`): a producer's
    /// blocks add `Σ y_n · at[n, j]` over their outputs y (the residual added; with SwiGLU over
    /// silu(gate) · up) into the accumulator, in fixed point; a consumer reads it, times its
    /// norm's row scale, as its LoRA t: its output equals the same kernel given the host's sums
    /// as t directly. Every two-row instance (the ones that carry the feed), producer grids of
    /// 3 blocks and a full one, 8 to 32 ranks; the accumulator is the same bits on a rerun.
    /// One in `Epi::feed_acc`'s fixed point (`FEED_ONE`, cuda/common.cuh).
    const FEED_ONE: f64 = 4294967296.0;

    #[test]
    fn decode_kernels_feed_the_next_lora() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        let Device::Cuda(cd) = &dev else {
            unreachable!("a CUDA device")
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(23);
        let (rows, cols) = (300usize, 3072usize);
        let w = random_qmatrix(rows, cols, 4, 64, Dtype::BF16, 29);
        let g = resident(&w, cd).unwrap();
        let p = QParams::new(&w, 1);
        let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1f32..1.0)).collect();
        let res: Vec<f32> = (0..rows).map(|_| rng.random_range(-2f32..2.0)).collect();
        let (xs, rs) = (cd.clone_htod(&x).unwrap(), cd.clone_htod(&res).unwrap());
        let stream = cd.cuda_stream();
        let mut acc = cd.alloc_zeros::<u64>(32).unwrap();
        // the consumer: 150 rows reading the producer's output (300, or 150 with SwiGLU)
        let (crows, ccols) = (150usize, 256usize);
        let cw = random_qmatrix(crows, ccols, 4, 64, Dtype::BF16, 31);
        let cg = resident(&cw, cd).unwrap();
        let cp = QParams::new(&cw, 1);
        let cx: Vec<f32> = (0..ccols).map(|_| rng.random_range(-1f32..1.0)).collect();
        let cxs = cd.clone_htod(&cx).unwrap();
        for (swiglu, fr) in [(false, 24usize), (true, 8), (false, 32)] {
            let ny = if swiglu { rows / 2 } else { rows };
            let at: Vec<f32> = (0..ny * fr).map(|_| rng.random_range(-1f32..1.0)).collect();
            let ats = cd.clone_htod(&at).unwrap();
            let bt: Vec<f32> = (0..crows * fr)
                .map(|_| rng.random_range(-0.5f32..0.5))
                .collect();
            let bts = cd.clone_htod(&bt).unwrap();
            let producer = Epi {
                residual: if swiglu { 0 } else { rs.device_ptr(&stream).0 },
                swiglu: swiglu as i32,
                feed_at: ats.device_ptr(&stream).0,
                feed_acc: acc.device_ptr(&stream).0,
                feed_r: fr as i32,
                ..Epi::default()
            };
            let lora = Epi {
                lora_bt: bts.device_ptr(&stream).0,
                r: fr as i32,
                rtot: fr as i32,
                seg1: crows as i32,
                seg2: crows as i32,
                ..Epi::default()
            };
            for kernel in [Numerics::Exact, Numerics::Fast] {
                // the two-row instances carry the feed (the step feeds only through them)
                for (rows_w, warps, k_warps) in [(2, 16, 1), (2, 8, 1), (2, 32, 2), (2, 16, 4)] {
                    let block = plan::DecodeBlock::new(rows_w, warps, k_warps).unwrap();
                    let plan = plan::decode4_with(rows, cols, kernel, block);
                    let cplan = plan::decode4_with(crows, ccols, kernel, block);
                    for grid in [Some(3), None] {
                        let label = format!("swiglu {swiglu} r {fr} {plan:?} grid {grid:?}");
                        let mut words = Vec::new();
                        let mut y = Vec::new();
                        for _ in 0..2 {
                            stream.memset_zeros(&mut acc).unwrap();
                            let yd =
                                qmv4_fwd(cd, &g, &p, plan, &xs.slice(..), grid, producer).unwrap();
                            y = cd.clone_dtoh(&yd).unwrap()[..ny].to_vec();
                            words.push(cd.clone_dtoh(&acc).unwrap());
                        }
                        assert_eq!(words[0], words[1], "{label}: a rerun's sums differ");
                        assert!(
                            words[0][fr..].iter().all(|&v| v == 0),
                            "{label}: a word past the ranks written"
                        );
                        let t: Vec<f32> = (0..fr)
                            .map(|j| {
                                let s: f64 =
                                    (0..ny).map(|n| y[n] as f64 * at[n * fr + j] as f64).sum();
                                s as f32
                            })
                            .collect();
                        let ts = cd.clone_htod(&t).unwrap();
                        let direct = Epi {
                            lora_t: ts.device_ptr(&stream).0,
                            ..lora
                        };
                        let fed = Epi {
                            fed_acc: acc.device_ptr(&stream).0,
                            ..lora
                        };
                        let want =
                            qmv4_fwd(cd, &cg, &cp, cplan, &cxs.slice(..), None, direct).unwrap();
                        let got = qmv4_fwd(cd, &cg, &cp, cplan, &cxs.slice(..), None, fed).unwrap();
                        let (want, got) =
                            (cd.clone_dtoh(&want).unwrap(), cd.clone_dtoh(&got).unwrap());
                        assert!(got.iter().all(|v| v.is_finite()), "{label}: non-finite");
                        let e = rel_err(&got, &want);
                        assert!(e <= 1e-5, "{label}: rel err {e:.2e}");
                    }
                }
            }
        }
        // the consumer's reading of the fixed point, negative and large sums included
        let fr = 16usize;
        let t: Vec<f64> = (0..fr).map(|j| (j as f64 - 7.5) * 1e3 / 7.0).collect();
        let words: Vec<u64> = t
            .iter()
            .map(|v| (v * FEED_ONE).round() as i64 as u64)
            .collect();
        stream
            .memcpy_htod(&words, &mut acc.slice_mut(..fr))
            .unwrap();
        let tf: Vec<f32> = t.iter().map(|&v| v as f32).collect();
        let ts = cd.clone_htod(&tf).unwrap();
        let bt: Vec<f32> = (0..crows * fr)
            .map(|_| rng.random_range(-0.5f32..0.5))
            .collect();
        let bts = cd.clone_htod(&bt).unwrap();
        let lora = Epi {
            lora_bt: bts.device_ptr(&stream).0,
            r: fr as i32,
            rtot: fr as i32,
            seg1: crows as i32,
            seg2: crows as i32,
            ..Epi::default()
        };
        let direct = Epi {
            lora_t: ts.device_ptr(&stream).0,
            ..lora
        };
        let fed = Epi {
            fed_acc: acc.device_ptr(&stream).0,
            ..lora
        };
        for (rows_w, warps, k_warps) in [(2, 16, 1), (2, 8, 1), (2, 32, 2)] {
            let block = plan::DecodeBlock::new(rows_w, warps, k_warps).unwrap();
            let cplan = plan::decode4_with(crows, ccols, Numerics::Fast, block);
            let want = qmv4_fwd(cd, &cg, &cp, cplan, &cxs.slice(..), None, direct).unwrap();
            let got = qmv4_fwd(cd, &cg, &cp, cplan, &cxs.slice(..), None, fed).unwrap();
            let (got, want) = (cd.clone_dtoh(&got).unwrap(), cd.clone_dtoh(&want).unwrap());
            assert_eq!(got, want, "{cplan:?}: fed t read differently");
        }
    }

    #[test]
    fn gather_matches_dequantized_rows_on_the_gpu() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        for bits in [4, 8, 3] {
            let w = Arc::new(random_qmatrix(50, 256, bits, 64, Dtype::BF16, 3));
            let ids = [7u32, 0, 49, 7];
            let got: Vec<f32> = Tensor::new(&ids, &dev)
                .unwrap()
                .apply_op1_no_bwd(&QGather { w: w.clone() })
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let mut want = vec![0f32; ids.len() * 256];
            for (row, &id) in want.chunks_exact_mut(256).zip(&ids) {
                w.dequantize_row(id as usize, row);
            }
            assert_eq!(got, want, "bits {bits}");
        }
    }
}
