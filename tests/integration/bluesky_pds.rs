//! `bot post` and friends against the reference PDS (`@atproto/pds`, started by
//! `.ci/pds/start-pds.sh` on loopback). Each test makes its own account so tests can run in
//! parallel. Without `BSKY_SERVICE` the tests skip, unless `REQUIRE_PDS=1` (CI) makes that
//! a failure.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use assert_cmd::Command;
use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};

use bot::bluesky::xrpc::RetryPolicy;
use bot::bluesky::{Bluesky, Credentials};

pub struct Pds {
    pub service: String,
    pub jwt_secret: String,
}

pub fn pds_from(var: &str) -> Option<Pds> {
    match std::env::var(var) {
        Ok(service) if !service.is_empty() => Some(Pds {
            service,
            jwt_secret: std::env::var("PDS_JWT_SECRET").unwrap_or_default(),
        }),
        _ => {
            assert!(
                std::env::var("REQUIRE_PDS").as_deref() != Ok("1"),
                "REQUIRE_PDS=1 but {var} is not set: start the PDS with .ci/pds/start-pds.sh"
            );
            eprintln!("skipping: {var} not set (start .ci/pds/start-pds.sh)");
            None
        }
    }
}

pub struct Account {
    pub handle: String,
    pub did: String,
    pub app_password: String,
}

fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

fn xrpc_post(service: &str, nsid: &str, body: &Value, token: Option<&str>) -> Value {
    let mut r = http().post(format!("{service}/xrpc/{nsid}")).json(body);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let resp = r.send().unwrap();
    let status = resp.status();
    let v: Value = resp.json().unwrap();
    assert!(status.is_success(), "{nsid}: {status} {v}");
    v
}

/// A fresh account with an app password.
pub fn account(pds: &Pds) -> Account {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let handle = format!(
        "t{}n{}x{}.test",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        nanos % 100000
    );
    let v = xrpc_post(
        &pds.service,
        "com.atproto.server.createAccount",
        &json!({ "handle": handle, "email": format!("{handle}@example.com"), "password": "account-pass-123" }),
        None,
    );
    let access = v["accessJwt"].as_str().unwrap();
    let app = xrpc_post(
        &pds.service,
        "com.atproto.server.createAppPassword",
        &json!({ "name": "bot-test" }),
        Some(access),
    );
    Account {
        handle,
        did: v["did"].as_str().unwrap().to_string(),
        app_password: app["password"].as_str().unwrap().to_string(),
    }
}

pub fn list_posts(pds: &Pds, did: &str) -> Vec<Value> {
    let v: Value = http()
        .get(format!("{}/xrpc/com.atproto.repo.listRecords", pds.service))
        .query(&[
            ("repo", did),
            ("collection", "app.bsky.feed.post"),
            ("limit", "100"),
        ])
        .send()
        .unwrap()
        .json()
        .unwrap();
    v["records"].as_array().cloned().unwrap_or_default()
}

pub fn bot(service: &str, home: &std::path::Path, acct: &Account) -> Command {
    let mut c = Command::cargo_bin("bot").unwrap();
    c.env("BOT_HOME", home)
        .env("BOT_BSKY_SERVICE", service)
        .env("BOT_BSKY_HANDLE", &acct.handle)
        .env("BOT_BSKY_APP_PASSWORD", &acct.app_password)
        .env("BOT_RETRY_TOTAL_S", "20")
        .timeout(Duration::from_secs(120));
    c
}

