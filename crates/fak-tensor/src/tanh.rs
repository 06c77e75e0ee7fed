//! `tanh` of many `f32` at once, bit-identical to the platform's scalar `f32::tanh`,
//! and the GeGLU activation built on it.
//!
//! Gemma's MLP applies GELU with the tanh approximation to every element of its gate
//! (`crate::ops::gelu_tanh`): over a 512-token prefill of Gemma 3 270M that is 19 M
//! calls of `tanhf`, each a library call computing one value (with `expm1f` inside),
//! a large share of a prefill's time. [`gelu_tanh_mul_in_place`] computes eight values per
//! AVX2 instruction stream and gives exactly the bits of the scalar form, so the exact
//! path's numbers (and every bit-exact invariant) do not move.
//!
//! The method is the one glibc's `tanhf` used up to glibc 2.40 (Sun's fdlibm, as
//! converted to `float` by Cygnus: glibc `sysdeps/ieee754/flt-32/s_tanhf.c` and
//! `s_expm1f.c`), in plain `f32` arithmetic, every operation rounded (no FMA), as the
//! x86-64 build of that C code evaluates it. For `|x| < 22`:
//!
//! - `tanh(x) = sign(x) · (1 − 2 / (t + 2))`, `t = expm1(2|x|)`, when `|x| ≥ 1`;
//!   `sign(x) · (−t / (t + 2))`, `t = expm1(−2|x|)`, below; `x` itself when
//!   `|x| < 2⁻⁵⁵`; `sign(x) · 1` when `|x| ≥ 22`.
//! - `expm1(y)`, for the `y` those take (`[2, 44)` and `(−2, 0)`): `k` is 0 for
//!   `|y| ≤ ln 2 / 2`, `±1` below `1.5 ln 2` and `trunc(y / ln 2 ± 1/2)` above; the
//!   reduced argument `r = hi − lo`, `hi = y − k·ln2_hi`, `lo = k·ln2_lo`, with its
//!   rounding error `c = (hi − r) − lo` (with `k = 0` these are `r = y`, `c = 0`
//!   exactly, so one formula serves every lane); a rational correction `e` from a
//!   degree-5 polynomial in `r²/2`; then one of fdlibm's reconstructions by `k`
//!   (`k = 0`, `k = −1`, `k ≤ −2` or `k > 56`, `2 ≤ k < 23`, `23 ≤ k ≤ 56`), each
//!   computed in every lane and the lane's own chosen by a blend; `y` itself when
//!   `|y| < 2⁻²⁵`.
//!
//! The constants are that method's `f32` constants, given by their bits. Vectors
//! with a NaN or infinite element are handed to `f32::tanh` element by element.
//! `tanh_matches_libm_for_every_f32` checks all 2³² inputs against `f32::tanh`, so a
//! platform whose `tanhf` differs (glibc 2.41 and later compute a correctly rounded
//! `tanhf`, musl its own) fails that test instead of silently changing results. Without
//! AVX2 every value is `f32::tanh`.

