//! The prompt GEMM of 4-bit weights on Intel AMX int8 tiles (Sapphire Rapids and later
//! Xeons), for the `fast` arithmetic: `y (m x rows) = x (m x cols) @ dequant(w)^T` with the
//! activations as 15-bit integers, as the `fast` decode kernel has them (`quant.rs`), here with
//! one scale per 64 values. The f32 GEMM (`gemm.rs`) stays for `exact` and other CPUs. The slow
//! reference is `QMatrix::matmul_reference`; the tile logic also runs through `Soft`, plain
//! Rust standing in for the tile instructions (tested on every CPU), and the hardware tiles
//! are checked against `Soft` bit for bit where the CPU has AMX.
//!
//! Why: llama.cpp prefills with AMX on these CPUs. An AVX-512 f32 tile does 32 products a
//! cycle; one `tdpbusd` does 16x16x64 in ~16. Intel's SDM (vol. 1 ch. 3, AMX) and the Linux
//! `arch_prctl(ARCH_REQ_XCOMP_PERM)` ABI say how tiles are configured and granted.
//!
//! Arithmetic, per 64-value block `kb` of a token: `d = max|x| / 16383`, `xq =
//! round_ties_even(x · (1/d))`, split `xq = 128·hi + lo` (`hi` signed, `lo` in 0..127, one byte
//! each). The 4-bit codes are the unsigned operand. For 16 weight rows and 16 tokens, two
//! `tdpbusd` give the hi and lo sums; then, exactly in i32 (|sum| < 2^24, so the conversion is
//! exact too), `c = 128·hi_sum + lo_sum`, and `y += c·d·s + b·Σx` in f32 (two FMAs), block
//! after block (`s`, `b`: the group's scale and bias; `Σx` the block's f32 sum). Rounding x to
//! 15 bits is the approximation beyond f32 rounding: at most `d/2` a value (plus an ulp or two
//! from `1/d`).
//!
//! Layout: within a block, tile byte `p` holds value `2p` for `p < 32` and `2(p - 32) + 1`
//! above, so a weight row unpacks as its 32 low nibbles then its 32 high nibbles, no shuffle;
//! the activations are laid out once a call in the same order, four values of a token a
//! 32-bit column (the B operand's form). A task unpacks its rows' block once, then for each
//! token tile runs its A tiles through two tile slots, so that the tiles compute one A tile
//! while the core combines the previous one.
//!
//! Where the matrix has its decode copy (`tile16.rs`, 16 rows interleaved a word at a time:
//! Intel's CPUs), a task's whole tiles are unpacked from it instead, transposed in registers
//! to the same A tiles (so the same bits): one contiguous stream a tile instead of 16 rows'
//! streams plus their scales' and biases', and prompts no longer read the model's file, so a
//! run holds the weights once (on the Xeon, twenty-second session: 8B prompts 23-27 → 35-38
//! tok/s, peak memory 8.0-8.7 → 4.3 GB).

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::OnceLock;

use crate::engine::cpu::isa::{self, Isa};
use crate::engine::cpu::quant::bf16_at;
use crate::engine::cpu::team;
use crate::engine::cpu::tile16;
use crate::engine::quant::QMatrix;

// KB: values a block holds: one activation scale, one tile row of bytes
use crate::engine::cpu::vnni::{self, SyncPtr, KB};
/// Tokens a B tile holds.
const TT: usize = 16;
/// Bytes of one tile (16 rows of 64).
const TILE: usize = 1024;

/// Whether the prompt GEMM of `w` runs here: the process's instruction set is `amx` and `w`
/// has 4-bit codes in groups of 64 or a multiple.
pub fn usable(w: &QMatrix) -> bool {
    isa::active() == Isa::Amx && shape_ok(w)
}

fn shape_ok(w: &QMatrix) -> bool {
    vnni::shape_ok(w)
}

/// `y = x @ dequant(w)^T` on AMX tiles. Callers check `usable(w)` first.
pub fn qgemm(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32]) {
    assert!(usable(w), "amx::qgemm without AMX");
    #[cfg(target_arch = "x86_64")]
    // SAFETY (as_uninit): the kernel stores only computed f32 sums.
    run(
        &[w],
        x,
        m,
        &mut [unsafe { vnni::as_uninit(y) }],
        |ctx, p0, p1| {
            // SAFETY: `usable` holds: the CPU has AMX-INT8 and AVX-512, and Linux granted the
            // tile state to this process.
            unsafe { hw::task(ctx, p0, p1) }
        },
    );
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, m, y);
}

/// `qgemm` of several matrices of the same input (q|k|v, gate|up): the activations laid out
/// once, every matrix's A tiles in one parallel region. Callers check `usable` on each;
/// every element of `outs` (`m x rows` each) is written (`shared_outputs` gives them).
pub fn qgemm_shared(ws: &[&QMatrix], x: &[f32], m: usize, outs: &mut [&mut [MaybeUninit<f32>]]) {
    assert!(
        ws.iter().all(|w| usable(w)),
        "amx::qgemm_shared without AMX"
    );
    // `usable` (asserted above) is never true off x86-64, and the caller must not see its
    // outputs unwritten
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "amx::qgemm_shared off x86-64 ({} values, {m} rows, {} outputs)",
        x.len(),
        outs.len()
    );
    #[cfg(target_arch = "x86_64")]
    run(ws, x, m, outs, |ctx, p0, p1| {
        // SAFETY: as in `qgemm`.
        unsafe { hw::task(ctx, p0, p1) }
    });
}

/// Whether this CPU has AMX-TILE and AMX-INT8, the OS enables their state, and Linux grants it
/// to this process (asked once).
pub fn granted() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            hw::cpu_has_amx() && hw::request_permission()
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// The activations of one call, laid out as B tiles: tile `(j, kb)` (tokens `16j..16j + 16`,
/// block `kb`) at `(j * kbs + kb) * TILE`, and its 16 tokens' `d` and `Σx` at `(j * kbs + kb)
/// * 16`. Tokens past `m` are zeros.
struct Acts {
    hi: Vec<u8>,
    lo: Vec<u8>,
    d: Vec<f32>,
    sx: Vec<f32>,
    kbs: usize,
}

/// Where value `p` of a block's tile row comes from.
#[inline]
fn source(p: usize) -> usize {
    if p < 32 {
        2 * p
    } else {
        2 * (p - 32) + 1
    }
}

