//! The request time limit over the mock engine (slowed to 10 ms a word): a whole
//! answer that takes longer gets 504 in each API's shape and its generation is
//! cancelled; a stream is limited only until it starts; no limit means none.

mod common;

use common::{get, post, start, Resp};
use fak_engine::mock::MockDriver;
use fak_engine::EngineDriver;
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_millis(300);

fn slow_mock() -> Arc<MockDriver> {
    Arc::new(MockDriver::new().with_delay(Duration::from_millis(10)))
}

fn config(request_timeout: Option<Duration>) -> GatewayConfig {
    GatewayConfig {
        request_timeout,
        ..GatewayConfig::default()
    }
}

/// A request whose reply is `1 2 ... n`, one word per 10 ms.
fn count(n: usize) -> Value {
    json!({"model": "mock", "max_tokens": n + 10,
           "messages": [{"role": "user", "content": format!("count {n}")}]})
}

fn expected(n: usize) -> String {
    (1..=n).map(|i| i.to_string()).collect::<Vec<_>>().join(" ")
}

/// Waits until the driver reports no generation running; panics after 2 s.
fn wait_idle(d: &MockDriver) {
    let t = Instant::now();
    while d.stats().active > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the generation ran on"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_slow_whole_answer_gets_504_and_is_cancelled() {
    let d = slow_mock();
    let srv = start(Arc::clone(&d) as Arc<dyn EngineDriver>, config(Some(LIMIT)));
    // 1000 words would take 10 s.
    for (path, check) in [
        ("/v1/chat/completions", openai_timeout as fn(&Resp)),
        ("/v1/messages", anthropic_timeout),
    ] {
        let t = Instant::now();
        let r = post(srv.addr, path, &count(1000));
        let took = t.elapsed();
        check(&r);
        assert!(
            took >= LIMIT && took < LIMIT + Duration::from_secs(2),
            "{path}: answered after {took:?}"
        );
        wait_idle(&d);
    }
    let m = get(srv.addr, "/metrics").body;
    assert!(
        m.contains("fak_requests_total{route=\"/v1/chat/completions\",status=\"504\"} 1"),
        "{m}"
    );
    // A quick answer is untouched.
    let r = post(srv.addr, "/v1/chat/completions", &count(5));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["message"]["content"], expected(5));
}

fn openai_timeout(r: &Resp) {
    assert_eq!(r.status, 504, "{}", r.body);
    let v = r.json();
    assert_eq!(v["error"]["type"], "timeout_error", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("0.3 s"),
        "{v}"
    );
}

fn anthropic_timeout(r: &Resp) {
    assert_eq!(r.status, 504, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "timeout_error", "{v}");
}

#[test]
fn a_stream_is_limited_only_until_it_starts() {
    let srv = start(slow_mock(), config(Some(LIMIT)));
    // 60 words: about 0.6 s, twice the limit.
    let mut body = count(60);
    body["stream"] = json!(true);
    let t = Instant::now();
    let r = post(srv.addr, "/v1/chat/completions", &body);
    assert!(t.elapsed() > LIMIT, "the stream was quicker than the limit");
    assert_eq!(r.status, 200, "{}", r.body);
    let ev = r.sse();
    assert_eq!(ev.last().unwrap().1, "[DONE]", "{}", r.body);
    let text: String = ev[..ev.len() - 1]
        .iter()
        .filter_map(|(_, d)| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, expected(60));
}

#[test]
fn no_limit_means_none() {
    let srv = start(slow_mock(), config(None));
    let r = post(srv.addr, "/v1/messages", &count(60));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["content"][0]["text"], expected(60));
    assert_eq!(
        GatewayConfig::default().request_timeout,
        Some(Duration::from_secs(600))
    );
}
