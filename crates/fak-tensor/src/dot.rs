//! Dot products in the canonical order (see the crate docs), scalar and AVX2/FMA.

/// Number of lane accumulators in the canonical order (one AVX2 register of `f32`).
pub const LANES: usize = 8;

/// Horizontal reduction of eight lane accumulators in the canonical tree
/// `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
#[inline(always)]
pub fn reduce_lanes(l: &[f32; LANES]) -> f32 {
    let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let t = [s[0] + s[2], s[1] + s[3]];
    t[0] + t[1]
}

/// Scalar reference of the canonical dot product of `a` and `b` (equal lengths); `a`
/// may be a weight row of [`F16`](crate::F16) values, each widened exactly to `f32`.
///
/// Lane `j` accumulates `a[i]*b[i]` for `i ≡ j (mod 8)`, `i < n - n%8`, with a fused
/// multiply-add (`f32::mul_add`, one rounding) in ascending `i`; the lanes are reduced by
/// [`reduce_lanes`]; the tail is then fused in ascending order. This is the order every
/// fast kernel reproduces.
///
/// # Panics
/// If `a.len() != b.len()` (a programming error, not bad input).
pub fn dot_ref<W: WeightElem>(a: &[W], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot of unequal lengths");
    let n8 = a.len() / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (ca, cb) in a[..n8].chunks_exact(LANES).zip(b[..n8].chunks_exact(LANES)) {
        for j in 0..LANES {
            acc[j] = ca[j].to_f32().mul_add(cb[j], acc[j]);
        }
    }
    tail(a, b, n8, reduce_lanes(&acc))
}

// The CPU probes that choose these kernels live in `crate::cpu` with all the others.
pub use crate::cpu::{has_avx2_fma, has_avx512_f32};
use crate::WeightElem;

/// Canonical dot product, using AVX2/FMA when available; bit-identical to [`dot_ref`].
///
/// # Panics
/// If `a.len() != b.len()`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot of unequal lengths");
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        let mut out = [0f32; 1];
        // SAFETY: AVX2, FMA and F16C were detected at run time; `rows` has one row of
        // `a.len()` elements and `out` has room for one result.
        unsafe { avx2::dot_rows_strided::<1, 0, f32>(a, a.len(), b, &mut out) };
        return out[0];
    }
    dot_ref(a, b)
}

/// Dot products of `x` with `out.len()` rows laid out at a stride:
/// `out[j] = dot(&rows[j * stride..j * stride + x.len()], x)`, each bit-identical to
/// [`dot`] (and so to [`dot_ref`]). Attention uses it for `q · k_j` over the keys of one
/// KV head, which sit `kv_dim` apart in the cache; eight rows at a time keep eight
/// independent accumulator chains in flight where one [`dot`] per key waits on one.
///
/// # Panics
/// If `stride < x.len()` or `rows` is too short for `out.len()` rows (a programming
/// error, not bad input).
pub fn dot_strided(rows: &[f32], stride: usize, x: &[f32], out: &mut [f32]) {
    let (len, n) = (x.len(), out.len());
    if n == 0 {
        return;
    }
    assert!(
        stride >= len,
        "dot_strided: stride {stride} < row length {len}"
    );
    assert!(
        rows.len() >= (n - 1) * stride + len,
        "dot_strided: {} elements for {n} rows at stride {stride}",
        rows.len()
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        let mut j = 0;
        if has_avx512_f32() {
            while j + 8 <= n {
                let mut o = [[0f32; 8]; 1];
                // SAFETY: AVX2, FMA and AVX-512F/DQ were detected; rows j..j+8 lie inside
                // `rows` (checked above).
                unsafe {
                    avx2::dot_rows_strided_512::<4, 1>(&rows[j * stride..], stride, [x], &mut o)
                };
                out[j..j + 8].copy_from_slice(&o[0]);
                j += 8;
            }
        }
        while j + 8 <= n {
            // SAFETY: AVX2 and FMA were detected; rows j..j+8 lie inside `rows` (checked
            // above) and `out` has room for 8 results from `j`.
            unsafe {
                avx2::dot_rows_strided::<8, 0, f32>(&rows[j * stride..], stride, x, &mut out[j..])
            };
            j += 8;
        }
        while j < n {
            // SAFETY: as above, for one row.
            unsafe {
                avx2::dot_rows_strided::<1, 0, f32>(&rows[j * stride..], stride, x, &mut out[j..])
            };
            j += 1;
        }
        return;
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot_ref(&rows[j * stride..j * stride + len], x);
    }
}

