//! Regression tests for what a hostile test of the release binary broke (issue #18), each
//! named after its defect. The server-side ones run against the reference PDS.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use assert_cmd::Command;
use serde_json::Value;

use crate::bluesky_pds::{account, bot, faulty_proxy_late, list_posts, ok_stdout, pds_from, Fault};
use crate::common::*;

fn local(home: &Path) -> Command {
    let mut c = Command::cargo_bin("bot").unwrap();
    c.env("BOT_HOME", home)
        .env("BOT_MODEL", fixtures().join("q4g64"))
        .env("BOT_ADAPTER", fixtures().join("adapter"))
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("BOT_BSKY_APP_PASSWORD")
        .env_remove("BOT_BSKY_HANDLE")
        .timeout(Duration::from_secs(120));
    c
}

fn code(out: &std::process::Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn drafts(home: &Path) -> Vec<Value> {
    ok_stdout(
        local(home)
            .args(["queue", "list", "--json"])
            .output()
            .unwrap(),
    )
    .lines()
    .map(|l| serde_json::from_str(l).unwrap())
    .collect()
}

/// 1. `post --next` killed while its createRecord is still on the way: the next run finds
///    nothing yet, and the late request lands after it. The rerun must resend under the same
///    record key, so whichever arrives second collides: one record, the draft posted once.
#[test]
fn post_sent_twice_when_the_killed_runs_request_lands_late() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let acct = account(&pds);
    let home = tempfile::tempdir().unwrap();
    ok_stdout(
        local(home.path())
            .args(["draft", "--seed", "41", "-q"])
            .output()
            .unwrap(),
    );
    ok_stdout(
        local(home.path())
            .args(["queue", "approve", "1"])
            .output()
            .unwrap(),
    );
    let (proxy, _creates, handled, release) = faulty_proxy_late(&pds.service, Fault::Late);
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("bot"))
        .env("BOT_HOME", home.path())
        .env("BOT_BSKY_SERVICE", &proxy)
        .env("BOT_BSKY_HANDLE", &acct.handle)
        .env("BOT_BSKY_APP_PASSWORD", &acct.app_password)
        .args(["post", "--next"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    handled
        .recv_timeout(Duration::from_secs(90))
        .expect("createRecord reached the proxy");
    child.kill().unwrap();
    child.wait().unwrap();
    // the rerun settles the pending post while the first request is still held
    ok_stdout(
        bot(&pds.service, home.path(), &acct)
            .args(["post", "--next"])
            .output()
            .unwrap(),
    );
    assert_eq!(list_posts(&pds, &acct.did).len(), 1);
    // now the killed run's request arrives
    release.send(()).unwrap();
    handled
        .recv_timeout(Duration::from_secs(60))
        .expect("the late createRecord was answered");
    let posts = list_posts(&pds, &acct.did);
    assert_eq!(posts.len(), 1, "{posts:?}");
    let d = drafts(home.path());
    assert_eq!(d[0]["status"], "posted");
    assert_eq!(d[0]["uri"], posts[0]["uri"]);
}

/// A stand-in for crontab(1) keeping the table in `dir/crontab.txt`.
fn fake_crontab(dir: &Path, initial: &str) -> std::path::PathBuf {
    let tab = dir.join("crontab.txt");
    let stub = dir.join("crontab");
    std::fs::write(&tab, initial).unwrap();
    std::fs::write(
        &stub,
        format!(
            "#!/bin/sh\nif [ \"$1\" = -l ]; then cat '{0}'; else cat > '{0}'; fi\n",
            tab.display()
        ),
    )
    .unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    stub
}

/// Settings a scheduled run can use: handle and password file in the config.
fn schedulable(home: &Path) {
    let pw = home.join("app-password");
    std::fs::write(&pw, "xxxx-xxxx-xxxx-xxxx\n").unwrap();
    std::fs::write(
        home.join("config.toml"),
        format!(
            "[bluesky]\nhandle = \"me.test\"\npassword_file = {:?}\n",
            pw.display().to_string()
        ),
    )
    .unwrap();
}

/// What cron does to a command before the shell sees it: an unescaped `%` ends the command
/// (the rest becomes its stdin), `\%` is a plain `%`.
fn cron_command(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'%') => {
                out.push('%');
                chars.next();
            }
            '%' => break,
            c => out.push(c),
        }
    }
    out
}

