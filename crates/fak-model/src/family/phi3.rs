//! Phi-3 (HF `Phi3ForCausalLM`, `modeling_phi3.py`): Llama with the q/k/v projections
//! fused into one `qkv_proj` and gate/up into one `gate_up_proj`, a sliding window on
//! every layer, and RoPE scaled per dimension (`longrope`: short and long factor lists
//! and an attention factor on cos and sin).
//!
//! HF chooses the long factors for a forward call whose largest position reaches past
//! `original_max_position_embeddings`, and its `generate` recomputes the whole sequence
//! when it first crosses that length. fak does the same: the model picks the factors
//! per pass ([`crate::Model::rope_regime`]) and refuses a pass that would put entries of
//! both regimes in one cache ([`ModelError::RopeRegimeChange`]), which `generate_greedy`
//! and fak-kv's `Session` answer by recomputing the sequence. GGUF architecture `phi3`:
//! the factors come from its `rope_factors_short.weight` and `rope_factors_long.weight`
//! tensors.

use super::common::{self, Block};
use super::{Family, FamilySpec, LayerTensor};
use crate::{Activation, Config, LongRopeFactors, ModelError, Norms, RopeScaling};
use fak_weights::GgufFile;
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// The Phi-3 family.
pub(crate) struct Phi3;

/// Phi-3's block: Llama's, its matrices fused in storage.
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
    scaled_rope: true,
};

/// The RoPE object of a Phi-3 `config.json` (`rope_parameters`, or the older
/// `rope_scaling` beside a top-level `rope_theta`); a key outside it is refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Rope {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    /// Read by the shared reader; named here so the object's keys are all known.
    #[serde(rename = "rope_theta")]
    _rope_theta: Option<f64>,
    short_factor: Option<Vec<f64>>,
    long_factor: Option<Vec<f64>>,
    original_max_position_embeddings: Option<usize>,
    attention_factor: Option<f64>,
    factor: Option<f64>,
    partial_rotary_factor: Option<f64>,
}

/// Phi-3's own top-level keys.
#[derive(Deserialize)]
struct Phi3Fields {
    max_position_embeddings: usize,
    original_max_position_embeddings: Option<usize>,
    rope_parameters: Option<Rope>,
    rope_scaling: Option<Rope>,
    sliding_window: Option<usize>,
}

impl FamilySpec for Phi3 {
    fn family(&self) -> Family {
        Family::Phi3
    }

