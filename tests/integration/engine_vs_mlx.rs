//! The engine against references computed by mlx_lm itself (tests/fixtures/tiny, made by
//! ../shared/oracle with mlx 0.32.4 / mlx_lm 0.32.2). Our compute is f32, so it is compared
//! with mlx's f32 references (`*_f32` keys; the native keys of the f32 variant).
//!
//! Tolerances: logits max |Δ| ≤ 1e-3 (the bar; measured ≤ 2.1e-5 on every variant),
//! hidden states max |Δ| ≤ 1e-4 on values up to ~9 (measured ≤ 8.3e-6), greedy ids identical
//! unless mlx's recorded top-1/top-2 margin at that step is below 1e-4.

use bot::engine::{self, Adapter, ModelOptions, Numerics, Qwen3, Qwen3Config, WeightStore};

use crate::common::*;

const LOGIT_TOL: f32 = 1e-3;
const HIDDEN_TOL: f32 = 1e-4;
const MARGIN_EXEMPT: f64 = 1e-4;

fn load(variant: &str, lora: bool, kernel: Numerics) -> Qwen3 {
    load_at(&fixtures(), variant, lora, kernel)
}

fn load_at(root: &std::path::Path, variant: &str, lora: bool, kernel: Numerics) -> Qwen3 {
    let adapter = root.join("adapter");
    let opts = ModelOptions {
        kernel,
        device: test_device(),
        ..ModelOptions::default()
    };
    engine::load(
        &root.join(variant),
        lora.then_some(adapter.as_path()),
        &opts,
    )
    .unwrap()
}

fn key(prefix: &str, kind: &str, f32_native: bool) -> String {
    if f32_native {
        format!("{prefix}_{kind}")
    } else {
        format!("{prefix}_{kind}_f32")
    }
}

