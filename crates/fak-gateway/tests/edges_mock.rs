//! The wires' edges over the mock engine. Every error the gateway writes is JSON in its
//! wire's error shape: the framework's own answers (a path id that is not UTF-8, a wrong
//! method, a request target too long), bodies with bytes after the JSON, parse errors in
//! plain words (no serde internals). The mock agrees with the in-kernel driver on an
//! empty prompt and continues a prefilled assistant message; tool-result content the
//! screen cannot read is listed in `fak.tool_results`.

mod common;

use common::{post, request, start, Resp, Server};
use fak_engine::mock::MockDriver;
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::sync::Arc;

fn mock_server() -> Server {
    start(Arc::new(MockDriver::new()), GatewayConfig::default())
}

/// The OpenAI error object of `r`, after checking its status, JSON content type and
/// shape.
fn openai_error(r: &Resp, status: u16) -> Value {
    assert_eq!(r.status, status, "{r:?}");
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{r:?}"
    );
    let v = r.json();
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    assert!(
        v.get("type").is_none(),
        "OpenAI's shape has no top-level type: {v}"
    );
    v["error"].clone()
}

/// The Anthropic error object of `r`, likewise.
fn anthropic_error(r: &Resp, status: u16) -> Value {
    assert_eq!(r.status, status, "{r:?}");
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    v["error"].clone()
}

const ANTHROPIC: (&str, &str) = ("anthropic-version", "2023-06-01");

#[test]
fn an_undecodable_path_id_is_a_400_in_the_wire_shape() {
    let srv = mock_server();
    for method in ["GET", "DELETE"] {
        let r = request(srv.addr, method, "/v1/responses/%FF%FE", &[], b"");
        let e = openai_error(&r, 400);
        assert_eq!(e["type"], "invalid_request_error");
        assert!(e["message"].as_str().unwrap().contains("UTF-8"), "{e}");
    }
    let r = request(srv.addr, "GET", "/v1/models/%FF", &[], b"");
    assert_eq!(openai_error(&r, 400)["type"], "invalid_request_error");
    let r = request(srv.addr, "GET", "/v1/models/%FF", &[ANTHROPIC], b"");
    assert_eq!(anthropic_error(&r, 400)["type"], "invalid_request_error");
}

#[test]
fn a_wrong_method_is_a_405_in_the_wire_shape() {
    let srv = mock_server();
    for path in [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/models",
    ] {
        let method = if path == "/v1/models" { "POST" } else { "GET" };
        let r = request(srv.addr, method, path, &[], b"");
        let e = openai_error(&r, 405);
        assert_eq!(e["type"], "invalid_request_error");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(method) && msg.contains(path), "{msg}");
        assert!(r.header("allow").is_some(), "the Allow header stays: {r:?}");
        assert_eq!(r.header("x-should-retry"), Some("false"));
    }
    let r = request(srv.addr, "GET", "/v1/messages", &[], b"");
    let e = anthropic_error(&r, 405);
    assert!(e["message"].as_str().unwrap().contains("GET"), "{e}");
    assert_eq!(r.header("allow"), Some("POST"));
}

#[test]
fn a_request_target_too_long_is_a_414_in_the_wire_shape() {
    let srv = mock_server();
    let long = "a".repeat(fak_gateway::MAX_URI_BYTES + 1);
    let r = request(srv.addr, "GET", &format!("/v1/models/{long}"), &[], b"");
    let e = openai_error(&r, 414);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains(&fak_gateway::MAX_URI_BYTES.to_string()),
        "{e}"
    );
    let r = request(
        srv.addr,
        "POST",
        &format!("/v1/messages?x={long}"),
        &[],
        b"{}",
    );
    anthropic_error(&r, 414);
    // Just within the limit: routed as usual (an unknown model: 404).
    let path = format!("/v1/models/{}", "a".repeat(fak_gateway::MAX_URI_BYTES - 11));
    assert_eq!(path.len(), fak_gateway::MAX_URI_BYTES);
    openai_error(&request(srv.addr, "GET", &path, &[], b""), 404);
}

#[test]
fn an_unknown_route_answers_in_the_shape_its_headers_ask() {
    let srv = mock_server();
    let e = openai_error(&request(srv.addr, "GET", "/v1/nothing", &[], b""), 404);
    assert_eq!(e["type"], "not_found_error");
    let r = request(srv.addr, "GET", "/v1/nothing", &[ANTHROPIC], b"");
    assert_eq!(anthropic_error(&r, 404)["type"], "not_found_error");
}

