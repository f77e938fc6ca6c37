//! The sandbox's own PDS: the reference `@atproto/pds` with a `@did-plc/server` directory, on
//! loopback, run by the launcher the tests use (`.ci/pds/pds-server.mjs`), installed from the
//! npm registry on first use (Node 22 as the `node-<os>-<arch>` package, then the PDS packages).
//! Its data lives under the sandbox's state and survives restarts: the PLC directory keeps no
//! data of its own, so the members' DID operations are saved when their accounts are made and
//! replayed into it on every start (they are signed, so the same DIDs come back).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::Value;

use crate::bluesky::xrpc::{Call, Xrpc};

const LAUNCHER: &str = include_str!("../../.ci/pds/pds-server.mjs");
const NODE_VERSION: &str = "22.23.3";
const PACKAGES: &[&str] = &[
    "@atproto/pds@0.5.35",
    "@did-plc/server@0.0.1",
    "@did-plc/lib",
];

/// Where Node and the packages are installed (shared by every sandbox of the user):
/// BOT_SANDBOX_PDS_DIR, else the user's cache directory.
pub fn install_dir() -> anyhow::Result<PathBuf> {
    if let Some(d) =
        crate::app::settings::process_env("BOT_SANDBOX_PDS_DIR").filter(|d| !d.is_empty())
    {
        return Ok(PathBuf::from(d));
    }
    let dirs = directories::ProjectDirs::from("", "", "bot")
        .ok_or_else(|| anyhow::anyhow!("no home directory to install the sandbox's PDS under"))?;
    Ok(dirs.cache_dir().join("local-pds"))
}

fn node_package() -> anyhow::Result<String> {
    let os = match std::env::consts::OS {
        "linux" => "linux",
        "macos" => "darwin",
        other => anyhow::bail!("the sandbox's PDS runs on Linux and macOS, not {other}"),
    };
    let arch = match std::env::consts::ARCH {
        "x86_64" => "x64",
        "aarch64" => "arm64",
        other => anyhow::bail!("no Node package for {other}"),
    };
    Ok(format!("node-{os}-{arch}"))
}

fn node_bin(dir: &Path) -> PathBuf {
    dir.join("node22/package/bin/node")
}

fn run(c: &mut Command, what: &str) -> anyhow::Result<()> {
    let st = c
        .stdout(Stdio::null())
        .status()
        .with_context(|| format!("{what}: could not start it (is npm installed?)"))?;
    anyhow::ensure!(st.success(), "{what} failed ({st})");
    Ok(())
}

/// Node 22 and the PDS packages, from the npm registry, unless they are there.
pub fn install(dir: &Path) -> anyhow::Result<()> {
    let node_dir = dir.join("node22");
    if !node_bin(dir).exists() {
        std::fs::create_dir_all(&node_dir)?;
        let pkg = node_package()?;
        eprintln!("installing Node {NODE_VERSION} ({pkg}) from the npm registry");
        run(
            Command::new("npm")
                .args(["pack", "--silent", &format!("{pkg}@{NODE_VERSION}")])
                .current_dir(&node_dir),
            "npm pack",
        )?;
        run(
            Command::new("tar")
                .args(["xzf", &format!("{pkg}-{NODE_VERSION}.tgz")])
                .current_dir(&node_dir),
            "unpacking Node",
        )?;
    }
    let pds = dir.join("pds");
    let built = pds.join("node_modules/better-sqlite3/build/Release/better_sqlite3.node");
    if !built.exists() || !pds.join("node_modules/@did-plc/server").exists() {
        std::fs::create_dir_all(&pds)?;
        if !pds.join("package.json").exists() {
            std::fs::write(
                pds.join("package.json"),
                "{\"name\":\"local-pds\",\"private\":true}\n",
            )?;
        }
        eprintln!(
            "installing {} from the npm registry (a few minutes)",
            PACKAGES.join(" ")
        );
        let bin = node_dir.join("package/bin");
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut c = Command::new("npm");
        c.args(["install", "--no-audit", "--no-fund"])
            .args(PACKAGES)
            .current_dir(&pds)
            .env("PATH", path)
            .env("npm_config_nodedir", node_dir.join("package"))
            .stderr(Stdio::inherit());
        run(&mut c, "npm install")?;
    }
    Ok(())
}

/// The running PDS of a sandbox whose state is `state`.
pub struct Running {
    pub service: String,
    pub plc: String,
    pub pid: u32,
}