/// 2. A newline in a value written into the crontab adds lines that run; a `%` cuts the
///    command; a control character breaks the plist. Control characters are refused naming the
///    variable, `%` is escaped so the command survives cron intact, and `remove` removes exactly
///    the block `install` wrote.
#[test]
fn crontab_injection_and_silently_broken_schedules() {
    let dir = tempfile::tempdir().unwrap();
    let stub = fake_crontab(dir.path(), "MAILTO=me\n");
    // a newline in BOT_HOME: refused, nothing written
    let evil_home = dir.path().join("home\n* * * * * touch /tmp/bot-injected #");
    std::fs::create_dir_all(&evil_home).unwrap();
    schedulable(&evil_home);
    for target in ["cron", "launchd"] {
        let out = local(&evil_home)
            .env("BOT_CRONTAB", &stub)
            .args([
                "schedule", "install", "--every", "1h", "--target", target, "--print",
            ])
            .output()
            .unwrap();
        assert_eq!(code(&out), 3, "{target}: {}", stderr(&out));
        assert!(stderr(&out).contains("BOT_HOME") && stderr(&out).contains("control character"));
        assert!(out.stdout.is_empty());
    }
    assert_eq!(
        std::fs::read_to_string(dir.path().join("crontab.txt")).unwrap(),
        "MAILTO=me\n"
    );

    // a `%` in BOT_HOME: installed escaped, and cron hands the shell the whole command
    let pct_home = dir.path().join("50%off");
    std::fs::create_dir_all(&pct_home).unwrap();
    schedulable(&pct_home);
    let run = |args: &[&str]| {
        local(&pct_home)
            .env("BOT_CRONTAB", &stub)
            .arg("schedule")
            .args(args)
            .output()
            .unwrap()
    };
    ok_stdout(run(&["install", "--every", "1h", "--target", "cron"]));
    let tab = std::fs::read_to_string(dir.path().join("crontab.txt")).unwrap();
    let lines: Vec<&str> = tab.lines().collect();
    assert_eq!(lines.len(), 3, "{tab}");
    let cmd = cron_command(lines[2]);
    assert!(cmd.ends_with(" 2>&1"), "cron would cut the command: {cmd}");
    assert!(cmd.contains("50%off"), "{cmd}");
    ok_stdout(run(&["remove", "--target", "cron"]));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("crontab.txt")).unwrap(),
        "MAILTO=me\n"
    );
}

