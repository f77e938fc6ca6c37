//! CUDA forward of the fused quantized matmul and the quantized embedding gather: each
//! `QMatrix` is uploaded once, as stored (packed codes, raw scales and biases), and the kernels
//! of `cuda/qmatmul.cu` (PTX built by `build.rs`) run on it. Few rows of x take the fp32 `qmv`
//! kernel (one row at 4 bits: `qmv4`, or `qmv4q` with x rounded to 16-bit integers in the fast
//! mode); many rows take a tensor-core kernel unless the exact kernel is asked for: fp16
//! `qmm4_f16` at 4 bits, TF32 `qmm_tf32` at other widths.

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaView, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Shape};

use crate::engine::metal::plan::QParams;
use crate::engine::quant::{CpuKernel, QMatrix};

pub(crate) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/qmatmul.ptx"));
pub(crate) const MODULE: &str = "bot_qmatmul";
/// Rows of x up to which the decode kernel is used (it reuses the codes across them).
const QMV_MAX_ROWS: usize = 8;

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
}

// SAFETY: `Epi` is `#[repr(C)]` plain data laid out as the C struct of the same name.
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for Epi {}

/// The lazily made device copy, kept beside the host matrix.
#[derive(Default, Clone)]
pub struct CudaCopy(OnceLock<Arc<GpuQMatrix>>);

pub(crate) fn resident(w: &QMatrix, dev: &CudaDevice) -> candle_core::Result<Arc<GpuQMatrix>> {
    if let Some(g) = w.device_copy.cuda.0.get() {
        return Ok(g.clone());
    }
    let g = Arc::new(GpuQMatrix {
        packed: dev.clone_htod(&w.packed[..])?,
        scales: dev.clone_htod(&w.scales.bytes[..])?,
        biases: dev.clone_htod(&w.biases.bytes[..])?,
    });
    Ok(w.device_copy.cuda.0.get_or_init(|| g).clone())
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

/// The decode kernel on one row of x: four warps a block, two rows a warp where N is odd (so
/// the kernel tests reach both instances of each kernel), and a block per pass of rows unless
/// `grid` caps the blocks (each then takes several passes, as in the fused step).
fn qmv4_fwd(
    dev: &CudaDevice,
    w: &QMatrix,
    g: &GpuQMatrix,
    kernel: CpuKernel,
    x: &CudaView<'_, f32>,
    grid: Option<usize>,
) -> candle_core::Result<CudaSlice<f32>> {
    let (n, k) = (w.rows, w.cols);
    let p = QParams::new(w, 1);
    let rows = if n % 4 == 0 { 4 } else { 2 };
    let (name, smem) = qmv4_kernel(kernel, rows, k);
    let func = dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function();
    func.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .w()?;
    // SAFETY: every element is written by the kernel below.
    let y = unsafe { dev.alloc::<f32>(n)? };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(x);
    b.arg(&g.packed);
    b.arg(&g.scales);
    b.arg(&g.biases);
    b.arg(&y);
    let (no_norm, eps, epi) = (0u64, 0f32, Epi::default());
    for d in [&p.n, &p.k, &p.group_size, &p.sdtype] {
        b.arg(d);
    }
    b.arg(&no_norm);
    b.arg(&eps);
    b.arg(&epi);
    let passes = n.div_ceil(rows * 4);
    let cfg = LaunchConfig {
        grid_dim: (grid.map_or(passes, |g| g.min(passes)) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: the arguments match qmv4(q)_m1_r*'s signature; x holds k floats, y n.
    unsafe { b.launch(cfg) }.w()?;
    Ok(y)
}

/// `x (..., cols) -> (..., rows)` on the GPU.
pub fn qmatmul_fwd(
    w: &QMatrix,
    kernel: CpuKernel,
    s: &CudaStorage,
    l: &Layout,
) -> candle_core::Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let (n, k) = (w.rows, w.cols);
    let x = f32_input(w, s, l)?;
    let m = x.len() / k;
    let g = resident(w, dev)?;
    if m == 1 && w.params.bits == 4 {
        let y = qmv4_fwd(dev, w, &g, kernel, &x, None)?;
        return Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            out_shape(l, n),
        ));
    }
    // SAFETY: every element is written by the kernel below.
    let y = unsafe { dev.alloc::<f32>(m * n)? };
    let p = QParams::new(w, m);
    if m > QMV_MAX_ROWS && kernel != CpuKernel::Exact && f16_prompt_kernel(&p) {
        let splits = qmm4_splits(n, m, k);
        // SAFETY: x_to_f16p writes all m * k halves and m row scales; qmm4_f16 writes every
        // element of y (one split) or of the splits * m * n partials.
        let (xh, rs) = unsafe { (dev.alloc::<u16>(m * k)?, dev.alloc::<f32>(m)?) };
        let ws = unsafe { dev.alloc::<f32>(if splits > 1 { splits * m * n } else { 1 })? };
        let func = dev.get_or_load_custom_func("x_to_f16p", MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&xh);
        b.arg(&rs);
        b.arg(&p.k);
        let cfg = LaunchConfig {
            grid_dim: (m as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match x_to_f16p's signature; x holds m * k floats.
        unsafe { b.launch(cfg) }.w()?;
        let func = dev.get_or_load_custom_func("qmm4_f16", MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&xh);
        b.arg(&rs);
        b.arg(&g.packed);
        b.arg(&g.scales);
        b.arg(&g.biases);
        b.arg(&y);
        b.arg(&ws);
        let (sp, epi) = (splits as i32, Epi::default());
        for d in [&p.m, &p.n, &p.k, &p.group_size, &p.sdtype, &sp] {
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
        return Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            out_shape(l, n),
        ));
    }
    let splits = qmm_splits(n, m, k);
    if m > QMV_MAX_ROWS && kernel != CpuKernel::Exact && splits > 1 {
        // split K over blocks (see qmm_tf32_sk), then add the partials
        // SAFETY: qmm_tf32_sk writes every element of its splits * m * n partials.
        let ws = unsafe { dev.alloc::<f32>(splits * m * n)? };
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
        return Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            out_shape(l, n),
        ));
    }
    let (name, cfg) = if m > QMV_MAX_ROWS && kernel != CpuKernel::Exact {
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
    // SAFETY: the kernel's arguments match qmatmul.cu's signature; sizes were checked above.
    unsafe { b.launch(cfg) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(y, dev.clone()),
        out_shape(l, n),
    ))
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