/// `gate[i] = gelu_tanh(gate[i]) · up[i]`, each value bit-identical to
/// `crate::ops::gelu_tanh(gate[i]) * up[i]` (the same `f32` operations in the same
/// order; the `tanh` as [`tanh_in_place`]).
///
/// # Panics
/// If the lengths differ (a programming error).
pub fn gelu_tanh_mul_in_place(gate: &mut [f32], up: &[f32]) {
    assert_eq!(
        gate.len(),
        up.len(),
        "gelu_tanh_mul_in_place: lengths differ"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // SAFETY: AVX2, AVX-512F and AVX-512DQ were detected at run time; the lengths
        // are equal.
        unsafe { avx512::gelu_tanh_mul_in_place(gate, up) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx2_f16c() {
        // SAFETY: AVX2 was detected at run time; the lengths are equal.
        unsafe { avx2::gelu_tanh_mul_in_place(gate, up) };
        return;
    }
    gate.iter_mut()
        .zip(up)
        .for_each(|(g, &u)| *g = crate::ops::gelu_tanh(*g) * u);
}

/// `x[i] = x[i].tanh()` for every element, bit-identical to `f32::tanh` (module docs).
pub fn tanh_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // SAFETY: AVX2, AVX-512F and AVX-512DQ were detected at run time.
        unsafe { avx512::tanh_in_place(x) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx2_f16c() {
        // SAFETY: AVX2 was detected at run time.
        unsafe { avx2::tanh_in_place(x) };
        return;
    }
    x.iter_mut().for_each(|v| *v = v.tanh());
}

/// The method's constants (module docs), as `f32` bits, and its thresholds on `|x|`
/// bits.
#[cfg(target_arch = "x86_64")]
mod k {
    /// `ln 2` split: `ln2_hi` (its low 12 bits zero, so `k · ln2_hi` is exact for the
    /// `k` here) and `ln2_lo ≈ ln 2 − ln2_hi`.
    pub(super) const LN2_HI: u32 = 0x3f31_7180;
    pub(super) const LN2_LO: u32 = 0x3717_f7d1;
    /// `1 / ln 2`.
    pub(super) const INV_LN2: u32 = 0x3fb8_aa3b;
    /// The correction polynomial's coefficients, `Q1` … `Q5`.
    pub(super) const Q: [u32; 5] = [
        0xbd08_8889,
        0x3ad0_0d01,
        0xb8a6_70cd,
        0x3686_7e54,
        0xb457_edbb,
    ];
    /// `|y|` bits above which `expm1` reduces the argument (`ln 2 / 2`), below which
    /// `k = ±1` (`1.5 ln 2`), and below which `expm1(y) = y` (`2⁻²⁵`).
    pub(super) const HALF_LN2: i32 = 0x3eb1_7218;
    pub(super) const THREE_HALVES_LN2: i32 = 0x3f85_1592;
    pub(super) const EXPM1_TINY: i32 = 0x3300_0000;
    /// `|x|` bits: 1 (the two forms of `tanh`), 22 (`tanh = ±1` from there) and
    /// `2⁻⁵⁵` (`tanh(x) = x` below).
    pub(super) const ONE: i32 = 0x3f80_0000;
    pub(super) const TWENTY_TWO: i32 = 0x41b0_0000;
    pub(super) const TANH_TINY: i32 = 0x2400_0000;
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::k::*;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2")]
    fn splat(bits: u32) -> __m256 {
        _mm256_castsi256_ps(_mm256_set1_epi32(bits as i32))
    }

    /// `expm1(y)` for eight `y` in `[2, 44)` or `(−2, 0)` (module docs).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn expm1(y: __m256) -> __m256 {
        let yi = _mm256_castps_si256(y);
        let hy = _mm256_and_si256(yi, _mm256_set1_epi32(0x7fff_ffff));
        // All ones where y < 0.
        let neg = _mm256_srai_epi32::<31>(yi);
        // k: 0, ±1, or trunc(y / ln 2 ± 1/2).
        let half = _mm256_or_ps(_mm256_set1_ps(0.5), _mm256_and_ps(y, _mm256_set1_ps(-0.0)));
        let kbig = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(splat(INV_LN2), y), half));
        let kone = _mm256_or_si256(neg, _mm256_set1_epi32(1)); // ±1 with y's sign
        let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(THREE_HALVES_LN2), hy);
        let reduce = _mm256_cmpgt_epi32(hy, _mm256_set1_epi32(HALF_LN2));
        let k = _mm256_and_si256(reduce, _mm256_blendv_epi8(kbig, kone, small));
        // r = hi − lo, c = (hi − r) − lo (r = y and c = 0 exactly when k = 0).
        let t = _mm256_cvtepi32_ps(k);
        let hi = _mm256_sub_ps(y, _mm256_mul_ps(t, splat(LN2_HI)));
        let lo = _mm256_mul_ps(t, splat(LN2_LO));
        let x = _mm256_sub_ps(hi, lo);
        let c = _mm256_sub_ps(_mm256_sub_ps(hi, x), lo);
        // The correction.
        let hfx = _mm256_mul_ps(_mm256_set1_ps(0.5), x);
        let hxs = _mm256_mul_ps(x, hfx);
        let mut p = _mm256_add_ps(splat(Q[3]), _mm256_mul_ps(hxs, splat(Q[4])));
        for &q in Q[..3].iter().rev() {
            p = _mm256_add_ps(splat(q), _mm256_mul_ps(hxs, p));
        }
        let one = _mm256_set1_ps(1.0);
        let r1 = _mm256_add_ps(one, _mm256_mul_ps(hxs, p));
        let t = _mm256_sub_ps(_mm256_set1_ps(3.0), _mm256_mul_ps(r1, hfx));
        let e = _mm256_mul_ps(
            hxs,
            _mm256_div_ps(
                _mm256_sub_ps(r1, t),
                _mm256_sub_ps(_mm256_set1_ps(6.0), _mm256_mul_ps(x, t)),
            ),
        );
        // k = 0.
        let r_k0 = _mm256_sub_ps(x, _mm256_sub_ps(_mm256_mul_ps(x, e), hxs));
        // k ≠ 0: e = (x (e − c) − c) − hxs, then by k.
        let e = _mm256_sub_ps(_mm256_sub_ps(_mm256_mul_ps(x, _mm256_sub_ps(e, c)), c), hxs);
        let half = _mm256_set1_ps(0.5);
        let r_m1 = _mm256_sub_ps(_mm256_mul_ps(half, _mm256_sub_ps(x, e)), half);
        let k23 = _mm256_slli_epi32::<23>(k);
        let scale = |v: __m256| _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(v), k23));
        let r_far = _mm256_sub_ps(scale(_mm256_sub_ps(one, _mm256_sub_ps(e, x))), one);
        // 2 ≤ k < 23: t = 1 − 2⁻ᵏ.
        let t_mid = _mm256_castsi256_ps(_mm256_sub_epi32(
            _mm256_set1_epi32(0x3f80_0000),
            _mm256_srlv_epi32(_mm256_set1_epi32(0x0100_0000), k),
        ));
        let r_mid = scale(_mm256_sub_ps(t_mid, _mm256_sub_ps(e, x)));
        // 23 ≤ k ≤ 56: t = 2⁻ᵏ.
        let t_high = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_sub_epi32(
            _mm256_set1_epi32(0x7f),
            k,
        )));
        let r_high = scale(_mm256_add_ps(
            _mm256_sub_ps(x, _mm256_add_ps(e, t_high)),
            one,
        ));
        // Choose by k.
        let is = |lo: i32, hi: i32| {
            // lo ≤ k ≤ hi
            _mm256_andnot_si256(
                _mm256_or_si256(
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), k),
                    _mm256_cmpgt_epi32(k, _mm256_set1_epi32(hi)),
                ),
                _mm256_set1_epi32(-1),
            )
        };
        let pick =
            |a: __m256, b: __m256, m: __m256i| _mm256_blendv_ps(a, b, _mm256_castsi256_ps(m));
        let mut r = r_far;
        r = pick(r, r_mid, is(2, 22));
        r = pick(r, r_high, is(23, 56));
        r = pick(r, r_m1, is(-1, -1));
        r = pick(r, r_k0, is(0, 0));
        // |y| < 2⁻²⁵: y itself.
        pick(r, y, _mm256_cmpgt_epi32(_mm256_set1_epi32(EXPM1_TINY), hy))
    }

    /// `tanh` of eight finite values (module docs).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn tanh8(x: __m256) -> __m256 {
        let sign = _mm256_set1_ps(-0.0);
        let ax = _mm256_andnot_ps(sign, x);
        let ix = _mm256_castps_si256(ax);
        let big = _mm256_cmpgt_epi32(_mm256_set1_epi32(ONE), ix); // |x| < 1
        let ge_one = _mm256_castsi256_ps(_mm256_xor_si256(big, _mm256_set1_epi32(-1)));
        // y = 2|x| for |x| ≥ 1, −2|x| below (exact); |x| clamped to 22 first, where the
        // result is ±1 anyway, so that y stays finite.
        let two_ax = _mm256_mul_ps(_mm256_set1_ps(2.0), _mm256_min_ps(ax, _mm256_set1_ps(22.0)));
        let y = _mm256_blendv_ps(_mm256_or_ps(two_ax, sign), two_ax, ge_one);
        let t = expm1(y);
        let two = _mm256_set1_ps(2.0);
        let tp2 = _mm256_add_ps(t, two);
        let z_ge = _mm256_sub_ps(_mm256_set1_ps(1.0), _mm256_div_ps(two, tp2));
        let z_lt = _mm256_div_ps(_mm256_xor_ps(t, sign), tp2);
        let mut z = _mm256_blendv_ps(z_lt, z_ge, ge_one);
        let at_least_22 = _mm256_cmpgt_epi32(ix, _mm256_set1_epi32(TWENTY_TWO - 1));
        z = _mm256_blendv_ps(z, _mm256_set1_ps(1.0), _mm256_castsi256_ps(at_least_22));
        let z = _mm256_or_ps(z, _mm256_and_ps(x, sign));
        // |x| < 2⁻⁵⁵ (zeros included): x itself.
        let tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(TANH_TINY), ix);
        _mm256_blendv_ps(z, x, _mm256_castsi256_ps(tiny))
    }

    /// Whether all eight values are finite.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn finite(x: __m256) -> bool {
        let ix = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fff_ffff));
        _mm256_movemask_epi8(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f80_0000), ix)) == -1
    }

    /// See [`super::tanh_in_place`].
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn tanh_in_place(x: &mut [f32]) {
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: `c` holds eight `f32`.
            let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
            if finite(v) {
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(c.as_mut_ptr(), tanh8(v)) };
            } else {
                c.iter_mut().for_each(|v| *v = v.tanh());
            }
        }
        chunks
            .into_remainder()
            .iter_mut()
            .for_each(|v| *v = v.tanh());
    }

    /// See [`super::gelu_tanh_mul_in_place`].
    ///
    /// # Safety
    /// The CPU must support AVX2; `gate.len() == up.len()`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn gelu_tanh_mul_in_place(gate: &mut [f32], up: &[f32]) {
        let n8 = gate.len() / 8 * 8;
        let beta = _mm256_set1_ps(crate::ops::GELU_BETA);
        let kappa = _mm256_set1_ps(crate::ops::GELU_KAPPA);
        let half = _mm256_set1_ps(0.5);
        let one = _mm256_set1_ps(1.0);
        for i in (0..n8).step_by(8) {
            // SAFETY: `i + 8 <= n8 <= gate.len() == up.len()`.
            let (g, u) = unsafe {
                (
                    _mm256_loadu_ps(gate.as_ptr().add(i)),
                    _mm256_loadu_ps(up.as_ptr().add(i)),
                )
            };
            // 0.5·x·(1 + tanh(β·(x + κ·x³))) · u, as `gelu_tanh(x) * u` computes it.
            let cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
            let inner = _mm256_mul_ps(beta, _mm256_add_ps(g, _mm256_mul_ps(kappa, cube)));
            if !finite(inner) {
                for j in i..i + 8 {
                    gate[j] = crate::ops::gelu_tanh(gate[j]) * up[j];
                }
                continue;
            }
            let t = tanh8(inner);
            let r = _mm256_mul_ps(
                _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, t)),
                u,
            );
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(gate.as_mut_ptr().add(i), r) };
        }
        for (g, &u) in gate[n8..].iter_mut().zip(&up[n8..]) {
            *g = crate::ops::gelu_tanh(*g) * u;
        }
    }
}

