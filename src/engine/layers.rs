//! The model's building blocks, apart from how Qwen3 wires them (`qwen3.rs`): the run-time
//! options, a weight in any of its forms (MLX-quantized, repacked, dense), a bias-free
//! projection with its LoRA branch, the embedding, RoPE's angles, and the read-only view of a
//! loaded model that the fused CUDA step builds its buffers from.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};

use crate::engine::config::Qwen3Config;
use crate::engine::cpu::team::{Ahead, Ready};
use crate::engine::error::{EngineError, Result};
use crate::engine::lora::{Adapter, LoraBranch};
use crate::engine::profile::{self, Part};
use crate::engine::quant::op::{qmatmul, QGather};
use crate::engine::quant::repack;
use crate::engine::quant::{Numerics, QMatrix};
use crate::engine::weights::WeightStore;

/// Run-time choices that do not change the model.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    pub device: Device,
    pub kernel: Numerics,
    pub route: QMatmulRoute,
    pub cuda_step: CudaStep,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            device: Device::Cpu,
            kernel: Numerics::Exact,
            route: QMatmulRoute::Native,
            cuda_step: CudaStep::Graph,
        }
    }
}

/// How a forward runs on CUDA (other devices always run candle ops).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CudaStep {
    /// Our fused step (`cuda/fused.rs`), decode steps replayed from a captured CUDA graph
    #[default]
    Graph,
    /// Our fused step, every kernel launched from the host
    Eager,
    /// candle ops around our quantized matmul (the reference path)
    Ops,
}

/// Which kernels run the quantized projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum QMatmulRoute {
    /// Our fused kernels on the MLX layout (every width and group size)
    #[default]
    Native,
    /// Repack 4-bit weights to candle's Q4_1 at load time and run candle's kernels
    /// (other widths, and values f16 cannot hold exactly, stay native)
    Repack,
}

/// A weight matrix [out, in]: MLX-quantized, repacked to candle's Q4_1, or dense (modules
/// mlx_lm left unquantized).
#[derive(Debug, Clone)]
pub enum Weight {
    Quant(Arc<QMatrix>),
    Repacked {
        mm: Arc<candle_core::quantized::QMatMul>,
        nbytes: usize,
    },
    Dense(Tensor),
}

impl Weight {
    pub(crate) fn load(
        store: &WeightStore,
        cfg: &Qwen3Config,
        name: &str,
        out: usize,
        inp: usize,
        dev: &Device,
    ) -> Result<Self> {
        match cfg.quant_for(store, name, inp)? {
            Some(params) => Ok(Weight::Quant(Arc::new(QMatrix::from_tensors(
                name,
                out,
                inp,
                params,
                store.require(&format!("{name}.weight"))?,
                store.require(&format!("{name}.scales"))?,
                store.require(&format!("{name}.biases"))?,
            )?))),
            None => {
                let w = store.require(&format!("{name}.weight"))?;
                if w.dtype == crate::engine::weights::Dtype::U32 {
                    return Err(EngineError::MissingTensor {
                        dir: store.dir.clone(),
                        name: format!("{name}.scales"),
                        hint: format!(
                            "`{name}.weight` holds packed U32 codes, which need scales and biases"
                        ),
                    });
                }
                w.expect_shape(&[out, inp])?;
                Ok(Weight::Dense(w.to_candle_f32(dev)?))
            }
        }
    }

    /// Bytes one pass over the weight reads.
    pub fn nbytes(&self) -> usize {
        match self {
            Weight::Quant(q) => q.nbytes(),
            Weight::Repacked { nbytes, .. } => *nbytes,
            Weight::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
        }
    }

    /// The weight as `route` wants it for a projection; the repack keeps the native layout
    /// for matrices it cannot represent exactly (`Qwen3::new` notes how many).
    pub(crate) fn routed(self, opts: &ModelOptions) -> Result<Self> {
        match (&self, opts.route) {
            (Weight::Quant(q), QMatmulRoute::Repack) => {
                Ok(Self::repacked(q, &opts.device)?.unwrap_or(self))
            }
            _ => Ok(self),
        }
    }

