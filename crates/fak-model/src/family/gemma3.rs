//! Gemma 3, text (HF `Gemma3ForCausalLM`, `modeling_gemma3.py`; GGUF architecture
//! `gemma3`): scaled embedding, `(1 + w)` RMSNorm gains, four norms per block, GeGLU
//! with tanh GELU, QK-norm, q·k scaled by `query_pre_attn_scalar^-0.5`, sliding layers
//! (their own window and RoPE base) between global ones.

use super::common::{self, Block, HfCore, HfFeatures, Local};
use super::{Family, FamilySpec, LayerTensor};
use crate::{Activation, Config, ModelError, Norms};
use fak_weights::GgufFile;
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// Gemma 3's RoPE base for sliding (local) layers when the checkpoint does not say (HF
/// `Gemma3TextConfig.rope_local_base_freq` default).
pub const GEMMA3_LOCAL_ROPE_BASE: f32 = 10000.0;
/// Gemma 3's local:global layer pattern when the checkpoint does not say: every sixth
/// layer is global (HF `sliding_window_pattern` default 6).
pub const GEMMA3_SLIDING_PATTERN: usize = 6;
/// Gemma 3's `query_pre_attn_scalar` when the checkpoint does not say (HF default 256).
pub const GEMMA3_QUERY_PRE_ATTN_SCALAR: f32 = 256.0;

/// The Gemma 3 family.
pub(crate) struct Gemma3;

/// Gemma 3's block.
const BLOCK: Block = Block {
    attention_bias: false,
    qk_norm: true,
    norms: Norms::Sandwich,
    norm_weight_offset: 1.0,
    scale_embedding: true,
    hidden_act: Activation::GeluTanh,
    tie_by_default: true,
    sliding_layers: true,
    rope_per_layer_type: true,
    scaled_rope: false,
};

/// The `config.json` keys of Gemma 3 beyond the shared ones (`Gemma3TextConfig`).
#[derive(Deserialize)]
struct Gemma3Fields {
    /// The activation (`hidden_act` in older configs).
    hidden_activation: Option<Value>,
    /// The sliding layers' window, in tokens (required).
    sliding_window: Option<usize>,
    /// The sliding layers' RoPE base (older configs; newer ones use
    /// `rope_parameters.sliding_attention`).
    rope_local_base_freq: Option<f64>,
    /// Per layer: `sliding_attention` or `full_attention`.
    layer_types: Option<Vec<String>>,
    /// Without `layer_types`: every this-many-th layer is global.
    sliding_window_pattern: Option<usize>,
    query_pre_attn_scalar: Option<f64>,
}

impl FamilySpec for Gemma3 {
    fn family(&self) -> Family {
        Family::Gemma3
    }

