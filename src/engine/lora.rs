//! Runtime LoRA from an mlx_lm adapter directory (`adapter_config.json` + `adapters.safetensors`,
//! as `mlx_lm lora --train` writes them). Follows `mlx_lm/tuner/lora.py` `LoRALinear`:
//! `y = base(x) + scale * ((x @ lora_a) @ lora_b)`, `lora_a` [in, r], `lora_b` [r, out], with
//! `scale = lora_parameters.scale` used as is (mlx_lm does not divide by the rank). The branch
//! computes in f32 beside the quantized base (its CPU copies rounded to f16 for the `fast` and
//! `int8` kernels: `Half`) and is never merged into the 4-bit weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use crate::engine::cpu::lora_half;
use crate::engine::error::{EngineError, Result};
use crate::engine::weights::SafetensorsFile;

/// One adapted projection.
#[derive(Debug, Clone)]
pub struct LoraBranch {
    /// [in, r]
    pub a: Tensor,
    /// [r, out]
    pub b: Tensor,
    pub scale: f64,
    /// On the CPU, `a` [in, r] row-major and `b` in blocks of `LANES` outputs (`block_b`):
    /// the branch then runs as two short loops instead of two candle matmuls (whose set-up
    /// cost more than the rank-8 products). A block holds its outputs' r values of `b` as r
    /// runs of `LANES`, so a range of outputs reads one contiguous stretch (no r short runs
    /// of [r, out], each a cold start for the hardware prefetcher) and `add_b` works on
    /// `LANES` outputs a vector, where [out, r] rows took a horizontal sum per output (3.2% of
    /// a `--synthetic-lora` pass's cycles, with the branches on half its tokens).
    host: Option<Arc<Copies>>,
}

/// A branch's host copies (`LoraBranch::host`): f32 as the adapter has them, or rounded to
/// f16 (`LoraBranch::halved`) for the kernels that round their activations anyway.
#[derive(Debug)]
enum Copies {
    F32 { a: Vec<f32>, bb: Vec<f32> },
    F16 { a: Vec<Half>, bb: Vec<Half> },
}

