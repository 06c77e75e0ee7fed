//! Attention for the new tokens of a prefill (more than one token in a pass).
//!
//! One chunk per (block of up to [`QB`] consecutive tokens, KV head): each writes its
//! own output slices, with the same kernels in the same order whichever thread runs it.
//! In a block the tokens and the GQA group's query heads share every K and V row load
//! over the keys the tokens all see; each (token, head, key) still gets exactly the
//! canonical dot and each output the ascending sum, so the bits are those of one token
//! and one head at a time (decode == prefill).
//!
//! With AVX-512 the scores come from the keys laid out once per layer in tiles of
//! sixteen keys, element-major ([`key_tiles`]), so one register holds an element of
//! sixteen keys and the canonical order's lane sums are whole registers
//! ([`fak_tensor::dot_key_tiles`]): no horizontal reduction per key. A SmolLM2-shaped
//! layer (9 heads, 3 KV heads of 64, 512 tokens) on one thread of a Zen 4: ~7.3 →
//! ~5.9 ms for the whole attention. Without AVX-512 the rows are read where they lie
//! ([`group_scores`]).

use super::AttentionShape;
use crate::kv::{window_start, KvRows};
use fak_tensor::pool::Disjoint;
use fak_tensor::{
    dot_key_tiles, dot_strided, dot_strided_multi, parallel_chunks, put_key_in_tile,
    scale_in_place, softmax_in_place, softmax_rows_in_place, weighted_rows_accumulate, Threads,
    KEY_TILE,
};

/// Tokens per block: the tokens of a block share the K and V row loads of the keys they
/// all see.
const QB: usize = 4;

/// Keys per step of a block's shared range: each step's K (then V) rows of the KV head
/// are read for every query head of the group before the next step, so they come from
/// memory once per block and from the core's L1 cache for the group's other heads (64
/// rows of a 64-element head: 16 KB).
const KEY_STEP: usize = 64;

