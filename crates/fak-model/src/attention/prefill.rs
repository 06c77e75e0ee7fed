//! Attention for the new tokens of a prefill (more than one token in a pass).
//!
//! One chunk per (block of up to [`QB`] consecutive tokens, query head): each writes its
//! own output slices, with the same kernels in the same order whichever thread runs it.
//! In a block the tokens share every K and V row load over the keys they all see; each
//! (token, key) still gets exactly the canonical dot and each output the ascending sum,
//! so the bits are those of one token at a time (decode == prefill).

use super::AttentionShape;
use crate::kv::{window_start, KvRows};
use fak_tensor::{
    dot_strided, dot_strided_multi, parallel_chunks, softmax_in_place, softmax_rows_in_place,
    weighted_rows_accumulate, Threads,
};

/// Tokens per block: the tokens of a block share the K and V row loads of the keys they
/// all see.
const QB: usize = 4;

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
    th: Threads,
) {
    let (nh, group, hd, scale) = (s.heads, s.group, s.head_dim, s.scale);
    let qd = nh * hd;
    let m = pos.len();
    let outs: Vec<std::sync::Mutex<&mut [f32]>> = attn[..n * qd]
        .chunks_exact_mut(hd)
        .map(std::sync::Mutex::new)
        .collect();
    let blocks = n.div_ceil(QB);
    parallel_chunks(blocks * nh, th, &|c| {
        let c = front_back(c, blocks * nh);
        let (tb, hq) = (c / nh, c % nh);
        let g = hq / group;
        let (k_at, v_at) = (At(keys, g * hd, hd), At(vals, g * hd, hd));
        let tokens = tb * QB..((tb + 1) * QB).min(n);
        // Token t attends to entries start..=end (end: its own entry).
        let ranges: Vec<(usize, usize)> = tokens
            .clone()
            .map(|t| {
                let end = m - n + t;
                (window_start(pos, end, window), end)
            })
            .collect();
        let qs: Vec<&[f32]> = tokens
            .clone()
            .map(|t| &q[t * qd + hq * hd..t * qd + (hq + 1) * hd])
            .collect();
        let mut scores: Vec<Vec<f32>> =
            ranges.iter().map(|&(s, e)| vec![0f32; e + 1 - s]).collect();
        let mut out: Vec<std::sync::MutexGuard<'_, &mut [f32]>> = tokens
            .clone()
            .map(|t| {
                outs[t * nh + hq]
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
            })
            .collect();
        block_scores(&ranges, &qs, k_at, scale, &mut scores);
        block_sums(&ranges, &scores, v_at, &mut out);
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

/// The softmaxed scores of one block of tokens for one query head: for token `i`,
/// `scores[i][j − first] = softmax(scale · qs[i] · k_j)` over its entries
/// `ranges[i] = (first, last)`, `k_at` the layer's keys of this head's KV head. The
/// keys every token of a full block sees are read once for the four
/// ([`dot_strided_multi`]); each dot is still the canonical one.
fn block_scores(
    ranges: &[(usize, usize)],
    qs: &[&[f32]],
    k_at: At<'_>,
    scale: f32,
    scores: &mut [Vec<f32>],
) {
    let (lo, hi, shared) = shared_keys(ranges);
    // q · k_j for every key each token sees (each one canonical dot).
    for (i, (&(s, e), sc)) in ranges.iter().zip(scores.iter_mut()).enumerate() {
        let dots = |from: usize, to: usize, sc: &mut [f32]| {
            k_at.for_runs(from..to, |rows, stride, r| {
                dot_strided(rows, stride, qs[i], &mut sc[r.start - from..r.end - from]);
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
        let [s0, s1, s2, s3] = &mut scores[..] else {
            unreachable!("a full block has QB tokens")
        };
        let r = ranges;
        let mut outs = [
            &mut s0[lo - r[0].0..hi + 1 - r[0].0],
            &mut s1[lo - r[1].0..hi + 1 - r[1].0],
            &mut s2[lo - r[2].0..hi + 1 - r[2].0],
            &mut s3[lo - r[3].0..hi + 1 - r[3].0],
        ];
        k_at.for_runs(lo..hi + 1, |rows, stride, j| {
            let (a, b) = (j.start - lo, j.end - lo);
            let [o0, o1, o2, o3] = &mut outs;
            dot_strided_multi(
                rows,
                stride,
                [qs[0], qs[1], qs[2], qs[3]],
                [&mut o0[a..b], &mut o1[a..b], &mut o2[a..b], &mut o3[a..b]],
            );
        });
    }
    for sc in scores.iter_mut() {
        sc.iter_mut().for_each(|s| *s *= scale);
    }
    // A full block's four rows side by side (the same bits as one by one).
    match &mut scores[..] {
        [s0, s1, s2, s3] => softmax_rows_in_place([s0, s1, s2, s3]),
        rows => rows.iter_mut().for_each(|sc| softmax_in_place(sc)),
    }
}

/// `out[i] = Σ_j scores[i][j − first] · v_j` for token `i` of a block over its entries
/// `ranges[i] = (first, last)`, ascending `j`, per element, `v_at` the layer's values
/// of this head's KV head: the keys before the shared range, the shared range (four
/// tokens at a time), the keys after it.
fn block_sums(
    ranges: &[(usize, usize)],
    scores: &[Vec<f32>],
    v_at: At<'_>,
    out: &mut [std::sync::MutexGuard<'_, &mut [f32]>],
) {
    let (lo, hi, shared) = shared_keys(ranges);
    // Σ_j p_j · v_j, ascending j, per element: the keys before the shared
    // range, the shared range (four tokens at a time), the keys after it.
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
    for ((&(s, e), sc), o) in ranges.iter().zip(scores).zip(out.iter_mut()) {
        let end = if shared { lo } else { e + 1 };
        sums(&sc[..end - s], s, end, &mut o[..]);
    }
    if shared {
        let r = ranges;
        let p: [&[f32]; QB] = std::array::from_fn(|i| &scores[i][lo - r[i].0..hi + 1 - r[i].0]);
        let [o0, o1, o2, o3] = &mut out[..] else {
            unreachable!("a full block has QB tokens")
        };
        v_at.for_runs(lo..hi + 1, |rows, stride, j| {
            let (a, b) = (j.start - lo, j.end - lo);
            weighted_rows_accumulate(
                p.map(|p| &p[a..b]),
                rows,
                stride,
                [&mut o0[..], &mut o1[..], &mut o2[..], &mut o3[..]],
            );
        });
        for ((&(s, e), sc), o) in ranges.iter().zip(scores).zip(out.iter_mut()) {
            sums(&sc[hi + 1 - s..], hi + 1, e + 1, &mut o[..]);
        }
    }
}

/// The `c`-th chunk claimed of `n` taken alternately from the front and the back
/// (`0, n−1, 1, n−2, …`; a permutation of `0..n`). Two threads claiming a prefill's
/// (token block, query head) chunks in turn then work from opposite ends, each on
/// consecutive query heads, so a KV head's rows are mostly read by one thread and the
/// group's other query heads find them in that core's cache. (A decode step goes by
/// GQA group instead: `super::decode`.)
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
