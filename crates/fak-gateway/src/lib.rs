//! fak-gateway: fak's HTTP APIs over a fak-engine driver.
//!
//! One job: speak the wire formats clients already use, and hand each request to an
//! [`EngineDriver`] (the in-kernel model, another server's OpenAI-compatible or
//! Anthropic Messages API, several of them routed by model, or the mock in tests). For a
//! driver that forwards the client's own request (the Anthropic upstream) the Messages
//! route attaches the body as it came, a screened tool result spliced in at its
//! `content` span and nothing else changed.
//!
//! | route | API | notes |
//! |---|---|---|
//! | `POST /v1/chat/completions` | OpenAI chat | `stream` (SSE ending `data: [DONE]`), `stream_options.include_usage`, `usage.prompt_tokens_details.cached_tokens`, `tools` / `tool_choice` (calls adjudicated, `fak` field) |
//! | `POST /v1/completions` | OpenAI legacy completions | no template; `prompt` as text or token ids (prefilled as is), one or a list (a choice per prompt by `index`) |
//! | `POST /v1/responses` | OpenAI Responses | `input` text or items (messages, `function_call`, `function_call_output`), `instructions`, function `tools` / `tool_choice` (calls adjudicated, `fak` field), `stream` (the SDK's event sequence), `max_output_tokens` → `incomplete`, `previous_response_id` from kept responses; `GET` / `DELETE /v1/responses/{id}` (the `responses` module) |
//! | `POST /v1/messages` | Anthropic Messages | top-level `system`, `text` / `tool_use` / `tool_result` blocks, `tools` / `tool_choice`, `max_tokens` required, SSE events `message_start` … `message_stop`, `usage.cache_read_input_tokens` |
//! | `GET /v1/models`, `GET /v1/models/{id}` | OpenAI or (with `anthropic-version`) Anthropic models | [`models`] |
//! | `GET /health` | | 200 once the model is loaded, 503 before (or if loading failed) |
//! | `GET /metrics` | Prometheus text | requests by route and status, token counters, queue depth, TTFT and per-token latency histograms, audit write failures, store size, revocations |
//!
//! | `POST /v1/fak/revoke` | fak | `{"tool_call_id"}` or `{"digest"}`: quarantine that content from now on and cut it out of every cached conversation |
//! | `POST /v1/fak/policy/reload` | fak | read the `--policy` file again; an invalid one is a 400 and the old policy stays |
//!
//! KV reuse is partitioned: requests share a cached prefix (and see it in
//! `cached_tokens` / `cache_read_input_tokens`) only when they authenticated with the same
//! API key ([`GatewayConfig::api_key`], [`GatewayConfig::api_keys`]) and carry the same
//! optional `cache_salt` (vLLM's field, on all three generation routes).
//!
//! Tool results: every inbound result (OpenAI `role: "tool"`, Anthropic `tool_result`)
//! is screened by fak-ctxmmu before the engine sees it; a quarantined or paged-out one
//! reaches the model as its stub, and the response's `fak.tool_results` says which.
//!
//! Tool calls: the engine reads the model's calls out of its text
//! ([`fak_engine::tools`]); this crate adjudicates each against the policy before the
//! client sees it (the `tools` module: malformed → `MALFORMED`, not offered → `UNKNOWN_TOOL`, then
//! [`fak_engine::policy::Policy::adjudicate`]), passes on only the allowed ones, and
//! reports every verdict in the response's `fak` field.
//!
//! Errors render in each API's own shape ([`error::ApiError`], [`Flavor::of_request`]),
//! the framework's own answers included: 400 for invalid JSON (bytes after the JSON
//! value too), missing fields, out-of-range parameters, context overflow and a path id
//! that is not UTF-8; 401 for a missing or wrong key (when one is set), and 401/403 when
//! an Anthropic upstream refuses the client's own key; 404 for an unknown model (OpenAI's
//! shape: `invalid_request_error`, `code: "model_not_found"`) or route; 405 for a wrong
//! method (`Allow` naming the allowed ones); 413 for a body over the limit (at once, unread,
//! when its `Content-Length` declares it); 414 for a request
//! target over [`MAX_URI_BYTES`]; 429 (queue full) and 503 (not ready) with `Retry-After`; 500 with
//! `x-should-retry: false` for a model that failed to load (no retry can help); 502 when an
//! upstream engine fails; 504 when a response takes longer than the request time limit
//! or an upstream engine times out.
//!
//! Inference never runs on the async threads: `submit` runs under `spawn_blocking` and
//! the driver generates on its own threads, streaming events through a channel. When a
//! client goes away, hyper drops the response body, which drops the event stream, which
//! the driver sees as a closed channel: it stops within one token and frees its slot.
//!
//! Layers: the body limit is axum's `DefaultBodyLimit` (a tower layer); in front of it the
//! middleware that puts every error in its wire's shape also refuses, from the request
//! head, a target over [`MAX_URI_BYTES`] and a declared length over the limit; one middleware
//! writes one `tracing` line per request (method, route, status, ms, tokens) and counts
//! it for `/metrics`; another checks the bearer key on `/v1/*`; a third bounds the time
//! to a `/v1/*` response ([`GatewayConfig::request_timeout`]).
//!
//! Connections ([`serve_with`], the [`conn`] module): a header timeout, an idle timeout
//! for stalled clients, a cap on open connections, and a graceful shutdown that ends
//! every request in flight with an answer in its API's shape; [`serve_engine`] also
//! drains the engine's queue at once and cancels its running generations when the grace
//! ends.

