//! The OpenAI Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`,
//! `DELETE /v1/responses/{id}` (shapes: [`fak_wire::responses`]).
//!
//! A request becomes the engine's chat request, whatever the engine (the in-kernel
//! model, the mock, or an upstream, which is then spoken to in its chat API):
//! `instructions` is a first system message; `input` (a string: one user message; or
//! items) becomes messages in order: `message` items by role (`developer` / `system` →
//! system), `function_call` items as the preceding assistant message's `tool_calls`,
//! `function_call_output` items as `tool` messages, which pass the same screen as the
//! chat route's tool results; `reasoning` items are dropped. Function `tools` and
//! `tool_choice` map to the engine's; the model's calls are adjudicated by the policy as
//! on the other routes: allowed ones become `function_call` output items, denied ones are
//! removed, said in the message's text (a sentence per denied call after the text, the
//! Anthropic route's wording; streamed as a last `output_text.delta`) and listed with
//! their reasons in the Response's `fak` field.
//! `max_output_tokens` reached (or the end of the context window) ends the Response
//! `incomplete` with `incomplete_details.reason: "max_output_tokens"`.
//! `text.format` `json_schema` (what the SDK's `responses.parse(text_format=Model)` sends)
//! and `json_object` constrain the reply to the format on an engine that can, and are a
//! 400 on any other ([`crate::structured`]); a grammar's dead end also ends it
//! `incomplete` (`fak.finish_detail: "grammar_dead_end"`).
//!
//! **Streaming** sends the events the SDK parses, each with `event:` its `type` and a
//! `sequence_number`: `response.created`, `response.in_progress`; for text
//! `response.output_item.added` (the message), `response.content_part.added`,
//! `response.output_text.delta`…, then at the end `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done`; for each allowed call
//! (held until the reply is over and the calls are decided) `output_item.added`,
//! `function_call_arguments.delta` (the whole arguments), `.done`, `output_item.done`;
//! last `response.completed` / `response.incomplete` (the whole Response), or
//! `response.failed` (with `error`) when the engine fails mid-way.
//!
//! **Kept responses.** Unless `store: false`, each Response is kept with its whole
//! conversation (the messages the engine saw, tool results as screened, and the reply)
//! in a bounded in-memory map ([`MAX_KEPT_RESPONSES`], [`MAX_KEPT_BYTES`]; the oldest is
//! evicted first; one larger than the byte cap is not kept), partitioned as the KV
//! prefix cache is (API key and `cache_salt`, see `cache_partition`). A request with
//! `previous_response_id` continues that conversation: its messages are the new
//! `instructions` (not carried over, as the API documents), the kept conversation, then
//! its own items, so the engine's KV prefix cache prefills only the new items (see
//! `usage.input_tokens_details.cached_tokens`). An id that is unknown, evicted, deleted or
//! of another partition is a 400 `previous_response_not_found` (OpenAI's code, `param:
//! "previous_response_id"`). `GET` / `DELETE /v1/responses/{id}` (with `?cache_salt=`
//! when the response was made with one) return / forget a kept response; otherwise 404.
//! `GET` with `?stream=true` (the SDK's `retrieve(id, stream=True)`) replays the kept
//! Response as its stream of events (from `?starting_after=N` on, when given).
//!
//! **Checks** beyond the body's types, each a 400 in OpenAI's shape: no `model`
//! (`missing_required_parameter`), a `function_call_output` whose `call_id` answers no
//! earlier `function_call` of the conversation, and a path id that is
//! not valid percent-encoded UTF-8.

use crate::error::{ApiError, Flavor};
use crate::structured;
use crate::tools::{
    adjudicate, check_tool_name, check_tools, conversation_key, denial_suffix, fak_field,
    finish_detail, offered_tools, request_taint, screen_messages, Adjudicated,
};
use crate::{
    cache_partition, finish, new_id, parse_body, positive, start, unix_now, with_note, AppState,
    UsageNote,
};
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Uri};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::Json;
use fak_engine::{
    EngineEvent, FinishReason, GenerateRequest, Message, Prompt, SamplingParams, ToolCall,
    ToolChoice as EngineChoice, ToolSpec,
};
use fak_wire::responses::{
    ContentPart, CreateResponse, Deleted, FunctionCall, IncompleteDetails, Input, InputItem,
    ItemStatus, MessageContent, OutputItem, OutputMessage, OutputText, Response, ResponseError,
    ResponseObject, Role, StreamEvent, TextConfig, Tool, ToolChoice, Usage,
};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

const F: Flavor = Flavor::OpenAi;

/// Most responses kept for `previous_response_id` / `GET` (all partitions together).
pub const MAX_KEPT_RESPONSES: usize = 1024;

/// Most bytes the kept responses may hold together (their conversations' and
/// Responses' JSON sizes), 64 MiB.
pub const MAX_KEPT_BYTES: usize = 64 << 20;

