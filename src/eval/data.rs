//! Evaluation data: mlx_lm's dataset JSONL (`mlx_lm/tuner/datasets.py`): one JSON object a
//! line, `{"messages": [...]}` (chat), `{"prompt": ..., "completion": ...}` (completions) or
//! `{"text": ...}` (text). As in mlx_lm the first example decides the kind; a line of another
//! kind, or one that is not such an object, is an error naming the line.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {why}")]
    Line {
        path: PathBuf,
        line: usize,
        why: String,
    },
    #[error("{path}: no examples (expected one JSON object per line)")]
    Empty { path: PathBuf },
}

/// What one line holds, as mlx_lm reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum Example {
    /// The conversation's messages, each an object with a `role` (fields other than `role` and
    /// `content`, e.g. `reasoning_content` or `tool_calls`, go to the chat template as they
    /// are), and the row's `tools` if it has them.
    Chat {
        messages: Vec<Value>,
        tools: Option<Value>,
    },
    Completion {
        prompt: String,
        completion: String,
        tools: Option<Value>,
    },
    Text(String),
}

/// The dataset's kind, which mlx_lm's `create_dataset` decides from the first example alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completions,
    Chat,
    Text,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Chat => "chat (\"messages\")",
            Kind::Completions => "completions (\"prompt\" and \"completion\")",
            Kind::Text => "text (\"text\")",
        }
    }

    /// mlx_lm's order of precedence: prompt and completion, then messages, then text.
    fn of(obj: &Map<String, Value>) -> Result<Kind, String> {
        if obj.contains_key("prompt") && obj.contains_key("completion") {
            Ok(Kind::Completions)
        } else if obj.contains_key("messages") {
            Ok(Kind::Chat)
        } else if obj.contains_key("text") {
            Ok(Kind::Text)
        } else {
            Err("expected \"messages\", \"prompt\" and \"completion\", or \"text\"".into())
        }
    }
}

/// An example and the line (1-based) it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Numbered {
    pub line: usize,
    pub example: Example,
}

pub fn read(path: &Path) -> Result<Vec<Numbered>, DataError> {
    let bytes = std::fs::read(path).map_err(|source| DataError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let at = |line: usize, why: String| DataError::Line {
        path: path.to_path_buf(),
        line,
        why,
    };
    let text = String::from_utf8(bytes).map_err(|e| {
        let line = 1 + e.as_bytes()[..e.utf8_error().valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count();
        at(line, "not UTF-8 text".into())
    })?;
    parse(&text).map_err(|e| match e {
        ParseError::Line { line, why } => at(line, why),
        ParseError::Empty => DataError::Empty {
            path: path.to_path_buf(),
        },
    })
}

#[derive(Debug, PartialEq)]
pub enum ParseError {
    Line { line: usize, why: String },
    Empty,
}

/// Every non-blank line, in order; the first one decides the kind of all.
pub fn parse(text: &str) -> Result<Vec<Numbered>, ParseError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut out: Vec<Numbered> = Vec::new();
    let mut kind: Option<(Kind, usize)> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let err = |why: String| ParseError::Line { line, why };
        let v: Value = serde_json::from_str(raw).map_err(|e| err(format!("not JSON: {e}")))?;
        let Value::Object(obj) = v else {
            return Err(err("expected a JSON object".into()));
        };
        let (k, first) = match kind {
            Some(k) => k,
            None => *kind.insert((Kind::of(&obj).map_err(err)?, line)),
        };
        let example = example(&obj, k).map_err(|why| {
            err(if first == line {
                why
            } else {
                format!("{why} (line {first} made this a {} dataset)", k.name())
            })
        })?;
        out.push(Numbered { line, example });
    }
    if out.is_empty() {
        return Err(ParseError::Empty);
    }
    Ok(out)
}

fn string(obj: &Map<String, Value>, key: &str) -> Result<String, String> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("\"{key}\" must be a string, got {other}")),
        None => Err(format!("missing \"{key}\"")),
    }
}

/// The row's `tools`, passed to the template as mlx_lm passes them (`row.get("tools")`).
fn tools(obj: &Map<String, Value>) -> Option<Value> {
    obj.get("tools").filter(|t| !t.is_null()).cloned()
}

