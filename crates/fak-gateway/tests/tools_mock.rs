//! Tool calls through both wires over the mock engine (whose replies go through the same
//! tool-call parser as the in-kernel model's): every verdict path of the policy (allow,
//! allow_prefix, deny with a reason, default deny, malformed arguments, a call of a tool
//! not offered, the rate limit), each on the OpenAI and the Anthropic wire, streaming and
//! not, a denied call explained in the reply's text in the same words on every wire;
//! forced `tool_choice`; and the tool history of both wires reaching the engine.

mod common;

use common::{post, request, start, start_with_policy, Resp, Server};
use fak_engine::mock::MockDriver;
use fak_engine::policy::Policy;
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::sync::Arc;

const MANIFEST: &str = r#"{
  "version": "fak-policy/1",
  "allow": ["send_note"],
  "allow_prefix": ["get_"],
  "deny": {"delete_all": "POLICY_BLOCK"},
  "args": {"send_note": {"text": {"type": "string", "max_len": 20, "required": true}}},
  "rate_limit": {"calls": 3, "window_s": 3600}
}"#;

fn server() -> Server {
    start_with_policy(
        Arc::new(MockDriver::new()),
        GatewayConfig::default(),
        Policy::from_json(MANIFEST).unwrap(),
    )
}

/// The tools every request offers (not `not_offered`).
fn tool_names() -> [&'static str; 4] {
    ["get_weather", "send_note", "delete_all", "rm_rf"]
}

/// A mock directive whose reply is `calls` (raw call bodies), after `text`.
fn directive(text: &str, calls: &[&str]) -> String {
    let mut s = format!("echo {text}");
    for c in calls {
        s.push_str(&format!(" <tool_call>{c}</tool_call>"));
    }
    s
}

#[derive(Clone, Copy, Debug)]
enum Wire {
    OpenAi,
    OpenAiStream,
    Anthropic,
    AnthropicStream,
}

const WIRES: [Wire; 4] = [
    Wire::OpenAi,
    Wire::OpenAiStream,
    Wire::Anthropic,
    Wire::AnthropicStream,
];

/// What a client got, in wire-neutral terms.
#[derive(Debug, Default)]
struct Outcome {
    text: String,
    /// Allowed calls: (name, arguments as JSON).
    calls: Vec<(String, Value)>,
    /// `tool_calls` / `tool_use` when a call was passed on, else `stop` / `end_turn`.
    finish: String,
    /// The `fak` report: (name, verdict, reason).
    report: Vec<(String, String, Option<String>)>,
}

