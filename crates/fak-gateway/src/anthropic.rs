//! The Anthropic-compatible routes: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`, on the typed wire of [`fak_wire::anthropic`].
//!
//! **Supported.** `model`, `max_tokens` (required, at least 1; larger than the room the
//! prompt leaves in the context, it is lowered to that room and a reply that fills it
//! ends with `stop_reason: "max_tokens"`, as the Anthropic API does; a prompt that alone
//! does not fit is a 400), `messages`, `system` (a string or `text` blocks),
//! `stop_sequences`, `temperature` (default 1; 0 to 1, the API's range), `top_p`, `top_k`, `stream`, `tools`
//! (client tools: `name`, `description`, `input_schema`), `tool_choice` (`auto`, `any`,
//! `tool` with a `name`, `none`), structured outputs (`output_config.format`, or the
//! beta's `output_format`: `{"type": "json_schema", "schema"}`, enforced by constrained
//! decoding on an engine that can, a 400 on any other; [`crate::structured`]), and the
//! fields of
//! [`fak_wire::anthropic::IGNORED_REQUEST_FIELDS`] (accepted, no effect). Any other
//! top-level field is a 400 naming it.
//!
//! Messages:
//! - roles `user` and `assistant`, and `system`: a system message anywhere in
//!   `messages` is merged, in order, into the system turn after the top-level `system`
//!   (texts joined by a blank line), as other Anthropic-compatible servers do;
//! - content a string or blocks: `text`; `tool_use` (assistant); `tool_result` (user;
//!   its content a string or blocks, where `text` and `search_result` text is kept and
//!   an `image` or `document`, which the screen cannot read, is replaced by a stub
//!   `{"_withheld": true, "type": ..., "reason": "UNSCREENABLE_CONTENT"}`, so the
//!   conversation goes on); `thinking` and `redacted_thinking` (accepted, not shown to
//!   the model, which has no thinking mode). An `image` or `document` outside a tool
//!   result, and server-tool blocks, are a 400 naming them;
//! - a final `assistant` message is a prefill: the reply continues it token for token
//!   (the prompt is the conversation with that turn left open, as HF's
//!   `continue_final_message`), and holds only what follows it;
//! - consecutive `user` (or `assistant`) messages are one turn, as the real API
//!   combines them: their texts joined by a blank line (two final assistant messages
//!   are one prefill);
//! - checked as the real API checks, each a 400 `invalid_request_error` naming the
//!   field: an empty `content` (string or array); a `tool_result` whose `tool_use_id`
//!   names no earlier `tool_use`; a `tool_use` with no `tool_result` for it in the next
//!   user turn; two `tool_use` blocks with one `id`; a `tool_use` whose `input` is not
//!   an object; a base64 image `source` whose `data` is not base64 (in a message or in
//!   a tool result: the API refuses both, so a bad one is not stubbed); a `thinking` or
//!   `redacted_thinking` block outside an assistant message.
//!
//! A prompt that alone fills the context window is a 400 saying its token count and
//! the window (`max_tokens` is capped to the room left, so it is not the cause).
//!
//! Usage follows Anthropic's split: `input_tokens` counts the prompt tokens *not* read
//! from the cache, `cache_read_input_tokens` those that were; their sum is the prompt.
//! `count_tokens` answers `{"input_tokens": N}` with N that sum for the same request:
//! the prompt rendered and tokenized by the served model's own template and tokenizer
//! (tool results screened as `/v1/messages` screens them), nothing generated.
//!
//! Tool calls the model proposes are adjudicated (the `tools` module): allowed ones become
//! `tool_use` blocks (`stop_reason: "tool_use"`); a denied one is removed and replaced by
//! a text block saying why, and the `fak` field (of `message_delta`, when streaming)
//! lists every verdict. A stream sends text as it comes and the tool blocks after the
//! reply is over and the whole set is decided. The blocks a stream assembles are exactly
//! the non-streamed reply's `content`: a text block only when there is text (or when
//! the reply holds nothing else: then one empty text block), then the denials, then the
//! calls.
//!
//! **Forwarding the client's bytes.** When the engine serving the model forwards the
//! client's own request ([`fak_engine::EngineDriver::forwards_client_body`]: the
//! `anthropic-upstream` engine), the request also carries its body as it came
//! ([`fak_engine::RawRequest`]), with the `x-api-key` (unless it is this server's own
//! key), `anthropic-version` and `anthropic-beta` headers. When every tool result is
//! admitted that body is the client's, byte for byte; when the screen replaces one
//! (quarantine, page-out, withheld content), only the `content` value of that
//! `tool_result` block changes (the `splice` module), so the upstream's prompt cache
//! still matches the rest.

