//! Rungs R0, R1 and R2b on the real default model, SmolLM2-135M-Instruct (GGUF Q4_1),
//! against HF transformers' oracles in `testdata/oracles/smollm2-135m-instruct/`.
//! The model file comes from `fak model pull smollm2-135m-instruct`; without it these
//! tests fail with that command (see `common::smollm2_path`).

mod common;
use common::*;
use fak_model::{Model, WeightSource};
use serde_json::Value;
use std::sync::OnceLock;

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::load(&smollm2_path()).expect("load SmolLM2"))
}

fn oracle_dir() -> std::path::PathBuf {
    testdata().join("oracles/smollm2-135m-instruct")
}

/// R0: tensor names, shapes and the parameter count equal HF's `named_parameters()`.
#[fak_testkit::real_model]
fn r0_tensor_table_matches_hf() {
    let path = smollm2_path();
    let (src, _) = WeightSource::open(&path).unwrap();
    assert_eq!(src.entries().len(), 272);
    let n = check_tensor_table(&src, &oracle_dir());
    assert_eq!(n, 134_515_008);
}

/// The config read from GGUF metadata equals the one HF derived from the same file.
#[fak_testkit::real_model]
fn config_matches_hf() {
    let m = model();
    let hf: Value =
        serde_json::from_str(&std::fs::read_to_string(oracle_dir().join("config.json")).unwrap())
            .unwrap();
    let c = m.config();
    let u = |k: &str| {
        hf[k]
            .as_u64()
            .unwrap_or_else(|| panic!("HF config lacks {k}")) as usize
    };
    assert_eq!(c.hidden_size, u("hidden_size"));
    assert_eq!(c.intermediate_size, u("intermediate_size"));
    assert_eq!(c.num_hidden_layers, u("num_hidden_layers"));
    assert_eq!(c.num_attention_heads, u("num_attention_heads"));
    assert_eq!(c.num_key_value_heads, u("num_key_value_heads"));
    assert_eq!(c.vocab_size, u("vocab_size"));
    assert_eq!(c.max_position_embeddings, u("max_position_embeddings"));
    assert_eq!(c.rms_norm_eps, hf["rms_norm_eps"].as_f64().unwrap() as f32);
    let theta = hf["rope_theta"]
        .as_f64()
        .or_else(|| hf["rope_parameters"]["rope_theta"].as_f64())
        .expect("HF rope_theta");
    assert_eq!(c.rope_theta[0], theta as f32);
    assert!(c.tie_word_embeddings);
}

/// R1 + R2b on every committed prompt of the real model.
#[fak_testkit::real_model]
fn r1_r2b_real_model_matches_hf() {
    let m = model();
    let files = oracle_files("smollm2-135m-instruct");
    assert!(
        files.len() >= 3,
        "need at least 3 real prompts, found {}",
        files.len()
    );
    for f in files {
        check_oracle(m, &load_oracle(f));
    }
}

/// The exact path's order contract on the real model: logits are bit-identical for 1
/// and 2 threads, and a token decoded after a prefill equals the same token inside a
/// longer prefill (the ground R2a of the KV-cache issue stands on).
#[fak_testkit::real_model]
fn exact_path_is_independent_of_threads_and_batch() {
    use fak_model::{LogitsWanted, VecKvCache};
    use fak_tensor::Threads;
    let path = smollm2_path();
    let ids = load_oracle(oracle_files("smollm2-135m-instruct").remove(0))
        .ids("prompt_ids")
        .unwrap();
    let n = ids.len();
    let pos: Vec<u32> = (0..n as u32).collect();
    let mut m = Model::load(&path).unwrap();
    let run_all = |m: &Model| {
        let mut kv = VecKvCache::new(30, 8192);
        m.forward(&ids, &pos, &mut kv, LogitsWanted::All, None)
            .unwrap()
    };
    m.set_threads(Threads::new(1));
    let one = run_all(&m);
    m.set_threads(Threads::new(2));
    let two = run_all(&m);
    assert!(one
        .iter()
        .zip(&two)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    // Prefill n-1 tokens, then decode the last one: equal to row n-1 of the full prefill.
    let mut kv = VecKvCache::new(30, 8192);
    m.forward(
        &ids[..n - 1],
        &pos[..n - 1],
        &mut kv,
        LogitsWanted::None,
        None,
    )
    .unwrap();
    let last = m
        .forward(
            &ids[n - 1..],
            &pos[n - 1..],
            &mut kv,
            LogitsWanted::Last,
            None,
        )
        .unwrap();
    let v = m.config().vocab_size;
    let row = &two[(n - 1) * v..n * v];
    assert!(last
        .iter()
        .zip(row)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}
