//! CPU forwards of the fused quantized matmul `y = x @ dequant(W)^T` (the slow references live
//! in `quant.rs`). Three kernels, chosen by `Numerics`:
//! - `Exact` (every bit width): each group is dequantized to f32 (`scale * q + bias`, as mlx
//!   does) in a 128-value stack buffer and reused for all `m` activation rows, so the full
//!   matrix is never materialized. f32 activations and accumulation.
//! - `Fast` (4-bit, AVX2 or NEON): the activations are quantized once per call to 15-bit integers per
//!   block of 32 (`d = max|x| / 16383`), split as `xq = 128·hi + lo` with `lo` in 0..127 so that
//!   both halves fit the signed operand of `maddubs`; the 4-bit codes are its unsigned operand.
//!   Per block `s·d·Σ q·xq` is added, and per group `b·Σx` with the exact f32 `Σx`. Rounding x
//!   to 15 bits is the only change to the numerics: at most `d/2` per element, about 3e-5 of the
//!   block's largest value, below what 4-bit weights can resolve and small enough that greedy
//!   decoding on the mlx_lm fixtures is unchanged (tested).
//! - `Int8` (4-bit, AVX2 or NEON): the same with 8-bit activations (llama.cpp's Q8_0 idea): two fewer
//!   `maddubs` per 64 weights, but an error of up to `max|x|/254` per element that flips
//!   greedy choices at near-ties; the bias term takes the codes' sums (`IntActs::code_sums`).
//!
//! Threads split the output rows (rayon); each task's rows stay in cache while up to four
//! activation rows reuse every unpacked 32-byte chunk.

use crate::engine::cpu::isa::{self, Isa};
use crate::engine::cpu::team;
use crate::engine::cpu::tile16;
use crate::engine::quant::{Numerics, ParamView, QMatrix};
use crate::engine::weights::Dtype;

/// `y (m x rows) = x (m x cols) @ dequant(w)^T`.
pub fn qmatmul(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32], kernel: Numerics) {
    debug_assert_eq!(x.len(), m * w.cols);
    debug_assert_eq!(y.len(), m * w.rows);
    if m == 0 || w.rows == 0 {
        return;
    }
    let isa = isa::active();
    // the integer kernels read bf16 scales directly (MLX's default); others use `Exact`
    let int = int_ok(w, isa);
    let from = gemm_from(&[w]);
    // `int8` prompts: 8-bit activations where that GEMM runs, else `fast`'s prompt GEMMs
    let ints = matches!(kernel, Numerics::Fast | Numerics::Int8);
    match kernel {
        Numerics::Int8 if m >= from && crate::engine::cpu::vnni::int8::usable(w) => {
            crate::engine::cpu::vnni::int8::qgemm(w, x, m, y)
        }
        _ if ints && m >= from && crate::engine::cpu::amx::usable(w) => {
            crate::engine::cpu::amx::qgemm(w, x, m, y)
        }
        _ if ints && m >= from && crate::engine::cpu::vnni::usable(w) => {
            crate::engine::cpu::vnni::qgemm(w, x, m, y)
        }
        _ if ints && m >= GEMM_MIN_ROWS && crate::engine::cpu::i8mm::usable(w) => {
            crate::engine::cpu::i8mm::qgemm(w, x, m, y)
        }
        _ if m >= GEMM_MIN_ROWS && crate::engine::cpu::gemm::available() => {
            crate::engine::cpu::gemm::qgemm(w, x, m, y)
        }
        _ if m >= GEMM_MIN_ROWS => tiled_gemm(w, x, m, y),
        Numerics::Fast if int => int_q4(w, x, m, y, true, isa),
        Numerics::Int8 if int => int_q4(w, x, m, y, false, isa),
        _ => exact(w, x, m, y),
    }
}

/// From this many activation rows on (prefill), weights are dequantized a tile of rows at a
/// time and multiplied with an f32 GEMM: each dequantized value then serves every row, and the
/// arithmetic is the `Exact` kernel's (f32 values, f32 accumulation) whatever `Numerics` says,
/// except `Fast` on AMX (`amx.rs`: 15-bit activations on int8 tiles), AVX-512 VNNI, AVX-VNNI
/// and AVX2 (`vnni.rs`: the same numbers with `vpdpwssd` or `vpmaddwd`) and NEON i8mm
/// (`i8mm.rs`: with `smmla`), and `Int8`: 8-bit activations with `vpdpbusd` on AVX-512 VNNI
/// (`vnni/int8.rs`, from 2 rows where the matrix has its copy, as `Fast`), `Fast`'s GEMMs
/// where that one does not run (more exact than `Int8` promises, and faster than f32).
pub const GEMM_MIN_ROWS: usize = 8;

/// The rows from which `fast` prompts of `ws` take the prompt GEMM: 2 where each has its
/// decode copy (`tile16.rs`), which those GEMMs read and the row kernels do not, so that a
/// short call (a prompt's last chunk of a few tokens) does not read the model's file beside
/// the copy; `GEMM_MIN_ROWS` otherwise.
fn gemm_from(ws: &[&QMatrix]) -> usize {
    let copied = ws
        .iter()
        .all(|w| w.cpu_copy.peek::<tile16::Tiles>().is_some());
    if copied && !ws.is_empty() {
        2
    } else {
        GEMM_MIN_ROWS
    }
}
const TILE_ROWS: usize = 128;

/// Dequantizes weight row `n` into `out` (`scale * q + bias`, as mlx).
fn dequant_row(w: &QMatrix, v: &View, n: usize, out: &mut [f32]) {
    let (gs, bits) = (w.params.group_size, w.params.bits);
    let gb = gs * bits / 8;
    let row = &v.packed[n * v.row_bytes..(n + 1) * v.row_bytes];
    let mut codes = [0u8; 128];
    for (g, (o, bytes)) in out
        .chunks_exact_mut(gs)
        .zip(row.chunks_exact(gb))
        .enumerate()
    {
        let (s, b) = (v.scales.get(n * v.gpr + g), v.biases.get(n * v.gpr + g));
        if bits == 4 {
            for (pair, &byte) in o.chunks_exact_mut(2).zip(bytes) {
                pair[0] = s * (byte & 15) as f32 + b;
                pair[1] = s * (byte >> 4) as f32 + b;
            }
        } else {
            QMatrix::unpack_codes(bits, bytes, &mut codes[..gs]);
            for (d, &q) in o.iter_mut().zip(&codes[..gs]) {
                *d = s * q as f32 + b;
            }
        }
    }
}

fn tiled_gemm(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32]) {
    let k = w.cols;
    let v = View::new(w);
    for_rows(w, m, y, |first, outs| {
        let nr = outs.len() / m;
        let mut tile = vec![0f32; TILE_ROWS * k];
        for t0 in (0..nr).step_by(TILE_ROWS) {
            let tr = TILE_ROWS.min(nr - t0);
            for (j, row) in tile.chunks_exact_mut(k).take(tr).enumerate() {
                dequant_row(w, &v, first + t0 + j, row);
            }
            // yT[t0.., :] (tr x m) = tile (tr x k) @ x^T (k x m)
            // SAFETY: every pointer/stride pair stays inside its slice: dst tr x m (row
            // stride m), lhs tr x k (row stride k), rhs k x m read from x (m x k) transposed.
            unsafe {
                gemm::gemm(
                    tr,
                    m,
                    k,
                    outs[t0 * m..].as_mut_ptr(),
                    1,
                    m as isize,
                    false,
                    tile.as_ptr(),
                    1,
                    k as isize,
                    x.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                )
            };
        }
    });
}

/// Borrowed views of one matrix, resolved once per call.
struct View<'a> {
    packed: &'a [u8],
    scales: ParamView<'a>,
    biases: ParamView<'a>,
    row_bytes: usize,
    gpr: usize,
}

impl<'a> View<'a> {
    fn new(w: &'a QMatrix) -> Self {
        View {
            packed: &w.packed,
            scales: w.scales.view(),
            biases: w.biases.view(),
            row_bytes: w.row_bytes(),
            gpr: w.groups_per_row(),
        }
    }
}

/// Weight rows a task takes out of `rows`: about four tasks a worker, to balance.
fn task_rows(rows: usize) -> usize {
    (rows / (rayon::current_num_threads().max(1) * 4)).clamp(8, 1024)
}

