//! Token-transposed tiles for the multi-token product (prefill, and a batched decode
//! step's few rows) of the 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
//! sixteen tokens sit in the sixteen `i32` lanes of one 512-bit register, and a row's
//! canonical accumulator (module docs of `quant`) for all of them is one such register.
//! After the last 16, groups of eight tokens run as *pair tiles*: one 512-bit register
//! holds two rows times eight tokens (lane `2t + h`: token `t`, row `h` of a pair), the
//! last group padded with dummy tokens when at least [`MIN_8`] are left, so that 5 to
//! 15 tokens and the remainders of a prefill get the transposed tiles too (products of
//! fewer than [`MIN_TOKENS`] tokens, [`MIN_TOKENS_ZEN4`] on a Zen 4 and
//! [`MIN_TOKENS_R2`] for the vocabulary matrix in row pairs, run a token at a time
//! instead).
//!
//! The other tiles keep a block's eight lane sums side by side in one register, so every
//! (row, token, block) costs its own total, conversion, scale multiply and add. Here one
//! register holds sixteen (row, token) pairs, so each of those instructions serves
//! sixteen of them, and the block's combined scale `wd · ad` is computed once per row
//! and block for all its tokens. Per lane `m` (four of the block's 32 bytes) the
//! weight's four bytes are broadcast to all lanes (a pair tile broadcasts the two rows'
//! eight bytes as one quadword) and the tokens' four bytes of lane `m` are laid out
//! once per product ([`Acts`]; twice each for the pair tiles); `vpdpbusd` adds their
//! products into one of four independent integer chains per row, which are added into
//! the block sum `S` once all eight lanes are in. The weights are prepared ([`WPair`]) a
//! chunk of rows at a time, two rows interleaved, into a buffer that stays in the cache
//! while every group's tiles read it; the tiles prefetch the next chunk's weights
//! meanwhile ([`tiles`]). A Q8_0 matrix repacked at load in row pairs
//! (`quant::QType::Q8_0R2`) already has this form, its scales still f16: the tiles read
//! it as it is, with nothing prepared ([`tiles_r2`], through [`PairSrc`]). Before the
//! pair tiles, groups of eight ran on 256-bit registers, one row per register: the
//! same instructions on half the lanes.
//!
//! Every (row, token) lane performs exactly the operations of the scalar references
//! (`quant::vec_dot_*_ref`) in their order: the exact integer block sum `S`, `d = wd ·
//! ad` rounded once, `acc + d · S` as a rounded multiply then a rounded add, in block
//! order; Q4_1 and Q5_1 add their minimum term `summ + wm · s_a` (a rounded multiply
//! then a rounded add, in block order) at the end. So the results are the same bits as
//! every other kernel.
//!
//! Integer exactness. `vpdpbusd` multiplies unsigned bytes by signed bytes and adds
//! the four products of each `i32` lane to the lane's start value without saturation
//! (Intel 64 and IA-32 Architectures Software Developer's Manual, Vol. 2, "VPDPBUSD").
//! The broadcast weight is always the unsigned operand and the activation bytes `a`
//! the signed one, as they are. Q4_1 and Q5_1 quants `w = q` are in `[0, 31]`
//! ([`Block32::UNSIGNED_QUANTS`]): the chains start at zero and `Σ w a` is exact (each
//! product in `[−3968, 3937]`). The other types' weights (offset removed, a signed byte
//! in `[−128, 127]`) become the unsigned `w + 128` (`w XOR 0x80`, exact for every
//! `i8`), and the first chain starts at the activation side's `−128 · Σ a` over the
//! block's 32 bytes, computed once per product per token ([`Acts`]), not per weight
//! block. Then `start + Σ (w + 128) a = Σ w a` exactly: `|start| ≤ 2^19`, each product
//! lies in `[−32640, 32385]`, so no partial sum leaves `±2^21`.

use super::avx2::{ActBlock, Block32};
use std::arch::x86_64::*;

/// Tokens per 512-bit tile: the `i32` lanes of a `zmm` register.
pub(super) const TOKENS: usize = 16;

/// Rows per 512-bit tile: the two rows' accumulators, integer chains (four each) and
/// scales and the activation register fit the 32 vector registers.
pub(super) const ROWS: usize = 2;

/// Tokens per pair tile: half the `i32` lanes of a `zmm` register, each token twice
/// (once per row of the pair).
const TOKENS_8: usize = 8;

/// Row pairs per pair tile: their accumulators, integer chains (two per pair), scales
/// and the activation register fit the 32 vector registers.
const PAIRS_8: usize = 4;

/// The fewest tokens left after the 16-token groups and the full 8-token groups that
/// run as one more 8-token group, padded with dummy tokens; fewer go to the other
/// tiles (`tiles::tiles_any`). Measured with `batch_bench`'s shapes (1536 × 576, weights
/// streamed, µs per product, 1 / 2 threads, a Zen 5, the other tiles vs padded pair
/// tiles): 2 tokens Q4_1 52.7 / 31 vs 65.6 / 41, Q8_0 60 / 35 vs 77 / 55; 3 tokens Q4_1
/// 78.7 / 43 vs 66.6 / 42, Q8_0 75 / 45 vs 77 / 45; 4 tokens Q4_1 78 / 46 vs 66 / 40,
/// Q8_0 233 / 121 vs 79 / 46; 12 (8 + 4) Q4_1 135 / 86 vs 120 / 71, Q8_0 143 / 88 vs
/// 142 / 82. (On the 256-bit 8-token tiles that preceded the pair tiles the threshold
/// was 5.)
const MIN_8: usize = 3;

/// The fewest tokens of a product that the transposed tiles take at all: fewer go
/// through the one-token kernel, a token at a time over chunks of rows held in the
/// cache (`tiles::row_wise_512`), which costs less there than preparing the weights for
/// one padded group (`batch_bench`'s shapes, a Zen 5, µs per product, 1 / 2 threads,
/// padded pair tile vs one token at a time: 3 tokens Q4_1 63 / 36 vs 45 / 25, Q8_0 73 /
/// 42 vs 51 / 28; 4 tokens Q4_1 64 / 36 vs 59 / 32, Q8_0 75 / 42 vs 64 / 34). With a
/// full group already run, the weights are prepared anyway and 3 or more left go in one
/// more padded group (12 tokens Q4_1 114 / 63 against 128 / 69 with the last 4 a token
/// at a time).
const MIN_TOKENS: usize = 5;

