//! Text generation over a session: sampling, stop tokens, stop strings, streaming
//! detokenization and timings (TTFT, prefill and decode tokens/s).

use crate::sampling::{Sampler, SamplingParams};
use crate::stop::StopStrings;
use crate::{Session, SessionError};
use fak_model::{StreamDecoder, Tokenizer};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// What to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct TextParams {
    /// How to choose each token.
    pub sampling: SamplingParams,
    /// Most new tokens.
    pub max_tokens: usize,
    /// Stop strings: generation ends before the first occurrence, which is not returned.
    pub stop: Vec<String>,
    /// Stop token ids (EOS, end of turn): generation ends after one, which is returned in
    /// `completion_ids` but not in the text.
    pub stop_ids: Vec<u32>,
}

/// Why generation ended (OpenAI's `finish_reason` words).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// The caller cancelled.
    Cancelled,
}

/// The outcome of [`generate_text`]; times in seconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TextOutput {
    /// Every token generated, including a final stop token.
    pub completion_ids: Vec<u32>,
    /// The text released to the caller (stop strings and control tokens excluded).
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Tokens prefilled for this request (the new ones only).
    pub prefill_tokens: usize,
    /// Time to the first generated token: prefill plus one sampling.
    pub ttft_s: f64,
    /// Time of the prefill forward pass.
    pub prefill_s: f64,
    /// Time of the decode steps.
    pub decode_s: f64,
    /// Decode steps run (forward passes after the prefill).
    pub decode_steps: usize,
}

/// Prefills `new_ids` (may be empty if the session already holds logits), then generates
/// until a stop token, a stop string, `max_tokens`, or `cancel`. Each piece of released
/// text is passed to `on_text` as soon as it is complete: never half a UTF-8 character,
/// never part of a stop string.
///
/// # Errors
/// [`SessionError`] from the forward pass (context overflow, out-of-range ids) or
/// [`SessionError::NoLogits`] when `new_ids` is empty and nothing was prefilled.
pub fn generate_text(
    session: &mut Session,
    tokenizer: &Tokenizer,
    new_ids: &[u32],
    params: &TextParams,
    cancel: Option<&AtomicBool>,
    on_text: &mut dyn FnMut(&str),
) -> Result<TextOutput, SessionError> {
    let t0 = Instant::now();
    let mut logits = if new_ids.is_empty() {
        session
            .last_logits()
            .map(<[f32]>::to_vec)
            .ok_or(SessionError::NoLogits)?
    } else {
        session.prefill(new_ids)?
    };
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut sampler = Sampler::new(params.sampling.clone());
    let mut decoder = StreamDecoder::new(true);
    let mut stops = StopStrings::new(&params.stop);
    let mut out = TextOutput {
        completion_ids: Vec::new(),
        text: String::new(),
        finish_reason: FinishReason::Length,
        prefill_tokens: new_ids.len(),
        ttft_s: 0.0,
        prefill_s,
        decode_s: 0.0,
        decode_steps: 0,
    };
    let mut emit = |s: &str, text: &mut String| {
        if !s.is_empty() {
            text.push_str(s);
            on_text(s);
        }
    };
    let t1 = Instant::now();
    let mut stopped = false;
    while out.completion_ids.len() < params.max_tokens {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            out.finish_reason = FinishReason::Cancelled;
            break;
        }
        let next = sampler.sample(&logits, session.ids());
        if out.completion_ids.is_empty() {
            out.ttft_s = t0.elapsed().as_secs_f64();
        }
        out.completion_ids.push(next);
        if params.stop_ids.contains(&next) {
            out.finish_reason = FinishReason::Stop;
            break;
        }
        let piece = decoder.push(tokenizer, next);
        let check = stops.push(&piece);
        emit(&check.emit, &mut out.text);
        if check.stopped {
            out.finish_reason = FinishReason::Stop;
            stopped = true;
            break;
        }
        if out.completion_ids.len() == params.max_tokens {
            break;
        }
        if !session.has_room() {
            // The context (or the cache's budget) is full: end as `length`, keeping the
            // text generated so far.
            break;
        }
        logits = session.step(next)?;
        out.decode_steps += 1;
    }
    if !stopped {
        let tail = decoder.finish();
        let check = stops.push(&tail);
        emit(&check.emit, &mut out.text);
        if check.stopped {
            out.finish_reason = FinishReason::Stop;
        } else {
            emit(&stops.finish(), &mut out.text);
        }
    }
    out.decode_s = t1.elapsed().as_secs_f64();
    Ok(out)
}
