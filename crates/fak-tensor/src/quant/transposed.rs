//! Token-transposed tiles for the multi-token product (prefill, and a batched decode
//! step's few rows) of the 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
//! sixteen tokens sit in the sixteen `i32` lanes of one 512-bit register, and a row's
//! eight canonical lane accumulators (module docs of `quant`) are eight such registers.
//! After the last 16, groups of eight tokens run the same code on 256-bit registers
//! (eight lanes; [`Lanes`], [`Simd`]), the last group padded with dummy tokens when at
//! least [`MIN_8`] are left, so that 5 to 15 tokens and the remainders of a prefill get
//! the transposed tiles too.
//!
//! The other tiles keep a row's eight lanes side by side in one register, so every
//! (row, token, block) costs its own lane sum, conversion, scale multiply and add.
//! Here one register holds lane `m` of sixteen (eight) tokens, so each of those
//! instructions serves sixteen (eight) (row, token) pairs, and the block's combined
//! scale `wd · ad` is computed once per row and block for all of them. Per lane `m` the
//! weight's four bytes are broadcast to all lanes (a `vpdpbusd` memory operand) and the
//! tokens' four bytes of lane `m` are laid out once per product ([`Acts`]). The weights
//! are prepared ([`WBlock`]) a chunk of rows at a time into a buffer that stays in the
//! cache while every group's tiles read it; the tiles prefetch the next chunk's weights
//! meanwhile ([`tiles`]).
//!
//! Every (row, token) lane performs exactly the operations of the scalar references
//! (`quant::vec_dot_*_ref`) in their order: the exact integer lane sum, `d = wd · ad`
//! rounded once, `acc + d · L` as a rounded multiply then a rounded add, in block
//! order, and the canonical tree `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))` done across
//! the eight registers; Q4_1 and Q5_1 add their minimum term `summ + wm · s_a` (a
//! rounded multiply then a rounded add, in block order) after the tree. So the
//! results are the same bits as every other kernel.
//!
//! Integer exactness. `vpdpbusd` multiplies unsigned bytes by signed bytes and adds
//! the four products of each `i32` lane to the lane's start value without saturation
//! (Intel 64 and IA-32 Architectures Software Developer's Manual, Vol. 2, "VPDPBUSD").
//! The weight is the signed operand (broadcast; offsets removed, so a byte in
//! `[−128, 127]`) and the activation byte `a` becomes the unsigned `a + 128` (`a XOR
//! 0x80`, exact for every `i8`); the start value is the weight side's `−128 · Σ w` over
//! the lane, prepared once per weight block ([`WBlock`]). Then `start + Σ (a + 128) w =
//! Σ a w` exactly: `|start| ≤ 65536`, the four products lie in `[−32640, 32385]`, so no
//! partial sum leaves `±2^18`.

use super::avx2::{ActBlock, Block32};
use std::arch::x86_64::*;

/// Tokens per 512-bit tile: the `i32` lanes of a `zmm` register.
pub(super) const TOKENS: usize = 16;

/// Rows per 512-bit tile: the sixteen accumulators of two rows and the activation
/// register fit the 32 vector registers.
pub(super) const ROWS: usize = 2;

/// Tokens per 256-bit tile: the `i32` lanes of a `ymm` register.
const TOKENS_8: usize = 8;

/// Rows per 256-bit tile: the 24 accumulators of three rows, their scales and the
/// activation register fit the 32 vector registers (3 rows were 3% faster than 2 with
/// the weights in the cache, `batch_bench`'s shapes; 4 were 25% slower).
const ROWS_8: usize = 3;

/// The fewest tokens left after the 16-token groups and the full 8-token groups that
/// run as one more 8-token group, padded with dummy tokens; fewer go to the other
/// tiles (`tiles::tiles_any`). Measured with `batch_bench`'s shapes (1536 × 576, weights
/// streamed, 1 thread, µs per product, today's path vs padded): 4 tokens Q4_1 196 vs
/// 223, Q8_0 247 vs 292; 5 tokens Q4_1 256 vs 232, Q8_0 311 vs 281; 12 (8 + 4) Q4_1 374
/// vs 377, Q8_0 402 vs 423; 13 (8 + 5) Q4_1 438 vs 393, Q8_0 455 vs 429. Four left are
/// one full 4-token tile of the other kernels; Q4_0, Q5_0, Q5_1 and 2 threads agreed.
const MIN_8: usize = 5;

