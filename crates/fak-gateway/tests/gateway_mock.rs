//! The gateway over the mock engine on a real loopback socket: request and response
//! shapes of each API, SSE event order, every error status and shape, auth,
//! concurrency, and clients that hang up mid-stream.

mod common;

use common::{get, open_stream, post, request, start, Server};
use fak_engine::mock::{MockDriver, MOCK_CONTEXT, MOCK_REPLY};
use fak_engine::{EngineDriver, EngineError, EventStream, GenerateRequest, ModelInfo, Readiness};
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn mock_server() -> Server {
    start(Arc::new(MockDriver::new()), GatewayConfig::default())
}

fn chat(content: &str) -> Value {
    json!({"model": "mock", "messages": [{"role": "user", "content": content}]})
}

#[test]
fn chat_completion_has_the_openai_shape() {
    let srv = mock_server();
    let r = post(srv.addr, "/v1/chat/completions", &chat("hi there"));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "mock");
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], MOCK_REPLY);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], 3);
    assert_eq!(u["completion_tokens"], 5);
    assert_eq!(u["total_tokens"], 8);
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
}

#[test]
fn content_parts_system_and_max_completion_tokens() {
    let srv = mock_server();
    let body = json!({"model": "mock", "max_completion_tokens": 2, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "count "}, {"type": "text", "text": "9"}]}
    ]});
    let v = post(srv.addr, "/v1/chat/completions", &body).json();
    assert_eq!(v["choices"][0]["message"]["content"], "1 2");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let body = json!({"model": "mock", "stop": ["4"], "messages": [{"role": "user", "content": "count 9"}]});
    let v = post(srv.addr, "/v1/chat/completions", &body).json();
    assert_eq!(v["choices"][0]["message"]["content"], "1 2 3 ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let body = json!({"model": "mock", "stop": " 3", "max_tokens": 50, "messages": [{"role": "user", "content": "count 9"}]});
    let v = post(srv.addr, "/v1/chat/completions", &body).json();
    assert_eq!(v["choices"][0]["message"]["content"], "1 2");
}

#[test]
fn chat_stream_sends_chunks_then_usage_then_done() {
    let srv = mock_server();
    let mut body = chat("echo a b c");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = post(srv.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let ev = r.sse();
    assert_eq!(ev.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let id = &chunks[0]["id"];
    assert!(chunks.iter().all(|c| &c["id"] == id));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "a b c");
    let n = chunks.len();
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    assert_eq!(chunks[n - 1]["usage"]["completion_tokens"], 3);
    assert_eq!(chunks[n - 1]["usage"]["prompt_tokens"], 5);
    assert!(chunks[..n - 1].iter().all(|c| c["usage"].is_null()));

    // Without include_usage: no usage chunk, no usage field.
    body["stream_options"] = Value::Null;
    let ev = post(srv.addr, "/v1/chat/completions", &body).sse();
    let last: Value = serde_json::from_str(&ev[ev.len() - 2].1).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert!(last.get("usage").is_none());
}

#[test]
fn completions_plain_prompt() {
    let srv = mock_server();
    let v = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": "mock", "prompt": "echo x y"}),
    )
    .json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "x y");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": "mock", "prompt": ["count 3"], "stream": true}),
    );
    let ev = r.sse();
    assert_eq!(ev.last().unwrap().1, "[DONE]");
    let text: String = ev[..ev.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, "1 2 3");
}

#[test]
fn anthropic_messages_shape() {
    let srv = mock_server();
    let body = json!({"model": "mock", "max_tokens": 100, "system": "be brief",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]});
    let r = post(srv.addr, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(v["content"], json!([{"type": "text", "text": MOCK_REPLY}]));
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["stop_sequence"], Value::Null);
    assert_eq!(v["usage"]["output_tokens"], 5);
    let u = &v["usage"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        5
    );
    // max_tokens and stop_sequences.
    let body = json!({"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": "count 9"}]});
    let v = post(srv.addr, "/v1/messages", &body).json();
    assert_eq!(v["stop_reason"], "max_tokens");
    let body = json!({"model": "mock", "max_tokens": 20, "stop_sequences": [" 3"],
        "messages": [{"role": "user", "content": "count 9"}]});
    let v = post(srv.addr, "/v1/messages", &body).json();
    assert_eq!(v["content"][0]["text"], "1 2");
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], " 3");
}

