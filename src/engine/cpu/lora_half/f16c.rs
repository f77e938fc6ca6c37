//! The rank-8 LoRA loops of `lora_half` on x86-64, with F16C's `vcvtph2ps` (every AVX2 CPU
//! has it): an f16 row of `a` or run of `b` widened by one load and one conversion.

use std::arch::x86_64::*;

use crate::engine::lora::{Half, LANES};

/// `out[j] = Σ_k x[k] a[k][j]` for rank 8 (`a` [x.len(), 8]) in `project_piece_body`'s four
/// chains (input `k` in chain `k % 4`, each a product then an add, the chains summed
/// `(t0 + t1) + (t2 + t3)`): the same bits.
///
/// # Safety
/// The CPU has AVX2 and F16C (`super::usable`).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn project8(a: &[Half], x: &[f32], out: &mut [f32; 8]) {
    assert_eq!(a.len(), x.len() * 8, "a is [x.len(), 8]");
    // a row of `a` is 8 halves: 16 bytes
    let rows = a.as_ptr() as *const __m128i;
    let mut t = [_mm256_setzero_ps(); 4];
    let n = x.len();
    let mut k = 0;
    while k + 4 <= n {
        for (c, tc) in t.iter_mut().enumerate() {
            let av = _mm256_cvtph_ps(_mm_loadu_si128(rows.add(k + c)));
            // mul then add, not an FMA: the portable loop rounds the product
            *tc = _mm256_add_ps(
                *tc,
                _mm256_mul_ps(_mm256_set1_ps(*x.get_unchecked(k + c)), av),
            );
        }
        k += 4;
    }
    for (c, tc) in t.iter_mut().enumerate().take(n - k) {
        let av = _mm256_cvtph_ps(_mm_loadu_si128(rows.add(k + c)));
        *tc = _mm256_add_ps(
            *tc,
            _mm256_mul_ps(_mm256_set1_ps(*x.get_unchecked(k + c)), av),
        );
    }
    let s = _mm256_add_ps(_mm256_add_ps(t[0], t[1]), _mm256_add_ps(t[2], t[3]));
    _mm256_storeu_ps(out.as_mut_ptr(), s);
}

/// `y[n] += Σ_j c[j] b[j][n]` for rank 8 over whole blocks (`blocks`: `y.len() / LANES` blocks
/// of `lora::block_b`, each 8 runs of `LANES` halves), in `add_b_body`'s order: the eight
/// products, then `((p0 + p4) + (p1 + p5)) + ((p2 + p6) + (p3 + p7))`, then the add to `y`.
///
/// # Safety
/// The CPU has AVX2 and F16C (`super::usable`).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn add_b8(blocks: &[Half], c: &[f32; 8], y: &mut [f32]) {
    const _: () = assert!(LANES == 8, "a block's run is one vector of 8 f32");
    assert!(y.len().is_multiple_of(LANES) && blocks.len() == y.len() * 8);
    let mut cv = [_mm256_setzero_ps(); 8];
    for (v, &cj) in cv.iter_mut().zip(c) {
        *v = _mm256_set1_ps(cj);
    }
    for (i, yv) in y.chunks_exact_mut(LANES).enumerate() {
        let runs = blocks.as_ptr().add(i * 8 * LANES) as *const __m128i;
        let mut p = [_mm256_setzero_ps(); 8];
        for (j, pj) in p.iter_mut().enumerate() {
            *pj = _mm256_mul_ps(cv[j], _mm256_cvtph_ps(_mm_loadu_si128(runs.add(j))));
        }
        let s = _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(p[0], p[4]), _mm256_add_ps(p[1], p[5])),
            _mm256_add_ps(_mm256_add_ps(p[2], p[6]), _mm256_add_ps(p[3], p[7])),
        );
        let at = yv.as_mut_ptr();
        _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), s));
    }
}
