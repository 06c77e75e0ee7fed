//! fak-engine: what answers a generation request, behind one trait.
//!
//! One job: turn a [`GenerateRequest`] (a chat conversation or a plain prompt, sampling
//! parameters, a token budget) into a stream of [`EngineEvent`]s, whatever does the
//! generating. The HTTP layer above (fak-gateway) speaks only to [`EngineDriver`].
//!
//! - [`EngineDriver`]: `submit` validates a request synchronously (unknown model,
//!   context overflow, overload are errors *before* any streaming starts) and returns an
//!   [`EventStream`]: `Start` (prompt and cached token counts), `Text` deltas (each
//!   preceded by the `Logprobs` of the tokens it releases, when the request asked for
//!   them), then `Done` or `Error`. Dropping the stream cancels the generation (the driver sees the
//!   closed channel and stops within one token).
//! - [`registry`]: drivers by id, a [`registry::Registry`] value the caller builds
//!   ([`registry::Registry::builtin`]: `inkernel` and `mock`; the `fak-upstream` crate
//!   adds `openai-upstream` and `anthropic-upstream`); a new driver is a type with a
//!   [`registry::DriverSpec`] added there, never an edit of the gateway.
//! - [`inkernel`]: the model loaded once and shared by `Arc`; `parallel` worker threads
//!   take jobs from a bounded queue; a [`prefix::PrefixCache`] of recent sessions keyed
//!   by their token ids lets a request that extends an earlier conversation clone the
//!   longest cached prefix (`Session::from_prefix`-style) and prefill only the rest.
//! - [`upstream`]: the configuration of an upstream server ([`upstream::UpstreamConfig`]).
//!   The drivers for which another server's OpenAI-compatible API (vLLM, llama.cpp,
//!   SGLang, another fak) or Anthropic-compatible Messages API does the generating live
//!   in the `fak-upstream` crate; the kernel boundary above stays in this process. The
//!   Anthropic driver forwards the client's own request bytes ([`RawRequest`]) so the
//!   upstream's prompt cache keeps working.
//! - [`route`]: several drivers side by side, each serving one model id, chosen by the
//!   request's `model` (`fak serve --route MODEL=ENGINE`).
//! - [`mock`]: deterministic text without a model, for tests of the layers above.
//!
//! Inference is CPU-bound and synchronous: drivers run it on their own threads, never
//! on an async runtime's; events cross to the async side through an unbounded tokio
//! channel (sending never blocks the worker).

pub mod alias;
pub mod inkernel;
pub mod mock;
pub mod persist;
pub mod policy;
pub mod prefix;
pub mod presets;
pub mod registry;
pub mod route;
pub mod schema;
pub mod tool_grammar;
pub mod tools;
pub mod upstream;

pub use fak_kv::logprobs::MAX_TOP_LOGPROBS;
pub use fak_kv::{
    FinishReason, GrammarSpec, SamplingParams, TokenLogprob, TopLogprob, BATCH_SIZE_BOUNDS,
};
pub use fak_model::Message;
pub use tools::{ToolCall, ToolChoice, ToolSpec};

use std::path::PathBuf;
use tokio::sync::mpsc;

/// Most choices one request may ask for ([`EngineDriver::submit_n`]'s `n`, the OpenAI
/// wire's `n`). Each choice is a sequence decoding beside the others (its own KV cache
/// after the shared prompt), so the bound keeps one request's memory and compute to a
/// small multiple of one generation's.
pub const MAX_CHOICES: usize = 16;

/// The sampling seed of choice `index` of a request seeded with `seed`
/// ([`EngineDriver::submit_n`]): `seed` itself for choice 0 (so choice 0 of an `n > 1`
/// request is the same text as the `n = 1` request), for the others a SplitMix64 mix
/// of `seed` and `index` (Steele, Lea and Flood 2014, "Fast splittable pseudorandom
/// number generators"), so the choices' streams differ and are reproducible.
pub fn choice_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Checks a choice count against `1..=`[`MAX_CHOICES`].
///
/// # Errors
/// [`EngineError::InvalidRequest`] naming `n` and the bound.
pub fn check_choices(n: usize) -> Result<(), EngineError> {
    if n == 0 || n > MAX_CHOICES {
        return Err(EngineError::InvalidRequest(format!(
            "n = {n}: the number of choices must be in 1..={MAX_CHOICES}"
        )));
    }
    Ok(())
}

/// The one stream of a one-choice [`EngineDriver::submit_n`].
///
/// # Errors
/// [`EngineError::Internal`] when the driver returned no stream.
pub fn single(streams: Vec<EventStream>) -> Result<EventStream, EngineError> {
    streams
        .into_iter()
        .next()
        .ok_or_else(|| EngineError::Internal("the engine started no generation".into()))
}

/// What to generate from.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// A conversation, rendered with the model's chat template (generation prompt added).
    Chat(Vec<Message>),
    /// Plain text, tokenized as is (BOS added when the model asks for it).
    Text(String),
    /// Token ids, prefilled as they are: no BOS added, no template, control tokens
    /// included (the way to send them). An id outside the model's vocabulary is
    /// [`EngineError::InvalidRequest`] naming the first such id; a driver without a
    /// vocabulary of its own (an upstream) passes them on.
    Tokens(Vec<u32>),
}

