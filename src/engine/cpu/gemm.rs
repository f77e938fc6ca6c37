//! Prompt-processing CPU forward of the fused quantized matmul (`m` ≥ `GEMM_MIN_ROWS` rows) on
//! x86-64 with AVX2 + FMA (AVX-512 where the CPU has it): a packed f32 GEMM whose weight panels are dequantized straight from
//! the 4-bit codes (`scale * q + bias`, as mlx), so the f32 matrix never exists beyond six rows
//! times one block of `k`. The slow reference is `QMatrix::matmul_reference` (tested below).
//!
//! Layout, in the spirit of BLIS: activations are packed once per call into panels of `NR` rows
//! (`[k][NR]`, zero-padded); each task dequantizes `MR` weight rows over a block of `k` (sized
//! so the packed activation block stays in L2) and an MR x NR register kernel runs over every
//! activation panel: 6x16 on AVX2 (12 ymm accumulators, enough to hide the FMA latency on two
//! ports), 8x32 on AVX-512 (16 zmm accumulators, twice the products an instruction). Results go straight
//! to `y (m x rows)`: no transposed copy, no serial step after the parallel part.

use crate::engine::quant::QMatrix;

/// The AVX2 tile: weight rows (broadcast operand) x activation rows (two 8-lane vectors).
const MR: usize = 6;
const NR: usize = 16;
/// The AVX-512 tile: two 16-lane vectors of activation rows.
const MR512: usize = 8;
const NR512: usize = 32;

/// `c[r][i] += Σ_kk w[r * ws + kk] * x[kk * NR + i]` for r < MR, i < NR, kk < kl.
type Kernel = unsafe fn(&[f32], usize, &[f32], usize, &mut [f32]);
/// Bytes of packed activations one `k` block may hold (half of a 512 KiB L2).
const XBLOCK_BYTES: usize = 256 * 1024;

/// Whether `qgemm` can run here (the process's instruction set is AVX2).
pub fn available() -> bool {
    crate::engine::cpu::isa::active().avx2()
}

/// `y (m x rows) = x (m x cols) @ dequant(w)^T`, f32 values and f32 accumulation. Callers
/// check `available()` first.
pub fn qgemm(w: &QMatrix, x: &[f32], m: usize, y: &mut [f32]) {
    debug_assert!(available());
    if crate::engine::cpu::isa::active().avx512() {
        qgemm_tiled::<MR512, NR512>(w, x, m, y, avx512::kernel)
    } else {
        qgemm_tiled::<MR, NR>(w, x, m, y, avx2::kernel_6x16)
    }
}

fn qgemm_tiled<const MR: usize, const NR: usize>(
    w: &QMatrix,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    kernel: Kernel,
) {
    let (k, rows, gs) = (w.cols, w.rows, w.params.group_size);
    let mp = m.div_ceil(NR);
    // a k block: whole groups, and at most XBLOCK_BYTES of packed activations
    let kc = ((XBLOCK_BYTES / (mp * NR * 4)) / gs * gs).clamp(gs, k);
    let xp = pack_x::<NR>(x, m, k, mp);
    let panels = rows.div_ceil(MR);
    let threads = rayon::current_num_threads().max(1);
    // enough tasks to balance, few enough that each reuses the k block over many panels
    let per_task = panels.div_ceil(threads * 4).max(1);
    let out = SyncPtr(y.as_mut_ptr());
    let mut tasks: Vec<usize> = (0..panels.div_ceil(per_task)).collect();
    // on the team a host pass leads (`cpu::team`), else rayon's pool
    crate::engine::cpu::team::for_each_mut(&mut tasks, |&mut t| {
        let (p0, p1) = (t * per_task, ((t + 1) * per_task).min(panels));
        let ws = kc + 16; // stride off a multiple of 4 KiB: the six row streams share no L1 set
        let mut wp = vec![0f32; MR * ws];
        let mut sb = Vec::with_capacity(kc / gs);
        // (panel, activation panel, MR x NR) accumulators of this task
        let mut acc = vec![0f32; (p1 - p0) * mp * MR * NR];
        for k0 in (0..k).step_by(kc) {
            let kl = kc.min(k - k0);
            for p in p0..p1 {
                let n0 = p * MR;
                prefetch_codes(w, n0 + MR..(n0 + 2 * MR).min(rows), k0, kl);
                for r in 0..MR {
                    let dst = &mut wp[r * ws..r * ws + kl];
                    if n0 + r < rows {
                        dequant(w, n0 + r, k0, dst, &mut sb);
                    } else {
                        dst.fill(0.0);
                    }
                }
                for j in 0..mp {
                    let c = &mut acc[((p - p0) * mp + j) * MR * NR..][..MR * NR];
                    let xs = &xp[j * k * NR + k0 * NR..][..kl * NR];
                    // SAFETY: `available()` holds (checked by the caller) and `kernel` is
                    // the tile of this instruction set; `wp` holds MR rows of stride
                    // ws ≥ kl, `xs` kl * NR values, `c` MR * NR.
                    unsafe { kernel(&wp, ws, xs, kl, c) };
                }
            }
        }
        for p in p0..p1 {
            let (n0, nr) = (p * MR, MR.min(rows - p * MR));
            for j in 0..mp {
                let c = &acc[((p - p0) * mp + j) * MR * NR..][..MR * NR];
                for ii in 0..NR.min(m - j * NR) {
                    let dst = out.at((j * NR + ii) * rows + n0);
                    for r in 0..nr {
                        // SAFETY: row j * NR + ii < m and column n0 + r < rows, so the
                        // element is inside y (m x rows); each task writes only the
                        // columns of its own panels.
                        unsafe { *dst.add(r) = c[r * NR + ii] };
                    }
                }
            }
        }
    });
}

