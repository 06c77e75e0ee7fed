//! How a model keeps its weights: [`WeightMode`], one matrix ([`Weight`]: `f32`, or in
//! native mode as the file stores it, copied at load into huge pages) and the weights of
//! a decoder block ([`LayerWeights`]).

use crate::source::{MappedF16, MappedF32, QuantMatrix};
use crate::ModelError;

/// How a model keeps its large matrices, chosen at load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WeightMode {
    /// Every weight dequantized or widened to `f32` at load; activations `f32`. The
    /// path proven against HF (`docs/design.md`, numerics contract).
    #[default]
    Exact,
    /// The fast path: the linear layers' matrices (attention q/k/v/o, MLP
    /// gate/up/down, the output head or tied embedding) stay in their GGUF block format
    /// when their type has a quantized dot product (`fak_tensor::quant::QType`); each
    /// product's input row is quantized once (Q8_0, Q8_1 or Q8_K, as the weight type
    /// pairs with; by the step that makes it, where it can) and the quantized matvec
    /// runs. Embedding rows are dequantized on lookup. A GGUF's F32 matrices stay as
    /// the file stores them too ([`MappedF32`]; a `llama` file's Q/K rows put in HF's
    /// order as they are copied at load, or, left on the map, on each product's
    /// output) and run the exact
    /// path's `f32` kernels, so they give the exact path's bits; so do its F16
    /// matrices ([`MappedF16`]), which the same kernels widen exactly as they load them.
    /// Every such matrix is copied once at load, with positional reads, into the model's
    /// huge pages ([`crate::WeightArena`]; some block types repacked into a layout this
    /// CPU reads faster, [`Weight::repacked_for_cpu`]), and read from the file's memory
    /// map only where that copy cannot be made. F32 or F16 data that cannot be borrowed
    /// from the map (misaligned, a big-endian host) is copied to `f32` as in exact mode.
    /// Norms, biases and matrices of other types (BF16, which needs widening, block
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

/// One weight matrix, held once in the form the forward pass reads (as candle's
/// `QMatMul`): `f32` values of its own, or a GGUF file's F32 or F16 values or quantized
/// blocks as the file stores them. [`WeightMode::Exact`] holds every matrix as
/// [`Weight::Dense`]; [`WeightMode::Native`] keeps what it can as the file stores it,
/// each such matrix copied once at load into the model's huge pages
/// ([`crate::WeightArena`]) or, where that copy cannot be made, read from the file's
/// memory map.
#[derive(Clone, Debug)]
pub enum Weight {
    /// Row-major `f32` values of its own (`[rows, cols]`), through the `f32` kernels.
    Dense(Vec<f32>),
    /// F32 as the file stores it (copied at load, or in the memory map), through the
    /// `f32` kernels.
    Mapped(MappedF32),
    /// F16 as the file stores it (copied at load, or in the memory map), through the
    /// `f32` kernels (each value widened exactly as it is loaded: the bits of the
    /// widened matrix).
    MappedF16(MappedF16),
    /// In its GGUF block format (copied at load, repacked or as stored, or in the memory
    /// map), through the quantized kernels.
    Quant(QuantMatrix),
}

impl Weight {
    /// A matrix read from the file in the layout this CPU's kernels read fastest
    /// ([`QuantMatrix::repacked_for_cpu`]), copied into the model's huge pages
    /// ([`crate::WeightArena`]); an F32 or F16 matrix copied as it is
    /// ([`Mapped::copied_for_cpu`](crate::Mapped::copied_for_cpu)); a
    /// [`Weight::Dense`] as it is.
    pub fn repacked_for_cpu(self) -> Weight {
        match self {
            Weight::Quant(q) => Weight::Quant(q.repacked_for_cpu()),
            w => w.copied_for_cpu(),
        }
    }