/// The registers of a tile of `T` tokens, one token per lane: `Lanes<16>` the 512-bit
/// `zmm` registers, `Lanes<8>` the 256-bit `ymm` ones (AVX-512VL gives 32 of those and
/// AVX512-VNNI's `vpdpbusd` on them; AMD Zen 4 runs a 512-bit instruction as two
/// 256-bit halves, so the narrow tile does half the work at twice the rate).
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
    /// `vpdpbusd`: per lane, `src` plus the four products of `a`'s unsigned bytes and
    /// `w`'s signed bytes, without saturation.
    unsafe fn dpbusd(src: Self::I, a: Self::I, w: Self::I) -> Self::I;
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
    unsafe fn dpbusd(src: __m512i, a: __m512i, w: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(src, a, w)
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

impl Simd for Lanes<8> {
    type I = __m256i;
    type F = __m256;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_load_ps(p)
    }
    #[inline(always)]
    unsafe fn load_i(p: *const u8) -> __m256i {
        _mm256_load_si256(p as *const __m256i)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn splat_i(x: i32) -> __m256i {
        _mm256_set1_epi32(x)
    }
    #[inline(always)]
    unsafe fn dpbusd(src: __m256i, a: __m256i, w: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(src, a, w)
    }
    #[inline(always)]
    unsafe fn cvt(x: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(x)
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, x: __m256) {
        _mm256_storeu_ps(p, x)
    }
}

/// One weight block prepared for the tile: the 32 quants as signed bytes, offset
/// removed, in canonical lane order ([`Block32::signed_quants`]; lane `m`'s four bytes
/// are `w[m]`, little-endian), each lane's start value `−128 · Σ_{k<4} w[4m+k]`, and
/// the scale and minimum widened to `f32`.
#[repr(C)]
#[derive(Clone, Copy)]
struct WBlock {
    w: [i32; 8],
    start: [i32; 8],
    d: f32,
    min: f32,
}

/// `T` tokens' activation blocks at one block index: per lane `m`, `T` dwords (token
/// `t`'s four bytes of lane `m`, each `+128` as an unsigned byte) and the tokens'
/// scales (`d`, and `s` for the types with a minimum) widened to `f32`. Each array
/// starts at a multiple of `4 · T` bytes (the register's width; `T` is 8 or 16).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct ABlock<const T: usize> {
    au: [[[u8; 4]; T]; 8],
    d: [f32; T],
    s: [f32; T],
}

/// A product's activation rows in tile form: the first `n16` tokens (a multiple of 16)
/// in groups of 16, then the next `tokens − n16` in groups of 8, the last of those
/// padded with dummy tokens; each group's blocks in order (`g16[g * nb + b]`,
/// `g8[g * nb + b]`).
pub(super) struct Acts {
    nb: usize,
    n16: usize,
    tokens: usize,
    g16: Vec<ABlock<TOKENS>>,
    g8: Vec<ABlock<TOKENS_8>>,
}

impl Acts {
    /// The tile form, for weights of type `K`, of the first tokens of `a`'s `n` token
    /// rows: `⌊n / 16⌋ · 16` in 16-token groups, then of the `r` left, `⌊r / 8⌋ · 8` in
    /// 8-token groups, and the last `r mod 8` in one more padded 8-token group when
    /// there are at least [`MIN_8`] of them (`None` when that covers no token, or the
    /// rows differ in length).
    ///
    /// # Safety
    /// AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn new<K: Block32>(a: &[&[K::Act]]) -> Option<Self>
    where
        K::Act: ActBlock,
    {
        let nb = a.first()?.len();
        if a.iter().any(|r| r.len() != nb) {
            return None;
        }
        let n16 = a.len() / TOKENS * TOKENS;
        let rest = a.len() - n16;
        let tail = rest % TOKENS_8;
        let tokens = n16 + rest - if tail >= MIN_8 { 0 } else { tail };
        if tokens == 0 {
            return None;
        }
        Some(Acts {
            nb,
            n16,
            tokens,
            g16: layout::<K, TOKENS>(&a[..n16], nb),
            g8: layout::<K, TOKENS_8>(&a[n16..tokens], nb),
        })
    }

    /// Tokens in tile form (the first tokens of the product, without the padding).
    pub(super) fn tokens(&self) -> usize {
        self.tokens
    }
}

