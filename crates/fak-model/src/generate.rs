//! Greedy generation over a [`VecKvCache`]: prefill the prompt, then decode one token
//! per step. (fak-kv's `Session` is the full-featured version; this one serves the
//! model's own proofs and the CLI's token-id mode.)

use crate::kv::{KvStore, VecKvCache};
use crate::{ForwardScratch, LogitsWanted, Model, ModelError};
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
///
/// Two vector passes (a 262,144-logit head made the one-pass loop ~2% of a Gemma 3
/// decode step): the largest non-NaN value ([`fak_tensor::max_skipping_nan`]; which
/// zero of `±0` it keeps does not matter), then the first index equal to it
/// ([`fak_tensor::first_equal`]: `−0 == +0`, as the one-pass `>` treats them). All NaN
/// (or empty): index 0.
pub fn argmax(logits: &[f32]) -> u32 {
    let max = fak_tensor::max_skipping_nan(logits);
    fak_tensor::first_equal(logits, max).unwrap_or(0) as u32
}

/// Greedy decoding (HF `generate(do_sample=False)`): prefill `prompt`, then repeatedly
/// take the argmax token, stopping after `max_new_tokens` or, when `stop_at_eos`, after
/// an id in `config().eos_token_ids`. When the sequence crosses a longrope model's
/// original context ([`ModelError::RopeRegimeChange`]) the whole sequence runs again
/// as one pass, as HF's `generate` does for Phi-3.
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
    // Kept between the decode steps, which then allocate nothing.
    let mut scratch = ForwardScratch::new();
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
        let want = LogitsWanted::Last;
        let step = model.forward_into(
            &[next],
            &[pos],
            &mut kv,
            want,
            None,
            &mut scratch,
            &mut logits,
        );
        if let Err(ModelError::RopeRegimeChange { .. }) = step {
            // The sequence crossed a longrope model's original context: run all of it
            // again as one pass, as HF's `generate` does.
            let all: Vec<u32> = prompt.iter().chain(&out).copied().collect();
            let positions: Vec<u32> = (0..all.len() as u32).collect();
            kv = VecKvCache::new(c.num_hidden_layers, capacity);
            logits = model.forward(&all, &positions, &mut kv, want, None)?;
        } else {
            step?;
        }
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

#[cfg(test)]
mod tests {
    use super::argmax;

    /// The one-pass definition: the first index whose value no later value exceeds,
    /// NaN never winning.
    fn argmax_one_pass(logits: &[f32]) -> u32 {
        let mut best = 0usize;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] || logits[best].is_nan() && !v.is_nan() {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_largest_and_skips_nan() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            (state >> 33) as u32
        };
        // Values from a small set, so ties (and ties of −0 with +0) are common.
        let pool = [
            -1.0f32,
            0.0,
            -0.0,
            0.5,
            2.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        for len in [0usize, 1, 2, 15, 16, 17, 33, 100, 1000] {
            for _ in 0..200 {
                let v: Vec<f32> = (0..len)
                    .map(|_| pool[next() as usize % pool.len()])
                    .collect();
                assert_eq!(argmax(&v), argmax_one_pass(&v), "{v:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN; 40]), 0);
        assert_eq!(argmax(&[f32::NAN, 1.0, 3.0, 3.0]), 2);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY]), 0);
    }
}