pub fn ok_stdout(out: std::process::Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn post_with_link_and_mention_facets_reads_back() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let acct = account(&pds);
    let home = tempfile::tempdir().unwrap();
    let text = format!(
        "Café notes for @{} and @nobody-here.test: see https://example.com/x?y=1.",
        acct.handle
    );
    let out = ok_stdout(
        bot(&pds.service, home.path(), &acct)
            .args(["post", "--json", "--text", &text])
            .output()
            .unwrap(),
    );
    let j: Value = serde_json::from_str(out.trim()).unwrap();
    let uri = j["uri"].as_str().unwrap();
    assert!(uri.starts_with(&format!("at://{}/app.bsky.feed.post/", acct.did)));
    let records = list_posts(&pds, &acct.did);
    assert_eq!(records.len(), 1);
    let rec = &records[0]["value"];
    assert_eq!(rec["text"], text);
    assert_eq!(rec["langs"], json!(["en"]));
    let created = rec["createdAt"].as_str().unwrap();
    assert!(created.ends_with('Z') && created.len() == 24, "{created}");
    let facets = rec["facets"].as_array().unwrap();
    // The unknown handle stays plain text: one mention and one link.
    assert_eq!(facets.len(), 2, "{facets:?}");
    let bytes = text.as_bytes();
    let slice = |f: &Value| {
        let (s, e) = (
            f["index"]["byteStart"].as_u64().unwrap() as usize,
            f["index"]["byteEnd"].as_u64().unwrap() as usize,
        );
        String::from_utf8(bytes[s..e].to_vec()).unwrap()
    };
    assert_eq!(slice(&facets[0]), format!("@{}", acct.handle));
    assert_eq!(facets[0]["features"][0]["did"], acct.did);
    assert_eq!(slice(&facets[1]), "https://example.com/x?y=1");
    assert_eq!(facets[1]["features"][0]["uri"], "https://example.com/x?y=1");

    // History has it; `delete last` removes it.
    ok_stdout(
        bot(&pds.service, home.path(), &acct)
            .args(["delete", "last"])
            .output()
            .unwrap(),
    );
    assert!(list_posts(&pds, &acct.did).is_empty());
}

#[test]
fn one_login_serves_many_runs() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let acct = account(&pds);
    let home = tempfile::tempdir().unwrap();
    let who = |c: &mut Command| -> Value {
        serde_json::from_str(ok_stdout(c.arg("whoami").output().unwrap()).trim()).unwrap()
    };
    assert_eq!(
        who(&mut bot(&pds.service, home.path(), &acct))["new_login"],
        true
    );
    ok_stdout(
        bot(&pds.service, home.path(), &acct)
            .args(["post", "--text", "second run, same session"])
            .output()
            .unwrap(),
    );
    // Without the password at all: the cached session is enough.
    let mut c = bot(&pds.service, home.path(), &acct);
    c.env_remove("BOT_BSKY_APP_PASSWORD");
    let w = who(&mut c);
    assert_eq!(w["new_login"], false);
    assert_eq!(w["did"], acct.did);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(home.path().join("session.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

fn mint_expired_access(pds: &Pds, did: &str) -> String {
    let b = |v: &Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let head = b(&json!({ "typ": "at+jwt", "alg": "HS256" }));
    let body = b(&json!({
        "scope": "com.atproto.access", "aud": "did:web:localhost", "sub": did,
        "iat": now - 7200, "exp": now - 3600,
    }));
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(pds.jwt_secret.as_bytes()).unwrap();
    mac.update(format!("{head}.{body}").as_bytes());
    let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
    format!("{head}.{body}.{sig}")
}

/// The server says `ExpiredToken` (HTTP 400): the client refreshes and the call succeeds,
/// without a new login.
#[test]
fn expired_access_token_is_refreshed() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let acct = account(&pds);
    let home = tempfile::tempdir().unwrap();
    let pw = || Ok(acct.app_password.clone());
    let creds = Credentials {
        service: pds.service.clone(),
        handle: acct.handle.clone(),
        password: &pw,
    };
    let mut client = Bluesky::connect(&creds, home.path(), RetryPolicy::default()).unwrap();
    assert_eq!(client.logins, 1);
    let old_refresh = client.session.refresh_jwt.clone();
    client.session.access_jwt = mint_expired_access(&pds, &acct.did);
    // The reference PDS really rejects it as expired.
    let raw = http()
        .get(format!(
            "{}/xrpc/com.atproto.server.getSession",
            pds.service
        ))
        .bearer_auth(&client.session.access_jwt)
        .send()
        .unwrap();
    assert_eq!(raw.status().as_u16(), 400);
    assert_eq!(raw.json::<Value>().unwrap()["error"], "ExpiredToken");
    let me = client.whoami(&creds).unwrap();
    assert_eq!(me["did"], acct.did);
    assert_eq!(client.logins, 1, "refreshed, not logged in again");
    assert_ne!(client.session.refresh_jwt, old_refresh);
    drop(client);

    // From the command line: an expired token in the cached session is refreshed too.
    let path = home.path().join("session.json");
    let mut s: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    s["access_jwt"] = json!(mint_expired_access(&pds, &acct.did));
    std::fs::write(&path, s.to_string()).unwrap();
    let mut c = bot(&pds.service, home.path(), &acct);
    c.env_remove("BOT_BSKY_APP_PASSWORD");
    ok_stdout(
        c.args(["post", "--text", "posted after a refresh"])
            .output()
            .unwrap(),
    );
    assert_eq!(list_posts(&pds, &acct.did).len(), 1);
}

#[test]
fn wrong_password_fails_cleanly_without_leaking_it() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let acct = account(&pds);
    let home = tempfile::tempdir().unwrap();
    let secret = "wrong-pass-zq9x-7781";
    let out = bot(&pds.service, home.path(), &acct)
        .env("BOT_BSKY_APP_PASSWORD", secret)
        .args(["post", "--text", "never sent"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(se.contains("wrong handle or app password"), "{se}");
    assert!(!so.contains(secret) && !se.contains(secret));
    assert!(!home.path().join("session.json").exists());
    assert!(list_posts(&pds, &acct.did).is_empty());
}

#[test]
fn over_the_limit_is_refused_before_sending() {
    // Nothing listens on port 9: any attempt to send would be a network failure (6), not 7.
    let acct = Account {
        handle: "x.test".into(),
        did: String::new(),
        app_password: "unused".into(),
    };
    let home = tempfile::tempdir().unwrap();
    let out = bot("http://127.0.0.1:9", home.path(), &acct)
        .args(["post", "--text", &"a".repeat(301)])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("301 grapheme clusters"));
    assert!(out.stdout.is_empty());
}

#[test]
fn dry_run_writes_nothing() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let acct = account(&pds);
    let home = tempfile::tempdir().unwrap();
    ok_stdout(
        bot(&pds.service, home.path(), &acct)
            .args(["post", "--text", "real one"])
            .output()
            .unwrap(),
    );
    let before = list_posts(&pds, &acct.did);
    let out = ok_stdout(
        bot(&pds.service, home.path(), &acct)
            .args([
                "post",
                "--dry-run",
                "--json",
                "--text",
                &format!("dry 👋 @{}", acct.handle),
            ])
            .output()
            .unwrap(),
    );
    let j: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(j["call"], "com.atproto.repo.createRecord");
    assert_eq!(j["graphemes"], 7 + acct.handle.len());
    assert_eq!(j["bytes"], 10 + acct.handle.len());
    assert_eq!(j["record"]["facets"][0]["features"][0]["did"], acct.did);
    assert_eq!(list_posts(&pds, &acct.did), before);
}

