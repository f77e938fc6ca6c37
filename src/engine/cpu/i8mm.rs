//! The prompt GEMM of 4-bit weights on aarch64 with the int8 matrix-multiply extension
//! (FEAT_I8MM, `smmla`: Apple M2 and later, Graviton 3 and later), for the `fast` arithmetic:
//! `y (m x rows) = x (m x cols) @ dequant(w)^T` with exactly the numbers of `vnni.rs` and
//! `amx.rs`: per 64-value block of a token `d = max|x| / 16383` and 15-bit codes
//! (`vnni::quantize`), split here `xq = 128·hi + lo` (`hi` signed, `lo` in 0..127, one byte
//! each), the i32 sums exact,
//! then `y = fma(b, Σx, fma(c·d, s, y))` in f32 block after block. The slow references are
//! `amx::soft_gemm` (the same bits, tested) and `QMatrix::matmul_reference` (within what
//! rounding x to 15 bits moves). Without i8mm a prompt takes the f32 GEMM (`exact`'s numbers).
//!
//! Why: `smmla vd.4s, vn.16b, vm.16b` adds a 2x8 block of signed bytes times the transpose of
//! another into a 2x2 block of i32 (`vd[2i + j] += Σ_k vn[8i + k] · vm[8j + k]`): two tokens by
//! two weight rows by eight values, 32 products an instruction where `sdot` does 16 and an f32
//! FMA 4. Arm's ARM (DDI 0487, SMMLA) defines it.
//!
//! Layout: a dot product does not depend on the order of its terms, so both sides take a
//! 32-value half-block in the order the packed bytes hold it, split by nibble: chunk 0 the low
//! nibbles of bytes 0..8 (values 0, 2, .., 14), chunk 1 of bytes 8..16, chunks 2 and 3 the high
//! nibbles (the odd values). A tile of `R` = 4 weight rows is unpacked once a call (NEON: a
//! mask, a shift and a 64-bit zip per 16 bytes) into
//! registers of two rows' 8 codes (`[block][chunk][row pair]`); the activations once a call
//! into registers of two tokens' 8 bytes (`[token pair][block][chunk][lo, hi]`). A tile of 4
//! tokens by 4 rows keeps 8 i32 accumulators (lo and hi sums of each 2x2) over a block's 8
//! chunks (64 `smmla`), then combines them into 4 f32 accumulators (lanes `[t0·r0, t0·r1,
//! t1·r0, t1·r1]`). The tile's steps are written twice, in NEON and in portable Rust
//! (`Soft`, any CPU), and the tests hold both to `amx::soft_gemm`'s bits.

#![cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]

use std::mem::MaybeUninit;

use crate::engine::cpu::team;

use crate::engine::cpu::isa::{self, Isa};
use crate::engine::cpu::vnni::{self, SyncPtr, KB};
use crate::engine::quant::QMatrix;

/// Weight rows of a tile (two row pairs).
const R: usize = 4;
/// Tokens of a tile (two token pairs).
const T: usize = 4;
/// 8-value chunks a 64-value block holds.
const CHUNKS: usize = KB / 8;
/// Token pairs whose activations a task runs over all its tiles before the next ones (32
/// tokens: 64 KiB of activations at 1024 columns, 256 KiB at 4096), so that a long prompt's
/// activations are not streamed again for every 4-row tile.
const TOKEN_PAIRS: usize = 16;

/// Whether the prompt GEMM of `w` runs here: the process's instruction set is `neon-i8mm` and
/// `w` has 4-bit codes in groups of 64 or a multiple.
pub fn usable(w: &QMatrix) -> bool {
    isa::active() == Isa::NeonI8mm && vnni::shape_ok(w)
}

/// `y = x @ dequant(w)^T` with `smmla`. Callers check `usable(w)` first.
pub fn qgemm(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32]) {
    assert!(usable(w), "i8mm::qgemm without FEAT_I8MM");
    // SAFETY (as_uninit): the kernel stores only computed f32 sums.
    run(&[w], x, m, &mut [unsafe { vnni::as_uninit(y) }], Mm::Hw);
}

