//! `bot eval`: the mean token loss and perplexity of held-out examples under the model, for
//! the configured adapter (or none) and every `--compare` adapter, with the same runtime that
//! publishes (runtime LoRA on the quantized base). The report is the product: a table, or one
//! JSON object per adapter, on stdout; progress and skips on stderr.

use serde::Serialize;

use super::*;
use crate::cmd::cli::{BadArgument, EvalArgs};
use crate::engine::{self, EngineError};
use crate::eval::template::ChatTemplate;
use crate::eval::{data, score, EvalError, Renderer, Score, Tokenized};
use crate::generate::chat::ChatTokenizer;

#[derive(Debug, Serialize)]
pub struct Report {
    /// The adapter directory, `null` for the base model.
    pub adapter: Option<String>,
    pub data: String,
    pub mask_prompt: bool,
    /// Whether mlx_lm's extra padding target was scored (`--mlx-pad-target`).
    pub mlx_pad_target: bool,
    pub examples: usize,
    /// Examples not scored: longer than the model's context, or nothing left after the mask.
    pub skipped: usize,
    pub tokens: usize,
    /// Mean loss per scored token (nats).
    pub loss: f64,
    pub perplexity: f64,
    /// This loss minus the first adapter's (negative: fits the data better).
    pub delta_loss: Option<f64>,
}

pub fn run(config: Option<&Path>, profile: Option<&str>, args: &EvalArgs) -> anyhow::Result<()> {
    let settings = load_settings(config, profile, &model_overrides(&args.model))?;
    init_threads(settings.threads.value)?;
    let verbose = !args.quiet;
    let env = HubEnv::from_env();
    let bars = verbose && std::io::stderr().is_terminal();
    let model_dir = hub::resolve(&settings.model.value, Kind::Model, &env, verbose, bars)?;
    let mut adapters: Vec<Option<PathBuf>> =
        vec![match (&settings.adapter.value, args.model.no_adapter) {
            (Some(a), false) => Some(hub::resolve(a, Kind::Adapter, &env, verbose, bars)?),
            _ => None,
        }];
    for c in &args.compare {
        adapters.push(match c.as_str() {
            "none" => None,
            _ => Some(hub::resolve(c, Kind::Adapter, &env, verbose, bars)?),
        });
    }

    if args.max_examples == Some(0) {
        return Err(BadArgument("--max-examples 0: expected at least 1".into()).into());
    }
    let mut seen = std::collections::HashSet::new();
    adapters.retain(|a| seen.insert(a.clone()));
    let mut examples = data::read(&args.data)?;
    if let Some(n) = args.max_examples {
        examples.truncate(n);
    }
    // a text has no prompt: nothing is masked whatever the flag says
    let masked = !args.no_mask_prompt
        && !matches!(
            examples.first().map(|e| &e.example),
            Some(data::Example::Text(_))
        );
    let cfg = engine::Qwen3Config::from_dir(&model_dir)?;
    let template = ChatTemplate::load(&model_dir).map_err(EvalError::from)?;
    let tokenizer = ChatTokenizer::load(&model_dir, &cfg.eos_token_ids).map_err(EvalError::from)?;
    let renderer = Renderer {
        template: &template,
        tokenizer: &tokenizer,
        mask_prompt: masked,
    };
    let mut tokenized: Vec<Tokenized> = Vec::new();
    let mut empty = 0;
    for e in &examples {
        match renderer.tokenize(e.line, &e.example) {
            Ok(t) => tokenized.push(t),
            Err(EvalError::NothingToScore { .. }) => empty += 1,
            Err(err) => {
                return Err(anyhow::Error::new(err).context(args.data.display().to_string()))
            }
        }
    }
    if empty > 0 && verbose {
        eprintln!(
            "{}: skipped {empty} example(s) with nothing to score after the masked prompt",
            args.data.display()
        );
    }

    let opts = args
        .model
        .engine
        .options(select_device(device_kind(&settings)?)?, Numerics::Exact);
    let mut reports: Vec<Report> = Vec::new();
    let mut out = std::io::stdout().lock();
    for adapter in &adapters {
        let label = adapter
            .as_ref()
            .map_or("base model (no adapter)".to_string(), |a| {
                a.display().to_string()
            });
        let mut model = engine::load(&model_dir, adapter.as_deref(), &opts)
            .with_context(|| format!("loading model {} with {label}", model_dir.display()))?;
        say_notes(&mut model);
        let bar = bar(bars, tokenized.len() as u64, &label);
        let (mut total, mut skipped) = (Score::default(), 0);
        for t in &tokenized {
            match score(&mut model, t, args.mlx_pad_target) {
                Ok(s) => total.add(s),
                Err(EngineError::ContextFull { .. }) => skipped += 1,
                Err(e) => {
                    return Err(anyhow::Error::new(e).context(format!(
                        "{}:{}",
                        args.data.display(),
                        t.line
                    )))
                }
            }
            bar.inc(1);
        }
        bar.finish_and_clear();
        if skipped > 0 && verbose {
            eprintln!(
                "{label}: skipped {skipped} example(s) longer than the model's context ({} tokens)",
                cfg.max_position_embeddings
            );
        }
        if total.tokens == 0 {
            anyhow::bail!(
                "{}: no example fits the model's context",
                args.data.display()
            );
        }
        let r = Report {
            adapter: adapter.as_ref().map(|a| a.display().to_string()),
            data: args.data.display().to_string(),
            mask_prompt: masked,
            mlx_pad_target: args.mlx_pad_target,
            examples: tokenized.len() - skipped,
            skipped: skipped + empty,
            tokens: total.tokens,
            loss: total.loss(),
            perplexity: total.perplexity(),
            delta_loss: reports.first().map(|f| total.loss() - f.loss),
        };
        if args.json {
            writeln!(out, "{}", serde_json::to_string(&r)?)?;
            out.flush()?;
        }
        reports.push(r);
    }
    if !args.json {
        write!(out, "{}", table(&reports))?;
    }
    Ok(())
}

fn bar(enabled: bool, len: u64, label: &str) -> indicatif::ProgressBar {
    if !enabled {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new(len);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} examples, {eta} left")
    {
        b.set_style(style.progress_chars("=> "));
    }
    b.set_message(label.to_string());
    b
}

/// The reports as an aligned table.
pub fn table(reports: &[Report]) -> String {
    let name = |r: &Report| r.adapter.clone().unwrap_or_else(|| "(base model)".into());
    let w = reports
        .iter()
        .map(|r| name(r).len())
        .max()
        .unwrap_or(0)
        .max(7);
    let mut s = format!(
        "{:<w$}  {:>9}  {:>10}  {:>8}  {:>9}\n",
        "adapter", "loss", "perplexity", "tokens", "Δ loss"
    );
    for r in reports {
        let delta = r.delta_loss.map_or(String::new(), |d| format!("{d:+.4}"));
        s.push_str(&format!(
            "{:<w$}  {:>9.4}  {:>10.3}  {:>8}  {:>9}\n",
            name(r),
            r.loss,
            r.perplexity,
            r.tokens,
            delta
        ));
    }
    s
}
