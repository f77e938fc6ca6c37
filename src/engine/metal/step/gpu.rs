//! The fused Metal step on the GPU: the layout uploaded once into shared-storage buffers, the
//! plan encoded dispatch by dispatch into one command buffer a forward, ids and the sampler's
//! state written and logits or the sampled token read through the buffers' contents. Never run
//! on a Mac by this project: every dispatch it makes is one the shim tests ran (docs/macos.md).

use std::collections::HashMap;

use candle_core::MetalDevice;
use candle_metal_kernels::metal::{Buffer, ComputePipeline};
use objc2_metal::{MTLResourceOptions, MTLSize};

use super::layout::{BufId, StepModel};
use super::plan::{self, Arg, Lib, SampleCall};
use crate::engine::error::{EngineError, Result};
use crate::engine::layers::ModelView;
use crate::engine::metal::quant::{pipeline, Lib as QLib};
use crate::engine::sample::{decode_kernel_output, NonFinite, SampleState, SampleStep, Sampled};

/// Every kernel the plan can name, compiled at load so that a refused library is an error then.
const KERNELS: [(Lib, &str); 8] = [
    (Lib::Step, "qgather"),
    (Lib::Step, "qmm_step"),
    (Lib::Step, "qmv4_step"),
    (Lib::Step, "qmvg_step"),
    (Lib::Step, "lora_a_step"),
    (Lib::Step, "qk_norm_rope_cache"),
    (Lib::Step, "attention_step"),
    (Lib::Sample, "sample_f32"),
];

fn err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Internal(format!("Metal fused step: {e}"))
}

pub struct MetalStep {
    dev: MetalDevice,
    model: StepModel,
    bufs: Vec<Buffer>,
    pipes: HashMap<&'static str, ComputePipeline>,
    sample_threads: usize,
    rows: usize,
    logit_rows: usize,
    cap: usize,
}

/// A shared-storage buffer of `len` bytes holding `bytes` (or zeros).
fn buffer(dev: &MetalDevice, len: usize, bytes: Option<&[u8]>) -> Result<Buffer> {
    let b = dev
        .device()
        .new_buffer(len.max(4), MTLResourceOptions::StorageModeShared)
        .map_err(err)?;
    // SAFETY: a shared buffer's contents are `len` writable bytes, and the GPU is not using
    // this new buffer yet.
    unsafe {
        let dst = b.contents();
        std::ptr::write_bytes(dst, 0, len);
        if let Some(src) = bytes {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len().min(len));
        }
    }
    Ok(b)
}

impl MetalStep {
    /// `m`'s weights in the fused layout on this GPU; `super::unsupported(m)` must be `None`.
    pub(crate) fn new(m: &ModelView, dev: &MetalDevice) -> Result<Self> {
        let (rows, logit_rows, cap) = (1, 1, 256);
        let model = StepModel::new(m, rows, logit_rows, cap)?;
        let mut bufs = Vec::with_capacity(model.arena.bufs.len());
        for (_, init) in &model.arena.bufs {
            bufs.push(buffer(dev, init.len(), init.bytes())?);
        }
        dev.register_buffers(bufs.iter());
        let mut pipes = HashMap::new();
        for (lib, name) in KERNELS {
            let l = match lib {
                Lib::Step => QLib::Step,
                Lib::Sample => QLib::Sample,
            };
            pipes.insert(name, pipeline(dev, l, name)?);
        }
        // the sampler needs a power of two of threads, up to 1024 (what the pipeline allows)
        let max = pipes["sample_f32"]
            .max_total_threads_per_threadgroup()
            .min(1024);
        let sample_threads = 1usize << max.max(1).ilog2();
        if sample_threads < 32 {
            return Err(err(format!(
                "the sampler needs 32 threads, got {sample_threads}"
            )));
        }
        Ok(MetalStep {
            dev: dev.clone(),
            model,
            bufs,
            pipes,
            sample_threads,
            rows,
            logit_rows,
            cap,
        })
    }

