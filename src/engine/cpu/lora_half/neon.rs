//! The rank-8 LoRA loops of `lora_half` on aarch64, with `fcvtl`/`fcvtl2` (base AArch64 SIMD:
//! no FEAT_FP16, so every aarch64 CPU; the attention kernels' `widen_halves`, as `asm!`
//! because the f16 vector intrinsics are not stable Rust): an f16 row of `a` or run of `b`,
//! eight values, widened by one load and two conversions into two four-lane vectors.

use std::arch::aarch64::*;

use crate::engine::cpu::attention::neon::widen_halves;
use crate::engine::lora::{Half, LANES};

/// Eight halves at `p` as two f32 vectors (values 0-3, 4-7), exactly.
///
/// # Safety
/// `p` points at eight readable halves.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn widen8(p: *const Half) -> (float32x4_t, float32x4_t) {
    widen_halves(vld1q_u16(p as *const u16))
}

/// `out[j] = Σ_k x[k] a[k][j]` for rank 8 (`a` [x.len(), 8]) in `project_piece_body`'s four
/// chains (input `k` in chain `k % 4`, each a product then an add, the chains summed
/// `(t0 + t1) + (t2 + t3)`): the same bits.
///
/// # Safety
/// The CPU has NEON (every aarch64 CPU).
#[target_feature(enable = "neon")]
pub unsafe fn project8(a: &[Half], x: &[f32], out: &mut [f32; 8]) {
    assert_eq!(a.len(), x.len() * 8, "a is [x.len(), 8]");
    let zero = vdupq_n_f32(0.0);
    let mut t = [[zero; 2]; 4];
    // input `k`'s row into chain `c`: a product then an add, as the portable loop rounds them
    let step = |t: &mut [float32x4_t; 2], k: usize| {
        let (lo, hi) = widen8(a.as_ptr().add(k * 8));
        let xv = vdupq_n_f32(*x.get_unchecked(k));
        t[0] = vaddq_f32(t[0], vmulq_f32(xv, lo));
        t[1] = vaddq_f32(t[1], vmulq_f32(xv, hi));
    };
    let n = x.len();
    let mut k = 0;
    while k + 4 <= n {
        for (c, tc) in t.iter_mut().enumerate() {
            step(tc, k + c);
        }
        k += 4;
    }
    for (c, tc) in t.iter_mut().enumerate().take(n - k) {
        step(tc, k + c);
    }
    for h in 0..2 {
        let s = vaddq_f32(vaddq_f32(t[0][h], t[1][h]), vaddq_f32(t[2][h], t[3][h]));
        vst1q_f32(out.as_mut_ptr().add(4 * h), s);
    }
}

/// `y[n] += Σ_j c[j] b[j][n]` for rank 8 over whole blocks (`blocks`: `y.len() / LANES` blocks
/// of `lora::block_b`, each 8 runs of `LANES` halves), in `add_b_body`'s order: the eight
/// products, then `((p0 + p4) + (p1 + p5)) + ((p2 + p6) + (p3 + p7))`, then the add to `y`.
///
/// # Safety
/// The CPU has NEON (every aarch64 CPU).
#[target_feature(enable = "neon")]
pub unsafe fn add_b8(blocks: &[Half], c: &[f32; 8], y: &mut [f32]) {
    const _: () = assert!(LANES == 8, "a block's run is two vectors of 4 f32");
    assert!(y.len().is_multiple_of(LANES) && blocks.len() == y.len() * 8);
    let cv = c.map(|cj| vdupq_n_f32(cj));
    for (i, yv) in y.chunks_exact_mut(LANES).enumerate() {
        let runs = blocks.as_ptr().add(i * 8 * LANES);
        let mut p = [[vdupq_n_f32(0.0); 2]; 8];
        for (j, pj) in p.iter_mut().enumerate() {
            let (lo, hi) = widen8(runs.add(j * LANES));
            *pj = [vmulq_f32(cv[j], lo), vmulq_f32(cv[j], hi)];
        }
        for h in 0..2 {
            let s = vaddq_f32(
                vaddq_f32(vaddq_f32(p[0][h], p[4][h]), vaddq_f32(p[1][h], p[5][h])),
                vaddq_f32(vaddq_f32(p[2][h], p[6][h]), vaddq_f32(p[3][h], p[7][h])),
            );
            let at = yv.as_mut_ptr().add(4 * h);
            vst1q_f32(at, vaddq_f32(vld1q_f32(at), s));
        }
    }
}
