//! Taint tracking through HTTP over the mock engine: the same proposed call of a sink
//! tool is passed on in a conversation that holds no tool result and denied
//! `TAINTED_SINK` in one that does (on both wires, streaming and not), a read tool stays
//! allowed on the tainted conversation, and a `require_flag` sink runs on a tainted
//! conversation only when the client names it in `x-fak-allow-tainted`.

mod common;

use common::{request, start_with_policy, Resp, Server};
use fak_engine::mock::MockDriver;
use fak_engine::policy::Policy;
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::sync::Arc;

const MANIFEST: &str = r#"{
  "version": "fak-policy/1",
  "allow": ["get_weather", "send_email", "run_script"],
  "capabilities": {"get_weather": ["read"], "send_email": ["egress"], "run_script": ["execute"]},
  "tainted": {"egress": "deny", "write": "deny", "execute": "require_flag"}
}"#;

/// A benign tool result: the screen admits it, and it still taints the conversation.
const RESULT: &str = "Weather in Paris: 18 C, light rain, wind 10 km/h.";

fn server() -> Server {
    start_with_policy(
        Arc::new(MockDriver::new()),
        GatewayConfig::default(),
        Policy::from_json(MANIFEST).unwrap(),
    )
}

/// The mock's directive to propose a call of `tool`.
fn propose(tool: &str) -> String {
    format!(
        r#"echo <tool_call>{{"name": "{tool}", "arguments": {{"to": "a@b.example"}}}}</tool_call>"#
    )
}

/// A `fak.tool_calls` report: (name, verdict, reason) per proposed call.
type Report = Vec<(String, String, Option<String>)>;

/// Sends a request whose last user turn proposes a call of `tool`, after a tool result
/// when `tainted`; answers the `fak.tool_calls` report's (name, verdict, reason) and the
/// names of the calls the client received.
fn send(
    srv: &Server,
    anthropic: bool,
    stream: bool,
    tainted: bool,
    tool: &str,
    headers: &[(&str, &str)],
) -> (Report, Vec<String>) {
    let tools = ["get_weather", "send_email", "run_script"];
    let body = if anthropic {
        let mut messages = vec![json!({"role": "user", "content": "weather in Paris?"})];
        if tainted {
            messages.push(json!({"role": "assistant", "content": [{"type": "tool_use",
                "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}));
            messages.push(json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT},
                {"type": "text", "text": propose(tool)}]}));
        } else {
            messages.push(json!({"role": "assistant", "content": "Which city?"}));
            messages.push(json!({"role": "user", "content": propose(tool)}));
        }
        json!({"model": "mock", "max_tokens": 200, "stream": stream, "messages": messages,
               "tools": tools.iter().map(|n| json!({"name": n, "input_schema": {"type": "object"}})).collect::<Vec<_>>()})
    } else {
        let mut messages = vec![json!({"role": "user", "content": "weather in Paris?"})];
        if tainted {
            messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}));
            messages.push(json!({"role": "tool", "tool_call_id": "call_1", "content": RESULT}));
        } else {
            messages.push(json!({"role": "assistant", "content": "Which city?"}));
        }
        messages.push(json!({"role": "user", "content": propose(tool)}));
        json!({"model": "mock", "stream": stream, "messages": messages,
               "tools": tools.iter().map(|n| json!({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}})).collect::<Vec<_>>()})
    };
    let path = if anthropic {
        "/v1/messages"
    } else {
        "/v1/chat/completions"
    };
    let r = request(srv.addr, "POST", path, headers, body.to_string().as_bytes());
    assert_eq!(r.status, 200, "{}", r.body);
    let (fak, calls) = match (anthropic, stream) {
        (false, false) => openai(&r),
        (false, true) => openai_stream(&r),
        (true, false) => anthropic_body(&r.json()),
        (true, true) => anthropic_stream(&r),
    };
    // A tainted request's tool result was screened and admitted as it was.
    assert!(
        fak.get("tool_results").is_none(),
        "the benign result was not admitted: {fak}"
    );
    let report = fak["tool_calls"]
        .as_array()
        .expect("a fak.tool_calls report")
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["verdict"].as_str().unwrap().to_string(),
                c["reason"].as_str().map(str::to_string),
            )
        })
        .collect();
    (report, calls)
}

