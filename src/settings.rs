//! Effective settings: command-line flags > environment (`BOT_*`) > the TOML config file >
//! defaults, each value remembering where it came from (`bot config show`). `BOT_HOME`
//! relocates every file `bot` reads or writes; otherwise the platform's config and data
//! directories (the `directories` crate) are used.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize;

pub const DEFAULT_MODEL: &str = "lmstudio-community/Qwen3-8B-MLX-4bit";
/// More worker threads than this is a typo (each is a real OS thread).
pub const MAX_THREADS: usize = 1024;
/// Longest post generation asked for (a post is at most 300 graphemes).
pub const MAX_NEW_TOKENS: usize = 8192;
pub const DEFAULT_SERVICE: &str = "https://bsky.social";

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {why}")]
    Parse { path: PathBuf, why: String },
    #[error("{origin}: invalid value {value:?} for {field}: {why}")]
    Value {
        origin: String,
        field: String,
        value: String,
        why: String,
    },
    #[error("no home directory found: set BOT_HOME to a directory for bot's files")]
    NoHome,
    #[error("profile {name:?} is not defined in {path} (add a [profiles.{name}] table)")]
    UnknownProfile { name: String, path: PathBuf },
    #[error("{0}")]
    Missing(String),
}

/// The `BOT_*` variables that carry settings (not secrets): what a schedule passes on.
pub const ENV_SETTINGS: &[&str] = &[
    "BOT_MODEL",
    "BOT_ADAPTER",
    "BOT_PROMPTS",
    "BOT_SYSTEM",
    "BOT_TEMPERATURE",
    "BOT_TOP_P",
    "BOT_MIN_P",
    "BOT_TOP_K",
    "BOT_REPETITION_PENALTY",
    "BOT_MAX_TOKENS",
    "BOT_MIN_CHARS",
    "BOT_ATTEMPTS",
    "BOT_DEVICE",
    "BOT_THREADS",
    "BOT_BSKY_SERVICE",
    "BOT_BSKY_HANDLE",
    "BOT_BSKY_PASSWORD_FILE",
    "BOT_LANGS",
];

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Default,
    File(PathBuf),
    Env(&'static str),
    Flag,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => write!(f, "default"),
            Source::File(p) => write!(f, "{}", p.display()),
            Source::Env(name) => write!(f, "env {name}"),
            Source::Flag => write!(f, "command line"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sourced<T> {
    pub value: T,
    pub source: Source,
}

/// The config file. Unknown keys are errors so that a typo does not silently do nothing.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub model: Option<String>,
    pub adapter: Option<String>,
    pub prompts: Option<PathBuf>,
    pub system: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    pub max_tokens: Option<usize>,
    pub min_chars: Option<usize>,
    pub attempts: Option<usize>,
    pub device: Option<String>,
    pub threads: Option<usize>,
    pub bluesky: Option<BlueskyFile>,
    /// `[profiles.NAME]`: a named bot overriding any of the keys above.
    #[serde(default)]
    pub profiles: BTreeMap<String, FileConfig>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlueskyFile {
    pub service: Option<String>,
    pub handle: Option<String>,
    /// A file holding the app password (should be mode 0600).
    pub password_file: Option<PathBuf>,
    pub langs: Option<Vec<String>>,
}

impl FileConfig {
    pub fn parse(path: &Path, text: &str) -> Result<Self, SettingsError> {
        toml::from_str(text).map_err(|e| SettingsError::Parse {
            path: path.to_path_buf(),
            why: e.to_string(),
        })
    }

    /// `self` with the profile's keys laid over it.
    fn with_profile(&self, p: &FileConfig) -> FileConfig {
        let b = self.bluesky.clone().unwrap_or_default();
        let pb = p.bluesky.clone().unwrap_or_default();
        FileConfig {
            model: p.model.clone().or(self.model.clone()),
            adapter: p.adapter.clone().or(self.adapter.clone()),
            prompts: p.prompts.clone().or(self.prompts.clone()),
            system: p.system.clone().or(self.system.clone()),
            temperature: p.temperature.or(self.temperature),
            top_p: p.top_p.or(self.top_p),
            min_p: p.min_p.or(self.min_p),
            top_k: p.top_k.or(self.top_k),
            repetition_penalty: p.repetition_penalty.or(self.repetition_penalty),
            max_tokens: p.max_tokens.or(self.max_tokens),
            min_chars: p.min_chars.or(self.min_chars),
            attempts: p.attempts.or(self.attempts),
            device: p.device.clone().or(self.device.clone()),
            threads: p.threads.or(self.threads),
            bluesky: Some(BlueskyFile {
                service: pb.service.or(b.service),
                handle: pb.handle.or(b.handle),
                password_file: pb.password_file.or(b.password_file),
                langs: pb.langs.or(b.langs),
            }),
            profiles: BTreeMap::new(),
        }
    }
}

/// Where `bot` keeps its files.
#[derive(Debug, Clone)]
pub struct Paths {
    pub config_file: PathBuf,
    /// State of the selected profile: sessions, drafts, history, logs.
    pub data_dir: PathBuf,
    /// Where an adapter is looked for when none is configured.
    pub default_adapter: PathBuf,
}

impl Paths {
    pub fn new(
        bot_home: Option<&Path>,
        config_flag: Option<&Path>,
        profile: Option<&str>,
    ) -> Result<Self, SettingsError> {
        let (config_dir, data_root) = match bot_home {
            Some(h) => (h.to_path_buf(), h.to_path_buf()),
            None => {
                let d =
                    directories::ProjectDirs::from("", "", "bot").ok_or(SettingsError::NoHome)?;
                (d.config_dir().to_path_buf(), d.data_dir().to_path_buf())
            }
        };
        let data_dir = match profile {
            Some(p) => data_root.join("profiles").join(p),
            None => data_root,
        };
        Ok(Paths {
            config_file: config_flag
                .map(Path::to_path_buf)
                .unwrap_or_else(|| config_dir.join("config.toml")),
            default_adapter: data_dir.join("adapter"),
            data_dir,
        })
    }
}

/// Values given on the command line (None = not given).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub model: Option<String>,
    pub adapter: Option<String>,
    pub prompts: Option<PathBuf>,
    pub system: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    pub max_tokens: Option<usize>,
    pub min_chars: Option<usize>,
    pub attempts: Option<usize>,
    pub device: Option<String>,
    pub threads: Option<usize>,
    pub service: Option<String>,
    pub handle: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub paths: Paths,
    pub profile: Option<String>,
    /// Whether the config file existed.
    pub config_found: bool,
    pub model: Sourced<String>,
    pub adapter: Sourced<Option<String>>,
    pub prompts: Sourced<Option<PathBuf>>,
    pub system: Sourced<Option<String>>,
    pub temperature: Sourced<f32>,
    pub top_p: Sourced<f32>,
    pub min_p: Sourced<f32>,
    pub top_k: Sourced<usize>,
    pub repetition_penalty: Sourced<Option<f32>>,
    pub max_tokens: Sourced<usize>,
    pub min_chars: Sourced<usize>,
    pub attempts: Sourced<usize>,
    pub device: Sourced<String>,
    pub threads: Sourced<Option<usize>>,
    pub service: Sourced<String>,
    pub handle: Sourced<Option<String>>,
    pub password_file: Sourced<Option<PathBuf>>,
    pub langs: Sourced<Vec<String>>,
}

/// One layer lookup: flag, then env, then file, then default.
struct Layers<'a> {
    env: &'a dyn Fn(&str) -> Option<String>,
    file_path: PathBuf,
}