    fn names(&self) -> &'static [&'static str] {
        &["phi3"]
    }

    fn block(&self) -> &'static Block {
        &BLOCK
    }

    fn config_from_hf(&self, v: &Value, path: &Path) -> Result<Config, ModelError> {
        let err = |reason: String| common::config_err(path, reason);
        let f: Phi3Fields = common::de(v, path)?;
        let rope = f.rope_parameters.as_ref().or(f.rope_scaling.as_ref());
        // The rest of the config is Llama's (the shared reader leaves the RoPE scaling
        // to this family: `Block::scaled_rope`); then the scaling and the window.
        let mut c = common::config_from_hf(Family::Phi3, &BLOCK, v, path)?;
        if let Some(r) = rope {
            let kind = r
                .rope_type
                .as_deref()
                .or(r.kind.as_deref())
                .unwrap_or("default");
            if r.partial_rotary_factor.is_some_and(|p| p != 1.0) {
                return Err(ModelError::Unsupported(
                    "partial_rotary_factor (partial RoPE) for phi3".into(),
                ));
            }
            match kind {
                "default" => {}
                "longrope" | "su" => {
                    let original = f
                        .original_max_position_embeddings
                        .or(r.original_max_position_embeddings)
                        .ok_or_else(|| {
                            err("longrope without original_max_position_embeddings".into())
                        })?;
                    let short = r
                        .short_factor
                        .as_ref()
                        .ok_or_else(|| err("longrope without short_factor".into()))?;
                    let long = r
                        .long_factor
                        .as_ref()
                        .ok_or_else(|| err("longrope without long_factor".into()))?;
                    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect();
                    c.rope_scaling = Some(RopeScaling {
                        factors: f32s(short),
                        attention_factor: longrope_attention_factor(
                            r.attention_factor,
                            r.factor,
                            f.max_position_embeddings,
                            original,
                        ),
                        long: Some(LongRopeFactors {
                            factors: f32s(long),
                            original_max_position_embeddings: original,
                        }),
                    });
                }
                other => {
                    return Err(ModelError::Unsupported(format!(
                        "RoPE type '{other}' for phi3"
                    )))
                }
            }
        }
        if let Some(w) = f.sliding_window {
            c.sliding_window = vec![Some(w); c.num_hidden_layers];
        }
        c.validate().map_err(err)?;
        Ok(c)
    }

    /// llama.cpp's `phi3` keys: Llama's, plus `rope.scaling.original_context_length`,
    /// `rope.scaling.attn_factor`, `attention.sliding_window` (0: none), and the
    /// longrope factors in the tensors `rope_factors_short.weight` and
    /// `rope_factors_long.weight` (F32, `[head_dim / 2]` each).
    fn config_from_gguf(&self, g: &GgufFile, path: &Path) -> Result<Config, ModelError> {
        let err = |reason: String| common::config_err(path, reason);
        let theta = common::GgufKeys::new(g)?
            .opt_f("rope.freq_base")?
            .unwrap_or(10000.0);
        let local = |m: &common::GgufKeys<'_>, n: usize| {
            Ok(match m.opt_u("attention.sliding_window")? {
                Some(w) if w > 0 => Some(common::Local {
                    window: w,
                    sliding: vec![true; n],
                    rope_theta: theta,
                }),
                _ => None,
            })
        };
        let mut c = common::config_from_gguf(Family::Phi3, &BLOCK, g, path, local, None)?;
        let m = common::GgufKeys::new(g)?;
        if let Some(original) = m.opt_u("rope.scaling.original_context_length")? {
            let factors = |name: &str| g.tensor_f32(name).map_err(|e| err(format!("{name}: {e}")));
            let attention_factor = match m.opt_f("rope.scaling.attn_factor")? {
                Some(a) => a,
                None => longrope_attention_factor(None, None, c.max_position_embeddings, original),
            };
            c.rope_scaling = Some(RopeScaling {
                factors: factors("rope_factors_short.weight")?,
                attention_factor,
                long: Some(LongRopeFactors {
                    factors: factors("rope_factors_long.weight")?,
                    original_max_position_embeddings: original,
                }),
            });
        }
        c.validate().map_err(err)?;
        Ok(c)
    }

    fn gguf_config_tensor(&self, gguf_name: &str) -> bool {
        matches!(
            gguf_name,
            "rope_factors_long.weight" | "rope_factors_short.weight"
        )
    }

    /// Llama's matrices and norms, as roles: `q_proj`, `k_proj`, `v_proj` are stored in
    /// `qkv_proj`, `gate_proj` and `up_proj` in `gate_up_proj` ([`Phi3::fused`]).
    fn layer_tensors(&self, c: &Config) -> Vec<LayerTensor> {
        common::llama_layer_tensors(c)
    }

    /// `qkv_proj` rows: q `[0, q_dim)`, k `[q_dim, q_dim + kv_dim)`, v the rest
    /// (`Phi3Attention`'s split); `gate_up_proj` rows: gate the first `intermediate`,
    /// up the rest (`Phi3MLP`'s `chunk(2)`).
    fn fused(&self, name: &str, c: &Config) -> Option<(&'static str, usize, usize)> {
        let (q, kv, ff) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        let (qkv, gate_up) = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight");
        match name {
            "self_attn.q_proj.weight" => Some((qkv, 0, q + 2 * kv)),
            "self_attn.k_proj.weight" => Some((qkv, q, q + 2 * kv)),
            "self_attn.v_proj.weight" => Some((qkv, q + kv, q + 2 * kv)),
            "mlp.gate_proj.weight" => Some((gate_up, 0, 2 * ff)),
            "mlp.up_proj.weight" => Some((gate_up, ff, 2 * ff)),
            _ => None,
        }
    }

    /// llama.cpp's `phi3` tensors: the fused `attn_qkv` and `ffn_up` (gate and up),
    /// otherwise Llama's parts.
    fn gguf_block_part(&self, part: &str) -> Option<&'static str> {
        match part {
            "attn_qkv" => Some("self_attn.qkv_proj"),
            "ffn_up" => Some("mlp.gate_up_proj"),
            "attn_q" | "attn_k" | "attn_v" | "ffn_gate" => None,
            _ => common::llama_block_part(part),
        }
    }
}

/// Longrope's attention factor (HF `_compute_longrope_parameters`): the config's
/// `attention_factor` when given; else, with `s` the config's `factor` or
/// `max / original`, `sqrt(1 + ln(s) / ln(original))`, or 1 when `s <= 1`. Computed in
/// `f64` as Python does, then rounded to `f32` as torch multiplies with it.
fn longrope_attention_factor(
    explicit: Option<f64>,
    factor: Option<f64>,
    max: usize,
    original: usize,
) -> f32 {
    if let Some(a) = explicit {
        return a as f32;
    }
    let s = factor.unwrap_or(max as f64 / original as f64);
    if s <= 1.0 {
        1.0
    } else {
        (1.0 + s.ln() / (original as f64).ln()).sqrt() as f32
    }
}
