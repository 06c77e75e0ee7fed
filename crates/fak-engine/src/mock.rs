//! The `mock` driver: deterministic text without a model, for tests of the layers above.
//!
//! "Tokens" are whitespace-separated words. The prompt's token count is the number of
//! words of every message's content (plus one per message for its role), the context
//! window is [`MOCK_CONTEXT`] tokens (or [`CONTEXT_ENV`]'s), and the reply depends only
//! on the last message, or else on its last line (so a client that puts context blocks
//! before the user's text, as Claude Code's `<system-reminder>` blocks are, can still
//! script it):
//!
//! - `count N`: the words `1 2 ... N` (N at most 100 000), a long reply for
//!   cancellation and streaming tests;
//! - `echo TEXT`: TEXT's words;
//! - anything else: [`MOCK_REPLY`];
//! - a prompt of token ids ([`crate::Prompt::Tokens`]; one token per id): the ids, in
//!   decimal, as words.
//!
//! A chat reply goes through the same tool-call parser as the in-kernel driver's (so
//! `echo <tool_call>{"name": "f", "arguments": {}}</tool_call>` proposes a call, offered
//! or not), and when `tool_choice` is `required` or names a tool and the reply holds no
//! call, the reply is a call of the named (or first) tool with placeholder arguments for
//! its schema's required properties (`"mock"`, 0, false, [], {}).
//!
//! A prompt with no words is a 400 (`InvalidRequest`), as the in-kernel driver answers
//! a prompt that tokenizes to nothing. A request that continues its final assistant
//! message ([`GenerateRequest::continue_final_message`], a prefill) is answered from the
//! conversation before that message, less the words the prefill already holds when the
//! reply starts with them (so `echo one two three` prefilled with `one two` goes on
//! with ` three`); the last message not being the assistant's is a 400, as in-kernel.
//!
//! Each word is one `Text` event (`"word"` then `" word"`...; after a prefill that does
//! not end in whitespace the first is `" word"` too). With
//! [`GenerateRequest::logprobs`] each word is one token (id: its index in the reply,
//! bytes: its piece, leading space included) with logprob 0.0 (the mock is certain of
//! it), and its top list holds only itself (when `n` ≥ 1): no other token has a finite
//! logprob. The record is sent just before the word's `Text`. Generation stops after the
//! reply (finish `stop`), at `max_tokens` (`length`) or before a stop string (`stop`,
//! the text before it kept). Cached tokens: the longest word prefix shared with the
//! previous request's prompt plus reply, minus one, as the in-kernel driver reports; 0
//! when the previous request was of another cache partition
//! ([`crate::GenerateRequest::cache_partition`]).
//! `n` choices ([`EngineDriver::submit_n`]) are `n` such requests (the default), so
//! every choice is the same reply.
//! A per-word delay (see [`MockDriver::with_delay`]) makes streams last, and a prefill
//! delay (see [`MockDriver::with_prefill_delay`]) a silent wait between `Start` and the
//! first word, as a long prompt's prefill is; each generation runs on its own thread,
//! stopping as soon as its stream is dropped.

use crate::tools::{ToolCallParser, TOOL_CALL_CLOSE, TOOL_CALL_OPEN};
use crate::{
    budget, check_model, event_channel, Done, EngineConfig, EngineDriver, EngineError, EngineEvent,
    EngineStats, EventStream, FinishReason, GenerateRequest, ModelInfo, PieceSender, Prompt,
    Readiness, TokenLogprob, ToolChoice, TopLogprob,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The model id the mock serves.
pub const MOCK_MODEL: &str = "mock";
/// The mock's context window, tokens (words).
pub const MOCK_CONTEXT: usize = 2048;
/// The default reply.
pub const MOCK_REPLY: &str = "Hello from the mock engine.";

/// Environment variable: a per-word delay, milliseconds, for the mock built from the
/// registry (`fak serve --engine mock`), so that tests of the server can make streams
/// last. Unset or not a number: no delay.
pub const DELAY_ENV: &str = "FAK_MOCK_DELAY_MS";

/// Environment variable: the context window, tokens (words), of the mock built from
/// the registry, for clients whose prompts are longer than [`MOCK_CONTEXT`] (Claude
/// Code's system prompt and tools). Unset or not a number: [`MOCK_CONTEXT`].
pub const CONTEXT_ENV: &str = "FAK_MOCK_CONTEXT";

/// The registry entry.
pub const SPEC: crate::registry::DriverSpec = crate::registry::DriverSpec {
    id: "mock",
    about: "deterministic text without a model (for tests)",
    build: |cfg: &EngineConfig| {
        let mut m = MockDriver::new();
        if let Some(id) = &cfg.model_id {
            m = m.with_model(id);
        }
        if let Some(n) = std::env::var(CONTEXT_ENV)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
        {
            m.context = n;
        }
        if let Some(ms) = std::env::var(DELAY_ENV)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            m = m.with_delay(Duration::from_millis(ms));
        }
        Ok(Arc::new(m) as Arc<dyn EngineDriver>)
    },
};