/// [`MIN_TOKENS`] on AMD's family 25 (Zen 4, [`crate::cpu::amd_family_25`]), whose
/// one-token kernel pays more for its 512-bit instructions' two halves: there a padded
/// pair tile was the faster from 3 tokens on (`batch_bench`'s shapes, µs per product, 1
/// / 2 threads, one token at a time vs padded: 3 tokens Q4_1 79–82 / 46–57 vs 72–74 /
/// 50–61, Q8_0 103–104 / 59–82 vs 83–93 / 60–80; 4 tokens Q4_1 103–105 / 53–60 vs 71–77
/// / 49–51, Q8_0 128–135 / 67–80 vs 81–99 / 44–51).
const MIN_TOKENS_ZEN4: usize = 3;

/// The fewest tokens the transposed tiles take on this CPU ([`MIN_TOKENS`],
/// [`MIN_TOKENS_ZEN4`]).
pub(super) fn min_tokens() -> usize {
    if crate::cpu::amd_family_25() {
        MIN_TOKENS_ZEN4
    } else {
        MIN_TOKENS
    }
}

/// [`MIN_TOKENS`] and [`MIN_8`] for a matrix repacked in row pairs (the vocabulary
/// matrix, [`Acts::new_r2`]): nothing to prepare, and the one-token kernel streams the
/// matrix from memory once per token. `batch_bench`'s head shape (Gemma 3's, 262,144 ×
/// 640, 2 threads, a Zen 4): one token at a time, 2 tokens 7.3–7.6 ms and 4 tokens
/// 12.2–13.8, where a padded 8-token group takes what 8 tokens do, 5.6–6.0.
const MIN_TOKENS_R2: usize = 2;

/// The registers of a tile of `T` lanes: `Lanes<16>` the 512-bit `zmm` registers (the
/// only width the tiles use now; the trait keeps the kernels' steps named once, and
/// [`super::transposed_k`] shares them).
pub(super) struct Lanes<const T: usize>;

/// The steps of the tiles, each one instruction on all `T` lanes of a register (the same
/// instruction at either width, so every lane's result is the same bits).
///
/// # Safety
/// Every method: AVX-512F/VL and AVX512-VNNI (the caller has them enabled); a pointer
/// is valid for `T` elements, and for `load`/`load_i` aligned to the register's width.
pub(super) trait Simd {
    /// `T` lanes of `i32`.
    type I: Copy;
    /// `T` lanes of `f32`.
    type F: Copy;
    /// All lanes `+0.0`.
    unsafe fn zero() -> Self::F;
    /// `T` `f32`s from `p` (aligned).
    unsafe fn load(p: *const f32) -> Self::F;
    /// `T` dwords from `p` (aligned).
    unsafe fn load_i(p: *const u8) -> Self::I;
    /// `x` in every lane.
    unsafe fn splat(x: f32) -> Self::F;
    /// `x` in every lane.
    unsafe fn splat_i(x: i32) -> Self::I;
    /// `vpdpbusd`: per lane, `src` plus the four products of `u`'s unsigned bytes and
    /// `s`'s signed bytes, without saturation.
    unsafe fn dpbusd(src: Self::I, u: Self::I, s: Self::I) -> Self::I;
    /// `i32` to `f32` (exact for the lane sums, `|L| < 2^24`).
    unsafe fn cvt(x: Self::I) -> Self::F;
    /// `a · b`, rounded.
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `a + b`, rounded.
    unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
    /// `x` to `p` (unaligned).
    unsafe fn store(p: *mut f32, x: Self::F);
}

impl Simd for Lanes<16> {
    type I = __m512i;
    type F = __m512;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_load_ps(p)
    }
    #[inline(always)]
    unsafe fn load_i(p: *const u8) -> __m512i {
        _mm512_load_si512(p as *const __m512i)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn splat_i(x: i32) -> __m512i {
        _mm512_set1_epi32(x)
    }
    #[inline(always)]
    unsafe fn dpbusd(src: __m512i, u: __m512i, s: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(src, u, s)
    }
    #[inline(always)]
    unsafe fn cvt(x: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(x)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, x: __m512) {
        _mm512_storeu_ps(p, x)
    }
}

/// One weight block of two rows prepared for the tiles: per row `h` of the pair, the
/// 32 quants as unsigned bytes (`w + 128` of [`Block32::signed_quants`], or the quants
/// themselves for [`Block32::UNSIGNED_QUANTS`]) in lane order (lane `m`'s four
/// bytes are `w[m][h]`, little-endian), and the scale and minimum widened to `f32`. Row
/// `h`'s values of lane `m` sit beside the other row's, so a pair tile broadcasts both
/// with one quadword load. A pair whose second row is past the matrix holds zero scales
/// there (its results are never stored).
#[repr(C)]
#[derive(Clone, Copy)]
struct WPair {
    w: [[i32; 2]; 8],
    d: [f32; 2],
    min: [f32; 2],
}

/// Where the tiles read a row pair's block from: [`WPair`]s prepared per chunk
/// ([`Prepared`]), or the blocks of a matrix repacked at load in row pairs ([`R2`],
/// `quant::QType::Q8_0R2`: the same quants, the scales still f16). Blocks are `SIZE`
/// bytes, read unaligned.
///
/// # Safety
/// Every method: `p` points at a whole block of `SIZE` bytes; F16C for [`R2`]'s scales.
trait PairSrc {
    /// Bytes per block.
    const SIZE: usize;
    /// Both rows' four bytes of lane `m`, row 0's first (`[w[m][0], w[m][1]]`).
    unsafe fn lane(p: *const u8, m: usize) -> i64;
    /// Row `r`'s four bytes of lane `m`.
    unsafe fn lane_of(p: *const u8, m: usize, r: usize) -> i32;
    /// Both rows' scales widened to `f32`.
    unsafe fn d(p: *const u8) -> [f32; 2];
    /// Both rows' minimums (zero for the types without one).
    unsafe fn min(p: *const u8) -> [f32; 2];
}

