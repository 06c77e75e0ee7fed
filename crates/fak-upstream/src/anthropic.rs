//! The Anthropic wire of the upstream driver (`anthropic-upstream`): `POST
//! {base}/v1/messages` on an Anthropic-compatible server.
//!
//! **Requests.** A request the gateway took on its own Anthropic route carries the
//! client's body ([`fak_engine::RawRequest`]), and that body is sent as it is, byte for
//! byte: the gateway has replaced only the `content` of a tool result the boundary did
//! not admit, and nothing else. With it go the client's `x-api-key`, `anthropic-version`
//! and `anthropic-beta` headers (no others). So the upstream's prompt cache sees the
//! client's own bytes, and `cache_read_input_tokens` work as they would without fak in
//! between. With an operator key ([`super::UpstreamConfig::api_key`]) that key is sent
//! as `x-api-key` in place of the client's. `anthropic-version: 2023-06-01` is added
//! when the client sent none. The `Accept` header follows the body's `stream`.
//!
//! A request from the OpenAI chat wire has no such body and is translated
//! ([`request_body`], written from [`fak_wire::anthropic`]'s request types): system
//! messages become the top-level `system` (joined by a blank line); an assistant's `tool_calls` become `tool_use` blocks (arguments that are not a
//! JSON object become `{}`), `tool` messages `tool_result` blocks of a user turn;
//! consecutive turns of one role are merged; `tools` / `tool_choice` map to Anthropic's
//! (`required` → `any`); `tool_calls` not in OpenAI's shape are an
//! [`EngineError::InvalidRequest`]; `max_tokens` (Anthropic requires one; default
//! [`DEFAULT_MAX_TOKENS`]), `temperature`, `top_p` (when below 1), `top_k` (when set),
//! `stop` → `stop_sequences`; always `stream: true`. `seed`, `min_p` and
//! `repetition_penalty` have no Anthropic field and are not sent. A structured output
//! goes as `output_config.format` ([`output_config`]); the reply is checked against it
//! as on the OpenAI wire. Plain-text prompts
//! (`/v1/completions`) and logprobs are not available from this wire
//! ([`EngineError::InvalidRequest`]).
//!
//! **Replies.** Server-sent events (`message_start` … `message_stop`), or one JSON
//! message when the client asked for no stream. `Start` once the message starts, its
//! prompt the sum of `usage.input_tokens`, `cache_creation_input_tokens` and
//! `cache_read_input_tokens`, its cached tokens the last; each `text_delta` is relayed
//! as `Text` as it arrives; each `tool_use` block is assembled (its `input_json_delta`s
//! concatenated, else its `input`) and sent as a whole [`ToolCall`] only once the
//! message is over, for the gateway to adjudicate. Other block types (thinking, server
//! tools, and types the API adds later) are not relayed, nor are their deltas (a server
//! tool's `input_json_delta` included). Events, messages and blocks are read into
//! [`fak_wire::anthropic`]'s types (`StreamEvent`, `Message`, `ContentBlock`,
//! `BlockDelta`, `ErrorResponse`): an unknown event, block or delta type, or stop
//! reason, is skipped; fields the API does not define are ignored; a field of the wrong
//! type is an [`EngineError::Upstream`] naming its path (e.g. `delta.text`). `Done`: `stop_reason` `max_tokens` → `Length`, anything
//! else → `Stop`; `stop_sequence` kept; `completion_tokens` from `output_tokens`; the
//! prompt's counts again in [`Done::prompt_usage`], with the cache writes.
//!
//! **Counting.** [`fak_engine::EngineDriver::count_tokens`] is the upstream's own count:
//! `POST {base}/v1/messages/count_tokens` with the client's body when the request
//! carries it, else the translated prompt ([`prompt`]: the request body without its
//! generation settings, which that endpoint does not take), and its `input_tokens`;
//! errors and retries as for a generation.
//!
//! **Models.** As on the OpenAI wire (health check, then `GET /v1/models`), except that a
//! models list refused with 401/403 (a server that lists its models only to a key) counts
//! as up when [`super::UpstreamConfig::model`] names the model: without an operator key,
//! each request brings the client's own.
//!
//! **Errors.** As on the OpenAI wire, plus: 529 (Anthropic's overloaded) →
//! [`EngineError::Overloaded`]; a 401/403 when the client's own key was sent →
//! [`EngineError::Refused`] (the client's 401/403; with the operator's key it is the
//! operator's problem, a 502); an `error` event or an error body →
//! [`EngineError::Upstream`] with its message.

use super::{
    parse, pump, BodyReader, EventReply, Failure, Flow, Job, PartialCall, Progress, MAX_EVENT_BYTES,
};
use fak_engine::{
    Done, EngineError, EngineEvent, EventSink, FinishReason, GenerateRequest, Prompt, PromptUsage,
    ToolChoice,
};
use fak_wire::anthropic as wire;
use hyper::body::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Instant;

/// The version header every Anthropic request carries.
pub(super) const VERSION: &str = "anthropic-version";
/// The version sent when the client sent none (the Messages API's first and current).
pub(super) const DEFAULT_VERSION: &str = "2023-06-01";
/// `max_tokens` of a translated request that set none (Anthropic requires the field).
pub const DEFAULT_MAX_TOKENS: usize = 4096;
/// The client headers passed on, lowercase.
const PASSED_ON: [&str; 3] = ["x-api-key", VERSION, "anthropic-beta"];

