//! Next-token sampling with mlx_lm's semantics (`mlx_lm/sample_utils.py` 0.32.2: `make_sampler`,
//! `apply_top_p` / `apply_min_p` / `apply_top_k`, `make_repetition_penalty`), stated exactly so
//! that every implementation (the CPU sampler here, `cuda/sample.cu`, `metal/sample.metal`) keeps
//! the same tokens whatever its reduction order, and checked against the slow full-sort
//! `reference_kept` below.
//!
//! For logits `x` (after the repetition penalty: the distinct ids of the last `context` tokens,
//! prompt included, divided by the penalty when positive, multiplied when negative):
//! - temperature 0: the first index of the largest `x` (numpy's argmax);
//! - else, with `M = max x` and each token's mass `q_i = rint(exp(x_i - M) * 2^40)` (an integer,
//!   so sums are exact in any order; `T` their total):
//!   - **top-p** (0 < p < 1) keeps token `i` iff the mass of tokens strictly more likely than it
//!     is below `floor(P * T / 2^24)`, `P = round(p * 2^24)`. This is mlx_lm 0.32's rule
//!     (`mass_above >= top_p * total_mass` is dropped, and the threshold is a *value*, so tied
//!     tokens stay or go together), with the mass in fixed point;
//!   - **min-p** (!= 0) then keeps `x_i - M >= ln(min_p)`;
//!   - **top-k** (0 < k < vocab) then keeps the first `k` survivors by (value desc, index asc),
//!     which is what MLX's CPU `argpartition` gives on ties (checked by the oracle's tie cases);
//!   - -inf logits are masked tokens and never kept (mlx_lm's masks leave them -inf);
//!   - the token is `argmax(((x_i - M) / temperature) + g_i)` over the kept ones, `g_i` a
//!     Gumbel variate from a counter-based hash of (seed, counter, i): mlx_lm's
//!     `categorical(logprobs / temp)` is the same Gumbel-max draw with another random stream.
//!
//! The log-probability reported with a token is `x_id - M - ln(sum exp(x_i - M))` (after the
//! penalty, before the masks and the temperature).

pub mod op;

use std::cmp::Ordering;

/// Fixed-point scale of a token's probability mass (relative to the most likely token).
pub const MASS_SHIFT: u32 = 40;
/// Recent tokens a repetition penalty can cover (mlx_lm's default context is 20).
pub const MAX_RECENT: usize = 64;
/// Bytes of `SampleState` as the kernels read it.
pub const STATE_BYTES: usize = 24 + 4 * MAX_RECENT;

/// What the user asked for (`--temperature`, `--top-p`, ...), as mlx_lm takes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerParams {
    pub temperature: f32,
    /// Active when in (0, 1), like mlx_lm.
    pub top_p: f32,
    /// Active when non-zero.
    pub min_p: f32,
    /// Active when 0 < k < vocab (mlx_lm refuses k >= vocab; here it keeps everything).
    pub top_k: usize,
    /// mlx_lm's sign-aware multiplicative penalty; active when neither 0 nor 1.
    pub repetition_penalty: f32,
    pub repetition_context: usize,
}

impl Default for SamplerParams {
    /// The tuned bot's settings.
    fn default() -> Self {
        SamplerParams {
            temperature: 0.95,
            top_p: 0.9,
            min_p: 0.0,
            top_k: 0,
            repetition_penalty: 1.0,
            repetition_context: 20,
        }
    }
}

impl SamplerParams {
    /// Temperature 0: the argmax.
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            top_p: 1.0,
            ..Self::default()
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(format!("top-p must be in [0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min-p must be in [0, 1], got {}", self.min_p));
        }
        let p = self.repetition_penalty;
        if !(p >= 0.0 && p.is_finite()) {
            return Err(format!(
                "repetition penalty must be a finite number >= 0, got {p}"
            ));
        }
        if self.repetition_context > MAX_RECENT {
            return Err(format!(
                "repetition context must be at most {MAX_RECENT} tokens, got {}",
                self.repetition_context
            ));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn penalty_active(&self) -> bool {
        let p = self.repetition_penalty;
        p != 0.0 && p != 1.0 && self.repetition_context > 0
    }

    /// The constants every implementation works from, for a vocabulary of `vocab` tokens.
    pub fn resolve(&self, vocab: usize) -> KernelParams {
        let top_p24 = if self.top_p > 0.0 && self.top_p < 1.0 {
            ((self.top_p as f64 * (1u64 << 24) as f64).round() as u32).clamp(1, (1 << 24) - 1)
        } else {
            0
        };
        KernelParams {
            greedy: self.is_greedy() as u32,
            inv_temp: if self.is_greedy() {
                0.0
            } else {
                1.0 / self.temperature
            },
            top_p24,
            ln_min_p: if self.min_p != 0.0 {
                (self.min_p as f64).ln() as f32
            } else {
                f32::NEG_INFINITY
            },
            top_k: if self.top_k > 0 && self.top_k < vocab {
                self.top_k as u32
            } else {
                0
            },
            penalty: if self.penalty_active() {
                self.repetition_penalty
            } else {
                1.0
            },
        }
    }
}

