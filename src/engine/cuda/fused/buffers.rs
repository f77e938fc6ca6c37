//! The fused step's memory, allocated once: the model's dimensions, activation buffers for up
//! to a number of rows, and the KV cache with its RoPE tables.

use super::*;

#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub(super) h: usize,
    pub(super) nh: usize,
    pub(super) nkv: usize,
    pub(super) hd: usize,
    pub(super) inter: usize,
    pub(super) vocab: usize,
    pub(super) eps: f32,
    pub(super) theta: f64,
}

impl Dims {
    /// Attention's score scale, `head_dim^-0.5`.
    pub(super) fn scale(&self) -> f32 {
        (self.hd as f32).powf(-0.5)
    }

    pub(super) fn qkv(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hd
    }

    /// Floats of split-K partials the layer matmuls need for `rows` prompt rows.
    pub(super) fn split_workspace(&self, rows: usize) -> usize {
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
pub(super) struct Buffers {
    pub(super) rows: usize,
    pub(super) x: CudaSlice<f32>,
    pub(super) xn: CudaSlice<f32>,
    pub(super) qkv: CudaSlice<f32>,
    pub(super) ao: CudaSlice<f32>,
    pub(super) gu: CudaSlice<f32>,
    pub(super) act: CudaSlice<f32>,
    pub(super) t: CudaSlice<f32>,
    /// Partial sums of split-K prompt matmuls.
    pub(super) ws: CudaSlice<f32>,
    /// A prompt matmul's input as `x_to_f16p` writes it, and its rows' scales.
    pub(super) xh: CudaSlice<u16>,
    pub(super) rs: CudaSlice<f32>,
    /// Decode attention's per-split partials (max, sum, head_dim values) and per-head counters.
    pub(super) att_ws: CudaSlice<f32>,
    pub(super) att_cnt: CudaSlice<u32>,
    pub(super) logits: CudaSlice<f32>,
    pub(super) ids: CudaSlice<u32>,
}

/// Where decode kernels leave the next projection's LoRA A products (`Epi::feed_acc`): 32
/// fixed-point words a link (producer to consumer) of the step, each link its own, all zeroed
/// at the start of every decode step (`FeedBufs::zero`): a producer's blocks add into them.
pub(super) struct FeedBufs {
    pub(super) acc: CudaSlice<u64>,
    pub(super) links: usize,
}

impl FeedBufs {
    pub(super) fn new(dev: &CudaDevice, links: usize) -> Result<Self> {
        let links = links.max(1);
        Ok(FeedBufs {
            acc: dev.alloc_zeros::<u64>(links * 32)?,
            links,
        })
    }

    /// The device address of link `i`'s words (`i < links`: the step numbers its links).
    pub(super) fn link(&self, i: usize, stream: &CudaStream) -> u64 {
        debug_assert!(i < self.links, "feed link {i} of {}", self.links);
        ptr(&self.acc, stream) + (i * 32 * 8) as u64
    }

    /// Zeroes every link's words (a memset node in a captured step).
    pub(super) fn zero(&self, stream: &CudaStream) -> Result<()> {
        stream.context().bind_to_thread().w()?;
        // SAFETY: `acc` holds `links * 32` u64 words, i.e. twice as many u32 words
        unsafe {
            sys::cuMemsetD32Async(
                ptr(&self.acc, stream),
                0,
                self.links * 64,
                stream.cu_stream(),
            )
        }
        .result()
        .w()?;
        Ok(())
    }
}

/// Per-layer K and V for `cap` positions, (cap, n_kv, head_dim), and the RoPE tables.
pub(super) struct Cache {
    pub(super) cap: usize,
    pub(super) k: Vec<CudaSlice<f32>>,
    pub(super) v: Vec<CudaSlice<f32>>,
    pub(super) cos: CudaSlice<f32>,
    pub(super) sin: CudaSlice<f32>,
}

impl Buffers {
    pub(super) fn new(dev: &CudaDevice, d: &Dims, rows: usize, rtot: usize) -> Result<Self> {
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
    pub(super) fn new(dev: &CudaDevice, d: &Dims, layers: usize, cap: usize) -> Result<Self> {
        let per = cap * d.nkv * d.hd;
        let (cos, sin) = rope_angles(d.theta, d.hd, 0..cap);
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
