//! Prompt → post: ChatML prompt, the token loop (the cache's common prefix with the previous
//! prompt reused, the next token sampled where the logits are, incremental detokenization),
//! then pure post-processing to Bluesky's limits; too-short results are regenerated a bounded
//! number of times and never replaced by a placeholder.

pub mod chat;
pub mod postprocess;

use std::path::Path;
use std::time::Instant;

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::engine::sample::{recent_distinct, Draw, SampleStep, SamplerParams};
use crate::engine::{self, EngineError, ModelOptions, Qwen3};
use chat::{ChatTokenizer, TextStream, TokenizerError};

/// The shipped instructions (`prompts/default.txt`), one per line.
pub const DEFAULT_PROMPTS: &str = include_str!("../../prompts/default.txt");

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Engine(#[from] engine::EngineError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(
        "no usable post after {attempts} attempts: every output was shorter than {min_chars} \
         characters after cleaning (last one: {last_len}). Try a higher --max-tokens, a lower \
         --min-chars, or another prompt"
    )]
    TooShort {
        attempts: usize,
        min_chars: usize,
        last_len: usize,
    },
    #[error("prompt list {path} has no instructions (one per line; '#' starts a comment)")]
    EmptyPrompts { path: String },
    #[error("cannot read prompt list {path}: {source}")]
    ReadPrompts {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid sampling settings: {0}")]
    Sampling(String),
    #[error(
        "the prompt is {prompt_tokens} tokens and up to {max_tokens} more would be generated, \
         past the model's context of {context}: shorten the prompt (or the system turn) or lower --max-tokens"
    )]
    PromptTooLong {
        prompt_tokens: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error("the model produced NaN/Inf logits at token {token} of attempt {attempt}: its weights or config (norm eps, rope theta, LoRA scale) make the arithmetic overflow; nothing was generated from them")]
    NonFinite { token: usize, attempt: usize },
}

