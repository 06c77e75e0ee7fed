//! AVX2 kernels of the quantized dot products. Each one computes exact integer lane
//! sums (`maddubs` pairs adjacent bytes into i16, `madd` pairs adjacent i16 into i32, so
//! i32 lane `m` holds bytes `4m..4m+4` of a 32-byte chunk) and combines them as its
//! scalar reference in the type's file (`q4_0.rs` … `q6_k.rs`) does, with the same
//! float operations in the same order (module docs of `quant`): the 32-element types
//! total a block's eight lanes into its exact block sum first ([`block_total`],
//! [`block_totals4`]), the K types keep their eight lanes.
//!
//! Saturation: `_mm256_maddubs_epi16` saturates its i16 pair sums, so every use keeps
//! the unsigned operand below 64 (|pair| ≤ 2 · 63 · 128 = 16128 < 32767). Offsets are
//! subtracted as a second `maddubs` against the constant offset (exact i16
//! subtraction), never by making the weight signed, so an activation quant of −128
//! is exact too. Q8_0 weights are signed and are widened to i16 instead; its AVX-VNNI
//! kernel reorders the bytes (the order the row-pair layout `Q8_0R2` keeps at load) and
//! offsets the weights by 128 (`VnniQ8_0`).
//!
//! Every function here requires AVX2 and F16C (`# Safety`) and that `w` holds exactly
//! `a.len()` blocks, which the dispatchers (`vec_dot_*` in each type's file,
//! `dispatch.rs`, `tiles.rs`) check before calling.
//!
//! # Layout
//!
//! This file holds what the kernels share: the load, unpack and widen helpers, the
//! lane accumulation and horizontal sum, the [`Block32`] and [`Tile512`] forms of a
//! 32-element format, the activation scales and the weight prefetch. Beside it, one
//! file per block format with that format's kernels (`q4_0.rs`, `q4_1.rs`, `q5_0.rs`,
//! `q5_1.rs`, `q8_0.rs`, `q4_k.rs`, `q5_k.rs`, `q6_k.rs`; the activation quantizers in
//! `q8_0.rs`, `q8_1.rs`, `q8_k.rs`), the row kernels generic over [`Block32`]
//! (`rows.rs`) and the many-token K-quant driver (`k_tokens.rs`). Each of those files
//! takes this one's names with `use super::*`.

use super::{k4_scale_min, k_mins, BlockQ8K, BlockQ8_0, BlockQ8_1};
use crate::dot::reduce_lanes;
use std::arch::x86_64::*;
use std::borrow::Cow;

/// One pass of the tokens left over a chunk of a 16-row kernel (`q4_1_r16.rs`,
/// `q8_0_r16.rs`): `$pass.run::<T>($out, $r0)` with `T` = 8 while 8 or more are left, else
/// exactly the tokens left (each further pass reads the chunk's weights again); the
/// tokens it ran.
macro_rules! r16_pass {
    ($left:expr, $pass:expr, $out:expr, $r0:expr) => {
        match $left {
            8.. => $pass.run::<8>($out, $r0),
            7 => $pass.run::<7>($out, $r0),
            6 => $pass.run::<6>($out, $r0),
            5 => $pass.run::<5>($out, $r0),
            4 => $pass.run::<4>($out, $r0),
            3 => $pass.run::<3>($out, $r0),
            2 => $pass.run::<2>($out, $r0),
            _ => $pass.run::<1>($out, $r0),
        }
    };
}

/// [`Tile512`] for a type whose VNNI activation form is its plain block, with the
/// weight offset (if any) taken off through the `vpdpbusd` start value. Defined above
/// the `mod` lines so that the format files below can invoke it.
macro_rules! tile512_plain {
    ($t:ty, $act:ty, $off:expr) => {
        tile512_plain!($t, $act, $off, None);
    };
    ($t:ty, $act:ty, $off:expr, $nibbles_at:expr) => {
        impl Tile512 for $t {
            #[inline(always)]
            unsafe fn unpack_pair512(wa: &[u8], wb: &[u8]) -> __m512i {
                let at: Option<usize> = $nibbles_at;
                match at {
                    // The quants are the 16 bytes from `at`, as `unpack_vnni` reads them.
                    Some(at) => nibbles_pair512(wa[at..at + 16].as_ptr(), wb[at..at + 16].as_ptr()),
                    None => unpack_pair_inserted::<Self>(wa, wb),
                }
            }
            #[inline(always)]
            unsafe fn vqs(a: &$act) -> __m256i {
                load32(a.qs_ptr())
            }
            #[inline(always)]
            unsafe fn vbase(a: &$act) -> __m256i {
                let off: Option<i8> = $off;
                match off {
                    Some(o) => _mm256_sub_epi32(
                        _mm256_setzero_si256(),
                        dp::<Evex>(_mm256_set1_epi8(o), load32(a.qs_ptr())),
                    ),
                    None => _mm256_setzero_si256(),
                }
            }
        }
    };
}

