//! The Anthropic-compatible route: `POST /v1/messages`.
//!
//! Supported now: `model`, `max_tokens` (required, at least 1), `messages` (roles
//! `user`/`assistant`, content a string or an array of `text`, `tool_use` (assistant) and
//! `tool_result` (user) blocks), top-level `system` (a string or `text` blocks),
//! `stop_sequences`, `temperature` (default 1), `top_p`, `top_k`, `stream`, `tools`
//! (client tools: `name`, `description`, `input_schema`) and `tool_choice` (`auto`,
//! `any`, `tool` with a `name`, `none`). Other block types (images, documents) are a 400
//! naming them. Usage follows Anthropic's split: `input_tokens` counts the prompt tokens
//! *not* read from the cache, `cache_read_input_tokens` those that were; their sum is
//! the prompt.
//!
//! Tool calls the model proposes are adjudicated (the `tools` module): allowed ones become
//! `tool_use` blocks (`stop_reason: "tool_use"`); a denied one is removed and replaced by
//! a text block saying why, and the `fak` field (of `message_delta`, when streaming)
//! lists every verdict. A stream sends text as it comes and the tool blocks after the
//! reply is over and the whole set is decided.
//!
//! **Forwarding the client's bytes.** When the engine serving the model forwards the
//! client's own request ([`fak_engine::EngineDriver::forwards_client_body`]: the
//! `anthropic-upstream` engine), the request also carries its body as it came
//! ([`fak_engine::RawRequest`]), with the `x-api-key` (unless it is this server's own
//! key), `anthropic-version` and `anthropic-beta` headers. When every tool result is
//! admitted that body is the client's, byte for byte; when the screen replaces one
//! (quarantine, page-out), only the `content` value of that `tool_result` block changes
//! (the `splice` module), so the upstream's prompt cache still matches the rest.

use crate::error::{ApiError, Flavor};
use crate::openai::sse_stream;
use crate::splice::{rewrite_tool_results, Rewrite};
use crate::tools::{
    adjudicate, arguments_object, check_tool_name, check_tools, conversation_key, denial_text,
    fak_field, offered_tools, screen_messages, Adjudicated,
};
use crate::{
    body_bytes, cache_partition, constant_time_eq, finish, new_id, parse_json, positive, start,
    with_note, AppState, UsageNote,
};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use fak_engine::{
    Done, EngineEvent, FinishReason, GenerateRequest, Message, Prompt, RawRequest, SamplingParams,
    ToolCall, ToolChoice, ToolSpec,
};
use serde::Deserialize;
use serde_json::{json, Value};

const F: Flavor = Flavor::Anthropic;

#[derive(Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    id: Option<String>,
    name: Option<String>,
    input: Option<Value>,
    tool_use_id: Option<String>,
    content: Option<Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Deserialize)]
struct AMessage {
    role: String,
    content: Content,
}

#[derive(Deserialize)]
struct MessagesRequest {
    model: String,
    max_tokens: i64,
    messages: Vec<AMessage>,
    system: Option<Content>,
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    stream: Option<bool>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    /// vLLM's prefix-cache salt, accepted on this wire too: only requests with the same
    /// salt (and API key) share a cached prefix.
    cache_salt: Option<String>,
}

fn bad(msg: String) -> ApiError {
    ApiError::bad_request(msg).with_flavor(F)
}

fn text_of(c: Content, at: &str) -> Result<String, ApiError> {
    match c {
        Content::Text(t) => Ok(t),
        Content::Blocks(blocks) => {
            let mut s = String::new();
            for (j, b) in blocks.into_iter().enumerate() {
                match (b.kind.as_str(), b.text) {
                    ("text", Some(t)) => s.push_str(&t),
                    ("text", None) => {
                        return Err(bad(format!("{at}[{j}] is a text block without `text`")))
                    }
                    (k, _) => {
                        return Err(bad(format!(
                            "{at}[{j}] has type '{k}'; only text blocks are supported yet"
                        )))
                    }
                }
            }
            Ok(s)
        }
    }
}