/// What an Anthropic-wire request asks of the upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ask {
    /// The reply (`POST /v1/messages`, streamed unless the client asked for one JSON
    /// message).
    Reply,
    /// The prompt's token count (`POST /v1/messages/count_tokens`, one JSON answer).
    Count,
}

/// The upstream request for `req` on `model` (see the module docs): `ask` picks the
/// path, the translated body ([`request_body`] or [`prompt`]) and what is accepted. The
/// client's body goes as it came when the request carries it. `operator_key`: the
/// driver sends its own key, so the client's is not passed on. `named`: the model was
/// named by this server's configuration (a refusal is then reported in the upstream's
/// words).
///
/// # Errors
/// [`EngineError::InvalidRequest`] for what this wire cannot carry (see
/// [`request_body`]) and for a client header value a header cannot carry.
pub(super) fn job(
    req: &GenerateRequest,
    model: String,
    served: Vec<String>,
    operator_key: bool,
    named: bool,
    ask: Ask,
) -> Result<Job, EngineError> {
    let (body, headers, stream, client_key) = match &req.raw {
        Some(raw) => {
            let mut headers = Vec::new();
            let mut client_key = false;
            for name in PASSED_ON {
                if name == "x-api-key" && operator_key {
                    continue;
                }
                for (_, v) in raw
                    .headers
                    .iter()
                    .filter(|(k, _)| k.eq_ignore_ascii_case(name))
                {
                    let mut value = HeaderValue::from_str(v).map_err(|_| {
                        EngineError::InvalidRequest(format!(
                            "the {name} header holds characters a header cannot carry"
                        ))
                    })?;
                    if name == "x-api-key" {
                        value.set_sensitive(true);
                        client_key = true;
                    }
                    headers.push((HeaderName::from_static(name), value));
                }
            }
            (raw.body.clone(), headers, raw.stream, client_key)
        }
        None => {
            let body = match ask {
                Ask::Reply => json_bytes(&request_body(req, &model)?)?,
                Ask::Count => json_bytes(&prompt(req, &model)?)?,
            };
            (body, Vec::new(), true, false)
        }
    };
    Ok(Job {
        path: match ask {
            Ask::Reply => "/v1/messages",
            Ask::Count => "/v1/messages/count_tokens",
        },
        body,
        headers,
        client_key,
        accept: if stream && ask == Ask::Reply {
            "text/event-stream"
        } else {
            "application/json"
        },
        chat: true,
        model,
        served,
        stop: req.stop.clone(),
        max_tokens: Some(req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)),
        named,
    })
}

/// A typed body as JSON bytes.
///
/// # Errors
/// [`EngineError::Internal`] if it cannot be written (a map with non-string keys; none
/// of fak-wire's types has one).
fn json_bytes<T: serde::Serialize>(body: &T) -> Result<Bytes, EngineError> {
    serde_json::to_vec(body)
        .map(Bytes::from)
        .map_err(|e| EngineError::Internal(format!("writing the upstream request: {e}")))
}

/// A text block, or none for empty text (Anthropic rejects empty text blocks).
fn text_blocks(text: &str) -> Vec<wire::ContentBlockParam> {
    if text.is_empty() {
        Vec::new()
    } else {
        vec![wire::ContentBlockParam::Text {
            text: text.to_string(),
        }]
    }
}

