//! `logprobs` / `top_logprobs` over the mock engine (each word one token, logprob 0.0,
//! its top list only itself): the response shapes of both OpenAI routes, the 400s, and
//! that a stream's per-chunk entries concatenate to the non-streamed list.

mod common;

use common::{post, start, Resp, Server};
use fak_engine::mock::MockDriver;
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::sync::Arc;

fn mock_server() -> Server {
    start(Arc::new(MockDriver::new()), GatewayConfig::default())
}

fn chat(content: &str, extra: Value) -> Value {
    let mut v = json!({"model": "mock", "messages": [{"role": "user", "content": content}]});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

/// The data of every chunk of a stream except `[DONE]`.
fn chunks(r: &Resp) -> Vec<Value> {
    r.sse()
        .into_iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| serde_json::from_str(&d).unwrap())
        .collect()
}

/// Streams `body` and checks each content chunk carries the entries of its own tokens;
/// returns all entries, concatenated.
fn streamed_entries(srv: &Server, body: &Value) -> Vec<Value> {
    let mut b = body.clone();
    b["stream"] = json!(true);
    let r = post(srv.addr, "/v1/chat/completions", &b);
    assert_eq!(r.status, 200, "{}", r.body);
    let mut all = Vec::new();
    for c in chunks(&r) {
        let lp = &c["choices"][0]["logprobs"];
        if let Some(list) = lp["content"].as_array() {
            all.extend(list.iter().cloned());
        }
    }
    all
}

#[test]
fn chat_logprobs_have_the_openai_shape() {
    let srv = mock_server();
    let body = chat("echo a bé c", json!({"logprobs": true, "top_logprobs": 2}));
    let v = post(srv.addr, "/v1/chat/completions", &body).json();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(content, "a bé c");
    let list = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(list.len(), 3);
    let tokens: String = list.iter().map(|e| e["token"].as_str().unwrap()).collect();
    assert_eq!(tokens, content);
    let e = &list[1];
    assert_eq!(e["token"], " bé");
    assert_eq!(e["logprob"], 0.0);
    assert_eq!(e["bytes"], json!([32, 98, 195, 169]));
    assert_eq!(
        e["top_logprobs"],
        json!([{"token": " bé", "logprob": 0.0, "bytes": [32, 98, 195, 169]}])
    );
    assert_eq!(v["choices"][0]["logprobs"]["refusal"], Value::Null);
    // logprobs without top_logprobs: no alternatives.
    let v = post(
        srv.addr,
        "/v1/chat/completions",
        &chat("echo a b", json!({"logprobs": true})),
    )
    .json();
    let list = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert!(list.iter().all(|e| e["top_logprobs"] == json!([])));
    // Not asked for: null, in the response and in every chunk.
    for extra in [json!({}), json!({"logprobs": false})] {
        let body = chat("echo a b", extra);
        let v = post(srv.addr, "/v1/chat/completions", &body).json();
        assert_eq!(v["choices"][0]["logprobs"], Value::Null);
        let mut b = body.clone();
        b["stream"] = json!(true);
        let r = post(srv.addr, "/v1/chat/completions", &b);
        for c in chunks(&r) {
            if let Some(ch) = c["choices"].as_array().and_then(|a| a.first()) {
                assert_eq!(ch["logprobs"], Value::Null, "{c}");
            }
        }
    }
}

#[test]
fn out_of_range_or_unpaired_top_logprobs_are_400() {
    let srv = mock_server();
    for (extra, word) in [
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"logprobs": true, "top_logprobs": -1}),
            "top_logprobs",
        ),
        (
            json!({"logprobs": true, "top_logprobs": 2.5}),
            "top_logprobs",
        ),
        (
            json!({"logprobs": true, "top_logprobs": "3"}),
            "top_logprobs",
        ),
        (json!({"top_logprobs": 3}), "logprobs: true"),
        (
            json!({"logprobs": false, "top_logprobs": 0}),
            "logprobs: true",
        ),
    ] {
        let r = post(srv.addr, "/v1/chat/completions", &chat("hi", extra.clone()));
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{}", r.body);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(word), "{extra}: {msg}");
    }
    // The edges are accepted.
    for n in [0, 20] {
        let r = post(
            srv.addr,
            "/v1/chat/completions",
            &chat("hi", json!({"logprobs": true, "top_logprobs": n})),
        );
        assert_eq!(r.status, 200, "{n}: {}", r.body);
    }
    for bad in [json!(21), json!(-1), json!("1")] {
        let body = json!({"model": "mock", "prompt": "hi", "logprobs": bad});
        let r = post(srv.addr, "/v1/completions", &body);
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
}

