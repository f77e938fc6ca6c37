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
    /// One row at 4 bits: `kernel` (`qmv4*`) with `rows_per_warp` rows a team of `k_warps`
    /// warps (which split each row's K), `warps` a block, `smem` bytes of dynamic shared memory
    /// (x staged once a block) and `passes` passes of rows; the launcher caps the grid at what
    /// fits on the GPU at once.
    Decode4 {
        kernel: &'static str,
        rows_per_warp: usize,
        warps: usize,
        k_warps: usize,
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

/// The decode plan with the measured block shape for an `n` x `k` matrix.
pub fn decode4(n: usize, k: usize, numerics: Numerics) -> Matmul {
    decode4_with(n, k, numerics, decode_block(n, k))
}

/// The decode plan with a given block shape (tests reach every kernel instance with it).
pub fn decode4_with(n: usize, k: usize, numerics: Numerics, b: DecodeBlock) -> Matmul {
    let smem = match numerics {
        Numerics::Exact => qmv4_smem(k),
        _ => qmv4q_smem(k),
    };
    Matmul::Decode4 {
        kernel: b.kernel(numerics),
        rows_per_warp: b.rows,
        warps: b.warps,
        k_warps: b.k_warps,
        smem,
        passes: n.div_ceil(b.rows * b.warps / b.k_warps),
    }
}

/// A decode block: `rows` rows a team of `k_warps` warps (each taking every `k_warps`-th
/// 1024-code chunk of them), `warps` warps a block. Only shapes with a kernel instance exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeBlock {
    rows: usize,
    warps: usize,
    k_warps: usize,
}

/// (rows, k_warps) of each `qmv4[q]_m1_*` instance in `qmatmul.cu`, the most warps a block of
/// it may have (its `__launch_bounds__`), and its exact and fast kernels.
const DECODE_INSTANCES: [((usize, usize), usize, &str, &str); 4] = [
    ((2, 1), 16, "qmv4_m1_r2", "qmv4q_m1_r2"),
    ((4, 1), 8, "qmv4_m1_r4", "qmv4q_m1_r4"),
    ((2, 2), 32, "qmv4_m1_r2_k2", "qmv4q_m1_r2_k2"),
    ((2, 4), 32, "qmv4_m1_r2_k4", "qmv4q_m1_r2_k4"),
];

impl DecodeBlock {
    /// The shape, if `qmatmul.cu` has its instance and the block fits it (warps a multiple of
    /// the team, no more than the instance takes).
    pub fn new(rows: usize, warps: usize, k_warps: usize) -> Option<DecodeBlock> {
        let instance = DECODE_INSTANCES
            .iter()
            .any(|(k, most, ..)| *k == (rows, k_warps) && warps <= *most);
        (instance && warps.is_multiple_of(k_warps) && warps >= k_warps).then_some(DecodeBlock {
            rows,
            warps,
            k_warps,
        })
    }

    fn kernel(&self, numerics: Numerics) -> &'static str {
        let key = (self.rows, self.k_warps);
        // `new` admits only instances, so the first entry is never taken for another
        let (_, _, exact, fast) = DECODE_INSTANCES
            .iter()
            .find(|(k, ..)| *k == key)
            .unwrap_or(&DECODE_INSTANCES[0]);
        match numerics {
            Numerics::Exact => exact,
            _ => fast,
        }
    }
}

/// Every decode kernel's name, exact and fast (the fused step loads them all).
pub fn decode_kernels() -> impl Iterator<Item = &'static str> {
    DECODE_INSTANCES.iter().flat_map(|(_, _, e, f)| [*e, *f])
}

