//! The review queue: `bot draft` fills it, `bot queue` and `bot review` decide, and
//! `bot post --next` / `bot run --mode queue` publish approved drafts (see `app::publish`).

use std::io::{BufRead, Write};
use std::path::Path;

use crate::app::settings::{Overrides, Settings};
use crate::app::store::{DraftStatus, Store};
use crate::bluesky::record;
use crate::cmd::cli::{DraftArgs, ReviewArgs, SamplingArgs};
use crate::cmd::{self, load_settings, overrides};
use crate::generate::Generator;

fn write_drafts(
    settings: &Settings,
    generator: &mut Generator,
    sampling: &SamplingArgs,
    n: usize,
    verbose: bool,
) -> anyhow::Result<Vec<i64>> {
    let store = Store::open(&settings.paths.data_dir)?;
    let base = sampling
        .seed
        .unwrap_or_else(|| rand::random::<u32>() as u64);
    let mut ids = Vec::new();
    for i in 0..n {
        let req = cmd::post_request(settings, sampling, base.wrapping_add(i as u64))?;
        let progress = cmd::Progress::new(verbose);
        let p = generator.post(&req, &mut |e| progress.event("draft", &e));
        progress.finish();
        let p = p?;
        ids.push(crate::app::drafts::save_draft(&store, &p, settings)?);
    }
    Ok(ids)
}

/// Another draft answering what `r` answers (`bot review`'s regenerate on a reply draft).
fn write_reply_draft(
    settings: &Settings,
    generator: &mut Generator,
    sampling: &SamplingArgs,
    r: &crate::app::store::DraftReply,
) -> anyhow::Result<i64> {
    let store = Store::open(&settings.paths.data_dir)?;
    let seed = sampling
        .seed
        .unwrap_or_else(|| rand::random::<u32>() as u64);
    let mut req = cmd::post_request(settings, sampling, seed)?;
    let template = settings
        .reply_prompt
        .value
        .clone()
        .unwrap_or_else(|| crate::bluesky::reply::DEFAULT_REPLY_PROMPT.to_string());
    req.prompt = Some(crate::bluesky::reply::reply_prompt(
        &template,
        &r.parent_text,
        &r.parent_author,
    ));
    let progress = cmd::Progress::new(true);
    let p = generator.post(&req, &mut |e| progress.event("reply", &e));
    progress.finish();
    let id = crate::app::drafts::save_draft(&store, &p?, settings)?;
    store.set_draft_reply(id, r)?;
    Ok(id)
}

pub fn draft(config: Option<&Path>, profile: Option<&str>, args: &DraftArgs) -> anyhow::Result<()> {
    let settings = load_settings(config, profile, &overrides(&args.model, &args.sampling))?;
    let (mut g, _) = cmd::load_generator(&settings, &args.model, !args.quiet)?;
    for id in write_drafts(&settings, &mut g, &args.sampling, args.count, !args.quiet)? {
        println!("{id}");
    }
    Ok(())
}

fn store_for(config: Option<&Path>, profile: Option<&str>) -> anyhow::Result<Store> {
    let settings = load_settings(config, profile, &Overrides::default())?;
    Ok(Store::open(&settings.paths.data_dir)?)
}

pub fn list(
    config: Option<&Path>,
    profile: Option<&str>,
    json: bool,
    status: Option<&str>,
) -> anyhow::Result<()> {
    let status = match status {
        Some(s) => Some(DraftStatus::parse(s).ok_or_else(|| {
            anyhow::anyhow!(
                "unknown status {s:?}: expected new, approved, rejected, refused or posted"
            )
        })?),
        None => None,
    };
    let store = store_for(config, profile)?;
    for d in store.drafts(status)? {
        if json {
            println!("{}", serde_json::to_string(&d)?);
        } else {
            println!(
                "{:>4}  {:<8}  {}{}{}",
                d.id,
                d.status,
                d.text.replace('\n', " ⏎ "),
                d.note
                    .as_deref()
                    .map(|n| format!("  [{n}]"))
                    .unwrap_or_default(),
                d.reply()
                    .map(|r| format!("  [replying to {}]", r.parent_author))
                    .unwrap_or_default()
            );
        }
    }
    Ok(())
}