fn prepare(x: &[f32], m: usize, k: usize) -> Acts {
    let (mt, kbs) = (m.div_ceil(TT), k / KB);
    let mut a = Acts {
        hi: vec![0; mt * kbs * TILE],
        lo: vec![0; mt * kbs * TILE],
        d: vec![0.0; mt * kbs * TT],
        sx: vec![0.0; mt * kbs * TT],
        kbs,
    };
    // tasks of `g` blocks of one token tile (`vnni::prepare_blocks`: a tile a task left all
    // but 4 of the Xeon's 16 threads idle in a 64-token prompt)
    let g = vnni::prepare_blocks(kbs, mt, TT.min(m));
    let mut parts: Vec<_> = (a.hi.chunks_mut(g * TILE))
        .zip(a.lo.chunks_mut(g * TILE))
        .zip(a.d.chunks_mut(g * TT).zip(a.sx.chunks_mut(g * TT)))
        .enumerate()
        .collect();
    // on the team a host pass leads (`cpu::team`), else rayon's pool
    team::for_each_mut(&mut parts, |(c, ((hi, lo), (d, sx)))| {
        let (j, kb0) = (*c / (kbs / g), *c % (kbs / g) * g);
        let (kbr, o) = (kb0..kb0 + g, TileActs { hi, lo, d, sx });
        #[cfg(target_arch = "x86_64")]
        if isa::active().avx512() {
            // SAFETY: the process's instruction set includes AVX-512 F/BW/VL.
            return unsafe { prepare_tile_avx512(x, m, k, j, kbr, o) };
        } else if isa::active().avx2() {
            // SAFETY: the process's instruction set includes AVX2 and FMA.
            return unsafe { prepare_tile_avx2(x, m, k, j, kbr, o) };
        }
        prepare_tile(x, m, k, j, kbr, o)
    });
    a
}

/// Quantizes one token's block (`vnni::quantize`) into its column of the hi and lo tiles;
/// returns `(d, Σx)`.
#[inline]
fn block(blk: &[f32], t: usize, th: &mut [u8], tl: &mut [u8]) -> (f32, f32) {
    let mut q = [0i32; KB];
    let ds = vnni::quantize(blk, &mut q);
    for r in 0..16 {
        for i in 0..4 {
            // row r of the tile, token t's 32-bit column, byte i
            let (v, at) = (q[source(4 * r + i)], r * 64 + t * 4 + i);
            th[at] = (v >> 7) as i8 as u8;
            tl[at] = (v & 127) as u8;
        }
    }
    ds
}

/// One token tile's share of `Acts`.
struct TileActs<'a> {
    hi: &'a mut [u8],
    lo: &'a mut [u8],
    d: &'a mut [f32],
    sx: &'a mut [f32],
}

/// `prepare`'s work for blocks `kbr` of token tile `j` (`o` from block `kbr.start` on).
#[inline(always)]
fn prepare_tile(x: &[f32], m: usize, k: usize, j: usize, kbr: Range<usize>, o: TileActs) {
    for t in 0..TT.min(m - j * TT) {
        let row = &x[(j * TT + t) * k..][..k];
        for (u, blk) in row[kbr.start * KB..kbr.end * KB]
            .chunks_exact(KB)
            .enumerate()
        {
            let (th, tl) = (&mut o.hi[u * TILE..][..TILE], &mut o.lo[u * TILE..][..TILE]);
            (o.d[u * TT + t], o.sx[u * TT + t]) = block(blk, t, th, tl);
        }
    }
}

/// `prepare_tile` compiled for AVX2 (every CPU with AMX has it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn prepare_tile_avx2(
    x: &[f32],
    m: usize,
    k: usize,
    j: usize,
    kbr: Range<usize>,
    o: TileActs,
) {
    prepare_tile(x, m, k, j, kbr, o)
}

/// `prepare_tile` in 16 lanes (every CPU with AMX has AVX-512): each token's block quantized
/// by `vnni::quantize16` (the same codes as `vnni::quantize`), its hi and lo bytes put in
/// tile order (`source`: the even values, then the odd ones) as one vector, and the 16 tokens'
/// vectors transposed a 32-bit word at a time into the tiles' rows: no byte stores. The same
/// bits as `prepare_tile` (tested); `block`'s byte scatter was 7-9% of a 16-thread prompt's
/// samples on the Xeon.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn prepare_tile_avx512(
    x: &[f32],
    m: usize,
    k: usize,
    j: usize,
    kbr: Range<usize>,
    o: TileActs,
) {
    use std::arch::x86_64::*;
    use vnni::{quantize16, transpose16};
    let tokens = TT.min(m - j * TT);
    let n = kbr.len();
    assert!(kbr.end <= k / KB && x.len() >= (j * TT + tokens) * k);
    assert!(o.hi.len() >= n * TILE && o.lo.len() >= n * TILE);
    assert!(o.d.len() >= n * TT && o.sx.len() >= n * TT);
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    let low7 = _mm512_set1_epi32(127);
    for (u, kb) in kbr.enumerate() {
        // token t's 64 bytes in tile order; its word r goes to row r of the tile
        let mut his = [_mm512_setzero_ps(); TT];
        let mut los = [_mm512_setzero_ps(); TT];
        for t in 0..tokens {
            let (c, dt, sum) = quantize16(x.as_ptr().add((j * TT + t) * k + kb * KB));
            let order = [
                _mm512_permutex2var_epi32(c[0], even, c[1]),
                _mm512_permutex2var_epi32(c[2], even, c[3]),
                _mm512_permutex2var_epi32(c[0], odd, c[1]),
                _mm512_permutex2var_epi32(c[2], odd, c[3]),
            ];
            let (mut h, mut l) = (order, order);
            for i in 0..4 {
                h[i] = _mm512_srai_epi32::<7>(order[i]);
                l[i] = _mm512_and_si512(order[i], low7);
            }
            his[t] = bytes64(h);
            los[t] = bytes64(l);
            (o.d[u * TT + t], o.sx[u * TT + t]) = (dt, sum);
        }
        for (dst, rows) in [(&mut *o.hi, his), (&mut *o.lo, los)] {
            let at = dst.as_mut_ptr().add(u * TILE).cast::<f32>();
            for (r, v) in transpose16(rows).iter().enumerate() {
                _mm512_storeu_ps(at.add(16 * r), *v);
            }
        }
    }
}