/// Whether a prompt matmul takes `qmm4_f16` (4 bits, K a multiple of its 128-code step, groups
/// of whole 32-code runs); the rest take the TF32 kernel.
pub(crate) fn f16_prompt_kernel(p: &QParams) -> bool {
    // f32 scales and biases would be rounded to fp16 (bf16 and f16 ones convert exactly)
    p.bits == 4 && p.k % 128 == 0 && p.group_size % 32 == 0 && p.group_size <= 128 && p.sdtype != 2
}

/// Blocks (128 weight rows by 64 x rows) a prompt matmul aims for: two per SM of an H100.
const QMM4_TARGET_BLOCKS: usize = 264;

/// K splits for `qmm4_f16` over `m` rows against an `n` x `k` matrix: doubled until the grid
/// reaches the target, each split a multiple of 128 codes and at least 512 long.
pub(crate) fn qmm4_splits(n: usize, m: usize, k: usize) -> usize {
    k_splits(
        n.div_ceil(128) * m.div_ceil(64),
        k,
        128,
        512,
        QMM4_TARGET_BLOCKS,
    )
}

/// Prompt matmuls split K until they launch this many 64x64-tile blocks (about four per SM
/// on a 132-SM H100), each split at least 256 codes long.
const QMM_TARGET_BLOCKS: usize = 528;

/// K splits for a prompt matmul (`qmm_tf32_sk`) of `m` rows against an `n` x `k` matrix; 1 = no
/// split. Each split is a multiple of the kernel's 32-code K step.
pub(crate) fn qmm_splits(n: usize, m: usize, k: usize) -> usize {
    k_splits(
        n.div_ceil(64) * m.div_ceil(64),
        k,
        32,
        256,
        QMM_TARGET_BLOCKS,
    )
}

/// Splits of K for a grid of `blocks` tiles: doubled while the grid is under `target` and each
/// split stays a multiple of the kernel's `step` codes and at least `min_len` long.
fn k_splits(blocks: usize, k: usize, step: usize, min_len: usize, target: usize) -> usize {
    let mut s = 1;
    while blocks * s < target && k % (2 * s * step) == 0 && k / (2 * s) >= min_len {
        s *= 2;
    }
    s
}

