//! `bot eval`'s computation: held-out examples (`data`) rendered as mlx_lm renders training
//! data (`template`, `mlx_lm/tuner/datasets.py`), scored by the engine's prefill the way
//! mlx_lm's `default_loss` scores them (`mlx_lm/tuner/trainer.py`): the mean, over every
//! scored token of the set, of `-log p(token | the tokens before it)`. Pure apart from the
//! model: the engine does the forward, the scoring here is plain arithmetic on its logits.

pub mod data;
pub mod template;

use rayon::prelude::*;
use serde_json::{Map, Value};

use crate::engine::{EngineError, Qwen3};
use crate::generate::chat::{ChatTokenizer, TokenizerError};
use data::Example;
use template::{ChatTemplate, TemplateError};

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("line {line}: {why}")]
    Example { line: usize, why: String },
    #[error("line {line}: nothing to score ({tokens} tokens, the first {prompt} of them prompt)")]
    NothingToScore {
        line: usize,
        tokens: usize,
        prompt: usize,
    },
}

/// One example as token ids, with the first position whose token is scored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    pub line: usize,
    pub ids: Vec<u32>,
    /// Tokens before this index are context only (the masked prompt); at least 1.
    pub first_scored: usize,
}

/// How examples become tokens: the template and tokenizer of the model, and whether the
/// prompt part of chat and completion examples is masked out of the loss (text examples have
/// no prompt: all of a text is scored either way).
pub struct Renderer<'a> {
    pub template: &'a ChatTemplate,
    pub tokenizer: &'a ChatTokenizer,
    pub mask_prompt: bool,
}

impl Renderer<'_> {
    /// As mlx_lm's `ChatDataset.process` / `CompletionsDataset.process` / `TextDataset.process`:
    /// the template gets `enable_thinking` (true when the vocabulary has `<think>`: mlx_lm's
    /// `TokenizerWrapper` passes its `has_thinking`), so Qwen3's last answer carries the empty
    /// think block, which is scored; the row's `tools`; the masked prompt is `messages[:-1]`
    /// rendered with the assistant header when the last message is the assistant's. Errors
    /// name the line.
    pub fn tokenize(&self, line: usize, ex: &Example) -> Result<Tokenized, EvalError> {
        let at = |e: &dyn std::fmt::Display| EvalError::Example {
            line,
            why: e.to_string(),
        };
        let has_think = self.tokenizer.tokenizer.token_to_id("<think>").is_some();
        let chat = |msgs: &[Value], tools: &Option<Value>, always_header: bool| {
            let msgs: Vec<Value> = msgs.iter().map(hf_message).collect();
            let mut vars = Map::new();
            vars.insert("enable_thinking".into(), Value::Bool(has_think));
            if let Some(t) = tools {
                vars.insert("tools".into(), t.clone());
            }
            let text = self
                .template
                .render(&msgs, false, &vars)
                .map_err(|e| at(&e))?;
            let ids = self.tokenizer.encode(&text).map_err(|e| at(&e))?;
            let mut first = 1;
            if self.mask_prompt {
                let Some((last, head)) = msgs.split_last().filter(|(_, h)| !h.is_empty()) else {
                    return Err(at(
                        &"masking the prompt needs a message before the scored one \
                                    (or --no-mask-prompt)",
                    ));
                };
                let header = always_header || last["role"] == "assistant";
                let prompt = self
                    .template
                    .render(head, header, &vars)
                    .map_err(|e| at(&e))?;
                first = self
                    .tokenizer
                    .encode(&prompt)
                    .map_err(|e| at(&e))?
                    .len()
                    .max(1);
            }
            Ok(Tokenized {
                line,
                ids,
                first_scored: first,
            })
        };
        let t =
            match ex {
                Example::Chat { messages, tools } => chat(messages, tools, false)?,
                Example::Completion {
                    prompt,
                    completion,
                    tools,
                } => chat(
                    &[
                        serde_json::json!({"role": "user", "content": prompt}),
                        serde_json::json!({"role": "assistant", "content": completion}),
                    ],
                    tools,
                    true,
                )?,
                Example::Text(text) => {
                    let mut ids = self.tokenizer.encode(text).map_err(|e| at(&e))?;
                    // mlx_lm's TextDataset ends every text with the tokenizer's EOS
                    let eos =
                        self.template
                            .eos_token()
                            .and_then(|t| self.tokenizer.tokenizer.token_to_id(t))
                            .ok_or_else(|| {
                                at(&"tokenizer_config.json names no eos_token the tokenizer knows, \
                             to end a text with")
                            })?;
                    if ids.last() != Some(&eos) {
                        ids.push(eos);
                    }
                    Tokenized {
                        line,
                        ids,
                        first_scored: 1,
                    }
                }
            };
        if t.ids.len() <= t.first_scored {
            return Err(EvalError::NothingToScore {
                line,
                tokens: t.ids.len(),
                prompt: t.first_scored,
            });
        }
        Ok(t)
    }
}

