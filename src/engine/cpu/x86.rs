//! The 4-bit integer decode kernel of `quant.rs` (`Numerics::Fast` and `Int8`) on x86-64: AVX2
//! (two 32-value blocks a step: `maddubs` then `madd` on 8-bit activations, `madd` on whole
//! 16-bit ones with 15-bit activations), and VNNI's `vpdpbusd` (unsigned 8-bit
//! times signed 8-bit, four products a lane summed into i32 in one instruction): AVX-512 (Ice
//! Lake and later Xeons, Zen 4 and 5) on 64 bytes of codes, four blocks, a step; AVX-VNNI (Alder
//! Lake and later desktop parts) on 32 bytes. The integer sums are exactly `int_row_scalar`'s
//! (the scalar definition the tests compare with); only the f32 additions are in another order.
//!
//! A call covers a range of weight rows (one rayon task's), so the constants are set up once
//! per task, not per row. A decode row (m = 1) takes the weight rows two at a time, one from each
//! half of the task, so each activation load serves both, and prefetches both streams ahead
//! (AVX2, AVX-VNNI and AVX-512 alike: one macro writes the three). Per step and weight row: the codes are split into low and high
//! nibbles (even and odd positions, as `IntActs` splits the activations); each 128-bit lane is
//! one block, whose four i32 lanes are scaled by `s_g · d_b` into f32 and accumulated. With
//! 15-bit activations (`split`) the VNNI kernels add the high parts' sum times 128; AVX2 takes
//! four codes out of each 16-bit word instead (`Step256`).

use super::quant::{IntActs, RowShape};

/// The weight rows `first..first + outs.len() / m` against activation rows `0..m`, written as
/// `outs[j * m + i]`; `packed`, `scales`, `biases` are the whole matrix (bf16 scales/biases).
pub struct Rows<'a> {
    pub packed: &'a [u8],
    pub row_bytes: usize,
    pub scales: &'a [u8],
    pub biases: &'a [u8],
    pub shape: &'a RowShape,
}

#[cfg(target_arch = "x86_64")]
impl Rows<'_> {
    /// Weight row `n`'s codes, bf16 scales and bf16 biases.
    fn row(&self, n: usize) -> &[u8] {
        &self.packed[n * self.row_bytes..(n + 1) * self.row_bytes]
    }
    fn row_scales(&self, n: usize) -> &[u8] {
        let g = self.shape.gpr;
        &self.scales[2 * n * g..2 * (n + 1) * g]
    }
    fn row_biases(&self, n: usize) -> &[u8] {
        let g = self.shape.gpr;
        &self.biases[2 * n * g..2 * (n + 1) * g]
    }
}

