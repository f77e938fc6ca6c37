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
        // only the tokens the tokenizer has: HF leaves the others out of the context, where
        // they render as nothing (a `None` would print "None")
        let mut special = serde_json::Map::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            let v = match cfg.get(key) {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Object(o)) => {
                    o.get("content").and_then(Value::as_str).map(str::to_string)
                }
                _ => None,
            };
            if let Some(v) = v {
                special.insert(key.into(), Value::String(v));
            }
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
        env.add_filter("tojson", tojson);
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
    /// `tools` and `documents` are `none` unless `extra` gives them (as `apply_chat_template`
    /// passes `None`); `extra` holds further template variables (e.g. `enable_thinking`), as
    /// its keyword arguments.
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String, TemplateError> {
        let t = self.env.get_template("chat").map_err(|e| self.err(e))?;
        let mut vars = self.special.clone();
        vars.insert("tools".into(), Value::Null);
        vars.insert("documents".into(), Value::Null);
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

/// HF's `tojson` filter: Python's `json.dumps(x, ensure_ascii=False, indent=indent)`: `", "`
/// and `": "` between items (`","` with an indent), no HTML escaping, keys in the file's order.
fn tojson(
    v: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    for ignored in ["ensure_ascii", "sort_keys", "separators"] {
        let _: Option<minijinja::Value> = kwargs.get(ignored)?;
    }
    kwargs.assert_all_used()?;
    let j = serde_json::to_value(&v)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    dumps(&j, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn dumps(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                dumps(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                dumps(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
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
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ bos_token }}|{{ tools is none }}".into(),
            Default::default(),
            Path::new("/m"),
        )
        .unwrap();
        let msg = serde_json::json!({"a": [1, 2.5, "Tom's <b> é"], "b": {}, "c": null});
        let got = t.render(&[msg], false, &Default::default()).unwrap();
        assert_eq!(
            got,
            "{\"a\": [1, 2.5, \"Tom's <b> é\"], \"b\": {}, \"c\": null}|{\n  \"a\": [\n    1,\n    \
             2.5,\n    \"Tom's <b> é\"\n  ],\n  \"b\": {},\n  \"c\": null\n}||True"
        );
    }

    /// Qwen3's real template against Hugging Face's renders (`cases.json`, made by
    /// make_cases.py with transformers): tools in the system turn, tool calls and responses,
    /// a `reasoning` field, a think block in the content, multi-turn; full and masked prompt.
    #[test]
    fn qwen3_template_renders_what_transformers_renders() {
        let dir = fixture("tests/fixtures/qwen3-template");
        let t = ChatTemplate::load(&dir).unwrap();
        let cases: serde_json::Map<String, Value> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap())
                .unwrap();
        let mut n = 0;
        for (name, c) in cases.iter().filter(|(k, _)| !k.starts_with('_')) {
            let msgs: Vec<Value> = c["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(crate::eval::hf_message)
                .collect();
            let mut vars = serde_json::Map::new();
            vars.insert("enable_thinking".into(), Value::Bool(true));
            if !c["tools"].is_null() {
                vars.insert("tools".into(), c["tools"].clone());
            }
            assert_eq!(
                t.render(&msgs, false, &vars).unwrap(),
                c["full"].as_str().unwrap(),
                "{name}"
            );
            let header = msgs.last().unwrap()["role"] == "assistant";
            let head = &msgs[..msgs.len() - 1];
            assert_eq!(
                t.render(head, header, &vars).unwrap(),
                c["prompt"].as_str().unwrap(),
                "{name} prompt"
            );
            n += 1;
        }
        assert_eq!(n, 4);
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
