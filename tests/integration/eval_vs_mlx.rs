//! `bot eval` against mlx_lm's own `evaluate` (tests/fixtures/eval, made by
//! make_eval_refs.py with mlx 0.32.4 / mlx_lm 0.32.2 in f32 on the tiny fixture models).
//! Tokenization and masking must match exactly; losses within 1e-4 nats (our compute is f32
//! like the references; measured differences are ~1e-6).

use bot::engine::{self, ModelOptions, Numerics, Qwen3};
use bot::eval::template::ChatTemplate;
use bot::eval::{data, score, Renderer, Score, Tokenized};
use bot::generate::chat::ChatTokenizer;
use serde_json::Value;

use crate::common::*;

const LOSS_TOL: f64 = 1e-4;

fn eval_dir() -> std::path::PathBuf {
    fixtures().parent().unwrap().join("eval")
}

fn refs() -> Value {
    serde_json::from_str(&std::fs::read_to_string(eval_dir().join("refs.json")).unwrap()).unwrap()
}

fn tokenize(variant: &str, dataset: &str, mask: bool) -> Vec<Tokenized> {
    let dir = fixtures().join(variant);
    let cfg = engine::Qwen3Config::from_dir(&dir).unwrap();
    let template = ChatTemplate::load(&dir).unwrap();
    let tokenizer = ChatTokenizer::load(&dir, &cfg.eos_token_ids).unwrap();
    let r = Renderer {
        template: &template,
        tokenizer: &tokenizer,
        mask_prompt: mask,
    };
    data::read(&eval_dir().join(format!("{dataset}.jsonl")))
        .unwrap()
        .iter()
        .map(|e| r.tokenize(e.line, &e.example).unwrap())
        .collect()
}

fn model(variant: &str, adapter: bool) -> Qwen3 {
    let opts = ModelOptions {
        kernel: Numerics::Exact,
        device: test_device(),
        ..ModelOptions::default()
    };
    let a = fixtures().join("adapter");
    engine::load(
        &fixtures().join(variant),
        adapter.then_some(a.as_path()),
        &opts,
    )
    .unwrap()
}

#[test]
fn examples_tokenize_and_mask_as_mlx_lm_does() {
    let r = refs();
    for ds in ["chat", "text", "completions"] {
        let want = r["datasets"][ds]["examples"].as_array().unwrap();
        for mask in [false, true] {
            let got = tokenize("q4g64_f32", ds, mask);
            assert_eq!(got.len(), want.len(), "{ds}");
            for (g, w) in got.iter().zip(want) {
                let ids: Vec<u32> = serde_json::from_value(w["ids"].clone()).unwrap();
                assert_eq!(g.ids, ids, "{ds} line {}: {}", g.line, w["rendered"]);
                let offset = match (mask, w.get("offset_mask_prompt")) {
                    (true, Some(o)) => o.as_u64().unwrap().max(1) as usize,
                    _ => 1,
                };
                assert_eq!(g.first_scored, offset, "{ds} line {} mask {mask}", g.line);
            }
        }
    }
}

/// Every batch-size-1 configuration (all examples, nothing truncated at max_seq_length 2048):
/// with mlx_lm's padding target our figure is `evaluate`'s; without it, the per-token
/// cross-entropies mlx_lm computed, over the real tokens only.
#[test]
fn loss_equals_mlx_lm_evaluate() {
    let r = refs();
    let per_token = r["per_token"].as_array().unwrap();
    let mut checked = 0;
    for c in r["configs"].as_array().unwrap() {
        if c["batch_size"] != 1 || c["max_seq_length"] != 2048 {
            continue;
        }
        let (variant, ds) = (c["model"].as_str().unwrap(), c["dataset"].as_str().unwrap());
        let (adapter, mask) = (
            c["adapter"].as_bool().unwrap(),
            c["mask_prompt"].as_bool().unwrap(),
        );
        let label = format!("{variant} {ds} adapter {adapter} mask {mask}");
        let examples = tokenize(variant, ds, mask);
        let mut m = model(variant, adapter);
        let (mut with_pad, mut without) = (Score::default(), Score::default());
        for (t, pe) in examples.iter().zip(c["per_example"].as_array().unwrap()) {
            let s = score(&mut m, t, true).unwrap();
            assert_eq!(
                s.tokens as u64,
                pe["ntokens"].as_u64().unwrap(),
                "{label} line {}",
                t.line
            );
            let d = (s.nll - pe["loss_sum"].as_f64().unwrap()).abs();
            assert!(
                d <= LOSS_TOL * s.tokens as f64,
                "{label} line {}: sum off by {d}",
                t.line
            );
            with_pad.add(s);
            let s = score(&mut m, t, false).unwrap();
            assert_eq!(
                s.tokens,
                pe["ntokens"].as_u64().unwrap() as usize - 1,
                "{label}"
            );
            // the per-token cross-entropies, where recorded: ce[k] is the loss of ids[k + 1]
            if let Some(pt) = per_token.iter().find(|p| {
                p["model"] == variant
                    && p["adapter"] == adapter
                    && p["dataset"] == ds
                    && p["index"] == pe["index"]
            }) {
                let ce: Vec<f64> = serde_json::from_value(pt["ce"].clone()).unwrap();
                let want: f64 = ce[t.first_scored - 1..ce.len() - 1].iter().sum();
                assert!(
                    (s.nll - want).abs() <= LOSS_TOL * s.tokens as f64,
                    "{label}: {} vs {want}",
                    s.nll
                );
            }
            without.add(s);
        }
        let want = c["loss"].as_f64().unwrap();
        assert!(
            (with_pad.loss() - want).abs() <= LOSS_TOL,
            "{label}: {} vs mlx_lm {want}",
            with_pad.loss()
        );
        assert_eq!(
            with_pad.tokens as u64,
            c["ntokens"].as_u64().unwrap(),
            "{label}"
        );
        assert_eq!(without.tokens, with_pad.tokens - examples.len(), "{label}");
        checked += 1;
    }
    assert_eq!(checked, 20, "the batch-size-1 configurations of refs.json");
}

