//! The command handlers (what `main.rs` dispatches to) and their shared glue: settings from
//! the command line, the model loaded with progress on stderr, the product on stdout.

pub mod bench;
pub mod cli;
pub mod debug;
pub mod doctor;
pub mod eval;
pub mod generate;
pub mod post;
pub mod queue;
pub mod reply;
pub mod sandbox;
pub mod schedule;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::ValueEnum;

use crate::app::hub::{self, HubEnv, Kind};
use crate::app::settings::{process_env, Overrides, Settings};
use crate::cmd::cli::{BadArgument, GenerateArgs, ModelArgs, SamplingArgs};
use crate::engine::device::{self, DeviceKind};
use crate::engine::sample::SamplerParams;
use crate::engine::Numerics;
use crate::generate::{Event, Generator, Post, PostRequest};

pub fn overrides(m: &ModelArgs, s: &SamplingArgs) -> Overrides {
    model_overrides(m)
        .with("prompts", s.prompts.as_ref().map(|p| p.display()))
        .with("system", s.system.as_ref())
        .with("temperature", s.temperature)
        .with("top_p", s.top_p)
        .with("min_p", s.min_p)
        .with("top_k", s.top_k)
        .with("repetition_penalty", s.repetition_penalty)
        .with("max_tokens", s.max_tokens)
        .with("min_chars", s.min_chars)
        .with("attempts", s.attempts)
}

/// The settings the model flags override (every command that loads a model).
pub fn model_overrides(m: &ModelArgs) -> Overrides {
    Overrides::default()
        .with("model", m.model.as_ref())
        .with("adapter", m.adapter.as_ref())
        .with("device", m.device.as_ref())
        .with("threads", m.threads)
}

/// The `device` setting, parsed.
pub fn device_kind(settings: &Settings) -> anyhow::Result<DeviceKind> {
    DeviceKind::from_str(&settings.device.value, true).map_err(|_| {
        anyhow::anyhow!(
            "invalid device {:?} (from {}): expected auto, cpu, cuda or metal",
            settings.device.value,
            settings.device.source
        )
    })
}

pub fn load_settings(
    config: Option<&Path>,
    profile: Option<&str>,
    o: &Overrides,
) -> anyhow::Result<Settings> {
    Ok(Settings::load(config, profile, o, &process_env)?)
}

/// Loads the model (and adapter) the settings name, fetching them from the Hub if needed.
pub fn load_generator(
    settings: &Settings,
    m: &ModelArgs,
    verbose: bool,
) -> anyhow::Result<(Generator, String)> {
    init_threads(settings.threads.value)?;
    let env = HubEnv::from_env();
    let progress = verbose && std::io::stderr().is_terminal();
    let model_dir = hub::resolve(&settings.model.value, Kind::Model, &env, verbose, progress)?;
    let adapter_dir: Option<PathBuf> = match (&settings.adapter.value, m.no_adapter) {
        (Some(a), false) => Some(hub::resolve(a, Kind::Adapter, &env, verbose, progress)?),
        _ => None,
    };
    let opts = m
        .engine
        .options(select_device(device_kind(settings)?)?, Numerics::Fast);
    let t = Instant::now();
    let mut generator = Generator::load(&model_dir, adapter_dir.as_deref(), &opts)
        .with_context(|| format!("loading model {}", model_dir.display()))?;
    say_notes(&mut generator.model);
    let label = match &adapter_dir {
        Some(a) => format!("{} + adapter {}", settings.model.value, a.display()),
        None => format!("{} (no adapter)", settings.model.value),
    };
    if verbose {
        eprintln!(
            "loaded {label} in {:.2} s on {}",
            t.elapsed().as_secs_f64(),
            if opts.device.is_cpu() { "cpu" } else { "gpu" }
        );
    }
    Ok((generator, label))
}

pub fn post_request(
    settings: &Settings,
    s: &SamplingArgs,
    seed: u64,
) -> anyhow::Result<PostRequest> {
    Ok(PostRequest {
        prompt: s.prompt.clone(),
        prompts: crate::generate::load_prompts(settings.prompts.value.as_deref())?,
        system: settings.system.value.clone(),
        sampler: SamplerParams {
            temperature: settings.temperature.value,
            top_p: settings.top_p.value,
            min_p: settings.min_p.value,
            top_k: settings.top_k.value,
            repetition_penalty: settings.repetition_penalty.value.unwrap_or(1.0),
            repetition_context: 20,
        },
        seed,
        max_tokens: settings.max_tokens.value,
        min_chars: settings.min_chars.value,
        attempts: settings.attempts.value,
    })
}

/// A spinner on a terminal's stderr while a post is being written.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    pub fn new(enabled: bool) -> Self {
        let bar = (enabled && std::io::stderr().is_terminal()).then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            b.enable_steady_tick(std::time::Duration::from_millis(120));
            b
        });
        Progress { bar }
    }

    pub fn event(&self, label: &str, e: &Event) {
        if let Some(b) = &self.bar {
            match e {
                Event::Attempt { attempt } => b.set_message(format!("{label}: attempt {attempt}")),
                Event::Token { count, .. } => b.set_message(format!("{label}: {count} tokens")),
            }
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

pub fn report_post(p: &Post, i: usize, n: usize) {
    eprintln!(
        "post {}/{}: {} prompt tokens ({} cached) at {:.1} tok/s, {} tokens at {:.1} tok/s, {} attempt(s), seed {}",
        i + 1,
        n,
        p.prompt_tokens,
        p.prompt_tokens_reused,
        p.prefill_tok_s,
        p.tokens,
        p.decode_tok_s,
        p.attempts,
        p.seed
    );
}

/// Sizes the global worker pool once; later calls keep the first size. A count past
/// `settings::MAX_THREADS` is refused (each is an OS thread; 100000 would hang the start).
/// Also the rest of the process's set-up for the CPU engine: `BOT_CPU_ISA` checked, freed
/// buffers kept for reuse (`heap`).
pub fn init_threads(threads: Option<usize>) -> Result<(), BadArgument> {
    crate::engine::cpu::isa::check_env().map_err(BadArgument)?;
    crate::engine::cpu::heap::keep_freed_buffers();
    if let Some(n) = threads {
        if !(1..=crate::app::settings::MAX_THREADS).contains(&n) {
            return Err(BadArgument(format!(
                "--threads {n}: expected 1 to {}",
                crate::app::settings::MAX_THREADS
            )));
        }
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
    }
    Ok(())
}

/// Tells the user, on stderr, what the engine noted about how the model runs (fallbacks).
/// The device for `kind`; why `auto` passed over a GPU goes to stderr.
pub fn select_device(kind: DeviceKind) -> anyhow::Result<candle_core::Device> {
    let s = device::select(kind)?;
    if let Some(n) = s.note {
        eprintln!("note: {n}");
    }
    Ok(s.device)
}

pub fn say_notes(model: &mut crate::engine::Qwen3) {
    for n in model.take_notes() {
        eprintln!("note: {n}");
    }
}
