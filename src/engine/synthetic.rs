//! Random-weight models of Qwen3's real shapes in MLX 4-bit group-64 layout, for benchmarks
//! (`bot bench --synthetic`) and for `--save` (an mlx_lm directory). The codes are uniformly
//! random and the scales and biases are chosen so each dequantized row has mean ~0 and
//! standard deviation ~1/sqrt(in): valid, non-zero data that runs like real weights (all-zero
//! tensors would take shortcuts real data never takes).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::engine::config::Qwen3Config;
use crate::engine::error::{EngineError, Result};
use crate::engine::lora::{Adapter, LoraBranch};
use crate::engine::resident::{HugeBuf, Residency};
use crate::engine::weights::{plan_safetensors, Dtype, FilePlan, SafetensorsFile, WeightStore};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Shape {
    #[value(name = "qwen3-0.6b")]
    Qwen3_0_6b,
    #[value(name = "qwen3-4b")]
    Qwen3_4b,
    #[value(name = "qwen3-8b")]
    Qwen3_8b,
}

impl Shape {
    /// (hidden, intermediate, layers, heads, kv heads, tied) of the public Qwen3 configs.
    fn dims(self) -> (usize, usize, usize, usize, usize, bool) {
        match self {
            Shape::Qwen3_0_6b => (1024, 3072, 28, 16, 8, true),
            Shape::Qwen3_4b => (2560, 9728, 36, 32, 8, true),
            Shape::Qwen3_8b => (4096, 12288, 36, 32, 8, false),
        }
    }

    /// config.json as mlx_lm writes it for this shape, 4-bit group 64.
    pub fn config_json(self) -> serde_json::Value {
        let (h, i, l, nh, nkv, tied) = self.dims();
        serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": h, "intermediate_size": i, "num_hidden_layers": l,
            "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": 128,
            "vocab_size": 151936, "tie_word_embeddings": tied,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
            "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
            "quantization": {"group_size": 64, "bits": 4, "mode": "affine"},
            "quantization_config": {"group_size": 64, "bits": 4, "mode": "affine"},
        })
    }
}

/// SplitMix64: a tiny, fast generator; each chunk of each tensor gets its own stream.
struct SplitMix(u64);
impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

enum Fill {
    Codes,
    Scales { sigma: f32 },
    Biases { sigma: f32 },
    Norm,
}

/// The tensor list of a 4-bit group-64 model of `cfg`'s shape.
fn tensor_list(cfg: &Qwen3Config) -> TensorList {
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (nh, nkv, v) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.vocab_size,
    );
    let mut t = Vec::new();
    let mut quant = |name: String, out: usize, inp: usize, sigma: f32| {
        t.push((
            format!("{name}.weight"),
            Dtype::U32,
            vec![out, inp / 8],
            Fill::Codes,
        ));
        t.push((
            format!("{name}.scales"),
            Dtype::BF16,
            vec![out, inp / 64],
            Fill::Scales { sigma },
        ));
        t.push((
            format!("{name}.biases"),
            Dtype::BF16,
            vec![out, inp / 64],
            Fill::Biases { sigma },
        ));
    };
    let lin = |inp: usize| 1.0 / (inp as f32).sqrt();
    quant("model.embed_tokens".into(), v, h, 0.3);
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        quant(format!("{p}.self_attn.q_proj"), nh * hd, h, lin(h));
        quant(format!("{p}.self_attn.k_proj"), nkv * hd, h, lin(h));
        quant(format!("{p}.self_attn.v_proj"), nkv * hd, h, lin(h));
        quant(format!("{p}.self_attn.o_proj"), h, nh * hd, lin(nh * hd));
        quant(format!("{p}.mlp.gate_proj"), i, h, lin(h));
        quant(format!("{p}.mlp.up_proj"), i, h, lin(h));
        quant(format!("{p}.mlp.down_proj"), h, i, lin(i));
    }
    if !cfg.tie_word_embeddings {
        quant("lm_head".into(), v, h, 3.0 * lin(h));
    }
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        t.push((
            format!("{p}.self_attn.q_norm.weight"),
            Dtype::BF16,
            vec![hd],
            Fill::Norm,
        ));
        t.push((
            format!("{p}.self_attn.k_norm.weight"),
            Dtype::BF16,
            vec![hd],
            Fill::Norm,
        ));
        t.push((
            format!("{p}.input_layernorm.weight"),
            Dtype::BF16,
            vec![h],
            Fill::Norm,
        ));
        t.push((
            format!("{p}.post_attention_layernorm.weight"),
            Dtype::BF16,
            vec![h],
            Fill::Norm,
        ));
    }
    t.push(("model.norm.weight".into(), Dtype::BF16, vec![h], Fill::Norm));
    t
}

