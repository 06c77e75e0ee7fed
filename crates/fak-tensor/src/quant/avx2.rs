//! AVX2 kernels of the quantized dot products. Each one computes the same exact
//! integer lane sums as its scalar reference in the type's file (`q4_0.rs` …
//! `q6_k.rs`; `maddubs` pairs adjacent bytes into i16, `madd` pairs adjacent i16 into
//! i32, so i32 lane `m` holds bytes `4m..4m+4` of a 32-byte chunk) and combines them
//! with the same float operations in the same order (module docs of `quant`).
//!
//! Saturation: `_mm256_maddubs_epi16` saturates its i16 pair sums, so every use keeps
//! the unsigned operand below 64 (|pair| ≤ 2 · 63 · 128 = 16128 < 32767). Offsets are
//! subtracted as a second `maddubs` against the constant offset (exact i16
//! subtraction), never by making the weight signed, so an activation quant of −128
//! is exact too. Q8_0 weights are signed and are widened to i16 instead; its AVX-VNNI
//! kernel reorders the bytes into the canonical lanes and offsets the weights by 128
//! (`VnniQ8_0`).
//!
//! Every function here requires AVX2 and F16C (`# Safety`) and that `w` holds exactly
//! `a.len()` blocks, which the dispatchers (`vec_dot_*` in each type's file,
//! `dispatch.rs`, `tiles.rs`) check before calling.

use super::{k4_scale_min, k_mins, BlockQ8K, BlockQ8_0, BlockQ8_1};
use crate::dot::reduce_lanes;
use std::arch::x86_64::*;
use std::borrow::Cow;

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

/// `acc + d * (l as f32)` lane-wise: step 2 of the canonical order.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn accumulate(acc: __m256, d: f32, l: __m256i) -> __m256 {
    _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(l)))
}

/// [`accumulate`] with the combined scale already in all eight lanes (the same
/// operations: the `f32` product `d` was rounded once, as a scalar product would be).
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn accumulate_v(acc: __m256, d: __m256, l: __m256i) -> __m256 {
    _mm256_add_ps(acc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(l)))
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
    /// Lane sums `L[m]` of an unpacked weight block against one activation block.
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
    unsafe fn vnni_acts(a: &[Self::Act]) -> Cow<'_, [Self::VAct]>;
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
    /// AVX2, F16C, AVX-VNNI, AVX-512BW and AVX-512VL (the caller has them enabled);
    /// `wb` is one whole weight block.
    #[inline(always)]
    unsafe fn unpack_vnni512(wb: &[u8]) -> Self::VW {
        Self::unpack_vnni(wb)
    }
    /// [`Block32::lanes_w`] with the AVX-VNNI instruction `vpdpbusd` (the same exact
    /// integer lane sums).
    ///
    /// # Safety
    /// AVX2, F16C and AVX-VNNI (the caller has them enabled).
    unsafe fn lanes_vnni(w: Self::VW, a: &Self::VAct) -> __m256i;
    /// The combined scale `wd · ad` in all eight lanes (`wdv` is `wd` in all eight, `ad`
    /// the activation block's [`ActBlock::scales`]`[0]`): one `f32` product, rounded
    /// once, whichever way it is computed.
    ///
    /// # Safety
    /// AVX2, F16C and AVX-VNNI (the caller has them enabled).
    #[inline(always)]
    unsafe fn vnni_scale(wd: f32, _wdv: __m256, _a: &Self::VAct, ad: f32) -> __m256 {
        _mm256_set1_ps(wd * ad)
    }
    /// The element of a 32-element chunk that byte `k` (`k < 4`) of canonical lane `m`
    /// holds: `4m + k` (element order; the nibble types), or Q8_0's `2m, 2m+1, 2m+16,
    /// 2m+17`.
    const LANE_ELEMENT: fn(usize, usize) -> usize = |m, k| 4 * m + k;
    /// The weight block's quants as signed bytes, offset removed (`q - 8` for Q4_0,
    /// `q - 16` for Q5_0), in canonical lane order: bytes `4m..4m+4` are the elements
    /// [`Block32::LANE_ELEMENT`] gives for lane `m`.
    ///
    /// # Safety
    /// AVX2 and F16C (the caller has them enabled); `wb` is one whole weight block.
    unsafe fn signed_quants(wb: &[u8]) -> __m256i;
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
    /// [`Block32::vnni_scale`] (for AVX2: `wd · ad` broadcast).
    ///
    /// # Safety
    /// The instruction set's features (the caller has them enabled).
    unsafe fn scale(wd: f32, wdv: __m256, a: &Self::A, ad: f32) -> __m256;
}

/// AVX2 lane sums (`maddubs`/`madd`).
pub(super) struct Avx2;
/// AVX-VNNI lane sums (`vpdpbusd`).
pub(super) struct Vnni;
/// [`Vnni`] in code compiled with AVX-512BW and AVX-512VL as well (32 vector registers
/// and `vpermw`; the same lane sums).
pub(super) struct Vnni512;

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
    #[inline(always)]
    unsafe fn scale(wd: f32, _wdv: __m256, _a: &K::Act, ad: f32) -> __m256 {
        _mm256_set1_ps(wd * ad)
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
        K::lanes_vnni(w, a)
    }
    #[inline(always)]
    unsafe fn scale(wd: f32, wdv: __m256, a: &K::VAct, ad: f32) -> __m256 {
        K::vnni_scale(wd, wdv, a, ad)
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
        K::lanes_vnni(w, a)
    }
    #[inline(always)]
    unsafe fn scale(wd: f32, wdv: __m256, a: &K::VAct, ad: f32) -> __m256 {
        K::vnni_scale(wd, wdv, a, ad)
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
    K::vnni_acts(a)
}

