//! `exp` of many `f32` at once, bit-identical to the platform's scalar `f32::exp`.
//!
//! Softmax (attention) and SiLU (the MLP) call `expf` once per element: over a
//! 512-token prefill that is tens of millions of calls, each a library call that
//! computes one value. [`exp_in_place`] computes eight values per AVX2 instruction
//! stream and gives exactly the bits that `f32::exp` gives on glibc x86-64 with FMA,
//! so the exact path's numbers (and every bit-exact invariant) do not move.
//!
//! The method is the one glibc's `expf` uses since glibc 2.27 (Szabolcs Nagy's
//! `expf` from Arm's optimized-routines; glibc `sysdeps/ieee754/flt-32/e_expf.c`),
//! evaluated in `f64` exactly as glibc's FMA build of it evaluates it:
//!
//! 1. `z = fma(32/ln 2, x, 1.5·2⁵²)`; the low bits of `z` hold `k = round(32x/ln 2)`.
//! 2. `r = fma(32/ln 2, x, −(z − 1.5·2⁵²))`, the reduced argument, `|r| ≤ 1/2`.
//! 3. `s = 2^(k/32)`: the `f64` bits of `2^((k mod 32)/32)` from a 32-entry table with
//!    `k` added to the exponent field (`TAB[k mod 32] + (k << 47)`, wrapping).
//! 4. `p = fma(fma(C0, r, C1), r², fma(C2, r, 1))`, a cubic for `2^(r/32)`;
//!    `exp(x) = (f32)(p · s)`, rounded to nearest.
//!
//! The table and coefficients are the `f64` constants of that method (each table entry
//! is `2^(i/32)` rounded to nearest, less `i << 47`). Inputs with `|x| ≥ 88` (under-
//! and overflow, infinities, NaN), where glibc takes a special path, are handed to
//! `f32::exp` itself. `exp_matches_libm_for_every_f32` checks all 2³² inputs against
//! `f32::exp`, so a platform whose `expf` differs (another libm, a build without FMA)
//! fails that test instead of silently changing results. With AVX-512F/DQ (unless
//! `FAK_NO_AVX512=1`) sixteen values go per step, eight `f64` lanes at a time, and the
//! table is read by two register permutes instead of a gather; the test checks both
//! kernels. Without AVX2 and FMA every value is `f32::exp`.

/// `2^(i/32)` as `f64` bits, less `i << 47` (so that adding `k << 47` for any `k ≡ i`
/// mod 32 gives `2^(k/32)`).
#[cfg(target_arch = "x86_64")]
const TAB: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];

/// `32 / ln 2`.
#[cfg(target_arch = "x86_64")]
const INV_LN2_N: u64 = 0x40471547652b82fe;
/// `1.5 · 2⁵²`: adding it rounds to an integer held in the low mantissa bits.
#[cfg(target_arch = "x86_64")]
const SHIFT: u64 = 0x4338000000000000;
/// The cubic's coefficients, highest degree first (scaled for `r` in units of 1/32).
#[cfg(target_arch = "x86_64")]
const C: [u64; 3] = [0x3ebc6af84b912394, 0x3f2ebfce50fac4f3, 0x3f962e42ff0c52d6];

/// Smallest `(bits >> 20) & 0x7ff` of an input that takes the special path (`|x| ≥ 88`).
#[cfg(target_arch = "x86_64")]
const SPECIAL_TOP12: i32 = 0x42b;

/// Whether the eight-wide kernel runs here (AVX2 and FMA, detected once).
#[inline]
pub fn has_simd_exp() -> bool {
    crate::cpu::has_avx2_fma()
}

/// `x[i] = x[i].exp()` for every element, bit-identical to `f32::exp` (module docs).
pub fn exp_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // SAFETY: AVX2, FMA and AVX-512F/DQ were detected at run time.
        unsafe { avx512::exp_in_place(x) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_simd_exp() {
        // SAFETY: AVX2 and FMA were detected at run time.
        unsafe { avx2::exp_in_place(x) };
        return;
    }
    x.iter_mut().for_each(|v| *v = v.exp());
}

/// `x[i] = exp(x[i] − m)` for every element: the difference rounded to `f32`, then
/// [`exp_in_place`]'s bits of it, as if `x[i] −= m` were stored first (a softmax's
/// exponentials, in one pass).
pub fn exp_sub_in_place(x: &mut [f32], m: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // SAFETY: AVX2, FMA and AVX-512F/DQ were detected at run time.
        unsafe { avx512::exp_sub_in_place(x, m) };
        return;
    }
    x.iter_mut().for_each(|v| *v -= m);
    exp_in_place(x);
}

