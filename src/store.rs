//! Local state in SQLite (`bot.sqlite3` in the profile's data dir): drafts and the posting
//! history. Every change is one transaction; WAL and a busy timeout let a cron run and a
//! human share the file. A post is written as `pending` (with its record key) *before* it is
//! sent, so a crash mid-send is reconciled on the next run instead of forgotten or repeated.

use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OptionalExtension};
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
    pub status: String,
    pub uri: Option<String>,
    pub cid: Option<String>,
    pub created_at: String,
    pub posted_at: Option<String>,
    pub draft_id: Option<i64>,
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
            c.pragma_update(None, "foreign_keys", "ON")?;
            c.execute_batch(SCHEMA)
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

    /// Records a post about to be sent.
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
        self.exec(|c| {
            c.execute(
                "INSERT INTO posts (account, service, rkey, text, record, status, created_at, draft_id)
                 VALUES (?1, ?2, ?3, ?4, ?5, 'pending', ?6, ?7)",
                params![account, service, rkey, text, record, created_at, draft_id],
            )?;
            Ok(c.last_insert_rowid())
        })
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

    pub fn set_status(&self, rkey: &str, status: &str) -> Result<(), StoreError> {
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
                })
            })?;
            rows.collect()
        })
    }

    const COLS: &'static str =
        "id, account, rkey, text, status, uri, cid, created_at, posted_at, draft_id";

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

    pub fn by_uri(&self, uri: &str) -> Result<Option<PostRow>, StoreError> {
        Ok(self
            .rows(
                &format!("SELECT {} FROM posts WHERE uri = ?1", Self::COLS),
                params![uri],
            )?
            .into_iter()
            .next())
    }

    pub fn count_posts(&self, status: &str) -> Result<i64, StoreError> {
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