    /// The weight on the verified route, for a device whose own kernels failed the self-test
    /// (`metal::selftest`): candle's Q4_1 where the repack is exact, else dense f32.
    pub(crate) fn verified(&self, dev: &Device) -> Result<Self> {
        let Weight::Quant(q) = self else {
            return Ok(self.clone());
        };
        match Self::repacked(q, dev)? {
            Some(w) => Ok(w),
            None => Ok(Weight::Dense(Tensor::from_vec(
                q.dequantize(),
                (q.rows, q.cols),
                dev,
            )?)),
        }
    }

    /// `q` on candle's Q4_1 kernels; `None` where the repack cannot hold it exactly.
    fn repacked(q: &QMatrix, dev: &Device) -> Result<Option<Self>> {
        Ok(repack::qmatmul(q, dev)?.ok().map(|mm| Weight::Repacked {
            mm: Arc::new(mm),
            nbytes: q.rows * q.cols / 32 * repack::Q4_1_BLOCK_BYTES,
        }))
    }

    pub fn is_native(&self) -> bool {
        matches!(self, Weight::Quant(_))
    }
}

/// A bias-free projection with an optional LoRA branch.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Weight,
    pub lora: Option<LoraBranch>,
    pub(crate) kernel: Numerics,
    pub(crate) part: Part,
}

impl Linear {
    pub(crate) fn new(
        store: &WeightStore,
        cfg: &Qwen3Config,
        name: &str,
        out: usize,
        inp: usize,
        adapter: &mut Option<Adapter>,
        opts: &ModelOptions,
    ) -> Result<Self> {
        let weight = Weight::load(store, cfg, name, out, inp, &opts.device)?.routed(opts)?;
        let lora = match adapter {
            Some(a) => a.take(name, inp, out)?,
            None => None,
        };
        // `exact` keeps the adapter's f32; the kernels that round activations take f16 copies
        let lora = lora.map(|b| match opts.kernel {
            Numerics::Exact => b,
            Numerics::Fast | Numerics::Int8 => b.halved(),
        });
        Ok(Linear {
            weight,
            lora,
            kernel: opts.kernel,
            part: Part::Projections,
        })
    }

    /// `forward` of each of `ls` on the same `x`. On the CPU, where `qmatmul_shared` has a path
    /// (a decode row on the integer kernel, a `fast` prompt on an integer GEMM), they run as one
    /// call: the input quantized once, one hand-off to the workers; anything else, one
    /// `forward` each.
    pub fn forward_shared<const N: usize>(ls: [&Linear; N], x: &Tensor) -> Result<[Tensor; N]> {
        if let Some(ys) = Self::try_shared(&ls, x)? {
            return Ok(ys);
        }
        Self::forward_each(ls, x)
    }

    /// `forward` of each of `ls` on the same `x`, one after the other (where `shared_host` has
    /// no path).
    pub(crate) fn forward_each<const N: usize>(
        ls: [&Linear; N],
        x: &Tensor,
    ) -> Result<[Tensor; N]> {
        let mut out = Vec::with_capacity(N);
        for l in ls {
            out.push(l.forward(x)?);
        }
        out.try_into()
            .map_err(|_| EngineError::Internal("forward_each: wrong count".into()))
    }

    fn try_shared<const N: usize>(ls: &[&Linear; N], x: &Tensor) -> Result<Option<[Tensor; N]>> {
        let Some(ys) = Self::shared_host(ls, x)? else {
            return Ok(None);
        };
        let m = x.dim(0)?;
        let mut out = Vec::with_capacity(N);
        for y in ys {
            let n = y.len() / m.max(1);
            out.push(Tensor::from_vec(y, (m, n), x.device())?);
        }
        Ok(out.try_into().ok())
    }

