//! Scheduling (the service behind `bot run` and `bot schedule`): quiet hours and durations,
//! the run log, and rendering/installing a launchd agent (macOS) or a marked crontab entry
//! (elsewhere). Rendering is pure; installing is idempotent (the old entry is replaced).

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use crate::app::settings::Settings;

/// Another run holds the lock.
#[derive(Debug, thiserror::Error)]
#[error("another `bot run` for this profile is in progress (lock {0}); this one does nothing")]
pub struct Locked(pub PathBuf);

/// "90s", "10m", "1h", "1d" → duration.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 30m or 1h"))?;
    let secs = match unit {
        "s" => n,
        "m" | "" => n * 60,
        "h" => n * 3600,
        "d" => n * 86400,
        _ => return Err(format!("{s:?}: unit must be s, m, h or d")),
    };
    if secs == 0 {
        return Err(format!("{s:?} must be positive"));
    }
    Ok(Duration::from_secs(secs))
}

/// "23:00-08:00" → (start, end) minutes after midnight.
pub fn parse_quiet(s: &str) -> Result<(u32, u32), String> {
    let hm = |t: &str| -> Option<u32> {
        let (h, m) = t.trim().split_once(':')?;
        let (h, m): (u32, u32) = (h.parse().ok()?, m.parse().ok()?);
        (h < 24 && m < 60).then_some(h * 60 + m)
    };
    let (a, b) = s
        .split_once('-')
        .ok_or_else(|| format!("{s:?}: expected HH:MM-HH:MM"))?;
    Ok((
        hm(a).ok_or(format!("{a:?}: expected HH:MM"))?,
        hm(b).ok_or(format!("{b:?}: expected HH:MM"))?,
    ))
}

/// Whether `minute` (after local midnight) falls in the quiet window, which may wrap midnight.
pub fn in_quiet(minute: u32, (start, end): (u32, u32)) -> bool {
    if start <= end {
        minute >= start && minute < end
    } else {
        minute >= start || minute < end
    }
}

/// Before and after the jitter wait: whether the run may go on (both checks outside quiet
/// hours). The wait can carry a run into quiet hours, so the time is read again after it.
pub fn wait_outside_quiet(
    quiet: Option<(u32, u32)>,
    wait: Duration,
    now: &dyn Fn() -> u32,
    sleep: &dyn Fn(Duration),
) -> bool {
    let quiet_now = |q: Option<(u32, u32)>| q.is_some_and(|w| in_quiet(now(), w));
    if quiet_now(quiet) {
        return false;
    }
    if !wait.is_zero() {
        sleep(wait);
    }
    !quiet_now(quiet)
}

/// Longest `--jitter` accepted: a run holds its lock while it waits.
pub const MAX_JITTER: Duration = Duration::from_secs(6 * 3600);

pub fn local_minute() -> u32 {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as libc::time_t)
        .unwrap_or(0);
    // SAFETY: localtime_r writes only into `tm`.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    unsafe { libc::localtime_r(&now, &mut tm) };
    (tm.tm_hour * 60 + tm.tm_min) as u32
}

pub fn append_log(settings: &Settings, entry: serde_json::Value) -> anyhow::Result<()> {
    let path = settings.paths.data_dir.join("runs.jsonl");
    let mut f = OpenOptions::new().create(true).append(true).open(&path)?;
    // One write per line: concurrent appends do not interleave.
    f.write_all(format!("{entry}\n").as_bytes())?;
    Ok(())
}

/// What a schedule runs and where it logs.
pub struct Job {
    pub label: String,
    pub exe: PathBuf,
    pub args: Vec<String>,
    pub every: Duration,
    pub env: Vec<(String, String)>,
    pub log_path: PathBuf,
}

/// A value that cannot go into a crontab line or a plist: a control character (a newline
/// would start another crontab line; XML cannot hold most of them).
#[derive(Debug, thiserror::Error)]
#[error("{what} holds a control character ({value:?}): it cannot go into a schedule; use a path without one")]
pub struct UnsafeValue {
    pub what: String,
    pub value: String,
}

impl Job {
    /// Every value the renderers write is free of control characters.
    pub fn validate(&self) -> Result<(), UnsafeValue> {
        let check = |what: &str, v: &str| {
            if v.chars().any(char::is_control) {
                return Err(UnsafeValue {
                    what: what.to_string(),
                    value: v.to_string(),
                });
            }
            Ok(())
        };
        // the environment first: a bad BOT_HOME also spoils the log path, and is the cause
        for (k, v) in &self.env {
            check(k, k)?;
            check(k, v)?;
        }
        check("the label", &self.label)?;
        check(
            "the path of the bot executable",
            &self.exe.display().to_string(),
        )?;
        check("the log path", &self.log_path.display().to_string())?;
        for a in &self.args {
            check("an argument", a)?;
        }
        Ok(())
    }
}

