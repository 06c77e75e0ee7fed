//! Attention for one new token (a decode step), by GQA group.
//!
//! In a decode step each query head attends over every cached key of its KV head, and
//! the query heads of one GQA group read the same K and V rows. Here one claimed chunk
//! is a run of whole groups, one run per thread (SmolLM2-135M's 3 groups of 3: all
//! three on 1 thread, two and one on 2), or a run of query heads of one group when
//! there are fewer groups than threads. Every K and V row is loaded once for all of a
//! group's heads ([`dot_strided_multi`], [`weighted_rows_accumulate`] with several
//! sums), a chunk's groups take the keys in blocks of [`KEY_BLOCK`] together, so a
//! cache entry is read once for all of them, and the scores stay in the core's cache
//! from the dots through the softmax to the weighted sum. Cutting the work finer, into
//! key and element ranges in several hand-offs, balances 2 threads better but was
//! slower: the scores then cross between the cores at each hand-off (docs/performance.md,
//! "Tried and kept out").
//!
//! Every value is computed by the same kernels in the same order as one query head at
//! a time: each key's score is [`fak_tensor::dot`]'s bits whichever of the
//! multi-query kernels computes it, a row's softmax is [`softmax_in_place`]'s (the
//! group's rows side by side, [`softmax_rows_in_place`]), and each
//! output element is the ascending sum of [`weighted_rows_accumulate`], which neither
//! the number of sums sharing a row load nor a split into consecutive key blocks
//! changes. So the result is bit-identical to the
//! per-head path a prefill takes, for any thread count (decode == prefill).

use super::AttentionShape;
use fak_tensor::ops::{softmax_in_place, softmax_rows_in_place, weighted_rows_accumulate};
use fak_tensor::pool::Disjoint;
use fak_tensor::{dot_strided_multi, parallel_chunks, Threads};

/// Keys per block when a chunk holds several KV heads: each block's dots (and then its
/// `Σ p·v`) are done for all of them before the next block, so the cache entries of a
/// block (every KV head's K row side by side, `kv_dim` elements) are read from memory
/// once rather than once per KV head. It pays once a layer's K and V outgrow the core's
/// L2 (long contexts); 8-key blocks were slower than one whole pass per KV head.
const KEY_BLOCK: usize = 128;

/// Attention of one token over cache entries `first..entries` of one layer:
/// `out[h] = Σ_j softmax_j(scale · q_h · k_j) · v_j` for every query head `h`, `j` over
/// those entries of `h`'s KV head (HF `eager_attention_forward` for one query row).
///
/// `q` is the token's `[heads × head_dim]` query (RoPE applied); `keys` and `values`
/// are the layer's `[entries, kv_dim]` cache (RoPE applied to the keys); `scores` is
/// scratch, resized here to `heads × (entries − first)` (no allocation when its
/// capacity already holds that); `out` receives `[heads × head_dim]`. Nothing else is
/// allocated.
///
/// # Panics
/// If the slices are shorter than the shape says, or `first > entries` (a programming
/// error, not bad input).
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_attention(
    s: AttentionShape,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    first: usize,
    entries: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    th: Threads,
) {
    let (hd, kvd) = (s.head_dim, s.kv_dim);
    let len = entries - first;
    let out = &mut out[..s.heads * hd];
    if len == 0 {
        out.fill(0.0);
        return;
    }
    // A chunk is a run of whole groups when there are groups enough for the threads
    // (as even a cut as whole groups allow), else a run of heads of one group: the
    // largest divisor of the group that gives every thread a chunk.
    let kv_heads = s.heads / s.group;
    let parts = th.get().max(1);
    let (chunks, per) = if kv_heads >= parts {
        (parts, s.group)
    } else {
        let per = (1..=s.group)
            .rev()
            .find(|&d| s.group.is_multiple_of(d) && s.heads / d >= parts)
            .unwrap_or(1);
        (s.heads / per, per)
    };
    // Chunk `c`'s heads, as runs of at most `per` heads each within one group.
    let chunk_heads = |c: usize| {
        if per == s.group {
            let (g0, g1) = (c * kv_heads / chunks, (c + 1) * kv_heads / chunks);
            g0 * s.group..g1 * s.group
        } else {
            c * per..(c + 1) * per
        }
    };
    scores.clear();
    scores.resize(s.heads * len, 0.0);
    // A chunk's heads are consecutive, so its score rows and outputs are one
    // consecutive part of each buffer, handed out without a list or a lock.
    let all_scores = Disjoint::new(&mut scores[..]);
    let all_out = Disjoint::new(out);
    parallel_chunks(chunks, th, &|c| {
        let heads = chunk_heads(c);
        let (h0, nc) = (heads.start, heads.len());
        // SAFETY: the pool calls each chunk index once, and chunk `c` alone holds the
        // heads `heads` (the chunks' head runs are disjoint), so these parts overlap no
        // other chunk's.
        let (sc, o) = unsafe {
            (
                all_scores.part(h0 * len..heads.end * len),
                all_out.part(h0 * hd..heads.end * hd),
            )
        };
        let qs = &q[h0 * hd..heads.end * hd];
        // The runs of the chunk's heads that share a KV head (`a..b` within the
        // chunk), with that KV head's offset in a cache entry.
        let runs = || {
            (0..nc)
                .step_by(per)
                .map(move |a| (a, (a + per).min(nc), ((h0 + a) / s.group) * hd))
        };
        // The keys in blocks, every run's dots for a block before the next block, so a
        // block's whole cache entries are read once for all the chunk's KV heads.
        let mut j0 = 0;
        while j0 < len {
            let j1 = (j0 + KEY_BLOCK).min(len);
            for (a, b, off) in runs() {
                let rows = &keys[(first + j0) * kvd + off..];
                let (q, sc) = (&qs[a * hd..b * hd], &mut sc[a * len..b * len]);
                dots_for_heads(rows, kvd, q, hd, sc, len, j0..j1);
            }
            j0 = j1;
        }
        sc.iter_mut().for_each(|x| *x *= s.scale);
        softmax_for_heads(sc, len);
        o.fill(0.0);
        let mut j0 = 0;
        while j0 < len {
            let j1 = (j0 + KEY_BLOCK).min(len);
            for (a, b, off) in runs() {
                let rows = &values[(first + j0) * kvd + off..];
                let (p, o) = (&sc[a * len..b * len], &mut o[a * hd..b * hd]);
                sums_for_heads(p, len, j0..j1, rows, kvd, o, hd);
            }
            j0 = j1;
        }
    });
}