/// One kept response.
struct Kept {
    /// The KV cache partition of the request that made it.
    partition: String,
    /// The Response as returned.
    response: Response,
    /// The conversation after it (instructions excluded): what a follow-up continues.
    conversation: Vec<Message>,
    /// Its size, bytes (for [`MAX_KEPT_BYTES`]).
    bytes: usize,
}

/// The kept responses: a map with a count and a byte cap, oldest evicted first.
pub(crate) struct ResponseStore {
    map: HashMap<String, Kept>,
    order: VecDeque<String>,
    bytes: usize,
    max_count: usize,
    max_bytes: usize,
}

impl Default for ResponseStore {
    fn default() -> Self {
        ResponseStore::new(MAX_KEPT_RESPONSES, MAX_KEPT_BYTES)
    }
}

impl ResponseStore {
    /// An empty store with these caps.
    pub(crate) fn new(max_count: usize, max_bytes: usize) -> Self {
        ResponseStore {
            map: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            max_count,
            max_bytes,
        }
    }

    fn insert(&mut self, id: String, kept: Kept) {
        if kept.bytes > self.max_bytes || self.max_count == 0 {
            return;
        }
        self.bytes += kept.bytes;
        if let Some(old) = self.map.insert(id.clone(), kept) {
            self.bytes -= old.bytes;
        } else {
            self.order.push_back(id);
        }
        while self.map.len() > self.max_count || self.bytes > self.max_bytes {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(k) = self.map.remove(&oldest) {
                self.bytes -= k.bytes;
            }
        }
    }

    fn get(&self, id: &str, partition: &str) -> Option<&Kept> {
        self.map.get(id).filter(|k| k.partition == partition)
    }

    fn remove(&mut self, id: &str, partition: &str) -> bool {
        if self.get(id, partition).is_none() {
            return false;
        }
        if let Some(k) = self.map.remove(id) {
            self.bytes -= k.bytes;
            self.order.retain(|o| o != id);
        }
        true
    }
}

/// The engine message `tool_calls` entry of an earlier call (OpenAI chat's, the shape
/// `fak_model::chat::Message::tool_calls` holds).
fn history_call(call_id: &str, name: &str, arguments: &str) -> serde_json::Value {
    serde_json::to_value(fak_wire::openai::ToolCall {
        id: call_id.to_string(),
        kind: fak_wire::openai::FunctionType::Function,
        function: fak_wire::openai::FunctionCall {
            name: name.to_string(),
            arguments: arguments.to_string(),
        },
    })
    .unwrap_or_default()
}

/// Appends a call to `messages`: to the last message when it is an assistant's, else as
/// a new assistant message without text.
fn push_call(messages: &mut Vec<Message>, call: serde_json::Value) {
    match messages.last_mut() {
        Some(m) if m.role == "assistant" => match &mut m.tool_calls {
            Some(serde_json::Value::Array(a)) => a.push(call),
            other => *other = Some(serde_json::Value::Array(vec![call])),
        },
        _ => messages.push(Message {
            tool_calls: Some(serde_json::Value::Array(vec![call])),
            ..Message::new("assistant", "")
        }),
    }
}

/// A message's or a tool output's text: the string, or its text parts joined.
fn content_text(c: MessageContent, at: &str) -> Result<String, ApiError> {
    match c {
        MessageContent::Text(t) => Ok(t),
        MessageContent::Parts(parts) => {
            let mut s = String::new();
            for (j, p) in parts.into_iter().enumerate() {
                match p {
                    ContentPart::Text(t) | ContentPart::Refusal(t) => s.push_str(&t),
                    ContentPart::Unsupported(k) => {
                        return Err(ApiError::bad_request(format!(
                            "{at}.content[{j}] has type '{k}'; only text parts are supported"
                        )))
                    }
                }
            }
            Ok(s)
        }
    }
}

/// `input` as engine messages, appended to `messages`.
fn push_input(messages: &mut Vec<Message>, input: Input) -> Result<(), ApiError> {
    let items = match input {
        Input::Text(t) => {
            messages.push(Message::new("user", &t));
            return Ok(());
        }
        Input::Items(items) => items,
    };
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("input[{i}]");
        match item {
            InputItem::Message(m) => {
                let role = match m.role {
                    Role::User => "user",
                    Role::System | Role::Developer => "system",
                    Role::Assistant => "assistant",
                };
                let text = content_text(m.content, &at)?;
                messages.push(Message::new(role, &text));
            }
            InputItem::FunctionCall(c) => {
                check_tool_name(&c.name, &format!("{at}.name"))?;
                push_call(messages, history_call(&c.call_id, &c.name, &c.arguments));
            }
            InputItem::FunctionCallOutput(o) => {
                let text = content_text(o.output, &format!("{at}.output"))?;
                messages.push(Message {
                    tool_call_id: Some(o.call_id),
                    ..Message::new("tool", &text)
                });
            }
            InputItem::Reasoning => {}
            InputItem::Unsupported(k) => {
                return Err(ApiError::bad_request(format!(
                    "{at} has type '{k}'; only message, function_call, function_call_output and reasoning items are supported"
                )))
            }
        }
    }
    Ok(())
}