use crate::error::{ApiError, Flavor};
use crate::openai::sse_stream;
use crate::splice::{rewrite_tool_results, Rewrite};
use crate::structured;
use crate::tools::{
    adjudicate, arguments_object, check_tool_name, check_tools, conversation_key, denial_text,
    fak_field, offered_tools, request_taint, screen_messages, Adjudicated,
};
use crate::{
    body_bytes, cache_partition, constant_time_eq, finish, new_id, parse_json, positive, start,
    with_note, AppState, UsageNote,
};
use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::HeaderMap;
use axum::response::sse::Event;
use axum::response::Response;
use axum::Json;
use fak_engine::{
    Done, EngineEvent, FinishReason, GenerateRequest, Message, Prompt, RawRequest, SamplingParams,
    ToolCall, ToolChoice, ToolSpec,
};
use fak_wire::anthropic as wire;
use fak_wire::anthropic::{
    BlockDelta, ContentBlock, ContentBlockParam, CountTokensRequest, CountTokensResponse,
    DeltaUsage, MessageContent, MessageDelta, MessageType, MessagesRequest, Role, StopReason,
    StreamEvent, ToolResultContent, Usage,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::HashSet;

const F: Flavor = Flavor::Anthropic;

/// A JSON body of type `T` and its bytes; a body that is too large or does not parse is
/// rejected in Anthropic's error shape (413, 400 naming what was wrong).
pub(crate) struct AnthropicJson<T> {
    /// The body as it came.
    pub bytes: Bytes,
    /// The body parsed.
    pub value: T,
}

impl<T: DeserializeOwned> FromRequest<AppState> for AnthropicJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, s: &AppState) -> Result<Self, ApiError> {
        let body = Bytes::from_request(req, s).await;
        let bytes = body_bytes(s, body, F)?;
        let value = parse_json(&bytes, F)?;
        Ok(AnthropicJson { bytes, value })
    }
}

fn bad(msg: String) -> ApiError {
    ApiError::bad_request(msg).with_flavor(F)
}

/// The reason word of the stub that stands for tool-result content the screen cannot
/// read (images, documents).
pub const UNSCREENABLE: &str = "UNSCREENABLE_CONTENT";

/// The stub in place of a tool result's image or document block: the model learns that
/// something was there and was withheld, in the shape of the screen's own stubs.
#[derive(Serialize)]
struct WithheldStub<'a> {
    _withheld: bool,
    #[serde(rename = "type")]
    kind: &'a str,
    reason: &'static str,
}

fn withheld_stub(kind: &str) -> String {
    serde_json::to_string(&WithheldStub {
        _withheld: true,
        kind,
        reason: UNSCREENABLE,
    })
    .unwrap_or_default()
}

/// A request's prompt in fak's terms.
struct Converted {
    /// The conversation: a system message first when there is any system text.
    messages: Vec<Message>,
    /// Each `tool` message's (message, block) index in the request.
    origins: Vec<(usize, usize)>,
    /// Each `tool` message: whether content was withheld (replaced by a stub) from it.
    withheld: Vec<bool>,
    tools: Vec<ToolSpec>,
    tool_choice: ToolChoice,
    /// The last message is an assistant's to continue.
    prefill: bool,
}

/// `tools` and `tool_choice` of a request.
fn parse_tools(
    tools: Option<Vec<wire::Tool>>,
    choice: Option<wire::ToolChoice>,
) -> Result<(Vec<ToolSpec>, ToolChoice), ApiError> {
    let list = tools.unwrap_or_default();
    let mut specs = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        if let Some(k) = t.kind.as_deref().filter(|k| *k != "custom") {
            return Err(bad(format!(
                "tools[{i}] has type '{k}'; only client tools (name, description, input_schema) are supported"
            )));
        }
        check_tool_name(&t.name, &format!("tools[{i}].name")).map_err(|e| e.with_flavor(F))?;
        let parameters = match t.input_schema {
            Some(p @ serde_json::Value::Object(_)) => p,
            _ => {
                return Err(bad(format!(
                    "tools[{i}].input_schema must be a JSON Schema object"
                )))
            }
        };
        specs.push(ToolSpec {
            name: t.name,
            description: t.description,
            parameters,
            strict: t.strict == Some(true),
        });
    }
    let choice = match choice {
        None | Some(wire::ToolChoice::Auto { .. }) => ToolChoice::Auto,
        Some(wire::ToolChoice::Any { .. }) => ToolChoice::Required,
        Some(wire::ToolChoice::None) => ToolChoice::None,
        Some(wire::ToolChoice::Tool { name, .. }) => ToolChoice::Named(name),
    };
    check_tools(&specs, &choice).map_err(|e| e.with_flavor(F))?;
    Ok((specs, choice))
}

