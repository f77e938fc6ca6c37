//! Models and adapters named by Hugging Face repo id, downloaded into the standard Hugging
//! Face cache layout (`models--OWNER--NAME/{blobs,snapshots/COMMIT,refs/main}`; `HF_HOME`,
//! `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` honoured as `huggingface_hub`
//! does), so mlx_lm and `bot` share downloads. Everything the server names that becomes part
//! of a path (commit, file names, ETags) is checked to be a plain token first: a hostile mirror
//! cannot write outside the cache. Redirects (the Hub sends large files to a CDN) are followed
//! by hand, and the token is only sent to the endpoint's own host. A 64-hex ETag is the file's
//! SHA-256 (Git LFS), and the download is checked against it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest, Sha256};

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "{repo} is not a local directory and is not in the Hugging Face cache ({cache}), and \
         HF_HUB_OFFLINE is set: run once online, or pass a local mlx_lm directory"
    )]
    OfflineNotCached { repo: String, cache: PathBuf },
    #[error(
        "{repo} was not found on {endpoint} (HTTP 404): check the repo id, or pass a local \
         directory (a path that does not exist is taken as a repo id)"
    )]
    NotFound { repo: String, endpoint: String },
    #[error(
        "{endpoint} refused access to {repo} (HTTP {status}): for a private or gated repo set \
         HF_TOKEN (or run `huggingface-cli login`) and accept the repo's terms on the Hub"
    )]
    Auth {
        repo: String,
        endpoint: String,
        status: u16,
    },
    #[error("cannot download {file} of {repo} from {endpoint}: {why} (set HF_HUB_OFFLINE=1 to use the cache only)")]
    Download {
        repo: String,
        file: String,
        endpoint: String,
        why: String,
    },
    #[error("{repo} on {endpoint} has no {what}")]
    Incomplete {
        repo: String,
        endpoint: String,
        what: String,
    },
    /// The server sent a name that would become a path outside the cache, or data that does
    /// not match what it announced.
    #[error("refusing {repo} from {endpoint}: {why}")]
    Untrusted {
        repo: String,
        endpoint: String,
        why: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Model,
    Adapter,
}

impl Kind {
    /// Files `bot` needs from a repo of this kind.
    fn wants(self, name: &str) -> bool {
        let top_level = !name.contains('/');
        match self {
            Kind::Model => {
                top_level
                    && (name.ends_with(".safetensors")
                        || matches!(
                            name,
                            "config.json"
                                | "generation_config.json"
                                | "tokenizer.json"
                                | "tokenizer_config.json"
                                | "special_tokens_map.json"
                                | "chat_template.jinja"
                                | "model.safetensors.index.json"
                        ))
            }
            Kind::Adapter => {
                top_level && (name == "adapter_config.json" || name.ends_with(".safetensors"))
            }
        }
    }

    /// The file whose presence marks a usable snapshot.
    fn marker(self) -> &'static str {
        match self {
            Kind::Model => "config.json",
            Kind::Adapter => "adapter_config.json",
        }
    }
}

/// Hub settings read from the environment, like `huggingface_hub`.
#[derive(Debug, Clone)]
pub struct HubEnv {
    pub endpoint: String,
    pub offline: bool,
    pub token: Option<String>,
    pub cache: PathBuf,
}

