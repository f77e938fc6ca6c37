//! Fuzzing entry points: each takes arbitrary bytes, must never panic, and asserts the
//! invariants its parser or renderer promises. The cargo-fuzz targets in `fuzz/` call these,
//! and `tests/integration/fuzz_corpus.rs` replays the saved corpus through them in CI
//! (docs/reliability.md says how to run the fuzzers). Panics here are findings.

use std::path::Path;

use crate::app::schedule::{render_cron, render_plist, Job};
use crate::bluesky::record;
use crate::engine::config::Qwen3Config;
use crate::engine::lora::Adapter;
use crate::engine::weights::{parse_header, SafetensorsFile};
use crate::generate::postprocess;

/// The safetensors header parser: whatever it accepts lies inside the data section, does not
/// overlap, and reads back at the sizes its dtype and shape say.
pub fn safetensors(data: &[u8]) {
    let Ok((start, tensors)) = parse_header(data) else {
        return;
    };
    let len = data.len() - start;
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for t in tensors.values() {
        assert!(
            t.begin <= t.end && t.end <= len,
            "{t:?} outside {len} bytes"
        );
        spans.push((t.begin, t.end));
    }
    spans.retain(|(b, e)| e > b);
    spans.sort();
    assert!(spans.windows(2).all(|w| w[1].0 >= w[0].1), "overlap");
    // ok: these expects are the fuzz target's invariants (a panic is the finding, module doc);
    // no user path calls this module
    let file = SafetensorsFile::from_bytes(Path::new("fuzz.safetensors"), data.to_vec())
        .expect("a header parse_header accepts opens");
    for name in tensors.keys() {
        // ok: a fuzz invariant, as above
        let t = file.get(name).expect("every tensor is readable");
        if t.dtype.is_float() {
            // ok: a fuzz invariant, as above
            let v = t.to_f32_vec().expect("float tensors convert");
            assert_eq!(v.len(), t.shape.iter().product::<usize>());
        }
    }
}

/// config.json: whatever parses names a usable model (positive sizes, stop ids inside the
/// vocabulary, positive eps, a RoPE base above 1).
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(c) = Qwen3Config::parse(Path::new("config.json"), text, None) else {
        return;
    };
    assert!(c.hidden_size > 0 && c.num_attention_heads > 0 && c.head_dim % 2 == 0);
    assert!(c.num_attention_heads % c.num_key_value_heads == 0);
    assert!(c
        .eos_token_ids
        .iter()
        .all(|&id| (id as usize) < c.vocab_size));
    assert!(c.rms_norm_eps > 0.0 && c.rope_theta.is_finite() && c.rope_theta > 1.0);
}

/// An adapter from `[u32 config length][adapter_config.json][adapters.safetensors]`: whatever
/// loads has a finite scale and finite tensors of one rank.
pub fn adapter(data: &[u8]) {
    if data.len() < 4 {
        return;
    }
    let n = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as usize;
    let Some(cfg) = data.get(4..4 + n.min(data.len() - 4)) else {
        return;
    };
    let rest = &data[4 + cfg.len()..];
    let (Ok(text), Ok(file)) = (
        std::str::from_utf8(cfg),
        SafetensorsFile::from_bytes(Path::new("adapters.safetensors"), rest.to_vec()),
    ) else {
        return;
    };
    if let Ok(a) = Adapter::from_parts(Path::new("fuzz"), text, &file, &candle_core::Device::Cpu) {
        assert!(a.scale.is_finite());
        assert!(a.rank > 0);
    }
}

/// Post-processing: any text comes out within Bluesky's limits, free of control characters
/// but newlines, and is a fixed point.
pub fn postprocess(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let out = postprocess::clean_post(&text);
    assert!(postprocess::grapheme_count(&out) <= postprocess::MAX_GRAPHEMES);
    assert!(out.len() <= postprocess::MAX_BYTES);
    assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
    assert_eq!(postprocess::clean_post(&out), out, "not a fixed point");
}

/// Facet detection: spans lie on character boundaries inside the text, in order, apart, and
/// what they cover is what they claim.
pub fn facets(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let spans = record::detect_spans(&text);
    let mut last = 0;
    for s in &spans {
        let (start, end) = match s {
            record::Span::Link { start, end, .. } | record::Span::Mention { start, end, .. } => {
                (*start, *end)
            }
        };
        assert!(start >= last && start < end && end <= text.len(), "{s:?}");
        assert!(text.is_char_boundary(start) && text.is_char_boundary(end));
        if let record::Span::Mention { handle, .. } = s {
            assert_eq!(text[start + 1..end].to_ascii_lowercase(), *handle);
        }
        last = end;
    }
    let facets = record::facets(&spans, &mut |h| Some(format!("did:plc:{}", h.len())));
    assert!(facets.len() <= spans.len());
}

/// The schedule renderers on a job of arbitrary values (fields split at 0xFF): a job that
/// validates renders a crontab block of exactly two lines whose command has no unescaped `%`,
/// and a plist (the caller parses it). Returns (cron, plist) for that check.
pub fn schedule(data: &[u8]) -> Option<(String, String)> {
    let mut fields = data
        .split(|&b| b == 0xFF)
        .map(|f| String::from_utf8_lossy(f).into_owned());
    let mut next = || fields.next().unwrap_or_default();
    let job = Job {
        label: format!("com.github.bot.{}", next()),
        exe: next().into(),
        args: vec!["run".into(), "--mode".into(), next()],
        every: std::time::Duration::from_secs(3600),
        env: vec![("BOT_HOME".into(), next()), ("PATH".into(), next())],
        log_path: next().into(),
    };
    if job.validate().is_err() {
        assert!(render_cron(&job).is_err(), "an invalid job rendered");
        return None;
    }
    // ok: a fuzz invariant (a panic is the finding); no user path calls this module
    let cron = render_cron(&job).expect("a valid hourly job renders");
    assert_eq!(cron.lines().count(), 2, "{cron:?}");
    let command = cron.lines().nth(1).unwrap_or_default();
    let bytes = command.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        assert!(
            b != b'%' || (i > 0 && bytes[i - 1] == b'\\'),
            "bare % in {command:?}"
        );
    }
    Some((cron, render_plist(&job)))
}