/// Attention of the last `n` of a layer's cache entries over the entries each sees:
/// for new token `t` (entry `end = entries − n + t`) and every query head `h`,
/// `out[t][h] = Σ_j softmax_j(scale · q_{t,h} · k_j) · v_j`, `j` from the window's start
/// ([`window_start`]) to `end` (HF `eager_attention_forward` with a causal mask).
///
/// `q` is the new tokens' `[n, heads × head_dim]` queries (RoPE applied); `keys` and
/// `values` are the layer's `[entries, kv_dim]` cache (RoPE applied to the keys, the new
/// tokens' rows already appended), in runs ([`KvRows`]: where they break changes no
/// bit); `positions` holds every entry's position
/// (`[entries]`); `window` is the layer's sliding window (`None`: full causal
/// attention); `out` receives `[n, heads × head_dim]`.
///
/// One chunk per (block of up to [`QB`] tokens, KV head): the block's tokens and the
/// GQA group's query heads share every K and V row the chunk reads ([`group_scores`],
/// [`group_sums`]), so a KV head's rows are read once per block rather than once per
/// query head. The scores are computed as `by` says ([`Scores::for_cpu`] the fast one),
/// the same bits either way; `tiles` is scratch for the keys laid out in tiles (grown
/// here, [`Scores::Tiled`]). A chunk's score rows come from a buffer each pool thread
/// keeps (grown as needed), not one allocated per chunk.
///
/// # Panics
/// If the slices are shorter than the shape says or `n` exceeds the entries (a
/// programming error, not bad input).
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefill_attention(
    s: AttentionShape,
    q: &[f32],
    keys: KvRows<'_>,
    vals: KvRows<'_>,
    pos: &[u32],
    window: Option<usize>,
    n: usize,
    attn: &mut [f32],
    tiles: &mut Vec<f32>,
    th: Threads,
    by: Scores,
) {
    let (nh, group, hd, scale) = (s.heads, s.group, s.head_dim, s.scale);
    let kv_heads = nh / group;
    let qd = nh * hd;
    let m = pos.len();
    // The first key any new token sees (the first token's window start: the starts
    // never decrease).
    let kb = if n == 0 {
        m
    } else {
        window_start(pos, m - n, window)
    };
    let tiled = (by == Scores::Tiled).then(|| key_tiles(keys, kb..m, kv_heads, hd, tiles, th));
    let outs: Vec<std::sync::Mutex<&mut [f32]>> = attn[..n * qd]
        .chunks_exact_mut(hd)
        .map(std::sync::Mutex::new)
        .collect();
    let blocks = n.div_ceil(QB);
    parallel_chunks(blocks * kv_heads, th, &|c| {
        let c = front_back(c, blocks * kv_heads);
        let (tb, g) = (c / kv_heads, c % kv_heads);
        let (k_at, v_at) = (At(keys, g * hd, hd), At(vals, g * hd, hd));
        let tokens = tb * QB..((tb + 1) * QB).min(n);
        let heads = g * group..(g + 1) * group;
        // Token t attends to entries start..=end (end: its own entry).
        let ranges: Vec<(usize, usize)> = tokens
            .clone()
            .map(|t| {
                let end = m - n + t;
                (window_start(pos, end, window), end)
            })
            .collect();
        // Head-major: query `(h, i)` is head `heads.start + h` of token `tokens.start + i`.
        let qs: Vec<&[f32]> = heads
            .clone()
            .flat_map(|hq| {
                tokens
                    .clone()
                    .map(move |t| &q[t * qd + hq * hd..t * qd + (hq + 1) * hd])
            })
            .collect();
        let mut rows = SCORE_ROWS.take();
        let scores = match &tiled {
            Some(t) => tile_scores(&ranges, &qs, t, g, scale, &mut rows),
            None => {
                // One score row per query, head-major, cut from one buffer (each value
                // written by the dots before it is read).
                let per_head: usize = ranges.iter().map(|&(s, e)| e + 1 - s).sum();
                let rest = grown(&mut rows, group * per_head);
                let mut scores: Vec<&mut [f32]> = Vec::with_capacity(qs.len());
                let mut rest = &mut rest[..];
                for _ in heads.clone() {
                    for &(s, e) in &ranges {
                        let (row, tail) = rest.split_at_mut(e + 1 - s);
                        scores.push(row);
                        rest = tail;
                    }
                }
                group_scores(&ranges, &qs, k_at, scale, &mut scores);
                scores
            }
        };
        let mut out: Vec<std::sync::MutexGuard<'_, &mut [f32]>> = heads
            .clone()
            .flat_map(|hq| tokens.clone().map(move |t| t * nh + hq))
            .map(|i| {
                outs[i]
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
            })
            .collect();
        group_sums(&ranges, &scores, v_at, &mut out);
        drop(scores);
        SCORE_ROWS.set(rows);
    });
    drop(outs);
}

/// The keys every token of a block sees, `[lo, hi]`, and whether the block shares them
/// (a full block of [`QB`] tokens with such keys): `ranges` holds each token's
/// `(first, last)` entry.
fn shared_keys(ranges: &[(usize, usize)]) -> (usize, usize, bool) {
    let lo = ranges.iter().map(|r| r.0).max().unwrap_or(0);
    let hi = ranges.iter().map(|r| r.1).min().unwrap_or(0);
    (lo, hi, ranges.len() == QB && lo <= hi)
}

/// The steps of [`KEY_STEP`] keys of the shared range `lo..=hi`, in order.
fn key_steps(lo: usize, hi: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (lo..hi + 1)
        .step_by(KEY_STEP)
        .map(move |j| j..(j + KEY_STEP).min(hi + 1))
}