/// Activation rows that share each unpacked chunk of weights.
#[cfg(target_arch = "x86_64")]
const MR: usize = 4;

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{IntActs, Rows, MR};
    use crate::engine::cpu::quant::{bf16_at, tail_blocks};

    /// Every weight row of a task against its activation rows, up to `MR` at a time, through
    /// `$row::<R, SPLIT, G>(w, a, n, i0, out)`.
    macro_rules! each_row {
        ($row:ident, $w:expr, $a:expr, $first:expr, $m:expr, $outs:expr) => {{
            let (w, a, first, m) = ($w, $a, $first, $m);
            for (j, out) in $outs.chunks_exact_mut(m).enumerate() {
                let mut i = 0;
                while i < m {
                    let take = (m - i).min(MR);
                    let o = &mut out[i..i + take];
                    if take == 4 {
                        $row::<4, SPLIT, G>(w, a, first + j, i, o);
                    } else {
                        (0..take)
                            .for_each(|r| $row::<1, SPLIT, G>(w, a, first + j, i + r, &mut o[r..]));
                    }
                    i += take;
                }
            }
        }};
    }

    /// `$task::<SPLIT, G>(w, a, first, m, outs)` with the activation width and the group
    /// size (`G` = log2(group size / 32): 0, 1 or 2, as the config allows) as constants, so
    /// the steps find their scale by a fixed shift and take no branch on it.
    macro_rules! dispatch {
        ($task:ident, $w:expr, $a:expr, $first:expr, $m:expr, $split:expr, $outs:expr) => {{
            let (w, a, first, m, outs) = ($w, $a, $first, $m, $outs);
            match ($split, w.shape.gshift) {
                (true, 0) => $task::<true, 0>(w, a, first, m, outs),
                (true, 1) => $task::<true, 1>(w, a, first, m, outs),
                (true, 2) => $task::<true, 2>(w, a, first, m, outs),
                (false, 0) => $task::<false, 0>(w, a, first, m, outs),
                (false, 1) => $task::<false, 1>(w, a, first, m, outs),
                (false, 2) => $task::<false, 2>(w, a, first, m, outs),
                // `quant::int_ok` sends no other group size here
                (_, g) => {
                    unreachable!("integer kernels take groups of 32, 64 or 128, not 32 << {g}")
                }
            }
        }};
    }

    /// `$step!(b, p)` over the steps `0, $w, 2·$w, …` below `$n`, `p` alternating 0 and 1: two
    /// accumulators, so consecutive steps do not wait on each other's FMA (a kernel that keeps
    /// one, `CHAINS` = 1, takes accumulator 0 for both).
    macro_rules! alternate {
        ($n:expr, $w:expr, $step:ident) => {{
            let (n, w) = ($n, $w);
            let mut b = 0;
            while b + 2 * w <= n {
                $step!(b, 0);
                $step!(b + w, 1);
                b += 2 * w;
            }
            if b < n {
                $step!(b, 0);
            }
        }};
    }

    /// 16-bit lane `p` of the scale vector: odd lanes (the high halves of the f32 lanes) take
    /// scale `(p / 8) >> gshift` of the step (four blocks of 8 lanes), even ones word 7, which
    /// the step's masked load of at most four scales leaves zero: one `vpermw` makes the f32
    /// values (a zero-masked one compiled to `vpermw` and `vpandq`).
    const fn scale_index(gshift: usize) -> [i16; 32] {
        let mut idx = [0i16; 32];
        let mut p = 0;
        while p < 32 {
            idx[p] = if p % 2 == 1 {
                ((p / 8) >> gshift) as i16
            } else {
                7
            };
            p += 1;
        }
        idx
    }
    /// How far ahead of the codes being read a decode pair prefetches, in each of its two
    /// streams. The hardware prefetchers follow each stream too (it reads rows front to back,
    /// see `$pair` in `decode_kernels!`); the hint covers their restart at each 4 KiB page. The
    /// hint is T1, to L2: an L1 hint holds one of the core's few L1 fill buffers until the
    /// line arrives, which on the Xeon (Emerald Rapids, 2 threads) capped the stream (0.6B
    /// decode, T0 beside T1 at the same time: 48.4 / 51.9, 44.1 / 50.7 tok/s); AMD's cores
    /// treat the hints alike (Zen 1: 27.1 / 27.0). 4 KiB: with the two sequential streams,
    /// alternating distances per token in one `bot bench` (Zen 5 EPYC and the Xeon, 2 threads),
    /// 8 KiB took 2-8% more time a step, 16 KiB 5-15% more, 2 KiB 12% more in the Zen 5's fast
    /// minutes at the 8B shape (docs/performance.md, eighteenth session). (With the pairs of
    /// adjacent rows before, 16 KiB had been the best distance.)
    const PFD: usize = 4096;
    const SCALE_INDEX: [[i16; 32]; 3] = [scale_index(0), scale_index(1), scale_index(2)];

    /// The constants of an AVX-512 step (four 32-value blocks), set up once per row.
    struct Step512 {
        mask: __m512i,
        idx: __m512i,
        /// The scales one step reads: 4, 2 or 1 (groups of 32, 64, 128 and more).
        smask: __mmask8,
        zero: __m512i,
    }

    impl Step512 {
        /// Accumulators a weight row keeps (`alternate!`): 32 registers leave room for two.
        const CHAINS: usize = 2;

        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
        #[inline]
        unsafe fn new<const G: usize>() -> Self {
            Step512 {
                mask: _mm512_set1_epi8(0x0f),
                idx: _mm512_loadu_si512(SCALE_INDEX[G].as_ptr() as *const _),
                smask: [0xf, 0x3, 0x1][G],
                zero: _mm512_setzero_si512(),
            }
        }

        /// Activation row `i`'s code halves at block `b` (even/odd low parts, then the high
        /// parts with `SPLIT`, else zero) and its four blocks' scales `d`, one per i32 lane.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
        #[inline]
        unsafe fn acts<const SPLIT: bool>(
            &self,
            a: &IntActs,
            i: usize,
            b: usize,
        ) -> ([__m512i; 4], __m512) {
            let off = i * a.k / 2 + b * 16;
            let ld = |v: &Vec<i8>| _mm512_loadu_si512(v.as_ptr().add(off) as *const _);
            let x = if SPLIT {
                [ld(&a.el), ld(&a.ol), ld(&a.eh), ld(&a.oh)]
            } else {
                [ld(&a.el), ld(&a.ol), self.zero, self.zero]
            };
            (
                x,
                _mm512_loadu_ps(a.dx.as_ptr().add(4 * (i * a.k / 32 + b))),
            )
        }

        /// `acc + Σ_block s_g·d_b·Σ q·x` over the four blocks at `b` of the row whose codes
        /// start at `rp` and bf16 scales at `sp`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
        #[inline]
        unsafe fn block<const SPLIT: bool, const G: usize>(
            &self,
            rp: *const u8,
            sp: *const i16,
            b: usize,
            (x, dxv): &([__m512i; 4], __m512),
            acc: __m512,
        ) -> __m512 {
            let wv = _mm512_loadu_si512(rp.add(b * 16) as *const _);
            let lo = _mm512_and_si512(wv, self.mask);
            let hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), self.mask);
            // bf16 scales into the high halves of f32 lanes (the low halves zero): f32 values
            let raw = _mm_maskz_loadu_epi16(self.smask, sp.add(b >> G));
            let ws = _mm512_castsi512_ps(_mm512_permutexvar_epi16(
                self.idx,
                _mm512_zextsi128_si512(raw),
            ));
            // with `SPLIT` the low parts' products accumulate onto the high parts' sum times
            // 128 (the same i32 sum as adding the two, one instruction fewer)
            let base = match SPLIT {
                true => {
                    let h = _mm512_dpbusd_epi32(self.zero, lo, x[2]);
                    _mm512_slli_epi32(_mm512_dpbusd_epi32(h, hi, x[3]), 7)
                }
                false => self.zero,
            };
            let s32 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(base, lo, x[0]), hi, x[1]);
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32), _mm512_mul_ps(ws, *dxv), acc)
        }

        /// Weight row `n`'s output for activation row `i`: the two accumulators, `Σ_g b_g ·
        /// Σx_g` sixteen groups at a time (masked loads read nothing past the row), reduced,
        /// plus the blocks past the last whole step.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
        #[inline]
        unsafe fn finish<const G: usize>(
            &self,
            w: &Rows,
            a: &IntActs,
            n: usize,
            i: usize,
            acc: [__m512; 2],
        ) -> f32 {
            let (nb, gpr) = (w.shape.nb, w.shape.gpr);
            let bp = w.biases.as_ptr().add(2 * n * gpr) as *const i16;
            let gs = a.gsum.as_ptr().add(i * gpr);
            let mut bv = _mm512_add_ps(acc[0], acc[1]);
            let mut g = 0;
            while g < gpr {
                let m16: __mmask16 = if gpr - g >= 16 {
                    0xffff
                } else {
                    ((1u32 << (gpr - g)) - 1) as u16
                };
                let bias = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m16, bp.add(g))),
                    16,
                ));
                bv = _mm512_fmadd_ps(bias, _mm512_maskz_loadu_ps(m16, gs.add(g)), bv);
                g += 16;
            }
            let mut y = _mm512_reduce_add_ps(bv);
            let quads = nb & !3;
            if quads < nb {
                y += tail_blocks(w.row(n), w.row_scales(n), G, a, i, quads..nb);
            }
            y
        }
    }

    /// The constants of an AVX2 step (two 32-value blocks, 32 bytes of codes), set up once per
    /// row. 8-bit activations: per block, `maddubs` multiplies the unsigned codes by the signed
    /// activations into i16 pairs and `madd` sums those into i32 lanes. 15-bit activations
    /// (`SPLIT`): the codes are taken out of each 16-bit word of the row by masks and shifts
    /// (four codes a word) and `madd` multiplies them with the whole i16 activations (`w16`):
    /// four 16-bit multiplies per 64 weights where the two 8-bit halves took six `maddubs` and
    /// `madd`. On a Zen 1 EPYC (one 128-bit integer multiply pipe) a decode matvec of 3072x1024
    /// went from 8.0-8.2 to 8.7-9.2 G weights/s on one core; other CPUs not measured.
    struct Step256 {
        mask: __m256i,
        mask16: __m256i,
        ones: __m256i,
        zero: __m256i,
    }

    impl Step256 {
        /// One accumulator a weight row: with two, the pair kernel's 16 registers spilled one
        /// to the stack every step; the two rows of a pair are already two FMA chains (Zen 1
        /// EPYC, one core, 3072x1024 and 1024x3072 at m = 1: +2-4%).
        const CHAINS: usize = 1;

        /// (`G` is the kernels' shared signature: only AVX-512's scale gather needs it here.)
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        unsafe fn new<const G: usize>() -> Self {
            Step256 {
                mask: _mm256_set1_epi8(0x0f),
                mask16: _mm256_set1_epi16(0x0f),
                ones: _mm256_set1_epi16(1),
                zero: _mm256_setzero_si256(),
            }
        }

        /// Activation row `i`'s code halves at block `b` (even/odd low parts, then the high
        /// parts with `SPLIT`, else zero) and its two blocks' scales `d`, four lanes each.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        unsafe fn acts<const SPLIT: bool>(
            &self,
            a: &IntActs,
            i: usize,
            b: usize,
        ) -> ([__m256i; 4], __m256) {
            let x = if SPLIT {
                let p = a.w16.as_ptr().add(i * a.k16() + b * 32) as *const __m256i;
                [0, 1, 2, 3].map(|t| _mm256_loadu_si256(p.add(t)))
            } else {
                let off = i * a.k / 2 + b * 16;
                let ld = |v: &Vec<i8>| _mm256_loadu_si256(v.as_ptr().add(off) as *const __m256i);
                [ld(&a.el), ld(&a.ol), self.zero, self.zero]
            };
            (
                x,
                _mm256_loadu_ps(a.dx.as_ptr().add(4 * (i * a.k / 32 + b))),
            )
        }

        /// `acc + Σ_block s_g·d_b·Σ q·x` over the two blocks at `b` of the row whose codes
        /// start at `rp` and bf16 scales at `sp`.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        unsafe fn block<const SPLIT: bool, const G: usize>(
            &self,
            rp: *const u8,
            sp: *const i16,
            b: usize,
            (x, dxv): &([__m256i; 4], __m256),
            acc: __m256,
        ) -> __m256 {
            let wv = _mm256_loadu_si256(rp.add(b * 16) as *const __m256i);
            let scale = |g: usize| f32::from_bits((sp.add(g).read_unaligned() as u16 as u32) << 16);
            // groups of 64 and more share one scale across the pair of blocks
            let ws = if G > 0 {
                // every 16-bit lane the bf16, then each 32-bit lane shifted: the f32 in two
                // instructions (a scalar load, shift and broadcast took four)
                let h = _mm256_set1_epi16(sp.add(b >> G).read_unaligned());
                _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
            } else {
                _mm256_set_m128(_mm_set1_ps(scale(b + 1)), _mm_set1_ps(scale(b)))
            };
            let s32 = if SPLIT {
                // word lane j of the block holds codes 4j (bits 0..4) to 4j + 3 (bits 12..16)
                let c0 = _mm256_and_si256(wv, self.mask16);
                let c1 = _mm256_and_si256(_mm256_srli_epi16(wv, 4), self.mask16);
                let c2 = _mm256_and_si256(_mm256_srli_epi16(wv, 8), self.mask16);
                let c3 = _mm256_srli_epi16(wv, 12);
                _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_madd_epi16(c0, x[0]), _mm256_madd_epi16(c1, x[1])),
                    _mm256_add_epi32(_mm256_madd_epi16(c2, x[2]), _mm256_madd_epi16(c3, x[3])),
                )
            } else {
                let lo = _mm256_and_si256(wv, self.mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), self.mask);
                let pl = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, x[0]),
                    _mm256_maddubs_epi16(hi, x[1]),
                );
                _mm256_madd_epi16(pl, self.ones)
            };
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(ws, *dxv), acc)
        }

        /// Weight row `n`'s output for activation row `i`: its accumulator(s), `Σ_g b_g ·
        /// Σx_g` eight groups at a time, reduced, plus an odd trailing block.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        unsafe fn finish<const G: usize>(
            &self,
            w: &Rows,
            a: &IntActs,
            n: usize,
            i: usize,
            acc: [__m256; 2],
        ) -> f32 {
            finish256::<G>(w, a, n, i, acc)
        }
    }

    /// A decode entry `$rows` over one task's weight rows, its row kernel `$row` (one weight row
    /// against activation rows `i0..i0 + R`) and its pair kernel `$pair` (two weight rows
    /// against activation row 0, each activation load serving both, the codes prefetched `PFD`
    /// ahead with one hint per 64 bytes), compiled for `$feat`, on steps of
    /// `$w` blocks of the step type `$step`. The f32 sums of a pair are the row kernel's
    /// exactly: a row gives the same bits in a pair or alone. (`$d` is a literal `$`, for the
    /// metavariables of the `step!` macros defined inside.)
    macro_rules! decode_kernels {
        ($d:tt $feat:literal, $step:ident, $w:literal, $zero:expr, $rows:ident, $row:ident, $pair:ident) => {
            #[target_feature(enable = $feat)]
            pub unsafe fn $rows(
                w: &Rows,
                a: &IntActs,
                first: usize,
                m: usize,
                split: bool,
                outs: &mut [f32],
            ) {
                dispatch!(task, w, a, first, m, split, outs);

                #[target_feature(enable = $feat)]
                unsafe fn task<const SPLIT: bool, const G: usize>(
                    w: &Rows,
                    a: &IntActs,
                    first: usize,
                    m: usize,
                    outs: &mut [f32],
                ) {
                    if m > 1 {
                        each_row!($row, w, a, first, m, outs);
                        return;
                    }
                    // Row `i` of the task's first half is paired with row `i` of its second,
                    // so each of a pair's two streams walks its half's rows in memory order,
                    // one contiguous run, which the hardware prefetchers follow. Pairs of
                    // adjacent rows jump a row at every pair in both streams; where two
                    // threads shared less bandwidth than they can draw (this project's Zen 5
                    // EPYC in its slow minutes, where a plain read loop on 2 threads gets
                    // ~48 GB/s), they streamed ~37 GB/s and these ~45 (8B step 110 -> 91
                    // ms), and the Xeon's 0.6B step took 10-12% less.
                    let h = outs.len() / 2;
                    let (lo, hi) = outs.split_at_mut(h);
                    for (i, (o0, o1)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
                        $pair::<SPLIT, G>(w, a, first + i, first + h + i, o0, o1);
                    }
                    if 2 * h < outs.len() {
                        $row::<1, SPLIT, G>(w, a, first + 2 * h, 0, &mut outs[2 * h..]);
                    }
                }
            }

            #[target_feature(enable = $feat)]
            #[inline]
            unsafe fn $row<const R: usize, const SPLIT: bool, const G: usize>(
                w: &Rows,
                a: &IntActs,
                n: usize,
                i0: usize,
                out: &mut [f32],
            ) {
                let c = $step::new::<G>();
                let (rp, sp) = (w.row(n).as_ptr(), w.row_scales(n).as_ptr() as *const i16);
                let mut acc = [[$zero; 2]; R];
                macro_rules! step {
                    ($d b:expr, $d p:tt) => {
                        for r in 0..R {
                            let x = c.acts::<SPLIT>(a, i0 + r, $d b);
                            let p = usize::min($d p, $step::CHAINS - 1);
                            acc[r][p] = c.block::<SPLIT, G>(rp, sp, $d b, &x, acc[r][p]);
                        }
                    };
                }
                alternate!(w.shape.nb / $w * $w, $w, step);
                for r in 0..R {
                    out[r] = c.finish::<G>(w, a, n, i0 + r, acc[r]);
                }
            }

            #[target_feature(enable = $feat)]
            unsafe fn $pair<const SPLIT: bool, const G: usize>(
                w: &Rows,
                a: &IntActs,
                n: usize,
                n1: usize,
                out0: &mut f32,
                out1: &mut f32,
            ) {
                let c = $step::new::<G>();
                let rp = [w.row(n).as_ptr(), w.row(n1).as_ptr()];
                let sp = [
                    w.row_scales(n).as_ptr() as *const i16,
                    w.row_scales(n1).as_ptr() as *const i16,
                ];
                let mut acc = [[$zero; 2]; 2];
                // the scales and biases are four more streams, 1/16 of the codes' bytes each:
                // two rows' `PFD` ahead of each stream's, so they are not missed at every 4 KiB
                // page either
                let (g2, ahead) = (2 * w.shape.gpr, (PFD / w.row_bytes).max(2));
                for r in [n, n1] {
                    let mut off = (r + ahead) * g2;
                    while off < (r + ahead + 2) * g2 {
                        // hints: an address past the matrix does not fault
                        _mm_prefetch::<_MM_HINT_T1>(
                            w.scales.as_ptr().wrapping_add(off) as *const i8
                        );
                        _mm_prefetch::<_MM_HINT_T1>(
                            w.biases.as_ptr().wrapping_add(off) as *const i8
                        );
                        off += 64;
                    }
                }
                macro_rules! step {
                    ($d b:expr, $d p:tt) => {{
                        let x = c.acts::<SPLIT>(a, 0, $d b);
                        let p = usize::min($d p, $step::CHAINS - 1);
                        for r in 0..2 {
                            if $d b % 4 == 0 {
                                // a hint: an address past the matrix does not fault
                                _mm_prefetch::<_MM_HINT_T1>(
                                    rp[r].wrapping_add($d b * 16 + PFD) as *const i8,
                                );
                            }
                            acc[r][p] = c.block::<SPLIT, G>(rp[r], sp[r], $d b, &x, acc[r][p]);
                        }
                    }};
                }
                alternate!(w.shape.nb / $w * $w, $w, step);
                *out0 = c.finish::<G>(w, a, n, 0, acc[0]);
                *out1 = c.finish::<G>(w, a, n1, 0, acc[1]);
            }
        };
    }

    // AVX2 + FMA; callers check that the CPU has both.
    decode_kernels!($ "avx2,fma", Step256, 2, _mm256_setzero_ps(), rows_avx2, row_avx2, pair_avx2);
    // AVX-512 VNNI; callers check that the CPU has avx512f/bw/vl/vnni.
    decode_kernels!(
        $ "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma",
        Step512,
        4,
        _mm512_setzero_ps(),
        rows512,
        row512,
        pair512
    );

    /// Weight row `n`'s output for activation row `i` from a 256-bit step's two accumulators
    /// (AVX2's and AVX-VNNI's): `Σ_g b_g · Σx_g` eight groups at a time and the rest one by
    /// one, the blocks past the last whole step, then the lanes' sum.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn finish256<const G: usize>(
        w: &Rows,
        a: &IntActs,
        n: usize,
        i: usize,
        acc: [__m256; 2],
    ) -> f32 {
        let (nb, gpr) = (w.shape.nb, w.shape.gpr);
        let bb = w.row_biases(n);
        let gs = &a.gsum[i * gpr..(i + 1) * gpr];
        let mut v = _mm256_add_ps(acc[0], acc[1]);
        let mut g = 0;
        while g + 8 <= gpr {
            let bias = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128(bb.as_ptr().add(2 * g) as *const _)),
                16,
            ));
            v = _mm256_fmadd_ps(bias, _mm256_loadu_ps(gs.as_ptr().add(g)), v);
            g += 8;
        }
        let mut y = (g..gpr).map(|g| bf16_at(bb, g) * gs[g]).sum::<f32>();
        let paired = nb & !1;
        if paired < nb {
            y += tail_blocks(w.row(n), w.row_scales(n), G, a, i, paired..nb);
        }
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
        _mm_cvtss_f32(h) + y
    }

    /// The constants of an AVX-VNNI step (two 32-value blocks: the VEX-encoded 256-bit
    /// `vpdpbusd` of Alder Lake and later desktop parts), set up once per row.
    struct StepVnni256 {
        mask: __m256i,
        zero: __m256i,
    }

    impl StepVnni256 {
        const CHAINS: usize = 2;

        #[target_feature(enable = "avxvnni,avx2,fma")]
        #[inline]
        unsafe fn new<const G: usize>() -> Self {
            StepVnni256 {
                mask: _mm256_set1_epi8(0x0f),
                zero: _mm256_setzero_si256(),
            }
        }

        /// Activation row `i`'s code halves at block `b` (even/odd low parts, then the high
        /// parts with `SPLIT`, else zero) and its two blocks' scales `d`, one per i32 lane.
        #[target_feature(enable = "avxvnni,avx2,fma")]
        #[inline]
        unsafe fn acts<const SPLIT: bool>(
            &self,
            a: &IntActs,
            i: usize,
            b: usize,
        ) -> ([__m256i; 4], __m256) {
            let off = i * a.k / 2 + b * 16;
            let ld = |v: &Vec<i8>| _mm256_loadu_si256(v.as_ptr().add(off) as *const __m256i);
            let x = if SPLIT {
                [ld(&a.el), ld(&a.ol), ld(&a.eh), ld(&a.oh)]
            } else {
                [ld(&a.el), ld(&a.ol), self.zero, self.zero]
            };
            (
                x,
                _mm256_loadu_ps(a.dx.as_ptr().add(4 * (i * a.k / 32 + b))),
            )
        }

        /// `acc + Σ_block s_g·d_b·Σ q·x` over the two blocks at `b` of the row whose codes
        /// start at `rp` and bf16 scales at `sp`.
        #[target_feature(enable = "avxvnni,avx2,fma")]
        #[inline]
        unsafe fn block<const SPLIT: bool, const G: usize>(
            &self,
            rp: *const u8,
            sp: *const i16,
            b: usize,
            (x, dxv): &([__m256i; 4], __m256),
            acc: __m256,
        ) -> __m256 {
            // the scales need not be 2-byte aligned in the file (safetensors packs tensors as they come)
            let bf = |g: usize| f32::from_bits((sp.add(g).read_unaligned() as u16 as u32) << 16);
            let wv = _mm256_loadu_si256(rp.add(b * 16) as *const __m256i);
            let lo = _mm256_and_si256(wv, self.mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), self.mask);
            let ws = if G > 0 {
                _mm256_set1_ps(bf(b >> G))
            } else {
                _mm256_set_m128(_mm_set1_ps(bf(b + 1)), _mm_set1_ps(bf(b)))
            };
            // as `Step512::block`: the low parts accumulate onto the high parts' sum times 128
            let base = match SPLIT {
                true => {
                    let h = _mm256_dpbusd_avx_epi32(self.zero, lo, x[2]);
                    _mm256_slli_epi32(_mm256_dpbusd_avx_epi32(h, hi, x[3]), 7)
                }
                false => self.zero,
            };
            let s32 = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(base, lo, x[0]), hi, x[1]);
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(ws, *dxv), acc)
        }

        /// Weight row `n`'s output for activation row `i` (`finish256`).
        #[target_feature(enable = "avxvnni,avx2,fma")]
        #[inline]
        unsafe fn finish<const G: usize>(
            &self,
            w: &Rows,
            a: &IntActs,
            n: usize,
            i: usize,
            acc: [__m256; 2],
        ) -> f32 {
            finish256::<G>(w, a, n, i, acc)
        }
    }

    // AVX-VNNI; callers check avxvnni, avx2 and fma.
    decode_kernels!($ "avxvnni,avx2,fma", StepVnni256, 2, _mm256_setzero_ps(), rows256, row256, pair256);
}

