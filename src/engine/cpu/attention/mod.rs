//! The attention core on the CPU over plain slices: per-head q/k RMSNorm, half-split RoPE,
//! a growing KV cache, causal softmax attention with grouped KV heads. The arithmetic of the
//! candle-op path in `qwen3.rs` (which the GPU backends use and the tests compare against) but
//! for the exp (the samplers' `exp_neg`, within 2 ulp) and, with the `fast` and `int8` kernels,
//! keys and values stored as f16 (mlx_lm keeps them in the model's dtype, bf16 for MLX 4-bit
//! models: f16 rounds 8x finer), minus its per-op allocations and the KV copies a strided cache
//! view costs every step.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::engine::cpu::quant::dot;
use crate::engine::cpu::team;

/// `impl Lanes for $set`: the `scores2` and `pv2` in scope where it expands (each module's own),
/// and `$exp_sum`. (Defined before the kernel modules, which expand it too.)
macro_rules! lanes {
    ($set:ident, $exp_sum:path) => {
        impl Lanes for $set {
            #[inline(always)]
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
                scores2::<E, P>(qa, qb, kp, hd, visible, scale, sa, sb)
            }
            #[inline(always)]
            unsafe fn exp_sum(s: &mut [f32]) -> f32 {
                $exp_sum(s)
            }
            #[inline(always)]
            unsafe fn pv2<E: KvElem, const P: bool>(
                pa: &[f32],
                pb: &[f32],
                vp: *const E,
                hd: usize,
                oa: *mut f32,
                ob: *mut f32,
            ) {
                pv2::<E, P>(pa, pb, vp, hd, oa, ob)
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;
mod prompt;

/// A value of the KV cache: f32, or f16 for half the bytes. A decode step reads the whole
/// cache of every layer (at the 0.6B shape 229 KB a position in f32: ~22 MB a token at 96
/// positions, 6% of the 4-bit weights' bytes, and it grows with the context).
pub trait KvElem: Copy + Default + Send + Sync + std::fmt::Debug + 'static {
    /// f16 (converted with F16C on x86-64), else f32.
    const HALF: bool;
    /// `dst[i] = src[i]` rounded to this type (to nearest, ties to even).
    fn store(src: &[f32], dst: &mut [Self]);
    /// `dst[i] = src[i]` as f32 (exact).
    fn load(src: &[Self], dst: &mut [f32]);
}

impl KvElem for f32 {
    const HALF: bool = false;
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
}

/// f16's largest finite value.
const F16_MAX: f32 = 65504.0;

impl KvElem for f16 {
    const HALF: bool = true;
    /// Saturating: a value past f16's range is stored as ±65504, not as an infinity that would
    /// turn the softmax and the output into NaN (keys are RMS-normalized, values are not).
    fn store(src: &[f32], dst: &mut [f16]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("f16c") {
            // SAFETY: the CPU has F16C (and so AVX).
            return unsafe { store_f16c(src, dst) };
        }
        // SAFETY: every aarch64 CPU has NEON.
        #[cfg(target_arch = "aarch64")]
        return unsafe { neon::store_f16(src, dst) };
        #[cfg(not(target_arch = "aarch64"))]
        store_portable(src, dst)
    }
    fn load(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
}

/// `f16::store` through `half`'s slice conversion: the definition `store_f16c` and NEON's
/// `store_f16` match bit for bit (tested).
#[cfg_attr(target_arch = "aarch64", allow(dead_code))]
fn store_portable(src: &[f32], dst: &mut [f16]) {
    let mut buf = [0f32; 64];
    for (s, d) in src.chunks(64).zip(dst.chunks_mut(64)) {
        for (b, &v) in buf.iter_mut().zip(s) {
            *b = v.clamp(-F16_MAX, F16_MAX);
        }
        d.convert_from_f32_slice(&buf[..s.len()]);
    }
}

/// `f16::store` eight values an instruction: clamped to ±65504 (`max` then `min` with the value
/// second, so that a NaN passes through as `clamp` lets it), rounded to nearest even. `half`'s
/// slice conversion calls a function per eight values, which was a fifth of a 64-token
/// prompt's attention (Zen 5, 2 threads).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn store_f16c(src: &[f32], dst: &mut [f16]) {
    use std::arch::x86_64::*;
    assert_eq!(src.len(), dst.len());
    let (lo, hi) = (_mm256_set1_ps(-F16_MAX), _mm256_set1_ps(F16_MAX));
    let whole = src.len() & !7;
    for i in (0..whole).step_by(8) {
        let v = _mm256_loadu_ps(src.as_ptr().add(i));
        let v = _mm256_min_ps(hi, _mm256_max_ps(lo, v));
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
    }
    for (d, &v) in dst[whole..].iter_mut().zip(&src[whole..]) {
        *d = f16::from_f32(v.clamp(-F16_MAX, F16_MAX));
    }
}

/// Keys and values of the tokens seen so far, one (T, D) block per KV head: a head's attention
/// then reads two contiguous streams. (Rows of `n_kv * head_dim` values put a head's
/// consecutive positions 4 KiB apart at the 0.6B shape, one page each, where the hardware
/// prefetcher stops. On a Zen 1 EPYC, 2 threads, a decode step's attention at 96 / 288 cached
/// positions: 111-113 / 329-332 us a layer before, 93-97 / 246-250 with this layout.)
#[derive(Debug, Clone)]
pub struct Heads<E> {
    k: Vec<Vec<E>>,
    v: Vec<Vec<E>>,
}

impl<E> Default for Heads<E> {
    fn default() -> Self {
        Heads {
            k: Vec::new(),
            v: Vec::new(),
        }
    }
}

impl<E: KvElem> Heads<E> {
    fn clear(&mut self) {
        self.k.iter_mut().chain(&mut self.v).for_each(Vec::clear);
    }

    fn positions(&self, head_dim: usize) -> usize {
        self.k.first().map_or(0, |k| k.len() / head_dim)
    }

    fn truncate(&mut self, len: usize, head_dim: usize) {
        self.k
            .iter_mut()
            .chain(&mut self.v)
            .for_each(|h| h.truncate(len * head_dim));
    }

    /// Appends `k` and `v`, each (L, n_kv * head_dim). A prompt's rows go a task per head
    /// and kind (on the Xeon's 16 threads the serial stores were ~4% of the leading thread's
    /// time in a 64-token 0.6B prompt, the other 15 waiting).
    fn append(&mut self, k: &[f32], v: &[f32], n_kv: usize, head_dim: usize) {
        self.k.resize_with(n_kv, Vec::new);
        self.v.resize_with(n_kv, Vec::new);
        let l = k.len() / (n_kv * head_dim);
        // head `g`'s rows of `src` after the `dst` it has
        let one = |src: &[f32], g: usize, dst: &mut Vec<E>| {
            let at = dst.len();
            dst.resize(at + l * head_dim, E::default());
            let rows = src.chunks_exact(n_kv * head_dim);
            for (row, d) in rows.zip(dst[at..].chunks_exact_mut(head_dim)) {
                E::store(&row[g * head_dim..][..head_dim], d);
            }
        };
        if l < 8 {
            // a decode step's: no allocation between its regions
            self.k
                .iter_mut()
                .enumerate()
                .for_each(|(g, d)| one(k, g, d));
            self.v
                .iter_mut()
                .enumerate()
                .for_each(|(g, d)| one(v, g, d));
            return;
        }
        let ks = self.k.iter_mut().enumerate().map(|(g, d)| (k, g, d));
        let vs = self.v.iter_mut().enumerate().map(|(g, d)| (v, g, d));
        let mut parts: Vec<_> = ks.chain(vs).collect();
        team::for_each_mut(&mut parts, |(src, g, d)| one(src, *g, d));
    }
}

/// The cache of one layer, in f32 (`exact`) or f16 (`fast`, `int8`).
#[derive(Debug, Clone)]
pub enum HostKv {
    F32(Heads<f32>),
    F16(Heads<f16>),
}

impl Default for HostKv {
    fn default() -> Self {
        HostKv::F32(Heads::default())
    }
}

impl HostKv {
    /// An empty cache storing f16 (`half`) or f32.
    pub fn new(half: bool) -> Self {
        if half {
            HostKv::F16(Heads::default())
        } else {
            HostKv::F32(Heads::default())
        }
    }

    pub fn clear(&mut self) {
        match self {
            HostKv::F32(h) => h.clear(),
            HostKv::F16(h) => h.clear(),
        }
    }

    /// Cached positions.
    pub fn positions(&self, head_dim: usize) -> usize {
        match self {
            HostKv::F32(h) => h.positions(head_dim),
            HostKv::F16(h) => h.positions(head_dim),
        }
    }

    /// Keeps the first `len` positions.
    pub fn truncate(&mut self, len: usize, head_dim: usize) {
        match self {
            HostKv::F32(h) => h.truncate(len, head_dim),
            HostKv::F16(h) => h.truncate(len, head_dim),
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
#[inline(always)]
fn norm_rope(x: &mut [f32], w: &[f32], eps: f32, cos: &[f32], sin: &[f32]) {
    // eight partial sums, which the compiler keeps in a vector: a plain sum is one chain of
    // dependent adds (a head of 128: ~500 cycles; 28% of a 64-token prompt's attention on the
    // Zen 4, 2 threads, then 15% with SSE, 8% with AVX2)
    let ms = dot(x, x) / x.len() as f32;
    scale_rope(x, ms, w, eps, cos, sin);
}

/// `norm_rope` once the mean square `ms` is known.
#[inline(always)]
fn scale_rope(x: &mut [f32], ms: f32, w: &[f32], eps: f32, cos: &[f32], sin: &[f32]) {
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
    #[cfg(target_arch = "x86_64")]
    let avx2 = crate::engine::cpu::isa::active().avx2();
    let token = |t: usize, x: &mut [f32]| {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU has AVX2 and FMA (`isa` detected them, or the caller checked).
            return unsafe { norm_rope_heads_avx2(x, hd, w, eps, c, s) };
        }
        for head in x.chunks_exact_mut(hd) {
            norm_rope(head, w, eps, c, s);
        }
    };
    // a prompt's tokens split over threads (serially, 10 ms of a 64-token 0.6B prefill)
    let l = x.len() / (heads * hd);
    if l >= 8 {
        let mut parts: Vec<_> = x.chunks_mut(heads * hd).enumerate().collect();
        team::for_each_mut(&mut parts, |(t, x)| token(*t, x));
    } else {
        for (t, x) in x.chunks_exact_mut(heads * hd).enumerate() {
            token(t, x);
        }
    }
}

/// `norm_rope` on each head of one token's `x` with the mean square in AVX2 (`hd` a multiple
/// of 8; else `norm_rope` itself): `dot(head, head)`'s operations in its order (lane k sums the squares of k, k+8, ...,
/// mul then add, then the same tree over the lanes), so the same bits; the rest compiles for
/// AVX2 too (no FMA contraction in Rust), in 8 lanes instead of SSE's 4.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn norm_rope_heads_avx2(
    x: &mut [f32],
    hd: usize,
    w: &[f32],
    eps: f32,
    cos: &[f32],
    sin: &[f32],
) {
    use std::arch::x86_64::*;
    for head in x.chunks_exact_mut(hd) {
        if !hd.is_multiple_of(8) {
            norm_rope(head, w, eps, cos, sin);
            continue;
        }
        let mut acc = _mm256_setzero_ps();
        for c in head.chunks_exact(8) {
            let v = _mm256_loadu_ps(c.as_ptr());
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let s = _mm_hadd_ps(s, s);
        let ms = (_mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_movehdup_ps(s))) / hd as f32;
        scale_rope(head, ms, w, eps, cos, sin);
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
    let mut out = vec![0f32; q.len()];
    attend_into(d, &mut q, &mut k, v, q_norm, k_norm, cos, sin, kv, &mut out);
    out
}

/// `attend` into `out` (L, Hq*D), normalizing and rotating `q` and `k` in place: a decode
/// step's scratch keeps all of them from token to token.
#[allow(clippy::too_many_arguments)]
pub fn attend_into(
    d: &Dims,
    q: &mut [f32],
    k: &mut [f32],
    v: &[f32],
    q_norm: &[f32],
    k_norm: &[f32],
    cos: &[f32],
    sin: &[f32],
    kv: &mut HostKv,
    out: &mut [f32],
) {
    // with more threads than KV heads, a task a query head (each reads its K and V rows)
    let per_task = if rayon::current_num_threads() > d.n_kv {
        1
    } else {
        d.n_heads / d.n_kv
    };
    let simd = Walk::best();
    let rows = Rows { q, k, v, out };
    match kv {
        HostKv::F32(h) => attend_with(d, rows, q_norm, k_norm, cos, sin, h, simd, per_task),
        HostKv::F16(h) => attend_with(d, rows, q_norm, k_norm, cos, sin, h, simd, per_task),
    }
}

/// Which kernels walk the cache (`Group`): the portable loops, or a vector set's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Walk {
    Portable,
    /// AVX2 + FMA + F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F, with AVX2 + FMA + F16C.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Walk {
    /// The widest set the process's instruction set has. The x86 kernels are compiled with
    /// F16C for both caches (every AVX2 CPU has it, but a VM may hide it).
    fn best() -> Walk {
        let isa = crate::engine::cpu::isa::active();
        #[cfg(target_arch = "x86_64")]
        if isa.avx2() && std::arch::is_x86_feature_detected!("f16c") {
            return if isa.avx512() {
                Walk::Avx512
            } else {
                Walk::Avx2
            };
        }
        #[cfg(target_arch = "aarch64")]
        if isa.neon() {
            return Walk::Neon;
        }
        let _ = isa;
        Walk::Portable
    }

    /// The sets this CPU can run, the portable loops first (for tests).
    #[cfg(test)]
    fn available() -> Vec<Walk> {
        let mut v = vec![Walk::Portable];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            v.push(Walk::Avx2);
            if is_x86_feature_detected!("avx512f") {
                v.push(Walk::Avx512);
            }
        }
        #[cfg(target_arch = "aarch64")]
        v.push(Walk::Neon);
        v
    }
}

/// A step's new rows, and where its output goes.
struct Rows<'a> {
    q: &'a mut [f32],
    k: &'a mut [f32],
    v: &'a [f32],
    out: &'a mut [f32],
}

/// `attend` with the kernels `simd` names (the caller has checked the CPU), `per_task` query
/// heads a task (a divisor of the heads a KV head has), each task writing its heads' rows of
/// `out` in place.
#[allow(clippy::too_many_arguments)]
fn attend_with<E: KvElem>(
    d: &Dims,
    rows: Rows,
    q_norm: &[f32],
    k_norm: &[f32],
    cos: &[f32],
    sin: &[f32],
    kv: &mut Heads<E>,
    simd: Walk,
    per_task: usize,
) {
    let Rows { q, k, v, out } = rows;
    let (nh, nkv, hd) = (d.n_heads, d.n_kv, d.head_dim);
    let l = q.len() / (nh * hd);
    norm_rope_rows(q, nh, hd, q_norm, d.eps, cos, sin);
    norm_rope_rows(k, nkv, hd, k_norm, d.eps, cos, sin);
    let q = &*q;
    let offset = kv.positions(hd);
    kv.append(k, v, nkv, hd);
    let scale = (hd as f32).powf(-0.5);
    let rep = nh / nkv;
    // a task per KV head, for the query heads that share it, reads their K and V rows once
    // (with the layout above: 93-97 -> 79-84 us a layer at 96 positions, the measure of
    // `HostKv`); with `per_task` < `rep` they are read once a task
    let group = |h0: usize, o: Out| {
        let grp = Group {
            q,
            keys: &kv.k[h0 / rep],
            values: &kv.v[h0 / rep],
            h0,
            rep: per_task,
            nh,
            hd,
            l,
            offset,
            scale,
        };
        // SAFETY (each arm of both): the CPU has the set (`Walk::best` or the caller checked it);
        // `o`'s rows of heads h0..h0 + per_task are this task's alone (below). The blocked
        // path declines a task whose values are not all finite; the walk runs it.
        let blocked = l >= prompt::MIN_TOKENS
            && match simd {
                #[cfg(target_arch = "x86_64")]
                Walk::Avx512 if hd % 16 == 0 => unsafe { grp.prompt_avx512(o) },
                #[cfg(target_arch = "x86_64")]
                Walk::Avx512 | Walk::Avx2 if hd % 8 == 0 => unsafe { grp.prompt_avx2(o) },
                #[cfg(target_arch = "aarch64")]
                Walk::Neon if hd % 4 == 0 => unsafe { grp.prompt_neon(o) },
                _ => false,
            };
        if blocked {
            return;
        }
        match simd {
            #[cfg(target_arch = "x86_64")]
            Walk::Avx512 if hd % 16 == 0 => unsafe { grp.run_avx512(o) },
            #[cfg(target_arch = "x86_64")]
            Walk::Avx512 | Walk::Avx2 if hd % 8 == 0 => unsafe { grp.run_avx2(o) },
            #[cfg(target_arch = "aarch64")]
            Walk::Neon if hd % 8 == 0 => unsafe { grp.run_neon(o) },
            _ => unsafe { grp.run(o) },
        }
    };
    // a task's heads share one KV head and the tasks' heads tile the row: the rows written
    // through `Out` below are then disjoint and within `out`
    assert!(
        per_task > 0 && rep % per_task == 0,
        "attention: {per_task} heads a task"
    );
    assert_eq!(out.len(), l * nh * hd, "attention: output rows");
    if l == 0 {
        return;
    }
    // every task writes its heads' rows of `out` (L, Hq*D) in place, at their strides: a
    // prompt's outputs are neither collected a task nor gathered after (at the 0.6B shape
    // and 64 tokens, 0.5 MB zeroed and 0.5 MB copied a layer on the leading thread)
    let base = Out {
        p: out.as_mut_ptr(),
        head: hd,
        tok: nh * hd,
    };
    let mut firsts: Vec<usize> = (0..nh).step_by(per_task).collect();
    team::for_each_mut(&mut firsts, |h0| {
        // SAFETY: h0 < nh and l > 0, so head h0's first row is within `out` (asserted above).
        let o = Out {
            p: unsafe { base.row(*h0, 0) },
            ..base
        };
        group(*h0, o)
    });
}

/// Where a `Group` writes: the row of its head `r` at new token `i` is `hd` values at
/// `p + r·head + i·tok`.
#[derive(Clone, Copy)]
struct Out {
    p: *mut f32,
    head: usize,
    tok: usize,
}

// SAFETY: the tasks of one `attend_with` share its `Out` and write disjoint rows through it
// (each its own query heads), and `attend_with` holds `out` borrowed until they are done.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// Head `r`'s row at new token `i`.
    ///
    /// # Safety
    /// `r` and `i` within the group's heads and new tokens.
    #[inline(always)]
    unsafe fn row(self, r: usize, i: usize) -> *mut f32 {
        self.p.add(r * self.head + i * self.tok)
    }
}

