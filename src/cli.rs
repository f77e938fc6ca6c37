//! Command-line definitions (clap) and nothing else: the commands live in their own modules.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::engine::device::DeviceKind;
use crate::engine::synthetic::Shape;

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
    /// Measure load time, prefill and decode speed, memory and bandwidth.
    Bench(BenchArgs),
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
    /// 15-bit integer activations with AVX2 integer dot products (4-bit weights)
    Fast,
    /// 8-bit integer activations (4-bit weights): fastest, least exact
    Int8,
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

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "synthetic"])))]
#[command(group(clap::ArgGroup::new("lora").args(["adapter", "synthetic_lora"])))]
pub struct BenchArgs {
    /// mlx_lm model directory
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Random 4-bit group-64 weights of a real Qwen3 shape, built in memory
    #[arg(long, value_enum)]
    pub synthetic: Option<Shape>,
    /// With --synthetic: write the model as an mlx_lm directory instead of benchmarking
    #[arg(long, requires = "synthetic")]
    pub save: Option<PathBuf>,
    /// With --save: copy tokenizer.json and tokenizer_config.json from this directory
    #[arg(long, requires = "save", env = "BOT_TOKENIZER_DIR")]
    pub tokenizer_dir: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Worker threads (default: all cores)
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long, default_value_t = 64)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Timed repeats after one warm-up; medians are reported
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// mlx_lm LoRA adapter directory
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// A random rank-8 adapter on all seven projections of the last 16 layers
    #[arg(long)]
    pub synthetic_lora: bool,
    /// CPU kernel for the quantized matmuls
    #[arg(long, value_enum, default_value_t = KernelArg::Fast)]
    pub kernel: KernelArg,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// One JSON object on stdout instead of a table
    #[arg(long)]
    pub json: bool,
}