/// Instructions from a prompt list: non-empty lines, `#` comments skipped.
pub fn parse_prompts(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

pub fn load_prompts(file: Option<&Path>) -> Result<Vec<String>, GenerateError> {
    let (text, name) = match file {
        Some(p) => (
            std::fs::read_to_string(p).map_err(|e| GenerateError::ReadPrompts {
                path: p.display().to_string(),
                source: e,
            })?,
            p.display().to_string(),
        ),
        None => (DEFAULT_PROMPTS.to_string(), "prompts/default.txt".into()),
    };
    let list = parse_prompts(&text);
    if list.is_empty() {
        return Err(GenerateError::EmptyPrompts { path: name });
    }
    Ok(list)
}

/// What one post needs besides the model.
#[derive(Debug, Clone)]
pub struct PostRequest {
    /// A fixed instruction, else one is picked from `prompts` with the seed.
    pub prompt: Option<String>,
    pub prompts: Vec<String>,
    pub system: Option<String>,
    pub sampler: SamplerParams,
    pub seed: u64,
    pub max_tokens: usize,
    pub min_chars: usize,
    pub attempts: usize,
}

/// One finished post with what made it.
#[derive(Debug, Clone, Serialize)]
pub struct Post {
    pub text: String,
    /// Model output of the accepted attempt, before cleaning.
    pub raw: String,
    pub prompt: String,
    pub seed: u64,
    /// Tokens generated in the accepted attempt.
    pub tokens: usize,
    pub attempts: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the cache (the shared system turn and
    /// header, when the previous post of the run had the same).
    pub prompt_tokens_reused: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub seconds: f64,
    /// Whether the accepted attempt ended at an EOS token (else at --max-tokens).
    pub finished: bool,
    /// Mean log-probability (nats) of the generated tokens under the model (its penalized
    /// distribution before the sampler's filters and temperature), EOS excluded.
    pub mean_logprob: Option<f64>,
}

/// Progress events for a terminal indicator.
pub enum Event<'a> {
    Attempt {
        attempt: usize,
    },
    /// A token was generated; `piece` is the text it completed (may be empty).
    Token {
        count: usize,
        piece: &'a str,
    },
}

pub struct Generator {
    pub model: Qwen3,
    pub tokenizer: ChatTokenizer,
}

struct Completion {
    raw: String,
    tokens: usize,
    prompt_tokens: usize,
    reused: usize,
    prefill_s: f64,
    decode_s: f64,
    finished: bool,
    logprob_sum: f64,
}

impl Generator {
    pub fn load(
        model_dir: &Path,
        adapter_dir: Option<&Path>,
        opts: &ModelOptions,
    ) -> Result<Self, GenerateError> {
        let model = engine::load(model_dir, adapter_dir, opts)?;
        let tokenizer = ChatTokenizer::load(model_dir, &model.cfg.eos_token_ids)?;
        Ok(Generator { model, tokenizer })
    }

    /// One generation: the prompt in two chunks (`prompt_ids[..split]`, the part posts share,
    /// taken from the cache when it holds exactly that; then the rest), then up to
    /// `max_tokens` tokens, each drawn with `Draw { seed, counter: attempt << 32 | index }`.
    /// Per token: one sampled id back from the model, one detokenizer step (a window of a few
    /// ids), one event.
    #[allow(clippy::too_many_arguments)]
    fn complete(
        &mut self,
        prompt_ids: &[u32],
        split: usize,
        sampler: &SamplerParams,
        seed: u64,
        attempt: usize,
        max_tokens: usize,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<Completion, GenerateError> {
        let params = sampler.resolve(self.model.cfg.vocab_size);
        let context = sampler
            .penalty_active()
            .then_some(sampler.repetition_context);
        // the penalty looks back over the prompt too, so history starts with it
        let mut history: Vec<u32> = match context {
            Some(_) => prompt_ids.to_vec(),
            None => Vec::new(),
        };
        let mut recent = Vec::new();
        let mut generated: Vec<u32> = Vec::with_capacity(max_tokens);
        let mut sample = |model: &mut Qwen3, ids: &[u32], index: usize, history: &[u32]| {
            if let Some(c) = context {
                recent_distinct(history, c, &mut recent);
            }
            let step = SampleStep {
                params,
                recent: &recent,
                draw: Draw {
                    seed,
                    counter: ((attempt as u64) << 32) | index as u64,
                },
            };
            model.next_token(ids, &step).map_err(|e| match e {
                EngineError::NonFiniteLogits => GenerateError::NonFinite {
                    token: index,
                    attempt,
                },
                e => e.into(),
            })
        };
        let t0 = Instant::now();
        let reused = self.model.keep_prefix(&prompt_ids[..split])?;
        if !reused && split > 0 {
            // computed as a chunk of its own, as when it is reused
            self.model.next_logits(&prompt_ids[..split])?;
        }
        let mut tok = sample(&mut self.model, &prompt_ids[split..], 0, &history)?;
        let prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut stream = TextStream::new(&self.tokenizer);
        let (mut finished, mut logprob_sum) = (false, 0f64);
        while generated.len() < max_tokens {
            if self.tokenizer.is_eos(tok.id) {
                finished = true;
                break;
            }
            generated.push(tok.id);
            logprob_sum += tok.logprob as f64;
            let piece = stream.push(tok.id)?.unwrap_or_default();
            on_event(Event::Token {
                count: generated.len(),
                piece: &piece,
            });
            if generated.len() < max_tokens {
                if context.is_some() {
                    history.push(tok.id);
                }
                tok = sample(&mut self.model, &[tok.id], generated.len(), &history)?;
            }
        }
        Ok(Completion {
            raw: self.tokenizer.decode(&generated)?,
            tokens: generated.len(),
            prompt_tokens: prompt_ids.len(),
            reused: if reused { split } else { 0 },
            prefill_s,
            decode_s: t1.elapsed().as_secs_f64(),
            finished,
            logprob_sum,
        })
    }

    /// One post: picks the instruction with the seed, generates, cleans, and regenerates
    /// while the cleaned text is shorter than `min_chars`, up to `attempts` times. The seed
    /// alone decides the result, so `--seed <post's seed> -n 1` reproduces a post.
    pub fn post(
        &mut self,
        req: &PostRequest,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<Post, GenerateError> {
        req.sampler.validate().map_err(GenerateError::Sampling)?;
        use rand::SeedableRng;
        let mut rng = ChaCha8Rng::seed_from_u64(req.seed);
        let prompt = match &req.prompt {
            Some(p) => p.clone(),
            None => req.prompts[rng.random_range(0..req.prompts.len())].clone(),
        };
        let prompt_ids = self
            .tokenizer
            .encode(&chat::render(req.system.as_deref(), &prompt))?;
        // where the shared chunk ends (none when its tokens are not a prefix of the prompt's)
        let shared = self
            .tokenizer
            .encode(&chat::shared_prefix(req.system.as_deref()))?;
        let split = if prompt_ids.len() > shared.len() && prompt_ids.starts_with(&shared) {
            shared.len()
        } else {
            0
        };
        let context = self.model.cfg.max_position_embeddings;
        if prompt_ids.len() + req.max_tokens > context {
            return Err(GenerateError::PromptTooLong {
                prompt_tokens: prompt_ids.len(),
                max_tokens: req.max_tokens,
                context,
            });
        }
        let seed: u64 = rng.random();
        let start = Instant::now();
        let mut last_len = 0;
        for attempt in 1..=req.attempts.max(1) {
            on_event(Event::Attempt { attempt });
            let c = self.complete(
                &prompt_ids,
                split,
                &req.sampler,
                seed,
                attempt,
                req.max_tokens,
                on_event,
            )?;
            let text = postprocess::clean_post(&c.raw);
            last_len = postprocess::grapheme_count(&text);
            if last_len >= req.min_chars.max(1) {
                return Ok(Post {
                    text,
                    raw: c.raw,
                    prompt,
                    seed: req.seed,
                    tokens: c.tokens,
                    attempts: attempt,
                    prompt_tokens: c.prompt_tokens,
                    prompt_tokens_reused: c.reused,
                    prefill_tok_s: (c.prompt_tokens - c.reused) as f64 / c.prefill_s.max(1e-9),
                    decode_tok_s: c.tokens as f64 / c.decode_s.max(1e-9),
                    seconds: start.elapsed().as_secs_f64(),
                    finished: c.finished,
                    mean_logprob: (c.tokens > 0).then(|| c.logprob_sum / c.tokens as f64),
                });
            }
        }
        Err(GenerateError::TooShort {
            attempts: req.attempts.max(1),
            min_chars: req.min_chars,
            last_len,
        })
    }
}
