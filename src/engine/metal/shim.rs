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

/// Compiles the runner `tests/metal_shim/{name}.cpp` with `BOT_SHIM_STRICT` (address spaces as
/// distinct types, see shim.h) without building it; the compiler's complaint if any.
pub(crate) fn strict_check(name: &str) -> Result<(), String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/metal_shim/{name}.cpp"));
    let out = std::process::Command::new(&cxx)
        .args([
            "-std=c++20",
            "-fsyntax-only",
            "-Wno-attributes",
            "-DBOT_SHIM_STRICT",
        ])
        .arg(&src)
        .output()
        .map_err(|e| format!("{cxx}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn the_kernels_compile_with_address_spaces_as_types() {
    for name in ["runner", "step_runner"] {
        if let Err(e) = strict_check(name) {
            panic!("{name}.cpp under BOT_SHIM_STRICT:\n{e}");
        }
    }
}

/// The strict build does catch what the Metal compiler would: a device pointer handed to a
/// function whose parameter lacks `device`.
#[test]
fn the_strict_build_refuses_a_missing_address_space() {
    let dir = tempfile::tempdir().unwrap();
    let shim = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/metal_shim/shim.h");
    let src = dir.path().join("bad.cpp");
    let compile = |body: &str, strict: bool| {
        std::fs::write(&src, format!("#include \"{}\"\n{body}\n", shim.display())).unwrap();
        let mut c =
            std::process::Command::new(std::env::var("CXX").unwrap_or_else(|_| "g++".into()));
        c.args(["-std=c++20", "-fsyntax-only", "-Wno-attributes"]);
        if strict {
            c.arg("-DBOT_SHIM_STRICT");
        }
        c.arg(&src).output().unwrap().status.success()
    };
    let bad = "inline float f(const float* p) { return p[0]; }\n\
               kernel void k(device const float* x, device float* y) { y[0] = f(x); }\n\
               void run(float* a) { k((device const float*)a, (device float*)a); }";
    let good = bad.replace("f(const float* p)", "f(device const float* p)");
    assert!(compile(bad, false), "the plain shim build takes both");
    assert!(compile(&good, true));
    assert!(
        !compile(bad, true),
        "the strict build took a missing `device`"
    );
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