/// The kernels of [`avx2`] with 512-bit registers: sixteen values per step, the
/// choices by mask registers instead of blends. The same operations on the same values
/// in every lane, so the same bits.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::k::*;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn splat(bits: u32) -> __m512 {
        _mm512_castsi512_ps(_mm512_set1_epi32(bits as i32))
    }

    /// `avx2::expm1` for sixteen `y`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn expm1(y: __m512) -> __m512 {
        let hy = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7fff_ffff));
        let neg = _mm512_cmplt_epi32_mask(_mm512_castps_si512(y), _mm512_setzero_si512());
        // k: 0, ±1, or trunc(y / ln 2 ± 1/2).
        let half = _mm512_or_ps(_mm512_set1_ps(0.5), _mm512_and_ps(y, _mm512_set1_ps(-0.0)));
        let kbig = _mm512_cvttps_epi32(_mm512_add_ps(_mm512_mul_ps(splat(INV_LN2), y), half));
        let kone = _mm512_mask_blend_epi32(neg, _mm512_set1_epi32(1), _mm512_set1_epi32(-1));
        let small = _mm512_cmplt_epi32_mask(hy, _mm512_set1_epi32(THREE_HALVES_LN2));
        let reduce = _mm512_cmpgt_epi32_mask(hy, _mm512_set1_epi32(HALF_LN2));
        let k = _mm512_maskz_mov_epi32(reduce, _mm512_mask_blend_epi32(small, kbig, kone));
        // r = hi − lo, c = (hi − r) − lo (r = y and c = 0 exactly when k = 0).
        let t = _mm512_cvtepi32_ps(k);
        let hi = _mm512_sub_ps(y, _mm512_mul_ps(t, splat(LN2_HI)));
        let lo = _mm512_mul_ps(t, splat(LN2_LO));
        let x = _mm512_sub_ps(hi, lo);
        let c = _mm512_sub_ps(_mm512_sub_ps(hi, x), lo);
        // The correction.
        let hfx = _mm512_mul_ps(_mm512_set1_ps(0.5), x);
        let hxs = _mm512_mul_ps(x, hfx);
        let mut p = _mm512_add_ps(splat(Q[3]), _mm512_mul_ps(hxs, splat(Q[4])));
        for &q in Q[..3].iter().rev() {
            p = _mm512_add_ps(splat(q), _mm512_mul_ps(hxs, p));
        }
        let one = _mm512_set1_ps(1.0);
        let r1 = _mm512_add_ps(one, _mm512_mul_ps(hxs, p));
        let t = _mm512_sub_ps(_mm512_set1_ps(3.0), _mm512_mul_ps(r1, hfx));
        let e = _mm512_mul_ps(
            hxs,
            _mm512_div_ps(
                _mm512_sub_ps(r1, t),
                _mm512_sub_ps(_mm512_set1_ps(6.0), _mm512_mul_ps(x, t)),
            ),
        );
        // k = 0.
        let r_k0 = _mm512_sub_ps(x, _mm512_sub_ps(_mm512_mul_ps(x, e), hxs));
        // k ≠ 0: e = (x (e − c) − c) − hxs, then by k.
        let e = _mm512_sub_ps(_mm512_sub_ps(_mm512_mul_ps(x, _mm512_sub_ps(e, c)), c), hxs);
        let half = _mm512_set1_ps(0.5);
        let r_m1 = _mm512_sub_ps(_mm512_mul_ps(half, _mm512_sub_ps(x, e)), half);
        let k23 = _mm512_slli_epi32::<23>(k);
        let scale = |v: __m512| _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(v), k23));
        let r_far = _mm512_sub_ps(scale(_mm512_sub_ps(one, _mm512_sub_ps(e, x))), one);
        // 2 ≤ k < 23: t = 1 − 2⁻ᵏ.
        let t_mid = _mm512_castsi512_ps(_mm512_sub_epi32(
            _mm512_set1_epi32(0x3f80_0000),
            _mm512_srlv_epi32(_mm512_set1_epi32(0x0100_0000), k),
        ));
        let r_mid = scale(_mm512_sub_ps(t_mid, _mm512_sub_ps(e, x)));
        // 23 ≤ k ≤ 56: t = 2⁻ᵏ.
        let t_high = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_sub_epi32(
            _mm512_set1_epi32(0x7f),
            k,
        )));
        let r_high = scale(_mm512_add_ps(
            _mm512_sub_ps(x, _mm512_add_ps(e, t_high)),
            one,
        ));
        // Choose by k.
        let is = |lo: i32, hi: i32| {
            _mm512_cmpge_epi32_mask(k, _mm512_set1_epi32(lo))
                & _mm512_cmple_epi32_mask(k, _mm512_set1_epi32(hi))
        };
        let mut r = r_far;
        r = _mm512_mask_blend_ps(is(2, 22), r, r_mid);
        r = _mm512_mask_blend_ps(is(23, 56), r, r_high);
        r = _mm512_mask_blend_ps(is(-1, -1), r, r_m1);
        r = _mm512_mask_blend_ps(is(0, 0), r, r_k0);
        // |y| < 2⁻²⁵: y itself.
        let tiny = _mm512_cmplt_epi32_mask(hy, _mm512_set1_epi32(EXPM1_TINY));
        _mm512_mask_blend_ps(tiny, r, y)
    }

    /// `avx2::tanh8` for sixteen finite values.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn tanh16(x: __m512) -> __m512 {
        let sign = _mm512_set1_ps(-0.0);
        let ax = _mm512_andnot_ps(sign, x);
        let ix = _mm512_castps_si512(ax);
        let ge_one = _mm512_cmpge_epi32_mask(ix, _mm512_set1_epi32(ONE));
        // y = 2|x| for |x| ≥ 1, −2|x| below (exact); |x| clamped to 22 first.
        let two_ax = _mm512_mul_ps(_mm512_set1_ps(2.0), _mm512_min_ps(ax, _mm512_set1_ps(22.0)));
        let y = _mm512_mask_blend_ps(ge_one, _mm512_or_ps(two_ax, sign), two_ax);
        let t = expm1(y);
        let two = _mm512_set1_ps(2.0);
        let tp2 = _mm512_add_ps(t, two);
        let z_ge = _mm512_sub_ps(_mm512_set1_ps(1.0), _mm512_div_ps(two, tp2));
        let z_lt = _mm512_div_ps(_mm512_xor_ps(t, sign), tp2);
        let mut z = _mm512_mask_blend_ps(ge_one, z_lt, z_ge);
        let at_least_22 = _mm512_cmpge_epi32_mask(ix, _mm512_set1_epi32(TWENTY_TWO));
        z = _mm512_mask_blend_ps(at_least_22, z, _mm512_set1_ps(1.0));
        let z = _mm512_or_ps(z, _mm512_and_ps(x, sign));
        // |x| < 2⁻⁵⁵ (zeros included): x itself.
        let tiny = _mm512_cmplt_epi32_mask(ix, _mm512_set1_epi32(TANH_TINY));
        _mm512_mask_blend_ps(tiny, z, x)
    }

    /// Whether all sixteen values are finite.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn finite(x: __m512) -> bool {
        let ix = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fff_ffff));
        _mm512_cmplt_epi32_mask(ix, _mm512_set1_epi32(0x7f80_0000)) == 0xffff
    }

    /// See [`super::tanh_in_place`].
    ///
    /// # Safety
    /// The CPU must support AVX2, AVX-512F and AVX-512DQ.
    #[target_feature(enable = "avx2,avx512f,avx512dq")]
    pub unsafe fn tanh_in_place(x: &mut [f32]) {
        let n16 = x.len() / 16 * 16;
        for c in x[..n16].chunks_exact_mut(16) {
            // SAFETY: `c` holds sixteen `f32`.
            let v = unsafe { _mm512_loadu_ps(c.as_ptr()) };
            if finite(v) {
                // SAFETY: as above.
                unsafe { _mm512_storeu_ps(c.as_mut_ptr(), tanh16(v)) };
            } else {
                c.iter_mut().for_each(|v| *v = v.tanh());
            }
        }
        // SAFETY: AVX2 is available.
        unsafe { super::avx2::tanh_in_place(&mut x[n16..]) };
    }

    /// See [`super::gelu_tanh_mul_in_place`].
    ///
    /// # Safety
    /// The CPU must support AVX2, AVX-512F and AVX-512DQ; `gate.len() == up.len()`.
    #[target_feature(enable = "avx2,avx512f,avx512dq")]
    pub unsafe fn gelu_tanh_mul_in_place(gate: &mut [f32], up: &[f32]) {
        let n16 = gate.len() / 16 * 16;
        let beta = _mm512_set1_ps(crate::ops::GELU_BETA);
        let kappa = _mm512_set1_ps(crate::ops::GELU_KAPPA);
        let half = _mm512_set1_ps(0.5);
        let one = _mm512_set1_ps(1.0);
        for i in (0..n16).step_by(16) {
            // SAFETY: `i + 16 <= n16 <= gate.len() == up.len()`.
            let (g, u) = unsafe {
                (
                    _mm512_loadu_ps(gate.as_ptr().add(i)),
                    _mm512_loadu_ps(up.as_ptr().add(i)),
                )
            };
            // 0.5·x·(1 + tanh(β·(x + κ·x³))) · u, as `gelu_tanh(x) * u` computes it.
            let cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
            let inner = _mm512_mul_ps(beta, _mm512_add_ps(g, _mm512_mul_ps(kappa, cube)));
            if !finite(inner) {
                for j in i..i + 16 {
                    gate[j] = crate::ops::gelu_tanh(gate[j]) * up[j];
                }
                continue;
            }
            let t = tanh16(inner);
            let r = _mm512_mul_ps(
                _mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, t)),
                u,
            );
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(gate.as_mut_ptr().add(i), r) };
        }
        // SAFETY: AVX2 is available; the tails have equal lengths.
        unsafe { super::avx2::gelu_tanh_mul_in_place(&mut gate[n16..], &up[n16..]) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// Every kernel this CPU runs, each behind a safe call: the dispatching functions,
    /// the 256-bit kernels and (where [`tanh_in_place`] takes them) the 512-bit ones.
    #[allow(clippy::type_complexity)]
    fn kernels() -> Vec<(&'static str, fn(&mut [f32]), fn(&mut [f32], &[f32]))> {
        let mut k: Vec<(&'static str, fn(&mut [f32]), fn(&mut [f32], &[f32]))> =
            vec![("dispatch", tanh_in_place, gelu_tanh_mul_in_place)];
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::has_avx2_f16c() {
            // SAFETY (both): AVX2 was detected; the lengths are equal.
            k.push((
                "avx2",
                |x| unsafe { avx2::tanh_in_place(x) },
                |g, u| unsafe { avx2::gelu_tanh_mul_in_place(g, u) },
            ));
        }
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::has_avx512_f32() {
            // SAFETY (both): AVX2, AVX-512F and AVX-512DQ were detected; equal lengths.
            k.push((
                "avx512",
                |x| unsafe { avx512::tanh_in_place(x) },
                |g, u| unsafe { avx512::gelu_tanh_mul_in_place(g, u) },
            ));
        }
        k
    }

    /// The tests below run the kernels [`kernels`] lists, those this CPU has: these two
    /// say which vector kernels that covered, and on a CPU without one's features (or
    /// with `FAK_NO_AVX512=1`) its test is reported ignored, not passed.
    #[fak_testkit::cpu("avx2", "f16c")]
    fn the_256_bit_kernels_are_tested() {
        assert!(kernels().iter().any(|k| k.0 == "avx2"));
    }

    /// See [`the_256_bit_kernels_are_tested`].
    #[fak_testkit::cpu("avx2", "fma", "avx512f", "avx512dq")]
    fn the_512_bit_kernels_are_tested() {
        assert!(kernels().iter().any(|k| k.0 == "avx512"));
    }

    /// Every one of the 2³² `f32` bit patterns through each vector kernel against the
    /// platform's `f32::tanh` (the oracle), on two threads.
    #[test]
    fn tanh_matches_libm_for_every_f32() {
        let vector: Vec<crate::test_util::NamedKernel> = kernels()
            .into_iter()
            .skip(1)
            .map(|(n, t, _)| (n, t))
            .collect();
        let bad = crate::test_util::first_mismatch_over_every_f32(&vector, f32::tanh);
        if let Some((name, b)) = bad {
            let x = f32::from_bits(b);
            panic!(
                "{name}: tanh({x:e}) (bits {b:#010x}) differs from f32::tanh's {:e}",
                x.tanh()
            );
        }
        assert!(kernels().len() > 1 || !cfg!(target_arch = "x86_64"));
    }

    #[test]
    fn gelu_tanh_mul_matches_the_scalar_form() {
        // Every length remainder, ordinary values, values whose cube overflows (a
        // non-finite inner argument), zeros of both signs, infinities, NaN.
        let mut vals: Vec<f32> = (0..203).map(|i| (i as f32 - 101.0) * 0.037).collect();
        vals.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            30.0,
            -30.0,
            1e13,
            -1e13,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ]);
        let up: Vec<f32> = (0..vals.len()).map(|i| 1.0 + i as f32 * 0.01).collect();
        for (name, _, gelu_mul) in kernels() {
            for len in [0, 1, 7, 8, 9, 15, 16, 17, 24, 33, vals.len()] {
                let mut got = vals[..len].to_vec();
                gelu_mul(&mut got, &up[..len]);
                for i in 0..len {
                    let want = crate::ops::gelu_tanh(vals[i]) * up[i];
                    assert!(
                        same(got[i], want),
                        "{name}, len {len}, x = {}: {} vs {want}",
                        vals[i],
                        got[i]
                    );
                }
            }
        }
    }
}