/// One generation request, in the engine's terms (the gateway maps each API's fields
/// onto it).
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    /// Requested model id; `None` takes the driver's default. An id the driver does not
    /// serve is [`EngineError::UnknownModel`].
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Most new tokens; `None` means up to the end of the context window. `Some(0)` is
    /// [`EngineError::InvalidRequest`].
    pub max_tokens: Option<usize>,
    /// How to choose tokens (temperature 0 is greedy).
    pub sampling: SamplingParams,
    /// Stop strings: generation ends before the first occurrence, which is not returned.
    pub stop: Vec<String>,
    /// Tools offered to the model (chat prompts only; see [`tools`]).
    pub tools: Vec<ToolSpec>,
    /// Which calls the model may or must make (ignored without tools).
    pub tool_choice: ToolChoice,
    /// `Some(n)`: report each generated token's logprob and its `n` most likely
    /// alternatives ([`EngineEvent::Logprobs`]; `n` at most
    /// [`MAX_TOP_LOGPROBS`], else [`EngineError::InvalidRequest`]).
    /// `None` (the default): no logprobs.
    pub logprobs: Option<usize>,
    /// Which partition of a driver's KV reuse cache the request may read and write
    /// ([`prefix::Partition::new`] of this name): requests share cached prefixes, and
    /// so learn anything from `cached_tokens`, only within one partition. The gateway
    /// names it after the API key the request authenticated with and the request's
    /// `cache_salt`; `""` (the default): the partition of requests with neither.
    pub cache_partition: String,
    /// The client's request as it came on the wire, for a driver that forwards it
    /// ([`EngineDriver::forwards_client_body`]); `None` for every other driver. The
    /// fields above still describe the same request (the gateway parsed them from it).
    pub raw: Option<RawRequest>,
    /// For a chat prompt whose last message is the assistant's: continue that message
    /// token for token instead of closing it and starting a new turn (an Anthropic
    /// prefill). The prompt is the conversation rendered without a generation prompt
    /// and cut right after the final message's content, as HF transformers'
    /// `apply_chat_template(..., continue_final_message=True)` does; the reply is what
    /// follows. `false` (the default): every message is closed and a generation prompt
    /// added.
    pub continue_final_message: bool,
    /// What a `max_tokens` larger than the room the prompt leaves in the context means:
    /// `true`, it is lowered to that room, and a reply that fills it ends with
    /// [`FinishReason::Length`] (the Anthropic API's behaviour); `false` (the default),
    /// it is [`EngineError::ContextOverflow`] (the OpenAI API's). A prompt that alone
    /// leaves no room is an overflow either way.
    pub cap_max_tokens: bool,
    /// What to do when a chat prompt and the room its reply needs do not fit the
    /// context window ([`ContextOverflow`]); `None`: the driver's
    /// [`EngineConfig::context_overflow`].
    pub context_overflow: Option<ContextOverflow>,
}

/// What the in-kernel driver does when a chat conversation, with the room its reply
/// needs (`max_tokens`; at most a quarter of the window when `max_tokens` is lowered to
/// the room left, [`GenerateRequest::cap_max_tokens`]; 512 tokens, at most a quarter of
/// the window, when not given), no longer fits the context window. A pinned system turn (the leading `system` and
/// `developer` messages) is never dropped, nor is the last turn; a turn is a `user`
/// message and everything after it up to the next one (a tool call and its result stay
/// together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContextOverflow {
    /// The request is refused ([`EngineError::ContextOverflow`] or
    /// [`EngineError::InvalidRequest`] naming the numbers), as before.
    #[default]
    Error,
    /// The oldest whole turns are dropped, and the KV cache of the conversation's last
    /// request is kept with their span evicted and the rest renumbered from their
    /// pre-RoPE keys in one rotation: only the new tokens are prefilled. **An
    /// approximation**, as llama.cpp's context shift is: the kept turns were computed
    /// while the dropped ones were in context, so the reply can differ from a
    /// conversation that only ever held the kept turns. Such caches are kept apart from
    /// exact ones (a request in another mode never reuses them).
    Shift,
    /// The oldest whole turns are dropped and the kept ones prefilled anew (only the
    /// pinned system turn, and any prefix of the kept turns already cached exactly,
    /// reused): the cache equals a conversation that only ever held the kept turns.
    /// Exact; costs one prefill of the kept turns each time the cut moves.
    Rebuild,
}

impl ContextOverflow {
    /// `"error"`, `"shift"` or `"rebuild"`.
    pub fn name(self) -> &'static str {
        match self {
            ContextOverflow::Error => "error",
            ContextOverflow::Shift => "shift",
            ContextOverflow::Rebuild => "rebuild",
        }
    }
}

/// A client's Anthropic Messages request (`POST /v1/messages`) as it came, for the
/// `anthropic-upstream` driver to forward byte for byte, so that the upstream's prompt
/// cache sees the same bytes the client sent.
#[derive(Clone, PartialEq, Eq)]
pub struct RawRequest {
    /// The JSON body: the client's bytes unchanged, except that the `content` value of
    /// each tool result the boundary replaced (quarantined, paged out) holds its stub,
    /// a JSON string, spliced in at that value's byte span.
    pub body: hyper::body::Bytes,
    /// Client headers to pass on, as (lowercase name, value): `x-api-key` (unless it was
    /// this server's own key), `anthropic-version`, `anthropic-beta`.
    pub headers: Vec<(String, String)>,
    /// Whether the body asks for a stream (`"stream": true`): the upstream then answers
    /// with server-sent events, else with one JSON message.
    pub stream: bool,
}

impl std::fmt::Debug for RawRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(k, v)| {
                let shown = if k == "x-api-key" {
                    "(set)"
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("RawRequest")
            .field("body_bytes", &self.body.len())
            .field("headers", &headers)
            .field("stream", &self.stream)
            .finish()
    }
}

impl GenerateRequest {
    /// A greedy chat request with the default model and no token limit.
    pub fn chat(messages: Vec<Message>) -> Self {
        GenerateRequest {
            model: None,
            prompt: Prompt::Chat(messages),
            max_tokens: None,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            tools: Vec::new(),
            tool_choice: ToolChoice::Auto,
            logprobs: None,
            cache_partition: String::new(),
            raw: None,
            continue_final_message: false,
            cap_max_tokens: false,
            context_overflow: None,
        }
    }

