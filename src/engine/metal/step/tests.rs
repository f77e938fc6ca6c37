//! The planned step, every dispatch of it, run under the C++ shim on the tiny fixture models
//! and compared with the CPU forward (the reference path, itself checked against mlx_lm); and
//! the decode step's dispatch count at Qwen3's real shapes.

use std::path::{Path, PathBuf};

use super::layout::{Arena, BufId};
use super::plan::{Arg, SampleCall};
use super::*;
use crate::engine::metal::shim::runner;
use crate::engine::sample::{decode_kernel_output, KernelParams, SampleState};
use crate::engine::{ModelOptions, Qwen3};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tiny")
        .join(name)
}

/// The step's buffers as files in a directory, and the shim runner over them.
struct Shim {
    dir: tempfile::TempDir,
}

impl Shim {
    fn new(arena: &Arena) -> Self {
        let dir = tempfile::tempdir().unwrap();
        for (i, (_, init)) in arena.bufs.iter().enumerate() {
            let bytes = match init.bytes() {
                Some(b) => b.to_vec(),
                None => vec![0u8; init.len()],
            };
            std::fs::write(dir.path().join(format!("buf_{i}.bin")), bytes).unwrap();
        }
        Shim { dir }
    }

    fn write(&self, id: BufId, bytes: &[u8]) {
        let p = self.dir.path().join(format!("buf_{}.bin", id.0));
        let mut b = std::fs::read(&p).unwrap();
        b[..bytes.len()].copy_from_slice(bytes);
        std::fs::write(p, b).unwrap();
    }

    fn read(&self, id: BufId) -> Vec<u8> {
        std::fs::read(self.dir.path().join(format!("buf_{}.bin", id.0))).unwrap()
    }

    /// Runs the dispatches; every buffer they write is kept for the next run.
    fn run(&self, plan: &[Dispatch]) {
        let mut text = String::new();
        let mut written = std::collections::BTreeSet::new();
        for d in plan {
            text += &format!(
                "D {} {} {} {} {} {} {} {}\n",
                d.kernel,
                d.grid[0],
                d.grid[1],
                d.grid[2],
                d.threads[0],
                d.threads[1],
                d.threads[2],
                d.args.len()
            );
            for (slot, a) in d.args.iter().enumerate() {
                match a {
                    Arg::Buf(id, off) => {
                        text += &format!("B {slot} {} {off}\n", id.0);
                        written.insert(id.0);
                    }
                    Arg::Bytes(b) => {
                        let hex: String = b.iter().map(|v| format!("{v:02x}")).collect();
                        text += &format!("Y {slot} {hex}\n");
                    }
                }
            }
        }
        std::fs::write(self.dir.path().join("plan.txt"), text).unwrap();
        let st = std::process::Command::new(runner("step_runner"))
            .arg(self.dir.path())
            .args(written.iter().map(|v| v.to_string()))
            .status()
            .unwrap();
        assert!(st.success(), "the step runner failed: {st}");
        for id in written {
            let d = self.dir.path();
            std::fs::rename(
                d.join(format!("out_{id}.bin")),
                d.join(format!("buf_{id}.bin")),
            )
            .unwrap();
        }
    }

