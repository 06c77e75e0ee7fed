//! What fak adds in front of an upstream: the latency of each request, and of each
//! streamed token, sent directly to an OpenAI-compatible server and through a fak
//! gateway in `openai-upstream` mode in front of it.
//!
//! By default the upstream is a fak gateway over the mock engine on loopback, in this
//! process, which answers at once and always alike (`echo w1 w2 ... wN`: N words, one
//! streamed chunk each), so what is measured is fak's own work: parsing the client's
//! request, the boundary, the driver's request to the upstream, reading its server-sent
//! events and writing them out again. `--delay-us` paces the mock (a wait before each
//! word), so that each token crosses fak on its own, as a model's would; without it the
//! whole reply is ready at once and what streams is fak's throughput. `--upstream-url`
//! points the same measurement at
//! a running server instead (llama.cpp's, vLLM, another fak), where the model's time
//! dominates and the differences are within its noise.
//!
//! A client (hyper, one keep-alive connection to each server) sends `--requests` chat
//! requests to each path and mode, in pairs (direct then through fak, and the other way
//! round every other pair): non-streaming
//! (time to the whole body), then streaming (time to the first content chunk, TTFT; to
//! the last; and the time per token after the first, (last - first) / (chunks - 1)).
//! Twenty of each are sent first as a warm-up and not counted. Printed: the median and
//! p99 of each distribution, what fak adds (through fak minus direct, for the medians
//! and for the p99s), and the median and p99 of the paired differences (each request
//! through fak minus the direct one of its pair). The answers through fak are
//! checked equal to the direct ones (after the warm-up).
//!
//! ```text
//! cargo run --release -p fak-gateway --example upstream_overhead -- \
//!     [--requests 500] [--words 32] [--delay-us 0] [--format text|json]
//!     [--upstream-url http://HOST:PORT [--model NAME] [--prompt TEXT] [--max-tokens 32]]
//! ```

use fak_engine::mock::MockDriver;
use fak_engine::{EngineDriver, Readiness};
use fak_gateway::{router, GatewayConfig};
use fak_upstream::{UpstreamConfig, UpstreamDriver};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{header, Request};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

const WARMUP: usize = 20;

struct Args {
    requests: usize,
    words: usize,
    delay_us: u64,
    json: bool,
    upstream_url: Option<String>,
    model: Option<String>,
    prompt: Option<String>,
    max_tokens: usize,
}

fn usage() -> ! {
    eprintln!(
        "usage: upstream_overhead [--requests 500] [--words 32] [--delay-us 0] [--format text|json]\n\
         \x20      [--upstream-url http://HOST:PORT [--model NAME] [--prompt TEXT] [--max-tokens 32]]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        requests: 500,
        words: 32,
        delay_us: 0,
        json: false,
        upstream_url: None,
        model: None,
        prompt: None,
        max_tokens: 32,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| usage());
        let num = |s: String| s.parse::<usize>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--requests" => a.requests = num(value()).max(1),
            "--words" => a.words = num(value()).max(2),
            "--delay-us" => a.delay_us = num(value()) as u64,
            "--max-tokens" => a.max_tokens = num(value()).max(2),
            "--format" => {
                a.json = match value().as_str() {
                    "json" => true,
                    "text" => false,
                    _ => usage(),
                }
            }
            "--upstream-url" => a.upstream_url = Some(value()),
            "--model" => a.model = Some(value()),
            "--prompt" => a.prompt = Some(value()),
            "-h" | "--help" => usage(),
            _ => usage(),
        }
    }
    a
}

/// Serves `app` on a loopback port on its own runtime (as `fak serve` builds it: one
/// worker per core), for the life of the process.
fn spawn_server(app: axum::Router) -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.set_nonblocking(true).expect("a non-blocking listener");
    let addr = l.local_addr().expect("the listener's address");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(l).expect("a tokio listener");
            fak_gateway::serve(l, app, std::future::pending())
                .await
                .expect("serving");
        });
    });
    addr
}

/// A keep-alive HTTP/1.1 connection to one server.
struct Conn {
    host: String,
    sender: SendRequest<Full<Bytes>>,
}

