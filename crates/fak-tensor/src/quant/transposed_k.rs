//! Token-transposed 512-bit tiles for the multi-token product (prefill) of the
//! K-quants (Q4_K, Q5_K, Q6_K): sixteen tokens sit in the sixteen `i32` lanes of one
//! register, as in [`super::transposed`] for the 32-element types.
//!
//! A super-block's canonical lane sum (module docs of `quant`) is
//! `L[m] = Σ_g sc_{g,m} Σ_{k<4} w_{32g+4m+k} a_{32g+4m+k}` over its eight 32-element
//! groups `g`, with a sub-block scale `sc_{g,m}` (Q4_K/Q5_K: `sc_g`; Q6_K:
//! `sc_{2g + m/4}`). Here one register holds lane `m` of group `g` for sixteen tokens,
//! so per `(g, m)` two instructions serve sixteen `(row, token)` pairs: `vpmaddubsw`
//! multiplies the tokens' bytes by the row's four quants (broadcast) into `i16` pair
//! sums, and `vpdpwssd` multiplies those by the scale and adds both into the lane's
//! `i32` sum. The float steps (`d = ad · wd`, `acc + d · L`, the minimum term, the
//! canonical tree) then run once per super-block for the sixteen tokens.
//!
//! Every (row, token) lane performs exactly the operations of the scalar references
//! (`quant::vec_dot_q4_k_q8_k_ref`, `…q5_k…`, `…q6_k…`) in their order: the exact
//! integer `L[m]`, `d = ad · wd` rounded once, `acc + d · L` as a rounded multiply then
//! a rounded add in super-block order, the canonical tree across the eight lane
//! registers; Q4_K/Q5_K keep `summ + (ad · wmin) · M` (`M` = `Σ_g mn_g (bsum_{2g} +
//! bsum_{2g+1})`, exact) in super-block order and subtract it after the tree. So the
//! results are the same bits as every other kernel.
//!
//! Integer exactness. `vpmaddubsw` multiplies unsigned bytes by signed bytes and adds
//! adjacent pairs into `i16` with saturation; `vpdpwssd` multiplies `i16` pairs and
//! adds both products to the `i32` lane without saturation (Intel 64 and IA-32
//! Architectures Software Developer's Manual, Vol. 2, "PMADDUBSW", "VPDPWSSD"). The
//! activation byte `a` becomes the unsigned `a + 128` (`a XOR 0x80`, exact for every
//! `i8`) and the weight is the signed operand (Q4_K `[0, 15]`, Q5_K `[0, 31]`, Q6_K
//! `q − 32` in `[−32, 31]`), so a pair sum is at most `2 · 255 · 32 = 16,320` in
//! magnitude: no saturation. Each lane starts at the weight side's
//! `−128 · Σ_g sc_{g,m} Σ_k w`, prepared once per weight super-block ([`WBlock`]), so
//! `start + Σ_g sc (Σ_k (a + 128) w) = L[m]` exactly; no partial sum leaves `±2^25`
//! (`|sc| ≤ 128`). The minimum sum takes each token's `bsums` as the `i16` pairs they
//! are in memory, each pair times `(mn_g, mn_g)` by `vpdpwssd`: `mn_g bsum_{2g} + mn_g
//! bsum_{2g+1}`, exact for any `bsums` (`|M| ≤ 8 · 63 · 2 · 32768 < 2^25`).

use super::avx2::{unpack_k45, unpack_q6_k, KQuant};
use super::transposed::{each_row_tile, tree, ROWS, TOKENS};
use super::{f16_at, k4_scale_min, BlockQ8K};
use std::arch::x86_64::*;

/// One weight super-block prepared for the tile.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct WBlock {
    /// Lane `(g, m)` at `8g + m`: the signed quants `w_{32g+4m..32g+4m+4}`,
    /// little-endian.
    w: [i32; 64],
    /// The scale of lane `(g, m)` at `2g + m / 4`, as an `i16` pair `(sc, sc)`.
    sc: [i32; 16],
    /// Each lane's start value `−128 · Σ_g sc_{g,m} Σ_{k<4} w_{32g+4m+k}`.
    start: [i32; 8],
    /// Q4_K/Q5_K: the minimum `mn_g` of group `g` as an `i16` pair `(mn_g, mn_g)`.
    mn: [i32; 8],
    /// The super-block scale `f16(d)` and (Q4_K/Q5_K) minimum scale `f16(dmin)`,
    /// widened to `f32`.
    d: f32,
    dmin: f32,
}

/// Sixteen tokens' Q8_K blocks at one super-block index.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct ABlock {
    /// Lane `(g, m)` at `8g + m`: token `t`'s bytes `a_{32g+4m..32g+4m+4} + 128` as
    /// dword `t`.
    au: [[u32; TOKENS]; 64],
    /// Pair `j`: token `t`'s `(bsum_{2j}, bsum_{2j+1})` as dword `t`.
    bs: [[u32; TOKENS]; 8],
    /// The tokens' scales.
    d: [f32; TOKENS],
}