/// x's shape with the last dimension replaced by `n`.
fn out_shape(l: &Layout, n: usize) -> Shape {
    let mut out = l.shape().dims().to_vec();
    if let Some(last) = out.last_mut() {
        *last = n;
    }
    Shape::from(out)
}

/// Dynamic shared memory of `qmv4_m1_r*` for rows of `k` codes (x staged as f32, padded to
/// 1024, and a sum per 32 codes).
pub(crate) fn qmv4_smem(k: usize) -> usize {
    let k = k.next_multiple_of(1024);
    k * 4 + k / 32 * 4
}

/// Dynamic shared memory of `qmv4q_m1_r*`: x staged as int16, and a scale and a sum per 32.
pub(crate) fn qmv4q_smem(k: usize) -> usize {
    let k = k.next_multiple_of(1024);
    k * 2 + k / 32 * 8
}

/// Rows a warp and warps a block of the decode kernel for a matrix of `n` rows, as measured on
/// an H100 with Qwen3-8B's shapes (docs/performance.md, session 7): two rows a warp and 16
/// warps, eight warps for q|k|v-sized matrices, four rows and eight warps for vocabulary heads.
pub(crate) fn qmv4_block(n: usize) -> (usize, usize) {
    match n {
        n if n >= 65536 => (4, 8),
        n if (6144..16384).contains(&n) => (2, 8),
        _ => (2, 16),
    }
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

/// The decode kernel at 4 bits and its dynamic shared memory: fp32 x for the exact kernel,
/// 16-bit integer x (`dp2a`) for the fast one.
pub(crate) fn qmv4_kernel(
    kernel: CpuKernel,
    rows_per_warp: usize,
    k: usize,
) -> (&'static str, usize) {
    match (kernel, rows_per_warp) {
        (CpuKernel::Exact, 4) => ("qmv4_m1_r4", qmv4_smem(k)),
        (CpuKernel::Exact, _) => ("qmv4_m1_r2", qmv4_smem(k)),
        (_, 4) => ("qmv4q_m1_r4", qmv4q_smem(k)),
        _ => ("qmv4q_m1_r2", qmv4q_smem(k)),
    }
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
    use crate::engine::quant::{qmatmul, testutil::random_qmatrix, QGather};
    use crate::engine::weights::Dtype;
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
        let got: Vec<f32> = qmatmul(&xt, w, CpuKernel::Fast)
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
                // odd rows reach the two-rows-a-warp decode kernel; 2304 wide takes 3 steps and, from
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
                        for (kernel, tol) in [(CpuKernel::Exact, 1e-5), (CpuKernel::Fast, 3e-3)] {
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
    /// current one. With 1, 3 and 7 blocks, on 19 and 38 passes whose last one only some warps
    /// fill, both decode kernels still give the reference's result.
    #[test]
    fn decode_kernels_with_fewer_blocks_than_passes() {
        let dev = Device::new_cuda(0).expect("a `cuda` build's tests need a GPU");
        let Device::Cuda(cd) = &dev else {
            unreachable!("a CUDA device")
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        // 300 rows: 4 a warp, 16 a pass; 298: 2 a warp, 8 a pass
        for (rows, cols) in [(300, 2048), (298, 1024)] {
            let w = random_qmatrix(rows, cols, 4, 64, Dtype::BF16, 17);
            let g = resident(&w, cd).unwrap();
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1f32..1.0)).collect();
            let want = w.matmul_reference(&x, 1);
            let xs = cd.clone_htod(&x).unwrap();
            for (kernel, tol) in [(CpuKernel::Exact, 1e-5), (CpuKernel::Fast, 3e-3)] {
                for grid in [1, 3, 7] {
                    let y = qmv4_fwd(cd, &w, &g, kernel, &xs.slice(..), Some(grid)).unwrap();
                    let got = cd.clone_dtoh(&y).unwrap();
                    let e = rel_err(&got, &want);
                    assert!(
                        e <= tol,
                        "{rows}x{cols} {kernel:?} grid {grid}: rel err {e:.2e} > {tol:.0e}"
                    );
                }
            }
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
