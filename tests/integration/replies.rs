//! `bot reply` and `bot thread` against the reference PDS: reply refs whose CIDs are the
//! records they point to, a reply killed mid-send that lands once, a post answered once,
//! reply drafts in the queue, and the tiny model writing a reply.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::bluesky_pds::{
    account, bot, faulty_proxy, list_posts, ok_stdout, pds_from, Account, Fault, Pds,
};
use crate::common::fixtures;

fn get_record(pds: &Pds, uri: &str) -> Value {
    let rest = uri.strip_prefix("at://").unwrap();
    let parts: Vec<&str> = rest.split('/').collect();
    reqwest::blocking::Client::new()
        .get(format!("{}/xrpc/com.atproto.repo.getRecord", pds.service))
        .query(&[
            ("repo", parts[0]),
            ("collection", parts[1]),
            ("rkey", parts[2]),
        ])
        .send()
        .unwrap()
        .json()
        .unwrap()
}

fn post(pds: &Pds, home: &Path, acct: &Account, text: &str) -> String {
    let out = ok_stdout(
        bot(&pds.service, home, acct)
            .args(["post", "--text", text])
            .output()
            .unwrap(),
    );
    out.trim().to_string()
}

fn reply_json(pds: &Pds, home: &Path, acct: &Account, to: &str, text: &str) -> Value {
    let out = bot(&pds.service, home, acct)
        .args(["reply", "--json", "--to", to, "--text", text])
        .output()
        .unwrap();
    serde_json::from_str(ok_stdout(out).trim()).unwrap()
}

#[test]
fn reply_refs_point_at_the_records_they_name() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let (a, b) = (account(&pds), account(&pds));
    let (ha, hb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let root_uri = post(&pds, ha.path(), &a, "A thread about sourdough starters.");
    let root = get_record(&pds, &root_uri);

    // b answers the top-level post by its at:// URI: root and parent are that post
    let r1 = reply_json(&pds, hb.path(), &b, &root_uri, "Mine is called Bubbles.");
    let rec1 = get_record(&pds, r1["uri"].as_str().unwrap());
    let reply = &rec1["value"]["reply"];
    assert_eq!(reply["root"]["uri"], root_uri);
    assert_eq!(reply["root"]["cid"], root["cid"]);
    assert_eq!(reply["parent"], reply["root"]);
    assert_eq!(rec1["value"]["text"], "Mine is called Bubbles.");

    // a answers b's reply through a bsky.app link with b's handle: the root stays a's post
    let rkey = r1["uri"].as_str().unwrap().rsplit('/').next().unwrap();
    let link = format!("https://bsky.app/profile/{}/post/{rkey}", b.handle);
    let r2 = reply_json(&pds, ha.path(), &a, &link, "Bubbles is a great name.");
    let rec2 = get_record(&pds, r2["uri"].as_str().unwrap());
    let reply = &rec2["value"]["reply"];
    assert_eq!(reply["root"]["uri"], root_uri);
    assert_eq!(reply["root"]["cid"], root["cid"]);
    assert_eq!(reply["parent"]["uri"], r1["uri"]);
    assert_eq!(reply["parent"]["cid"], rec1["cid"]);

    // `bot thread` walks back to the root
    let out = ok_stdout(
        bot(&pds.service, ha.path(), &a)
            .args(["thread", "--json", r2["uri"].as_str().unwrap()])
            .output()
            .unwrap(),
    );
    let lines: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let uris: Vec<&str> = lines.iter().map(|l| l["uri"].as_str().unwrap()).collect();
    assert_eq!(
        uris,
        [
            root_uri.as_str(),
            r1["uri"].as_str().unwrap(),
            r2["uri"].as_str().unwrap()
        ]
    );
    // the handle where the PDS can say it (describeRepo), else the DID
    let who = lines[1]["author"].as_str().unwrap();
    assert!(who == format!("@{}", b.handle) || who == b.did, "{who}");

    // answering the same post again sends nothing and names the reply made
    let again = reply_json(&pds, hb.path(), &b, &root_uri, "A second answer");
    assert_eq!(again["uri"], r1["uri"]);
    assert_eq!(again["existing"], true);
    assert_eq!(list_posts(&pds, &b.did).len(), 1);
}