/// The resolved sampler, as the kernels take it (`struct SampleParams` in `cuda/sample.cu` and
/// `metal/sample.metal`): inactive filters are 0 (`top_p24`, `top_k`) or -inf (`ln_min_p`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelParams {
    pub greedy: u32,
    pub inv_temp: f32,
    pub top_p24: u32,
    pub ln_min_p: f32,
    pub top_k: u32,
    pub penalty: f32,
}

/// Per-token inputs of the kernels (`struct SampleState`): the draw and the recent distinct ids.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SampleState {
    pub seed: u64,
    pub counter: u64,
    pub n_recent: u32,
    pub pad: u32,
    pub recent: [u32; MAX_RECENT],
}

impl SampleState {
    /// `recent` beyond `MAX_RECENT` ids is cut (`SamplerParams::validate` keeps the context
    /// within it).
    pub fn new(d: Draw, recent: &[u32]) -> Self {
        let mut s = SampleState {
            seed: d.seed,
            counter: d.counter,
            n_recent: recent.len().min(MAX_RECENT) as u32,
            pad: 0,
            recent: [0; MAX_RECENT],
        };
        s.recent[..s.n_recent as usize].copy_from_slice(&recent[..s.n_recent as usize]);
        s
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(STATE_BYTES);
        b.extend_from_slice(&self.seed.to_le_bytes());
        b.extend_from_slice(&self.counter.to_le_bytes());
        b.extend_from_slice(&self.n_recent.to_le_bytes());
        b.extend_from_slice(&self.pad.to_le_bytes());
        for r in self.recent {
            b.extend_from_slice(&r.to_le_bytes());
        }
        b
    }
}

impl KernelParams {
    pub fn to_bytes(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        let words = [
            self.greedy,
            self.inv_temp.to_bits(),
            self.top_p24,
            self.ln_min_p.to_bits(),
            self.top_k,
            self.penalty.to_bits(),
        ];
        for (i, w) in words.iter().enumerate() {
            b[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        b
    }
}

/// What the kernels report back: the token, its log-probability, a non-finite flag.
pub fn decode_kernel_output(out: [u32; 3]) -> Result<Sampled, NonFinite> {
    if out[2] != 0 {
        return Err(NonFinite);
    }
    Ok(Sampled {
        id: out[0],
        logprob: f32::from_bits(out[1]),
    })
}

/// The Metal sampler's source: `metal/sample.metal` with `kernels/sample.h` in place of its
/// `#include` (the Metal compiler gets one string; the shim compiles the file as it is).
pub fn metal_source() -> String {
    include_str!("../metal/sample.metal").replace(
        "#include \"../kernels/sample.h\"",
        include_str!("../kernels/sample.h"),
    )
}

/// Vocabularies the kernels handle: the index radix select takes two 10-bit digits.
pub const MAX_KERNEL_VOCAB: usize = 1 << 20;

/// Bytes the sampler kernel writes for `vocab` logits: three u32 words
/// (`decode_kernel_output`), then with `want_keep` one kept-or-not byte per token.
pub fn kernel_out_len(vocab: usize, want_keep: bool) -> usize {
    12 + if want_keep { vocab } else { 0 }
}

/// Which draw this is: a post's seed and the index of the token within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draw {
    pub seed: u64,
    pub counter: u64,
}

/// One sampling step: the sampler, the recent distinct ids its penalty covers, the draw.
#[derive(Debug, Clone, Copy)]
pub struct SampleStep<'a> {
    pub params: KernelParams,
    pub recent: &'a [u32],
    pub draw: Draw,
}

/// A chosen token and its log-probability under the (penalized) model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub id: u32,
    pub logprob: f32,
}

