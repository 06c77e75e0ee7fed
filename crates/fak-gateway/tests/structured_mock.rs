//! Structured outputs on every wire, without a model: a scripted driver that says it
//! constrains its output, records the grammar each request asked for, and answers a
//! set text with a set finish reason. What it checks is the gateway's part: which
//! [`GrammarSpec`] each wire's field becomes, and how a grammar's dead end
//! ([`FinishReason::GrammarDeadEnd`]) is told on each wire (the finish word for a reply
//! cut short, `fak.finish_detail: "grammar_dead_end"` and, on Chat Completions and
//! Anthropic Messages, `fak.grammar_error`, the engine's reason). The in-kernel engine's
//! part (that the output then validates) is `structured_smollm2.rs`.

mod common;

use common::{post, start};
use fak_engine::{
    event_channel, Done, EngineDriver, EngineError, EngineEvent, EventStream, FinishReason,
    GenerateRequest, GrammarSpec, ModelInfo, Readiness,
};
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ID: &str = "scripted";

/// Answers every request with a set text and finish reason ([`Scripted::answer`]), and
/// keeps the last request's grammar.
struct Scripted {
    answer: Mutex<(String, FinishReason)>,
    grammar: Mutex<Option<Option<GrammarSpec>>>,
}

impl Scripted {
    fn new(text: &str, finish: FinishReason) -> Arc<Self> {
        Arc::new(Scripted {
            answer: Mutex::new((text.into(), finish)),
            grammar: Mutex::new(None),
        })
    }

    /// Answers later requests with `text` and `finish`.
    fn answer(&self, text: &str, finish: FinishReason) {
        *self.answer.lock().unwrap() = (text.into(), finish);
    }

    /// The grammar of the last request (panics when none came).
    fn last_grammar(&self) -> Option<GrammarSpec> {
        self.grammar
            .lock()
            .unwrap()
            .take()
            .expect("no request reached the driver")
    }
}

impl EngineDriver for Scripted {
    fn id(&self) -> &'static str {
        "scripted"
    }

    fn models(&self) -> Vec<ModelInfo> {
        vec![ModelInfo {
            id: ID.into(),
            context_length: 4096,
            owned_by: "scripted".into(),
        }]
    }

    fn readiness(&self) -> Readiness {
        Readiness::Ready
    }

    fn constrains_output(&self, _model: Option<&str>) -> bool {
        true
    }

    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        *self.grammar.lock().unwrap() = Some(req.sampling.grammar.clone());
        let (sink, stream) = event_channel();
        sink.send(EngineEvent::Start {
            prompt_tokens: 3,
            cached_tokens: 0,
        });
        let (text, finish_reason) = self.answer.lock().unwrap().clone();
        sink.send(EngineEvent::Text(text));
        sink.send(EngineEvent::Done(Done {
            completion_tokens: 2,
            completion_ids: vec![1, 2],
            finish_reason,
            stop_sequence: None,
            dead_end: (finish_reason == FinishReason::GrammarDeadEnd).then(|| DEAD_END.to_string()),
            ttft_s: 0.0,
            decode_s: 0.0,
            token_gaps_s: Vec::new(),
            prompt_usage: None,
        }));
        Ok(stream)
    }
}

/// The reason the scripted driver gives for a dead end ([`Done::dead_end`]).
const DEAD_END: &str = "no token is allowed at this step";

fn server(d: &Arc<Scripted>) -> common::Server {
    start(d.clone(), GatewayConfig::default())
}