impl HubEnv {
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|s| !s.is_empty());
        let truthy =
            |v: String| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on");
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            directories::BaseDirs::new()
                .map(|b| b.home_dir().join(".cache/huggingface"))
                .unwrap_or_else(|| PathBuf::from(".cache/huggingface"))
        });
        let token = var("HF_TOKEN").or_else(|| {
            std::fs::read_to_string(hf_home.join("token"))
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        HubEnv {
            endpoint: var("HF_ENDPOINT")
                .unwrap_or_else(|| "https://huggingface.co".into())
                .trim_end_matches('/')
                .to_string(),
            offline: var("HF_HUB_OFFLINE").map(truthy).unwrap_or(false),
            token,
            cache: var("HF_HUB_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| hf_home.join("hub")),
        }
    }

    /// The cache folder of `repo` (a model repo).
    fn repo_dir(&self, repo: &str) -> PathBuf {
        self.cache
            .join(format!("models--{}", repo.replace('/', "--")))
    }
}

/// A repo id has the form `owner/name`, or a bare `name` for a few legacy repos. Anything that
/// exists on disk is a path.
pub fn looks_like_repo(spec: &str) -> bool {
    let parts: Vec<&str> = spec.split('/').collect();
    !spec.starts_with('.')
        && !spec.starts_with('/')
        && !spec.starts_with('~')
        && (1..=2).contains(&parts.len())
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
}

/// Where `spec` lives on disk: itself when it is a directory, else the cached snapshot of
/// the Hub repo it names (downloaded first unless offline).
/// `verbose` names each file as it is downloaded (stderr); `progress` adds a progress bar.
pub fn resolve(
    spec: &str,
    kind: Kind,
    env: &HubEnv,
    verbose: bool,
    progress: bool,
) -> Result<PathBuf, HubError> {
    let p = Path::new(spec);
    if p.is_dir() || !looks_like_repo(spec) {
        return Ok(p.to_path_buf());
    }
    let cached = cached_snapshot(spec, kind, env);
    if env.offline {
        return cached.ok_or_else(|| HubError::OfflineNotCached {
            repo: spec.into(),
            cache: env.cache.clone(),
        });
    }
    match download(spec, kind, env, verbose, progress) {
        Ok(dir) => Ok(dir),
        // Unreachable Hub with a complete cached copy: use it, like huggingface_hub does.
        Err(HubError::Download { why, .. }) if cached.is_some() => {
            eprintln!(
                "warning: {} unreachable ({why}); using the cached copy of {spec}",
                env.endpoint
            );
            Ok(cached.unwrap_or_default())
        }
        Err(e) => Err(e),
    }
}

/// The snapshot `refs/main` points at, when it has the kind's marker file and weights.
fn cached_snapshot(repo: &str, kind: Kind, env: &HubEnv) -> Option<PathBuf> {
    let dir = env.repo_dir(repo);
    let sha = std::fs::read_to_string(dir.join("refs/main")).ok()?;
    let sha = sha.trim();
    plain_commit(sha).ok()?;
    let snap = dir.join("snapshots").join(sha);
    if !snap.join(kind.marker()).is_file() {
        return None;
    }
    // A snapshot is only usable when its weights came down too.
    let has_weights = std::fs::read_dir(&snap)
        .ok()?
        .flatten()
        .any(|e| e.file_name().to_string_lossy().ends_with(".safetensors"));
    has_weights.then_some(snap)
}

/// A commit id the Hub reports: 40 (SHA-1) or 64 (SHA-256) lowercase hex digits.
fn plain_commit(s: &str) -> Result<(), String> {
    let hex = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if hex && (s.len() == 40 || s.len() == 64) {
        Ok(())
    } else {
        Err(format!("commit {s:?} is not a hex commit id"))
    }
}

/// An ETag that names a blob file: letters and digits only (the Hub's are hex digests).
fn plain_etag(s: &str) -> Result<(), String> {
    if (8..=128).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric()) {
        Ok(())
    } else {
        Err(format!(
            "ETag {s:?} is not a plain hex digest, so it cannot name a cache file"
        ))
    }
}

/// A file name in a repo that `bot` stores: one plain path component.
fn plain_file_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with('.')
        && !s.contains(['/', '\\'])
        && !s.chars().any(char::is_control)
}

struct Hub<'a> {
    http: reqwest::blocking::Client,
    env: &'a HubEnv,
    repo: &'a str,
}