/// A pointer that tasks writing disjoint elements may share.
struct SyncPtr(*mut f32);
// SAFETY: used only for writes to disjoint elements (see `qgemm`).
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    /// The address of element `i`, computed without dereferencing; callers keep `i` in bounds
    /// before writing through it.
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Activation panels: `xp[j][kk][i] = x[j * NR + i][kk]`, zero past row `m`.
fn pack_x<const NR: usize>(x: &[f32], m: usize, k: usize, mp: usize) -> Vec<f32> {
    let mut xp = vec![0f32; mp * k * NR];
    for (i, row) in x.chunks_exact(k).take(m).enumerate() {
        let panel = &mut xp[(i / NR) * k * NR..][..k * NR];
        for (kk, &v) in row.iter().enumerate() {
            panel[kk * NR + i % NR] = v;
        }
    }
    xp
}

/// Asks for the codes of weight rows `rows`, columns `k0..k0 + kl`, ahead of their dequantizing:
/// the next panel's rows arrive from DRAM while this panel's products run (without it, two
/// threads wait on the weight stream: measured on a 3072x1024 matrix, 64 rows, weights not in
/// L3, 4.6 ms a call; they had 2.9 ms with the weights in L3).
fn prefetch_codes(w: &QMatrix, rows: std::ops::Range<usize>, k0: usize, kl: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let bits = w.params.bits;
        let (b0, b1) = (k0 * bits / 8, (k0 + kl) * bits / 8);
        for n in rows {
            let row = &w.packed[n * w.row_bytes()..(n + 1) * w.row_bytes()];
            for at in (b0..b1).step_by(64) {
                // SAFETY: a prefetch hint of an address inside `row`; it never faults.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        row.as_ptr().add(at) as *const i8,
                    )
                };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (w, rows, k0, kl);
}

