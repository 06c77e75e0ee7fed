//! Q5_0 × Q8_0 with AVX2: the [`Block32`] form of Q5_0 (nibbles plus fifth bits,
//! offset 16), its [`Tile512`] form and the one-row kernel (reference:
//! `vec_dot_q5_0_q8_0_ref`).

use super::*;

pub(in crate::quant) struct Q5_0;

impl Block32 for Q5_0 {
    type Act = BlockQ8_0;
    const BYTES: usize = 22;
    const HAS_MIN: bool = false;
    type W = __m256i;
    #[inline(always)]
    unsafe fn unpack(wb: &[u8]) -> __m256i {
        let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
        _mm256_or_si256(nibbles(wb[6..22].as_ptr()), bits_to_bytes(qh, 0x10))
    }
    #[inline(always)]
    unsafe fn lanes_w(q: __m256i, a: &BlockQ8_0) -> __m256i {
        quads(pairs_off(q, load32(a.qs.as_ptr() as *const u8), 16))
    }
    #[inline(always)]
    unsafe fn wscales(wb: &[u8]) -> (f32, f32) {
        (one_f16(wb), 0.0)
    }
    type VW = __m256i;
    type VAct = BlockQ8_0;
    #[inline(always)]
    unsafe fn vnni_acts<D: Dp>(a: &[BlockQ8_0]) -> Cow<'_, [BlockQ8_0]> {
        Cow::Borrowed(a)
    }
    #[inline(always)]
    unsafe fn unpack_vnni(wb: &[u8]) -> __m256i {
        Self::unpack(wb)
    }
    /// As [`Block32::unpack`], the fifth bits placed by one masked move.
    #[inline(always)]
    unsafe fn unpack_vnni512(wb: &[u8]) -> __m256i {
        let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
        let high = _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles(wb[6..22].as_ptr()), high)
    }
    #[inline(always)]
    unsafe fn lanes_vnni<D: Dp>(w: __m256i, a: &BlockQ8_0) -> __m256i {
        let aq = load32(a.qs.as_ptr() as *const u8);
        _mm256_sub_epi32(dp::<D>(w, aq), dp::<D>(_mm256_set1_epi8(16), aq))
    }
    #[inline(always)]
    unsafe fn signed_quants(wb: &[u8]) -> __m256i {
        _mm256_sub_epi8(Self::unpack(wb), _mm256_set1_epi8(16))
    }
}

tile512_plain!(Q5_0, BlockQ8_0, Some(16));

/// See `vec_dot_q5_0_q8_0_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 22 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn dot_q5_0_q8_0(w: &[u8], a: &[BlockQ8_0]) -> f32 {
    one::<Q5_0>(w, a)
}