/// What a [`faulty_proxy`] does to the first createRecord it sees.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Fault {
    /// The PDS applies the write, the answer is lost (the connection closes).
    LoseAnswer,
    /// The request never reaches the PDS (the connection closes).
    LoseRequest,
    /// The request is (or, with `forward: false`, is not) applied and the client is left
    /// waiting for an answer that never comes, so the test can kill it mid-send.
    Hold { forward: bool },
    /// The request is held, not forwarded, until the test says so (a second message on the
    /// returned channel's partner: see `faulty_proxy_late`); then it reaches the PDS late.
    Late,
}

/// A proxy that forwards to the PDS except for the first createRecord, to which it applies
/// `fault`; the returned receiver gets a message once that createRecord has been handled.
pub fn faulty_proxy(
    target: &str,
    fault: Fault,
) -> (String, Arc<AtomicUsize>, std::sync::mpsc::Receiver<()>) {
    let (url, creates, handled, _release) = faulty_proxy_late(target, fault);
    (url, creates, handled)
}

/// `faulty_proxy` that also returns the sender releasing a `Fault::Late` request; `handled`
/// gets a message when the request is held and another once the PDS answered it.
pub fn faulty_proxy_late(
    target: &str,
    fault: Fault,
) -> (
    String,
    Arc<AtomicUsize>,
    std::sync::mpsc::Receiver<()>,
    std::sync::mpsc::Sender<()>,
) {
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = Arc::new(std::sync::Mutex::new(release_rx));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let target = target.trim_start_matches("http://").to_string();
    let creates = Arc::new(AtomicUsize::new(0));
    let c2 = creates.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let (target, creates, tx) = (target.clone(), c2.clone(), tx.clone());
            let release = release_rx.clone();
            std::thread::spawn(move || proxy_one(client, &target, &creates, fault, tx, &release));
        }
    });
    (format!("http://{addr}"), creates, rx, release_tx)
}

