//! Text generation over a session: sampling, stop tokens, stop strings, streaming
//! detokenization and timings (TTFT, prefill and decode tokens/s).

use crate::grammar::{mask_logits, DeadEnd, Grammar};
use crate::logprobs::{token_logprob, TokenLogprob};
use crate::sampling::{Sampler, SamplingParams};
use crate::stop::StopStrings;
use crate::{Session, SessionError};
use fak_model::{StreamDecoder, Tokenizer};
use serde::Serialize;
use std::collections::VecDeque;
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
    /// They are matched in the text a grammar ([`TextParams::grammar`]) does not
    /// constrain only: never inside a constrained reply (the grammar decides where it
    /// ends, so a JSON reply is never cut mid-object), and for a lazy grammar only in the
    /// free text up to and including its trigger's token.
    pub stop: Vec<String>,
    /// Stop token ids (EOS, end of turn): generation ends after one, which is returned in
    /// `completion_ids` but not in the text.
    pub stop_ids: Vec<u32>,
    /// `Some(n)`: record each generated token's logprob and its `n` most likely
    /// alternatives (see [`crate::logprobs`]; `n` is capped at
    /// [`crate::logprobs::MAX_TOP_LOGPROBS`]). `None`: no records, no extra work.
    pub logprobs: Option<usize>,
    /// `Some`: each step's choice is constrained to the tokens this grammar allows
    /// ([`crate::grammar`]): disallowed rows of the logits get no probability, the
    /// allowed rows are the step's own bits, and `stop_ids` are allowed only where the
    /// grammar can end. Logprob records still come from the unmasked logits. `None`:
    /// unconstrained, and no extra work. A lazy grammar ([`Grammar::lazy`]) starts
    /// only once the generated text (the tokens' bytes, control tokens excluded)
    /// contains its trigger: the steps before are unconstrained, bit for bit the
    /// steps of a run without it, and the grammar then takes the bytes the trigger's
    /// token carried past the trigger and masks every later step. Should it refuse
    /// those bytes, the text goes on unconstrained until the trigger comes again.
    pub grammar: Option<Grammar>,
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
    /// A grammar ([`TextParams::grammar`]) allowed no token at a step, or its parser
    /// failed: the text so far is kept and does not complete the grammar
    /// ([`TextOutput::dead_end`] says why).
    GrammarDeadEnd,
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
    /// With [`FinishReason::GrammarDeadEnd`]: why the grammar allowed no token
    /// (llguidance's message, or "no token is allowed at this step"); else `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dead_end: Option<String>,
    /// Whether one of [`TextParams::stop`]'s strings ended it (with
    /// [`FinishReason::Stop`]); `false` when a stop token or a grammar's end did.
    pub stop_string: bool,
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
    /// Seconds from each generated token to the next (its decode step, sampling and
    /// any wait for a batched pass): `completion_ids.len() - 1` values, in order (the
    /// first token's time is `ttft_s`). Not serialized.
    #[serde(skip)]
    pub token_gaps_s: Vec<f32>,
    /// Of `decode_steps`, those whose output head computed only the rows the grammar
    /// allowed at the next step ([`Session::decode_rows`]; with a grammar, no logprobs
    /// and few allowed tokens, [`fak_model::Model::head_rows_pay`]).
    #[serde(skip_serializing_if = "is_zero")]
    pub head_rows_steps: usize,
    /// With [`TextParams::logprobs`]: the records passed to `on_piece`, in order (see
    /// [`generate_text_with_logprobs`] for which tokens they cover); else empty.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TokenLogprob>,
}

/// A generated token's record, waiting for the text that releases it.
struct Pending {
    rec: TokenLogprob,
    /// Bytes of decoded text before this token's piece.
    start: usize,
    /// Bytes of decoded text once this token's last byte is decoded; `None` while the
    /// decoder holds it back (part of an incomplete UTF-8 character).
    end: Option<usize>,
}

/// How [`Release::emit`] treats the records still waiting.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Moment {
    /// Generation goes on: records whose last byte is released go with the text.
    Mid,
    /// A stop string ended it at the end of this text: records of tokens with at least
    /// one byte before the stop go with it, the rest are dropped.
    Stopped,
    /// It ended otherwise: every record left goes with this text (even if empty).
    Last,
}