    /// A layer's matrix copied into the model's huge pages ([`crate::WeightArena`]),
    /// in the layout this CPU's kernels read fastest for the types whose layout pays
    /// there: Q4_1 in groups of 16 rows ([`QuantMatrix::repacked_for_cpu`]), whose
    /// multi-token products otherwise unpack every block into a prepared buffer per
    /// product. Every other matrix is copied as the file has it: a layer's Q8_0 in
    /// groups of 16 rows (as the head is) made a Q8_0 SmolLM2's prefill 10–17% faster
    /// but its decode after 512 tokens 5–12% slower on a Zen 4 (docs/performance.md,
    /// "Tried and kept out").
    pub fn repacked_layer_for_cpu(self) -> Weight {
        match self {
            Weight::Quant(q) if q.ty == fak_tensor::quant::QType::Q4_1 => {
                Weight::Quant(q.repacked_for_cpu())
            }
            w => w.copied_for_cpu(),
        }
    }

    /// A matrix of the file copied as it is into the model's huge pages
    /// ([`QuantMatrix::copied_for_cpu`], [`Mapped::copied_for_cpu`](crate::Mapped::copied_for_cpu);
    /// a `llama` file's Q/K rows in HF's order); a [`Weight::Dense`] as it is.
    pub fn copied_for_cpu(self) -> Weight {
        match self {
            Weight::Quant(q) => Weight::Quant(q.copied_for_cpu()),
            Weight::Mapped(m) => Weight::Mapped(m.copied_for_cpu()),
            Weight::MappedF16(m) => Weight::MappedF16(m.copied_for_cpu()),
            w => w,
        }
    }

    /// Drops the process's mappings of the file's pages of a matrix copied at load
    /// ([`QuantMatrix::release_file_pages`]); nothing for any other.
    pub(super) fn release_file_pages(&self) {
        match self {
            Weight::Quant(q) => q.release_file_pages(),
            Weight::Mapped(m) => m.release_file_pages(),
            Weight::MappedF16(m) => m.release_file_pages(),
            Weight::Dense(_) => {}
        }
    }

    /// Rows `first..first + rows` of a `[_, cols]` matrix as a matrix of their own: one
    /// part of a fused tensor. A dense matrix copies them; an F32, F16 or quantized one
    /// not yet copied at load is a view of the same bytes in the map (the copy at load
    /// then copies only those rows).
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] when the range is not inside the matrix, or a matrix
    /// kept as the file stores it has permuted rows or was already copied at load.
    pub fn row_range(self, first: usize, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        match self {
            Weight::Dense(w) => w
                .get(first * cols..(first + rows) * cols)
                .map(|r| Weight::Dense(r.to_vec()))
                .ok_or_else(|| {
                    ModelError::Unsupported(format!(
                        "rows {first}..+{rows} of a matrix of {} values",
                        w.len()
                    ))
                }),
            Weight::Mapped(m) => Ok(Weight::Mapped(m.row_range(first, rows)?)),
            Weight::MappedF16(m) => Ok(Weight::MappedF16(m.row_range(first, rows)?)),
            Weight::Quant(q) => Ok(Weight::Quant(q.row_range(first, rows)?)),
        }
    }

    /// The values of a [`Weight::Dense`] matrix, row-major; `None` for a matrix kept as
    /// the file stores it.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Weight::Dense(w) => Some(w),
            Weight::Mapped(_) | Weight::MappedF16(_) | Weight::Quant(_) => None,
        }
    }

    /// [`Weight::as_f32`], mutable (for experiments and negative controls; the length
    /// cannot change).
    pub fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            Weight::Dense(w) => Some(w),
            Weight::Mapped(_) | Weight::MappedF16(_) | Weight::Quant(_) => None,
        }
    }

    /// The quantized matrix, if the weight is held in a block format.
    pub(super) fn quant(&self) -> Option<&QuantMatrix> {
        match self {
            Weight::Quant(q) => Some(q),
            Weight::Dense(_) | Weight::Mapped(_) | Weight::MappedF16(_) => None,
        }
    }

    /// Whether the weight is kept as the file stores it (copied at load or read from the
    /// memory map), not widened into a [`Weight::Dense`].
    pub(super) fn is_mapped(&self) -> bool {
        !matches!(self, Weight::Dense(_))
    }

    /// Bytes of the matrix read from the map (0 for [`Weight::Dense`] and a matrix
    /// copied at load).
    pub(super) fn mapped_byte_len(&self) -> usize {
        match self {
            Weight::Dense(_) => 0,
            Weight::Quant(q) if q.is_copied() => 0,
            Weight::Quant(q) => q.bytes().len(),
            Weight::Mapped(m) if m.is_copied() => 0,
            Weight::Mapped(m) => m.byte_len(),
            Weight::MappedF16(m) if m.is_copied() => 0,
            Weight::MappedF16(m) => m.byte_len(),
        }
    }

    /// Bytes of a matrix copied at load ([`Weight::repacked_for_cpu`],
    /// [`Weight::copied_for_cpu`]), held by the model rather than the map; 0 for any
    /// other weight.
    pub(super) fn copied_byte_len(&self) -> usize {
        match self {
            Weight::Quant(q) if q.is_copied() => q.bytes().len(),
            Weight::Mapped(m) if m.is_copied() => m.byte_len(),
            Weight::MappedF16(m) if m.is_copied() => m.byte_len(),
            _ => 0,
        }
    }

    /// `f32` values held in the model's own heap (the length of [`Weight::Dense`], 0
    /// for any other).
    pub(super) fn owned_len(&self) -> usize {
        match self {
            Weight::Dense(w) => w.len(),
            Weight::Mapped(_) | Weight::MappedF16(_) | Weight::Quant(_) => 0,
        }
    }
}

