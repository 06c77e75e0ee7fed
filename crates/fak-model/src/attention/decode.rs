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
//! When the groups do not divide evenly among the threads (SmolLM2's 3 on 2 threads;
//! Gemma 3's one KV head, whose K and V every thread would read whole), the step runs
//! as three hand-offs instead ([`by_ranges`]): the dots split by keys, the softmax by
//! heads, and the weighted sums by columns of the cache entry (one consecutive part of
//! every V row, holding whole heads or parts of them), so each thread reads an equal
//! share of the layer's K and V, and reads it front to back. The scores then cross
//! between the cores, which costs less than a thread that waits on another's whole
//! groups or reads the same rows again (docs/performance.md, "Why it is fast").
//!
//! Either way a block of keys is read as whole cache entries (every KV head's columns a
//! chunk needs, in one [`KvRows::for_cols`]), so a compact cache's row is widened once
//! for all its heads, and within a block every KV head's dots (and, where a chunk holds
//! whole groups, sums) are done for [`SUB_BLOCK`] keys before the next ones, so the
//! memory is read in order, each entry whole, not once per KV head at a stride.
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
use crate::kv::{KvRows, KvType};
use fak_tensor::ops::{
    scale_in_place, softmax_in_place, softmax_rows_in_place, weighted_rows_accumulate,
};
use fak_tensor::pool::{part_range, Disjoint};
use fak_tensor::{dot_strided_multi, parallel_chunks, Threads};

/// Keys per block when a chunk holds several KV heads: each block's dots (and then its
/// `Σ p·v`) are done for all of them before the next block, so the cache entries of a
/// block (every KV head's K row side by side, `kv_dim` elements) are read from memory
/// once rather than once per KV head. It pays once a layer's K and V outgrow the core's
/// L2 (long contexts); 8-key blocks were slower than one whole pass per KV head (with
/// the rows prefetched into L2, before [`SUB_BLOCK`]s within a block).
const KEY_BLOCK: usize = 128;

/// Keys per sub-block of a block: every KV head's dots (then sums) over [`SUB_BLOCK`]
/// keys before the next ones, so the cache entries are read front to back, each whole
/// once, where one pass per KV head over the block read a few lines of every entry in
/// each of several strided passes. On the Zen 5 a probe of the two kernels (SmolLM2's
/// shape, 30 layers' cache at 1,152 keys, one thread) went from ~17 / ~26 GB/s to ~40 /
/// ~44 GB/s with the prefetch into L1 ([`fak_tensor::cpu::amd_zen5_or_later`]; into L2
/// elsewhere). On a Zen 4, with its prefetch into L2, decode after a 2,048-token context
/// (SmolLM2 Q4_1, one thread) went 63–65 → 73–76 tokens/s against whole pieces; figures
/// in docs/performance.md ("Why it is fast"). 32 keys rather than 8: a sub-block's
/// entries (24 KB of SmolLM2's) still stay in L1 from one KV head's pass to the next,
/// and each kernel call's fixed cost (its prefetches, the lane reductions, the
/// accumulators loaded and stored) is spread over four times the keys; on the Zen 4 one
/// sequence's step over 128 keys went ~8 → ~6 µs on one thread, eight streams' batched
/// decode ~5% faster, a 2,048-token context level or better.
const SUB_BLOCK: usize = 32;

/// Consecutive sub-blocks of `0..n` of a piece of `rows`: [`SUB_BLOCK`] keys each (the
/// last shorter) where the piece is the `f32` cache's rows read in place, else the whole
/// piece at once. A compact cache's piece is widened into a buffer in the core's L1
/// ([`KvRows::for_cols`]), with no strided passes over memory to save, and 8-key calls
/// there only cost (SmolLM2 Q4_1 after 2,048 tokens, one thread: an `f16` cache 152–155
/// → 129–140 tokens/s, `q8_0` 130–138 → 128–130).
fn sub_blocks(rows: &KvRows<'_>, n: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let size = if rows.kv_type() == KvType::F32 {
        SUB_BLOCK
    } else {
        n.max(1)
    };
    (0..n).step_by(size).map(move |a| a..(a + size).min(n))
}

