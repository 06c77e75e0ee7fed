//! Attention of new tokens over one layer's KV cache, by phase of the forward pass:
//! `decode` for one new token (by GQA group, [`decode_attention`]) and `prefill` for
//! several (by block of tokens and query head, [`prefill_attention`]). Both compute
//! every score, softmax and weighted sum with the same kernels in the same order as one
//! query head of one token at a time, so decode == prefill bit for bit.

mod decode;
mod prefill;

pub(crate) use decode::decode_attention;
pub(crate) use prefill::{prefill_attention, Scores};

/// The shapes of one layer's attention (a decode step's or a prefill's).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Query heads per KV head (GQA group size, `heads / kv_heads`).
    pub group: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Multiplier of every score (HF's `scaling`).
    pub scale: f32,
}

impl AttentionShape {
    /// The shape of every layer of a model of `config`.
    pub(crate) fn of(c: &crate::Config) -> Self {
        AttentionShape {
            heads: c.num_attention_heads,
            group: c.num_attention_heads / c.num_key_value_heads,
            head_dim: c.head_dim,
            scale: c.attention_scale,
        }
    }
}

/// What the attention tests share.
#[cfg(test)]
pub(crate) mod test_util {
    use crate::kv::KvRows;

    /// `x`'s `entries` rows of `kvd` values as runs broken before each entry in `cut`
    /// (a shared prefix's runs): where they break changes no bit.
    pub(crate) fn cut_runs<'a>(
        x: &'a [f32],
        kvd: usize,
        cut: &[usize],
        entries: usize,
    ) -> KvRows<'a> {
        let mut r = KvRows::contiguous(&x[..0], kvd);
        let mut at = 0;
        for &c in cut.iter().chain([&entries]) {
            let c = c.max(at);
            r.push(&x[at * kvd..c * kvd]);
            at = c;
        }
        r
    }

    /// Whether `a` and `b` hold the same bits.
    pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// Seeded values in `[-2, 2)`: a 64-bit LCG's top 24 bits.
    pub(crate) fn values(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        }
    }
}
