//! RMSNorm of hidden rows on the CPU, as mlx_lm's Qwen3 applies it (`nn.RMSNorm`, i.e.
//! `mx.fast.rms_norm`: `x · rsqrt(mean(x²) + eps) · weight`, in f32), as a candle op over host
//! slices. candle's own op sums the squares in one chain of dependent adds and divides each
//! value: ~7 us a 4096-wide row on the Zen 4 EPYC, two of them a layer, on the leading thread
//! between two decode regions while the weights do not stream.

use crate::engine::cpu::host_f32;
use crate::engine::cpu::quant::dot;

/// Rows a prompt's norm hands each rayon task (below twice this, one thread does it all).
const ROWS_PER_TASK: usize = 16;

/// `out[r] = x[r] · (1 / sqrt(mean(x[r]²) + eps)) · w` for each row `r` of width `w.len()`.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(n > 0 && x.len() == out.len() && x.len().is_multiple_of(n));
    let row = |(x, out): (&[f32], &mut [f32])| {
        // eight partial sums (`dot`), which the compiler keeps in vector registers
        let r = 1.0 / (dot(x, x) / n as f32 + eps).sqrt();
        for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
            *o = v * r * g;
        }
    };
    if x.len() < 2 * ROWS_PER_TASK * n {
        x.chunks_exact(n).zip(out.chunks_exact_mut(n)).for_each(row);
    } else {
        let mut parts: Vec<_> = x
            .chunks(ROWS_PER_TASK * n)
            .zip(out.chunks_mut(ROWS_PER_TASK * n))
            .collect();
        // on the team a host pass leads (`cpu::team`), else rayon's pool
        crate::engine::cpu::team::for_each_mut(&mut parts, |(x, out)| {
            x.chunks_exact(n).zip(out.chunks_exact_mut(n)).for_each(row)
        });
    }
}

/// `rms_norm_rows` as a candle op on CPU f32 tensors: (x, weight) with weight (D) and x (.., D).
pub struct RmsNorm {
    pub eps: f32,
}

impl candle_core::CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "host-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (x, w) = (
            host_f32(self.name(), s1, l1)?,
            host_f32(self.name(), s2, l2)?,
        );
        let d = l1.shape().dims().last().copied().unwrap_or(0);
        if l2.shape().dims() != [d] || d == 0 {
            candle_core::bail!(
                "host-rms-norm: weight {:?} for rows of {:?}",
                l2.shape(),
                l1.shape()
            );
        }
        let mut out = vec![0f32; x.len()];
        rms_norm_rows(x, w, self.eps, &mut out);
        Ok((candle_core::CpuStorage::F32(out), l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// Against candle's `rms_norm` (same formula, other summation order and a division where
    /// this multiplies by the reciprocal): within 2e-6 relative to each row's largest output,
    /// for one row, a few, and enough to take the parallel split; and the f64 definition.
    #[test]
    fn host_rms_norm_matches_candle_and_f64() {
        let d = 1000;
        for rows in [1, 3, 2 * ROWS_PER_TASK + 1] {
            let x: Vec<f32> = (0..rows * d)
                .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 300.0 * (1 + i / d) as f32)
                .collect();
            let w: Vec<f32> = (0..d).map(|i| 0.5 + (i % 13) as f32 / 10.0).collect();
            let xt = Tensor::from_vec(x.clone(), (rows, d), &Device::Cpu).unwrap();
            let wt = Tensor::from_vec(w.clone(), d, &Device::Cpu).unwrap();
            let got = xt
                .apply_op2_no_bwd(&wt, &RmsNorm { eps: 1e-6 })
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let want = candle_nn::ops::rms_norm(&xt, &wt, 1e-6)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for r in 0..rows {
                let xs = &x[r * d..(r + 1) * d];
                let ms = xs.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
                let inv = 1.0 / (ms + 1e-6).sqrt();
                let top = (0..d).fold(0f64, |m, i| m.max((xs[i] as f64 * inv * w[i] as f64).abs()));
                for i in 0..d {
                    let exact = xs[i] as f64 * inv * w[i] as f64;
                    let (g, c) = (got[r * d + i] as f64, want[r * d + i] as f64);
                    assert!(
                        (g - exact).abs() <= 2e-6 * top,
                        "row {r} i {i}: {g} vs {exact}"
                    );
                    assert!(
                        (g - c).abs() <= 2e-6 * top,
                        "row {r} i {i}: {g} vs candle {c}"
                    );
                }
            }
        }
    }
}