#[test]
fn stream_chunks_concatenate_to_the_non_stream_list() {
    let srv = mock_server();
    for (content, extra) in [
        ("echo one two three", json!({})),
        ("count 30", json!({"max_tokens": 12})),
        // A stop string: the word it cuts has a byte before it and is listed.
        ("count 9", json!({"stop": "4"})),
    ] {
        let mut body = chat(content, json!({"logprobs": true, "top_logprobs": 1}));
        for (k, x) in extra.as_object().unwrap() {
            body[k] = x.clone();
        }
        let v = post(srv.addr, "/v1/chat/completions", &body).json();
        let whole = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .clone();
        assert!(!whole.is_empty());
        assert_eq!(streamed_entries(&srv, &body), whole, "{content}");
    }
    // Each content chunk carries its own word's entry.
    let mut body = chat("echo x y z", json!({"logprobs": true, "stream": true}));
    body["stream"] = json!(true);
    let r = post(srv.addr, "/v1/chat/completions", &body);
    let mut n = 0;
    for c in chunks(&r) {
        let ch = &c["choices"][0];
        if let Some(t) = ch["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
            let list = ch["logprobs"]["content"].as_array().unwrap();
            assert_eq!(list.len(), 1);
            assert_eq!(list[0]["token"], t);
            n += 1;
        }
    }
    assert_eq!(n, 3);
    // With a stop string the straddling word is listed on the last text chunk.
    let v = post(
        srv.addr,
        "/v1/chat/completions",
        &chat("count 9", json!({"logprobs": true, "stop": "4"})),
    )
    .json();
    assert_eq!(v["choices"][0]["message"]["content"], "1 2 3 ");
    let tokens: Vec<&str> = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["token"].as_str().unwrap())
        .collect();
    assert_eq!(tokens, ["1", " 2", " 3", " 4"]);
}

#[test]
fn tool_call_tokens_are_not_listed() {
    let srv = mock_server();
    let body = json!({
        "model": "mock", "logprobs": true,
        "messages": [{"role": "user", "content": r#"echo ok <tool_call>{"name": "get_time", "arguments": {}}</tool_call>"#}],
        "tools": [{"type": "function", "function": {"name": "get_time"}}],
    });
    let v = post(srv.addr, "/v1/chat/completions", &body).json();
    let whole = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    // The text's word only: the call's tokens go up as the call, to be adjudicated, and
    // are not readable from the logprobs (a denied call's text would leak through them).
    assert_eq!(whole.len(), 1, "{v}");
    assert_eq!(whole[0]["token"], "ok");
    let mut b = body.clone();
    b["stream"] = json!(true);
    let r = post(srv.addr, "/v1/chat/completions", &b);
    let cs = chunks(&r);
    let fin = cs
        .iter()
        .find(|c| c["choices"][0]["finish_reason"].is_string())
        .unwrap();
    assert!(
        fin["choices"][0]["logprobs"].is_null(),
        "nothing left over for the finish chunk: {fin}"
    );
    assert_eq!(streamed_entries(&srv, &body), whole);
}

#[test]
fn legacy_completions_logprobs() {
    let srv = mock_server();
    let body = json!({"model": "mock", "prompt": "echo x yé z", "logprobs": 1});
    let v = post(srv.addr, "/v1/completions", &body).json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["x", " yé", " z"]));
    assert_eq!(lp["token_logprobs"], json!([0.0, 0.0, 0.0]));
    assert_eq!(lp["top_logprobs"][1], json!({" yé": 0.0}));
    assert_eq!(lp["text_offset"], json!([0, 1, 4]));
    // Streamed: per-chunk lists concatenate to the same, offsets running on.
    let mut b = body.clone();
    b["stream"] = json!(true);
    let r = post(srv.addr, "/v1/completions", &b);
    let (mut tokens, mut offsets) = (Vec::new(), Vec::new());
    for c in chunks(&r) {
        let l = &c["choices"][0]["logprobs"];
        if let Some(t) = l["tokens"].as_array() {
            tokens.extend(t.iter().cloned());
            offsets.extend(l["text_offset"].as_array().unwrap().iter().cloned());
        }
    }
    assert_eq!(Value::Array(tokens), lp["tokens"]);
    assert_eq!(Value::Array(offsets), lp["text_offset"]);
    let v = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": "mock", "prompt": "echo x"}),
    )
    .json();
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
}
