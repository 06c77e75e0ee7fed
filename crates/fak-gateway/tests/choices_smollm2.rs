//! OpenAI `n > 1` on the real SmolLM2-135M-Instruct through the gateway: `n` choices
//! of one prompt, prefilled once. Choice `i` is, token for token and logprob for
//! logprob, the `n = 1` request seeded with `choice_seed(seed, i)` (so choice 0 is the
//! `n = 1` request with the same seed); greedy choices are all the greedy text; usage
//! counts the prompt once and sums the completions; streamed choices interleave, each
//! with its own final chunk, the usage chunk once at the end; the batched run
//! (`parallel` 2) gives the same bits as the one-slot run; `n` outside 1..=16 is a 400.
//! A request without a seed samples afresh each time, unless the server fixes the seed
//! of such requests (`GatewayConfig::default_seed`, `fak serve --seed`).
//! Without the model file this fails with the fetch command (`FAK_SKIP_REAL_MODEL=1`
//! reports them as ignored, never in CI).

mod common;

use common::{post, start, Server};
use fak_engine::inkernel::InKernelDriver;
use fak_engine::{choice_seed, EngineConfig, EngineDriver, MAX_CHOICES};
use fak_gateway::GatewayConfig;
use fak_model::{load_text, Model};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

const ID: &str = common::SMOLLM2_ID;
const SEED: u64 = 7;

fn model() -> (PathBuf, Arc<Model>) {
    static M: OnceLock<(PathBuf, Arc<Model>)> = OnceLock::new();
    M.get_or_init(|| {
        let path = match std::env::var_os("FAK_SMOLLM2_GGUF") {
            Some(p) => PathBuf::from(p),
            None => fak_catalog::require_cached(ID).unwrap_or_else(|m| panic!("{m}")),
        };
        let m = Arc::new(Model::load(&path).unwrap());
        (path, m)
    })
    .clone()
}

/// A server with `parallel` slots (a batcher from 2) and no KV reuse cache.
fn server(parallel: usize) -> (Server, Arc<InKernelDriver>) {
    server_with(parallel, GatewayConfig::default())
}

/// [`server`] with the gateway configured as `gw`.
fn server_with(parallel: usize, gw: GatewayConfig) -> (Server, Arc<InKernelDriver>) {
    let (path, m) = model();
    let (tok, tmpl) = load_text(&path, m.config()).unwrap();
    let cfg = EngineConfig {
        parallel,
        kv_budget_bytes: 0,
        ..EngineConfig::default()
    };
    let d = Arc::new(InKernelDriver::from_loaded(m, tok, tmpl, ID, cfg));
    let srv = start(Arc::clone(&d) as Arc<dyn EngineDriver>, gw);
    (srv, d)
}