    /// `max_tokens` as the budget for a prompt of `prompt_tokens` in a context of
    /// `context` tokens: lowered to the room left when [`GenerateRequest::cap_max_tokens`]
    /// is set, else as asked. A capped request whose prompt leaves no room gets `None`,
    /// which [`budget`] reports as the prompt alone filling the window (its message
    /// names the prompt's tokens and the window, not a `max_tokens` the client never
    /// asked for).
    pub fn max_tokens_within(&self, prompt_tokens: usize, context: usize) -> Option<usize> {
        match self.max_tokens {
            Some(m) if self.cap_max_tokens && m > 0 => {
                match context.saturating_sub(prompt_tokens) {
                    0 => None,
                    room => Some(m.min(room)),
                }
            }
            m => m,
        }
    }

    /// Whether tool calls are offered and read: tools given and `tool_choice` not
    /// `none`.
    pub fn tools_active(&self) -> bool {
        !self.tools.is_empty() && self.tool_choice != ToolChoice::None
    }

    /// Checks the request's own fields that need no model (the `logprobs` count).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] naming the field and its range.
    pub fn validate(&self) -> Result<(), EngineError> {
        let max = MAX_TOP_LOGPROBS;
        match self.logprobs {
            Some(n) if n > max => Err(EngineError::InvalidRequest(format!(
                "top logprobs {n} must be in 0..={max}"
            ))),
            _ => Ok(()),
        }
    }
}

/// How a finished generation ended and what it cost.
#[derive(Clone, Debug, PartialEq)]
pub struct Done {
    /// Tokens generated, including a final stop token (EOS / end of turn).
    pub completion_tokens: usize,
    /// The generated token ids (`completion_tokens` of them; the mock reports its own
    /// word indices; empty from an upstream, whose wire carries no ids).
    pub completion_ids: Vec<u32>,
    /// `Stop` (stop token or stop string) or `Length` (`max_tokens` or the context end).
    pub finish_reason: FinishReason,
    /// The stop string that ended generation, if one did.
    pub stop_sequence: Option<String>,
    /// With [`FinishReason::GrammarDeadEnd`]: why the grammar allowed no token
    /// (llguidance's message; [`fak_kv::TextOutput::dead_end`]); else `None`.
    pub dead_end: Option<String>,
    /// Seconds from the request's arrival to the first generated token: for the
    /// in-kernel driver its wait in the queue for a worker and its prefill.
    pub ttft_s: f64,
    /// Seconds of the decode steps after the first token (0 for a one-token reply).
    pub decode_s: f64,
    /// Seconds from each generated token to the next, in order
    /// ([`fak_kv::TextOutput::token_gaps_s`]; `/metrics`' inter-token latency
    /// histogram). Empty where the driver does not see single tokens (an upstream, the
    /// mock).
    pub token_gaps_s: Vec<f32>,
    /// The prompt's counts when the driver learnt them only at the end (an upstream
    /// server reports usage in its last chunk): they replace those of
    /// [`EngineEvent::Start`]. `None`: `Start`'s counts stand.
    pub prompt_usage: Option<PromptUsage>,
}

/// Prompt token counts reported late (see [`Done::prompt_usage`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PromptUsage {
    /// Tokens of the prompt after templating.
    pub prompt_tokens: usize,
    /// Of those, tokens read from a cache.
    pub cached_tokens: usize,
    /// Of those not read from a cache, tokens written to one (Anthropic's
    /// `cache_creation_input_tokens`; 0 when the upstream does not say).
    pub cache_creation_tokens: usize,
}

/// One event of a generation, in order: `Start`, any number of `Logprobs`, `Text` and
/// `ToolCall`, then exactly one of `Done` or `Error`.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// A worker took the request (an upstream driver: the upstream accepted it).
    Start {
        /// Tokens of the prompt after templating (0 when only known at the end; then
        /// [`Done::prompt_usage`] has them).
        prompt_tokens: usize,
        /// Of those, tokens whose KV entries were reused from an earlier request.
        cached_tokens: usize,
    },
    /// The next piece of text (whole UTF-8 characters, never part of a stop string).
    Text(String),
    /// Only when the request set [`GenerateRequest::logprobs`]: the records of the
    /// generated tokens whose text the next `Text` releases (see
    /// [`fak_kv::generate_text_with_logprobs`] for the mapping), sent just before it.
    /// Records of tokens whose text became a tool call, or of tokens that released no
    /// text by the end, come in a last `Logprobs` before `Done`. All `Logprobs` of a
    /// generation, concatenated, list its generated tokens except stop tokens (EOS, end
    /// of turn) and tokens wholly inside a matched stop string.
    Logprobs(Vec<TokenLogprob>),
    /// A tool call read from the reply (only when the request offered tools), whole.
    /// It may be [`ToolCall::malformed`]: the layer above decides what the client sees.
    ToolCall(ToolCall),
    /// Generation finished.
    Done(Done),
    /// Generation failed after it started.
    Error(EngineError),
}

