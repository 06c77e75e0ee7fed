//! `/v1/completions` with the prompt as token ids, over the in-kernel engine on the real
//! SmolLM2-135M-Instruct: the chat-templated prompt of each committed HF e2e case, sent
//! as HF's own token ids (control tokens included), gives HF's greedy text at
//! temperature 0; a plain text and its ids give the same completion; a list of two id
//! lists is answered as two choices by `index`; an id outside the vocabulary is a 400
//! naming it. Without the model file this fails with the fetch command
//! (`FAK_SKIP_REAL_MODEL=1` reports it as ignored, never in CI).

mod common;

use common::{post, start, Server};
use fak_engine::inkernel::InKernelDriver;
use fak_engine::EngineConfig;
use fak_gateway::GatewayConfig;
use fak_model::{load_text, Model};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;

const ID: &str = "smollm2-135m-instruct";

/// The server, the vocabulary size, and [`PLAIN`] as the ids a text prompt becomes
/// (the tokenizer proven equal to HF's, BOS as the model asks).
fn server() -> (Server, usize, Vec<u32>) {
    let path = fak_catalog::require_cached(ID).unwrap_or_else(|m| panic!("{m}"));
    let m = Arc::new(Model::load(&path).unwrap());
    let vocab = m.config().vocab_size;
    let (tok, tmpl) = load_text(&path, m.config()).unwrap();
    let plain = tok.encode_prompt(PLAIN).unwrap();
    let cfg = EngineConfig {
        kv_budget_bytes: 0,
        ..EngineConfig::default()
    };
    let d = InKernelDriver::from_loaded(m, tok, tmpl, ID, cfg);
    (start(Arc::new(d), GatewayConfig::default()), vocab, plain)
}

/// A plain-text prompt.
const PLAIN: &str = "The capital of France is";

/// HF's e2e cases: `prompt_ids` (the chat template rendered and tokenized by
/// transformers), `rendered` (that text), `text` (HF's greedy reply).
fn e2e_cases() -> Vec<Value> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/text/smollm2-135m-instruct/e2e.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn completion(prompt: Value, max_tokens: usize) -> Value {
    json!({"model": ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

#[fak_testkit::real_model]
fn token_ids_and_their_text_give_hf_greedy_text() {
    let (srv, vocab, plain) = server();
    let cases = e2e_cases();
    for case in &cases[..2] {
        let n = case["completion_ids"].as_array().unwrap().len() + 4;
        let by_ids = post(
            srv.addr,
            "/v1/completions",
            &completion(case["prompt_ids"].clone(), n),
        );
        assert_eq!(by_ids.status, 200, "{}", by_ids.body);
        let v = by_ids.json();
        assert_eq!(v["choices"][0]["text"], case["text"], "{}", case["name"]);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            v["usage"]["prompt_tokens"],
            case["prompt_ids"].as_array().unwrap().len()
        );
    }
    // A text and its ids give the same completion.
    let by_text = post(srv.addr, "/v1/completions", &completion(json!(PLAIN), 12)).json();
    let by_ids = post(srv.addr, "/v1/completions", &completion(json!(plain), 12)).json();
    let text = by_text["choices"][0]["text"].as_str().unwrap();
    assert!(!text.is_empty(), "{by_text}");
    assert_eq!(by_ids["choices"][0]["text"], text, "{by_ids}");
    assert_eq!(by_ids["usage"], by_text["usage"]);
    // Two prompts as a list of id lists: two choices, each its prompt's answer.
    let n = 16;
    let both = json!([cases[0]["prompt_ids"], cases[1]["prompt_ids"]]);
    let r = post(srv.addr, "/v1/completions", &completion(both, n));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    for (i, case) in cases[..2].iter().enumerate() {
        let c = &v["choices"][i];
        assert_eq!(c["index"], i);
        let want = case["text"].as_str().unwrap();
        let got = c["text"].as_str().unwrap();
        // Cut at max_tokens, HF's text starts the same way.
        assert!(
            !got.is_empty() && want.starts_with(got) || got == want,
            "{i}: {got:?} vs {want:?}"
        );
    }
    // An id outside the vocabulary is a 400 naming it, not a panic.
    let mut ids = cases[0]["prompt_ids"].as_array().unwrap().clone();
    ids.insert(3, json!(vocab));
    let r = post(srv.addr, "/v1/completions", &completion(json!(ids), 4));
    assert_eq!(r.status, 400, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains(&format!("token id {vocab} (at position 3)")),
        "{msg}"
    );
}
