//! Turns raw model output into a post Bluesky accepts: think blocks, special-token text,
//! hashtags and emoji removed, whitespace collapsed, then cut to the app.bsky.feed.post limits
//! (300 grapheme clusters, 3000 UTF-8 bytes). Pure and deterministic.
//!
//! What counts as a hashtag follows the official client's tag detection
//! (`@atproto/api` rich-text `TAG_REGEX`): `#` or full-width `＃` at the start or after
//! whitespace, followed by non-space text that is not all digits and punctuation. So `#rust`
//! and `#2024goals` are hashtags; `C#`, `#1`, `issue#12` and `example.com/#frag` are not.
//! Trailing punctuation is not part of the tag (`#rust.` leaves the `.`).
//!
//! What counts as emoji works on grapheme clusters (UAX #29), so a ZWJ sequence, a skin tone,
//! a keycap or a flag pair goes as one unit. A cluster is emoji when it holds a character with
//! Emoji_Presentation, a variation selector 16, a keycap mark, a skin-tone modifier, a regional
//! indicator or a tag character, or an Emoji character from the blocks that hold nothing but
//! pictographs (Miscellaneous Symbols, Dingbats, U+1F000 and up: text-default ☀ ✔ ✈ go too).
//! Text-default symbols elsewhere (© ® ™ ‼ arrows ↔ ⇒, geometric ▶ ◀) and plain text
//! (accents, CJK, ★ ✓ which are not Emoji characters) stay.

use unicode_properties::emoji::UnicodeEmoji;
use unicode_properties::{GeneralCategoryGroup, UnicodeGeneralCategory};
use unicode_segmentation::UnicodeSegmentation;

/// Bluesky's app.bsky.feed.post `text` limits.
pub const MAX_GRAPHEMES: usize = 300;
pub const MAX_BYTES: usize = 3000;
const ELLIPSIS: &str = "…";

/// Everything `clean` does, in order; then `fit` to the limits.
pub fn clean_post(raw: &str) -> String {
    // Removing one thing can expose another (a hashtag after a dropped emoji); a fixed point
    // makes the function idempotent, which callers and tests rely on.
    let mut text = clean(raw);
    for _ in 0..4 {
        let next = clean(&text);
        if next == text {
            break;
        }
        text = next;
    }
    fit(&text, MAX_GRAPHEMES, MAX_BYTES)
}

fn clean(raw: &str) -> String {
    let t = strip_think(raw);
    let t = strip_special_tokens(&t);
    // Bytes the tokenizer could not decode (a cut-off character) are never meant as text.
    let t = t.replace('\u{FFFD}', "");
    let t = strip_emoji(&t);
    let t = strip_hashtags(&t);
    collapse_whitespace(&t)
}

/// Drops `<think>…</think>` (nested ones too), an unclosed `<think>` to the end, and stray
/// `</think>` tags.
pub fn strip_think(s: &str) -> String {
    const OPEN: &str = "<think>";
    const CLOSE: &str = "</think>";
    let mut out = String::with_capacity(s.len());
    let mut depth = 0usize;
    let mut rest = s;
    loop {
        let open = rest.find(OPEN);
        let close = rest.find(CLOSE);
        let next = match (open, close) {
            (None, None) => None,
            (Some(o), None) => Some((o, true)),
            (None, Some(c)) => Some((c, false)),
            (Some(o), Some(c)) => Some(if o < c { (o, true) } else { (c, false) }),
        };
        let Some((at, is_open)) = next else {
            if depth == 0 {
                out.push_str(rest);
            }
            break;
        };
        if depth == 0 {
            out.push_str(&rest[..at]);
        }
        if is_open {
            depth += 1;
            rest = &rest[at + OPEN.len()..];
        } else {
            depth = depth.saturating_sub(1);
            rest = &rest[at + CLOSE.len()..];
        }
    }
    out
}

