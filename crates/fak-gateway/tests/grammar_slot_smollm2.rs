//! Where a request's grammar compiles, on the real SmolLM2-135M-Instruct: in the worker
//! slot that takes the request (so within `--parallel` and behind `--max-queue`), after
//! the prompt passed the context-length check, and within llguidance's limits.
//!
//! - With one slot busy and a queue of one, a request with a big schema waits in the
//!   queue at once: the next request is a 429 at once (its grammar once compiled on the
//!   request's thread first, leaving the queue empty meanwhile).
//! - A prompt over the context length with a huge schema is the context-length 400 at
//!   once (it once compiled the schema first).
//! - A 6,000-property object schema is a 400 naming the limit in bounded time (it once
//!   compiled, for about 20 s of a core, then generated).
//!
//! Without the model file these fail with the fetch command (`FAK_SKIP_REAL_MODEL=1`
//! reports them as ignored, never in CI).

mod common;

use common::{open_stream, post, smollm2_server, Server};
use fak_engine::EngineConfig;
use fak_model::WeightMode;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const ID: &str = common::SMOLLM2_ID;

/// An object schema of `n` optional string properties `p0`, `p1`, ...
fn object_schema(n: usize) -> Value {
    let properties: serde_json::Map<String, Value> = (0..n)
        .map(|i| (format!("p{i}"), json!({"type": "string"})))
        .collect();
    json!({"type": "object", "properties": properties})
}

/// A chat request constrained to `schema` (Chat Completions `response_format`).
fn with_schema(content: &str, schema: Value, max_tokens: usize) -> Value {
    json!({
        "model": ID,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "Big", "schema": schema}}
    })
}

fn message(r: &common::Resp) -> String {
    r.json()["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message: {}", r.body))
        .to_string()
}

fn server(parallel: usize, max_queue: usize) -> Server {
    smollm2_server(
        WeightMode::Native,
        EngineConfig {
            parallel,
            max_queue,
            ..EngineConfig::default()
        },
    )
}

#[fak_testkit::real_model]
fn a_big_schema_waits_in_the_queue_and_the_next_request_is_a_429_at_once() {
    let srv = server(1, 1);
    // The one slot generates a long reply (held open, read no further). Its format
    // asks for a string of at least 10,000 characters, so it cannot end before its
    // 2,000 tokens, however fast the machine (unconstrained, the native weights answer
    // this prompt in 52 tokens: a quarter of a second on a fast CPU, and the slot would
    // be free again before the third request).
    let long = json!({"type": "object", "required": ["s"],
                      "properties": {"s": {"type": "string", "minLength": 10000}}});
    let busy = open_stream(
        srv.addr,
        "/v1/chat/completions",
        &json!({"model": ID, "stream": true, "max_tokens": 2000, "temperature": 0,
                "messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "Long", "schema": long}}}),
        200,
    );
    // A schema that takes about a second of a core to compile, within the limits.
    let addr = srv.addr;
    let queued = std::thread::spawn(move || {
        post(
            addr,
            "/v1/chat/completions",
            &with_schema("Describe a thing.", object_schema(2000), 4),
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let third = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"model": ID, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]}),
    );
    let waited = t.elapsed();
    assert_eq!(third.status, 429, "{}", third.body);
    assert!(waited < Duration::from_secs(1), "the 429 took {waited:?}");
    // The slot frees when the long reply's client leaves; the queued request then
    // compiles its grammar in the worker and is answered there: a 400, as 2,000 optional
    // properties pass llguidance's per-step limits at the first token.
    drop(busy);
    let queued = queued.join().unwrap();
    assert_eq!(queued.status, 400, "{}", queued.body);
    assert!(
        message(&queued).contains("accepts no output"),
        "{}",
        queued.body
    );
}

#[fak_testkit::real_model]
fn an_overlong_prompt_with_a_huge_schema_is_the_context_length_400_at_once() {
    let srv = server(1, 4);
    // SmolLM2's context is 8,192 tokens; " hello" is one token.
    let prompt = " hello".repeat(9000);
    let t = Instant::now();
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &with_schema(&prompt, object_schema(6000), 16),
    );
    let took = t.elapsed();
    println!(
        "overlong prompt with a 6,000-property schema: {} in {took:?}",
        r.status
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let msg = message(&r);
    assert!(msg.contains("context"), "{msg}");
    assert!(took < Duration::from_secs(2), "the 400 took {took:?}");
}

#[fak_testkit::real_model]
fn a_6000_property_schema_is_a_400_naming_the_limit_in_bounded_time() {
    let srv = server(1, 4);
    let t = Instant::now();
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &with_schema("Describe a thing.", object_schema(6000), 16),
    );
    let took = t.elapsed();
    println!("6,000-property schema: {} in {took:?}", r.status);
    assert_eq!(r.status, 400, "{}", r.body);
    let msg = message(&r);
    assert!(
        msg.contains("the grammar is too large to compile") && msg.contains("limit"),
        "{msg}"
    );
    assert!(took < Duration::from_secs(10), "the 400 took {took:?}");
}