/// A product's Q8_K activation rows in tile form: the first `groups · 16` tokens,
/// group by group, each group's super-blocks in order (`blocks[g * nb + b]`).
pub(super) struct Acts {
    groups: usize,
    nb: usize,
    blocks: Vec<ABlock>,
}

impl Acts {
    /// The tile form of the first `⌊n / 16⌋ · 16` of `a`'s `n` token rows (`None`
    /// when there are fewer than 16, or the rows differ in length).
    pub(super) fn new(a: &[&[BlockQ8K]]) -> Option<Self> {
        let groups = a.len() / TOKENS;
        let nb = a.first()?.len();
        if groups == 0 || a.iter().any(|r| r.len() != nb) {
            return None;
        }
        let empty = ABlock {
            au: [[0; TOKENS]; 64],
            bs: [[0; TOKENS]; 8],
            d: [0.0; TOKENS],
        };
        let mut blocks = vec![empty; groups * nb];
        for g in 0..groups {
            for (t, row) in a[g * TOKENS..(g + 1) * TOKENS].iter().enumerate() {
                for (b, blk) in row.iter().enumerate() {
                    let ab = &mut blocks[g * nb + b];
                    ab.d[t] = blk.d;
                    for (j, q) in blk.qs.chunks_exact(4).enumerate() {
                        let bytes = [q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8];
                        ab.au[j][t] = u32::from_le_bytes(bytes) ^ 0x8080_8080;
                    }
                    for (j, p) in blk.bsums.chunks_exact(2).enumerate() {
                        ab.bs[j][t] = (p[0] as u16 as u32) | ((p[1] as u16 as u32) << 16);
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

/// The super-blocks of `w` (whole `kind` super-blocks) prepared as [`WBlock`]s, in
/// order.
///
/// # Safety
/// AVX2 and F16C; `w.len()` is a multiple of `kind`'s super-block bytes.
#[target_feature(enable = "avx2,f16c")]
unsafe fn prepare(w: &[u8], kind: KQuant) -> Vec<WBlock> {
    let bytes = match kind {
        KQuant::Q45 { bytes, .. } => bytes,
        KQuant::Q6 => 210,
    };
    let mut out = Vec::with_capacity(w.len() / bytes);
    let ones = _mm256_set1_epi8(1);
    for wb in w.chunks_exact(bytes) {
        let mut blk = WBlock {
            w: [0; 64],
            sc: [0; 16],
            start: [0; 8],
            mn: [0; 8],
            d: 0.0,
            dmin: 0.0,
        };
        let pair = |s: i16| (s as u16 as i32) | ((s as u16 as i32) << 16);
        // The signed quants per group, and each group's scales as `madd` multipliers
        // (lanes 0-3 in the low half, 4-7 in the high one).
        let (q, scales): ([__m256i; 8], [__m256i; 8]) = match kind {
            KQuant::Q45 { qs_at, qh_at, .. } => {
                let (sc, mn) = k4_scale_min(&wb[4..16]);
                for g in 0..8 {
                    blk.sc[2 * g] = pair(sc[g] as i16);
                    blk.sc[2 * g + 1] = pair(sc[g] as i16);
                    blk.mn[g] = pair(mn[g] as i16);
                }
                blk.d = f16_at(wb, 0);
                blk.dmin = f16_at(wb, 2);
                let q = unpack_k45(wb, qs_at, qh_at);
                (q, std::array::from_fn(|g| _mm256_set1_epi16(sc[g] as i16)))
            }
            KQuant::Q6 => {
                let s = |j: usize| (wb[192 + j] as i8) as i16;
                for j in 0..16 {
                    blk.sc[j] = pair(s(j));
                }
                blk.d = f16_at(wb, 208);
                let thirty_two = _mm256_set1_epi8(32);
                let q = unpack_q6_k(wb).map(|v| _mm256_sub_epi8(v, thirty_two));
                let scales = std::array::from_fn(|c| {
                    _mm256_set_m128i(_mm_set1_epi16(s(2 * c + 1)), _mm_set1_epi16(s(2 * c)))
                });
                (q, scales)
            }
        };
        // Σ_g sc_{g,m} Σ_k w per lane (exact: `maddubs` of 1 · w pairs, `madd` by the
        // scale), then times −128.
        let mut sum = _mm256_setzero_si256();
        for g in 0..8 {
            _mm256_storeu_si256(blk.w[8 * g..].as_mut_ptr() as *mut __m256i, q[g]);
            let p = _mm256_maddubs_epi16(ones, q[g]);
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, scales[g]));
        }
        let start = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum, 7));
        _mm256_storeu_si256(blk.start.as_mut_ptr() as *mut __m256i, start);
        out.push(blk);
    }
    out
}

/// `R` rows (`wp[r * nb..(r + 1) * nb]`) times the sixteen tokens of `ga` (`nb`
/// super-blocks); `out[r][t]` = row `r` times token `t`. `MIN`: Q4_K/Q5_K's minimum
/// term.
///
/// # Safety
/// AVX-512F/BW/DQ/VL and AVX512-VNNI; `wp.len() >= R * nb`, `ga.len() >= nb`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
unsafe fn rows_tokens<const R: usize, const MIN: bool>(
    wp: &[WBlock],
    nb: usize,
    ga: &[ABlock],
    out: &mut [[f32; TOKENS]; R],
) {
    debug_assert!(wp.len() >= R * nb && ga.len() >= nb);
    // acc[m][r]: lane m of row r.
    let mut acc = [[_mm512_setzero_ps(); R]; 8];
    let mut summ = [_mm512_setzero_ps(); R];
    for (b, ab) in ga[..nb].iter().enumerate() {
        let wbs: [&WBlock; R] = std::array::from_fn(|r| &wp[r * nb + b]);
        let ad = _mm512_load_ps(ab.d.as_ptr());
        // d = ad · wd for each token, rounded once (the reference's product).
        let d: [__m512; R] = std::array::from_fn(|r| _mm512_mul_ps(ad, _mm512_set1_ps(wbs[r].d)));
        for (m, acc) in acc.iter_mut().enumerate() {
            // Exact (module docs): start + Σ_g sc Σ_k (a + 128) w = L[m].
            let mut l: [__m512i; R] = std::array::from_fn(|r| _mm512_set1_epi32(wbs[r].start[m]));
            for g in 0..8 {
                let a = _mm512_load_si512(ab.au[8 * g + m].as_ptr() as *const __m512i);
                for r in 0..R {
                    let p = _mm512_maddubs_epi16(a, _mm512_set1_epi32(wbs[r].w[8 * g + m]));
                    let s = _mm512_set1_epi32(wbs[r].sc[2 * g + m / 4]);
                    l[r] = _mm512_dpwssd_epi32(l[r], p, s);
                }
            }
            for r in 0..R {
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(d[r], _mm512_cvtepi32_ps(l[r])));
            }
        }
        if MIN {
            for r in 0..R {
                let mut mi = _mm512_setzero_si512();
                for j in 0..8 {
                    let bs = _mm512_load_si512(ab.bs[j].as_ptr() as *const __m512i);
                    mi = _mm512_dpwssd_epi32(mi, bs, _mm512_set1_epi32(wbs[r].mn[j]));
                }
                let dmin = _mm512_mul_ps(ad, _mm512_set1_ps(wbs[r].dmin));
                summ[r] = _mm512_add_ps(summ[r], _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mi)));
            }
        }
    }
    for r in 0..R {
        let mut v = tree::<TOKENS>(std::array::from_fn(|m| acc[m][r]));
        if MIN {
            v = _mm512_sub_ps(v, summ[r]);
        }
        _mm512_storeu_ps(out[r].as_mut_ptr(), v);
    }
}

