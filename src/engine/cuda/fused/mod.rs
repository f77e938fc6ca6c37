//! Qwen3's forward on CUDA as a fixed sequence of our own kernels (`cuda/step.cu`,
//! `cuda/qmatmul.cu`) on buffers allocated once, instead of ~30 candle ops a layer. A decode step
//! is five launches a layer (nine with LoRA): q|k|v as one 4-bit matmul over concatenated
//! weights with the input RMSNorm inside; attention with the q/k norms, RoPE and cache write
//! inside; o with the residual add; gate|up (rows interleaved) with the norm inside and SwiGLU
//! as its epilogue; down with the residual add. LoRA B products ride in the matmuls' epilogues.
//! The fast mode's decode matmuls round x to 16-bit integers (`qmv4q`, as the CPU's fast
//! kernel does; the exact mode's stay fp32), with no more blocks than fit on the GPU at once.
//! On sm_90 every kernel is launched with programmatic dependent launch, so it starts while its
//! predecessor ends (attention fetches its cache rows meanwhile). The step is captured once as
//! a CUDA graph and replayed for every token. Prompts take the fp16 tensor-core matmul at 4
//! bits (TF32 at other widths; their input converted by `x_to_f16p`) and separate norm, RoPE
//! and SwiGLU kernels. The numerics are those of `qwen3.rs` (mlx_lm's Qwen3), which stays the
//! reference and the path of the other devices.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::CudaDevice;

use crate::engine::cuda::plan::{self, qmv4_smem, qmv4q_smem, Matmul};
use crate::engine::cuda::quant::{
    feed_smem, qmv4_grid, raise_smem_limit, resident, Epi, GpuQMatrix, MODULE as QMODULE,
    PTX as QPTX,
};
use crate::engine::cuda::sample;
use crate::engine::error::{EngineError, Result};
use crate::engine::layers::{rope_angles, CudaStep, Linear, ModelView, Weight};
use crate::engine::lora::LoraBranch;
use crate::engine::profile::KernelTime;
use crate::engine::quant::QParams;
use crate::engine::quant::{Numerics, QMatrix};
mod buffers;
mod eligible;
#[cfg(test)]
mod kernel_tests;
mod kernels;
mod launch;
mod step;
mod weights;

use buffers::{Buffers, Cache, Dims, FeedBufs};
pub(crate) use eligible::unsupported;
use kernels::AttentionIo;
use launch::{clusters_available, pdl_available, ptr, Arg, Clusters, Mode, Pdl};
use weights::{quant, DecodeShape, Layer, Proj};

use crate::engine::sample::{
    decode_kernel_output, KernelParams, NonFinite, SampleState, SampleStep, Sampled,
};

const STEP_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/step.ptx"));
const STEP_MODULE: &str = "bot_step";
/// Blocks a head's keys are split over in decode attention (32 heads alone fill a quarter of
/// an H100's SMs).
const ATT_SPLITS: usize = 4;
/// The kernels of `qmatmul.cu` the step launches, besides the decode kernels
/// (`plan::decode_kernels`).
const QMATMUL_KERNELS: [&str; 8] = [
    "qmv_f32",
    "qmm4_f16",
    "qmm4_f16_b2",
    "x_to_f16p",
    "qmm_tf32",
    "qmm_tf32_sk",
    "qmm_reduce",
    "qgather_f32",
];
const STEP_KERNELS: [&str; 15] = [
    "rms_norm_f32",
    "qk_norm_rope_cache",
    "attention_prompt_hd32",
    "attention_prompt_hd64",
    "attention_prompt_hd128",
    "attention_f32_hd32",
    "attention_f32_hd64",
    "attention_f32_hd128",
    "attention_f32_hd256",
    "attention_decode_hd32",
    "attention_decode_hd64",
    "attention_decode_hd128",
    "attention_decode_hd256",
    "swiglu_f32",
    "lora_a_f32",
];