/// Environment variables a scheduled run needs to see the settings this shell has: every
/// non-secret `BOT_*` setting (`settings::SETTINGS`), the Hugging Face cache and endpoint,
/// and PATH. The app password and HF_TOKEN are secrets and never go into a schedule.
pub fn schedule_env(env: &dyn Fn(&str) -> Option<String>) -> Vec<(String, String)> {
    let names = ["BOT_HOME", "BOT_CONFIG"]
        .into_iter()
        .chain(crate::app::settings::env_settings())
        .chain([
            "HF_HOME",
            "HF_HUB_CACHE",
            "HF_ENDPOINT",
            "HF_HUB_OFFLINE",
            "PATH",
        ]);
    names
        .filter_map(|k| env(k).filter(|v| !v.is_empty()).map(|v| (k.to_string(), v)))
        .collect()
}

/// What a scheduled run needs that this shell may have only in its environment: a handle,
/// and an app password it can read (a file: secrets never go into a schedule).
pub fn missing_for_runs(settings: &Settings) -> Vec<String> {
    let mut missing = Vec::new();
    if settings.handle.value.is_none() {
        missing.push(
            "a Bluesky handle: set `handle` under [bluesky] in the config, or BOT_BSKY_HANDLE"
                .into(),
        );
    }
    if settings.password_file.value.is_none() {
        missing.push(
            "an app password the runs can read: BOT_BSKY_APP_PASSWORD is never copied into a \
             schedule, so put the app password in a file of mode 0600 and set `password_file` \
             under [bluesky] (or BOT_BSKY_PASSWORD_FILE)"
                .into(),
        );
    }
    missing
}

pub fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The launchd agent property list (`validate` keeps control characters out of it).
pub fn render_plist(j: &Job) -> String {
    let mut s = String::from(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<!DOCTYPE plist PUBLIC \"-//Apple//DTD PLIST 1.0//EN\" \"http://www.apple.com/DTDs/PropertyList-1.0.dtd\">\n<plist version=\"1.0\">\n<dict>\n",
    );
    let kv = |s: &mut String, k: &str, v: &str| {
        s.push_str(&format!(
            "  <key>{k}</key>\n  <string>{}</string>\n",
            xml_escape(v)
        ))
    };
    kv(&mut s, "Label", &j.label);
    s.push_str("  <key>ProgramArguments</key>\n  <array>\n");
    for a in std::iter::once(j.exe.display().to_string()).chain(j.args.iter().cloned()) {
        s.push_str(&format!("    <string>{}</string>\n", xml_escape(&a)));
    }
    s.push_str("  </array>\n");
    s.push_str(&format!(
        "  <key>StartInterval</key>\n  <integer>{}</integer>\n",
        j.every.as_secs()
    ));
    s.push_str("  <key>RunAtLoad</key>\n  <false/>\n");
    kv(&mut s, "StandardOutPath", &j.log_path.display().to_string());
    kv(
        &mut s,
        "StandardErrorPath",
        &j.log_path.display().to_string(),
    );
    s.push_str("  <key>EnvironmentVariables</key>\n  <dict>\n");
    for (k, v) in &j.env {
        s.push_str(&format!(
            "    <key>{}</key>\n    <string>{}</string>\n",
            xml_escape(k),
            xml_escape(v)
        ));
    }
    s.push_str("  </dict>\n</dict>\n</plist>\n");
    s
}

pub fn shell_quote(s: &str) -> String {
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The crontab block: a marker comment and one line. cron turns an unescaped `%` in the
/// command into a newline, so every `%` is written `\%` (cron removes the backslash).
pub fn render_cron(j: &Job) -> Result<String, String> {
    j.validate().map_err(|e| e.to_string())?;
    let m = j.every.as_secs() / 60;
    let when = match m {
        1..=59 if 60_u64.is_multiple_of(m) => format!("*/{m} * * * *"),
        60 => "0 * * * *".into(),
        _ if m.is_multiple_of(60) && m / 60 < 24 && 24_u64.is_multiple_of(m / 60) => {
            format!("0 */{} * * *", m / 60)
        }
        1440 => "0 0 * * *".into(),
        _ => {
            return Err(format!(
                "cron cannot run every {m} minutes evenly: use a divisor of 60 minutes or 24 hours"
            ))
        }
    };
    let env: String = j
        .env
        .iter()
        .map(|(k, v)| format!("{k}={} ", shell_quote(v)))
        .collect();
    let args: Vec<String> = j.args.iter().map(|a| shell_quote(a)).collect();
    let command = format!(
        "{env}{} {} >> {} 2>&1",
        shell_quote(&j.exe.display().to_string()),
        args.join(" "),
        shell_quote(&j.log_path.display().to_string()),
    );
    Ok(format!(
        "# bot:{label} (managed by `bot schedule`; do not edit)\n{when} {}\n",
        command.replace('%', "\\%"),
        label = j.label
    ))
}

/// `crontab` (or `BOT_CRONTAB`, for tests and unusual systems).
pub fn crontab_cmd() -> String {
    std::env::var("BOT_CRONTAB").unwrap_or_else(|_| "crontab".into())
}

pub fn read_crontab() -> anyhow::Result<String> {
    let out = std::process::Command::new(crontab_cmd())
        .arg("-l")
        .output()?;
    // `crontab -l` fails when the user has no crontab yet: that is an empty one.
    Ok(if out.status.success() {
        String::from_utf8_lossy(&out.stdout).into_owned()
    } else {
        String::new()
    })
}

pub fn write_crontab(text: &str) -> anyhow::Result<()> {
    let mut child = std::process::Command::new(crontab_cmd())
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow::anyhow!("crontab stdin"))?
        .write_all(text.as_bytes())?;
    anyhow::ensure!(child.wait()?.success(), "crontab - failed");
    Ok(())
}

