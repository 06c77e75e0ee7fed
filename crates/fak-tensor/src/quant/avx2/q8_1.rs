//! The Q8_1 activation quantizer with AVX2 (reference: `quant::quantize_q8_1`): the
//! Q8_0 block kernel plus the exact quant sum.

use super::*;

/// `Σ qs` of 32 signed quants, exactly: `vpsadbw` sums the unsigned bytes `q + 128` in
/// four groups of eight (each at most 2,040, no overflow), less `32 · 128`.
///
/// # Safety
/// AVX2 (the caller has it enabled).
#[target_feature(enable = "avx2")]
#[inline]
pub(in crate::quant) unsafe fn sum_quants(qs: &[i8; 32]) -> i32 {
    let v = _mm256_xor_si256(load32(qs.as_ptr().cast()), _mm256_set1_epi8(-128));
    let s = _mm256_sad_epu8(v, _mm256_setzero_si256());
    let s = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi64(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(s) - 32 * 128
}

/// `quant::quantize_q8_1` (same bits), appending to `out`: as [`quantize_q8_0`], and `s` from
/// [`sum_quants`].
///
/// # Safety
/// As [`quantize_q8_0`].
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn quantize_q8_1(x: &[f32], out: &mut Vec<BlockQ8_1>) {
    out.reserve(x.len() / 32);
    for c in x.chunks_exact(32) {
        let (d, qs) = q8_block(c).unwrap_or_else(|| crate::quant::q8_block_ref(c));
        let sum = sum_quants(&qs);
        out.push(BlockQ8_1 {
            d: crate::quant::f32_to_f16(d),
            s: crate::quant::f32_to_f16(sum as f32 * d),
            qs,
        });
    }
}
