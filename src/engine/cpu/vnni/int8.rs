//! The `int8` prompt GEMM of 4-bit weights on AVX-512 VNNI (Zen 4 and 5, Ice Lake; AMX CPUs
//! prompt on AMX's tiles, `fast`'s arithmetic): `y (m x
//! rows) = x (m x cols) @ dequant(w)^T` with the activations as 8-bit integers, one scale per 64
//! values (`vnni::quantize_to` with 127: llama.cpp's Q8 idea on `vnni.rs`'s blocks), multiplied
//! with `vpdpbusd` (16 lanes, each four products of an unsigned 4-bit code and a signed 8-bit
//! activation summed into i32): 64 multiply-adds an instruction where `fast`'s `vpdpwssd` does
//! 32, both issuing once a cycle on a Zen 4. `--kernel int8` is the user asking for that trade
//! (an error of up to max|x|/254 a value, where `fast` moves it by max|x|/32766); `fast`, the
//! default, stays on 15 bits. The slow reference is `gemm_portable` (the same integer sums and
//! f32 steps: the same bits), and `QMatrix::matmul_reference` within that rounding.
//!
//! `vnni.rs`'s GEMM (its `run_on`, `simd::tile::<true>`) with quads of values for its pairs;
//! this file holds what differs: activations `[token vector][block]
//! [quad][16 tokens]` dwords (four i8, value `4u` lowest), a panel row's block as 16 dwords of
//! four codes `4u..4u + 4` in `vnni::Panel`'s 32-dword slots (`simd::fill`), 12 rows
//! by two token vectors a register tile, and per block `vnni.rs`'s epilogue
//! `y = fma(b, Σx, fma(c·d, s, y))`, `c` exact in i32 (|c| ≤ 64 · 15 · 127), with the block's
//! sum as its codes give it, `Σx = d·Σq` (`quantized_sum` says why). Where a matrix has its
//! `tile16` copy (Intel's CPUs) the panels read their rows' whole tiles from it, as `fast`'s
//! do, so prompts do not read the model's file beside it.

use std::mem::MaybeUninit;

use super::{shape_ok, KB};
use crate::engine::cpu::isa::{self, Isa};
use crate::engine::quant::QMatrix;

/// Dwords of four values a block holds.
pub(super) const QUADS: usize = KB / 4;
/// The largest activation code: 8 bits with the sign.
pub(crate) const QMAX8: f32 = 127.0;

/// Whether `int8` prompts of `w` run here: the process's instruction set is `avx512-vnni` and
/// `w` has 4-bit codes in groups of 64 or a multiple.
pub fn usable(w: &QMatrix) -> bool {
    isa::active() == Isa::Avx512Vnni && shape_ok(w)
}

/// `y = x @ dequant(w)^T` with 8-bit activations. Callers check `usable(w)` first.
pub fn qgemm(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32]) {
    assert!(usable(w), "vnni::int8::qgemm without AVX-512 VNNI");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the kernel stores only computed f32 sums.
    run(&[w], x, m, &mut [unsafe { super::as_uninit(y) }]);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, m, y);
}

/// `qgemm` of several matrices of the same input (q|k|v, gate|up), as `vnni::qgemm_shared`:
/// callers check `usable` on each; every element of `outs` (`m x rows` each) is written.
pub fn qgemm_shared(ws: &[&QMatrix], x: &[f32], m: usize, outs: &mut [&mut [MaybeUninit<f32>]]) {
    assert!(
        ws.iter().all(|w| usable(w)),
        "vnni::int8::qgemm_shared without AVX-512 VNNI"
    );
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "vnni::int8::qgemm_shared off x86-64 ({} values, {m} rows, {} outputs)",
        x.len(),
        outs.len()
    );
    #[cfg(target_arch = "x86_64")]
    run(ws, x, m, outs);
}

/// Four codes in one dword, the first in the low byte.
#[inline(always)]
fn quad(v: &[i32]) -> i32 {
    i32::from_le_bytes([v[0] as u8, v[1] as u8, v[2] as u8, v[3] as u8])
}

