//! `bot sandbox up|status|converse|page`: this config's profiles as bots on a private PDS
//! (`app::sandbox` keeps the state and renders the page). Each member posts and replies in its
//! own profile's voice (its model, adapter, system prompt), under its own sandbox account and
//! state directory, through the same never-twice publishing as `bot post`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::app::publish::{publish, with_account, Guard};
use crate::app::sandbox::{
    render_page, threads, Act, ActKind, Member, Sandbox, ThreadPost, PAGE_CSS,
};
use crate::app::sandbox_pds;
use crate::app::settings::{Overrides, Settings};
use crate::bluesky::reply::{self, FetchedPost};
use crate::bluesky::xrpc::{Call, RetryPolicy, Xrpc};
use crate::bluesky::{self, BlueskyError};
use crate::cmd::cli::{BadArgument, ModelArgs, SamplingArgs, SandboxCommand};
use crate::cmd::{self, load_settings};
use crate::generate::Generator;

/// The base state directory: the default profile's.
fn base(config: Option<&Path>) -> anyhow::Result<Settings> {
    load_settings(config, None, &Overrides::default())
}

fn profile_arg(p: &str) -> Option<&str> {
    (p != "default").then_some(p)
}

/// The profiles named, or every profile of the config file plus the default one.
fn profiles(config: Option<&Path>, list: &Option<String>) -> anyhow::Result<Vec<String>> {
    if let Some(l) = list {
        let v: Vec<String> = l
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        if v.len() < 2 {
            return Err(BadArgument(format!(
                "--profiles {l:?}: a sandbox needs at least two profiles"
            ))
            .into());
        }
        return Ok(v);
    }
    let s = base(config)?;
    let text = std::fs::read_to_string(&s.paths.config_file).unwrap_or_default();
    let file: toml::Value = toml::from_str(&text).unwrap_or(toml::Value::Table(Default::default()));
    let mut v = vec!["default".to_string()];
    if let Some(t) = file.get("profiles").and_then(toml::Value::as_table) {
        v.extend(t.keys().cloned());
    }
    if v.len() < 2 {
        return Err(BadArgument(
            "a sandbox needs at least two profiles: add [profiles.NAME] sections to the config, or pass --profiles a,b".into(),
        )
        .into());
    }
    Ok(v)
}

fn xrpc() -> anyhow::Result<Xrpc> {
    Ok(Xrpc::new(RetryPolicy {
        attempts: 3,
        request_timeout: Duration::from_secs(30),
        ..RetryPolicy::default()
    })?)
}

/// A handle for `profile` on a service whose user domain is `domain` (".test"): the profile's
/// letters and digits, and a random tail so that it never collides.
fn handle_for(profile: &str, domain: &str) -> String {
    let mut name: String = profile
        .to_ascii_lowercase()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(12)
        .collect();
    if name.is_empty() || !name.starts_with(|c: char| c.is_ascii_alphabetic()) {
        name.insert(0, 'b');
    }
    let tail: String = (0..5)
        .map(|_| char::from(b"abcdefghijkmnpqrstuvwxyz23456789"[rand::rng().random_range(0..32)]))
        .collect();
    format!("{name}-{tail}{domain}")
}

fn random_secret() -> String {
    (0..24)
        .map(|_| {
            char::from(
                b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnpqrstuvwxyz23456789"
                    [rand::rng().random_range(0..56)],
            )
        })
        .collect()
}

