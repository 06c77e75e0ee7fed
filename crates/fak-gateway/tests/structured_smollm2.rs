//! Structured outputs over HTTP (`response_format` on `/v1/chat/completions`) on the
//! real SmolLM2-135M-Instruct: the official `openai` SDK's `chat.completions.parse`
//! request gets content that validates against its schema (checked by the
//! `jsonschema` crate, not by our grammar code), JSON mode gets an object, a schema
//! that does not compile is a 400 naming the construct, and an engine that cannot
//! constrain its output refuses `response_format` instead of ignoring it.
//!
//! Without the model file the real-model tests fail with the fetch command
//! (`FAK_SKIP_REAL_MODEL=1` reports them as ignored, never in CI).

mod common;

use common::{post, smollm2_server, start, Server};
use fak_engine::mock::MockDriver;
use fak_engine::EngineConfig;
use fak_gateway::GatewayConfig;
use fak_model::WeightMode;
use serde_json::{json, Value};
use std::sync::Arc;

const ID: &str = common::SMOLLM2_ID;

/// The body `openai` 3.57.0 (pydantic 2.14.4) sends for
/// `client.chat.completions.parse(model=ID, messages=[...], response_format=Person,
/// temperature=0)` with `class Person(BaseModel): name: str; age: int`, captured from
/// the SDK byte for byte.
const SDK_PARSE_BODY: &str = r#"{"model":"smollm2-135m-instruct","stream":false,"messages":[{"role":"user","content":"Tell me about a famous scientist: their name and their age when they died."}],"response_format":{"type":"json_schema","json_schema":{"schema":{"properties":{"name":{"title":"Name","type":"string"},"age":{"title":"Age","type":"integer"}},"required":["name","age"],"title":"Person","type":"object","additionalProperties":false},"name":"Person","strict":true}},"temperature":0}"#;

fn server() -> Server {
    smollm2_server(WeightMode::Native, EngineConfig::default())
}

fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {v}"))
}

#[fak_testkit::real_model]
fn sdk_parse_request_gets_content_valid_for_its_schema() {
    let srv = server();
    let body: Value = serde_json::from_str(SDK_PARSE_BODY).unwrap();
    let schema = body["response_format"]["json_schema"]["schema"].clone();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let prompts = [
        "Tell me about a famous scientist: their name and their age when they died.",
        "Describe a fictional pirate captain.",
        "Who wrote Hamlet, and how old was he when he died?",
        "Invent a character for a children's story.",
    ];
    for (i, prompt) in prompts.iter().enumerate() {
        let mut b = body.clone();
        b["messages"][0]["content"] = json!(prompt);
        if i % 2 == 1 {
            b["temperature"] = json!(1.0);
            b["seed"] = json!(i);
        }
        let r = post(srv.addr, "/v1/chat/completions", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let text = content(&v);
        let out: Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
        let errors: Vec<String> = validator.iter_errors(&out).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{prompt:?} -> {text}: {errors:?}");
        println!("{prompt:?} -> {text}");
    }
}

#[fak_testkit::real_model]
fn json_mode_gets_an_object() {
    let srv = server();
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({
            "model": ID,
            "messages": [{"role": "user", "content": "List three colours as JSON."}],
            "response_format": {"type": "json_object"},
            "temperature": 0,
            "max_tokens": 120
        }),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let text = content(&v);
    if v["choices"][0]["finish_reason"] == "stop" {
        let out: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(out.is_object(), "{text}");
    } else {
        // Cut by max_tokens: still a prefix of a JSON object.
        assert!(text.starts_with('{'), "{text}");
    }
}

#[fak_testkit::real_model]
fn a_schema_that_does_not_compile_is_a_400_naming_it() {
    let srv = server();
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({
            "model": ID,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "X",
                "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
            }}
        }),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("not"), "{msg}");
}

/// The mock engine cannot constrain its output: `response_format` is a 400 naming
/// the field, never a reply that silently ignores it.
#[test]
fn an_engine_that_cannot_constrain_refuses_response_format() {
    let srv = start(Arc::new(MockDriver::new()), GatewayConfig::default());
    for rf in [
        json!({"type": "json_object"}),
        json!({"type": "json_schema", "json_schema": {"name": "X", "schema": {"type": "object"}}}),
    ] {
        let r = post(
            srv.addr,
            "/v1/chat/completions",
            &json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "response_format": rf}),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains("response_format"), "{msg}");
    }
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text"}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

/// The body `openai` 3.57.0 sends for `client.responses.parse(model=ID, input=...,
/// text_format=Person, temperature=0)` (Person as above), captured byte for byte.
const SDK_RESPONSES_PARSE_BODY: &str = r#"{"model":"smollm2-135m-instruct","input":"Describe a fictional pirate captain.","temperature":0,"text":{"format":{"type":"json_schema","strict":true,"name":"Person","schema":{"properties":{"name":{"title":"Name","type":"string"},"age":{"title":"Age","type":"integer"}},"required":["name","age"],"title":"Person","type":"object","additionalProperties":false}}}}"#;