/// [`WPair`]s, as [`prepare`] writes them.
struct Prepared;

impl PairSrc for Prepared {
    const SIZE: usize = std::mem::size_of::<WPair>();
    #[inline(always)]
    unsafe fn lane(p: *const u8, m: usize) -> i64 {
        std::ptr::read_unaligned(p.add(8 * m) as *const i64)
    }
    #[inline(always)]
    unsafe fn lane_of(p: *const u8, m: usize, r: usize) -> i32 {
        std::ptr::read_unaligned(p.add(8 * m + 4 * r) as *const i32)
    }
    #[inline(always)]
    unsafe fn d(p: *const u8) -> [f32; 2] {
        std::ptr::read_unaligned(p.add(64) as *const [f32; 2])
    }
    #[inline(always)]
    unsafe fn min(p: *const u8) -> [f32; 2] {
        std::ptr::read_unaligned(p.add(72) as *const [f32; 2])
    }
}

/// The 68-byte blocks of a Q8_0 matrix repacked in row pairs (layout in
/// `quant/q8_0_r2.rs`): the two f16 scales, then the lanes as in [`WPair::w`].
pub(super) struct R2;

impl PairSrc for R2 {
    const SIZE: usize = 68;
    #[inline(always)]
    unsafe fn lane(p: *const u8, m: usize) -> i64 {
        std::ptr::read_unaligned(p.add(4 + 8 * m) as *const i64)
    }
    #[inline(always)]
    unsafe fn lane_of(p: *const u8, m: usize, r: usize) -> i32 {
        std::ptr::read_unaligned(p.add(4 + 8 * m + 4 * r) as *const i32)
    }
    #[inline(always)]
    unsafe fn d(p: *const u8) -> [f32; 2] {
        let h = std::ptr::read_unaligned(p as *const i32);
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(h));
        [_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_shuffle_ps::<1>(v, v))]
    }
    #[inline(always)]
    unsafe fn min(_p: *const u8) -> [f32; 2] {
        [0.0; 2]
    }
}

/// The bytes of `wp` (plain data: `WPair` is `f32`s and `i32`s).
fn wpair_bytes(wp: &[WPair]) -> &[u8] {
    // SAFETY: `WPair` is `repr(C)` of `i32` and `f32` arrays with no padding, so its
    // bytes are initialized; the slice covers exactly `wp`'s memory, borrowed as long.
    unsafe { std::slice::from_raw_parts(wp.as_ptr() as *const u8, std::mem::size_of_val(wp)) }
}

/// `T` lanes of activation blocks at one block index: per lane `m`, `T` dwords (a
/// token's four signed bytes of lane `m`), and the tokens' scales (`d`, and `s` for the
/// types with a minimum) widened to `f32`. The 16-token groups hold token `t` in lane
/// `t`, the pair tiles' 8-token groups in lanes `2t` and `2t + 1`. Each array starts at
/// a multiple of 64 bytes.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct ABlock {
    aq: [[[u8; 4]; TOKENS]; 8],
    d: [f32; TOKENS],
    s: [f32; TOKENS],
}

/// The start value of an [`ABlock`]'s block sums for weights that are not
/// [`Block32::UNSIGNED_QUANTS`]: per token lane, `−128 ·` the sum of the token's 32
/// bytes of the block (module docs). Kept apart from the [`ABlock`]s, so the types that
/// need none read no larger activation blocks.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct AStart([i32; TOKENS]);

/// A product's activation rows in tile form: the first `n16` tokens (a multiple of 16)
/// in groups of 16, then the next `tokens − n16` in groups of 8 (each token in two
/// lanes), the last of those padded with dummy tokens; each group's blocks in order
/// (`g16[g * nb + b]`, `g8[g * nb + b]`), and their start values at the same indices
/// (`s16`, `s8`; empty for [`Block32::UNSIGNED_QUANTS`] weights).
pub(super) struct Acts {
    nb: usize,
    n16: usize,
    tokens: usize,
    g16: Vec<ABlock>,
    g8: Vec<ABlock>,
    s16: Vec<AStart>,
    s8: Vec<AStart>,
}

impl Acts {
    /// The tile form, for weights of type `K`, of the first tokens of `a`'s `n` token
    /// rows: `⌊n / 16⌋ · 16` in 16-token groups, then of the `r` left, `⌊r / 8⌋ · 8` in
    /// 8-token groups, and the last `r mod 8` in one more padded 8-token group when
    /// there are at least [`MIN_8`] of them (`None` when `n` is under [`min_tokens`],
    /// when that covers no token, or when the rows differ in length).
    ///
    /// # Safety
    /// AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn new<K: Block32>(a: &[&[K::Act]]) -> Option<Self>
    where
        K::Act: ActBlock,
    {
        Self::with_minimums::<K>(a, min_tokens(), MIN_8)
    }

    /// [`Acts::new`] for a matrix repacked in row pairs ([`tiles_r2`]): it has no
    /// weights to prepare, so a padded 8-token group pays from 2 tokens on (and 2 or
    /// more left after the full groups go in one more), where the one-token kernel reads
    /// the matrix once per token ([`MIN_TOKENS_R2`]).
    ///
    /// # Safety
    /// AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn new_r2(a: &[&[<super::avx2::Q8_0 as Block32>::Act]]) -> Option<Self> {
        Self::with_minimums::<super::avx2::Q8_0>(a, MIN_TOKENS_R2, MIN_TOKENS_R2)
    }

    /// [`Acts::new`] with `min_tokens` in place of [`MIN_TOKENS`] and `min_8` in place of
    /// [`MIN_8`].
    ///
    /// # Safety
    /// AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn with_minimums<K: Block32>(
        a: &[&[K::Act]],
        min_tokens: usize,
        min_8: usize,
    ) -> Option<Self>
    where
        K::Act: ActBlock,
    {
        let nb = a.first()?.len();
        if a.len() < min_tokens || a.iter().any(|r| r.len() != nb) {
            return None;
        }
        let n16 = a.len() / TOKENS * TOKENS;
        let rest = a.len() - n16;
        let tail = rest % TOKENS_8;
        let tokens = n16 + rest - if tail >= min_8 { 0 } else { tail };
        if tokens == 0 {
            return None;
        }
        let (g16, s16) = layout::<K, 1>(&a[..n16], nb);
        let (g8, s8) = layout::<K, 2>(&a[n16..tokens], nb);
        Some(Acts {
            nb,
            n16,
            tokens,
            g16,
            g8,
            s16,
            s8,
        })
    }

    /// Tokens in tile form (the first tokens of the product, without the padding).
    pub(super) fn tokens(&self) -> usize {
        self.tokens
    }
}