/// Attention of one token over cache entries `first..entries` of one layer:
/// `out[h] = Σ_j softmax_j(scale · q_h · k_j) · v_j` for every query head `h`, `j` over
/// those entries of `h`'s KV head (HF `eager_attention_forward` for one query row).
///
/// `q` is the token's `[heads × head_dim]` query (RoPE applied); `keys` and `values`
/// are the layer's `[entries, kv_dim]` cache (RoPE applied to the keys), in runs
/// ([`KvRows`]: where they break changes no bit); `scores` is
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
    keys: KvRows<'_>,
    values: KvRows<'_>,
    first: usize,
    entries: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    th: Threads,
) {
    let hd = s.head_dim;
    let len = entries - first;
    let out = &mut out[..s.heads * hd];
    if len == 0 {
        out.fill(0.0);
        return;
    }
    let kv_heads = s.heads / s.group;
    let parts = th.get().max(1);
    if parts > 1 && !kv_heads.is_multiple_of(parts) {
        let sc = ScoreRows { scores, first, len };
        return by_ranges(s, q, keys, values, sc, out, th);
    }
    // A chunk is a run of whole groups when there are groups enough for the threads
    // (as even a cut as whole groups allow), else a run of heads of one group: the
    // largest divisor of the group that gives every thread a chunk.
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
        // The chunk's KV heads are consecutive: columns `cols` of every cache entry.
        let cols = (h0 / s.group) * hd..((heads.end - 1) / s.group + 1) * hd;
        let mut j0 = 0;
        while j0 < len {
            let j1 = (j0 + KEY_BLOCK).min(len);
            keys.for_cols(first + j0..first + j1, cols.clone(), |rows, st, r| {
                for sb in sub_blocks(&keys, r.len()) {
                    let js = r.start - first + sb.start..r.start - first + sb.end;
                    let rows = &rows[sb.start * st..];
                    for (a, b, off) in runs() {
                        let (q, sc) = (&qs[a * hd..b * hd], &mut sc[a * len..b * len]);
                        let rows = &rows[off - cols.start..];
                        dots_for_heads(rows, st, q, hd, sc, len, js.clone());
                    }
                }
            });
            j0 = j1;
        }
        scale_in_place(sc, s.scale);
        softmax_for_heads(sc, len);
        o.fill(0.0);
        let mut j0 = 0;
        while j0 < len {
            let j1 = (j0 + KEY_BLOCK).min(len);
            values.for_cols(first + j0..first + j1, cols.clone(), |rows, st, r| {
                for sb in sub_blocks(&values, r.len()) {
                    let js = r.start - first + sb.start..r.start - first + sb.end;
                    let rows = &rows[sb.start * st..];
                    for (a, b, off) in runs() {
                        let (p, o) = (&sc[a * len..b * len], &mut o[a * hd..b * hd]);
                        let rows = &rows[off - cols.start..];
                        sums_for_heads(p, len, js.clone(), rows, st, o, hd);
                    }
                }
            });
            j0 = j1;
        }
    });
}

/// The scores of a decode step: `scores` is scratch for every head's row of `len`
/// scores, over the cache entries `first..first + len`.
struct ScoreRows<'a> {
    scores: &'a mut Vec<f32>,
    first: usize,
    len: usize,
}

