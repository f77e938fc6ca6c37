//! Answering the accounts that address the bot (`bot run --mode replies`): what counts as
//! being addressed (a mention of the bot's DID in a post's facets, or a reply to one of its
//! posts), read from `app.bsky.notification.listNotifications` on the real network or from
//! given accounts' repos where there is no AppView (the sandbox), and which of them to answer:
//! never the bot itself, each post once, at most so many replies a thread and an hour
//! (Bluesky's guidance for bots: interact only when addressed). Pure; the store and the
//! network are the caller's.

use std::collections::HashSet;

use serde_json::Value;

use crate::bluesky::reply::FetchedPost;

/// A post that addressed the bot.
#[derive(Debug, Clone, PartialEq)]
pub struct Mention {
    pub post: FetchedPost,
    /// Its author's DID.
    pub author: String,
    /// The author's handle when the source knows it.
    pub handle: Option<String>,
    /// When the service indexed it (notifications) or its `createdAt` (repos): the order.
    pub at: String,
}

impl Mention {
    /// The thread the post is in: its root's URI, or its own when it starts one.
    pub fn thread(&self) -> String {
        self.post
            .reply()
            .map(|r| r.root.uri)
            .unwrap_or_else(|| self.post.uri.clone())
    }
}

/// Whether `record` (an `app.bsky.feed.post`) addresses `me`: a mention facet of my DID, or a
/// reply whose parent is a post of mine.
pub fn addresses(record: &Value, me: &str) -> bool {
    let mentions = record
        .get("facets")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .flat_map(|f| {
            f.get("features")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
        })
        .any(|feat| {
            feat.get("$type").and_then(Value::as_str) == Some("app.bsky.richtext.facet#mention")
                && feat.get("did").and_then(Value::as_str) == Some(me)
        });
    let replies_to_me = record
        .pointer("/reply/parent/uri")
        .and_then(Value::as_str)
        .is_some_and(|u| {
            u.strip_prefix("at://")
                .is_some_and(|r| r.split('/').next() == Some(me))
        });
    mentions || replies_to_me
}

/// The mentions and replies of a `listNotifications` response (other reasons are skipped).
pub fn from_notifications(v: &Value) -> Vec<Mention> {
    v.get("notifications")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|n| {
            matches!(
                n.get("reason").and_then(Value::as_str),
                Some("mention") | Some("reply")
            )
        })
        .filter_map(|n| {
            let post = FetchedPost {
                uri: n.get("uri")?.as_str()?.to_string(),
                cid: n.get("cid")?.as_str()?.to_string(),
                value: n.get("record")?.clone(),
            };
            Some(Mention {
                author: n.pointer("/author/did")?.as_str()?.to_string(),
                handle: n
                    .pointer("/author/handle")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                at: n
                    .get("indexedAt")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                post,
            })
        })
        .collect()
}

/// The posts among `posts` (other accounts' repos) that address `me`.
pub fn from_posts(posts: Vec<FetchedPost>, me: &str) -> Vec<Mention> {
    posts
        .into_iter()
        .filter(|p| addresses(&p.value, me))
        .map(|p| Mention {
            author: p.author().to_string(),
            handle: None,
            at: p
                .value
                .get("createdAt")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            post: p,
        })
        .collect()
}

/// The limits a run of replies keeps.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub per_thread: usize,
    pub per_hour: usize,
}

/// What the bot has done already, as the store tells it.
pub trait History {
    fn answered(&self, uri: &str) -> bool;
    /// The bot's replies in the thread whose root is `root`.
    fn replies_in_thread(&self, root: &str) -> usize;
    /// The bot's replies published in the last hour.
    fn replies_last_hour(&self) -> usize;
}

