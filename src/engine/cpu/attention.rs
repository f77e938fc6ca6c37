//! The attention core on the CPU over plain slices: per-head q/k RMSNorm, half-split RoPE,
//! a growing KV cache, causal softmax attention with grouped KV heads. Same arithmetic as the
//! candle-op path in `qwen3.rs` (which the GPU backends use and the tests compare against), minus
//! its per-op allocations and the KV copies a strided cache view costs every step.

use rayon::prelude::*;

use crate::engine::cpu::quant::dot;

/// Keys and values of the tokens seen so far: row t holds `n_kv * head_dim` values.
#[derive(Debug, Default, Clone)]
pub struct HostKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl HostKv {
    pub fn clear(&mut self) {
        self.k.clear();
        self.v.clear();
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
    for (row, head) in x.chunks_exact_mut(hd).enumerate() {
        let t = row / heads;
        norm_rope(
            head,
            w,
            eps,
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
    }
}

/// One attention step for `l` new tokens at cache position `offset`. `q` is (L, Hq*D), `k` and
/// `v` (L, Hkv*D); `cos`/`sin` (L, D/2). Appends k/v to `kv`; returns (L, Hq*D).
#[allow(clippy::too_many_arguments)]
pub fn attend(
    d: &Dims,
    mut q: Vec<f32>,
    mut k: Vec<f32>,
    v: &[f32],
    q_norm: &[f32],
    k_norm: &[f32],
    cos: &[f32],
    sin: &[f32],
    kv: &mut HostKv,
) -> Vec<f32> {
    let (nh, nkv, hd) = (d.n_heads, d.n_kv, d.head_dim);
    let l = q.len() / (nh * hd);
    norm_rope_rows(&mut q, nh, hd, q_norm, d.eps, cos, sin);
    norm_rope_rows(&mut k, nkv, hd, k_norm, d.eps, cos, sin);
    let offset = kv.k.len() / (nkv * hd);
    kv.k.extend_from_slice(&k);
    kv.v.extend_from_slice(v);
    let scale = (hd as f32).powf(-0.5);
    let rep = nh / nkv;
    let mut out = vec![0f32; l * nh * hd];
    // one task per (query head): its rows of `out` are strided, so collect then scatter
    let avx2 = crate::engine::cpu::isa::active().avx2();
    let head = |h: usize| {
        let hd_ = Head {
            q: &q,
            kv,
            h,
            g: h / rep,
            nh,
            nkv,
            hd,
            l,
            offset,
            scale,
        };
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU has AVX2 and FMA (`isa` detected them).
            return unsafe { hd_.run_avx2() };
        }
        let _ = avx2;
        hd_.run()
    };
    let per_head: Vec<Vec<f32>> = (0..nh).into_par_iter().map(head).collect();
    for (h, o) in per_head.iter().enumerate() {
        for i in 0..l {
            out[(i * nh + h) * hd..(i * nh + h + 1) * hd].copy_from_slice(&o[i * hd..(i + 1) * hd]);
        }
    }
    out
}

/// One query head's causal attention over the cache: (L, D) outputs.
struct Head<'a> {
    q: &'a [f32],
    kv: &'a HostKv,
    h: usize,
    g: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    l: usize,
    offset: usize,
    scale: f32,
}

impl Head<'_> {
    /// The same code compiled for AVX2 + FMA (8-wide dot products and updates; the default
    /// build targets baseline x86-64, 4-wide SSE2).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self) -> Vec<f32> {
        self.run()
    }

    #[inline(always)]
    fn run(&self) -> Vec<f32> {
        let Head {
            q,
            kv,
            h,
            g,
            nh,
            nkv,
            hd,
            l,
            offset,
            scale,
        } = *self;
        let mut o = vec![0f32; l * hd];
        let mut scores = vec![0f32; offset + l];
        for i in 0..l {
            let qh = &q[(i * nh + h) * hd..(i * nh + h + 1) * hd];
            let visible = offset + i + 1; // causal: positions 0..=offset+i
            let mut max = f32::NEG_INFINITY;
            for (t, s) in scores[..visible].iter_mut().enumerate() {
                let kt = &kv.k[(t * nkv + g) * hd..(t * nkv + g + 1) * hd];
                *s = dot(qh, kt) * scale;
                max = max.max(*s);
            }
            let mut sum = 0f32;
            for s in &mut scores[..visible] {
                *s = (*s - max).exp();
                sum += *s;
            }
            let oi = &mut o[i * hd..(i + 1) * hd];
            for (t, &p) in scores[..visible].iter().enumerate() {
                let vt = &kv.v[(t * nkv + g) * hd..(t * nkv + g + 1) * hd];
                let p = p / sum;
                for (a, b) in oi.iter_mut().zip(vt) {
                    *a += p * b;
                }
            }
        }
        o
    }
}