/// Four vectors of 16 codes, each within a byte, as the 64 bytes of one vector in order.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn bytes64(v: [std::arch::x86_64::__m512i; 4]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let z = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(v[0]));
    let z = _mm512_inserti32x4::<1>(z, _mm512_cvtepi32_epi8(v[1]));
    let z = _mm512_inserti32x4::<2>(z, _mm512_cvtepi32_epi8(v[2]));
    _mm512_castsi512_ps(_mm512_inserti32x4::<3>(z, _mm512_cvtepi32_epi8(v[3])))
}

/// Weight rows of one A tile: a tile of the `tile16` copy too (its A tile `i` is the copy's).
const NT: usize = 16;
const _: () = assert!(NT == tile16::ROWS);

/// Blocks ahead of the one being unpacked whose bytes a task asks for (each row's next line).
/// A task's rows are hundreds of streams 32 bytes a block apart, more than the hardware
/// prefetchers follow: on the Xeon (twenty-first session) 8B prompts, weights from DRAM, went
/// from 21-24 to 27-34 tok/s and 0.6B ones, from its 300 MiB L3, from 307-356 to 403-446 (2
/// and 4 blocks alike within that machine's noise; 6 and 8 less).
const PF: usize = 2;

/// One 64-byte-aligned tile of bytes.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct ATile([u8; TILE]);

/// The two C tiles of one A tile: its rows x hi, then its rows x lo (16x16 i32 each).
#[repr(C, align(64))]
struct CPair([i32; 512]);

/// The tile operations, on AMX (`hw::Hw`) or emulated (`Soft`). Two slots, so that the tiles
/// compute one A tile's products while the core combines the previous one's:
/// `issue(s, a)` loads `a` and starts `C_s = a · [hi, lo]`; `drain(s, c)` stores `C_s`.
trait Tiles {
    /// 32 bytes of a weight row's block to its 64 codes in tile order (`source`).
    fn unpack(&self, src: &[u8], dst: &mut [u8]) {
        unpack_portable(src, dst)
    }
    /// One block of a `tile16` tile (8 words of 16 rows, 512 bytes) to its A tile, in the
    /// same order as `unpack` gives each row.
    fn unpack16(&self, codes: &[u8], dst: &mut ATile) {
        unpack16_portable(codes, dst)
    }
    /// Asks for the cache line at `p` ahead of its use (a hint: nothing on `Soft`).
    fn prefetch(&self, _p: *const u8) {}
    /// Loads the B tiles (one token tile's `hi` and `lo` of one block).
    fn load_b(&mut self, hi: &[u8], lo: &[u8]);
    fn issue(&mut self, slot: usize, a: &ATile);
    fn drain(&mut self, slot: usize, c: &mut CPair);
    /// `acc[r][t] += (128·hi + lo)·d[t]·s[r] + b[r]·sx[t]` for the 16 rows of one A tile.
    fn combine(
        &self,
        c: &CPair,
        s: &[f32],
        b: &[f32],
        d: &[f32],
        sx: &[f32],
        acc: &mut [[f32; TT]],
    ) {
        combine_portable(c, s, b, d, sx, acc)
    }
}

/// `Tiles::combine`, one value at a time: `fma(b, sx, fma(c·d, s, acc))`, the hardware
/// path's operations.
fn combine_portable(c: &CPair, s: &[f32], b: &[f32], d: &[f32], sx: &[f32], acc: &mut [[f32; TT]]) {
    for (r, a) in acc.iter_mut().enumerate().take(NT) {
        for t in 0..TT {
            let v = ((c.0[r * 16 + t] << 7) + c.0[256 + r * 16 + t]) as f32;
            a[t] = b[r].mul_add(sx[t], (v * d[t]).mul_add(s[r], a[t]));
        }
    }
}

/// `tdpbusd` in plain Rust: `c[r][n] = Σ_q Σ_i a[r][4q + i] (unsigned) · b[q][4n + i] (signed)`.
#[cfg(test)]
struct Soft {
    b: Vec<u8>,
    c: [Vec<i32>; 2],
}

#[cfg(test)]
impl Soft {
    fn new() -> Soft {
        Soft {
            b: vec![0; 2 * TILE],
            c: [vec![0; 512], vec![0; 512]],
        }
    }
}

#[cfg(test)]
impl Tiles for Soft {
    fn load_b(&mut self, hi: &[u8], lo: &[u8]) {
        self.b[..TILE].copy_from_slice(&hi[..TILE]);
        self.b[TILE..].copy_from_slice(&lo[..TILE]);
    }

    fn issue(&mut self, slot: usize, a: &ATile) {
        for half in 0..2 {
            let b = &self.b[half * TILE..][..TILE];
            for r in 0..16 {
                for n in 0..16 {
                    let mut acc = 0i32;
                    for q in 0..16 {
                        for i in 0..4 {
                            acc +=
                                a.0[r * 64 + 4 * q + i] as i32 * b[q * 64 + 4 * n + i] as i8 as i32;
                        }
                    }
                    self.c[slot][half * 256 + r * 16 + n] = acc;
                }
            }
        }
    }

    fn drain(&mut self, slot: usize, c: &mut CPair) {
        c.0.copy_from_slice(&self.c[slot]);
    }
}

/// What every task of a call shares.
struct Ctx<'a> {
    w: &'a QMatrix,
    acts: &'a Acts,
    m: usize,
    out: SyncPtr,
}

/// Splits the A tiles (16 weight rows each) of every matrix (all `x.len() / m` wide) over
/// rayon's threads; `task(ctx, i0, i1)` computes tiles `i0..i1` of the context's matrix.
fn run(
    ws: &[&QMatrix],
    x: &[f32],
    m: usize,
    ys: &mut [&mut [MaybeUninit<f32>]],
    task: impl Fn(&Ctx, usize, usize) + Sync,
) {
    let k = vnni::check_shapes(ws, x, m, ys);
    if m == 0 {
        return;
    }
    let acts = prepare(x, m, k);
    let ctxs: Vec<Ctx> = ws
        .iter()
        .zip(ys.iter_mut())
        .map(|(w, y)| Ctx {
            w,
            acts: &acts,
            m,
            out: SyncPtr(y.as_mut_ptr().cast()),
        })
        .collect();
    let tiles: usize = ws.iter().map(|w| w.rows.div_ceil(NT)).sum();
    // a task's unpacked block (1 KiB a tile) and accumulators (1 KiB a tile and token tile,
    // read and written once a block) stay within 256 KiB of L2
    let cap = (256 / m.div_ceil(TT)).clamp(1, 32);
    // ~8 tasks a thread, so the region's tail is short, of two A tiles at least (the slots
    // overlap one's products with the other's combine) where the cap allows
    let per_task = tiles
        .div_ceil(rayon::current_num_threads().max(1) * 8)
        .max(2)
        .min(cap);
    let mut tasks = vnni::tile_runs(ws, NT, per_task);
    team::for_each_mut(&mut tasks, |&mut (i, t0, t1)| task(&ctxs[i], t0, t1));
}