/// A whole safetensors file of a random model of `cfg`'s shape, built in one buffer.
pub fn build_file(cfg: &Qwen3Config, seed: u64) -> Vec<u8> {
    let mut buf = vec![0u8; file_len(cfg)];
    fill_file(cfg, seed, &mut buf);
    buf
}

/// Each tensor of a random model: name, dtype, shape and how it is filled.
type TensorList = Vec<(String, Dtype, Vec<usize>, Fill)>;

fn plan_for(cfg: &Qwen3Config) -> (TensorList, FilePlan) {
    let list = tensor_list(cfg);
    let plan = plan_safetensors(
        &list
            .iter()
            .map(|(n, d, s, _)| (n.clone(), *d, s.clone()))
            .collect::<Vec<_>>(),
    );
    (list, plan)
}

/// The size of `build_file`'s file.
pub fn file_len(cfg: &Qwen3Config) -> usize {
    plan_for(cfg).1.bytes_total
}

/// `build_file` into `buf` (`file_len` bytes).
pub fn fill_file(cfg: &Qwen3Config, seed: u64, buf: &mut [u8]) {
    let (list, plan) = plan_for(cfg);
    buf[..plan.header.len()].copy_from_slice(&plan.header);
    const CHUNK: usize = 1 << 16;
    for (ti, ((_, _, _, fill), range)) in list.iter().zip(&plan.ranges).enumerate() {
        buf[range.clone()]
            .par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(ci, out)| {
                let mut rng = SplitMix(
                    seed ^ ((ti as u64) << 32) ^ (ci as u64).wrapping_mul(0x2545_F491_4F6C_DD1D),
                );
                let mut put_bf16 = |f: &mut dyn FnMut(&mut SplitMix) -> f32| {
                    for c in out.chunks_exact_mut(2) {
                        c.copy_from_slice(&bf16::from_f32(f(&mut rng)).to_le_bytes());
                    }
                };
                // q is uniform on 0..=15 (mean 7.5, sd 4.6): w = s*q + b has sd ~ sigma, mean ~ 0
                match fill {
                    Fill::Codes => {
                        for c in out.chunks_mut(8) {
                            let r = rng.next().to_le_bytes();
                            c.copy_from_slice(&r[..c.len()]);
                        }
                    }
                    Fill::Scales { sigma } => put_bf16(&mut |r| sigma / 4.6 * r.uniform(0.8, 1.2)),
                    Fill::Biases { sigma } => {
                        put_bf16(&mut |r| -7.5 * sigma / 4.6 * r.uniform(0.9, 1.1))
                    }
                    Fill::Norm => put_bf16(&mut |r| r.uniform(0.8, 1.2)),
                }
            });
    }
}