/// The `data:` payloads of an SSE body, `[DONE]` left out.
fn sse_data(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// A dead end is `length` on Chat Completions (the word the `openai` SDK's `parse()`
/// treats as a reply cut short) with `fak.finish_detail`, streamed or not; a reply that
/// ends normally has neither.
#[test]
fn chat_dead_end_is_length_with_the_detail() {
    let d = Scripted::new("{\"a\": ", FinishReason::GrammarDeadEnd);
    let srv = server(&d);
    let body = json!({
        "model": ID,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_object"}
    });
    let r = post(srv.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["fak"]["finish_detail"], "grammar_dead_end", "{v}");
    assert_eq!(v["fak"]["grammar_error"], DEAD_END, "{v}");
    assert_eq!(d.last_grammar(), Some(GrammarSpec::JsonObject));

    let mut b = body.clone();
    b["stream"] = json!(true);
    let r = post(srv.addr, "/v1/chat/completions", &b);
    assert_eq!(r.status, 200, "{}", r.body);
    let chunks = sse_data(&r.body);
    let last = chunks
        .iter()
        .find(|c| !c["choices"][0]["finish_reason"].is_null())
        .unwrap_or_else(|| panic!("no finish chunk: {}", r.body));
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{last}");
    assert_eq!(last["fak"]["finish_detail"], "grammar_dead_end", "{last}");
    assert_eq!(last["fak"]["grammar_error"], DEAD_END, "{last}");

    let d = Scripted::new("{}", FinishReason::Stop);
    let srv = server(&d);
    let v = post(srv.addr, "/v1/chat/completions", &body).json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(v.get("fak").is_none(), "{v}");
}

/// A dead end ends a Response `incomplete` (`max_output_tokens`, the SDK's only word
/// for a cut), with `fak.finish_detail`.
#[test]
fn responses_dead_end_is_incomplete_with_the_detail() {
    let d = Scripted::new("{\"a\": ", FinishReason::GrammarDeadEnd);
    let srv = server(&d);
    let r = post(
        srv.addr,
        "/v1/responses",
        &json!({"model": ID, "input": "hi", "store": false}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(
        v["incomplete_details"]["reason"], "max_output_tokens",
        "{v}"
    );
    assert_eq!(v["fak"]["finish_detail"], "grammar_dead_end", "{v}");
}

/// A dead end is `stop_reason: "max_tokens"` on the Anthropic wire, with
/// `fak.finish_detail`, streamed (in `message_delta`) or not.
#[test]
fn anthropic_dead_end_is_max_tokens_with_the_detail() {
    let d = Scripted::new("{\"a\": ", FinishReason::GrammarDeadEnd);
    let srv = server(&d);
    let body = json!({
        "model": ID,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}]
    });
    let r = post(srv.addr, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["stop_reason"], "max_tokens", "{v}");
    assert_eq!(v["fak"]["finish_detail"], "grammar_dead_end", "{v}");
    assert_eq!(v["fak"]["grammar_error"], DEAD_END, "{v}");

    let mut b = body.clone();
    b["stream"] = json!(true);
    let r = post(srv.addr, "/v1/messages", &b);
    assert_eq!(r.status, 200, "{}", r.body);
    let delta = sse_data(&r.body)
        .into_iter()
        .find(|e| e["type"] == "message_delta")
        .unwrap_or_else(|| panic!("no message_delta: {}", r.body));
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens", "{delta}");
    assert_eq!(delta["fak"]["finish_detail"], "grammar_dead_end", "{delta}");
    assert_eq!(delta["fak"]["grammar_error"], DEAD_END, "{delta}");
}

/// `response_format` on `/v1/completions` (as vLLM takes it) asks the engine for the
/// same grammar as on Chat Completions, instead of being ignored; with `grammar` too it
/// is a 400.
#[test]
fn completions_response_format_becomes_the_grammar() {
    let d = Scripted::new("{}", FinishReason::Stop);
    let srv = server(&d);
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": ID, "prompt": "hi", "response_format": {"type": "json_schema",
                "json_schema": {"name": "A", "schema": schema, "strict": true}}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        d.last_grammar(),
        Some(GrammarSpec::JsonSchema {
            schema,
            name: Some("A".into()),
            description: None,
            strict: Some(true),
        })
    );
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": ID, "prompt": "hi", "response_format": {"type": "json_object"}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(d.last_grammar(), Some(GrammarSpec::JsonObject));
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": ID, "prompt": "hi", "grammar": "start: \"x\"",
                "response_format": {"type": "json_object"}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
}

/// The body `openai` 3.57.0 sends for `client.responses.parse(model=ID, input=...,
/// text_format=Person, temperature=0)` with `class Person(BaseModel): name: str; age:
/// int`, captured from the SDK byte for byte.
const SDK_RESPONSES_PARSE_BODY: &str = r#"{"model":"scripted","input":"Describe a fictional pirate captain.","temperature":0,"text":{"format":{"type":"json_schema","strict":true,"name":"Person","schema":{"properties":{"name":{"title":"Name","type":"string"},"age":{"title":"Age","type":"integer"}},"required":["name","age"],"title":"Person","type":"object","additionalProperties":false}}}}"#;