impl Hub<'_> {
    fn err(&self, file: &str, why: impl Into<String>) -> HubError {
        HubError::Download {
            repo: self.repo.into(),
            file: file.into(),
            endpoint: self.env.endpoint.clone(),
            why: why.into(),
        }
    }

    fn untrusted(&self, why: impl Into<String>) -> HubError {
        HubError::Untrusted {
            repo: self.repo.into(),
            endpoint: self.env.endpoint.clone(),
            why: why.into(),
        }
    }

    /// GET `url`, following up to five redirects by hand; the token goes only to the
    /// endpoint's host. Returns the first response's headers (where the Hub puts the ETag of
    /// a redirected file) and the final response.
    fn get(
        &self,
        url: &str,
        file: &str,
    ) -> Result<(reqwest::header::HeaderMap, reqwest::blocking::Response), HubError> {
        let host = |u: &str| {
            reqwest::Url::parse(u)
                .ok()
                .and_then(|u| u.host_str().map(str::to_string))
        };
        let home = host(&self.env.endpoint);
        let mut url = url.to_string();
        let mut first = None;
        for _ in 0..6 {
            let mut req = self.http.get(&url);
            if let (Some(t), true) = (&self.env.token, host(&url) == home) {
                req = req.bearer_auth(t);
            }
            let resp = req.send().map_err(|e| self.err(file, describe(&e)))?;
            let status = resp.status();
            if first.is_none() {
                first = Some(resp.headers().clone());
            }
            if status.is_redirection() {
                let loc = resp
                    .headers()
                    .get(reqwest::header::LOCATION)
                    .and_then(|v| v.to_str().ok())
                    .ok_or_else(|| self.err(file, format!("HTTP {status} without a Location")))?;
                url = reqwest::Url::parse(&url)
                    .and_then(|base| base.join(loc))
                    .map_err(|e| self.err(file, format!("bad redirect {loc:?}: {e}")))?
                    .to_string();
                continue;
            }
            return match status.as_u16() {
                200..=299 => Ok((first.unwrap_or_default(), resp)),
                404 => Err(HubError::NotFound {
                    repo: self.repo.into(),
                    endpoint: self.env.endpoint.clone(),
                }),
                s @ (401 | 403) => Err(HubError::Auth {
                    repo: self.repo.into(),
                    endpoint: self.env.endpoint.clone(),
                    status: s,
                }),
                s => Err(self.err(file, format!("HTTP {s}"))),
            };
        }
        Err(self.err(file, "more than five redirects"))
    }

    /// The repo's current commit and the files of `kind` in it.
    fn info(&self, kind: Kind) -> Result<(String, Vec<String>), HubError> {
        let url = format!(
            "{}/api/models/{}/revision/main",
            self.env.endpoint, self.repo
        );
        let (_, resp) = self.get(&url, "(repo info)")?;
        let v: Value = resp
            .json()
            .map_err(|e| self.err("(repo info)", format!("not JSON: {e}")))?;
        let sha = v
            .get("sha")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        plain_commit(&sha).map_err(|e| self.untrusted(e))?;
        let files: Vec<String> = v
            .get("siblings")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.get("rfilename").and_then(Value::as_str))
                    .filter(|f| kind.wants(f))
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        if let Some(bad) = files.iter().find(|f| !plain_file_name(f)) {
            return Err(self.untrusted(format!("file name {bad:?} is not a plain file name")));
        }
        Ok((sha, files))
    }

    /// Downloads `file` of commit `sha` into `blobs/ETAG` (through a temporary file renamed
    /// into place, so a crash or a concurrent run never leaves half a blob) and links it from
    /// the snapshot.
    fn fetch(&self, sha: &str, file: &str, snap: &Path, progress: bool) -> Result<(), HubError> {
        let url = format!("{}/{}/resolve/{sha}/{file}", self.env.endpoint, self.repo);
        let (first, mut resp) = self.get(&url, file)?;
        let etag = first
            .get("x-linked-etag")
            .or_else(|| first.get(reqwest::header::ETAG))
            .and_then(|v| v.to_str().ok())
            .map(|e| {
                e.trim()
                    .trim_start_matches("W/")
                    .trim_matches('"')
                    .to_string()
            })
            .ok_or_else(|| self.err(file, "no ETag in the response"))?;
        plain_etag(&etag).map_err(|e| self.untrusted(e))?;
        let dir = self.env.repo_dir(self.repo);
        let blobs = dir.join("blobs");
        let io =
            |what: &Path, e: std::io::Error| self.err(file, format!("{}: {e}", what.display()));
        std::fs::create_dir_all(&blobs).map_err(|e| io(&blobs, e))?;
        std::fs::create_dir_all(snap).map_err(|e| io(snap, e))?;
        let blob = blobs.join(&etag);
        if !blob.is_file() {
            let tmp = blobs.join(format!("{etag}.{}.incomplete", std::process::id()));
            let len = resp.content_length();
            let bar = (progress && len.is_some()).then(|| {
                let b = indicatif::ProgressBar::new(len.unwrap_or(0));
                b.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
                b.set_message(file.to_string());
                b
            });
            let mut out = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
            let (mut hash, mut got, mut buf) = (Sha256::new(), 0u64, vec![0u8; 1 << 20]);
            loop {
                let n = resp
                    .read(&mut buf)
                    .map_err(|e| self.err(file, format!("reading: {e}")))?;
                if n == 0 {
                    break;
                }
                hash.update(&buf[..n]);
                out.write_all(&buf[..n]).map_err(|e| io(&tmp, e))?;
                got += n as u64;
                if let Some(b) = &bar {
                    b.set_position(got);
                }
            }
            if let Some(b) = bar {
                b.finish_and_clear();
            }
            out.sync_all().map_err(|e| io(&tmp, e))?;
            let check = match len {
                Some(l) if l != got => Err(self.err(file, format!("got {got} of {l} bytes"))),
                _ if etag.len() == 64
                    && format!("{:x}", hash.finalize()) != etag.to_ascii_lowercase() =>
                {
                    Err(self.untrusted(format!("{file}: content does not match its SHA-256 ETag")))
                }
                _ => Ok(()),
            };
            if let Err(e) = check {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            std::fs::rename(&tmp, &blob).map_err(|e| io(&blob, e))?;
        }
        let link = snap.join(file);
        let _ = std::fs::remove_file(&link);
        #[cfg(unix)]
        std::os::unix::fs::symlink(Path::new("../../blobs").join(&etag), &link)
            .map_err(|e| io(&link, e))?;
        #[cfg(not(unix))]
        std::fs::copy(&blob, &link).map_err(|e| io(&link, e))?;
        Ok(())
    }
}

