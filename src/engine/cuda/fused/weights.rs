//! The fused step's weights: projections that share an input concatenated by output rows
//! (q|k|v, gate|up interleaved), resident on the GPU, with their LoRA factors packed for the
//! kernels' epilogues.

use super::*;

/// A projection (or several sharing an input, concatenated by output rows) ready to run.
pub(super) struct Proj {
    pub(super) w: Arc<GpuQMatrix>,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) bits: usize,
    pub(super) group_size: usize,
    pub(super) sdtype: i32,
    pub(super) lora: Option<ProjLora>,
    /// Rows of the parts alternate (gate_0, up_0, gate_1, ...) rather than follow each other.
    pub(super) interleaved: bool,
    /// The decode kernel's launch (4-bit weights only).
    pub(super) decode: DecodeShape,
}

/// How the decode kernel runs on a `Proj`: `plan::decode4`'s kernel and block, `qmv4_grid`'s blocks.
#[derive(Clone, Copy, Default)]
pub(super) struct DecodeShape {
    pub(super) f: &'static str,
    pub(super) grid: usize,
    pub(super) threads: usize,
    pub(super) smem: usize,
}

/// LoRA of a `Proj`: `at` (rtot, k) holds each part's A transposed, rank-padded to `r`; `bt`
/// (n, r) each output's column of B, times the adapter scale. `feed_at` (k, rtot) is `at`
/// transposed back, each input's row times the weight of the projection's input RMSNorm (if
/// any): what the decode kernel that writes this projection's input reads to make its A
/// product (`Epi::feed_at`).
pub(super) struct ProjLora {
    pub(super) at: CudaSlice<f32>,
    pub(super) feed_at: CudaSlice<f32>,
    pub(super) bt: CudaSlice<f32>,
    pub(super) r: usize,
    pub(super) rtot: usize,
    pub(super) seg1: usize,
    pub(super) seg2: usize,
}

pub(super) struct Layer {
    pub(super) in_norm: CudaSlice<f32>,
    pub(super) post_norm: CudaSlice<f32>,
    pub(super) q_norm: CudaSlice<f32>,
    pub(super) k_norm: CudaSlice<f32>,
    pub(super) qkv: Proj,
    pub(super) o: Proj,
    pub(super) gu: Proj,
    pub(super) down: Proj,
}

pub(super) fn quant(w: &Weight) -> Option<&Arc<QMatrix>> {
    match w {
        Weight::Quant(q) => Some(q),
        _ => None,
    }
}

impl Proj {
    pub(super) fn single(dev: &CudaDevice, q: &QMatrix) -> Result<Self> {
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
    /// `interleave` (parts of equal size) alternating row by row; `norm`: the weight of the
    /// RMSNorm their input passes first, if any.
    pub(super) fn new(
        dev: &CudaDevice,
        parts: &[&Linear],
        interleave: bool,
        norm: Option<&[f32]>,
    ) -> Result<Self> {
        let qs: Vec<&QMatrix> = parts
            .iter()
            .map(|l| quant(&l.weight).map(|a| a.as_ref()))
            .collect::<Option<_>>()
            .ok_or_else(|| EngineError::Internal("fused step: dense projection".into()))?;
        let interleave = interleave && qs.len() > 1 && qs.iter().all(|q| q.rows == qs[0].rows);
        let lora = ProjLora::new(dev, parts, &qs, interleave, norm)?;
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
    pub(super) fn new(
        dev: &CudaDevice,
        parts: &[&Linear],
        qs: &[&QMatrix],
        interleave: bool,
        norm: Option<&[f32]>,
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
        let mut feed_at = vec![0f32; k * rtot];
        for (kk, row) in feed_at.chunks_exact_mut(rtot).enumerate() {
            let g = norm.map_or(1.0, |w| w[kk]);
            for (j, v) in row.iter_mut().enumerate() {
                // the product `lora_a_f32` forms, so only the order of the sums differs
                *v = at[j * k + kk] * g;
            }
        }
        Ok(Some(ProjLora {
            at: dev.clone_htod(&at)?,
            feed_at: dev.clone_htod(&feed_at)?,
            bt: dev.clone_htod(&bt)?,
            r,
            rtot,
            seg1: if parts.len() > 1 { seg(1) } else { n },
            seg2: if parts.len() > 2 { seg(2) } else { n },
        }))
    }
}