/// The body `anthropic` 2.14.0 sends for `client.messages.parse(model=ID,
/// max_tokens=100, messages=[...], output_format=Person)` (the beta's
/// `client.beta.messages.parse` sends the same `output_config`), captured byte for byte.
const SDK_MESSAGES_PARSE_BODY: &str = r#"{"max_tokens":100,"messages":[{"role":"user","content":"Describe a fictional pirate captain."}],"model":"scripted","output_config":{"format":{"schema":{"type":"object","title":"Person","properties":{"name":{"type":"string","title":"Name"},"age":{"type":"integer","title":"Age"}},"additionalProperties":false,"required":["name","age"]},"type":"json_schema"}}}"#;

/// `text.format` `json_schema` (the SDK's `responses.parse` body) asks the engine for
/// the schema's grammar and is echoed in the Response; `json_object` asks for any object;
/// `text` and no format ask for none; another type is a 400 naming the accepted ones.
#[test]
fn responses_text_format_becomes_the_grammar() {
    let d = Scripted::new("{\"name\": \"Ann\", \"age\": 3}", FinishReason::Stop);
    let srv = server(&d);
    let body: Value = serde_json::from_str(SDK_RESPONSES_PARSE_BODY).unwrap();
    let r = post(srv.addr, "/v1/responses", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let format = &body["text"]["format"];
    let want = GrammarSpec::JsonSchema {
        schema: format["schema"].clone(),
        name: format["name"].as_str().map(String::from),
        description: None,
        strict: format["strict"].as_bool(),
    };
    assert_eq!(d.last_grammar(), Some(want));
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["text"]["format"], body["text"]["format"], "{v}");

    for (format, want) in [
        (
            json!({"type": "json_object"}),
            Some(GrammarSpec::JsonObject),
        ),
        (json!({"type": "text"}), None),
    ] {
        let b = json!({"model": ID, "input": "hi", "text": {"format": format}});
        let r = post(srv.addr, "/v1/responses", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(d.last_grammar(), want, "{format}");
        assert_eq!(r.json()["text"]["format"], format);
    }
    let r = post(
        srv.addr,
        "/v1/responses",
        &json!({"model": ID, "input": "hi"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(d.last_grammar(), None);
    assert_eq!(r.json()["text"]["format"], json!({"type": "text"}));

    let b = json!({"model": ID, "input": "hi", "text": {"format": {"type": "xml"}}});
    let r = post(srv.addr, "/v1/responses", &b);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("json_schema"), "{}", r.body);
}

/// `output_config.format` (the SDK's `messages.parse` body) and the older beta's
/// top-level `output_format` ask the engine for the schema's grammar; both at once is a
/// 400; no format asks for none.
#[test]
fn anthropic_output_format_becomes_the_grammar() {
    let d = Scripted::new("{\"name\": \"Ann\", \"age\": 3}", FinishReason::Stop);
    let srv = server(&d);
    let body: Value = serde_json::from_str(SDK_MESSAGES_PARSE_BODY).unwrap();
    let schema = body["output_config"]["format"]["schema"].clone();
    let r = post(srv.addr, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["stop_reason"], "end_turn");
    assert_eq!(
        d.last_grammar(),
        Some(GrammarSpec::json_schema(schema.clone()))
    );

    let mut beta = body.clone();
    beta["output_format"] = beta["output_config"]["format"].take();
    beta.as_object_mut().unwrap().remove("output_config");
    let r = post(srv.addr, "/v1/messages", &beta);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(d.last_grammar(), Some(GrammarSpec::json_schema(schema)));

    let mut both = body.clone();
    both["output_format"] = body["output_config"]["format"].clone();
    let r = post(srv.addr, "/v1/messages", &both);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("output_format"), "{}", r.body);

    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("output_config");
    let r = post(srv.addr, "/v1/messages", &plain);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(d.last_grammar(), None);
}

/// The mock engine cannot constrain its output: each wire's format field is a 400
/// naming it, never a reply that silently ignores it.
#[test]
fn an_engine_that_cannot_constrain_refuses_each_format_field() {
    let srv = start(
        Arc::new(fak_engine::mock::MockDriver::new()),
        GatewayConfig::default(),
    );
    let mut b: Value = serde_json::from_str(SDK_RESPONSES_PARSE_BODY).unwrap();
    b["model"] = json!("mock");
    let r = post(srv.addr, "/v1/responses", &b);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("text.format"), "{}", r.body);

    let mut b: Value = serde_json::from_str(SDK_MESSAGES_PARSE_BODY).unwrap();
    b["model"] = json!("mock");
    let r = post(srv.addr, "/v1/messages", &b);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("output_config.format"), "{}", r.body);
    b["output_format"] = b["output_config"]["format"].take();
    b.as_object_mut().unwrap().remove("output_config");
    let r = post(srv.addr, "/v1/messages", &b);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("output_format"), "{}", r.body);
}

