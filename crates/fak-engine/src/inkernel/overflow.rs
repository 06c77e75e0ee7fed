//! Past the context wall ([`ContextOverflow`]): a chat conversation that, with the room
//! its reply needs, no longer fits the window is cut before it is queued, dropping the
//! oldest whole turns behind the pinned system turn, and, in `shift` mode, the cached
//! conversation is cut the same way in place.
//!
//! Requests are stateless: each sends the whole history, so the cut is found again for
//! every request. It is made to stick, so that the next turns reuse the cache:
//!
//! 1. `k_min`: the fewest turns dropped for the prompt and the reply's room to fit.
//! 2. `k_deep`: the fewest dropped for the prompt to fill at most half the window, the
//!    headroom a fresh cut leaves for the turns after it.
//! 3. Among the cuts from `k_min` to `k_deep`, the one a kept conversation already
//!    starts with (its first kept message rendered after the system turn is in the
//!    cache: the cut an earlier request chose) is taken; when none is, `k_deep`.
//!
//! `rebuild` prefills the cut conversation (reusing only what is cached of exactly
//! it), so its cache is what a conversation that only ever held the kept turns holds.
//! `shift` first looks for a kept conversation that still holds turns now dropped (the
//! conversation's previous request, before a cut), evicts their span from a copy of it
//! ([`fak_kv::Session::evict`]: the survivors renumbered from their pre-RoPE keys in one
//! rotation) and prefills only what follows. That cache is an approximation (the kept
//! turns were computed with the dropped ones in context), so it is kept in a partition
//! of its own ([`shifted`]) that only `shift` requests read.

use super::{content_starts, lock, render_prompt, Loaded, Rendered, Shared};
use crate::prefix::{start_session, Partition};
use crate::{ContextOverflow, EngineError, GenerateRequest, Message, Prompt};

/// Reply room assumed when a request gives no `max_tokens`.
const DEFAULT_REPLY_ROOM: usize = 512;

/// Cuts of a conversation probed for a kept one, at most (each costs a short render).
const MAX_PROBES: usize = 64;

/// The room a reply needs before a conversation counts as overflowing, tokens: its
/// `max_tokens`, which turns are dropped to make room for (a request whose
/// `max_tokens` is lowered to the room left, [`GenerateRequest::cap_max_tokens`], as
/// Anthropic clients' large defaults are, needs at most a quarter of the window);
/// without `max_tokens`, [`DEFAULT_REPLY_ROOM`], at most a quarter of the window.
pub(super) fn reply_room(req: &GenerateRequest, context: usize) -> usize {
    let quarter = (context / 4).max(1);
    match req.max_tokens {
        Some(m) if req.cap_max_tokens => m.min(quarter),
        Some(m) => m,
        None => DEFAULT_REPLY_ROOM.min(quarter),
    }
    .max(1)
}

/// The partition `shift` keeps its approximate caches in, beside `name`'s.
pub(super) fn shifted(name: &str) -> Partition {
    Partition::new(&format!("{name}\u{0}shifted"))
}

/// A conversation's turns: `pinned` leading system/developer messages, then turns
/// starting at `starts` (message indices; a turn is a `user` message and what follows
/// up to the next; messages before the first `user` one form a turn of their own).
struct Turns {
    pinned: usize,
    starts: Vec<usize>,
}

fn turns(messages: &[Message]) -> Turns {
    let pinned = messages
        .iter()
        .take_while(|m| m.role == "system" || m.role == "developer")
        .count();
    let mut starts: Vec<usize> = (pinned..messages.len())
        .filter(|&i| messages[i].role == "user")
        .collect();
    if pinned < messages.len() && starts.first() != Some(&pinned) {
        starts.insert(0, pinned);
    }
    Turns { pinned, starts }
}

/// The evict-in-place part of a `shift` ([`try_shift`]).
pub(super) struct ShiftPlan {
    /// The conversation with the turns to drop still in it: the key a kept one is
    /// looked up by.
    with_dropped: Vec<u32>,
    /// Its partition (the shifted one or the exact one).
    from: Partition,
    /// The span of the dropped turns in it, tokens.
    evict_from: usize,
    evict_n: usize,
}

/// A conversation cut to fit.
pub(super) struct Fitted {
    /// The request with the kept messages.
    pub(super) req: GenerateRequest,
    pub(super) rendered: Rendered,
    /// Messages dropped.
    pub(super) dropped: usize,
    /// The partition the request reads and keeps its cache in.
    pub(super) partition: Partition,
    pub(super) shift: Option<ShiftPlan>,
}

/// `req` with the messages before `starts[k]` (after the pinned ones) dropped.
fn cut(req: &GenerateRequest, messages: &[Message], t: &Turns, k: usize) -> GenerateRequest {
    let mut kept: Vec<Message> = messages[..t.pinned].to_vec();
    kept.extend_from_slice(&messages[t.starts[k]..]);
    GenerateRequest {
        prompt: Prompt::Chat(kept),
        ..req.clone()
    }
}