#[test]
fn a_bad_target_is_a_usage_error_and_a_missing_post_names_itself() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let a = account(&pds);
    let home = tempfile::tempdir().unwrap();
    let out = bot(&pds.service, home.path(), &a)
        .args(["reply", "--to", "https://example.com/x", "--text", "hi"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let missing = format!("at://{}/app.bsky.feed.post/3kaaaaaaaaaaa", a.did);
    let out = bot(&pds.service, home.path(), &a)
        .args(["reply", "--to", &missing, "--text", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no post at") && err.contains("3kaaaaaaaaaaa"),
        "{err}"
    );
    assert!(list_posts(&pds, &a.did).is_empty());
}

/// Killed while createRecord is in flight (forwarded or not), then run again: one reply.
#[test]
fn a_reply_killed_mid_send_lands_once() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    for forward in [true, false] {
        let (a, b) = (account(&pds), account(&pds));
        let (ha, hb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let target = post(&pds, ha.path(), &a, "Who else is up at dawn?");
        let (proxy, creates, handled) = faulty_proxy(&pds.service, Fault::Hold { forward });
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("bot"))
            .env("BOT_HOME", hb.path())
            .env("BOT_BSKY_SERVICE", &proxy)
            .env("BOT_BSKY_HANDLE", &b.handle)
            .env("BOT_BSKY_APP_PASSWORD", &b.app_password)
            .args(["reply", "--to", &target, "--text", "Me, with coffee."])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        handled
            .recv_timeout(Duration::from_secs(90))
            .expect("createRecord reached the proxy");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(creates.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(
            list_posts(&pds, &b.did).len(),
            forward as usize,
            "forward={forward}"
        );

        let j = reply_json(&pds, hb.path(), &b, &target, "Me, with coffee.");
        let posts = list_posts(&pds, &b.did);
        assert_eq!(posts.len(), 1, "forward={forward}: {posts:?}");
        assert_eq!(posts[0]["uri"], j["uri"]);
        assert_eq!(posts[0]["value"]["reply"]["parent"]["uri"], target);
    }
}

/// The tiny model writes the reply; `--save` queues it as a reply draft that `bot post
/// --next` publishes with its refs; `--dry-run` shows the refs and sends nothing.
#[test]
fn generated_replies_go_through_the_queue_with_their_refs() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let (a, b) = (account(&pds), account(&pds));
    let (ha, hb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let target = post(&pds, ha.path(), &a, "What are you reading this week?");
    let with_model = |c: &mut assert_cmd::Command| {
        c.env("BOT_MODEL", fixtures().join("q4g64"))
            .env("BOT_ADAPTER", fixtures().join("adapter"))
            .env("HF_HUB_OFFLINE", "1");
    };
    let mut c = bot(&pds.service, hb.path(), &b);
    with_model(&mut c);
    let dry = ok_stdout(
        c.args([
            "reply",
            "--dry-run",
            "--json",
            "-q",
            "--seed",
            "5",
            "--to",
            &target,
        ])
        .output()
        .unwrap(),
    );
    let dry: Value = serde_json::from_str(dry.trim()).unwrap();
    assert_eq!(dry["record"]["reply"]["parent"]["uri"], target);
    assert_eq!(dry["answering"]["text"], "What are you reading this week?");
    assert!(!dry["record"]["text"].as_str().unwrap().trim().is_empty());
    assert!(list_posts(&pds, &b.did).is_empty());

    let mut c = bot(&pds.service, hb.path(), &b);
    with_model(&mut c);
    let id = ok_stdout(
        c.args(["reply", "--save", "-q", "--seed", "5", "--to", &target])
            .output()
            .unwrap(),
    );
    let mut c = bot(&pds.service, hb.path(), &b);
    let list = ok_stdout(c.args(["queue", "list"]).output().unwrap());
    assert!(
        list.contains(&format!("[replying to @{}]", a.handle))
            || list.contains(&format!("[replying to {}]", a.did)),
        "{list}"
    );
    let mut c = bot(&pds.service, hb.path(), &b);
    ok_stdout(c.args(["queue", "approve", id.trim()]).output().unwrap());
    let mut c = bot(&pds.service, hb.path(), &b);
    let uri = ok_stdout(c.args(["post", "--next"]).output().unwrap());
    let rec = get_record(&pds, uri.trim());
    assert_eq!(rec["value"]["reply"]["parent"]["uri"], target);
    assert_eq!(rec["value"]["reply"]["root"]["uri"], target);
    assert_eq!(
        rec["value"]["text"], dry["record"]["text"],
        "same seed, same reply"
    );
}

/// `bot run --mode replies` over the members' repos (the reference PDS has no AppView, so no
/// notifications): a mention and a reply to the bot are answered, each once across two runs;
/// a post that does not address it and its own mention of itself are not.
#[test]
fn mode_replies_answers_who_addressed_the_bot_once() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let (b, a, c) = (account(&pds), account(&pds), account(&pds));
    let (hb, ha, hc) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let hello = post(&pds, hb.path(), &b, "Hello from the bot.");
    let self_mention = post(
        &pds,
        hb.path(),
        &b,
        &format!("Note to self, @{}.", b.handle),
    );
    let reply = reply_json(&pds, ha.path(), &a, &hello, "Hello, bot!");
    let mention = post(
        &pds,
        ha.path(),
        &a,
        &format!("What do you think, @{}?", b.handle),
    );
    post(&pds, hc.path(), &c, "A post about nothing in particular.");
    let sources = format!("{},{},{}", a.did, c.did, b.did);
    let run = || {
        let mut cmd = bot(&pds.service, hb.path(), &b);
        cmd.env("BOT_MODEL", fixtures().join("q4g64"))
            .env("BOT_ADAPTER", fixtures().join("adapter"))
            .env("HF_HUB_OFFLINE", "1")
            .args([
                "run",
                "--mode",
                "replies",
                "--seed",
                "3",
                "--mentions-from",
                &sources,
            ]);
        ok_stdout(cmd.output().unwrap())
    };
    let first = run();
    assert_eq!(first.lines().count(), 2, "{first}");
    let posts = list_posts(&pds, &b.did);
    let parents: Vec<&str> = posts
        .iter()
        .filter_map(|p| p["value"]["reply"]["parent"]["uri"].as_str())
        .collect();
    let mut want = vec![reply["uri"].as_str().unwrap(), mention.as_str()];
    want.sort();
    let mut got = parents.clone();
    got.sort();
    assert_eq!(got, want, "{posts:#?}");
    assert!(!parents.contains(&self_mention.as_str()));
    // the reply to a reply stays in the thread of the bot's first post
    let deep = posts
        .iter()
        .find(|p| p["value"]["reply"]["parent"]["uri"] == reply["uri"])
        .unwrap();
    assert_eq!(deep["value"]["reply"]["root"]["uri"], hello.as_str());

    let second = run();
    assert!(second.trim().is_empty(), "{second}");
    assert_eq!(list_posts(&pds, &b.did).len(), 4);
    let log = ok_stdout(
        bot(&pds.service, hb.path(), &b)
            .args(["log", "-n", "2"])
            .output()
            .unwrap(),
    );
    let results: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(results[0]["result"], "replied");
    assert_eq!(results[1]["result"], "idle");
}