/// Checks that each tool output of the conversation (the kept one of
/// `previous_response_id`, then the input items) answers a call made before it: a
/// `function_call_output` whose `call_id` no earlier `function_call` (of the input or of
/// a kept response) carries is a 400 naming it, as the API answers.
fn check_outputs(messages: &[Message]) -> Result<(), ApiError> {
    let mut calls = std::collections::HashSet::new();
    for m in messages {
        if let Some(list) = m.tool_calls.as_ref().and_then(serde_json::Value::as_array) {
            calls.extend(
                list.iter()
                    .filter_map(|c| c.get("id").and_then(serde_json::Value::as_str)),
            );
        }
        if let Some(id) = m.tool_call_id.as_deref() {
            if !calls.contains(id) {
                return Err(ApiError::bad_request(format!(
                    "No tool call found for function call output with call_id '{id}': no function_call item before it (in input, or in the previous_response_id's conversation) has that call_id."
                ))
                .with_flavor(F));
            }
        }
    }
    Ok(())
}

/// `tools` and `tool_choice` in the engine's terms, checked as the chat route checks
/// them.
fn engine_tools(
    tools: &[Tool],
    choice: &ToolChoice,
) -> Result<(Vec<ToolSpec>, EngineChoice), ApiError> {
    let mut specs = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let f = match t {
            Tool::Function(f) => f,
            Tool::Unsupported(k) => {
                return Err(ApiError::bad_request(format!(
                    "tools[{i}] has type '{k}'; only function tools are supported"
                )))
            }
        };
        check_tool_name(&f.name, &format!("tools[{i}].name"))?;
        let parameters = match &f.parameters {
            Some(p) => serde_json::Value::Object(p.clone()),
            None => no_parameters(),
        };
        specs.push(ToolSpec {
            name: f.name.clone(),
            description: f.description.clone(),
            parameters,
            strict: f.strict == Some(true),
        });
    }
    let choice = match choice {
        ToolChoice::None => EngineChoice::None,
        ToolChoice::Auto => EngineChoice::Auto,
        ToolChoice::Required => EngineChoice::Required,
        ToolChoice::Function(n) => EngineChoice::Named(n.clone()),
        ToolChoice::Unsupported(k) => {
            return Err(ApiError::bad_request(format!(
                "tool_choice '{k}' is not supported (only none, auto, required or {{\"type\": \"function\", \"name\": ...}})"
            )))
        }
    };
    check_tools(&specs, &choice)?;
    Ok((specs, choice))
}

/// The schema of a tool without parameters: an object with no properties.
fn no_parameters() -> serde_json::Value {
    let mut m = serde_json::Map::new();
    m.insert("type".into(), "object".into());
    m.insert("properties".into(), serde_json::Map::new().into());
    m.into()
}

/// What a request asks that fak does not serve, as a 400 naming it.
fn check_request(r: &CreateResponse) -> Result<(), ApiError> {
    if let Some((name, v)) = r.unsupported_field() {
        return Err(ApiError::bad_request(format!(
            "`{name}` is not supported (got {v})"
        )));
    }
    Ok(())
}

/// What a Response repeats of its request.
#[derive(Clone)]
struct Echo {
    id: String,
    created_at: u64,
    model: String,
    request: CreateResponse,
}

impl Echo {
    /// The Response with this request's echoed fields and `status`, no output yet.
    fn response(&self, status: ItemStatus) -> Response {
        let r = &self.request;
        Response {
            id: self.id.clone(),
            object: ResponseObject::Response,
            created_at: self.created_at,
            status,
            model: self.model.clone(),
            output: Vec::new(),
            usage: None,
            incomplete_details: None,
            error: None,
            instructions: r.instructions.clone(),
            max_output_tokens: r.max_output_tokens.map(|v| v.max(0) as u64),
            metadata: r.metadata.clone().unwrap_or_default(),
            parallel_tool_calls: r.parallel_tool_calls.unwrap_or(true),
            previous_response_id: r.previous_response_id.clone(),
            store: r.store != Some(false),
            temperature: r.temperature.unwrap_or(1.0),
            top_p: r.top_p.unwrap_or(1.0),
            tool_choice: r.tool_choice.clone().unwrap_or_default(),
            tools: r
                .tools
                .iter()
                .flatten()
                .filter_map(|t| match t {
                    Tool::Function(f) => Some(f.clone()),
                    Tool::Unsupported(_) => None,
                })
                .collect(),
            text: match &r.text {
                Some(t) if t.format.is_some() => t.clone(),
                Some(t) => TextConfig {
                    verbosity: t.verbosity.clone(),
                    ..TextConfig::plain()
                },
                None => TextConfig::plain(),
            },
            truncation: r.truncation.clone().unwrap_or_else(|| "disabled".into()),
            user: r.user.clone(),
            reasoning: r.reasoning.clone(),
            fak: None,
        }
    }
}

