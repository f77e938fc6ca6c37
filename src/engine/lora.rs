//! Runtime LoRA from an mlx_lm adapter directory (`adapter_config.json` + `adapters.safetensors`,
//! as `mlx_lm lora --train` writes them). Follows `mlx_lm/tuner/lora.py` `LoRALinear`:
//! `y = base(x) + scale * ((x @ lora_a) @ lora_b)`, `lora_a` [in, r], `lora_b` [r, out], with
//! `scale = lora_parameters.scale` used as is (mlx_lm does not divide by the rank). The branch
//! runs in f32 beside the quantized base and is never merged into the 4-bit weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
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
    /// On the CPU, `a` [in, r] and `b` transposed, [out, r], row-major: the branch then runs
    /// as two short loops instead of two candle matmuls (whose set-up cost more than the
    /// rank-8 products). Transposed, a range of outputs reads one contiguous block of `b`
    /// (rank-wide rows) where [r, out] took r short runs, each a cold start for the hardware
    /// prefetcher (`--synthetic-lora` decode cost, in one run alternating per token, 0.6B on
    /// 2 threads: +8.1 / +8.8% -> +5.6 / +7.3%).
    host: Option<Arc<(Vec<f32>, Vec<f32>)>>,
}

/// Up to this many rows (decode, short chunks) the branch runs as host loops; a prompt's
/// rows go to candle's multi-threaded matmul.
pub(crate) const HOST_MAX_ROWS: usize = 4;

impl LoraBranch {
    /// `a` [in, r] and `b` [r, out], f32.
    pub fn new(a: Tensor, b: Tensor, scale: f64) -> Result<Self> {
        let host = if a.device().is_cpu() {
            let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
            Some(Arc::new((flat(&a)?, flat(&b.t()?)?)))
        } else {
            None
        };
        Ok(LoraBranch { a, b, scale, host })
    }

    /// `scale * ((x @ a) @ b)` for `x` (L, in).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok((x.matmul(&self.a)?.matmul(&self.b)? * self.scale)?)
    }

    /// `y += scale * ((x @ a) @ b)` on host slices (`x` rows `in` wide, `y` the same rows `out`
    /// wide), where the branch has its host copies and the rows are decode-sized; `false`
    /// (nothing done) otherwise. The decode path calls it on the matmul's own output, before
    /// that becomes a tensor: no copies in and out of tensors.
    pub fn add_rows(&self, x: &[f32], y: &mut [f32]) -> bool {
        let (Some(h), Ok(inp)) = (&self.host, self.a.dim(0)) else {
            return false;
        };
        if inp == 0 || !x.len().is_multiple_of(inp) || x.len() / inp > HOST_MAX_ROWS {
            return false;
        }
        add_host(&h.0, &h.1, self.scale as f32, x, inp, y);
        true
    }

    /// The host copies of `a` [in, r] and of `b` transposed, [out, r] (row-major), with the
    /// scale, where the branch has them (the CPU).
    pub fn host_parts(&self) -> Option<(&[f32], &[f32], f32)> {
        self.host
            .as_ref()
            .map(|h| (h.0.as_slice(), h.1.as_slice(), self.scale as f32))
    }

    /// `y + scale * ((x @ a) @ b)`: on the CPU by `add_rows`, else with candle ops.
    pub fn add_to(&self, x: &Tensor, y: Tensor) -> Result<Tensor> {
        if self.host.is_some()
            && x.dtype() == DType::F32
            && y.dtype() == DType::F32
            && x.dims2()?.0 <= HOST_MAX_ROWS
        {
            let xs = x.flatten_all()?.to_vec1::<f32>()?;
            let mut ys = y.flatten_all()?.to_vec1::<f32>()?;
            if self.add_rows(&xs, &mut ys) {
                return Ok(Tensor::from_vec(ys, y.shape(), y.device())?);
            }
        }
        Ok((y + self.forward(x)?)?)
    }
}

/// `y[i] += scale * Σ_j (Σ_k x[i][k] a[k][j]) b[j]` for every row i of `x` (`inp` wide);
/// `a` is [inp, r], `bt` is `b` transposed, [out, r], row-major.
pub fn add_host(a: &[f32], bt: &[f32], scale: f32, x: &[f32], inp: usize, y: &mut [f32]) {
    let r = a.len() / inp.max(1);
    let out = bt.len() / r.max(1);
    for (xi, yi) in x.chunks_exact(inp).zip(y.chunks_exact_mut(out)) {
        let c = project_a(a, scale, xi);
        add_b(bt, &c, 0, yi);
    }
}

/// `scale * (x @ a)` for one row `x` (`a` [x.len(), r]): the rank-r vector the second half
/// (`add_b`) spreads over the outputs.
pub fn project_a(a: &[f32], scale: f32, x: &[f32]) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if crate::engine::cpu::isa::active().avx2() {
        // SAFETY: the CPU has AVX2 and FMA (`isa` detected them).
        return unsafe { project_a_avx2(a, scale, x) };
    }
    project_a_body(a, scale, x)
}

/// `y[n - first] += Σ_j c[j] bt[n][j]` for the outputs `first..first + y.len()` (`bt` [out,
/// r]): one task's rows of a projection, each output as `add_host` computes it for the whole
/// row, so the result does not depend on how rows are split.
pub fn add_b(bt: &[f32], c: &[f32], first: usize, y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::engine::cpu::isa::active().avx2() {
        // SAFETY: as above.
        return unsafe { add_b_avx2(bt, c, first, y) };
    }
    add_b_body(bt, c, first, y)
}