pub struct FusedQwen3 {
    dev: CudaDevice,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    d: Dims,
    layers: Vec<Layer>,
    norm: CudaSlice<f32>,
    embed: Proj,
    head: Proj,
    exact: bool,
    /// Where kernels are launched with programmatic dependent launch (`pdl_available`), and
    /// whether the forward being issued is one of those (`issue` sets it).
    pdl: Pdl,
    pdl_now: std::cell::Cell<bool>,
    /// Which prompt matmuls add their K splits inside a thread-block cluster.
    clusters: Clusters,
    max_rtot: usize,
    bufs: Buffers,
    /// Decode's LoRA A products made by the kernel before (`None`: by `lora_a_f32` always,
    /// `BOT_CUDA_LORA_FEED=0`).
    feed: Option<FeedBufs>,
    cache: Cache,
    pos: CudaSlice<i32>,
    mode: CudaStep,
    graph: Option<CudaGraph>,
    /// The sampler the captured graph ends with (`None`: it stops at the logits).
    graph_sampler: Option<KernelParams>,
    /// The sampler's per-token inputs (`SampleState`) and its three output words.
    sample_state: CudaSlice<u8>,
    sample_out: CudaSlice<u32>,
    /// Blocks of the grid sampler (`None`: the one-block kernel, `BOT_CUDA_SAMPLER=block`)
    /// and its scratch, zeroed once (each run leaves it as the next one reads it); its launch is
    /// cooperative (`launch_with`).
    sample_grid: Option<usize>,
    sample_scratch: CudaSlice<u8>,
    /// While profiling: an event pair around every launch (which then runs eagerly).
    profile: Option<RefCell<Vec<(&'static str, CudaEvent, CudaEvent)>>>,
    /// Fallbacks to report (`Qwen3::take_notes`).
    pub(crate) notes: Vec<String>,
}

impl FusedQwen3 {
    /// Uploads `m`'s weights in the fused layout; `unsupported(m)` must be `None`.
    pub(crate) fn new(
        m: &ModelView,
        dev: &CudaDevice,
        kernel: Numerics,
        mode: CudaStep,
    ) -> Result<Self> {
        let c = &m.cfg;
        let d = Dims {
            h: c.hidden_size,
            nh: c.num_attention_heads,
            nkv: c.num_key_value_heads,
            hd: c.head_dim,
            inter: c.intermediate_size,
            vocab: c.vocab_size,
            eps: c.rms_norm_eps as f32,
            theta: c.rope_theta,
        };
        let mut funcs = HashMap::new();
        for f in QMATMUL_KERNELS.into_iter().chain(plan::decode_kernels()) {
            funcs.insert(
                f,
                dev.get_or_load_custom_func(f, QMODULE, QPTX)?
                    .into_cuda_function(),
            );
        }
        for f in STEP_KERNELS {
            funcs.insert(
                f,
                dev.get_or_load_custom_func(f, STEP_MODULE, STEP_PTX)?
                    .into_cuda_function(),
            );
        }
        for f in [sample::KERNEL, sample::GRID_KERNEL] {
            funcs.insert(
                f,
                dev.get_or_load_custom_func(f, sample::MODULE, sample::PTX)?
                    .into_cuda_function(),
            );
        }
        let vec = |t: &candle_core::Tensor| -> Result<CudaSlice<f32>> {
            let v = t
                .flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?;
            Ok(dev.clone_htod(&v)?)
        };
        let mut layers = Vec::new();
        let mut max_rtot = 1;
        let host = |t: &candle_core::Tensor| -> Result<Vec<f32>> {
            Ok(t.flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?)
        };
        for (l, norms) in m.layers.iter().map(|l| (l.linears, l.norms)) {
            let (inn, post) = (host(norms[0])?, host(norms[1])?);
            let qkv = Proj::new(dev, &l[0..3], false, Some(&inn))?;
            let o = Proj::new(dev, &l[3..4], false, None)?;
            let gu = Proj::new(dev, &l[4..6], true, Some(&post))?;
            let down = Proj::new(dev, &l[6..7], false, None)?;
            for p in [&qkv, &o, &gu, &down] {
                if let Some(lo) = &p.lora {
                    max_rtot = max_rtot.max(lo.rtot);
                }
            }
            layers.push(Layer {
                in_norm: vec(norms[0])?,
                post_norm: vec(norms[1])?,
                q_norm: vec(norms[2])?,
                k_norm: vec(norms[3])?,
                qkv,
                o,
                gu,
                down,
            });
        }
        let one = |w: &Weight| -> Result<Proj> {
            let q =
                quant(w).ok_or_else(|| EngineError::Internal("fused step: dense weight".into()))?;
            Proj::single(dev, q)
        };
        // x staged in shared memory: 48 KiB at 12288 wide, which with the kernel's static
        // shared memory is past the default limit, so opt in to what the widest row needs
        let widest = m
            .projections()
            .filter_map(quant)
            .map(|q| q.cols)
            .max()
            .unwrap_or(0);
        let widest = widest.max(d.h);
        for name in plan::decode_kernels() {
            // a LoRA feed sums through the staging memory: a float a thread (1024 at most)
            let smem = if name.starts_with("qmv4q") {
                qmv4q_smem(widest)
            } else {
                qmv4_smem(widest)
            }
            .max(4 * 1024);
            if let Some(f) = funcs.get(name) {
                raise_smem_limit(f, smem).w()?;
            }
        }
        let pdl = pdl_available(dev)?;
        let sms = dev
            .cuda_stream()
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .w()? as usize;
        let shape = |p: &mut Proj| -> Result<()> {
            if p.bits != 4 {
                return Ok(());
            }
            let Matmul::Decode4 {
                kernel: f,
                warps,
                smem,
                passes,
                ..
            } = plan::decode4(p.n, p.k, kernel)
            else {
                unreachable!("decode4 plans a decode kernel")
            };
            let func = funcs
                .get(f)
                .ok_or_else(|| EngineError::Internal(format!("kernel {f} not loaded")))?;
            let grid = qmv4_grid(func, passes, 32 * warps, smem, sms)?;
            p.decode = DecodeShape {
                f,
                grid,
                threads: 32 * warps,
                smem,
            };
            Ok(())
        };
        let embed = one(m.embed)?;
        let mut head = one(&m.lm_head.weight)?;
        for l in layers.iter_mut() {
            for p in [&mut l.qkv, &mut l.o, &mut l.gu, &mut l.down] {
                shape(p)?;
            }
        }
        shape(&mut head)?;
        let bufs = Buffers::new(dev, &d, 1, max_rtot)?;
        // o -> gate|up -> down -> the next layer's q|k|v: three links a layer
        let feed = match std::env::var("BOT_CUDA_LORA_FEED").as_deref() {
            Ok("0") => None,
            _ if max_rtot > 1 => Some(FeedBufs::new(dev, 3 * layers.len())?),
            _ => None,
        };
        let cache = Cache::new(dev, &d, c.num_hidden_layers, 256)?;
        Ok(FusedQwen3 {
            stream: dev.cuda_stream(),
            dev: dev.clone(),
            funcs,
            d,
            layers,
            norm: vec(m.norm)?,
            embed,
            head,
            exact: kernel == Numerics::Exact,
            pdl,
            pdl_now: std::cell::Cell::new(false),
            clusters: clusters_available(dev)?,
            max_rtot,
            bufs,
            feed,
            cache,
            pos: dev.alloc_zeros::<i32>(1)?,
            mode,
            graph: None,
            graph_sampler: None,
            sample_state: dev.alloc_zeros::<u8>(std::mem::size_of::<SampleState>())?,
            sample_out: dev.alloc_zeros::<u32>(3)?,
            sample_grid: match std::env::var("BOT_CUDA_SAMPLER").as_deref() {
                Ok("block") => None,
                _ => Some(sample::grid_blocks(d.vocab, sms)),
            },
            sample_scratch: dev.alloc_zeros::<u8>(sample::GRID_SCRATCH_BYTES)?,
            profile: None,
            notes: Vec::new(),
        })
    }

