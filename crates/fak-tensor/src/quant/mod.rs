//! Quantized dot products: a weight row kept in its GGUF block format times an
//! activation row quantized per block to 8 bits, the pairing ggml uses for its CPU
//! `vec_dot` kernels.
//!
//! | weight type | activation type | block (elements) |
//! |---|---|---|
//! | Q4_0, Q5_0, Q8_0 | [`BlockQ8_0`] | 32 |
//! | Q4_1, Q5_1 | [`BlockQ8_1`] (carries `d * Σq`) | 32 |
//! | Q4_K, Q5_K, Q6_K | [`BlockQ8K`] (f32 scale, 16-element sums) | 256 |
//!
//! Weight block layouts are ggml's `ggml-common.h` (the GGUF tensor data), each
//! defined once, in its format's file, as a block struct with its size asserted and
//! its gguf-py-exact dequantizer (`dequantize_*`, which `fak_weights` uses); a weight
//! row is passed to the dot products as its raw bytes.
//! Activation quantizers follow ggml's reference functions `quantize_row_q8_0_ref`,
//! `quantize_row_q8_1_ref` and `quantize_row_q8_K_ref` (`ggml/src/ggml-quants.c`).
//!
//! # Layout
//!
//! One file per block format: the activation blocks with their quantizers
//! ([`BlockQ8_0`] in `q8_0.rs`, [`BlockQ8_1`] in `q8_1.rs`, [`BlockQ8K`] in `q8_k.rs`;
//! each struct with its size asserted) and, per weight type, the block struct with its
//! size asserted and its dequantizer, and the scalar reference `vec_dot_*_ref` beside
//! the dispatching `vec_dot_*` (`q4_0.rs`, `q4_1.rs`, `q5_0.rs`, `q5_1.rs`, `q8_0.rs`,
//! `q4_k.rs`, `q5_k.rs`, `q6_k.rs`; `q2_k.rs` and `q3_k.rs` hold a block and its
//! dequantizer only). Around them: `f16.rs`
//! (conversions), `unpack.rs` (the unpacking the references share), `q8_0_r2.rs`
//! (Q8_0 repacked at load in row pairs, [`QType::Q8_0R2`]: its layout, the repacking,
//! a row back in the file's form), `q4_1_r16.rs` and `q8_0_r16.rs` (Q4_1 and Q8_0
//! repacked at load in groups of 16 rows, [`QType::Q4_1R16`] and [`QType::Q8_0R16`],
//! likewise), `repacked.rs` (what the repacked layouts share), `dispatch.rs` (the type-generic entry points), `threads.rs` (products on the thread pool), `tiles.rs`
//! (the x86 drivers: row groups and multi-token tiles), and the x86 kernels: `avx2/` (what the AVX2 kernels share in `avx2/mod.rs`, then one
//! file per block format, `avx2/q4_0.rs` … `avx2/q6_k.rs` and the activation
//! quantizers' `avx2/q8_0.rs`, `avx2/q8_1.rs`, `avx2/q8_k.rs`; the generic row kernels
//! in `avx2/rows.rs`, the many-token K-quant driver in `avx2/k_tokens.rs`, the repacked
//! layouts' kernels in `avx2/q8_0_r2.rs`, `avx2/q4_1_r16.rs` and `avx2/q8_0_r16.rs`),
//! `transposed.rs` and `transposed_k.rs`. Which kernels this CPU runs is detected in
//! [`crate::cpu`] ([`has_avx2_f16c`], [`has_avx_vnni`], [`has_avx512_vnni`], re-exported
//! here).
//!
//! # Canonical order
//!
//! Every integer product sum inside a block is exact (bounds below), so only the
//! float combination can depend on order. It is fixed, and the scalar reference
//! (`*_ref`) and every SIMD kernel perform it with the same operations in the same
//! order, so they agree bit for bit (non-NaN results; a NaN result is NaN in both).
//! f16 scales are widened exactly in both (the AVX2 kernels use the F16C instruction,
//! which gives the same `f32` for every non-NaN f16). `d` is the block's combined
//! scale, a product rounded once; "a multiply and an add" are rounded separately (no
//! FMA).
//!
//! The 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
//!
//! 1. Each block contributes one exact `i32` sum `S = Σ_{e<32} w_e a_e`.
//! 2. One `f32` accumulator starts at `+0.0`; per block, in block order,
//!    `acc = acc + d * (S as f32)`.
//! 3. Q4_1 and Q5_1 keep one scalar `summ += f16(m_w) * f16(s_a)`, accumulated in block
//!    order, and the result is `acc + summ`; the others' result is `acc`.
//!
//! A SIMD kernel may sum a block's products in any grouping (integer adds are exact);
//! what it may not change is step 2: one accumulator per (row, token), one conversion,
//! multiply and add per block. That is what lets the many-token tiles put sixteen
//! (row, token) pairs in one register and pay one conversion, multiply and add per
//! block for all of them (`transposed.rs`), and the one-token kernels total several
//! rows' lane sums in one register for one conversion, multiply and add
//! (`avx2/rows.rs`, `avx2/q8_0_r2.rs`); the 16-row groups hold a block's sums of 16 rows
//! for one token in one register, for one conversion, multiply and add
//! (`avx2/q4_1_r16.rs`).
//!
//! The K types (Q4_K, Q5_K, Q6_K), whose 256-element super-blocks carry sub-block
//! scales:
//!
//! 1. Each super-block contributes eight exact `i32` lane sums `L[m]`, `m = 0..8`
//!    (it mirrors the AVX2 register layout: `maddubs`+`madd` pair adjacent elements,
//!    so lane `m` holds elements `4m..4m+4` of each 32-element chunk), stated per type
//!    below.
//! 2. Eight `f32` lane accumulators start at `+0.0`; per super-block, in order,
//!    `acc[m] = acc[m] + d * (L[m] as f32)`.
//! 3. The lanes are reduced by [`crate::dot::reduce_lanes`]
//!    (`((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`).
//! 4. Q4_K and Q5_K keep one scalar `summ`, accumulated in order, and the result is
//!    `reduced - summ`.
//!
//! Per type (`w` the weight quant with its offset removed, `a` the activation quant,
//! `e` an element index inside the block):
//!
//! - Q4_0 (`w = q - 8`), Q5_0 (`w = q - 16`), Q8_0 (`w = q`, signed; the AVX2 kernel
//!   widens to i16, so that weights and activations of −128 are exact):
//!   `d = f16(d_w) * f16(d_a)`.
//! - Q4_1, Q5_1 (`w = q`, unsigned): `d = f16(d_w) * f16(d_a)`,
//!   `summ += f16(m_w) * f16(s_a)`.
//! - Q4_K, Q5_K: `L[m] = Σ_{g=0}^{7} sc_g Σ_{k<4} w_{32g+4m+k} a_{32g+4m+k}`,
//!   `d = d_a * f16(d_w)`; `summ += (d_a * f16(dmin_w)) * (Σ_g mn_g (bsum_{2g} +
//!   bsum_{2g+1})) as f32`.
//! - Q6_K (`w = q - 32`): `L[m] = Σ_{c=0}^{7} sc_{2c + m/4} Σ_{k<4} w_{32c+4m+k}
//!   a_{32c+4m+k}` (i8 scales), `d = d_a * f16(d_w)`.
//!
//! Integer bounds (any bytes, any activation block): a 32-element block sum is at most
//! `32 · 128 · 128 = 2^19` in magnitude; a Q6_K lane reaches at most
//! `8 · 128 · 4 · 32 · 128 ≈ 1.7e7`, the largest of all types, far inside `i32`. A
//! lane above `2^24` (reachable only by Q6_K with extreme data) rounds when converted
//! to `f32`, identically in both kernels.