/// `tools` and `tool_choice` of a Messages request.
fn parse_tools(
    tools: Option<Value>,
    choice: Option<Value>,
) -> Result<(Vec<ToolSpec>, ToolChoice), ApiError> {
    let list = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("tools must be an array".into())),
    };
    let mut specs = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        if let Some(k) = t.get("type").and_then(Value::as_str) {
            if k != "custom" {
                return Err(bad(format!(
                    "tools[{i}] has type '{k}'; only client tools (name, description, input_schema) are supported"
                )));
            }
        }
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("tools[{i}] has no string `name`")))?;
        check_tool_name(name, &format!("tools[{i}].name")).map_err(|e| e.with_flavor(F))?;
        let parameters = match t.get("input_schema") {
            Some(p @ Value::Object(_)) => p.clone(),
            _ => {
                return Err(bad(format!(
                    "tools[{i}].input_schema must be a JSON Schema object"
                )))
            }
        };
        specs.push(ToolSpec {
            name: name.to_string(),
            description: t
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_string),
            parameters,
        });
    }
    let choice = match &choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(v) => match (
            v.get("type").and_then(Value::as_str),
            v.get("name").and_then(Value::as_str),
        ) {
            (Some("auto"), _) => ToolChoice::Auto,
            (Some("any"), _) => ToolChoice::Required,
            (Some("none"), _) => ToolChoice::None,
            (Some("tool"), Some(n)) => ToolChoice::Named(n.to_string()),
            _ => {
                return Err(bad(
                    "tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}".into(),
                ))
            }
        },
    };
    check_tools(&specs, &choice).map_err(|e| e.with_flavor(F))?;
    Ok((specs, choice))
}

/// The text of a `tool_result` block's `content`: a string, or `text` blocks.
fn result_text(c: Option<Value>, at: &str) -> Result<String, ApiError> {
    match c {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(blocks)) => {
            let mut s = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (
                    b.get("type").and_then(Value::as_str),
                    b.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => s.push_str(t),
                    (k, _) => {
                        return Err(bad(format!(
                        "{at}.content[{j}] has type '{}'; only text is supported in tool results",
                        k.unwrap_or("?")
                    )))
                    }
                }
            }
            Ok(s)
        }
        Some(_) => Err(bad(format!("{at}.content must be a string or blocks"))),
    }
}