/// The softmaxed scores of one block of tokens for a GQA group's query heads: for
/// query `(h, i)` (head-major: `h * ranges.len() + i`, token `i` of the block),
/// `scores[h·nt + i][j − first] = softmax(scale · qs[h·nt + i] · k_j)` over token `i`'s
/// entries `ranges[i] = (first, last)`, `k_at` the group's KV head's keys. The keys
/// every token of a full block sees are read a [`KEY_STEP`] at a time for all the
/// group's heads, four tokens at once ([`dot_strided_multi`]); each dot is still the
/// canonical one, so the bits are those of one query at a time.
fn group_scores(
    ranges: &[(usize, usize)],
    qs: &[&[f32]],
    k_at: At<'_>,
    scale: f32,
    scores: &mut [&mut [f32]],
) {
    let nt = ranges.len();
    let (lo, hi, shared) = shared_keys(ranges);
    // q · k_j for every key each query sees outside the shared range (each one
    // canonical dot).
    for (q, sc) in scores.iter_mut().enumerate() {
        let (s, e) = ranges[q % nt];
        let dots = |from: usize, to: usize, sc: &mut [f32]| {
            k_at.for_runs(from..to, |rows, stride, r| {
                dot_strided(rows, stride, qs[q], &mut sc[r.start - from..r.end - from]);
            });
        };
        if shared {
            dots(s, lo, &mut sc[..lo - s]);
            dots(hi + 1, e + 1, &mut sc[hi + 1 - s..]);
        } else {
            dots(s, e + 1, sc);
        }
    }
    if shared {
        let r = ranges;
        for step in key_steps(lo, hi) {
            for (hq, sc) in qs.chunks_exact(QB).zip(scores.chunks_exact_mut(QB)) {
                let [s0, s1, s2, s3] = sc else {
                    unreachable!("a full block has QB tokens")
                };
                k_at.for_runs(step.clone(), |rows, stride, j| {
                    let at = |i: usize| j.start - r[i].0..j.end - r[i].0;
                    dot_strided_multi(
                        rows,
                        stride,
                        [hq[0], hq[1], hq[2], hq[3]],
                        [
                            &mut s0[at(0)],
                            &mut s1[at(1)],
                            &mut s2[at(2)],
                            &mut s3[at(3)],
                        ],
                    );
                });
            }
        }
    }
    finish_scores(scores, scale);
}

/// Every score row times `scale`, then softmaxed, as one query at a time.
fn finish_scores(scores: &mut [&mut [f32]], scale: f32) {
    for sc in scores.iter_mut() {
        scale_in_place(sc, scale);
    }
    // Up to sixteen rows side by side, the group's heads' rows of a full block
    // together (the same bits as one by one: each row's sum is its own chain).
    for rows in scores.chunks_mut(16) {
        match rows {
            [a, b, c, d] => softmax_rows_in_place([&mut **a, b, c, d]),
            [a, b, c, d, e, f, g, h] => softmax_rows_in_place([&mut **a, b, c, d, e, f, g, h]),
            [a, b, c, d, e, f, g, h, i, j, k, l] => {
                softmax_rows_in_place([&mut **a, b, c, d, e, f, g, h, i, j, k, l])
            }
            [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p] => {
                softmax_rows_in_place([&mut **a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p])
            }
            rows => rows.iter_mut().for_each(|sc| softmax_in_place(sc)),
        }
    }
}

thread_local! {
    /// Each pool thread's score rows (the strided path's, or [`tile_scores`]' windows),
    /// kept from chunk to chunk (grown as needed) rather than allocated and zeroed for
    /// each: every value is written before it is read.
    static SCORE_ROWS: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The first `len` values of `buf`, grown (zeroed) to hold them if it is shorter; never
/// shrunk or cleared, so they hold whatever was there.
fn grown(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// How a prefill computes its scores (the same bits either way).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Scores {
    /// From the cache's rows ([`group_scores`]).
    Strided,
    /// From the keys laid out in tiles first ([`key_tiles`], [`tile_scores`]).
    Tiled,
}

impl Scores {
    /// The faster on this CPU: [`Scores::Tiled`] with AVX-512, else
    /// [`Scores::Strided`].
    pub(crate) fn for_cpu() -> Scores {
        if fak_tensor::cpu::has_avx512_f32() {
            Scores::Tiled
        } else {
            Scores::Strided
        }
    }
}

/// Keys per chunk of [`key_tiles`]' hand-off (a multiple of [`KEY_TILE`]).
const TILE_CHUNK_KEYS: usize = 8 * KEY_TILE;

/// A layer's keys `first..` laid out in tiles ([`key_tiles`]).
struct Tiles<'a> {
    /// `[kv_heads, tiles, head_dim, KEY_TILE]`.
    data: &'a [f32],
    /// The entry of the first tile's first key.
    first: usize,
    /// Tiles per KV head.
    count: usize,
    hd: usize,
}

