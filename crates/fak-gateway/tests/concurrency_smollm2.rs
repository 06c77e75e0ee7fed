//! The gateway under concurrent load on the real SmolLM2-135M-Instruct, on a loopback
//! socket: 8 clients at once, 20 requests each (streamed and whole, OpenAI and
//! Anthropic wires) on two worker slots, every answer equal to its single-client
//! greedy answer, no error status, and `/health` answering in under 50 ms meanwhile;
//! then clients that hang up mid-stream leave the server serving, with no generation
//! left running. Without the model file this fails with the fetch command
//! (`FAK_SKIP_REAL_MODEL=1` reports them as ignored, never in CI).

mod common;

use common::{get, post, start, Resp, Server};
use fak_engine::inkernel::InKernelDriver;
use fak_engine::{EngineConfig, EngineDriver};
use fak_gateway::GatewayConfig;
use fak_model::{load_text, Model};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const ID: &str = "smollm2-135m-instruct";
const CLIENTS: usize = 8;
const REQUESTS: usize = 20;
const MAX_TOKENS: usize = 6;
const HEALTH_BOUND: Duration = Duration::from_millis(50);

/// The tests of this file measure latency under load: they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    fak_catalog::require_cached(ID).unwrap_or_else(|m| panic!("{m}"))
}

fn model() -> (PathBuf, Arc<Model>) {
    static M: OnceLock<(PathBuf, Arc<Model>)> = OnceLock::new();
    M.get_or_init(|| {
        let path = smollm2_path();
        let m = Arc::new(Model::load(&path).unwrap());
        (path, m)
    })
    .clone()
}

/// A server on two worker slots whose queue holds every client, with KV reuse; and
/// its driver, for the engine's figures.
fn server() -> (Server, Arc<InKernelDriver>) {
    let (path, m) = model();
    let (tok, tmpl) = load_text(&path, m.config()).unwrap();
    let cfg = EngineConfig {
        parallel: 2,
        max_queue: 4 * CLIENTS,
        kv_budget_bytes: 64 << 20,
        ..EngineConfig::default()
    };
    let d = Arc::new(InKernelDriver::from_loaded(m, tok, tmpl, ID, cfg));
    let srv = start(
        Arc::clone(&d) as Arc<dyn EngineDriver>,
        GatewayConfig::default(),
    );
    (srv, d)
}

/// One way of asking: which route, and whether to stream.
#[derive(Clone, Copy, Debug)]
enum Wire {
    OpenAi { stream: bool },
    Anthropic { stream: bool },
}

const WIRES: [Wire; 4] = [
    Wire::OpenAi { stream: false },
    Wire::OpenAi { stream: true },
    Wire::Anthropic { stream: false },
    Wire::Anthropic { stream: true },
];

/// Client `c`'s question: short and distinct per client.
fn question(c: usize) -> String {
    const TOPICS: [&str; CLIENTS] = [
        "the sea",
        "a red apple",
        "winter",
        "the moon",
        "a small dog",
        "bread",
        "rain",
        "a mountain",
    ];
    format!("Write one short sentence about {}.", TOPICS[c])
}

/// Sends `question` on `wire` (greedy, `max_tokens` new tokens at most) and returns the
/// answer's text; panics on any status but 200.
fn ask(addr: SocketAddr, wire: Wire, question: &str, max_tokens: usize) -> String {
    let messages = json!([{"role": "user", "content": question}]);
    let (path, stream) = match wire {
        Wire::OpenAi { stream } => ("/v1/chat/completions", stream),
        Wire::Anthropic { stream } => ("/v1/messages", stream),
    };
    let body = json!({"model": ID, "temperature": 0, "max_tokens": max_tokens,
                      "stream": stream, "messages": messages});
    let r = post(addr, path, &body);
    assert_eq!(r.status, 200, "{wire:?}: {}", r.body);
    text_of(&r, wire)
}