/// The smallest decode task worth a claim, in bytes of codes.
const MIN_TASK_BYTES: usize = 256 << 10;

/// The row counts of a decode region's tasks over `rows` rows of `row_bytes` bytes, in the
/// order they are claimed: `task_rows` each while more than half the rows are left, then a
/// quarter of what is left per worker pair, down to `MIN_TASK_BYTES`, so the last tasks a
/// region's threads finish on are short and neither waits long for the other.
fn decode_tasks(rows: usize, row_bytes: usize) -> Vec<usize> {
    // whole 16-row tiles (`tile16`) where the matrices' rows are multiples of 16
    const ALIGN: usize = 16;
    let most = task_rows(rows).next_multiple_of(ALIGN);
    let threads = rayon::current_num_threads().max(1);
    let least = (MIN_TASK_BYTES / row_bytes.max(1))
        .next_multiple_of(ALIGN)
        .clamp(ALIGN, most);
    let mut sizes = Vec::new();
    let mut left = rows;
    while left > 0 {
        let want = (left / (2 * threads))
            .next_multiple_of(ALIGN)
            .clamp(least, most);
        let take = want.min(left);
        sizes.push(take);
        left -= take;
    }
    sizes
}

/// `decode_tasks` over the rows of `ws` one after another, cut where a matrix ends: (matrix,
/// first row, rows) per task.
fn decode_tasks_of(ws: &[&QMatrix]) -> Vec<(usize, usize, usize)> {
    let total: usize = ws.iter().map(|w| w.rows).sum();
    let mut tasks = Vec::new();
    let (mut i, mut first) = (0, 0);
    for mut n in decode_tasks(total, ws.first().map_or(1, |w| w.row_bytes())) {
        while n > 0 && i < ws.len() {
            let take = n.min(ws[i].rows - first);
            if take > 0 {
                tasks.push((i, first, take));
            }
            (n, first) = (n - take, first + take);
            if first == ws[i].rows {
                (i, first) = (i + 1, 0);
            }
        }
    }
    tasks
}

/// `decode_tasks_of(ws)` with each task's slice of its matrix's output (`ys[i]`: one value
/// per row of `ws[i]`): (matrix, first row, outputs).
fn decode_parts<'a>(
    ws: &[&QMatrix],
    mut ys: Vec<&'a mut [f32]>,
) -> Vec<(usize, usize, &'a mut [f32])> {
    decode_tasks_of(ws)
        .into_iter()
        .map(|(i, first, rows)| {
            let (part, rest) = std::mem::take(&mut ys[i]).split_at_mut(rows);
            ys[i] = rest;
            (i, first, part)
        })
        .collect()
}

/// The bytes a decode matvec of `ws` (one region: `qmatvec_shared`, or `qmatmul` at m = 1 of
/// one matrix) reads first: the codes of its first two tasks' first rows, for a team's helper
/// to read ahead (`team::read_ahead`) before the region opens.
pub fn decode_lead_in(ws: &[&QMatrix]) -> team::Ahead {
    let mut starts: Vec<&[u8]> = decode_tasks_of(ws)
        .into_iter()
        .take(2)
        .map(|(i, first, rows)| {
            let rb = ws[i].row_bytes();
            ws[i]
                .packed
                .get(first * rb..(first + rows) * rb)
                .unwrap_or(&[])
        })
        .collect();
    // the second task is the one a helper claims first (after a LoRA region's `pre` tasks,
    // which `Linear::lead_in` names before these): its range goes first
    starts.reverse();
    team::Ahead::of(&starts)
}

/// Splits the output rows over the worker threads: `f(first_row, out)` fills `out`, the
/// results of rows `first_row..first_row + out.len() / m`, row-major (`m` values per row);
/// then the results are transposed into `y (m x rows)`.
fn for_rows(w: &QMatrix, m: usize, y: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync) {
    if m == 1 {
        // a decode row: on the decode step's team when there is one
        let mut parts = decode_parts(&[w], vec![y]);
        team::for_each_mut(&mut parts, |(_, first, ys)| f(*first, ys));
        return;
    }
    let (rows, chunk) = (w.rows, task_rows(w.rows));
    let mut yt = vec![0f32; rows * m];
    let mut parts: Vec<_> = yt.chunks_mut(chunk * m).enumerate().collect();
    team::for_each_mut(&mut parts, |(c, ys)| f(*c * chunk, ys));
    for (n, col) in yt.chunks_exact(m).enumerate() {
        for (i, &v) in col.iter().enumerate() {
            y[i * rows + n] = v;
        }
    }
}

#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    // 8 independent partial sums let the compiler vectorize without -ffast-math.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

fn exact(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32]) {
    let (gs, bits, k) = (w.params.group_size, w.params.bits, w.cols);
    let gb = gs * bits / 8;
    let v = View::new(w);
    for_rows(w, m, y, |first, outs| {
        let mut codes = [0u8; 128];
        let mut deq = [0f32; 128];
        for (j, out) in outs.chunks_exact_mut(m).enumerate() {
            let n = first + j;
            let row = &v.packed[n * v.row_bytes..(n + 1) * v.row_bytes];
            out.iter_mut().for_each(|o| *o = 0.0);
            for g in 0..v.gpr {
                QMatrix::unpack_codes(bits, &row[g * gb..(g + 1) * gb], &mut codes[..gs]);
                let (s, b) = (v.scales.get(n * v.gpr + g), v.biases.get(n * v.gpr + g));
                for (d, &q) in deq[..gs].iter_mut().zip(&codes[..gs]) {
                    *d = s * q as f32 + b;
                }
                for (i, o) in out.iter_mut().enumerate() {
                    *o += dot(&deq[..gs], &x[i * k + g * gs..i * k + (g + 1) * gs]);
                }
            }
        }
    });
}

/// Activations prepared for the integer kernels: per row, one scale `d` per 32-value block
/// (`max|x| / qmax`), each value's integer code `round(x / d)` (ties to even), and the f32
/// sum of each quantization group: exact for 15-bit codes, the codes' for 8-bit ones
/// (`code_sums`). The codes are stored in the one layout the kernel that
/// reads them wants (`ActLayout`), built in a single pass (SIMD where the CPU has AVX2).
pub struct IntActs {
    pub k: usize,
    pub split: bool,
    pub layout: ActLayout,
    /// `Halves`: per row, the codes of each block split into even (`e`) and odd (`o`)
    /// positions, matching the low and high nibbles of MLX's bytes; with `split`, each code is
    /// `128·h + l` (`h` signed, `l` in 0..127), else only `l` (an int8 code). Empty otherwise.
    pub el: Vec<i8>,
    pub ol: Vec<i8>,
    pub eh: Vec<i8>,
    pub oh: Vec<i8>,
    /// `Words`: per row (stride `k16()`), per pair of blocks `(2p, 2p + 1)`, four vectors
    /// `t` of 16 i16: lanes 0..8 hold codes `4j + t` of block `2p`, lanes 8..16 those of block
    /// `2p + 1`. Lane `j` of a 16-bit word of MLX's codes holds codes `4j..4j + 4` in its four
    /// nibbles, so masks and shifts alone line the weights up with these (no shuffles).
    pub w16: Vec<i16>,
    pub d: Vec<f32>,
    /// `d` with each value repeated 4 times: one f32 lane per i32 lane of the AVX2 sums.
    pub dx: Vec<f32>,
    pub gsum: Vec<f32>,
}

/// Which layout of the integer activations a kernel reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActLayout {
    /// Even/odd 8-bit halves: the `maddubs`/VNNI/NEON kernels.
    Halves,
    /// Whole 15-bit codes as i16 in `madd` order: AVX2 (no VNNI) with 15-bit activations.
    Words,
}

impl ActLayout {
    /// The layout `isa`'s decode kernel reads, with 15-bit (`split`) or 8-bit activations.
    pub fn for_isa(isa: Isa, split: bool) -> Self {
        if split && isa == Isa::Avx2 {
            ActLayout::Words
        } else {
            ActLayout::Halves
        }
    }
}

/// Where code `pos` (0..32) of the first block of a pair goes in its 64 words of `w16`
/// (the second block's are 8 further).
const W16_AT: [usize; 32] = {
    let mut at = [0; 32];
    let mut pos = 0;
    while pos < 32 {
        at[pos] = pos % 4 * 16 + pos / 4;
        pos += 1;
    }
    at
};