/// Blocks `kbr` of token vector `j` laid out as `vnni::prepare_vector` does, in quads of 8-bit
/// codes: the definition, which `simd::prepare_vector` matches bit for bit (tested).
#[cfg_attr(not(test), allow(dead_code))]
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
    for t in 0..super::TV.min(m - j * super::TV) {
        let row = &x[(j * super::TV + t) * k..][..k];
        for (u, blk) in row[kbr.start * KB..kbr.end * KB]
            .chunks_exact(KB)
            .enumerate()
        {
            let (dt, _) = super::quantize_to(blk, &mut v, QMAX8);
            (d[u * super::TV + t], sx[u * super::TV + t]) = (dt, quantized_sum(&v, dt));
            let dst = &mut q[u * QUADS * super::TV..][..QUADS * super::TV];
            for p in 0..QUADS {
                dst[p * super::TV + t] = quad(&v[4 * p..4 * p + 4]);
            }
        }
    }
}

/// The block's sum as its codes give it, `d · Σq` (exact in i32, one rounding): the bias
/// term `b·Σx` takes this, not the exact sum, so that the rounding error is `Σ (s·q + b)·Δx`,
/// where the centred weights cancel most of it, and not `s·Σ q·Δx` with MLX's unsigned codes
/// (on the mlx_lm fixtures the exact sum left 3-4 times the logit error).
#[inline(always)]
fn quantized_sum(q: &[i32; KB], d: f32) -> f32 {
    q.iter().sum::<i32>() as f32 * d
}

/// The GEMM's arithmetic one output at a time (the slow reference): each token's blocks
/// quantized by `quantize_to(.., 127)`, `c = Σ q·code` in i32, `y = fma(b, d·Σq, fma(c·d, s, y))`
/// block after block from 0.
#[cfg(test)]
pub(crate) fn gemm_portable(w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
    let (k, rows, gs) = (w.cols, w.rows, w.params.group_size);
    let (rb, gpr) = (w.row_bytes(), w.groups_per_row());
    let (scales, biases) = (w.scales.view(), w.biases.view());
    let mut y = vec![0f32; m * rows];
    let mut v = [0i32; KB];
    for t in 0..m {
        let blocks: Vec<(f32, f32, [i32; KB])> = x[t * k..][..k]
            .chunks_exact(KB)
            .map(|blk| {
                let (d, _) = super::quantize_to(blk, &mut v, QMAX8);
                (d, quantized_sum(&v, d), v)
            })
            .collect();
        for n in 0..rows {
            let row = &w.packed[n * rb..][..rb];
            let mut acc = 0f32;
            for (kb, (d, sx, q)) in blocks.iter().enumerate() {
                let c: i32 = (0..KB)
                    .map(|i| {
                        let b = row[(kb * KB + i) / 2];
                        let code = if i % 2 == 0 { b & 15 } else { b >> 4 };
                        q[i] * code as i32
                    })
                    .sum();
                let g = n * gpr + kb * KB / gs;
                let (s, b) = (scales.get(g), biases.get(g));
                acc = b.mul_add(*sx, (c as f32 * d).mul_add(s, acc));
            }
            y[t * rows + n] = acc;
        }
    }
    y
}

/// `vnni::run_on` with 8-bit codes: the activations laid out by `simd::prepare_vector`, the
/// panels filled by `simd::fill`, `vnni::simd::tile::<true>` on each.
#[cfg(target_arch = "x86_64")]
fn run(ws: &[&QMatrix], x: &[f32], m: usize, ys: &mut [&mut [MaybeUninit<f32>]]) {
    super::run_on(Isa::Avx512Vnni, super::Codes::Quads8, ws, x, m, ys)
}

#[cfg(target_arch = "x86_64")]
pub(super) mod simd {
    use std::arch::x86_64::*;

    use super::super::simd::fill_with;
    use super::super::{Panel, KB, TV};
    use super::{QMAX8, QUADS};
    use crate::engine::cpu::vnni::{quantize16_to, transpose16};
    use crate::engine::quant::QMatrix;

    /// Rows `n0..n0 + R` of `w` into the panel as quads (`vnni::simd::fill_with`: the rows in
    /// the decode copy's whole tiles from it, the rest from the matrix; zeros past the last row).
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL.
    #[inline(always)]
    pub(in crate::engine::cpu::vnni) unsafe fn fill(p: &mut Panel, w: &QMatrix, n0: usize) {
        fill_with(
            p,
            w,
            n0,
            QUADS / 2,
            |s, d| unpack16(s, d),
            |s, d| unpack_ptr(s, d),
        );
    }

