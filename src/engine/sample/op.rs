//! The sampler as a candle op on a logits row: on a GPU the row never leaves the device and the
//! op returns 12 bytes, three little-endian u32s (token, log-probability bits, non-finite flag:
//! `sample::decode_kernel_output`), then with `want_keep` one byte per token (kept or not).
//! Used where candle computed the logits (the Metal forward, `--cuda-step ops`); the fused CUDA
//! step launches the same kernel inside its graph (`cuda/fused.rs`).

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape};

use crate::engine::cpu::sample::CpuSampler;
use crate::engine::sample::{KernelParams, SampleState, MAX_KERNEL_VOCAB};

pub struct SampleOp {
    pub params: KernelParams,
    pub state: SampleState,
    /// Also return the kept-token mask (u8 per token, after the three words): for tests.
    pub want_keep: bool,
    /// CUDA only: the one-block kernel instead of the grid one (for tests and comparisons).
    pub single_block: bool,
    /// CUDA only, for tests: the grid kernel's blocks and dynamic shared memory instead of the
    /// planned grid (a grid that cannot be resident at once must be refused).
    pub grid: Option<(usize, u32)>,
    pub cpu: Mutex<CpuSampler>,
}

impl SampleOp {
    pub fn new(params: KernelParams, state: SampleState) -> Self {
        SampleOp {
            params,
            state,
            want_keep: false,
            single_block: false,
            grid: None,
            cpu: Mutex::new(CpuSampler::new()),
        }
    }

    fn check(&self, l: &Layout) -> candle_core::Result<(usize, usize)> {
        let Some((o0, o1)) = l.contiguous_offsets() else {
            candle_core::bail!("the sampler takes a contiguous logits row");
        };
        let vocab = o1 - o0;
        if vocab == 0 || vocab > MAX_KERNEL_VOCAB {
            candle_core::bail!("the sampler takes 1 to {MAX_KERNEL_VOCAB} logits, got {vocab}");
        }
        Ok((o0, vocab))
    }

    /// Bytes the op returns for `vocab` logits.
    pub fn out_len(&self, vocab: usize) -> usize {
        crate::engine::sample::kernel_out_len(vocab, self.want_keep)
    }
}

/// The op's output: the kernel's three words, and the kept mask if asked for.
pub fn split_output(bytes: &[u8]) -> ([u32; 3], &[u8]) {
    let w = |i: usize| {
        u32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ])
    };
    ([w(0), w(1), w(2)], &bytes[12..])
}

impl CustomOp1 for SampleOp {
    fn name(&self) -> &'static str {
        "bot-sample"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (o0, vocab) = self.check(l)?;
        let CpuStorage::F32(x) = s else {
            candle_core::bail!("the sampler takes f32 logits");
        };
        let mut row = x[o0..o0 + vocab].to_vec();
        let recent = &self.state.recent[..self.state.n_recent as usize];
        let draw = crate::engine::sample::Draw {
            seed: self.state.seed,
            counter: self.state.counter,
        };
        let mut cpu = self
            .cpu
            .lock()
            .map_err(|_| candle_core::Error::Msg("sampler lock poisoned".into()))?;
        let out = match cpu.sample(&mut row, recent, &self.params, draw) {
            Ok(t) => [t.id, t.logprob.to_bits(), 0],
            Err(_) => [0, 0, 1],
        };
        let mut bytes: Vec<u8> = out.iter().flat_map(|w| w.to_le_bytes()).collect();
        if self.want_keep {
            // the CPU sampler does not expose its kept set: the reference's
            let x = &x[o0..o0 + vocab];
            let mut pen = x.to_vec();
            crate::engine::sample::apply_penalty(&mut pen, recent, self.params.penalty);
            let kept =
                crate::engine::sample::reference_kept(&pen, &self.params).unwrap_or_default();
            let mut mask = vec![0u8; vocab];
            for i in kept {
                mask[i as usize] = 1;
            }
            bytes.extend(mask);
        }
        let n = bytes.len();
        Ok((CpuStorage::U8(bytes), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (o0, vocab) = self.check(l)?;
        crate::engine::cuda::sample::sample_fwd(
            &self.params,
            &self.state,
            self.want_keep,
            self.single_block,
            self.grid,
            s,
            o0,
            vocab,
        )
    }

    #[cfg(bot_metal)]
    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::MetalStorage, Shape)> {
        let (o0, vocab) = self.check(l)?;
        crate::engine::metal::sample::sample_fwd(
            &self.params,
            &self.state,
            self.want_keep,
            s,
            o0,
            vocab,
        )
    }
}
