//! Continuous batching through sessions ([`fak_kv::Batcher`]): 16 sessions, each on its
//! own thread and attached to one batcher, prefill prompts of different lengths (in
//! pieces across passes), decode, evict a span mid-run, and generate text with their
//! own sampling settings; each one's logits at every step, final cache and text are
//! bit-identical to the same session run alone, and the batcher did run them together
//! (its passes held more than one sequence). The solo runs are the witness:
//! `tests/tiny.rs` and fak-model's `tiny_oracle.rs` tie them to HF.

use fak_kv::{generate_text, BatchPolicy, Batcher, KvCache, Session, TextParams};
use fak_model::{KvStore, Model, WeightMode};
use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::Duration;

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn same_cache(a: &KvCache, b: &KvCache, layers: usize) -> bool {
    a.positions() == b.positions()
        && (0..layers).all(|l| {
            same_bits(&a.keys(l).to_vec(), &b.keys(l).to_vec())
                && same_bits(&a.values(l).to_vec(), &b.values(l).to_vec())
        })
}

/// Sequence `i`'s tokens over a vocabulary of `vocab`: a prompt of 1 to 40 tokens, then
/// 4 to 8 decode tokens.
fn tokens(i: usize, vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let mut seed = 0x9e37_79b9_u64 ^ (i as u64 * 0x1000_0193);
    let mut next = move || {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((seed >> 33) % vocab as u64) as u32
    };
    let prompt = (0..1 + (i * 13) % 40).map(|_| next()).collect();
    let decode = (0..4 + i % 5).map(|_| next()).collect();
    (prompt, decode)
}

/// What sequence `i` does: prefill its prompt, decode its tokens (sequence 3 evicts
/// two entries after its second step and prefills the next token instead), recording
/// every step's logits.
fn script(s: &mut Session, i: usize, vocab: usize) -> Vec<Vec<f32>> {
    let (prompt, decode) = tokens(i, vocab);
    let mut out = vec![s.prefill(&prompt).unwrap()];
    for (k, &id) in decode.iter().enumerate() {
        if i % 8 == 3 && k == 2 && s.len() > 3 {
            s.evict(1, 2).unwrap();
            out.push(s.prefill(&[id]).unwrap());
        } else {
            out.push(s.decode(id).unwrap().to_vec());
        }
    }
    out
}

/// A policy that waits long enough for every thread to arrive, with small passes, so
/// that prompts run in several pieces beside decode tokens.
fn test_policy() -> BatchPolicy {
    BatchPolicy {
        max_rows: 12,
        min_prefill_rows: 5,
        gather: Duration::from_millis(200),
        max_prefill_rows: 256,
    }
}

fn assert_sessions_batch_invariant(m: Model, label: &str) {
    let m = Arc::new(m);
    let vocab = m.config().vocab_size;
    let layers = m.config().num_hidden_layers;
    let n = 16;
    let solo: Vec<(Vec<Vec<f32>>, Session)> = (0..n)
        .map(|i| {
            let mut s = Session::new(Arc::clone(&m));
            (script(&mut s, i, vocab), s)
        })
        .collect();
    let batcher = Batcher::new(Arc::clone(&m), test_policy()).unwrap();
    let start = Arc::new(Barrier::new(n));
    let batched: Vec<(Vec<Vec<f32>>, Session)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let (m, b, start) = (Arc::clone(&m), batcher.clone(), Arc::clone(&start));
                scope.spawn(move || {
                    let mut s = Session::new(m);
                    s.attach(&b).unwrap();
                    start.wait();
                    let out = script(&mut s, i, vocab);
                    s.detach();
                    (out, s)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, ((w, ws), (g, gs))) in solo.iter().zip(&batched).enumerate() {
        assert_eq!(w.len(), g.len(), "{label}: sequence {i}'s steps");
        for (k, (a, b)) in w.iter().zip(g).enumerate() {
            assert!(
                same_bits(a, b),
                "{label}: sequence {i}, step {k}: logits differ from the solo run"
            );
        }
        assert!(
            same_cache(ws.cache(), gs.cache(), layers),
            "{label}: sequence {i}'s cache differs from the solo run"
        );
        assert!(!gs.is_attached());
    }
    let st = batcher.stats();
    println!("{label}: {st:?}");
    assert!(
        st.max_sequences > 1,
        "{label}: no pass held two sequences: {st:?}"
    );
    assert!(st.sequences > st.passes, "{label}: {st:?}");
    assert_eq!(st.attached, 0);
}

#[test]
fn sixteen_batched_sessions_equal_their_solo_runs_on_tiny_models() {
    for family in ["llama-tied", "gemma3", "qwen3", "phi3"] {
        let m = Model::load(&testdata().join("tiny").join(family)).unwrap();
        assert_sessions_batch_invariant(m, family);
    }
}

/// The control: the comparison sees a sequence that ran differently (sequence 5's
/// script run with sequence 6's prompt).
#[test]
fn a_different_run_is_seen() {
    let m = Arc::new(Model::load(&testdata().join("tiny").join("llama-tied")).unwrap());
    let v = m.config().vocab_size;
    let a = script(&mut Session::new(Arc::clone(&m)), 5, v);
    let mut s = Session::new(Arc::clone(&m));
    s.prefill(&tokens(6, v).0).unwrap();
    let b = script(&mut s, 5, v);
    assert!(!same_bits(&a[0], &b[0]));
}

/// A session attached to a batcher of another model is refused.
#[test]
fn a_batcher_of_another_model_is_refused() {
    let a = Arc::new(Model::load(&testdata().join("tiny").join("llama-tied")).unwrap());
    let b = Arc::new(Model::load(&testdata().join("tiny").join("llama-tied")).unwrap());
    let batcher = Batcher::new(a, BatchPolicy::default()).unwrap();
    let mut s = Session::new(b);
    assert!(matches!(
        s.attach(&batcher),
        Err(fak_kv::SessionError::ModelMismatch)
    ));
    assert!(!s.is_attached());
}

fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"))
}

