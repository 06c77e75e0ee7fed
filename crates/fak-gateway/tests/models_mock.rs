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

/// A driver serving the given model ids (each as the mock's model).
struct Many(Vec<String>);

impl EngineDriver for Many {
    fn id(&self) -> &'static str {
        "many"
    }
    fn models(&self) -> Vec<fak_engine::ModelInfo> {
        self.0
            .iter()
            .map(|id| fak_engine::ModelInfo {
                id: id.clone(),
                context_length: 1,
                owned_by: "many".into(),
            })
            .collect()
    }
    fn readiness(&self) -> fak_engine::Readiness {
        fak_engine::Readiness::Ready
    }
    fn submit(
        &self,
        _: fak_engine::GenerateRequest,
    ) -> Result<fak_engine::EventStream, fak_engine::EngineError> {
        Err(fak_engine::EngineError::NotReady("many".into()))
    }
}

fn ids_of(v: &Value) -> Vec<String> {
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn the_anthropic_list_pages_as_the_api_does() {
    let all: Vec<String> = (0..25).map(|i| format!("m{i:02}")).collect();
    let srv = start(Arc::new(Many(all.clone())), GatewayConfig::default());
    let get = |q: &str| get_with(&srv, &format!("/v1/models{q}"), &[ANTHROPIC]);
    // The default page is 20 (before: every model, has_more always false).
    let (st, v) = get("");
    assert_eq!(st, 200, "{v}");
    assert_eq!(ids_of(&v), all[..20]);
    assert_eq!(
        (&v["has_more"], &v["first_id"], &v["last_id"]),
        (&json!(true), &json!("m00"), &json!("m19"))
    );
    // Walking forward as the SDK does: after_id = last_id while has_more.
    let mut seen = Vec::new();
    let mut q = "?limit=7".to_string();
    loop {
        let (st, v) = get(&q);
        assert_eq!(st, 200, "{v}");
        seen.extend(ids_of(&v));
        if v["has_more"] == false {
            break;
        }
        q = format!("?limit=7&after_id={}", v["last_id"].as_str().unwrap());
    }
    assert_eq!(seen, all);
    // Backwards: the page right before before_id.
    let (_, v) = get("?limit=3&before_id=m05");
    assert_eq!(ids_of(&v), ["m02", "m03", "m04"]);
    assert_eq!(
        (&v["has_more"], &v["first_id"]),
        (&json!(true), &json!("m02"))
    );
    let (_, v) = get("?limit=3&before_id=m02");
    assert_eq!(ids_of(&v), ["m00", "m01"]);
    assert_eq!(v["has_more"], false);
    // Past the end: an empty page with null ids.
    let (_, v) = get("?after_id=m24");
    assert_eq!((ids_of(&v).len(), &v["first_id"]), (0, &Value::Null));
    // Bad parameters: 400s naming them.
    for (q, names) in [
        ("?limit=0", "limit"),
        ("?limit=1001", "limit"),
        ("?limit=ten", "limit"),
        ("?after_id=nope", "after_id"),
        ("?before_id=nope", "before_id"),
        ("?after_id=m01&before_id=m03", "after_id and before_id"),
    ] {
        let (st, v) = get(q);
        assert_eq!(st, 400, "{q}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{q}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(names), "{q}: {msg}");
    }
    // The OpenAI list is one page, whatever the query.
    let (_, v) = get_with(&srv, "/v1/models?limit=2", &[]);
    assert_eq!(ids_of(&v).len(), 25);
}

#[test]
fn a_patterns_own_text_is_no_model() {
    let srv = aliased();
    for h in [&[][..], &[ANTHROPIC][..]] {
        // Before: `claude-*` matched itself and was answered as a model.
        let (st, v) = get_with(&srv, "/v1/models/claude-*", h);
        assert_eq!(st, 404, "{v}");
        assert_eq!(v["error"]["type"], "not_found_error");
        let (st, v) = get_with(&srv, "/v1/models", h);
        assert_eq!(st, 200);
        assert!(!ids_of(&v).iter().any(|id| id.contains('*')), "{v}");
    }
    let msg = json!({"model": "claude-*", "max_tokens": 16,
        "messages": [{"role": "user", "content": "echo hello"}]});
    let r = post(srv.addr, "/v1/messages", &msg);
    assert_eq!(r.status, 404, "{}", r.body);
}

#[test]
fn an_alias_whose_model_is_gone_is_a_404_naming_the_id_sent() {
    // The alias's MODEL is not served (a driver that lists it no more).
    let d = AliasedDriver::new(
        Arc::new(MockDriver::new()),
        vec![Alias::parse("gpt-4o=gone").unwrap()],
    );
    let srv = start(Arc::new(d), GatewayConfig::default());
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/messages",
            json!({"model": "gpt-4o", "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}]}),
        ),
    ] {
        let r = post(srv.addr, path, &body);
        assert_eq!(r.status, 404, "{}", r.body);
        // Before: "model 'gone' is not served", an id the client never sent.
        assert!(
            r.body.contains("'gpt-4o'") && !r.body.contains("'gone'"),
            "{}",
            r.body
        );
    }
}
