//! A plain XRPC client (AT Protocol HTTP API) on blocking reqwest: queries are GET, procedures
//! POST with JSON; errors are read from the body's `error`/`message`. Rate limits (429) are
//! waited out from `Retry-After` or `RateLimit-Reset` when that fits the time budget, and
//! 5xx/transport failures of *idempotent* calls are retried with exponential backoff; every
//! loop is bounded in attempts and in total time. Non-idempotent writes are never retried
//! here: the caller decides, after checking whether the write landed.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use reqwest::blocking::{Client, Response};
use reqwest::StatusCode;
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum XrpcError {
    /// The server answered with an XRPC error.
    #[error("{nsid}: HTTP {status} {error}{}", message.as_deref().map(|m| format!(": {m}")).unwrap_or_default())]
    Api {
        nsid: String,
        status: u16,
        error: String,
        message: Option<String>,
    },
    /// Throttled longer than the time budget allows.
    #[error("{nsid}: rate limited by the server; retry in {} s", wait.as_secs())]
    RateLimited { nsid: String, wait: Duration },
    /// No answer (connection failed, timed out, or the response was lost): the request may
    /// or may not have been applied.
    #[error("{nsid}: no response from {url}: {why}")]
    Transport {
        nsid: String,
        url: String,
        why: String,
    },
    #[error("{nsid}: unreadable response: {why}")]
    Decode { nsid: String, why: String },
    /// The server answered with a redirect. XRPC calls carry passwords and tokens, so they
    /// are never sent on to another address.
    #[error(
        "{nsid}: {url} answered HTTP {status} redirecting to {location}; bot never follows \
         redirects with credentials: set the service to the address that answers directly"
    )]
    Redirect {
        nsid: String,
        url: String,
        status: u16,
        location: String,
    },
}

impl XrpcError {
    /// The XRPC error name, when the server gave one.
    pub fn name(&self) -> Option<&str> {
        match self {
            XrpcError::Api { error, .. } => Some(error),
            _ => None,
        }
    }
    pub fn status(&self) -> Option<u16> {
        match self {
            XrpcError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
    /// A failure after which a write may or may not have happened.
    pub fn is_ambiguous(&self) -> bool {
        matches!(self, XrpcError::Transport { .. })
            || matches!(self, XrpcError::Api { status, .. } if *status >= 500)
    }
}

/// Bounds of every retry loop.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub attempts: u32,
    pub first_backoff: Duration,
    pub max_backoff: Duration,
    /// Longest single rate-limit wait that is waited out instead of failing.
    pub max_rate_limit_wait: Duration,
    /// Total time one call may spend, waits included.
    pub total: Duration,
    pub request_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 4,
            first_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
            max_rate_limit_wait: Duration::from_secs(90),
            total: Duration::from_secs(180),
            request_timeout: Duration::from_secs(30),
        }
    }
}

pub struct Xrpc {
    http: Client,
    pub policy: RetryPolicy,
}