impl Default for IntActs {
    /// Activations of no rows, for `fill` to write into.
    fn default() -> Self {
        IntActs {
            k: 0,
            split: false,
            layout: ActLayout::Halves,
            el: Vec::new(),
            ol: Vec::new(),
            eh: Vec::new(),
            oh: Vec::new(),
            w16: Vec::new(),
            d: Vec::new(),
            dx: Vec::new(),
            gsum: Vec::new(),
        }
    }
}

impl IntActs {
    pub fn new(x: &[f32], m: usize, k: usize, gs: usize, split: bool, layout: ActLayout) -> Self {
        let mut a = IntActs::default();
        a.fill(x, m, k, gs, split, layout);
        a
    }

    /// `new`'s activations of `x` written over this one's, in its buffers: a decode step
    /// quantizes ~4 rows a layer, and fresh buffers each time cost the allocator and, between
    /// regions that evicted them, page-cold memory.
    pub fn fill(
        &mut self,
        x: &[f32],
        m: usize,
        k: usize,
        gs: usize,
        split: bool,
        layout: ActLayout,
    ) {
        let nb = k / 32;
        let halves = layout == ActLayout::Halves;
        let half = if split && halves { m * k / 2 } else { 0 };
        let lows = if halves { m * k / 2 } else { 0 };
        fn zeroed<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
            v.clear();
            v.resize(n, T::default());
        }
        let a = self;
        (a.k, a.split, a.layout) = (k, split, layout);
        zeroed(&mut a.el, lows);
        zeroed(&mut a.ol, lows);
        zeroed(&mut a.eh, half);
        zeroed(&mut a.oh, half);
        zeroed(&mut a.d, m * nb);
        zeroed(&mut a.w16, if halves { 0 } else { m * nb.div_ceil(2) * 64 });
        zeroed(&mut a.dx, 4 * m * nb);
        zeroed(&mut a.gsum, m * (k / gs));
        let k16 = a.k16();
        let qmax = if split { 16383.0 } else { 127.0 };
        let mut q = Vec::new();
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            let d = &mut a.d[i * nb..(i + 1) * nb];
            let gsum = &mut a.gsum[i * (k / gs)..(i + 1) * (k / gs)];
            if split {
                group_sums(xr, gs, gsum);
            }
            #[cfg(target_arch = "x86_64")]
            if halves && isa::active().avx2() {
                let r = i * k / 2..(i + 1) * k / 2;
                let (eh, oh) = if split {
                    (&mut a.eh[r.clone()], &mut a.oh[r.clone()])
                } else {
                    (&mut [][..], &mut [][..])
                };
                // SAFETY: the active instruction set has AVX2 and FMA; the slices are this
                // row's (`nb` blocks: `k / 2` codes each, `nb` scales).
                unsafe {
                    crate::engine::cpu::x86::quantize_halves_avx2(
                        &xr[..nb * 32],
                        qmax,
                        split,
                        d,
                        &mut a.el[r.clone()],
                        &mut a.ol[r],
                        eh,
                        oh,
                    )
                };
                continue;
            }
            q.resize(nb * 32, 0);
            quantize_row(&xr[..nb * 32], qmax, d, &mut q);
            for (b, qb) in q.chunks_exact(32).enumerate() {
                if halves {
                    let at = i * k / 2 + b * 16;
                    for j in 0..16 {
                        let (e, o) = (qb[2 * j], qb[2 * j + 1]);
                        if split {
                            (a.el[at + j], a.eh[at + j]) = ((e & 127) as i8, (e >> 7) as i8);
                            (a.ol[at + j], a.oh[at + j]) = ((o & 127) as i8, (o >> 7) as i8);
                        } else {
                            (a.el[at + j], a.ol[at + j]) = (e as i8, o as i8);
                        }
                    }
                } else {
                    let base = i * k16 + b / 2 * 64 + b % 2 * 8;
                    for (&at, &v) in W16_AT.iter().zip(qb) {
                        a.w16[base + at] = v as i16;
                    }
                }
            }
        }
        if !split {
            a.code_sums(m, gs);
        }
        for (dx, &d) in a.dx.chunks_exact_mut(4).zip(&a.d) {
            dx.fill(d);
        }
    }

    /// 8-bit codes: each group's sum as the codes give it, `Σ_blocks d·Σq` in block order,
    /// over `group_sums`' exact one. The bias term `b·Σx` then errs by `b·ΣΔx`, which with
    /// MLX's unsigned codes (zero point in the bias) cancels most of `s·Σ q·Δx`: on the mlx_lm
    /// fixtures `int8`'s logits came 2-4 times closer to mlx_lm's (`vnni::int8` does the same).
    /// 15-bit codes keep the exact sums: their rounding is 128 times finer.
    fn code_sums(&mut self, m: usize, gs: usize) {
        let (k, nb) = (self.k, self.k / 32);
        for i in 0..m {
            for g in 0..k / gs {
                let mut acc = 0f32;
                for b in g * gs / 32..(g + 1) * gs / 32 {
                    // the block's two halves as they lie (this runs before every decode
                    // matvec, on one thread); `code` for the other layout
                    let q: i32 = if self.layout == ActLayout::Halves {
                        let at = i * k / 2 + b * 16;
                        let (e, o) = (&self.el[at..at + 16], &self.ol[at..at + 16]);
                        e.iter().chain(o).map(|&c| c as i32).sum()
                    } else {
                        (0..32).map(|j| self.code(i, b, j)).sum()
                    };
                    acc += q as f32 * self.d[i * nb + b];
                }
                self.gsum[i * (k / gs) + g] = acc;
            }
        }
    }

    /// The row stride of `w16`: whole pairs of blocks.
    pub fn k16(&self) -> usize {
        self.k.div_ceil(64) * 64
    }

    /// The integer code of value `j` of block `b` of row `i` as a plain i32.
    pub(crate) fn code(&self, i: usize, b: usize, j: usize) -> i32 {
        if self.layout == ActLayout::Words {
            return self.w16[i * self.k16() + b / 2 * 64 + b % 2 * 8 + W16_AT[j]] as i32;
        }
        let at = i * self.k / 2 + b * 16 + j / 2;
        let (l, h) = if j.is_multiple_of(2) {
            (&self.el, &self.eh)
        } else {
            (&self.ol, &self.oh)
        };
        if self.split {
            128 * h[at] as i32 + l[at] as i32
        } else {
            l[at] as i32
        }
    }
}

/// Per 32-value block of `x`: `d = max|x| / qmax` and the codes `round_ties_even(x · (1/d))`
/// (zero for an all-zero block). With AVX2 the same bits, faster (this runs on one thread
/// before every decode matmul).
fn quantize_row(x: &[f32], qmax: f32, d: &mut [f32], q: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if isa::active().avx2() {
        // SAFETY: the active instruction set includes AVX2 and FMA (detected or checked).
        unsafe { crate::engine::cpu::x86::quantize_row_avx2(x, qmax, d, q) };
        return;
    }
    quantize_row_scalar(x, qmax, d, q)
}

/// The definition `quantize_row` follows.
pub(crate) fn quantize_row_scalar(x: &[f32], qmax: f32, d: &mut [f32], q: &mut [i32]) {
    for ((blk, db), qb) in x
        .chunks_exact(32)
        .zip(d.iter_mut())
        .zip(q.chunks_exact_mut(32))
    {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let dv = amax / qmax;
        // a zero block, or one whose scale is subnormal (1/dv would overflow): codes 0
        let inv = if dv >= f32::MIN_POSITIVE {
            1.0 / dv
        } else {
            0.0
        };
        *db = dv;
        for (o, &v) in qb.iter_mut().zip(blk) {
            *o = (v * inv).round_ties_even() as i32;
        }
    }
}

/// The f32 sum of each group of `gs` values of `x`, in eight lanes then a fixed tree (the
/// order the compiler can vectorize without reassociating).
fn group_sums(x: &[f32], gs: usize, out: &mut [f32]) {
    for (xs, o) in x.chunks_exact(gs).zip(out.iter_mut()) {
        let mut acc = [0f32; 8];
        for c in xs.chunks_exact(8) {
            for l in 0..8 {
                acc[l] += c[l];
            }
        }
        let t = [
            acc[0] + acc[4],
            acc[1] + acc[5],
            acc[2] + acc[6],
            acc[3] + acc[7],
        ];
        *o = (t[0] + t[2]) + (t[1] + t[3]);
    }
}

