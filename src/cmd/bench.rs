//! `bot bench`: load time, prefill and decode speed (medians of repeats after a warm-up), peak
//! resident memory, bytes of weights read per decoded token and the bandwidth that implies, and
//! where a decode step's time goes. Prints a table, or one JSON object with `--json`.

use std::time::Instant;

use anyhow::Context;
use serde::Serialize;

use crate::cmd::cli::BenchArgs;
use crate::engine::sample::{recent_distinct, Draw, SampleStep, SamplerParams};
use crate::engine::{self, profile, synthetic, Numerics, Qwen3};

#[derive(Serialize)]
pub struct Report {
    pub model: String,
    pub device: String,
    pub kernel: String,
    /// The CPU kernels' instruction set (`avx2`, `neon`, `scalar`; `BOT_CPU_ISA` overrides).
    pub cpu_isa: String,
    pub threads: usize,
    pub lora: bool,
    /// The sampler decode ran with (`--sampler`): `greedy`, or its settings.
    pub sampler: String,
    pub load_s: f64,
    /// How the weights are held on the host: the file mapped, or read into huge pages and how
    /// much of them the kernel gave 2 MiB pages (`engine/resident.rs`).
    pub weights_memory: String,
    /// The same of the CPU decode's copy where it made one (`cpu/tile16.rs`: Intel's CPUs
    /// with AVX-512), which is then what decode reads; `null` otherwise.
    pub decode_copy_memory: Option<String>,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub peak_rss_bytes: u64,
    pub weight_bytes_per_token: usize,
    pub decode_bandwidth_gb_s: f64,
    /// Share of prefill time per part (same order as `engine::profile::PARTS`), rest last.
    pub prefill_time_split: Vec<(String, f64)>,
    /// The same for decode.
    pub decode_time_split: Vec<(String, f64)>,
    /// With an adapter on the CPU: how much longer a decode step takes with its branches than
    /// without, from one more pass that turns them on and off token by token (`lora_cost`).
    pub lora_decode_cost: Option<f64>,
    /// With `--kernel-times`: GPU time per kernel class over one more decode pass.
    pub kernel_times: Vec<KernelRow>,
    /// The same for that pass's prompt; `us_per_token` is then per prompt token.
    pub prefill_kernel_times: Vec<KernelRow>,
}

#[derive(Serialize)]
pub struct KernelRow {
    pub kernel: String,
    pub us_per_token: f64,
    pub share: f64,
    /// Weight bytes read per second while the class ran (projections only).
    pub gb_s: Option<f64>,
}

