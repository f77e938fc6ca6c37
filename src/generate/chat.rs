//! The prompt: Qwen3's ChatML as its `chat_template.jinja` renders one optional system turn
//! and one user turn with `add_generation_prompt=True` (mlx_lm's default, no
//! `enable_thinking` argument), with ` /no_think` appended to the user text; and the
//! tokenizer from the model's `tokenizer.json`, under which special tokens are single ids.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

/// Qwen3's soft switch: the template passes it through and the model skips its reasoning.
pub const NO_THINK: &str = " /no_think";

/// `<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt} /no_think<|im_end|>\n<|im_start|>assistant\n`
pub fn render(system: Option<&str>, prompt: &str) -> String {
    let mut s = shared_prefix(system);
    s.push_str(prompt.trim());
    if !prompt.trim_end().ends_with(NO_THINK.trim()) {
        s.push_str(NO_THINK);
    }
    s.push_str("<|im_end|>\n<|im_start|>assistant\n");
    s
}

/// The start of `render(system, _)` that every instruction shares: the system turn and the user
/// turn's header.
pub fn shared_prefix(system: Option<&str>) -> String {
    let mut s = String::new();
    if let Some(sys) = system.filter(|s| !s.trim().is_empty()) {
        s.push_str("<|im_start|>system\n");
        s.push_str(sys.trim());
        s.push_str("<|im_end|>\n");
    }
    s.push_str("<|im_start|>user\n");
    s
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer {path}: {why}")]
    Load { path: PathBuf, why: String },
    #[error("tokenizer {path}: {why}")]
    Invalid { path: PathBuf, why: String },
    #[error("tokenizing: {0}")]
    Encode(String),
}

/// The model's tokenizer plus the ids generation needs.
pub struct ChatTokenizer {
    pub tokenizer: Tokenizer,
    /// Every id that ends generation: the model config's, and the tokenizer's `<|im_end|>` and
    /// `<|endoftext|>` when it has them.
    pub eos_ids: Vec<u32>,
    path: PathBuf,
}

impl ChatTokenizer {
    pub fn load(model_dir: &Path, config_eos: &[u32]) -> Result<Self, TokenizerError> {
        let path = model_dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&path).map_err(|e| TokenizerError::Load {
            path: path.clone(),
            why: e.to_string(),
        })?;
        let mut eos_ids = config_eos.to_vec();
        for special in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(id) = tokenizer.token_to_id(special) {
                eos_ids.push(id);
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let t = ChatTokenizer {
            tokenizer,
            eos_ids,
            path,
        };
        // ChatML cannot work if its markers are not single special tokens.
        for special in ["<|im_start|>", "<|im_end|>"] {
            let ids = t.encode(special)?;
            if ids.len() != 1 {
                return Err(TokenizerError::Invalid {
                    path: t.path.clone(),
                    why: format!(
                        "{special} encodes to {} ids, expected one special token",
                        ids.len()
                    ),
                });
            }
        }
        Ok(t)
    }

    /// Ids of `text` with special tokens recognised and nothing added (Qwen has no BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }
}

/// Incremental detokenizer: text is released only once it is valid UTF-8 and no later token
/// can change it (a multi-byte character split across byte-level tokens is held back). Each
/// step decodes a window of a few ids (tokenizers' `DecodeStream`), never the whole text.
pub struct TextStream<'a> {
    inner: tokenizers::DecodeStream<
        'a,
        tokenizers::ModelWrapper,
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        tokenizers::DecoderWrapper,
    >,
}

impl<'a> TextStream<'a> {
    pub fn new(tok: &'a ChatTokenizer) -> Self {
        TextStream {
            inner: tok.tokenizer.decode_stream(false),
        }
    }

    /// Adds a token; returns the newly final text, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        self.inner
            .step(id)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml() {
        assert_eq!(
            render(Some("Sys."), "Write."),
            "<|im_start|>system\nSys.<|im_end|>\n<|im_start|>user\nWrite. /no_think<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            render(None, "Hi /no_think"),
            "<|im_start|>user\nHi /no_think<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