    /// `forward_shared`'s CPU path with the outputs as host vectors, each (L, out) row-major,
    /// LoRA added: `None` where it has none (not the CPU or f32 rows, or a matrix the shared
    /// kernels do not take), for the caller to run `forward_each`. `x` is read where it
    /// lies, not copied out of its tensor first.
    pub(crate) fn shared_host<const N: usize>(
        ls: &[&Linear; N],
        x: &Tensor,
    ) -> Result<Option<[Vec<f32>; N]>> {
        let kernel = ls[0].kernel;
        if !x.device().is_cpu() || x.dtype() != candle_core::DType::F32 || x.rank() != 2 {
            return Ok(None);
        }
        let m = x.dim(0)?;
        let mut ws = Vec::with_capacity(N);
        for l in ls {
            match &l.weight {
                Weight::Quant(q) if l.kernel == kernel => ws.push(q.as_ref()),
                _ => return Ok(None),
            }
        }
        let t = Instant::now();
        let x = x.contiguous()?;
        // the branches a host pass could not add, added through tensors once `x` is released
        let mut by_tensor = Vec::new();
        let mut ys = {
            let (storage, layout) = x.storage_and_layout();
            let candle_core::Storage::Cpu(cs) = &*storage else {
                return Ok(None);
            };
            let xs = crate::engine::cpu::host_f32("forward_shared", cs, layout)?;
            if m == 1 && ls.iter().any(|l| l.lora.is_some()) {
                if let Some(ys) = Self::matvec_with_lora(ls, &ws, xs, kernel) {
                    return Ok(ys.try_into().ok());
                }
            }
            let Some(mut ys) = crate::engine::cpu::quant::qmatmul_shared(&ws, xs, m, kernel) else {
                return Ok(None);
            };
            profile::add(ls[0].part, t);
            for (i, (l, y)) in ls.iter().zip(&mut ys).enumerate() {
                let Some(b) = &l.lora else { continue };
                let t = Instant::now();
                if !b.add_rows(xs, y) {
                    by_tensor.push(i);
                }
                profile::add(Part::Lora, t);
            }
            ys
        };
        for i in by_tensor {
            let (Some(b), y) = (&ls[i].lora, &mut ys[i]) else {
                continue;
            };
            let t = Instant::now();
            let n = y.len() / m.max(1);
            let yt = Tensor::from_vec(std::mem::take(y), (m, n), x.device())?;
            *y = b.add_to(&x, yt)?.flatten_all()?.to_vec1::<f32>()?;
            profile::add(Part::Lora, t);
        }
        Ok(ys.try_into().ok())
    }

    /// What a decode step's region over these projections (one, or several sharing their
    /// input) reads first, for the team to read ahead (`cpu::team::read_ahead`): the LoRA
    /// branches' `a` matrices (the region's first tasks, `x @ a`, read them), then the
    /// matmul's first tasks; empty for weights the CPU's quantized kernel does not run.
    pub(crate) fn lead_in(ls: &[&Linear]) -> Ahead {
        let mut ws = Vec::with_capacity(ls.len());
        for l in ls {
            match &l.weight {
                Weight::Quant(q) => ws.push(q.as_ref()),
                _ => return Ahead::default(),
            }
        }
        let a = ls
            .iter()
            .filter_map(|l| l.lora.as_ref()?.host_parts().map(|(a, _, _)| a.range()));
        Ahead::before_ranges(a, crate::engine::cpu::quant::decode_lead_in(&ws))
    }

