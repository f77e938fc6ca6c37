//! Local state in SQLite (`bot.sqlite3` in the profile's data dir): drafts and the posting
//! history. Every change is one transaction; WAL and a busy timeout let a cron run and a
//! human share the file. A post is written as `pending` (with its record key) *before* it is
//! sent, so a crash mid-send is reconciled on the next run instead of forgotten or repeated.

use std::fmt;
use std::path::{Path, PathBuf};

use rusqlite::types::{FromSql, FromSqlError, FromSqlResult, ToSqlOutput, ValueRef};
use rusqlite::{params, Connection, OptionalExtension, ToSql};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database {path}: {source}")]
    Sql {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("cannot create {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Another run is sending (or has sent) this draft, or it is no longer approved.
    #[error("draft {0} is no longer approved or another run is sending it")]
    DraftTaken(i64),
}

pub struct Store {
    conn: Connection,
    path: PathBuf,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PostRow {
    pub id: i64,
    pub account: String,
    pub rkey: String,
    pub text: String,
    pub status: PostStatus,
    pub uri: Option<String>,
    pub cid: Option<String>,
    pub created_at: String,
    pub posted_at: Option<String>,
    pub draft_id: Option<i64>,
    /// The exact record JSON that was (or is being) sent under `rkey`.
    pub record: String,
}

/// A post about to be sent.
pub struct NewPost<'a> {
    pub account: &'a str,
    pub service: &'a str,
    pub rkey: &'a str,
    pub text: &'a str,
    pub record: &'a str,
    pub created_at: &'a str,
    pub draft_id: Option<i64>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS drafts (
    id INTEGER PRIMARY KEY,
    text TEXT NOT NULL,
    raw TEXT,
    prompt TEXT,
    seed INTEGER,
    model TEXT,
    adapter TEXT,
    created_at TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('new', 'approved', 'rejected', 'posted')),
    uri TEXT
);
CREATE TABLE IF NOT EXISTS posts (
    id INTEGER PRIMARY KEY,
    account TEXT NOT NULL,
    service TEXT NOT NULL,
    rkey TEXT NOT NULL UNIQUE,
    text TEXT NOT NULL,
    record TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'posted', 'failed', 'deleted')),
    uri TEXT,
    cid TEXT,
    created_at TEXT NOT NULL,
    posted_at TEXT,
    draft_id INTEGER REFERENCES drafts(id)
);
CREATE INDEX IF NOT EXISTS posts_by_account ON posts (account, id);
";

/// Schema changes after the first one, applied in order inside `BEGIN IMMEDIATE`
/// transactions (with foreign keys off, as SQLite's table rebuild needs); `user_version`
/// counts those applied, so an older database catches up on open and a concurrent opener
/// waits and finds the work done.
const MIGRATIONS: &[&str] = &[
    // 1: a draft the duplicate or training-data guard turned down becomes `refused`, with a
    // note saying why, so the queue moves on to the next one.
    "CREATE TABLE drafts_v1 (
        id INTEGER PRIMARY KEY,
        text TEXT NOT NULL,
        raw TEXT,
        prompt TEXT,
        seed INTEGER,
        model TEXT,
        adapter TEXT,
        created_at TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('new', 'approved', 'rejected', 'posted', 'refused')),
        uri TEXT,
        note TEXT
    );
    INSERT INTO drafts_v1 (id, text, raw, prompt, seed, model, adapter, created_at, status, uri)
        SELECT id, text, raw, prompt, seed, model, adapter, created_at, status, uri FROM drafts;
    DROP TABLE drafts;
    ALTER TABLE drafts_v1 RENAME TO drafts;",
    // 2: a reply draft holds what it answers (`bot reply --save`): the reply refs and the
    // answered post's text and author, as JSON.
    "ALTER TABLE drafts ADD COLUMN reply TEXT;",
    // 3: how far `bot run --mode replies` has read each source of mentions.
    "CREATE TABLE cursors (source TEXT PRIMARY KEY, seen TEXT NOT NULL);",
];

