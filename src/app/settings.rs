//! Effective settings: command-line flags > environment (`BOT_*`) > the TOML config file >
//! defaults, each value remembering where it came from (`bot config show`). `BOT_HOME`
//! relocates every file `bot` reads or writes; otherwise the platform's config and data
//! directories (the `directories` crate) are used.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub const DEFAULT_MODEL: &str = crate::setting_default!(model);
/// More worker threads than this is a typo (each is a real OS thread).
pub const MAX_THREADS: usize = 1024;
/// Longest post generation asked for (a post is at most 300 graphemes).
pub const MAX_NEW_TOKENS: usize = 8192;
pub const DEFAULT_SERVICE: &str = crate::setting_default!(service);

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

/// The process environment as the settings layer sees it.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// How `config show` prints a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Show {
    /// A string or path, quoted.
    Quoted,
    /// A number.
    Plain,
    /// A comma-separated list, printed as a list.
    List,
}

/// One setting, declared once: its config-file key (`bluesky.*` sits in the `[bluesky]` table),
/// its environment variable, its default as text (`None`: unset unless given), how `config
/// show` prints it and what it prints when unset. Flags, the file's keys, the environment a
/// schedule carries and `config show` all follow this table.
#[derive(Debug)]
pub struct Decl {
    pub key: &'static str,
    pub env: &'static str,
    pub default: Option<&'static str>,
    pub show: Show,
    pub unset: &'static str,
}

/// A setting's default as a literal, for this table and for the flags' help (`cli.rs`).
#[macro_export]
macro_rules! setting_default {
    (temperature) => {
        "0.95"
    };
    (top_p) => {
        "0.9"
    };
    (min_p) => {
        "0"
    };
    (top_k) => {
        "0"
    };
    (max_tokens) => {
        "280"
    };
    (min_chars) => {
        "30"
    };
    (attempts) => {
        "5"
    };
    (device) => {
        "auto"
    };
    (model) => {
        "lmstudio-community/Qwen3-8B-MLX-4bit"
    };
    (service) => {
        "https://bsky.social"
    };
    (langs) => {
        "en"
    };
}

const fn d(
    key: &'static str,
    env: &'static str,
    default: Option<&'static str>,
    show: Show,
) -> Decl {
    Decl {
        key,
        env,
        default,
        show,
        unset: "(none)",
    }
}

/// Every setting, in `config show`'s order.
pub const SETTINGS: &[Decl] = &[
    d(
        "model",
        "BOT_MODEL",
        Some(crate::setting_default!(model)),
        Show::Quoted,
    ),
    d("adapter", "BOT_ADAPTER", None, Show::Quoted),
    d("prompts", "BOT_PROMPTS", None, Show::Quoted),
    d("system", "BOT_SYSTEM", None, Show::Quoted),
    d("reply_prompt", "BOT_REPLY_PROMPT", None, Show::Quoted),
    d(
        "temperature",
        "BOT_TEMPERATURE",
        Some(crate::setting_default!(temperature)),
        Show::Plain,
    ),
    d(
        "top_p",
        "BOT_TOP_P",
        Some(crate::setting_default!(top_p)),
        Show::Plain,
    ),
    d(
        "min_p",
        "BOT_MIN_P",
        Some(crate::setting_default!(min_p)),
        Show::Plain,
    ),
    d(
        "top_k",
        "BOT_TOP_K",
        Some(crate::setting_default!(top_k)),
        Show::Plain,
    ),
    d(
        "repetition_penalty",
        "BOT_REPETITION_PENALTY",
        None,
        Show::Plain,
    ),
    d(
        "max_tokens",
        "BOT_MAX_TOKENS",
        Some(crate::setting_default!(max_tokens)),
        Show::Plain,
    ),
    d(
        "min_chars",
        "BOT_MIN_CHARS",
        Some(crate::setting_default!(min_chars)),
        Show::Plain,
    ),
    d(
        "attempts",
        "BOT_ATTEMPTS",
        Some(crate::setting_default!(attempts)),
        Show::Plain,
    ),
    d(
        "device",
        "BOT_DEVICE",
        Some(crate::setting_default!(device)),
        Show::Quoted,
    ),
    Decl {
        unset: "(all cores)",
        ..d("threads", "BOT_THREADS", None, Show::Plain)
    },
    d(
        "bluesky.service",
        "BOT_BSKY_SERVICE",
        Some(crate::setting_default!(service)),
        Show::Quoted,
    ),
    d("bluesky.handle", "BOT_BSKY_HANDLE", None, Show::Quoted),
    d(
        "bluesky.langs",
        "BOT_LANGS",
        Some(crate::setting_default!(langs)),
        Show::List,
    ),
    d(
        "bluesky.password_file",
        "BOT_BSKY_PASSWORD_FILE",
        None,
        Show::Quoted,
    ),
];

