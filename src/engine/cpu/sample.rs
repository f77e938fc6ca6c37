//! The CPU sampler: the rules of `sample.rs` in three passes over the logits (max; the
//! exponentials, their total mass and the tokens near the top; the draw over the kept ones),
//! with thresholds found by selection among the candidates, never by sorting the vocabulary.
//! The exponential pass is AVX2+FMA where the CPU has it (`exp_neg` computed 8 lanes at a time,
//! the same bits as the scalar form). Buffers are kept between tokens.

use crate::engine::sample::{
    apply_penalty, best_draw, exp_neg, mass, max_argmax, rank, top_p_limit, Draw, KernelParams,
    NonFinite, Sampled,
};

/// The sampler first looks only at tokens within this many nats of the most likely one.
const CANDIDATE_CUT: f32 = -16.0;

#[derive(Debug, Clone, Copy)]
struct Cand {
    v: f32,
    i: u32,
    q: u64,
}

/// The CPU sampler: one pass for the max, one for the exponentials (and the tokens within
/// `CANDIDATE_CUT` of the max), then thresholds found by selection among those candidates
/// (all tokens only when they cannot decide, e.g. nearly flat distributions). Its buffers are
/// kept between tokens.
#[derive(Debug, Default)]
pub struct CpuSampler {
    pool: Vec<Cand>,
}

impl CpuSampler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Samples from `logits` (penalized in place first; `recent`: distinct ids).
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        recent: &[u32],
        p: &KernelParams,
        d: Draw,
    ) -> Result<Sampled, NonFinite> {
        apply_penalty(logits, recent, p.penalty);
        let x = &*logits;
        let (m, arg) = max_and_first(x)?;
        self.pool.clear();
        // one pass: the normalizer, the total mass, and the candidates near the top
        let Pass { sum, total, cmass } = exp_pass(x, m, &mut self.pool);
        let lse = m + sum.ln() as f32;
        if p.greedy != 0 {
            return Ok(Sampled {
                id: arg,
                logprob: x[arg as usize] - lse,
            });
        }
        // The candidates decide when the kept set cannot reach below them: top-p's mass is
        // reached among them, min-p's floor is above the cut, or top-k finds k of them.
        let mut all = self.pool.len() == x.len();
        let mut decided = all || p.ln_min_p >= CANDIDATE_CUT;
        let mut tau = f32::NEG_INFINITY;
        if p.top_p24 != 0 {
            let limit = top_p_limit(total, p.top_p24);
            if cmass < limit && !all {
                self.fill_all(x, m);
                all = true;
            }
            decided = true;
            tau = top_p_threshold(&mut self.pool, limit);
        }
        let keep = |c: &Cand| (c.v >= tau) & (c.v - m >= p.ln_min_p) & (c.v > f32::NEG_INFINITY);
        retain(&mut self.pool, keep);
        let k = p.top_k as usize;
        if !(decided || all || (k != 0 && self.pool.len() >= k)) {
            self.fill_all(x, m);
            retain(&mut self.pool, keep);
        }
        if k != 0 && self.pool.len() > k {
            self.pool
                .select_nth_unstable_by(k - 1, |a, b| rank((a.v, a.i), (b.v, b.i)));
            self.pool.truncate(k);
        }
        let id = best_draw(self.pool.iter().map(|c| (c.v, c.i)), m, p.inv_temp, d);
        Ok(Sampled {
            id,
            logprob: x[id as usize] - lse,
        })
    }

    fn fill_all(&mut self, x: &[f32], m: f32) {
        self.pool.clear();
        self.pool.extend(x.iter().enumerate().map(|(i, &v)| Cand {
            v,
            i: i as u32,
            q: mass(exp_neg(v - m)),
        }));
    }
}

/// `Vec::retain` without a branch on `keep` per token: each one is written to the next free
/// place and the place advances when it is kept (top-p cuts a flat distribution's pool
/// at a random place of every line, and there the branch is mispredicted half the time).
fn retain(pool: &mut Vec<Cand>, keep: impl Fn(&Cand) -> bool) {
    let mut n = 0;
    for j in 0..pool.len() {
        let c = pool[j];
        pool[n] = c;
        n += keep(&c) as usize;
    }
    pool.truncate(n);
}

/// Value buckets of `top_p_threshold`'s first pass.
const BUCKETS: usize = 2048;

