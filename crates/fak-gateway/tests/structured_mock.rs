//! Structured outputs on every wire, without a model: a scripted driver that says it
//! constrains its output, records the grammar each request asked for, and answers a
//! set text with a set finish reason. What it checks is the gateway's part: which
//! [`GrammarSpec`] each wire's field becomes, and how a grammar's dead end
//! ([`FinishReason::GrammarDeadEnd`]) is told on each wire (the finish word for a reply
//! cut short, and `fak.finish_detail: "grammar_dead_end"`). The in-kernel engine's
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

const ID: &str = "scripted";

/// Answers every request with `text` and `finish`, and keeps the last request's grammar.
struct Scripted {
    text: String,
    finish: FinishReason,
    grammar: Mutex<Option<Option<GrammarSpec>>>,
}

impl Scripted {
    fn new(text: &str, finish: FinishReason) -> Arc<Self> {
        Arc::new(Scripted {
            text: text.into(),
            finish,
            grammar: Mutex::new(None),
        })
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
        sink.send(EngineEvent::Text(self.text.clone()));
        sink.send(EngineEvent::Done(Done {
            completion_tokens: 2,
            completion_ids: vec![1, 2],
            finish_reason: self.finish,
            stop_sequence: None,
            ttft_s: 0.0,
            decode_s: 0.0,
            prompt_usage: None,
        }));
        Ok(stream)
    }
}

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
    let schema = body["text"]["format"]["schema"].clone();
    assert_eq!(d.last_grammar(), Some(GrammarSpec::JsonSchema(schema)));
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
        Some(GrammarSpec::JsonSchema(schema.clone()))
    );

    let mut beta = body.clone();
    beta["output_format"] = beta["output_config"]["format"].take();
    beta.as_object_mut().unwrap().remove("output_config");
    let r = post(srv.addr, "/v1/messages", &beta);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(d.last_grammar(), Some(GrammarSpec::JsonSchema(schema)));

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