/// A message as Hugging Face's `apply_chat_template` hands it to the template: keys whose
/// value is null dropped; the first of `reasoning_content`, `thinking`, `reasoning` present
/// becomes `reasoning_content` (and `thinking` when that is absent), as transformers'
/// `_alias_reasoning_fields` does.
pub(crate) fn hf_message(m: &Value) -> Value {
    let Value::Object(o) = m else {
        return m.clone();
    };
    let mut o: Map<String, Value> = o
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let found = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| o.get(*k).cloned());
    if let Some(r) = found {
        o.entry("thinking").or_insert_with(|| r.clone());
        o.insert("reasoning_content".into(), r);
    }
    Value::Object(o)
}

/// Negative log-likelihood (nats) summed over the scored tokens, and how many there were.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Score {
    pub nll: f64,
    pub tokens: usize,
}

impl Score {
    pub fn add(&mut self, o: Score) {
        self.nll += o.nll;
        self.tokens += o.tokens;
    }

    /// Mean loss per token (nats).
    pub fn loss(&self) -> f64 {
        self.nll / self.tokens as f64
    }

    pub fn perplexity(&self) -> f64 {
        self.loss().exp()
    }
}

/// Rows of logits computed at once: bounds the memory of a long example (rows x vocab f32).
const CHUNK: usize = 128;

/// `-log softmax(row)[target]`, in f64.
pub fn nll(row: &[f32], target: u32) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + sum.ln() - row[target as usize] as f64
}

/// What mlx_lm's `default_loss` also scores after every example that `max_seq_length` did not
/// truncate: the prediction of the padding id 0 in the slot after the last token (its mask
/// runs to the length inclusive). Off by default: it is not part of the text.
pub const MLX_PAD_ID: u32 = 0;

/// One example through the model from an empty cache: every position's logits predict the
/// next token; tokens from `first_scored` on are scored. With `mlx_pad`, also the padding id
/// after the last token, as `mlx_lm.lora --test` does (see `MLX_PAD_ID`).
pub fn score(model: &mut Qwen3, t: &Tokenized, mlx_pad: bool) -> Result<Score, EngineError> {
    model.reset();
    let n = t.ids.len();
    let inputs = if mlx_pad { &t.ids[..] } else { &t.ids[..n - 1] };
    model.check_room(inputs.len())?;
    let vocab = model.cfg.vocab_size;
    let mut s = Score::default();
    let mut pos = 0;
    for chunk in inputs.chunks(CHUNK) {
        // a chunk whose rows predict only masked tokens needs no logits
        let wanted = pos + chunk.len() >= t.first_scored;
        let out = model.forward(chunk, wanted, false)?;
        if wanted {
            let logits: Vec<f32> = out.logits.flatten_all()?.to_vec1()?;
            // rows in parallel (a row is a pass over the vocabulary), summed in order
            let per_row: Vec<f64> = logits
                .par_chunks_exact(vocab)
                .enumerate()
                .filter(|(i, _)| pos + i + 1 >= t.first_scored)
                .map(|(i, row)| {
                    let id = t.ids.get(pos + i + 1).copied().unwrap_or(MLX_PAD_ID);
                    nll(row, id)
                })
                .collect();
            for v in per_row {
                s.add(Score { nll: v, tokens: 1 });
            }
        }
        pos += chunk.len();
    }
    if !s.nll.is_finite() {
        return Err(EngineError::NonFiniteLogits);
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_the_log_softmax_of_the_target() {
        let row = [1.0f32, 2.0, 3.0];
        let z: f64 = row.iter().map(|&v| (v as f64).exp()).sum();
        for t in 0..3 {
            let want = -((row[t] as f64).exp() / z).ln();
            assert!((nll(&row, t as u32) - want).abs() < 1e-12);
        }
        // large logits do not overflow
        assert!((nll(&[1000.0, 1000.0], 0) - 2f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn messages_reach_the_template_as_transformers_passes_them() {
        let m = serde_json::json!({"role": "assistant", "content": "A", "reasoning": "R", "tool_calls": null});
        assert_eq!(
            hf_message(&m),
            serde_json::json!({"role": "assistant", "content": "A", "reasoning": "R",
                               "reasoning_content": "R", "thinking": "R"})
        );
        let m = serde_json::json!({"role": "assistant", "content": "A", "reasoning_content": "C", "thinking": "T"});
        assert_eq!(hf_message(&m)["reasoning_content"], "C");
        assert_eq!(hf_message(&m)["thinking"], "T");
    }

    #[test]
    fn the_mean_is_per_token_over_the_set() {
        let mut s = Score::default();
        s.add(Score {
            nll: 3.0,
            tokens: 1,
        });
        s.add(Score {
            nll: 3.0,
            tokens: 5,
        });
        assert_eq!(s.loss(), 1.0);
        assert!((s.perplexity() - 1f64.exp()).abs() < 1e-12);
    }
}
