//! KV reuse benchmark: the time to first token (TTFT) of each turn of a scripted 10-turn
//! conversation on the real default model, with the in-kernel driver's reuse cache (warm:
//! only the new turn is prefilled) and without it (cold: the whole conversation is
//! prefilled again), alternating the two on the same machine; prints medians over
//! `--repeats` runs and their ratio. Checks on the way that warm and cold give the same
//! tokens.
//!
//! `cargo run --release -p fak-engine --example kv_reuse_bench [-- --repeats 3]`

use fak_engine::inkernel::InKernelDriver;
use fak_engine::{EngineConfig, EngineDriver, GenerateRequest, Message};
use std::sync::Arc;

const USERS: [&str; 10] = [
    "What is the capital of France?",
    "And of Germany?",
    "Name one river in that country.",
    "How long is it?",
    "Which sea does it flow into?",
    "Name a city on its banks.",
    "What is that city known for?",
    "Give me one word for water.",
    "Translate it to French.",
    "Thanks! Say goodbye.",
];

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let repeats = args
        .iter()
        .position(|a| a == "--repeats")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(3usize)
        .max(1);
    let path = match fak_catalog::require_cached("smollm2-135m-instruct") {
        Ok(p) => p,
        Err(m) => {
            eprintln!("{m}");
            std::process::exit(1);
        }
    };
    let model = Arc::new(fak_model::Model::load(&path).expect("load the model"));
    let driver = |budget: usize| {
        let (tok, tmpl) = fak_model::load_text(&path, model.config()).expect("tokenizer");
        let cfg = EngineConfig {
            kv_budget_bytes: budget,
            ..EngineConfig::default()
        };
        InKernelDriver::from_loaded(Arc::clone(&model), tok, tmpl, "smollm2-135m-instruct", cfg)
    };
    let (warm_d, cold_d) = (driver(256 << 20), driver(0));
    // ttft[turn] = (warm samples, cold samples), seconds
    let mut ttft: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); USERS.len()];
    let mut prompt_tokens = vec![0usize; USERS.len()];
    let mut cached = vec![0usize; USERS.len()];
    for _ in 0..repeats {
        warm_d.clear_kv_cache();
        let mut history: Vec<Message> = Vec::new();
        for (k, u) in USERS.iter().enumerate() {
            history.push(Message::new("user", u));
            let mut req = GenerateRequest::chat(history.clone());
            req.max_tokens = Some(32);
            let warm = warm_d
                .submit(req.clone())
                .expect("submit")
                .blocking_collect()
                .expect("warm");
            let cold = cold_d
                .submit(req)
                .expect("submit")
                .blocking_collect()
                .expect("cold");
            let (wd, cd) = (warm.done.expect("done"), cold.done.expect("done"));
            assert_eq!(
                wd.completion_ids,
                cd.completion_ids,
                "turn {}: warm and cold differ",
                k + 1
            );
            ttft[k].0.push(wd.ttft_s);
            ttft[k].1.push(cd.ttft_s);
            prompt_tokens[k] = warm.prompt_tokens;
            cached[k] = warm.cached_tokens;
            history.push(Message::new("assistant", &warm.text));
        }
    }
    println!(
        "KV reuse, SmolLM2-135M-Instruct, {} threads, median of {repeats} runs",
        model.threads().get()
    );
    println!("turn  prompt  cached   TTFT warm ms   TTFT cold ms   cold/warm");
    let mut ratios = Vec::new();
    for (k, (w, c)) in ttft.iter_mut().enumerate() {
        let (mw, mc) = (median(w), median(c));
        if k > 0 {
            ratios.push(mc / mw);
        }
        println!(
            "{:>4}  {:>6}  {:>6}   {:>12.1}   {:>12.1}   {:>9.2}",
            k + 1,
            prompt_tokens[k],
            cached[k],
            mw * 1e3,
            mc * 1e3,
            mc / mw
        );
    }
    println!(
        "median cold/warm TTFT ratio over turns 2-10: {:.2}",
        median(&mut ratios)
    );
}