/// `grammar` on Chat Completions and Completions asks the engine for that Lark grammar;
/// with a `response_format` other than `text` it is a 400, as GBNF and an empty one
/// are; an engine that cannot constrain refuses it naming `grammar`.
#[test]
fn the_grammar_field_becomes_the_grammar() {
    let d = Scripted::new("yes", FinishReason::Stop);
    let srv = server(&d);
    let lark = r#"start: "yes" | "no""#;
    let chat =
        json!({"model": ID, "grammar": lark, "messages": [{"role": "user", "content": "hi"}]});
    let r = post(srv.addr, "/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(d.last_grammar(), Some(GrammarSpec::Lark(lark.into())));
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": ID, "grammar": lark, "prompt": "hi"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(d.last_grammar(), Some(GrammarSpec::Lark(lark.into())));

    let mut both = chat.clone();
    both["response_format"] = json!({"type": "json_object"});
    let mut gbnf = chat.clone();
    gbnf["grammar"] = json!("root ::= \"yes\"");
    let mut empty = chat.clone();
    empty["grammar"] = json!(" ");
    for (b, needle) in [(both, "not both"), (gbnf, "GBNF"), (empty, "empty")] {
        let r = post(srv.addr, "/v1/chat/completions", &b);
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body.contains(needle), "{}", r.body);
    }
    let mut text = chat.clone();
    text["response_format"] = json!({"type": "text"});
    assert_eq!(post(srv.addr, "/v1/chat/completions", &text).status, 200);

    let mock = start(
        Arc::new(fak_engine::mock::MockDriver::new()),
        GatewayConfig::default(),
    );
    let mut b = chat.clone();
    b["model"] = json!("mock");
    let r = post(mock.addr, "/v1/chat/completions", &b);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("`grammar`"), "{}", r.body);
}

// ---------------------------------------------------------------------------------------
// Upstream mode: the format forwarded to the upstream, its reply checked here.
//
// The upstream is a gateway over `Scripted` (which says it constrains its output, so
// that gateway takes the format and records the grammar it became); the front, which
// the test talks to, is a gateway over an upstream driver pointing at it.

/// A front over `wire`'s upstream driver in front of a gateway over `d`, both ready.
/// Keep both servers alive for the test.
fn upstream_pair(d: &Arc<Scripted>, wire: fak_upstream::Wire) -> (common::Server, common::Server) {
    let up = server(d);
    let cfg = fak_upstream::UpstreamConfig {
        base_urls: vec![format!("http://{}", up.addr)],
        timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(10),
        retries: 0,
        health_interval: Duration::from_millis(200),
        ..fak_upstream::UpstreamConfig::default()
    };
    let driver = fak_upstream::UpstreamDriver::start_wire(cfg, wire).unwrap();
    let front = start(Arc::new(driver), GatewayConfig::default());
    let t = Instant::now();
    while common::get(front.addr, "/health").status != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the front never got ready"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (front, up)
}

/// The schema `SDK_RESPONSES_PARSE_BODY` asks for (the SDK's strict `Person`).
fn person_format() -> Value {
    let b: Value = serde_json::from_str(SDK_RESPONSES_PARSE_BODY).unwrap();
    b["text"]["format"].clone()
}