/// Causal attention of `rep` query heads from `h0` on, which share KV head `g`, over the
/// cache: (rep, L, D) outputs. Each head's arithmetic is that of a head alone (same sums in
/// the same order); the heads only share the walk over the cached rows.
struct Group<'a, E> {
    q: &'a [f32],
    keys: &'a [E],
    values: &'a [E],
    h0: usize,
    rep: usize,
    nh: usize,
    hd: usize,
    l: usize,
    offset: usize,
    scale: f32,
}

impl<E: KvElem> Group<'_, E> {
    /// `run` with AVX2 + FMA intrinsics (`hd` a multiple of 8). The portable loops leave the
    /// compiler one dependent chain per dot product (strict f32 order: no reassociation, no
    /// FMA contraction), so a q·k dot waits on 16 adds in a row, and P·V keeps its sums in
    /// memory. Here the query heads go two at a time: each key and value row loaded (and
    /// widened from f16, F16C) serves both, four keys' dots run as eight independent chains,
    /// and P·V holds 32 output values of each head in registers across all positions (a head
    /// alone: four chains, and 64 values). The sums are the same terms in another order
    /// (FMA-rounded).
    ///
    /// At decode the cache comes from memory (the weights streamed since evicted it) as a few
    /// short streams a task, each 4 KiB page of which the hardware prefetcher learns anew:
    /// rows `AHEAD` positions on are prefetched to L2 (Zen 4, 2 threads, the 0.6B shape
    /// decoding at 64-320 positions: attention 12.8-12.9% of a step before, 11.2-11.4% after).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, o: Out) {
        self.walk::<Avx2>(o)
    }

    /// `run_avx2`'s walk with the AVX-512 kernels (`avx512.rs`; `hd` a multiple of 16).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn run_avx512(&self, o: Out) {
        self.walk::<avx512::Avx512>(o)
    }

    /// `run_avx2`'s walk with the NEON kernels (`neon.rs`; `hd` a multiple of 8).
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    unsafe fn run_neon(&self, o: Out) {
        self.walk::<neon::Neon>(o)
    }

    /// A prompt's attention in blocked products (`prompt.rs`) in 16 lanes: scores 6 rows x 4
    /// vectors of keys, outputs 4 rows x 4 vectors (`hd` a multiple of 16). False where a value
    /// is not finite: nothing was written and the walk is to run (masked positions would turn
    /// it into NaN in earlier tokens' outputs).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn prompt_avx512(&self, o: Out) -> bool {
        prompt::run::<avx512::Avx512, E, 16, 6, 4, 6, 4>(self, o)
    }

    /// `prompt_avx512` in 8 lanes (16 registers): scores 4 x 2, outputs 2 x 4 (`hd` a multiple
    /// of 8).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prompt_avx2(&self, o: Out) -> bool {
        prompt::run::<Avx2, E, 8, 4, 2, 2, 4>(self, o)
    }

    /// `prompt_avx512` in NEON's 4 lanes (32 registers): scores 6 x 4, outputs 4 x 4 (`hd` a
    /// multiple of 4).
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    unsafe fn prompt_neon(&self, o: Out) -> bool {
        prompt::run::<neon::Neon, E, 4, 6, 4, 4, 4>(self, o)
    }

    /// The vector walk of `run_avx2` and `run_neon` with `K`'s kernels, inlined into each.
    #[inline(always)]
    unsafe fn walk<K: Lanes>(&self, o: Out) {
        let Group {
            q,
            keys,
            values,
            h0,
            rep,
            nh,
            hd,
            l,
            offset,
            scale,
        } = *self;
        debug_assert_eq!(hd % 8, 0);
        let t_max = offset + l;
        let mut probs = vec![0f32; rep * t_max];
        let (kp, vp) = (keys.as_ptr(), values.as_ptr());
        for i in 0..l {
            let visible = offset + i + 1;
            let mut r = 0;
            while r < rep {
                let pair = r + 1 < rep;
                let qa = q[(i * nh + h0 + r) * hd..][..hd].as_ptr();
                // the second head of a pair, or the first again (its results then unused)
                let qb = q[(i * nh + h0 + r + pair as usize) * hd..][..hd].as_ptr();
                let (sa, sb) = probs.split_at_mut((r + 1) * t_max);
                let sa = &mut sa[r * t_max..][..visible];
                let sb = &mut sb[..if pair { visible } else { 0 }];
                if pair {
                    K::scores2::<E, true>(qa, qb, kp, hd, visible, scale, sa, sb);
                } else {
                    K::scores2::<E, false>(qa, qb, kp, hd, visible, scale, sa, sb);
                }
                K::softmax(sa);
                K::softmax(sb);
                let oa = o.row(r, i);
                let ob = if pair { o.row(r + 1, i) } else { oa };
                if pair {
                    K::pv2::<E, true>(sa, sb, vp, hd, oa, ob);
                } else {
                    K::pv2::<E, false>(sa, sa, vp, hd, oa, ob);
                }
                r += 2;
            }
        }
    }

    /// The group's outputs into `o`'s rows.
    ///
    /// # Safety
    /// `o`'s rows of the group's heads and new tokens are `hd` writable values each, which
    /// nothing else reads or writes meanwhile.
    #[inline(always)]
    unsafe fn run(&self, o: Out) {
        let Group {
            q,
            keys,
            values,
            h0,
            rep,
            nh,
            hd,
            l,
            offset,
            scale,
        } = *self;
        let t_max = offset + l;
        let mut scores = vec![0f32; rep * t_max];
        let mut row = vec![0f32; hd];
        // a token's sums of every head, written to their rows once complete
        let mut acc = vec![0f32; rep * hd];
        for i in 0..l {
            let visible = offset + i + 1; // causal: positions 0..=offset+i
            let qh = |r: usize| {
                let h = h0 + r;
                &q[(i * nh + h) * hd..(i * nh + h + 1) * hd]
            };
            for (t, kt) in keys.chunks_exact(hd).take(visible).enumerate() {
                E::load(kt, &mut row);
                for r in 0..rep {
                    scores[r * t_max + t] = dot(qh(r), &row) * scale;
                }
            }
            for r in 0..rep {
                softmax(&mut scores[r * t_max..r * t_max + visible]);
            }
            acc.fill(0.0);
            for (t, vt) in values.chunks_exact(hd).take(visible).enumerate() {
                E::load(vt, &mut row);
                for r in 0..rep {
                    let p = scores[r * t_max + t];
                    for (a, b) in acc[r * hd..(r + 1) * hd].iter_mut().zip(&row) {
                        *a += p * b;
                    }
                }
            }
            for r in 0..rep {
                std::slice::from_raw_parts_mut(o.row(r, i), hd)
                    .copy_from_slice(&acc[r * hd..(r + 1) * hd]);
            }
        }
    }
}

