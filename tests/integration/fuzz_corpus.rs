//! The saved fuzz corpora (`fuzz/corpus/<target>`, minimized with `cargo fuzz cmin`) replayed
//! through the same entry points the cargo-fuzz targets call, so every input a fuzzer ever kept
//! (and every crash it found, once fixed) stays a regression test without nightly Rust.
//! docs/reliability.md says how the corpora were grown and how to run the fuzzers.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

/// Runs `check` on every file of one corpus; reports all failing inputs by name at once.
fn replay(target: &str, min_inputs: usize, check: impl Fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .collect();
    files.sort();
    // A corpus that lost its files would make this test pass vacuously.
    assert!(
        files.len() >= min_inputs,
        "{}: {} inputs, expected at least {min_inputs}",
        dir.display(),
        files.len()
    );
    let failed: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let data = std::fs::read(f).expect("corpus file");
            match catch_unwind(AssertUnwindSafe(|| check(&data))) {
                Ok(()) => None,
                Err(e) => {
                    let why = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    Some(format!("{}: {why}", f.display()))
                }
            }
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} inputs fail:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
fn fuzz_corpus_safetensors() {
    replay("safetensors", 100, bot::fuzz::safetensors);
}

#[test]
fn fuzz_corpus_config() {
    replay("config", 100, bot::fuzz::config);
}

#[test]
fn fuzz_corpus_adapter() {
    replay("adapter", 100, bot::fuzz::adapter);
}

#[test]
fn fuzz_corpus_postprocess() {
    replay("postprocess", 100, bot::fuzz::postprocess);
}

#[test]
fn fuzz_corpus_facets() {
    replay("facets", 100, bot::fuzz::facets);
}

#[test]
fn fuzz_corpus_schedule() {
    replay("schedule", 100, |data| {
        if let Some((_, plist)) = bot::fuzz::schedule(data) {
            plist::from_bytes::<plist::Value>(plist.as_bytes()).expect("the plist parses");
        }
    });
}