fn to_vec(t: &candle_core::Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// Compares greedy ids with mlx_lm's, allowing a difference only at a near-tie.
fn assert_greedy_matches(label: &str, got: &[u32], reference: &serde_json::Value) {
    let want: Vec<u32> = reference["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let margins: Vec<f64> = reference["top1_top2_logprob_margin"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(got.len(), want.len(), "{label}");
    if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
        assert!(
            margins[i] < MARGIN_EXEMPT,
            "{label}: greedy step {i} gives {} but mlx_lm gives {} (margin {:.3e})\n got  {got:?}\n want {want:?}",
            got[i],
            want[i],
            margins[i]
        );
        eprintln!(
            "{label}: step {i} differs at a near-tie (margin {:.3e}); later steps not compared",
            margins[i]
        );
    }
}

#[test]
fn logits_and_hidden_states_match_mlx_f32_on_every_variant() {
    let sets = fixture_sets();
    assert!(
        sets[0].1.len() >= 7,
        "fixture variants missing: {:?}",
        sets[0]
    );
    assert!(
        sets[1].1.len() >= 2,
        "head_dim-128 variants missing: {:?}",
        sets[1]
    );
    for (root, v, f32n) in sets
        .iter()
        .flat_map(|(root, vs)| vs.iter().map(move |(v, f)| (root, v.clone(), *f)))
    {
        let r = Reference::open_at(root, &v);
        let v = format!("{}/{v}", root.file_name().unwrap().to_string_lossy());
        let variant = v.rsplit('/').next().unwrap();
        let ids = r.prompt_ids();
        for (kind, lora) in [("base", false), ("lora", true)] {
            let mut m = load_at(root, variant, lora, Numerics::Exact);
            let out = m.forward(&ids, true, true).unwrap();
            let (want, shape) = r.f32(&key("logits", kind, f32n));
            let got = to_vec(&out.logits);
            assert_eq!(out.logits.dims(), &shape[..]);
            let d = max_abs_diff(&got, &want);
            assert!(
                d <= LOGIT_TOL,
                "{v} {kind}: full-sequence logits differ by {d}"
            );
            let last = shape[1];
            let dl = max_abs_diff(&got[got.len() - last..], &want[want.len() - last..]);
            assert!(
                dl <= LOGIT_TOL,
                "{v} {kind}: last-position logits differ by {dl}"
            );
            let hk = key("hidden", kind, f32n);
            if r.has(&hk) {
                let (hw, hs) = r.f32(&hk);
                assert_eq!(
                    out.hidden.len(),
                    hs[0] + 1,
                    "embedding + layers + final norm"
                );
                let per = hs[1] * hs[2];
                for (i, h) in out.hidden.iter().take(hs[0]).enumerate() {
                    let d = max_abs_diff(&to_vec(h), &hw[i * per..(i + 1) * per]);
                    assert!(
                        d <= HIDDEN_TOL,
                        "{v} {kind}: hidden state {i} differs by {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn greedy_32_steps_with_kv_cache_match_mlx() {
    for (root, vs) in fixture_sets() {
        for (v, f32n) in vs {
            let ids = Reference::open_at(&root, &v).prompt_ids();
            for (kind, lora) in [("base", false), ("lora", true)] {
                let mut m = load_at(&root, &v, lora, Numerics::Exact);
                let (_, got) = m.greedy(&ids, 32).unwrap();
                let want = greedy_ref_at(&root, &v, kind, f32n);
                assert_greedy_matches(&format!("{} {v} {kind}", root.display()), &got, &want);
            }
        }
    }
}

#[test]
fn token_by_token_decode_equals_full_forward() {
    let v = "q4g64";
    let ids = Reference::open(v).prompt_ids();
    let mut m = load(v, true, Numerics::Exact);
    let (_, gen) = m.greedy(&ids, 12).unwrap();
    let all: Vec<u32> = ids.iter().chain(&gen).copied().collect();
    m.reset();
    let full = to_vec(&m.forward(&all, true, false).unwrap().logits);
    let vocab = full.len() / all.len();
    m.reset();
    // prompt in two chunks (prefill with an offset), then one token at a time
    let split = ids.len() / 2;
    let mut inc = to_vec(&m.forward(&all[..split], true, false).unwrap().logits);
    inc.extend(to_vec(
        &m.forward(&all[split..ids.len()], true, false)
            .unwrap()
            .logits,
    ));
    for &t in &gen {
        inc.extend(to_vec(&m.forward(&[t], true, false).unwrap().logits));
    }
    assert_eq!(m.offset(), all.len());
    let d = max_abs_diff(&inc, &full);
    assert!(
        d <= 1e-4,
        "cached decode differs from the full forward by {d}"
    );
    assert_eq!(inc.len(), all.len() * vocab);
}

/// Fails if the adapter were not applied, or applied with `scale / rank` (mlx_lm uses the
/// scale as is: dividing by the rank made an earlier port 8x too weak).
#[test]
fn lora_scale_is_used_as_is() {
    let v = "q4g64_f32";
    let r = Reference::open(v);
    let ids = r.prompt_ids();
    let (want, _) = r.f32("logits_lora");
    let (base, _) = r.f32("logits_base");
    assert!(
        max_abs_diff(&want, &base) > 100.0 * LOGIT_TOL,
        "the fixture adapter must matter"
    );

    let dir = fixtures().join(v);
    let logits_with = |adapter: Adapter| {
        let cfg = Qwen3Config::from_dir(&dir).unwrap();
        let store = WeightStore::open_dir(&dir).unwrap();
        let mut m = Qwen3::new(cfg, &store, Some(adapter), &ModelOptions::default()).unwrap();
        to_vec(&m.forward(&ids, true, false).unwrap().logits)
    };
    let adapter = Adapter::load(&fixtures().join("adapter"), &candle_core::Device::Cpu).unwrap();
    assert_eq!((adapter.scale, adapter.rank), (20.0, 8));
    assert!(max_abs_diff(&logits_with(adapter.clone()), &want) <= LOGIT_TOL);
    let mut divided = adapter.clone();
    for b in divided.branches.values_mut() {
        b.scale /= divided.rank as f64;
    }
    let d = max_abs_diff(&logits_with(divided), &want);
    assert!(
        d > 100.0 * LOGIT_TOL,
        "scale/rank would have passed (diff {d})"
    );
}

/// The slow reference's dequantization equals `mx.dequantize` on mlx_lm's own files.
#[test]
fn dequantize_reference_equals_mx_dequantize() {
    for (v, f32n) in variants() {
        let r = Reference::open(&v);
        let dir = fixtures().join(&v);
        let cfg = Qwen3Config::from_dir(&dir).unwrap();
        let store = WeightStore::open_dir(&dir).unwrap();
        let name = "model.layers.0.self_attn.q_proj";
        let (want, shape) = r.f32(&format!("dequant/{name}"));
        let p = cfg
            .quant_for(&store, name, shape[1])
            .unwrap()
            .expect("quantized");
        let manifest = manifest();
        assert_eq!(
            p.bits as u64,
            manifest["variants"][&v]["bits"].as_u64().unwrap()
        );
        assert_eq!(
            p.group_size as u64,
            manifest["variants"][&v]["group_size"].as_u64().unwrap()
        );
        let q = bot::engine::QMatrix::from_tensors(
            name,
            shape[0],
            shape[1],
            p,
            store.require(&format!("{name}.weight")).unwrap(),
            store.require(&format!("{name}.scales")).unwrap(),
            store.require(&format!("{name}.biases")).unwrap(),
        )
        .unwrap();
        // mx.dequantize computes in the scales' dtype: with bf16 scales `s*q` and `+ b` each
        // round to 8 significant bits, so the error scales with the row's magnitude; the f32
        // variant is compared exactly (to f32 rounding).
        let rel = if f32n { 0.0 } else { 1.0 / 128.0 };
        let got = q.dequantize();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let row = &want[i / shape[1] * shape[1]..(i / shape[1] + 1) * shape[1]];
            let tol = 1e-6 + rel * row.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(
                (g - w).abs() <= tol,
                "{v}: element {i}: {g} vs mx.dequantize {w}"
            );
        }
    }
}

/// The slice-based CPU attention equals the candle-op attention (prefill with an offset, then
/// decode steps), so the GPU backends, which use the candle ops, compute the same thing.
#[test]
fn cpu_attention_equals_candle_op_attention() {
    let v = "q4g64_tied";
    let ids = Reference::open(v).prompt_ids();
    let run = |reference: bool| {
        let mut m = load(v, true, Numerics::Exact);
        m.use_reference_attention(reference);
        let mut out = to_vec(&m.forward(&ids[..10], true, false).unwrap().logits);
        out.extend(to_vec(&m.forward(&ids[10..], true, false).unwrap().logits));
        for t in [5u32, 77, 300] {
            out.extend(to_vec(&m.forward(&[t], true, false).unwrap().logits));
        }
        out
    };
    let d = max_abs_diff(&run(false), &run(true));
    // summation order differs: f32 rounding on logits of magnitude ~10
    assert!(d <= 1e-4, "CPU attention differs from candle ops by {d}");
}

/// The default mode (`fast`: 15-bit integer activations for 4-bit weights, the exact
/// arithmetic for other widths, the KV cache in f16 either way) gives mlx_lm's greedy ids on
/// every variant. Its logits stay within 2e-2 of mlx's f32 references (measured ≤ 1.24e-2 on logits up
/// to ~12 with the f16 KV cache, ≤ 1.19e-2 with an f32 one): rounding x to 15 bits errs by
/// ≤ max|x|/32766 per value, and because MLX's codes
/// are unsigned (0..15, zero point in the bias) the error is carried by `s·Σq·Δx` without the
/// cancellation the bias gives the exact sum; it grows through the layers to ~1e-3 relative.
#[test]
fn fast_kernel_matches_mlx_on_every_variant() {
    for (v, f32n) in variants() {
        let r = Reference::open(&v);
        let ids = r.prompt_ids();
        for (kind, lora) in [("base", false), ("lora", true)] {
            let mut m = load(&v, lora, Numerics::Fast);
            let got = to_vec(&m.forward(&ids, true, false).unwrap().logits);
            let d = max_abs_diff(&got, &r.f32(&key("logits", kind, f32n)).0);
            assert!(d <= 2e-2, "{v} {kind} fast: logits differ by {d}");
            let (_, got) = m.greedy(&ids, 32).unwrap();
            assert_greedy_matches(
                &format!("{v} {kind} fast"),
                &got,
                &greedy_ref(&v, kind, f32n),
            );
        }
    }
}

/// `int8` (8-bit activations for 4-bit weights: prompts in blocks of 64 through `vpdpbusd`
/// on AVX-512 VNNI, elsewhere `fast`'s prompt GEMMs; decode steps in blocks of 32) stays
/// within INT8_TOL of mlx_lm's f32 logits on every variant: a whole prompt's logits, and the
/// same positions decoded one token at a time. Measured ≤ 0.54 for prompts and ≤ 0.49 for
/// steps on the 4-bit variants (logits up to ~12; the other widths compute as `exact`, ≤ 1e-2):
/// 8-bit activations round like bf16 does (`repack`'s 0.6 below), and with the bias term on
/// the codes' sums (`vnni::int8::quantized_sum`, `IntActs::code_sums`); with the exact sums
/// it was 0.93-1.81. A broken code, scale or layout moves logits by whole units. Greedy ids
/// are not asserted: `int8` may flip near-ties, as its help says.
#[test]
fn int8_kernel_stays_close_to_mlx_on_every_variant() {
    const INT8_TOL: f32 = 0.75;
    let mut worst = (0f32, 0f32);
    for (v, f32n) in variants() {
        let r = Reference::open(&v);
        let ids = r.prompt_ids();
        for (kind, lora) in [("base", false), ("lora", true)] {
            let want = r.f32(&key("logits", kind, f32n)).0;
            let mut m = load(&v, lora, Numerics::Int8);
            let prompt = to_vec(&m.forward(&ids, true, false).unwrap().logits);
            let mut m = load(&v, lora, Numerics::Int8);
            let mut steps = Vec::new();
            for &id in &ids {
                steps.extend(to_vec(&m.forward(&[id], false, false).unwrap().logits));
            }
            let (dp, ds) = (max_abs_diff(&prompt, &want), max_abs_diff(&steps, &want));
            eprintln!("{v} {kind} int8: prompt max |Δ| {dp:.3e}, steps {ds:.3e}");
            worst = (worst.0.max(dp), worst.1.max(ds));
            assert!(
                dp <= INT8_TOL,
                "{v} {kind} int8 prompt: logits differ by {dp}"
            );
            assert!(
                ds <= INT8_TOL,
                "{v} {kind} int8 steps: logits differ by {ds}"
            );
        }
    }
    eprintln!(
        "int8: worst max |Δ| prompt {:.3e}, steps {:.3e} (bound {INT8_TOL})",
        worst.0, worst.1
    );
}

/// `--qmatmul repack` (candle's Q4_1 kernels; on the CPU they round activations to 8 bits per
/// 32 values) against mlx_lm's f32 logits on the 4-bit variants. Measured max |Δ| 0.37-0.47 on
/// the bf16 variants: the size of mlx_lm's own bf16-vs-f32 difference on these fixtures
/// (0.76-1.03, manifest `native_bf16_vs_f32_max_abs_logit_diff`), as 8-bit activations round
/// like bf16 does. REPACK_TOL = 0.6 fails if the repack broke a single nibble or scale (that
/// moves logits by whole units); on CUDA the bound is 1.5 (measured 1.11). The f32 variant's scales are not f16-exact, so it stays native
/// and must match as tightly as the native path.
#[test]
fn repack_route_stays_close_to_mlx_on_4bit_variants() {
    // candle's CUDA Q4_1 kernels quantize activations to 8 bits: measured up to 1.54 on an H100.
    let repack_tol: f32 = if test_device().is_cpu() { 0.6 } else { 2.0 };
    let mut worst = 0f32;
    for (v, f32n) in variants().into_iter().filter(|(v, _)| v.starts_with("q4")) {
        let r = Reference::open(&v);
        let ids = r.prompt_ids();
        for (kind, lora) in [("base", false), ("lora", true)] {
            let adapter = fixtures().join("adapter");
            let opts = ModelOptions {
                kernel: Numerics::Exact,
                device: test_device(),
                route: bot::engine::QMatmulRoute::Repack,
                ..ModelOptions::default()
            };
            let mut m = engine::load(
                &fixtures().join(&v),
                lora.then_some(adapter.as_path()),
                &opts,
            )
            .unwrap();
            let layers = m.cfg.num_hidden_layers;
            assert_eq!(
                m.repacked_projections(),
                if f32n { 0 } else { 7 * layers + 1 },
                "{v}"
            );
            let got = to_vec(&m.forward(&ids, true, false).unwrap().logits);
            let d = max_abs_diff(&got, &r.f32(&key("logits", kind, f32n)).0);
            eprintln!("{v} {kind} repack: max |Δ| {d:.3e}");
            worst = worst.max(d);
            let tol = if f32n { LOGIT_TOL } else { repack_tol };
            assert!(d <= tol, "{v} {kind} repack: logits differ by {d}");
        }
    }
    eprintln!("repack worst {worst:.3e}");
}

/// The verified route a Mac takes when its Metal kernels fail the load-time self-test: every
/// matrix leaves our kernels (candle's Q4_1 where the repack is exact, dense f32 elsewhere) and
/// the embedding is gathered on the CPU. On every variant it must stay as close to mlx_lm as
/// the repack route (4-bit, f16-exact scales) or as the native path (dense).
#[test]
fn verified_route_stays_close_to_mlx_on_every_variant() {
    let repack_tol: f32 = if test_device().is_cpu() { 0.6 } else { 2.0 };
    for (v, f32n) in variants() {
        let r = Reference::open(&v);
        let ids = r.prompt_ids();
        let mut m = load(&v, true, Numerics::Exact);
        assert!(m.native_matrices() > 0, "{v}");
        m.use_verified_route().unwrap();
        assert_eq!(
            m.native_matrices(),
            0,
            "{v}: a matrix is still on our kernels"
        );
        let repacked = m.repacked_projections() > 0;
        assert_eq!(repacked, v.starts_with("q4") && !f32n, "{v}");
        let got = to_vec(&m.forward(&ids, true, false).unwrap().logits);
        let d = max_abs_diff(&got, &r.f32(&key("logits", "lora", f32n)).0);
        eprintln!("{v} verified route: max |Δ| {d:.3e}");
        let tol = if repacked { repack_tol } else { LOGIT_TOL };
        assert!(d <= tol, "{v} verified route: logits differ by {d}");
    }
}

/// A model split over two shards with `model.safetensors.index.json` (as large mlx_lm
/// models are) loads and computes the same logits as the single file.
#[test]
fn sharded_model_equals_single_file() {
    use bot::engine::weights::{plan_safetensors, SafetensorsFile};
    let v = "q4g64";
    let src = fixtures().join(v);
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
    }
    let file = SafetensorsFile::open(&src.join("model.safetensors")).unwrap();
    let names: Vec<&String> = file.tensors.keys().collect();
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in names.chunks(names.len() / 2 + 1).enumerate() {
        let shard_name = format!("model-0000{}-of-00002.safetensors", shard + 1);
        let list: Vec<_> = part
            .iter()
            .map(|n| {
                let t = file.get(n).unwrap();
                ((*n).clone(), t.dtype, t.shape.clone())
            })
            .collect();
        let plan = plan_safetensors(&list);
        let mut buf = vec![0u8; plan.bytes_total];
        buf[..plan.header.len()].copy_from_slice(&plan.header);
        for ((n, _, _), r) in list.iter().zip(&plan.ranges) {
            buf[r.clone()].copy_from_slice(&file.get(n).unwrap().bytes);
            weight_map.insert(n.clone(), shard_name.clone().into());
        }
        std::fs::write(tmp.path().join(&shard_name), buf).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        tmp.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let ids = Reference::open(v).prompt_ids();
    let opts = ModelOptions {
        device: test_device(),
        ..ModelOptions::default()
    };
    let mut sharded = engine::load(tmp.path(), None, &opts).unwrap();
    let mut single = load(v, false, Numerics::Exact);
    let a = to_vec(&sharded.forward(&ids, true, false).unwrap().logits);
    let b = to_vec(&single.forward(&ids, true, false).unwrap().logits);
    assert_eq!(a, b);
}

/// The fused CUDA step (graph-replayed and eager) against candle ops on the GPU: logits and
/// hidden states of the prompt, then 300 decode steps, past the KV cache's first growth (256
/// positions, which also re-captures the graph), with and without LoRA, in both kernel modes.
/// Graph and eager run the same kernels, so they must agree bit for bit.
#[cfg(feature = "cuda")]
#[test]
fn fused_cuda_step_equals_candle_ops() {
    use bot::engine::device::{select, DeviceKind};
    use bot::engine::CudaStep;
    let dev = select(DeviceKind::Cuda)
        .expect("a `cuda` build's tests need a GPU")
        .device;
    let rel = |a: &[f32], b: &[f32]| {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    };
    let mut worst = [0f32; 2];
    // the tiny set (head_dim 32) and the head_dim-128 set, the attention kernels production runs
    let tiny = [
        "q4g64",
        "q4g64_tied",
        "q4g32",
        "q8g64",
        "q3g64",
        "q4g64_f32",
    ];
    let cases = tiny.iter().map(|v| (fixtures(), *v)).chain(
        ["q4g64", "q4g64_f32"]
            .iter()
            .map(|v| (fixtures_hd128(), *v)),
    );
    for (root, v) in cases {
        let adapter = root.join("adapter");
        for lora in [false, true] {
            for (ki, kernel) in [Numerics::Exact, Numerics::Fast].into_iter().enumerate() {
                let tol = [1e-4, 2e-3][ki];
                let mk = |step| {
                    let opts = ModelOptions {
                        device: dev.clone(),
                        kernel,
                        cuda_step: step,
                        ..ModelOptions::default()
                    };
                    engine::load(&root.join(v), lora.then_some(adapter.as_path()), &opts).unwrap()
                };
                let (mut ops, mut eager, mut graph) =
                    (mk(CudaStep::Ops), mk(CudaStep::Eager), mk(CudaStep::Graph));
                assert!(
                    !ops.uses_fused_step() && eager.uses_fused_step() && graph.uses_fused_step()
                );
                let label = format!("{} {v} lora={lora} {kernel:?}", root.display());
                let ids = Reference::open_at(&root, v).prompt_ids();
                let a = ops.forward(&ids, true, true).unwrap();
                let b = eager.forward(&ids, true, true).unwrap();
                let c = graph.forward(&ids, true, false).unwrap();
                let (la, lb) = (to_vec(&a.logits), to_vec(&b.logits));
                let e = rel(&lb, &la);
                worst[ki] = worst[ki].max(e);
                assert!(
                    e <= tol,
                    "{label}: prompt logits rel err {e:.2e} > {tol:.0e}"
                );
                assert_eq!(
                    lb,
                    to_vec(&c.logits),
                    "{label}: graph vs eager prompt logits"
                );
                assert_eq!(a.hidden.len(), b.hidden.len(), "{label}: hidden states");
                for (i, (x, y)) in a.hidden.iter().zip(&b.hidden).enumerate() {
                    let e = rel(&to_vec(y), &to_vec(x));
                    assert!(
                        e <= tol,
                        "{label}: hidden state {i} rel err {e:.2e} > {tol:.0e}"
                    );
                }
                let vocab = ops.cfg.vocab_size;
                let mut id = Qwen3::argmax(&la[la.len() - vocab..]);
                for s in ids.len()..300 {
                    let x = ops.next_logits(&[id]).unwrap();
                    let y = eager.next_logits(&[id]).unwrap();
                    let z = graph.next_logits(&[id]).unwrap();
                    let e = rel(&y, &x);
                    worst[ki] = worst[ki].max(e);
                    assert!(
                        e <= tol,
                        "{label}: position {s} logits rel err {e:.2e} > {tol:.0e}"
                    );
                    assert_eq!(y, z, "{label}: position {s}: graph vs eager");
                    id = Qwen3::argmax(&x);
                }
            }
        }
    }
    eprintln!(
        "fused vs candle ops, worst relative logit error: exact {:.2e}, fast {:.2e}",
        worst[0], worst[1]
    );
}

/// The sampler inside the fused CUDA step's graph: each token it draws is the one the slow
/// reference draws from the same logits (eager launches of the same kernels give those logits
/// bit for bit), or one within rounding of it at a near-tie of Gumbel scores; graph and eager
/// sampling agree exactly. Default sampler, then top-k with a repetition penalty.
#[cfg(feature = "cuda")]
#[test]
fn fused_cuda_sampler_draws_what_the_reference_draws() {
    use bot::engine::device::{select, DeviceKind};
    use bot::engine::sample::{
        apply_penalty, gumbel, recent_distinct, reference_kept, reference_sample, Draw, SampleStep,
        SamplerParams,
    };
    use bot::engine::CudaStep;
    let dev = select(DeviceKind::Cuda)
        .expect("a `cuda` build's tests need a GPU")
        .device;
    let mk = |step| {
        let opts = ModelOptions {
            device: dev.clone(),
            kernel: Numerics::Fast,
            cuda_step: step,
            ..ModelOptions::default()
        };
        engine::load(&fixtures().join("q4g64"), None, &opts).unwrap()
    };
    let (mut eager, mut sampling, mut graph) = (
        mk(CudaStep::Eager),
        mk(CudaStep::Eager),
        mk(CudaStep::Graph),
    );
    let ids = Reference::open("q4g64").prompt_ids();
    let samplers = [
        SamplerParams::default(),
        SamplerParams {
            temperature: 1.3,
            top_k: 7,
            repetition_penalty: 1.4,
            ..SamplerParams::default()
        },
    ];
    let mut near_ties = 0;
    for sp in samplers {
        let p = sp.resolve(eager.cfg.vocab_size);
        eager.reset();
        sampling.reset();
        graph.reset();
        let mut history = ids.clone();
        let mut recent = Vec::new();
        let mut next = ids.clone();
        for counter in 0..200u64 {
            recent_distinct(&history, 20, &mut recent);
            let recent_used: &[u32] = if sp.penalty_active() { &recent } else { &[] };
            let d = Draw { seed: 77, counter };
            // the logits (eager), and the fused sampler at the same position (graph, eager)
            let mut logits = eager.next_logits(&next).unwrap();
            let step = SampleStep {
                params: p,
                recent: recent_used,
                draw: d,
            };
            let g = graph.next_token(&next, &step).unwrap();
            let e = sampling.next_token(&next, &step).unwrap();
            apply_penalty(&mut logits, recent_used, p.penalty);
            let want = reference_sample(&logits, &p, d).unwrap();
            let kept = reference_kept(&logits, &p).unwrap();
            assert!(kept.contains(&g.id), "step {counter}: {} not kept", g.id);
            if g.id != want.id {
                let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let score = |i: u32| (logits[i as usize] - m) * p.inv_temp + gumbel(d, i);
                assert!(
                    (score(g.id) - score(want.id)).abs() < 1e-4,
                    "step {counter}"
                );
                near_ties += 1;
            }
            assert!((g.logprob - want.logprob).abs() < 2e-3, "step {counter}");
            assert_eq!(e, g, "step {counter}: eager vs graph sampling");
            // every model goes on with the reference's token
            history.push(want.id);
            next = vec![want.id];
        }
    }
    assert!(near_ties < 3, "{near_ties} near-ties in 400 draws");
}

/// The CPU's host passes (`Qwen3::decode_host`, `prompt_host`: every region's kernel writing
/// into buffers, no tensors between them) are the tensor path's arithmetic: the same logits,
/// bit for bit, for a whole prompt, token after token of decode, and a prompt in three chunks
/// (27, 24 and 3 tokens: at an offset, and too short for the shared GEMM, whose fallback
/// inside the host pass goes through tensors), on every variant (the ones the integer kernels
/// do not take go through that fallback too), with and without LoRA, each kernel (`fast`,
/// `exact`, `int8`).
#[test]
fn host_passes_equal_tensor_passes() {
    if !test_device().is_cpu() {
        eprintln!(
            "host_passes_equal_tensor_passes: the host passes are the CPU's; not run on {:?}",
            test_device()
        );
        return;
    }
    for (v, _) in variants() {
        let ids = Reference::open(&v).prompt_ids();
        assert!(
            ids.len() > 51,
            "{v}: the chunks below need more than 51 prompt tokens"
        );
        for lora in [false, true] {
            for kernel in [Numerics::Fast, Numerics::Exact, Numerics::Int8] {
                let mut m = load(&v, lora, kernel);
                let mut runs = Vec::new();
                for tensor in [false, true] {
                    m.use_tensor_path(tensor);
                    m.reset();
                    let mut logits = to_vec(&m.forward(&ids, false, false).unwrap().logits);
                    let mut all = logits.clone();
                    for _ in 0..6 {
                        let id = Qwen3::argmax(&logits);
                        logits = m.next_logits(&[id]).unwrap();
                        all.extend_from_slice(&logits);
                    }
                    m.reset();
                    for chunk in [&ids[..27], &ids[27..51], &ids[51..]] {
                        all.extend(to_vec(&m.forward(chunk, false, false).unwrap().logits));
                    }
                    runs.push(all);
                }
                let what = format!("{v} lora={lora} {kernel:?}");
                assert_eq!(runs[0].len(), runs[1].len(), "{what}");
                let differ = runs[0]
                    .iter()
                    .zip(&runs[1])
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    differ, 0,
                    "{what}: {differ} logits differ between the host and tensor passes"
                );
            }
        }
    }
}