fn chat(n: Option<usize>, seed: u64, temperature: f64, stream: bool) -> Value {
    let mut b = json!({
        "model": ID,
        "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
        "max_tokens": 20,
        "temperature": temperature,
        // As the wire carries it: an i64, read back as the same 64 bits.
        "seed": seed as i64,
        "logprobs": true,
        "top_logprobs": 2,
        "stream": stream,
    });
    if let Some(n) = n {
        b["n"] = json!(n);
    }
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

fn ok(r: common::Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// (text, logprobs.content) of each choice, by index.
fn choices(v: &Value) -> Vec<(String, Value)> {
    let cs = v["choices"].as_array().unwrap();
    for (i, c) in cs.iter().enumerate() {
        assert_eq!(c["index"], i as u64, "{v}");
        assert!(c["finish_reason"].is_string(), "{v}");
    }
    cs.iter()
        .map(|c| {
            (
                c["message"]["content"].as_str().unwrap().to_string(),
                c["logprobs"]["content"].clone(),
            )
        })
        .collect()
}

#[fak_testkit::real_model]
fn each_choice_is_the_one_choice_request_with_its_seed() {
    let (srv, _) = server(1);
    let v = ok(post(
        srv.addr,
        "/v1/chat/completions",
        &chat(Some(3), SEED, 1.0, false),
    ));
    let got = choices(&v);
    assert_eq!(got.len(), 3);
    let mut prompt = 0;
    let mut completion = 0;
    for (i, (text, lp)) in got.iter().enumerate() {
        let one = ok(post(
            srv.addr,
            "/v1/chat/completions",
            &chat(None, choice_seed(SEED, i), 1.0, false),
        ));
        let want = &choices(&one)[0];
        // Bit-identical: the same text and the same logprobs (f64s printed alike).
        assert_eq!(text, &want.0, "choice {i}");
        assert_eq!(lp, &want.1, "choice {i}");
        assert!(lp.as_array().is_some_and(|a| !a.is_empty()), "{lp}");
        prompt = one["usage"]["prompt_tokens"].as_u64().unwrap();
        completion += one["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(choice_seed(SEED, 0), SEED);
    // Sampled with different seeds, the choices are not all one text.
    assert!(
        got.iter().any(|c| c.0 != got[0].0),
        "three sampled choices alike: {got:?}"
    );
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], prompt, "{u}");
    assert_eq!(u["completion_tokens"], completion, "{u}");
    assert_eq!(u["total_tokens"], prompt + completion, "{u}");
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0, "{u}");
}

#[fak_testkit::real_model]
fn greedy_choices_are_all_the_greedy_text() {
    let (srv, _) = server(1);
    let v = ok(post(
        srv.addr,
        "/v1/chat/completions",
        &chat(Some(3), 0, 0.0, false),
    ));
    let one = ok(post(
        srv.addr,
        "/v1/chat/completions",
        &chat(None, 0, 0.0, false),
    ));
    let want = &choices(&one)[0];
    let got = choices(&v);
    assert_eq!(got.len(), 3);
    for c in &got {
        assert_eq!(c, want);
    }
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        3 * one["usage"]["completion_tokens"].as_u64().unwrap()
    );
}

/// Each choice's streamed text, logprobs and finish chunks, and the usage chunks, in
/// arrival order.
struct Streamed {
    text: BTreeMap<u64, String>,
    logprobs: BTreeMap<u64, Vec<Value>>,
    finishes: BTreeMap<u64, usize>,
    /// The index of each content chunk, in order.
    order: Vec<u64>,
    /// Position (among the chunks) of each choice's final chunk.
    finished_at: BTreeMap<u64, usize>,
    usage: Vec<Value>,
    events: usize,
}

fn read_stream(r: &common::Resp) -> Streamed {
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.sse();
    assert_eq!(events.last().map(|e| e.1.as_str()), Some("[DONE]"));
    let mut s = Streamed {
        text: BTreeMap::new(),
        logprobs: BTreeMap::new(),
        finishes: BTreeMap::new(),
        order: Vec::new(),
        finished_at: BTreeMap::new(),
        usage: Vec::new(),
        events: events.len(),
    };
    for (k, (_, d)) in events.iter().enumerate() {
        if d == "[DONE]" {
            assert_eq!(k, events.len() - 1, "[DONE] before the end");
            continue;
        }
        let v: Value = serde_json::from_str(d).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            assert!(v["choices"].as_array().unwrap().is_empty(), "{v}");
            s.usage.push(u.clone());
            continue;
        }
        let cs = v["choices"].as_array().unwrap();
        assert_eq!(cs.len(), 1, "{v}");
        let c = &cs[0];
        let i = c["index"].as_u64().unwrap();
        if let Some(t) = c["delta"]["content"].as_str() {
            s.text.entry(i).or_default().push_str(t);
            if !t.is_empty() {
                s.order.push(i);
            }
        }
        if let Some(lp) = c["logprobs"]["content"].as_array() {
            s.logprobs.entry(i).or_default().extend(lp.iter().cloned());
        }
        if c["finish_reason"].is_string() {
            *s.finishes.entry(i).or_default() += 1;
            s.finished_at.insert(i, k);
        }
    }
    s
}