/// Scalar definition of the integer kernel for one (row, activation row) over `blocks`: what
/// the AVX2 code must reproduce, and the path for a trailing odd block.
fn int_row_scalar(
    v: &View,
    gs: usize,
    n: usize,
    a: &IntActs,
    i: usize,
    blocks: std::ops::Range<usize>,
) -> f32 {
    let row = &v.packed[n * v.row_bytes..(n + 1) * v.row_bytes];
    let nb = a.k / 32;
    let mut acc = 0f32;
    for b in blocks {
        let mut isum = 0i32;
        for j in 0..16 {
            let byte = row[b * 16 + j];
            isum += (byte & 15) as i32 * a.code(i, b, 2 * j);
            isum += (byte >> 4) as i32 * a.code(i, b, 2 * j + 1);
        }
        acc += v.scales.get(n * v.gpr + b * 32 / gs) * a.d[i * nb + b] * isum as f32;
    }
    acc
}

/// A bf16 value of a little-endian byte slice, as f32 (bf16 is the top half of an f32).
#[inline(always)]
pub(crate) fn bf16_at(b: &[u8], i: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
}

/// `blocks` of one weight row (`row` its codes, `sb` its bf16 scales, groups of
/// `32 << gshift`) against activation row `i`, scalar: the SIMD kernels' blocks past their
/// last whole step.
#[cfg(target_arch = "x86_64")]
pub(crate) fn tail_blocks(
    row: &[u8],
    sb: &[u8],
    gshift: usize,
    a: &IntActs,
    i: usize,
    blocks: std::ops::Range<usize>,
) -> f32 {
    let nb = a.k / 32;
    let mut y = 0f32;
    for b in blocks {
        let mut isum = 0i32;
        for j in 0..32 {
            let byte = row[b * 16 + j / 2];
            let q = if j % 2 == 0 { byte & 15 } else { byte >> 4 };
            isum += q as i32 * a.code(i, b, j);
        }
        y += bf16_at(sb, b >> gshift) * a.d[i * nb + b] * isum as f32;
    }
    y
}

fn bias_term(v: &View, n: usize, a: &IntActs, i: usize) -> f32 {
    (0..v.gpr)
        .map(|g| v.biases.get(n * v.gpr + g) * a.gsum[i * v.gpr + g])
        .sum()
}

/// Blocks of 32 values per row, groups per row, log2(group size / 32).
pub struct RowShape {
    pub nb: usize,
    pub gpr: usize,
    pub gshift: usize,
}

/// Activation rows that share each unpacked chunk of weights.
const MR: usize = 4;

fn int_q4(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32], split: bool, isa: Isa) {
    let a = IntActs::new(
        x,
        m,
        w.cols,
        w.params.group_size,
        split,
        ActLayout::for_isa(isa, split),
    );
    for_rows(w, m, y, |first, outs| {
        int_task(w, &a, first, m, split, isa, outs)
    });
}

/// Whether the integer kernels take this matrix (4-bit codes, groups of 32, 64 or 128 (the
/// x86 kernels have one variant each), bf16 scales and biases).
fn int_ok(w: &QMatrix, isa: Isa) -> bool {
    w.params.bits == 4
        && matches!(w.params.group_size, 32 | 64 | 128)
        && w.scales.dtype == Dtype::BF16
        && w.biases.dtype == Dtype::BF16
        && isa != Isa::Scalar
}

/// `qmatmul` into a new vector. The prompt GEMMs that write every output (`fast` on AMX,
/// AVX-512 VNNI, AVX-VNNI, AVX2 or NEON i8mm) get it without clearing it first (`vnni::shared_outputs`);
/// others a zeroed one.
pub fn qmatmul_vec(w: &QMatrix, x: &[f32], m: usize, kernel: Numerics) -> Vec<f32> {
    if m >= gemm_from(&[w]) {
        if let Some(y) = qmatmul_shared(&[w], x, m, kernel).and_then(|mut ys| ys.pop()) {
            return y;
        }
    }
    let mut y = vec![0f32; m * w.rows];
    qmatmul(w, x, m, &mut y, kernel);
    y
}

/// `qmatmul` of `m` rows against several matrices of the same input (q|k|v, gate|up), where a
/// shared path exists: a decode row (`qmatvec_shared`), or a `fast` prompt on AMX, AVX-512
/// VNNI, AVX-VNNI, AVX2 or NEON i8mm (`shared_gemm`: the activations laid out once, one
/// parallel region). Same arithmetic as `qmatmul` on each; `None` where the caller should run
/// them one by one.
pub fn qmatmul_shared(
    ws: &[&QMatrix],
    x: &[f32],
    m: usize,
    kernel: Numerics,
) -> Option<Vec<Vec<f32>>> {
    let k = ws.first()?.cols;
    if m == 0 || x.len() != m * k || ws.iter().any(|w| w.cols != k) {
        return None;
    }
    if m == 1 {
        return qmatvec_shared(ws, x, kernel);
    }
    let gemm = prompt_gemm(ws, m, kernel)?;
    Some(crate::engine::cpu::vnni::shared_outputs(ws, m, |outs| {
        gemm(ws, x, m, outs)
    }))
}

/// A shared-input prompt GEMM: `amx`, `vnni`, `vnni::int8` or `i8mm::qgemm_shared`.
type SharedGemm = fn(&[&QMatrix], &[f32], usize, &mut [&mut [std::mem::MaybeUninit<f32>]]);

/// The shared-input GEMM that a prompt of `m` rows (2 or more) of `ws` takes with `kernel`, as
/// `qmatmul` picks for each: `int8`'s own where it runs, else `fast`'s; `None` for `exact`, too
/// few rows, or where none takes every matrix.
fn prompt_gemm(ws: &[&QMatrix], m: usize, kernel: Numerics) -> Option<SharedGemm> {
    use crate::engine::cpu::vnni::int8;
    match kernel {
        Numerics::Int8 if m >= gemm_from(ws) && ws.iter().all(|w| int8::usable(w)) => {
            Some(int8::qgemm_shared)
        }
        // a group split between the 8-bit GEMM and another (a width or group size it does not
        // take): one by one, as `qmatmul` takes each
        Numerics::Int8 if m >= gemm_from(ws) && ws.iter().any(|w| int8::usable(w)) => None,
        Numerics::Fast | Numerics::Int8 if m >= gemm_from(ws) => shared_gemm(ws),
        _ => None,
    }
}

/// The GEMM that takes every one of `ws` for a `fast` prompt here (AMX first, then AVX-512
/// VNNI, AVX-VNNI or AVX2, then NEON i8mm); `None` where none does.
fn shared_gemm(ws: &[&QMatrix]) -> Option<SharedGemm> {
    use crate::engine::cpu::{amx, i8mm, vnni};
    if ws.iter().all(|w| amx::usable(w)) {
        Some(amx::qgemm_shared)
    } else if ws.iter().all(|w| vnni::usable(w)) {
        Some(vnni::qgemm_shared)
    } else if ws.iter().all(|w| i8mm::usable(w)) {
        Some(i8mm::qgemm_shared)
    } else {
        None
    }
}

/// `qmatmul_shared` of a prompt (`m` >= 2 rows) into the caller's buffers (`m x rows` each,
/// every element written): the host prompt pass's (`Qwen3::forward_host`) GEMMs, no outputs
/// allocated. `false`, nothing written, where `qmatmul_shared` would return `None`.
pub fn qmatmul_shared_into(
    ws: &[&QMatrix],
    x: &[f32],
    m: usize,
    kernel: Numerics,
    ys: &mut [&mut [f32]],
) -> bool {
    let Some(k) = ws.first().map(|w| w.cols) else {
        return false;
    };
    let shapes_ok = ws.len() == ys.len()
        && x.len() == m * k
        && ws
            .iter()
            .zip(ys.iter())
            .all(|(w, y)| w.cols == k && y.len() == m * w.rows);
    // `gemm_from` is 2 at least: a decode row never comes here
    if !shapes_ok || m < 2 {
        return false;
    }
    let Some(gemm) = prompt_gemm(ws, m, kernel) else {
        return false;
    };
    // SAFETY (as_uninit): the kernels store only computed f32 sums.
    let mut outs: Vec<_> = ys
        .iter_mut()
        .map(|y| unsafe { crate::engine::cpu::vnni::as_uninit(y) })
        .collect();
    gemm(ws, x, m, &mut outs);
    true
}

