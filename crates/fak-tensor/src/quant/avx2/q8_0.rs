//! Q8_0 with AVX2: the [`Block32`] form of Q8_0 weights (widened to i16; for AVX-VNNI
//! reordered into the lanes `Q8_0R2` keeps, [`VnniQ8_0`]), its [`Tile512`] form and the
//! one-row kernel (reference: `vec_dot_q8_0_q8_0_ref`); and the Q8_0 activation
//! quantizer (reference: `quant::quantize_q8_0`).

use super::*;

pub(in crate::quant) struct Q8_0;

impl Block32 for Q8_0 {
    type Act = BlockQ8_0;
    const BYTES: usize = 34;
    const HAS_MIN: bool = false;
    /// Widened to i16 (lane `m` = elements `2m, 2m+1, 2m+16, 2m+17`), exact for every
    /// i8 weight and activation including −128.
    type W = (__m256i, __m256i);
    #[inline(always)]
    unsafe fn unpack(wb: &[u8]) -> (__m256i, __m256i) {
        let wq = wb[2..34].as_ptr() as *const __m128i;
        (
            _mm256_cvtepi8_epi16(_mm_loadu_si128(wq)),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(wq.add(1))),
        )
    }
    #[inline(always)]
    unsafe fn lanes_w((w_lo, w_hi): (__m256i, __m256i), a: &BlockQ8_0) -> __m256i {
        let aq = a.qs.as_ptr() as *const __m128i;
        let a_lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(aq));
        let a_hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(aq.add(1)));
        _mm256_add_epi32(_mm256_madd_epi16(w_lo, a_lo), _mm256_madd_epi16(w_hi, a_hi))
    }
    #[inline(always)]
    unsafe fn wscales(wb: &[u8]) -> (f32, f32) {
        (one_f16(wb), 0.0)
    }
    /// Off: in the one-token rows each weight block is used once, so its reordering
    /// (`vpermq`, `vpshufb`, `vpxor`) is not shared between tokens, and the widening
    /// kernel was faster (`qdot_bench` Q8_0, in cache and streaming).
    const VNNI_ROWS: bool = false;
    /// The quants in VNNI order ([`q8_0_vnni_order`]) plus 128, as unsigned bytes.
    type VW = __m256i;
    type VAct = VnniQ8_0;
    #[inline(always)]
    unsafe fn vnni_acts<D: Dp>(a: &[BlockQ8_0]) -> Cow<'_, [VnniQ8_0]> {
        let mut v = Vec::with_capacity(a.len());
        for b in a {
            let qs = q8_0_vnni_order(load32(b.qs.as_ptr() as *const u8));
            // 128 · Σ_{k<4} qs[4m+k]: |sum| <= 4 · 128 · 128 = 65536, exact in i32.
            let bias =
                _mm256_sub_epi32(_mm256_setzero_si256(), dp::<D>(_mm256_set1_epi8(-128), qs));
            v.push(VnniQ8_0 { qs, bias });
        }
        Cow::Owned(v)
    }
    #[inline(always)]
    unsafe fn unpack_vnni(wb: &[u8]) -> __m256i {
        // XOR with 0x80 maps the i8 `w` to the u8 `w + 128` (0..=255), exactly.
        let q = q8_0_vnni_order(load32(wb[2..34].as_ptr()));
        _mm256_xor_si256(q, _mm256_set1_epi8(-128))
    }
    /// As [`Block32::unpack_vnni`], the reordering in one `vpermw`: word `2m` = old
    /// word `m`, word `2m+1` = old word `m+8` ([`q8_0_vnni_order`]).
    #[inline(always)]
    unsafe fn unpack_vnni512(wb: &[u8]) -> __m256i {
        let idx = _mm256_setr_epi16(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        let q = _mm256_permutexvar_epi16(idx, load32(wb[2..34].as_ptr()));
        _mm256_xor_si256(q, _mm256_set1_epi8(-128))
    }
    /// `bias + Σ_{k<4} (w + 128) a = Σ_{k<4} w a` over bytes `4m..4m+4` of the VNNI
    /// order, i.e. over elements `2m, 2m+1, 2m+16, 2m+17`, exactly. Every
    /// product `(w + 128) a` lies in `[-32640, 32385]` and every partial sum within
    /// `±2^18`, so `vpdpbusd` (which does not saturate) neither saturates nor wraps,
    /// for any weight and activation bytes, −128 included.
    #[inline(always)]
    unsafe fn lanes_vnni<D: Dp>(w: __m256i, a: &VnniQ8_0) -> __m256i {
        D::dpbusd(a.bias, w, a.qs)
    }
    #[cfg(test)]
    const LANE_ELEMENT: fn(usize, usize) -> usize = |m, k| 2 * m + (k & 1) + 16 * (k >> 1);
    const PAIR_PREFETCH_L2: bool = true;
    #[inline(always)]
    unsafe fn act_lanes(q: __m256i) -> __m256i {
        q8_0_vnni_order(q)
    }
    #[inline(always)]
    unsafe fn signed_quants(wb: &[u8]) -> __m256i {
        q8_0_vnni_order(load32(wb[2..34].as_ptr()))
    }
}