/// Hands released text, and the records it releases, to the caller.
struct Release<'a> {
    released: usize,
    pending: VecDeque<Pending>,
    on_piece: &'a mut dyn FnMut(&str, &[TokenLogprob]),
}

impl Release<'_> {
    fn emit(&mut self, text: &str, moment: Moment, out: &mut TextOutput) {
        self.released += text.len();
        let mut ready = Vec::new();
        if !text.is_empty() || moment != Moment::Mid {
            while let Some(p) = self.pending.front() {
                let take = match moment {
                    Moment::Mid => p.end.is_some_and(|e| e <= self.released),
                    Moment::Stopped => p.start < self.released,
                    Moment::Last => true,
                };
                match self.pending.pop_front() {
                    Some(p) if take => ready.push(p.rec),
                    Some(p) => {
                        self.pending.push_front(p);
                        break;
                    }
                    None => break,
                }
            }
        }
        if moment == Moment::Stopped {
            self.pending.clear();
        }
        if !text.is_empty() || !ready.is_empty() {
            out.text.push_str(text);
            (self.on_piece)(text, &ready);
            out.logprobs.extend(ready);
        }
    }
}

/// Prefills `new_ids` (may be empty if the session already holds logits), then generates
/// until a stop token, a stop string, `max_tokens`, or `cancel`. `cancel` is checked
/// between the prefill's batches of [`fak_model::Model::prefill_chunk`] tokens and
/// before each decode step; a cancelled prefill returns
/// [`FinishReason::Cancelled`] with no text, the session holding the batches that ran. Each piece of released
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
    generate_text_with_logprobs(session, tokenizer, new_ids, params, cancel, &mut |t, _| {
        on_text(t)
    })
}

