//! Clients that go away while the engine is silent (a long prompt's prefill, mocked by
//! [`MockDriver::with_prefill_delay`]): the generation is cancelled within moments, on
//! every streaming wire and for a non-streamed request on every generating route, with
//! the bytes of a pipelined request behind it or not; a client that stays is served,
//! its pipelined request too; and keep-alives flow while the engine is silent, in each
//! wire's form.

mod common;

use common::{request, start};
use fak_engine::mock::MockDriver;
use fak_engine::EngineDriver;
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The three streaming routes and a streamed body for each.
fn streamed(path: &str, content: &str) -> Value {
    let msg = json!([{"role": "user", "content": content}]);
    match path {
        "/v1/responses" => json!({"model": "mock", "stream": true, "input": msg}),
        "/v1/messages" => {
            json!({"model": "mock", "stream": true, "max_tokens": 50, "messages": msg})
        }
        _ => json!({"model": "mock", "stream": true, "messages": msg}),
    }
}

const STREAM_ROUTES: [&str; 3] = ["/v1/chat/completions", "/v1/responses", "/v1/messages"];

/// A second request, sent right after the first on the same connection (pipelined).
/// The server holds its bytes unread while it answers the first; with bytes waiting
/// there, hyper does not look for the end of the connection, so only a write notices
/// that the client left.
const PIPELINED: &str = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";

/// Sends `body` to `path` (followed by `then`, raw) and returns the socket once the
/// response head has arrived, with that head.
fn head_then_socket(addr: SocketAddr, path: &str, body: &Value, then: &str) -> (TcpStream, String) {
    let mut s = send(addr, path, body, then);
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("{path}: no response head: {e}"));
        assert!(n > 0, "{path}: closed before the response head");
        got.extend_from_slice(&buf[..n]);
    }
    (s, String::from_utf8_lossy(&got).into_owned())
}

/// Waits until `mock` runs no generation; panics naming `what` after `limit`.
fn idle_within(mock: &MockDriver, limit: Duration, what: &str) -> Duration {
    let t = Instant::now();
    while mock.stats().active > 0 {
        assert!(
            t.elapsed() < limit,
            "{what}: the generation still runs {:?} after the client left",
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    t.elapsed()
}

/// Waits until `mock` runs a generation.
fn busy_within(mock: &MockDriver, limit: Duration) {
    let t = Instant::now();
    while mock.stats().active == 0 {
        assert!(t.elapsed() < limit, "the request never started");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The generating routes and a non-streamed body for each.
fn unstreamed(path: &str, content: &str) -> Value {
    let msg = json!([{"role": "user", "content": content}]);
    match path {
        "/v1/responses" => json!({"model": "mock", "input": msg}),
        "/v1/messages" => json!({"model": "mock", "max_tokens": 50, "messages": msg}),
        "/v1/completions" => json!({"model": "mock", "prompt": content}),
        _ => json!({"model": "mock", "messages": msg}),
    }
}

const ALL_ROUTES: [&str; 4] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
];

/// Sends `body` to `path` (followed by `then`, raw) on a new connection.
fn send(addr: SocketAddr, path: &str, body: &Value, then: &str) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}{then}",
        body.len()
    )
    .unwrap();
    s
}