/// The text of a system message's content (text blocks only).
fn system_text(c: &MessageContent, at: &str) -> Result<String, ApiError> {
    match c {
        MessageContent::Text(t) => Ok(t.clone()),
        MessageContent::Blocks(blocks) => {
            let mut s = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match b {
                    ContentBlockParam::Text { text } => s.push_str(text),
                    b => {
                        return Err(bad(format!(
                            "{at}[{j}] has type '{}'; a system message holds text blocks only",
                            b.type_name()
                        )))
                    }
                }
            }
            Ok(s)
        }
    }
}

/// The text of a `tool_result`'s content, with a stub for each block the screen cannot
/// read; and whether there was one.
fn result_text(c: Option<&ToolResultContent>, at: &str) -> Result<(String, bool), ApiError> {
    let blocks = match c {
        None => return Ok((String::new(), false)),
        Some(ToolResultContent::Text(s)) => return Ok((s.clone(), false)),
        Some(ToolResultContent::Blocks(b)) => b,
    };
    let mut s = String::new();
    let mut withheld = false;
    for (j, b) in blocks.iter().enumerate() {
        match b {
            ContentBlockParam::Text { text } => s.push_str(text),
            ContentBlockParam::SearchResult { content, .. } => {
                for t in content {
                    s.push_str(&t.text);
                }
            }
            ContentBlockParam::Image { .. } | ContentBlockParam::Document { .. } => {
                s.push_str(&withheld_stub(b.type_name()));
                withheld = true;
            }
            b => {
                return Err(bad(format!(
                    "{at}.content[{j}] has type '{}', which a tool result cannot hold",
                    b.type_name()
                )))
            }
        }
    }
    Ok((s, withheld))
}

/// The `tool_use` ids of a message, and the `tool_use_id`s of its `tool_result`s.
fn call_ids(c: &MessageContent) -> (Vec<&str>, Vec<&str>) {
    let (mut uses, mut results) = (Vec::new(), Vec::new());
    if let MessageContent::Blocks(blocks) = c {
        for b in blocks {
            match b {
                ContentBlockParam::ToolUse { id, .. } => uses.push(id.as_str()),
                ContentBlockParam::ToolResult { tool_use_id, .. } => {
                    results.push(tool_use_id.as_str())
                }
                _ => {}
            }
        }
    }
    (uses, results)
}

/// Whether `data` is standard base64 (RFC 4648 section 4, padded), as an image
/// source's `data` must be.
fn is_base64(data: &str) -> bool {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(data.as_bytes())
        .is_ok()
}

/// The checks of one block the real API makes: a `tool_use`'s `input` is an object, a
/// base64 image source holds base64 `data`, a `thinking` block is the assistant's.
/// `at` is the block's path (`messages[0].content[1]`); `role` its message's.
fn check_block(b: &ContentBlockParam, at: &str, role: Role) -> Result<(), ApiError> {
    match b {
        ContentBlockParam::ToolUse { input, .. } if !input.is_object() => Err(bad(format!(
            "{at}.tool_use.input must be an object (the call's arguments), not {}",
            json_kind(input)
        ))),
        ContentBlockParam::Image { source } => {
            let base64 = source.get("type").and_then(serde_json::Value::as_str) == Some("base64");
            match source.get("data").and_then(serde_json::Value::as_str) {
                Some(data) if base64 && !is_base64(data) => {
                    Err(bad(format!("{at}.image.source.data: invalid base64 data")))
                }
                _ => Ok(()),
            }
        }
        ContentBlockParam::Thinking { .. } | ContentBlockParam::RedactedThinking { .. }
            if role != Role::Assistant =>
        {
            Err(bad(format!(
                "{at}: a '{}' block may only be in an assistant message",
                b.type_name()
            )))
        }
        ContentBlockParam::ToolResult {
            content: Some(ToolResultContent::Blocks(inner)),
            ..
        } => inner
            .iter()
            .enumerate()
            .try_for_each(|(j, c)| check_block(c, &format!("{at}.tool_result.content[{j}]"), role)),
        _ => Ok(()),
    }
}