/// Errors a driver reports, each mapping to one HTTP status (noted per variant).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The request names a model this driver does not serve (404).
    #[error("model '{requested}' is not served here (available: {})", available.join(", "))]
    UnknownModel {
        /// The id asked for.
        requested: String,
        /// The ids served.
        available: Vec<String>,
    },
    /// A parameter is out of range or the prompt cannot be rendered (400).
    #[error("{0}")]
    InvalidRequest(String),
    /// The prompt plus `max_tokens` do not fit the context window (400).
    #[error("{}", overflow_message(*prompt_tokens, *max_tokens, *context))]
    ContextOverflow {
        /// Prompt tokens after templating.
        prompt_tokens: usize,
        /// Tokens requested (`None`: the request set no limit, and the prompt leaves no
        /// room for even one).
        max_tokens: Option<usize>,
        /// The model's context length in tokens.
        context: usize,
    },
    /// The queue is full (429 with `Retry-After`).
    #[error("the engine is busy ({queued} requests queued); retry in {retry_after_s} s")]
    Overloaded {
        /// Requests waiting.
        queued: usize,
        /// Suggested wait, seconds.
        retry_after_s: u64,
    },
    /// The engine cannot serve yet but may soon: the model is still loading, or no
    /// upstream is reachable now (503 with `Retry-After`).
    #[error("the engine is not ready: {0}")]
    NotReady(String),
    /// The model failed to load, so no request for it can succeed until the server is
    /// restarted with a working model: a retry cannot help (500 with
    /// `x-should-retry: false`, no `Retry-After`). The message says why, naming the model
    /// by its id and never by its path.
    #[error("the model cannot be served: {0}")]
    LoadFailed(String),
    /// The server is shutting down: the request was refused, or answered while it still
    /// waited for a worker, or cancelled when the shutdown grace ended (503 with
    /// `Retry-After`; see [`EngineDriver::drain`]).
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The generation failed inside the engine (500).
    #[error("engine error: {0}")]
    Internal(String),
    /// The upstream server could not be reached, failed, or answered something that is
    /// not a valid reply (502).
    #[error("upstream error: {0}")]
    Upstream(String),
    /// The upstream server did not answer, or stalled mid-reply, within its time limit
    /// (504).
    #[error("upstream timeout: {0}")]
    UpstreamTimeout(String),
    /// The upstream refused the client's own credentials, passed through to it
    /// (`status` 401 or 403, kept; the `anthropic-upstream` driver with the client's
    /// `x-api-key`). A refusal of this server's own key is [`EngineError::Upstream`].
    #[error("the upstream refused the request's credentials ({status}): {message}")]
    Refused {
        /// The upstream's status, 401 or 403.
        status: u16,
        /// The upstream's message.
        message: String,
    },
}

/// Whether a driver can take requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Loading the model; requests get [`EngineError::NotReady`].
    Loading,
    /// Serving.
    Ready,
    /// Not serving; the message says why. For the in-kernel driver the model failed to
    /// load (final: requests get [`EngineError::LoadFailed`] and its model is left out of
    /// [`EngineDriver::models`]); for an upstream driver no upstream answers now (it may
    /// come back).
    Failed(String),
}

/// A model a driver serves.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ModelInfo {
    /// The id clients send as `model`.
    pub id: String,
    /// Context window, tokens.
    pub context_length: usize,
    /// Who serves it (the driver id).
    pub owned_by: String,
}

/// Load figures a driver reports for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Requests waiting for a worker.
    pub queue_depth: usize,
    /// Requests being generated now.
    pub active: usize,
    /// Sessions held by the KV reuse cache.
    pub kv_entries: usize,
    /// Bytes of KV entries held by the reuse cache, each session counted whole.
    pub kv_bytes: usize,
    /// Bytes of memory those entries take, a prefix shared by several sessions counted
    /// once ([`prefix::PrefixCache::bytes_held`]).
    pub kv_bytes_held: usize,
    /// Upstream servers behind the driver (0 for a driver that generates itself).
    pub upstreams: usize,
    /// Of those, the ones in rotation (their last health check passed).
    pub upstreams_healthy: usize,
    /// Batched forward passes run (continuous batching; 0 with one slot).
    pub batch_passes: u64,
    /// Sequences summed over those passes (over `batch_passes`: the mean batch size).
    pub batch_sequences: u64,
    /// Sequences in the largest pass so far.
    pub batch_max_sequences: usize,
    /// Passes of at most [`BATCH_SIZE_BOUNDS`]`[i]` sequences, per `i`
    /// (cumulative; [`fak_kv::BatchStats::passes_within`]).
    pub batch_passes_within: [u64; BATCH_SIZE_BOUNDS.len()],
}

/// The receiving end of one generation. Dropping it cancels the generation: it trips
/// the generation's [`CancelHandle`], which the in-kernel driver checks between
/// prefill chunks and before every decode step.
#[derive(Debug)]
pub struct EventStream {
    rx: mpsc::UnboundedReceiver<EngineEvent>,
    cancel: CancelHandle,
}

/// The sending end a driver's worker holds.
#[derive(Clone, Debug)]
pub struct EventSink {
    tx: mpsc::UnboundedSender<EngineEvent>,
    cancel: CancelHandle,
}

