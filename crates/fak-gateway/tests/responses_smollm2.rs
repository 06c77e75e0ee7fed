//! `POST /v1/responses` over the in-kernel engine on the real SmolLM2-135M-Instruct,
//! against the committed HF e2e fixture (greedy text and token counts from
//! transformers' `apply_chat_template` and `generate`): plain text streamed and not, and a
//! `previous_response_id` follow-up whose prompt is exactly HF's two-turn conversation
//! (same token count, same greedy answer) with the first turn read from the KV cache.
//! Without the model file this fails with the fetch command (`FAK_SKIP_REAL_MODEL=1`
//! reports them as ignored, never in CI).

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

fn server() -> Server {
    let path = match std::env::var_os("FAK_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => fak_catalog::require_cached(ID).unwrap_or_else(|m| panic!("{m}")),
    };
    let m = Arc::new(Model::load(&path).unwrap());
    let (tok, tmpl) = load_text(&path, m.config()).unwrap();
    let d = InKernelDriver::from_loaded(m, tok, tmpl, ID, EngineConfig::default());
    start(Arc::new(d), GatewayConfig::default())
}

fn e2e_cases() -> Vec<Value> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/text/smollm2-135m-instruct/e2e.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn output_text(v: &Value) -> String {
    v["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

fn len(v: &Value) -> usize {
    v.as_array().unwrap().len()
}

#[fak_testkit::real_model]
fn plain_text_and_a_follow_up_from_the_kept_conversation_equal_hf() {
    let srv = server();
    let cases = e2e_cases();
    // Case 0 is one user turn; case 4 is case 0's exchange followed by a second question.
    let (one, two) = (&cases[0], &cases[4]);
    assert_eq!(two["messages"][0], one["messages"][0]);
    assert_eq!(two["messages"][1]["content"], one["text"]);
    let first = post(
        srv.addr,
        "/v1/responses",
        &json!({"model": ID, "input": one["messages"][0]["content"], "temperature": 0}),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    let first = first.json();
    assert_eq!(output_text(&first), one["text"].as_str().unwrap());
    assert_eq!(first["status"], "completed");
    assert_eq!(first["usage"]["input_tokens"], len(&one["prompt_ids"]));
    assert_eq!(first["usage"]["output_tokens"], len(&one["completion_ids"]));

    let r = post(
        srv.addr,
        "/v1/responses",
        &json!({"model": ID, "input": two["messages"][2]["content"], "temperature": 0,
                "previous_response_id": first["id"]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    // The kept conversation plus the new item is HF's two-turn prompt, token for token
    // in count, and the greedy answer is HF's.
    assert_eq!(v["usage"]["input_tokens"], len(&two["prompt_ids"]));
    assert_eq!(output_text(&v), two["text"].as_str().unwrap());
    // The first turn's prompt (and reply) came from the KV cache: only the new item and
    // what re-tokenizes differently at the turn boundary were prefilled.
    let cached = v["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    eprintln!(
        "follow-up: input_tokens {} cached_tokens {cached} (first turn's prompt {})",
        v["usage"]["input_tokens"],
        len(&one["prompt_ids"])
    );
    assert!(cached >= len(&one["prompt_ids"]), "cached {cached}: {v}");
}

#[fak_testkit::real_model]
fn streamed_text_equals_hf() {
    let srv = server();
    let case = &e2e_cases()[3];
    let r = post(
        srv.addr,
        "/v1/responses",
        &json!({"model": ID, "input": case["messages"][0]["content"], "temperature": 0,
                "stream": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let ev: Vec<Value> = r
        .sse()
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = ev
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, case["text"].as_str().unwrap());
    let last = ev.last().unwrap();
    assert_eq!(last["type"], "response.completed");
    assert_eq!(output_text(&last["response"]), text);
    assert_eq!(
        last["response"]["usage"]["output_tokens"],
        len(&case["completion_ids"])
    );
}
