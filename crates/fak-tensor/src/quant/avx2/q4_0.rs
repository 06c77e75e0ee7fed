//! Q4_0 × Q8_0 with AVX2: the [`Block32`] form of Q4_0 (nibbles, offset 8), its
//! [`Tile512`] form and the one-row kernel (reference: `vec_dot_q4_0_q8_0_ref`).

use super::*;

pub(in crate::quant) struct Q4_0;

impl Block32 for Q4_0 {
    type Act = BlockQ8_0;
    const BYTES: usize = 18;
    const HAS_MIN: bool = false;
    type W = __m256i;
    #[inline(always)]
    unsafe fn unpack(wb: &[u8]) -> __m256i {
        nibbles(wb[2..18].as_ptr())
    }
    #[inline(always)]
    unsafe fn lanes_w(w: __m256i, a: &BlockQ8_0) -> __m256i {
        quads(pairs_off(w, load32(a.qs.as_ptr() as *const u8), 8))
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
    #[inline(always)]
    unsafe fn lanes_vnni<D: Dp>(w: __m256i, a: &BlockQ8_0) -> __m256i {
        let aq = load32(a.qs.as_ptr() as *const u8);
        _mm256_sub_epi32(dp::<D>(w, aq), dp::<D>(_mm256_set1_epi8(8), aq))
    }
    #[inline(always)]
    unsafe fn signed_quants(wb: &[u8]) -> __m256i {
        _mm256_sub_epi8(Self::unpack(wb), _mm256_set1_epi8(8))
    }
}

tile512_plain!(Q4_0, BlockQ8_0, Some(8), Some(2));

/// See `vec_dot_q4_0_q8_0_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 18 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn dot_q4_0_q8_0(w: &[u8], a: &[BlockQ8_0]) -> f32 {
    one::<Q4_0>(w, a)
}