/// The kernels `Group::walk` runs, on one instruction set: each an `#[inline(always)]` call of
/// a function compiled for it, so that the walk, inlined into a function compiled for the
/// same set, inlines them too.
trait Lanes {
    /// `sa[t] = scale · qa·k_t` and, with `P` (a pair), `sb[t] = scale · qb·k_t`, `t < visible`.
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
    );
    /// `s[t] = exp(s[t] - max)` in place; returns their sum (`softmax` before its division).
    unsafe fn exp_sum(s: &mut [f32]) -> f32;
    /// `softmax` in place: `exp_sum`, then each value over the sum (IEEE division, the same
    /// bits in any lane).
    #[inline(always)]
    unsafe fn softmax(s: &mut [f32]) {
        let sum = Self::exp_sum(s);
        s.iter_mut().for_each(|v| *v /= sum);
    }
    /// `oa = Σ_t pa[t]·v_t` and, with `P`, `ob = Σ_t pb[t]·v_t`.
    unsafe fn pv2<E: KvElem, const P: bool>(
        pa: &[f32],
        pb: &[f32],
        vp: *const E,
        hd: usize,
        oa: *mut f32,
        ob: *mut f32,
    );
}

/// The AVX2 + FMA + F16C kernels below.
#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
lanes!(Avx2, exp_sum_avx2);