/// A flag that asks one generation to stop: tripped when its [`EventStream`] is
/// dropped (the client went away, the request's time limit passed) or by
/// [`CancelHandle::cancel`]. Cloning shares the flag.
#[derive(Clone, Debug, Default)]
pub struct CancelHandle(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl CancelHandle {
    /// Asks the generation to stop (at its next check: within one prefill chunk or one
    /// decode step for the in-kernel driver).
    pub fn cancel(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether it was asked to stop.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The flag itself, for code that polls an `AtomicBool` (such as
    /// [`fak_kv::generate_text_with_logprobs`]).
    pub fn flag(&self) -> &std::sync::atomic::AtomicBool {
        &self.0
    }

    /// The flag, shared (for [`fak_kv::Session::attach_cancellable`]).
    pub fn shared_flag(&self) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
        std::sync::Arc::clone(&self.0)
    }
}

/// A connected sink and stream.
pub fn event_channel() -> (EventSink, EventStream) {
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = CancelHandle::default();
    (
        EventSink {
            tx,
            cancel: cancel.clone(),
        },
        EventStream { rx, cancel },
    )
}

impl Drop for EventStream {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl EventSink {
    /// Sends an event; `false` when the stream was dropped (the client went away).
    pub fn send(&self, e: EngineEvent) -> bool {
        self.tx.send(e).is_ok()
    }

    /// Whether the stream was dropped.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// The generation's cancel flag: tripped once the stream is dropped or its
    /// [`EventStream::cancel_handle`] is used.
    pub fn cancel_handle(&self) -> &CancelHandle {
        &self.cancel
    }

    /// Resolves once the stream is dropped (for drivers that wait on I/O).
    pub async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// A worker's side of one generation's text: passes each piece through the tool-call
/// parser (for chat requests) and sends it with the logprob records it releases,
/// records first (see [`EngineEvent::Logprobs`]). The records of a tool call's tokens
/// are dropped with the call's text: only the call itself goes up, to be adjudicated.
pub(crate) struct PieceSender<'a> {
    sink: &'a EventSink,
    parser: Option<tools::ToolCallParser>,
    /// Records waiting for the next `Text`.
    held: Vec<TokenLogprob>,
}

impl<'a> PieceSender<'a> {
    /// A sender into `sink`; `parser` reads tool calls out of the text.
    pub(crate) fn new(sink: &'a EventSink, parser: Option<tools::ToolCallParser>) -> Self {
        PieceSender {
            sink,
            parser,
            held: Vec::new(),
        }
    }

    /// Sends `text` (possibly empty) and `records`; `false` once the client left.
    pub(crate) fn piece(&mut self, text: &str, records: &[TokenLogprob]) -> bool {
        self.held.extend_from_slice(records);
        match self.parser.as_mut() {
            None if text.is_empty() => true,
            None => {
                let t = EngineEvent::Text(text.to_string());
                self.send_held() && self.sink.send(t)
            }
            Some(p) => {
                let out = p.push(text);
                out.into_iter().all(|x| self.send_parsed(x))
            }
        }
    }

    /// Ends the text: the parser's last events, then any records still held.
    /// `finish` is how generation ended (a call cut off at `Length` is truncated,
    /// [`ToolCall::truncated`]).
    pub(crate) fn finish(mut self, finish: FinishReason) -> bool {
        if let Some(p) = self.parser.take() {
            let cut = finish == FinishReason::Length;
            if !p.finish(cut).into_iter().all(|x| self.send_parsed(x)) {
                return false;
            }
        }
        self.send_held()
    }

    fn send_parsed(&mut self, x: tools::Parsed) -> bool {
        match x {
            tools::Parsed::Text(t) => self.send_held() && self.sink.send(EngineEvent::Text(t)),
            tools::Parsed::Call(c) => {
                // The records held now are the call's own tokens: they are not sent, so a
                // call the layer above denies cannot be read back out of the logprobs.
                self.held.clear();
                self.sink.send(EngineEvent::ToolCall(c))
            }
        }
    }

    fn send_held(&mut self) -> bool {
        self.held.is_empty()
            || self
                .sink
                .send(EngineEvent::Logprobs(std::mem::take(&mut self.held)))
    }
}

impl EventStream {
    /// The next event, or `None` once the driver is done (or its worker died).
    pub async fn next(&mut self) -> Option<EngineEvent> {
        self.rx.recv().await
    }

    /// A handle that stops this generation without dropping the stream (a driver
    /// checks it as it checks for a dropped stream).
    pub fn cancel_handle(&self) -> CancelHandle {
        self.cancel.clone()
    }

    /// The next event, blocking the thread. Must not be called from async code.
    pub fn blocking_next(&mut self) -> Option<EngineEvent> {
        self.rx.blocking_recv()
    }

    /// Blocks until the generation ends and gathers it. Must not be called from async
    /// code.
    ///
    /// # Errors
    /// The driver's [`EngineEvent::Error`], or [`EngineError::Internal`] when the stream
    /// ends without `Done`.
    pub fn blocking_collect(mut self) -> Result<Collected, EngineError> {
        let mut c = Collected::default();
        while let Some(e) = self.blocking_next() {
            if c.absorb(e)? {
                return Ok(c);
            }
        }
        Err(EngineError::Internal(
            "the generation ended without a result".into(),
        ))
    }

    /// Async form of [`EventStream::blocking_collect`].
    ///
    /// # Errors
    /// As [`EventStream::blocking_collect`].
    pub async fn collect(mut self) -> Result<Collected, EngineError> {
        let mut c = Collected::default();
        while let Some(e) = self.next().await {
            if c.absorb(e)? {
                return Ok(c);
            }
        }
        Err(EngineError::Internal(
            "the generation ended without a result".into(),
        ))
    }
}

/// A whole generation gathered from its events.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Collected {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens reused from the KV cache.
    pub cached_tokens: usize,
    /// The concatenated text.
    pub text: String,
    /// The tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
    /// Every [`EngineEvent::Logprobs`] record, in order (empty unless asked for).
    pub logprobs: Vec<TokenLogprob>,
    /// The ending (`None` only while incomplete).
    pub done: Option<Done>,
}

impl Collected {
    /// Adds one event; `Ok(true)` once `Done` arrived.
    ///
    /// # Errors
    /// The event's error, for [`EngineEvent::Error`].
    pub fn absorb(&mut self, e: EngineEvent) -> Result<bool, EngineError> {
        match e {
            EngineEvent::Start {
                prompt_tokens,
                cached_tokens,
            } => {
                self.prompt_tokens = prompt_tokens;
                self.cached_tokens = cached_tokens;
            }
            EngineEvent::Text(t) => self.text.push_str(&t),
            EngineEvent::Logprobs(v) => self.logprobs.extend(v),
            EngineEvent::ToolCall(c) => self.tool_calls.push(c),
            EngineEvent::Done(d) => {
                if let Some(u) = d.prompt_usage {
                    self.prompt_tokens = u.prompt_tokens;
                    self.cached_tokens = u.cached_tokens;
                }
                self.done = Some(d);
                return Ok(true);
            }
            EngineEvent::Error(e) => return Err(e),
        }
        Ok(false)
    }
}

/// Content to take out of every cached conversation: a tool result named by the
/// sha256 of its text ([`fak_ctxmmu::digest`]) or by the id of the call it answered.
/// Either field matching is enough. Serialized as `/v1/fak/revoke`'s reply names it
/// (`{"tool_call_id": ..., "digest": ...}`, each `null` when not given).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Revocation {
    /// The `tool_call_id` (OpenAI) / `tool_use_id` (Anthropic) the result answered.
    pub tool_call_id: Option<String>,
    /// sha256 hex of the result's text as it entered the prompt.
    pub digest: Option<String>,
}

/// What a revocation did to the KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RevokeReport {
    /// Kept sessions that held the content (each cut back to before it, or dropped).
    pub sessions: usize,
    /// KV positions dropped across them.
    pub tokens_dropped: usize,
}

