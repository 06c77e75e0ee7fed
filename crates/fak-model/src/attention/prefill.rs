//! Attention for the new tokens of a prefill (more than one token in a pass).
//!
//! One chunk per (block of up to [`QB`] consecutive tokens, query head): each writes its
//! own output slices, with the same kernels in the same order whichever thread runs it.
//! In a block the tokens share every K and V row load over the keys they all see; each
//! (token, key) still gets exactly the canonical dot and each output the ascending sum,
//! so the bits are those of one token at a time (decode == prefill).

use super::AttentionShape;
use crate::kv::window_start;
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
/// tokens' rows already appended); `positions` holds every entry's position
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
    keys: &[f32],
    vals: &[f32],
    pos: &[u32],
    window: Option<usize>,
    n: usize,
    attn: &mut [f32],
    th: Threads,
) {
    let (nh, group, hd, kvd, scale) = (s.heads, s.group, s.head_dim, s.kv_dim, s.scale);
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
        let (k_at, v_at) = (&keys[g * hd..], &vals[g * hd..]);
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
        block_scores(&ranges, &qs, k_at, kvd, scale, &mut scores);
        block_sums(&ranges, &scores, v_at, kvd, &mut out);
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
/// `ranges[i] = (first, last)`, `k_at` the layer's keys from this head's KV head on
/// (`kvd` apart). The keys every token of a full block sees are read once for the four
/// ([`dot_strided_multi`]); each dot is still the canonical one.
fn block_scores(
    ranges: &[(usize, usize)],
    qs: &[&[f32]],
    k_at: &[f32],
    kvd: usize,
    scale: f32,
    scores: &mut [Vec<f32>],
) {
    let (lo, hi, shared) = shared_keys(ranges);
    // q · k_j for every key each token sees (each one canonical dot).
    for (i, (&(s, _), sc)) in ranges.iter().zip(scores.iter_mut()).enumerate() {
        if shared {
            dot_strided(rows_from(kvd, k_at, s), kvd, qs[i], &mut sc[..lo - s]);
            dot_strided(
                rows_from(kvd, k_at, hi + 1),
                kvd,
                qs[i],
                &mut sc[hi + 1 - s..],
            );
        } else {
            dot_strided(rows_from(kvd, k_at, s), kvd, qs[i], sc);
        }
    }
    if shared {
        let [s0, s1, s2, s3] = &mut scores[..] else {
            unreachable!("a full block has QB tokens")
        };
        let r = ranges;
        dot_strided_multi(
            rows_from(kvd, k_at, lo),
            kvd,
            [qs[0], qs[1], qs[2], qs[3]],
            [
                &mut s0[lo - r[0].0..hi + 1 - r[0].0],
                &mut s1[lo - r[1].0..hi + 1 - r[1].0],
                &mut s2[lo - r[2].0..hi + 1 - r[2].0],
                &mut s3[lo - r[3].0..hi + 1 - r[3].0],
            ],
        );
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
/// from this head's KV head on (`kvd` apart): the keys before the shared range, the
/// shared range (four tokens at a time), the keys after it.
fn block_sums(
    ranges: &[(usize, usize)],
    scores: &[Vec<f32>],
    v_at: &[f32],
    kvd: usize,
    out: &mut [std::sync::MutexGuard<'_, &mut [f32]>],
) {
    let (lo, hi, shared) = shared_keys(ranges);
    // Σ_j p_j · v_j, ascending j, per element: the keys before the shared
    // range, the shared range (four tokens at a time), the keys after it.
    for o in out.iter_mut() {
        o.fill(0.0);
    }
    for ((&(s, e), sc), o) in ranges.iter().zip(scores).zip(out.iter_mut()) {
        let head = if shared { lo - s } else { e + 1 - s };
        weighted_rows_accumulate([&sc[..head]], rows_from(kvd, v_at, s), kvd, [&mut o[..]]);
    }
    if shared {
        let r = ranges;
        let p: [&[f32]; QB] = std::array::from_fn(|i| &scores[i][lo - r[i].0..hi + 1 - r[i].0]);
        let [o0, o1, o2, o3] = &mut out[..] else {
            unreachable!("a full block has QB tokens")
        };
        weighted_rows_accumulate(
            p,
            rows_from(kvd, v_at, lo),
            kvd,
            [&mut o0[..], &mut o1[..], &mut o2[..], &mut o3[..]],
        );
        for ((&(s, _), sc), o) in ranges.iter().zip(scores).zip(out.iter_mut()) {
            weighted_rows_accumulate(
                [&sc[hi + 1 - s..]],
                rows_from(kvd, v_at, hi + 1),
                kvd,
                [&mut o[..]],
            );
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

/// The rows of a `[entries, kvd]` cache slice from entry `j` on (empty past the end,
/// where no row is read).
fn rows_from(kvd: usize, rows: &[f32], j: usize) -> &[f32] {
    &rows[(j * kvd).min(rows.len())..]
}