/// The finished Response: `text` (a message item when not empty, or when no call is
/// passed on), the allowed calls, the status from the finish reason.
fn finished_response(
    echo: &Echo,
    message_id: &str,
    text: &str,
    a: &Adjudicated,
    finish: FinishReason,
    usage: Usage,
    fak: Option<serde_json::Value>,
) -> Response {
    // A grammar's dead end is cut short of its format, as at max_output_tokens.
    let incomplete = matches!(finish, FinishReason::Length | FinishReason::GrammarDeadEnd);
    let status = if incomplete {
        ItemStatus::Incomplete
    } else {
        ItemStatus::Completed
    };
    let mut r = echo.response(status);
    if !text.is_empty() || a.allowed.is_empty() {
        r.output.push(OutputItem::Message(OutputMessage {
            id: message_id.to_string(),
            role: Role::Assistant,
            status,
            content: vec![OutputText::new(text)],
        }));
    }
    r.output.extend(
        a.allowed
            .iter()
            .map(|c| OutputItem::FunctionCall(output_call(c))),
    );
    r.usage = Some(usage);
    if incomplete {
        r.incomplete_details = Some(IncompleteDetails {
            reason: "max_output_tokens".into(),
        });
    }
    r.fak = finish_detail(fak, finish);
    r
}

/// An allowed call as a `function_call` output item.
fn output_call(c: &ToolCall) -> FunctionCall {
    FunctionCall {
        id: Some(format!("fc_{}", c.id.trim_start_matches("call_"))),
        call_id: c.id.clone(),
        name: c.name.clone(),
        arguments: c.arguments.clone(),
        status: Some(ItemStatus::Completed),
    }
}

/// What a finished request leaves to keep: the conversation the engine saw (minus the
/// instructions) and the reply with its allowed calls.
struct ToKeep {
    store: Option<Arc<Mutex<ResponseStore>>>,
    partition: String,
    /// The messages after the instructions, as the engine saw them.
    history: Vec<Message>,
}

impl ToKeep {
    fn keep(self, response: &Response, text: &str, a: &Adjudicated) {
        let Some(store) = self.store else { return };
        let mut conversation = self.history;
        conversation.push(Message::new("assistant", text));
        for c in &a.allowed {
            push_call(
                &mut conversation,
                history_call(&c.id, &c.name, &c.arguments),
            );
        }
        let bytes = serde_json::to_vec(&conversation).map_or(usize::MAX, |v| v.len())
            + serde_json::to_vec(response).map_or(usize::MAX, |v| v.len());
        let kept = Kept {
            partition: self.partition,
            response: response.clone(),
            conversation,
            bytes: bytes.min(usize::MAX / 2),
        };
        store
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(response.id.clone(), kept);
    }
}