/// `crontab` text without this label's block.
pub fn without_block(crontab: &str, label: &str) -> String {
    let marker = format!("# bot:{label} ");
    let mut out = Vec::new();
    let mut skip_next = false;
    for line in crontab.lines() {
        if skip_next {
            skip_next = false;
            continue;
        }
        if line.starts_with(&marker) {
            skip_next = true;
            continue;
        }
        out.push(line);
    }
    let mut s = out.join("\n");
    if !s.is_empty() {
        s.push('\n');
    }
    s
}

pub fn plist_path(label: &str) -> anyhow::Result<PathBuf> {
    let home = directories::BaseDirs::new().ok_or_else(|| anyhow::anyhow!("no home directory"))?;
    Ok(home
        .home_dir()
        .join("Library/LaunchAgents")
        .join(format!("{label}.plist")))
}

pub fn launchctl(args: &[&str]) -> anyhow::Result<bool> {
    Ok(std::process::Command::new("launchctl")
        .args(args)
        .status()?
        .success())
}

#[cfg(test)]
mod tests {
    /// #18.9: quiet hours were checked only before the jitter wait, so a run that woke up
    /// inside them posted anyway. The time is read again after the wait.
    #[test]
    fn quiet_hours_are_checked_after_the_jitter_wait() {
        use std::cell::Cell;
        let quiet = Some(parse_quiet("23:00-08:00").unwrap());
        let clock = Cell::new(22 * 60 + 50);
        let slept = Cell::new(Duration::ZERO);
        let now = || clock.get();
        let sleep = |d: Duration| {
            slept.set(d);
            clock.set(clock.get() + (d.as_secs() / 60) as u32);
        };
        // 22:50 plus a 20-minute wait is 23:10: quiet
        assert!(!wait_outside_quiet(
            quiet,
            Duration::from_secs(20 * 60),
            &now,
            &sleep
        ));
        assert_eq!(slept.get(), Duration::from_secs(20 * 60));
        clock.set(12 * 60);
        assert!(wait_outside_quiet(
            quiet,
            Duration::from_secs(60),
            &now,
            &sleep
        ));
        clock.set(23 * 60 + 30);
        slept.set(Duration::ZERO);
        assert!(!wait_outside_quiet(
            quiet,
            Duration::from_secs(60),
            &now,
            &sleep
        ));
        assert_eq!(slept.get(), Duration::ZERO, "no wait when already quiet");
    }

    use super::*;

    fn job() -> Job {
        Job {
            label: "com.github.bot.default".into(),
            exe: "/usr/local/bin/bot".into(),
            args: vec![
                "run".into(),
                "--mode".into(),
                "queue".into(),
                "--quiet-hours".into(),
                "23:00-08:00".into(),
            ],
            every: Duration::from_secs(3600),
            env: vec![("BOT_HOME".into(), "/home/me/bot home".into())],
            log_path: "/home/me/bot home/schedule.log".into(),
        }
    }

    #[test]
    fn durations_and_quiet_hours() {
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert!(parse_duration("0m").is_err() && parse_duration("x").is_err());
        let w = parse_quiet("23:00-08:00").unwrap();
        assert!(in_quiet(23 * 60 + 30, w) && in_quiet(7 * 60, w) && !in_quiet(12 * 60, w));
        assert!(!in_quiet(8 * 60, w));
    }

    #[test]
    fn cron_line() {
        let c = render_cron(&job()).unwrap();
        let lines: Vec<&str> = c.lines().collect();
        assert_eq!(
            lines[0],
            "# bot:com.github.bot.default (managed by `bot schedule`; do not edit)"
        );
        assert_eq!(
            lines[1],
            "0 * * * * BOT_HOME='/home/me/bot home' /usr/local/bin/bot run --mode queue --quiet-hours 23:00-08:00 >> '/home/me/bot home/schedule.log' 2>&1"
        );
        let mut j = job();
        j.every = Duration::from_secs(1800);
        assert!(render_cron(&j).unwrap().contains("\n*/30 * * * * "));
        j.every = Duration::from_secs(7 * 60);
        assert!(render_cron(&j).is_err());
        // Replacing a block keeps the user's other lines.
        let tab = format!("MAILTO=me\n{c}5 4 * * * backup\n");
        assert_eq!(
            without_block(&tab, "com.github.bot.default"),
            "MAILTO=me\n5 4 * * * backup\n"
        );
    }
}