/// `quant::quantize_row_scalar` on AVX2, bit for bit: the maximum is exact in any order, and
/// the product and the conversion round to nearest even (the default MXCSR), as
/// `round_ties_even` does.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `d` holds a value per 32 of `x`, `q` one per value.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_row_avx2(x: &[f32], qmax: f32, d: &mut [f32], q: &mut [i32]) {
    use std::arch::x86_64::*;
    for ((blk, db), qb) in x
        .chunks_exact(32)
        .zip(d.iter_mut())
        .zip(q.chunks_exact_mut(32))
    {
        let (dv, c) = block_codes(blk, qmax);
        *db = dv;
        for (t, &ct) in c.iter().enumerate() {
            _mm256_storeu_si256(qb.as_mut_ptr().add(8 * t) as *mut __m256i, ct);
        }
    }
}

/// One 32-value block's scale `d` and its codes, eight to a vector (`quantize_row_scalar`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn block_codes(blk: &[f32], qmax: f32) -> (f32, [std::arch::x86_64::__m256i; 4]) {
    use std::arch::x86_64::*;
    debug_assert!(blk.len() >= 32);
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let v = [0, 1, 2, 3].map(|t| _mm256_loadu_ps(blk.as_ptr().add(8 * t)));
    let m = v.map(|v| _mm256_and_ps(v, abs));
    let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
    let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    let dv = _mm_cvtss_f32(h) / qmax;
    // a zero block, or one whose scale is subnormal (1/dv would overflow): codes 0
    let inv = if dv >= f32::MIN_POSITIVE {
        1.0 / dv
    } else {
        0.0
    };
    let iv = _mm256_set1_ps(inv);
    (dv, v.map(|vt| _mm256_cvtps_epi32(_mm256_mul_ps(vt, iv))))
}

