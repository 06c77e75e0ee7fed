//! OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.
//!
//! Request fields follow the OpenAI API reference. Supported now: `model`, `messages`
//! (roles `system`/`developer`/`user`/`assistant`/`tool`, content a string or an array
//! of `text` parts), `max_tokens`/`max_completion_tokens` (at least 1; default: the rest
//! of the context window), `temperature` (default 1), `top_p`, `seed`, `stop` (string or
//! list), `stream`, `stream_options.include_usage`, `n` (1 only). Not yet: `tools`,
//! `tool_choice`, `logprobs`, `response_format` other than `text`: each is a 400 naming
//! the field, never silently ignored.

use crate::error::{ApiError, Flavor};
use crate::{
    finish, new_id, parse_body, positive, start, unix_now, with_note, AppState, Started, StreamLog,
    UsageNote,
};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use fak_engine::{EngineEvent, FinishReason, GenerateRequest, Message, Prompt, SamplingParams};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;

const F: Flavor = Flavor::OpenAi;

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    content: Option<Content>,
    name: Option<String>,
    tool_call_id: Option<String>,
    tool_calls: Option<Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<ChatMessage>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<i64>,
    stop: Option<Stop>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<i64>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    logprobs: Option<bool>,
    top_logprobs: Option<Value>,
    response_format: Option<Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct CompletionRequest {
    model: String,
    prompt: PromptField,
    max_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<i64>,
    stop: Option<Stop>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<i64>,
    echo: Option<bool>,
    logprobs: Option<Value>,
    suffix: Option<String>,
}

fn unsupported(field: &str) -> ApiError {
    ApiError::bad_request(format!("`{field}` is not supported yet")).with_flavor(F)
}

fn stops(s: Option<Stop>) -> Result<Vec<String>, ApiError> {
    let v = match s {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if v.len() > 16 {
        return Err(ApiError::bad_request(format!(
            "stop holds {} strings; at most 16",
            v.len()
        )));
    }
    Ok(v.into_iter().filter(|s| !s.is_empty()).collect())
}

fn sampling(temperature: Option<f32>, top_p: Option<f32>, seed: Option<i64>) -> SamplingParams {
    SamplingParams {
        temperature: temperature.unwrap_or(1.0),
        top_p: top_p.unwrap_or(1.0),
        seed: seed.map_or(0, |s| s as u64),
        ..SamplingParams::default()
    }
}

fn check_n(n: Option<i64>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => {
            Err(ApiError::bad_request(format!("n = {n}: only n = 1 is supported")).with_flavor(F))
        }
    }
}