mod k_tokens;
mod q4_0;
mod q4_1;
mod q4_1_r16;
mod q4_k;
mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
mod q8_0;
mod q8_0_r16;
mod q8_0_r2;
mod q8_1;
mod q8_k;
mod rows;

pub(super) use k_tokens::{k_tokens, k_tokens_wide, KQuant};
pub(super) use q4_0::{dot_q4_0_q8_0, Q4_0};
pub(super) use q4_1::{dot_q4_1_q8_1, Q4_1};
pub(super) use q4_1_r16::rows_r16_512;
pub(super) use q4_k::{dot_q4_k_q8_k, unpack_k45};
pub(super) use q5_0::{dot_q5_0_q8_0, Q5_0};
pub(super) use q5_1::{dot_q5_1_q8_1, Q5_1};
pub(super) use q5_k::dot_q5_k_q8_k;
pub(super) use q6_k::{dot_q6_k_q8_k, unpack_q6_k};
pub(super) use q8_0::{dot_q8_0_q8_0, q8_block, quantize_q8_0, Q8_0};
pub(super) use q8_0_r16::rows_r16_q8_0_512;
pub(super) use q8_0_r2::rows_r2_512;
pub(super) use q8_1::quantize_q8_1;
#[cfg(test)]
pub(super) use q8_1::sum_quants;
pub(super) use q8_k::q8k_block;
pub(super) use rows::{
    rows, rows_pairs_512, rows_tokens, rows_tokens_vnni, rows_tokens_vnni512, rows_vnni,
    rows_vnni512,
};
// Shared between the files below.
use k_tokens::k_tokens_one;
use q4_k::dot_k45_tokens;
use q6_k::dot_q6_k_tokens;
use rows::one;

/// f16 bits to `f32` with the F16C instruction: the exact value for every non-NaN
/// input, as `quant::f16_to_f32` (a signalling NaN comes back quiet; a NaN scale makes
/// the result NaN either way, which is all the NaN contract promises).
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn h2f(h: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// The little-endian f16 at `bytes[at..at + 2]`, widened by [`h2f`].
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn f16_at(bytes: &[u8], at: usize) -> f32 {
    h2f(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// Stores the eight lane accumulators and reduces them in the canonical tree.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let mut l = [0f32; 8];
    _mm256_storeu_ps(l.as_mut_ptr(), v);
    reduce_lanes(&l)
}

/// The exact total of the eight `i32` lanes of `v`: a block's lane sums to its product
/// sum `S`, step 1 of the 32-element types' canonical order (module docs of `quant`;
/// integer adds of values within `±2^19`, exact in any order).
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn block_total(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// The block totals ([`block_total`]) of four lane-sum registers, `[S0, S1, S2, S3]`:
/// two rounds of pairwise horizontal adds and one add of the halves, exact integer adds.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn block_totals4(l: [__m256i; 4]) -> __m128i {
    // Per 128-bit half: [l0 pair sums, l1 pair sums], then [l0, l1, l2, l3] quad sums.
    let a = _mm256_hadd_epi32(l[0], l[1]);
    let b = _mm256_hadd_epi32(l[2], l[3]);
    let q = _mm256_hadd_epi32(a, b);
    _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q))
}

/// Accumulators of `n` (row, token) pairs of the 32-element types: the first `4 ⌊n / 4⌋`
/// four to a register, the rest one by one.
struct Accs<'a> {
    /// Pairs `4g..4g + 4` in lanes 0..4 of `v4[g]`.
    v4: &'a mut [__m128],
    /// Pair `i` at `v1[i]` for the pairs past the registers.
    v1: &'a mut [f32],
}