/// The first `N` rows of `len` elements of `s`.
///
/// # Panics
/// If `s` holds fewer than `N` rows or `len` is 0.
fn rows<const N: usize>(s: &[f32], len: usize) -> [&[f32]; N] {
    let mut it = s.chunks_exact(len);
    std::array::from_fn(|_| it.next().expect("N whole rows"))
}

/// [`rows`], mutable.
fn rows_mut<const N: usize>(s: &mut [f32], len: usize) -> [&mut [f32]; N] {
    let mut it = s.chunks_exact_mut(len);
    std::array::from_fn(|_| it.next().expect("N whole rows"))
}

/// [`softmax_in_place`] of every `len`-element row of `rows`, up to four side by side
/// ([`softmax_rows_in_place`]: each row's sum is a chain of dependent adds in ascending
/// order, and side by side the chains of the group's heads overlap; the same bits).
fn softmax_for_heads(rows: &mut [f32], len: usize) {
    for r in rows.chunks_mut(4 * len) {
        match r.len() / len {
            4 => softmax_rows_in_place(rows_mut::<4>(r, len)),
            3 => softmax_rows_in_place(rows_mut::<3>(r, len)),
            2 => softmax_rows_in_place(rows_mut::<2>(r, len)),
            1 => softmax_in_place(r),
            _ => unreachable!("chunks of one to four rows"),
        }
    }
}

/// [`dot_strided_multi`] for any number of queries, up to four at a time: the dots of
/// `rows` (the cache entries of the keys `keys`, from the first of them) against the
/// `hd`-element query `i` of `qs` go to `scores[i * len..][keys]`. Nothing is allocated
/// (a decode step makes these calls for every block of keys of every layer).
fn dots_for_heads(
    rows: &[f32],
    stride: usize,
    qs: &[f32],
    hd: usize,
    scores: &mut [f32],
    len: usize,
    keys: std::ops::Range<usize>,
) {
    fn go<const N: usize>(
        rows: &[f32],
        stride: usize,
        (q, hd): (&[f32], usize),
        (o, len): (&mut [f32], usize),
        keys: &std::ops::Range<usize>,
    ) {
        let out = rows_mut::<N>(o, len).map(|o| &mut o[keys.clone()]);
        dot_strided_multi(rows, stride, self::rows::<N>(q, hd), out);
    }
    for (q, o) in qs.chunks(4 * hd).zip(scores.chunks_mut(4 * len)) {
        match q.len() / hd {
            4 => go::<4>(rows, stride, (q, hd), (o, len), &keys),
            3 => go::<3>(rows, stride, (q, hd), (o, len), &keys),
            2 => go::<2>(rows, stride, (q, hd), (o, len), &keys),
            1 => go::<1>(rows, stride, (q, hd), (o, len), &keys),
            _ => unreachable!("queries and outputs come in equal chunks"),
        }
    }
}

