//! The prompt GEMM of 4-bit weights on AVX-512 VNNI (Zen 4 and 5, Ice Lake and later Xeons
//! without AMX), and in 256-bit registers on AVX-VNNI and AVX2 (`simd256`), for the `fast`
//! arithmetic: `y (m x rows) = x (m x cols) @ dequant(w)^T` with
//! the activations as 15-bit integers, one scale per 64 values, exactly as `amx.rs` has them,
//! multiplied with `vpdpwssd` (16 lanes, each two signed 16-bit products summed into i32). The
//! slow reference is `QMatrix::matmul_reference`; the result is also the bits of `amx.rs`'s
//! emulated tiles (same quantization, same integer sums, same f32 steps in the same order), so
//! a prompt gives the same numbers on both kinds of CPU.
//!
//! Why: one `vpdpwssd zmm` a cycle is 32 multiply-adds, twice an AVX-512 f32 FMA's 16, and the
//! weights need no f32 dequantization (measured on a Zen 4: both instructions issue once a
//! cycle). llama.cpp prefills these CPUs with 8-bit activations (`vpdpbusd`); 15 bits keep
//! `fast`'s numerics, the decode kernel's.
//!
//! Per 64-value block `kb` of a token: `d = max|x| / 16383`, `xq = round_ties_even(x · (1/d))`,
//! `Σx` in f32 (`quantize`). For 12 weight rows and 16 tokens (a zmm of tokens, one lane each),
//! 32 steps of one pair of values: the pair's two codes as a broadcast dword times the tokens'
//! pair, `c += xq[2p]·q[2p] + xq[2p+1]·q[2p+1]` exactly in i32 (|c| < 2^24, so its conversion
//! is exact too); then `y = fma(b, Σx, fma(c·d, s, y))` in f32, block after block.
//!
//! Layout: activations once a call as `[token vector][block][pair][16 tokens]` dwords (two
//! i16: value `2p` low, `2p + 1` high); a row tile's codes once as `[block][row][pair]` dwords
//! (code `2p` low, `2p + 1` high: a packed byte's two nibbles), so each step's 12 broadcasts
//! come from 12 rows of the unpacked panel (24-72 KiB, in L1 or L2). The tile's sums are
//! transposed in registers, so a token's 12 outputs are one masked store. Where the matrix has
//! its decode copy (`tile16.rs`: Intel's CPUs with AVX-512), the AVX-512 panels take their
//! rows' whole tiles from it, each block transposed back to rows once for the panel's rows in
//! that tile: the same panel, one contiguous stream a tile, and the model's file not read
//! (on the Zen 5 forced to the copy: 0.6B kinds 5-10% faster, 8B kinds even; peak memory at
//! the 8B as with the rows alone, 4.3 GB).

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::mem::MaybeUninit;

use crate::engine::cpu::isa::{self, Isa};
#[cfg(target_arch = "x86_64")]
use crate::engine::cpu::team;
use crate::engine::cpu::tile16;
use crate::engine::quant::QMatrix;

pub mod int8;

/// Values one activation scale covers.
pub(crate) const KB: usize = 64;
/// Pairs of values a block holds.
const PAIRS: usize = KB / 2;
/// Tokens a vector holds.
const TV: usize = 16;
/// Weight rows of one register tile.
const R: usize = 12;
/// The largest activation code: 15 bits with the sign.
pub(crate) const QMAX: f32 = 16383.0;

/// Whether the prompt GEMM of `w` runs here: the process's instruction set is `avx512-vnni`,
/// `avx-vnni` or `avx2` and `w` has 4-bit codes in groups of 64 or a multiple.
pub fn usable(w: &QMatrix) -> bool {
    matches!(isa::active(), Isa::Avx512Vnni | Isa::AvxVnni | Isa::Avx2) && shape_ok(w)
}

/// 4-bit codes, groups a multiple of the 64-value block, whole blocks a row.
pub(crate) fn shape_ok(w: &QMatrix) -> bool {
    w.params.bits == 4
        && w.params.group_size.is_multiple_of(KB)
        && w.cols > 0
        && w.cols.is_multiple_of(KB)
}

/// One token's 64 values as 15-bit integers: `(d, Σx)`, `q[i] = round_ties_even(x[i] · (1/d))`
/// (0 where `d` is 0 or subnormal). Non-finite inputs give non-finite outputs, not the same
/// codes on every path.
/// The one definition of `fast` prompt activations (`amx.rs` splits these into bytes). Written
/// in 16 lanes (the max and the sum lane-wise, then folded in a fixed order) so that it
/// compiles to vector code.
#[inline(always)]
pub(crate) fn quantize(blk: &[f32], q: &mut [i32; KB]) -> (f32, f32) {
    quantize_to(blk, q, QMAX)
}

/// `quantize` with the largest code `qmax` (`QMAX`; 127 for `int8`'s prompts, `int8.rs`).
#[inline(always)]
pub(crate) fn quantize_to(blk: &[f32], q: &mut [i32; KB], qmax: f32) -> (f32, f32) {
    let (mut mx, mut sm) = ([0f32; 16], [0f32; 16]);
    for c in blk[..KB].chunks_exact(16) {
        for i in 0..16 {
            mx[i] = mx[i].max(c[i].abs());
            sm[i] += c[i];
        }
    }
    let amax = mx.iter().fold(0f32, |a, &v| a.max(v));
    let sum = sm.iter().sum();
    let d = amax / qmax;
    // a block of zeros, or so small that `d` is subnormal and 1/d overflows: all codes 0
    let inv = if d >= f32::MIN_POSITIVE { 1.0 / d } else { 0.0 };
    // 1.5·2^23: adding it leaves an |x| < 2^22 rounded to an integer, ties to even (the
    // default rounding), and no libm call
    const ROUND: f32 = 12_582_912.0;
    for (q, &x) in q.iter_mut().zip(blk) {
        *q = (((x * inv + ROUND) - ROUND) as i32).clamp(-(qmax as i32), qmax as i32);
    }
    (d, sum)
}

/// `y = x @ dequant(w)^T` with `vpdpwssd` (or AVX2's `vpmaddwd`). Callers check `usable(w)`
/// first.
pub fn qgemm(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32]) {
    assert!(usable(w), "vnni::qgemm without AVX2");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the kernel stores only computed f32 sums.
    run(&[w], x, m, &mut [unsafe { as_uninit(y) }]);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, m, y);
}

/// `qgemm` of several matrices of the same input (q|k|v, gate|up): the activations laid out
/// once, every matrix's row tiles in one parallel region. Callers check `usable` on each;
/// every element of `outs` (`m x rows` each) is written (`shared_outputs` gives them).
pub fn qgemm_shared(ws: &[&QMatrix], x: &[f32], m: usize, outs: &mut [&mut [MaybeUninit<f32>]]) {
    assert!(
        ws.iter().all(|w| usable(w)),
        "vnni::qgemm_shared without AVX2"
    );
    // `usable` (asserted above) is never true off x86-64, and the caller must not see its
    // outputs unwritten
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "vnni::qgemm_shared off x86-64 ({} values, {m} rows, {} outputs)",
        x.len(),
        outs.len()
    );
    #[cfg(target_arch = "x86_64")]
    run(ws, x, m, outs);
}