    /// A decode row through quantized projections some of which carry LoRA branches, both
    /// halves of each branch inside the matmul's region: `scale · (x @ a)` as its first tasks,
    /// a piece of the input each (`lora::FirstHalves`), then `@ b` in each task, added to the
    /// rows it computed. Both stream on every thread beside the weights; the leading thread
    /// alone ran the first half between regions before (`--synthetic-lora`, 0.6B, 2 threads:
    /// 4.4% of a decode step, the helper idle meanwhile). (The bench's time split counts both
    /// as projections.) `None` when a branch has no host copies or the kernel takes another
    /// path.
    fn matvec_with_lora(
        ls: &[&Linear],
        ws: &[&QMatrix],
        xs: &[f32],
        kernel: Numerics,
    ) -> Option<Vec<Vec<f32>>> {
        let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; w.rows]).collect();
        let outs = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
        let mut acts = crate::engine::cpu::quant::IntActs::default();
        Self::matvec_into(ls, ws, xs, kernel, &mut acts, outs).then_some(ys)
    }

    /// `matvec_with_lora` into the caller's buffers (`quant::qmatvec_shared_into`), for any
    /// mix of branches (none too); `false`, nothing written, where it does not apply.
    fn matvec_into(
        ls: &[&Linear],
        ws: &[&QMatrix],
        xs: &[f32],
        kernel: Numerics,
        acts: &mut crate::engine::cpu::quant::IntActs,
        ys: Vec<&mut [f32]>,
    ) -> bool {
        if !crate::engine::cpu::quant::decode_shared_ok(ws, xs.len(), kernel) {
            // e.g. f32 activations (`exact`): `qmatmul`'s path, with the branch after it
            return false;
        }
        // per matrix: its branch's index among the region's and its `b` in blocks
        let mut second = Vec::with_capacity(ls.len());
        let mut firsts = Vec::new();
        for (l, w) in ls.iter().zip(ws) {
            second.push(match &l.lora {
                None => None,
                Some(br) => {
                    let Some((a, b, scale)) = br.host_parts() else {
                        return false;
                    };
                    // the adapter's shapes were checked against the model's at load
                    let r = a.len() / xs.len();
                    if a.len() % xs.len() != 0
                        || b.len() != crate::engine::lora::blocked_len(r, w.rows)
                    {
                        return false;
                    }
                    firsts.push((a, scale));
                    Some((firsts.len() - 1, b))
                }
            });
        }
        let Some(halves) = crate::engine::lora::FirstHalves::new(xs, &firsts) else {
            return false;
        };
        let pre = |p: usize| halves.piece(p);
        let then = |i: usize, first: usize, outs: &mut [f32], ready: &Ready| {
            if let Some((k, b)) = second[i] {
                ready.wait();
                crate::engine::lora::add_b(b, &halves.first_half(k), first, outs);
            }
        };
        let warm = |i: usize, first: usize, outs: &mut [f32]| {
            if let Some((k, b)) = second[i] {
                let r = firsts[k].0.len() / xs.len();
                let rows = first..first + outs.len();
                b.blocks_of(r, rows).prefetch();
            }
        };
        let extra = (!firsts.is_empty()).then_some(crate::engine::cpu::quant::Extra {
            pre_tasks: halves.pieces(),
            pre: &pre,
            warm: &warm,
            then: &then,
        });
        let t = Instant::now();
        let done = crate::engine::cpu::quant::qmatvec_shared_into(ws, xs, kernel, extra, acts, ys);
        profile::add(ls[0].part, t);
        done
    }

    /// `forward_shared` of `m` rows on host slices, into `ys` (`m` rows of each of `ls`'s
    /// outputs, row-major): the CPU's host passes (`Qwen3::forward_host`). A decode row's
    /// integer kernel writes there directly, LoRA branches included; a prompt's shared GEMM
    /// too (`quant::qmatmul_shared_into`), its branches added on the host where
    /// `LoraBranch::add_rows` can, else through tensors as `shared_host` does; anything else
    /// goes through `forward_shared` and is copied over.
    pub(crate) fn forward_host<const N: usize>(
        ls: [&Linear; N],
        x: &[f32],
        m: usize,
        acts: &mut crate::engine::cpu::quant::IntActs,
        ys: [&mut [f32]; N],
    ) -> Result<()> {
        let kernel = ls[0].kernel;
        let ws: Option<Vec<&QMatrix>> = ls
            .iter()
            .map(|l| match &l.weight {
                Weight::Quant(q) if l.kernel == kernel => Some(q.as_ref()),
                _ => None,
            })
            .collect();
        let mut ys = ys;
        if let (Some(ws), 1) = (&ws, m) {
            let outs = ys.iter_mut().map(|y| &mut **y).collect();
            if Self::matvec_into(&ls, ws, x, kernel, acts, outs) {
                return Ok(());
            }
        }
        let t = Instant::now();
        let shared = ws.as_ref().is_some_and(|ws| {
            crate::engine::cpu::quant::qmatmul_shared_into(ws, x, m, kernel, &mut ys)
        });
        if shared {
            profile::add(ls[0].part, t);
            for (l, y) in ls.iter().zip(ys.iter_mut()) {
                let Some(b) = &l.lora else { continue };
                let t = Instant::now();
                if !b.add_rows(x, y) {
                    let n = y.len() / m;
                    let xt = Tensor::from_slice(x, (m, x.len() / m), &Device::Cpu)?;
                    let yt = Tensor::from_slice(y, (m, n), &Device::Cpu)?;
                    y.copy_from_slice(&b.add_to(&xt, yt)?.flatten_all()?.to_vec1::<f32>()?);
                }
                profile::add(Part::Lora, t);
            }
            return Ok(());
        }
        let xt = Tensor::from_slice(x, (m, x.len() / m.max(1)), &Device::Cpu)?;
        for (y, t) in ys.iter_mut().zip(Self::forward_shared(ls, &xt)?) {
            let t = t.flatten_all()?.to_dtype(candle_core::DType::F32)?;
            if t.dim(0)? != y.len() {
                return Err(EngineError::Internal(format!(
                    "forward_host: {} outputs for a buffer of {}",
                    t.dim(0)?,
                    y.len()
                )));
            }
            y.copy_from_slice(&t.to_vec1::<f32>()?);
        }
        Ok(())
    }

    /// (L, in) -> (L, out)
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = self.forward_host_lora(x)? {
            return Ok(y);
        }
        let t = Instant::now();
        let y = match &self.weight {
            Weight::Quant(q) => qmatmul(x, q, self.kernel)?,
            Weight::Repacked { mm, .. } => candle_core::Module::forward(mm.as_ref(), x)?,
            Weight::Dense(w) => x.matmul(&w.t()?)?,
        };
        profile::add(self.part, t);
        match &self.lora {
            Some(l) => {
                let t = Instant::now();
                let y = l.add_to(x, y)?;
                profile::add(Part::Lora, t);
                Ok(y)
            }
            None => Ok(y),
        }
    }

    /// A decode-sized CPU input to a quantized matrix with a LoRA branch: the matmul and the
    /// branch on host slices, one tensor made at the end (`forward`'s arithmetic, without the
    /// branch's copies in and out of tensors). `None` where that does not apply.
    fn forward_host_lora(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let (Weight::Quant(q), Some(b)) = (&self.weight, &self.lora) else {
            return Ok(None);
        };
        if !x.device().is_cpu()
            || x.dtype() != candle_core::DType::F32
            || x.rank() != 2
            || x.dim(1)? != q.cols
        {
            return Ok(None);
        }
        let m = x.dim(0)?;
        if m > crate::engine::lora::HOST_MAX_ROWS {
            return Ok(None);
        }
        let t = Instant::now();
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        if m == 1 {
            if let Some(mut ys) = Self::matvec_with_lora(&[self], &[q.as_ref()], &xs, self.kernel) {
                let y = ys.pop().unwrap_or_default();
                return Ok(Some(Tensor::from_vec(y, (1, q.rows), x.device())?));
            }
        }
        let mut y = vec![0f32; m * q.rows];
        crate::engine::cpu::quant::qmatmul(q, &xs, m, &mut y, self.kernel);
        profile::add(self.part, t);
        let t = Instant::now();
        let host = b.add_rows(&xs, &mut y);
        let y = Tensor::from_vec(y, (m, q.rows), x.device())?;
        let y = if host { y } else { b.add_to(x, y)? };
        profile::add(Part::Lora, t);
        Ok(Some(y))
    }
}