    fn write(&self, id: BufId, bytes: &[u8]) {
        let b = &self.bufs[id.0 as usize];
        // SAFETY: the GPU is idle (every forward waits for its command buffer), and `ensure`
        // sized the buffer for what is written
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.contents(), bytes.len().min(b.length()))
        }
    }

    fn read(&self, id: BufId, len: usize) -> Vec<u8> {
        let b = &self.bufs[id.0 as usize];
        let mut v = vec![0u8; len.min(b.length())];
        // SAFETY: as in `write`
        unsafe { std::ptr::copy_nonoverlapping(b.contents(), v.as_mut_ptr(), v.len()) }
        v
    }

    /// Buffers for `m` rows, `logit_rows` of logits and `len` cache positions; the cache's
    /// contents carry over.
    fn ensure(&mut self, m: usize, logit_rows: usize, len: usize) -> Result<()> {
        if m <= self.rows && logit_rows <= self.logit_rows && len <= self.cap {
            return Ok(());
        }
        let rows = m.max(self.rows);
        let logit_rows = logit_rows.max(self.logit_rows);
        let cap = if len > self.cap {
            len.max(2 * self.cap).next_multiple_of(256)
        } else {
            self.cap
        };
        let (cos, sin) = self.model.rope_tables(cap);
        for (id, size) in self.model.resizable(rows, logit_rows, cap) {
            let old = &self.bufs[id.0 as usize];
            if old.length() >= size && id != self.model.acts.cos && id != self.model.acts.sin {
                continue;
            }
            let keep = if id == self.model.acts.cos {
                cos.clone()
            } else if id == self.model.acts.sin {
                sin.clone()
            } else {
                // the caches keep their positions; activations are rewritten before use
                self.read(id, old.length())
            };
            let b = buffer(&self.dev, size, Some(&keep))?;
            self.dev.register_buffers(std::iter::once(&b));
            let old = std::mem::replace(&mut self.bufs[id.0 as usize], b);
            self.dev.unregister_buffers(std::iter::once(&old));
        }
        (self.rows, self.logit_rows, self.cap) = (rows, logit_rows, cap);
        Ok(())
    }

    /// Encodes the plan of a forward of `ids` at `pos` in one command buffer and waits for it;
    /// with `hidden`, one command buffer per layer instead, and the residual stream read after
    /// the embedding and after every layer, then the final norm's output (computed here).
    fn run(
        &mut self,
        ids: &[u32],
        pos: usize,
        all_logits: bool,
        sample: Option<SampleCall>,
        mut hidden: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<()> {
        let vocab = self.model.d.vocab;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::TokenOutOfRange { id, vocab });
        }
        let m = ids.len();
        self.ensure(m, if all_logits { m } else { 1 }, pos + m)?;
        let idb: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write(self.model.acts.ids, &idb);
        let plan = self.model.plan(m, pos, all_logits, sample);
        if hidden.is_none() {
            self.encode(&plan)?;
            return Ok(());
        }
        let h = self.model.d.h;
        for (range, read) in plan::hidden_segments(&plan) {
            self.encode(&plan[range])?;
            if read {
                let x = self.floats(self.model.acts.x, m * h);
                if let Some(out) = hidden.as_deref_mut() {
                    out.push(x);
                }
            }
        }
        // the final norm's output, as candle ops keep it: the rows the logits are of
        let rows = if all_logits { m } else { 1 };
        let x = self.floats(self.model.acts.x, m * h);
        let g = self.floats(self.model.norm, h);
        let eps = self.model.d.eps;
        let mut normed = Vec::with_capacity(rows * h);
        for r in x[(m - rows) * h..].chunks_exact(h) {
            let ms = r.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let s = 1.0 / (ms + eps).sqrt();
            normed.extend(r.iter().zip(&g).map(|(v, w)| v * s * w));
        }
        if let Some(out) = hidden {
            out.push(normed);
        }
        Ok(())
    }

    /// Encodes `plan` in one command buffer and waits for it.
    fn encode(&self, plan: &[plan::Dispatch]) -> Result<()> {
        let size = |v: [usize; 3]| MTLSize {
            width: v[0],
            height: v[1],
            depth: v[2],
        };
        {
            let guard = self.dev.command_encoder()?;
            let enc = guard.as_ref();
            for d in plan {
                let pipe = self
                    .pipes
                    .get(d.kernel)
                    .ok_or_else(|| err(format!("no pipeline for {}", d.kernel)))?;
                enc.set_label(d.kernel);
                enc.set_compute_pipeline_state(pipe);
                let out = plan::written(d.kernel);
                for (slot, a) in d.args.iter().enumerate() {
                    match a {
                        Arg::Buf(id, off) => {
                            let b = Some(&self.bufs[id.0 as usize]);
                            if out.contains(&slot) {
                                enc.set_output_buffer(slot, b, *off);
                            } else {
                                enc.set_input_buffer(slot, b, *off);
                            }
                        }
                        Arg::Bytes(v) => enc.set_bytes_directly(slot, v.len(), v.as_ptr().cast()),
                    }
                }
                enc.dispatch_thread_groups(size(d.grid), size(d.threads));
            }
        }
        self.dev.wait_until_completed()?;
        Ok(())
    }

    fn floats(&self, id: BufId, n: usize) -> Vec<f32> {
        self.read(id, 4 * n)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Runs `ids` at cache position `pos`; the logits of the last position (or of every one)
    /// and, when asked for, the hidden states as `Qwen3::forward` gives them.
    pub fn forward(
        &mut self,
        ids: &[u32],
        pos: usize,
        all_logits: bool,
        keep_hidden: bool,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let mut hidden = Vec::new();
        self.run(
            ids,
            pos,
            all_logits,
            None,
            keep_hidden.then_some(&mut hidden),
        )?;
        let n = if all_logits { ids.len() } else { 1 } * self.model.d.vocab;
        Ok((self.floats(self.model.acts.logits, n), hidden))
    }

    /// Runs `ids` at `pos` and samples the next token on the GPU in the same command buffer:
    /// three words come back.
    pub fn forward_sample(
        &mut self,
        ids: &[u32],
        pos: usize,
        s: &SampleStep,
    ) -> Result<std::result::Result<Sampled, NonFinite>> {
        let state = SampleState::new(s.draw, s.recent);
        self.write(self.model.acts.sample_state, &state.to_bytes());
        let call = SampleCall {
            params: s.params,
            threads: self.sample_threads,
        };
        self.run(ids, pos, false, Some(call), None)?;
        let b = self.read(self.model.acts.sample_out, 12);
        let w = |i: usize| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
        Ok(decode_kernel_output([w(0), w(1), w(2)]))
    }
}