/// [`decode_attention`] in three hand-offs, each thread reading an equal share of the
/// layer's K and V whatever the number of groups: chunk `c` of `parts` computes
///
/// 1. the dots of keys `part_range(len, parts, c)` for every query head, each group's
///    heads against its KV head's rows, [`KEY_BLOCK`] keys at a time for all groups;
/// 2. the scale and softmax of heads `part_range(heads, parts, c)`;
/// 3. columns `part_range` of the cache entries (in units of 16; the heads' output
///    elements those columns hold), the weighted sum over all keys, [`KEY_BLOCK`] keys
///    at a time.
///
/// Every score is one [`dot_strided_multi`] dot, every row's softmax
/// [`softmax_in_place`]'s, and every output element the ascending sum of
/// [`weighted_rows_accumulate`] (which the element range it is computed in does not
/// change): the same bits as [`decode_attention`]'s one hand-off and as one head at a
/// time.
fn by_ranges(
    s: AttentionShape,
    q: &[f32],
    keys: KvRows<'_>,
    values: KvRows<'_>,
    sc: ScoreRows<'_>,
    out: &mut [f32],
    th: Threads,
) {
    let hd = s.head_dim;
    let ScoreRows { scores, first, len } = sc;
    let kv_heads = s.heads / s.group;
    let parts = th.get().max(1);
    scores.clear();
    scores.resize(s.heads * len, 0.0);
    // The query heads of group `g` in runs of at most four (the multi-query kernels'
    // widest), as `(first head, heads)`.
    let runs = |g: usize| {
        let h0 = g * s.group;
        (h0..h0 + s.group)
            .step_by(4)
            .map(move |a| (a, (h0 + s.group - a).min(4)))
    };
    {
        let all = Disjoint::new(&mut scores[..]);
        parallel_chunks(parts, th, &|c| {
            let kr = part_range(len, parts, c);
            let mut j0 = kr.start;
            while j0 < kr.end {
                let j1 = (j0 + KEY_BLOCK).min(kr.end);
                keys.for_cols(first + j0..first + j1, 0..kv_heads * hd, |rows, st, r| {
                    for sb in sub_blocks(&keys, r.len()) {
                        let (r0, r1) = (r.start - first + sb.start, r.start - first + sb.end);
                        let rows = &rows[sb.start * st..];
                        for g in 0..kv_heads {
                            for (a, nh) in runs(g) {
                                // SAFETY: chunk `c` alone takes keys `kr` (the chunks' key
                                // ranges are disjoint), and of them `r0..r1` once, in
                                // every head's row: no part overlaps another chunk's or
                                // its own.
                                let part =
                                    |h: usize| unsafe { all.part(h * len + r0..h * len + r1) };
                                let q = &q[a * hd..(a + nh) * hd];
                                dots_into(&rows[g * hd..], st, q, hd, nh, part, a);
                            }
                        }
                    }
                });
                j0 = j1;
            }
        });
    }
    {
        let all = Disjoint::new(&mut scores[..]);
        parallel_chunks(parts, th, &|c| {
            let hr = part_range(s.heads, parts, c);
            // SAFETY: chunk `c` alone holds heads `hr` (the chunks' head ranges are
            // disjoint), whose score rows are one consecutive part.
            let rows = unsafe { all.part(hr.start * len..hr.end * len) };
            scale_in_place(rows, s.scale);
            softmax_for_heads(rows, len);
        });
    }
    let scores = &scores[..];
    let all_out = Disjoint::new(&mut out[..s.heads * hd]);
    let kvd = kv_heads * hd;
    let units = kvd.div_ceil(16);
    parallel_chunks(parts, th, &|c| {
        // Columns `c0..c1` of every cache entry (a consecutive part of the row, in
        // units of 16), and within them each KV head's elements `e0..e1`, at `off`.
        let ur = part_range(units, parts, c);
        let (c0, c1) = (ur.start * 16, (ur.end * 16).min(kvd));
        if c0 >= c1 {
            return;
        }
        let segs = || {
            (c0 / hd..c1.div_ceil(hd)).map(move |g| {
                let (a, b) = (c0.max(g * hd), c1.min((g + 1) * hd));
                (g, a - g * hd, b - g * hd, a - c0)
            })
        };
        for (g, e0, e1, _) in segs() {
            for h in g * s.group..(g + 1) * s.group {
                // SAFETY: chunk `c` alone takes columns `c0..c1` of the cache entries,
                // so elements `e0..e1` of the heads of group `g` (the chunks' column
                // ranges are disjoint); this part is zeroed and dropped before the
                // next one is taken.
                unsafe { all_out.part(h * hd + e0..h * hd + e1) }.fill(0.0);
            }
        }
        let mut j0 = 0;
        while j0 < len {
            let j1 = (j0 + KEY_BLOCK).min(len);
            // The whole piece per call, not in sub-blocks: each thread reads its
            // columns, a part of every entry, and 8-key calls were slower here
            // (SmolLM2 on 2 threads after 1,024 keys: 198–251 against 258–269 tokens/s).
            values.for_cols(first + j0..first + j1, c0..c1, |rows, st, r| {
                let (r0, r1) = (r.start - first, r.end - first);
                for (g, e0, e1, off) in segs() {
                    for (a, nh) in runs(g) {
                        // SAFETY: as above; the parts of one call are distinct heads'.
                        let part = |h: usize| unsafe { all_out.part(h * hd + e0..h * hd + e1) };
                        let p = |h: usize| &scores[h * len + r0..h * len + r1];
                        sums_into(p, &rows[off..], st, nh, part, a);
                    }
                }
            });
            j0 = j1;
        }
    });
}

