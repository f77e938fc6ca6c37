//! Command-line definitions (clap) and nothing else: the commands live in their own modules.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::engine::device::DeviceKind;
use crate::engine::synthetic::Shape;
use candle_core::Device;

use crate::engine::{CudaStep, ModelOptions, Numerics, QMatmulRoute};

/// A command-line value the program refuses (clap checks the syntax; this, the meaning):
/// exit code 2, like clap's own errors.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadArgument(pub String);

#[derive(Debug, Parser)]
#[command(
    name = "bot",
    version,
    about = "Write short posts in your voice with a local LoRA-tuned Qwen3"
)]
pub struct Cli {
    /// Config file (default: BOT_HOME/config.toml, else the platform config dir's bot/config.toml)
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    /// Named bot from the config's [profiles.NAME] (also BOT_PROFILE): its own model, account and state
    #[arg(long, global = true)]
    pub profile: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Write posts and print them (stdout carries only the posts).
    Generate(GenerateArgs),
    /// Publish a post to Bluesky: generated, or --text; --dry-run shows the exact record.
    Post(PostArgs),
    /// Reply to a post (an at:// URI or a bsky.app link) in the user's voice: published with
    /// the thread's root and parent refs, or --dry-run, or --save to the review queue.
    Reply(ReplyArgs),
    /// Print a post and the thread above it, root first.
    Thread(ThreadArgs),
    /// The profiles as bots talking to each other on a private PDS.
    #[command(subcommand)]
    Sandbox(SandboxCommand),
    /// Delete one of the account's posts: an at:// URI, or `last` (the newest in local history).
    Delete(DeleteArgs),
    /// Log in (or reuse the cached session) and print the account.
    Whoami(AccountArgs),
    /// Add the `bot` self-label to the account's profile (does nothing if it is there).
    LabelBot(AccountArgs),
    /// Generate posts into the review queue.
    Draft(DraftArgs),
    /// List and decide drafts without a terminal UI.
    #[command(subcommand)]
    Queue(QueueCommand),
    /// Walk new drafts in the terminal: approve, reject, edit, regenerate, quit.
    Review(ReviewArgs),
    /// One scheduled run: takes the run lock, respects quiet hours, posts, logs one line.
    Run(RunArgs),
    /// Install, show or remove the schedule (launchd on macOS, cron elsewhere).
    #[command(subcommand)]
    Schedule(ScheduleCommand),
    /// Recent scheduled runs from the run log.
    Log(LogArgs),
    /// Inspect the effective configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Loss and perplexity of held-out posts under the model, per adapter (mlx_lm's test loss).
    Eval(EvalArgs),
    /// Measure load time, prefill and decode speed, memory and bandwidth.
    Bench(BenchArgs),
    /// Show what this install can use: backends, devices, config, model cache, service.
    Doctor,
    /// Developer tools: check that a model is loaded right.
    #[command(subcommand)]
    Debug(DebugCommand),
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print every setting with where it came from (secrets masked).
    Show,
}

