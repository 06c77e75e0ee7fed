//! `logprobs` over HTTP on the real SmolLM2-135M-Instruct: at temperature 0 every
//! generated token is the top of its own `top_logprobs` (greedy = argmax), the lists are
//! sorted and sub-normalized, the tokens concatenate to the content (the end-of-turn
//! token is not listed), a stream's entries concatenate to the non-streamed list, and
//! the first token's figures equal HF's log-softmax of the committed oracle logits.
//!
//! Oracle tolerance, derived: `logprob_i = z_i - LSE(z)` with LSE 1-Lipschitz in the
//! max norm, so `|Δlogprob| <= 2·max|Δz|`, and the design bounds the exact path's
//! logits by max|Δz| <= 1e-4: 2e-4 here (fak-kv's `logprobs_smollm2` checks the tighter
//! bound from the measured logit error). Without the model file this fails with the
//! fetch command (`FAK_SKIP_REAL_MODEL=1` reports them as ignored, never in CI).

mod common;

use common::{post, smollm2_server, Server};
use fak_engine::EngineConfig;
use fak_model::WeightMode;
use fak_prove::oracle::Oracle;
use serde_json::{json, Value};
use std::path::PathBuf;

const ID: &str = common::SMOLLM2_ID;
/// 2 × the design's logits bound (see the module docs).
const TOL: f64 = 2e-4;

fn server() -> Server {
    smollm2_server(WeightMode::Exact, EngineConfig::default())
}

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

fn e2e_cases() -> Vec<Value> {
    let p = testdata().join("text/smollm2-135m-instruct/e2e.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// HF's log-softmax, directly: `z - ln Σ exp(z)` in f64, sorted highest first.
fn hf_sorted_log_softmax(z: &[f32]) -> Vec<f64> {
    let ln_z = z.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
    let mut v: Vec<f64> = z.iter().map(|&x| x as f64 - ln_z).collect();
    v.sort_by(|a, b| b.total_cmp(a));
    v
}

fn oracle(name: &str) -> Oracle {
    Oracle::load(testdata().join(format!("oracles/{ID}/{name}.safetensors"))).unwrap()
}

/// The last row of the oracle's logits (the first generated token's distribution).
fn last_logits(o: &Oracle) -> Vec<f32> {
    let (shape, l) = o.f32("logits").unwrap();
    l[l.len() - shape[1]..].to_vec()
}

#[fak_testkit::real_model]
fn greedy_tokens_top_their_lists_and_spell_the_content() {
    let srv = server();
    for case in e2e_cases() {
        let name = case["name"].as_str().unwrap();
        let body = json!({"model": ID, "temperature": 0, "messages": case["messages"],
                          "logprobs": true, "top_logprobs": 20});
        let r = post(srv.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "{name}");
        let list = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        // Every generated token but the final end-of-turn token.
        let n = case["completion_ids"].as_array().unwrap().len();
        assert_eq!(list.len(), n - 1, "{name}");
        assert_eq!(v["usage"]["completion_tokens"], n);
        let mut bytes = Vec::new();
        for (i, e) in list.iter().enumerate() {
            let top = e["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 20);
            assert_eq!(
                top[0]["token"], e["token"],
                "{name} token {i}: greedy = argmax"
            );
            assert_eq!(top[0]["bytes"], e["bytes"]);
            assert_eq!(f(&top[0]["logprob"]), f(&e["logprob"]));
            let vals: Vec<f64> = top.iter().map(|t| f(&t["logprob"])).collect();
            assert!(
                vals.windows(2).all(|w| w[0] >= w[1]),
                "{name} {i}: {vals:?}"
            );
            let mass: f64 = vals.iter().map(|x| x.exp()).sum();
            assert!(mass <= 1.0 + 1e-9 && vals[0] <= 0.0, "{name} {i}: {mass}");
            bytes.extend(
                e["bytes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|b| b.as_u64().unwrap() as u8),
            );
        }
        let tokens: String = list.iter().map(|e| e["token"].as_str().unwrap()).collect();
        assert_eq!(tokens, text, "{name}");
        assert_eq!(String::from_utf8(bytes).unwrap(), text, "{name}");
        // Streamed: the chunks' entries concatenate to the same list.
        let mut b = body.clone();
        b["stream"] = json!(true);
        let r = post(srv.addr, "/v1/chat/completions", &b);
        let mut streamed = Vec::new();
        for (_, d) in r.sse().into_iter().filter(|(_, d)| d != "[DONE]") {
            let c: Value = serde_json::from_str(&d).unwrap();
            if let Some(l) = c["choices"][0]["logprobs"]["content"].as_array() {
                streamed.extend(l.iter().cloned());
            }
        }
        assert_eq!(&streamed, list, "{name}");
    }
}

#[fak_testkit::real_model]
fn first_token_equals_hf_log_softmax_of_the_oracle_logits() {
    let srv = server();
    // Chat: the oracle's messages through the template (the same 40 prompt ids).
    let o = oracle("chat");
    let messages: Value = serde_json::from_str(&o.metadata["chat_messages"]).unwrap();
    let body = json!({"model": ID, "temperature": 0, "max_tokens": 1, "messages": messages,
                      "logprobs": true, "top_logprobs": 20});
    let v = post(srv.addr, "/v1/chat/completions", &body).json();
    assert_eq!(
        v["usage"]["prompt_tokens"],
        o.ids("prompt_ids").unwrap().len()
    );
    let e = &v["choices"][0]["logprobs"]["content"][0];
    let hf = hf_sorted_log_softmax(&last_logits(&o));
    let ours: Vec<f64> = e["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| f(&t["logprob"]))
        .collect();
    assert_eq!(ours.len(), 20);
    let worst = ours
        .iter()
        .zip(&hf)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    eprintln!(
        "chat: first token {} logprob {} (HF {}), top-20 max|Δ| {worst:.2e}",
        e["token"], e["logprob"], hf[0]
    );
    assert!(worst <= TOL, "chat: {worst:e}");
    assert!((f(&e["logprob"]) - hf[0]).abs() <= TOL);
    // Text prompts through /v1/completions (`logprobs: 5`).
    for name in ["capital", "code"] {
        let o = oracle(name);
        let body = json!({"model": ID, "temperature": 0, "max_tokens": 1,
                          "prompt": o.metadata["prompt_text"], "logprobs": 5});
        let v = post(srv.addr, "/v1/completions", &body).json();
        assert_eq!(
            v["usage"]["prompt_tokens"],
            o.ids("prompt_ids").unwrap().len()
        );
        let lp = &v["choices"][0]["logprobs"];
        let hf = hf_sorted_log_softmax(&last_logits(&o));
        assert!((f(&lp["token_logprobs"][0]) - hf[0]).abs() <= TOL, "{name}");
        let mut top: Vec<f64> = lp["top_logprobs"][0]
            .as_object()
            .unwrap()
            .values()
            .map(f)
            .collect();
        top.sort_by(|a, b| b.total_cmp(a));
        assert_eq!(top.len(), 5, "{name}: {lp}");
        for (a, b) in top.iter().zip(&hf) {
            assert!((a - b).abs() <= TOL, "{name}: {a} vs HF {b}");
        }
    }
}