impl Layers<'_> {
    fn pick<T: FromStr + Clone>(
        &self,
        field: &str,
        flag: Option<T>,
        env: &'static str,
        file: Option<T>,
        default: T,
    ) -> Result<Sourced<T>, SettingsError>
    where
        T::Err: fmt::Display,
    {
        Ok(self.pick_opt(field, flag, env, file)?.unwrap_or(Sourced {
            value: default,
            source: Source::Default,
        }))
    }

    fn pick_opt<T: FromStr + Clone>(
        &self,
        field: &str,
        flag: Option<T>,
        env: &'static str,
        file: Option<T>,
    ) -> Result<Option<Sourced<T>>, SettingsError>
    where
        T::Err: fmt::Display,
    {
        if let Some(v) = flag {
            return Ok(Some(Sourced {
                value: v,
                source: Source::Flag,
            }));
        }
        if let Some(raw) = (self.env)(env).filter(|s| !s.is_empty()) {
            let v = raw.parse::<T>().map_err(|e| SettingsError::Value {
                origin: format!("environment variable {env}"),
                field: field.into(),
                value: raw.clone(),
                why: e.to_string(),
            })?;
            return Ok(Some(Sourced {
                value: v,
                source: Source::Env(env),
            }));
        }
        Ok(file.map(|v| Sourced {
            value: v,
            source: Source::File(self.file_path.clone()),
        }))
    }
}

