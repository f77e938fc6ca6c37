//! The attention core on the CPU over plain slices: per-head q/k RMSNorm, half-split RoPE,
//! a growing KV cache, causal softmax attention with grouped KV heads. The arithmetic of the
//! candle-op path in `qwen3.rs` (which the GPU backends use and the tests compare against) but
//! for the exp (the samplers' `exp_neg`, within 2 ulp), minus its per-op allocations and the
//! KV copies a strided cache view costs every step.

use rayon::prelude::*;

use crate::engine::cpu::quant::dot;
use crate::engine::cpu::team;

/// Keys and values of the tokens seen so far, one (T, D) block per KV head: a head's attention
/// then reads two contiguous streams. (Rows of `n_kv * head_dim` values put a head's
/// consecutive positions 4 KiB apart at the 0.6B shape, one page each, where the hardware
/// prefetcher stops. On a Zen 1 EPYC, 2 threads, a decode step's attention at 96 / 288 cached
/// positions: 111-113 / 329-332 us a layer before, 93-97 / 246-250 with this layout.)
#[derive(Debug, Default, Clone)]
pub struct HostKv {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl HostKv {
    pub fn clear(&mut self) {
        self.k.iter_mut().chain(&mut self.v).for_each(Vec::clear);
    }

    /// Cached positions.
    pub fn positions(&self, head_dim: usize) -> usize {
        self.k.first().map_or(0, |k| k.len() / head_dim)
    }

    /// Keeps the first `len` positions.
    pub fn truncate(&mut self, len: usize, head_dim: usize) {
        self.k
            .iter_mut()
            .chain(&mut self.v)
            .for_each(|h| h.truncate(len * head_dim));
    }

