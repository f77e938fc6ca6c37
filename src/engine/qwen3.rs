//! Qwen3 decoder, read top-down like candle-transformers' `qwen3.rs`, with the numerics of
//! `mlx_lm/models/qwen3.py`: RMSNorm with a plain weight; per-head `q_norm`/`k_norm` *before*
//! RoPE; half-split (non-traditional) RoPE with the config theta at absolute positions
//! `offset..offset+L`; grouped-query attention scaled by `head_dim^-0.5`; SwiGLU; a KV cache;
//! tied or untied (possibly quantized) head. Batch size is 1; compute is f32 on the CPU.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::kv_cache::KvCache;

use crate::engine::config::Qwen3Config;
use crate::engine::cpu;
use crate::engine::cpu::attention::{self, Dims, HostKv};
use crate::engine::cpu::sample::CpuSampler;
use crate::engine::cpu::team::{self, Ahead};
use crate::engine::cpu::tile16;
use crate::engine::error::{EngineError, Result};
use crate::engine::fused::Fused;
use crate::engine::layers::{
    rope_angles, Embedding, LayerView, Linear, ModelOptions, ModelView, Weight,
};
#[allow(unused_imports)]
use crate::engine::layers::{CudaStep, QMatmulRoute};
use crate::engine::lora::Adapter;
use crate::engine::profile::{self, Part};
use crate::engine::sample::op::{split_output, SampleOp};
use crate::engine::sample::{decode_kernel_output, SampleState, SampleStep, Sampled};
use crate::engine::weights::WeightStore;

/// Prompts longer than this run in chunks of this many tokens (bounded memory for any length).
const PREFILL_CHUNK: usize = 512;

fn rms_norm_weight(store: &WeightStore, name: &str, dim: usize, dev: &Device) -> Result<Tensor> {
    let t = store.require(name)?;
    t.expect_shape(&[dim])?;
    if let Some(i) = t.to_f32_vec()?.iter().position(|v| !v.is_finite()) {
        return Err(EngineError::BadTensor {
            path: store.dir.clone(),
            name: name.into(),
            why: format!("element {i} is NaN or infinite"),
        });
    }
    t.to_candle_f32(dev)
}

/// RMSNorm of hidden rows: on the CPU over host slices (`cpu::norm`), elsewhere candle's op.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && w.dtype() == DType::F32 {
        return Ok(x
            .contiguous()?
            .apply_op2_no_bwd(w, &cpu::norm::RmsNorm { eps })?);
    }
    Ok(candle_nn::ops::rms_norm(x, w, eps)?)
}

/// A checkpoint with more layers than its config names is not the model the config
/// describes (a truncated config, or weights of another model): refused, not half-used.
fn check_layer_count(cfg: &Qwen3Config, store: &WeightStore) -> Result<()> {
    for name in store.names() {
        let Some(rest) = name.strip_prefix("model.layers.") else {
            continue;
        };
        let n: Option<usize> = rest.split('.').next().and_then(|n| n.parse().ok());
        if let Some(n) = n.filter(|&n| n >= cfg.num_hidden_layers) {
            return Err(EngineError::Config {
                path: cfg.path.clone(),
                field: "num_hidden_layers".into(),
                why: format!(
                    "is {}, but the weights hold layer {n} (`{name}`): the config and the weights disagree",
                    cfg.num_hidden_layers
                ),
            });
        }
    }
    Ok(())
}

/// cos/sin of the half-split RoPE for the positions of one forward pass, (L, head_dim/2), as
/// tensors for the candle-op attention and as host slices for `cpu::attention`.
struct Rope {
    cos: Tensor,
    sin: Tensor,
    cos_host: Vec<f32>,
    sin_host: Vec<f32>,
}

/// The tables for positions `offset..offset+len`, built once per forward for all layers.
fn rope_tables(cfg: &Qwen3Config, offset: usize, len: usize, dev: &Device) -> Result<Rope> {
    let half = cfg.head_dim / 2;
    let (cos, sin) = rope_angles(cfg.rope_theta, cfg.head_dim, offset..offset + len);
    Ok(Rope {
        cos: Tensor::from_vec(cos.clone(), (len, half), dev)?,
        sin: Tensor::from_vec(sin.clone(), (len, half), dev)?,
        cos_host: cos,
        sin_host: sin,
    })
}

/// A CPU pass's vectors, `rows` positions of each, row-major (`Qwen3::forward_host`): kept
/// from layer to layer (and, for decode steps, token to token): no allocation, and no tensor,
/// between the pass's regions.
#[derive(Default)]
struct HostStep {
    /// positions in the pass
    rows: usize,
    /// (H) the residual stream; after the last layer only the last row is whole (its MLP
    /// output is added to that row alone, for the head: `Qwen3::forward_host`)
    x: Vec<f32>,
    /// (H) a norm's output, the input of q|k|v and gate|up
    h: Vec<f32>,
    /// (Hq*D), (Hkv*D), (Hkv*D): q|k|v's outputs
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// (Hq*D) attention's output, `o_proj`'s input
    att: Vec<f32>,
    /// (H) `o_proj`'s and `down_proj`'s output
    o: Vec<f32>,
    /// (I) gate|up's outputs and `silu(gate) · up`
    g: Vec<f32>,
    u: Vec<f32>,
    a: Vec<f32>,
    /// (V) the head's output
    logits: Vec<f32>,
    /// the integer kernels' activations (`quant::IntActs::fill`)
    acts: cpu::quant::IntActs,
}

impl HostStep {
    /// Every vector for `rows` positions (the logits for one: the last).
    fn size_for(&mut self, cfg: &Qwen3Config, rows: usize) {
        let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        self.rows = rows;
        for (v, n) in [
            (&mut self.h, h),
            (&mut self.q, q),
            (&mut self.k, kv),
            (&mut self.v, kv),
            (&mut self.att, q),
            (&mut self.o, h),
            (&mut self.g, i),
            (&mut self.u, i),
            (&mut self.a, i),
        ] {
            v.resize(n * rows, 0.0);
        }
        self.logits.resize(cfg.vocab_size, 0.0);
    }
}

pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Tensor,
    k_norm: Tensor,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    eps: f32,
    kv: KvCache,
    host_kv: HostKv,
    /// Use the candle-op path on the CPU too (tests compare the two).
    pub reference_path: bool,
    q_norm_host: Vec<f32>,
    k_norm_host: Vec<f32>,
}

impl Attention {
    fn new(
        cfg: &Qwen3Config,
        store: &WeightStore,
        p: &str,
        ad: &mut Option<Adapter>,
        o: &ModelOptions,
    ) -> Result<Self> {
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        Ok(Attention {
            q_proj: Linear::new(store, cfg, &format!("{p}.q_proj"), nh * hd, h, ad, o)?,
            k_proj: Linear::new(store, cfg, &format!("{p}.k_proj"), nkv * hd, h, ad, o)?,
            v_proj: Linear::new(store, cfg, &format!("{p}.v_proj"), nkv * hd, h, ad, o)?,
            o_proj: Linear::new(store, cfg, &format!("{p}.o_proj"), h, nh * hd, ad, o)?,
            q_norm: rms_norm_weight(store, &format!("{p}.q_norm.weight"), hd, &o.device)?,
            k_norm: rms_norm_weight(store, &format!("{p}.k_norm.weight"), hd, &o.device)?,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            eps: cfg.rms_norm_eps as f32,
            kv: KvCache::new(1, 256),
            // `fast`/`int8` keep the CPU cache in f16: half the bytes a decode step streams
            host_kv: HostKv::new(o.kernel != crate::engine::quant::Numerics::Exact),
            reference_path: false,
            q_norm_host: store.require(&format!("{p}.q_norm.weight"))?.to_f32_vec()?,
            k_norm_host: store.require(&format!("{p}.k_norm.weight"))?.to_f32_vec()?,
        })
    }

    /// x: (L, H); rope: (L, D/2) tables; mask: (L, T) additive or None for L == 1; `next`:
    /// what the region after `o_proj` reads first.
    fn forward(
        &mut self,
        x: &Tensor,
        rope: &Rope,
        mask: Option<&Tensor>,
        next: Ahead,
    ) -> Result<Tensor> {
        let l = x.dim(0)?;
        let (nh, nkv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let qkv = [&self.q_proj, &self.k_proj, &self.v_proj];
        if x.device().is_cpu() && !self.reference_path {
            // q|k|v's outputs as host vectors (the shared kernels' own, else copied out of
            // their tensors), which the attention core normalizes and rotates in place
            let [mut q, mut k, v] = match Linear::shared_host(&qkv, x)? {
                Some(qkv) => qkv,
                None => {
                    let flat = |t: Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
                    let [q, k, v] = Linear::forward_each(qkv, x)?;
                    // the copies are the attention core's cost here, as they always were
                    let t = Instant::now();
                    let host = [flat(q)?, flat(k)?, flat(v)?];
                    profile::add(Part::Attention, t);
                    host
                }
            };
            let t0 = Instant::now();
            let dims = Dims {
                n_heads: nh,
                n_kv: nkv,
                head_dim: hd,
                eps: self.eps,
            };
            let mut out = vec![0f32; l * nh * hd];
            attention::attend_into(
                &dims,
                &mut q,
                &mut k,
                &v,
                &self.q_norm_host,
                &self.k_norm_host,
                &rope.cos_host,
                &rope.sin_host,
                &mut self.host_kv,
                &mut out,
            );
            let out = Tensor::from_vec(out, (l, nh * hd), x.device())?; // (L, Hq*D)
            profile::add(Part::Attention, t0);
            team::read_ahead(next);
            return self.o_proj.forward(&out);
        }
        let [q, k, v] = Linear::forward_shared(qkv, x)?;
        let q = q.reshape((l, nh, hd))?; // (L, Hq, D)
        let k = k.reshape((l, nkv, hd))?; // (L, Hkv, D)
        let v = v.reshape((l, nkv, hd))?;
        let t0 = Instant::now();
        // q/k norms act on each head before RoPE, as in mlx_lm
        let q = candle_nn::ops::rms_norm(&q, &self.q_norm, self.eps)?;
        let k = candle_nn::ops::rms_norm(&k, &self.k_norm, self.eps)?;
        let q = q.transpose(0, 1)?.contiguous()?.unsqueeze(0)?; // (1, Hq, L, D)
        let k = k.transpose(0, 1)?.contiguous()?.unsqueeze(0)?; // (1, Hkv, L, D)
        let q = candle_nn::rotary_emb::rope(&q, &rope.cos, &rope.sin)?.squeeze(0)?; // (Hq, L, D)
        let k = candle_nn::rotary_emb::rope(&k, &rope.cos, &rope.sin)?.squeeze(0)?; // (Hkv, L, D)
        let v = v.transpose(0, 1)?.contiguous()?; // (Hkv, L, D)
        let (k, v) = self.kv.append(&k, &v)?; // (Hkv, T, D)
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let t = k.dim(1)?;
        let rep = nh / nkv;
        // Query heads sharing a KV head are stacked along the row axis: no KV copies.
        let q = q.reshape((nkv, rep * l, hd))?; // (Hkv, rep*L, D)
        let scores = (q.matmul(&k.t()?)? * (hd as f64).powf(-0.5))?; // (Hkv, rep*L, T)
        let scores = match mask {
            Some(m) => scores
                .reshape((nkv, rep, l, t))?
                .broadcast_add(m)?
                .reshape((nkv, rep * l, t))?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs.matmul(&v)?; // (Hkv, rep*L, D)
        let out = out
            .reshape((nh, l, hd))?
            .transpose(0, 1)?
            .reshape((l, nh * hd))?; // (L, Hq*D)
        profile::add(Part::Attention, t0);
        team::read_ahead(next);
        self.o_proj.forward(&out)
    }

    /// `forward` on the host pass's vectors: `s.h` in, `s.o` out; `cos`, `sin`: (L, D/2) for
    /// the pass's positions.
    fn forward_host(
        &mut self,
        s: &mut HostStep,
        cos: &[f32],
        sin: &[f32],
        next: Ahead,
    ) -> Result<()> {
        let HostStep {
            rows,
            h,
            q,
            k,
            v,
            att,
            o,
            acts,
            ..
        } = s;
        let qkv = [&self.q_proj, &self.k_proj, &self.v_proj];
        Linear::forward_host(qkv, h, *rows, acts, [q, k, v])?;
        let t0 = Instant::now();
        let dims = Dims {
            n_heads: self.n_heads,
            n_kv: self.n_kv_heads,
            head_dim: self.head_dim,
            eps: self.eps,
        };
        let (qn, kn) = (&self.q_norm_host, &self.k_norm_host);
        attention::attend_into(&dims, q, k, v, qn, kn, cos, sin, &mut self.host_kv, att);
        profile::add(Part::Attention, t0);
        team::read_ahead(next);
        Linear::forward_host([&self.o_proj], att, *rows, acts, [o])
    }
}

pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(
        cfg: &Qwen3Config,
        store: &WeightStore,
        p: &str,
        ad: &mut Option<Adapter>,
        o: &ModelOptions,
    ) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Mlp {
            gate_proj: Linear::new(store, cfg, &format!("{p}.gate_proj"), i, h, ad, o)?,
            up_proj: Linear::new(store, cfg, &format!("{p}.up_proj"), i, h, ad, o)?,
            down_proj: Linear::new(store, cfg, &format!("{p}.down_proj"), h, i, ad, o)?,
        })
    }

    /// `next`: what the region after `down_proj` reads first.
    fn forward(&self, x: &Tensor, next: Ahead) -> Result<Tensor> {
        team::read_ahead(Linear::lead_in(&[&self.down_proj]));
        let [g, u] = Linear::forward_shared([&self.gate_proj, &self.up_proj], x)?;
        let host = g.device().is_cpu() && g.dtype() == DType::F32;
        let a = if host && g.is_contiguous() && u.is_contiguous() {
            g.apply_op2_no_bwd(&u, &cpu::act::SiluMul)?
        } else {
            (candle_nn::ops::silu(&g)? * u)?
        };
        team::read_ahead(next);
        self.down_proj.forward(&a)
    }

    /// `forward` on the host pass's vectors: `s.h` in, `s.o` out.
    fn forward_host(&self, s: &mut HostStep, next: Ahead) -> Result<()> {
        team::read_ahead(Linear::lead_in(&[&self.down_proj]));
        let HostStep {
            rows,
            h,
            g,
            u,
            a,
            o,
            acts,
            ..
        } = s;
        Linear::forward_host([&self.gate_proj, &self.up_proj], h, *rows, acts, [g, u])?;
        cpu::act::silu_mul(g, u, a);
        team::read_ahead(next);
        Linear::forward_host([&self.down_proj], a, *rows, acts, [o])
    }
}

