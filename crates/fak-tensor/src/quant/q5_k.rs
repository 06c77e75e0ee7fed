//! Q5_K weights (ggml `block_q5_K`, 176-byte super-blocks of 256: Q4_K plus a fifth bit
//! per quant) × Q8_K activations: the scalar reference and its dispatch.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::q4_k::k45_ref;
use super::{check_row, has_avx2_f16c, BlockQ8K, QType, QuantError};

/// Scalar reference of Q5_K × Q8_K in the canonical order ([`super`] docs).
///
/// Shapes: `w` is one row of `a.len()` Q5_K super-blocks (`176 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q5_k_q8_k_ref(w: &[u8], a: &[BlockQ8K]) -> Result<f32, QuantError> {
    check_row(QType::Q5K, w.len(), a.len())?;
    // As Q4_K (qs at 48), plus bit g of qh[e % 32] as bit 4.
    Ok(k45_ref(w, a, 176, |wb, e| {
        let (g, lane) = (e / 32, e % 32);
        let lo = (wb[48 + 32 * (g / 2) + lane] >> (4 * (g % 2))) & 0x0f;
        let hi = (wb[16 + lane] >> g) & 1;
        (lo | (hi << 4)) as i32
    }))
}

dispatch!(
    /// Q5_K weights × Q8_K activations, one row.
    vec_dot_q5_k_q8_k, vec_dot_q5_k_q8_k_ref, dot_q5_k_q8_k, QType::Q5K, BlockQ8K
);
