//! R1 and R2b on the tiny random-init Llama models of `testdata/tiny/`, against their
//! HF oracles (all positions): embedding bit-exact, every layer's hidden state cosine
//! at least 0.999999, logits max|Δ| <= 1e-4, argmax equal at every position, 16 greedy tokens
//! equal to HF `generate`. Also checks the config read from config.json.

mod common;
use common::*;
use fak_model::{Model, Weight};

fn prove_tiny(name: &str) {
    let dir = testdata().join("tiny").join(name);
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()));
    for file in oracle_files(&format!("tiny-{name}")) {
        check_oracle(&model, &load_oracle(file));
    }
}

#[test]
fn tiny_llama_untied_matches_hf() {
    prove_tiny("llama-untied");
}

#[test]
fn tiny_llama_tied_matches_hf() {
    prove_tiny("llama-tied");
}

#[test]
fn tiny_qwen2_matches_hf() {
    prove_tiny("qwen2");
}

#[test]
fn tiny_qwen3_matches_hf() {
    prove_tiny("qwen3");
}

#[test]
fn tiny_gemma3_matches_hf() {
    prove_tiny("gemma3");
}

#[test]
fn tiny_olmo2_matches_hf() {
    prove_tiny("olmo2");
}

/// Phi-3 with longrope in both regimes: rand7, rand12, rand20 (within the original
/// context of 48 positions, the short factors), long64 (a 64-token prompt, the long
/// factors for every position) and cross40 (a 40-token prompt whose greedy run crosses
/// the original context at step 9, where HF's `generate` runs the whole sequence again
/// in the long regime and so does `generate_greedy`).
#[test]
fn tiny_phi3_matches_hf_in_both_rope_regimes() {
    let model = Model::load(&testdata().join("tiny/phi3")).unwrap();
    assert_eq!(model.config().max_position_embeddings, 192);
    let mut proven = Vec::new();
    for file in oracle_files("tiny-phi3") {
        proven.push(file.file_stem().unwrap().to_string_lossy().into_owned());
        check_oracle(&model, &load_oracle(file));
    }
    proven.sort();
    assert_eq!(proven, ["cross40", "long64", "rand12", "rand20", "rand7"]);
}

/// A pass that would take a sequence cached within Phi-3's original context past it is
/// refused before anything changes (its entries were computed with the short factors);
/// one that stays on either side of the boundary runs. The regime follows the
/// sequence's end: 48 positions short, 49 long.
#[test]
fn phi3_pass_across_the_original_context_is_refused() {
    use fak_model::{KvStore, LogitsWanted, ModelError, RopeRegime, VecKvCache};
    let model = Model::load(&testdata().join("tiny/phi3")).unwrap();
    assert_eq!(model.rope_regime(48), RopeRegime::Short);
    assert_eq!(model.rope_regime(49), RopeRegime::Long);
    let c = model.config();
    let mut kv = VecKvCache::new(c.num_hidden_layers, 64);
    let ids: Vec<u32> = (0..50).map(|i| (i * 7 % 256) as u32).collect();
    let pos: Vec<u32> = (0..50).collect();
    let all = LogitsWanted::All;
    model
        .forward(&ids[..48], &pos[..48], &mut kv, all, None)
        .unwrap();
    let k0 = kv.keys(0).to_vec();
    let e = model.forward(&ids[48..49], &pos[48..49], &mut kv, all, None);
    assert!(
        matches!(
            e,
            Err(ModelError::RopeRegimeChange {
                needed: 49,
                original: 48
            })
        ),
        "{e:?}"
    );
    assert_eq!((kv.len(), kv.keys(0).to_vec()), (48, k0));
    // In the long regime from the start, the sequence grows on.
    let mut long = VecKvCache::new(c.num_hidden_layers, 64);
    model
        .forward(&ids[..49], &pos[..49], &mut long, all, None)
        .unwrap();
    model
        .forward(&ids[49..], &pos[49..], &mut long, all, None)
        .unwrap();
    assert_eq!(long.len(), 50);
}

#[test]
fn tiny_configs_are_read_as_hf_wrote_them() {
    let c = Model::load(&testdata().join("tiny/llama-tied")).unwrap();
    let c = c.config();
    assert!(c.tie_word_embeddings);
    assert_eq!(
        (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim
        ),
        (64, 4, 2, 16)
    );
    assert_eq!(c.vocab_size, 256);
    let u = Model::load(&testdata().join("tiny/llama-untied")).unwrap();
    assert!(!u.config().tie_word_embeddings);
    assert_eq!(u.config().num_hidden_layers, 3);
}