/// The declaration of `key` (a key not in the table is a bug of this file).
fn decl(key: &str) -> &'static Decl {
    match SETTINGS.iter().find(|d| d.key == key) {
        Some(d) => d,
        None => panic!("setting `{key}` is not declared in SETTINGS"),
    }
}

/// The `BOT_*` variables that carry settings (not secrets): what a schedule passes on.
pub fn env_settings() -> impl Iterator<Item = &'static str> {
    SETTINGS.iter().map(|d| d.env)
}

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

/// The config file: each declared key's value as text (strings as they are, numbers and lists
/// of strings written out), with `[profiles.NAME]` tables kept apart. Unknown keys are errors
/// so that a typo does not silently do nothing.
#[derive(Debug, Clone, Default)]
pub struct FileConfig {
    values: BTreeMap<&'static str, String>,
    profiles: BTreeMap<String, FileConfig>,
}

impl FileConfig {
    pub fn parse(path: &Path, text: &str) -> Result<Self, SettingsError> {
        let err = |why: String| SettingsError::Parse {
            path: path.to_path_buf(),
            why,
        };
        let table: toml::Table = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        Self::from_table(&table, "").map_err(err)
    }

    /// The keys of `table`, which sits at `prefix` (`""`, or `"bluesky."`).
    fn from_table(table: &toml::Table, prefix: &str) -> Result<Self, String> {
        let mut c = FileConfig::default();
        for (k, v) in table {
            let key = format!("{prefix}{k}");
            match (key.as_str(), v) {
                ("bluesky", toml::Value::Table(t)) => {
                    c.values.extend(Self::from_table(t, "bluesky.")?.values)
                }
                ("profiles", toml::Value::Table(t)) => {
                    for (name, p) in t {
                        let toml::Value::Table(p) = p else {
                            return Err(format!("[profiles.{name}] must be a table"));
                        };
                        c.profiles.insert(name.clone(), Self::from_table(p, "")?);
                    }
                }
                _ => {
                    let Some(d) = SETTINGS.iter().find(|d| d.key == key) else {
                        let known: Vec<&str> = SETTINGS.iter().map(|d| d.key).collect();
                        return Err(format!(
                            "unknown key `{key}`, expected one of {}",
                            known.join(", ")
                        ));
                    };
                    c.values.insert(d.key, Self::text(&key, v)?);
                }
            }
        }
        Ok(c)
    }