    fn floats(&self, id: BufId, n: usize) -> Vec<f32> {
        self.read(id)[..4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

fn ids_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Largest |a - b| over the largest |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

const GREEDY: KernelParams = KernelParams {
    greedy: 1,
    inv_temp: 1.0,
    top_p24: 0,
    ln_min_p: f32::NEG_INFINITY,
    top_k: 0,
    penalty: 1.0,
};

/// A prompt of `n` tokens (every row's logits: the prompt kernels; more than 8 rows take the
/// tiled `qmm_step`), then three decode steps (the fused attention), the last one ending with the
/// sampler; each against the CPU forward.
fn step_matches_cpu(mut cpu: Qwen3, what: &str, n: usize) -> Vec<f32> {
    let view = cpu.view();
    assert_eq!(unsupported(&view), None, "{what}");
    let model = StepModel::new(&view, n, n, n + 3).unwrap();
    let shim = Shim::new(&model.arena);
    let vocab = model.d.vocab;
    let prompt: Vec<u32> = [401u32, 17, 250, 3, 402, 99, 7, 300, 42, 11, 12, 13, 260, 5]
        .into_iter()
        .cycle()
        .take(n)
        .collect();
    shim.write(model.acts.ids, &ids_bytes(&prompt));
    let plan = model.plan(prompt.len(), 0, true, None);
    let tiled = plan.iter().any(|d| d.kernel == "qmm_step");
    assert_eq!(tiled, n > 8, "{what}: the prompt kernel");
    shim.run(&plan);
    let want = cpu.forward(&prompt, true, false).unwrap().logits;
    let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
    let got = shim.floats(model.acts.logits, n * vocab);
    let err = rel_err(&got, &want);
    assert!(err <= 1e-4, "{what} prompt: relative error {err:.2e}");
    let mut next = Qwen3::argmax(&want[(n - 1) * vocab..]);
    let mut last = Vec::new();
    for (step, pos) in (0..3).zip(prompt.len()..) {
        shim.write(model.acts.ids, &ids_bytes(&[next]));
        let sample = (step == 2).then_some(SampleCall {
            params: GREEDY,
            threads: 64,
        });
        if sample.is_some() {
            let state = SampleState::new(
                crate::engine::sample::Draw {
                    seed: 1,
                    counter: 0,
                },
                &[],
            );
            shim.write(model.acts.sample_state, &state.to_bytes());
        }
        let plan = model.plan(1, pos, false, sample);
        assert!(plan.iter().any(|d| d.kernel == "attention_step"));
        assert!(!plan.iter().any(|d| d.kernel == "qk_norm_rope_cache"));
        shim.run(&plan);
        let want = cpu.next_logits(&[next]).unwrap();
        let got = shim.floats(model.acts.logits, vocab);
        let err = rel_err(&got, &want);
        assert!(
            err <= 1e-4,
            "{what} decode step {step}: relative error {err:.2e}"
        );
        if sample.is_some() {
            let b = shim.read(model.acts.sample_out);
            let w =
                |i: usize| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
            let s = decode_kernel_output([w(0), w(1), w(2)]).unwrap();
            assert_eq!(
                s.id,
                Qwen3::argmax(&got),
                "{what}: the sampler's greedy token"
            );
        }
        next = Qwen3::argmax(&want);
        last = want;
    }
    last
}

fn load(variant: &str, adapter: Option<&str>) -> Qwen3 {
    crate::engine::load(
        &fixture(variant),
        adapter.map(fixture).as_deref(),
        &ModelOptions::default(),
    )
    .unwrap()
}

#[test]
fn fused_step_at_4_bits_matches_the_cpu_forward_under_the_shim() {
    step_matches_cpu(load("q4g64", None), "q4g64", 5);
    step_matches_cpu(load("q4g64", None), "q4g64", 12);
}

#[test]
fn fused_step_at_other_widths_and_tied_heads_matches_the_cpu_forward_under_the_shim() {
    step_matches_cpu(load("q8g64", None), "q8g64", 12);
    step_matches_cpu(load("q3g64", None), "q3g64", 5);
    step_matches_cpu(load("q4g64_tied", None), "q4g64_tied", 5);
}

/// The LoRA epilogues of every projection (the synthetic adapter covers all seven: q|k|v's A
/// inside its matmul and B inside attention, the others' A products and B epilogues, gate|up's
/// interleaved pairs), and the fixture's own mlx_lm adapter.
#[test]
fn fused_step_with_adapters_matches_the_cpu_forward_under_the_shim() {
    let dir = fixture("q4g64");
    let cfg = crate::engine::Qwen3Config::from_dir(&dir).unwrap();
    let store = crate::engine::WeightStore::open_dir(&dir).unwrap();
    let dev = candle_core::Device::Cpu;
    let adapter = crate::engine::synthetic::lora(&cfg, 3, &dev).unwrap();
    let cpu = Qwen3::new(cfg, &store, Some(adapter), &ModelOptions::default()).unwrap();
    let with = step_matches_cpu(cpu, "q4g64 + synthetic adapter", 12);
    let without = step_matches_cpu(load("q4g64", None), "q4g64", 12);
    // the adapter changes the logits by more than the tolerance: its terms were exercised
    assert!(
        rel_err(&with, &without) > 1e-3,
        "the synthetic adapter changed nothing"
    );
    step_matches_cpu(load("q4g64", Some("adapter")), "q4g64 + fixture adapter", 5);
}

/// Qwen3 0.6B, 4B and 8B: a decode step is at most eight dispatches a layer (five without an
/// adapter) and three a token, every projection on the 4-bit word-load kernel.
#[test]
fn decode_step_dispatch_counts_at_qwen3_shapes() {
    // (hidden, intermediate, heads, kv heads, layers)
    for (h, i, nh, nkv, layers) in [
        (1024, 3072, 16, 8, 28),
        (2560, 9728, 32, 8, 36),
        (4096, 12288, 32, 8, 36),
    ] {
        let d = layout::Dims {
            h,
            nh,
            nkv,
            hd: 128,
            inter: i,
            vocab: 151936,
            eps: 1e-6,
            theta: 1e6,
        };
        for (lora, want) in [(None, 5), (Some(8), 8)] {
            let m = StepModel::shaped(d, layers, 4, 64, lora);
            let (per_layer, per_token) = decode_counts(&m, 1024);
            assert_eq!(per_layer, want, "hidden {h}, adapter {lora:?}");
            assert!(per_layer <= 8);
            assert_eq!(per_token, 3, "hidden {h}");
            let plan = m.plan(1, 7, false, None);
            let mats: Vec<&str> = plan
                .iter()
                .filter(|d| d.kernel.starts_with("qmv"))
                .map(|d| d.kernel)
                .collect();
            assert_eq!(mats.len(), 4 * layers + 1);
            assert!(
                mats.iter().all(|k| *k == "qmv4_step"),
                "hidden {h}: {mats:?}"
            );
        }
    }
}

/// Every buffer a kernel writes under the shim is declared written for the GPU's encoder
/// (`plan::written`), or its readers could run before it is done.
#[test]
fn every_written_slot_is_declared() {
    // the kernels' writable parameters, read off the MSL: `device T*` without `const`
    let src = format!(
        "{}\n{}",
        super::source(),
        crate::engine::sample::metal_source()
    );
    for kernel in [
        "qgather",
        "qmv4_step",
        "qmvg_step",
        "qmm_step",
        "lora_a_step",
        "qk_norm_rope_cache",
        "attention_step",
        "sample_f32",
    ] {
        let start = src.find(&format!("kernel void {kernel}(")).unwrap();
        let sig = &src[start..start + src[start..].find('{').unwrap()];
        let mut writable: Vec<usize> = sig
            .split(',')
            .filter(|p| p.contains("device ") && !p.contains("device const"))
            .map(|p| {
                let i = p.find("[[buffer(").unwrap() + 9;
                p[i..i + p[i..].find(')').unwrap()].parse().unwrap()
            })
            .collect();
        writable.sort();
        assert_eq!(writable, plan::written(kernel), "{kernel}");
    }
}

/// With hidden states kept, the GPU reads x after the embedding and after every layer: as many
/// reads as `Qwen3::forward` keeps states before the final norm, at the layer boundaries.
#[test]
fn hidden_state_segments_end_at_every_layer() {
    let cpu = load("q4g64", None);
    let model = StepModel::new(&cpu.view(), 3, 3, 8).unwrap();
    for (m, sample) in [
        (3, None),
        (
            1,
            Some(SampleCall {
                params: GREEDY,
                threads: 64,
            }),
        ),
    ] {
        let plan = model.plan(m, 0, false, sample);
        let segs = plan::hidden_segments(&plan);
        let reads = segs.iter().filter(|(_, r)| *r).count();
        assert_eq!(reads, model.layers.len() + 1);
        assert_eq!(segs.iter().map(|(r, _)| r.len()).sum::<usize>(), plan.len());
        assert_eq!(
            plan[segs[0].0.clone()]
                .iter()
                .map(|d| d.kernel)
                .collect::<Vec<_>>(),
            ["qgather"]
        );
        for (i, (r, _)) in segs[1..=model.layers.len()].iter().enumerate() {
            assert!(plan[r.clone()].iter().all(|d| d.layer == Some(i)));
        }
        let (last, read) = segs.last().unwrap();
        assert!(!read && plan[last.clone()].iter().all(|d| d.layer.is_none()));
    }
}

/// The step's matmuls alone at Qwen3's depths (K 1024, 4096, 12288), N that fill no tile, decode
/// and prompt row counts, with the input norm inside and the residual epilogue: against the
/// slow reference, `residual + rms_norm(x) @ W^T`.
#[test]
fn step_matmuls_at_qwen3_depths_match_the_reference_under_the_shim() {
    use crate::engine::quant::random::qmatrix;
    use crate::engine::weights::Dtype;
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let eps = 1e-6f32;
    for (n, k, bits, ms) in [
        (20, 1024, 4, &[1, 5, 64, 100][..]),
        (20, 4096, 4, &[1, 5, 100][..]),
        (12, 12288, 4, &[1, 40][..]),
        (20, 4096, 8, &[1, 9][..]),
    ] {
        let w = std::sync::Arc::new(qmatrix(n, k, bits, 64, Dtype::BF16, k as u64 + bits as u64));
        for &m in ms {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1f32..1.0)).collect();
            let g: Vec<f32> = (0..k).map(|_| rng.random_range(0.5f32..1.5)).collect();
            let res: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1f32..1.0)).collect();
            let mut a = Arena::default();
            let p = layout::Proj::shared(&mut a, "w", &w);
            let (xb, gb, yb) = (a.floats("x", &x), a.floats("g", &g), a.floats("y", &res));
            let t = a.floats("t", &[0.0]);
            let mut plan = Vec::new();
            let finish = plan::Finish {
                norm: Some(gb),
                residual: true,
                ..Default::default()
            };
            plan::matmul(&mut plan, &p, Arg::Buf(xb, 0), m, yb, finish, t, eps);
            let kernel = plan[0].kernel;
            let shim = Shim::new(&a);
            shim.run(&plan);
            let got = shim.floats(yb, m * n);
            let xn: Vec<f32> = x
                .chunks_exact(k)
                .flat_map(|r| {
                    let s = 1.0 / (r.iter().map(|v| v * v).sum::<f32>() / k as f32 + eps).sqrt();
                    r.iter()
                        .zip(&g)
                        .map(move |(v, w)| v * s * w)
                        .collect::<Vec<_>>()
                })
                .collect();
            let want: Vec<f32> = w
                .matmul_reference(&xn, m)
                .iter()
                .zip(&res)
                .map(|(a, b)| a + b)
                .collect();
            let err = rel_err(&got, &want);
            assert!(
                err <= 1e-5,
                "{kernel} bits {bits} N {n} K {k} M {m}: relative error {err:.2e}"
            );
        }
    }
}

/// Qwen3's real head_dim (128): attention with four values a lane, RoPE over 64 pairs, and
/// the fixture's adapter.
#[test]
fn fused_step_at_head_dim_128_matches_the_cpu_forward_under_the_shim() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hd128");
    let opts = ModelOptions::default();
    let cpu = crate::engine::load(&dir.join("q4g64"), None, &opts).unwrap();
    step_matches_cpu(cpu, "hd128", 12);
    let cpu = crate::engine::load(&dir.join("q4g64"), Some(&dir.join("adapter")), &opts).unwrap();
    step_matches_cpu(cpu, "hd128 + adapter", 5);
}
