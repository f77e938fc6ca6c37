//! The `app.bsky.feed.post` record: text within the lexicon's limits, `createdAt`, `langs`,
//! and link/mention facets with UTF-8 byte offsets, detected as the official client's
//! `RichText.detectFacets` (`@atproto/api`) does; and record keys as TIDs (atproto spec
//! "Record Key: tid"), chosen before sending so a retry can never make a second post.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{json, Value};

use crate::generate::postprocess::{grapheme_count, MAX_BYTES, MAX_GRAPHEMES};

pub const POST_COLLECTION: &str = "app.bsky.feed.post";

/// Timestamp identifier: 53 bits of microseconds since the epoch and a 10-bit clock id,
/// base32-sortable, 13 characters.
pub fn tid(now: SystemTime, clock_id: u16) -> String {
    const ALPHABET: &[u8; 32] = b"234567abcdefghijklmnopqrstuvwxyz";
    let micros = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    let v = ((micros & ((1 << 53) - 1)) << 10) | (clock_id as u64 & 0x3FF);
    (0..13)
        .rev()
        .map(|i| ALPHABET[((v >> (i * 5)) & 31) as usize] as char)
        .collect()
}

pub fn is_valid_tid(s: &str) -> bool {
    s.len() == 13
        && s.bytes()
            .all(|b| b"234567abcdefghijklmnopqrstuvwxyz".contains(&b))
        && b"234567abcdefghij".contains(&s.as_bytes()[0])
}

/// RFC 3339 with milliseconds and `Z`, as the official client writes `createdAt`.
pub fn timestamp(now: SystemTime) -> String {
    humantime::format_rfc3339_millis(now).to_string()
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    #[error("the post is empty")]
    Empty,
    #[error("the post has {graphemes} grapheme clusters; Bluesky allows at most {MAX_GRAPHEMES}")]
    TooManyGraphemes { graphemes: usize },
    #[error("the post has {bytes} bytes of UTF-8; Bluesky allows at most {MAX_BYTES}")]
    TooManyBytes { bytes: usize },
    #[error(
        "the post holds the control character U+{code:04X} at byte {at}: only newlines and \
         tabs are text (NUL, ESC and the rest would reach readers' screens as garbage)"
    )]
    ControlCharacter { code: u32, at: usize },
}

/// Checks the lexicon's limits (before anything is sent).
pub fn check_text(text: &str) -> Result<(), TextError> {
    if text.trim().is_empty() {
        return Err(TextError::Empty);
    }
    let g = grapheme_count(text);
    if g > MAX_GRAPHEMES {
        return Err(TextError::TooManyGraphemes { graphemes: g });
    }
    if text.len() > MAX_BYTES {
        return Err(TextError::TooManyBytes { bytes: text.len() });
    }
    if let Some((at, c)) = text
        .char_indices()
        .find(|&(_, c)| c.is_control() && c != '\n' && c != '\t')
    {
        return Err(TextError::ControlCharacter { code: c as u32, at });
    }
    Ok(())
}

/// A facet candidate found in the text; byte offsets into it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Span {
    Link {
        start: usize,
        end: usize,
        uri: String,
    },
    Mention {
        start: usize,
        end: usize,
        handle: String,
    },
}

fn boundary_before(text: &str, at: usize) -> bool {
    text[..at]
        .chars()
        .next_back()
        .is_none_or(|c| c.is_whitespace() || c == '(')
}

/// Top-level domains accepted for bare domains (`example.com`): the common generic ones and
/// every two-letter country code shape. The official client checks the full IANA list.
fn known_tld(tld: &str) -> bool {
    const GENERIC: &[&str] = &[
        "com", "org", "net", "edu", "gov", "io", "dev", "app", "social", "xyz", "info", "blog",
        "tech", "ai", "me", "co", "page", "site", "online", "news", "art", "science", "zone",
        "cloud", "wiki", "pub", "lol", "gay", "rocks", "club", "space", "link", "live",
    ];
    let t = tld.to_ascii_lowercase();
    GENERIC.contains(&t.as_str()) || (t.len() == 2 && t.chars().all(|c| c.is_ascii_lowercase()))
}

fn is_handle(s: &str) -> bool {
    let labels: Vec<&str> = s.split('.').collect();
    labels.len() >= 2
        && s.len() <= 253
        && labels.iter().all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
        && labels
            .last()
            .is_some_and(|t| t.chars().next().is_some_and(|c| c.is_ascii_alphabetic()))
}

/// Trailing characters that end a sentence rather than a URL.
fn trim_url_end(s: &str) -> &str {
    let mut s = s.trim_end_matches(['.', ',', ';', ':', '!', '?', '"', '\'']);
    if s.ends_with(')') && !s.contains('(') {
        s = &s[..s.len() - 1];
        s = s.trim_end_matches(['.', ',', ';', ':', '!', '?']);
    }
    s
}