/// The smallest value in `pool` whose strictly-greater mass is below `limit`. `pool` holds
/// every token at least as likely as its least likely member (an up-set), so that mass is
/// known within it; `pool` is reordered. A large pool (a flat distribution keeps most of the
/// vocabulary) is first bucketed by value, most likely first: the answer lies in the first
/// bucket whose running mass reaches `limit`, and only that bucket is searched.
fn top_p_threshold(pool: &mut [Cand], limit: u64) -> f32 {
    if pool.len() > 4 * BUCKETS {
        let (lo, hi) = pool
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), c| {
                (a.min(c.v), b.max(c.v))
            });
        if lo.is_finite() && hi.is_finite() && hi > lo {
            let scale = (BUCKETS - 1) as f32 / (hi - lo);
            // monotone: a larger value never lands in a later bucket, equal ones share one
            let at = |v: f32| (((hi - v) * scale) as usize).min(BUCKETS - 1);
            let mut mass = vec![0u64; BUCKETS];
            for c in pool.iter() {
                mass[at(c.v)] += c.q;
            }
            let mut above = 0u64;
            for (b, &mb) in mass.iter().enumerate() {
                if above + mb >= limit {
                    let mut n = 0;
                    for j in 0..pool.len() {
                        if at(pool[j].v) == b {
                            pool.swap(n, j);
                            n += 1;
                        }
                    }
                    return select_threshold(&mut pool[..n], limit, above);
                }
                above += mb;
            }
        }
    }
    select_threshold(pool, limit, 0)
}

/// `top_p_threshold` by weighted quickselect over `pool`, above which lies `base` mass of
/// tokens that all qualify: expected linear time, `pool` reordered.
fn select_threshold(pool: &mut [Cand], limit: u64, base: u64) -> f32 {
    let (mut lo, mut hi, mut base) = (0, pool.len(), base);
    let mut best = f32::INFINITY;
    while lo < hi {
        let s = &mut pool[lo..hi];
        let pivot = median3(s);
        let (gt, eq) = partition3(s, pivot);
        let above = base + s[..gt].iter().map(|c| c.q).sum::<u64>();
        if above < limit {
            best = pivot;
            base = above + s[gt..gt + eq].iter().map(|c| c.q).sum::<u64>();
            lo += gt + eq;
        } else {
            hi = lo + gt;
        }
    }
    best
}

fn median3(s: &[Cand]) -> f32 {
    let (a, b, c) = (s[0].v, s[s.len() / 2].v, s[s.len() - 1].v);
    a.max(b).min(a.min(b).max(c))
}

/// Reorders `s` as [> pivot][== pivot][< pivot]; returns the first two lengths.
fn partition3(s: &mut [Cand], pivot: f32) -> (usize, usize) {
    let (mut gt, mut i, mut lt) = (0, 0, s.len());
    while i < lt {
        if s[i].v > pivot {
            s.swap(gt, i);
            gt += 1;
            i += 1;
        } else if s[i].v < pivot {
            lt -= 1;
            s.swap(i, lt);
        } else {
            i += 1;
        }
    }
    (gt, lt - gt)
}

/// What the exponential pass gathers.
struct Pass {
    /// Sum of exp(x - M), for the normalizer.
    sum: f64,
    /// Total fixed-point mass.
    total: u64,
    /// Mass of the candidates pushed.
    cmass: u64,
}