fn healthy(x: &Xrpc, service: &str) -> bool {
    x.call(service, "_health", Call::Query(&[]), None, true)
        .is_ok()
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

pub fn read_pid(state: &Path) -> Option<u32> {
    std::fs::read_to_string(state.join("pds.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Starts the PDS on `port` (the PLC directory on `port - 1`) with its data in `state`,
/// unless it runs already; replays the saved DID operations.
pub fn start(dir: &Path, state: &Path, port: u16, x: &Xrpc) -> anyhow::Result<Running> {
    let service = format!("http://127.0.0.1:{port}");
    let plc = format!("http://127.0.0.1:{}", port - 1);
    if let Some(pid) = read_pid(state).filter(|p| pid_alive(*p)) {
        if healthy(x, &service) {
            return Ok(Running { service, plc, pid });
        }
    }
    install(dir)?;
    crate::bluesky::session::private_dir(state)?;
    let launcher = dir.join("pds").join("bot-sandbox-pds.mjs");
    std::fs::write(&launcher, LAUNCHER)?;
    let secret_file = state.join("jwt-secret");
    if !secret_file.exists() {
        let secret: String = (0..32)
            .map(|_| format!("{:02x}", rand::random::<u8>()))
            .collect();
        crate::bluesky::session::write_private(&secret_file, secret.as_bytes())?;
    }
    let secret = std::fs::read_to_string(&secret_file)?;
    let log = std::fs::File::create(state.join("pds.log"))?;
    let mut c = Command::new(node_bin(dir));
    c.arg(&launcher)
        .current_dir(dir.join("pds"))
        .env("PDS_PORT", port.to_string())
        .env("PLC_PORT", (port - 1).to_string())
        .env("PDS_DATA_DIR", state.join("data"))
        .env("PDS_PIDFILE", state.join("pds.pid"))
        .env("PDS_JWT_SECRET", secret.trim())
        .env("RATE_LIMITS", "0")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // its own process group: the PDS outlives this command and a Ctrl-C in its terminal
        c.process_group(0);
    }
    let child = c.spawn().context("starting the sandbox's PDS")?;
    let pid = child.id();
    let t = Instant::now();
    while !healthy(x, &service) {
        if t.elapsed() > Duration::from_secs(60) || !pid_alive(pid) {
            let log = std::fs::read_to_string(state.join("pds.log")).unwrap_or_default();
            anyhow::bail!("the sandbox's PDS did not come up on {service}:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    replay_ops(state, &plc)?;
    Ok(Running { service, plc, pid })
}

/// Stops the sandbox's PDS if it runs; whether it did.
pub fn stop(state: &Path) -> anyhow::Result<bool> {
    let Some(pid) = read_pid(state).filter(|p| pid_alive(*p)) else {
        return Ok(false);
    };
    // SAFETY: a plain SIGTERM to the PDS this sandbox started (its pid file)
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let t = Instant::now();
    while pid_alive(pid) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = std::fs::remove_file(state.join("pds.pid"));
    Ok(true)
}

fn http() -> anyhow::Result<reqwest::blocking::Client> {
    Ok(reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()?)
}

/// Saves `did`'s operations (its audit log on the PLC directory) for replay after a restart.
pub fn save_ops(state: &Path, plc: &str, did: &str) -> anyhow::Result<()> {
    let ops: Value = http()?
        .get(format!("{plc}/{did}/log"))
        .send()?
        .error_for_status()?
        .json()?;
    let path = state.join("plc-ops.jsonl");
    let mut text = std::fs::read_to_string(&path).unwrap_or_default();
    for op in ops.as_array().into_iter().flatten() {
        text.push_str(&serde_json::json!({ "did": did, "op": op }).to_string());
        text.push('\n');
    }
    crate::bluesky::session::write_private(&path, text.as_bytes())?;
    Ok(())
}

fn replay_ops(state: &Path, plc: &str) -> anyhow::Result<()> {
    let Ok(text) = std::fs::read_to_string(state.join("plc-ops.jsonl")) else {
        return Ok(());
    };
    let client = http()?;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).context("plc-ops.jsonl")?;
        let did = v["did"].as_str().unwrap_or_default();
        let r = client.post(format!("{plc}/{did}")).json(&v["op"]).send()?;
        // an operation the directory has already (it kept running) is refused: fine
        if !r.status().is_success() && r.status().as_u16() != 400 {
            anyhow::bail!("replaying {did}'s DID operation: {}", r.status());
        }
    }
    Ok(())
}
