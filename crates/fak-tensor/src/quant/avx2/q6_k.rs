//! Q6_K × Q8_K with AVX2 (reference: `vec_dot_q6_k_q8_k_ref`): the one-row and
//! multi-token kernels and the quant unpacking.

use super::*;

/// See `vec_dot_q6_k_q8_k_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 210 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn dot_q6_k_q8_k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let [v] = k_tokens_one(w, a, KQuant::Q6);
    v
}

/// Q6_K (`vec_dot_q6_k_q8_k_ref`'s order) of one weight row with `T` tokens'
/// activations, each super-block's quants unpacked once for the `T` tokens; every
/// token's operations the same as with `T = 1` ([`dot_q6_k_q8_k`]), so the same bits.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 210 * a[t].len()` for every `t`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn dot_q6_k_tokens<const T: usize>(w: &[u8], a: [&[BlockQ8K]; T]) -> [f32; T] {
    let mut acc = [_mm256_setzero_ps(); T];
    for (b, wb) in w.chunks_exact(210).enumerate() {
        let q = unpack_q6_k(wb);
        // The sub-block scales as `madd` multipliers: kept in registers for several
        // tokens, made where used for one (there the registers hold the quants).
        let scale = |c: usize| {
            let s0 = (wb[192 + 2 * c] as i8) as i16;
            let s1 = (wb[192 + 2 * c + 1] as i8) as i16;
            _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0))
        };
        let kept: [__m256i; 8] = if T > 1 {
            std::array::from_fn(scale)
        } else {
            [_mm256_setzero_si256(); 8]
        };
        let wd = f16_at(wb, 208);
        for t in 0..T {
            let ab = &a[t][b];
            let aq = ab.qs.as_ptr() as *const u8;
            let mut sumi = _mm256_setzero_si256();
            for c in 0..8 {
                let p = pairs_off(q[c], load32(aq.add(32 * c)), 32);
                let scales = if T > 1 { kept[c] } else { scale(c) };
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scales));
            }
            acc[t] = accumulate(acc[t], ab.d * wd, sumi);
        }
    }
    std::array::from_fn(|t| hsum(acc[t]))
}

/// The 256 quants of one Q6_K super-block `wb` (210 bytes) as unsigned bytes in
/// element order, the offset 32 not yet removed: register `c` holds elements
/// `32c..32c + 32` (`vec_dot_q6_k_q8_k_ref`'s unpacking).
///
/// # Safety
/// AVX2 and F16C; `wb.len() >= 192`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(in crate::quant) unsafe fn unpack_q6_k(wb: &[u8]) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(0x03);
    let mut q = [_mm256_setzero_si256(); 8];
    for (c, qc) in q.iter_mut().enumerate() {
        let (half, j) = (c / 4, c % 4);
        let at = 64 * half + 32 * (j % 2);
        let ql = load32(wb[at..at + 32].as_ptr());
        let lo = if j < 2 {
            _mm256_and_si256(ql, m4)
        } else {
            _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4)
        };
        let qh = load32(wb[128 + 32 * half..160 + 32 * half].as_ptr());
        let hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j as i32)), m2);
        *qc = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    q
}