/// `POST /v1/responses`.
pub(crate) async fn create(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<HttpResponse, ApiError> {
    let mut r: CreateResponse = parse_body(&s, body, F)?;
    let Some(model) = r.model.clone() else {
        return Err(
            ApiError::bad_request("Missing required parameter: 'model'.")
                .with_code("missing_required_parameter", "model")
                .with_flavor(F),
        );
    };
    check_request(&r).map_err(|e| e.with_flavor(F))?;
    crate::openai::check_temperature(r.temperature)?;
    let grammar = structured::enforced(
        &s,
        &model,
        "text.format",
        structured::text_format(r.text.as_ref().and_then(|t| t.format.as_ref())),
        F,
    )?;
    let (tools, tool_choice) = engine_tools(
        r.tools.as_deref().unwrap_or_default(),
        &r.tool_choice.clone().unwrap_or_default(),
    )
    .map_err(|e| e.with_flavor(F))?;
    let max_tokens = r
        .max_output_tokens
        .map(|v| positive("max_output_tokens", v, F))
        .transpose()?;
    // `truncation: "auto"` drops the oldest input items when the conversation
    // outgrows the window: fak's `rebuild` (exact); `"disabled"` refuses it.
    let context_overflow = match r.truncation.as_deref() {
        None => None,
        Some("auto") => Some(fak_engine::ContextOverflow::Rebuild),
        Some("disabled") => Some(fak_engine::ContextOverflow::Error),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "truncation must be \"auto\" or \"disabled\", not {other:?}"
            ))
            .with_code("invalid_value", "truncation")
            .with_flavor(F))
        }
    };
    let partition = cache_partition(&s, &headers, r.cache_salt.as_deref(), F)?;
    let mut history = Vec::new();
    if let Some(prev) = &r.previous_response_id {
        let store = s.responses.lock().unwrap_or_else(|p| p.into_inner());
        let kept = store.get(prev, &partition).ok_or_else(|| {
            ApiError::bad_request(format!("Previous response with id '{prev}' not found."))
                .with_code("previous_response_not_found", "previous_response_id")
                .with_flavor(F)
        })?;
        history = kept.conversation.clone();
    }
    let had_history = !history.is_empty();
    match r.input.take() {
        Some(input) => push_input(&mut history, input).map_err(|e| e.with_flavor(F))?,
        None if had_history => {}
        None => return Err(ApiError::bad_request("`input` is required").with_flavor(F)),
    }
    if history.is_empty() {
        return Err(ApiError::bad_request("`input` holds no items").with_flavor(F));
    }
    check_outputs(&history)?;
    let mut messages = Vec::with_capacity(history.len() + 1);
    if let Some(i) = &r.instructions {
        messages.push(Message::new("system", i));
    }
    let n_instructions = messages.len();
    messages.extend(history);
    let conversation = conversation_key(&headers, &messages);
    let taint = request_taint(&headers, &messages);
    let (messages, results) = screen_messages(&s, &conversation, messages, &[], F).await?;
    let req = GenerateRequest {
        model: r.model.clone(),
        prompt: Prompt::Chat(messages.clone()),
        max_tokens,
        sampling: SamplingParams {
            temperature: r.temperature.unwrap_or(1.0),
            top_p: r.top_p.unwrap_or(1.0),
            seed: s.seed(None),
            grammar,
            ..SamplingParams::default()
        },
        stop: Vec::new(),
        tools,
        tool_choice,
        logprobs: None,
        cache_partition: partition.clone(),
        raw: None,
        continue_final_message: false,
        cap_max_tokens: false,
        context_overflow,
    };
    let offered = offered_tools(&req);
    let started = start(&s, req, F, "/v1/responses").await?;
    let keep = ToKeep {
        store: (r.store != Some(false)).then(|| Arc::clone(&s.responses)),
        partition,
        history: messages[n_instructions..].to_vec(),
    };
    let stream = r.stream == Some(true);
    let echo = Echo {
        id: new_id("resp_"),
        created_at: unix_now(),
        model,
        request: r,
    };
    let message_id = new_id("msg_");
    if stream {
        let note = UsageNote {
            prompt: started.prompt_tokens,
            cached: started.cached_tokens,
            stream: true,
            ..UsageNote::default()
        };
        let mut w = StreamWriter {
            s: s.clone(),
            echo,
            message_id,
            seq: 0,
            text: String::new(),
            message_open: false,
            calls: Vec::new(),
            prompt: (started.prompt_tokens, started.cached_tokens),
            conversation,
            taint,
            offered,
            results,
            keep: Some(keep),
        };
        let head = vec![
            w.event(|sequence_number, r| StreamEvent::Created {
                response: Box::new(r),
                sequence_number,
            }),
            w.event(|sequence_number, r| StreamEvent::InProgress {
                response: Box::new(r),
                sequence_number,
            }),
        ];
        let events = crate::openai::sse_stream(s.clone(), started, head, move |ev| w.on(ev));
        let sse = crate::openai::sse_response(&s, events, crate::openai::keep_alive_comment());
        return Ok(with_note(sse, note));
    }
    let mut f = finish(&s, started, F).await?;
    let a = adjudicate(
        &s,
        &conversation,
        &taint,
        &offered,
        std::mem::take(&mut f.tool_calls),
    );
    f.text.push_str(&denial_suffix(f.text.is_empty(), &a));
    let response = finished_response(
        &echo,
        &message_id,
        &f.text,
        &a,
        f.done.finish_reason,
        Usage::new(f.prompt_tokens, f.cached_tokens, f.done.completion_tokens),
        fak_field(&results, &a),
    );
    keep.keep(&response, &f.text, &a);
    Ok(f.respond(serde_json::to_value(&response).unwrap_or_default()))
}

/// `*seq`, then one more.
fn bump(seq: &mut u64) -> u64 {
    *seq += 1;
    *seq - 1
}

/// The events of an allowed call's output item at `index`, numbered from `*seq` on:
/// `output_item.added` (no arguments yet), `function_call_arguments.delta` (the whole
/// arguments), `.done`, `output_item.done`.
fn call_events(c: &FunctionCall, index: usize, seq: &mut u64) -> Vec<StreamEvent> {
    let item_id = c.id.clone().unwrap_or_default();
    let mut next = || bump(seq);
    vec![
        StreamEvent::OutputItemAdded {
            item: OutputItem::FunctionCall(FunctionCall {
                arguments: String::new(),
                status: Some(ItemStatus::InProgress),
                ..c.clone()
            }),
            output_index: index,
            sequence_number: next(),
        },
        StreamEvent::FunctionCallArgumentsDelta {
            item_id: item_id.clone(),
            output_index: index,
            delta: c.arguments.clone(),
            sequence_number: next(),
        },
        StreamEvent::FunctionCallArgumentsDone {
            item_id,
            output_index: index,
            arguments: c.arguments.clone(),
            sequence_number: next(),
        },
        StreamEvent::OutputItemDone {
            item: OutputItem::FunctionCall(c.clone()),
            output_index: index,
            sequence_number: next(),
        },
    ]
}