mod anthropic;
pub mod conn;
pub mod error;
mod extract;
pub mod metrics;
pub mod models;
mod openai;
mod responses;
mod splice;
mod structured;
mod tools;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use error::{ApiError, Flavor};
use fak_ctxmmu::{Screen, ScreenConfig};
use fak_engine::policy::Policy;
use fak_engine::{EngineDriver, EngineError, EngineEvent, EventStream, GenerateRequest, Readiness};
use metrics::Metrics;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Gateway settings (the `fak serve` flags that are not the engine's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayConfig {
    /// When set, `/v1/*` requires `Authorization: Bearer KEY` or `x-api-key: KEY`.
    /// `/health` and `/metrics` stay open.
    pub api_key: Option<String>,
    /// More keys accepted on `/v1/*` as [`GatewayConfig::api_key`] is (`fak serve
    /// --api-key-env` with a comma-separated list: its first key is `api_key`, the rest
    /// go here). Each key, `api_key` included, is its own partition of the engine's KV
    /// reuse cache: requests made with different keys never share a cached prefix.
    pub api_keys: Vec<String>,
    /// Largest request body, bytes; larger ones get 413.
    pub max_body_bytes: usize,
    /// Longest a `/v1/*` request may wait for its response, after which it gets 504
    /// (`timeout_error`) and its generation is cancelled; `None`: no limit. The limit
    /// covers the time to the response head: a whole generation for a non-streaming
    /// request, only the wait for a worker slot for a stream (a stream's body, once
    /// started, is not limited). Default: 600 s.
    pub request_timeout: Option<Duration>,
    /// When set, the operator routes (`/v1/fak/*`: revoke, policy reload) require this
    /// key instead of [`GatewayConfig::api_key`], so clients holding the API key cannot
    /// revoke content or reload the policy (`fak serve --admin-key-env`).
    pub admin_key: Option<String>,
    /// The policy manifest file `POST /v1/fak/policy/reload` reads again (`fak serve
    /// --policy FILE`); `None`: the built-in policy, nothing to reload.
    pub policy_path: Option<std::path::PathBuf>,
    /// Longest wait for a whole request head, from a connection's opening or its
    /// previous response's end; then the connection is closed (so also the longest a
    /// keep-alive connection stays idle). `None`: no limit. Default: 10 s. See [`conn`].
    pub header_timeout: Option<Duration>,
    /// Longest the server waits on a stalled client mid-request: for a request body's
    /// next bytes (then 400), or for the client to read a response (then the connection
    /// is closed and the generation cancelled). `None`: no limit. Default: 60 s.
    pub idle_timeout: Option<Duration>,
    /// Most connections open at once; at the cap, new ones wait in the listen backlog
    /// until one closes. Default: 1024.
    pub max_connections: usize,
    /// At shutdown, how long requests in flight may go on; then a waiting request gets
    /// 503 and a stream a final error event. Default: 10 s.
    pub shutdown_grace: Duration,
    /// Longest a stream stays silent: after this long without an event (a long prompt's
    /// prefill, a slow token) it sends a keep-alive in its wire's form, an SSE comment
    /// `: keep-alive` on the OpenAI routes (SSE parsers, the OpenAI SDKs' among them,
    /// skip comment lines), a `ping` event on `/v1/messages` (`event: ping`, data
    /// `{"type": "ping"}`, as Anthropic's API sends). So clients' idle timers do not
    /// fire on a silent prefill, and a client that went away is noticed: the write to
    /// its closed connection fails, which drops the stream and cancels the generation.
    /// `None`: no keep-alives. Default: [`SSE_KEEP_ALIVE`].
    pub sse_keep_alive: Option<Duration>,
    /// The sampling seed of a request that carries none (`fak serve --seed`). `None`
    /// (the default): a fresh seed per request from the OS's random source, so a
    /// repeated request gets another sample, as OpenAI's and Anthropic's APIs and
    /// vLLM's and llama.cpp's servers sample without a seed. `Some(s)`: every such
    /// request samples with `s`, so a repeated request gets the same reply (the only
    /// way to make Anthropic's `/v1/messages` and the Responses API reproducible: they
    /// have no `seed` field). A request's own `seed` (OpenAI Chat Completions and
    /// Completions) always wins.
    pub default_seed: Option<u64>,
}