#[test]
fn anthropic_stream_follows_the_documented_event_order() {
    let srv = mock_server();
    let body = json!({"model": "mock", "max_tokens": 100, "stream": true,
        "messages": [{"role": "user", "content": "echo one two"}]});
    let r = post(srv.addr, "/v1/messages", &body);
    assert_eq!(r.status, 200);
    let ev = r.sse();
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let data: Vec<Value> = ev
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    for ((n, _), d) in ev.iter().zip(&data) {
        assert_eq!(&d["type"], n);
    }
    assert_eq!(data[0]["message"]["usage"]["output_tokens"], 0);
    let text: String = data
        .iter()
        .filter_map(|d| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "one two");
    assert_eq!(data[6]["delta"]["stop_reason"], "end_turn");
    assert_eq!(data[6]["usage"]["output_tokens"], 2);
}

#[test]
fn models_health_and_metrics() {
    let srv = mock_server();
    let v = get(srv.addr, "/v1/models").json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "mock");
    assert_eq!(v["data"][0]["object"], "model");
    let h = get(srv.addr, "/health");
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["status"], "ok");
    post(srv.addr, "/v1/chat/completions", &chat("hi"));
    post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"model": "nope", "messages": []}),
    );
    let m = get(srv.addr, "/metrics");
    assert_eq!(m.status, 200);
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    for needle in [
        "fak_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 1",
        "fak_requests_total{route=\"/v1/chat/completions\",status=\"400\"} 1",
        "fak_requests_total{route=\"/v1/models\",status=\"200\"} 1",
        "fak_prompt_tokens_total 2",
        "fak_completion_tokens_total 5",
        "fak_cached_tokens_total 0",
        "fak_queue_depth 0",
        "fak_engine_ready 1",
        "fak_time_to_first_token_seconds_bucket{le=\"0.001\"} 1",
        "fak_time_to_first_token_seconds_count 1",
        "fak_time_per_output_token_seconds_count 1",
        // The mock times no single tokens, and runs no batched pass.
        "fak_inter_token_latency_seconds_count 0",
        "fak_batch_size_count 0",
    ] {
        assert!(m.body.contains(needle), "missing {needle} in\n{}", m.body);
    }
}

fn assert_openai_error(r: &common::Resp, status: u16, kind: &str, needle: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert_eq!(v["error"]["type"], kind, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(needle), "'{msg}' lacks '{needle}'");
}

fn assert_anthropic_error(r: &common::Resp, status: u16, kind: &str, needle: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], kind, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(needle), "'{msg}' lacks '{needle}'");
}

#[test]
fn openai_errors_have_their_status_and_shape() {
    let srv = mock_server();
    let a = srv.addr;
    let p = "/v1/chat/completions";
    let r = request(a, "POST", p, &[], b"{not json");
    assert_openai_error(&r, 400, "invalid_request_error", "invalid request body");
    let r = post(a, p, &json!({"model": "mock"}));
    assert_openai_error(&r, 400, "invalid_request_error", "missing field `messages`");
    let r = post(a, p, &json!({"model": "mock", "messages": []}));
    assert_openai_error(&r, 400, "invalid_request_error", "at least one message");
    let r = post(
        a,
        p,
        &json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
    );
    // As the OpenAI API types it (the SDK raises NotFoundError by the status).
    assert_openai_error(&r, 404, "invalid_request_error", "gpt-9");
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert_eq!(r.json()["error"]["param"], "model");
    let mut b = chat("x");
    b["max_tokens"] = json!(0);
    assert_openai_error(
        &post(a, p, &b),
        400,
        "invalid_request_error",
        "max_tokens must be at least 1",
    );
    b["max_tokens"] = json!(-3);
    assert_openai_error(&post(a, p, &b), 400, "invalid_request_error", "-3");
    b["max_tokens"] = json!(5000);
    let r = post(a, p, &b);
    assert_openai_error(&r, 400, "invalid_request_error", "5000");
    assert!(
        r.body.contains(&MOCK_CONTEXT.to_string()) && r.body.contains("prompt has 2 tokens"),
        "{}",
        r.body
    );
    let mut b = chat("x");
    b["n"] = json!(17);
    assert_openai_error(&post(a, p, &b), 400, "invalid_request_error", "n = 17");
    let mut b = chat("x");
    b["tools"] = json!([{"type": "function", "function": {"name": "bad name"}}]);
    assert_openai_error(&post(a, p, &b), 400, "invalid_request_error", "tool name");
    let mut b = chat("x");
    b["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
    b["tool_choice"] = json!({"type": "function", "function": {"name": "g"}});
    assert_openai_error(&post(a, p, &b), 400, "invalid_request_error", "'g'");
    let mut b = chat("x");
    b["tool_choice"] = json!("required");
    assert_openai_error(&post(a, p, &b), 400, "invalid_request_error", "no tools");
    let mut b = chat("x");
    b["temperature"] = json!(-1);
    assert_openai_error(&post(a, p, &b), 400, "invalid_request_error", "temperature");
    // OpenAI's range is 0 to 2 on every endpoint: 2 is taken, past it a 400.
    b["temperature"] = json!(2);
    assert_eq!(post(a, p, &b).status, 200);
    b["temperature"] = json!(2.5);
    let r = post(a, p, &b);
    assert_openai_error(&r, 400, "invalid_request_error", "between 0 and 2");
    assert!(r.body.contains("\"param\":\"temperature\""), "{}", r.body);
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "mock", "prompt": "x", "temperature": 3}),
    );
    assert_openai_error(&r, 400, "invalid_request_error", "between 0 and 2");
    let r = post(
        a,
        "/v1/responses",
        &json!({"model": "mock", "input": "x", "temperature": 2.01}),
    );
    assert_openai_error(&r, 400, "invalid_request_error", "between 0 and 2");
    let b = json!({"model": "mock", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]});
    assert_openai_error(&post(a, p, &b), 400, "invalid_request_error", "image_url");
    let b = json!({"model": "mock", "messages": [{"role": "wizard", "content": "x"}]});
    assert_openai_error(&post(a, p, &b), 400, "invalid_request_error", "wizard");
    let r = get(a, "/v1/nothing");
    assert_openai_error(&r, 404, "not_found_error", "/v1/nothing");
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "mock", "prompt": "x", "max_tokens": 0}),
    );
    assert_openai_error(&r, 400, "invalid_request_error", "max_tokens");
}