/// `qgemm` of several matrices of the same input (q|k|v, gate|up): the activations laid out
/// once, every matrix's row tiles in one parallel region. Callers check `usable` on each;
/// every element of `outs` (`m x rows` each) is written (`shared_outputs` gives them).
pub fn qgemm_shared(ws: &[&QMatrix], x: &[f32], m: usize, outs: &mut [&mut [MaybeUninit<f32>]]) {
    assert!(
        ws.iter().all(|w| usable(w)),
        "i8mm::qgemm_shared without FEAT_I8MM"
    );
    run(ws, x, m, outs, Mm::Hw)
}

/// Which implementation of a tile's steps runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mm {
    /// NEON with `smmla` (aarch64 with i8mm only).
    Hw,
    /// Portable Rust, the same steps (tests, on any CPU).
    #[cfg(test)]
    Soft,
}

/// The activations of one call: per token pair, block and chunk, the low then the high bytes
/// of two tokens' 8 values (16 bytes each); per token pair and block, `d` and `Σx` as the lanes
/// of a tile's result want them (`[t0, t0, t1, t1]`). Tokens past `m` are zeros.
struct Acts {
    q: Vec<[i8; 16]>,
    d: Vec<[f32; 4]>,
    sx: Vec<[f32; 4]>,
    kbs: usize,
}

/// Value index (within its block) of byte `j` of chunk `c`: chunks 0-1 (4-5) the even values
/// of the first (second) half-block, 2-3 (6-7) the odd ones.
fn value_of(c: usize, j: usize) -> usize {
    let (half, cc) = (c / 4, c % 4);
    2 * (half * 16 + 8 * (cc % 2) + j) + cc / 2
}

fn prepare(x: &[f32], m: usize, k: usize) -> Acts {
    let (pairs, kbs) = (m.div_ceil(2), k / KB);
    let mut a = Acts {
        q: vec![[0; 16]; pairs * kbs * CHUNKS * 2],
        d: vec![[0.0; 4]; pairs * kbs],
        sx: vec![[0.0; 4]; pairs * kbs],
        kbs,
    };
    let mut parts: Vec<_> = (a.q.chunks_mut(kbs * CHUNKS * 2))
        .zip(a.d.chunks_mut(kbs).zip(a.sx.chunks_mut(kbs)))
        .enumerate()
        .collect();
    // on the team a host pass leads (`cpu::team`), else rayon's pool
    team::for_each_mut(&mut parts, |(p, (q, (d, sx)))| {
        let p = *p;
        let mut v = [0i32; KB];
        for t in 0..2.min(m - 2 * p) {
            let row = &x[(2 * p + t) * k..][..k];
            for (kb, blk) in row.chunks_exact(KB).enumerate() {
                let (dt, st) = vnni::quantize(blk, &mut v);
                d[kb][2 * t..2 * t + 2].fill(dt);
                sx[kb][2 * t..2 * t + 2].fill(st);
                for c in 0..CHUNKS {
                    let at = (kb * CHUNKS + c) * 2;
                    for j in 0..8 {
                        let xq = v[value_of(c, j)];
                        q[at][8 * t + j] = (xq & 127) as i8;
                        q[at + 1][8 * t + j] = (xq >> 7) as i8;
                    }
                }
            }
        }
    });
    a
}

/// A tile of `R` weight rows, unpacked: per block and chunk, two row pairs' codes; per block,
/// the scales and biases as a tile's result lanes want them (`[r0, r1, r0, r1]` a row pair).
struct Panel {
    q: Vec<[i8; 16]>,
    s: Vec<[f32; 4]>,
    b: Vec<[f32; 4]>,
}

