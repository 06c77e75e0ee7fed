//! fak-model: turns a checkpoint into logits.
//!
//! One job: read a model's configuration and weights (GGUF or safetensors, through
//! fak-weights), and run its forward pass with fak-tensor's kernels. The exact path is
//! here: every weight widened or dequantized to `f32`, every reduction in a fixed order,
//! proven against HF transformers by the tests in `tests/` (rungs R0, R1, R2b of
//! `docs/proof-ladder.md`; the HF oracle fixtures are read and measured by fak-prove).
//!
//! - [`Config`]: hyper-parameters from `config.json` or GGUF metadata.
//! - `family` (private): one file per model [`Family`] (its `config.json` fields and
//!   refusals, GGUF metadata, per-layer tensor list, GGUF names, load-time fixes)
//!   behind one trait, and the registry with one line per family.
//! - [`WeightSource`]: HF-named `f32` tensors from either format (GGUF Q/K rows
//!   un-permuted to rotate-half order); for [`WeightMode::Native`], a GGUF's matrices
//!   kept as the file stores them instead: [`QuantMatrix`] (block formats; Q4_1 and a
//!   Q8_0 vocabulary matrix repacked into 16-row groups on a CPU with AVX-512 VNNI,
//!   [`QuantMatrix::repacked_for_cpu`]) and [`MappedF32`] / [`MappedF16`] (F32, F16),
//!   each copied once at load into the huge pages of a [`WeightArena`] (`arena.rs`).
//! - [`Model`] (`model/`): the weights and [`Model::forward`] over a [`KvStore`];
//!   [`Model::forward_into`] works in a caller's [`ForwardScratch`] and logits buffer,
//!   so a decode step allocates nothing. Each matrix is one [`Weight`] (`f32`, F32/F16
//!   as stored, or quantized blocks; `model/weights.rs`); the loader is
//!   `model/loader.rs`; the forward pass, as named steps (embedding, per layer the
//!   attention block and the MLP block, final norm, head), is `model/forward.rs`, the
//!   head `model/head.rs`, the matrix products `model/linear.rs`.
//! - `attention` (private): the attention of new tokens over a layer's cache, by phase:
//!   `attention/decode.rs` (one token, by GQA group) and `attention/prefill.rs`
//!   (several, by block of tokens and query head), bit-identical to each other.
//! - [`generate_greedy`]: prefill + decode with a plain [`VecKvCache`].
//!
//! Load once, share with `Arc<Model>`: the model is immutable after load.

mod arena;
mod attention;
pub mod chat;
mod config;
mod error;
mod family;
mod generate;
mod kv;
mod model;
mod source;
pub mod tokenizer;

pub use arena::{ArenaBytes, WeightArena};
pub use chat::{load_text, ChatError, ChatTemplate, Message, RenderLimits};
pub use config::{Activation, Config, LongRopeFactors, Norms, RopeScaling};
pub use error::ModelError;
pub use family::Family;
pub use generate::{argmax, generate_greedy, Generation, StopReason};
pub use kv::{window_start, KvRows, KvStore, KvType, RopeAtRead, RowBuf, Run, VecKvCache};
pub use model::{
    BatchSeq, ForwardScratch, ForwardTrace, LayerWeights, LogitsWanted, Model, Op, OpProfile,
    OpTimes, RopeRegime, Weight, WeightMode, HEAD_ROWS_FRACTION, HEAD_ROWS_MAX, PREFILL_CHUNK,
};
pub use source::{
    Mapped, MappedElem, MappedF16, MappedF32, QuantMatrix, TensorEntry, WeightSource,
};
pub use tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
