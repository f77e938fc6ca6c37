//! The cached login: `session.json` in the profile's data dir, mode 0600, written atomically
//! (temp file + rename), guarded by an exclusive lock so two runs never refresh the same
//! (single-use) refresh token at once. Reusing it keeps scheduled runs far below
//! `createSession`'s limits (30 per 5 minutes, about 100 a day on bsky.social).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Clone, Serialize, Deserialize, PartialEq)]
pub struct Session {
    /// The login host (`--service`).
    pub service: String,
    /// Where the account's repo lives: the didDoc's PDS endpoint, else `service`.
    pub pds: String,
    pub did: String,
    pub handle: String,
    pub access_jwt: String,
    pub refresh_jwt: String,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Tokens are secrets: never in logs or panics.
        f.debug_struct("Session")
            .field("service", &self.service)
            .field("pds", &self.pds)
            .field("did", &self.did)
            .field("handle", &self.handle)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// From a createSession/refreshSession response.
    pub fn from_response(service: &str, v: &Value) -> Option<Session> {
        let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
        let pds = v
            .get("didDoc")
            .and_then(|d| d.get("service"))
            .and_then(Value::as_array)
            .and_then(|services| {
                services.iter().find(|s| {
                    s.get("id")
                        .and_then(Value::as_str)
                        .is_some_and(|id| id.ends_with("#atproto_pds"))
                })
            })
            .and_then(|s| s.get("serviceEndpoint").and_then(Value::as_str))
            .map(|s| s.trim_end_matches('/').to_string())
            .unwrap_or_else(|| service.trim_end_matches('/').to_string());
        Some(Session {
            service: service.trim_end_matches('/').to_string(),
            pds,
            did: s("did")?,
            handle: s("handle")?,
            access_jwt: s("accessJwt")?,
            refresh_jwt: s("refreshJwt")?,
        })
    }

    /// Whether the access token is past (or within `margin_s` of) its `exp` claim.
    pub fn access_expired(&self, now: SystemTime, margin_s: u64) -> bool {
        jwt_exp(&self.access_jwt).is_some_and(|exp| {
            let now = now
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            exp <= now + margin_s
        })
    }
}

/// The `exp` claim of a JWT (not verified: only used to refresh early).
pub fn jwt_exp(jwt: &str) -> Option<u64> {
    let payload = jwt.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice::<Value>(&bytes)
        .ok()?
        .get("exp")?
        .as_u64()
}

pub struct SessionStore {
    path: PathBuf,
    _lock: File,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("session file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Creates `path` (and parents) readable by the owner only.
pub fn private_dir(path: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Writes `data` to `path` atomically with mode 0600 from the first byte.
pub fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut opts = OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(&tmp)?;
    f.write_all(data)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)
}

impl SessionStore {
    /// Takes the session lock of `data_dir` (waits while another run holds it).
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
        private_dir(data_dir).map_err(io(data_dir))?;
        let lock_path = data_dir.join("session.lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        lock.lock().map_err(io(&lock_path))?;
        Ok(SessionStore {
            path: data_dir.join("session.json"),
            _lock: lock,
        })
    }

    /// The cached session for this service and handle, if any (a corrupt file is ignored).
    pub fn load(&self, service: &str, handle: &str) -> Option<Session> {
        let text = std::fs::read_to_string(&self.path).ok()?;
        let s: Session = serde_json::from_str(&text).ok()?;
        (s.service == service.trim_end_matches('/')
            && (s.handle.eq_ignore_ascii_case(handle) || s.did == handle))
            .then_some(s)
    }

    pub fn save(&self, s: &Session) -> Result<(), StoreError> {
        let data = serde_json::to_vec_pretty(s).map_err(|e| io(&self.path)(e.into()))?;
        write_private(&self.path, &data).map_err(io(&self.path))
    }

    pub fn clear(&self) -> Result<(), StoreError> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&self.path)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwt(exp: u64) -> String {
        let b = |v: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
        format!(
            "{}.{}.sig",
            b("{\"alg\":\"HS256\"}"),
            b(&format!("{{\"exp\":{exp}}}"))
        )
    }

    #[test]
    fn expiry_from_the_token() {
        let s = Session {
            service: "x".into(),
            pds: "x".into(),
            did: "d".into(),
            handle: "h".into(),
            access_jwt: jwt(1000),
            refresh_jwt: String::new(),
        };
        assert!(s.access_expired(UNIX_EPOCH + std::time::Duration::from_secs(990), 30));
        assert!(!s.access_expired(UNIX_EPOCH + std::time::Duration::from_secs(900), 30));
        assert!(!format!("{s:?}").contains(&s.access_jwt));
    }

    #[test]
    fn saved_private_and_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let store = SessionStore::open(dir.path()).unwrap();
        let s = Session {
            service: "http://h".into(),
            pds: "http://h".into(),
            did: "did:plc:x".into(),
            handle: "a.test".into(),
            access_jwt: jwt(1),
            refresh_jwt: "r".into(),
        };
        store.save(&s).unwrap();
        assert_eq!(store.load("http://h/", "A.test"), Some(s.clone()));
        assert_eq!(store.load("http://other", "a.test"), None);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("session.json"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}
