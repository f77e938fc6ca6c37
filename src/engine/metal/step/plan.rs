//! The fused Metal step as data: every dispatch of a forward over `m` rows, in order, with its
//! kernel, grid and arguments by `[[buffer(i)]]` slot. The GPU encodes exactly this list
//! (`gpu.rs`), and the shim tests run exactly this list (`tests/metal_shim/step_runner.cpp`).
//!
//! A decode step is five dispatches a layer: q|k|v (input RMSNorm inside, the LoRA A product of
//! q|k|v in extra threadgroups), attention (q/k norms, RoPE, cache write and q|k|v's LoRA B
//! inside), o (+ residual), gate|up (norm inside, SwiGLU after), down (+ residual); an adapter
//! adds the A products of o, gate|up and down: eight. Then the head (final norm inside) and the
//! sampler, after the embedding gather: three a token.

use super::layout::{BufId, Proj, StepModel};
use crate::engine::sample::KernelParams;

/// Which MSL library a kernel is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lib {
    /// `qmatmul.metal` followed by `step.metal`.
    Step,
    /// `sample.metal` with `kernels/sample.h`.
    Sample,
}

/// One argument slot: a buffer at a byte offset, or bytes set inline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arg {
    Buf(BufId, usize),
    Bytes(Vec<u8>),
}

#[derive(Debug, Clone)]
pub struct Dispatch {
    pub lib: Lib,
    pub kernel: &'static str,
    pub grid: [usize; 3],
    pub threads: [usize; 3],
    pub args: Vec<Arg>,
    /// The decoder layer it belongs to (`None`: embedding, head, sampler).
    pub layer: Option<usize>,
}

/// Threads of a matmul threadgroup (2 simdgroups of 4 rows) and the rows it covers.
const MV_THREADS: usize = 64;
const MV_ROWS: usize = 8;
/// Rows of x up to which the decode kernels run; the tiled prompt kernel's tile and threads.
const QMV_MAX_ROWS: usize = 8;
const QMM_TILE: usize = 32;
const QMM_THREADS: usize = 128;
/// Threads of an attention threadgroup (`ATT_SIMDS` simdgroups).
const ATT_THREADS: usize = 128;