impl Store {
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
        crate::bluesky::session::private_dir(data_dir).map_err(|source| StoreError::Io {
            path: data_dir.to_path_buf(),
            source,
        })?;
        let path = data_dir.join("bot.sqlite3");
        let conn = Connection::open(&path).map_err(|source| StoreError::Sql {
            path: path.clone(),
            source,
        })?;
        let s = Store { conn, path };
        s.exec(|c| {
            c.busy_timeout(std::time::Duration::from_secs(30))?;
            c.pragma_update(None, "journal_mode", "WAL")?;
            c.execute_batch(SCHEMA)?;
            migrate(c)?;
            c.pragma_update(None, "foreign_keys", "ON")
        })?;
        Ok(s)
    }

    fn exec<T>(&self, f: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> Result<T, StoreError> {
        f(&self.conn).map_err(|source| StoreError::Sql {
            path: self.path.clone(),
            source,
        })
    }

    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records a post about to be sent. A post of a draft claims it in the same statement:
    /// the row is written only while the draft is approved and no other send of it is pending
    /// or done, so two runs that picked the same draft cannot both send it. Err(DraftTaken)
    /// when the claim lost.
    pub fn add_pending(&self, p: &NewPost) -> Result<i64, StoreError> {
        let NewPost {
            account,
            service,
            rkey,
            text,
            record,
            created_at,
            draft_id,
        } = p;
        let (rows, id) = self.exec(|c| {
            let rows = c.execute(
                "INSERT INTO posts (account, service, rkey, text, record, status, created_at, draft_id)
                 SELECT ?1, ?2, ?3, ?4, ?5, 'pending', ?6, ?7
                 WHERE ?7 IS NULL OR (
                   EXISTS (SELECT 1 FROM drafts WHERE id = ?7 AND status = 'approved')
                   AND NOT EXISTS (SELECT 1 FROM posts WHERE draft_id = ?7
                                   AND status IN ('pending', 'posted')))",
                params![account, service, rkey, text, record, created_at, draft_id],
            )?;
            Ok((rows, c.last_insert_rowid()))
        })?;
        match (rows, draft_id) {
            (0, Some(d)) => Err(StoreError::DraftTaken(*d)),
            _ => Ok(id),
        }
    }

    /// Marks a post as published (and its draft, if any), in one transaction.
    pub fn mark_posted(
        &self,
        rkey: &str,
        uri: &str,
        cid: &str,
        posted_at: &str,
    ) -> Result<(), StoreError> {
        self.exec(|c| {
            let tx = c.unchecked_transaction()?;
            tx.execute(
                "UPDATE posts SET status = 'posted', uri = ?2, cid = ?3, posted_at = ?4 WHERE rkey = ?1",
                params![rkey, uri, cid, posted_at],
            )?;
            tx.execute(
                "UPDATE drafts SET status = 'posted', uri = ?2
                 WHERE id = (SELECT draft_id FROM posts WHERE rkey = ?1)",
                params![rkey, uri],
            )?;
            tx.commit()
        })
    }

    pub fn set_status(&self, rkey: &str, status: PostStatus) -> Result<(), StoreError> {
        self.exec(|c| {
            c.execute(
                "UPDATE posts SET status = ?2 WHERE rkey = ?1",
                params![rkey, status],
            )
            .map(|_| ())
        })
    }

    fn rows(&self, sql: &str, p: impl rusqlite::Params) -> Result<Vec<PostRow>, StoreError> {
        self.exec(|c| {
            let mut st = c.prepare(sql)?;
            let rows = st.query_map(p, |r| {
                Ok(PostRow {
                    id: r.get(0)?,
                    account: r.get(1)?,
                    rkey: r.get(2)?,
                    text: r.get(3)?,
                    status: r.get(4)?,
                    uri: r.get(5)?,
                    cid: r.get(6)?,
                    created_at: r.get(7)?,
                    posted_at: r.get(8)?,
                    draft_id: r.get(9)?,
                    record: r.get(10)?,
                })
            })?;
            rows.collect()
        })
    }

    const COLS: &'static str =
        "id, account, rkey, text, status, uri, cid, created_at, posted_at, draft_id, record";

    pub fn pending(&self, account: &str) -> Result<Vec<PostRow>, StoreError> {
        self.rows(
            &format!(
                "SELECT {} FROM posts WHERE account = ?1 AND status = 'pending' ORDER BY id",
                Self::COLS
            ),
            params![account],
        )
    }

    /// The last `n` published posts of the account, newest first.
    pub fn recent_posted(&self, account: &str, n: usize) -> Result<Vec<PostRow>, StoreError> {
        self.rows(
            &format!(
                "SELECT {} FROM posts WHERE account = ?1 AND status = 'posted' ORDER BY id DESC LIMIT ?2",
                Self::COLS
            ),
            params![account, n as i64],
        )
    }

    /// The account's (any account's, for `None`) published reply to `parent_uri`, if any.
    pub fn reply_to(
        &self,
        account: Option<&str>,
        parent_uri: &str,
    ) -> Result<Option<PostRow>, StoreError> {
        Ok(self
            .rows(
                &format!(
                    "SELECT {} FROM posts WHERE (?1 IS NULL OR account = ?1) AND status = 'posted' \
                     AND json_extract(record, '$.reply.parent.uri') = ?2 ORDER BY id DESC LIMIT 1",
                    Self::COLS
                ),
                params![account, parent_uri],
            )?
            .into_iter()
            .next())
    }

    /// The account's published replies in the thread whose root is `root`.
    pub fn replies_in_thread(&self, account: &str, root: &str) -> Result<usize, StoreError> {
        self.exec(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM posts WHERE account = ?1 AND status IN ('posted', 'pending')
                 AND json_extract(record, '$.reply.root.uri') = ?2",
                params![account, root],
                |r| r.get::<_, i64>(0),
            )
        })
        .map(|n| n as usize)
    }

    /// The account's replies published (or being sent) at or after `since` (RFC 3339, UTC).
    pub fn replies_since(&self, account: &str, since: &str) -> Result<usize, StoreError> {
        self.exec(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM posts WHERE account = ?1 AND status IN ('posted', 'pending')
                 AND json_extract(record, '$.reply') IS NOT NULL AND created_at >= ?2",
                params![account, since],
                |r| r.get::<_, i64>(0),
            )
        })
        .map(|n| n as usize)
    }

    /// How far a source of mentions has been read.
    pub fn cursor(&self, source: &str) -> Result<Option<String>, StoreError> {
        self.exec(|c| {
            c.query_row(
                "SELECT seen FROM cursors WHERE source = ?1",
                params![source],
                |r| r.get(0),
            )
            .optional()
        })
    }

    pub fn set_cursor(&self, source: &str, seen: &str) -> Result<(), StoreError> {
        self.exec(|c| {
            c.execute(
                "INSERT INTO cursors (source, seen) VALUES (?1, ?2)
                 ON CONFLICT(source) DO UPDATE SET seen = excluded.seen",
                params![source, seen],
            )
            .map(|_| ())
        })
    }

    pub fn by_uri(&self, uri: &str) -> Result<Option<PostRow>, StoreError> {
        Ok(self
            .rows(
                &format!("SELECT {} FROM posts WHERE uri = ?1", Self::COLS),
                params![uri],
            )?
            .into_iter()
            .next())
    }

    pub fn count_posts(&self, status: PostStatus) -> Result<i64, StoreError> {
        self.exec(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM posts WHERE status = ?1",
                params![status],
                |r| r.get(0),
            )
            .optional()
            .map(|v| v.unwrap_or(0))
        })
    }
}

