//! fak-upstream: the upstream drivers, HTTP clients of another server behind
//! fak-engine's [`EngineDriver`] trait. They live in their own crate so that fak-engine
//! (the trait, the in-kernel driver, routing, the mock) carries no HTTP client, and so
//! that their wire is fak-wire's types, the same ones the gateway serves. The caller
//! adds them to its registry with [`register`] ([`SPECS`]: `openai-upstream`,
//! `anthropic-upstream`); their configuration, [`UpstreamConfig`], stays in fak-engine
//! as part of its `EngineConfig`.
//!
//! Another server does the generating, and everything above the
//! driver — the screening of tool results, the adjudication of tool calls, auth, limits,
//! metrics — stays in this process. The upstream only ever sees what the gateway let
//! through, and the client only ever sees calls the gateway allowed.
//!
//! Two wires share one machinery (several upstreams, health checks, least-loaded choice,
//! retries, timeouts, cancellation; all described below): `openai-upstream` speaks an
//! OpenAI-compatible API (vLLM, llama.cpp's server, SGLang, another fak), and
//! `anthropic-upstream` an Anthropic-compatible Messages API (`POST /v1/messages`;
//! another fak, or any server speaking it); its requests and replies are described in
//! the `anthropic` submodule's docs. What follows describes the OpenAI wire where the
//! two differ.
//!
//! **Requests.** Written from [`fak_wire::openai`]'s types. A chat prompt becomes
//! `POST {base}/v1/chat/completions`, a plain prompt or one of token ids
//! `POST {base}/v1/completions` (`prompt`: the text, or the ids), always with `stream: true` and
//! `stream_options.include_usage: true`. Mapped: `messages` (assistant `tool_calls`,
//! `tool` results with their `tool_call_id`), `tools` / `tool_choice`, `max_tokens`,
//! `temperature`, `top_p`, `stop`, `logprobs` (`top_logprobs` on chat, the legacy count
//! on completions); `seed` only when not 0 (0 is what
//! [`SamplingParams`](fak_engine::SamplingParams)'s default carries, and sending it would
//! make every such request sample alike; the gateway gives each request its own seed or
//! a fresh random one, unless `fak serve --seed` fixes it); `top_k`, `min_p` and
//! `repetition_penalty` (vLLM and llama.cpp extensions) only when set. `n` is never
//! sent: a request for `n` choices is `n` upstream requests, one choice each, seeded
//! [`fak_engine::choice_seed`]`(seed, i)` ([`EngineDriver::submit_n`]'s default), as
//! every field here is mapped into a request of the driver's own rather than forwarded. A request's
//! structured output ([`SamplingParams::grammar`](fak_engine::SamplingParams::grammar))
//! goes as `response_format` on chat (`json_object`; `json_schema` with the client's
//! `name`, `description`, `strict`); a Lark grammar is refused
//! ([`EngineDriver::accepts_grammar`]), and so is a format on a completions prompt. The
//! reply is then checked against the format (the `reply_check` module: a reply that
//! breaks it ends in an [`EngineError::Upstream`] in place of its `Done`).
//!
//! **Replies.** Each server-sent event is read as fak-wire's
//! [`ChatCompletionChunk`](wire::ChatCompletionChunk) (chat) or
//! [`Completion`](wire::Completion) (completions), the types the gateway writes; the
//! models list as [`ModelList`](wire::ModelList). Fields the API does not define are
//! ignored (llama.cpp's `timings` and `reasoning_content`, vLLM's `stop_reason` is
//! read), missing ones take their defaults; a field of another type is an
//! [`EngineError::Upstream`] naming its path (`choices[0].delta.content`). The events
//! map to [`EngineEvent`]s:
//!
//! - `Start` as soon as the upstream answers `200` (so a 4xx or 429 from the upstream is
//!   still this server's status, not an error inside a stream). Its counts are 0: an
//!   OpenAI-compatible server reports usage only in its last chunk. [`Done::prompt_usage`]
//!   then carries `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`
//!   (0 when absent), which the gateway reports. An upstream that sends no usage in a
//!   stream (llama.cpp's Python server ignores `stream_options`) leaves the prompt's
//!   count at 0.
//! - `Text` for each content delta, relayed as it arrives (preceded by its `Logprobs`
//!   when asked; ids are not on the wire, so records carry id 0).
//! - Tool-call deltas are assembled per `index` and sent as whole [`ToolCall`]s only
//!   once the upstream has finished, never partial; a call whose arguments are not a
//!   JSON object is sent marked malformed (the gateway denies it).
//! - `Done`: `finish_reason` `length` → `Length`, anything else (`stop`, `tool_calls`)
//!   → `Stop`; `completion_tokens` from the usage (else the number of content deltas).
//!   A `[DONE]` before any `finish_reason` is a reply cut short (llama.cpp's Python
//!   server interrupted by another request), an error like a stream that ends early.
//!
//! **Errors.** Upstream 429 and 503 → [`EngineError::Overloaded`] with its
//! `Retry-After`; 404 naming a model → [`EngineError::UnknownModel`]; 401/403 (our key
//! refused: the operator's problem, not the client's) and a 404 without a model →
//! [`EngineError::Upstream`]; other 4xx → [`EngineError::InvalidRequest`] with the
//! upstream's message. Connection failures, 5xx and timeouts are retried
//! ([`UpstreamConfig::retries`], backoff 0.25 s doubling) as long as nothing has been
//! relayed to the client, then become [`EngineError::Upstream`] (502) or
//! [`EngineError::UpstreamTimeout`] (504). An event that is not JSON, a field of the
//! wrong type, an `error` event ([`wire::ServerError`]: vLLM's and llama.cpp's carry an
//! integer `code`), or a stream that ends before the reply finished is an error, never
//! a panic.
//!
//! **Timeouts.** [`UpstreamConfig::timeout`] bounds connecting and the wait for the
//! response head; [`UpstreamConfig::idle_timeout`] bounds each wait for the next piece of
//! the body (a stall mid-reply).
//!
//! **Cancellation.** Each generation runs as a task on the driver's own small tokio
//! runtime; dropping its [`EventStream`] ends the task, which drops the response and
//! closes the connection, which a serving engine takes as the client leaving.
//!
//! **Several upstreams, health and readiness.** [`UpstreamConfig::base_urls`] may name
//! several servers. Each has a health state, kept by a background check every
//! [`UpstreamConfig::health_interval`]: `GET {base}/health` (a 2xx is healthy, and so is
//! a 404 or 405 from a server without that route; another status or no answer is not),
//! and `GET {base}/v1/models` only while the upstream's models are not known (at start
//! and after it was down): llama.cpp's Python server stops the generation under way
//! when any request for its model arrives, its models list included. A failing check takes the upstream out of rotation, a passing one
//! puts it back. A request goes to the healthy upstream serving its model with the fewest
//! requests in flight (ties taken in turn); an attempt that fails before anything reached
//! the client is retried on another healthy upstream when there is one. Until the first
//! check answers the driver reports [`Readiness::Loading`], then [`Readiness::Ready`]
//! while at least one upstream is healthy, else [`Readiness::Failed`] with the reasons;
//! requests while none is healthy are [`EngineError::NotReady`].
//! [`UpstreamDriver::upstreams`] lists the upstreams and their state. Served models:
//! [`UpstreamConfig::model`] when given, else every id the healthy upstreams list
//! (context length from its `context_length` or vLLM's `max_model_len`, 0 when
//! unknown).
//!
//! **Transport.** Plain HTTP/1.1 (hyper's client with a connection pool). TLS is not
//! built in: an `https://` base URL is an error at start. Serving engines usually sit on
//! loopback or a private network next to fak; a remote one is reached through a local
//! TLS tunnel.

use fak_engine::registry::{DriverSpec, Registry};
use fak_engine::tools::new_call_id;
pub use fak_engine::upstream::{normalize_base_url, UpstreamConfig};
use fak_engine::{
    check_model, event_channel, Done, EngineConfig, EngineDriver, EngineError, EngineEvent,
    EngineStats, EventSink, EventStream, FinishReason, GenerateRequest, GrammarSpec, ModelInfo,
    Prompt, PromptUsage, Readiness, TokenLogprob, ToolCall, ToolChoice, TopLogprob,
};
use fak_wire::openai as wire;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod anthropic;
mod reply_check;

/// The upstream drivers' registry entries, in the order [`register`] adds them.
pub const SPECS: [DriverSpec; 2] = [SPEC, ANTHROPIC_SPEC];

/// Adds [`SPECS`] to `registry` (after the drivers it holds).
pub fn register(registry: &mut Registry) -> &mut Registry {
    for s in SPECS {
        registry.add(s);
    }
    registry
}

/// The registry entry of the OpenAI wire: needs [`UpstreamConfig::base_urls`].
pub const SPEC: DriverSpec = DriverSpec {
    id: "openai-upstream",
    about: "an OpenAI-compatible server (vLLM, llama.cpp, another fak) generates; the boundary stays here",
    build: |cfg: &EngineConfig| {
        Ok(Arc::new(UpstreamDriver::start(cfg.upstream.clone())?) as Arc<dyn EngineDriver>)
    },
};

/// The registry entry of the Anthropic wire: needs [`UpstreamConfig::base_urls`].
pub const ANTHROPIC_SPEC: DriverSpec = DriverSpec {
    id: "anthropic-upstream",
    about: "an Anthropic-compatible Messages server generates; the client's request bytes are forwarded, the boundary stays here",
    build: |cfg: &EngineConfig| {
        Ok(Arc::new(UpstreamDriver::start_wire(
            cfg.upstream.clone(),
            Wire::Anthropic,
        )?) as Arc<dyn EngineDriver>)
    },
};

/// The API an upstream speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// OpenAI's chat completions and completions (`openai-upstream`).
    OpenAi,
    /// Anthropic's Messages (`anthropic-upstream`).
    Anthropic,
}

impl Wire {
    /// The driver id of this wire.
    pub fn driver_id(self) -> &'static str {
        match self {
            Wire::OpenAi => SPEC.id,
            Wire::Anthropic => ANTHROPIC_SPEC.id,
        }
    }
}

/// Longest wait for one health check or models-list answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes read of an error body or a models list.
const SMALL_BODY_LIMIT: usize = 1 << 20;
/// Most bytes of one server-sent event (or of a line not yet ended).
const MAX_EVENT_BYTES: usize = 16 << 20;
/// The first retry's wait; each further one doubles it.
const BACKOFF: Duration = Duration::from_millis(250);

/// What the driver knows of one upstream.
enum State {
    /// The first check is under way.
    Probing,
    /// Healthy; the models it serves.
    Up(Vec<ModelInfo>),
    /// Its last check failed, for this reason.
    Down(String),
}

/// One upstream server.
struct Upstream {
    /// `http://HOST:PORT[/PREFIX]`, without a trailing `/` or `/v1`.
    base: String,
    state: Mutex<State>,
    /// Attempts sent to it and not ended.
    in_flight: AtomicUsize,
}

/// An upstream's state, as [`UpstreamDriver::upstreams`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamStatus {
    /// Its normalized base URL.
    pub base_url: String,
    /// In rotation: its last health check passed.
    pub healthy: bool,
    /// Why it is out of rotation (`None` when healthy or not checked yet).
    pub error: Option<String>,
    /// Requests sent to it and not ended.
    pub in_flight: usize,
}

struct Inner {
    cfg: UpstreamConfig,
    wire: Wire,
    ups: Vec<Upstream>,
    /// Where the next tie between equally loaded upstreams is broken.
    turn: AtomicUsize,
    /// The operator's key as its header (`authorization` or `x-api-key`).
    auth: Option<(HeaderName, HeaderValue)>,
    client: Client<HttpConnector, Full<Bytes>>,
    active: AtomicUsize,
}