/// Settings every driver is built from (the `fak serve` flags).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// The model file or folder (inkernel).
    pub model_path: Option<PathBuf>,
    /// The id the model is served under; default: the file's stem.
    pub model_id: Option<String>,
    /// Worker slots generating at once (at least 1; default 4, as llama.cpp's server's
    /// `--parallel` auto). With more than one, their forward passes are batched
    /// ([`fak_kv::Batcher`]); each reply is the same bits as alone.
    pub parallel: usize,
    /// Requests that may wait for a slot before new ones get
    /// [`EngineError::Overloaded`] (taken as at least 1).
    pub max_queue: usize,
    /// Memory budget of the KV reuse cache, bytes (0 disables reuse): the sessions kept
    /// *between* requests. Not to be confused with [`EngineConfig::max_kv_bytes`].
    pub kv_budget_bytes: usize,
    /// Most KV cache one generation may hold, bytes (its prompt and generated tokens,
    /// at [`fak_kv::KvCache::bytes_per_token`] each; the `n` choices of one request
    /// together, the prompt they share counted once, [`EngineDriver::submit_n`]): a prompt needing more is
    /// [`EngineError::InvalidRequest`] naming the limit, and a generation reaching it
    /// ends with [`FinishReason::Length`], as at the end of the context window. (The
    /// buffers' allocation past [`fak_kv::KvCache::RESERVED_TOKENS`] entries may round up
    /// to the next doubling.) `None`: [`default_max_kv_bytes`] of
    /// [`EngineConfig::parallel`].
    pub max_kv_bytes: Option<usize>,
    /// Threads per matrix product (default: all cores).
    pub threads: Option<usize>,
    /// How the in-kernel driver keeps the model's matrices (default
    /// [`fak_model::WeightMode::Exact`], the path proven against HF;
    /// [`fak_model::WeightMode::Native`] keeps them quantized and decodes faster).
    pub weights: fak_model::WeightMode,
    /// Whether [`EngineDriver::revoke`] takes revoked content out of the KV cache
    /// (default on; `fak serve --no-kv-evict` turns it off, and then a cached prefix
    /// may still hold content revoked after it was cached).
    pub kv_evict: bool,
    /// Whether the in-kernel driver constrains a call that `tool_choice` forces
    /// (`required`, a named tool), and a call the model opens under `auto`, to the
    /// call grammar of the offered tools ([`tool_grammar`]; default on). Off, the
    /// reply is the model's own text, as before constrained decoding (kept for
    /// measuring the difference).
    pub constrain_tool_calls: bool,
    /// The upstream server (`openai-upstream`, `anthropic-upstream`).
    pub upstream: upstream::UpstreamConfig,
    /// Where the in-kernel driver writes its kept conversations at shutdown and reads
    /// them back at start ([`persist`]; `fak serve --kv-persist`). `None`: kept
    /// conversations end with the process.
    pub kv_persist: Option<persist::KvPersistConfig>,
    /// What the in-kernel driver does when a chat conversation outgrows the context
    /// window, unless a request says ([`GenerateRequest::context_overflow`]).
    pub context_overflow: ContextOverflow,
    /// The in-kernel driver's context window, tokens, when smaller than the model's
    /// (`fak serve --context-length`, as llama.cpp's `-c` and vLLM's
    /// `--max-model-len`): prompts and replies are held to it and `/v1/models` reports
    /// it. `None`: the model's trained context.
    pub context_length: Option<usize>,
    /// Revocations in force when the engine starts (the quarantine store's persisted
    /// ones): a session restored from [`EngineConfig::kv_persist`] is cut before any
    /// span they match, as a live one is by [`EngineDriver::revoke`].
    pub revoked: Vec<Revocation>,
    /// How the in-kernel driver's KV caches store their rows (`fak serve --kv-type`):
    /// [`fak_kv::KvType::F32`] (default) keeps the values the forward pass computed,
    /// the cache the HF proofs hold for; `f16` and `q8_0` take 1/3 and about 1/6 of its
    /// memory, keeping every exact guarantee of the cache on their rounded rows.
    pub kv_type: fak_kv::KvType,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            model_path: None,
            model_id: None,
            parallel: 4,
            max_queue: 64,
            kv_budget_bytes: 512 << 20,
            max_kv_bytes: None,
            threads: None,
            weights: fak_model::WeightMode::Exact,
            kv_evict: true,
            constrain_tool_calls: true,
            upstream: upstream::UpstreamConfig::default(),
            kv_persist: None,
            context_overflow: ContextOverflow::Error,
            context_length: None,
            revoked: Vec::new(),
            kv_type: fak_kv::KvType::F32,
        }
    }
}

