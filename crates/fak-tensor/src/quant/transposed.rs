//! Token-transposed 512-bit tiles for the multi-token product (prefill) of the
//! 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): sixteen tokens sit in the
//! sixteen `i32` lanes of one register, and a row's eight canonical lane accumulators
//! (module docs of `quant`) are eight such registers.
//!
//! The other tiles keep a row's eight lanes side by side in one register, so every
//! (row, token, block) costs its own lane sum, conversion, scale multiply and add.
//! Here one register holds lane `m` of sixteen tokens, so each of those instructions
//! serves sixteen (row, token) pairs, and the block's combined scale `wd · ad` is
//! computed once per row and block for the sixteen tokens. Per lane `m` the weight's
//! four bytes are broadcast to all sixteen lanes (a `vpdpbusd` memory operand) and the
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

/// Tokens per tile: the `i32` lanes of a 512-bit register.
pub(super) const TOKENS: usize = 16;

/// Rows per tile: the sixteen accumulators of two rows and the activation register fit
/// the 32 vector registers.
pub(super) const ROWS: usize = 2;

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

/// Sixteen tokens' activation blocks at one block index: per lane `m`, sixteen dwords
/// (token `t`'s four bytes of lane `m`, each `+128` as an unsigned byte) and the
/// sixteen tokens' scales (`d`, and `s` for the types with a minimum) widened to `f32`.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct ABlock {
    au: [[u8; 64]; 8],
    d: [f32; TOKENS],
    s: [f32; TOKENS],
}

/// A product's activation rows in tile form: the first `groups · 16` tokens, group by
/// group, each group's blocks in order (`blocks[g * nb + b]`).
pub(super) struct Acts {
    groups: usize,
    nb: usize,
    blocks: Vec<ABlock>,
}

impl Acts {
    /// The tile form, for weights of type `K`, of the first `⌊n / 16⌋ · 16` of `a`'s
    /// `n` token rows (`None` when there are fewer than 16, or the rows differ in
    /// length).
    ///
    /// # Safety
    /// AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn new<K: Block32>(a: &[&[K::Act]]) -> Option<Self>
    where
        K::Act: ActBlock,
    {
        let groups = a.len() / TOKENS;
        let nb = a.first()?.len();
        if groups == 0 || a.iter().any(|r| r.len() != nb) {
            return None;
        }
        let empty = ABlock {
            au: [[0; 64]; 8],
            d: [0.0; TOKENS],
            s: [0.0; TOKENS],
        };
        let mut blocks = vec![empty; groups * nb];
        for g in 0..groups {
            for (t, row) in a[g * TOKENS..(g + 1) * TOKENS].iter().enumerate() {
                for (b, blk) in row.iter().enumerate() {
                    let ab = &mut blocks[g * nb + b];
                    [ab.d[t], ab.s[t]] = blk.scales();
                    // SAFETY: an activation block holds 32 quants.
                    let qs = std::slice::from_raw_parts(blk.qs_ptr(), 32);
                    for (m, lane) in ab.au.iter_mut().enumerate() {
                        for k in 0..4 {
                            lane[4 * t + k] = qs[K::LANE_ELEMENT(m, k)] ^ 0x80;
                        }
                    }
                }
            }
        }
        Some(Acts { groups, nb, blocks })
    }

    /// Tokens in tile form (a multiple of 16).
    pub(super) fn tokens(&self) -> usize {
        self.groups * TOKENS
    }
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

/// `R` rows (`wp[r * nb..(r + 1) * nb]`) times the sixteen tokens of `ga` (`nb`
/// blocks); `out[r][t]` = row `r` times token `t`.
///
/// # Safety
/// AVX-512F/BW/DQ/VL and AVX512-VNNI; `wp.len() >= R * nb`, `ga.len() >= nb`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn rows_tokens<const R: usize, const HAS_MIN: bool>(
    wp: &[WBlock],
    nb: usize,
    ga: &[ABlock],
    out: &mut [[f32; TOKENS]; R],
) {
    debug_assert!(wp.len() >= R * nb && ga.len() >= nb);
    let mut acc = [[_mm512_setzero_ps(); 8]; R];
    let mut summ = [_mm512_setzero_ps(); R];
    for (b, ab) in ga[..nb].iter().enumerate() {
        let ad = _mm512_load_ps(ab.d.as_ptr());
        let wbs: [&WBlock; R] = std::array::from_fn(|r| &wp[r * nb + b]);
        // d = wd · ad for each token, rounded once (the reference's scalar product).
        let d: [__m512; R] = std::array::from_fn(|r| _mm512_mul_ps(_mm512_set1_ps(wbs[r].d), ad));
        for (m, au) in ab.au.iter().enumerate() {
            let a = _mm512_load_si512(au.as_ptr() as *const __m512i);
            for ((acc, wb), d) in acc.iter_mut().zip(wbs).zip(d) {
                // Exact (module docs): start + Σ (a + 128) w = Σ a w.
                let l = _mm512_dpbusd_epi32(
                    _mm512_set1_epi32(wb.start[m]),
                    a,
                    _mm512_set1_epi32(wb.w[m]),
                );
                acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(d, _mm512_cvtepi32_ps(l)));
            }
        }
        if HAS_MIN {
            let s = _mm512_load_ps(ab.s.as_ptr());
            for r in 0..R {
                summ[r] = _mm512_add_ps(summ[r], _mm512_mul_ps(_mm512_set1_ps(wbs[r].min), s));
            }
        }
    }
    for r in 0..R {
        let mut v = tree(acc[r]);
        if HAS_MIN {
            v = _mm512_add_ps(v, summ[r]);
        }
        _mm512_storeu_ps(out[r].as_mut_ptr(), v);
    }
}

