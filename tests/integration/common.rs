//! Shared helpers: fixture paths and reference loading.

use std::path::{Path, PathBuf};

use bot::engine::weights::SafetensorsFile;
use serde_json::Value;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny")
}

pub fn manifest() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).unwrap())
        .unwrap()
}

/// Variants in the committed fixture, with whether their params are f32 natively.
pub fn variants() -> Vec<(String, bool)> {
    let m = manifest();
    let mut v: Vec<(String, bool)> = m["variants"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| fixtures().join(k).is_dir())
        .map(|(k, v)| (k.clone(), v["dtype"] == "float32"))
        .collect();
    v.sort();
    v
}

pub struct Reference {
    file: SafetensorsFile,
}

impl Reference {
    pub fn open(variant: &str) -> Self {
        let p = fixtures().join("ref").join(variant).join("ref.safetensors");
        Reference {
            file: SafetensorsFile::open(&p).unwrap(),
        }
    }
    pub fn has(&self, name: &str) -> bool {
        self.file.tensors.contains_key(name)
    }
    pub fn f32(&self, name: &str) -> (Vec<f32>, Vec<usize>) {
        let t = self
            .file
            .get(name)
            .unwrap_or_else(|| panic!("reference has no `{name}`"));
        (t.to_f32_vec().unwrap(), t.shape.clone())
    }
    pub fn prompt_ids(&self) -> Vec<u32> {
        let t = self.file.get("prompt_ids").unwrap();
        t.bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32)
            .collect()
    }
}

pub fn greedy_ref(variant: &str, kind: &str, f32_native: bool) -> Value {
    let name = if f32_native {
        format!("greedy_{kind}.json")
    } else {
        format!("greedy_{kind}_f32.json")
    };
    let p = fixtures().join("ref").join(variant).join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}