/// `n` values of `T` whose bytes are all zero, written with one fill.
///
/// # Safety
/// All-zero bytes must be a valid `T` (plain arrays of integers and floats).
unsafe fn zeroed<T>(n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    // SAFETY: the capacity holds `n` values; all-zero bytes are a valid `T` (the
    // caller's contract), so after the fill the first `n` are initialized.
    std::ptr::write_bytes(v.as_mut_ptr(), 0, n);
    v.set_len(n);
    v
}

/// The token rows `a` (`nb` blocks each) in groups of `TOKENS / C` tokens, each token
/// in `C` consecutive lanes (1: lane `t`; 2: lanes `2t` and `2t + 1`), the last group
/// padded with dummy tokens (scales `0.0`, quants `0`) whose results are never stored.
/// The bytes are `a` as they are; the start values `−128 · Σ a` over each block's 32
/// bytes unless the weights are [`Block32::UNSIGNED_QUANTS`].
///
/// # Safety
/// AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
unsafe fn layout<K: Block32, const C: usize>(
    a: &[&[K::Act]],
    nb: usize,
) -> (Vec<ABlock>, Vec<AStart>)
where
    K::Act: ActBlock,
{
    let per = TOKENS / C;
    let n = a.len().div_ceil(per) * nb;
    // Zeros in one fill (the padding lanes keep them), then every token's values
    // written in place. (Filled block by block, `vec![zero; n]` cost a call per block;
    // built in a local and moved in, the move's wide loads waited on the narrow stores
    // before them.)
    // SAFETY (both): `ABlock` and `AStart` are arrays of bytes, `f32`s and `i32`s, for
    // which all-zero bytes are valid values.
    let mut blocks = zeroed::<ABlock>(n);
    let mut starts = zeroed::<AStart>(if K::UNSIGNED_QUANTS { 0 } else { n });
    let bias = _mm256_set1_epi8(-128);
    for (g, rows) in a.chunks(per).enumerate() {
        for b in 0..nb {
            let ab = &mut blocks[g * nb + b];
            for (t, row) in rows.iter().enumerate() {
                let blk = &row[b];
                let [d, s] = blk.scales();
                // SAFETY: an activation block holds 32 quants.
                let q = _mm256_loadu_si256(blk.qs_ptr() as *const __m256i);
                // The block's lanes once (four bytes each, in lane order), then copied
                // to the token's lanes.
                let mut lanes = [[0u8; 4]; 8];
                // SAFETY: `lanes` is 32 bytes, what an unaligned 256-bit store writes.
                _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, K::act_lanes(q));
                for lane in C * t..C * (t + 1) {
                    (ab.d[lane], ab.s[lane]) = (d, s);
                    for (aq, l) in ab.aq.iter_mut().zip(&lanes) {
                        aq[lane] = *l;
                    }
                }
                if let Some(st) = starts.get_mut(g * nb + b) {
                    // Σ q over the 32 signed bytes: the sums of `q + 128` less 32 · 128.
                    let sad = _mm256_sad_epu8(_mm256_xor_si256(q, bias), _mm256_setzero_si256());
                    // SAFETY: `__m256i` and `[i64; 4]` are both 32 bytes of plain integers.
                    let quarters: [i64; 4] = std::mem::transmute(sad);
                    let sum = quarters.iter().sum::<i64>() as i32 - 32 * 128;
                    st.0[C * t..C * (t + 1)].fill(-128 * sum);
                }
            }
        }
    }
    (blocks, starts)
}

/// The `mc` rows of `w` (`nb` whole `K` blocks each) prepared as [`WPair`]s into
/// `out`: rows `2p` and `2p + 1` in `out[p * nb..(p + 1) * nb]`, block by block, the
/// second row of the last pair zeros when `mc` is odd.
///
/// # Safety
/// AVX2, F16C, AVX-512F/VL and AVX512-VNNI; `w.len() == K::BYTES * nb * mc`,
/// `out.len() == nb * mc.div_ceil(2)`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn prepare<K: Block32>(w: &[u8], nb: usize, mc: usize, out: &mut [WPair]) {
    let rb = K::BYTES * nb;
    debug_assert!(w.len() == rb * mc && out.len() == nb * mc.div_ceil(2));
    // One row's block: its quants, its scales.
    let row = |wb: &[u8]| (K::signed_quants(wb), K::wscales(wb));
    // Lane m of `a` and `b` side by side, m = 0..8 ([a0 b0 a1 b1 .. a7 b7]), in one
    // two-source permutation, as unsigned bytes: w + 128 = w XOR 0x80 for the signed
    // types.
    let idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let flip = _mm512_set1_epi8(if K::UNSIGNED_QUANTS { 0 } else { -128 });
    let interleave = |dst: *mut i32, a: __m256i, b: __m256i| {
        let ab =
            _mm512_permutex2var_epi32(_mm512_castsi256_si512(a), idx, _mm512_castsi256_si512(b));
        _mm512_storeu_si512(dst as *mut __m512i, _mm512_xor_si512(ab, flip));
    };
    for (p, pair) in out.chunks_exact_mut(nb).enumerate() {
        let ra = &w[2 * p * rb..(2 * p + 1) * rb];
        let rb_ = (2 * p + 1 < mc).then(|| &w[(2 * p + 1) * rb..(2 * p + 2) * rb]);
        for (b, wp) in pair.iter_mut().enumerate() {
            let (qa, (da, ma)) = row(&ra[b * K::BYTES..(b + 1) * K::BYTES]);
            let (qb, (db, mb)) = match rb_ {
                Some(r) => row(&r[b * K::BYTES..(b + 1) * K::BYTES]),
                None => (_mm256_setzero_si256(), (0.0, 0.0)),
            };
            interleave(wp.w.as_mut_ptr() as *mut i32, qa, qb);
            (wp.d, wp.min) = ([da, db], [ma, mb]);
        }
    }
}