    /// 16 packed bytes (32 codes, low nibble first) as 8 dwords of code quads in order.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn unpack16(src: *const u8, dst: *mut i32) {
        // a byte b to the word b | b << 4, masked to 0x0f0f: its low nibble in the low byte,
        // its high nibble in the high one
        let b = _mm256_cvtepu8_epi16(_mm_loadu_si128(src as *const _));
        let mask = _mm256_set1_epi16(0x0f0f);
        let v = _mm256_ternarylogic_epi32::<0xA8>(b, _mm256_slli_epi16::<4>(b), mask);
        _mm256_storeu_si256(dst as *mut _, v);
    }

    /// 32 packed bytes (64 codes, low nibble first) as 64 code bytes in order, 16 dwords at
    /// `dst` (`unpack_ptr` with its bounds checked, for the tests).
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn unpack(src: &[u8], dst: &mut [i32]) {
        assert!(src.len() >= 32 && dst.len() >= QUADS);
        unpack_ptr(src.as_ptr(), dst.as_mut_ptr())
    }

    /// `unpack` from `src` (32 bytes) to `dst` (16 dwords), unchecked.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL; both ranges are inside their buffers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn unpack_ptr(src: *const u8, dst: *mut i32) {
        unpack16(src, dst);
        unpack16(src.add(16), dst.add(QUADS / 2));
    }

    /// `super::prepare_vector` in 16 lanes: each token's block quantized by `quantize16_to`
    /// (`quantize_to`'s bits), narrowed to bytes (64 of them: 16 quads), then the 16 tokens'
    /// quads transposed so that each quad is one vector of tokens.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(in crate::engine::cpu::vnni) unsafe fn prepare_vector(
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
        assert!(q.len() >= n * QUADS * TV && d.len() >= n * TV && sx.len() >= n * TV);
        for (u, kb) in kbr.enumerate() {
            let mut rows = [_mm512_setzero_ps(); 16];
            for (t, row) in rows.iter_mut().enumerate().take(tokens) {
                let p = x.as_ptr().add((j * TV + t) * k + kb * KB);
                let (codes, dt, _) = quantize16_to(p, QMAX8);
                let total = _mm512_add_epi32(
                    _mm512_add_epi32(codes[0], codes[1]),
                    _mm512_add_epi32(codes[2], codes[3]),
                );
                // `quantized_sum`: the integer sum is exact in any order
                let sum = _mm512_reduce_add_epi32(total) as f32 * dt;
                // |code| <= 127: the low byte is the code
                let v = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(codes[0]));
                let v = _mm512_inserti32x4::<1>(v, _mm512_cvtepi32_epi8(codes[1]));
                let v = _mm512_inserti32x4::<2>(v, _mm512_cvtepi32_epi8(codes[2]));
                let v = _mm512_inserti32x4::<3>(v, _mm512_cvtepi32_epi8(codes[3]));
                *row = _mm512_castsi512_ps(v);
                (d[u * TV + t], sx[u * TV + t]) = (dt, sum);
            }
            let dst = q.as_mut_ptr().add(u * QUADS * TV);
            for (p, v) in transpose16(rows).iter().enumerate() {
                _mm512_storeu_ps(dst.add(p * TV) as *mut f32, *v);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::engine::cpu::vnni::{as_uninit, layout_test_input, TV};

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    #[test]
    fn unpack_quads_nibbles() {
        if !isa::tested_here(Isa::Avx512Vnni, "unpack_quads_nibbles") {
            return;
        }
        let src: Vec<u8> = (0..32).map(|i| (i * 37 + 5) as u8).collect();
        let mut got = [0i32; QUADS];
        // SAFETY: the CPU has AVX-512; 32 bytes read, 16 dwords written.
        unsafe { simd::unpack(&src, &mut got) };
        for (u, v) in got.iter().enumerate() {
            let b = v.to_le_bytes();
            let want = [
                src[2 * u] & 15,
                src[2 * u] >> 4,
                src[2 * u + 1] & 15,
                src[2 * u + 1] >> 4,
            ];
            assert_eq!(b, want, "quad {u}");
        }
    }

    /// The AVX-512 layout pass gives the portable definition's codes, scales and sums bit for
    /// bit (a token tail, a zero block, ties, an outlier, tiny and huge magnitudes); the codes
    /// are the 8-bit rounding of each value.
    #[test]
    fn prepare_avx512_matches_portable() {
        if !isa::tested_here(Isa::Avx512Vnni, "int8::prepare_avx512_matches_portable") {
            return;
        }
        let (m, k, mut x) = layout_test_input(5);
        // a block whose 8-bit scale is subnormal (max 3e-38 / 127): codes 0 on every path
        x[3 * k + 128..3 * k + 192]
            .iter_mut()
            .for_each(|v| *v *= 1e-38);
        let kbs = k / KB;
        let mut zero_blocks = 0;
        for (j, kbr) in (0..m.div_ceil(TV)).flat_map(|j| [(j, 0..kbs), (j, 1..kbs - 1)]) {
            let n = kbr.len();
            let mut want = (
                vec![0; n * QUADS * TV],
                vec![0.0; n * TV],
                vec![0.0; n * TV],
            );
            let mut got = want.clone();
            let (w, g) = (&mut want, &mut got);
            prepare_vector(&x, m, k, j, kbr.clone(), &mut w.0, &mut w.1, &mut w.2);
            // SAFETY: the CPU has AVX-512.
            unsafe { simd::prepare_vector(&x, m, k, j, kbr.clone(), &mut g.0, &mut g.1, &mut g.2) };
            assert_eq!(got.0, want.0, "token vector {j}, blocks {kbr:?}: codes");
            assert_eq!(bits(&got.1), bits(&want.1), "vector {j}, {kbr:?}: scales");
            assert_eq!(bits(&got.2), bits(&want.2), "vector {j}, {kbr:?}: sums");
            // a finite block's codes: each value over d, rounded, within ±127
            for t in 0..TV.min(m - j * TV) {
                for (u, kb) in kbr.clone().enumerate() {
                    let dt = want.1[u * TV + t];
                    for i in 0..KB {
                        let xv = x[(j * TV + t) * k + kb * KB + i];
                        let code =
                            (want.0[(u * QUADS + i / 4) * TV + t].to_le_bytes()[i % 4]) as i8;
                        if dt >= f32::MIN_POSITIVE && dt.is_finite() {
                            assert!((xv / dt - code as f32).abs() <= 0.5 + 1e-3, "{xv} / {dt}");
                        } else {
                            assert_eq!(code, 0);
                            zero_blocks += (i == 0) as usize;
                        }
                    }
                }
            }
        }
        assert!(
            zero_blocks > 0,
            "no block with a zero or subnormal scale was checked"
        );
    }

    /// The GEMM gives the slow definition's bits (row and token tails: panels of 12 rows, token
    /// vectors of 16 in pairs and alone; groups of 64 and 128; bf16, f16 and f32 scales), the
    /// reference within what rounding x to 8 bits can move each output, the same bits on a
    /// pool of 1 or 3 threads and on a team, and `qmatmul` takes it for `int8` prompts.
    #[test]
    fn gemm_matches_portable_and_reference() {
        if !isa::tested_here(Isa::Avx512Vnni, "int8::gemm_matches_portable_and_reference") {
            return;
        }
        let shapes = crate::engine::cpu::amx::TEST_SHAPES.into_iter();
        for (seed, (gs, m, k, rows)) in shapes
            .chain([(64, 48, 128, 13), (128, 9, 256, 6), (64, 40, 1024, 100)])
            .enumerate()
        {
            let (w, x) = crate::engine::cpu::amx::test_case(seed, gs, m, k, rows);
            let want = gemm_portable(&w, &x, m);
            crate::engine::cpu::amx::assert_within_rounding_to(&w, &x, m, &want, QMAX8);
            let on = |threads: usize, team: bool| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                let pool = pool.expect("a test pool");
                let mut got = vec![f32::NAN; m * rows];
                // SAFETY: the kernel stores only computed f32 sums.
                let call = || run(&[&w], &x, m, &mut [unsafe { as_uninit(&mut got[..]) }]);
                match team {
                    true => pool.install(|| crate::engine::cpu::team::Team::lead(call)),
                    false => pool.install(call),
                }
                got
            };
            for (threads, team) in [(1, false), (3, false), (3, true)] {
                let got = on(threads, team);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "gs {gs} m {m} k {k} rows {rows}: {threads} threads, team {team}"
                );
            }
            if isa::active() == Isa::Avx512Vnni {
                let mut via = vec![f32::NAN; m * rows];
                let int8 = crate::engine::quant::Numerics::Int8;
                crate::engine::cpu::quant::qmatmul(&w, &x, m, &mut via, int8);
                assert_eq!(
                    bits(&via),
                    bits(&want),
                    "qmatmul's int8 prompt path is this GEMM"
                );
            }
        }
    }

    /// With a `tile16` copy the panels read their rows' whole tiles from it and give the rows'
    /// bits; with the matrix's own codes, scales and biases zeroed the same outputs for every
    /// row of a whole tile (the tail rows, which read the matrix, give zeros): panels of 12
    /// rows across tiles of 16, groups of 64 and 128.
    #[test]
    fn gemm_reads_the_copy() {
        if !isa::tested_here(Isa::Avx512Vnni, "int8::gemm_reads_the_copy") {
            return;
        }
        use crate::engine::quant::testutil::{blanked, random_qmatrix};
        use crate::engine::weights::Dtype;
        let gemm = |w: &QMatrix, x: &[f32], m: usize| {
            let mut y = vec![f32::NAN; m * w.rows];
            // SAFETY: the kernel stores only computed f32 sums.
            run(&[w], x, m, &mut [unsafe { as_uninit(&mut y[..]) }]);
            y
        };
        let shapes = [(64, 17, 1024, 50), (128, 33, 640, 96), (64, 9, 128, 200)];
        for (seed, (gs, m, k, rows)) in shapes.into_iter().enumerate() {
            let w = random_qmatrix(rows, k, 4, gs, Dtype::BF16, seed as u64 + 51);
            let (_, x) = crate::engine::cpu::amx::test_case(seed, gs, m, k, rows);
            let want = gemm(&w, &x, m);
            assert_eq!(bits(&want), bits(&gemm_portable(&w, &x, m)));
            assert!(crate::engine::cpu::tile16::attach(&w).is_some());
            assert_eq!(
                bits(&gemm(&w, &x, m)),
                bits(&want),
                "gs {gs}: with the copy"
            );
            let got = gemm(&blanked(&w), &x, m);
            let what = format!("int8 gs {gs}");
            crate::engine::cpu::amx::assert_read_from_copy(&got, &want, m, rows, &what);
        }
    }

    /// Matrices sharing one input in one call give each matrix's own bits.
    #[test]
    fn shared_equals_one_by_one() {
        if !isa::tested_here(Isa::Avx512Vnni, "int8::shared_equals_one_by_one") {
            return;
        }
        use crate::engine::quant::testutil::random_qmatrix;
        use crate::engine::weights::Dtype;
        let (m, k) = (19, 512);
        let ws: Vec<QMatrix> = [(40, 64), (13, 128), (96, 64)]
            .iter()
            .enumerate()
            .map(|(i, &(rows, gs))| random_qmatrix(rows, k, 4, gs, Dtype::BF16, 70 + i as u64))
            .collect();
        let refs: Vec<&QMatrix> = ws.iter().collect();
        let (_, x) = crate::engine::cpu::amx::test_case(3, 64, m, k, 8);
        let got = super::super::shared_outputs(&refs, m, |outs| run(&refs, &x, m, outs));
        for (w, y) in ws.iter().zip(&got) {
            let mut want = vec![f32::NAN; m * w.rows];
            // SAFETY: the kernel stores only computed f32 sums.
            run(&[w], &x, m, &mut [unsafe { as_uninit(&mut want[..]) }]);
            assert_eq!(bits(y), bits(&want), "{} rows", w.rows);
            assert_eq!(bits(&want), bits(&gemm_portable(w, &x, m)));
        }
    }
}
