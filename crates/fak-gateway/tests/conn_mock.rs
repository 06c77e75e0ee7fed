//! Connections of [`fak_gateway::serve_with`] over the mock engine, with hostile
//! clients on a loopback socket: a half-sent request line or trickled headers are cut
//! after the header timeout; 300 trickling connections do not slow other clients; a
//! request body that stops arriving gets 400 after the idle timeout; a client that stops
//! reading a stream is cut after the idle timeout; connections over the cap wait until
//! one closes; at shutdown the listener closes, a short stream still finishes, and at
//! the end of the grace a waiting request gets 503 and each running stream a final error
//! event in its wire's shape.

use fak_engine::mock::MockDriver;
use fak_engine::EngineDriver;
use fak_gateway::{router, serve_with, GatewayConfig};
use serde_json::{json, Value};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A server on its own thread; `stop` starts its shutdown, `join` waits for `serve_with`
/// to return.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(driver: Arc<dyn EngineDriver>, config: GatewayConfig) -> Server {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let app = router(driver, config.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(listener).unwrap();
                serve_with(l, app, &config, async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
            });
            rt.shutdown_timeout(Duration::from_millis(100));
        });
        Server {
            addr,
            stop: Some(tx),
            thread: Some(thread),
        }
    }

    fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    fn join(&mut self) {
        self.stop();
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
        // A failed test must not wait for the grace.
        self.thread.take();
    }
}

fn config() -> GatewayConfig {
    GatewayConfig {
        header_timeout: Some(Duration::from_millis(500)),
        idle_timeout: Some(Duration::from_millis(300)),
        shutdown_grace: Duration::from_secs(1),
        ..GatewayConfig::default()
    }
}

fn slow_mock() -> Arc<MockDriver> {
    Arc::new(MockDriver::new().with_delay(Duration::from_millis(10)))
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn request_bytes(path: &str, body: &str) -> Vec<u8> {
    let method = if body.is_empty() { "GET" } else { "POST" };
    format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Everything the server sends until it closes (or the read times out, which fails).
fn read_all(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)
        .unwrap_or_else(|e| panic!("the server did not close the connection: {e}"));
    String::from_utf8_lossy(&buf).into_owned()
}

/// Waits for the server to close `s` (EOF or reset); returns how long that took, or
/// panics when it stays open for `limit`.
fn closed_within(s: &mut TcpStream, limit: Duration) -> Duration {
    let t = Instant::now();
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return t.elapsed(),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return t.elapsed(),
            Err(e) => panic!("still open after {:?} ({e})", t.elapsed()),
        }
    }
}

/// One whole request; (status line, body).
fn call(addr: SocketAddr, path: &str, body: &str) -> (String, String) {
    let mut s = connect(addr);
    s.write_all(&request_bytes(path, body)).unwrap();
    let all = read_all(&mut s);
    let (head, body) = all.split_once("\r\n\r\n").expect("a response head");
    (head.lines().next().unwrap().to_string(), body.to_string())
}

fn count(n: usize, stream: bool) -> String {
    json!({"model": "mock", "max_tokens": n + 10, "stream": stream,
           "messages": [{"role": "user", "content": format!("count {n}")}]})
    .to_string()
}

/// SSE events (event name or "", data) of a chunked body, in order. Each chunk holds
/// whole events here, so the chunk-size lines are simply skipped.
fn sse(body: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut name = String::new();
    for line in body.lines() {
        if let Some(v) = line.strip_prefix("event:") {
            name = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("data:") {
            out.push((std::mem::take(&mut name), v.trim().to_string()));
        }
    }
    out
}

#[test]
fn a_half_sent_request_line_is_cut_after_the_header_timeout() {
    let srv = Server::start(slow_mock(), config());
    let mut s = connect(srv.addr);
    s.write_all(b"GET /hea").unwrap();
    let took = closed_within(&mut s, Duration::from_secs(5));
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(2),
        "cut after {took:?} (header timeout 500 ms)"
    );
}