/// `R` rows (1 or 2: the pair `wp[..nb]`'s first `R` rows) times the 16 tokens of `ga`
/// (`nb` blocks, with their start values `gs` unless the weights are
/// [`Block32::UNSIGNED_QUANTS`]); `out[r][t]` = row `r` times token `t`.
///
/// # Safety
/// AVX-512F/BW/DQ/VL and AVX512-VNNI; `wp.len() >= nb`, `ga.len() >= nb` (and
/// `gs.len() >= nb` for signed weights), `R <= 2`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn rows_tokens<K: Block32, S: PairSrc, const R: usize>(
    wp: &[u8],
    nb: usize,
    (ga, gs): (&[ABlock], &[AStart]),
    out: &mut [[f32; TOKENS]; R],
) {
    type L = Lanes<TOKENS>;
    assert!(R <= 2 && wp.len() >= nb * S::SIZE && ga.len() >= nb);
    let mut acc = [L::zero(); R];
    let mut summ = [L::zero(); R];
    for (b, ab) in ga[..nb].iter().enumerate() {
        // In `wp` (the assertion above).
        let wb = wp.as_ptr().add(b * S::SIZE);
        let st = (!K::UNSIGNED_QUANTS).then(|| &gs[b]);
        let ad = L::load(ab.d.as_ptr());
        // d = wd · ad for each token, rounded once (the reference's scalar product).
        let wd = S::d(wb);
        let d: [_; R] = std::array::from_fn(|r| L::mul(L::splat(wd[r]), ad));
        // Four independent chains per row, lanes m and m + 4 in chain m mod 4, the
        // first starting at the start value.
        let mut c = [[L::splat_i(0); 4]; R];
        for c in &mut c {
            c[0] = start_of(st);
        }
        for (m, aq) in ab.aq.iter().enumerate() {
            let a = L::load_i(aq.as_ptr() as *const u8);
            for (r, c) in c.iter_mut().enumerate() {
                c[m % 4] = L::dpbusd(c[m % 4], L::splat_i(S::lane_of(wb, m, r)), a);
            }
        }
        for ((acc, c), d) in acc.iter_mut().zip(c).zip(d) {
            // Exact (module docs): start + Σ (w + 128) a = Σ w a, or Σ w a.
            *acc = L::add(*acc, L::mul(d, L::cvt(block_sum(&c))));
        }
        if K::HAS_MIN {
            let s = L::load(ab.s.as_ptr());
            let wm = S::min(wb);
            for (r, summ) in summ.iter_mut().enumerate() {
                *summ = L::add(*summ, L::mul(L::splat(wm[r]), s));
            }
        }
    }
    for r in 0..R {
        let mut v = acc[r];
        if K::HAS_MIN {
            v = L::add(v, summ[r]);
        }
        L::store(out[r].as_mut_ptr(), v);
    }
}

/// `P` row pairs (`wp[p * nb..(p + 1) * nb]`) times the 8 tokens of `ga` (`nb` blocks,
/// each token in two lanes); `out[p][2t + h]` = row `h` of pair `p` times token `t`.
/// Each lane performs [`rows_tokens`]' operations, in its order, for its (row, token).
/// `ahead` is prefetched a part per block: all at once before the tile, most of those
/// prefetches were dropped (Q8_0, whose raw rows are the longest, was slower than on the
/// 256-bit tiles with the weights streamed, though faster with them in the cache).
///
/// # Safety
/// AVX-512F/BW/DQ/VL and AVX512-VNNI; `wp.len() >= P * nb`, `ga.len() >= nb` (and
/// `gs.len() >= nb` for signed weights, as [`rows_tokens`]).
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn pairs_tokens<K: Block32, S: PairSrc, const P: usize>(
    wp: &[u8],
    nb: usize,
    (ga, gs): (&[ABlock], &[AStart]),
    out: &mut [[f32; TOKENS]; P],
    ahead: &[u8],
) {
    type L = Lanes<TOKENS>;
    assert!(wp.len() >= P * nb * S::SIZE && ga.len() >= nb);
    // Both rows' values of a lane, `[x0, x1]`, in lanes 2t and 2t + 1 for every t.
    let both_f = |x: [f32; 2]| {
        _mm512_castpd_ps(_mm512_set1_pd(std::ptr::read_unaligned(
            x.as_ptr() as *const f64
        )))
    };
    let mut acc = [L::zero(); P];
    let mut summ = [L::zero(); P];
    let mut pf = Spread::new(ahead.len().div_ceil(64), nb);
    let l1 = !K::PAIR_PREFETCH_L2 || pair_prefetch_l1();
    for (b, ab) in ga[..nb].iter().enumerate() {
        let lines = pf.next();
        for l in lines {
            // SAFETY: line `l` starts inside `ahead` (`Spread` covers `⌈len / 64⌉`
            // lines).
            prefetch_line(ahead.as_ptr().add(64 * l), l1);
        }
        let st = (!K::UNSIGNED_QUANTS).then(|| &gs[b]);
        let ad = L::load(ab.d.as_ptr());
        // Pair p's block b, in `wp` (the assertion above).
        let wbs: [*const u8; P] = std::array::from_fn(|p| wp.as_ptr().add((p * nb + b) * S::SIZE));
        // d = wd · ad for each (row, token), rounded once.
        let d: [_; P] = std::array::from_fn(|p| L::mul(both_f(S::d(wbs[p])), ad));
        // Independent chains per pair (four, as `rows_tokens`, or two with four pairs to
        // keep in registers), the first starting at the start value.
        let ch = if P >= 4 { 2 } else { 4 };
        let mut c = [[L::splat_i(0); 4]; P];
        for c in &mut c {
            c[0] = start_of(st);
        }
        for (m, aq) in ab.aq.iter().enumerate() {
            let a = L::load_i(aq.as_ptr() as *const u8);
            for (c, wb) in c.iter_mut().zip(wbs) {
                c[m % ch] = L::dpbusd(c[m % ch], _mm512_set1_epi64(S::lane(wb, m)), a);
            }
        }
        for ((acc, c), d) in acc.iter_mut().zip(c).zip(d) {
            // Exact (module docs): start + Σ (w + 128) a = Σ w a, or Σ w a.
            *acc = L::add(*acc, L::mul(d, L::cvt(block_sum(&c[..ch]))));
        }
        if K::HAS_MIN {
            let s = L::load(ab.s.as_ptr());
            for (summ, wb) in summ.iter_mut().zip(wbs) {
                *summ = L::add(*summ, L::mul(both_f(S::min(wb)), s));
            }
        }
    }
    for p in 0..P {
        let mut v = acc[p];
        if K::HAS_MIN {
            v = L::add(v, summ[p]);
        }
        L::store(out[p].as_mut_ptr(), v);
    }
}