/// `s` -> softmax(s) in place: `exp(s - max) / Σ`.
#[inline(always)]
fn softmax(s: &mut [f32]) {
    let sum = exp_sum(s);
    s.iter_mut().for_each(|v| *v /= sum);
}

/// `s[t] = exp(s[t] - max)`; returns their sum.
#[inline(always)]
fn exp_sum(s: &mut [f32]) -> f32 {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f32;
    for v in s.iter_mut() {
        // the samplers' exp (within 2 ulp of libm's, no call): 79-84 -> 76-77 us
        *v = crate::engine::sample::exp_neg(*v - max);
        sum += *v;
    }
    sum
}

/// Rows this far ahead of the one in use are prefetched (4 KiB of f16 rows at head dim 128).
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 16;

/// Prefetches `n` values from `p` to L2, one hint a cache line. Addresses past the cache are
/// harmless: a prefetch never faults.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn prefetch_rows<E: KvElem>(p: *const E, n: usize) {
    use std::arch::x86_64::*;
    let bytes = n * std::mem::size_of::<E>();
    for off in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T1>((p as *const i8).wrapping_add(off));
    }
}

/// Eight cached values at `p` as f32: widened from f16, or loaded.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<E: KvElem>(p: *const E) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    if E::HALF {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// `sa[t] = scale · qa·k_t` and, with `P` (a pair), `sb[t] = scale · qb·k_t`, for `t <
/// visible`: four keys at a time, each key's eight-value slices loaded once for both heads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
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
    use std::arch::x86_64::*;
    let mut t = 0;
    while t + 4 <= visible {
        let k0 = kp.add(t * hd);
        prefetch_rows(k0.wrapping_add(AHEAD * hd), 4 * hd);
        let (mut a, mut b) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
        for d in (0..hd).step_by(8) {
            let (x, y) = (_mm256_loadu_ps(qa.add(d)), _mm256_loadu_ps(qb.add(d)));
            for j in 0..4 {
                let k = load8(k0.add(j * hd + d));
                a[j] = _mm256_fmadd_ps(x, k, a[j]);
                if P {
                    b[j] = _mm256_fmadd_ps(y, k, b[j]);
                }
            }
        }
        _mm_storeu_ps(sa[t..t + 4].as_mut_ptr(), sum4(a, scale));
        if P {
            _mm_storeu_ps(sb[t..t + 4].as_mut_ptr(), sum4(b, scale));
        }
        t += 4;
    }
    for t in t..visible {
        let kt = kp.add(t * hd);
        let (mut a, mut b) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for d in (0..hd).step_by(8) {
            let k = load8(kt.add(d));
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qa.add(d)), k, a);
            if P {
                b = _mm256_fmadd_ps(_mm256_loadu_ps(qb.add(d)), k, b);
            }
        }
        sa[t] = hsum256(a) * scale;
        if P {
            sb[t] = hsum256(b) * scale;
        }
    }
}

