//! The OpenAI wire over the mock engine: `/v1/completions` with prompts as token ids
//! (one list, or a list of lists answered as choices by `index`, streamed and not),
//! parse errors that name the field at fault, and the fields taken and not acted on
//! against those refused.

mod common;

use common::{post, start, Server};
use fak_engine::mock::MockDriver;
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::sync::Arc;

fn mock_server() -> Server {
    start(Arc::new(MockDriver::new()), GatewayConfig::default())
}

fn completion(prompt: Value, extra: Value) -> Value {
    let mut b = json!({"model": "mock", "prompt": prompt, "max_tokens": 50});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn error_message(r: &common::Resp) -> String {
    assert_eq!(r.status, 400, "{}", r.body);
    let v = r.json();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    v["error"]["message"].as_str().unwrap().to_string()
}

/// The mock answers a prompt of ids with the ids as words, so each choice shows which
/// prompt it answers.
#[test]
fn token_id_prompts_are_answered_one_choice_each_by_index() {
    let srv = mock_server();
    let r = post(
        srv.addr,
        "/v1/completions",
        &completion(json!([5, 6, 7]), json!({})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["choices"][0]["text"], "5 6 7");
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["usage"]["prompt_tokens"], 3);

    let r = post(
        srv.addr,
        "/v1/completions",
        &completion(json!([[5, 6], [7], [8, 9, 10]]), json!({})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    let got: Vec<(u64, &str, &str)> = choices
        .iter()
        .map(|c| {
            (
                c["index"].as_u64().unwrap(),
                c["text"].as_str().unwrap(),
                c["finish_reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![(0, "5 6", "stop"), (1, "7", "stop"), (2, "8 9 10", "stop")]
    );
    // usage sums the prompts: 2 + 1 + 3 prompt tokens, as many completion tokens.
    assert_eq!(v["usage"]["prompt_tokens"], 6, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    assert_eq!(v["usage"]["total_tokens"], 12, "{v}");

    // A list of strings is answered the same way.
    let r = post(
        srv.addr,
        "/v1/completions",
        &completion(json!(["echo a b", "echo c"]), json!({})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], "a b");
    assert_eq!(v["choices"][1]["text"], "c");
    assert_eq!(v["choices"][1]["index"], 1);
}

#[test]
fn streamed_token_id_prompts_carry_their_index_and_one_usage_chunk() {
    let srv = mock_server();
    let body = completion(
        json!([[1, 2, 3], [4]]),
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let r = post(srv.addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.sse();
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let mut texts = [String::new(), String::new()];
    let mut finishes = [0, 0];
    let mut usage = Vec::new();
    for (_, d) in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        assert_eq!(v["object"], "text_completion", "{v}");
        if v["choices"].as_array().unwrap().is_empty() {
            usage.push(v["usage"].clone());
            continue;
        }
        let c = &v["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        texts[i].push_str(c["text"].as_str().unwrap());
        if !c["finish_reason"].is_null() {
            finishes[i] += 1;
        }
    }
    assert_eq!(texts, ["1 2 3".to_string(), "4".to_string()]);
    assert_eq!(finishes, [1, 1], "one finish_reason per choice");
    assert_eq!(usage.len(), 1, "one usage chunk, at the end");
    assert_eq!(usage[0]["prompt_tokens"], 4);
    assert_eq!(usage[0]["completion_tokens"], 4);
    let last_data: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    assert!(last_data["choices"].as_array().unwrap().is_empty());
}

#[test]
fn bad_prompts_are_400s_naming_the_element() {
    let srv = mock_server();
    for (prompt, needle) in [
        (json!([1, -2]), "prompt[1] is -2"),
        (
            json!([[1], [2, 5_000_000_000u64]]),
            "prompt[1][1] is 5000000000",
        ),
        (json!([1, "a"]), "prompt[1]"),
        (json!([1.5]), "prompt[0] is 1.5"),
        (json!([]), "between 1 and"),
        (json!({"ids": [1]}), "prompt"),
    ] {
        let r = post(
            srv.addr,
            "/v1/completions",
            &completion(prompt.clone(), json!({})),
        );
        let msg = error_message(&r);
        assert!(msg.contains(needle), "{prompt}: '{msg}' lacks '{needle}'");
    }
    let many: Vec<Vec<u32>> = (0..65).map(|i| vec![i]).collect();
    let r = post(
        srv.addr,
        "/v1/completions",
        &completion(json!(many), json!({})),
    );
    assert!(error_message(&r).contains("65 prompts"));
}

/// A field of the wrong type is a 400 that names it (its path in the body).
#[test]
fn parse_errors_name_the_field() {
    let srv = mock_server();
    let chat = |extra: Value| {
        let mut b = json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    for (extra, needle) in [
        (json!({"temperature": "hot"}), "temperature"),
        (json!({"stop": 3}), "stop"),
        // vLLM's controls, flattened into the request: named too.
        (json!({"top_k": "x"}), "top_k"),
        (json!({"min_p": true}), "min_p"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "x"}]}),
            "messages[1].role",
        ),
        (json!({"tools": [{"type": "function"}]}), "tools[0]"),
    ] {
        let r = post(srv.addr, "/v1/chat/completions", &chat(extra.clone()));
        let msg = error_message(&r);
        assert!(msg.contains(needle), "{extra}: '{msg}' lacks '{needle}'");
    }
}

/// The fields listed as accepted and not acted on pass; those that would change the
/// output are refused by name.
#[test]
fn ignored_fields_pass_and_unimplemented_ones_are_named() {
    let srv = mock_server();
    let mut b = json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}],
        "user": "u-1", "metadata": {"k": "v"}, "store": false, "service_tier": "auto",
        "prompt_cache_key": "p", "safety_identifier": "s", "parallel_tool_calls": true,
        "modalities": ["text"], "response_format": {"type": "text"}});
    let r = post(srv.addr, "/v1/chat/completions", &b);
    assert_eq!(r.status, 200, "{}", r.body);
    for (field, v) in [
        ("audio", json!({"voice": "alloy", "format": "wav"})),
        ("prediction", json!({"type": "content", "content": "x"})),
        ("web_search_options", json!({})),
        ("reasoning_effort", json!("high")),
        ("verbosity", json!("low")),
        ("modalities", json!(["text", "audio"])),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        ),
    ] {
        let mut bad = b.clone();
        bad[field] = v;
        let r = post(srv.addr, "/v1/chat/completions", &bad);
        let msg = error_message(&r);
        assert!(msg.contains(field), "'{msg}' lacks '{field}'");
    }
    // `null` is the same as absent.
    b["audio"] = Value::Null;
    assert_eq!(post(srv.addr, "/v1/chat/completions", &b).status, 200);
}
