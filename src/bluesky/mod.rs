//! Bluesky over plain AT Protocol XRPC: login with an app password, a cached session that is
//! refreshed when its access token expires (`ExpiredToken`, HTTP 400 on the reference PDS) and
//! recreated only when the refresh fails, and posting that can never make the same post twice
//! (the record key is chosen first; an ambiguous failure is resolved with `getRecord`).

pub mod record;
pub mod reply;
pub mod session;
pub mod xrpc;

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use record::POST_COLLECTION;
use session::{Session, SessionStore};
use xrpc::{Call, RetryPolicy, Xrpc, XrpcError};

#[derive(Debug, thiserror::Error)]
pub enum BlueskyError {
    #[error("{0}")]
    Config(String),
    #[error("login as {handle} on {service} failed: {why}")]
    Auth {
        handle: String,
        service: String,
        why: String,
    },
    #[error(transparent)]
    Xrpc(#[from] XrpcError),
    #[error(transparent)]
    Session(#[from] session::StoreError),
    #[error(transparent)]
    Text(#[from] record::TextError),
    #[error("unexpected response from {nsid}: {why}")]
    Protocol { nsid: String, why: String },
}

impl BlueskyError {
    pub fn is_rate_limited(&self) -> bool {
        matches!(self, BlueskyError::Xrpc(XrpcError::RateLimited { .. }))
    }
}

/// Who logs in where. The password is only read when a new session is needed.
pub struct Credentials<'a> {
    pub service: String,
    pub handle: String,
    pub password: &'a dyn Fn() -> Result<String, BlueskyError>,
}

/// A published record.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Published {
    pub uri: String,
    pub cid: String,
}

pub struct Bluesky {
    xrpc: Xrpc,
    store: SessionStore,
    pub session: Session,
    /// How many `createSession` calls this client made (tests check reuse).
    pub logins: u32,
}

fn auth_message(e: &XrpcError) -> String {
    match e.name() {
        Some("AuthFactorTokenRequired") => "the account asks for an email sign-in code: create an \
            app password (Settings → Privacy and security → App passwords) and use that instead"
            .into(),
        Some("AccountTakedown") => "the account has been taken down by the service".into(),
        Some("AuthenticationRequired") | Some("InvalidPassword") => {
            "wrong handle or app password (check BOT_BSKY_APP_PASSWORD or the password file)".into()
        }
        _ => e.to_string(),
    }
}

impl Bluesky {
    /// Reuses the cached session for this account, or logs in. Holds the profile's session
    /// lock until dropped.
    pub fn connect(
        creds: &Credentials,
        data_dir: &Path,
        policy: RetryPolicy,
    ) -> Result<Self, BlueskyError> {
        if creds.handle.is_empty() {
            return Err(BlueskyError::Config(
                "no Bluesky handle: pass --handle, set BOT_BSKY_HANDLE, or add `handle` under [bluesky] in the config".into(),
            ));
        }
        let xrpc = Xrpc::new(policy)?;
        let store = SessionStore::open(data_dir)?;
        let cached = store.load(&creds.service, &creds.handle);
        let mut me = match cached {
            Some(session) => Bluesky {
                xrpc,
                store,
                session,
                logins: 0,
            },
            None => {
                let session = Self::login(&xrpc, creds)?;
                store.save(&session)?;
                Bluesky {
                    xrpc,
                    store,
                    session,
                    logins: 1,
                }
            }
        };
        if me.session.access_expired(SystemTime::now(), 30) {
            me.refresh_or_login(creds)?;
        }
        Ok(me)
    }

    fn login(xrpc: &Xrpc, creds: &Credentials) -> Result<Session, BlueskyError> {
        let password = (creds.password)()?;
        let body = json!({ "identifier": creds.handle, "password": password });
        let v = xrpc
            .call(
                &creds.service,
                "com.atproto.server.createSession",
                Call::Procedure(&body),
                None,
                false,
            )
            .map_err(|e| match e {
                XrpcError::Api { status, .. } if status == 401 || status == 400 => {
                    BlueskyError::Auth {
                        handle: creds.handle.clone(),
                        service: creds.service.clone(),
                        why: auth_message(&e),
                    }
                }
                other => BlueskyError::Xrpc(other),
            })?;
        Session::from_response(&creds.service, &v).ok_or_else(|| BlueskyError::Protocol {
            nsid: "com.atproto.server.createSession".into(),
            why: "no did, handle or tokens in the response".into(),
        })
    }

    fn refresh_or_login(&mut self, creds: &Credentials) -> Result<(), BlueskyError> {
        let refreshed = self
            .xrpc
            .call(
                &self.session.pds,
                "com.atproto.server.refreshSession",
                Call::Empty,
                Some(&self.session.refresh_jwt),
                false,
            )
            .ok()
            .and_then(|v| Session::from_response(&self.session.service, &v))
            .map(|mut s| {
                // refreshSession's didDoc may be absent: keep the known PDS then.
                if s.pds == s.service {
                    s.pds = self.session.pds.clone();
                }
                s
            });
        self.session = match refreshed {
            Some(s) => s,
            None => {
                self.store.clear()?;
                self.logins += 1;
                Self::login(&self.xrpc, creds)?
            }
        };
        self.store.save(&self.session)?;
        Ok(())
    }