    /// Starts (or stops) timing every launch with CUDA events; forwards run eagerly meanwhile.
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(|| RefCell::new(Vec::new()));
    }

    /// GPU time per kernel class since profiling started, largest first; resets the record.
    pub fn kernel_times(&mut self) -> Result<Vec<KernelTime>> {
        let Some(rec) = &self.profile else {
            return Ok(Vec::new());
        };
        self.stream.synchronize().w()?;
        let mut by: HashMap<&'static str, KernelTime> = HashMap::new();
        for (name, a, b) in rec.borrow_mut().drain(..) {
            let t = by.entry(name).or_insert(KernelTime {
                name,
                calls: 0,
                ms: 0.0,
                bytes: 0,
            });
            t.calls += 1;
            t.ms += a.elapsed_ms(&b).w()? as f64;
        }
        let per_layer = |f: &dyn Fn(&Layer) -> &Proj| -> usize {
            self.layers.iter().map(|l| f(l).w.bytes()).sum()
        };
        let layers = self.layers.len().max(1);
        for (name, bytes) in [
            ("qkv_proj", per_layer(&|l| &l.qkv)),
            ("o_proj", per_layer(&|l| &l.o)),
            ("gate_up_proj", per_layer(&|l| &l.gu)),
            ("down_proj", per_layer(&|l| &l.down)),
            ("lm_head", self.head.w.bytes() * layers),
        ] {
            if let Some(t) = by.get_mut(name) {
                // calls / layers passes over every layer's matrix (the head: one per forward)
                t.bytes = bytes * t.calls / layers;
            }
        }
        let mut v: Vec<KernelTime> = by.into_values().collect();
        v.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(v)
    }

