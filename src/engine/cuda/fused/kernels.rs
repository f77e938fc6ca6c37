//! One typed launch function per kernel of `step.cu` (and the embedding gather): each takes
//! device pointers and sizes by name, builds the argument list in the C signature's order and
//! picks the grid, so the step (`step.rs`) reads as a sequence of calls.

use super::*;

/// Device pointers of one layer's attention inputs and outputs.
pub(super) struct AttentionIo {
    /// (rows, (nh + 2 nkv) hd): q, k and v of each row.
    pub qkv: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    /// The layer's KV cache, (cap, nkv, hd) each.
    pub kc: u64,
    pub vc: u64,
    /// RoPE tables, (cap, hd / 2) each.
    pub cos: u64,
    pub sin: u64,
    /// (rows, nh hd): the attention output.
    pub out: u64,
}

impl FusedQwen3 {
    /// `dst (rows, h) = rms_norm(src) * w`.
    pub(super) fn rms_norm(
        &self,
        src: u64,
        w: &CudaSlice<f32>,
        dst: u64,
        rows: usize,
    ) -> Result<()> {
        let a = [
            Arg::P(src),
            Arg::P(ptr(w, &self.stream)),
            Arg::P(dst),
            Arg::I(self.d.h as i32),
            Arg::F(self.d.eps),
        ];
        self.launch("rms_norm_f32", (rows, 1), 256, &a)
    }

    /// `t (rows, r) = x (rows, k) @ at^T` (the LoRA A products of projections sharing x), with
    /// x RMS-normalized by `norm_w` first unless it is 0.
    pub(super) fn lora_a(
        &self,
        x: u64,
        at: u64,
        t: u64,
        (rows, k, r): (usize, usize, usize),
        norm_w: u64,
    ) -> Result<()> {
        let a = [
            Arg::P(x),
            Arg::P(at),
            Arg::P(t),
            Arg::I(k as i32),
            Arg::I(r as i32),
            Arg::P(norm_w),
            Arg::F(self.d.eps),
        ];
        self.launch("lora_a_f32", (r, rows), 256, &a)
    }

    /// Rows `ids` of the embedding table, dequantized, into `x (rows, h)`.
    pub(super) fn embed(&self, ids: u64, x: u64, rows: usize) -> Result<()> {
        let (d, e, st) = (self.d, &self.embed, &self.stream);
        let a = [
            Arg::P(ids),
            Arg::P(ptr(&e.w.packed, st)),
            Arg::P(ptr(&e.w.scales, st)),
            Arg::P(ptr(&e.w.biases, st)),
            Arg::P(x),
            Arg::I(d.h as i32),
            Arg::I(e.bits as i32),
            Arg::I(e.group_size as i32),
            Arg::I(e.sdtype),
        ];
        self.launch("qgather_f32", ((d.h / 16).div_ceil(128), rows), 128, &a)
    }

    /// Prompt rows: q and k normed and rotated in place, k and v written to the cache at
    /// positions `pos..pos + rows`.
    pub(super) fn qk_norm_rope_cache(&self, io: &AttentionIo, pos: u64, rows: usize) -> Result<()> {
        let d = self.d;
        let a = [
            Arg::P(io.qkv),
            Arg::P(io.q_norm),
            Arg::P(io.k_norm),
            Arg::P(io.kc),
            Arg::P(io.vc),
            Arg::P(io.cos),
            Arg::P(io.sin),
            Arg::P(pos),
            Arg::I(d.nh as i32),
            Arg::I(d.nkv as i32),
            Arg::I(d.hd as i32),
            Arg::F(d.eps),
        ];
        let block = (d.hd / 2).next_multiple_of(32);
        self.launch("qk_norm_rope_cache", (d.nh + d.nkv, rows), block, &a)
    }