/// A Q8_0 activation block prepared once per product for the VNNI lane sums: its quants
/// in VNNI order ([`q8_0_vnni_order`]) and, per `i32` lane `m`, the bias
/// `−128 · Σ_{k<4} qs[4m+k]` that cancels the `+128` making the weights unsigned.
/// `vpdpbusd` multiplies unsigned by signed bytes (Intel 64 and IA-32 Architectures
/// Software Developer's Manual, Vol. 2, "VPDPBUSD"; Intel Intrinsics Guide,
/// `_mm256_dpbusd_avx_epi32`): per `i32` lane, the four byte products are summed with
/// the lane of the first operand without saturation. Offsetting the weight rather than
/// the activation puts the correction on the activation side, where it is computed
/// once per product instead of once per weight block and token, and both operands may
/// be any byte, −128 included (the activation quantizer never gives −128, but
/// [`BlockQ8_0`] is public).
#[derive(Clone, Copy)]
pub(in crate::quant) struct VnniQ8_0 {
    qs: __m256i,
    bias: __m256i,
}

/// The 32 quants of a Q8_0 block reordered so that bytes `4m..4m+4` are elements
/// `2m, 2m+1, 2m+16, 2m+17` (the lane grouping of the AVX2 widening kernel, which the
/// row-pair layout `Q8_0R2` keeps), where `vpdpbusd` sums them. In 16-bit words: word
/// `2m` = old word `m`, word `2m+1` = old word `m+8`.
#[inline(always)]
unsafe fn q8_0_vnni_order(q: __m256i) -> __m256i {
    // 64-bit quarters (elements 0..8, 8..16, 16..24, 24..32) to [0, 2 | 1, 3]: each
    // 128-bit half then holds old words m..m+4 and m+8..m+12 (m = 0, then 4) ...
    let x = _mm256_permute4x64_epi64::<0b11_01_10_00>(q);
    // ... which one in-half byte shuffle interleaves word by word.
    let idx = _mm256_setr_epi8(
        0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12,
        13, 6, 7, 14, 15,
    );
    _mm256_shuffle_epi8(x, idx)
}

impl Tile512 for Q8_0 {
    #[inline(always)]
    unsafe fn vqs(a: &VnniQ8_0) -> __m256i {
        a.qs
    }
    #[inline(always)]
    unsafe fn vbase(a: &VnniQ8_0) -> __m256i {
        a.bias
    }
}

/// See `vec_dot_q8_0_q8_0_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 34 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn dot_q8_0_q8_0(w: &[u8], a: &[BlockQ8_0]) -> f32 {
    one::<Q8_0>(w, a)
}

