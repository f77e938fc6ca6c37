//! Times the CPU attention step (`cpu::attention::attend`: q/k norm, RoPE, the cache append,
//! softmax attention) at the 0.6B shape (16 query heads, 8 KV heads, head dim 128) on a pool
//! of `threads` workers, in microseconds a layer: a prompt of `tokens` from an empty cache, or
//! with `decode` one token at `tokens` cached positions (the cache stays in L3 here, unlike a
//! real decode step, where the weights evict it). For A/B of attention changes on one machine;
//! `bot bench` stays the measure of what users run.
//!
//!   cargo run --release --example attention [f16|f32] [prompt|decode] [tokens] [threads]
use std::time::Instant;

use bot::engine::cpu::attention::{attend, Dims, HostKv};

fn main() {
    let mut args = std::env::args().skip(1);
    let half = args.next().as_deref() != Some("f32");
    let decode = args.next().as_deref() == Some("decode");
    let tokens: usize = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64)
        .max(1);
    let threads: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(2).max(1);
    bot::engine::cpu::heap::keep_freed_buffers();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let (nh, nkv, hd) = (16, 8, 128);
    let d = Dims {
        n_heads: nh,
        n_kv: nkv,
        head_dim: hd,
        eps: 1e-6,
    };
    let norm = vec![1f32; hd];
    let val = |n: usize, seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 31 + seed * 17) % 97) as f32 - 48.0) / 20.0)
            .collect()
    };
    let angles = |n: usize| {
        let a: Vec<f32> = (0..n * hd / 2).map(|i| (i % 61) as f32 * 0.05).collect();
        (
            a.iter().map(|x| x.cos()).collect::<Vec<_>>(),
            a.iter().map(|x| x.sin()).collect::<Vec<_>>(),
        )
    };
    let (cos, sin) = angles(tokens);
    let step = |l: usize, kv: &mut HostKv, cos: &[f32], sin: &[f32]| {
        let (q, k, v) = (
            val(l * nh * hd, 1),
            val(l * nkv * hd, 2),
            val(l * nkv * hd, 3),
        );
        let t = Instant::now();
        let _ = attend(&d, q, k, &v, &norm, &norm, cos, sin, kv);
        t.elapsed()
    };
    for _ in 0..5 {
        let reps = if decode { 500 } else { 50 };
        let mut spent = std::time::Duration::ZERO;
        pool.install(|| {
            let mut kv = HostKv::new(half);
            if decode {
                let _ = step(tokens, &mut kv, &cos, &sin);
            }
            for _ in 0..reps {
                if decode {
                    spent += step(1, &mut kv, &cos[..hd / 2], &sin[..hd / 2]);
                    kv.truncate(tokens, hd);
                } else {
                    kv.clear();
                    spent += step(tokens, &mut kv, &cos, &sin);
                }
            }
        });
        println!(
            "{} {tokens} tokens, {} cache, {threads} threads: {:.1} us a layer",
            if decode { "decode at" } else { "prompt of" },
            if half { "f16" } else { "f32" },
            spent.as_secs_f64() * 1e6 / reps as f64
        );
    }
}
