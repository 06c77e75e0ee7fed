//! The model families: one file per family behind [`FamilySpec`], and the registry
//! [`FAMILIES`] (one line per family).
//!
//! A family file holds everything that differs between families outside the forward
//! pass: the reading of HF's `config.json` (a `#[derive(Deserialize)]` struct of its
//! fields, refusing what fak does not implement), the mapping of GGUF metadata
//! (`<arch>.*` keys), the per-layer tensor list (used both to load and to check that no
//! tensor of a checkpoint is left unused), the GGUF → HF tensor names, and the fixes a
//! GGUF tensor needs at load (Gemma's norm +1, Llama's Q/K row order). The fields every
//! Llama-like family shares, their refusals and the derived fields are in `common`,
//! once. The pre-tokenizer is not a family property (a `llama` GGUF may carry a `smollm`
//! or `llama-bpe` vocabulary): `tokenizer.ggml.pre` chooses it in `tokenizer.rs`.
//!
//! Adding a family: a file here implementing [`FamilySpec`], its line in [`FAMILIES`],
//! and its [`Family`] variant (the handle other crates match on).

mod common;
mod gemma3;
mod llama;
mod olmo2;
mod phi3;
mod qwen2;
mod qwen3;

use crate::{Config, ModelError};
use fak_weights::GgufFile;
use serde_json::Value;
use std::path::Path;

pub(crate) use common::check_dim;

/// The model families fak implements, each resolved through the registry (`FAMILIES`
/// in `family/mod.rs`) to its file. Names follow HF's `model_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// `llama` (HF `LlamaForCausalLM`; GGUF architecture `llama`).
    Llama,
    /// `qwen2` (HF `Qwen2ForCausalLM`): Llama with biases on the q/k/v projections.
    Qwen2,
    /// `qwen3` (HF `Qwen3ForCausalLM`): per-head RMSNorm of q and k before RoPE, an
    /// explicit `head_dim`.
    Qwen3,
    /// `gemma3` (HF `Gemma3ForCausalLM`, text): scaled embedding, `(1 + w)` norms, four
    /// norms per block, GeGLU (tanh GELU), QK-norm, `query_pre_attn_scalar`, sliding and
    /// global layers with their own RoPE bases.
    Gemma3,
    /// `olmo2` (HF `Olmo2ForCausalLM`): the norms after attention and the MLP instead of
    /// before, QK-norm over the whole q and k projections.
    Olmo2,
    /// `phi3` (HF `Phi3ForCausalLM`): fused `qkv_proj` and `gate_up_proj`, a sliding
    /// window, longrope RoPE scaling.
    Phi3,
}

/// The registry: one line per family. [`Family::from_name`] searches it in this order.
pub(crate) const FAMILIES: &[&dyn FamilySpec] = &[
    &llama::Llama,
    &qwen2::Qwen2,
    &qwen3::Qwen3,
    &gemma3::Gemma3,
    &olmo2::Olmo2,
    &phi3::Phi3,
];

impl Family {
    /// The family's registry entry.
    pub(crate) fn spec(self) -> &'static dyn FamilySpec {
        match FAMILIES.iter().find(|s| s.family() == self) {
            Some(s) => *s,
            // Every variant has its registry line (checked by a test below).
            None => unreachable!("family {self:?} has no registry line"),
        }
    }

    /// HF `model_type` / GGUF `general.architecture` string.
    pub fn name(self) -> &'static str {
        self.spec().names()[0]
    }

    /// The family of an HF `model_type` / GGUF architecture name.
    ///
    /// # Errors
    /// [`ModelError::UnknownArchitecture`] for a name fak does not implement.
    pub fn from_name(name: &str) -> Result<Self, ModelError> {
        FAMILIES
            .iter()
            .find(|s| s.names().contains(&name))
            .map(|s| s.family())
            .ok_or_else(|| ModelError::UnknownArchitecture(name.to_string()))
    }

    /// The canonical names of every registered family, in registry order (for messages).
    pub fn known_names() -> Vec<&'static str> {
        FAMILIES.iter().map(|s| s.names()[0]).collect()
    }
}

