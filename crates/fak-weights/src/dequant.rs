//! Dequantization of ggml block formats to f32.
//!
//! The block formats are fak-tensor's, each defined once in its file under
//! `fak_tensor::quant` (re-exported here): a plain `#[repr(C)]` block struct whose
//! layout and size follow ggml's `ggml-common.h`, and one scalar function that expands
//! a slice of blocks. The arithmetic reproduces gguf-py's `gguf.quants.dequantize`
//! (`gguf-py/gguf/quants.py`) bit for bit: f16 scales are widened exactly to f32, every
//! product and sum is a single f32 operation in the same order as the numpy expression
//! (no fused multiply-add), so NaN, infinite and subnormal scales give the same bits.
//!
//! The weight block structs are made of byte arrays only (alignment 1), so a byte
//! slice of any alignment can be viewed as a block slice without copying. Q8_0 and
//! Q8_K blocks are the quantized dot products' activation blocks ([`BlockQ8_0`],
//! [`BlockQ8K`], with typed fields): [`dequantize`] reads them from the file bytes one
//! block at a time, little-endian.

use crate::ggml_type::GgmlType;
use bytemuck::Pod;
pub use fak_tensor::quant::{
    dequantize_q2_k, dequantize_q3_k, dequantize_q4_0, dequantize_q4_1, dequantize_q4_k,
    dequantize_q5_0, dequantize_q5_1, dequantize_q5_k, dequantize_q6_k, dequantize_q8_0,
    dequantize_q8_k, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0,
    BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0,
};

/// Why a buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// This crate has no dequantizer for the type (i-quants, ternary, MXFP4, integer
    /// types, Q8_1).
    #[error("dequantization of {0} is not supported")]
    Unsupported(GgmlType),
    /// The output length is not a whole number of blocks.
    #[error("{ty}: {n_elements} output elements is not a multiple of the block size {block_size}")]
    NotBlockMultiple {
        /// The type being dequantized.
        ty: GgmlType,
        /// Requested output elements.
        n_elements: usize,
        /// Elements per block of `ty`.
        block_size: usize,
    },
    /// The input byte length does not equal the bytes needed for the output length.
    #[error("{ty}: {got} input bytes, but {n_elements} elements need exactly {expected} bytes")]
    LengthMismatch {
        /// The type being dequantized.
        ty: GgmlType,
        /// Requested output elements.
        n_elements: usize,
        /// Bytes required for `n_elements` of `ty`.
        expected: usize,
        /// Bytes supplied.
        got: usize,
    },
}

/// Widen IEEE binary16 bits to f32 exactly, as numpy's `astype(np.float32)` does
/// (subnormals normalized; NaN sign and payload shifted into place, and a signalling
/// NaN stays signalling, unlike `half::f16::to_f32` and torch, which set the quiet
/// bit; see [`crate::widen_f16`] for that variant).
///
/// This is the conversion gguf-py applies to every f16 scale and to F16 tensors; it is
/// fak-tensor's [`fak_tensor::quant::f16_to_f32`], the widening of the quantized dot
/// products too, defined once there.
pub use fak_tensor::quant::f16_to_f32 as f16_bits_to_f32;