pub struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    /// the two norms' weights again as host vectors, for `forward_host`
    input_layernorm_host: Vec<f32>,
    post_attention_layernorm_host: Vec<f32>,
    eps: f32,
}

impl DecoderLayer {
    fn new(
        cfg: &Qwen3Config,
        store: &WeightStore,
        i: usize,
        ad: &mut Option<Adapter>,
        o: &ModelOptions,
    ) -> Result<Self> {
        let p = format!("model.layers.{i}");
        let host = |name: &str| store.require(&format!("{p}.{name}.weight"))?.to_f32_vec();
        Ok(DecoderLayer {
            input_layernorm_host: host("input_layernorm")?,
            post_attention_layernorm_host: host("post_attention_layernorm")?,
            self_attn: Attention::new(cfg, store, &format!("{p}.self_attn"), ad, o)?,
            mlp: Mlp::new(cfg, store, &format!("{p}.mlp"), ad, o)?,
            input_layernorm: rms_norm_weight(
                store,
                &format!("{p}.input_layernorm.weight"),
                cfg.hidden_size,
                &o.device,
            )?,
            post_attention_layernorm: rms_norm_weight(
                store,
                &format!("{p}.post_attention_layernorm.weight"),
                cfg.hidden_size,
                &o.device,
            )?,
            eps: cfg.rms_norm_eps as f32,
        })
    }

    /// What this layer's decode step reads first (its q|k|v region), for the layer before.
    fn lead_in(&self) -> Ahead {
        let a = &self.self_attn;
        Linear::lead_in(&[&a.q_proj, &a.k_proj, &a.v_proj])
    }

    /// `next`: what the step reads after this layer (the next layer's q|k|v, or the head).
    /// The team's helper reads each region's start ahead once it has no task left in the one
    /// before (`cpu::team`): `o_proj`'s from q|k|v on, gate|up's from `o_proj`'s, and so on.
    fn forward(
        &mut self,
        x: &Tensor,
        rope: &Rope,
        mask: Option<&Tensor>,
        next: Ahead,
    ) -> Result<Tensor> {
        let h = rms_norm(x, &self.input_layernorm, self.eps)?;
        team::read_ahead(Linear::lead_in(&[&self.self_attn.o_proj]));
        let gate_up = Linear::lead_in(&[&self.mlp.gate_proj, &self.mlp.up_proj]);
        let h = (x + self.self_attn.forward(&h, rope, mask, gate_up)?)?;
        let m = rms_norm(&h, &self.post_attention_layernorm, self.eps)?;
        Ok((h + self.mlp.forward(&m, next)?)?)
    }

