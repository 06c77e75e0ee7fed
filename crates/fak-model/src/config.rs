//! Model configuration, read from an HF `config.json` or from GGUF metadata.
//!
//! One struct serves every family: the switches the other families need (attention
//! bias, QK-norm, explicit head_dim, per-layer sliding window and RoPE base, the norm
//! weight offset, an embedding scale, the activation) default to Llama's values, so a
//! new family adds branches, not a rewrite. Anything a checkpoint asks for that fak does
//! not implement (RoPE scaling, mixture of experts, ...) is refused here with
//! [`ModelError::Unsupported`], never replaced by a default.

use crate::ModelError;
use fak_weights::{GgufFile, MetaValue};
use serde_json::Value;
use std::path::Path;

/// The model families fak implements. Names follow HF's `model_type`.
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
}

impl Family {
    /// HF `model_type` / GGUF `general.architecture` string.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
        }
    }

    /// The family of an HF `model_type` / GGUF architecture name.
    ///
    /// # Errors
    /// [`ModelError::UnknownArchitecture`] for a name fak does not implement.
    pub fn from_name(name: &str) -> Result<Self, ModelError> {
        match name {
            "llama" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            "gemma3" | "gemma3_text" => Ok(Family::Gemma3),
            other => Err(ModelError::UnknownArchitecture(other.to_string())),
        }
    }
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// SiLU, making the MLP SwiGLU (Shazeer 2020); HF `hidden_act: "silu"`.
    Silu,
    /// GELU with the tanh approximation, making the MLP GeGLU; HF `gelu_pytorch_tanh`.
    GeluTanh,
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
    /// Whether the logits head reuses the token embedding (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Bias on the q/k/v projections (Qwen2). Llama: false.
    pub attention_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma3). Llama: false.
    pub qk_norm: bool,
    /// Sliding attention window per layer, in tokens; `None` is full causal attention.
    pub sliding_window: Vec<Option<usize>>,
    /// Added to every RMSNorm weight (Gemma's `1 + weight`); 0 for Llama.
    pub norm_weight_offset: f32,
    /// Multiplier on the embedding output (Gemma's `sqrt(hidden)`); `None` for Llama.
    pub embedding_scale: Option<f32>,
    /// The MLP activation.
    pub hidden_act: Activation,
    /// Gemma's extra norms: `post_attention_layernorm` after attention and
    /// `pre_feedforward_layernorm` / `post_feedforward_layernorm` around the MLP.
    pub post_norms: bool,
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
        let err = |reason: String| ModelError::Config {
            path: path.to_path_buf(),
            reason,
        };
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| err("missing string key 'model_type'".into()))?;
        let family = Family::from_name(model_type)?;
        let usize_key = |k: &str| -> Result<usize, ModelError> {
            v.get(k)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| err(format!("missing or non-integer key '{k}'")))
        };
        let opt_usize = |k: &str| -> Result<Option<usize>, ModelError> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .map(|x| Some(x as usize))
                    .ok_or_else(|| err(format!("key '{k}' is not a non-negative integer"))),
            }
        };
        let opt_f32 = |k: &str| -> Result<Option<f32>, ModelError> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(|x| Some(x as f32))
                    .ok_or_else(|| err(format!("key '{k}' is not a number"))),
            }
        };
        let opt_bool = |k: &str| -> Result<Option<bool>, ModelError> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Bool(b)) => Ok(Some(*b)),
                Some(x) => Err(err(format!("key '{k}' is {x}, not true or false"))),
            }
        };
        // Anything about RoPE fak does not implement is refused, never defaulted.
        // transformers >= 5 writes `rope_parameters: {rope_theta, rope_type}` (Gemma 3:
        // one such object per layer type); older configs write `rope_theta` and
        // `rope_scaling` at the top level.
        let check_rope = |key: &str, rs: &Value| -> Result<Option<f32>, ModelError> {
            let Some(obj) = rs.as_object() else {
                return Err(ModelError::Unsupported(format!(
                    "'{key}' = {rs} in {}",
                    path.display()
                )));
            };
            let kind = match obj.get("rope_type").or_else(|| obj.get("type")) {
                None | Some(Value::Null) => "default",
                Some(Value::String(s)) => s.as_str(),
                Some(x) => return Err(err(format!("{key}.rope_type is {x}, not a string"))),
            };
            if kind != "default" {
                return Err(ModelError::Unsupported(format!(
                    "RoPE type '{kind}' in {}",
                    path.display()
                )));
            }
            if let Some(extra) = obj
                .keys()
                .find(|k| !matches!(k.as_str(), "rope_type" | "type" | "rope_theta"))
            {
                return Err(ModelError::Unsupported(format!(
                    "RoPE parameter '{key}.{extra}' in {} (fak implements plain RoPE only)",
                    path.display()
                )));
            }
            match obj.get("rope_theta") {
                None | Some(Value::Null) => Ok(None),
                Some(t) => t
                    .as_f64()
                    .map(|t| Some(t as f32))
                    .ok_or_else(|| err(format!("{key}.rope_theta is not a number"))),
            }
        };
        let mut theta_global: Option<f32> = None;
        let mut theta_local: Option<f32> = None;
        if let Some(rp) = v.get("rope_parameters").filter(|x| !x.is_null()) {
            let per_type = rp.as_object().is_some_and(|o| {
                o.contains_key("full_attention") || o.contains_key("sliding_attention")
            });
            if per_type && family == Family::Gemma3 {
                for (lt, sub) in rp.as_object().into_iter().flatten() {
                    let t = check_rope(&format!("rope_parameters.{lt}"), sub)?;
                    match lt.as_str() {
                        "full_attention" => theta_global = t,
                        "sliding_attention" => theta_local = t,
                        other => {
                            return Err(ModelError::Unsupported(format!(
                                "RoPE for layer type '{other}'"
                            )));
                        }
                    }
                }
            } else {
                theta_global = check_rope("rope_parameters", rp)?;
            }
        }
        if let Some(rs) = v.get("rope_scaling").filter(|x| !x.is_null()) {
            check_rope("rope_scaling", rs)?;
        }
        if let Some(f) = opt_f32("partial_rotary_factor")? {
            if f != 1.0 {
                return Err(ModelError::Unsupported(format!(
                    "partial_rotary_factor {f} (partial RoPE)"
                )));
            }
        }
        // The activation: SiLU for Llama/Qwen, tanh-GELU for Gemma (`hidden_activation`).
        let act_key = if family == Family::Gemma3 && v.get("hidden_activation").is_some() {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        let hidden_act = match (family, v.get(act_key)) {
            (Family::Gemma3, None | Some(Value::Null)) => Activation::GeluTanh,
            (_, None | Some(Value::Null)) => Activation::Silu,
            (Family::Gemma3, Some(Value::String(a))) if a == "gelu_pytorch_tanh" => {
                Activation::GeluTanh
            }
            (f, Some(Value::String(a))) if a == "silu" && f != Family::Gemma3 => Activation::Silu,
            (_, Some(x)) => {
                return Err(ModelError::Unsupported(format!(
                    "{act_key} {x} for {model_type}"
                )));
            }
        };
        // Qwen2 has q/k/v biases (implemented); Llama's `attention_bias` also biases o_proj
        // (not implemented), so it is refused.
        if opt_bool("attention_bias")? == Some(true) && family != Family::Qwen2 {
            return Err(ModelError::Unsupported(format!(
                "attention_bias for {model_type}"
            )));
        }
        if opt_bool("mlp_bias")? == Some(true) {
            return Err(ModelError::Unsupported(format!(
                "mlp_bias for {model_type}"
            )));
        }
        if opt_bool("use_sliding_window")? == Some(true) && family != Family::Gemma3 {
            return Err(ModelError::Unsupported(format!(
                "use_sliding_window for {model_type}"
            )));
        }
        for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if opt_f32(k)?.is_some() {
                return Err(ModelError::Unsupported(format!("{k} for {model_type}")));
            }
        }
        if opt_usize("num_local_experts")?.unwrap_or(0) > 0
            || opt_usize("num_experts")?.unwrap_or(0) > 0
        {
            return Err(ModelError::Unsupported("mixture of experts".into()));
        }
        let hidden_size = usize_key("hidden_size")?;
        let num_attention_heads = usize_key("num_attention_heads")?;
        let num_hidden_layers = usize_key("num_hidden_layers")?;
        check_layers(num_hidden_layers).map_err(err)?;
        let head_dim = match opt_usize("head_dim")? {
            Some(d) => d,
            None => hidden_size.checked_div(num_attention_heads).unwrap_or(0),
        };
        // HF's documented default base for Llama.
        let theta = match theta_global {
            Some(t) => t,
            None => opt_f32("rope_theta")?.unwrap_or(10000.0),
        };
        let token_id = |x: &Value| x.as_u64().and_then(|i| u32::try_from(i).ok());
        let eos_token_ids =
            match v.get("eos_token_id") {
                None | Some(Value::Null) => vec![],
                Some(Value::Array(a)) => a
                    .iter()
                    .map(token_id)
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        err("eos_token_id list holds a value that is not a token id".into())
                    })?,
                Some(x) => vec![token_id(x)
                    .ok_or_else(|| err(format!("eos_token_id {x} is not a token id")))?],
            };
        let gemma = family == Family::Gemma3;
        // Gemma 3: which layers slide (`layer_types`, else every `sliding_window_pattern`-th
        // layer is global) and the local RoPE base.
        let mut sliding_window = vec![None; num_hidden_layers];
        let mut rope_theta = vec![theta; num_hidden_layers];
        if gemma {
            let w = opt_usize("sliding_window")?
                .ok_or_else(|| err("gemma3 config lacks 'sliding_window'".into()))?;
            let local = match theta_local {
                Some(t) => t,
                None => opt_f32("rope_local_base_freq")?.unwrap_or(GEMMA3_LOCAL_ROPE_BASE),
            };
            let sliding: Vec<bool> = match v.get("layer_types").filter(|x| !x.is_null()) {
                Some(Value::Array(a)) if a.len() == num_hidden_layers => a
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Ok(true),
                        Some("full_attention") => Ok(false),
                        _ => Err(err(format!("layer_types holds {t}"))),
                    })
                    .collect::<Result<_, _>>()?,
                Some(x) => {
                    return Err(err(format!(
                        "layer_types {x} does not list {num_hidden_layers} layers"
                    )))
                }
                None => {
                    let every = opt_usize("sliding_window_pattern")?
                        .unwrap_or(GEMMA3_SLIDING_PATTERN)
                        .max(1);
                    (0..num_hidden_layers)
                        .map(|i| (i + 1) % every != 0)
                        .collect()
                }
            };
            for (i, s) in sliding.iter().enumerate() {
                if *s {
                    sliding_window[i] = Some(w);
                    rope_theta[i] = local;
                }
            }
        }
        let attention_scale = if gemma {
            let q = opt_f32("query_pre_attn_scalar")?.unwrap_or(GEMMA3_QUERY_PRE_ATTN_SCALAR);
            (q as f64).powf(-0.5) as f32
        } else {
            (head_dim as f64).powf(-0.5) as f32
        };
        let cfg = Config {
            family,
            vocab_size: usize_key("vocab_size")?,
            hidden_size,
            intermediate_size: usize_key("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads),
            head_dim,
            rms_norm_eps: opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            max_position_embeddings: opt_usize("max_position_embeddings")?.unwrap_or(2048),
            tie_word_embeddings: opt_bool("tie_word_embeddings")?.unwrap_or(gemma),
            attention_bias: family == Family::Qwen2,
            qk_norm: matches!(family, Family::Qwen3 | Family::Gemma3),
            sliding_window,
            norm_weight_offset: if gemma { 1.0 } else { 0.0 },
            embedding_scale: gemma.then(|| (hidden_size as f64).sqrt() as f32),
            hidden_act,
            post_norms: gemma,
            attention_scale,
            bos_token_id: match v.get("bos_token_id") {
                None | Some(Value::Null) => None,
                Some(x) => Some(
                    token_id(x)
                        .ok_or_else(|| err(format!("bos_token_id {x} is not a token id")))?,
                ),
            },
            eos_token_ids,
        };
        cfg.validate().map_err(err)?;
        Ok(cfg)
    }

    /// Reads the config from a GGUF file's metadata (`<arch>.*` keys, GGUF spec
    /// "Standardized key-value pairs"), with `tie_word_embeddings` true when the file
    /// has no `output.weight` tensor.
    ///
    /// # Errors
    /// [`ModelError::Gguf`] for a missing or mistyped key (named in the message),
    /// [`ModelError::UnknownArchitecture`], [`ModelError::Unsupported`] for RoPE scaling.
    pub fn from_gguf(g: &GgufFile, path: &Path) -> Result<Self, ModelError> {
        let arch = g.architecture()?.to_string();
        let family = Family::from_name(&arch)?;
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| -> Result<usize, ModelError> { Ok(g.get_u64(&key(k))? as usize) };
        let opt_u = |k: &str| -> Result<Option<usize>, ModelError> {
            match g.get(&key(k)) {
                None => Ok(None),
                Some(_) => Ok(Some(g.get_u64(&key(k))? as usize)),
            }
        };
        let opt_f = |k: &str| -> Result<Option<f32>, ModelError> {
            match g.get(&key(k)) {
                None => Ok(None),
                Some(_) => Ok(Some(g.get_f32(&key(k))?)),
            }
        };
        match g.get(&key("rope.scaling.type")) {
            None => {}
            Some(MetaValue::String(s)) if s == "none" => {}
            Some(MetaValue::String(s)) => {
                return Err(ModelError::Unsupported(format!("rope scaling type '{s}'")));
            }
            Some(x) => {
                return Err(ModelError::Unsupported(format!("rope scaling type {x:?}")));
            }
        }
        if let Some(f) = opt_f("rope.scaling.factor")? {
            if f != 1.0 && f != 0.0 {
                return Err(ModelError::Unsupported(format!("rope scaling factor {f}")));
            }
        }
        if opt_u("expert_count")?.unwrap_or(0) > 0 {
            return Err(ModelError::Unsupported("mixture of experts".into()));
        }
        let hidden_size = u("embedding_length")?;
        let num_attention_heads = u("attention.head_count")?;
        let num_hidden_layers = u("block_count")?;
        check_layers(num_hidden_layers).map_err(|reason| ModelError::Config {
            path: path.to_path_buf(),
            reason,
        })?;
        // Range-checked before head_dim is derived from them, so that a zero or huge
        // value is named as such rather than reported as a RoPE mismatch.
        for (k, x) in [
            ("hidden_size", hidden_size),
            ("num_attention_heads", num_attention_heads),
        ] {
            check_dim(k, x).map_err(|reason| ModelError::Config {
                path: path.to_path_buf(),
                reason,
            })?;
        }
        let head_dim = match opt_u("attention.key_length")? {
            Some(d) => d,
            None => hidden_size.checked_div(num_attention_heads).unwrap_or(0),
        };
        if let Some(rot) = opt_u("rope.dimension_count")? {
            if rot != head_dim {
                return Err(ModelError::Unsupported(format!(
                    "partial RoPE: rope.dimension_count {rot} of head_dim {head_dim}"
                )));
            }
        }
        let vocab_size = match opt_u("vocab_size")? {
            Some(n) => n,
            None => g
                .get("tokenizer.ggml.tokens")
                .and_then(MetaValue::as_array)
                .map(|a| a.len())
                .ok_or_else(|| ModelError::Config {
                    path: path.to_path_buf(),
                    reason: format!("no '{arch}.vocab_size' and no tokenizer.ggml.tokens"),
                })?,
        };
        let theta = opt_f("rope.freq_base")?.unwrap_or(10000.0);
        let gemma = family == Family::Gemma3;
        // Gemma 3 files store the sliding window but not which layers slide nor their
        // RoPE base: HF's defaults (named below) decide, as transformers does on load.
        let mut sliding_window = vec![None; num_hidden_layers];
        let mut rope_theta = vec![theta; num_hidden_layers];
        if gemma {
            let w = u("attention.sliding_window")?;
            for i in 0..num_hidden_layers {
                if (i + 1) % GEMMA3_SLIDING_PATTERN != 0 {
                    sliding_window[i] = Some(w);
                    rope_theta[i] = GEMMA3_LOCAL_ROPE_BASE;
                }
            }
        }
        let attention_scale = if gemma {
            (GEMMA3_QUERY_PRE_ATTN_SCALAR as f64).powf(-0.5) as f32
        } else {
            (head_dim as f64).powf(-0.5) as f32
        };
        let tok_id = |k: &str| -> Result<Option<u32>, ModelError> {
            match g.get(k) {
                None => Ok(None),
                Some(_) => {
                    let id = g.get_u64(k)?;
                    u32::try_from(id).map(Some).map_err(|_| ModelError::Config {
                        path: path.to_path_buf(),
                        reason: format!("{k} = {id} is not a token id"),
                    })
                }
            }
        };
        let cfg = Config {
            family,
            vocab_size,
            hidden_size,
            intermediate_size: u("feed_forward_length")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: opt_u("attention.head_count_kv")?.unwrap_or(num_attention_heads),
            head_dim,
            rms_norm_eps: opt_f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
            rope_theta,
            max_position_embeddings: u("context_length")?,
            tie_word_embeddings: g.tensor("output.weight").is_none(),
            attention_bias: family == Family::Qwen2,
            qk_norm: matches!(family, Family::Qwen3 | Family::Gemma3),
            sliding_window,
            norm_weight_offset: if gemma { 1.0 } else { 0.0 },
            embedding_scale: gemma.then(|| (hidden_size as f64).sqrt() as f32),
            hidden_act: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            post_norms: gemma,
            attention_scale,
            bos_token_id: tok_id("tokenizer.ggml.bos_token_id")?,
            eos_token_ids: tok_id("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
        };
        cfg.validate().map_err(|reason| ModelError::Config {
            path: path.to_path_buf(),
            reason,
        })?;
        Ok(cfg)
    }
}