/// Lays the keys of entries `range` out in tiles of [`KEY_TILE`] keys
/// ([`fak_tensor::put_key_in_tile`]) into `tiles`, resized to `[kv_heads, tiles,
/// head_dim, KEY_TILE]` (the last tile's keys past the range zero): tile `t` of KV head
/// `g` holds entries `range.start + KEY_TILE·t ..`, each key's head `g` values
/// transposed. One chunk per KV head and [`TILE_CHUNK_KEYS`] keys on the pool, each
/// writing its own tiles.
fn key_tiles<'a>(
    keys: KvRows<'_>,
    range: std::ops::Range<usize>,
    kv_heads: usize,
    hd: usize,
    tiles: &'a mut Vec<f32>,
    th: Threads,
) -> Tiles<'a> {
    let count = range.len().div_ceil(KEY_TILE);
    let tile_len = KEY_TILE * hd;
    let per_chunk = TILE_CHUNK_KEYS / KEY_TILE * tile_len;
    // Grown, never shrunk or cleared: every key of the range is written below, and the
    // last tile's keys past it are zeroed (their dots are never read; zero keeps them
    // finite).
    let tiles = grown(tiles, kv_heads * count * tile_len);
    if !range.len().is_multiple_of(KEY_TILE) {
        for g in 0..kv_heads {
            tiles[(g * count + count - 1) * tile_len..][..tile_len].fill(0.0);
        }
    }
    let all = Disjoint::new(&mut tiles[..]);
    let chunks = range.len().div_ceil(TILE_CHUNK_KEYS);
    parallel_chunks(kv_heads * chunks, th, &|c| {
        let (g, c) = (c / chunks, c % chunks);
        let from = range.start + c * TILE_CHUNK_KEYS;
        let to = (from + TILE_CHUNK_KEYS).min(range.end);
        let at = g * count * tile_len + c * per_chunk;
        let end = (at + per_chunk).min((g + 1) * count * tile_len);
        // SAFETY: the pool calls each chunk index once, and chunk `(g, c)` alone writes
        // the tiles of KV head `g` for its keys: `at..end`, within head `g`'s tiles.
        let part = unsafe { all.part(at..end) };
        keys.for_cols(from..to, g * hd..(g + 1) * hd, |rows, stride, r| {
            for (i, j) in r.enumerate() {
                let (t, key) = ((j - from) / KEY_TILE, (j - from) % KEY_TILE);
                let row = &rows[i * stride..][..hd];
                put_key_in_tile(&mut part[t * tile_len..][..tile_len], key, row);
            }
        });
    });
    Tiles {
        data: tiles,
        first: range.start,
        count,
        hd,
    }
}

/// The softmaxed scores of [`group_scores`] from KV head `g`'s key tiles, cut from
/// `buf`: every query's dots with the tiles holding any key of the block's ranges,
/// three queries at a time over all those tiles in one call ([`dot_key_tiles`], each
/// dot the canonical one), into a window of its own in `buf`; query `q`'s score row is
/// the part of its window its range covers (the rest is never read). Then the scale
/// and softmax as there. The same bits.
fn tile_scores<'b>(
    ranges: &[(usize, usize)],
    qs: &[&[f32]],
    tiles: &Tiles<'_>,
    g: usize,
    scale: f32,
    buf: &'b mut Vec<f32>,
) -> Vec<&'b mut [f32]> {
    let nt = ranges.len();
    let lo = ranges.iter().map(|r| r.0).min().unwrap_or(tiles.first);
    let hi = ranges.iter().map(|r| r.1).max().unwrap_or(tiles.first);
    let (t0, t1) = (
        (lo - tiles.first) / KEY_TILE,
        (hi - tiles.first) / KEY_TILE + 1,
    );
    let (base, count) = (tiles.first + t0 * KEY_TILE, t1 - t0);
    let tile_len = KEY_TILE * tiles.hd;
    let at = (g * tiles.count + t0) * tile_len;
    let run = &tiles.data[at..at + count * tile_len];
    let w = count * KEY_TILE;
    // Grown, never cleared: every window is written whole below before it is read.
    let buf = grown(buf, qs.len() * w);
    let (mut q, mut rest) = (qs, &mut buf[..]);
    while !q.is_empty() {
        let take = q.len().min(3);
        let (qh, qt) = q.split_at(take);
        let (wins, tail) = rest.split_at_mut(take * w);
        let mut it = wins.chunks_exact_mut(w);
        let mut win = || it.next().expect("one window per query");
        match *qh {
            [a, b, c] => dot_key_tiles(run, count, [a, b, c], [win(), win(), win()]),
            [a, b] => dot_key_tiles(run, count, [a, b], [win(), win()]),
            [a] => dot_key_tiles(run, count, [a], [win()]),
            _ => unreachable!("one to three queries at a time"),
        }
        (q, rest) = (qt, tail);
    }
    let mut scores: Vec<&mut [f32]> = buf
        .chunks_exact_mut(w.max(1))
        .enumerate()
        .map(|(q, win)| {
            let (s, e) = ranges[q % nt];
            &mut win[s - base..=e - base]
        })
        .collect();
    finish_scores(&mut scores, scale);
    scores
}