#[fak_testkit::real_model]
fn streamed_choices_interleave_and_the_batched_run_gives_the_same_bits() {
    let (one_slot, _) = server(1);
    let whole = ok(post(
        one_slot.addr,
        "/v1/chat/completions",
        &chat(Some(3), SEED, 1.0, false),
    ));
    let want = choices(&whole);
    // Two slots: a batcher, every choice on its own thread, decoding in shared passes.
    let (srv, driver) = server(2);
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &chat(Some(3), SEED, 1.0, true),
    );
    let s = read_stream(&r);
    assert_eq!(s.text.len(), 3, "{}", r.body);
    for (i, (text, lp)) in want.iter().enumerate() {
        let i = i as u64;
        assert_eq!(&s.text[&i], text, "choice {i}");
        assert_eq!(&Value::Array(s.logprobs[&i].clone()), lp, "choice {i}");
        assert_eq!(s.finishes[&i], 1, "choice {i}: one final chunk");
    }
    assert_eq!(s.usage.len(), 1, "one usage chunk");
    assert_eq!(s.usage[0], whole["usage"], "streamed usage == whole usage");
    // The usage chunk and [DONE] come after every choice's final chunk.
    assert!(s.finished_at.values().all(|&k| k < s.events - 2));
    let stats = driver.stats();
    assert!(
        stats.batch_max_sequences >= 2,
        "the choices decoded in shared passes: {stats:?}"
    );
    // Greedy, the choices decode in step: their chunks interleave (each choice sends
    // text before any choice's final chunk).
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &chat(Some(3), 0, 0.0, true),
    );
    let g = read_stream(&r);
    assert_eq!(g.text.len(), 3);
    let first_finish = *g.finished_at.values().min().unwrap();
    let events = r.sse();
    for i in 0..3u64 {
        let first_text = events.iter().position(|(_, d)| {
            serde_json::from_str::<Value>(d).is_ok_and(|v| {
                v["choices"][0]["index"] == i
                    && v["choices"][0]["delta"]["content"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty())
            })
        });
        assert!(
            first_text.is_some_and(|k| k < first_finish),
            "choice {i} sent no text before the first final chunk: {:?}",
            g.order
        );
    }
    assert!(g.text.values().all(|t| t == &g.text[&0]), "{:?}", g.text);
    assert_eq!(
        driver.stats().batch_max_sequences,
        3,
        "{:?}",
        driver.stats()
    );
}

#[fak_testkit::real_model]
fn completions_give_n_choices_per_prompt() {
    let (srv, _) = server(1);
    let body = |prompt: Value, n: Option<usize>| {
        let mut b = json!({"model": ID, "prompt": prompt, "max_tokens": 8,
            "temperature": 0.9, "seed": SEED as i64, "logprobs": 1});
        if let Some(n) = n {
            b["n"] = json!(n);
        }
        b
    };
    let prompts = ["The sea is", "Once upon a time"];
    let v = ok(post(
        srv.addr,
        "/v1/completions",
        &body(json!(prompts), Some(2)),
    ));
    let cs = v["choices"].as_array().unwrap();
    assert_eq!(cs.len(), 4, "{v}");
    let mut prompt = 0;
    let mut completion = 0;
    for (p, text) in prompts.iter().enumerate() {
        for i in 0..2 {
            let k = p * 2 + i;
            assert_eq!(cs[k]["index"], k as u64, "{v}");
            let mut one = body(json!(text), None);
            one["seed"] = json!(choice_seed(SEED, i) as i64);
            let one = ok(post(srv.addr, "/v1/completions", &one));
            assert_eq!(
                cs[k]["text"], one["choices"][0]["text"],
                "prompt {p} choice {i}"
            );
            assert_eq!(cs[k]["logprobs"], one["choices"][0]["logprobs"]);
            if i == 0 {
                prompt += one["usage"]["prompt_tokens"].as_u64().unwrap();
            }
            completion += one["usage"]["completion_tokens"].as_u64().unwrap();
        }
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], completion, "{v}");
    // Streamed: the same four choices, one usage chunk summing them.
    let mut b = body(json!(prompts), Some(2));
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    let r = post(srv.addr, "/v1/completions", &b);
    assert_eq!(r.status, 200, "{}", r.body);
    let mut text: BTreeMap<u64, String> = BTreeMap::new();
    let mut usage = Vec::new();
    for (_, d) in r.sse().iter().filter(|(_, d)| d != "[DONE]") {
        let c: Value = serde_json::from_str(d).unwrap();
        if !c["usage"].is_null() {
            usage.push(c["usage"].clone());
        }
        for ch in c["choices"].as_array().unwrap() {
            let t = ch["text"].as_str().unwrap();
            text.entry(ch["index"].as_u64().unwrap())
                .or_default()
                .push_str(t);
        }
    }
    assert_eq!(text.len(), 4);
    for (k, t) in &text {
        assert_eq!(cs[*k as usize]["text"], t.as_str());
    }
    assert_eq!(usage, vec![v["usage"].clone()]);
}

