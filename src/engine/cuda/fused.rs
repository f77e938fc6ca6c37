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
    qmv4_grid, resident, Epi, GpuQMatrix, MODULE as QMODULE, PTX as QPTX,
};
use crate::engine::cuda::sample;
use crate::engine::error::{EngineError, Result};
use crate::engine::lora::LoraBranch;
use crate::engine::profile::KernelTime;
use crate::engine::quant::QParams;
use crate::engine::quant::{Numerics, QMatrix};
use crate::engine::qwen3::{CudaStep, Linear, Qwen3, Weight};
use crate::engine::sample::{
    decode_kernel_output, KernelParams, NonFinite, SampleState, SampleStep, Sampled,
};

const STEP_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/step.ptx"));
const STEP_MODULE: &str = "bot_step";
/// Blocks a head's keys are split over in decode attention (32 heads alone fill a quarter of
/// an H100's SMs).
const ATT_SPLITS: usize = 4;
const QMATMUL_KERNELS: [&str; 11] = [
    "qmv_f32",
    "qmv4_m1_r2",
    "qmv4_m1_r4",
    "qmv4q_m1_r2",
    "qmv4q_m1_r4",
    "qmm4_f16",
    "x_to_f16p",
    "qmm_tf32",
    "qmm_tf32_sk",
    "qmm_reduce",
    "qgather_f32",
];
const STEP_KERNELS: [&str; 12] = [
    "rms_norm_f32",
    "qk_norm_rope_cache",
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

/// A projection (or several sharing an input, concatenated by output rows) ready to run.
struct Proj {
    w: Arc<GpuQMatrix>,
    n: usize,
    k: usize,
    bits: usize,
    group_size: usize,
    sdtype: i32,
    lora: Option<ProjLora>,
    /// Rows of the parts alternate (gate_0, up_0, gate_1, ...) rather than follow each other.
    interleaved: bool,
    /// The decode kernel's launch (4-bit weights only).
    decode: DecodeShape,
}

/// How the decode kernel runs on a `Proj`: `plan::decode4`'s kernel and block, `qmv4_grid`'s blocks.
#[derive(Clone, Copy, Default)]
struct DecodeShape {
    f: &'static str,
    grid: usize,
    threads: usize,
    smem: usize,
}

/// LoRA of a `Proj`: `at` (rtot, k) holds each part's A transposed, rank-padded to `r`; `bt`
/// (n, r) each output's column of B, times the adapter scale.
struct ProjLora {
    at: CudaSlice<f32>,
    bt: CudaSlice<f32>,
    r: usize,
    rtot: usize,
    seg1: usize,
    seg2: usize,
}

struct Layer {
    in_norm: CudaSlice<f32>,
    post_norm: CudaSlice<f32>,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    qkv: Proj,
    o: Proj,
    gu: Proj,
    down: Proj,
}

#[derive(Clone, Copy)]
struct Dims {
    h: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    inter: usize,
    vocab: usize,
    eps: f32,
    theta: f64,
}

impl Dims {
    fn qkv(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hd
    }

    /// Floats of split-K partials the layer matmuls need for `rows` prompt rows.
    fn split_workspace(&self, rows: usize) -> usize {
        let (h, a, i) = (self.h, self.nh * self.hd, self.inter);
        [(self.qkv(), h), (h, a), (2 * i, h), (h, i)]
            .iter()
            .map(|&(n, k)| {
                // the kernel (fp16 or TF32) depends on the bit width: room for either split
                let s = plan::qmm_splits(n, rows, k).max(plan::qmm4_splits(n, rows, k));
                if s == 1 {
                    0
                } else {
                    s * rows * n
                }
            })
            .max()
            .unwrap_or(0)
    }
}

/// Activations for up to `rows` positions.
struct Buffers {
    rows: usize,
    x: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    ao: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    act: CudaSlice<f32>,
    t: CudaSlice<f32>,
    /// Partial sums of split-K prompt matmuls.
    ws: CudaSlice<f32>,
    /// A prompt matmul's input as `x_to_f16p` writes it, and its rows' scales.
    xh: CudaSlice<u16>,
    rs: CudaSlice<f32>,
    /// Decode attention's per-split partials (max, sum, head_dim values) and per-head counters.
    att_ws: CudaSlice<f32>,
    att_cnt: CudaSlice<u32>,
    logits: CudaSlice<f32>,
    ids: CudaSlice<u32>,
}

/// Per-layer K and V for `cap` positions, (cap, n_kv, head_dim), and the RoPE tables.
struct Cache {
    cap: usize,
    k: Vec<CudaSlice<f32>>,
    v: Vec<CudaSlice<f32>>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

enum Arg {
    P(u64),
    I(i32),
    F(f32),
    E(Epi),
    S(KernelParams),
}

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
    /// Kernels are launched with programmatic dependent launch (see `pdl_available`).
    pdl: bool,
    max_rtot: usize,
    bufs: Buffers,
    cache: Cache,
    pos: CudaSlice<i32>,
    mode: CudaStep,
    graph: Option<CudaGraph>,
    /// The sampler the captured graph ends with (`None`: it stops at the logits).
    graph_sampler: Option<KernelParams>,
    /// The sampler's per-token inputs (`SampleState`) and its three output words.
    sample_state: CudaSlice<u8>,
    sample_out: CudaSlice<u32>,
    /// While profiling: an event pair around every launch (which then runs eagerly).
    profile: Option<RefCell<Vec<(&'static str, CudaEvent, CudaEvent)>>>,
}

/// Programmatic dependent launch needs sm_90 on both sides: a GPU of compute capability 9.0 or
/// newer, and PTX built for it (`build.rs`; older PTX has no `griddepcontrol`, so its kernels
/// would not wait). `BOT_CUDA_PDL=0` turns it off, for comparisons.
fn pdl_available(dev: &CudaDevice) -> Result<bool> {
    let built: u32 = env!("BOT_CUDA_ARCH").parse().unwrap_or(0);
    let (major, _) = dev.cuda_stream().context().compute_capability().w()?;
    let off = std::env::var("BOT_CUDA_PDL").is_ok_and(|v| v == "0");
    Ok(built >= 90 && major >= 9 && !off)
}

fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

fn quant(w: &Weight) -> Option<&Arc<QMatrix>> {
    match w {
        Weight::Quant(q) => Some(q),
        _ => None,
    }
}

/// Why the fused step cannot run this model (the caller falls back to candle ops), if it cannot.
pub fn unsupported(m: &Qwen3) -> Option<String> {
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
    let all = m
        .projections()
        .chain([m.embed_weight(), &m.lm_head_linear().weight]);
    for w in all {
        match w {
            Weight::Quant(_) => {}
            _ => return Some("a projection is not MLX-quantized (dense or repacked)".into()),
        }
    }
    for l in m.layer_linears() {
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

fn rope_tables(d: &Dims, cap: usize) -> (Vec<f32>, Vec<f32>) {
    let half = d.hd / 2;
    let mut cos = Vec::with_capacity(cap * half);
    let mut sin = Vec::with_capacity(cap * half);
    for p in 0..cap {
        for i in 0..half {
            // as qwen3::rope_tables: the angle in f64, so the table is exact to f32
            let angle = p as f64 * d.theta.powf(-(2.0 * i as f64) / d.hd as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

impl FusedQwen3 {
    /// Uploads `m`'s weights in the fused layout; `unsupported(m)` must be `None`.
    pub fn new(m: &Qwen3, dev: &CudaDevice, kernel: Numerics, mode: CudaStep) -> Result<Self> {
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
        for f in QMATMUL_KERNELS {
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
        funcs.insert(
            sample::KERNEL,
            dev.get_or_load_custom_func(sample::KERNEL, sample::MODULE, sample::PTX)?
                .into_cuda_function(),
        );
        let vec = |t: &candle_core::Tensor| -> Result<CudaSlice<f32>> {
            let v = t
                .flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?;
            Ok(dev.clone_htod(&v)?)
        };
        let mut layers = Vec::new();
        let mut max_rtot = 1;
        for (l, norms) in m.layer_linears().zip(m.layer_norms()) {
            let qkv = Proj::new(dev, &l[0..3], false)?;
            let o = Proj::new(dev, &l[3..4], false)?;
            let gu = Proj::new(dev, &l[4..6], true)?;
            let down = Proj::new(dev, &l[6..7], false)?;
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
                quant(w).ok_or_else(|| EngineError::Invalid("fused step: dense weight".into()))?;
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
        for name in QMATMUL_KERNELS.iter().filter(|f| f.starts_with("qmv4")) {
            let smem = if name.starts_with("qmv4q") {
                qmv4q_smem(widest)
            } else {
                qmv4_smem(widest)
            };
            if let Some(f) = funcs.get(name) {
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .w()?;
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
                .ok_or_else(|| EngineError::Invalid(format!("kernel {f} not loaded")))?;
            let grid = qmv4_grid(func, passes, 32 * warps, smem, sms)?;
            p.decode = DecodeShape {
                f,
                grid,
                threads: 32 * warps,
                smem,
            };
            Ok(())
        };
        let embed = one(m.embed_weight())?;
        let mut head = one(&m.lm_head_linear().weight)?;
        for l in layers.iter_mut() {
            for p in [&mut l.qkv, &mut l.o, &mut l.gu, &mut l.down] {
                shape(p)?;
            }
        }
        shape(&mut head)?;
        let bufs = Buffers::new(dev, &d, 1, max_rtot)?;
        let cache = Cache::new(dev, &d, c.num_hidden_layers, 256)?;
        Ok(FusedQwen3 {
            stream: dev.cuda_stream(),
            dev: dev.clone(),
            funcs,
            d,
            layers,
            norm: vec(m.final_norm())?,
            embed,
            head,
            exact: kernel == Numerics::Exact,
            pdl,
            max_rtot,
            bufs,
            cache,
            pos: dev.alloc_zeros::<i32>(1)?,
            mode,
            graph: None,
            graph_sampler: None,
            sample_state: dev.alloc_zeros::<u8>(std::mem::size_of::<SampleState>())?,
            sample_out: dev.alloc_zeros::<u32>(3)?,
            profile: None,
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
            return Err(EngineError::Invalid(format!(
                "token id {id} is outside the vocabulary (size {})",
                self.d.vocab
            )));
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
                        eprintln!("CUDA graph capture failed ({e}); launching kernels one by one");
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
            .ok_or_else(|| EngineError::Invalid("the captured CUDA graph is empty".into()))
    }

    fn launch(
        &self,
        f: &'static str,
        grid: (usize, usize),
        block: usize,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_as(f, f, grid, block, 0, args)
    }

    /// `launch`, profiled under `tag`.
    fn launch_as(
        &self,
        tag: &'static str,
        f: &str,
        grid: (usize, usize),
        block: usize,
        smem: usize,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_grid(tag, f, (grid.0, grid.1, 1), block, smem, args)
    }

    /// `launch_as` with a 3-D grid and no dynamic shared memory.
    fn launch3(
        &self,
        tag: &'static str,
        f: &str,
        grid: (usize, usize, usize),
        block: usize,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_grid(tag, f, grid, block, 0, args)
    }

    fn launch_grid(
        &self,
        tag: &'static str,
        f: &str,
        grid: (usize, usize, usize),
        block: usize,
        smem: usize,
        args: &[Arg],
    ) -> Result<()> {
        let func = self
            .funcs
            .get(f)
            .ok_or_else(|| EngineError::Invalid(format!("kernel {f} not loaded")))?;
        if self.pdl && self.profile.is_none() {
            return self.launch_pdl(func, grid, block, smem, args);
        }
        let mut b = self.stream.launch_builder(func);
        for a in args {
            match a {
                Arg::P(v) => b.arg(v),
                Arg::I(v) => b.arg(v),
                Arg::F(v) => b.arg(v),
                Arg::E(v) => b.arg(v),
                Arg::S(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
            block_dim: (block as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let start = match &self.profile {
            Some(_) => Some(
                self.stream
                    .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?,
            ),
            None => None,
        };
        // SAFETY: each call site passes the arguments of the kernel's C signature, in order,
        // and sizes its buffers for the grid it launches (`ensure`).
        unsafe { b.launch(cfg) }.w()?;
        if let (Some(rec), Some(start)) = (&self.profile, start) {
            let end = self
                .stream
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .w()?;
            rec.borrow_mut().push((tag, start, end));
        }
        Ok(())
    }

    /// `launch_grid` through `cuLaunchKernelEx` with programmatic stream serialization: the
    /// kernel may start while the previous one still runs and waits for it in `pdl_wait()`
    /// (`cuda/common.cuh`). Stream capture records this as a programmatic graph edge.
    fn launch_pdl(
        &self,
        func: &CudaFunction,
        grid: (usize, usize, usize),
        block: usize,
        smem: usize,
        args: &[Arg],
    ) -> Result<()> {
        let mut params: Vec<*mut std::ffi::c_void> = args
            .iter()
            .map(|a| match a {
                Arg::P(v) => v as *const u64 as *mut std::ffi::c_void,
                Arg::I(v) => v as *const i32 as *mut std::ffi::c_void,
                Arg::F(v) => v as *const f32 as *mut std::ffi::c_void,
                Arg::E(v) => v as *const Epi as *mut std::ffi::c_void,
                Arg::S(v) => v as *const KernelParams as *mut std::ffi::c_void,
            })
            .collect();
        // SAFETY: a zeroed attribute value is valid (all fields are plain integers)
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0 as u32,
            gridDimY: grid.1 as u32,
            gridDimZ: grid.2 as u32,
            blockDimX: block as u32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem as u32,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        self.stream.context().bind_to_thread().w()?;
        // SAFETY: `params` points at one value per parameter of the kernel's C signature, in
        // order (each call site's contract, as for `launch_grid`), alive for the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .w()?;
        Ok(())
    }

    /// `y (rows, p.n) = x (rows, p.k) @ W^T`, plus LoRA and `residual` (which may be `y`).
    /// With `norm`, x is RMS-normalized with that weight first: inside the matmul (and the
    /// LoRA A product) where the decode kernel runs and `fuse` allows, else by its own kernel.
    #[allow(clippy::too_many_arguments)]
    fn proj(
        &self,
        tag: &'static str,
        p: &Proj,
        x: u64,
        rows: usize,
        y: u64,
        residual: u64,
        norm: Option<&CudaSlice<f32>>,
        fuse: bool,
    ) -> Result<()> {
        let st = &self.stream;
        let decode = rows == 1 && p.bits == 4;
        // gate|up: the decode kernel writes SwiGLU's output to `act` directly
        let y = if p.interleaved && decode {
            ptr(&self.bufs.act, st)
        } else {
            y
        };
        let (x, nw) = match norm {
            Some(w) if decode && fuse => (x, ptr(w, st)),
            Some(w) => {
                let xn = ptr(&self.bufs.xn, st);
                self.rms_norm(x, w, xn, rows)?;
                (xn, 0)
            }
            None => (x, 0),
        };
        let mut epi = Epi {
            residual,
            swiglu: (p.interleaved && decode) as i32,
            ..Epi::default()
        };
        if let Some(l) = &p.lora {
            let t = ptr(&self.bufs.t, st);
            self.launch(
                "lora_a_f32",
                (l.rtot, rows),
                256,
                &[
                    Arg::P(x),
                    Arg::P(ptr(&l.at, st)),
                    Arg::P(t),
                    Arg::I(p.k as i32),
                    Arg::I(l.rtot as i32),
                    Arg::P(nw),
                    Arg::F(self.d.eps),
                ],
            )?;
            epi.lora_t = t;
            epi.lora_bt = ptr(&l.bt, st);
            epi.r = l.r as i32;
            epi.rtot = l.rtot as i32;
            epi.seg1 = l.seg1 as i32;
            epi.seg2 = l.seg2 as i32;
            epi.pairs = p.interleaved as i32;
        }
        let (w, s, b) = (
            ptr(&p.w.packed, st),
            ptr(&p.w.scales, st),
            ptr(&p.w.biases, st),
        );
        let (n, k) = (p.n as i32, p.k as i32);
        let (bits, gs, sd) = (p.bits as i32, p.group_size as i32, p.sdtype);
        if decode {
            let a = [
                Arg::P(x),
                Arg::P(w),
                Arg::P(s),
                Arg::P(b),
                Arg::P(y),
                Arg::I(n),
                Arg::I(k),
                Arg::I(gs),
                Arg::I(sd),
                Arg::P(nw),
                Arg::F(self.d.eps),
                Arg::E(epi),
            ];
            let s = p.decode;
            return self.launch_as(tag, s.f, (s.grid, 1), s.threads, s.smem, &a);
        }
        let q = QParams {
            m: rows as i32,
            n,
            k,
            bits,
            group_size: gs,
            sdtype: sd,
        };
        let numerics = if self.exact {
            Numerics::Exact
        } else {
            Numerics::Fast
        };
        let a = [
            Arg::P(x),
            Arg::P(w),
            Arg::P(s),
            Arg::P(b),
            Arg::P(y),
            Arg::I(rows as i32),
            Arg::I(n),
            Arg::I(k),
            Arg::I(bits),
            Arg::I(gs),
            Arg::I(sd),
            Arg::E(epi),
        ];
        match plan::matmul(&q, numerics, self.bufs.ws.len()) {
            Matmul::PromptF16 { splits } => {
                let (xh, rs, ws) = (
                    ptr(&self.bufs.xh, st),
                    ptr(&self.bufs.rs, st),
                    ptr(&self.bufs.ws, st),
                );
                self.launch_as(
                    tag,
                    "x_to_f16p",
                    (rows, 1),
                    256,
                    0,
                    &[Arg::P(x), Arg::P(xh), Arg::P(rs), Arg::I(k)],
                )?;
                let a = [
                    Arg::P(xh),
                    Arg::P(rs),
                    Arg::P(w),
                    Arg::P(s),
                    Arg::P(b),
                    Arg::P(y),
                    Arg::P(ws),
                    Arg::I(rows as i32),
                    Arg::I(n),
                    Arg::I(k),
                    Arg::I(gs),
                    Arg::I(sd),
                    Arg::I(splits as i32),
                    Arg::E(epi),
                ];
                let grid = (p.n.div_ceil(128), rows.div_ceil(64), splits);
                self.launch3(tag, "qmm4_f16", grid, 128, &a)?;
                if splits == 1 {
                    return Ok(());
                }
                self.reduce_splits(tag, rows, p.n, splits, y, epi)
            }
            Matmul::PromptTf32 { splits } if splits > 1 => {
                let ws = ptr(&self.bufs.ws, st);
                let grid = (p.n.div_ceil(64), rows.div_ceil(64) * splits);
                let sk = [
                    Arg::P(x),
                    Arg::P(w),
                    Arg::P(s),
                    Arg::P(b),
                    Arg::P(ws),
                    Arg::I(rows as i32),
                    Arg::I(n),
                    Arg::I(k),
                    Arg::I(bits),
                    Arg::I(gs),
                    Arg::I(sd),
                    Arg::I(splits as i32),
                ];
                self.launch_as(tag, "qmm_tf32_sk", grid, 128, 0, &sk)?;
                self.reduce_splits(tag, rows, p.n, splits, y, epi)
            }
            Matmul::PromptTf32 { .. } => self.launch_as(
                tag,
                "qmm_tf32",
                (p.n.div_ceil(64), rows.div_ceil(64)),
                128,
                0,
                &a,
            ),
            // one row at 4 bits took the decode kernel above
            Matmul::Rows | Matmul::Decode4 { .. } => {
                self.launch_as(tag, "qmv_f32", (p.n.div_ceil(8), 1), 256, 0, &a)
            }
        }
    }

    /// `y (rows, n) = epilogue(sum of the split-K partials in ws)`: `qmm_reduce`.
    fn reduce_splits(
        &self,
        tag: &'static str,
        rows: usize,
        n: usize,
        splits: usize,
        y: u64,
        epi: Epi,
    ) -> Result<()> {
        let red = [
            Arg::P(ptr(&self.bufs.ws, &self.stream)),
            Arg::P(y),
            Arg::I(rows as i32),
            Arg::I(n as i32),
            Arg::I(splits as i32),
            Arg::E(epi),
        ];
        let grid = ((rows * n).div_ceil(256), 1);
        self.launch_as(tag, "qmm_reduce", grid, 256, 0, &red)
    }

    fn rms_norm(&self, src: u64, w: &CudaSlice<f32>, dst: u64, rows: usize) -> Result<()> {
        let a = [
            Arg::P(src),
            Arg::P(ptr(w, &self.stream)),
            Arg::P(dst),
            Arg::I(self.d.h as i32),
            Arg::F(self.d.eps),
        ];
        self.launch("rms_norm_f32", (rows, 1), 256, &a)
    }

    /// Every kernel of a forward over `m` rows, in order, on the stream; with `sample`, the
    /// sampler after the head (on the last row's logits, which it penalizes in place).
    fn issue(
        &self,
        m: usize,
        all_logits: bool,
        mut hidden: Option<&mut Vec<Vec<f32>>>,
        sample: Option<KernelParams>,
    ) -> Result<()> {
        let (d, st) = (self.d, &self.stream);
        let b = &self.bufs;
        let (x, xn, qkv, ao, gu, act) = (
            ptr(&b.x, st),
            ptr(&b.xn, st),
            ptr(&b.qkv, st),
            ptr(&b.ao, st),
            ptr(&b.gu, st),
            ptr(&b.act, st),
        );
        let pos = ptr(&self.pos, st);
        let e = &self.embed;
        self.launch(
            "qgather_f32",
            ((d.h / 16).div_ceil(128), m),
            128,
            &[
                Arg::P(ptr(&b.ids, st)),
                Arg::P(ptr(&e.w.packed, st)),
                Arg::P(ptr(&e.w.scales, st)),
                Arg::P(ptr(&e.w.biases, st)),
                Arg::P(x),
                Arg::I(d.h as i32),
                Arg::I(e.bits as i32),
                Arg::I(e.group_size as i32),
                Arg::I(e.sdtype),
            ],
        )?;
        let keep =
            |h: &mut Option<&mut Vec<Vec<f32>>>, src: &CudaSlice<f32>, n: usize| -> Result<()> {
                if let Some(h) = h {
                    let mut v = vec![0f32; n];
                    st.memcpy_dtoh(&src.slice(0..n), &mut v).w()?;
                    st.synchronize().w()?;
                    h.push(v);
                }
                Ok(())
            };
        keep(&mut hidden, &b.x, m * d.h)?;
        // the final norm's output is a hidden state, so it is materialized when kept
        let fuse = hidden.is_none();
        let half = d.hd / 2;
        let (attention, attention_decode) = match d.hd {
            32 => ("attention_f32_hd32", "attention_decode_hd32"),
            64 => ("attention_f32_hd64", "attention_decode_hd64"),
            128 => ("attention_f32_hd128", "attention_decode_hd128"),
            _ => ("attention_f32_hd256", "attention_decode_hd256"),
        };
        let scale = (d.hd as f32).powf(-0.5);
        for (i, l) in self.layers.iter().enumerate() {
            self.proj("qkv_proj", &l.qkv, x, m, qkv, 0, Some(&l.in_norm), fuse)?;
            let (kc, vc) = (ptr(&self.cache.k[i], st), ptr(&self.cache.v[i], st));
            let (qn, kn) = (ptr(&l.q_norm, st), ptr(&l.k_norm, st));
            let (cos, sin) = (ptr(&self.cache.cos, st), ptr(&self.cache.sin, st));
            if m == 1 {
                // q/k norms, RoPE and the cache write happen inside the decode attention
                self.launch_as(
                    "attention (+ q/k norm, RoPE, cache write)",
                    attention_decode,
                    (d.nh, ATT_SPLITS),
                    256,
                    0,
                    &[
                        Arg::P(qkv),
                        Arg::P(qn),
                        Arg::P(kn),
                        Arg::P(kc),
                        Arg::P(vc),
                        Arg::P(cos),
                        Arg::P(sin),
                        Arg::P(ao),
                        Arg::P(pos),
                        Arg::I(d.nh as i32),
                        Arg::I(d.nkv as i32),
                        Arg::F(scale),
                        Arg::F(d.eps),
                        Arg::P(ptr(&b.att_ws, st)),
                        Arg::P(ptr(&b.att_cnt, st)),
                    ],
                )?;
            } else {
                self.launch(
                    "qk_norm_rope_cache",
                    (d.nh + d.nkv, m),
                    half.next_multiple_of(32),
                    &[
                        Arg::P(qkv),
                        Arg::P(qn),
                        Arg::P(kn),
                        Arg::P(kc),
                        Arg::P(vc),
                        Arg::P(cos),
                        Arg::P(sin),
                        Arg::P(pos),
                        Arg::I(d.nh as i32),
                        Arg::I(d.nkv as i32),
                        Arg::I(d.hd as i32),
                        Arg::F(d.eps),
                    ],
                )?;
                self.launch_as(
                    "attention",
                    attention,
                    (d.nh, m),
                    256,
                    0,
                    &[
                        Arg::P(qkv),
                        Arg::P(kc),
                        Arg::P(vc),
                        Arg::P(ao),
                        Arg::P(pos),
                        Arg::I(d.nh as i32),
                        Arg::I(d.nkv as i32),
                        Arg::F(scale),
                    ],
                )?;
            }
            self.proj("o_proj", &l.o, ao, m, x, x, None, fuse)?;
            self.proj("gate_up_proj", &l.gu, x, m, gu, 0, Some(&l.post_norm), fuse)?;
            if !(m == 1 && l.gu.bits == 4) {
                let total = m * d.inter;
                self.launch(
                    "swiglu_f32",
                    (total.div_ceil(256), 1),
                    256,
                    &[
                        Arg::P(gu),
                        Arg::P(act),
                        Arg::I(d.inter as i32),
                        Arg::I(total as i32),
                    ],
                )?;
            }
            self.proj("down_proj", &l.down, act, m, x, x, None, fuse)?;
            keep(&mut hidden, &b.x, m * d.h)?;
        }
        let rows = if all_logits { m } else { 1 };
        let last = x + ((m - rows) * d.h * 4) as u64;
        if !fuse {
            self.rms_norm(last, &self.norm, xn, rows)?;
            keep(&mut hidden, &b.xn, rows * d.h)?;
            self.proj(
                "lm_head",
                &self.head,
                xn,
                rows,
                ptr(&b.logits, st),
                0,
                None,
                fuse,
            )?;
            return match sample {
                Some(p) => self.sample(p),
                None => Ok(()),
            };
        }
        self.proj(
            "lm_head",
            &self.head,
            last,
            rows,
            ptr(&b.logits, st),
            0,
            Some(&self.norm),
            fuse,
        )?;
        match sample {
            Some(p) => self.sample(p),
            None => Ok(()),
        }
    }

    /// `sample_f32` on the last row of logits (one block; `kernels/sample.h`).
    fn sample(&self, p: KernelParams) -> Result<()> {
        let st = &self.stream;
        let logits = ptr(&self.bufs.logits, st);
        let out = ptr(&self.sample_out, st);
        self.launch_as(
            "sample",
            sample::KERNEL,
            (1, 1),
            sample::THREADS,
            0,
            &[
                Arg::P(logits),
                Arg::P(logits),
                Arg::I(self.d.vocab as i32),
                Arg::S(p),
                Arg::P(ptr(&self.sample_state, st)),
                Arg::P(out),
                Arg::P(out),
                Arg::I(0),
            ],
        )
    }
}

impl Proj {
    fn single(dev: &CudaDevice, q: &QMatrix) -> Result<Self> {
        Ok(Proj {
            w: resident(q, dev)?,
            n: q.rows,
            k: q.cols,
            bits: q.params.bits,
            group_size: q.params.group_size,
            sdtype: q.scales.kernel_code(),
            lora: None,
            interleaved: false,
            decode: DecodeShape::default(),
        })
    }

    /// Projections sharing their input, their weights concatenated by output rows, or with
    /// `interleave` (parts of equal size) alternating row by row.
    fn new(dev: &CudaDevice, parts: &[&Linear], interleave: bool) -> Result<Self> {
        let qs: Vec<&QMatrix> = parts
            .iter()
            .map(|l| quant(&l.weight).map(|a| a.as_ref()))
            .collect::<Option<_>>()
            .ok_or_else(|| EngineError::Invalid("fused step: dense projection".into()))?;
        let interleave = interleave && qs.len() > 1 && qs.iter().all(|q| q.rows == qs[0].rows);
        let lora = ProjLora::new(dev, parts, &qs, interleave)?;
        if qs.len() == 1 {
            return Ok(Proj {
                lora,
                ..Proj::single(dev, qs[0])?
            });
        }
        // Each matrix's rows are `bytes.len() / rows` bytes of codes, scales or biases.
        let cat = |f: &dyn Fn(&QMatrix) -> &[u8]| -> Result<CudaSlice<u8>> {
            let mut v = Vec::with_capacity(qs.iter().map(|q| f(q).len()).sum());
            if interleave {
                let rb = f(qs[0]).len() / qs[0].rows;
                for i in 0..qs[0].rows {
                    for q in &qs {
                        v.extend_from_slice(&f(q)[i * rb..(i + 1) * rb]);
                    }
                }
            } else {
                for q in &qs {
                    v.extend_from_slice(f(q));
                }
            }
            Ok(dev.clone_htod(&v)?)
        };
        let w = GpuQMatrix {
            packed: cat(&|q| &q.packed[..])?,
            scales: cat(&|q| &q.scales.bytes[..])?,
            biases: cat(&|q| &q.biases.bytes[..])?,
        };
        Ok(Proj {
            w: Arc::new(w),
            n: qs.iter().map(|q| q.rows).sum(),
            lora,
            interleaved: interleave,
            ..Proj::single(dev, qs[0])?
        })
    }
}

impl ProjLora {
    fn new(
        dev: &CudaDevice,
        parts: &[&Linear],
        qs: &[&QMatrix],
        interleave: bool,
    ) -> Result<Option<Self>> {
        let branches: Vec<Option<&LoraBranch>> = parts.iter().map(|l| l.lora.as_ref()).collect();
        if branches.iter().all(Option::is_none) {
            return Ok(None);
        }
        let k = qs[0].cols;
        let n: usize = qs.iter().map(|q| q.rows).sum();
        let r = branches
            .iter()
            .flatten()
            .map(|b| b.a.dim(1))
            .collect::<candle_core::Result<Vec<_>>>()?
            .into_iter()
            .max()
            .unwrap_or(1);
        let rtot = r * parts.len();
        let mut at = vec![0f32; rtot * k];
        let mut bt = vec![0f32; n * r];
        let mut off = 0;
        for (i, (b, q)) in branches.iter().zip(qs).enumerate() {
            if let Some(b) = b {
                let a = b.a.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?; // (k, ri)
                let bm = b.b.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?; // (ri, rows)
                for (kk, row) in a.iter().enumerate() {
                    for (j, v) in row.iter().enumerate() {
                        at[(i * r + j) * k + kk] = *v;
                    }
                }
                for (j, row) in bm.iter().enumerate() {
                    for (nn, v) in row.iter().enumerate() {
                        let out = if interleave {
                            nn * parts.len() + i
                        } else {
                            off + nn
                        };
                        bt[out * r + j] = (*v as f64 * b.scale) as f32;
                    }
                }
            }
            off += q.rows;
        }
        let seg = |i: usize| qs.iter().take(i).map(|q| q.rows).sum::<usize>().min(n);
        Ok(Some(ProjLora {
            at: dev.clone_htod(&at)?,
            bt: dev.clone_htod(&bt)?,
            r,
            rtot,
            seg1: if parts.len() > 1 { seg(1) } else { n },
            seg2: if parts.len() > 2 { seg(2) } else { n },
        }))
    }
}

impl Buffers {
    fn new(dev: &CudaDevice, d: &Dims, rows: usize, rtot: usize) -> Result<Self> {
        let z = |n: usize| dev.alloc_zeros::<f32>(n);
        Ok(Buffers {
            rows,
            x: z(rows * d.h)?,
            xn: z(rows * d.h)?,
            qkv: z(rows * d.qkv())?,
            ao: z(rows * d.nh * d.hd)?,
            gu: z(rows * 2 * d.inter)?,
            act: z(rows * d.inter)?,
            t: z(rows * rtot)?,
            ws: z(d.split_workspace(rows).max(1))?,
            xh: dev.alloc_zeros::<u16>(rows * d.h.max(d.inter).max(d.nh * d.hd))?,
            rs: z(rows)?,
            att_ws: z(d.nh * ATT_SPLITS * (d.hd + 2))?,
            att_cnt: dev.alloc_zeros::<u32>(d.nh)?,
            logits: z(d.vocab)?,
            ids: dev.alloc_zeros::<u32>(rows)?,
        })
    }
}

impl Cache {
    fn new(dev: &CudaDevice, d: &Dims, layers: usize, cap: usize) -> Result<Self> {
        let per = cap * d.nkv * d.hd;
        let (cos, sin) = rope_tables(d, cap);
        Ok(Cache {
            cap,
            k: (0..layers)
                .map(|_| dev.alloc_zeros::<f32>(per))
                .collect::<candle_core::Result<_>>()?,
            v: (0..layers)
                .map(|_| dev.alloc_zeros::<f32>(per))
                .collect::<candle_core::Result<_>>()?,
            cos: dev.clone_htod(&cos)?,
            sin: dev.clone_htod(&sin)?,
        })
    }
}
