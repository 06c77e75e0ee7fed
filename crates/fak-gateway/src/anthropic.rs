//! The Anthropic-compatible route: `POST /v1/messages`.
//!
//! Supported now: `model`, `max_tokens` (required, at least 1), `messages` (roles
//! `user`/`assistant`, content a string or an array of `text` blocks), top-level
//! `system` (a string or `text` blocks), `stop_sequences`, `temperature` (default 1),
//! `top_p`, `top_k`, `stream`. Not yet: `tools` and the `tool_use` / `tool_result`
//! blocks (a 400 naming them). Usage follows Anthropic's split: `input_tokens` counts
//! the prompt tokens *not* read from the cache, `cache_read_input_tokens` those that
//! were; their sum is the prompt.

use crate::error::{ApiError, Flavor};
use crate::openai::sse_stream;
use crate::{finish, new_id, parse_body, positive, start, with_note, AppState, UsageNote};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use fak_engine::{
    Done, EngineEvent, FinishReason, GenerateRequest, Message, Prompt, SamplingParams,
};
use serde::Deserialize;
use serde_json::{json, Value};

const F: Flavor = Flavor::Anthropic;

#[derive(Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
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

fn stop_reason(d: &Done) -> &'static str {
    match (d.finish_reason, &d.stop_sequence) {
        (FinishReason::Length, _) => "max_tokens",
        (_, Some(_)) => "stop_sequence",
        _ => "end_turn",
    }
}

fn usage(prompt: usize, cached: usize, output: usize) -> Value {
    json!({
        "input_tokens": prompt - cached.min(prompt),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    })
}

fn event(name: &str, v: &Value) -> Event {
    Event::default().event(name).data(v.to_string())
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: MessagesRequest = parse_body(&s, body, F)?;
    if r.tools
        .as_ref()
        .is_some_and(|t| t.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(bad("`tools` is not supported yet".into()));
    }
    let max_tokens = positive("max_tokens", r.max_tokens, F)?;
    if r.messages.is_empty() {
        return Err(bad("messages must hold at least one message".into()));
    }
    let mut msgs = Vec::with_capacity(r.messages.len() + 1);
    if let Some(sys) = r.system {
        msgs.push(Message::new("system", &text_of(sys, "system")?));
    }
    for (i, m) in r.messages.into_iter().enumerate() {
        if m.role != "user" && m.role != "assistant" {
            return Err(bad(format!(
                "messages[{i}].role '{}' is not one of user, assistant",
                m.role
            )));
        }
        let text = text_of(m.content, &format!("messages[{i}].content"))?;
        msgs.push(Message::new(&m.role, &text));
    }
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
    };
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
                    "usage": usage(prompt, cached, 0),
                }}),
            ),
            event(
                "content_block_start",
                &json!({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}),
            ),
            event("ping", &json!({"type": "ping"})),
        ];
        let st = sse_stream(s, started, head, move |ev| match ev {
            EngineEvent::Text(t) => vec![event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": t}}),
            )],
            EngineEvent::Done(d) => vec![
                event(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                ),
                event(
                    "message_delta",
                    &json!({"type": "message_delta",
                            "delta": {"stop_reason": stop_reason(&d), "stop_sequence": d.stop_sequence},
                            "usage": {"output_tokens": d.completion_tokens}}),
                ),
                event("message_stop", &json!({"type": "message_stop"})),
            ],
            EngineEvent::Error(e) => vec![event("error", &ApiError::from(e).with_flavor(F).body())],
            EngineEvent::Start { .. } => Vec::new(),
        });
        return Ok(with_note(Sse::new(st).into_response(), note));
    }
    let f = finish(&s, started, F).await?;
    let body = json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": f.text}],
        "stop_reason": stop_reason(&f.done),
        "stop_sequence": f.done.stop_sequence,
        "usage": usage(f.prompt_tokens, f.cached_tokens, f.done.completion_tokens),
    });
    Ok(with_note(
        Json(body).into_response(),
        UsageNote {
            prompt: f.prompt_tokens,
            completion: f.done.completion_tokens,
            cached: f.cached_tokens,
            stream: false,
        },
    ))
}
