//! Which CUDA kernel of `qmatmul.cu` runs a quantized product, and on what grid: plain Rust,
//! compiled on every platform and unit-tested here. The candle op (`cuda::quant`) and the fused
//! step (`cuda::fused`) both launch exactly these plans, so the choice is made in one place.
//! Thresholds were measured on an H100 with Qwen3-8B's shapes (docs/performance.md).

use crate::engine::quant::{Numerics, QParams};

/// Rows of x up to which the row kernels run (they reuse the codes across the rows).
pub const QMV_MAX_ROWS: usize = 8;

/// How one product `x (m, k) @ W^T (n, k)` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matmul {
    /// One row at 4 bits: `kernel` (`qmv4*`) with `rows_per_warp` rows a warp, `warps` a block,
    /// `smem` bytes of dynamic shared memory (x staged once a block) and `passes` passes of
    /// rows; the launcher caps the grid at what fits on the GPU at once.
    Decode4 {
        kernel: &'static str,
        rows_per_warp: usize,
        warps: usize,
        smem: usize,
        passes: usize,
    },
    /// A prompt at 4 bits: x rounded to fp16 per row (`x_to_f16p`), then fp16 MMAs fed from
    /// the codes (`qmm4_f16`, 128 x 64 tiles), K split `splits` ways (then `qmm_reduce`).
    PromptF16 { splits: usize },
    /// A prompt at other widths: TF32 MMAs (64 x 64 tiles), `qmm_tf32` or, K split, the
    /// `qmm_tf32_sk` partials and `qmm_reduce`.
    PromptTf32 { splits: usize },
    /// Scalar fp32 rows (`qmv_f32`, 8 output rows a block): few rows, exact numerics, or a
    /// width without a decode kernel.
    Rows,
}

impl Matmul {
    /// Floats of split-K partials the plan writes (0 without a split).
    pub fn workspace(&self, p: &QParams) -> usize {
        match *self {
            Matmul::PromptF16 { splits } | Matmul::PromptTf32 { splits } if splits > 1 => {
                splits * p.m as usize * p.n as usize
            }
            _ => 0,
        }
    }
}

/// The plan for `p` under `numerics`, with at most `workspace` floats of split-K partials
/// (a plan that would need more runs unsplit).
pub fn matmul(p: &QParams, numerics: Numerics, workspace: usize) -> Matmul {
    let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
    if m == 1 && p.bits == 4 {
        return decode4(n, k, numerics);
    }
    if m <= QMV_MAX_ROWS || numerics == Numerics::Exact {
        return Matmul::Rows;
    }
    let fits = |s: usize| if s * m * n <= workspace { s } else { 1 };
    if f16_prompt(p) {
        Matmul::PromptF16 {
            splits: fits(qmm4_splits(n, m, k)),
        }
    } else {
        Matmul::PromptTf32 {
            splits: fits(qmm_splits(n, m, k)),
        }
    }
}

/// The decode plan with the measured block shape for `n` rows.
pub fn decode4(n: usize, k: usize, numerics: Numerics) -> Matmul {
    let (rows_per_warp, warps) = decode_block(n);
    decode4_with(n, k, numerics, rows_per_warp, warps)
}

/// The decode plan with a given block shape (tests reach every kernel instance with it).
pub fn decode4_with(
    n: usize,
    k: usize,
    numerics: Numerics,
    rows_per_warp: usize,
    warps: usize,
) -> Matmul {
    let (kernel, smem) = match (numerics, rows_per_warp) {
        (Numerics::Exact, 4) => ("qmv4_m1_r4", qmv4_smem(k)),
        (Numerics::Exact, _) => ("qmv4_m1_r2", qmv4_smem(k)),
        (_, 4) => ("qmv4q_m1_r4", qmv4q_smem(k)),
        _ => ("qmv4q_m1_r2", qmv4q_smem(k)),
    };
    Matmul::Decode4 {
        kernel,
        rows_per_warp,
        warps,
        smem,
        passes: n.div_ceil(rows_per_warp * warps),
    }
}

/// Rows a warp and warps a block of the decode kernel for a matrix of `n` rows (H100, Qwen3-8B,
/// docs/performance.md session 7): two rows a warp and 16 warps, eight warps for q|k|v-sized
/// matrices, four rows and eight warps for vocabulary heads.
pub fn decode_block(n: usize) -> (usize, usize) {
    match n {
        n if n >= 65536 => (4, 8),
        n if (6144..16384).contains(&n) => (2, 8),
        _ => (2, 16),
    }
}

/// Whether a prompt product takes `qmm4_f16`: 4 bits, K a multiple of its 128-code step, groups
/// of whole 32-code runs, and scales that fp16 holds exactly (bf16 and f16 do; f32 would be
/// rounded).
pub fn f16_prompt(p: &QParams) -> bool {
    p.bits == 4 && p.k % 128 == 0 && p.group_size % 32 == 0 && p.group_size <= 128 && p.sdtype != 2
}

/// Blocks (128 weight rows by 64 x rows) a `qmm4_f16` grid aims for: two per SM of an H100.
const QMM4_TARGET_BLOCKS: usize = 264;

/// K splits for `qmm4_f16`: doubled until the grid reaches the target, each split a multiple
/// of 128 codes and at least 512 long.
pub fn qmm4_splits(n: usize, m: usize, k: usize) -> usize {
    k_splits(
        n.div_ceil(128) * m.div_ceil(64),
        k,
        128,
        512,
        QMM4_TARGET_BLOCKS,
    )
}