impl Panel {
    /// Rows `n0..n0 + R` of `w` (zeros past its last row); the codes by NEON for `Mm::Hw`.
    fn new(w: &QMatrix, n0: usize, mm: Mm) -> Panel {
        let (kbs, gpr) = (w.cols / KB, w.groups_per_row());
        let (scales, biases) = (w.scales.view(), w.biases.view());
        let mut p = Panel {
            q: vec![[0; 16]; kbs * CHUNKS * 2],
            s: vec![[0.0; 4]; kbs * 2],
            b: vec![[0.0; 4]; kbs * 2],
        };
        for r in 0..R.min(w.rows.saturating_sub(n0)) {
            let n = n0 + r;
            let (rp, lane) = (r / 2, r % 2);
            for kb in 0..kbs {
                let g = kb * KB / w.params.group_size;
                let (s, b) = (scales.get(n * gpr + g), biases.get(n * gpr + g));
                for l in [lane, lane + 2] {
                    p.s[kb * 2 + rp][l] = s;
                    p.b[kb * 2 + rp][l] = b;
                }
            }
        }
        match mm {
            // SAFETY: `Hw` is chosen through `usable`: the CPU has NEON; `p.q` holds `kbs`
            // blocks of chunks.
            Mm::Hw => unsafe { hw::fill_codes(&mut p.q, w, n0) },
            #[cfg(test)]
            Mm::Soft => soft_codes(&mut p.q, w, n0),
        }
        p
    }
}

/// `hw::fill_codes` in portable Rust: chunk `c` of a block takes the low (`c % 4 < 2`) or
/// high nibbles of 8 of a half-block's bytes, row `2·rp` in bytes 0..8 of its register and
/// row `2·rp + 1` in 8..16 (`value_of`'s order).
#[cfg(test)]
fn soft_codes(q: &mut [[i8; 16]], w: &QMatrix, n0: usize) {
    let (kbs, rb) = (w.cols / KB, w.row_bytes());
    for r in 0..R.min(w.rows.saturating_sub(n0)) {
        let (n, rp, lane) = (n0 + r, r / 2, r % 2);
        for kb in 0..kbs {
            let bytes = &w.packed[n * rb + kb * KB / 2..][..KB / 2];
            for c in 0..CHUNKS {
                let (half, cc) = (c / 4, c % 4);
                for j in 0..8 {
                    let byte = bytes[half * 16 + 8 * (cc % 2) + j];
                    let code = if cc < 2 { byte & 15 } else { byte >> 4 };
                    q[(kb * CHUNKS + c) * 2 + rp][8 * lane + j] = code as i8;
                }
            }
        }
    }
}

/// Splits the row tiles of every matrix over rayon's threads; each task unpacks a tile, then
/// runs every token tile against it.
fn run(ws: &[&QMatrix], x: &[f32], m: usize, ys: &mut [&mut [MaybeUninit<f32>]], mm: Mm) {
    let k = vnni::check_shapes(ws, x, m, ys);
    if m == 0 {
        return;
    }
    let acts = prepare(x, m, k);
    let outs: Vec<SyncPtr> = ys
        .iter_mut()
        .map(|y| SyncPtr(y.as_mut_ptr().cast()))
        .collect();
    let tiles: usize = ws.iter().map(|w| w.rows.div_ceil(R)).sum();
    // a task's unpacked tiles (k/2 bytes of codes each) stay within 256 KiB, and each block
    // of `TOKEN_PAIRS` token pairs' activations is read once per task, not once per tile
    let cap = ((256 << 10) / (k / 2).max(1)).clamp(1, 64);
    let per_task = tiles
        .div_ceil(rayon::current_num_threads().max(1) * 8)
        .clamp(1, cap);
    let mut tasks = vnni::tile_runs(ws, R, per_task);
    // on the team a host pass leads (`cpu::team`), else rayon's pool
    team::for_each_mut(&mut tasks, |&mut (i, t0, t1)| {
        let panels: Vec<Panel> = (t0..t1).map(|t| Panel::new(ws[i], t * R, mm)).collect();
        let pairs = m.div_ceil(2);
        for tb in (0..pairs).step_by(TOKEN_PAIRS) {
            for (t, panel) in (t0..t1).zip(&panels) {
                for tp in (tb..pairs.min(tb + TOKEN_PAIRS)).step_by(T / 2) {
                    let y = match mm {
                        // SAFETY: `Hw` is chosen by `qgemm` through `usable`: the CPU has
                        // NEON and i8mm; `panel` and `acts` hold whole blocks of this
                        // call's width.
                        Mm::Hw => unsafe { hw::tile(panel, &acts, tp) },
                        #[cfg(test)]
                        Mm::Soft => soft_tile(panel, &acts, tp),
                    };
                    store(&y, m, ws[i].rows, t * R, tp, &outs[i]);
                }
            }
        }
    });
}