fn chat_with_format(format: Value, stream: bool) -> Value {
    json!({
        "model": ID,
        "messages": [{"role": "user", "content": "Describe a pirate."}],
        "response_format": format,
        "stream": stream,
    })
}

/// The Chat Completions `response_format` of the SDK's `parse(response_format=Person)`.
fn person_response_format() -> Value {
    let f = person_format();
    json!({"type": "json_schema", "json_schema": {
        "name": f["name"], "strict": f["strict"], "schema": f["schema"]}})
}

/// On the OpenAI wire, `response_format` reaches the upstream as the client sent it
/// (JSON mode; a schema with its name and `strict`), and so does a Responses request's
/// `text.format` (sent as the chat request's `response_format`); a Lark `grammar` has
/// no portable upstream form and is a 400 naming it.
#[test]
fn openai_upstream_is_sent_the_format_as_the_client_gave_it() {
    let d = Scripted::new(r#"{"name": "Ann", "age": 3}"#, FinishReason::Stop);
    let (front, _up) = upstream_pair(&d, fak_upstream::Wire::OpenAi);
    let f = person_format();
    let want = GrammarSpec::JsonSchema {
        schema: f["schema"].clone(),
        name: Some("Person".into()),
        description: None,
        strict: Some(true),
    };

    let r = post(
        front.addr,
        "/v1/chat/completions",
        &chat_with_format(person_response_format(), false),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(d.last_grammar(), Some(want.clone()));
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        r#"{"name": "Ann", "age": 3}"#
    );

    let r = post(
        front.addr,
        "/v1/chat/completions",
        &chat_with_format(json!({"type": "json_object"}), false),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(d.last_grammar(), Some(GrammarSpec::JsonObject));

    let r = post(
        front.addr,
        "/v1/responses",
        &serde_json::from_str(SDK_RESPONSES_PARSE_BODY).unwrap(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(d.last_grammar(), Some(want));

    let mut b = chat_with_format(json!({"type": "text"}), false);
    b["grammar"] = json!("start: \"yes\" | \"no\"");
    let r = post(front.addr, "/v1/chat/completions", &b);
    assert_eq!(r.status, 400, "{}", r.body);
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(m.contains("`grammar`") && m.contains("Lark"), "{m}");
}

/// On the Anthropic wire, the client's `output_config.format` goes in its own body,
/// and a chat request's `response_format` is sent as `output_config.format` (its name
/// has no Anthropic field).
#[test]
fn anthropic_upstream_is_sent_the_format() {
    let d = Scripted::new(r#"{"name": "Ann", "age": 3}"#, FinishReason::Stop);
    let (front, _up) = upstream_pair(&d, fak_upstream::Wire::Anthropic);
    let body: Value = serde_json::from_str(SDK_MESSAGES_PARSE_BODY).unwrap();
    let r = post(front.addr, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        d.last_grammar(),
        Some(GrammarSpec::json_schema(
            body["output_config"]["format"]["schema"].clone()
        ))
    );
    assert_eq!(
        r.json()["content"][0]["text"],
        r#"{"name": "Ann", "age": 3}"#
    );

    let r = post(
        front.addr,
        "/v1/chat/completions",
        &chat_with_format(person_response_format(), false),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        d.last_grammar(),
        Some(GrammarSpec::json_schema(person_format()["schema"].clone()))
    );
}

/// The `data:` payloads of an Anthropic stream with their event names.
fn named_events(body: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut name = String::new();
    for l in body.lines() {
        if let Some(n) = l.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = l.strip_prefix("data: ") {
            out.push((
                name.clone(),
                serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")),
            ));
        }
    }
    out
}

/// A reply that breaks the schema is a 502 on Chat Completions naming the first
/// failure, never a 200; streamed, its text has gone out and the stream ends with an
/// `error` chunk in place of the finish; a reply that is not JSON is named so; a reply
/// cut off by `max_tokens` is `length`, not a schema error; JSON mode takes any object
/// and nothing else.
#[test]
fn openai_upstream_replies_are_checked_against_the_format() {
    let d = Scripted::new(r#"{"name": "Ann"}"#, FinishReason::Stop);
    let (front, _up) = upstream_pair(&d, fak_upstream::Wire::OpenAi);
    let url = "/v1/chat/completions";

    let r = post(
        front.addr,
        url,
        &chat_with_format(person_response_format(), false),
    );
    assert_eq!(r.status, 502, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["type"], "api_error", "{e}");
    let m = e["message"].as_str().unwrap();
    assert!(
        m.contains("response format") && m.contains("\"age\" is a required property"),
        "{m}"
    );

    let r = post(
        front.addr,
        url,
        &chat_with_format(person_response_format(), true),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let chunks = sse_data(&r.body);
    assert!(
        chunks
            .iter()
            .any(|c| c["choices"][0]["delta"]["content"] == r#"{"name": "Ann"}"#),
        "{}",
        r.body
    );
    let err = chunks
        .iter()
        .find(|c| c.get("error").is_some())
        .unwrap_or_else(|| panic!("no error chunk: {}", r.body));
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("\"age\""),
        "{err}"
    );
    assert!(
        chunks
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()),
        "a finish after the error: {}",
        r.body
    );

    d.answer(r#"{"name": "Ann", "age": "#, FinishReason::Stop);
    let r = post(
        front.addr,
        url,
        &chat_with_format(person_response_format(), false),
    );
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(r.body.contains("not JSON"), "{}", r.body);

    d.answer(r#"{"name": "Ann", "age": "#, FinishReason::Length);
    for stream in [false, true] {
        let r = post(
            front.addr,
            url,
            &chat_with_format(person_response_format(), stream),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let finish = if stream {
            sse_data(&r.body)
                .into_iter()
                .find_map(|c| c["choices"][0]["finish_reason"].as_str().map(String::from))
        } else {
            r.json()["choices"][0]["finish_reason"]
                .as_str()
                .map(String::from)
        };
        assert_eq!(finish.as_deref(), Some("length"), "{}", r.body);
    }

    d.answer("[1, 2]", FinishReason::Stop);
    let r = post(
        front.addr,
        url,
        &chat_with_format(json!({"type": "json_object"}), false),
    );
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(r.body.contains("not a JSON object"), "{}", r.body);
    d.answer(r#"{"any": ["thing"]}"#, FinishReason::Stop);
    let r = post(
        front.addr,
        url,
        &chat_with_format(json!({"type": "json_object"}), true),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        sse_data(&r.body)
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "stop"),
        "{}",
        r.body
    );
}

/// On the Anthropic wire the same: a 502 in Anthropic's error shape, not a 200;
/// streamed, an `error` event and no `message_stop`; a reply that validates is served.
#[test]
fn anthropic_upstream_replies_are_checked_against_the_format() {
    let d = Scripted::new(r#"{"name": 7, "age": 3}"#, FinishReason::Stop);
    let (front, _up) = upstream_pair(&d, fak_upstream::Wire::Anthropic);
    let body: Value = serde_json::from_str(SDK_MESSAGES_PARSE_BODY).unwrap();

    let r = post(front.addr, "/v1/messages", &body);
    assert_eq!(r.status, 502, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "api_error", "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("at /name") && m.contains("string"), "{m}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post(front.addr, "/v1/messages", &streamed);
    assert_eq!(r.status, 200, "{}", r.body);
    let events = named_events(&r.body);
    let (_, err) = events
        .iter()
        .find(|(n, _)| n == "error")
        .unwrap_or_else(|| panic!("no error event: {}", r.body));
    assert_eq!(err["type"], "error", "{err}");
    assert!(
        err["error"]["message"].as_str().unwrap().contains("/name"),
        "{err}"
    );
    assert!(
        events.iter().all(|(n, _)| n != "message_stop"),
        "a message_stop after the error: {}",
        r.body
    );

    d.answer(r#"{"name": "Ann", "age": 3}"#, FinishReason::Stop);
    let r = post(front.addr, "/v1/messages", &streamed);
    assert_eq!(r.status, 200, "{}", r.body);
    let events = named_events(&r.body);
    assert!(
        events.iter().any(|(n, _)| n == "message_stop"),
        "{}",
        r.body
    );
    assert!(events.iter().all(|(n, _)| n != "error"), "{}", r.body);
}
