//! Per-op wall time of the forward pass, for `fak bench --profile`.
//!
//! A [`Model`](super::Model) carries one [`OpProfile`]; it is off unless
//! [`OpProfile::set_enabled`] turns it on. While on, each named step of a pass
//! ([`Op`]) adds the wall time it took on the calling thread (the products and the
//! attention fan out to the thread pool inside their step, so their time includes the
//! pool's hand-offs and the wait for the slowest thread) and one call. Off, a step costs
//! one relaxed atomic load; the numerics never change either way. Counters are atomics
//! so that a shared `Arc<Model>` can be profiled; when several sessions run passes at
//! once their times add up in one profile.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A named step of the forward pass, as [`Model`](super::Model)'s `forward` module runs
/// them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `embed_tokens`' rows (dequantized in native mode), times the embedding scale.
    Embedding,
    /// Every RMSNorm: the blocks' pre- and post-norms, QK-norm, the final norm; with
    /// the residual add before a sublayer's norm and the quantization of the normed rows
    /// for the products after it (one step per row, `forward`'s `residual_then_norm`).
    Norm,
    /// The q, k and v products and Qwen2's biases (the input quantized by the norm
    /// before them, or here once for the three).
    QkvProducts,
    /// The RoPE cos/sin rows of the pass and the rotation of q and k (K kept unrotated
    /// too); a batched decode step's decode rows are rotated in [`Op::Attention`].
    Rope,
    /// The batch's K, pre-RoPE K and V rows appended to the KV cache (in a batched
    /// decode step, the decode sequences' appends are part of [`Op::Attention`]).
    KvAppend,
    /// Attention over the cache: decode by GQA group, prefill by block and head (and
    /// in a batched decode step each sequence's RoPE and append before its attention,
    /// and, when every row is a decode token, its output quantized for `o_proj`).
    Attention,
    /// The `o_proj` product (its input quantized here unless the attention step did).
    OProj,
    /// The gate and up products (the input quantized by the norm before them, or here
    /// once for the two).
    GateUpProducts,
    /// SiLU or tanh-GELU of gate, times up, each row then quantized for `down_proj`.
    Activation,
    /// The `down_proj` product.
    DownProj,
    /// The logits head (`lm_head`, or the tied embedding), over the rows asked for.
    Head,
}

impl Op {
    /// Every op, in the order a pass runs them.
    pub const ALL: [Op; 11] = [
        Op::Embedding,
        Op::Norm,
        Op::QkvProducts,
        Op::Rope,
        Op::KvAppend,
        Op::Attention,
        Op::OProj,
        Op::GateUpProducts,
        Op::Activation,
        Op::DownProj,
        Op::Head,
    ];

    /// The op's name as `fak bench --profile` prints it.
    pub fn name(self) -> &'static str {
        match self {
            Op::Embedding => "embedding",
            Op::Norm => "rms_norm",
            Op::QkvProducts => "qkv_proj",
            Op::Rope => "rope",
            Op::KvAppend => "kv_append",
            Op::Attention => "attention",
            Op::OProj => "o_proj",
            Op::GateUpProducts => "gate_up_proj",
            Op::Activation => "activation",
            Op::DownProj => "down_proj",
            Op::Head => "lm_head",
        }
    }
}

/// Wall time and call count per [`Op`], accumulated while enabled.
#[derive(Debug, Default)]
pub struct OpProfile {
    enabled: AtomicBool,
    nanos: [AtomicU64; Op::ALL.len()],
    calls: [AtomicU64; Op::ALL.len()],
}

/// What an [`OpProfile`] held when it was taken: per op in [`Op::ALL`]'s order, its
/// total wall time and calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpTimes(pub Vec<(Op, Duration, u64)>);

impl OpTimes {
    /// The sum of the ops' times.
    pub fn total(&self) -> Duration {
        self.0.iter().map(|(_, d, _)| *d).sum()
    }

    /// One op's time and calls.
    pub fn get(&self, op: Op) -> (Duration, u64) {
        self.0
            .iter()
            .find(|(o, _, _)| *o == op)
            .map_or((Duration::ZERO, 0), |(_, d, c)| (*d, *c))
    }
}

impl OpProfile {
    /// Turns accumulation on or off (counters are kept; [`OpProfile::take`] clears).
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// The counters since the last take, cleared.
    pub fn take(&self) -> OpTimes {
        OpTimes(
            Op::ALL
                .iter()
                .enumerate()
                .map(|(i, &op)| {
                    let ns = self.nanos[i].swap(0, Ordering::Relaxed);
                    let calls = self.calls[i].swap(0, Ordering::Relaxed);
                    (op, Duration::from_nanos(ns), calls)
                })
                .collect(),
        )
    }

    /// The start of a timed step: `None` (and no clock read) while disabled.
    #[inline]
    pub(super) fn start(&self) -> Option<Instant> {
        self.enabled.load(Ordering::Relaxed).then(Instant::now)
    }

    /// Adds the time since `start` (from [`OpProfile::start`]) to `op`.
    #[inline]
    pub(super) fn stop(&self, op: Op, start: Option<Instant>) {
        if let Some(t) = start {
            let i = op as usize;
            let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.nanos[i].fetch_add(ns, Ordering::Relaxed);
            self.calls[i].fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_op_indexes_its_own_counter() {
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i, "{}", op.name());
        }
    }

    #[test]
    fn nothing_is_counted_while_disabled_and_take_clears() {
        let p = OpProfile::default();
        let s = p.start();
        assert!(s.is_none());
        p.stop(Op::Head, s);
        assert_eq!(p.take().get(Op::Head), (Duration::ZERO, 0));
        p.set_enabled(true);
        let s = p.start();
        p.stop(Op::Head, s);
        p.stop(Op::Head, p.start());
        assert_eq!(p.take().get(Op::Head).1, 2);
        assert_eq!(p.take().get(Op::Head).1, 0);
    }
}
