//! How many of the multiply-add instructions the CPU kernels are built on one core issues a
//! second (24 independent accumulators, registers only): the roof of a GEMM's inner loop, to
//! set beside `examples/prompt_gemm.rs`'s G multiply-adds/s. AVX-512 VNNI CPUs only.
//!
//!   cargo run --release --example issue_rate
//!
//! `vpdpwssd` is `fast`'s prompt GEMM (32 multiply-adds an instruction), `vpdpbusd` `int8`'s
//! (64), `vfmadd231ps` the f32 GEMM's (16); "+ 1/8 f32" is `vpdpwssd` with the GEMM's share of
//! f32 steps among them (its rate counts the `vpdpwssd` only): the roof with its epilogue.

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;

    /// A function running `n` loops of 24 `$op zmmI, zmm30, zmm31`, each on its own
    /// accumulator, with `$e0`, `$e1`, `$e2` after the 8th, 16th and 24th (other instructions
    /// among them, on zmm24-29; empty for none).
    macro_rules! loop24 {
        ($name:ident, $op:literal) => {
            loop24!($name, $op, "", "", "");
        };
        ($name:ident, $op:literal, $e0:literal, $e1:literal, $e2:literal) => {
            #[target_feature(enable = "avx512f,avx512vnni")]
            unsafe fn $name(n: u64) {
                let mut left = n;
                unsafe {
                    asm!(
                        "2:",
                concat!($op, " zmm0, zmm30, zmm31"),
                concat!($op, " zmm1, zmm30, zmm31"),
                concat!($op, " zmm2, zmm30, zmm31"),
                concat!($op, " zmm3, zmm30, zmm31"),
                concat!($op, " zmm4, zmm30, zmm31"),
                concat!($op, " zmm5, zmm30, zmm31"),
                concat!($op, " zmm6, zmm30, zmm31"),
                concat!($op, " zmm7, zmm30, zmm31"),
                $e0,
                concat!($op, " zmm8, zmm30, zmm31"),
                concat!($op, " zmm9, zmm30, zmm31"),
                concat!($op, " zmm10, zmm30, zmm31"),
                concat!($op, " zmm11, zmm30, zmm31"),
                concat!($op, " zmm12, zmm30, zmm31"),
                concat!($op, " zmm13, zmm30, zmm31"),
                concat!($op, " zmm14, zmm30, zmm31"),
                concat!($op, " zmm15, zmm30, zmm31"),
                $e1,
                concat!($op, " zmm16, zmm30, zmm31"),
                concat!($op, " zmm17, zmm30, zmm31"),
                concat!($op, " zmm18, zmm30, zmm31"),
                concat!($op, " zmm19, zmm30, zmm31"),
                concat!($op, " zmm20, zmm30, zmm31"),
                concat!($op, " zmm21, zmm30, zmm31"),
                concat!($op, " zmm22, zmm30, zmm31"),
                concat!($op, " zmm23, zmm30, zmm31"),
                $e2,
                        "dec {left}",
                        "jnz 2b",
                        left = inout(reg) left,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _,
                out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _,
                out("zmm18") _, out("zmm19") _, out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                out("zmm24") _, out("zmm25") _, out("zmm26") _,
                        options(nostack),
                    );
                }
                let _ = left;
            }
        };
    }

    // `vpdpwssd` with three f32 steps among the 24 (on registers of their own): 1 to 8, the
    // share of the prompt GEMM's per-block epilogue (four f32 steps an accumulator against 32
    // `vpdpwssd`)
    loop24!(
        dpwssd_epilogue,
        "vpdpwssd",
        "vcvtdq2ps zmm24, zmm29",
        "vmulps zmm25, zmm28, zmm29",
        "vfmadd231ps zmm26, zmm28, zmm29"
    );
    loop24!(dpwssd_zmm, "vpdpwssd");
    loop24!(dpbusd_zmm, "vpdpbusd");
    loop24!(fma_zmm, "vfmadd231ps");

    /// Each kind's G instructions/s (best of 5 runs of 50 M loops).
    pub fn main() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni")) {
            eprintln!("this CPU has no AVX-512 VNNI");
            std::process::exit(1);
        }
        let n = 50_000_000u64;
        type Loop = unsafe fn(u64);
        let kinds: [(&str, Loop, u32); 4] = [
            ("vpdpwssd zmm", dpwssd_zmm, 32),
            ("vpdpwssd + 1/8 f32", dpwssd_epilogue, 32),
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
                "{name:18} {rate:5.2} G instructions/s, {:6.1} G multiply-adds/s",
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
