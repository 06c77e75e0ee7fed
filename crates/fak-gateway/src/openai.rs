//! OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`.
//!
//! Requests are parsed into, and replies and stream chunks written from, the types of
//! [`fak_wire::openai`] (which follow the `openai` Python SDK); a body that does not
//! parse is a 400 naming the field at fault ([`crate::extract`]). Supported: `model`,
//! `messages` (roles `system`/`developer`/`user`/`assistant`/`tool`, content a string or
//! an array of `text` parts), `max_tokens`/`max_completion_tokens` (at least 1; default:
//! the rest of the context window), `temperature` (default 1; 0 to 2, the API's range,
//! past it a 400), `top_p`, `seed`, `stop`
//! (string or list), `stream`, `stream_options.include_usage`, `n` (see below), `tools`
//! (functions) and `tool_choice` (`none`, `auto`, `required`, or a named function),
//! assistant `tool_calls` and `tool` results in the history, `logprobs` and
//! `top_logprobs`. `/v1/completions` takes `prompt` as a string, a list of strings, a
//! list of token ids or a list of lists of token ids (at most [`MAX_PROMPTS`]
//! prompts): token ids are prefilled as they are (no BOS, so control tokens can be
//! sent; an id outside the vocabulary is a 400 naming it), and each prompt of a list is
//! answered by the choice whose `index` is its position, `usage` summing them all. It
//! takes the legacy `logprobs: N`. Fields accepted and not acted on are listed in
//! [`fak_wire::openai::Ignored`]; sampling controls accepted only at their neutral value
//! in [`fak_wire::openai::NeutralOnly`]; `response_format` `json_object` and
//! `json_schema` constrain the reply's tokens to the schema on an engine that can
//! (the in-kernel one; [`fak_kv::grammar`]) and are a 400 on any other, on both
//! routes (`/v1/completions` takes `response_format` as vLLM does), as is the
//! `grammar` field (llguidance's Lark syntax; GBNF is a 400) ([`crate::structured`]);
//! a grammar's dead end finishes the choice `length` with
//! `fak.finish_detail: "grammar_dead_end"` and `fak.grammar_error` (why);
//! `modalities` other than `["text"]`, the fields of
//! [`fak_wire::openai::Unimplemented`] (the deprecated `functions` / `function_call`,
//! `audio`, ...) and on `/v1/completions` `echo` and `suffix` are each a 400 naming the
//! field, never silently ignored.
//!
//! **Choices (`n`).** `n` in 1..=[`MAX_CHOICES`] (default 1; outside it a 400 naming the
//! bound) gives `n` choices with `index` 0..n-1 (on `/v1/completions` with a list of
//! prompts, prompt `p`'s choice `i` has `index` `p * n + i`, at most [`MAX_PROMPTS`]
//! choices in all), from one prefilled prompt on the in-kernel engine
//! ([`fak_engine::EngineDriver::submit_n`]). Choice `i` samples with
//! [`fak_engine::choice_seed`]`(seed, i)`, so choice 0 is the `n = 1` reply with the same
//! seed. Each choice has its own stop strings, grammar (`response_format`, `grammar`,
//! a forced tool call), logprobs and tool calls, adjudicated choice by choice; with
//! `n > 1` each `fak.tool_calls` entry names its `choice`, and a choice's grammar dead
//! end is told in its own `choices[i].fak`. `usage` counts the prompt once and sums the
//! completions. Streamed, the choices' chunks interleave (as their tokens come), each
//! chunk with its choice's `index`; each choice has its own first (role) chunk and last
//! chunk (`finish_reason`, its `fak`), and the usage chunk comes once after them all.
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
//! `finish_reason: "tool_calls"`), denied ones are removed and the reply's text says
//! why (a sentence per denied call after the text, the Anthropic route's wording; when
//! streaming, one content chunk before the last), and the `fak` field of the
//! response (of the last chunk, when streaming) lists every proposed call's verdict. A
//! stream sends text as it comes but holds tool calls until the reply is over and the
//! whole set is decided.

use crate::error::{ApiError, Flavor};
use crate::extract::{OpenAiJson, WireJson};
use crate::structured;
use crate::tools::{
    adjudicate, check_tool_name, check_tools, conversation_key, denial_suffix, fak_field,
    offered_tools, request_taint, screen_messages, Adjudicated,
};
use crate::{
    cache_partition, finish, metered, new_id, positive, prompt_counts, start_n, unix_now,
    with_note, AppState, Started, StreamLog, UsageNote,
};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use fak_engine::{
    EngineEvent, FinishReason, GenerateRequest, GrammarSpec, Message, Prompt, SamplingParams,
    TokenLogprob, ToolCall, ToolChoice, ToolSpec, MAX_CHOICES, MAX_TOP_LOGPROBS,
};
use fak_wire::openai as wire;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::Value;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