/// The upstream driver. See the module docs.
pub struct UpstreamDriver {
    inner: Arc<Inner>,
    /// Runs the HTTP; `None` only while dropping.
    rt: Option<tokio::runtime::Runtime>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl UpstreamDriver {
    /// Starts the driver: its runtime, its HTTP client, and the first models request
    /// (in the background; the driver reports [`Readiness::Loading`] until it answers).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] without a base URL or with a bad one, or an API
    /// key that cannot be a header; [`EngineError::Internal`] if the runtime cannot
    /// start.
    pub fn start(cfg: UpstreamConfig) -> Result<Self, EngineError> {
        Self::start_wire(cfg, Wire::OpenAi)
    }

    /// As [`UpstreamDriver::start`], for an upstream speaking `wire`.
    ///
    /// # Errors
    /// As [`UpstreamDriver::start`].
    pub fn start_wire(cfg: UpstreamConfig, wire: Wire) -> Result<Self, EngineError> {
        if cfg.base_urls.is_empty() {
            return Err(EngineError::InvalidRequest(format!(
                "the {} engine needs a base URL (--base-url)",
                wire.driver_id()
            )));
        }
        if cfg.health_interval < Duration::from_millis(10) {
            return Err(EngineError::InvalidRequest(
                "the upstream health interval must be at least 10 ms".into(),
            ));
        }
        let mut bases: Vec<String> = Vec::new();
        for url in &cfg.base_urls {
            let b = normalize_base_url(url)?;
            if !bases.contains(&b) {
                bases.push(b);
            }
        }
        let auth = match &cfg.api_key {
            None => None,
            Some(k) => {
                let (name, value) = match wire {
                    Wire::OpenAi => (header::AUTHORIZATION, format!("Bearer {k}")),
                    Wire::Anthropic => (HeaderName::from_static("x-api-key"), k.clone()),
                };
                let mut v = HeaderValue::from_str(&value).map_err(|_| {
                    EngineError::InvalidRequest(
                        "the upstream API key holds characters a header cannot carry".into(),
                    )
                })?;
                v.set_sensitive(true);
                Some((name, v))
            }
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fak-upstream")
            .enable_all()
            .build()
            .map_err(|e| EngineError::Internal(format!("starting the upstream runtime: {e}")))?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(cfg.timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        let ups = bases
            .into_iter()
            .map(|base| Upstream {
                base,
                state: Mutex::new(State::Probing),
                in_flight: AtomicUsize::new(0),
            })
            .collect();
        let inner = Arc::new(Inner {
            cfg,
            wire,
            ups,
            turn: AtomicUsize::new(0),
            auth,
            client,
            active: AtomicUsize::new(0),
        });
        for i in 0..inner.ups.len() {
            rt.spawn(watch(Arc::clone(&inner), i));
        }
        Ok(UpstreamDriver {
            inner,
            rt: Some(rt),
        })
    }

    /// The normalized base URL of the first upstream.
    pub fn base_url(&self) -> &str {
        self.inner.ups.first().map_or("", |u| u.base.as_str())
    }

    /// Each upstream and its state, in the order given.
    pub fn upstreams(&self) -> Vec<UpstreamStatus> {
        self.inner
            .ups
            .iter()
            .map(|u| {
                let (healthy, error) = match &*lock(&u.state) {
                    State::Probing => (false, None),
                    State::Up(_) => (true, None),
                    State::Down(m) => (false, Some(m.clone())),
                };
                UpstreamStatus {
                    base_url: u.base.clone(),
                    healthy,
                    error,
                    in_flight: u.in_flight.load(Ordering::SeqCst),
                }
            })
            .collect()
    }
}

impl Drop for UpstreamDriver {
    fn drop(&mut self) {
        // Never blocks, so the driver may be dropped on an async thread too.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Checks upstream `i` every health interval, for the driver's life.
async fn watch(inner: Arc<Inner>, i: usize) {
    let Some(up) = inner.ups.get(i) else {
        return;
    };
    loop {
        let next = inner.check(&up.base, known_models(up)).await;
        *lock(&up.state) = next;
        tokio::time::sleep(inner.cfg.health_interval).await;
    }
}

/// The models of an upstream that is up.
fn known_models(up: &Upstream) -> Option<Vec<ModelInfo>> {
    match &*lock(&up.state) {
        State::Up(m) => Some(m.clone()),
        _ => None,
    }
}

/// A hyper error with its causes (`client error (Connect): tcp connect error: ...`).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

/// Reads a whole (small) body: at most `limit` bytes, within `within`.
async fn read_small(body: Incoming, limit: usize, within: Duration) -> Result<Vec<u8>, String> {
    let read = async move {
        let mut body = body;
        let mut out = Vec::new();
        while let Some(f) = body.frame().await {
            let f = f.map_err(|e| chain(&e))?;
            if let Ok(d) = f.into_data() {
                if out.len() + d.len() > limit {
                    return Err(format!("the body is larger than {limit} bytes"));
                }
                out.extend_from_slice(&d);
            }
        }
        Ok(out)
    };
    tokio::time::timeout(within, read)
        .await
        .map_err(|_| format!("the body did not arrive within {} s", within.as_secs_f64()))?
}

/// At most 300 characters of `s`, for messages.
fn excerpt(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(300) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    }
}

/// The message of an error body or error event ([`wire::ServerError`]: `error.message`,
/// `error`, `message` or `detail` of a JSON object), else the text itself.
fn body_message(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let msg = match serde_json::from_str::<wire::ServerError>(&text) {
        Ok(e) => e.text().map_or_else(|| excerpt(&text), excerpt),
        Err(_) => excerpt(&text),
    };
    if msg.is_empty() {
        "(no message)".into()
    } else {
        msg
    }
}

/// Parses an upstream's reply or event `text` as `T`. The error says whether the text
/// was not JSON at all or which field (its path, e.g. `choices[0].index`) is not of
/// the API's type, and quotes the start of the text.
fn parse<'a, T: serde::Deserialize<'a>>(text: &'a str, what: &str) -> Result<T, String> {
    let not_json = |e: serde_json::Error| {
        format!(
            "{what} that is not JSON of the API's shape ({e}): {}",
            excerpt(text)
        )
    };
    let mut d = serde_json::Deserializer::from_str(text);
    let v = serde_path_to_error::deserialize(&mut d).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        // Inside the wire's tagged unions the rest of the path is in the message.
        let (path, message) = fak_wire::error_path(&path, &inner.to_string());
        if inner.is_syntax() || inner.is_eof() || path == "." {
            not_json(inner)
        } else {
            format!(
                "{what} whose `{path}` is not of the API's type ({message}): {}",
                excerpt(text)
            )
        }
    })?;
    d.end().map_err(not_json)?;
    Ok(v)
}

/// A failed attempt: the error and whether another attempt may help.
#[derive(Debug)]
struct Failure {
    error: EngineError,
    retryable: bool,
}

impl Failure {
    fn fatal(error: EngineError) -> Self {
        Failure {
            error,
            retryable: false,
        }
    }
    fn retry(error: EngineError) -> Self {
        Failure {
            error,
            retryable: true,
        }
    }
}

/// What a non-200 upstream status means here (see the module docs). `client_key`: the
/// request carried the client's own key (a 401/403 is then the client's
/// [`EngineError::Refused`]).
fn status_failure(
    status: StatusCode,
    body: &[u8],
    retry_after: Option<u64>,
    url: &str,
    job: &Job,
) -> Failure {
    let (model, served) = (&job.model, &job.served);
    let msg = body_message(body);
    match status.as_u16() {
        401 | 403 if job.client_key => Failure::fatal(EngineError::Refused {
            status: status.as_u16(),
            message: msg,
        }),
        // 529: Anthropic's "overloaded".
        429 | 503 | 529 => Failure::fatal(EngineError::Overloaded {
            queued: 0,
            retry_after_s: retry_after.unwrap_or(1),
        }),
        // A model this server lists (named by --upstream-model or a route) that the
        // upstream refuses: say so in the upstream's words, not as an unknown model.
        404 if msg.to_ascii_lowercase().contains("model") && job.named => {
            Failure::fatal(EngineError::Upstream(format!(
                "{url} does not serve '{model}' ({msg}); --upstream-model, or a route's \
                 MODEL, must be a model id the upstream accepts"
            )))
        }
        404 if msg.to_ascii_lowercase().contains("model") => {
            Failure::fatal(EngineError::UnknownModel {
                requested: model.clone(),
                available: served.clone(),
            })
        }
        404 => Failure::fatal(EngineError::Upstream(format!(
            "{url} answered 404 (is the base URL right?): {msg}"
        ))),
        401 | 403 => Failure::fatal(EngineError::Upstream(format!(
            "the upstream refused this server's credentials ({status}): {msg}"
        ))),
        408 => Failure::retry(EngineError::UpstreamTimeout(format!(
            "the upstream timed out the request (408): {msg}"
        ))),
        400..=499 => Failure::fatal(EngineError::InvalidRequest(format!(
            "the upstream rejected the request ({status}): {msg}"
        ))),
        _ => Failure::retry(EngineError::Upstream(format!(
            "the upstream answered {status}: {msg}"
        ))),
    }
}

impl Inner {
    /// A request to `base`: `extra` headers (a job's: the client's, passed on) go after
    /// the operator's key, and on the Anthropic wire an `anthropic-version` is added when
    /// `extra` brings none.
    fn request(
        &self,
        method: Method,
        base: &str,
        path: &str,
        body: Bytes,
        extra: &[(HeaderName, HeaderValue)],
    ) -> Result<Request<Full<Bytes>>, String> {
        let url = format!("{base}{path}");
        let uri: Uri = url.parse().map_err(|e| format!("bad URL {url}: {e}"))?;
        let mut b = Request::builder().method(method.clone()).uri(uri).header(
            header::USER_AGENT,
            concat!("fak/", env!("CARGO_PKG_VERSION")),
        );
        if method == Method::POST {
            b = b.header(header::CONTENT_TYPE, "application/json");
        }
        if let Some((name, value)) = &self.auth {
            b = b.header(name, value.clone());
        }
        for (name, value) in extra {
            b = b.header(name, value.clone());
        }
        if self.wire == Wire::Anthropic && !extra.iter().any(|(n, _)| n == anthropic::VERSION) {
            b = b.header(anthropic::VERSION, anthropic::DEFAULT_VERSION);
        }
        b.body(Full::new(body))
            .map_err(|e| format!("building the request to {url}: {e}"))
    }

    /// One health check of the upstream at `base` (see the module docs): its new state.
    async fn check(&self, base: &str, known: Option<Vec<ModelInfo>>) -> State {
        let url = format!("{base}/health");
        let within = self.cfg.timeout.min(PROBE_TIMEOUT);
        let req = match self.request(Method::GET, base, "/health", Bytes::new(), &[]) {
            Ok(r) => r,
            Err(e) => return State::Down(e),
        };
        match tokio::time::timeout(within, self.client.request(req)).await {
            Err(_) => {
                return State::Down(format!(
                    "{url} did not answer within {} s",
                    within.as_secs_f64()
                ))
            }
            Ok(Err(e)) => return State::Down(format!("cannot reach {url}: {}", chain(&e))),
            Ok(Ok(resp)) => {
                let status = resp.status();
                let body = read_small(resp.into_body(), SMALL_BODY_LIMIT, within)
                    .await
                    .unwrap_or_default();
                if !status.is_success()
                    && status != StatusCode::NOT_FOUND
                    && status != StatusCode::METHOD_NOT_ALLOWED
                {
                    return State::Down(format!(
                        "{url} answered {status}: {}",
                        body_message(&body)
                    ));
                }
            }
        }
        // A 2xx, or a 404 or 405 (no health route): alive. The models list is
        // asked only while the models are not known: llama.cpp's Python server
        // interrupts the generation under way when a request for its model (the list
        // included) arrives, so a periodic models request would cut replies short.
        match known {
            Some(m) => State::Up(m),
            None => match self.fetch_models(base).await {
                Ok(m) => State::Up(m),
                Err(e) => State::Down(e),
            },
        }
    }

    /// `GET /v1/models`, as the models served (see the module docs).
    async fn fetch_models(&self, base: &str) -> Result<Vec<ModelInfo>, String> {
        let url = format!("{base}/v1/models");
        let req = self.request(Method::GET, base, "/v1/models", Bytes::new(), &[])?;
        let within = self.cfg.timeout.min(PROBE_TIMEOUT);
        let resp = tokio::time::timeout(within, self.client.request(req))
            .await
            .map_err(|_| format!("{url} did not answer within {} s", within.as_secs_f64()))?
            .map_err(|e| format!("cannot reach {url}: {}", chain(&e)))?;
        let status = resp.status();
        let body = read_small(resp.into_body(), SMALL_BODY_LIMIT, within)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let owned_by = self.wire.driver_id();
        if let (Some(name), Wire::Anthropic, 401 | 403) =
            (&self.cfg.model, self.wire, status.as_u16())
        {
            // The upstream answers, but lists its models only to a key: without one of
            // the operator's, each request brings the client's own. Served: the one
            // model named.
            return Ok(vec![ModelInfo {
                id: name.clone(),
                context_length: 0,
                owned_by: owned_by.into(),
            }]);
        }
        if !status.is_success() {
            return Err(format!("{url} answered {status}: {}", body_message(&body)));
        }
        let list: wire::ModelList = parse(
            &String::from_utf8_lossy(&body),
            &format!("{url} answered a models list"),
        )?;
        let listed: Vec<ModelInfo> = list
            .data
            .into_iter()
            .map(|m| ModelInfo {
                context_length: usize::try_from(m.window()).unwrap_or(usize::MAX),
                id: m.id,
                owned_by: owned_by.into(),
            })
            .collect();
        if let Some(name) = &self.cfg.model {
            let context_length = listed
                .iter()
                .find(|m| &m.id == name)
                .map_or(0, |m| m.context_length);
            return Ok(vec![ModelInfo {
                id: name.clone(),
                context_length,
                owned_by: owned_by.into(),
            }]);
        }
        if listed.is_empty() {
            return Err(format!(
                "{url} lists no models; name one with --upstream-model"
            ));
        }
        Ok(listed)
    }

    /// One attempt at a generation: the request, then the reply relayed to `sink`.
    /// `Ok` when it ended (with `Done`, or because the client left).
    async fn attempt(
        &self,
        base: &str,
        job: &Job,
        sink: &EventSink,
        progress: &mut Progress,
    ) -> Result<(), Failure> {
        let (url, resp) = self.post(base, job).await?;
        let ctype = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let body = BodyReader {
            body: resp.into_body(),
            idle: self.cfg.idle_timeout,
        };
        match self.wire {
            Wire::OpenAi => relay_openai(&url, &ctype, body, job, sink, progress).await,
            Wire::Anthropic => anthropic::relay(&url, &ctype, body, sink, progress).await,
        }
    }
}

/// A response body read piece by piece, each wait bounded by the idle timeout.
struct BodyReader {
    body: Incoming,
    idle: Duration,
}

impl BodyReader {
    /// The next piece of data; `None` at the end of the body.
    async fn next(&mut self) -> Result<Option<Bytes>, Failure> {
        loop {
            let frame = match tokio::time::timeout(self.idle, self.body.frame()).await {
                Err(_) => {
                    return Err(Failure::retry(EngineError::UpstreamTimeout(format!(
                        "the upstream sent nothing for {} s mid-reply (the idle timeout)",
                        self.idle.as_secs_f64()
                    ))))
                }
                Ok(None) => return Ok(None),
                Ok(Some(Err(e))) => {
                    return Err(Failure::retry(EngineError::Upstream(format!(
                        "the upstream connection failed mid-reply: {}",
                        chain(&e)
                    ))))
                }
                Ok(Some(Ok(f))) => f,
            };
            if let Ok(data) = frame.into_data() {
                return Ok(Some(data));
            }
            // Trailers: nothing to read.
        }
    }
}

/// Relays an OpenAI-wire reply (server-sent events) to `sink`.
async fn relay_openai(
    url: &str,
    ctype: &str,
    mut body: BodyReader,
    job: &Job,
    sink: &EventSink,
    progress: &mut Progress,
) -> Result<(), Failure> {
    if !ctype.starts_with("text/event-stream") {
        return Err(Failure::fatal(EngineError::Upstream(format!(
            "{url} answered '{ctype}', not an event stream"
        ))));
    }
    if !progress.started {
        progress.started = true;
        if !sink.send(EngineEvent::Start {
            prompt_tokens: 0,
            cached_tokens: 0,
        }) {
            return Ok(());
        }
    }
    pump(&mut body, Reply::new(job, sink, progress)).await
}

/// A reply assembled from server-sent events, on either wire.
trait EventReply {
    /// Takes one event's data.
    fn event(&mut self, data: &str) -> Result<Flow, Failure>;
    /// Whether the reply has said how it finished (then a stream that closes is whole).
    fn finished(&self) -> bool;
    /// Sends the finished reply on.
    fn finish(self);
}

/// Feeds the event stream `body` to `reply` until the reply ends, the client leaves or
/// the stream closes; a stream that closes before the reply said how it finished is a
/// retryable failure.
async fn pump<R: EventReply>(body: &mut BodyReader, mut reply: R) -> Result<(), Failure> {
    let mut sse = SseParser::default();
    loop {
        let (events, closed) = match body.next().await? {
            Some(data) => (
                sse.push(&data)
                    .map_err(|e| Failure::fatal(EngineError::Upstream(e)))?,
                false,
            ),
            None => (sse.finish(), true),
        };
        for ev in events {
            match reply.event(&ev)? {
                Flow::More => {}
                Flow::End => {
                    reply.finish();
                    return Ok(());
                }
                Flow::Gone => return Ok(()),
            }
        }
        if closed {
            break;
        }
    }
    if reply.finished() {
        reply.finish();
        return Ok(());
    }
    Err(Failure::retry(EngineError::Upstream(
        "the upstream closed the stream before the reply finished".into(),
    )))
}

/// One generation's request, ready to send (again, on a retry).
struct Job {
    path: &'static str,
    body: Bytes,
    /// The client's headers passed on (Anthropic wire).
    headers: Vec<(HeaderName, HeaderValue)>,
    /// Whether `headers` carry the client's own key.
    client_key: bool,
    /// The `Accept` header: what the reply will be.
    accept: &'static str,
    chat: bool,
    model: String,
    served: Vec<String>,
    stop: Vec<String>,
    /// The client's `max_tokens` (a limit fak holds the upstream to).
    max_tokens: Option<usize>,
    /// The model was named by this server's configuration (`--upstream-model`, a
    /// route), not taken from the upstream's list.
    named: bool,
}

/// What has reached the client so far, across attempts.
struct Progress {
    t0: Instant,
    started: bool,
    /// A `Text` or `Logprobs` was sent: no more retries.
    relayed: bool,
    first_text: Option<Instant>,
    /// The client's `max_tokens`.
    max_tokens: Option<usize>,
    /// Text pieces and bytes (text and tool-call arguments) received.
    pieces: usize,
    bytes: usize,
}

/// Most bytes of text and tool-call arguments one reply may bring, whatever the
/// upstream sends, so that an upstream that never stops cannot make fak buffer without
/// bound.
const MAX_REPLY_BYTES: usize = 8 << 20;

impl Progress {
    /// Counts a text piece (`piece`) or tool-call fragment of `len` bytes; `true` when
    /// the reply must end here: more text pieces than the client's `max_tokens` (each
    /// piece is at least one token, so the upstream is ignoring the limit), or more than
    /// [`MAX_REPLY_BYTES`]. The reply then ends as `length` without this fragment.
    fn over(&mut self, len: usize, piece: bool) -> bool {
        self.pieces += usize::from(piece);
        self.bytes += len;
        self.bytes > MAX_REPLY_BYTES || self.max_tokens.is_some_and(|m| self.pieces > m)
    }
}

/// What to do after one event.
enum Flow {
    More,
    End,
    /// The client left.
    Gone,
}

/// A tool call being assembled from its deltas.
#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

impl PartialCall {
    fn into_call(self) -> ToolCall {
        let id = if self.id.is_empty() {
            new_call_id()
        } else {
            self.id
        };
        let args = self.arguments.trim();
        let (arguments, mut malformed) = if args.is_empty() {
            ("{}".to_string(), None)
        } else {
            match serde_json::from_str::<Value>(args) {
                Ok(v @ Value::Object(_)) => (v.to_string(), None),
                Ok(_) => (
                    args.to_string(),
                    Some("`arguments` is not a JSON object".to_string()),
                ),
                Err(e) => (
                    args.to_string(),
                    Some(format!("`arguments` is not JSON: {e}")),
                ),
            }
        };
        if self.name.is_empty() {
            malformed = Some("the call has no function name".into());
        }
        ToolCall {
            id,
            name: self.name,
            arguments,
            malformed,
            truncated: false,
        }
    }
}

/// One attempt's reading of the reply.
struct Reply<'a> {
    job: &'a Job,
    sink: &'a EventSink,
    progress: &'a mut Progress,
    calls: BTreeMap<u64, PartialCall>,
    finish_reason: Option<wire::FinishReason>,
    /// vLLM's `stop_reason`, when it was a stop string.
    stop_reason: Option<String>,
    usage: Option<wire::Usage>,
    pieces: usize,
}

fn as_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// A record of one token or alternative: its `bytes` when the server sent them, else
/// the UTF-8 of its text.
fn top_record(token: &str, logprob: f64, bytes: Option<&[u8]>) -> TopLogprob {
    TopLogprob {
        id: 0,
        bytes: bytes.map_or_else(|| token.as_bytes().to_vec(), <[u8]>::to_vec),
        logprob,
    }
}

/// A chat choice's logprob records (`logprobs.content`).
fn chat_records(lp: &wire::ChoiceLogprobs) -> Vec<TokenLogprob> {
    lp.content
        .iter()
        .flatten()
        .map(|e| {
            let t = top_record(&e.token, e.logprob, e.bytes.as_deref());
            TokenLogprob {
                id: 0,
                bytes: t.bytes,
                logprob: t.logprob,
                top: e
                    .top_logprobs
                    .iter()
                    .map(|a| top_record(&a.token, a.logprob, a.bytes.as_deref()))
                    .collect(),
            }
        })
        .collect()
}

/// A completion choice's logprob records (the legacy parallel lists; alternatives
/// highest first).
fn completion_records(lp: &wire::CompletionLogprobs) -> Vec<TokenLogprob> {
    lp.tokens
        .iter()
        .zip(&lp.token_logprobs)
        .enumerate()
        .map(|(i, (t, &l))| {
            let mut top: Vec<TopLogprob> = lp
                .top_logprobs
                .get(i)
                .map(|o| o.iter().map(|(k, &v)| top_record(k, v, None)).collect())
                .unwrap_or_default();
            top.sort_by(|a, b| b.logprob.total_cmp(&a.logprob));
            TokenLogprob {
                id: 0,
                bytes: t.as_bytes().to_vec(),
                logprob: l,
                top,
            }
        })
        .collect()
}

/// What one event brings for choice 0, whichever API the stream is of.
#[derive(Default)]
struct ChoiceEvent {
    text: Option<String>,
    records: Vec<TokenLogprob>,
    calls: Vec<wire::ToolCallDelta>,
    finish_reason: Option<wire::FinishReason>,
    stop_reason: Option<wire::StopReason>,
}

impl ChoiceEvent {
    /// Choice 0 of a chat chunk (n = 1: only choice 0 is asked for; any other an
    /// upstream sends is not this reply's).
    fn chat(chunk: wire::ChatCompletionChunk) -> Option<Self> {
        let c = chunk.choices.into_iter().find(|c| c.index == 0)?;
        Some(ChoiceEvent {
            records: c.logprobs.as_ref().map(chat_records).unwrap_or_default(),
            text: c.delta.content,
            calls: c.delta.tool_calls.unwrap_or_default(),
            finish_reason: c.finish_reason,
            stop_reason: c.stop_reason,
        })
    }

