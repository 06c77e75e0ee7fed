//! Model configuration, read from an HF `config.json` or from GGUF metadata.
//!
//! One struct serves every family: the switches the other families need (attention
//! bias, QK-norm, explicit head_dim, per-layer sliding window and RoPE base, the norm
//! weight offset, an embedding scale, the activation) take Llama's values unless the
//! family sets them. The reading itself is the family's (`family/`): [`Config::from_hf_value`]
//! and [`Config::from_gguf`] find the family in the registry and let it read the file.
//! Anything a checkpoint asks for that fak does not implement (RoPE scaling, mixture of
//! experts, ...) is refused there with [`ModelError::Unsupported`], never replaced by a
//! default.

use crate::family::{check_dim, Family};
use crate::ModelError;
use fak_weights::GgufFile;
use serde_json::Value;
use std::path::Path;

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// SiLU, making the MLP SwiGLU (Shazeer 2020); HF `hidden_act: "silu"`.
    Silu,
    /// GELU with the tanh approximation, making the MLP GeGLU; HF `gelu_pytorch_tanh`.
    GeluTanh,
}

/// RoPE scaled per dimension: `inv_freq[i] = 1 / (factors[i] · base^(2i/d))`, and cos
/// and sin times `attention_factor` ([`fak_tensor::RopeTable::scaled`]). HF
/// `transformers.modeling_rope_utils`' longrope (Phi-3).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RopeScaling {
    /// One factor per rotated pair, `head_dim / 2` of them: longrope's `short_factor`,
    /// used while the sequence fits in the original context (all of it without `long`).
    pub factors: Vec<f32>,
    /// Multiplier on cos and sin in both regimes (longrope: `sqrt(1 + ln(s) /
    /// ln(original))`, `s` the context's extension over the original length).
    pub attention_factor: f32,
    /// longrope's `long_factor` and the length past which they apply.
    pub long: Option<LongRopeFactors>,
}

/// The factors a longrope model uses for a sequence longer than its original context.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LongRopeFactors {
    /// One factor per rotated pair, `head_dim / 2` of them (`long_factor`).
    pub factors: Vec<f32>,
    /// `original_max_position_embeddings`: a forward pass whose largest position `p` has
    /// `p + 1` above this uses `factors` for every position (HF's `Phi3RotaryEmbedding`
    /// picks the regime per call from `max(position_ids) + 1`).
    pub original_max_position_embeddings: usize,
}

/// Where a decoder block's RMSNorms sit around its two sublayers (attention, MLP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Norms {
    /// Before each sublayer (Llama, Qwen): `input_layernorm`, then
    /// `post_attention_layernorm` before the MLP.
    Pre,
    /// Before and after each (Gemma 3): `input_layernorm` / `post_attention_layernorm`
    /// around attention, `pre_feedforward_layernorm` / `post_feedforward_layernorm`
    /// around the MLP.
    Sandwich,
    /// After each, on the sublayer's output before the residual add (OLMo 2):
    /// `post_attention_layernorm`, `post_feedforward_layernorm`.
    Post,
}