/// The outputs of a shared-input call (`m x rows` each), filled by `run(outs)`, which must
/// write every element (`run` here, `amx.rs`'s and `i8mm.rs`'s do: each of a call's tiles
/// stores its rows for every token). They are not zeroed first: a prompt's outputs are
/// megabytes a layer, and clearing them took 3.8% of a 64-token 0.6B prefill on the Zen 4.
/// Also `amx.rs`'s and `i8mm.rs`'s.
pub(crate) fn shared_outputs(
    ws: &[&QMatrix],
    m: usize,
    run: impl FnOnce(&mut [&mut [MaybeUninit<f32>]]),
) -> Vec<Vec<f32>> {
    let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| Vec::with_capacity(m * w.rows)).collect();
    let mut outs: Vec<&mut [MaybeUninit<f32>]> = ys
        .iter_mut()
        .zip(ws)
        .map(|(y, w)| &mut y.spare_capacity_mut()[..m * w.rows])
        .collect();
    run(&mut outs);
    for (y, w) in ys.iter_mut().zip(ws) {
        // SAFETY: `run` wrote all `m * rows` elements (above); the capacity is that.
        unsafe { y.set_len(m * w.rows) };
    }
    ys
}

/// `y` as memory for a kernel to write.
///
/// # Safety
/// Only initialized f32 values may be written through the result (never
/// `MaybeUninit::uninit()`), so that `y` stays initialized: the kernels store computed sums.
pub(crate) unsafe fn as_uninit(y: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has f32's layout; the caller writes only f32 values.
    unsafe { &mut *(y as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// Checks a call's shapes (every matrix `shape_ok` and as wide as `x`'s rows, each output
/// `m x rows`); returns that width. Also `amx.rs`'s and `i8mm.rs`'s.
pub(crate) fn check_shapes(
    ws: &[&QMatrix],
    x: &[f32],
    m: usize,
    ys: &[&mut [MaybeUninit<f32>]],
) -> usize {
    let k = ws.first().map_or(0, |w| w.cols);
    assert!(ws.len() == ys.len() && x.len() == m * k);
    for (w, y) in ws.iter().zip(ys) {
        assert!(shape_ok(w) && w.cols == k && y.len() == m * w.rows);
    }
    k
}

/// A parallel region's tasks: `(matrix, first tile, end tile)`, runs of at most `per_task`
/// tiles of `tile_rows` rows within one matrix. Also `amx.rs`'s and `i8mm.rs`'s.
pub(crate) fn tile_runs(
    ws: &[&QMatrix],
    tile_rows: usize,
    per_task: usize,
) -> Vec<(usize, usize, usize)> {
    let mut tasks = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        let n = w.rows.div_ceil(tile_rows);
        tasks.extend(
            (0..n)
                .step_by(per_task)
                .map(|t0| (i, t0, (t0 + per_task).min(n))),
        );
    }
    tasks
}

/// The activations of one call: token vector `j`, block `kb`, pair `p`, token `t` at
/// `((j * kbs + kb) * PAIRS + p) * TV + t`; `d` and `Σx` at `(j * kbs + kb) * TV + t`. Tokens
/// past `m` are zeros.
struct Acts {
    q: Vec<i32>,
    d: Vec<f32>,
    sx: Vec<f32>,
    kbs: usize,
}

/// Two i16 in one dword, `lo` in the low half (the portable layouts' packing).
#[inline(always)]
fn pair(lo: i32, hi: i32) -> i32 {
    ((lo as u32 & 0xffff) | ((hi as u32) << 16)) as i32
}

/// The activation codes of a call: `fast`'s 15-bit ones two to a dword (`vpdpwssd`), or
/// `int8.rs`'s 8-bit ones four to a dword (`vpdpbusd`, AVX-512 VNNI only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Codes {
    Pairs15,
    Quads8,
}

impl Codes {
    /// Dwords a token's 64-value block takes.
    fn dwords(self) -> usize {
        match self {
            Codes::Pairs15 => PAIRS,
            Codes::Quads8 => int8::QUADS,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn prepare(x: &[f32], m: usize, k: usize, isa: Isa, codes: Codes) -> Acts {
    let (mt, kbs, per) = (m.div_ceil(TV), k / KB, codes.dwords());
    let mut a = Acts {
        q: vec![0; mt * kbs * per * TV],
        d: vec![0.0; mt * kbs * TV],
        sx: vec![0.0; mt * kbs * TV],
        kbs,
    };
    // tasks of `g` blocks of one token vector: a vector a task left all but 4 of 16 threads
    // idle in a 64-token prompt (the Xeon, twenty-ninth session)
    let g = prepare_blocks(kbs, mt, TV.min(m));
    let mut parts: Vec<_> = (a.q.chunks_mut(g * per * TV))
        .zip(a.d.chunks_mut(g * TV).zip(a.sx.chunks_mut(g * TV)))
        .enumerate()
        .collect();
    // on the team a host pass leads (`cpu::team`), else rayon's pool
    team::for_each_mut(&mut parts, |(c, (q, (d, sx)))| {
        let (j, kb0) = (*c / (kbs / g), *c % (kbs / g) * g);
        let kbr = kb0..kb0 + g;
        if codes == Codes::Quads8 {
            // SAFETY: the CPU has AVX-512 VNNI (`run_on` asserted it for 8-bit codes).
            unsafe { int8::simd::prepare_vector(x, m, k, j, kbr, q, d, sx) }
        } else if isa == Isa::Avx512Vnni {
            // SAFETY: the CPU has AVX-512 VNNI (`run_on`'s caller checked).
            unsafe { simd::prepare_vector(x, m, k, j, kbr, q, d, sx) }
        } else {
            // SAFETY: the CPU has AVX2 (`run_on`'s caller checked).
            unsafe { simd256::prepare_vector(x, m, k, j, kbr, q, d, sx) }
        }
    });
    a
}

/// Blocks a task of an activation layout pass takes (`vnni::prepare`, `amx::prepare`): a
/// divisor of `kbs`, so that a task stays within one token vector of `vectors`; ~4 tasks a
/// thread, and no fewer than ~2048 values a task (`tokens` a vector).
pub(crate) fn prepare_blocks(kbs: usize, vectors: usize, tokens: usize) -> usize {
    let least = 2048usize.div_ceil(tokens.max(1) * KB);
    let g = crate::engine::cpu::team::per_task(vectors * kbs, least).min(kbs);
    (1..=g).rev().find(|g| kbs.is_multiple_of(*g)).unwrap_or(1)
}

/// `prepare`'s work for blocks `kbr` of token vector `j` (`q`, `d` and `sx` from block
/// `kbr.start` on): the definition, which `simd::prepare_vector` matches bit for bit
/// (tested); `simd256` compiles it for AVX2.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn prepare_vector(
    x: &[f32],
    m: usize,
    k: usize,
    j: usize,
    kbr: std::ops::Range<usize>,
    q: &mut [i32],
    d: &mut [f32],
    sx: &mut [f32],
) {
    let mut v = [0i32; KB];
    for t in 0..TV.min(m - j * TV) {
        let row = &x[(j * TV + t) * k..][..k];
        for (u, blk) in row[kbr.start * KB..kbr.end * KB]
            .chunks_exact(KB)
            .enumerate()
        {
            (d[u * TV + t], sx[u * TV + t]) = quantize(blk, &mut v);
            let dst = &mut q[u * PAIRS * TV..][..PAIRS * TV];
            for p in 0..PAIRS {
                dst[p * TV + t] = pair(v[2 * p], v[2 * p + 1]);
            }
        }
    }
}

/// A pointer that tasks writing disjoint elements may share (also `amx.rs`'s).
pub(crate) struct SyncPtr(pub(crate) *mut f32);
// SAFETY: used only for writes to disjoint elements (each task its own columns of y).
unsafe impl Sync for SyncPtr {}

/// A row tile's weights, unpacked: `[block][row][pair]` code dwords and `[block][row]` scales
/// and biases (zeros past the matrix's last row).
struct Panel {
    q: Vec<i32>,
    s: Vec<f32>,
    b: Vec<f32>,
    /// one row's scales and biases as f32, on their way into `s` and `b`
    rs: Vec<f32>,
    rb: Vec<f32>,
}

impl Panel {
    fn new(kbs: usize) -> Panel {
        Panel {
            q: vec![0; kbs * R * PAIRS],
            s: vec![0.0; kbs * R],
            b: vec![0.0; kbs * R],
            rs: Vec::new(),
            rb: Vec::new(),
        }
    }

    /// `f` on this thread's panel for rows `kbs` blocks wide (kept from task to task, as
    /// rayon's `for_each_init` kept one a split; remade when the width changes).
    #[cfg(target_arch = "x86_64")]
    fn with<R>(kbs: usize, f: impl FnOnce(&mut Panel) -> R) -> R {
        thread_local! {
            static PANEL: std::cell::RefCell<Option<Panel>> = const { std::cell::RefCell::new(None) };
        }
        PANEL.with(|p| {
            let mut p = p.borrow_mut();
            let panel = match p.take() {
                Some(panel) if panel.s.len() == kbs * R => panel,
                _ => Panel::new(kbs),
            };
            let panel = p.insert(panel);
            f(panel)
        })
    }
}

/// Panel rows `from..` from matrix rows `n0 + from..` of MLX's layout, zeros past the
/// matrix's last row: each 64-value block's 32 bytes through `unpack` (to 32 dwords,
/// `unpack_portable`'s), the group's scale and bias beside it. The bounds are checked once here, not per block, and a row's scales and biases
/// widened in one pass: with a check a slice and a dtype match a value, the fill took ~20% of
/// a 64-token call on the Zen 5 (this way ~10%; the GEMM 8-9% faster).
///
/// # Safety
/// `unpack(src, dst)` reads 32 bytes at `src` and writes at most 32 dwords at `dst` (16 for
/// `int8.rs`'s quads), and nothing else.
#[inline(always)]
unsafe fn fill_rows(
    p: &mut Panel,
    w: &QMatrix,
    n0: usize,
    from: usize,
    unpack: impl Fn(*const u8, *mut i32),
) {
    let (gpr, rb, kbs) = (w.groups_per_row(), w.row_bytes(), w.cols / KB);
    let per_group = w.params.group_size / KB;
    let packed: &[u8] = &w.packed;
    let nr = R.min(w.rows.saturating_sub(n0));
    assert!(packed.len() >= (n0 + nr) * rb);
    assert!(gpr * per_group == kbs && rb == kbs * KB / 2);
    assert!(p.q.len() >= kbs * R * PAIRS && p.s.len() >= kbs * R && p.b.len() >= kbs * R);
    p.rs.resize(gpr, 0.0);
    p.rb.resize(gpr, 0.0);
    let (scales, biases) = (w.scales.view(), w.biases.view());
    let (q, s, b) = (p.q.as_mut_ptr(), p.s.as_mut_ptr(), p.b.as_mut_ptr());
    for r in from..nr {
        let n = n0 + r;
        let row = packed.as_ptr().add(n * rb);
        scales.read_into(n * gpr, &mut p.rs);
        biases.read_into(n * gpr, &mut p.rb);
        // one loop over the blocks (a loop over groups around it cost as much as the unpack)
        let (mut g, mut left) = (0, per_group);
        for kb in 0..kbs {
            let at = kb * R + r;
            // in bounds: kb < kbs, r < R and g < gpr (asserted above)
            unpack(row.add(kb * KB / 2), q.add(at * PAIRS));
            (*s.add(at), *b.add(at)) = (*p.rs.get_unchecked(g), *p.rb.get_unchecked(g));
            left -= 1;
            if left == 0 {
                (g, left) = (g + 1, per_group);
            }
        }
    }
    for r in nr..R {
        for kb in 0..kbs {
            let at = kb * R + r;
            p.q[at * PAIRS..][..PAIRS].fill(0);
            (p.s[at], p.b[at]) = (0.0, 0.0);
        }
    }
}

/// The decode copy of `w` (`tile16.rs`, 16 rows interleaved a word at a time; Intel's CPUs
/// with AVX-512) where the prompt GEMMs take it: groups of 64 or 128. The AVX-512 panels
/// (and `amx.rs`'s tiles) read their rows' whole tiles from it, so prompts do not read the
/// model's file beside it.
pub(crate) fn copy_of(w: &QMatrix) -> Option<&tile16::Tiles> {
    let gs = w.params.group_size;
    w.cpu_copy
        .peek::<tile16::Tiles>()
        .filter(|t| gs >= KB && t.gpr * gs == w.cols)
}

/// 32 packed bytes (64 codes, low nibble first) as 32 dwords of two i16 codes: the slow
/// reference of `simd::unpack`.
#[cfg(test)]
fn unpack_portable(src: &[u8], dst: &mut [i32]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = pair((b & 15) as i32, (b >> 4) as i32);
    }
}

/// Splits the row tiles of every matrix (all `x.len() / m` wide) over rayon's threads; each
/// task fills a panel per tile and runs it against every token vector.
#[cfg(target_arch = "x86_64")]
fn run(ws: &[&QMatrix], x: &[f32], m: usize, ys: &mut [&mut [MaybeUninit<f32>]]) {
    let isa = isa::active();
    assert!(matches!(isa, Isa::Avx512Vnni | Isa::AvxVnni | Isa::Avx2));
    run_on(isa, Codes::Pairs15, ws, x, m, ys)
}

/// `run` with the kernels of `isa` (`Avx512Vnni`, `AvxVnni` or `Avx2`), which the CPU has
/// (asserted), on `codes` (8-bit ones on `Avx512Vnni` only: `int8.rs`).
#[cfg(target_arch = "x86_64")]
fn run_on(
    isa: Isa,
    codes: Codes,
    ws: &[&QMatrix],
    x: &[f32],
    m: usize,
    ys: &mut [&mut [MaybeUninit<f32>]],
) {
    assert!(isa.supported() && matches!(isa, Isa::Avx512Vnni | Isa::AvxVnni | Isa::Avx2));
    assert!(codes == Codes::Pairs15 || isa == Isa::Avx512Vnni);
    let k = check_shapes(ws, x, m, ys);
    if m == 0 {
        return;
    }
    let acts = prepare(x, m, k, isa, codes);
    let outs: Vec<SyncPtr> = ys
        .iter_mut()
        .map(|y| SyncPtr(y.as_mut_ptr().cast()))
        .collect();
    let tiles: usize = ws.iter().map(|w| w.rows.div_ceil(R)).sum();
    // small tasks (~16 a thread, a few tiles each): a region ends when its last task does, and
    // on a shared machine one core may run slower than the other for a while
    let per_task = tiles
        .div_ceil(rayon::current_num_threads().max(1) * 16)
        .max(1);
    let mut tasks = tile_runs(ws, R, per_task);
    // on the team a host pass leads (`cpu::team`), else rayon's pool; a panel a thread
    team::for_each_mut(&mut tasks, |&mut (i, t0, t1)| {
        Panel::with(acts.kbs, |panel| {
            for tile in t0..t1 {
                let (w, n0, out) = (ws[i], tile * R, &outs[i]);
                // SAFETY: the CPU has the instruction set (asserted above).
                unsafe {
                    match isa {
                        Isa::Avx512Vnni if codes == Codes::Quads8 => {
                            simd::tile::<true>(w, &acts, m, n0, panel, out)
                        }
                        Isa::Avx512Vnni => simd::tile::<false>(w, &acts, m, n0, panel, out),
                        Isa::AvxVnni => simd256::tile_vnni(w, &acts, m, n0, panel, out),
                        _ => simd256::tile_avx2(w, &acts, m, n0, panel, out),
                    }
                }
            }
        })
    });
}

/// The same GEMM in 256-bit registers, for CPUs without AVX-512: with AVX-VNNI's VEX-encoded
/// `vpdpwssd` (Alder Lake and later desktop and laptop parts; Zen 5), or with AVX2's
/// `vpmaddwd` then `vpaddd`, which give the same i32 sums (each product of a 15-bit
/// activation and a 4-bit code, a pair of them summed, cannot overflow). Each 16-token vector
/// of the activations is two halves of 8; a register tile is 6 weight rows by those two halves
/// (12 accumulators of the 16 registers; 4 rows ran 4-9% slower on a Zen 5), two of them a
/// panel. Same f32 steps in the same order: the same bits as `simd`.
#[cfg(target_arch = "x86_64")]
mod simd256 {
    use std::arch::x86_64::*;

    use super::{fill_rows, Acts, Panel, SyncPtr, PAIRS, R, TV};
    use crate::engine::quant::QMatrix;

    /// Rows of a register tile.
    const RS: usize = 6;

    /// `super::prepare_vector` compiled for AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn prepare_vector(
        x: &[f32],
        m: usize,
        k: usize,
        j: usize,
        kbr: std::ops::Range<usize>,
        q: &mut [i32],
        d: &mut [f32],
        sx: &mut [f32],
    ) {
        super::prepare_vector(x, m, k, j, kbr, q, d, sx)
    }

    /// `simd::tile` with AVX-VNNI.
    ///
    /// # Safety
    /// The CPU has AVX-VNNI, AVX2 and FMA.
    #[target_feature(enable = "avxvnni,avx2,fma")]
    pub unsafe fn tile_vnni(
        w: &QMatrix,
        a: &Acts,
        m: usize,
        n0: usize,
        p: &mut Panel,
        out: &SyncPtr,
    ) {
        tile::<true>(w, a, m, n0, p, out)
    }

    /// `simd::tile` with AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_avx2(
        w: &QMatrix,
        a: &Acts,
        m: usize,
        n0: usize,
        p: &mut Panel,
        out: &SyncPtr,
    ) {
        tile::<false>(w, a, m, n0, p, out)
    }

    /// Rows `n0..n0 + R` against every token: the panel once, then each 16-token vector.
    #[inline(always)]
    unsafe fn tile<const VNNI: bool>(
        w: &QMatrix,
        a: &Acts,
        m: usize,
        n0: usize,
        p: &mut Panel,
        out: &SyncPtr,
    ) {
        fill(p, w, n0);
        // the next tile's codes on their way to L2 while this one computes (as `simd::tile`)
        let (packed, rb): (&[u8], usize) = (&w.packed, w.row_bytes());
        for n in (n0 + R).min(w.rows)..(n0 + 2 * R).min(w.rows) {
            for off in (0..rb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(packed.as_ptr().add(n * rb + off) as *const i8);
            }
        }
        let nr = w.rows.saturating_sub(n0).min(R);
        for j in 0..m.div_ceil(TV) {
            for r0 in (0..nr).step_by(RS) {
                let f = rows::<VNNI>(a, p, j, r0);
                store(&f, w.rows, m, n0 + r0, nr - r0, j, out);
            }
        }
    }

    /// Panel rows `r0..r0 + RS` against token vector `j`, every block: `[row][half]` f32 sums
    /// of 8 tokens.
    #[inline(always)]
    unsafe fn rows<const VNNI: bool>(
        a: &Acts,
        p: &Panel,
        j: usize,
        r0: usize,
    ) -> [[__m256; 2]; RS] {
        let kbs = a.kbs;
        let mut f = [[_mm256_setzero_ps(); 2]; RS];
        for kb in 0..kbs {
            let mut c = [[_mm256_setzero_si256(); 2]; RS];
            let wq = p.q.as_ptr().add((kb * R + r0) * PAIRS);
            let xq = a.q.as_ptr().add((j * kbs + kb) * PAIRS * TV);
            for pp in 0..PAIRS {
                let xv: [__m256i; 2] = std::array::from_fn(|h| {
                    _mm256_loadu_si256(xq.add(pp * TV + 8 * h) as *const __m256i)
                });
                // `r` indexes the register tile and the weights alike
                #[allow(clippy::needless_range_loop)]
                for r in 0..RS {
                    let wv = _mm256_set1_epi32(*wq.add(r * PAIRS + pp));
                    for h in 0..2 {
                        c[r][h] = if VNNI {
                            _mm256_dpwssd_avx_epi32(c[r][h], xv[h], wv)
                        } else {
                            _mm256_add_epi32(c[r][h], _mm256_madd_epi16(xv[h], wv))
                        };
                    }
                }
            }
            let at = (j * kbs + kb) * TV;
            let d: [__m256; 2] =
                std::array::from_fn(|h| _mm256_loadu_ps(a.d.as_ptr().add(at + 8 * h)));
            let sx: [__m256; 2] =
                std::array::from_fn(|h| _mm256_loadu_ps(a.sx.as_ptr().add(at + 8 * h)));
            for r in 0..RS {
                let s = _mm256_set1_ps(*p.s.get_unchecked(kb * R + r0 + r));
                let b = _mm256_set1_ps(*p.b.get_unchecked(kb * R + r0 + r));
                for h in 0..2 {
                    let v = _mm256_mul_ps(_mm256_cvtepi32_ps(c[r][h]), d[h]);
                    f[r][h] = _mm256_fmadd_ps(b, sx[h], _mm256_fmadd_ps(v, s, f[r][h]));
                }
            }
        }
        f
    }

    /// `unpack_ptr` with its bounds checked, for the tests.
    #[cfg(test)]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn unpack(src: &[u8], dst: &mut [i32]) {
        assert!(src.len() >= 32 && dst.len() >= 32);
        unpack_ptr(src.as_ptr(), dst.as_mut_ptr())
    }

    /// 32 packed bytes at `src` as 32 code pairs at `dst` (`super::unpack_portable`), 8 at a
    /// time.
    ///
    /// # Safety
    /// The CPU has AVX2; both ranges are inside their buffers.
    #[inline(always)]
    unsafe fn unpack_ptr(src: *const u8, dst: *mut i32) {
        let mask = _mm256_set1_epi32(0x000f_000f);
        for h in 0..4 {
            let d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(src.add(8 * h) as *const _));
            let v = _mm256_and_si256(_mm256_or_si256(d, _mm256_slli_epi32::<12>(d)), mask);
            _mm256_storeu_si256(dst.add(8 * h) as *mut _, v);
        }
    }

    /// Rows `n0..n0 + R` of `w` into the panel (zeros past the last row).
    #[inline(always)]
    unsafe fn fill(p: &mut Panel, w: &QMatrix, n0: usize) {
        fill_rows(p, w, n0, 0, |src, dst| unpack_ptr(src, dst));
    }

    /// Writes rows `n0..n0 + min(RS, nr)` of token vector `j`'s sums into `y (m x rows)`, for
    /// the tokens that exist.
    #[inline(always)]
    unsafe fn store(
        f: &[[__m256; 2]; RS],
        rows: usize,
        m: usize,
        n0: usize,
        nr: usize,
        j: usize,
        out: &SyncPtr,
    ) {
        let tokens = m.saturating_sub(j * TV).min(TV);
        for (r, fr) in f.iter().enumerate().take(nr.min(RS)) {
            let mut v = [0f32; TV];
            _mm256_storeu_ps(v.as_mut_ptr(), fr[0]);
            _mm256_storeu_ps(v.as_mut_ptr().add(8), fr[1]);
            for (t, &y) in v.iter().enumerate().take(tokens) {
                // SAFETY (of the caller): token j·16 + t < m and row n0 + r < rows, inside y;
                // only this task writes the columns of its rows.
                *out.0.add((j * TV + t) * rows + n0 + r) = y;
            }
        }
    }
}