/// Dequantizes `dst.len()` values of weight row `n` from column `k0` (both whole groups); `sb`
/// is scratch for the groups' scales and biases.
fn dequant(w: &QMatrix, n: usize, k0: usize, dst: &mut [f32], sb: &mut Vec<(f32, f32)>) {
    let (gs, bits) = (w.params.group_size, w.params.bits);
    let gpr = w.groups_per_row();
    let (scales, biases) = (w.scales.view(), w.biases.view());
    let gb = gs * bits / 8;
    let row = &w.packed[n * w.row_bytes()..(n + 1) * w.row_bytes()];
    let g0 = k0 / gs;
    let groups = dst.len() / gs;
    sb.clear();
    sb.extend((g0..g0 + groups).map(|g| (scales.get(n * gpr + g), biases.get(n * gpr + g))));
    let bytes = &row[g0 * gb..(g0 + groups) * gb];
    if (bits == 4 || bits == 8) && gs % 8 == 0 {
        // SAFETY: available() (AVX2) holds; bytes holds groups * gs * bits / 8 values' codes,
        // dst groups * gs values and sb one pair per group.
        unsafe { avx2::dequant_groups(bits, gs, bytes, sb, dst) };
        return;
    }
    let mut codes = [0u8; 128];
    for ((o, g), &(s, b)) in dst
        .chunks_exact_mut(gs)
        .zip(bytes.chunks_exact(gb))
        .zip(sb.iter())
    {
        QMatrix::unpack_codes(bits, g, &mut codes[..gs]);
        for (d, &q) in o.iter_mut().zip(&codes[..gs]) {
            *d = s * q as f32 + b;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{MR, NR};

    /// `c[r][i] += Σ_kk w[r * ws + kk] * x[kk * NR + i]` for r < MR, i < NR, kk < kl.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn kernel_6x16(w: &[f32], ws: usize, x: &[f32], kl: usize, c: &mut [f32]) {
        debug_assert!(w.len() >= (MR - 1) * ws + kl && x.len() >= kl * NR && c.len() >= MR * NR);
        let (wp, xp, cp) = (w.as_ptr(), x.as_ptr(), c.as_mut_ptr());
        let mut a = [[_mm256_setzero_ps(); 2]; MR];
        for (r, ar) in a.iter_mut().enumerate() {
            ar[0] = _mm256_loadu_ps(cp.add(r * NR));
            ar[1] = _mm256_loadu_ps(cp.add(r * NR + 8));
        }
        for kk in 0..kl {
            let x0 = _mm256_loadu_ps(xp.add(kk * NR));
            let x1 = _mm256_loadu_ps(xp.add(kk * NR + 8));
            for (r, ar) in a.iter_mut().enumerate() {
                let wv = _mm256_broadcast_ss(&*wp.add(r * ws + kk));
                ar[0] = _mm256_fmadd_ps(wv, x0, ar[0]);
                ar[1] = _mm256_fmadd_ps(wv, x1, ar[1]);
            }
        }
        for (r, ar) in a.iter().enumerate() {
            _mm256_storeu_ps(cp.add(r * NR), ar[0]);
            _mm256_storeu_ps(cp.add(r * NR + 8), ar[1]);
        }
    }

    /// Groups of 4- or 8-bit codes (packed low bits first in little-endian u32 words) to
    /// `s * q + b`, eight values per step: broadcast the word(s), shift each lane by its own
    /// amount, mask, convert, one FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dequant_groups(
        bits: usize,
        gs: usize,
        bytes: &[u8],
        sb: &[(f32, f32)],
        out: &mut [f32],
    ) {
        assert!(
            gs.is_multiple_of(8)
                && out.len() == sb.len() * gs
                && bytes.len() * 8 == out.len() * bits
        );
        let (src, dst) = (bytes.as_ptr(), out.as_mut_ptr());
        let word = |i: usize| std::ptr::read_unaligned(src.add(4 * i) as *const i32);
        let steps = gs / 8;
        if bits == 4 {
            let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            let mask = _mm256_set1_epi32(15);
            for (g, &(s, b)) in sb.iter().enumerate() {
                let (sv, bv) = (_mm256_set1_ps(s), _mm256_set1_ps(b));
                for j in g * steps..(g + 1) * steps {
                    let q = _mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_set1_epi32(word(j)), shifts),
                        mask,
                    );
                    _mm256_storeu_ps(
                        dst.add(8 * j),
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sv, bv),
                    );
                }
            }
        } else {
            for (g, &(s, b)) in sb.iter().enumerate() {
                let (sv, bv) = (_mm256_set1_ps(s), _mm256_set1_ps(b));
                for j in g * steps..(g + 1) * steps {
                    // eight bytes -> eight i32 lanes
                    let v = _mm_loadl_epi64(src.add(8 * j) as *const __m128i);
                    let q = _mm256_cvtepu8_epi32(v);
                    _mm256_storeu_ps(
                        dst.add(8 * j),
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sv, bv),
                    );
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{MR512 as MR, NR512 as NR};

    /// The 8x32 tile: `c[r][i] += Σ_kk w[r * ws + kk] * x[kk * NR + i]`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn kernel(w: &[f32], ws: usize, x: &[f32], kl: usize, c: &mut [f32]) {
        debug_assert!(w.len() >= (MR - 1) * ws + kl && x.len() >= kl * NR && c.len() >= MR * NR);
        let (wp, xp, cp) = (w.as_ptr(), x.as_ptr(), c.as_mut_ptr());
        let mut a = [[_mm512_setzero_ps(); 2]; MR];
        for (r, ar) in a.iter_mut().enumerate() {
            ar[0] = _mm512_loadu_ps(cp.add(r * NR));
            ar[1] = _mm512_loadu_ps(cp.add(r * NR + 16));
        }
        for kk in 0..kl {
            let x0 = _mm512_loadu_ps(xp.add(kk * NR));
            let x1 = _mm512_loadu_ps(xp.add(kk * NR + 16));
            for (r, ar) in a.iter_mut().enumerate() {
                let wv = _mm512_set1_ps(*wp.add(r * ws + kk));
                ar[0] = _mm512_fmadd_ps(wv, x0, ar[0]);
                ar[1] = _mm512_fmadd_ps(wv, x1, ar[1]);
            }
        }
        for (r, ar) in a.iter().enumerate() {
            _mm512_storeu_ps(cp.add(r * NR), ar[0]);
            _mm512_storeu_ps(cp.add(r * NR + 16), ar[1]);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx512 {
    pub unsafe fn kernel(_: &[f32], _: usize, _: &[f32], _: usize, _: &mut [f32]) {
        unreachable!("qgemm needs x86-64 AVX-512")
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx2 {
    pub unsafe fn kernel_6x16(_: &[f32], _: usize, _: &[f32], _: usize, _: &mut [f32]) {
        unreachable!("qgemm needs x86-64 AVX2")
    }
    pub unsafe fn dequant_groups(_: usize, _: usize, _: &[u8], _: &[(f32, f32)], _: &mut [f32]) {
        unreachable!("qgemm needs x86-64 AVX2")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::isa::Isa;
    use crate::engine::quant::testutil::random_qmatrix;
    use crate::engine::weights::Dtype;
    use rand::{Rng, SeedableRng};

    /// The packed GEMM against dequantize-then-matmul: every bit width (the vector dequant for
    /// 4 and 8, the scalar one otherwise), all group sizes, row counts that leave partial 6-row
    /// and 16-row tiles, and an `m` large enough to split `k` into several blocks. Bound: 1e-5 of
    /// the largest |y| (f32 sums in another order).
    #[test]
    fn packed_gemm_matches_reference() {
        if !available() {
            eprintln!("packed_gemm_matches_reference: no AVX2+FMA here; nothing to test");
            return;
        }
        let with_avx512 =
            crate::engine::cpu::isa::tested_here(Isa::Avx512Vnni, "packed_gemm_matches_reference");
        let mut seed = 0u64;
        for bits in [2, 3, 4, 5, 6, 8] {
            for (gs, m, k, rows) in [
                (32, 8, 96, 13),
                (64, 17, 1024, 50),
                (128, 64, 640, 37),
                (64, 300, 2048, 7),
            ] {
                seed += 1;
                let dt = [Dtype::BF16, Dtype::F16, Dtype::F32][seed as usize % 3];
                let w = random_qmatrix(rows, k, bits, gs, dt, seed);
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed + 100);
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                let want = w.matmul_reference(&x, m);
                type Gemm<'a> = Box<dyn Fn(&mut [f32]) + 'a>;
                let mut tiles: Vec<(&str, Gemm)> = vec![
                    ("active", Box::new(|y: &mut [f32]| qgemm(&w, &x, m, y))),
                    (
                        "avx2 6x16",
                        Box::new(|y: &mut [f32]| {
                            qgemm_tiled::<MR, NR>(&w, &x, m, y, avx2::kernel_6x16)
                        }),
                    ),
                ];
                if with_avx512 {
                    tiles.push((
                        "avx512 8x32",
                        Box::new(|y: &mut [f32]| {
                            qgemm_tiled::<MR512, NR512>(&w, &x, m, y, avx512::kernel)
                        }),
                    ));
                }
                for (name, run) in &tiles {
                    let mut got = vec![f32::NAN; m * rows];
                    run(&mut got);
                    assert!(
                        got.iter().all(|v| v.is_finite()),
                        "{name} bits {bits} m {m}: an output was not written"
                    );
                    let max = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let err = got
                        .iter()
                        .zip(&want)
                        .fold(0f32, |a, (g, r)| a.max((g - r).abs()));
                    assert!(
                        err <= 1e-5 * max,
                        "{name} bits {bits} gs {gs} m {m} k {k} rows {rows}: max err {err} of {max}"
                    );
                }
            }
        }
    }
}