/// Model and run-time choices shared by the commands that load a model.
#[derive(Debug, Args, Clone, Default)]
pub struct ModelArgs {
    #[arg(long, help = concat!("mlx_lm model directory or Hugging Face repo id [default: ", crate::setting_default!(model), "]"))]
    pub model: Option<String>,
    /// mlx_lm LoRA adapter directory or Hugging Face repo id [default: DATA_DIR/adapter if present]
    #[arg(long)]
    pub adapter: Option<String>,
    /// Run the base model even when an adapter is configured
    #[arg(long, conflicts_with = "adapter")]
    pub no_adapter: bool,
    #[arg(long, help = concat!("auto, cpu, cuda or metal [default: ", crate::setting_default!(device), "]"))]
    pub device: Option<String>,
    /// Worker threads (default: all cores)
    #[arg(long)]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// How the engine computes: one group, flattened into every command that loads a model.
#[derive(Debug, Args, Clone, Copy, Default)]
pub struct EngineArgs {
    /// Arithmetic of the quantized matmuls [default: fast; `debug forward` and `eval`: exact]
    #[arg(long, value_enum)]
    pub kernel: Option<Numerics>,
    /// Kernels for the quantized projections: ours on the MLX layout, or candle's on Q4_1
    #[arg(long, value_enum, default_value_t = QMatmulRoute::Native)]
    pub qmatmul: QMatmulRoute,
    /// On CUDA: our fused step replayed as a CUDA graph, the same launched kernel by kernel, or candle ops
    #[arg(long, value_enum, default_value_t = CudaStep::Graph)]
    pub cuda_step: CudaStep,
}

impl EngineArgs {
    /// The model options on `device`; `numerics` unless `--kernel` says otherwise.
    pub fn options(&self, device: Device, numerics: Numerics) -> ModelOptions {
        ModelOptions {
            device,
            kernel: self.kernel.unwrap_or(numerics),
            route: self.qmatmul,
            cuda_step: self.cuda_step,
        }
    }
}

/// How posts are written.
#[derive(Debug, Args, Clone, Default)]
pub struct SamplingArgs {
    /// An instruction to use instead of one picked from the prompt list
    #[arg(long)]
    pub prompt: Option<String>,
    /// A prompt list file (one instruction per line) instead of the shipped one
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// A system turn before the instruction
    #[arg(long)]
    pub system: Option<String>,
    #[arg(long, help = concat!("0 is greedy [default: ", crate::setting_default!(temperature), "]"))]
    pub temperature: Option<f32>,
    #[arg(long, help = concat!("Nucleus sampling; 0 or 1 turns it off [default: ", crate::setting_default!(top_p), "]"))]
    pub top_p: Option<f32>,
    #[arg(long, help = concat!("[default: ", crate::setting_default!(min_p), ", off]"))]
    pub min_p: Option<f32>,
    #[arg(long, help = concat!("[default: ", crate::setting_default!(top_k), ", off]"))]
    pub top_k: Option<usize>,
    /// mlx_lm's repetition penalty over the last 20 tokens [default: off]
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Seed of the first post (post i uses SEED+i); default: random, printed with --json
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long, help = concat!("Tokens a post may take [default: ", crate::setting_default!(max_tokens), "]"))]
    pub max_tokens: Option<usize>,
    #[arg(long, help = concat!("Outputs shorter than this (grapheme clusters, after cleaning) are regenerated [default: ", crate::setting_default!(min_chars), "]"))]
    pub min_chars: Option<usize>,
    #[arg(long, help = concat!("Generations per post before giving up [default: ", crate::setting_default!(attempts), "]"))]
    pub attempts: Option<usize>,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Number of posts
    #[arg(short = 'n', long = "count", default_value_t = 1)]
    pub count: usize,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// One JSON object per post per line (text, raw, prompt, seed, tokens, attempts, timings)
    #[arg(long)]
    pub json: bool,
    /// Also store each post as a new draft in the review queue
    #[arg(long)]
    pub save: bool,
    /// Separate posts with NUL bytes instead of a line holding only "---"
    #[arg(short = 'z', long, conflicts_with = "json")]
    pub null: bool,
    /// No progress or timings on stderr
    #[arg(short, long)]
    pub quiet: bool,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Held-out examples: mlx_lm's dataset JSONL ({"messages": [...]}, {"prompt", "completion"} or {"text"})
    #[arg(long)]
    pub data: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Also evaluate these adapters (directories or Hub repo ids; `none` for the base model)
    #[arg(long, num_args = 1..)]
    pub compare: Vec<String>,
    /// Evaluate only the first N examples
    #[arg(long)]
    pub max_examples: Option<usize>,
    /// Score the whole conversation, prompt included (mlx_lm's default); by default only the
    /// last message (the answer, or the completion) is scored, as mlx_lm's `--mask-prompt`
    #[arg(long)]
    pub no_mask_prompt: bool,
    /// Also score what mlx_lm's loss scores after each example: the padding id 0 (reproduces
    /// `mlx_lm.lora --test --batch-size 1 --test-batches -1`)
    #[arg(long)]
    pub mlx_pad_target: bool,
    /// One JSON object per adapter per line
    #[arg(long)]
    pub json: bool,
    /// No progress on stderr
    #[arg(short, long)]
    pub quiet: bool,
}

/// The Bluesky account (the app password comes only from BOT_BSKY_APP_PASSWORD, the config's
/// password_file, or a prompt on a terminal: never from the command line).
#[derive(Debug, Args, Clone, Default)]
pub struct AccountArgs {
    #[arg(long, help = concat!("Login host [default: ", crate::setting_default!(service), "] (also BOT_BSKY_SERVICE)"))]
    pub service: Option<String>,
    /// Account handle, e.g. alice.bsky.social (also BOT_BSKY_HANDLE)
    #[arg(long)]
    pub handle: Option<String>,
}