/// A status stored as text in SQLite (the schema's CHECK lists the same words) and shown as
/// that word in JSON and messages.
macro_rules! status_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name {
            $($variant),+
        }

        impl $name {
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
            pub fn parse(s: &str) -> Option<Self> {
                match s {
                    $($text => Some($name::$variant),)+
                    _ => None,
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl ToSql for $name {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                Ok(ToSqlOutput::from(self.as_str()))
            }
        }

        impl FromSql for $name {
            fn column_result(v: ValueRef<'_>) -> FromSqlResult<Self> {
                let text = v.as_str()?;
                Self::parse(text).ok_or_else(|| {
                    FromSqlError::Other(format!("unknown {} `{text}`", stringify!($name)).into())
                })
            }
        }
    };
}

status_enum! {
/// A draft's life: `new` → `approved` | `rejected`; `approved` ⇄ `rejected` while unposted;
    /// `approved` → `posted` only through publishing, or → `refused` when the guard turns it down
    /// at publishing time (a person may approve or reject it again, after editing). `posted` is
    /// final.
    DraftStatus {
        New = "new",
        Approved = "approved",
        Rejected = "rejected",
        Posted = "posted",
        Refused = "refused",
    }
}

status_enum! {
    /// A post in the history: `pending` from before its send until the server's answer (or the
    /// next run's reconcile) settles it.
    PostStatus {
        Pending = "pending",
        Posted = "posted",
        Failed = "failed",
        Deleted = "deleted",
    }
}

