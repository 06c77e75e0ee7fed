//! `GET /v1/models` and `GET /v1/models/{id}` on both wires, and model aliases
//! (`fak serve --alias`) seen through the gateway: the mock engine on a loopback socket.

mod common;

use common::{post, request, start, Server};
use fak_engine::alias::{Alias, AliasedDriver};
use fak_engine::mock::{MockDriver, MOCK_CONTEXT};
use fak_engine::EngineDriver;
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::sync::Arc;

const ANTHROPIC: (&str, &str) = ("anthropic-version", "2023-06-01");

fn aliased() -> Server {
    let d = AliasedDriver::new(
        Arc::new(MockDriver::new()),
        vec![
            Alias::parse("claude-*=mock").unwrap(),
            Alias::parse("gpt-4o=mock").unwrap(),
        ],
    );
    start(
        Arc::new(d) as Arc<dyn EngineDriver>,
        GatewayConfig::default(),
    )
}

fn get_with(srv: &Server, path: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let r = request(srv.addr, "GET", path, headers, b"");
    (r.status, serde_json::from_str(&r.body).unwrap())
}

#[test]
fn the_list_has_each_wires_shape() {
    let srv = aliased();
    let (st, v) = get_with(&srv, "/v1/models", &[]);
    assert_eq!(st, 200);
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    // The concrete alias is listed, the pattern is not.
    assert_eq!(ids, ["mock", "gpt-4o"]);
    let m = &v["data"][1];
    assert_eq!(m["object"], "model");
    assert!(m["created"].is_u64());
    assert_eq!(m["owned_by"], "mock");
    assert_eq!(m["context_length"], MOCK_CONTEXT);

    let (st, v) = get_with(&srv, "/v1/models", &[ANTHROPIC]);
    assert_eq!(st, 200);
    assert!(v.get("object").is_none(), "{v}");
    assert_eq!(v["has_more"], false);
    assert_eq!(v["first_id"], "mock");
    assert_eq!(v["last_id"], "gpt-4o");
    let m = &v["data"][0];
    assert_eq!(m["type"], "model");
    assert_eq!(m["id"], "mock");
    assert_eq!(m["display_name"], "mock");
    let at = m["created_at"].as_str().unwrap();
    assert!(
        at.len() == 20 && at.ends_with('Z') && at.as_bytes()[10] == b'T',
        "{at}"
    );
}

#[test]
fn one_model_by_id_on_both_wires_and_404_for_an_unknown_one() {
    let srv = aliased();
    let (st, v) = get_with(&srv, "/v1/models/mock", &[]);
    assert_eq!(st, 200);
    assert_eq!(
        (v["id"].as_str(), v["object"].as_str()),
        (Some("mock"), Some("model"))
    );
    // A glob alias's id is a model too, on either wire.
    let (st, v) = get_with(&srv, "/v1/models/claude-opus-4-1", &[ANTHROPIC]);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["type"], "model");
    assert_eq!(v["id"], "claude-opus-4-1");
    let (st, v) = get_with(&srv, "/v1/models/claude-opus-4-1", &[]);
    assert_eq!((st, v["owned_by"].as_str()), (200, Some("mock")));

    let (st, v) = get_with(&srv, "/v1/models/llama-3", &[]);
    assert_eq!(st, 404);
    assert_eq!(v["error"]["type"], "not_found_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("llama-3"));
    let (st, v) = get_with(&srv, "/v1/models/llama-3", &[ANTHROPIC]);
    assert_eq!(st, 404);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "not_found_error");
    // An id with a slash (a hub-style name) is looked up whole.
    let (st, _) = get_with(&srv, "/v1/models/Qwen/Qwen2.5-7B", &[]);
    assert_eq!(st, 404);
}

#[test]
fn an_alias_is_served_and_answered_under_the_id_asked_for() {
    let srv = aliased();
    let chat =
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "echo hi there"}]});
    let r = post(srv.addr, "/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["model"], "gpt-4o");
    assert_eq!(v["choices"][0]["message"]["content"], "hi there");

    let msg = json!({"model": "claude-sonnet-4-5", "max_tokens": 16,
        "messages": [{"role": "user", "content": "echo hello"}]});
    let r = post(srv.addr, "/v1/messages", &msg);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["model"], "claude-sonnet-4-5");
    assert_eq!(v["content"][0]["text"], "hello");

    // No alias matches: the engine's 404, naming what is served.
    let mut miss = msg.clone();
    miss["model"] = json!("gemini-2");
    let r = post(srv.addr, "/v1/messages", &miss);
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("gemini-2"));
}