/// The body `anthropic` 2.14.0 sends for `client.messages.parse(model=ID,
/// max_tokens=100, messages=[...], output_format=Person)`, captured byte for byte.
const SDK_MESSAGES_PARSE_BODY: &str = r#"{"max_tokens":100,"messages":[{"role":"user","content":"Describe a fictional pirate captain."}],"model":"smollm2-135m-instruct","output_config":{"format":{"schema":{"type":"object","title":"Person","properties":{"name":{"type":"string","title":"Name"},"age":{"type":"integer","title":"Age"}},"additionalProperties":false,"required":["name","age"]},"type":"json_schema"}}}"#;

/// `text` parsed as JSON and checked against `schema` by the `jsonschema` crate.
fn assert_valid(schema: &Value, text: &str) {
    let validator = jsonschema::validator_for(schema).unwrap();
    let out: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let errors: Vec<String> = validator.iter_errors(&out).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{text}: {errors:?}");
}

const PROMPTS: [&str; 3] = [
    "Describe a fictional pirate captain.",
    "Who wrote Hamlet, and how old was he when he died?",
    "Invent a character for a children's story.",
];

/// The Responses API's `text.format` (the SDK's `responses.parse` body): the
/// Response completes and its `output_text` validates against the schema.
#[fak_testkit::real_model]
fn responses_parse_request_gets_output_valid_for_its_schema() {
    let srv = server();
    let body: Value = serde_json::from_str(SDK_RESPONSES_PARSE_BODY).unwrap();
    let schema = body["text"]["format"]["schema"].clone();
    for prompt in PROMPTS {
        let mut b = body.clone();
        b["input"] = json!(prompt);
        let r = post(srv.addr, "/v1/responses", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["status"], "completed", "{v}");
        let text = v["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("no output text: {v}"));
        assert_valid(&schema, text);
        println!("{prompt:?} -> {text}");
    }
}

/// Anthropic structured outputs (the SDK's `messages.parse` body, `output_config.format`):
/// the reply ends `end_turn` and its text validates against the schema.
#[fak_testkit::real_model]
fn messages_parse_request_gets_text_valid_for_its_schema() {
    let srv = server();
    let body: Value = serde_json::from_str(SDK_MESSAGES_PARSE_BODY).unwrap();
    let schema = body["output_config"]["format"]["schema"].clone();
    for prompt in PROMPTS {
        let mut b = body.clone();
        b["messages"][0]["content"] = json!(prompt);
        b["temperature"] = json!(0);
        let r = post(srv.addr, "/v1/messages", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["stop_reason"], "end_turn", "{v}");
        let text = v["content"][0]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("no text: {v}"));
        assert_valid(&schema, text);
        println!("{prompt:?} -> {text}");
    }
}

