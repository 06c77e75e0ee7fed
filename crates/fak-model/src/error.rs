//! The one error type of fak-model.

use std::path::PathBuf;

/// Everything that can go wrong loading a model or running it. Each variant names the
/// offending file, key, tensor or value.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A GGUF file could not be read or is malformed.
    #[error(transparent)]
    Gguf(#[from] fak_weights::GgufError),
    /// A safetensors file could not be read or is malformed.
    #[error(transparent)]
    Safetensors(#[from] fak_weights::SafetensorsError),
    /// Reading a file or folder failed.
    #[error("{path}: {source}")]
    Io {
        /// The path that was being read.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` is not valid JSON or lacks a field.
    #[error("config {path}: {reason}")]
    Config {
        /// The config file (or GGUF file) the value came from.
        path: PathBuf,
        /// What is wrong, naming the key.
        reason: String,
    },
    /// The checkpoint's architecture is not one fak implements.
    #[error("unknown architecture '{0}' (fak implements: {known})", known = crate::Family::known_names().join(", "))]
    UnknownArchitecture(String),
    /// The checkpoint uses a feature fak does not implement; running it with a default
    /// would give wrong numbers, so it is refused.
    #[error("unsupported model feature: {0}")]
    Unsupported(String),
    /// A tensor the architecture needs is absent.
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    /// A tensor's shape differs from what the config implies.
    #[error("tensor '{name}' has shape {found:?}, the config implies {expected:?}")]
    ShapeMismatch {
        /// HF name of the tensor.
        name: String,
        /// Shape the config implies, row-major.
        expected: Vec<usize>,
        /// Shape found in the file.
        found: Vec<usize>,
    },
    /// A token id is not in the vocabulary.
    #[error("token id {id} is out of range (vocabulary size {vocab})")]
    TokenOutOfRange {
        /// The id given.
        id: u32,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// The sequence would exceed the model's context length.
    #[error("context overflow: {needed} positions needed, the context length is {limit}")]
    ContextOverflow {
        /// Positions the request needs (cached + new).
        needed: usize,
        /// The model's (or cache's) limit.
        limit: usize,
    },
    /// A longrope model's (Phi-3's) pass would take a sequence cached within the
    /// original context past it: longrope's long factors then apply to every position,
    /// so each cached entry (every layer's K and V, not only their rotation) must be
    /// computed again. The cache is unchanged; run the whole sequence as one pass into an
    /// empty cache, as HF's `generate` does (`generate_greedy` and fak-kv's `Session` do
    /// this themselves).
    #[error("the sequence grows to {needed} positions, past original_max_position_embeddings {original}: longrope's long factors apply to every position, so the cache must be recomputed")]
    RopeRegimeChange {
        /// Positions the sequence needs (cached + new).
        needed: usize,
        /// The model's `original_max_position_embeddings`.
        original: usize,
    },
    /// The path is neither a GGUF file nor a folder with config.json and *.safetensors.
    #[error("{0}: not a GGUF file or a folder holding config.json and *.safetensors")]
    UnknownFormat(PathBuf),
    /// A request argument is invalid (empty prompt, inconsistent positions, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
}
