//! Q5_0 weights (ggml `block_q5_0`, 22-byte blocks of 32: an f16 scale and 5-bit quants
//! offset by 16) × Q8_0 activations: the scalar reference and its dispatch; the block
//! struct and its dequantizer.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::f16::f16_le;
use super::unpack::q5_value;
use super::unpack::{accumulate_block, block_sum, five_bit, weight_blocks};
use super::{check_row, f16_to_f32, has_avx2_f16c, BlockQ8_0, QType, QuantError};
use bytemuck::{Pod, Zeroable};
use std::mem::size_of;

/// Scalar reference of Q5_0 × Q8_0 in the canonical order ([`super`] docs).
///
/// Shapes: `w` is one row of `a.len()` Q5_0 blocks (`22 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q5_0_q8_0_ref(w: &[u8], a: &[BlockQ8_0]) -> Result<f32, QuantError> {
    check_row(QType::Q5_0, w.len(), a.len())?;
    let mut acc = 0f32;
    for (wb, ab) in weight_blocks::<BlockQ5_0>(w).zip(a) {
        let d = f16_le(wb.d) * f16_to_f32(ab.d);
        let q = five_bit(&wb.qh, &wb.qs).map(|v| v - 16);
        acc = accumulate_block(acc, d, block_sum(&q, &ab.qs));
    }
    Ok(acc)
}

dispatch!(
    /// Q5_0 weights × Q8_0 activations, one row.
    vec_dot_q5_0_q8_0, vec_dot_q5_0_q8_0_ref, dot_q5_0_q8_0, QType::Q5_0, BlockQ8_0
);

/// Q5_0 block (ggml `block_q5_0`, 22 bytes): `d` (f16), `qh` the fifth bit of
/// element `j` at bit `j` of a little-endian u32, `qs` the low nibbles as in Q4_0.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// Scale, f16.
    pub d: [u8; 2],
    /// High bits, u32 little-endian.
    pub qh: [u8; 4],
    /// Low nibbles.
    pub qs: [u8; 16],
}
const _: () = assert!(size_of::<BlockQ5_0>() == 22);

/// Q5_0: `x = d * (q - 16)` (gguf-py `Q5_0.dequantize_blocks`).
pub fn dequantize_q5_0(blocks: &[BlockQ5_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_le(b.d);
        let qh = u32::from_le_bytes(b.qh);
        for (j, x) in o.iter_mut().enumerate() {
            let q = q5_value(qh, &b.qs, j) as i8 - 16;
            *x = d * q as f32;
        }
    }
}