pub enum Call<'a> {
    Query(&'a [(&'a str, &'a str)]),
    Procedure(&'a Value),
    /// A procedure without input (refreshSession, deleteSession): no body at all.
    Empty,
}

/// Seconds to wait from a 429's headers: `Retry-After` (seconds), else `RateLimit-Reset`
/// (epoch seconds), else a default.
pub fn rate_limit_wait(headers: &reqwest::header::HeaderMap, now: SystemTime) -> Duration {
    let num = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    if let Some(s) = num("retry-after") {
        return Duration::from_secs(s);
    }
    if let Some(reset) = num("ratelimit-reset") {
        let now_s = now
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        return Duration::from_secs(reset.saturating_sub(now_s).max(1));
    }
    Duration::from_secs(5)
}

impl Xrpc {
    pub fn new(policy: RetryPolicy) -> Result<Self, XrpcError> {
        let http = Client::builder()
            .timeout(policy.request_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("bot/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| XrpcError::Transport {
                nsid: "(client)".into(),
                url: String::new(),
                why: e.to_string(),
            })?;
        Ok(Xrpc { http, policy })
    }

    fn send_once(
        &self,
        base: &str,
        nsid: &str,
        call: &Call,
        token: Option<&str>,
    ) -> Result<Response, XrpcError> {
        let url = format!("{}/xrpc/{nsid}", base.trim_end_matches('/'));
        let mut req = match call {
            Call::Query(q) => self.http.get(&url).query(q),
            Call::Procedure(body) => self.http.post(&url).json(body),
            Call::Empty => self.http.post(&url),
        };
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().map_err(|e| XrpcError::Transport {
            nsid: nsid.into(),
            url: url.clone(),
            why: if e.is_timeout() {
                format!(
                    "timed out after {:.1} s waiting for an answer",
                    self.policy.request_timeout.as_secs_f64()
                )
            } else if e.is_connect() {
                format!("cannot connect ({})", root_cause(&e))
            } else {
                root_cause(&e)
            },
        })?;
        if resp.status().is_redirection() {
            return Err(XrpcError::Redirect {
                nsid: nsid.into(),
                url,
                status: resp.status().as_u16(),
                location: resp
                    .headers()
                    .get(reqwest::header::LOCATION)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("(no Location)")
                    .to_string(),
            });
        }
        Ok(resp)
    }

    fn decode(nsid: &str, resp: Response) -> Result<Value, XrpcError> {
        let status = resp.status();
        let text = resp.text().map_err(|e| XrpcError::Transport {
            nsid: nsid.into(),
            url: String::new(),
            why: format!("reading the response: {e}"),
        })?;
        let body: Value = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text.clone()))
        };
        if status.is_success() {
            return Ok(body);
        }
        Err(XrpcError::Api {
            nsid: nsid.into(),
            status: status.as_u16(),
            error: body
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or(status.canonical_reason().unwrap_or("Error"))
                .to_string(),
            message: body
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }

    /// One call with the rate-limit wait and, when `idempotent`, retries of 5xx and transport
    /// failures.
    pub fn call(
        &self,
        base: &str,
        nsid: &str,
        call: Call,
        token: Option<&str>,
        idempotent: bool,
    ) -> Result<Value, XrpcError> {
        let start = Instant::now();
        let mut backoff = self.policy.first_backoff;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let result = self.send_once(base, nsid, &call, token);
            let err = match result {
                Ok(resp) if resp.status() == StatusCode::TOO_MANY_REQUESTS => {
                    let wait = rate_limit_wait(resp.headers(), SystemTime::now());
                    let fits = wait <= self.policy.max_rate_limit_wait
                        && start.elapsed() + wait <= self.policy.total
                        && attempt < self.policy.attempts;
                    if !fits {
                        return Err(XrpcError::RateLimited {
                            nsid: nsid.into(),
                            wait,
                        });
                    }
                    eprintln!("{nsid}: rate limited, waiting {} s", wait.as_secs());
                    std::thread::sleep(wait);
                    continue;
                }
                Ok(resp) => match Self::decode(nsid, resp) {
                    Ok(v) => return Ok(v),
                    Err(e) => e,
                },
                Err(e) => e,
            };
            let retry = idempotent
                && err.is_ambiguous()
                && attempt < self.policy.attempts
                && start.elapsed() + backoff <= self.policy.total;
            if !retry {
                return Err(err);
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(self.policy.max_backoff);
        }
    }
}

/// The innermost cause of an error, which says what happened ("connection refused") where
/// reqwest's own message only says "error sending request for url".
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{HeaderMap, HeaderValue};

    #[test]
    fn waits_from_retry_after_or_reset() {
        let now = UNIX_EPOCH + Duration::from_secs(1000);
        let mut h = HeaderMap::new();
        h.insert("ratelimit-reset", HeaderValue::from_static("1030"));
        assert_eq!(rate_limit_wait(&h, now), Duration::from_secs(30));
        h.insert("retry-after", HeaderValue::from_static("7"));
        assert_eq!(rate_limit_wait(&h, now), Duration::from_secs(7));
        assert_eq!(
            rate_limit_wait(&HeaderMap::new(), now),
            Duration::from_secs(5)
        );
    }
}
