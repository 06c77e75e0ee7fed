//! OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`.
//!
//! Request fields follow the OpenAI API reference. Supported now: `model`, `messages`
//! (roles `system`/`developer`/`user`/`assistant`/`tool`, content a string or an array
//! of `text` parts), `max_tokens`/`max_completion_tokens` (at least 1; default: the rest
//! of the context window), `temperature` (default 1), `top_p`, `seed`, `stop` (string or
//! list), `stream`, `stream_options.include_usage`, `n` (1 only), `tools` (functions)
//! and `tool_choice` (`none`, `auto`, `required`, or a named function), assistant
//! `tool_calls` and `tool` results in the history, `logprobs` and `top_logprobs`.
//! Legacy `/v1/completions` takes `logprobs: N`. Not yet: `response_format` other than
//! `text`; `logit_bias`, `frequency_penalty`, `presence_penalty` and `best_of` other than
//! their neutral values (empty, 0, 1); the deprecated `functions` / `function_call`; and
//! on `/v1/completions` `echo` and `suffix`: each is a 400 naming the field, never
//! silently ignored.
//!
//! **Logprobs.** `logprobs: true` (with `top_logprobs` 0..=20, default 0; outside that
//! range, or `top_logprobs` without `logprobs: true`, is a 400) returns
//! `choices[0].logprobs.content`: one `{token, logprob, bytes, top_logprobs: [{token,
//! logprob, bytes}, ...]}` per generated token, `top_logprobs` highest first. `logprob`
//! is the natural log of the token's probability under the model's raw logits, before
//! temperature / top-p (`fak_kv::logprobs`: `(z_i - max z) - ln Σ_j exp(z_j - max z)`,
//! in f64), so at temperature 0 the chosen token has its position's highest logprob.
//! `bytes` are the token's exact bytes and `token` their text (U+FFFD for part of a
//! UTF-8 character). Listed: every generated token except a final stop token
//! (`<|im_end|>`, EOS: not part of the content, as OpenAI and vLLM do) and tokens wholly
//! inside a matched stop string; a token that straddles a stop string is listed. When
//! streaming, each content chunk carries the entries of the tokens whose last byte it
//! releases (a token held back by the stop-string check or an unfinished UTF-8
//! character goes with the chunk that finally releases it); entries not yet sent by the
//! end (tokens that became a tool call, or released no text) come on the chunk with the
//! `finish_reason`. So the chunks' entries, concatenated, equal the non-streamed list.
//! `/v1/completions` with `logprobs: N` (0..=20) gives the legacy shape `{tokens,
//! token_logprobs, top_logprobs: [{token: logprob}] (the N best plus the chosen one),
//! text_offset}`, offsets in characters from the start of the completion text.
//!
//! Tool calls the model proposes are adjudicated (the `tools` module) before the client
//! sees them: allowed ones come back as `message.tool_calls` (arguments as a JSON string,
//! `finish_reason: "tool_calls"`), denied ones are removed, and the `fak` field of the
//! response (of the last chunk, when streaming) lists every proposed call's verdict. A
//! stream sends text as it comes but holds tool calls until the reply is over and the
//! whole set is decided.

use crate::error::{ApiError, Flavor};
use crate::tools::{
    adjudicate, check_tool_name, check_tools, conversation_key, fak_field, offered_tools,
    request_taint, screen_messages, Adjudicated,
};
use crate::{
    cache_partition, finish, new_id, parse_body, positive, prompt_counts, start, unix_now,
    with_note, AppState, Started, StreamLog, UsageNote,
};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use fak_engine::{
    EngineEvent, FinishReason, GenerateRequest, Message, Prompt, SamplingParams, TokenLogprob,
    ToolCall, ToolChoice, ToolSpec, TopLogprob, MAX_TOP_LOGPROBS,
};
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
    #[allow(dead_code)] // accepted; several calls per reply are always allowed
    parallel_tool_calls: Option<bool>,
    logprobs: Option<bool>,
    top_logprobs: Option<Value>,
    response_format: Option<Value>,
    #[serde(flatten)]
    inert: Inert,
    functions: Option<Value>,
    function_call: Option<Value>,
    /// vLLM's prefix-cache salt: only requests with the same salt (and API key) share
    /// a cached prefix.
    cache_salt: Option<String>,
}