/// An adapter's decode cost from one more pass whose steps alternate with and without its
/// branches, so that a shared machine's busy minutes fall on both alike (separate runs of a
/// few seconds each differed by more than the cost itself): mean time per step with the
/// branches over without, minus one.
fn lora_cost(m: &mut Qwen3, d: &mut Decoder, prompt: &[u32], gen: usize) -> anyhow::Result<f64> {
    m.reset();
    let mut id = d.first(m, prompt)?;
    let mut secs = [0.0f64; 2];
    let mut steps = [0usize; 2];
    let mut run = || -> anyhow::Result<()> {
        for i in 0..gen {
            let off = i % 2;
            m.suspend_lora(off == 1);
            let t = Instant::now();
            id = d.next(m, id)?;
            secs[off] += t.elapsed().as_secs_f64();
            steps[off] += 1;
        }
        Ok(())
    };
    let done = run();
    m.suspend_lora(false);
    done?;
    Ok((secs[0] / steps[0] as f64) / (secs[1] / steps[1] as f64) - 1.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Peak resident set size of this process so far, in bytes.
pub fn peak_rss_bytes() -> u64 {
    // SAFETY: getrusage writes into the struct we pass and reads nothing else.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0;
    }
    let v = ru.ru_maxrss as u64;
    if cfg!(target_os = "macos") {
        v // bytes on macOS
    } else {
        v * 1024 // KiB on Linux
    }
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    crate::cmd::init_threads(args.threads)?;
    if let (Some(shape), Some(dir)) = (args.synthetic, &args.save) {
        let t = Instant::now();
        synthetic::save(shape, args.seed, dir, args.tokenizer_dir.as_deref())?;
        if args.tokenizer_dir.is_none() {
            eprintln!(
                "note: no --tokenizer-dir given: {} has no tokenizer files",
                dir.display()
            );
        }
        eprintln!(
            "wrote {} in {:.1} s",
            dir.display(),
            t.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    let dev = crate::cmd::select_device(args.device)?;
    let opts = args.engine.options(dev.clone(), Numerics::Fast);
    let residency = engine::resident::Residency::for_device(&dev);
    // the store is kept to the end: how the kernel holds its bytes is read after the runs
    let (mut model, load_s, name, store) = if let Some(dir) = &args.model {
        let t = Instant::now();
        let adapter = match (&args.adapter, args.synthetic_lora) {
            (Some(a), _) => Some(engine::Adapter::load(a, &dev)?),
            (None, true) => {
                let cfg = engine::Qwen3Config::from_dir(dir)?;
                Some(synthetic::lora(&cfg, args.seed, &dev)?)
            }
            _ => None,
        };
        let cfg = engine::Qwen3Config::from_dir(dir)?;
        let store = engine::WeightStore::open_dir_with(dir, residency)?;
        let m = Qwen3::new(cfg, &store, adapter, &opts)
            .with_context(|| format!("loading {}", dir.display()))?;
        (
            m,
            t.elapsed().as_secs_f64(),
            dir.display().to_string(),
            store,
        )
    } else {
        let shape = args
            .synthetic
            .context("--model or --synthetic is required")?;
        let t = Instant::now();
        let (cfg, store) = synthetic::build(shape, args.seed, residency)?;
        eprintln!("built random weights in {:.1} s", t.elapsed().as_secs_f64());
        let t = Instant::now();
        let adapter = match (&args.adapter, args.synthetic_lora) {
            (Some(a), _) => Some(engine::Adapter::load(a, &dev)?),
            (None, true) => Some(synthetic::lora(&cfg, args.seed, &dev)?),
            _ => None,
        };
        let m = Qwen3::new(cfg, &store, adapter, &opts)?;
        (
            m,
            t.elapsed().as_secs_f64(),
            format!("synthetic {shape:?}"),
            store,
        )
    };
    crate::cmd::say_notes(&mut model);
    let vocab = model.cfg.vocab_size.min(151_643) as u64;
    let prompt: Vec<u32> = (0..args.prompt_tokens as u64)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ args.seed) % vocab) as u32)
        .collect();

    let sampler = parse_sampler(&args.sampler)?;
    let params = sampler.resolve(model.cfg.vocab_size);
    let mut decoder = Decoder {
        params,
        context: sampler
            .penalty_active()
            .then_some(sampler.repetition_context),
        seed: args.seed,
        history: Vec::new(),
        recent: Vec::new(),
    };
    // Prefill and decode seconds, each with the profile counters of its phase.
    type Phase = (f64, [f64; PARTS]);
    let mut step = |m: &mut Qwen3, gen: usize| -> anyhow::Result<(Phase, Phase)> {
        m.reset();
        profile::reset();
        let t = Instant::now();
        let mut id = decoder.first(m, &prompt)?;
        let prefill = (t.elapsed().as_secs_f64(), profile::snapshot());
        profile::reset();
        let t = Instant::now();
        for _ in 0..gen {
            id = decoder.next(m, id)?;
        }
        Ok((prefill, (t.elapsed().as_secs_f64(), profile::snapshot())))
    };
    step(&mut model, args.gen_tokens.min(8))?; // warm-up: page in weights, size buffers
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    let (mut pre_total, mut decode_total) = ((0.0, [0.0; PARTS]), (0.0, [0.0; PARTS]));
    let add = |total: &mut Phase, (s, parts): Phase| {
        total.0 += s;
        total.1.iter_mut().zip(parts).for_each(|(a, b)| *a += b);
    };
    for _ in 0..args.repeats.max(1) {
        let (p, d) = step(&mut model, args.gen_tokens)?;
        pre.push(args.prompt_tokens as f64 / p.0);
        dec.push(args.gen_tokens as f64 / d.0);
        add(&mut pre_total, p);
        add(&mut decode_total, d);
    }
    let (mut kernel_times, mut prefill_kernel_times) = (Vec::new(), Vec::new());
    if args.kernel_times {
        if !model.uses_fused_step() {
            anyhow::bail!("--kernel-times needs the fused CUDA step (--device cuda, --qmatmul native, --cuda-step graph or eager)");
        }
        model.profile_kernels(true);
        profile_pass(
            &mut model,
            &mut decoder,
            &prompt,
            args.gen_tokens,
            &mut prefill_kernel_times,
            &mut kernel_times,
        )?;
        model.profile_kernels(false);
    }
    let lora = args.adapter.is_some() || args.synthetic_lora;
    // two steps at least: one with the branches, one without
    let lora_decode_cost = if lora && !model.uses_fused_step() && args.gen_tokens >= 2 {
        Some(lora_cost(
            &mut model,
            &mut decoder,
            &prompt,
            args.gen_tokens,
        )?)
    } else {
        None
    };
    let decode_tok_s = median(dec);
    let bytes = model.weight_bytes_per_token();
    let report = Report {
        model: name,
        device: format!("{dev:?}"),
        kernel: format!("{:?}", opts.kernel).to_lowercase(),
        cpu_isa: engine::cpu::isa::active().name().into(),
        threads: rayon::current_num_threads(),
        lora,
        sampler: describe(&sampler),
        load_s,
        weights_memory: store.describe_memory(),
        decode_copy_memory: model.describe_cpu_copy(),
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        prefill_tok_s: median(pre),
        decode_tok_s,
        peak_rss_bytes: peak_rss_bytes(),
        weight_bytes_per_token: bytes,
        decode_bandwidth_gb_s: bytes as f64 * decode_tok_s / 1e9,
        prefill_time_split: time_split(pre_total),
        decode_time_split: time_split(decode_total),
        lora_decode_cost,
        kernel_times,
        prefill_kernel_times,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// Shares of a phase's wall time per profiled part, the rest last; empty where no part was
/// timed (the fused CUDA step keeps no host-side counters: see `--kernel-times`).
fn time_split((total, parts): (f64, [f64; PARTS])) -> Vec<(String, f64)> {
    if parts.iter().all(|&p| p == 0.0) {
        return Vec::new();
    }
    let mut split: Vec<(String, f64)> = profile::PARTS
        .iter()
        .zip(parts)
        .map(|((_, n), s)| (n.to_string(), s / total))
        .collect();
    let rest = 1.0 - split.iter().map(|(_, f)| f).sum::<f64>();
    split.push((
        "everything else (embedding, norms, residuals, candle overhead)".into(),
        rest,
    ));
    split
}

/// One profiled pass, `prompt` then `gen` decoded tokens: GPU time per kernel class of each.
fn profile_pass(
    m: &mut Qwen3,
    decoder: &mut Decoder,
    prompt: &[u32],
    gen: usize,
    prefill: &mut Vec<KernelRow>,
    decode: &mut Vec<KernelRow>,
) -> anyhow::Result<()> {
    m.reset();
    let mut id = decoder.first(m, prompt)?;
    *prefill = kernel_rows(m.kernel_times()?, prompt.len());
    for _ in 0..gen {
        id = decoder.next(m, id)?;
    }
    *decode = kernel_rows(m.kernel_times()?, gen);
    Ok(())
}

const PARTS: usize = profile::PARTS.len();

/// The token loop of `bot generate` without the text: each step samples with the user's
/// sampler where the logits are, as generation does.
struct Decoder {
    params: engine::sample::KernelParams,
    /// The penalty's context, when one is active.
    context: Option<usize>,
    seed: u64,
    history: Vec<u32>,
    recent: Vec<u32>,
}

impl Decoder {
    fn first(&mut self, m: &mut Qwen3, prompt: &[u32]) -> anyhow::Result<u32> {
        self.history.clear();
        self.history.extend_from_slice(prompt);
        self.step(m, prompt)
    }

    fn next(&mut self, m: &mut Qwen3, id: u32) -> anyhow::Result<u32> {
        self.history.push(id);
        self.step(m, &[id])
    }

    fn step(&mut self, m: &mut Qwen3, ids: &[u32]) -> anyhow::Result<u32> {
        if let Some(c) = self.context {
            recent_distinct(&self.history, c, &mut self.recent);
        }
        let s = SampleStep {
            params: self.params,
            recent: &self.recent,
            draw: Draw {
                seed: self.seed,
                counter: self.history.len() as u64,
            },
        };
        Ok(m.next_token(ids, &s)?.id)
    }
}

/// `--sampler`: `greedy`, `default` (the user's default: temperature 0.95, top-p 0.9), or
/// settings like `t=0.95,top_p=0.9,min_p=0,top_k=0,rep=1.1`.
pub fn parse_sampler(spec: &str) -> anyhow::Result<SamplerParams> {
    let p = match spec.trim() {
        "greedy" => SamplerParams::greedy(),
        "default" => crate::app::settings::default_sampler(),
        s => {
            let mut p = SamplerParams {
                top_p: 1.0,
                ..SamplerParams::default()
            };
            for kv in s.split(',').filter(|kv| !kv.trim().is_empty()) {
                let (k, v) = kv
                    .split_once('=')
                    .with_context(|| format!("--sampler: `{kv}` is not KEY=VALUE"))?;
                let num = |v: &str| -> anyhow::Result<f32> {
                    v.trim()
                        .parse::<f32>()
                        .with_context(|| format!("--sampler: `{kv}`: not a number"))
                };
                match k.trim() {
                    "t" | "temp" | "temperature" => p.temperature = num(v)?,
                    "top_p" => p.top_p = num(v)?,
                    "min_p" => p.min_p = num(v)?,
                    "top_k" => {
                        p.top_k = v
                            .trim()
                            .parse()
                            .with_context(|| format!("--sampler: `{kv}`: not a count"))?
                    }
                    "rep" | "repetition_penalty" => p.repetition_penalty = num(v)?,
                    other => anyhow::bail!(
                        "--sampler: unknown setting `{other}` (expected t, top_p, min_p, top_k, rep)"
                    ),
                }
            }
            p
        }
    };
    p.validate()
        .map_err(|e| anyhow::anyhow!("--sampler {spec:?}: {e}"))?;
    Ok(p)
}

fn describe(p: &SamplerParams) -> String {
    if p.is_greedy() {
        return "greedy".into();
    }
    format!(
        "t={},top_p={},min_p={},top_k={},rep={}",
        p.temperature, p.top_p, p.min_p, p.top_k, p.repetition_penalty
    )
}

fn kernel_rows(times: Vec<profile::KernelTime>, tokens: usize) -> Vec<KernelRow> {
    let total: f64 = times.iter().map(|t| t.ms).sum();
    times
        .into_iter()
        .map(|t| KernelRow {
            kernel: t.name.to_string(),
            us_per_token: t.ms * 1e3 / tokens.max(1) as f64,
            share: t.ms / total,
            gb_s: (t.bytes > 0).then(|| t.bytes as f64 / (t.ms * 1e-3) / 1e9),
        })
        .collect()
}

fn print_table(r: &Report) {
    println!("model            {}", r.model);
    println!(
        "device           {} ({} threads, {} kernel, cpu {}{})",
        r.device,
        r.threads,
        r.kernel,
        r.cpu_isa,
        if r.lora { ", LoRA" } else { "" }
    );
    println!("sampler          {}", r.sampler);
    println!("load             {:.3} s", r.load_s);
    println!("weights memory   {}", r.weights_memory);
    if let Some(copy) = &r.decode_copy_memory {
        println!("decode copy      {copy}");
    }
    println!(
        "prefill          {:.1} tok/s ({} tokens)",
        r.prefill_tok_s, r.prompt_tokens
    );
    println!(
        "decode           {:.2} tok/s ({} tokens)",
        r.decode_tok_s, r.gen_tokens
    );
    if let Some(c) = r.lora_decode_cost {
        println!(
            "LoRA cost        {:+.1}% decode time (branches on and off by turns, one pass)",
            100.0 * c
        );
    }
    println!(
        "peak RSS         {:.1} MiB",
        r.peak_rss_bytes as f64 / (1 << 20) as f64
    );
    println!(
        "weights/token    {:.1} MB -> {:.1} GB/s",
        r.weight_bytes_per_token as f64 / 1e6,
        r.decode_bandwidth_gb_s
    );
    for (phase, split) in [
        ("prefill", &r.prefill_time_split),
        ("decode", &r.decode_time_split),
    ] {
        if split.is_empty() {
            continue;
        }
        println!("{phase} time split:");
        for (name, f) in split {
            println!("  {:5.1}%  {name}", 100.0 * f);
        }
    }
    for (rows, what, tokens) in [
        (
            &r.prefill_kernel_times,
            "GPU time of the prompt",
            r.prompt_tokens as f64,
        ),
        (&r.kernel_times, "GPU time per decoded token", 1.0),
    ] {
        if rows.is_empty() {
            continue;
        }
        let total: f64 = rows.iter().map(|k| k.us_per_token).sum::<f64>() * tokens;
        println!("{what} ({total:.0} us in kernels, CUDA events; us per token below):");
        for k in rows {
            let bw = k
                .gb_s
                .map(|g| format!("  {g:6.0} GB/s"))
                .unwrap_or_default();
            println!(
                "  {:5.1}%  {:8.1} us  {}{bw}",
                100.0 * k.share,
                k.us_per_token,
                k.kernel
            );
        }
    }
}
