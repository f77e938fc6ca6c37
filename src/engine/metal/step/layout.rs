//! The fused Metal step's memory as plain host data: every buffer the plan binds, numbered, with
//! what it starts as (weights in the fused layout, or zeros). The GPU side (`gpu.rs`) uploads it
//! once; the shim tests write it to files.

use std::sync::Arc;

use crate::engine::error::{EngineError, Result};
use crate::engine::layers::{rope_angles, Linear, ModelView, Weight};
use crate::engine::quant::QMatrix;

/// A buffer of the step, by number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufId(pub u32);

/// Which bytes of a quantized matrix a buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Codes,
    Scales,
    Biases,
}

/// What a buffer holds when the step starts.
pub enum Init {
    Bytes(Vec<u8>),
    /// A part of a loaded matrix, shared rather than copied.
    Matrix(Arc<QMatrix>, Part),
    Zeros(usize),
}

impl Init {
    pub fn len(&self) -> usize {
        match self {
            Init::Bytes(b) => b.len(),
            Init::Matrix(m, p) => part_bytes(m, *p).len(),
            Init::Zeros(n) => *n,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The initial contents (`None`: zeros).
    pub fn bytes(&self) -> Option<&[u8]> {
        match self {
            Init::Bytes(b) => Some(b),
            Init::Matrix(m, p) => Some(part_bytes(m, *p)),
            Init::Zeros(_) => None,
        }
    }
}

fn part_bytes(m: &QMatrix, p: Part) -> &[u8] {
    match p {
        Part::Codes => &m.packed[..],
        Part::Scales => &m.scales.bytes[..],
        Part::Biases => &m.biases.bytes[..],
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Every buffer, indexed by `BufId`, with a name for messages.
#[derive(Default)]
pub struct Arena {
    pub bufs: Vec<(String, Init)>,
    /// Matrices already added (a tied head shares the embedding's buffers).
    /// (address of the matrix, part, buffer)
    shared: Vec<(usize, Part, BufId)>,
}

impl Arena {
    fn matrix(&mut self, name: String, q: &Arc<QMatrix>, part: Part) -> BufId {
        let key = Arc::as_ptr(q) as usize;
        if let Some(&(_, _, id)) = self.shared.iter().find(|(p, w, _)| *p == key && *w == part) {
            return id;
        }
        let id = self.add(name, Init::Matrix(q.clone(), part));
        self.shared.push((key, part, id));
        id
    }

    pub(crate) fn add(&mut self, name: impl Into<String>, init: Init) -> BufId {
        self.bufs.push((name.into(), init));
        BufId(self.bufs.len() as u32 - 1)
    }

    pub(crate) fn floats(&mut self, name: impl Into<String>, v: &[f32]) -> BufId {
        self.add(name, Init::Bytes(f32_bytes(v)))
    }

    fn zeros(&mut self, name: impl Into<String>, floats: usize) -> BufId {
        // Metal refuses empty buffers
        self.add(name, Init::Zeros(4 * floats.max(1)))
    }
}

/// The model's dimensions.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub h: usize,
    pub nh: usize,
    pub nkv: usize,
    pub hd: usize,
    pub inter: usize,
    pub vocab: usize,
    pub eps: f32,
    pub theta: f64,
}

impl Dims {
    pub fn qkv(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hd
    }
}

/// LoRA of a `Proj`: `at` (rtot, k) each part's A transposed, rank-padded to `r`; `bt` (n, r)
/// each output's column of B times the adapter scale.
#[derive(Debug, Clone, Copy)]
pub struct ProjLora {
    pub at: BufId,
    pub bt: BufId,
    pub r: usize,
    pub rtot: usize,
    pub seg1: usize,
    pub seg2: usize,
}

/// A projection (or several sharing an input, concatenated by output rows; gate|up with rows
/// alternating) as one matrix.
#[derive(Debug, Clone, Copy)]
pub struct Proj {
    pub w: BufId,
    pub s: BufId,
    pub b: BufId,
    pub n: usize,
    pub k: usize,
    pub bits: usize,
    pub group_size: usize,
    pub sdtype: i32,
    pub lora: Option<ProjLora>,
    pub interleaved: bool,
}

pub struct Layer {
    pub in_norm: BufId,
    pub post_norm: BufId,
    pub q_norm: BufId,
    pub k_norm: BufId,
    pub qkv: Proj,
    pub o: Proj,
    pub gu: Proj,
    pub down: Proj,
    pub k_cache: BufId,
    pub v_cache: BufId,
}

/// Activations for up to `rows` positions, the logits of up to `logit_rows`, and the sampler's.
pub struct Acts {
    pub ids: BufId,
    pub x: BufId,
    pub qkv: BufId,
    pub ao: BufId,
    pub act: BufId,
    pub t: BufId,
    pub logits: BufId,
    pub cos: BufId,
    pub sin: BufId,
    pub sample_state: BufId,
    pub sample_work: BufId,
    pub sample_out: BufId,
}

/// The whole step: dimensions, buffers, and which buffer is what.
pub struct StepModel {
    pub d: Dims,
    pub arena: Arena,
    pub layers: Vec<Layer>,
    pub embed: Proj,
    pub head: Proj,
    pub norm: BufId,
    pub acts: Acts,
    /// Rows the activations hold, logits rows, and positions the cache and RoPE tables hold.
    pub rows: usize,
    pub logit_rows: usize,
    pub cap: usize,
    /// The largest `rtot` of any projection (the size of `acts.t`'s rows).
    pub max_rtot: usize,
}

/// Why the fused step cannot run this model (the caller keeps candle ops), if it cannot.
pub(crate) fn unsupported(m: &ModelView) -> Option<String> {
    let c = &m.cfg;
    if !c.head_dim.is_multiple_of(32) || c.head_dim > 256 {
        return Some(format!(
            "head_dim {} is not a multiple of 32 up to 256",
            c.head_dim
        ));
    }
    if !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
        return Some("heads are not a multiple of KV heads".into());
    }
    if !c.hidden_size.is_multiple_of(4) || !c.intermediate_size.is_multiple_of(4) {
        return Some("hidden or intermediate size is not a multiple of 4".into());
    }
    for w in m.projections().chain([m.embed, &m.lm_head.weight]) {
        if !matches!(w, Weight::Quant(_)) {
            return Some("a projection is not MLX-quantized (dense or repacked)".into());
        }
    }
    for l in &m.layers {
        for group in [&l.linears[0..3], &l.linears[4..6]] {
            let q: Vec<&QMatrix> = group.iter().filter_map(|l| quant(&l.weight)).collect();
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

fn quant(w: &Weight) -> Option<&QMatrix> {
    match w {
        Weight::Quant(q) => Some(q),
        _ => None,
    }
}

fn norm_floats(t: &candle_core::Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

impl StepModel {
    /// `m`'s weights in the fused layout, activations for `rows` positions (`logit_rows` of
    /// logits) and a cache for `cap` positions; `unsupported(m)` must be `None`.
    pub(crate) fn new(m: &ModelView, rows: usize, logit_rows: usize, cap: usize) -> Result<Self> {
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
        let mut a = Arena::default();
        let mut layers = Vec::with_capacity(m.layers.len());
        for (i, l) in m.layers.iter().enumerate() {
            let [q, k, v, o, g, u, dn] = l.linears;
            let mut norm = |what: &str, t| -> Result<BufId> {
                Ok(a.floats(format!("layers.{i}.{what}"), &norm_floats(t)?))
            };
            let in_norm = norm("input_layernorm", l.norms[0])?;
            let post_norm = norm("post_attention_layernorm", l.norms[1])?;
            let q_norm = norm("q_norm", l.norms[2])?;
            let k_norm = norm("k_norm", l.norms[3])?;
            let per = cap * d.nkv * d.hd;
            layers.push(Layer {
                in_norm,
                post_norm,
                q_norm,
                k_norm,
                qkv: Proj::new(&mut a, &format!("layers.{i}.qkv"), &[q, k, v], false)?,
                o: Proj::new(&mut a, &format!("layers.{i}.o"), &[o], false)?,
                gu: Proj::new(&mut a, &format!("layers.{i}.gate_up"), &[g, u], true)?,
                down: Proj::new(&mut a, &format!("layers.{i}.down"), &[dn], false)?,
                k_cache: a.zeros(format!("layers.{i}.k_cache"), per),
                v_cache: a.zeros(format!("layers.{i}.v_cache"), per),
            });
        }
        let embed = match m.embed {
            Weight::Quant(q) => Proj::shared(&mut a, "embed_tokens", q),
            _ => return Err(EngineError::Internal("fused step: dense embedding".into())),
        };
        let head = Proj::new(&mut a, "lm_head", &[m.lm_head], false)?;
        let norm = a.floats("norm", &norm_floats(m.norm)?);
        let max_rtot = layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o, &l.gu, &l.down])
            .filter_map(|p| p.lora.map(|l| l.rtot))
            .max()
            .unwrap_or(0);
        let (cos, sin) = rope_angles(d.theta, d.hd, 0..cap);
        let acts = Acts {
            ids: a.add("ids", Init::Zeros(4 * rows)),
            x: a.zeros("x", rows * d.h),
            qkv: a.zeros("qkv", rows * d.qkv()),
            ao: a.zeros("attention_out", rows * d.nh * d.hd),
            act: a.zeros("gate_up", rows * 2 * d.inter),
            t: a.zeros("lora_t", rows * max_rtot),
            logits: a.zeros("logits", logit_rows * d.vocab),
            cos: a.floats("rope_cos", &cos),
            sin: a.floats("rope_sin", &sin),
            sample_state: a.add(
                "sample_state",
                Init::Zeros(crate::engine::sample::STATE_BYTES),
            ),
            sample_work: a.zeros("sample_work", d.vocab),
            sample_out: a.add(
                "sample_out",
                Init::Zeros(crate::engine::sample::kernel_out_len(d.vocab, false)),
            ),
        };
        Ok(StepModel {
            d,
            arena: a,
            layers,
            embed,
            head,
            norm,
            acts,
            rows,
            logit_rows,
            cap,
            max_rtot,
        })
    }
}

impl Proj {
    /// One matrix, its bytes shared with the loaded model.
    pub(crate) fn shared(a: &mut Arena, name: &str, q: &Arc<QMatrix>) -> Self {
        Proj {
            w: a.matrix(format!("{name}.weight"), q, Part::Codes),
            s: a.matrix(format!("{name}.scales"), q, Part::Scales),
            b: a.matrix(format!("{name}.biases"), q, Part::Biases),
            n: q.rows,
            k: q.cols,
            bits: q.params.bits,
            group_size: q.params.group_size,
            sdtype: q.scales.kernel_code(),
            lora: None,
            interleaved: false,
        }
    }

    /// Projections sharing their input, concatenated by output rows, or with `interleave`
    /// (parts of equal size) alternating row by row; with their LoRA packed.
    fn new(a: &mut Arena, name: &str, parts: &[&Linear], interleave: bool) -> Result<Self> {
        let qs: Vec<&Arc<QMatrix>> = parts
            .iter()
            .map(|l| match &l.weight {
                Weight::Quant(q) => Some(q),
                _ => None,
            })
            .collect::<Option<_>>()
            .ok_or_else(|| EngineError::Internal(format!("fused step: {name} is dense")))?;
        let interleave = interleave && qs.len() > 1 && qs.iter().all(|q| q.rows == qs[0].rows);
        let mut p = if qs.len() == 1 {
            Proj::shared(a, name, qs[0])
        } else {
            // each matrix's rows are `bytes.len() / rows` bytes of codes, scales or biases
            let mut cat = |what: &str, part: Part| -> BufId {
                let total = qs.iter().map(|q| part_bytes(q, part).len()).sum();
                let mut v = Vec::with_capacity(total);
                if interleave {
                    let rb = part_bytes(qs[0], part).len() / qs[0].rows;
                    for i in 0..qs[0].rows {
                        for q in &qs {
                            v.extend_from_slice(&part_bytes(q, part)[i * rb..(i + 1) * rb]);
                        }
                    }
                } else {
                    for q in &qs {
                        v.extend_from_slice(part_bytes(q, part));
                    }
                }
                a.add(format!("{name}.{what}"), Init::Bytes(v))
            };
            Proj {
                w: cat("weight", Part::Codes),
                s: cat("scales", Part::Scales),
                b: cat("biases", Part::Biases),
                n: qs.iter().map(|q| q.rows).sum(),
                interleaved: interleave,
                ..Proj::shared(&mut Arena::default(), name, qs[0])
            }
        };
        p.lora = ProjLora::new(a, name, parts, &qs, interleave)?;
        Ok(p)
    }
}

impl ProjLora {
    fn new(
        a: &mut Arena,
        name: &str,
        parts: &[&Linear],
        qs: &[&Arc<QMatrix>],
        interleave: bool,
    ) -> Result<Option<Self>> {
        if parts.iter().all(|l| l.lora.is_none()) {
            return Ok(None);
        }
        let k = qs[0].cols;
        let n: usize = qs.iter().map(|q| q.rows).sum();
        let mut r = 1;
        for b in parts.iter().filter_map(|l| l.lora.as_ref()) {
            r = r.max(b.a.dim(1)?);
        }
        let rtot = r * parts.len();
        let mut at = vec![0f32; rtot * k];
        let mut bt = vec![0f32; n * r];
        let mut off = 0;
        for (i, (l, q)) in parts.iter().zip(qs).enumerate() {
            if let Some(b) = &l.lora {
                let am = b.a.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?; // (k, ri)
                let bm = b.b.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?; // (ri, rows)
                for (kk, row) in am.iter().enumerate() {
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
            at: a.floats(format!("{name}.lora_at"), &at),
            bt: a.floats(format!("{name}.lora_bt"), &bt),
            r,
            rtot,
            seg1: if parts.len() > 1 { seg(1) } else { n },
            seg2: if parts.len() > 2 { seg(2) } else { n },
        }))
    }
}

#[cfg(test)]
impl StepModel {
    /// The layout of a model of dimensions `d` with `layers` layers quantized at `bits` / `gs`
    /// (bf16 scales), with a rank-`lora` adapter on every projection if asked, and nothing in
    /// its buffers: enough to plan (the dispatch counts at real shapes), not to run.
    pub(crate) fn shaped(
        d: Dims,
        layers: usize,
        bits: usize,
        gs: usize,
        lora: Option<usize>,
    ) -> Self {
        let mut a = Arena::default();
        let proj = |a: &mut Arena, parts: &[usize], k: usize, interleaved: bool| {
            let n: usize = parts.iter().sum();
            let mut zeros = |len| a.add("shaped", Init::Zeros(len));
            let (w, s, b) = (
                zeros(n * k * bits / 8),
                zeros(n * k / gs * 2),
                zeros(n * k / gs * 2),
            );
            let lora = lora.map(|r| {
                let rtot = r * parts.len();
                let seg = |i: usize| parts.iter().take(i).sum::<usize>();
                ProjLora {
                    at: zeros(4 * rtot * k),
                    bt: zeros(4 * n * r),
                    r,
                    rtot,
                    seg1: if parts.len() > 1 { seg(1) } else { n },
                    seg2: if parts.len() > 2 { seg(2) } else { n },
                }
            });
            Proj {
                w,
                s,
                b,
                n,
                k,
                bits,
                group_size: gs,
                sdtype: 0,
                lora,
                interleaved,
            }
        };
        let (h, q, kv, i) = (d.h, d.nh * d.hd, d.nkv * d.hd, d.inter);
        let layers = (0..layers)
            .map(|_| Layer {
                in_norm: a.zeros("n", h),
                post_norm: a.zeros("n", h),
                q_norm: a.zeros("n", d.hd),
                k_norm: a.zeros("n", d.hd),
                qkv: proj(&mut a, &[q, kv, kv], h, false),
                o: proj(&mut a, &[h], q, false),
                gu: proj(&mut a, &[i, i], h, true),
                down: proj(&mut a, &[h], i, false),
                k_cache: a.zeros("k", 1),
                v_cache: a.zeros("v", 1),
            })
            .collect();
        let mut embed = proj(&mut a, &[d.vocab], h, false);
        embed.lora = None;
        let mut head = embed;
        head.w = a.zeros("head", 1);
        let z = a.zeros("act", 1);
        let acts = Acts {
            ids: z,
            x: z,
            qkv: z,
            ao: z,
            act: z,
            t: z,
            logits: z,
            cos: z,
            sin: z,
            sample_state: z,
            sample_work: z,
            sample_out: z,
        };
        let norm = a.zeros("norm", h);
        StepModel {
            d,
            arena: a,
            layers,
            embed,
            head,
            norm,
            acts,
            rows: 1,
            logit_rows: 1,
            cap: 1,
            max_rtot: lora.map_or(0, |r| 3 * r),
        }
    }
}

impl StepModel {
    /// Bytes of every buffer whose size depends on the rows, logit rows or cache positions,
    /// for `rows`, `logit_rows` and `cap` of them.
    pub fn resizable(&self, rows: usize, logit_rows: usize, cap: usize) -> Vec<(BufId, usize)> {
        let (d, a) = (&self.d, &self.acts);
        let f = |n: usize| 4 * n.max(1);
        let mut v = vec![
            (a.ids, 4 * rows),
            (a.x, f(rows * d.h)),
            (a.qkv, f(rows * d.qkv())),
            (a.ao, f(rows * d.nh * d.hd)),
            (a.act, f(rows * 2 * d.inter)),
            (a.t, f(rows * self.max_rtot)),
            (a.logits, f(logit_rows * d.vocab)),
            (a.cos, f(cap * d.hd / 2)),
            (a.sin, f(cap * d.hd / 2)),
        ];
        for l in &self.layers {
            v.push((l.k_cache, f(cap * d.nkv * d.hd)));
            v.push((l.v_cache, f(cap * d.nkv * d.hd)));
        }
        v
    }

    /// The RoPE tables (cos, sin) for `cap` positions, as the buffers hold them.
    pub fn rope_tables(&self, cap: usize) -> (Vec<u8>, Vec<u8>) {
        let (cos, sin) = rope_angles(self.d.theta, self.d.hd, 0..cap);
        (f32_bytes(&cos), f32_bytes(&sin))
    }
}