fn lift<T>(s: Option<Sourced<T>>) -> Sourced<Option<T>> {
    match s {
        Some(s) => Sourced {
            value: Some(s.value),
            source: s.source,
        },
        None => Sourced {
            value: None,
            source: Source::Default,
        },
    }
}

impl Settings {
    /// Reads the config file (if any) and layers flags and environment over it.
    pub fn load(
        config_flag: Option<&Path>,
        profile_flag: Option<&str>,
        o: &Overrides,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, SettingsError> {
        let profile = profile_flag
            .map(str::to_string)
            .or_else(|| env("BOT_PROFILE").filter(|s| !s.is_empty()));
        if let Some(p) = &profile {
            if p.is_empty()
                || !p
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(SettingsError::Value {
                    origin: "profile".into(),
                    field: "profile".into(),
                    value: p.clone(),
                    why: "use letters, digits, '-' and '_'".into(),
                });
            }
        }
        let home = env("BOT_HOME").filter(|s| !s.is_empty()).map(PathBuf::from);
        let config_flag = config_flag.map(Path::to_path_buf).or_else(|| {
            env("BOT_CONFIG")
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
        });
        let paths = Paths::new(home.as_deref(), config_flag.as_deref(), profile.as_deref())?;
        let (file, config_found) = match std::fs::read_to_string(&paths.config_file) {
            Ok(text) => (FileConfig::parse(&paths.config_file, &text)?, true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && config_flag.is_none() => {
                (FileConfig::default(), false)
            }
            Err(e) => {
                return Err(SettingsError::Read {
                    path: paths.config_file.clone(),
                    source: e,
                })
            }
        };
        let file = match &profile {
            Some(name) => match file.profiles.get(name) {
                Some(p) => file.with_profile(p),
                None => {
                    return Err(SettingsError::UnknownProfile {
                        name: name.clone(),
                        path: paths.config_file.clone(),
                    })
                }
            },
            None => file,
        };
        Self::layer(paths, profile, config_found, file, o, env)
    }

    fn layer(
        paths: Paths,
        profile: Option<String>,
        config_found: bool,
        f: FileConfig,
        o: &Overrides,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, SettingsError> {
        let l = Layers {
            env,
            file_path: paths.config_file.clone(),
        };
        let b = f.bluesky.clone().unwrap_or_default();
        let adapter = match l.pick_opt(
            "adapter",
            o.adapter.clone(),
            "BOT_ADAPTER",
            f.adapter.clone(),
        )? {
            Some(a) => Sourced {
                value: Some(a.value),
                source: a.source,
            },
            // The conventional place, when the user put an adapter there.
            None if paths.default_adapter.join("adapter_config.json").is_file() => Sourced {
                value: Some(paths.default_adapter.display().to_string()),
                source: Source::Default,
            },
            None => lift(None),
        };
        let langs = match env("BOT_LANGS").filter(|s| !s.is_empty()) {
            Some(v) => Sourced {
                value: v.split(',').map(|s| s.trim().to_string()).collect(),
                source: Source::Env("BOT_LANGS"),
            },
            None => match b.langs.clone() {
                Some(v) => Sourced {
                    value: v,
                    source: Source::File(paths.config_file.clone()),
                },
                None => Sourced {
                    value: vec!["en".into()],
                    source: Source::Default,
                },
            },
        };
        let s = Settings {
            model: l.pick(
                "model",
                o.model.clone(),
                "BOT_MODEL",
                f.model.clone(),
                DEFAULT_MODEL.into(),
            )?,
            adapter,
            prompts: lift(l.pick_opt(
                "prompts",
                o.prompts.clone(),
                "BOT_PROMPTS",
                f.prompts.clone(),
            )?),
            system: lift(l.pick_opt("system", o.system.clone(), "BOT_SYSTEM", f.system.clone())?),
            temperature: l.pick(
                "temperature",
                o.temperature,
                "BOT_TEMPERATURE",
                f.temperature,
                0.95,
            )?,
            top_p: l.pick("top_p", o.top_p, "BOT_TOP_P", f.top_p, 0.9)?,
            min_p: l.pick("min_p", o.min_p, "BOT_MIN_P", f.min_p, 0.0)?,
            top_k: l.pick("top_k", o.top_k, "BOT_TOP_K", f.top_k, 0)?,
            repetition_penalty: lift(l.pick_opt(
                "repetition_penalty",
                o.repetition_penalty,
                "BOT_REPETITION_PENALTY",
                f.repetition_penalty,
            )?),
            max_tokens: l.pick(
                "max_tokens",
                o.max_tokens,
                "BOT_MAX_TOKENS",
                f.max_tokens,
                280,
            )?,
            min_chars: l.pick("min_chars", o.min_chars, "BOT_MIN_CHARS", f.min_chars, 30)?,
            attempts: l.pick("attempts", o.attempts, "BOT_ATTEMPTS", f.attempts, 5)?,
            device: l.pick(
                "device",
                o.device.clone(),
                "BOT_DEVICE",
                f.device.clone(),
                "auto".into(),
            )?,
            threads: lift(l.pick_opt("threads", o.threads, "BOT_THREADS", f.threads)?),
            service: l.pick(
                "bluesky.service",
                o.service.clone(),
                "BOT_BSKY_SERVICE",
                b.service.clone(),
                DEFAULT_SERVICE.into(),
            )?,
            handle: lift(l.pick_opt(
                "bluesky.handle",
                o.handle.clone(),
                "BOT_BSKY_HANDLE",
                b.handle.clone(),
            )?),
            password_file: lift(l.pick_opt(
                "bluesky.password_file",
                None,
                "BOT_BSKY_PASSWORD_FILE",
                b.password_file.clone(),
            )?),
            langs,
            paths,
            profile,
            config_found,
        };
        let mut s = s;
        s.validate()?;
        // `@alice.bsky.social`, as handles are written in posts, is the handle `alice.bsky.social`
        if let Some(h) = &mut s.handle.value {
            *h = h.trim().trim_start_matches('@').to_string();
        }
        Ok(s)
    }

    /// Values that parse but cannot work, refused here with where they came from.
    fn validate(&self) -> Result<(), SettingsError> {
        fn bad<T: fmt::Display>(s: &Sourced<T>, field: &str, why: &str) -> SettingsError {
            SettingsError::Value {
                origin: s.source.to_string(),
                field: field.into(),
                value: s.value.to_string(),
                why: why.into(),
            }
        }
        if self.attempts.value == 0 {
            return Err(bad(&self.attempts, "attempts", "at least 1"));
        }
        if !matches!(
            self.device.value.as_str(),
            "auto" | "cpu" | "cuda" | "metal"
        ) {
            return Err(bad(
                &self.device,
                "device",
                "expected auto, cpu, cuda or metal",
            ));
        }
        if let Some(n) = self.threads.value {
            if !(1..=MAX_THREADS).contains(&n) {
                let why = format!("expected 1 to {MAX_THREADS} worker threads");
                return Err(SettingsError::Value {
                    origin: self.threads.source.to_string(),
                    field: "threads".into(),
                    value: n.to_string(),
                    why,
                });
            }
        }
        if self.max_tokens.value == 0 || self.max_tokens.value > MAX_NEW_TOKENS {
            let why = format!("expected 1 to {MAX_NEW_TOKENS} tokens");
            return Err(bad(&self.max_tokens, "max_tokens", &why));
        }
        for (v, field) in [
            (&self.temperature, "temperature"),
            (&self.top_p, "top_p"),
            (&self.min_p, "min_p"),
        ] {
            let ok =
                v.value.is_finite() && v.value >= 0.0 && (field == "temperature" || v.value <= 1.0);
            if !ok {
                let why = if field == "temperature" {
                    "a finite number >= 0"
                } else {
                    "a number in [0, 1]"
                };
                return Err(bad(v, field, why));
            }
        }
        if let Some(p) = self.repetition_penalty.value {
            if !(p.is_finite() && p >= 0.0) {
                return Err(SettingsError::Value {
                    origin: self.repetition_penalty.source.to_string(),
                    field: "repetition_penalty".into(),
                    value: p.to_string(),
                    why: "a finite number >= 0".into(),
                });
            }
        }
        Ok(())
    }

    /// `bot config show`: every effective value with its source; secrets never printed.
    pub fn render(&self, password_from_env: bool) -> String {
        let mut out = String::new();
        let mut line = |k: &str, v: String, src: &Source| {
            out.push_str(&format!("{k:<22} = {v:<48} # {src}\n"));
        };
        let q = |s: &str| format!("{s:?}");
        let opt = |s: &Option<String>| s.as_deref().map(q).unwrap_or_else(|| "(none)".into());
        let path_opt = |p: &Option<PathBuf>| {
            p.as_ref()
                .map(|p| q(&p.display().to_string()))
                .unwrap_or_else(|| "(none)".into())
        };
        line(
            "config_file",
            format!(
                "{}{}",
                q(&self.paths.config_file.display().to_string()),
                if self.config_found {
                    ""
                } else {
                    " (not found)"
                }
            ),
            &Source::Default,
        );
        line(
            "data_dir",
            q(&self.paths.data_dir.display().to_string()),
            &Source::Default,
        );
        line("profile", opt(&self.profile), &Source::Default);
        line("model", q(&self.model.value), &self.model.source);
        line("adapter", opt(&self.adapter.value), &self.adapter.source);
        line(
            "prompts",
            path_opt(&self.prompts.value),
            &self.prompts.source,
        );
        line("system", opt(&self.system.value), &self.system.source);
        line(
            "temperature",
            self.temperature.value.to_string(),
            &self.temperature.source,
        );
        line("top_p", self.top_p.value.to_string(), &self.top_p.source);
        line("min_p", self.min_p.value.to_string(), &self.min_p.source);
        line("top_k", self.top_k.value.to_string(), &self.top_k.source);
        line(
            "repetition_penalty",
            self.repetition_penalty
                .value
                .map(|v| v.to_string())
                .unwrap_or_else(|| "(none)".into()),
            &self.repetition_penalty.source,
        );
        line(
            "max_tokens",
            self.max_tokens.value.to_string(),
            &self.max_tokens.source,
        );
        line(
            "min_chars",
            self.min_chars.value.to_string(),
            &self.min_chars.source,
        );
        line(
            "attempts",
            self.attempts.value.to_string(),
            &self.attempts.source,
        );
        line("device", q(&self.device.value), &self.device.source);
        line(
            "threads",
            self.threads
                .value
                .map(|v| v.to_string())
                .unwrap_or_else(|| "(all cores)".into()),
            &self.threads.source,
        );
        line(
            "bluesky.service",
            q(&self.service.value),
            &self.service.source,
        );
        line(
            "bluesky.handle",
            opt(&self.handle.value),
            &self.handle.source,
        );
        line(
            "bluesky.langs",
            format!("{:?}", self.langs.value),
            &self.langs.source,
        );
        line(
            "bluesky.password_file",
            path_opt(&self.password_file.value),
            &self.password_file.source,
        );
        let pw = if password_from_env {
            (
                "******** (set)".to_string(),
                Source::Env("BOT_BSKY_APP_PASSWORD"),
            )
        } else {
            ("(not set)".to_string(), Source::Default)
        };
        line("bluesky.app_password", pw.0, &pw.1);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn precedence_flag_env_file_default() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().to_str().unwrap().to_string();
        std::fs::write(
            dir.path().join("config.toml"),
            "temperature = 0.5\ntop_p = 0.7\nmodel = \"file/model\"\n[bluesky]\nhandle = \"me.test\"\n",
        )
        .unwrap();
        let env = env_of(&[
            ("BOT_HOME", &home),
            ("BOT_TOP_P", "0.8"),
            ("BOT_MODEL", "env/model"),
        ]);
        let o = Overrides {
            model: Some("flag/model".into()),
            ..Overrides::default()
        };
        let s = Settings::load(None, None, &o, &env).unwrap();
        assert_eq!(s.model.value, "flag/model");
        assert_eq!(s.model.source, Source::Flag);
        assert_eq!(s.top_p.value, 0.8);
        assert_eq!(s.top_p.source, Source::Env("BOT_TOP_P"));
        assert_eq!(s.temperature.value, 0.5);
        assert!(matches!(s.temperature.source, Source::File(_)));
        assert_eq!(s.max_tokens.value, 280);
        assert_eq!(s.max_tokens.source, Source::Default);
        assert_eq!(s.handle.value.as_deref(), Some("me.test"));
        assert_eq!(s.paths.data_dir, dir.path());
    }

    #[test]
    fn profiles_override_and_separate_state() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().to_str().unwrap().to_string();
        std::fs::write(
            dir.path().join("config.toml"),
            "temperature = 0.5\n[bluesky]\nhandle = \"a.test\"\n[profiles.b]\ntemperature = 0.7\n[profiles.b.bluesky]\nhandle = \"b.test\"\n",
        )
        .unwrap();
        let env = env_of(&[("BOT_HOME", &home), ("BOT_PROFILE", "b")]);
        let s = Settings::load(None, None, &Overrides::default(), &env).unwrap();
        assert_eq!(s.temperature.value, 0.7);
        assert_eq!(s.handle.value.as_deref(), Some("b.test"));
        assert_eq!(s.paths.data_dir, dir.path().join("profiles/b"));
        let err = Settings::load(None, Some("zzz"), &Overrides::default(), &env).unwrap_err();
        assert!(err.to_string().contains("[profiles.zzz]"), "{err}");
    }

    #[test]
    fn bad_values_name_their_origin() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().to_str().unwrap().to_string();
        let env = env_of(&[("BOT_HOME", &home), ("BOT_TOP_K", "many")]);
        let err = Settings::load(None, None, &Overrides::default(), &env).unwrap_err();
        assert!(err.to_string().contains("BOT_TOP_K"), "{err}");
        std::fs::write(dir.path().join("config.toml"), "temprature = 1\n").unwrap();
        let env = env_of(&[("BOT_HOME", &home)]);
        let err = Settings::load(None, None, &Overrides::default(), &env).unwrap_err();
        assert!(err.to_string().contains("temprature"), "{err}");
    }
}
