//! Q5_1 × Q8_1 with AVX2: the [`Block32`] form of Q5_1 (nibbles plus fifth bits, and a
//! minimum), its [`Tile512`] form and the one-row kernel (reference:
//! `vec_dot_q5_1_q8_1_ref`).

use super::*;

pub(in crate::quant) struct Q5_1;

impl Block32 for Q5_1 {
    type Act = BlockQ8_1;
    const BYTES: usize = 24;
    const HAS_MIN: bool = true;
    const UNSIGNED_QUANTS: bool = true;
    type W = __m256i;
    #[inline(always)]
    unsafe fn unpack(wb: &[u8]) -> __m256i {
        let qh = u32::from_le_bytes([wb[4], wb[5], wb[6], wb[7]]);
        _mm256_or_si256(nibbles(wb[8..24].as_ptr()), bits_to_bytes(qh, 0x10))
    }
    #[inline(always)]
    unsafe fn lanes_w(q: __m256i, a: &BlockQ8_1) -> __m256i {
        quads(pairs(q, load32(a.qs.as_ptr() as *const u8)))
    }
    #[inline(always)]
    unsafe fn wscales(wb: &[u8]) -> (f32, f32) {
        two_f16(wb)
    }
    type VW = __m256i;
    type VAct = BlockQ8_1;
    #[inline(always)]
    unsafe fn vnni_acts<D: Dp>(a: &[BlockQ8_1]) -> Cow<'_, [BlockQ8_1]> {
        Cow::Borrowed(a)
    }
    #[inline(always)]
    unsafe fn unpack_vnni(wb: &[u8]) -> __m256i {
        Self::unpack(wb)
    }
    /// As [`Block32::unpack`], the fifth bits placed by one masked move.
    #[inline(always)]
    unsafe fn unpack_vnni512(wb: &[u8]) -> __m256i {
        let qh = u32::from_le_bytes([wb[4], wb[5], wb[6], wb[7]]);
        let high = _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles(wb[8..24].as_ptr()), high)
    }
    #[inline(always)]
    unsafe fn lanes_vnni<D: Dp>(w: __m256i, a: &BlockQ8_1) -> __m256i {
        dp::<D>(w, load32(a.qs.as_ptr() as *const u8))
    }
    #[inline(always)]
    unsafe fn signed_quants(wb: &[u8]) -> __m256i {
        Self::unpack(wb)
    }
}

tile512_plain!(Q5_1, BlockQ8_1, None);

/// See `vec_dot_q5_1_q8_1_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 24 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn dot_q5_1_q8_1(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    one::<Q5_1>(w, a)
}
