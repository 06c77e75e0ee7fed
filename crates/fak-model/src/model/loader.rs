//! Loading a model: [`Model::load`], [`Model::from_source_with`] and their variants read
//! every tensor of the architecture from a [`WeightSource`] and refuse a file with a
//! tensor the architecture does not use.

use super::{LayerWeights, Model, OpProfile, Weight, WeightMode, PREFILL_CHUNK};
use crate::family::LayerTensor;
use crate::source::WeightSource;
use crate::{Config, ModelError, Norms};
use fak_tensor::{RopeTable, Threads, F16};
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
    /// large matrices kept as the file stores them, quantized, F32 or F16, and copied
    /// once at load into huge pages).
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
        let (h, v) = (c.hidden_size, c.vocab_size);
        // Every matrix the native path reads from the file is copied into the model's
        // huge pages (`WeightArena`), the vocabulary matrices (the embedding, tied or
        // not, and the head) in the layout the CPU's kernels read fastest: the head is
        // the largest product of a step, and a batched step's head reads it once for
        // all sequences. The layers' Q4_1 matrices are repacked too
        // (`Weight::repacked_layer_for_cpu`), the rest copied as the file has them.
        let embed_tokens =
            load_matrix(src, c, mode, "model.embed_tokens.weight", [v, h])?.repacked_for_cpu();
        // The family's per-layer tensor list gives every shape loaded, and the
        // unused-tensor check below uses the same list.
        let listed = c.family.spec().layer_tensors(c);
        let layers = (0..c.num_hidden_layers)
            .map(|l| load_layer(src, c, mode, &listed, l))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = src.load("model.norm.weight", &[h], c)?;
        let lm_head = if src.contains("lm_head.weight") && !c.tie_word_embeddings {
            Some(load_matrix(src, c, mode, "lm_head.weight", [v, h])?.repacked_for_cpu())
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
            for (s, _) in &listed {
                let stored = c.family.spec().fused(s, c).map_or(*s, |f| f.0);
                used.push(format!("model.layers.{l}.{stored}"));
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
        let tables = |factors: Option<&[f32]>| -> Result<Vec<RopeTable>, ModelError> {
            c.rope_theta
                .iter()
                .map(|&t| match (factors, &c.rope_scaling) {
                    (Some(f), Some(s)) => RopeTable::scaled(c.head_dim, t, f, s.attention_factor)
                        .ok_or_else(|| {
                            ModelError::Unsupported(format!(
                                "{} RoPE factors for head_dim {}",
                                f.len(),
                                c.head_dim
                            ))
                        }),
                    _ => Ok(RopeTable::new(c.head_dim, t)),
                })
                .collect()
        };
        let scaling = c.rope_scaling.as_ref();
        let rope = tables(scaling.map(|s| &s.factors[..]))?;
        let rope_long = match scaling.and_then(|s| s.long.as_ref()) {
            Some(l) => Some((
                l.original_max_position_embeddings,
                tables(Some(&l.factors))?,
            )),
            None => None,
        };
        let model = Model {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            rope_long,
            threads: Threads::available(),
            prefill_chunk: PREFILL_CHUNK,
            mode,
            profile: OpProfile::default(),
            read_rope: Default::default(),
        };
        // The file's pages of the copied matrices, mapped around the small tensors read
        // through the map since, leave the resident set.
        for w in model.held() {
            w.release_file_pages();
        }
        src.release_load_pages();
        Ok(model)
    }
}

/// One matrix in `mode`: in native mode quantized when its type has a kernel, kept as
/// F32 or F16 when it is that and its data can be borrowed from the map (both a view of
/// the map until the caller copies it, [`Weight::repacked_for_cpu`]), else (and in
/// exact mode) an `f32` copy.
fn load_matrix(
    src: &WeightSource,
    c: &Config,
    mode: WeightMode,
    name: &str,
    shape: [usize; 2],
) -> Result<Weight, ModelError> {
    if mode == WeightMode::Native {
        if let Some(q) = src.quantized(name, shape, c)? {
            return Ok(Weight::Quant(q));
        }
        if let Some(m) = src.mapped::<f32>(name, shape, c)? {
            return Ok(Weight::Mapped(m));
        }
        if let Some(m) = src.mapped::<F16>(name, shape, c)? {
            return Ok(Weight::MappedF16(m));
        }
    }
    Ok(Weight::Dense(src.load(name, &shape, c)?))
}