const F: Flavor = Flavor::OpenAi;

/// The fingerprint every reply carries.
const FINGERPRINT: &str = "fak";

/// Most prompts one `/v1/completions` request may list.
pub(crate) const MAX_PROMPTS: usize = 64;

/// A wire refusal as a 400 in OpenAI's shape.
fn refused(r: wire::Refused) -> ApiError {
    ApiError::bad_request(r.message).with_flavor(F)
}

/// A count field in 0..=[`MAX_TOP_LOGPROBS`].
fn top_count(name: &str, v: Option<i64>) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) => match usize::try_from(n) {
            Ok(n) if n <= MAX_TOP_LOGPROBS => Ok(Some(n)),
            _ => Err(ApiError::bad_request(format!(
                "{name} must be an integer in 0..={MAX_TOP_LOGPROBS} (got {n})"
            ))
            .with_flavor(F)),
        },
    }
}

/// A chat request's `logprobs` / `top_logprobs` as the engine's top-n: `None` when
/// logprobs are off.
fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    let top = top_count("top_logprobs", top)?;
    match (logprobs == Some(true), top) {
        (true, n) => Ok(Some(n.unwrap_or(0))),
        (false, None) => Ok(None),
        (false, Some(_)) => {
            Err(ApiError::bad_request("top_logprobs requires logprobs: true").with_flavor(F))
        }
    }
}

/// One chat `logprobs.content` entry.
fn lp_entry(r: &TokenLogprob) -> wire::TokenLogprob {
    wire::TokenLogprob {
        token: r.text(),
        logprob: r.logprob,
        bytes: Some(r.bytes.clone()),
        top_logprobs: r
            .top
            .iter()
            .map(|t| wire::TopLogprob {
                token: t.text(),
                logprob: t.logprob,
                bytes: Some(t.bytes.clone()),
            })
            .collect(),
    }
}

/// A chat choice's `logprobs` object for `records`.
fn chat_lp(records: &[TokenLogprob]) -> wire::ChoiceLogprobs {
    wire::ChoiceLogprobs {
        content: Some(records.iter().map(lp_entry).collect()),
        refusal: None,
    }
}

/// A legacy completion choice's `logprobs` object for `records`; `offset` is the
/// character offset of the first one in the completion text, advanced past them.
fn legacy_lp(records: &[TokenLogprob], offset: &mut usize) -> wire::CompletionLogprobs {
    let mut lp = wire::CompletionLogprobs::default();
    for r in records {
        let text = r.text();
        let mut top: std::collections::BTreeMap<String, f64> =
            r.top.iter().map(|t| (t.text(), t.logprob)).collect();
        top.entry(text.clone()).or_insert(r.logprob);
        lp.text_offset.push(*offset);
        *offset += text.chars().count();
        lp.tokens.push(text);
        lp.token_logprobs.push(r.logprob);
        lp.top_logprobs.push(top);
    }
    lp
}

fn unsupported(field: &str) -> ApiError {
    ApiError::bad_request(format!("`{field}` is not supported yet")).with_flavor(F)
}

fn stops(s: Option<wire::Stop>) -> Result<Vec<String>, ApiError> {
    let v = s.map_or_else(Vec::new, wire::Stop::into_vec);
    if v.len() > 16 {
        return Err(
            ApiError::bad_request(format!("stop holds {} strings; at most 16", v.len()))
                .with_flavor(F),
        );
    }
    Ok(v.into_iter().filter(|s| !s.is_empty()).collect())
}

/// A request's sampling parameters: its own, the API's defaults where it gives none
/// (`temperature` and `top_p` 1), its `seed` or [`AppState::seed`]'s.
fn sampling(s: &AppState, p: &wire::SamplingParams) -> SamplingParams {
    let d = SamplingParams::default();
    let x = &p.extensions;
    SamplingParams {
        temperature: p.temperature.unwrap_or(1.0),
        top_p: p.top_p.unwrap_or(1.0),
        seed: s.seed(p.seed.map(|s| s as u64)),
        top_k: x.top_k.map_or(d.top_k, |k| k as usize),
        min_p: x.min_p.unwrap_or(d.min_p),
        repetition_penalty: x.repetition_penalty.unwrap_or(d.repetition_penalty),
        grammar: None,
    }
}