/// A tile's results (`y[token pair][row pair]`, lanes `[t0·r0, t0·r1, t1·r0, t1·r1]`) into
/// `out` (m x rows), those inside the matrix.
fn store(y: &[[[f32; 4]; 2]; 2], m: usize, rows: usize, n0: usize, tp0: usize, out: &SyncPtr) {
    for (pi, yp) in y.iter().enumerate() {
        for (ri, v) in yp.iter().enumerate() {
            for (l, &val) in v.iter().enumerate() {
                let (t, n) = (2 * (tp0 + pi) + l / 2, n0 + 2 * ri + l % 2);
                if t < m && n < rows {
                    // SAFETY: t < m and n < rows, so the element is inside y (m x rows); only
                    // the task of this row tile writes these columns.
                    unsafe { *out.0.add(t * rows + n) = val };
                }
            }
        }
    }
}

/// Token pairs `tp0` and `tp0 + 1` (zeros past the last) against a tile's two row pairs, in
/// portable Rust: the definition of `hw::tile`'s steps.
#[cfg(test)]
fn soft_tile(p: &Panel, a: &Acts, tp0: usize) -> [[[f32; 4]; 2]; 2] {
    let pairs = a.d.len() / a.kbs;
    let mut y = [[[0f32; 4]; 2]; 2];
    for kb in 0..a.kbs {
        for (pi, yp) in y.iter_mut().enumerate() {
            let tp = tp0 + pi;
            if tp >= pairs {
                continue;
            }
            for (ri, v) in yp.iter_mut().enumerate() {
                let (mut lo, mut hi) = ([0i32; 4], [0i32; 4]);
                for c in 0..CHUNKS {
                    let w = &p.q[(kb * CHUNKS + c) * 2 + ri];
                    let at = ((tp * a.kbs + kb) * CHUNKS + c) * 2;
                    smmla_soft(&mut lo, &a.q[at], w);
                    smmla_soft(&mut hi, &a.q[at + 1], w);
                }
                let (d, sx) = (a.d[tp * a.kbs + kb], a.sx[tp * a.kbs + kb]);
                let (s, b) = (p.s[kb * 2 + ri], p.b[kb * 2 + ri]);
                for l in 0..4 {
                    let c = (lo[l] + 128 * hi[l]) as f32;
                    v[l] = b[l].mul_add(sx[l], (c * d[l]).mul_add(s[l], v[l]));
                }
            }
        }
    }
    y
}

