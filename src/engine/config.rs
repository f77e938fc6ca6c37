//! `config.json` of an mlx_lm Qwen3 directory: the model fields of `mlx_lm.models.qwen3.ModelArgs`
//! and the MLX `quantization` block, resolved per module the way `mlx_lm.utils.load_model` does
//! (an entry keyed by module path wins; otherwise bits and group size follow from the shapes).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::engine::error::{EngineError, Result};
use crate::engine::weights::WeightStore;

/// Bits and group size of one MLX affine-quantized matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantParams {
    pub bits: usize,
    pub group_size: usize,
}

impl QuantParams {
    pub const SUPPORTED_BITS: [usize; 6] = [2, 3, 4, 5, 6, 8];

    pub fn validate(&self) -> std::result::Result<(), String> {
        if !Self::SUPPORTED_BITS.contains(&self.bits) {
            return Err(format!(
                "bits must be one of 2, 3, 4, 5, 6, 8; found {}",
                self.bits
            ));
        }
        if ![32, 64, 128].contains(&self.group_size) {
            return Err(format!(
                "group_size must be 32, 64 or 128; found {}",
                self.group_size
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq)]
enum ModuleQuant {
    Off,
    On {
        params: Option<QuantParams>,
        mode: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct QuantConfig {
    pub default: QuantParams,
    pub mode: String,
    per_module: BTreeMap<String, ModuleQuant>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3Config {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Stop ids: `generation_config.json`'s `eos_token_id` when present, else config.json's.
    pub eos_token_ids: Vec<u32>,
    pub quantization: Option<QuantConfig>,
    pub path: PathBuf,
}

struct Fields<'a> {
    path: &'a Path,
    v: &'a Value,
}

impl Fields<'_> {
    fn err(&self, field: &str, why: impl Into<String>) -> EngineError {
        EngineError::Config {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            why: why.into(),
        }
    }
    fn usize(&self, field: &str) -> Result<usize> {
        match self.v.get(field) {
            Some(x) => x
                .as_u64()
                .filter(|&n| n > 0)
                .map(|n| n as usize)
                .ok_or_else(|| self.err(field, format!("expected a positive integer, found {x}"))),
            None => Err(self.err(field, "missing (required for Qwen3)")),
        }
    }
    fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.v.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.usize(field).map(Some),
        }
    }
    fn f64(&self, field: &str) -> Result<Option<f64>> {
        match self.v.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a number, found {x}"))),
        }
    }
}

/// `eos_token_id` as a number or a list; an id that is no u32 is kept as u64 so the
/// vocabulary check below can name it instead of it wrapping to another token.
fn eos_ids(v: Option<&Value>) -> Vec<u64> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).collect(),
        _ => Vec::new(),
    }
}

