//! What the Llama-like families share, written once: the `config.json` keys every one
//! of them reads (and the ones fak refuses), the GGUF metadata keys, the derived fields
//! of [`Config`] and its checks, and the decoder layer's base tensor list.

use crate::{Activation, Config, Family, ModelError, Norms};
use fak_weights::{GgufFile, MetaValue};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// The block structure of a family: the [`Config`] switches that are fixed by the
/// family rather than read from a file.
pub(crate) struct Block {
    /// Biases on the q/k/v projections (Qwen2); only such a family accepts
    /// `attention_bias: true` in its `config.json`.
    pub attention_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Where the block's norms sit.
    pub norms: Norms,
    /// Added to every RMSNorm weight (Gemma's `1 + weight`).
    pub norm_weight_offset: f32,
    /// Whether the embedding output is multiplied by `sqrt(hidden)` (Gemma).
    pub scale_embedding: bool,
    /// The MLP's gate activation.
    pub hidden_act: Activation,
    /// `tie_word_embeddings` when `config.json` does not say (HF's per-family default).
    pub tie_by_default: bool,
    /// Whether `use_sliding_window: true` is accepted (the family has sliding layers).
    pub sliding_layers: bool,
    /// Whether `rope_parameters` may hold one object per layer type (Gemma 3).
    pub rope_per_layer_type: bool,
    /// Whether the family reads RoPE scaling itself (Phi-3's longrope): the shared
    /// reader then takes only `rope_theta` from the RoPE objects and leaves their type
    /// and other keys to the family.
    pub scaled_rope: bool,
}

/// The sliding (local) layers of a family that has them (Gemma 3).
pub(crate) struct Local {
    /// The sliding window, in tokens.
    pub window: usize,
    /// Per layer: whether it slides.
    pub sliding: Vec<bool>,
    /// The RoPE base of the sliding layers.
    pub rope_theta: f32,
}

