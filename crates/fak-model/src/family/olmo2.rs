//! OLMo 2 (HF `Olmo2ForCausalLM`, `modeling_olmo2.py`; GGUF architecture `olmo2`): Llama
//! with its two norms moved after the sublayers (on the attention output and the MLP
//! output, before each residual add; none before them) and a QK-norm over the whole q
//! and k projections (`[q_dim]`, `[kv_dim]`) rather than per head.

use super::common::{self, Block};
use super::{Family, FamilySpec, LayerTensor};
use crate::{Activation, Config, Norms};

/// The OLMo 2 family.
pub(crate) struct Olmo2;

/// OLMo 2's block: post-norms only, QK-norm over the whole projection.
const BLOCK: Block = Block {
    attention_bias: false,
    qk_norm: true,
    norms: Norms::Post,
    norm_weight_offset: 0.0,
    scale_embedding: false,
    hidden_act: Activation::Silu,
    tie_by_default: false,
    sliding_layers: false,
    rope_per_layer_type: false,
    scaled_rope: false,
};

impl FamilySpec for Olmo2 {
    fn family(&self) -> Family {
        Family::Olmo2
    }

    fn names(&self) -> &'static [&'static str] {
        &["olmo2"]
    }

    fn block(&self) -> &'static Block {
        &BLOCK
    }

    /// `Olmo2DecoderLayer`: the four attention projections, `q_norm` `[q_dim]` and
    /// `k_norm` `[kv_dim]`, `post_attention_layernorm`, the three MLP projections,
    /// `post_feedforward_layernorm`.
    fn layer_tensors(&self, c: &Config) -> Vec<LayerTensor> {
        let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        vec![
            ("self_attn.q_proj.weight", vec![q, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.o_proj.weight", vec![h, q]),
            ("self_attn.q_norm.weight", vec![q]),
            ("self_attn.k_norm.weight", vec![kv]),
            ("post_attention_layernorm.weight", vec![h]),
            ("mlp.gate_proj.weight", vec![ff, h]),
            ("mlp.up_proj.weight", vec![ff, h]),
            ("mlp.down_proj.weight", vec![h, ff]),
            ("post_feedforward_layernorm.weight", vec![h]),
        ]
    }

    /// llama.cpp's `olmo2` tensors: Llama's projections, `attn_q_norm` / `attn_k_norm`,
    /// `post_attention_norm`, `post_ffw_norm` (no `attn_norm`, no `ffn_norm`).
    fn gguf_block_part(&self, part: &str) -> Option<&'static str> {
        match part {
            "attn_q_norm" => Some("self_attn.q_norm"),
            "attn_k_norm" => Some("self_attn.k_norm"),
            "post_attention_norm" => Some("post_attention_layernorm"),
            "post_ffw_norm" => Some("post_feedforward_layernorm"),
            "attn_norm" | "ffn_norm" => None,
            _ => common::llama_block_part(part),
        }
    }
}