/// The AVX-512 block quantization and word transpose, for `amx.rs`'s layout pass too.
#[cfg(target_arch = "x86_64")]
pub(crate) use simd::{quantize16, quantize16_to, transpose16};

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{copy_of, fill_rows, Acts, Panel, SyncPtr, KB, PAIRS, QMAX, R, TV};
    use crate::engine::cpu::tile16::{transpose_block, Tiles, ROWS};
    use crate::engine::quant::QMatrix;

    /// Rows `n0..n0 + R` against every token: the panel once, then token vectors two at a time;
    /// `EIGHT`: 8-bit codes in quads (`int8.rs`), else 15-bit ones in pairs.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL and VNNI; `a` holds `EIGHT`'s codes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub unsafe fn tile<const EIGHT: bool>(
        w: &QMatrix,
        a: &Acts,
        m: usize,
        n0: usize,
        p: &mut Panel,
        out: &SyncPtr,
    ) {
        if EIGHT {
            super::int8::simd::fill(p, w, n0);
        } else {
            fill_with(p, w, n0, 16, |s, d| unpack16(s, d), |s, d| unpack_ptr(s, d));
        }
        prefetch_next(w, n0);
        let mt = m.div_ceil(TV);
        let mut j = 0;
        while j + 2 <= mt {
            let f = vectors::<2, EIGHT>(a, p, j);
            store(&f, w.rows, m, n0, j, out);
            j += 2;
        }
        if j < mt {
            let f = vectors::<1, EIGHT>(a, p, j);
            store(&f, w.rows, m, n0, j, out);
        }
    }

    /// The next panel's codes (rows `n0 + R..n0 + 2R`, from the copy where it has them) on
    /// their way to L2 while this one computes: a tile's rows are read once a call, mostly
    /// from memory, and the unpacking would wait for them.
    ///
    /// # Safety
    /// The CPU has SSE (every x86-64 CPU).
    #[inline(always)]
    unsafe fn prefetch_next(w: &QMatrix, n0: usize) {
        if let Some(t) = copy_of(w) {
            // the copy's tiles (16 rows) the next panel reaches and this one did not
            let (last, end) = ((n0 + R).min(w.rows), (n0 + 2 * R).min(w.rows));
            for tile in last.div_ceil(ROWS)..end.div_ceil(ROWS).min(t.tiles) {
                let bytes = t.tile(tile);
                for off in (0..bytes.len()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T1>(bytes.as_ptr().add(off) as *const i8);
                }
            }
        } else {
            let (packed, rb): (&[u8], usize) = (&w.packed, w.row_bytes());
            for n in (n0 + R).min(w.rows)..(n0 + 2 * R).min(w.rows) {
                for off in (0..rb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T1>(packed.as_ptr().add(n * rb + off) as *const i8);
                }
            }
        }
    }

    /// Panel rows `r0..r1` (matrix rows `n0 + r0..`, all in whole tile `tile` of `t`) from
    /// the decode copy: each block transposed once (`tile16::transpose_block`), then each
    /// row's two 16-byte pieces unpacked by `unpack` into `half` dwords each (16 code pairs,
    /// or 8 code quads for `int8.rs`), as MLX's 32 bytes are; the group's scales and biases
    /// from after its codes.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VL; `unpack(src, dst)` reads 16 bytes at `src`, writes
    /// `half` <= 16 dwords at `dst` and nothing else.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn fill_from_copy(
        p: &mut Panel,
        t: &Tiles,
        tile: usize,
        n0: usize,
        r0: usize,
        r1: usize,
        half: usize,
        unpack: impl Fn(*const u8, *mut i32),
    ) {
        assert!(half <= 16);
        debug_assert!(
            tile < t.tiles && r0 < r1 && (n0 + r0) / ROWS == tile && (n0 + r1 - 1) / ROWS == tile
        );
        let (bytes, gb) = (t.tile(tile), t.group_bytes());
        let per_group = (32 << t.gshift) / KB;
        let codes = per_group * KB / 8 * 64;
        let kbs = bytes.len() / gb * per_group;
        // bounds checked once here, not per row and block (as `fill_rows`)
        assert!(r1 <= R && codes + 4 * ROWS <= gb);
        assert!(p.q.len() >= kbs * R * PAIRS && p.s.len() >= kbs * R && p.b.len() >= kbs * R);
        let (pq, ps, pb) = (p.q.as_mut_ptr(), p.s.as_mut_ptr(), p.b.as_mut_ptr());
        let mut q = [[0u8; 64]; 8];
        let qp = q.as_ptr() as *const u8;
        let mut kb = 0;
        for piece in bytes.chunks_exact(gb) {
            let sb = piece[codes..].as_ptr() as *const u16;
            for h in 0..per_group {
                let v = transpose_block(&piece[h * KB / 8 * 64..]);
                for (dst, v) in q.iter_mut().zip(v) {
                    _mm512_storeu_si512(dst.as_mut_ptr() as *mut _, v);
                }
                for r in r0..r1 {
                    let lane = (n0 + r) % ROWS;
                    let (l, k) = (lane / 4, lane % 4);
                    let at = kb * R + r;
                    // words 0-3 (the row's bytes 0-15), then words 4-7
                    unpack(qp.add(64 * k + 16 * l), pq.add(at * PAIRS));
                    unpack(qp.add(64 * (k + 4) + 16 * l), pq.add(at * PAIRS + half));
                    let bf = |i: usize| f32::from_bits((sb.add(i).read_unaligned() as u32) << 16);
                    (*ps.add(at), *pb.add(at)) = (bf(lane), bf(ROWS + lane));
                }
                kb += 1;
            }
        }
    }

    /// 32 packed bytes as 32 code pairs: a byte `b` to the dword `(b & 15) | (b >> 4) << 16`
    /// (`unpack_ptr` with its bounds checked, for the tests).
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn unpack(src: &[u8], dst: &mut [i32]) {
        assert!(src.len() >= 32 && dst.len() >= 32);
        unpack_ptr(src.as_ptr(), dst.as_mut_ptr())
    }

    /// `unpack` from `src` (32 bytes) to `dst` (32 dwords), unchecked.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL; both ranges are inside their buffers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn unpack_ptr(src: *const u8, dst: *mut i32) {
        unpack16(src, dst);
        unpack16(src.add(16), dst.add(16));
    }

    /// 16 bytes at `src` as 16 code pairs at `dst`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn unpack16(src: *const u8, dst: *mut i32) {
        let d = _mm512_cvtepu8_epi32(_mm_loadu_si128(src as *const _));
        // (d | d << 12) & 0x000f000f: the low nibble stays, the high one moves to bit 16
        let mask = _mm512_set1_epi32(0x000f_000f);
        let v = _mm512_ternarylogic_epi32::<0xA8>(d, _mm512_slli_epi32::<12>(d), mask);
        _mm512_storeu_si512(dst as *mut _, v);
    }

    /// The panel's rows against token vectors `j..j + T`, every block: `[row][vector]` f32
    /// sums of 16 tokens; `EIGHT` as `tile`'s.
    #[inline(always)]
    unsafe fn vectors<const T: usize, const EIGHT: bool>(
        a: &Acts,
        p: &Panel,
        j: usize,
    ) -> [[__m512; T]; R] {
        let kbs = a.kbs;
        // dwords of a block: pairs of 15-bit codes, or quads of 8-bit ones
        let steps = if EIGHT { super::int8::QUADS } else { PAIRS };
        let mut f = [[_mm512_setzero_ps(); T]; R];
        for kb in 0..kbs {
            let mut c = [[_mm512_setzero_si512(); T]; R];
            let wq = p.q.as_ptr().add(kb * R * PAIRS);
            let xq: [*const i32; T] =
                std::array::from_fn(|t| a.q.as_ptr().add(((j + t) * kbs + kb) * steps * TV));
            for pp in 0..steps {
                let xv: [__m512i; T] =
                    std::array::from_fn(|t| _mm512_loadu_si512(xq[t].add(pp * TV) as *const _));
                // `r` indexes the register tile and the weights alike
                #[allow(clippy::needless_range_loop)]
                for r in 0..R {
                    let wv = _mm512_set1_epi32(*wq.add(r * PAIRS + pp));
                    for t in 0..T {
                        // 8-bit: the codes are the unsigned operand, the activations signed
                        c[r][t] = match EIGHT {
                            true => _mm512_dpbusd_epi32(c[r][t], wv, xv[t]),
                            false => _mm512_dpwssd_epi32(c[r][t], xv[t], wv),
                        };
                    }
                }
            }
            let at: [usize; T] = std::array::from_fn(|t| ((j + t) * kbs + kb) * TV);
            let d: [__m512; T] = std::array::from_fn(|t| _mm512_loadu_ps(a.d.as_ptr().add(at[t])));
            let sx: [__m512; T] =
                std::array::from_fn(|t| _mm512_loadu_ps(a.sx.as_ptr().add(at[t])));
            for r in 0..R {
                let s = _mm512_set1_ps(*p.s.get_unchecked(kb * R + r));
                let b = _mm512_set1_ps(*p.b.get_unchecked(kb * R + r));
                for t in 0..T {
                    let v = _mm512_mul_ps(_mm512_cvtepi32_ps(c[r][t]), d[t]);
                    f[r][t] = _mm512_fmadd_ps(b, sx[t], _mm512_fmadd_ps(v, s, f[r][t]));
                }
            }
        }
        f
    }

    /// `super::quantize` of the 64 values at `p` in 16 lanes: the lane-wise max and sum in
    /// its order, the lanes' sum folded by the same scalar code, rounded with `cvtps2dq` (ties
    /// to even, as its trick does): the codes as i32 in four vectors, `d` and `Σx`, the same
    /// bits (tested through `prepare_vector`).
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `p` points at 64 readable values.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(crate) unsafe fn quantize16(p: *const f32) -> ([__m512i; 4], f32, f32) {
        quantize16_to(p, QMAX)
    }

    /// `quantize16` with the largest code `qmax` (`super::quantize_to`'s bits).
    ///
    /// # Safety
    /// As `quantize16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(crate) unsafe fn quantize16_to(p: *const f32, qmax: f32) -> ([__m512i; 4], f32, f32) {
        // no closures or array maps here: they would not inherit the target features, and
        // their intrinsics would be calls
        let lim = _mm512_set1_epi32(qmax as i32);
        let neg = _mm512_sub_epi32(_mm512_setzero_si512(), lim);
        let mut v = [_mm512_setzero_ps(); 4];
        let (mut mx, mut sm) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for (c, v) in v.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(p.add(16 * c));
            mx = _mm512_max_ps(mx, _mm512_abs_ps(*v));
            sm = _mm512_add_ps(sm, *v);
        }
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), sm);
        let sum: f32 = lanes.iter().sum();
        let amax = _mm512_reduce_max_ps(mx);
        let dt = amax / qmax;
        let inv = _mm512_set1_ps(if dt >= f32::MIN_POSITIVE {
            1.0 / dt
        } else {
            0.0
        });
        let mut codes = [_mm512_setzero_si512(); 4];
        for (q, v) in codes.iter_mut().zip(v) {
            let qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
            *q = _mm512_max_epi32(_mm512_min_epi32(qi, lim), neg);
        }
        (codes, dt, sum)
    }

    /// `super::prepare_vector` in 16 lanes: a token's block as four vectors (the lane-wise max
    /// and sum in `quantize`'s order, the lanes' sum folded by the same scalar code), rounded
    /// with `cvtps2dq` (ties to even, as `quantize`'s trick), narrowed to 16 bits; then the 16
    /// tokens' pairs transposed so that each pair is one vector of tokens.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn prepare_vector(
        x: &[f32],
        m: usize,
        k: usize,
        j: usize,
        kbr: std::ops::Range<usize>,
        q: &mut [i32],
        d: &mut [f32],
        sx: &mut [f32],
    ) {
        let tokens = TV.min(m - j * TV);
        let n = kbr.len();
        assert!(kbr.end <= k / KB && x.len() >= (j * TV + tokens) * k);
        assert!(q.len() >= n * PAIRS * TV && d.len() >= n * TV && sx.len() >= n * TV);
        for (u, kb) in kbr.enumerate() {
            // pairs 0..16 and 16..32 of each token, as rows to transpose
            let mut lo = [_mm512_setzero_ps(); 16];
            let mut hi = [_mm512_setzero_ps(); 16];
            for t in 0..tokens {
                let p = x.as_ptr().add((j * TV + t) * k + kb * KB);
                let (codes, dt, sum) = quantize16(p);
                let mut w = [_mm256_setzero_si256(); 4];
                for (w, q) in w.iter_mut().zip(codes) {
                    *w = _mm512_cvtepi32_epi16(q);
                }
                let join = |a: __m256i, b: __m256i| {
                    _mm512_castsi512_ps(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b))
                };
                lo[t] = join(w[0], w[1]);
                hi[t] = join(w[2], w[3]);
                (d[u * TV + t], sx[u * TV + t]) = (dt, sum);
            }
            let dst = q.as_mut_ptr().add(u * PAIRS * TV);
            for (h, rows) in [lo, hi].into_iter().enumerate() {
                for (p, v) in transpose16(rows).iter().enumerate() {
                    _mm512_storeu_ps(dst.add((16 * h + p) * TV) as *mut f32, *v);
                }
            }
        }
    }

    /// Rows `n0..n0 + R` of `w` into the panel (zeros past the last row): from the copy's
    /// whole tiles 16 bytes at a time by `unpack16` (into `half` dwords), from the matrix's
    /// rows 32 at a time by `unpack32` (`fill_rows`).
    #[inline(always)]
    pub(super) unsafe fn fill_with(
        p: &mut Panel,
        w: &QMatrix,
        n0: usize,
        half: usize,
        unpack16: impl Fn(*const u8, *mut i32),
        unpack32: impl Fn(*const u8, *mut i32),
    ) {
        let nr = R.min(w.rows.saturating_sub(n0));
        // the rows in the copy's whole tiles from it, a tile's at a time
        let mut from = 0;
        if let Some(t) = copy_of(w) {
            while from < nr && (n0 + from) / ROWS < t.tiles {
                let tile = (n0 + from) / ROWS;
                let to = ((tile + 1) * ROWS - n0).min(nr);
                fill_from_copy(p, t, tile, n0, from, to, half, &unpack16);
                from = to;
            }
        }
        fill_rows(p, w, n0, from, unpack32);
    }

    /// Writes the sums of token vectors `j..j + T` into `y (m x rows)`, rows and tokens that
    /// exist only: each vector's 12 rows x 16 tokens transposed, so a token's rows are one
    /// masked store.
    #[inline(always)]
    unsafe fn store<const T: usize>(
        f: &[[__m512; T]; R],
        rows: usize,
        m: usize,
        n0: usize,
        j: usize,
        out: &SyncPtr,
    ) {
        let nr = rows.saturating_sub(n0).min(R);
        let mask = ((1u32 << nr) - 1) as __mmask16;
        for t in 0..T {
            let mut v = [_mm512_setzero_ps(); 16];
            for (v, f) in v.iter_mut().zip(f) {
                *v = f[t];
            }
            let cols = transpose16(v);
            for (i, c) in cols
                .iter()
                .enumerate()
                .take(m.saturating_sub((j + t) * TV).min(TV))
            {
                // SAFETY (of the caller): token (j + t)·16 + i < m and rows n0..n0 + nr <
                // rows, inside y; only this task writes the columns of its rows.
                _mm512_mask_storeu_ps(out.0.add(((j + t) * TV + i) * rows + n0), mask, *c);
            }
        }
    }

    /// A 16x16 f32 transpose: `out[c]` lane `r` is `v[r]` lane `c`.
    #[inline(always)]
    pub(crate) unsafe fn transpose16(v: [__m512; 16]) -> [__m512; 16] {
        // pairs of rows interleaved: t[2i] lane L holds r2i[4L], r2i+1[4L], r2i[4L+1], r2i+1[4L+1]
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
        }
        // u[4i + c] lane L holds rows 4i..4i + 4 of column 4L + c
        let mut u = [_mm512_setzero_ps(); 16];
        for i in 0..4 {
            let pd = |x: __m512| _mm512_castps_pd(x);
            u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
            u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
            u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
            u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
        }
        // across 128-bit lanes: column 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
        let mut out = [_mm512_setzero_ps(); 16];
        for c in 0..4 {
            let a = _mm512_shuffle_f32x4::<0x44>(u[c], u[4 + c]);
            let b = _mm512_shuffle_f32x4::<0xEE>(u[c], u[4 + c]);
            let cc = _mm512_shuffle_f32x4::<0x44>(u[8 + c], u[12 + c]);
            let d = _mm512_shuffle_f32x4::<0xEE>(u[8 + c], u[12 + c]);
            out[c] = _mm512_shuffle_f32x4::<0x88>(a, cc);
            out[4 + c] = _mm512_shuffle_f32x4::<0xDD>(a, cc);
            out[8 + c] = _mm512_shuffle_f32x4::<0x88>(b, d);
            out[12 + c] = _mm512_shuffle_f32x4::<0xDD>(b, d);
        }
        out
    }
}