    /// `forward` on the host pass's vectors: the residual stream `s.x` is updated in place,
    /// but for this layer's MLP output, which is left in `s.o`: the next layer's first norm
    /// adds it in the same region (`pending` there), or the final norm does.
    fn forward_host(
        &mut self,
        s: &mut HostStep,
        cos: &[f32],
        sin: &[f32],
        next: Ahead,
        pending: bool,
    ) -> Result<()> {
        let (w, eps) = (&self.input_layernorm_host, self.eps);
        match pending {
            true => cpu::norm::add_rms_norm_rows(&mut s.x, &s.o, w, eps, &mut s.h),
            false => cpu::norm::rms_norm_rows(&s.x, w, eps, &mut s.h),
        }
        team::read_ahead(Linear::lead_in(&[&self.self_attn.o_proj]));
        let gate_up = Linear::lead_in(&[&self.mlp.gate_proj, &self.mlp.up_proj]);
        self.self_attn.forward_host(s, cos, sin, gate_up)?;
        let w = &self.post_attention_layernorm_host;
        cpu::norm::add_rms_norm_rows(&mut s.x, &s.o, w, eps, &mut s.h);
        self.mlp.forward_host(s, next)
    }
}

/// What a forward pass returns.
pub struct ForwardOutput {
    /// (L, vocab) for every position, or (1, vocab) for the last one only.
    pub logits: Tensor,
    /// When asked for: the embedding output, each layer's output, then the final norm's output.
    pub hidden: Vec<Tensor>,
}

/// The model lent to a rayon worker for one CPU forward pass.
struct OnWorker<'a>(&'a mut Qwen3);
// SAFETY: `forward` blocks in `rayon::scope` until the closure holding this returns, so the model
// is used by one thread at a time, and only on the CPU device: the GPU handles that make
// `Qwen3` !Send with the `cuda` feature (a CUDA graph in `fused`) are never touched there.
unsafe impl Send for OnWorker<'_> {}

pub struct Qwen3 {
    pub cfg: Qwen3Config,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    /// `norm`'s weight as a host vector, for `decode_host`
    norm_host: Vec<f32>,
    lm_head: Linear,
    /// The ids whose keys and values the cache holds, in order.
    cached: Vec<u32>,
    sampler: CpuSampler,
    /// What the user should hear about how this model runs (fallbacks), for the commands to say.
    notes: Vec<String>,
    device: Device,
    /// The GPU's fused step, when it runs this model (else candle ops).
    fused: Option<Fused>,
    /// The LoRA branches taken out by `suspend_lora`, in `linears_mut` order.
    suspended: Vec<Option<crate::engine::lora::LoraBranch>>,
    /// The CPU decode step's vectors (`decode_host`).
    host: HostStep,
    /// Decode and prompts on the CPU through tensors (tests compare the two paths).
    tensor_path: bool,
}