fn finish_word(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn to_messages(ms: Vec<ChatMessage>) -> Result<Vec<Message>, ApiError> {
    if ms.is_empty() {
        return Err(ApiError::bad_request(
            "messages must hold at least one message",
        ));
    }
    ms.into_iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                "user" | "assistant" | "tool" => m.role.as_str(),
                other => {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}].role '{other}' is not one of system, developer, user, assistant, tool"
                    )))
                }
            }
            .to_string();
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for (j, p) in parts.into_iter().enumerate() {
                        match (p.kind.as_str(), p.text) {
                            ("text", Some(t)) => s.push_str(&t),
                            ("text", None) => {
                                return Err(ApiError::bad_request(format!(
                                    "messages[{i}].content[{j}] is a text part without `text`"
                                )))
                            }
                            (k, _) => {
                                return Err(ApiError::bad_request(format!(
                                    "messages[{i}].content[{j}] has type '{k}'; only text parts are supported"
                                )))
                            }
                        }
                    }
                    s
                }
            };
            Ok(Message {
                role,
                content,
                tool_calls: m.tool_calls,
                tool_call_id: m.tool_call_id,
                name: m.name,
            })
        })
        .collect()
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: ChatRequest = parse_body(&s, body, F)?;
    check_n(r.n)?;
    if r.tools
        .as_ref()
        .is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(unsupported("tools"));
    }
    if r.tool_choice
        .as_ref()
        .is_some_and(|t| !t.is_null() && t != "none" && t != "auto")
    {
        return Err(unsupported("tool_choice"));
    }
    if r.logprobs == Some(true) || r.top_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(unsupported("logprobs"));
    }
    if let Some(rf) = &r.response_format {
        if rf
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t != "text")
        {
            return Err(unsupported("response_format"));
        }
    }
    let max_tokens = match r.max_completion_tokens.or(r.max_tokens) {
        Some(v) => Some(positive(
            if r.max_completion_tokens.is_some() {
                "max_completion_tokens"
            } else {
                "max_tokens"
            },
            v,
            F,
        )?),
        None => None,
    };
    let req = GenerateRequest {
        model: Some(r.model.clone()),
        prompt: Prompt::Chat(to_messages(r.messages).map_err(|e| e.with_flavor(F))?),
        max_tokens,
        sampling: sampling(r.temperature, r.top_p, r.seed),
        stop: stops(r.stop).map_err(|e| e.with_flavor(F))?,
    };
    let started = start(&s, req, F, "/v1/chat/completions").await?;
    let id = new_id("chatcmpl-");
    let created = unix_now();
    if r.stream == Some(true) {
        let include_usage = r.stream_options.and_then(|o| o.include_usage) == Some(true);
        let note = UsageNote {
            prompt: started.prompt_tokens,
            cached: started.cached_tokens,
            stream: true,
            ..UsageNote::default()
        };
        let sse = Sse::new(chat_stream(s, started, id, created, r.model, include_usage));
        return Ok(with_note(sse.into_response(), note));
    }
    let f = finish(&s, started, F).await?;
    let body = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": r.model,
        "system_fingerprint": "fak",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": f.text, "refusal": null},
            "logprobs": null,
            "finish_reason": finish_word(f.done.finish_reason),
        }],
        "usage": usage(f.prompt_tokens, f.done.completion_tokens, f.cached_tokens),
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

/// What each SSE step of a stream has to go on with.
struct StreamState {
    s: AppState,
    st: Started,
    ended: bool,
    /// Written when the state is dropped: at the end, or when the client goes away.
    log: StreamLog,
}

/// Turns engine events into SSE events: `render(event)` maps one engine event to
/// zero or more SSE events (after the `head` events); the first `Done` or `Error` ends
/// the stream. Tokens and latencies go to the metrics at `Done`; one log line is written
/// when the stream ends or is dropped.
pub(crate) fn sse_stream<R>(
    s: AppState,
    st: Started,
    head: Vec<Event>,
    mut render: R,
) -> impl Stream<Item = Result<Event, Infallible>>
where
    R: FnMut(EngineEvent) -> Vec<Event> + Send + 'static,
{
    let head = stream::iter(head.into_iter().map(Ok));
    let body = stream::unfold(
        StreamState {
            log: StreamLog::new(&st),
            s,
            st,
            ended: false,
        },
        move |mut state| {
            let next = async move {
                if state.ended {
                    return None;
                }
                let ev = state.st.events.next().await;
                let ev = ev.unwrap_or_else(|| {
                    EngineEvent::Error(fak_engine::EngineError::Internal(
                        "the engine ended the stream without a result".into(),
                    ))
                });
                match &ev {
                    EngineEvent::Done(d) => {
                        state.s.metrics.add_tokens(
                            state.st.prompt_tokens,
                            d.completion_tokens,
                            state.st.cached_tokens,
                        );
                        state
                            .s
                            .metrics
                            .observe_latency(d.ttft_s, d.decode_s, d.completion_tokens);
                        state.ended = true;
                        state.log.completion = Some(d.completion_tokens);
                        state.log.outcome = "done";
                    }
                    EngineEvent::Error(_) => {
                        state.ended = true;
                        state.log.outcome = "engine error";
                    }
                    _ => {}
                }
                Some((ev, state))
            };
            next
        },
    );
    head.chain(body.flat_map(move |ev| stream::iter(render(ev).into_iter().map(Ok))))
}

pub(crate) fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

