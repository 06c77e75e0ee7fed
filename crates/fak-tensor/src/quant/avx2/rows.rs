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
    let (mut v4, mut v1) = ([_mm_setzero_ps(); R], [0f32; R]);
    let mut acc = Accs {
        v4: &mut v4[..R / 4],
        v1: &mut v1,
    };
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
        let mut l = [_mm256_setzero_si256(); R];
        let mut d = [0f32; R];
        for r in 0..R {
            let at = r * row_bytes + b * K::BYTES;
            let wb = &w[at..at + K::BYTES];
            let (wd, wm) = K::wscales(wb);
            l[r] = I::lanes(I::unpack(wb), ab);
            d[r] = wd * ad;
            if K::HAS_MIN {
                summ[r] += wm * as_;
            }
        }
        acc.add(&d, &l);
    }
    for r in 0..R {
        out[r] = if K::HAS_MIN {
            acc.get(r) + summ[r]
        } else {
            acc.get(r)
        };
    }
}

/// [`rows`] for `2P` rows (`P` = 2 or 4 pairs) with 512-bit registers, two rows per
/// `vpdpbusd`: each block's lane sums of all the rows are totalled by integer adds into
/// one register (row `r`'s block sum `S` in the lanes [`pair_lane`] gives), so its
/// conversion, scale multiply and accumulate are one instruction each for all the rows.
/// Every row performs exactly the operations of the single-row kernel in the same order
/// (the exact block sum; `d = wd * ad` rounded once in `f32`; `acc + d * S` as a
/// rounded multiply then a rounded add), so the results are the same bits as [`rows`]
/// (and as the scalar reference).
///
/// The rows' f16 scale words are widened by one instruction and multiplied by the
/// activation's `[ad, as]` by one more, and the rows' min sums (Q4_1, Q5_1) run in
/// lanes of one register, each lane the scalar code's rounded product and rounded add
/// in the same order; Q4_0 and Q4_1 unpack two rows' nibbles at once
/// ([`Tile512::unpack_pair512`]); the block reads are bounds-checked once, up front.
/// That is fewer instructions per block than per-row scalar scales, separate unpacking
/// and per-read checks (docs/performance.md, "Why it is fast").
///
/// `a` is the activation row in its VNNI form ([`vnni_acts512`]).
///
/// # Safety
/// As [`rows`] with `R = 2P`, and AVX-512F/BW/DQ/VL and AVX512-VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(in crate::quant) unsafe fn rows_pairs_512<K: Tile512, const P: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &[K::VAct],
    sc: &[[f32; 2]],
    out: &mut [f32],
) {
    const { assert!(P == 2 || P == 4) };
    // Checked once here, so the block reads below need no bounds checks of their own.
    assert!(
        w.len() >= 2 * P * row_bytes
            && row_bytes >= a.len() * K::BYTES
            && out.len() >= 2 * P
            && sc.len() == a.len()
    );
    // Row r's accumulator in lane `pair_lane::<P>(r)` (and the lane beside it).
    let mut acc = _mm512_setzero_ps();
    // Lane 2r + 1: row r's running `summ` (the even lanes unused).
    let mut summ = _mm512_setzero_ps();
    // Row r's `d` (element 2r of the scale products) to row r's lanes.
    let spread = match P {
        2 => _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6),
        _ => _mm512_setr_epi32(0, 0, 8, 8, 2, 2, 10, 10, 4, 4, 12, 12, 6, 6, 14, 14),
    };
    let next = w
        .as_ptr()
        .wrapping_add((2 * P * row_bytes).max(PREFETCH_BYTES));
    let nta = nta_prefetch();
    let step = 2 * P * K::BYTES;
    // Without a minimum, the bytes after `d` are quants: zeroed rather than widened as
    // f16 (random bits, sometimes subnormal or NaN, which made the conversion slow).
    let keep = if K::HAS_MIN { u32::MAX } else { 0xffff };
    for ((b, ab), sc2) in a.iter().enumerate().zip(sc) {
        prefetch_weights(next.wrapping_add(b * step), step, nta);
        let aq = _mm512_broadcast_i64x4(K::vqs(ab));
        let base = _mm512_broadcast_i64x4(K::vbase(ab));
        // `[ad, as]` eight times. SAFETY: `sc2` is two `f32`s, read as one unaligned
        // 8-byte value.
        let act = _mm512_castpd_ps(_mm512_set1_pd(std::ptr::read_unaligned(
            sc2.as_ptr() as *const f64
        )));
        let mut l = [_mm512_setzero_si512(); 4];
        let mut h = [0u32; 8];
        for (pair, l) in l.iter_mut().take(P).enumerate() {
            let at_a = 2 * pair * row_bytes + b * K::BYTES;
            let at_b = at_a + row_bytes;
            // SAFETY: rows 0..2P of `row_bytes` each lie in `w`, and block `b <
            // a.len()` ends within its row, by the assertion above.
            let (wa, wb) = unsafe {
                (
                    w.get_unchecked(at_a..at_a + K::BYTES),
                    w.get_unchecked(at_b..at_b + K::BYTES),
                )
            };
            // Exact: the base and every product sum fit `i32` (as `lanes_vnni`).
            *l = _mm512_dpbusd_epi32(base, K::unpack_pair512(wa, wb), aq);
            h[2 * pair] = u32::from_le_bytes([wa[0], wa[1], wa[2], wa[3]]) & keep;
            h[2 * pair + 1] = u32::from_le_bytes([wb[0], wb[1], wb[2], wb[3]]) & keep;
        }
        // `[d0, m0, d1, m1, ..]` widened from f16 at once (`m` zero for the types
        // without a minimum), times `[ad, as, ..]`: each lane the one rounded product the
        // scalar code forms.
        // SAFETY: `h` is eight `u32`s, 32 bytes, read unaligned.
        let hv = _mm256_loadu_si256(h.as_ptr() as *const __m256i);
        let prod = _mm512_mul_ps(_mm512_cvtph_ps(hv), act);
        let d = _mm512_permutexvar_ps(spread, prod);
        let s = block_sums::<P>(l);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
        if K::HAS_MIN {
            summ = _mm512_add_ps(summ, prod);
        }
    }
    let mut v = [0f32; 16];
    _mm512_storeu_ps(v.as_mut_ptr(), acc);
    let mut m = [0f32; 16];
    _mm512_storeu_ps(m.as_mut_ptr(), summ);
    for r in 0..2 * P {
        let x = v[pair_lane::<P>(r)];
        out[r] = if K::HAS_MIN { x + m[2 * r + 1] } else { x };
    }
}

