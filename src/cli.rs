//! Command-line definitions (clap) and nothing else: the commands live in their own modules.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "bot",
    version,
    about = "Write short posts in your voice with a local LoRA-tuned Qwen3"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Developer tools: check that a model is loaded right.
    #[command(subcommand)]
    Debug(DebugCommand),
}

#[derive(Debug, Subcommand)]
pub enum DebugCommand {
    /// Run token ids through the model and print {"last_logits": [...], "greedy_ids": [...]}.
    Forward(ForwardArgs),
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum KernelArg {
    /// f32 activations: bit-for-bit the arithmetic the mlx_lm fixtures are checked with
    Exact,
    /// int8 activations with integer dot products (4-bit weights)
    Fast,
}

#[derive(Debug, Args)]
pub struct ForwardArgs {
    /// mlx_lm model directory
    #[arg(long)]
    pub model: PathBuf,
    /// mlx_lm LoRA adapter directory
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Comma-separated prompt token ids, e.g. 5,17,42
    #[arg(long, value_delimiter = ',', required = true)]
    pub ids: Vec<u32>,
    /// Greedy steps to decode with the KV cache (EOS does not stop them)
    #[arg(long, default_value_t = 0)]
    pub steps: usize,
    /// CPU kernel for the quantized matmuls
    #[arg(long, value_enum, default_value_t = KernelArg::Exact)]
    pub kernel: KernelArg,
    /// Worker threads (default: all cores)
    #[arg(long)]
    pub threads: Option<usize>,
}
