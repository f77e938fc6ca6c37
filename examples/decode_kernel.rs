//! Times the CPU decode matvec (`qmatmul`, m = 1) on one thread (or more) for the 0.6B shape's
//! matrix kinds, in G weights/s: the kernel alone, for A/B of kernel changes on one machine.
//! `bot bench` stays the measure of what users run.
//!
//!   cargo run --release --example decode_kernel [fast|int8] [rounds] [threads] [rows|tile16]
//!
//! `tile16` gives each matrix its decode copy 16 rows interleaved (`cpu::tile16`, read on
//! AVX-512 VNNI); the first shape (256x1024, 128 KiB of codes) stays in L2: the kernel's
//! arithmetic rather than the memory's rate.
use std::time::Instant;

use bot::engine::quant::{random, Numerics};
use bot::engine::weights::Dtype;

fn main() {
    let mut args = std::env::args().skip(1);
    let kernel = match args.next().as_deref() {
        Some("int8") => Numerics::Int8,
        _ => Numerics::Fast,
    };
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    let threads: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let tiles = args.next().as_deref() == Some("tile16");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    for (rows, cols) in [(256, 1024), (3072, 1024), (1024, 3072), (151936, 1024)] {
        let w = random::qmatrix(rows, cols, 4, 64, Dtype::BF16, 7);
        if tiles && bot::engine::cpu::tile16::attach(&w).is_none() {
            eprintln!("{rows}x{cols}: no tile16 copy for this matrix");
        }
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let mut y = vec![0f32; rows];
        let reps = (1_200_000_000 / (rows * cols)).max(1);
        let mut best = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            pool.install(|| {
                for _ in 0..reps {
                    bot::engine::cpu::quant::qmatmul(&w, &x, 1, &mut y, kernel);
                }
            });
            best.push((rows * cols * reps) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        best.sort_by(|a, b| a.total_cmp(b));
        println!(
            "{rows}x{cols} {kernel:?}: median {:.2} G weights/s (min {:.2}, max {:.2}); y[0] {}",
            best[best.len() / 2],
            best[0],
            best[best.len() - 1],
            y[0]
        );
    }
}
