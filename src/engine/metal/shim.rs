//! Test support: the MSL kernels compiled as C++ under `tests/metal_shim/shim.h` (g++ or clang++
//! with C++20; `CXX` picks it), one runner binary per kernel family, built once per test run.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The runner `tests/metal_shim/{name}.cpp`, compiled (once) into a temporary directory.
pub(crate) fn runner(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, (tempfile::TempDir, PathBuf)>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap();
    if let Some((_, exe)) = built.get(name) {
        return exe.clone();
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join(name);
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/metal_shim/{name}.cpp"));
    let out = std::process::Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-Wno-attributes", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("the Metal shim tests need a C++20 compiler ({cxx}): {e}"));
    assert!(
        out.status.success(),
        "{cxx} could not compile {} under the shim:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    built.insert(name.to_string(), (dir, exe.clone()));
    exe
}