#[test]
fn trickled_headers_are_cut_after_the_header_timeout() {
    let srv = Server::start(slow_mock(), config());
    let mut s = connect(srv.addr);
    let t = Instant::now();
    let head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut cut = false;
    // One byte per 50 ms: the head would take 3.5 s.
    for b in head {
        if s.write_all(&[*b]).is_err() {
            cut = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        if t.elapsed() > Duration::from_secs(1) {
            break;
        }
    }
    if !cut {
        closed_within(&mut s, Duration::from_secs(2));
    }
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

#[test]
fn three_hundred_trickling_connections_do_not_stop_other_clients() {
    let d = slow_mock();
    let srv = Server::start(
        Arc::clone(&d) as Arc<dyn EngineDriver>,
        GatewayConfig {
            header_timeout: Some(Duration::from_secs(2)),
            ..config()
        },
    );
    let t0 = Instant::now();
    let mut tricklers: Vec<TcpStream> = (0..300)
        .map(|_| {
            let mut s = connect(srv.addr);
            s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHo")
                .unwrap();
            s
        })
        .collect();
    // While they hang: /health in under 50 ms, and a generation answered.
    for _ in 0..20 {
        let t = Instant::now();
        let (status, body) = call(srv.addr, "/health", "");
        let ms = t.elapsed().as_secs_f64() * 1e3;
        assert!(status.contains(" 200 "), "{status} {body}");
        assert!(
            ms < 50.0,
            "/health took {ms:.1} ms beside 300 trickling connections"
        );
    }
    let (status, body) = call(srv.addr, "/v1/chat/completions", &count(5, false));
    assert!(status.contains(" 200 "), "{status} {body}");
    assert!(body.contains("1 2 3 4 5"), "{body}");
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "the checks took {:?}, past the point where the tricklers are cut",
        t0.elapsed()
    );
    // And then each trickler is cut by the header timeout.
    for s in &mut tricklers {
        closed_within(s, Duration::from_secs(4));
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn a_request_body_that_stops_arriving_gets_400_after_the_idle_timeout() {
    let srv = Server::start(slow_mock(), config());
    let mut s = connect(srv.addr);
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":",
    )
    .unwrap();
    let t = Instant::now();
    let all = read_all(&mut s);
    let took = t.elapsed();
    assert!(all.starts_with("HTTP/1.1 400 "), "{all}");
    assert!(all.contains("idle timeout"), "{all}");
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(2),
        "answered after {took:?} (idle timeout 300 ms)"
    );
}

#[test]
fn a_client_that_stops_reading_is_cut_after_the_idle_timeout() {
    // 1000 words of 16 KiB each: 16 MiB of stream, more than the socket buffers hold.
    let d = Arc::new(MockDriver::new());
    let srv = Server::start(
        Arc::clone(&d) as Arc<dyn EngineDriver>,
        GatewayConfig {
            max_body_bytes: 64 << 20,
            ..config()
        },
    );
    let word = "w".repeat(16 << 10);
    let text = vec![word.as_str(); 1000].join(" ");
    let body = json!({"model": "mock", "max_tokens": 1000, "stream": true,
        "messages": [{"role": "user", "content": format!("echo {text}")}]})
    .to_string();
    let mut s = connect(srv.addr);
    s.write_all(&request_bytes("/v1/chat/completions", &body))
        .unwrap();
    // Not reading: the server's writes stall, and after 300 ms it gives up.
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    while d.stats().active > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the generation still runs for a client that reads nothing"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let got = String::from_utf8_lossy(&got);
    assert!(
        got.starts_with("HTTP/1.1 200 "),
        "{}",
        &got[..got.len().min(200)]
    );
    assert!(
        !got.contains("[DONE]"),
        "the whole stream ({} bytes) was delivered to a client that stopped reading",
        got.len()
    );
}

#[test]
fn a_slow_reader_that_keeps_reading_is_not_cut() {
    // 40 words at 10 ms each (0.4 s); the client reads 64 bytes every 20 ms, so the
    // server's writes wait often, each time less than the idle timeout.
    let srv = Server::start(
        slow_mock(),
        GatewayConfig {
            idle_timeout: Some(Duration::from_millis(300)),
            ..config()
        },
    );
    let mut s = connect(srv.addr);
    s.write_all(&request_bytes("/v1/chat/completions", &count(40, true)))
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf).unwrap() {
            0 => break,
            n => got.extend_from_slice(&buf[..n]),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let got = String::from_utf8_lossy(&got);
    assert!(got.contains("data: [DONE]"), "{got}");
    assert!(got.contains("\"finish_reason\":\"stop\""), "{got}");
}

#[test]
fn connections_over_the_cap_wait_until_one_closes() {
    let srv = Server::start(
        slow_mock(),
        GatewayConfig {
            max_connections: 4,
            header_timeout: Some(Duration::from_millis(800)),
            ..config()
        },
    );
    let t0 = Instant::now();
    let hogs: Vec<TcpStream> = (0..4).map(|_| connect(srv.addr)).collect();
    std::thread::sleep(Duration::from_millis(100));
    // The fifth connects (the kernel's backlog) but is not served while 4 are open...
    let mut fifth = connect(srv.addr);
    fifth.write_all(&request_bytes("/health", "")).unwrap();
    fifth
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut buf = [0u8; 16];
    let e = fifth.read(&mut buf).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{e}"
    );
    // ... and is once the header timeout has cut the idle ones.
    fifth
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let all = read_all(&mut fifth);
    assert!(all.starts_with("HTTP/1.1 200 "), "{all}");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_secs(3),
        "{took:?}"
    );
    drop(hogs);
}