/// Default of [`GatewayConfig::sse_keep_alive`]: 5 s, well inside clients' stream idle
/// timeouts (tens of seconds), and a few small writes a minute per silent stream.
pub const SSE_KEEP_ALIVE: Duration = Duration::from_secs(5);

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            api_key: None,
            api_keys: Vec::new(),
            max_body_bytes: 8 << 20,
            request_timeout: Some(Duration::from_secs(600)),
            admin_key: None,
            policy_path: None,
            header_timeout: Some(Duration::from_secs(10)),
            idle_timeout: Some(Duration::from_secs(60)),
            max_connections: 1024,
            shutdown_grace: Duration::from_secs(10),
            sse_keep_alive: Some(SSE_KEEP_ALIVE),
            default_seed: None,
        }
    }
}

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    driver: Arc<dyn EngineDriver>,
    metrics: Arc<Metrics>,
    config: Arc<GatewayConfig>,
    /// The tool-call policy every proposed call is adjudicated against.
    policy: Arc<Mutex<Policy>>,
    /// The screen every inbound tool result passes, with its store and audit log.
    screen: Arc<Mutex<Screen>>,
    /// The kept Responses (`previous_response_id`, `GET /v1/responses/{id}`).
    responses: Arc<Mutex<responses::ResponseStore>>,
    /// When the router was built, Unix seconds (the models' `created`).
    created: u64,
}

impl AppState {
    /// The seed a request samples with: its own `given`, else
    /// [`GatewayConfig::default_seed`], else a fresh random one ([`random_seed`]).
    pub(crate) fn seed(&self, given: Option<u64>) -> u64 {
        given
            .or(self.config.default_seed)
            .unwrap_or_else(random_seed)
    }
}

/// A fresh 64-bit seed from the OS's random source (`getrandom`); should that fail (no
/// source on this platform), std's per-process random hash keys, which differ per call.
fn random_seed() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        use std::hash::{BuildHasher, RandomState};
        RandomState::new().hash_one(std::time::SystemTime::now())
    })
}

/// The kernel boundary a gateway enforces: the policy for the model's tool calls and
/// the screen for the tool results clients send back.
pub struct Boundary {
    /// Adjudicates proposed tool calls.
    pub policy: Policy,
    /// Screens inbound tool results (its audit log also receives the adjudications).
    pub screen: Screen,
}

impl Default for Boundary {
    /// The built-in policy and a screen with the default detectors, an in-memory store
    /// and an in-memory audit log.
    fn default() -> Self {
        Boundary {
            policy: Policy::builtin(),
            screen: Screen::new(ScreenConfig::default()),
        }
    }
}

/// Token counts a handler attaches to its response for the request's log line.
#[derive(Clone, Copy, Debug, Default)]
struct UsageNote {
    prompt: usize,
    completion: usize,
    cached: usize,
    stream: bool,
}

/// The application with the built-in default policy
/// ([`Policy::default_manifest`]): every route, the body limit, auth, logging and
/// counting.
pub fn router(driver: Arc<dyn EngineDriver>, config: GatewayConfig) -> Router {
    router_with_policy(driver, config, Policy::builtin())
}