/// `vpdpbusd` lane sums of unsigned `w` bytes times signed `a` bytes: lane `m` =
/// `Σ_{k<4} w[4m+k] a[4m+k]` in `i32`, exactly `quads(pairs(w, a))` whenever `pairs`
/// does not saturate (always, for the weights here: unsigned operand below 64).
#[inline(always)]
unsafe fn dp(w: __m256i, a: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, a)
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

/// Prefetches the `step` bytes (one block of every row of a group, at most 192) of
/// weights at `p`: 64-byte lines at `p`, `p + 64` and, past 128 bytes, `p + 128`;
/// non-temporally when `nta` ([`nta_prefetch`]). A hint only: it never faults, and
/// past the end of the matrix it is simply wasted.
#[inline(always)]
unsafe fn prefetch_weights(p: *const u8, step: usize, nta: bool) {
    if nta {
        _mm_prefetch::<_MM_HINT_NTA>(p as *const i8);
        _mm_prefetch::<_MM_HINT_NTA>(p.wrapping_add(64) as *const i8);
        if step > 128 {
            _mm_prefetch::<_MM_HINT_NTA>(p.wrapping_add(128) as *const i8);
        }
    } else {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64) as *const i8);
        if step > 128 {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(128) as *const i8);
        }
    }
}

pub(super) struct Q4_0;
pub(super) struct Q4_1;
pub(super) struct Q5_0;
pub(super) struct Q5_1;
pub(super) struct Q8_0;

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
    unsafe fn vnni_acts(a: &[BlockQ8_0]) -> Cow<'_, [BlockQ8_0]> {
        Cow::Borrowed(a)
    }
    #[inline(always)]
    unsafe fn unpack_vnni(wb: &[u8]) -> __m256i {
        Self::unpack(wb)
    }
    #[inline(always)]
    unsafe fn lanes_vnni(w: __m256i, a: &BlockQ8_0) -> __m256i {
        let aq = load32(a.qs.as_ptr() as *const u8);
        _mm256_sub_epi32(dp(w, aq), dp(_mm256_set1_epi8(8), aq))
    }
    #[inline(always)]
    unsafe fn signed_quants(wb: &[u8]) -> __m256i {
        _mm256_sub_epi8(Self::unpack(wb), _mm256_set1_epi8(8))
    }
}

impl Block32 for Q4_1 {
    type Act = BlockQ8_1;
    const BYTES: usize = 20;
    const HAS_MIN: bool = true;
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
    unsafe fn vnni_acts(a: &[BlockQ8_1]) -> Cow<'_, [BlockQ8_1]> {
        Cow::Borrowed(a)
    }
    #[inline(always)]
    unsafe fn unpack_vnni(wb: &[u8]) -> __m256i {
        Self::unpack(wb)
    }
    #[inline(always)]
    unsafe fn lanes_vnni(w: __m256i, a: &BlockQ8_1) -> __m256i {
        dp(w, load32(a.qs.as_ptr() as *const u8))
    }
    #[inline(always)]
    unsafe fn signed_quants(wb: &[u8]) -> __m256i {
        Self::unpack(wb)
    }
}

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
    unsafe fn vnni_acts(a: &[BlockQ8_0]) -> Cow<'_, [BlockQ8_0]> {
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
    unsafe fn lanes_vnni(w: __m256i, a: &BlockQ8_0) -> __m256i {
        let aq = load32(a.qs.as_ptr() as *const u8);
        _mm256_sub_epi32(dp(w, aq), dp(_mm256_set1_epi8(16), aq))
    }
    #[inline(always)]
    unsafe fn signed_quants(wb: &[u8]) -> __m256i {
        _mm256_sub_epi8(Self::unpack(wb), _mm256_set1_epi8(16))
    }
}