/// A request's `temperature` against the OpenAI API's range, 0 to 2 (the Chat
/// Completions, Completions and Responses references), as OpenAI answers a value past
/// it: a 400 naming the field. The engine itself takes any finite value `>= 0`
/// (`fak run --temperature`); past 2 the distribution is near uniform and a reply runs
/// to its limit in noise.
///
/// # Errors
/// A 400 when `t` is outside `0..=2` or not a number.
pub(crate) fn check_temperature(t: Option<f32>) -> Result<(), ApiError> {
    match t {
        Some(t) if !(0.0..=2.0).contains(&t) => Err(ApiError::bad_request(format!(
            "temperature: must be between 0 and 2 (got {t})"
        ))
        .with_code("invalid_value", "temperature")
        .with_flavor(F)),
        _ => Ok(()),
    }
}

/// The request's `n`: choices to generate, 1 when absent.
///
/// # Errors
/// A 400 naming `n` and the bound when it is outside `1..=`[`MAX_CHOICES`].
fn choice_count(n: Option<i64>) -> Result<usize, ApiError> {
    match n {
        None => Ok(1),
        Some(v) => match usize::try_from(v) {
            Ok(k) if (1..=MAX_CHOICES).contains(&k) => Ok(k),
            _ => Err(ApiError::bad_request(format!(
                "n = {v}: the number of choices must be an integer in 1..={MAX_CHOICES}"
            ))
            .with_flavor(F)),
        },
    }
}

/// The wire's `finish_reason` for how generation ended. A grammar dead end
/// ([`FinishReason::GrammarDeadEnd`]) is `length`: the content is cut short and does not
/// complete its format, which is what `length` tells a client (the `openai` SDK's
/// `parse()` raises `LengthFinishReasonError` rather than a JSON error, and the SDK
/// types allow no other word); the reply's `fak.finish_detail` says why
/// ([`crate::tools::finish_detail`]).
fn finish_word(f: FinishReason) -> wire::FinishReason {
    match f {
        FinishReason::Length | FinishReason::GrammarDeadEnd => wire::FinishReason::Length,
        _ => wire::FinishReason::Stop,
    }
}

fn usage(prompt: usize, completion: usize, cached: usize) -> wire::Usage {
    wire::Usage::new(prompt as u64, completion as u64, cached as u64)
}

/// `tools` and `tool_choice` of a chat request.
fn parse_tools(
    tools: Option<Vec<wire::Tool>>,
    choice: Option<wire::ToolChoice>,
) -> Result<(Vec<ToolSpec>, ToolChoice), ApiError> {
    let list = tools.unwrap_or_default();
    let mut specs = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        let f = t.function;
        check_tool_name(&f.name, &format!("tools[{i}].function.name"))?;
        specs.push(ToolSpec {
            name: f.name,
            description: f.description,
            parameters: Value::Object(f.parameters.unwrap_or_else(|| {
                let mut m = serde_json::Map::new();
                m.insert("type".into(), Value::String("object".into()));
                m.insert("properties".into(), Value::Object(serde_json::Map::new()));
                m
            })),
            strict: f.strict == Some(true),
        });
    }
    let choice = match choice {
        None | Some(wire::ToolChoice::Mode(wire::ToolChoiceMode::Auto)) => ToolChoice::Auto,
        Some(wire::ToolChoice::Mode(wire::ToolChoiceMode::None)) => ToolChoice::None,
        Some(wire::ToolChoice::Mode(wire::ToolChoiceMode::Required)) => ToolChoice::Required,
        Some(wire::ToolChoice::Named(n)) => ToolChoice::Named(n.function.name),
    };
    check_tools(&specs, &choice)?;
    Ok((specs, choice))
}

