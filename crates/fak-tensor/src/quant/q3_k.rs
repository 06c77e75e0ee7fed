//! Q3_K weights (ggml `block_q3_K`, 110-byte super-blocks of 256: sixteen groups of 16
//! with 6-bit scales, 3-bit quants): the block struct and its dequantizer (no
//! quantized dot product here).

use super::f16::f16_le;
use super::QK_K;
use bytemuck::{Pod, Zeroable};
use std::mem::size_of;

/// Q3_K super-block (ggml `block_q3_K`, 110 bytes, 256 elements in 16 groups of 16).
///
/// Element `e` takes 2 low bits from `qs` as in Q2_K and subtracts 4 when bit
/// `e / 32` of `hmask[e % 32]` is clear. The 16 6-bit scales are packed in 12 bytes:
/// low nibbles from `scales[k % 8]` (`k < 8` low, else high nibble), high 2 bits
/// from `scales[8 + k % 4] >> (2 * (k / 4))`; each scale is biased by 32.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ3K {
    /// High bit of each quant (inverted: clear means subtract 4).
    pub hmask: [u8; QK_K / 8],
    /// Low 2 bits of each quant.
    pub qs: [u8; QK_K / 4],
    /// Packed 6-bit scales.
    pub scales: [u8; 12],
    /// Super-block scale, f16.
    pub d: [u8; 2],
}
const _: () = assert!(size_of::<BlockQ3K>() == 110);

/// The 16 signed 6-bit scales of a Q3_K block, bias 32 removed.
fn q3_k_scales(s: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (k, o) in out.iter_mut().enumerate() {
        let lo = if k < 8 { s[k] & 0x0f } else { s[k - 8] >> 4 };
        let hi = (s[8 + k % 4] >> (2 * (k / 4))) & 0x03;
        *o = (lo | (hi << 4)) as i8 - 32;
    }
    out
}

/// Q3_K: per group of 16, `dl = d * scale`, `x = dl * q` with `q` in -4..=3
/// (gguf-py `Q3_K.dequantize_blocks`).
pub fn dequantize_q3_k(blocks: &[BlockQ3K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_le(b.d);
        let scales = q3_k_scales(&b.scales);
        for (e, x) in o.iter_mut().enumerate() {
            let dl = d * scales[e / 16] as f32;
            let (half, shift, lane) = (e / 128, (e % 128) / 32, e % 32);
            let low = ((b.qs[half * 32 + lane] >> (2 * shift)) & 3) as i8;
            let high_set = (b.hmask[lane] >> (e / 32)) & 1 == 1;
            let q = if high_set { low } else { low - 4 };
            *x = dl * q as f32;
        }
    }
}
