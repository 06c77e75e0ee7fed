//! Rungs R0, R1 and R2b on the real Gemma 3 270M (GGUF Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0 and
//! F32 tensors), against HF transformers' oracles in `testdata/oracles/gemma3-270m/`.
//! The file comes from `fak model pull gemma3-270m`; without it these tests fail with
//! that command.

mod common;
use common::*;
use fak_model::{Model, WeightSource};
use serde_json::Value;

fn oracle_dir() -> std::path::PathBuf {
    testdata().join("oracles/gemma3-270m")
}

/// R0 and the config: tensor names, shapes and parameter count equal HF's; the config
/// read from the GGUF (with Gemma 3's documented defaults for what the file lacks)
/// equals the one HF derived from the same file.
#[fak_testkit::real_model]
fn gemma3_tensor_table_and_config_match_hf() {
    let path = real_model("gemma3-270m");
    let (src, c) = WeightSource::open(&path).unwrap();
    assert_eq!(check_tensor_table(&src, &oracle_dir()), 268_098_176);

    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(oracle_dir().join("config.json")).unwrap())
            .unwrap();
    let u = |k: &str| {
        cfg[k]
            .as_u64()
            .unwrap_or_else(|| panic!("HF config lacks {k}")) as usize
    };
    assert_eq!(c.hidden_size, u("hidden_size"));
    assert_eq!(c.num_hidden_layers, u("num_hidden_layers"));
    assert_eq!(c.head_dim, u("head_dim"));
    assert_eq!(c.num_key_value_heads, u("num_key_value_heads"));
    let types = cfg["layer_types"].as_array().expect("HF layer_types");
    for (l, t) in types.iter().enumerate() {
        let sliding = t == "sliding_attention";
        assert_eq!(c.sliding_window[l].is_some(), sliding, "layer {l}");
        if sliding {
            assert_eq!(c.sliding_window[l], Some(u("sliding_window")));
        }
    }
    let scalar = cfg["query_pre_attn_scalar"].as_f64().unwrap();
    assert_eq!(c.attention_scale, scalar.powf(-0.5) as f32);
}

/// R1 + R2b on every committed prompt of the real Gemma 3 file.
#[fak_testkit::real_model]
fn gemma3_r1_r2b_match_hf() {
    let path = real_model("gemma3-270m");
    let m = Model::load(&path).unwrap();
    let files = oracle_files("gemma3-270m");
    assert!(files.len() >= 3);
    for f in files {
        check_oracle(&m, &load_oracle(f));
    }
}

/// The long prompt (991 tokens) exceeds the 512-token sliding window, so the window is
/// exercised: the same weights with every layer global fail R1 on it.
#[fak_testkit::real_model]
fn gemma3_long_prompt_needs_the_sliding_window() {
    let path = real_model("gemma3-270m");
    let mut m = Model::load(&path).unwrap();
    let n = m.config().num_hidden_layers;
    m.set_sliding_windows(vec![None; n]).unwrap();
    let long = oracle_files("gemma3-270m")
        .into_iter()
        .find(|f| f.ends_with("long.safetensors"))
        .expect("long prompt oracle");
    let oracle = load_oracle(long);
    assert!(oracle.ids("prompt_ids").unwrap().len() > 512);
    let f = measure(&m, &oracle).unwrap();
    assert!(
        !f.r1_holds(),
        "without the window: cosine {}, max|Δ| {}",
        f.min_layer_cosine,
        f.logits_max_abs_diff
    );
}
