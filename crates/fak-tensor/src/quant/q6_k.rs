//! Q6_K weights (ggml `block_q6_K`, 210-byte super-blocks of 256: sixteen groups of 16
//! with i8 scales, 6-bit quants offset by 32) × Q8_K activations: the scalar reference
//! and its dispatch.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::unpack::{accumulate, lanes4};
use super::{check_row, f16_at, has_avx2_f16c, BlockQ8K, QType, QuantError, QK};
use crate::dot::reduce_lanes;

/// Scalar reference of Q6_K × Q8_K in the canonical order ([`super`] docs).
///
/// Shapes: `w` is one row of `a.len()` Q6_K super-blocks (`210 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q6_k_q8_k_ref(w: &[u8], a: &[BlockQ8K]) -> Result<f32, QuantError> {
    check_row(QType::Q6K, w.len(), a.len())?;
    let mut acc = [0f32; 8];
    for (wb, ab) in w.chunks_exact(210).zip(a) {
        let (ql, qh, scales) = (&wb[0..128], &wb[128..192], &wb[192..208]);
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
        accumulate(&mut acc, ab.d * f16_at(wb, 208), &l);
    }
    Ok(reduce_lanes(&acc))
}

dispatch!(
    /// Q6_K weights × Q8_K activations, one row.
    vec_dot_q6_k_q8_k, vec_dot_q6_k_q8_k_ref, dot_q6_k_q8_k, QType::Q6K, BlockQ8K
);