/// `scale ·` the lane sums of four vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn sum4(a: [std::arch::x86_64::__m256; 4], scale: f32) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    // lanes (a0 0..3, a1 0..3, a2 0..3, a3 0..3 | the same of 4..7), then the halves added
    let h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_mul_ps(
        _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)),
        _mm_set1_ps(scale),
    )
}

/// `oa = Σ_t pa[t]·v_t` and, with `P` (a pair), `ob = Σ_t pb[t]·v_t` (`hd` values each, over
/// the positions of `pa`): 32 values of each head at a time held in registers (64 of one head
/// alone: eight independent FMA chains either way), each value row's slice loaded once for
/// both heads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
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
            pv_block::<E, P, 4>(pa, pb, vp, hd, d0, oa, ob);
            d0 += 32;
        }
    } else {
        while d0 + 64 <= hd {
            pv_block::<E, P, 8>(pa, pb, vp, hd, d0, oa, ob);
            d0 += 64;
        }
    }
    while d0 < hd {
        pv_block::<E, P, 1>(pa, pb, vp, hd, d0, oa, ob);
        d0 += 8;
    }
}

/// `pv2` for outputs `d0..d0 + 8·W`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
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
    use std::arch::x86_64::*;
    let (mut a, mut b) = ([_mm256_setzero_ps(); W], [_mm256_setzero_ps(); W]);
    for (t, (&p, &q)) in pa.iter().zip(pb).enumerate() {
        if d0 == 0 {
            prefetch_rows(vp.wrapping_add((t + AHEAD) * hd), hd);
        }
        let (x, y, vt) = (_mm256_set1_ps(p), _mm256_set1_ps(q), vp.add(t * hd + d0));
        for j in 0..W {
            let v = load8(vt.add(8 * j));
            a[j] = _mm256_fmadd_ps(x, v, a[j]);
            if P {
                b[j] = _mm256_fmadd_ps(y, v, b[j]);
            }
        }
    }
    for j in 0..W {
        _mm256_storeu_ps(oa.add(d0 + 8 * j), a[j]);
        if P {
            _mm256_storeu_ps(ob.add(d0 + 8 * j), b[j]);
        }
    }
}