/// Sampling controls fak does not implement. Each is accepted only at the value that
/// changes nothing (`null`, a penalty of 0, an empty `logit_bias`, `best_of` 1: what a
/// client sends when it spells out OpenAI's defaults); any other value is a 400 naming
/// the field ([`Inert::check`]), never a reply sampled as if it were absent.
#[derive(Deserialize)]
struct Inert {
    logit_bias: Option<Value>,
    frequency_penalty: Option<Value>,
    presence_penalty: Option<Value>,
    best_of: Option<Value>,
}

/// Whether a field's value is the one that changes nothing.
type Neutral<'a> = &'a dyn Fn(&Value) -> bool;

impl Inert {
    fn check(&self) -> Result<(), ApiError> {
        let empty = |v: &Value| v.as_object().is_some_and(|m| m.is_empty());
        let zero = |v: &Value| v.as_f64() == Some(0.0);
        let one = |v: &Value| v.as_u64() == Some(1);
        let fields: [(&str, &Option<Value>, Neutral); 4] = [
            ("logit_bias", &self.logit_bias, &empty),
            ("frequency_penalty", &self.frequency_penalty, &zero),
            ("presence_penalty", &self.presence_penalty, &zero),
            ("best_of", &self.best_of, &one),
        ];
        for (name, v, neutral) in fields {
            match v {
                None | Some(Value::Null) => {}
                Some(v) if neutral(v) => {}
                Some(v) => {
                    return Err(ApiError::bad_request(format!(
                        "`{name}` is not supported yet (only its neutral value; got {v})"
                    ))
                    .with_flavor(F))
                }
            }
        }
        Ok(())
    }
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
    /// As [`ChatRequest::cache_salt`].
    cache_salt: Option<String>,
    #[serde(flatten)]
    inert: Inert,
}

/// A count field in 0..=[`MAX_TOP_LOGPROBS`] (`null` is `None`).
fn top_count(name: &str, v: Option<&Value>) -> Result<Option<usize>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n as usize <= MAX_TOP_LOGPROBS => Ok(Some(n as usize)),
            _ => Err(ApiError::bad_request(format!(
                "{name} must be an integer in 0..={MAX_TOP_LOGPROBS} (got {v})"
            ))
            .with_flavor(F)),
        },
    }
}

/// A chat request's `logprobs` / `top_logprobs` as the engine's top-n: `None` when
/// logprobs are off.
fn chat_logprobs(logprobs: Option<bool>, top: Option<&Value>) -> Result<Option<usize>, ApiError> {
    let top = top_count("top_logprobs", top)?;
    match (logprobs == Some(true), top) {
        (true, n) => Ok(Some(n.unwrap_or(0))),
        (false, None) => Ok(None),
        (false, Some(_)) => {
            Err(ApiError::bad_request("top_logprobs requires logprobs: true").with_flavor(F))
        }
    }
}

/// A token's bytes as the JSON array of numbers OpenAI sends.
fn bytes_json(b: &[u8]) -> Value {
    Value::Array(b.iter().map(|&x| json!(x)).collect())
}

/// One chat `logprobs.content` entry.
fn lp_entry(r: &TokenLogprob) -> Value {
    let top: Vec<Value> = r
        .top
        .iter()
        .map(|t: &TopLogprob| json!({"token": t.text(), "logprob": t.logprob, "bytes": bytes_json(&t.bytes)}))
        .collect();
    json!({"token": r.text(), "logprob": r.logprob, "bytes": bytes_json(&r.bytes), "top_logprobs": top})
}

