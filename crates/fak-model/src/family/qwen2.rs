//! Qwen2 (HF `Qwen2ForCausalLM`, `modeling_qwen2.py`; GGUF architecture `qwen2`): Llama
//! with biases on the q/k/v projections.

use super::common::{self, Block};
use super::{Family, FamilySpec, LayerTensor};
use crate::{Activation, Config, Norms};

/// The Qwen2 family.
pub(crate) struct Qwen2;

/// Qwen2's block: Llama's plus q/k/v biases.
const BLOCK: Block = Block {
    attention_bias: true,
    qk_norm: false,
    norms: Norms::Pre,
    norm_weight_offset: 0.0,
    scale_embedding: false,
    hidden_act: Activation::Silu,
    tie_by_default: false,
    sliding_layers: false,
    rope_per_layer_type: false,
    scaled_rope: false,
};

impl FamilySpec for Qwen2 {
    fn family(&self) -> Family {
        Family::Qwen2
    }

    fn names(&self) -> &'static [&'static str] {
        &["qwen2"]
    }

    fn block(&self) -> &'static Block {
        &BLOCK
    }

    fn layer_tensors(&self, cfg: &Config) -> Vec<LayerTensor> {
        let mut t = common::llama_layer_tensors(cfg);
        t.extend([
            ("self_attn.q_proj.bias", vec![cfg.q_dim()]),
            ("self_attn.k_proj.bias", vec![cfg.kv_dim()]),
            ("self_attn.v_proj.bias", vec![cfg.kv_dim()]),
        ]);
        t
    }

    fn gguf_block_part(&self, part: &str) -> Option<&'static str> {
        common::llama_block_part(part)
    }
}
