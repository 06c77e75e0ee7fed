//! The row kernels of the 32-element types, generic over [`Block32`]: several rows
//! ([`rows`]), several rows and tokens ([`rows_tokens`]), their AVX-VNNI and 512-bit
//! forms, and the one-row dot ([`one`]) each format's `dot_*` calls.

use super::*;

/// `out[r] = dot(row r, a)` for `R` consecutive rows of `row_bytes` each, interleaved
/// so that the `R` independent float chains overlap; each row's own operations and
/// their order are exactly those of the single-row kernel (`R = 1`). `sc` holds
/// [`act_scales`] of `a`.
///
/// # Safety
/// AVX2 and F16C; `w.len() >= R * row_bytes`, `row_bytes == K::BYTES * a.len()`,
/// `sc.len() == a.len()`, `out.len() >= R`.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn rows<K: Block32, const R: usize>(
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
pub(in crate::quant) unsafe fn rows_vnni<K: Block32, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &[K::VAct],
    sc: &[[f32; 2]],
    out: &mut [f32],
) {
    rows_body::<K, Vnni, R>(w, row_bytes, a, sc, out)
}

/// [`rows_vnni`] with AVX512-VNNI's encoding of the lane sums ([`Evex`]), compiled with
/// AVX-512F/BW/VL (the same bits); for CPUs with AVX512-VNNI, which need not have
/// AVX-VNNI. `a` is [`vnni_acts512`] of the activation row.
///
/// # Safety
/// As [`rows`], and AVX-512F/BW/VL and AVX512-VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(in crate::quant) unsafe fn rows_vnni512<K: Block32, const R: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &[K::VAct],
    sc: &[[f32; 2]],
    out: &mut [f32],
) {
    rows_body::<K, Vnni512, R>(w, row_bytes, a, sc, out)
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
/// `a` is the activation row in its VNNI form ([`vnni_acts512`]).
///
/// # Safety
/// As [`rows`] with `R = 4`, and AVX-512F/BW/DQ/VL and AVX512-VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(in crate::quant) unsafe fn rows_pairs_512<K: Tile512>(
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
pub(in crate::quant) unsafe fn rows_tokens<K: Block32, const R: usize, const T: usize>(
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
pub(in crate::quant) unsafe fn rows_tokens_vnni<K: Block32, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: [&[K::VAct]; T],
    scs: [&[[f32; 2]]; T],
    out: &mut [[f32; R]; T],
) {
    rows_tokens_body::<K, Vnni, R, T>(w, row_bytes, acts, scs, out)
}

/// [`rows_tokens_vnni`] with AVX512-VNNI's encoding of the lane sums ([`Evex`]),
/// compiled with AVX-512F/BW/VL: the same operations on the same values (so the same
/// bits), with 32 vector registers to keep them in and Q8_0's reordering in one
/// instruction ([`Block32::unpack_vnni512`]). `acts[t]` is [`vnni_acts512`] of token
/// `t`'s activation row (the same values as [`vnni_acts`]).
///
/// # Safety
/// As [`rows_tokens`], and AVX-512F/BW/VL and AVX512-VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(in crate::quant) unsafe fn rows_tokens_vnni512<K: Block32, const R: usize, const T: usize>(
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
pub(super) unsafe fn one<K: Block32>(w: &[u8], a: &[K::Act]) -> f32
where
    K::Act: ActBlock,
{
    let mut out = [0f32];
    rows::<K, 1>(w, w.len(), a, &act_scales(a), &mut out);
    out[0]
}