impl Qwen3 {
    pub fn new(
        cfg: Qwen3Config,
        store: &WeightStore,
        adapter: Option<Adapter>,
        opts: &ModelOptions,
    ) -> Result<Self> {
        let mut adapter = adapter;
        let notes = Vec::new();
        check_layer_count(&cfg, store)?;
        let h = cfg.hidden_size;
        let embed = Weight::load(
            store,
            &cfg,
            "model.embed_tokens",
            cfg.vocab_size,
            h,
            &opts.device,
        )?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(&cfg, store, i, &mut adapter, opts))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear {
                weight: embed.clone().routed(opts)?,
                lora: None,
                kernel: opts.kernel,
                part: Part::Head,
            }
        } else {
            Linear {
                part: Part::Head,
                ..Linear::new(store, &cfg, "lm_head", cfg.vocab_size, h, &mut None, opts)?
            }
        };
        if let Some(a) = &adapter {
            a.ensure_all_used()?;
        }
        #[allow(unused_mut)]
        let mut model = Qwen3 {
            norm: rms_norm_weight(store, "model.norm.weight", h, &opts.device)?,
            norm_host: store.require("model.norm.weight")?.to_f32_vec()?,
            embed_tokens: Embedding {
                weight: embed,
                on_host: false,
            },
            layers,
            lm_head,
            cached: Vec::new(),
            sampler: CpuSampler::new(),
            notes,
            device: opts.device.clone(),
            cfg,
            fused: None,
            suspended: Vec::new(),
            host: HostStep::default(),
            tensor_path: false,
        };
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(dev), true) = (&opts.device, opts.cuda_step != CudaStep::Ops) {
            use crate::engine::cuda::fused::{unsupported, FusedQwen3};
            match unsupported(&model.view()) {
                None => {
                    let f = FusedQwen3::new(&model.view(), dev, opts.kernel, opts.cuda_step)?;
                    model.fused = Some(Fused::Cuda(Box::new(f)));
                }
                Some(why) => model.notes.push(format!(
                    "CUDA: {why}; running candle ops instead of the fused step"
                )),
            }
        }
        #[cfg(bot_metal)]
        if let Device::Metal(dev) = &opts.device {
            if model.verify_metal_kernels(dev)? && opts.cuda_step != CudaStep::Ops {
                model.adopt_metal_step(dev)?;
            }
        }
        // the exact kernel (`eval`'s and `debug`'s default) never reads the copy
        if opts.device.is_cpu()
            && opts.kernel != crate::engine::Numerics::Exact
            && tile16::wanted(crate::engine::cpu::isa::active())
        {
            model.copy_tiles(store);
        }
        if opts.route == QMatmulRoute::Repack {
            let total = model.projections().count() + 1;
            let kept = total - model.repacked_projections();
            if kept > 0 {
                model.notes.push(format!(
                    "--qmatmul repack: {kept} of {total} matrices keep the native kernels \
                     (not 4-bit, or values Q4_1 cannot hold exactly)"
                ));
            }
        }
        Ok(model)
    }

    /// Each 4-bit projection's and the head's copy for the CPU decode kernel
    /// (`cpu::tile16`: mapped from its cache, or made now and kept there).
    fn copy_tiles(&mut self, store: &WeightStore) {
        let files = store.file_stamps();
        let notes = tile16::prepare(&self.decode_matrices(), files.as_deref(), &store.dir);
        self.notes.extend(notes);
    }

    /// The quantized matrices a decode step reads: the projections and the head.
    fn decode_matrices(&self) -> Vec<&crate::engine::QMatrix> {
        let head = std::iter::once(&self.lm_head.weight);
        self.projections()
            .chain(head)
            .filter_map(|w| match w {
                Weight::Quant(q) => Some(&**q),
                _ => None,
            })
            .collect()
    }

    /// How the CPU decode's copies of the weights are held (`cpu::tile16`), where it made
    /// them; `None` otherwise.
    pub fn describe_cpu_copy(&self) -> Option<String> {
        tile16::describe_memory(&self.decode_matrices())
    }

    /// Notes gathered since the last call (a fallback at load or during a run), for the caller
    /// to show; the engine prints nothing itself.
    pub fn take_notes(&mut self) -> Vec<String> {
        if let Some(f) = &mut self.fused {
            self.notes.append(&mut f.take_notes());
        }
        std::mem::take(&mut self.notes)
    }

    /// Whether forwards run a GPU's fused step rather than candle ops.
    pub fn uses_fused_step(&self) -> bool {
        self.fused.is_some()
    }

    /// Times every kernel of the fused CUDA step with events from now on (or stops); forwards
    /// then launch eagerly. No effect elsewhere.
    pub fn profile_kernels(&mut self, on: bool) {
        if let Some(f) = &mut self.fused {
            f.set_profiling(on);
        }
    }

    /// GPU time per kernel class since `profile_kernels(true)` (empty off the fused step).
    pub fn kernel_times(&mut self) -> Result<Vec<profile::KernelTime>> {
        if let Some(f) = &mut self.fused {
            return f.kernel_times();
        }
        Ok(Vec::new())
    }

    /// Per layer: q, k, v, o, gate, up, down.
    fn layer_linears(&self) -> impl Iterator<Item = [&Linear; 7]> + '_ {
        self.layers.iter().map(|l| {
            let (a, m) = (&l.self_attn, &l.mlp);
            [
                &a.q_proj,
                &a.k_proj,
                &a.v_proj,
                &a.o_proj,
                &m.gate_proj,
                &m.up_proj,
                &m.down_proj,
            ]
        })
    }

    /// Takes the LoRA branches out of the projections (`true`) or puts them back (`false`),
    /// between steps, for `bot bench` to time an adapter's cost within one run. The fused
    /// GPU step keeps its own copies: there this changes nothing.
    pub fn suspend_lora(&mut self, off: bool) {
        if off && self.suspended.is_empty() {
            self.suspended = self.linears_mut().map(|l| l.lora.take()).collect();
        } else if !off && !self.suspended.is_empty() {
            let branches = std::mem::take(&mut self.suspended);
            for (l, b) in self.linears_mut().zip(branches) {
                l.lora = b;
            }
        }
    }

    /// Every projection and the head, to change their route.
    fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> + '_ {
        self.layers
            .iter_mut()
            .flat_map(|l| {
                let (a, m) = (&mut l.self_attn, &mut l.mlp);
                [
                    &mut a.q_proj,
                    &mut a.k_proj,
                    &mut a.v_proj,
                    &mut a.o_proj,
                    &mut m.gate_proj,
                    &mut m.up_proj,
                    &mut m.down_proj,
                ]
            })
            .chain(std::iter::once(&mut self.lm_head))
    }

    /// Moves every matrix off our own kernels: candle's Q4_1 kernels where the repack is
    /// exact, dense f32 elsewhere, the embedding gathered on the CPU. What a Mac whose Metal
    /// kernels fail the load-time self-test runs; public so that its numerics are tested on
    /// every device.
    pub fn use_verified_route(&mut self) -> Result<()> {
        let dev = self.device.clone();
        for l in self.linears_mut() {
            l.weight = l.weight.verified(&dev)?;
        }
        self.embed_tokens.on_host = true;
        Ok(())
    }

    /// Matrices (projections and head) still on our own quantized kernels.
    pub fn native_matrices(&self) -> usize {
        self.matrices().filter(|w| w.is_native()).count()
    }

    /// Runs the self-test on every Metal kernel variant this model dispatches; on a failure
    /// the model moves to the verified route and says so once.
    #[cfg(bot_metal)]
    /// Whether every kernel variant passed (`false`: the model now runs the verified route).
    fn verify_metal_kernels(&mut self, dev: &candle_core::MetalDevice) -> Result<bool> {
        use crate::engine::metal::{quant::GpuRunner, selftest};
        let quant = |w: &Weight| match w {
            Weight::Quant(q) => Some(crate::engine::quant::QParams::new(q, 1)),
            _ => None,
        };
        let matmuls: Vec<_> = self.matrices().filter_map(quant).collect();
        let gathers: Vec<_> = quant(&self.embed_tokens.weight).into_iter().collect();
        let variants = selftest::variants(&matmuls, &gathers);
        if variants.is_empty() {
            return Ok(true);
        }
        if let Err(why) = selftest::verdict(&selftest::run_all(&GpuRunner(dev), &variants)) {
            self.notes.push(format!(
                "Metal {why}; running the verified route instead (candle's Q4_1 kernels, dense \
                 f32 where Q4_1 cannot hold a matrix, the embedding gathered on the CPU)"
            ));
            self.use_verified_route()?;
            return Ok(false);
        }
        Ok(true)
    }

    /// Runs forwards on the fused Metal step (`metal::step`) when it takes this model and its
    /// first forward agrees with candle ops (one token at position 0 on both, then the caches
    /// are reset); else says why once and keeps candle ops.
    #[cfg(bot_metal)]
    fn adopt_metal_step(&mut self, dev: &candle_core::MetalDevice) -> Result<()> {
        use crate::engine::metal::step::{gpu::MetalStep, unsupported};
        if let Some(why) = unsupported(&self.view()) {
            self.notes.push(format!(
                "Metal: {why}; running candle ops instead of the fused step"
            ));
            return Ok(());
        }
        let mut step = MetalStep::new(&self.view(), dev)?;
        let id = [0u32];
        let (got, _) = step.forward(&id, 0, false, false)?;
        let want = self
            .forward(&id, false, false)?
            .logits
            .flatten_all()?
            .to_vec1::<f32>()?;
        self.reset();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        if !(err <= 1e-3) {
            self.notes.push(format!(
                "Metal: the fused step's first logits differ from candle ops' by {err:.1e} \
                 (relative); running candle ops instead"
            ));
            return Ok(());
        }
        self.fused = Some(Fused::Metal(Box::new(step)));
        Ok(())
    }

    /// Every projection's weight and the head's: the matrices a decode step multiplies by.
    fn matrices(&self) -> impl Iterator<Item = &Weight> + '_ {
        self.projections()
            .chain(std::iter::once(&self.lm_head.weight))
    }

    fn projections(&self) -> impl Iterator<Item = &Weight> + '_ {
        self.layer_linears().flat_map(|l| l.map(|l| &l.weight))
    }

    /// The weights as the fused step reads them.
    #[cfg_attr(not(any(feature = "cuda", bot_metal, test)), allow(dead_code))]
    pub(crate) fn view(&self) -> ModelView<'_> {
        ModelView {
            cfg: &self.cfg,
            embed: &self.embed_tokens.weight,
            layers: self
                .layers
                .iter()
                .zip(self.layer_linears())
                .map(|(l, linears)| LayerView {
                    linears,
                    norms: [
                        &l.input_layernorm,
                        &l.post_attention_layernorm,
                        &l.self_attn.q_norm,
                        &l.self_attn.k_norm,
                    ],
                })
                .collect(),
            norm: &self.norm,
            lm_head: &self.lm_head,
        }
    }

    /// Runs attention through candle ops on the CPU too, instead of `cpu::attention` (the
    /// two are compared in tests; GPUs always use candle ops). Resets the cache.
    pub fn use_reference_attention(&mut self, on: bool) {
        self.reset();
        for l in &mut self.layers {
            l.self_attn.reference_path = on;
        }
    }

    /// Decode positions and prompts on the CPU through tensors (`on`), as forwards that keep
    /// hidden states or every position's logits do, or on host vectors (`decode_host`,
    /// `prompt_host`: the default); the tests compare the two.
    pub fn use_tensor_path(&mut self, on: bool) {
        self.tensor_path = on;
    }

    /// Tokens already in the KV cache.
    pub fn offset(&self) -> usize {
        self.cached.len()
    }

    pub fn reset(&mut self) {
        self.cached.clear();
        for l in &mut self.layers {
            l.self_attn.kv.reset();
            l.self_attn.host_kv.clear();
        }
    }

    /// Keeps the first `len` cached positions and forgets the rest.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.cached.len() {
            return Ok(());
        }
        self.cached.truncate(len);
        for l in &mut self.layers {
            let a = &mut l.self_attn;
            a.host_kv.truncate(len, self.cfg.head_dim);
            let (k, v) = (a.kv.k()?, a.kv.v()?); // (Hkv, T, D)
            a.kv.reset();
            if let (Some(k), Some(v), true) = (k, v, len > 0) {
                a.kv.append(
                    &k.narrow(1, 0, len)?.contiguous()?,
                    &v.narrow(1, 0, len)?.contiguous()?,
                )?;
            }
        }
        Ok(())
    }

    /// Whether the cache starts with exactly `prefix`: then it is cut back to it and the
    /// caller continues after it; else the cache is emptied. (A prefix reused only where it
    /// matches whole was computed as the same chunk as a fresh run would compute it, so the
    /// results are the same bits either way.)
    pub fn keep_prefix(&mut self, prefix: &[u32]) -> Result<bool> {
        if self.cached.len() >= prefix.len() && self.cached[..prefix.len()] == *prefix {
            self.truncate(prefix.len())?;
            return Ok(true);
        }
        self.reset();
        Ok(false)
    }

    /// Projections (and the head) running on candle's Q4_1 kernels after `--qmatmul repack`.
    pub fn repacked_projections(&self) -> usize {
        self.matrices()
            .filter(|w| matches!(w, Weight::Repacked { .. }))
            .count()
    }

    /// Bytes of weights one decode step reads (every projection, the head, one embedding row).
    pub fn weight_bytes_per_token(&self) -> usize {
        self.matrices().map(Weight::nbytes).sum::<usize>()
            + self.embed_tokens.weight.nbytes() / self.cfg.vocab_size
    }

    /// Runs `ids` at the current cache position and appends them to the cache.
    pub fn forward(
        &mut self,
        ids: &[u32],
        all_logits: bool,
        keep_hidden: bool,
    ) -> Result<ForwardOutput> {
        let team = ids.len() == 1 || (!all_logits && !keep_hidden && self.prompt_on_team());
        self.on_workers(team, |m| m.forward_on_workers(ids, all_logits, keep_hidden))
    }

    /// `f(self)`, on the CPU from a worker of rayon's pool. Every CPU matmul hands its rows
    /// to the worker pool. Called from outside it, each of a step's ~200 hand-offs would put
    /// this thread to sleep and wake it again (a futex round trip each); run from a worker,
    /// the whole pass costs one. A decode step's regions, and a host prompt pass's (`team`
    /// set), are too short for rayon's wake-ups: the workers spin for this one pass instead
    /// (`cpu::team`). Other prompts keep rayon's pool.
    fn on_workers<R: Send>(&mut self, team: bool, f: impl FnOnce(&mut Qwen3) -> R + Send) -> R {
        if !self.device.is_cpu() || rayon::current_thread_index().is_some() {
            return f(self);
        }
        let model = OnWorker(self);
        rayon::scope(move |_| {
            let model = model;
            if team {
                // the wrapper moves whole into the closure (`let`): capturing `model.0`
                // alone would send a bare `&mut Qwen3`, which is not `Send` with `cuda`
                crate::engine::cpu::team::Team::lead(move || {
                    let model = model;
                    f(model.0)
                })
            } else {
                f(model.0)
            }
        })
    }

    /// Whether a prompt's host pass (`prompt_host`) runs on a spinning team (`cpu::team`) as a
    /// decode step does: every parallel region of it is the team's (the shared GEMMs, their
    /// fallbacks' `qmatmul`, norms, attention, `silu · up`, LoRA's rows), so it is whenever
    /// the pass is the host's, every matrix is ours and every LoRA branch has its host copies
    /// (candle's matmuls, for dense or repacked weights or a branch without them, would run
    /// on the leading thread alone under a team). On the Xeon's
    /// 16 threads each of a 64-token 0.6B prompt's ~300 regions cost rayon a wake-up chain
    /// (twenty-ninth session).
    fn prompt_on_team(&self) -> bool {
        // a LoRA branch without host copies would add through candle's matmul
        let lora_host = |l: &Linear| l.lora.as_ref().is_none_or(|b| b.host_parts().is_some());
        self.host_step_ok()
            && self.matrices().all(|w| matches!(w, Weight::Quant(_)))
            && self.layer_linears().flatten().all(lora_host)
    }

    /// Whether a CPU pass runs on host vectors (`decode_host`, `prompt_host`): the CPU device, with
    /// `cpu::attention` (not the candle ops the tests compare it with).
    fn host_step_ok(&self) -> bool {
        !self.tensor_path
            && self.device.is_cpu()
            && self.fused.is_none()
            && !self.layers.iter().any(|l| l.self_attn.reference_path)
    }

    /// One decode position on the CPU, `forward_on_workers`' arithmetic on host vectors
    /// (`HostStep`) kept across calls: the logits are left in `self.host.logits`. Each
    /// region's kernel writes where the next reads, and what runs between the regions (norms,
    /// residual adds, `silu · up`, the activations' quantization) touches no allocator.
    fn decode_host(&mut self, id: u32) -> Result<()> {
        let mut s = std::mem::take(&mut self.host);
        let out = self.forward_host(&[id], &mut s);
        self.host = s;
        out
    }

    /// A prompt (chunk) on the CPU on host vectors, as `decode_host` runs a position: the
    /// shared GEMMs write into the pass's buffers (`quant::qmatmul_shared_into`), the
    /// attention core reads q|k|v there, and no tensor is made between the layers' regions
    /// (through tensors, a 64-token 0.6B pass allocated ~5 MB a layer, much of it fresh
    /// pages for the kernel to clear). The buffers are this call's: a chunk's are megabytes,
    /// kept only while it runs. Returns the logits of its last position.
    fn prompt_host(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let mut s = HostStep::default();
        self.forward_host(ids, &mut s)?;
        Ok(s.logits)
    }

    /// `forward_on_workers`' arithmetic for `ids` on `s`, the logits of the last position
    /// (the head reads it alone) left in `s.logits`.
    fn forward_host(&mut self, ids: &[u32], s: &mut HostStep) -> Result<()> {
        let l = ids.len();
        let x = self.embed_tokens.forward(ids, &self.device)?; // (L, H)
        s.x = x.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        s.size_for(&self.cfg, l);
        let offset = self.cached.len();
        let (cos, sin) = rope_angles(self.cfg.rope_theta, self.cfg.head_dim, offset..offset + l);
        let head = Linear::lead_in(&[&self.lm_head]);
        for i in 0..self.layers.len() {
            let (this, rest) = self.layers.split_at_mut(i + 1);
            let next = rest.first().map_or(head, DecoderLayer::lead_in);
            this[i].forward_host(s, &cos, &sin, next, i > 0)?;
        }
        self.cached.extend_from_slice(ids);
        // the last layer's MLP output is added to the last row only: the head reads it alone
        let (eps, h) = (self.cfg.rms_norm_eps as f32, self.cfg.hidden_size);
        let (x, o) = (&mut s.x[(l - 1) * h..], &s.o[(l - 1) * h..]);
        cpu::norm::add_rms_norm_rows(x, o, &self.norm_host, eps, &mut s.h[..h]);
        let HostStep {
            h: hv,
            logits,
            acts,
            ..
        } = s;
        Linear::forward_host([&self.lm_head], &hv[..h], 1, acts, [logits])
    }

    /// `forward` proper (on a worker thread when the device is the CPU).
    fn forward_on_workers(
        &mut self,
        ids: &[u32],
        all_logits: bool,
        keep_hidden: bool,
    ) -> Result<ForwardOutput> {
        let l = ids.len();
        if l == 0 {
            return Err(EngineError::Internal(
                "forward needs at least one token".into(),
            ));
        }
        if !keep_hidden && (l == 1 || !all_logits) && self.host_step_ok() {
            let v = self.cfg.vocab_size;
            let logits = if l == 1 {
                self.decode_host(ids[0])?;
                Tensor::from_slice(&self.host.logits, (1, v), &self.device)?
            } else {
                Tensor::from_vec(self.prompt_host(ids)?, (1, v), &self.device)?
            };
            return Ok(ForwardOutput {
                logits,
                hidden: Vec::new(),
            });
        }
        if let Some(f) = &mut self.fused {
            let (logits, hidden) = f.forward(ids, self.cached.len(), all_logits, keep_hidden)?;
            self.cached.extend_from_slice(ids);
            let rows = if all_logits { l } else { 1 };
            let h = self.cfg.hidden_size;
            let hidden = hidden
                .into_iter()
                .map(|v| {
                    let n = v.len() / h;
                    Tensor::from_vec(v, (n, h), &self.device)
                })
                .collect::<candle_core::Result<_>>()?;
            let logits = Tensor::from_vec(logits, (rows, self.cfg.vocab_size), &self.device)?;
            return Ok(ForwardOutput { logits, hidden });
        }
        let mut x = self.embed_tokens.forward(ids, &self.device)?; // (L, H)
        let offset = self.cached.len();
        let rope = rope_tables(&self.cfg, offset, l, &self.device)?;
        let t = offset + l;
        let mask = if l > 1 {
            let off = offset;
            let m: Vec<f32> = (0..l)
                .flat_map(|i| {
                    (0..t).map(move |j| if j > off + i { f32::NEG_INFINITY } else { 0.0 })
                })
                .collect();
            Some(Tensor::from_vec(m, (l, t), &self.device)?)
        } else {
            None
        };
        let mut hidden = Vec::new();
        if keep_hidden {
            hidden.push(x.clone());
        }
        let head = Linear::lead_in(&[&self.lm_head]);
        for i in 0..self.layers.len() {
            let (this, rest) = self.layers.split_at_mut(i + 1);
            let next = rest.first().map_or(head, DecoderLayer::lead_in);
            x = this[i].forward(&x, &rope, mask.as_ref(), next)?;
            if keep_hidden {
                hidden.push(x.clone());
            }
        }
        self.cached.extend_from_slice(ids);
        let x = if all_logits {
            x
        } else {
            x.narrow(0, l - 1, 1)?
        };
        let x = rms_norm(&x, &self.norm, self.cfg.rms_norm_eps as f32)?;
        if keep_hidden {
            hidden.push(x.clone());
        }
        let logits = self.lm_head.forward(&x)?.to_dtype(DType::F32)?;
        Ok(ForwardOutput { logits, hidden })
    }

    /// Refuses `more` tokens past the cache when they would not fit the context.
    pub fn check_room(&self, more: usize) -> Result<()> {
        let tokens = self.cached.len().saturating_add(more);
        if tokens > self.cfg.max_position_embeddings {
            return Err(EngineError::ContextFull {
                tokens,
                max: self.cfg.max_position_embeddings,
            });
        }
        Ok(())
    }

    /// Runs all of `ids` but its last `PREFILL_CHUNK` (or fewer) tokens, in chunks of that
    /// size, so a long prompt never needs activations, masks or attention scores for all of
    /// it at once; returns what is left to run.
    fn prefill_chunks<'a>(&mut self, ids: &'a [u32]) -> Result<&'a [u32]> {
        self.check_room(ids.len())?;
        let mut rest = ids;
        while rest.len() > PREFILL_CHUNK {
            let (chunk, tail) = rest.split_at(PREFILL_CHUNK);
            if let Some(f) = &mut self.fused {
                f.forward(chunk, self.cached.len(), false, false)?;
                self.cached.extend_from_slice(chunk);
                rest = tail;
                continue;
            }
            self.forward(chunk, false, false)?;
            rest = tail;
        }
        Ok(rest)
    }

    /// Logits of the last position of `ids`, as a host vector.
    pub fn next_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let ids = self.prefill_chunks(ids)?;
        if let Some(f) = &mut self.fused {
            if ids.is_empty() {
                return Err(EngineError::Internal(
                    "forward needs at least one token".into(),
                ));
            }
            let (logits, _) = f.forward(ids, self.cached.len(), false, false)?;
            self.cached.extend_from_slice(ids);
            return Ok(logits);
        }
        let out = self.forward(ids, false, false)?;
        Ok(out.logits.squeeze(0)?.to_vec1::<f32>()?)
    }

    /// Runs `ids` at the cache position and samples the next token where the logits are: on
    /// the GPU only the token and its log-probability come back to the host.
    pub fn next_token(&mut self, ids: &[u32], s: &SampleStep) -> Result<Sampled> {
        let ids = self.prefill_chunks(ids)?;
        if let Some(f) = &mut self.fused {
            if ids.is_empty() {
                return Err(EngineError::Internal(
                    "forward needs at least one token".into(),
                ));
            }
            let out = f.forward_sample(ids, self.cached.len(), s)?;
            self.cached.extend_from_slice(ids);
            return out.map_err(|_| EngineError::NonFiniteLogits);
        }
        if let ([id], true) = (ids, self.host_step_ok()) {
            let id = *id;
            self.on_workers(true, |m| m.decode_host(id))?;
            let t = Instant::now();
            let out = self
                .sampler
                .sample(&mut self.host.logits, s.recent, &s.params, s.draw);
            profile::add(Part::Sampling, t);
            return out.map_err(|_| EngineError::NonFiniteLogits);
        }
        let logits = self.forward(ids, false, false)?.logits;
        let t = Instant::now();
        let out = if self.device.is_cpu() {
            let mut v = logits.squeeze(0)?.to_vec1::<f32>()?;
            self.sampler.sample(&mut v, s.recent, &s.params, s.draw)
        } else {
            // the GPU samples its own logits row: three words come back
            let op = SampleOp::new(s.params, SampleState::new(s.draw, s.recent));
            let bytes = logits.apply_op1_no_bwd(&op)?.to_vec1::<u8>()?;
            decode_kernel_output(split_output(&bytes).0)
        };
        profile::add(Part::Sampling, t);
        out.map_err(|_| EngineError::NonFiniteLogits)
    }

    /// Index of the largest logit (ties: the lowest id, like numpy's argmax).
    pub fn argmax(logits: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        best as u32
    }

    /// Greedy decoding with the KV cache after a prompt; does not stop at EOS.
    pub fn greedy(&mut self, prompt: &[u32], steps: usize) -> Result<(Vec<f32>, Vec<u32>)> {
        self.reset();
        self.check_room(prompt.len().saturating_add(steps))?;
        let first = self.next_logits(prompt)?;
        let mut ids = Vec::with_capacity(steps);
        let mut logits = first.clone();
        for s in 0..steps {
            let id = Self::argmax(&logits);
            ids.push(id);
            if s + 1 < steps {
                logits = self.next_logits(&[id])?;
            }
        }
        Ok((first, ids))
    }
}