/// A JSON value's kind, for an error message.
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The real API's checks of a conversation: no empty content; each block as
/// [`check_block`] checks it; `tool_use` ids unique; every `tool_result` answers an
/// earlier `tool_use`; every `tool_use` is answered in the next user turn. Consecutive
/// messages of one role are one turn, as the API combines them (a call may be answered
/// in any user message of the turn after it).
fn validate(messages: &[wire::MessageParam]) -> Result<(), ApiError> {
    let mut seen: HashSet<&str> = HashSet::new();
    // The calls of the last assistant turn still to be answered, and its first index.
    let mut pending: Option<(usize, Vec<&str>)> = None;
    // The role of the last user or assistant message.
    let mut last: Option<Role> = None;
    for (i, m) in messages.iter().enumerate() {
        if m.content.is_empty() {
            return Err(bad(format!(
                "messages[{i}].content is empty; a message needs content (a non-empty string or at least one block)"
            )));
        }
        if let MessageContent::Blocks(blocks) = &m.content {
            for (j, b) in blocks.iter().enumerate() {
                check_block(b, &format!("messages[{i}].content[{j}]"), m.role)?;
                if let ContentBlockParam::ToolUse { id, .. } = b {
                    if !seen.insert(id.as_str()) {
                        return Err(bad(format!(
                            "messages[{i}].content[{j}]: `tool_use` ids must be unique ('{id}' is used twice)"
                        )));
                    }
                }
            }
        }
        let (uses, results) = call_ids(&m.content);
        match m.role {
            Role::System => continue,
            Role::Assistant if last == Some(Role::Assistant) => {
                if let Some((_, ids)) = &mut pending {
                    ids.extend(uses);
                }
            }
            Role::Assistant => {
                if let Some((k, ids)) = pending.take().filter(|(_, ids)| !ids.is_empty()) {
                    return Err(unanswered(k, ids[0]));
                }
                pending = Some((i, uses));
            }
            Role::User => {
                if let Some(id) = results.iter().find(|id| !seen.contains(**id)) {
                    return Err(bad(format!(
                        "messages[{i}]: tool_result block's tool_use_id '{id}' matches no tool_use block in an earlier message"
                    )));
                }
                if let Some((_, ids)) = &mut pending {
                    ids.retain(|id| !results.contains(id));
                }
            }
        }
        last = Some(m.role);
    }
    match pending {
        Some((k, ids)) if !ids.is_empty() => Err(unanswered(k, ids[0])),
        _ => Ok(()),
    }
}

/// Consecutive `user` or `assistant` messages as one turn each, as the real API
/// combines them: texts joined by a blank line (the separator of merged system text),
/// tool calls in order. `tool` messages stay apart (each is one result).
fn merge_turns(msgs: Vec<Message>) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(msgs.len());
    for m in msgs {
        match out.last_mut() {
            Some(prev) if prev.role == m.role && (m.role == "user" || m.role == "assistant") => {
                if !m.content.is_empty() {
                    if !prev.content.is_empty() {
                        prev.content.push_str("\n\n");
                    }
                    prev.content.push_str(&m.content);
                }
                prev.tool_calls = match (prev.tool_calls.take(), m.tool_calls) {
                    (Some(serde_json::Value::Array(mut a)), Some(serde_json::Value::Array(b))) => {
                        a.extend(b);
                        Some(serde_json::Value::Array(a))
                    }
                    (a, b) => a.or(b),
                };
            }
            _ => out.push(m),
        }
    }
    out
}

fn unanswered(k: usize, id: &str) -> ApiError {
    bad(format!(
        "messages[{k}]: tool_use id '{id}' has no tool_result block in the next user message (each tool_use must be answered right after it)"
    ))
}