/// The same loops compiled for AVX2 + FMA (the default build targets baseline x86-64).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn project_a_avx2(a: &[f32], scale: f32, x: &[f32]) -> Vec<f32> {
    project_a_body(a, scale, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn add_b_avx2(bt: &[f32], c: &[f32], first: usize, y: &mut [f32]) {
    add_b_body(bt, c, first, y)
}

/// Four partial sums over interleaved rows of `a`: one chain of rank-wide adds would wait on
/// each add's latency at every input (the whole `x @ a` of a decode step was a ~0.7M-cycle
/// chain on the 0.6B shape with 16 adapted layers).
#[inline(always)]
fn project_a_body(a: &[f32], scale: f32, x: &[f32]) -> Vec<f32> {
    const CHAINS: usize = 4;
    let r = a.len() / x.len().max(1);
    let mut t = [const { Vec::new() }; CHAINS];
    t.iter_mut().for_each(|v| v.resize(r, 0f32));
    let mut rows = x.iter().zip(a.chunks_exact(r.max(1)));
    loop {
        let mut any = false;
        for tc in t.iter_mut() {
            let Some((&xv, ar)) = rows.next() else { break };
            any = true;
            for (tj, &aj) in tc.iter_mut().zip(ar) {
                *tj += xv * aj;
            }
        }
        if !any {
            break;
        }
    }
    let [t0, t1, t2, t3] = t;
    t0.iter()
        .zip(&t1)
        .zip(t2.iter().zip(&t3))
        .map(|((a, b), (c, d))| ((a + b) + (c + d)) * scale)
        .collect()
}

/// Each output's rank-wide dot product, summed as a tree (rank 8, the common one, unrolled so
/// it vectorizes), then added to the output.
#[inline(always)]
fn add_b_body(bt: &[f32], c: &[f32], first: usize, y: &mut [f32]) {
    let r = c.len();
    if r == 8 {
        let c: [f32; 8] = std::array::from_fn(|j| c[j]);
        for (yv, row) in y.iter_mut().zip(bt[first * 8..].chunks_exact(8)) {
            let p: [f32; 8] = std::array::from_fn(|j| c[j] * row[j]);
            *yv += ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
        }
        return;
    }
    for (yv, row) in y.iter_mut().zip(bt[first * r..].chunks_exact(r.max(1))) {
        *yv += c.iter().zip(row).map(|(c, b)| c * b).sum::<f32>();
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
            branches.insert(module, LoraBranch::new(a, b, scale)?);
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The branch's second half over a row split into task-sized pieces gives the bits of
    /// the whole row, and the first half (four partial sums) matches a single-chain sum within
    /// f32 rounding; odd sizes and ranks.
    #[test]
    fn halves_split_like_whole_rows() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for (inp, r, out, piece) in [(67, 8, 50, 7), (1024, 8, 96, 32), (5, 3, 9, 4)] {
            let mut v = |n: usize| {
                (0..n)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect::<Vec<_>>()
            };
            let (a, bt, x, y0) = (v(inp * r), v(out * r), v(inp), v(out));
            let c = project_a(&a, 3.0, &x);
            let mut naive = vec![0f32; r];
            for (k, &xv) in x.iter().enumerate() {
                for j in 0..r {
                    naive[j] += xv * a[k * r + j];
                }
            }
            for (got, want) in c.iter().zip(&naive) {
                let bound = 1e-5 * (inp as f32).sqrt() * 3.0;
                assert!((got - want * 3.0).abs() <= bound, "{got} vs {}", want * 3.0);
            }
            let mut whole = y0.clone();
            add_b(&bt, &c, 0, &mut whole);
            let mut pieces = y0.clone();
            let mut first = 0;
            for chunk in pieces.chunks_mut(piece) {
                add_b(&bt, &c, first, chunk);
                first += chunk.len();
            }
            assert_eq!(whole, pieces, "inp {inp} r {r} out {out}");
            assert_ne!(whole, y0);
        }
    }

    /// The CPU loops against candle's `y + scale * ((x @ a) @ b)`: 1 and 5 rows, rank 8 and 3.
    #[test]
    fn host_loops_match_candle_ops() {
        let dev = Device::Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for (l, inp, r, out) in [(1, 64, 8, 48), (5, 96, 3, 40)] {
            let mut v = |n: usize| {
                (0..n)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect::<Vec<_>>()
            };
            let a = Tensor::from_vec(v(inp * r), (inp, r), &dev).unwrap();
            let b = Tensor::from_vec(v(r * out), (r, out), &dev).unwrap();
            let x = Tensor::from_vec(v(l * inp), (l, inp), &dev).unwrap();
            let y = Tensor::from_vec(v(l * out), (l, out), &dev).unwrap();
            let br = LoraBranch::new(a, b, 20.0).unwrap();
            assert!(br.host.is_some());
            let want = (&y + br.forward(&x).unwrap()).unwrap();
            let got = br.add_to(&x, y.clone()).unwrap();
            assert_eq!(got.dims(), want.dims());
            let d = (got - &want)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let delta = (&want - &y).unwrap().abs().unwrap().flatten_all().unwrap();
            let scale = delta.max(0).unwrap().to_scalar::<f32>().unwrap();
            assert!(scale > 1.0, "the branch added nothing");
            assert!(d <= 1e-5 * scale, "l {l} r {r}: {d} of {scale}");
        }
    }
}