/// A tiles `i0..i1` of the output through `tiles`: per block, every tile's rows are unpacked
/// once, then for each token tile the A tiles go through the two slots in turn. Inlined into
/// each caller, so that the hardware one's steps compile for AVX-512.
#[inline(always)]
fn task_body(tiles: &mut impl Tiles, ctx: &Ctx, i0: usize, i1: usize) {
    let Ctx { w, acts, m, .. } = *ctx;
    let (rows, gs, kbs) = (w.rows, w.params.group_size, acts.kbs);
    let (gpr, rb) = (w.groups_per_row(), w.row_bytes());
    let (scales, biases) = (w.scales.view(), w.biases.view());
    let packed: &[u8] = &w.packed;
    let (mt, nt) = (m.div_ceil(TT), i1 - i0);
    let mut a = vec![ATile([0; TILE]); nt];
    let (mut s, mut b) = (vec![0f32; nt * NT], vec![0f32; nt * NT]);
    let mut c = CPair([0; 512]);
    // accumulators: (token tile, weight row of the task) -> 16 tokens
    let mut acc = vec![[0f32; TT]; mt * nt * NT];
    // Intel's CPUs decode from a copy 16 rows interleaved (`tile16.rs`); where a task's A
    // tiles are its whole tiles, they are unpacked from it, so the model's file is not read
    let copy = vnni::copy_of(w);
    for kb in 0..kbs {
        let g = kb * KB / gs;
        for i in 0..nt {
            if let Some(t) = copy.filter(|t| i0 + i < t.tiles) {
                let gb = t.group_bytes();
                // this block's 8 words of 16 rows, then (after the group's codes) its scales
                // and biases
                let at = |kb: usize| (kb * KB / gs) * gb + (kb % (gs / KB)) * WORDS * 64;
                let tile = t.tile(i0 + i);
                if kb + PF < kbs {
                    for line in 0..WORDS {
                        tiles.prefetch(tile[at(kb + PF) + 64 * line..].as_ptr());
                    }
                    tiles.prefetch(tile[((kb + PF) * KB / gs) * gb + gs / 8 * 64..].as_ptr());
                }
                tiles.unpack16(&tile[at(kb)..][..WORDS * 64], &mut a[i]);
                let sb = &tile[g * gb + gs / 8 * 64..][..64];
                for r in 0..NT {
                    s[i * NT + r] = bf16_at(sb, r);
                    b[i * NT + r] = bf16_at(sb, NT + r);
                }
                continue;
            }
            for r in i * NT..(i + 1) * NT {
                let n = i0 * NT + r;
                let dst = &mut a[i].0[r % NT * 64..][..64];
                if n < rows {
                    if kb + PF < kbs {
                        tiles.prefetch(packed[n * rb + (kb + PF) * KB / 2..].as_ptr());
                    }
                    tiles.unpack(&packed[n * rb + kb * KB / 2..][..KB / 2], dst);
                    (s[r], b[r]) = (scales.get(n * gpr + g), biases.get(n * gpr + g));
                } else {
                    dst.fill(0);
                    (s[r], b[r]) = (0.0, 0.0);
                }
            }
        }
        for j in 0..mt {
            let tile = (j * kbs + kb) * TILE;
            tiles.load_b(&acts.hi[tile..][..TILE], &acts.lo[tile..][..TILE]);
            let at = (j * kbs + kb) * TT;
            let (d, sx) = (&acts.d[at..][..TT], &acts.sx[at..][..TT]);
            let acc = &mut acc[j * nt * NT..][..nt * NT];
            tiles.issue(0, &a[0]);
            for i in 0..nt {
                if i + 1 < nt {
                    tiles.issue((i + 1) % 2, &a[i + 1]);
                }
                tiles.drain(i % 2, &mut c);
                let rs = i * NT..(i + 1) * NT;
                tiles.combine(&c, &s[rs.clone()], &b[rs.clone()], d, sx, &mut acc[rs]);
            }
        }
    }
    let n0 = i0 * NT;
    let nr = (nt * NT).min(rows - n0);
    for t in 0..m {
        let accs = &acc[t / TT * nt * NT..][..nr];
        for (r, v) in accs.iter().enumerate() {
            // SAFETY: t < m and n0 + r < rows, so the element is inside y (m x rows); only
            // this task writes the columns of its tiles.
            unsafe { *ctx.out.0.add(t * rows + n0 + r) = v[t % TT] };
        }
    }
}

/// A block's 32-bit words in the `tile16` copy: 64 codes, 8 a word.
const WORDS: usize = KB / 8;

/// One block of 16 rows in the `tile16` copy (word `w` of row `r` at `64w + 4r`) as an A
/// tile: each row's 8 words in order are its 32 bytes in MLX's layout, unpacked as
/// `unpack_portable` does.
fn unpack16_portable(codes: &[u8], dst: &mut ATile) {
    for r in 0..NT {
        let mut row = [0u8; KB / 2];
        for w in 0..WORDS {
            row[4 * w..4 * w + 4].copy_from_slice(&codes[64 * w + 4 * r..][..4]);
        }
        unpack_portable(&row, &mut dst.0[r * 64..][..64]);
    }
}

/// A weight row's 32 bytes of one block as 64 codes: the low nibbles, then the high ones
/// (eight bytes a step in a u64).
fn unpack_portable(src: &[u8], dst: &mut [u8]) {
    const NIB: u64 = 0x0F0F_0F0F_0F0F_0F0F;
    for i in 0..4 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&src[8 * i..8 * i + 8]);
        let v = u64::from_le_bytes(b);
        dst[8 * i..8 * i + 8].copy_from_slice(&(v & NIB).to_le_bytes());
        dst[32 + 8 * i..40 + 8 * i].copy_from_slice(&((v >> 4) & NIB).to_le_bytes());
    }
}

