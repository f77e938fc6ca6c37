//! Times the decode matvecs of a whole 0.6B layer stack (q|k|v, o, gate|up, down x 28) and the
//! head on the decode team, in GB/s of weights, with the weights in 4 KiB pages and in 2 MiB
//! pages (`engine/resident.rs`), alternating: how close the projections stream to the machine's
//! read bandwidth. `bot bench` stays the measure of what users run.
//!
//!   cargo run --release --example layer_stream [rounds] [threads]
use std::time::Instant;

use bot::engine::config::QuantParams;
use bot::engine::cpu::quant::{qmatmul, qmatvec_shared};
use bot::engine::resident::Residency;
use bot::engine::synthetic::{self, Shape};
use bot::engine::{Numerics, QMatrix, WeightStore};

fn matrix(s: &WeightStore, name: &str, rows: usize, cols: usize) -> QMatrix {
    let t = |p: &str| s.require(&format!("{name}.{p}")).expect("tensor");
    let params = QuantParams {
        group_size: 64,
        bits: 4,
    };
    QMatrix::from_tensors(
        name,
        rows,
        cols,
        params,
        t("weight"),
        t("scales"),
        t("biases"),
    )
    .expect("matrix")
}

type Layer = ([QMatrix; 3], QMatrix, [QMatrix; 2], QMatrix);

fn load(residency: Residency) -> (Vec<Layer>, QMatrix) {
    let (_, s) = synthetic::build(Shape::Qwen3_0_6b, 7, residency).expect("build");
    let layers = (0..28)
        .map(|l| {
            let p = format!("model.layers.{l}");
            let m = |n: &str, r, c| matrix(&s, &format!("{p}.{n}"), r, c);
            (
                [
                    m("self_attn.q_proj", 2048, 1024),
                    m("self_attn.k_proj", 1024, 1024),
                    m("self_attn.v_proj", 1024, 1024),
                ],
                m("self_attn.o_proj", 1024, 2048),
                [m("mlp.gate_proj", 3072, 1024), m("mlp.up_proj", 3072, 1024)],
                m("mlp.down_proj", 1024, 3072),
            )
        })
        .collect();
    (layers, matrix(&s, "model.embed_tokens", 151936, 1024))
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    let threads: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let sets = [
        ("4 KiB pages", load(Residency::Mapped)),
        ("2 MiB pages", load(Residency::HugeCopied)),
    ];
    let bytes = |r: usize, c: usize| (r * c / 2 + r * c / 64 * 4) as f64;
    let layer_bytes =
        28.0 * (bytes(4096, 1024) + bytes(1024, 2048) + bytes(6144, 1024) + bytes(1024, 3072));
    let xs: Vec<Vec<f32>> = [1024, 2048, 3072]
        .iter()
        .map(|&n| {
            (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect()
        })
        .collect();
    let k = Numerics::Fast;
    let mut res = vec![(Vec::new(), Vec::new()); sets.len()];
    for _ in 0..rounds {
        for (si, (_, (layers, head))) in sets.iter().enumerate() {
            let (tl, th) = pool.install(|| {
                bot::engine::cpu::team::Team::lead(|| {
                    let t = Instant::now();
                    let mut s = 0f32;
                    let mut y = vec![0f32; 1024];
                    for (qkv, o, gu, down) in layers {
                        let ys = qmatvec_shared(&qkv.iter().collect::<Vec<_>>(), &xs[0], k);
                        s += ys.expect("qkv")[0][0];
                        qmatmul(o, &xs[1], 1, &mut y, k);
                        let ys = qmatvec_shared(&gu.iter().collect::<Vec<_>>(), &xs[0], k);
                        s += ys.expect("gate|up")[1][0];
                        qmatmul(down, &xs[2], 1, &mut y, k);
                        s += y[0];
                    }
                    let tl = t.elapsed().as_secs_f64();
                    let t = Instant::now();
                    let mut y = vec![0f32; 151936];
                    qmatmul(head, &xs[0], 1, &mut y, k);
                    std::hint::black_box((s, &y));
                    (tl, t.elapsed().as_secs_f64())
                })
            });
            res[si].0.push(layer_bytes / tl / 1e9);
            res[si].1.push(bytes(151936, 1024) / th / 1e9);
        }
    }
    for ((name, _), (l, h)) in sets.iter().zip(&mut res) {
        l.sort_by(f64::total_cmp);
        h.sort_by(f64::total_cmp);
        let q = |v: &[f64], f: usize| v[(v.len() - 1) * f / 4];
        println!(
            "{name}: layers {:.1} GB/s (quartiles {:.1}-{:.1}), head {:.1} GB/s ({:.1}-{:.1})",
            q(l, 2),
            q(l, 1),
            q(l, 3),
            q(h, 2),
            q(h, 1),
            q(h, 3)
        );
    }
}
