//! The K-quant products of many tokens ([`k_tokens`]): a few tokens at a time against
//! every row, through the per-format kernels in `q4_k.rs` and `q6_k.rs`.

use super::*;

/// A K-quant product of `rows` weight rows (`rb` bytes each, of the type `kind`) with
/// `acts.len()` tokens, into `out[t][r]` (one slice of `rows` per token): four tokens
/// at a time against every row ([`dot_k45_tokens`], [`dot_q6_k_tokens`]), the rest one
/// by one; each result the bits of the one-token dot.
///
/// # Safety
/// AVX2 and F16C; `w.len() == rows * rb`, every `acts[t]` of `rb / bytes` blocks,
/// `out` holds at least `acts.len()` slices of at least `rows` outputs.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn k_tokens(
    w: &[u8],
    rb: usize,
    acts: &[&[BlockQ8K]],
    kind: KQuant,
    out: &mut [&mut [f32]],
) {
    k_tokens_by::<4>(w, rb, acts, kind, out)
}

/// [`k_tokens`] eight tokens at a time, in code compiled with AVX-512VL too, whose 32
/// vector registers hold a super-block's unpacked quants and eight tokens' sums.
///
/// # Safety
/// As [`k_tokens`], and AVX-512F/BW/VL.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
pub(in crate::quant) unsafe fn k_tokens_wide(
    w: &[u8],
    rb: usize,
    acts: &[&[BlockQ8K]],
    kind: KQuant,
    out: &mut [&mut [f32]],
) {
    k_tokens_by::<8>(w, rb, acts, kind, out)
}

/// [`k_tokens`] with `B` tokens at a time.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn k_tokens_by<const B: usize>(
    w: &[u8],
    rb: usize,
    acts: &[&[BlockQ8K]],
    kind: KQuant,
    out: &mut [&mut [f32]],
) {
    let mut t = 0;
    while t < acts.len() {
        let take = (acts.len() - t).min(B);
        for (r, wr) in w.chunks_exact(rb).enumerate() {
            if take == B {
                let ab: [&[BlockQ8K]; B] = std::array::from_fn(|i| acts[t + i]);
                let res = match kind {
                    KQuant::Q6 => dot_q6_k_tokens::<B>(wr, ab),
                    KQuant::Q45 {
                        bytes,
                        qs_at,
                        qh_at,
                    } => dot_k45_tokens::<B>(wr, ab, bytes, qs_at, qh_at),
                };
                for (i, v) in res.into_iter().enumerate() {
                    out[t + i][r] = v;
                }
            } else {
                for i in 0..take {
                    let [v] = k_tokens_one(wr, acts[t + i], kind);
                    out[t + i][r] = v;
                }
            }
        }
        t += take;
    }
}

/// One token's K-quant dot with `kind`'s kernel.
///
/// # Safety
/// As [`dot_k45_tokens`] / [`dot_q6_k_tokens`] with `T = 1`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn k_tokens_one(w: &[u8], a: &[BlockQ8K], kind: KQuant) -> [f32; 1] {
    match kind {
        KQuant::Q6 => dot_q6_k_tokens::<1>(w, [a]),
        KQuant::Q45 {
            bytes,
            qs_at,
            qh_at,
        } => dot_k45_tokens::<1>(w, [a], bytes, qs_at, qh_at),
    }
}

/// Which K-quant [`k_tokens`] runs.
#[derive(Clone, Copy, Debug)]
pub(in crate::quant) enum KQuant {
    /// Q4_K or Q5_K: super-block bytes, where the 4-bit quants start, Q5_K's fifth bits
    /// ([`dot_k45_tokens`]).
    Q45 {
        bytes: usize,
        qs_at: usize,
        qh_at: Option<usize>,
    },
    /// Q6_K.
    Q6,
}

impl KQuant {
    /// Q4_K: 144-byte super-blocks, the quants from byte 16.
    pub(in crate::quant) const Q4: KQuant = KQuant::Q45 {
        bytes: 144,
        qs_at: 16,
        qh_at: None,
    };
    /// Q5_K: 176-byte super-blocks, the fifth bits at byte 16, the quants from byte 48.
    pub(in crate::quant) const Q5: KQuant = KQuant::Q45 {
        bytes: 176,
        qs_at: 48,
        qh_at: Some(16),
    };
}
