//! Engine work bounded at shutdown and by KV size, on the real SmolLM2-135M-Instruct
//! (in-kernel driver, one worker slot):
//!
//! - shutdown: [`fak_gateway::serve_engine`] answers a request still queued for the slot
//!   503 at once (before: only when the grace ended), and once the grace ends the long
//!   prefill in the slot is cut with a final error event; [`EngineDriver::cancel_all`]
//!   stops a generation whose stream is still held within a prefill batch, in well under
//!   the whole prefill's time;
//! - `max_kv_bytes`: a generation whose KV cache reaches the limit ends with the length
//!   stop reason on both wires; a prompt alone over it is a 400 naming the limit.
//!
//! Without the model file these fail with the fetch command (`FAK_SKIP_REAL_MODEL=1`
//! reports them ignored).

mod common;

use common::{post, Resp};
use fak_engine::inkernel::InKernelDriver;
use fak_engine::{EngineConfig, EngineDriver, EngineError, EngineEvent, GenerateRequest, Prompt};
use fak_gateway::{router, serve_engine, GatewayConfig};
use fak_model::{load_text, Model};
use serde_json::{json, Value};
use std::io::Read;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const ID: &str = "smollm2-135m-instruct";

fn model() -> (PathBuf, Arc<Model>) {
    static M: OnceLock<(PathBuf, Arc<Model>)> = OnceLock::new();
    M.get_or_init(|| {
        let path = fak_catalog::require_cached(ID).unwrap_or_else(|m| panic!("{m}"));
        let m = Arc::new(Model::load(&path).unwrap());
        (path, m)
    })
    .clone()
}

/// The in-kernel driver, one slot, no KV reuse, `max_kv_bytes` as given.
fn driver(max_kv_bytes: Option<usize>) -> Arc<InKernelDriver> {
    let (path, m) = model();
    let (tok, tmpl) = load_text(&path, m.config()).unwrap();
    let cfg = EngineConfig {
        parallel: 1,
        kv_budget_bytes: 0,
        max_kv_bytes,
        ..EngineConfig::default()
    };
    Arc::new(InKernelDriver::from_loaded(m, tok, tmpl, ID, cfg))
}

/// About `n` tokens of text (each word one token).
fn words(n: usize) -> String {
    (0..n)
        .map(|k| [" apple", " river", " stone"][k % 3])
        .collect()
}

/// A server over `d` run by [`serve_engine`]; `stop` starts its shutdown.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(d: Arc<dyn EngineDriver>, config: GatewayConfig) -> Server {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let app = router(Arc::clone(&d), config.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(listener).unwrap();
                serve_engine(l, app, d, &config, async {
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
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
        self.thread.take();
    }
}

fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    t.elapsed()
}

#[fak_testkit::real_model]
fn shutdown_answers_the_queue_at_once_and_cancels_the_prefill_at_the_grace() {
    let d = driver(None);
    let grace = Duration::from_secs(2);
    let mut srv = Server::start(
        Arc::clone(&d) as Arc<dyn EngineDriver>,
        GatewayConfig {
            shutdown_grace: grace,
            ..GatewayConfig::default()
        },
    );
    let addr = srv.addr;
    // A long prefill in the slot, streamed (its head comes once it starts), and a short
    // request queued behind it.
    let long = json!({"model": ID, "temperature": 0, "max_tokens": 1, "stream": true,
        "messages": [{"role": "user", "content": words(4000)}]});
    let mut running = common::open_stream(addr, "/v1/chat/completions", &long, 1);
    let queued = std::thread::spawn(move || {
        let r = post(
            addr,
            "/v1/chat/completions",
            &json!({"model": ID, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]}),
        );
        (r, Instant::now())
    });
    wait_for("one running, one queued", Duration::from_secs(30), || {
        let s = d.stats();
        s.active == 1 && s.queue_depth == 1
    });
    let t0 = Instant::now();
    srv.stop();

    let (r, at) = queued.join().unwrap();
    let waited = at - t0;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "overloaded_error", "{}", r.body);
    assert!(
        waited < grace / 2,
        "the queued request was answered {waited:?} after the shutdown began (grace {grace:?})"
    );

    // The prefill runs through the grace, then is cut with a final error event; it
    // stops at the end of the batch it was in, never finishing (the next test measures
    // that against the whole prefill's time).
    running
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut rest = Vec::new();
    let _ = running.read_to_end(&mut rest);
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("shutting down"), "{rest}");
    assert!(!rest.contains("finish_reason\":\"length"), "{rest}");
    let idle = t0.elapsed()
        + wait_for("the slot idle", Duration::from_secs(300), || {
            d.stats().active == 0
        });
    println!("queued answered after {waited:?}; slot idle {idle:?} after the shutdown began (grace {grace:?})");
}

