//! The boundary's durable state through HTTP over the mock engine: a revocation made on
//! one server is in force on the next one started on the same store folder, and an audit
//! log that cannot be written refuses the request (fail-closed, 503 in the wire's shape)
//! or lets it through and counts it in `/metrics` (fail-open).

mod common;

use common::{get, post, start_router, Server};
use fak_ctxmmu::{AuditConfig, AuditLog, PageStore, Screen, ScreenConfig};
use fak_engine::mock::MockDriver;
use fak_engine::policy::Policy;
use fak_gateway::{router_with_boundary, Boundary, GatewayConfig};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;

const BENIGN: &str = "Weather: 18 C, light rain, wind 10 km/h.";

fn server(store: &Path, audit: AuditLog) -> Server {
    let screen = Screen::with(
        fak_ctxmmu::default_detectors(),
        ScreenConfig::default(),
        PageStore::open(store).unwrap(),
        audit,
    );
    start_router(router_with_boundary(
        Arc::new(MockDriver::default()),
        GatewayConfig::default(),
        Boundary {
            policy: Policy::builtin(),
            screen,
        },
    ))
}

fn openai_with_result(result: &str) -> Value {
    json!({"model": "mock", "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": result}
    ]})
}

fn anthropic_with_result(result: &str) -> Value {
    json!({"model": "mock", "max_tokens": 20, "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": result}]}
    ]})
}

/// The `fak.tool_results` verdict and reason of the one result, or `None` if admitted.
fn verdict(r: &Value) -> Option<(String, String)> {
    let e = r.pointer("/fak/tool_results/0")?;
    Some((
        e["verdict"].as_str()?.to_string(),
        e["reason"].as_str().unwrap_or_default().to_string(),
    ))
}

#[test]
fn a_revocation_is_in_force_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let srv = server(dir.path(), AuditLog::in_memory());
        let r = post(
            srv.addr,
            "/v1/chat/completions",
            &openai_with_result(BENIGN),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(verdict(&r.json()), None);
        let d = fak_ctxmmu::digest(BENIGN);
        let r = post(srv.addr, "/v1/fak/revoke", &json!({"digest": d}));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // A new server (a restart) on the same FAK_HOME.
    let srv = server(dir.path(), AuditLog::in_memory());
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &openai_with_result(BENIGN),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        verdict(&r.json()),
        Some(("quarantine".into(), "REVOKED".into()))
    );
    let m = get(srv.addr, "/metrics").body;
    assert!(m.contains("\nfak_revocations 1\n"), "{m}");
}

#[test]
fn an_unwritable_audit_log_refuses_fail_closed_and_counts_fail_open() {
    let dir = tempfile::tempdir().unwrap();
    // A directory where the log file should be: every write fails.
    let bad = dir.path().join("audit.jsonl");
    std::fs::create_dir(&bad).unwrap();
    let log = |fail_closed| {
        AuditLog::to_file_with(
            &bad,
            AuditConfig {
                fail_closed,
                ..AuditConfig::default()
            },
        )
    };
    let closed = server(&dir.path().join("a"), log(true));
    for (path, body, shape) in [
        (
            "/v1/chat/completions",
            openai_with_result(BENIGN),
            "/error/type",
        ),
        ("/v1/messages", anthropic_with_result(BENIGN), "/error/type"),
    ] {
        let r = post(closed.addr, path, &body);
        assert_eq!(r.status, 503, "{path}: {}", r.body);
        let v = r.json();
        assert_eq!(v.pointer(shape).and_then(Value::as_str), Some("api_error"));
        if path == "/v1/messages" {
            assert_eq!(v["type"], "error");
        }
        assert!(r.body.contains("audit"), "{}", r.body);
    }
    // Requests without a tool result write no record and pass.
    let r = post(
        closed.addr,
        "/v1/chat/completions",
        &json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    let open = server(&dir.path().join("b"), log(false));
    let r = post(
        open.addr,
        "/v1/chat/completions",
        &openai_with_result(BENIGN),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let m = get(open.addr, "/metrics").body;
    assert!(m.contains("\nfak_audit_write_failures_total 1\n"), "{m}");
}