/// `up`: the sandbox's own PDS started (or `--service` used as it is), then an account for
/// each profile without one, its app password in a 0600 file of the member's state directory.
fn up(
    config: Option<&Path>,
    service: &Option<String>,
    port: u16,
    list: &Option<String>,
) -> anyhow::Result<()> {
    let sb = Sandbox::open(&base(config)?.paths.data_dir)?;
    let x = xrpc()?;
    let own = match service {
        Some(_) => None,
        None => {
            let r =
                sandbox_pds::start(&sandbox_pds::install_dir()?, &sb.dir.join("pds"), port, &x)?;
            eprintln!(
                "the sandbox's PDS runs at {} (pid {}, data in {})",
                r.service,
                r.pid,
                sb.dir.join("pds").display()
            );
            Some(r)
        }
    };
    let service = match (service, &own) {
        (Some(s), _) => s.trim_end_matches('/').to_string(),
        (None, Some(r)) => r.service.clone(),
        (None, None) => unreachable!("started above"),
    };
    let service = service.as_str();
    let desc = x
        .call(
            service,
            "com.atproto.server.describeServer",
            Call::Query(&[]),
            None,
            true,
        )
        .with_context(|| format!("no PDS answers at {service}"))?;
    let domain = desc
        .get("availableUserDomains")
        .and_then(Value::as_array)
        .and_then(|d| d.first())
        .and_then(Value::as_str)
        .unwrap_or(".test")
        .to_string();
    sb.set_service(service)?;
    let known: Vec<String> = sb.members()?.into_iter().map(|m| m.profile).collect();
    for p in profiles(config, list)? {
        if known.contains(&p) && sb.password_file(&p).exists() {
            continue;
        }
        // the profile must load (its model need not exist yet)
        load_settings(config, profile_arg(&p), &Overrides::default())?;
        let handle = handle_for(&p, &domain);
        let password = random_secret();
        let body = json!({ "handle": handle, "email": format!("{handle}@sandbox.invalid"), "password": password });
        let v = x
            .call(
                service,
                "com.atproto.server.createAccount",
                Call::Procedure(&body),
                None,
                false,
            )
            .map_err(|e| anyhow::anyhow!("creating {handle} for profile {p} on {service}: {e}"))?;
        let did = v
            .get("did")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let access = v
            .get("accessJwt")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let app = x.call(
            service,
            "com.atproto.server.createAppPassword",
            Call::Procedure(&json!({ "name": "bot-sandbox" })),
            Some(access),
            false,
        )?;
        let app_pw = app
            .get("password")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let dir = sb.member_dir(&p);
        crate::bluesky::session::private_dir(&dir)?;
        crate::bluesky::session::write_private(&sb.password_file(&p), app_pw.as_bytes())?;
        crate::bluesky::session::write_private(&dir.join("account-password"), password.as_bytes())?;
        if let Some(r) = &own {
            sandbox_pds::save_ops(&sb.dir.join("pds"), &r.plc, &did)?;
        }
        sb.add_member(&Member {
            profile: p.clone(),
            handle: handle.clone(),
            did,
        })?;
        eprintln!("profile {p}: {handle}");
    }
    println!("{service}");
    Ok(())
}

/// A member's settings: its profile's model and voice, the sandbox's account and state.
fn member_settings(
    config: Option<&Path>,
    sb: &Sandbox,
    service: &str,
    m: &Member,
    o: &Overrides,
) -> anyhow::Result<Settings> {
    let mut s = load_settings(config, profile_arg(&m.profile), o)?;
    s.paths.data_dir = sb.member_dir(&m.profile);
    s.service.value = service.to_string();
    s.handle.value = Some(m.handle.clone());
    s.password_file.value = Some(sb.password_file(&m.profile));
    s.password_file_only = true;
    Ok(s)
}

fn sandbox_service(sb: &Sandbox) -> anyhow::Result<String> {
    // BOT_SANDBOX_SERVICE reaches the same PDS another way (a proxy in the tests)
    if let Some(s) =
        crate::app::settings::process_env("BOT_SANDBOX_SERVICE").filter(|s| !s.is_empty())
    {
        return Ok(s);
    }
    sb.service()?
        .ok_or_else(|| anyhow::anyhow!("no sandbox yet: run `bot sandbox up --service URL` first"))
}

fn posts_of(x: &Xrpc, service: &str, did: &str) -> anyhow::Result<Vec<FetchedPost>> {
    let q = [
        ("repo", did),
        ("collection", "app.bsky.feed.post"),
        ("limit", "100"),
    ];
    let v = x
        .call(
            service,
            "com.atproto.repo.listRecords",
            Call::Query(&q),
            None,
            true,
        )
        .map_err(BlueskyError::Xrpc)?;
    Ok(v.get("records")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(FetchedPost::from_get_record).collect())
        .unwrap_or_default())
}

pub struct ConverseArgs<'a> {
    pub rounds: u32,
    pub reply_ratio: f64,
    pub profiles: &'a Option<String>,
    pub model: &'a ModelArgs,
    pub sampling: &'a SamplingArgs,
    pub quiet: bool,
}