/// A value of a branch's host copies: an f32, or a `Half`.
pub trait Elem: Copy + Send + Sync {
    fn widen(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

/// An IEEE half-precision value by its bits, finite (`Half::narrow` makes no other). A decode
/// step streams its branches' copies from memory beside the weights, and past rank 8 the
/// branches' cost follows their bytes (`--synthetic-lora` on the 0.6B shape, 2 threads, Zen 4,
/// decode time with f32 copies: +2.2% at rank 1, ~8% at 8, ~15% at 16, ~20-24% at 32; with
/// f16 ones ~8%, ~14%, ~15%). f16 rounds to 11 significant bits, where `fast` rounds the
/// activations to 15 and keeps its cache in f16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Half(u16);

impl Half {
    /// `v` rounded to the nearest f16 (ties to even); `None` where that is not finite.
    pub fn narrow(v: f32) -> Option<Half> {
        let h = half::f16::from_f32(v);
        h.is_finite().then_some(Half(h.to_bits()))
    }
}

impl Elem for Half {
    /// Exactly `half::f16::to_f32` for a finite value, in integer operations and one exact
    /// multiply (no per-value check for F16C, as `half` has off such builds): the loops over
    /// the copies can vectorize on any instruction set. Exact for subnormals too, where the
    /// CPU does not treat subnormal inputs as zero (nothing in this program sets x86's DAZ or
    /// ARM's FZ; the test over every value would fail if something did).
    #[inline(always)]
    fn widen(self) -> f32 {
        let h = self.0 as u32;
        // the magnitude's bits in f32's places read as 2^-112 times the value (subnormals
        // included); f32's exponent bias is f16's plus 112
        let magnitude = f32::from_bits((h & 0x7fff) << 13) * f32::from_bits(0x7780_0000);
        f32::from_bits(magnitude.to_bits() | (h & 0x8000) << 16)
    }
}

/// A branch's host copy of `a` [in, r] or of `b` in blocks (`block_b`), in the type kept.
#[derive(Debug, Clone, Copy)]
pub enum Stored<'a> {
    F32(&'a [f32]),
    F16(&'a [Half]),
}

impl<'a> Stored<'a> {
    pub fn len(&self) -> usize {
        match self {
            Stored::F32(v) => v.len(),
            Stored::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (address, bytes) of the copy: for read-ahead hints.
    pub fn range(&self) -> (usize, usize) {
        match self {
            Stored::F32(v) => (v.as_ptr() as usize, std::mem::size_of_val(*v)),
            Stored::F16(v) => (v.as_ptr() as usize, std::mem::size_of_val(*v)),
        }
    }

    /// The blocks of `b` (this copy, rank `r`) that hold outputs `rows`.
    pub fn blocks_of(self, r: usize, rows: std::ops::Range<usize>) -> Stored<'a> {
        match self {
            Stored::F32(v) => Stored::F32(blocks_of(v, r, rows)),
            Stored::F16(v) => Stored::F16(blocks_of(v, r, rows)),
        }
    }

    /// Every cache line of the copy into L2 (`team::prefetch`).
    pub fn prefetch(&self) {
        match self {
            Stored::F32(v) => crate::engine::cpu::team::prefetch(v),
            Stored::F16(v) => crate::engine::cpu::team::prefetch(v),
        }
    }
}

/// Up to this many rows (decode, short chunks) the branch runs on the calling thread (and a
/// decode step's single row inside the matmul's region); a prompt's rows are spread over
/// rayon's threads, a row a task.
pub(crate) const HOST_MAX_ROWS: usize = 4;

impl LoraBranch {
    /// `a` [in, r] and `b` [r, out], f32.
    pub fn new(a: Tensor, b: Tensor, scale: f64) -> Result<Self> {
        let host = if a.device().is_cpu() {
            let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
            let (r, out) = b.dims2()?;
            Some(Arc::new(Copies::F32 {
                a: flat(&a)?,
                bb: block_b(&flat(&b)?, r, out),
            }))
        } else {
            None
        };
        Ok(LoraBranch { a, b, scale, host })
    }

    /// The branch with its host copies rounded to f16 (the `fast` and `int8` kernels, whose
    /// activations are rounded already: `Half`), where every value stays finite; as it was
    /// otherwise (no host copies, or a value past f16's range: then f32, as loaded).
    pub fn halved(mut self) -> Self {
        if let Some(Copies::F32 { a, bb }) = self.host.as_deref() {
            let narrow = |v: &[f32]| {
                v.iter()
                    .map(|&x| Half::narrow(x))
                    .collect::<Option<Vec<_>>>()
            };
            if let (Some(a), Some(bb)) = (narrow(a), narrow(bb)) {
                self.host = Some(Arc::new(Copies::F16 { a, bb }));
            }
        }
        self
    }

    /// `scale * ((x @ a) @ b)` for `x` (L, in).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok((x.matmul(&self.a)?.matmul(&self.b)? * self.scale)?)
    }

    /// `y += scale * ((x @ a) @ b)` on host slices (`x` rows `in` wide, `y` the same rows `out`
    /// wide), where the branch has its host copies; `false` (nothing done) otherwise. The CPU
    /// paths call it on the matmul's own output, before that becomes a tensor: no copies in
    /// and out of tensors. Every row gets `add_host`'s bits for that row alone, a decode
    /// step's or a prompt's. (A prompt's rows went through candle's matmuls before: 14.7% of
    /// a 64-token `--synthetic-lora` prefill at the 0.6B shape, 2 threads, Zen 5.)
    pub fn add_rows(&self, x: &[f32], y: &mut [f32]) -> bool {
        let (Some((a, bb, scale)), Ok((inp, _)), Ok((_, out))) =
            (self.host_parts(), self.a.dims2(), self.b.dims2())
        else {
            return false;
        };
        if inp == 0 || !x.len().is_multiple_of(inp) || y.len() != x.len() / inp * out {
            return false;
        }
        if x.is_empty() || out == 0 {
            return true; // no rows, or nothing to add to
        }
        if x.len() / inp <= HOST_MAX_ROWS {
            add_host(a, bb, scale, x, inp, y);
        } else {
            let mut rows: Vec<_> = x.chunks_exact(inp).zip(y.chunks_exact_mut(out)).collect();
            // on the team a host pass leads (`cpu::team`), else rayon's pool
            crate::engine::cpu::team::for_each_mut(&mut rows, |(xi, yi)| {
                add_host(a, bb, scale, xi, inp, yi)
            });
        }
        true
    }

    /// The host copies of `a` [in, r] (row-major) and of `b` in blocks (`block_b`), with the
    /// scale, where the branch has them (the CPU).
    pub fn host_parts(&self) -> Option<(Stored<'_>, Stored<'_>, f32)> {
        let scale = self.scale as f32;
        self.host.as_deref().map(|h| match h {
            Copies::F32 { a, bb } => (Stored::F32(a), Stored::F32(bb), scale),
            Copies::F16 { a, bb } => (Stored::F16(a), Stored::F16(bb), scale),
        })
    }

    /// `y + scale * ((x @ a) @ b)`: on the CPU by `add_rows`, else with candle ops.
    pub fn add_to(&self, x: &Tensor, y: Tensor) -> Result<Tensor> {
        if self.host.is_some() && x.dtype() == DType::F32 && y.dtype() == DType::F32 {
            let xs = x.flatten_all()?.to_vec1::<f32>()?;
            let mut ys = y.flatten_all()?.to_vec1::<f32>()?;
            if self.add_rows(&xs, &mut ys) {
                return Ok(Tensor::from_vec(ys, y.shape(), y.device())?);
            }
        }
        Ok((y + self.forward(x)?)?)
    }
}

/// Outputs a block of `b` holds (`block_b`): one f32 vector of AVX2, two of NEON.
pub const LANES: usize = 8;

/// `b` [r, out] (row-major) as blocks of `LANES` outputs, each its r runs of `LANES` values
/// (the last block padded with zeros): output `n`'s `b[j][n]` sits at
/// `(n / LANES) * r * LANES + j * LANES + n % LANES`.
pub fn block_b(b: &[f32], r: usize, out: usize) -> Vec<f32> {
    let mut blocks = vec![0f32; blocked_len(r, out)];
    for (j, row) in b.chunks_exact(out.max(1)).take(r).enumerate() {
        for (n, &v) in row.iter().enumerate() {
            blocks[(n / LANES) * r * LANES + j * LANES + n % LANES] = v;
        }
    }
    blocks
}

/// The length of `block_b`'s result for `b` [r, out].
pub fn blocked_len(r: usize, out: usize) -> usize {
    out.div_ceil(LANES) * r * LANES
}

/// The blocks of `bb` (`block_b`, rank `r`) that hold outputs `rows`.
pub fn blocks_of<E>(bb: &[E], r: usize, rows: std::ops::Range<usize>) -> &[E] {
    let end = (rows.end.div_ceil(LANES) * r * LANES).min(bb.len());
    &bb[((rows.start / LANES) * r * LANES).min(end)..end]
}

/// `y[i] += scale * Σ_j (Σ_k x[i][k] a[k][j]) b[j]` for every row i of `x` (`inp` wide);
/// `a` is [inp, r], `bb` is `b` in blocks (`block_b`).
pub fn add_host(a: Stored, bb: Stored, scale: f32, x: &[f32], inp: usize, y: &mut [f32]) {
    let out = y.len() / (x.len() / inp.max(1)).max(1);
    for (xi, yi) in x.chunks_exact(inp).zip(y.chunks_exact_mut(out)) {
        let c = project_a(a, scale, xi);
        add_b(bb, &c, 0, yi);
    }
}

/// Inputs per piece of `x @ a`: the sum runs a piece at a time, pieces added in order, so a
/// team can compute the pieces in parallel (`FirstHalves`) and get the bits of one thread's
/// `project_a`, whatever the thread count. Pieces need not balance the threads (those
/// without one start on the matmul meanwhile), only be few: each is a claim of the region's
/// shared counter (`--synthetic-lora`, 0.6B, 2 threads, 256 against 1024: no difference
/// above the run-to-run noise, and 4x the claims).
pub const PIECE: usize = 1024;

/// `scale * (x @ a)` for one row `x` (`a` [x.len(), r]): the rank-r vector the second half
/// (`add_b`) spreads over the outputs.
pub fn project_a(a: Stored, scale: f32, x: &[f32]) -> Vec<f32> {
    // one thread's `FirstHalves`: the bits a team's pieces give
    let Some(h) = FirstHalves::new(x, &[(a, scale)]) else {
        return vec![0f32; a.len() / x.len().max(1)];
    };
    (0..h.pieces()).for_each(|p| h.piece(p));
    h.first_half(0)
}

/// `Σ_k x[k] a[k]` over the inputs `k` of piece `p` (`PIECE` of them, fewer in the last),
/// into `out` (r values).
pub fn project_piece(a: Stored, x: &[f32], p: usize, out: &mut [f32]) {
    match a {
        Stored::F32(a) => project_piece_of(a, x, p, out),
        Stored::F16(a) => {
            if let Ok(out8) = <&mut [f32; 8]>::try_from(&mut *out) {
                // rank 8 through the CPU's f16 conversion where it has one (the same bits)
                let k = piece_range(x.len(), p);
                if lora_half::project8(&a[k.start * 8..k.end * 8], &x[k], out8) {
                    return;
                }
            }
            project_piece_of(a, x, p, out)
        }
    }
}

/// The inputs of piece `p` of an input `len` long.
fn piece_range(len: usize, p: usize) -> std::ops::Range<usize> {
    (p * PIECE).min(len)..((p + 1) * PIECE).min(len)
}

/// `project_piece` of f32 copies in the portable loop whatever the instruction set: the
/// slow reference of `cpu::lora_half`.
#[cfg(test)]
pub(crate) fn project_piece_portable(a: &[f32], x: &[f32], p: usize, out: &mut [f32]) {
    let r = out.len();
    let k = piece_range(x.len(), p);
    project_piece_body(&a[k.start * r..k.end * r], &x[k], out)
}

fn project_piece_of<E: Elem>(a: &[E], x: &[f32], p: usize, out: &mut [f32]) {
    let r = out.len();
    let k = piece_range(x.len(), p);
    let (a, x) = (&a[k.start * r..k.end * r], &x[k]);
    #[cfg(target_arch = "x86_64")]
    if crate::engine::cpu::isa::active().avx2() {
        // SAFETY: the CPU has AVX2 and FMA (`isa` detected them).
        return unsafe { project_piece_avx2(a, x, out) };
    }
    project_piece_body(a, x, out)
}

/// The first halves (`scale · (x @ a)`) of a region's LoRA branches, which share the input
/// `x`, computed a piece of the input at a time (`piece`, one task of the region each) and
/// read back whole (`first_half`) by the tasks that add the second halves. The pieces' sums
/// are stored as f32 bits in atomics: written by one thread, read by others after the
/// region's count of finished pieces says they are done (`team::Ready`).
pub struct FirstHalves<'a> {
    x: &'a [f32],
    /// Each branch's `a` [x.len(), r], scale, and where its r values start in a piece's row.
    branches: Vec<(Stored<'a>, f32, usize)>,
    /// Σ r over the branches: one piece's row of `sums`.
    width: usize,
    sums: Vec<AtomicU32>,
}

impl<'a> FirstHalves<'a> {
    /// For `x` and each branch's `a` [x.len(), r] and scale; `None` where an `a` does not
    /// have a whole number of rows of `x.len()` values.
    pub fn new(x: &'a [f32], branches: &[(Stored<'a>, f32)]) -> Option<Self> {
        let mut width = 0;
        let mut bs = Vec::with_capacity(branches.len());
        for &(a, scale) in branches {
            if x.is_empty() || !a.len().is_multiple_of(x.len()) {
                return None;
            }
            bs.push((a, scale, width));
            width += a.len() / x.len();
        }
        let sums = (0..width * x.len().div_ceil(PIECE))
            .map(|_| AtomicU32::new(0))
            .collect();
        Some(FirstHalves {
            x,
            branches: bs,
            width,
            sums,
        })
    }

    /// Tasks of the first halves: one a piece of the input.
    pub fn pieces(&self) -> usize {
        self.x.len().div_ceil(PIECE)
    }

    /// Piece `p` of every branch.
    pub fn piece(&self, p: usize) {
        let mut part = Vec::new();
        for &(a, _, at) in &self.branches {
            part.resize(a.len() / self.x.len(), 0f32);
            project_piece(a, self.x, p, &mut part);
            for (slot, v) in self.sums[p * self.width + at..].iter().zip(&part) {
                slot.store(v.to_bits(), Ordering::Relaxed);
            }
        }
    }

    /// Branch `i`'s `scale · (x @ a)`, from its pieces once all have run: `project_a`'s bits.
    pub fn first_half(&self, i: usize) -> Vec<f32> {
        let (a, scale, at) = self.branches[i];
        let r = a.len() / self.x.len();
        let mut sum = vec![0f32; r];
        for row in self.sums.chunks_exact(self.width.max(1)) {
            for (s, v) in sum.iter_mut().zip(&row[at..at + r]) {
                *s += f32::from_bits(v.load(Ordering::Relaxed));
            }
        }
        sum.iter_mut().for_each(|s| *s *= scale);
        sum
    }
}

/// `y[n - first] += Σ_j c[j] b[j][n]` for the outputs `first..first + y.len()` (`bb`: `b` in
/// blocks, `block_b`): one task's rows of a projection, each output as `add_host` computes it
/// for the whole row, so the result does not depend on how rows are split.
pub fn add_b(bb: Stored, c: &[f32], first: usize, y: &mut [f32]) {
    match bb {
        Stored::F32(bb) => add_b_of(bb, c, first, y),
        Stored::F16(bb) => {
            if let Ok(c8) = <&[f32; 8]>::try_from(c) {
                // the whole blocks through the CPU's f16 conversion where it has one, the ends
                // short of a whole block as before (the same bits per output either way)
                let whole = whole_blocks(first, y.len());
                let (head, rest) = y.split_at_mut(whole.start - first);
                let (mid, tail) = rest.split_at_mut(whole.len());
                let (lo, hi) = (whole.start, whole.end);
                let blocks = &bb[lo / LANES * 8 * LANES..hi / LANES * 8 * LANES];
                if lora_half::add_b8(blocks, c8, mid) {
                    add_b_of(bb, c, first, head);
                    add_b_of(bb, c, hi, tail);
                    return;
                }
            }
            add_b_of(bb, c, first, y)
        }
    }
}

/// The outputs of `first..first + len` that fill whole blocks of `LANES` (`block_b`); those
/// before and after it are the range's ends, one output at a time.
fn whole_blocks(first: usize, len: usize) -> std::ops::Range<usize> {
    let end = first + len;
    let lo = first.next_multiple_of(LANES).min(end);
    lo..lo + (end - lo) / LANES * LANES
}

/// `add_b` of f32 blocks in the portable loop whatever the instruction set: the slow
/// reference of `cpu::lora_half`.
#[cfg(test)]
pub(crate) fn add_b_portable(bb: &[f32], c: &[f32], first: usize, y: &mut [f32]) {
    add_b_body(bb, c, first, y)
}

fn add_b_of<E: Elem>(bb: &[E], c: &[f32], first: usize, y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::engine::cpu::isa::active().avx2() {
        // SAFETY: as above.
        return unsafe { add_b_avx2(bb, c, first, y) };
    }
    add_b_body(bb, c, first, y)
}

/// The same loops compiled for AVX2 + FMA (the default build targets baseline x86-64).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn project_piece_avx2<E: Elem>(a: &[E], x: &[f32], out: &mut [f32]) {
    project_piece_body(a, x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn add_b_avx2<E: Elem>(bb: &[E], c: &[f32], first: usize, y: &mut [f32]) {
    add_b_body(bb, c, first, y)
}

/// Four partial sums over interleaved rows of `a` (`x.len()` rows of `out.len()`): one chain
/// of rank-wide adds would wait on each add's latency at every input (the whole `x @ a` of a
/// decode step was a ~0.7M-cycle chain on the 0.6B shape with 16 adapted layers). Rank 8, the
/// common one, on arrays so the chains stay in registers.
#[inline(always)]
fn project_piece_body<E: Elem>(a: &[E], x: &[f32], out: &mut [f32]) {
    if out.len() == 8 {
        return chains(a, x, [[0f32; 8]; 4], out);
    }
    chains(
        a,
        x,
        std::array::from_fn::<Vec<f32>, 4, _>(|_| vec![0f32; out.len()]),
        out,
    )
}

/// `project_piece_body`'s four chains, in fixed-size rows (rank 8) or heap ones (any rank).
#[inline(always)]
fn chains<E: Elem, T: AsMut<[f32]> + AsRef<[f32]>>(
    a: &[E],
    x: &[f32],
    mut t: [T; 4],
    out: &mut [f32],
) {
    let mut rows = x.iter().zip(a.chunks_exact(out.len().max(1)));
    'rows: loop {
        for tc in t.iter_mut() {
            let Some((&xv, ar)) = rows.next() else {
                break 'rows;
            };
            for (tj, &aj) in tc.as_mut().iter_mut().zip(ar) {
                *tj += xv * aj.widen();
            }
        }
    }
    let [t0, t1, t2, t3] = t.each_ref().map(|v| v.as_ref());
    for (j, o) in out.iter_mut().enumerate() {
        *o = (t0[j] + t1[j]) + (t2[j] + t3[j]);
    }
}

/// Each output's rank-wide dot product, added to the output: `LANES` outputs at a time where
/// a whole block is in range (vertical adds of r vectors, which vectorize), one at a time at
/// the ends, in the same order per output either way. Rank 8, the common one, sums its
/// products as a tree; other ranks in order.
#[inline(always)]
fn add_b_body<E: Elem>(bb: &[E], c: &[f32], first: usize, y: &mut [f32]) {
    let r = c.len();
    if r == 0 {
        return; // a rank-0 branch adds nothing
    }
    let one = |n: usize| -> f32 {
        let base = (n / LANES) * r * LANES + n % LANES;
        let b = |j: usize| bb[base + j * LANES].widen();
        if r == 8 {
            let mut p = [0f32; 8];
            for (j, pj) in p.iter_mut().enumerate() {
                *pj = c[j] * b(j);
            }
            return ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
        }
        (0..r).fold(0f32, |s, j| s + c[j] * b(j))
    };
    let (end, whole) = (first + y.len(), whole_blocks(first, y.len()));
    let (lo, hi) = (whole.start, whole.end);
    for n in (first..lo).chain(hi..end) {
        y[n - first] += one(n);
    }
    let blocks = bb[(lo / LANES) * r * LANES..(hi / LANES) * r * LANES].chunks_exact(r * LANES);
    let ys = y[lo - first..hi - first].chunks_exact_mut(LANES);
    if r == 8 {
        // (plain loops: `array::from_fn` is not inlined into the AVX2 copy of this body)
        for (yv, blk) in ys.zip(blocks) {
            let mut p = [[0f32; LANES]; 8];
            for ((pj, run), &cj) in p.iter_mut().zip(blk.chunks_exact(LANES)).zip(c) {
                for (pl, &bl) in pj.iter_mut().zip(run) {
                    *pl = cj * bl.widen();
                }
            }
            for (l, v) in yv.iter_mut().enumerate() {
                *v += ((p[0][l] + p[4][l]) + (p[1][l] + p[5][l]))
                    + ((p[2][l] + p[6][l]) + (p[3][l] + p[7][l]));
            }
        }
        return;
    }
    for (yv, blk) in ys.zip(blocks) {
        let mut s = [0f32; LANES];
        for (&cj, run) in c.iter().zip(blk.chunks_exact(LANES)) {
            for (sl, &bl) in s.iter_mut().zip(run) {
                *sl += cj * bl.widen();
            }
        }
        for (v, sl) in yv.iter_mut().zip(s) {
            *v += sl;
        }
    }
}

/// An adapter: module path (e.g. `model.layers.27.mlp.down_proj`) -> branch.
#[derive(Debug, Clone)]
pub struct Adapter {
    pub dir: PathBuf,
    pub scale: f64,
    pub rank: usize,
    pub branches: BTreeMap<String, LoraBranch>,
}

/// Largest adapter scale accepted: far above any trained adapter, far below overflow.
const MAX_SCALE: f64 = 1e4;

impl Adapter {
    /// Loads an adapter directory. Shapes are checked against the model later, by
    /// `check_module`, when each projection is built.
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let cfg_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| EngineError::io(&cfg_path, e))?;
        let file = SafetensorsFile::open(&dir.join("adapters.safetensors"))?;
        Self::from_parts(dir, &text, &file, device)
    }

    /// The adapter of `adapter_config.json`'s text and the parsed `adapters.safetensors`
    /// (pure: `dir` only names the files in messages).
    pub fn from_parts(
        dir: &Path,
        text: &str,
        file: &SafetensorsFile,
        device: &Device,
    ) -> Result<Self> {
        let cfg_path = dir.join("adapter_config.json");
        let err = |why: String| EngineError::Adapter {
            path: cfg_path.clone(),
            why,
        };
        let cfg: Value =
            serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        let ft = cfg
            .get("fine_tune_type")
            .and_then(Value::as_str)
            .unwrap_or("lora");
        if ft != "lora" {
            return Err(err(format!(
                "fine_tune_type `{ft}` is not supported: only `lora` adapters run (DoRA and full fine-tunes do not)"
            )));
        }
        let lp = cfg
            .get("lora_parameters")
            .ok_or_else(|| err("field `lora_parameters` is missing".into()))?;
        let scale = lp.get("scale").and_then(Value::as_f64).ok_or_else(|| {
            err("field `lora_parameters.scale` is missing or not a number".into())
        })?;
        if !(scale.is_finite() && scale.abs() <= MAX_SCALE) {
            return Err(err(format!(
                "lora_parameters.scale is {scale}: expected a finite number within ±{MAX_SCALE} \
                 (mlx_lm uses it as is; adapters are trained with 1 to a few tens)"
            )));
        }
        let rank_cfg = lp.get("rank").and_then(Value::as_u64).map(|r| r as usize);

        let st_path = dir.join("adapters.safetensors");
        let mut pairs: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
        let mut rank = None;
        for name in file.tensors.keys() {
            let (module, which) = match name.rsplit_once('.') {
                Some((m, w @ ("lora_a" | "lora_b"))) => (m.to_string(), w),
                _ => {
                    return Err(EngineError::Adapter {
                        path: st_path.clone(),
                        why: format!("unexpected tensor `{name}`: expected only `<module>.lora_a` / `<module>.lora_b`"),
                    })
                }
            };
            let t = file
                .get(name)
                .ok_or_else(|| err(format!("tensor `{name}` vanished")))?;
            if t.shape.len() != 2 {
                return Err(EngineError::BadTensor {
                    path: st_path.clone(),
                    name: name.clone(),
                    why: format!("expected a 2-D matrix, found shape {:?}", t.shape),
                });
            }
            let r = if which == "lora_a" {
                t.shape[1]
            } else {
                t.shape[0]
            };
            if *rank.get_or_insert(r) != r {
                return Err(EngineError::BadTensor {
                    path: st_path.clone(),
                    name: name.clone(),
                    why: format!(
                        "rank {r} differs from the adapter's other tensors ({})",
                        rank.unwrap_or(0)
                    ),
                });
            }
            if let Some(i) = t.to_f32_vec()?.iter().position(|v| !v.is_finite()) {
                return Err(EngineError::BadTensor {
                    path: st_path.clone(),
                    name: name.clone(),
                    why: format!("element {i} is NaN or infinite"),
                });
            }
            let e = pairs.entry(module).or_default();
            let tensor = t.to_candle_f32(device)?;
            if which == "lora_a" {
                e.0 = Some(tensor)
            } else {
                e.1 = Some(tensor)
            }
        }
        let rank = rank.ok_or_else(|| EngineError::Adapter {
            path: st_path.clone(),
            why: "holds no lora_a/lora_b tensors".into(),
        })?;
        if let Some(rc) = rank_cfg {
            if rc != rank {
                return Err(err(format!(
                    "lora_parameters.rank is {rc} but the tensors have rank {rank}"
                )));
            }
        }
        let mut branches = BTreeMap::new();
        for (module, (a, b)) in pairs {
            let (Some(a), Some(b)) = (a, b) else {
                return Err(EngineError::Adapter {
                    path: st_path.clone(),
                    why: format!("`{module}` has only one of lora_a / lora_b"),
                });
            };
            branches.insert(module, LoraBranch::new(a, b, scale)?);
        }
        Ok(Adapter {
            dir: dir.to_path_buf(),
            scale,
            rank,
            branches,
        })
    }

    /// Takes the branch of `module` after checking it against the projection's shape.
    pub fn take(
        &mut self,
        module: &str,
        in_features: usize,
        out_features: usize,
    ) -> Result<Option<LoraBranch>> {
        let Some(br) = self.branches.remove(module) else {
            return Ok(None);
        };
        let path = self.dir.join("adapters.safetensors");
        for (name, t, want) in [
            ("lora_a", &br.a, [in_features, self.rank]),
            ("lora_b", &br.b, [self.rank, out_features]),
        ] {
            if t.dims() != want {
                return Err(EngineError::BadTensor {
                    path: path.clone(),
                    name: format!("{module}.{name}"),
                    why: format!(
                        "does not fit the model: expected shape {want:?} for a {in_features} -> {out_features} projection, found {:?}",
                        t.dims()
                    ),
                });
            }
        }
        Ok(Some(br))
    }

    /// After the model took its branches: any left over name modules the model lacks.
    pub fn ensure_all_used(&self) -> Result<()> {
        if let Some(name) = self.branches.keys().next() {
            return Err(EngineError::Adapter {
                path: self.dir.join("adapters.safetensors"),
                why: format!(
                    "adapts `{name}`, which this model does not have ({} unused modules): the adapter was trained for another model",
                    self.branches.len()
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The branch's second half (from `b` in blocks) matches a plain dot product per output,
    /// and over a row split into pieces at any offset gives the bits of the whole row; the
    /// first half (four partial sums a piece) matches a single-chain sum within f32 rounding;
    /// odd sizes and ranks.
    #[test]
    fn halves_split_like_whole_rows() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for (inp, r, out, piece) in [
            (67, 8, 50, 7),
            (3000, 8, 96, 32),
            (5, 3, 9, 4),
            (9, 5, 21, 13),
        ] {
            let mut v = |n: usize| {
                (0..n)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect::<Vec<_>>()
            };
            let (a, b, x, y0) = (v(inp * r), v(r * out), v(inp), v(out));
            let bb = block_b(&b, r, out);
            let c = project_a(Stored::F32(&a), 3.0, &x);
            let mut naive = vec![0f32; r];
            for (k, &xv) in x.iter().enumerate() {
                for j in 0..r {
                    naive[j] += xv * a[k * r + j];
                }
            }
            for (got, want) in c.iter().zip(&naive) {
                let bound = 1e-5 * (inp as f32).sqrt() * 3.0;
                assert!((got - want * 3.0).abs() <= bound, "{got} vs {}", want * 3.0);
            }
            let mut whole = y0.clone();
            add_b(Stored::F32(&bb), &c, 0, &mut whole);
            for (n, (&got, &y)) in whole.iter().zip(&y0).enumerate() {
                let want: f32 = (0..r).map(|j| c[j] * b[j * out + n]).sum();
                assert!(
                    (got - y - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "output {n}"
                );
            }
            let mut pieces = y0.clone();
            let mut first = 0;
            for chunk in pieces.chunks_mut(piece) {
                add_b(Stored::F32(&bb), &c, first, chunk);
                first += chunk.len();
            }
            assert_eq!(whole, pieces, "inp {inp} r {r} out {out}");
            assert_ne!(whole, y0);
        }
    }

    /// The first halves of several branches computed a piece at a time, the pieces on a
    /// pool's threads in any order, give `project_a`'s bits for each branch (ranks 8 and 3,
    /// inputs over several pieces and fewer than one).
    #[test]
    fn pieces_on_threads_give_project_a_bits() {
        use rayon::prelude::*;
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for inp in [2500, 1024, 100] {
            let mut v = |n: usize| {
                (0..n)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect::<Vec<_>>()
            };
            let (x, a8, a3) = (v(inp), v(inp * 8), v(inp * 3));
            let (a8, a3) = (Stored::F32(&a8), Stored::F32(&a3));
            let halves = FirstHalves::new(&x, &[(a8, 2.5), (a3, -0.5)]).expect("halves");
            assert_eq!(halves.pieces(), inp.div_ceil(PIECE));
            (0..halves.pieces())
                .into_par_iter()
                .rev()
                .for_each(|p| halves.piece(p));
            assert_eq!(halves.first_half(0), project_a(a8, 2.5, &x), "inp {inp}");
            assert_eq!(halves.first_half(1), project_a(a3, -0.5, &x), "inp {inp}");
            assert!(halves.first_half(0).iter().any(|&c| c != 0.0));
        }
        assert!(FirstHalves::new(&[1.0; 10], &[(Stored::F32(&[0.0; 25]), 1.0)]).is_none());
    }

    /// A rank-0 branch adds nothing, and no rows is nothing to do: neither panics (the
    /// blocked `b` and the pieces of `x @ a` are empty there).
    #[test]
    fn rank_zero_and_no_rows_add_nothing() {
        let dev = Device::Cpu;
        let a = Tensor::zeros((64, 0), DType::F32, &dev).unwrap();
        let b = Tensor::zeros((0, 20), DType::F32, &dev).unwrap();
        let br = LoraBranch::new(a, b, 2.0).unwrap();
        let x: Vec<f32> = (0..64 * 6).map(|i| i as f32).collect();
        let mut y = vec![1.5f32; 20 * 6];
        assert!(br.add_rows(&x, &mut y));
        assert!(y.iter().all(|&v| v == 1.5));
        assert!(br.add_rows(&[], &mut []));
        let (ha, _, _) = br.host_parts().unwrap();
        let halves = FirstHalves::new(&x[..64], &[(ha, 2.0)]).unwrap();
        (0..halves.pieces()).for_each(|p| halves.piece(p));
        assert!(halves.first_half(0).is_empty());
    }

    /// The CPU loops against candle's `y + scale * ((x @ a) @ b)`: 1, 5 and 37 rows (the last
    /// two a prompt's, spread over threads), rank 8 and 3; and every row of a prompt's gets
    /// the bits `add_host` gives it alone (a decode step's).
    #[test]
    fn host_loops_match_candle_ops() {
        let dev = Device::Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for (l, inp, r, out) in [(1, 64, 8, 48), (5, 96, 3, 40), (37, 1300, 8, 70)] {
            let mut v = |n: usize| {
                (0..n)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect::<Vec<_>>()
            };
            let a = Tensor::from_vec(v(inp * r), (inp, r), &dev).unwrap();
            let b = Tensor::from_vec(v(r * out), (r, out), &dev).unwrap();
            let x = Tensor::from_vec(v(l * inp), (l, inp), &dev).unwrap();
            let y = Tensor::from_vec(v(l * out), (l, out), &dev).unwrap();
            let br = LoraBranch::new(a, b, 20.0).unwrap();
            assert!(br.host.is_some());
            let want = (&y + br.forward(&x).unwrap()).unwrap();
            let got = br.add_to(&x, y.clone()).unwrap();
            assert_eq!(got.dims(), want.dims());
            let d = (got - &want)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let delta = (&want - &y).unwrap().abs().unwrap().flatten_all().unwrap();
            let scale = delta.max(0).unwrap().to_scalar::<f32>().unwrap();
            assert!(scale > 1.0, "the branch added nothing");
            assert!(d <= 1e-5 * scale, "l {l} r {r}: {d} of {scale}");
            let (xs, mut ys) = (
                x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            let (ha, hb, hs) = br.host_parts().unwrap();
            let rows: Vec<f32> = xs
                .chunks_exact(inp)
                .zip(ys.chunks_exact(out))
                .flat_map(|(xi, yi)| {
                    let mut yi = yi.to_vec();
                    add_host(ha, hb, hs, xi, inp, &mut yi);
                    yi
                })
                .collect();
            assert!(br.add_rows(&xs, &mut ys));
            assert_eq!(ys, rows, "l {l}");
            assert!(
                !br.add_rows(&xs, &mut ys[1..]),
                "a y of the wrong size is refused"
            );
        }
    }

    /// `Half::widen` is `half`'s conversion, bit for bit, on every finite f16; `narrow`
    /// rounds to nearest and refuses what f16 cannot hold.
    #[test]
    fn half_widens_every_finite_value_exactly() {
        let mut finite = 0;
        for bits in 0..=u16::MAX {
            let h = half::f16::from_bits(bits);
            if !h.is_finite() {
                continue;
            }
            finite += 1;
            assert_eq!(
                Half(bits).widen().to_bits(),
                h.to_f32().to_bits(),
                "{bits:#06x}"
            );
        }
        assert_eq!(finite, 65536 - 2 * 1024);
        assert_eq!(Half::narrow(1.0 + 1e-4).map(Elem::widen), Some(1.0));
        assert_eq!(
            Half::narrow(-3.0e-6).map(Elem::widen),
            Some(half::f16::from_f32(-3.0e-6).to_f32())
        );
        assert_eq!(Half::narrow(65504.0).map(Elem::widen), Some(65504.0));
        assert!(Half::narrow(70000.0).is_none() && Half::narrow(f32::NAN).is_none());
    }

    /// A halved branch computes as the f32 branch of its values rounded to f16, bit for bit,
    /// in both halves and on a prompt's rows (threads) as a decode row's; its copies are half
    /// the bytes; a value past f16's range keeps the branch in f32.
    #[test]
    fn halved_branch_is_the_f32_branch_of_rounded_values() {
        let dev = Device::Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        let (l, inp, r, out) = (9, 1300, 8, 70);
        let mut v = |n: usize, s: f32| (0..n).map(|_| rng.random_range(-s..s)).collect::<Vec<_>>();
        let (a, b, x, y) = (
            v(inp * r, 0.03),
            v(r * out, 0.01),
            v(l * inp, 4.0),
            v(l * out, 1.0),
        );
        let round = |v: &[f32]| -> Vec<f32> {
            v.iter()
                .map(|&x| Half::narrow(x).expect("finite").widen())
                .collect()
        };
        let t = |v: &[f32], d: (usize, usize)| Tensor::from_vec(v.to_vec(), d, &dev).unwrap();
        let half = LoraBranch::new(t(&a, (inp, r)), t(&b, (r, out)), 20.0)
            .unwrap()
            .halved();
        let rounded =
            LoraBranch::new(t(&round(&a), (inp, r)), t(&round(&b), (r, out)), 20.0).unwrap();
        let full = LoraBranch::new(t(&a, (inp, r)), t(&b, (r, out)), 20.0).unwrap();
        let (ha, hb, _) = half.host_parts().unwrap();
        let (fa, fb, _) = full.host_parts().unwrap();
        assert!(matches!((ha, hb), (Stored::F16(_), Stored::F16(_))));
        assert_eq!(
            (2 * ha.range().1, 2 * hb.range().1),
            (fa.range().1, fb.range().1)
        );
        let (mut yh, mut yr, mut yf) = (y.clone(), y.clone(), y.clone());
        assert!(
            half.add_rows(&x, &mut yh)
                && rounded.add_rows(&x, &mut yr)
                && full.add_rows(&x, &mut yf)
        );
        assert_eq!(yh, yr, "the f16 copies are the rounded values");
        // one row alone, as a decode step adds it
        let mut y0 = y[..out].to_vec();
        add_host(ha, hb, 20.0, &x[..inp], inp, &mut y0);
        assert_eq!(y0, yh[..out]);
        // and close to the adapter's own f32: the largest change a fraction of the largest
        // output the branch adds (f16 keeps 11 significant bits: 2^-12 relative a value)
        let most = |d: &mut dyn Iterator<Item = f32>| d.fold(0f32, f32::max);
        let change = most(&mut yh.iter().zip(&yf).map(|(h, f)| (h - f).abs()));
        let added = most(&mut yf.iter().zip(&y).map(|(f, y0)| (f - y0).abs()));
        assert!(change > 0.0 && change < 2e-3 * added, "{change} of {added}");
        let mut big = b.clone();
        big[5] = 1e5;
        let kept = LoraBranch::new(t(&a, (inp, r)), t(&big, (r, out)), 20.0)
            .unwrap()
            .halved();
        assert!(matches!(
            kept.host_parts(),
            Some((Stored::F32(_), Stored::F32(_), _))
        ));
    }
}
