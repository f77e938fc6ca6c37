//! Times the decode matvecs of a whole layer stack (q|k|v, o, gate|up, down) and the head of a
//! Qwen3 shape on the decode team, in GB/s of weights, with the weights in 4 KiB pages and in
//! 2 MiB pages (`engine/resident.rs`), alternating: how close the projections stream to the
//! machine's read bandwidth. `bot bench` stays the measure of what users run.
//!
//!   cargo run --release --example layer_stream [rounds] [threads] [qwen3-0.6b|qwen3-8b] [fast|int8]
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

/// (hidden, intermediate, layers, q width, kv width, head tensor) of `shape`.
fn dims(shape: Shape) -> (usize, usize, usize, usize, usize, &'static str) {
    let c = shape.config_json();
    let u = |k: &str| c[k].as_u64().expect("config field") as usize;
    let head = if c["tie_word_embeddings"].as_bool() == Some(true) {
        "model.embed_tokens"
    } else {
        "lm_head"
    };
    let hd = u("head_dim");
    let (h, i, l) = (
        u("hidden_size"),
        u("intermediate_size"),
        u("num_hidden_layers"),
    );
    (
        h,
        i,
        l,
        u("num_attention_heads") * hd,
        u("num_key_value_heads") * hd,
        head,
    )
}

fn load(shape: Shape, residency: Residency) -> (Vec<Layer>, QMatrix) {
    let (h, i, layers, q, kv, head) = dims(shape);
    let (_, s) = synthetic::build(shape, 7, residency).expect("build");
    let layers = (0..layers)
        .map(|l| {
            let p = format!("model.layers.{l}");
            let m = |n: &str, r, c| matrix(&s, &format!("{p}.{n}"), r, c);
            (
                [
                    m("self_attn.q_proj", q, h),
                    m("self_attn.k_proj", kv, h),
                    m("self_attn.v_proj", kv, h),
                ],
                m("self_attn.o_proj", h, q),
                [m("mlp.gate_proj", i, h), m("mlp.up_proj", i, h)],
                m("mlp.down_proj", h, i),
            )
        })
        .collect();
    (layers, matrix(&s, head, 151936, h))
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    let threads: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(2);
    let shape = match args.next().as_deref() {
        Some("qwen3-8b") => Shape::Qwen3_8b,
        Some("qwen3-4b") => Shape::Qwen3_4b,
        _ => Shape::Qwen3_0_6b,
    };
    let k = match args.next().as_deref() {
        Some("int8") => Numerics::Int8,
        _ => Numerics::Fast,
    };
    let (h, i, nl, q, kv, _) = dims(shape);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let sets = [
        ("4 KiB pages", load(shape, Residency::Mapped)),
        ("2 MiB pages", load(shape, Residency::HugeCopied)),
    ];
    let bytes = |r: usize, c: usize| (r * c / 2 + r * c / 64 * 4) as f64;
    let layer_bytes =
        nl as f64 * (bytes(q + 2 * kv, h) + bytes(h, q) + bytes(2 * i, h) + bytes(h, i));
    let xs: Vec<Vec<f32>> = [h, q, i]
        .iter()
        .map(|&n| {
            (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect()
        })
        .collect();
    let mut res = vec![(Vec::new(), Vec::new()); sets.len()];
    for _ in 0..rounds {
        for (si, (_, (layers, head))) in sets.iter().enumerate() {
            let (tl, th) = pool.install(|| {
                bot::engine::cpu::team::Team::lead(|| {
                    let t = Instant::now();
                    let mut s = 0f32;
                    let mut y = vec![0f32; h];
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
            res[si].1.push(bytes(151936, h) / th / 1e9);
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