/// The hyper-parameters read from a file (either format), before the derived fields.
pub(crate) struct Core {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    /// An explicit head width (`head_dim`, GGUF `attention.key_length`).
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f32,
    /// The RoPE base of every (non-sliding) layer.
    pub rope_theta: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// `head_dim` when given, else `hidden_size / num_attention_heads` (0 when there are no
/// heads, which [`Config`]'s checks then name).
pub(crate) fn head_dim(explicit: Option<usize>, hidden: usize, heads: usize) -> usize {
    match explicit {
        Some(d) => d,
        None => hidden.checked_div(heads).unwrap_or(0),
    }
}

/// The one place a [`Config`] is assembled: the derived fields (head width, per-layer
/// RoPE bases and windows, attention scale, embedding scale) are computed here for both
/// formats, then the whole is checked.
///
/// `query_pre_attn_scalar`: Gemma's q·k scale `query_pre_attn_scalar^-0.5`; `None` is
/// `head_dim^-0.5`.
pub(crate) fn build(
    family: Family,
    block: &Block,
    core: Core,
    local: Option<Local>,
    query_pre_attn_scalar: Option<f32>,
) -> Result<Config, String> {
    let n = core.num_hidden_layers;
    check_layers(n)?;
    let head_dim = head_dim(core.head_dim, core.hidden_size, core.num_attention_heads);
    let mut sliding_window = vec![None; n];
    let mut rope_theta = vec![core.rope_theta; n];
    if let Some(local) = local {
        for (i, s) in local.sliding.iter().enumerate().take(n) {
            if *s {
                sliding_window[i] = Some(local.window);
                rope_theta[i] = local.rope_theta;
            }
        }
    }
    let attention_scale = match query_pre_attn_scalar {
        Some(q) => (q as f64).powf(-0.5) as f32,
        None => (head_dim as f64).powf(-0.5) as f32,
    };
    let cfg = Config {
        family,
        vocab_size: core.vocab_size,
        hidden_size: core.hidden_size,
        intermediate_size: core.intermediate_size,
        num_hidden_layers: n,
        num_attention_heads: core.num_attention_heads,
        num_key_value_heads: core.num_key_value_heads.unwrap_or(core.num_attention_heads),
        head_dim,
        rms_norm_eps: core.rms_norm_eps,
        rope_theta,
        max_position_embeddings: core.max_position_embeddings,
        rope_scaling: None,
        tie_word_embeddings: core.tie_word_embeddings,
        attention_bias: block.attention_bias,
        qk_norm: block.qk_norm,
        sliding_window,
        norm_weight_offset: block.norm_weight_offset,
        embedding_scale: block
            .scale_embedding
            .then(|| (core.hidden_size as f64).sqrt() as f32),
        hidden_act: block.hidden_act,
        norms: block.norms,
        attention_scale,
        bos_token_id: core.bos_token_id,
        eos_token_ids: core.eos_token_ids,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Layers fak accepts in a config (bounded before any per-layer table is allocated).
const MAX_LAYERS: usize = 4096;

/// `num_hidden_layers` must be in `1..=MAX_LAYERS`.
pub(crate) fn check_layers(n: usize) -> Result<(), String> {
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
pub(crate) fn check_dim(k: &str, x: usize) -> Result<(), String> {
    if x == 0 || x > MAX_DIM {
        return Err(format!("{k} = {x} is out of range"));
    }
    Ok(())
}

// ---------------------------------------------------------------- HF config.json

/// A [`ModelError::Config`] about `path`.
pub(crate) fn config_err(path: &Path, reason: String) -> ModelError {
    ModelError::Config {
        path: path.to_path_buf(),
        reason,
    }
}

/// Deserializes `T` from a parsed `config.json`, naming the offending key on error.
pub(crate) fn de<T: DeserializeOwned>(v: &Value, path: &Path) -> Result<T, ModelError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let key = e.path().to_string();
        config_err(path, format!("key '{key}': {}", e.into_inner()))
    })
}

/// The `config.json` keys that name a feature: each one fak does not implement is
/// refused ([`ModelError::Unsupported`]), never replaced by a default.
#[derive(Deserialize)]
pub(crate) struct HfFeatures {
    /// HF `model_type` (named in messages).
    model_type: String,
    /// transformers >= 5: `{rope_theta, rope_type}` (Gemma 3: one such object per
    /// layer type).
    rope_parameters: Option<Value>,
    /// Older configs: RoPE scaling at the top level.
    rope_scaling: Option<Value>,
    partial_rotary_factor: Option<f64>,
    hidden_act: Option<Value>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    use_sliding_window: Option<bool>,
    final_logit_softcapping: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
}

/// RoPE bases named in `rope_parameters`: every layer's (or the full-attention
/// layers'), and the sliding layers' (per-layer-type form only).
#[derive(Default)]
pub(crate) struct RopeBases {
    pub global: Option<f32>,
    pub local: Option<f32>,
}

impl HfFeatures {
    /// Reads the feature keys of `v`.
    pub fn read(v: &Value, path: &Path) -> Result<Self, ModelError> {
        de(v, path)
    }

    /// Refuses any RoPE variant other than plain RoPE (`rope_parameters`,
    /// `rope_scaling`, `partial_rotary_factor`), unless the family reads the scaling
    /// itself ([`Block::scaled_rope`]), and returns the bases it names.
    pub fn check_rope(&self, block: &Block, path: &Path) -> Result<RopeBases, ModelError> {
        let mut bases = RopeBases::default();
        if let Some(rp) = &self.rope_parameters {
            let per_type = rp.as_object().is_some_and(|o| {
                o.contains_key("full_attention") || o.contains_key("sliding_attention")
            });
            if per_type && block.rope_per_layer_type {
                for (lt, sub) in rp.as_object().into_iter().flatten() {
                    let key = format!("rope_parameters.{lt}");
                    let t = check_rope_object(&key, sub, block.scaled_rope, path)?;
                    match lt.as_str() {
                        "full_attention" => bases.global = t,
                        "sliding_attention" => bases.local = t,
                        other => {
                            return Err(ModelError::Unsupported(format!(
                                "RoPE for layer type '{other}'"
                            )));
                        }
                    }
                }
            } else {
                bases.global = check_rope_object("rope_parameters", rp, block.scaled_rope, path)?;
            }
        }
        if let Some(rs) = &self.rope_scaling {
            check_rope_object("rope_scaling", rs, block.scaled_rope, path)?;
        }
        if let Some(f) = self.partial_rotary_factor.map(|f| f as f32) {
            if f != 1.0 {
                return Err(ModelError::Unsupported(format!(
                    "partial_rotary_factor {f} (partial RoPE)"
                )));
            }
        }
        Ok(bases)
    }