/// The mock driver. See the module docs for its behaviour.
pub struct MockDriver {
    model: String,
    delay: Duration,
    prefill_delay: Duration,
    max_active: usize,
    /// The context window, words.
    context: usize,
    active: Arc<AtomicUsize>,
    last: Mutex<(String, Vec<String>)>,
}

impl Default for MockDriver {
    fn default() -> Self {
        Self::new()
    }
}

impl MockDriver {
    /// A mock with no delay and no limit on concurrent generations.
    pub fn new() -> Self {
        MockDriver {
            model: MOCK_MODEL.into(),
            delay: Duration::ZERO,
            prefill_delay: Duration::ZERO,
            max_active: usize::MAX,
            context: MOCK_CONTEXT,
            active: Arc::new(AtomicUsize::new(0)),
            last: Mutex::new((String::new(), Vec::new())),
        }
    }

    /// Serves the model under `id` instead of [`MOCK_MODEL`] (from
    /// [`EngineConfig::model_id`], e.g. a `fak serve --route ID=mock`).
    pub fn with_model(mut self, id: &str) -> Self {
        self.model = id.to_string();
        self
    }

    /// Sleeps `delay` before each word.
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Waits `delay` after `Start` before the first word, sending nothing, as the
    /// in-kernel driver does while it prefills a long prompt. Like a prefill, the wait
    /// ends early (and the generation with it) once the stream is dropped: the
    /// generation's cancel flag is checked every few milliseconds.
    pub fn with_prefill_delay(mut self, delay: Duration) -> Self {
        self.prefill_delay = delay;
        self
    }

    /// At most `n` generations at once; more get [`EngineError::Overloaded`].
    pub fn with_max_active(mut self, n: usize) -> Self {
        self.max_active = n;
        self
    }

    fn prompt_words(prompt: &Prompt) -> Vec<String> {
        match prompt {
            Prompt::Text(t) => t.split_whitespace().map(str::to_string).collect(),
            Prompt::Tokens(ids) => ids.iter().map(u32::to_string).collect(),
            Prompt::Chat(ms) => ms
                .iter()
                .flat_map(|m| {
                    std::iter::once(format!("<{}>", m.role))
                        .chain(m.content.split_whitespace().map(str::to_string))
                })
                .collect(),
        }
    }

    /// For a request that continues its final message
    /// ([`GenerateRequest::continue_final_message`]): the conversation before that
    /// message and the message's text. `None` otherwise.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] when the last message is not the assistant's (as
    /// the in-kernel driver answers).
    fn prefill(req: &GenerateRequest) -> Result<Option<(Prompt, String)>, EngineError> {
        let Prompt::Chat(ms) = &req.prompt else {
            return Ok(None);
        };
        if !req.continue_final_message {
            return Ok(None);
        }
        match ms.split_last() {
            Some((last, before)) if last.role == "assistant" => {
                Ok(Some((Prompt::Chat(before.to_vec()), last.content.clone())))
            }
            _ => Err(EngineError::InvalidRequest(
                "continue_final_message needs a final assistant message".into(),
            )),
        }
    }

    fn reply(prompt: &Prompt) -> Vec<String> {
        let last = match prompt {
            Prompt::Text(t) => t.as_str(),
            Prompt::Tokens(ids) => return ids.iter().map(u32::to_string).collect(),
            Prompt::Chat(ms) => ms.last().map_or("", |m| m.content.as_str()),
        };
        let last = last.trim();
        let line = last.lines().last().unwrap_or("").trim();
        let last = if last.starts_with("count ") || last.starts_with("echo ") {
            last
        } else {
            line
        };
        if let Some(n) = last.strip_prefix("count ") {
            let n = n.trim().parse::<usize>().unwrap_or(0).min(100_000);
            return (1..=n).map(|i| i.to_string()).collect();
        }
        if let Some(t) = last.strip_prefix("echo ") {
            return t.split_whitespace().map(str::to_string).collect();
        }
        MOCK_REPLY.split_whitespace().map(str::to_string).collect()
    }
}

