//! Publishing (the service behind `bot post`, the queue and scheduled runs): the account's
//! credentials and session, the duplicate guard, and the send itself with the local history
//! written before and after it, so a crash never loses or duplicates a post (docs/reliability.md).

use std::io::IsTerminal;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use rand::Rng;
use serde_json::Value;

use crate::app::dedup::{self, TrainingIndex};
use crate::app::settings::{process_env, Settings};
use crate::app::store::{NewPost, PostStatus, Store, StoreError};
use crate::bluesky::record::{self, POST_COLLECTION};
use crate::bluesky::reply::ReplyRefs;
use crate::bluesky::xrpc::RetryPolicy;
use crate::bluesky::{Bluesky, BlueskyError, Credentials, Published};

/// A post refused before anything was sent.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// The app password: BOT_BSKY_APP_PASSWORD, else the configured file, else a prompt on a
/// terminal. Never an argument, never printed.
pub fn password_source(settings: &Settings) -> impl Fn() -> Result<String, BlueskyError> + '_ {
    move || {
        if let Some(p) = process_env("BOT_BSKY_APP_PASSWORD")
            .filter(|p| !p.is_empty() && !settings.password_file_only)
        {
            return Ok(p);
        }
        if let Some(path) = &settings.password_file.value {
            #[cfg(unix)]
            if let Ok(m) = std::fs::metadata(path) {
                use std::os::unix::fs::PermissionsExt;
                if m.permissions().mode() & 0o077 != 0 {
                    eprintln!(
                        "warning: {} is readable by other users; run `chmod 600 {}`",
                        path.display(),
                        path.display()
                    );
                }
            }
            let text = std::fs::read_to_string(path).map_err(|e| {
                BlueskyError::Config(format!(
                    "cannot read the app password file {}: {e}",
                    path.display()
                ))
            })?;
            let p = text.trim().to_string();
            if p.is_empty() {
                return Err(BlueskyError::Config(format!(
                    "the app password file {} is empty",
                    path.display()
                )));
            }
            return Ok(p);
        }
        if std::io::stdin().is_terminal() {
            let handle = settings.handle.value.clone().unwrap_or_default();
            return rpassword::prompt_password(format!("App password for {handle}: "))
                .map_err(|e| BlueskyError::Config(format!("reading the app password: {e}")));
        }
        Err(BlueskyError::Config(
            "no app password: set BOT_BSKY_APP_PASSWORD, or `password_file` under [bluesky] in \
             the config (a file of mode 0600 holding an app password)"
                .into(),
        ))
    }
}

fn credentials<'a>(
    settings: &Settings,
    password: &'a dyn Fn() -> Result<String, BlueskyError>,
) -> Credentials<'a> {
    Credentials {
        service: settings.service.value.trim_end_matches('/').to_string(),
        handle: settings.handle.value.clone().unwrap_or_default(),
        password,
    }
}

/// Retry bounds; BOT_RETRY_TOTAL_S shortens them (tests, impatient schedulers).
fn policy() -> RetryPolicy {
    let mut p = RetryPolicy::default();
    if let Some(s) = process_env("BOT_RETRY_TOTAL_S").and_then(|v| v.parse::<u64>().ok()) {
        p.total = Duration::from_secs(s);
        p.max_rate_limit_wait = p.max_rate_limit_wait.min(p.total);
    }
    p
}