impl DraftStatus {
    /// Whether a person may move a draft from `self` to `to` (posting is not a person's move).
    pub fn can_become(self, to: DraftStatus) -> bool {
        use DraftStatus::*;
        matches!(
            (self, to),
            (New, Approved)
                | (New, Rejected)
                | (Approved, Rejected)
                | (Rejected, Approved)
                | (Refused, Approved)
                | (Refused, Rejected)
        )
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Draft {
    pub id: i64,
    pub text: String,
    pub raw: Option<String>,
    pub prompt: Option<String>,
    pub seed: Option<i64>,
    pub model: Option<String>,
    pub adapter: Option<String>,
    pub created_at: String,
    pub status: DraftStatus,
    pub uri: Option<String>,
    /// Why the guard refused it, for a `refused` draft.
    pub note: Option<String>,
    /// For a reply: what it answers (`DraftReply` as JSON).
    pub reply: Option<String>,
}

/// What a reply draft answers.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct DraftReply {
    pub refs: crate::bluesky::reply::ReplyRefs,
    pub parent_text: String,
    pub parent_author: String,
}

impl Draft {
    /// What this draft answers, when it is a reply.
    pub fn reply(&self) -> Option<DraftReply> {
        serde_json::from_str(self.reply.as_deref()?).ok()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error("no draft {0}")]
    NotFound(i64),
    #[error("draft {id} is {from}; it cannot become {to}")]
    Transition {
        id: i64,
        from: DraftStatus,
        to: String,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Store {
    #[allow(clippy::too_many_arguments)]
    pub fn add_draft(
        &self,
        text: &str,
        raw: Option<&str>,
        prompt: Option<&str>,
        seed: Option<i64>,
        model: Option<&str>,
        adapter: Option<&str>,
        created_at: &str,
    ) -> Result<i64, StoreError> {
        self.exec(|c| {
            c.execute(
                "INSERT INTO drafts (text, raw, prompt, seed, model, adapter, created_at, status)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'new')",
                params![text, raw, prompt, seed, model, adapter, created_at],
            )?;
            Ok(c.last_insert_rowid())
        })
    }

    const DRAFT_COLS: &'static str =
        "id, text, raw, prompt, seed, model, adapter, created_at, status, uri, note, reply";

    fn drafts_where(&self, cond: &str, p: impl rusqlite::Params) -> Result<Vec<Draft>, StoreError> {
        self.exec(|c| {
            let mut st = c.prepare(&format!(
                "SELECT {} FROM drafts WHERE {cond}",
                Self::DRAFT_COLS
            ))?;
            let rows = st.query_map(p, |r| {
                Ok(Draft {
                    id: r.get(0)?,
                    text: r.get(1)?,
                    raw: r.get(2)?,
                    prompt: r.get(3)?,
                    seed: r.get(4)?,
                    model: r.get(5)?,
                    adapter: r.get(6)?,
                    created_at: r.get(7)?,
                    status: r.get(8)?,
                    uri: r.get(9)?,
                    note: r.get(10)?,
                    reply: r.get(11)?,
                })
            })?;
            rows.collect()
        })
    }

    /// Marks draft `id` as a reply to what `reply` describes.
    pub fn set_draft_reply(&self, id: i64, reply: &DraftReply) -> Result<(), StoreError> {
        let json = serde_json::to_string(reply).unwrap_or_default();
        self.exec(|c| {
            c.execute(
                "UPDATE drafts SET reply = ?1 WHERE id = ?2",
                params![json, id],
            )?;
            Ok(())
        })
    }

    pub fn drafts(&self, status: Option<DraftStatus>) -> Result<Vec<Draft>, StoreError> {
        match status {
            Some(s) => self.drafts_where("status = ?1 ORDER BY id", params![s]),
            None => self.drafts_where("1 ORDER BY id", params![]),
        }
    }

    pub fn draft(&self, id: i64) -> Result<Option<Draft>, StoreError> {
        Ok(self
            .drafts_where("id = ?1", params![id])?
            .into_iter()
            .next())
    }

    /// A person's move (approve, reject), checked against the state machine in one statement
    /// so that a concurrent change cannot slip between the check and the write.
    pub fn set_draft_status(&self, id: i64, to: DraftStatus) -> Result<(), DraftError> {
        let allowed: Vec<&str> = [
            DraftStatus::New,
            DraftStatus::Approved,
            DraftStatus::Rejected,
            DraftStatus::Refused,
        ]
        .into_iter()
        .filter(|f| f.can_become(to))
        .map(DraftStatus::as_str)
        .collect();
        let placeholders = allowed
            .iter()
            .map(|s| format!("'{s}'"))
            .collect::<Vec<_>>()
            .join(",");
        let changed = self.exec(|c| {
            c.execute(
                &format!(
                    "UPDATE drafts SET status = ?2 WHERE id = ?1 AND status IN ({placeholders})"
                ),
                params![id, to.as_str()],
            )
        })?;
        if changed == 1 {
            return Ok(());
        }
        match self.draft(id)? {
            None => Err(DraftError::NotFound(id)),
            Some(d) => Err(DraftError::Transition {
                id,
                from: d.status,
                to: to.as_str().into(),
            }),
        }
    }

    /// The guard turned an approved draft down at publishing time: it leaves the queue with
    /// the reason, until a person approves it again.
    pub fn refuse_draft(&self, id: i64, why: &str) -> Result<(), DraftError> {
        let changed = self.exec(|c| {
            c.execute(
                "UPDATE drafts SET status = 'refused', note = ?2 WHERE id = ?1 AND status = 'approved'",
                params![id, why],
            )
        })?;
        if changed == 1 {
            return Ok(());
        }
        match self.draft(id)? {
            None => Err(DraftError::NotFound(id)),
            Some(d) => Err(DraftError::Transition {
                id,
                from: d.status,
                to: "refused".into(),
            }),
        }
    }

    /// Replaces an unposted draft's text.
    pub fn edit_draft(&self, id: i64, text: &str) -> Result<(), DraftError> {
        let changed = self.exec(|c| {
            c.execute(
                "UPDATE drafts SET text = ?2 WHERE id = ?1 AND status != 'posted'",
                params![id, text],
            )
        })?;
        if changed == 1 {
            return Ok(());
        }
        match self.draft(id)? {
            None => Err(DraftError::NotFound(id)),
            Some(d) => Err(DraftError::Transition {
                id,
                from: d.status,
                to: "edited".into(),
            }),
        }
    }

    /// The oldest approved draft that no send is in flight for.
    pub fn next_approved(&self) -> Result<Option<Draft>, StoreError> {
        Ok(self
            .drafts_where(
                "status = 'approved' AND id NOT IN
                   (SELECT draft_id FROM posts WHERE draft_id IS NOT NULL AND status IN ('pending', 'posted'))
                 ORDER BY id LIMIT 1",
                params![],
            )?
            .into_iter()
            .next())
    }

    /// Deletes new and rejected drafts; returns how many.
    pub fn clear_drafts(&self) -> Result<usize, StoreError> {
        self.exec(|c| {
            c.execute(
                "DELETE FROM drafts WHERE status IN ('new', 'rejected')
                   AND id NOT IN (SELECT draft_id FROM posts WHERE draft_id IS NOT NULL)",
                params![],
            )
        })
    }
}

/// Applies the migrations this database lacks.
fn migrate(c: &Connection) -> rusqlite::Result<()> {
    c.pragma_update(None, "foreign_keys", "OFF")?;
    loop {
        c.execute_batch("BEGIN IMMEDIATE")?;
        let version: i64 = c.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        let Some(step) = MIGRATIONS.get(version.max(0) as usize) else {
            c.execute_batch("COMMIT")?;
            return Ok(());
        };
        let applied = c
            .execute_batch(step)
            .and_then(|_| c.pragma_update(None, "user_version", version + 1))
            .and_then(|_| c.execute_batch("COMMIT"));
        if let Err(e) = applied {
            let _ = c.execute_batch("ROLLBACK");
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database made before the migrations opens, gains `refused`, and keeps its drafts.
    #[test]
    fn old_databases_are_migrated() {
        let dir = tempfile::tempdir().unwrap();
        {
            let c = Connection::open(dir.path().join("bot.sqlite3")).unwrap();
            c.execute_batch(SCHEMA).unwrap();
            c.execute(
                "INSERT INTO drafts (text, created_at, status) VALUES ('kept', 't', 'approved')",
                [],
            )
            .unwrap();
        }
        let s = Store::open(dir.path()).unwrap();
        let d = s.drafts(None).unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].text, "kept");
        s.refuse_draft(d[0].id, "too similar").unwrap();
        let d = s.draft(d[0].id).unwrap().unwrap();
        assert_eq!(
            (d.status, d.note.as_deref()),
            (DraftStatus::Refused, Some("too similar"))
        );
        drop(s);
        // opening again applies nothing twice
        let s = Store::open(dir.path()).unwrap();
        let v: i64 = s
            .conn()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v as usize, MIGRATIONS.len());
    }

    #[test]
    fn draft_state_machine() {
        use DraftStatus::*;
        assert!(New.can_become(Approved) && New.can_become(Rejected));
        assert!(Approved.can_become(Rejected) && Rejected.can_become(Approved));
        assert!(!Posted.can_become(Approved) && !Posted.can_become(Rejected));
        assert!(!New.can_become(Posted) && !Approved.can_become(Posted));
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path()).unwrap();
        let id = s
            .add_draft("hello world", None, None, None, None, None, "t")
            .unwrap();
        assert!(s.next_approved().unwrap().is_none());
        s.set_draft_status(id, Approved).unwrap();
        assert_eq!(s.next_approved().unwrap().unwrap().id, id);
        s.add_pending(&NewPost {
            account: "did:x",
            service: "s",
            rkey: "3kaaaaaaaaaaa",
            text: "hello world",
            record: "{}",
            created_at: "t",
            draft_id: Some(id),
        })
        .unwrap();
        assert!(
            s.next_approved().unwrap().is_none(),
            "in flight: not offered twice"
        );
        s.mark_posted("3kaaaaaaaaaaa", "at://x", "cid", "t")
            .unwrap();
        assert_eq!(s.draft(id).unwrap().unwrap().status, Posted);
        let err = s.set_draft_status(id, Rejected).unwrap_err();
        assert!(err.to_string().contains("posted"), "{err}");
        assert!(matches!(
            s.set_draft_status(999, Approved),
            Err(DraftError::NotFound(999))
        ));
        assert!(s.edit_draft(id, "changed").is_err());
    }