/// A user's own Lark grammar (`grammar`) on Chat Completions and Completions: the
/// reply is one of the grammar's sentences; GBNF and a grammar that does not compile
/// are 400s naming why.
#[fak_testkit::real_model]
fn a_lark_grammar_constrains_chat_and_completions() {
    let srv = server();
    let lark = r##"start: ("yes" | "no") " because " /[a-z ]{1,40}/ ".""##;
    let ok = |t: &str| {
        let rest = t
            .strip_prefix("yes because ")
            .or_else(|| t.strip_prefix("no because "))
            .unwrap_or_else(|| panic!("{t:?}"));
        let body = rest.strip_suffix('.').unwrap_or_else(|| panic!("{t:?}"));
        assert!(
            (1..=40).contains(&body.len())
                && body.bytes().all(|b| b.is_ascii_lowercase() || b == b' '),
            "{t:?}"
        );
    };
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"model": ID, "temperature": 0, "grammar": lark,
                "messages": [{"role": "user", "content": "Is the sky blue?"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    ok(content(&v));
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": ID, "temperature": 0, "grammar": lark, "max_tokens": 60,
                "prompt": "Q: Is water wet?\nA:"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    ok(v["choices"][0]["text"].as_str().unwrap());

    for (grammar, needle) in [
        ("root ::= \"yes\" | \"no\"", "GBNF"),
        ("start: (", "grammar"),
    ] {
        let r = post(
            srv.addr,
            "/v1/chat/completions",
            &json!({"model": ID, "grammar": grammar,
                    "messages": [{"role": "user", "content": "hi"}]}),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains(needle), "{msg}");
    }
}

/// Stop strings are not matched inside a constrained reply: the grammar decides where
/// it ends. A schema reply holds `"`, `,` and `:` at every key, so with these stops
/// it was cut at its first key (`finish_reason: "stop"`, content `{`); now it is whole
/// JSON valid for the schema, on Chat Completions and Completions.
#[fak_testkit::real_model]
fn stop_strings_do_not_cut_a_constrained_reply() {
    let srv = server();
    let body: Value = serde_json::from_str(SDK_PARSE_BODY).unwrap();
    let schema = body["response_format"]["json_schema"]["schema"].clone();
    for stop in [json!("\""), json!([",", ":"])] {
        let mut b = body.clone();
        b["stop"] = stop.clone();
        b["max_tokens"] = json!(100);
        let r = post(srv.addr, "/v1/chat/completions", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert_valid(&schema, content(&v));

        let r = post(
            srv.addr,
            "/v1/completions",
            &json!({"model": ID, "temperature": 0, "max_tokens": 100, "stop": stop,
                    "prompt": "A famous scientist as JSON:",
                    "grammar": "start: %json { \"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\"}}, \"required\": [\"name\"], \"additionalProperties\": false }"}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let text = v["choices"][0]["text"].as_str().unwrap();
        let out: Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
        assert!(out["name"].is_string(), "{text}");
    }
}

/// A grammar whose language is empty (a rule that recurses with no base case) is a
/// 400 saying the grammar accepts no output, before any token is generated, on each
/// way a request gives one; it was an empty reply finished `grammar_dead_end`.
#[fak_testkit::real_model]
fn a_grammar_with_an_empty_language_is_a_400() {
    let srv = server();
    let never = json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]});
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": ID, "messages": [{"role": "user", "content": "hi"}],
                   "grammar": "start: a\na: \"x\" a"}),
        ),
        (
            "/v1/completions",
            json!({"model": ID, "prompt": "hi", "grammar": "start: a\na: \"x\" a"}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": ID, "messages": [{"role": "user", "content": "hi"}],
                   "response_format": {"type": "json_schema",
                        "json_schema": {"name": "Never", "schema": never}}}),
        ),
    ] {
        let r = post(srv.addr, path, &body);
        assert_eq!(r.status, 400, "{path} {body}: {}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains("accepts no output"), "{msg}");
    }
}

/// `response_format` on `/v1/completions` (vLLM takes it there) constrains the reply:
/// a `json_schema` gives JSON valid for it (it was ignored: free text, not JSON).
#[fak_testkit::real_model]
fn completions_response_format_gives_valid_json() {
    let srv = server();
    let body: Value = serde_json::from_str(SDK_PARSE_BODY).unwrap();
    let format = body["response_format"].clone();
    let schema = format["json_schema"]["schema"].clone();
    for prompt in ["Q: Who was Marie Curie?\nA:", "The captain of the ship was"] {
        let r = post(
            srv.addr,
            "/v1/completions",
            &json!({"model": ID, "prompt": prompt, "temperature": 0, "max_tokens": 100,
                    "response_format": format}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert_valid(&schema, v["choices"][0]["text"].as_str().unwrap());
    }
}

/// A reply held to a JSON format is that JSON, not tool-call markup: a string value
/// that reads `<tool_call>` (forced here by a `const`) reaches the client as the JSON
/// the schema asked for, with tools offered under `auto` or none offered, and no call
/// is reported.
#[fak_testkit::real_model]
fn a_json_format_reply_is_not_parsed_for_tool_calls() {
    let srv = server();
    let schema = json!({"type": "object", "properties": {"t": {"const": "<tool_call>"}},
        "required": ["t"], "additionalProperties": false});
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    for offered in [true, false] {
        let mut body = json!({"model": ID, "temperature": 0, "max_tokens": 30,
            "messages": [{"role": "user", "content": "Say something."}],
            "response_format": {"type": "json_schema",
                "json_schema": {"name": "T", "schema": schema}}});
        if offered {
            body["tools"] = tools.clone();
        }
        let r = post(srv.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(content(&v), r#"{"t": "<tool_call>"}"#, "{v}");
        assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
        assert!(
            v["fak"]["tool_calls"]
                .as_array()
                .is_none_or(|a| a.is_empty()),
            "{v}"
        );
    }
}

/// A continued final assistant message (Anthropic's prefill) under a response format is
/// a 400 naming the conflict, before any token: the constrained reply would start after
/// the prefilled text, so the two together would not be valid JSON.
#[fak_testkit::real_model]
fn a_prefilled_reply_under_a_format_is_a_400() {
    let srv = server();
    let mut body: Value = serde_json::from_str(SDK_MESSAGES_PARSE_BODY).unwrap();
    body["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": "{\"name\": \""}));
    let r = post(srv.addr, "/v1/messages", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("continued") && msg.contains("format"), "{msg}");
    // Without the format the same prefill is answered.
    body.as_object_mut().unwrap().remove("output_config");
    let r = post(srv.addr, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
}