#[fak_testkit::real_model]
fn n_outside_its_range_is_a_400_naming_the_bound() {
    let (srv, _) = server(1);
    let bound = format!("1..={MAX_CHOICES}");
    for n in [json!(0), json!(-1), json!(MAX_CHOICES + 1), json!(1000)] {
        let mut b = chat(Some(1), 0, 0.0, false);
        b["n"] = n.clone();
        let r = post(srv.addr, "/v1/chat/completions", &b);
        assert_eq!(r.status, 400, "n = {n}: {}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains(&bound) && msg.contains("n = "), "{msg}");
        let c = json!({"model": ID, "prompt": "Hi", "n": n});
        let r = post(srv.addr, "/v1/completions", &c);
        assert_eq!(r.status, 400, "n = {n}: {}", r.body);
        assert!(r.body.contains(&bound), "{}", r.body);
    }
    // The bound itself is served.
    let mut b = chat(Some(MAX_CHOICES), 0, 0.0, false);
    b["max_tokens"] = json!(2);
    let v = ok(post(srv.addr, "/v1/chat/completions", &b));
    assert_eq!(v["choices"].as_array().unwrap().len(), MAX_CHOICES);
    // Prompts times n past the completions limit.
    let c = json!({"model": ID, "prompt": vec!["a"; 8], "n": 9, "max_tokens": 1});
    let r = post(srv.addr, "/v1/completions", &c);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("72 choices"), "{}", r.body);
}