#[fak_testkit::real_model]
fn batched_sessions_equal_solo_runs_on_smollm2_native() {
    let m = Model::load_with(&smollm2_path(), WeightMode::Native).unwrap();
    assert_sessions_batch_invariant(m, "SmolLM2 native");
}

/// Text generation with each session's own sampling settings (greedy, temperature with
/// top-k, top-p, min-p, a repetition penalty; each its own seed) gives the same tokens
/// and text batched as alone.
#[fak_testkit::real_model]
fn batched_text_generation_equals_solo_with_each_sessions_sampling() {
    let path = smollm2_path();
    let g = fak_weights::GgufFile::open(&path).unwrap();
    let tok = fak_model::Tokenizer::from_gguf(&g).unwrap();
    let m = Arc::new(Model::load_with(&path, WeightMode::Native).unwrap());
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived a",
        "List three colors:",
        "1, 2, 3, 4,",
        "The quick brown fox",
        "Water boils at",
        "In 1969, the first",
    ];
    let params: Vec<TextParams> = (0..prompts.len())
        .map(|i| {
            let mut p = TextParams {
                sampling: Default::default(),
                max_tokens: 12 + 3 * i,
                stop: Vec::new(),
                stop_ids: m.config().eos_token_ids.clone(),
                logprobs: None,
                grammar: None,
            };
            let s = &mut p.sampling;
            s.seed = 1000 + i as u64;
            match i % 4 {
                0 => {}
                1 => (s.temperature, s.top_k) = (0.8, 40),
                2 => (s.temperature, s.top_p) = (1.0, 0.9),
                _ => (s.temperature, s.min_p, s.repetition_penalty) = (0.7, 0.05, 1.1),
            }
            p
        })
        .collect();
    let run = |i: usize, s: &mut Session| {
        let ids = tok.encode(prompts[i]).unwrap();
        generate_text(s, &tok, &ids, &params[i], None, &mut |_| {}).unwrap()
    };
    let solo: Vec<_> = (0..prompts.len())
        .map(|i| run(i, &mut Session::new(Arc::clone(&m))))
        .collect();
    let batcher = Batcher::new(Arc::clone(&m), test_policy()).unwrap();
    let start = Barrier::new(prompts.len());
    let batched: Vec<_> = std::thread::scope(|scope| {
        let hs: Vec<_> = (0..prompts.len())
            .map(|i| {
                let (m, b, start, run) = (Arc::clone(&m), batcher.clone(), &start, &run);
                scope.spawn(move || {
                    let mut s = Session::new(m);
                    s.attach(&b).unwrap();
                    start.wait();
                    run(i, &mut s)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, b)) in solo.iter().zip(&batched).enumerate() {
        assert_eq!(a.completion_ids, b.completion_ids, "prompt {i}");
        assert_eq!(a.text, b.text, "prompt {i}");
    }
    let st = batcher.stats();
    println!("{st:?}");
    assert!(st.max_sequences > 1, "{st:?}");
}

/// A cancelled session's prompt leaves the batcher before its next piece: with another
/// session attached and idle, every pass waits out the gather window, so a 120-token
/// prompt in pieces of at most 4 rows would take 30 passes; the flag is set after the
/// second, the call comes back failed within a pass or two, and the session is rolled
/// back to what it held (so it equals a session that never ran the prompt).
#[test]
fn a_cancelled_prompt_leaves_the_batch_within_a_pass() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let m = Arc::new(Model::load(&testdata().join("tiny").join("llama-tied")).unwrap());
    let vocab = m.config().vocab_size;
    let policy = BatchPolicy {
        max_rows: 4,
        min_prefill_rows: 4,
        gather: Duration::from_millis(30),
        max_prefill_rows: 256,
    };
    let batcher = Batcher::new(Arc::clone(&m), policy).unwrap();
    let mut idle = Session::new(Arc::clone(&m));
    idle.attach(&batcher).unwrap();
    let cancel = Arc::new(AtomicBool::new(false));
    let mut s = Session::new(Arc::clone(&m));
    s.prefill(&tokens(1, vocab).0).unwrap();
    let before = s.cache().clone();
    s.attach_cancellable(&batcher, Arc::clone(&cancel)).unwrap();
    let prompt: Vec<u32> = (0..120).map(|i| (i * 7 % vocab) as u32).collect();
    let ran = std::thread::scope(|scope| {
        scope.spawn(|| {
            while batcher.stats().passes < 2 {
                std::thread::sleep(Duration::from_millis(1));
            }
            cancel.store(true, Ordering::Relaxed);
        });
        s.prefill(&prompt)
    });
    let passes = batcher.stats().passes;
    assert!(ran.is_err(), "the prompt ran to its end");
    assert!(passes < 10, "{passes} passes ran before the call came back");
    assert_eq!(
        s.cache(),
        &before,
        "the cancelled pieces were not rolled back"
    );
    s.detach();
    idle.detach();
    assert_eq!(batcher.stats().attached, 0);
}
