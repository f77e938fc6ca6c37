//! `bot generate` and its parts: the chat prompt and tokenizer against mlx_lm's renders, the
//! sampler against mlx_lm's kept-token sets, post-processing properties, and the command.

use std::collections::BTreeSet;

use assert_cmd::Command;
use proptest::prelude::*;
use serde_json::Value;

use bot::engine::cpu::sample::CpuSampler;
use bot::engine::sample::{reference_kept, Draw, SamplerParams};
use bot::generate::chat::{self, ChatTokenizer};
use bot::generate::postprocess::{
    clean_post, grapheme_count, is_emoji_cluster, MAX_BYTES, MAX_GRAPHEMES,
};
use unicode_segmentation::UnicodeSegmentation;

use crate::common::*;

fn tokenizer() -> ChatTokenizer {
    ChatTokenizer::load(&fixtures().join("q4g64"), &[]).unwrap()
}

/// The `/no_think` user turn renders to mlx_lm's text and ids (TokenizerWrapper's
/// apply_chat_template with no extra kwargs, the way mlx_lm.generate calls it).
#[test]
fn prompt_matches_mlx_lm_chat_template() {
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("chat_template_cases.json")).unwrap(),
    )
    .unwrap();
    let tok = tokenizer();
    let case = &cases["sys_user/default"];
    let msgs = case["messages"].as_array().unwrap();
    let system = msgs[0]["content"].as_str().unwrap();
    let user = msgs[1]["content"]
        .as_str()
        .unwrap()
        .trim_end_matches(" /no_think");
    let text = chat::render(Some(system), user);
    assert_eq!(text, case["text"].as_str().unwrap());
    let want: Vec<u32> = case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(tok.encode(&text).unwrap(), want);
    // The user-only multi-turn case's last turn has the same shape without a system turn.
    let mt = cases["multi_turn_with_think/default"]["text"]
        .as_str()
        .unwrap();
    assert!(mt.ends_with(&chat::render(None, "Post about coffee")));
}

#[test]
fn special_tokens_are_single_ids_and_no_bos() {
    let tok = tokenizer();
    for s in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"] {
        let ids = tok.encode(s).unwrap();
        assert_eq!(ids.len(), 1, "{s} -> {ids:?}");
        assert_eq!(tok.decode(&ids).unwrap(), s);
    }
    let ids = tok.encode("<|im_start|>user\nhi").unwrap();
    assert_eq!(
        ids[0],
        tok.encode("<|im_start|>").unwrap()[0],
        "nothing before the first token"
    );
    assert!(tok
        .eos_ids
        .contains(&tok.tokenizer.token_to_id("<|im_end|>").unwrap()));
    assert!(tok
        .eos_ids
        .contains(&tok.tokenizer.token_to_id("<|endoftext|>").unwrap()));
}

/// Streaming never releases half a character: feeding the ids of multi-byte text one by one
/// gives back exactly the text, and every released piece is whole.
#[test]
fn incremental_decoding_keeps_characters_whole() {
    let tok = tokenizer();
    let text = "Café — 日本語 ok";
    let ids = tok.encode(text).unwrap();
    assert!(ids.len() > text.chars().count() / 2);
    let mut s = chat::TextStream::new(&tok);
    let mut out = String::new();
    for id in ids {
        if let Some(piece) = s.push(id).unwrap() {
            assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
            out.push_str(&piece);
        }
    }
    assert_eq!(out, text);
}

/// The sampler's rules as `apply_top_p` / `apply_min_p` / `apply_top_k` of a filter.
fn filter(name: &str, value: f32, vocab: usize) -> bot::engine::sample::KernelParams {
    let mut p = SamplerParams {
        temperature: 1.0,
        top_p: 1.0,
        ..SamplerParams::default()
    };
    match name {
        "top_p" => p.top_p = value,
        "min_p" => p.min_p = value,
        "top_k" => p.top_k = value as usize,
        other => panic!("unknown filter {other}"),
    }
    p.resolve(vocab)
}

/// Every draw of the fast CPU sampler lands in the kept set.
fn assert_draws_within(x: &[f32], p: &bot::engine::sample::KernelParams, kept: &[u32], what: &str) {
    let mut s = CpuSampler::new();
    for counter in 0..50 {
        let d = Draw { seed: 1, counter };
        let id = s.sample(&mut x.to_vec(), &[], p, d).unwrap().id;
        assert!(kept.contains(&id), "{what}: drew {id}");
    }
}