    #[test]
    fn two_runs_cannot_both_claim_a_draft() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (
            Store::open(dir.path()).unwrap(),
            Store::open(dir.path()).unwrap(),
        );
        let id = a
            .add_draft("hello world", None, None, None, None, None, "t")
            .unwrap();
        a.set_draft_status(id, DraftStatus::Approved).unwrap();
        // both runs picked the draft before either claimed it
        assert_eq!(a.next_approved().unwrap().unwrap().id, id);
        assert_eq!(b.next_approved().unwrap().unwrap().id, id);
        let post = |rkey: &'static str| NewPost {
            account: "did:x",
            service: "s",
            rkey,
            text: "hello world",
            record: "{}",
            created_at: "t",
            draft_id: Some(id),
        };
        a.add_pending(&post("3kaaaaaaaaaaa")).unwrap();
        assert!(matches!(
            b.add_pending(&post("3kbbbbbbbbbbb")),
            Err(StoreError::DraftTaken(d)) if d == id
        ));
        assert_eq!(a.count_posts(PostStatus::Pending).unwrap(), 1);
        // a send that failed frees the draft for the next run
        a.set_status("3kaaaaaaaaaaa", PostStatus::Failed).unwrap();
        b.add_pending(&post("3kbbbbbbbbbbb")).unwrap();
        // a draft no longer approved cannot be claimed
        let other = a
            .add_draft("another one", None, None, None, None, None, "t")
            .unwrap();
        assert!(matches!(
            a.add_pending(&NewPost {
                draft_id: Some(other),
                ..post("3kccccccccccc")
            }),
            Err(StoreError::DraftTaken(_))
        ));
    }
}
