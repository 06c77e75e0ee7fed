//! Tool calls on the real SmolLM2-135M-Instruct, constrained to the call grammar
//! of the offered tools (issue 27): with `tool_choice: "required"` (OpenAI Chat
//! Completions), a named function, and Anthropic `{"type": "any"}` / `{"type": "tool"}`,
//! the reply is one call that names an offered tool (the named one for a named choice)
//! and, unless `max_tokens` cuts it off (then denied `TRUNCATED`), reads as a
//! call with arguments valid for that tool's schema, checked here by
//! the `jsonschema` crate against the schema the client sent (not by our grammar code).
//! The boundary still adjudicates each call: a call of a tool the policy does not allow
//! is denied with its reason, constrained or not. Under `tool_choice: "auto"` (Chat
//! Completions, Responses and Anthropic) the reply is free text, the same text as
//! unconstrained, until the model writes `<tool_call>`; the call it then writes is
//! constrained in the same way.
//!
//! Without the model file the real-model tests fail with the fetch command
//! (`FAK_SKIP_REAL_MODEL=1` reports them as ignored, never in CI).

mod common;

use common::{post, smollm2_server, Server};
use fak_engine::EngineConfig;
use fak_model::WeightMode;
use serde_json::{json, Value};

const ID: &str = common::SMOLLM2_ID;

fn server(constrain: bool) -> Server {
    let cfg = EngineConfig {
        constrain_tool_calls: constrain,
        ..EngineConfig::default()
    };
    smollm2_server(WeightMode::Native, cfg)
}

/// The tools offered, in the OpenAI Chat Completions shape, with schemas as clients
/// send them: with and without `additionalProperties`, one without `type`, an enum, an
/// integer, a nested object, and one with no parameters at all.
fn openai_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "search_flights",
            "description": "Find flights between two airports on a date",
            "parameters": {"properties": {
                "origin": {"type": "string"}, "destination": {"type": "string"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["origin", "destination", "passengers"]}}},
        {"type": "function", "function": {"name": "send_email",
            "description": "Send an email",
            "parameters": {"type": "object", "properties": {
                "to": {"type": "string"},
                "message": {"type": "object", "properties": {
                    "subject": {"type": "string"}, "body": {"type": "string"}},
                    "required": ["subject", "body"]}},
                "required": ["to", "message"]}}},
        {"type": "function", "function": {"name": "get_time",
            "description": "The current time"}}
    ])
}

/// `tools` (the OpenAI shape) in Anthropic's shape (`name`, `description`,
/// `input_schema`).
fn anthropic_tools(tools: &Value) -> Vec<Value> {
    tools
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let f = &t["function"];
            json!({"name": f["name"], "description": f["description"],
                "input_schema": f.get("parameters").cloned().unwrap_or(json!({"type": "object"}))})
        })
        .collect()
}

/// The client's schema of `name`'s arguments (`{}` when it gave none, which any
/// object satisfies).
fn schema_of(tools: &Value, name: &str) -> Option<Value> {
    tools.as_array()?.iter().find_map(|t| {
        let f = &t["function"];
        (f["name"] == name).then(|| f.get("parameters").cloned().unwrap_or(json!({})))
    })
}

/// Asserts that call report `r` of reply `v` is a well-formed call's: the grammar holds
/// within the budget, so a call is never denied `UNKNOWN_TOOL` or `MALFORMED`, and
/// `TRUNCATED` only when `max_tokens` cut the reply off (`v` at JSON pointer `finish`
/// is `cut`: `length`, `max_tokens` or `incomplete` by wire).
fn assert_well_formed(v: &Value, r: &Value, finish: &str, cut: &str) {
    assert_ne!(r["reason"], "UNKNOWN_TOOL", "{v}");
    assert_ne!(r["reason"], "MALFORMED", "{v}");
    if r["reason"] == "TRUNCATED" {
        assert_eq!(v.pointer(finish), Some(&Value::from(cut)), "{v}");
    }
}