impl Accs<'_> {
    /// Step 2 of the 32-element types' canonical order for every pair: `acc_i = acc_i +
    /// d[i] * (S_i as f32)` with `S_i` the [`block_total`] of `l[i]` (a rounded multiply
    /// then a rounded add); four at a time ([`block_totals4`]), the same bits as one at a
    /// time. The scales are read as values (no vector load of scalars just stored).
    ///
    /// # Safety
    /// AVX2 and F16C (the caller has them enabled); `d` and `l` hold the `n` pairs.
    #[inline(always)]
    unsafe fn add(&mut self, d: &[f32], l: &[__m256i]) {
        let n = self.v1.len();
        for (g, v) in self.v4.iter_mut().enumerate() {
            let i = 4 * g;
            let s = block_totals4([l[i], l[i + 1], l[i + 2], l[i + 3]]);
            let dv = _mm_setr_ps(d[i], d[i + 1], d[i + 2], d[i + 3]);
            *v = _mm_add_ps(*v, _mm_mul_ps(dv, _mm_cvtepi32_ps(s)));
        }
        for i in 4 * self.v4.len()..n {
            self.v1[i] =
                crate::quant::unpack::accumulate_block(self.v1[i], d[i], block_total(l[i]));
        }
    }

    /// Pair `i`'s accumulator.
    ///
    /// # Safety
    /// AVX2 and F16C (the caller has them enabled).
    #[inline(always)]
    unsafe fn get(&self, i: usize) -> f32 {
        match self.v4.get(i / 4) {
            Some(v) => {
                let mut x = [0f32; 4];
                _mm_storeu_ps(x.as_mut_ptr(), *v);
                x[i % 4]
            }
            None => self.v1[i],
        }
    }
}

/// `acc + d * (l as f32)` lane-wise: step 2 of the K types' canonical order.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn accumulate(acc: __m256, d: f32, l: __m256i) -> __m256 {
    _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(l)))
}

/// 32 bytes from an unaligned pointer.
///
/// # Safety
/// AVX2 and F16C; `p` valid for reading 32 bytes.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn load32(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// The 32 nibbles of a 16-byte `qs` in element order: bytes 0..16 the low nibbles,
/// 16..32 the high ones.
///
/// # Safety
/// AVX2 and F16C; `qs` valid for reading 16 bytes.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn nibbles(qs: *const u8) -> __m256i {
    let q = _mm_loadu_si128(qs as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// Byte `j` = `val` when bit `j` of `bits` is set, else 0.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn bits_to_bytes(bits: u32, val: i8) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    // Byte j takes byte j / 8 of `bits` (shuffle indices are per 128-bit half, and
    // the broadcast put all four bytes in both halves).
    let idx = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bytes = _mm256_shuffle_epi8(v, idx);
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64); // byte j: 1 << (j % 8)
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask);
    _mm256_and_si256(set, _mm256_set1_epi8(val))
}

/// i16 pair sums `w[2j]a[2j] + w[2j+1]a[2j+1]`, `w` unsigned below 64.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn pairs(w: __m256i, a: __m256i) -> __m256i {
    _mm256_maddubs_epi16(w, a)
}

/// i16 pair sums of `(w - off) * a`, `w` and `off` unsigned below 64.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn pairs_off(w: __m256i, a: __m256i, off: i8) -> __m256i {
    _mm256_sub_epi16(pairs(w, a), pairs(_mm256_set1_epi8(off), a))
}