/// Converts a request's prompt (see the module docs): an assistant's `tool_use` blocks
/// become its `tool_calls`; a user's `tool_result` blocks become `tool` messages (in
/// order, before the user's text, as Anthropic requires results to come first).
fn convert(p: &CountTokensRequest) -> Result<Converted, ApiError> {
    if let Some(why) = p.unsupported_field() {
        return Err(bad(why));
    }
    if p.messages.is_empty() {
        return Err(bad("messages must hold at least one message".into()));
    }
    let (tools, tool_choice) = parse_tools(p.tools.clone(), p.tool_choice.clone())?;
    validate(&p.messages)?;
    let mut system: Vec<String> = p.system.iter().map(|s| s.text()).collect();
    for (i, m) in p.messages.iter().enumerate() {
        if m.role == Role::System {
            system.push(system_text(&m.content, &format!("messages[{i}].content"))?);
        }
    }
    system.retain(|s| !s.is_empty());
    let mut out = Vec::with_capacity(p.messages.len() + 1);
    if !system.is_empty() || p.system.is_some() {
        out.push(Message::new("system", &system.join("\n\n")));
    }
    let (mut origins, mut withheld) = (Vec::new(), Vec::new());
    for (i, m) in p.messages.iter().enumerate() {
        let role = match m.role {
            Role::System => continue,
            Role::User => "user",
            Role::Assistant => "assistant",
        };
        let at = format!("messages[{i}].content");
        let blocks = match &m.content {
            MessageContent::Text(t) => {
                out.push(Message::new(role, t));
                continue;
            }
            MessageContent::Blocks(b) => b,
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            match (b, m.role) {
                (ContentBlockParam::Text { text: t }, _) => text.push_str(t),
                (
                    ContentBlockParam::Thinking { .. } | ContentBlockParam::RedactedThinking { .. },
                    _,
                ) => {}
                (ContentBlockParam::ToolUse { id, name, input }, Role::Assistant) => {
                    // An object (validated above).
                    let arguments = input.to_string();
                    // The OpenAI chat `tool_calls[]` entry [`Message::tool_calls`] holds.
                    calls.push(fak_wire::openai::ToolCall {
                        id: id.clone(),
                        kind: fak_wire::openai::FunctionType::Function,
                        function: fak_wire::openai::FunctionCall {
                            name: name.clone(),
                            arguments,
                        },
                    });
                }
                (
                    ContentBlockParam::ToolResult {
                        tool_use_id,
                        content,
                        ..
                    },
                    Role::User,
                ) => {
                    let (t, w) = result_text(content.as_ref(), &format!("{at}[{j}]"))?;
                    let mut t = Message::new("tool", &t);
                    t.tool_call_id = Some(tool_use_id.clone());
                    out.push(t);
                    origins.push((i, j));
                    withheld.push(w);
                }
                (b, _) => {
                    return Err(bad(format!(
                        "{at}[{j}] has type '{}', which is not supported in {role} messages",
                        b.type_name()
                    )))
                }
            }
        }
        if m.role == Role::Assistant {
            let mut a = Message::new("assistant", &text);
            if !calls.is_empty() {
                a.tool_calls = Some(serde_json::to_value(&calls).map_err(|e| {
                    ApiError::internal(format!("writing a call: {e}")).with_flavor(F)
                })?);
            }
            out.push(a);
        } else if !text.is_empty() || out.last().is_none_or(|l| l.role != "tool") {
            out.push(Message::new("user", &text));
        }
    }
    let mut out = merge_turns(out);
    // A final assistant message with text (and, validated above, no calls) is a prefill;
    // one left empty (only thinking blocks) is dropped.
    let mut prefill = false;
    if out
        .last()
        .is_some_and(|m| m.role == "assistant" && m.tool_calls.is_none())
    {
        if out.last().is_some_and(|m| m.content.is_empty()) {
            out.pop();
        } else {
            prefill = true;
        }
    }
    Ok(Converted {
        messages: out,
        origins,
        withheld,
        tools,
        tool_choice,
        prefill,
    })
}

/// The contents of the `tool` messages, in order.
fn tool_contents(msgs: &[Message]) -> impl Iterator<Item = &str> {
    msgs.iter()
        .filter(|m| m.role == "tool")
        .map(|m| m.content.as_str())
}

fn stop_reason(d: &Done, a: &Adjudicated) -> StopReason {
    if !a.allowed.is_empty() {
        return StopReason::ToolUse;
    }
    match (d.finish_reason, &d.stop_sequence) {
        // A grammar's dead end: the reply is cut short of its format, as at max_tokens
        // (the SDK's `stop_reason` has no other word for it); `fak.finish_detail` says why.
        (FinishReason::Length | FinishReason::GrammarDeadEnd, _) => StopReason::MaxTokens,
        (_, Some(_)) => StopReason::StopSequence,
        _ => StopReason::EndTurn,
    }
}

/// Anthropic's id for a call: `toolu_` and the call id's own suffix (unchanged when it
/// is one already).
fn tool_use_id(c: &ToolCall) -> String {
    if c.id.starts_with("toolu_") {
        return c.id.clone();
    }
    format!("toolu_{}", c.id.trim_start_matches("call_"))
}

/// The calls with Anthropic ids, so that the `fak` report, the audit log and a later
/// revocation name a call by the id the client sees.
fn with_tool_use_ids(calls: Vec<ToolCall>) -> Vec<ToolCall> {
    calls
        .into_iter()
        .map(|mut c| {
            c.id = tool_use_id(&c);
            c
        })
        .collect()
}