/// A chat choice's `logprobs` object for `records`.
fn chat_lp(records: &[TokenLogprob]) -> Value {
    json!({"content": records.iter().map(lp_entry).collect::<Vec<_>>(), "refusal": null})
}

/// A legacy completion choice's `logprobs` object for `records`; `offset` is the
/// character offset of the first one in the completion text, advanced past them.
fn legacy_lp(records: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut tokens = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for r in records {
        let text = r.text();
        let mut top = serde_json::Map::new();
        for t in &r.top {
            top.insert(t.text(), json!(t.logprob));
        }
        top.entry(text.clone()).or_insert(json!(r.logprob));
        offsets.push(*offset);
        *offset += text.chars().count();
        tokens.push(json!(text));
        lps.push(json!(r.logprob));
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
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

/// `tools` and `tool_choice` of a chat request.
fn parse_tools(
    tools: Option<Value>,
    choice: Option<Value>,
) -> Result<(Vec<ToolSpec>, ToolChoice), ApiError> {
    let list = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::bad_request("tools must be an array")),
    };
    let mut specs = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::bad_request(format!(
                "tools[{i}].type must be 'function'"
            )));
        }
        let f = t
            .get("function")
            .ok_or_else(|| ApiError::bad_request(format!("tools[{i}] has no `function`")))?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad_request(format!("tools[{i}].function has no string `name`"))
        })?;
        check_tool_name(name, &format!("tools[{i}].function.name"))?;
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(ApiError::bad_request(format!(
                    "tools[{i}].function.parameters must be a JSON Schema object"
                )))
            }
        };
        specs.push(ToolSpec {
            name: name.to_string(),
            description: f
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_string),
            parameters,
        });
    }
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(w)) => match w.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::bad_request(format!(
                    "tool_choice '{other}' is not one of none, auto, required, or a function"
                )))
            }
        },
        Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(n) if v.get("type").and_then(Value::as_str) == Some("function") => {
                ToolChoice::Named(n.to_string())
            }
            _ => {
                return Err(ApiError::bad_request(
                    "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
    };
    check_tools(&specs, &choice)?;
    Ok((specs, choice))
}

/// Checks an assistant message's `tool_calls`: an array of
/// `{id, type: "function", function: {name, arguments}}` with `arguments` a string.
fn check_history_calls(v: &Value, i: usize) -> Result<(), ApiError> {
    let Some(a) = v.as_array() else {
        return Err(ApiError::bad_request(format!(
            "messages[{i}].tool_calls must be an array"
        )));
    };
    for (j, c) in a.iter().enumerate() {
        let ok = c.pointer("/function/name").is_some_and(Value::is_string)
            && c.pointer("/function/arguments")
                .is_some_and(Value::is_string);
        if !ok {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].tool_calls[{j}] needs function.name and function.arguments (a string)"
            )));
        }
    }
    Ok(())
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
            let tool_calls = match m.tool_calls {
                None | Some(Value::Null) => None,
                Some(v) if role == "assistant" => {
                    check_history_calls(&v, i)?;
                    Some(v)
                }
                Some(_) => {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}] has tool_calls but is not an assistant message"
                    )))
                }
            };
            Ok(Message {
                role,
                content,
                tool_calls,
                tool_call_id: m.tool_call_id,
                name: m.name,
            })
        })
        .collect()
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: ChatRequest = parse_body(&s, body, F)?;
    check_n(r.n)?;
    let (tools, tool_choice) = parse_tools(r.tools, r.tool_choice).map_err(|e| e.with_flavor(F))?;
    let logprobs = chat_logprobs(r.logprobs, r.top_logprobs.as_ref())?;
    r.inert.check()?;
    for (name, v) in [
        ("functions", &r.functions),
        ("function_call", &r.function_call),
    ] {
        if v.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::bad_request(format!(
                "`{name}` (the deprecated function-calling form) is not supported; use `tools` and `tool_choice`"
            ))
            .with_flavor(F));
        }
    }
    match &r.response_format {
        None | Some(Value::Null) => {}
        Some(rf) => {
            match rf.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some(_) => return Err(unsupported("response_format")),
                None => return Err(ApiError::bad_request(
                    "response_format must be an object with a `type` (only \"text\" is supported)",
                )
                .with_flavor(F)),
            }
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
    let messages = to_messages(r.messages).map_err(|e| e.with_flavor(F))?;
    let conversation = conversation_key(&headers, &messages);
    let taint = request_taint(&headers, &messages);
    let (messages, results) = screen_messages(&s, &conversation, messages, F).await?;
    let req = GenerateRequest {
        model: Some(r.model.clone()),
        prompt: Prompt::Chat(messages),
        max_tokens,
        sampling: sampling(r.temperature, r.top_p, r.seed),
        stop: stops(r.stop).map_err(|e| e.with_flavor(F))?,
        tools,
        tool_choice,
        logprobs,
        cache_partition: cache_partition(&s, &headers, r.cache_salt.as_deref(), F)?,
        raw: None,
    };
    // Calls may only be of tools the model was offered (none when `tool_choice` is
    // `none`): anything else it writes is denied UNKNOWN_TOOL.
    let offered = offered_tools(&req);
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
        let calls = CallCheck {
            conversation,
            taint,
            offered,
            results,
        };
        let sse = Sse::new(chat_stream(
            s,
            started,
            ChunkHead {
                id,
                created,
                model: r.model,
                include_usage,
                logprobs: logprobs.is_some(),
            },
            calls,
        ));
        return Ok(with_note(sse.into_response(), note));
    }
    let mut f = finish(&s, started, F).await?;
    let a = adjudicate(
        &s,
        &conversation,
        &taint,
        &offered,
        std::mem::take(&mut f.tool_calls),
    );
    let mut message = json!({"role": "assistant", "content": f.text, "refusal": null});
    if !a.allowed.is_empty() {
        message["tool_calls"] = Value::Array(a.allowed.iter().map(call_json).collect());
        if f.text.is_empty() {
            message["content"] = Value::Null;
        }
    }
    let mut body = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": r.model,
        "system_fingerprint": "fak",
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": if logprobs.is_some() { chat_lp(&f.logprobs) } else { Value::Null },
            "finish_reason": finish_for(&f.done, &a),
        }],
        "usage": usage(f.prompt_tokens, f.done.completion_tokens, f.cached_tokens),
    });
    if let Some(v) = fak_field(&results, &a) {
        body["fak"] = v;
    }
    Ok(f.respond(body))
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
                        let (prompt, cached) =
                            prompt_counts(d, state.st.prompt_tokens, state.st.cached_tokens);
                        state
                            .s
                            .metrics
                            .add_tokens(prompt, d.completion_tokens, cached);
                        (state.log.prompt, state.log.cached) = (prompt, cached);
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

