//! Compiles the CUDA kernels (`src/engine/cuda/qmatmul.cu`: the fused quantized matmul;
//! `src/engine/cuda/step.cu`: the rest of a Qwen3 step) to PTX when the `cuda` feature is on; the PTX is embedded in the binary and JIT-compiled by the
//! driver for the GPU it meets. `NVCC` or `CUDA_HOME` locate nvcc (else `nvcc` on PATH);
//! `CUDA_COMPUTE_CAP` (e.g. 90 for H100) picks the virtual architecture, 80 by default (the
//! TF32 tensor-core prefill kernel needs 8.0 or newer). Also sets `cfg(bot_metal)` where the
//! Metal backend is compiled in.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    // The Metal backend: asked for with `--features metal`, or implied by building on macOS.
    println!("cargo::rustc-check-cfg=cfg(bot_metal)");
    if std::env::var_os("CARGO_FEATURE_METAL").is_some()
        || std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos")
    {
        println!("cargo:rustc-cfg=bot_metal");
    }
    for f in ["qmatmul.cu", "step.cu", "sample.cu", "common.cuh"] {
        println!("cargo:rerun-if-changed=src/engine/cuda/{f}");
    }
    println!("cargo:rerun-if-changed=src/engine/kernels/sample.h");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = std::env::var("NVCC").ok().unwrap_or_else(|| {
        std::env::var("CUDA_HOME")
            .map(|h| format!("{h}/bin/nvcc"))
            .unwrap_or_else(|_| "nvcc".into())
    });
    let cap = std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .map(|c| c.trim().trim_start_matches("sm_").replace('.', ""))
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "80".into());
    // the host launches kernels with programmatic dependent launch only where the PTX has it
    println!("cargo:rustc-env=BOT_CUDA_ARCH={cap}");
    for name in ["qmatmul", "step", "sample"] {
        let src = format!("src/engine/cuda/{name}.cu");
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-o")
            .arg(out_dir.join(format!("{name}.ptx")))
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!("the `cuda` feature needs nvcc: could not run `{nvcc}` ({e}); set NVCC or CUDA_HOME")
            });
        assert!(status.success(), "nvcc failed on {src} ({status})");
    }
}