    /// Choice 0 of a completions chunk.
    fn completion(chunk: wire::Completion) -> Option<Self> {
        let c = chunk.choices.into_iter().find(|c| c.index == 0)?;
        Some(ChoiceEvent {
            records: c
                .logprobs
                .as_ref()
                .map(completion_records)
                .unwrap_or_default(),
            text: Some(c.text),
            calls: Vec::new(),
            finish_reason: c.finish_reason,
            stop_reason: c.stop_reason,
        })
    }
}

impl<'a> Reply<'a> {
    fn new(job: &'a Job, sink: &'a EventSink, progress: &'a mut Progress) -> Self {
        Reply {
            job,
            sink,
            progress,
            calls: BTreeMap::new(),
            finish_reason: None,
            stop_reason: None,
            usage: None,
            pieces: 0,
        }
    }

    /// Relays one event to the client; `false` once it left.
    fn relay(&mut self, e: EngineEvent) -> bool {
        self.progress.relayed = true;
        if matches!(e, EngineEvent::Text(_)) && self.progress.first_text.is_none() {
            self.progress.first_text = Some(Instant::now());
        }
        self.sink.send(e)
    }
}

impl EventReply for Reply<'_> {
    fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// Reads one event's data.
    fn event(&mut self, data: &str) -> Result<Flow, Failure> {
        let bad = |why: String| Failure::fatal(EngineError::Upstream(why));
        if data.trim() == "[DONE]" {
            if self.finish_reason.is_none() {
                // llama.cpp's Python server ends a generation this way when another
                // request for its model interrupts it: a cut reply, not a finished one.
                return Err(Failure::retry(EngineError::Upstream(
                    "the upstream ended the stream before the reply finished ([DONE] without a finish_reason: interrupted?)".into(),
                )));
            }
            return Ok(Flow::End);
        }
        // An error event (vLLM, llama.cpp's server: `{"error": {...}}` mid-reply).
        if data.trim_start().starts_with('{') {
            if let Ok(e @ wire::ServerError { error: Some(_), .. }) =
                serde_json::from_str::<wire::ServerError>(data)
            {
                return Err(bad(format!(
                    "the upstream failed mid-reply: {}",
                    e.text().map_or_else(|| excerpt(data), excerpt)
                )));
            }
        }
        let what = "the upstream sent an event";
        let (usage, choice) = if self.job.chat {
            let mut chunk: wire::ChatCompletionChunk = parse(data, what).map_err(bad)?;
            (chunk.usage.take().flatten(), ChoiceEvent::chat(chunk))
        } else {
            let mut chunk: wire::Completion = parse(data, what).map_err(bad)?;
            (chunk.usage.take(), ChoiceEvent::completion(chunk))
        };
        if usage.is_some() {
            self.usage = usage;
        }
        let Some(c) = choice else {
            return Ok(Flow::More);
        };
        if let Some(t) = c.text.filter(|t| !t.is_empty()) {
            if self.progress.over(t.len(), true) {
                self.finish_reason = Some(wire::FinishReason::Length);
                return Ok(Flow::End);
            }
            if !c.records.is_empty() && !self.relay(EngineEvent::Logprobs(c.records)) {
                return Ok(Flow::Gone);
            }
            self.pieces += 1;
            if !self.relay(EngineEvent::Text(t)) {
                return Ok(Flow::Gone);
            }
        }
        let mut over = false;
        for d in c.calls {
            let p = self.calls.entry(u64::from(d.index)).or_default();
            if let Some(id) = &d.id {
                p.id.push_str(id);
            }
            if let Some(f) = d.function {
                if let Some(n) = &f.name {
                    p.name.push_str(n);
                }
                if let Some(a) = &f.arguments {
                    p.arguments.push_str(a);
                    over |= self.progress.over(a.len(), false);
                }
            }
        }
        if over {
            self.finish_reason = Some(wire::FinishReason::Length);
            return Ok(Flow::End);
        }
        if let Some(f) = c.finish_reason {
            self.finish_reason = Some(f);
        }
        if let Some(s) = c.stop_reason.as_ref().and_then(wire::StopReason::sequence) {
            self.stop_reason = Some(s.to_string());
        }
        Ok(Flow::More)
    }