/// `out[q] = Σ_j scores[q][j − first] · v_j` for query `q` of a block (head-major, as
/// in [`group_scores`]) over its token's entries `ranges[q % nt] = (first, last)`,
/// ascending `j`, per element, `v_at` the group's KV head's values: the keys before the
/// shared range, the shared range (a [`KEY_STEP`] at a time for all the group's heads,
/// four tokens at once), the keys after it. Each element's sum runs over `j` in
/// ascending order whatever the steps, so the bits are those of one query at a time.
fn group_sums(
    ranges: &[(usize, usize)],
    scores: &[&mut [f32]],
    v_at: At<'_>,
    out: &mut [std::sync::MutexGuard<'_, &mut [f32]>],
) {
    let nt = ranges.len();
    let (lo, hi, shared) = shared_keys(ranges);
    for o in out.iter_mut() {
        o.fill(0.0);
    }
    // `o += Σ_j p[j − from] · v_j` over entries `from..to`.
    let sums = |p: &[f32], from: usize, to: usize, o: &mut [f32]| {
        v_at.for_runs(from..to, |rows, stride, r| {
            let p = &p[r.start - from..r.end - from];
            weighted_rows_accumulate([p], rows, stride, [&mut o[..]]);
        });
    };
    for (q, (sc, o)) in scores.iter().zip(out.iter_mut()).enumerate() {
        let (s, e) = ranges[q % nt];
        let end = if shared { lo } else { e + 1 };
        sums(&sc[..end - s], s, end, &mut o[..]);
    }
    if !shared {
        return;
    }
    let r = ranges;
    for step in key_steps(lo, hi) {
        for (sc, o) in scores.chunks_exact(QB).zip(out.chunks_exact_mut(QB)) {
            let p: [&[f32]; QB] = std::array::from_fn(|i| &sc[i][lo - r[i].0..hi + 1 - r[i].0]);
            let [o0, o1, o2, o3] = o else {
                unreachable!("a full block has QB tokens")
            };
            v_at.for_runs(step.clone(), |rows, stride, j| {
                let (a, b) = (j.start - lo, j.end - lo);
                weighted_rows_accumulate(
                    p.map(|p| &p[a..b]),
                    rows,
                    stride,
                    [&mut o0[..], &mut o1[..], &mut o2[..], &mut o3[..]],
                );
            });
        }
    }
    for (q, (sc, o)) in scores.iter().zip(out.iter_mut()).enumerate() {
        let (s, e) = ranges[q % nt];
        sums(&sc[hi + 1 - s..], hi + 1, e + 1, &mut o[..]);
    }
}

/// The `c`-th chunk claimed of `n` taken alternately from the front and the back
/// (`0, n−1, 1, n−2, …`; a permutation of `0..n`). Two threads claiming a prefill's
/// (token block, KV head) chunks in turn take short blocks (the prompt's start) and
/// long ones (its end: the causal mask makes later blocks see more keys) alike, and
/// the chunks claimed last are middling ones, so neither thread is left with a long
/// block after the other has finished.
fn front_back(c: usize, n: usize) -> usize {
    if c.is_multiple_of(2) {
        c / 2
    } else {
        n - 1 - c / 2
    }
}

/// One KV head's K or V rows of a layer's cache: the rows, the head's offset in a row
/// and its width.
#[derive(Clone, Copy)]
struct At<'a>(KvRows<'a>, usize, usize);