#[test]
fn shutdown_ends_streams_with_an_error_event_and_answers_waiting_requests() {
    let d = slow_mock();
    let mut srv = Server::start(Arc::clone(&d) as Arc<dyn EngineDriver>, config());
    let addr = srv.addr;
    // Two streams of 1000 words (10 s) and a whole answer of 1000 words, all running
    // when the shutdown starts, and a short stream (0.3 s) that can finish in the grace.
    let mut openai = connect(addr);
    openai
        .write_all(&request_bytes("/v1/chat/completions", &count(1000, true)))
        .unwrap();
    let mut anthropic = connect(addr);
    anthropic
        .write_all(&request_bytes("/v1/messages", &count(1000, true)))
        .unwrap();
    let whole = std::thread::spawn(move || call(addr, "/v1/chat/completions", &count(1000, false)));
    let mut short = connect(addr);
    short
        .write_all(&request_bytes("/v1/chat/completions", &count(30, true)))
        .unwrap();
    let mut b = [0u8; 1];
    for s in [&mut openai, &mut anthropic, &mut short] {
        s.read_exact(&mut b).unwrap();
    }
    while d.stats().active < 4 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let t0 = Instant::now();
    srv.stop();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err(),
        "a new connection was accepted during the shutdown"
    );

    let short = read_all(&mut short);
    assert!(short.contains("data: [DONE]"), "{short}");
    assert!(!short.contains("error"), "{short}");
    assert!(short.contains("\"finish_reason\":\"stop\""), "{short}");

    let o = read_all(&mut openai);
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(2500),
        "the stream ended {took:?} after the shutdown began (grace 1 s)"
    );
    let ev = sse(&o);
    let n = ev.len();
    assert!(n >= 3, "{o}");
    assert_eq!(ev[n - 1].1, "[DONE]", "{o}");
    let err: Value = serde_json::from_str(&ev[n - 2].1).unwrap();
    assert_eq!(err["error"]["type"], "overloaded_error", "{o}");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("shutting down"));
    assert!(ev[..n - 2].iter().all(|(_, d)| !d.contains("error")), "{o}");

    let a = read_all(&mut anthropic);
    let ev = sse(&a);
    let (name, data) = ev.last().unwrap();
    assert_eq!(name, "error", "{a}");
    let err: Value = serde_json::from_str(data).unwrap();
    assert_eq!(err["type"], "error");
    assert_eq!(err["error"]["type"], "overloaded_error", "{a}");
    assert!(ev.iter().any(|(n, _)| n == "content_block_delta"), "{a}");

    let (status, body) = whole.join().unwrap();
    assert!(status.contains(" 503 "), "{status} {body}");
    let err: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["type"], "overloaded_error", "{body}");

    srv.join();
    assert!(
        t0.elapsed() < Duration::from_millis(3500),
        "serve_with returned {:?} after the shutdown began",
        t0.elapsed()
    );
    // Every generation was cancelled.
    let t = Instant::now();
    while d.stats().active > 0 {
        assert!(t.elapsed() < Duration::from_secs(1), "a generation ran on");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn shutdown_with_nothing_in_flight_returns_at_once() {
    let mut srv = Server::start(slow_mock(), config());
    // An idle keep-alive connection does not hold the shutdown.
    let mut idle = connect(srv.addr);
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut b = [0u8; 12];
    idle.read_exact(&mut b).unwrap();
    let t = Instant::now();
    srv.join();
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
}
