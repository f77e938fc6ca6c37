//! Shared helpers: fixture paths and reference loading.

use std::path::{Path, PathBuf};

use bot::engine::weights::SafetensorsFile;
use serde_json::Value;

/// The committed fixtures; `BOT_FIXTURES` points elsewhere (a test binary run on another
/// machine, such as the GPU machine, where the source tree sits at another path).
pub fn fixtures() -> PathBuf {
    match std::env::var_os("BOT_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny"),
    }
}

/// The head_dim-128 fixture (real Qwen3's head size; tests/fixtures/hd128), beside `fixtures()`.
pub fn fixtures_hd128() -> PathBuf {
    fixtures()
        .parent()
        .expect("the fixtures directory has a parent")
        .join("hd128")
}

/// Every fixture set: (root, variants with whether their params are f32 natively).
pub fn fixture_sets() -> Vec<(PathBuf, Vec<(String, bool)>)> {
    [fixtures(), fixtures_hd128()]
        .into_iter()
        .map(|root| {
            let v = variants_at(&root);
            (root, v)
        })
        .collect()
}

/// The device the engine tests run on: `BOT_TEST_DEVICE` (cpu, cuda, metal), CPU by default.
/// A device that is asked for but missing fails the test rather than falling back.
pub fn test_device() -> candle_core::Device {
    use bot::engine::device::{select, DeviceKind};
    let kind = match std::env::var("BOT_TEST_DEVICE").as_deref() {
        Ok("cuda") => DeviceKind::Cuda,
        Ok("metal") => DeviceKind::Metal,
        Ok("cpu") | Err(_) => DeviceKind::Cpu,
        Ok(other) => panic!("BOT_TEST_DEVICE={other}: expected cpu, cuda or metal"),
    };
    select(kind)
        .expect("BOT_TEST_DEVICE names a device this build or machine lacks")
        .device
}

pub fn manifest() -> Value {
    manifest_at(&fixtures())
}

pub fn manifest_at(root: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(root.join("manifest.json")).unwrap()).unwrap()
}

/// Variants in the committed fixture, with whether their params are f32 natively.
pub fn variants() -> Vec<(String, bool)> {
    variants_at(&fixtures())
}

pub fn variants_at(root: &Path) -> Vec<(String, bool)> {
    let m = manifest_at(root);
    let mut v: Vec<(String, bool)> = m["variants"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| root.join(k).is_dir())
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
        Self::open_at(&fixtures(), variant)
    }
    pub fn open_at(root: &Path, variant: &str) -> Self {
        let p = root.join("ref").join(variant).join("ref.safetensors");
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
    greedy_ref_at(&fixtures(), variant, kind, f32_native)
}

pub fn greedy_ref_at(root: &Path, variant: &str, kind: &str, f32_native: bool) -> Value {
    let name = if f32_native {
        format!("greedy_{kind}.json")
    } else {
        format!("greedy_{kind}_f32.json")
    };
    let p = root.join("ref").join(variant).join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}
