//! Broken model and adapter directories: each fails with one message that names the file or
//! tensor, what was expected and what was found, through the library and through the CLI.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use bot::engine::{self, ModelOptions};

use crate::common::fixtures;

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

/// A scratch copy of the q4g64 model and the adapter.
struct Scratch {
    _tmp: tempfile::TempDir,
    model: PathBuf,
    adapter: PathBuf,
}

fn scratch() -> Scratch {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let adapter = tmp.path().join("adapter");
    copy_dir(&fixtures().join("q4g64"), &model);
    copy_dir(&fixtures().join("adapter"), &adapter);
    Scratch {
        _tmp: tmp,
        model,
        adapter,
    }
}

fn load_err(model: &Path, adapter: Option<&Path>) -> String {
    match engine::load(model, adapter, &ModelOptions::default()) {
        Ok(_) => panic!("loading {} should fail", model.display()),
        Err(e) => e.to_string(),
    }
}

/// Replaces `from` by `to` (same length) inside a file's bytes.
fn patch(path: &Path, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let mut b = std::fs::read(path).unwrap();
    let i = b
        .windows(from.len())
        .position(|w| w == from.as_bytes())
        .unwrap_or_else(|| panic!("`{from}` not in {}", path.display()));
    b[i..i + to.len()].copy_from_slice(to.as_bytes());
    std::fs::write(path, b).unwrap();
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Writes a safetensors file of f32 tensors.
fn write_f32_safetensors(path: &Path, tensors: &[(&str, Vec<usize>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape) in tensors {
        let n: usize = shape.iter().product();
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [data.len(), data.len() + 4 * n]}),
        );
        data.extend((0..n).flat_map(|i| (i as f32 * 1e-3).to_le_bytes()));
    }
    let h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message lacks `{p}`:\n{msg}");
    }
}

#[test]
fn missing_directory_and_config() {
    let s = scratch();
    let e = load_err(&s.model.join("nope"), None);
    assert_has(&e, &["nope", "does not exist"]);
    std::fs::remove_file(s.model.join("config.json")).unwrap();
    let e = load_err(&s.model, None);
    assert_has(&e, &["cannot read", "config.json"]);
}

#[test]
fn truncated_safetensors_names_the_file() {
    let s = scratch();
    let f = s.model.join("model.safetensors");
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() / 2]).unwrap();
    let e = load_err(&s.model, None);
    assert_has(&e, &["model.safetensors", "truncated", "data section"]);
}

