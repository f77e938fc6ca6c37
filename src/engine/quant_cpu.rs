//! CPU forwards of the fused quantized matmul `y = x @ dequant(W)^T` (the slow references live
//! in `quant.rs`). Two kernels:
//! - `Exact`: every bit width; each group is dequantized to f32 (`scale * q + bias`, as mlx
//!   does) in a 128-value stack buffer and reused for all `m` activation rows, so the full
//!   matrix is never materialized.
//! - `Fast` (4-bit, AVX2): the activations are quantized once per call to int8 in blocks of 32
//!   (scale `d = max|x| / 127`, like llama.cpp's Q8_0), the codes are used as unsigned bytes in
//!   `maddubs` integer dot products, and per block `s * d * Σ q·xq` plus `b * Σx` (with the exact
//!   f32 `Σx`) is added. The only change to the numerics is rounding x to int8: per element at
//!   most `d / 2`, so `|Δy| ≤ Σ_blocks s·d/2·Σ q ≤` about 0.4% of `Σ |s q x|`.
//! Threads split the output rows (rayon), each task a run of rows whose codes stay in cache.

use rayon::prelude::*;

use super::quant::{CpuKernel, QMatrix};

/// `y (m x rows) = x (m x cols) @ dequant(w)^T`.
pub fn qmatmul(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32], kernel: CpuKernel) {
    debug_assert_eq!(x.len(), m * w.cols);
    debug_assert_eq!(y.len(), m * w.rows);
    if m == 0 || w.rows == 0 {
        return;
    }
    match kernel {
        CpuKernel::Fast if w.params.bits == 4 && avx2::available() => fast_q4(w, x, m, y),
        _ => exact(w, x, m, y),
    }
}

/// Rows per rayon task: enough tasks to balance, few enough that scheduling stays cheap.
fn rows_per_task(rows: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    (rows / (threads * 8)).clamp(4, 256)
}

/// Runs `f(row, out_row)` over all output rows in parallel, where `out_row` holds the `m`
/// results of that row, then transposes into `y (m x rows)`.
fn for_rows(w: &QMatrix, m: usize, y: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync) {
    let chunk = rows_per_task(w.rows);
    if m == 1 {
        y.par_chunks_mut(chunk).enumerate().for_each(|(c, ys)| {
            for (j, v) in ys.chunks_exact_mut(1).enumerate() {
                f(c * chunk + j, v);
            }
        });
        return;
    }
    let mut yt = vec![0f32; w.rows * m];
    yt.par_chunks_mut(chunk * m)
        .enumerate()
        .for_each(|(c, ys)| {
            for (j, v) in ys.chunks_exact_mut(m).enumerate() {
                f(c * chunk + j, v);
            }
        });
    for (n, col) in yt.chunks_exact(m).enumerate() {
        for (i, &v) in col.iter().enumerate() {
            y[i * w.rows + n] = v;
        }
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
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
    let (gpr, gb, rb) = (w.groups_per_row(), gs * bits / 8, w.row_bytes());
    for_rows(w, m, y, |n, out| {
        let row = &w.packed[n * rb..(n + 1) * rb];
        let mut codes = [0u8; 128];
        let mut deq = [0f32; 128];
        out.iter_mut().for_each(|o| *o = 0.0);
        for g in 0..gpr {
            QMatrix::unpack_codes(bits, &row[g * gb..(g + 1) * gb], &mut codes[..gs]);
            let (s, b) = (w.scales.get(n * gpr + g), w.biases.get(n * gpr + g));
            for (d, &q) in deq[..gs].iter_mut().zip(&codes[..gs]) {
                *d = s * q as f32 + b;
            }
            for (i, o) in out.iter_mut().enumerate() {
                *o += dot(&deq[..gs], &x[i * k + g * gs..i * k + (g + 1) * gs]);
            }
        }
    });
}

/// Activations prepared for the int8 kernels: per row, the codes of each 32-value block split
/// into even (`xe`) and odd (`xo`) positions, matching the low and high nibbles of MLX's bytes,
/// one scale per block and the exact sum of each quantization group.
pub struct Q8Acts {
    pub k: usize,
    pub xe: Vec<i8>,
    pub xo: Vec<i8>,
    pub d: Vec<f32>,
    pub gsum: Vec<f32>,
}

impl Q8Acts {
    pub fn new(x: &[f32], m: usize, k: usize, gs: usize) -> Self {
        let nb = k / 32;
        let mut a = Q8Acts {
            k,
            xe: vec![0; m * k / 2],
            xo: vec![0; m * k / 2],
            d: vec![0.0; m * nb],
            gsum: vec![0.0; m * (k / gs)],
        };
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            for b in 0..nb {
                let blk = &xr[b * 32..(b + 1) * 32];
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                a.d[i * nb + b] = d;
                for j in 0..16 {
                    a.xe[i * k / 2 + b * 16 + j] = (blk[2 * j] * inv).round() as i8;
                    a.xo[i * k / 2 + b * 16 + j] = (blk[2 * j + 1] * inv).round() as i8;
                }
            }
            for (g, s) in a.gsum[i * (k / gs)..(i + 1) * (k / gs)]
                .iter_mut()
                .enumerate()
            {
                *s = xr[g * gs..(g + 1) * gs].iter().sum();
            }
        }
        a
    }
}