/// i32 lane `m` = i16 lanes `2m + 2m+1` (times 1).
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn quads(p: __m256i) -> __m256i {
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// One 32-element weight format paired with its activation block: how to get a
/// block's exact lane sums, its combined scale and (Q4_1/Q5_1) its min term.
pub(super) trait Block32 {
    /// Activation block type.
    type Act;
    /// Weight block bytes.
    const BYTES: usize;
    /// Whether the result is `reduced + summ` (else just `reduced`; adding a zero
    /// `summ` would turn a `-0.0` into `+0.0`).
    const HAS_MIN: bool;
    /// A weight block's quants unpacked into registers, reusable against several
    /// activation blocks.
    type W: Copy;
    /// Unpacks the quants of one weight block.
    ///
    /// # Safety
    /// AVX2 and F16C (the caller has them enabled); `wb` is one whole weight block.
    unsafe fn unpack(wb: &[u8]) -> Self::W;
    /// Exact lane sums of an unpacked weight block against one activation block: eight
    /// `i32` lanes whose total is the block sum `S` (which products feed which lane is
    /// the type's grouping, [`Block32::act_lanes`] for the VNNI forms).
    ///
    /// # Safety
    /// AVX2 and F16C (the caller has them enabled).
    unsafe fn lanes_w(w: Self::W, a: &Self::Act) -> __m256i;
    /// The weight block's scale and minimum widened to `f32`: `(f16(d_w), f16(m_w))`,
    /// the minimum `0.0` when not `HAS_MIN`.
    ///
    /// # Safety
    /// AVX2 and F16C (the caller has them enabled); `wb` is one whole weight block.
    unsafe fn wscales(wb: &[u8]) -> (f32, f32);
    /// Whether the one-token row kernel ([`rows_vnni`]) should use the VNNI lane sums
    /// when the CPU has them (the multi-token tiles always do).
    const VNNI_ROWS: bool = true;
    /// A weight block's quants unpacked for [`Block32::lanes_vnni`].
    type VW: Copy;
    /// An activation block as [`Block32::lanes_vnni`] reads it: the block itself, or
    /// (Q8_0) a form prepared once per product by [`Block32::vnni_acts`].
    type VAct: Clone;
    /// The activation row in the form [`Block32::lanes_vnni`] reads.
    ///
    /// # Safety
    /// AVX2, F16C and AVX-VNNI (the caller has them enabled).
    unsafe fn vnni_acts<D: Dp>(a: &[Self::Act]) -> Cow<'_, [Self::VAct]>;
    /// Unpacks the quants of one weight block for [`Block32::lanes_vnni`].
    ///
    /// # Safety
    /// AVX2, F16C and AVX-VNNI (the caller has them enabled); `wb` is one whole weight
    /// block.
    unsafe fn unpack_vnni(wb: &[u8]) -> Self::VW;
    /// [`Block32::unpack_vnni`] where AVX-512BW and AVX-512VL are enabled too (the same
    /// value; Q8_0 reorders its bytes with one `vpermw`).
    ///
    /// # Safety
    /// AVX2, F16C, AVX-512BW and AVX-512VL (the caller has them enabled); `wb` is one
    /// whole weight block.
    #[inline(always)]
    unsafe fn unpack_vnni512(wb: &[u8]) -> Self::VW {
        Self::unpack_vnni(wb)
    }
    /// [`Block32::lanes_w`] with the instruction `vpdpbusd` in the encoding `D` (the
    /// same exact integer lane sums).
    ///
    /// # Safety
    /// AVX2, F16C and `D`'s features (the caller has them enabled).
    unsafe fn lanes_vnni<D: Dp>(w: Self::VW, a: &Self::VAct) -> __m256i;
    /// The element of a 32-element chunk that byte `k` (`k < 4`) of lane `m` holds in the
    /// VNNI and tile forms (weights and activations grouped alike, so any grouping gives
    /// the same block sum): `4m + k` (element order; the nibble types), or Q8_0's `2m,
    /// 2m+1, 2m+16, 2m+17`.
    #[cfg(test)]
    const LANE_ELEMENT: fn(usize, usize) -> usize = |m, k| 4 * m + k;
    /// An activation block's 32 quants `q` (in element order) in lane order, the
    /// grouping of the VNNI and tile forms: lane `m` (bytes `4m..4m + 4`) holds elements
    /// `4m..4m + 4` for the nibble types (`q` as it is), Q8_0's `2m, 2m+1, 2m+16, 2m+17`
    /// (`LANE_ELEMENT` in the tests).
    ///
    /// # Safety
    /// AVX2 (the caller has it enabled).
    #[inline(always)]
    unsafe fn act_lanes(q: __m256i) -> __m256i {
        q
    }
    /// The weight block's quants as signed bytes, offset removed (`q - 8` for Q4_0,
    /// `q - 16` for Q5_0), in lane order: bytes `4m..4m+4` are the elements
    /// of lane `m` in [`Block32::act_lanes`]'s grouping.
    ///
    /// # Safety
    /// AVX2 and F16C (the caller has them enabled); `wb` is one whole weight block.
    unsafe fn signed_quants(wb: &[u8]) -> __m256i;
    /// Whether the 8-token pair tiles prefetch this type's next chunk of weights into L2
    /// rather than L1 where L1 is not the tuned choice (`transposed::pair_prefetch_l1`).
    const PAIR_PREFETCH_L2: bool = false;
    /// Whether [`Block32::signed_quants`] are all in `[0, 127]` (Q4_1's and Q5_1's
    /// `w = q`, no offset), so that they can be the unsigned operand of `vpdpbusd`.
    const UNSIGNED_QUANTS: bool = false;
}

/// Which lane sums a kernel body computes, with the weight and activation forms they
/// read: [`Avx2`] ([`Block32::unpack`], [`Block32::lanes_w`] on the activation blocks)
/// or [`Vnni`] ([`Block32::unpack_vnni`], [`Block32::lanes_vnni`] on
/// [`Block32::vnni_acts`]). Both give the same exact `i32` lane sums.
pub(super) trait Isa<K: Block32> {
    /// Unpacked weight block.
    type W: Copy;
    /// Activation block as read.
    type A;
    /// # Safety
    /// The instruction set's features (the caller has them enabled); `wb` is one whole
    /// weight block.
    unsafe fn unpack(wb: &[u8]) -> Self::W;
    /// # Safety
    /// The instruction set's features (the caller has them enabled).
    unsafe fn lanes(w: Self::W, a: &Self::A) -> __m256i;
}

/// AVX2 lane sums (`maddubs`/`madd`).
pub(super) struct Avx2;

/// AVX-VNNI lane sums (`vpdpbusd`, VEX-encoded: [`Vex`]).
pub(super) struct Vnni;

/// The `vpdpbusd` lane sums of AVX512-VNNI on 256-bit registers (EVEX-encoded:
/// [`Evex`]), in code compiled with AVX-512F/BW/VL as well (32 vector registers and
/// `vpermw`; the same lane sums as [`Vnni`]).
pub(super) struct Vnni512;

/// One encoding of `vpdpbusd` on 256-bit registers (Intel 64 and IA-32 Architectures
/// Software Developer's Manual, Vol. 2, "VPDPBUSD"): per `i32` lane, `src` plus the four
/// products of unsigned bytes of `w` and signed bytes of `a`, without saturation. The
/// two encodings compute the same thing; which one a CPU runs is a matter of its
/// features: AVX-VNNI gives the VEX form ([`Vex`]; Intel since Alder Lake and
/// Sapphire Rapids, AMD since Zen 5), AVX512-VNNI with AVX-512VL the EVEX form
/// ([`Evex`]; Intel since Cascade Lake, AMD since Zen 4). AMD Zen 4 and the Ice Lake
/// and Cascade Lake Xeons have only the EVEX form, so the kernels built on AVX-512 use
/// that one.
pub(super) trait Dp {
    /// # Safety
    /// The encoding's features (the caller has them enabled).
    unsafe fn dpbusd(src: __m256i, w: __m256i, a: __m256i) -> __m256i;
}

/// `vpdpbusd` as AVX-VNNI encodes it (`_mm256_dpbusd_avx_epi32`).
pub(super) struct Vex;

/// `vpdpbusd` as AVX512-VNNI with AVX-512VL encodes it (`_mm256_dpbusd_epi32`).
pub(super) struct Evex;

impl Dp for Vex {
    #[inline(always)]
    unsafe fn dpbusd(src: __m256i, w: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(src, w, a)
    }
}

impl Dp for Evex {
    #[inline(always)]
    unsafe fn dpbusd(src: __m256i, w: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(src, w, a)
    }
}

impl<K: Block32> Isa<K> for Avx2 {
    type W = K::W;
    type A = K::Act;
    #[inline(always)]
    unsafe fn unpack(wb: &[u8]) -> K::W {
        K::unpack(wb)
    }
    #[inline(always)]
    unsafe fn lanes(w: K::W, a: &K::Act) -> __m256i {
        K::lanes_w(w, a)
    }
}

impl<K: Block32> Isa<K> for Vnni512 {
    type W = K::VW;
    type A = K::VAct;
    #[inline(always)]
    unsafe fn unpack(wb: &[u8]) -> K::VW {
        K::unpack_vnni512(wb)
    }
    #[inline(always)]
    unsafe fn lanes(w: K::VW, a: &K::VAct) -> __m256i {
        K::lanes_vnni::<Evex>(w, a)
    }
}

impl<K: Block32> Isa<K> for Vnni {
    type W = K::VW;
    type A = K::VAct;
    #[inline(always)]
    unsafe fn unpack(wb: &[u8]) -> K::VW {
        K::unpack_vnni(wb)
    }
    #[inline(always)]
    unsafe fn lanes(w: K::VW, a: &K::VAct) -> __m256i {
        K::lanes_vnni::<Vex>(w, a)
    }
}

/// An activation block's scales widened to `f32`: `[f16(d_a), f16(s_a)]` (`s_a = 0`
/// for Q8_0, which has none).
pub(super) trait ActBlock {
    /// # Safety
    /// AVX2 and F16C (the caller has them enabled).
    unsafe fn scales(&self) -> [f32; 2];
    /// The block's 32 quants.
    fn qs_ptr(&self) -> *const u8;
}

impl ActBlock for BlockQ8_0 {
    #[inline(always)]
    unsafe fn scales(&self) -> [f32; 2] {
        [h2f(self.d), 0.0]
    }
    #[inline(always)]
    fn qs_ptr(&self) -> *const u8 {
        self.qs.as_ptr() as *const u8
    }
}

impl ActBlock for BlockQ8_1 {
    #[inline(always)]
    unsafe fn scales(&self) -> [f32; 2] {
        [h2f(self.d), h2f(self.s)]
    }
    #[inline(always)]
    fn qs_ptr(&self) -> *const u8 {
        self.qs.as_ptr() as *const u8
    }
}

/// Every activation block's [`ActBlock::scales`], widened once per product instead of
/// once per weight row.
///
/// # Safety
/// AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn act_scales<A: ActBlock>(a: &[A]) -> Vec<[f32; 2]> {
    a.iter().map(|b| b.scales()).collect()
}

