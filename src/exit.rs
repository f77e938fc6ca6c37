//! Exit codes for scripts and schedulers (documented in README.md, "Exit codes").

use crate::app::hub::HubError;
use crate::app::settings::SettingsError;
use crate::bluesky::xrpc::XrpcError;
use crate::bluesky::BlueskyError;
use crate::cmd::cli::BadArgument;
use crate::generate::GenerateError;

pub const OK: i32 = 0;
/// Anything not listed below.
pub const OTHER: i32 = 1;
/// Bad command line (clap's own code).
pub const USAGE: i32 = 2;
/// Bad configuration or credentials: a human must act; retrying will not help.
pub const CONFIG: i32 = 3;
/// The server throttled us beyond the wait budget: retry later.
pub const RATE_LIMITED: i32 = 4;
/// No usable post could be generated.
pub const GENERATION: i32 = 5;
/// Network or server failure: retry later.
pub const NETWORK: i32 = 6;
/// The post was refused before sending (over the limits, empty, a duplicate).
pub const REFUSED: i32 = 7;
/// Another scheduled run of the same profile holds the lock.
pub const LOCKED: i32 = 8;

/// The code for an error: the first typed error in its chain decides.
pub fn code(e: &anyhow::Error) -> i32 {
    for cause in e.chain() {
        if cause.downcast_ref::<BadArgument>().is_some() {
            return USAGE;
        }
        if let Some(b) = cause.downcast_ref::<BlueskyError>() {
            return match b {
                BlueskyError::Config(_) | BlueskyError::Auth { .. } => CONFIG,
                BlueskyError::Text(_) => REFUSED,
                BlueskyError::Xrpc(x) => xrpc_code(x),
                BlueskyError::Session(_) | BlueskyError::Protocol { .. } => OTHER,
            };
        }
        if let Some(x) = cause.downcast_ref::<XrpcError>() {
            return xrpc_code(x);
        }
        if cause
            .downcast_ref::<crate::bluesky::record::TextError>()
            .is_some()
        {
            return REFUSED;
        }
        if let Some(g) = cause.downcast_ref::<GenerateError>() {
            return match g {
                GenerateError::TooShort { .. } | GenerateError::NonFinite { .. } => GENERATION,
                GenerateError::EmptyPrompts { .. }
                | GenerateError::ReadPrompts { .. }
                | GenerateError::Sampling(_) => CONFIG,
                GenerateError::PromptTooLong { .. } => USAGE,
                GenerateError::Engine(e) => engine_code(e),
                _ => OTHER,
            };
        }
        // `bot eval`: the --data file is the command line's; a model whose template or
        // tokenizer cannot be used is configuration
        if cause
            .downcast_ref::<crate::eval::data::DataError>()
            .is_some()
        {
            return USAGE;
        }
        if let Some(e) = cause.downcast_ref::<crate::eval::EvalError>() {
            use crate::eval::EvalError as V;
            return match e {
                V::Data(_) | V::Example { .. } | V::NothingToScore { .. } => USAGE,
                V::Template(_) | V::Tokenizer(_) => CONFIG,
                V::Engine(e) => engine_code(e),
            };
        }
        if let Some(e) = cause.downcast_ref::<crate::engine::EngineError>() {
            return engine_code(e);
        }
        if let Some(h) = cause.downcast_ref::<HubError>() {
            return match h {
                HubError::Download { .. } => NETWORK,
                _ => CONFIG,
            };
        }
        if let Some(s) = cause.downcast_ref::<SettingsError>() {
            return match s {
                // a flag's value is the command line's fault
                SettingsError::Value { origin, .. } if origin == "command line" => USAGE,
                _ => CONFIG,
            };
        }
        if cause
            .downcast_ref::<crate::app::schedule::Locked>()
            .is_some()
        {
            return LOCKED;
        }
        if cause
            .downcast_ref::<crate::app::schedule::UnsafeValue>()
            .is_some()
        {
            return CONFIG;
        }
        if cause
            .downcast_ref::<crate::app::store::DraftError>()
            .is_some()
        {
            return CONFIG;
        }
        if cause
            .downcast_ref::<crate::app::publish::Refused>()
            .is_some()
        {
            return REFUSED;
        }
    }
    OTHER
}

/// A model or adapter the user must fix is a configuration problem; running out of context is
/// a command-line one; the rest (device failures, internal errors) are other errors.
fn engine_code(e: &crate::engine::EngineError) -> i32 {
    use crate::engine::EngineError as E;
    match e {
        E::Io { .. }
        | E::SafetensorsFormat { .. }
        | E::BadTensor { .. }
        | E::MissingTensor { .. }
        | E::Config { .. }
        | E::UnsupportedQuantMode { .. }
        | E::Adapter { .. } => CONFIG,
        E::NotADirectory { .. }
        | E::NoWeights { .. }
        | E::FeatureDisabled { .. }
        | E::MetalUnavailable(_) => CONFIG,
        E::ContextFull { .. } | E::TokenOutOfRange { .. } => USAGE,
        E::NonFiniteLogits => GENERATION,
        E::Internal(_) | E::Candle(_) => OTHER,
    }
}

fn xrpc_code(x: &XrpcError) -> i32 {
    match x {
        XrpcError::RateLimited { .. } => RATE_LIMITED,
        XrpcError::Redirect { .. } => CONFIG,
        XrpcError::Transport { .. } => NETWORK,
        XrpcError::Api { status, .. } if *status >= 500 => NETWORK,
        XrpcError::Api {
            status: 401 | 403, ..
        } => CONFIG,
        _ => OTHER,
    }
}
