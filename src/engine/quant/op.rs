//! The quantized matmul and gather as candle ops: `qmatmul` runs `x @ dequant(W)^T` on the
//! backend the activations live on (the CPU kernels, our CUDA kernels, our MSL kernels), never
//! materializing the dequantized matrix; the slow references are in `quant` itself.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use crate::engine::cpu;
use crate::engine::error::Result;
use crate::engine::quant::{Numerics, QMatrix};

/// The fused quantized matmul as a candle op over the activations; the weights ride along.
pub struct QMatMul {
    pub w: Arc<QMatrix>,
    pub kernel: Numerics,
}

impl CustomOp1 for QMatMul {
    fn name(&self) -> &'static str {
        "mlx-affine-qmatmul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = l.shape().dims();
        let k = *dims
            .last()
            .ok_or_else(|| candle_core::Error::Msg("qmatmul on a scalar".into()))?;
        if k != self.w.cols {
            candle_core::bail!(
                "{}: input has {} features, the matrix expects {}",
                self.w.name,
                k,
                self.w.cols
            );
        }
        let CpuStorage::F32(data) = s else {
            candle_core::bail!(
                "{}: the CPU qmatmul takes f32 activations, got {:?}",
                self.w.name,
                s.dtype()
            );
        };
        let Some((o0, o1)) = l.contiguous_offsets() else {
            candle_core::bail!("{}: qmatmul input must be contiguous", self.w.name);
        };
        let x = &data[o0..o1];
        let m = x.len() / k;
        let y = cpu::quant::qmatmul_vec(&self.w, x, m, self.kernel);
        let mut out = dims.to_vec();
        *out.last_mut().unwrap_or(&mut 0) = self.w.rows;
        Ok((CpuStorage::F32(y), Shape::from(out)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::engine::cuda::quant::qmatmul_fwd(&self.w, self.kernel, s, l)
    }

    #[cfg(bot_metal)]
    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::MetalStorage, Shape)> {
        crate::engine::metal::quant::qmatmul_fwd(&self.w, s, l)
    }
}

/// Rows of a quantized table (the embedding), dequantized: ids `(L,)` U32 -> `(L, cols)` f32.
/// Ids are range-checked by the caller.
pub struct QGather {
    pub w: Arc<QMatrix>,
}

impl CustomOp1 for QGather {
    fn name(&self) -> &'static str {
        "mlx-affine-gather"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::U32(ids) = s else {
            candle_core::bail!("{}: gather takes U32 ids", self.w.name);
        };
        let Some((o0, o1)) = l.contiguous_offsets() else {
            candle_core::bail!("{}: gather ids must be contiguous", self.w.name);
        };
        let k = self.w.cols;
        let mut out = vec![0f32; (o1 - o0) * k];
        for (row, &id) in out.chunks_exact_mut(k).zip(&ids[o0..o1]) {
            self.w.dequantize_row(id as usize, row);
        }
        Ok((CpuStorage::F32(out), Shape::from((o1 - o0, k))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::engine::cuda::quant::gather_fwd(&self.w, s, l)
    }

    #[cfg(bot_metal)]
    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::MetalStorage, Shape)> {
        crate::engine::metal::quant::gather_fwd(&self.w, s, l)
    }
}

/// Applies the fused op to `x (..., cols)`, giving `(..., rows)`.
pub fn qmatmul(x: &Tensor, w: &Arc<QMatrix>, kernel: Numerics) -> Result<Tensor> {
    let mut x = x.contiguous()?;
    if !x.device().is_cpu() && x.layout().start_offset() % 4 != 0 {
        // GPU kernels load x in 16-byte vectors
        x = x.copy()?;
    }
    Ok(x.apply_op1_no_bwd(&QMatMul {
        w: w.clone(),
        kernel,
    })?)
}