/// 64x64-tile blocks a TF32 prompt grid aims for (about four per SM of an H100).
const QMM_TARGET_BLOCKS: usize = 528;

/// K splits for `qmm_tf32_sk`; 1 = no split. Each split is a multiple of the kernel's 32-code
/// K step and at least 256 long.
pub fn qmm_splits(n: usize, m: usize, k: usize) -> usize {
    k_splits(
        n.div_ceil(64) * m.div_ceil(64),
        k,
        32,
        256,
        QMM_TARGET_BLOCKS,
    )
}

/// Splits of K for a grid of `blocks` tiles: doubled while the grid is under `target` and each
/// split stays a multiple of the kernel's `step` codes and at least `min_len` long.
fn k_splits(blocks: usize, k: usize, step: usize, min_len: usize, target: usize) -> usize {
    let mut s = 1;
    while blocks * s < target && k % (2 * s * step) == 0 && k / (2 * s) >= min_len {
        s *= 2;
    }
    s
}

/// Dynamic shared memory of `qmv4_m1_r*` for rows of `k` codes (x staged as f32, padded to
/// 1024, and a sum per 32 codes).
pub fn qmv4_smem(k: usize) -> usize {
    let k = k.next_multiple_of(1024);
    k * 4 + k / 32 * 4
}

/// Dynamic shared memory of `qmv4q_m1_r*`: x staged as int16, and a scale and a sum per 32.
pub fn qmv4q_smem(k: usize) -> usize {
    let k = k.next_multiple_of(1024);
    k * 2 + k / 32 * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(m: usize, n: usize, k: usize, bits: i32, gs: i32, sdtype: i32) -> QParams {
        QParams {
            m: m as i32,
            n: n as i32,
            k: k as i32,
            bits,
            group_size: gs,
            sdtype,
        }
    }

    #[test]
    fn decode_takes_the_4bit_row_kernel_with_the_measured_block() {
        // Qwen3-8B: q|k|v (6144 rows), o (4096), head (151936)
        let fast = Numerics::Fast;
        match matmul(&p(1, 6144, 4096, 4, 64, 0), fast, 0) {
            Matmul::Decode4 {
                kernel: "qmv4q_m1_r2",
                rows_per_warp: 2,
                warps: 8,
                passes: 384,
                smem,
            } => assert_eq!(smem, 4096 * 2 + 4096 / 32 * 8),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            matmul(&p(1, 151936, 4096, 4, 64, 0), Numerics::Exact, 0),
            Matmul::Decode4 {
                kernel: "qmv4_m1_r4",
                rows_per_warp: 4,
                warps: 8,
                ..
            }
        ));
        assert!(matches!(
            matmul(&p(1, 4096, 4096, 4, 64, 0), fast, 0),
            Matmul::Decode4 {
                warps: 16,
                passes: 128,
                ..
            }
        ));
        // other widths have no decode kernel
        assert_eq!(matmul(&p(1, 4096, 4096, 8, 64, 0), fast, 0), Matmul::Rows);
    }

    #[test]
    fn prompts_pick_fp16_tf32_or_rows() {
        let ws = usize::MAX;
        assert_eq!(
            matmul(&p(8, 4096, 4096, 4, 64, 0), Numerics::Fast, ws),
            Matmul::Rows
        );
        assert_eq!(
            matmul(&p(64, 4096, 4096, 4, 64, 0), Numerics::Exact, ws),
            Matmul::Rows
        );
        assert!(matches!(
            matmul(&p(64, 4096, 4096, 4, 64, 0), Numerics::Fast, ws),
            Matmul::PromptF16 { .. }
        ));
        // f32 scales, odd K, 3 bits: TF32
        for q in [
            p(64, 4096, 4096, 4, 64, 2),
            p(64, 4096, 4160, 4, 64, 0),
            p(64, 4096, 4096, 3, 64, 0),
        ] {
            assert!(
                matches!(matmul(&q, Numerics::Fast, ws), Matmul::PromptTf32 { .. }),
                "{q:?}"
            );
        }
    }

    #[test]
    fn splits_fill_the_gpu_and_respect_the_workspace() {
        // 64 rows of o_proj: 32 x 1 tiles of 128 x 64, doubled to reach 264 blocks
        let q = p(64, 4096, 4096, 4, 64, 0);
        let plan = matmul(&q, Numerics::Fast, usize::MAX);
        assert_eq!(plan, Matmul::PromptF16 { splits: 8 });
        assert_eq!(plan.workspace(&q), 8 * 64 * 4096);
        // a workspace too small for the split runs unsplit
        assert_eq!(
            matmul(&q, Numerics::Fast, 64 * 4096),
            Matmul::PromptF16 { splits: 1 }
        );
        // splits stay multiples of the K step and long enough
        for (n, m, k) in [
            (4096, 64, 4096),
            (128, 9, 12288),
            (151936, 512, 4096),
            (64, 9, 1024),
        ] {
            let s = qmm4_splits(n, m, k);
            assert!(
                k % (s * 128) == 0 && k / s >= 512.min(k),
                "{n} {m} {k}: {s}"
            );
            let s = qmm_splits(n, m, k);
            assert!(k % (s * 32) == 0 && k / s >= 256.min(k), "{n} {m} {k}: {s}");
        }
        assert_eq!(qmm_splits(151936, 512, 4096), 1, "a full grid is not split");
    }
}