use std::fmt;

/// Elements per block of the 32-element types (Q4_0 … Q8_1).
pub const QK: usize = 32;
/// Elements per super-block of the K types (`QK_K` in ggml).
pub const QK_K: usize = 256;

macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident, $reference:ident, $simd:ident, $ty:expr, $act:ty) => {
        $(#[$doc])*
        ///
        /// Uses the AVX2 kernel when the CPU has AVX2 and F16C, else the scalar reference; the two
        /// agree bit for bit (canonical order in the module docs).
        ///
        /// # Errors
        /// [`QuantError::RowLength`] when `w.len()` is not `a.len()` blocks.
        #[inline]
        pub fn $name(w: &[u8], a: &[$act]) -> Result<f32, QuantError> {
            check_row($ty, w.len(), a.len())?;
            #[cfg(target_arch = "x86_64")]
            if has_avx2_f16c() {
                // SAFETY: AVX2 and F16C were detected at run time, and `w` holds exactly
                // `a.len()` blocks of this type (checked above), which is all the
                // kernel reads.
                return Ok(unsafe { avx2::$simd(w, a) });
            }
            $reference(w, a)
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2;
mod dispatch;
mod f16;
mod q2_k;
mod q3_k;
mod q4_0;
mod q4_1;
mod q4_1_r16;
mod q4_k;
mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
mod q8_0;
mod q8_0_r16;
mod q8_0_r2;
mod q8_1;
mod q8_k;
mod repacked;
mod threads;
mod tiles;
#[cfg(target_arch = "x86_64")]
mod transposed;
#[cfg(target_arch = "x86_64")]
mod transposed_k;
mod unpack;

pub(crate) use crate::cpu::has_avx512_bw_vl;
pub use crate::cpu::{has_avx2_f16c, has_avx512_vnni, has_avx_vnni};
pub(crate) use dispatch::check_matvec;
pub use dispatch::{
    matvec, matvec_ref, quantize_activation, quantize_activation_into, vec_dot, vec_dot_ref,
    QuantizedActs,
};
pub use f16::{f16_to_f32, f32_to_f16};
pub use q2_k::{dequantize_q2_k, BlockQ2K};
pub use q3_k::{dequantize_q3_k, BlockQ3K};
pub use q4_0::{dequantize_q4_0, vec_dot_q4_0_q8_0, vec_dot_q4_0_q8_0_ref, BlockQ4_0};
pub use q4_1::{dequantize_q4_1, vec_dot_q4_1_q8_1, vec_dot_q4_1_q8_1_ref, BlockQ4_1};
pub use q4_1_r16::{
    dequantize_row_q4_1_r16, repack_q4_1_r16, repack_q4_1_r16_into, row_to_q4_1,
    vec_dot_row_q4_1_r16, R16_BLOCK, R16_ROWS,
};
pub use q4_k::{dequantize_q4_k, vec_dot_q4_k_q8_k, vec_dot_q4_k_q8_k_ref, BlockQ4K};
pub use q5_0::{dequantize_q5_0, vec_dot_q5_0_q8_0, vec_dot_q5_0_q8_0_ref, BlockQ5_0};
pub use q5_1::{dequantize_q5_1, vec_dot_q5_1_q8_1, vec_dot_q5_1_q8_1_ref, BlockQ5_1};
pub use q5_k::{dequantize_q5_k, vec_dot_q5_k_q8_k, vec_dot_q5_k_q8_k_ref, BlockQ5K};
pub use q6_k::{dequantize_q6_k, vec_dot_q6_k_q8_k, vec_dot_q6_k_q8_k_ref, BlockQ6K};
pub use q8_0::{
    dequantize_q8_0, quantize_q8_0, quantize_q8_0_into, vec_dot_q8_0_q8_0, vec_dot_q8_0_q8_0_ref,
    BlockQ8_0,
};
pub use q8_0_r16::{
    dequantize_row_q8_0_r16, repack_q8_0_r16, repack_q8_0_r16_into, row_to_q8_0_r16,
    vec_dot_row_q8_0_r16, Q8_0_R16_BLOCK,
};
pub use q8_0_r2::{
    dequantize_row_q8_0_r2, repack_q8_0_r2, repack_q8_0_r2_into, row_to_q8_0, vec_dot_row, R2_BLOCK,
};
pub use q8_1::{quantize_q8_1, quantize_q8_1_into, BlockQ8_1};
pub use q8_k::{dequantize_q8_k, quantize_q8_k, quantize_q8_k_into, BlockQ8K};
pub use threads::{
    matmul_many, matmul_threads, matmul_threads_into, matvec_many, matvec_pool, matvec_threads,
    Matmul, Matvec,
};
pub use unpack::k4_scale_min;

// Shared with the kernels in the files beside this one.
use dispatch::matvec_with;
use f16::f16_at;
use q8_0::q8_block_ref;
use unpack::k_mins;

// Internals the tests reach through `use super::*`.
#[cfg(test)]
use dispatch::matvec_isa;
#[cfg(test)]
use q8_0::c_amax;
#[cfg(test)]
use q8_k::q8k_block_ref;
#[cfg(test)]
use threads::{matmul_rows_isa, matvec_range_rows};
#[cfg(all(test, target_arch = "x86_64"))]
use tiles::k_quant;
#[cfg(test)]
use tiles::TileIsa;

// ---------------------------------------------------------------------------------
// Errors and the weight types
// ---------------------------------------------------------------------------------

/// A weight type with a quantized dot product here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QType {
    /// ggml Q4_0 (18-byte blocks of 32).
    Q4_0,
    /// ggml Q4_1 (20-byte blocks of 32).
    Q4_1,
    /// ggml Q5_0 (22-byte blocks of 32).
    Q5_0,
    /// ggml Q5_1 (24-byte blocks of 32).
    Q5_1,
    /// ggml Q8_0 (34-byte blocks of 32).
    Q8_0,
    /// ggml Q4_K (144-byte super-blocks of 256).
    Q4K,
    /// ggml Q5_K (176-byte super-blocks of 256).
    Q5K,
    /// ggml Q6_K (210-byte super-blocks of 256).
    Q6K,
    /// Q8_0 repacked at load in row pairs (not a GGUF type; [`repack_q8_0_r2`], layout
    /// in `q8_0_r2.rs`): 34 bytes per block of 32 as Q8_0, the same products' bits, an
    /// even number of rows. Not in [`QType::ALL`].
    Q8_0R2,
    /// Q4_1 repacked at load in groups of 16 rows (not a GGUF type;
    /// [`repack_q4_1_r16`], layout in `q4_1_r16.rs`): 20 bytes per block of 32 as Q4_1,
    /// the same products' bits, a multiple of 16 rows. Not in [`QType::ALL`].
    Q4_1R16,
    /// Q8_0 repacked at load in groups of 16 rows (not a GGUF type;
    /// [`repack_q8_0_r16`], layout in `q8_0_r16.rs`): 34 bytes per block of 32 as Q8_0,
    /// the same products' bits, a multiple of 16 rows. Not in [`QType::ALL`].
    Q8_0R16,
}

/// Which activation block type a weight type pairs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActKind {
    /// [`BlockQ8_0`].
    Q8_0,
    /// [`BlockQ8_1`].
    Q8_1,
    /// [`BlockQ8K`].
    Q8K,
}

impl QType {
    /// Every type, in ggml's type-id order.
    pub const ALL: [QType; 8] = [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q4K,
        QType::Q5K,
        QType::Q6K,
    ];

    /// Elements per block (32, or 256 for the K types).
    pub fn block_elems(self) -> usize {
        match self {
            QType::Q4K | QType::Q5K | QType::Q6K => QK_K,
            _ => QK,
        }
    }

    /// Bytes per block (ggml `type_size`).
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q4_0 => 18,
            QType::Q4_1 | QType::Q4_1R16 => 20,
            QType::Q5_0 => 22,
            QType::Q5_1 => 24,
            QType::Q8_0 | QType::Q8_0R2 | QType::Q8_0R16 => 34,
            QType::Q4K => 144,
            QType::Q5K => 176,
            QType::Q6K => 210,
        }
    }

    /// The activation block type this weight type is multiplied with.
    pub fn act_kind(self) -> ActKind {
        match self {
            QType::Q4_0 | QType::Q5_0 | QType::Q8_0 | QType::Q8_0R2 | QType::Q8_0R16 => {
                ActKind::Q8_0
            }
            QType::Q4_1 | QType::Q5_1 | QType::Q4_1R16 => ActKind::Q8_1,
            QType::Q4K | QType::Q5K | QType::Q6K => ActKind::Q8K,
        }
    }

    /// The rows a matrix of this type is stored in groups of, so that its row ranges
    /// (a thread's share, a chunk) start at multiples of it: 2 for [`QType::Q8_0R2`],
    /// 16 for [`QType::Q4_1R16`] and [`QType::Q8_0R16`], else 1.
    pub fn row_group(self) -> usize {
        match self {
            QType::Q8_0R2 => 2,
            QType::Q4_1R16 | QType::Q8_0R16 => R16_ROWS,
            _ => 1,
        }
    }

    /// ggml's name ("Q4_0", "Q4_K", ...).
    pub fn name(self) -> &'static str {
        match self {
            QType::Q4_0 => "Q4_0",
            QType::Q4_1 => "Q4_1",
            QType::Q5_0 => "Q5_0",
            QType::Q5_1 => "Q5_1",
            QType::Q8_0 => "Q8_0",
            QType::Q4K => "Q4_K",
            QType::Q5K => "Q5_K",
            QType::Q6K => "Q6_K",
            QType::Q8_0R2 => "Q8_0_R2",
            QType::Q4_1R16 => "Q4_1_R16",
            QType::Q8_0R16 => "Q8_0_R16",
        }
    }
}