/// Drops the text form of special tokens the model may emit (`<|im_end|>`, `<|endoftext|>`…).
pub fn strip_special_tokens(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(start) = rest.find("<|") {
        match rest[start + 2..].find("|>") {
            Some(len)
                if rest[start + 2..start + 2 + len]
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                out.push_str(&rest[..start]);
                out.push(' ');
                rest = &rest[start + 2 + len + 2..];
            }
            _ => {
                out.push_str(&rest[..start + 2]);
                rest = &rest[start + 2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Whether a grapheme cluster is an emoji (see the module docs for the rule).
pub fn is_emoji_cluster(g: &str) -> bool {
    let mut text_selector = false;
    for c in g.chars() {
        match c {
            '\u{FE0F}' | '\u{20E3}' => return true,
            '\u{FE0E}' => text_selector = true,
            '\u{1F3FB}'..='\u{1F3FF}' | '\u{1F1E6}'..='\u{1F1FF}' | '\u{E0020}'..='\u{E007F}' => {
                return true
            }
            _ => {}
        }
    }
    if text_selector {
        return false;
    }
    g.chars().any(|c| {
        use unicode_properties::emoji::EmojiStatus as S;
        let status = c.emoji_status();
        let presentation = matches!(
            status,
            S::EmojiPresentation
                | S::EmojiPresentationAndModifierBase
                | S::EmojiPresentationAndEmojiComponent
                | S::EmojiPresentationAndModifierAndEmojiComponent
        );
        let pictograph_block = matches!(c, '\u{2600}'..='\u{27BF}' | '\u{1F000}'..='\u{1FAFF}');
        let unassigned_pictograph = matches!(c, '\u{1F000}'..='\u{1FAFF}' | '\u{1FC00}'..='\u{1FFFD}')
            && c.general_category_group() == GeneralCategoryGroup::Other;
        presentation
            || (pictograph_block && c.is_emoji_char() && !c.is_emoji_component())
            || unassigned_pictograph
    })
}

pub fn strip_emoji(s: &str) -> String {
    s.graphemes(true).filter(|g| !is_emoji_cluster(g)).collect()
}

fn is_tag_break(c: char) -> bool {
    c.is_whitespace()
        || matches!(
            c,
            '\u{AD}' | '\u{2060}' | '\u{200A}'..='\u{200D}' | '\u{20E2}'
        )
}

/// Drops hashtags as the official client detects them, leaving trailing punctuation.
pub fn strip_hashtags(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let at_start = i == 0 || chars[i - 1].is_whitespace();
        if (c == '#' || c == '＃') && at_start && chars.get(i + 1) != Some(&'\u{FE0F}') {
            let mut end = i + 1;
            while end < chars.len() && !is_tag_break(chars[end]) {
                end += 1;
            }
            // The tag without trailing punctuation must hold something other than digits
            // and punctuation.
            let mut tag_end = end;
            while tag_end > i + 1 && is_punct(chars[tag_end - 1]) {
                tag_end -= 1;
            }
            let body = &chars[i + 1..tag_end];
            if body.iter().any(|&b| !b.is_numeric() && !is_punct(b)) {
                i = tag_end;
                continue;
            }
        }
        out.push(c);
        i += 1;
    }
    out
}

fn is_punct(c: char) -> bool {
    c.general_category_group() == GeneralCategoryGroup::Punctuation
}

/// Runs of whitespace become one space (one newline where the run had newlines, at most one
/// blank line), no space before closing punctuation, trimmed.
pub fn collapse_whitespace(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut pending_newlines = 0usize;
    let mut pending_space = false;
    for c in s.chars() {
        if c.is_whitespace() || c.is_control() {
            if c == '\n' {
                pending_newlines += 1;
            } else {
                pending_space = true;
            }
            continue;
        }
        if !out.is_empty() {
            if pending_newlines > 0 {
                out.push_str(if pending_newlines > 1 { "\n\n" } else { "\n" });
            } else if pending_space && !matches!(c, '.' | ',' | '!' | '?' | ';' | ':' | ')') {
                out.push(' ');
            }
        }
        pending_newlines = 0;
        pending_space = false;
        out.push(c);
    }
    out
}

/// Cuts `s` to at most `max_graphemes` clusters and `max_bytes` bytes: at the last sentence
/// end that keeps at least half of what fits, else at the last word boundary plus "…".
pub fn fit(s: &str, max_graphemes: usize, max_bytes: usize) -> String {
    let graphemes: Vec<&str> = s.graphemes(true).collect();
    if graphemes.len() <= max_graphemes && s.len() <= max_bytes {
        return s.to_string();
    }
    // The longest prefix within both limits, counted in clusters.
    let mut fits = 0;
    let mut bytes = 0;
    for g in &graphemes {
        if fits + 1 > max_graphemes || bytes + g.len() > max_bytes {
            break;
        }
        fits += 1;
        bytes += g.len();
    }
    let half = fits / 2;
    // A sentence ends after . ! ? … (or CJK 。！？), optionally closed by quotes/brackets,
    // when what follows is whitespace.
    let is_end = |g: &str| matches!(g, "." | "!" | "?" | "…" | "。" | "！" | "？");
    let is_closer = |g: &str| matches!(g, "\"" | "'" | "”" | "’" | ")" | "»" | "」");
    for end in (half.max(1)..=fits).rev() {
        let last = graphemes[end - 1];
        let next_is_space = graphemes
            .get(end)
            .is_none_or(|g| g.chars().all(char::is_whitespace));
        if !next_is_space {
            continue;
        }
        let mut k = end;
        while k > 0 && is_closer(graphemes[k - 1]) {
            k -= 1;
        }
        if k > 0 && (is_end(graphemes[k - 1]) || (k == end && is_end(last))) {
            return graphemes[..end].concat().trim_end().to_string();
        }
    }
    // No sentence end: the last word boundary leaving room for the ellipsis.
    let room_g = max_graphemes.saturating_sub(1);
    let room_b = max_bytes.saturating_sub(ELLIPSIS.len());
    let mut cut = 0;
    let mut b = 0;
    for (i, g) in graphemes.iter().enumerate() {
        if i + 1 > room_g || b + g.len() > room_b {
            break;
        }
        b += g.len();
        if graphemes
            .get(i + 1)
            .is_some_and(|n| n.chars().all(char::is_whitespace))
        {
            cut = i + 1;
        }
    }
    if cut == 0 {
        // One enormous word: cut inside it.
        cut = fits.min(room_g);
        while graphemes[..cut].concat().len() > room_b {
            cut -= 1;
        }
    }
    let mut out = graphemes[..cut].concat().trim_end().to_string();
    out.push_str(ELLIPSIS);
    out
}

/// Grapheme clusters in `s`: the unit Bluesky's 300 limit counts.
pub fn grapheme_count(s: &str) -> usize {
    s.graphemes(true).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn think_blocks() {
        let cases = [
            ("<think>\n\n</think>\n\nHello there.", "Hello there."),
            ("<think>plan</think>Post text", "Post text"),
            ("Post <think>a<think>b</think>c</think> text", "Post text"),
            ("Kept <think>never closed, all of this goes", "Kept"),
            ("stray </think> tag", "stray tag"),
            ("a</think>b<think>", "ab"),
        ];
        for (raw, want) in cases {
            assert_eq!(clean_post(raw), want, "{raw:?}");
        }
    }

    #[test]
    fn hashtags() {
        let cases = [
            ("#rust is great", "is great"),
            ("I love #rust.", "I love."),
            ("Writing C# today", "Writing C# today"),
            ("We're #1 again", "We're #1 again"),
            ("see example.com/#frag now", "see example.com/#frag now"),
            ("issue#12 fixed", "issue#12 fixed"),
            ("end #tag1 #tag2", "end"),
            ("full width ＃タグ works", "full width works"),
            ("#2024goals matter", "matter"),
            ("a (#paren) b", "a (#paren) b"),
            ("tab\t#x y", "tab y"),
            ("# heading", "# heading"),
            ("just ## here", "just ## here"),
        ];
        for (raw, want) in cases {
            assert_eq!(clean_post(raw), want, "{raw:?}");
        }
    }

    #[test]
    fn emoji_of_every_kind() {
        let cases = [
            ("Hi 😀 there", "Hi there"),
            ("family 👨\u{200D}👩\u{200D}👧 time", "family time"),
            ("wave 👋🏽 now", "wave now"),
            ("heart ❤\u{FE0F} red", "heart red"),
            ("keycap 1\u{FE0F}\u{20E3} one", "keycap one"),
            ("flag 🇫🇷 France", "flag France"),
            (
                "england 🏴\u{E0067}\u{E0062}\u{E0065}\u{E006E}\u{E0067}\u{E007F} go",
                "england go",
            ),
            ("sun ☀ and ✔ and ✈", "sun and and"),
            ("rainbow 🏳\u{FE0F}\u{200D}🌈 pride", "rainbow pride"),
        ];
        for (raw, want) in cases {
            assert_eq!(clean_post(raw), want, "{raw:?}");
        }
    }

    #[test]
    fn ordinary_text_survives() {
        let keep = [
            "Café naïve résumé façade",
            "日本語のテキストと中文",
            "© 2026 Acme® and Foo™",
            "left ← right → both ↔ implies ⇒",
            "★ rated ✓ done ▶ play",
            "Prices: 3 < 5 and 10% off; a #1 fan of C#",
            "Ελληνικά και русский",
            "Line one\nLine two",
        ];
        for s in keep {
            assert_eq!(clean_post(s), s);
        }
    }

    #[test]
    fn whitespace_and_special_tokens() {
        assert_eq!(clean_post("  a   b \n\n\n\n c  "), "a b\n\nc");
        assert_eq!(clean_post("done<|im_end|>"), "done");
        assert_eq!(clean_post("a <|not a token|> b"), "a <|not a token|> b");
    }

    #[test]
    fn cut_at_sentence_end() {
        let s = format!(
            "{} Second sentence goes on and on {}",
            "First one.".repeat(20),
            "word ".repeat(60)
        );
        let out = fit(&s, 300, 3000);
        assert!(out.ends_with('.'), "{out}");
        assert!(grapheme_count(&out) <= 300);
        assert!(grapheme_count(&out) >= 150);
    }

    #[test]
    fn cut_at_word_with_ellipsis() {
        let s = "word ".repeat(100);
        let out = fit(s.trim(), 300, 3000);
        assert!(out.ends_with("word…"), "{out}");
        assert_eq!(grapheme_count(&out), 300);
    }

    #[test]
    fn bytes_limit_counts_too() {
        // 1000 four-byte characters: 1000 graphemes but 4000 bytes.
        let s = "𝕏".repeat(250) + " " + &"𝕏".repeat(750);
        let out = fit(&s, 300, 3000);
        assert!(out.len() <= 3000 && grapheme_count(&out) <= 300);
        assert!(out.ends_with('…'));
    }

    #[test]
    fn early_sentence_end_is_not_used() {
        // The only sentence end is in the first tenth: cutting there would lose most text.
        let s = format!("Hi. {}", "word ".repeat(100));
        assert!(fit(s.trim(), 300, 3000).ends_with('…'));
    }
}
