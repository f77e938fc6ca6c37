//! Times the CPU prompt matmul (`qmatmul`, m = 64 rows) for the 0.6B shape's matrix kinds, in
//! G multiply-adds/s, with the kernel `BOT_CPU_ISA` and `--kernel`-like first argument pick:
//! the prompt GEMMs alone, for A/B of kernel changes on one machine. `bot bench` stays the
//! measure of what users run.
//!
//!   cargo run --release --example prompt_gemm [fast|exact|int8] [rounds] [threads] [m] [0.6b|8b] [tile16]
//!
//! `8b` times the 8B shape's matrix kinds instead (q, k/v, gate|up, down); `tile16` gives each
//! matrix its decode copy first (`cpu/tile16.rs`), which the AMX and AVX-512 VNNI GEMMs then read.
use std::time::Instant;

use bot::engine::quant::{random, Numerics};
use bot::engine::weights::Dtype;

fn main() {
    let mut args = std::env::args().skip(1);
    let kernel = match args.next().as_deref() {
        Some("exact") => Numerics::Exact,
        Some("int8") => Numerics::Int8,
        _ => Numerics::Fast,
    };
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    let threads: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let m: usize = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64)
        .max(1);
    let eight = args.next().as_deref() == Some("8b");
    let copy = args.next().as_deref() == Some("tile16");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    println!(
        "isa {}, {kernel:?}, {threads} threads, m {m}",
        bot::engine::cpu::isa::active().name()
    );
    let shapes: &[(usize, usize)] = if eight {
        &[(4096, 4096), (1024, 4096), (24576, 4096), (4096, 12288)]
    } else {
        &[
            (2048, 1024),
            (1024, 1024),
            (6144, 1024),
            (1024, 3072),
            (1024, 2048),
        ]
    };
    for &(rows, cols) in shapes {
        let w = random::qmatrix(rows, cols, 4, 64, Dtype::BF16, 7);
        if copy && bot::engine::cpu::tile16::attach(&w).is_none() {
            eprintln!("no tile16 copy for {rows} x {cols}");
        }
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let mut y = vec![0f32; m * rows];
        let reps = (4_000_000_000 / (rows * cols * m)).max(1);
        let mut best = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            pool.install(|| {
                for _ in 0..reps {
                    bot::engine::cpu::quant::qmatmul(&w, &x, m, &mut y, kernel);
                }
            });
            best.push((rows * cols * m * reps) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        best.sort_by(|a, b| a.total_cmp(b));
        println!(
            "{rows:>6} x {cols:<5} {:>8.1} G MAC/s (best of {rounds}; {:.3} ms a call)",
            best[rounds - 1],
            (rows * cols * m) as f64 / best[rounds - 1] / 1e6
        );
    }
}
