//! The session on the tiny random-init models (testdata/tiny): the window proofs that
//! need an independent reference, the bounded mode, cloning, and bad input. (The whole
//! ladder on these models, with their HF oracles, is fak-prove's `tests/tiny.rs`.)

use fak_kv::{GenerateParams, KvError, Session, SessionError};
use fak_model::{LogitsWanted, Model, WeightSource};
use fak_prove::ladder::cache_max_abs_diff;
use fak_tensor::{matmul_ref, rms_norm, rope_rotate_half, silu, softmax_in_place, RopeTable};
use std::path::PathBuf;
use std::sync::Arc;

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

fn tiny(name: &str) -> Model {
    Model::load(&testdata().join("tiny").join(name)).unwrap()
}

fn bits_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// An independently written forward pass with an explicit attention mask
/// `mask[t][j] = j <= t && pos[j] >= pos[t] - W + 1`, a full recompute over all
/// positions, built only from fak-tensor's reference kernels and the weights by HF name.
fn masked_reference(dir: &std::path::Path, ids: &[u32], window: usize) -> Vec<f32> {
    let (src, c) = WeightSource::open(dir).unwrap();
    let w = |n: &str, shape: &[usize]| src.load(n, shape, &c).unwrap();
    let (h, hd, nh, nkv, ff, v) = (
        c.hidden_size,
        c.head_dim,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
    );
    let (qd, kvd, n) = (nh * hd, nkv * hd, ids.len());
    let embed = w("model.embed_tokens.weight", &[v, h]);
    let mut x: Vec<f32> = ids
        .iter()
        .flat_map(|&i| embed[i as usize * h..(i as usize + 1) * h].to_vec())
        .collect();
    let norm_rows = |x: &[f32], g: &[f32]| {
        let mut o = vec![0f32; x.len()];
        for (o, r) in o.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
            rms_norm(r, g, 0.0, c.rms_norm_eps, o);
        }
        o
    };
    let lin = |wt: &[f32], rows: usize, cols: usize, x: &[f32]| {
        let mut o = vec![0f32; n * rows];
        matmul_ref(wt, rows, cols, x, n, &mut o);
        o
    };
    let rope = RopeTable::new(hd, c.rope_theta[0]);
    for l in 0..c.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let xn = norm_rows(&x, &w(&p("input_layernorm.weight"), &[h]));
        let mut q = lin(&w(&p("self_attn.q_proj.weight"), &[qd, h]), qd, h, &xn);
        let mut k = lin(&w(&p("self_attn.k_proj.weight"), &[kvd, h]), kvd, h, &xn);
        let vv = lin(&w(&p("self_attn.v_proj.weight"), &[kvd, h]), kvd, h, &xn);
        for t in 0..n {
            let (mut cs, mut sn) = (vec![0f32; hd / 2], vec![0f32; hd / 2]);
            rope.cos_sin(t as u32, &mut cs, &mut sn);
            q[t * qd..(t + 1) * qd]
                .chunks_exact_mut(hd)
                .for_each(|r| rope_rotate_half(r, &cs, &sn));
            k[t * kvd..(t + 1) * kvd]
                .chunks_exact_mut(hd)
                .for_each(|r| rope_rotate_half(r, &cs, &sn));
        }
        let mut att = vec![0f32; n * qd];
        for t in 0..n {
            for head in 0..nh {
                let g = head / (nh / nkv);
                let qh = &q[t * qd + head * hd..t * qd + (head + 1) * hd];
                let mut s: Vec<f32> = (0..n)
                    .map(|j| {
                        let visible = j <= t && t - j < window;
                        if visible {
                            fak_tensor::dot_ref(qh, &k[j * kvd + g * hd..j * kvd + (g + 1) * hd])
                                * (1.0 / (hd as f32).sqrt())
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                    .collect();
                softmax_in_place(&mut s);
                let o = &mut att[t * qd + head * hd..t * qd + (head + 1) * hd];
                for (j, &pj) in s.iter().enumerate().take(t + 1) {
                    if pj == 0.0 && t - j >= window {
                        continue; // masked: contributes nothing
                    }
                    for (oo, &vj) in o
                        .iter_mut()
                        .zip(&vv[j * kvd + g * hd..j * kvd + (g + 1) * hd])
                    {
                        *oo += pj * vj;
                    }
                }
            }
        }
        let o = lin(&w(&p("self_attn.o_proj.weight"), &[h, qd]), h, qd, &att);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let xn = norm_rows(&x, &w(&p("post_attention_layernorm.weight"), &[h]));
        let mut gate = lin(&w(&p("mlp.gate_proj.weight"), &[ff, h]), ff, h, &xn);
        let up = lin(&w(&p("mlp.up_proj.weight"), &[ff, h]), ff, h, &xn);
        gate.iter_mut()
            .zip(&up)
            .for_each(|(g, u)| *g = silu(*g) * u);
        let d = lin(&w(&p("mlp.down_proj.weight"), &[h, ff]), h, ff, &gate);
        x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
    }
    let xn = norm_rows(&x, &w("model.norm.weight", &[h]));
    let head = if c.tie_word_embeddings {
        embed
    } else {
        w("lm_head.weight", &[v, h])
    };
    let mut logits = vec![0f32; n * v];
    matmul_ref(&head, v, h, &xn, n, &mut logits);
    logits
}

#[test]
fn windowed_forward_equals_masked_reference_bit_for_bit() {
    let dir = testdata().join("tiny/llama-untied");
    let ids: Vec<u32> = (0..20u32).map(|i| (i * 37 + 5) % 256).collect();
    let mut model = Model::load(&dir).unwrap();
    let layers = model.config().num_hidden_layers;
    for window in [1usize, 3, 7, 20, 64] {
        model
            .set_sliding_windows(vec![Some(window); layers])
            .unwrap();
        let mut kv = fak_kv::KvCache::new(model.config(), 64);
        let pos: Vec<u32> = (0..20).collect();
        let ours = model
            .forward(&ids, &pos, &mut kv, LogitsWanted::All, None)
            .unwrap();
        let reference = masked_reference(&dir, &ids, window);
        assert!(
            bits_eq(&ours, &reference),
            "window {window}: differs from the masked reference"
        );
    }
    // Non-vacuous: the reference itself depends on the window.
    assert!(!bits_eq(
        &masked_reference(&dir, &ids, 3),
        &masked_reference(&dir, &ids, 20)
    ));
}

/// Bounded mode: with a window on every layer, dropping entries older than the window
/// keeps memory flat over 2,000 decode steps and changes no logit.
#[test]
fn bounded_mode_keeps_memory_flat_and_output_exact() {
    const W: usize = 8;
    let mut m = tiny("llama-tied");
    let layers = m.config().num_hidden_layers;
    m.set_sliding_windows(vec![Some(W); layers]).unwrap();
    m.set_max_position_embeddings(4096);
    let m = Arc::new(m);
    let mut bounded = Session::with_capacity(Arc::clone(&m), W + 1);
    let mut unbounded = Session::with_capacity(Arc::clone(&m), 2100);
    let reserved = bounded.cache().bytes_reserved();
    let mut tok = 7u32;
    let mut max_len = 0;
    for step in 0..2000 {
        if bounded.len() == W + 1 {
            bounded.drop_oldest(1).unwrap();
        }
        let a = bounded.step(tok).unwrap();
        let b = unbounded.step(tok).unwrap();
        assert!(
            bits_eq(&a, &b),
            "step {step}: bounded logits differ from unbounded"
        );
        assert_eq!(
            bounded.cache().bytes_reserved(),
            reserved,
            "step {step}: memory grew"
        );
        max_len = max_len.max(bounded.len());
        tok = (fak_model::argmax(&a) + step as u32) % 256;
    }
    assert!(max_len <= W + 1);
    assert_eq!(unbounded.len(), 2000);
    println!(
        "bounded mode: 2000 steps, cache held <= {max_len} entries, {} bytes reserved throughout ({} bytes/token)",
        reserved,
        bounded.cache().bytes_per_token()
    );
}

#[test]
fn evict_out_of_range_is_an_error_and_changes_nothing() {
    let m = Arc::new(tiny("llama-tied"));
    let mut s = Session::new(Arc::clone(&m));
    s.prefill(&[1, 2, 3, 4, 5]).unwrap();
    let before = s.cache().clone();
    for (from, n) in [(3, 3), (6, 0), (0, 6), (usize::MAX, 2)] {
        let e = s.evict(from, n).unwrap_err();
        assert!(
            matches!(e, SessionError::Kv(KvError::SpanOutOfRange { .. })),
            "{e}"
        );
        assert_eq!(s.cache(), &before);
    }
    s.evict(5, 0).unwrap();
    assert_eq!(s.cache(), &before);
    assert!(s.drop_oldest(6).is_err());
}

#[test]
fn generate_needs_logits_and_eviction_drops_them() {
    let m = Arc::new(tiny("llama-tied"));
    let mut s = Session::new(Arc::clone(&m));
    assert!(matches!(
        s.generate(&GenerateParams::default()),
        Err(SessionError::NoLogits)
    ));
    s.prefill(&[1, 2, 3]).unwrap();
    s.evict(1, 1).unwrap();
    assert!(matches!(
        s.generate(&GenerateParams::default()),
        Err(SessionError::NoLogits)
    ));
    assert_eq!(s.positions(), &[0, 1]);
    assert!(matches!(s.prefill(&[999]), Err(SessionError::Model(_))));
    assert_eq!(s.len(), 2);
}

#[test]
fn clone_is_byte_exact_and_independent() {
    let m = Arc::new(tiny("llama-untied"));
    let mut a = Session::new(Arc::clone(&m));
    a.prefill(&[3, 1, 4, 1, 5, 9, 2, 6]).unwrap();
    let mut b = a.clone();
    assert_eq!(cache_max_abs_diff(a.cache(), b.cache()), 0.0);
    b.step(5).unwrap();
    assert_eq!(a.len(), 8);
    assert_eq!(b.len(), 9);
    let c = Session::from_prefix(&a, &[]).unwrap();
    assert_eq!(c.positions_computed(), 0);
    assert_eq!(c.cache(), a.cache());
    assert_eq!(a.cache().bytes_per_token(), 3 * 3 * 32 * 4 + 4);
}

/// NaN logits (a corrupt weight) are an error and the tokens are rolled back.
#[test]
fn nan_logits_are_an_error_and_roll_back() {
    let mut m = tiny("llama-tied");
    m.layer_weights_mut()[1]
        .down_proj
        .as_f32_mut()
        .expect("exact weights")[0] = f32::NAN;
    let mut s = Session::new(Arc::new(m));
    assert!(matches!(
        s.prefill(&[1, 2, 3]),
        Err(SessionError::NanLogits)
    ));
    assert_eq!(s.len(), 0);
    assert!(s.ids().is_empty());
}

/// `Session::generate` past the context is a clear error, and nothing is lost from the
/// cache.
#[test]
fn session_generate_past_the_context_is_an_error() {
    let m = Arc::new(tiny("llama-tied")); // context 256
    let mut s = Session::new(Arc::clone(&m));
    s.prefill(&[5; 250]).unwrap();
    let e = s
        .generate(&GenerateParams {
            max_new_tokens: 100,
            stop_at_eos: false,
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            SessionError::Model(fak_model::ModelError::ContextOverflow { .. })
        ),
        "{e}"
    );
    assert_eq!(s.len(), 256);
}

/// A session asked for more room than the context holds gets the context's room (no
/// overflowing reservation), and runs as usual.
#[test]
fn a_capacity_past_the_context_is_capped_at_it() {
    let model = Arc::new(tiny("llama-tied"));
    let ctx = model.config().max_position_embeddings;
    let mut s = Session::with_capacity(Arc::clone(&model), usize::MAX);
    assert_eq!(s.cache().capacity(), ctx);
    let a = s.prefill(&[1, 2, 3]).unwrap();
    let mut t = Session::new(model);
    assert!(bits_eq(&a, &t.prefill(&[1, 2, 3]).unwrap()));
}

/// `drop_oldest` refuses to drop an entry some layer can still attend to (a global layer
/// reaches every entry, a sliding one its window), leaving the session unchanged; an
/// entry past every window goes, and the outputs stay those of a session that kept it.
#[test]
fn drop_oldest_refuses_entries_a_layer_can_still_reach() {
    let ids: Vec<u32> = (0..12u32).map(|i| (i * 37 + 5) % 256).collect();
    // The tiny Gemma 3: windows [4, 4, None].
    let mut s = Session::new(Arc::new(tiny("gemma3")));
    s.prefill(&ids).unwrap();
    let before = s.cache().clone();
    let e = s.drop_oldest(1).unwrap_err();
    assert!(
        matches!(&e, SessionError::StillInWindow { n: 1, position: 0, next: 12, reach } if reach.contains("global")),
        "{e}"
    );
    assert_eq!(s.cache(), &before, "a refused drop changed the cache");
    // Every layer windowed (4): the next query (position 12) reaches positions 9..=12.
    let mut m = tiny("gemma3");
    let layers = m.config().num_hidden_layers;
    m.set_sliding_windows(vec![Some(4); layers]).unwrap();
    let m = Arc::new(m);
    let mut s = Session::new(Arc::clone(&m));
    s.prefill(&ids).unwrap();
    let e = s.drop_oldest(10).unwrap_err();
    assert!(
        matches!(&e, SessionError::StillInWindow { position: 9, .. }),
        "{e}"
    );
    s.drop_oldest(9).unwrap();
    let mut kept = Session::new(m);
    kept.prefill(&ids).unwrap();
    assert!(bits_eq(&s.step(7).unwrap(), &kept.step(7).unwrap()));
}

/// The tiny Phi-3's cross40 oracle: its prompt and HF `generate`'s 16 greedy ids, whose
/// run crosses the original context (48) at step 9.
fn phi3_cross40() -> (Vec<u32>, Vec<u32>) {
    let file = testdata().join("oracles/tiny-phi3/cross40.safetensors");
    let o = fak_prove::oracle::Oracle::load(file).unwrap();
    (o.ids("prompt_ids").unwrap(), o.ids("greedy_ids").unwrap())
}

/// A session whose sequence crosses Phi-3's original context runs all of it again in
/// the long regime, as HF's `generate` does: the greedy run equals HF's, and the cache
/// afterwards is bit-identical to one pass over the whole sequence.
#[test]
fn phi3_session_recomputes_where_the_sequence_crosses_the_original_context() {
    let model = Arc::new(tiny("phi3"));
    let (prompt, hf) = phi3_cross40();
    assert_eq!(prompt.len(), 40);
    let mut s = Session::new(Arc::clone(&model));
    s.prefill(&prompt).unwrap();
    let params = GenerateParams {
        max_new_tokens: 16,
        stop_at_eos: false,
    };
    let out = s.generate(&params).unwrap();
    assert_eq!(out, hf);
    // 40 prompt tokens and 15 steps ran (the last token is returned, not run); the
    // step to 49 positions ran the 49 again.
    assert_eq!(s.len(), 55);
    assert_eq!(s.positions_computed(), 40 + 8 + 49 + 6);
    let mut whole = Session::new(Arc::clone(&model));
    whole.prefill(s.ids()).unwrap();
    assert_eq!(cache_max_abs_diff(s.cache(), whole.cache()), 0.0);
    assert!(bits_eq(
        s.last_logits().unwrap(),
        whole.last_logits().unwrap()
    ));
}

/// Eviction on Phi-3 at write time equals never-saw on both sides of the original
/// context: a span that takes the sequence back within it (the survivors run again with
/// the short factors), and one that leaves it past it.
#[test]
fn phi3_write_time_eviction_equals_never_saw_across_the_original_context() {
    let model = Arc::new(tiny("phi3"));
    let (prompt, _) = phi3_cross40();
    let poison: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 256).collect();
    let query = [17u32, 99];
    let run = |ids: &[&[u32]]| {
        let mut s = Session::new(Arc::clone(&model));
        for part in ids {
            s.prefill(part).unwrap();
        }
        s
    };
    // 40 + 20 crosses: the second prefill runs all 60 again in the long regime.
    let mut evicted = run(&[&prompt, &poison]);
    assert_eq!(evicted.positions_computed(), 40 + 60);
    // Control: the first 40 entries as the long pass left them are not never-saw's.
    let mut truncated = evicted.cache().clone();
    truncated.drop_newest(20);
    evicted.evict(40, 20).unwrap();
    let never = run(&[&prompt]);
    assert_eq!(evicted.ids(), never.ids());
    assert_eq!(cache_max_abs_diff(evicted.cache(), never.cache()), 0.0);
    assert!(cache_max_abs_diff(&truncated, never.cache()) > 0.0);
    evicted.prefill(&query).unwrap();
    let mut never = never;
    never.prefill(&query).unwrap();
    assert!(bits_eq(
        evicted.last_logits().unwrap(),
        never.last_logits().unwrap()
    ));

    // Past the context before and after: 55 long positions, then 50.
    let mut long = run(&[&prompt, &poison[..10], &poison[10..15]]);
    long.evict(50, 5).unwrap();
    let never = run(&[&[&prompt[..], &poison[..10]].concat()]);
    assert_eq!(cache_max_abs_diff(long.cache(), never.cache()), 0.0);
}