/// Negative control: the comparison is sensitive. The same weights with a wrong RoPE
/// base (10000 instead of the config's 500000) must fail R1, while the embedding (which
/// RoPE does not touch) stays exact.
#[test]
fn wrong_rope_base_fails_r1() {
    use fak_model::WeightSource;
    let (src, mut cfg) = WeightSource::open(&testdata().join("tiny/llama-tied")).unwrap();
    assert_eq!(cfg.rope_theta[0], 500000.0);
    cfg.rope_theta.iter_mut().for_each(|t| *t = 10000.0);
    let model = Model::from_source(&src, cfg).unwrap();
    let oracle = load_oracle(oracle_files("tiny-llama-tied").remove(0));
    let f = measure(&model, &oracle).unwrap();
    assert!(f.embed_exact);
    assert!(
        f.min_layer_cosine < 0.999999,
        "cosine {} should fail",
        f.min_layer_cosine
    );
}

/// Negative control: the GGUF path's Q/K un-permutation matters. Running the tiny model
/// with its q_proj rows permuted the way llama.cpp's converter stores them must fail R1.
#[test]
fn permuted_qk_rows_fail_r1() {
    use fak_model::WeightSource;
    let (src, cfg) = WeightSource::open(&testdata().join("tiny/llama-untied")).unwrap();
    let mut model = Model::from_source(&src, cfg.clone()).unwrap();
    let w = &mut model.layer_weights_mut()[0].q_proj;
    let q = w.as_f32().expect("exact weights");
    *w = Weight::Dense(
        fak_weights::permute_qk_rows(q, cfg.num_attention_heads, cfg.hidden_size).unwrap(),
    );
    let oracle = load_oracle(oracle_files("tiny-llama-untied").remove(0));
    let f = measure(&model, &oracle).unwrap();
    assert!(
        f.min_layer_cosine < 0.999999,
        "cosine {} should fail",
        f.min_layer_cosine
    );
}

/// Negative control: Qwen3 with its QK-norm switched off fails R1 (the witness catches a
/// missing QK-norm).
#[test]
fn qwen3_without_qk_norm_fails_r1() {
    let mut model = Model::load(&testdata().join("tiny/qwen3")).unwrap();
    model
        .layer_weights_mut()
        .iter_mut()
        .for_each(|w| w.qk_norm = None);
    let oracle = load_oracle(oracle_files("tiny-qwen3").remove(0));
    let f = measure(&model, &oracle).unwrap();
    assert!(!f.r1_holds(), "cosine {}", f.min_layer_cosine);
}

/// Negative control: Gemma 3 with head_dim computed as hidden / heads (16) instead of
/// read (32) cannot even be built: its projections do not fit.
#[test]
fn gemma3_with_computed_head_dim_is_caught() {
    use fak_model::WeightSource;
    let (src, mut cfg) = WeightSource::open(&testdata().join("tiny/gemma3")).unwrap();
    assert_eq!(cfg.head_dim, 32);
    cfg.head_dim = cfg.hidden_size / cfg.num_attention_heads;
    let e = Model::from_source(&src, cfg).unwrap_err();
    assert!(
        matches!(e, fak_model::ModelError::ShapeMismatch { .. }),
        "{e}"
    );
}

/// Negative control: RoPE with the interleaved pairing (what llama.cpp's permuted Q/K rows
/// mean) on a rotate-half model fails R1: Qwen2's q and k rows permuted to interleaved.
#[test]
fn interleaved_rope_pairing_fails_r1() {
    let mut model = Model::load(&testdata().join("tiny/qwen2")).unwrap();
    let c = model.config().clone();
    for w in model.layer_weights_mut() {
        let (q, k) = (w.q_proj.as_f32().unwrap(), w.k_proj.as_f32().unwrap());
        let q = fak_weights::permute_qk_rows(q, c.num_attention_heads, c.hidden_size).unwrap();
        let k = fak_weights::permute_qk_rows(k, c.num_key_value_heads, c.hidden_size).unwrap();
        (w.q_proj, w.k_proj) = (Weight::Dense(q), Weight::Dense(k));
        if let Some((bq, bk, _)) = &mut w.qkv_bias {
            *bq = fak_weights::permute_qk_rows(bq, c.num_attention_heads, 1).unwrap();
            *bk = fak_weights::permute_qk_rows(bk, c.num_key_value_heads, 1).unwrap();
        }
    }
    let oracle = load_oracle(oracle_files("tiny-qwen2").remove(0));
    let f = measure(&model, &oracle).unwrap();
    assert!(!f.r1_holds(), "cosine {}", f.min_layer_cosine);
}

/// Negative controls for OLMo 2's block: its QK-norm switched off, or its norms moved
/// before the sublayers (the same gains, Llama's placement), each fail R1.
#[test]
fn olmo2_without_qk_norm_or_with_pre_norms_fails_r1() {
    let oracle = load_oracle(oracle_files("tiny-olmo2").remove(0));
    let mut no_qk = Model::load(&testdata().join("tiny/olmo2")).unwrap();
    no_qk
        .layer_weights_mut()
        .iter_mut()
        .for_each(|w| w.qk_norm = None);
    let f = measure(&no_qk, &oracle).unwrap();
    assert!(!f.r1_holds(), "no QK-norm: cosine {}", f.min_layer_cosine);
    let mut pre = Model::load(&testdata().join("tiny/olmo2")).unwrap();
    for w in pre.layer_weights_mut() {
        w.input_norm = w.attn_out_norm.take();
        w.mlp_norm = w.mlp_out_norm.take();
    }
    let f = measure(&pre, &oracle).unwrap();
    assert!(!f.r1_holds(), "pre-norms: cosine {}", f.min_layer_cosine);
}