fn text_of(r: &Resp, wire: Wire) -> String {
    match wire {
        Wire::OpenAi { stream: false } => r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
        Wire::Anthropic { stream: false } => {
            r.json()["content"][0]["text"].as_str().unwrap().to_string()
        }
        Wire::OpenAi { stream: true } => {
            let ev = r.sse();
            assert_eq!(
                ev.last().map(|e| e.1.as_str()),
                Some("[DONE]"),
                "{}",
                r.body
            );
            ev.iter()
                .filter(|(_, d)| d != "[DONE]")
                .filter_map(|(_, d)| {
                    serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"]
                        .as_str()
                        .map(str::to_string)
                })
                .collect()
        }
        Wire::Anthropic { stream: true } => {
            let ev = r.sse();
            assert_eq!(
                ev.last().map(|e| e.0.as_str()),
                Some("message_stop"),
                "{}",
                r.body
            );
            assert!(ev.iter().all(|(name, _)| name != "error"), "{}", r.body);
            ev.iter()
                .filter(|(name, _)| name == "content_block_delta")
                .map(|(_, d)| {
                    serde_json::from_str::<Value>(d).unwrap()["delta"]["text"]
                        .as_str()
                        .unwrap()
                        .to_string()
                })
                .collect()
        }
    }
}

/// Polls `/health` every ~50 ms until `stop`, returning each answer's latency; panics
/// on any status but 200.
fn poll_health(addr: SocketAddr, stop: &AtomicBool) -> Vec<Duration> {
    let mut lat = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let t = Instant::now();
        let r = get(addr, "/health");
        lat.push(t.elapsed());
        assert_eq!(r.status, 200, "{}", r.body);
        std::thread::sleep(Duration::from_millis(50));
    }
    lat
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[fak_testkit::real_model]
fn eight_clients_twenty_requests_each_get_their_single_client_answers() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (srv, driver) = server();
    let addr = srv.addr;
    // Single-client references, one client at a time, one per wire. Both wires render
    // the same prompt: their answers must agree.
    let t = Instant::now();
    let reference: Vec<String> = (0..CLIENTS)
        .map(|c| {
            let texts: Vec<String> = WIRES
                .iter()
                .map(|&w| ask(addr, w, &question(c), MAX_TOKENS))
                .collect();
            assert!(!texts[0].is_empty(), "client {c}: empty answer");
            assert!(
                texts.iter().all(|x| *x == texts[0]),
                "client {c}: the wires disagree: {texts:?}"
            );
            texts[0].clone()
        })
        .collect();
    let distinct: std::collections::HashSet<_> = reference.iter().collect();
    assert!(
        distinct.len() > 1,
        "every client got the same answer: {reference:?}"
    );
    eprintln!(
        "references: {} requests in {:.1} s",
        CLIENTS * WIRES.len(),
        t.elapsed().as_secs_f64()
    );

    let stop = Arc::new(AtomicBool::new(false));
    let health = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || poll_health(addr, &stop))
    };
    let t = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let want = reference[c].clone();
            std::thread::spawn(move || {
                for i in 0..REQUESTS {
                    let wire = WIRES[(c + i) % WIRES.len()];
                    let got = ask(addr, wire, &question(c), MAX_TOKENS);
                    assert_eq!(got, want, "client {c} request {i} ({wire:?})");
                }
            })
        })
        .collect();
    let failed: Vec<usize> = clients
        .into_iter()
        .enumerate()
        .filter_map(|(c, h)| h.join().is_err().then_some(c))
        .collect();
    let wall = t.elapsed();
    stop.store(true, Ordering::SeqCst);
    let mut lat = health.join().expect("the /health poller failed");
    assert!(failed.is_empty(), "clients {failed:?} failed (see above)");

    assert!(lat.len() >= 5, "only {} /health polls", lat.len());
    lat.sort();
    let (median, max) = (lat[lat.len() / 2], lat[lat.len() - 1]);
    let stats = driver.stats();
    eprintln!(
        "{} requests from {CLIENTS} clients in {:.1} s ({:.1} requests/s); /health: {} polls, median {:.2} ms, max {:.2} ms; kv cache: {} entries, {:.1} MB",
        CLIENTS * REQUESTS,
        wall.as_secs_f64(),
        (CLIENTS * REQUESTS) as f64 / wall.as_secs_f64(),
        lat.len(),
        ms(median),
        ms(max),
        stats.kv_entries,
        stats.kv_bytes as f64 / 1e6,
    );
    // Every request was counted with status 200, nothing else.
    let m = get(addr, "/metrics").body;
    let statuses: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("fak_requests_total{") && !l.contains("/health"))
        .collect();
    assert!(
        statuses.iter().all(|l| l.contains("status=\"200\"")),
        "{statuses:?}"
    );
    // The inter-token latency histogram holds every gap between two tokens: each
    // generation's completion tokens but its first.
    let value = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{m}"))
    };
    let generations = (CLIENTS * WIRES.len() + CLIENTS * REQUESTS) as f64;
    assert_eq!(
        value("fak_inter_token_latency_seconds_count"),
        value("fak_completion_tokens_total") - generations
    );
    // The batch size histogram counts every batched pass, each of at most the two slots,
    // some of both.
    let passes = value("fak_batch_passes_total");
    assert!(passes > 0.0);
    assert_eq!(value("fak_batch_size_count"), passes);
    assert_eq!(value("fak_batch_size_bucket{le=\"+Inf\"}"), passes);
    assert_eq!(value("fak_batch_size_bucket{le=\"2\"}"), passes);
    assert!(value("fak_batch_size_bucket{le=\"1\"}") < passes, "{m}");
    assert_eq!(
        value("fak_batch_size_sum"),
        value("fak_batch_sequences_total")
    );
    assert!(
        max < HEALTH_BOUND,
        "/health took {:.2} ms at worst (median {:.2} ms) under load",
        ms(max),
        ms(median)
    );
}