/// The application with `policy` adjudicating the model's tool calls (and the default
/// screen).
pub fn router_with_policy(
    driver: Arc<dyn EngineDriver>,
    config: GatewayConfig,
    policy: Policy,
) -> Router {
    router_with_boundary(
        driver,
        config,
        Boundary {
            policy,
            ..Boundary::default()
        },
    )
}

/// The application with `boundary` enforced on every request.
pub fn router_with_boundary(
    driver: Arc<dyn EngineDriver>,
    config: GatewayConfig,
    boundary: Boundary,
) -> Router {
    router_with_metrics(driver, config, boundary, Arc::new(Metrics::default()))
}

/// [`router_with_boundary`] counting into `metrics`, which the caller keeps to read the
/// counts (`fak guard` prints what the boundary did from them at exit).
pub fn router_with_metrics(
    driver: Arc<dyn EngineDriver>,
    config: GatewayConfig,
    boundary: Boundary,
    metrics: Arc<Metrics>,
) -> Router {
    let limit = config.max_body_bytes;
    let state = AppState {
        driver,
        metrics,
        config: Arc::new(config),
        policy: Arc::new(Mutex::new(boundary.policy)),
        screen: Arc::new(Mutex::new(boundary.screen)),
        responses: Arc::default(),
        created: unix_now(),
    };
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/models", get(models::list))
        .route("/v1/models/{*id}", get(models::retrieve))
        .route("/v1/fak/revoke", post(tools::revoke))
        .route("/v1/fak/policy/reload", post(tools::reload_policy))
        .route_layer(middleware::from_fn_with_state(state.clone(), time_limit))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), wire_errors))
        .layer(middleware::from_fn_with_state(state.clone(), log_and_count))
        .with_state(state)
}

/// Serves `router` on `listener` with the default connection limits
/// ([`GatewayConfig::default`]) until `shutdown` resolves, then shuts down gracefully.
/// See [`serve_with`].
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, router, &GatewayConfig::default(), shutdown).await
}

/// Serves `router` on `listener` until `shutdown` resolves, with `config`'s header and
/// idle timeouts and connection cap; then stops accepting and gives requests in flight
/// [`GatewayConfig::shutdown_grace`] to finish before answering the rest 503 (a stream:
/// a final error event). Returns when every connection is closed, or at most
/// [`conn::FLUSH_MARGIN`] after the grace. Every accepted connection gets
/// `TCP_NODELAY`. The details are in [`conn`].
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    router: Router,
    config: &GatewayConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    conn::serve(listener, router, config, shutdown).await
}

/// [`serve_with`], with `driver`'s side of the shutdown: when `shutdown` resolves the
/// driver drains ([`EngineDriver::drain`]: requests waiting for a worker are answered
/// 503 at once, new ones refused), and when [`GatewayConfig::shutdown_grace`] ends it
/// cancels every generation still running ([`EngineDriver::cancel_all`]), so no
/// engine work outlives the grace. `driver` is the one `router` was built over.
///
/// # Errors
/// As [`serve_with`].
pub async fn serve_engine(
    listener: tokio::net::TcpListener,
    router: Router,
    driver: Arc<dyn EngineDriver>,
    config: &GatewayConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let grace = config.shutdown_grace;
    let d = Arc::clone(&driver);
    let shutdown = async move {
        shutdown.await;
        d.drain();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            d.cancel_all();
        });
    };
    let r = conn::serve(listener, router, config, shutdown).await;
    // Returned at most FLUSH_MARGIN after the grace: nothing may run on.
    driver.cancel_all();
    r
}

async fn log_and_count(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "other".to_string(), |p| p.as_str().to_string());
    let method = req.method().clone();
    let t0 = Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    s.metrics.count_request(&route, status);
    let u = resp
        .extensions()
        .get::<UsageNote>()
        .copied()
        .unwrap_or_default();
    // A stream writes its own line when it ends (see `StreamLog`).
    if !u.stream {
        tracing::info!(
            target: "fak::http",
            "{method} {route} {status} {:.1}ms prompt_tokens={} cached_tokens={} completion_tokens={}",
            t0.elapsed().as_secs_f64() * 1e3,
            u.prompt,
            u.cached,
            u.completion,
        );
    }
    resp
}

