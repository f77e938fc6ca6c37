//! `bot reply --to POST` and `bot thread POST`: the post fetched with `getRecord` (no login
//! needed), a reply written in the user's voice from the configured reply prompt (or `--text`),
//! post-processed as posts are, then shown (`--dry-run`), queued as a reply draft (`--save`) or
//! published with its `root`/`parent` refs through the same never-twice path as posts.

use std::path::Path;
use std::time::{Duration, SystemTime};

use serde_json::{json, Value};

use crate::app::publish::{publish, with_account};
use crate::app::store::{DraftReply, Store};
use crate::bluesky::record::{self, POST_COLLECTION};
use crate::bluesky::reply::{self, FetchedPost, PostRef};
use crate::bluesky::xrpc::{Call, Xrpc};
use crate::bluesky::{self, BlueskyError};
use crate::cmd::cli::{BadArgument, ReplyArgs, ThreadArgs};
use crate::cmd::post::{guard, settings_for};
use crate::cmd::{self};

fn target(s: &str) -> anyhow::Result<PostRef> {
    reply::parse_target(s).map_err(|e| BadArgument(e.to_string()).into())
}

/// The post `r` names, through `service`, without logging in.
pub fn fetch(anon: &Xrpc, service: &str, r: &PostRef) -> anyhow::Result<FetchedPost> {
    let nsid = "com.atproto.repo.getRecord";
    let q = [
        ("repo", r.repo.as_str()),
        ("collection", POST_COLLECTION),
        ("rkey", r.rkey.as_str()),
    ];
    let v = anon
        .call(service, nsid, Call::Query(&q), None, true)
        .map_err(|e| match e.name() {
            Some("RecordNotFound") | Some("RepoNotFound") | Some("InvalidRequest") => {
                anyhow::anyhow!(
                    "no post at://{}/{POST_COLLECTION}/{} on {service} ({e})",
                    r.repo,
                    r.rkey
                )
            }
            _ => BlueskyError::Xrpc(e).into(),
        })?;
    FetchedPost::from_get_record(&v).ok_or_else(|| {
        BlueskyError::Protocol {
            nsid: nsid.into(),
            why: "no uri, cid or value in the response".into(),
        }
        .into()
    })
}

/// The handle of `did` for showing (`describeRepo`), or the DID itself.
fn display_name(anon: &Xrpc, service: &str, did: &str) -> String {
    anon.call(
        service,
        "com.atproto.repo.describeRepo",
        Call::Query(&[("repo", did)]),
        None,
        true,
    )
    .ok()
    .and_then(|v| v.get("handle").and_then(Value::as_str).map(str::to_string))
    .map(|h| format!("@{h}"))
    .unwrap_or_else(|| did.to_string())
}

