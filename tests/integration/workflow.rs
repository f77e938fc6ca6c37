//! The review queue and scheduled runs: drafts from the fixture model, decisions, publishing
//! the next approved draft exactly once against the reference PDS, crash recovery, the
//! duplicate guard, the run lock, schedule rendering/installation and profiles.

use std::path::Path;
use std::time::Duration;

use assert_cmd::Command;
use serde_json::Value;

use crate::bluesky_pds::{account, bot, faulty_proxy, list_posts, ok_stdout, pds_from, Fault};
use crate::common::*;

fn local(home: &Path) -> Command {
    let mut c = Command::cargo_bin("bot").unwrap();
    c.env("BOT_HOME", home)
        .env("BOT_MODEL", fixtures().join("q4g64"))
        .env("BOT_ADAPTER", fixtures().join("adapter"))
        .env("HF_HUB_OFFLINE", "1")
        .timeout(Duration::from_secs(120));
    c
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

#[test]
fn review_and_queue_commands_follow_the_state_machine() {
    let home = tempfile::tempdir().unwrap();
    let ids = ok_stdout(
        local(home.path())
            .args(["draft", "-n", "3", "--seed", "11", "-q"])
            .output()
            .unwrap(),
    );
    assert_eq!(ids.lines().count(), 3);
    // Review from a script: approve the first, reject the second, skip the third.
    let out = local(home.path())
        .arg("review")
        .write_stdin("a\nr\ns\n")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let d = drafts(home.path());
    let status: Vec<&str> = d.iter().map(|x| x["status"].as_str().unwrap()).collect();
    assert_eq!(status, vec!["approved", "rejected", "new"]);
    assert!(d[0]["raw"].is_string() && d[0]["seed"] == 11);
    // queue approve/reject; an impossible move fails with the config exit code.
    ok_stdout(
        local(home.path())
            .args(["queue", "reject", "1"])
            .output()
            .unwrap(),
    );
    let out = local(home.path())
        .args(["queue", "approve", "99"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    ok_stdout(
        local(home.path())
            .args(["queue", "clear"])
            .output()
            .unwrap(),
    );
    assert!(
        drafts(home.path()).is_empty(),
        "new and rejected drafts are cleared"
    );
    // generate --save feeds the queue too.
    ok_stdout(
        local(home.path())
            .args(["generate", "--save", "-q", "--seed", "5"])
            .output()
            .unwrap(),
    );
    assert_eq!(drafts(home.path()).len(), 1);
}

#[test]
fn profiles_keep_separate_queues() {
    let home = tempfile::tempdir().unwrap();
    std::fs::write(
        home.path().join("config.toml"),
        "[profiles.a]\n[profiles.b]\n",
    )
    .unwrap();
    ok_stdout(
        local(home.path())
            .args(["--profile", "a", "draft", "-q", "--seed", "1"])
            .output()
            .unwrap(),
    );
    let list = |p: &str| {
        ok_stdout(
            local(home.path())
                .args(["--profile", p, "queue", "list"])
                .output()
                .unwrap(),
        )
    };
    assert_eq!(list("a").lines().count(), 1);
    assert_eq!(list("b").lines().count(), 0);
    assert!(home.path().join("profiles/a/bot.sqlite3").exists());
}

#[test]
fn a_held_run_lock_gives_its_exit_code() {
    let home = tempfile::tempdir().unwrap();
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(home.path().join("run.lock"))
        .unwrap();
    lock.lock().unwrap();
    let out = local(home.path())
        .args(["run", "--mode", "queue"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(8),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(lock);
}

#[test]
fn schedule_print_install_show_remove() {
    let home = tempfile::tempdir().unwrap();
    // A stand-in for crontab(1) that keeps the table in a file.
    let tab = home.path().join("crontab.txt");
    let stub = home.path().join("crontab");
    std::fs::write(&tab, "MAILTO=me\n5 4 * * * backup\n").unwrap();
    std::fs::write(
        &stub,
        format!(
            "#!/bin/sh\nif [ \"$1\" = -l ]; then cat {0}; else cat > {0}; fi\n",
            tab.display()
        ),
    )
    .unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    // what a scheduled run needs: a handle and a password it can read (a file)
    let pw = home.path().join("app-password");
    std::fs::write(&pw, "xxxx-xxxx-xxxx-xxxx\n").unwrap();
    let sched = |args: &[&str]| {
        let mut c = local(home.path());
        c.env("BOT_CRONTAB", &stub)
            .env("BOT_BSKY_APP_PASSWORD", "s3cret-app-pass")
            .env("BOT_BSKY_HANDLE", "me.test")
            .env("BOT_BSKY_PASSWORD_FILE", &pw)
            .arg("schedule")
            .args(args);
        c.output().unwrap()
    };
    let plist = ok_stdout(sched(&[
        "install", "--every", "2h", "--jitter", "10m", "--print", "--target", "launchd",
    ]));
    for key in [
        "<key>Label</key>",
        "<key>ProgramArguments</key>",
        "<key>StartInterval</key>",
        "<integer>7200</integer>",
        "<key>StandardOutPath</key>",
        "<key>EnvironmentVariables</key>",
        "<key>BOT_HOME</key>",
    ] {
        assert!(plist.contains(key), "{key} missing:\n{plist}");
    }
    assert!(!plist.contains("s3cret"), "no secrets in the plist");
    // It is a property list launchd can read: parse it and check the keys' values.
    let v: plist::Value = plist::from_bytes(plist.as_bytes()).expect("a valid property list");
    let d = v.as_dictionary().expect("a top-level dict");
    assert_eq!(d["Label"].as_string(), Some("com.github.bot.default"));
    assert_eq!(d["StartInterval"].as_signed_integer(), Some(7200));
    let argv: Vec<&str> = d["ProgramArguments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_string().unwrap())
        .collect();
    assert!(argv[0].ends_with("bot"), "{argv:?}");
    assert!(
        argv.windows(2).any(|w| w == ["--mode", "queue"]),
        "{argv:?}"
    );
    assert!(
        argv.windows(2).any(|w| w == ["--jitter", "10m"]),
        "{argv:?}"
    );
    let env = d["EnvironmentVariables"].as_dictionary().unwrap();
    assert_eq!(
        env["BOT_HOME"].as_string(),
        Some(home.path().to_str().unwrap())
    );
    // the password file's path travels, the password never does
    assert!(env.keys().all(|k| k != "BOT_BSKY_APP_PASSWORD"), "{env:?}");
    assert_eq!(env["BOT_BSKY_PASSWORD_FILE"].as_string(), pw.to_str());
    for k in ["StandardOutPath", "StandardErrorPath"] {
        assert!(d[k]
            .as_string()
            .unwrap()
            .starts_with(home.path().to_str().unwrap()));
    }
    let cron = ok_stdout(sched(&[
        "install", "--every", "30m", "--print", "--target", "cron",
    ]));
    assert!(
        cron.lines()
            .nth(1)
            .unwrap()
            .starts_with("*/30 * * * * BOT_HOME="),
        "{cron}"
    );
    assert!(cron.contains(" run --mode queue >> "));
    // Installing twice leaves one entry and the user's own lines.
    for _ in 0..2 {
        let out = sched(&["install", "--every", "1h", "--target", "cron"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let t = std::fs::read_to_string(&tab).unwrap();
    assert_eq!(t.matches("# bot:com.github.bot.default").count(), 1, "{t}");
    assert!(t.starts_with("MAILTO=me\n5 4 * * * backup\n"));
    assert!(t.contains("\n0 * * * * "));
    assert!(ok_stdout(sched(&["show", "--target", "cron"])).contains("run --mode queue"));
    for _ in 0..2 {
        assert!(sched(&["remove", "--target", "cron"]).status.success());
    }
    assert_eq!(
        std::fs::read_to_string(&tab).unwrap(),
        "MAILTO=me\n5 4 * * * backup\n"
    );
}

/// Two `bot post --next` at once publish the one approved draft exactly once; an interrupted
/// send (a `pending` history row, as a SIGKILL between write and answer leaves it) is settled
/// by the next run without loss or duplication; the duplicate guard refuses a repeat.
#[test]
fn queue_publishing_is_exactly_once() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let acct = account(&pds);
    let home = tempfile::tempdir().unwrap();
    let with_pds = |c: &mut Command| {
        c.env("BOT_BSKY_SERVICE", &pds.service)
            .env("BOT_BSKY_HANDLE", &acct.handle)
            .env("BOT_BSKY_APP_PASSWORD", &acct.app_password);
    };
    ok_stdout(
        local(home.path())
            .args(["draft", "-n", "2", "--seed", "21", "-q"])
            .output()
            .unwrap(),
    );
    ok_stdout(
        local(home.path())
            .args(["queue", "approve", "1"])
            .output()
            .unwrap(),
    );
    let spawn = || {
        let mut c = std::process::Command::new(assert_cmd::cargo::cargo_bin("bot"));
        c.env("BOT_HOME", home.path())
            .env("BOT_BSKY_SERVICE", &pds.service)
            .env("BOT_BSKY_HANDLE", &acct.handle)
            .env("BOT_BSKY_APP_PASSWORD", &acct.app_password)
            .args(["post", "--next"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        c.spawn().unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(
        a.status.success() && b.status.success(),
        "{} / {}",
        String::from_utf8_lossy(&a.stderr),
        String::from_utf8_lossy(&b.stderr)
    );
    let uris: Vec<String> = [&a, &b]
        .iter()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    assert_eq!(uris.len(), 1, "exactly one run published");
    assert_eq!(list_posts(&pds, &acct.did).len(), 1);
    let d = drafts(home.path());
    assert_eq!(d[0]["status"], "posted");
    assert_eq!(d[0]["uri"], uris[0].as_str());

    // An interrupted send of draft 2: its record key is in the history as pending, and the
    // record did not land. The next run marks it failed and publishes the draft once.
    ok_stdout(
        local(home.path())
            .args(["queue", "approve", "2"])
            .output()
            .unwrap(),
    );
    {
        let store = bot::app::store::Store::open(home.path()).unwrap();
        store
            .add_pending(&bot::app::store::NewPost {
                account: &acct.did,
                service: &pds.service,
                rkey: "3kzzzzzzzzzz2",
                text: d[1]["text"].as_str().unwrap(),
                record: "{}",
                created_at: "2026-01-01T00:00:00.000Z",
                draft_id: Some(2),
            })
            .unwrap();
        assert!(
            store.next_approved().unwrap().is_none(),
            "an in-flight draft is not offered"
        );
    }
    let mut c = bot(&pds.service, home.path(), &acct);
    with_pds(&mut c);
    ok_stdout(c.args(["post", "--next"]).output().unwrap());
    assert_eq!(list_posts(&pds, &acct.did).len(), 2);
    assert_eq!(drafts(home.path())[1]["status"], "posted");
    let store = bot::app::store::Store::open(home.path()).unwrap();
    assert_eq!(
        store
            .count_posts(bot::app::store::PostStatus::Failed)
            .unwrap(),
        1
    );
    assert_eq!(
        store
            .count_posts(bot::app::store::PostStatus::Pending)
            .unwrap(),
        0
    );

    // Nothing left: exit 0, nothing on stdout, a line in the run log.
    let out = bot(&pds.service, home.path(), &acct)
        .args(["run", "--mode", "queue"])
        .output()
        .unwrap();
    assert!(out.status.success() && out.stdout.is_empty());
    let log = ok_stdout(local(home.path()).arg("log").output().unwrap());
    assert!(log.contains("\"result\":\"idle\""), "{log}");

    // The same text again is refused by the duplicate guard.
    let text = drafts(home.path())[0]["text"].as_str().unwrap().to_string();
    let out = bot(&pds.service, home.path(), &acct)
        .args(["post", "--text", &text])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("similar"));
    assert_eq!(list_posts(&pds, &acct.did).len(), 2);

    // The training-data check: a memorized span is refused, an original text goes out.
    let train = home.path().join("train.jsonl");
    std::fs::write(
        &train,
        r#"{"messages":[{"role":"user","content":"Write a post."},{"role":"assistant","content":"Spent the whole weekend rewriting the parser and it is finally twice as fast."}]}"#,
    )
    .unwrap();
    let guarded = |text: &str| {
        bot(&pds.service, home.path(), &acct)
            .args(["post", "--training-data"])
            .arg(&train)
            .args(["--text", text])
            .output()
            .unwrap()
    };
    let out = guarded(
        "News: spent the whole weekend rewriting the parser and it is finally twice as fast!",
    );
    assert_eq!(out.status.code(), Some(7));
    assert!(String::from_utf8_lossy(&out.stderr).contains("training data"));
    assert_eq!(list_posts(&pds, &acct.did).len(), 2);
    ok_stdout(guarded(
        "A quiet evening with a good book and no compiler errors.",
    ));
    assert_eq!(list_posts(&pds, &acct.did).len(), 3);
}

/// A `bot post --next` killed with SIGKILL while its createRecord is in flight (applied by
/// the PDS or not) leaves the draft recoverable; the rerun settles it: one record, the draft
/// `posted` with that record's uri, nothing lost, nothing sent twice.
#[test]
fn sigkill_mid_send_neither_loses_nor_duplicates() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    for forward in [true, false] {
        let acct = account(&pds);
        let home = tempfile::tempdir().unwrap();
        ok_stdout(
            local(home.path())
                .args(["draft", "--seed", "31", "-q"])
                .output()
                .unwrap(),
        );
        ok_stdout(
            local(home.path())
                .args(["queue", "approve", "1"])
                .output()
                .unwrap(),
        );
        let (proxy, creates, handled) = faulty_proxy(&pds.service, Fault::Hold { forward });
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
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        assert_eq!(creates.load(std::sync::atomic::Ordering::SeqCst), 1);
        let landed = if forward { 1 } else { 0 };
        assert_eq!(
            list_posts(&pds, &acct.did).len(),
            landed,
            "forward={forward}"
        );
        let d = drafts(home.path());
        assert_eq!(d.len(), 1, "the draft survives the kill");
        assert_eq!(d[0]["status"], "approved", "forward={forward}");

        let out = bot(&pds.service, home.path(), &acct)
            .args(["post", "--next"])
            .output()
            .unwrap();
        ok_stdout(out);
        let posts = list_posts(&pds, &acct.did);
        assert_eq!(posts.len(), 1, "forward={forward}: {posts:?}");
        let d = drafts(home.path());
        assert_eq!(d[0]["status"], "posted");
        assert_eq!(d[0]["uri"], posts[0]["uri"]);
        assert_eq!(posts[0]["value"]["text"], d[0]["text"]);
    }
}

/// Two profiles with two accounts: each keeps its own session file, queue and history, and
/// each posts to its own account.
#[test]
fn two_profiles_keep_separate_sessions_and_accounts() {
    let Some(pds) = pds_from("BSKY_SERVICE") else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let (a, b) = (account(&pds), account(&pds));
    let pw = |name: &str, acct: &crate::bluesky_pds::Account| {
        let f = home.path().join(format!("{name}.pw"));
        std::fs::write(&f, &acct.app_password).unwrap();
        f
    };
    let (pa, pb) = (pw("a", &a), pw("b", &b));
    std::fs::write(
        home.path().join("config.toml"),
        format!(
            "[profiles.a.bluesky]\nhandle = \"{}\"\npassword_file = \"{}\"\n\
             [profiles.b.bluesky]\nhandle = \"{}\"\npassword_file = \"{}\"\n",
            a.handle,
            pa.display(),
            b.handle,
            pb.display()
        ),
    )
    .unwrap();
    let post = |profile: &str, text: &str| {
        let mut c = local(home.path());
        c.env("BOT_BSKY_SERVICE", &pds.service)
            .env("BOT_RETRY_TOTAL_S", "20")
            .args(["--profile", profile, "post", "--text", text]);
        ok_stdout(c.output().unwrap()).trim().to_string()
    };
    let ua = post("a", "from profile a");
    let ub = post("b", "from profile b");
    assert!(ua.contains(&a.did), "{ua}");
    assert!(ub.contains(&b.did), "{ub}");
    assert_eq!(list_posts(&pds, &a.did).len(), 1);
    assert_eq!(list_posts(&pds, &b.did).len(), 1);
    let session = |p: &str| -> Value {
        let f = home.path().join("profiles").join(p).join("session.json");
        serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap()
    };
    assert_eq!(session("a")["did"], a.did.as_str());
    assert_eq!(session("b")["did"], b.did.as_str());
    // Second posts reuse each profile's own session (the password files are gone).
    std::fs::remove_file(&pa).unwrap();
    std::fs::remove_file(&pb).unwrap();
    post("a", "again from a");
    post("b", "again from b");
    assert_eq!(list_posts(&pds, &a.did).len(), 2);
    assert_eq!(list_posts(&pds, &b.did).len(), 2);
    for p in ["a", "b"] {
        let store = bot::app::store::Store::open(&home.path().join("profiles").join(p)).unwrap();
        assert_eq!(
            store
                .count_posts(bot::app::store::PostStatus::Posted)
                .unwrap(),
            2,
            "profile {p}"
        );
    }
    assert!(!home.path().join("session.json").exists());
}

/// `bot review` in a real pseudo-terminal: edit in $EDITOR, approve, regenerate, skip, reject.
#[cfg(unix)]
#[test]
fn review_in_a_pseudo_terminal() {
    use std::os::unix::fs::PermissionsExt;
    let home = tempfile::tempdir().unwrap();
    ok_stdout(
        local(home.path())
            .args(["draft", "-n", "3", "--seed", "41", "-q"])
            .output()
            .unwrap(),
    );
    // An editor that rewrites the file it is given, as a user would.
    let editor = home.path().join("editor.sh");
    std::fs::write(
        &editor,
        "#!/bin/sh\nprintf 'Edited in the editor, kept as typed.\\n' > \"$1\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&editor, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("bot"));
    cmd.env("BOT_HOME", home.path())
        .env("BOT_MODEL", fixtures().join("q4g64"))
        .env("BOT_ADAPTER", fixtures().join("adapter"))
        .env("HF_HUB_OFFLINE", "1")
        .env("EDITOR", &editor)
        .env_remove("VISUAL")
        .args(["review", "--seed", "77"]);
    let mut p = rexpect::session::spawn_command(cmd, Some(120_000)).unwrap();
    p.exp_string("#1 (").unwrap();
    p.exp_string("[q]uit > ").unwrap();
    p.send_line("e").unwrap();
    p.exp_string("Edited in the editor, kept as typed.")
        .unwrap();
    p.exp_string("[q]uit > ").unwrap();
    p.send_line("a").unwrap();
    p.exp_string("#2 (").unwrap();
    p.exp_string("[q]uit > ").unwrap();
    p.send_line("g").unwrap();
    // The replacement comes up at once, before the drafts that were waiting.
    p.exp_string("#4 (").unwrap();
    p.exp_string("[q]uit > ").unwrap();
    p.send_line("s").unwrap();
    p.exp_string("#3 (").unwrap();
    p.exp_string("[q]uit > ").unwrap();
    p.send_line("r").unwrap();
    p.exp_string("1 approved draft(s) waiting").unwrap();
    p.exp_eof().unwrap();
    let d = drafts(home.path());
    let status: Vec<&str> = d.iter().map(|x| x["status"].as_str().unwrap()).collect();
    assert_eq!(status, vec!["approved", "rejected", "rejected", "new"]);
    assert_eq!(d[0]["text"], "Edited in the editor, kept as typed.");
    assert_ne!(d[0]["raw"], d[0]["text"], "the model's raw output is kept");
    assert_eq!(
        d[3]["seed"], 77,
        "the regenerated draft uses the review's seed"
    );
}