/// Token embedding; a quantized table is gathered row by row and only those rows dequantized.
#[derive(Debug, Clone)]
pub struct Embedding {
    pub weight: Weight,
    /// Gather on the CPU and copy the rows over: the verified route where the device's own
    /// gather kernel failed the self-test.
    pub on_host: bool,
}

impl Embedding {
    /// ids -> (L, H) on `dev`
    pub fn forward(&self, ids: &[u32], dev: &Device) -> Result<Tensor> {
        match &self.weight {
            Weight::Quant(q) => {
                if let Some(&id) = ids.iter().find(|&&id| id as usize >= q.rows) {
                    return Err(EngineError::TokenOutOfRange { id, vocab: q.rows });
                }
                let gather = QGather { w: q.clone() };
                if self.on_host {
                    let idx = Tensor::new(ids, &Device::Cpu)?;
                    return Ok(idx.apply_op1_no_bwd(&gather)?.to_device(dev)?);
                }
                Ok(Tensor::new(ids, dev)?.apply_op1_no_bwd(&gather)?)
            }
            Weight::Dense(t) => {
                let idx = Tensor::new(ids, t.device())?;
                Ok(t.index_select(&idx, 0)?.to_device(dev)?)
            }
            Weight::Repacked { .. } => Err(EngineError::Internal(
                "the embedding table is gathered natively, never repacked".into(),
            )),
        }
    }
}

