//! The attention kernels of `Group::walk` in NEON (every aarch64 CPU: Apple Silicon's when
//! Metal is not used, Graviton, Ampere): the AVX2 kernels' structure in four-lane vectors, each
//! key and value row loaded once for a pair of query heads, f16 rows widened with `fcvtl`
//! (base AArch64 SIMD: no FEAT_FP16 needed), the softmax's exp the samplers' `exp_neg` in four
//! lanes (the same bits), and the f16 cache written with `fcvtn`. The portable loops they replace were 6-8x slower than AVX2 on x86-64
//! with the compiler's own 128-bit vectors (`BOT_CPU_ISA=scalar`, the proxy for what NEON got).

use std::arch::aarch64::*;
use std::arch::asm;

use half::f16;

use super::{KvElem, Lanes, F16_MAX};
use crate::engine::cpu::sample::neon::exp_neg4;
use crate::engine::sample::exp_neg;

pub(super) struct Neon;

lanes!(Neon, exp_sum);

/// Eight cached values at `p` as two f32 vectors: widened from f16, or loaded.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn load8<E: KvElem>(p: *const E) -> (float32x4_t, float32x4_t) {
    if E::HALF {
        widen_halves(vld1q_u16(p as *const u16))
    } else {
        let p = p as *const f32;
        (vld1q_f32(p), vld1q_f32(p.add(4)))
    }
}

/// Eight f16 values by their bits as two f32 vectors (values 0-3, 4-7) with `fcvtl` and
/// `fcvtl2`: exact, subnormals included (also LoRA's f16 loops, `cpu::lora_half`).
#[target_feature(enable = "neon")]
#[inline]
pub(crate) unsafe fn widen_halves(h: uint16x8_t) -> (float32x4_t, float32x4_t) {
    let (lo, hi): (float32x4_t, float32x4_t);
    // `lo` is written before `h`'s second read: not a late output, so never `h`'s register
    asm!(
        "fcvtl {lo:v}.4s, {h:v}.4h",
        "fcvtl2 {hi:v}.4s, {h:v}.8h",
        h = in(vreg) h,
        lo = out(vreg) lo,
        hi = lateout(vreg) hi,
        options(pure, nomem, nostack, preserves_flags)
    );
    (lo, hi)
}

/// `f16::store` in NEON: clamped to ±65504 (`fmax`/`fmin` keep a NaN, as `clamp` does), then
/// narrowed with `fcvtn`/`fcvtn2` (the FPCR's rounding: to nearest even), eight values a step.
#[target_feature(enable = "neon")]
pub(super) unsafe fn store_f16(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len());
    let (lo, hi) = (vdupq_n_f32(-F16_MAX), vdupq_n_f32(F16_MAX));
    let whole = src.len() & !7;
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr() as *mut u16);
    for i in (0..whole).step_by(8) {
        let a = vminq_f32(vmaxq_f32(vld1q_f32(s.add(i)), lo), hi);
        let b = vminq_f32(vmaxq_f32(vld1q_f32(s.add(i + 4)), lo), hi);
        let h: uint16x8_t;
        // `h` is written before `b` is read: not a late output, so never `b`'s register
        asm!(
            "fcvtn {h:v}.4h, {a:v}.4s",
            "fcvtn2 {h:v}.8h, {b:v}.4s",
            a = in(vreg) a,
            b = in(vreg) b,
            h = out(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
        vst1q_u16(d.add(i), h);
    }
    for (o, &v) in dst[whole..].iter_mut().zip(&src[whole..]) {
        *o = f16::from_f32(v.clamp(-F16_MAX, F16_MAX));
    }
}

/// `scores2` of the AVX2 kernels: four keys at a time, each value of a key loaded once for
/// both heads, two chains a key and head (eight values a step), so 16 independent FMA chains
/// for a pair.
#[target_feature(enable = "neon")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn scores2<E: KvElem, const P: bool>(
    qa: *const f32,
    qb: *const f32,
    kp: *const E,
    hd: usize,
    visible: usize,
    scale: f32,
    sa: &mut [f32],
    sb: &mut [f32],
) {
    let zero = vdupq_n_f32(0.0);
    let mut t = 0;
    while t + 4 <= visible {
        let k0 = kp.add(t * hd);
        let (mut a, mut b) = ([[zero; 2]; 4], [[zero; 2]; 4]);
        for d in (0..hd).step_by(8) {
            let x = [vld1q_f32(qa.add(d)), vld1q_f32(qa.add(d + 4))];
            let y = [vld1q_f32(qb.add(d)), vld1q_f32(qb.add(d + 4))];
            for j in 0..4 {
                let (k_lo, k_hi) = load8(k0.add(j * hd + d));
                a[j][0] = vfmaq_f32(a[j][0], x[0], k_lo);
                a[j][1] = vfmaq_f32(a[j][1], x[1], k_hi);
                if P {
                    b[j][0] = vfmaq_f32(b[j][0], y[0], k_lo);
                    b[j][1] = vfmaq_f32(b[j][1], y[1], k_hi);
                }
            }
        }
        for j in 0..4 {
            sa[t + j] = vaddvq_f32(vaddq_f32(a[j][0], a[j][1])) * scale;
            if P {
                sb[t + j] = vaddvq_f32(vaddq_f32(b[j][0], b[j][1])) * scale;
            }
        }
        t += 4;
    }
    for t in t..visible {
        let kt = kp.add(t * hd);
        let (mut a, mut b) = ([zero; 2], [zero; 2]);
        for d in (0..hd).step_by(8) {
            let (k_lo, k_hi) = load8(kt.add(d));
            a[0] = vfmaq_f32(a[0], vld1q_f32(qa.add(d)), k_lo);
            a[1] = vfmaq_f32(a[1], vld1q_f32(qa.add(d + 4)), k_hi);
            if P {
                b[0] = vfmaq_f32(b[0], vld1q_f32(qb.add(d)), k_lo);
                b[1] = vfmaq_f32(b[1], vld1q_f32(qb.add(d + 4)), k_hi);
            }
        }
        sa[t] = vaddvq_f32(vaddq_f32(a[0], a[1])) * scale;
        if P {
            sb[t] = vaddvq_f32(vaddq_f32(b[0], b[1])) * scale;
        }
    }
}