/// The mock's record of word `index` with text `piece` (see the module docs).
fn mock_logprob(index: usize, piece: &str, top_n: usize) -> TokenLogprob {
    let id = u32::try_from(index).unwrap_or(u32::MAX);
    let bytes = piece.as_bytes().to_vec();
    TokenLogprob {
        id,
        top: if top_n > 0 {
            vec![TopLogprob {
                id,
                bytes: bytes.clone(),
                logprob: 0.0,
            }]
        } else {
            Vec::new()
        },
        bytes,
        logprob: 0.0,
    }
}

/// Arguments that satisfy a simple object schema: each `required` property with a
/// placeholder of its `type` (`"mock"`, 0, false, [], {}; `null` when untyped).
fn placeholder_arguments(schema: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    let mut args = serde_json::Map::new();
    for name in schema
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        let kind = schema
            .get("properties")
            .and_then(|p| p.get(name))
            .and_then(|p| p.get("type"))
            .and_then(Value::as_str);
        let v = match kind {
            Some("string") => Value::from("mock"),
            Some("integer" | "number") => Value::from(0),
            Some("boolean") => Value::Bool(false),
            Some("array") => Value::Array(Vec::new()),
            Some("object") => Value::Object(serde_json::Map::new()),
            _ => Value::Null,
        };
        args.insert(name.to_string(), v);
    }
    Value::Object(args)
}

struct ActiveGuard(Arc<AtomicUsize>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl EngineDriver for MockDriver {
    fn id(&self) -> &'static str {
        "mock"
    }

    fn models(&self) -> Vec<ModelInfo> {
        vec![ModelInfo {
            id: self.model.clone(),
            context_length: self.context,
            owned_by: "mock".into(),
        }]
    }

    fn readiness(&self) -> Readiness {
        Readiness::Ready
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            active: self.active.load(Ordering::SeqCst),
            ..EngineStats::default()
        }
    }

    /// The prompt's words, as `submit` counts them (see the module docs).
    fn count_tokens(&self, req: &GenerateRequest) -> Result<usize, EngineError> {
        check_model(req.model.as_deref(), &self.models())?;
        Ok(Self::prompt_words(&req.prompt).len())
    }

    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        check_model(req.model.as_deref(), &self.models())?;
        req.validate()?;
        req.sampling
            .validate()
            .map_err(EngineError::InvalidRequest)?;
        let words = Self::prompt_words(&req.prompt);
        if words.is_empty() {
            // As the in-kernel driver answers a prompt that tokenizes to nothing.
            return Err(EngineError::InvalidRequest(
                "the prompt is empty (no tokens)".into(),
            ));
        }
        let prefill = Self::prefill(&req)?;
        let max_tokens = budget(
            words.len(),
            req.max_tokens_within(words.len(), self.context),
            self.context,
        )?;
        let now = self.active.fetch_add(1, Ordering::SeqCst);
        let guard = ActiveGuard(Arc::clone(&self.active));
        if now >= self.max_active {
            return Err(EngineError::Overloaded {
                queued: now,
                retry_after_s: 1,
            });
        }
        let mut reply = match &prefill {
            Some((before, _)) => Self::reply(before),
            None => Self::reply(&req.prompt),
        };
        // A continued message: the reply goes on after the words it already holds, and
        // its first word follows the prefill after a space unless the prefill ends in one.
        let mut lead_space = false;
        if let Some((_, p)) = &prefill {
            let have: Vec<&str> = p.split_whitespace().collect();
            if !have.is_empty() && reply.iter().zip(&have).all(|(a, b)| a == b) {
                reply.drain(..have.len().min(reply.len()));
            }
            lead_space = !p.is_empty() && !p.ends_with(char::is_whitespace);
        }
        let forced = match &req.tool_choice {
            ToolChoice::Named(n) => req.tools.iter().find(|t| &t.name == n),
            ToolChoice::Required => req.tools.first(),
            _ => None,
        };
        if let Some(tool) = forced.filter(|_| req.tools_active()) {
            if !reply.iter().any(|w| w.contains(TOOL_CALL_OPEN)) {
                let call = format!(
                    "{TOOL_CALL_OPEN}{{\"name\": {}, \"arguments\": {}}}{TOOL_CALL_CLOSE}",
                    serde_json::Value::String(tool.name.clone()),
                    placeholder_arguments(&tool.parameters)
                );
                reply = call.split_whitespace().map(str::to_string).collect();
            }
        }
        let parser = matches!(req.prompt, Prompt::Chat(_)).then(|| ToolCallParser::new(""));
        let cached = {
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            // Only a request of the same cache partition reuses the last one's words.
            let common = if last.0 == req.cache_partition {
                last.1
                    .iter()
                    .zip(&words)
                    .take_while(|(a, b)| a == b)
                    .count()
                    .min(words.len().saturating_sub(1))
            } else {
                0
            };
            let mut kept = words.clone();
            kept.extend(reply.iter().cloned());
            *last = (req.cache_partition.clone(), kept);
            common
        };
        let (sink, stream) = event_channel();
        let delay = self.delay;
        let prefill_delay = self.prefill_delay;
        let prompt_tokens = words.len();
        std::thread::spawn(move || {
            let _guard = guard;
            if !sink.send(EngineEvent::Start {
                prompt_tokens,
                cached_tokens: cached,
            }) {
                return;
            }
            if !silent_prefill(&sink, prefill_delay) {
                return; // the client went away during the prefill
            }
            let mut sender = PieceSender::new(&sink, parser);
            let record = |n: usize, piece: &str| {
                req.logprobs
                    .map(|top| vec![mock_logprob(n, piece, top)])
                    .unwrap_or_default()
            };
            let mut text = String::new();
            let mut n = 0;
            let mut finish = FinishReason::Stop;
            let mut stop_sequence = None;
            for w in &reply {
                if n == max_tokens {
                    finish = FinishReason::Length;
                    break;
                }
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                let piece = if n == 0 && !lead_space {
                    w.clone()
                } else {
                    format!(" {w}")
                };
                let mut candidate = text.clone();
                candidate.push_str(&piece);
                if let Some((at, s)) = req
                    .stop
                    .iter()
                    .filter(|s| !s.is_empty())
                    .filter_map(|s| candidate.find(s.as_str()).map(|at| (at, s)))
                    .min_by_key(|(at, _)| *at)
                {
                    // The word is a token with at least one byte before the stop
                    // when `before` is not empty: its record goes with that text.
                    let before = &candidate[text.len().min(at)..at];
                    if !before.is_empty() && !sender.piece(before, &record(n, &piece)) {
                        return;
                    }
                    n += 1;
                    stop_sequence = Some(s.clone());
                    break;
                }
                if !sender.piece(&piece, &record(n, &piece)) {
                    return; // the client went away
                }
                n += 1;
                text = candidate;
            }
            if !sender.finish(finish) {
                return;
            }
            sink.send(EngineEvent::Done(Done {
                completion_tokens: n,
                completion_ids: (0..n as u32).collect(),
                finish_reason: finish,
                stop_sequence,
                dead_end: None,
                ttft_s: 0.0,
                decode_s: 0.0,
                token_gaps_s: Vec::new(),
                prompt_usage: None,
            }));
        });
        Ok(stream)
    }
}