/// Reads one response (head and a `Content-Length` body) from `s`, after `buf`'s bytes;
/// returns its status and body and leaves what follows in `buf`.
fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> (u16, String) {
    let mut chunk = [0u8; 4096];
    let mut more = |s: &mut TcpStream, buf: &mut Vec<u8>| {
        let n = s.read(&mut chunk).expect("reading a response");
        assert!(
            n > 0,
            "closed mid-response: {:?}",
            String::from_utf8_lossy(buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    };
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        more(s, buf);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status: u16 = head[9..12].parse().unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no Content-Length: {head}"));
    while buf.len() < head_end + len {
        more(s, buf);
    }
    let body = String::from_utf8_lossy(&buf[head_end..head_end + len]).into_owned();
    buf.drain(..head_end + len);
    (status, body)
}

fn config() -> GatewayConfig {
    GatewayConfig {
        sse_keep_alive: Some(Duration::from_millis(200)),
        ..GatewayConfig::default()
    }
}

#[test]
fn a_stream_whose_client_leaves_during_the_prefill_is_cancelled() {
    // A prefill far longer than the test: only a cancel ends it in time.
    let mock = Arc::new(MockDriver::new().with_prefill_delay(Duration::from_secs(120)));
    let srv = start(Arc::clone(&mock) as Arc<dyn EngineDriver>, config());
    for path in STREAM_ROUTES {
        for then in ["", PIPELINED] {
            let (s, head) = head_then_socket(srv.addr, path, &streamed(path, "hi"), then);
            // The stream is open before the prefill ends: 200 and an event stream.
            assert!(head.starts_with("HTTP/1.1 200"), "{path}: {head}");
            assert!(head.contains("text/event-stream"), "{path}: {head}");
            busy_within(&mock, Duration::from_secs(5));
            drop(s);
            let what = format!("{path} (pipelined bytes: {})", !then.is_empty());
            let took = idle_within(&mock, Duration::from_secs(5), &what);
            eprintln!("{what}: cancelled {took:?} after the client left");
        }
    }
}

#[test]
fn an_unstreamed_request_whose_client_leaves_during_the_prefill_is_cancelled() {
    // A prefill far longer than the test: only a cancel ends it in time. Without
    // pipelined bytes hyper notices the EOF itself; with them, only the connection's
    // watcher does.
    let mock = Arc::new(MockDriver::new().with_prefill_delay(Duration::from_secs(120)));
    let srv = start(Arc::clone(&mock) as Arc<dyn EngineDriver>, config());
    for path in ALL_ROUTES {
        for then in ["", PIPELINED] {
            let s = send(srv.addr, path, &unstreamed(path, "hi"), then);
            busy_within(&mock, Duration::from_secs(5));
            drop(s);
            let what = format!("{path} unstreamed (pipelined bytes: {})", !then.is_empty());
            let took = idle_within(&mock, Duration::from_secs(5), &what);
            eprintln!("{what}: cancelled {took:?} after the client left");
        }
    }
}

#[test]
fn an_unstreamed_request_whose_client_stays_is_served_and_so_is_its_pipelined_one() {
    // A prefill long enough for the watcher to see the pipelined bytes arrive and hold
    // them; they must reach hyper whole, after the first response.
    let mock = Arc::new(MockDriver::new().with_prefill_delay(Duration::from_millis(700)));
    let srv = start(Arc::clone(&mock) as Arc<dyn EngineDriver>, config());
    for path in ALL_ROUTES {
        let mut s = send(srv.addr, path, &unstreamed(path, "echo a b"), PIPELINED);
        let mut buf = Vec::new();
        let (status, body) = read_response(&mut s, &mut buf);
        assert_eq!(status, 200, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(v.to_string().contains("a b"), "{path}: {body}");
        let (status, body) = read_response(&mut s, &mut buf);
        assert_eq!(status, 200, "{path}: the pipelined /health: {body}");
        assert!(
            buf.is_empty(),
            "{path}: {:?}",
            String::from_utf8_lossy(&buf)
        );
        // The connection is still open and serves a third request.
        write!(s, "{PIPELINED}").unwrap();
        let (status, _) = read_response(&mut s, &mut buf);
        assert_eq!(status, 200, "{path}: a request after the pipelined one");
    }
    // Bytes that arrive late, while the first response is pending, are kept too.
    let mut s = send(
        srv.addr,
        "/v1/chat/completions",
        &unstreamed("", "echo c"),
        "",
    );
    busy_within(&mock, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(100));
    write!(s, "{PIPELINED}").unwrap();
    let mut buf = Vec::new();
    let (status, body) = read_response(&mut s, &mut buf);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"c\""), "{body}");
    let (status, _) = read_response(&mut s, &mut buf);
    assert_eq!(status, 200);
}

#[test]
fn keep_alives_flow_while_the_engine_is_silent_and_the_stream_still_parses() {
    let mock = Arc::new(MockDriver::new().with_prefill_delay(Duration::from_millis(1100)));
    let srv = start(Arc::clone(&mock) as Arc<dyn EngineDriver>, config());
    for path in STREAM_ROUTES {
        let r = request(
            srv.addr,
            "POST",
            path,
            &[],
            streamed(path, "echo a b").to_string().as_bytes(),
        );
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        let blocks: Vec<&str> = r.body.split("\n\n").filter(|b| !b.is_empty()).collect();
        // A 1.1 s silence at 0.2 s: at least 4 keep-alives, all before the first text.
        let alive = |b: &str| match path {
            "/v1/messages" => b == "event: ping\ndata: {\"type\":\"ping\"}",
            _ => b == ": keep-alive",
        };
        let n = blocks.iter().filter(|b| alive(b)).count();
        assert!(n >= 4, "{path}: {n} keep-alives in {:?}", r.body);
        let first_text = blocks
            .iter()
            .position(|b| b.contains("\"a\"") || b.contains("\"a "))
            .unwrap_or_else(|| panic!("{path}: no text in {:?}", r.body));
        assert!(
            blocks[..first_text].iter().filter(|b| alive(b)).count() >= 4,
            "{path}: the keep-alives came late: {:?}",
            r.body
        );
        // The events besides the keep-alives are the stream as it always was.
        for b in blocks.iter().filter(|b| !alive(b)) {
            for line in b.lines() {
                assert!(
                    line.starts_with("data: ") || line.starts_with("event: "),
                    "{path}: {line:?}"
                );
            }
        }
    }
}