/// Settles posts left `pending` by an interrupted run. One that landed becomes `posted`. One
/// that did not may still be in flight (the killed run's request can reach the server later),
/// so it is sent again under the *same* record key: whichever copy arrives second collides
/// with the first instead of making a second post. Only a definite refusal marks it `failed`.
pub fn reconcile(client: &mut Bluesky, creds: &Credentials, store: &Store) -> anyhow::Result<()> {
    for row in store.pending(&client.session.did)? {
        let landed = match client.get_record(creds, POST_COLLECTION, &row.rkey)? {
            Some(v) => published_of(&v),
            None => {
                let record: Value = serde_json::from_str(&row.record)
                    .with_context(|| format!("the history's record of {}", row.rkey))?;
                match client.create_post(creds, &row.rkey, &record) {
                    Ok(p) => Some(p),
                    Err(BlueskyError::Xrpc(e)) if e.status() == Some(400) => {
                        eprintln!(
                            "an interrupted run's post {} was refused on resending: {e}",
                            row.rkey
                        );
                        store.set_status(&row.rkey, PostStatus::Failed)?;
                        None
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        if let Some(p) = landed {
            store.mark_posted(
                &row.rkey,
                &p.uri,
                &p.cid,
                &record::timestamp(SystemTime::now()),
            )?;
            eprintln!("settled an interrupted run's post: {}", p.uri);
        }
    }
    Ok(())
}

fn published_of(v: &Value) -> Option<Published> {
    Some(Published {
        uri: v.get("uri")?.as_str()?.to_string(),
        cid: v.get("cid")?.as_str()?.to_string(),
    })
}

/// The duplicate guard's inputs.
pub struct Guard {
    pub max_similarity: f64,
    pub history: u32,
    pub training: Option<TrainingIndex>,
}

impl Guard {
    /// Refuses `text` when it repeats a recent post (local history and the account's
    /// records) or copies the training data.
    pub fn check(
        &self,
        client: &mut Bluesky,
        creds: &Credentials,
        store: &Store,
        text: &str,
    ) -> anyhow::Result<()> {
        let mut earlier: Vec<String> = store
            .recent_posted(&client.session.did, self.history as usize)?
            .into_iter()
            .map(|r| r.text)
            .collect();
        for r in client.list_records(creds, POST_COLLECTION, self.history.clamp(1, 100))? {
            if let Some(t) = r.pointer("/value/text").and_then(Value::as_str) {
                earlier.push(t.to_string());
            }
        }
        if let Some((prev, score)) = dedup::near_duplicate(text, &earlier, self.max_similarity) {
            return Err(Refused(format!(
                "refused: {:.0}% similar to an earlier post ({prev:?}); --max-similarity is {}",
                score * 100.0,
                self.max_similarity
            ))
            .into());
        }
        if let Some(span) = self.training.as_ref().and_then(|t| t.copied_span(text)) {
            return Err(Refused(format!(
                "refused: copies the training data verbatim ({span:?})"
            ))
            .into());
        }
        Ok(())
    }
}

/// Publishes `text` (a reply when `reply` is given) with the history written around the send.
#[allow(clippy::too_many_arguments)]
pub fn publish(
    client: &mut Bluesky,
    creds: &Credentials,
    store: &Store,
    text: &str,
    langs: &[String],
    draft_id: Option<i64>,
    guard: &Guard,
    reply: Option<&ReplyRefs>,
) -> anyhow::Result<(String, Published)> {
    record::check_text(text).map_err(BlueskyError::Text)?;
    guard.check(client, creds, store, text)?;
    let spans = record::detect_spans(text);
    let facets = record::facets(&spans, &mut |h| client.resolve_handle(h));
    let now = SystemTime::now();
    let rkey = record::tid(now, rand::rng().random_range(0..1024));
    let mut rec = record::post_record(text, &record::timestamp(now), langs, facets);
    if let Some(r) = reply {
        rec = crate::bluesky::reply::with_reply(rec, r);
    }
    let did = client.session.did.clone();
    store.add_pending(&NewPost {
        account: &did,
        service: &creds.service,
        rkey: &rkey,
        text,
        record: &rec.to_string(),
        created_at: &record::timestamp(now),
        draft_id,
    })?;
    let published = client.create_post(creds, &rkey, &rec)?;
    store.mark_posted(
        &rkey,
        &published.uri,
        &published.cid,
        &record::timestamp(SystemTime::now()),
    )?;
    Ok((rkey, published))
}

/// Runs `f` with the account logged in (or its session reused) and the store open, after
/// settling interrupted sends.
pub fn with_account<T>(
    settings: &Settings,
    f: impl FnOnce(&mut Bluesky, &Credentials, &Store) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let pw = password_source(settings);
    let creds = credentials(settings, &pw);
    let mut client = Bluesky::connect(&creds, &settings.paths.data_dir, policy())?;
    let store = Store::open(&settings.paths.data_dir)?;
    reconcile(&mut client, &creds, &store)?;
    f(&mut client, &creds, &store)
}

/// Publishes the oldest approved draft; None when the queue has none. A draft the guard or
/// the limits turn down becomes `refused` (with the reason) and the next one is tried, so one
/// bad draft never stalls the queue; when every approved draft was refused, that is the error.
pub fn publish_next(
    settings: &Settings,
    guard: &Guard,
) -> anyhow::Result<Option<(i64, Published)>> {
    with_account(settings, |client, creds, store| {
        let mut refused = Vec::new();
        while let Some(d) = store.next_approved()? {
            match publish(
                client,
                creds,
                store,
                &d.text,
                &settings.langs.value,
                Some(d.id),
                guard,
                d.reply().map(|r| r.refs).as_ref(),
            ) {
                Ok((_, p)) => return Ok(Some((d.id, p))),
                // A concurrent run claimed it between our pick and our claim: theirs to send.
                Err(e)
                    if e.chain()
                        .any(|c| matches!(c.downcast_ref(), Some(StoreError::DraftTaken(_)))) =>
                {
                    eprintln!(
                        "draft {} is being sent by another run; taking the next",
                        d.id
                    );
                }
                Err(e) if is_refusal(&e) => {
                    let why = format!("{e:#}");
                    eprintln!("draft {} refused: {why}", d.id);
                    store.refuse_draft(d.id, &why)?;
                    refused.push(format!("draft {}: {why}", d.id));
                }
                Err(e) => return Err(e),
            }
        }
        if refused.is_empty() {
            return Ok(None);
        }
        Err(Refused(format!(
            "every approved draft was refused ({}); edit and approve them again with `bot queue approve`",
            refused.join("; ")
        ))
        .into())
    })
}

/// Whether `e` turned the text down before anything was sent.
fn is_refusal(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<Refused>().is_some()
            || c.downcast_ref::<record::TextError>().is_some()
            || matches!(
                c.downcast_ref::<BlueskyError>(),
                Some(BlueskyError::Text(_))
            )
    })
}