/// A kept Response's whole stream, as `GET /v1/responses/{id}?stream=true` replays it:
/// the events a streamed request for it sent (`response.created`, `.in_progress`, each
/// output item's events with a message's text as one delta per part, then
/// `response.completed` / `.incomplete`), numbered from 0.
fn replay(r: &Response) -> Vec<StreamEvent> {
    let mut seq = 0u64;
    let in_progress = || {
        Box::new(Response {
            status: ItemStatus::InProgress,
            output: Vec::new(),
            usage: None,
            incomplete_details: None,
            ..r.clone()
        })
    };
    let mut out = vec![
        StreamEvent::Created {
            response: in_progress(),
            sequence_number: bump(&mut seq),
        },
        StreamEvent::InProgress {
            response: in_progress(),
            sequence_number: bump(&mut seq),
        },
    ];
    for (index, item) in r.output.iter().enumerate() {
        match item {
            OutputItem::Message(m) => {
                out.push(StreamEvent::OutputItemAdded {
                    item: OutputItem::Message(OutputMessage {
                        status: ItemStatus::InProgress,
                        content: Vec::new(),
                        ..m.clone()
                    }),
                    output_index: index,
                    sequence_number: bump(&mut seq),
                });
                for (j, part) in m.content.iter().enumerate() {
                    let item_id = m.id.clone();
                    out.push(StreamEvent::ContentPartAdded {
                        item_id: item_id.clone(),
                        output_index: index,
                        content_index: j,
                        part: OutputText::new(""),
                        sequence_number: bump(&mut seq),
                    });
                    if !part.text.is_empty() {
                        out.push(StreamEvent::OutputTextDelta {
                            item_id: item_id.clone(),
                            output_index: index,
                            content_index: j,
                            delta: part.text.clone(),
                            logprobs: Vec::new(),
                            sequence_number: bump(&mut seq),
                        });
                    }
                    out.push(StreamEvent::OutputTextDone {
                        item_id: item_id.clone(),
                        output_index: index,
                        content_index: j,
                        text: part.text.clone(),
                        logprobs: Vec::new(),
                        sequence_number: bump(&mut seq),
                    });
                    out.push(StreamEvent::ContentPartDone {
                        item_id,
                        output_index: index,
                        content_index: j,
                        part: part.clone(),
                        sequence_number: bump(&mut seq),
                    });
                }
                out.push(StreamEvent::OutputItemDone {
                    item: item.clone(),
                    output_index: index,
                    sequence_number: bump(&mut seq),
                });
            }
            OutputItem::FunctionCall(c) => {
                out.extend(call_events(c, index, &mut seq));
            }
        }
    }
    let response = Box::new(r.clone());
    out.push(if r.status == ItemStatus::Incomplete {
        StreamEvent::Incomplete {
            response,
            sequence_number: bump(&mut seq),
        }
    } else {
        StreamEvent::Completed {
            response,
            sequence_number: bump(&mut seq),
        }
    });
    out
}

/// The state of one streamed Response.
struct StreamWriter {
    s: AppState,
    echo: Echo,
    message_id: String,
    /// The next event's `sequence_number`.
    seq: u64,
    /// The text so far.
    text: String,
    /// Whether the message item (and its text part) was opened.
    message_open: bool,
    /// The proposed calls, held until the end.
    calls: Vec<ToolCall>,
    /// `Start`'s prompt and cached token counts.
    prompt: (usize, usize),
    conversation: String,
    taint: fak_engine::policy::Taint,
    offered: Vec<ToolSpec>,
    results: Vec<crate::tools::ResultReport>,
    keep: Option<ToKeep>,
}

/// One SSE event: `event:` its type, `data:` its JSON.
fn sse(ev: &StreamEvent) -> Event {
    // These types always serialize (string keys, finite numbers).
    Event::default()
        .event(ev.kind())
        .data(serde_json::to_string(ev).unwrap_or_default())
}

impl StreamWriter {
    /// The next event, built from its sequence number and the in-progress Response.
    fn event(&mut self, make: impl FnOnce(u64, Response) -> StreamEvent) -> Event {
        let r = self.echo.response(ItemStatus::InProgress);
        self.next(|n| make(n, r))
    }

    fn next(&mut self, make: impl FnOnce(u64) -> StreamEvent) -> Event {
        let e = make(self.seq);
        self.seq += 1;
        sse(&e)
    }