/// What a transport error was, not reqwest's "error sending request for url".
fn describe(e: &reqwest::Error) -> String {
    let mut cause: &dyn std::error::Error = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    if e.is_timeout() {
        format!("timed out ({cause})")
    } else {
        cause.to_string()
    }
}

fn download(
    repo: &str,
    kind: Kind,
    env: &HubEnv,
    verbose: bool,
    progress: bool,
) -> Result<PathBuf, HubError> {
    let http = reqwest::blocking::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(30))
        .user_agent(concat!("bot/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| HubError::Download {
            repo: repo.into(),
            file: String::new(),
            endpoint: env.endpoint.clone(),
            why: e.to_string(),
        })?;
    let hub = Hub { http, env, repo };
    let (sha, files) = hub.info(kind)?;
    for (want, what) in [
        (kind.marker(), kind.marker()),
        (".safetensors", "safetensors weights"),
    ] {
        if !files
            .iter()
            .any(|f| f == want || (want.starts_with('.') && f.ends_with(want)))
        {
            return Err(HubError::Incomplete {
                repo: repo.into(),
                endpoint: env.endpoint.clone(),
                what: what.into(),
            });
        }
    }
    let snap = env.repo_dir(repo).join("snapshots").join(&sha);
    for f in &files {
        // a snapshot's file is current when its link resolves (the commit names the content)
        if snap.join(f).is_file() {
            continue;
        }
        if verbose {
            eprintln!("downloading {repo}/{f} from {}", env.endpoint);
        }
        hub.fetch(&sha, f, &snap, progress)?;
    }
    let refs = env.repo_dir(repo).join("refs");
    std::fs::create_dir_all(&refs)
        .and_then(|_| std::fs::write(refs.join("main"), &sha))
        .map_err(|e| hub.err("refs/main", e.to_string()))?;
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_paths() {
        assert!(looks_like_repo("lmstudio-community/Qwen3-8B-MLX-4bit"));
        assert!(looks_like_repo("gpt2"));
        assert!(!looks_like_repo("./models/x"));
        assert!(!looks_like_repo("/abs/path"));
        assert!(!looks_like_repo("a/b/c"));
        assert!(!looks_like_repo("~/m"));
    }

    #[test]
    fn names_from_the_server_must_be_plain() {
        assert!(plain_etag("0123456789abcdef0123456789abcdef").is_ok());
        for bad in [
            "/etc/passwd",
            "../../x",
            "abc/def",
            "",
            "a b c d e f g h",
            "...........",
        ] {
            assert!(plain_etag(bad).is_err(), "{bad}");
        }
        assert!(plain_commit("0123456789abcdef0123456789abcdef01234567").is_ok());
        assert!(plain_commit("main").is_err() && plain_commit("../0123").is_err());
        assert!(plain_file_name("model.safetensors"));
        for bad in ["../x.safetensors", "a/b", ".hidden", "x\ny", ""] {
            assert!(!plain_file_name(bad), "{bad:?}");
        }
    }
}