    fn names(&self) -> &'static [&'static str] {
        &["gemma3", "gemma3_text"]
    }

    fn block(&self) -> &'static Block {
        &BLOCK
    }

    fn config_from_hf(&self, v: &Value, path: &Path) -> Result<Config, ModelError> {
        let err = |reason: String| common::config_err(path, reason);
        let features = HfFeatures::read(v, path)?;
        let bases = features.check_rope(&BLOCK, path)?;
        let fields: Gemma3Fields = common::de(v, path)?;
        let (key, act) = if v.get("hidden_activation").is_some() {
            ("hidden_activation", fields.hidden_activation.as_ref())
        } else {
            ("hidden_act", features.hidden_act())
        };
        features.check_activation(key, act, "gelu_pytorch_tanh")?;
        features.check_block(&BLOCK)?;
        let core = HfCore::read(v, path)?;
        let n = core.num_hidden_layers();
        let window = fields
            .sliding_window
            .ok_or_else(|| err("gemma3 config lacks 'sliding_window'".into()))?;
        let rope_theta = match bases.local {
            Some(t) => t,
            None => fields
                .rope_local_base_freq
                .map_or(GEMMA3_LOCAL_ROPE_BASE, |t| t as f32),
        };
        let sliding: Vec<bool> = match fields.layer_types {
            Some(types) if types.len() == n => types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    _ => Err(err(format!("layer_types holds \"{t}\""))),
                })
                .collect::<Result<_, _>>()?,
            Some(types) => {
                return Err(err(format!(
                    "layer_types {types:?} does not list {n} layers"
                )))
            }
            None => every_nth_global(
                n,
                fields
                    .sliding_window_pattern
                    .unwrap_or(GEMMA3_SLIDING_PATTERN),
            ),
        };
        let q = fields
            .query_pre_attn_scalar
            .map_or(GEMMA3_QUERY_PRE_ATTN_SCALAR, |q| q as f32);
        let core = core.into_core(&BLOCK, bases.global);
        let local = Local {
            window,
            sliding,
            rope_theta,
        };
        common::build(Family::Gemma3, &BLOCK, core, Some(local), Some(q)).map_err(err)
    }

    /// Gemma 3 files store the sliding window but not which layers slide nor their RoPE
    /// base nor `query_pre_attn_scalar`: HF's defaults (named above) decide, as
    /// transformers does on load.
    fn config_from_gguf(&self, g: &GgufFile, path: &Path) -> Result<Config, ModelError> {
        let local = |m: &common::GgufKeys<'_>, n: usize| {
            Ok(Some(Local {
                window: m.u("attention.sliding_window")?,
                sliding: every_nth_global(n, GEMMA3_SLIDING_PATTERN),
                rope_theta: GEMMA3_LOCAL_ROPE_BASE,
            }))
        };
        common::config_from_gguf(
            Family::Gemma3,
            &BLOCK,
            g,
            path,
            local,
            Some(GEMMA3_QUERY_PRE_ATTN_SCALAR),
        )
    }

    /// `Gemma3DecoderLayer`: Llama's tensors (its `post_attention_layernorm` now after
    /// attention), QK-norm, and the two norms around the MLP.
    fn layer_tensors(&self, cfg: &Config) -> Vec<LayerTensor> {
        let mut t = common::llama_layer_tensors(cfg);
        t.extend(common::qk_norm_tensors(cfg));
        t.extend([
            ("pre_feedforward_layernorm.weight", vec![cfg.hidden_size]),
            ("post_feedforward_layernorm.weight", vec![cfg.hidden_size]),
        ]);
        t
    }

    /// Four norms per block (`ffn_norm` → `pre_feedforward_layernorm`,
    /// `post_attention_norm` → `post_attention_layernorm`, `post_ffw_norm` →
    /// `post_feedforward_layernorm`) and QK-norm (`attn_q_norm` / `attn_k_norm`).
    fn gguf_block_part(&self, part: &str) -> Option<&'static str> {
        match part {
            "ffn_norm" => Some("pre_feedforward_layernorm"),
            "post_attention_norm" => Some("post_attention_layernorm"),
            "post_ffw_norm" => Some("post_feedforward_layernorm"),
            "attn_q_norm" => Some("self_attn.q_norm"),
            "attn_k_norm" => Some("self_attn.k_norm"),
            _ => common::llama_block_part(part),
        }
    }

    /// Gemma files store RMSNorm gains with the +1 folded in (llama.cpp's converter adds
    /// it); HF's loader subtracts it again and the model adds it back (`1 + w`). Do the
    /// same, so the f32 arithmetic matches HF's.
    fn fix_gguf_f32(
        &self,
        name: &str,
        mut w: Vec<f32>,
        _expected: &[usize],
        _cfg: &Config,
    ) -> Result<Vec<f32>, ModelError> {
        if name.ends_with("norm.weight") {
            w.iter_mut().for_each(|x| *x -= 1.0);
        }
        Ok(w)
    }
}

/// Per layer of `n`: whether it slides when every `every`-th layer is global (0 counts
/// as 1).
fn every_nth_global(n: usize, every: usize) -> Vec<bool> {
    let every = every.max(1);
    (0..n).map(|i| (i + 1) % every != 0).collect()
}