/// `gate[i] = silu(gate[i]) · up[i]` with `silu(g) = g / (1 + exp(−g))`, each value
/// bit-identical to `crate::silu(gate[i]) * up[i]` (the same `f32` operations in the
/// same order; the exponentials as [`exp_in_place`]).
///
/// # Panics
/// If the lengths differ (a programming error).
pub fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul_in_place: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // SAFETY: AVX2, FMA and AVX-512F/DQ were detected at run time; the lengths are
        // equal.
        unsafe { avx512::silu_mul_in_place(gate, up) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_simd_exp() {
        // SAFETY: AVX2 and FMA were detected at run time; the lengths are equal.
        unsafe { avx2::silu_mul_in_place(gate, up) };
        return;
    }
    gate.iter_mut()
        .zip(up)
        .for_each(|(g, &u)| *g = crate::ops::silu(*g) * u);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{C, INV_LN2_N, SHIFT, SPECIAL_TOP12, TAB};
    use std::arch::x86_64::*;

    /// The main path (module docs, steps 1-4) for four inputs widened to `f64`, before
    /// the final rounding to `f32`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp4(xd: __m256d) -> __m256d {
        let inv = _mm256_set1_pd(f64::from_bits(INV_LN2_N));
        let shift = _mm256_set1_pd(f64::from_bits(SHIFT));
        let z = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(z);
        let kd = _mm256_sub_pd(z, shift);
        let r = _mm256_fmsub_pd(inv, xd, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // SAFETY: every index is in 0..32, the table's length.
        let t = unsafe { _mm256_i64gather_epi64::<8>(TAB.as_ptr().cast::<i64>(), idx) };
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let c = |i: usize| _mm256_set1_pd(f64::from_bits(C[i]));
        let p = _mm256_fmadd_pd(c(0), r, c(1));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(c(2), r, _mm256_set1_pd(1.0));
        _mm256_mul_pd(_mm256_fmadd_pd(p, r2, y), s)
    }

    /// `exp` of eight values; the lanes with `|x| ≥ 88` (or NaN) from `f32::exp`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp8(x: __m256) -> __m256 {
        let lo = exp4(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        let hi = exp4(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)));
        let y = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
        let top = _mm256_and_si256(
            _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
            _mm256_set1_epi32(0x7ff),
        );
        let special = _mm256_cmpgt_epi32(top, _mm256_set1_epi32(SPECIAL_TOP12 - 1));
        if _mm256_movemask_epi8(special) == 0 {
            return y;
        }
        let (mut xs, mut ys) = ([0f32; 8], [0f32; 8]);
        // SAFETY: both arrays hold eight `f32`.
        unsafe {
            _mm256_storeu_ps(xs.as_mut_ptr(), x);
            _mm256_storeu_ps(ys.as_mut_ptr(), y);
        }
        for (xv, yv) in xs.iter().zip(ys.iter_mut()) {
            if (xv.to_bits() >> 20) & 0x7ff >= SPECIAL_TOP12 as u32 {
                *yv = xv.exp();
            }
        }
        // SAFETY: `ys` holds eight `f32`.
        unsafe { _mm256_loadu_ps(ys.as_ptr()) }
    }

    /// See [`super::exp_in_place`].
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_in_place(x: &mut [f32]) {
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: `c` holds eight `f32`.
            unsafe { _mm256_storeu_ps(c.as_mut_ptr(), exp8(_mm256_loadu_ps(c.as_ptr()))) };
        }
        chunks
            .into_remainder()
            .iter_mut()
            .for_each(|v| *v = v.exp());
    }

    /// See [`super::silu_mul_in_place`].
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `gate.len() == up.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
        let n8 = gate.len() / 8 * 8;
        let sign = _mm256_set1_ps(-0.0);
        let one = _mm256_set1_ps(1.0);
        for i in (0..n8).step_by(8) {
            // SAFETY: `i + 8 <= n8 <= gate.len() == up.len()`.
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                // g / (1 + exp(-g)) * u, as `silu(g) * u` computes it.
                let e = exp8(_mm256_xor_ps(g, sign));
                let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
                _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, u));
            }
        }
        for (g, &u) in gate[n8..].iter_mut().zip(&up[n8..]) {
            *g = crate::ops::silu(*g) * u;
        }
    }
}

/// The kernels of [`avx2`] with 512-bit registers: eight `f64` lanes per step instead
/// of four, and the table read by two in-register permutes instead of a gather. The
/// same operations on the same values in every lane, so the same bits.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{C, INV_LN2_N, SHIFT, SPECIAL_TOP12, TAB};
    use std::arch::x86_64::*;

    /// `avx2::exp4` for eight inputs widened to `f64`.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512dq")]
    fn exp8d(xd: __m512d) -> __m512d {
        let inv = _mm512_set1_pd(f64::from_bits(INV_LN2_N));
        let shift = _mm512_set1_pd(f64::from_bits(SHIFT));
        let z = _mm512_fmadd_pd(inv, xd, shift);
        let ki = _mm512_castpd_si512(z);
        let kd = _mm512_sub_pd(z, shift);
        let r = _mm512_fmsub_pd(inv, xd, kd);
        // TAB[k mod 32]: entries 0-15 and 16-31 by index bits 0-3, bit 4 picks.
        let tab = |i: usize| {
            // SAFETY: `i + 8 <= 32`, inside the table.
            unsafe { _mm512_loadu_si512(TAB.as_ptr().add(i).cast()) }
        };
        let lo = _mm512_permutex2var_epi64(tab(0), ki, tab(8));
        let hi = _mm512_permutex2var_epi64(tab(16), ki, tab(24));
        let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
        let t = _mm512_mask_blend_epi64(upper, lo, hi);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let c = |i: usize| _mm512_set1_pd(f64::from_bits(C[i]));
        let p = _mm512_fmadd_pd(c(0), r, c(1));
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(c(2), r, _mm512_set1_pd(1.0));
        _mm512_mul_pd(_mm512_fmadd_pd(p, r2, y), s)
    }

    /// `exp` of sixteen values; the lanes with `|x| ≥ 88` (or NaN) from `f32::exp`.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512dq")]
    fn exp16(x: __m512) -> __m512 {
        let lo = exp8d(_mm512_cvtps_pd(_mm512_castps512_ps256(x)));
        let hi = exp8d(_mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(x)));
        let y = _mm512_insertf32x8::<1>(
            _mm512_castps256_ps512(_mm512_cvtpd_ps(lo)),
            _mm512_cvtpd_ps(hi),
        );
        let top = _mm512_and_si512(
            _mm512_srli_epi32::<20>(_mm512_castps_si512(x)),
            _mm512_set1_epi32(0x7ff),
        );
        let special = _mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(SPECIAL_TOP12 - 1));
        if special == 0 {
            return y;
        }
        let (mut xs, mut ys) = ([0f32; 16], [0f32; 16]);
        // SAFETY: both arrays hold sixteen `f32`.
        unsafe {
            _mm512_storeu_ps(xs.as_mut_ptr(), x);
            _mm512_storeu_ps(ys.as_mut_ptr(), y);
        }
        for (xv, yv) in xs.iter().zip(ys.iter_mut()) {
            if (xv.to_bits() >> 20) & 0x7ff >= SPECIAL_TOP12 as u32 {
                *yv = xv.exp();
            }
        }
        // SAFETY: `ys` holds sixteen `f32`.
        unsafe { _mm512_loadu_ps(ys.as_ptr()) }
    }

    /// See [`super::exp_in_place`].
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and AVX-512F/DQ.
    #[target_feature(enable = "avx2,fma,avx512f,avx512dq")]
    pub unsafe fn exp_in_place(x: &mut [f32]) {
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: `c` holds sixteen `f32`.
            unsafe { _mm512_storeu_ps(c.as_mut_ptr(), exp16(_mm512_loadu_ps(c.as_ptr()))) };
        }
        // SAFETY: AVX2 and FMA are available (the caller's contract).
        unsafe { super::avx2::exp_in_place(chunks.into_remainder()) };
    }

    /// See [`super::exp_sub_in_place`].
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and AVX-512F/DQ.
    #[target_feature(enable = "avx2,fma,avx512f,avx512dq")]
    pub unsafe fn exp_sub_in_place(x: &mut [f32], m: f32) {
        let mv = _mm512_set1_ps(m);
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: `c` holds sixteen `f32`.
            unsafe {
                let d = _mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), mv);
                _mm512_storeu_ps(c.as_mut_ptr(), exp16(d));
            }
        }
        let tail = chunks.into_remainder();
        tail.iter_mut().for_each(|v| *v -= m);
        // SAFETY: AVX2 and FMA are available (the caller's contract).
        unsafe { super::avx2::exp_in_place(tail) };
    }

    /// See [`super::silu_mul_in_place`].
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and AVX-512F/DQ; `gate.len() == up.len()`.
    #[target_feature(enable = "avx2,fma,avx512f,avx512dq")]
    pub unsafe fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
        let n16 = gate.len() / 16 * 16;
        let sign = _mm512_set1_ps(-0.0);
        let one = _mm512_set1_ps(1.0);
        for i in (0..n16).step_by(16) {
            // SAFETY: `i + 16 <= n16 <= gate.len() == up.len()`.
            unsafe {
                let g = _mm512_loadu_ps(gate.as_ptr().add(i));
                let u = _mm512_loadu_ps(up.as_ptr().add(i));
                // g / (1 + exp(-g)) * u, as `silu(g) * u` computes it.
                let e = exp16(_mm512_xor_ps(g, sign));
                let s = _mm512_div_ps(g, _mm512_add_ps(one, e));
                _mm512_storeu_ps(gate.as_mut_ptr().add(i), _mm512_mul_ps(s, u));
            }
        }
        // SAFETY: AVX2 and FMA are available; the tails have equal lengths.
        unsafe { super::avx2::silu_mul_in_place(&mut gate[n16..], &up[n16..]) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits()
    }

    /// Every kernel this CPU runs, each behind a safe call: the 512-bit one (where
    /// [`exp_in_place`] takes it) and the 256-bit one it falls back to elsewhere.
    #[allow(clippy::type_complexity)]
    fn kernels() -> Vec<(&'static str, fn(&mut [f32]), fn(&mut [f32], &[f32]))> {
        let mut k: Vec<(&'static str, fn(&mut [f32]), fn(&mut [f32], &[f32]))> =
            vec![("dispatch", exp_in_place, silu_mul_in_place)];
        #[cfg(target_arch = "x86_64")]
        if has_simd_exp() {
            // SAFETY (both): AVX2 and FMA were detected; the lengths are equal.
            k.push((
                "avx2",
                |x| unsafe { avx2::exp_in_place(x) },
                |g, u| unsafe { avx2::silu_mul_in_place(g, u) },
            ));
        }
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::has_avx512_f32() {
            // SAFETY (both): AVX2, FMA and AVX-512F/DQ were detected; equal lengths.
            k.push((
                "avx512",
                |x| unsafe { avx512::exp_in_place(x) },
                |g, u| unsafe { avx512::silu_mul_in_place(g, u) },
            ));
        }
        k
    }

    /// The tests below run the kernels [`kernels`] lists, those this CPU has: these two
    /// say which vector kernels that covered, and on a CPU without one's features (or
    /// with `FAK_NO_AVX512=1`) its test is reported ignored, not passed.
    #[fak_testkit::cpu("avx2", "fma")]
    fn the_256_bit_kernels_are_tested() {
        assert!(kernels().iter().any(|k| k.0 == "avx2"));
    }

    /// See [`the_256_bit_kernels_are_tested`].
    #[fak_testkit::cpu("avx2", "fma", "avx512f", "avx512dq")]
    fn the_512_bit_kernels_are_tested() {
        assert!(kernels().iter().any(|k| k.0 == "avx512"));
    }

    /// Every one of the 2³² `f32` bit patterns through [`exp_in_place`] against the
    /// platform's `f32::exp` (the oracle), on two threads.
    #[test]
    fn exp_matches_libm_for_every_f32() {
        let vector: Vec<crate::test_util::NamedKernel> = kernels()
            .into_iter()
            .skip(1)
            .map(|(n, e, _)| (n, e))
            .collect();
        let bad = crate::test_util::first_mismatch_over_every_f32(&vector, f32::exp);
        if let Some((name, b)) = bad {
            let x = f32::from_bits(b);
            panic!(
                "{name}: exp({x:e}) (bits {b:#010x}) differs from f32::exp's {:e}",
                x.exp()
            );
        }
    }

    #[test]
    fn silu_mul_matches_the_scalar_form() {
        // Every length remainder, ordinary values, large magnitudes (the special path
        // of exp), zeros of both signs, infinities.
        let mut vals: Vec<f32> = (0..203).map(|i| (i as f32 - 101.0) * 0.37).collect();
        vals.extend([
            0.0,
            -0.0,
            90.0,
            -90.0,
            200.0,
            -200.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        let up: Vec<f32> = (0..vals.len()).map(|i| 1.0 + i as f32 * 0.01).collect();
        for (name, _, silu_mul) in kernels() {
            for len in [0, 1, 7, 8, 9, 15, 16, 17, 24, 33, vals.len()] {
                let mut got = vals[..len].to_vec();
                silu_mul(&mut got, &up[..len]);
                for i in 0..len {
                    let want = crate::ops::silu(vals[i]) * up[i];
                    assert!(
                        same(got[i], want) || (got[i].is_nan() && want.is_nan()),
                        "{name}, len {len}, x = {}: {} vs {want}",
                        vals[i],
                        got[i]
                    );
                }
            }
        }
    }

    #[test]
    fn table_entries_are_powers_of_two_to_the_i_over_32() {
        #[cfg(target_arch = "x86_64")]
        for (i, &t) in TAB.iter().enumerate() {
            let v = f64::from_bits(t.wrapping_add((i as u64) << 47));
            let want = (i as f64 / 32.0).exp2();
            assert!(
                (v - want).abs() <= want * 2.3e-16,
                "entry {i}: {v} vs {want}"
            );
        }
    }
}