/// One tensor of a decoder layer: its HF name after `model.layers.{l}.` and its
/// row-major shape.
pub(crate) type LayerTensor = (&'static str, Vec<usize>);

/// Everything that is particular to one model family outside the forward pass.
pub(crate) trait FamilySpec: Sync {
    /// The public handle of this family.
    fn family(&self) -> Family;

    /// The HF `model_type`s and GGUF `general.architecture` names this family answers
    /// to; the first is its canonical name.
    fn names(&self) -> &'static [&'static str];

    /// The family's block structure: the [`Config`] switches fixed by the family.
    fn block(&self) -> &'static common::Block;

    /// Reads the family's HF `config.json` (already parsed; `path` only for messages).
    /// The default reads the keys the Llama-like families share, under [`Self::block`].
    ///
    /// # Errors
    /// [`ModelError::Config`] for a missing or mistyped key, [`ModelError::Unsupported`]
    /// for a feature fak does not implement.
    fn config_from_hf(&self, v: &Value, path: &Path) -> Result<Config, ModelError> {
        common::config_from_hf(self.family(), self.block(), v, path)
    }

    /// Reads the config from a GGUF file's metadata (`<arch>.*` keys). The default reads
    /// the keys the Llama-like families share, with no sliding layers.
    ///
    /// # Errors
    /// [`ModelError::Gguf`] for a missing or mistyped key, [`ModelError::Config`],
    /// [`ModelError::Unsupported`] as [`FamilySpec::config_from_hf`].
    fn config_from_gguf(&self, g: &GgufFile, path: &Path) -> Result<Config, ModelError> {
        common::config_from_gguf(self.family(), self.block(), g, path, |_, _| Ok(None), None)
    }

    /// Every tensor of one decoder layer under `cfg`, as (HF suffix, shape): the names
    /// the loader reads and the only per-layer names a checkpoint may hold.
    fn layer_tensors(&self, cfg: &Config) -> Vec<LayerTensor>;

    /// For a matrix of [`FamilySpec::layer_tensors`] stored as rows of a fused tensor of
    /// the layer (Phi-3's `self_attn.qkv_proj.weight`, `mlp.gate_up_proj.weight`): that
    /// tensor's name (after `model.layers.N.`), the matrix's first row in it and its
    /// row count. `None` (the default) when the matrix is stored under its own name.
    fn fused(&self, name: &str, cfg: &Config) -> Option<(&'static str, usize, usize)> {
        let _ = (name, cfg);
        None
    }

    /// Whether GGUF tensor `gguf_name` is configuration rather than a weight (Phi-3's
    /// `rope_factors_long.weight` / `rope_factors_short.weight`): read by
    /// [`FamilySpec::config_from_gguf`], not loaded as a tensor. The default: none is.
    fn gguf_config_tensor(&self, gguf_name: &str) -> bool {
        let _ = gguf_name;
        false
    }

    /// The HF name (after `model.layers.N.`, without `.weight` / `.bias`) of a GGUF
    /// block tensor part (`attn_q`, `ffn_norm`, ...), or `None` if the family has none.
    fn gguf_block_part(&self, part: &str) -> Option<&'static str>;

    /// Applies the family's load-time fix to GGUF tensor `name` (HF name, `expected`
    /// its shape), read as `f32`; the default changes nothing.
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] when the fix does not apply to the tensor's shape.
    fn fix_gguf_f32(
        &self,
        name: &str,
        w: Vec<f32>,
        expected: &[usize],
        cfg: &Config,
    ) -> Result<Vec<f32>, ModelError> {
        let _ = (name, expected, cfg);
        Ok(w)
    }

    /// For a GGUF matrix `name` with `rows` output rows kept in the file (native path):
    /// HF row `r` is the file's row `order[r]`; `None` when the rows are in HF order
    /// (the default).
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] when the rows do not split as the order needs.
    fn gguf_row_order(
        &self,
        name: &str,
        rows: usize,
        cfg: &Config,
    ) -> Result<Option<Vec<u32>>, ModelError> {
        let _ = (name, rows, cfg);
        Ok(None)
    }
}

/// Maps a GGUF tensor name to its HF name for family `family` (llama.cpp
/// `gguf-py/gguf/tensor_mapping.py`): the family-independent names are split by
/// [`fak_weights::gguf_to_hf_name_with`], the block parts by the family.
pub(crate) fn gguf_to_hf_name(family: Family, gguf_name: &str) -> Option<String> {
    let spec = family.spec();
    fak_weights::gguf_to_hf_name_with(gguf_name, |part| spec.gguf_block_part(part))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_has_one_registry_line() {
        for f in [
            Family::Llama,
            Family::Qwen2,
            Family::Qwen3,
            Family::Gemma3,
            Family::Olmo2,
            Family::Phi3,
        ] {
            assert_eq!(FAMILIES.iter().filter(|s| s.family() == f).count(), 1);
            assert_eq!(Family::from_name(f.name()).unwrap(), f);
        }
        assert_eq!(Family::from_name("gemma3_text").unwrap(), Family::Gemma3);
        assert!(Family::from_name("mamba").is_err());
    }

    #[test]
    fn gguf_names_by_family() {
        let cases = [
            (
                Family::Llama,
                "blk.3.ffn_norm.weight",
                Some("model.layers.3.post_attention_layernorm.weight"),
            ),
            (
                Family::Gemma3,
                "blk.3.ffn_norm.weight",
                Some("model.layers.3.pre_feedforward_layernorm.weight"),
            ),
            (
                Family::Gemma3,
                "blk.3.post_attention_norm.weight",
                Some("model.layers.3.post_attention_layernorm.weight"),
            ),
            (
                Family::Gemma3,
                "blk.3.post_ffw_norm.weight",
                Some("model.layers.3.post_feedforward_layernorm.weight"),
            ),
            (
                Family::Gemma3,
                "blk.0.attn_q_norm.weight",
                Some("model.layers.0.self_attn.q_norm.weight"),
            ),
            (
                Family::Qwen3,
                "blk.0.attn_k_norm.weight",
                Some("model.layers.0.self_attn.k_norm.weight"),
            ),
            (
                Family::Qwen2,
                "blk.0.attn_q.bias",
                Some("model.layers.0.self_attn.q_proj.bias"),
            ),
            (Family::Llama, "blk.0.attn_q_norm.weight", None),
            (Family::Qwen2, "blk.0.attn_k_norm.weight", None),
            (Family::Llama, "blk.0.post_ffw_norm.weight", None),
            (Family::Qwen3, "output.weight", Some("lm_head.weight")),
        ];
        for (f, g, h) in cases {
            assert_eq!(gguf_to_hf_name(f, g).as_deref(), h, "{f:?} {g}");
        }
    }
}