impl Block32 for Q5_1 {
    type Act = BlockQ8_1;
    const BYTES: usize = 24;
    const HAS_MIN: bool = true;
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
    unsafe fn vnni_acts(a: &[BlockQ8_1]) -> Cow<'_, [BlockQ8_1]> {
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
    unsafe fn lanes_vnni(w: __m256i, a: &BlockQ8_1) -> __m256i {
        dp(w, load32(a.qs.as_ptr() as *const u8))
    }
    #[inline(always)]
    unsafe fn signed_quants(wb: &[u8]) -> __m256i {
        Self::unpack(wb)
    }
}

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
    unsafe fn vnni_acts(a: &[BlockQ8_0]) -> Cow<'_, [VnniQ8_0]> {
        let mut v = Vec::with_capacity(a.len());
        for b in a {
            let qs = q8_0_vnni_order(load32(b.qs.as_ptr() as *const u8));
            // 128 · Σ_{k<4} qs[4m+k]: |sum| <= 4 · 128 · 128 = 65536, exact in i32.
            let bias = _mm256_sub_epi32(_mm256_setzero_si256(), dp(_mm256_set1_epi8(-128), qs));
            let d = _mm256_set1_ps(h2f(b.d));
            v.push(VnniQ8_0 { qs, bias, d });
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
    /// order, i.e. over elements `2m, 2m+1, 2m+16, 2m+17`: exactly `L[m]`. Every
    /// product `(w + 128) a` lies in `[-32640, 32385]` and every partial sum within
    /// `±2^18`, so `vpdpbusd` (which does not saturate) neither saturates nor wraps,
    /// for any weight and activation bytes, −128 included.
    #[inline(always)]
    unsafe fn lanes_vnni(w: __m256i, a: &VnniQ8_0) -> __m256i {
        _mm256_dpbusd_avx_epi32(a.bias, w, a.qs)
    }
    /// `wdv · a.d` lane-wise: the product `wd · ad` of [`ActBlock::scales`] (`a.d` is
    /// the same F16C widening, kept broadcast), one multiply from memory instead of a
    /// scalar multiply and a broadcast per weight block and token.
    #[inline(always)]
    unsafe fn vnni_scale(_wd: f32, wdv: __m256, a: &VnniQ8_0, _ad: f32) -> __m256 {
        _mm256_mul_ps(wdv, a.d)
    }
    const LANE_ELEMENT: fn(usize, usize) -> usize = |m, k| 2 * m + (k & 1) + 16 * (k >> 1);
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
pub(super) struct VnniQ8_0 {
    qs: __m256i,
    bias: __m256i,
    /// `f16(d_a)` in all eight lanes.
    d: __m256,
}

/// The 32 quants of a Q8_0 block reordered so that bytes `4m..4m+4` are elements
/// `2m, 2m+1, 2m+16, 2m+17`: the elements of the canonical lane `m` (module docs of
/// `quant`), where `vpdpbusd` sums them. In 16-bit words: word `2m` = old word `m`,
/// word `2m+1` = old word `m+8`.
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

/// `out[r] = dot(row r, a)` for `R` consecutive rows of `row_bytes` each, interleaved
/// so that the `R` independent float chains overlap; each row's own operations and
/// their order are exactly those of the single-row kernel (`R = 1`). `sc` holds
/// [`act_scales`] of `a`.
///
/// # Safety
/// AVX2 and F16C; `w.len() >= R * row_bytes`, `row_bytes == K::BYTES * a.len()`,
/// `sc.len() == a.len()`, `out.len() >= R`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn rows<K: Block32, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &[K::Act],
    sc: &[[f32; 2]],
    out: &mut [f32],
) {
    rows_body::<K, Avx2, R>(w, row_bytes, a, sc, out)
}

/// [`rows`] with AVX-VNNI lane sums (the same bits); `a` is [`vnni_acts`] of the
/// activation row.
///
/// # Safety
/// As [`rows`], and AVX-VNNI.
#[target_feature(enable = "avx2,f16c,avxvnni")]
pub(super) unsafe fn rows_vnni<K: Block32, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &[K::VAct],
    sc: &[[f32; 2]],
    out: &mut [f32],
) {
    rows_body::<K, Vnni, R>(w, row_bytes, a, sc, out)
}

#[inline(always)]
unsafe fn rows_body<K: Block32, I: Isa<K>, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &[I::A],
    sc: &[[f32; 2]],
    out: &mut [f32],
) {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summ = [0f32; R];
    // The weights ahead follow these in memory; ask for the bytes [`PREFETCH_BYTES`]
    // (at least one group) ahead at the pace this group is consumed, so over a
    // chunk of groups every line is requested well before it is read (a hint only: a
    // prefetch never faults, and past the end of the matrix it is simply wasted).
    let next = w.as_ptr().wrapping_add((R * row_bytes).max(PREFETCH_BYTES));
    let nta = nta_prefetch();
    let step = R * K::BYTES;
    for ((b, ab), &[ad, as_]) in a.iter().enumerate().zip(sc) {
        prefetch_weights(next.wrapping_add(b * step), step, nta);
        for r in 0..R {
            let at = r * row_bytes + b * K::BYTES;
            let wb = &w[at..at + K::BYTES];
            let (wd, wm) = K::wscales(wb);
            let l = I::lanes(I::unpack(wb), ab);
            acc[r] = accumulate_v(acc[r], I::scale(wd, _mm256_set1_ps(wd), ab, ad), l);
            if K::HAS_MIN {
                summ[r] += wm * as_;
            }
        }
    }
    for r in 0..R {
        out[r] = if K::HAS_MIN {
            hsum(acc[r]) + summ[r]
        } else {
            hsum(acc[r])
        };
    }
}

/// The 32-element types whose VNNI weight form is one `__m256i` (every one but Q4_0,
/// see `quant::has_avx512_vnni`; Q8_0 included): two rows ([`rows_pairs_512`]) or two
/// tokens ([`rows_tokens_512`]) fit one 512-bit register.
pub(super) trait Tile512: Block32<VW = __m256i> {
    /// The activation block's 32 quants in the byte order of [`Block32::unpack_vnni`].
    ///
    /// # Safety
    /// AVX2 and AVX-VNNI (the caller has them enabled).
    unsafe fn vqs(a: &Self::VAct) -> __m256i;
    /// What `vpdpbusd` starts each lane from so that it ends at the exact `L[m]`:
    /// `-Σ OFFSET a` (Q5_0), the form's `-128 Σ a` bias (Q8_0), or zero.
    ///
    /// # Safety
    /// AVX2 and AVX-VNNI (the caller has them enabled).
    unsafe fn vbase(a: &Self::VAct) -> __m256i;
    /// Two weight blocks' [`Block32::unpack_vnni512`] side by side, `wa`'s in the low
    /// half: the same bytes, with fewer instructions where the format allows.
    ///
    /// # Safety
    /// AVX2, F16C, AVX-VNNI, AVX-512F/BW/VL (the caller has them enabled); `wa` and
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

/// [`Tile512`] for a type whose VNNI activation form is its plain block, with the
/// weight offset (if any) taken off through the `vpdpbusd` start value.
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
                        dp(_mm256_set1_epi8(o), load32(a.qs_ptr())),
                    ),
                    None => _mm256_setzero_si256(),
                }
            }
        }
    };
}