async fn auth(State(s): State<AppState>, req: Request, next: Next) -> Response {
    // The operator routes take the admin key when one is set, else the API keys.
    let ok = if req.uri().path().starts_with("/v1/fak/") {
        match &s.config.admin_key {
            Some(admin) => presented_key(req.headers())
                .is_some_and(|g| constant_time_eq(g.as_bytes(), admin.as_bytes())),
            None => matching_key(&s.config, req.headers()).is_ok(),
        }
    } else {
        matching_key(&s.config, req.headers()).is_ok()
    };
    if !ok {
        return ApiError::unauthorized()
            .with_flavor(Flavor::of_path(req.uri().path()))
            .into_response();
    }
    next.run(req).await
}

/// The key a request presents: `Authorization: Bearer KEY` (the scheme
/// case-insensitive, RFC 9110 §11.1), else `x-api-key: KEY`.
fn presented_key(h: &header::HeaderMap) -> Option<&str> {
    h.get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()))
}

/// Which configured API key the request presents: `Ok(None)` when none is configured
/// (every request is let in), `Ok(Some(key))` for a match, `Err(())` otherwise. Every
/// configured key is compared, each without an early exit.
fn matching_key<'a>(
    config: &'a GatewayConfig,
    h: &header::HeaderMap,
) -> Result<Option<&'a str>, ()> {
    let mut keys = config.api_key.iter().chain(&config.api_keys).peekable();
    if keys.peek().is_none() {
        return Ok(None);
    }
    let given = presented_key(h).ok_or(())?;
    keys.fold(None, |found, k| {
        let eq = constant_time_eq(given.as_bytes(), k.as_bytes());
        found.or(eq.then_some(k.as_str()))
    })
    .map(Some)
    .ok_or(())
}

/// The engine's form of the wire's `context_overflow` field.
fn context_overflow(c: fak_wire::ContextOverflow) -> fak_engine::ContextOverflow {
    match c {
        fak_wire::ContextOverflow::Error => fak_engine::ContextOverflow::Error,
        fak_wire::ContextOverflow::Shift => fak_engine::ContextOverflow::Shift,
        fak_wire::ContextOverflow::Rebuild => fak_engine::ContextOverflow::Rebuild,
    }
}

/// The KV reuse cache partition of a request ([`GenerateRequest::cache_partition`]):
/// named after the API key it authenticated with (the key's sha256, never the key; no
/// key configured: one partition for all) and its `cache_salt` (vLLM's field: a secret
/// the client chooses, so that only requests carrying the same salt share a cached
/// prefix). Requests share a prefix only when both are equal.
///
/// # Errors
/// 400 for an empty `cache_salt` (as vLLM answers).
fn cache_partition(
    s: &AppState,
    h: &header::HeaderMap,
    salt: Option<&str>,
    flavor: Flavor,
) -> Result<String, ApiError> {
    if salt == Some("") {
        return Err(
            ApiError::bad_request("cache_salt must be a non-empty string when given")
                .with_flavor(flavor),
        );
    }
    let key = matching_key(&s.config, h)
        .ok()
        .flatten()
        .map(fak_ctxmmu::digest)
        .unwrap_or_default();
    // The key part is hex or empty, so the separator keeps the two apart.
    Ok(match salt {
        Some(salt) => format!("key:{key}\nsalt:{salt}"),
        None => format!("key:{key}"),
    })
}

/// Answers 504 when the response (its head, for a stream) takes longer than
/// [`GatewayConfig::request_timeout`]. The handler is dropped then, and with it its
/// event stream, which cancels the generation.
async fn time_limit(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let Some(limit) = s.config.request_timeout else {
        return next.run(req).await;
    };
    let flavor = Flavor::of_path(req.uri().path());
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(r) => r,
        Err(_) => ApiError::timeout(limit).with_flavor(flavor).into_response(),
    }
}

/// Compares without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Longest request target (path and query) the router serves, bytes; a longer one is a
/// 414 in the wire's error shape. (hyper itself answers a target over 64 KiB with a bare
/// 414 before any route sees it.)
pub const MAX_URI_BYTES: usize = 8 << 10;

