//! Which Metal kernel of `metal/qmatmul.metal` runs a quantized product or gather, and on what
//! grid. Plain Rust, compiled on every platform: the Metal forward (`metal::quant`) dispatches
//! exactly these plans, and the tests run the same plans through the C++ shim
//! (`tests/metal_shim/`) against the slow reference, so the kernels' logic is proven without a Mac.

/// The MSL source, compiled at run time by the Metal device.
pub const SOURCE: &str = include_str!("qmatmul.metal");

pub use crate::engine::quant::QParams;

/// A dispatch: kernel name, threadgroups in the grid, threads per threadgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub kernel: &'static str,
    pub grid: [usize; 3],
    pub threads: [usize; 3],
}

/// Rows of x up to which the decode kernels run (they stream W once per row of x).
pub const QMV_MAX_ROWS: i32 = 8;

pub fn matmul_plan(p: &QParams) -> Plan {
    let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
    if p.m > QMV_MAX_ROWS {
        return Plan {
            kernel: "qmm",
            grid: [n.div_ceil(32), m.div_ceil(32), 1],
            threads: [32, 8, 1],
        };
    }
    let fast = k % 512 == 0 && n % 8 == 0;
    let kernel = match (p.bits, fast) {
        (4, true) => "qmv_fast_4",
        (8, true) => "qmv_fast_8",
        _ => "qmv_generic",
    };
    Plan {
        kernel,
        grid: [n.div_ceil(8), m, 1],
        threads: [64, 1, 1],
    }
}

/// `p.m` ids, each a row of `p.k` values.
pub fn gather_plan(p: &QParams) -> Plan {
    Plan {
        kernel: "qgather",
        grid: [(p.k as usize).div_ceil(256), p.m as usize, 1],
        threads: [256, 1, 1],
    }
}

#[cfg(test)]
mod tests {
    //! The MSL kernels, compiled as C++ under `tests/metal_shim/shim.h`, against the slow
    //! reference.
    use super::*;
    use crate::engine::quant::testutil::random_qmatrix;
    use crate::engine::weights::Dtype;
    use rand::{Rng, SeedableRng};

    fn run(plan: &Plan, p: &QParams, x: &[u8], w: &crate::engine::QMatrix) -> Vec<f32> {
        use crate::engine::metal::selftest::Runner;
        crate::engine::metal::shim::ShimRunner
            .run(plan, p, x, w)
            .unwrap()
    }

    /// `m` random rows through the planned kernel under the shim: the kernel and its largest
    /// error relative to the largest |reference|.
    fn run_against_reference(
        w: &crate::engine::QMatrix,
        m: usize,
        rng: &mut rand::rngs::StdRng,
    ) -> (&'static str, f32) {
        let k = w.cols;
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1f32..1.0)).collect();
        let p = QParams::new(w, m);
        let plan = matmul_plan(&p);
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got = run(&plan, &p, &bytes, w);
        let want = w.matmul_reference(&x, m);
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |a, (g, r)| a.max((g - r).abs()))
            / scale;
        (plan.kernel, err)
    }

    #[test]
    fn msl_matmul_kernels_match_the_reference_under_the_shim() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut seen = std::collections::BTreeSet::new();
        // (N, K): fast-path shapes, and tails the fast path must leave to the generic kernel
        let shapes = [(16, 512), (24, 1024), (13, 128), (8, 640)];
        for bits in [4, 8, 3] {
            for gs in [32, 64, 128] {
                for (i, &(n, k)) in shapes.iter().enumerate() {
                    if k % gs != 0 {
                        continue;
                    }
                    let sd = [Dtype::BF16, Dtype::F16, Dtype::F32][(i + gs / 32) % 3];
                    let w = random_qmatrix(n, k, bits, gs, sd, (bits * 1000 + gs + i) as u64);
                    for m in [1, 5, 64] {
                        if bits == 3 && m == 64 && gs != 64 {
                            continue; // keep the thread-per-lane emulation quick
                        }
                        let (kernel, err) = run_against_reference(&w, m, &mut rng);
                        seen.insert(kernel);
                        assert!(
                            err <= 1e-5,
                            "{kernel} bits {bits} gs {gs} N {n} K {k} M {m} {sd}: relative error {err:.2e}"
                        );
                    }
                }
            }
        }
        for k in ["qmv_fast_4", "qmv_fast_8", "qmv_generic", "qmm"] {
            assert!(seen.contains(k), "{k} was not exercised");
        }
    }

    #[test]
    fn msl_gather_matches_dequantized_rows_under_the_shim() {
        for bits in [4, 8, 5] {
            let w = random_qmatrix(20, 384, bits, 128, Dtype::BF16, 4);
            let ids = [3u32, 19, 0, 3];
            let p = QParams::new(&w, ids.len());
            let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
            let got = run(&gather_plan(&p), &p, &bytes, &w);
            let mut want = vec![0f32; ids.len() * 384];
            for (row, &id) in want.chunks_exact_mut(384).zip(&ids) {
                w.dequantize_row(id as usize, row);
            }
            assert_eq!(got, want, "bits {bits}");
        }
    }

    /// Every projection and the head of Qwen3 0.6B, 4B and 8B takes a fast decode kernel and
    /// the tiled prompt kernel.
    #[test]
    fn qwen3_projections_get_the_fast_kernels() {
        // (hidden, intermediate, q rows, kv rows)
        for (h, i, q, kv) in [
            (1024, 3072, 2048, 1024),
            (2560, 9728, 4096, 1024),
            (4096, 12288, 4096, 1024),
        ] {
            let shapes = [(q, h), (kv, h), (h, q), (i, h), (h, i), (151936, h)];
            for bits in [4, 8] {
                for (n, k) in shapes {
                    let p = |m| QParams {
                        m,
                        n,
                        k,
                        bits,
                        group_size: 64,
                        sdtype: 0,
                    };
                    assert_eq!(
                        matmul_plan(&p(1)).kernel,
                        format!("qmv_fast_{bits}"),
                        "{n}x{k}"
                    );
                    assert_eq!(
                        matmul_plan(&p(QMV_MAX_ROWS)).kernel,
                        format!("qmv_fast_{bits}")
                    );
                    assert_eq!(matmul_plan(&p(64)).kernel, "qmm", "{n}x{k}");
                }
            }
        }
    }

    /// Qwen3's real K (1024, 4096, 12288), N that fill no tile, and decode and prompt row counts.
    #[test]
    fn msl_kernels_at_qwen3_depths_under_the_shim() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for (n, k, ms) in [
            (24, 1024, &[1, 5, 64, 100][..]),
            (20, 4096, &[1, 5, 100][..]),
            (13, 12288, &[1, 5][..]),
        ] {
            let w = random_qmatrix(n, k, 4, 64, Dtype::BF16, k as u64);
            for &m in ms {
                let (kernel, err) = run_against_reference(&w, m, &mut rng);
                assert!(
                    err <= 1e-5,
                    "{kernel} N {n} K {k} M {m}: relative error {err:.2e}"
                );
            }
        }
    }
}