    fn text(key: &str, v: &toml::Value) -> Result<String, String> {
        Ok(match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Array(a) => a
                .iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| format!("`{key}`: expected a list of strings"))?
                .join(","),
            _ => return Err(format!("`{key}`: expected a string, a number or a list")),
        })
    }

    /// `self` with the profile's keys laid over it.
    fn with_profile(&self, p: &FileConfig) -> FileConfig {
        let mut values = self.values.clone();
        values.extend(p.values.clone());
        FileConfig {
            values,
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

/// Values given on the command line, by setting key, as text.
#[derive(Debug, Clone, Default)]
pub struct Overrides(BTreeMap<&'static str, String>);

impl Overrides {
    /// `key` given as `value` (None: not given).
    pub fn with<T: ToString>(mut self, key: &'static str, value: Option<T>) -> Self {
        if let Some(v) = value {
            self.0.insert(decl(key).key, v.to_string());
        }
        self
    }
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
    /// The instruction for replies; `{post}` and `{author}` are filled in
    /// (`bluesky::reply::DEFAULT_REPLY_PROMPT` when unset).
    pub reply_prompt: Sourced<Option<String>>,
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
    /// The app password comes from `password_file` only, never the environment (a sandbox
    /// member's account is not the one BOT_BSKY_APP_PASSWORD belongs to).
    pub password_file_only: bool,
    /// Each setting's text and source as `config show` prints it.
    shown: BTreeMap<&'static str, Sourced<Option<String>>>,
}

/// One layer lookup: flag, then env, then file, then default; what was found is also kept
/// as text for `config show`.
struct Layers<'a> {
    flags: &'a Overrides,
    env: &'a dyn Fn(&str) -> Option<String>,
    file: &'a FileConfig,
    file_path: PathBuf,
    shown: BTreeMap<&'static str, Sourced<Option<String>>>,
}

impl Layers<'_> {
    /// The raw text of `key` and where it came from; None when no layer (default included) has it.
    fn raw(&self, d: &'static Decl) -> Option<(String, Source)> {
        if let Some(v) = self.flags.0.get(d.key) {
            return Some((v.clone(), Source::Flag));
        }
        if let Some(v) = (self.env)(d.env).filter(|s| !s.is_empty()) {
            return Some((v, Source::Env(d.env)));
        }
        if let Some(v) = self.file.values.get(d.key) {
            return Some((v.clone(), Source::File(self.file_path.clone())));
        }
        d.default.map(|v| (v.to_string(), Source::Default))
    }

    fn get_opt<T: FromStr>(&mut self, key: &str) -> Result<Sourced<Option<T>>, SettingsError>
    where
        T::Err: fmt::Display,
    {
        let d = decl(key);
        let Some((raw, source)) = self.raw(d) else {
            self.shown.insert(
                d.key,
                Sourced {
                    value: None,
                    source: Source::Default,
                },
            );
            return Ok(Sourced {
                value: None,
                source: Source::Default,
            });
        };
        let value = raw.trim().parse::<T>().map_err(|e| SettingsError::Value {
            origin: match &source {
                Source::Env(name) => format!("environment variable {name}"),
                other => other.to_string(),
            },
            field: d.key.into(),
            value: raw.clone(),
            why: e.to_string(),
        })?;
        self.shown.insert(
            d.key,
            Sourced {
                value: Some(raw),
                source: source.clone(),
            },
        );
        Ok(Sourced {
            value: Some(value),
            source,
        })
    }

    /// A setting with a default: always has a value.
    fn get<T: FromStr>(&mut self, key: &str) -> Result<Sourced<T>, SettingsError>
    where
        T::Err: fmt::Display,
    {
        let s = self.get_opt(key)?;
        match s.value {
            Some(value) => Ok(Sourced {
                value,
                source: s.source,
            }),
            None => panic!("setting `{key}` has no default in SETTINGS"),
        }
    }
}

/// A comma-separated list (`BOT_LANGS=en,de`, or a TOML list).
struct List(Vec<String>);

impl FromStr for List {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(List(
            s.split(',')
                .map(|x| x.trim().to_string())
                .filter(|x| !x.is_empty())
                .collect(),
        ))
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
        let mut l = Layers {
            flags: o,
            env,
            file: &f,
            file_path: paths.config_file.clone(),
            shown: BTreeMap::new(),
        };
        let mut adapter = l.get_opt::<String>("adapter")?;
        if adapter.value.is_none() && paths.default_adapter.join("adapter_config.json").is_file() {
            // The conventional place, when the user put an adapter there.
            let dir = paths.default_adapter.display().to_string();
            l.shown.insert(
                "adapter",
                Sourced {
                    value: Some(dir.clone()),
                    source: Source::Default,
                },
            );
            adapter.value = Some(dir);
        }
        let langs = l.get::<List>("bluesky.langs")?;
        let mut s = Settings {
            model: l.get("model")?,
            adapter,
            prompts: l.get_opt("prompts")?,
            system: l.get_opt("system")?,
            reply_prompt: l.get_opt("reply_prompt")?,
            temperature: l.get("temperature")?,
            top_p: l.get("top_p")?,
            min_p: l.get("min_p")?,
            top_k: l.get("top_k")?,
            repetition_penalty: l.get_opt("repetition_penalty")?,
            max_tokens: l.get("max_tokens")?,
            min_chars: l.get("min_chars")?,
            attempts: l.get("attempts")?,
            device: l.get("device")?,
            threads: l.get_opt("threads")?,
            service: l.get("bluesky.service")?,
            handle: l.get_opt("bluesky.handle")?,
            password_file: l.get_opt("bluesky.password_file")?,
            langs: Sourced {
                value: langs.value.0,
                source: langs.source,
            },
            shown: BTreeMap::new(),
            paths,
            profile,
            config_found,
            password_file_only: false,
        };
        s.shown = l.shown;
        s.validate()?;
        // `@alice.bsky.social`, as handles are written in posts, is the handle `alice.bsky.social`
        if let Some(h) = &mut s.handle.value {
            *h = h.trim().trim_start_matches('@').to_string();
            if let Some(shown) = s.shown.get_mut("bluesky.handle") {
                shown.value = Some(h.clone());
            }
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
        let found = if self.config_found {
            ""
        } else {
            " (not found)"
        };
        let file = q(&self.paths.config_file.display().to_string());
        line("config_file", format!("{file}{found}"), &Source::Default);
        line(
            "data_dir",
            q(&self.paths.data_dir.display().to_string()),
            &Source::Default,
        );
        let profile = self.profile.as_deref().map(q);
        line(
            "profile",
            profile.unwrap_or_else(|| "(none)".into()),
            &Source::Default,
        );
        for d in SETTINGS {
            let Some(s) = self.shown.get(d.key) else {
                continue;
            };
            let text = match (&s.value, d.show) {
                (None, _) => d.unset.to_string(),
                (Some(v), Show::Quoted) => q(v),
                (Some(v), Show::Plain) => v.clone(),
                (Some(v), Show::List) => {
                    format!("{:?}", v.parse::<List>().map(|l| l.0).unwrap_or_default())
                }
            };
            line(d.key, text, &s.source);
        }
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

/// The user's default sampler: what `bot generate` uses with no settings given (`bot bench
/// --sampler default` measures it).
pub fn default_sampler() -> crate::engine::sample::SamplerParams {
    fn get<T: FromStr + Default>(key: &str) -> T {
        decl(key)
            .default
            .and_then(|v| v.parse().ok())
            .unwrap_or_default()
    }
    crate::engine::sample::SamplerParams {
        temperature: get("temperature"),
        top_p: get("top_p"),
        min_p: get("min_p"),
        top_k: get("top_k"),
        ..crate::engine::sample::SamplerParams::greedy()
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
    fn declared_defaults_parse_and_keys_are_unique() {
        let keys: std::collections::BTreeSet<_> = SETTINGS.iter().map(|d| d.key).collect();
        assert_eq!(keys.len(), SETTINGS.len());
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().to_str().unwrap().to_string();
        let s = Settings::load(
            None,
            None,
            &Overrides::default(),
            &env_of(&[("BOT_HOME", &home)]),
        )
        .unwrap();
        let p = default_sampler();
        assert_eq!(
            (p.temperature, p.top_p),
            (s.temperature.value, s.top_p.value)
        );
        assert_eq!((p.min_p, p.top_k), (s.min_p.value, s.top_k.value));
        assert_eq!(p.temperature, 0.95, "the tuned bot's temperature");
        // every declared setting is shown, in order, after config_file, data_dir and profile
        let text = s.render(false);
        let shown: Vec<&str> = text
            .lines()
            .map(|l| l.split_whitespace().next().unwrap())
            .collect();
        let declared: Vec<&str> = SETTINGS.iter().map(|d| d.key).collect();
        assert_eq!(shown[3..3 + declared.len()], declared[..]);
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
        let o = Overrides::default().with("model", Some("flag/model"));
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