impl Conn {
    async fn open(addr: &str) -> Conn {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| fail(&format!("cannot connect to {addr}: {e}")));
        stream.set_nodelay(true).expect("TCP_NODELAY");
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .unwrap_or_else(|e| fail(&format!("HTTP handshake with {addr}: {e}")));
        tokio::spawn(conn);
        Conn {
            host: addr.to_string(),
            sender,
        }
    }

    /// Sends `req` and reads the reply: its text, and the times (from sending) of the
    /// whole body and of each non-empty content chunk.
    async fn send(&mut self, method: &str, path: &str, body: &Value) -> Timed {
        self.sender
            .ready()
            .await
            .unwrap_or_else(|e| fail(&format!("connection to {}: {e}", self.host)));
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, &self.host)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("a request");
        let t0 = Instant::now();
        let resp = self
            .sender
            .send_request(req)
            .await
            .unwrap_or_else(|e| fail(&format!("request to {}: {e}", self.host)));
        let status = resp.status();
        let sse = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let mut body = resp.into_body();
        let mut raw = Vec::new();
        let mut chunks = Vec::new();
        let mut text = String::new();
        let mut scanned = 0;
        while let Some(f) = body.frame().await {
            let f = f.unwrap_or_else(|e| fail(&format!("reading from {}: {e}", self.host)));
            let Ok(d) = f.into_data() else { continue };
            raw.extend_from_slice(&d);
            if !sse {
                continue;
            }
            // Whole events (a blank line ends one) seen so far.
            while let Some(end) = find(&raw[scanned..], b"\n\n") {
                let ev = &raw[scanned..scanned + end];
                scanned += end + 2;
                let piece = std::str::from_utf8(ev)
                    .ok()
                    .and_then(|e| e.strip_prefix("data: "))
                    .and_then(|d| serde_json::from_str::<Value>(d).ok())
                    .and_then(|v| {
                        v.pointer("/choices/0/delta/content")
                            .and_then(Value::as_str)
                            .map(str::to_string)
                    })
                    .filter(|p| !p.is_empty());
                if let Some(p) = piece {
                    chunks.push(t0.elapsed());
                    text.push_str(&p);
                }
            }
        }
        let total = t0.elapsed();
        if !status.is_success() {
            fail(&format!(
                "{} answered {status}: {}",
                self.host,
                String::from_utf8_lossy(&raw)
            ));
        }
        if !sse {
            let v: Value = serde_json::from_slice(&raw)
                .unwrap_or_else(|e| fail(&format!("{} answered no JSON: {e}", self.host)));
            text = v
                .pointer("/choices/0/message/content")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
        }
        Timed {
            text,
            total,
            chunks,
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn fail(msg: &str) -> ! {
    eprintln!("upstream_overhead: {msg}");
    std::process::exit(1)
}

struct Timed {
    text: String,
    total: Duration,
    /// When each non-empty content chunk arrived (streams only).
    chunks: Vec<Duration>,
}

/// Nearest-rank percentile of `v` (sorted here), in ms.
fn pct(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// One measured quantity, direct and through fak, in ms, paired by request.
#[derive(Default)]
struct Pair {
    direct: Vec<f64>,
    via: Vec<f64>,
}

impl Pair {
    fn push(&mut self, direct: f64, via: f64) {
        self.direct.push(direct);
        self.via.push(via);
    }

    fn diffs(&self) -> Vec<f64> {
        self.via
            .iter()
            .zip(&self.direct)
            .map(|(v, d)| v - d)
            .collect()
    }

    fn summary(&self) -> Value {
        let (d50, d99) = (pct(&self.direct, 0.5), pct(&self.direct, 0.99));
        let (v50, v99) = (pct(&self.via, 0.5), pct(&self.via, 0.99));
        let diffs = self.diffs();
        // Microseconds are the resolution that means anything here.
        let us = |x: f64| (x * 1e3).round() / 1e3;
        json!({
            "direct": {"median_ms": us(d50), "p99_ms": us(d99)},
            "through_fak": {"median_ms": us(v50), "p99_ms": us(v99)},
            "added": {"median_ms": us(v50 - d50), "p99_ms": us(v99 - d99)},
            "paired_difference": {"median_ms": us(pct(&diffs, 0.5)), "p99_ms": us(pct(&diffs, 0.99))},
        })
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[derive(Default)]
struct Results {
    whole: Pair,
    ttft: Pair,
    last: Pair,
    per_token: Pair,
    chunks: usize,
}

/// One request on each path, in the order `swap` says: (direct, through fak).
async fn pair(direct: &mut Conn, via: &mut Conn, body: &Value, swap: bool) -> (Timed, Timed) {
    const PATH: &str = "/v1/chat/completions";
    if swap {
        let v = via.send("POST", PATH, body).await;
        (direct.send("POST", PATH, body).await, v)
    } else {
        let d = direct.send("POST", PATH, body).await;
        (d, via.send("POST", PATH, body).await)
    }
}

async fn measure(
    direct: &mut Conn,
    via: &mut Conn,
    body: &Value,
    n: usize,
    out: &mut Results,
) -> String {
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let mut text = String::new();
    for i in 0..WARMUP + n {
        let count = i >= WARMUP;
        // Non-streaming, then streaming; direct first on even rounds, through fak first
        // on odd ones, so that neither path always follows the other.
        let swap = i % 2 == 1;
        let (d, v) = pair(direct, via, body, swap).await;
        // Not during the warm-up: a real upstream's first answer may differ (llama.cpp's
        // depends on how much of the prompt its cache holds).
        if count && v.text != d.text {
            fail(&format!(
                "the answer through fak differs:\n  direct: {:?}\n  via:    {:?}",
                d.text, v.text
            ));
        }
        if count {
            out.whole.push(ms(d.total), ms(v.total));
        }
        let (d, v) = pair(direct, via, &stream_body, swap).await;
        if d.chunks.len() < 2
            || v.chunks.len() < 2
            || (count && (v.text != d.text || v.chunks.len() != d.chunks.len()))
        {
            fail(&format!(
                "the streamed answer through fak differs (or has under 2 chunks):\n  \
                 direct: {:?} ({} chunks)\n  via:    {:?} ({} chunks)",
                d.text,
                d.chunks.len(),
                v.text,
                v.chunks.len()
            ));
        }
        if count {
            let first = |t: &Timed| ms(t.chunks[0]);
            let last = |t: &Timed| ms(*t.chunks.last().expect("chunks"));
            let per = |t: &Timed| (last(t) - first(t)) / (t.chunks.len() - 1) as f64;
            out.ttft.push(first(&d), first(&v));
            out.last.push(last(&d), last(&v));
            out.per_token.push(per(&d), per(&v));
            out.chunks = d.chunks.len();
        }
        text = d.text;
    }
    text
}

/// The first model the upstream lists.
async fn first_model(conn: &mut Conn) -> String {
    conn.sender
        .ready()
        .await
        .unwrap_or_else(|e| fail(&format!("connection to {}: {e}", conn.host)));
    let req = Request::builder()
        .uri("/v1/models")
        .header(header::HOST, &conn.host)
        .body(Full::new(Bytes::new()))
        .expect("a request");
    let resp = conn
        .sender
        .send_request(req)
        .await
        .unwrap_or_else(|e| fail(&format!("GET /v1/models from {}: {e}", conn.host)));
    let body = resp
        .into_body()
        .collect()
        .await
        .unwrap_or_else(|e| fail(&format!("reading /v1/models: {e}")))
        .to_bytes();
    serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.pointer("/data/0/id")?.as_str().map(str::to_string))
        .unwrap_or_else(|| fail("the upstream lists no model; name one with --model"))
}

fn main() {
    let args = parse_args();
    // The upstream: the given server, or the mock behind a fak gateway.
    let (upstream, what) = match &args.upstream_url {
        Some(u) => {
            let base = fak_upstream::normalize_base_url(u).unwrap_or_else(|e| fail(&e.to_string()));
            (base, format!("the server at {u}"))
        }
        None => {
            let mock = MockDriver::new().with_delay(Duration::from_micros(args.delay_us));
            let addr = spawn_server(router(Arc::new(mock), GatewayConfig::default()));
            let pace = if args.delay_us == 0 {
                "instant replies".to_string()
            } else {
                format!("{} us before each word", args.delay_us)
            };
            (
                format!("http://{addr}"),
                format!("a fak gateway over the mock engine, in this process ({pace})"),
            )
        }
    };
    let driver = Arc::new(
        UpstreamDriver::start(UpstreamConfig {
            base_urls: vec![upstream.clone()],
            ..UpstreamConfig::default()
        })
        .unwrap_or_else(|e| fail(&e.to_string())),
    );
    let t = Instant::now();
    while driver.readiness() != Readiness::Ready {
        if t.elapsed() > Duration::from_secs(30) {
            fail(&format!(
                "the upstream is not ready: {:?}",
                driver.readiness()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let front = spawn_server(router(
        Arc::clone(&driver) as Arc<dyn EngineDriver>,
        GatewayConfig::default(),
    ));

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let (results, text, model) = rt.block_on(async {
        let authority = upstream.trim_start_matches("http://");
        let authority = authority.split('/').next().unwrap_or(authority).to_string();
        let mut direct = Conn::open(&authority).await;
        let mut via = Conn::open(&front.to_string()).await;
        let model = match &args.model {
            Some(m) => m.clone(),
            None => first_model(&mut direct).await,
        };
        // `top_p: 1` as fak sends it upstream (OpenAI's default, which fak applies
        // when a request has none), so that both paths ask the upstream alike.
        let body = if args.upstream_url.is_some() {
            let prompt = args
                .prompt
                .clone()
                .unwrap_or_else(|| "Count from 1 to 50, separated by spaces.".into());
            json!({"model": model, "temperature": 0, "top_p": 1, "max_tokens": args.max_tokens,
                   "messages": [{"role": "user", "content": prompt}]})
        } else {
            let words: Vec<String> = (1..=args.words).map(|i| format!("w{i}")).collect();
            json!({"model": model, "temperature": 0, "top_p": 1,
                   "messages": [{"role": "user", "content": format!("echo {}", words.join(" "))}]})
        };
        let mut r = Results::default();
        let text = measure(&mut direct, &mut via, &body, args.requests, &mut r).await;
        (r, text, model)
    });

    let report = json!({
        "upstream": what,
        "model": model,
        "requests": args.requests,
        "mock_delay_us": args.upstream_url.is_none().then_some(args.delay_us),
        "warmup": WARMUP,
        "streamed_chunks": results.chunks,
        "reply_chars": text.len(),
        "non_streaming": results.whole.summary(),
        "streaming": {
            "ttft": results.ttft.summary(),
            "last_token": results.last.summary(),
            "per_token": results.per_token.summary(),
        },
    });
    if args.json {
        println!("{report:#}");
        return;
    }
    println!("upstream: {what}");
    println!(
        "model {model}; {} requests per path and mode after {WARMUP} warm-up, in pairs \
         (direct first in half of them); one keep-alive connection each",
        args.requests
    );
    println!(
        "reply: {} content chunks, {} chars: {:?}",
        results.chunks,
        text.len(),
        excerpt(&text)
    );
    println!();
    println!(
        "{:<34}{:>9}{:>9}{:>13}{:>9}{:>11}{:>9}{:>14}{:>9}",
        "ms", "direct", "p99", "through fak", "p99", "added", "p99", "paired diff", "p99"
    );
    let row = |name: &str, p: &Pair| {
        let d = p.diffs();
        let (d50, d99, v50, v99) = (
            pct(&p.direct, 0.5),
            pct(&p.direct, 0.99),
            pct(&p.via, 0.5),
            pct(&p.via, 0.99),
        );
        println!(
            "{:<34}{:>9.3}{:>9.3}{:>13.3}{:>9.3}{:>11.3}{:>9.3}{:>14.3}{:>9.3}",
            name,
            d50,
            d99,
            v50,
            v99,
            v50 - d50,
            v99 - d99,
            pct(&d, 0.5),
            pct(&d, 0.99)
        );
    };
    row("non-streaming: whole reply", &results.whole);
    row("streaming: first token (TTFT)", &results.ttft);
    row("streaming: last token", &results.last);
    row("streaming: per token after first", &results.per_token);
    println!();
    println!(
        "added = through-fak median minus direct median (p99: the p99s' difference); \
         paired diff = each request through fak minus the direct one of its pair"
    );
}

/// The first 60 characters of `s`.
fn excerpt(s: &str) -> String {
    match s.char_indices().nth(60) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    }
}