/// The canonical tree `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))` of eight lane
/// registers, for sixteen tokens at once.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn tree(l: [__m512; 8]) -> __m512 {
    let s = [
        _mm512_add_ps(l[0], l[4]),
        _mm512_add_ps(l[1], l[5]),
        _mm512_add_ps(l[2], l[6]),
        _mm512_add_ps(l[3], l[7]),
    ];
    _mm512_add_ps(_mm512_add_ps(s[0], s[2]), _mm512_add_ps(s[1], s[3]))
}

/// Every row tile of one 16-token group over `m` rows: `run(r, o)` fills `o` (`ROWS`
/// rows, or one at the end) with rows `r..` times the group's tokens, `o[j][t]`, which
/// goes to `out[t][r0 + r + j]`.
#[inline(always)]
pub(super) fn each_row_tile(
    m: usize,
    r0: usize,
    out: &mut [&mut [f32]],
    mut run: impl FnMut(usize, &mut [[f32; TOKENS]]),
) {
    let mut r = 0;
    while r < m {
        let take = if m - r >= ROWS { ROWS } else { 1 };
        let mut o = [[0f32; TOKENS]; ROWS];
        run(r, &mut o[..take]);
        for (j, orow) in o[..take].iter().enumerate() {
            for (t, &v) in orow.iter().enumerate() {
                out[t][r0 + r + j] = v;
            }
        }
        r += take;
    }
}

/// `out[t][r] = dot(row r of w, token t)` for the `m = w.len() / rb` rows of `K`
/// blocks in `w` and the first [`Acts::tokens`] tokens (`out`'s slices of later tokens
/// are untouched). Row chunk by row chunk ([`chunk_rows`]): the chunk's weights are
/// prepared, then every group runs its tiles over them, the first group's tiles
/// prefetching the next chunk's weights (without it, the preparation of each chunk
/// waited on memory).
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
    for r0 in (0..m).step_by(chunk) {
        let mc = chunk.min(m - r0);
        let wp = &mut wp[..mc * nb];
        // The next chunk's weights, prefetched by the first group's tiles.
        let next = &w[(r0 + mc) * rb..(r0 + mc + chunk).min(m) * rb];
        // SAFETY: this function's features and contract; `wp` holds rows `r0..r0 + mc`.
        unsafe { prepare::<K>(&w[r0 * rb..(r0 + mc) * rb], wp) };
        for g in 0..acts.groups {
            let ga = &acts.blocks[g * nb..(g + 1) * nb];
            each_row_tile(mc, r0, &mut out[g * TOKENS..], |r, o| {
                if g == 0 {
                    // This tile's share of `next`: its rows' fraction of the chunk.
                    let take = if mc - r >= ROWS { ROWS } else { 1 };
                    let (a, b) = (next.len() * r / mc, next.len() * (r + take) / mc);
                    for off in (a..b).step_by(64) {
                        // SAFETY: `off < next.len()`; a prefetch reads nothing.
                        unsafe { _mm_prefetch::<_MM_HINT_T0>(next.as_ptr().add(off) as *const i8) };
                    }
                }
                let wr = &wp[r * nb..];
                // SAFETY (all): this function's features; `wr` holds the tile's rows.
                if let Ok(o) = <&mut [_; ROWS]>::try_from(&mut *o) {
                    match K::HAS_MIN {
                        true => unsafe { rows_tokens::<ROWS, true>(wr, nb, ga, o) },
                        false => unsafe { rows_tokens::<ROWS, false>(wr, nb, ga, o) },
                    }
                } else if let Ok(o) = <&mut [_; 1]>::try_from(o) {
                    match K::HAS_MIN {
                        true => unsafe { rows_tokens::<1, true>(wr, nb, ga, o) },
                        false => unsafe { rows_tokens::<1, false>(wr, nb, ga, o) },
                    }
                }
            });
        }
    }
}

/// Rows per chunk of [`tiles`]: each chunk's weights are prepared into a buffer of
/// about [`CHUNK_BYTES`], which all groups then read while it is in the cache; a
/// multiple of the tile's rows, so that only the last chunk has a 1-row tile.
fn chunk_rows(nb: usize) -> usize {
    let per_row = nb.max(1) * std::mem::size_of::<WBlock>();
    (CHUNK_BYTES / per_row).div_ceil(ROWS).max(1) * ROWS
}

/// Prepared weight bytes per chunk of [`tiles`].
const CHUNK_BYTES: usize = 16 * 1024;
