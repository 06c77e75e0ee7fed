//! Sessions on the real default model, SmolLM2-135M-Instruct: text generation at the
//! context end, chat turns that prefill only their new tokens, stop strings across tokens,
//! seeded sampling. (The proof ladder on this model is fak-prove's `tests/real_smollm2.rs`.)
//! Without the model file these fail with the fetch command (`FAK_SKIP_REAL_MODEL=1`
//! reports them as ignored, never in CI).

use fak_model::Model;
use std::path::PathBuf;

fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"))
}

/// Text generation that reaches the end of the context stops as `length` and keeps its
/// text (the tiny model's context of 256 tokens, with the real model's tokenizer).
#[fak_testkit::real_model]
fn text_generation_stops_at_the_context_end() {
    use fak_kv::{generate_text, FinishReason, Session, TextParams};
    use std::sync::Arc;
    let path = smollm2_path();
    let g = fak_weights::GgufFile::open(&path).unwrap();
    let tok = fak_model::Tokenizer::from_gguf(&g).unwrap();
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tiny/llama-tied");
    let m = Arc::new(Model::load(&tiny).unwrap());
    let mut s = Session::new(m);
    let params = TextParams {
        sampling: Default::default(),
        max_tokens: 100,
        stop: vec![],
        stop_ids: vec![],
        logprobs: None,
        grammar: None,
    };
    let out = generate_text(&mut s, &tok, &[40; 250], &params, None, &mut |_| {}).unwrap();
    assert_eq!(out.finish_reason, FinishReason::Length);
    assert_eq!(
        out.completion_ids.len(),
        7,
        "250 prompt + 6 run + 1 sampled"
    );
    assert_eq!(s.len(), 256);
    assert!(!out.text.is_empty());
}

/// Multi-turn: across 3 turns each turn prefills exactly the tokens its rendering adds
/// past the cache, and its output equals a from-scratch run of the same conversation.
#[fak_testkit::real_model]
fn chat_turns_prefill_only_new_tokens_and_equal_from_scratch() {
    use fak_kv::{generate_text, ChatSession, Session, TextParams};
    use std::sync::Arc;
    let path = smollm2_path();
    let model = Arc::new(Model::load(&path).unwrap());
    let (tok, tmpl) = fak_model::load_text(&path, model.config()).unwrap();
    let params = TextParams {
        sampling: Default::default(),
        max_tokens: 40,
        stop: vec![],
        stop_ids: tmpl.stop_token_ids(&tok),
        logprobs: None,
        grammar: None,
    };
    let (tok, tmpl) = (Arc::new(tok), Arc::new(tmpl));
    let mut chat = ChatSession::new(
        Arc::clone(&model),
        Arc::clone(&tok),
        Arc::clone(&tmpl),
        None,
    );
    let mut prev_cache = 0;
    for (k, q) in [
        "What is the capital of France?",
        "And of Germany?",
        "Name three colors.",
    ]
    .iter()
    .enumerate()
    {
        let stats = chat.turn(q, &params, None, &mut |_| {}).unwrap();
        // The conversation as rendered for this turn (before the reply was appended).
        let history = &chat.messages()[..chat.messages().len() - 1];
        let full = tmpl.encode(&tok, history, true, None).unwrap();
        assert_eq!(stats.reused + stats.prefilled, full.len(), "turn {k}");
        assert_eq!(
            stats.reused, prev_cache,
            "turn {k}: the whole cache is reused"
        );
        assert_eq!(stats.evicted, 0);
        prev_cache = stats.cache_len;
        // From scratch: a fresh session on the full rendering.
        let mut fresh = Session::new(Arc::clone(&model));
        let out = generate_text(&mut fresh, &tok, &full, &params, None, &mut |_| {}).unwrap();
        assert_eq!(out.completion_ids, stats.output.completion_ids, "turn {k}");
        assert_eq!(out.text, stats.output.text);
        assert!(stats.prefilled < full.len() || k == 0);
    }
}

/// A stop string that spans several tokens is never shown in part: the streamed pieces
/// stop before it.
#[fak_testkit::real_model]
fn stop_string_across_tokens_is_held_back() {
    use fak_kv::{generate_text, FinishReason, Session, TextParams};
    use std::sync::Arc;
    let path = smollm2_path();
    let model = Arc::new(Model::load(&path).unwrap());
    let (tok, tmpl) = fak_model::load_text(&path, model.config()).unwrap();
    let ids = tmpl
        .encode(
            &tok,
            &[fak_model::Message::new(
                "user",
                "What is the capital of France?",
            )],
            true,
            None,
        )
        .unwrap();
    let params = TextParams {
        sampling: Default::default(),
        max_tokens: 40,
        stop: vec!["France is Pa".into()],
        stop_ids: tmpl.stop_token_ids(&tok),
        logprobs: None,
        grammar: None,
    };
    let mut pieces = Vec::new();
    let out = generate_text(
        &mut Session::new(model),
        &tok,
        &ids,
        &params,
        None,
        &mut |p| pieces.push(p.to_string()),
    )
    .unwrap();
    assert_eq!(out.finish_reason, FinishReason::Stop);
    assert_eq!(out.text, "The capital of ");
    assert_eq!(pieces.concat(), "The capital of ");
    assert!(pieces.iter().all(|p| !p.contains("France")), "{pieces:?}");
    // The stop string really spans tokens: "France", " is", " Paris" are separate.
    assert!(out.completion_ids.len() >= 6);
}

/// Sampling on the real model: the same seed gives the same text, another seed (at a
/// high temperature) other text.
#[fak_testkit::real_model]
fn same_seed_same_text() {
    use fak_kv::{generate_text, SamplingParams, Session, TextParams};
    use std::sync::Arc;
    let path = smollm2_path();
    let model = Arc::new(Model::load(&path).unwrap());
    let (tok, tmpl) = fak_model::load_text(&path, model.config()).unwrap();
    let ids = tmpl
        .encode(
            &tok,
            &[fak_model::Message::new("user", "Tell me a story.")],
            true,
            None,
        )
        .unwrap();
    let run = |seed| {
        let params = TextParams {
            sampling: SamplingParams {
                temperature: 1.2,
                top_p: 0.95,
                seed,
                ..Default::default()
            },
            max_tokens: 24,
            stop: vec![],
            stop_ids: vec![],
            logprobs: None,
            grammar: None,
        };
        generate_text(
            &mut Session::new(Arc::clone(&model)),
            &tok,
            &ids,
            &params,
            None,
            &mut |_| {},
        )
        .unwrap()
        .text
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}