/// Cuts `req` (a chat conversation whose prompt and reply room do not fit `context`)
/// as the module docs say. `Ok(None)`: not a chat prompt, or no turn can be dropped.
///
/// # Errors
/// A render error of the cut conversation; [`EngineError::InvalidRequest`] when even
/// the pinned system turn and the last turn leave no room for the reply.
pub(super) fn fit(
    s: &Shared,
    l: &Loaded,
    req: &GenerateRequest,
    mode: ContextOverflow,
    context: usize,
) -> Result<Option<Fitted>, EngineError> {
    let Prompt::Chat(messages) = &req.prompt else {
        return Ok(None);
    };
    let t = turns(messages);
    if t.starts.len() < 2 {
        return Ok(None);
    }
    let room = reply_room(req, context);
    let last = t.starts.len() - 1;
    // A cut's prompt when it fits with `limit` tokens to spare, else `None` (also for
    // a prompt too long to tokenize: its length check is the same test).
    let fits = |k: usize, limit: usize| -> Result<Option<Rendered>, EngineError> {
        match render_prompt(l, &cut(req, messages, &t, k), context) {
            Ok(r) if r.ids.len() + limit <= context => Ok(Some(r)),
            Ok(_) => Ok(None),
            Err(EngineError::InvalidRequest(m)) if m.contains("context window") => Ok(None),
            Err(e) => Err(e),
        }
    };
    // The smallest k in `lo..=last` that fits `limit` (fitting is monotone in k).
    let smallest = |lo: usize, limit: usize| -> Result<Option<usize>, EngineError> {
        if fits(last, limit)?.is_none() {
            return Ok(None);
        }
        let (mut a, mut b) = (lo, last);
        while a < b {
            let m = (a + b) / 2;
            if fits(m, limit)?.is_some() {
                b = m;
            } else {
                a = m + 1;
            }
        }
        Ok(Some(a))
    };
    let Some(k_min) = smallest(0, room)? else {
        return Err(EngineError::InvalidRequest(format!(
            "even the system turn and the last turn alone leave no room for a reply of {room} tokens in the context window of {context} tokens"
        )));
    };
    let k_deep = smallest(k_min, room.max(context - context / 2))?.unwrap_or(k_min);
    let exact = Partition::new(&req.cache_partition);
    let shift = shifted(&req.cache_partition);
    let partitions: &[Partition] = match mode {
        ContextOverflow::Shift => &[shift, exact],
        _ => &[exact],
    };
    // The pinned turn and turn k's first message, rendered without a generation
    // prompt: a kept conversation cut at k starts with these tokens.
    let head = |k: usize| -> Option<Vec<u32>> {
        let mut m: Vec<Message> = messages[..t.pinned].to_vec();
        m.push(messages[t.starts[k]].clone());
        let prep = crate::tools::prepare(
            &m,
            &req.tools,
            &req.tool_choice,
            crate::tools::template_renders_tools(l.template.source()),
        );
        l.template
            .encode(&l.tokenizer, &prep.messages, false, prep.tools.as_ref())
            .ok()
    };
    let kept_at = |k: usize| -> Option<Partition> {
        let h = head(k)?;
        let p = lock(&s.prefix);
        partitions
            .iter()
            .find(|part| p.shared_len_in(part, &h) == h.len())
            .copied()
    };
    let chosen = (k_min..=k_deep)
        .take(MAX_PROBES)
        .find_map(|k| kept_at(k).map(|p| (k, p)));
    let (k, partition) = chosen.unwrap_or((k_deep, exact));
    let mut plan = None;
    let mut partition = partition;
    if mode == ContextOverflow::Shift && chosen.is_none() {
        // The conversation's previous request, cut earlier (or not at all).
        if let Some((k0, from)) = (0..k_min)
            .rev()
            .take(MAX_PROBES)
            .find_map(|k0| kept_at(k0).map(|p| (k0, p)))
        {
            plan = shift_plan(l, req, messages, &t, k0, k, from);
            if plan.is_some() {
                partition = shift;
            }
        }
    }
    let c = cut(req, messages, &t, k);
    let rendered = render_prompt(l, &c, context)?;
    Ok(Some(Fitted {
        req: c,
        rendered,
        dropped: t.starts[k] - t.pinned,
        partition,
        shift: plan,
    }))
}

/// The span of turns `k0..k` in the conversation cut at `k0`.
fn shift_plan(
    l: &Loaded,
    req: &GenerateRequest,
    messages: &[Message],
    t: &Turns,
    k0: usize,
    k: usize,
    from: Partition,
) -> Option<ShiftPlan> {
    let c = cut(req, messages, t, k0);
    // Not checked against the window: it is a lookup key, never run.
    let r = render_prompt(l, &c, usize::MAX).ok()?;
    let Prompt::Chat(m) = &c.prompt else {
        return None;
    };
    let starts = content_starts(&l.tokenizer, &l.template, m.len(), r.prep.as_ref()?, &r.ids)?;
    let a = *starts.get(t.pinned)?;
    let b = *starts.get(t.pinned + (t.starts[k] - t.starts[k0]))?;
    (a > 0 && b > a).then_some(ShiftPlan {
        with_dropped: r.ids,
        from,
        evict_from: a,
        evict_n: b - a,
    })
}

/// Carries out `plan` for the prompt `ids`: a copy of the kept conversation that still
/// holds the dropped turns, their span evicted; the session and how many of `ids` it
/// holds. `None` when no kept conversation holds the span whole or the result is not
/// a prefix of `ids` (the caller then prefills as `rebuild` would).
pub(super) fn try_shift(
    s: &Shared,
    l: &Loaded,
    plan: &ShiftPlan,
    ids: &[u32],
) -> Option<(fak_kv::Session, usize)> {
    let hit = lock(&s.prefix).lookup_in(&plan.from, &plan.with_dropped)?;
    if hit.reuse < plan.evict_from + plan.evict_n {
        return None;
    }
    let (mut session, _) = start_session(Some(hit), &l.empty).ok()?;
    session.evict(plan.evict_from, plan.evict_n).ok()?;
    let held = session.len();
    if held == 0 || session.ids() != &ids[..held.min(ids.len())] {
        return None;
    }
    if held >= ids.len() {
        // At least one prompt token is run, for the logits the reply starts from.
        let extra = held + 1 - ids.len();
        session.evict(held - extra, extra).ok()?;
    }
    let reused = session.len();
    Some((session, reused))
}