/// `pv2` of the AVX2 kernels: 32 values of each head of a pair at a time in registers (64 of a
/// head alone), each value row's slice loaded once for both heads.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn pv2<E: KvElem, const P: bool>(
    pa: &[f32],
    pb: &[f32],
    vp: *const E,
    hd: usize,
    oa: *mut f32,
    ob: *mut f32,
) {
    let mut d0 = 0;
    if P {
        while d0 + 32 <= hd {
            pv_block::<E, P, 8>(pa, pb, vp, hd, d0, oa, ob);
            d0 += 32;
        }
    } else {
        while d0 + 64 <= hd {
            pv_block::<E, P, 16>(pa, pb, vp, hd, d0, oa, ob);
            d0 += 64;
        }
    }
    while d0 < hd {
        pv_block::<E, P, 2>(pa, pb, vp, hd, d0, oa, ob);
        d0 += 8;
    }
}

/// `pv2` for outputs `d0..d0 + 4·W` (`W` even: vectors of four, loaded eight values at a time).
#[target_feature(enable = "neon")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_block<E: KvElem, const P: bool, const W: usize>(
    pa: &[f32],
    pb: &[f32],
    vp: *const E,
    hd: usize,
    d0: usize,
    oa: *mut f32,
    ob: *mut f32,
) {
    let zero = vdupq_n_f32(0.0);
    let (mut a, mut b) = ([zero; W], [zero; W]);
    for (t, (&p, &q)) in pa.iter().zip(pb).enumerate() {
        let vt = vp.add(t * hd + d0);
        for j in (0..W).step_by(2) {
            let (v_lo, v_hi) = load8(vt.add(4 * j));
            a[j] = vfmaq_n_f32(a[j], v_lo, p);
            a[j + 1] = vfmaq_n_f32(a[j + 1], v_hi, p);
            if P {
                b[j] = vfmaq_n_f32(b[j], v_lo, q);
                b[j + 1] = vfmaq_n_f32(b[j + 1], v_hi, q);
            }
        }
    }
    for j in 0..W {
        vst1q_f32(oa.add(d0 + 4 * j), a[j]);
        if P {
            vst1q_f32(ob.add(d0 + 4 * j), b[j]);
        }
    }
}

/// `exp_sum` four lanes at a time, with `exp_neg` in four lanes (the same bits as the scalar
/// one); the sum is taken in four lanes.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn exp_sum(s: &mut [f32]) -> f32 {
    let n = s.len();
    let p = s.as_mut_ptr();
    let whole = n & !3;
    let mut mv = vdupq_n_f32(f32::NEG_INFINITY);
    // `fmaxnm` skips a NaN score, as `softmax`'s `f32::max` does
    for i in (0..whole).step_by(4) {
        mv = vmaxnmq_f32(mv, vld1q_f32(p.add(i)));
    }
    let max = s[whole..].iter().fold(vmaxnmvq_f32(mv), |m, &v| m.max(v));
    let (m4, mut sv) = (vdupq_n_f32(max), vdupq_n_f32(0.0));
    for i in (0..whole).step_by(4) {
        let e = exp_neg4(vsubq_f32(vld1q_f32(p.add(i)), m4));
        vst1q_f32(p.add(i), e);
        sv = vaddq_f32(sv, e);
    }
    let mut sum = vaddvq_f32(sv);
    for v in &mut s[whole..] {
        *v = exp_neg(*v - max);
        sum += *v;
    }
    sum
}