fn report_of(fak: &Value) -> Vec<(String, String, Option<String>)> {
    fak["tool_calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    (
                        c["name"].as_str().unwrap().to_string(),
                        c["verdict"].as_str().unwrap().to_string(),
                        c["reason"].as_str().map(str::to_string),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn send(srv: &Server, wire: Wire, conv: &str, content: &str, choice: Option<&str>) -> Outcome {
    let names = tool_names();
    let openai = matches!(wire, Wire::OpenAi | Wire::OpenAiStream);
    let stream = matches!(wire, Wire::OpenAiStream | Wire::AnthropicStream);
    let body = if openai {
        let tools: Vec<Value> = names
            .iter()
            .map(|n| json!({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}))
            .collect();
        let mut b = json!({"model": "mock", "messages": [{"role": "user", "content": content}],
                           "tools": tools, "stream": stream});
        if let Some(c) = choice {
            b["tool_choice"] = json!({"type": "function", "function": {"name": c}});
        }
        b
    } else {
        let tools: Vec<Value> = names
            .iter()
            .map(|n| json!({"name": n, "input_schema": {"type": "object"}}))
            .collect();
        let mut b = json!({"model": "mock", "max_tokens": 200,
                           "messages": [{"role": "user", "content": content}],
                           "tools": tools, "stream": stream});
        if let Some(c) = choice {
            b["tool_choice"] = json!({"type": "tool", "name": c});
        }
        b
    };
    let path = if openai {
        "/v1/chat/completions"
    } else {
        "/v1/messages"
    };
    let r = request(
        srv.addr,
        "POST",
        path,
        &[("x-fak-conversation", conv)],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    match wire {
        Wire::OpenAi => openai_outcome(&r),
        Wire::OpenAiStream => openai_stream_outcome(&r),
        Wire::Anthropic => anthropic_outcome(&r.json()),
        Wire::AnthropicStream => anthropic_stream_outcome(&r),
    }
}

fn openai_outcome(r: &Resp) -> Outcome {
    let v = r.json();
    let m = &v["choices"][0]["message"];
    let calls = m["tool_calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    assert_eq!(c["type"], "function");
                    assert!(c["id"].as_str().unwrap().starts_with("call_"));
                    let args = c["function"]["arguments"].as_str().unwrap();
                    (
                        c["function"]["name"].as_str().unwrap().to_string(),
                        serde_json::from_str(args).unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Outcome {
        text: m["content"].as_str().unwrap_or("").to_string(),
        calls,
        finish: v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
        report: report_of(&v["fak"]),
    }
}

fn openai_stream_outcome(r: &Resp) -> Outcome {
    let events = r.sse();
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let mut o = Outcome::default();
    let mut seen_call = false;
    for (_, d) in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        let c = &v["choices"][0];
        if let Some(t) = c["delta"]["content"].as_str() {
            assert!(!seen_call, "text after a tool call: the calls come last");
            o.text.push_str(t);
        }
        if let Some(a) = c["delta"]["tool_calls"].as_array() {
            seen_call = true;
            for tc in a {
                assert_eq!(tc["index"].as_u64().unwrap() as usize, o.calls.len());
                let args = tc["function"]["arguments"].as_str().unwrap();
                o.calls.push((
                    tc["function"]["name"].as_str().unwrap().to_string(),
                    serde_json::from_str(args).unwrap(),
                ));
            }
        }
        if let Some(f) = c["finish_reason"].as_str() {
            o.finish = f.to_string();
            o.report = report_of(&v["fak"]);
        }
    }
    o
}

fn anthropic_outcome(v: &Value) -> Outcome {
    let mut o = Outcome {
        finish: v["stop_reason"].as_str().unwrap().to_string(),
        report: report_of(&v["fak"]),
        ..Outcome::default()
    };
    for b in v["content"].as_array().unwrap() {
        match b["type"].as_str().unwrap() {
            "text" => o.text.push_str(b["text"].as_str().unwrap()),
            "tool_use" => {
                assert!(b["id"].as_str().unwrap().starts_with("toolu_"));
                o.calls
                    .push((b["name"].as_str().unwrap().to_string(), b["input"].clone()));
            }
            k => panic!("unexpected block {k}"),
        }
    }
    o
}

fn anthropic_stream_outcome(r: &Resp) -> Outcome {
    // Rebuild the message from the events, as the SDK's accumulator does.
    let mut blocks: Vec<Value> = Vec::new();
    let mut partial: Vec<String> = Vec::new();
    let mut msg = Value::Null;
    for (name, d) in r.sse() {
        let v: Value = serde_json::from_str(&d).unwrap();
        assert_eq!(v["type"], name.as_str());
        match name.as_str() {
            "message_start" => msg = v["message"].clone(),
            "content_block_start" => {
                assert_eq!(v["index"].as_u64().unwrap() as usize, blocks.len());
                blocks.push(v["content_block"].clone());
                partial.push(String::new());
            }
            "content_block_delta" => {
                let i = v["index"].as_u64().unwrap() as usize;
                match v["delta"]["type"].as_str().unwrap() {
                    "text_delta" => {
                        let t = format!(
                            "{}{}",
                            blocks[i]["text"].as_str().unwrap(),
                            v["delta"]["text"].as_str().unwrap()
                        );
                        blocks[i]["text"] = json!(t);
                    }
                    "input_json_delta" => {
                        partial[i].push_str(v["delta"]["partial_json"].as_str().unwrap())
                    }
                    k => panic!("delta {k}"),
                }
            }
            "content_block_stop" => {
                let i = v["index"].as_u64().unwrap() as usize;
                if blocks[i]["type"] == "tool_use" {
                    blocks[i]["input"] = serde_json::from_str(&partial[i]).unwrap();
                }
            }
            "message_delta" => {
                msg["stop_reason"] = v["delta"]["stop_reason"].clone();
                msg["fak"] = v["fak"].clone();
            }
            "message_stop" | "ping" => {}
            k => panic!("event {k}"),
        }
    }
    msg["content"] = Value::Array(blocks);
    anthropic_outcome(&msg)
}

fn tool_finish(wire: Wire) -> (&'static str, &'static str) {
    match wire {
        Wire::OpenAi | Wire::OpenAiStream => ("tool_calls", "stop"),
        _ => ("tool_use", "end_turn"),
    }
}

#[test]
fn every_verdict_path_on_both_wires_streaming_and_not() {
    let srv = server();
    // (call body, expected verdict, expected reason)
    let cases: [(&str, &str, Option<&str>); 7] = [
        (
            r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#,
            "allow",
            None,
        ),
        (
            r#"{"name": "send_note", "arguments": {"text": "hi"}}"#,
            "allow",
            None,
        ),
        (
            r#"{"name": "delete_all", "arguments": {}}"#,
            "deny",
            Some("POLICY_BLOCK"),
        ),
        (
            r#"{"name": "rm_rf", "arguments": {"path": "/"}}"#,
            "deny",
            Some("DEFAULT_DENY"),
        ),
        (
            r#"{"name": "send_note", "arguments": {"text": 5}}"#,
            "deny",
            Some("MALFORMED"),
        ),
        (
            r#"{"name": "get_weather", "arguments": {"city": }"#,
            "deny",
            Some("MALFORMED"),
        ),
        (
            r#"{"name": "get_secret_plans", "arguments": {}}"#,
            "deny",
            Some("UNKNOWN_TOOL"),
        ),
    ];
    // Each denied case's explanation, as the first wire wrote it: every wire says the same.
    let mut notes: Vec<Option<String>> = vec![None; cases.len()];
    for wire in WIRES {
        let (called, plain) = tool_finish(wire);
        for (i, (body, verdict, reason)) in cases.iter().enumerate() {
            let conv = format!("{wire:?}-{i}");
            let o = send(&srv, wire, &conv, &directive("Checking.", &[body]), None);
            let ctx = format!("{wire:?} case {i}: {o:?}");
            assert_eq!(o.report.len(), 1, "{ctx}");
            assert_eq!(o.report[0].1, *verdict, "{ctx}");
            assert_eq!(o.report[0].2.as_deref(), *reason, "{ctx}");
            assert!(o.text.starts_with("Checking."), "{ctx}");
            if *verdict == "allow" {
                let want: Value = serde_json::from_str::<Value>(body).unwrap()["arguments"].clone();
                assert_eq!(o.calls.len(), 1, "{ctx}");
                assert_eq!(o.calls[0].1, want, "{ctx}");
                assert_eq!(o.finish, called, "{ctx}");
            } else {
                assert!(
                    o.calls.is_empty(),
                    "a denied call reached the client: {ctx}"
                );
                assert_eq!(o.finish, plain, "{ctx}");
                // The client sees why, on every wire, in the same words.
                let at = o
                    .text
                    .find("[fak] ")
                    .unwrap_or_else(|| panic!("no explanation: {ctx}"));
                let note = &o.text[at..];
                assert!(note.starts_with("[fak] The tool call '"), "{ctx}");
                assert!(
                    note.ends_with(").")
                        && note.contains(&format!("was not passed on: {} (", reason.unwrap())),
                    "{ctx}"
                );
                let first = notes[i].get_or_insert_with(|| note.to_string());
                assert_eq!(first, note, "{ctx}");
                if matches!(wire, Wire::OpenAi | Wire::OpenAiStream) {
                    // After the reply's own text, a blank line apart.
                    assert_eq!(o.text, format!("Checking.\n\n{note}"), "{ctx}");
                }
            }
        }
    }
}

#[test]
fn the_rate_limit_counts_allowed_calls_per_conversation() {
    let srv = server();
    for wire in WIRES {
        let conv = format!("rate-{wire:?}");
        let call = r#"{"name": "get_weather", "arguments": {"city": "Oslo"}}"#;
        // Two calls in one reply, then two more: the manifest allows 3 an hour.
        let o = send(&srv, wire, &conv, &directive("a", &[call, call]), None);
        assert_eq!(o.calls.len(), 2, "{wire:?} {o:?}");
        let o = send(&srv, wire, &conv, &directive("b", &[call, call]), None);
        assert_eq!(o.calls.len(), 1, "{wire:?} {o:?}");
        assert_eq!(o.report[1].2.as_deref(), Some("RATE_LIMITED"), "{o:?}");
        // Another conversation has its own count.
        let o = send(
            &srv,
            wire,
            &format!("{conv}-other"),
            &directive("c", &[call]),
            None,
        );
        assert_eq!(o.calls.len(), 1, "{wire:?} {o:?}");
    }
}

#[test]
fn a_named_tool_choice_forces_a_call() {
    let srv = server();
    for wire in WIRES {
        let o = send(
            &srv,
            wire,
            &format!("forced-{wire:?}"),
            "hello",
            Some("get_weather"),
        );
        assert_eq!(o.calls.len(), 1, "{wire:?} {o:?}");
        assert_eq!(o.calls[0].0, "get_weather");
        assert_eq!(o.finish, tool_finish(wire).0);
        assert_eq!(o.text, "");
        // Without a directive or a forced choice there is no call and no report.
        let o = send(&srv, wire, &format!("free-{wire:?}"), "hello", None);
        assert!(o.calls.is_empty() && o.report.is_empty(), "{o:?}");
        assert_eq!(o.finish, tool_finish(wire).1);
    }
}

#[test]
fn tool_history_of_both_wires_reaches_the_engine() {
    // The mock counts one token per word plus one per message: the history's messages
    // (an assistant call and its result) must arrive as two more messages.
    let srv = start(Arc::new(MockDriver::new()), GatewayConfig::default());
    let openai = json!({"model": "mock", "messages": [
        {"role": "user", "content": "weather in Paris"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C sunny"}
    ]});
    let r = post(srv.addr, "/v1/chat/completions", &openai);
    assert_eq!(r.status, 200, "{}", r.body);
    // <user> weather in Paris (4) + <assistant> (1) + <tool> 18 C sunny (4)
    assert_eq!(r.json()["usage"]["prompt_tokens"], 9);
    let anthropic = json!({"model": "mock", "max_tokens": 10, "messages": [
        {"role": "user", "content": "weather in Paris"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C sunny"}]}]}
    ]});
    let r = post(srv.addr, "/v1/messages", &anthropic);
    assert_eq!(r.status, 200, "{}", r.body);
    let u = &r.json()["usage"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        9
    );
    // A bad history is a 400, not a silent drop.
    let bad = json!({"model": "mock", "messages": [
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}
    ]});
    let r = post(srv.addr, "/v1/chat/completions", &bad);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("arguments"), "{}", r.body);
}

#[test]
fn arguments_must_match_the_offered_schema_and_the_named_choice() {
    let srv = server();
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": false}}});
    let note = json!({"type": "function", "function": {"name": "send_note",
        "parameters": {"type": "object"}}});
    let ask = |calls: &str, choice: Value| {
        let b = json!({"model": "mock", "tools": [weather, note], "tool_choice": choice,
            "messages": [{"role": "user", "content": directive("x", &[calls])}]});
        post(srv.addr, "/v1/chat/completions", &b).json()
    };
    for (args, ok) in [
        (r#"{"city": "Paris"}"#, true),
        (r#"{"town": 5}"#, false),
        (r#"{}"#, false),
        (r#"{"city": 5}"#, false),
        (r#"{"city": "Paris", "extra": 1}"#, false),
    ] {
        let v = ask(
            &format!(r#"{{"name": "get_weather", "arguments": {args}}}"#),
            json!("auto"),
        );
        let rep = &v["fak"]["tool_calls"][0];
        assert_eq!(rep["verdict"] == "allow", ok, "{args}: {v}");
        if !ok {
            assert_eq!(rep["reason"], "MALFORMED", "{v}");
            assert!(rep["detail"].as_str().unwrap().contains("schema"), "{v}");
        }
    }
    // A named tool_choice: a call of another (offered, allowed) tool is not passed on.
    let v = ask(
        r#"{"name": "send_note", "arguments": {}}"#,
        json!({"type": "function", "function": {"name": "get_weather"}}),
    );
    assert_eq!(v["fak"]["tool_calls"][0]["reason"], "UNKNOWN_TOOL", "{v}");
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
    // An invalid schema is a 400 up front.
    let b = json!({"model": "mock", "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]});
    let r = post(srv.addr, "/v1/chat/completions", &b);
    assert_eq!(r.status, 400, "{}", r.body);
    // More than 128 tools is a 400, answered at once.
    let many: Vec<Value> = (0..129)
        .map(|i| json!({"type": "function", "function": {"name": format!("t{i}")}}))
        .collect();
    let b = json!({"model": "mock", "messages": [{"role": "user", "content": "x"}], "tools": many});
    let r = post(srv.addr, "/v1/chat/completions", &b);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("128"), "{}", r.body);
}

#[test]
fn call_markup_never_reaches_a_client_unjudged() {
    // No tools offered, or tool_choice none: a call the model writes anyway is read out,
    // denied UNKNOWN_TOOL, and neither its text nor its logprobs reach the client.
    let srv = server();
    let call = r#"{"name": "get_weather", "arguments": {"token": "sk-proj-Q7fL2mN9xR4tV8wZ1bC3dE5gH6jK0pS"}}"#;
    for extra in [
        json!({}),
        json!({"tools": [{"type": "function", "function": {"name": "get_weather"}}], "tool_choice": "none"}),
    ] {
        let mut b = json!({"model": "mock", "logprobs": true,
            "messages": [{"role": "user", "content": directive("Sure.", &[call])}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let v = post(srv.addr, "/v1/chat/completions", &b).json();
        let m = &v["choices"][0]["message"];
        // The text, then why the call was removed; never the call's own markup.
        let content = m["content"].as_str().unwrap();
        assert!(
            content.starts_with(
                "Sure.\n\n[fak] The tool call 'get_weather' was not passed on: UNKNOWN_TOOL ("
            ),
            "{v}"
        );
        assert!(
            !content.contains("sk-proj") && !content.contains("<tool_call>"),
            "{v}"
        );
        assert!(m["tool_calls"].is_null(), "{v}");
        assert_eq!(v["fak"]["tool_calls"][0]["reason"], "UNKNOWN_TOOL", "{v}");
        let tokens: String = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["token"].as_str().unwrap())
            .collect();
        assert!(
            !tokens.contains("sk-proj") && !tokens.contains("get_weather"),
            "{tokens}"
        );
    }
    // On the Anthropic wire the fak report names the call by its tool_use id.
    let b = json!({"model": "mock", "max_tokens": 50, "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": directive("ok", &[r#"{"name": "get_weather", "arguments": {}}"#])}]});
    let v = post(srv.addr, "/v1/messages", &b).json();
    let id = v["content"][1]["id"].as_str().unwrap();
    assert!(id.starts_with("toolu_"), "{v}");
    assert_eq!(v["fak"]["tool_calls"][0]["id"], id, "{v}");
}

/// `n` choices: every choice's calls go through the policy as one choice's would, each
/// choice its own adjudication (its allowed calls in its own `tool_calls`, its denials
/// in its own text), all counted against the conversation's rate limit; the reply's
/// `fak.tool_calls` (streamed: each choice's last chunk's) names the choice of each.
#[test]
fn every_choice_s_calls_pass_the_policy() {
    let srv = server();
    let get = r#"{"name": "get_weather", "arguments": {"city": "Oslo"}}"#;
    let delete = r#"{"name": "delete_all", "arguments": {}}"#;
    let tools: Vec<Value> = tool_names()
        .iter()
        .map(|n| json!({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}))
        .collect();
    for stream in [false, true] {
        let body = json!({"model": "mock", "n": 4, "stream": stream, "tools": tools,
            "messages": [{"role": "user", "content": directive("x", &[get, delete])}]});
        let conv = format!("choices-{stream}");
        let r = request(
            srv.addr,
            "POST",
            "/v1/chat/completions",
            &[("x-fak-conversation", &conv)],
            body.to_string().as_bytes(),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        // Per choice: (allowed call names, text, finish) and the fak entries.
        let mut allowed: Vec<Vec<String>> = vec![Vec::new(); 4];
        let mut text = vec![String::new(); 4];
        let mut finish = vec![String::new(); 4];
        let mut entries: Vec<Value> = Vec::new();
        if stream {
            for (_, d) in r.sse().iter().filter(|(_, d)| d != "[DONE]") {
                let v: Value = serde_json::from_str(d).unwrap();
                let Some(c) = v["choices"].as_array().and_then(|a| a.first()) else {
                    continue;
                };
                let i = c["index"].as_u64().unwrap() as usize;
                if let Some(t) = c["delta"]["content"].as_str() {
                    text[i].push_str(t);
                }
                for call in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
                    allowed[i].push(call["function"]["name"].as_str().unwrap().into());
                }
                if let Some(f) = c["finish_reason"].as_str() {
                    finish[i] = f.into();
                    for e in v["fak"]["tool_calls"].as_array().unwrap() {
                        assert_eq!(e["choice"], i as u64, "{v}");
                        entries.push(e.clone());
                    }
                }
            }
        } else {
            let v = r.json();
            for c in v["choices"].as_array().unwrap() {
                let i = c["index"].as_u64().unwrap() as usize;
                text[i] = c["message"]["content"].as_str().unwrap_or("").into();
                finish[i] = c["finish_reason"].as_str().unwrap().into();
                for call in c["message"]["tool_calls"].as_array().into_iter().flatten() {
                    allowed[i].push(call["function"]["name"].as_str().unwrap().into());
                }
            }
            entries = v["fak"]["tool_calls"].as_array().unwrap().clone();
        }
        // Two proposed calls per choice, each judged, each naming its choice.
        assert_eq!(entries.len(), 8, "{entries:?}");
        for i in 0..4u64 {
            let mine: Vec<&Value> = entries.iter().filter(|e| e["choice"] == i).collect();
            assert_eq!(mine.len(), 2, "choice {i}: {entries:?}");
            let del = mine.iter().find(|e| e["name"] == "delete_all").unwrap();
            assert_eq!(del["reason"], "POLICY_BLOCK");
        }
        // The manifest allows 3 calls an hour per conversation: of the four choices'
        // get_weather calls, three pass and one is RATE_LIMITED.
        let limited: Vec<&Value> = entries
            .iter()
            .filter(|e| e["reason"] == "RATE_LIMITED")
            .collect();
        assert_eq!(limited.len(), 1, "{entries:?}");
        let k = limited[0]["choice"].as_u64().unwrap() as usize;
        for i in 0..4 {
            assert!(!allowed[i].iter().any(|n| n == "delete_all"), "{allowed:?}");
            assert!(text[i].contains("delete_all"), "choice {i}: {}", text[i]);
            if i == k {
                assert!(allowed[i].is_empty(), "{allowed:?}");
                assert_eq!(finish[i], "stop");
            } else {
                assert_eq!(allowed[i], vec!["get_weather".to_string()]);
                assert_eq!(finish[i], "tool_calls");
            }
        }
        if !stream {
            assert_eq!(k, 3, "choices are judged in order when not streamed");
        }
    }
}