/// The dots of `rows` (`KEY` rows at `stride`) against the `n` queries of `qs` (heads
/// `a..a + n`, `hd` elements each) into `part(h)` for each head `h`
/// ([`dot_strided_multi`], up to four queries).
fn dots_into<'p>(
    rows: &[f32],
    stride: usize,
    qs: &[f32],
    hd: usize,
    n: usize,
    part: impl Fn(usize) -> &'p mut [f32],
    a: usize,
) {
    fn go<'p, const N: usize>(
        rows: &[f32],
        stride: usize,
        (qs, hd): (&[f32], usize),
        part: impl Fn(usize) -> &'p mut [f32],
        a: usize,
    ) {
        let out: [&mut [f32]; N] = std::array::from_fn(|i| part(a + i));
        dot_strided_multi(rows, stride, self::rows::<N>(qs, hd), out);
    }
    match n {
        4 => go::<4>(rows, stride, (qs, hd), part, a),
        3 => go::<3>(rows, stride, (qs, hd), part, a),
        2 => go::<2>(rows, stride, (qs, hd), part, a),
        1 => go::<1>(rows, stride, (qs, hd), part, a),
        _ => unreachable!("runs of one to four heads"),
    }
}

/// `part(h) += Σ_j p(h)[j] · rows[j]` for heads `a..a + n`
/// ([`weighted_rows_accumulate`], up to four sums).
fn sums_into<'s, 'p>(
    p: impl Fn(usize) -> &'s [f32],
    rows: &[f32],
    stride: usize,
    n: usize,
    part: impl Fn(usize) -> &'p mut [f32],
    a: usize,
) {
    fn go<'s, 'p, const N: usize>(
        p: impl Fn(usize) -> &'s [f32],
        rows: &[f32],
        stride: usize,
        part: impl Fn(usize) -> &'p mut [f32],
        a: usize,
    ) {
        let ps: [&[f32]; N] = std::array::from_fn(|i| p(a + i));
        let out: [&mut [f32]; N] = std::array::from_fn(|i| part(a + i));
        weighted_rows_accumulate(ps, rows, stride, out);
    }
    match n {
        4 => go::<4>(p, rows, stride, part, a),
        3 => go::<3>(p, rows, stride, part, a),
        2 => go::<2>(p, rows, stride, part, a),
        1 => go::<1>(p, rows, stride, part, a),
        _ => unreachable!("runs of one to four heads"),
    }
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
    use crate::attention::test_util::{cut_runs, same_bits, values};
    use fak_tensor::{dot, weighted_rows_sum};

    /// One query head at a time with the single-head kernels.
    fn per_head(s: AttentionShape, q: &[f32], k: &[f32], v: &[f32], first: usize) -> Vec<f32> {
        let hd = s.head_dim;
        let kvd = s.heads / s.group * hd;
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
        let mut r = values(0x2545_f491_u64);
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
                // The cache in one run, and cut into runs (a shared prefix's): the
                // same bits wherever the runs break.
                let cuts: [&[usize]; 3] = [&[], &[entries / 3], &[1, entries / 2, entries - 1]];
                for (cut, threads) in cuts.iter().flat_map(|c| [1, 2, 3].map(|t| (c, t))) {
                    let runs = |x| cut_runs(x, kvd, cut, entries);
                    let mut out = vec![f32::NAN; heads * hd];
                    let mut scratch = Vec::new();
                    decode_attention(
                        s,
                        &q,
                        runs(&k),
                        runs(&v),
                        first,
                        entries,
                        &mut scratch,
                        &mut out,
                        Threads::new(threads),
                    );
                    assert!(
                        same_bits(&out, &want),
                        "heads {heads}/{kv_heads} × {hd}, entries {first}..{entries}, runs cut at {cut:?}, {threads} threads"
                    );
                }
            }
        }
    }
}
