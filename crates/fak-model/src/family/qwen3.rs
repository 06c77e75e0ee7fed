//! Qwen3 (HF `Qwen3ForCausalLM`, `modeling_qwen3.py`; GGUF architecture `qwen3`): Llama
//! with a per-head RMSNorm of q and k before RoPE and an explicit `head_dim`.

use super::common::{self, Block};
use super::{Family, FamilySpec, LayerTensor};
use crate::{Activation, Config, Norms};

/// The Qwen3 family.
pub(crate) struct Qwen3;

/// Qwen3's block: Llama's plus QK-norm.
const BLOCK: Block = Block {
    attention_bias: false,
    qk_norm: true,
    norms: Norms::Pre,
    norm_weight_offset: 0.0,
    scale_embedding: false,
    hidden_act: Activation::Silu,
    tie_by_default: false,
    sliding_layers: false,
    rope_per_layer_type: false,
    scaled_rope: false,
};

impl FamilySpec for Qwen3 {
    fn family(&self) -> Family {
        Family::Qwen3
    }

    fn names(&self) -> &'static [&'static str] {
        &["qwen3"]
    }

    fn block(&self) -> &'static Block {
        &BLOCK
    }

    fn layer_tensors(&self, cfg: &Config) -> Vec<LayerTensor> {
        let mut t = common::llama_layer_tensors(cfg);
        t.extend(common::qk_norm_tensors(cfg));
        t
    }

    /// Llama's parts plus `attn_q_norm` / `attn_k_norm` (`Qwen3Attention`).
    fn gguf_block_part(&self, part: &str) -> Option<&'static str> {
        match part {
            "attn_q_norm" => Some("self_attn.q_norm"),
            "attn_k_norm" => Some("self_attn.k_norm"),
            _ => common::llama_block_part(part),
        }
    }
}