fn example(obj: &Map<String, Value>, kind: Kind) -> Result<Example, String> {
    match kind {
        Kind::Completions => Ok(Example::Completion {
            prompt: string(obj, "prompt")?,
            completion: string(obj, "completion")?,
            tools: tools(obj),
        }),
        Kind::Text => Ok(Example::Text(string(obj, "text")?)),
        Kind::Chat => {
            let Some(Value::Array(msgs)) = obj.get("messages") else {
                return Err("\"messages\" must be an array".into());
            };
            if msgs.is_empty() {
                return Err("\"messages\" is empty".into());
            }
            let mut messages = Vec::with_capacity(msgs.len());
            for (j, msg) in msgs.iter().enumerate() {
                let Value::Object(o) = msg else {
                    return Err(format!("message {j} is not an object"));
                };
                string(o, "role").map_err(|e| format!("message {j}: {e}"))?;
                // a tool-calling turn may have no content (null or absent); text is a string
                match o.get("content") {
                    None | Some(Value::Null) | Some(Value::String(_)) => {}
                    Some(_) => {
                        return Err(format!(
                            "message {j}: \"content\" must be a string (lists of parts are not supported)"
                        ))
                    }
                }
                messages.push(msg.clone());
            }
            Ok(Example::Chat {
                messages,
                tools: tools(obj),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_parses_and_blank_lines_are_skipped() {
        let chat = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "r"}]}"#;
        let got = parse(&format!("{chat}\n\n{chat}\n")).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].line, 3);
        let Example::Chat { messages: m, tools } = &got[0].example else {
            panic!()
        };
        assert_eq!(m[1]["reasoning_content"], "r");
        assert_eq!(tools, &None);
        let got = parse(r#"{"prompt": "p", "completion": "c", "extra": 1, "tools": [1]}"#).unwrap();
        assert_eq!(
            got[0].example,
            Example::Completion {
                prompt: "p".into(),
                completion: "c".into(),
                tools: Some(serde_json::json!([1])),
            }
        );
        // a byte-order mark and a tool call without content are fine
        let got = parse("\u{feff}{\"messages\": [{\"role\": \"assistant\", \"content\": null, \"tool_calls\": []}]}").unwrap();
        assert_eq!(got.len(), 1);
        let got = parse(r#"{"text": "t"}"#).unwrap();
        assert_eq!(got[0].example, Example::Text("t".into()));
    }

    #[test]
    fn errors_name_the_line_and_the_problem() {
        let ok = r#"{"text": "a"}"#;
        for (bad, want) in [
            ("{\"text\": \"b\"", "not JSON"),
            ("[1, 2]", "JSON object"),
            (r#"{"text": 3}"#, "must be a string"),
            (r#"{"prompt": "p"}"#, "missing \"text\""),
            (r#"{"other": 1}"#, "line 1 made this a text"),
        ] {
            match parse(&format!("{ok}\n{bad}\n{ok}")) {
                Err(ParseError::Line { line, why }) => {
                    assert_eq!(line, 2, "{bad}");
                    assert!(why.contains(want), "{bad}: {why}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert_eq!(parse("\n  \n"), Err(ParseError::Empty));
        // the first line decides: a chat set whose later line also has prompt and completion
        // stays chat, as in mlx_lm
        let chat = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
        let mixed =
            r#"{"messages": [{"role": "user", "content": "x"}], "prompt": "p", "completion": "c"}"#;
        let got = parse(&format!("{chat}\n{mixed}")).unwrap();
        assert!(matches!(got[1].example, Example::Chat { .. }));
        for (bad, want) in [
            (r#"{"messages": []}"#, "empty"),
            (
                r#"{"messages": [{"role": "user", "content": ["part"]}]}"#,
                "lists of parts",
            ),
            (r#"{"messages": "hi"}"#, "must be an array"),
            (r#"{"other": 1}"#, "expected \"messages\""),
        ] {
            match parse(bad) {
                Err(ParseError::Line { line: 1, why }) => {
                    assert!(why.contains(want), "{bad}: {why}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}
