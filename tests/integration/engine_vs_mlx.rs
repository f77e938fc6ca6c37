//! The engine against references computed by mlx_lm itself (tests/fixtures/tiny, made by
//! ../shared/oracle): f32 compute is compared with mlx's f32 references.

use bot::engine::{self, ModelOptions};

use crate::common::*;

#[test]
fn probe() {
    for (v, f32n) in variants() {
        for kind in ["base", "lora"] {
            let r = Reference::open(&v);
            let ids = r.prompt_ids();
            let adapter = fixtures().join("adapter");
            let mut m = engine::load(
                &fixtures().join(&v),
                (kind == "lora").then_some(adapter.as_path()),
                &ModelOptions::default(),
            )
            .unwrap();
            let out = m.forward(&ids, true, true).unwrap();
            let got: Vec<f32> = out.logits.flatten_all().unwrap().to_vec1().unwrap();
            let key = if f32n {
                format!("logits_{kind}")
            } else {
                format!("logits_{kind}_f32")
            };
            let (want, _) = r.f32(&key);
            println!("{v} {kind}: logits max diff {}", max_abs_diff(&got, &want));
            let hk = if f32n {
                format!("hidden_{kind}")
            } else {
                format!("hidden_{kind}_f32")
            };
            if r.has(&hk) {
                let (hw, shape) = r.f32(&hk);
                let per = shape[1] * shape[2];
                for (i, h) in out.hidden.iter().take(shape[0]).enumerate() {
                    let hv: Vec<f32> = h.flatten_all().unwrap().to_vec1().unwrap();
                    let mx = hw[i * per..(i + 1) * per]
                        .iter()
                        .fold(0f32, |a, b| a.max(b.abs()));
                    println!(
                        "   hidden {i}: {} (max {mx})",
                        max_abs_diff(&hv, &hw[i * per..(i + 1) * per])
                    );
                }
            }
            let g = greedy_ref(&v, kind, f32n);
            let want_ids: Vec<u32> = g["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let (_, got_ids) = m.greedy(&ids, 32).unwrap();
            println!("   greedy equal: {}", got_ids == want_ids);
        }
    }
}