/// What a stream needs to adjudicate its calls at the end.
struct CallCheck {
    conversation: String,
    /// The request's taint (a tool result in its history).
    taint: fak_engine::policy::Taint,
    offered: Vec<ToolSpec>,
    /// The `fak.tool_results` entries of the request's screening.
    results: Vec<Value>,
}

/// An allowed call in OpenAI's shape.
fn call_json(c: &ToolCall) -> Value {
    json!({"id": c.id, "type": "function",
           "function": {"name": c.name, "arguments": c.arguments}})
}

/// `tool_calls` when a call is passed on, else the generation's own ending.
fn finish_for(d: &fak_engine::Done, a: &Adjudicated) -> &'static str {
    if a.allowed.is_empty() {
        finish_word(d.finish_reason)
    } else {
        "tool_calls"
    }
}

/// What every chunk of a chat stream repeats, and what the stream reports.
struct ChunkHead {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Whether chunks carry `logprobs.content`.
    logprobs: bool,
}

fn chat_stream(
    s: AppState,
    st: Started,
    head: ChunkHead,
    check: CallCheck,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let (prompt, cached) = (st.prompt_tokens, st.cached_tokens);
    let state = s.clone();
    let mut held: Vec<ToolCall> = Vec::new();
    let mut held_lp: Vec<TokenLogprob> = Vec::new();
    let ChunkHead {
        id,
        created,
        model,
        include_usage,
        logprobs,
    } = head;
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
        EngineEvent::Text(t) => {
            let mut v = chunk(json!({"content": t}), Value::Null, None);
            if logprobs {
                v["choices"][0]["logprobs"] = chat_lp(&std::mem::take(&mut held_lp));
            }
            vec![data(&v)]
        }
        EngineEvent::Logprobs(r) => {
            held_lp.extend(r);
            Vec::new()
        }
        EngineEvent::ToolCall(c) => {
            held.push(c);
            Vec::new()
        }
        EngineEvent::Done(d) => {
            let a = adjudicate(
                &state,
                &check.conversation,
                &check.taint,
                &check.offered,
                std::mem::take(&mut held),
            );
            let mut out: Vec<Event> = a
                .allowed
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let mut v = call_json(c);
                    v["index"] = json!(i);
                    data(&chunk(json!({"tool_calls": [v]}), Value::Null, None))
                })
                .collect();
            let mut last = chunk(json!({}), json!(finish_for(&d, &a)), None);
            if logprobs && !held_lp.is_empty() {
                last["choices"][0]["logprobs"] = chat_lp(&std::mem::take(&mut held_lp));
            }
            if let Some(v) = fak_field(&check.results, &a) {
                last["fak"] = v;
            }
            out.push(data(&last));
            if include_usage {
                let (prompt, cached) = prompt_counts(&d, prompt, cached);
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
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: CompletionRequest = parse_body(&s, body, F)?;
    check_n(r.n)?;
    r.inert.check()?;
    if r.echo == Some(true) {
        return Err(unsupported("echo"));
    }
    let logprobs = top_count("logprobs", r.logprobs.as_ref())?;
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
        tools: Vec::new(),
        tool_choice: ToolChoice::None,
        logprobs,
        cache_partition: cache_partition(&s, &headers, r.cache_salt.as_deref(), F)?,
        raw: None,
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
        let mut held_lp: Vec<TokenLogprob> = Vec::new();
        let mut offset = 0usize;
        let mut lp =
            move |held: &mut Vec<TokenLogprob>| legacy_lp(&std::mem::take(held), &mut offset);
        let st = sse_stream(s, started, Vec::new(), move |ev| match ev {
            EngineEvent::Text(t) => {
                let mut v = chunk(&t, Value::Null);
                if logprobs.is_some() {
                    v["choices"][0]["logprobs"] = lp(&mut held_lp);
                }
                vec![data(&v)]
            }
            EngineEvent::Logprobs(r) => {
                held_lp.extend(r);
                Vec::new()
            }
            EngineEvent::Done(d) => {
                let mut last = chunk("", json!(finish_word(d.finish_reason)));
                if logprobs.is_some() && !held_lp.is_empty() {
                    last["choices"][0]["logprobs"] = lp(&mut held_lp);
                }
                let mut out = vec![data(&last)];
                if include_usage {
                    let (prompt, cached) = prompt_counts(&d, prompt, cached);
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
            EngineEvent::Start { .. } | EngineEvent::ToolCall(_) => Vec::new(),
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
            "text": f.text, "index": 0,
            "logprobs": if logprobs.is_some() { legacy_lp(&f.logprobs, &mut 0) } else { Value::Null },
            "finish_reason": finish_word(f.done.finish_reason),
        }],
        "usage": usage(f.prompt_tokens, f.done.completion_tokens, f.cached_tokens),
    });
    Ok(f.respond(body))
}