/// The kept sets of mlx_lm's apply_top_p / apply_min_p / apply_top_k and of the make_sampler
/// chain, on the same logits, exactly: the real fixture row and the tie/-inf/flat rows.
#[test]
fn sampler_masks_match_mlx_lm() {
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("sampler_cases.json")).unwrap(),
    )
    .unwrap();
    let (logits, shape) = Reference::open("q4g64").f32("logits_lora_last");
    let vocab = shape[1];
    let x = logits[logits.len() - vocab..].to_vec();
    let mut checked = 0;
    for (name, want) in cases["cases"].as_object().unwrap() {
        let want: Vec<u32> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let p = if name.starts_with("chain") {
            SamplerParams {
                temperature: 1.0,
                top_p: 0.95,
                min_p: 0.05,
                top_k: 20,
                ..SamplerParams::default()
            }
            .resolve(vocab)
        } else {
            let (k, val) = name.split_once('=').unwrap();
            filter(k, val.parse().unwrap(), vocab)
        };
        let kept = reference_kept(&x, &p).unwrap();
        assert_eq!(kept, want, "{name}");
        assert_draws_within(&x, &p, &kept, name);
        checked += 1;
    }
    assert_eq!(checked, 8);

    let ties: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("sampler_tie_cases.json")).unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for case in ties["cases"].as_array().unwrap() {
        let row: Vec<f32> = ties["rows"][case["row"].as_str().unwrap()]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().map_or(f32::NEG_INFINITY, |v| v as f32))
            .collect();
        let f = case["filter"].as_str().unwrap();
        let p = if f == "chain" {
            let v = case["value"].as_array().unwrap();
            SamplerParams {
                temperature: 1.0,
                top_p: v[0].as_f64().unwrap() as f32,
                min_p: v[1].as_f64().unwrap() as f32,
                top_k: v[2].as_u64().unwrap() as usize,
                ..SamplerParams::default()
            }
            .resolve(row.len())
        } else {
            filter(f, case["value"].as_f64().unwrap() as f32, row.len())
        };
        let want: Vec<u32> = case["kept"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let kept = reference_kept(&row, &p).unwrap();
        assert_eq!(kept, want, "{case}");
        assert_draws_within(&row, &p, &kept, &case.to_string());
        checked += 1;
    }
    assert!(checked > 90, "{checked}");
}

fn bot() -> Command {
    let mut c = Command::cargo_bin("bot").unwrap();
    // Nothing from the developer's own config or Hub cache leaks in.
    let home = tempfile::tempdir().unwrap().keep();
    c.env("BOT_HOME", &home)
        .env("HF_HOME", home.join("hf"))
        .env("HF_HUB_OFFLINE", "1");
    c
}

