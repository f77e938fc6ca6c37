//! `bot debug forward`: the engine's outside interface for tests and for "is my model loaded
//! right?". Prints one JSON object: the last prompt position's logits and greedy ids.

use std::io::Write;

use anyhow::Context;
use serde::Serialize;

use crate::cli::ForwardArgs;
use crate::engine::{self, Numerics};

#[derive(Serialize)]
struct ForwardReport {
    last_logits: Vec<f32>,
    greedy_ids: Vec<u32>,
}

/// Sizes the global worker pool once; later calls keep the first size. A count past
/// `settings::MAX_THREADS` is refused (each is an OS thread; 100000 would hang the start).
pub fn init_threads(threads: Option<usize>) -> Result<(), crate::exit::BadArgument> {
    if let Some(n) = threads {
        if !(1..=crate::settings::MAX_THREADS).contains(&n) {
            return Err(crate::exit::BadArgument(format!(
                "--threads {n}: expected 1 to {}",
                crate::settings::MAX_THREADS
            )));
        }
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
    }
    Ok(())
}

pub fn forward(args: &ForwardArgs) -> anyhow::Result<()> {
    init_threads(args.threads)?;
    let opts = args
        .engine
        .options(crate::engine::device::select(args.device)?, Numerics::Exact);
    let mut model = engine::load(&args.model, args.adapter.as_deref(), &opts)
        .with_context(|| format!("loading the model from {}", args.model.display()))?;
    let (last_logits, greedy_ids) = model.greedy(&args.ids, args.steps)?;
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(
        &mut out,
        &ForwardReport {
            last_logits,
            greedy_ids,
        },
    )?;
    writeln!(out)?;
    Ok(())
}