#[test]
fn bytes_after_the_json_body_are_a_400_on_every_post_route() {
    let srv = mock_server();
    let chat = json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}]});
    let cases = [
        ("/v1/chat/completions", chat.clone()),
        ("/v1/completions", json!({"model": "mock", "prompt": "hi"})),
        ("/v1/responses", json!({"model": "mock", "input": "hi"})),
        (
            "/v1/messages",
            json!({"model": "mock", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/messages/count_tokens",
            json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        ("/v1/fak/revoke", json!({"digest": "0".repeat(64)})),
    ];
    for (path, body) in cases {
        // The body alone (and with trailing whitespace) is fine.
        let ok = format!("{body} \r\n\t");
        let r = request(srv.addr, "POST", path, &[], ok.as_bytes());
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        for tail in [" garbage", "{}", "\n[]", "x"] {
            let bad = format!("{body}{tail}");
            let r = request(srv.addr, "POST", path, &[], bad.as_bytes());
            let e = if path.starts_with("/v1/messages") {
                anthropic_error(&r, 400)
            } else {
                openai_error(&r, 400)
            };
            let msg = e["message"].as_str().unwrap();
            assert!(
                msg.contains("trailing characters"),
                "{path} {tail:?}: {msg}"
            );
        }
    }
}

#[test]
fn parse_errors_say_what_was_expected_in_plain_words() {
    let srv = mock_server();
    let cases: [(&str, Value, &str, &str); 6] = [
        (
            "/v1/responses",
            json!({"model": "mock", "input": 5}),
            "input",
            "a string or an array of input items",
        ),
        (
            "/v1/responses",
            json!({"model": "mock", "input": [{"role": "user", "content": 5}]}),
            "input[0]",
            "a string or an array of content parts",
        ),
        (
            "/v1/responses",
            json!({"model": "mock", "input": [{"role": "wizard", "content": "x"}]}),
            "input[0]",
            "unknown variant `wizard`",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "mock", "stop": 5, "messages": [{"role": "user", "content": "x"}]}),
            "stop",
            "a string or an array of strings",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "mock", "tool_choice": "sometimes", "messages": [{"role": "user", "content": "x"}]}),
            "tool_choice",
            "unknown variant `sometimes`, expected one of `none`, `auto`, `required`",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "mock", "tool_choice": 3, "messages": [{"role": "user", "content": "x"}]}),
            "tool_choice",
            r#""none", "auto", "required" or {"type": "function""#,
        ),
    ];
    for (path, body, field, expected) in cases {
        let r = post(srv.addr, path, &body);
        let e = openai_error(&r, 400);
        let msg = e["message"].as_str().unwrap();
        assert!(
            msg.contains(field) && msg.contains(expected),
            "{body}: {msg:?} should name {field:?} and {expected:?}"
        );
        assert!(!msg.contains("untagged"), "{msg}");
    }
    // A named tool_choice missing its function says so.
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"model": "mock", "tool_choice": {"type": "function"}, "messages": [{"role": "user", "content": "x"}]}),
    );
    let msg = openai_error(&r, 400)["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("missing field `function`"), "{msg}");
    // An Anthropic message's unsupported block names the role in plain words.
    let r = post(
        srv.addr,
        "/v1/messages",
        &json!({"model": "mock", "max_tokens": 5, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}),
    );
    let msg = anthropic_error(&r, 400)["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("in assistant messages"), "{msg}");
}

#[test]
fn an_empty_prompt_is_a_400_as_in_kernel() {
    let srv = mock_server();
    // Text that tokenizes to nothing, and an empty list of token ids.
    for prompt in [json!(""), json!([[]])] {
        let r = post(
            srv.addr,
            "/v1/completions",
            &json!({"model": "mock", "prompt": prompt}),
        );
        let e = openai_error(&r, 400);
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("the prompt is empty"),
            "{prompt}: {e}"
        );
    }
}

/// An Anthropic prefill (a trailing assistant message) is continued, not answered anew:
/// the mock goes on after the words it holds, as the in-kernel driver continues the
/// message token for token; streamed and not alike.
#[test]
fn the_mock_continues_a_prefilled_assistant_message() {
    let srv = mock_server();
    let body = |prefill: &str, stream: bool| {
        json!({"model": "mock", "max_tokens": 20, "stream": stream, "messages": [
            {"role": "user", "content": "echo one two three four"},
            {"role": "assistant", "content": prefill}]})
    };
    let text = |v: &Value| -> String {
        v["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["text"].as_str().unwrap_or("").to_string())
            .collect()
    };
    let v = post(srv.addr, "/v1/messages", &body("one two", false)).json();
    assert_eq!(text(&v), " three four", "{v}");
    assert_eq!(v["usage"]["output_tokens"], 2);
    let r = post(srv.addr, "/v1/messages", &body("one two", true));
    assert_eq!(r.status, 200, "{}", r.body);
    let streamed: String = r
        .sse()
        .into_iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            let v: Value = serde_json::from_str(&d).unwrap();
            v["delta"]["text"].as_str().unwrap_or("").to_string()
        })
        .collect();
    assert_eq!(streamed, " three four");
    // A prefill the reply does not start with: the whole reply follows it.
    let v = post(srv.addr, "/v1/messages", &body("Sure:", false)).json();
    assert_eq!(text(&v), " one two three four", "{v}");
}

/// An image in a tool result reaches the model as a stub; the response lists that
/// result in `fak.tool_results` with the stub's reason, streamed and not.
#[test]
fn a_withheld_image_in_a_tool_result_is_listed_with_its_reason() {
    let srv = mock_server();
    for stream in [false, true] {
        let body = json!({"model": "mock", "max_tokens": 20, "stream": stream,
            "tools": [{"name": "shot", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "take a screenshot"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "here it is"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}]});
        let r = post(srv.addr, "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let fak = if stream {
            r.sse()
                .into_iter()
                .filter(|(n, _)| n == "message_delta")
                .map(|(_, d)| serde_json::from_str::<Value>(&d).unwrap()["fak"].clone())
                .next()
                .unwrap()
        } else {
            r.json()["fak"].clone()
        };
        let results = fak["tool_results"]
            .as_array()
            .unwrap_or_else(|| panic!("{fak}"));
        assert_eq!(results.len(), 1, "{fak}");
        assert_eq!(results[0]["tool_call_id"], "toolu_1");
        assert_eq!(results[0]["tool"], "shot");
        assert_eq!(results[0]["verdict"], "quarantine");
        assert_eq!(results[0]["reason"], "UNSCREENABLE_CONTENT");
    }
}