fn to_messages(ms: Vec<wire::ChatMessage>) -> Result<Vec<Message>, ApiError> {
    if ms.is_empty() {
        return Err(ApiError::bad_request(
            "messages must hold at least one message",
        ));
    }
    ms.into_iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role {
                wire::Role::System | wire::Role::Developer => "system",
                r => r.as_str(),
            };
            let content = match m.content {
                None => String::new(),
                Some(wire::MessageContent::Text(t)) => t,
                Some(wire::MessageContent::Parts(parts)) => {
                    let mut s = String::new();
                    for (j, p) in parts.into_iter().enumerate() {
                        match p {
                            wire::ContentPart::Text { text } => s.push_str(&text),
                            p => {
                                return Err(ApiError::bad_request(format!(
                                    "messages[{i}].content[{j}] has type '{}'; only text parts are supported",
                                    p.kind()
                                )))
                            }
                        }
                    }
                    s
                }
            };
            let tool_calls = match m.tool_calls {
                None => None,
                Some(calls) if m.role == wire::Role::Assistant => Some(
                    serde_json::to_value(calls)
                        .map_err(|e| ApiError::internal(format!("messages[{i}].tool_calls: {e}")))?,
                ),
                Some(_) => {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}] has tool_calls but is not an assistant message"
                    )))
                }
            };
            Ok(Message {
                role: role.to_string(),
                content,
                tool_calls,
                tool_call_id: m.tool_call_id,
                name: m.name,
            })
        })
        .collect()
}

/// Checks what a chat request asks that fak does not do: a 400 naming the field.
fn check_chat_fields(r: &wire::ChatCompletionRequest) -> Result<(), ApiError> {
    r.neutral.check().map_err(refused)?;
    r.unimplemented.check().map_err(refused)?;
    if let Some(m) = &r.modalities {
        if m.iter().any(|m| m != "text") {
            return Err(unsupported("modalities").with_flavor(F));
        }
    }
    Ok(())
}