/// `smmla` by its definition: `acc[2i + j] += Σ_k a[8i + k] · b[8j + k]`.
#[cfg(test)]
fn smmla_soft(acc: &mut [i32; 4], a: &[i8; 16], b: &[i8; 16]) {
    for i in 0..2 {
        for j in 0..2 {
            acc[2 * i + j] += (0..8)
                .map(|k| a[8 * i + k] as i32 * b[8 * j + k] as i32)
                .sum::<i32>();
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod hw {
    use std::arch::aarch64::*;

    use super::{Acts, Panel, CHUNKS};

    /// `acc + a · bᵀ` on 2x8 blocks of signed bytes (`smmla`; its intrinsic is not stable).
    #[target_feature(enable = "neon,i8mm")]
    #[inline]
    unsafe fn smmla(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        std::arch::asm!(
            "smmla {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    /// `Panel::fill`'s codes on NEON: per half-block of a row pair, the two rows' 16 bytes
    /// split into low and high nibbles, then paired 8 bytes from each row (`zip` on 64-bit
    /// lanes): chunks 0-3 as the portable loop lays them out. A row past the matrix is zeros.
    ///
    /// # Safety
    /// The CPU has NEON; `q` holds `w.cols / 64` blocks of chunks.
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn fill_codes(
        q: &mut [[i8; 16]],
        w: &crate::engine::quant::QMatrix,
        n0: usize,
    ) {
        let (kbs, rb) = (w.cols / super::KB, w.row_bytes());
        assert!(q.len() >= kbs * CHUNKS * 2);
        let mask = vdupq_n_u8(0x0f);
        for rp in 0..2 {
            let rows = [n0 + 2 * rp, n0 + 2 * rp + 1];
            for kb in 0..kbs {
                for half in 0..2 {
                    let [v0, v1] = rows.map(|n| {
                        if n < w.rows {
                            vld1q_u8(
                                w.packed[n * rb + kb * super::KB / 2 + half * 16..][..16].as_ptr(),
                            )
                        } else {
                            vdupq_n_u8(0)
                        }
                    });
                    let lo = [v0, v1].map(|v| vreinterpretq_u64_u8(vandq_u8(v, mask)));
                    let hi = [v0, v1].map(|v| vreinterpretq_u64_u8(vshrq_n_u8::<4>(v)));
                    let chunks = [
                        vzip1q_u64(lo[0], lo[1]),
                        vzip2q_u64(lo[0], lo[1]),
                        vzip1q_u64(hi[0], hi[1]),
                        vzip2q_u64(hi[0], hi[1]),
                    ];
                    for (cc, v) in chunks.into_iter().enumerate() {
                        let at = (kb * CHUNKS + half * 4 + cc) * 2 + rp;
                        vst1q_s8(q[at].as_mut_ptr(), vreinterpretq_s8_u64(v));
                    }
                }
            }
        }
    }

    /// `soft_tile` on NEON, step for step (the same i32 sums, the same f32 operations in the
    /// same order).
    ///
    /// # Safety
    /// The CPU has NEON and i8mm; `p` and `a` are of one call (the same block count).
    #[target_feature(enable = "neon,i8mm")]
    pub(super) unsafe fn tile(p: &Panel, a: &Acts, tp0: usize) -> [[[f32; 4]; 2]; 2] {
        let pairs = a.d.len() / a.kbs;
        let ld = |v: &[i8; 16]| vld1q_s8(v.as_ptr());
        let ldf = |v: &[f32; 4]| vld1q_f32(v.as_ptr());
        let mut y = [[vdupq_n_f32(0.0); 2]; 2];
        let np = 2.min(pairs - tp0);
        for kb in 0..a.kbs {
            let mut lo = [[vdupq_n_s32(0); 2]; 2];
            let mut hi = lo;
            for c in 0..CHUNKS {
                let w = [0, 1].map(|ri| ld(&p.q[(kb * CHUNKS + c) * 2 + ri]));
                for pi in 0..np {
                    let at = (((tp0 + pi) * a.kbs + kb) * CHUNKS + c) * 2;
                    let (xl, xh) = (ld(&a.q[at]), ld(&a.q[at + 1]));
                    for ri in 0..2 {
                        lo[pi][ri] = smmla(lo[pi][ri], xl, w[ri]);
                        hi[pi][ri] = smmla(hi[pi][ri], xh, w[ri]);
                    }
                }
            }
            for pi in 0..np {
                let at = (tp0 + pi) * a.kbs + kb;
                let (d, sx) = (ldf(&a.d[at]), ldf(&a.sx[at]));
                for ri in 0..2 {
                    let (s, b) = (ldf(&p.s[kb * 2 + ri]), ldf(&p.b[kb * 2 + ri]));
                    let c = vcvtq_f32_s32(vmlaq_n_s32(lo[pi][ri], hi[pi][ri], 128));
                    let t = vfmaq_f32(y[pi][ri], vmulq_f32(c, d), s);
                    y[pi][ri] = vfmaq_f32(t, b, sx);
                }
            }
        }
        let mut out = [[[0f32; 4]; 2]; 2];
        for pi in 0..2 {
            for ri in 0..2 {
                vst1q_f32(out[pi][ri].as_mut_ptr(), y[pi][ri]);
            }
        }
        out
    }
}

#[cfg(not(target_arch = "aarch64"))]
mod hw {
    use super::{Acts, Panel};

    /// Never reached: `usable` is false off aarch64.
    pub(super) unsafe fn fill_codes(
        _: &mut [[i8; 16]],
        _: &crate::engine::quant::QMatrix,
        _: usize,
    ) {
        unreachable!("the i8mm kernel is chosen only on aarch64")
    }

    /// Never reached: `usable` is false off aarch64.
    pub(super) unsafe fn tile(_: &Panel, _: &Acts, _: usize) -> [[[f32; 4]; 2]; 2] {
        unreachable!("the i8mm kernel is chosen only on aarch64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value of a block lands in exactly one chunk byte, on both sides alike.
    #[test]
    fn chunks_cover_each_block_value_once() {
        let mut seen = [0u8; KB];
        for c in 0..CHUNKS {
            for j in 0..8 {
                seen[value_of(c, j)] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
    }

    /// The tile's steps against `amx.rs`'s emulated tiles bit for bit (the same arithmetic)
    /// and the dequantized product within the activations' rounding: portable everywhere,
    /// NEON `smmla` where the CPU has i8mm (`qmatmul` and `qmatmul_shared` there take it for
    /// `fast` prompts). Token and row tails, groups of 64 and 128, bf16/f16/f32 scales.
    #[test]
    fn gemm_matches_amx_tiles_and_reference() {
        // the portable steps run everywhere; scripts/test-aarch64.sh names neon-i8mm in
        // REQUIRE_CPU_ISAS (qemu's `max` CPU has it), so skipping `smmla` there fails
        let hw = crate::engine::cpu::isa::tested_here(
            Isa::NeonI8mm,
            "gemm_matches_amx_tiles_and_reference",
        );
        let shapes = crate::engine::cpu::amx::TEST_SHAPES.into_iter();
        let extra = [(64, 9, 128, 201), (64, 3, 128, 13)];
        for (seed, (gs, m, k, rows)) in shapes.take(5).chain(extra).enumerate() {
            let (w, x) = crate::engine::cpu::amx::test_case(seed, gs, m, k, rows);
            let tiles = crate::engine::cpu::amx::soft_gemm(&w, &x, m);
            let mms: &[Mm] = if hw { &[Mm::Soft, Mm::Hw] } else { &[Mm::Soft] };
            for &mm in mms {
                let mut got = vec![f32::NAN; m * rows];
                // SAFETY: the kernel stores only computed f32 sums.
                run(
                    &[&w],
                    &x,
                    m,
                    &mut [unsafe { vnni::as_uninit(&mut got[..]) }],
                    mm,
                );
                crate::engine::cpu::amx::assert_within_rounding(&w, &x, m, &got);
                for (i, (a, b)) in got.iter().zip(&tiles).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "gs {gs} m {m} k {k}: element {i}");
                }
            }
            if isa::active() == Isa::NeonI8mm && m >= crate::engine::cpu::quant::GEMM_MIN_ROWS {
                let mut via = vec![f32::NAN; m * rows];
                let fast = crate::engine::quant::Numerics::Fast;
                crate::engine::cpu::quant::qmatmul(&w, &x, m, &mut via, fast);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&via),
                    bits(&tiles),
                    "qmatmul's fast prompt path is this GEMM"
                );
                let ws = [&w, &w];
                let shared = vnni::shared_outputs(&ws, m, |o| qgemm_shared(&ws, &x, m, o));
                assert!(
                    shared.iter().all(|y| bits(y) == bits(&tiles)),
                    "shared inputs"
                );
            }
        }
    }
}