/// The prompt of a request that came on another wire, as Anthropic's Messages API takes
/// it: `req`'s chat on `model` (see the module docs for the mapping). It is the body of
/// `POST /v1/messages/count_tokens` as it is (fak-wire's `CountTokensRequest`), and the
/// part of [`request_body`] that is not generation settings.
///
/// # Errors
/// [`EngineError::InvalidRequest`] for a plain-text prompt, or a message role other
/// than system, developer, user, assistant and tool.
pub fn prompt(req: &GenerateRequest, model: &str) -> Result<wire::CountTokensRequest, EngineError> {
    let Prompt::Chat(ms) = &req.prompt else {
        return Err(EngineError::InvalidRequest(
            "an Anthropic upstream answers chat requests only (/v1/chat/completions or /v1/messages), not plain completions".into(),
        ));
    };
    let mut system: Vec<&str> = Vec::new();
    let mut turns: Vec<(wire::Role, Vec<wire::ContentBlockParam>)> = Vec::new();
    for m in ms {
        let (role, blocks) = match m.role.as_str() {
            "system" | "developer" => {
                system.push(&m.content);
                continue;
            }
            "user" => (wire::Role::User, text_blocks(&m.content)),
            "assistant" => {
                let mut b = text_blocks(&m.content);
                for c in assistant_calls(m)? {
                    let input = match serde_json::from_str::<Value>(&c.function.arguments) {
                        Ok(v @ Value::Object(_)) => v,
                        _ => Value::Object(serde_json::Map::new()),
                    };
                    b.push(wire::ContentBlockParam::ToolUse {
                        id: c.id,
                        name: c.function.name,
                        input,
                    });
                }
                (wire::Role::Assistant, b)
            }
            "tool" => (
                wire::Role::User,
                vec![wire::ContentBlockParam::ToolResult {
                    tool_use_id: m.tool_call_id.clone().unwrap_or_default(),
                    content: Some(wire::ToolResultContent::Text(m.content.clone())),
                    is_error: None,
                }],
            ),
            r => {
                return Err(EngineError::InvalidRequest(format!(
                    "a message with role '{r}' cannot be sent to an Anthropic upstream"
                )))
            }
        };
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some((r, b)) if *r == role => b.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    let tools = (!req.tools.is_empty()).then(|| {
        req.tools
            .iter()
            .map(|t| wire::Tool {
                kind: None,
                name: t.name.clone(),
                description: t.description.clone(),
                input_schema: Some(t.parameters.clone()),
                strict: t.strict.then_some(true),
            })
            .collect()
    });
    let tool_choice = (!req.tools.is_empty()).then(|| match &req.tool_choice {
        ToolChoice::None => wire::ToolChoice::None,
        ToolChoice::Auto => wire::ToolChoice::Auto {
            disable_parallel_tool_use: None,
        },
        ToolChoice::Required => wire::ToolChoice::Any {
            disable_parallel_tool_use: None,
        },
        ToolChoice::Named(n) => wire::ToolChoice::Tool {
            name: n.clone(),
            disable_parallel_tool_use: None,
        },
    });
    Ok(wire::CountTokensRequest {
        model: model.to_string(),
        messages: turns
            .into_iter()
            .map(|(role, content)| wire::MessageParam {
                role,
                content: wire::MessageContent::Blocks(content),
            })
            .collect(),
        system: (!system.is_empty()).then(|| wire::SystemPrompt::Text(system.join("\n\n"))),
        tools,
        tool_choice,
        thinking: None,
        output_config: None,
        output_format: None,
        other: BTreeMap::new(),
    })
}

/// The `tool_calls` of an assistant message, in the OpenAI shape the gateways write
/// (fak-wire's `openai::ToolCall`).
///
/// # Errors
/// [`EngineError::InvalidRequest`] for `tool_calls` not of that shape.
fn assistant_calls(
    m: &fak_engine::Message,
) -> Result<Vec<fak_wire::openai::ToolCall>, EngineError> {
    match &m.tool_calls {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(v) => Vec::<fak_wire::openai::ToolCall>::deserialize(v).map_err(|e| {
            EngineError::InvalidRequest(format!("an assistant message's tool_calls: {e}"))
        }),
    }
}

/// The Anthropic Messages body for a request that came on another wire: [`prompt`] and
/// the generation settings (see the module docs for the mapping).
///
/// # Errors
/// As [`prompt`]; [`EngineError::InvalidRequest`] for logprobs.
pub fn request_body(
    req: &GenerateRequest,
    model: &str,
) -> Result<wire::MessagesRequest, EngineError> {
    if req.logprobs.is_some() {
        return Err(EngineError::InvalidRequest(
            "logprobs are not available from an Anthropic upstream".into(),
        ));
    }
    let s = &req.sampling;
    let mut prompt = prompt(req, model)?;
    prompt.output_config = s.grammar.as_ref().map(output_config).transpose()?;
    Ok(wire::MessagesRequest {
        max_tokens: i64::try_from(req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)).unwrap_or(i64::MAX),
        stream: Some(true),
        stop_sequences: (!req.stop.is_empty()).then(|| req.stop.clone()),
        temperature: Some(s.temperature),
        top_p: (s.top_p < 1.0).then_some(s.top_p),
        top_k: (s.top_k != 0).then(|| i64::try_from(s.top_k).unwrap_or(i64::MAX)),
        cache_salt: None,
        context_overflow: None,
        prompt,
    })
}

/// The `output_config` an Anthropic upstream is sent for `spec` (SDK:
/// `OutputConfigParam`, its `format` a `JSONOutputFormatParam`): a JSON Schema as it
/// is, JSON mode as the schema `{"type": "object"}` (the Messages API has no JSON mode
/// of its own; a server that refuses that schema answers with its 400). The format's
/// name, description and `strict` have no Anthropic field and are not sent.
///
/// # Errors
/// [`EngineError::InvalidRequest`] for a Lark grammar or a schema that is not a JSON
/// object.
fn output_config(spec: &fak_engine::GrammarSpec) -> Result<wire::OutputConfig, EngineError> {
    use fak_engine::GrammarSpec;
    let schema = match spec {
        GrammarSpec::JsonObject => {
            serde_json::Map::from_iter([("type".to_string(), Value::from("object"))])
        }
        GrammarSpec::JsonSchema { schema, .. } => super::schema_object(schema)?,
        GrammarSpec::Lark(_) => {
            return Err(EngineError::InvalidRequest(
                super::LARK_NOT_FORWARDED.into(),
            ))
        }
    };
    Ok(wire::OutputConfig {
        effort: None,
        format: Some(wire::JsonOutputFormat {
            kind: wire::JsonSchemaType::JsonSchema,
            schema,
        }),
    })
}