#[fak_testkit::real_model]
fn cancel_all_stops_a_held_generation_and_drain_answers_the_queue() {
    let d = driver(None);
    let req = |text: String, max_tokens: usize| GenerateRequest {
        max_tokens: Some(max_tokens),
        ..GenerateRequest {
            prompt: Prompt::Text(text),
            ..GenerateRequest::chat(Vec::new())
        }
    };
    // The whole prefill's time, for scale.
    let t = Instant::now();
    let done = d
        .submit(req(words(3000), 1))
        .unwrap()
        .blocking_collect()
        .unwrap();
    let full = t.elapsed();
    assert!(done.prompt_tokens > 2500, "{}", done.prompt_tokens);

    let mut long = d.submit(req(words(3000), 1)).unwrap();
    let mut short = d.submit(req("Hi.".into(), 2)).unwrap();
    wait_for("one running, one queued", Duration::from_secs(30), || {
        let s = d.stats();
        s.active == 1 && s.queue_depth == 1
    });
    d.drain();
    assert_eq!(
        short.blocking_next(),
        Some(EngineEvent::Error(EngineError::ShuttingDown))
    );
    assert_eq!(
        d.submit(req("Hi.".into(), 2)).unwrap_err(),
        EngineError::ShuttingDown
    );
    assert_eq!(d.stats().active, 1, "drain must leave the running one");
    let t = Instant::now();
    d.cancel_all();
    let stopped = wait_for("the slot idle", full, || d.stats().active == 0);
    let mut events = Vec::new();
    while let Some(e) = long.blocking_next() {
        events.push(e);
    }
    println!("whole prefill {full:?}; cancel_all stopped it in {stopped:?}");
    assert!(
        matches!(
            events.last(),
            Some(EngineEvent::Error(EngineError::ShuttingDown))
        ),
        "{events:?}"
    );
    assert!(!events.iter().any(|e| matches!(e, EngineEvent::Done(_))));
    assert!(
        t.elapsed() < full / 2,
        "stopped {:?} after cancel_all; the whole prefill takes {full:?}",
        t.elapsed()
    );
}

/// A server over the in-kernel driver (the plain one: no shutdown in these tests).
fn kv_server(max_kv_bytes: Option<usize>) -> common::Server {
    common::start(driver(max_kv_bytes), GatewayConfig::default())
}

fn count_chat(max_tokens: usize) -> Value {
    json!({"model": ID, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]})
}

fn usage(r: &Resp) -> (u64, u64) {
    let v = r.json();
    let u = &v["usage"];
    (
        u["prompt_tokens"]
            .as_u64()
            .or(u["input_tokens"].as_u64())
            .unwrap(),
        u["completion_tokens"]
            .as_u64()
            .or(u["output_tokens"].as_u64())
            .unwrap(),
    )
}

#[fak_testkit::real_model]
fn a_generation_reaching_the_kv_limit_ends_with_the_length_reason() {
    let per_token = fak_kv::Session::new(model().1).cache().bytes_per_token();
    // Without a limit (the machine's default) the reply runs on past 5 tokens.
    let srv = kv_server(None);
    let r = post(srv.addr, "/v1/chat/completions", &count_chat(40));
    assert_eq!(r.status, 200, "{}", r.body);
    let (prompt, completion) = usage(&r);
    assert!(completion > 10, "{}", r.body);
    drop(srv);

    // Room for the prompt and 5 more tokens.
    let limit = per_token * (prompt as usize + 5);
    let srv = kv_server(Some(limit));
    let r = post(srv.addr, "/v1/chat/completions", &count_chat(40));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(usage(&r), (prompt, 5), "{}", r.body);
    assert_eq!(
        r.json()["choices"][0]["finish_reason"],
        "length",
        "{}",
        r.body
    );

    let m = json!({"model": ID, "temperature": 0, "max_tokens": 40,
        "messages": [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]});
    let r = post(srv.addr, "/v1/messages", &m);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(usage(&r).1, 5, "{}", r.body);
    assert_eq!(r.json()["stop_reason"], "max_tokens", "{}", r.body);

    // A prompt that alone fills the limit: 400 naming it, before any generation.
    let mut big = count_chat(1);
    big["messages"][0]["content"] = json!(words(40));
    let r = post(srv.addr, "/v1/chat/completions", &big);
    assert_eq!(r.status, 400, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    let mb = format!("{:.1} MB", limit as f64 / (1u64 << 20) as f64);
    assert!(
        msg.contains("limit of one generation's KV cache") && msg.contains(&mb),
        "{msg}"
    );
}