tile512_plain!(Q4_0, BlockQ8_0, Some(8), Some(2));
tile512_plain!(Q4_1, BlockQ8_1, None, Some(4));
tile512_plain!(Q5_1, BlockQ8_1, None);
tile512_plain!(Q5_0, BlockQ8_0, Some(16));

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

/// [`rows`] for four rows with 512-bit registers, two rows per register: each block's
/// lane sums, their conversion, the scale multiply and the accumulate are done for two
/// rows by one instruction each. Every lane performs exactly the operations of the
/// single-row kernel in the same order (an exact integer lane sum; `d = wd * ad`
/// rounded once in `f32`; `acc + d * L` as a rounded multiply then a rounded add), and
/// each row's eight lanes are reduced by the same [`hsum`], so the results are the same
/// bits as [`rows`] (and as the scalar reference).
///
/// A row pair's two f16 scale words are widened by one instruction and multiplied by
/// the activation's `[ad, as, ad, as]` by one more, and the two rows' min sums (Q4_1,
/// Q5_1) run in two lanes of one register, each lane the scalar code's rounded product
/// and rounded add in the same order; Q4_0 and Q4_1 unpack both rows' nibbles at once
/// ([`Tile512::unpack_pair512`]); the block reads are bounds-checked once, up front.
/// That is fewer instructions per block than per-row scalar scales, separate unpacking
/// and per-read checks, and measured faster in cache and in decode (docs/performance.md,
/// "Why it is fast").
///
/// `a` is the activation row in its VNNI form ([`vnni_acts`]).
///
/// # Safety
/// As [`rows`] with `R = 4`, and AVX-VNNI, AVX-512F/BW/DQ/VL and AVX512-VNNI.
#[target_feature(enable = "avx2,f16c,avxvnni,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(super) unsafe fn rows_pairs_512<K: Tile512>(
    w: &[u8],
    row_bytes: usize,
    a: &[K::VAct],
    sc: &[[f32; 2]],
    out: &mut [f32],
) {
    // Checked once here, so the block reads below need no bounds checks of their own.
    assert!(
        w.len() >= 4 * row_bytes
            && row_bytes >= a.len() * K::BYTES
            && out.len() >= 4
            && sc.len() == a.len()
    );
    let mut acc = [_mm512_setzero_ps(); 2];
    // Per pair: lanes 1 and 3 are the two rows' running `summ` (lanes 0 and 2 unused).
    let mut summ = [_mm_setzero_ps(); 2];
    // Lanes 0..8 take element 0 of a scale vector (row a's `d`), lanes 8..16 element 2
    // (row b's).
    let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    let next = w.as_ptr().wrapping_add((4 * row_bytes).max(PREFETCH_BYTES));
    let nta = nta_prefetch();
    let step = 4 * K::BYTES;
    for ((b, ab), sc2) in a.iter().enumerate().zip(sc) {
        prefetch_weights(next.wrapping_add(b * step), step, nta);
        let aq = _mm512_broadcast_i64x4(K::vqs(ab));
        let base = _mm512_broadcast_i64x4(K::vbase(ab));
        // `[ad, as, ad, as]`.
        let act = _mm_castpd_ps(_mm_loaddup_pd(sc2.as_ptr() as *const f64));
        for ((pair, acc), summ) in acc.iter_mut().enumerate().zip(&mut summ) {
            let at_a = 2 * pair * row_bytes + b * K::BYTES;
            let at_b = at_a + row_bytes;
            // SAFETY: rows 0..4 of `row_bytes` each lie in `w`, and block `b < a.len()`
            // ends within its row, by the assertion above.
            let (wa, wb) = unsafe {
                (
                    w.get_unchecked(at_a..at_a + K::BYTES),
                    w.get_unchecked(at_b..at_b + K::BYTES),
                )
            };
            let wq = K::unpack_pair512(wa, wb);
            // Exact: the base and every product sum fit `i32` (as `lanes_vnni`).
            let l = _mm512_dpbusd_epi32(base, wq, aq);
            // `[da, ma, db, mb]` widened from f16 at once (`m` zero for the types without
            // a minimum), times `[ad, as, ad, as]`: each lane the one rounded product
            // the scalar code forms.
            // Without a minimum, the bytes after `d` are quants: zeroed rather than
            // widened as f16 (random bits, sometimes subnormal or NaN, which made the
            // conversion slow).
            let keep = if K::HAS_MIN { u32::MAX } else { 0xffff };
            let sa = u32::from_le_bytes([wa[0], wa[1], wa[2], wa[3]]) & keep;
            let sb = u32::from_le_bytes([wb[0], wb[1], wb[2], wb[3]]) & keep;
            let h = _mm_unpacklo_epi32(_mm_cvtsi32_si128(sa as i32), _mm_cvtsi32_si128(sb as i32));
            let prod = _mm_mul_ps(_mm_cvtph_ps(h), act);
            let d = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(prod));
            *acc = _mm512_add_ps(*acc, _mm512_mul_ps(d, _mm512_cvtepi32_ps(l)));
            if K::HAS_MIN {
                *summ = _mm_add_ps(*summ, prod);
            }
        }
    }
    for ((pair, acc), summ) in acc.iter().enumerate().zip(&summ) {
        let halves = [
            _mm512_castps512_ps256(*acc),
            _mm512_extractf32x8_ps::<1>(*acc),
        ];
        let mut m = [0f32; 4];
        _mm_storeu_ps(m.as_mut_ptr(), *summ);
        for (h, v) in halves.into_iter().enumerate() {
            let r = 2 * pair + h;
            out[r] = if K::HAS_MIN {
                hsum(v) + m[2 * h + 1]
            } else {
                hsum(v)
            };
        }
    }
}