/// Scalar version of the int8 kernel for one (row, activation row): the definition the AVX2
/// code must reproduce, and the path for blocks the vector loop does not cover.
fn q4_row_scalar(
    w: &QMatrix,
    n: usize,
    a: &Q8Acts,
    i: usize,
    blocks: std::ops::Range<usize>,
) -> f32 {
    let (gs, gpr, rb, k) = (w.params.group_size, w.groups_per_row(), w.row_bytes(), a.k);
    let row = &w.packed[n * rb..(n + 1) * rb];
    let nb = k / 32;
    let mut acc = 0f32;
    for b in blocks {
        let mut isum = 0i32;
        for j in 0..16 {
            let byte = row[b * 16 + j];
            isum += (byte & 15) as i32 * a.xe[i * k / 2 + b * 16 + j] as i32;
            isum += (byte >> 4) as i32 * a.xo[i * k / 2 + b * 16 + j] as i32;
        }
        let g = b * 32 / gs;
        acc += w.scales.get(n * gpr + g) * a.d[i * nb + b] * isum as f32;
    }
    acc
}

fn bias_term(w: &QMatrix, n: usize, a: &Q8Acts, i: usize) -> f32 {
    let gpr = w.groups_per_row();
    (0..gpr)
        .map(|g| w.biases.get(n * gpr + g) * a.gsum[i * gpr + g])
        .sum()
}

fn fast_q4(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32]) {
    let a = Q8Acts::new(x, m, w.cols, w.params.group_size);
    let nb = w.cols / 32;
    for_rows(w, m, y, |n, out| {
        for (i, o) in out.iter_mut().enumerate() {
            let paired = nb & !1;
            // SAFETY: `fast_q4` is only chosen when AVX2 and FMA were detected at run time.
            let v = unsafe { avx2::q4_row(w, n, &a, i, paired) };
            *o = v + q4_row_scalar(w, n, &a, i, paired..nb) + bias_term(w, n, &a, i);
        }
    });
}

/// Reference for the `Fast` kernel's arithmetic without SIMD (tests compare the two).
pub fn fast_q4_scalar(w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
    let a = Q8Acts::new(x, m, w.cols, w.params.group_size);
    let nb = w.cols / 32;
    let mut y = vec![0f32; m * w.rows];
    for i in 0..m {
        for n in 0..w.rows {
            y[i * w.rows + n] = q4_row_scalar(w, n, &a, i, 0..nb) + bias_term(w, n, &a, i);
        }
    }
    y
}

mod avx2 {
    use super::{Q8Acts, QMatrix};

    pub fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Σ over blocks `0..paired` (an even count) of `s_g * d_b * Σ q·xq` for row `n` and
    /// activation row `i`. Each 32-byte load holds two 32-value blocks: lane 0 block b,
    /// lane 1 block b+1, which `xe`/`xo` mirror.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q4_row(w: &QMatrix, n: usize, a: &Q8Acts, i: usize, paired: usize) -> f32 {
        use std::arch::x86_64::*;
        let (gs, gpr, rb, k) = (w.params.group_size, w.groups_per_row(), w.row_bytes(), a.k);
        let nb = k / 32;
        let row = w.packed[n * rb..(n + 1) * rb].as_ptr();
        let xe = a.xe[i * k / 2..].as_ptr();
        let xo = a.xo[i * k / 2..].as_ptr();
        let d = &a.d[i * nb..(i + 1) * nb];
        let mask = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        let mut b = 0;
        while b < paired {
            let v = _mm256_loadu_si256(row.add(b * 16) as *const __m256i);
            let lo = _mm256_and_si256(v, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            let e = _mm256_loadu_si256(xe.add(b * 16) as *const __m256i);
            let o = _mm256_loadu_si256(xo.add(b * 16) as *const __m256i);
            let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, o));
            let s32 = _mm256_madd_epi16(p, ones);
            let s0 = w.scales.get(n * gpr + b * 32 / gs) * d[b];
            let s1 = w.scales.get(n * gpr + (b + 1) * 32 / gs) * d[b + 1];
            let sc = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), sc, acc);
            b += 2;
        }
        let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
        _mm_cvtss_f32(h)
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub unsafe fn q4_row(_: &QMatrix, _: usize, _: &Q8Acts, _: usize, _: usize) -> f32 {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::super::quant::testutil::random_qmatrix;
    use super::*;
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

    /// Fused exact kernel vs dequantize-then-matmul: every bit width and group size, rows
    /// M in {1, 7, 64}, widths that are not multiples of 512.
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
                    qmatmul(&w, &x, m, &mut got, CpuKernel::Exact);
                    let e = rel_err(&got, &want);
                    assert!(e <= 1e-5, "bits {bits} gs {gs} m {m} k {k}: rel err {e}");
                }
            }
        }
    }

    /// The AVX2 int8 kernel equals its scalar definition (same integer sums, f32 rounding
    /// only), and stays within 1% of the exact product (the int8 bound in the module docs).
    #[test]
    fn fast_q4_matches_scalar_and_exact() {
        for (gs, m, k) in [
            (32, 1, 96),
            (64, 1, 1024),
            (128, 7, 640),
            (64, 64, 384),
            (32, 5, 1056),
        ] {
            let w = random_qmatrix(50, k, 4, gs, Dtype::BF16, k as u64);
            let x = rand_x(m, k, 7);
            let scalar = fast_q4_scalar(&w, &x, m);
            let mut got = vec![0f32; m * 50];
            qmatmul(&w, &x, m, &mut got, CpuKernel::Fast);
            if avx2::available() {
                assert!(
                    rel_err(&got, &scalar) <= 1e-5,
                    "gs {gs} m {m} k {k}: {}",
                    rel_err(&got, &scalar)
                );
            }
            let want = w.matmul_reference(&x, m);
            let e = rel_err(&scalar, &want);
            assert!(e <= 1e-2, "gs {gs} m {m} k {k}: int8 rel err {e}");
        }
    }
}