/// Makes every error answer JSON in its wire's error shape ([`Flavor::of_request`]).
///
/// Two refusals come from the request head alone, before any route or body: a target
/// over [`MAX_URI_BYTES`] is a 414, and a `Content-Length` declaring a body over
/// [`GatewayConfig::max_body_bytes`] a 413 at once (the connection is then closed with
/// the body unread; a body without the header, or declared under the limit, is limited
/// as it is read by axum's `DefaultBodyLimit`; without this a client declaring
/// gigabytes waited for the idle timeout, or sent the limit's worth, before its answer).
///
/// An error the framework writes itself (405 for a wrong method, with an empty body; a
/// path or body rejection in text/plain) is rewritten with the same status, its text as
/// the message (405: the method and the path; axum adds the `Allow` header after) and
/// the headers it had besides the body's. Answers that already are JSON, and
/// successes, pass as they are.
async fn wire_errors(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let flavor = Flavor::of_request(req.uri().path(), req.headers());
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let target = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if target > MAX_URI_BYTES {
        return ApiError::uri_too_long(target, MAX_URI_BYTES)
            .with_flavor(flavor)
            .into_response();
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > s.config.max_body_bytes as u64) {
        return ApiError::too_large(s.config.max_body_bytes)
            .with_flavor(flavor)
            .into_response();
    }
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    // The framework's own error texts are short; more is not read.
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = if status == StatusCode::METHOD_NOT_ALLOWED {
        format!("{method} is not allowed on {path} (the Allow header lists the methods that are)")
    } else if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_string()
    } else {
        text
    };
    let mut out = ApiError::status(status, message)
        .with_flavor(flavor)
        .into_response();
    parts.headers.remove(header::CONTENT_TYPE);
    parts.headers.remove(header::CONTENT_LENGTH);
    for (k, v) in &parts.headers {
        if !out.headers().contains_key(k) {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no route {} {}", req.method(), req.uri().path()))
        .with_flavor(Flavor::of_request(req.uri().path(), req.headers()))
}

/// The models a server lists as served but cannot answer now, each with the reason:
/// with `fak serve --route`, the routes whose engine failed while others are ready.
/// Given to [`report_models_down`].
pub type ModelsDown = Arc<dyn Fn() -> Vec<(String, String)> + Send + Sync>;

/// `app` with `/health` saying which models are down ([`ModelsDown`]): while the
/// engine is ready and some are down, `/health` answers 200 (the server serves the
/// rest) with `"status": "degraded"` and `"down": [{"model", "error"}]`.
pub fn report_models_down(app: Router, down: ModelsDown) -> Router {
    app.layer(axum::Extension(down))
}

/// `/health`'s body when the engine is ready.
#[derive(serde::Serialize)]
struct HealthReady<'a> {
    /// `ok`, or `degraded` when some models are down.
    status: &'static str,
    engine: &'a str,
    /// The models served.
    models: Vec<String>,
    /// The models down, each with why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    down: Vec<ModelDown>,
}

/// `/health`'s body (with a 503) while the engine loads or after it failed to.
#[derive(serde::Serialize)]
struct HealthNotReady<'a> {
    /// `loading` or `failed`.
    status: &'static str,
    engine: &'a str,
    /// Why loading failed (left out while loading).
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// One entry of [`HealthReady::down`].
#[derive(serde::Serialize)]
struct ModelDown {
    model: String,
    error: String,
}

async fn health(State(s): State<AppState>, down: Option<axum::Extension<ModelsDown>>) -> Response {
    let models: Vec<String> = s.driver.models().into_iter().map(|m| m.id).collect();
    match s.driver.readiness() {
        Readiness::Ready => {
            let down: Vec<ModelDown> = down
                .map(|axum::Extension(f)| f())
                .unwrap_or_default()
                .into_iter()
                .map(|(model, error)| ModelDown { model, error })
                .collect();
            Json(HealthReady {
                status: if down.is_empty() { "ok" } else { "degraded" },
                engine: s.driver.id(),
                models,
                down,
            })
            .into_response()
        }
        Readiness::Loading => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "5")],
            Json(HealthNotReady {
                status: "loading",
                engine: s.driver.id(),
                error: None,
            }),
        )
            .into_response(),
        Readiness::Failed(m) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(HealthNotReady {
                status: "failed",
                engine: s.driver.id(),
                error: Some(m),
            }),
        )
            .into_response(),
    }
}