pub fn reply(config: Option<&Path>, profile: Option<&str>, args: &ReplyArgs) -> anyhow::Result<()> {
    let settings = settings_for(
        config,
        profile,
        &args.account,
        cmd::overrides(&args.model, &args.sampling),
    )?;
    let to = target(&args.to)?;
    let guard = guard(&args.guard)?;
    let service = settings.service.value.trim_end_matches('/').to_string();
    let anon = bluesky::anonymous(Duration::from_secs(20))?;
    let parent = fetch(&anon, &service, &to)?;
    let author = display_name(&anon, &service, parent.author());
    let refs = parent.refs_for_reply();
    if !args.quiet {
        eprintln!("replying to {author}: {}", parent.text().replace('\n', " "));
    }
    if !args.again && !args.dry_run && !args.save {
        let store = Store::open(&settings.paths.data_dir)?;
        if let Some(row) = store.reply_to(None, &parent.uri)? {
            let uri = row.uri.clone().unwrap_or_default();
            eprintln!(
                "{} was answered already: {uri} (--again replies once more)",
                parent.uri
            );
            if args.json {
                println!(
                    "{}",
                    json!({ "uri": uri, "cid": row.cid, "rkey": row.rkey, "text": row.text, "reply": refs, "existing": true })
                );
            } else {
                println!("{uri}");
            }
            return Ok(());
        }
    }
    let template = settings
        .reply_prompt
        .value
        .clone()
        .unwrap_or_else(|| reply::DEFAULT_REPLY_PROMPT.to_string());
    let instruction = reply::reply_prompt(&template, parent.text(), &author);
    let (text, generated) = match &args.text {
        Some(t) => (t.trim().to_string(), None),
        None => {
            let (mut generator, _) = cmd::load_generator(&settings, &args.model, !args.quiet)?;
            let seed = args
                .sampling
                .seed
                .unwrap_or_else(|| rand::random::<u32>() as u64);
            let mut req = cmd::post_request(&settings, &args.sampling, seed)?;
            req.prompt = Some(instruction.clone());
            let progress = cmd::Progress::new(!args.quiet);
            let p = generator.post(&req, &mut |e| progress.event("reply", &e));
            progress.finish();
            let p = p?;
            if !args.quiet {
                cmd::report_post(&p, 0, 1);
            }
            (p.text.clone(), Some(p))
        }
    };
    record::check_text(&text).map_err(BlueskyError::Text)?;
    let answering =
        json!({ "uri": parent.uri, "cid": parent.cid, "author": author, "text": parent.text() });
    if args.save {
        let store = Store::open(&settings.paths.data_dir)?;
        let id = match &generated {
            Some(p) => crate::app::drafts::save_draft(&store, p, &settings)?,
            None => store.add_draft(
                &text,
                None,
                Some(&instruction),
                None,
                None,
                None,
                &record::timestamp(SystemTime::now()),
            )?,
        };
        store.set_draft_reply(
            id,
            &DraftReply {
                refs: refs.clone(),
                parent_text: parent.text().to_string(),
                parent_author: author.clone(),
            },
        )?;
        if args.json {
            println!(
                "{}",
                json!({ "draft": id, "text": text, "answering": answering })
            );
        } else {
            println!("{id}");
        }
        return Ok(());
    }
    if args.dry_run {
        let now = SystemTime::now();
        let rec = reply::with_reply(
            record::post_record(
                &text,
                &record::timestamp(now),
                &settings.langs.value,
                Vec::new(),
            ),
            &refs,
        );
        let report = json!({
            "dry_run": true,
            "call": "com.atproto.repo.createRecord",
            "service": service,
            "repo": settings.handle.value,
            "collection": POST_COLLECTION,
            "record": rec,
            "answering": answering,
            "graphemes": crate::generate::postprocess::grapheme_count(&text),
            "bytes": text.len(),
        });
        if args.json {
            println!("{report}");
        } else {
            println!("{}", serde_json::to_string_pretty(&report)?);
        }
        return Ok(());
    }
    let done = with_account(&settings, |client, creds, store| {
        // after an interrupted run was settled: a post answered already is not answered again
        if !args.again {
            if let Some(row) = store.reply_to(Some(&client.session.did), &parent.uri)? {
                return Ok(Err(row));
            }
        }
        publish(
            client,
            creds,
            store,
            &text,
            &settings.langs.value,
            None,
            &guard,
            Some(&refs),
        )
        .map(Ok)
    })?;
    match done {
        Ok((rkey, published)) => {
            if args.json {
                println!(
                    "{}",
                    json!({ "uri": published.uri, "cid": published.cid, "rkey": rkey, "text": text, "reply": refs })
                );
            } else {
                println!("{}", published.uri);
            }
        }
        Err(row) => {
            let uri = row.uri.unwrap_or_default();
            eprintln!(
                "{} was answered already: {uri} (--again replies once more)",
                parent.uri
            );
            if args.json {
                println!(
                    "{}",
                    json!({ "uri": uri, "cid": row.cid, "rkey": row.rkey, "text": row.text, "reply": refs, "existing": true })
                );
            } else {
                println!("{uri}");
            }
        }
    }
    Ok(())
}

/// `bot thread POST`: the post's ancestors up to the thread's root, then the post, as
/// `getRecord` finds them (replies to it are not listed: finding them needs an AppView, or
/// the sandbox's member repos, `bot sandbox page`).
pub fn thread(
    config: Option<&Path>,
    profile: Option<&str>,
    args: &ThreadArgs,
) -> anyhow::Result<()> {
    let settings = settings_for(config, profile, &args.account, Default::default())?;
    let service = settings.service.value.trim_end_matches('/').to_string();
    let anon = bluesky::anonymous(Duration::from_secs(20))?;
    let mut chain = vec![fetch(&anon, &service, &target(&args.uri)?)?];
    // up the parents, at most a long thread's depth (a cycle cannot be made, but be bounded)
    while chain.len() < 200 {
        let Some(r) = chain.last().and_then(FetchedPost::reply) else {
            break;
        };
        let Some((repo, _, rkey)) = bluesky::parse_at_uri(&r.parent.uri) else {
            break;
        };
        match fetch(&anon, &service, &PostRef { repo, rkey }) {
            Ok(p) => chain.push(p),
            Err(e) => {
                eprintln!("the thread's earlier posts are out of reach: {e:#}");
                break;
            }
        }
    }
    chain.reverse();
    for (depth, p) in chain.iter().enumerate() {
        let who = display_name(&anon, &service, p.author());
        let at = p
            .value
            .get("createdAt")
            .and_then(Value::as_str)
            .unwrap_or("");
        if args.json {
            println!(
                "{}",
                json!({ "depth": depth, "uri": p.uri, "cid": p.cid, "author": who, "created_at": at, "text": p.text() })
            );
        } else {
            let pad = "  ".repeat(depth);
            println!("{pad}{who}  {at}");
            for line in p.text().lines() {
                println!("{pad}  {line}");
            }
        }
    }
    Ok(())
}
