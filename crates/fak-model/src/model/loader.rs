//! Loading a model: [`Model::load`], [`Model::from_source_with`] and their variants read
//! every tensor of the architecture from a [`WeightSource`] and refuse a file with a
//! tensor the architecture does not use.

use super::{LayerWeights, Model, Weight, WeightMode, PREFILL_CHUNK};
use crate::source::WeightSource;
use crate::{Config, ModelError};
use fak_tensor::{RopeTable, Threads};
use std::path::Path;

impl Model {
    /// Loads a model from a GGUF file or a safetensors folder (see [`WeightSource::open`]),
    /// dequantizing or widening every weight to `f32` (the exact path).
    ///
    /// # Errors
    /// Any [`ModelError`] from reading the files, the config, or a missing / misshapen
    /// tensor.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::load_with(path, WeightMode::Exact)
    }

    /// [`Model::load`] keeping the weights as `mode` says ([`WeightMode::Native`]: the
    /// large matrices stay in the memory map, quantized or F32).
    ///
    /// # Errors
    /// As [`Model::load`].
    pub fn load_with(path: &Path, mode: WeightMode) -> Result<Self, ModelError> {
        let (src, cfg) = WeightSource::open(path)?;
        Self::from_source_with(&src, cfg, mode)
    }

    /// Builds the model from an opened source (exact path).
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] / [`ModelError::ShapeMismatch`] / reader errors.
    pub fn from_source(src: &WeightSource, config: Config) -> Result<Self, ModelError> {
        Self::from_source_with(src, config, WeightMode::Exact)
    }

    /// Builds the model from an opened source, keeping the weights as `mode` says.
    ///
    /// # Errors
    /// As [`Model::from_source`].
    pub fn from_source_with(
        src: &WeightSource,
        config: Config,
        mode: WeightMode,
    ) -> Result<Self, ModelError> {
        let c = &config;
        // A matrix in native mode: quantized when its type has a kernel, read in place
        // when it is F32 that can be borrowed, else an f32 copy.
        let mat = |name: &str, shape: [usize; 2]| -> Result<Weight, ModelError> {
            if mode == WeightMode::Native {
                if let Some(q) = src.quantized(name, shape, c)? {
                    return Ok(Weight::Quant(q));
                }
                if let Some(m) = src.mapped_f32(name, shape, c)? {
                    return Ok(Weight::Mapped(m));
                }
            }
            Ok(Weight::Dense(src.load(name, &shape, c)?))
        };
        let (h, q, kv, ff, v) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.vocab_size,
        );
        let embed_tokens = mat("model.embed_tokens.weight", [v, h])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let hd = c.head_dim;
            let qkv_bias = if c.attention_bias {
                Some((
                    src.load(&p("self_attn.q_proj.bias"), &[q], c)?,
                    src.load(&p("self_attn.k_proj.bias"), &[kv], c)?,
                    src.load(&p("self_attn.v_proj.bias"), &[kv], c)?,
                ))
            } else {
                None
            };
            let qk_norm = if c.qk_norm {
                Some((
                    src.load(&p("self_attn.q_norm.weight"), &[hd], c)?,
                    src.load(&p("self_attn.k_norm.weight"), &[hd], c)?,
                ))
            } else {
                None
            };
            let (attn_out_norm, mlp_norm, mlp_out_norm) = if c.post_norms {
                (
                    Some(src.load(&p("post_attention_layernorm.weight"), &[h], c)?),
                    src.load(&p("pre_feedforward_layernorm.weight"), &[h], c)?,
                    Some(src.load(&p("post_feedforward_layernorm.weight"), &[h], c)?),
                )
            } else {
                (
                    None,
                    src.load(&p("post_attention_layernorm.weight"), &[h], c)?,
                    None,
                )
            };
            let q_proj = mat(&p("self_attn.q_proj.weight"), [q, h])?;
            let k_proj = mat(&p("self_attn.k_proj.weight"), [kv, h])?;
            let v_proj = mat(&p("self_attn.v_proj.weight"), [kv, h])?;
            let o_proj = mat(&p("self_attn.o_proj.weight"), [h, q])?;
            let gate_proj = mat(&p("mlp.gate_proj.weight"), [ff, h])?;
            let up_proj = mat(&p("mlp.up_proj.weight"), [ff, h])?;
            let down_proj = mat(&p("mlp.down_proj.weight"), [h, ff])?;
            layers.push(LayerWeights {
                input_norm: src.load(&p("input_layernorm.weight"), &[h], c)?,
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                qkv_bias,
                qk_norm,
                attn_out_norm,
                mlp_norm,
                mlp_out_norm,
                gate_proj,
                up_proj,
                down_proj,
            });
        }
        let norm = src.load("model.norm.weight", &[h], c)?;
        let lm_head = if src.contains("lm_head.weight") && !c.tie_word_embeddings {
            Some(mat("lm_head.weight", [v, h])?)
        } else if c.tie_word_embeddings {
            None
        } else {
            return Err(ModelError::MissingTensor("lm_head.weight".into()));
        };
        // Every tensor in the file must be one the architecture uses: a tensor fak would
        // silently ignore (a bias, an extra layer) means the model is not what fak runs.
        let mut used: Vec<String> = vec![
            "model.embed_tokens.weight".into(),
            "model.norm.weight".into(),
        ];
        if lm_head.is_some() {
            used.push("lm_head.weight".into());
        }
        for l in 0..c.num_hidden_layers {
            let mut parts = vec![
                "input_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "post_attention_layernorm.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            ];
            if c.attention_bias {
                parts.extend([
                    "self_attn.q_proj.bias",
                    "self_attn.k_proj.bias",
                    "self_attn.v_proj.bias",
                ]);
            }
            if c.qk_norm {
                parts.extend(["self_attn.q_norm.weight", "self_attn.k_norm.weight"]);
            }
            if c.post_norms {
                parts.extend([
                    "pre_feedforward_layernorm.weight",
                    "post_feedforward_layernorm.weight",
                ]);
            }
            for s in parts {
                used.push(format!("model.layers.{l}.{s}"));
            }
        }
        let used: std::collections::HashSet<String> = used.into_iter().collect();
        // A tied checkpoint may still store lm_head (a copy of the embedding) and HF
        // rotary buffers may be saved; both are harmless.
        let harmless = |n: &str| n == "lm_head.weight" || n.ends_with("rotary_emb.inv_freq");
        if let Some(extra) = src
            .entries()
            .into_iter()
            .find(|e| !used.contains(&e.name) && !harmless(&e.name))
        {
            return Err(ModelError::Unsupported(format!(
                "tensor '{}' is not used by the {} architecture with this config (fak would ignore it)",
                extra.name,
                c.family.name()
            )));
        }
        let rope = c
            .rope_theta
            .iter()
            .map(|&t| RopeTable::new(c.head_dim, t))
            .collect();
        Ok(Model {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            threads: Threads::available(),
            prefill_chunk: PREFILL_CHUNK,
            mode,
        })
    }
}
