//! How many of the multiply-add instructions the CPU kernels are built on one core issues a
//! second (24 independent accumulators, registers only): the roof of a GEMM's inner loop, to
//! set beside `examples/prompt_gemm.rs`'s G multiply-adds/s. AVX-512 VNNI CPUs only.
//!
//!   cargo run --release --example issue_rate
//!
//! `vpdpwssd` is `fast`'s prompt GEMM (32 multiply-adds an instruction), `vpdpbusd` `int8`'s
//! (64), `vfmadd231ps` the f32 GEMM's (16).
#[cfg(target_arch = "x86_64")]
use std::arch::asm;
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;

    /// vpdpwssd on zmm registers: 24 independent accumulators a loop.
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dpwssd_zmm(n: u64) {
        let mut left = n;
        unsafe {
            asm!(
                "2:",
                    "vpdpwssd zmm0, zmm30, zmm31",
                    "vpdpwssd zmm1, zmm30, zmm31",
                    "vpdpwssd zmm2, zmm30, zmm31",
                    "vpdpwssd zmm3, zmm30, zmm31",
                    "vpdpwssd zmm4, zmm30, zmm31",
                    "vpdpwssd zmm5, zmm30, zmm31",
                    "vpdpwssd zmm6, zmm30, zmm31",
                    "vpdpwssd zmm7, zmm30, zmm31",
                    "vpdpwssd zmm8, zmm30, zmm31",
                    "vpdpwssd zmm9, zmm30, zmm31",
                    "vpdpwssd zmm10, zmm30, zmm31",
                    "vpdpwssd zmm11, zmm30, zmm31",
                    "vpdpwssd zmm12, zmm30, zmm31",
                    "vpdpwssd zmm13, zmm30, zmm31",
                    "vpdpwssd zmm14, zmm30, zmm31",
                    "vpdpwssd zmm15, zmm30, zmm31",
                    "vpdpwssd zmm16, zmm30, zmm31",
                    "vpdpwssd zmm17, zmm30, zmm31",
                    "vpdpwssd zmm18, zmm30, zmm31",
                    "vpdpwssd zmm19, zmm30, zmm31",
                    "vpdpwssd zmm20, zmm30, zmm31",
                    "vpdpwssd zmm21, zmm30, zmm31",
                    "vpdpwssd zmm22, zmm30, zmm31",
                    "vpdpwssd zmm23, zmm30, zmm31",
                "dec {left}",
                "jnz 2b",
                left = inout(reg) left,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _,
                out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _,
                out("zmm18") _, out("zmm19") _, out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                options(nostack),
            );
        }
        let _ = left;
    }

    /// vpdpbusd on zmm registers: 24 independent accumulators a loop.
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dpbusd_zmm(n: u64) {
        let mut left = n;
        unsafe {
            asm!(
                "2:",
                    "vpdpbusd zmm0, zmm30, zmm31",
                    "vpdpbusd zmm1, zmm30, zmm31",
                    "vpdpbusd zmm2, zmm30, zmm31",
                    "vpdpbusd zmm3, zmm30, zmm31",
                    "vpdpbusd zmm4, zmm30, zmm31",
                    "vpdpbusd zmm5, zmm30, zmm31",
                    "vpdpbusd zmm6, zmm30, zmm31",
                    "vpdpbusd zmm7, zmm30, zmm31",
                    "vpdpbusd zmm8, zmm30, zmm31",
                    "vpdpbusd zmm9, zmm30, zmm31",
                    "vpdpbusd zmm10, zmm30, zmm31",
                    "vpdpbusd zmm11, zmm30, zmm31",
                    "vpdpbusd zmm12, zmm30, zmm31",
                    "vpdpbusd zmm13, zmm30, zmm31",
                    "vpdpbusd zmm14, zmm30, zmm31",
                    "vpdpbusd zmm15, zmm30, zmm31",
                    "vpdpbusd zmm16, zmm30, zmm31",
                    "vpdpbusd zmm17, zmm30, zmm31",
                    "vpdpbusd zmm18, zmm30, zmm31",
                    "vpdpbusd zmm19, zmm30, zmm31",
                    "vpdpbusd zmm20, zmm30, zmm31",
                    "vpdpbusd zmm21, zmm30, zmm31",
                    "vpdpbusd zmm22, zmm30, zmm31",
                    "vpdpbusd zmm23, zmm30, zmm31",
                "dec {left}",
                "jnz 2b",
                left = inout(reg) left,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _,
                out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _,
                out("zmm18") _, out("zmm19") _, out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                options(nostack),
            );
        }
        let _ = left;
    }

    /// vfmadd231ps on zmm registers: 24 independent accumulators a loop.
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn fma_zmm(n: u64) {
        let mut left = n;
        unsafe {
            asm!(
                "2:",
                    "vfmadd231ps zmm0, zmm30, zmm31",
                    "vfmadd231ps zmm1, zmm30, zmm31",
                    "vfmadd231ps zmm2, zmm30, zmm31",
                    "vfmadd231ps zmm3, zmm30, zmm31",
                    "vfmadd231ps zmm4, zmm30, zmm31",
                    "vfmadd231ps zmm5, zmm30, zmm31",
                    "vfmadd231ps zmm6, zmm30, zmm31",
                    "vfmadd231ps zmm7, zmm30, zmm31",
                    "vfmadd231ps zmm8, zmm30, zmm31",
                    "vfmadd231ps zmm9, zmm30, zmm31",
                    "vfmadd231ps zmm10, zmm30, zmm31",
                    "vfmadd231ps zmm11, zmm30, zmm31",
                    "vfmadd231ps zmm12, zmm30, zmm31",
                    "vfmadd231ps zmm13, zmm30, zmm31",
                    "vfmadd231ps zmm14, zmm30, zmm31",
                    "vfmadd231ps zmm15, zmm30, zmm31",
                    "vfmadd231ps zmm16, zmm30, zmm31",
                    "vfmadd231ps zmm17, zmm30, zmm31",
                    "vfmadd231ps zmm18, zmm30, zmm31",
                    "vfmadd231ps zmm19, zmm30, zmm31",
                    "vfmadd231ps zmm20, zmm30, zmm31",
                    "vfmadd231ps zmm21, zmm30, zmm31",
                    "vfmadd231ps zmm22, zmm30, zmm31",
                    "vfmadd231ps zmm23, zmm30, zmm31",
                "dec {left}",
                "jnz 2b",
                left = inout(reg) left,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _,
                out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _,
                out("zmm18") _, out("zmm19") _, out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                options(nostack),
            );
        }
        let _ = left;
    }

    /// Each kind's G instructions/s (best of 5 runs of 50 M loops).
    pub fn main() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni")) {
            eprintln!("this CPU has no AVX-512 VNNI");
            std::process::exit(1);
        }
        let n = 50_000_000u64;
        type Loop = unsafe fn(u64);
        let kinds: [(&str, Loop, u32); 3] = [
            ("vpdpwssd zmm", dpwssd_zmm, 32),
            ("vpdpbusd zmm", dpbusd_zmm, 64),
            ("vfmadd231ps zmm", fma_zmm, 16),
        ];
        for (name, f, macs) in kinds {
            let best = (0..5)
                .map(|_| {
                    let t = std::time::Instant::now();
                    // SAFETY: the CPU has AVX-512 F and VNNI (checked above).
                    unsafe { f(n) };
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            let rate = (n * 24) as f64 / best / 1e9;
            println!(
                "{name:16} {rate:5.2} G instructions/s, {:6.1} G multiply-adds/s",
                rate * macs as f64
            );
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::main();
    #[cfg(not(target_arch = "x86_64"))]
    eprintln!("x86-64 only");
}
