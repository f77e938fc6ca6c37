//! Models by repo id: a loopback server in the Hugging Face Hub's URL layout
//! (`/api/models/{repo}/revision/main`, `/{repo}/resolve/main/{file}` with ranges, `etag` and
//! `x-repo-commit`) stands in for huggingface.co through `HF_ENDPOINT`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use assert_cmd::Command;

use crate::common::*;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

struct FakeHub {
    port: u16,
    /// Requests for file bytes beyond the one-byte metadata probe.
    downloads: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
}

type Repos = BTreeMap<String, BTreeMap<String, Vec<u8>>>;

fn repo_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn etag(name: &str, data: &[u8]) -> String {
    // FNV-1a: a stable content id for the blob file name.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in name.bytes().chain(data.iter().copied()) {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}{:08x}", data.len())
}

fn respond(mut s: TcpStream, status: &str, headers: &[(String, String)], body: &[u8]) {
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = s.write_all(head.as_bytes());
    let _ = s.write_all(body);
}

fn handle(s: TcpStream, repos: &Repos, downloads: &AtomicUsize, etag_override: Option<&str>) {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut range = None;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).unwrap() <= 2 {
            break;
        }
        if let Some((k, v)) = h.trim_end().split_once(':') {
            if k.eq_ignore_ascii_case("range") {
                range = Some(v.trim().trim_start_matches("bytes=").to_string());
            }
        }
    }
    if path.contains("private") {
        return respond(
            s,
            "401 Unauthorized",
            &[],
            b"{\"error\":\"Invalid credentials\"}",
        );
    }
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let repo = rest.trim_end_matches("/revision/main");
        return match repos.get(repo) {
            Some(files) => {
                let siblings: Vec<_> = files
                    .keys()
                    .map(|f| serde_json::json!({ "rfilename": f }))
                    .collect();
                let body = serde_json::json!({ "sha": COMMIT, "siblings": siblings }).to_string();
                respond(
                    s,
                    "200 OK",
                    &[("Content-Type".into(), "application/json".into())],
                    body.as_bytes(),
                )
            }
            None => respond(
                s,
                "404 Not Found",
                &[],
                b"{\"error\":\"Repository not found\"}",
            ),
        };
    }
    // `/{repo}/resolve/{revision}/{file}`, the revision a branch or the commit
    let Some((repo, rest)) = path.trim_start_matches('/').split_once("/resolve/") else {
        return respond(s, "404 Not Found", &[], b"");
    };
    let Some((_, file)) = rest.split_once('/') else {
        return respond(s, "404 Not Found", &[], b"");
    };
    let Some(data) = repos.get(repo).and_then(|f| f.get(file)) else {
        return respond(s, "404 Not Found", &[], b"{\"error\":\"Entry not found\"}");
    };
    let (start, end) = match range.as_deref().and_then(|r| r.split_once('-')) {
        Some((a, b)) => (
            a.parse::<usize>().unwrap_or(0),
            b.parse::<usize>()
                .map(|e| e + 1)
                .unwrap_or(data.len())
                .min(data.len()),
        ),
        None => (0, data.len()),
    };
    if end - start > 1 || data.len() <= 1 {
        downloads.fetch_add(1, Ordering::SeqCst);
    }
    let headers = vec![
        (
            "ETag".to_string(),
            format!(
                "\"{}\"",
                etag_override
                    .map(str::to_string)
                    .unwrap_or_else(|| etag(file, data))
            ),
        ),
        ("X-Repo-Commit".to_string(), COMMIT.to_string()),
        (
            "Content-Range".to_string(),
            format!("bytes {start}-{}/{}", end.max(1) - 1, data.len()),
        ),
    ];
    respond(s, "206 Partial Content", &headers, &data[start..end]);
}

impl FakeHub {
    fn start(repos: Repos) -> FakeHub {
        Self::start_with(repos, None)
    }

    /// A mirror that names every blob `etag` (a hostile one: a path).
    fn start_with(repos: Repos, etag: Option<String>) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let downloads = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(AtomicUsize::new(0));
        let (d, q) = (downloads.clone(), requests.clone());
        let repos = Arc::new(repos);
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                q.fetch_add(1, Ordering::SeqCst);
                let (repos, d, e) = (repos.clone(), d.clone(), etag.clone());
                std::thread::spawn(move || handle(s, &repos, &d, e.as_deref()));
            }
        });
        FakeHub {
            port,
            downloads,
            requests,
        }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

fn bot(hf_home: &Path, endpoint: &str, offline: bool) -> Command {
    let mut c = Command::cargo_bin("bot").unwrap();
    c.env("BOT_HOME", hf_home.join("bot"))
        .env("HF_HOME", hf_home)
        .env("HF_ENDPOINT", endpoint)
        .env_remove("HF_TOKEN");
    if offline {
        c.env("HF_HUB_OFFLINE", "1");
    } else {
        c.env_remove("HF_HUB_OFFLINE");
    }
    c
}