impl Qwen3Config {
    /// Reads `dir/config.json` and, when present, `dir/generation_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
        let gen_path = dir.join("generation_config.json");
        let gen = match std::fs::read_to_string(&gen_path) {
            Ok(t) => serde_json::from_str::<Value>(&t).ok(), // mlx_lm ignores a broken one too
            Err(_) => None,
        };
        Self::parse(&path, &text, gen.as_ref())
    }

    /// Pure parser: `path` is only used in messages.
    pub fn parse(path: &Path, text: &str, generation_config: Option<&Value>) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| EngineError::Config {
            path: path.to_path_buf(),
            field: "(whole file)".into(),
            why: format!("not valid JSON: {e}"),
        })?;
        let f = Fields { path, v: &v };
        if let Some(mt) = v.get("model_type").and_then(Value::as_str) {
            if mt != "qwen3" {
                return Err(f.err("model_type", format!("expected \"qwen3\", found \"{mt}\"")));
            }
        }
        let hidden_size = f.usize("hidden_size")?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let num_key_value_heads = f
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!("{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}"),
            ));
        }
        let head_dim = f
            .opt_usize("head_dim")?
            .unwrap_or(hidden_size / num_attention_heads);
        if head_dim % 2 != 0 {
            return Err(f.err(
                "head_dim",
                format!("RoPE needs an even head_dim, found {head_dim}"),
            ));
        }
        // transformers >= 5 nests rope_theta (and the scaling type) under rope_parameters.
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let rope_theta = match f.f64("rope_theta")? {
            Some(t) => t,
            None => rope_params
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
                .ok_or_else(|| f.err("rope_theta", "missing (also not under rope_parameters)"))?,
        };
        let scaling = v
            .get("rope_scaling")
            .filter(|s| s.is_object())
            .or(rope_params);
        if let Some(s) = scaling {
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            if kind != "default" {
                return Err(f.err(
                    "rope_scaling",
                    format!("RoPE scaling `{kind}` is not supported (only plain RoPE)"),
                ));
            }
        }
        let mut eos_token_ids = eos_ids(v.get("eos_token_id"));
        let gen_eos = eos_ids(generation_config.and_then(|g| g.get("eos_token_id")));
        if !gen_eos.is_empty() {
            eos_token_ids = gen_eos;
        }
        let quantization = match v.get("quantization") {
            None | Some(Value::Null) => None,
            Some(q) => Some(parse_quant(path, q)?),
        };
        let vocab_size = f.usize("vocab_size")?;
        if let Some(bad) = eos_token_ids.iter().find(|&&id| id >= vocab_size as u64) {
            return Err(f.err(
                "eos_token_id",
                format!("{bad} is not a token of the vocabulary (size {vocab_size})"),
            ));
        }
        let rms_norm_eps = f.f64("rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_norm_eps > 0.0 && rms_norm_eps < 1.0) {
            return Err(f.err(
                "rms_norm_eps",
                format!("expected a small positive number, found {rms_norm_eps}"),
            ));
        }
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(f.err(
                "rope_theta",
                format!("expected a finite base above 1, found {rope_theta}"),
            ));
        }
        for (field, v) in [
            ("hidden_size", hidden_size),
            ("num_attention_heads", num_attention_heads),
            ("num_key_value_heads", num_key_value_heads),
            ("head_dim", head_dim),
            ("vocab_size", vocab_size),
        ] {
            if v == 0 || v > 1 << 24 {
                return Err(f.err(field, format!("expected 1 to 2^24, found {v}")));
            }
        }
        Ok(Qwen3Config {
            hidden_size,
            intermediate_size: f.usize("intermediate_size")?,
            num_hidden_layers: f.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            vocab_size,
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(40960),
            eos_token_ids: eos_token_ids.into_iter().map(|id| id as u32).collect(),
            quantization,
            path: path.to_path_buf(),
        })
    }

    /// Whether and how `module` (e.g. `model.layers.3.mlp.down_proj`) is quantized, following
    /// `mlx_lm.utils.load_model`: an entry in the quantization block keyed by the module path
    /// wins; otherwise a module is quantized iff `<module>.scales` exists, with bits and group
    /// size recovered from the shapes (`infer_quant_config`). `in_features` is the unpacked width.
    pub fn quant_for(
        &self,
        store: &WeightStore,
        module: &str,
        in_features: usize,
    ) -> Result<Option<QuantParams>> {
        let q = self.quantization.as_ref();
        let bad = |why: String| EngineError::BadTensor {
            path: store.dir.clone(),
            name: module.to_string(),
            why,
        };
        let check_mode = |mode: &str| -> Result<()> {
            if mode != "affine" {
                return Err(EngineError::UnsupportedQuantMode {
                    mode: mode.to_string(),
                    path: self.path.clone(),
                    module: module.to_string(),
                });
            }
            Ok(())
        };
        let scales_name = format!("{module}.scales");
        let params = match q.and_then(|q| q.per_module.get(module)) {
            Some(ModuleQuant::Off) => None,
            Some(ModuleQuant::On { params, mode }) => {
                check_mode(mode)?;
                Some(
                    params
                        .or(q.map(|q| q.default))
                        .ok_or_else(|| bad("quantized without bits/group_size".into()))?,
                )
            }
            None => {
                let Some(scales) = store.get(&scales_name) else {
                    return Ok(None);
                };
                if let Some(q) = q {
                    check_mode(&q.mode)?;
                }
                if !scales.dtype.is_float() {
                    // mxfp4/nvfp4/mxfp8 store U8 exponent scales
                    return Err(EngineError::UnsupportedQuantMode {
                        mode: format!("(inferred from {} scales)", scales.dtype),
                        path: self.path.clone(),
                        module: module.to_string(),
                    });
                }
                let w = store.require(&format!("{module}.weight"))?;
                let (ng, wc) = (
                    scales.shape.last().copied().unwrap_or(0),
                    w.shape.last().copied().unwrap_or(0),
                );
                if ng == 0 || !in_features.is_multiple_of(ng) || (wc * 32) % in_features != 0 {
                    return Err(bad(format!(
                        "cannot infer quantization: input width {in_features}, {ng} scale groups per row, {wc} packed words per row"
                    )));
                }
                Some(QuantParams {
                    bits: wc * 32 / in_features,
                    group_size: in_features / ng,
                })
            }
        };
        if let Some(p) = params {
            p.validate().map_err(bad)?;
            if store.get(&scales_name).is_none() {
                return Err(EngineError::MissingTensor {
                    dir: store.dir.clone(),
                    name: scales_name,
                    hint: format!("config.json says `{module}` is quantized"),
                });
            }
        }
        Ok(params)
    }
}

