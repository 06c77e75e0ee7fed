//! Attention of new tokens over one layer's KV cache, by phase of the forward pass:
//! `decode` for one new token (by GQA group, [`decode_attention`]) and `prefill` for
//! several (by block of tokens and query head, [`prefill_attention`]). Both compute
//! every score, softmax and weighted sum with the same kernels in the same order as one
//! query head of one token at a time, so decode == prefill bit for bit.

mod decode;
mod prefill;

pub(crate) use decode::decode_attention;
pub(crate) use prefill::prefill_attention;

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