/// Which mentions to answer now, oldest first: not the bot's own posts, not answered, within
/// the thread and hourly limits (counting the answers chosen here); and how far the run got:
/// the time of the newest mention decided (answered or passed over for good), the cursor's next
/// value. Mentions left for want of hourly budget stay after it.
pub fn choose(
    mut found: Vec<Mention>,
    me: &str,
    h: &dyn History,
    limits: Limits,
) -> (Vec<Mention>, Option<String>) {
    found.sort_by(|a, b| a.at.cmp(&b.at));
    let mut decided = None;
    let mut seen = HashSet::new();
    let mut budget = limits.per_hour.saturating_sub(h.replies_last_hour());
    let mut per_thread: std::collections::HashMap<String, usize> = Default::default();
    let mut out = Vec::new();
    for m in found {
        if m.author == me || !seen.insert(m.post.uri.clone()) || h.answered(&m.post.uri) {
            decided = Some(m.at.clone());
            continue;
        }
        let t = m.thread();
        let n = per_thread
            .entry(t.clone())
            .or_insert_with(|| h.replies_in_thread(&t));
        if *n >= limits.per_thread {
            decided = Some(m.at.clone());
            continue;
        }
        if budget == 0 {
            break;
        }
        *n += 1;
        budget -= 1;
        decided = Some(m.at.clone());
        out.push(m);
    }
    (out, decided)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ME: &str = "did:plc:me";

    fn post(uri: &str, at: &str, value: Value) -> FetchedPost {
        let mut value = value;
        value["createdAt"] = json!(at);
        FetchedPost {
            uri: uri.into(),
            cid: "bafy".into(),
            value,
        }
    }

    fn mention_of(did: &str) -> Value {
        json!({ "text": "hi @me", "facets": [{ "index": { "byteStart": 3, "byteEnd": 6 },
            "features": [{ "$type": "app.bsky.richtext.facet#mention", "did": did }] }] })
    }

    fn reply_to(parent: &str, root: &str) -> Value {
        json!({ "text": "re", "reply": { "root": { "uri": root, "cid": "r" }, "parent": { "uri": parent, "cid": "p" } } })
    }

    #[test]
    fn mentions_and_replies_to_me_address_me_and_nothing_else_does() {
        assert!(addresses(&mention_of(ME), ME));
        assert!(!addresses(&mention_of("did:plc:other"), ME));
        assert!(addresses(
            &reply_to(
                "at://did:plc:me/app.bsky.feed.post/1",
                "at://x/app.bsky.feed.post/0"
            ),
            ME
        ));
        assert!(!addresses(
            &reply_to(
                "at://did:plc:other/app.bsky.feed.post/1",
                "at://did:plc:me/app.bsky.feed.post/0"
            ),
            ME
        ));
        assert!(!addresses(&json!({ "text": "did:plc:me" }), ME));
    }

    #[test]
    fn notifications_keep_mentions_and_replies_only() {
        let v = json!({ "notifications": [
            { "uri": "at://did:plc:a/app.bsky.feed.post/1", "cid": "c1", "reason": "mention",
              "author": { "did": "did:plc:a", "handle": "a.test" }, "record": mention_of(ME), "indexedAt": "2026-01-01T00:00:00Z" },
            { "uri": "at://did:plc:b/app.bsky.feed.like/1", "cid": "c2", "reason": "like",
              "author": { "did": "did:plc:b" }, "record": {}, "indexedAt": "2026-01-01T00:00:01Z" },
        ]});
        let m = from_notifications(&v);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].handle.as_deref(), Some("a.test"));
        assert_eq!(m[0].thread(), "at://did:plc:a/app.bsky.feed.post/1");
    }

    struct Hist {
        answered: Vec<&'static str>,
        in_thread: usize,
        last_hour: usize,
    }

    impl History for Hist {
        fn answered(&self, uri: &str) -> bool {
            self.answered.contains(&uri)
        }
        fn replies_in_thread(&self, _: &str) -> usize {
            self.in_thread
        }
        fn replies_last_hour(&self) -> usize {
            self.last_hour
        }
    }

    #[test]
    fn the_bot_answers_others_once_within_its_limits() {
        let root = "at://did:plc:a/app.bsky.feed.post/root";
        let found = from_posts(
            vec![
                post(
                    "at://did:plc:a/app.bsky.feed.post/2",
                    "2026-01-02",
                    reply_to("at://did:plc:me/app.bsky.feed.post/x", root),
                ),
                post(
                    "at://did:plc:a/app.bsky.feed.post/1",
                    "2026-01-01",
                    mention_of(ME),
                ),
                post(
                    "at://did:plc:me/app.bsky.feed.post/3",
                    "2026-01-03",
                    mention_of(ME),
                ),
                post(
                    "at://did:plc:b/app.bsky.feed.post/4",
                    "2026-01-04",
                    reply_to("at://did:plc:me/app.bsky.feed.post/y", root),
                ),
                post(
                    "at://did:plc:b/app.bsky.feed.post/5",
                    "2026-01-05",
                    mention_of("did:plc:z"),
                ),
            ],
            ME,
        );
        let limits = Limits {
            per_thread: 1,
            per_hour: 10,
        };
        let h = Hist {
            answered: vec![],
            in_thread: 0,
            last_hour: 0,
        };
        let (chosen, until) = choose(found.clone(), ME, &h, limits);
        let uris: Vec<String> = chosen.into_iter().map(|m| m.post.uri).collect();
        // oldest first; itself never; one reply in the thread under `root`
        assert_eq!(
            uris,
            [
                "at://did:plc:a/app.bsky.feed.post/1",
                "at://did:plc:a/app.bsky.feed.post/2"
            ]
        );
        assert_eq!(
            until.as_deref(),
            Some("2026-01-04"),
            "everything seen was decided"
        );
        let h = Hist {
            answered: vec!["at://did:plc:a/app.bsky.feed.post/1"],
            in_thread: 0,
            last_hour: 9,
        };
        let (chosen, until) = choose(found.clone(), ME, &h, limits);
        let uris: Vec<String> = chosen.into_iter().map(|m| m.post.uri).collect();
        assert_eq!(
            uris,
            ["at://did:plc:a/app.bsky.feed.post/2"],
            "answered once, hourly budget of one"
        );
        assert_eq!(until.as_deref(), Some("2026-01-04"));
        let h = Hist {
            answered: vec![],
            in_thread: 0,
            last_hour: 10,
        };
        let (chosen, until) = choose(found, ME, &h, limits);
        assert!(chosen.is_empty());
        assert_eq!(
            until, None,
            "nothing decided: the cursor stays for the next hour"
        );
    }
}