/// The logits held NaN or +inf (or nothing finite): the model's arithmetic broke down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the model produced NaN/Inf logits")]
pub struct NonFinite;

/// Cephes' single-precision exp polynomial, as `sample_exp` in `kernels/sample.h`.
pub(crate) mod exp_consts {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const C1: f32 = 0.693_359_4;
    pub const C2: f32 = -2.121_944_4e-4;
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
    /// Below this, exp is 0 (2^n would leave the normal range).
    pub const FLOOR: f32 = -87.0;
}

/// `exp(x)` for `x <= 0` exactly as every backend computes it: a range reduction and a
/// degree-5 polynomial with every multiply-add fused (so the result is the same bits on the
/// CPU, CUDA and Metal), 0 below -87 and for -inf. Within 2 ulp of the true value.
#[inline]
pub fn exp_neg(x: f32) -> f32 {
    use exp_consts::*;
    if x.is_nan() || x < FLOOR {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-C1, x);
    let r = n.mul_add(-C2, r);
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `exp(x - M)` as fixed-point mass: `e * 2^40` is exact in f32, so rounding it is too.
#[inline]
pub fn mass(e: f32) -> u64 {
    (e * (1u64 << MASS_SHIFT) as f32).round_ties_even() as u64
}

/// `floor(P * total / 2^24)` in 64-bit integers (total < 2^58).
#[inline]
pub fn top_p_limit(total: u64, top_p24: u32) -> u64 {
    let p = top_p24 as u64;
    p * (total >> 24) + ((p * (total & 0xFF_FFFF)) >> 24)
}

/// SplitMix64's finalizer.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Wellons' lowbias32 (`sample_hash32` in the kernels).
#[inline]
fn hash32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The per-token key of draw `d` (one 64-bit mix of seed and counter).
#[inline]
pub fn draw_key(d: Draw) -> u64 {
    mix(d.seed ^ mix(d.counter.wrapping_add(0x9E37_79B9_7F4A_7C15)))
}

/// A uniform in (0, 1) for token `i` of draw `d`: 24 bits of a counter-based hash, so any
/// device computes the same one without a shared random state.
#[inline]
pub fn uniform(d: Draw, i: u32) -> f32 {
    uniform_keyed(draw_key(d), i)
}

#[inline]
fn uniform_keyed(key: u64, i: u32) -> f32 {
    uniform_of_hash(hash32(
        hash32(i.wrapping_mul(0x9E37_79B9) ^ key as u32) ^ (key >> 32) as u32,
    ))
}

/// `(top 24 bits + 0.5) / 2^24`, but never 1: in f32 the top value, 2^24 - 0.5, rounds to 2^24
/// (ties to even), and a uniform of 1 is a Gumbel variate of +inf, a draw that would win
/// whatever its logit (once in 2^24 kept tokens). That one value takes the largest f32 below 1.
#[inline]
fn uniform_of_hash(h: u32) -> f32 {
    if h >> 8 == 0x00FF_FFFF {
        return 1.0 - f32::EPSILON / 2.0;
    }
    ((h >> 8) as f32 + 0.5) * (1.0 / (1u32 << 24) as f32)
}

/// The Gumbel variate `-ln(-ln(u))` of `uniform(d, i)`.
#[inline]
pub fn gumbel(d: Draw, i: u32) -> f32 {
    gumbel_keyed(draw_key(d), i)
}

/// `gumbel` with the draw's key computed once.
#[inline]
pub fn gumbel_keyed(key: u64, i: u32) -> f32 {
    gumbel_of(uniform_keyed(key, i))
}

#[inline]
fn gumbel_of(u: f32) -> f32 {
    -(-u.ln()).ln()
}

/// A uniform below which the Gumbel variate is certainly below `g`: `exp(-exp(-(g - 0.01)))`
/// in f64. The margin is thousands of times the f32 error of `gumbel_of` (a few ulps of
/// values under 18), so no draw the bound skips could have reached `g` once rounded.
fn uniform_floor(g: f32) -> f64 {
    (-(-(g as f64 - 0.01)).exp()).exp()
}

/// The distinct ids among the last `context` of `history`, for the penalty.
pub fn recent_distinct(history: &[u32], context: usize, out: &mut Vec<u32>) {
    out.clear();
    out.extend_from_slice(&history[history.len().saturating_sub(context)..]);
    out.sort_unstable();
    out.dedup();
}

/// mlx_lm's repetition penalty on `recent` (distinct ids).
pub fn apply_penalty(logits: &mut [f32], recent: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    for &id in recent {
        if let Some(x) = logits.get_mut(id as usize) {
            *x = if *x < 0.0 { *x * penalty } else { *x / penalty };
        }
    }
}

/// Max (first index on ties), and an error for NaN, +inf or no finite entry (-inf entries are
/// masked tokens and allowed).
pub(crate) fn max_argmax(x: &[f32]) -> Result<(f32, u32), NonFinite> {
    let (mut m, mut arg, mut bad) = (f32::NEG_INFINITY, 0u32, false);
    for (i, &v) in x.iter().enumerate() {
        bad |= v.is_nan() || v == f32::INFINITY;
        if v > m {
            m = v;
            arg = i as u32;
        }
    }
    if bad || m == f32::NEG_INFINITY {
        return Err(NonFinite);
    }
    Ok((m, arg))
}

/// A u32 that orders like the float (-0 and +0 alike), as the kernels' `sample_key`.
#[inline]
pub fn order_key(v: f32) -> u32 {
    let mut b = v.to_bits();
    if b & 0x7FFF_FFFF == 0 {
        b = 0;
    }
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// (value desc, index asc): the order top-k takes survivors in.
#[inline]
pub(crate) fn rank(a: (f32, u32), b: (f32, u32)) -> Ordering {
    order_key(b.0).cmp(&order_key(a.0)).then(a.1.cmp(&b.1))
}

/// The slow reference: every token sorted, the rules of the module header applied one by one.
/// Returns the kept ids, ascending (penalty not applied: pass penalized logits).
pub fn reference_kept(x: &[f32], p: &KernelParams) -> Result<Vec<u32>, NonFinite> {
    let (m, arg) = max_argmax(x)?;
    if p.greedy != 0 {
        return Ok(vec![arg]);
    }
    let n = x.len();
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_by(|&a, &b| rank((x[a as usize], a), (x[b as usize], b)));
    let mut keep = vec![true; n];
    if p.top_p24 != 0 {
        let q: Vec<u64> = x.iter().map(|&v| mass(exp_neg(v - m))).collect();
        let limit = top_p_limit(q.iter().sum(), p.top_p24);
        let (mut above, mut j) = (0u64, 0);
        while j < n {
            let v = x[order[j] as usize];
            let start = j;
            let mut group = 0;
            while j < n && x[order[j] as usize] == v {
                group += q[order[j] as usize];
                j += 1;
            }
            if above >= limit {
                for &i in &order[start..j] {
                    keep[i as usize] = false;
                }
            }
            above += group;
        }
    }
    for (k, &v) in keep.iter_mut().zip(x) {
        *k &= v - m >= p.ln_min_p && v > f32::NEG_INFINITY;
    }
    if p.top_k != 0 {
        let mut seen = 0;
        for &i in &order {
            if keep[i as usize] {
                seen += 1;
                keep[i as usize] = seen <= p.top_k;
            }
        }
    }
    Ok((0..n as u32).filter(|&i| keep[i as usize]).collect())
}

/// The reference draw over `reference_kept`: the Gumbel-max of the module header.
pub fn reference_sample(x: &[f32], p: &KernelParams, d: Draw) -> Result<Sampled, NonFinite> {
    let kept = reference_kept(x, p)?;
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + x.iter().map(|&v| exp_neg(v - m) as f64).sum::<f64>().ln() as f32;
    let id = if p.greedy != 0 {
        kept[0]
    } else {
        best_draw(kept.iter().map(|&i| (x[i as usize], i)), m, p.inv_temp, d)
    };
    Ok(Sampled {
        id,
        logprob: x[id as usize] - lse,
    })
}

/// argmax of `(x - m) * inv_temp + gumbel` over `(x, id)` pairs; ties to the lowest id.
pub(crate) fn best_draw(
    kept: impl Iterator<Item = (f32, u32)>,
    m: f32,
    inv_temp: f32,
    d: Draw,
) -> u32 {
    let key = draw_key(d);
    let (mut best, mut best_id) = (f32::NEG_INFINITY, u32::MAX);
    // No `(x - m) * inv_temp` is above 0 (x <= m), so a token whose Gumbel variate is below
    // `best` cannot win: its uniform is compared with `floor` instead of taking two logarithms
    // (a flat distribution keeps most of the vocabulary, and then nearly every token is
    // skipped so). The ids are exactly those of the plain loop (`best_draw_plain`, tested).
    let screen = inv_temp >= 0.0 && inv_temp.is_finite();
    let mut floor = 0f64;
    for (v, i) in kept {
        let u = uniform_keyed(key, i);
        if (u as f64) < floor && v <= m {
            continue;
        }
        let s = (v - m) * inv_temp + gumbel_of(u);
        if s > best || (s == best && i < best_id) {
            best = s;
            best_id = i;
            if screen {
                floor = uniform_floor(best);
            }
        }
    }
    if best_id == u32::MAX {
        // every kept logit was -inf: the first one
        best_id = 0;
    }
    best_id
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Logits of the shapes the sampler must get right, shared by every backend's tests.
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Named seeded cases: peaked, flat, exact ties, -inf entries, a real-looking spread.
    pub fn logit_cases(vocab: usize, seed: u64) -> Vec<(String, Vec<f32>)> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let normal = |rng: &mut rand::rngs::StdRng, s: f32| -> f32 {
            // Box-Muller
            let (u, v): (f32, f32) = (rng.random::<f32>().max(1e-9), rng.random());
            s * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        };
        let mut cases = Vec::new();
        let spread: Vec<f32> = (0..vocab).map(|_| normal(&mut rng, 3.0)).collect();
        cases.push(("spread".to_string(), spread));
        let mut peaked: Vec<f32> = (0..vocab).map(|_| normal(&mut rng, 1.0)).collect();
        peaked[rng.random_range(0..vocab)] += 12.0;
        peaked[rng.random_range(0..vocab)] += 10.0;
        cases.push(("peaked".into(), peaked));
        cases.push(("flat".into(), vec![0.25; vocab]));
        // few distinct values: ties at every boundary
        let ties: Vec<f32> = (0..vocab)
            .map(|_| rng.random_range(0..6) as f32 * 0.5)
            .collect();
        cases.push(("ties".into(), ties));
        let mut masked: Vec<f32> = (0..vocab).map(|_| normal(&mut rng, 2.0)).collect();
        for v in masked.iter_mut() {
            if rng.random::<f32>() < 0.5 {
                *v = f32::NEG_INFINITY;
            }
        }
        cases.push(("neg_inf".into(), masked));
        let mut one_left = vec![f32::NEG_INFINITY; vocab];
        one_left[vocab / 3] = 1.0;
        cases.push(("one_finite".into(), one_left));
        cases
    }

    /// The sampler settings every implementation is checked with.
    pub fn param_cases() -> Vec<super::SamplerParams> {
        use super::SamplerParams as P;
        let base = P {
            temperature: 0.95,
            top_p: 1.0,
            min_p: 0.0,
            top_k: 0,
            repetition_penalty: 1.0,
            repetition_context: 20,
        };
        let mut v = vec![P::greedy(), base, P::default()];
        for top_p in [0.0, 1e-6, 0.3, 0.9, 0.999] {
            v.push(P { top_p, ..base });
        }
        for min_p in [0.05, 0.5, 1.0] {
            v.push(P { min_p, ..base });
        }
        for top_k in [1, 5, 100, 1 << 30] {
            v.push(P { top_k, ..base });
        }
        v.push(P {
            top_p: 0.95,
            min_p: 0.05,
            top_k: 20,
            ..base
        });
        v.push(P {
            top_p: 0.5,
            top_k: 3,
            temperature: 2.0,
            ..base
        });
        v.push(P {
            repetition_penalty: 1.3,
            ..P::default()
        });
        v.push(P {
            repetition_penalty: 0.7,
            temperature: 0.0,
            ..P::default()
        });
        v
    }

    /// Ids a penalty covers in the checks.
    pub fn recent(vocab: usize) -> Vec<u32> {
        let mut r = vec![0, 2, (vocab - 1) as u32];
        r.sort_unstable();
        r.dedup();
        r
    }

    /// `SampleOp` on `dev` keeps exactly the reference's tokens and draws the reference's token
    /// (or, at a near-tie of Gumbel scores, one whose score is within rounding of it), for every
    /// case of `logit_cases` and `param_cases`, at the test vocabularies and Qwen3's.
    /// `configure` picks a backend's variant of the op (e.g. CUDA's one-block kernel).
    pub fn check_device_sampler(
        dev: &candle_core::Device,
        configure: impl Fn(&mut crate::engine::sample::op::SampleOp),
    ) {
        use crate::engine::sample::op::{split_output, SampleOp};
        for vocab in [7usize, 512, 5000, 151_936] {
            let mut cases = logit_cases(vocab, vocab as u64);
            if vocab > 100_000 {
                cases.truncate(2);
            }
            let recent = recent(vocab);
            for (name, x) in cases {
                let t = candle_core::Tensor::from_vec(x.clone(), (1, vocab), dev).unwrap();
                for sp in param_cases() {
                    let p = sp.resolve(vocab);
                    let mut pen = x.clone();
                    apply_penalty(&mut pen, &recent, p.penalty);
                    let want_kept = reference_kept(&pen, &p).unwrap();
                    for counter in 0..3 {
                        let d = Draw { seed: 9, counter };
                        let mut op = SampleOp::new(p, SampleState::new(d, &recent));
                        op.want_keep = true;
                        configure(&mut op);
                        let bytes = t.apply_op1_no_bwd(&op).unwrap().to_vec1::<u8>().unwrap();
                        let (w, mask) = split_output(&bytes);
                        let got = decode_kernel_output(w).unwrap();
                        let want = reference_sample(&pen, &p, d).unwrap();
                        let what = format!("{name} vocab {vocab} {sp:?} counter {counter}");
                        if p.greedy == 0 {
                            let kept: Vec<u32> = (0..vocab as u32)
                                .filter(|&i| mask[i as usize] != 0)
                                .collect();
                            assert_eq!(kept, want_kept, "{what}");
                        }
                        if got.id != want.id {
                            let m = pen.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                            let score = |i: u32| (pen[i as usize] - m) * p.inv_temp + gumbel(d, i);
                            let gap = (score(got.id) - score(want.id)).abs();
                            assert!(
                                want_kept.contains(&got.id) && gap < 1e-4,
                                "{what}: got {} want {} (score gap {gap})",
                                got.id,
                                want.id
                            );
                        }
                        let err = (got.logprob - want.logprob).abs();
                        assert!(
                            err < 2e-3 || got.logprob == want.logprob,
                            "{what}: logprob {err}"
                        );
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::sample::CpuSampler;
    use crate::engine::sample::testutil::*;

    /// Every hash maps strictly inside (0, 1), the top one included, so every Gumbel variate
    /// is finite; the order of the hashes is kept.
    #[test]
    fn uniforms_of_the_extreme_hashes_are_inside_the_interval() {
        let top = uniform_of_hash(u32::MAX);
        assert!(top < 1.0, "the top hash gives {top}");
        assert!(gumbel_of(top).is_finite());
        assert!(uniform_of_hash(0xFFFF_FEFF) < top);
        assert!(uniform_of_hash(0) > 0.0 && gumbel_of(uniform_of_hash(0)).is_finite());
    }

    /// `best_draw` without the screen: every kept token's Gumbel variate computed.
    fn best_draw_plain(kept: &[(f32, u32)], m: f32, inv_temp: f32, d: Draw) -> u32 {
        let (mut best, mut best_id) = (f32::NEG_INFINITY, u32::MAX);
        for &(v, i) in kept {
            let s = (v - m) * inv_temp + gumbel(d, i);
            if s > best || (s == best && i < best_id) {
                (best, best_id) = (s, i);
            }
        }
        if best_id == u32::MAX {
            0
        } else {
            best_id
        }
    }

    /// The screened draw picks the plain loop's id on every logit case (flat, ties, -inf
    /// entries, spread, peaked), over all tokens and over the top half, at four temperatures
    /// and 64 draws each.
    #[test]
    fn screened_draw_is_the_plain_draw() {
        for (name, x) in logit_cases(20_000, 11) {
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let all: Vec<(f32, u32)> = x.iter().copied().zip(0..).collect();
            let mut top = all.clone();
            top.sort_by(|a, b| b.0.total_cmp(&a.0));
            top.truncate(all.len() / 2);
            for kept in [&all, &top] {
                for inv_temp in [0.25f32, 1.0, 1.0 / 0.7, 8.0] {
                    for counter in 0..64 {
                        let d = Draw { seed: 5, counter };
                        assert_eq!(
                            best_draw(kept.iter().copied(), m, inv_temp, d),
                            best_draw_plain(kept, m, inv_temp, d),
                            "{name}, 1/T {inv_temp}, draw {counter}, {} kept",
                            kept.len()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn fast_sampler_keeps_the_reference_set_and_draws_from_it() {
        let mut s = CpuSampler::new();
        for vocab in [7, 512, 5000] {
            for (name, x) in logit_cases(vocab, vocab as u64) {
                for sp in param_cases() {
                    let p = sp.resolve(vocab);
                    let kept = reference_kept(&x, &p).unwrap();
                    assert!(!kept.is_empty(), "{name} {sp:?}");
                    for counter in 0..8 {
                        let d = Draw { seed: 3, counter };
                        let want = reference_sample(&x, &p, d).unwrap();
                        let got = s.sample(&mut x.clone(), &[], &p, d).unwrap();
                        assert_eq!(got.id, want.id, "{name} vocab {vocab} {sp:?}");
                        assert!(kept.binary_search(&got.id).is_ok());
                        let err = (got.logprob - want.logprob).abs();
                        assert!(err <= 1e-4 || got.logprob == want.logprob, "{err}");
                    }
                }
            }
        }
    }

    #[test]
    fn top_p_ties_stay_or_go_together() {
        // masses 4:2:2:1 (x = ln): the two middle tokens are tied
        let x: Vec<f32> = [4f32, 2.0, 2.0, 1.0].iter().map(|v| v.ln()).collect();
        let p = |top_p| {
            SamplerParams {
                top_p,
                ..SamplerParams::default()
            }
            .resolve(4)
        };
        // the mass above the tied pair is 4/9 and above the last token 8/9
        assert_eq!(reference_kept(&x, &p(0.44)).unwrap(), vec![0]);
        assert_eq!(reference_kept(&x, &p(0.45)).unwrap(), vec![0, 1, 2]);
        assert_eq!(reference_kept(&x, &p(0.88)).unwrap(), vec![0, 1, 2]);
        assert_eq!(reference_kept(&x, &p(0.9)).unwrap(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn penalty_is_sign_aware_and_counts_each_id_once() {
        let mut l = vec![2.0, -2.0, 1.0];
        let mut recent = Vec::new();
        recent_distinct(&[0, 1, 1], 20, &mut recent);
        apply_penalty(&mut l, &recent, 2.0);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
        recent_distinct(&[2, 0, 1, 1], 2, &mut recent);
        assert_eq!(recent, vec![1]);
    }

    #[test]
    fn nan_and_inf_logits_are_errors() {
        let p = SamplerParams::default().resolve(3);
        let d = Draw {
            seed: 0,
            counter: 0,
        };
        let mut s = CpuSampler::new();
        for bad in [
            vec![0.0, f32::NAN, 1.0],
            vec![0.0, f32::INFINITY, 1.0],
            vec![f32::NEG_INFINITY; 3],
        ] {
            assert_eq!(s.sample(&mut bad.clone(), &[], &p, d), Err(NonFinite));
            assert_eq!(reference_kept(&bad, &p), Err(NonFinite));
        }
    }

    /// Draws over many counters follow softmax(x / T) restricted to the kept set: a chi-square
    /// test at p = 0.001 on a small vocabulary, for plain temperature and with top-k.
    #[test]
    fn draws_follow_the_categorical_distribution() {
        let x = [1.0f32, 0.2, -0.5, 2.0, 0.0, -3.0, 1.5, 0.7];
        for (sp, df_crit) in [
            // chi-square critical values at p = 0.001 for 7 and 3 degrees of freedom
            (
                SamplerParams {
                    temperature: 0.8,
                    top_p: 1.0,
                    ..SamplerParams::default()
                },
                24.32,
            ),
            (
                SamplerParams {
                    temperature: 1.3,
                    top_p: 1.0,
                    top_k: 4,
                    ..SamplerParams::default()
                },
                16.27,
            ),
        ] {
            let p = sp.resolve(x.len());
            let kept = reference_kept(&x, &p).unwrap();
            let w: Vec<f64> = kept
                .iter()
                .map(|&i| ((x[i as usize] / sp.temperature) as f64).exp())
                .collect();
            let z: f64 = w.iter().sum();
            let n = 200_000u64;
            let mut counts = vec![0u64; x.len()];
            let mut s = CpuSampler::new();
            for counter in 0..n {
                let d = Draw { seed: 11, counter };
                counts[s.sample(&mut x.to_vec(), &[], &p, d).unwrap().id as usize] += 1;
            }
            let chi2: f64 = kept
                .iter()
                .zip(&w)
                .map(|(&i, wi)| {
                    let e = n as f64 * wi / z;
                    (counts[i as usize] as f64 - e).powi(2) / e
                })
                .sum();
            let outside: u64 = (0..x.len() as u32)
                .filter(|i| !kept.contains(i))
                .map(|i| counts[i as usize])
                .sum();
            assert_eq!(outside, 0);
            assert!(chi2 < df_crit, "chi2 {chi2:.2} for {sp:?}: {counts:?}");
        }
    }

    #[test]
    fn the_sampler_op_on_the_cpu_agrees_with_the_reference() {
        check_device_sampler(&candle_core::Device::Cpu, |_| {});
    }

    /// The MSL sampler (`kernels/sample.h` as Metal compiles it) under the C++ shim keeps the
    /// reference's set and draws the reference's token, with 64 and 256 lanes.
    #[test]
    fn msl_sampler_matches_the_reference_under_the_shim() {
        let runner = crate::engine::metal::shim::runner("sample_runner");
        let mut checked = 0;
        for (vocab, threads) in [(7usize, 64usize), (512, 64), (3000, 256)] {
            let recent = recent(vocab);
            for (name, x) in logit_cases(vocab, 17 + vocab as u64) {
                for sp in param_cases() {
                    let p = sp.resolve(vocab);
                    let d = Draw {
                        seed: 4,
                        counter: checked,
                    };
                    let dir = tempfile::tempdir().unwrap();
                    let f = |n: &str| dir.path().join(n);
                    let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
                    std::fs::write(f("x.bin"), xb).unwrap();
                    std::fs::write(f("params.bin"), p.to_bytes()).unwrap();
                    std::fs::write(f("state.bin"), SampleState::new(d, &recent).to_bytes())
                        .unwrap();
                    let shape: Vec<u8> = [vocab as u32, 1]
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect();
                    std::fs::write(f("shape.bin"), shape).unwrap();
                    let st = std::process::Command::new(&runner)
                        .arg(dir.path())
                        .arg(threads.to_string())
                        .status()
                        .unwrap();
                    assert!(st.success());
                    let out = std::fs::read(f("out.bin")).unwrap();
                    let w =
                        |i: usize| u32::from_le_bytes(out[4 * i..4 * i + 4].try_into().unwrap());
                    let got = decode_kernel_output([w(0), w(1), w(2)]).unwrap();
                    let mut pen = x.clone();
                    apply_penalty(&mut pen, &recent, p.penalty);
                    let want = reference_sample(&pen, &p, d).unwrap();
                    let what = format!("{name} vocab {vocab} {sp:?}");
                    assert_eq!(got.id, want.id, "{what}");
                    assert!((got.logprob - want.logprob).abs() < 1e-3, "{what}");
                    if p.greedy == 0 {
                        let keep = std::fs::read(f("keep.bin")).unwrap();
                        let kept: Vec<u32> = (0..vocab as u32)
                            .filter(|&i| keep[i as usize] == 1)
                            .collect();
                        assert_eq!(kept, reference_kept(&pen, &p).unwrap(), "{what}");
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked > 200);
    }

    #[test]
    fn metal_source_has_the_kernel_core_spliced_in() {
        let src = metal_source();
        assert!(!src.contains("#include \"../kernels"));
        assert!(src.contains("KFN void sample_block("));
        assert!(src.find("KFN void sample_block(") < src.find("kernel void sample_f32("));
    }

    /// `exp_neg` stays within 2 ulp of the true exponential.
    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (got, want) = (exp_neg(x) as f64, (x as f64).exp());
            let ulp = f32::EPSILON as f64 * want;
            worst = worst.max((got - want).abs() / ulp);
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn uniforms_are_in_the_open_interval_and_distinct() {
        let d = Draw {
            seed: 5,
            counter: 9,
        };
        let us: Vec<f32> = (0..1000).map(|i| uniform(d, i)).collect();
        assert!(us.iter().all(|&u| u > 0.0 && u < 1.0));
        let mut sorted = us.clone();
        sorted.sort_by(f32::total_cmp);
        sorted.dedup();
        assert!(sorted.len() > 990);
        let other = Draw {
            seed: 5,
            counter: 10,
        };
        assert_ne!(uniform(d, 3), uniform(other, 3));
    }
}