/// `out[t][r] = dot(row r of w, token t)` for the `m = w.len() / rb` rows of `kind`
/// super-blocks in `w` and the first [`Acts::tokens`] tokens (`out`'s slices of later
/// tokens are untouched).
///
/// # Safety
/// AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI; `rb` is `acts.nb` super-blocks of
/// `kind`, `w.len()` a multiple of `rb`, `out` holds at least [`Acts::tokens`] slices
/// of at least `m` outputs.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(super) unsafe fn tiles(w: &[u8], rb: usize, kind: KQuant, acts: &Acts, out: &mut [&mut [f32]]) {
    let nb = acts.nb;
    debug_assert!(nb > 0 && rb.is_multiple_of(nb) && w.len().is_multiple_of(rb));
    let m = w.len() / rb;
    let wp = prepare(w, kind);
    let min = matches!(kind, KQuant::Q45 { .. });
    for g in 0..acts.groups {
        let ga = &acts.blocks[g * nb..(g + 1) * nb];
        each_row_tile::<TOKENS, ROWS>(m, 0, &mut out[g * TOKENS..], |r, o| {
            let wr = &wp[r * nb..];
            // SAFETY (both): this function's features; `wr` holds the tile's rows.
            if let Ok(o) = <&mut [_; ROWS]>::try_from(&mut *o) {
                match min {
                    true => unsafe { rows_tokens::<ROWS, true>(wr, nb, ga, o) },
                    false => unsafe { rows_tokens::<ROWS, false>(wr, nb, ga, o) },
                }
            } else if let Ok(o) = <&mut [_; 1]>::try_from(o) {
                match min {
                    true => unsafe { rows_tokens::<1, true>(wr, nb, ga, o) },
                    false => unsafe { rows_tokens::<1, false>(wr, nb, ga, o) },
                }
            }
        });
    }
}
