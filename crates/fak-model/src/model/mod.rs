//! The decoder-only transformer: weights per layer and the forward pass (exact path).
//!
//! Mirrors HF's `modeling_llama.py` top to bottom: `embed_tokens` → for each
//! `LlamaDecoderLayer`: `input_layernorm` → self-attention (q/k/v projections, RoPE,
//! GQA with a causal mask, `o_proj`) → residual add → `post_attention_layernorm` →
//! SwiGLU MLP (`down(silu(gate(x)) * up(x))`) → residual add; then `norm` and `lm_head`.
//! All math is `f32` with the fixed reduction order of fak-tensor, so a token's output
//! does not depend on how many tokens share its forward pass or on the thread count.
//!
//! - `weights`: [`WeightMode`], [`Weight`] (one matrix: `f32`, F32 or F16 as the file
//!   stores it, or a quantized block format) and the weights of a decoder block
//!   ([`LayerWeights`]).
//! - `loader`: [`Model::from_source_with`] and the other constructors.
//! - `forward`: [`Model::forward`] and the pass over one batch of tokens as named
//!   steps: `embed`, then per layer `attention_block` (the residual add and norm,
//!   `qkv`, `rope_qk`, the KV append, `attention`: decode or prefill, from
//!   `crate::attention`; `o_proj`) and `mlp_block` (the residual add and norm,
//!   gate/up, activation, down), the last residual add with the final norm, and the
//!   head. A sublayer's output is added to the residual stream by the next one's first
//!   step (`residual_then_norm`), which also quantizes the normed rows for its
//!   products.
//! - `head`: the logits head, over every row or over a subset of its rows.
//! - `linear`: the matrix products (`f32`, F32 or F16 as stored, or quantized weights).
//! - `scratch`: [`ForwardScratch`] and the products' buffers.
//! - `profile`: [`OpProfile`], the per-op wall time of passes (`fak bench --profile`).

mod forward;
mod head;
mod linear;
mod loader;
mod profile;
mod scratch;
mod weights;

pub use forward::{BatchSeq, ForwardTrace, LogitsWanted};
pub use head::{HEAD_ROWS_FRACTION, HEAD_ROWS_MAX};
pub use profile::{Op, OpProfile, OpTimes};
pub use scratch::ForwardScratch;
pub use weights::{LayerWeights, Weight, WeightMode};

use crate::{Config, ModelError};
use fak_tensor::{rope_rotate_half, RopeTable, Threads};

/// Default of [`Model::set_prefill_chunk`]: most tokens one batch of a forward pass
/// runs through the layers at once (llama.cpp's micro-batch, `n_ubatch`, defaults to
/// 512). A pass's activations take ~28 KB a token for SmolLM2 (hidden 576, MLP 1536), so
/// a 4,096-token prompt in one batch held ~115 MB of them. Batches bound that memory;
/// each batch reads every weight again, which at 256 tokens was not slower than 512
/// with the multi-token tiles (and 10 MB less peak RSS for a 512-token prompt).
/// Measured figures: docs/performance.md, "Why it is fast".
pub const PREFILL_CHUNK: usize = 256;

/// A loaded model: config, weights, RoPE tables and the thread count its products use.
/// Immutable after load (apart from its profile's counters, [`Model::profile`]): share
/// it between sessions with `Arc<Model>`.
pub struct Model {
    config: Config,
    embed_tokens: Weight,
    layers: Vec<LayerWeights>,
    norm: Vec<f32>,
    /// `None` when the head is tied to `embed_tokens`.
    lm_head: Option<Weight>,
    /// Per layer, the RoPE table of a sequence within the original context (all
    /// sequences for a model without longrope's long factors).
    rope: Vec<RopeTable>,
    /// longrope's long tables, per layer, and the original context length past which
    /// they apply ([`Model::rope_regime`]).
    rope_long: Option<(usize, Vec<RopeTable>)>,
    threads: Threads,
    /// Most tokens one batch of a pass runs at once ([`Model::set_prefill_chunk`]).
    prefill_chunk: usize,
    mode: WeightMode,
    /// Per-op wall time of passes, off unless enabled ([`Model::profile`]).
    profile: OpProfile,
    /// cos and sin rows of every position a compact cache's keys are rotated at when
    /// read ([`Model::read_rope`]), per RoPE table, grown as positions come.
    read_rope: std::sync::Mutex<Vec<std::sync::Arc<CosSinRows>>>,
}