/// One Anthropic message as fak messages: an assistant's `tool_use` blocks become its
/// `tool_calls`; a user's `tool_result` blocks become `tool` messages (in order, before
/// the user's text, as Anthropic requires results to come first). `origins` receives
/// each `tool` message's (message, block) index in the request.
fn convert(
    m: AMessage,
    i: usize,
    out: &mut Vec<Message>,
    origins: &mut Vec<(usize, usize)>,
) -> Result<(), ApiError> {
    let at = format!("messages[{i}].content");
    let blocks = match m.content {
        Content::Text(t) => {
            out.push(Message::new(&m.role, &t));
            return Ok(());
        }
        Content::Blocks(b) => b,
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.into_iter().enumerate() {
        match (b.kind.as_str(), m.role.as_str()) {
            ("text", _) => match b.text {
                Some(t) => text.push_str(&t),
                None => return Err(bad(format!("{at}[{j}] is a text block without `text`"))),
            },
            ("tool_use", "assistant") => {
                let (Some(id), Some(name)) = (b.id, b.name) else {
                    return Err(bad(format!(
                        "{at}[{j}] is a tool_use block without id or name"
                    )));
                };
                let input = b.input.unwrap_or_else(|| json!({}));
                calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": input.to_string()}}));
            }
            ("tool_result", "user") => {
                let Some(id) = b.tool_use_id else {
                    return Err(bad(format!(
                        "{at}[{j}] is a tool_result block without tool_use_id"
                    )));
                };
                let mut t = Message::new("tool", &result_text(b.content, &format!("{at}[{j}]"))?);
                t.tool_call_id = Some(id);
                out.push(t);
                origins.push((i, j));
            }
            (k, role) => {
                return Err(bad(format!(
                    "{at}[{j}] has type '{k}', which is not supported in a {role} message"
                )))
            }
        }
    }
    if m.role == "assistant" {
        let mut a = Message::new("assistant", &text);
        if !calls.is_empty() {
            a.tool_calls = Some(Value::Array(calls));
        }
        out.push(a);
    } else if !text.is_empty() || out.last().is_none_or(|l| l.role != "tool") {
        out.push(Message::new("user", &text));
    }
    Ok(())
}

/// The contents of the `tool` messages, in order.
fn tool_contents(msgs: &[Message]) -> impl Iterator<Item = &str> {
    msgs.iter()
        .filter(|m| m.role == "tool")
        .map(|m| m.content.as_str())
}

fn stop_reason(d: &Done, a: &Adjudicated) -> &'static str {
    if !a.allowed.is_empty() {
        return "tool_use";
    }
    match (d.finish_reason, &d.stop_sequence) {
        (FinishReason::Length, _) => "max_tokens",
        (_, Some(_)) => "stop_sequence",
        _ => "end_turn",
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
fn tool_blocks(a: &Adjudicated) -> Vec<Value> {
    let mut out: Vec<Value> = a
        .denied
        .iter()
        .map(|(c, v)| json!({"type": "text", "text": denial_text(c, v)}))
        .collect();
    out.extend(a.allowed.iter().map(|c| {
        json!({"type": "tool_use", "id": tool_use_id(c), "name": c.name,
               "input": arguments_object(c)})
    }));
    out
}

/// Anthropic's usage: `input_tokens` are the prompt's tokens neither read from nor
/// written to a cache.
fn usage(prompt: usize, cached: usize, created: usize, output: usize) -> Value {
    json!({
        "input_tokens": prompt.saturating_sub(cached).saturating_sub(created),
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    })
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

fn event(name: &str, v: &Value) -> Event {
    Event::default().event(name).data(v.to_string())
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(&s, body, F)?;
    let r: MessagesRequest = parse_json(&bytes, F)?;
    let (tools, tool_choice) = parse_tools(r.tools, r.tool_choice)?;
    let max_tokens = positive("max_tokens", r.max_tokens, F)?;
    if r.messages.is_empty() {
        return Err(bad("messages must hold at least one message".into()));
    }
    let mut msgs = Vec::with_capacity(r.messages.len() + 1);
    if let Some(sys) = r.system {
        msgs.push(Message::new("system", &text_of(sys, "system")?));
    }
    let mut origins = Vec::new();
    for (i, m) in r.messages.into_iter().enumerate() {
        if m.role != "user" && m.role != "assistant" {
            return Err(bad(format!(
                "messages[{i}].role '{}' is not one of user, assistant",
                m.role
            )));
        }
        convert(m, i, &mut msgs, &mut origins)?;
    }
    let forward = s.driver.forwards_client_body(Some(&r.model));
    let before: Vec<String> = if forward {
        tool_contents(&msgs).map(str::to_string).collect()
    } else {
        Vec::new()
    };
    let conversation = conversation_key(&headers, &msgs);
    let (msgs, results) = screen_messages(&s, &conversation, msgs, F).await?;
    let raw = if forward {
        // Each tool message whose content the screen replaced: its block gets the stub.
        let rewrites: Vec<Rewrite> = tool_contents(&msgs)
            .zip(&before)
            .zip(&origins)
            .filter(|((after, before), _)| after != before)
            .map(|((after, _), &(message, block))| Rewrite {
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
        Some(RawRequest {
            body,
            headers: passed_on_headers(&s, &headers),
            stream: r.stream == Some(true),
        })
    } else {
        None
    };
    let top_k = match r.top_k {
        None => 0,
        Some(k) if k >= 0 => k as usize,
        Some(k) => return Err(bad(format!("top_k must be >= 0 (got {k})"))),
    };
    let req = GenerateRequest {
        model: Some(r.model.clone()),
        prompt: Prompt::Chat(msgs),
        max_tokens: Some(max_tokens),
        sampling: SamplingParams {
            temperature: r.temperature.unwrap_or(1.0),
            top_p: r.top_p.unwrap_or(1.0),
            top_k,
            ..SamplingParams::default()
        },
        stop: r
            .stop_sequences
            .unwrap_or_default()
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect(),
        tools,
        tool_choice,
        logprobs: None,
        cache_partition: cache_partition(&s, &headers, r.cache_salt.as_deref(), F)?,
        raw,
    };
    // Calls may only be of tools the model was offered (none when `tool_choice` is
    // `none`): anything else it writes is denied UNKNOWN_TOOL.
    let offered = offered_tools(&req);
    let started = start(&s, req, F, "/v1/messages").await?;
    let id = new_id("msg_");
    let model = r.model;
    if r.stream == Some(true) {
        let (prompt, cached) = (started.prompt_tokens, started.cached_tokens);
        let note = UsageNote {
            prompt,
            cached,
            stream: true,
            ..UsageNote::default()
        };
        let head = vec![
            event(
                "message_start",
                &json!({"type": "message_start", "message": {
                    "id": id, "type": "message", "role": "assistant", "model": model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": usage(prompt, cached, 0, 0),
                }}),
            ),
            event(
                "content_block_start",
                &json!({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}),
            ),
            event("ping", &json!({"type": "ping"})),
        ];
        let state = s.clone();
        let mut held: Vec<ToolCall> = Vec::new();
        let st = sse_stream(s, started, head, move |ev| match ev {
            EngineEvent::Text(t) => vec![event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": t}}),
            )],
            EngineEvent::ToolCall(c) => {
                held.push(c);
                Vec::new()
            }
            EngineEvent::Done(d) => {
                let a = adjudicate(
                    &state,
                    &conversation,
                    &offered,
                    with_tool_use_ids(std::mem::take(&mut held)),
                );
                let mut out = vec![event(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                )];
                for (k, b) in tool_blocks(&a).into_iter().enumerate() {
                    let index = k + 1;
                    let (start, delta) = if b["type"] == "tool_use" {
                        let input = b["input"].to_string();
                        let mut start = b;
                        start["input"] = json!({});
                        (
                            start,
                            json!({"type": "input_json_delta", "partial_json": input}),
                        )
                    } else {
                        let text = b["text"].clone();
                        (
                            json!({"type": "text", "text": ""}),
                            json!({"type": "text_delta", "text": text}),
                        )
                    };
                    out.push(event("content_block_start", &json!({"type": "content_block_start", "index": index, "content_block": start})));
                    out.push(event(
                        "content_block_delta",
                        &json!({"type": "content_block_delta", "index": index, "delta": delta}),
                    ));
                    out.push(event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": index}),
                    ));
                }
                let mut md = json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(&d, &a), "stop_sequence": d.stop_sequence},
                        "usage": {"output_tokens": d.completion_tokens}});
                // Counts known only at the end (an upstream engine) come here too.
                if let Some(u) = d.prompt_usage {
                    md["usage"] = usage(
                        u.prompt_tokens,
                        u.cached_tokens,
                        u.cache_creation_tokens,
                        d.completion_tokens,
                    );
                }
                if let Some(v) = fak_field(&results, &a) {
                    md["fak"] = v;
                }
                out.push(event("message_delta", &md));
                out.push(event("message_stop", &json!({"type": "message_stop"})));
                out
            }
            EngineEvent::Error(e) => vec![event("error", &ApiError::from(e).with_flavor(F).body())],
            EngineEvent::Start { .. } | EngineEvent::Logprobs(_) => Vec::new(),
        });
        return Ok(with_note(Sse::new(st).into_response(), note));
    }
    let mut f = finish(&s, started, F).await?;
    let a = adjudicate(
        &s,
        &conversation,
        &offered,
        with_tool_use_ids(std::mem::take(&mut f.tool_calls)),
    );
    let mut content = Vec::new();
    if !f.text.is_empty() || a.report.is_none() {
        content.push(json!({"type": "text", "text": f.text}));
    }
    content.extend(tool_blocks(&a));
    let mut body = json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(&f.done, &a),
        "stop_sequence": f.done.stop_sequence,
        "usage": usage(
            f.prompt_tokens,
            f.cached_tokens,
            f.done.prompt_usage.map_or(0, |u| u.cache_creation_tokens),
            f.done.completion_tokens,
        ),
    });
    if let Some(v) = fak_field(&results, &a) {
        body["fak"] = v;
    }
    Ok(f.respond(body))
}