/// `exp_sum` eight lanes at a time, with the samplers' `exp_neg` in AVX2 (the same bits as the
/// scalar one); the sum is taken in eight lanes. A prompt of 64 tokens computes ~33k of these
/// exps a layer at the 0.6B shape, a decode step at 190 positions ~3k.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp_sum_avx2(s: &mut [f32]) -> f32 {
    use crate::engine::cpu::sample::avx2::exp_neg8;
    use std::arch::x86_64::*;
    let n = s.len();
    let p = s.as_mut_ptr();
    let whole = n & !7;
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..whole).step_by(8) {
        // a NaN score is skipped, as `softmax`'s `f32::max` skips it (`maxps` returns its
        // second operand where either is NaN)
        mv = _mm256_max_ps(_mm256_loadu_ps(p.add(i)), mv);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), mv);
    let max = lanes
        .iter()
        .chain(&s[whole..])
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let (m8, mut sv) = (_mm256_set1_ps(max), _mm256_setzero_ps());
    for i in (0..whole).step_by(8) {
        let e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m8));
        _mm256_storeu_ps(p.add(i), e);
        sv = _mm256_add_ps(sv, e);
    }
    let mut sum = hsum256(sv);
    for v in &mut s[whole..] {
        *v = crate::engine::sample::exp_neg(*v - max);
        sum += *v;
    }
    sum
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

    /// `Heads::append` in steps of 1, 5, 13 and 99 rows (decode steps and prompt chunks, the
    /// latter a task per head and kind, on a pool and on a team): each head's keys and values
    /// are its rows in order, each value `E::store`'s, the same as appending a row at a time.
    #[test]
    fn append_keeps_each_heads_rows_in_order() {
        fn check<E: KvElem + PartialEq>(threads: usize, lead: bool) {
            let (nkv, hd) = (3, 16);
            let steps = [1, 5, 13, 99, 1];
            let total: usize = steps.iter().sum();
            let val = |t: usize, g: usize, i: usize, kind: usize| {
                ((t * 7 + g * 131 + i * 17 + kind * 1009) % 2001) as f32 / 97.0 - 10.0
            };
            let rows = |kind: usize, t0: usize, l: usize| -> Vec<f32> {
                (t0..t0 + l)
                    .flat_map(|t| (0..nkv * hd).map(move |j| val(t, j / hd, j % hd, kind)))
                    .collect()
            };
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
            let heads = pool.expect("a test pool").install(|| {
                let body = || {
                    let mut h = Heads::<E>::default();
                    let mut t0 = 0;
                    for l in steps {
                        h.append(&rows(0, t0, l), &rows(1, t0, l), nkv, hd);
                        t0 += l;
                    }
                    h
                };
                match lead {
                    true => team::Team::lead(body),
                    false => body(),
                }
            });
            for (kind, got) in [(0, &heads.k), (1, &heads.v)] {
                assert_eq!(got.len(), nkv);
                for (g, got) in got.iter().enumerate() {
                    let want: Vec<f32> = (0..total)
                        .flat_map(|t| (0..hd).map(move |i| val(t, g, i, kind)))
                        .collect();
                    let mut want_e = vec![E::default(); want.len()];
                    for (s, d) in want.chunks(hd).zip(want_e.chunks_mut(hd)) {
                        E::store(s, d);
                    }
                    let what = format!("kind {kind} head {g}: {threads} threads, team {lead}");
                    assert!(*got == want_e, "{what}");
                }
            }
        }
        for (threads, lead) in [(1, false), (3, false), (4, true)] {
            check::<f32>(threads, lead);
            check::<f16>(threads, lead);
        }
    }

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

    /// The f16 cache saturates values past f16's range instead of storing infinities; NaN
    /// stays NaN, and values in range round to nearest.
    #[test]
    fn f16_store_equals_the_portable_bits() {
        // whole vectors and a tail; NaN, ±0, past f16's range, its subnormals, ties
        let mut src: Vec<f32> = (0..203)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 0.37 * 1.5f32.powi(i % 23 - 11))
            .collect();
        for (i, v) in [
            f32::NAN,
            -0.0,
            1e6,
            -7e4,
            65520.0,
            3e-6,
            -6e-8,
            1.0 + 1.0 / 2048.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]
        .into_iter()
        .enumerate()
        {
            src[i * 19] = v;
        }
        let (mut a, mut b) = (vec![f16::ZERO; src.len()], vec![f16::ZERO; src.len()]);
        store_portable(&src, &mut a);
        <f16 as KvElem>::store(&src, &mut b);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                "value {i} ({}): {x} against {y}",
                src[i]
            );
        }
        #[cfg(target_arch = "x86_64")]
        if crate::engine::cpu::isa::required(crate::engine::cpu::isa::Isa::Avx2) {
            assert!(std::arch::is_x86_feature_detected!("f16c"), "no F16C");
        }
    }

    #[test]
    fn f16_cache_saturates() {
        let src = [1e6f32, -7e4, 65504.0, 1.0 / 3.0, f32::NAN, -0.0];
        let mut dst = [f16::ZERO; 6];
        <f16 as KvElem>::store(&src, &mut dst);
        let back: Vec<f32> = dst.iter().map(|h| h.to_f32()).collect();
        assert_eq!(&back[..3], &[65504.0, -65504.0, 65504.0]);
        assert_eq!(back[3], f16::from_f32(1.0 / 3.0).to_f32());
        assert!(back[4].is_nan());
        assert!(back[5] == 0.0 && back[5].is_sign_negative());
    }

    /// The AVX2 norm + RoPE gives the portable one's bits (same operations, same order), at head
    /// dims with and without a whole number of 8-lane steps.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn norm_rope_in_avx2_equals_the_portable_bits() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            eprintln!("norm_rope: no AVX2 + FMA here, nothing to compare");
            return;
        }
        for hd in [128usize, 72, 36] {
            let heads = 3;
            let x: Vec<f32> = (0..heads * hd)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
                .collect();
            let w: Vec<f32> = (0..hd).map(|i| 0.5 + (i % 13) as f32 / 10.0).collect();
            let ang: Vec<f32> = (0..hd / 2).map(|i| i as f32 * 0.37).collect();
            let (cos, sin): (Vec<f32>, Vec<f32>) = ang.iter().map(|a| (a.cos(), a.sin())).unzip();
            let mut want = x.clone();
            for h in want.chunks_exact_mut(hd) {
                norm_rope(h, &w, 1e-6, &cos, &sin);
            }
            let mut got = x;
            // SAFETY: AVX2 and FMA were detected above.
            unsafe { norm_rope_heads_avx2(&mut got, hd, &w, 1e-6, &cos, &sin) };
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "head dim {hd}");
        }
    }

    /// Prefill then decode steps against the reference with the per-head cache, for 2, 4 and 3
    /// query heads a KV head (heads go in pairs, and one alone), then a truncated cache decoding
    /// again, then long prompts (the blocked path) and a decode after them: |Δ| ≤ 1e-5. Norm weights of
    /// one and a zero angle make norm + RoPE a plain RMS normalization, applied here to the
    /// reference's inputs too.
    #[test]
    fn grouped_heads_match_the_reference() {
        let walks = Walk::available();
        eprintln!("attention: kernels {walks:?}");
        #[cfg(target_arch = "x86_64")]
        if crate::engine::cpu::isa::required(crate::engine::cpu::isa::Isa::Avx2) {
            assert!(walks.contains(&Walk::Avx2), "no AVX2 + FMA + F16C");
        }
        for simd in walks {
            for hd in [64, 32, 128, 72, 48, 12, 20, 256] {
                for one_head_a_task in [false, true] {
                    grouped_heads_at::<f32>(hd, simd, one_head_a_task);
                    grouped_heads_at::<f16>(hd, simd, one_head_a_task);
                }
            }
        }
    }

    /// Each vector softmax against the portable one: within rounding, a NaN score weighted 0 as
    /// `f32::max` and `exp_neg` weigh it (not the row's max), -inf scores 0, gaps past the exp's
    /// floor, lengths with and without vector tails.
    #[test]
    fn vector_softmax_matches_the_portable_one() {
        type Kernel = unsafe fn(&mut [f32]);
        let mut kernels: Vec<(&str, Kernel)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            kernels.push(("avx2", <Avx2 as Lanes>::softmax));
        }
        #[cfg(target_arch = "aarch64")]
        kernels.push(("neon", <neon::Neon as Lanes>::softmax));
        for (name, kernel) in kernels {
            for n in 1..41usize {
                for seed in 0..9usize {
                    let mut row: Vec<f32> = (0..n)
                        .map(|i| match (i * 7 + seed * 3) % 23 {
                            0 if seed % 2 == 0 => f32::NAN,
                            1 => f32::NEG_INFINITY,
                            2 => 120.0,
                            _ => ((i * 31 + seed * 17) % 29) as f32 * 0.7 - 9.0,
                        })
                        .collect();
                    if seed == 8 && n > 9 {
                        // the max in one lane, then a NaN in the same lane of a later vector (4
                        // and 8 lanes)
                        row.iter_mut().for_each(|v| *v = v.clamp(-9.0, 9.0));
                        row[1] = 60.0;
                        row[5] = f32::NAN;
                        row[9] = f32::NAN;
                    }
                    let mut want = row.clone();
                    softmax(&mut want);
                    let mut got = row.clone();
                    // SAFETY: the CPU has the set (checked above).
                    unsafe { kernel(&mut got) };
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        // (a row with no finite score is 0/0 on every path)
                        assert!(
                            (g - w).abs() <= 1e-6 * w.abs().max(1e-30) + 1e-37
                                || (g.is_nan() && w.is_nan() && row.iter().all(|v| !v.is_finite())),
                            "{name} n {n} seed {seed} at {i}: {g} against {w} ({row:?})"
                        );
                    }
                }
            }
        }
    }

    /// The f16 cache's keys and values are the f32 ones rounded to f16, and then the same
    /// arithmetic: its outputs are held to the reference on those rounded inputs.
    fn grouped_heads_at<E: KvElem>(hd: usize, simd: Walk, one_head_a_task: bool) {
        let round = |x: &mut [f32]| {
            if E::HALF {
                x.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32());
            }
        };
        let norm = |x: &mut [f32]| {
            for h in x.chunks_exact_mut(hd) {
                // `norm_rope`'s sum, so that the f16 cache rounds the same values
                let r = 1.0 / (dot(h, h) / hd as f32 + 1e-6).sqrt();
                h.iter_mut().for_each(|v| *v *= r);
            }
        };
        for (nh, nkv) in [(4, 2), (8, 2), (6, 2)] {
            let d = Dims {
                n_heads: nh,
                n_kv: nkv,
                head_dim: hd,
                eps: 1e-6,
            };
            let (w, cos, sin) = (
                vec![1f32; hd],
                vec![1f32; 128 * hd / 2],
                vec![0f32; 128 * hd / 2],
            );
            let val = |n: usize, seed: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| (((i * 31 + seed * 17) % 97) as f32 - 48.0) / 20.0)
                    .collect()
            };
            let mut kv = Heads::<E>::default();
            let (mut keys, mut values) = (Vec::new(), Vec::new());
            // steps of 99 take the blocked prompt path (`prompt.rs`) where the walk has one:
            // from an empty cache, then at an offset (a thread after a cached prefix)
            for (step, l) in [5usize, 1, 1, 3, 13, 99, 99, 1].into_iter().enumerate() {
                if step == 5 {
                    kv.clear();
                    keys.clear();
                    values.clear();
                }
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
                let (mut qx, mut kx) = (q.clone(), k.clone());
                let mut got = vec![f32::NAN; q.len()];
                let rows = Rows {
                    q: &mut qx,
                    k: &mut kx,
                    v: &v,
                    out: &mut got,
                };
                let per_task = if one_head_a_task { 1 } else { nh / nkv };
                attend_with(&d, rows, &w, &w, &cos, &sin, &mut kv, simd, per_task);
                let (mut qn, mut kn, mut vn) = (q, k, v);
                norm(&mut qn);
                norm(&mut kn);
                round(&mut kn);
                round(&mut vn);
                keys.extend_from_slice(&kn);
                values.extend_from_slice(&vn);
                let want = reference(&qn, &keys, &values, nh, nkv, hd, l, offset);
                // every output written (`got` starts as NaN, which `f32::max` would skip)
                let unwritten = got.iter().filter(|x| !x.is_finite()).count();
                assert_eq!(
                    unwritten, 0,
                    "hd {hd} kernels {simd:?} one head a task {one_head_a_task} heads {nh}/{nkv} \
                     step {step}: outputs not written"
                );
                let err = got
                    .iter()
                    .zip(&want)
                    .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
                assert!(
                    err <= 1e-5,
                    "hd {hd} kernels {simd:?} f16 {} one head a task {one_head_a_task} heads \
                     {nh}/{nkv} step {step}: max |Δ| {err}",
                    E::HALF
                );
                assert_eq!(kv.positions(hd), offset + l);
            }
        }
    }

    /// A non-finite value at a later position stays out of earlier tokens' outputs on every
    /// set (the blocked prompt path multiplies masked positions by 0; it leaves such a task to
    /// the walk). Found by a review: AVX2 leaked into 24 earlier tokens, AVX-512 into 36.
    #[test]
    fn a_later_non_finite_value_does_not_reach_earlier_tokens() {
        let (nh, nkv, hd, l, bad) = (2usize, 1usize, 64usize, 100usize, 60usize);
        let d = Dims {
            n_heads: nh,
            n_kv: nkv,
            head_dim: hd,
            eps: 1e-6,
        };
        let (w, cos, sin) = (
            vec![1f32; hd],
            vec![1f32; l * hd / 2],
            vec![0f32; l * hd / 2],
        );
        let val = |n: usize, seed: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * 37 + seed * 13) % 101) as f32 - 50.0) / 17.0)
                .collect()
        };
        let mut failures = Vec::new();
        for simd in Walk::available() {
            for nonfinite in [f32::INFINITY, f32::NAN] {
                let mut kv = Heads::<f32>::default();
                let (mut q, mut k, mut v) = (
                    val(l * nh * hd, 1),
                    val(l * nkv * hd, 2),
                    val(l * nkv * hd, 3),
                );
                v[bad * nkv * hd + 5] = nonfinite;
                let mut got = vec![0f32; q.len()];
                let rows = Rows {
                    q: &mut q,
                    k: &mut k,
                    v: &v,
                    out: &mut got,
                };
                attend_with(&d, rows, &w, &w, &cos, &sin, &mut kv, simd, nh / nkv);
                // tokens whose outputs hold a non-finite value
                let (leaked, later) = got
                    .chunks_exact(nh * hd)
                    .enumerate()
                    .filter(|(_, t)| t.iter().any(|x| !x.is_finite()))
                    .fold(
                        (0, 0),
                        |(e, a), (i, _)| if i < bad { (e + 1, a) } else { (e, a + 1) },
                    );
                if leaked > 0 || later == 0 {
                    failures.push(format!(
                        "{simd:?} {nonfinite}: {leaked} earlier, {later} later"
                    ));
                }
            }
        }
        assert!(failures.is_empty(), "{failures:?}");
    }
}