fn proxy_one(
    client: TcpStream,
    target: &str,
    creates: &AtomicUsize,
    fault: Fault,
    handled: std::sync::mpsc::Sender<()>,
    release: &std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
) {
    client.set_read_timeout(Some(Duration::from_secs(30))).ok();
    let mut r = BufReader::new(client.try_clone().unwrap());
    // One request per connection (upstream is told to close): head, then Content-Length bytes.
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let end = line == "\r\n";
        if !line.to_ascii_lowercase().starts_with("connection:") {
            head.push_str(&line);
        }
        if end {
            break;
        }
    }
    let len = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse::<usize>().unwrap())
        })
        .unwrap_or(0);
    let mut body = vec![0; len];
    r.read_exact(&mut body).unwrap();
    let is_create = head.starts_with("POST /xrpc/com.atproto.repo.createRecord");
    let first_create = is_create && creates.fetch_add(1, Ordering::SeqCst) == 0;
    // Keeps the client's connection open and silent until the client is killed.
    let hold = || {
        let _ = handled.send(());
        std::thread::sleep(Duration::from_secs(90));
    };
    if first_create {
        match fault {
            Fault::LoseRequest => {
                let _ = handled.send(());
                return;
            }
            Fault::Hold { forward: false } => return hold(),
            Fault::Late => {
                let _ = handled.send(());
                let _ = release
                    .lock()
                    .unwrap()
                    .recv_timeout(Duration::from_secs(120));
            }
            _ => {}
        }
    }
    let head = head.replacen("\r\n", "\r\nConnection: close\r\n", 1);
    let mut up = TcpStream::connect(target).unwrap();
    up.write_all(head.as_bytes()).unwrap();
    up.write_all(&body).unwrap();
    let mut resp = Vec::new();
    up.read_to_end(&mut resp).unwrap();
    if first_create {
        // The PDS applied it (or, late, refused it); the answer is lost or withheld.
        return match fault {
            Fault::Hold { .. } => hold(),
            _ => drop(handled.send(())),
        };
    }
    let _ = client.try_clone().unwrap().write_all(&resp);
}

#[test]
fn lost_answer_or_lost_request_still_makes_exactly_one_post() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    for drop_request in [false, true] {
        let acct = account(&pds);
        let home = tempfile::tempdir().unwrap();
        let fault = if drop_request {
            Fault::LoseRequest
        } else {
            Fault::LoseAnswer
        };
        let (proxy, creates, _) = faulty_proxy(&pds.service, fault);
        let text = format!("exactly once (request dropped: {drop_request})");
        let start = Instant::now();
        let out = bot(&proxy, home.path(), &acct)
            .args(["post", "--json", "--text", &text])
            .output()
            .unwrap();
        let j: Value = serde_json::from_str(ok_stdout(out).trim()).unwrap();
        assert!(start.elapsed() < Duration::from_secs(60));
        let posts = list_posts(&pds, &acct.did);
        assert_eq!(posts.len(), 1, "drop_request={drop_request}: {posts:?}");
        assert_eq!(posts[0]["uri"], j["uri"]);
        assert_eq!(posts[0]["value"]["text"], text);
        let expected_creates = if drop_request { 2 } else { 1 };
        assert_eq!(
            creates.load(Ordering::SeqCst),
            expected_creates,
            "drop_request={drop_request}"
        );
    }
}

/// With the production rate limiter on (a second PDS, `RATE_LIMITS=1`), logins beyond
/// createSession's limit end with the rate-limit exit code within the time bound.
#[test]
fn throttled_logins_fail_cleanly_within_the_bound() {
    let Some(pds) = pds_from("BSKY_SERVICE_RATELIMITED") else {
        return;
    };
    let acct = account(&pds);
    let start = Instant::now();
    let mut codes = Vec::new();
    for _ in 0..40 {
        // A fresh home each time: no cached session, so every run logs in.
        let home = tempfile::tempdir().unwrap();
        let out = bot(&pds.service, home.path(), &acct)
            .env("BOT_RETRY_TOTAL_S", "5")
            .arg("whoami")
            .output()
            .unwrap();
        codes.push(out.status.code());
        if out.status.code() == Some(4) {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains("rate limited") && err.contains("retry in"),
                "{err}"
            );
            break;
        }
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(codes.last(), Some(&Some(4)), "{codes:?}");
    assert!(codes.len() <= 32, "{codes:?}");
    assert!(start.elapsed() < Duration::from_secs(120));
}