fn words(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn buf(id: BufId) -> Arg {
    Arg::Buf(id, 0)
}

/// The sampler at the end of a forward: its parameters and the threads of its threadgroup (a
/// power of two, 32 to 1024: what the pipeline allows on the GPU).
#[derive(Debug, Clone, Copy)]
pub struct SampleCall {
    pub params: KernelParams,
    pub threads: usize,
}

/// How a matmul's output is finished.
#[derive(Clone, Copy, Default)]
pub(crate) struct Finish {
    pub norm: Option<BufId>,
    /// y += its old value (the residual stream)
    pub residual: bool,
    /// LoRA B in this kernel's epilogue (the A product is already in `t`).
    pub lora_b: bool,
    /// LoRA A of this matrix computed by extra threadgroups, its B left to the reader.
    pub lora_a_inside: bool,
}

impl StepModel {
    /// Every dispatch of a forward of `m` rows at cache position `pos`: logits of the last row
    /// (or of all rows), then the sampler if asked. `m <= self.rows`, `pos + m <= self.cap`.
    pub fn plan(
        &self,
        m: usize,
        pos: usize,
        all_logits: bool,
        sample: Option<SampleCall>,
    ) -> Vec<Dispatch> {
        let (d, a) = (&self.d, &self.acts);
        let mut out = Vec::new();
        let e = &self.embed;
        out.push(Dispatch {
            lib: Lib::Step,
            kernel: "qgather",
            grid: [e.k.div_ceil(256), m, 1],
            threads: [256, 1, 1],
            args: vec![
                buf(a.ids),
                buf(e.w),
                buf(e.s),
                buf(e.b),
                buf(a.x),
                Arg::Bytes(words(&[
                    m as i32,
                    e.n as i32,
                    e.k as i32,
                    e.bits as i32,
                    e.group_size as i32,
                    e.sdtype,
                ])),
            ],
            layer: None,
        });
        let fused = m == 1;
        for (i, l) in self.layers.iter().enumerate() {
            let start = out.len();
            let inside = l.qkv.lora.is_some();
            self.proj(
                &mut out,
                &l.qkv,
                a.x,
                m,
                a.qkv,
                Finish {
                    norm: Some(l.in_norm),
                    lora_a_inside: inside,
                    ..Finish::default()
                },
            );
            let (t, bt, lora) = match l.qkv.lora {
                Some(lo) => (
                    a.t,
                    lo.bt,
                    [1, lo.r, lo.rtot, lo.seg1, lo.seg2].map(|v| v as i32),
                ),
                None => (a.x, a.x, [0; 5]),
            };
            let attn = |fused: bool| {
                let mut w = [d.nh, d.nkv, d.hd, pos, fused as usize]
                    .map(|v| v as i32)
                    .to_vec();
                w.push(d.eps.to_bits() as i32);
                w.push((d.hd as f32).powf(-0.5).to_bits() as i32);
                w.extend_from_slice(&lora);
                Arg::Bytes(words(&w))
            };
            let common = [
                buf(a.qkv),
                buf(l.q_norm),
                buf(l.k_norm),
                buf(l.k_cache),
                buf(l.v_cache),
                buf(a.cos),
                buf(a.sin),
            ];
            if !fused {
                let mut args = common.to_vec();
                args.extend([attn(false), buf(t), buf(bt)]);
                out.push(Dispatch {
                    lib: Lib::Step,
                    kernel: "qk_norm_rope_cache",
                    grid: [d.nh + d.nkv, m, 1],
                    threads: [(d.hd / 2).next_multiple_of(32), 1, 1],
                    args,
                    layer: None,
                });
            }
            let mut args = common.to_vec();
            args.extend([attn(fused), buf(a.ao), buf(t), buf(bt)]);
            out.push(Dispatch {
                lib: Lib::Step,
                kernel: "attention_step",
                grid: [d.nh, m, 1],
                threads: [ATT_THREADS, 1, 1],
                args,
                layer: None,
            });
            let res = Finish {
                residual: true,
                lora_b: true,
                ..Finish::default()
            };
            self.proj(&mut out, &l.o, a.ao, m, a.x, res);
            let gu = Finish {
                norm: Some(l.post_norm),
                lora_b: true,
                ..Finish::default()
            };
            self.proj(&mut out, &l.gu, a.x, m, a.act, gu);
            self.proj(&mut out, &l.down, a.act, m, a.x, res);
            for d in &mut out[start..] {
                d.layer = Some(i);
            }
        }
        let rows = if all_logits { m } else { 1 };
        let last = (m - rows) * d.h * 4;
        self.proj_at(
            &mut out,
            &self.head,
            Arg::Buf(a.x, last),
            rows,
            a.logits,
            Finish {
                norm: Some(self.norm),
                ..Finish::default()
            },
        );
        if let Some(s) = sample {
            let shape = words(&[d.vocab as i32, 0]);
            out.push(Dispatch {
                lib: Lib::Sample,
                kernel: "sample_f32",
                grid: [1, 1, 1],
                threads: [s.threads, 1, 1],
                args: vec![
                    buf(a.logits),
                    buf(a.sample_work),
                    Arg::Bytes(shape),
                    Arg::Bytes(s.params.to_bytes().to_vec()),
                    buf(a.sample_state),
                    buf(a.sample_out),
                    // no mask is asked for: the kernel never writes `keep`
                    buf(a.sample_out),
                ],
                layer: None,
            });
        }
        out
    }

    fn proj(&self, out: &mut Vec<Dispatch>, p: &Proj, x: BufId, rows: usize, y: BufId, f: Finish) {
        self.proj_at(out, p, buf(x), rows, y, f)
    }

    fn proj_at(&self, out: &mut Vec<Dispatch>, p: &Proj, x: Arg, rows: usize, y: BufId, f: Finish) {
        matmul(out, p, x, rows, y, f, self.acts.t, self.d.eps)
    }
}

/// `y (rows, p.n) = finish(x (rows, p.k) @ W^T)` (SwiGLU's N / 2 for interleaved gate|up), with
/// the LoRA A product through `t`: the dispatches, appended to `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    out: &mut Vec<Dispatch>,
    p: &Proj,
    x: Arg,
    rows: usize,
    y: BufId,
    f: Finish,
    t: BufId,
    eps: f32,
) {
    let norm = f.norm.map_or(x.clone(), buf);
    let lora = p.lora.filter(|_| f.lora_b || f.lora_a_inside);
    if let (Some(l), true) = (lora, f.lora_b) {
        out.push(Dispatch {
            lib: Lib::Step,
            kernel: "lora_a_step",
            grid: [l.rtot, rows, 1],
            threads: [32, 1, 1],
            args: vec![
                x.clone(),
                buf(l.at),
                buf(t),
                Arg::Bytes(words(&[
                    p.k as i32,
                    l.rtot as i32,
                    f.norm.is_some() as i32,
                    eps.to_bits() as i32,
                ])),
                norm.clone(),
            ],
            layer: None,
        });
    }
    let epi_lora = lora.filter(|_| f.lora_b);
    let a_inside = lora.filter(|_| f.lora_a_inside);
    let a_tgs = a_inside.map_or(0, |l| l.rtot.div_ceil(2));
    let e = epi_lora.map_or([0; 5], |l| {
        [l.r, l.rtot, l.seg1, l.seg2, 0].map(|v| v as i32)
    });
    let params = words(&[
        rows as i32,
        p.n as i32,
        p.k as i32,
        p.bits as i32,
        p.group_size as i32,
        p.sdtype,
        f.norm.is_some() as i32,
        eps.to_bits() as i32,
        // StepEpi
        f.residual as i32,
        epi_lora.is_some() as i32,
        e[0],
        e[1],
        e[2],
        e[3],
        (epi_lora.is_some() && p.interleaved) as i32,
        p.interleaved as i32,
        a_tgs as i32,
        a_inside.map_or(0, |l| l.rtot as i32),
    ]);
    // decode kernels stream W once per row of x; past a few rows the tiled kernel reuses
    // each tile of W for 32 rows
    let (kernel, grid, threads) = if rows > QMV_MAX_ROWS {
        let grid = [rows.div_ceil(QMM_TILE), p.n.div_ceil(QMM_TILE) + a_tgs, 1];
        ("qmm_step", grid, QMM_THREADS)
    } else if p.bits == 4 && p.k.is_multiple_of(16) && p.group_size.is_multiple_of(16) {
        (
            "qmv4_step",
            [rows, p.n.div_ceil(MV_ROWS) + a_tgs, 1],
            MV_THREADS,
        )
    } else {
        (
            "qmvg_step",
            [rows, p.n.div_ceil(MV_ROWS) + a_tgs, 1],
            MV_THREADS,
        )
    };
    let at = match a_inside {
        Some(l) => buf(l.at),
        None => norm.clone(),
    };
    out.push(Dispatch {
        lib: Lib::Step,
        kernel,
        grid,
        threads: [threads, 1, 1],
        args: vec![
            x.clone(),
            buf(p.w),
            buf(p.s),
            buf(p.b),
            buf(y),
            Arg::Bytes(params),
            norm.clone(),
            if f.residual { buf(y) } else { x.clone() },
            epi_lora.map_or(x.clone(), |_| buf(t)),
            epi_lora.map_or(x.clone(), |l| buf(l.bt)),
            at,
            buf(t),
        ],
        layer: None,
    });
}