    /// Sends the assembled calls and `Done`.
    fn finish(self) {
        for (_, p) in self.calls {
            if !self.sink.send(EngineEvent::ToolCall(p.into_call())) {
                return;
            }
        }
        let u = self.usage.as_ref();
        let completion_tokens = u.map_or(self.pieces, |u| as_usize(u.completion_tokens));
        let prompt_usage = u.map(|u| {
            let p = as_usize(u.prompt_tokens);
            PromptUsage {
                prompt_tokens: p,
                cached_tokens: as_usize(u.cached_tokens()).min(p),
                cache_creation_tokens: 0,
            }
        });
        let finish_reason = match self.finish_reason {
            Some(wire::FinishReason::Length) => FinishReason::Length,
            _ => FinishReason::Stop,
        };
        let stop_sequence = self
            .stop_reason
            .filter(|s| self.job.stop.iter().any(|x| x == s));
        let now = Instant::now();
        let first = self.progress.first_text.unwrap_or(now);
        self.sink.send(EngineEvent::Done(Done {
            completion_tokens,
            completion_ids: Vec::new(),
            finish_reason,
            stop_sequence,
            dead_end: None,
            ttft_s: first.duration_since(self.progress.t0).as_secs_f64(),
            decode_s: now.duration_since(first).as_secs_f64(),
            token_gaps_s: Vec::new(),
            prompt_usage,
        }));
    }
}

/// Splits a byte stream into server-sent events' `data` (the WHATWG format: lines
/// ending in LF or CRLF, `data:` lines joined by LF, a blank line ends an event,
/// comments and other fields ignored).
#[derive(Debug, Default)]
struct SseParser {
    buf: Vec<u8>,
    data: String,
    has_data: bool,
}

impl SseParser {
    /// Feeds bytes; returns the events they complete.
    fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(nl) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let end = start + nl;
            let line = &self.buf[start..end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let line = std::str::from_utf8(line)
                .map_err(|_| "the upstream sent an event that is not UTF-8".to_string())?
                .to_string();
            start = end + 1;
            self.line(&line, &mut out);
        }
        self.buf.drain(..start);
        if self.buf.len() + self.data.len() > MAX_EVENT_BYTES {
            return Err(format!(
                "the upstream sent an event longer than {MAX_EVENT_BYTES} bytes"
            ));
        }
        Ok(out)
    }

    fn line(&mut self, line: &str, out: &mut Vec<String>) {
        if line.is_empty() {
            if self.has_data {
                out.push(std::mem::take(&mut self.data));
                self.has_data = false;
            }
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = line
            .split_once(':')
            .map_or((line, ""), |(f, v)| (f, v.strip_prefix(' ').unwrap_or(v)));
        if field == "data" {
            if self.has_data {
                self.data.push('\n');
            }
            self.data.push_str(value);
            self.has_data = true;
        }
    }

    /// The end of the stream: a last line without its newline, and a last event
    /// without its blank line, are taken as if they had them.
    fn finish(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if let Ok(line) = std::str::from_utf8(&rest) {
            let line = line.strip_suffix('\r').unwrap_or(line).to_string();
            if !line.is_empty() {
                self.line(&line, &mut out);
            }
        }
        self.line("", &mut out);
        out
    }
}

/// A message in OpenAI's chat shape. Roles are the gateway's (`system`, `user`,
/// `assistant`, `tool`); `tool_calls` the OpenAI shape both gateways write.
///
/// # Errors
/// [`EngineError::InvalidRequest`] for another role or `tool_calls` not of that shape.
fn wire_message(m: &fak_engine::Message) -> Result<wire::ChatMessage, EngineError> {
    let role = match m.role.as_str() {
        "system" => wire::Role::System,
        "developer" => wire::Role::Developer,
        "user" => wire::Role::User,
        "assistant" => wire::Role::Assistant,
        "tool" => wire::Role::Tool,
        other => {
            return Err(EngineError::InvalidRequest(format!(
                "a message of role '{other}' has no OpenAI chat form"
            )))
        }
    };
    let tool_calls = match &m.tool_calls {
        None => None,
        Some(v) => Some(
            serde_json::from_value::<Vec<wire::ToolCall>>(v.clone()).map_err(|e| {
                EngineError::InvalidRequest(format!("an assistant message's tool_calls: {e}"))
            })?,
        ),
    };
    let content = (tool_calls.is_none() || !m.content.is_empty())
        .then(|| wire::MessageContent::Text(m.content.clone()));
    Ok(wire::ChatMessage {
        role,
        content,
        name: m.name.clone(),
        tool_call_id: m.tool_call_id.clone(),
        tool_calls,
        refusal: None,
    })
}

/// The upstream request for `req` on `model`: its path and JSON body (see the module
/// docs for the mapping), written from [`fak_wire::openai`]'s request types (numbers as
/// they read: a temperature of 0.7 is `0.7`).
///
/// # Errors
/// As `wire_message`.
pub fn request_body(
    req: &GenerateRequest,
    model: &str,
) -> Result<(&'static str, String), EngineError> {
    let s = &req.sampling;
    let stream_options = Some(wire::StreamOptions {
        include_usage: Some(true),
        include_obfuscation: None,
    });
    let sampling = wire::SamplingParams {
        max_tokens: req.max_tokens.map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
        temperature: Some(s.temperature),
        top_p: Some(s.top_p),
        seed: (s.seed != 0).then_some(s.seed as i64),
        stop: (!req.stop.is_empty()).then(|| wire::Stop::Many(req.stop.clone())),
        n: None,
        extensions: wire::SamplingExtensions {
            top_k: (s.top_k != 0).then(|| u32::try_from(s.top_k).unwrap_or(u32::MAX)),
            min_p: (s.min_p != 0.0).then_some(s.min_p),
            repetition_penalty: (s.repetition_penalty != 1.0).then_some(s.repetition_penalty),
        },
    };
    let logprobs = req.logprobs.map(|n| n as i64);
    let completion = |prompt: wire::CompletionPrompt| wire::CompletionRequest {
        model: model.to_string(),
        prompt,
        stream: Some(true),
        stream_options: stream_options.clone(),
        echo: None,
        logprobs,
        suffix: None,
        cache_salt: None,
        grammar: None,
        response_format: None,
        sampling: sampling.clone(),
        ignored: wire::Ignored::default(),
        neutral: wire::NeutralOnly::default(),
    };
    if s.grammar.is_some() && !matches!(req.prompt, Prompt::Chat(_)) {
        return Err(EngineError::InvalidRequest(
            "a response format on a completions prompt has no upstream form (only chat \
             completions take `response_format`)"
                .into(),
        ));
    }
    let written = match &req.prompt {
        Prompt::Text(t) => {
            serde_json::to_string(&completion(wire::CompletionPrompt::Text(t.clone())))
        }
        Prompt::Tokens(ids) => {
            serde_json::to_string(&completion(wire::CompletionPrompt::Tokens(ids.clone())))
        }
        Prompt::Chat(ms) => {
            let messages = ms.iter().map(wire_message).collect::<Result<_, _>>()?;
            let (tools, tool_choice) = if req.tools.is_empty() {
                (None, None)
            } else {
                let tools = req
                    .tools
                    .iter()
                    .map(|t| wire::Tool {
                        kind: wire::FunctionType::Function,
                        function: wire::FunctionDefinition {
                            name: t.name.clone(),
                            description: t.description.clone(),
                            parameters: t.parameters.as_object().cloned(),
                            strict: t.strict.then_some(true),
                        },
                    })
                    .collect();
                let choice = match &req.tool_choice {
                    ToolChoice::None => wire::ToolChoice::Mode(wire::ToolChoiceMode::None),
                    ToolChoice::Auto => wire::ToolChoice::Mode(wire::ToolChoiceMode::Auto),
                    ToolChoice::Required => wire::ToolChoice::Mode(wire::ToolChoiceMode::Required),
                    ToolChoice::Named(n) => wire::ToolChoice::Named(wire::NamedToolChoice {
                        kind: wire::FunctionType::Function,
                        function: wire::FunctionName { name: n.clone() },
                    }),
                };
                (Some(tools), Some(choice))
            };
            serde_json::to_string(&wire::ChatCompletionRequest {
                model: model.to_string(),
                messages,
                response_format: s.grammar.as_ref().map(response_format).transpose()?,
                stream: Some(true),
                stream_options,
                tools,
                tool_choice,
                logprobs: logprobs.map(|_| true),
                top_logprobs: logprobs,
                sampling,
                ..wire::ChatCompletionRequest::default()
            })
        }
    };
    let path = match req.prompt {
        Prompt::Chat(_) => "/v1/chat/completions",
        Prompt::Text(_) | Prompt::Tokens(_) => "/v1/completions",
    };
    let body =
        written.map_err(|e| EngineError::Internal(format!("writing the upstream request: {e}")))?;
    Ok((path, body))
}