    /// Checks the activation at `key` (`value`, `None` when absent or null) is the
    /// family's `accepted` one; absent means the family's default.
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] for any other activation.
    pub fn check_activation(
        &self,
        key: &str,
        value: Option<&Value>,
        accepted: &str,
    ) -> Result<(), ModelError> {
        match value {
            None | Some(Value::Null) => Ok(()),
            Some(Value::String(a)) if a == accepted => Ok(()),
            Some(x) => Err(ModelError::Unsupported(format!(
                "{key} {x} for {}",
                self.model_type
            ))),
        }
    }

    /// The `hidden_act` key.
    pub fn hidden_act(&self) -> Option<&Value> {
        self.hidden_act.as_ref()
    }

    /// Refuses the block features fak does not implement: `attention_bias` (except a
    /// family with q/k/v biases: Llama's also biases o_proj, which is not
    /// implemented), `mlp_bias`, `use_sliding_window` (except a family with sliding
    /// layers), logit softcapping, mixture of experts.
    pub fn check_block(&self, block: &Block) -> Result<(), ModelError> {
        let mt = &self.model_type;
        if self.attention_bias == Some(true) && !block.attention_bias {
            return Err(ModelError::Unsupported(format!("attention_bias for {mt}")));
        }
        if self.mlp_bias == Some(true) {
            return Err(ModelError::Unsupported(format!("mlp_bias for {mt}")));
        }
        if self.use_sliding_window == Some(true) && !block.sliding_layers {
            return Err(ModelError::Unsupported(format!(
                "use_sliding_window for {mt}"
            )));
        }
        for (k, x) in [
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
        ] {
            if x.is_some() {
                return Err(ModelError::Unsupported(format!("{k} for {mt}")));
            }
        }
        if self.num_local_experts.unwrap_or(0) > 0 || self.num_experts.unwrap_or(0) > 0 {
            return Err(ModelError::Unsupported("mixture of experts".into()));
        }
        Ok(())
    }
}

/// Checks one RoPE object (`rope_parameters`, one of its per-layer-type entries, or
/// `rope_scaling`) asks for plain RoPE (any type when `family_scaled`: the family reads
/// the rest), and returns its `rope_theta`.
fn check_rope_object(
    key: &str,
    rs: &Value,
    family_scaled: bool,
    path: &Path,
) -> Result<Option<f32>, ModelError> {
    let Some(obj) = rs.as_object() else {
        return Err(ModelError::Unsupported(format!(
            "'{key}' = {rs} in {}",
            path.display()
        )));
    };
    let kind = match obj.get("rope_type").or_else(|| obj.get("type")) {
        None | Some(Value::Null) => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(x) => {
            return Err(config_err(
                path,
                format!("{key}.rope_type is {x}, not a string"),
            ))
        }
    };
    if kind != "default" && !family_scaled {
        return Err(ModelError::Unsupported(format!(
            "RoPE type '{kind}' in {}",
            path.display()
        )));
    }
    let plain_key = |k: &String| matches!(k.as_str(), "rope_type" | "type" | "rope_theta");
    if let Some(extra) = obj.keys().find(|k| !family_scaled && !plain_key(k)) {
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
            .ok_or_else(|| config_err(path, format!("{key}.rope_theta is not a number"))),
    }
}

/// One token id or a list of them (HF `eos_token_id` is either).
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

/// The hyper-parameter keys of `config.json` every Llama-like family reads.
#[derive(Deserialize)]
pub(crate) struct HfCore {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    /// HF's documented default base for Llama is 10000.
    rope_theta: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
}

impl HfCore {
    /// Reads the keys of `v`, checking the layer count before anything is sized by it.
    pub fn read(v: &Value, path: &Path) -> Result<Self, ModelError> {
        let core: Self = de(v, path)?;
        check_layers(core.num_hidden_layers).map_err(|r| config_err(path, r))?;
        Ok(core)
    }

    /// Layers of the model (checked by [`HfCore::read`]).
    pub fn num_hidden_layers(&self) -> usize {
        self.num_hidden_layers
    }

