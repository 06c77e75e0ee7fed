//! `POST /v1/messages/count_tokens` through `fak serve` in upstream mode: with
//! `anthropic-upstream` the upstream's own count comes back (the oracle: the same request
//! counted directly by an in-kernel `fak serve`, the served model's exact template and
//! tokenizer); with `openai-upstream`, whose wire has no count endpoint, a 400 in
//! Anthropic's error shape saying so, never a count fak made up. And `POST /v1/responses`
//! with `openai-upstream`: translated to the upstream's chat API, answered as the
//! upstream answers it. And structured outputs through both upstream drivers in front of
//! an in-kernel `fak serve`, which constrains its reply to the forwarded format, so the
//! front's check of the reply passes.

mod common;

use common::{fak, serve, wait_ready, Serve};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The Anthropic version header every request here carries.
const VERSION: &str = "anthropic-version: 2023-06-01\r\n";

/// One HTTP/1.1 request with Anthropic's version header; returns (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    common::http_with(addr, method, path, VERSION, body)
}

/// [`http`] with extra header lines (each ending in `\r\n`).
fn http_with(addr: &str, method: &str, path: &str, extra: &str, body: &str) -> (u16, String) {
    common::http_with(addr, method, path, &format!("{VERSION}{extra}"), body)
}

fn count(addr: &str, body: &Value) -> u64 {
    let (status, resp) = http(addr, "POST", "/v1/messages/count_tokens", &body.to_string());
    assert_eq!(status, 200, "{resp}");
    let v: Value = serde_json::from_str(&resp).unwrap();
    v["input_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("{resp}"))
}

/// Count requests that exercise the translation: a plain one, one with a system prompt,
/// tools, a tool call and its result, and one ending in an assistant prefill.
fn bodies() -> Vec<Value> {
    let model = "smollm2-135m-instruct";
    vec![
        json!({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
        json!({"model": model,
        "system": "You are terse.",
        "tools": [{"name": "get_weather", "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, clear"},
                {"type": "text", "text": "And tomorrow?"}]}
        ]}),
        json!({"model": model, "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "The colour is"}]}),
    ]
}

#[fak_testkit::real_model]
fn count_tokens_is_the_upstreams_own_count_in_anthropic_upstream_mode() {
    fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"));
    let up = serve(&["--kv-budget-mb", "16"]);
    wait_ready(&up.addr);
    let base = format!("http://{}", up.addr);
    let front = serve(&[
        "--engine",
        "anthropic-upstream",
        "--base-url",
        &base,
        "--upstream-health-interval-s",
        "1",
    ]);
    wait_ready(&front.addr);
    let mut seen = Vec::new();
    for body in bodies() {
        let direct = count(&up.addr, &body);
        assert!(direct > 0, "{body}");
        assert_eq!(count(&front.addr, &body), direct, "{body}");
        seen.push(direct);
    }
    // The three requests differ, and so do their counts: not one number for all.
    seen.dedup();
    assert_eq!(seen.len(), 3, "{seen:?}");
    // A model the upstream does not serve is Anthropic's 404, as on /v1/messages.
    let (status, resp) = http(
        &front.addr,
        "POST",
        "/v1/messages/count_tokens",
        &json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
    );
    assert_eq!(status, 404, "{resp}");
    let v: Value = serde_json::from_str(&resp).unwrap();
    assert_eq!(v["type"], "error", "{resp}");
}

/// The count goes up with the client's own `x-api-key`, as `/v1/messages` does: an
/// upstream that requires a key counts for a client that sent it, with no operator key
/// set on the front.
#[fak_testkit::real_model]
fn count_tokens_goes_up_with_the_clients_own_key() {
    fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"));
    let up = Serve::spawn(
        fak()
            .args(["serve", "--port", "0", "--kv-budget-mb", "16"])
            .args(["--api-key-env", "FAK_TEST_UPSTREAM_KEY"])
            .env("FAK_TEST_UPSTREAM_KEY", "sk-upstream-123"),
    );
    let key = "x-api-key: sk-upstream-123\r\n";
    let t = Instant::now();
    while http_with(&up.addr, "GET", "/health", key, "").0 != 200 {
        assert!(t.elapsed() < Duration::from_secs(120), "never ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    let base = format!("http://{}", up.addr);
    // No operator key: an upstream that lists its models only to a key counts as up
    // when --upstream-model names the model, and each request brings the client's key.
    let front = serve(&[
        "--engine",
        "anthropic-upstream",
        "--base-url",
        &base,
        "--upstream-model",
        "smollm2-135m-instruct",
        "--upstream-health-interval-s",
        "1",
    ]);
    let body = bodies()[1].to_string();
    let (status, direct) = http_with(&up.addr, "POST", "/v1/messages/count_tokens", key, &body);
    assert_eq!(status, 200, "{direct}");
    let t = Instant::now();
    let (status, through) = loop {
        let r = http_with(&front.addr, "POST", "/v1/messages/count_tokens", key, &body);
        // 503 while the front's first health check of the upstream is pending.
        if r.0 != 503 || t.elapsed() > Duration::from_secs(60) {
            break r;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(status, 200, "{through}");
    let (d, t): (Value, Value) = (
        serde_json::from_str(&direct).unwrap(),
        serde_json::from_str(&through).unwrap(),
    );
    assert_eq!(t["input_tokens"], d["input_tokens"], "{through}");
}

#[test]
fn count_tokens_is_a_clear_400_in_openai_upstream_mode() {
    let up = serve(&["--engine", "mock"]);
    wait_ready(&up.addr);
    let base = format!("http://{}", up.addr);
    let front = serve(&["--engine", "openai-upstream", "--base-url", &base]);
    wait_ready(&front.addr);
    let (status, resp) = http(
        &front.addr,
        "POST",
        "/v1/messages/count_tokens",
        &json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
    );
    assert_eq!(status, 400, "{resp}");
    let v: Value = serde_json::from_str(&resp).unwrap();
    assert_eq!(v["type"], "error", "{resp}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{resp}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("cannot count tokens") && m.contains("no token-counting endpoint"),
        "{m}"
    );
}

/// The text of a Responses API reply's message items.
fn output_text(v: &Value) -> String {
    v["output"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .filter(|o| o["type"] == "message")
        .flat_map(|o| o["content"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["type"] == "output_text")
        .map(|c| c["text"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// `POST /v1/responses` through `fak serve --engine openai-upstream` in front of an
/// in-kernel `fak serve`: translated to the upstream's chat API, the greedy answer is the
/// in-kernel server's own answer to the same Responses request.
#[fak_testkit::real_model]
fn responses_through_openai_upstream_mode_answer_as_the_upstream_does() {
    fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"));
    let up = serve(&["--kv-budget-mb", "16"]);
    wait_ready(&up.addr);
    let base = format!("http://{}/v1", up.addr);
    let front = serve(&["--engine", "openai-upstream", "--base-url", &base]);
    wait_ready(&front.addr);
    let body = json!({"model": "smollm2-135m-instruct", "temperature": 0,
        "max_output_tokens": 16, "instructions": "You are terse.",
        "input": "What is the capital of France?"})
    .to_string();
    let ask = |addr: &str| {
        let (status, resp) = http(addr, "POST", "/v1/responses", &body);
        assert_eq!(status, 200, "{resp}");
        let v: Value = serde_json::from_str(&resp).unwrap();
        assert_eq!(v["object"], "response", "{resp}");
        v
    };
    let direct = ask(&up.addr);
    let through = ask(&front.addr);
    let text = output_text(&direct);
    assert!(!text.is_empty(), "{direct}");
    assert_eq!(output_text(&through), text);
    assert_eq!(
        through["usage"]["input_tokens"], direct["usage"]["input_tokens"],
        "{through}"
    );
}

/// A schema whose every value is short (so the 135M model's constrained reply finishes
/// well within `max_tokens`).
fn verdict_schema() -> Value {
    json!({"type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
            "sure": {"type": "boolean"}},
        "required": ["answer", "sure"], "additionalProperties": false})
}

/// Whether `text` is a JSON object valid for [`verdict_schema`].
fn is_verdict(text: &str) -> bool {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    o.len() == 2
        && matches!(o.get("answer").and_then(Value::as_str), Some("yes" | "no"))
        && o.get("sure").is_some_and(Value::is_boolean)
}

/// `body` POSTed to `/v1/chat/completions` at `addr`: the 200 reply, whose message
/// text is asserted to be a verdict ([`is_verdict`]), and that text.
fn chat_verdict(addr: &str, body: &Value) -> (Value, String) {
    let (status, resp) = http(addr, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{resp}");
    let v: Value = serde_json::from_str(&resp).unwrap();
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("{resp}"))
        .to_string();
    assert!(is_verdict(&text), "{resp}");
    (v, text)
}

/// `response_format` through `openai-upstream` and `output_config.format` through
/// `anthropic-upstream` (and a chat `response_format` translated to it), in front of
/// an in-kernel `fak serve`: the upstream constrains its reply to the format it was
/// sent, so the front's check passes and the client gets the valid JSON, streamed or
/// not. A Lark `grammar`, which the in-kernel server itself takes, is a 400 at the
/// front: it is not forwarded.
#[fak_testkit::real_model]
fn structured_outputs_go_up_and_come_back_valid() {
    fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"));
    let up = serve(&["--kv-budget-mb", "16"]);
    wait_ready(&up.addr);
    let base = format!("http://{}", up.addr);
    let front = |engine: &str| {
        let s = serve(&[
            "--engine",
            engine,
            "--base-url",
            &base,
            "--upstream-health-interval-s",
            "1",
        ]);
        wait_ready(&s.addr);
        s
    };
    let model = "smollm2-135m-instruct";
    let question = "Is Paris the capital of France? Answer in JSON.";
    let chat = |stream: bool| {
        json!({"model": model, "temperature": 0, "max_tokens": 40, "stream": stream,
            "messages": [{"role": "user", "content": question}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "Verdict", "strict": true, "schema": verdict_schema()}}})
    };

    let openai = front("openai-upstream");
    let (v, text) = chat_verdict(&openai.addr, &chat(false));
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let (status, resp) = http(
        &openai.addr,
        "POST",
        "/v1/chat/completions",
        &chat(true).to_string(),
    );
    assert_eq!(status, 200, "{resp}");
    let mut streamed = String::new();
    for d in resp.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if d == "[DONE]" {
            continue;
        }
        let c: Value = serde_json::from_str(d).unwrap();
        assert!(c.get("error").is_none(), "{resp}");
        streamed.push_str(c["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!(streamed, text, "{resp}");
    let mut lark = chat(false);
    lark.as_object_mut().unwrap().remove("response_format");
    lark["grammar"] = json!("start: \"yes\" | \"no\"");
    let (status, resp) = http(&up.addr, "POST", "/v1/chat/completions", &lark.to_string());
    assert_eq!(status, 200, "the in-kernel server takes it: {resp}");
    let (status, resp) = http(
        &openai.addr,
        "POST",
        "/v1/chat/completions",
        &lark.to_string(),
    );
    assert_eq!(status, 400, "{resp}");
    assert!(resp.contains("`grammar`"), "{resp}");

    let anthropic = front("anthropic-upstream");
    let body = json!({"model": model, "max_tokens": 40, "temperature": 0,
        "messages": [{"role": "user", "content": question}],
        "output_config": {"format": {"type": "json_schema", "schema": verdict_schema()}}});
    let (status, resp) = http(&anthropic.addr, "POST", "/v1/messages", &body.to_string());
    assert_eq!(status, 200, "{resp}");
    let v: Value = serde_json::from_str(&resp).unwrap();
    assert_eq!(v["stop_reason"], "end_turn", "{resp}");
    assert!(
        is_verdict(v["content"][0]["text"].as_str().unwrap()),
        "{resp}"
    );
    chat_verdict(&anthropic.addr, &chat(false));
}