pub fn decide(
    config: Option<&Path>,
    profile: Option<&str>,
    ids: &[i64],
    approve: bool,
) -> anyhow::Result<()> {
    let store = store_for(config, profile)?;
    let to = if approve {
        DraftStatus::Approved
    } else {
        DraftStatus::Rejected
    };
    for &id in ids {
        store.set_draft_status(id, to)?;
        eprintln!("draft {id}: {}", to.as_str());
    }
    Ok(())
}

pub fn clear(config: Option<&Path>, profile: Option<&str>) -> anyhow::Result<()> {
    let n = store_for(config, profile)?.clear_drafts()?;
    eprintln!("deleted {n} new or rejected drafts");
    Ok(())
}

/// Opens `text` in `$EDITOR` (else `vi`) and returns what was saved.
fn edit_in_editor(text: &str) -> anyhow::Result<String> {
    let editor = std::env::var("VISUAL")
        .or_else(|_| std::env::var("EDITOR"))
        .unwrap_or_else(|_| "vi".into());
    let file = tempfile::Builder::new().suffix(".txt").tempfile()?;
    std::fs::write(file.path(), text)?;
    // The editor may carry arguments ("code --wait"): run it through the shell.
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(file.path())
        .status()?;
    anyhow::ensure!(status.success(), "{editor} exited with {status}");
    Ok(std::fs::read_to_string(file.path())?.trim().to_string())
}

/// Walks new drafts: one key per draft, read as a line from stdin (a terminal or a script).
pub fn review(
    config: Option<&Path>,
    profile: Option<&str>,
    args: &ReviewArgs,
) -> anyhow::Result<()> {
    let settings = load_settings(config, profile, &overrides(&args.model, &args.sampling))?;
    let store = Store::open(&settings.paths.data_dir)?;
    let mut generator: Option<Generator> = None;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut out = std::io::stderr();
    let mut queue: Vec<i64> = store
        .drafts(Some(DraftStatus::New))?
        .iter()
        .map(|d| d.id)
        .collect();
    queue.reverse();
    while let Some(id) = queue.pop() {
        let Some(d) = store.draft(id)? else { continue };
        if d.status != DraftStatus::New {
            continue;
        }
        let answers = d
            .reply()
            .map(|r| {
                format!(
                    "↳ replying to {}: {}\n",
                    r.parent_author,
                    r.parent_text.replace('\n', " ")
                )
            })
            .unwrap_or_default();
        writeln!(
            out,
            "\n#{id} ({} graphemes)\n{answers}{}\n[a]pprove  [r]eject  [e]dit  [g]enerate another  [s]kip  [q]uit > ",
            crate::generate::postprocess::grapheme_count(&d.text),
            d.text
        )?;
        out.flush()?;
        let Some(line) = lines.next() else { break };
        match line?.trim() {
            "a" => store.set_draft_status(id, DraftStatus::Approved)?,
            "r" => store.set_draft_status(id, DraftStatus::Rejected)?,
            "e" => {
                let text = edit_in_editor(&d.text)?;
                match record::check_text(&text) {
                    Ok(()) => store.edit_draft(id, &text)?,
                    Err(e) => writeln!(out, "not saved: {e}")?,
                }
                queue.push(id);
            }
            "g" => {
                store.set_draft_status(id, DraftStatus::Rejected)?;
                if generator.is_none() {
                    generator = Some(cmd::load_generator(&settings, &args.model, true)?.0);
                }
                let g = generator
                    .as_mut()
                    .ok_or_else(|| anyhow::anyhow!("no model"))?;
                let new = match d.reply() {
                    Some(r) => vec![write_reply_draft(&settings, g, &args.sampling, &r)?],
                    None => write_drafts(&settings, g, &args.sampling, 1, true)?,
                };
                queue.extend(new);
            }
            "s" | "" => {}
            "q" => break,
            other => {
                writeln!(out, "unknown choice {other:?}")?;
                queue.push(id);
            }
        }
    }
    let approved = store.drafts(Some(DraftStatus::Approved))?.len();
    writeln!(out, "{approved} approved draft(s) waiting")?;
    Ok(())
}