/// Sampling controls fak does not implement are refused unless they hold the value
/// that changes nothing (what a client sends when it spells out OpenAI's defaults).
#[test]
fn unimplemented_sampling_controls_are_refused_unless_neutral() {
    let srv = mock_server();
    let a = srv.addr;
    for (p, base) in [
        ("/v1/chat/completions", chat("x")),
        ("/v1/completions", json!({"model": "mock", "prompt": "x"})),
    ] {
        for (field, neutral, active) in [
            ("logit_bias", json!({}), json!({"19556": -100})),
            ("frequency_penalty", json!(0), json!(2)),
            ("presence_penalty", json!(0.0), json!(-3)),
        ] {
            let mut b = base.clone();
            b[field] = neutral.clone();
            let r = post(a, p, &b);
            assert_eq!(r.status, 200, "{p} {field} = {neutral}: {}", r.body);
            b[field] = Value::Null;
            assert_eq!(post(a, p, &b).status, 200, "{p} {field} = null");
            b[field] = active.clone();
            assert_openai_error(&post(a, p, &b), 400, "invalid_request_error", field);
        }
    }
    let mut b = json!({"model": "mock", "prompt": "x", "best_of": 1});
    assert_eq!(post(a, "/v1/completions", &b).status, 200);
    b["best_of"] = json!(3);
    let r = post(a, "/v1/completions", &b);
    assert_openai_error(&r, 400, "invalid_request_error", "best_of");
    for field in ["functions", "function_call"] {
        let mut b = chat("x");
        b[field] = json!([{"name": "f", "parameters": {}}]);
        let r = post(a, "/v1/chat/completions", &b);
        assert_openai_error(&r, 400, "invalid_request_error", "tools");
    }
}