/// The start values of a block's sums as the tiles add them: the activations' `−128 ·
/// Σ a` from `st`, or zero without one ([`Block32::UNSIGNED_QUANTS`] weights).
///
/// # Safety
/// As [`Simd`].
#[inline(always)]
unsafe fn start_of(st: Option<&AStart>) -> __m512i {
    match st {
        None => _mm512_setzero_si512(),
        Some(s) => <Lanes<TOKENS> as Simd>::load_i(s.0.as_ptr() as *const u8),
    }
}

/// The block sums of two or four chains, `c0 + c1` or `(c0 + c1) + (c2 + c3)` per
/// lane: exact (each chain within `±2^19`).
///
/// # Safety
/// As [`Simd`].
#[inline(always)]
unsafe fn block_sum(c: &[__m512i]) -> __m512i {
    let s = _mm512_add_epi32(c[0], c[1]);
    match c {
        [_, _, c2, c3] => _mm512_add_epi32(s, _mm512_add_epi32(*c2, *c3)),
        _ => s,
    }
}

/// The K types' canonical tree `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))` of
/// eight lane registers, for `T` tokens at once (`transposed_k`'s tiles).
///
/// # Safety
/// As [`Simd`].
#[inline(always)]
pub(super) unsafe fn tree<const T: usize>(l: [<Lanes<T> as Simd>::F; 8]) -> <Lanes<T> as Simd>::F
where
    Lanes<T>: Simd,
{
    let add = |a, b| {
        // SAFETY: as this function.
        unsafe { Lanes::<T>::add(a, b) }
    };
    let s = [
        add(l[0], l[4]),
        add(l[1], l[5]),
        add(l[2], l[6]),
        add(l[3], l[7]),
    ];
    add(add(s[0], s[2]), add(s[1], s[3]))
}

/// Every row tile of one `T`-token group over `m` rows: `run(r, o)` fills `o` (`R`
/// rows, or one at the end) with rows `r..` times the group's tokens, `o[j][t]`, which
/// goes to `out[t][r0 + r + j]` for the tokens `out` holds (a padded group's dummy
/// tokens have no slice, and their results are dropped).
#[inline(always)]
pub(super) fn each_row_tile<const T: usize, const R: usize>(
    m: usize,
    r0: usize,
    out: &mut [&mut [f32]],
    mut run: impl FnMut(usize, &mut [[f32; T]]),
) {
    let mut r = 0;
    while r < m {
        let take = if m - r >= R { R } else { 1 };
        let mut o = [[0f32; T]; R];
        run(r, &mut o[..take]);
        let at = r0 + r;
        for (t, ot) in out.iter_mut().take(T).enumerate() {
            // A token's `take` results are consecutive outputs: one bounds check, then
            // the stores.
            for (o, orow) in ot[at..at + take].iter_mut().zip(&o[..take]) {
                *o = orow[t];
            }
        }
        r += take;
    }
}

/// `out[t][r] = dot(row r of w, token t)` for the `m = w.len() / rb` rows of `K`
/// blocks in `w` and the first [`Acts::tokens`] tokens (`out`'s slices of later tokens
/// are untouched; so are the padded group's dummy tokens'). Row chunk by row chunk
/// ([`chunk_rows`]): the chunk's weights are prepared, then every 16- and 8-token group
/// runs its tiles over them, the first group's tiles prefetching the next chunk's
/// weights (without it, the preparation of each chunk waited on memory: Q4_1, 8 tokens,
/// weights streamed, 1 thread, 171 µs against 139 µs with it, which is the time with
/// the weights in the cache).
///
/// # Safety
/// AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI; `acts` was made by
/// [`Acts::new`] for `K`; `rb == K::BYTES * acts.nb`, `w.len()` a multiple of `rb`,
/// `out` holds at least [`Acts::tokens`] slices of at least `m` outputs.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(super) unsafe fn tiles<K: Block32>(w: &[u8], rb: usize, acts: &Acts, out: &mut [&mut [f32]]) {
    let nb = acts.nb;
    debug_assert!(rb == K::BYTES * nb && w.len().is_multiple_of(rb));
    let m = w.len() / rb;
    let chunk = chunk_rows(nb);
    let blank = WPair {
        w: [[0; 2]; 8],
        d: [0.0; 2],
        min: [0.0; 2],
    };
    let mut wp = vec![blank; chunk.min(m).div_ceil(2) * nb];
    let (out16, out8) = out[..acts.tokens].split_at_mut(acts.n16);
    for r0 in (0..m).step_by(chunk) {
        let mc = chunk.min(m - r0);
        let wp = &mut wp[..mc.div_ceil(2) * nb];
        // The next chunk's weights, prefetched by the first group's tiles.
        let next = &w[(r0 + mc) * rb..(r0 + mc + chunk).min(m) * rb];
        let (next16, next8) = match acts.n16 {
            0 => (&[][..], next),
            _ => (next, &[][..]),
        };
        // SAFETY (all): this function's features and contract; `wp` holds rows
        // `r0..r0 + mc` in pairs.
        unsafe {
            prepare::<K>(&w[r0 * rb..(r0 + mc) * rb], nb, mc, wp);
            let wp = wpair_bytes(wp);
            groups16::<K, Prepared>(wp, nb, mc, r0, (&acts.g16, &acts.s16), out16, next16);
            groups8::<K, Prepared>(wp, nb, mc, r0, (&acts.g8, &acts.s8), out8, next8);
        }
    }
}