#[cfg(target_arch = "x86_64")]
mod hw {
    use std::arch::asm;

    use super::{task_body, ATile, CPair, Ctx, Tiles, NT, TILE, TT};

    /// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25); XCR0 enables the tile
    /// configuration and data state (bits 17 and 18).
    pub fn cpu_has_amx() -> bool {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        #[allow(unused_unsafe)]
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is read only when leaf 0 lists it.
        let (max, osxsave, edx7) = unsafe {
            let max = __cpuid(0).eax;
            let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
            (
                max,
                osxsave,
                if max >= 7 { __cpuid_count(7, 0).edx } else { 0 },
            )
        };
        if max < 7 || !osxsave || edx7 & (3 << 24) != 3 << 24 {
            return false;
        }
        // SAFETY: OSXSAVE is set, so XGETBV is available.
        let xcr0 = unsafe { xcr0() };
        xcr0 & (3 << 17) == 3 << 17
    }

    #[target_feature(enable = "xsave")]
    unsafe fn xcr0() -> u64 {
        std::arch::x86_64::_xgetbv(0)
    }

    /// Linux hands the tile data state to a process that asks (`ARCH_REQ_XCOMP_PERM` for
    /// `XFEATURE_XTILEDATA`, 5.16 and later); until then a tile instruction faults.
    #[cfg(target_os = "linux")]
    pub fn request_permission() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these arguments only changes this process's permissions.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }

    /// The tiles of this thread, configured: palette 1, all eight 16 rows of 64 bytes. tmm0
    /// and tmm1 hold the slots' A tiles, tmm2 and tmm3 the B tiles (hi, lo), tmm4-5 and
    /// tmm6-7 the slots' C pairs. Released on drop, so an idle thread carries no tile state.
    /// Tile contents live from one asm block to the next (nothing else in this process uses
    /// AMX; the blocks declare what they write). Not `Send`: the configuration is the thread's.
    pub struct Hw(std::marker::PhantomData<*const ()>);

