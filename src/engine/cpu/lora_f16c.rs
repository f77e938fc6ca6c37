//! Rank-8 LoRA loops on f16 copies (`lora::Half`) with F16C's `vcvtph2ps` (every AVX2 CPU has
//! it): `x @ a` a piece at a time and `@ b` over whole blocks of `b`, the bits of
//! `lora::project_piece_body` and `lora::add_b_body` (their slow references, compared in the
//! tests below). Why: the portable loops widen each f16 in six integer and float operations
//! (`Half::widen`, which any instruction set vectorizes); here a load and one conversion. On
//! the Zen 4 those two loops were 2.6% of a `--synthetic-lora` decode's samples, most of them
//! on the widening (0.6B shape, 2 threads, rank 8 on 7 projections x 16 layers).

use crate::engine::lora::{Half, LANES};

/// Whether the loops here may run: the active instruction set has AVX2 and FMA (so
/// `BOT_CPU_ISA=scalar` keeps the portable loops) and the CPU has F16C.
pub fn usable() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::engine::cpu::isa::active().avx2() && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `out[j] = Σ_k x[k] a[k][j]` for rank 8 (`a` [x.len(), 8]) in `project_piece_body`'s four
/// chains (input `k` in chain `k % 4`, each a product then an add, the chains summed
/// `(t0 + t1) + (t2 + t3)`): the same bits.
///
/// # Safety
/// The CPU has AVX2 and F16C (`usable`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn project8(a: &[Half], x: &[f32], out: &mut [f32; 8]) {
    use std::arch::x86_64::*;
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
/// The CPU has AVX2 and F16C (`usable`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn add_b8(blocks: &[Half], c: &[f32; 8], y: &mut [f32]) {
    use std::arch::x86_64::*;
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::engine::lora::{add_b, block_b, project_piece, Stored, PIECE};
    use rand::{Rng, SeedableRng};

    fn halves(rng: &mut rand::rngs::StdRng, n: usize, s: f32) -> Vec<Half> {
        (0..n)
            .map(|_| Half::narrow(rng.random_range(-s..s)).expect("finite"))
            .collect()
    }

    /// Both loops give the portable bodies' bits (the slow references, run through the f32
    /// copies of the same values with `BOT_CPU_ISA`'s choice bypassed), over input lengths
    /// that end mid-chain, several pieces, `y` ranges starting and ending mid-block, and
    /// subnormal and signed-zero halves; fails rather than skips where the CPU lacks F16C
    /// and AVX2 (every x86-64 CPU this project runs on has them).
    #[test]
    fn f16c_loops_match_portable_bodies() {
        assert!(
            std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("avx2"),
            "this x86-64 CPU lacks F16C or AVX2"
        );
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        for inp in [1, 3, 4, 7, 64, 1023, 1024, 1029, 3072] {
            let mut a = halves(&mut rng, inp * 8, 0.05);
            a[0] = Half::narrow(3.0e-7).expect("subnormal"); // f16 subnormal
            a[inp * 8 - 1] = Half::narrow(-0.0).expect("zero");
            let x: Vec<f32> = (0..inp).map(|_| rng.random_range(-4.0..4.0)).collect();
            let wide: Vec<f32> = a
                .iter()
                .map(|h| crate::engine::lora::Elem::widen(*h))
                .collect();
            for p in 0..inp.div_ceil(PIECE) {
                let k = (p * PIECE).min(inp)..((p + 1) * PIECE).min(inp);
                let mut got = [0f32; 8];
                // SAFETY: asserted above.
                unsafe { project8(&a[k.start * 8..k.end * 8], &x[k.clone()], &mut got) };
                let mut want = [0f32; 8];
                crate::engine::lora::project_piece_portable(&wide, &x, p, &mut want);
                assert_eq!(
                    got.map(f32::to_bits),
                    want.map(f32::to_bits),
                    "inp {inp} piece {p}"
                );
                assert!(got.iter().any(|&v| v != 0.0));
                // and `project_piece`, which picks this loop for f16 copies
                let mut via = [0f32; 8];
                project_piece(Stored::F16(&a), &x, p, &mut via);
                assert_eq!(via.map(f32::to_bits), want.map(f32::to_bits));
            }
        }
        for out in [8, 70, 256, 1000] {
            let b: Vec<f32> = halves(&mut rng, 8 * out, 0.02)
                .iter()
                .map(|h| crate::engine::lora::Elem::widen(*h))
                .collect();
            let wide = block_b(&b, 8, out);
            let bb: Vec<Half> = wide
                .iter()
                .map(|&v| Half::narrow(v).expect("exact"))
                .collect();
            let c: [f32; 8] = std::array::from_fn(|_| rng.random_range(-2.0..2.0));
            let y0: Vec<f32> = (0..out).map(|_| rng.random_range(-1.0..1.0)).collect();
            for (first, len) in [
                (0, out),
                (3, out - 3),
                (8, out - 8),
                (5, 2),
                (0, out / 8 * 8),
            ] {
                let mut want = y0[first..first + len].to_vec();
                crate::engine::lora::add_b_portable(&wide, &c, first, &mut want);
                let mut got = y0[first..first + len].to_vec();
                add_b(Stored::F16(&bb), &c, first, &mut got);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "out {out} first {first} len {len}"
                );
                assert!(len < 8 || got != y0[first..first + len]);
            }
            // whole blocks straight through the kernel
            let whole = out / LANES * LANES;
            let mut got = y0[..whole].to_vec();
            // SAFETY: asserted above.
            unsafe { add_b8(&bb[..whole * 8], &c, &mut got) };
            let mut want = y0[..whole].to_vec();
            crate::engine::lora::add_b_portable(&wide, &c, 0, &mut want);
            assert_eq!(got, want, "out {out}");
        }
    }
}