/// The token rows `a` (`nb` blocks each) in groups of `T`, the last group padded with
/// dummy tokens (scales `0.0`, quants `0`) whose results are never stored.
///
/// # Safety
/// AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
unsafe fn layout<K: Block32, const T: usize>(a: &[&[K::Act]], nb: usize) -> Vec<ABlock<T>>
where
    K::Act: ActBlock,
{
    let empty = ABlock {
        au: [[[0x80; 4]; T]; 8],
        d: [0.0; T],
        s: [0.0; T],
    };
    let mut blocks = vec![empty; a.len().div_ceil(T) * nb];
    for (i, row) in a.iter().enumerate() {
        let (g, t) = (i / T, i % T);
        for (b, blk) in row.iter().enumerate() {
            let ab = &mut blocks[g * nb + b];
            [ab.d[t], ab.s[t]] = blk.scales();
            // SAFETY: an activation block holds 32 quants.
            let qs = std::slice::from_raw_parts(blk.qs_ptr(), 32);
            for (m, lane) in ab.au.iter_mut().enumerate() {
                for (k, byte) in lane[t].iter_mut().enumerate() {
                    *byte = qs[K::LANE_ELEMENT(m, k)] ^ 0x80;
                }
            }
        }
    }
    blocks
}

/// The blocks of `w` (whole `K` blocks) prepared as [`WBlock`]s, in order, into `out`
/// (one per block).
///
/// # Safety
/// AVX2, F16C, AVX-512F/VL and AVX512-VNNI; `w.len() == K::BYTES * out.len()`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn prepare<K: Block32>(w: &[u8], out: &mut [WBlock]) {
    debug_assert_eq!(w.len(), K::BYTES * out.len());
    for (wb, blk) in w.chunks_exact(K::BYTES).zip(out) {
        let q = K::signed_quants(wb);
        // 128 · Σ_{k<4} w[4m+k] (unsigned 128 times the signed weights), then negated.
        let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(-128), q);
        let start = _mm256_sub_epi32(_mm256_setzero_si256(), s);
        (blk.d, blk.min) = K::wscales(wb);
        _mm256_storeu_si256(blk.w.as_mut_ptr() as *mut __m256i, q);
        _mm256_storeu_si256(blk.start.as_mut_ptr() as *mut __m256i, start);
    }
}

/// `R` rows (`wp[r * nb..(r + 1) * nb]`) times the `T` tokens of `ga` (`nb` blocks);
/// `out[r][t]` = row `r` times token `t`.
///
/// # Safety
/// AVX-512F/BW/DQ/VL and AVX512-VNNI; `wp.len() >= R * nb`, `ga.len() >= nb`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn rows_tokens<const T: usize, const R: usize, const HAS_MIN: bool>(
    wp: &[WBlock],
    nb: usize,
    ga: &[ABlock<T>],
    out: &mut [[f32; T]; R],
) where
    Lanes<T>: Simd,
{
    debug_assert!(wp.len() >= R * nb && ga.len() >= nb);
    let mut acc = [[Lanes::<T>::zero(); 8]; R];
    let mut summ = [Lanes::<T>::zero(); R];
    for (b, ab) in ga[..nb].iter().enumerate() {
        let ad = Lanes::<T>::load(ab.d.as_ptr());
        let wbs: [&WBlock; R] = std::array::from_fn(|r| &wp[r * nb + b]);
        // d = wd · ad for each token, rounded once (the reference's scalar product).
        let d: [_; R] = std::array::from_fn(|r| Lanes::<T>::mul(Lanes::<T>::splat(wbs[r].d), ad));
        for (m, au) in ab.au.iter().enumerate() {
            let a = Lanes::<T>::load_i(au.as_ptr() as *const u8);
            for ((acc, wb), d) in acc.iter_mut().zip(wbs).zip(d) {
                // Exact (module docs): start + Σ (a + 128) w = Σ a w.
                let l = Lanes::<T>::dpbusd(
                    Lanes::<T>::splat_i(wb.start[m]),
                    a,
                    Lanes::<T>::splat_i(wb.w[m]),
                );
                acc[m] = Lanes::<T>::add(acc[m], Lanes::<T>::mul(d, Lanes::<T>::cvt(l)));
            }
        }
        if HAS_MIN {
            let s = Lanes::<T>::load(ab.s.as_ptr());
            for r in 0..R {
                let t = Lanes::<T>::mul(Lanes::<T>::splat(wbs[r].min), s);
                summ[r] = Lanes::<T>::add(summ[r], t);
            }
        }
    }
    for r in 0..R {
        let mut v = tree::<T>(acc[r]);
        if HAS_MIN {
            v = Lanes::<T>::add(v, summ[r]);
        }
        Lanes::<T>::store(out[r].as_mut_ptr(), v);
    }
}