/// `--max-kv-mb` bounds the `n` sequences together, the prompt they share counted once
/// (prompt + n × reply tokens): room for `n` replies cuts each at its share (`length`),
/// no room for one token each is a 400 naming `n`, while `n = 1` has the whole limit.
#[fak_testkit::real_model]
fn the_kv_limit_holds_for_the_choices_together() {
    let (path, m) = model();
    let (tok, tmpl) = load_text(&path, m.config()).unwrap();
    let per_token = fak_kv::KvCache::new(m.config(), 1).bytes_per_token();
    let cfg = EngineConfig {
        kv_budget_bytes: 0,
        max_kv_bytes: Some(per_token * 120),
        ..EngineConfig::default()
    };
    let d = InKernelDriver::from_loaded(m, tok, tmpl, ID, cfg);
    let srv = start(Arc::new(d), GatewayConfig::default());
    let mut b = chat(None, 0, 0.0, false);
    b["max_tokens"] = json!(60);
    let one = ok(post(srv.addr, "/v1/chat/completions", &b));
    let prompt = one["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt < 40, "{prompt}");
    // n = 1: the whole limit, 60 tokens fit.
    assert_eq!(one["choices"][0]["finish_reason"], "length");
    assert_eq!(one["usage"]["completion_tokens"], 60);
    // n = 4: (120 - prompt) / 4 tokens each (fewer than 60); were the prompt counted
    // per choice, (120 / 4) - prompt.
    b["n"] = json!(4);
    let four = ok(post(srv.addr, "/v1/chat/completions", &b));
    let each = (120 - prompt) / 4;
    assert!(each < 60, "{each}");
    assert_eq!(four["usage"]["completion_tokens"], 4 * each, "{four}");
    for c in four["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "length");
    }
    // A prompt leaving fewer than 16 tokens of room: n = 16 is a 400 naming it, and
    // n = 1 still runs.
    let words = "sea ".repeat(85);
    b["messages"][0]["content"] = json!(words);
    b["n"] = json!(1);
    let long = ok(post(srv.addr, "/v1/chat/completions", &b));
    let p = long["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!((105..120).contains(&p), "prompt of {p} tokens");
    b["n"] = json!(16);
    let r = post(srv.addr, "/v1/chat/completions", &b);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("n = 16 choices"), "{}", r.body);
}

/// The texts of `bodies` posted to `path` one after another (a chat or completions
/// choice's, or an Anthropic message's).
fn texts(srv: &Server, path: &str, bodies: &[Value]) -> Vec<String> {
    bodies
        .iter()
        .map(|b| {
            let v = ok(post(srv.addr, path, b));
            let c = &v["choices"][0];
            let t = c["message"]["content"].as_str().or(c["text"].as_str());
            t.or(v["content"][0]["text"].as_str())
                .unwrap_or_else(|| panic!("no text in {v}"))
                .to_string()
        })
        .collect()
}

/// A sampled request without a seed, as OpenAI's and Anthropic's clients send them,
/// gets another sample each time (a fresh random seed per request), on Chat
/// Completions, Completions, Anthropic Messages and Responses; with a seed it is the
/// same reply each time.
#[fak_testkit::real_model]
fn a_request_without_a_seed_samples_afresh() {
    let (srv, _) = server(1);
    let mut chat_b = chat(None, SEED, 1.0, false);
    let same = texts(
        &srv,
        "/v1/chat/completions",
        &[chat_b.clone(), chat_b.clone()],
    );
    assert_eq!(same[0], same[1], "a seeded request is reproducible");
    chat_b.as_object_mut().unwrap().remove("seed");
    let cases = [
        ("/v1/chat/completions", chat_b),
        (
            "/v1/completions",
            json!({"model": ID, "prompt": "Once upon a time", "max_tokens": 20}),
        ),
        (
            "/v1/messages",
            json!({"model": ID, "max_tokens": 20,
                   "messages": [{"role": "user", "content": "Write a short poem about the sea."}]}),
        ),
    ];
    for (path, body) in cases {
        let t = texts(&srv, path, &[body.clone(), body.clone(), body.clone()]);
        // Three samples of 20 tokens at temperature 1: alike only if the seed repeats.
        assert!(t[0] != t[1] || t[1] != t[2], "{path}: {t:?}");
    }
    let resp = json!({"model": ID, "input": "Write a short poem about the sea.",
                      "max_output_tokens": 20});
    let t: Vec<String> = (0..3)
        .map(|_| {
            let v = ok(post(srv.addr, "/v1/responses", &resp));
            v["output"][0]["content"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(t[0] != t[1] || t[1] != t[2], "/v1/responses: {t:?}");
}

/// With the server's seed fixed (`fak serve --seed`), a request without a seed samples
/// with it: the same reply, token for token and logprob for logprob, as the request
/// carrying that seed, and the same each time on Anthropic Messages (which has no
/// `seed`).
#[fak_testkit::real_model]
fn the_servers_seed_is_the_seed_of_requests_without_one() {
    let gw = GatewayConfig {
        default_seed: Some(SEED),
        ..GatewayConfig::default()
    };
    let (srv, _) = server_with(1, gw);
    let seeded = chat(None, SEED, 1.0, false);
    let mut unseeded = seeded.clone();
    unseeded.as_object_mut().unwrap().remove("seed");
    let a = ok(post(srv.addr, "/v1/chat/completions", &seeded));
    let b = ok(post(srv.addr, "/v1/chat/completions", &unseeded));
    assert_eq!(choices(&a), choices(&b));
    let mut other = seeded.clone();
    other["seed"] = json!(SEED + 1);
    let c = ok(post(srv.addr, "/v1/chat/completions", &other));
    assert_ne!(choices(&a), choices(&c), "a request's own seed wins");
    let msg = json!({"model": ID, "max_tokens": 20,
                     "messages": [{"role": "user", "content": "Write a short poem about the sea."}]});
    let t = texts(&srv, "/v1/messages", &[msg.clone(), msg]);
    assert_eq!(t[0], t[1]);
}
