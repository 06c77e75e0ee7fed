//! A model that fails to load, through the gateway on a real socket: the in-kernel driver
//! over a truncated GGUF file (written in the test's temp dir). Its requests get an error
//! no retry can fix (500 `api_error`, `x-should-retry: false`, no `Retry-After`) in each
//! API's shape, naming the load failure without the file's path; `/v1/models` leaves it
//! out; `/health` says failed with the reason. Routed beside a working engine, the other
//! route keeps serving.

mod common;

use common::{get, post, start, start_router};
use fak_engine::inkernel::InKernelDriver;
use fak_engine::mock::MockDriver;
use fak_engine::route::RoutedDriver;
use fak_engine::{EngineConfig, EngineDriver, Readiness};
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The in-kernel driver over `broken.gguf` in `dir`: a GGUF header (magic, version 3)
/// that claims tensors and metadata the file then lacks. Returns once its load failed.
fn broken_driver(dir: &Path) -> Arc<InKernelDriver> {
    let path = dir.join("broken.gguf");
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&7u64.to_le_bytes()); // tensors
    bytes.extend_from_slice(&5u64.to_le_bytes()); // metadata entries
    bytes.extend_from_slice(b"\x14\x00\x00"); // cut inside the first key's length
    std::fs::write(&path, bytes).unwrap();
    let d = Arc::new(InKernelDriver::start(path, EngineConfig::default()));
    let t = Instant::now();
    while d.readiness() == Readiness::Loading {
        assert!(t.elapsed() < Duration::from_secs(30), "still loading");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        matches!(d.readiness(), Readiness::Failed(_)),
        "{:?}",
        d.readiness()
    );
    d
}

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
}

fn messages(model: &str) -> Value {
    json!({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
}

/// The final-error checks common to both wires: status, headers, a message naming the
/// load failure and no part of the server's path.
fn assert_final(r: &common::Resp, message: &str, dir: &Path) {
    assert_eq!(r.status, 500, "{}", r.body);
    assert_eq!(r.header("x-should-retry"), Some("false"), "{:?}", r.headers);
    assert_eq!(r.header("retry-after"), None, "{:?}", r.headers);
    assert!(
        message.contains("cannot be served") && message.contains("loading the model 'broken'"),
        "{message}"
    );
    let tmp = dir.display().to_string();
    assert!(!message.contains(&tmp), "{message}");
}

#[test]
fn a_model_that_failed_to_load_is_a_final_error_on_both_wires() {
    let dir = tempfile::tempdir().unwrap();
    let srv = start(broken_driver(dir.path()), GatewayConfig::default());

    let r = post(srv.addr, "/v1/chat/completions", &chat("broken"));
    let v = r.json();
    assert_eq!(v["error"]["type"], "api_error", "{v}");
    assert_final(&r, v["error"]["message"].as_str().unwrap(), dir.path());
    let mut stream = chat("broken");
    stream["stream"] = json!(true);
    let r = post(srv.addr, "/v1/chat/completions", &stream);
    assert_final(
        &r,
        r.json()["error"]["message"].as_str().unwrap(),
        dir.path(),
    );
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": "broken", "prompt": "hi"}),
    );
    assert_final(
        &r,
        r.json()["error"]["message"].as_str().unwrap(),
        dir.path(),
    );

    let r = post(srv.addr, "/v1/messages", &messages("broken"));
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "api_error", "{v}");
    assert_final(&r, v["error"]["message"].as_str().unwrap(), dir.path());

    // Not listed: no request for it can succeed.
    let r = get(srv.addr, "/v1/models");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"], json!([]), "{}", r.body);

    let r = get(srv.addr, "/health");
    assert_eq!(r.status, 503, "{}", r.body);
    let v = r.json();
    assert_eq!(v["status"], "failed", "{v}");
    let why = v["error"].as_str().unwrap();
    assert!(why.contains("loading the model 'broken'"), "{why}");
    assert!(!why.contains(&dir.path().display().to_string()), "{why}");
}

#[test]
fn beside_a_failed_model_another_route_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let broken = broken_driver(dir.path()) as Arc<dyn EngineDriver>;
    let mock = Arc::new(MockDriver::new().with_model("mock")) as Arc<dyn EngineDriver>;
    let router = Arc::new(
        RoutedDriver::new(vec![("broken".into(), broken), ("mock".into(), mock)]).unwrap(),
    );
    // As `fak serve --route` wires it: /health names the routes down.
    let routes = Arc::clone(&router);
    let app = fak_gateway::report_models_down(
        fak_gateway::router(router, GatewayConfig::default()),
        Arc::new(move || routes.not_ready()),
    );
    let srv = start_router(app);

    let r = post(srv.addr, "/v1/chat/completions", &chat("mock"));
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(srv.addr, "/v1/messages", &messages("mock"));
    assert_eq!(r.status, 200, "{}", r.body);

    let r = post(srv.addr, "/v1/chat/completions", &chat("broken"));
    assert_final(
        &r,
        r.json()["error"]["message"].as_str().unwrap(),
        dir.path(),
    );
    let r = post(srv.addr, "/v1/messages", &messages("broken"));
    assert_final(
        &r,
        r.json()["error"]["message"].as_str().unwrap(),
        dir.path(),
    );

    let ids: Vec<Value> = get(srv.addr, "/v1/models").json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].clone())
        .collect();
    assert_eq!(ids, [json!("mock")]);
    // 200 (the other route serves), saying which route is down and why (before: a
    // plain "ok").
    let r = get(srv.addr, "/health");
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["status"], "degraded", "{v}");
    assert_eq!(v["models"], json!(["mock"]), "{v}");
    let down = v["down"].as_array().unwrap();
    assert_eq!(down.len(), 1, "{v}");
    assert_eq!(down[0]["model"], "broken");
    assert!(!down[0]["error"].as_str().unwrap().is_empty(), "{v}");
    assert!(!r.body.contains(dir.path().to_str().unwrap()), "{v}");
}