/// 4. A redirect answering createSession must not carry the app password to another
///    address: the call fails (exit 3: fix the service) and the other address gets nothing.
#[test]
fn the_app_password_never_follows_a_redirect() {
    let elsewhere = TcpListener::bind("127.0.0.1:0").unwrap();
    let elsewhere_addr = elsewhere.local_addr().unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let r2 = reached.clone();
    std::thread::spawn(move || {
        for s in elsewhere.incoming().flatten() {
            r2.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    let front = TcpListener::bind("127.0.0.1:0").unwrap();
    let front_addr = front.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut s in front.incoming().flatten() {
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            while r.read_line(&mut line).unwrap_or(0) > 2 {
                line.clear();
            }
            let _ = write!(
                s,
                "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://{elsewhere_addr}/xrpc/com.atproto.server.createSession\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
    });
    let home = tempfile::tempdir().unwrap();
    let out = local(home.path())
        .env("BOT_BSKY_SERVICE", format!("http://{front_addr}"))
        .env("BOT_BSKY_HANDLE", "alice.test")
        .env("BOT_BSKY_APP_PASSWORD", "s3cret-pass-word")
        .arg("whoami")
        .output()
        .unwrap();
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("307") && stderr(&out).contains("redirect"),
        "{}",
        stderr(&out)
    );
    assert!(!stderr(&out).contains("s3cret"));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        reached.load(Ordering::SeqCst),
        0,
        "the redirect target was contacted"
    );
}

/// 5. `bot delete` deleted any record (the profile!) and said "deleted" for records that do
///    not exist. It deletes posts only, and says when there is nothing to delete.
#[test]
fn delete_deletes_only_posts_that_exist() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let acct = account(&pds);
    let home = tempfile::tempdir().unwrap();
    ok_stdout(
        bot(&pds.service, home.path(), &acct)
            .arg("label-bot")
            .output()
            .unwrap(),
    );
    let profile = format!("at://{}/app.bsky.actor.profile/self", acct.did);
    let out = bot(&pds.service, home.path(), &acct)
        .args(["delete", &profile])
        .output()
        .unwrap();
    assert_eq!(code(&out), 7, "{}", stderr(&out));
    assert!(stderr(&out).contains("posts only"), "{}", stderr(&out));
    // the profile (and its bot label) is still there
    ok_stdout(
        bot(&pds.service, home.path(), &acct)
            .arg("label-bot")
            .output()
            .unwrap(),
    )
    .contains("already");
    let missing = format!("at://{}/app.bsky.feed.post/3kaaaaaaaaaaa", acct.did);
    let out = bot(&pds.service, home.path(), &acct)
        .args(["delete", &missing])
        .output()
        .unwrap();
    assert_eq!(code(&out), 1);
    assert!(stderr(&out).contains("does not exist"), "{}", stderr(&out));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("deleted"));
}

/// 6. The oldest approved draft refused by the duplicate guard stalled every later draft (and
///    the message did not name it). It becomes `refused` with the reason and the next one goes.
#[test]
fn one_refused_draft_stalls_the_queue() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let acct = account(&pds);
    let home = tempfile::tempdir().unwrap();
    for seed in ["51", "52"] {
        ok_stdout(
            local(home.path())
                .args(["draft", "--seed", seed, "-q"])
                .output()
                .unwrap(),
        );
    }
    ok_stdout(
        local(home.path())
            .args(["queue", "approve", "1", "2"])
            .output()
            .unwrap(),
    );
    // the first draft's text is already on the account
    let first = drafts(home.path())[0]["text"].as_str().unwrap().to_string();
    ok_stdout(
        bot(&pds.service, home.path(), &acct)
            .args(["post", "--text", &first])
            .output()
            .unwrap(),
    );
    let out = bot(&pds.service, home.path(), &acct)
        .args(["post", "--next", "--json"])
        .output()
        .unwrap();
    let err = stderr(&out);
    let j: Value = serde_json::from_str(ok_stdout(out).trim()).unwrap();
    assert_eq!(j["draft"], 2, "the next draft went out");
    assert!(err.contains("draft 1 refused"), "{err}");
    let d = drafts(home.path());
    assert_eq!(d[0]["status"], "refused");
    assert!(
        d[0]["note"].as_str().unwrap().contains("similar"),
        "{}",
        d[0]
    );
    assert_eq!(d[1]["status"], "posted");
    // with only refused drafts left: exit 7 naming them; a person can approve again
    ok_stdout(
        local(home.path())
            .args(["queue", "approve", "1"])
            .output()
            .unwrap(),
    );
    let out = bot(&pds.service, home.path(), &acct)
        .args(["post", "--next"])
        .output()
        .unwrap();
    assert_eq!(code(&out), 7);
    assert!(stderr(&out).contains("draft 1"), "{}", stderr(&out));
}