    fn message(&self, status: ItemStatus, text: Option<&str>) -> OutputItem {
        OutputItem::Message(OutputMessage {
            id: self.message_id.clone(),
            role: Role::Assistant,
            status,
            content: text.map(|t| vec![OutputText::new(t)]).unwrap_or_default(),
        })
    }

    /// Opens the message item and its text part.
    fn open_message(&mut self, out: &mut Vec<Event>) {
        if self.message_open {
            return;
        }
        self.message_open = true;
        let item = self.message(ItemStatus::InProgress, None);
        out.push(self.next(|sequence_number| StreamEvent::OutputItemAdded {
            item,
            output_index: 0,
            sequence_number,
        }));
        let item_id = self.message_id.clone();
        out.push(self.next(|sequence_number| StreamEvent::ContentPartAdded {
            item_id,
            output_index: 0,
            content_index: 0,
            part: OutputText::new(""),
            sequence_number,
        }));
    }

    fn on(&mut self, ev: EngineEvent) -> Vec<Event> {
        let mut out = Vec::new();
        match ev {
            EngineEvent::Text(t) => {
                self.open_message(&mut out);
                self.text.push_str(&t);
                let item_id = self.message_id.clone();
                out.push(self.next(|sequence_number| StreamEvent::OutputTextDelta {
                    item_id,
                    output_index: 0,
                    content_index: 0,
                    delta: t,
                    logprobs: Vec::new(),
                    sequence_number,
                }));
            }
            EngineEvent::ToolCall(c) => self.calls.push(c),
            EngineEvent::Done(d) => {
                let a = adjudicate(
                    &self.s,
                    &self.conversation,
                    &self.taint,
                    &self.offered,
                    std::mem::take(&mut self.calls),
                );
                let notes = denial_suffix(self.text.is_empty(), &a);
                if !notes.is_empty() {
                    out.extend(self.on(EngineEvent::Text(notes)));
                }
                let (prompt, cached) = crate::prompt_counts(&d, self.prompt.0, self.prompt.1);
                let response = finished_response(
                    &self.echo,
                    &self.message_id,
                    &self.text,
                    &a,
                    d.finish_reason,
                    Usage::new(prompt, cached, d.completion_tokens),
                    fak_field(&self.results, &a),
                );
                let mut index = 0;
                if let Some(OutputItem::Message(m)) = response.output.first() {
                    self.open_message(&mut out);
                    let (item_id, text) = (self.message_id.clone(), self.text.clone());
                    out.push(self.next(|sequence_number| StreamEvent::OutputTextDone {
                        item_id: item_id.clone(),
                        output_index: 0,
                        content_index: 0,
                        text: text.clone(),
                        logprobs: Vec::new(),
                        sequence_number,
                    }));
                    out.push(self.next(|sequence_number| StreamEvent::ContentPartDone {
                        item_id,
                        output_index: 0,
                        content_index: 0,
                        part: OutputText::new(text),
                        sequence_number,
                    }));
                    let item = OutputItem::Message(m.clone());
                    out.push(self.next(|sequence_number| StreamEvent::OutputItemDone {
                        item,
                        output_index: 0,
                        sequence_number,
                    }));
                    index = 1;
                }
                for item in &response.output[index..] {
                    let OutputItem::FunctionCall(c) = item else {
                        continue;
                    };
                    out.extend(call_events(c, index, &mut self.seq).iter().map(sse));
                    index += 1;
                }
                if let Some(k) = self.keep.take() {
                    k.keep(&response, &self.text, &a);
                }
                let incomplete = response.status == ItemStatus::Incomplete;
                let response = Box::new(response);
                out.push(self.next(|sequence_number| {
                    if incomplete {
                        StreamEvent::Incomplete {
                            response,
                            sequence_number,
                        }
                    } else {
                        StreamEvent::Completed {
                            response,
                            sequence_number,
                        }
                    }
                }));
            }
            EngineEvent::Error(e) => {
                let mut response = self.echo.response(ItemStatus::Failed);
                response.error = Some(ResponseError {
                    code: "server_error".into(),
                    message: ApiError::from(e).message,
                });
                out.push(self.next(|sequence_number| StreamEvent::Failed {
                    response: Box::new(response),
                    sequence_number,
                }));
            }
            EngineEvent::Start { .. } | EngineEvent::Logprobs(_) => {}
        }
        out
    }
}

/// A query parameter of `GET` / `DELETE /v1/responses/{id}` (`cache_salt`, `stream`,
/// `starting_after`), percent-decoded.
fn query_param(uri: &Uri, name: &str) -> Option<String> {
    let q = uri.query()?;
    let raw = q
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))?;
    let b = raw.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// The `cache_salt` query parameter.
fn query_salt(uri: &Uri) -> Option<String> {
    query_param(uri, "cache_salt")
}