/// [`rows_tokens`] for `R` rows and `P` pairs of tokens with 512-bit registers: one
/// register holds a row's eight lanes for two tokens, so each block's lane sums,
/// conversion, scale multiply and accumulate are done for two tokens by one
/// instruction each, and the weight block is unpacked once for all `2P` tokens. Every
/// lane performs exactly the single-row kernel's operations in its order (`d = wd *
/// ad` rounded once, then a rounded multiply and a rounded add), and each (row, token)
/// is reduced by the same [`hsum`]: the same bits as [`rows`] for each token alone.
/// `out[p][h][r]` is row `r` times token `acts[p][h]` (in the VNNI form,
/// [`vnni_acts`]).
///
/// # Safety
/// As [`rows_tokens`] (for every `acts[p][h]`), and AVX-VNNI, AVX-512F/BW/DQ/VL and
/// AVX512-VNNI.
#[target_feature(enable = "avx2,f16c,avxvnni,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(super) unsafe fn rows_tokens_512<K: Tile512, const R: usize, const P: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: [[&[K::VAct]; 2]; P],
    scs: [[&[[f32; 2]]; 2]; P],
    out: &mut [[[f32; R]; 2]; P],
) {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    let mut summ = [[[0f32; 2]; P]; R];
    let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let nb = acts[0][0].len();
    for b in 0..nb {
        let mut aq = [_mm512_setzero_si512(); P];
        let mut ad = [_mm512_setzero_ps(); P];
        let mut base = [_mm512_setzero_si512(); P];
        for p in 0..P {
            let [a0, a1] = acts[p];
            aq[p] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(K::vqs(&a0[b])), K::vqs(&a1[b]));
            base[p] =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(K::vbase(&a0[b])), K::vbase(&a1[b]));
            let d2 = _mm_unpacklo_ps(_mm_set_ss(scs[p][0][b][0]), _mm_set_ss(scs[p][1][b][0]));
            ad[p] = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(d2));
        }
        for r in 0..R {
            let at = r * row_bytes + b * K::BYTES;
            let wb = &w[at..at + K::BYTES];
            let wq = _mm512_broadcast_i64x4(K::unpack_vnni512(wb));
            let (wd, wm) = K::wscales(wb);
            let wdv = _mm512_set1_ps(wd);
            for p in 0..P {
                // Exact: the base and every product sum fit `i32` (as `lanes_vnni`).
                let l = _mm512_dpbusd_epi32(base[p], wq, aq[p]);
                let d = _mm512_mul_ps(wdv, ad[p]);
                acc[r][p] = _mm512_add_ps(acc[r][p], _mm512_mul_ps(d, _mm512_cvtepi32_ps(l)));
                if K::HAS_MIN {
                    summ[r][p][0] += wm * scs[p][0][b][1];
                    summ[r][p][1] += wm * scs[p][1][b][1];
                }
            }
        }
    }
    for r in 0..R {
        for p in 0..P {
            let v = acc[r][p];
            let halves = [_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v)];
            for (h, v) in halves.into_iter().enumerate() {
                out[p][h][r] = if K::HAS_MIN {
                    hsum(v) + summ[r][p][h]
                } else {
                    hsum(v)
                };
            }
        }
    }
}

/// `out[t][r] = dot(row r, acts[t])` for `R` consecutive rows and `T` activation rows
/// (tokens): each weight block is unpacked once and used for all `T` tokens. Every
/// (row, token) pair is accumulated with exactly the operations, in the order, of the
/// single-row kernel ([`rows`] with `R = 1`), so the results are the same bits.
/// `scs[t]` holds [`act_scales`] of `acts[t]`.
///
/// # Safety
/// AVX2 and F16C; `w.len() >= R * row_bytes`, `row_bytes == K::BYTES * acts[t].len()`
/// and `scs[t].len() == acts[t].len()` for every `t`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn rows_tokens<K: Block32, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: [&[K::Act]; T],
    scs: [&[[f32; 2]]; T],
    out: &mut [[f32; R]; T],
) {
    rows_tokens_body::<K, Avx2, R, T>(w, row_bytes, acts, scs, out)
}

/// [`rows_tokens`] with AVX-VNNI lane sums (the same bits); `acts[t]` is
/// [`vnni_acts`] of token `t`'s activation row.
///
/// # Safety
/// As [`rows_tokens`], and AVX-VNNI.
#[target_feature(enable = "avx2,f16c,avxvnni")]
pub(super) unsafe fn rows_tokens_vnni<K: Block32, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: [&[K::VAct]; T],
    scs: [&[[f32; 2]]; T],
    out: &mut [[f32; R]; T],
) {
    rows_tokens_body::<K, Vnni, R, T>(w, row_bytes, acts, scs, out)
}

/// [`rows_tokens_vnni`] compiled with AVX-512BW and AVX-512VL as well: the same
/// operations on the same values (so the same bits), with 32 vector registers to keep
/// them in and Q8_0's reordering in one instruction ([`Block32::unpack_vnni512`]).
///
/// # Safety
/// As [`rows_tokens`], and AVX-VNNI, AVX-512BW and AVX-512VL.
#[target_feature(enable = "avx2,f16c,avxvnni,avx512bw,avx512vl")]
pub(super) unsafe fn rows_tokens_vnni512<K: Block32, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: [&[K::VAct]; T],
    scs: [&[[f32; 2]]; T],
    out: &mut [[f32; R]; T],
) {
    rows_tokens_body::<K, Vnni512, R, T>(w, row_bytes, acts, scs, out)
}