/// Config and weight store of a random model of `shape`, in memory (in a buffer of huge pages
/// unless `residency` is `Mapped`: building it costs the same either way).
pub fn build(shape: Shape, seed: u64, residency: Residency) -> Result<(Qwen3Config, WeightStore)> {
    let text = shape.config_json().to_string();
    let dir = Path::new("<synthetic>");
    let cfg = Qwen3Config::parse(&dir.join("config.json"), &text, None)?;
    let path = dir.join("model.safetensors");
    let file = if residency != Residency::Mapped {
        let mut buf = HugeBuf::zeroed(file_len(&cfg)).map_err(|e| EngineError::io(&path, e))?;
        fill_file(&cfg, seed, &mut buf);
        SafetensorsFile::from_huge(&path, buf)?
    } else {
        SafetensorsFile::from_bytes(&path, build_file(&cfg, seed))?
    };
    Ok((cfg, WeightStore::from_files(dir, vec![file])))
}

/// Writes a random model of `shape` as an mlx_lm directory: config.json, generation_config.json,
/// model.safetensors (+ index), and the tokenizer files copied from `tokenizer_dir` if given.
pub fn save(shape: Shape, seed: u64, dir: &Path, tokenizer_dir: Option<&Path>) -> Result<()> {
    let io = |p: &Path, e| EngineError::io(p, e);
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let cfg_json = shape.config_json();
    let text = serde_json::to_string_pretty(&cfg_json).unwrap_or_default();
    let cfg = Qwen3Config::parse(&dir.join("config.json"), &text, None)?;
    let bytes = build_file(&cfg, seed);
    let st = dir.join("model.safetensors");
    std::fs::write(&st, &bytes).map_err(|e| io(&st, e))?;
    let parsed = SafetensorsFile::from_bytes(&st, bytes)?;
    let weight_map: BTreeMap<&String, &str> = parsed
        .tensors
        .keys()
        .map(|k| (k, "model.safetensors"))
        .collect();
    let index = serde_json::json!({"metadata": {"total_size": std::fs::metadata(&st).map(|m| m.len()).unwrap_or(0)}, "weight_map": weight_map});
    for (name, value) in [
        ("model.safetensors.index.json", index),
        (
            "generation_config.json",
            serde_json::json!({"eos_token_id": [151645, 151643]}),
        ),
        ("config.json", cfg_json),
    ] {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(&value).unwrap_or_default())
            .map_err(|e| io(&p, e))?;
    }
    if let Some(t) = tokenizer_dir {
        for name in ["tokenizer.json", "tokenizer_config.json"] {
            let (from, to) = (t.join(name), dir.join(name));
            std::fs::copy(&from, &to).map_err(|e| io(&from, e))?;
        }
    }
    Ok(())
}

/// A rank-8, scale-20 adapter on all seven projections of the last 16 layers (the user's
/// adapter's layout), random but seeded.
pub fn lora(cfg: &Qwen3Config, seed: u64, device: &Device) -> Result<Adapter> {
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let rank = 8;
    let mut rng = SplitMix(seed ^ 0x10AA);
    let mut mat = |rows: usize, cols: usize, bound: f32| -> Result<Tensor> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| rng.uniform(-bound, bound))
            .collect();
        Ok(Tensor::from_vec(v, (rows, cols), device)?)
    };
    let mut branches = BTreeMap::new();
    let first = cfg.num_hidden_layers.saturating_sub(16);
    for l in first..cfg.num_hidden_layers {
        for (name, inp, out) in [
            ("self_attn.q_proj", h, nh * hd),
            ("self_attn.k_proj", h, nkv * hd),
            ("self_attn.v_proj", h, nkv * hd),
            ("self_attn.o_proj", nh * hd, h),
            ("mlp.gate_proj", h, i),
            ("mlp.up_proj", h, i),
            ("mlp.down_proj", i, h),
        ] {
            let a = mat(inp, rank, 1.0 / (inp as f32).sqrt())?;
            let b = mat(rank, out, 0.01)?;
            branches.insert(
                format!("model.layers.{l}.{name}"),
                LoraBranch::new(a, b, 20.0)?,
            );
        }
    }
    Ok(Adapter {
        dir: "<synthetic-lora>".into(),
        scale: 20.0,
        rank,
        branches,
    })
}