/// [`tiles`] over a Q8_0 matrix repacked in row pairs (`quant::QType::Q8_0R2`; `w` its
/// bytes, an even number of rows of `rb`): the tiles read its blocks as they are, with
/// nothing prepared, a chunk of rows at a time as [`tiles`] does, the first group's
/// tiles prefetching the next chunk. The same bits as [`tiles`] over the file's blocks.
///
/// # Safety
/// As [`tiles`] with `K` = Q8_0 (`acts` made by [`Acts::new`] for it); `w.len()` is an
/// even number of rows of `rb`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(super) unsafe fn tiles_r2(w: &[u8], rb: usize, acts: &Acts, out: &mut [&mut [f32]]) {
    type K = super::avx2::Q8_0;
    let nb = acts.nb;
    assert!(rb == K::BYTES * nb && w.len().is_multiple_of(2 * rb));
    let m = w.len() / rb;
    // Whole pairs per chunk (`chunk_rows` is a multiple of 4).
    let chunk = chunk_rows(nb);
    let (out16, out8) = out[..acts.tokens].split_at_mut(acts.n16);
    for r0 in (0..m).step_by(chunk) {
        let mc = chunk.min(m - r0);
        let wp = &w[r0 * rb..(r0 + mc) * rb];
        let next = &w[(r0 + mc) * rb..(r0 + mc + chunk).min(m) * rb];
        let (next16, next8) = match acts.n16 {
            0 => (&[][..], next),
            _ => (next, &[][..]),
        };
        // SAFETY (both): this function's features and contract; `wp` holds rows
        // `r0..r0 + mc` (`r0` and `mc` even) as 68-byte pair blocks.
        unsafe {
            groups16::<K, R2>(wp, nb, mc, r0, (&acts.g16, &acts.s16), out16, next16);
            groups8::<K, R2>(wp, nb, mc, r0, (&acts.g8, &acts.s8), out8, next8);
        }
    }
}

/// Rows per chunk of [`tiles`]: each chunk's weights are prepared into a buffer of
/// about [`CHUNK_BYTES`], which all groups then read while it is in the cache; a
/// multiple of both tiles' rows, so that only the last chunk has shorter tiles.
fn chunk_rows(nb: usize) -> usize {
    const STEP: usize = 2 * PAIRS_8;
    let per_row = nb.max(1) * std::mem::size_of::<WPair>() / 2;
    (CHUNK_BYTES / per_row).div_ceil(STEP).max(1) * STEP
}

/// Prepared weight bytes per chunk of [`tiles`].
const CHUNK_BYTES: usize = 16 * 1024;

/// `lines` items spread over `parts` consecutive parts as evenly as whole items allow
/// (part `i` gets `⌊lines (i + 1) / parts⌋ − ⌊lines i / parts⌋` of them), with no
/// division per part: the ranges of a tile's per-block prefetches.
struct Spread {
    at: usize,
    q: usize,
    r: usize,
    err: usize,
    parts: usize,
}

impl Spread {
    fn new(lines: usize, parts: usize) -> Spread {
        let parts = parts.max(1);
        Spread {
            at: 0,
            q: lines / parts,
            r: lines % parts,
            err: 0,
            parts,
        }
    }

    /// The next part's items.
    #[inline(always)]
    fn next(&mut self) -> std::ops::Range<usize> {
        let mut take = self.q;
        self.err += self.r;
        if self.err >= self.parts {
            self.err -= self.parts;
            take += 1;
        }
        let start = self.at;
        self.at += take;
        start..self.at
    }
}

/// Every cache line of `p`, prefetched into the first-level cache (the 16-token groups'
/// next chunk: on a Zen 4 into L2 instead was no faster for them, unlike the pair tiles,
/// [`pair_prefetch_l1`]).
#[inline(always)]
fn prefetch(p: &[u8]) {
    for off in (0..p.len()).step_by(64) {
        // SAFETY: `off < p.len()`.
        unsafe { prefetch_line(p.as_ptr().add(off), true) };
    }
}

/// Whether the 8-token pair tiles prefetch the next chunk's weights into the
/// first-level cache (`prefetcht0`) for the types that ask for the second
/// ([`Block32::PAIR_PREFETCH_L2`]: Q8_0, raw or in row pairs): on AMD's Zen 5 and later,
/// where the tiles were tuned, yes; elsewhere they go to L2 (`prefetcht1`). On a Zen 4
/// the `prefetcht0`s stalled the Q8_0 pair tiles (`perf` put the samples on them: the
/// core's L1 miss buffers full) and the weights came no sooner: 8-token products of
/// Gemma 3's head (Q8_0 in row pairs, 262,144 × 640, 2 threads, weights streamed) took
/// 8.0–10.4 ms with `prefetcht0` and 5.6–7.5 ms with `prefetcht1`, alternating; Q4_1's
/// were slower with `prefetcht1` (`batch_bench`, docs/performance.md, "Why it is
/// fast").
#[inline]
fn pair_prefetch_l1() -> bool {
    crate::cpu::amd_zen5_or_later()
}

/// Prefetches the cache line at `p` into L1 when `l1`, else into L2. A hint only: it
/// never faults and reads nothing into the program.
///
/// # Safety
/// None beyond the call (any address); `unsafe` only as the intrinsic is.
#[inline(always)]
unsafe fn prefetch_line(p: *const u8, l1: bool) {
    if l1 {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
    } else {
        _mm_prefetch::<_MM_HINT_T1>(p as *const i8);
    }
}

