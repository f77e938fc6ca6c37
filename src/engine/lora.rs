//! Runtime LoRA from an mlx_lm adapter directory (`adapter_config.json` + `adapters.safetensors`,
//! as `mlx_lm lora --train` writes them). Follows `mlx_lm/tuner/lora.py` `LoRALinear`:
//! `y = base(x) + scale * ((x @ lora_a) @ lora_b)`, `lora_a` [in, r], `lora_b` [r, out], with
//! `scale = lora_parameters.scale` used as is (mlx_lm does not divide by the rank). The branch
//! runs in f32 beside the quantized base and is never merged into the 4-bit weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::Value;

use crate::engine::error::{EngineError, Result};
use crate::engine::weights::SafetensorsFile;

/// One adapted projection.
#[derive(Debug, Clone)]
pub struct LoraBranch {
    /// [in, r]
    pub a: Tensor,
    /// [r, out]
    pub b: Tensor,
    pub scale: f64,
}

impl LoraBranch {
    /// `scale * ((x @ a) @ b)` for `x` (L, in).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok((x.matmul(&self.a)?.matmul(&self.b)? * self.scale)?)
    }
}

/// An adapter: module path (e.g. `model.layers.27.mlp.down_proj`) -> branch.
#[derive(Debug, Clone)]
pub struct Adapter {
    pub dir: PathBuf,
    pub scale: f64,
    pub rank: usize,
    pub branches: BTreeMap<String, LoraBranch>,
}

/// Largest adapter scale accepted: far above any trained adapter, far below overflow.
const MAX_SCALE: f64 = 1e4;

impl Adapter {
    /// Loads an adapter directory. Shapes are checked against the model later, by
    /// `check_module`, when each projection is built.
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let cfg_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| EngineError::io(&cfg_path, e))?;
        let file = SafetensorsFile::open(&dir.join("adapters.safetensors"))?;
        Self::from_parts(dir, &text, &file, device)
    }

    /// The adapter of `adapter_config.json`'s text and the parsed `adapters.safetensors`
    /// (pure: `dir` only names the files in messages).
    pub fn from_parts(
        dir: &Path,
        text: &str,
        file: &SafetensorsFile,
        device: &Device,
    ) -> Result<Self> {
        let cfg_path = dir.join("adapter_config.json");
        let err = |why: String| EngineError::Adapter {
            path: cfg_path.clone(),
            why,
        };
        let cfg: Value =
            serde_json::from_str(&text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        let ft = cfg
            .get("fine_tune_type")
            .and_then(Value::as_str)
            .unwrap_or("lora");
        if ft != "lora" {
            return Err(err(format!(
                "fine_tune_type `{ft}` is not supported: only `lora` adapters run (DoRA and full fine-tunes do not)"
            )));
        }
        let lp = cfg
            .get("lora_parameters")
            .ok_or_else(|| err("field `lora_parameters` is missing".into()))?;
        let scale = lp.get("scale").and_then(Value::as_f64).ok_or_else(|| {
            err("field `lora_parameters.scale` is missing or not a number".into())
        })?;
        if !(scale.is_finite() && scale.abs() <= MAX_SCALE) {
            return Err(err(format!(
                "lora_parameters.scale is {scale}: expected a finite number within ±{MAX_SCALE} \
                 (mlx_lm uses it as is; adapters are trained with 1 to a few tens)"
            )));
        }
        let rank_cfg = lp.get("rank").and_then(Value::as_u64).map(|r| r as usize);

        let st_path = dir.join("adapters.safetensors");
        let mut pairs: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
        let mut rank = None;
        for name in file.tensors.keys() {
            let (module, which) = match name.rsplit_once('.') {
                Some((m, w @ ("lora_a" | "lora_b"))) => (m.to_string(), w),
                _ => {
                    return Err(EngineError::Adapter {
                        path: st_path.clone(),
                        why: format!("unexpected tensor `{name}`: expected only `<module>.lora_a` / `<module>.lora_b`"),
                    })
                }
            };
            let t = file
                .get(name)
                .ok_or_else(|| err(format!("tensor `{name}` vanished")))?;
            if t.shape.len() != 2 {
                return Err(EngineError::BadTensor {
                    path: st_path.clone(),
                    name: name.clone(),
                    why: format!("expected a 2-D matrix, found shape {:?}", t.shape),
                });
            }
            let r = if which == "lora_a" {
                t.shape[1]
            } else {
                t.shape[0]
            };
            if *rank.get_or_insert(r) != r {
                return Err(EngineError::BadTensor {
                    path: st_path.clone(),
                    name: name.clone(),
                    why: format!(
                        "rank {r} differs from the adapter's other tensors ({})",
                        rank.unwrap_or(0)
                    ),
                });
            }
            if let Some(i) = t.to_f32_vec()?.iter().position(|v| !v.is_finite()) {
                return Err(EngineError::BadTensor {
                    path: st_path.clone(),
                    name: name.clone(),
                    why: format!("element {i} is NaN or infinite"),
                });
            }
            let e = pairs.entry(module).or_default();
            let tensor = t.to_candle_f32(device)?;
            if which == "lora_a" {
                e.0 = Some(tensor)
            } else {
                e.1 = Some(tensor)
            }
        }
        let rank = rank.ok_or_else(|| EngineError::Adapter {
            path: st_path.clone(),
            why: "holds no lora_a/lora_b tensors".into(),
        })?;
        if let Some(rc) = rank_cfg {
            if rc != rank {
                return Err(err(format!(
                    "lora_parameters.rank is {rc} but the tensors have rank {rank}"
                )));
            }
        }
        let mut branches = BTreeMap::new();
        for (module, (a, b)) in pairs {
            let (Some(a), Some(b)) = (a, b) else {
                return Err(EngineError::Adapter {
                    path: st_path.clone(),
                    why: format!("`{module}` has only one of lora_a / lora_b"),
                });
            };
            branches.insert(module, LoraBranch { a, b, scale });
        }
        Ok(Adapter {
            dir: dir.to_path_buf(),
            scale,
            rank,
            branches,
        })
    }

    /// Takes the branch of `module` after checking it against the projection's shape.
    pub fn take(
        &mut self,
        module: &str,
        in_features: usize,
        out_features: usize,
    ) -> Result<Option<LoraBranch>> {
        let Some(br) = self.branches.remove(module) else {
            return Ok(None);
        };
        let path = self.dir.join("adapters.safetensors");
        for (name, t, want) in [
            ("lora_a", &br.a, [in_features, self.rank]),
            ("lora_b", &br.b, [self.rank, out_features]),
        ] {
            if t.dims() != want {
                return Err(EngineError::BadTensor {
                    path: path.clone(),
                    name: format!("{module}.{name}"),
                    why: format!(
                        "does not fit the model: expected shape {want:?} for a {in_features} -> {out_features} projection, found {:?}",
                        t.dims()
                    ),
                });
            }
        }
        Ok(Some(br))
    }

    /// After the model took its branches: any left over name modules the model lacks.
    pub fn ensure_all_used(&self) -> Result<()> {
        if let Some(name) = self.branches.keys().next() {
            return Err(EngineError::Adapter {
                path: self.dir.join("adapters.safetensors"),
                why: format!(
                    "adapts `{name}`, which this model does not have ({} unused modules): the adapter was trained for another model",
                    self.branches.len()
                ),
            });
        }
        Ok(())
    }
}