/// Activation blocks whose widened scales [`ActScales`] keeps inline (1 KB); longer
/// rows (more than 4,096 elements in 32-element blocks) allocate them.
pub(super) const STACK_SCALES: usize = 128;

/// [`act_scales`] held inline for up to [`STACK_SCALES`] blocks, on the heap past
/// that: a decode step runs hundreds of one-token products, and each would otherwise
/// allocate its scales.
pub(super) struct ActScales {
    /// The scales when they fit: the first `len` entries.
    inline: [[f32; 2]; STACK_SCALES],
    len: usize,
    /// The scales when they do not fit (empty, never allocated, otherwise).
    heap: Vec<[f32; 2]>,
}

impl ActScales {
    /// # Safety
    /// AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn new<A: ActBlock>(a: &[A]) -> Self {
        let mut s = ActScales {
            inline: [[0f32; 2]; STACK_SCALES],
            len: a.len(),
            heap: Vec::new(),
        };
        if a.len() > STACK_SCALES {
            s.heap = act_scales(a);
        } else {
            for (o, b) in s.inline.iter_mut().zip(a) {
                *o = b.scales();
            }
        }
        s
    }

    /// One `[d, s]` pair per activation block.
    pub(super) fn get(&self) -> &[[f32; 2]] {
        if self.len > STACK_SCALES {
            &self.heap
        } else {
            &self.inline[..self.len]
        }
    }
}