/// Asks for rows `r` of `rows` (`len` elements each at `stride`) to be brought into the
/// core's cache ahead of their use. A prefetch never faults, so rows past the end of
/// `rows` are harmless; the addresses are formed with wrapping arithmetic and never read.
///
/// Where to ([`attention_prefetch_l1`]): into L1 (`prefetcht0`) on AMD's Zen 5 and
/// later, into L2 (`prefetcht1`) elsewhere.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn prefetch_rows(rows: &[f32], stride: usize, len: usize, r: std::ops::Range<usize>) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    let l1 = attention_prefetch_l1();
    for row in r {
        let at = rows.as_ptr().wrapping_add(row * stride) as *const i8;
        let mut b = 0;
        while b < 4 * len {
            // SAFETY: `prefetcht0`/`prefetcht1` are SSE (every x86_64 CPU) and never
            // fault or read into the program, whatever the address.
            unsafe {
                if l1 {
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(b))
                } else {
                    _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(b))
                }
            };
            b += 64;
        }
    }
}

/// Whether the decode attention kernels ([`prefetch_rows`] and
/// [`crate::ops::weighted_rows_accumulate`]'s rows) prefetch the K and V rows into L1
/// (`prefetcht0`) rather than L2 (`prefetcht1`): on AMD's Zen 5 and later
/// ([`crate::cpu::amd_zen5_or_later`]). With the cache entries read front to back a few
/// keys at a time for every KV head (`fak-model`'s decode attention), the Zen 5's
/// kernels read at ~42 GB/s into L1 and ~17 into L2 (a probe on one thread of SmolLM2's
/// shape, 30 layers' cache at 1,152 keys). On a Zen 4 the same reading order is faster
/// into L2: SmolLM2 Q4_1 decode after a 2,048-token context, one thread, 72–76 tokens/s
/// against 50–51 into L1, and after a 512-token prompt 117–121 against 92–100, where
/// prefetches into L1 hold the miss buffers that the kernels' own loads wait on. On an
/// Intel Xeon L2 was chosen under an earlier reading order and not measured since
/// (docs/performance.md, "Why it is fast").
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn attention_prefetch_l1() -> bool {
    crate::cpu::amd_zen5_or_later()
}

/// [`dot_strided`] for `Q` queries against the same rows:
/// `out[q][j] = dot(&rows[j * stride..j * stride + len], x[q])`, each bit-identical to
/// [`dot`]. With AVX-512 a register holds two rows' lanes and every row pair is loaded
/// once for the `Q` queries (a prefill's consecutive tokens against one KV head);
/// otherwise it is [`dot_strided`] per query.
///
/// # Panics
/// If the queries differ in length or the outputs in count, or as [`dot_strided`].
pub fn dot_strided_multi<const Q: usize>(
    rows: &[f32],
    stride: usize,
    x: [&[f32]; Q],
    mut out: [&mut [f32]; Q],
) {
    let (len, n) = (x[0].len(), out[0].len());
    assert!(
        x.iter().all(|q| q.len() == len) && out.iter().all(|o| o.len() == n),
        "dot_strided_multi: queries or outputs of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx512_f32() && n >= 8 {
        assert!(
            stride >= len,
            "dot_strided_multi: stride {stride} < row length {len}"
        );
        assert!(
            rows.len() >= (n - 1) * stride + len,
            "dot_strided_multi: {} elements for {n} rows at stride {stride}",
            rows.len()
        );
        let j = n / 8 * 8;
        // SAFETY: AVX2, FMA and AVX-512F/DQ were detected; rows 0..j lie inside `rows`
        // (checked above) and every output holds `n >= j` elements.
        unsafe { avx2::dot_strided_multi_512(rows, stride, x, &mut out, j) };
        // Rows j.. only if any are left: with `rows` as short as the contract allows,
        // `j * stride` lies past its end when `n` is a multiple of 8 and `stride > len`.
        if j < n {
            for (oq, xq) in out.iter_mut().zip(x) {
                dot_strided(&rows[j * stride..], stride, xq, &mut oq[j..]);
            }
        }
        return;
    }
    for (oq, xq) in out.iter_mut().zip(x) {
        dot_strided(rows, stride, xq, oq);
    }
}

/// Keys per tile of the key-tile layout that [`dot_key_tiles`] reads: a tile holds
/// [`KEY_TILE`] rows (a KV head's keys) of `len` elements transposed, element `i` of
/// key `c` at `tile[i * KEY_TILE + c]` ([`put_key_in_tile`]), so element `i` of all its
/// keys is one 512-bit register.
pub const KEY_TILE: usize = 16;

/// Writes `row` (`len` elements) as key `c` (`< KEY_TILE`) of `tile`
/// (`[len, KEY_TILE]`): `tile[i * KEY_TILE + c] = row[i]`.
///
/// # Panics
/// If `c >= KEY_TILE` or `tile` holds fewer than `row.len() * KEY_TILE` values (a
/// programming error, not bad input).
#[inline]
pub fn put_key_in_tile(tile: &mut [f32], c: usize, row: &[f32]) {
    assert!(c < KEY_TILE && tile.len() >= row.len() * KEY_TILE);
    for (i, v) in row.iter().enumerate() {
        tile[i * KEY_TILE + c] = *v;
    }
}

