//! Q5_K × Q8_K with AVX2 (reference: `vec_dot_q5_k_q8_k_ref`): the Q4_K kernels
//! (`q4_k.rs`) with Q5_K's layout ([`KQuant::Q5`]).

use super::*;

/// See `vec_dot_q5_k_q8_k_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 176 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn dot_q5_k_q8_k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let [v] = k_tokens_one(w, a, KQuant::Q5);
    v
}
