//! The Metal backend's load-time self-test: every kernel variant the model will dispatch
//! (kernel, width, group size, scale type) runs once on a small random matrix and is compared
//! with the slow reference (`QMatrix::matmul_reference`, `dequantize_row`). A kernel that does
//! not compile, fails to run or disagrees sends the model to the verified route (`Qwen3` says
//! so once). The logic is plain Rust over a `Runner`: on a Mac the runner is the GPU
//! (`metal::quant::GpuRunner`); in the tests it is the C++ shim, and a runner that corrupts an
//! output proves that a mismatch is caught.

use std::collections::BTreeSet;
use std::fmt;

use rand::{Rng, SeedableRng};

use crate::engine::metal::plan::{self, Plan, QParams};
use crate::engine::quant::{random, QMatrix};
use crate::engine::weights::Dtype;

/// One compiled kernel as the model uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Variant {
    pub kernel: &'static str,
    pub bits: i32,
    pub group_size: i32,
    /// 0 bf16, 1 f16, 2 f32 (as `QParams`)
    pub sdtype: i32,
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sd = ["bf16", "f16", "f32"]
            .get(self.sdtype as usize)
            .unwrap_or(&"?");
        write!(
            f,
            "{} ({}-bit, group {}, {sd} scales)",
            self.kernel, self.bits, self.group_size
        )
    }
}

/// Runs one dispatch: `input` is f32 x (or u32 ids for the gather), the result is f32.
pub trait Runner {
    fn run(&self, plan: &Plan, p: &QParams, input: &[u8], w: &QMatrix) -> Result<Vec<f32>, String>;
}

/// Largest error allowed, relative to the largest |reference|: the GPU sums in another order
/// (and with fast math), so not bit for bit; a wrong index or code is off by far more.
pub const TOLERANCE: f32 = 1e-4;

/// The variants a model's matrices run (each given by its `QParams`; `m` is ignored): each
/// projection at a decode step (1 row) and at a prompt (more rows than the decode kernels
/// take), each gathered table's gather.
pub fn variants(matmuls: &[QParams], gathers: &[QParams]) -> BTreeSet<Variant> {
    let of = |plan: Plan, p: QParams| Variant {
        kernel: plan.kernel,
        bits: p.bits,
        group_size: p.group_size,
        sdtype: p.sdtype,
    };
    let mut out = BTreeSet::new();
    for &w in matmuls {
        for m in [1, plan::QMV_MAX_ROWS + 1] {
            let p = QParams { m, ..w };
            out.insert(of(plan::matmul_plan(&p), p));
        }
    }
    for &w in gathers {
        let p = QParams { m: 1, ..w };
        out.insert(of(plan::gather_plan(&p), p));
    }
    out
}

/// `QParams` of an `n x k` matrix (for `variants`).
pub fn shape(n: i32, k: i32, bits: i32, group_size: i32, sdtype: i32) -> QParams {
    QParams {
        m: 1,
        n,
        k,
        bits,
        group_size,
        sdtype,
    }
}

/// What `bot doctor` checks without a model: the variants of mlx_lm's default 4-bit (group
/// 64, bf16 scales) and 8-bit models at Qwen3's shapes.
pub fn common_variants() -> BTreeSet<Variant> {
    let mut all = BTreeSet::new();
    for bits in [4, 8] {
        // a fast projection and a ragged one: the plans depend on N % 8 and K % 512
        let ws = [
            shape(1024, 4096, bits, 64, 0),
            shape(1000, 192, bits, 64, 0),
        ];
        all.extend(variants(&ws, &ws[..1]));
    }
    all
}

/// A small problem that the plans send to `v.kernel`, with its reference result.
pub struct Case {
    pub w: QMatrix,
    pub p: QParams,
    pub plan: Plan,
    pub input: Vec<u8>,
    pub want: Vec<f32>,
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

pub fn case(v: &Variant) -> Case {
    let gs = v.group_size as usize;
    let bits = v.bits as usize;
    let sd = match v.sdtype {
        0 => Dtype::BF16,
        1 => Dtype::F16,
        _ => Dtype::F32,
    };
    // (rows of W, columns, rows of x): the fast decode kernels want K % 512 == 0 and N % 8 == 0,
    // the generic one is reached by a ragged N, the prompt kernel by more rows than decode takes
    let (n, k, m) = match v.kernel {
        "qmv_fast_4" | "qmv_fast_8" => (16, lcm(512, gs), 1),
        "qmv_generic" => (13, 3 * gs, 1),
        "qgather" => (20, 2 * gs, 3),
        _ => (40, 2 * gs, plan::QMV_MAX_ROWS as usize + 4),
    };
    let seed = (v.bits * 7919 + v.group_size * 31 + v.sdtype) as u64;
    let w = random::qmatrix(n, k, bits, gs, sd, seed);
    let p = QParams::new(&w, m);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    if v.kernel == "qgather" {
        let ids: Vec<u32> = vec![n as u32 - 1, 0, 7];
        let mut want = vec![0f32; m * k];
        for (row, &id) in want.chunks_exact_mut(k).zip(&ids) {
            w.dequantize_row(id as usize, row);
        }
        let input = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        return Case {
            plan: plan::gather_plan(&p),
            w,
            p,
            input,
            want,
        };
    }
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1f32..1.0)).collect();
    Case {
        plan: plan::matmul_plan(&p),
        want: w.matmul_reference(&x, m),
        input: x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        w,
        p,
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The largest relative error seen.
    Pass(f32),
    Mismatch(f32),
    Failed(String),
}