#[test]
fn header_length_past_end_of_file() {
    let s = scratch();
    let f = s.model.join("model.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&f, &b).unwrap();
    let e = load_err(&s.model, None);
    assert_has(
        &e,
        &[
            "model.safetensors",
            "header length 1099511627776 runs past the end",
        ],
    );
}

#[test]
fn unknown_dtype_is_named() {
    let s = scratch();
    patch(&s.model.join("model.safetensors"), "\"U32\"", "\"X32\"");
    let e = load_err(&s.model, None);
    assert_has(&e, &["model.safetensors", "unknown dtype `X32`"]);
}

#[test]
fn missing_tensor_is_named() {
    let s = scratch();
    patch(
        &s.model.join("model.safetensors"),
        "model.norm.weight",
        "model.norm.weighx",
    );
    let e = load_err(&s.model, None);
    assert_has(&e, &["`model.norm.weight` is missing"]);
    let s = scratch();
    patch(
        &s.model.join("model.safetensors"),
        "layers.1.mlp.up_proj.scales",
        "layers.1.mlp.up_proj.scalez",
    );
    let e = load_err(&s.model, None);
    assert_has(
        &e,
        &[
            "`model.layers.1.mlp.up_proj.scales` is missing",
            "packed U32",
        ],
    );
}

#[test]
fn packed_shape_inconsistent_with_bits() {
    let s = scratch();
    edit_json(&s.model.join("config.json"), |v| {
        v["quantization"]["model.layers.0.mlp.up_proj"] =
            serde_json::json!({"bits": 8, "group_size": 64});
    });
    let e = load_err(&s.model, None);
    assert_has(
        &e,
        &[
            "model.layers.0.mlp.up_proj.weight",
            "expected packed shape [256, 32]",
            "found [256, 16]",
        ],
    );
}

#[test]
fn unsupported_quantization_mode() {
    let s = scratch();
    edit_json(&s.model.join("config.json"), |v| {
        v["quantization"]["mode"] = "mxfp4".into()
    });
    let e = load_err(&s.model, None);
    assert_has(
        &e,
        &["unsupported quantization mode `mxfp4`", "config.json"],
    );
}

#[test]
fn adapter_with_wrong_shapes_or_layers() {
    let s = scratch();
    write_f32_safetensors(
        &s.adapter.join("adapters.safetensors"),
        &[
            ("model.layers.3.self_attn.q_proj.lora_a", vec![64, 8]),
            ("model.layers.3.self_attn.q_proj.lora_b", vec![8, 128]),
        ],
    );
    let e = load_err(&s.model, Some(&s.adapter));
    assert_has(
        &e,
        &[
            "model.layers.3.self_attn.q_proj.lora_a",
            "expected shape [128, 8]",
            "found [64, 8]",
        ],
    );

    write_f32_safetensors(
        &s.adapter.join("adapters.safetensors"),
        &[
            ("model.layers.9.self_attn.q_proj.lora_a", vec![128, 8]),
            ("model.layers.9.self_attn.q_proj.lora_b", vec![8, 128]),
        ],
    );
    let e = load_err(&s.model, Some(&s.adapter));
    assert_has(&e, &["model.layers.9.self_attn.q_proj", "does not have"]);
}

#[test]
fn adapter_of_another_kind_is_refused() {
    let s = scratch();
    edit_json(&s.adapter.join("adapter_config.json"), |v| {
        v["fine_tune_type"] = "dora".into()
    });
    let e = load_err(&s.model, Some(&s.adapter));
    assert_has(
        &e,
        &[
            "adapter_config.json",
            "fine_tune_type `dora` is not supported",
        ],
    );
}

#[test]
fn cli_reports_bad_input_on_stderr_with_nonzero_exit() {
    let s = scratch();
    patch(&s.model.join("model.safetensors"), "\"U32\"", "\"X32\"");
    let out = Command::cargo_bin("bot")
        .unwrap()
        .args(["debug", "forward", "--model"])
        .arg(&s.model)
        .args(["--ids", "1,2,3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_has(
        &err,
        &["error:", "model.safetensors", "unknown dtype `X32`"],
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// #18.12: a shard name in the index that leads out of the model directory was opened.
#[test]
fn shard_names_that_leave_the_directory_are_refused() {
    let s = scratch();
    let index = s.model.join("model.safetensors.index.json");
    for bad in [
        "../model.safetensors",
        "/etc/passwd.safetensors",
        ".hidden.safetensors",
    ] {
        edit_json(&index, |v| {
            let map = v["weight_map"].as_object_mut().unwrap();
            let k = map.keys().next().unwrap().clone();
            map[&k] = bad.into();
        });
        let e = load_err(&s.model, None);
        assert_has(
            &e,
            &["model.safetensors.index.json", "weight_map", "not a plain"],
        );
    }
}

/// #18.12: `num_hidden_layers` below the weights' layer count silently dropped layers.
#[test]
fn fewer_layers_in_config_than_in_weights_is_refused() {
    let s = scratch();
    edit_json(&s.model.join("config.json"), |v| {
        v["num_hidden_layers"] = 3.into()
    });
    let e = load_err(&s.model, None);
    assert_has(&e, &["num_hidden_layers", "is 3", "layer 3"]);
}

/// #18.10: prompts past 512 tokens run in chunks (bounded memory); the result is the same
/// model output as running them whole, within f32 rounding.
#[test]
fn chunked_prefill_equals_one_pass() {
    let opts = ModelOptions::default();
    let mut m = engine::load(&fixtures().join("q4g64"), None, &opts).unwrap();
    let ids: Vec<u32> = (0..1200u32).map(|i| (i * 7919) % 500).collect();
    let chunked = m.next_logits(&ids).unwrap();
    m.reset();
    let whole = m.forward(&ids, false, false).unwrap().logits;
    let whole: Vec<f32> = whole.flatten_all().unwrap().to_vec1().unwrap();
    let scale = whole.iter().fold(0f32, |a, v| a.max(v.abs()));
    let err = chunked
        .iter()
        .zip(&whole)
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()))
        / scale;
    assert!(err < 1e-4, "relative error {err}");
    assert_eq!(m.offset(), 1200);
}