/// Relays an Anthropic reply (events or one JSON message, by its content type) to
/// `sink`.
pub(super) async fn relay(
    url: &str,
    ctype: &str,
    mut body: BodyReader,
    sink: &EventSink,
    progress: &mut Progress,
) -> Result<(), Failure> {
    let fatal = |m: String| Failure::fatal(EngineError::Upstream(m));
    if ctype.starts_with("text/event-stream") {
        return pump(&mut body, Reply::new(sink, progress)).await;
    }
    if ctype.starts_with("application/json") {
        let mut buf = Vec::new();
        while let Some(d) = body.next().await? {
            if buf.len() + d.len() > MAX_EVENT_BYTES {
                return Err(fatal(format!(
                    "the upstream sent a reply longer than {MAX_EVENT_BYTES} bytes"
                )));
            }
            buf.extend_from_slice(&d);
        }
        return Reply::new(sink, progress).message(&String::from_utf8_lossy(&buf));
    }
    Err(fatal(format!(
        "{url} answered '{ctype}', neither JSON nor an event stream"
    )))
}

/// Token counts as the upstream reported them (the last value of each wins).
#[derive(Debug, Default)]
struct Usage {
    input: Option<usize>,
    creation: Option<usize>,
    read: Option<usize>,
    output: Option<usize>,
}

impl Usage {
    /// Takes a `message_delta`'s counts (those present); zero usage, which is what a
    /// `message_delta` without `usage` reads as, changes nothing.
    fn merge(&mut self, u: wire::DeltaUsage) {
        if u == wire::DeltaUsage::default() {
            return;
        }
        let n = |v: Option<u64>| v.map(super::as_usize);
        self.input = n(u.input_tokens).or(self.input);
        self.creation = n(u.cache_creation_input_tokens).or(self.creation);
        self.read = n(u.cache_read_input_tokens).or(self.read);
        self.output = Some(super::as_usize(u.output_tokens));
    }

    /// The prompt's counts, when the upstream gave any.
    fn prompt(&self) -> Option<PromptUsage> {
        if self.input.is_none() && self.read.is_none() && self.creation.is_none() {
            return None;
        }
        let (i, c, r) = (
            self.input.unwrap_or(0),
            self.creation.unwrap_or(0),
            self.read.unwrap_or(0),
        );
        Some(PromptUsage {
            prompt_tokens: i.saturating_add(c).saturating_add(r),
            cached_tokens: r,
            cache_creation_tokens: c,
        })
    }
}

/// One content block of the reply, by its index.
enum Block {
    Text,
    /// A `tool_use`: the call being assembled and the `input` it started with.
    Tool(PartialCall, Value),
    /// Anything else (thinking, server tools, types added later): not relayed; its
    /// deltas (a server tool's `input_json_delta` too) are skipped.
    Other,
}

/// One attempt's reading of the reply.
struct Reply<'a> {
    sink: &'a EventSink,
    progress: &'a mut Progress,
    blocks: BTreeMap<usize, Block>,
    stop_reason: Option<wire::StopReason>,
    stop_sequence: Option<String>,
    usage: Usage,
    pieces: usize,
}

impl<'a> Reply<'a> {
    fn new(sink: &'a EventSink, progress: &'a mut Progress) -> Self {
        Reply {
            sink,
            progress,
            blocks: BTreeMap::new(),
            stop_reason: None,
            stop_sequence: None,
            usage: Usage::default(),
            pieces: 0,
        }
    }

    /// Sends `Start` once per generation (with the counts known so far).
    fn start(&mut self) -> Flow {
        if self.progress.started {
            return Flow::More;
        }
        self.progress.started = true;
        let u = self.usage.prompt().unwrap_or_default();
        if self.sink.send(EngineEvent::Start {
            prompt_tokens: u.prompt_tokens,
            cached_tokens: u.cached_tokens,
        }) {
            Flow::More
        } else {
            Flow::Gone
        }
    }

    /// Relays a piece of text (after `Start`); past the client's limits
    /// (`Progress::over`) the reply ends as `max_tokens` instead.
    fn text(&mut self, t: &str) -> Flow {
        if t.is_empty() {
            return Flow::More;
        }
        if self.progress.over(t.len(), true) {
            self.stop_reason = Some(wire::StopReason::MaxTokens);
            return Flow::End;
        }
        if let Flow::Gone = self.start() {
            return Flow::Gone;
        }
        self.progress.relayed = true;
        if self.progress.first_text.is_none() {
            self.progress.first_text = Some(Instant::now());
        }
        self.pieces += 1;
        if self.sink.send(EngineEvent::Text(t.to_string())) {
            Flow::More
        } else {
            Flow::Gone
        }
    }

    /// The block a `content_block_start` (or a JSON message's `content` entry) opens.
    fn open(&mut self, index: usize, b: wire::ContentBlock) -> Flow {
        match b {
            wire::ContentBlock::Text { text } => {
                self.blocks.insert(index, Block::Text);
                self.text(&text)
            }
            wire::ContentBlock::ToolUse { id, name, input } => {
                let call = PartialCall {
                    id,
                    name,
                    arguments: String::new(),
                };
                self.blocks.insert(index, Block::Tool(call, input));
                Flow::More
            }
            wire::ContentBlock::Thinking { .. }
            | wire::ContentBlock::RedactedThinking { .. }
            | wire::ContentBlock::Unknown(_) => {
                self.blocks.insert(index, Block::Other);
                Flow::More
            }
        }
    }
}

