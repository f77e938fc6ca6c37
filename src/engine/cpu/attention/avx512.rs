//! The attention kernels of `Group::walk` in AVX-512 (Zen 4 and 5, Ice Lake and later Xeons):
//! the AVX2 kernels' structure in 16 lanes. A key's dot products take half the steps, and P·V
//! holds a whole head of 128 values of both heads of a pair in 16 registers, so the
//! probabilities and value rows are walked once instead of four times. The softmax stays the
//! AVX2 one (its exps are a small part). The sums are the same terms in another order.

use std::arch::x86_64::*;

use super::{exp_sum_avx2, prefetch_rows, sum4, KvElem, Lanes, AHEAD};

pub(super) struct Avx512;

lanes!(Avx512, exp_sum_avx2);

/// Sixteen cached values at `p` as f32: widened from f16, or loaded.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn load16<E: KvElem>(p: *const E) -> __m512 {
    if E::HALF {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    } else {
        _mm512_loadu_ps(p as *const f32)
    }
}

/// A zmm's two halves added: the same eight lane sums `sum4` then folds.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn halves(a: __m512) -> __m256 {
    // (`extractf64x4` is AVX-512 F; the f32x8 form would need DQ)
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    _mm256_add_ps(_mm512_castps512_ps256(a), hi)
}

/// `scores2` of the AVX2 kernels in 16 lanes (`hd` a multiple of 16): four keys at a time,
/// each key's slice loaded once for both heads, eight independent chains.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    let mut t = 0;
    while t + 4 <= visible {
        let k0 = kp.add(t * hd);
        prefetch_rows(k0.wrapping_add(AHEAD * hd), 4 * hd);
        let (mut a, mut b) = ([_mm512_setzero_ps(); 4], [_mm512_setzero_ps(); 4]);
        for d in (0..hd).step_by(16) {
            let (x, y) = (_mm512_loadu_ps(qa.add(d)), _mm512_loadu_ps(qb.add(d)));
            for j in 0..4 {
                let k = load16(k0.add(j * hd + d));
                a[j] = _mm512_fmadd_ps(x, k, a[j]);
                if P {
                    b[j] = _mm512_fmadd_ps(y, k, b[j]);
                }
            }
        }
        let s = sum4(a.map(|v| halves(v)), scale);
        _mm_storeu_ps(sa[t..t + 4].as_mut_ptr(), s);
        if P {
            let s = sum4(b.map(|v| halves(v)), scale);
            _mm_storeu_ps(sb[t..t + 4].as_mut_ptr(), s);
        }
        t += 4;
    }
    for t in t..visible {
        let kt = kp.add(t * hd);
        let (mut a, mut b) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for d in (0..hd).step_by(16) {
            let k = load16(kt.add(d));
            a = _mm512_fmadd_ps(_mm512_loadu_ps(qa.add(d)), k, a);
            if P {
                b = _mm512_fmadd_ps(_mm512_loadu_ps(qb.add(d)), k, b);
            }
        }
        sa[t] = _mm512_reduce_add_ps(a) * scale;
        if P {
            sb[t] = _mm512_reduce_add_ps(b) * scale;
        }
    }
}

/// `pv2` of the AVX2 kernels in 16 lanes (`hd` a multiple of 16): 128 values of each head of
/// a pair at a time (a Qwen3 head whole), 256 of a head alone.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
        while d0 + 128 <= hd {
            pv_block::<E, P, 8>(pa, pb, vp, hd, d0, oa, ob);
            d0 += 128;
        }
    } else {
        while d0 + 256 <= hd {
            pv_block::<E, P, 16>(pa, pb, vp, hd, d0, oa, ob);
            d0 += 256;
        }
    }
    while d0 + 64 <= hd {
        pv_block::<E, P, 4>(pa, pb, vp, hd, d0, oa, ob);
        d0 += 64;
    }
    while d0 < hd {
        pv_block::<E, P, 1>(pa, pb, vp, hd, d0, oa, ob);
        d0 += 16;
    }
}

/// `pv2` for outputs `d0..d0 + 16·W`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    let (mut a, mut b) = ([_mm512_setzero_ps(); W], [_mm512_setzero_ps(); W]);
    for (t, (&p, &q)) in pa.iter().zip(pb).enumerate() {
        if d0 == 0 {
            prefetch_rows(vp.wrapping_add((t + AHEAD) * hd), hd);
        }
        let (x, y, vt) = (_mm512_set1_ps(p), _mm512_set1_ps(q), vp.add(t * hd + d0));
        for j in 0..W {
            let v = load16(vt.add(16 * j));
            a[j] = _mm512_fmadd_ps(x, v, a[j]);
            if P {
                b[j] = _mm512_fmadd_ps(y, v, b[j]);
            }
        }
    }
    for j in 0..W {
        _mm512_storeu_ps(oa.add(d0 + 16 * j), a[j]);
        if P {
            _mm512_storeu_ps(ob.add(d0 + 16 * j), b[j]);
        }
    }
}
