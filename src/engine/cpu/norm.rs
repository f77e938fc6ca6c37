//! RMSNorm of hidden rows on the CPU, as mlx_lm's Qwen3 applies it (`nn.RMSNorm`, i.e.
//! `mx.fast.rms_norm`: `x · rsqrt(mean(x²) + eps) · weight`, in f32), as a candle op over host
//! slices. candle's own op sums the squares in one chain of dependent adds and divides each
//! value: ~7 us a 4096-wide row on the Zen 4 EPYC, two of them a layer, on the leading thread
//! between two decode regions while the weights do not stream.

use crate::engine::cpu::host_f32;
use crate::engine::cpu::quant::dot;

/// Values a norm task takes at least (a few rows), so that a region's hand-off stays small
/// beside its work.
const MIN_TASK_VALUES: usize = 2048;

/// Rows of width `n` each task of a norm over `m` rows takes (`team::per_task`: on the Xeon's
/// 16 threads a 64-token prompt's norm was 4 tasks of 16 rows, 12 threads idle); `m` when
/// that is all one task (one thread, or a decode step's row).
fn rows_per_task(m: usize, n: usize) -> usize {
    crate::engine::cpu::team::per_task(m, MIN_TASK_VALUES.div_ceil(n))
}

/// One row: `out = x · (1 / sqrt(mean(x²) + eps)) · w`.
#[inline]
fn norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    // eight partial sums (`dot`), which the compiler keeps in vector registers
    let r = 1.0 / (dot(x, x) / w.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * r * g;
    }
}

/// `out[r] = x[r] · (1 / sqrt(mean(x[r]²) + eps)) · w` for each row `r` of width `w.len()`.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(n > 0 && x.len() == out.len() && x.len().is_multiple_of(n));
    let per = rows_per_task(x.len() / n, n) * n;
    let rows = |x: &[f32], out: &mut [f32]| {
        x.chunks_exact(n)
            .zip(out.chunks_exact_mut(n))
            .for_each(|(x, out)| norm_row(x, w, eps, out))
    };
    if per >= x.len() {
        // one task: here, without allocating (a decode step's)
        return rows(x, out);
    }
    let mut parts: Vec<_> = x.chunks(per).zip(out.chunks_mut(per)).collect();
    // on the team a host pass leads (`cpu::team`), else rayon's pool
    crate::engine::cpu::team::for_each_mut(&mut parts, |(x, out)| rows(x, out));
}

/// The residual add and the norm after it in one region: `x[r] += d[r]`, then
/// `out[r] = rms_norm(x[r]) · w`, for each row `r` (the same bits as `x += d` followed by
/// `rms_norm_rows`: each row is normed from the sums just stored). A host pass's layers end
/// and begin with this pair; apart, the add ran on the leading thread alone.
pub fn add_rms_norm_rows(x: &mut [f32], d: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(n > 0 && x.len() == out.len() && x.len() == d.len() && x.len().is_multiple_of(n));
    let per = rows_per_task(x.len() / n, n) * n;
    let rows = |x: &mut [f32], d: &[f32], out: &mut [f32]| {
        for ((x, d), out) in x
            .chunks_exact_mut(n)
            .zip(d.chunks_exact(n))
            .zip(out.chunks_exact_mut(n))
        {
            x.iter_mut().zip(d).for_each(|(x, d)| *x += d);
            norm_row(x, w, eps, out);
        }
    };
    if per >= x.len() {
        // one task: here, without allocating (a decode step's)
        return rows(x, d, out);
    }
    let mut parts: Vec<_> = x
        .chunks_mut(per)
        .zip(d.chunks(per))
        .zip(out.chunks_mut(per))
        .collect();
    crate::engine::cpu::team::for_each_mut(&mut parts, |((x, d), out)| rows(x, d, out));
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
        for rows in [1, 3, 33, 64] {
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

    /// The fused add and norm: the same bits as the add followed by `rms_norm_rows`, and both
    /// the same on one thread, on pools of 3 and 16 and on teams of 3 and 16 (a host pass's
    /// way), for a decode row, a few, and prompts split into many tasks.
    #[test]
    fn add_then_norm_is_the_same_fused_and_on_any_pool() {
        use crate::engine::cpu::team;
        let d: usize = 1024;
        let w: Vec<f32> = (0..d).map(|i| 0.5 + (i % 13) as f32 / 10.0).collect();
        for rows in [1, 2, 5, 64, 77] {
            let x: Vec<f32> = (0..rows * d)
                .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 300.0)
                .collect();
            let o: Vec<f32> = (0..rows * d)
                .map(|i| ((i * 104729 % 997) as f32 - 498.0) / 1000.0)
                .collect();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let apart = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                pool.expect("a test pool").install(|| {
                    let mut x = x.clone();
                    x.iter_mut().zip(&o).for_each(|(x, d)| *x += d);
                    let mut out = vec![0f32; x.len()];
                    rms_norm_rows(&x, &w, 1e-6, &mut out);
                    (bits(&x), bits(&out))
                })
            };
            let fused = |threads: usize, lead: bool| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                let body = || {
                    let mut x = x.clone();
                    let mut out = vec![0f32; x.len()];
                    add_rms_norm_rows(&mut x, &o, &w, 1e-6, &mut out);
                    (bits(&x), bits(&out))
                };
                let pool = pool.expect("a test pool");
                match lead {
                    true => pool.install(|| team::Team::lead(body)),
                    false => pool.install(body),
                }
            };
            let one = apart(1);
            assert!(apart(16) == one, "rows {rows}: the norm on 16 threads");
            for (threads, lead) in [(1, false), (3, false), (16, false), (3, true), (16, true)] {
                assert!(
                    fused(threads, lead) == one,
                    "rows {rows}: fused on {threads} threads, team {lead}"
                );
            }
        }
    }
}