/// Decoder layer `l`, every tensor's shape from the family's list `listed`. A name
/// loaded here must be on the list and every name on the list loaded (counted), so the
/// list and the loader cannot drift apart.
///
/// # Errors
/// [`ModelError::Unsupported`] when the loader and the list disagree; reader errors.
fn load_layer(
    src: &WeightSource,
    c: &Config,
    mode: WeightMode,
    listed: &[LayerTensor],
    l: usize,
) -> Result<LayerWeights, ModelError> {
    let p = |s: &str| format!("model.layers.{l}.{s}");
    let loaded = std::cell::Cell::new(0usize);
    let shape = |s: &str| -> Result<&[usize], ModelError> {
        loaded.set(loaded.get() + 1);
        listed
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, d)| d.as_slice())
            .ok_or_else(|| {
                ModelError::Unsupported(format!(
                    "'{s}' is not in the {} tensor list",
                    c.family.name()
                ))
            })
    };
    let tensor = |s: &str| src.load(&p(s), shape(s)?, c);
    // A matrix stored as rows of a fused tensor is those rows: in native mode a view of
    // them in the map, then copied at load on its own.
    let matrix = |s: &str| match *shape(s)? {
        [rows, cols] => match c.family.spec().fused(s, c) {
            None => Ok(load_matrix(src, c, mode, &p(s), [rows, cols])?.repacked_layer_for_cpu()),
            Some((stored, first, total)) => {
                let all = load_matrix(src, c, mode, &p(stored), [total, cols])?;
                Ok(all.row_range(first, rows, cols)?.repacked_layer_for_cpu())
            }
        },
        _ => Err(ModelError::Unsupported(format!(
            "'{s}' is not a matrix in the {} tensor list",
            c.family.name()
        ))),
    };
    let qkv_bias = if c.attention_bias {
        Some((
            tensor("self_attn.q_proj.bias")?,
            tensor("self_attn.k_proj.bias")?,
            tensor("self_attn.v_proj.bias")?,
        ))
    } else {
        None
    };
    let qk_norm = if c.qk_norm {
        Some((
            tensor("self_attn.q_norm.weight")?,
            tensor("self_attn.k_norm.weight")?,
        ))
    } else {
        None
    };
    let (input_norm, attn_out_norm, mlp_norm, mlp_out_norm) = match c.norms {
        Norms::Pre => (
            Some(tensor("input_layernorm.weight")?),
            None,
            Some(tensor("post_attention_layernorm.weight")?),
            None,
        ),
        Norms::Sandwich => (
            Some(tensor("input_layernorm.weight")?),
            Some(tensor("post_attention_layernorm.weight")?),
            Some(tensor("pre_feedforward_layernorm.weight")?),
            Some(tensor("post_feedforward_layernorm.weight")?),
        ),
        Norms::Post => (
            None,
            Some(tensor("post_attention_layernorm.weight")?),
            None,
            Some(tensor("post_feedforward_layernorm.weight")?),
        ),
    };
    let q_proj = matrix("self_attn.q_proj.weight")?;
    let k_proj = matrix("self_attn.k_proj.weight")?;
    let v_proj = matrix("self_attn.v_proj.weight")?;
    let o_proj = matrix("self_attn.o_proj.weight")?;
    let gate_proj = matrix("mlp.gate_proj.weight")?;
    let up_proj = matrix("mlp.up_proj.weight")?;
    let down_proj = matrix("mlp.down_proj.weight")?;
    if loaded.get() != listed.len() {
        return Err(ModelError::Unsupported(format!(
            "the loader read {} of the {} tensors the {} list names per layer",
            loaded.get(),
            listed.len(),
            c.family.name()
        )));
    }
    Ok(LayerWeights {
        input_norm,
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
    })
}
