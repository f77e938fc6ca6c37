//! Cheap always-on counters of where a forward pass spends its time (a few `Instant::now`
//! calls per projection), read by `bot bench` to say where a decode step's time goes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

#[derive(Debug, Clone, Copy)]
pub enum Part {
    /// Quantized/dense projections of the decoder layers.
    Projections = 0,
    /// The output head.
    Head = 1,
    /// LoRA branches.
    Lora = 2,
    /// Attention proper: norms, RoPE, scores, softmax, KV cache.
    Attention = 3,
    /// Choosing the next token from the logits.
    Sampling = 4,
}

pub const PARTS: [(Part, &str); 5] = [
    (Part::Projections, "layer projections (fused 4-bit matmul)"),
    (Part::Head, "output head (fused 4-bit matmul)"),
    (Part::Lora, "LoRA branches"),
    (
        Part::Attention,
        "attention core (q/k norm, RoPE, KV cache, softmax)",
    ),
    (Part::Sampling, "sampling (penalty, softmax, filters, draw)"),
];

static NANOS: [AtomicU64; 5] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];

pub fn add(part: Part, since: Instant) {
    NANOS[part as usize].fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

pub fn reset() {
    for n in &NANOS {
        n.store(0, Ordering::Relaxed);
    }
}

/// Seconds spent in each part since the last reset.
pub fn snapshot() -> [f64; 5] {
    let mut out = [0.0; 5];
    for (o, n) in out.iter_mut().zip(&NANOS) {
        *o = n.load(Ordering::Relaxed) as f64 * 1e-9;
    }
    out
}

/// GPU time of one kernel class over profiled forwards (the fused CUDA step's event timings).
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelTime {
    pub name: &'static str,
    pub calls: usize,
    pub ms: f64,
    /// Weight bytes the class read (projections only).
    pub bytes: usize,
}