/// The grammar a chat request's `response_format` asks for: `None` for none or
/// `text`; `json_object` is any JSON object; `json_schema` is its `schema` (any JSON
/// value when absent), enforced whether `strict` is set or not. A grammar is refused
/// (400 naming `response_format`) by a driver that cannot serve it
/// ([`fak_engine::EngineDriver::accepts_grammar`]); one that does not compile is the engine's 400.
fn response_grammar(
    s: &AppState,
    model: &str,
    f: Option<wire::ResponseFormat>,
) -> Result<Option<GrammarSpec>, ApiError> {
    let spec = match f {
        None | Some(wire::ResponseFormat::Text) => None,
        Some(wire::ResponseFormat::JsonObject) => Some(GrammarSpec::JsonObject),
        Some(wire::ResponseFormat::JsonSchema { json_schema }) => {
            Some(structured::chat_schema(json_schema))
        }
    };
    structured::enforced(s, model, "response_format", spec, F)
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    WireJson(r, _): OpenAiJson<wire::ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let n = choice_count(r.sampling.n)?;
    check_temperature(r.sampling.temperature)?;
    check_chat_fields(&r)?;
    let (tools, tool_choice) = parse_tools(r.tools, r.tool_choice).map_err(|e| e.with_flavor(F))?;
    let logprobs = chat_logprobs(r.logprobs, r.top_logprobs)?;
    let grammar = response_grammar(&s, &r.model, r.response_format.clone())?;
    let grammar = structured::with_grammar(&s, &r.model, r.grammar.clone(), grammar, F)?;
    let max_tokens = match r.max_completion_tokens.or(r.sampling.max_tokens) {
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
    let (messages, results) = screen_messages(&s, &conversation, messages, &[], F).await?;
    let req = GenerateRequest {
        model: Some(r.model.clone()),
        prompt: Prompt::Chat(messages),
        max_tokens,
        sampling: SamplingParams {
            grammar,
            ..sampling(&s, &r.sampling)
        },
        stop: stops(r.sampling.stop)?,
        tools,
        tool_choice,
        logprobs,
        cache_partition: cache_partition(&s, &headers, r.cache_salt.as_deref(), F)?,
        raw: None,
        continue_final_message: false,
        cap_max_tokens: false,
        context_overflow: r.context_overflow.map(crate::context_overflow),
    };
    // Calls may only be of tools the model was offered (none when `tool_choice` is
    // `none`): anything else it writes is denied UNKNOWN_TOOL.
    let offered = offered_tools(&req);
    let started = start_n(&s, req, n, F, "/v1/chat/completions").await?;
    let id = new_id("chatcmpl-");
    let created = unix_now();
    if r.stream == Some(true) {
        let include_usage = r.stream_options.and_then(|o| o.include_usage) == Some(true);
        let note = UsageNote {
            prompt: started.first().map_or(0, |st| st.prompt_tokens),
            cached: started.first().map_or(0, |st| st.cached_tokens),
            stream: true,
            ..UsageNote::default()
        };
        let check = Arc::new(CallCheck {
            conversation,
            taint,
            offered,
            results,
        });
        let head = Arc::new(ChunkHead {
            id,
            created,
            model: r.model,
            include_usage,
            logprobs: logprobs.is_some(),
            n,
        });
        let totals = Arc::new(Mutex::new(Totals::default()));
        let streams: Vec<_> = started
            .into_iter()
            .map(|st| {
                chat_stream(
                    s.clone(),
                    st,
                    Arc::clone(&head),
                    Arc::clone(&check),
                    Arc::clone(&totals),
                )
                .boxed()
            })
            .collect();
        let tail = stream_tail(totals, include_usage, move |u| {
            let mut c = head.chunk(0, wire::Delta::default(), None, None);
            c.choices.clear();
            c.usage = Some(Some(u));
            data(&c)
        });
        let events = stream::select_all(streams).chain(tail);
        let sse = sse_response(&s, events, keep_alive_comment());
        return Ok(with_note(sse, note));
    }
    let mut choices = Vec::with_capacity(n);
    let mut totals = Totals::default();
    // One choice: its `fak` is the reply's. Several: every choice's verdicts in the
    // reply's `fak`, each naming its choice.
    let mut one_fak = None;
    let mut reports = Vec::new();
    for st in started {
        let index = st.choice;
        let mut f = finish(&s, st, F).await?;
        if index == 0 {
            (totals.prompt, totals.cached) = (f.prompt_tokens, f.cached_tokens);
        }
        totals.completion += f.done.completion_tokens;
        let a = adjudicate(
            &s,
            &conversation,
            &taint,
            &offered,
            std::mem::take(&mut f.tool_calls),
        )
        .of_choice(index, n);
        let calls = (!a.allowed.is_empty()).then(|| a.allowed.iter().map(call_wire).collect());
        f.text.push_str(&denial_suffix(f.text.is_empty(), &a));
        let content = if calls.is_some() && f.text.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut f.text))
        };
        choices.push(wire::ChatChoice {
            index: index as u32,
            message: wire::AssistantMessage {
                role: wire::Role::Assistant,
                content,
                refusal: None,
                tool_calls: calls,
            },
            logprobs: logprobs.is_some().then(|| chat_lp(&f.logprobs)),
            finish_reason: Some(finish_for(&f.done, &a)),
            fak: (n > 1)
                .then(|| structured::dead_end_detail(None, &f.done))
                .flatten(),
        });
        if n == 1 {
            one_fak = structured::dead_end_detail(fak_field(&results, &a), &f.done);
        } else {
            reports.extend(a.report);
        }
    }
    let fak = if n == 1 {
        one_fak
    } else {
        fak_field(
            &results,
            &Adjudicated {
                report: reports,
                ..Adjudicated::default()
            },
        )
    };
    let body = wire::ChatCompletion {
        id,
        object: wire::CHAT_COMPLETION_OBJECT.into(),
        created,
        model: r.model,
        system_fingerprint: Some(FINGERPRINT.into()),
        choices,
        usage: Some(usage(totals.prompt, totals.completion, totals.cached)),
        fak,
    };
    let note = UsageNote {
        prompt: totals.prompt,
        completion: totals.completion,
        cached: totals.cached,
        stream: false,
    };
    Ok(with_note(axum::Json(body).into_response(), note))
}

/// The end of a stream of one request's choices merged: once every choice's stream
/// ended, the usage chunk (`usage_chunk` of the totals, when `include_usage` and no
/// choice failed), then `[DONE]`.
fn stream_tail(
    totals: Arc<Mutex<Totals>>,
    include_usage: bool,
    usage_chunk: impl FnOnce(wire::Usage) -> Event + Send + 'static,
) -> impl Stream<Item = Result<Event, Infallible>> {
    stream::once(async move {
        let t = totals.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        if include_usage && !t.failed {
            out.push(Ok(usage_chunk(usage(t.prompt, t.completion, t.cached))));
        }
        out.push(Ok(done_event()));
        stream::iter(out)
    })
    .flatten()
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
                        let (p, c) = metered(state.st.choice, prompt, cached);
                        state.s.metrics.add_tokens(p, d.completion_tokens, c);
                        (state.log.prompt, state.log.cached) = (prompt, cached);
                        state.s.metrics.observe_latency(d);
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

/// `events` as an SSE response (200, `text/event-stream`) that sends `keep_alive`
/// whenever the stream has been silent for [`crate::GatewayConfig::sse_keep_alive`].
pub(crate) fn sse_response<S>(s: &AppState, events: S, keep_alive: Event) -> Response
where
    S: Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    let sse = Sse::new(events);
    match s.config.sse_keep_alive {
        Some(every) => sse
            .keep_alive(KeepAlive::new().interval(every).event(keep_alive))
            .into_response(),
        None => sse.into_response(),
    }
}

