//! Q4_1 × Q8_1 with AVX2: the [`Block32`] form of Q4_1 (nibbles and a minimum), its
//! [`Tile512`] form and the one-row kernel (reference: `vec_dot_q4_1_q8_1_ref`).

use super::*;

pub(in crate::quant) struct Q4_1;

impl Block32 for Q4_1 {
    type Act = BlockQ8_1;
    const BYTES: usize = 20;
    const HAS_MIN: bool = true;
    const UNSIGNED_QUANTS: bool = true;
    type W = __m256i;
    #[inline(always)]
    unsafe fn unpack(wb: &[u8]) -> __m256i {
        nibbles(wb[4..20].as_ptr())
    }
    #[inline(always)]
    unsafe fn lanes_w(w: __m256i, a: &BlockQ8_1) -> __m256i {
        quads(pairs(w, load32(a.qs.as_ptr() as *const u8)))
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
    #[inline(always)]
    unsafe fn lanes_vnni<D: Dp>(w: __m256i, a: &BlockQ8_1) -> __m256i {
        dp::<D>(w, load32(a.qs.as_ptr() as *const u8))
    }
    #[inline(always)]
    unsafe fn signed_quants(wb: &[u8]) -> __m256i {
        Self::unpack(wb)
    }
}

tile512_plain!(Q4_1, BlockQ8_1, None, Some(4));

/// See `vec_dot_q4_1_q8_1_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 20 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn dot_q4_1_q8_1(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    one::<Q4_1>(w, a)
}