async fn metrics_text(State(s): State<AppState>) -> Response {
    let ready = s.driver.readiness() == Readiness::Ready;
    let mut body = s.metrics.render(s.driver.stats(), ready);
    let boundary = {
        let screen = s.screen.lock().unwrap_or_else(|p| p.into_inner());
        metrics::BoundaryStats {
            audit_write_failures: screen.audit().failures(),
            store_items: screen.store().len(),
            store_bytes: screen.store().bytes(),
            store_damaged: screen.store().damaged().len(),
            revocations: screen.revocations().len(),
        }
    };
    boundary.render(&mut body);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// The body as JSON of type `T`, or a 400/413 in `flavor`'s shape.
fn parse_body<T: serde::de::DeserializeOwned>(
    s: &AppState,
    body: Result<Bytes, BytesRejection>,
    flavor: Flavor,
) -> Result<T, ApiError> {
    parse_json(&body_bytes(s, body, flavor)?, flavor)
}

/// The body's bytes, or a 400/413 in `flavor`'s shape.
fn body_bytes(
    s: &AppState,
    body: Result<Bytes, BytesRejection>,
    flavor: Flavor,
) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(s.config.max_body_bytes)
        } else {
            ApiError::bad_request(format!("reading the body: {}", r.body_text()))
        }
        .with_flavor(flavor)
    })
}

/// `bytes` as JSON of type `T`, or a 400 in `flavor`'s shape naming the field at fault
/// (`invalid request body: messages[0].role: unknown variant ...`). Anything but
/// whitespace after the JSON value is a 400 too (`trailing characters at line L column
/// C`), as `serde_json::from_slice` answers.
fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8], flavor: Flavor) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let msg = if path == "." {
            format!("invalid request body: {}", e.inner())
        } else {
            format!("invalid request body: {path}: {}", e.inner())
        };
        ApiError::bad_request(msg).with_flavor(flavor)
    })?;
    de.end().map_err(|e| {
        ApiError::bad_request(format!(
            "invalid request body: {e} (nothing but whitespace may follow the JSON value)"
        ))
        .with_flavor(flavor)
    })?;
    Ok(value)
}

/// A started generation: its counts from the `Start` event and the rest of its events.
struct Started {
    prompt_tokens: usize,
    cached_tokens: usize,
    /// Which choice of its request it is (the OpenAI wire's `n`; 0 for the first or
    /// only one). Only choice 0 adds the prompt's tokens to the metrics: the prompt is
    /// one prompt, however many choices.
    choice: usize,
    events: EventStream,
    /// The route, for a stream's log line.
    route: &'static str,
    /// When the request was submitted.
    t0: Instant,
}

/// The log line of a streamed response, written once when the stream ends: finished,
/// failed, or dropped because the client went away.
struct StreamLog {
    route: &'static str,
    t0: Instant,
    prompt: usize,
    cached: usize,
    completion: Option<usize>,
    outcome: &'static str,
}

impl StreamLog {
    fn new(st: &Started) -> Self {
        StreamLog {
            route: st.route,
            t0: st.t0,
            prompt: st.prompt_tokens,
            cached: st.cached_tokens,
            completion: None,
            outcome: "client went away",
        }
    }
}

impl Drop for StreamLog {
    fn drop(&mut self) {
        tracing::info!(
            target: "fak::http",
            "POST {} 200 {:.1}ms prompt_tokens={} cached_tokens={} completion_tokens={} (stream: {})",
            self.route,
            self.t0.elapsed().as_secs_f64() * 1e3,
            self.prompt,
            self.cached,
            self.completion.map_or_else(|| "?".to_string(), |n| n.to_string()),
            self.outcome,
        );
    }
}

/// Submits `req` (off the async threads) and waits for the `Start` event, so that any
/// error before generation becomes a proper status.
async fn start(
    s: &AppState,
    req: GenerateRequest,
    flavor: Flavor,
    route: &'static str,
) -> Result<Started, ApiError> {
    let mut v = start_n(s, req, 1, flavor, route).await?;
    v.pop()
        .ok_or_else(|| ApiError::internal("the engine started no generation").with_flavor(flavor))
}