/// The name a JSON Schema format is sent with when the request gave none (an
/// Anthropic `output_config.format` has no name; OpenAI's `json_schema.name` is
/// required).
pub const DEFAULT_FORMAT_NAME: &str = "response";

/// The `response_format` an OpenAI-compatible upstream is sent for `spec`: `json_object`
/// for JSON mode, `json_schema` with the `name`, `description`, `strict` and `schema`
/// the client gave (SDK: `ResponseFormatJSONObject` / `ResponseFormatJSONSchema`; name
/// [`DEFAULT_FORMAT_NAME`] when it gave none).
///
/// # Errors
/// [`EngineError::InvalidRequest`] for a Lark grammar (no portable upstream form;
/// [`EngineDriver::accepts_grammar`] refuses it first) or a schema that is not a JSON
/// object.
fn response_format(spec: &GrammarSpec) -> Result<wire::ResponseFormat, EngineError> {
    match spec {
        GrammarSpec::JsonObject => Ok(wire::ResponseFormat::JsonObject),
        GrammarSpec::JsonSchema {
            schema,
            name,
            description,
            strict,
        } => Ok(wire::ResponseFormat::JsonSchema {
            json_schema: wire::JsonSchemaFormat {
                name: name.clone().unwrap_or_else(|| DEFAULT_FORMAT_NAME.into()),
                description: description.clone(),
                schema: Some(schema_object(schema)?),
                strict: *strict,
            },
        }),
        GrammarSpec::Lark(_) => Err(EngineError::InvalidRequest(LARK_NOT_FORWARDED.into())),
    }
}

/// A format's schema as the JSON object the wires carry.
///
/// # Errors
/// [`EngineError::InvalidRequest`] when it is not an object.
fn schema_object(schema: &Value) -> Result<serde_json::Map<String, Value>, EngineError> {
    schema.as_object().cloned().ok_or_else(|| {
        EngineError::InvalidRequest(format!(
            "a JSON schema must be a JSON object, not {}",
            excerpt(&schema.to_string())
        ))
    })
}

/// Why a Lark `grammar` is not sent to an upstream.
const LARK_NOT_FORWARDED: &str = "an upstream server takes no portable form of a Lark \
     grammar (llama.cpp's server takes GBNF, vLLM and SGLang their own guided-decoding \
     fields), so it cannot be forwarded; JSON mode and JSON schemas are";