/// Dequantize `data` holding `out.len()` elements of type `ty` into `out`
/// (row-major, element order as stored).
///
/// Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
/// Q6_K (bit-exact with gguf-py `gguf.quants.dequantize`) and Q8_K (ggml
/// `dequantize_row_q8_K`: `d * q`).
///
/// # Errors
/// [`DequantError::Unsupported`] for other types; [`DequantError::NotBlockMultiple`]
/// when `out.len()` is not a multiple of `ty.block_size()`;
/// [`DequantError::LengthMismatch`] when `data.len()` differs from the bytes needed
/// for `out.len()` elements. `out` is untouched on error.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    use GgmlType::*;
    if !matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
    ) {
        return Err(DequantError::Unsupported(ty));
    }
    let n = out.len();
    let bs = ty.block_size();
    if !n.is_multiple_of(bs) {
        return Err(DequantError::NotBlockMultiple {
            ty,
            n_elements: n,
            block_size: bs,
        });
    }
    let expected = (n / bs).checked_mul(ty.type_size());
    if expected != Some(data.len()) {
        return Err(DequantError::LengthMismatch {
            ty,
            n_elements: n,
            expected: expected.unwrap_or(usize::MAX),
            got: data.len(),
        });
    }
    match ty {
        F32 => dequantize_f32(data, out),
        F16 => dequantize_f16(data, out),
        BF16 => dequantize_bf16(data, out),
        Q4_0 => dequantize_q4_0(blocks(ty, n, data)?, out),
        Q4_1 => dequantize_q4_1(blocks(ty, n, data)?, out),
        Q5_0 => dequantize_q5_0(blocks(ty, n, data)?, out),
        Q5_1 => dequantize_q5_1(blocks(ty, n, data)?, out),
        Q8_0 => {
            for (c, o) in data.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
                // One block from file bytes of any alignment; its f16 scale is little-endian.
                let b: BlockQ8_0 = bytemuck::pod_read_unaligned(c);
                let d = u16::from_le(b.d);
                dequantize_q8_0(&[BlockQ8_0 { d, ..b }], o);
            }
        }
        Q2_K => dequantize_q2_k(blocks(ty, n, data)?, out),
        Q3_K => dequantize_q3_k(blocks(ty, n, data)?, out),
        Q4_K => dequantize_q4_k(blocks(ty, n, data)?, out),
        Q5_K => dequantize_q5_k(blocks(ty, n, data)?, out),
        Q6_K => dequantize_q6_k(blocks(ty, n, data)?, out),
        Q8_K => {
            for (c, o) in data.chunks_exact(292).zip(out.chunks_exact_mut(256)) {
                // One block from file bytes of any alignment; its f32 scale is
                // little-endian (the group sums are not read).
                let b: BlockQ8K = bytemuck::pod_read_unaligned(c);
                let d = f32::from_bits(u32::from_le(b.d.to_bits()));
                dequantize_q8_k(&[BlockQ8K { d, ..b }], o);
            }
        }
        _ => return Err(DequantError::Unsupported(ty)),
    }
    Ok(())
}

/// View bytes as blocks of `ty`. The caller has checked that `data.len()` is a whole
/// number of `ty`'s blocks, and every block struct has alignment 1 (asserted at compile
/// time), so the cast fails only if `B` is not `ty`'s block: then it is
/// [`DequantError::LengthMismatch`] for `n` elements, never a panic or a silent no-op.
fn blocks<B: Pod>(ty: GgmlType, n: usize, data: &[u8]) -> Result<&[B], DequantError> {
    const { assert!(std::mem::align_of::<B>() == 1) };
    bytemuck::try_cast_slice(data)
        .ok()
        .filter(|_| std::mem::size_of::<B>() == ty.type_size())
        .ok_or(DequantError::LengthMismatch {
            ty,
            n_elements: n,
            expected: (n / ty.block_size()).saturating_mul(std::mem::size_of::<B>()),
            got: data.len(),
        })
}

/// F32: little-endian copy. `out.len() * 4 == data.len()`.
pub fn dequantize_f32(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// F16: exact widening with [`f16_bits_to_f32`] (gguf-py: `view(np.float16).astype(np.float32)`).
pub fn dequantize_f16(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
        *o = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// BF16: the 16 bits become the top half of an f32 (gguf-py: `int16 << 16`), NaNs
/// untouched.
pub fn dequantize_bf16(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_widening_matches_half_on_every_non_nan() {
        for h in 0..=u16::MAX {
            let ours = f16_bits_to_f32(h);
            let theirs = half::f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}");
                // Quiet NaNs agree bit for bit; signalling NaNs keep their payload here.
                if h & 0x0200 != 0 {
                    assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
                }
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn q4_0_by_hand() {
        // d = 0.5 (f16 0x3800); qs[0] = 0x9F -> element 0 = 15-8 = 7, element 16 = 9-8 = 1.
        let mut block = [0u8; 18];
        block[0..2].copy_from_slice(&0x3800u16.to_le_bytes());
        block[2] = 0x9f;
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_0, &block, &mut out).unwrap();
        assert_eq!(out[0], 3.5);
        assert_eq!(out[16], 0.5);
        assert_eq!(out[1], -4.0);
    }

    #[test]
    fn length_errors() {
        let mut out = [0f32; 31];
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 18], &mut out),
            Err(DequantError::NotBlockMultiple { .. })
        ));
        let mut out = [0f32; 32];
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 17], &mut out),
            Err(DequantError::LengthMismatch { .. })
        ));
        assert_eq!(
            dequantize(GgmlType::IQ2_XXS, &[], &mut []),
            Err(DequantError::Unsupported(GgmlType::IQ2_XXS))
        );
    }
}