/// Every 2-row (1-row at the end) tile of the 16-token groups `ga` (`nb` blocks each)
/// against the `m` prepared rows `wp` (rows `r0..` of the product); `out` holds one
/// slice per token of the groups. The first group's tiles prefetch `ahead`.
///
/// # Safety
/// As [`tiles`]; `wp` is the `m` rows' pairs, `ga` is `out.len() / 16 · nb` blocks (`gs`
/// their start values, or empty for unsigned weights),
/// every slice of `out` holds at least `r0 + m` outputs.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn groups16<K: Block32, S: PairSrc>(
    wp: &[u8],
    nb: usize,
    m: usize,
    r0: usize,
    (ga, gs): (&[ABlock], &[AStart]),
    out: &mut [&mut [f32]],
    ahead: &[u8],
) {
    for (g, out) in out.chunks_mut(TOKENS).enumerate() {
        // The group's blocks, and their start values (none for unsigned weights).
        let ga = (
            &ga[g * nb..(g + 1) * nb],
            gs.get(g * nb..(g + 1) * nb).unwrap_or(&[]),
        );
        each_row_tile::<TOKENS, ROWS>(m, r0, out, |r, o| {
            if g == 0 {
                let (a, b) = (ahead.len() * r / m, ahead.len() * (r + o.len()) / m);
                prefetch(&ahead[a..b]);
            }
            // Tiles start at even rows: row r is the first of pair r / 2.
            let wr = &wp[r / 2 * nb * S::SIZE..];
            // SAFETY (all): this function's features; `wr` holds the tile's pair.
            if let Ok(o) = <&mut [_; ROWS]>::try_from(&mut *o) {
                unsafe { rows_tokens::<K, S, ROWS>(wr, nb, ga, o) }
            } else if let Ok(o) = <&mut [_; 1]>::try_from(o) {
                unsafe { rows_tokens::<K, S, 1>(wr, nb, ga, o) }
            }
        });
    }
}

/// Every pair tile ([`PAIRS_8`] pairs, then two, then one at the end) of the 8-token groups `ga`
/// (`nb` blocks each, tokens in two lanes) against the `m` prepared rows `wp` (rows
/// `r0..` of the product); `out` holds one slice per real token of the groups (fewer
/// than 8 in the last when it is padded). The first group's tiles prefetch `ahead`.
///
/// # Safety
/// As [`tiles`]; `wp` is the `m` rows' pairs, `ga` is `⌈out.len() / 8⌉ · nb` blocks (`gs`
/// as in [`groups16`]),
/// every slice of `out` holds at least `r0 + m` outputs.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn groups8<K: Block32, S: PairSrc>(
    wp: &[u8],
    nb: usize,
    m: usize,
    r0: usize,
    (ga, gs): (&[ABlock], &[AStart]),
    out: &mut [&mut [f32]],
    ahead: &[u8],
) {
    let pairs = m.div_ceil(2);
    for (g, out) in out.chunks_mut(TOKENS_8).enumerate() {
        // The group's blocks, and their start values (none for unsigned weights).
        let ga = (
            &ga[g * nb..(g + 1) * nb],
            gs.get(g * nb..(g + 1) * nb).unwrap_or(&[]),
        );
        let mut p = 0;
        while p < pairs {
            let take = match pairs - p {
                n if n >= PAIRS_8 => PAIRS_8,
                n if n >= 2 => 2,
                _ => 1,
            };
            // The tile's share of `ahead` (its rows' fraction), for the first group.
            let share = match g {
                0 => {
                    let (a, b) = (
                        ahead.len() * 2 * p / m,
                        ahead.len() * (2 * (p + take)).min(m) / m,
                    );
                    &ahead[a..b]
                }
                _ => &[][..],
            };
            let wr = &wp[p * nb * S::SIZE..];
            let mut o = [[0f32; TOKENS]; PAIRS_8];
            // SAFETY (all): this function's features; `wr` holds the tile's pairs.
            let [o0, o1, _, _] = &mut o;
            match take {
                PAIRS_8 => unsafe { pairs_tokens::<K, S, PAIRS_8>(wr, nb, ga, &mut o, share) },
                2 => unsafe {
                    let mut o2 = [[0f32; TOKENS]; 2];
                    pairs_tokens::<K, S, 2>(wr, nb, ga, &mut o2, share);
                    (*o0, *o1) = (o2[0], o2[1]);
                },
                _ => unsafe {
                    pairs_tokens::<K, S, 1>(wr, nb, ga, std::array::from_mut(o0), share)
                },
            }
            // Lane 2t + h of pair j: row 2(p + j) + h, token t (the dummy row of an odd
            // chunk's last pair is dropped). Whole pairs: each token's rows are lane
            // pairs, moved as such.
            if 2 * (p + take) <= m {
                let at = r0 + 2 * p;
                for (t, ot) in out.iter_mut().enumerate() {
                    let lanes = 2 * t..2 * t + 2;
                    for (j, oj) in o[..take].iter().enumerate() {
                        ot[at + 2 * j..at + 2 * j + 2].copy_from_slice(&oj[lanes.clone()]);
                    }
                }
                p += take;
                continue;
            }
            for (t, ot) in out.iter_mut().enumerate() {
                for (j, oj) in o[..take].iter().enumerate() {
                    for h in 0..2 {
                        let r = 2 * (p + j) + h;
                        if r < m {
                            ot[r0 + r] = oj[2 * t + h];
                        }
                    }
                }
            }
            p += take;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::avx2::{self, Block32};
    use std::arch::x86_64::*;

    /// [`Block32::act_lanes`] puts element [`Block32::LANE_ELEMENT`]`(m, k)` at byte
    /// `4m + k` (the grouping the weights' tile form uses), for every 32-element type.
    #[test]
    fn act_lanes_follow_lane_element() {
        fn check<K: Block32>(name: &str) {
            let q: [u8; 32] = std::array::from_fn(|i| i as u8 * 7 + 3);
            let mut got = [0u8; 32];
            // SAFETY: AVX2 was detected; both arrays are 32 bytes.
            unsafe {
                let v = K::act_lanes(_mm256_loadu_si256(q.as_ptr() as *const __m256i));
                _mm256_storeu_si256(got.as_mut_ptr() as *mut __m256i, v);
            }
            for m in 0..8 {
                for k in 0..4 {
                    assert_eq!(got[4 * m + k], q[K::LANE_ELEMENT(m, k)], "{name} lane {m}");
                }
            }
        }
        assert!(crate::cpu::has_avx2_f16c(), "this CPU lacks AVX2/F16C");
        check::<avx2::Q4_0>("Q4_0");
        check::<avx2::Q4_1>("Q4_1");
        check::<avx2::Q5_0>("Q5_0");
        check::<avx2::Q5_1>("Q5_1");
        check::<avx2::Q8_0>("Q8_0");
    }
}