fn chat_stream(
    s: AppState,
    st: Started,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let (prompt, cached) = (st.prompt_tokens, st.cached_tokens);
    let chunk = move |delta: Value, finish: Value, usage_v: Option<Value>| {
        let mut v = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": "fak",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if include_usage {
            v["usage"] = usage_v.unwrap_or(Value::Null);
        }
        v
    };
    let head = vec![data(&chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
        None,
    ))];
    sse_stream(s, st, head, move |ev| match ev {
        EngineEvent::Text(t) => vec![data(&chunk(json!({"content": t}), Value::Null, None))],
        EngineEvent::Done(d) => {
            let mut out = vec![data(&chunk(
                json!({}),
                json!(finish_word(d.finish_reason)),
                None,
            ))];
            if include_usage {
                let mut u = chunk(
                    json!({}),
                    Value::Null,
                    Some(usage(prompt, d.completion_tokens, cached)),
                );
                u["choices"] = json!([]);
                out.push(data(&u));
            }
            out.push(Event::default().data("[DONE]"));
            out
        }
        EngineEvent::Error(e) => vec![
            data(&ApiError::from(e).with_flavor(F).body()),
            Event::default().data("[DONE]"),
        ],
        EngineEvent::Start { .. } => Vec::new(),
    })
}

/// `POST /v1/completions`: a plain prompt, no chat template.
pub(crate) async fn completions(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: CompletionRequest = parse_body(&s, body, F)?;
    check_n(r.n)?;
    if r.echo == Some(true) {
        return Err(unsupported("echo"));
    }
    if r.logprobs.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(unsupported("logprobs"));
    }
    if r.suffix.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(unsupported("suffix"));
    }
    let prompt = match r.prompt {
        PromptField::One(p) => p,
        PromptField::Many(mut v) if v.len() == 1 => v.remove(0),
        PromptField::Many(v) => {
            return Err(ApiError::bad_request(format!(
                "prompt holds {} strings; only one is supported",
                v.len()
            ))
            .with_flavor(F))
        }
    };
    let max_tokens = positive("max_tokens", r.max_tokens.unwrap_or(16), F)?;
    let req = GenerateRequest {
        model: Some(r.model.clone()),
        prompt: Prompt::Text(prompt),
        max_tokens: Some(max_tokens),
        sampling: sampling(r.temperature, r.top_p, r.seed),
        stop: stops(r.stop).map_err(|e| e.with_flavor(F))?,
    };
    let started = start(&s, req, F, "/v1/completions").await?;
    let id = new_id("cmpl-");
    let created = unix_now();
    let model = r.model;
    if r.stream == Some(true) {
        let include_usage = r.stream_options.and_then(|o| o.include_usage) == Some(true);
        let (prompt, cached) = (started.prompt_tokens, started.cached_tokens);
        let note = UsageNote {
            prompt,
            cached,
            stream: true,
            ..UsageNote::default()
        };
        let chunk = move |text: &str, finish: Value| {
            json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"text": text, "index": 0, "logprobs": null, "finish_reason": finish}],
            })
        };
        let st = sse_stream(s, started, Vec::new(), move |ev| match ev {
            EngineEvent::Text(t) => vec![data(&chunk(&t, Value::Null))],
            EngineEvent::Done(d) => {
                let mut out = vec![data(&chunk("", json!(finish_word(d.finish_reason))))];
                if include_usage {
                    let mut u = chunk("", Value::Null);
                    u["choices"] = json!([]);
                    u["usage"] = usage(prompt, d.completion_tokens, cached);
                    out.push(data(&u));
                }
                out.push(Event::default().data("[DONE]"));
                out
            }
            EngineEvent::Error(e) => vec![
                data(&ApiError::from(e).with_flavor(F).body()),
                Event::default().data("[DONE]"),
            ],
            EngineEvent::Start { .. } => Vec::new(),
        });
        return Ok(with_note(Sse::new(st).into_response(), note));
    }
    let f = finish(&s, started, F).await?;
    let body = json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{
            "text": f.text, "index": 0, "logprobs": null,
            "finish_reason": finish_word(f.done.finish_reason),
        }],
        "usage": usage(f.prompt_tokens, f.done.completion_tokens, f.cached_tokens),
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

/// `GET /v1/models`.
pub(crate) async fn models(State(s): State<AppState>) -> Json<Value> {
    let created = unix_now();
    let data: Vec<Value> = s
        .driver
        .models()
        .into_iter()
        .map(|m| {
            json!({
                "id": m.id, "object": "model", "created": created, "owned_by": m.owned_by,
                "context_length": m.context_length,
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}