#[derive(Debug, Args)]
pub struct PostArgs {
    /// Publish this text instead of generating one (checked against the limits, not rewritten)
    #[arg(long, conflicts_with = "next")]
    pub text: Option<String>,
    /// Publish the oldest approved draft instead (exit 0 with a message when there is none)
    #[arg(long)]
    pub next: bool,
    #[command(flatten)]
    pub guard: GuardArgs,
    /// Do everything but the write: print the record, its counts and the call it would make
    #[arg(long)]
    pub dry_run: bool,
    /// Print the result as one JSON object
    #[arg(long)]
    pub json: bool,
    /// No progress or timings on stderr
    #[arg(short, long)]
    pub quiet: bool,
    #[command(flatten)]
    pub account: AccountArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

#[derive(Debug, Args)]
pub struct ReplyArgs {
    /// The post to answer: at://DID_OR_HANDLE/app.bsky.feed.post/RKEY or a bsky.app link
    #[arg(long)]
    pub to: String,
    /// Reply with this text instead of generating one (checked against the limits)
    #[arg(long)]
    pub text: Option<String>,
    /// Put the reply in the review queue instead of publishing it
    #[arg(long, conflicts_with = "dry_run")]
    pub save: bool,
    /// Reply even if this account has answered the post already (by default that reply's
    /// URI is printed and nothing is sent)
    #[arg(long)]
    pub again: bool,
    #[command(flatten)]
    pub guard: GuardArgs,
    /// Do everything but the write: print the record with its reply refs
    #[arg(long)]
    pub dry_run: bool,
    /// Print the result as one JSON object
    #[arg(long)]
    pub json: bool,
    /// No progress or timings on stderr
    #[arg(short, long)]
    pub quiet: bool,
    #[command(flatten)]
    pub account: AccountArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

// parsed once a process: the size of its largest variant does not matter
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum SandboxCommand {
    /// Start the sandbox's own PDS on loopback (installed from the npm registry on first use;
    /// its data persists), or use --service; then an account for each profile (all of the
    /// config's, or --profiles a,b); prints the service
    Up {
        /// Use this PDS instead of starting one
        #[arg(long)]
        service: Option<String>,
        /// The port of the sandbox's own PDS (its PLC directory takes the one below)
        #[arg(long, default_value_t = 2683)]
        port: u16,
        #[arg(long)]
        profiles: Option<String>,
    },
    /// Stop the sandbox's own PDS (its data stays)
    Down,
    /// The service, the members and the rounds done, as JSON
    Status,
    /// Rounds until the conversation has --rounds complete ones (a killed round is finished
    /// first); each member replies to another's newest post it has not answered, or posts
    Converse {
        #[arg(long, default_value_t = 1)]
        rounds: u32,
        /// How often a member replies rather than posts (when there is something to answer)
        #[arg(long, default_value_t = 0.7)]
        reply_ratio: f64,
        /// Only these members (at least two)
        #[arg(long)]
        profiles: Option<String>,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        sampling: SamplingArgs,
        #[arg(short, long)]
        quiet: bool,
    },
    /// A static page of the conversations (index.html + style.css, no scripts, no external
    /// requests) for a personal website
    Page {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "The bots' sandbox")]
        title: String,
    },
}

#[derive(Debug, Args)]
pub struct ThreadArgs {
    /// A post: at://DID_OR_HANDLE/app.bsky.feed.post/RKEY or a bsky.app link
    pub uri: String,
    /// One JSON object a post
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub account: AccountArgs,
}

/// The duplicate guard.
#[derive(Debug, Args, Clone)]
pub struct GuardArgs {
    /// Refuse a post at least this similar (0-1, character trigrams) to a recent one
    #[arg(long, default_value_t = 0.85)]
    pub max_similarity: f64,
    /// How many recent posts (local history and the account's records) to compare with
    #[arg(long, default_value_t = 50)]
    pub history: u32,
    /// mlx_lm chat JSONL the adapter was trained on: refuse posts copying a run of its words
    #[arg(long)]
    pub training_data: Option<PathBuf>,
    /// With --training-data: how many consecutive words count as copying
    #[arg(long, default_value_t = 10)]
    pub copied_words: usize,
}

#[derive(Debug, Args)]
pub struct DraftArgs {
    /// Number of drafts
    #[arg(short = 'n', long = "count", default_value_t = 1)]
    pub count: usize,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[arg(short, long)]
    pub quiet: bool,
}