impl<'a> At<'a> {
    /// [`KvRows::for_cols`] of the head's `hd` values: `f(rows, stride, entries)`,
    /// `rows` the head's values of entry `entries.start` on, `stride` apart.
    fn for_runs(
        &self,
        range: std::ops::Range<usize>,
        f: impl FnMut(&[f32], usize, std::ops::Range<usize>),
    ) {
        let At(rows, off, hd) = *self;
        rows.for_cols(range, off..off + hd, f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::test_util::{cut_runs, same_bits, values};
    use fak_tensor::{dot, weighted_rows_sum};

    /// One (token, query head) at a time with the single-query kernels: token `t` of
    /// the last `n` entries over its window's entries up to its own.
    #[allow(clippy::too_many_arguments)]
    fn per_query(
        s: AttentionShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        pos: &[u32],
        window: Option<usize>,
        n: usize,
    ) -> Vec<f32> {
        let hd = s.head_dim;
        let (qd, kvd) = (s.heads * hd, s.heads / s.group * hd);
        let m = pos.len();
        let mut out = vec![0f32; n * qd];
        for t in 0..n {
            let end = m - n + t;
            let first = window_start(pos, end, window);
            for h in 0..s.heads {
                let g = h / s.group;
                let qh = &q[t * qd + h * hd..t * qd + (h + 1) * hd];
                let mut sc: Vec<f32> = (first..=end)
                    .map(|j| dot(&k[j * kvd + g * hd..j * kvd + (g + 1) * hd], qh) * s.scale)
                    .collect();
                softmax_in_place(&mut sc);
                let rows = &v[first * kvd + g * hd..];
                weighted_rows_sum(&sc, rows, kvd, &mut out[t * qd + h * hd..][..hd]);
            }
        }
        out
    }

    #[test]
    fn grouped_prefill_attention_equals_one_query_at_a_time_bitwise() {
        let mut r = values(0x9e37_79b9_u64);
        // (heads, kv heads, head_dim): groups of 1, 2, 3, 4 and 7; head sizes off the
        // 8- and 16-element grids too.
        for (heads, kv_heads, hd) in [(9, 3, 64), (4, 1, 32), (8, 4, 16), (14, 2, 20), (6, 6, 8)] {
            let (qd, kvd) = (heads * hd, kv_heads * hd);
            let s = AttentionShape {
                heads,
                group: heads / kv_heads,
                head_dim: hd,
                scale: 0.125,
            };
            // (entries, new tokens, window): whole prompts, pieces after a cache, and
            // sliding windows that cut the block's shared keys short or leave none.
            for (m, n, window) in [
                (1, 1, None),
                (7, 7, None),
                (13, 5, None),
                (150, 150, None),
                (300, 37, None),
                (200, 64, Some(16)),
                (90, 9, Some(2)),
                (140, 140, Some(70)),
            ] {
                // Positions with gaps (entries evicted before), strictly increasing.
                let pos: Vec<u32> = (0..m as u32).map(|i| i + i / 5).collect();
                let q: Vec<f32> = (0..n * qd).map(|_| r()).collect();
                let k: Vec<f32> = (0..m * kvd).map(|_| r()).collect();
                let v: Vec<f32> = (0..m * kvd).map(|_| r()).collect();
                let want = per_query(s, &q, &k, &v, &pos, window, n);
                let cuts: [&[usize]; 2] = [&[], &[1, m / 2, m - 1]];
                let by = [Scores::Strided, Scores::Tiled];
                let cases = cuts
                    .iter()
                    .flat_map(|c| [1, 2, 3].map(|t| (c, t)))
                    .flat_map(|(c, t)| by.map(|b| (c, t, b)));
                for (cut, threads, by) in cases {
                    let runs = |x| cut_runs(x, kvd, cut, m);
                    let mut out = vec![f32::NAN; n * qd];
                    // A tile buffer left over from a larger call, and this thread's score
                    // rows: NaN, so a value read before it is written shows.
                    let mut tiles = vec![f32::NAN; 3 * m * kvd];
                    SCORE_ROWS.set(vec![f32::NAN; 4 * heads * m]);
                    prefill_attention(
                        s,
                        &q,
                        runs(&k),
                        runs(&v),
                        &pos,
                        window,
                        n,
                        &mut out,
                        &mut tiles,
                        Threads::new(threads),
                        by,
                    );
                    assert!(
                        same_bits(&out, &want),
                        "heads {heads}/{kv_heads} × {hd}, {n} of {m} entries, window {window:?}, runs cut at {cut:?}, {threads} threads, scores {by:?}"
                    );
                }
            }
        }
    }
}