    /// The [`Core`], with `rope_theta` the base `rope_parameters` named (if it did),
    /// else the top-level `rope_theta`, else 10000.
    pub fn into_core(self, block: &Block, rope_theta: Option<f32>) -> Core {
        Core {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rms_norm_eps: self.rms_norm_eps.map_or(1e-6, |x| x as f32),
            rope_theta: rope_theta
                .or(self.rope_theta.map(|t| t as f32))
                .unwrap_or(10000.0),
            max_position_embeddings: self.max_position_embeddings.unwrap_or(2048),
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(block.tie_by_default),
            bos_token_id: self.bos_token_id,
            eos_token_ids: match self.eos_token_id {
                None => vec![],
                Some(TokenIds::One(id)) => vec![id],
                Some(TokenIds::Many(ids)) => ids,
            },
        }
    }
}

/// A Llama-like family's `config.json` with no keys of its own: the features checked,
/// the shared keys read, the derived fields computed.
pub(crate) fn config_from_hf(
    family: Family,
    block: &Block,
    v: &Value,
    path: &Path,
) -> Result<Config, ModelError> {
    let features = HfFeatures::read(v, path)?;
    let bases = features.check_rope(block, path)?;
    features.check_activation("hidden_act", features.hidden_act(), "silu")?;
    features.check_block(block)?;
    let core = HfCore::read(v, path)?.into_core(block, bases.global);
    build(family, block, core, None, None).map_err(|r| config_err(path, r))
}

// ---------------------------------------------------------------- GGUF metadata

/// A GGUF file's `<arch>.*` metadata keys (GGUF spec, "Standardized key-value pairs").
pub(crate) struct GgufKeys<'a> {
    g: &'a GgufFile,
    arch: String,
}

impl<'a> GgufKeys<'a> {
    /// The keys of `g` under its `general.architecture`.
    pub fn new(g: &'a GgufFile) -> Result<Self, ModelError> {
        Ok(Self {
            g,
            arch: g.architecture()?.to_string(),
        })
    }

    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    /// Required integer key `<arch>.k`.
    pub fn u(&self, k: &str) -> Result<usize, ModelError> {
        Ok(self.g.get_u64(&self.key(k))? as usize)
    }

    /// Optional integer key `<arch>.k`.
    pub fn opt_u(&self, k: &str) -> Result<Option<usize>, ModelError> {
        match self.g.get(&self.key(k)) {
            None => Ok(None),
            Some(_) => Ok(Some(self.g.get_u64(&self.key(k))? as usize)),
        }
    }

    /// Optional float key `<arch>.k`.
    pub fn opt_f(&self, k: &str) -> Result<Option<f32>, ModelError> {
        match self.g.get(&self.key(k)) {
            None => Ok(None),
            Some(_) => Ok(Some(self.g.get_f32(&self.key(k))?)),
        }
    }
}