/// The keep-alive of the OpenAI routes' streams: an SSE comment, `: keep-alive`, which
/// SSE parsers skip (the OpenAI SDKs' `SSEDecoder` yields no event for it).
pub(crate) fn keep_alive_comment() -> Event {
    Event::default().comment("keep-alive")
}

/// A JSON value as one SSE `data:` event.
pub(crate) fn data<T: serde::Serialize>(v: &T) -> Event {
    Event::default().data(serde_json::to_string(v).unwrap_or_default())
}

/// The stream's last event.
fn done_event() -> Event {
    Event::default().data("[DONE]")
}

/// What a stream needs to adjudicate its calls at the end.
struct CallCheck {
    conversation: String,
    /// The request's taint (a tool result in its history).
    taint: fak_engine::policy::Taint,
    offered: Vec<ToolSpec>,
    /// The `fak.tool_results` entries of the request's screening.
    results: Vec<crate::tools::ResultReport>,
}

/// An allowed call in OpenAI's shape.
fn call_wire(c: &ToolCall) -> wire::ToolCall {
    wire::ToolCall {
        id: c.id.clone(),
        kind: wire::FunctionType::Function,
        function: wire::FunctionCall {
            name: c.name.clone(),
            arguments: c.arguments.clone(),
        },
    }
}

/// `tool_calls` when a call is passed on, else the generation's own ending.
fn finish_for(d: &fak_engine::Done, a: &Adjudicated) -> wire::FinishReason {
    if a.allowed.is_empty() {
        finish_word(d.finish_reason)
    } else {
        wire::FinishReason::ToolCalls
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
    /// Choices of the request (`n`).
    n: usize,
}

impl ChunkHead {
    /// A chunk of choice `index` with `delta`, `finish` and `logprobs`.
    fn chunk(
        &self,
        index: u32,
        delta: wire::Delta,
        finish: Option<wire::FinishReason>,
        logprobs: Option<wire::ChoiceLogprobs>,
    ) -> wire::ChatCompletionChunk {
        wire::ChatCompletionChunk {
            id: self.id.clone(),
            object: wire::CHAT_COMPLETION_CHUNK_OBJECT.into(),
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: Some(FINGERPRINT.into()),
            choices: vec![wire::ChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason: finish,
                stop_reason: None,
            }],
            usage: self.include_usage.then_some(None),
            fak: None,
        }
    }
}

