//! The MLP's activation on the CPU, `silu(gate) * up` (mlx_lm's Qwen3 `MLP`: `nn.silu(gate) *
//! up`, with `silu(x) = x * sigmoid(x)`), in one pass over host slices, split over threads for
//! prompts. candle's two ops (`silu`, then `*`) ran on one thread with a libm `exp` a value
//! and two tensor allocations: 46-52 ms of a 1.06 s 64-token prefill of the 0.6B shape on 2
//! threads, the same ~60 ms on 16 threads of a Xeon, where it was a quarter of the prefill.
//!
//! `sigmoid` uses the shared `exp_neg` (`x ≤ 0`, within 2 ulp) on `-|x|`, so no value
//! overflows: `1 / (1 + e)` for `x ≥ 0`, `e / (1 + e)` below. The AVX2 path runs the same
//! operations in the same order, so both give the same bits (tested).

use crate::engine::cpu::host_f32;
use crate::engine::sample::exp_neg;

/// Values below which one thread does it all (a decode step's, on every shape).
const SERIAL: usize = 16 * 1024;
/// Values a task of a prompt's pass takes at least.
const MIN_TASK: usize = 4 * 1024;

/// `out[i] = silu(g[i]) * u[i]`.
pub fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(g.len() == u.len() && g.len() == out.len());
    // `team::per_task`: the Xeon's 16 threads had 12 tasks of a 64-token 0.6B prompt's
    let chunk = crate::engine::cpu::team::per_task(g.len(), MIN_TASK).next_multiple_of(64);
    if g.len() <= SERIAL || chunk >= g.len() {
        return silu_mul_serial(g, u, out);
    }
    let mut parts: Vec<_> = out
        .chunks_mut(chunk)
        .zip(g.chunks(chunk).zip(u.chunks(chunk)))
        .collect();
    // on the team a host pass leads (`cpu::team`), else rayon's pool
    crate::engine::cpu::team::for_each_mut(&mut parts, |(o, (g, u))| silu_mul_serial(g, u, o));
}

fn silu_mul_serial(g: &[f32], u: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::engine::cpu::isa::active().avx2() {
        // SAFETY: the active instruction set has AVX2 and FMA; the lengths are equal (asserted
        // by the caller).
        return unsafe { avx2::silu_mul(g, u, out) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::engine::cpu::isa::active().neon() {
        // SAFETY: the active instruction set has NEON; the lengths are equal (as above).
        return unsafe { neon::silu_mul(g, u, out) };
    }
    silu_mul_scalar(g, u, out, 0)
}

/// The portable loop from element `start` on.
fn silu_mul_scalar(g: &[f32], u: &[f32], out: &mut [f32], start: usize) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u).skip(start) {
        *o = silu1(g) * u;
    }
}

#[inline]
fn silu1(x: f32) -> f32 {
    let e = exp_neg(-x.abs());
    let num = if x >= 0.0 { 1.0 } else { e };
    x * (num / (1.0 + e))
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    // the sampler's 8-lane `exp_neg` (same bits as the scalar one)
    use crate::engine::cpu::sample::avx2::exp_neg8;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
        let n8 = g.len() / 8 * 8;
        let sign = _mm256_set1_ps(-0.0);
        let one = _mm256_set1_ps(1.0);
        for i in (0..n8).step_by(8) {
            let x = _mm256_loadu_ps(g.as_ptr().add(i));
            let e = exp_neg8(_mm256_or_ps(x, sign)); // exp(-|x|)
            let pos = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_setzero_ps());
            let num = _mm256_blendv_ps(e, one, pos);
            let s = _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, e)));
            let y = _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), y);
        }
        super::silu_mul_scalar(g, u, out, n8);
    }
}

/// The AVX2 loop in NEON's four lanes, the same operations in the same order.
#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    // the sampler's 4-lane `exp_neg` (same bits as the scalar one)
    use crate::engine::cpu::sample::neon::exp_neg4;

    #[target_feature(enable = "neon")]
    pub(super) unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
        let n4 = g.len() / 4 * 4;
        let one = vdupq_n_f32(1.0);
        for i in (0..n4).step_by(4) {
            let x = vld1q_f32(g.as_ptr().add(i));
            let e = exp_neg4(vnegq_f32(vabsq_f32(x))); // exp(-|x|)
            let pos = vcgeq_f32(x, vdupq_n_f32(0.0));
            let num = vbslq_f32(pos, one, e);
            let s = vmulq_f32(x, vdivq_f32(num, vaddq_f32(one, e)));
            let y = vmulq_f32(s, vld1q_f32(u.as_ptr().add(i)));
            vst1q_f32(out.as_mut_ptr().add(i), y);
        }
        super::silu_mul_scalar(g, u, out, n4);
    }
}

/// `silu(gate) * up` as a candle op on CPU f32 tensors of one shape (any layout).
pub struct SiluMul;

impl candle_core::CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (g, u) = (
            host_f32(self.name(), s1, l1)?,
            host_f32(self.name(), s2, l2)?,
        );
        if l1.shape() != l2.shape() {
            candle_core::bail!("silu-mul: shapes {:?} and {:?}", l1.shape(), l2.shape());
        }
        let mut out = vec![0f32; g.len()];
        silu_mul(g, u, &mut out);
        Ok((candle_core::CpuStorage::F32(out), l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(n: usize) -> (Vec<f32>, Vec<f32>) {
        let g = (0..n)
            .map(|i| match i % 97 {
                0 => -100.0,
                1 => 100.0,
                2 => 0.0,
                3 => -0.0,
                4 => -88.5,
                5 => 1e-40,
                6 => -1e-40,
                _ => ((i * 7919 % 2003) as f32 - 1001.0) / 60.0,
            })
            .collect();
        let u = (0..n).map(|i| ((i * 31 % 17) as f32 - 8.0) / 3.0).collect();
        (g, u)
    }

    /// Against `x / (1 + exp(-x)) * u` in f64: within 4e-7 relative plus a tiny absolute term
    /// (the exp is within 2 ulp; three roundings follow), at lengths that leave vector tails
    /// and that take the parallel split.
    #[test]
    fn silu_mul_matches_f64() {
        for n in [1, 7, 8, 100, 3072, 3 * SERIAL + 5] {
            let (g, u) = inputs(n);
            let mut out = vec![f32::NAN; n];
            silu_mul(&g, &u, &mut out);
            for i in 0..n {
                let (x, v) = (g[i] as f64, u[i] as f64);
                let want = x / (1.0 + (-x).exp()) * v;
                let err = (out[i] as f64 - want).abs();
                assert!(
                    err <= 4e-7 * want.abs() + 1e-30,
                    "n {n} i {i}: silu({x}) * {v} = {} want {want}",
                    out[i]
                );
            }
        }
    }

    /// The AVX2 (NEON) loop gives the portable loop's bits.
    #[test]
    fn vector_and_portable_agree_bitwise() {
        let (g, u) = inputs(4099);
        let mut want = vec![0f32; g.len()];
        silu_mul_scalar(&g, &u, &mut want, 0);
        let mut got = vec![0f32; g.len()];
        silu_mul_serial(&g, &u, &mut got);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "i {i}: g {} u {}", g[i], u[i]);
        }
    }
}