/// `qmatmul` of one decode row against several matrices of the same input (q|k|v, gate|up):
/// the activations are quantized once and every matrix's rows run in one parallel region, one
/// hand-off to the workers instead of one a matrix. Same arithmetic as `qmatmul` on each.
/// `None` when they do not all take the integer kernel with the same width and group size:
/// the caller then runs them one by one.
pub fn qmatvec_shared(ws: &[&QMatrix], x: &[f32], kernel: Numerics) -> Option<Vec<Vec<f32>>> {
    let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; w.rows]).collect();
    let outs = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
    qmatvec_shared_into(ws, x, kernel, None, &mut IntActs::default(), outs).then_some(ys)
}

/// Whether `qmatvec_shared` runs `ws` against a row of `k` values (else it returns `None`):
/// the integer kernel for every matrix, one width and one group size.
pub fn decode_shared_ok(ws: &[&QMatrix], k: usize, kernel: Numerics) -> bool {
    let isa = isa::active();
    let Some(w0) = ws.first() else { return false };
    kernel != Numerics::Exact
        && w0.cols == k
        && ws
            .iter()
            .all(|w| int_ok(w, isa) && w.cols == k && w.params.group_size == w0.params.group_size)
}

/// What a decode region's task does to its rows before the matmul: `warm(matrix, first row,
/// outputs)` (prefetches what `Then` will read), on the thread that computes them.
pub type Warm<'a> = &'a (dyn Fn(usize, usize, &mut [f32]) + Sync);

/// What a decode region's task does to its rows after the matmul: `then(matrix, first row,
/// outputs, ready)` (a LoRA branch's second half, `lora::add_b`), on the thread that computed
/// them; it calls `ready.wait()` before it reads what the `pre` tasks wrote (a matrix without
/// a branch need not wait).
pub type Then<'a> = &'a (dyn Fn(usize, usize, &mut [f32], &team::Ready) + Sync);

/// Work a decode region does beside the matmul (its LoRA branches): `pre(j)` for `j` in
/// `0..pre_tasks` (the branches' `x @ a`, a piece of the input each), as the region's first
/// tasks; `warm` on each task's rows before its matmul; `then` on them after it
/// (`team::for_each_mut_after`).
#[derive(Clone, Copy)]
pub struct Extra<'a> {
    pub pre_tasks: usize,
    pub pre: &'a (dyn Fn(usize) + Sync),
    pub warm: Warm<'a>,
    pub then: Then<'a>,
}

/// `qmatvec_shared` into the caller's buffers: `ys[i]` holds one value per row of `ws[i]`
/// (every one is written), `acts` the activations' buffers (`IntActs::fill`); a decode
/// step's scratch keeps both from token to token. `extra` runs in the region too (a LoRA
/// branch's two halves): work that would otherwise come before or after the region on the
/// leading thread alone runs on the whole team. `false`, nothing written, where
/// `qmatvec_shared` returns `None`.
pub fn qmatvec_shared_into(
    ws: &[&QMatrix],
    x: &[f32],
    kernel: Numerics,
    extra: Option<Extra>,
    acts: &mut IntActs,
    ys: Vec<&mut [f32]>,
) -> bool {
    if !decode_shared_ok(ws, x.len(), kernel)
        || ys.len() != ws.len()
        || ws.iter().zip(&ys).any(|(w, y)| y.len() != w.rows)
    {
        return false;
    }
    let isa = isa::active();
    let split = kernel == Numerics::Fast;
    let (k, gs) = (ws[0].cols, ws[0].params.group_size);
    acts.fill(x, 1, k, gs, split, ActLayout::for_isa(isa, split));
    let a = &*acts;
    let mut tasks = decode_parts(ws, ys);
    let (pre_tasks, pre): (usize, &(dyn Fn(usize) + Sync)) = match extra {
        Some(e) => (e.pre_tasks, e.pre),
        None => (0, &|_| {}),
    };
    team::for_each_mut_after(pre_tasks, pre, &mut tasks, |(i, first, outs), ready| {
        if let Some(e) = extra {
            (e.warm)(*i, *first, outs);
        }
        int_task(ws[*i], a, *first, 1, split, isa, outs);
        if let Some(e) = extra {
            (e.then)(*i, *first, outs, ready);
        }
    });
    true
}

/// Rows `first..first + outs.len() / m` of `w` against the `m` activation rows of `a`,
/// written as `outs[j * m + i]`.
fn int_task(
    w: &QMatrix,
    a: &IntActs,
    first: usize,
    m: usize,
    split: bool,
    isa: Isa,
    outs: &mut [f32],
) {
    let gs = w.params.group_size;
    let v = View::new(w);
    let shape = RowShape {
        nb: w.cols / 32,
        gpr: v.gpr,
        gshift: (gs / 32).trailing_zeros() as usize,
    };
    if isa.avx2() {
        let rows = crate::engine::cpu::x86::Rows {
            packed: v.packed,
            row_bytes: v.row_bytes,
            scales: v.scales.raw(),
            biases: v.biases.raw(),
            shape: &shape,
        };
        // SAFETY: `isa` was detected at run time (or checked by the tests) and the scales
        // and biases are bf16 (`int_ok`); `outs` holds whole rows of this matrix.
        let row_kernel = |first: usize, outs: &mut [f32]| unsafe {
            crate::engine::cpu::x86::rows(isa, &rows, a, first, m, split, outs)
        };
        #[cfg(target_arch = "x86_64")]
        if let (1, true, Some(t)) = (m, isa.avx512(), w.cpu_copy.peek::<tile16::Tiles>()) {
            // the whole tiles among these rows from the copy, the rows around them as rows
            let end = first + outs.len();
            let (t0, t1) = (
                first.div_ceil(tile16::ROWS),
                (end / tile16::ROWS).min(t.tiles),
            );
            if t0 < t1 {
                let (head, rest) = outs.split_at_mut(t0 * tile16::ROWS - first);
                let (mid, tail) = rest.split_at_mut((t1 - t0) * tile16::ROWS);
                if !head.is_empty() {
                    row_kernel(first, head);
                }
                // SAFETY: AVX-512 VNNI was detected (`isa.avx512()`); `a` is one row of
                // this matrix's inputs in the halves layout (`ActLayout::for_isa`); `mid`
                // holds tiles `t0..t1`'s rows.
                unsafe { tile16::tiles_avx512(t, a, t0..t1, split, mid) };
                if !tail.is_empty() {
                    row_kernel(t1 * tile16::ROWS, tail);
                }
                return;
            }
        }
        row_kernel(first, outs);
        return;
    }
    for (j, out) in outs.chunks_exact_mut(m).enumerate() {
        let n = first + j;
        let row = &v.packed[n * v.row_bytes..(n + 1) * v.row_bytes];
        let sb = &v.scales.raw()[2 * n * v.gpr..2 * (n + 1) * v.gpr];
        let bb = &v.biases.raw()[2 * n * v.gpr..2 * (n + 1) * v.gpr];
        let mut i = 0;
        while i < m {
            let take = (m - i).min(MR);
            let out = &mut out[i..i + take];
            // SAFETY: the integer kernels are only chosen when `isa` was detected at run time
            // (AVX2 and FMA, or NEON, with `sdot` for NeonDot and NeonI8mm) and the scales are
            // bf16; the slices hold one row of codes, scales and biases, `a` the activations of
            // rows `i..i + take`.
            match isa {
                Isa::Neon => unsafe { neon::q4_rows(row, sb, bb, &shape, a, i, take, split, out) },
                Isa::NeonDot | Isa::NeonI8mm => unsafe {
                    neon::q4_rows_dot(row, sb, bb, &shape, a, i, take, split, out)
                },
                // (the x86 sets returned above, through `x86.rs`)
                Isa::Scalar | Isa::Avx2 | Isa::Amx | Isa::Avx512Vnni | Isa::AvxVnni => {
                    for (r, o) in out.iter_mut().enumerate() {
                        *o = int_row_scalar(&v, gs, n, a, i + r, 0..shape.nb)
                            + bias_term(&v, n, a, i + r);
                    }
                }
            }
            i += take;
        }
    }
}