/// The CLI end to end: two adapters (the fixture's and none), JSON lines, the delta.
/// `bot eval --device cpu --model <the f32 fixture> --data DATA ARGS...` with its own home.
fn bot_eval(home: &std::path::Path, data: &std::path::Path, args: &[&str]) -> std::process::Output {
    assert_cmd::Command::cargo_bin("bot")
        .unwrap()
        .env("BOT_HOME", home)
        .args(["eval", "--device", "cpu", "--model"])
        .arg(fixtures().join("q4g64_f32"))
        .arg("--data")
        .arg(data)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn cli_reports_each_adapter_and_the_difference() {
    let home = tempfile::tempdir().unwrap();
    let adapter = fixtures().join("adapter");
    let out = bot_eval(
        home.path(),
        &eval_dir().join("chat.jsonl"),
        &[
            "--json",
            "--quiet",
            "--mlx-pad-target",
            "--adapter",
            adapter.to_str().unwrap(),
            "--compare",
            "none",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    let r = refs();
    let find = |adapter: bool| {
        r["configs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| {
                c["model"] == "q4g64_f32"
                    && c["dataset"] == "chat"
                    && c["adapter"] == adapter
                    && c["mask_prompt"] == true
                    && c["batch_size"] == 1
                    && c["max_seq_length"] == 2048
            })
            .unwrap()["loss"]
            .as_f64()
            .unwrap()
    };
    let (lora, base) = (
        lines[0]["loss"].as_f64().unwrap(),
        lines[1]["loss"].as_f64().unwrap(),
    );
    assert!((lora - find(true)).abs() <= LOSS_TOL, "{lora}");
    assert!((base - find(false)).abs() <= LOSS_TOL, "{base}");
    assert!(lines[1]["adapter"].is_null());
    let delta = lines[1]["delta_loss"].as_f64().unwrap();
    assert!((delta - (base - lora)).abs() < 1e-12);
}

/// Bad data: the line is named; an empty file is its own error.
#[test]
fn cli_names_the_bad_line_and_refuses_an_empty_set() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"fine\"}\n{\"text\": 5}\n").unwrap();
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n\n").unwrap();
    for (file, want) in [
        (&bad, "bad.jsonl:2: \"text\" must be a string"),
        (&empty, "no examples"),
    ] {
        let out = bot_eval(dir.path(), file, &["--quiet", "--no-adapter"]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "a bad --data file is a usage error"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{err}");
    }
}

/// An example longer than the model's context is skipped and counted, not a crash.
#[test]
fn examples_past_the_context_are_skipped_with_a_count() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("long.jsonl");
    let max = engine::Qwen3Config::from_dir(&fixtures().join("q4g64_f32"))
        .unwrap()
        .max_position_embeddings;
    let long = "a b ".repeat(max / 2 + 10);
    std::fs::write(
        &data,
        format!("{{\"text\": \"{long}\"}}\n{{\"text\": \"Rain fell.\"}}\n"),
    )
    .unwrap();
    let out = bot_eval(dir.path(), &data, &["--json", "--no-adapter"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (r["examples"].as_u64(), r["skipped"].as_u64()),
        (Some(1), Some(1)),
        "{r}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("skipped 1 example"));
}

/// Examples longer than one scoring chunk (128 positions), masked anywhere, with and without the
/// padding target: the chunked scoring equals one forward over the whole example.
#[test]
fn chunked_scoring_equals_one_forward() {
    use bot::eval::nll;
    let mut m = model("q4g64_f32", true);
    let v = m.cfg.vocab_size;
    let ids: Vec<u32> = (0..300u32).map(|i| (i * 37) % (v as u32 - 1) + 1).collect();
    m.reset();
    let logits: Vec<f32> = m
        .forward(&ids, true, false)
        .unwrap()
        .logits
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    for first in [1, 100, 127, 128, 129, 200, 299] {
        for pad in [false, true] {
            let t = Tokenized {
                line: 1,
                ids: ids.clone(),
                first_scored: first,
            };
            let got = score(&mut m, &t, pad).unwrap();
            let last = if pad { 300 } else { 299 };
            let want: f64 = (first..=last)
                .map(|tok| {
                    nll(
                        &logits[(tok - 1) * v..tok * v],
                        ids.get(tok).copied().unwrap_or(0),
                    )
                })
                .sum();
            assert_eq!(got.tokens, last + 1 - first, "first {first} pad {pad}");
            assert!(
                (got.nll - want).abs() <= LOSS_TOL * got.tokens as f64,
                "first {first} pad {pad}: {} vs {want}",
                got.nll
            );
        }
    }
}