/// Each variant once, in order.
pub fn run_all(runner: &dyn Runner, variants: &BTreeSet<Variant>) -> Vec<(Variant, Outcome)> {
    variants
        .iter()
        .map(|v| {
            let c = case(v);
            let outcome = match runner.run(&c.plan, &c.p, &c.input, &c.w) {
                Err(e) => Outcome::Failed(e),
                Ok(got) if got.len() != c.want.len() => {
                    Outcome::Failed(format!("{} outputs, expected {}", got.len(), c.want.len()))
                }
                Ok(got) => {
                    let scale = c.want.iter().fold(f32::MIN_POSITIVE, |a, v| a.max(v.abs()));
                    let err = got
                        .iter()
                        .zip(&c.want)
                        .map(|(g, r)| (g - r).abs() / scale)
                        // a NaN is the worst error there is
                        .fold(
                            0f32,
                            |a, e| if e.is_nan() { f32::INFINITY } else { a.max(e) },
                        );
                    if err <= TOLERANCE {
                        Outcome::Pass(err)
                    } else {
                        Outcome::Mismatch(err)
                    }
                }
            };
            (*v, outcome)
        })
        .collect()
}

/// `Ok` when every variant passed; else what failed, for the user to read once.
pub fn verdict(results: &[(Variant, Outcome)]) -> Result<(), String> {
    let bad: Vec<String> = results
        .iter()
        .filter_map(|(v, o)| match o {
            Outcome::Pass(_) => None,
            Outcome::Mismatch(e) => Some(format!(
                "{v} disagrees with the reference (relative error {e:.1e})"
            )),
            Outcome::Failed(e) => Some(format!("{v} failed: {e}")),
        })
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("self-test: {}", bad.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::metal::shim::ShimRunner;

    /// The projections of Qwen3 0.6B / 8B as mlx_lm stores them (4-bit g64 bf16), an 8-bit
    /// model, and a mixed model with a 6-bit head and f16 scales.
    fn qwen3_variants() -> BTreeSet<Variant> {
        let mut all = BTreeSet::new();
        for (bits, gs, sd, shapes) in [
            (
                4,
                64,
                0,
                &[(2048, 1024), (1024, 1024), (3072, 1024), (1024, 3072)][..],
            ),
            (
                4,
                64,
                0,
                &[(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288)][..],
            ),
            (8, 64, 0, &[(4096, 4096), (12288, 4096)][..]),
            (6, 64, 1, &[(151936, 1024)][..]),
            (4, 32, 2, &[(100, 96)][..]),
        ] {
            let ws: Vec<QParams> = shapes
                .iter()
                .map(|&(n, k)| shape(n, k, bits, gs, sd))
                .collect();
            all.extend(variants(&ws, &ws[..1]));
        }
        all.extend(common_variants());
        all
    }

    #[test]
    fn each_case_reaches_the_kernel_it_tests() {
        let vs = qwen3_variants();
        for k in ["qmv_fast_4", "qmv_fast_8", "qmv_generic", "qmm", "qgather"] {
            assert!(vs.iter().any(|v| v.kernel == k), "{k} not among {vs:?}");
        }
        for v in &vs {
            assert_eq!(case(v).plan.kernel, v.kernel, "{v}");
        }
    }

    #[test]
    fn every_variant_passes_under_the_shim() {
        let results = run_all(&ShimRunner, &qwen3_variants());
        assert!(results.len() >= 10, "{results:?}");
        assert_eq!(verdict(&results), Ok(()), "{results:?}");
    }

    /// A kernel that is wrong by one output, or by a NaN, or that does not compile.
    struct Broken(&'static str, fn(&mut Vec<f32>));
    impl Runner for Broken {
        fn run(&self, plan: &Plan, p: &QParams, x: &[u8], w: &QMatrix) -> Result<Vec<f32>, String> {
            let mut y = ShimRunner.run(plan, p, x, w)?;
            if plan.kernel == self.0 {
                (self.1)(&mut y);
            }
            Ok(y)
        }
    }

    #[test]
    fn a_wrong_kernel_is_caught_and_named() {
        let vs = qwen3_variants();
        for (kernel, spoil) in [
            (
                "qmv_fast_4",
                (|y: &mut Vec<f32>| y[3] += 0.01) as fn(&mut Vec<f32>),
            ),
            ("qmm", |y| y[17] = f32::NAN),
            ("qgather", |y| y.truncate(5)),
        ] {
            let results = run_all(&Broken(kernel, spoil), &vs);
            let why = verdict(&results).unwrap_err();
            assert!(why.contains(kernel), "{why}");
            for (v, o) in &results {
                assert_eq!(
                    matches!(o, Outcome::Pass(_)),
                    v.kernel != kernel,
                    "{v}: {o:?}"
                );
            }
        }
        struct NoCompile;
        impl Runner for NoCompile {
            fn run(
                &self,
                _: &Plan,
                _: &QParams,
                _: &[u8],
                _: &QMatrix,
            ) -> Result<Vec<f32>, String> {
                Err("the MSL source did not compile: expected ';'".into())
            }
        }
        let why = verdict(&run_all(&NoCompile, &vs)).unwrap_err();
        assert!(why.contains("expected ';'"), "{why}");
    }
}