/// Hyper-parameters of a decoder-only transformer. Lengths are in elements, the context
/// length in tokens.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Config {
    /// Which family's block structure to run.
    pub family: Family,
    /// Vocabulary size: rows of the embedding and of the logits head.
    pub vocab_size: usize,
    /// Width of the residual stream (`hidden_size`, GGUF `embedding_length`).
    pub hidden_size: usize,
    /// Width of the MLP's inner layer (`intermediate_size`, GGUF `feed_forward_length`).
    pub intermediate_size: usize,
    /// Number of decoder blocks (`num_hidden_layers`, GGUF `block_count`).
    pub num_hidden_layers: usize,
    /// Query heads (`num_attention_heads`, GGUF `attention.head_count`).
    pub num_attention_heads: usize,
    /// Key/value heads; fewer than query heads means GQA (Ainslie et al. 2023).
    pub num_key_value_heads: usize,
    /// Width of one attention head (`head_dim`, else `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// RMSNorm epsilon (`rms_norm_eps`, GGUF `attention.layer_norm_rms_epsilon`).
    pub rms_norm_eps: f32,
    /// RoPE base per layer (`rope_theta`, GGUF `rope.freq_base`; HF default 10000).
    pub rope_theta: Vec<f32>,
    /// Context length in tokens (`max_position_embeddings`, GGUF `context_length`).
    pub max_position_embeddings: usize,
    /// Per-dimension RoPE frequency factors and the attention factor on cos and sin
    /// (HF `transformers.modeling_rope_utils`), when the family scales RoPE: Phi-3's
    /// longrope short factors. `None` is plain RoPE.
    pub rope_scaling: Option<RopeScaling>,
    /// Whether the logits head reuses the token embedding (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Bias on the q/k/v projections (Qwen2). Llama: false.
    pub attention_bias: bool,
    /// RMSNorm of q and k before RoPE (Qwen3, Gemma 3: per head; OLMo 2: over the whole
    /// projection; the span is the gain's length). Llama: false.
    pub qk_norm: bool,
    /// Sliding attention window per layer, in tokens; `None` is full causal attention.
    pub sliding_window: Vec<Option<usize>>,
    /// Added to every RMSNorm weight (Gemma's `1 + weight`); 0 for Llama.
    pub norm_weight_offset: f32,
    /// Multiplier on the embedding output (Gemma's `sqrt(hidden)`); `None` for Llama.
    pub embedding_scale: Option<f32>,
    /// The MLP activation.
    pub hidden_act: Activation,
    /// Where a block's RMSNorms sit around attention and the MLP.
    pub norms: Norms,
    /// Multiplier of q·k: `head_dim^-0.5`, or Gemma's `query_pre_attn_scalar^-0.5`.
    pub attention_scale: f32,
    /// Beginning-of-sequence token id, if the checkpoint names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token ids: generation stops at any of them.
    pub eos_token_ids: Vec<u32>,
}

impl Config {
    /// Width of the key (and value) projection: `num_key_value_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Width of the query projection: `num_attention_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Reads an HF `config.json`.
    ///
    /// # Errors
    /// [`ModelError::Io`] / [`ModelError::Config`] for an unreadable file, invalid JSON, a
    /// missing or mistyped key; [`ModelError::UnknownArchitecture`] for a `model_type`
    /// fak does not implement; [`ModelError::Unsupported`] for RoPE scaling.
    pub fn from_hf_json(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|e| ModelError::Config {
            path: path.to_path_buf(),
            reason: format!("invalid JSON: {e}"),
        })?;
        Self::from_hf_value(&v, path)
    }

    /// Builds a config from an already parsed `config.json` value (`path` is only used in
    /// error messages).
    ///
    /// # Errors
    /// As [`Config::from_hf_json`].
    pub fn from_hf_value(v: &Value, path: &Path) -> Result<Self, ModelError> {
        let model_type =
            v.get("model_type")
                .and_then(Value::as_str)
                .ok_or_else(|| ModelError::Config {
                    path: path.to_path_buf(),
                    reason: "missing string key 'model_type'".into(),
                })?;
        Family::from_name(model_type)?
            .spec()
            .config_from_hf(v, path)
    }

    /// Reads the config from a GGUF file's metadata (`<arch>.*` keys, GGUF spec
    /// "Standardized key-value pairs"), with `tie_word_embeddings` true when the file
    /// has no `output.weight` tensor.
    ///
    /// # Errors
    /// [`ModelError::Gguf`] for a missing or mistyped key (named in the message),
    /// [`ModelError::UnknownArchitecture`], [`ModelError::Unsupported`] for RoPE scaling.
    pub fn from_gguf(g: &GgufFile, path: &Path) -> Result<Self, ModelError> {
        Family::from_name(g.architecture()?)?
            .spec()
            .config_from_gguf(g, path)
    }
}

impl Config {
    /// Checks the hyper-parameters are consistent and within sane bounds, so that no
    /// later size computation can overflow or divide by zero.
    pub(crate) fn validate(&self) -> Result<(), String> {
        let dims = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (k, x) in dims {
            check_dim(k, x)?;
        }
        if self.num_hidden_layers > 4096 || self.num_attention_heads > 4096 {
            return Err("too many layers or heads".into());
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim {} is odd; RoPE needs pairs",
                self.head_dim
            ));
        }
        for id in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if *id as usize >= self.vocab_size {
                return Err(format!(
                    "special token id {id} is outside the vocabulary of {}",
                    self.vocab_size
                ));
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(format!(
                "rms_norm_eps {} is not a finite non-negative number",
                self.rms_norm_eps
            ));
        }
        if self.rope_theta.iter().any(|t| !(t.is_finite() && *t > 0.0)) {
            return Err("rope_theta is not a finite positive number".into());
        }
        Ok(())
    }
}
