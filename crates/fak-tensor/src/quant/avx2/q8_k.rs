//! The Q8_K activation quantizer with AVX2 (reference: `quant::quantize_q8_k`).

use super::*;

/// One block of the Q8_K activation quantizer (`quant::quantize_q8_k`'s arithmetic,
/// the same bits) eight elements at a time, or `None` for a block the scalar code
/// must take: an element that is not finite, or a largest element so small that
/// `−127 / max` overflows. The largest magnitude of finite values does not depend on
/// order, and `max` is the first element of that magnitude, as in the scalar loop;
/// `round_ties_even(iscale · x)` is `vroundps` to nearest (ties to even, the default
/// rounding); the clamp to `−128..=127` is the saturation of the two packs (no value
/// reaches it: `|iscale · x| ≤ 127` up to rounding); `bsums` by `vpsadbw` as
/// [`sum_quants`].
///
/// # Safety
/// AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn q8k_block(x: &[f32; 256]) -> Option<BlockQ8K> {
    let p = x.as_ptr();
    // Loops rather than closures: a closure does not inherit this function's target
    // features, and these were not inlined.
    let mut v = [_mm256_setzero_ps(); 32];
    for (i, r) in v.iter_mut().enumerate() {
        *r = _mm256_loadu_ps(p.add(8 * i));
    }
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let inf = _mm256_set1_epi32(0x7f80_0000);
    let mut finite = _mm256_set1_epi32(-1);
    let mut m = _mm256_setzero_ps();
    for r in v {
        let a = _mm256_and_ps(r, abs_mask);
        // Finite iff below infinity as an unsigned integer (NaNs are above it).
        finite = _mm256_and_si256(finite, _mm256_cmpgt_epi32(inf, _mm256_castps_si256(a)));
        m = _mm256_max_ps(m, a);
    }
    if _mm256_movemask_epi8(finite) != -1 {
        return None;
    }
    let mut l = [0f32; 8];
    _mm256_storeu_ps(l.as_mut_ptr(), m);
    let amax = l.iter().fold(0f32, |m, &v| m.max(v));
    let mut b = BlockQ8K {
        d: 0.0,
        qs: [0; 256],
        bsums: [0; 16],
    };
    if amax == 0.0 {
        return Some(b);
    }
    let target = _mm256_set1_ps(amax);
    let mut first = None;
    for (i, &r) in v.iter().enumerate() {
        let eq = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(
            _mm256_and_ps(r, abs_mask),
            target,
        ));
        if eq != 0 {
            first = Some(8 * i + eq.trailing_zeros() as usize);
            break;
        }
    }
    let iscale = -127.0 / x[first?];
    if !iscale.is_finite() {
        return None;
    }
    let sv = _mm256_set1_ps(iscale);
    let mut q = [_mm256_setzero_si256(); 32];
    for (q, &r) in q.iter_mut().zip(&v) {
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(sv, r),
        );
        *q = _mm256_cvtps_epi32(n);
    }
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let bias = _mm256_set1_epi8(-128);
    for c in 0..8 {
        // i32 -> i8 with saturation; the packs interleave 128-bit lanes, which the
        // dword permutation undoes.
        let w01 = _mm256_packs_epi32(q[4 * c], q[4 * c + 1]);
        let w23 = _mm256_packs_epi32(q[4 * c + 2], q[4 * c + 3]);
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
        _mm256_storeu_si256(b.qs[32 * c..].as_mut_ptr() as *mut __m256i, bytes);
        // Σ of each 16 quants: `vpsadbw` of `q + 128` in groups of 8, less 16 · 128.
        let s = _mm256_sad_epu8(_mm256_xor_si256(bytes, bias), _mm256_setzero_si256());
        let mut s4 = [0u64; 4];
        _mm256_storeu_si256(s4.as_mut_ptr() as *mut __m256i, s);
        b.bsums[2 * c] = (s4[0] + s4[1]) as i16 - 16 * 128;
        b.bsums[2 * c + 1] = (s4[2] + s4[3]) as i16 - 16 * 128;
    }
    b.d = 1.0 / iscale;
    Some(b)
}