/// Negative controls for Phi-3: on rand20, gate and up taken from the wrong halves of
/// `gate_up_proj`, RoPE without the longrope factors, or without their attention factor;
/// on long64, the short factors in place of the long ones. Each fails R1.
#[test]
fn phi3_wrong_split_or_plain_rope_fails_r1() {
    let rand20 = oracle_files("tiny-phi3")
        .into_iter()
        .find(|f| f.ends_with("rand20.safetensors"))
        .unwrap();
    let oracle = load_oracle(rand20);
    let dir = testdata().join("tiny/phi3");
    let mut swapped = Model::load(&dir).unwrap();
    for w in swapped.layer_weights_mut() {
        std::mem::swap(&mut w.gate_proj, &mut w.up_proj);
    }
    let f = measure(&swapped, &oracle).unwrap();
    assert!(
        !f.r1_holds(),
        "gate/up swapped: cosine {}",
        f.min_layer_cosine
    );
    let (src, cfg) = fak_model::WeightSource::open(&dir).unwrap();
    let scaling = cfg.rope_scaling.clone().unwrap();
    let mut unit = scaling.clone();
    unit.attention_factor = 1.0;
    for (label, scaling) in [("plain RoPE", None), ("attention factor 1", Some(unit))] {
        let mut c = cfg.clone();
        c.rope_scaling = scaling;
        let m = Model::from_source(&src, c).unwrap();
        let f = measure(&m, &oracle).unwrap();
        assert!(!f.r1_holds(), "{label}: cosine {}", f.min_layer_cosine);
    }
    // The long factors matter past the original context: the short ones there fail
    // long64.
    let long64 = oracle_files("tiny-phi3")
        .into_iter()
        .find(|f| f.ends_with("long64.safetensors"))
        .unwrap();
    let mut short_only = scaling;
    let long = short_only.long.as_mut().unwrap();
    long.factors = short_only.factors.clone();
    let mut c = cfg.clone();
    c.rope_scaling = Some(short_only);
    let m = Model::from_source(&src, c).unwrap();
    let f = measure(&m, &load_oracle(long64)).unwrap();
    assert!(
        !f.r1_holds(),
        "short factors on long64: cosine {}",
        f.min_layer_cosine
    );
}

/// `Model::profile`: a prefill and a decode step give the same logits bits with the
/// profile on as off, and the profile counts each named step once per layer (per
/// norm for RMSNorm: two pre-norms and the per-head QK-norm in Qwen3, plus the final
/// one), the embedding and the head once per pass, and nothing while off.
#[test]
fn profiling_changes_no_bit_and_counts_each_step() {
    use fak_model::{LogitsWanted, Op, VecKvCache};
    let model = Model::load(&testdata().join("tiny/qwen3")).unwrap();
    let layers = model.config().num_hidden_layers as u64;
    let ids = [3u32, 17, 5, 9, 11, 2, 8];
    let run = |m: &Model| {
        let mut kv = VecKvCache::new(m.config().num_hidden_layers, 16);
        let pos: Vec<u32> = (0..ids.len() as u32).collect();
        let a = m
            .forward(&ids, &pos, &mut kv, LogitsWanted::Last, None)
            .unwrap();
        let b = m
            .forward(&[4], &[ids.len() as u32], &mut kv, LogitsWanted::Last, None)
            .unwrap();
        (a, b)
    };
    let off = run(&model);
    assert_eq!(model.profile().take().total(), std::time::Duration::ZERO);
    model.profile().set_enabled(true);
    let on = run(&model);
    let t = model.profile().take();
    model.profile().set_enabled(false);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&off.0), bits(&on.0));
    assert_eq!(bits(&off.1), bits(&on.1));
    let passes = 2;
    for (op, per_pass) in [
        (Op::Embedding, 1),
        (Op::Norm, 3 * layers + 1),
        (Op::QkvProducts, layers),
        (Op::Rope, 2 * layers),
        (Op::KvAppend, layers),
        (Op::Attention, layers),
        (Op::OProj, layers),
        (Op::GateUpProducts, layers),
        (Op::Activation, layers),
        (Op::DownProj, layers),
        (Op::Head, 1),
    ] {
        assert_eq!(t.get(op).1, passes * per_pass, "{}", op.name());
    }
    assert!(t.get(Op::Attention).0 > std::time::Duration::ZERO);
}
