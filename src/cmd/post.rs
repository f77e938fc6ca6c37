//! `bot post`, `bot delete`, `bot whoami`, `bot label-bot`: settings → text → record →
//! Bluesky through the publishing service (`app::publish`).

use std::path::Path;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use serde_json::{json, Value};

use crate::app::dedup::{self, TrainingIndex};
use crate::app::publish::{publish, publish_next, with_account, Guard, Refused};
use crate::app::settings::{Overrides, Settings};
use crate::app::store::{PostStatus, Store};
use crate::bluesky::record::{self, POST_COLLECTION};
use crate::bluesky::{self, BlueskyError};
use crate::cmd::cli::{AccountArgs, BadArgument, DeleteArgs, GuardArgs, PostArgs};
use crate::cmd::{self, load_settings};

pub fn settings_for(
    config: Option<&Path>,
    profile: Option<&str>,
    a: &AccountArgs,
    o: Overrides,
) -> anyhow::Result<Settings> {
    load_settings(
        config,
        profile,
        &o.with("bluesky.service", a.service.as_ref())
            .with("bluesky.handle", a.handle.as_ref()),
    )
}

fn dry_run(settings: &Settings, text: &str, json_out: bool) -> anyhow::Result<()> {
    let spans = record::detect_spans(text);
    let anon = bluesky::anonymous(Duration::from_secs(10))?;
    let mut unresolved = Vec::new();
    let facets = record::facets(&spans, &mut |h| {
        let did = bluesky::resolve_handle(&anon, &settings.service.value, h);
        if did.is_none() {
            unresolved.push(h.to_string());
        }
        did
    });
    let now = SystemTime::now();
    let rkey = record::tid(now, 0);
    let rec = record::post_record(text, &record::timestamp(now), &settings.langs.value, facets);
    let report = json!({
        "dry_run": true,
        "call": "com.atproto.repo.createRecord",
        "service": settings.service.value,
        "repo": settings.handle.value,
        "collection": POST_COLLECTION,
        "rkey": rkey,
        "record": rec,
        "graphemes": crate::generate::postprocess::grapheme_count(text),
        "bytes": text.len(),
        "facets": spans,
        "unresolved_mentions": unresolved,
    });
    if json_out {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

pub fn post(config: Option<&Path>, profile: Option<&str>, args: &PostArgs) -> anyhow::Result<()> {
    let settings = settings_for(
        config,
        profile,
        &args.account,
        cmd::overrides(&args.model, &args.sampling),
    )?;
    let guard = crate::cmd::post::guard(&args.guard)?;
    if args.next {
        if args.dry_run {
            let store = Store::open(&settings.paths.data_dir)?;
            return match store.next_approved()? {
                Some(d) => dry_run(&settings, &d.text, args.json),
                None => {
                    eprintln!("no approved drafts");
                    Ok(())
                }
            };
        }
        match publish_next(&settings, &guard)? {
            Some((id, p)) => {
                if args.json {
                    println!("{}", json!({ "uri": p.uri, "cid": p.cid, "draft": id }));
                } else {
                    println!("{}", p.uri);
                }
            }
            None => eprintln!("no approved drafts: nothing posted"),
        }
        return Ok(());
    }
    let text = match &args.text {
        Some(t) => t.trim().to_string(),
        None => {
            let (mut generator, _) = cmd::load_generator(&settings, &args.model, !args.quiet)?;
            let seed = args
                .sampling
                .seed
                .unwrap_or_else(|| rand::random::<u32>() as u64);
            let req = cmd::post_request(&settings, &args.sampling, seed)?;
            let progress = cmd::Progress::new(!args.quiet);
            let p = generator.post(&req, &mut |e| progress.event("post", &e));
            progress.finish();
            let p = p?;
            if !args.quiet {
                cmd::report_post(&p, 0, 1);
            }
            p.text
        }
    };
    record::check_text(&text).map_err(BlueskyError::Text)?;
    if args.dry_run {
        return dry_run(&settings, &text, args.json);
    }
    let (rkey, published) = with_account(&settings, |client, creds, store| {
        publish(
            client,
            creds,
            store,
            &text,
            &settings.langs.value,
            None,
            &guard,
            None,
        )
    })?;
    if args.json {
        println!(
            "{}",
            json!({ "uri": published.uri, "cid": published.cid, "rkey": rkey, "text": text })
        );
    } else {
        println!("{}", published.uri);
    }
    Ok(())
}

pub fn delete(
    config: Option<&Path>,
    profile: Option<&str>,
    args: &DeleteArgs,
) -> anyhow::Result<()> {
    let settings = settings_for(config, profile, &args.account, Overrides::default())?;
    with_account(&settings, |client, creds, store| {
        let uri = if args.target == "last" {
            store
                .recent_posted(&client.session.did, 1)?
                .into_iter()
                .next()
                .and_then(|r| r.uri)
                .ok_or_else(|| {
                    anyhow::anyhow!("no post of {} in the local history", creds.handle)
                })?
        } else {
            args.target.clone()
        };
        let (repo, collection, rkey) = bluesky::parse_at_uri(&uri).ok_or_else(|| {
            anyhow::anyhow!("{uri:?} is not an at:// URI of the form at://DID/COLLECTION/RKEY")
        })?;
        if repo != client.session.did && !repo.eq_ignore_ascii_case(&client.session.handle) {
            anyhow::bail!(
                "{uri} belongs to {repo}, not to {} ({})",
                client.session.handle,
                client.session.did
            );
        }
        // only posts: the profile, follows and likes are not this command's to delete
        if collection != POST_COLLECTION {
            return Err(Refused(format!(
                "{uri} is a {collection} record, not a post ({POST_COLLECTION}): `bot delete` deletes posts only"
            ))
            .into());
        }
        if client.get_record(creds, &collection, &rkey)?.is_none() {
            anyhow::bail!("{uri} does not exist (nothing was deleted)");
        }
        client.delete(creds, &collection, &rkey)?;
        store.set_status(&rkey, PostStatus::Deleted)?;
        println!("deleted {uri}");
        Ok(())
    })
}

pub fn whoami(
    config: Option<&Path>,
    profile: Option<&str>,
    args: &AccountArgs,
) -> anyhow::Result<()> {
    let settings = settings_for(config, profile, args, Overrides::default())?;
    with_account(&settings, |client, creds, _| {
        let v: Value = client.whoami(creds)?;
        println!(
            "{}",
            json!({
                "handle": v.get("handle"),
                "did": v.get("did"),
                "pds": client.session.pds,
                "service": client.session.service,
                "new_login": client.logins > 0,
            })
        );
        Ok(())
    })
}

pub fn label_bot(
    config: Option<&Path>,
    profile: Option<&str>,
    args: &AccountArgs,
) -> anyhow::Result<()> {
    let settings = settings_for(config, profile, args, Overrides::default())?;
    with_account(&settings, |client, creds, _| {
        if client.label_bot(creds)? {
            println!("added the `bot` self-label to {}", client.session.handle);
        } else {
            println!(
                "{} already carries the `bot` self-label",
                client.session.handle
            );
        }
        Ok(())
    })
}

/// The duplicate guard the flags ask for.
pub fn guard(g: &GuardArgs) -> anyhow::Result<Guard> {
    let training = match &g.training_data {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading training data {}", path.display()))?;
            let posts = dedup::training_posts(&text)
                .map_err(|e| anyhow::anyhow!("training data {}: {e}", path.display()))?;
            Some(TrainingIndex::new(&posts, g.copied_words))
        }
        None => None,
    };
    if !(g.max_similarity > 0.0 && g.max_similarity <= 1.0) {
        return Err(BadArgument(format!(
            "--max-similarity {}: expected a number in (0, 1] (1 refuses only identical posts)",
            g.max_similarity
        ))
        .into());
    }
    if g.copied_words == 0 {
        return Err(BadArgument("--copied-words 0: expected at least 1 word".into()).into());
    }
    Ok(Guard {
        max_similarity: g.max_similarity,
        history: g.history,
        training,
    })
}