/// The default of [`EngineConfig::max_kv_bytes`]: a quarter of the machine's physical
/// memory shared by `parallel` generations at once, so that every worker slot at its
/// limit still fits in memory beside the model. Where the memory size is not read (not
/// Linux), 4 GiB / `parallel`. At least 64 MiB.
pub fn default_max_kv_bytes(parallel: usize) -> usize {
    let total = physical_memory_bytes().unwrap_or(16 << 30);
    (total / 4 / parallel.max(1)).max(64 << 20)
}

/// The machine's physical memory, bytes (`sysconf(_SC_PHYS_PAGES) * _SC_PAGESIZE`).
fn physical_memory_bytes() -> Option<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf reads a system constant; it touches no memory of ours.
        let (pages, size) = unsafe {
            (
                libc::sysconf(libc::_SC_PHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let pages = usize::try_from(pages).ok()?;
        let size = usize::try_from(size).ok()?;
        pages.checked_mul(size).filter(|&b| b > 0)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// A generation backend. Implementations must be cheap to call from async code:
/// `submit` only validates and enqueues; the generating happens on the driver's threads.
pub trait EngineDriver: Send + Sync + 'static {
    /// The registry id (`inkernel`, `mock`, ...).
    fn id(&self) -> &'static str;

    /// The models served; the first is the default.
    fn models(&self) -> Vec<ModelInfo>;

    /// Whether requests can be served now.
    fn readiness(&self) -> Readiness;

    /// Validates `req` and starts (or queues) its generation.
    ///
    /// # Errors
    /// [`EngineError::UnknownModel`], [`EngineError::InvalidRequest`],
    /// [`EngineError::ContextOverflow`], [`EngineError::Overloaded`],
    /// [`EngineError::NotReady`], [`EngineError::LoadFailed`]; nothing is queued then.
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError>;

    /// Starts `n` choices of `req` (the OpenAI wire's `n`): `n` streams, each a whole
    /// generation of its own as [`EngineDriver::submit`] returns one (`Start`, text,
    /// `Done`), stream `i` sampling with [`choice_seed`]`(req.sampling.seed, i)`, so
    /// stream 0 is what `submit(req)` gives. Each choice has its own stop strings,
    /// grammar state, tool-call parser and logprobs; every `Start` carries the same
    /// prompt counts (the prompt is one prompt, however many choices). Dropping one
    /// stream cancels that choice only.
    ///
    /// The default submits `req` `n` times (the prompt prefilled `n` times, each choice
    /// its own request: the upstream drivers, the mock). The in-kernel driver prefills
    /// the prompt once and clones the session `n` times.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] for `n` outside `1..=`[`MAX_CHOICES`]; else as
    /// [`EngineDriver::submit`] (the streams already started are dropped, so cancelled).
    fn submit_n(&self, req: GenerateRequest, n: usize) -> Result<Vec<EventStream>, EngineError> {
        check_choices(n)?;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let mut r = req.clone();
            r.sampling.seed = choice_seed(req.sampling.seed, i);
            out.push(self.submit(r)?);
        }
        Ok(out)
    }

    /// Load figures for metrics.
    fn stats(&self) -> EngineStats {
        EngineStats::default()
    }

    /// Takes `r`'s content out of every conversation whose KV cache the driver holds:
    /// each is cut back to the first token of the message that held it (an exact tail
    /// eviction), so the next request with a stub in its place prefills the stub and
    /// what follows, and the cache equals one that had the stub from the start. Later
    /// sessions holding it are cut the same way when kept. Drivers that keep no KV cache
    /// do nothing.
    fn revoke(&self, r: &Revocation) -> RevokeReport {
        let _ = r;
        RevokeReport::default()
    }

    /// Begins a shutdown: later [`EngineDriver::submit`]s are
    /// [`EngineError::ShuttingDown`], and every request still waiting for a worker is
    /// answered with it at once (as its stream's only event: its generation never
    /// starts). Generations already running go on. Default: nothing (a driver without a
    /// queue of its own).
    fn drain(&self) {}

    /// Ends a shutdown's grace: [`EngineDriver::drain`]s, then trips the
    /// [`CancelHandle`] of every generation still running, so each stops within one
    /// step (one prefill batch or decode step for the in-kernel driver) even while its
    /// stream is still held, and the driver's threads go idle. Default: nothing (a
    /// driver whose generations stop when their streams are dropped).
    fn cancel_all(&self) {}

    /// Writes the kept conversations to [`EngineConfig::kv_persist`]'s folder
    /// ([`persist`]) once the generations still running have ended, waiting for them at
    /// most `wait`. For the end of a shutdown, after [`EngineDriver::cancel_all`].
    /// `None` when this engine keeps none there (the default).
    fn persist_kv(&self, wait: std::time::Duration) -> Option<persist::PersistReport> {
        let _ = wait;
        None
    }

    /// Whether a request for `model` (`None`: the default) is forwarded as the client
    /// sent it, so the gateway should attach [`GenerateRequest::raw`]. Default `false`;
    /// `true` for the `anthropic-upstream` driver.
    fn forwards_client_body(&self, model: Option<&str>) -> bool {
        let _ = model;
        false
    }

    /// Whether this driver enforces a request's grammar ([`SamplingParams::grammar`]:
    /// JSON mode, a JSON Schema) for `model` (`None`: the default) by constrained
    /// decoding. Default `false`: the gateway then refuses a request that asks for one
    /// (a 400), rather than answering it unconstrained. `true` for the in-kernel driver.
    fn constrains_output(&self, model: Option<&str>) -> bool {
        let _ = model;
        false
    }

    /// Whether a request for `model` (`None`: the default) may ask for `spec`: `Ok`
    /// when the driver constrains its output to it ([`EngineDriver::constrains_output`])
    /// or forwards it to a server that does and checks the reply (the upstream
    /// drivers: JSON mode and JSON Schemas, not Lark grammars).
    ///
    /// # Errors
    /// Why the driver cannot serve `spec`, for the client's 400. Default: `Ok` exactly
    /// when [`EngineDriver::constrains_output`].
    fn accepts_grammar(&self, model: Option<&str>, spec: &GrammarSpec) -> Result<(), String> {
        let _ = spec;
        if self.constrains_output(model) {
            Ok(())
        } else {
            Err(format!(
                "the {} engine cannot constrain its output",
                self.id()
            ))
        }
    }

    /// The number of prompt tokens `req` would have if submitted (the prompt rendered
    /// and tokenized exactly as [`EngineDriver::submit`] would, nothing generated): the
    /// Anthropic `count_tokens` route. `max_tokens` and sampling are not checked.
    ///
    /// # Errors
    /// As `submit` for the prompt ([`EngineError::UnknownModel`],
    /// [`EngineError::InvalidRequest`], [`EngineError::NotReady`]); the default, for a
    /// driver that cannot count, is [`EngineError::InvalidRequest`] saying so.
    fn count_tokens(&self, req: &GenerateRequest) -> Result<usize, EngineError> {
        let _ = req;
        Err(EngineError::InvalidRequest(format!(
            "the {} engine cannot count tokens",
            self.id()
        )))
    }

    /// The served model a request naming `id` is answered by, when the driver serves
    /// `id` under another model's name (an [`alias`]); `None` when `id` is served as
    /// itself or not at all. Default `None`.
    fn resolve_model(&self, id: &str) -> Option<String> {
        let _ = id;
        None
    }
}

/// Checks a request's model against the served ids (`None` takes the first).
///
/// # Errors
/// [`EngineError::UnknownModel`] naming what is served.
pub fn check_model(requested: Option<&str>, served: &[ModelInfo]) -> Result<(), EngineError> {
    match requested {
        None => Ok(()),
        Some(m) if served.iter().any(|s| s.id == m) => Ok(()),
        Some(m) => Err(EngineError::UnknownModel {
            requested: m.to_string(),
            available: served.iter().map(|s| s.id.clone()).collect(),
        }),
    }
}

/// [`EngineError::ContextOverflow`]'s message: a limit the client set is named, one it
/// did not set is not.
fn overflow_message(prompt_tokens: usize, max_tokens: Option<usize>, context: usize) -> String {
    match max_tokens {
        Some(m) => format!(
            "the prompt has {prompt_tokens} tokens and max_tokens is {m}: together {} exceed the context window of {context} tokens",
            prompt_tokens.saturating_add(m)
        ),
        None => format!(
            "the prompt has {prompt_tokens} tokens, which leaves no room for a reply in the context window of {context} tokens"
        ),
    }
}

/// Resolves `max_tokens` against the context: `None` becomes the room left.
///
/// # Errors
/// [`EngineError::InvalidRequest`] for 0; [`EngineError::ContextOverflow`] when the
/// prompt plus `max_tokens` (at least 1) exceed `context`.
pub fn budget(
    prompt_tokens: usize,
    max_tokens: Option<usize>,
    context: usize,
) -> Result<usize, EngineError> {
    if max_tokens == Some(0) {
        return Err(EngineError::InvalidRequest(
            "max_tokens must be at least 1".into(),
        ));
    }
    if prompt_tokens.saturating_add(max_tokens.unwrap_or(1)) > context {
        return Err(EngineError::ContextOverflow {
            prompt_tokens,
            max_tokens,
            context,
        });
    }
    Ok(max_tokens.unwrap_or(context - prompt_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_checks_the_context() {
        assert_eq!(budget(10, None, 100), Ok(90));
        assert_eq!(budget(10, Some(90), 100), Ok(90));
        assert_eq!(
            budget(10, Some(91), 100),
            Err(EngineError::ContextOverflow {
                prompt_tokens: 10,
                max_tokens: Some(91),
                context: 100
            })
        );
        assert!(matches!(
            budget(100, None, 100),
            Err(EngineError::ContextOverflow { .. })
        ));
        assert!(matches!(
            budget(1, Some(0), 100),
            Err(EngineError::InvalidRequest(_))
        ));
        let msg = budget(10, Some(91), 100).unwrap_err().to_string();
        assert!(
            msg.contains("10") && msg.contains("91") && msg.contains("100"),
            "{msg}"
        );
        // A limit the request did not set is not named as if it had.
        let msg = budget(100, None, 100).unwrap_err().to_string();
        assert!(
            !msg.contains("max_tokens") && msg.contains("100 tokens") && msg.contains("no room"),
            "{msg}"
        );
    }

    #[test]
    fn a_capped_prompt_that_fills_the_window_is_reported_as_the_prompt() {
        let req = |m| GenerateRequest {
            max_tokens: Some(m),
            cap_max_tokens: true,
            ..GenerateRequest::chat(Vec::new())
        };
        assert_eq!(req(32000).max_tokens_within(10, 100), Some(90));
        assert_eq!(req(5).max_tokens_within(10, 100), Some(5));
        // Before: the cap said "max_tokens is 1", a limit the client never set.
        for prompt in [100, 150] {
            let m = req(32000).max_tokens_within(prompt, 100);
            let msg = budget(prompt, m, 100).unwrap_err().to_string();
            assert!(
                !msg.contains("max_tokens")
                    && msg.contains(&format!("{prompt} tokens"))
                    && msg.contains("window of 100 tokens"),
                "{msg}"
            );
        }
    }

    #[test]
    fn unknown_model_names_the_served_ones() {
        let served = vec![ModelInfo {
            id: "a".into(),
            context_length: 1,
            owned_by: "x".into(),
        }];
        assert!(check_model(None, &served).is_ok());
        assert!(check_model(Some("a"), &served).is_ok());
        let e = check_model(Some("b"), &served).unwrap_err();
        assert!(e.to_string().contains("'b'") && e.to_string().contains("a"));
    }
}