/// One choice's chunks: its role, its text as it comes, at the end the denials'
/// sentence, its allowed calls and its last chunk (`finish_reason`, and its `fak`: the
/// verdicts on this choice's calls and the request's screened results). Its counts go
/// into `totals` (the prompt's from choice 0 only); the usage chunk and `[DONE]` follow
/// every choice's end ([`stream_tail`]).
fn chat_stream(
    s: AppState,
    st: Started,
    head: Arc<ChunkHead>,
    check: Arc<CallCheck>,
    totals: Arc<Mutex<Totals>>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let (prompt, cached) = (st.prompt_tokens, st.cached_tokens);
    let choice = st.choice;
    let index = choice as u32;
    let state = s.clone();
    let mut held: Vec<ToolCall> = Vec::new();
    let mut held_lp: Vec<TokenLogprob> = Vec::new();
    // Whether any text was sent (the denials' sentences follow it after a blank line).
    let mut sent_text = false;
    let logprobs = head.logprobs;
    let first = vec![data(&head.chunk(
        index,
        wire::Delta {
            role: Some(wire::Role::Assistant),
            content: Some(String::new()),
            ..wire::Delta::default()
        },
        None,
        None,
    ))];
    sse_stream(s, st, first, move |ev| match ev {
        EngineEvent::Text(t) => {
            sent_text |= !t.is_empty();
            let lp = logprobs.then(|| chat_lp(&std::mem::take(&mut held_lp)));
            let delta = wire::Delta {
                content: Some(t),
                ..wire::Delta::default()
            };
            vec![data(&head.chunk(index, delta, None, lp))]
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
            )
            .of_choice(choice, head.n);
            let notes = denial_suffix(!sent_text, &a);
            let mut out: Vec<Event> = Vec::new();
            if !notes.is_empty() {
                let delta = wire::Delta {
                    content: Some(notes),
                    ..wire::Delta::default()
                };
                out.push(data(&head.chunk(index, delta, None, None)));
            }
            out.extend(a.allowed.iter().enumerate().map(|(i, c)| {
                let delta = wire::Delta {
                    tool_calls: Some(vec![wire::ToolCallDelta {
                        index: i as u32,
                        id: Some(c.id.clone()),
                        kind: Some(wire::FunctionType::Function),
                        function: Some(wire::FunctionCallDelta {
                            name: Some(c.name.clone()),
                            arguments: Some(c.arguments.clone()),
                        }),
                    }]),
                    ..wire::Delta::default()
                };
                data(&head.chunk(index, delta, None, None))
            }));
            let lp =
                (logprobs && !held_lp.is_empty()).then(|| chat_lp(&std::mem::take(&mut held_lp)));
            let mut last = head.chunk(index, wire::Delta::default(), Some(finish_for(&d, &a)), lp);
            last.fak = structured::dead_end_detail(fak_field(&check.results, &a), &d);
            out.push(data(&last));
            let mut t = totals.lock().unwrap_or_else(|p| p.into_inner());
            if choice == 0 {
                (t.prompt, t.cached) = prompt_counts(&d, prompt, cached);
            }
            t.completion += d.completion_tokens;
            out
        }
        EngineEvent::Error(e) => {
            totals.lock().unwrap_or_else(|p| p.into_inner()).failed = true;
            vec![data(&ApiError::from(e).with_flavor(F).body())]
        }
        EngineEvent::Start { .. } => Vec::new(),
    })
}

/// Token counts summed over a request's prompts, and whether one failed.
#[derive(Default)]
struct Totals {
    prompt: usize,
    completion: usize,
    cached: usize,
    failed: bool,
}