#[derive(Debug, Subcommand)]
pub enum QueueCommand {
    /// Drafts, oldest first
    List {
        #[arg(long)]
        json: bool,
        /// Only drafts with this status (new, approved, rejected, posted)
        #[arg(long)]
        status: Option<String>,
    },
    Approve {
        ids: Vec<i64>,
    },
    Reject {
        ids: Vec<i64>,
    },
    /// Delete new and rejected drafts
    Clear,
}

#[derive(Debug, Args)]
pub struct ReviewArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum RunMode {
    /// Publish the oldest approved draft; with none, do nothing
    Queue,
    /// Generate and publish (the original bot's behaviour)
    Auto,
    /// Answer the accounts that mentioned the bot or replied to it (opt-in): each post once,
    /// never itself, within --max-replies-per-thread and --max-replies-per-hour
    Replies,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[arg(long, value_enum, default_value_t = RunMode::Queue)]
    pub mode: RunMode,
    /// Wait a random time up to this long first (e.g. 10m), so posts do not land on the minute
    #[arg(long)]
    pub jitter: Option<String>,
    /// Do nothing between these local times, e.g. 23:00-08:00
    #[arg(long)]
    pub quiet_hours: Option<String>,
    #[command(flatten)]
    pub replies: RepliesArgs,
    #[command(flatten)]
    pub guard: GuardArgs,
    #[command(flatten)]
    pub account: AccountArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// `--mode replies`.
#[derive(Debug, Args, Clone)]
pub struct RepliesArgs {
    /// At most this many of the bot's replies in one thread
    #[arg(long, default_value_t = 3)]
    pub max_replies_per_thread: usize,
    /// At most this many replies an hour
    #[arg(long, default_value_t = 10)]
    pub max_replies_per_hour: usize,
    /// Put the replies in the review queue instead of publishing them
    #[arg(long)]
    pub save_replies: bool,
    /// Read these accounts' repos (DIDs, comma-separated) for mentions instead of the
    /// notifications, which need an AppView (the sandbox has none)
    #[arg(long)]
    pub mentions_from: Option<String>,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum ScheduleTarget {
    Launchd,
    Cron,
}

#[derive(Debug, Args)]
pub struct ScheduleSpec {
    /// How often, e.g. 30m, 1h, 6h
    #[arg(long, default_value = "1h")]
    pub every: String,
    #[arg(long)]
    pub jitter: Option<String>,
    #[arg(long, value_enum, default_value_t = RunMode::Queue)]
    pub mode: RunMode,
    #[arg(long)]
    pub quiet_hours: Option<String>,
    /// Only print what would be installed
    #[arg(long)]
    pub print: bool,
    /// launchd or cron [default: launchd on macOS, cron elsewhere]
    #[arg(long, value_enum)]
    pub target: Option<ScheduleTarget>,
}

#[derive(Debug, Subcommand)]
pub enum ScheduleCommand {
    Install(ScheduleSpec),
    Show {
        #[arg(long, value_enum)]
        target: Option<ScheduleTarget>,
    },
    Remove {
        #[arg(long, value_enum)]
        target: Option<ScheduleTarget>,
    },
}

#[derive(Debug, Args)]
pub struct LogArgs {
    #[arg(short = 'n', default_value_t = 20)]
    pub n: usize,
}

#[derive(Debug, Args)]
pub struct DeleteArgs {
    /// at://DID/app.bsky.feed.post/RKEY, or `last`
    pub target: String,
    #[command(flatten)]
    pub account: AccountArgs,
}

#[derive(Debug, Subcommand)]
pub enum DebugCommand {
    /// Run token ids through the model and print {"last_logits": [...], "greedy_ids": [...]}.
    Forward(ForwardArgs),
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
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
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
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How decode picks tokens: `default` (the user's default sampler, as `bot generate`),
    /// `greedy`, or settings like `t=0.95,top_p=0.9,min_p=0,top_k=0,rep=1.1`
    #[arg(long, default_value = "default")]
    pub sampler: String,
    /// After the timed runs, one more decode pass timing every GPU kernel with CUDA events
    /// (the fused CUDA step only)
    #[arg(long)]
    pub kernel_times: bool,
    /// One JSON object on stdout instead of a table
    #[arg(long)]
    pub json: bool,
}
