//! `bot sandbox` against the reference PDS: two profiles of the tiny fixture model converse
//! three rounds into a well-formed thread tree with nothing twice, also when a round is killed
//! mid-send and resumed; the static page shows every post, escaped.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::bluesky_pds::{faulty_proxy, list_posts, ok_stdout, pds_from, Fault};
use crate::common::fixtures;

fn sandbox(home: &Path) -> assert_cmd::Command {
    let mut c = assert_cmd::Command::cargo_bin("bot").unwrap();
    c.env("BOT_HOME", home)
        .env("BOT_MODEL", fixtures().join("q4g64"))
        .env("BOT_ADAPTER", fixtures().join("adapter"))
        .env("HF_HUB_OFFLINE", "1")
        .env("BOT_RETRY_TOTAL_S", "20")
        // the members' accounts are the sandbox's, whatever the environment says
        .env("BOT_BSKY_APP_PASSWORD", "not-a-sandbox-password")
        .env_remove("BOT_SANDBOX_SERVICE")
        .timeout(Duration::from_secs(300));
    c
}

/// A home with two profiles (the default one and `b`, with its own system prompt) in the
/// sandbox on `service`; their DIDs.
fn setup(home: &Path, service: &str) -> Vec<String> {
    std::fs::write(
        home.join("config.toml"),
        "system = \"You are bot A.\"\n[profiles.b]\nsystem = \"You are bot B.\"\n",
    )
    .unwrap();
    let out = ok_stdout(
        sandbox(home)
            .args(["sandbox", "up", "--service", service])
            .output()
            .unwrap(),
    );
    assert_eq!(out.trim(), service);
    let st: Value = serde_json::from_str(
        ok_stdout(sandbox(home).args(["sandbox", "status"]).output().unwrap()).trim(),
    )
    .unwrap();
    let members = st["members"].as_array().unwrap();
    assert_eq!(members.len(), 2, "{st}");
    members
        .iter()
        .map(|m| m["did"].as_str().unwrap().to_string())
        .collect()
}

/// Every post of the members: no two replies of one member to one post, every reply's parent
/// and root exist with the CIDs the refs name, roots are top-level posts.
fn check_tree(service: &str, dids: &[String], want_posts: usize) -> Vec<Value> {
    let pds = crate::bluesky_pds::Pds {
        service: service.to_string(),
        jwt_secret: String::new(),
    };
    let all: Vec<Value> = dids.iter().flat_map(|d| list_posts(&pds, d)).collect();
    assert_eq!(all.len(), want_posts, "{all:#?}");
    let by_uri: HashMap<&str, &Value> = all
        .iter()
        .map(|p| (p["uri"].as_str().unwrap(), p))
        .collect();
    let mut answered = HashSet::new();
    let mut replies = 0;
    for p in &all {
        let Some(r) = p["value"].get("reply") else {
            continue;
        };
        replies += 1;
        let author = p["uri"]
            .as_str()
            .unwrap()
            .split('/')
            .nth(2)
            .unwrap()
            .to_string();
        let parent = by_uri[r["parent"]["uri"].as_str().unwrap()];
        assert_eq!(parent["cid"], r["parent"]["cid"]);
        let root = by_uri[r["root"]["uri"].as_str().unwrap()];
        assert_eq!(root["cid"], r["root"]["cid"]);
        assert!(
            root["value"].get("reply").is_none(),
            "a root is a top-level post"
        );
        let want_root = parent["value"]["reply"]["root"]["uri"]
            .as_str()
            .unwrap_or(parent["uri"].as_str().unwrap());
        assert_eq!(r["root"]["uri"], want_root);
        assert!(
            !r["parent"]["uri"].as_str().unwrap().contains(&author),
            "a member never answers itself"
        );
        assert!(
            answered.insert((author, r["parent"]["uri"].clone())),
            "answered twice: {p}"
        );
    }
    assert!(replies > 0, "the members never talked to each other");
    all
}