    /// Runs `ids` at cache position `pos`; returns the logits of the last position (or of
    /// every position) and, when asked for, the hidden states as `qwen3::Qwen3::forward` does.
    pub fn forward(
        &mut self,
        ids: &[u32],
        pos: usize,
        all_logits: bool,
        keep_hidden: bool,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let m = ids.len();
        let mut hidden = Vec::new();
        self.run(
            ids,
            pos,
            all_logits,
            keep_hidden.then_some(&mut hidden),
            None,
        )?;
        let rows = if all_logits { m } else { 1 };
        let mut logits = vec![0f32; rows * self.d.vocab];
        self.stream
            .memcpy_dtoh(&self.bufs.logits.slice(0..rows * self.d.vocab), &mut logits)
            .w()?;
        self.stream.synchronize().w()?;
        Ok((logits, hidden))
    }

    /// Runs `ids` at cache position `pos` and samples the next token on the GPU, after the
    /// head, in the same graph: only the token, its log-probability and a flag come back.
    pub fn forward_sample(
        &mut self,
        ids: &[u32],
        pos: usize,
        s: &SampleStep,
    ) -> Result<std::result::Result<Sampled, NonFinite>> {
        let state = SampleState::new(s.draw, s.recent);
        self.stream
            .memcpy_htod(&state.to_bytes(), &mut self.sample_state)
            .w()?;
        self.run(ids, pos, false, None, Some(s.params))?;
        let mut out = [0u32; 3];
        self.stream.memcpy_dtoh(&self.sample_out, &mut out).w()?;
        self.stream.synchronize().w()?;
        Ok(decode_kernel_output(out))
    }

    /// Uploads `ids` and `pos`, then issues the forward (replaying the decode graph where it
    /// can, capturing it first if needed), ending with the sampler when one is given.
    fn run(
        &mut self,
        ids: &[u32],
        pos: usize,
        all_logits: bool,
        hidden: Option<&mut Vec<Vec<f32>>>,
        sample: Option<KernelParams>,
    ) -> Result<()> {
        let m = ids.len();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.d.vocab) {
            return Err(EngineError::TokenOutOfRange {
                id,
                vocab: self.d.vocab,
            });
        }
        self.ensure(m, pos + m, all_logits)?;
        self.stream
            .memcpy_htod(ids, &mut self.bufs.ids.slice_mut(0..m))
            .w()?;
        self.stream.memcpy_htod(&[pos as i32], &mut self.pos).w()?;
        let graphable = m == 1 && !all_logits && hidden.is_none() && self.profile.is_none();
        if graphable && self.mode == CudaStep::Graph {
            if self.graph.is_some() && self.graph_sampler != sample {
                self.graph = None;
            }
            if self.graph.is_none() {
                match self.capture(sample) {
                    Ok(g) => {
                        self.graph = Some(g);
                        self.graph_sampler = sample;
                    }
                    Err(e) => {
                        self.notes.push(format!(
                            "CUDA graph capture failed ({e}); launching kernels one by one"
                        ));
                        self.mode = CudaStep::Eager;
                    }
                }
            }
        }
        match (&self.graph, graphable && self.mode == CudaStep::Graph) {
            (Some(g), true) => g.launch().w()?,
            _ => self.issue(m, all_logits, hidden, sample)?,
        }
        Ok(())
    }

    /// Buffers for `m` rows (and every row's logits if asked) and a cache for `len` positions;
    /// anything reallocated invalidates the captured graph.
    fn ensure(&mut self, m: usize, len: usize, all_logits: bool) -> Result<()> {
        let logit_rows = if all_logits { m } else { 1 };
        if m > self.bufs.rows || self.bufs.logits.len() < logit_rows * self.d.vocab {
            self.bufs = Buffers::new(&self.dev, &self.d, m.max(self.bufs.rows), self.max_rtot)?;
            if logit_rows > 1 {
                self.bufs.logits = self.dev.alloc_zeros::<f32>(logit_rows * self.d.vocab)?;
            }
            self.graph = None;
        }
        if len > self.cache.cap {
            let cap = len.max(2 * self.cache.cap).next_multiple_of(256);
            let mut next = Cache::new(&self.dev, &self.d, self.layers.len(), cap)?;
            for (new, old) in next
                .k
                .iter_mut()
                .zip(&self.cache.k)
                .chain(next.v.iter_mut().zip(&self.cache.v))
            {
                self.stream
                    .memcpy_dtod(old, &mut new.slice_mut(0..old.len()))
                    .w()?;
            }
            self.cache = next;
            self.graph = None;
        }
        Ok(())
    }

    fn capture(&mut self, sample: Option<KernelParams>) -> Result<CudaGraph> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()?;
        let issued = self.issue(1, false, None, sample);
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        issued?;
        graph
            .w()?
            .ok_or_else(|| EngineError::Internal("the captured CUDA graph is empty".into()))
    }
}
