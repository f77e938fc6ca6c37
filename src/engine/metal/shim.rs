//! Test support: the MSL kernels compiled as C++ under `tests/metal_shim/shim.h` (g++ or clang++
//! with C++20; `CXX` picks it), with AddressSanitizer and UBSan, one runner binary per kernel
//! family, built once per test run.

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
        // AddressSanitizer and UBSan: a kernel reading or writing past a buffer (every buffer
        // is an exactly sized vector) or a threadgroup array, or overflowing, aborts the run
        .args([
            "-std=c++20",
            "-O1",
            "-g",
            "-Wno-attributes",
            "-pthread",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
            "-o",
        ])
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

/// The kernels of `qmatmul.metal` run by the shim's `runner` binary: the self-test's and the
/// plan tests' stand-in for the GPU.
pub(crate) struct ShimRunner;

impl crate::engine::metal::selftest::Runner for ShimRunner {
    fn run(
        &self,
        plan: &crate::engine::metal::plan::Plan,
        p: &crate::engine::quant::QParams,
        input: &[u8],
        w: &crate::engine::quant::QMatrix,
    ) -> Result<Vec<f32>, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let d = dir.path();
        let files: [(&str, &[u8]); 5] = [
            ("params.bin", &p.to_bytes()),
            ("x.bin", input),
            ("w.bin", &w.packed[..]),
            ("s.bin", &w.scales.bytes[..]),
            ("b.bin", &w.biases.bytes[..]),
        ];
        for (name, bytes) in files {
            std::fs::write(d.join(name), bytes).map_err(|e| e.to_string())?;
        }
        let st = std::process::Command::new(runner("runner"))
            .arg(plan.kernel)
            .arg(d)
            .args(
                [plan.grid[0], plan.grid[1], plan.threads[0], plan.threads[1]]
                    .map(|v| v.to_string()),
            )
            .status()
            .map_err(|e| e.to_string())?;
        if !st.success() {
            return Err(format!("the shim runner failed on {plan:?}: {st}"));
        }
        Ok(std::fs::read(d.join("y.bin"))
            .map_err(|e| e.to_string())?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}
