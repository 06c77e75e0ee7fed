//! The reachable-rows output head on the real SmolLM2-135M-Instruct
//! (`Session::decode_rows`, `fak_model::Model::forward_rows_into`): the rows it computes
//! are the full head's rows bit for bit and every other row is `-inf`; a constrained
//! greedy reply through `generate_text`, whose steps with few allowed tokens compute
//! only those rows, chooses the same tokens and leaves the same KV cache bytes as the
//! same reply stepped with the full head and the mask. On the exact and the native
//! (quantized) weight paths.
//!
//! Without the model file this fails with the fetch command (`FAK_SKIP_REAL_MODEL=1`
//! reports them as ignored, never in CI).

mod common;

use common::{load, prompt_ids};
use fak_kv::grammar::mask_logits;
use fak_kv::{generate_text, FinishReason, GrammarCompiler, GrammarSpec, Session, TextParams};
use fak_model::WeightMode;
use std::sync::Arc;

/// Every K, pre-RoPE K and V value of the two sessions' caches, bit for bit.
fn assert_same_cache(a: &Session, b: &Session, what: &str) {
    let (a, b) = (a.cache(), b.cache());
    assert_eq!(a.len(), b.len(), "{what}: cache lengths");
    assert_eq!(a.positions(), b.positions(), "{what}: positions");
    for layer in 0..a.n_layers() {
        for (x, y) in [
            (&a.k(layer).to_vec(), &b.k(layer).to_vec()),
            (&a.k_raw(layer).to_vec(), &b.k_raw(layer).to_vec()),
            (&a.v(layer).to_vec(), &b.v(layer).to_vec()),
        ] {
            assert_eq!(x.len(), y.len());
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{what}: layer {layer}: cache differs"
            );
        }
    }
}

/// Row sets of several sizes and shapes: one row, the ends of the vocabulary, a
/// scattered spread, a contiguous run, and rows given out of order and twice.
fn row_sets(vocab: u32) -> Vec<Vec<u32>> {
    let mut spread: Vec<u32> = (0..vocab).step_by(97).collect();
    spread.push(vocab - 1);
    vec![
        vec![17],
        vec![0, vocab - 1],
        spread,
        (1000..1517).collect(),
        vec![vocab - 1, 5, 40_000, 5, 123],
    ]
}

/// Steps a session with the full head and a copy with each row set, over several
/// tokens: the subset's rows are the full logits' bits, the rest `-inf`, and the
/// caches stay equal.
fn subset_rows_are_full_rows_on(mode: WeightMode) {
    let (model, tok, tmpl) = load(mode);
    let vocab = model.config().vocab_size as u32;
    let ids = prompt_ids(&tok, &tmpl, "Name three colours.");
    let mut full = Session::new(Arc::clone(&model));
    full.prefill(&ids).unwrap();
    let mut compared = 0usize;
    for (step, next) in [28u32, 1530, 314, 0, 48_000].into_iter().enumerate() {
        for rows in row_sets(vocab) {
            let mut part = full.clone();
            let got = part.decode_rows(next, &rows).unwrap().to_vec();
            let mut whole = full.clone();
            let want = whole.decode(next).unwrap().to_vec();
            assert_eq!(got.len(), want.len());
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                if rows.contains(&(i as u32)) {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{mode:?} step {step}: row {i} {g} against the full head's {w}"
                    );
                    compared += 1;
                } else {
                    assert_eq!(g, f32::NEG_INFINITY, "{mode:?} step {step}: row {i}");
                }
            }
            assert_same_cache(&part, &whole, "decode_rows against decode");
        }
        full.decode(next).unwrap();
    }
    assert!(compared > 5 * 1000, "{compared} rows compared");
    // A row outside the vocabulary is an error that leaves the session as it was.
    let before = full.clone();
    let err = full.decode_rows(28, &[3, vocab]).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    assert_same_cache(&full, &before, "after a refused row");
}

#[fak_testkit::real_model]
fn head_rows_are_the_full_heads_rows_exact_path() {
    subset_rows_are_full_rows_on(WeightMode::Exact);
}

#[fak_testkit::real_model]
fn head_rows_are_the_full_heads_rows_native_path() {
    subset_rows_are_full_rows_on(WeightMode::Native);
}

fn person_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "field": {"enum": ["physics", "chemistry", "biology", "mathematics"]}
        },
        "required": ["name", "age", "field"],
        "additionalProperties": false
    })
}

/// A constrained greedy reply through `generate_text` (which computes only the allowed
/// rows where few are allowed) against the same reply stepped here with the full head,
/// the mask and the greedy choice: the same tokens, the same cache.
fn constrained_reply_same_as_full_head_on(mode: WeightMode) {
    let (model, tok, tmpl) = load(mode);
    let vocab = model.config().vocab_size;
    let compiler = GrammarCompiler::new(&tok, vocab).unwrap();
    let grammar = compiler
        .compile(&GrammarSpec::json_schema(person_schema()))
        .unwrap();
    let stop_ids = tmpl.stop_token_ids(&tok);
    let ids = prompt_ids(
        &tok,
        &tmpl,
        "Tell me about a famous scientist: their name, field and age when they died.",
    );
    let params = TextParams {
        sampling: Default::default(),
        max_tokens: 64,
        stop: vec![],
        stop_ids: stop_ids.clone(),
        logprobs: None,
        grammar: Some(grammar.clone()),
    };
    let mut fast = Session::new(Arc::clone(&model));
    let out = generate_text(&mut fast, &tok, &ids, &params, None, &mut |_| {}).unwrap();
    println!(
        "{mode:?}: {:?} ({:?}), {} of {} steps over the allowed rows",
        out.text, out.finish_reason, out.head_rows_steps, out.decode_steps
    );
    assert_eq!(out.finish_reason, FinishReason::Stop, "{:?}", out.text);
    // The path under test ran: most steps of a JSON reply allow few tokens.
    assert!(
        out.head_rows_steps * 2 > out.decode_steps,
        "{} of {} steps used the allowed rows",
        out.head_rows_steps,
        out.decode_steps
    );

    // The reference: full head every step, the mask over it, the greedy choice.
    let mut plain = Session::new(Arc::clone(&model));
    plain.prefill(&ids).unwrap();
    let mut c = grammar.start();
    let mut masked = Vec::new();
    let mut chosen = Vec::new();
    while chosen.len() < params.max_tokens {
        let allowed = c.allowed(&stop_ids).unwrap();
        mask_logits(plain.last_logits().unwrap(), allowed, &mut masked);
        let next = fak_model::argmax(&masked);
        chosen.push(next);
        if stop_ids.contains(&next) {
            break;
        }
        c.accept(next).unwrap();
        plain.decode(next).unwrap();
    }
    assert_eq!(out.completion_ids, chosen, "{mode:?}: tokens");
    assert_same_cache(&fast, &plain, "constrained reply");
}

#[fak_testkit::real_model]
fn constrained_reply_with_head_rows_matches_the_full_head_exact_path() {
    constrained_reply_same_as_full_head_on(WeightMode::Exact);
}

#[fak_testkit::real_model]
fn constrained_reply_with_head_rows_matches_the_full_head_native_path() {
    constrained_reply_same_as_full_head_on(WeightMode::Native);
}