    impl Hw {
        /// # Safety
        /// The CPU has AMX-INT8, AVX-512 F/BW/VL and AVX2 (the safe methods use them), and the
        /// process was granted the tile state (`granted()`).
        unsafe fn begin() -> Hw {
            #[repr(C, align(64))]
            struct Cfg([u8; 64]);
            let mut cfg = Cfg([0; 64]);
            cfg.0[0] = 1; // palette
            for t in 0..8 {
                cfg.0[16 + 2 * t] = 64; // bytes a row (u16, little-endian)
                cfg.0[48 + t] = 16; // rows
            }
            asm!(
                "ldtilecfg [{}]",
                in(reg) cfg.0.as_ptr(),
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack, readonly),
            );
            Hw(std::marker::PhantomData)
        }
    }

    impl Drop for Hw {
        fn drop(&mut self) {
            // SAFETY: a configured thread (see `begin`) releases its tiles.
            unsafe {
                asm!(
                    "tilerelease",
                    out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                    out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                    options(nostack, nomem),
                )
            };
        }
    }

    impl Tiles for Hw {
        fn unpack(&self, src: &[u8], dst: &mut [u8]) {
            use std::arch::x86_64::*;
            assert!(src.len() >= 32 && dst.len() >= 64);
            // SAFETY: an `Hw` exists only where the CPU has AVX-512 (AVX2 with it, see `task`);
            // 32 bytes are read and 64 written, both in bounds (asserted).
            unsafe {
                let v = _mm256_loadu_si256(src.as_ptr() as *const __m256i);
                let nib = _mm256_set1_epi8(15);
                let p = dst.as_mut_ptr() as *mut __m256i;
                _mm256_storeu_si256(p, _mm256_and_si256(v, nib));
                _mm256_storeu_si256(p.add(1), _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib));
            }
        }

        fn unpack16(&self, codes: &[u8], dst: &mut ATile) {
            // SAFETY: an `Hw` exists only where the CPU has AVX-512 F and BW (see `task`).
            unsafe { unpack16_avx512(codes, dst) }
        }

        fn prefetch(&self, p: *const u8) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // SAFETY: a prefetch is a hint; it never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
        }

        fn load_b(&mut self, hi: &[u8], lo: &[u8]) {
            assert!(hi.len() >= TILE && lo.len() >= TILE);
            // SAFETY: tiles configured (`begin`); hi and lo hold a tile each.
            unsafe {
                asm!(
                    "tileloadd tmm2, [{h} + {s}*1]",
                    "tileloadd tmm3, [{l} + {s}*1]",
                    h = in(reg) hi.as_ptr(),
                    l = in(reg) lo.as_ptr(),
                    s = in(reg) 64usize,
                    out("tmm2") _,
                    out("tmm3") _,
                    options(nostack, readonly),
                )
            };
        }

        fn issue(&mut self, slot: usize, a: &ATile) {
            // SAFETY: tiles configured and the B tiles loaded; `a` is one tile.
            unsafe {
                if slot == 0 {
                    asm!(
                        "tileloadd tmm0, [{p} + {s}*1]",
                        "tilezero tmm4",
                        "tilezero tmm5",
                        "tdpbusd tmm4, tmm0, tmm2",
                        "tdpbusd tmm5, tmm0, tmm3",
                        p = in(reg) a.0.as_ptr(),
                        s = in(reg) 64usize,
                        out("tmm0") _,
                        out("tmm4") _,
                        out("tmm5") _,
                        options(nostack, readonly),
                    )
                } else {
                    asm!(
                        "tileloadd tmm1, [{p} + {s}*1]",
                        "tilezero tmm6",
                        "tilezero tmm7",
                        "tdpbusd tmm6, tmm1, tmm2",
                        "tdpbusd tmm7, tmm1, tmm3",
                        p = in(reg) a.0.as_ptr(),
                        s = in(reg) 64usize,
                        out("tmm1") _,
                        out("tmm6") _,
                        out("tmm7") _,
                        options(nostack, readonly),
                    )
                }
            };
        }

        fn drain(&mut self, slot: usize, c: &mut CPair) {
            let cp = c.0.as_mut_ptr();
            // SAFETY: tiles configured; `c` holds two tiles (rows of 64 bytes).
            unsafe {
                if slot == 0 {
                    asm!(
                        "tilestored [{c0} + {s}*1], tmm4",
                        "tilestored [{c1} + {s}*1], tmm5",
                        c0 = in(reg) cp,
                        c1 = in(reg) cp.add(256),
                        s = in(reg) 64usize,
                        options(nostack),
                    )
                } else {
                    asm!(
                        "tilestored [{c0} + {s}*1], tmm6",
                        "tilestored [{c1} + {s}*1], tmm7",
                        c0 = in(reg) cp,
                        c1 = in(reg) cp.add(256),
                        s = in(reg) 64usize,
                        options(nostack),
                    )
                }
            };
        }

        fn combine(
            &self,
            c: &CPair,
            s: &[f32],
            b: &[f32],
            d: &[f32],
            sx: &[f32],
            acc: &mut [[f32; TT]],
        ) {
            // SAFETY: an `Hw` exists only where the CPU has AVX-512 F (see `task`).
            unsafe { combine512(c, s, b, d, sx, acc) }
        }
    }

    /// `unpack16_portable` in registers: the block transposed (`tile16::transpose_block`), a
    /// two-source permute putting a row's words 0-3 and 4-7 twice in one vector, then each
    /// row's low nibbles to the first 32 bytes and its high ones to the last by one variable
    /// shift.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn unpack16_avx512(codes: &[u8], dst: &mut ATile) {
        use std::arch::x86_64::*;
        let q = crate::engine::cpu::tile16::transpose_block(codes);
        // the upper 256 bits' 16-bit words shift by 4: their bytes' high nibbles
        const FOURS: i64 = 0x0004_0004_0004_0004;
        let shift = _mm512_set_epi64(FOURS, FOURS, FOURS, FOURS, 0, 0, 0, 0);
        let nib = _mm512_set1_epi8(15);
        let out = dst.0.as_mut_ptr() as *mut __m512i;
        for l in 0..4i64 {
            // a row's words 0-3 (q[k]'s lane l), 4-7 (q[k + 4]'s), then both again
            let idx = _mm512_set_epi64(
                9 + 2 * l,
                8 + 2 * l,
                1 + 2 * l,
                2 * l,
                9 + 2 * l,
                8 + 2 * l,
                1 + 2 * l,
                2 * l,
            );
            for k in 0..4 {
                let row = _mm512_permutex2var_epi64(q[k], idx, q[k + 4]);
                let codes = _mm512_and_si512(_mm512_srlv_epi16(row, shift), nib);
                _mm512_storeu_si512(out.add(4 * l as usize + k), codes);
            }
        }
    }

    /// `Tiles::combine` on 16-lane vectors: a C tile row is 16 tokens' sums.
    #[target_feature(enable = "avx512f")]
    unsafe fn combine512(
        c: &CPair,
        s: &[f32],
        b: &[f32],
        d: &[f32],
        sx: &[f32],
        acc: &mut [[f32; TT]],
    ) {
        use std::arch::x86_64::*;
        assert!(
            d.len() >= TT && sx.len() >= TT && acc.len() >= NT && s.len() >= NT && b.len() >= NT
        );
        let (dv, sxv) = (_mm512_loadu_ps(d.as_ptr()), _mm512_loadu_ps(sx.as_ptr()));
        let cp = c.0.as_ptr();
        for r in 0..NT {
            let hi = _mm512_loadu_si512(cp.add(r * 16) as *const _);
            let lo = _mm512_loadu_si512(cp.add(256 + r * 16) as *const _);
            let v = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32::<7>(hi), lo));
            let a = acc.as_mut_ptr().add(r) as *mut f32;
            let t = _mm512_fmadd_ps(
                _mm512_mul_ps(v, dv),
                _mm512_set1_ps(s[r]),
                _mm512_loadu_ps(a),
            );
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(b[r]), sxv, t));
        }
    }

    /// One task on this thread's tiles, its f32 steps compiled for AVX-512.
    ///
    /// # Safety
    /// As `Hw::begin`, and the CPU has AVX-512 F/BW/VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub unsafe fn task(ctx: &Ctx, i0: usize, i1: usize) {
        let mut tiles = Hw::begin();
        task_body(&mut tiles, ctx, i0, i1);
    }
}

/// The AMX GEMM's result through the emulated tiles, on any CPU (`vnni.rs` checks its bits
/// against it).
#[cfg(test)]
pub(crate) fn soft_gemm(w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; m * w.rows];
    run(
        &[w],
        x,
        m,
        // SAFETY: the kernel stores only computed f32 sums.
        &mut [unsafe { vnni::as_uninit(&mut y[..]) }],
        |ctx, p0, p1| task_body(&mut Soft::new(), ctx, p0, p1),
    );
    y
}

/// The shapes of the 15-bit prompt GEMM tests (here, `vnni.rs`, `i8mm.rs`): (group size,
/// tokens, columns, rows), with token and row tails and groups of 64 and 128.
#[cfg(test)]
pub(crate) const TEST_SHAPES: [(usize, usize, usize, usize); 6] = [
    (64, 16, 64, 32),
    (64, 17, 1024, 50),
    (128, 64, 640, 96),
    (64, 8, 192, 7),
    (128, 33, 256, 64),
    (64, 9, 128, 200),
];

/// A case of the 15-bit prompt GEMM tests (here, `vnni.rs` and `i8mm.rs`): `rows x k` random 4-bit
/// weights in groups of `gs` (bf16, f16 or f32 scales by `seed`) and `m` tokens of inputs in
/// ±2 with an outlier, a zero block and a negative extreme.
#[cfg(test)]
pub(crate) fn test_case(
    seed: usize,
    gs: usize,
    m: usize,
    k: usize,
    rows: usize,
) -> (QMatrix, Vec<f32>) {
    use crate::engine::quant::testutil::random_qmatrix;
    use crate::engine::weights::Dtype;
    use rand::{Rng, SeedableRng};
    let dt = [Dtype::BF16, Dtype::F16, Dtype::F32][seed % 3];
    let w = random_qmatrix(rows, k, 4, gs, dt, seed as u64 + 11);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed as u64);
    let mut x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    x[3] = 40.0;
    x[k..k + KB.min(k)].fill(0.0);
    x[m * k - 1] = -17.0;
    (w, x)
}