    /// Prompt attention of `rows` rows over the cache (after `qk_norm_rope_cache`): eight rows
    /// a block sharing the keys they stage (`attention_prompt`), or, at head_dim 256 or with
    /// `BOT_CUDA_PROMPT_ATTENTION=row` (for comparisons), a block a row (`attention_f32`).
    pub(super) fn attention(&self, io: &AttentionIo, pos: u64, rows: usize) -> Result<()> {
        let d = self.d;
        let (nh, nkv, scale) = (Arg::I(d.nh as i32), Arg::I(d.nkv as i32), Arg::F(d.scale()));
        let (qkv, kc, vc, out, pos) = (
            Arg::P(io.qkv),
            Arg::P(io.kc),
            Arg::P(io.vc),
            Arg::P(io.out),
            Arg::P(pos),
        );
        match prompt_attention_kernel(d.hd) {
            Some(f) => {
                let a = [qkv, kc, vc, out, pos, Arg::I(rows as i32), nh, nkv, scale];
                self.launch_as("attention", f, (d.nh, rows.div_ceil(8)), 256, 0, &a)
            }
            None => {
                let a = [qkv, kc, vc, out, pos, nh, nkv, scale];
                let f = attention_kernel(d.hd, false);
                self.launch_as("attention", f, (d.nh, rows), 256, 0, &a)
            }
        }
    }

    /// One decode row: q/k norms, RoPE and the cache write inside, keys split over
    /// `ATT_SPLITS` blocks a head.
    pub(super) fn attention_decode(&self, io: &AttentionIo, pos: u64) -> Result<()> {
        let (d, b, st) = (self.d, &self.bufs, &self.stream);
        let a = [
            Arg::P(io.qkv),
            Arg::P(io.q_norm),
            Arg::P(io.k_norm),
            Arg::P(io.kc),
            Arg::P(io.vc),
            Arg::P(io.cos),
            Arg::P(io.sin),
            Arg::P(io.out),
            Arg::P(pos),
            Arg::I(d.nh as i32),
            Arg::I(d.nkv as i32),
            Arg::F(d.scale()),
            Arg::F(d.eps),
            Arg::P(ptr(&b.att_ws, st)),
            Arg::P(ptr(&b.att_cnt, st)),
        ];
        let f = attention_kernel(d.hd, true);
        let tag = "attention (+ q/k norm, RoPE, cache write)";
        self.launch_as(tag, f, (d.nh, ATT_SPLITS), 256, 0, &a)
    }

    /// `act (rows, inter) = silu(gate) * up` from interleaved gate|up rows.
    pub(super) fn swiglu(&self, gu: u64, act: u64, rows: usize) -> Result<()> {
        let total = rows * self.d.inter;
        let a = [
            Arg::P(gu),
            Arg::P(act),
            Arg::I(self.d.inter as i32),
            Arg::I(total as i32),
        ];
        self.launch("swiglu_f32", (total.div_ceil(256), 1), 256, &a)
    }
}

/// The attention kernel instance for a head size (`unsupported` admits only these).
/// `attention_prompt`'s instance for `hd`, where there is one and it is not switched off.
fn prompt_attention_kernel(hd: usize) -> Option<&'static str> {
    static ROW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let row =
        *ROW.get_or_init(|| std::env::var("BOT_CUDA_PROMPT_ATTENTION").is_ok_and(|v| v == "row"));
    match hd {
        _ if row => None,
        32 => Some("attention_prompt_hd32"),
        64 => Some("attention_prompt_hd64"),
        128 => Some("attention_prompt_hd128"),
        _ => None,
    }
}

fn attention_kernel(hd: usize, decode: bool) -> &'static str {
    match (hd, decode) {
        (32, false) => "attention_f32_hd32",
        (64, false) => "attention_f32_hd64",
        (128, false) => "attention_f32_hd128",
        (_, false) => "attention_f32_hd256",
        (32, true) => "attention_decode_hd32",
        (64, true) => "attention_decode_hd64",
        (128, true) => "attention_decode_hd128",
        (_, true) => "attention_decode_hd256",
    }
}