/// Gemma 3's RoPE base for sliding (local) layers when the checkpoint does not say (HF
/// `Gemma3TextConfig.rope_local_base_freq` default).
pub const GEMMA3_LOCAL_ROPE_BASE: f32 = 10000.0;
/// Gemma 3's local:global layer pattern when the checkpoint does not say: every sixth
/// layer is global (HF `sliding_window_pattern` default 6).
pub const GEMMA3_SLIDING_PATTERN: usize = 6;
/// Gemma 3's `query_pre_attn_scalar` when the checkpoint does not say (HF default 256).
pub const GEMMA3_QUERY_PRE_ATTN_SCALAR: f32 = 256.0;

/// Layers fak accepts in a config (bounded before any per-layer table is allocated).
const MAX_LAYERS: usize = 4096;

fn check_layers(n: usize) -> Result<(), String> {
    if n == 0 || n > MAX_LAYERS {
        return Err(format!(
            "num_hidden_layers = {n} is out of range (1..={MAX_LAYERS})"
        ));
    }
    Ok(())
}

/// Largest size fak accepts for any one dimension of a config (vocabulary, widths,
/// heads, context), bounding every later size computation.
const MAX_DIM: usize = 1 << 24;

/// `k = x` must be in `1..=MAX_DIM`.
fn check_dim(k: &str, x: usize) -> Result<(), String> {
    if x == 0 || x > MAX_DIM {
        return Err(format!("{k} = {x} is out of range"));
    }
    Ok(())
}

impl Config {
    /// Checks the hyper-parameters are consistent and within sane bounds, so that no
    /// later size computation can overflow or divide by zero.
    fn validate(&self) -> Result<(), String> {
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