/// The lane of [`rows_pairs_512`]'s sums that holds row `r` of `2P`: `4r` for 4 rows;
/// for 8, `4r` for rows 0..4 and `4(r − 4) + 2` for rows 4..8.
#[inline(always)]
const fn pair_lane<const P: usize>(r: usize) -> usize {
    if P == 2 || r < 4 {
        4 * r
    } else {
        4 * (r - 4) + 2
    }
}

/// The block sums of `2P` rows from their `vpdpbusd` lane sums `l[..P]` (row pair `j`
/// in `l[j]`, its first row in the low 256 bits): row `r`'s in lane [`pair_lane`]`(r)`
/// and the lane after it. Exact integer adds (each lane sum within `±2^18`).
///
/// # Safety
/// AVX-512F (the caller has it enabled).
#[inline(always)]
unsafe fn block_sums<const P: usize>(l: [__m512i; 4]) -> __m512i {
    // 128-bit quarters: rows 2j, 2j + 1 of `l[j]` are quarters 0, 1 and 2, 3. Adding
    // each row's two quarters: [r0, r1, r2, r3] of four partial sums each.
    let rows4 = |a: __m512i, b: __m512i| {
        _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b),
        )
    };
    let x = rows4(l[0], l[1]);
    let x = match P {
        // Quarter c: row c's four partials, then pairs of them, then all four.
        2 => _mm512_add_epi32(x, _mm512_shuffle_epi32::<_MM_PERM_BADC>(x)),
        // Quarter c: rows c and c + 4, two partials each.
        _ => {
            let y = rows4(l[2], l[3]);
            _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y))
        }
    };
    _mm512_add_epi32(x, _mm512_shuffle_epi32::<_MM_PERM_CDAB>(x))
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
    // Pair (t, r) at index tR + r.
    let (mut v4, mut v1) = ([[_mm_setzero_ps(); R]; T], [[0f32; R]; T]);
    let mut acc = Accs {
        v4: &mut v4.as_flattened_mut()[..R * T / 4],
        v1: v1.as_flattened_mut(),
    };
    let mut summ = [[0f32; R]; T];
    let nb = acts[0].len();
    #[allow(clippy::needless_range_loop)] // `b` indexes every token's blocks
    for b in 0..nb {
        let mut l = [[_mm256_setzero_si256(); R]; T];
        let mut d = [[0f32; R]; T];
        for r in 0..R {
            let at = r * row_bytes + b * K::BYTES;
            let wb = &w[at..at + K::BYTES];
            let wq = I::unpack(wb);
            let (wd, wm) = K::wscales(wb);
            for t in 0..T {
                let ab = &acts[t][b];
                let [ad, as_] = scs[t][b];
                l[t][r] = I::lanes(wq, ab);
                d[t][r] = wd * ad;
                if K::HAS_MIN {
                    summ[t][r] += wm * as_;
                }
            }
        }
        acc.add(d.as_flattened(), l.as_flattened());
    }
    for t in 0..T {
        for r in 0..R {
            out[t][r] = if K::HAS_MIN {
                acc.get(t * R + r) + summ[t][r]
            } else {
                acc.get(t * R + r)
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