impl EventReply for Reply<'_> {
    fn finished(&self) -> bool {
        self.stop_reason.is_some()
    }

    /// Reads one event's data.
    fn event(&mut self, data: &str) -> Result<Flow, Failure> {
        let bad = |why: String| Failure::fatal(EngineError::Upstream(why));
        let event: wire::StreamEvent = parse(data, "the upstream sent an event").map_err(bad)?;
        Ok(match event {
            wire::StreamEvent::MessageStart { message } => {
                self.usage.merge(message.usage.into());
                self.start()
            }
            wire::StreamEvent::ContentBlockStart {
                index,
                content_block,
            } => self.open(index, content_block),
            wire::StreamEvent::ContentBlockDelta { index, delta } => match delta {
                wire::BlockDelta::TextDelta { text } => self.text(&text),
                wire::BlockDelta::InputJsonDelta { partial_json } => {
                    match self.blocks.get_mut(&index) {
                        Some(Block::Tool(call, _)) => {
                            call.arguments.push_str(&partial_json);
                            if self.progress.over(partial_json.len(), false) {
                                self.stop_reason = Some(wire::StopReason::MaxTokens);
                                Flow::End
                            } else {
                                Flow::More
                            }
                        }
                        // A server tool's input: not this reply's call.
                        Some(Block::Other) => Flow::More,
                        Some(Block::Text) | None => {
                            return Err(bad(format!(
                                "the upstream sent tool input for block {index}, which is not a tool_use block"
                            )))
                        }
                    }
                }
                wire::BlockDelta::ThinkingDelta { .. }
                | wire::BlockDelta::SignatureDelta { .. }
                | wire::BlockDelta::Unknown(_) => Flow::More,
            },
            wire::StreamEvent::MessageDelta { delta, usage, .. } => {
                if let Some(r) = delta.stop_reason {
                    self.stop_reason = Some(r);
                }
                if let Some(q) = delta.stop_sequence {
                    self.stop_sequence = Some(q);
                }
                self.usage.merge(usage);
                Flow::More
            }
            wire::StreamEvent::MessageStop => Flow::End,
            wire::StreamEvent::Error { error } => {
                return Err(bad(format!(
                    "the upstream failed mid-reply: {}",
                    error.message
                )))
            }
            wire::StreamEvent::ContentBlockStop { .. }
            | wire::StreamEvent::Ping
            | wire::StreamEvent::Unknown(_) => Flow::More,
        })
    }

    /// Sends the assembled calls and `Done`.
    fn finish(mut self) {
        if let Flow::Gone = self.start() {
            return;
        }
        for (_, b) in std::mem::take(&mut self.blocks) {
            let Block::Tool(mut call, input) = b else {
                continue;
            };
            if call.arguments.trim().is_empty() {
                call.arguments = input.to_string();
            }
            if !self.sink.send(EngineEvent::ToolCall(call.into_call())) {
                return;
            }
        }
        let finish_reason = match self.stop_reason {
            Some(wire::StopReason::MaxTokens) => FinishReason::Length,
            _ => FinishReason::Stop,
        };
        let stop_sequence = self
            .stop_sequence
            .filter(|_| self.stop_reason == Some(wire::StopReason::StopSequence));
        let now = Instant::now();
        let first = self.progress.first_text.unwrap_or(now);
        self.sink.send(EngineEvent::Done(Done {
            completion_tokens: self.usage.output.unwrap_or(self.pieces),
            completion_ids: Vec::new(),
            finish_reason,
            stop_sequence,
            dead_end: None,
            ttft_s: first.duration_since(self.progress.t0).as_secs_f64(),
            decode_s: now.duration_since(first).as_secs_f64(),
            token_gaps_s: Vec::new(),
            prompt_usage: self.usage.prompt(),
        }));
    }
}

