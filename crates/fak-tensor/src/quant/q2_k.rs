//! Q2_K weights (ggml `block_q2_K`, 84-byte super-blocks of 256: sixteen groups of 16
//! with 4-bit scales and mins, 2-bit quants): the block struct and its dequantizer (no
//! quantized dot product here).

use super::f16::f16_le;
use super::QK_K;
use bytemuck::{Pod, Zeroable};
use std::mem::size_of;

/// Q2_K super-block (ggml `block_q2_K`, 84 bytes, 256 elements in 16 groups of 16).
///
/// `scales[k]`: low nibble scales group `k`, high nibble is its min. Element `e`
/// (half `e / 128`, shift `(e % 128) / 32`, lane `e % 32`) is 2 bits of
/// `qs[half * 32 + lane] >> (2 * shift)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ2K {
    /// Per-group 4-bit scale (low) and min (high).
    pub scales: [u8; QK_K / 16],
    /// 2-bit quants.
    pub qs: [u8; QK_K / 4],
    /// Super-block scale for the scales, f16.
    pub d: [u8; 2],
    /// Super-block scale for the mins, f16.
    pub dmin: [u8; 2],
}
const _: () = assert!(size_of::<BlockQ2K>() == 84);

/// Q2_K: per group of 16, `dl = d * (scale & 15)`, `ml = dmin * (scale >> 4)`,
/// `x = (dl * q) - ml` (gguf-py `Q2_K.dequantize_blocks`).
pub fn dequantize_q2_k(blocks: &[BlockQ2K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_le(b.d);
        let dmin = f16_le(b.dmin);
        for (e, x) in o.iter_mut().enumerate() {
            let sc = b.scales[e / 16];
            let dl = d * (sc & 0x0f) as f32;
            let ml = dmin * (sc >> 4) as f32;
            let (half, shift, lane) = (e / 128, (e % 128) / 32, e % 32);
            let q = (b.qs[half * 32 + lane] >> (2 * shift)) & 3;
            *x = dl * q as f32 - ml;
        }
    }
}