/// 7. With the handle in BOT_BSKY_HANDLE (as the README shows), `schedule install` reported
///    success and every run failed; BOT_BSKY_SERVICE was dropped. The schedule carries the
///    environment's settings, and refuses (saying what) when a run could not log in.
#[test]
fn schedules_lose_env_based_settings() {
    let home = tempfile::tempdir().unwrap();
    let stub = fake_crontab(home.path(), "");
    let pw = home.path().join("pw");
    std::fs::write(&pw, "xxxx-xxxx-xxxx-xxxx").unwrap();
    let out = local(home.path())
        .env("BOT_CRONTAB", &stub)
        .env("BOT_BSKY_HANDLE", "me.test")
        .env("BOT_BSKY_SERVICE", "https://pds.example")
        .env("BOT_BSKY_PASSWORD_FILE", &pw)
        .env("BOT_BSKY_APP_PASSWORD", "s3cret")
        .args([
            "schedule", "install", "--every", "1h", "--target", "launchd", "--print",
        ])
        .output()
        .unwrap();
    let plist: plist::Value = plist::from_bytes(ok_stdout(out).as_bytes()).unwrap();
    let env = plist.as_dictionary().unwrap()["EnvironmentVariables"]
        .as_dictionary()
        .unwrap()
        .clone();
    assert_eq!(env["BOT_BSKY_HANDLE"].as_string(), Some("me.test"));
    assert_eq!(
        env["BOT_BSKY_SERVICE"].as_string(),
        Some("https://pds.example")
    );
    assert!(env.keys().all(|k| k != "BOT_BSKY_APP_PASSWORD"));
    // only the password variable: refused, naming password_file
    let out = local(home.path())
        .env("BOT_CRONTAB", &stub)
        .env("BOT_BSKY_HANDLE", "me.test")
        .env("BOT_BSKY_APP_PASSWORD", "s3cret")
        .args(["schedule", "install", "--every", "1h", "--target", "cron"])
        .output()
        .unwrap();
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    assert!(stderr(&out).contains("password_file"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("s3cret"));
    assert_eq!(
        std::fs::read_to_string(home.path().join("crontab.txt")).unwrap(),
        ""
    );
}

/// A scratch copy of the q4g64 model and the adapter.
fn scratch() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (model, adapter) = (tmp.path().join("model"), tmp.path().join("adapter"));
    for (src, dst) in [
        (fixtures().join("q4g64"), &model),
        (fixtures().join("adapter"), &adapter),
    ] {
        std::fs::create_dir_all(dst).unwrap();
        for e in std::fs::read_dir(src).unwrap().flatten() {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
    (tmp, model, adapter)
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn generate_with(model: &Path, adapter: Option<&Path>, extra: &[&str]) -> std::process::Output {
    let home = tempfile::tempdir().unwrap();
    let mut c = local(home.path());
    c.args(["generate", "--seed", "3", "--model"]).arg(model);
    match adapter {
        Some(a) => c.arg("--adapter").arg(a),
        None => c.arg("--no-adapter"),
    };
    c.args(extra).output().unwrap()
}

/// Overwrites the first f32 of a tensor in a safetensors file with `v`.
fn poke_f32(file: &Path, tensor: &str, v: f32) {
    let mut b = std::fs::read(file).unwrap();
    let hlen = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&b[8..8 + hlen]).unwrap();
    let t = &header[tensor];
    assert_eq!(t["dtype"], "F32", "{tensor}");
    let at = 8 + hlen + t["data_offsets"][0].as_u64().unwrap() as usize;
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    std::fs::write(file, b).unwrap();
}

/// Overwrites every element of a bf16 tensor with `bits`.
fn fill_bf16(file: &Path, tensor: &str, bits: u16) {
    let mut b = std::fs::read(file).unwrap();
    let hlen = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&b[8..8 + hlen]).unwrap();
    let t = &header[tensor];
    assert_eq!(t["dtype"], "BF16", "{tensor}");
    let (s, e) = (
        t["data_offsets"][0].as_u64().unwrap() as usize,
        t["data_offsets"][1].as_u64().unwrap() as usize,
    );
    for c in b[8 + hlen + s..8 + hlen + e].chunks_exact_mut(2) {
        c.copy_from_slice(&bits.to_le_bytes());
    }
    std::fs::write(file, b).unwrap();
}

/// 8. NaN/Inf adapters, norms and configs made garbage (280 `!`) that passed every check
///    with exit 0. Invalid values are refused at load naming the field or tensor (exit 3); a
///    model whose arithmetic still overflows stops with exit 5 and nothing on stdout.
#[test]
fn nan_inf_publishes_garbage() {
    let adapter_tensor = {
        let (_t, _m, a) = scratch();
        let f = std::fs::read(a.join("adapters.safetensors")).unwrap();
        let hlen = u64::from_le_bytes(f[..8].try_into().unwrap()) as usize;
        let h: serde_json::Map<String, Value> = serde_json::from_slice(&f[8..8 + hlen]).unwrap();
        h.keys().find(|k| k.ends_with("lora_a")).unwrap().clone()
    };
    type Spoil<'a> = Box<dyn Fn(&Path, &Path) + 'a>;
    let cases: Vec<(&str, Spoil, &str)> = vec![
        (
            "NaN adapter",
            Box::new(|_, a: &Path| {
                poke_f32(&a.join("adapters.safetensors"), &adapter_tensor, f32::NAN)
            }),
            "NaN",
        ),
        (
            "scale 1e308",
            Box::new(|_, a: &Path| {
                edit_json(&a.join("adapter_config.json"), |v| {
                    v["lora_parameters"]["scale"] = 1e308.into()
                })
            }),
            "lora_parameters.scale",
        ),
        (
            "rms_norm_eps -1",
            Box::new(|m: &Path, _| {
                edit_json(&m.join("config.json"), |v| {
                    v["rms_norm_eps"] = (-1.0).into()
                })
            }),
            "rms_norm_eps",
        ),
        (
            "rope_theta 0",
            Box::new(|m: &Path, _| {
                edit_json(&m.join("config.json"), |v| v["rope_theta"] = 0.0.into())
            }),
            "rope_theta",
        ),
        (
            "Inf norm weight",
            Box::new(|m: &Path, _| {
                fill_bf16(&m.join("model.safetensors"), "model.norm.weight", 0x7F80)
            }),
            "model.norm.weight",
        ),
    ];
    for (what, break_it, named) in cases {
        let (_t, m, a) = scratch();
        break_it(&m, &a);
        let out = generate_with(&m, Some(&a), &[]);
        assert_eq!(code(&out), 3, "{what}: {}", stderr(&out));
        assert!(stderr(&out).contains(named), "{what}: {}", stderr(&out));
        assert!(out.stdout.is_empty(), "{what}");
    }
    // scales that overflow f32 in the arithmetic pass every load check: exit 5, no post
    let (_t, m, _a) = scratch();
    fill_bf16(&m.join("model.safetensors"), "lm_head.scales", 0x7F7F);
    let out = generate_with(&m, None, &[]);
    assert_eq!(code(&out), 5, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("NaN/Inf logits at token 0"),
        "{}",
        stderr(&out)
    );
    assert!(out.stdout.is_empty());
}

/// 10. Crashes, hangs and unbounded waits from huge numbers: each is refused at once with
///     exit 2 and a message naming the flag.
#[test]
fn crashes_hangs_and_ooms_from_huge_numbers() {
    let home = tempfile::tempdir().unwrap();
    let q4 = fixtures().join("q4g64");
    let q4 = q4.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "debug",
                "forward",
                "--model",
                q4,
                "--ids",
                "1,2",
                "--steps",
                "18446744073709551615",
            ],
            "context",
        ),
        (
            vec!["generate", "--model", q4, "--threads", "100000"],
            "threads",
        ),
        (
            vec!["bench", "--model", q4, "--threads", "100000"],
            "--threads",
        ),
        (vec!["run", "--jitter", "100d"], "--jitter"),
        (
            vec![
                "schedule", "install", "--every", "1h", "--jitter", "2h", "--print",
            ],
            "--jitter",
        ),
        (
            vec!["schedule", "install", "--every", "1s", "--print"],
            "--every",
        ),
        (
            vec![
                "post",
                "--max-similarity",
                "NaN",
                "--text",
                "hi there",
                "--dry-run",
            ],
            "--max-similarity",
        ),
        (
            vec![
                "post",
                "--max-similarity",
                "2",
                "--text",
                "hi there",
                "--dry-run",
            ],
            "--max-similarity",
        ),
    ];
    schedulable(home.path());
    for (args, named) in cases {
        let out = local(home.path())
            .timeout(Duration::from_secs(30))
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(code(&out), 2, "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(named), "{args:?}: {}", stderr(&out));
    }
}