/// The most dispatches any layer of a decode step takes, and those outside the layers
/// (embedding, head, sampler), counted from the plan itself.
pub fn decode_counts(model: &StepModel, sample_threads: usize) -> (usize, usize) {
    let params = KernelParams {
        greedy: 1,
        inv_temp: 1.0,
        top_p24: 0,
        ln_min_p: f32::NEG_INFINITY,
        top_k: 0,
        penalty: 1.0,
    };
    let plan = model.plan(
        1,
        0,
        false,
        Some(SampleCall {
            params,
            threads: sample_threads,
        }),
    );
    let per_layer = (0..model.layers.len())
        .map(|i| plan.iter().filter(|d| d.layer == Some(i)).count())
        .max()
        .unwrap_or(0);
    let per_token = plan.iter().filter(|d| d.layer.is_none()).count();
    (per_layer, per_token)
}

/// The plan cut where the hidden states are read (`Qwen3::forward` keeps the residual stream
/// after the embedding and after every layer): each piece, and whether x is read after it.
pub fn hidden_segments(plan: &[Dispatch]) -> Vec<(std::ops::Range<usize>, bool)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < plan.len() {
        let layer = plan[start].layer;
        let mut end = start + 1;
        while end < plan.len() && plan[end].layer == layer {
            end += 1;
        }
        if layer.is_none() && start > 0 {
            // the head and the sampler: nothing read after them but the logits
            end = plan.len();
        }
        out.push((start..end, end < plan.len() || start == 0));
        start = end;
    }
    out
}

/// The slots a kernel writes (the rest it only reads): the GPU declares them so that the
/// encoder orders the dispatches.
pub fn written(kernel: &str) -> &'static [usize] {
    match kernel {
        "qgather" => &[4],
        "qmv4_step" | "qmvg_step" | "qmm_step" => &[4, 11],
        "lora_a_step" => &[2],
        "qk_norm_rope_cache" => &[0, 3, 4],
        "attention_step" => &[3, 4, 8],
        "sample_f32" => &[1, 5, 6],
        _ => &[],
    }
}