/// `POST /v1/completions`: plain prompts, no chat template. `prompt` is a string, a
/// list of strings, a list of token ids or a list of lists of token ids; each prompt of
/// a list is answered by the choice whose `index` is its position (streamed: their
/// chunks interleave, each with its `index`), and `usage` sums them all.
pub(crate) async fn completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    WireJson(mut r, _): OpenAiJson<wire::CompletionRequest>,
) -> Result<Response, ApiError> {
    let n = choice_count(r.sampling.n)?;
    check_temperature(r.sampling.temperature)?;
    r.neutral.check().map_err(refused)?;
    if r.echo == Some(true) {
        return Err(unsupported("echo"));
    }
    let logprobs = top_count("logprobs", r.logprobs)?;
    if r.suffix.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(unsupported("suffix"));
    }
    let prompts = r.prompt.into_prompts();
    if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
        return Err(ApiError::bad_request(format!(
            "prompt holds {} prompts; between 1 and {MAX_PROMPTS}",
            prompts.len()
        ))
        .with_flavor(F));
    }
    if prompts.len() * n > MAX_PROMPTS {
        return Err(ApiError::bad_request(format!(
            "prompt holds {} prompts and n = {n}: {} choices; at most {MAX_PROMPTS}",
            prompts.len(),
            prompts.len() * n
        ))
        .with_flavor(F));
    }
    let max_tokens = positive("max_tokens", r.sampling.max_tokens.unwrap_or(16), F)?;
    let stop = stops(r.sampling.stop.take())?;
    let partition = cache_partition(&s, &headers, r.cache_salt.as_deref(), F)?;
    let format = response_grammar(&s, &r.model, r.response_format.take())?;
    let grammar = structured::with_grammar(&s, &r.model, r.grammar.clone(), format, F)?;
    let mut started = Vec::with_capacity(prompts.len());
    for p in prompts {
        let req = GenerateRequest {
            model: Some(r.model.clone()),
            prompt: match p {
                wire::PromptInput::Text(t) => Prompt::Text(t),
                wire::PromptInput::Tokens(ids) => Prompt::Tokens(ids),
            },
            max_tokens: Some(max_tokens),
            sampling: SamplingParams {
                grammar: grammar.clone(),
                ..sampling(&s, &r.sampling)
            },
            stop: stop.clone(),
            tools: Vec::new(),
            tool_choice: ToolChoice::None,
            logprobs,
            cache_partition: partition.clone(),
            raw: None,
            continue_final_message: false,
            cap_max_tokens: false,
            context_overflow: None,
        };
        started.extend(start_n(&s, req, n, F, "/v1/completions").await?);
    }
    let id = new_id("cmpl-");
    let created = unix_now();
    let model = r.model;
    let chunk = move |index: usize,
                      text: String,
                      finish: Option<wire::FinishReason>,
                      lp: Option<wire::CompletionLogprobs>| wire::Completion {
        id: id.clone(),
        object: wire::TEXT_COMPLETION_OBJECT.into(),
        created,
        model: model.clone(),
        choices: vec![wire::CompletionChoice {
            text,
            index: index as u32,
            logprobs: lp,
            finish_reason: finish,
            stop_reason: None,
        }],
        usage: None,
    };
    if r.stream == Some(true) {
        let include_usage = r.stream_options.and_then(|o| o.include_usage) == Some(true);
        let firsts = || started.iter().filter(|st| st.choice == 0);
        let note = UsageNote {
            prompt: firsts().map(|st| st.prompt_tokens).sum(),
            cached: firsts().map(|st| st.cached_tokens).sum(),
            stream: true,
            ..UsageNote::default()
        };
        let totals = Arc::new(Mutex::new(Totals::default()));
        let streams = started.into_iter().enumerate().map(|(index, st)| {
            let (prompt, cached, choice) = (st.prompt_tokens, st.cached_tokens, st.choice);
            let chunk = chunk.clone();
            let totals = Arc::clone(&totals);
            let mut held_lp: Vec<TokenLogprob> = Vec::new();
            let mut offset = 0usize;
            let mut lp = move |held: &mut Vec<TokenLogprob>| {
                logprobs.map(|_| legacy_lp(&std::mem::take(held), &mut offset))
            };
            sse_stream(s.clone(), st, Vec::new(), move |ev| match ev {
                EngineEvent::Text(t) => {
                    let l = lp(&mut held_lp);
                    vec![data(&chunk(index, t, None, l))]
                }
                EngineEvent::Logprobs(r) => {
                    held_lp.extend(r);
                    Vec::new()
                }
                EngineEvent::Done(d) => {
                    let l = if held_lp.is_empty() {
                        None
                    } else {
                        lp(&mut held_lp)
                    };
                    let (prompt, cached) = prompt_counts(&d, prompt, cached);
                    let (prompt, cached) = metered(choice, prompt, cached);
                    let mut t = totals.lock().unwrap_or_else(|p| p.into_inner());
                    t.prompt += prompt;
                    t.cached += cached;
                    t.completion += d.completion_tokens;
                    vec![data(&chunk(
                        index,
                        String::new(),
                        Some(finish_word(d.finish_reason)),
                        l,
                    ))]
                }
                EngineEvent::Error(e) => {
                    totals.lock().unwrap_or_else(|p| p.into_inner()).failed = true;
                    vec![data(&ApiError::from(e).with_flavor(F).body())]
                }
                EngineEvent::Start { .. } | EngineEvent::ToolCall(_) => Vec::new(),
            })
            .boxed()
        });
        let streams: Vec<_> = streams.collect();
        let tail = stream_tail(totals, include_usage, move |u| {
            let mut c = chunk(0, String::new(), None, None);
            c.choices.clear();
            c.usage = Some(u);
            data(&c)
        });
        let st = stream::select_all(streams).chain(tail);
        let sse = sse_response(&s, st, keep_alive_comment());
        return Ok(with_note(sse, note));
    }
    let mut choices = Vec::with_capacity(started.len());
    let mut totals = Totals::default();
    for (index, st) in started.into_iter().enumerate() {
        let choice = st.choice;
        let f = finish(&s, st, F).await?;
        let (prompt, cached) = metered(choice, f.prompt_tokens, f.cached_tokens);
        totals.prompt += prompt;
        totals.cached += cached;
        totals.completion += f.done.completion_tokens;
        let lp = logprobs.map(|_| legacy_lp(&f.logprobs, &mut 0));
        let mut c = chunk(index, f.text, Some(finish_word(f.done.finish_reason)), lp);
        choices.append(&mut c.choices);
    }
    let mut body = chunk(0, String::new(), None, None);
    body.choices = choices;
    body.usage = Some(usage(totals.prompt, totals.completion, totals.cached));
    let note = UsageNote {
        prompt: totals.prompt,
        completion: totals.completion,
        cached: totals.cached,
        stream: false,
    };
    Ok(with_note(axum::Json(body).into_response(), note))
}