    /// Appends `k` and `v`, each (L, n_kv * head_dim).
    fn append(&mut self, k: &[f32], v: &[f32], n_kv: usize, head_dim: usize) {
        self.k.resize_with(n_kv, Vec::new);
        self.v.resize_with(n_kv, Vec::new);
        for (src, dst) in [(k, &mut self.k), (v, &mut self.v)] {
            for row in src.chunks_exact(n_kv * head_dim) {
                for (g, head) in row.chunks_exact(head_dim).enumerate() {
                    dst[g].extend_from_slice(head);
                }
            }
        }
    }
}

pub struct Dims {
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub eps: f32,
}

/// `x * rsqrt(mean(x^2) + eps) * w` (mlx `fast.rms_norm`) then RoPE at `cos`/`sin` (half width).
fn norm_rope(x: &mut [f32], w: &[f32], eps: f32, cos: &[f32], sin: &[f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for (v, g) in x.iter_mut().zip(w) {
        *v = *v * r * g;
    }
    let half = x.len() / 2;
    let (a, b) = x.split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] - x2 * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

/// `norm_rope` on every head of `x` (L, heads*D), token t taking row t of `cos`/`sin`.
fn norm_rope_rows(
    x: &mut [f32],
    heads: usize,
    hd: usize,
    w: &[f32],
    eps: f32,
    cos: &[f32],
    sin: &[f32],
) {
    let half = hd / 2;
    let token = |t: usize, x: &mut [f32]| {
        for head in x.chunks_exact_mut(hd) {
            norm_rope(
                head,
                w,
                eps,
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
        }
    };
    // a prompt's tokens split over threads (serially, 10 ms of a 64-token 0.6B prefill)
    let l = x.len() / (heads * hd);
    if l >= 8 {
        x.par_chunks_mut(heads * hd)
            .enumerate()
            .for_each(|(t, x)| token(t, x));
    } else {
        for (t, x) in x.chunks_exact_mut(heads * hd).enumerate() {
            token(t, x);
        }
    }
}

/// One attention step for `l` new tokens at cache position `offset`. `q` is (L, Hq*D), `k` and
/// `v` (L, Hkv*D); `cos`/`sin` (L, D/2). Appends k/v to `kv`; returns (L, Hq*D).
#[allow(clippy::too_many_arguments)]
pub fn attend(
    d: &Dims,
    q: Vec<f32>,
    k: Vec<f32>,
    v: &[f32],
    q_norm: &[f32],
    k_norm: &[f32],
    cos: &[f32],
    sin: &[f32],
    kv: &mut HostKv,
) -> Vec<f32> {
    let simd = crate::engine::cpu::isa::active().avx2();
    // with more threads than KV heads, a task a query head (each reads its K and V rows)
    let per_task = if rayon::current_num_threads() > d.n_kv {
        1
    } else {
        d.n_heads / d.n_kv
    };
    attend_with(d, q, k, v, q_norm, k_norm, cos, sin, kv, simd, per_task)
}

/// `attend` with the AVX2 + FMA kernels (`simd`, x86-64 only: the caller has checked the CPU)
/// or the portable loops, `per_task` query heads a task (a divisor of the heads a KV head has).
#[allow(clippy::too_many_arguments)]
fn attend_with(
    d: &Dims,
    mut q: Vec<f32>,
    mut k: Vec<f32>,
    v: &[f32],
    q_norm: &[f32],
    k_norm: &[f32],
    cos: &[f32],
    sin: &[f32],
    kv: &mut HostKv,
    simd: bool,
    per_task: usize,
) -> Vec<f32> {
    let (nh, nkv, hd) = (d.n_heads, d.n_kv, d.head_dim);
    let l = q.len() / (nh * hd);
    norm_rope_rows(&mut q, nh, hd, q_norm, d.eps, cos, sin);
    norm_rope_rows(&mut k, nkv, hd, k_norm, d.eps, cos, sin);
    let offset = kv.positions(hd);
    kv.append(&k, v, nkv, hd);
    let scale = (hd as f32).powf(-0.5);
    let rep = nh / nkv;
    let mut out = vec![0f32; l * nh * hd];
    // a task per KV head, for the query heads that share it, reads their K and V rows once
    // (with the layout above: 93-97 -> 79-84 us a layer at 96 positions, the measure of
    // `HostKv`); with `per_task` < `rep` they are read once a task. A task's rows of `out`
    // are strided, so collect then scatter
    let group = |h0: usize| {
        let grp = Group {
            q: &q,
            kv,
            g: h0 / rep,
            h0,
            rep: per_task,
            nh,
            hd,
            l,
            offset,
            scale,
        };
        #[cfg(target_arch = "x86_64")]
        if simd && hd % 8 == 0 {
            // SAFETY: the CPU has AVX2 and FMA (`isa` detected them, or the caller checked).
            return unsafe { grp.run_avx2() };
        }
        let _ = simd;
        grp.run()
    };
    debug_assert_eq!(rep % per_task, 0);
    let mut per_group: Vec<(usize, Vec<f32>)> = (0..nh)
        .step_by(per_task)
        .map(|h0| (h0, Vec::new()))
        .collect();
    team::for_each_mut(&mut per_group, |(h0, o)| *o = group(*h0));
    for (h0, o) in &per_group {
        for r in 0..per_task {
            let h = h0 + r;
            for i in 0..l {
                out[(i * nh + h) * hd..(i * nh + h + 1) * hd]
                    .copy_from_slice(&o[(r * l + i) * hd..(r * l + i + 1) * hd]);
            }
        }
    }
    out
}

/// Causal attention of `rep` query heads from `h0` on, which share KV head `g`, over the
/// cache: (rep, L, D) outputs. Each head's arithmetic is that of a head alone (same sums in
/// the same order); the heads only share the walk over the cached rows.
struct Group<'a> {
    q: &'a [f32],
    kv: &'a HostKv,
    g: usize,
    h0: usize,
    rep: usize,
    nh: usize,
    hd: usize,
    l: usize,
    offset: usize,
    scale: f32,
}

impl Group<'_> {
    /// `run` with AVX2 + FMA intrinsics (`hd` a multiple of 8). The portable loops leave the
    /// compiler one dependent chain per dot product (strict f32 order: no reassociation, no
    /// FMA contraction), so a q·k dot waits on 16 adds in a row, and P·V keeps its sums in
    /// memory. Here four keys' dots run as four independent chains that share each load of q,
    /// and P·V holds 64 output values in registers across all positions. The sums are the
    /// same terms in another order (FMA-rounded).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self) -> Vec<f32> {
        use std::arch::x86_64::*;
        let Group {
            q,
            kv,
            g,
            h0,
            rep,
            nh,
            hd,
            l,
            offset,
            scale,
        } = *self;
        debug_assert_eq!(hd % 8, 0);
        let (keys, values) = (&kv.k[g], &kv.v[g]);
        let mut o = vec![0f32; rep * l * hd];
        let t_max = offset + l;
        let mut probs = vec![0f32; rep * t_max];
        for i in 0..l {
            let visible = offset + i + 1;
            let (kp, vp) = (keys.as_ptr(), values.as_ptr());
            for r in 0..rep {
                let qp = q[(i * nh + h0 + r) * hd..][..hd].as_ptr();
                let sr = &mut probs[r * t_max..r * t_max + visible];
                let mut t = 0;
                while t + 4 <= visible {
                    let k0 = kp.add(t * hd);
                    let (mut a0, mut a1, mut a2, mut a3) = (
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                    );
                    for d in (0..hd).step_by(8) {
                        let qv = _mm256_loadu_ps(qp.add(d));
                        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0.add(d)), a0);
                        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0.add(hd + d)), a1);
                        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0.add(2 * hd + d)), a2);
                        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0.add(3 * hd + d)), a3);
                    }
                    // lanes (a0 0..3, a1 0..3, a2 0..3, a3 0..3 | the same of 4..7), then halves
                    let h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                    let s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                    _mm_storeu_ps(
                        sr[t..t + 4].as_mut_ptr(),
                        _mm_mul_ps(s4, _mm_set1_ps(scale)),
                    );
                    t += 4;
                }
                for (tt, s) in sr.iter_mut().enumerate().skip(t) {
                    let kt = kp.add(tt * hd);
                    let mut a = _mm256_setzero_ps();
                    for d in (0..hd).step_by(8) {
                        a = _mm256_fmadd_ps(
                            _mm256_loadu_ps(qp.add(d)),
                            _mm256_loadu_ps(kt.add(d)),
                            a,
                        );
                    }
                    *s = hsum256(a) * scale;
                }
                softmax(sr);
                // P·V: 64 (then 8) output values at a time, summed over every position
                let orow = o[(r * l + i) * hd..][..hd].as_mut_ptr();
                let mut d0 = 0;
                while d0 + 64 <= hd {
                    let mut acc = [_mm256_setzero_ps(); 8];
                    for (tt, &p) in sr.iter().enumerate() {
                        let (pv, vt) = (_mm256_set1_ps(p), vp.add(tt * hd + d0));
                        for (j, a) in acc.iter_mut().enumerate() {
                            *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt.add(8 * j)), *a);
                        }
                    }
                    for (j, a) in acc.iter().enumerate() {
                        _mm256_storeu_ps(orow.add(d0 + 8 * j), *a);
                    }
                    d0 += 64;
                }
                while d0 < hd {
                    let mut a = _mm256_setzero_ps();
                    for (tt, &p) in sr.iter().enumerate() {
                        a = _mm256_fmadd_ps(
                            _mm256_set1_ps(p),
                            _mm256_loadu_ps(vp.add(tt * hd + d0)),
                            a,
                        );
                    }
                    _mm256_storeu_ps(orow.add(d0), a);
                    d0 += 8;
                }
            }
        }
        o
    }

    #[inline(always)]
    fn run(&self) -> Vec<f32> {
        let Group {
            q,
            kv,
            g,
            h0,
            rep,
            nh,
            hd,
            l,
            offset,
            scale,
        } = *self;
        let (keys, values) = (&kv.k[g], &kv.v[g]);
        let mut o = vec![0f32; rep * l * hd];
        let t_max = offset + l;
        let mut scores = vec![0f32; rep * t_max];
        for i in 0..l {
            let visible = offset + i + 1; // causal: positions 0..=offset+i
            let qh = |r: usize| {
                let h = h0 + r;
                &q[(i * nh + h) * hd..(i * nh + h + 1) * hd]
            };
            for (t, kt) in keys.chunks_exact(hd).take(visible).enumerate() {
                for r in 0..rep {
                    scores[r * t_max + t] = dot(qh(r), kt) * scale;
                }
            }
            for r in 0..rep {
                softmax(&mut scores[r * t_max..r * t_max + visible]);
            }
            for (t, vt) in values.chunks_exact(hd).take(visible).enumerate() {
                for r in 0..rep {
                    let p = scores[r * t_max + t];
                    let oi = &mut o[(r * l + i) * hd..(r * l + i + 1) * hd];
                    for (a, b) in oi.iter_mut().zip(vt) {
                        *a += p * b;
                    }
                }
            }
        }
        o
    }
}