#[test]
fn anthropic_errors_have_their_status_and_shape() {
    let srv = mock_server();
    let a = srv.addr;
    let p = "/v1/messages";
    let r = request(a, "POST", p, &[], b"[1,");
    assert_anthropic_error(&r, 400, "invalid_request_error", "invalid request body");
    let r = post(
        a,
        p,
        &json!({"model": "mock", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_anthropic_error(&r, 400, "invalid_request_error", "max_tokens");
    let r = post(
        a,
        p,
        &json!({"model": "mock", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_anthropic_error(&r, 400, "invalid_request_error", "at least 1");
    let r = post(
        a,
        p,
        &json!({"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_anthropic_error(&r, 404, "not_found_error", "claude-x");
    let r = post(
        a,
        p,
        &json!({"model": "mock", "max_tokens": 4000, "messages": [{"role": "user", "content": "x"}]}),
    );
    // More than fits is capped to what fits, as the Anthropic API does (anthropic_mock.rs).
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(
        a,
        p,
        &json!({"model": "mock", "max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}),
    );
    assert_anthropic_error(&r, 400, "invalid_request_error", "tool_result");
    let r = post(
        a,
        p,
        &json!({"model": "mock", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
    );
    assert_anthropic_error(&r, 400, "invalid_request_error", "image");
    let r = post(
        a,
        p,
        &json!({"model": "mock", "max_tokens": 5, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_anthropic_error(&r, 400, "invalid_request_error", "input_schema");
}

/// The mock engine behind a 1 MiB body limit.
fn one_mib_limit_server() -> Server {
    start(
        Arc::new(MockDriver::new()),
        GatewayConfig {
            max_body_bytes: 1 << 20,
            ..GatewayConfig::default()
        },
    )
}

#[test]
fn a_body_over_the_limit_is_413() {
    let srv = one_mib_limit_server();
    let big =
        json!({"model": "mock", "messages": [{"role": "user", "content": "x".repeat(2 << 20)}]});
    let r = post(srv.addr, "/v1/chat/completions", &big);
    assert_openai_error(&r, 413, "request_too_large", "1048576");
    let mut big = big;
    big["max_tokens"] = json!(5);
    let r = post(srv.addr, "/v1/messages", &big);
    assert_anthropic_error(&r, 413, "request_too_large", "1048576");
    // And the server still serves.
    assert_eq!(
        post(srv.addr, "/v1/chat/completions", &chat("hi")).status,
        200
    );
}

/// A `Content-Length` over the limit is answered 413 at once, without waiting for a
/// body that is never sent (the idle timeout is 60 s; the answer must come in 5), in
/// each route's error shape.
#[test]
fn a_declared_length_over_the_limit_is_413_before_the_body() {
    use std::io::{Read, Write};
    let srv = one_mib_limit_server();
    for (path, anthropic) in [("/v1/chat/completions", false), ("/v1/messages", true)] {
        let mut s = std::net::TcpStream::connect(srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: 100000000000\r\n\r\n{{"
        );
        s.write_all(head.as_bytes()).unwrap();
        let t = Instant::now();
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        let text = String::from_utf8_lossy(&buf);
        assert!(t.elapsed() < Duration::from_secs(5), "no answer: {text}");
        assert!(text.starts_with("HTTP/1.1 413"), "{text}");
        assert!(
            text.contains("request_too_large") && text.contains("1048576"),
            "{text}"
        );
        assert_eq!(text.contains("\"type\":\"error\""), anthropic, "{text}");
    }
    assert_eq!(
        post(srv.addr, "/v1/chat/completions", &chat("hi")).status,
        200
    );
}

#[test]
fn overload_is_429_with_retry_after() {
    let mock = MockDriver::new()
        .with_delay(Duration::from_millis(5))
        .with_max_active(1);
    let srv = start(Arc::new(mock), GatewayConfig::default());
    let mut body = chat("count 100000");
    body["stream"] = json!(true);
    let hold = open_stream(srv.addr, "/v1/chat/completions", &body, 1);
    let r = post(srv.addr, "/v1/chat/completions", &chat("hi"));
    assert_openai_error(&r, 429, "rate_limit_error", "busy");
    assert_eq!(r.header("retry-after"), Some("1"));
    let mut b = chat("hi");
    b["max_tokens"] = json!(3);
    let r = post(srv.addr, "/v1/messages", &b);
    assert_anthropic_error(&r, 429, "rate_limit_error", "busy");
    drop(hold);
    // The slot comes free once the hung-up stream is cancelled.
    let t = Instant::now();
    loop {
        let r = post(srv.addr, "/v1/chat/completions", &chat("hi"));
        if r.status == 200 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "slot never freed");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A driver that never finishes loading: requests get 503 and /health says loading.
struct Loading;

impl EngineDriver for Loading {
    fn id(&self) -> &'static str {
        "loading"
    }
    fn models(&self) -> Vec<ModelInfo> {
        vec![ModelInfo {
            id: "m".into(),
            context_length: 0,
            owned_by: "test".into(),
        }]
    }
    fn readiness(&self) -> Readiness {
        Readiness::Loading
    }
    fn submit(&self, _req: GenerateRequest) -> Result<EventStream, EngineError> {
        Err(EngineError::NotReady("the model is loading".into()))
    }
}

#[test]
fn not_ready_is_503_and_health_says_loading() {
    let srv = start(Arc::new(Loading), GatewayConfig::default());
    let h = get(srv.addr, "/health");
    assert_eq!(h.status, 503);
    assert_eq!(h.json()["status"], "loading");
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_openai_error(&r, 503, "overloaded_error", "loading");
    assert!(r.header("retry-after").is_some());
    assert!(get(srv.addr, "/metrics")
        .body
        .contains("fak_engine_ready 0"));
}

#[test]
fn api_key_is_required_when_set() {
    let srv = start(
        Arc::new(MockDriver::new()),
        GatewayConfig {
            api_key: Some("sekret".into()),
            ..GatewayConfig::default()
        },
    );
    let a = srv.addr;
    let body = chat("hi").to_string();
    let r = request(a, "POST", "/v1/chat/completions", &[], body.as_bytes());
    assert_openai_error(&r, 401, "authentication_error", "API key");
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer wrong")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 401);
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sekret")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200);
    let ab =
        json!({"model": "mock", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
            .to_string();
    let r = request(a, "POST", "/v1/messages", &[], ab.as_bytes());
    assert_anthropic_error(&r, 401, "authentication_error", "API key");
    let r = request(
        a,
        "POST",
        "/v1/messages",
        &[("x-api-key", "sekret")],
        ab.as_bytes(),
    );
    assert_eq!(r.status, 200);
    assert_eq!(request(a, "GET", "/v1/models", &[], b"").status, 401);
    assert_eq!(get(a, "/health").status, 200);
}

#[test]
fn concurrent_clients_all_get_their_answers() {
    let srv = start(
        Arc::new(MockDriver::new().with_delay(Duration::from_millis(1))),
        GatewayConfig::default(),
    );
    let addr = srv.addr;
    let threads: Vec<_> = (0..8)
        .map(|c| {
            std::thread::spawn(move || {
                for i in 0..10 {
                    let words = format!("c{c} r{i} w");
                    let stream = i % 2 == 1;
                    let mut body = chat(&format!("echo {words}"));
                    body["stream"] = json!(stream);
                    let r = post(addr, "/v1/chat/completions", &body);
                    assert_eq!(r.status, 200);
                    let text: String = if stream {
                        r.sse()
                            .iter()
                            .filter(|(_, d)| d != "[DONE]")
                            .filter_map(|(_, d)| {
                                serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]
                                    ["content"]
                                    .as_str()
                                    .map(str::to_string)
                            })
                            .collect()
                    } else {
                        r.json()["choices"][0]["message"]["content"]
                            .as_str()
                            .unwrap()
                            .to_string()
                    };
                    assert_eq!(text, words);
                }
            })
        })
        .collect();
    // Health answers meanwhile.
    for _ in 0..5 {
        let t = Instant::now();
        assert_eq!(get(addr, "/health").status, 200);
        assert!(t.elapsed() < Duration::from_millis(500));
    }
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn clients_that_hang_up_mid_stream_leave_the_server_serving() {
    let mock = Arc::new(MockDriver::new().with_delay(Duration::from_millis(2)));
    let srv = start(
        Arc::clone(&mock) as Arc<dyn EngineDriver>,
        GatewayConfig::default(),
    );
    let mut body = chat("count 100000");
    body["stream"] = json!(true);
    for path in ["/v1/chat/completions", "/v1/messages"] {
        let mut b = body.clone();
        b["max_tokens"] = json!(1000);
        let s = open_stream(srv.addr, path, &b, 300);
        drop(s);
    }
    // Every generation stops once its client is gone.
    let t = Instant::now();
    while mock.stats().active > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "generations not cancelled"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = post(srv.addr, "/v1/chat/completions", &chat("hi"));
    assert_eq!(r.status, 200);
    assert_eq!(get(srv.addr, "/health").status, 200);
}

#[test]
fn a_client_that_hangs_up_on_a_non_streaming_request_cancels_it() {
    let mock = Arc::new(MockDriver::new().with_delay(Duration::from_millis(2)));
    let srv = start(
        Arc::clone(&mock) as Arc<dyn EngineDriver>,
        GatewayConfig::default(),
    );
    let s = {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(srv.addr).unwrap();
        let body = chat("count 100000").to_string();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        s
    };
    let t = Instant::now();
    while mock.stats().active == 0 {
        assert!(t.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(s);
    let t = Instant::now();
    while mock.stats().active > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "generation not cancelled"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