/// `IntActs`' `Halves` layout of one row straight from `x`, bit for bit what the scalar
/// split of `quantize_row_scalar`'s codes gives: per block, the even and odd positions' codes
/// as i8 (`el`, `ol`), or with `split` each code as `128·h + l` (`l = c & 127` in `el`/`ol`,
/// `h = c >> 7` in `eh`/`oh`). This runs on the leading thread before every decode matmul;
/// the scalar split took ~8 us of the 8B shape's ~30 us between two regions (Zen 4 EPYC).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `x` holds whole blocks, `d` one value per block, `el` and
/// `ol` (and with `split` `eh` and `oh`) half a value per value of `x`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn quantize_halves_avx2(
    x: &[f32],
    qmax: f32,
    split: bool,
    d: &mut [f32],
    el: &mut [i8],
    ol: &mut [i8],
    eh: &mut [i8],
    oh: &mut [i8],
) {
    use std::arch::x86_64::*;
    let nb = x.len() / 32;
    assert!(d.len() >= nb && el.len() >= 16 * nb && ol.len() >= 16 * nb);
    assert!(!split || (eh.len() >= 16 * nb && oh.len() >= 16 * nb));
    // 16 i32 values (`a` then `b`, eight each, in range for i8) as 16 i8 in that order
    let pack = |a: __m256i, b: __m256i| {
        let s = _mm256_packs_epi32(a, b); // a0..4 b0..4 | a4..8 b4..8 (i16)
        let s = _mm256_permute4x64_epi64::<0xD8>(s); // a0..8 | b0..8
        _mm_packs_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
    };
    let evens_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    let low7 = _mm256_set1_epi32(127);
    for b in 0..nb {
        let (dv, c) = block_codes(&x[32 * b..], qmax);
        d[b] = dv;
        // each vector's even positions in its low half, odd ones in its high half
        let p = c.map(|c| _mm256_permutevar8x32_epi32(c, evens_first));
        let halves = [
            (
                _mm256_permute2x128_si256::<0x20>(p[0], p[1]),
                _mm256_permute2x128_si256::<0x20>(p[2], p[3]),
            ),
            (
                _mm256_permute2x128_si256::<0x31>(p[0], p[1]),
                _mm256_permute2x128_si256::<0x31>(p[2], p[3]),
            ),
        ];
        for ((e0, e1), (lo, hi)) in halves.into_iter().zip([
            (el.as_mut_ptr(), eh.as_mut_ptr()),
            (ol.as_mut_ptr(), oh.as_mut_ptr()),
        ]) {
            let at = 16 * b;
            if split {
                let l = pack(_mm256_and_si256(e0, low7), _mm256_and_si256(e1, low7));
                let h = pack(_mm256_srai_epi32::<7>(e0), _mm256_srai_epi32::<7>(e1));
                _mm_storeu_si128(lo.add(at) as *mut __m128i, l);
                _mm_storeu_si128(hi.add(at) as *mut __m128i, h);
            } else {
                _mm_storeu_si128(lo.add(at) as *mut __m128i, pack(e0, e1));
            }
        }
    }
}

/// The kernel of `isa` (`Avx512Vnni`, `AvxVnni` or `Avx2`) over one task's weight rows.
///
/// # Safety
/// The CPU must have the instruction set (`isa.supported()`), the scales and biases must be
/// bf16, and `outs.len()` a multiple of `m` with rows `first..` inside the matrix.
#[allow(unused_variables)]
pub unsafe fn rows(
    isa: super::isa::Isa,
    w: &Rows,
    a: &IntActs,
    first: usize,
    m: usize,
    split: bool,
    outs: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        super::isa::Isa::Amx | super::isa::Isa::Avx512Vnni => {
            return simd::rows512(w, a, first, m, split, outs)
        }
        super::isa::Isa::AvxVnni => return simd::rows256(w, a, first, m, split, outs),
        super::isa::Isa::Avx2 => return simd::rows_avx2(w, a, first, m, split, outs),
        _ => {}
    }
    unreachable!("the x86 kernels run only on x86-64 CPUs with AVX2")
}
