//! Llama (HF `LlamaForCausalLM`, `modeling_llama.py`; GGUF architecture `llama`): the
//! base block every other family here varies. Its GGUF files store the rows of
//! `q_proj` / `k_proj` permuted for interleaved RoPE; they are put back in HF's
//! rotate-half order at load.

use super::common::{self, Block};
use super::{Family, FamilySpec, LayerTensor};
use crate::{Activation, Config, ModelError, Norms};
use fak_weights::unpermute_qk_rows;

/// The Llama family.
pub(crate) struct Llama;

/// Llama's block: no biases, no QK-norm, two norms, SwiGLU.
const BLOCK: Block = Block {
    attention_bias: false,
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

impl FamilySpec for Llama {
    fn family(&self) -> Family {
        Family::Llama
    }

    fn names(&self) -> &'static [&'static str] {
        &["llama"]
    }

    fn block(&self) -> &'static Block {
        &BLOCK
    }

    fn layer_tensors(&self, cfg: &Config) -> Vec<LayerTensor> {
        common::llama_layer_tensors(cfg)
    }

    fn gguf_block_part(&self, part: &str) -> Option<&'static str> {
        common::llama_block_part(part)
    }

    /// Un-permutes the rows of `q_proj` / `k_proj` back to HF's rotate-half order
    /// (llama.cpp's converter permutes them for interleaved RoPE).
    fn fix_gguf_f32(
        &self,
        name: &str,
        w: Vec<f32>,
        expected: &[usize],
        cfg: &Config,
    ) -> Result<Vec<f32>, ModelError> {
        match qk_heads(name, cfg) {
            Some(h) => {
                let cols = *expected.last().unwrap_or(&1);
                unpermute_qk_rows(&w, h, cols)
                    .map_err(|e| ModelError::Unsupported(format!("un-permuting '{name}': {e}")))
            }
            None => Ok(w),
        }
    }

    /// For `q_proj` / `k_proj`: the row-index form of [`fak_weights::unpermute_qk_rows`].
    fn gguf_row_order(
        &self,
        name: &str,
        rows: usize,
        cfg: &Config,
    ) -> Result<Option<Vec<u32>>, ModelError> {
        let Some(h) = qk_heads(name, cfg) else {
            return Ok(None);
        };
        let hd = if h > 0 && rows.is_multiple_of(h) {
            rows / h
        } else {
            0
        };
        if hd == 0 || hd % 2 != 0 || u32::try_from(rows).is_err() {
            return Err(ModelError::Unsupported(format!(
                "un-permuting '{name}': {rows} rows do not split into {h} heads of even size"
            )));
        }
        let half = hd / 2;
        let mut order = vec![0u32; rows];
        for head in 0..h {
            for s in 0..2 {
                for j in 0..half {
                    order[head * hd + s * half + j] = (head * hd + 2 * j + s) as u32;
                }
            }
        }
        Ok(Some(order))
    }
}

/// The heads of a permuted matrix: query heads for `q_proj`, KV heads for `k_proj`;
/// `None` for every other tensor.
fn qk_heads(name: &str, cfg: &Config) -> Option<usize> {
    if name.ends_with("self_attn.q_proj.weight") {
        Some(cfg.num_attention_heads)
    } else if name.ends_with("self_attn.k_proj.weight") {
        Some(cfg.num_key_value_heads)
    } else {
        None
    }
}
