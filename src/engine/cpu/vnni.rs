//! The 4-bit integer decode kernel of `quant.rs` (`Numerics::Fast` and `Int8`) on VNNI's
//! `vpdpbusd` (unsigned 8-bit times signed 8-bit, four products a lane summed into i32 in one
//! instruction, where AVX2 needs `maddubs` then `madd`): AVX-512 (Ice Lake and later Xeons,
//! Zen 4 and 5) on 64 bytes of codes, four 32-value blocks, a step; AVX-VNNI (Alder Lake and
//! later desktop parts) on 32 bytes. The integer sums are exactly `int_row_scalar`'s (the
//! scalar definition the tests compare with); only the f32 additions are in another order.
//!
//! A call covers a range of weight rows (one rayon task's), so the constants are set up once
//! per task, not per row. A decode row (m = 1) takes the weight rows two at a time, so each
//! activation load serves both, and prefetches the task's stream ahead. Per step and weight row: the codes are split into low and high
//! nibbles (even and odd positions, as `IntActs` splits the activations); each 128-bit lane is
//! one block, whose four i32 lanes are scaled by `s_g · d_b` into f32 and accumulated. With
//! 15-bit activations (`split`) the high parts' sum is added times 128.

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

/// Activation rows that share each unpacked chunk of weights.
#[cfg(target_arch = "x86_64")]
const MR: usize = 4;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{IntActs, Rows, MR};

    #[inline(always)]
    fn bf16(b: &[u8], i: usize) -> f32 {
        f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
    }

    /// Blocks past the last whole step (widths that are not a multiple of the step): scalar,
    /// the definition itself.
    fn tail(w: &Rows, n: usize, a: &IntActs, i: usize, from_block: usize, sb: &[u8]) -> f32 {
        let (nb, gsh) = (w.shape.nb, w.shape.gshift);
        let row = &w.packed[n * w.row_bytes..(n + 1) * w.row_bytes];
        let mut y = 0f32;
        for b in from_block..nb {
            let mut isum = 0i32;
            for j in 0..32 {
                let byte = row[b * 16 + j / 2];
                let q = if j % 2 == 0 { byte & 15 } else { byte >> 4 };
                isum += q as i32 * a.code(i, b, j);
            }
            y += bf16(sb, b >> gsh) * a.d[i * nb + b] * isum as f32;
        }
        y
    }

    /// 16-bit lane `p` of the scale vector takes scale `(p / 8) >> gshift` of the step (four
    /// blocks of 8 lanes); only odd lanes (the high halves of the f32 lanes) are kept.
    const fn scale_index(gshift: usize) -> [i16; 32] {
        let mut idx = [0i16; 32];
        let mut p = 0;
        while p < 32 {
            idx[p] = ((p / 8) >> gshift) as i16;
            p += 1;
        }
        idx
    }
    /// How far ahead of the codes being read a decode task prefetches: the rows of a task are
    /// one contiguous stream, and the hardware prefetcher alone stops at each 4 KiB page
    /// (measured on a Zen 5 EPYC, 2 threads, with the pairs: 0.6B decode 68-69 -> 73-77 tok/s).
    const PFD: usize = 8192;
    const SCALE_INDEX: [[i16; 32]; 3] = [scale_index(0), scale_index(1), scale_index(2)];

    /// AVX-512 VNNI. Callers check that the CPU has avx512f/bw/vl/vnni.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub unsafe fn rows512(
        w: &Rows,
        a: &IntActs,
        first: usize,
        m: usize,
        split: bool,
        outs: &mut [f32],
    ) {
        if m == 1 {
            // a decode row: weight rows two at a time, each activation load serving both
            let mut j = 0;
            while j + 2 <= outs.len() {
                let (o0, o1) = outs[j..j + 2].split_at_mut(1);
                if split {
                    pair512::<true>(w, a, first + j, &mut o0[0], &mut o1[0]);
                } else {
                    pair512::<false>(w, a, first + j, &mut o0[0], &mut o1[0]);
                }
                j += 2;
            }
            if j < outs.len() {
                if split {
                    row512::<1, true>(w, a, first + j, 0, &mut outs[j..]);
                } else {
                    row512::<1, false>(w, a, first + j, 0, &mut outs[j..]);
                }
            }
            return;
        }
        for (j, out) in outs.chunks_exact_mut(m).enumerate() {
            let mut i = 0;
            while i < m {
                let take = (m - i).min(MR);
                let o = &mut out[i..i + take];
                match (take, split) {
                    (4, true) => row512::<4, true>(w, a, first + j, i, o),
                    (4, false) => row512::<4, false>(w, a, first + j, i, o),
                    (_, true) => (0..take)
                        .for_each(|r| row512::<1, true>(w, a, first + j, i + r, &mut o[r..])),
                    (_, false) => (0..take)
                        .for_each(|r| row512::<1, false>(w, a, first + j, i + r, &mut o[r..])),
                }
                i += take;
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    unsafe fn row512<const R: usize, const SPLIT: bool>(
        w: &Rows,
        a: &IntActs,
        n: usize,
        i0: usize,
        out: &mut [f32],
    ) {
        let (k, nb, gsh, gpr) = (a.k, w.shape.nb, w.shape.gshift, w.shape.gpr);
        let sb = &w.scales[2 * n * gpr..2 * (n + 1) * gpr];
        let bb = &w.biases[2 * n * gpr..2 * (n + 1) * gpr];
        let rp = w.packed.as_ptr().add(n * w.row_bytes);
        let sp = sb.as_ptr() as *const i16;
        let quads = nb & !3;
        let mask = _mm512_set1_epi8(0x0f);
        let idx = _mm512_loadu_si512(SCALE_INDEX[gsh.min(2)].as_ptr() as *const _);
        // the scales one step reads: 4, 2 or 1 (groups of 32, 64, 128 and more)
        let smask: __mmask8 = [0xf, 0x3, 0x1][gsh.min(2)];
        let (el, ol) = (a.el.as_ptr(), a.ol.as_ptr());
        let (eh, oh) = (a.eh.as_ptr(), a.oh.as_ptr());
        let dx = a.dx.as_ptr();
        let zero = _mm512_setzero_si512();
        // two accumulators a row: consecutive steps do not wait on each other's FMA
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        macro_rules! step {
            ($b:expr, $p:tt) => {{
                let b = $b;
                let wv = _mm512_loadu_si512(rp.add(b * 16) as *const _);
                let lo = _mm512_and_si512(wv, mask);
                let hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), mask);
                // bf16 scales into the high halves of f32 lanes (the low halves zero): f32 values
                let raw = _mm_maskz_loadu_epi16(smask, sp.add(b >> gsh));
                let ws = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
                    0xAAAA_AAAA,
                    idx,
                    _mm512_castsi128_si512(raw),
                ));
                for r in 0..R {
                    let off = (i0 + r) * k / 2 + b * 16;
                    let mut s32 =
                        _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(el.add(off) as *const _));
                    s32 = _mm512_dpbusd_epi32(s32, hi, _mm512_loadu_si512(ol.add(off) as *const _));
                    if SPLIT {
                        let h = _mm512_dpbusd_epi32(
                            zero,
                            lo,
                            _mm512_loadu_si512(eh.add(off) as *const _),
                        );
                        let h =
                            _mm512_dpbusd_epi32(h, hi, _mm512_loadu_si512(oh.add(off) as *const _));
                        s32 = _mm512_add_epi32(s32, _mm512_slli_epi32(h, 7));
                    }
                    let dxv = _mm512_loadu_ps(dx.add(4 * ((i0 + r) * nb + b)));
                    acc[r][$p] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(s32),
                        _mm512_mul_ps(ws, dxv),
                        acc[r][$p],
                    );
                }
            }};
        }
        let mut b = 0;
        while b + 8 <= quads {
            step!(b, 0);
            step!(b + 4, 1);
            b += 8;
        }
        if b < quads {
            step!(b, 0);
        }
        // Σ_g b_g · Σx_g, sixteen groups a step (masked loads read nothing past the row)
        let bp = bb.as_ptr() as *const i16;
        for r in 0..R {
            let gs = a.gsum.as_ptr().add((i0 + r) * gpr);
            let mut bv = _mm512_add_ps(acc[r][0], acc[r][1]);
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
            if quads < nb {
                y += tail(w, n, a, i0 + r, quads, sb);
            }
            out[r] = y;
        }
    }

    /// Two consecutive weight rows against activation row 0: each activation load serves both.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn pair512<const SPLIT: bool>(
        w: &Rows,
        a: &IntActs,
        n: usize,
        out0: &mut f32,
        out1: &mut f32,
    ) {
        let (nb, gsh, gpr) = (w.shape.nb, w.shape.gshift, w.shape.gpr);
        let quads = nb & !3;
        let mask = _mm512_set1_epi8(0x0f);
        let idx = _mm512_loadu_si512(SCALE_INDEX[gsh.min(2)].as_ptr() as *const _);
        let smask: __mmask8 = [0xf, 0x3, 0x1][gsh.min(2)];
        let (el, ol) = (a.el.as_ptr(), a.ol.as_ptr());
        let (eh, oh) = (a.eh.as_ptr(), a.oh.as_ptr());
        let dx = a.dx.as_ptr();
        let zero = _mm512_setzero_si512();
        let rp = [
            w.packed.as_ptr().add(n * w.row_bytes),
            w.packed.as_ptr().add((n + 1) * w.row_bytes),
        ];
        let s16 = w.scales.as_ptr() as *const i16;
        let sp = [s16.add(n * gpr), s16.add((n + 1) * gpr)];
        // per row two accumulators, alternate steps: the f32 sums of `row512::<1, _>` exactly,
        // so a row gives the same bits whether it ran in a pair or alone
        let mut acc = [[_mm512_setzero_ps(); 2]; 2];
        macro_rules! step {
            ($b:expr, $p:tt) => {{
                let b = $b;
                let off = b * 16;
                let xel = _mm512_loadu_si512(el.add(off) as *const _);
                let xol = _mm512_loadu_si512(ol.add(off) as *const _);
                let (xeh, xoh) = if SPLIT {
                    (
                        _mm512_loadu_si512(eh.add(off) as *const _),
                        _mm512_loadu_si512(oh.add(off) as *const _),
                    )
                } else {
                    (zero, zero)
                };
                let dxv = _mm512_loadu_ps(dx.add(4 * b));
                for r in 0..2 {
                    // a hint: an address past the matrix does not fault
                    _mm_prefetch::<_MM_HINT_T0>(rp[r].wrapping_add(b * 16 + PFD) as *const i8);
                    let wv = _mm512_loadu_si512(rp[r].add(b * 16) as *const _);
                    let lo = _mm512_and_si512(wv, mask);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), mask);
                    let raw = _mm_maskz_loadu_epi16(smask, sp[r].add(b >> gsh));
                    let ws = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
                        0xAAAA_AAAA,
                        idx,
                        _mm512_castsi128_si512(raw),
                    ));
                    let mut s32 = _mm512_dpbusd_epi32(zero, lo, xel);
                    s32 = _mm512_dpbusd_epi32(s32, hi, xol);
                    if SPLIT {
                        let h = _mm512_dpbusd_epi32(zero, lo, xeh);
                        let h = _mm512_dpbusd_epi32(h, hi, xoh);
                        s32 = _mm512_add_epi32(s32, _mm512_slli_epi32(h, 7));
                    }
                    acc[r][$p] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(s32),
                        _mm512_mul_ps(ws, dxv),
                        acc[r][$p],
                    );
                }
            }};
        }
        let mut b = 0;
        while b + 8 <= quads {
            step!(b, 0);
            step!(b + 4, 1);
            b += 8;
        }
        if b < quads {
            step!(b, 0);
        }
        for (r, out) in [out0, out1].into_iter().enumerate() {
            let nn = n + r;
            let sb = &w.scales[2 * nn * gpr..2 * (nn + 1) * gpr];
            let bp = w.biases.as_ptr().add(2 * nn * gpr) as *const i16;
            let gs = a.gsum.as_ptr();
            let mut bv = _mm512_add_ps(acc[r][0], acc[r][1]);
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
            if quads < nb {
                y += tail(w, nn, a, 0, quads, sb);
            }
            *out = y;
        }
    }

    /// AVX-VNNI (the VEX-encoded 256-bit `vpdpbusd`). Callers check avxvnni, avx2 and fma.
    #[target_feature(enable = "avxvnni,avx2,fma")]
    pub unsafe fn rows256(
        w: &Rows,
        a: &IntActs,
        first: usize,
        m: usize,
        split: bool,
        outs: &mut [f32],
    ) {
        for (j, out) in outs.chunks_exact_mut(m).enumerate() {
            let mut i = 0;
            while i < m {
                let take = (m - i).min(MR);
                let o = &mut out[i..i + take];
                match (take, split) {
                    (4, true) => row256::<4, true>(w, a, first + j, i, o),
                    (4, false) => row256::<4, false>(w, a, first + j, i, o),
                    (_, true) => (0..take)
                        .for_each(|r| row256::<1, true>(w, a, first + j, i + r, &mut o[r..])),
                    (_, false) => (0..take)
                        .for_each(|r| row256::<1, false>(w, a, first + j, i + r, &mut o[r..])),
                }
                i += take;
            }
        }
    }

    #[target_feature(enable = "avxvnni,avx2,fma")]
    #[inline]
    unsafe fn row256<const R: usize, const SPLIT: bool>(
        w: &Rows,
        a: &IntActs,
        n: usize,
        i0: usize,
        out: &mut [f32],
    ) {
        let (k, nb, gsh, gpr) = (a.k, w.shape.nb, w.shape.gshift, w.shape.gpr);
        let sb = &w.scales[2 * n * gpr..2 * (n + 1) * gpr];
        let bb = &w.biases[2 * n * gpr..2 * (n + 1) * gpr];
        let rp = w.packed.as_ptr().add(n * w.row_bytes);
        let paired = nb & !1;
        let mask = _mm256_set1_epi8(0x0f);
        let (el, ol) = (a.el.as_ptr(), a.ol.as_ptr());
        let (eh, oh) = (a.eh.as_ptr(), a.oh.as_ptr());
        let dx = a.dx.as_ptr();
        let zero = _mm256_setzero_si256();
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        macro_rules! step {
            ($b:expr, $p:tt) => {{
                let b = $b;
                let wv = _mm256_loadu_si256(rp.add(b * 16) as *const __m256i);
                let lo = _mm256_and_si256(wv, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask);
                let ws = if gsh > 0 {
                    _mm256_set1_ps(bf16(sb, b >> gsh))
                } else {
                    _mm256_set_m128(_mm_set1_ps(bf16(sb, b + 1)), _mm_set1_ps(bf16(sb, b)))
                };
                for r in 0..R {
                    let off = (i0 + r) * k / 2 + b * 16;
                    let ld = |p: *const i8| _mm256_loadu_si256(p.add(off) as *const __m256i);
                    let mut s32 = _mm256_dpbusd_avx_epi32(zero, lo, ld(el));
                    s32 = _mm256_dpbusd_avx_epi32(s32, hi, ld(ol));
                    if SPLIT {
                        let h = _mm256_dpbusd_avx_epi32(zero, lo, ld(eh));
                        let h = _mm256_dpbusd_avx_epi32(h, hi, ld(oh));
                        s32 = _mm256_add_epi32(s32, _mm256_slli_epi32(h, 7));
                    }
                    let dxv = _mm256_loadu_ps(dx.add(4 * ((i0 + r) * nb + b)));
                    acc[r][$p] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(s32),
                        _mm256_mul_ps(ws, dxv),
                        acc[r][$p],
                    );
                }
            }};
        }
        let mut b = 0;
        while b + 4 <= paired {
            step!(b, 0);
            step!(b + 2, 1);
            b += 4;
        }
        if b < paired {
            step!(b, 0);
        }
        let bp = bb.as_ptr();
        for r in 0..R {
            let gs = a.gsum.as_ptr().add((i0 + r) * gpr);
            let mut v = _mm256_add_ps(acc[r][0], acc[r][1]);
            let mut g = 0;
            while g + 8 <= gpr {
                let bias = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(bp.add(2 * g) as *const __m128i)),
                    16,
                ));
                v = _mm256_fmadd_ps(bias, _mm256_loadu_ps(gs.add(g)), v);
                g += 8;
            }
            let mut y = (g..gpr).map(|g| bf16(bb, g) * *gs.add(g)).sum::<f32>();
            if paired < nb {
                y += tail(w, n, a, i0 + r, paired, sb);
            }
            let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
            out[r] = _mm_cvtss_f32(h) + y;
        }
    }
}

/// The kernel of `isa` (`Avx512Vnni` or `AvxVnni`) over one task's weight rows.
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
        super::isa::Isa::Avx512Vnni => return x86::rows512(w, a, first, m, split, outs),
        super::isa::Isa::AvxVnni => return x86::rows256(w, a, first, m, split, outs),
        _ => {}
    }
    unreachable!("the VNNI kernels run only where the CPU has VNNI")
}