/// The content blocks after the text: an explanation per denied call, then the allowed
/// calls as `tool_use` blocks.
fn tool_blocks(a: &Adjudicated) -> Vec<ContentBlock> {
    let mut out: Vec<ContentBlock> = a
        .denied
        .iter()
        .map(|(c, v)| ContentBlock::Text {
            text: denial_text(c, v),
        })
        .collect();
    out.extend(a.allowed.iter().map(|c| ContentBlock::ToolUse {
        id: tool_use_id(c),
        name: c.name.clone(),
        input: arguments_object(c),
    }));
    out
}

/// A reply's `content`: its text as a block when there is any (or when nothing else
/// is there), then [`tool_blocks`].
fn reply_content(text: &str, a: &Adjudicated) -> Vec<ContentBlock> {
    let rest = tool_blocks(a);
    let mut out = Vec::with_capacity(rest.len() + 1);
    if !text.is_empty() || rest.is_empty() {
        out.push(ContentBlock::Text {
            text: text.to_string(),
        });
    }
    out.extend(rest);
    out
}

/// The client headers the upstream gets with its body (see the module docs).
fn passed_on_headers(s: &AppState, headers: &HeaderMap) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for name in ["x-api-key", "anthropic-version", "anthropic-beta"] {
        for v in headers.get_all(name) {
            let Ok(v) = v.to_str() else {
                continue;
            };
            let ours = name == "x-api-key"
                && (s.config.api_key.iter().chain(&s.config.api_keys))
                    .any(|k| constant_time_eq(k.as_bytes(), v.as_bytes()));
            if !ours {
                out.push((name.to_string(), v.to_string()));
            }
        }
    }
    out
}

fn event(e: &StreamEvent) -> Event {
    Event::default()
        .event(e.event_name())
        .data(serde_json::to_string(e).unwrap_or_default())
}

/// The events of one whole block at `index`: start (text empty, input `{}`), one delta,
/// stop.
fn block_events(index: usize, b: ContentBlock) -> Vec<Event> {
    let (start, delta) = match b {
        ContentBlock::ToolUse { id, name, input } => (
            ContentBlock::ToolUse {
                id,
                name,
                input: serde_json::Value::Object(Default::default()),
            },
            Some(BlockDelta::InputJsonDelta {
                partial_json: input.to_string(),
            }),
        ),
        ContentBlock::Text { text } => (
            ContentBlock::Text {
                text: String::new(),
            },
            Some(BlockDelta::TextDelta { text }),
        ),
        b => (b, None),
    };
    let mut out = vec![event(&StreamEvent::ContentBlockStart {
        index,
        content_block: start,
    })];
    if let Some(delta) = delta {
        out.push(event(&StreamEvent::ContentBlockDelta { index, delta }));
    }
    out.push(event(&StreamEvent::ContentBlockStop { index }));
    out
}

fn error_event(e: &ApiError) -> Event {
    event(&StreamEvent::Error {
        error: wire::ErrorDetail {
            kind: e.kind.to_string(),
            message: e.message.clone(),
        },
    })
}

/// The client's request for a driver that forwards it ([`RawRequest`]): its own bytes,
/// with the `content` of each tool result the screen replaced (or that held a withheld
/// block) set to what the model sees, and the headers passed on. `before` holds the
/// tool results' contents before screening, `msgs` after, in the same order.
fn forwarded(
    s: &AppState,
    headers: &HeaderMap,
    bytes: Bytes,
    before: &[String],
    msgs: &[Message],
    c: &Converted,
    stream: bool,
) -> Result<RawRequest, ApiError> {
    let rewrites: Vec<Rewrite> = tool_contents(msgs)
        .zip(before)
        .zip(c.origins.iter().zip(&c.withheld))
        .filter(|((after, before), (_, withheld))| after != before || **withheld)
        .map(|((after, _), (&(message, block), _))| Rewrite {
            message,
            block,
            content: after.to_string(),
        })
        .collect();
    let body = if rewrites.is_empty() {
        bytes
    } else {
        Bytes::from(rewrite_tool_results(&bytes, &rewrites).map_err(|e| {
            ApiError::internal(format!(
                "replacing a screened tool result in the request for the upstream: {e}"
            ))
            .with_flavor(F)
        })?)
    };
    Ok(RawRequest {
        body,
        headers: passed_on_headers(s, headers),
        stream,
    })
}

