//! Q4_1 weights (ggml `block_q4_1`, 20-byte blocks of 32: f16 scale and minimum, 4-bit
//! quants) × Q8_1 activations: the scalar reference and its dispatch; the block struct
//! and its dequantizer.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::f16::f16_le;
use super::unpack::{accumulate_block, block_sum, nibbles, weight_blocks};
use super::{check_row, f16_to_f32, has_avx2_f16c, BlockQ8_1, QType, QuantError};
use bytemuck::{Pod, Zeroable};
use std::mem::size_of;

/// Scalar reference of Q4_1 × Q8_1 in the canonical order ([`super`] docs).
///
/// Shapes: `w` is one row of `a.len()` Q4_1 blocks (`20 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q4_1_q8_1_ref(w: &[u8], a: &[BlockQ8_1]) -> Result<f32, QuantError> {
    check_row(QType::Q4_1, w.len(), a.len())?;
    let mut acc = 0f32;
    let mut summ = 0f32;
    for (wb, ab) in weight_blocks::<BlockQ4_1>(w).zip(a) {
        let d = f16_le(wb.d) * f16_to_f32(ab.d);
        acc = accumulate_block(acc, d, block_sum(&nibbles(&wb.qs), &ab.qs));
        summ += f16_le(wb.m) * f16_to_f32(ab.s);
    }
    Ok(acc + summ)
}

dispatch!(
    /// Q4_1 weights × Q8_1 activations, one row.
    vec_dot_q4_1_q8_1, vec_dot_q4_1_q8_1_ref, dot_q4_1_q8_1, QType::Q4_1, BlockQ8_1
);

/// Q4_1 block (ggml `block_q4_1`, 20 bytes): `d`, `m` (f16), `qs` as in [`BlockQ4_0`](super::BlockQ4_0).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// Scale, f16.
    pub d: [u8; 2],
    /// Minimum (offset), f16.
    pub m: [u8; 2],
    /// Packed nibbles.
    pub qs: [u8; 16],
}
const _: () = assert!(size_of::<BlockQ4_1>() == 20);

/// Q4_1: `x = (d * q) + m` (gguf-py `Q4_1.dequantize_blocks`).
pub fn dequantize_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_le(b.d);
        let m = f16_le(b.m);
        for j in 0..16 {
            let lo = (b.qs[j] & 0x0f) as f32;
            let hi = (b.qs[j] >> 4) as f32;
            o[j] = d * lo + m;
            o[j + 16] = d * hi + m;
        }
    }
}