/// 21 tokens of 320 values for the layout passes' tests (here and `amx.rs`): random values
/// with a zero block, an outlier, a tiny value and a negative zero, a block whose scale is
/// subnormal (1/d would overflow: codes 0 on every path), and ties in x / d (the block's max
/// 2, so 1 is 16383 / 2 = 8191.5 steps; and -1).
#[cfg(test)]
pub(crate) fn layout_test_input(seed: u64) -> (usize, usize, Vec<f32>) {
    use rand::{Rng, SeedableRng};
    let (m, k) = (21, 320);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    x[64..128].fill(0.0);
    x[130] = 1.0e30;
    x[200] = -1.0e-30;
    x[k + 5] = -0.0;
    x[k + 64..k + 128].iter_mut().for_each(|v| *v *= 1.0e-36);
    x[2 * k..2 * k + KB].iter_mut().for_each(|v| *v /= 3.0);
    (x[2 * k], x[2 * k + 1], x[2 * k + 2]) = (2.0, 1.0, -1.0);
    (m, k, x)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "x86_64")]
    use rand::{Rng, SeedableRng};

    #[test]
    fn unpack_pairs_nibbles() {
        let src: Vec<u8> = (0..32).map(|i| (i * 37 + 5) as u8).collect();
        let mut dst = [0i32; 32];
        unpack_portable(&src, &mut dst);
        for (i, &v) in dst.iter().enumerate() {
            assert_eq!(v & 0xffff, (src[i] & 15) as i32);
            assert_eq!(v >> 16, (src[i] >> 4) as i32);
        }
        #[cfg(target_arch = "x86_64")]
        if crate::engine::cpu::isa::tested_here(Isa::Avx512Vnni, "unpack_pairs_nibbles") {
            let mut v = [0i32; 32];
            // SAFETY: the CPU has AVX-512.
            unsafe { simd::unpack(&src, &mut v) };
            assert_eq!(v, dst);
        }
        #[cfg(target_arch = "x86_64")]
        if crate::engine::cpu::isa::tested_here(Isa::Avx2, "unpack_pairs_nibbles") {
            let mut v = [0i32; 32];
            // SAFETY: the CPU has AVX2; 32 bytes read, 32 dwords written.
            unsafe { simd256::unpack(&src, &mut v) };
            assert_eq!(v, dst);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn transpose16_transposes() {
        if !crate::engine::cpu::isa::tested_here(Isa::Avx512Vnni, "transpose16_transposes") {
            return;
        }
        use std::arch::x86_64::*;
        let m: Vec<f32> = (0..256).map(|i| i as f32).collect();
        let mut got = [0f32; 256];
        // SAFETY: the CPU has AVX-512; 16 rows of 16 read and written.
        unsafe {
            let v = std::array::from_fn(|r| _mm512_loadu_ps(m.as_ptr().add(16 * r)));
            for (c, o) in simd::transpose16(v).iter().enumerate() {
                _mm512_storeu_ps(got.as_mut_ptr().add(16 * c), *o);
            }
        }
        for r in 0..16 {
            for c in 0..16 {
                assert_eq!(got[16 * c + r], m[16 * r + c], "row {r} column {c}");
            }
        }
    }

    /// The AVX-512 layout pass gives the portable definition's codes, scales and sums bit for
    /// bit: a token tail, a zero block, ties, an outlier, tiny and huge magnitudes.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn prepare_avx512_matches_portable() {
        if !crate::engine::cpu::isa::tested_here(Isa::Avx512Vnni, "prepare_avx512_matches_portable")
        {
            return;
        }
        let (m, k, x) = layout_test_input(5);
        let kbs = k / KB;
        // every block of a vector, and a run of them from the second on (a task's share)
        for (j, kbr) in (0..m.div_ceil(TV)).flat_map(|j| [(j, 0..kbs), (j, 1..kbs - 1)]) {
            let n = kbr.len();
            let mut want = (
                vec![0; n * PAIRS * TV],
                vec![0.0; n * TV],
                vec![0.0; n * TV],
            );
            let mut got = want.clone();
            let (w, g) = (&mut want, &mut got);
            prepare_vector(&x, m, k, j, kbr.clone(), &mut w.0, &mut w.1, &mut w.2);
            // SAFETY: the CPU has AVX-512.
            unsafe { simd::prepare_vector(&x, m, k, j, kbr.clone(), &mut g.0, &mut g.1, &mut g.2) };
            assert_eq!(got.0, want.0, "token vector {j}, blocks {kbr:?}: codes");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got.1),
                bits(&want.1),
                "vector {j}, blocks {kbr:?}: scales"
            );
            assert_eq!(
                bits(&got.2),
                bits(&want.2),
                "vector {j}, blocks {kbr:?}: sums"
            );
        }
    }

    /// The layout pass is the same whatever its tasks: a pool of 1, 3 and 16 threads (tasks
    /// of every block of a vector down to one block), and a team of 3 and 16 (`cpu::team`,
    /// as a host prompt pass runs it), on each instruction set the CPU has; each task's share
    /// divides a vector's blocks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn prepare_is_the_same_on_any_pool() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        for (m, k) in [(64, 1024), (21, 320), (2, 3072), (40, 64 * 7)] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            for isa in [Isa::Avx512Vnni, Isa::Avx2] {
                if !crate::engine::cpu::isa::tested_here(isa, "prepare_is_the_same_on_any_pool") {
                    continue;
                }
                // on the pool's workers, or on a team they form (a host prompt pass's way)
                let on = |threads: usize, team: bool| {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                    let pool = pool.expect("a test pool");
                    let g = pool.install(|| prepare_blocks(k / KB, m.div_ceil(TV), TV.min(m)));
                    assert_eq!((k / KB) % g, 0, "{threads} threads: {g} blocks a task");
                    let a = match team {
                        true => pool.install(|| {
                            team::Team::lead(|| prepare(&x, m, k, isa, Codes::Pairs15))
                        }),
                        false => pool.install(|| prepare(&x, m, k, isa, Codes::Pairs15)),
                    };
                    (
                        a.q,
                        a.d.iter()
                            .chain(&a.sx)
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>(),
                    )
                };
                let one = on(1, false);
                for (threads, team) in [(3, false), (16, false), (3, true), (16, true)] {
                    assert!(
                        on(threads, team) == one,
                        "{isa:?}, m {m}, k {k}: {threads} threads, team {team}"
                    );
                }
            }
        }
    }

    /// Each kernel the CPU has (AVX-512 VNNI; in 256-bit registers AVX-VNNI, and AVX2 on
    /// every x86-64 CPU these tests run on), whatever the process's instruction set: the bits
    /// of `amx.rs`'s emulated tiles (the same arithmetic) and within what rounding x to 15 bits
    /// can move each output, on row and token tails (the 256-bit row tiles of 6 inside panels
    /// of 12), groups of 64 and 128; `qmatmul` takes the active set's for `fast` prompts.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn gemm_matches_reference_and_amx() {
        let (here, missing): (Vec<Isa>, Vec<Isa>) = [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2]
            .into_iter()
            .partition(|&i| {
                crate::engine::cpu::isa::tested_here(i, "gemm_matches_reference_and_amx")
            });
        eprintln!("prompt GEMM tested: {here:?}; not on this CPU: {missing:?}");
        let shapes = crate::engine::cpu::amx::TEST_SHAPES.into_iter();
        for (seed, (gs, m, k, rows)) in shapes
            .chain([(64, 48, 128, 13), (128, 9, 256, 6)])
            .enumerate()
        {
            let (w, x) = crate::engine::cpu::amx::test_case(seed, gs, m, k, rows);
            let tiles = crate::engine::cpu::amx::soft_gemm(&w, &x, m);
            for &isa in &here {
                let mut got = vec![f32::NAN; m * rows];
                // SAFETY: the kernel stores only computed f32 sums.
                run_on(
                    isa,
                    Codes::Pairs15,
                    &[&w],
                    &x,
                    m,
                    &mut [unsafe { as_uninit(&mut got[..]) }],
                );
                crate::engine::cpu::amx::assert_within_rounding(&w, &x, m, &got);
                for (i, (a, b)) in got.iter().zip(&tiles).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{isa:?} gs {gs} m {m} k {k}: element {i}"
                    );
                }
                if isa::active() == isa {
                    let mut via = vec![f32::NAN; m * rows];
                    crate::engine::cpu::quant::qmatmul(
                        &w,
                        &x,
                        m,
                        &mut via,
                        crate::engine::quant::Numerics::Fast,
                    );
                    assert_eq!(via, got, "qmatmul's fast prompt path is this GEMM");
                }
            }
        }
    }

    /// With a `tile16` copy the AVX-512 panels read their rows' whole tiles from it and give
    /// the rows' bits: the same outputs with the copy (every kernel the CPU has; the 256-bit
    /// ones read the rows), and on AVX-512 with the matrix's own codes, scales and biases
    /// zeroed the same outputs for every row of a whole tile (the tail rows, which read the
    /// matrix, give zeros): panels of 12 rows across tiles of 16, groups of 64 and 128.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn gemm_reads_the_copy() {
        use crate::engine::quant::testutil::random_qmatrix;
        use crate::engine::weights::Dtype;
        let here: Vec<Isa> = [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2]
            .into_iter()
            .filter(|&i| crate::engine::cpu::isa::tested_here(i, "gemm_reads_the_copy"))
            .collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let gemm = |isa: Isa, w: &QMatrix, x: &[f32], m: usize| {
            let mut y = vec![f32::NAN; m * w.rows];
            // SAFETY: the kernel stores only computed f32 sums.
            run_on(
                isa,
                Codes::Pairs15,
                &[w],
                x,
                m,
                &mut [unsafe { as_uninit(&mut y[..]) }],
            );
            y
        };
        let shapes = [
            (64, 17, 1024, 50),
            (128, 33, 640, 96),
            (64, 9, 128, 200),
            (128, 16, 256, 40),
        ];
        for (seed, (gs, m, k, rows)) in shapes.into_iter().enumerate() {
            let w = random_qmatrix(rows, k, 4, gs, Dtype::BF16, seed as u64 + 41);
            let (_, x) = crate::engine::cpu::amx::test_case(seed, gs, m, k, rows);
            let want: Vec<Vec<f32>> = here.iter().map(|&isa| gemm(isa, &w, &x, m)).collect();
            assert!(tile16::attach(&w).is_some());
            for (&isa, want) in here.iter().zip(&want) {
                let got = gemm(isa, &w, &x, m);
                assert_eq!(
                    bits(&got),
                    bits(want),
                    "{isa:?} gs {gs} rows {rows}: with the copy"
                );
            }
            if !here.contains(&Isa::Avx512Vnni) {
                continue;
            }
            let blank = crate::engine::quant::testutil::blanked(&w);
            let got = gemm(Isa::Avx512Vnni, &blank, &x, m);
            let what = format!("gs {gs}");
            crate::engine::cpu::amx::assert_read_from_copy(&got, &want[0], m, rows, &what);
        }
    }

    /// Short `fast` and `int8` calls (2-7 tokens: a prompt's last chunk) of matrices with a
    /// copy take the prompt GEMM, which reads the copy: with the matrices' own bytes zeroed,
    /// `qmatmul` and `qmatmul_shared` still give the rows in whole tiles (where the process's
    /// set is AMX or AVX-512 VNNI, the CPUs that make copies).
    #[test]
    fn short_calls_read_the_copy() {
        use crate::engine::cpu::quant::{qmatmul, qmatmul_shared};
        use crate::engine::quant::testutil::random_qmatrix;
        use crate::engine::quant::Numerics;
        use crate::engine::weights::Dtype;
        if !isa::active().avx512() {
            eprintln!("short_calls_read_the_copy: not run, the process's set is not AVX-512");
            return;
        }
        let (rows, k) = (40, 256);
        let w = random_qmatrix(rows, k, 4, 64, Dtype::BF16, 9);
        assert!(tile16::attach(&w).is_some());
        let blank = crate::engine::quant::testutil::blanked(&w);
        let whole = rows / tile16::ROWS * tile16::ROWS;
        // `int8`'s prompts too (its own GEMM on AVX-512 VNNI, `fast`'s on AMX)
        for (m, kernel) in (2..8).flat_map(|m| [(m, Numerics::Fast), (m, Numerics::Int8)]) {
            let (_, x) = crate::engine::cpu::amx::test_case(m, 64, m, k, rows);
            let mut want = vec![0f32; m * rows];
            qmatmul(&w, &x, m, &mut want, kernel);
            let mut got = vec![0f32; m * rows];
            qmatmul(&blank, &x, m, &mut got, kernel);
            let shared = qmatmul_shared(&[&blank, &blank], &x, m, kernel)
                .expect("a shared GEMM for matrices with copies");
            for t in 0..m {
                let r = &want[t * rows..][..whole];
                assert_eq!(&got[t * rows..][..whole], r, "m {m} token {t} {kernel:?}");
                for y in &shared {
                    assert_eq!(
                        &y[t * rows..][..whole],
                        r,
                        "m {m} token {t}: shared {kernel:?}"
                    );
                }
            }
        }
    }
}