/// `POST /v1/messages/count_tokens`: the prompt's token count for the same request to
/// `/v1/messages` (see the module docs).
pub(crate) async fn count_tokens(
    State(s): State<AppState>,
    headers: HeaderMap,
    AnthropicJson { bytes, value: r }: AnthropicJson<CountTokensRequest>,
) -> Result<Json<CountTokensResponse>, ApiError> {
    let mut c = convert(&r)?;
    let forward = s.driver.forwards_client_body(Some(&r.model));
    let before: Vec<String> = if forward {
        tool_contents(&c.messages).map(str::to_string).collect()
    } else {
        Vec::new()
    };
    let conversation = conversation_key(&headers, &c.messages);
    let messages = std::mem::take(&mut c.messages);
    let (msgs, _) = screen_messages(&s, &conversation, messages, &c.withheld, F).await?;
    // An upstream counts the client's own bytes, with its key and headers, as for
    // `/v1/messages` (screened tool results replaced as there).
    let raw = if forward {
        Some(forwarded(&s, &headers, bytes, &before, &msgs, &c, false)?)
    } else {
        None
    };
    let req = GenerateRequest {
        raw,
        model: Some(r.model),
        tools: c.tools,
        tool_choice: c.tool_choice,
        continue_final_message: c.prefill,
        cap_max_tokens: true,
        ..GenerateRequest::chat(msgs)
    };
    let driver = std::sync::Arc::clone(&s.driver);
    let n = tokio::task::spawn_blocking(move || driver.count_tokens(&req))
        .await
        .map_err(|e| ApiError::internal(format!("counting failed: {e}")).with_flavor(F))?
        .map_err(|e| ApiError::from(e).with_flavor(F))?;
    Ok(Json(CountTokensResponse {
        input_tokens: n as u64,
    }))
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(s): State<AppState>,
    headers: HeaderMap,
    AnthropicJson { bytes, value: r }: AnthropicJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let mut c = convert(&r.prompt)?;
    let max_tokens = positive("max_tokens", r.max_tokens, F)?;
    // The API's range (OpenAI's is 0 to 2; a value past 1 is a client error here).
    if let Some(t) = r.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(bad(format!(
            "temperature: must be between 0 and 1 (got {t})"
        )));
    }
    let msgs = std::mem::take(&mut c.messages);
    let forward = s.driver.forwards_client_body(Some(&r.prompt.model));
    let before: Vec<String> = if forward {
        tool_contents(&msgs).map(str::to_string).collect()
    } else {
        Vec::new()
    };
    let conversation = conversation_key(&headers, &msgs);
    let taint = request_taint(&headers, &msgs);
    let (msgs, results) = screen_messages(&s, &conversation, msgs, &c.withheld, F).await?;
    let stream = r.stream == Some(true);
    let raw = if forward {
        Some(forwarded(&s, &headers, bytes, &before, &msgs, &c, stream)?)
    } else {
        None
    };
    let top_k = match r.top_k {
        None => 0,
        Some(k) if k >= 0 => k as usize,
        Some(k) => return Err(bad(format!("top_k must be >= 0 (got {k})"))),
    };
    let field = if r.prompt.output_format.is_some() {
        "output_format"
    } else {
        "output_config.format"
    };
    let grammar = r
        .prompt
        .output_format()
        .map(|f| structured::schema(f.schema.clone()));
    let grammar = structured::enforced(&s, &r.prompt.model, field, grammar, F)?;
    let model = r.prompt.model;
    let req = GenerateRequest {
        model: Some(model.clone()),
        prompt: Prompt::Chat(msgs),
        max_tokens: Some(max_tokens),
        sampling: SamplingParams {
            temperature: r.temperature.unwrap_or(1.0),
            top_p: r.top_p.unwrap_or(1.0),
            top_k,
            seed: s.seed(None),
            grammar,
            ..SamplingParams::default()
        },
        stop: r
            .stop_sequences
            .unwrap_or_default()
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect(),
        tools: c.tools,
        tool_choice: c.tool_choice,
        logprobs: None,
        cache_partition: cache_partition(&s, &headers, r.cache_salt.as_deref(), F)?,
        raw,
        continue_final_message: c.prefill,
        cap_max_tokens: true,
        context_overflow: r.context_overflow.map(crate::context_overflow),
    };
    // Calls may only be of tools the model was offered (none when `tool_choice` is
    // `none`): anything else it writes is denied UNKNOWN_TOOL.
    let offered = offered_tools(&req);
    let started = start(&s, req, F, "/v1/messages").await?;
    let id = new_id("msg_");
    if stream {
        let (prompt, cached) = (started.prompt_tokens, started.cached_tokens);
        let note = UsageNote {
            prompt,
            cached,
            stream: true,
            ..UsageNote::default()
        };
        let head = vec![event(&StreamEvent::MessageStart {
            message: wire::Message {
                id,
                kind: MessageType::Message,
                role: Role::Assistant,
                model,
                content: Vec::new(),
                stop_reason: None,
                stop_sequence: None,
                usage: Usage::split(prompt, cached, 0, 0),
                fak: None,
            },
        })];
        let state = s.clone();
        let mut held: Vec<ToolCall> = Vec::new();
        // Whether the text block (index 0) has been opened: at the first text.
        let mut text_open = false;
        // A `ping` follows the first block's start, as the API sends it.
        let mut pinged = false;
        let st = sse_stream(s.clone(), started, head, move |ev| match ev {
            EngineEvent::Text(t) if t.is_empty() => Vec::new(),
            EngineEvent::Text(t) => {
                let mut out = Vec::with_capacity(2);
                if !text_open {
                    text_open = true;
                    out.push(event(&StreamEvent::ContentBlockStart {
                        index: 0,
                        content_block: ContentBlock::Text {
                            text: String::new(),
                        },
                    }));
                    out.push(event(&StreamEvent::Ping));
                    pinged = true;
                }
                out.push(event(&StreamEvent::ContentBlockDelta {
                    index: 0,
                    delta: BlockDelta::TextDelta { text: t },
                }));
                out
            }
            EngineEvent::ToolCall(c) => {
                held.push(c);
                Vec::new()
            }
            EngineEvent::Done(d) => {
                let a = adjudicate(
                    &state,
                    &conversation,
                    &taint,
                    &offered,
                    with_tool_use_ids(std::mem::take(&mut held)),
                );
                let mut out = Vec::new();
                let mut blocks = tool_blocks(&a);
                if text_open {
                    out.push(event(&StreamEvent::ContentBlockStop { index: 0 }));
                } else if blocks.is_empty() {
                    blocks.push(ContentBlock::Text {
                        text: String::new(),
                    });
                }
                let first = usize::from(text_open);
                for (k, b) in blocks.into_iter().enumerate() {
                    let mut evs = block_events(first + k, b);
                    if !pinged {
                        evs.insert(1, event(&StreamEvent::Ping));
                        pinged = true;
                    }
                    out.extend(evs);
                }
                // Counts known only at the end (an upstream engine) come here too.
                let usage = match d.prompt_usage {
                    Some(u) => DeltaUsage::from(Usage::split(
                        u.prompt_tokens,
                        u.cached_tokens,
                        u.cache_creation_tokens,
                        d.completion_tokens,
                    )),
                    None => DeltaUsage {
                        output_tokens: d.completion_tokens as u64,
                        ..DeltaUsage::default()
                    },
                };
                out.push(event(&StreamEvent::MessageDelta {
                    delta: MessageDelta {
                        stop_reason: Some(stop_reason(&d, &a)),
                        stop_sequence: d.stop_sequence.clone(),
                    },
                    usage,
                    fak: structured::dead_end_detail(fak_field(&results, &a), &d),
                }));
                out.push(event(&StreamEvent::MessageStop));
                out
            }
            EngineEvent::Error(e) => vec![error_event(&ApiError::from(e).with_flavor(F))],
            EngineEvent::Start { .. } | EngineEvent::Logprobs(_) => Vec::new(),
        });
        // The keep-alive is the API's own `ping` event.
        let sse = crate::openai::sse_response(&s, st, event(&StreamEvent::Ping));
        return Ok(with_note(sse, note));
    }
    let mut f = finish(&s, started, F).await?;
    let a = adjudicate(
        &s,
        &conversation,
        &taint,
        &offered,
        with_tool_use_ids(std::mem::take(&mut f.tool_calls)),
    );
    let body = wire::Message {
        id,
        kind: MessageType::Message,
        role: Role::Assistant,
        model,
        content: reply_content(&f.text, &a),
        stop_reason: Some(stop_reason(&f.done, &a)),
        stop_sequence: f.done.stop_sequence.clone(),
        usage: Usage::split(
            f.prompt_tokens,
            f.cached_tokens,
            f.done.prompt_usage.map_or(0, |u| u.cache_creation_tokens),
            f.done.completion_tokens,
        ),
        fak: structured::dead_end_detail(fak_field(&results, &a), &f.done),
    };
    let body = serde_json::to_value(&body)
        .map_err(|e| ApiError::internal(format!("writing the reply: {e}")).with_flavor(F))?;
    Ok(f.respond(body))
}