/// Asserts each of `got`'s outputs within what rounding x to 15 bits can move it from
/// dequantize-then-matmul: at most d/2 a value, so Σ_blocks d/2 · Σ|w| over the block, plus
/// 1e-5 of the largest |y| for f32 sums. Returns the reference and its largest |y|.
#[cfg(test)]
pub(crate) fn assert_within_rounding(
    w: &QMatrix,
    x: &[f32],
    m: usize,
    got: &[f32],
) -> (Vec<f32>, f32) {
    assert_within_rounding_to(w, x, m, got, 16383.0)
}

/// `assert_within_rounding` for activations rounded to `qmax` steps a side (127: `int8`).
#[cfg(test)]
pub(crate) fn assert_within_rounding_to(
    w: &QMatrix,
    x: &[f32],
    m: usize,
    got: &[f32],
    qmax: f32,
) -> (Vec<f32>, f32) {
    let (k, rows, gs) = (w.cols, w.rows, w.params.group_size);
    let want = w.matmul_reference(x, m);
    let max = want.iter().fold(0f32, |a, v| a.max(v.abs()));
    let wd = w.dequantize();
    for t in 0..m {
        for n in 0..rows {
            let mut bound = 1e-5 * max as f64;
            for kb in 0..k / KB {
                let blk = &x[t * k + kb * KB..][..KB];
                let d = blk.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / qmax as f64;
                let wsum: f64 = wd[n * k + kb * KB..][..KB]
                    .iter()
                    .map(|v| v.abs() as f64)
                    .sum();
                bound += d / 2.0 * wsum;
            }
            let (g, r) = (got[t * rows + n], want[t * rows + n]);
            assert!(
                ((g - r).abs() as f64) <= bound,
                "gs {gs} m {m} k {k} rows {rows} token {t} row {n}: {g} vs {r}, bound {bound}"
            );
        }
    }
    (want, max)
}

