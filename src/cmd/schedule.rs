//! `bot run` (one run under a non-blocking lock, quiet hours, one run-log line) and
//! `bot schedule install|show|remove`, `bot log`, over `app::schedule`.

use std::fs::OpenOptions;
use std::path::Path;
use std::time::{Duration, SystemTime};

use serde_json::json;

use crate::app::publish::{self, Guard};
use crate::app::schedule::*;
use crate::app::settings::{process_env, Overrides, Settings};
use crate::cmd::cli::{BadArgument, RunArgs, RunMode, ScheduleSpec, ScheduleTarget};
use crate::cmd::{self, load_settings, post};

fn parse_jitter(j: &str) -> Result<Duration, BadArgument> {
    let d = parse_duration(j).map_err(|e| BadArgument(format!("--jitter {e}")))?;
    if d > MAX_JITTER {
        return Err(BadArgument(format!(
            "--jitter {j} is longer than {} h: a run holds its profile's lock while it waits",
            MAX_JITTER.as_secs() / 3600
        )));
    }
    Ok(d)
}

pub fn run(config: Option<&Path>, profile: Option<&str>, args: &RunArgs) -> anyhow::Result<()> {
    let settings = post::settings_for(
        config,
        profile,
        &args.account,
        cmd::overrides(&args.model, &args.sampling),
    )?;
    crate::bluesky::session::private_dir(&settings.paths.data_dir)?;
    let lock_path = settings.paths.data_dir.join("run.lock");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)?;
    if lock.try_lock().is_err() {
        return Err(Locked(lock_path).into());
    }
    let mode = match args.mode {
        RunMode::Queue => "queue",
        RunMode::Auto => "auto",
        RunMode::Replies => "replies",
    };
    let log = |result: &str, uri: Option<&str>, error: Option<String>| {
        append_log(
            &settings,
            json!({
                "time": crate::bluesky::record::timestamp(SystemTime::now()),
                "profile": settings.profile,
                "mode": mode,
                "result": result,
                "uri": uri,
                "error": error,
            }),
        )
    };
    let quiet = match &args.quiet_hours {
        Some(q) => Some(parse_quiet(q).map_err(|e| BadArgument(format!("--quiet-hours {e}")))?),
        None => None,
    };
    let jitter = match &args.jitter {
        Some(j) => Some(parse_jitter(j)?),
        None => None,
    };
    let wait = jitter.map_or(Duration::ZERO, |max| {
        Duration::from_millis(rand::random::<u64>() % max.as_millis().max(1) as u64)
    });
    if !wait_outside_quiet(quiet, wait, &local_minute, &std::thread::sleep) {
        eprintln!(
            "quiet hours ({}): nothing to do",
            args.quiet_hours.as_deref().unwrap_or_default()
        );
        return log("quiet", None, None);
    }
    let guard = crate::cmd::post::guard(&args.guard)?;
    let outcome = match args.mode {
        RunMode::Queue => publish::publish_next(&settings, &guard).map(|r| r.map(|(_, p)| p)),
        RunMode::Auto => auto(&settings, args, &guard).map(Some),
        RunMode::Replies => {
            return match replies(&settings, args, &guard) {
                Ok(done) => {
                    for d in &done {
                        println!("{d}");
                    }
                    let result = if done.is_empty() { "idle" } else { "replied" };
                    if done.is_empty() {
                        eprintln!("nobody to answer");
                    }
                    log(result, done.first().map(String::as_str), None)
                }
                Err(e) => {
                    log("error", None, Some(format!("{e:#}")))?;
                    Err(e)
                }
            };
        }
    };
    match outcome {
        Ok(Some(p)) => {
            println!("{}", p.uri);
            log("posted", Some(&p.uri), None)
        }
        Ok(None) => {
            eprintln!("no approved drafts: nothing posted");
            log("idle", None, None)
        }
        Err(e) => {
            log("error", None, Some(format!("{e:#}")))?;
            Err(e)
        }
    }
}

