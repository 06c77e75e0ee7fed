//! Where an upstream server is and how to talk to it: the configuration the upstream
//! drivers take ([`UpstreamConfig`], part of [`crate::EngineConfig`]) and the base-URL
//! check that routing ([`crate::route`]) does at parse time. The drivers themselves
//! (the HTTP clients of the OpenAI and Anthropic wires) live in the `fak-upstream`
//! crate, which registers them in a [`crate::registry::Registry`].

use crate::EngineError;
use hyper::Uri;
use std::time::Duration;

/// Where the upstream is and how to talk to it (the `fak serve --base-url` family of
/// flags).
#[derive(Clone, PartialEq, Eq)]
pub struct UpstreamConfig {
    /// The servers, each by its root or its `/v1` URL, `http://HOST:PORT[/PREFIX]`. At
    /// least one is required; a repeated one counts once.
    pub base_urls: Vec<String>,
    /// The one model served, under the name the upstream knows it by; `None`: every
    /// model the upstream's `/v1/models` lists.
    pub model: Option<String>,
    /// The operator's key for the upstream: sent as `Authorization: Bearer KEY` (OpenAI
    /// wire) or `x-api-key: KEY` (Anthropic wire, in place of the client's own) on every
    /// upstream request.
    pub api_key: Option<String>,
    /// Longest wait to connect and receive the response head.
    pub timeout: Duration,
    /// Longest wait for the next piece of a response body (a stall mid-reply).
    pub idle_timeout: Duration,
    /// Extra attempts after a connection failure, a 5xx or a timeout, while nothing has
    /// been relayed to the client (on another healthy upstream when there is one).
    pub retries: u32,
    /// How often each upstream's health is checked; at least 10 ms.
    pub health_interval: Duration,
}

impl Default for UpstreamConfig {
    /// No base URL; 300 s to the response head (a CPU server may prefill a long prompt
    /// first), 120 s idle, 2 retries, a health check every 5 s.
    fn default() -> Self {
        UpstreamConfig {
            base_urls: Vec::new(),
            model: None,
            api_key: None,
            timeout: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(120),
            retries: 2,
            health_interval: Duration::from_secs(5),
        }
    }
}

impl std::fmt::Debug for UpstreamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamConfig")
            .field("base_urls", &self.base_urls)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "(set)"))
            .field("timeout", &self.timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("retries", &self.retries)
            .field("health_interval", &self.health_interval)
            .finish()
    }
}

/// `http://HOST:PORT[/PREFIX]` from a base URL (a trailing `/` or `/v1` dropped).
///
/// # Errors
/// [`EngineError::InvalidRequest`] for a URL that does not parse, has no host, or is not
/// `http://`.
pub fn normalize_base_url(url: &str) -> Result<String, EngineError> {
    let bad = |why: &str| EngineError::InvalidRequest(format!("base URL '{url}': {why}"));
    let uri: Uri = url.trim().parse().map_err(|e| bad(&format!("{e}")))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(bad(
                "TLS is not built in; reach an https upstream through a local TLS tunnel",
            ))
        }
        _ => return Err(bad("it must start with http://")),
    }
    let authority = uri
        .authority()
        .ok_or_else(|| bad("it names no host"))?
        .as_str();
    let mut path = uri.path().trim_end_matches('/').to_string();
    if path.ends_with("/v1") {
        path.truncate(path.len() - 3);
    }
    Ok(format!("http://{authority}{path}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        for (u, want) in [
            ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
            ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
            ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
            ("http://h:1/api/v1/", "http://h:1/api"),
        ] {
            assert_eq!(normalize_base_url(u).unwrap(), want, "{u}");
        }
        for bad in ["https://h:1", "ftp://h", "h:1", "", "http://"] {
            assert!(normalize_base_url(bad).is_err(), "{bad}");
        }
        let e = normalize_base_url("https://x").unwrap_err().to_string();
        assert!(e.contains("TLS"), "{e}");
    }
}