fn gen_args(model: &str, adapter: &str) -> Vec<String> {
    [
        "generate",
        "--model",
        model,
        "--adapter",
        adapter,
        "--seed",
        "4",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn text_of(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    j["text"].as_str().unwrap().to_string()
}

#[test]
fn models_by_repo_id_download_once_then_work_from_cache_and_offline() {
    let mut repos = Repos::new();
    repos.insert(
        "test-org/tiny-q4".into(),
        repo_files(&fixtures().join("q4g64")),
    );
    repos.insert(
        "test-org/tiny-adapter".into(),
        repo_files(&fixtures().join("adapter")),
    );
    let hub = FakeHub::start(repos);
    let home = tempfile::tempdir().unwrap();
    let args = gen_args("test-org/tiny-q4", "test-org/tiny-adapter");

    // First run downloads every file and says so.
    let first = bot(home.path(), &hub.endpoint(), false)
        .args(&args)
        .output()
        .unwrap();
    let first_text = text_of(&first);
    let err = String::from_utf8_lossy(&first.stderr);
    assert!(
        err.contains("downloading test-org/tiny-q4/model.safetensors"),
        "{err}"
    );
    assert!(
        err.contains("downloading test-org/tiny-adapter/adapters.safetensors"),
        "{err}"
    );
    let downloaded = hub.downloads.load(Ordering::SeqCst);
    assert!(downloaded >= 8, "{downloaded} downloads");
    assert!(home
        .path()
        .join("hub/models--test-org--tiny-q4/snapshots")
        .join(COMMIT)
        .is_dir());

    // The same post as from the local directory: the cached copy is the model.
    let local = bot(home.path(), &hub.endpoint(), true)
        .args(gen_args(
            fixtures().join("q4g64").to_str().unwrap(),
            fixtures().join("adapter").to_str().unwrap(),
        ))
        .output()
        .unwrap();
    assert_eq!(text_of(&local), first_text);

    // Second run: only the repo info is asked for, nothing is downloaded again.
    let second = bot(home.path(), &hub.endpoint(), false)
        .args(&args)
        .output()
        .unwrap();
    assert_eq!(text_of(&second), first_text);
    assert!(!String::from_utf8_lossy(&second.stderr).contains("downloading"));
    assert_eq!(hub.downloads.load(Ordering::SeqCst), downloaded);

    // Offline: no request at all.
    let before = hub.requests.load(Ordering::SeqCst);
    let offline = bot(home.path(), &hub.endpoint(), true)
        .args(&args)
        .output()
        .unwrap();
    assert_eq!(text_of(&offline), first_text);
    assert_eq!(hub.requests.load(Ordering::SeqCst), before);

    // Hub unreachable (nothing listens on the endpoint): the cache still serves.
    let dead = bot(home.path(), "http://127.0.0.1:9", false)
        .args(&args)
        .output()
        .unwrap();
    assert_eq!(text_of(&dead), first_text);

    // Offline with an empty cache: a clear failure.
    let empty = tempfile::tempdir().unwrap();
    let out = bot(empty.path(), &hub.endpoint(), true)
        .args(&args)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("test-org/tiny-q4") && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );
}

#[test]
fn unknown_and_private_repos_say_what_to_do() {
    let hub = FakeHub::start(Repos::new());
    let home = tempfile::tempdir().unwrap();
    let out = bot(home.path(), &hub.endpoint(), false)
        .args(["generate", "--model", "nobody/nothing"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nobody/nothing") && err.contains("not found"),
        "{err}"
    );

    let out = bot(home.path(), &hub.endpoint(), false)
        .args(["generate", "--model", "someone/private-model"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("HF_TOKEN") && err.contains("401"), "{err}");
}

/// A mirror (HF_ENDPOINT) that answers with ETags that are paths cannot make bot write
/// outside the cache: the download is refused, naming the ETag, and nothing lands there.
#[test]
fn hostile_mirror_etags_cannot_write_outside_the_cache() {
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("pwned");
    for etag in [
        target.display().to_string(),
        "../../../../../../../../../../tmp/bot-pwned".to_string(),
    ] {
        let mut repos = Repos::new();
        repos.insert(
            "test-org/tiny-q4".into(),
            repo_files(&fixtures().join("q4g64")),
        );
        let hub = FakeHub::start_with(repos, Some(etag.clone()));
        let home = tempfile::tempdir().unwrap();
        let out = bot(home.path(), &hub.endpoint(), false)
            .args(["generate", "--model", "test-org/tiny-q4", "--no-adapter"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("refusing") && err.contains("ETag"), "{err}");
        assert!(
            !target.exists(),
            "{etag}: a file appeared outside the cache"
        );
        assert!(!Path::new("/tmp/bot-pwned").exists());
    }
}