fn auto(
    settings: &Settings,
    args: &RunArgs,
    guard: &Guard,
) -> anyhow::Result<crate::bluesky::Published> {
    let (mut g, _) = cmd::load_generator(settings, &args.model, true)?;
    let seed = args
        .sampling
        .seed
        .unwrap_or_else(|| rand::random::<u32>() as u64);
    let post = g.post(
        &cmd::post_request(settings, &args.sampling, seed)?,
        &mut |_| {},
    )?;
    publish::with_account(settings, |client, creds, store| {
        let id = crate::app::drafts::save_draft(store, &post, settings)?;
        store.set_draft_status(id, crate::app::store::DraftStatus::Approved)?;
        let (_, p) = publish::publish(
            client,
            creds,
            store,
            &post.text,
            &settings.langs.value,
            Some(id),
            guard,
            None,
        )?;
        Ok(p)
    })
}

/// The store as `mentions::choose` asks it.
struct StoreHistory<'a> {
    store: &'a crate::app::store::Store,
    me: &'a str,
    hour_ago: String,
}

impl crate::app::mentions::History for StoreHistory<'_> {
    fn answered(&self, uri: &str) -> bool {
        self.store
            .reply_to(Some(self.me), uri)
            .ok()
            .flatten()
            .is_some()
    }
    fn replies_in_thread(&self, root: &str) -> usize {
        // unreadable history counts as full: never more replies than the limit
        self.store
            .replies_in_thread(self.me, root)
            .unwrap_or(usize::MAX)
    }
    fn replies_last_hour(&self) -> usize {
        self.store
            .replies_since(self.me, &self.hour_ago)
            .unwrap_or(usize::MAX)
    }
}

/// `--mode replies`: the mentions since the cursor, those to answer now, a reply to each
/// (published, or saved as a reply draft); the replies' URIs (or draft ids).
fn replies(settings: &Settings, args: &RunArgs, guard: &Guard) -> anyhow::Result<Vec<String>> {
    use crate::app::mentions::{self, Limits};
    use crate::bluesky::xrpc::Call;
    let r = &args.replies;
    let limits = Limits {
        per_thread: r.max_replies_per_thread,
        per_hour: r.max_replies_per_hour,
    };
    publish::with_account(settings, |client, creds, store| {
        let me = client.session.did.clone();
        let (source, found) = match &r.mentions_from {
            Some(list) => {
                let mut found = Vec::new();
                for did in list.split(',').map(str::trim).filter(|d| !d.is_empty()) {
                    found.extend(mentions::from_posts(
                        client.list_posts_of(creds, did, 100)?,
                        &me,
                    ));
                }
                (format!("repos:{list}"), found)
            }
            None => {
                let v = client.call(
                    creds,
                    "app.bsky.notification.listNotifications",
                    Call::Query(&[("limit", "100")]),
                    true,
                )?;
                (
                    "notifications".to_string(),
                    mentions::from_notifications(&v),
                )
            }
        };
        let seen = store.cursor(&source)?;
        let fresh: Vec<_> = found
            .into_iter()
            .filter(|m| seen.as_deref().is_none_or(|s| m.at.as_str() > s))
            .collect();
        let hour_ago =
            crate::bluesky::record::timestamp(SystemTime::now() - Duration::from_secs(3600));
        let hist = StoreHistory {
            store,
            me: &me,
            hour_ago,
        };
        let (chosen, decided) = mentions::choose(fresh, &me, &hist, limits);
        let mut done = Vec::new();
        if !chosen.is_empty() {
            let (mut g, _) = cmd::load_generator(settings, &args.model, true)?;
            let template = settings
                .reply_prompt
                .value
                .clone()
                .unwrap_or_else(|| crate::bluesky::reply::DEFAULT_REPLY_PROMPT.to_string());
            for m in &chosen {
                let who = m
                    .handle
                    .as_ref()
                    .map(|h| format!("@{h}"))
                    .unwrap_or_else(|| m.author.clone());
                let seed = args
                    .sampling
                    .seed
                    .unwrap_or_else(|| rand::random::<u32>() as u64);
                let mut req = cmd::post_request(settings, &args.sampling, seed)?;
                req.prompt = Some(crate::bluesky::reply::reply_prompt(
                    &template,
                    m.post.text(),
                    &who,
                ));
                let post = g.post(&req, &mut |_| {})?;
                let refs = m.post.refs_for_reply();
                if r.save_replies {
                    let id = crate::app::drafts::save_draft(store, &post, settings)?;
                    store.set_draft_reply(
                        id,
                        &crate::app::store::DraftReply {
                            refs,
                            parent_text: m.post.text().to_string(),
                            parent_author: who,
                        },
                    )?;
                    done.push(format!("draft {id}"));
                } else {
                    let (_, p) = publish::publish(
                        client,
                        creds,
                        store,
                        &post.text,
                        &settings.langs.value,
                        None,
                        guard,
                        Some(&refs),
                    )?;
                    done.push(p.uri);
                }
            }
        }
        if let Some(d) = decided {
            store.set_cursor(&source, &d)?;
        }
        Ok(done)
    })
}

