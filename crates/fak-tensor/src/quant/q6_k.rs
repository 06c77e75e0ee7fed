//! Q6_K weights (ggml `block_q6_K`, 210-byte super-blocks of 256: sixteen groups of 16
//! with i8 scales, 6-bit quants offset by 32) × Q8_K activations: the scalar reference
//! and its dispatch; the block struct and its dequantizer.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::f16::f16_le;
use super::unpack::{accumulate, lanes4, weight_blocks};
use super::QK_K;
use super::{check_row, has_avx2_f16c, BlockQ8K, QType, QuantError, QK};
use crate::dot::reduce_lanes;
use bytemuck::{Pod, Zeroable};
use std::mem::size_of;

/// Scalar reference of Q6_K × Q8_K in the canonical order ([`super`] docs).
///
/// Shapes: `w` is one row of `a.len()` Q6_K super-blocks (`210 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q6_k_q8_k_ref(w: &[u8], a: &[BlockQ8K]) -> Result<f32, QuantError> {
    check_row(QType::Q6K, w.len(), a.len())?;
    let mut acc = [0f32; 8];
    for (wb, ab) in weight_blocks::<BlockQ6K>(w).zip(a) {
        let (ql, qh, scales) = (&wb.ql, &wb.qh, &wb.scales);
        let mut l = [0i32; 8];
        for c in 0..8 {
            // Element e (half e / 128, r = e % 128): low nibble r / 64 of
            // ql[64 half + r % 64], high bits 2 (r / 32) of qh[32 half + r % 32].
            let mut wc = [0i32; QK];
            for (lane, v) in wc.iter_mut().enumerate() {
                let e = 32 * c + lane;
                let (half, r) = (e / 128, e % 128);
                let lo = (ql[64 * half + r % 64] >> (4 * (r / 64))) & 0x0f;
                let hi = (qh[32 * half + r % 32] >> (2 * (r / 32))) & 0x03;
                *v = (lo | (hi << 4)) as i32 - 32;
            }
            let lc = lanes4(&wc, &ab.qs[32 * c..32 * c + 32]);
            for m in 0..8 {
                l[m] += (scales[2 * c + m / 4] as i8) as i32 * lc[m];
            }
        }
        accumulate(&mut acc, ab.d * f16_le(wb.d), &l);
    }
    Ok(reduce_lanes(&acc))
}

dispatch!(
    /// Q6_K weights × Q8_K activations, one row.
    vec_dot_q6_k_q8_k, vec_dot_q6_k_q8_k_ref, dot_q6_k_q8_k, QType::Q6K, BlockQ8K
);

/// Q6_K super-block (ggml `block_q6_K`, 210 bytes, 256 elements in 16 groups of 16).
///
/// Element `e` (half `e / 128`, `r = e % 128`): low 4 bits are nibble `r / 64` of
/// `ql[64 * half + r % 64]`, high 2 bits are `qh[32 * half + r % 32] >> (2 * (r / 32))`;
/// the 6-bit value is biased by 32; `scales` are i8.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ6K {
    /// Low 4 bits.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits.
    pub qh: [u8; QK_K / 4],
    /// Per-group scales, i8.
    pub scales: [u8; QK_K / 16],
    /// Super-block scale, f16.
    pub d: [u8; 2],
}
const _: () = assert!(size_of::<BlockQ6K>() == 210);

/// Q6_K: per group of 16, `dl = d * scale`, `x = dl * (q - 32)`
/// (gguf-py `Q6_K.dequantize_blocks`).
pub fn dequantize_q6_k(blocks: &[BlockQ6K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_le(b.d);
        for (e, x) in o.iter_mut().enumerate() {
            let dl = d * (b.scales[e / 16] as i8) as f32;
            let (half, r) = (e / 128, e % 128);
            let lo = (b.ql[64 * half + r % 64] >> (4 * (r / 64))) & 0x0f;
            let hi = (b.qh[32 * half + r % 32] >> (2 * (r / 32))) & 0x03;
            let q = (lo | (hi << 4)) as i8 - 32;
            *x = dl * q as f32;
        }
    }
}
