//! Q5_K weights (ggml `block_q5_K`, 176-byte super-blocks of 256: Q4_K plus a fifth bit
//! per quant) × Q8_K activations: the scalar reference and its dispatch; the block struct
//! and its dequantizer.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::f16::f16_le;
use super::q4_k::{k45_ref, KHead};
use super::unpack::k4_scale_min;
use super::QK_K;
use super::{check_row, has_avx2_f16c, BlockQ8K, QType, QuantError};
use bytemuck::{Pod, Zeroable};
use std::mem::size_of;

/// Scalar reference of Q5_K × Q8_K in the canonical order ([`super`] docs).
///
/// Shapes: `w` is one row of `a.len()` Q5_K super-blocks (`176 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q5_k_q8_k_ref(w: &[u8], a: &[BlockQ8K]) -> Result<f32, QuantError> {
    check_row(QType::Q5K, w.len(), a.len())?;
    // As Q4_K, plus bit g of qh[e % 32] as bit 4.
    Ok(k45_ref(w, a, |b: &BlockQ5K, e| {
        let (g, lane) = (e / 32, e % 32);
        let lo = (b.qs[32 * (g / 2) + lane] >> (4 * (g % 2))) & 0x0f;
        let hi = (b.qh[lane] >> g) & 1;
        (lo | (hi << 4)) as i32
    }))
}

dispatch!(
    /// Q5_K weights × Q8_K activations, one row.
    vec_dot_q5_k_q8_k, vec_dot_q5_k_q8_k_ref, dot_q5_k_q8_k, QType::Q5K, BlockQ8K
);

/// Q5_K super-block (ggml `block_q5_K`, 176 bytes): as Q4_K plus a fifth bit for
/// group `g` at bit `g` of `qh[lane]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5K {
    /// Super-block scale for the scales, f16.
    pub d: [u8; 2],
    /// Super-block scale for the mins, f16.
    pub dmin: [u8; 2],
    /// Packed 6-bit scales and mins.
    pub scales: [u8; 12],
    /// Fifth bits.
    pub qh: [u8; QK_K / 8],
    /// Low 4 bits.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(size_of::<BlockQ5K>() == 176);

impl KHead for BlockQ5K {
    fn head(&self) -> ([u8; 2], [u8; 2], [u8; 12]) {
        (self.d, self.dmin, self.scales)
    }
}

/// Q5_K: as Q4_K with a fifth bit per quant (gguf-py `Q5_K.dequantize_blocks`).
pub fn dequantize_q5_k(blocks: &[BlockQ5K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_le(b.d);
        let dmin = f16_le(b.dmin);
        let (sc, mn) = k4_scale_min(&b.scales);
        for (g, og) in o.chunks_exact_mut(32).enumerate() {
            let dg = d * sc[g] as f32;
            let mg = dmin * mn[g] as f32;
            let (c, h) = (g / 2, g % 2);
            for (lane, x) in og.iter_mut().enumerate() {
                let lo = (b.qs[c * 32 + lane] >> (4 * h)) & 0x0f;
                let hi = (b.qh[lane] >> g) & 1;
                let q = lo | (hi << 4);
                *x = dg * q as f32 - mg;
            }
        }
    }
}