#[test]
fn two_profiles_converse_into_one_well_formed_tree_and_a_page() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let dids = setup(home.path(), &pds.service);
    ok_stdout(
        sandbox(home.path())
            .args(["sandbox", "converse", "--rounds", "3", "--seed", "4", "-q"])
            .output()
            .unwrap(),
    );
    let all = check_tree(&pds.service, &dids, 6);
    // a second run with the same --rounds has nothing left to do
    ok_stdout(
        sandbox(home.path())
            .args(["sandbox", "converse", "--rounds", "3", "-q"])
            .output()
            .unwrap(),
    );
    check_tree(&pds.service, &dids, 6);

    // a member's own post with markup in its text: on the page it must stay text
    let hostile = "<script>alert('x')</script> <b>bold</b> & \"quoted\"";
    post_as_member(&pds.service, home.path(), &dids[0], hostile);
    let mut all = all;
    all.extend(
        crate::bluesky_pds::list_posts(&pds, &dids[0])
            .into_iter()
            .filter(|p| p["value"]["text"] == hostile),
    );

    let out = home.path().join("site");
    ok_stdout(
        sandbox(home.path())
            .args([
                "sandbox",
                "page",
                "--out",
                out.to_str().unwrap(),
                "--title",
                "Bots <3",
            ])
            .output()
            .unwrap(),
    );
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(out.join("style.css").exists());
    let doc = scraper::Html::parse_document(&html);
    assert!(doc.errors.is_empty(), "{:?}", doc.errors);
    let sel = |s: &str| scraper::Selector::parse(s).unwrap();
    let ids: HashSet<String> = doc
        .select(&sel("div.post"))
        .map(|e| e.value().attr("id").unwrap().to_string())
        .collect();
    for p in &all {
        assert!(
            ids.contains(p["uri"].as_str().unwrap()),
            "missing from the page: {p}"
        );
    }
    assert_eq!(doc.select(&sel("script")).count(), 0);
    assert_eq!(doc.select(&sel("p.text b")).count(), 0);
    assert!(all.iter().any(|p| p["value"]["text"] == hostile));
    // post text arrives as text: the model's output never becomes markup
    let texts: Vec<String> = doc
        .select(&sel("p.text"))
        .map(|e| e.text().collect())
        .collect();
    for p in &all {
        assert!(texts.contains(&p["value"]["text"].as_str().unwrap().to_string()));
    }
    assert_eq!(
        doc.select(&sel("title"))
            .next()
            .unwrap()
            .text()
            .collect::<String>(),
        "Bots <3"
    );
    screenshot_is_not_blank(&out);
}