/// [`generate_text`], passing each piece of text with the logprob records of the tokens
/// it releases (empty unless [`TextParams::logprobs`] is set).
///
/// Which records go with which piece:
/// - a token's record goes with the piece that releases its last byte. A token whose
///   text the decoder holds back (part of a UTF-8 character) or the stop-string check
///   holds back (a possible start of a stop string) waits for the piece that releases
///   it; a token with no text of its own (a control token the decoder drops) goes with
///   the next piece;
/// - a stop token (EOS, end of turn) gets no record: it is not part of the text;
/// - when a stop string ends generation, the tokens with at least one byte before the
///   stop go with the last piece (a token may straddle the stop); tokens wholly inside
///   the stop string get none;
/// - when generation ends otherwise, every record left goes with the last piece, which
///   may then be empty text (the only time a piece is empty).
///
/// So the records of all pieces, concatenated, are [`TextOutput::logprobs`], and unless
/// a stop string or a dropped control token intervenes their bytes concatenate to the
/// text.
///
/// # Errors
/// As [`generate_text`].
pub fn generate_text_with_logprobs(
    session: &mut Session,
    tokenizer: &Tokenizer,
    new_ids: &[u32],
    params: &TextParams,
    cancel: Option<&AtomicBool>,
    on_piece: &mut dyn FnMut(&str, &[TokenLogprob]),
) -> Result<TextOutput, SessionError> {
    let t0 = Instant::now();
    let cancelled = || cancel.is_some_and(|c| c.load(Ordering::Relaxed));
    if new_ids.is_empty() {
        session.last_logits().ok_or(SessionError::NoLogits)?;
    }
    // The prefill runs in the model's own batches ([`fak_model::Model::prefill_chunk`]),
    // one call each, so that `cancel` stops it between batches: the same passes the
    // model runs for one call, so the same bits.
    // A prompt the session would refuse goes in one call, so that the error comes
    // before any batch runs and leaves the session unchanged, as one call does.
    let chunk = session.model().prefill_chunk().max(1);
    let cfg = session.model().config();
    let room = (session.cache().capacity().saturating_sub(session.len())).min(
        cfg.max_position_embeddings
            .saturating_sub(session.cache().next_position() as usize),
    );
    let valid = new_ids.len() <= room && new_ids.iter().all(|&id| (id as usize) < cfg.vocab_size);
    let mut prefilled = 0;
    if !valid {
        session.prefill(new_ids)?;
        prefilled = new_ids.len();
    }
    for piece in new_ids[prefilled..].chunks(chunk) {
        if cancelled() {
            break;
        }
        match session.prefill(piece) {
            // A batcher hands a cancelled session's piece back unrun
            // (`Session::attach_cancellable`); the session rolled it back.
            Err(_) if cancelled() => break,
            r => r?,
        };
        prefilled += piece.len();
    }
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut sampler = Sampler::new(params.sampling.clone());
    // A lazy grammar waits for its trigger; `seen` holds the free text's last bytes
    // (at most the trigger's length before each new token's).
    let lazy = params
        .grammar
        .as_ref()
        .and_then(|g| g.trigger().map(|t| (g, t.as_bytes())))
        .filter(|(_, t)| !t.is_empty());
    let mut constraint = match lazy {
        Some(_) => None,
        None => params.grammar.as_ref().map(Grammar::start),
    };
    let mut seen: Vec<u8> = Vec::new();
    // The masked copy of a step's logits (grown once, reused every step).
    let mut masked: Vec<f32> = Vec::new();
    // The next step's allowed set, when it was computed before the decode step that
    // gives its logits (so that the step's head computes only the allowed rows):
    // `Some(Err)` is a dead end found then. The allowed ids go in `rows`.
    let mut ready: Option<Result<(), DeadEnd>> = None;
    let mut rows: Vec<u32> = Vec::new();
    let mut decoder = StreamDecoder::new(true);
    // Stop strings apply to unconstrained text only (see [`TextParams::stop`]): none
    // under a grammar that constrains from the first token; under a lazy one, until
    // its trigger.
    let mut stops = match (&params.grammar, lazy) {
        (Some(_), None) => StopStrings::default(),
        _ => StopStrings::new(&params.stop),
    };
    let mut out = TextOutput {
        completion_ids: Vec::new(),
        text: String::new(),
        finish_reason: FinishReason::Length,
        dead_end: None,
        stop_string: false,
        prefill_tokens: new_ids.len(),
        ttft_s: 0.0,
        prefill_s,
        decode_s: 0.0,
        decode_steps: 0,
        token_gaps_s: Vec::new(),
        head_rows_steps: 0,
        logprobs: Vec::new(),
    };
    let mut release = Release {
        released: 0,
        pending: VecDeque::new(),
        on_piece,
    };
    // Bytes of text the decoder has produced so far.
    let mut decoded = 0usize;
    let t1 = Instant::now();
    // When the last token was chosen (for `token_gaps_s`).
    let mut last_token: Option<Instant> = None;
    let mut stopped = false;
    if prefilled < new_ids.len() {
        out.finish_reason = FinishReason::Cancelled;
        return Ok(out);
    }
    while out.completion_ids.len() < params.max_tokens {
        if cancelled() {
            out.finish_reason = FinishReason::Cancelled;
            break;
        }
        // The logits of the last token run, borrowed from the session (a decode step
        // writes them in place, [`Session::decode`]).
        let logits = session.last_logits().ok_or(SessionError::NoLogits)?;
        let next = match constraint.as_mut() {
            None => sampler.sample(logits, session.ids()),
            Some(c) => {
                let step = match ready.take() {
                    Some(step) => step,
                    None => c.allowed(&params.stop_ids).map(|_| ()),
                };
                let allowed = c.current();
                match step {
                    Err(DeadEnd(why)) => {
                        out.finish_reason = FinishReason::GrammarDeadEnd;
                        out.dead_end = Some(why);
                        break;
                    }
                    // Complete, with no stop id to end on: the grammar's end is the stop.
                    Ok(()) if allowed.count() == 0 => {
                        out.finish_reason = FinishReason::Stop;
                        break;
                    }
                    Ok(()) => {
                        mask_logits(logits, allowed, &mut masked);
                        sampler.sample(&masked, session.ids())
                    }
                }
            }
        };
        let now = Instant::now();
        match last_token {
            None => out.ttft_s = (now - t0).as_secs_f64(),
            Some(t) => out.token_gaps_s.push((now - t).as_secs_f32()),
        }
        last_token = Some(now);
        out.completion_ids.push(next);
        if params.stop_ids.contains(&next) {
            out.finish_reason = FinishReason::Stop;
            break;
        }
        if let Some(c) = constraint.as_mut() {
            if let Err(DeadEnd(why)) = c.accept(next) {
                // Not reachable for a token the mask allowed; ends the reply rather than
                // continuing unconstrained.
                out.completion_ids.pop();
                out.finish_reason = FinishReason::GrammarDeadEnd;
                out.dead_end = Some(why);
                break;
            }
        }
        if let (None, Some((g, trigger))) = (&constraint, lazy) {
            if !tokenizer.is_special(next) {
                seen.extend_from_slice(tokenizer.token_bytes(next));
            }
            if let Some(at) = find_bytes(&seen, trigger) {
                let mut c = g.start();
                if c.accept_bytes(&seen[at + trigger.len()..]).is_ok() {
                    constraint = Some(c);
                }
                seen.clear();
            } else {
                let keep = trigger.len().saturating_sub(1);
                seen.drain(..seen.len().saturating_sub(keep));
            }
        }
        let piece = decoder.push(tokenizer, next);
        if let Some(n) = params.logprobs {
            release.pending.push_back(Pending {
                rec: token_logprob(logits, next, n, tokenizer),
                start: decoded,
                end: None,
            });
        }
        decoded += piece.len();
        if decoder.pending().is_empty() {
            resolve(&mut release.pending, decoded);
        }
        let check = stops.push(&piece);
        if check.stopped {
            release.emit(&check.emit, Moment::Stopped, &mut out);
            out.finish_reason = FinishReason::Stop;
            out.stop_string = true;
            stopped = true;
            break;
        }
        release.emit(&check.emit, Moment::Mid, &mut out);
        if constraint.is_some() && !stops.is_empty() {
            // A lazy grammar's trigger came: from here the grammar decides where the
            // reply ends, so the text held back as a possible stop string's start goes
            // out and no stop string is matched any more.
            let held = stops.finish();
            release.emit(&held, Moment::Mid, &mut out);
            stops = StopStrings::default();
        }
        if out.completion_ids.len() == params.max_tokens {
            break;
        }
        if !session.has_room() {
            // The context (or the cache's budget) is full: end as `length`, keeping the
            // text generated so far.
            break;
        }
        // The next step's allowed set depends only on the tokens chosen so far, so it
        // is computed now; when it is small (and no logprobs need the full row set) the
        // step's head computes only its rows, the same bits as the full head's.
        let mut head_rows = false;
        if let (Some(c), None) = (constraint.as_mut(), params.logprobs) {
            let step = c.allowed(&params.stop_ids).map(|a| {
                let n = a.count();
                head_rows = n > 0 && session.model().head_rows_pay(n);
                if head_rows {
                    a.ids_into(&mut rows);
                }
            });
            ready = Some(step);
        }
        let stepped = if head_rows {
            session.decode_rows(next, &rows).map(|_| true)
        } else {
            session.decode(next).map(|_| false)
        };
        match stepped {
            // As for the prefill: cancelled while waiting in a batcher.
            Err(_) if cancelled() => {
                out.finish_reason = FinishReason::Cancelled;
                break;
            }
            r => out.head_rows_steps += usize::from(r?),
        }
        out.decode_steps += 1;
    }
    if !stopped {
        let tail = decoder.finish();
        decoded += tail.len();
        resolve(&mut release.pending, decoded);
        let check = stops.push(&tail);
        if check.stopped {
            release.emit(&check.emit, Moment::Stopped, &mut out);
            out.finish_reason = FinishReason::Stop;
            out.stop_string = true;
        } else {
            release.emit(&check.emit, Moment::Mid, &mut out);
            let rest = stops.finish();
            release.emit(&rest, Moment::Last, &mut out);
        }
    }
    out.decode_s = t1.elapsed().as_secs_f64();
    Ok(out)
}

/// Where `needle` first occurs in `haystack` (`Some(0)` for an empty needle).
fn find_bytes(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return Some(0);
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Whether `n` is 0 (a count left out of the serialized output).
fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Gives the records still waiting for their last byte the end `decoded` (the decoder
/// has just produced all it held).
fn resolve(pending: &mut VecDeque<Pending>, decoded: usize) {
    for p in pending.iter_mut().rev() {
        if p.end.is_some() {
            break;
        }
        p.end = Some(decoded);
    }
}
