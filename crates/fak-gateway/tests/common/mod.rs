//! A gateway on a real loopback socket, and a small blocking HTTP/1.1 client (so the
//! tests control the socket: they can read part of a stream and hang up).

#![allow(dead_code)]

use fak_engine::EngineDriver;
use fak_gateway::{router, serve, GatewayConfig};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// The id SmolLM2-135M-Instruct is served under in the real-model tests.
pub const SMOLLM2_ID: &str = "smollm2-135m-instruct";

/// A gateway over the in-kernel engine serving SmolLM2-135M-Instruct as
/// [`SMOLLM2_ID`]: the file at `FAK_SMOLLM2_GGUF`, else the cached one (missing, this
/// panics with the command that fetches it), its weights kept as `mode`, with `cfg`'s
/// settings but no KV reuse cache (`kv_budget_bytes` 0: each request prefills anew).
pub fn smollm2_server(mode: fak_model::WeightMode, cfg: fak_engine::EngineConfig) -> Server {
    let path = match std::env::var_os("FAK_SMOLLM2_GGUF") {
        Some(p) => std::path::PathBuf::from(p),
        None => fak_catalog::require_cached(SMOLLM2_ID).unwrap_or_else(|m| panic!("{m}")),
    };
    let m = Arc::new(fak_model::Model::load_with(&path, mode).unwrap());
    let (tok, tmpl) = fak_model::load_text(&path, m.config()).unwrap();
    let cfg = fak_engine::EngineConfig {
        kv_budget_bytes: 0,
        ..cfg
    };
    let d = fak_engine::inkernel::InKernelDriver::from_loaded(m, tok, tmpl, SMOLLM2_ID, cfg);
    start(Arc::new(d), GatewayConfig::default())
}

/// A running server; dropping it shuts it down.
pub struct Server {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn start(driver: Arc<dyn EngineDriver>, config: GatewayConfig) -> Server {
    start_router(router(driver, config))
}

pub fn start_with_policy(
    driver: Arc<dyn EngineDriver>,
    config: GatewayConfig,
    policy: fak_engine::policy::Policy,
) -> Server {
    start_router(fak_gateway::router_with_policy(driver, config, policy))
}

pub fn start_router(app: axum::Router) -> Server {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            serve(l, app, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
    });
    Server {
        addr,
        stop: Some(tx),
        thread: Some(thread),
    }
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    /// SSE events as (event name or "", data).
    pub fn sse(&self) -> Vec<(String, String)> {
        self.body
            .split("\n\n")
            .filter(|b| !b.trim().is_empty())
            .map(|block| {
                let mut name = String::new();
                let mut data = Vec::new();
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        name = v.trim().to_string();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
                    }
                }
                (name, data.join("\n"))
            })
            .collect()
    }
}

fn raw_request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    // The server may answer (413) and close before the whole body is sent.
    let _ = s.write_all(&raw_request(method, path, headers, body));
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    parse(&buf)
}

fn parse(buf: &[u8]) -> Resp {
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(buf)));
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = buf[end + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Resp {
        status,
        headers,
        body: String::from_utf8(body).unwrap(),
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size_str = String::from_utf8_lossy(&b[..nl]);
        let size = usize::from_str_radix(size_str.split(';').next().unwrap().trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + size]);
        b = &b[nl + 2 + size + 2..];
    }
    out
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    request(addr, "POST", path, &[], body.to_string().as_bytes())
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], b"")
}

/// Sends a request and returns the open socket after reading at least `min_bytes` of
/// the response, for hang-up tests.
pub fn open_stream(addr: SocketAddr, path: &str, body: &Value, min_bytes: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(&raw_request("POST", path, &[], body.to_string().as_bytes()))
        .unwrap();
    let mut got = 0;
    let mut buf = [0u8; 4096];
    while got < min_bytes {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the server closed the stream early");
        got += n;
    }
    s
}

/// A server on its own runtime that can be killed outright (connections cut, no
/// graceful wait), as a crashed serving engine would be.
pub struct Killable {
    pub addr: SocketAddr,
    rt: Option<tokio::runtime::Runtime>,
}

impl Killable {
    pub fn start(app: axum::Router, at: Option<SocketAddr>) -> Self {
        let l = std::net::TcpListener::bind(at.unwrap_or_else(|| "127.0.0.1:0".parse().unwrap()))
            .unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.spawn(async move {
            let l = tokio::net::TcpListener::from_std(l).unwrap();
            let _ = fak_gateway::serve(l, app, std::future::pending()).await;
        });
        Killable { addr, rt: Some(rt) }
    }

    pub fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Killable {
    fn drop(&mut self) {
        self.kill();
    }
}
