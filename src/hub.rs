//! Models and adapters named by Hugging Face repo id: fetched with the hf-hub crate into the
//! standard Hugging Face cache (`HF_HOME`, `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE`
//! honoured as `huggingface_hub` does), so mlx_lm and `bot` share downloads.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};

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
        let truthy =
            |v: String| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on");
        let cache = Cache::from_env();
        HubEnv {
            endpoint: std::env::var("HF_ENDPOINT")
                .ok()
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "https://huggingface.co".into())
                .trim_end_matches('/')
                .to_string(),
            offline: std::env::var("HF_HUB_OFFLINE").map(truthy).unwrap_or(false),
            token: std::env::var("HF_TOKEN")
                .ok()
                .filter(|s| !s.is_empty())
                .or_else(|| cache.token()),
            cache: cache.path().clone(),
        }
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
    let cached = cached_snapshot(spec, kind, &env.cache);
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

fn cached_snapshot(repo: &str, kind: Kind, cache: &Path) -> Option<PathBuf> {
    let path = Cache::new(cache.to_path_buf())
        .repo(Repo::new(repo.to_string(), RepoType::Model))
        .get(kind.marker())?;
    let dir = path.parent()?.to_path_buf();
    // A snapshot is only usable when its weights came down too.
    let has_weights = std::fs::read_dir(&dir)
        .ok()?
        .flatten()
        .any(|e| e.file_name().to_string_lossy().ends_with(".safetensors"));
    has_weights.then_some(dir)
}

fn classify(repo: &str, file: &str, env: &HubEnv, e: ApiError) -> HubError {
    if let ApiError::RequestError(inner) = &e {
        if let ureq::Error::Status(status, _) = inner.as_ref() {
            match *status {
                404 => {
                    return HubError::NotFound {
                        repo: repo.into(),
                        endpoint: env.endpoint.clone(),
                    }
                }
                401 | 403 => {
                    return HubError::Auth {
                        repo: repo.into(),
                        endpoint: env.endpoint.clone(),
                        status: *status,
                    }
                }
                _ => {}
            }
        }
    }
    HubError::Download {
        repo: repo.into(),
        file: file.into(),
        endpoint: env.endpoint.clone(),
        why: e.to_string(),
    }
}

fn download(
    repo: &str,
    kind: Kind,
    env: &HubEnv,
    verbose: bool,
    progress: bool,
) -> Result<PathBuf, HubError> {
    let api = ApiBuilder::from_cache(Cache::new(env.cache.clone()))
        .with_endpoint(env.endpoint.clone())
        .with_token(env.token.clone())
        .with_progress(progress)
        .with_retries(2)
        .build()
        .map_err(|e| classify(repo, "", env, e))?;
    let api_repo = api.repo(Repo::new(repo.to_string(), RepoType::Model));
    let info = api_repo
        .info()
        .map_err(|e| classify(repo, "(repo info)", env, e))?;
    let files: Vec<String> = info
        .siblings
        .into_iter()
        .map(|s| s.rfilename)
        .filter(|f| kind.wants(f))
        .collect();
    if !files.iter().any(|f| f == kind.marker()) {
        return Err(HubError::Incomplete {
            repo: repo.into(),
            endpoint: env.endpoint.clone(),
            what: kind.marker().into(),
        });
    }
    if !files.iter().any(|f| f.ends_with(".safetensors")) {
        return Err(HubError::Incomplete {
            repo: repo.into(),
            endpoint: env.endpoint.clone(),
            what: "safetensors weights".into(),
        });
    }
    let mut dir = None;
    let hf_repo = Repo::new(repo.to_string(), RepoType::Model);
    // The cached snapshot is current when its commit is the one the Hub reports now.
    let cached_sha =
        std::fs::read_to_string(env.cache.join(hf_repo.folder_name()).join("refs/main"));
    let current = cached_sha.is_ok_and(|s| s.trim() == info.sha);
    let cache = Cache::new(env.cache.clone()).repo(hf_repo.clone());
    let remote = api.repo(hf_repo);
    for f in &files {
        let path = match cache.get(f).filter(|_| current) {
            Some(p) => p,
            None => {
                if verbose {
                    eprintln!("downloading {repo}/{f} from {}", env.endpoint);
                }
                remote.download(f).map_err(|e| classify(repo, f, env, e))?
            }
        };
        if f == kind.marker() {
            dir = path.parent().map(Path::to_path_buf);
        }
    }
    dir.ok_or_else(|| HubError::Incomplete {
        repo: repo.into(),
        endpoint: env.endpoint.clone(),
        what: kind.marker().into(),
    })
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
}