impl Reply<'_> {
    /// Reads a whole (non-streamed) message, or an error body, and ends the generation.
    fn message(mut self, text: &str) -> Result<(), Failure> {
        let fatal = |m: String| Failure::fatal(EngineError::Upstream(m));
        if let Ok(e) = serde_json::from_str::<wire::ErrorResponse>(text) {
            return Err(fatal(format!("the upstream failed: {}", e.error.message)));
        }
        let m: wire::Message = parse(text, "the upstream sent a reply").map_err(fatal)?;
        self.usage.merge(m.usage.into());
        self.stop_reason = m.stop_reason;
        self.stop_sequence = m.stop_sequence;
        if let Flow::Gone = self.start() {
            return Ok(());
        }
        for (i, b) in m.content.into_iter().enumerate() {
            match self.open(i, b) {
                Flow::Gone => return Ok(()),
                Flow::End => break,
                Flow::More => {}
            }
        }
        self.finish();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fak_engine::{event_channel, Message, ToolSpec};
    use serde_json::json;

    fn progress() -> Progress {
        Progress {
            t0: Instant::now(),
            started: false,
            relayed: false,
            first_text: None,
            max_tokens: None,
            pieces: 0,
            bytes: 0,
        }
    }

    /// Every event sent so far (the sink is dropped, so the stream ends after them).
    fn events(sink: EventSink, mut s: fak_engine::EventStream) -> Vec<EngineEvent> {
        drop(sink);
        let mut out = Vec::new();
        while let Some(e) = s.blocking_next() {
            out.push(e);
        }
        out
    }

    #[test]
    fn a_stream_maps_to_events_with_tool_calls_held_to_the_end() {
        let (sink, stream) = event_channel();
        let mut p = progress();
        let mut r = Reply::new(&sink, &mut p);
        let evs = [
            r#"{"type":"message_start","message":{"id":"msg_1","content":[],"usage":{"input_tokens":5,"cache_creation_input_tokens":2,"cache_read_input_tokens":30,"output_tokens":1}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"ping"}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hel"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"lo"}}"#,
            r#"{"type":"content_block_stop","index":0}"#,
            r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"get_x","input":{}}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"q\""}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":": 1}"}}"#,
            r#"{"type":"content_block_stop","index":1}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":9}}"#,
        ];
        for e in evs {
            assert!(matches!(r.event(e).unwrap(), Flow::More), "{e}");
        }
        assert!(matches!(
            r.event(r#"{"type":"message_stop"}"#).unwrap(),
            Flow::End
        ));
        r.finish();
        let got = events(sink, stream);
        assert_eq!(
            got[0],
            EngineEvent::Start {
                prompt_tokens: 37,
                cached_tokens: 30
            }
        );
        assert_eq!(got[1], EngineEvent::Text("Hel".into()));
        assert_eq!(got[2], EngineEvent::Text("lo".into()));
        let EngineEvent::ToolCall(c) = &got[3] else {
            panic!("{got:?}")
        };
        assert_eq!(
            (c.id.as_str(), c.name.as_str(), c.arguments.as_str()),
            ("toolu_1", "get_x", r#"{"q":1}"#)
        );
        assert!(c.malformed.is_none());
        let EngineEvent::Done(d) = &got[4] else {
            panic!("{got:?}")
        };
        assert_eq!(d.completion_tokens, 9);
        assert_eq!(d.finish_reason, FinishReason::Stop);
        assert_eq!(
            d.prompt_usage,
            Some(PromptUsage {
                prompt_tokens: 37,
                cached_tokens: 30,
                cache_creation_tokens: 2
            })
        );
        assert_eq!(got.len(), 5);
    }

    #[test]
    fn a_json_message_maps_to_events() {
        let (sink, stream) = event_channel();
        let mut p = progress();
        let v = json!({"type": "message", "content": [
            {"type": "thinking", "thinking": "hidden", "signature": "s"},
            {"type": "text", "text": "done"},
            {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {"a": [1]}}],
            "stop_reason": "stop_sequence", "stop_sequence": "END",
            "usage": {"input_tokens": 4, "output_tokens": 2}});
        Reply::new(&sink, &mut p).message(&v.to_string()).unwrap();
        let got = events(sink, stream);
        assert_eq!(
            got[0],
            EngineEvent::Start {
                prompt_tokens: 4,
                cached_tokens: 0
            }
        );
        assert_eq!(got[1], EngineEvent::Text("done".into()));
        assert!(matches!(&got[2], EngineEvent::ToolCall(c) if c.arguments == r#"{"a":[1]}"#));
        let EngineEvent::Done(d) = &got[3] else {
            panic!("{got:?}")
        };
        assert_eq!(d.stop_sequence.as_deref(), Some("END"));
        // Errors and garbage are errors, never panics.
        for bad in [
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
            json!({"type": "message", "content": "text"}),
            json!([1]),
        ] {
            let (sink, _s) = event_channel();
            let mut p = progress();
            let e = Reply::new(&sink, &mut p)
                .message(&bad.to_string())
                .unwrap_err();
            assert!(matches!(e.error, EngineError::Upstream(_)), "{bad}");
        }
        for bad in [
            "{not json",
            "[1]",
            r#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#,
            r#"{"type":"content_block_delta","index":3,"delta":{"type":"input_json_delta","partial_json":"{"}}"#,
        ] {
            let (sink, _s) = event_channel();
            let mut p = progress();
            assert!(Reply::new(&sink, &mut p).event(bad).is_err(), "{bad}");
        }
    }

    /// The events of the SSE text `sse` fed to one reply, and the events it sent.
    fn read_stream(sse: &str) -> Vec<EngineEvent> {
        let (sink, stream) = event_channel();
        let mut p = progress();
        let mut r = Reply::new(&sink, &mut p);
        let mut parser = super::super::SseParser::default();
        let mut evs = parser.push(sse.as_bytes()).unwrap();
        evs.extend(parser.finish());
        assert!(evs.len() > 10, "{evs:?}");
        let mut ended = false;
        for e in evs {
            assert!(!ended, "an event after message_stop: {e}");
            match r.event(&e) {
                Ok(Flow::More) => {}
                Ok(Flow::End) => ended = true,
                Ok(Flow::Gone) => panic!("the sink is held"),
                Err(f) => panic!("{e}: {:?}", f.error),
            }
        }
        assert!(ended, "no message_stop");
        r.finish();
        events(sink, stream)
    }

    /// What the SDK-written reply (thinking, redacted thinking, a server tool's use and
    /// result, text with a citation, a tool call) must come to: its text and its one
    /// client tool call, the rest skipped.
    fn assert_sdk_reply(got: &[EngineEvent], texts: &[&str]) {
        assert_eq!(
            got[0],
            EngineEvent::Start {
                prompt_tokens: 55,
                cached_tokens: 40
            }
        );
        let text: Vec<_> = got[1..=texts.len()].to_vec();
        let want: Vec<_> = texts
            .iter()
            .map(|t| EngineEvent::Text(t.to_string()))
            .collect();
        assert_eq!(text, want);
        let rest = &got[texts.len() + 1..];
        let EngineEvent::ToolCall(c) = &rest[0] else {
            panic!("{got:?}")
        };
        assert_eq!(
            (c.id.as_str(), c.name.as_str(), c.arguments.as_str()),
            ("toolu_1", "get_forecast", r#"{"city":"Paris"}"#)
        );
        let EngineEvent::Done(d) = &rest[1] else {
            panic!("{got:?}")
        };
        assert_eq!(
            (d.completion_tokens, d.finish_reason),
            (87, FinishReason::Stop)
        );
        assert_eq!(rest.len(), 2, "{got:?}");
    }

    /// A stream written by the `anthropic` SDK's own types (testdata/anthropic: see
    /// make_sdk_stream.py) with the block and delta types fak does not relay
    /// (`thinking_delta`, `signature_delta`, `citations_delta`, a `server_tool_use` whose
    /// input streams as `input_json_delta`, `web_search_tool_result`): they are skipped,
    /// the text and the client tool call come through. The old reader failed here (a
    /// server tool's `input_json_delta` was "tool input for a block that is not a
    /// tool_use block").
    #[test]
    fn an_sdk_stream_with_thinking_and_server_tools_relays_only_text_and_calls() {
        let got = read_stream(include_str!("../../../testdata/anthropic/sdk_stream.sse"));
        assert_sdk_reply(&got, &["It is ", "sunny."]);
    }

    /// The same reply whole, as the SDK's `Message` writes it.
    #[test]
    fn an_sdk_message_with_thinking_and_server_tools_relays_only_text_and_calls() {
        let (sink, stream) = event_channel();
        let mut p = progress();
        Reply::new(&sink, &mut p)
            .message(include_str!("../../../testdata/anthropic/sdk_message.json"))
            .unwrap();
        assert_sdk_reply(&events(sink, stream), &["It is sunny."]);
    }

    /// A field of the wrong type, inside an event's delta or a message's block, is an
    /// upstream error naming the field's path; a block type fak does not know is no
    /// error whatever its fields.
    #[test]
    fn a_field_of_the_wrong_type_is_an_error_naming_its_path() {
        let upstream = |f: Failure| match f.error {
            EngineError::Upstream(m) => m,
            e => panic!("{e:?}"),
        };
        for (data, path) in [
            (
                r#"{"index":0,"delta":{"text":5,"type":"text_delta"},"type":"content_block_delta"}"#,
                "`delta.text`",
            ),
            (
                r#"{"type":"content_block_start","index":"0","content_block":{"type":"text","text":""}}"#,
                "`index`",
            ),
            (
                r#"{"type":"message_start","message":{"content":[],"usage":{"input_tokens":"many"}}}"#,
                "`message.usage.input_tokens`",
            ),
            (
                r#"{"type":"message_delta","delta":{"stop_reason":7},"usage":{"output_tokens":1}}"#,
                "`delta.stop_reason`",
            ),
        ] {
            let (sink, _s) = event_channel();
            let mut p = progress();
            let m = upstream(Reply::new(&sink, &mut p).event(data).err().expect(data));
            assert!(m.contains(path), "{path}: {m}");
        }
        let (sink, _s) = event_channel();
        let mut p = progress();
        let m = upstream(
            Reply::new(&sink, &mut p)
                .message(
                    r#"{"content":[{"type":"future_block","x":1},{"type":"tool_use","id":"t","name":["f"],"input":{}}]}"#,
                )
                .unwrap_err(),
        );
        assert!(m.contains("`content[1].name`"), "{m}");
        // An unknown event type, block type or delta type is skipped, even with fields
        // fak would not read.
        let (sink, _s) = event_channel();
        let mut p = progress();
        let mut r = Reply::new(&sink, &mut p);
        for e in [
            r#"{"type":"future_event","index":"x"}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"future_block","text":7}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"future_delta","text":7}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"future_reason"},"usage":{"output_tokens":1}}"#,
        ] {
            assert!(matches!(r.event(e), Ok(Flow::More)), "{e}");
        }
    }

    #[test]
    fn a_max_tokens_stop_is_length_and_a_missing_input_is_the_start_input() {
        let (sink, stream) = event_channel();
        let mut p = progress();
        let mut r = Reply::new(&sink, &mut p);
        for e in [
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"toolu_3","name":"g","input":{"k":"v"}}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"max_tokens"}}"#,
        ] {
            r.event(e).unwrap();
        }
        r.finish();
        let got = events(sink, stream);
        assert_eq!(
            got[0],
            EngineEvent::Start {
                prompt_tokens: 0,
                cached_tokens: 0
            }
        );
        assert!(matches!(&got[1], EngineEvent::ToolCall(c) if c.arguments == r#"{"k":"v"}"#));
        assert!(
            matches!(&got[2], EngineEvent::Done(d) if d.finish_reason == FinishReason::Length && d.prompt_usage.is_none())
        );
    }

    #[test]
    fn openai_chat_translates_to_messages() {
        let mut a = Message::new("assistant", "");
        a.tool_calls = Some(json!([{"id": "c1", "type": "function",
            "function": {"name": "get_x", "arguments": "{\"q\": 2}"}}]));
        let mut t = Message::new("tool", "42");
        t.tool_call_id = Some("c1".into());
        let mut r = GenerateRequest::chat(vec![
            Message::new("system", "be brief"),
            Message::new("user", "hi"),
            a,
            t,
            Message::new("user", "and?"),
        ]);
        r.stop = vec!["END".into()];
        r.sampling.temperature = 0.5;
        r.tools = vec![ToolSpec {
            name: "get_x".into(),
            description: None,
            parameters: json!({"type": "object"}),
            strict: false,
        }];
        r.tool_choice = ToolChoice::Required;
        let b = serde_json::to_value(request_body(&r, "m").unwrap()).unwrap();
        assert_eq!(b["system"], "be brief");
        assert_eq!(b["max_tokens"], DEFAULT_MAX_TOKENS);
        assert_eq!(b["stream"], true);
        assert_eq!(b["temperature"], json!(0.5));
        assert!(b.get("top_p").is_none() && b.get("top_k").is_none());
        assert_eq!(b["stop_sequences"], json!(["END"]));
        assert_eq!(b["tool_choice"], json!({"type": "any"}));
        assert_eq!(b["tools"][0]["input_schema"], json!({"type": "object"}));
        let m = b["messages"].as_array().unwrap();
        assert_eq!(m.len(), 3, "{m:?}");
        assert_eq!(m[1]["content"][0]["type"], "tool_use");
        assert_eq!(m[1]["content"][0]["input"], json!({"q": 2}));
        // The tool result and the next user text share one user turn, result first.
        assert_eq!(m[2]["role"], "user");
        assert_eq!(m[2]["content"][0]["type"], "tool_result");
        assert_eq!(m[2]["content"][0]["tool_use_id"], "c1");
        assert_eq!(m[2]["content"][1]["text"], "and?");
        r.logprobs = Some(1);
        assert!(request_body(&r, "m").is_err());
        r.logprobs = None;
        r.prompt = Prompt::Text("once".into());
        assert!(matches!(
            request_body(&r, "m"),
            Err(EngineError::InvalidRequest(_))
        ));
    }

    #[test]
    fn a_reply_and_a_count_differ_only_in_path_body_and_accept() {
        let r = GenerateRequest::chat(vec![Message::new("user", "hi")]);
        let reply = job(&r, "m".into(), vec!["m".into()], false, false, Ask::Reply).unwrap();
        let count = job(&r, "m".into(), vec!["m".into()], false, false, Ask::Count).unwrap();
        assert_eq!(
            (reply.path, reply.accept),
            ("/v1/messages", "text/event-stream")
        );
        assert_eq!(
            (count.path, count.accept),
            ("/v1/messages/count_tokens", "application/json")
        );
        let reply: Value = serde_json::from_slice(&reply.body).unwrap();
        let count: Value = serde_json::from_slice(&count.body).unwrap();
        assert_eq!(reply["messages"], count["messages"]);
        assert!(reply.get("max_tokens").is_some() && count.get("max_tokens").is_none());
    }

    #[test]
    fn only_the_passed_on_headers_go_and_an_operator_key_replaces_the_clients() {
        let mut r = GenerateRequest::chat(vec![Message::new("user", "hi")]);
        r.raw = Some(fak_engine::RawRequest {
            body: Bytes::from_static(b"{ \"x\" : 1 }"),
            headers: vec![
                ("x-api-key".into(), "sk-client".into()),
                ("anthropic-beta".into(), "b1".into()),
                ("cookie".into(), "c".into()),
            ],
            stream: false,
        });
        let j = job(&r, "m".into(), vec!["m".into()], false, false, Ask::Reply).unwrap();
        assert_eq!(&j.body[..], b"{ \"x\" : 1 }");
        assert_eq!(j.accept, "application/json");
        let names: Vec<&str> = j.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["x-api-key", "anthropic-beta"]);
        assert!(j.client_key);
        let j = job(&r, "m".into(), vec!["m".into()], true, false, Ask::Reply).unwrap();
        let names: Vec<&str> = j.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["anthropic-beta"]);
        assert!(!j.client_key);
        // Without a body of the client's: translated, streamed.
        r.raw = None;
        let j = job(&r, "m".into(), vec!["m".into()], false, false, Ask::Reply).unwrap();
        assert_eq!(j.accept, "text/event-stream");
        let v: Value = serde_json::from_slice(&j.body).unwrap();
        assert_eq!(v["messages"][0]["content"][0]["text"], "hi");
    }
}