/// `max_argmax` (first index of the max; NaN, +inf or nothing finite an error), vectorized.
fn max_and_first(x: &[f32]) -> Result<(f32, u32), NonFinite> {
    #[cfg(target_arch = "x86_64")]
    if crate::engine::cpu::isa::active().avx2() {
        // SAFETY: the CPU has AVX2 (`isa` detected it).
        return unsafe { avx2::max_and_first(x) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::engine::cpu::isa::active().neon() {
        // SAFETY: the CPU has NEON (`isa` detected it).
        return unsafe { neon::max_and_first(x) };
    }
    max_argmax(x)
}

/// The max as `max_argmax` returns it: the value at its first index (of -0 and +0 the first
/// one's sign, which a vector max does not keep), and that index.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn first_max(x: &[f32], i: usize) -> (f32, u32) {
    (x[i], i as u32)
}

/// exp(x - m) of every logit: the normalizer, the total mass, and the tokens within
/// `CANDIDATE_CUT` of `m` pushed to `pool`.
fn exp_pass(x: &[f32], m: f32, pool: &mut Vec<Cand>) -> Pass {
    #[cfg(target_arch = "x86_64")]
    if crate::engine::cpu::isa::active().avx2() {
        // SAFETY: the CPU has AVX2 and FMA (`isa` detected them).
        return unsafe { avx2::exp_pass(x, m, pool) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::engine::cpu::isa::active().neon() {
        // SAFETY: the CPU has NEON (`isa` detected it).
        return unsafe { neon::exp_pass(x, m, pool) };
    }
    exp_pass_scalar(
        x,
        m,
        pool,
        0,
        Pass {
            sum: 0.0,
            total: 0,
            cmass: 0,
        },
    )
}

/// Pushes token `i`, whose `exp(x[i] - M)` is `e`, to the candidates: its mass.
#[inline(always)]
fn push(pool: &mut Vec<Cand>, x: &[f32], i: usize, e: f32) -> u64 {
    let q = mass(e);
    pool.push(Cand {
        v: x[i],
        i: i as u32,
        q,
    });
    q
}

/// The scalar pass from `start` on, continuing `acc`.
#[inline(always)]
fn exp_pass_scalar(x: &[f32], m: f32, pool: &mut Vec<Cand>, start: usize, mut acc: Pass) -> Pass {
    for (i, &v) in x.iter().enumerate().skip(start) {
        let e = exp_neg(v - m);
        acc.sum += e as f64;
        let q = mass(e);
        acc.total += q;
        if v - m >= CANDIDATE_CUT {
            pool.push(Cand { v, i: i as u32, q });
            acc.cmass += q;
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::*;
    use crate::engine::sample::exp_consts::*;
    use std::arch::x86_64::*;

    /// `exp_neg` on 8 lanes: the same operations in the same order, so the same bits.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_neg8(x: __m256) -> __m256 {
        let valid = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(FLOOR));
        let x = _mm256_max_ps(x, _mm256_set1_ps(FLOOR));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-C1), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-C2), r);
        let mut p = _mm256_set1_ps(P[0]);
        for c in &P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e));
        _mm256_and_ps(_mm256_mul_ps(y, pow2), valid)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn max_and_first(x: &[f32]) -> Result<(f32, u32), NonFinite> {
        let chunks = x.len() / 8;
        let inf = _mm256_set1_ps(f32::INFINITY);
        let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
        // lanes stay all-ones while every value is below +inf (NaN compares false)
        let mut ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for c in 0..chunks {
            let v = _mm256_loadu_ps(x.as_ptr().add(8 * c));
            ok = _mm256_and_ps(ok, _mm256_cmp_ps::<_CMP_LT_OQ>(v, inf));
            mx = _mm256_max_ps(mx, v);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), mx);
        let mut m = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut bad = _mm256_movemask_ps(ok) != 0xFF;
        for &v in &x[8 * chunks..] {
            bad |= v.is_nan() || v == f32::INFINITY;
            m = m.max(v);
        }
        if bad || m == f32::NEG_INFINITY {
            return Err(NonFinite);
        }
        // the first index holding the max (as `v > m` scanning in order finds it)
        let mv = _mm256_set1_ps(m);
        for c in 0..chunks {
            let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(
                _mm256_loadu_ps(x.as_ptr().add(8 * c)),
                mv,
            ));
            if hit != 0 {
                return Ok(first_max(x, 8 * c + hit.trailing_zeros() as usize));
            }
        }
        let i = x[8 * chunks..].iter().position(|&v| v == m).unwrap_or(0);
        Ok(first_max(x, 8 * chunks + i))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_pass(x: &[f32], m: f32, pool: &mut Vec<Cand>) -> Pass {
        let (mv, cut) = (_mm256_set1_ps(m), _mm256_set1_ps(CANDIDATE_CUT));
        let mut sums = [_mm256_setzero_ps(); 2];
        let mut totals = _mm256_setzero_si256();
        let mut cmass = 0u64;
        let mut lanes = [0f32; 8];
        // e * 2^40 + 2^52 in f64 rounds to an integer (half to even, as `mass`) held in the
        // low mantissa bits: the mass is those bits minus the magic's
        let (scale, magic) = (
            _mm256_set1_pd((1u64 << 40) as f64),
            _mm256_set1_pd(4_503_599_627_370_496.0),
        );
        let chunks = x.len() / 8;
        for c in 0..chunks {
            let v = _mm256_loadu_ps(x.as_ptr().add(8 * c));
            let d = _mm256_sub_ps(v, mv);
            let e = exp_neg8(d);
            sums[c & 1] = _mm256_add_ps(sums[c & 1], e);
            for half in [_mm256_castps256_ps128(e), _mm256_extractf128_ps::<1>(e)] {
                let q = _mm256_add_pd(_mm256_mul_pd(_mm256_cvtps_pd(half), scale), magic);
                let q = _mm256_sub_epi64(_mm256_castpd_si256(q), _mm256_castpd_si256(magic));
                totals = _mm256_add_epi64(totals, q);
            }
            let mut near = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(d, cut)) as u32;
            if near != 0 {
                _mm256_storeu_ps(lanes.as_mut_ptr(), e);
            }
            while near != 0 {
                let l = near.trailing_zeros() as usize;
                near &= near - 1;
                cmass += push(pool, x, 8 * c + l, lanes[l]);
            }
        }
        let mut s = [0f32; 16];
        _mm256_storeu_ps(s.as_mut_ptr(), sums[0]);
        _mm256_storeu_ps(s.as_mut_ptr().add(8), sums[1]);
        let mut t = [0u64; 4];
        _mm256_storeu_si256(t.as_mut_ptr().cast(), totals);
        let acc = Pass {
            sum: s.iter().map(|&v| v as f64).sum(),
            total: t.iter().sum(),
            cmass,
        };
        exp_pass_scalar(x, m, pool, 8 * chunks, acc)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// The 8-lane exp is the scalar one, bit for bit, over the whole range it takes.
        #[test]
        fn vector_exp_matches_the_scalar_bits() {
            use crate::engine::cpu::isa::{tested_here, Isa};
            if !tested_here(Isa::Avx2, "vector_exp_matches_the_scalar_bits") {
                return;
            }
            let mut xs: Vec<f32> = (0..200_000).map(|i| -(i as f32) * 0.000_45).collect();
            xs.extend([
                0.0,
                -0.0,
                -86.99,
                -87.0,
                -87.01,
                -1e9,
                f32::NEG_INFINITY,
                -1e-30,
            ]);
            xs.resize(xs.len().next_multiple_of(8), -3.0);
            for c in xs.chunks_exact(8) {
                let mut out = [0f32; 8];
                // SAFETY: AVX2 and FMA checked above.
                unsafe {
                    _mm256_storeu_ps(out.as_mut_ptr(), exp_neg8(_mm256_loadu_ps(c.as_ptr())))
                };
                for (x, y) in c.iter().zip(out) {
                    assert_eq!(y.to_bits(), exp_neg(*x).to_bits(), "exp({x})");
                }
            }
        }
    }
}