/// cos and sin of RoPE's angles for `positions`, `(positions, head_dim / 2)` row-major, the
/// half-split layout mlx_lm's `nn.RoPE(traditional=False)` uses. Every path (candle ops, the
/// CPU attention, the fused CUDA step) takes its tables from here.
pub(crate) fn rope_angles(
    theta: f64,
    head_dim: usize,
    positions: std::ops::Range<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for p in positions {
        for i in 0..half {
            // inv_freq = theta^(-2i/d), computed in f64 so the table is exact to f32
            let angle = p as f64 * theta.powf(-(2.0 * i as f64) / head_dim as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// One decoder layer as the fused step reads it: q, k, v, o, gate, up, down; then the input,
/// post-attention, q and k norm weights.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct LayerView<'a> {
    pub linears: [&'a Linear; 7],
    pub norms: [&'a Tensor; 4],
}

/// A loaded model's weights, read-only, for the fused step (which so depends on these blocks,
/// not on the model that owns them).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct ModelView<'a> {
    pub cfg: &'a Qwen3Config,
    pub embed: &'a Weight,
    pub layers: Vec<LayerView<'a>>,
    pub norm: &'a Tensor,
    pub lm_head: &'a Linear,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl ModelView<'_> {
    /// Every layer projection's weight.
    pub fn projections(&self) -> impl Iterator<Item = &Weight> + '_ {
        self.layers
            .iter()
            .flat_map(|l| l.linears.iter().map(|l| &l.weight))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::quant::testutil::random_qmatrix;
    use crate::engine::weights::Dtype;

    /// A decode row through q|k|v-like projections sharing their input, two with LoRA
    /// branches (ranks 8 and 3, copies in f32 and in f16, an input of three `lora::PIECE`s,
    /// row counts that cut the branches' blocks of `b` mid-block): on a team (both halves of
    /// each branch inside the region) and on rayon, the bits of the matmul alone plus
    /// `lora::add_host`.
    #[test]
    fn lora_in_the_region_gives_the_serial_bits() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let cols = 2560;
        let mut v = |n: usize| {
            (0..n)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect::<Vec<_>>()
        };
        let x = v(cols);
        let rows = [1004, 302, 508];
        let mut ls = Vec::new();
        for (i, (&n, r)) in rows.iter().zip([Some(8), None, Some(3)]).enumerate() {
            let w = Arc::new(random_qmatrix(n, cols, 4, 64, Dtype::BF16, i as u64 + 1));
            let lora = r.map(|r| {
                let a = Tensor::from_vec(v(cols * r), (cols, r), &Device::Cpu).expect("a");
                let b = Tensor::from_vec(v(r * n), (r, n), &Device::Cpu).expect("b");
                let branch = LoraBranch::new(a, b, 4.0).expect("branch");
                // one branch's copies in f32, the other's in f16 (`fast`'s): one region
                if r == 3 {
                    branch.halved()
                } else {
                    branch
                }
            });
            ls.push(Linear {
                weight: Weight::Quant(w),
                lora,
                kernel: Numerics::Fast,
                part: Part::Projections,
            });
        }
        assert!(matches!(
            ls[2].lora.as_ref().and_then(|b| b.host_parts()),
            Some((
                crate::engine::lora::Stored::F16(_),
                crate::engine::lora::Stored::F16(_),
                _
            ))
        ));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        // the pass under test: the three linears' decode row through `forward_host`
        let host_pass = || {
            let mut ys: Vec<Vec<f32>> = rows.iter().map(|&n| vec![0f32; n]).collect();
            let [y0, y1, y2] = &mut ys[..] else {
                unreachable!()
            };
            let mut acts = crate::engine::cpu::quant::IntActs::default();
            Linear::forward_host([&ls[0], &ls[1], &ls[2]], &x, 1, &mut acts, [y0, y1, y2])
                .expect("forward_host");
            ys
        };
        let Weight::Quant(q0) = &ls[0].weight else {
            unreachable!()
        };
        if !crate::engine::cpu::quant::decode_shared_ok(&[q0], cols, Numerics::Fast) {
            // No integer kernel (`BOT_CPU_ISA=scalar`): no region either; the host pass must
            // then give what each linear's tensor pass gives.
            assert_eq!(
                crate::engine::cpu::isa::active(),
                crate::engine::cpu::isa::Isa::Scalar
            );
            let xt = Tensor::from_slice(&x, (1, cols), &Device::Cpu).expect("x");
            let ys = pool.install(host_pass);
            let tensor_pass = |l: &Linear| {
                l.forward(&xt)
                    .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
                    .expect("tensor pass")
            };
            for (l, y) in ls.iter().zip(&ys) {
                let t = tensor_pass(l);
                let top = t.iter().fold(0f32, |m, a| m.max(a.abs()));
                let worst = t
                    .iter()
                    .zip(y)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                // the same sums in other orders: f32 rounding of the largest output, no more
                assert!(
                    worst <= 1e-5 * top,
                    "host vs tensor pass: {worst} (max {top})"
                );
            }
            let base = Linear {
                lora: None,
                ..ls[0].clone()
            };
            assert_ne!(
                tensor_pass(&base),
                ys[0],
                "the branch must change the output"
            );
            return;
        }
        let want: Vec<Vec<f32>> = pool.install(|| {
            ls.iter()
                .map(|l| {
                    let Weight::Quant(q) = &l.weight else {
                        unreachable!()
                    };
                    let mut y = crate::engine::cpu::quant::qmatvec_shared(&[q], &x, l.kernel)
                        .expect("int kernel")
                        .remove(0);
                    if let Some((a, bb, scale)) = l.lora.as_ref().and_then(|b| b.host_parts()) {
                        crate::engine::lora::add_host(a, bb, scale, &x, cols, &mut y);
                    }
                    y
                })
                .collect()
        });
        for lead in [false, true] {
            let got = pool.install(|| {
                if lead {
                    crate::engine::cpu::team::Team::lead(host_pass)
                } else {
                    host_pass()
                }
            });
            assert_eq!(got, want, "lead {lead}");
        }
        let plain = pool.install(|| {
            let Weight::Quant(q) = &ls[0].weight else {
                unreachable!()
            };
            crate::engine::cpu::quant::qmatvec_shared(&[q], &x, Numerics::Fast).expect("int")
        });
        assert_ne!(plain[0], want[0], "the branch must change the output");
    }

    /// A decode region's read-ahead hint names its LoRA branches' `a` matrices (host copies,
    /// whole, in bytes) before the region's first tasks, and only the tasks without them.
    #[test]
    fn lead_in_names_lora_a_before_the_first_tasks() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        pool.install(|| {
            let w = Arc::new(random_qmatrix(256, 64, 4, 64, Dtype::BF16, 1));
            let a = Tensor::ones((64, 8), candle_core::DType::F32, &Device::Cpu).expect("a");
            let b = Tensor::ones((8, 256), candle_core::DType::F32, &Device::Cpu).expect("b");
            let plain = Linear {
                weight: Weight::Quant(w),
                lora: None,
                kernel: Numerics::Fast,
                part: Part::Projections,
            };
            let adapted = Linear {
                lora: Some(LoraBranch::new(a, b, 2.0).expect("branch")),
                ..plain.clone()
            };
            let tasks = Linear::lead_in(&[&plain, &plain]).ranges();
            assert!(tasks[0].1 > 0 && tasks[1].1 > 0 && tasks[2] == (0, 0));
            let r = Linear::lead_in(&[&plain, &adapted]).ranges();
            let (ha, _, _) = adapted
                .lora
                .as_ref()
                .and_then(|l| l.host_parts())
                .expect("host");
            assert_eq!(r[0], ha.range());
            assert_eq!(ha.range().1, 64 * 8 * 4);
            assert_eq!(r[1..3], tasks[..2]);
            assert_eq!(r[3], (0, 0));
        });
    }
}