pub fn log(config: Option<&Path>, profile: Option<&str>, n: usize) -> anyhow::Result<()> {
    let settings = load_settings(config, profile, &Overrides::default())?;
    let text =
        std::fs::read_to_string(settings.paths.data_dir.join("runs.jsonl")).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    for l in &lines[lines.len().saturating_sub(n)..] {
        println!("{l}");
    }
    Ok(())
}

fn job(settings: &Settings, spec: &ScheduleSpec) -> anyhow::Result<Job> {
    let every = parse_duration(&spec.every).map_err(|e| BadArgument(format!("--every {e}")))?;
    if every < Duration::from_secs(60) || every.as_secs() % 60 != 0 {
        return Err(BadArgument(format!(
            "--every {}: schedules run in whole minutes, at least 1m",
            spec.every
        ))
        .into());
    }
    let mut args = Vec::new();
    if let Some(p) = &settings.profile {
        args.extend(["--profile".to_string(), p.clone()]);
    }
    args.extend(["run".to_string(), "--mode".to_string()]);
    args.push(match spec.mode {
        RunMode::Queue => "queue".into(),
        RunMode::Auto => "auto".into(),
        RunMode::Replies => "replies".into(),
    });
    if let Some(j) = &spec.jitter {
        if parse_jitter(j)? >= every {
            return Err(BadArgument(format!(
                "--jitter {j} must be shorter than --every {}: runs would overlap",
                spec.every
            ))
            .into());
        }
        args.extend(["--jitter".to_string(), j.clone()]);
    }
    if let Some(q) = &spec.quiet_hours {
        parse_quiet(q).map_err(|e| BadArgument(format!("--quiet-hours {e}")))?;
        args.extend(["--quiet-hours".to_string(), q.clone()]);
    }
    let j = Job {
        label: label(settings),
        exe: std::env::current_exe()?,
        args,
        every,
        env: schedule_env(&process_env),
        log_path: settings.paths.data_dir.join("schedule.log"),
    };
    j.validate()?;
    Ok(j)
}

/// The launchd label and crontab marker of a profile's schedule.
fn label(settings: &Settings) -> String {
    format!(
        "com.github.bot.{}",
        settings.profile.as_deref().unwrap_or("default")
    )
}

fn default_target() -> ScheduleTarget {
    if cfg!(target_os = "macos") {
        ScheduleTarget::Launchd
    } else {
        ScheduleTarget::Cron
    }
}