/// Publishes `text` as the sandbox member `did`, with its own app password file.
fn post_as_member(service: &str, home: &Path, did: &str, text: &str) {
    let pw_files: Vec<_> = walk(home)
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "app-password"))
        .collect();
    let client = reqwest::blocking::Client::new();
    for f in pw_files {
        let pw = std::fs::read_to_string(&f).unwrap();
        let r = client
            .post(format!("{service}/xrpc/com.atproto.server.createSession"))
            .json(&serde_json::json!({ "identifier": did, "password": pw.trim() }))
            .send()
            .unwrap();
        if !r.status().is_success() {
            continue; // another member's password
        }
        let s: Value = r.json().unwrap();
        let v: Value = client
            .post(format!("{service}/xrpc/com.atproto.repo.createRecord"))
            .bearer_auth(s["accessJwt"].as_str().unwrap())
            .json(&serde_json::json!({
                "repo": did,
                "collection": "app.bsky.feed.post",
                "record": { "$type": "app.bsky.feed.post", "text": text,
                            "createdAt": "2026-11-24T12:00:00.000Z" },
            }))
            .send()
            .unwrap()
            .json()
            .unwrap();
        assert!(v["uri"].is_string(), "{v}");
        return;
    }
    panic!("no app password of {did} under {}", home.display());
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The page rendered by headless Chromium (Debian's `chromium`) to a PNG that shows something:
/// many pixels away from the background colour, in several colours. `REQUIRE_CHROMIUM=1` (CI)
/// makes a missing browser an error; `BOT_SCREENSHOT_OUT=FILE` keeps the PNG (docs/sandbox.md's).
fn screenshot_is_not_blank(site: &Path) {
    let Some(chromium) = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|c| {
            std::process::Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
    else {
        assert!(
            std::env::var("REQUIRE_CHROMIUM").as_deref() != Ok("1"),
            "REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install chromium)"
        );
        eprintln!("skipping the screenshot: no chromium on PATH");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let png_path = tmp.path().join("page.png");
    let (w, h) = (900u32, 1400u32);
    let out = std::process::Command::new(chromium)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--force-device-scale-factor=1",
        ])
        .arg(format!(
            "--user-data-dir={}",
            tmp.path().join("profile").display()
        ))
        .arg(format!("--window-size={w},{h}"))
        .arg(format!("--screenshot={}", png_path.display()))
        .arg(format!("file://{}", site.join("index.html").display()))
        .output()
        .unwrap();
    assert!(
        out.status.success() && png_path.exists(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let decoder = png::Decoder::new(std::fs::File::open(&png_path).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (w, h));
    let channels = info.color_type.samples();
    assert!(channels >= 3, "{:?}", info.color_type);
    let pixels: Vec<[u8; 3]> = buf[..info.buffer_size()]
        .chunks(channels)
        .map(|c| [c[0], c[1], c[2]])
        .collect();
    let mut counts: HashMap<[u8; 3], usize> = HashMap::new();
    for p in &pixels {
        *counts.entry(*p).or_default() += 1;
    }
    let background = counts
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(c, _)| *c)
        .unwrap();
    let ink = pixels.iter().filter(|p| **p != background).count();
    assert!(
        ink * 100 > pixels.len() && counts.len() > 16,
        "the page rendered blank: {ink} of {} pixels differ from {background:?}, {} colours",
        pixels.len(),
        counts.len()
    );
    if let Ok(keep) = std::env::var("BOT_SCREENSHOT_OUT") {
        std::fs::copy(&png_path, keep).unwrap();
    }
}

/// Killed while a member's createRecord is in flight (forwarded or not), then resumed: six
/// posts in all, nothing twice.
#[test]
fn a_killed_round_resumes_without_repeating_anything() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    for forward in [true, false] {
        let home = tempfile::tempdir().unwrap();
        let dids = setup(home.path(), &pds.service);
        let (proxy, creates, handled) = faulty_proxy(&pds.service, Fault::Hold { forward });
        let mut c = std::process::Command::new(assert_cmd::cargo::cargo_bin("bot"));
        let mut child = c
            .env("BOT_HOME", home.path())
            .env("BOT_MODEL", fixtures().join("q4g64"))
            .env("BOT_ADAPTER", fixtures().join("adapter"))
            .env("HF_HUB_OFFLINE", "1")
            .env("BOT_SANDBOX_SERVICE", &proxy)
            .args(["sandbox", "converse", "--rounds", "3", "--seed", "9", "-q"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        handled
            .recv_timeout(Duration::from_secs(120))
            .expect("createRecord reached the proxy");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(creates.load(std::sync::atomic::Ordering::SeqCst), 1);
        ok_stdout(
            sandbox(home.path())
                .args(["sandbox", "converse", "--rounds", "3", "-q"])
                .output()
                .unwrap(),
        );
        check_tree(&pds.service, &dids, 6);
    }
}

/// The tour on a fresh home: `up` starts the sandbox's own PDS (Node and the packages as the
/// CI's PDS installed them), `converse`, `down`, `up` again (the same accounts, their DIDs
/// replayed into the new PLC directory), another round, `page`.
#[test]
fn the_sandboxs_own_pds_keeps_its_conversation_across_restarts() {
    let Some(_) = pds_from("BSKY_SERVICE") else {
        return;
    };
    // where .ci/pds/start-pds.sh installed Node and the packages
    let install = std::env::var("ATPROTO_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| {
            std::env::var("XDG_CACHE_HOME")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|_| {
                    std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache")
                })
                .join("local-pds")
        });
    assert!(
        install.join("pds/node_modules/@atproto/pds").exists(),
        "no PDS install at {}",
        install.display()
    );
    let home = tempfile::tempdir().unwrap();
    std::fs::write(
        home.path().join("config.toml"),
        "system = \"You are bot A.\"\n[profiles.b]\nsystem = \"You are bot B.\"\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        ok_stdout(
            sandbox(home.path())
                .env("BOT_SANDBOX_PDS_DIR", &install)
                .args(args)
                .output()
                .unwrap(),
        )
    };
    let service = run(&["sandbox", "up", "--port", "2783"]).trim().to_string();
    assert_eq!(service, "http://127.0.0.1:2783");
    let stop = scopeguard(home.path(), &install);
    run(&["sandbox", "converse", "--rounds", "1", "--seed", "2", "-q"]);
    run(&["sandbox", "down"]);
    let st: Value = serde_json::from_str(run(&["sandbox", "status"]).trim()).unwrap();
    assert_eq!(st["up"], false);
    run(&["sandbox", "up", "--port", "2783"]);
    run(&["sandbox", "converse", "--rounds", "2", "--seed", "3", "-q"]);
    let st: Value = serde_json::from_str(run(&["sandbox", "status"]).trim()).unwrap();
    assert_eq!(st["rounds_done"], 2);
    let dids: Vec<String> = st["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["did"].as_str().unwrap().to_string())
        .collect();
    check_tree(&service, &dids, 4);
    drop(stop);
}

/// Stops the sandbox's PDS when the test ends, passed or not.
struct StopOnDrop(std::path::PathBuf, std::path::PathBuf);

fn scopeguard(home: &Path, install: &Path) -> StopOnDrop {
    StopOnDrop(home.to_path_buf(), install.to_path_buf())
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let _ = sandbox(&self.0)
            .env("BOT_SANDBOX_PDS_DIR", &self.1)
            .args(["sandbox", "down"])
            .output();
    }
}