/// The canonical tree `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))` of eight lane
/// registers, for `T` tokens at once.
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
        for (t, ot) in out.iter_mut().take(T).enumerate() {
            for (j, orow) in o[..take].iter().enumerate() {
                ot[r0 + r + j] = orow[t];
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
    let blank = WBlock {
        w: [0; 8],
        start: [0; 8],
        d: 0.0,
        min: 0.0,
    };
    let mut wp = vec![blank; chunk.min(m) * nb];
    let (out16, out8) = out[..acts.tokens].split_at_mut(acts.n16);
    for r0 in (0..m).step_by(chunk) {
        let mc = chunk.min(m - r0);
        let wp = &mut wp[..mc * nb];
        // The next chunk's weights, prefetched by the first group's tiles.
        let next = &w[(r0 + mc) * rb..(r0 + mc + chunk).min(m) * rb];
        let (next16, next8) = match acts.n16 {
            0 => (&[][..], next),
            _ => (next, &[][..]),
        };
        // SAFETY (all): this function's features and contract; `wp` holds rows
        // `r0..r0 + mc`.
        unsafe {
            prepare::<K>(&w[r0 * rb..(r0 + mc) * rb], wp);
            groups::<K, TOKENS, ROWS>(wp, nb, mc, r0, &acts.g16, out16, next16);
            groups::<K, TOKENS_8, ROWS_8>(wp, nb, mc, r0, &acts.g8, out8, next8);
        }
    }
}

/// Rows per chunk of [`tiles`]: each chunk's weights are prepared into a buffer of
/// about [`CHUNK_BYTES`], which all groups then read while it is in the cache; a
/// multiple of both tiles' rows, so that only the last chunk has 1-row tiles.
fn chunk_rows(nb: usize) -> usize {
    const STEP: usize = ROWS * ROWS_8;
    let per_row = nb.max(1) * std::mem::size_of::<WBlock>();
    (CHUNK_BYTES / per_row).div_ceil(STEP).max(1) * STEP
}

/// Prepared weight bytes per chunk of [`tiles`].
const CHUNK_BYTES: usize = 16 * 1024;

/// Every `R`-row tile (1-row at the end) of the `T`-token groups `ga` (`nb` blocks
/// each) against the `m` prepared rows `wp` (rows `r0..` of the product); `out` holds one
/// slice per real token of the groups (fewer than `T` in the last when it is padded).
/// The first group's tiles prefetch `ahead` (the raw weights of the next chunk), spread
/// over the rows, so that they arrive while the tiles compute rather than when they
/// are prepared.
///
/// # Safety
/// As [`tiles`]; `wp` is `m · nb` blocks, `ga` is `⌈out.len() / T⌉ · nb` blocks, every
/// slice of `out` holds at least `r0 + m` outputs.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn groups<K: Block32, const T: usize, const R: usize>(
    wp: &[WBlock],
    nb: usize,
    m: usize,
    r0: usize,
    ga: &[ABlock<T>],
    out: &mut [&mut [f32]],
    ahead: &[u8],
) where
    Lanes<T>: Simd,
{
    for (g, out) in out.chunks_mut(T).enumerate() {
        let ga = &ga[g * nb..(g + 1) * nb];
        each_row_tile::<T, R>(m, r0, out, |r, o| {
            if g == 0 {
                // This tile's share of `ahead`: its rows' fraction of the chunk.
                let take = if m - r >= R { R } else { 1 };
                let (a, b) = (ahead.len() * r / m, ahead.len() * (r + take) / m);
                for off in (a..b).step_by(64) {
                    // SAFETY: `off < ahead.len()`; a prefetch reads nothing.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.as_ptr().add(off) as *const i8) };
                }
            }
            let wr = &wp[r * nb..];
            // SAFETY (all): this function's features; `wr` holds the tile's rows.
            if let Ok(o) = <&mut [_; R]>::try_from(&mut *o) {
                match K::HAS_MIN {
                    true => unsafe { rows_tokens::<T, R, true>(wr, nb, ga, o) },
                    false => unsafe { rows_tokens::<T, R, false>(wr, nb, ga, o) },
                }
            } else if let Ok(o) = <&mut [_; 1]>::try_from(o) {
                match K::HAS_MIN {
                    true => unsafe { rows_tokens::<T, 1, true>(wr, nb, ga, o) },
                    false => unsafe { rows_tokens::<T, 1, false>(wr, nb, ga, o) },
                }
            }
        });
    }
}
