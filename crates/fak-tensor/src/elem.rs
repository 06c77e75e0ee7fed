//! The element types of a weight matrix that the `f32` products read: `f32` itself, or
//! IEEE binary16 ([`F16`], a GGUF F16 tensor read in place) widened to `f32` as each
//! value is loaded.
//!
//! Widening binary16 to `f32` is exact (every binary16 value is an `f32` value), so a
//! product over [`F16`] weights computes, in the canonical order (crate docs), exactly
//! the products of the same matrix widened to `f32` beforehand: the same bits, with
//! half the bytes read. The SIMD kernels widen eight values per F16C instruction
//! (`vcvtph2ps`), which gives the bits of [`crate::quant::f16_to_f32`] for every
//! non-NaN input (Intel SDM Vol. 2, "VCVTPH2PS"; a NaN stays a NaN, as it does in the
//! scalar widening, whose quieting may differ, and a NaN weight makes every output it
//! touches NaN either way).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::F16 {}
}

/// An element type of a weight matrix of [`crate::matmul()`] and [`crate::matmul_group`]:
/// `f32`, or [`F16`]. Sealed: the kernels' safety rests on these two implementations.
pub trait WeightElem: Copy + Send + Sync + std::fmt::Debug + 'static + sealed::Sealed {
    /// The value as `f32`, exactly.
    fn to_f32(self) -> f32;

    /// Eight consecutive elements from `p`, as `f32` lanes.
    ///
    /// # Safety
    /// The CPU supports AVX2 and F16C, and `p..p + 8` are readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

impl WeightElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller's contract (eight readable elements, AVX).
        unsafe { _mm256_loadu_ps(p) }
    }
}

/// One IEEE binary16 value, as its bits (a GGUF `F16` tensor's element, little-endian
/// in the file; read in place only on a little-endian host).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F16(pub u16);

impl F16 {
    /// Binary16 bits as [`F16`] values, in place (no copy).
    pub fn from_bits_slice(bits: &[u16]) -> &[F16] {
        // SAFETY: `F16` is `repr(transparent)` over `u16`: the same size, alignment and
        // valid bit patterns, so the same memory read as `F16` is a valid slice of the
        // same length, borrowed for as long as `bits`.
        unsafe { std::slice::from_raw_parts(bits.as_ptr() as *const F16, bits.len()) }
    }
}

impl WeightElem for F16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::quant::f16_to_f32(self.0)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const F16) -> __m256 {
        // SAFETY: the caller's contract: sixteen readable bytes (eight `F16`, which is
        // `repr(transparent)` over `u16`), F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every binary16 bit pattern through the F16C widening against the scalar one.
    #[cfg(target_arch = "x86_64")]
    #[fak_testkit::cpu("avx2", "f16c")]
    fn the_f16c_widening_is_the_scalar_one_for_every_non_nan_value() {
        assert!(crate::cpu::has_avx2_f16c());
        let all: Vec<F16> = (0..=u16::MAX).map(F16).collect();
        for chunk in all.chunks_exact(8) {
            let mut got = [0f32; 8];
            // SAFETY: AVX2 and F16C were detected; the chunk holds 8 elements.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), F16::load8(chunk.as_ptr())) };
            for (g, h) in got.iter().zip(chunk) {
                let want = h.to_f32();
                if want.is_nan() {
                    assert!(g.is_nan(), "{:#06x}", h.0);
                } else {
                    assert_eq!(g.to_bits(), want.to_bits(), "{:#06x}", h.0);
                }
            }
        }
    }
}