/// Dot products of `Q` queries with the keys of `count` consecutive tiles
/// ([`put_key_in_tile`]'s layout, `len = x[q].len()` elements per key, tile `t` at
/// `tiles[t * KEY_TILE * len..]`): `out[q][t * KEY_TILE + c] = dot(key c of tile t,
/// x[q])`, each bit-identical to [`dot`] (and so to [`dot_ref`]).
///
/// With AVX-512 every lane of a register is one key: the canonical order's eight lane
/// sums of a tile's sixteen keys are eight registers, each key's element `i` multiplied
/// by the query's element `i` broadcast and added in ascending `i` (lane `i mod 8`),
/// [`reduce_lanes`]' tree is seven adds of whole registers, and the tail is fused in
/// ascending order after it: the same operations on the same values as one key at a
/// time, with no horizontal reduction and each tile register loaded once for the `Q`
/// queries. Without AVX-512 the same order one key at a time.
///
/// # Panics
/// If the queries differ in length, `tiles` holds fewer than `count * KEY_TILE * len`
/// values or an output fewer than `count * KEY_TILE` (a programming error, not bad
/// input).
pub fn dot_key_tiles<const Q: usize>(
    tiles: &[f32],
    count: usize,
    x: [&[f32]; Q],
    mut out: [&mut [f32]; Q],
) {
    let len = x.first().map_or(0, |q| q.len());
    assert!(
        x.iter().all(|q| q.len() == len)
            && tiles.len() >= count * KEY_TILE * len
            && out.iter().all(|o| o.len() >= count * KEY_TILE),
        "dot_key_tiles: queries of different lengths, or short tiles or outputs"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx512_f32() {
        // SAFETY: AVX-512F was detected; `tiles` holds `count` tiles of `len * KEY_TILE`
        // values, every query `len` values and every output `count * KEY_TILE` (checked
        // above).
        unsafe { avx2::dot_key_tiles_512(tiles, count, x, &mut out) };
        return;
    }
    let n8 = len / LANES * LANES;
    for (oq, xq) in out.iter_mut().zip(x) {
        for t in 0..count {
            let tile = &tiles[t * KEY_TILE * len..];
            for c in 0..KEY_TILE {
                let mut acc = [0f32; LANES];
                for i in 0..n8 {
                    acc[i % LANES] = tile[i * KEY_TILE + c].mul_add(xq[i], acc[i % LANES]);
                }
                let mut s = reduce_lanes(&acc);
                for i in n8..len {
                    s = tile[i * KEY_TILE + c].mul_add(xq[i], s);
                }
                oq[t * KEY_TILE + c] = s;
            }
        }
    }
}

/// Tail of a dot product after the lane reduction: fused, ascending (`a`'s elements
/// widened exactly to `f32`).
#[inline(always)]
pub(crate) fn tail<W: WeightElem>(a: &[W], b: &[f32], start: usize, mut s: f32) -> f32 {
    for i in start..a.len() {
        s = a[i].to_f32().mul_add(b[i], s);
    }
    s
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! AVX2/FMA micro-kernels. Each computes every (row, token) dot product with one
    //! 8-lane accumulator in the canonical order, so they agree with `dot_ref` exactly.
    use super::{reduce_lanes, tail, LANES};
    use crate::WeightElem;
    use std::arch::x86_64::*;

    /// Stores a register's lanes and reduces them in the canonical tree.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let mut l = [0f32; LANES];
        _mm256_storeu_ps(l.as_mut_ptr(), v);
        reduce_lanes(&l)
    }

    /// `out[r] = dot(w[r * stride..r * stride + x.len()], x)` for `R` rows at a stride,
    /// in the canonical order (each row's 8 lanes in order, then [`tail`]); with
    /// `stride == x.len()` the rows are adjacent.
    ///
    /// With `AHEAD > 0` each row's weights `AHEAD` bytes past the ones being read are
    /// asked for (`prefetcht0`, one line per row per 64 bytes read), for rows that are
    /// each the head of a longer stream (the one-token product's `one_token_rows`
    /// streams): a hint only, never a read into the program, so the same bits. The
    /// addresses may lie past `w` (wrapping arithmetic, never dereferenced).
    ///
    /// The rows may be [`crate::F16`], widened as they are loaded (exactly: the bits of
    /// the rows widened beforehand).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `stride >= x.len()`,
    /// `w.len() >= (R - 1) * stride + x.len()`, `out.len() >= R`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows_strided<const R: usize, const AHEAD: usize, W: WeightElem>(
        w: &[W],
        stride: usize,
        x: &[f32],
        out: &mut [f32],
    ) {
        let len = x.len();
        debug_assert!(stride >= len && w.len() >= (R - 1) * stride + len && out.len() >= R);
        let n8 = len / LANES * LANES;
        let mut acc = [_mm256_setzero_ps(); R];
        let wp = w.as_ptr();
        let xp = x.as_ptr();
        let mut i = 0;
        while i < n8 {
            if AHEAD > 0 && i % (2 * LANES) == 0 {
                for r in 0..R {
                    let at = wp.wrapping_add(r * stride + i) as *const i8;
                    // A prefetch never faults or reads into the program, whatever the
                    // address (SSE, on every x86_64 CPU).
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(AHEAD));
                }
            }
            let xv = _mm256_loadu_ps(xp.add(i));
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(W::load8(wp.add(r * stride + i)), xv, *a);
            }
            i += LANES;
        }
        for r in 0..R {
            let row = &w[r * stride..r * stride + len];
            out[r] = tail(row, x, n8, hsum(acc[r]));
        }
    }

    /// [`dot_rows_strided`] for `2P` rows and `Q` queries with 512-bit registers: one
    /// register holds the eight lane accumulators of two rows (rows `2p`, `2p + 1` in
    /// its low and high halves) against a query in both halves, so one fused
    /// multiply-add serves both, and each row pair is loaded once for every query. Each
    /// lane performs exactly [`dot_rows_strided`]'s operations in its order, and each
    /// (row, query) is reduced by the same [`hsum`] and [`tail`] (eight rows with no
    /// tail by [`reduce_8_rows`], the same tree): the same bits.
    /// `out[q][r]` is row `r` times query `q`.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and AVX-512F/DQ; `2P <= 8`; every query of one
    /// length `len`, `stride >= len`, `w.len() >= (2P - 1) * stride + len`.
    #[target_feature(enable = "avx2,fma,avx512f,avx512dq")]
    pub unsafe fn dot_rows_strided_512<const P: usize, const Q: usize>(
        w: &[f32],
        stride: usize,
        x: [&[f32]; Q],
        out: &mut [[f32; 8]; Q],
    ) {
        let len = x[0].len();
        debug_assert!(stride >= len && w.len() >= (2 * P - 1) * stride + len && 2 * P <= 8);
        let n8 = len / LANES * LANES;
        let mut acc = [[_mm512_setzero_ps(); P]; Q];
        let wp = w.as_ptr();
        let mut i = 0;
        while i < n8 {
            let mut wv = [_mm512_setzero_ps(); P];
            for (p, v) in wv.iter_mut().enumerate() {
                let lo = _mm256_loadu_ps(wp.add(2 * p * stride + i));
                let hi = _mm256_loadu_ps(wp.add((2 * p + 1) * stride + i));
                *v = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(lo), hi);
            }
            for (q, qacc) in acc.iter_mut().enumerate() {
                let xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x[q].as_ptr().add(i)));
                for (a, v) in qacc.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(*v, xv, *a);
                }
            }
            i += LANES;
        }
        for (q, qacc) in acc.iter().enumerate() {
            // Eight rows (four pairs) with no tail: their lane sums reduced side by side.
            if let (Ok(a), true) = (<[__m512; 4]>::try_from(&qacc[..]), n8 == len) {
                _mm256_storeu_ps(out[q].as_mut_ptr(), reduce_8_rows(a));
                continue;
            }
            for (p, a) in qacc.iter().enumerate() {
                let halves = [_mm512_castps512_ps256(*a), _mm512_extractf32x8_ps::<1>(*a)];
                for (h, v) in halves.into_iter().enumerate() {
                    let r = 2 * p + h;
                    let row = &w[r * stride..r * stride + len];
                    out[q][r] = tail(row, x[q], n8, hsum(v));
                }
            }
        }
    }

    /// [`dot_rows_strided_512`] over rows `0..n` in blocks of eight (`n` a multiple of
    /// 8), each block's rows [`crate::ops::PREFETCH_ROWS`] ahead prefetched first:
    /// `out[q][j] = dot(rows[j * stride..][..len], x[q])`, the same bits as one row at a
    /// time. One call for the whole run, so the blocks' kernel inlines into the loop.
    ///
    /// # Safety
    /// As [`dot_rows_strided_512`] for every block: `rows.len() >= (n - 1) * stride +
    /// len` when `n > 0`, and every `out[q]` holds at least `n` elements.
    #[target_feature(enable = "avx2,fma,avx512f,avx512dq")]
    pub unsafe fn dot_strided_multi_512<const Q: usize>(
        rows: &[f32],
        stride: usize,
        x: [&[f32]; Q],
        out: &mut [&mut [f32]; Q],
        n: usize,
    ) {
        let len = x[0].len();
        debug_assert!(n.is_multiple_of(8) && out.iter().all(|o| o.len() >= n));
        let mut j = 0;
        while j < n {
            let mut o = [[0f32; 8]; Q];
            super::prefetch_rows(
                rows,
                stride,
                len,
                j + crate::ops::PREFETCH_ROWS..j + crate::ops::PREFETCH_ROWS + 8,
            );
            dot_rows_strided_512::<4, Q>(rows.get_unchecked(j * stride..), stride, x, &mut o);
            for (oq, r) in out.iter_mut().zip(&o) {
                oq.get_unchecked_mut(j..j + 8).copy_from_slice(r);
            }
            j += 8;
        }
    }

    /// [`super::dot_key_tiles`] with 512-bit registers: for each tile, register
    /// `acc[q][l]` holds lane `l`'s sum of query `q` for the sixteen keys, element `i`
    /// of the tile (sixteen keys' values, one load for every query) times query
    /// element `i` broadcast, in ascending `i`; the lanes are added in
    /// [`reduce_lanes`]' tree, then the tail elements are fused in ascending order.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; every query holds `len` values, `tiles` at least
    /// `count * KEY_TILE * len` and every output `count * KEY_TILE`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_key_tiles_512<const Q: usize>(
        tiles: &[f32],
        count: usize,
        x: [&[f32]; Q],
        out: &mut [&mut [f32]; Q],
    ) {
        const K: usize = super::KEY_TILE;
        let len = x.first().map_or(0, |q| q.len());
        debug_assert!(tiles.len() >= count * K * len && x.iter().all(|q| q.len() == len));
        debug_assert!(out.iter().all(|o| o.len() >= count * K));
        let n8 = len / LANES * LANES;
        for t in 0..count {
            let tp = tiles.as_ptr().add(t * K * len);
            let mut acc = [[_mm512_setzero_ps(); LANES]; Q];
            let mut i = 0;
            while i < n8 {
                for l in 0..LANES {
                    let kv = _mm512_loadu_ps(tp.add((i + l) * K));
                    for (a, xq) in acc.iter_mut().zip(&x) {
                        let xv = _mm512_set1_ps(*xq.get_unchecked(i + l));
                        a[l] = _mm512_fmadd_ps(kv, xv, a[l]);
                    }
                }
                i += LANES;
            }
            for ((a, xq), o) in acc.iter().zip(&x).zip(out.iter_mut()) {
                let mut s = _mm512_add_ps(
                    _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                    _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])),
                );
                for j in n8..len {
                    let kv = _mm512_loadu_ps(tp.add(j * K));
                    s = _mm512_fmadd_ps(kv, _mm512_set1_ps(*xq.get_unchecked(j)), s);
                }
                _mm512_storeu_ps(o.as_mut_ptr().add(t * K), s);
            }
        }
    }

    /// [`reduce_lanes`] of eight rows at once: `a[p]` holds the eight lane sums of
    /// rows `2p` (low half) and `2p + 1` (high half); the result's element `r` is row
    /// `r`'s `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`. The same adds of the same
    /// values as the scalar tree, each row in its own lanes, rearranged between the
    /// steps by shuffles (exact), so the same bits; a dot of 64 elements is four
    /// fused multiply-adds per row pair, and reducing each row through memory and
    /// scalar adds had cost several times that.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512dq")]
    fn reduce_8_rows(a: [__m512; 4]) -> __m256 {
        // Quarters of a[p]: (row 2p: l0-3, l4-7, row 2p+1: l0-3, l4-7).
        // s = [l0+l4, l1+l5, l2+l6, l3+l7], one row per quarter: rows 0-3, then 4-7.
        let lo01 = _mm512_shuffle_f32x4::<0b10_00_10_00>(a[0], a[1]);
        let hi01 = _mm512_shuffle_f32x4::<0b11_01_11_01>(a[0], a[1]);
        let lo23 = _mm512_shuffle_f32x4::<0b10_00_10_00>(a[2], a[3]);
        let hi23 = _mm512_shuffle_f32x4::<0b11_01_11_01>(a[2], a[3]);
        let s03 = _mm512_add_ps(lo01, hi01);
        let s47 = _mm512_add_ps(lo23, hi23);
        // t = [s0+s2, s1+s3]: quarter k holds (t0, t1) of row k, then of row k + 4.
        let e = _mm512_shuffle_ps::<0b01_00_01_00>(s03, s47);
        let f = _mm512_shuffle_ps::<0b11_10_11_10>(s03, s47);
        let t = _mm512_add_ps(e, f);
        // t0 + t1: quarter k holds row k, row k + 4 (then the same again).
        let g = _mm512_shuffle_ps::<0b10_00_10_00>(t, t);
        let h = _mm512_shuffle_ps::<0b11_01_11_01>(t, t);
        let r = _mm512_add_ps(g, h);
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r))
    }

    /// The token pairs that [`dot_tile_512`] reads, at offset `o` (the returned value)
    /// of `pairs`: for tokens `2p` and `2p + 1` of `x` (`[n, cols]`, `n` even),
    /// `pairs[o + p * 2 * n8 + 2 * i..][..16]` holds elements `i..i + 8` of token `2p`
    /// then of token `2p + 1`, for each `i` a multiple of 8 below `n8 = cols / 8 * 8`
    /// (the tail elements are read from `x` itself). `pairs` is cleared and refilled:
    /// `o < 16` leading zeros, then `n / 2 * 2 * n8` floats, a copy of the activations
    /// laid out so that the tile loads each pair's register with one load rather than
    /// two loads and an insert (the inserts share the port of one of an Intel core's
    /// two 512-bit FMA units).
    ///
    /// `pairs[o..]` starts on a 64-byte boundary, and each pair's 16 floats are 64
    /// bytes at a multiple of 64 from it, so no load of the tile spans two cache lines.
    /// A `Vec<f32>` is only 4-byte aligned by its type (16 by the allocator here), and
    /// with the pairs unaligned every one of the tile's four pair loads per step was
    /// split over two cache lines.
    pub fn pair_tokens(x: &[f32], n: usize, cols: usize, pairs: &mut Vec<f32>) -> usize {
        let n8 = cols / LANES * LANES;
        pairs.clear();
        pairs.reserve(16 + n / 2 * 2 * n8);
        // Elements to skip to the first 64-byte boundary; the reservation above covers
        // them, so the pushes below do not move the buffer.
        let o = pairs.as_ptr().align_offset(64).min(15);
        pairs.resize(o, 0.0);
        for p in 0..n / 2 {
            let (a, b) = (&x[2 * p * cols..][..n8], &x[(2 * p + 1) * cols..][..n8]);
            for (ca, cb) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
                pairs.extend_from_slice(ca);
                pairs.extend_from_slice(cb);
            }
        }
        o
    }

    /// [`dot_tile`] for `R` rows × `2P` tokens with 512-bit registers: one register
    /// holds a row's eight lane accumulators for two tokens (tokens `2p`, `2p + 1` in
    /// its low and high halves), so one fused multiply-add serves both. The tokens come
    /// as [`pair_tokens`] lays them out (`pairs`, from the tile's first pair on) and as
    /// rows of `x` (`[2P, cols]`) for the tail. Each lane performs exactly
    /// [`dot_tile`]'s operations in its order, and each (row, token) is reduced by the
    /// same [`hsum`] and [`tail`] (or, for a row's eight tokens when `P == 4` and `cols`
    /// is a multiple of 8, by [`reduce_8_rows`], the same tree on the same values): the
    /// same bits.
    ///
    /// The rows may be [`crate::F16`], widened as they are loaded (the same bits).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA, F16C and AVX-512F/DQ; `w.len() >= R*cols`,
    /// `x.len() >= 2P*cols`, `pairs.len() >= P * 2 * (cols / 8 * 8)`,
    /// `out.len() >= (2P-1)*ldo + R`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
    pub unsafe fn dot_tile_512<const R: usize, const P: usize, W: WeightElem>(
        w: &[W],
        pairs: &[f32],
        x: &[f32],
        cols: usize,
        out: &mut [f32],
        ldo: usize,
    ) {
        let n8 = cols / LANES * LANES;
        debug_assert!(w.len() >= R * cols && x.len() >= 2 * P * cols);
        debug_assert!(pairs.len() >= P * 2 * n8);
        debug_assert!(out.len() >= (2 * P - 1) * ldo + R);
        if n8 == 0 {
            // Rows shorter than a register: the tails alone (from the +0.0 that the lane
            // sums of zero registers reduce to).
            for r in 0..R {
                for t in 0..2 * P {
                    let (row, xt) = (&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    out[t * ldo + r] = tail(row, xt, 0, 0.0);
                }
            }
            return;
        }
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let wp = w.as_ptr();
        let pp = pairs.as_ptr();
        let mut i = 0;
        // At least one step (`n8 > 0`): the accumulators are then always the loop's
        // registers, and the compiler no longer zeroes a stack copy of all `R × P` of
        // them (1.5 KB for the 6 × 4 tile, a `memset` call) on every call in case the
        // loop is skipped; that call showed in a prefill's profile.
        loop {
            let mut xv = [_mm512_setzero_ps(); P];
            for (p, v) in xv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(pp.add(p * 2 * n8 + 2 * i));
            }
            for (r, row_acc) in acc.iter_mut().enumerate() {
                let wv = _mm512_broadcast_f32x8(W::load8(wp.add(r * cols + i)));
                for (p, a) in row_acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(wv, xv[p], *a);
                }
            }
            i += LANES;
            if i >= n8 {
                break;
            }
        }
        for (r, row_acc) in acc.iter().enumerate() {
            // Eight tokens (four pairs) with no tail: their lane sums reduced side by
            // side, then written to their rows of `out`.
            if let (Ok(a), true) = (<[__m512; 4]>::try_from(&row_acc[..]), n8 == cols) {
                let mut o = [0f32; 8];
                _mm256_storeu_ps(o.as_mut_ptr(), reduce_8_rows(a));
                for (t, v) in o.into_iter().enumerate() {
                    out[t * ldo + r] = v;
                }
                continue;
            }
            let row = &w[r * cols..(r + 1) * cols];
            for (p, a) in row_acc.iter().enumerate() {
                let halves = [_mm512_castps512_ps256(*a), _mm512_extractf32x8_ps::<1>(*a)];
                for (h, v) in halves.into_iter().enumerate() {
                    let t = 2 * p + h;
                    let xt = &x[t * cols..(t + 1) * cols];
                    out[t * ldo + r] = tail(row, xt, n8, hsum(v));
                }
            }
        }
    }

    /// Micro-kernel for `R` rows × `T` tokens: `out[t*ldo + r] = dot(w_r, x_t)`.
    ///
    /// The rows may be [`crate::F16`], widened as they are loaded (the same bits).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `w.len() >= R*cols`, `x.len() >= T*cols`,
    /// `out.len() >= (T-1)*ldo + R`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_tile<const R: usize, const T: usize, W: WeightElem>(
        w: &[W],
        x: &[f32],
        cols: usize,
        out: &mut [f32],
        ldo: usize,
    ) {
        debug_assert!(w.len() >= R * cols && x.len() >= T * cols);
        debug_assert!(out.len() >= (T - 1) * ldo + R);
        let n8 = cols / LANES * LANES;
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let wp = w.as_ptr();
        let xp = x.as_ptr();
        let mut i = 0;
        while i < n8 {
            let mut xv = [_mm256_setzero_ps(); T];
            for (t, v) in xv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(xp.add(t * cols + i));
            }
            for (r, row_acc) in acc.iter_mut().enumerate() {
                let wv = W::load8(wp.add(r * cols + i));
                for (t, a) in row_acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wv, xv[t], *a);
                }
            }
            i += LANES;
        }
        for (r, row_acc) in acc.iter().enumerate() {
            let row = &w[r * cols..(r + 1) * cols];
            for (t, a) in row_acc.iter().enumerate() {
                let xt = &x[t * cols..(t + 1) * cols];
                out[t * ldo + r] = tail(row, xt, n8, hsum(*a));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn dot_simd_matches_reference_bitwise() {
        let mut s = 7u64;
        for n in [0usize, 1, 7, 8, 9, 15, 16, 63, 64, 576, 1537] {
            let a: Vec<f32> = (0..n).map(|_| lcg(&mut s) * 3.0).collect();
            let b: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            assert_eq!(dot(&a, &b).to_bits(), dot_ref(&a, &b).to_bits(), "n={n}");
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn token_pairs_start_on_a_cache_line_and_interleave_each_pair() {
        // Five tokens (the last has no pair) of 19 elements (a tail of 3 past the 16 the
        // pairs hold); buffers of many prior capacities, so their allocations start at
        // various offsets within a cache line.
        let (n, cols, n8) = (5usize, 19usize, 16usize);
        let mut s = 3u64;
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s)).collect();
        for cap in 0..48 {
            let mut pairs: Vec<f32> = Vec::with_capacity(cap);
            pairs.extend((0..cap).map(|i| i as f32));
            let o = avx2::pair_tokens(&x, n, cols, &mut pairs);
            assert!(o < 16, "offset {o}");
            assert_eq!(pairs[o..].as_ptr() as usize % 64, 0, "capacity {cap}");
            assert_eq!(pairs.len(), o + n / 2 * 2 * n8, "capacity {cap}");
            for p in 0..n / 2 {
                for i in (0..n8).step_by(8) {
                    for j in 0..8 {
                        let at = o + p * 2 * n8 + 2 * i;
                        assert_eq!(pairs[at + j], x[2 * p * cols + i + j]);
                        assert_eq!(pairs[at + 8 + j], x[(2 * p + 1) * cols + i + j]);
                    }
                }
            }
        }
    }

    /// Strided-dot shapes `(len, stride, rows)`, the first with the row count given.
    /// The last two have rows no longer than the contract asks (`(n - 1) * stride +
    /// len`), `n` a multiple of 8 with `stride > len`: nothing may be sliced past the
    /// last row.
    fn strided_cases(first_rows: usize) -> [(usize, usize, usize); 6] {
        [
            (64, 192, first_rows),
            (9, 9, 8),
            (7, 30, 3),
            (64, 64, 0),
            (7, 30, 8),
            (64, 80, 16),
        ]
    }

    /// `n` rows of `len` at `stride`, exactly as long as the contract asks.
    fn strided_rows(len: usize, stride: usize, n: usize, s: &mut u64) -> Vec<f32> {
        (0..(n.max(1) - 1) * stride + len).map(|_| lcg(s)).collect()
    }

    #[test]
    fn strided_dots_equal_single_dots_bitwise() {
        let mut s = 13u64;
        for (len, stride, n) in strided_cases(21) {
            let rows = strided_rows(len, stride, n, &mut s);
            let x: Vec<f32> = (0..len).map(|_| lcg(&mut s) * 2.0).collect();
            let mut got = vec![f32::NAN; n];
            dot_strided(&rows, stride, &x, &mut got);
            for (j, g) in got.iter().enumerate() {
                let want = dot_ref(&rows[j * stride..j * stride + len], &x);
                assert_eq!(
                    g.to_bits(),
                    want.to_bits(),
                    "len={len} stride={stride} j={j}"
                );
            }
        }
    }

    #[test]
    fn multi_query_strided_dots_equal_single_dots_bitwise() {
        let mut s = 17u64;
        for (len, stride, n) in strided_cases(37) {
            let rows = strided_rows(len, stride, n, &mut s);
            let xs: Vec<Vec<f32>> = (0..4)
                .map(|_| (0..len).map(|_| lcg(&mut s) * 2.0).collect())
                .collect();
            let mut got = vec![vec![f32::NAN; n]; 4];
            {
                let [a, b, c, d] = &mut got[..] else {
                    unreachable!()
                };
                dot_strided_multi(
                    &rows,
                    stride,
                    [&xs[0], &xs[1], &xs[2], &xs[3]],
                    [a, b, c, d],
                );
            }
            for (q, gq) in got.iter().enumerate() {
                for (j, g) in gq.iter().enumerate() {
                    let want = dot_ref(&rows[j * stride..j * stride + len], &xs[q]);
                    assert_eq!(g.to_bits(), want.to_bits(), "len={len} q={q} j={j}");
                }
            }
        }
    }

    #[test]
    fn key_tile_dots_equal_single_dots_bitwise() {
        let mut s = 19u64;
        // Key lengths on and off the 8-element grid (a tail of 1 to 7), and none; three
        // tiles.
        for len in [0usize, 1, 7, 8, 9, 20, 64, 100, 256] {
            let keys: Vec<Vec<f32>> = (0..3 * KEY_TILE)
                .map(|_| (0..len).map(|_| lcg(&mut s) * 3.0).collect())
                .collect();
            let mut tiles = vec![f32::NAN; 3 * len * KEY_TILE];
            for (j, k) in keys.iter().enumerate() {
                let tile = &mut tiles[j / KEY_TILE * len * KEY_TILE..];
                put_key_in_tile(tile, j % KEY_TILE, k);
            }
            let xs: Vec<Vec<f32>> = (0..3)
                .map(|_| (0..len).map(|_| lcg(&mut s)).collect())
                .collect();
            let mut got = vec![vec![f32::NAN; 3 * KEY_TILE]; 3];
            let [g0, g1, g2] = &mut got[..] else {
                unreachable!()
            };
            dot_key_tiles(&tiles, 3, [&xs[0], &xs[1], &xs[2]], [g0, g1, g2]);
            let mut one = vec![f32::NAN; 3 * KEY_TILE];
            dot_key_tiles(&tiles, 3, [&xs[2]], [&mut one]);
            for (q, gq) in got.iter().enumerate() {
                for (j, g) in gq.iter().enumerate() {
                    let want = dot_ref(&keys[j], &xs[q]);
                    assert_eq!(g.to_bits(), want.to_bits(), "len={len} q={q} key={j}");
                }
            }
            assert!(one
                .iter()
                .zip(&got[2])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn reference_is_not_naive_order() {
        // The canonical order differs from a plain left-to-right sum on ordinary data,
        // so a kernel that silently used another order would be caught by the tests.
        let mut s = 11u64;
        let differs = (0..50).any(|_| {
            let a: Vec<f32> = (0..576).map(|_| lcg(&mut s)).collect();
            let b: Vec<f32> = (0..576).map(|_| lcg(&mut s)).collect();
            let naive = a
                .iter()
                .zip(&b)
                .fold(0f32, |acc, (x, y)| x.mul_add(*y, acc));
            naive.to_bits() != dot_ref(&a, &b).to_bits()
        });
        assert!(differs);
    }
}