/// 10. A prompt longer than the model's context aborted allocating gigabytes; it is refused
///     with exit 2 before any work. (Within the context, prompts run in 512-token chunks.)
#[test]
fn prompt_past_the_context_is_refused_not_allocated() {
    let (_t, m, _a) = scratch();
    edit_json(&m.join("config.json"), |v| {
        v["max_position_embeddings"] = 600.into()
    });
    let words = vec!["word"; 2000].join(" ");
    let out = generate_with(&m, None, &["--prompt", &words]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("context of 600"), "{}", stderr(&out));
}

/// 12. Smaller defects: a config's unknown device was exit 1 (config is 3); a handle written
///     `@alice.test` logged in as `@alice.test`; NUL and ESC reached the server.
#[test]
fn smaller_defects_of_settings_and_text() {
    let home = tempfile::tempdir().unwrap();
    std::fs::write(home.path().join("config.toml"), "device = \"tpu\"\n").unwrap();
    let out = local(home.path())
        .args([
            "generate",
            "--model",
            fixtures().join("q4g64").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    assert!(stderr(&out).contains("device") && stderr(&out).contains("tpu"));
    let home = tempfile::tempdir().unwrap();
    // (NUL cannot be an argument; `record::check_text` refuses it like ESC: unit-tested)
    for bad in ["escape \u{1b}[31m red", "bell \u{7} here"] {
        let out = local(home.path())
            .args(["post", "--dry-run", "--text", bad])
            .output()
            .unwrap();
        assert_eq!(code(&out), 7, "{bad:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("control character"),
            "{}",
            stderr(&out)
        );
    }
    let out = local(home.path())
        .args(["config", "show"])
        .env("BOT_BSKY_HANDLE", "@alice.test")
        .output()
        .unwrap();
    assert!(ok_stdout(out).contains("\"alice.test\""));
}

/// 12. Against the PDS: `--handle @alice.test` logs in (it reported a wrong password).
#[test]
fn handle_with_at_sign_logs_in() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let acct = account(&pds);
    let home = tempfile::tempdir().unwrap();
    let out = bot(&pds.service, home.path(), &acct)
        .env_remove("BOT_BSKY_HANDLE")
        .args(["whoami", "--handle", &format!("@{}", acct.handle)])
        .output()
        .unwrap();
    let v: Value = serde_json::from_str(ok_stdout(out).trim()).unwrap();
    assert_eq!(v["did"], acct.did);
}

/// 12. A server that never answers: the error says it timed out, not "error sending request".
#[test]
fn timeouts_say_they_timed_out() {
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in silent.incoming().flatten() {
            let mut s = s;
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            held.push(s);
        }
    });
    let policy = bot::bluesky::xrpc::RetryPolicy {
        attempts: 1,
        request_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let x = bot::bluesky::xrpc::Xrpc::new(policy).unwrap();
    let e = x
        .call(
            &format!("http://{addr}"),
            "com.atproto.server.describeServer",
            bot::bluesky::xrpc::Call::Query(&[]),
            None,
            true,
        )
        .unwrap_err();
    assert!(e.to_string().contains("timed out"), "{e}");
}
