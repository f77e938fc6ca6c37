//! `bot debug forward`: the engine's outside interface for tests and for "is my model loaded
//! right?". Prints one JSON object: the last prompt position's logits and greedy ids.

use std::io::Write;

use anyhow::Context;
use serde::Serialize;

use crate::cmd;
use crate::cmd::cli::ForwardArgs;
use crate::engine::{self, Numerics};

#[derive(Serialize)]
struct ForwardReport {
    last_logits: Vec<f32>,
    greedy_ids: Vec<u32>,
}

pub fn forward(args: &ForwardArgs) -> anyhow::Result<()> {
    cmd::init_threads(args.threads)?;
    let opts = args
        .engine
        .options(cmd::select_device(args.device)?, Numerics::Exact);
    let mut model = engine::load(&args.model, args.adapter.as_deref(), &opts)
        .with_context(|| format!("loading the model from {}", args.model.display()))?;
    let (last_logits, greedy_ids) = model.greedy(&args.ids, args.steps)?;
    cmd::say_notes(&mut model);
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