/// The same passes in NEON's four lanes (every aarch64 CPU: Apple Silicon's, Graviton's), where
/// the portable loop spent ~3 ms a token at the 0.6B shape's 151936 logits (measured on x86-64
/// with `BOT_CPU_ISA=scalar`, whose loops the compiler vectorizes to 128 bits as it does for
/// NEON: the exp does not vectorize there).
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon {
    use super::*;
    use crate::engine::sample::exp_consts::*;
    use crate::engine::sample::MASS_SHIFT;
    use std::arch::aarch64::*;

    /// `exp_neg` on 4 lanes: the same operations in the same order (every multiply-add fused,
    /// rounding to nearest even), so the same bits; 0 where `x` is NaN or below `FLOOR`.
    #[target_feature(enable = "neon")]
    #[inline]
    pub(crate) unsafe fn exp_neg4(x: float32x4_t) -> float32x4_t {
        let valid = vcgeq_f32(x, vdupq_n_f32(FLOOR));
        let x = vmaxnmq_f32(x, vdupq_n_f32(FLOOR));
        let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(LOG2E)));
        let r = vfmaq_f32(x, n, vdupq_n_f32(-C1));
        let r = vfmaq_f32(r, n, vdupq_n_f32(-C2));
        let mut p = vdupq_n_f32(P[0]);
        for c in &P[1..] {
            p = vfmaq_f32(vdupq_n_f32(*c), p, r);
        }
        let y = vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), vdupq_n_f32(1.0));
        let e = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
        let pow2 = vreinterpretq_f32_s32(vshlq_n_s32::<23>(e));
        vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(vmulq_f32(y, pow2)), valid))
    }

    #[target_feature(enable = "neon")]
    pub(super) unsafe fn max_and_first(x: &[f32]) -> Result<(f32, u32), NonFinite> {
        let chunks = x.len() / 4;
        let inf = vdupq_n_f32(f32::INFINITY);
        let mut mx = vdupq_n_f32(f32::NEG_INFINITY);
        // lanes stay all-ones while every value is below +inf (NaN compares false)
        let mut ok = vdupq_n_u32(u32::MAX);
        for c in 0..chunks {
            let v = vld1q_f32(x.as_ptr().add(4 * c));
            ok = vandq_u32(ok, vcltq_f32(v, inf));
            mx = vmaxnmq_f32(mx, v);
        }
        let mut m = vmaxnmvq_f32(mx);
        let mut bad = vminvq_u32(ok) != u32::MAX;
        for &v in &x[4 * chunks..] {
            bad |= v.is_nan() || v == f32::INFINITY;
            m = m.max(v);
        }
        if bad || m == f32::NEG_INFINITY {
            return Err(NonFinite);
        }
        // the first index holding the max (as `v > m` scanning in order finds it)
        let mv = vdupq_n_f32(m);
        for c in 0..chunks {
            let hit = vceqq_f32(vld1q_f32(x.as_ptr().add(4 * c)), mv);
            if vmaxvq_u32(hit) != 0 {
                let mut lanes = [0u32; 4];
                vst1q_u32(lanes.as_mut_ptr(), hit);
                let l = lanes.iter().position(|&h| h != 0).unwrap_or(0);
                return Ok(first_max(x, 4 * c + l));
            }
        }
        let i = x[4 * chunks..].iter().position(|&v| v == m).unwrap_or(0);
        Ok(first_max(x, 4 * chunks + i))
    }

    #[target_feature(enable = "neon")]
    pub(super) unsafe fn exp_pass(x: &[f32], m: f32, pool: &mut Vec<Cand>) -> Pass {
        let (mv, cut) = (vdupq_n_f32(m), vdupq_n_f32(CANDIDATE_CUT));
        let mut sums = [vdupq_n_f32(0.0); 2];
        let mut totals = vdupq_n_u64(0);
        let mut cmass = 0u64;
        let mut lanes = [0f32; 4];
        // e · 2^40 is exact in f64 as in f32; `fcvtnu` rounds it half to even, as `mass`
        let scale = vdupq_n_f64((1u64 << MASS_SHIFT) as f64);
        let chunks = x.len() / 4;
        for c in 0..chunks {
            let v = vld1q_f32(x.as_ptr().add(4 * c));
            let d = vsubq_f32(v, mv);
            let e = exp_neg4(d);
            sums[c & 1] = vaddq_f32(sums[c & 1], e);
            let lo = vcvtnq_u64_f64(vmulq_f64(vcvt_f64_f32(vget_low_f32(e)), scale));
            let hi = vcvtnq_u64_f64(vmulq_f64(vcvt_high_f64_f32(e), scale));
            totals = vaddq_u64(totals, vaddq_u64(lo, hi));
            let near = vcgeq_f32(d, cut);
            if vmaxvq_u32(near) != 0 {
                let mut flags = [0u32; 4];
                vst1q_u32(flags.as_mut_ptr(), near);
                vst1q_f32(lanes.as_mut_ptr(), e);
                for l in (0..4).filter(|&l| flags[l] != 0) {
                    cmass += push(pool, x, 4 * c + l, lanes[l]);
                }
            }
        }
        let mut s = [0f32; 8];
        vst1q_f32(s.as_mut_ptr(), sums[0]);
        vst1q_f32(s.as_mut_ptr().add(4), sums[1]);
        let acc = Pass {
            sum: s.iter().map(|&v| v as f64).sum(),
            total: vaddvq_u64(totals),
            cmass,
        };
        exp_pass_scalar(x, m, pool, 4 * chunks, acc)
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::engine::sample::testutil::logit_cases;

        /// The 4-lane exp is the scalar one, bit for bit, over the whole range it takes.
        #[test]
        fn vector_exp_matches_the_scalar_bits() {
            let mut xs: Vec<f32> = (0..200_000).map(|i| -(i as f32) * 0.000_45).collect();
            xs.extend([
                0.0,
                -0.0,
                -86.99,
                -87.0,
                -87.01,
                -1e9,
                f32::NEG_INFINITY,
                -1e-30,
                f32::NAN,
                -f32::NAN,
                -0.5,
                -1.5,
            ]);
            xs.resize(xs.len().next_multiple_of(4), -3.0);
            for c in xs.chunks_exact(4) {
                let mut out = [0f32; 4];
                // SAFETY: every aarch64 CPU has NEON.
                unsafe { vst1q_f32(out.as_mut_ptr(), exp_neg4(vld1q_f32(c.as_ptr()))) };
                for (x, y) in c.iter().zip(out) {
                    assert_eq!(y.to_bits(), exp_neg(*x).to_bits(), "exp({x})");
                }
            }
        }

        /// The NEON passes give the portable ones' max, first index, masses and candidates
        /// (the f32 normalizer within rounding), on every logit case and odd lengths.
        #[test]
        fn passes_match_the_portable_ones() {
            for vocab in [3, 5, 4099] {
                for (name, x) in logit_cases(vocab, 11) {
                    // SAFETY: every aarch64 CPU has NEON.
                    let got = unsafe { max_and_first(&x) };
                    let want = max_argmax(&x);
                    assert_eq!(got.is_ok(), want.is_ok(), "{name}");
                    let (Ok((m, i)), Ok((wm, wi))) = (got, want) else {
                        continue;
                    };
                    assert_eq!((m.to_bits(), i), (wm.to_bits(), wi), "{name}");
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    // SAFETY: as above.
                    let p = unsafe { exp_pass(&x, m, &mut a) };
                    let zero = Pass {
                        sum: 0.0,
                        total: 0,
                        cmass: 0,
                    };
                    let q = exp_pass_scalar(&x, m, &mut b, 0, zero);
                    assert_eq!((p.total, p.cmass), (q.total, q.cmass), "{name}");
                    assert!((p.sum - q.sum).abs() <= 1e-5 * q.sum, "{name}");
                    let key = |c: &Cand| (c.i, c.v.to_bits(), c.q);
                    assert_eq!(
                        a.iter().map(key).collect::<Vec<_>>(),
                        b.iter().map(key).collect::<Vec<_>>(),
                        "{name}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sample::testutil::logit_cases;

    /// The bucketed threshold is the quickselect's over the whole pool: every logit case of a
    /// vocabulary-sized pool (flat, ties, spread, peaked, -inf entries), limits from a sliver of
    /// the mass to all of it.
    #[test]
    fn max_and_first_is_max_argmax() {
        let special = [
            -0.0,
            0.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            -1.0,
            3.5,
            f32::MIN_POSITIVE / 4.0,
        ];
        for n in 1..40usize {
            for seed in 0..60usize {
                let x: Vec<f32> = (0..n)
                    .map(|i| {
                        let h = (i * 2654435761 + seed * 40503) % 1009;
                        if h % 7 == 0 {
                            special[h % special.len()]
                        } else {
                            (h % 9) as f32 - 6.0
                        }
                    })
                    .collect();
                let (got, want) = (max_and_first(&x), max_argmax(&x));
                assert_eq!(got.is_ok(), want.is_ok(), "{x:?}");
                if let (Ok((m, i)), Ok((wm, wi))) = (got, want) {
                    assert_eq!((m.to_bits(), i), (wm.to_bits(), wi), "{x:?}");
                }
            }
        }
        // the first of a tie of zeros keeps its sign, in whole vectors and in the tail
        for n in [3, 5, 9, 17] {
            let mut x = vec![-1.0f32; n];
            x[n - 2] = -0.0;
            x[n - 1] = 0.0;
            let (m, i) = max_and_first(&x).unwrap();
            assert_eq!((m.to_bits(), i as usize), ((-0.0f32).to_bits(), n - 2));
        }
    }

    #[test]
    fn bucketed_top_p_threshold_is_the_plain_one() {
        for (name, x) in logit_cases(60_000, 3) {
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let pool: Vec<Cand> = x
                .iter()
                .enumerate()
                .map(|(i, &v)| Cand {
                    v,
                    i: i as u32,
                    q: mass(exp_neg(v - m)),
                })
                .collect();
            assert!(pool.len() > 4 * BUCKETS);
            let total: u64 = pool.iter().map(|c| c.q).sum();
            for f in [1e-6, 0.01, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0] {
                let limit = ((total as f64 * f) as u64).max(1);
                let want = select_threshold(&mut pool.clone(), limit, 0);
                let got = top_p_threshold(&mut pool.clone(), limit);
                assert_eq!(got.to_bits(), want.to_bits(), "{name}, {f} of the mass");
            }
        }
    }
}