/// One RoPE table's `cos` and `sin` rows of positions `0..rows`, `[rows, half]` each,
/// computed by [`RopeTable::cos_sin`] (the forward pass's rows for those positions).
#[derive(Debug)]
pub(crate) struct CosSinRows {
    table: RopeTable,
    rows: usize,
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
}

/// Which of a model's RoPE tables a sequence uses ([`Model::rope_regime`]). Only a
/// longrope model (Phi-3) has two; every other model is always `Short`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeRegime {
    /// The sequence fits in `original_max_position_embeddings` (longrope's
    /// `short_factor`), or the model has one table.
    Short,
    /// The sequence reaches past `original_max_position_embeddings` (`long_factor`).
    Long,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// The model's per-op profile of its forward passes: off until
    /// [`OpProfile::set_enabled`]; it changes no bit of any result.
    pub fn profile(&self) -> &OpProfile {
        &self.profile
    }

    /// How this model keeps its weights.
    pub fn weight_mode(&self) -> WeightMode {
        self.mode
    }

    /// Every matrix kept as the file stores it ([`WeightMode::Native`]): copied at load
    /// or, where the copy could not be made, read from the memory map.
    fn held(&self) -> impl Iterator<Item = &Weight> {
        let layers = self.layers.iter().flat_map(|l| l.matrices());
        layers
            .chain([&self.embed_tokens])
            .chain(self.lm_head.as_ref())
            .filter(|w| w.is_mapped())
    }

    /// The block types of the matrices held quantized, with how many matrices of each
    /// (empty in [`WeightMode::Exact`]), e.g. `[("Q4_1", 210), ("Q8_0", 1)]`. F32 and
    /// F16 matrices kept as stored are not here: see [`Model::mapped_f32_matrices`]
    /// and [`Model::mapped_f16_matrices`]. A matrix repacked at load is counted under
    /// the file's type (a Q8_0 vocabulary matrix in row pairs holds Q8_0 blocks, a Q4_1
    /// matrix in groups of 16 rows Q4_1 blocks:
    /// [`QuantMatrix::repacked_for_cpu`](crate::QuantMatrix::repacked_for_cpu)), so the
    /// list is the file's whatever the CPU.
    pub fn quantized_types(&self) -> Vec<(&'static str, usize)> {
        let mut counts: std::collections::BTreeMap<&'static str, usize> = Default::default();
        for q in self.held().filter_map(Weight::quant) {
            let ty = match q.ty {
                fak_tensor::quant::QType::Q8_0R2 | fak_tensor::quant::QType::Q8_0R16 => {
                    fak_tensor::quant::QType::Q8_0
                }
                fak_tensor::quant::QType::Q4_1R16 => fak_tensor::quant::QType::Q4_1,
                ty => ty,
            };
            *counts.entry(ty.name()).or_default() += 1;
        }
        counts.into_iter().collect()
    }

    /// How many F32 matrices are read as the GGUF file stores them, from the copy made
    /// at load or in place from the memory map, instead of being copied into `f32`
    /// buffers of the exact path's (0 in [`WeightMode::Exact`], for files without F32
    /// matrices and for misaligned F32 data), e.g. 211 for an all-F32 SmolLM2 file:
    /// 30 × 7 linear layers and the tied embedding.
    pub fn mapped_f32_matrices(&self) -> usize {
        self.held()
            .filter(|m| matches!(m, Weight::Mapped(_)))
            .count()
    }

    /// How many F16 matrices are read as the GGUF file stores them instead of being
    /// widened into `f32` copies ([`Model::mapped_f32_matrices`] for F16: 0 in
    /// [`WeightMode::Exact`]).
    pub fn mapped_f16_matrices(&self) -> usize {
        self.held()
            .filter(|m| matches!(m, Weight::MappedF16(_)))
            .count()
    }

    /// Bytes of the matrices copied out of the file at load into the model's huge pages
    /// ([`crate::WeightArena`]), as the file stores them or repacked to the same size
    /// (0 in [`WeightMode::Exact`]).
    pub fn copied_weight_bytes(&self) -> usize {
        self.held().map(Weight::copied_byte_len).sum()
    }

    /// The model's configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Sets the sliding attention window of every layer (`None` = full causal
    /// attention), e.g. to run the window proofs on a model that has none.
    ///
    /// # Errors
    /// [`ModelError::InvalidInput`] if `windows.len()` is not the layer count or a window
    /// is 0.
    pub fn set_sliding_windows(&mut self, windows: Vec<Option<usize>>) -> Result<(), ModelError> {
        if windows.len() != self.config.num_hidden_layers {
            return Err(ModelError::InvalidInput(format!(
                "{} windows for {} layers",
                windows.len(),
                self.config.num_hidden_layers
            )));
        }
        if windows.contains(&Some(0)) {
            return Err(ModelError::InvalidInput(
                "a sliding window of 0 tokens".into(),
            ));
        }
        self.config.sliding_window = windows;
        Ok(())
    }

    /// Sets the context length in tokens (e.g. to run a long bounded-window test on a
    /// tiny model). RoPE has no table to outgrow, so any length is computable; the
    /// model's training length is what makes longer contexts meaningful.
    pub fn set_max_position_embeddings(&mut self, n: usize) {
        self.config.max_position_embeddings = n.max(1);
    }

    /// The decoder blocks' weights, in layer order.
    pub fn layer_weights(&self) -> &[LayerWeights] {
        &self.layers
    }

    /// Mutable access to the decoder blocks' weights (for experiments and negative
    /// controls; the shapes must stay as the config implies). A matrix kept as the file
    /// stores it in [`WeightMode::Native`] is a [`Weight::Mapped`], [`Weight::MappedF16`]
    /// or [`Weight::Quant`] here, whose values [`Weight::as_f32_mut`] does not give.
    pub fn layer_weights_mut(&mut self) -> &mut [LayerWeights] {
        &mut self.layers
    }

    /// Which RoPE table a forward pass uses when the largest position in the sequence
    /// (cached and new) is `seq_len - 1`: [`RopeRegime::Long`] for a longrope model
    /// (Phi-3) past its `original_max_position_embeddings`, else [`RopeRegime::Short`].
    /// HF's `Phi3RotaryEmbedding` decides the same way, per call, from
    /// `max(position_ids) + 1`.
    pub fn rope_regime(&self, seq_len: usize) -> RopeRegime {
        match &self.rope_long {
            Some((original, _)) if seq_len > *original => RopeRegime::Long,
            _ => RopeRegime::Short,
        }
    }

    /// Layer `layer`'s RoPE table in `regime`.
    fn rope_table(&self, layer: usize, regime: RopeRegime) -> &RopeTable {
        match (&self.rope_long, regime) {
            (Some((_, long)), RopeRegime::Long) => &long[layer],
            _ => &self.rope[layer],
        }
    }

    /// Applies layer `layer`'s RoPE in `regime` ([`Model::rope_regime`] of the
    /// sequence) at absolute position `pos` to `row`, a `[heads * head_dim]` row of K (or
    /// Q) laid out head after head, in place: one rotation, the same arithmetic the
    /// forward pass uses, so re-deriving K from `k_raw` at a new position gives the bits
    /// a forward pass at that position would have given.
    ///
    /// # Panics
    /// If `layer` is out of range or `row.len()` is not a multiple of `head_dim`.
    pub fn rope_in_place(&self, layer: usize, pos: u32, regime: RopeRegime, row: &mut [f32]) {
        let hd = self.config.head_dim;
        assert!(
            row.len().is_multiple_of(hd),
            "rope_in_place: row is not whole heads"
        );
        let half = hd / 2;
        let mut cos = vec![0f32; half];
        let mut sin = vec![0f32; half];
        self.rope_table(layer, regime)
            .cos_sin(pos, &mut cos, &mut sin);
        for head in row.chunks_exact_mut(hd) {
            rope_rotate_half(head, &cos, &sin);
        }
    }

    /// Layer `layer`'s `cos` and `sin` rows in `regime` for positions up to
    /// `max_pos` at least: the rotation a compact cache's pre-RoPE keys get as
    /// attention reads them ([`crate::KvRows::with_rope`]). Built once per table, and
    /// again (to the next power of two, at most the context length) when positions
    /// outgrow it; 256 bytes a position for a 64-value head.
    pub(crate) fn read_rope(
        &self,
        layer: usize,
        regime: RopeRegime,
        max_pos: u32,
    ) -> std::sync::Arc<CosSinRows> {
        let table = self.rope_table(layer, regime);
        let need = max_pos as usize + 1;
        let mut held = self
            .read_rope
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(r) = held.iter().find(|r| r.table == *table && r.rows >= need) {
            return std::sync::Arc::clone(r);
        }
        let rows = need
            .next_power_of_two()
            .max(1024)
            .min(self.config.max_position_embeddings.max(need));
        let half = table.half();
        let (mut cos, mut sin) = (vec![0f32; rows * half], vec![0f32; rows * half]);
        for p in 0..rows {
            let r = p * half..(p + 1) * half;
            table.cos_sin(p as u32, &mut cos[r.clone()], &mut sin[r]);
        }
        let built = std::sync::Arc::new(CosSinRows {
            table: table.clone(),
            rows,
            cos,
            sin,
        });
        held.retain(|r| r.table != *table);
        held.push(std::sync::Arc::clone(&built));
        built
    }

    /// Threads used by the matrix products.
    pub fn threads(&self) -> Threads {
        self.threads
    }

    /// Sets the threads used by the matrix products. Results are bit-identical for any
    /// count.
    pub fn set_threads(&mut self, threads: Threads) {
        self.threads = threads;
    }

    /// Most tokens a forward pass runs through the layers at once (at least 1). A longer
    /// pass runs as consecutive batches of this many tokens, each appending its K/V rows
    /// before the next attends to them, so its activations take memory for one batch,
    /// not the whole prompt. Every token's result is computed by the same operations in
    /// the same order whatever the batch (the products' and attention's reduction orders
    /// do not depend on how many tokens run together), so the bits are those of one
    /// batch: a test checks logits and K/V rows for several sizes. A pass that fills a
    /// [`ForwardTrace`] runs as one batch. Default [`PREFILL_CHUNK`].
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens.max(1);
    }

    /// Most tokens a forward pass runs through the layers at once
    /// ([`Model::set_prefill_chunk`]).
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Bytes of weights the model reads per token: its own buffers
    /// ([`Model::owned_weight_bytes`]) plus, in [`WeightMode::Native`], any matrix
    /// still read from the memory map (one whose copy at load could not be made).
    pub fn weight_bytes(&self) -> usize {
        let mapped: usize = self.held().map(Weight::mapped_byte_len).sum();
        mapped + self.owned_weight_bytes()
    }

    /// Bytes of weights the model holds in its own buffers: every weight as `f32` in
    /// [`WeightMode::Exact`]; in [`WeightMode::Native`] the matrices copied at load as
    /// the file stores them or repacked ([`Model::copied_weight_bytes`]) and the `f32`
    /// copies of the rest (norms, biases, matrices of types without a kernel or that
    /// need widening). The map's pages are not counted here.
    pub fn owned_weight_bytes(&self) -> usize {
        let copied = self.copied_weight_bytes();
        let l: usize = self
            .layers
            .iter()
            .map(|w| {
                w.input_norm.as_ref().map_or(0, Vec::len)
                    + w.q_proj.owned_len()
                    + w.k_proj.owned_len()
                    + w.v_proj.owned_len()
                    + w.o_proj.owned_len()
                    + w.mlp_norm.as_ref().map_or(0, Vec::len)
                    + w.attn_out_norm.as_ref().map_or(0, Vec::len)
                    + w.mlp_out_norm.as_ref().map_or(0, Vec::len)
                    + w.qk_norm.as_ref().map_or(0, |(a, b)| a.len() + b.len())
                    + w.qkv_bias
                        .as_ref()
                        .map_or(0, |(a, b, c)| a.len() + b.len() + c.len())
                    + w.gate_proj.owned_len()
                    + w.up_proj.owned_len()
                    + w.down_proj.owned_len()
            })
            .sum();
        copied
            + 4 * (l
                + self.embed_tokens.owned_len()
                + self.norm.len()
                + self.lm_head.as_ref().map_or(0, Weight::owned_len))
    }
}
