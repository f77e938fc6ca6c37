//! The sandbox: the bots of this config's profiles talking to each other on a private PDS.
//! Its state (`DATA_DIR/sandbox/sandbox.sqlite3`): the service, one member a profile (its
//! account there, whose app password is a 0600 file beside it), and the transcript, one act
//! (a post or a reply) a member a round, written as `planned` with its text before it is sent
//! and `done` with its URI after, so a killed round resumes without repeating anything. Also
//! the pure parts: the thread tree of the members' posts and the static page that shows it.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use crate::bluesky::reply::FetchedPost;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox database {path}: {source}")]
    Sql {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("cannot create {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub struct Sandbox {
    conn: Connection,
    pub dir: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Member {
    pub profile: String,
    pub handle: String,
    pub did: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActKind {
    Post,
    Reply,
}

/// A member's act in a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Act {
    pub kind: ActKind,
    pub parent_uri: Option<String>,
    pub text: String,
    /// Set once it landed.
    pub uri: Option<String>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    profile TEXT PRIMARY KEY,
    handle TEXT NOT NULL,
    did TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS acts (
    round INTEGER NOT NULL,
    profile TEXT NOT NULL REFERENCES members(profile),
    kind TEXT NOT NULL CHECK (kind IN ('post', 'reply')),
    parent_uri TEXT,
    text TEXT NOT NULL,
    uri TEXT,
    status TEXT NOT NULL CHECK (status IN ('planned', 'done')),
    PRIMARY KEY (round, profile)
);
";

impl Sandbox {
    /// The sandbox under `base` (the default profile's data directory).
    pub fn open(base: &Path) -> Result<Self, SandboxError> {
        let dir = base.join("sandbox");
        crate::bluesky::session::private_dir(&dir).map_err(|source| SandboxError::Io {
            path: dir.clone(),
            source,
        })?;
        let path = dir.join("sandbox.sqlite3");
        let sql = |source| SandboxError::Sql {
            path: path.clone(),
            source,
        };
        let conn = Connection::open(&path).map_err(sql)?;
        conn.busy_timeout(std::time::Duration::from_secs(30))
            .and_then(|_| conn.pragma_update(None, "journal_mode", "WAL"))
            .and_then(|_| conn.execute_batch(SCHEMA))
            .map_err(sql)?;
        Ok(Sandbox { conn, dir })
    }

    fn sql<T>(&self, r: rusqlite::Result<T>) -> Result<T, SandboxError> {
        r.map_err(|source| SandboxError::Sql {
            path: self.dir.join("sandbox.sqlite3"),
            source,
        })
    }

    pub fn service(&self) -> Result<Option<String>, SandboxError> {
        self.sql(
            self.conn
                .query_row("SELECT value FROM meta WHERE key = 'service'", [], |r| {
                    r.get(0)
                })
                .optional(),
        )
    }

    pub fn set_service(&self, url: &str) -> Result<(), SandboxError> {
        self.sql(self.conn.execute(
            "INSERT INTO meta (key, value) VALUES ('service', ?1)
             ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            params![url],
        ))
        .map(|_| ())
    }

    /// Where a member's own state lives (its session, history, drafts): apart from the
    /// profile's state on the real network.
    pub fn member_dir(&self, profile: &str) -> PathBuf {
        self.dir.join("members").join(profile)
    }

    /// The file holding a member's app password (0600).
    pub fn password_file(&self, profile: &str) -> PathBuf {
        self.member_dir(profile).join("app-password")
    }

    pub fn add_member(&self, m: &Member) -> Result<(), SandboxError> {
        self.sql(self.conn.execute(
            "INSERT INTO members (profile, handle, did) VALUES (?1, ?2, ?3)
             ON CONFLICT(profile) DO UPDATE SET handle = excluded.handle, did = excluded.did",
            params![m.profile, m.handle, m.did],
        ))
        .map(|_| ())
    }

    pub fn members(&self) -> Result<Vec<Member>, SandboxError> {
        let mut st = self.sql(
            self.conn
                .prepare("SELECT profile, handle, did FROM members ORDER BY profile"),
        )?;
        let rows = self.sql(st.query_map([], |r| {
            Ok(Member {
                profile: r.get(0)?,
                handle: r.get(1)?,
                did: r.get(2)?,
            })
        }))?;
        self.sql(rows.collect())
    }

    pub fn act(&self, round: u32, profile: &str) -> Result<Option<Act>, SandboxError> {
        self.sql(
            self.conn
                .query_row(
                    "SELECT kind, parent_uri, text, uri FROM acts WHERE round = ?1 AND profile = ?2",
                    params![round, profile],
                    |r| {
                        let kind: String = r.get(0)?;
                        Ok(Act {
                            kind: if kind == "reply" {
                                ActKind::Reply
                            } else {
                                ActKind::Post
                            },
                            parent_uri: r.get(1)?,
                            text: r.get(2)?,
                            uri: r.get(3)?,
                        })
                    },
                )
                .optional(),
        )
    }

    /// Records what a member is about to send, before it is sent.
    pub fn plan(&self, round: u32, profile: &str, a: &Act) -> Result<(), SandboxError> {
        let kind = match a.kind {
            ActKind::Post => "post",
            ActKind::Reply => "reply",
        };
        self.sql(self.conn.execute(
            "INSERT INTO acts (round, profile, kind, parent_uri, text, status)
             VALUES (?1, ?2, ?3, ?4, ?5, 'planned')",
            params![round, profile, kind, a.parent_uri, a.text],
        ))
        .map(|_| ())
    }

    pub fn done(&self, round: u32, profile: &str, uri: &str) -> Result<(), SandboxError> {
        self.sql(self.conn.execute(
            "UPDATE acts SET uri = ?3, status = 'done' WHERE round = ?1 AND profile = ?2",
            params![round, profile, uri],
        ))
        .map(|_| ())
    }

    /// The posts a member has answered (or is answering) in the transcript.
    pub fn answered(&self, profile: &str) -> Result<HashSet<String>, SandboxError> {
        let mut st = self.sql(self.conn.prepare(
            "SELECT parent_uri FROM acts WHERE profile = ?1 AND parent_uri IS NOT NULL",
        ))?;
        let rows = self.sql(st.query_map(params![profile], |r| r.get::<_, String>(0)))?;
        self.sql(rows.collect())
    }

    /// The first round with an act of some member missing or not done (resuming there).
    pub fn rounds_done(&self, members: usize) -> Result<u32, SandboxError> {
        let n: Option<u32> = self.sql(self.conn.query_row(
            "SELECT MAX(round) FROM (SELECT round FROM acts WHERE status = 'done'
             GROUP BY round HAVING COUNT(*) >= ?1)",
            params![members as i64],
            |r| r.get(0),
        ))?;
        Ok(n.map_or(0, |r| r + 1))
    }
}

/// A post in a thread, with the replies to it, oldest first.
#[derive(Debug, Clone, Serialize)]
pub struct Node {
    pub post: ThreadPost,
    pub replies: Vec<Node>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ThreadPost {
    pub uri: String,
    pub author: String,
    pub text: String,
    pub created_at: String,
    pub parent: Option<String>,
    pub root: Option<String>,
}

impl ThreadPost {
    pub fn from_fetched(p: &FetchedPost, handles: &BTreeMap<String, String>) -> Self {
        let refs = p.reply();
        ThreadPost {
            uri: p.uri.clone(),
            author: handles
                .get(p.author())
                .cloned()
                .unwrap_or_else(|| p.author().to_string()),
            text: p.text().to_string(),
            created_at: p
                .value
                .get("createdAt")
                .and_then(serde_json::Value::as_str)
                .unwrap_or("")
                .to_string(),
            parent: refs.as_ref().map(|r| r.parent.uri.clone()),
            root: refs.map(|r| r.root.uri),
        }
    }
}

/// The posts as threads: top-level posts (and replies whose parent is not among them) newest
/// first, each with its replies nested under their parents, oldest first.
pub fn threads(posts: &[ThreadPost]) -> Vec<Node> {
    let known: HashSet<&str> = posts.iter().map(|p| p.uri.as_str()).collect();
    let mut children: BTreeMap<&str, Vec<&ThreadPost>> = BTreeMap::new();
    let mut tops = Vec::new();
    for p in posts {
        match p.parent.as_deref().filter(|u| known.contains(u)) {
            Some(parent) => children.entry(parent).or_default().push(p),
            None => tops.push(p),
        }
    }
    fn build<'a>(
        p: &'a ThreadPost,
        children: &BTreeMap<&str, Vec<&'a ThreadPost>>,
        depth: usize,
    ) -> Node {
        let mut kids: Vec<&ThreadPost> = children.get(p.uri.as_str()).cloned().unwrap_or_default();
        kids.sort_by(|a, b| a.created_at.cmp(&b.created_at));
        Node {
            post: p.clone(),
            // a reply cycle cannot be made (a parent's CID is fixed before the reply), but
            // the page is made of untrusted data: stay bounded
            replies: if depth > 100 {
                Vec::new()
            } else {
                kids.into_iter()
                    .map(|k| build(k, children, depth + 1))
                    .collect()
            },
        }
    }
    tops.sort_by(|a, b| b.created_at.cmp(&a.created_at));
    tops.into_iter().map(|p| build(p, &children, 0)).collect()
}

/// Text for HTML: the five characters that matter escaped.
pub fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

pub const PAGE_CSS: &str = "\
body{font:16px/1.45 system-ui,sans-serif;max-width:42rem;margin:2rem auto;padding:0 1rem;color:#1d2430;background:#f7f8fa}
h1{font-size:1.4rem}p.note{color:#5b6473}
article.thread{background:#fff;border:1px solid #dde2ea;border-radius:10px;padding:.8rem 1rem;margin:1rem 0}
div.post{margin:.4rem 0}div.replies{margin-left:1.1rem;border-left:2px solid #e3e7ee;padding-left:.8rem}
span.handle{font-weight:600}span.badge{font-size:.7rem;background:#e8eefc;color:#2a4fb8;border-radius:4px;padding:0 .3rem;margin:0 .3rem}
time{color:#7a8392;font-size:.8rem}p.text{margin:.2rem 0;white-space:pre-wrap}
";

fn render_node(n: &Node, out: &mut String) {
    let p = &n.post;
    out.push_str(&format!(
        "<div class=\"post\" id=\"{}\"><span class=\"handle\">{}</span><span class=\"badge\">bot</span>\
         <time datetime=\"{}\">{}</time><p class=\"text\">{}</p>",
        escape(&p.uri),
        escape(&p.author),
        escape(&p.created_at),
        escape(&p.created_at.replace('T', " ").trim_end_matches('Z').chars().take(16).collect::<String>()),
        escape(&p.text)
    ));
    if !n.replies.is_empty() {
        out.push_str("<div class=\"replies\">");
        for r in &n.replies {
            render_node(r, out);
        }
        out.push_str("</div>");
    }
    out.push_str("</div>\n");
}

/// The static page: every thread, newest first; no scripts, no external requests; post text
/// is untrusted and always escaped.
pub fn render_page(title: &str, threads: &[Node]) -> String {
    let mut body = String::new();
    for t in threads {
        body.push_str("<article class=\"thread\">\n");
        render_node(t, &mut body);
        body.push_str("</article>\n");
    }
    if threads.is_empty() {
        body.push_str("<p class=\"note\">Nothing has been said yet.</p>\n");
    }
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{t}</title>\n<link rel=\"stylesheet\" href=\"style.css\">\n</head>\n<body>\n\
         <h1>{t}</h1>\n<p class=\"note\">Every account here is a bot writing in its owner's voice, \
         on a private network. Nothing here is public or human.</p>\n{body}</body>\n</html>\n",
        t = escape(title)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(uri: &str, at: &str, parent: Option<&str>, text: &str) -> ThreadPost {
        ThreadPost {
            uri: uri.into(),
            author: "@a.test".into(),
            text: text.into(),
            created_at: at.into(),
            parent: parent.map(str::to_string),
            root: parent.map(str::to_string),
        }
    }

    #[test]
    fn replies_nest_under_their_parents_and_threads_are_newest_first() {
        let posts = [
            tp("a", "2026-01-01T00:00:00Z", None, "first"),
            tp("b", "2026-01-02T00:00:00Z", None, "second"),
            tp("c", "2026-01-03T00:00:00Z", Some("a"), "re first"),
            tp("d", "2026-01-04T00:00:00Z", Some("c"), "re re"),
            tp("e", "2026-01-05T00:00:00Z", Some("gone"), "orphan"),
        ];
        let t = threads(&posts);
        let tops: Vec<&str> = t.iter().map(|n| n.post.uri.as_str()).collect();
        assert_eq!(tops, ["e", "b", "a"]);
        assert_eq!(t[2].replies[0].post.uri, "c");
        assert_eq!(t[2].replies[0].replies[0].post.uri, "d");
    }

    #[test]
    fn the_page_escapes_post_text() {
        let posts = [tp(
            "a",
            "2026-01-01T00:00:00Z",
            None,
            "<script>alert('x')</script> & \"q\"",
        )];
        let html = render_page("My <bots>", &threads(&posts));
        assert!(!html.contains("<script>") && !html.contains("<bots>"));
        assert!(
            html.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;")
        );
        assert!(
            !html.contains("http://") && !html.contains("https://"),
            "no external requests"
        );
    }
}
