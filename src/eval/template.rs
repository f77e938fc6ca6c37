//! The model's own chat template, rendered as mlx_lm renders it for training data: Hugging
//! Face's `apply_chat_template` (jinja2 with `trim_blocks` and `lstrip_blocks`, Python string
//! methods, `raise_exception`, the tokenizer's special tokens in the context), through
//! minijinja with its Python-compatibility methods. The template is `chat_template.jinja` in
//! the model directory when present (newer `transformers` save it there), else
//! `tokenizer_config.json`'s `chat_template`.

use std::path::{Path, PathBuf};

use minijinja::{context, Environment, Error, ErrorKind};
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{dir}: no chat template (neither chat_template.jinja nor a \"chat_template\" in tokenizer_config.json)")]
    Missing { dir: PathBuf },
    #[error("cannot read {path}: {why}")]
    Read { path: PathBuf, why: String },
    #[error("the chat template of {dir}: {why}")]
    Render { dir: PathBuf, why: String },
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... from tokenizer_config.json, as the template sees them.
    special: serde_json::Map<String, Value>,
    dir: PathBuf,
}

impl ChatTemplate {
    pub fn load(model_dir: &Path) -> Result<Self, TemplateError> {
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|e| TemplateError::Read {
                path: p.to_path_buf(),
                why: e.to_string(),
            })
        };
        let cfg_path = model_dir.join("tokenizer_config.json");
        let cfg: serde_json::Map<String, Value> = if cfg_path.exists() {
            serde_json::from_str(&read(&cfg_path)?).map_err(|e| TemplateError::Read {
                path: cfg_path.clone(),
                why: e.to_string(),
            })?
        } else {
            Default::default()
        };
        let file = model_dir.join("chat_template.jinja");
        let source = if file.exists() {
            read(&file)?
        } else {
            match cfg.get("chat_template") {
                Some(Value::String(s)) => s.clone(),
                // a list of named templates: the default one
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str())
                    .map(str::to_string)
                    .ok_or_else(|| TemplateError::Missing {
                        dir: model_dir.to_path_buf(),
                    })?,
                _ => {
                    return Err(TemplateError::Missing {
                        dir: model_dir.to_path_buf(),
                    })
                }
            }
        };
        let mut special = serde_json::Map::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            let v = match cfg.get(key) {
                Some(Value::String(s)) => Value::String(s.clone()),
                Some(Value::Object(o)) => o.get("content").cloned().unwrap_or(Value::Null),
                _ => Value::Null,
            };
            special.insert(key.into(), v);
        }
        Self::new(source, special, model_dir)
    }

    fn new(
        source: String,
        special: serde_json::Map<String, Value>,
        dir: &Path,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TemplateError::Render {
                dir: dir.to_path_buf(),
                why: e.to_string(),
            })?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source)
            .map_err(|e| TemplateError::Render {
                dir: dir.to_path_buf(),
                why: e.to_string(),
            })?;
        Ok(ChatTemplate {
            env,
            special,
            dir: dir.to_path_buf(),
        })
    }

    /// The tokenizer's `eos_token` (tokenizer_config.json), which mlx_lm appends to texts.
    pub fn eos_token(&self) -> Option<&str> {
        self.special.get("eos_token").and_then(Value::as_str)
    }

    /// `messages` rendered; with `add_generation_prompt` the assistant header follows.
    /// `extra` holds further template variables (e.g. `enable_thinking`), as `apply_chat_template`'s
    /// keyword arguments.
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String, TemplateError> {
        let t = self.env.get_template("chat").map_err(|e| self.err(e))?;
        let mut vars = self.special.clone();
        vars.extend(extra.clone());
        t.render(context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            ..minijinja::Value::from(minijinja::value::Serde(&vars))
        })
        .map_err(|e| self.err(e))
    }

    fn err(&self, e: Error) -> TemplateError {
        let mut why = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            why.push_str(&format!(": {s}"));
            src = s.source();
        }
        TemplateError::Render {
            dir: self.dir.clone(),
            why,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(dir: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(dir)
    }

    /// The renders mlx_lm's tokenizer made of the fixture's template (generation prompts, with
    /// and without `enable_thinking`).
    #[test]
    fn renders_what_transformers_renders() {
        let root = fixture("tests/fixtures/tiny");
        let t = ChatTemplate::load(&root.join("q4g64")).unwrap();
        let cases: serde_json::Map<String, Value> = serde_json::from_str(
            &std::fs::read_to_string(root.join("chat_template_cases.json")).unwrap(),
        )
        .unwrap();
        assert!(cases.len() >= 3);
        for (name, c) in &cases {
            let msgs = c["messages"].as_array().unwrap();
            let kwargs = c["kwargs"].as_object().unwrap();
            let got = t.render(msgs, true, kwargs).unwrap();
            assert_eq!(got, c["text"].as_str().unwrap(), "{name}");
        }
    }

    /// Qwen3's real template (tokenizer_config.json of ../shared/qwen3-tokenizer, as committed
    /// in tests/fixtures/qwen3-template): a finished conversation carries the empty think
    /// block on the last assistant turn; earlier assistant turns do not.
    #[test]
    fn qwen3_template_puts_an_empty_think_block_on_the_last_answer() {
        let t = ChatTemplate::load(&fixture("tests/fixtures/qwen3-template")).unwrap();
        let msgs: Vec<Value> = serde_json::from_str(
            r#"[{"role":"system","content":"S"},{"role":"user","content":"U1"},
                {"role":"assistant","content":"A1"},{"role":"user","content":"U2"},
                {"role":"assistant","content":"A2"}]"#,
        )
        .unwrap();
        let got = t.render(&msgs, false, &Default::default()).unwrap();
        assert_eq!(
            got,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n\
             <|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n\
             <|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n"
        );
        let head = t.render(&msgs[..4], true, &Default::default()).unwrap();
        assert!(got.starts_with(&head), "{head:?}");
    }

    #[test]
    fn a_template_that_raises_is_an_error_naming_the_model() {
        let t = ChatTemplate::new(
            "{{ raise_exception('only user and assistant roles') }}".into(),
            Default::default(),
            Path::new("/m"),
        )
        .unwrap();
        let e = t
            .render(&[], false, &Default::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/m") && e.contains("only user and assistant roles"),
            "{e}"
        );
    }
}
