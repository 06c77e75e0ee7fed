//! Q4_0 weights (ggml `block_q4_0`, 18-byte blocks of 32: an f16 scale and 4-bit quants
//! offset by 8) × Q8_0 activations: the scalar reference and its dispatch; the block
//! struct and its dequantizer.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::f16::f16_le;
use super::unpack::{accumulate_block, block_sum, nibbles, weight_blocks};
use super::{check_row, f16_to_f32, has_avx2_f16c, BlockQ8_0, QType, QuantError};
use bytemuck::{Pod, Zeroable};
use std::mem::size_of;

/// Scalar reference of Q4_0 × Q8_0 in the canonical order ([`super`] docs).
///
/// Shapes: `w` is one row of `a.len()` Q4_0 blocks (`18 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q4_0_q8_0_ref(w: &[u8], a: &[BlockQ8_0]) -> Result<f32, QuantError> {
    check_row(QType::Q4_0, w.len(), a.len())?;
    let mut acc = 0f32;
    for (wb, ab) in weight_blocks::<BlockQ4_0>(w).zip(a) {
        let d = f16_le(wb.d) * f16_to_f32(ab.d);
        let q = nibbles(&wb.qs).map(|v| v - 8);
        acc = accumulate_block(acc, d, block_sum(&q, &ab.qs));
    }
    Ok(acc)
}

dispatch!(
    /// Q4_0 weights × Q8_0 activations, one row: `Σ_e w_e x_e` over the row.
    vec_dot_q4_0_q8_0, vec_dot_q4_0_q8_0_ref, dot_q4_0_q8_0, QType::Q4_0, BlockQ8_0
);

/// Q4_0 block (ggml `block_q4_0`, 18 bytes): `d` (f16), `qs` 16 bytes holding 32
/// 4-bit quants, element `j < 16` in the low nibble of `qs[j]`, element `j + 16` in
/// the high nibble.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// Scale, IEEE f16 little-endian.
    pub d: [u8; 2],
    /// Packed nibbles.
    pub qs: [u8; 16],
}
const _: () = assert!(size_of::<BlockQ4_0>() == 18);

/// Q4_0: `x = d * (q - 8)` (gguf-py `Q4_0.dequantize_blocks`). `out.len() == 32 * blocks.len()`.
pub fn dequantize_q4_0(blocks: &[BlockQ4_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_le(b.d);
        for j in 0..16 {
            let lo = (b.qs[j] & 0x0f) as i8 - 8;
            let hi = (b.qs[j] >> 4) as i8 - 8;
            o[j] = d * lo as f32;
            o[j + 16] = d * hi as f32;
        }
    }
}