/// A Llama-like family's config from GGUF metadata, with `tie_word_embeddings` true
/// when the file has no `output.weight` tensor. `local` reads a family's sliding
/// layers (given the keys and the layer count), `query_pre_attn_scalar` is as in
/// [`build`].
pub(crate) fn config_from_gguf(
    family: Family,
    block: &Block,
    g: &GgufFile,
    path: &Path,
    local: impl FnOnce(&GgufKeys<'_>, usize) -> Result<Option<Local>, ModelError>,
    query_pre_attn_scalar: Option<f32>,
) -> Result<Config, ModelError> {
    let m = GgufKeys::new(g)?;
    match g.get(&m.key("rope.scaling.type")) {
        None => {}
        Some(MetaValue::String(s)) if s == "none" => {}
        Some(MetaValue::String(s)) => {
            return Err(ModelError::Unsupported(format!("rope scaling type '{s}'")));
        }
        Some(x) => {
            return Err(ModelError::Unsupported(format!("rope scaling type {x:?}")));
        }
    }
    if let Some(f) = m.opt_f("rope.scaling.factor")? {
        if f != 1.0 && f != 0.0 {
            return Err(ModelError::Unsupported(format!("rope scaling factor {f}")));
        }
    }
    if m.opt_u("expert_count")?.unwrap_or(0) > 0 {
        return Err(ModelError::Unsupported("mixture of experts".into()));
    }
    let hidden_size = m.u("embedding_length")?;
    let num_attention_heads = m.u("attention.head_count")?;
    let num_hidden_layers = m.u("block_count")?;
    check_layers(num_hidden_layers).map_err(|r| config_err(path, r))?;
    // Range-checked before head_dim is derived from them, so that a zero or huge
    // value is named as such rather than reported as a RoPE mismatch.
    for (k, x) in [
        ("hidden_size", hidden_size),
        ("num_attention_heads", num_attention_heads),
    ] {
        check_dim(k, x).map_err(|r| config_err(path, r))?;
    }
    let explicit_head_dim = m.opt_u("attention.key_length")?;
    let hd = head_dim(explicit_head_dim, hidden_size, num_attention_heads);
    if let Some(rot) = m.opt_u("rope.dimension_count")? {
        if rot != hd {
            return Err(ModelError::Unsupported(format!(
                "partial RoPE: rope.dimension_count {rot} of head_dim {hd}"
            )));
        }
    }
    let vocab_size = match m.opt_u("vocab_size")? {
        Some(n) => n,
        None => g
            .get("tokenizer.ggml.tokens")
            .and_then(MetaValue::as_array)
            .map(|a| a.len())
            .ok_or_else(|| {
                config_err(
                    path,
                    format!("no '{}' and no tokenizer.ggml.tokens", m.key("vocab_size")),
                )
            })?,
    };
    let rope_theta = m.opt_f("rope.freq_base")?.unwrap_or(10000.0);
    let local = local(&m, num_hidden_layers)?;
    let tok_id = |k: &str| -> Result<Option<u32>, ModelError> {
        match g.get(k) {
            None => Ok(None),
            Some(_) => {
                let id = g.get_u64(k)?;
                u32::try_from(id)
                    .map(Some)
                    .map_err(|_| config_err(path, format!("{k} = {id} is not a token id")))
            }
        }
    };
    let core = Core {
        vocab_size,
        hidden_size,
        intermediate_size: m.u("feed_forward_length")?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads: m.opt_u("attention.head_count_kv")?,
        head_dim: explicit_head_dim,
        rms_norm_eps: m.opt_f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
        rope_theta,
        max_position_embeddings: m.u("context_length")?,
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        bos_token_id: tok_id("tokenizer.ggml.bos_token_id")?,
        eos_token_ids: tok_id("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
    };
    build(family, block, core, local, query_pre_attn_scalar).map_err(|r| config_err(path, r))
}

// ---------------------------------------------------------------- tensors

/// The GGUF block parts every Llama-like family shares (llama.cpp
/// `gguf-py/gguf/tensor_mapping.py`, LLAMA), as HF names after `model.layers.N.`:
/// fak-weights' table, which its `gguf_to_hf_name` uses too. `ffn_norm` is the norm
/// before the MLP: Llama's `post_attention_layernorm`.
pub(crate) fn llama_block_part(part: &str) -> Option<&'static str> {
    fak_weights::gguf_llama_block_part(part)
}

/// Llama's decoder layer (`LlamaDecoderLayer`): two norms, the four attention
/// projections, the three MLP projections, with their shapes under `c`.
pub(crate) fn llama_layer_tensors(c: &Config) -> Vec<super::LayerTensor> {
    let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    vec![
        ("input_layernorm.weight", vec![h]),
        ("self_attn.q_proj.weight", vec![q, h]),
        ("self_attn.k_proj.weight", vec![kv, h]),
        ("self_attn.v_proj.weight", vec![kv, h]),
        ("self_attn.o_proj.weight", vec![h, q]),
        ("post_attention_layernorm.weight", vec![h]),
        ("mlp.gate_proj.weight", vec![ff, h]),
        ("mlp.up_proj.weight", vec![ff, h]),
        ("mlp.down_proj.weight", vec![h, ff]),
    ]
}

/// The per-head q/k RMSNorm gains (Qwen3, Gemma 3), `[head_dim]` each.
pub(crate) fn qk_norm_tensors(c: &Config) -> [super::LayerTensor; 2] {
    [
        ("self_attn.q_norm.weight", vec![c.head_dim]),
        ("self_attn.k_norm.weight", vec![c.head_dim]),
    ]
}
