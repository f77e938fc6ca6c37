//! Which models the fused step runs (the rest take candle ops).

use super::*;

/// Why the fused step cannot run this model (the caller falls back to candle ops), if it cannot.
pub(crate) fn unsupported(m: &ModelView) -> Option<String> {
    let c = &m.cfg;
    if ![32, 64, 128, 256].contains(&c.head_dim) {
        return Some(format!("head_dim {} is not 32, 64, 128 or 256", c.head_dim));
    }
    if c.num_attention_heads % c.num_key_value_heads != 0 {
        return Some("heads are not a multiple of KV heads".into());
    }
    if c.hidden_size % 4 != 0 || c.intermediate_size % 4 != 0 {
        // the kernels read activation rows as float4
        return Some("hidden or intermediate size is not a multiple of 4".into());
    }
    let all = m.projections().chain([m.embed, &m.lm_head.weight]);
    for w in all {
        match w {
            Weight::Quant(_) => {}
            _ => return Some("a projection is not MLX-quantized (dense or repacked)".into()),
        }
    }
    for l in m.layers.iter().map(|l| l.linears) {
        for group in [&l[0..3], &l[4..6]] {
            let q: Vec<&QMatrix> = group
                .iter()
                .filter_map(|l| quant(&l.weight))
                .map(|a| a.as_ref())
                .collect();
            let same = q.windows(2).all(|w| {
                w[0].params.bits == w[1].params.bits
                    && w[0].params.group_size == w[1].params.group_size
                    && w[0].scales.dtype == w[1].scales.dtype
                    && w[0].biases.dtype == w[1].biases.dtype
            });
            if !same {
                return Some(format!(
                    "{} and its siblings are quantized differently",
                    q[0].name
                ));
            }
        }
    }
    None
}
