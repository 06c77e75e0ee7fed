//! Constrained against unconstrained decode on the same prompts (greedy), on the native
//! and the exact weight paths:
//!
//! - decode tokens/s of `generate_text` unconstrained, constrained by a JSON schema (its
//!   steps with few allowed tokens computing only those rows of the output head), and
//!   constrained with the full head every step (stepped here: full logits, the mask,
//!   the greedy choice), medians over prompts and runs;
//! - the mask's time per token (llguidance's allowed set and the masked copy), median
//!   and p99 over every step of the constrained replies;
//! - one decode step with a small mask (the reply's first step after `{`) with the
//!   allowed rows only against the full head: median times and the speedup.
//!
//! A rough figure: quote it with the machine's load.
//!
//! `cargo run --release -p fak-kv --example grammar_bench -- MODEL.gguf [RUNS]`

use fak_kv::grammar::mask_logits;
use fak_kv::{generate_text, Grammar, GrammarCompiler, GrammarSpec, Session, TextParams};
use fak_model::{Message, Model, WeightMode};
use std::sync::Arc;
use std::time::Instant;

const PROMPTS: [&str; 4] = [
    "Give a JSON object describing a planet: its name, size and number of moons.",
    "Describe a famous scientist as JSON: name, field and age when they died.",
    "Return JSON for a book you like: title, author and year.",
    "Write a JSON record of a city: its name, country and population.",
];

fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "kind": {"enum": ["planet", "person", "book", "city", "other"]},
            "number": {"type": "integer"},
            "facts": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3}
        },
        "required": ["name", "kind", "number", "facts"],
        "additionalProperties": false
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The full-head constrained reply: decode steps/s, and each step's mask time (us).
fn full_head_reply(
    model: &Arc<Model>,
    ids: &[u32],
    grammar: &Grammar,
    stop_ids: &[u32],
    max_tokens: usize,
    mask_us: &mut Vec<f64>,
) -> f64 {
    let mut s = Session::new(Arc::clone(model));
    s.prefill(ids).expect("prefill");
    let mut c = grammar.start();
    let mut masked = Vec::new();
    let (mut steps, mut decode_s) = (0usize, 0f64);
    for _ in 0..max_tokens {
        let t0 = Instant::now();
        let allowed = c.allowed(stop_ids).expect("allowed");
        if allowed.count() == 0 {
            break;
        }
        mask_logits(s.last_logits().expect("logits"), allowed, &mut masked);
        mask_us.push(t0.elapsed().as_secs_f64() * 1e6);
        let next = fak_model::argmax(&masked);
        if stop_ids.contains(&next) {
            break;
        }
        c.accept(next).expect("accept");
        let t0 = Instant::now();
        s.decode(next).expect("decode");
        decode_s += t0.elapsed().as_secs_f64();
        steps += 1;
    }
    steps as f64 / decode_s
}

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: grammar_bench MODEL.gguf [RUNS]");
        std::process::exit(2);
    };
    let runs: usize = args.next().and_then(|r| r.parse().ok()).unwrap_or(3);
    let path = std::path::PathBuf::from(path);
    for mode in [WeightMode::Native, WeightMode::Exact] {
        let model = Arc::new(Model::load_with(&path, mode).expect("model"));
        let (tok, tmpl) = fak_model::load_text(&path, model.config()).expect("tokenizer");
        let t0 = Instant::now();
        let compiler = GrammarCompiler::new(&tok, model.config().vocab_size).expect("trie");
        println!(
            "{}: token trie {:.0} ms",
            mode.name(),
            t0.elapsed().as_secs_f64() * 1e3
        );
        let grammar = compiler
            .compile(&GrammarSpec::json_schema(schema()))
            .expect("grammar");
        let stop_ids = tmpl.stop_token_ids(&tok);
        let max_tokens = 96;
        let (mut free, mut rows, mut full) = (Vec::new(), Vec::new(), Vec::new());
        let mut mask_us = Vec::new();
        let (mut head_rows_steps, mut steps) = (0, 0);
        for prompt in PROMPTS {
            let msgs = [Message::new("user", prompt)];
            let ids = tok
                .encode_with_special(&tmpl.render(&msgs, true, None).expect("template"))
                .expect("encode");
            for _ in 0..runs {
                for constrained in [false, true] {
                    let params = TextParams {
                        sampling: Default::default(),
                        max_tokens,
                        stop: vec![],
                        stop_ids: stop_ids.clone(),
                        logprobs: None,
                        grammar: constrained.then(|| grammar.clone()),
                    };
                    let mut s = Session::new(Arc::clone(&model));
                    let out =
                        generate_text(&mut s, &tok, &ids, &params, None, &mut |_| {}).expect("gen");
                    let tps = out.decode_steps as f64 / out.decode_s;
                    if constrained {
                        rows.push(tps);
                        head_rows_steps += out.head_rows_steps;
                        steps += out.decode_steps;
                    } else {
                        free.push(tps);
                    }
                }
                full.push(full_head_reply(
                    &model,
                    &ids,
                    &grammar,
                    &stop_ids,
                    max_tokens,
                    &mut mask_us,
                ));
            }
        }
        let (f, r, u) = (median(&mut free), median(&mut rows), median(&mut full));
        println!(
            "{}: decode tokens/s, medians of {} replies: unconstrained {f:.1}, constrained \
             {r:.1} ({:.3}x; {head_rows_steps} of {steps} steps over the allowed rows), \
             constrained with the full head {u:.1} ({:.3}x)",
            mode.name(),
            free.len(),
            r / f,
            u / f
        );
        println!(
            "{}: mask per token over {} steps: median {:.0} us, p99 {:.0} us",
            mode.name(),
            mask_us.len(),
            median(&mut mask_us),
            pct(&mut mask_us, 0.99)
        );

        // One step with a small mask: after `{`, the grammar allows only the key's
        // opening quote.
        let msgs = [Message::new("user", PROMPTS[0])];
        let ids = tok
            .encode_with_special(&tmpl.render(&msgs, true, None).expect("template"))
            .expect("encode");
        let mut s = Session::new(Arc::clone(&model));
        s.prefill(&ids).expect("prefill");
        let mut c = grammar.start();
        let mut masked = Vec::new();
        mask_logits(
            s.last_logits().expect("logits"),
            c.allowed(&stop_ids).expect("allowed"),
            &mut masked,
        );
        let first = fak_model::argmax(&masked);
        c.accept(first).expect("accept");
        let allowed = c.allowed(&stop_ids).expect("allowed").ids();
        let (mut t_rows, mut t_full) = (Vec::new(), Vec::new());
        for _ in 0..31 {
            let mut a = s.clone();
            let t0 = Instant::now();
            a.decode_rows(first, &allowed).expect("decode_rows");
            t_rows.push(t0.elapsed().as_secs_f64() * 1e3);
            let mut b = s.clone();
            let t0 = Instant::now();
            b.decode(first).expect("decode");
            t_full.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let (a, b) = (median(&mut t_rows), median(&mut t_full));
        println!(
            "{}: a step allowing {} of {} tokens: {a:.2} ms over the allowed rows, {b:.2} ms \
             with the full head ({:.2}x faster)",
            mode.name(),
            allowed.len(),
            model.config().vocab_size,
            b / a
        );
    }
}
