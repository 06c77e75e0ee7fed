//! Decode tokens/s with and without a grammar on the same prompt (greedy, native
//! weights), and what the mask costs per token. A rough figure: run it on an idle
//! machine for numbers to quote.
//!
//! `cargo run --release -p fak-kv --example grammar_bench -- MODEL.gguf [RUNS]`

use fak_kv::grammar::mask_logits;
use fak_kv::{generate_text, GrammarCompiler, GrammarSpec, Session, TextParams};
use fak_model::{Message, Model, WeightMode};
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: grammar_bench MODEL.gguf [RUNS]");
        std::process::exit(2);
    };
    let runs: usize = args.next().and_then(|r| r.parse().ok()).unwrap_or(3);
    let path = std::path::PathBuf::from(path);
    let model = Arc::new(Model::load_with(&path, WeightMode::Native).expect("model"));
    let (tok, tmpl) = fak_model::load_text(&path, model.config()).expect("tokenizer");
    let t0 = Instant::now();
    let compiler = GrammarCompiler::new(&tok, model.config().vocab_size).expect("trie");
    println!("token trie: {:.0} ms", t0.elapsed().as_secs_f64() * 1e3);
    let grammar = compiler.compile(&GrammarSpec::JsonObject).expect("grammar");
    let msgs = [Message::new(
        "user",
        "Give a JSON object describing three planets, with their names, sizes and moons.",
    )];
    let ids = tok
        .encode_with_special(&tmpl.render(&msgs, true, None).expect("template"))
        .expect("encode");
    let stop_ids = tmpl.stop_token_ids(&tok);
    for run in 0..runs {
        for constrained in [false, true] {
            let params = TextParams {
                sampling: Default::default(),
                max_tokens: 128,
                stop: vec![],
                stop_ids: stop_ids.clone(),
                logprobs: None,
                grammar: constrained.then(|| grammar.clone()),
            };
            let mut s = Session::new(Arc::clone(&model));
            let out = generate_text(&mut s, &tok, &ids, &params, None, &mut |_| {}).expect("gen");
            println!(
                "run {run} {:<13} {:>4} steps  {:6.1} tokens/s  ({:?})",
                if constrained {
                    "constrained"
                } else {
                    "unconstrained"
                },
                out.decode_steps,
                out.decode_steps as f64 / out.decode_s,
                out.finish_reason
            );
        }
    }
    // The mask alone, per token, replayed over one constrained reply's tokens.
    let params = TextParams {
        sampling: Default::default(),
        max_tokens: 128,
        stop: vec![],
        stop_ids: stop_ids.clone(),
        logprobs: None,
        grammar: Some(grammar.clone()),
    };
    let mut s = Session::new(Arc::clone(&model));
    let out = generate_text(&mut s, &tok, &ids, &params, None, &mut |_| {}).expect("gen");
    let logits = vec![0.0f32; model.config().vocab_size];
    let mut masked = Vec::new();
    let mut times = Vec::new();
    let mut c = grammar.start();
    for &t in &out.completion_ids {
        let t0 = Instant::now();
        let allowed = c.allowed(&stop_ids).expect("allowed");
        mask_logits(&logits, allowed, &mut masked);
        times.push(t0.elapsed().as_secs_f64() * 1e6);
        if stop_ids.contains(&t) {
            break;
        }
        c.accept(t).expect("accept");
    }
    times.sort_by(f64::total_cmp);
    let pct = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize];
    println!(
        "mask per token over {} steps: median {:.0} us, p99 {:.0} us",
        times.len(),
        pct(0.5),
        pct(0.99)
    );
}