/// Rounds until the transcript holds `rounds` complete ones: in each, every member replies to
/// the newest post of another member it has not answered (with probability `reply_ratio`), or
/// writes a new post. Each act is planned (with its text) before it is sent, so a killed run
/// resumes where it stopped and sends nothing twice.
fn converse(config: Option<&Path>, a: &ConverseArgs) -> anyhow::Result<()> {
    if !(0.0..=1.0).contains(&a.reply_ratio) {
        return Err(
            BadArgument(format!("--reply-ratio {}: expected 0 to 1", a.reply_ratio)).into(),
        );
    }
    let sb = Sandbox::open(&base(config)?.paths.data_dir)?;
    let service = sandbox_service(&sb)?;
    let mut members = sb.members()?;
    if let Some(l) = a.profiles {
        let want = profiles(config, &Some(l.clone()))?;
        members.retain(|m| want.contains(&m.profile));
    }
    if members.len() < 2 {
        anyhow::bail!("the sandbox has fewer than two members: run `bot sandbox up` with two or more profiles");
    }
    let x = xrpc()?;
    let o = cmd::overrides(a.model, a.sampling);
    let seed = a
        .sampling
        .seed
        .unwrap_or_else(|| rand::random::<u32>() as u64);
    let mut generators: BTreeMap<String, Generator> = BTreeMap::new();
    let guard = Guard {
        max_similarity: 1.0,
        history: 20,
        training: None,
    };
    let handles: BTreeMap<String, String> = members
        .iter()
        .map(|m| (m.did.clone(), format!("@{}", m.handle)))
        .collect();
    for round in sb.rounds_done(members.len())?..a.rounds {
        for (i, m) in members.iter().enumerate() {
            let act = match sb.act(round, &m.profile)? {
                Some(act) if act.uri.is_some() => continue,
                Some(planned) => planned,
                None => {
                    let settings = member_settings(config, &sb, &service, m, &o)?;
                    let answered = sb.answered(&m.profile)?;
                    let mut candidates: Vec<FetchedPost> = Vec::new();
                    for other in members.iter().filter(|o| o.did != m.did) {
                        candidates.extend(posts_of(&x, &service, &other.did)?);
                    }
                    candidates.retain(|p| !answered.contains(&p.uri));
                    candidates.sort_by(|p, q| created(q).cmp(created(p)));
                    let mut rng =
                        rand::rngs::StdRng::seed_from_u64(seed ^ ((round as u64) << 32) ^ i as u64);
                    let parent = candidates
                        .into_iter()
                        .next()
                        .filter(|_| rng.random_bool(a.reply_ratio));
                    let g = match generators.entry(m.profile.clone()) {
                        std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                        std::collections::btree_map::Entry::Vacant(e) => e.insert(
                            cmd::load_generator(&settings, &ModelArgs::default(), !a.quiet)?.0,
                        ),
                    };
                    let mut req =
                        cmd::post_request(&settings, a.sampling, rng.random::<u32>() as u64)?;
                    if let Some(p) = &parent {
                        let template = settings
                            .reply_prompt
                            .value
                            .clone()
                            .unwrap_or_else(|| reply::DEFAULT_REPLY_PROMPT.to_string());
                        let who = handles
                            .get(p.author())
                            .map(String::as_str)
                            .unwrap_or(p.author());
                        req.prompt = Some(reply::reply_prompt(&template, p.text(), who));
                    }
                    let post = g.post(&req, &mut |_| {})?;
                    let act = Act {
                        kind: if parent.is_some() {
                            ActKind::Reply
                        } else {
                            ActKind::Post
                        },
                        parent_uri: parent.as_ref().map(|p| p.uri.clone()),
                        text: post.text,
                        uri: None,
                    };
                    sb.plan(round, &m.profile, &act)?;
                    act
                }
            };
            let settings = member_settings(config, &sb, &service, m, &o)?;
            let uri = send(&settings, &x, &service, &act, &guard)?;
            sb.done(round, &m.profile, &uri)?;
            if !a.quiet {
                let what = if act.kind == ActKind::Reply {
                    "replied"
                } else {
                    "posted"
                };
                eprintln!(
                    "round {}: @{} {what}: {}",
                    round + 1,
                    m.handle,
                    act.text.replace('\n', " ")
                );
            }
        }
    }
    println!(
        "{}",
        json!({ "rounds": a.rounds, "members": members.len() })
    );
    Ok(())
}