#[inline(always)]
unsafe fn rows_tokens_body<K: Block32, I: Isa<K>, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: [&[I::A]; T],
    scs: [&[[f32; 2]]; T],
    out: &mut [[f32; R]; T],
) {
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    let mut summ = [[0f32; R]; T];
    let nb = acts[0].len();
    #[allow(clippy::needless_range_loop)] // `b` indexes every token's blocks
    for b in 0..nb {
        for r in 0..R {
            let at = r * row_bytes + b * K::BYTES;
            let wb = &w[at..at + K::BYTES];
            let wq = I::unpack(wb);
            let (wd, wm) = K::wscales(wb);
            let wdv = _mm256_set1_ps(wd);
            for t in 0..T {
                let ab = &acts[t][b];
                let [ad, as_] = scs[t][b];
                let l = I::lanes(wq, ab);
                acc[t][r] = accumulate_v(acc[t][r], I::scale(wd, wdv, ab, ad), l);
                if K::HAS_MIN {
                    summ[t][r] += wm * as_;
                }
            }
        }
    }
    for t in 0..T {
        for r in 0..R {
            out[t][r] = if K::HAS_MIN {
                hsum(acc[t][r]) + summ[t][r]
            } else {
                hsum(acc[t][r])
            };
        }
    }
}

/// One row: [`rows`] with `R = 1`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == K::BYTES * a.len()`.
#[target_feature(enable = "avx2,f16c")]
unsafe fn one<K: Block32>(w: &[u8], a: &[K::Act]) -> f32
where
    K::Act: ActBlock,
{
    let mut out = [0f32];
    rows::<K, 1>(w, w.len(), a, &act_scales(a), &mut out);
    out[0]
}

/// See `vec_dot_q4_0_q8_0_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 18 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dot_q4_0_q8_0(w: &[u8], a: &[BlockQ8_0]) -> f32 {
    one::<Q4_0>(w, a)
}

/// See `vec_dot_q4_1_q8_1_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 20 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dot_q4_1_q8_1(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    one::<Q4_1>(w, a)
}

/// See `vec_dot_q5_0_q8_0_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 22 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dot_q5_0_q8_0(w: &[u8], a: &[BlockQ8_0]) -> f32 {
    one::<Q5_0>(w, a)
}

/// See `vec_dot_q5_1_q8_1_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 24 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dot_q5_1_q8_1(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    one::<Q5_1>(w, a)
}

/// See `vec_dot_q8_0_q8_0_ref` (lane `m` = elements `2m, 2m+1, 2m+16, 2m+17`).
///
/// # Safety
/// AVX2 and F16C; `w.len() == 34 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dot_q8_0_q8_0(w: &[u8], a: &[BlockQ8_0]) -> f32 {
    one::<Q8_0>(w, a)
}

/// See `vec_dot_q4_k_q8_k_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 144 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dot_q4_k_q8_k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let [v] = k_tokens_one(w, a, KQuant::Q4);
    v
}

/// See `vec_dot_q5_k_q8_k_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 176 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dot_q5_k_q8_k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let [v] = k_tokens_one(w, a, KQuant::Q5);
    v
}

/// See `vec_dot_q6_k_q8_k_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 210 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dot_q6_k_q8_k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let [v] = k_tokens_one(w, a, KQuant::Q6);
    v
}