/// The mock's silent prefill: waits `delay`, checking the generation's cancel flag
/// every 5 ms. `false` when it was cancelled (the stream dropped).
fn silent_prefill(sink: &crate::EventSink, delay: Duration) -> bool {
    let cancel = sink.cancel_handle();
    let end = std::time::Instant::now() + delay;
    loop {
        if cancel.is_cancelled() {
            return false;
        }
        let left = end.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return true;
        }
        std::thread::sleep(left.min(Duration::from_millis(5)));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_directive_on_the_last_line_counts() {
        use super::*;
        let p = |t: &str| Prompt::Chat(vec![crate::Message::new("user", t)]);
        let reply = |t: &str| MockDriver::reply(&p(t)).join(" ");
        assert_eq!(
            reply("<system-reminder>\nx\n</system-reminder>\necho a b"),
            "a b"
        );
        assert_eq!(reply("echo a\nb"), "a b");
        assert_eq!(reply("context\ncount 3"), "1 2 3");
        assert_eq!(
            reply("echo at the start\nnot here"),
            "at the start not here"
        );
        assert_eq!(reply("no directive\nat all"), MOCK_REPLY);
    }

    use super::*;
    use fak_model::Message;

    fn run(req: GenerateRequest) -> crate::Collected {
        MockDriver::new()
            .submit(req)
            .unwrap()
            .blocking_collect()
            .unwrap()
    }

    #[test]
    fn replies_deterministically() {
        let c = run(GenerateRequest::chat(vec![Message::new(
            "user", "hi there",
        )]));
        assert_eq!(c.text, MOCK_REPLY);
        assert_eq!(c.prompt_tokens, 3);
        let d = c.done.unwrap();
        assert_eq!(d.finish_reason, FinishReason::Stop);
        assert_eq!(d.completion_tokens, 5);
    }

    #[test]
    fn n_choices_are_n_replies_and_n_is_bounded() {
        let d = MockDriver::new();
        let req = GenerateRequest::chat(vec![Message::new("user", "echo a b c")]);
        let streams = d.submit_n(req.clone(), 3).unwrap();
        assert_eq!(streams.len(), 3);
        for s in streams {
            let c = s.blocking_collect().unwrap();
            assert_eq!(c.text, "a b c");
            assert_eq!(c.prompt_tokens, 5);
        }
        for n in [0, crate::MAX_CHOICES + 1] {
            let e = d.submit_n(req.clone(), n).unwrap_err().to_string();
            assert!(
                e.contains(&format!("n = {n}")) && e.contains("1..=16"),
                "{e}"
            );
        }
        // Choice 0 keeps the seed; the others differ from it and from each other.
        let seeds: Vec<u64> = (0..4).map(|i| crate::choice_seed(9, i)).collect();
        assert_eq!(seeds[0], 9);
        for i in 0..4 {
            for j in 0..i {
                assert_ne!(seeds[i], seeds[j]);
            }
        }
    }

    #[test]
    fn max_tokens_and_stop_strings() {
        let mut r = GenerateRequest::chat(vec![Message::new("user", "count 10")]);
        r.max_tokens = Some(3);
        let c = run(r.clone());
        assert_eq!(c.text, "1 2 3");
        assert_eq!(c.done.unwrap().finish_reason, FinishReason::Length);
        r.max_tokens = None;
        r.stop = vec![" 5".into(), "9".into()];
        let c = run(r);
        assert_eq!(c.text, "1 2 3 4");
        let d = c.done.unwrap();
        assert_eq!(d.finish_reason, FinishReason::Stop);
        assert_eq!(d.stop_sequence.as_deref(), Some(" 5"));
    }

    #[test]
    fn tool_calls_go_through_the_parser() {
        let tools = vec![crate::ToolSpec {
            name: "get_time".into(),
            description: None,
            parameters: serde_json::json!({}),
            strict: false,
        }];
        let mut r = GenerateRequest::chat(vec![Message::new(
            "user",
            r#"echo ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>"#,
        )]);
        r.tools = tools.clone();
        let c = run(r.clone());
        assert_eq!(c.text, "ok");
        assert_eq!(c.tool_calls.len(), 1);
        assert_eq!(c.tool_calls[0].name, "f");
        assert_eq!(c.tool_calls[0].arguments, r#"{"a":1}"#);
        // Without tools the call is still read out (the layer above denies it), never
        // left in the text.
        r.tools.clear();
        let c = run(r);
        assert_eq!((c.text.as_str(), c.tool_calls.len()), ("ok", 1));
        let mut r = GenerateRequest::chat(vec![Message::new("user", "hi")]);
        r.tools = tools;
        r.tool_choice = ToolChoice::Required;
        let c = run(r.clone());
        assert_eq!(
            (c.text.as_str(), c.tool_calls[0].name.as_str()),
            ("", "get_time")
        );
        r.tool_choice = ToolChoice::Auto;
        assert!(run(r).tool_calls.is_empty());
    }

    #[test]
    fn a_forced_call_fills_the_required_arguments() {
        let schema = serde_json::json!({"type": "object", "required": ["city", "days"],
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}});
        assert_eq!(
            placeholder_arguments(&schema),
            serde_json::json!({"city": "mock", "days": 0})
        );
        let mut r = GenerateRequest::chat(vec![Message::new("user", "hi")]);
        r.tools = vec![crate::ToolSpec {
            name: "get_weather".into(),
            description: None,
            parameters: schema,
            strict: false,
        }];
        r.tool_choice = ToolChoice::Named("get_weather".into());
        let c = run(r);
        assert_eq!(c.tool_calls[0].arguments, r#"{"city":"mock","days":0}"#);
    }

    #[test]
    fn errors_before_streaming() {
        let d = MockDriver::new();
        let mut r = GenerateRequest::chat(vec![Message::new("user", "x")]);
        r.model = Some("nope".into());
        assert!(matches!(
            d.submit(r.clone()),
            Err(EngineError::UnknownModel { .. })
        ));
        r.model = None;
        r.max_tokens = Some(MOCK_CONTEXT);
        assert!(matches!(
            d.submit(r),
            Err(EngineError::ContextOverflow { .. })
        ));
    }

    #[test]
    fn dropping_the_stream_stops_the_generation() {
        let d = MockDriver::new().with_delay(Duration::from_millis(2));
        let mut s = d
            .submit(GenerateRequest::chat(vec![Message::new(
                "user",
                "count 100000",
            )]))
            .unwrap();
        assert!(matches!(s.blocking_next(), Some(EngineEvent::Start { .. })));
        assert!(matches!(s.blocking_next(), Some(EngineEvent::Text(_))));
        drop(s);
        let t = std::time::Instant::now();
        while d.stats().active > 0 {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "generation not cancelled"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
