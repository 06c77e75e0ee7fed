//! fak-weights reads model weights: GGUF and safetensors files over a memory map,
//! with dequantization of ggml block formats and widening of half-precision types
//! to f32.
//!
//! - [`GgufFile`]: a validated GGUF v2/v3 reader (metadata, tensor infos, zero-copy
//!   tensor data, [`GgufFile::tensor_f32`], and F32 data borrowed as `&[f32]` by
//!   [`GgufFile::tensor_f32_in_place`]).
//! - [`dequantize`]: ggml block formats to f32, bit-exact with gguf-py.
//! - [`SafetensorsFile`]: HF safetensors, with [`widen_bf16`] / [`widen_f16`].
//! - [`gguf_to_hf_name`] / [`unpermute_qk_rows`]: map llama.cpp's Llama tensors back
//!   to HF names and row order; [`gguf_to_hf_name_with`] splits any family's names
//!   given its table of block parts (fak-model's `family/` files).

#![warn(missing_docs)]

pub mod dequant;
pub mod ggml_type;
pub mod gguf;
pub mod names;
pub mod safetensors_file;

pub use dequant::{dequantize, f16_bits_to_f32, DequantError};
pub use ggml_type::{GgmlType, QK_K};
pub use gguf::{GgufError, GgufFile, MetaValue, TensorInfo};
pub use names::{
    gguf_llama_block_part, gguf_to_hf_name, gguf_to_hf_name_with, permute_qk_rows,
    unpermute_qk_rows, PermuteError,
};
pub use safetensors_file::{widen_bf16, widen_f16, SafetensorsError, SafetensorsFile};
