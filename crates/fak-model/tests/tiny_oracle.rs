//! R1 and R2b on the tiny random-init Llama models of `testdata/tiny/`, against their
//! HF oracles (all positions): embedding bit-exact, every layer's hidden state cosine
//! >= 0.999999, logits max|Δ| <= 1e-4, argmax equal at every position, 16 greedy tokens
//! equal to HF `generate`. Also checks the config read from config.json.

mod common;
use common::*;
use fak_model::Model;

fn prove_tiny(name: &str) {
    let dir = testdata().join("tiny").join(name);
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()));
    for file in oracle_files(&format!("tiny-{name}")) {
        check_oracle(&model, &Oracle::load(file));
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