/// The path's `{id}`, or a 400 in OpenAI's shape when it is not valid percent-encoded
/// UTF-8.
fn path_id(p: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    p.map(|Path(id)| id).map_err(|e| {
        ApiError::bad_request(format!("the response id in the path: {}", e.body_text()))
            .with_flavor(F)
    })
}

fn not_kept(id: &str) -> ApiError {
    ApiError::not_found(format!("Response with id '{id}' not found.")).with_flavor(F)
}

/// `GET /v1/responses/{id}`: a kept response (404 when not kept for this partition).
/// With `?stream=true` (the SDK's `responses.retrieve(id, stream=True)`) its events are
/// replayed as the stream of the request that made it would have sent them ([`replay`]),
/// those after `?starting_after=N` only when given; a `stream` other than `true` /
/// `false`, or a `starting_after` that is not a number, is a 400.
pub(crate) async fn retrieve(
    State(s): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    uri: Uri,
) -> Result<HttpResponse, ApiError> {
    let id = path_id(id)?;
    let partition = cache_partition(&s, &headers, query_salt(&uri).as_deref(), F)?;
    let stream = match query_param(&uri, "stream").as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(v) => {
            return Err(
                ApiError::bad_request(format!("stream must be true or false (got '{v}')"))
                    .with_flavor(F),
            )
        }
    };
    let after = match query_param(&uri, "starting_after") {
        None => None,
        Some(v) => Some(v.parse::<u64>().map_err(|_| {
            ApiError::bad_request(format!(
                "starting_after must be a sequence number, an integer from 0 (got '{v}')"
            ))
            .with_flavor(F)
        })?),
    };
    let response = {
        let store = s.responses.lock().unwrap_or_else(|p| p.into_inner());
        store
            .get(&id, &partition)
            .map(|k| k.response.clone())
            .ok_or_else(|| not_kept(&id))?
    };
    if !stream {
        return Ok(Json(response).into_response());
    }
    let events: Vec<Result<Event, std::convert::Infallible>> = replay(&response)
        .iter()
        .enumerate()
        .filter(|(n, _)| after.is_none_or(|a| *n as u64 > a))
        .map(|(_, e)| Ok(sse(e)))
        .collect();
    Ok(Sse::new(futures_util::stream::iter(events)).into_response())
}

/// `DELETE /v1/responses/{id}`: forgets a kept response (404 when not kept for this
/// partition).
pub(crate) async fn delete(
    State(s): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    uri: Uri,
) -> Result<Json<Deleted>, ApiError> {
    let id = path_id(id)?;
    let partition = cache_partition(&s, &headers, query_salt(&uri).as_deref(), F)?;
    let removed = s
        .responses
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&id, &partition);
    if !removed {
        return Err(not_kept(&id));
    }
    Ok(Json(Deleted {
        id,
        object: ResponseObject::Response,
        deleted: true,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(partition: &str, bytes: usize) -> Kept {
        Kept {
            partition: partition.into(),
            response: Echo {
                id: "r".into(),
                created_at: 0,
                model: "m".into(),
                request: CreateResponse::default(),
            }
            .response(ItemStatus::Completed),
            conversation: Vec::new(),
            bytes,
        }
    }

    #[test]
    fn the_store_evicts_the_oldest_by_count_and_bytes_and_keeps_partitions_apart() {
        let mut st = ResponseStore::new(2, 100);
        st.insert("a".into(), kept("p", 10));
        st.insert("b".into(), kept("p", 10));
        st.insert("c".into(), kept("p", 10));
        assert!(st.get("a", "p").is_none(), "count cap: the oldest goes");
        assert!(st.get("b", "p").is_some() && st.get("c", "p").is_some());
        assert!(st.get("b", "q").is_none(), "another partition sees nothing");
        st.insert("d".into(), kept("p", 85));
        assert!(st.get("b", "p").is_none(), "byte cap: the oldest goes");
        assert!(st.get("c", "p").is_some() && st.get("d", "p").is_some());
        assert_eq!((st.map.len(), st.bytes), (2, 95));
        st.insert("e".into(), kept("p", 101));
        assert!(st.get("e", "p").is_none(), "larger than the cap: not kept");
        assert_eq!(st.map.len(), 2);
        assert!(!st.remove("d", "q"));
        assert!(st.remove("d", "p"));
        assert_eq!((st.map.len(), st.bytes, st.order.len()), (1, 10, 1));
    }

    #[test]
    fn the_salt_query_is_percent_decoded() {
        let u: Uri = "/v1/responses/x?a=1&cache_salt=s%20a+lt%2".parse().unwrap();
        assert_eq!(query_salt(&u).as_deref(), Some("s a lt%2"));
        let u: Uri = "/v1/responses/x".parse().unwrap();
        assert_eq!(query_salt(&u), None);
    }
}