    /// An authenticated call on the account's PDS; an expired or rejected access token is
    /// refreshed (or the session recreated) once.
    pub fn call(
        &mut self,
        creds: &Credentials,
        nsid: &str,
        call: Call,
        idempotent: bool,
    ) -> Result<Value, BlueskyError> {
        let first = self.xrpc.call(
            &self.session.pds,
            nsid,
            Self::again(&call),
            Some(&self.session.access_jwt),
            idempotent,
        );
        match first {
            Err(e) if matches!(e.name(), Some("ExpiredToken") | Some("InvalidToken")) => {
                self.refresh_or_login(creds)?;
                Ok(self.xrpc.call(
                    &self.session.pds,
                    nsid,
                    call,
                    Some(&self.session.access_jwt),
                    idempotent,
                )?)
            }
            other => Ok(other?),
        }
    }

    fn again<'a>(c: &Call<'a>) -> Call<'a> {
        match c {
            Call::Query(q) => Call::Query(q),
            Call::Procedure(b) => Call::Procedure(b),
            Call::Empty => Call::Empty,
        }
    }

    pub fn whoami(&mut self, creds: &Credentials) -> Result<Value, BlueskyError> {
        self.call(
            creds,
            "com.atproto.server.getSession",
            Call::Query(&[]),
            true,
        )
    }

    /// The DID of `handle`, or None when it does not resolve.
    pub fn resolve_handle(&self, handle: &str) -> Option<String> {
        resolve_handle(&self.xrpc, &self.session.pds, handle)
    }

    /// The record at `collection/rkey` of this account, or None when there is none.
    pub fn get_record(
        &mut self,
        creds: &Credentials,
        collection: &str,
        rkey: &str,
    ) -> Result<Option<Value>, BlueskyError> {
        let did = self.session.did.clone();
        let q = [
            ("repo", did.as_str()),
            ("collection", collection),
            ("rkey", rkey),
        ];
        match self.call(creds, "com.atproto.repo.getRecord", Call::Query(&q), true) {
            Ok(v) => Ok(Some(v)),
            Err(BlueskyError::Xrpc(e)) if e.name() == Some("RecordNotFound") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A post of any repo (a DID or a handle), or None when there is none: the post a reply
    /// answers, and its thread's ancestors.
    pub fn get_post(
        &mut self,
        creds: &Credentials,
        repo: &str,
        rkey: &str,
    ) -> Result<Option<reply::FetchedPost>, BlueskyError> {
        let nsid = "com.atproto.repo.getRecord";
        let q = [
            ("repo", repo),
            ("collection", POST_COLLECTION),
            ("rkey", rkey),
        ];
        match self.call(creds, nsid, Call::Query(&q), true) {
            Ok(v) => reply::FetchedPost::from_get_record(&v)
                .map(Some)
                .ok_or_else(|| BlueskyError::Protocol {
                    nsid: nsid.into(),
                    why: "no uri, cid or value in the response".into(),
                }),
            Err(BlueskyError::Xrpc(e))
                if matches!(e.name(), Some("RecordNotFound") | Some("RepoNotFound")) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Posts of any repo, newest first (up to 100).
    pub fn list_posts_of(
        &mut self,
        creds: &Credentials,
        repo: &str,
        limit: u32,
    ) -> Result<Vec<reply::FetchedPost>, BlueskyError> {
        let limit = limit.clamp(1, 100).to_string();
        let q = [
            ("repo", repo),
            ("collection", POST_COLLECTION),
            ("limit", limit.as_str()),
        ];
        let v = self.call(creds, "com.atproto.repo.listRecords", Call::Query(&q), true)?;
        Ok(v.get("records")
            .and_then(Value::as_array)
            .map(|r| {
                r.iter()
                    .filter_map(reply::FetchedPost::from_get_record)
                    .collect()
            })
            .unwrap_or_default())
    }

    pub fn list_records(
        &mut self,
        creds: &Credentials,
        collection: &str,
        limit: u32,
    ) -> Result<Vec<Value>, BlueskyError> {
        let did = self.session.did.clone();
        let limit = limit.to_string();
        let q = [
            ("repo", did.as_str()),
            ("collection", collection),
            ("limit", limit.as_str()),
        ];
        let v = self.call(creds, "com.atproto.repo.listRecords", Call::Query(&q), true)?;
        Ok(v.get("records")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default())
    }

    /// Creates the post under `rkey`. After an ambiguous failure (no response, or a 5xx) it
    /// asks `getRecord` whether the post landed before trying again, so the post exists at
    /// most once whatever the network does. Bounded by the retry policy.
    pub fn create_post(
        &mut self,
        creds: &Credentials,
        rkey: &str,
        record: &Value,
    ) -> Result<Published, BlueskyError> {
        let nsid = "com.atproto.repo.createRecord";
        let body = json!({
            "repo": self.session.did,
            "collection": POST_COLLECTION,
            "rkey": rkey,
            "record": record,
        });
        let start = Instant::now();
        let mut backoff = self.xrpc.policy.first_backoff;
        let attempts = self.xrpc.policy.attempts;
        let mut last_err = None;
        for attempt in 1..=attempts {
            match self.call(creds, nsid, Call::Procedure(&body), false) {
                Ok(v) => return published(nsid, &v),
                Err(BlueskyError::Xrpc(e)) if e.is_ambiguous() => {
                    eprintln!("{nsid}: {e}; checking whether the post landed (attempt {attempt}/{attempts})");
                    std::thread::sleep(backoff);
                    if let Some(v) = self.get_record(creds, POST_COLLECTION, rkey)? {
                        return published("com.atproto.repo.getRecord", &v);
                    }
                    last_err = Some(e);
                    if start.elapsed() + backoff > self.xrpc.policy.total {
                        break;
                    }
                    backoff = (backoff * 2).min(self.xrpc.policy.max_backoff);
                }
                Err(e) => return Err(e),
            }
        }
        Err(BlueskyError::Xrpc(last_err.unwrap_or(
            XrpcError::Transport {
                nsid: nsid.into(),
                url: self.session.pds.clone(),
                why: "gave up".into(),
            },
        )))
    }

    pub fn delete(
        &mut self,
        creds: &Credentials,
        collection: &str,
        rkey: &str,
    ) -> Result<(), BlueskyError> {
        let body = json!({ "repo": self.session.did, "collection": collection, "rkey": rkey });
        // Deleting is idempotent: a retry of a delete that landed is a no-op.
        self.call(
            creds,
            "com.atproto.repo.deleteRecord",
            Call::Procedure(&body),
            true,
        )?;
        Ok(())
    }

    /// Adds the `bot` self-label to the profile record, keeping everything else. Returns
    /// false when it was already there.
    pub fn label_bot(&mut self, creds: &Credentials) -> Result<bool, BlueskyError> {
        let collection = "app.bsky.actor.profile";
        let existing = self.get_record(creds, collection, "self")?;
        let (mut profile, swap) = match &existing {
            Some(v) => (
                v.get("value").cloned().unwrap_or_else(|| json!({})),
                v.get("cid").and_then(Value::as_str).map(str::to_string),
            ),
            None => (json!({ "$type": collection }), None),
        };
        let values = profile
            .pointer("/labels/values")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if values
            .iter()
            .any(|l| l.get("val").and_then(Value::as_str) == Some("bot"))
        {
            return Ok(false);
        }
        let mut values = values;
        values.push(json!({ "val": "bot" }));
        profile["labels"] =
            json!({ "$type": "com.atproto.label.defs#selfLabels", "values": values });
        let mut body = json!({
            "repo": self.session.did,
            "collection": collection,
            "rkey": "self",
            "record": profile,
        });
        // swapRecord makes a concurrent profile edit fail instead of being overwritten.
        if let Some(cid) = swap {
            body["swapRecord"] = json!(cid);
        }
        self.call(
            creds,
            "com.atproto.repo.putRecord",
            Call::Procedure(&body),
            false,
        )?;
        Ok(true)
    }
}

fn published(nsid: &str, v: &Value) -> Result<Published, BlueskyError> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    match (s("uri"), s("cid")) {
        (Some(uri), Some(cid)) => Ok(Published { uri, cid }),
        _ => Err(BlueskyError::Protocol {
            nsid: nsid.into(),
            why: "no uri/cid in the response".into(),
        }),
    }
}

/// `com.atproto.identity.resolveHandle` (no login needed).
pub fn resolve_handle(xrpc: &Xrpc, service: &str, handle: &str) -> Option<String> {
    xrpc.call(
        service,
        "com.atproto.identity.resolveHandle",
        Call::Query(&[("handle", handle)]),
        None,
        true,
    )
    .ok()?
    .get("did")?
    .as_str()
    .map(str::to_string)
}

/// A client for calls that need no login (dry runs).
pub fn anonymous(timeout: Duration) -> Result<Xrpc, BlueskyError> {
    Ok(Xrpc::new(RetryPolicy {
        attempts: 2,
        request_timeout: timeout,
        ..RetryPolicy::default()
    })?)
}

/// `at://did/collection/rkey` → its parts.
pub fn parse_at_uri(uri: &str) -> Option<(String, String, String)> {
    let rest = uri.strip_prefix("at://")?;
    let mut parts = rest.splitn(3, '/');
    let (a, c, r) = (parts.next()?, parts.next()?, parts.next()?);
    (!a.is_empty() && !c.is_empty() && !r.is_empty() && !r.contains('/'))
        .then(|| (a.to_string(), c.to_string(), r.to_string()))
}