/// The decode block for an `n` x `k` matrix (H100, Qwen3-8B, docs/performance.md): four rows a
/// warp and eight warps for vocabulary heads, eight warps of two rows for q|k|v-sized
/// matrices; rows past 8192 codes long (down) two a team of two warps, 32 warps a block; two
/// rows and 16 warps otherwise. `BOT_CUDA_DECODE_BLOCK` (see `parse_block_overrides`) replaces
/// it for chosen shapes, for comparisons.
pub fn decode_block(n: usize, k: usize) -> DecodeBlock {
    let (rows, warps, k_warps) = match n {
        n if n >= 65536 => (4, 8, 1),
        n if (6144..16384).contains(&n) => (2, 8, 1),
        _ if k > 8192 => (2, 32, 2),
        _ => (2, 16, 1),
    };
    let measured = DecodeBlock {
        rows,
        warps,
        k_warps,
    };
    block_overrides()
        .iter()
        .find(|o| o.0 == n && o.1 == k)
        .map_or(measured, |o| o.2)
}

/// `BOT_CUDA_DECODE_BLOCK`, parsed once (a malformed value is reported and ignored).
fn block_overrides() -> &'static [(usize, usize, DecodeBlock)] {
    static CELL: std::sync::OnceLock<Vec<(usize, usize, DecodeBlock)>> = std::sync::OnceLock::new();
    CELL.get_or_init(|| {
        let Ok(v) = std::env::var("BOT_CUDA_DECODE_BLOCK") else {
            return Vec::new();
        };
        parse_block_overrides(&v).unwrap_or_else(|e| {
            eprintln!("BOT_CUDA_DECODE_BLOCK ignored: {e}");
            Vec::new()
        })
    })
}

/// Decode block overrides, `NxK=ROWSxWARPSxKWARPS` separated by commas (e.g.
/// `4096x12288=2x32x2`): matrices of N rows of K codes take that block.
pub fn parse_block_overrides(v: &str) -> Result<Vec<(usize, usize, DecodeBlock)>, String> {
    v.split(',')
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let bad = || format!("`{e}`: expected NxK=ROWSxWARPSxKWARPS");
            let (shape, block) = e.trim().split_once('=').ok_or_else(bad)?;
            let nums = |s: &str| -> Result<Vec<usize>, String> {
                s.split('x').map(|t| t.parse().map_err(|_| bad())).collect()
            };
            let (sh, bl) = (nums(shape)?, nums(block)?);
            let (&[n, k], &[r, w, kw]) = (&sh[..], &bl[..]) else {
                return Err(bad());
            };
            let b = DecodeBlock::new(r, w, kw)
                .ok_or_else(|| format!("`{e}`: no decode kernel has that block"))?;
            Ok((n, k, b))
        })
        .collect()
}

/// Whether a prompt product takes `qmm4_f16`: 4 bits, K a multiple of its 128-code step, groups
/// of 32, 64 or 128 codes (a power of two: the kernel shifts), and scales that fp16 holds
/// exactly (bf16 and f16 do; f32 would be rounded).
pub fn f16_prompt(p: &QParams) -> bool {
    p.bits == 4 && p.k % 128 == 0 && matches!(p.group_size, 32 | 64 | 128) && p.sdtype != 2
}

/// Blocks (128 weight rows by 64 x rows) of `qmm4_f16` an H100 holds at once: three an SM of
/// 132 (its launch bounds). `qmm4_f16_b2` (two an SM) kept the earlier rule: double the grid
/// while under 264 blocks.
const QMM4_SLOTS: usize = 396;
const QMM4_B2_TARGET_BLOCKS: usize = 264;

/// `BOT_CUDA_PROMPT_OCC=2`: the two-an-SM `qmm4_f16_b2` and its splits, for comparisons.
fn qmm4_two_an_sm() -> bool {
    static CELL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CELL.get_or_init(|| std::env::var("BOT_CUDA_PROMPT_OCC").is_ok_and(|v| v == "2"))
}

/// The `qmm4_f16` instance prompts run.
pub fn qmm4_kernel() -> &'static str {
    if qmm4_two_an_sm() {
        "qmm4_f16_b2"
    } else {
        "qmm4_f16"
    }
}

/// The most K splits of a `qmm4_f16` tile that can add their partials in one thread-block
/// cluster: 8 blocks is the portable cluster size.
pub const QMM4_CLUSTER_SPLITS: usize = 8;