/// [`Block32::vnni_acts`] of `a`, computed once per product.
///
/// # Safety
/// AVX2, F16C and AVX-VNNI.
#[target_feature(enable = "avx2,f16c,avxvnni")]
pub(super) unsafe fn vnni_acts<K: Block32>(a: &[K::Act]) -> Cow<'_, [K::VAct]> {
    K::vnni_acts::<Vex>(a)
}

/// [`vnni_acts`] with the AVX512-VNNI encoding (the same values), for the kernels built
/// on AVX-512.
///
/// # Safety
/// AVX2, F16C, AVX-512F/VL and AVX512-VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512vl,avx512vnni")]
pub(super) unsafe fn vnni_acts512<K: Block32>(a: &[K::Act]) -> Cow<'_, [K::VAct]> {
    K::vnni_acts::<Evex>(a)
}

/// `vpdpbusd` lane sums of unsigned `w` bytes times signed `a` bytes: lane `m` =
/// `Σ_{k<4} w[4m+k] a[4m+k]` in `i32`, exactly `quads(pairs(w, a))` whenever `pairs`
/// does not saturate (always, for the weights here: unsigned operand below 64).
#[inline(always)]
unsafe fn dp<D: Dp>(w: __m256i, a: __m256i) -> __m256i {
    D::dpbusd(_mm256_setzero_si256(), w, a)
}