/// [`start`] for `n` choices of one request ([`fak_engine::EngineDriver::submit_n`]):
/// every choice's `Start` is awaited, so an error of any before generation is the
/// request's status (the others are then dropped, so cancelled).
async fn start_n(
    s: &AppState,
    req: GenerateRequest,
    n: usize,
    flavor: Flavor,
    route: &'static str,
) -> Result<Vec<Started>, ApiError> {
    let t0 = Instant::now();
    let driver = Arc::clone(&s.driver);
    let submitted = tokio::task::spawn_blocking(move || {
        if n == 1 {
            driver.submit(req).map(|e| vec![e])
        } else {
            driver.submit_n(req, n)
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("submit failed: {e}")).with_flavor(flavor))?;
    let streams = submitted.map_err(|e| ApiError::from(e).with_flavor(flavor))?;
    let mut out = Vec::with_capacity(streams.len());
    for (choice, mut events) in streams.into_iter().enumerate() {
        match events.next().await {
            Some(EngineEvent::Start {
                prompt_tokens,
                cached_tokens,
            }) => out.push(Started {
                prompt_tokens,
                cached_tokens,
                choice,
                events,
                route,
                t0,
            }),
            Some(EngineEvent::Error(e)) => return Err(ApiError::from(e).with_flavor(flavor)),
            _ => {
                return Err(
                    ApiError::internal("the engine ended the request before starting it")
                        .with_flavor(flavor),
                )
            }
        }
    }
    Ok(out)
}

/// The prompt's counts a choice adds to the metrics: the prompt's for choice 0, none
/// for the others (one prompt, counted once).
fn metered(choice: usize, prompt: usize, cached: usize) -> (usize, usize) {
    if choice == 0 {
        (prompt, cached)
    } else {
        (0, 0)
    }
}

/// A whole generation, for the non-streaming responses.
struct Finished {
    prompt_tokens: usize,
    cached_tokens: usize,
    text: String,
    tool_calls: Vec<fak_engine::ToolCall>,
    /// The generated tokens' logprob records (empty unless asked for).
    logprobs: Vec<fak_engine::TokenLogprob>,
    done: fak_engine::Done,
}

impl Finished {
    /// `body` as the JSON response, carrying this generation's token counts for the
    /// request's log line.
    fn respond(&self, body: impl serde::Serialize) -> Response {
        with_note(
            Json(body).into_response(),
            UsageNote {
                prompt: self.prompt_tokens,
                completion: self.done.completion_tokens,
                cached: self.cached_tokens,
                stream: false,
            },
        )
    }
}

async fn finish(s: &AppState, st: Started, flavor: Flavor) -> Result<Finished, ApiError> {
    let Started {
        prompt_tokens,
        cached_tokens,
        choice,
        events,
        ..
    } = st;
    let c = events
        .collect()
        .await
        .map_err(|e: EngineError| ApiError::from(e).with_flavor(flavor))?;
    let done = c
        .done
        .ok_or_else(|| ApiError::internal("no result").with_flavor(flavor))?;
    let (prompt_tokens, cached_tokens) = prompt_counts(&done, prompt_tokens, cached_tokens);
    let (p, k) = metered(choice, prompt_tokens, cached_tokens);
    s.metrics.add_tokens(p, done.completion_tokens, k);
    s.metrics.observe_latency(&done);
    Ok(Finished {
        prompt_tokens,
        cached_tokens,
        text: c.text,
        tool_calls: c.tool_calls,
        logprobs: c.logprobs,
        done,
    })
}

/// The prompt's token counts: those `Done` brought when the driver learnt them only at
/// the end (an upstream), else `Start`'s.
fn prompt_counts(d: &fak_engine::Done, prompt: usize, cached: usize) -> (usize, usize) {
    d.prompt_usage
        .map_or((prompt, cached), |u| (u.prompt_tokens, u.cached_tokens))
}

/// Seconds since the Unix epoch (`created` fields).
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A fresh id with `prefix` (`chatcmpl-`, `cmpl-`, `msg_`): time and a counter, unique
/// within the process.
fn new_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}{:x}{:06x}",
        unix_now(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// `max_tokens`-style field: at least 1.
fn positive(name: &str, v: i64, flavor: Flavor) -> Result<usize, ApiError> {
    if v < 1 {
        return Err(
            ApiError::bad_request(format!("{name} must be at least 1 (got {v})"))
                .with_flavor(flavor),
        );
    }
    usize::try_from(v)
        .map_err(|_| ApiError::bad_request(format!("{name} {v} is too large")).with_flavor(flavor))
}

/// A response with a usage note for the log line.
fn with_note(mut r: Response, note: UsageNote) -> Response {
    r.extensions_mut().insert(note);
    r
}