/// [`weighted_rows_accumulate`] for any number of sums, up to four at a time: the
/// `hd`-element output `i` of `outs` `+= Σ_j ps[i * len..][keys][j] · rows[j]` (`rows`
/// starting at the cache entry of the first key of `keys`). Nothing is allocated, as in
/// [`dots_for_heads`].
fn sums_for_heads(
    ps: &[f32],
    len: usize,
    keys: std::ops::Range<usize>,
    rows: &[f32],
    stride: usize,
    outs: &mut [f32],
    hd: usize,
) {
    fn go<const N: usize>(
        (p, len): (&[f32], usize),
        keys: &std::ops::Range<usize>,
        rows: &[f32],
        stride: usize,
        (o, hd): (&mut [f32], usize),
    ) {
        let p = self::rows::<N>(p, len).map(|p| &p[keys.clone()]);
        weighted_rows_accumulate(p, rows, stride, rows_mut::<N>(o, hd));
    }
    for (p, o) in ps.chunks(4 * len).zip(outs.chunks_mut(4 * hd)) {
        match p.len() / len {
            4 => go::<4>((p, len), &keys, rows, stride, (o, hd)),
            3 => go::<3>((p, len), &keys, rows, stride, (o, hd)),
            2 => go::<2>((p, len), &keys, rows, stride, (o, hd)),
            1 => go::<1>((p, len), &keys, rows, stride, (o, hd)),
            _ => unreachable!("weights and outputs come in equal chunks"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fak_tensor::{dot, weighted_rows_sum};

    /// One query head at a time with the single-head kernels.
    fn per_head(s: AttentionShape, q: &[f32], k: &[f32], v: &[f32], first: usize) -> Vec<f32> {
        let (hd, kvd) = (s.head_dim, s.kv_dim);
        let entries = k.len() / kvd;
        let mut out = vec![0f32; s.heads * hd];
        for h in 0..s.heads {
            let g = h / s.group;
            let qh = &q[h * hd..(h + 1) * hd];
            let mut sc: Vec<f32> = (first..entries)
                .map(|j| dot(&k[j * kvd + g * hd..j * kvd + (g + 1) * hd], qh) * s.scale)
                .collect();
            softmax_in_place(&mut sc);
            let rows = &v[first * kvd + g * hd..];
            weighted_rows_sum(&sc, rows, kvd, &mut out[h * hd..(h + 1) * hd]);
        }
        out
    }

    #[test]
    fn grouped_decode_attention_equals_one_head_at_a_time_bitwise() {
        let mut seed = 0x2545_f491_u64;
        let mut r = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        };
        // (heads, kv heads, head_dim): groups of 1, 2, 3, 4, 5 and 7; head sizes off
        // the 8- and 16-element grids too.
        for (heads, kv_heads, hd) in [
            (9, 3, 64),
            (4, 1, 32),
            (8, 4, 16),
            (5, 1, 24),
            (14, 2, 20),
            (6, 6, 8),
        ] {
            let kvd = kv_heads * hd;
            let s = AttentionShape {
                heads,
                group: heads / kv_heads,
                head_dim: hd,
                kv_dim: kvd,
                scale: 0.125,
            };
            for (entries, first) in [
                (1, 0),
                (7, 0),
                (9, 3),
                (64, 0),
                (133, 0),
                (133, 70),
                (300, 299),
                (300, 0),
                (386, 1),
            ] {
                let q: Vec<f32> = (0..heads * hd).map(|_| r()).collect();
                let k: Vec<f32> = (0..entries * kvd).map(|_| r()).collect();
                let v: Vec<f32> = (0..entries * kvd).map(|_| r()).collect();
                let want = per_head(s, &q, &k, &v, first);
                for threads in [1, 2, 3] {
                    let mut out = vec![f32::NAN; heads * hd];
                    let mut scratch = Vec::new();
                    decode_attention(
                        s,
                        &q,
                        &k,
                        &v,
                        first,
                        entries,
                        &mut scratch,
                        &mut out,
                        Threads::new(threads),
                    );
                    let same = out
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "heads {heads}/{kv_heads} × {hd}, entries {first}..{entries}, {threads} threads");
                }
            }
        }
    }
}