/// The f16 at `wb[0..2]` (a block's `d`) widened by one F16C instruction.
///
/// The bytes are loaded by a `vmovd` written out, which fills the whole register. With
/// an intrinsic load (`_mm_loadl_epi64`, `_mm_cvtsi32_si128`, ...) of which only the
/// first 16 bits are used, the compiler narrows the load to `vpinsrw`, a 16-bit insert
/// that keeps the rest of a register of its choosing; in the 512-bit row-pair kernel it
/// chose an accumulator of the loop, so every block waited for the previous block's
/// sum (Q4_0's rows ran at half Q4_1's rate in cache).
///
/// # Safety
/// F16C (the caller has it enabled); `wb.len() >= 4` (asserted).
#[inline(always)]
unsafe fn one_f16(wb: &[u8]) -> f32 {
    assert!(wb.len() >= 4);
    let v: __m128i;
    // SAFETY: reads the 4 bytes `wb[0..4]`, in bounds by the assertion; writes only the
    // output register; no stack, no flags.
    unsafe {
        std::arch::asm!(
            "vmovd {v}, dword ptr [{p}]",
            p = in(reg) wb.as_ptr(),
            v = out(xmm_reg) v,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    _mm_cvtss_f32(_mm_cvtph_ps(v))
}

/// The two f16 at `wb[0..4]` (`d`, then `m`) widened by one F16C instruction.
#[inline(always)]
unsafe fn two_f16(wb: &[u8]) -> (f32, f32) {
    debug_assert!(wb.len() >= 8);
    let v = _mm_cvtph_ps(_mm_loadl_epi64(wb.as_ptr() as *const __m128i));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// How far ahead of the rows being read [`rows`] prefetches the weights. Decode
/// streams every weight from memory once per token; with the next group only (~1.4 KB
/// for SmolLM2's Q4_1 rows) the loads still waited on memory, and more so with two
/// threads streaming at once. 8 KB ahead let the pooled Q4_1 product stream at its
/// in-cache rate on one thread and much faster on two (`qdot_bench`); larger distances
/// gained nothing more.
///
/// The hint of the prefetches is chosen per CPU ([`nta_prefetch`]).
const PREFETCH_BYTES: usize = 8 * 1024;

/// Whether the one-token kernels prefetch the weights non-temporally
/// (`_MM_HINT_NTA`) rather than into every cache level (`_MM_HINT_T0`): on AMD CPUs
/// ([`crate::cpu::tuned_for_amd`]), unless `FAK_PREFETCH_NTA=0` (or `=1` forces it
/// elsewhere). A prefetch is a hint; either choice gives the same bits.
///
/// Each weight is read once per token, and the matrices (96.6 MB for SmolLM2 Q4_1) are
/// larger than an L3 (32 MB on the AMD Zen 5 this was measured on), so keeping them
/// there only evicts what is read again soon, the KV cache (24-29 MB of f32 K and V at
/// a 512-640-token context): on AMD, `NTA` made decode faster. On an Intel Xeon `NTA`
/// was the slow choice by far, since Intel's `prefetchnta` fills the L1 only, where a
/// line 8 KB ahead of its use is not sure to stay; `T0`, `T1` and `T2` were alike there.
/// Figures: docs/performance.md, "Why it is fast".
pub(super) fn nta_prefetch() -> bool {
    use std::sync::OnceLock;
    static NTA: OnceLock<bool> = OnceLock::new();
    *NTA.get_or_init(|| match std::env::var_os("FAK_PREFETCH_NTA") {
        Some(v) if v == "1" => true,
        Some(v) if v == "0" => false,
        _ => crate::cpu::tuned_for_amd(),
    })
}

/// Prefetches (`T0`) the `len` bytes of row data that start [`PREFETCH_BYTES`] (at
/// least `len`) past offset `at` of `w`: the one-row kernels (the K-quants') ask for the
/// row ahead as they start each row. Only where [`nta_prefetch`] is off (not on AMD,
/// whose hardware prefetchers this was not measured against). A hint only: past the end
/// of `w` it is simply wasted.
pub(super) fn prefetch_row_ahead(w: &[u8], at: usize, len: usize) {
    let ahead = w.as_ptr().wrapping_add(at + PREFETCH_BYTES.max(len));
    for off in (0..len).step_by(64) {
        // SAFETY: `prefetcht0` is SSE, part of every x86_64 CPU, and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(off) as *const i8) };
    }
}

/// Prefetches the `step` bytes (one block of every row of a group) of weights at `p`:
/// the 64-byte lines at `p`, `p + 64`, … up to `step` bytes, at least two;
/// non-temporally when `nta` ([`nta_prefetch`]). Over consecutive steps every line is
/// asked for (a step's last line that its start's alignment leaves out is the next
/// step's first). A hint only: it never faults, and past the end of the matrix it is
/// simply wasted.
#[inline(always)]
unsafe fn prefetch_weights(p: *const u8, step: usize, nta: bool) {
    for off in (0..step.max(128)).step_by(64) {
        let at = p.wrapping_add(off) as *const i8;
        if nta {
            _mm_prefetch::<_MM_HINT_NTA>(at);
        } else {
            _mm_prefetch::<_MM_HINT_T0>(at);
        }
    }
}

/// The 32-element types whose VNNI weight form is one `__m256i` (every one but Q4_0,
/// see `quant::has_avx512_vnni`; Q8_0 included): two rows ([`rows_pairs_512`]) fit one
/// 512-bit register.
pub(super) trait Tile512: Block32<VW = __m256i> {
    /// The activation block's 32 quants in the byte order of [`Block32::unpack_vnni`].
    ///
    /// # Safety
    /// AVX2, AVX-512VL and AVX512-VNNI (the caller has them enabled).
    unsafe fn vqs(a: &Self::VAct) -> __m256i;
    /// What `vpdpbusd` starts each lane from so that it ends at its exact `Σ w a`:
    /// `-Σ OFFSET a` (Q5_0), the form's `-128 Σ a` bias (Q8_0), or zero.
    ///
    /// # Safety
    /// AVX2, AVX-512VL and AVX512-VNNI (the caller has them enabled).
    unsafe fn vbase(a: &Self::VAct) -> __m256i;
    /// Two weight blocks' [`Block32::unpack_vnni512`] side by side, `wa`'s in the low
    /// half: the same bytes, with fewer instructions where the format allows.
    ///
    /// # Safety
    /// AVX2, F16C, AVX-512F/BW/VL and AVX512-VNNI (the caller has them enabled); `wa` and
    /// `wb` are whole weight blocks.
    #[inline(always)]
    unsafe fn unpack_pair512(wa: &[u8], wb: &[u8]) -> __m512i {
        unpack_pair_inserted::<Self>(wa, wb)
    }
}

/// [`Tile512::unpack_pair512`] by two [`Block32::unpack_vnni512`] and one insert.
///
/// # Safety
/// As [`Tile512::unpack_pair512`].
#[inline(always)]
unsafe fn unpack_pair_inserted<K: Tile512 + ?Sized>(wa: &[u8], wb: &[u8]) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(K::unpack_vnni512(wa)),
        K::unpack_vnni512(wb),
    )
}

/// [`nibbles`] of two 16-byte `qs` side by side (`qa`'s in the low half): each loaded
/// into both 128-bit lanes of its half, the upper lane of each shifted right by 4 bits
/// (per 16-bit word, as [`nibbles`] does), then masked to the low nibble.
///
/// # Safety
/// AVX-512F/BW; `qa` and `qb` valid for reading 16 bytes.
#[target_feature(enable = "avx2,avx512f,avx512bw")]
#[inline]
unsafe fn nibbles_pair512(qa: *const u8, qb: *const u8) -> __m512i {
    let a = _mm256_broadcastsi128_si256(_mm_loadu_si128(qa as *const __m128i));
    let b = _mm256_broadcastsi128_si256(_mm_loadu_si128(qb as *const __m128i));
    let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
    // 4 in the 16-bit words of lanes 1 and 3 (words 8..16 and 24..32), else 0.
    let shifts = _mm512_maskz_mov_epi16(0xff00_ff00, _mm512_set1_epi16(4));
    _mm512_and_si512(_mm512_srlv_epi16(both, shifts), _mm512_set1_epi8(0x0f))
}
