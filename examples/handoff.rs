//! What one hand-off of parallel work to the workers costs, in the shape of a decode step:
//! a serial stretch, then `tasks` equal tasks over `threads` threads, `iters` times. Prints the
//! time per hand-off above the ideal (serial + tasks * work / threads) through rayon's pool and
//! through the decode step's spinning team (`bot::engine::cpu::team`).
//!
//!   cargo run --release --example handoff -- [threads] [serial_us] [work_us] [tasks] [iters]
use std::time::{Duration, Instant};

use bot::engine::cpu::team::{for_each_mut, Team};

fn spin_for(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn main() {
    let a: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|s| s.parse().ok())
        .collect();
    let arg = |i: usize, d: u64| a.get(i).copied().unwrap_or(d);
    let (threads, serial, work, tasks, iters) = (
        arg(0, 2) as usize,
        Duration::from_micros(arg(1, 20)),
        Duration::from_micros(arg(2, 10)),
        arg(3, 8) as usize,
        arg(4, 2000) as usize,
    );
    let ideal = serial + work * tasks as u32 / threads as u32;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let steps = || {
        let mut items = vec![0u8; tasks];
        let t = Instant::now();
        for _ in 0..iters {
            spin_for(serial);
            for_each_mut(&mut items, |_| spin_for(work));
        }
        t.elapsed()
    };
    for _round in 0..2 {
        for (name, team) in [("rayon", false), ("team", true)] {
            let t = pool.install(|| if team { Team::lead(steps) } else { steps() });
            let per = t.as_secs_f64() / iters as f64;
            println!(
                "{name:>6}: {:>7.1} us a hand-off, ideal {:>6.1}, overhead {:>6.1} us",
                per * 1e6,
                ideal.as_secs_f64() * 1e6,
                (per - ideal.as_secs_f64()) * 1e6
            );
        }
    }
}
