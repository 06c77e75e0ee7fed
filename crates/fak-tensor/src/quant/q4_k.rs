//! Q4_K weights (ggml `block_q4_K`, 144-byte super-blocks of 256: eight groups of 32
//! with 6-bit scales and mins) × Q8_K activations: the scalar reference (and the one it
//! shares with Q5_K) and its dispatch; the block struct and its dequantizer.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::f16::f16_le;
use super::unpack::{accumulate, k4_scale_min, k_mins, lanes4, weight_blocks};
use super::QK_K;
use super::{check_row, has_avx2_f16c, BlockQ8K, QType, QuantError, QK};
use crate::dot::reduce_lanes;
use bytemuck::{Pod, Zeroable};
use std::mem::size_of;

/// The head Q4_K and Q5_K super-blocks share: `d`, `dmin` (f16) and the twelve bytes of
/// packed 6-bit scales and minimums.
pub(crate) trait KHead: Pod {
    /// `(d, dmin, scales)`.
    fn head(&self) -> ([u8; 2], [u8; 2], [u8; 12]);
}

impl KHead for BlockQ4K {
    fn head(&self) -> ([u8; 2], [u8; 2], [u8; 12]) {
        (self.d, self.dmin, self.scales)
    }
}

/// Scalar reference shared by Q4_K and Q5_K: `q(block, e)` gives the unsigned quant of
/// element `e`.
pub(crate) fn k45_ref<B: KHead>(w: &[u8], a: &[BlockQ8K], q: impl Fn(&B, usize) -> i32) -> f32 {
    let mut acc = [0f32; 8];
    let mut summ = 0f32;
    for (wb, ab) in weight_blocks::<B>(w).zip(a) {
        let (d, dmin, scales) = wb.head();
        let (sc, mn) = k4_scale_min(&scales);
        let mut l = [0i32; 8];
        for (g, &s) in sc.iter().enumerate() {
            let mut wg = [0i32; QK];
            for (lane, v) in wg.iter_mut().enumerate() {
                *v = q(&wb, 32 * g + lane);
            }
            let lg = lanes4(&wg, &ab.qs[32 * g..32 * g + 32]);
            for m in 0..8 {
                l[m] += s as i32 * lg[m];
            }
        }
        let d = ab.d * f16_le(d);
        let dmin = ab.d * f16_le(dmin);
        accumulate(&mut acc, d, &l);
        summ += dmin * k_mins(&mn, &ab.bsums) as f32;
    }
    reduce_lanes(&acc) - summ
}

/// Scalar reference of Q4_K × Q8_K in the canonical order ([`super`] docs).
///
/// Shapes: `w` is one row of `a.len()` Q4_K super-blocks (`144 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q4_k_q8_k_ref(w: &[u8], a: &[BlockQ8K]) -> Result<f32, QuantError> {
    check_row(QType::Q4K, w.len(), a.len())?;
    // Element e: group g = e / 32 = 2c + h takes nibble h of qs[32c + e % 32].
    Ok(k45_ref(w, a, |b: &BlockQ4K, e| {
        let (g, lane) = (e / 32, e % 32);
        ((b.qs[32 * (g / 2) + lane] >> (4 * (g % 2))) & 0x0f) as i32
    }))
}

dispatch!(
    /// Q4_K weights × Q8_K activations, one row.
    vec_dot_q4_k_q8_k, vec_dot_q4_k_q8_k_ref, dot_q4_k_q8_k, QType::Q4K, BlockQ8K
);

/// Q4_K super-block (ggml `block_q4_K`, 144 bytes, 256 elements in 8 groups of 32).
///
/// Group `g = 2c + h` takes nibble `h` (0 low, 1 high) of `qs[32c .. 32c + 32]`.
/// Scales and mins are 6-bit, packed in 12 bytes as in ggml's `get_scale_min_k4`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4K {
    /// Super-block scale for the scales, f16.
    pub d: [u8; 2],
    /// Super-block scale for the mins, f16.
    pub dmin: [u8; 2],
    /// Packed 6-bit scales and mins.
    pub scales: [u8; 12],
    /// 4-bit quants.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(size_of::<BlockQ4K>() == 144);

/// Q4_K: per group of 32, `dg = d * scale`, `mg = dmin * min`, `x = (dg * q) - mg`
/// (gguf-py `Q4_K.dequantize_blocks`).
pub fn dequantize_q4_k(blocks: &[BlockQ4K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_le(b.d);
        let dmin = f16_le(b.dmin);
        let (sc, mn) = k4_scale_min(&b.scales);
        for (g, og) in o.chunks_exact_mut(32).enumerate() {
            let dg = d * sc[g] as f32;
            let mg = dmin * mn[g] as f32;
            let (c, h) = (g / 2, g % 2);
            for (lane, x) in og.iter_mut().enumerate() {
                let q = (b.qs[c * 32 + lane] >> (4 * h)) & 0x0f;
                *x = dg * q as f32 - mg;
            }
        }
    }
}