fn openai(r: &Resp) -> (Value, Vec<String>) {
    let v = r.json();
    let calls = v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| c["function"]["name"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default();
    (v["fak"].clone(), calls)
}

fn openai_stream(r: &Resp) -> (Value, Vec<String>) {
    let mut fak = Value::Null;
    let mut calls = Vec::new();
    for (_, d) in r.sse() {
        let Ok(v) = serde_json::from_str::<Value>(&d) else {
            continue;
        };
        for c in v["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            calls.push(c["function"]["name"].as_str().unwrap().to_string());
        }
        if !v["fak"].is_null() {
            fak = v["fak"].clone();
        }
    }
    (fak, calls)
}

fn anthropic_body(v: &Value) -> (Value, Vec<String>) {
    let calls = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| b["name"].as_str().unwrap().to_string())
        .collect();
    (v["fak"].clone(), calls)
}

fn anthropic_stream(r: &Resp) -> (Value, Vec<String>) {
    let mut fak = Value::Null;
    let mut calls = Vec::new();
    for (_, d) in r.sse() {
        let v: Value = serde_json::from_str(&d).unwrap();
        if v["type"] == "content_block_start" && v["content_block"]["type"] == "tool_use" {
            calls.push(v["content_block"]["name"].as_str().unwrap().to_string());
        }
        if v["type"] == "message_delta" {
            fak = v["fak"].clone();
        }
    }
    (fak, calls)
}

const WIRES: [(bool, bool); 4] = [(false, false), (false, true), (true, false), (true, true)];

#[test]
fn the_same_sink_call_is_allowed_clean_and_denied_tainted_on_both_wires() {
    let srv = server();
    for (anthropic, stream) in WIRES {
        let at = format!("anthropic={anthropic} stream={stream}");
        let (report, calls) = send(&srv, anthropic, stream, false, "send_email", &[]);
        assert_eq!(
            report,
            vec![("send_email".into(), "allow".into(), None)],
            "{at}"
        );
        assert_eq!(calls, vec!["send_email".to_string()], "{at}");

        let (report, calls) = send(&srv, anthropic, stream, true, "send_email", &[]);
        assert_eq!(
            report,
            vec![(
                "send_email".into(),
                "deny".into(),
                Some("TAINTED_SINK".into())
            )],
            "{at}"
        );
        assert!(calls.is_empty(), "{at}: a denied call reached the client");

        // A read tool stays allowed on the tainted conversation.
        let (report, calls) = send(&srv, anthropic, stream, true, "get_weather", &[]);
        assert_eq!(
            report,
            vec![("get_weather".into(), "allow".into(), None)],
            "{at}"
        );
        assert_eq!(calls, vec!["get_weather".to_string()], "{at}");
    }
}

#[test]
fn a_require_flag_sink_runs_tainted_only_with_the_clients_flag() {
    let srv = server();
    for (anthropic, stream) in WIRES {
        let at = format!("anthropic={anthropic} stream={stream}");
        let deny = vec![(
            "run_script".to_string(),
            "deny".to_string(),
            Some("TAINTED_SINK".to_string()),
        )];
        let allow = vec![("run_script".to_string(), "allow".to_string(), None)];
        assert_eq!(
            send(&srv, anthropic, stream, true, "run_script", &[]).0,
            deny,
            "{at}"
        );
        assert_eq!(
            send(
                &srv,
                anthropic,
                stream,
                true,
                "run_script",
                &[("x-fak-allow-tainted", "send_email")]
            )
            .0,
            deny,
            "{at}"
        );
        let (report, calls) = send(
            &srv,
            anthropic,
            stream,
            true,
            "run_script",
            &[("x-fak-allow-tainted", "get_weather, run_script")],
        );
        assert_eq!(report, allow, "{at}");
        assert_eq!(calls, vec!["run_script".to_string()], "{at}");
        // The flag does not lift a `deny` rule.
        assert_eq!(
            send(
                &srv,
                anthropic,
                stream,
                true,
                "send_email",
                &[("x-fak-allow-tainted", "*")]
            )
            .0[0]
                .2
                .as_deref(),
            Some("TAINTED_SINK"),
            "{at}"
        );
    }
}