/// Links and mentions, in text order.
pub fn detect_spans(text: &str) -> Vec<Span> {
    let mut spans = Vec::new();
    // Word-like runs separated by whitespace; each is checked on its own.
    let mut i = 0;
    let bytes = text.as_bytes();
    while i < text.len() {
        if text[i..].starts_with(char::is_whitespace) {
            i += text[i..].chars().next().map_or(1, char::len_utf8);
            continue;
        }
        let end = text[i..]
            .find(char::is_whitespace)
            .map_or(text.len(), |e| i + e);
        let mut start = i;
        // An opening parenthesis may precede either kind.
        if bytes[start] == b'(' {
            start += 1;
        }
        let word = &text[start..end];
        if (start == i || boundary_before(text, start)) && start < end {
            if let Some(rest) = word.strip_prefix('@') {
                let handle: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-')
                    .collect();
                let handle = handle.trim_end_matches('.').to_string();
                if is_handle(&handle) {
                    spans.push(Span::Mention {
                        start,
                        end: start + 1 + handle.len(),
                        handle: handle.to_ascii_lowercase(),
                    });
                }
            } else if word.starts_with("https://") || word.starts_with("http://") {
                let url = trim_url_end(word);
                if url.len() > "https://".len() {
                    spans.push(Span::Link {
                        start,
                        end: start + url.len(),
                        uri: url.to_string(),
                    });
                }
            } else if word.starts_with(|c: char| c.is_ascii_alphabetic()) {
                let url = trim_url_end(word);
                let host = url.split(['/', '?', '#']).next().unwrap_or("");
                let tld = host.rsplit('.').next().unwrap_or("");
                if host.contains('.')
                    && is_handle(host)
                    && known_tld(tld)
                    && !host.ends_with(".test")
                {
                    spans.push(Span::Link {
                        start,
                        end: start + url.len(),
                        uri: format!("https://{url}"),
                    });
                }
            }
        }
        i = end;
    }
    spans
}

/// Facet JSON for the spans; mentions whose handle did not resolve (`did` None) are left out,
/// so they stay plain text.
pub fn facets(spans: &[Span], resolve: &mut dyn FnMut(&str) -> Option<String>) -> Vec<Value> {
    spans
        .iter()
        .filter_map(|s| match s {
            Span::Link { start, end, uri } => Some(json!({
                "index": { "byteStart": start, "byteEnd": end },
                "features": [{ "$type": "app.bsky.richtext.facet#link", "uri": uri }],
            })),
            Span::Mention { start, end, handle } => resolve(handle).map(|did| {
                json!({
                    "index": { "byteStart": start, "byteEnd": end },
                    "features": [{ "$type": "app.bsky.richtext.facet#mention", "did": did }],
                })
            }),
        })
        .collect()
}

/// The record as it is sent.
pub fn post_record(text: &str, created_at: &str, langs: &[String], facets: Vec<Value>) -> Value {
    let mut r = json!({
        "$type": POST_COLLECTION,
        "text": text,
        "createdAt": created_at,
    });
    if !langs.is_empty() {
        r["langs"] = json!(langs);
    }
    if !facets.is_empty() {
        r["facets"] = Value::Array(facets);
    }
    r
}

#[cfg(test)]
mod tests {
    #[test]
    fn control_characters_are_refused() {
        for bad in ["a\u{0}b", "a\u{1b}[31mb", "a\u{7f}b", "a\rb"] {
            assert!(
                matches!(check_text(bad), Err(TextError::ControlCharacter { .. })),
                "{bad:?}"
            );
        }
        assert!(check_text("two\nlines\tand a tab").is_ok());
    }

    use super::*;
    use std::time::Duration;

    #[test]
    fn tids_sort_by_time_and_validate() {
        let t0 = UNIX_EPOCH + Duration::from_secs(1_763_000_000);
        let a = tid(t0, 5);
        let b = tid(t0 + Duration::from_micros(1), 5);
        assert_eq!(a.len(), 13);
        assert!(a < b);
        assert!(is_valid_tid(&a) && is_valid_tid(&b));
        assert!(!is_valid_tid("not-a-tid"));
    }

    #[test]
    fn timestamps_have_millis_and_z() {
        let t = UNIX_EPOCH + Duration::from_millis(1_763_000_000_123);
        assert_eq!(timestamp(t), "2025-11-13T02:13:20.123Z");
    }

    #[test]
    fn links_and_mentions_with_byte_offsets() {
        let text = "Café with @alice.test, see https://example.com/a?b=1. Also (bsky.app) and 3.14 or @nope";
        let spans = detect_spans(text);
        let slice = |s: &Span| match s {
            Span::Link { start, end, .. } | Span::Mention { start, end, .. } => &text[*start..*end],
        };
        let got: Vec<&str> = spans.iter().map(slice).collect();
        assert_eq!(
            got,
            vec!["@alice.test", "https://example.com/a?b=1", "bsky.app"]
        );
        assert!(matches!(&spans[2], Span::Link { uri, .. } if uri == "https://bsky.app"));
        // "Café" is 5 bytes: offsets are bytes, not characters.
        assert!(matches!(&spans[0], Span::Mention { start: 11, .. }));
    }

    #[test]
    fn unresolved_mentions_stay_text() {
        let spans = detect_spans("hi @ghost.test and @alice.test");
        let f = facets(&spans, &mut |h| {
            (h == "alice.test").then(|| "did:plc:abc".to_string())
        });
        assert_eq!(f.len(), 1);
        assert_eq!(f[0]["features"][0]["did"], "did:plc:abc");
    }

    #[test]
    fn limits_are_graphemes_and_bytes() {
        assert!(check_text(&"a".repeat(300)).is_ok());
        assert_eq!(
            check_text(&"a".repeat(301)),
            Err(TextError::TooManyGraphemes { graphemes: 301 })
        );
        // 300 family emoji: 300 graphemes but 5 400 bytes.
        assert!(matches!(
            check_text(&"👨‍👩‍👧".repeat(300)),
            Err(TextError::TooManyBytes { .. })
        ));
        assert_eq!(check_text("  "), Err(TextError::Empty));
    }
}