fn created(p: &FetchedPost) -> &str {
    p.value
        .get("createdAt")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// Sends a planned act once: after the member's interrupted send is settled, a reply to the
/// same post or a post of the same text already made is that act.
fn send(
    settings: &Settings,
    x: &Xrpc,
    service: &str,
    act: &Act,
    guard: &Guard,
) -> anyhow::Result<String> {
    let refs = match &act.parent_uri {
        Some(uri) => {
            let (repo, _, rkey) =
                bluesky::parse_at_uri(uri).ok_or_else(|| anyhow::anyhow!("bad parent {uri}"))?;
            let parent = crate::cmd::reply::fetch(x, service, &reply::PostRef { repo, rkey })?;
            Some(parent.refs_for_reply())
        }
        None => None,
    };
    with_account(settings, |client, creds, store| {
        let did = client.session.did.clone();
        if let Some(uri) = &act.parent_uri {
            if let Some(row) = store.reply_to(Some(&did), uri)? {
                return Ok(row.uri.unwrap_or_default());
            }
        } else if let Some(row) = store
            .recent_posted(&did, 50)?
            .into_iter()
            .find(|r| r.text == act.text && !r.record.contains("\"reply\""))
        {
            return Ok(row.uri.unwrap_or_default());
        }
        let (_, p) = publish(
            client,
            creds,
            store,
            &act.text,
            &settings.langs.value,
            None,
            guard,
            refs.as_ref(),
        )?;
        Ok(p.uri)
    })
}

fn status(config: Option<&Path>) -> anyhow::Result<()> {
    let sb = Sandbox::open(&base(config)?.paths.data_dir)?;
    let members = sb.members()?;
    let service = sb.service()?;
    let up = service.as_deref().is_some_and(|s| {
        xrpc().is_ok_and(|x| x.call(s, "_health", Call::Query(&[]), None, true).is_ok())
    });
    println!(
        "{}",
        json!({
            "service": service,
            "up": up,
            "own_pds_pid": sandbox_pds::read_pid(&sb.dir.join("pds")),
            "members": members,
            "rounds_done": sb.rounds_done(members.len().max(1))?,
            "state": sb.dir,
        })
    );
    Ok(())
}

fn page(config: Option<&Path>, out: &Path, title: &str) -> anyhow::Result<()> {
    let sb = Sandbox::open(&base(config)?.paths.data_dir)?;
    let service = sandbox_service(&sb)?;
    let x = xrpc()?;
    let members = sb.members()?;
    let handles: BTreeMap<String, String> = members
        .iter()
        .map(|m| (m.did.clone(), format!("@{}", m.handle)))
        .collect();
    let mut posts = Vec::new();
    for m in &members {
        posts.extend(
            posts_of(&x, &service, &m.did)?
                .iter()
                .map(|p| ThreadPost::from_fetched(p, &handles)),
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let html = render_page(title, &threads(&posts));
    std::fs::write(out.join("index.html"), html)
        .with_context(|| format!("writing {}", out.join("index.html").display()))?;
    std::fs::write(out.join("style.css"), PAGE_CSS)?;
    println!("{}", out.join("index.html").display());
    Ok(())
}

pub fn run(config: Option<&Path>, c: &SandboxCommand) -> anyhow::Result<()> {
    match c {
        SandboxCommand::Up {
            service,
            port,
            profiles,
        } => up(config, service, *port, profiles),
        SandboxCommand::Down => {
            let sb = Sandbox::open(&base(config)?.paths.data_dir)?;
            if sandbox_pds::stop(&sb.dir.join("pds"))? {
                eprintln!(
                    "stopped the sandbox's PDS (its data stays in {})",
                    sb.dir.join("pds").display()
                );
            } else {
                eprintln!("the sandbox's PDS is not running");
            }
            Ok(())
        }
        SandboxCommand::Status => status(config),
        SandboxCommand::Converse {
            rounds,
            reply_ratio,
            profiles,
            model,
            sampling,
            quiet,
        } => converse(
            config,
            &ConverseArgs {
                rounds: *rounds,
                reply_ratio: *reply_ratio,
                profiles,
                model,
                sampling,
                quiet: *quiet,
            },
        ),
        SandboxCommand::Page { out, title } => page(config, out, title),
    }
}
