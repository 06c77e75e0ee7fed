//! How a model keeps its weights: [`WeightMode`], the `f32` weights of a decoder block
//! ([`LayerWeights`]) and the matrices read from the memory map in native mode.

use crate::source::{MappedF32, QuantMatrix};

/// How a model keeps its large matrices, chosen at load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WeightMode {
    /// Every weight dequantized or widened to `f32` at load; activations `f32`. The
    /// path proven against HF (`docs/design.md`, numerics contract).
    #[default]
    Exact,
    /// The fast path: the linear layers' matrices (attention q/k/v/o, MLP
    /// gate/up/down, the output head or tied embedding) stay in their GGUF block format
    /// inside the memory map when their type has a quantized dot product
    /// (`fak_tensor::quant::QType`); each product quantizes its input row once
    /// (Q8_0, Q8_1 or Q8_K, as the weight type pairs with) and runs the quantized
    /// matvec. Embedding rows are dequantized on lookup. A GGUF's F32 matrices are read
    /// in place from the memory map too ([`MappedF32`], no copy; a `llama` file's Q/K
    /// row order undone on each product's output) and run the exact path's `f32`
    /// kernels, so they give the exact path's bits; F32 data that cannot be borrowed
    /// (not 4-byte aligned, a big-endian host) is copied as in exact mode. Norms,
    /// biases and matrices of other types (F16 and BF16, which need widening, block
    /// types without a kernel, anything from safetensors) are `f32` copies. Every
    /// token goes through the same per-row kernels whether it is in a prefill or a
    /// decode step, and the thread split never touches a reduction, so decode ==
    /// prefill and thread-count independence still hold bit for bit; against
    /// [`WeightMode::Exact`] the logits differ by the activation rounding of the
    /// quantized products (measured in `tests/native.rs`).
    Native,
}

impl WeightMode {
    /// `"exact"` or `"native"`.
    pub fn name(self) -> &'static str {
        match self {
            WeightMode::Exact => "exact",
            WeightMode::Native => "native",
        }
    }
}

/// A matrix [`WeightMode::Native`] reads from the memory map instead of an `f32` copy.
#[derive(Clone, Debug)]
pub(super) enum NativeMatrix {
    /// In its GGUF block format, through the quantized kernels.
    Quant(QuantMatrix),
    /// F32 read in place, through the `f32` kernels.
    F32(MappedF32),
}

impl NativeMatrix {
    pub(super) fn quant(&self) -> Option<&QuantMatrix> {
        match self {
            NativeMatrix::Quant(q) => Some(q),
            NativeMatrix::F32(_) => None,
        }
    }

    /// Bytes of the matrix in the map.
    pub(super) fn byte_len(&self) -> usize {
        match self {
            NativeMatrix::Quant(q) => q.bytes().len(),
            NativeMatrix::F32(m) => m.byte_len(),
        }
    }
}

/// The matrices of one block held in the memory map in [`WeightMode::Native`] (`None`:
/// that matrix is in [`LayerWeights`] as `f32`).
#[derive(Clone, Debug, Default)]
pub(super) struct NativeLayer {
    pub(super) q: Option<NativeMatrix>,
    pub(super) k: Option<NativeMatrix>,
    pub(super) v: Option<NativeMatrix>,
    pub(super) o: Option<NativeMatrix>,
    pub(super) gate: Option<NativeMatrix>,
    pub(super) up: Option<NativeMatrix>,
    pub(super) down: Option<NativeMatrix>,
}

impl NativeLayer {
    pub(super) fn all(&self) -> [&Option<NativeMatrix>; 7] {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
    }
}

/// The weights of one decoder block, row-major `f32` (HF names in the comments). In
/// [`WeightMode::Native`] a matrix read from the memory map (held quantized, or an F32
/// GGUF matrix read in place) is an empty `Vec` here.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// `input_layernorm.weight`, `[hidden]`.
    pub input_norm: Vec<f32>,
    /// `self_attn.q_proj.weight`, `[q_dim, hidden]`.
    pub q_proj: Vec<f32>,
    /// `self_attn.k_proj.weight`, `[kv_dim, hidden]`.
    pub k_proj: Vec<f32>,
    /// `self_attn.v_proj.weight`, `[kv_dim, hidden]`.
    pub v_proj: Vec<f32>,
    /// `self_attn.o_proj.weight`, `[hidden, q_dim]`.
    pub o_proj: Vec<f32>,
    /// `self_attn.{q,k,v}_proj.bias` (Qwen2), `[q_dim]`, `[kv_dim]`, `[kv_dim]`.
    pub qkv_bias: Option<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    /// `self_attn.q_norm.weight` and `self_attn.k_norm.weight` (Qwen3, Gemma 3), each
    /// `[head_dim]`, applied per head before RoPE.
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// Gemma's `post_attention_layernorm.weight` on the attention output, `[hidden]`.
    pub attn_out_norm: Option<Vec<f32>>,
    /// The norm before the MLP, `[hidden]`: Llama/Qwen `post_attention_layernorm`, Gemma
    /// `pre_feedforward_layernorm`.
    pub mlp_norm: Vec<f32>,
    /// Gemma's `post_feedforward_layernorm.weight` on the MLP output, `[hidden]`.
    pub mlp_out_norm: Option<Vec<f32>>,
    /// `mlp.gate_proj.weight`, `[intermediate, hidden]`.
    pub gate_proj: Vec<f32>,
    /// `mlp.up_proj.weight`, `[intermediate, hidden]`.
    pub up_proj: Vec<f32>,
    /// `mlp.down_proj.weight`, `[hidden, intermediate]`.
    pub down_proj: Vec<f32>,
}
