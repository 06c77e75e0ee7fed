//! Routing by model (`fak serve --route MODEL=ENGINE`) over real sockets: one gateway
//! over a [`RoutedDriver`] with a local engine (the mock, standing in for the in-kernel
//! model) and two upstreams (other fak gateways over the mock, one reached over the
//! OpenAI wire, one over the Anthropic wire). Each request goes to the engine its
//! `model` names, on both client wires; `/v1/models` lists every routed model; an
//! unknown model is a 404 naming them.

mod common;

use common::{get, post, Killable};
use fak_engine::mock::MockDriver;
use fak_engine::route::{Route, RoutedDriver};
use fak_engine::{
    EngineConfig, EngineDriver, EngineError, EventStream, GenerateRequest, ModelInfo, Readiness,
};
use fak_gateway::{router, GatewayConfig};
use fak_upstream::UpstreamConfig;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The mock under its own model id, counting the requests it served.
struct Counted {
    mock: MockDriver,
    served: AtomicUsize,
}

impl Counted {
    fn new(id: &str) -> Arc<Self> {
        Arc::new(Counted {
            mock: MockDriver::new().with_model(id),
            served: AtomicUsize::new(0),
        })
    }

    fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }
}

impl EngineDriver for Counted {
    fn id(&self) -> &'static str {
        "mock"
    }
    fn models(&self) -> Vec<ModelInfo> {
        self.mock.models()
    }
    fn readiness(&self) -> Readiness {
        Readiness::Ready
    }
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        self.served.fetch_add(1, Ordering::SeqCst);
        self.mock.submit(req)
    }
}

fn upstream(driver: Arc<Counted>) -> Killable {
    Killable::start(router(driver, GatewayConfig::default()), None)
}

/// An OpenAI chat request. With `max_tokens`: on the way to an Anthropic upstream it
/// would otherwise be that wire's default of 4096, beyond the mock's 2048-token window.
fn chat(model: &str, content: &str) -> Value {
    json!({"model": model, "max_tokens": 50, "messages": [{"role": "user", "content": content}]})
}

fn messages(model: &str, content: &str) -> Value {
    json!({"model": model, "max_tokens": 50, "messages": [{"role": "user", "content": content}]})
}

#[test]
fn requests_go_to_the_engine_their_model_names_on_both_wires() {
    let (near, far_openai, far_anthropic) = (
        Counted::new("small"),
        Counted::new("big"),
        Counted::new("claude-x"),
    );
    let up_o = upstream(Arc::clone(&far_openai));
    let up_a = upstream(Arc::clone(&far_anthropic));
    let config = EngineConfig {
        upstream: UpstreamConfig {
            timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(10),
            health_interval: Duration::from_millis(200),
            ..UpstreamConfig::default()
        },
        ..EngineConfig::default()
    };
    // The upstream routes as `fak serve` builds them; the local engine added in front.
    let built = RoutedDriver::build(
        &[
            Route::parse(&format!("big=openai-upstream@http://{}/v1", up_o.addr)).unwrap(),
            Route::parse(&format!("claude-x=anthropic-upstream@http://{}", up_a.addr)).unwrap(),
        ],
        &config,
        fak_upstream::register(&mut fak_engine::registry::Registry::builtin()),
    )
    .unwrap();
    assert_eq!(
        built.routes(),
        vec![
            ("big".to_string(), "openai-upstream"),
            ("claude-x".to_string(), "anthropic-upstream")
        ]
    );
    let mut routes: Vec<(String, Arc<dyn EngineDriver>)> =
        vec![("small".into(), Arc::clone(&near) as Arc<dyn EngineDriver>)];
    routes.push(("big".into(), Arc::new(built)));
    // A router is a driver too: "big" and "claude-x" both reach this one (and its two
    // upstreams are counted once in the metrics).
    let inner = Arc::clone(&routes[1].1);
    routes.push(("claude-x".into(), inner));
    let d = Arc::new(RoutedDriver::new(routes).unwrap());
    let fr = common::start(
        Arc::clone(&d) as Arc<dyn EngineDriver>,
        GatewayConfig::default(),
    );
    let t = Instant::now();
    while get(fr.addr, "/health").status != 200 {
        assert!(t.elapsed() < Duration::from_secs(15), "never ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    let h = get(fr.addr, "/health").json();
    assert_eq!(h["engine"], "router");
    assert_eq!(h["models"], json!(["small", "big", "claude-x"]));
    let models = get(fr.addr, "/v1/models").json();
    let listed: Vec<(String, String)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_string(),
                m["owned_by"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        vec![
            ("small".to_string(), "mock".to_string()),
            ("big".to_string(), "openai-upstream".to_string()),
            ("claude-x".to_string(), "anthropic-upstream".to_string()),
        ]
    );
    assert_eq!(models["data"][0]["context_length"], 2048);
    // Each model on each wire: the right engine answers, and only it.
    let engines = [&near, &far_openai, &far_anthropic];
    for (k, model) in ["small", "big", "claude-x"].into_iter().enumerate() {
        let before: Vec<usize> = engines.iter().map(|e| e.served()).collect();
        let r = post(
            fr.addr,
            "/v1/chat/completions",
            &chat(model, &format!("echo hi {model}")),
        );
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        let v = r.json();
        assert_eq!(v["choices"][0]["message"]["content"], format!("hi {model}"));
        assert_eq!(v["model"], model);
        let r = post(
            fr.addr,
            "/v1/messages",
            &messages(model, &format!("echo yo {model}")),
        );
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        let v = r.json();
        assert_eq!(v["content"][0]["text"], format!("yo {model}"));
        assert_eq!(v["model"], model);
        let after: Vec<usize> = engines.iter().map(|e| e.served()).collect();
        for (j, (a, b)) in after.iter().zip(&before).enumerate() {
            let want = if j == k { 2 } else { 0 };
            assert_eq!(a - b, want, "model {model}: engine {j} served {}", a - b);
        }
    }
    // An unknown model: 404 in each wire's shape, naming the routed ones.
    let r = post(fr.addr, "/v1/chat/completions", &chat("gpt-9", "hi"));
    assert_eq!(r.status, 404, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("gpt-9") && msg.contains("small, big, claude-x"),
        "{msg}"
    );
    let r = post(fr.addr, "/v1/messages", &messages("gpt-9", "hi"));
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "not_found_error");
    // Metrics sum the engines: the two upstreams are counted.
    let m = get(fr.addr, "/metrics").body;
    assert!(m.contains("\nfak_upstreams 2\n"), "{m}");
}