/// K splits for `qmm4_f16`: the most that keep the grid in one wave of the GPU (a second,
/// partial wave would leave most SMs idle while it runs), each split a whole number of
/// 128-code steps and at least 512 codes long (down_proj's 96 steps split 12 ways: 384 blocks).
pub fn qmm4_splits(n: usize, m: usize, k: usize) -> usize {
    let blocks = n.div_ceil(128) * m.div_ceil(64);
    if qmm4_two_an_sm() {
        return k_splits(blocks, k, 128, 512, QMM4_B2_TARGET_BLOCKS);
    }
    let steps = k / 128;
    (1..=steps)
        .filter(|&s| steps.is_multiple_of(s) && k / s >= 512 && blocks * s <= QMM4_SLOTS)
        .max()
        .unwrap_or(1)
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
    while blocks * s < target && k.is_multiple_of(2 * s * step) && k / (2 * s) >= min_len {
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
                k_warps: 1,
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
        // down (12288 codes a row): teams of two warps
        assert!(matches!(
            matmul(&p(1, 4096, 12288, 4, 64, 0), fast, 0),
            Matmul::Decode4 {
                kernel: "qmv4q_m1_r2_k2",
                warps: 32,
                k_warps: 2,
                passes: 128,
                ..
            }
        ));
        // other widths have no decode kernel
        assert_eq!(matmul(&p(1, 4096, 4096, 8, 64, 0), fast, 0), Matmul::Rows);
    }

    #[test]
    fn decode_blocks_exist_only_where_a_kernel_does() {
        let b = DecodeBlock::new(2, 32, 2).unwrap();
        match decode4_with(4096, 12288, Numerics::Fast, b) {
            Matmul::Decode4 {
                kernel: "qmv4q_m1_r2_k2",
                passes,
                ..
            } => assert_eq!(passes, 4096 / 32),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            DecodeBlock::new(2, 16, 4).map(|b| b.kernel(Numerics::Exact)),
            Some("qmv4_m1_r2_k4")
        );
        for (r, w, kw) in [
            (4, 8, 2),
            (3, 8, 1),
            (2, 6, 4),
            (2, 32, 1),
            (4, 16, 1),
            (2, 1, 2),
        ] {
            assert_eq!(DecodeBlock::new(r, w, kw), None, "{r}x{w}x{kw}");
        }
        // every instance's name is among the kernels the step loads
        let names: Vec<&str> = decode_kernels().collect();
        assert_eq!(names.len(), 2 * DECODE_INSTANCES.len());
        for &((r, kw), most, ..) in DECODE_INSTANCES.iter() {
            assert!(DecodeBlock::new(r, most, kw).is_some());
            let b = DecodeBlock::new(r, 8 * kw, kw).unwrap();
            for num in [Numerics::Exact, Numerics::Fast] {
                assert!(names.contains(&b.kernel(num)), "{b:?} {num:?}");
            }
        }
        let o = parse_block_overrides("4096x12288=2x32x2, 6144x4096=2x8x1").unwrap();
        assert_eq!(o.len(), 2);
        assert_eq!(o[0], (4096, 12288, b));
        for bad in [
            "4096=2x32x2",
            "4096x4096=2x32",
            "4096x4096=3x8x1",
            "x",
            "1x1=2x8x1x1",
        ] {
            assert!(parse_block_overrides(bad).is_err(), "{bad}");
        }
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
        // 64 rows of o_proj: 32 x 1 tiles of 128 x 64, doubled while one wave holds them
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
        // 64 rows of the 8B shape: q|k|v, gate|up and down in one wave of 396 blocks; o (32
        // steps) at 256, as splits of 256 codes would be too short
        assert_eq!(qmm4_splits(6144, 64, 4096), 8);
        assert_eq!(qmm4_splits(24576, 64, 4096), 2);
        assert_eq!(qmm4_splits(4096, 64, 12288), 12);
        assert_eq!(qmm4_splits(4096, 64, 4096), 8);
        assert_eq!(qmm4_splits(24576, 512, 4096), 1);
    }
}