pub fn install(
    config: Option<&Path>,
    profile: Option<&str>,
    spec: &ScheduleSpec,
) -> anyhow::Result<()> {
    let settings = load_settings(config, profile, &Overrides::default())?;
    let j = job(&settings, spec)?;
    let target = spec.target.unwrap_or_else(default_target);
    let text = match target {
        ScheduleTarget::Launchd => render_plist(&j),
        ScheduleTarget::Cron => render_cron(&j).map_err(|e| anyhow::anyhow!(e))?,
    };
    let missing = missing_for_runs(&settings);
    if spec.print {
        for m in &missing {
            eprintln!("warning: scheduled runs would lack {m}");
        }
        print!("{text}");
        return Ok(());
    }
    if !missing.is_empty() {
        return Err(crate::app::settings::SettingsError::Missing(format!(
            "not installed: scheduled runs would fail for lack of {}",
            missing.join("; and of ")
        ))
        .into());
    }
    crate::bluesky::session::private_dir(&settings.paths.data_dir)?;
    match target {
        ScheduleTarget::Cron => {
            let current = read_crontab()?;
            write_crontab(&(without_block(&current, &j.label) + &text))?;
            eprintln!("installed the crontab entry {}", j.label);
        }
        ScheduleTarget::Launchd => {
            anyhow::ensure!(
                cfg!(target_os = "macos"),
                "launchd exists only on macOS: use --print to see the plist"
            );
            let path = plist_path(&j.label)?;
            std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
            let domain = format!("gui/{}", unsafe { libc::getuid() });
            let _ = launchctl(&["bootout", &domain, &path.display().to_string()]);
            std::fs::write(&path, text)?;
            anyhow::ensure!(
                launchctl(&["bootstrap", &domain, &path.display().to_string()])?,
                "launchctl bootstrap {domain} {} failed",
                path.display()
            );
            eprintln!("installed and loaded {}", path.display());
        }
    }
    Ok(())
}

pub fn show(
    config: Option<&Path>,
    profile: Option<&str>,
    target: Option<ScheduleTarget>,
) -> anyhow::Result<()> {
    let settings = load_settings(config, profile, &Overrides::default())?;
    let label = label(&settings);
    match target.unwrap_or_else(default_target) {
        ScheduleTarget::Cron => {
            let c = read_crontab()?;
            let marker = format!("# bot:{label} ");
            let mut lines = c.lines().skip_while(|l| !l.starts_with(&marker));
            match (lines.next(), lines.next()) {
                (Some(m), Some(l)) => println!("{m}\n{l}"),
                _ => eprintln!("no crontab entry for {label}"),
            }
        }
        ScheduleTarget::Launchd => {
            let p = plist_path(&label)?;
            match std::fs::read_to_string(&p) {
                Ok(t) => print!("{t}"),
                Err(_) => eprintln!("no launchd agent at {}", p.display()),
            }
        }
    }
    Ok(())
}

pub fn remove(
    config: Option<&Path>,
    profile: Option<&str>,
    target: Option<ScheduleTarget>,
) -> anyhow::Result<()> {
    let settings = load_settings(config, profile, &Overrides::default())?;
    let label = label(&settings);
    match target.unwrap_or_else(default_target) {
        ScheduleTarget::Cron => {
            let c = read_crontab()?;
            let without = without_block(&c, &label);
            if without != c {
                write_crontab(&without)?;
                eprintln!("removed the crontab entry {label}");
            } else {
                eprintln!("no crontab entry for {label}");
            }
        }
        ScheduleTarget::Launchd => {
            let p = plist_path(&label)?;
            if p.exists() {
                let domain = format!("gui/{}", unsafe { libc::getuid() });
                let _ = launchctl(&["bootout", &domain, &p.display().to_string()]);
                std::fs::remove_file(&p)?;
                eprintln!("removed {}", p.display());
            } else {
                eprintln!("no launchd agent at {}", p.display());
            }
        }
    }
    Ok(())
}
