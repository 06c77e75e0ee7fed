//! `fak serve`'s boundary state through the binary, each server on its own `FAK_HOME`: a
//! revocation survives a restart (kill, start again), `--max-tool-result-kb` moves the
//! page-out threshold, and the store and audit flags refuse bad values.

mod common;

use common::Serve;
use serde_json::{json, Value};
use std::path::Path;

fn serve(home: &Path, args: &[&str]) -> Serve {
    let srv = Serve::spawn(
        common::fak()
            .env("FAK_HOME", home)
            .args(["serve", "--engine", "mock", "--port", "0"])
            .args(args),
    );
    common::wait_ready(&srv.addr);
    srv
}

/// One HTTP/1.1 POST of `body`; returns (status, body as JSON, `null` when not JSON).
fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, body) = common::http(addr, "POST", path, &body.to_string());
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

fn with_result(result: &str) -> Value {
    json!({"model": "mock", "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": result}
    ]})
}

/// The verdict of the request's one tool result (`None`: admitted).
fn verdict(v: &Value) -> Option<String> {
    v.pointer("/fak/tool_results/0/verdict")
        .and_then(Value::as_str)
        .map(|s| format!("{s} {}", v["fak"]["tool_results"][0]["reason"]))
}

#[test]
fn a_revocation_survives_a_restart_of_the_server() {
    let home = tempfile::tempdir().unwrap();
    let benign = "Weather: 18 C, light rain.";
    {
        let s = serve(home.path(), &[]);
        let (st, v) = post(&s.addr, "/v1/chat/completions", &with_result(benign));
        assert_eq!((st, verdict(&v)), (200, None), "{v}");
        // The sha256 of the content, as the audit log names it.
        let log = std::fs::read_to_string(home.path().join("audit.jsonl")).unwrap();
        let rec: Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
        let d = rec["digest"].as_str().unwrap().to_string();
        let (st, v) = post(&s.addr, "/v1/fak/revoke", &json!({"digest": d}));
        assert_eq!(st, 200, "{v}");
    }
    let s = serve(home.path(), &[]);
    let (st, v) = post(&s.addr, "/v1/chat/completions", &with_result(benign));
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        verdict(&v).as_deref(),
        Some("quarantine \"REVOKED\""),
        "{v}"
    );
}

#[test]
fn max_tool_result_kb_moves_the_page_out_threshold() {
    let home = tempfile::tempdir().unwrap();
    // 40 KiB with no spaces: one word for the mock engine, which counts words as tokens.
    let big = "row,value;".repeat(4096);
    let s = serve(home.path(), &[]);
    let (st, v) = post(&s.addr, "/v1/chat/completions", &with_result(&big));
    assert_eq!(st, 200);
    assert_eq!(verdict(&v).as_deref(), Some("page_out null"), "{v}");
    drop(s);
    let s = serve(home.path(), &["--max-tool-result-kb", "64"]);
    let big2 = "row,other;".repeat(4096);
    let (st, v) = post(&s.addr, "/v1/chat/completions", &with_result(&big2));
    assert_eq!((st, verdict(&v)), (200, None), "{v}");
}

#[test]
fn bad_state_flags_are_refused() {
    let home = tempfile::tempdir().unwrap();
    for args in [
        &["--max-tool-result-kb", "0"][..],
        &["--max-tool-result-kb", "5000"],
        &["--store-max-items", "x"],
    ] {
        let out = common::fak()
            .env("FAK_HOME", home.path())
            .args(["serve", "--engine", "mock", "--port", "0"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(args[0]), "{args:?}: {err}");
    }
}