/// The weights of one decoder block (HF names in the comments): the norms and biases
/// row-major `f32`, each matrix a [`Weight`] (in [`WeightMode::Native`] one kept as the
/// file stores it, quantized blocks or F32/F16 values copied at load, is not a
/// [`Weight::Dense`]).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// `input_layernorm.weight`, `[hidden]`, before attention; `None` when the block
    /// has no norm there ([`Norms::Post`](crate::Norms::Post)).
    pub input_norm: Option<Vec<f32>>,
    /// `self_attn.q_proj.weight`, `[q_dim, hidden]`.
    pub q_proj: Weight,
    /// `self_attn.k_proj.weight`, `[kv_dim, hidden]`.
    pub k_proj: Weight,
    /// `self_attn.v_proj.weight`, `[kv_dim, hidden]`.
    pub v_proj: Weight,
    /// `self_attn.o_proj.weight`, `[hidden, q_dim]`.
    pub o_proj: Weight,
    /// `self_attn.{q,k,v}_proj.bias` (Qwen2), `[q_dim]`, `[kv_dim]`, `[kv_dim]`.
    pub qkv_bias: Option<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    /// `self_attn.q_norm.weight` and `self_attn.k_norm.weight`, applied before RoPE to
    /// each span of their length: `[head_dim]` each, per head (Qwen3, Gemma 3), or
    /// `[q_dim]` and `[kv_dim]`, the whole projection (OLMo 2).
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// The norm on the attention output before the residual add, `[hidden]`: Gemma's
    /// and OLMo 2's `post_attention_layernorm.weight`.
    pub attn_out_norm: Option<Vec<f32>>,
    /// The norm before the MLP, `[hidden]`: Llama/Qwen `post_attention_layernorm`, Gemma
    /// `pre_feedforward_layernorm`; `None` for OLMo 2.
    pub mlp_norm: Option<Vec<f32>>,
    /// The norm on the MLP output before the residual add, `[hidden]`: Gemma's and OLMo
    /// 2's `post_feedforward_layernorm.weight`.
    pub mlp_out_norm: Option<Vec<f32>>,
    /// `mlp.gate_proj.weight`, `[intermediate, hidden]`.
    pub gate_proj: Weight,
    /// `mlp.up_proj.weight`, `[intermediate, hidden]`.
    pub up_proj: Weight,
    /// `mlp.down_proj.weight`, `[hidden, intermediate]`.
    pub down_proj: Weight,
}

impl LayerWeights {
    /// The block's seven matrices: q, k, v, o, gate, up, down.
    pub(super) fn matrices(&self) -> [&Weight; 7] {
        [
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ]
    }
}
