//! Greedy generation over a [`VecKvCache`]: prefill the prompt, then decode one token
//! per step. (fak-kv's `Session` is the full-featured version; this one serves the
//! model's own proofs and the CLI's token-id mode.)

use crate::kv::{KvStore, VecKvCache};
use crate::{LogitsWanted, Model, ModelError};
use std::time::Instant;

/// Result of [`generate_greedy`], with timings in seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The new tokens, ending with an EOS id if one was produced.
    pub completion_ids: Vec<u32>,
    /// Wall time of the prompt's forward pass (prefill), seconds.
    pub prefill_seconds: f64,
    /// Wall time of the decode steps, seconds.
    pub decode_seconds: f64,
    /// Number of decode steps (forward passes after the prefill).
    pub decode_steps: usize,
    /// Why generation stopped.
    pub stop: StopReason,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// An EOS id was produced (it is the last completion id).
    Eos,
    /// `max_new_tokens` were produced.
    MaxTokens,
}

/// Index of the largest logit; the first one on ties (as `torch.argmax`). NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding (HF `generate(do_sample=False)`): prefill `prompt`, then repeatedly
/// take the argmax token, stopping after `max_new_tokens` or, when `stop_at_eos`, after
/// an id in `config().eos_token_ids`.
///
/// # Errors
/// Any forward-pass error: an empty prompt, an out-of-range id, a context overflow.
pub fn generate_greedy(
    model: &Model,
    prompt: &[u32],
    max_new_tokens: usize,
    stop_at_eos: bool,
) -> Result<Generation, ModelError> {
    let c = model.config();
    let capacity = prompt
        .len()
        .saturating_add(max_new_tokens)
        .min(c.max_position_embeddings);
    let mut kv = VecKvCache::new(c.num_hidden_layers, capacity);
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let t0 = Instant::now();
    let mut logits = model.forward(prompt, &positions, &mut kv, LogitsWanted::Last, None)?;
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut out = Vec::new();
    let mut steps = 0;
    let mut stop = StopReason::MaxTokens;
    while out.len() < max_new_tokens {
        let next = argmax(&logits);
        out.push(next);
        if stop_at_eos && c.eos_token_ids.contains(&next) {
            stop = StopReason::Eos;
            break;
        }
        if out.len() == max_new_tokens {
            break;
        }
        let pos = kv.len() as u32;
        logits = model.forward(&[next], &[pos], &mut kv, LogitsWanted::Last, None)?;
        steps += 1;
    }
    Ok(Generation {
        completion_ids: out,
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
        decode_steps: steps,
        stop,
    })
}
