//! The duplicate guard, pure: a post is refused when its normalized text equals or nearly
//! equals a recent post (character-trigram Jaccard similarity ≥ a threshold), or when it copies
//! a long run of words verbatim from the training posts (memorized text).

use std::collections::HashSet;

/// Lowercase letters and digits, one space between words.
pub fn normalize(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_alphanumeric() {
                c.to_lowercase().next().unwrap_or(c)
            } else {
                ' '
            }
        })
        .collect::<String>()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn trigrams(s: &str) -> HashSet<[char; 3]> {
    let c: Vec<char> = s.chars().collect();
    c.windows(3).map(|w| [w[0], w[1], w[2]]).collect()
}

/// The most similar earlier post at or above `threshold`.
pub fn near_duplicate<'a>(
    text: &str,
    earlier: &'a [String],
    threshold: f64,
) -> Option<(&'a str, f64)> {
    earlier
        .iter()
        .map(|e| (e.as_str(), jaccard(text, e)))
        .filter(|(_, s)| *s >= threshold)
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

/// Jaccard similarity of the character trigrams of the normalized texts, in [0, 1]
/// (1.0 for equal normalized texts). A text with no letters or digits (symbols, emoji)
/// normalizes to nothing, so such texts are compared as written (whitespace collapsed).
pub fn jaccard(a: &str, b: &str) -> f64 {
    let (na, nb) = (normalize(a), normalize(b));
    let collapse = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let (a, b) = if na.is_empty() || nb.is_empty() {
        (collapse(a), collapse(b))
    } else {
        (na, nb)
    };
    if a == b {
        return 1.0;
    }
    let (ta, tb) = (trigrams(&a), trigrams(&b));
    let union = ta.union(&tb).count();
    if union == 0 {
        return 0.0;
    }
    ta.intersection(&tb).count() as f64 / union as f64
}

/// Word n-grams of the training posts, for the memorization check.
pub struct TrainingIndex {
    n: usize,
    grams: HashSet<String>,
}

impl TrainingIndex {
    pub fn new(posts: &[String], n: usize) -> Self {
        let n = n.max(1);
        let mut grams = HashSet::new();
        for p in posts {
            let norm = normalize(p);
            let w: Vec<&str> = norm.split(' ').filter(|s| !s.is_empty()).collect();
            for win in w.windows(n) {
                grams.insert(win.join(" "));
            }
        }
        TrainingIndex { n, grams }
    }

    /// The first run of `n` words of `text` found verbatim in a training post.
    pub fn copied_span(&self, text: &str) -> Option<String> {
        let norm = normalize(text);
        let w: Vec<&str> = norm.split(' ').filter(|s| !s.is_empty()).collect();
        w.windows(self.n)
            .map(|win| win.join(" "))
            .find(|g| self.grams.contains(g))
    }
}

/// Assistant turns of an mlx_lm chat JSONL (`{"messages": [...]}`), or `completion` / `text`
/// fields of the other mlx_lm data formats.
pub fn training_posts(jsonl: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for (i, line) in jsonl.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: not JSON ({e})", i + 1))?;
        if let Some(msgs) = v.get("messages").and_then(|m| m.as_array()) {
            for m in msgs {
                if m.get("role").and_then(|r| r.as_str()) == Some("assistant") {
                    if let Some(c) = m.get("content").and_then(|c| c.as_str()) {
                        out.push(c.to_string());
                    }
                }
            }
        } else if let Some(c) = v
            .get("completion")
            .or_else(|| v.get("text"))
            .and_then(|c| c.as_str())
        {
            out.push(c.to_string());
        } else {
            return Err(format!(
                "line {}: no `messages`, `completion` or `text`",
                i + 1
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// #18.11: texts without letters or digits normalized to nothing and were all "100%
    /// similar" to each other; they are compared as written.
    #[test]
    fn emoji_only_posts_are_not_all_duplicates() {
        assert!(jaccard("\u{1F642}\u{1F642}\u{1F642}", "\u{1F389}!!! ***") < 0.5);
        assert!(jaccard("--- *** ---", "??? !!! ???") < 0.5);
        assert_eq!(jaccard("\u{1F642} \u{1F642}", "\u{1F642}  \u{1F642}"), 1.0);
        let earlier = vec!["\u{2728}\u{2728}".to_string()];
        assert!(near_duplicate("\u{1F30A}\u{1F30A}", &earlier, 0.85).is_none());
    }

    use super::*;

    #[test]
    fn near_duplicates_are_caught_and_others_pass() {
        let earlier = vec![
            "Coffee first, then code. Every single morning.".to_string(),
            "The sunset over the bay was unreal tonight.".to_string(),
        ];
        assert!(near_duplicate(
            "coffee first -- then code! every single morning",
            &earlier,
            0.8
        )
        .is_some());
        assert!(near_duplicate("Coffee first, then code. Every morning.", &earlier, 0.6).is_some());
        assert!(
            near_duplicate("Rust's borrow checker taught me patience.", &earlier, 0.6).is_none()
        );
    }

    #[test]
    fn memorized_spans_are_found() {
        let train = training_posts(
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"I finally fixed the flaky test that haunted our CI for three whole weeks."}]}
{"text":"unrelated"}"#,
        )
        .unwrap();
        assert_eq!(train.len(), 2);
        let idx = TrainingIndex::new(&train, 8);
        assert!(idx
            .copied_span("Today: I finally fixed the flaky test that haunted our CI!")
            .is_some());
        assert!(idx
            .copied_span("I fixed a test today and it felt great, honestly.")
            .is_none());
        assert!(training_posts("{\"foo\":1}").is_err());
    }
}