impl fmt::Display for QType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a quantization or a quantized product was refused. No function in this module
/// panics on bad lengths; it returns one of these.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuantError {
    /// An activation length is not a whole number of blocks.
    NotBlockMultiple {
        /// Elements given.
        len: usize,
        /// Elements per block.
        block: usize,
    },
    /// A weight row's byte length does not hold exactly one block per activation block.
    RowLength {
        /// Weight type.
        ty: QType,
        /// Weight bytes given.
        bytes: usize,
        /// Bytes needed: `activation blocks × block_bytes`.
        expected: usize,
    },
    /// The activation blocks are not the kind this weight type pairs with.
    ActKind {
        /// Weight type.
        ty: QType,
        /// The kind given.
        got: ActKind,
    },
    /// A matrix or output buffer does not match `rows × row bytes` / `rows`.
    MatrixShape {
        /// What was wrong, with the sizes.
        detail: String,
    },
}

impl fmt::Display for QuantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantError::NotBlockMultiple { len, block } => {
                write!(
                    f,
                    "{len} elements is not a multiple of the block size {block}"
                )
            }
            QuantError::RowLength {
                ty,
                bytes,
                expected,
            } => write!(
                f,
                "{ty}: weight row has {bytes} bytes, the activation needs exactly {expected}"
            ),
            QuantError::ActKind { ty, got } => write!(
                f,
                "{ty} weights pair with {:?} activations, got {got:?}",
                ty.act_kind()
            ),
            QuantError::MatrixShape { detail } => write!(f, "quantized matvec: {detail}"),
        }
    }
}

impl std::error::Error for QuantError {}

fn check_row(ty: QType, bytes: usize, blocks: usize) -> Result<(), QuantError> {
    let expected = blocks.checked_mul(ty.block_bytes());
    if expected == Some(bytes) {
        Ok(())
    } else {
        Err(QuantError::RowLength {
            ty,
            bytes,
            expected: expected.unwrap_or(usize::MAX),
        })
    }
}

fn check_multiple(len: usize, block: usize) -> Result<(), QuantError> {
    if len.is_multiple_of(block) {
        Ok(())
    } else {
        Err(QuantError::NotBlockMultiple { len, block })
    }
}

#[cfg(test)]
mod tests;