fn generate(extra: &[&str]) -> std::process::Output {
    bot()
        .arg("generate")
        .arg("--model")
        .arg(fixtures().join("q4g64"))
        .arg("--adapter")
        .arg(fixtures().join("adapter"))
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn generate_prints_posts_within_limits() {
    let out = generate(&["-n", "3", "--seed", "1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let posts: Vec<&str> = stdout.trim_end_matches('\n').split("\n---\n").collect();
    assert_eq!(posts.len(), 3, "{stdout}");
    for p in &posts {
        assert!(
            grapheme_count(p) <= MAX_GRAPHEMES && p.len() <= MAX_BYTES,
            "{p}"
        );
        assert!(grapheme_count(p) >= 30, "{p}");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tok/s"), "timings go to stderr: {stderr}");
}

#[test]
fn generate_json_is_reproducible_per_seed() {
    let parse = |out: std::process::Output| -> Vec<Value> {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.stderr.is_empty(), "-q silences stderr");
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let a = parse(generate(&["-n", "2", "--seed", "7", "--json", "-q"]));
    let b = parse(generate(&["-n", "2", "--seed", "7", "--json", "-q"]));
    let c = parse(generate(&["-n", "2", "--seed", "8", "--json", "-q"]));
    assert_eq!(a.len(), 2);
    for k in [
        "text",
        "raw",
        "prompt",
        "seed",
        "tokens",
        "attempts",
        "prefill_tok_s",
        "decode_tok_s",
    ] {
        assert!(a[0].get(k).is_some(), "missing {k}");
    }
    let texts = |v: &[Value]| {
        v.iter()
            .map(|p| p["text"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(texts(&a), texts(&b), "same seed, same posts");
    assert_ne!(texts(&a), texts(&c), "another seed, other posts");
    // Post i of a run uses seed SEED+i: run 8's first post is run 7's second.
    assert_eq!(a[1]["seed"], 8);
    assert_eq!(a[1]["text"], c[0]["text"]);
}

/// The system turn is prefilled once per run and reused from the cache by later posts; a reused
/// post is the same one a fresh run of its seed writes (same tokens, same log-probabilities).
#[test]
fn cached_system_turn_changes_nothing() {
    let system = "You write short, dry posts about small engineering pleasures, in the first \
                  person, without hashtags or emoji, as a tired but cheerful developer would.";
    let run = |seed: &str, n: &str| -> Vec<Value> {
        let out = generate(&["-n", n, "--seed", seed, "--json", "-q", "--system", system]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let batch = run("20", "3");
    assert_eq!(batch.len(), 3);
    assert_eq!(batch[0]["prompt_tokens_reused"], 0);
    for (i, post) in batch.iter().enumerate() {
        if i > 0 {
            let reused = post["prompt_tokens_reused"].as_u64().unwrap();
            assert!(reused > 30, "post {i} reused {reused} tokens");
        }
        let alone = &run(&(20 + i).to_string(), "1")[0];
        assert_eq!(alone["prompt_tokens_reused"], 0);
        for k in ["raw", "text", "tokens", "mean_logprob"] {
            assert_eq!(post[k], alone[k], "post {i}: {k}");
        }
    }
}

#[test]
fn impossible_min_chars_fails_with_empty_stdout() {
    let out = generate(&["--min-chars", "100000", "--attempts", "2", "--seed", "3"]);
    assert!(!out.status.success());
    assert!(
        out.stdout.is_empty(),
        "nothing that looks like a post: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no usable post after 2 attempts"), "{err}");
}

#[test]
fn config_show_reports_sources_and_masks_secrets() {
    let home = tempfile::tempdir().unwrap();
    std::fs::write(
        home.path().join("config.toml"),
        "temperature = 0.6\n[bluesky]\nhandle = \"me.test\"\n",
    )
    .unwrap();
    let out = Command::cargo_bin("bot")
        .unwrap()
        .args(["config", "show"])
        .env("BOT_HOME", home.path())
        .env("BOT_TOP_P", "0.8")
        .env("BOT_BSKY_APP_PASSWORD", "abcd-efgh-ijkl-mnop")
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8(out.stdout).unwrap();
    assert!(!s.contains("abcd-efgh"), "{s}");
    let line = |k: &str| s.lines().find(|l| l.starts_with(k)).unwrap().to_string();
    assert!(line("temperature").contains("config.toml"));
    assert!(line("top_p").contains("BOT_TOP_P"));
    assert!(line("max_tokens").contains("default"));
    assert!(line("bluesky.app_password").contains("(set)"));
}

fn emoji_char() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "😀",
        "👋🏽",
        "❤\u{FE0F}",
        "1\u{FE0F}\u{20E3}",
        "🇯🇵",
        "👩\u{200D}💻",
        "☀",
        "✨",
        "🏳\u{FE0F}\u{200D}🌈",
    ])
    .prop_map(str::to_string)
}

fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z]{1,12}",
        "[ \n\t]{1,3}",
        "[.!?,;:]",
        "#[a-z0-9]{1,8}",
        "＃[a-z]{1,4}",
        "(é|ñ|日本|©|™|→|★)",
        emoji_char(),
        Just("<think>".to_string()),
        Just("</think>".to_string()),
        Just("<|im_end|>".to_string()),
        "[\\PC]{1,4}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// For any text: within Bluesky's limits, idempotent, no emoji, no hashtag, no think tags.
    #[test]
    fn cleaned_posts_are_valid(parts in prop::collection::vec(piece(), 0..400)) {
        let raw: String = parts.concat();
        let out = clean_post(&raw);
        prop_assert!(grapheme_count(&out) <= MAX_GRAPHEMES);
        prop_assert!(out.len() <= MAX_BYTES);
        prop_assert_eq!(clean_post(&out), out.clone());
        prop_assert!(!out.graphemes(true).any(is_emoji_cluster), "emoji left in {:?}", out);
        prop_assert!(!out.contains("<think>") && !out.contains("</think>"));
        let words: Vec<&str> = out.split_whitespace().collect();
        for w in words {
            let tag_like = (w.starts_with('#') || w.starts_with('＃'))
                && w.chars().nth(1).is_some_and(char::is_alphanumeric)
                && w.chars().skip(1).any(char::is_alphabetic);
            prop_assert!(!tag_like, "hashtag {:?} left in {:?}", w, out);
        }
    }
}

/// Text with no emoji, tags or markup passes through unchanged (modulo whitespace).
#[test]
fn plain_text_is_untouched() {
    let set: BTreeSet<&str> = [
        "A calm morning.",
        "Rust 1.80 shipped; C# too!",
        "Zürich → Genève ©",
    ]
    .into();
    for s in set {
        assert_eq!(clean_post(s), s);
    }
}