/// The integer kernel's arithmetic without SIMD (tests compare the two).
pub fn int_q4_scalar(w: &QMatrix, x: &[f32], m: usize, split: bool) -> Vec<f32> {
    let gs = w.params.group_size;
    let a = IntActs::new(x, m, w.cols, gs, split, ActLayout::Halves);
    let v = View::new(w);
    let mut y = vec![0f32; m * w.rows];
    for i in 0..m {
        for n in 0..w.rows {
            y[i * w.rows + n] =
                int_row_scalar(&v, gs, n, &a, i, 0..w.cols / 32) + bias_term(&v, n, &a, i);
        }
    }
    y
}

/// The integer kernel on ARM NEON (every aarch64 CPU; Apple Silicon's CPU is what runs when
/// Metal cannot). Per 32-value block, the 16 bytes of codes are split into low and high
/// nibbles (even and odd positions, as `IntActs` splits the activations) and multiplied with
/// the int8 activation halves: with the dot-product extension by `sdot` (four products a lane
/// into i32), else by `smull`/`smlal` into i16 (|15 · 128| · 2 fits) and `sadalp` into i32. The
/// block's sum is scaled by `s_g · d_b` into four f32 lanes per activation row, reduced once at
/// the end. The same integer sums as the scalar definition; only the f32 additions are in
/// another order. `sdot` is written as inline assembly: its intrinsic is not stable yet.
mod neon {
    use super::{IntActs, RowShape};

    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn q4_rows(
        row: &[u8],
        sb: &[u8],
        bb: &[u8],
        shape: &RowShape,
        a: &IntActs,
        i0: usize,
        take: usize,
        split: bool,
        out: &mut [f32],
    ) {
        rows::<false>(row, sb, bb, shape, a, i0, take, split, out)
    }

    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon,dotprod")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn q4_rows_dot(
        row: &[u8],
        sb: &[u8],
        bb: &[u8],
        shape: &RowShape,
        a: &IntActs,
        i0: usize,
        take: usize,
        split: bool,
        out: &mut [f32],
    ) {
        rows::<true>(row, sb, bb, shape, a, i0, take, split, out)
    }

    /// `acc + Σ a·b` over each lane's four int8 pairs.
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon,dotprod")]
    #[inline]
    unsafe fn sdot(
        acc: std::arch::aarch64::int32x4_t,
        a: std::arch::aarch64::int8x16_t,
        b: std::arch::aarch64::int8x16_t,
    ) -> std::arch::aarch64::int32x4_t {
        let mut acc = acc;
        std::arch::asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    /// Σ lo·e + hi·o in four i32 lanes: 16 nibbles of each parity against 16 activations.
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn dot<const DOT: bool>(
        lo: std::arch::aarch64::int8x16_t,
        hi: std::arch::aarch64::int8x16_t,
        e: *const i8,
        o: *const i8,
    ) -> std::arch::aarch64::int32x4_t {
        use std::arch::aarch64::*;
        let (e, o) = (vld1q_s8(e), vld1q_s8(o));
        if DOT {
            return sdot(sdot(vdupq_n_s32(0), lo, e), hi, o);
        }
        let p0 = vmlal_s8(
            vmull_s8(vget_low_s8(lo), vget_low_s8(e)),
            vget_low_s8(hi),
            vget_low_s8(o),
        );
        let p1 = vmlal_high_s8(vmull_high_s8(lo, e), hi, o);
        vpadalq_s16(vpaddlq_s16(p0), p1)
    }

    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows<const DOT: bool>(
        row: &[u8],
        sb: &[u8],
        bb: &[u8],
        shape: &RowShape,
        a: &IntActs,
        i0: usize,
        take: usize,
        split: bool,
        out: &mut [f32],
    ) {
        use std::arch::aarch64::*;
        let (k, nb, gs) = (a.k, shape.nb, shape.gshift);
        let bf16 = super::bf16_at;
        let mask = vdupq_n_u8(0x0f);
        let mut acc = [vdupq_n_f32(0.0); super::MR];
        for b in 0..nb {
            let w = vld1q_u8(row.as_ptr().add(b * 16));
            let lo = vreinterpretq_s8_u8(vandq_u8(w, mask));
            let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(w));
            let s = bf16(sb, b >> gs);
            for r in 0..take {
                let i = i0 + r;
                let off = i * k / 2 + b * 16;
                let mut s32 = dot::<DOT>(lo, hi, a.el.as_ptr().add(off), a.ol.as_ptr().add(off));
                if split {
                    let h = dot::<DOT>(lo, hi, a.eh.as_ptr().add(off), a.oh.as_ptr().add(off));
                    s32 = vmlaq_n_s32(s32, h, 128);
                }
                acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(s32), s * a.d[i * nb + b]);
            }
        }
        for r in 0..take {
            let i = i0 + r;
            let gsum = &a.gsum[i * shape.gpr..(i + 1) * shape.gpr];
            out[r] =
                vaddvq_f32(acc[r]) + (0..shape.gpr).map(|g| bf16(bb, g) * gsum[g]).sum::<f32>();
        }
    }

    #[cfg(not(target_arch = "aarch64"))]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn q4_rows(
        _: &[u8],
        _: &[u8],
        _: &[u8],
        _: &RowShape,
        _: &IntActs,
        _: usize,
        _: usize,
        _: bool,
        _: &mut [f32],
    ) {
        unreachable!("the NEON kernel is chosen only on aarch64")
    }

    #[cfg(not(target_arch = "aarch64"))]
    pub use q4_rows as q4_rows_dot;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::quant::testutil::random_qmatrix;
    use crate::engine::weights::Dtype;
    use rand::{Rng, SeedableRng};

    fn rel_err(a: &[f32], b: &[f32]) -> f32 {
        let max = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / max
    }

    fn rand_x(m: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..m * k).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    /// Fused kernels vs dequantize-then-matmul: every bit width and group size, rows M in
    /// {1, 7, 64} (64 takes the tiled-GEMM path), widths that are not multiples of 512. Relative error: max |Δ| over the
    /// largest |y|.
    #[test]
    fn exact_matches_reference_on_all_bits_and_groups() {
        let mut seed = 0;
        for bits in [2, 3, 4, 5, 6, 8] {
            for gs in [32, 64, 128] {
                for m in [1, 7, 64] {
                    seed += 1;
                    let k = gs * (1 + (seed as usize % 5)) + if gs == 32 { 384 } else { 0 };
                    let rows = 33 + (seed as usize * 7) % 40;
                    let dt = [Dtype::BF16, Dtype::F16, Dtype::F32][seed as usize % 3];
                    let w = random_qmatrix(rows, k, bits, gs, dt, seed);
                    let x = rand_x(m, k, seed + 100);
                    let want = w.matmul_reference(&x, m);
                    let mut got = vec![0f32; m * rows];
                    qmatmul(&w, &x, m, &mut got, Numerics::Exact);
                    let e = rel_err(&got, &want);
                    assert!(e <= 1e-5, "bits {bits} gs {gs} m {m} k {k}: rel err {e}");
                }
            }
        }
    }

    /// Matrices sharing one decode input (q|k|v, gate|up) in one call give each matrix's own
    /// `qmatmul` bits; mixed widths, group sizes or the exact kernel are refused (`None`).
    #[test]
    fn shared_input_matmuls_equal_one_by_one() {
        let k = 1024;
        let ws: Vec<QMatrix> = [(96, 64), (40, 64), (300, 64)]
            .iter()
            .enumerate()
            .map(|(i, &(rows, gs))| random_qmatrix(rows, k, 4, gs, Dtype::BF16, 40 + i as u64))
            .collect();
        let refs: Vec<&QMatrix> = ws.iter().collect();
        let x = rand_x(1, k, 9);
        for kernel in [Numerics::Fast, Numerics::Int8] {
            let got = qmatvec_shared(&refs, &x, kernel);
            if isa::active() == Isa::Scalar {
                assert!(got.is_none());
                continue;
            }
            let got = got.expect("all 4-bit bf16 matrices of one width qualify");
            for (w, y) in ws.iter().zip(&got) {
                let mut want = vec![0f32; w.rows];
                qmatmul(w, &x, 1, &mut want, kernel);
                assert_eq!(y, &want, "{kernel:?}");
            }
        }
        assert!(qmatvec_shared(&refs, &x, Numerics::Exact).is_none());
        let other_gs = random_qmatrix(8, k, 4, 32, Dtype::BF16, 1);
        assert!(qmatvec_shared(&[&ws[0], &other_gs], &x, Numerics::Fast).is_none());
        let other_bits = random_qmatrix(8, k, 8, 64, Dtype::BF16, 2);
        assert!(qmatvec_shared(&[&ws[0], &other_bits], &x, Numerics::Fast).is_none());
    }

    /// A `fast` prompt against matrices sharing one input gives each matrix's own `qmatmul`
    /// bits where a shared prompt path runs (AMX, AVX-512 VNNI, AVX-VNNI, AVX2, NEON i8mm), and is refused
    /// (`None`) elsewhere, for `exact`, and for too few rows.
    #[test]
    fn shared_input_prompts_equal_one_by_one() {
        let (k, m) = (640, 37);
        let ws: Vec<QMatrix> = [(96, 64), (40, 128), (300, 64)]
            .iter()
            .enumerate()
            .map(|(i, &(rows, gs))| random_qmatrix(rows, k, 4, gs, Dtype::BF16, 60 + i as u64))
            .collect();
        let refs: Vec<&QMatrix> = ws.iter().collect();
        let x = rand_x(m, k, 19);
        let shared = matches!(
            isa::active(),
            Isa::Amx | Isa::Avx512Vnni | Isa::AvxVnni | Isa::Avx2 | Isa::NeonI8mm
        );
        let got = qmatmul_shared(&refs, &x, m, Numerics::Fast);
        assert_eq!(got.is_some(), shared, "{:?}", isa::active());
        for (w, y) in ws.iter().zip(got.iter().flatten()) {
            // NaN first: an element the kernel skips stays NaN and fails the comparison
            let mut want = vec![f32::NAN; m * w.rows];
            qmatmul(w, &x, m, &mut want, Numerics::Fast);
            assert_eq!(y, &want);
            // and not a mistake both share: within 15-bit rounding of the f32 reference
            let r = w.matmul_reference(&x, m);
            let max = r.iter().fold(0f32, |a, v| a.max(v.abs()));
            let err = y
                .iter()
                .zip(&r)
                .fold(0f32, |a, (g, v)| a.max((g - v).abs()));
            assert!(err <= 2e-4 * max, "max err {err} of {max}");
        }
        assert!(qmatmul_shared(&refs, &x, m, Numerics::Exact).is_none());
        assert!(qmatmul_shared(&refs, &x[..4 * k], 4, Numerics::Fast).is_none());
    }

    /// `int8` prompts take an integer GEMM wherever `fast` has one: 8-bit activations on
    /// AVX-512 VNNI (`vnni::int8`, within 8-bit rounding of the reference), `fast`'s GEMM's
    /// bits elsewhere (AMX, AVX-VNNI, AVX2, NEON i8mm), f32 only where neither runs; shared
    /// calls give each matrix's own bits, and too few rows go one by one.
    #[test]
    fn int8_prompts_take_an_integer_gemm() {
        use crate::engine::cpu::vnni::int8;
        let (k, m) = (640, 21);
        let ws: Vec<QMatrix> = [(50, 64), (13, 128)]
            .iter()
            .enumerate()
            .map(|(i, &(rows, gs))| random_qmatrix(rows, k, 4, gs, Dtype::BF16, 80 + i as u64))
            .collect();
        let refs: Vec<&QMatrix> = ws.iter().collect();
        let x = rand_x(m, k, 23);
        let got = qmatmul_shared(&refs, &x, m, Numerics::Int8);
        let fast = qmatmul_shared(&refs, &x, m, Numerics::Fast);
        assert_eq!(got.is_some(), fast.is_some(), "{:?}", isa::active());
        let own = ws.iter().all(int8::usable);
        assert_eq!(own, isa::active() == Isa::Avx512Vnni, "{:?}", isa::active());
        eprintln!("int8 prompts on {:?}: own GEMM {own}", isa::active());
        for (i, w) in ws.iter().enumerate() {
            let mut y = vec![f32::NAN; m * w.rows];
            qmatmul(w, &x, m, &mut y, Numerics::Int8);
            if let Some(got) = &got {
                assert_eq!(got[i], y, "shared and alone");
            }
            let mut want = vec![f32::NAN; m * w.rows];
            if own {
                int8::qgemm(w, &x, m, &mut want);
                crate::engine::cpu::amx::assert_within_rounding_to(w, &x, m, &y, int8::QMAX8);
            } else if fast.is_some() {
                qmatmul(w, &x, m, &mut want, Numerics::Fast);
            } else {
                qmatmul(w, &x, m, &mut want, Numerics::Exact);
            }
            assert_eq!(y, want, "{:?} gs {}", isa::active(), w.params.group_size);
        }
        assert!(qmatmul_shared(&refs, &x[..4 * k], 4, Numerics::Int8).is_none());
        if own {
            // groups of 32 take no prompt GEMM: a group with such a matrix goes one by one
            let other = random_qmatrix(32, k, 4, 32, Dtype::BF16, 90);
            assert!(!int8::usable(&other));
            let mixed = [&ws[0], &other];
            assert!(qmatmul_shared(&mixed, &x, m, Numerics::Int8).is_none());
            let mut ys = [vec![0f32; m * ws[0].rows], vec![0f32; m * other.rows]];
            let [a, b] = &mut ys;
            let mut outs = [&mut a[..], &mut b[..]];
            assert!(!qmatmul_shared_into(
                &mixed,
                &x,
                m,
                Numerics::Int8,
                &mut outs
            ));
        }
    }

    /// The groups' sums the bias term takes: for 8-bit codes `Σ_blocks d·Σq` in block order
    /// (within the codes' rounding of the exact sum), for 15-bit ones `group_sums`' exact
    /// sums; groups of 32, 64 and 128, both layouts.
    #[test]
    fn group_sums_are_the_codes_for_int8() {
        let (m, k) = (3, 512);
        let x = rand_x(m, k, 29);
        for gs in [32, 64, 128] {
            for (split, layout) in [
                (false, ActLayout::Halves),
                (true, ActLayout::Halves),
                (true, ActLayout::Words),
            ] {
                let a = IntActs::new(&x, m, k, gs, split, layout);
                let mut moved = 0;
                let mut exact = vec![0f32; m * (k / gs)];
                for i in 0..m {
                    group_sums(&x[i * k..][..k], gs, &mut exact[i * (k / gs)..][..k / gs]);
                }
                for i in 0..m {
                    for g in 0..k / gs {
                        let got = a.gsum[i * (k / gs) + g];
                        let want = exact[i * (k / gs) + g];
                        if split {
                            assert_eq!(got.to_bits(), want.to_bits(), "gs {gs} {layout:?}");
                            continue;
                        }
                        let blocks = g * gs / 32..(g + 1) * gs / 32;
                        let mut codes = 0f32;
                        let mut bound = 1e-5 * want.abs();
                        for b in blocks {
                            let q: i32 = (0..32).map(|j| a.code(i, b, j)).sum();
                            codes += q as f32 * a.d[i * (k / 32) + b];
                            bound += 16.0 * a.d[i * (k / 32) + b];
                        }
                        assert_eq!(got.to_bits(), codes.to_bits(), "gs {gs} row {i} group {g}");
                        assert!((got - want).abs() <= bound, "gs {gs}: {got} vs {want}");
                        moved += (got != want) as usize;
                    }
                }
                // 8-bit codes round most groups' sums away from the exact ones
                assert!(split || moved > m * (k / gs) / 2, "gs {gs}: {moved} moved");
            }
        }
    }

    /// The activation quantizer: the AVX2 pass gives the scalar definition's scales and
    /// codes bit for bit (ties, zero blocks, tiny and huge magnitudes included), and both
    /// layouts hold the same codes, within the stated range.
    #[test]
    fn activation_codes_agree_across_isas_and_layouts() {
        let (m, k, gs) = (3, 1056, 32);
        let mut x = rand_x(m, k, 11);
        x[64..96].fill(0.0); // an all-zero block
        x[128] = 3.0e30;
        x[200] = -1.0e-30;
        // a block whose scale is subnormal (1/d would overflow to inf): codes 0
        x[224..256].iter_mut().for_each(|v| *v *= 1.0e-37);
        for split in [true, false] {
            let qmax = if split { 16383.0 } else { 127.0 };
            // a block whose scale is 1: its halves are ties, rounded to even
            for (j, v) in x[96..128].iter_mut().enumerate() {
                *v = if j == 0 { qmax } else { j as f32 - 16.5 };
            }
            let nb = k / 32;
            let (mut d0, mut q0) = (vec![0f32; nb], vec![0i32; k]);
            quantize_row_scalar(&x[..k], qmax, &mut d0, &mut q0);
            assert!(q0.iter().all(|q| q.abs() <= qmax as i32));
            assert!(q0[224..256].iter().all(|&q| q == 0), "subnormal scale");
            let ties: Vec<i32> = (1..32)
                .map(|j| ((j as f32 - 16.5) / 2.0).round() as i32 * 2)
                .collect();
            assert_eq!(q0[97..128], ties[..], "ties to even");
            #[cfg(target_arch = "x86_64")]
            if crate::engine::cpu::isa::tested_here(
                Isa::Avx2,
                "activation_codes_agree_across_isas_and_layouts",
            ) {
                let (mut d1, mut q1) = (vec![0f32; nb], vec![0i32; k]);
                // SAFETY: AVX2 and FMA checked above
                unsafe {
                    crate::engine::cpu::x86::quantize_row_avx2(&x[..k], qmax, &mut d1, &mut q1)
                };
                assert_eq!(q0, q1, "split {split}");
                assert_eq!(
                    d0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    d1.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
            let h = IntActs::new(&x, m, k, gs, split, ActLayout::Halves);
            let layouts = if split {
                vec![IntActs::new(&x, m, k, gs, split, ActLayout::Words)]
            } else {
                vec![]
            };
            for i in 0..m {
                // every row of each layout is the scalar definition's codes and scales
                let (mut di, mut qi) = (vec![0f32; nb], vec![0i32; k]);
                quantize_row_scalar(&x[i * k..(i + 1) * k], qmax, &mut di, &mut qi);
                assert_eq!(
                    h.d[i * nb..(i + 1) * nb]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    di.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "row {i} split {split}"
                );
                for b in 0..nb {
                    for j in 0..32 {
                        assert_eq!(h.code(i, b, j), qi[b * 32 + j], "{i} {b} {j} {split}");
                        for w in &layouts {
                            assert_eq!(w.code(i, b, j), h.code(i, b, j), "{i} {b} {j}");
                        }
                    }
                }
            }
        }
    }

    /// Decode-sized inputs (M < GEMM_MIN_ROWS, including the 4-row blocking and its
    /// remainder): the integer kernels of every instruction set this CPU runs (AVX2, NEON)
    /// equal their scalar definition (the same integer sums; f32 rounding only) and stay within their stated bounds of the exact product: 15-bit
    /// activations 1e-4, 8-bit activations 1e-2 (relative to the largest |y|).
    #[test]
    fn integer_kernels_match_scalar_and_exact() {
        let (here, missing): (Vec<Isa>, Vec<Isa>) = Isa::ALL.into_iter().partition(|&i| {
            crate::engine::cpu::isa::tested_here(i, "integer_kernels_match_scalar_and_exact")
        });
        eprintln!("integer kernels tested: {here:?}; not on this CPU (skipped): {missing:?}");
        for (gs, m, k) in [
            (32, 1, 96),
            (64, 1, 1024),
            (128, 7, 640),
            (128, 1, 512),
            (64, 1, 448),
            (64, 6, 384),
            (32, 5, 1056),
            (64, 3, 64),
        ] {
            // 51 rows: the decode kernel's pairs of rows and a lone last row
            let w = random_qmatrix(51, k, 4, gs, Dtype::BF16, k as u64);
            let x = rand_x(m, k, 7);
            let want = w.matmul_reference(&x, m);
            for (kernel, split, bound) in
                [(Numerics::Fast, true, 1e-4), (Numerics::Int8, false, 1e-2)]
            {
                let scalar = int_q4_scalar(&w, &x, m, split);
                for &isa in &here {
                    let mut got = vec![0f32; m * 51];
                    int_q4(&w, &x, m, &mut got, split, isa);
                    let e = rel_err(&got, &scalar);
                    assert!(
                        e <= 1e-5,
                        "{isa:?} {kernel:?} gs {gs} m {m} k {k}: vs the scalar definition {e}"
                    );
                }
                if isa::active() != Isa::Scalar {
                    let mut got = vec![0f32; m * 51];
                    qmatmul(&w, &x, m, &mut got, kernel);
                    let e = rel_err(&got, &scalar);
                    assert!(e <= 1e-5, "{kernel:?} through qmatmul: {e}");
                }
                let e = rel_err(&scalar, &want);
                assert!(
                    e <= bound,
                    "{kernel:?} gs {gs} m {m} k {k}: rel err {e} > {bound}"
                );
            }
        }
    }

    /// A decode region's tasks cover each row of each matrix once, in order, none past a
    /// matrix's end, each starting at a whole 16-row tile where the matrices' rows allow;
    /// none bigger than `task_rows` (to a tile), and they shrink toward the end, down to
    /// `MIN_TASK_BYTES` (the 8B shape's q|k|v, down and head, and a small odd one).
    #[test]
    fn decode_tasks_cover_every_row_and_end_short() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        pool.install(|| {
            for (rows, k) in [
                (vec![4096, 1024, 1024], 4096),
                (vec![4096], 12288),
                (vec![151936], 4096),
                (vec![8, 20, 20], 64),
                (vec![1024, 48, 32], 1024),
            ] {
                let ws: Vec<QMatrix> = rows
                    .iter()
                    .map(|&r| random_qmatrix(r, k, 4, 64, Dtype::BF16, 1))
                    .collect();
                let refs: Vec<&QMatrix> = ws.iter().collect();
                let tasks = decode_tasks_of(&refs);
                let mut next = vec![0; ws.len()];
                let mut last = 0;
                for &(i, first, n) in &tasks {
                    assert!(i >= last, "{rows:?}: matrix {i} after {last}");
                    assert_eq!(first, next[i], "{rows:?}: a gap or overlap in matrix {i}");
                    assert!(n > 0 && first + n <= rows[i], "{rows:?}: task {first}+{n}");
                    let most = task_rows(rows.iter().sum()).next_multiple_of(16);
                    assert!(n <= most, "{rows:?}: {n} rows");
                    if rows.iter().all(|r| r % 16 == 0) {
                        assert_eq!(first % 16, 0, "{rows:?}: task at {first} splits a tile");
                    }
                    (next[i], last) = (first + n, i);
                }
                assert_eq!(next, rows, "{rows:?}: not every row");
                let least = (MIN_TASK_BYTES / (k / 2)).next_multiple_of(16).max(16);
                let (_, _, tail) = tasks[tasks.len() - 1];
                assert!(tail <= least, "{rows:?}: the last task has {tail} rows");
            }
        });
    }

    /// The read-ahead hint of a decode region names the first rows of its second task, then
    /// its first, as the region splits them: one matrix, and several sharing a region
    /// (q|k|v) whose first matrix has fewer rows than a task.
    #[test]
    fn decode_lead_in_names_the_first_two_tasks() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        pool.install(|| {
            let w = random_qmatrix(256, 64, 4, 64, Dtype::BF16, 1);
            let rb = w.row_bytes();
            let chunk = task_rows(256);
            assert_eq!(chunk, 32);
            let r = decode_lead_in(&[&w]).ranges();
            let at = |m: &QMatrix, row: usize| m.packed.as_ptr() as usize + row * rb;
            assert_eq!(r[0], (at(&w, chunk), chunk * rb));
            assert_eq!(r[1], (at(&w, 0), chunk * rb));
            // 48 rows in all, tasks of 8: q is task 0 whole, task 1 is k's first rows
            let (q, k, v) = (
                random_qmatrix(8, 64, 4, 64, Dtype::BF16, 2),
                random_qmatrix(20, 64, 4, 64, Dtype::BF16, 3),
                random_qmatrix(20, 64, 4, 64, Dtype::BF16, 4),
            );
            let chunk = task_rows(48);
            assert_eq!(chunk, 8);
            let r = decode_lead_in(&[&q, &k, &v]).ranges();
            assert_eq!(r[0], (at(&k, 0), chunk * rb));
            assert_eq!(r[1], (at(&q, 0), 8 * rb));
        });
    }
}