/// One block of the Q8_0/Q8_1 activation quantizer (`quant::q8_block`'s arithmetic,
/// vectorized): `d = amax / 127`, `id = 1 / d`, `qs = roundf(x * id)` with ties away
/// from zero. `None` (the caller runs the scalar code) when an element is not finite
/// or `id` is infinite or zero, the cases where the scalar `as i8` conversion's
/// saturation or NaN rule would matter.
///
/// Exactness: `x * id` is one rounded `f32` multiply in both; `|x * id| <= 127 (1 +
/// 2^-22)` so it is below `2^23`, where `trunc(p)` and `p - trunc(p)` are exact, and
/// `trunc(p) + sign(p) [|p - trunc(p)| >= 1/2]` is exactly `roundf(p)`, in
/// `-127..=127`. The maximum of finite magnitudes does not depend on order.
///
/// # Safety
/// AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(in crate::quant) unsafe fn q8_block(x: &[f32]) -> Option<(f32, [i8; 32])> {
    debug_assert_eq!(x.len(), 32);
    let p = x.as_ptr();
    let v = [
        _mm256_loadu_ps(p),
        _mm256_loadu_ps(p.add(8)),
        _mm256_loadu_ps(p.add(16)),
        _mm256_loadu_ps(p.add(24)),
    ];
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let a = v.map(|r| _mm256_and_ps(r, abs_mask));
    // Finite iff below infinity as an unsigned integer (NaNs are above it).
    let inf = _mm256_set1_epi32(0x7f80_0000);
    let mut finite = _mm256_set1_epi32(-1);
    for r in a {
        finite = _mm256_and_si256(finite, _mm256_cmpgt_epi32(inf, _mm256_castps_si256(r)));
    }
    if _mm256_movemask_epi8(finite) != -1 {
        return None;
    }
    let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
    // The eight lanes' maximum in registers: stored and read back as scalars, the
    // loads waited on the wide store (`perf`: the batched step's quantization at 4× its
    // time in one build). The values are finite and non-negative, so the maximum is
    // one of them whatever the order.
    let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_movehdup_ps(h));
    let amax = _mm_cvtss_f32(h);
    let d = amax / 127.0;
    if d == 0.0 {
        return Some((d, [0; 32]));
    }
    let id = 1.0 / d;
    if !id.is_finite() {
        return None;
    }
    let idv = _mm256_set1_ps(id);
    let half = _mm256_set1_ps(0.5);
    let one = _mm256_set1_ps(1.0);
    let sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
    let q = v.map(|r| {
        let p = _mm256_mul_ps(r, idv);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
        let frac = _mm256_and_ps(_mm256_sub_ps(p, t), abs_mask);
        let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, half);
        let step = _mm256_or_ps(_mm256_and_ps(p, sign_mask), one); // ±1 with p's sign
        _mm256_cvtps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, step)))
    });
    // i32 -> i8 with saturation (no value saturates: all lie in -127..=127); the packs
    // interleave 128-bit lanes, which the final dword permutation undoes.
    let w01 = _mm256_packs_epi32(q[0], q[1]);
    let w23 = _mm256_packs_epi32(q[2], q[3]);
    let b = _mm256_packs_epi16(w01, w23);
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let mut qs = [0i8; 32];
    _mm256_storeu_si256(qs.as_mut_ptr() as *mut __m256i, b);
    Some((d, qs))
}

/// `quant::quantize_q8_0` (same bits), appending to `out`: each block by
/// [`q8_block`], or the scalar `quant::q8_block_ref` where it declines; in one function
/// with AVX2 enabled, so the block kernels inline.
///
/// # Safety
/// AVX2 and F16C; `x.len()` a multiple of 32 (a shorter tail is ignored).
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn quantize_q8_0(x: &[f32], out: &mut Vec<BlockQ8_0>) {
    out.reserve(x.len() / 32);
    for c in x.chunks_exact(32) {
        let (d, qs) = q8_block(c).unwrap_or_else(|| crate::quant::q8_block_ref(c));
        out.push(BlockQ8_0 {
            d: crate::quant::f32_to_f16(d),
            qs,
        });
    }
}