/// Asserts that `got` (m x rows), computed from a matrix blanked but for its `tile16` copy
/// (`testutil::blanked`), has `want`'s bits for every row of a whole tile and zeros for the
/// tail rows (which read the blanked matrix). Also `vnni.rs`'s.
#[cfg(test)]
pub(crate) fn assert_read_from_copy(got: &[f32], want: &[f32], m: usize, rows: usize, what: &str) {
    let whole = rows / tile16::ROWS * tile16::ROWS;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for t in 0..m {
        let (g, r) = (&got[t * rows..][..rows], &want[t * rows..][..rows]);
        assert_eq!(
            bits(&g[..whole]),
            bits(&r[..whole]),
            "{what} token {t}: whole tiles"
        );
        assert!(
            g[whole..].iter().all(|v| *v == 0.0),
            "{what} token {t}: tail rows"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::quant::testutil::random_qmatrix;
    use crate::engine::weights::Dtype;

    fn soft(w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
        soft_gemm(w, x, m)
    }

    /// The GEMM on the hardware tiles; the caller checks `Isa::Amx.supported()`.
    #[cfg(target_arch = "x86_64")]
    fn hardware(w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * w.rows];
        run(
            &[w],
            x,
            m,
            // SAFETY: the kernel stores only computed f32 sums.
            &mut [unsafe { vnni::as_uninit(&mut y[..]) }],
            // SAFETY: the caller checked that AMX (with AVX-512) is supported and granted.
            |ctx, p0, p1| unsafe { hw::task(ctx, p0, p1) },
        );
        y
    }

    /// The AVX-512 layout pass gives `prepare_tile`'s bytes, scales and sums bit for bit: a
    /// token tail, a zero block, ties, an outlier, tiny and huge magnitudes, every block of a
    /// tile and a run of them from the second on.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn prepare_avx512_matches_portable() {
        if !crate::engine::cpu::isa::tested_here(Isa::Avx512Vnni, "prepare_avx512_matches_portable")
        {
            return;
        }
        let (m, k, x) = vnni::layout_test_input(8);
        let kbs = k / KB;
        for (j, kbr) in (0..m.div_ceil(TT)).flat_map(|j| [(j, 0..kbs), (j, 1..kbs - 1)]) {
            let n = kbr.len();
            let fresh = || {
                (
                    vec![0u8; n * TILE],
                    vec![0u8; n * TILE],
                    vec![0f32; n * TT],
                    vec![0f32; n * TT],
                )
            };
            let (mut want, mut got) = (fresh(), fresh());
            type Bufs = (Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>);
            fn acts(a: &mut Bufs) -> TileActs<'_> {
                let (hi, lo, d, sx) = a;
                TileActs { hi, lo, d, sx }
            }
            prepare_tile(&x, m, k, j, kbr.clone(), acts(&mut want));
            // SAFETY: the CPU has AVX-512.
            unsafe { prepare_tile_avx512(&x, m, k, j, kbr.clone(), acts(&mut got)) };
            assert_eq!(got.0, want.0, "token tile {j}, blocks {kbr:?}: hi bytes");
            assert_eq!(got.1, want.1, "token tile {j}, blocks {kbr:?}: lo bytes");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got.2),
                bits(&want.2),
                "tile {j}, blocks {kbr:?}: scales"
            );
            assert_eq!(
                bits(&got.3),
                bits(&want.3),
                "tile {j}, blocks {kbr:?}: sums"
            );
        }
    }

    /// The activations' layout is the same whatever the pass's tasks: pools of 1, 3 and 16
    /// threads (a token tile's every block a task down to two blocks) and teams of 3 and 16
    /// (`cpu::team`, as a host prompt pass runs it), token tails included; and the GEMM
    /// (emulated tiles) gives one thread's bits on a team.
    #[test]
    fn prepare_is_the_same_on_any_pool() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (m, k) in [(64, 1024), (21, 320), (2, 3072)] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            // on the pool's workers, or on a team they form (a host prompt pass's way)
            let on = |threads: usize, team: bool| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                let pool = pool.expect("a test pool");
                let a = match team {
                    true => pool.install(|| team::Team::lead(|| prepare(&x, m, k))),
                    false => pool.install(|| prepare(&x, m, k)),
                };
                let f =
                    a.d.iter()
                        .chain(&a.sx)
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>();
                (a.hi, a.lo, f)
            };
            let one = on(1, false);
            for (threads, team) in [(3, false), (16, false), (3, true), (16, true)] {
                let what = format!("m {m}, k {k}: {threads} threads, team {team}");
                assert!(on(threads, team) == one, "{what}");
            }
            // the GEMM on the emulated tiles too: the same bits on a team as on one thread
            let (w, x) = test_case(m, 64, m, k, 40);
            let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build();
            let one = pool(1)
                .expect("a test pool")
                .install(|| soft_gemm(&w, &x, m));
            let team = pool(5).expect("a test pool");
            let got = team.install(|| team::Team::lead(|| soft_gemm(&w, &x, m)));
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&one),
                "m {m}, k {k}: the GEMM on a team of 5"
            );
        }
    }

    /// The tile logic (layout, split, per-block scaling, row and token tails, the two slots)
    /// through the emulated tiles, on every CPU, against dequantize-then-matmul: each output
    /// within what rounding x to 15 bits can move it (plus 1e-5 of the largest |y|), and all
    /// within 2e-4 of the largest |y| (an outlier of 40 among values below 2 included). Where the CPU has AMX, the hardware tiles give
    /// the same bits as the emulated ones, and `qmatmul` takes this path for `fast` prompts.
    #[test]
    fn tiles_match_reference_and_hardware() {
        // emulated tiles everywhere, the hardware's too where AMX runs
        #[cfg(target_arch = "x86_64")]
        let hw =
            crate::engine::cpu::isa::tested_here(Isa::Amx, "tiles_match_reference_and_hardware");
        for (seed, (gs, m, k, rows)) in TEST_SHAPES.into_iter().enumerate() {
            let (w, x) = test_case(seed, gs, m, k, rows);
            let got = soft(&w, &x, m);
            let (want, max) = assert_within_rounding(&w, &x, m, &got);
            let err = got
                .iter()
                .zip(&want)
                .fold(0f32, |a, (g, r)| a.max((g - r).abs()));
            assert!(
                err <= 2e-4 * max,
                "gs {gs} m {m} k {k}: max err {err} of {max}"
            );
            #[cfg(target_arch = "x86_64")]
            if hw {
                let on_hw = hardware(&w, &x, m);
                // (no FMA contraction in Rust: the AVX-512 build of the f32 steps rounds alike)
                for (i, (a, b)) in on_hw.iter().zip(&got).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "gs {gs} m {m} k {k}: element {i}");
                }
                if isa::active() == Isa::Amx {
                    let mut via = vec![f32::NAN; m * rows];
                    crate::engine::cpu::quant::qmatmul(
                        &w,
                        &x,
                        m,
                        &mut via,
                        crate::engine::quant::Numerics::Fast,
                    );
                    assert_eq!(via, on_hw, "qmatmul's fast prompt path is the AMX GEMM");
                }
            }
        }
    }

    /// A block of the `tile16` copy unpacks to the A tile MLX's rows give: the portable
    /// transpose against each row's bytes gathered by hand, and the AVX-512 one against the
    /// portable where the CPU has AVX-512 BW.
    #[test]
    fn copy_blocks_unpack_as_rows() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for _ in 0..20 {
            let codes: Vec<u8> = (0..WORDS * 64).map(|_| rng.random()).collect();
            let mut want = ATile([0; TILE]);
            for r in 0..NT {
                // row r's 32 bytes: its word w at 64w + 4r
                let row: Vec<u8> = (0..KB / 2)
                    .map(|i| codes[64 * (i / 4) + 4 * r + i % 4])
                    .collect();
                unpack_portable(&row, &mut want.0[r * 64..][..64]);
            }
            let mut got = ATile([0xAA; TILE]);
            unpack16_portable(&codes, &mut got);
            assert_eq!(got.0, want.0);
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx512bw") {
                let mut simd = ATile([0xAA; TILE]);
                // SAFETY: AVX-512 F and BW were detected.
                unsafe { hw::unpack16_avx512(&codes, &mut simd) };
                assert_eq!(simd.0, want.0, "AVX-512 transpose");
            } else {
                eprintln!("copy_blocks_unpack_as_rows: no AVX-512 BW here; portable only");
            }
        }
    }

    /// With a `tile16` copy the GEMM reads its whole tiles from it and gives the rows' bits:
    /// the same outputs with the copy, and with the copy but the matrix's own codes, scales
    /// and biases zeroed the same outputs for every row in a whole tile (the tail rows,
    /// which read the matrix, change). Emulated tiles on every CPU; the hardware ones where
    /// the CPU has AMX.
    #[test]
    fn copy_gives_the_rows_bits() {
        let shapes = [
            (64, 17, 1024, 50),
            (128, 64, 640, 96),
            (64, 9, 128, 200),
            (128, 33, 256, 16),
        ];
        for (seed, (gs, m, k, rows)) in shapes.into_iter().enumerate() {
            let w = random_qmatrix(rows, k, 4, gs, Dtype::BF16, seed as u64 + 31);
            let (_, x) = test_case(seed, gs, m, k, rows);
            let want = soft(&w, &x, m);
            assert!(crate::engine::cpu::tile16::attach(&w).is_some());
            let got = soft(&w, &x, m);
            assert_eq!(
                bits(&got),
                bits(&want),
                "gs {gs} m {m} k {k} rows {rows}: with the copy"
            );
            let blank = crate::engine::quant::testutil::blanked(&w);
            assert_read_from_copy(&soft(&blank, &x, m), &want, m, rows, &format!("gs {gs}"));
            #[cfg(target_arch = "x86_64")]
            if crate::engine::cpu::isa::tested_here(Isa::Amx, "copy_gives_the_rows_bits") {
                let on_hw = hardware(&w, &x, m);
                assert_eq!(
                    bits(&on_hw),
                    bits(&want),
                    "gs {gs} m {m}: hardware tiles, copy"
                );
            }
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Shapes the tiles cannot take go to the other kernels.
    #[test]
    fn other_shapes_are_not_taken() {
        assert!(!shape_ok(&random_qmatrix(8, 96, 4, 32, Dtype::BF16, 1)));
        assert!(!shape_ok(&random_qmatrix(8, 128, 8, 64, Dtype::BF16, 1)));
        assert!(shape_ok(&random_qmatrix(8, 128, 4, 128, Dtype::BF16, 1)));
        assert!(!shape_ok(&random_qmatrix(8, 0, 4, 64, Dtype::BF16, 1)));
    }
}
