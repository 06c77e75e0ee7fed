//! The gateway over the in-kernel engine on the real SmolLM2-135M-Instruct, on a
//! loopback socket: greedy HTTP output equals `fak run --format json` (the committed HF
//! e2e fixture, which `fak run` is tested to equal), streamed text equals the whole
//! text, and a scripted conversation reports the previous turns as cached tokens
//! while giving the cold output. Without the model file this fails with the fetch
//! command (`FAK_SKIP_REAL_MODEL=1` opts out locally, never in CI).

mod common;

use common::{post, start, Server};
use fak_engine::inkernel::InKernelDriver;
use fak_engine::EngineConfig;
use fak_gateway::GatewayConfig;
use fak_model::{catalog, load_text, Model};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

const ID: &str = "smollm2-135m-instruct";

fn smollm2_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        return Some(PathBuf::from(p));
    }
    catalog::require_cached(ID).unwrap_or_else(|m| panic!("{m}"))
}

fn model() -> Option<(PathBuf, Arc<Model>)> {
    static M: OnceLock<Option<(PathBuf, Arc<Model>)>> = OnceLock::new();
    M.get_or_init(|| {
        let path = smollm2_path()?;
        let m = Arc::new(Model::load(&path).unwrap());
        Some((path, m))
    })
    .clone()
}

fn server(kv_budget_bytes: usize) -> Option<Server> {
    let (path, m) = model()?;
    let (tok, tmpl) = load_text(&path, m.config()).unwrap();
    let cfg = EngineConfig {
        kv_budget_bytes,
        ..EngineConfig::default()
    };
    let d = InKernelDriver::from_loaded(m, tok, tmpl, ID, cfg);
    Some(start(Arc::new(d), GatewayConfig::default()))
}

fn e2e_cases() -> Vec<Value> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/text/smollm2-135m-instruct/e2e.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn chat_text(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

fn streamed_text(r: &common::Resp) -> String {
    r.sse()
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .filter_map(|(_, d)| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect()
}

#[test]
fn greedy_http_output_equals_fak_run_json() {
    let Some(srv) = server(0) else { return };
    for case in e2e_cases() {
        let body = json!({"model": ID, "temperature": 0, "messages": case["messages"]});
        let r = post(srv.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(
            chat_text(&v),
            case["text"].as_str().unwrap(),
            "{}",
            case["name"]
        );
        let n_prompt = case["prompt_ids"].as_array().unwrap().len();
        let n_completion = case["completion_ids"].as_array().unwrap().len();
        assert_eq!(v["usage"]["prompt_tokens"], n_prompt);
        assert_eq!(v["usage"]["completion_tokens"], n_completion);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        // Streaming gives the same text.
        let mut body = body;
        body["stream"] = json!(true);
        let r = post(srv.addr, "/v1/chat/completions", &body);
        assert_eq!(streamed_text(&r), case["text"].as_str().unwrap());
    }
    // Anthropic's route, same model, same answer.
    let case = &e2e_cases()[0];
    let body =
        json!({"model": ID, "max_tokens": 64, "temperature": 0, "messages": case["messages"]});
    let v = post(srv.addr, "/v1/messages", &body).json();
    assert_eq!(v["content"][0]["text"], case["text"]);
    assert_eq!(v["stop_reason"], "end_turn");
}

#[test]
fn a_scripted_conversation_reuses_the_previous_turns_and_equals_cold_output() {
    let Some(warm) = server(256 << 20) else {
        return;
    };
    let Some(cold) = server(0) else { return };
    let users = [
        "What is the capital of France?",
        "And of Germany?",
        "Name one river in that country.",
    ];
    let mut messages: Vec<Value> = Vec::new();
    let mut prev_total = 0u64; // prompt + completion tokens of the previous turn
    for (k, u) in users.iter().enumerate() {
        messages.push(json!({"role": "user", "content": u}));
        let body = json!({"model": ID, "temperature": 0, "max_tokens": 40, "messages": messages});
        let w = post(warm.addr, "/v1/chat/completions", &body).json();
        let c = post(cold.addr, "/v1/chat/completions", &body).json();
        assert_eq!(chat_text(&w), chat_text(&c), "turn {k}");
        assert_eq!(w["usage"], {
            let mut u = c["usage"].clone();
            u["prompt_tokens_details"]["cached_tokens"] =
                w["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
            u
        });
        let cached = w["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        if k == 0 {
            assert_eq!(cached, 0);
        } else {
            // The cache holds the previous prompt and reply except the reply's last
            // (end-of-turn) token, which was sampled but never run.
            assert_eq!(cached, prev_total - 1, "turn {k}");
        }
        prev_total = w["usage"]["total_tokens"].as_u64().unwrap();
        messages.push(json!({"role": "assistant", "content": chat_text(&w)}));
    }
    // Anthropic reports the same reuse as cache_read_input_tokens, and input_tokens
    // as the rest of the prompt.
    messages.push(json!({"role": "user", "content": "Thanks!"}));
    let body = json!({"model": ID, "max_tokens": 40, "temperature": 0, "messages": messages});
    let v = post(warm.addr, "/v1/messages", &body).json();
    let u = &v["usage"];
    assert_eq!(
        u["cache_read_input_tokens"].as_u64().unwrap(),
        prev_total - 1,
        "{u}"
    );
    assert!(u["input_tokens"].as_u64().unwrap() > 0, "{u}");
}

/// Several clients at once on two worker slots: every answer equals its single-client
/// (HF) answer, nothing fails, and /health answers promptly meanwhile.
#[test]
fn concurrent_clients_get_their_single_client_answers() {
    let Some((path, m)) = model() else { return };
    let (tok, tmpl) = load_text(&path, m.config()).unwrap();
    let cfg = EngineConfig {
        parallel: 2,
        kv_budget_bytes: 64 << 20,
        ..EngineConfig::default()
    };
    let d = InKernelDriver::from_loaded(m, tok, tmpl, ID, cfg);
    let srv = start(Arc::new(d), GatewayConfig::default());
    let addr = srv.addr;
    let cases = e2e_cases();
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let cases = cases.clone();
            std::thread::spawn(move || {
                for i in 0..2 {
                    let case = &cases[(c + i) % 2];
                    let mut body =
                        json!({"model": ID, "temperature": 0, "messages": case["messages"]});
                    let stream = (c + i) % 2 == 1;
                    body["stream"] = json!(stream);
                    let r = post(addr, "/v1/chat/completions", &body);
                    assert_eq!(r.status, 200, "{}", r.body);
                    let text = if stream {
                        streamed_text(&r)
                    } else {
                        chat_text(&r.json())
                    };
                    assert_eq!(
                        text,
                        case["text"].as_str().unwrap(),
                        "client {c} request {i}"
                    );
                }
            })
        })
        .collect();
    let mut worst = std::time::Duration::ZERO;
    while clients.iter().any(|c| !c.is_finished()) {
        let t = std::time::Instant::now();
        assert_eq!(common::get(addr, "/health").status, 200);
        worst = worst.max(t.elapsed());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    for c in clients {
        c.join().unwrap();
    }
    eprintln!(
        "slowest /health under load: {:.1} ms",
        worst.as_secs_f64() * 1e3
    );
    assert!(worst < std::time::Duration::from_millis(500), "{worst:?}");
}