/// `s` -> softmax(s) in place: `exp(s - max) / Σ`.
#[inline(always)]
fn softmax(s: &mut [f32]) {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f32;
    for v in s.iter_mut() {
        // the samplers' exp (within 2 ulp of libm's, no call): 79-84 -> 76-77 us
        *v = crate::engine::sample::exp_neg(*v - max);
        sum += *v;
    }
    s.iter_mut().for_each(|v| *v /= sum);
}

/// The sum of the eight lanes of `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum256(a: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward attention over a flat (T, Hkv*D) cache: one head at a time, f64.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        nh: usize,
        nkv: usize,
        hd: usize,
        l: usize,
        offset: usize,
    ) -> Vec<f32> {
        let mut out = vec![0f32; l * nh * hd];
        for i in 0..l {
            for h in 0..nh {
                let g = h / (nh / nkv);
                let qh = &q[(i * nh + h) * hd..][..hd];
                let row = |c: &[f32], t: usize| c[(t * nkv + g) * hd..][..hd].to_vec();
                let s: Vec<f64> = (0..=offset + i)
                    .map(|t| {
                        row(keys, t)
                            .iter()
                            .zip(qh)
                            .map(|(a, b)| (a * b) as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (t, p) in e.iter().enumerate() {
                    for (d, v) in row(values, t).iter().enumerate() {
                        out[(i * nh + h) * hd + d] += (p / z * *v as f64) as f32;
                    }
                }
            }
        }
        out
    }

    /// Prefill then decode steps against the reference with the per-head cache, for 2 and 4
    /// query heads a KV head, then a truncated cache decoding again: |Δ| ≤ 1e-5. Norm weights of
    /// one and a zero angle make norm + RoPE a plain RMS normalization, applied here to the
    /// reference's inputs too.
    #[test]
    fn grouped_heads_match_the_reference() {
        #[cfg(target_arch = "x86_64")]
        let simd = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        #[cfg(not(target_arch = "x86_64"))]
        let simd = false;
        if !simd {
            eprintln!("attention: no AVX2 + FMA here, the portable loops only");
        }
        for (hd, simd) in [(64, false), (64, simd), (32, simd), (128, simd), (72, simd)] {
            for one_head_a_task in [false, true] {
                grouped_heads_at(hd, simd, one_head_a_task);
            }
        }
    }

    fn grouped_heads_at(hd: usize, simd: bool, one_head_a_task: bool) {
        let norm = |x: &mut [f32]| {
            for h in x.chunks_exact_mut(hd) {
                let r = 1.0 / (h.iter().map(|v| v * v).sum::<f32>() / hd as f32 + 1e-6).sqrt();
                h.iter_mut().for_each(|v| *v *= r);
            }
        };
        for (nh, nkv) in [(4, 2), (8, 2)] {
            let d = Dims {
                n_heads: nh,
                n_kv: nkv,
                head_dim: hd,
                eps: 1e-6,
            };
            let (w, cos, sin) = (
                vec![1f32; hd],
                vec![1f32; 64 * hd / 2],
                vec![0f32; 64 * hd / 2],
            );
            let val = |n: usize, seed: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| (((i * 31 + seed * 17) % 97) as f32 - 48.0) / 20.0)
                    .collect()
            };
            let mut kv = HostKv::default();
            let (mut keys, mut values) = (Vec::new(), Vec::new());
            for (step, l) in [5usize, 1, 1, 3].into_iter().enumerate() {
                if step == 3 {
                    kv.truncate(4, hd);
                    keys.truncate(4 * nkv * hd);
                    values.truncate(4 * nkv * hd);
                }
                let offset = kv.positions(hd);
                let (q, k, v) = (
                    val(l * nh * hd, step),
                    val(l * nkv * hd, step + 5),
                    val(l * nkv * hd, step + 9),
                );
                let got = attend_with(
                    &d,
                    q.clone(),
                    k.clone(),
                    &v,
                    &w,
                    &w,
                    &cos,
                    &sin,
                    &mut kv,
                    simd,
                    if one_head_a_task { 1 } else { nh / nkv },
                );
                let (mut qn, mut kn) = (q, k);
                norm(&mut qn);
                norm(&mut kn);
                keys.extend_from_slice(&kn);
                values.extend_from_slice(&v);
                let want = reference(&qn, &keys, &values, nh, nkv, hd, l, offset);
                let err = got
                    .iter()
                    .zip(&want)
                    .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
                assert!(
                    err <= 1e-5,
                    "hd {hd} simd {simd} one head a task {one_head_a_task} heads {nh}/{nkv} \
                     step {step}: max |Δ| {err}"
                );
                assert_eq!(kv.positions(hd), offset + l);
            }
        }
    }
}