/// Checks one OpenAI reply's proposed calls (from the `fak` report, which lists every
/// call whatever its verdict) and returns them as `(name, verdict, reason)`; the
/// arguments of each allowed call are checked against the client's schema.
fn check_calls(v: &Value, tools: &Value, only: Option<&str>) -> Vec<(String, String, String)> {
    let report = v["fak"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no call was proposed: {v}"));
    assert!(!report.is_empty(), "{v}");
    let passed = v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut out = Vec::new();
    for r in report {
        let name = r["name"].as_str().unwrap_or("").to_string();
        let reason = r["reason"].as_str().unwrap_or("").to_string();
        assert_well_formed(v, r, "/choices/0/finish_reason", "length");
        let schema = schema_of(tools, &name).unwrap_or_else(|| panic!("not offered: {v}"));
        if let Some(n) = only {
            assert_eq!(name, n, "{v}");
        }
        if let Some(c) = passed.iter().find(|c| c["id"] == r["id"]) {
            let text = c["function"]["arguments"].as_str().unwrap();
            let args: Value = serde_json::from_str(text).unwrap();
            let validator = jsonschema::validator_for(&schema).unwrap();
            let errors: Vec<String> = validator
                .iter_errors(&args)
                .map(|e| e.to_string())
                .collect();
            assert!(errors.is_empty(), "{name}({text}): {errors:?}");
        }
        out.push((
            name,
            r["verdict"].as_str().unwrap_or("").to_string(),
            reason,
        ));
    }
    out
}

const PROMPTS: [&str; 4] = [
    "What's the weather like in Lisbon right now?",
    "Book me something: two people flying from Oslo to Rome.",
    "Email bob@example.com that the meeting moved to Friday.",
    "What time is it?",
];

fn chat(prompt: &str, tools: &Value, choice: Value) -> Value {
    json!({
        "model": ID,
        "messages": [{"role": "user", "content": prompt}],
        "tools": tools,
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": 200
    })
}

/// Sends [`chat`]'s body to Chat Completions (`choice`: its `tool_choice`; `None`: left
/// out) and returns the reply, asserting 200 and printing its `fak` report.
fn chat_reply(srv: &Server, prompt: &str, tools: &Value, choice: Option<Value>) -> Value {
    let mut body = chat(prompt, tools, choice.clone().unwrap_or(Value::Null));
    if choice.is_none() {
        body.as_object_mut().unwrap().remove("tool_choice");
    }
    let r = post(srv.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    println!("{prompt:?} -> {}", v["fak"]);
    v
}

/// Sends `prompt` with `tools` ([`anthropic_tools`]) and `choice` to `/v1/messages` and
/// returns the reply and its `tool_use` blocks' count, asserting: 200, no call denied
/// `UNKNOWN_TOOL` or `MALFORMED` (one denied `TRUNCATED` only when `max_tokens` cut the
/// reply off), and
/// each `tool_use` block's `input` valid for its tool's `input_schema` (`jsonschema`).
fn anthropic_reply(srv: &Server, tools: &[Value], prompt: &str, choice: Value) -> (Value, usize) {
    let body = json!({
        "model": ID, "max_tokens": 200, "temperature": 0,
        "messages": [{"role": "user", "content": prompt}],
        "tools": tools, "tool_choice": choice
    });
    let r = post(srv.addr, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    println!("{prompt:?} -> {}", v["fak"]);
    for r in v["fak"]["tool_calls"].as_array().into_iter().flatten() {
        assert_well_formed(&v, r, "/stop_reason", "max_tokens");
    }
    let mut blocks = 0;
    for block in v["content"].as_array().unwrap() {
        if block["type"] == "tool_use" {
            blocks += 1;
            let t = tools.iter().find(|t| t["name"] == block["name"]).unwrap();
            let validator = jsonschema::validator_for(&t["input_schema"]).unwrap();
            assert!(validator.is_valid(&block["input"]), "{block}");
        }
    }
    (v, blocks)
}

#[fak_testkit::real_model]
fn required_calls_name_an_offered_tool_with_valid_arguments() {
    let srv = server(true);
    let tools = openai_tools();
    let mut verdicts = Vec::new();
    for prompt in PROMPTS {
        let v = chat_reply(&srv, prompt, &tools, Some(json!("required")));
        let calls = check_calls(&v, &tools, None);
        assert_eq!(calls.len(), 1, "{v}");
        verdicts.extend(calls);
    }
    // The boundary still decides: a read-shaped call is allowed, `send_email` is not
    // under the built-in policy whoever wrote it.
    assert!(
        verdicts.iter().any(|(_, v, _)| v == "allow"),
        "{verdicts:?}"
    );
    for (name, verdict, _) in &verdicts {
        if name == "send_email" {
            assert_eq!(verdict, "deny", "{verdicts:?}");
        }
    }
}

/// A forced call that `max_tokens` cuts off before its arguments are whole: denied
/// `TRUNCATED` (not `MALFORMED`: the budget cut it, the model did not write it wrong),
/// never passed on, and the reply's finish reason stays `length`. On both wires.
#[fak_testkit::real_model]
fn a_call_max_tokens_cuts_off_is_denied_truncated() {
    let srv = server(true);
    let tools = openai_tools();
    let mut body = chat(PROMPTS[0], &tools, json!("required"));
    body["max_tokens"] = json!(6);
    let r = post(srv.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
    let report = v["fak"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(report.len(), 1, "{v}");
    assert_eq!(report[0]["verdict"], "deny", "{v}");
    assert_eq!(report[0]["reason"], "TRUNCATED", "{v}");

    let r = post(
        srv.addr,
        "/v1/messages",
        &json!({"model": ID, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": PROMPTS[0]}],
                "tools": anthropic_tools(&tools), "tool_choice": {"type": "any"}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["stop_reason"], "max_tokens", "{v}");
    let report = v["fak"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(report.len(), 1, "{v}");
    assert_eq!(report[0]["reason"], "TRUNCATED", "{v}");
    assert!(
        v["content"]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| b["type"] != "tool_use"),
        "{v}"
    );
}

#[fak_testkit::real_model]
fn a_named_function_gets_one_call_of_that_function() {
    let srv = server(true);
    let tools = openai_tools();
    for (prompt, name) in
        PROMPTS
            .iter()
            .zip(["search_flights", "get_weather", "get_time", "get_weather"])
    {
        let choice = json!({"type": "function", "function": {"name": name}});
        let v = chat_reply(&srv, prompt, &tools, Some(choice));
        let calls = check_calls(&v, &tools, Some(name));
        assert_eq!(calls.len(), 1, "{v}");
    }
}

/// Anthropic `tool_choice` `any` and `tool` force a call whose `input` satisfies the
/// tool's `input_schema`.
#[fak_testkit::real_model]
fn anthropic_any_and_tool_choices_get_valid_tool_use_blocks() {
    let srv = server(true);
    let tools = anthropic_tools(&openai_tools());
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let choice = if i % 2 == 0 {
            json!({"type": "any"})
        } else {
            json!({"type": "tool", "name": "get_weather"})
        };
        let (v, _) = anthropic_reply(&srv, &tools, prompt, choice);
        let report = v["fak"]["tool_calls"]
            .as_array()
            .unwrap_or_else(|| panic!("{v}"));
        assert!(!report.is_empty(), "{v}");
        for r in report {
            if i % 2 == 1 {
                assert_eq!(r["name"], "get_weather", "{v}");
            }
        }
    }
}

/// The same required-call prompts without the grammar (the model's own continuation of
/// the forced head): the negative control. SmolLM2-135M does not write the call format
/// unaided, so at least one of these is denied MALFORMED or UNKNOWN_TOOL; the
/// constrained test above asserts none is.
#[fak_testkit::real_model]
fn without_the_grammar_some_forced_calls_are_malformed() {
    let srv = server(false);
    let tools = openai_tools();
    let mut bad = 0;
    for prompt in PROMPTS {
        let v = chat_reply(&srv, prompt, &tools, Some(json!("required")));
        bad += v["fak"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["reason"] == "MALFORMED" || r["reason"] == "UNKNOWN_TOOL")
            .count();
    }
    assert!(bad > 0, "every unconstrained call was well-formed");
}

/// Prompts on which SmolLM2-135M opens a call under `tool_choice: "auto"` (greedy,
/// with [`openai_tools`] offered). Asked plainly it answers in text and never writes
/// `<tool_call>`; asked to start with the tag, it does on these three, and without the
/// grammar writes no JSON after it.
const AUTO_PROMPTS: [&str; 3] = [
    "What's the weather like in Lisbon right now? Start your reply with <tool_call>",
    "How warm is it in Tokyo? Start your reply with <tool_call>",
    "What's the weather in Paris? Start your reply with <tool_call>",
];

/// The calls of one Chat Completions reply, from the `fak` report, as
/// `(name, reason)`; none when the model answered in text.
fn reported(v: &Value) -> Vec<(String, String)> {
    v["fak"]["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["name"].as_str().unwrap_or("").to_string(),
                r["reason"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// Under `tool_choice: "auto"` (and with no `tool_choice`, which means the same) the
/// reply is free text until the model writes `<tool_call>`; the call it then writes is
/// constrained: it names an offered tool and its arguments validate against the
/// client's schema (`jsonschema`; checked on the calls the policy allows, whose
/// arguments the reply carries). One call per reply: after `</tool_call>` only the end
/// of the turn is allowed. As for forced calls, a call `max_tokens` cuts off is denied
/// `TRUNCATED` (finish reason `length`; `check_calls`).
#[fak_testkit::real_model]
fn auto_calls_the_model_opens_are_well_formed() {
    let srv = server(true);
    let tools = openai_tools();
    for choice in [Some(json!("auto")), None] {
        let (mut with_calls, mut allowed) = (0, 0);
        for prompt in AUTO_PROMPTS {
            let v = chat_reply(&srv, prompt, &tools, choice.clone());
            if reported(&v).is_empty() {
                continue;
            }
            with_calls += 1;
            let calls = check_calls(&v, &tools, None);
            assert_eq!(calls.len(), 1, "{v}");
            allowed += calls.iter().filter(|(_, v, _)| v == "allow").count();
        }
        // Not vacuous: the model opens calls on these prompts, and one at least is
        // passed on with its arguments.
        assert!(
            with_calls >= 2,
            "{choice:?}: {with_calls} replies with calls"
        );
        assert!(allowed >= 1, "{choice:?}: no call allowed");
    }
}

/// The negative control of the test above: the same `auto` prompts without the call
/// grammar. The model opens calls on them too, and at least one names no offered tool
/// (it writes no JSON after the tag, and is denied as malformed, as an unknown tool, or
/// as cut off by `max_tokens` before its closing tag), which the test above asserts
/// never happens.
#[fak_testkit::real_model]
fn without_the_grammar_auto_calls_are_broken() {
    let srv = server(false);
    let tools = openai_tools();
    let mut bad = 0;
    for prompt in AUTO_PROMPTS {
        let v = chat_reply(&srv, prompt, &tools, Some(json!("auto")));
        bad += reported(&v)
            .iter()
            .filter(|(name, reason)| {
                schema_of(&tools, name).is_none()
                    && ["MALFORMED", "UNKNOWN_TOOL", "TRUNCATED"].contains(&reason.as_str())
            })
            .count();
    }
    assert!(
        bad > 0,
        "every unconstrained auto call named an offered tool"
    );
}

/// A prompt the model answers in text under `auto`: the lazy grammar never starts, so
/// the text is the unconstrained run's, token for token.
#[fak_testkit::real_model]
fn auto_text_replies_are_the_unconstrained_text() {
    let tools = openai_tools();
    let prompts = [
        "Write one sentence about the sea.",
        "Is it raining in Oslo? Start your reply with <tool_call>",
    ];
    let mut texts = Vec::new();
    for constrain in [true, false] {
        let srv = server(constrain);
        let mut out = Vec::new();
        for prompt in prompts {
            let v = chat_reply(&srv, prompt, &tools, Some(json!("auto")));
            assert!(reported(&v).is_empty(), "{v}");
            let text = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_else(|| panic!("{v}"))
                .to_string();
            assert!(!text.is_empty(), "{v}");
            out.push((text, v["usage"]["completion_tokens"].clone()));
        }
        texts.push(out);
    }
    assert_eq!(texts[0], texts[1]);
}

/// Anthropic `tool_choice` `{"type": "auto"}`: a `tool_use` block the model opens has
/// an offered name and an `input` valid for its `input_schema`.
#[fak_testkit::real_model]
fn anthropic_auto_tool_use_blocks_are_valid() {
    let srv = server(true);
    let tools = anthropic_tools(&openai_tools());
    let mut blocks = 0;
    for prompt in AUTO_PROMPTS {
        blocks += anthropic_reply(&srv, &tools, prompt, json!({"type": "auto"})).1;
    }
    assert!(blocks >= 1, "no tool_use block");
}

/// The Responses API's `tool_choice: "auto"` (function tools in its flat shape): each
/// `function_call` output item names an offered tool and its `arguments` validate
/// against the tool's `parameters`; no call is denied `UNKNOWN_TOOL` or `MALFORMED`
/// (`TRUNCATED` only when `max_output_tokens` cut it off).
#[fak_testkit::real_model]
fn responses_auto_function_calls_are_valid() {
    let srv = server(true);
    let tools: Vec<Value> = openai_tools()
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let f = &t["function"];
            json!({"type": "function", "name": f["name"], "description": f["description"],
                "parameters": f.get("parameters").cloned().unwrap_or(json!({"type": "object"}))})
        })
        .collect();
    let mut calls = 0;
    for prompt in AUTO_PROMPTS {
        let body = json!({
            "model": ID, "max_output_tokens": 200, "temperature": 0, "store": false,
            "input": prompt, "tools": tools, "tool_choice": "auto"
        });
        let r = post(srv.addr, "/v1/responses", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        println!("{prompt:?} -> {}", v["output"]);
        for r in v["fak"]["tool_calls"].as_array().into_iter().flatten() {
            assert_well_formed(&v, r, "/status", "incomplete");
        }
        for item in v["output"].as_array().unwrap() {
            if item["type"] == "function_call" {
                calls += 1;
                let t = tools.iter().find(|t| t["name"] == item["name"]).unwrap();
                let args: Value =
                    serde_json::from_str(item["arguments"].as_str().unwrap()).unwrap();
                let validator = jsonschema::validator_for(&t["parameters"]).unwrap();
                assert!(validator.is_valid(&args), "{item}");
            }
        }
    }
    assert!(calls >= 1, "no function_call item");
}

/// Offers one tool `get_weather` with `params` as its schema, forced, on both wires,
/// marked `strict` and not: strict, the request is a 400 whose message names the tool,
/// `strict` and `cause`; not strict, its arguments fall back to any JSON object and the
/// request is answered.
fn assert_strict_refuses(srv: &Server, params: &Value, cause: &str) {
    for strict in [true, false] {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": params, "strict": strict}}]);
        let mut body = chat(PROMPTS[0], &tools, json!("required"));
        body["max_tokens"] = json!(30);
        let r = post(srv.addr, "/v1/chat/completions", &body);
        let anthropic = json!({"model": ID, "max_tokens": 30,
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "tools": [{"name": "get_weather", "input_schema": params, "strict": strict}],
            "tool_choice": {"type": "any"}});
        let r2 = post(srv.addr, "/v1/messages", &anthropic);
        for (r, wire) in [(r, "openai"), (r2, "anthropic")] {
            if strict {
                assert_eq!(r.status, 400, "{wire}: {}", r.body);
                let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
                assert!(
                    msg.contains("get_weather") && msg.contains("strict") && msg.contains(cause),
                    "{wire}: {msg}"
                );
            } else {
                assert_eq!(r.status, 200, "{wire}: {}", r.body);
            }
        }
    }
}

/// A tool whose schema the call grammar cannot constrain (`not` is a keyword llguidance
/// does not implement): marked `strict` (OpenAI `function.strict`, Anthropic `strict`)
/// the request is a 400 naming the tool and the construct; without `strict` the tool's
/// arguments fall back to any JSON object and the request is answered.
#[fak_testkit::real_model]
fn a_strict_tool_whose_schema_cannot_be_constrained_is_a_400() {
    let params = json!({"type": "object", "properties": {"city": {"not": {"type": "integer"}}}});
    assert_strict_refuses(&server(true), &params, "not");
}

/// A strict tool whose schema cannot describe call arguments at all (its `type` is not
/// `object`) is a 400 naming the tool, on both wires; without `strict` its arguments
/// fall back to any JSON object and the request is answered.
#[fak_testkit::real_model]
fn a_strict_tool_whose_schema_is_not_an_object_is_a_400() {
    assert_strict_refuses(&server(true), &json!({"type": "string"}), "object");
}