/// Q4_K or Q5_K (they share everything but the quant unpacking: the 4-bit quants start
/// at byte `qs_at` of a block of `bytes`, and Q5_K's fifth bits are the 32 bytes at
/// `qh_at`, bit `g` of byte `lane` for group `g`) of one weight row with `T` tokens'
/// activations, in the canonical order of `vec_dot_q4_k_q8_k_ref`. Each super-block's
/// quants and scales are unpacked once for the `T` tokens (a prefill reads every weight
/// row for many tokens); every token gets the same operations in the same order (the
/// integer lane sums, `d = ad · wd` and `dmin = ad · wmin` rounded once, [`accumulate`],
/// the minimum sum, [`hsum`]), so each result is the bits of `T = 1` (the one-token
/// kernels [`dot_q4_k_q8_k`], [`dot_q5_k_q8_k`]).
///
/// # Safety
/// AVX2 and F16C; `w.len() == bytes * a[t].len()` for every `t`; `qs_at + 128 <= bytes`,
/// `qh_at + 32 <= bytes`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn dot_k45_tokens<const T: usize>(
    w: &[u8],
    a: [&[BlockQ8K]; T],
    bytes: usize,
    qs_at: usize,
    qh_at: Option<usize>,
) -> [f32; T] {
    let mut acc = [_mm256_setzero_ps(); T];
    let mut summ = [0f32; T];
    for (b, wb) in w.chunks_exact(bytes).enumerate() {
        let (sc, mn) = k4_scale_min(&wb[4..16]);
        let q = unpack_k45(wb, qs_at, qh_at);
        let (wd, wmin) = (f16_at(wb, 0), f16_at(wb, 2));
        for t in 0..T {
            let ab = &a[t][b];
            let aq = ab.qs.as_ptr() as *const u8;
            let mut sumi = _mm256_setzero_si256();
            for c in 0..4 {
                let p0 = _mm256_madd_epi16(
                    pairs(q[2 * c], load32(aq.add(64 * c))),
                    _mm256_set1_epi16(sc[2 * c] as i16),
                );
                let p1 = _mm256_madd_epi16(
                    pairs(q[2 * c + 1], load32(aq.add(64 * c + 32))),
                    _mm256_set1_epi16(sc[2 * c + 1] as i16),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
            }
            acc[t] = accumulate(acc[t], ab.d * wd, sumi);
            summ[t] += ab.d * wmin * k_mins(&mn, &ab.bsums) as f32;
        }
    }
    std::array::from_fn(|t| hsum(acc[t]) - summ[t])
}

/// Q6_K (`vec_dot_q6_k_q8_k_ref`'s order) of one weight row with `T` tokens'
/// activations, each super-block's quants unpacked once for the `T` tokens; every
/// token's operations the same as with `T = 1` ([`dot_q6_k_q8_k`]), so the same bits.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 210 * a[t].len()` for every `t`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn dot_q6_k_tokens<const T: usize>(w: &[u8], a: [&[BlockQ8K]; T]) -> [f32; T] {
    let mut acc = [_mm256_setzero_ps(); T];
    for (b, wb) in w.chunks_exact(210).enumerate() {
        let q = unpack_q6_k(wb);
        // The sub-block scales as `madd` multipliers: kept in registers for several
        // tokens, made where used for one (there the registers hold the quants).
        let scale = |c: usize| {
            let s0 = (wb[192 + 2 * c] as i8) as i16;
            let s1 = (wb[192 + 2 * c + 1] as i8) as i16;
            _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0))
        };
        let kept: [__m256i; 8] = if T > 1 {
            std::array::from_fn(scale)
        } else {
            [_mm256_setzero_si256(); 8]
        };
        let wd = f16_at(wb, 208);
        for t in 0..T {
            let ab = &a[t][b];
            let aq = ab.qs.as_ptr() as *const u8;
            let mut sumi = _mm256_setzero_si256();
            for c in 0..8 {
                let p = pairs_off(q[c], load32(aq.add(32 * c)), 32);
                let scales = if T > 1 { kept[c] } else { scale(c) };
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scales));
            }
            acc[t] = accumulate(acc[t], ab.d * wd, sumi);
        }
    }
    std::array::from_fn(|t| hsum(acc[t]))
}

/// The 256 quants of one Q4_K/Q5_K super-block `wb` as unsigned bytes in element
/// order: register `g` holds elements `32g..32g + 32` (group `g`, the nibble `g % 2` of
/// the 32 bytes at `qs_at + 32 (g / 2)`, and for Q5_K bit `g` of the 32 bytes at
/// `qh_at` as bit 4; `vec_dot_q4_k_q8_k_ref`, `vec_dot_q5_k_q8_k_ref`).
///
/// # Safety
/// AVX2 and F16C; `qs_at + 128 <= wb.len()`, `qh_at + 32 <= wb.len()`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn unpack_k45(wb: &[u8], qs_at: usize, qh_at: Option<usize>) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0f);
    let sixteen = _mm256_set1_epi8(0x10);
    let qh = match qh_at {
        Some(at) => load32(wb[at..at + 32].as_ptr()),
        None => _mm256_setzero_si256(),
    };
    let mut q = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        let raw = load32(wb[qs_at + 32 * c..qs_at + 32 * c + 32].as_ptr());
        let mut q0 = _mm256_and_si256(raw, m4);
        let mut q1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        if qh_at.is_some() {
            let b0 = _mm256_set1_epi8((1u8 << (2 * c)) as i8);
            let b1 = _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8);
            let h0 = _mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0);
            let h1 = _mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1);
            q0 = _mm256_or_si256(q0, _mm256_and_si256(h0, sixteen));
            q1 = _mm256_or_si256(q1, _mm256_and_si256(h1, sixteen));
        }
        q[2 * c] = q0;
        q[2 * c + 1] = q1;
    }
    q
}

/// The 256 quants of one Q6_K super-block `wb` (210 bytes) as unsigned bytes in
/// element order, the offset 32 not yet removed: register `c` holds elements
/// `32c..32c + 32` (`vec_dot_q6_k_q8_k_ref`'s unpacking).
///
/// # Safety
/// AVX2 and F16C; `wb.len() >= 192`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn unpack_q6_k(wb: &[u8]) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(0x03);
    let mut q = [_mm256_setzero_si256(); 8];
    for (c, qc) in q.iter_mut().enumerate() {
        let (half, j) = (c / 4, c % 4);
        let at = 64 * half + 32 * (j % 2);
        let ql = load32(wb[at..at + 32].as_ptr());
        let lo = if j < 2 {
            _mm256_and_si256(ql, m4)
        } else {
            _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4)
        };
        let qh = load32(wb[128 + 32 * half..160 + 32 * half].as_ptr());
        let hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j as i32)), m2);
        *qc = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    q
}

/// A K-quant product of `rows` weight rows (`rb` bytes each, of the type `kind`) with
/// `acts.len()` tokens, into `out[t][r]` (one slice of `rows` per token): four tokens
/// at a time against every row ([`dot_k45_tokens`], [`dot_q6_k_tokens`]), the rest one
/// by one; each result the bits of the one-token dot.
///
/// # Safety
/// AVX2 and F16C; `w.len() == rows * rb`, every `acts[t]` of `rb / bytes` blocks,
/// `out` holds at least `acts.len()` slices of at least `rows` outputs.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn k_tokens(
    w: &[u8],
    rb: usize,
    acts: &[&[BlockQ8K]],
    kind: KQuant,
    out: &mut [&mut [f32]],
) {
    k_tokens_by::<4>(w, rb, acts, kind, out)
}