/// A question the model answers at length (digits are one token each here).
const LONG: &str = "Count from 1 to 1000, separated by commas.";

/// Sends a request and returns the open socket once the response holds `count`
/// occurrences of `marker` (so that generation has produced text), for hang-up tests.
fn open_until(addr: SocketAddr, path: &str, body: &Value, marker: &str, count: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&got).matches(marker).count() < count {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the server closed the stream early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    s
}

#[fak_testkit::real_model]
fn clients_hanging_up_mid_stream_leave_the_server_serving() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (srv, driver) = server();
    let addr = srv.addr;
    let q = question(0);
    let want = ask(addr, Wire::OpenAi { stream: false }, &q, MAX_TOKENS);
    // The control: LONG does not end by itself within 120 tokens, so a stream of it
    // left running would keep its slot busy for seconds after its client left.
    let body = json!({"model": ID, "temperature": 0, "max_tokens": 120,
                      "messages": [{"role": "user", "content": LONG}]});
    let r = post(addr, "/v1/chat/completions", &body);
    assert_eq!(
        r.json()["choices"][0]["finish_reason"],
        "length",
        "{}",
        r.body
    );

    // Long streams on both wires, more than there are slots (some wait in the queue);
    // each client hangs up once its first text has arrived.
    let hangups: Vec<_> = (0..6)
        .map(|i| {
            std::thread::spawn(move || {
                let messages = json!([{"role": "user", "content": LONG}]);
                let body = json!({"model": ID, "temperature": 0, "stream": true,
                                  "max_tokens": 400, "messages": messages});
                let s = if i % 2 == 0 {
                    // The role chunk, then a text chunk.
                    open_until(addr, "/v1/chat/completions", &body, "\"delta\":", 2)
                } else {
                    open_until(addr, "/v1/messages", &body, "text_delta", 1)
                };
                drop(s);
            })
        })
        .collect();
    for h in hangups {
        h.join().unwrap();
    }
    // Within a few tokens no generation is left running or waiting.
    let t = Instant::now();
    let deadline = Duration::from_secs(2);
    loop {
        let s = driver.stats();
        let m = get(addr, "/metrics").body;
        let gauge = |name: &str| {
            m.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<u64>().ok())
        };
        let idle = s.active == 0
            && s.queue_depth == 0
            && gauge("fak_active_generations") == Some(0)
            && gauge("fak_queue_depth") == Some(0);
        if idle {
            break;
        }
        assert!(
            t.elapsed() < deadline,
            "still busy {deadline:?} after the clients left: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "6 streams dropped after their first text; engine idle {:.0} ms after the last",
        ms(t.elapsed())
    );
    // And it still answers, correctly, on both wires.
    assert_eq!(
        ask(addr, Wire::OpenAi { stream: false }, &q, MAX_TOKENS),
        want
    );
    assert_eq!(
        ask(addr, Wire::Anthropic { stream: true }, &q, MAX_TOKENS),
        want
    );
    assert_eq!(get(addr, "/health").status, 200);
}