struct ActiveGuard(Arc<Inner>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts one attempt in flight on an upstream while it lives.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Inner {
    /// The healthy upstream serving `model` with the fewest attempts in flight,
    /// preferring one not in `tried`; ties are taken in turn. `None` when no healthy
    /// upstream serves it.
    fn pick(&self, model: &str, tried: &[usize]) -> Option<usize> {
        let n = self.ups.len();
        let from = self.turn.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<((bool, usize), usize)> = None;
        for k in 0..n {
            let i = (from.wrapping_add(k)) % n;
            let up = &self.ups[i];
            let serves = match &*lock(&up.state) {
                State::Up(m) => m.iter().any(|x| x.id == model),
                _ => false,
            };
            if !serves {
                continue;
            }
            let key = (tried.contains(&i), up.in_flight.load(Ordering::SeqCst));
            if best.as_ref().is_none_or(|(b, _)| key < *b) {
                best = Some((key, i));
            }
        }
        best.map(|(_, i)| i)
    }

    /// The models the healthy upstreams serve (each id once, first listing wins), and
    /// whether any upstream has not answered its first check yet.
    fn served(&self) -> (Vec<ModelInfo>, bool) {
        let mut out: Vec<ModelInfo> = Vec::new();
        let mut probing = false;
        for up in &self.ups {
            match &*lock(&up.state) {
                State::Up(m) => {
                    for x in m {
                        if !out.iter().any(|o| o.id == x.id) {
                            out.push(x.clone());
                        }
                    }
                }
                State::Probing => probing = true,
                State::Down(_) => {}
            }
        }
        (out, probing)
    }

    /// Why no upstream is healthy: each one's reason.
    fn down_reasons(&self) -> String {
        let reasons: Vec<String> = self
            .ups
            .iter()
            .filter_map(|up| match &*lock(&up.state) {
                State::Down(m) if self.ups.len() == 1 => Some(m.clone()),
                State::Down(m) => Some(format!("{}: {m}", up.base)),
                _ => None,
            })
            .collect();
        let what = if self.ups.len() == 1 {
            "the upstream does not answer"
        } else {
            "no upstream answers"
        };
        format!("{what}: {}", reasons.join("; "))
    }
}

/// A generation: attempts with backoff until one ends, the error is final, or the
/// client leaves (the stream dropped: the attempt is dropped with its connection). Each
/// attempt goes to the least-loaded healthy upstream, one not tried yet when there is
/// one; only a retry on an upstream already tried waits the backoff first.
async fn run(guard: ActiveGuard, job: Job, sink: EventSink) {
    let inner = Arc::clone(&guard.0);
    let mut progress = Progress {
        t0: Instant::now(),
        started: false,
        relayed: false,
        first_text: None,
        max_tokens: job.max_tokens,
        pieces: 0,
        bytes: 0,
    };
    let mut attempt = 0u32;
    let mut tried: Vec<usize> = Vec::new();
    let mut last: Option<Failure> = None;
    loop {
        let Some(i) = inner.pick(&job.model, &tried) else {
            let f =
                last.unwrap_or_else(|| Failure::fatal(EngineError::Upstream(inner.down_reasons())));
            sink.send(EngineEvent::Error(with_attempts(f.error, attempt)));
            return;
        };
        if attempt > 0 && tried.contains(&i) {
            let wait = BACKOFF.saturating_mul(1 << (attempt - 1).min(8));
            tokio::select! {
                () = sink.closed() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
        tried.push(i);
        let up = &inner.ups[i];
        let r = {
            let _counted = InFlight::new(&up.in_flight);
            tokio::select! {
                () = sink.closed() => return,
                r = inner.attempt(&up.base, &job, &sink, &mut progress) => r,
            }
        };
        let Err(f) = r else {
            return;
        };
        if f.retryable && !progress.relayed && attempt < inner.cfg.retries {
            attempt += 1;
            last = Some(f);
            continue;
        }
        sink.send(EngineEvent::Error(with_attempts(f.error, attempt)));
        return;
    }
}

impl Inner {
    /// Sends a count job (not streamed) with the retries of [`run`]: the upstream's
    /// `input_tokens`.
    async fn count(&self, job: &Job) -> Result<usize, EngineError> {
        let mut attempt = 0u32;
        let mut tried: Vec<usize> = Vec::new();
        let mut last: Option<Failure> = None;
        loop {
            let Some(i) = self.pick(&job.model, &tried) else {
                let f = last
                    .unwrap_or_else(|| Failure::fatal(EngineError::Upstream(self.down_reasons())));
                return Err(with_attempts(f.error, attempt));
            };
            if attempt > 0 && tried.contains(&i) {
                tokio::time::sleep(BACKOFF.saturating_mul(1 << (attempt - 1).min(8))).await;
            }
            tried.push(i);
            let up = &self.ups[i];
            let r = {
                let _counted = InFlight::new(&up.in_flight);
                self.count_once(&up.base, job).await
            };
            match r {
                Ok(n) => return Ok(n),
                Err(f) if f.retryable && attempt < self.cfg.retries => {
                    attempt += 1;
                    last = Some(f);
                }
                Err(f) => return Err(with_attempts(f.error, attempt)),
            }
        }
    }

    /// POSTs `job` to the upstream at `base`: its URL and the response, which is a 200
    /// (any other status is read, up to a small limit, into its [`Failure`]).
    async fn post(
        &self,
        base: &str,
        job: &Job,
    ) -> Result<(String, hyper::Response<Incoming>), Failure> {
        let url = format!("{base}{}", job.path);
        let mut headers = job.headers.clone();
        headers.push((header::ACCEPT, HeaderValue::from_static(job.accept)));
        let req = self
            .request(Method::POST, base, job.path, job.body.clone(), &headers)
            .map_err(|e| Failure::fatal(EngineError::Upstream(e)))?;
        let resp = match tokio::time::timeout(self.cfg.timeout, self.client.request(req)).await {
            Err(_) => {
                return Err(Failure::retry(EngineError::UpstreamTimeout(format!(
                    "no response from {url} within {} s (the upstream timeout)",
                    self.cfg.timeout.as_secs_f64()
                ))))
            }
            Ok(Err(e)) => {
                return Err(Failure::retry(EngineError::Upstream(format!(
                    "cannot reach {url}: {}",
                    chain(&e)
                ))))
            }
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        if status != StatusCode::OK {
            let retry_after = resp
                .headers()
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok());
            let body = read_small(resp.into_body(), SMALL_BODY_LIMIT, self.cfg.idle_timeout)
                .await
                .unwrap_or_default();
            return Err(status_failure(status, &body, retry_after, &url, job));
        }
        Ok((url, resp))
    }

    /// One attempt of [`Inner::count`] at the upstream at `base`.
    async fn count_once(&self, base: &str, job: &Job) -> Result<usize, Failure> {
        let (url, resp) = self.post(base, job).await?;
        let body = read_small(resp.into_body(), SMALL_BODY_LIMIT, self.cfg.idle_timeout)
            .await
            .map_err(|e| Failure::retry(EngineError::Upstream(format!("{url}: {e}"))))?;
        let answer: fak_wire::anthropic::CountTokensResponse = serde_json::from_slice(&body)
            .map_err(|e| {
                Failure::fatal(EngineError::Upstream(format!(
                    "{url} answered something that is not a token count ({e}): {}",
                    excerpt(&String::from_utf8_lossy(&body))
                )))
            })?;
        usize::try_from(answer.input_tokens).map_err(|_| {
            Failure::fatal(EngineError::Upstream(format!(
                "{url} answered a count too large: {}",
                answer.input_tokens
            )))
        })
    }
}

/// An upstream error with the number of attempts when there was more than one.
fn with_attempts(error: EngineError, retries: u32) -> EngineError {
    let tries = if retries > 0 {
        format!(" ({} attempts)", retries + 1)
    } else {
        String::new()
    };
    match error {
        EngineError::Upstream(m) => EngineError::Upstream(m + &tries),
        EngineError::UpstreamTimeout(m) => EngineError::UpstreamTimeout(m + &tries),
        e => e,
    }
}

impl EngineDriver for UpstreamDriver {
    fn id(&self) -> &'static str {
        self.inner.wire.driver_id()
    }

    fn forwards_client_body(&self, _model: Option<&str>) -> bool {
        self.inner.wire == Wire::Anthropic
    }

    /// JSON mode and JSON schemas are forwarded (see the module docs); a Lark grammar
    /// is not.
    fn accepts_grammar(&self, _model: Option<&str>, spec: &GrammarSpec) -> Result<(), String> {
        match spec {
            GrammarSpec::JsonObject | GrammarSpec::JsonSchema { .. } => Ok(()),
            GrammarSpec::Lark(_) => Err(LARK_NOT_FORWARDED.into()),
        }
    }

    fn models(&self) -> Vec<ModelInfo> {
        let (served, _) = self.inner.served();
        if !served.is_empty() {
            return served;
        }
        self.inner
            .cfg
            .model
            .iter()
            .map(|id| ModelInfo {
                id: id.clone(),
                context_length: 0,
                owned_by: self.inner.wire.driver_id().into(),
            })
            .collect()
    }

    fn readiness(&self) -> Readiness {
        let (served, probing) = self.inner.served();
        let up = self
            .inner
            .ups
            .iter()
            .any(|u| matches!(&*lock(&u.state), State::Up(_)));
        if up && !served.is_empty() {
            Readiness::Ready
        } else if probing {
            Readiness::Loading
        } else {
            Readiness::Failed(self.inner.down_reasons())
        }
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            active: self.inner.active.load(Ordering::SeqCst),
            upstreams: self.inner.ups.len(),
            upstreams_healthy: self
                .inner
                .ups
                .iter()
                .filter(|u| matches!(&*lock(&u.state), State::Up(_)))
                .count(),
            ..EngineStats::default()
        }
    }

    /// `anthropic-upstream`: the upstream's own count (`POST /v1/messages/count_tokens`,
    /// the request translated as for `/v1/messages`, its `input_tokens` returned;
    /// retried as a generation is). `openai-upstream`: [`EngineError::InvalidRequest`],
    /// as OpenAI's API has no count endpoint and a count fak made up would not be the
    /// upstream's.
    fn count_tokens(&self, req: &GenerateRequest) -> Result<usize, EngineError> {
        if self.inner.wire == Wire::OpenAi {
            return Err(EngineError::InvalidRequest(format!(
                "the {} engine cannot count tokens: an OpenAI-compatible upstream has no \
                 token-counting endpoint, and a count fak made up would not be the \
                 upstream's (count_tokens is forwarded by the {} and inkernel engines)",
                SPEC.id, ANTHROPIC_SPEC.id
            )));
        }
        let (served, probing) = self.inner.served();
        if served.is_empty() {
            return Err(EngineError::NotReady(if probing {
                "asking the upstream for its models".into()
            } else {
                self.inner.down_reasons()
            }));
        }
        check_model(req.model.as_deref(), &served)?;
        let model = match &req.model {
            Some(m) => m.clone(),
            None => served
                .first()
                .map(|m| m.id.clone())
                .ok_or_else(|| EngineError::NotReady("the upstream serves no model".into()))?,
        };
        let job = anthropic::job(
            req,
            model,
            served.iter().map(|m| m.id.clone()).collect(),
            self.inner.auth.is_some(),
            self.inner.cfg.model.is_some(),
            anthropic::Ask::Count,
        )?;
        let rt = self
            .rt
            .as_ref()
            .ok_or_else(|| EngineError::NotReady("the driver is shutting down".into()))?;
        // The driver's runtime does the HTTP; this (blocking) caller waits for its answer.
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let inner = Arc::clone(&self.inner);
        rt.spawn(async move {
            let _ = tx.send(inner.count(&job).await);
        });
        rx.recv().unwrap_or_else(|_| {
            Err(EngineError::Internal(
                "the upstream driver stopped while counting".into(),
            ))
        })
    }

    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        let (served, probing) = self.inner.served();
        if served.is_empty() {
            return Err(EngineError::NotReady(if probing {
                "asking the upstream for its models".into()
            } else {
                self.inner.down_reasons()
            }));
        }
        check_model(req.model.as_deref(), &served)?;
        req.validate()?;
        req.sampling
            .validate()
            .map_err(EngineError::InvalidRequest)?;
        if req.max_tokens == Some(0) {
            return Err(EngineError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        let model = match &req.model {
            Some(m) => m.clone(),
            None => served
                .first()
                .map(|m| m.id.clone())
                .ok_or_else(|| EngineError::NotReady("the upstream serves no model".into()))?,
        };
        let served_ids: Vec<String> = served.iter().map(|m| m.id.clone()).collect();
        let check = match &req.sampling.grammar {
            Some(spec) => reply_check::ReplyCheck::new(spec)?,
            None => None,
        };
        let job = match self.inner.wire {
            Wire::OpenAi => {
                let (path, body) = request_body(&req, &model)?;
                Job {
                    path,
                    body: Bytes::from(body),
                    headers: Vec::new(),
                    client_key: false,
                    accept: "text/event-stream",
                    chat: matches!(req.prompt, Prompt::Chat(_)),
                    model,
                    served: served_ids,
                    stop: req.stop,
                    max_tokens: req.max_tokens,
                    named: self.inner.cfg.model.is_some(),
                }
            }
            Wire::Anthropic => anthropic::job(
                &req,
                model,
                served_ids,
                self.inner.auth.is_some(),
                self.inner.cfg.model.is_some(),
                anthropic::Ask::Reply,
            )?,
        };
        let rt = self
            .rt
            .as_ref()
            .ok_or_else(|| EngineError::NotReady("the driver is shutting down".into()))?;
        let (sink, stream) = event_channel();
        self.inner.active.fetch_add(1, Ordering::SeqCst);
        let guard = ActiveGuard(Arc::clone(&self.inner));
        match check {
            None => {
                rt.spawn(run(guard, job, sink));
            }
            Some(check) => {
                let (upstream_sink, upstream) = event_channel();
                rt.spawn(run(guard, job, upstream_sink));
                rt.spawn(reply_check::relay(upstream, sink, check, MAX_REPLY_BYTES));
            }
        }
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fak_engine::Message;
    use serde_json::json;
    use std::io::{Read, Write};

    #[test]
    fn sse_events_split_across_reads() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").unwrap().is_empty());
        assert!(p.push(b": 1}\r\n").unwrap().is_empty());
        assert_eq!(
            p.push(b"\r\n: comment\n\ndata: x\ndata: y\n\n").unwrap(),
            vec!["{\"a\": 1}".to_string(), "x\ny".to_string()]
        );
        assert_eq!(
            p.push(b"event: e\ndata:[DONE]").unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(p.finish(), vec!["[DONE]".to_string()]);
        assert!(SseParser::default().push(b"data: \xff\xfe\n").is_err());
    }

    #[test]
    fn requests_map_every_field() {
        let mut a = Message::new("assistant", "");
        a.tool_calls = Some(json!([{"id": "c1", "type": "function",
            "function": {"name": "get_x", "arguments": "{}"}}]));
        let mut t = Message::new("tool", "42");
        t.tool_call_id = Some("c1".into());
        let mut r = GenerateRequest::chat(vec![Message::new("user", "hi"), a, t]);
        r.max_tokens = Some(7);
        r.sampling.temperature = 0.7;
        r.sampling.seed = 3;
        r.stop = vec!["END".into()];
        r.logprobs = Some(2);
        r.tools = vec![fak_engine::ToolSpec {
            name: "get_x".into(),
            description: Some("x".into()),
            parameters: json!({"type": "object"}),
            strict: false,
        }];
        r.tool_choice = ToolChoice::Named("get_x".into());
        let (path, b) = request_body(&r, "m").unwrap();
        let b: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(path, "/v1/chat/completions");
        assert_eq!(b["model"], "m");
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["messages"][1]["content"], Value::Null);
        assert_eq!(b["messages"][1]["tool_calls"][0]["id"], "c1");
        assert_eq!(b["messages"][2]["tool_call_id"], "c1");
        assert_eq!(b["max_tokens"], 7);
        assert_eq!(b["temperature"], json!(0.7));
        assert_eq!(b["seed"], 3);
        assert_eq!(b["stop"], json!(["END"]));
        assert_eq!(
            (b["logprobs"].clone(), b["top_logprobs"].clone()),
            (json!(true), json!(2))
        );
        assert_eq!(b["tools"][0]["function"]["name"], "get_x");
        assert_eq!(b["tool_choice"]["function"]["name"], "get_x");
        assert!(b.get("top_k").is_none() && b.get("min_p").is_none());
        r.sampling.seed = 0;
        r.prompt = Prompt::Text("once".into());
        let (path, b) = request_body(&r, "m").unwrap();
        let b: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(path, "/v1/completions");
        assert_eq!(
            (b["prompt"].clone(), b["logprobs"].clone()),
            (json!("once"), json!(2))
        );
        assert!(b.get("seed").is_none() && b.get("messages").is_none());
        // Token ids go up as ids; the vLLM / llama.cpp sampling extensions when set.
        r.prompt = Prompt::Tokens(vec![1, 50, 2]);
        r.sampling.top_k = 5;
        r.sampling.repetition_penalty = 1.1;
        let (path, b) = request_body(&r, "m").unwrap();
        let b: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(path, "/v1/completions");
        assert_eq!(b["prompt"], json!([1, 50, 2]));
        assert_eq!(
            (b["top_k"].clone(), b["repetition_penalty"].clone()),
            (json!(5), json!(1.1))
        );
        assert!(b.get("min_p").is_none());
    }

    #[test]
    fn statuses_map_to_engine_errors() {
        let job = |client_key: bool| Job {
            path: "/v1/chat/completions",
            body: Bytes::new(),
            headers: Vec::new(),
            client_key,
            accept: "text/event-stream",
            chat: true,
            model: "m".into(),
            served: vec!["m".into()],
            stop: Vec::new(),
            max_tokens: None,
            named: false,
        };
        let operator = job(false);
        let f = |code: u16, body: &str| {
            status_failure(
                StatusCode::from_u16(code).unwrap(),
                body.as_bytes(),
                Some(7),
                "http://u/v1/chat/completions",
                &operator,
            )
        };
        let e = f(400, r#"{"error": {"message": "temperature too hot"}}"#);
        assert!(!e.retryable);
        assert_eq!(
            e.error,
            EngineError::InvalidRequest(
                "the upstream rejected the request (400 Bad Request): temperature too hot".into()
            )
        );
        assert!(matches!(
            f(429, "").error,
            EngineError::Overloaded {
                retry_after_s: 7,
                ..
            }
        ));
        assert!(matches!(
            f(503, "busy").error,
            EngineError::Overloaded { .. }
        ));
        assert!(matches!(
            f(
                404,
                r#"{"error": {"message": "The model `m` does not exist."}}"#
            )
            .error,
            EngineError::UnknownModel { .. }
        ));
        assert!(matches!(f(404, "no route").error, EngineError::Upstream(_)));
        assert!(
            matches!(f(401, "bad key").error, EngineError::Upstream(m) if m.contains("bad key"))
        );
        let e = f(500, "oops");
        assert!(e.retryable && matches!(e.error, EngineError::Upstream(m) if m.contains("oops")));
        assert!(f(502, "<html>").retryable);
        // Anthropic's 529 is its overloaded; a refusal of the client's own key is the
        // client's 401/403, of the operator's a 502.
        assert!(matches!(f(529, "").error, EngineError::Overloaded { .. }));
        let client = job(true);
        let e = status_failure(
            StatusCode::FORBIDDEN,
            br#"{"type": "error", "error": {"type": "permission_error", "message": "no access"}}"#,
            None,
            "http://u/v1/messages",
            &client,
        );
        assert_eq!(
            e.error,
            EngineError::Refused {
                status: 403,
                message: "no access".into()
            }
        );
    }

    #[test]
    fn tool_call_deltas_assemble_whole() {
        let p = PartialCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: "{\"city\": \"Paris\"}".into(),
        };
        let c = p.into_call();
        assert_eq!(
            (c.id.as_str(), c.arguments.as_str()),
            ("call_1", r#"{"city":"Paris"}"#)
        );
        assert!(c.malformed.is_none());
        let c = PartialCall {
            name: "f".into(),
            arguments: "{\"a\": ".into(),
            ..PartialCall::default()
        }
        .into_call();
        assert!(c.malformed.is_some() && c.id.starts_with("call_"));
        let c = PartialCall::default().into_call();
        assert_eq!(c.arguments, "{}");
        assert!(c.malformed.unwrap().contains("no function name"));
    }

    /// A models list of one model, `fake`.
    const MODELS: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 27\r\nconnection: close\r\n\r\n{\"data\": [{\"id\": \"fake\"}]}\n";

    /// What a mock upstream does with one request.
    enum Answer {
        /// Writes the bytes and closes the connection.
        Reply(&'static [u8]),
        /// Writes the bytes and holds the connection open until the client closes it.
        Hold(&'static [u8]),
    }

    /// An HTTP server on loopback: each connection on a thread of its own, its request
    /// head read, then answered as `answer` says for that head.
    fn mock_upstream(
        answer: impl Fn(&[u8]) -> Answer + Send + Sync + 'static,
    ) -> std::net::SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let answer = Arc::new(answer);
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                let answer = Arc::clone(&answer);
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 65536];
                    let mut head = Vec::new();
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    match answer(&head) {
                        Answer::Reply(r) => {
                            let _ = s.write_all(r);
                        }
                        Answer::Hold(r) => {
                            let _ = s.write_all(r);
                            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
                        }
                    }
                });
            }
        });
        addr
    }

    /// A mock upstream answering `GET`s with [`MODELS`] and every other request with
    /// `reply`.
    fn fake_upstream(reply: &'static [u8]) -> std::net::SocketAddr {
        mock_upstream(move |head| {
            Answer::Reply(if head.starts_with(b"GET ") {
                MODELS
            } else {
                reply
            })
        })
    }

    /// `d` once it is ready (within 10 s).
    fn ready(d: UpstreamDriver) -> UpstreamDriver {
        let t = Instant::now();
        while d.readiness() != Readiness::Ready {
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", d.readiness());
            std::thread::sleep(Duration::from_millis(10));
        }
        d
    }

    fn driver(addr: std::net::SocketAddr, idle_ms: u64) -> UpstreamDriver {
        let d = UpstreamDriver::start(UpstreamConfig {
            base_urls: vec![format!("http://{addr}/v1")],
            timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_millis(idle_ms),
            retries: 1,
            ..UpstreamConfig::default()
        })
        .unwrap();
        ready(d)
    }

    fn ask(d: &UpstreamDriver) -> Result<fak_engine::Collected, EngineError> {
        d.submit(GenerateRequest::chat(vec![Message::new("user", "hi")]))?
            .blocking_collect()
    }

    #[test]
    fn an_upstream_that_ignores_max_tokens_is_cut_off_and_other_choices_are_not_relayed() {
        let mut reply =
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                .to_vec();
        for i in 0..50 {
            reply.extend_from_slice(
                format!(
                    "data: {{\"choices\":[{{\"index\":1,\"delta\":{{\"content\":\"other{i} \"}}}},\
{{\"index\":0,\"delta\":{{\"content\":\"w{i} \"}}}}]}}\n\n"
                )
                .as_bytes(),
            );
        }
        reply.extend_from_slice(
            b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n",
        );
        let addr = fake_upstream(Box::leak(reply.into_boxed_slice()));
        let d = driver(addr, 5000);
        // Obeyed limits pass untouched: 50 pieces within max_tokens 50.
        let mut req = GenerateRequest::chat(vec![Message::new("user", "hi")]);
        req.max_tokens = Some(50);
        let c = d.submit(req).unwrap().blocking_collect().unwrap();
        assert_eq!(c.text.split_whitespace().count(), 50);
        assert!(
            !c.text.contains("other"),
            "choice 1 is not this reply: {}",
            c.text
        );
        assert_eq!(c.done.unwrap().finish_reason, FinishReason::Stop);
        // An upstream sending more pieces than max_tokens is cut off as `length`.
        let mut req = GenerateRequest::chat(vec![Message::new("user", "hi")]);
        req.max_tokens = Some(3);
        let c = d.submit(req).unwrap().blocking_collect().unwrap();
        assert_eq!(c.text, "w0 w1 w2 ");
        assert_eq!(c.done.unwrap().finish_reason, FinishReason::Length);
    }

    #[test]
    fn a_named_model_the_upstream_refuses_is_reported_in_the_upstreams_words() {
        let addr = fake_upstream(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 56\r\nconnection: close\r\n\r\n{\"error\": {\"message\": \"the model 'big' does not exist\"}}\n\n");
        let d = ready(
            UpstreamDriver::start(UpstreamConfig {
                base_urls: vec![format!("http://{addr}")],
                model: Some("big".into()),
                ..UpstreamConfig::default()
            })
            .unwrap(),
        );
        let e = ask(&d).unwrap_err();
        assert!(
            matches!(&e, EngineError::Upstream(m) if m.contains("does not serve 'big'")
                && m.contains("does not exist")),
            "{e:?}"
        );
    }

    #[test]
    fn a_well_formed_stream_maps_to_events() {
        let addr = fake_upstream(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n\
data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n\
data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_a\",\"type\":\"function\",\"function\":{\"name\":\"get_x\",\"arguments\":\"{\\\"q\\\"\"}}]}}]}\n\n\
data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\": 1}\"}}]}}]}\n\n\
data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\n\
data: [DONE]\n\n",
        );
        let d = driver(addr, 5000);
        assert_eq!(d.models()[0].id, "fake");
        let c = ask(&d).unwrap();
        assert_eq!(c.text, "Hello");
        assert_eq!(c.tool_calls.len(), 1);
        assert_eq!(c.tool_calls[0].id, "call_a");
        assert_eq!(c.tool_calls[0].arguments, r#"{"q":1}"#);
        assert_eq!((c.prompt_tokens, c.cached_tokens), (11, 3));
        let done = c.done.unwrap();
        assert_eq!(done.finish_reason, FinishReason::Stop);
        assert_eq!(done.completion_tokens, 4);
        assert!(d
            .submit({
                let mut r = GenerateRequest::chat(vec![Message::new("user", "hi")]);
                r.model = Some("other".into());
                r
            })
            .is_err());
    }

    #[test]
    fn garbage_events_are_errors_not_panics() {
        for reply in [
            &b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {not json\n\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: [1, 2]\n\n",
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {\"choices\": 5}\n\n",
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: \xff\xfe\n\n",
            b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\nconnection: close\r\n\r\n<html>",
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {\"error\": {\"message\": \"boom\"}}\n\n",
        ] {
            let d = driver(fake_upstream(reply), 5000);
            let e = ask(&d).unwrap_err();
            assert!(matches!(e, EngineError::Upstream(_)), "{e:?}");
        }
        // A stream cut off before it finished: retried, then an error naming that.
        let d = driver(
            fake_upstream(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n"),
            5000,
        );
        let e = ask(&d).unwrap_err().to_string();
        assert!(
            e.contains("before the reply finished") && e.contains("2 attempts"),
            "{e}"
        );
        // Garbage after text was relayed: the text came, then the error (no retry).
        let d = driver(
            fake_upstream(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: }\n\n"),
            5000,
        );
        let evs = events_of(&d);
        assert!(matches!(evs[0], EngineEvent::Start { .. }));
        assert_eq!(evs[1], EngineEvent::Text("a".into()));
        assert!(
            matches!(&evs[2], EngineEvent::Error(EngineError::Upstream(m)) if !m.contains("attempts"))
        );
        assert_eq!(evs.len(), 3);
    }

    #[test]
    fn a_done_without_a_finish_reason_is_a_cut_reply() {
        // llama.cpp's Python server, interrupted by another request, ends a generation
        // with `[DONE]` and no finish_reason. Before any text: retried, then an error.
        let d = driver(
            fake_upstream(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {\"choices\":[{\"delta\":{\"role\":\"assistant\"},\"finish_reason\":null}]}\n\ndata: [DONE]\n\n"),
            5000,
        );
        let e = ask(&d).unwrap_err().to_string();
        assert!(
            e.contains("before the reply finished") && e.contains("2 attempts"),
            "{e}"
        );
        // After text: the text, then the error, never a `Done` that says it finished.
        let d = driver(
            fake_upstream(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {\"choices\":[{\"delta\":{\"content\":\"The sky\"},\"finish_reason\":null}]}\n\ndata: [DONE]\n\n"),
            5000,
        );
        let evs = events_of(&d);
        assert_eq!(evs[1], EngineEvent::Text("The sky".into()));
        assert!(
            matches!(&evs[2], EngineEvent::Error(EngineError::Upstream(m)) if m.contains("finish_reason")),
            "{evs:?}"
        );
        assert_eq!(evs.len(), 3);
    }

    #[test]
    fn a_stall_mid_reply_is_a_timeout() {
        // The head of an event stream, then silence (the connection stays open).
        let addr = mock_upstream(|head| {
            if head.starts_with(b"GET ") {
                Answer::Reply(MODELS)
            } else {
                Answer::Hold(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
            }
        });
        let d = driver(addr, 200);
        let t = Instant::now();
        let e = ask(&d).unwrap_err();
        assert!(
            matches!(&e, EngineError::UpstreamTimeout(m) if m.contains("idle")),
            "{e:?}"
        );
        // Two attempts of 0.2 s and a 0.25 s backoff.
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }

    #[test]
    fn a_5xx_before_any_token_is_retried_and_a_silent_head_times_out() {
        // The first generation request is answered 500, the next one properly.
        let posts = Arc::new(AtomicUsize::new(0));
        let p = Arc::clone(&posts);
        let addr = mock_upstream(move |head| {
            Answer::Reply(if head.starts_with(b"GET ") {
                MODELS
            } else if p.fetch_add(1, Ordering::SeqCst) == 0 {
                b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\nconnection: close\r\n\r\noops"
            } else {
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {\"choices\":[{\"delta\":{\"content\":\"ok\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n"
            })
        });
        let d = driver(addr, 5000);
        assert_eq!(ask(&d).unwrap().text, "ok");
        assert_eq!(posts.load(Ordering::SeqCst), 2);
        // A server that takes the request and never answers: the head timeout.
        let addr = mock_upstream(|head| {
            if head.starts_with(b"GET ") {
                Answer::Reply(MODELS)
            } else {
                Answer::Hold(b"")
            }
        });
        let d = ready(
            UpstreamDriver::start(UpstreamConfig {
                base_urls: vec![format!("http://{addr}")],
                timeout: Duration::from_millis(300),
                retries: 0,
                ..UpstreamConfig::default()
            })
            .unwrap(),
        );
        let t = Instant::now();
        let e = ask(&d).unwrap_err();
        assert!(
            matches!(&e, EngineError::UpstreamTimeout(m) if m.contains("no response") && m.contains("0.3 s")),
            "{e:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    /// A loopback server answering each request with the reply of the first route whose
    /// prefix its head starts with (else a 404).
    /// An HTTP reply streaming `events` (each one `data:` line) as server-sent events.
    fn sse(events: &[&str]) -> &'static [u8] {
        let mut r =
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                .to_vec();
        for e in events {
            r.extend_from_slice(format!("data: {e}\n\n").as_bytes());
        }
        Box::leak(r.into_boxed_slice())
    }

    /// All events of one chat generation.
    fn events_of(d: &UpstreamDriver) -> Vec<EngineEvent> {
        let mut s = d
            .submit(GenerateRequest::chat(vec![Message::new("user", "hi")]))
            .unwrap();
        let mut evs = Vec::new();
        while let Some(e) = s.blocking_next() {
            evs.push(e);
        }
        evs
    }

    #[test]
    fn llama_cpp_server_chunks_parse_with_their_extra_fields() {
        // Chunks as llama.cpp's server (llama-server, builds b6097 and b6881) sent them,
        // quoted from captured streams: a first chunk with `"content": null`, a
        // `reasoning_content` delta (not relayed: it is not the reply's text), and a last
        // chunk carrying `usage` and llama.cpp's own `timings`.
        let d = driver(
            fake_upstream(sse(&[
                r#"{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1762593253,"id":"chatcmpl-DHvcEyFobkuV4Xu1QSYo4bqNv18TDqaA","model":"gpt-oss:120b","system_fingerprint":"b6881-8b11deea4","object":"chat.completion.chunk"}"#,
                r#"{"choices":[{"finish_reason":null,"index":0,"delta":{"reasoning_content":"We"}}],"created":1762593253,"id":"chatcmpl-DHvcEyFobkuV4Xu1QSYo4bqNv18TDqaA","model":"gpt-oss:120b","system_fingerprint":"b6881-8b11deea4","object":"chat.completion.chunk"}"#,
                r#"{"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1754524122,"id":"chatcmpl-yPk7z9nC22CofOlh100qQdHVEDMNYCb1","model":"gpt-oss:20b","system_fingerprint":"b6097-9515c613","object":"chat.completion.chunk","usage":{"completion_tokens":247,"prompt_tokens":1085,"total_tokens":1332},"timings":{"prompt_n":1085,"prompt_ms":203.378,"prompt_per_token_ms":0.18744516129032257,"prompt_per_second":5334.893646313762,"predicted_n":247,"predicted_ms":933.63,"predicted_per_token_ms":3.7798785425101213,"predicted_per_second":264.5587652496171}}"#,
                "[DONE]",
            ])),
            5000,
        );
        let c = ask(&d).unwrap();
        assert_eq!(c.text, "");
        assert_eq!((c.prompt_tokens, c.cached_tokens), (1085, 0));
        let done = c.done.unwrap();
        assert_eq!(done.finish_reason, FinishReason::Stop);
        assert_eq!(done.completion_tokens, 247);
    }

    #[test]
    fn a_vllm_error_event_with_an_integer_code_is_its_message() {
        // vLLM's streaming error: `{"error": ErrorResponse}` with its `object` and an
        // integer `code` (create_streaming_error_response in vLLM's OpenAI server).
        let d = driver(
            fake_upstream(sse(&[
                r#"{"error": {"object": "error", "message": "This model's maximum context length is 2048 tokens.", "type": "BadRequestError", "param": null, "code": 400}}"#,
            ])),
            5000,
        );
        let e = ask(&d).unwrap_err();
        assert!(
            matches!(&e, EngineError::Upstream(m)
                if m == "the upstream failed mid-reply: This model's maximum context length is 2048 tokens."),
            "{e:?}"
        );
    }

    #[test]
    fn a_field_of_the_wrong_type_is_an_error_naming_it() {
        for (event, path) in [
            (
                r#"{"choices":[{"index":0,"delta":{"content":5}}]}"#,
                "`choices[0].delta.content`",
            ),
            (
                r#"{"choices":[{"index":"0","delta":{"content":"a"}}]}"#,
                "`choices[0].index`",
            ),
            (
                r#"{"choices":[],"usage":{"prompt_tokens":"11","completion_tokens":4}}"#,
                "`usage.prompt_tokens`",
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":{"a":1}}}]}}]}"#,
                "`choices[0].delta.tool_calls[0].function.arguments`",
            ),
        ] {
            let evs = events_of(&driver(fake_upstream(sse(&[event, "[DONE]"])), 5000));
            assert!(
                matches!(evs.last(), Some(EngineEvent::Error(EngineError::Upstream(m)))
                    if m.contains(path) && m.contains("not of the API's type")),
                "{event}: {evs:?}"
            );
        }
    }

    #[test]
    fn a_vllm_models_list_gives_the_context_window() {
        // vLLM's `GET /v1/models`, as a vLLM server answered it (quoted from a vendor's
        // API reference built on vLLM): `max_model_len`, `root`, `parent`, `permission`.
        const VLLM: &[u8] = br#"HTTP/1.1 200 OK
content-type: application/json
connection: close

{"data":[{"created":1756885796,"id":"seongil-dn/bge-m3-3800_steps_v2_234","max_model_len":1024,"object":"model","owned_by":"vllm","parent":null,"permission":[{"allow_create_engine":false,"allow_fine_tuning":false,"allow_logprobs":true,"allow_sampling":true,"allow_search_indices":false,"allow_view":true,"created":1756885796,"group":null,"id":"modelperm-cb01ad02375f4989a5730d7e103b03ab","is_blocking":false,"object":"model_permission","organization":"*"}],"root":"seongil-dn/bge-m3-3800_steps_v2_234"}],"object":"list"}"#;
        let addr = routed_upstream(vec![(b"GET /v1/models", VLLM)]);
        let d = ready(
            UpstreamDriver::start(UpstreamConfig {
                base_urls: vec![format!("http://{addr}")],
                ..UpstreamConfig::default()
            })
            .unwrap(),
        );
        let m = d.models();
        assert_eq!(m.len(), 1);
        assert_eq!(
            (m[0].id.as_str(), m[0].context_length),
            ("seongil-dn/bge-m3-3800_steps_v2_234", 1024)
        );
        // A list whose entry has a field of the wrong type: down, the field named.
        let bad = routed_upstream(vec![(
            b"GET /v1/models",
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n{\"data\": [{\"id\": \"m\", \"max_model_len\": \"big\"}]}",
        )]);
        let d = UpstreamDriver::start(UpstreamConfig {
            base_urls: vec![format!("http://{bad}")],
            ..UpstreamConfig::default()
        })
        .unwrap();
        let t = Instant::now();
        while d.upstreams()[0].error.is_none() {
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", d.upstreams());
            std::thread::sleep(Duration::from_millis(10));
        }
        let e = d.upstreams()[0].error.clone().unwrap();
        assert!(e.contains("`data[0].max_model_len`"), "{e}");
    }

    /// A mock upstream answering each request with the reply of the first route whose
    /// prefix its head starts with (else a 404).
    fn routed_upstream(routes: Vec<(&'static [u8], &'static [u8])>) -> std::net::SocketAddr {
        mock_upstream(move |head| {
            Answer::Reply(
                routes
                    .iter()
                    .find(|(p, _)| head.starts_with(p))
                    .map_or(NOT_FOUND, |(_, r)| r),
            )
        })
    }

    const NOT_FOUND: &[u8] =
        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

    #[test]
    fn health_checks_fall_back_to_the_models_list_and_a_failing_one_is_out() {
        // No /health route at all: the models list decides.
        let plain = routed_upstream(vec![(b"GET /v1/models", MODELS)]);
        // A /health that says it is not ready, though its models list answers.
        let loading = routed_upstream(vec![
            (
                b"GET /health",
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 7\r\nconnection: close\r\n\r\nloading",
            ),
            (b"GET /v1/models", MODELS),
        ]);
        let d = UpstreamDriver::start(UpstreamConfig {
            base_urls: vec![format!("http://{loading}"), format!("http://{plain}/v1/")],
            health_interval: Duration::from_millis(50),
            ..UpstreamConfig::default()
        })
        .unwrap();
        let t = Instant::now();
        while d.readiness() != Readiness::Ready || d.upstreams()[0].error.is_none() {
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", d.upstreams());
            std::thread::sleep(Duration::from_millis(10));
        }
        let u = d.upstreams();
        assert_eq!(u[1].base_url, format!("http://{plain}"));
        assert!(u[1].healthy && u[1].error.is_none(), "{u:?}");
        assert!(!u[0].healthy, "{u:?}");
        let e = u[0].error.clone().unwrap();
        assert!(e.contains("503") && e.contains("loading"), "{e}");
        assert_eq!(d.models().len(), 1);
        assert_eq!(d.models()[0].id, "fake");
        // Bad configurations are errors, not panics.
        for cfg in [
            UpstreamConfig::default(),
            UpstreamConfig {
                base_urls: vec![format!("http://{plain}")],
                health_interval: Duration::ZERO,
                ..UpstreamConfig::default()
            },
            UpstreamConfig {
                base_urls: vec![format!("http://{plain}"), "nope".into()],
                ..UpstreamConfig::default()
            },
        ] {
            assert!(matches!(
                UpstreamDriver::start(cfg),
                Err(EngineError::InvalidRequest(_))
            ));
        }
    }

    #[test]
    fn health_checks_ask_the_models_list_only_while_the_models_are_unknown() {
        // llama.cpp's Python server: no /health route, and a models request interrupts
        // the generation under way. Count what the checks ask.
        let (health, models) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (h, m) = (Arc::clone(&health), Arc::clone(&models));
        let addr = mock_upstream(move |head| {
            Answer::Reply(if head.starts_with(b"GET /v1/models") {
                m.fetch_add(1, Ordering::SeqCst);
                MODELS
            } else {
                h.fetch_add(1, Ordering::SeqCst);
                NOT_FOUND
            })
        });
        let d = UpstreamDriver::start(UpstreamConfig {
            base_urls: vec![format!("http://{addr}")],
            health_interval: Duration::from_millis(20),
            ..UpstreamConfig::default()
        })
        .unwrap();
        let t = Instant::now();
        while health.load(Ordering::SeqCst) < 10 {
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", d.upstreams());
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(d.readiness(), Readiness::Ready);
        assert_eq!(d.models()[0].id, "fake");
        assert_eq!(
            models.load(Ordering::SeqCst),
            1,
            "the models list asked once"
        );
    }

    #[test]
    fn a_models_list_behind_a_key_is_up_on_the_anthropic_wire_with_a_named_model() {
        let keyed = routed_upstream(vec![(
            b"GET /v1/models",
            b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 27\r\nconnection: close\r\n\r\n{\"error\": \"x-api-key\"}\n\n\n\n\n",
        )]);
        let start = |wire: Wire, model: Option<&str>| {
            let d = UpstreamDriver::start_wire(
                UpstreamConfig {
                    base_urls: vec![format!("http://{keyed}")],
                    model: model.map(str::to_string),
                    ..UpstreamConfig::default()
                },
                wire,
            )
            .unwrap();
            let t = Instant::now();
            while d.readiness() == Readiness::Loading {
                assert!(t.elapsed() < Duration::from_secs(10));
                std::thread::sleep(Duration::from_millis(10));
            }
            d
        };
        let d = start(Wire::Anthropic, Some("claude-x"));
        assert_eq!(d.readiness(), Readiness::Ready);
        assert_eq!(d.models()[0].id, "claude-x");
        assert_eq!(d.models()[0].owned_by, "anthropic-upstream");
        assert!(d.forwards_client_body(None));
        // Not without a model named, nor on the OpenAI wire (where the key is ours).
        for (wire, model) in [(Wire::Anthropic, None), (Wire::OpenAi, Some("claude-x"))] {
            let d = start(wire, model);
            let r = d.readiness();
            assert!(
                matches!(&r, Readiness::Failed(m) if m.contains("401")),
                "{r:?}"
            );
        }
    }

    #[test]
    fn an_upstream_that_is_down_is_not_ready() {
        // A port nothing listens on.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let d = UpstreamDriver::start(UpstreamConfig {
            base_urls: vec![format!("http://{addr}")],
            ..UpstreamConfig::default()
        })
        .unwrap();
        let t = Instant::now();
        while d.readiness() == Readiness::Loading {
            assert!(t.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(10));
        }
        let r = d.readiness();
        assert!(
            matches!(&r, Readiness::Failed(m) if m.contains("cannot reach")),
            "{r:?}"
        );
        assert!(matches!(ask(&d), Err(EngineError::NotReady(_))));
    }
}
