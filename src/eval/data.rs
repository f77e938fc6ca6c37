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
    /// The conversation's messages, each an object with at least `role` and `content` (other
    /// fields, e.g. `reasoning_content`, are passed to the chat template as they are).
    Chat(Vec<Value>),
    Completion {
        prompt: String,
        completion: String,
    },
    Text(String),
}

impl Example {
    fn kind(&self) -> &'static str {
        match self {
            Example::Chat(_) => "chat (\"messages\")",
            Example::Completion { .. } => "completions (\"prompt\" and \"completion\")",
            Example::Text(_) => "text (\"text\")",
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
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text).map_err(|e| match e {
        ParseError::Line { line, why } => DataError::Line {
            path: path.to_path_buf(),
            line,
            why,
        },
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

/// Every non-blank line, in order.
pub fn parse(text: &str) -> Result<Vec<Numbered>, ParseError> {
    let mut out: Vec<Numbered> = Vec::new();
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
        let example = example(&obj).map_err(err)?;
        if let Some(first) = out.first() {
            if std::mem::discriminant(&first.example) != std::mem::discriminant(&example) {
                return Err(err(format!(
                    "a {} example, but line {} made this a {} dataset",
                    example.kind(),
                    first.line,
                    first.example.kind()
                )));
            }
        }
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

/// mlx_lm's order of precedence (`create_dataset`): prompt and completion, then messages,
/// then text.
fn example(obj: &Map<String, Value>) -> Result<Example, String> {
    if obj.contains_key("prompt") && obj.contains_key("completion") {
        return Ok(Example::Completion {
            prompt: string(obj, "prompt")?,
            completion: string(obj, "completion")?,
        });
    }
    if let Some(m) = obj.get("messages") {
        let Value::Array(msgs) = m else {
            return Err("\"messages\" must be an array".into());
        };
        if msgs.is_empty() {
            return Err("\"messages\" is empty".into());
        }
        for (j, msg) in msgs.iter().enumerate() {
            let Value::Object(o) = msg else {
                return Err(format!("message {j} is not an object"));
            };
            string(o, "role").map_err(|e| format!("message {j}: {e}"))?;
            if !matches!(o.get("content"), Some(Value::String(_))) {
                return Err(format!("message {j}: \"content\" must be a string"));
            }
        }
        return Ok(Example::Chat(msgs.clone()));
    }
    if obj.contains_key("text") {
        return Ok(Example::Text(string(obj, "text")?));
    }
    if obj.contains_key("prompt") || obj.contains_key("completion") {
        return Err("a completions example needs both \"prompt\" and \"completion\"".into());
    }
    Err("expected \"messages\", \"prompt\" and \"completion\", or \"text\"".into())
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
        let Example::Chat(m) = &got[0].example else {
            panic!()
        };
        assert_eq!(m[1]["reasoning_content"], "r");
        let got = parse(r#"{"prompt": "p", "completion": "c", "extra": 1}"#).unwrap();
        assert_eq!(
            got[0].example,
            Example::Completion {
                prompt: "p".into(),
                completion: "c".into()
            }
        );
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
            (r#"{"prompt": "p"}"#, "needs both"),
            (r#"{"messages": []}"#, "empty"),
            (r#"{"messages": [{"role": "user"}]}"#, "content"),
            (r#"{"other": 1}"#, "expected \"messages\""),
            (
                r#"{"prompt": "p", "completion": "c"}"#,
                "line 1 made this a text",
            ),
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
    }
}