/// [`k_tokens`] eight tokens at a time, in code compiled with AVX-512VL too, whose 32
/// vector registers hold a super-block's unpacked quants and eight tokens' sums.
///
/// # Safety
/// As [`k_tokens`], and AVX-512F/BW/VL.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn k_tokens_wide(
    w: &[u8],
    rb: usize,
    acts: &[&[BlockQ8K]],
    kind: KQuant,
    out: &mut [&mut [f32]],
) {
    k_tokens_by::<8>(w, rb, acts, kind, out)
}

/// [`k_tokens`] with `B` tokens at a time.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn k_tokens_by<const B: usize>(
    w: &[u8],
    rb: usize,
    acts: &[&[BlockQ8K]],
    kind: KQuant,
    out: &mut [&mut [f32]],
) {
    let mut t = 0;
    while t < acts.len() {
        let take = (acts.len() - t).min(B);
        for (r, wr) in w.chunks_exact(rb).enumerate() {
            if take == B {
                let ab: [&[BlockQ8K]; B] = std::array::from_fn(|i| acts[t + i]);
                let res = match kind {
                    KQuant::Q6 => dot_q6_k_tokens::<B>(wr, ab),
                    KQuant::Q45 {
                        bytes,
                        qs_at,
                        qh_at,
                    } => dot_k45_tokens::<B>(wr, ab, bytes, qs_at, qh_at),
                };
                for (i, v) in res.into_iter().enumerate() {
                    out[t + i][r] = v;
                }
            } else {
                for i in 0..take {
                    let [v] = k_tokens_one(wr, acts[t + i], kind);
                    out[t + i][r] = v;
                }
            }
        }
        t += take;
    }
}

/// One token's K-quant dot with `kind`'s kernel.
///
/// # Safety
/// As [`dot_k45_tokens`] / [`dot_q6_k_tokens`] with `T = 1`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn k_tokens_one(w: &[u8], a: &[BlockQ8K], kind: KQuant) -> [f32; 1] {
    match kind {
        KQuant::Q6 => dot_q6_k_tokens::<1>(w, [a]),
        KQuant::Q45 {
            bytes,
            qs_at,
            qh_at,
        } => dot_k45_tokens::<1>(w, [a], bytes, qs_at, qh_at),
    }
}

/// Which K-quant [`k_tokens`] runs.
#[derive(Clone, Copy, Debug)]
pub(super) enum KQuant {
    /// Q4_K or Q5_K: super-block bytes, where the 4-bit quants start, Q5_K's fifth bits
    /// ([`dot_k45_tokens`]).
    Q45 {
        bytes: usize,
        qs_at: usize,
        qh_at: Option<usize>,
    },
    /// Q6_K.
    Q6,
}

impl KQuant {
    /// Q4_K: 144-byte super-blocks, the quants from byte 16.
    pub(super) const Q4: KQuant = KQuant::Q45 {
        bytes: 144,
        qs_at: 16,
        qh_at: None,
    };
    /// Q5_K: 176-byte super-blocks, the fifth bits at byte 16, the quants from byte 48.
    pub(super) const Q5: KQuant = KQuant::Q45 {
        bytes: 176,
        qs_at: 48,
        qh_at: Some(16),
    };
}

/// `Σ qs` of 32 signed quants, exactly: `vpsadbw` sums the unsigned bytes `q + 128` in
/// four groups of eight (each at most 2,040, no overflow), less `32 · 128`.
///
/// # Safety
/// AVX2 (the caller has it enabled).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn sum_quants(qs: &[i8; 32]) -> i32 {
    let v = _mm256_xor_si256(load32(qs.as_ptr().cast()), _mm256_set1_epi8(-128));
    let s = _mm256_sad_epu8(v, _mm256_setzero_si256());
    let s = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi64(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(s) - 32 * 128
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
pub(super) unsafe fn q8_block(x: &[f32]) -> Option<(f32, [i8; 32])> {
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
    let mut l = [0f32; 8];
    _mm256_storeu_ps(l.as_mut_ptr(), m);
    let amax = l.iter().fold(0f32, |m, &v| m.max(v));
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
pub(super) unsafe fn quantize_q8_0(x: &[f32], out: &mut Vec<BlockQ8_0>) {
    out.reserve(x.len() / 32);
    for c in x.chunks_exact(32) {
        let (d, qs) = q8_block(c).unwrap_or_else(|| super::q8_block_ref(c));
        out.push(BlockQ8_0 {
            d: super::f32_to_f16(d),
            qs,
        });
    }
}

/// `quant::quantize_q8_1` (same bits), appending to `out`: as [`quantize_q8_0`], and `s` from
/// [`sum_quants`].
///
/// # Safety
/// As [`quantize_q8_0`].
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn quantize_q8_1(x: &[f32], out: &mut Vec<BlockQ8_1>) {
    out.reserve(x.len() / 32);
    for c in x.chunks_exact(32) {
        let (d, qs) = q8_block(c).unwrap_or_else(|| super::q8_block_ref(c));
        let sum = sum_quants(&qs);
        out.push(BlockQ8_1 {
            d: super::f32_to_f16(d),
            s: super::f32_to_f16(sum as f32 * d),
            qs,
        });
    }
}

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
pub(super) unsafe fn q8k_block(x: &[f32; 256]) -> Option<BlockQ8K> {
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