fn parse_quant(path: &Path, q: &Value) -> Result<QuantConfig> {
    let err = |field: &str, why: String| EngineError::Config {
        path: path.to_path_buf(),
        field: field.to_string(),
        why,
    };
    let obj = q
        .as_object()
        .ok_or_else(|| err("quantization", format!("expected an object, found {q}")))?;
    let num = |o: &serde_json::Map<String, Value>, k: &str, field: &str| -> Result<Option<usize>> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| err(field, format!("expected an integer, found {x}"))),
        }
    };
    let mode = obj
        .get("mode")
        .and_then(Value::as_str)
        .unwrap_or("affine")
        .to_string();
    let default = QuantParams {
        bits: num(obj, "bits", "quantization.bits")?.unwrap_or(4),
        group_size: num(obj, "group_size", "quantization.group_size")?.unwrap_or(64),
    };
    let mut per_module = BTreeMap::new();
    for (k, v) in obj {
        let entry = match v {
            Value::Bool(false) => ModuleQuant::Off,
            Value::Bool(true) => ModuleQuant::On {
                params: None,
                mode: mode.clone(),
            },
            Value::Object(o) => {
                let field = format!("quantization.{k}");
                let bits = num(o, "bits", &field)?;
                let gs = num(o, "group_size", &field)?;
                ModuleQuant::On {
                    params: Some(QuantParams {
                        bits: bits.unwrap_or(default.bits),
                        group_size: gs.unwrap_or(default.group_size),
                    }),
                    mode: o
                        .get("mode")
                        .and_then(Value::as_str)
                        .unwrap_or(&mode)
                        .to_string(),
                }
            }
            _ => continue, // group_size, bits, mode themselves
        };
        per_module.insert(k.clone(), entry);
    }
    Ok(QuantConfig {
        default,
        mode,
        per_module,
    })
}

#[cfg(test)]
mod tests {
    /// #18.12: an EOS id past u32 wrapped to token 0; impossible eps and theta made NaN.
    #[test]
    fn eos_eps_and_theta_are_checked() {
        let base = BASE.replace("\"eos_token_id\":5", "\"rope_theta\":10000.0");
        for (extra, field) in [
            (",\"eos_token_id\":1099511627776", "eos_token_id"),
            (",\"eos_token_id\":[5,512]", "eos_token_id"),
            (",\"rms_norm_eps\":-1", "rms_norm_eps"),
        ] {
            let t = format!("{base}{extra}}}");
            let e = Qwen3Config::parse(Path::new("c.json"), &t, None).unwrap_err();
            assert!(e.to_string().contains(field), "{extra}: {e}");
        }
        let t = format!(
            "{}}}",
            BASE.replace("\"eos_token_id\":5", "\"rope_theta\":0")
        );
        let e = Qwen3Config::parse(Path::new("c.json"), &t, None).unwrap_err();
        assert!(e.to_string().contains("rope_theta"), "{e}");
    }

    use super::*;

    const BASE: &str = r#"{"model_type":"qwen3","hidden_size":128,"intermediate_size":256,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
        "rms_norm_eps":1e-6,"vocab_size":512,"tie_word_embeddings":false,"eos_token_id":5"#;

    #[test]
    fn rope_theta_nested_and_eos_override() {
        let t = format!(
            "{BASE}, \"rope_parameters\": {{\"rope_theta\": 5000.0, \"rope_type\": \"default\"}}}}"
        );
        let gen: Value = serde_json::from_str(r#"{"eos_token_id":[7,8]}"#).unwrap();
        let c = Qwen3Config::parse(Path::new("config.json"), &t, Some(&gen)).unwrap();
        assert_eq!(c.rope_theta, 5000.0);
        assert_eq!(c.eos_token_ids, vec![7, 8]);
        let c = Qwen3Config::parse(Path::new("config.json"), &t, None).unwrap();
        assert_eq!(c.eos_token_ids, vec![5]);
    }

    #[test]
    fn missing_fields_are_named() {
        let e = Qwen3Config::parse(
            Path::new("x/config.json"),
            r#"{"model_type":"qwen3"}"#,
            None,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("x/config.json: field `hidden_size`"),
            "{e}"
        );
        let t = format!("{BASE}}}");
        let e = Qwen3Config::parse(Path::new("c.json"), &t, None).unwrap_err();
        assert!(e.to_string().contains("rope_theta"), "{e}");
    }

    #[test]
    fn per_module_quant_entries() {
        let t = format!(
            "{BASE}, \"rope_theta\": 1e6, \"quantization\": {{\"group_size\": 64, \"bits\": 4, \
             \"model.layers.0.mlp.down_proj\": {{\"group_size\": 32, \"bits\": 6}}, \"lm_head\": false}}}}"
        );
        let c = Qwen3Config::parse(Path::new("c.json"), &t, None).unwrap();
        let q = c.quantization.unwrap();
        assert_eq!(
            q.default,
            QuantParams {
                bits: 4,
                group_size: 64
            }
        );
        assert_eq!(
            q.per_module["model.layers.0.mlp.down_proj"],
            ModuleQuant::On {
                params: Some(QuantParams {
                    bits: 6,
                    group_size: 32
                }),
                mode: "affine".into()
            }
        );
        assert_eq!(q.per_module["lm_head"], ModuleQuant::Off);
    }
}
