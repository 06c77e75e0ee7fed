//! A cache of recent sessions keyed by their token ids, for KV reuse across requests.
//!
//! After a request, its session (prompt plus completion, all but the last sampled token)
//! is kept. A later request whose prompt shares a prefix with a kept session starts
//! from a byte-exact copy of that session's cache cut to the shared prefix (a tail
//! eviction, exact: nothing after it is renumbered) and prefills only the rest, so the
//! output is the same as a cold run (rungs R14 and R2a: prefix clone == recompute,
//! decode == prefill). Entries are whole sessions, bounded by a byte budget
//! ([`fak_kv::KvCache::bytes_used`]) with least-recently-used eviction.

use fak_kv::Session;
use std::sync::Arc;

struct Entry {
    session: Arc<Session>,
    last_used: u64,
}

/// Recent sessions, longest-prefix lookup, LRU within a byte budget.
pub struct PrefixCache {
    entries: Vec<Entry>,
    budget_bytes: usize,
    tick: u64,
}

/// A lookup hit: a kept session and how many of the prompt's leading tokens it holds.
pub struct Hit {
    /// The kept session (shared; copy it before use).
    pub session: Arc<Session>,
    /// Tokens of the prompt it holds, `< prompt.len()` (at least one prompt token is
    /// always left to prefill, to produce the logits generation starts from).
    pub reuse: usize,
}

impl PrefixCache {
    /// An empty cache holding at most `budget_bytes` of KV entries (0 keeps nothing).
    pub fn new(budget_bytes: usize) -> Self {
        PrefixCache {
            entries: Vec::new(),
            budget_bytes,
            tick: 0,
        }
    }

    /// Sessions held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of KV entries held.
    pub fn bytes(&self) -> usize {
        self.entries
            .iter()
            .map(|e| e.session.cache().bytes_used())
            .sum()
    }

    /// The kept session sharing the longest prefix with `prompt` (ties: the most
    /// recently used), if it shares at least one token. Marks it used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<Hit> {
        let limit = prompt.len().saturating_sub(1);
        let mut best: Option<(usize, usize, u64)> = None; // (index, reuse, last_used)
        for (i, e) in self.entries.iter().enumerate() {
            let common = e
                .session
                .ids()
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
                .min(limit);
            if common == 0 {
                continue;
            }
            let better = match best {
                None => true,
                Some((_, r, t)) => common > r || (common == r && e.last_used > t),
            };
            if better {
                best = Some((i, common, e.last_used));
            }
        }
        let (i, reuse, _) = best?;
        self.tick += 1;
        self.entries[i].last_used = self.tick;
        Some(Hit {
            session: Arc::clone(&self.entries[i].session),
            reuse,
        })
    }

    /// Keeps `session`. Entries whose ids are a prefix of its ids are dropped (it covers
    /// them); if it is itself a prefix of a kept entry, that entry is only marked used.
    /// Then least-recently-used entries go until the budget holds; a session larger
    /// than the whole budget is not kept.
    pub fn insert(&mut self, session: Session) {
        self.tick += 1;
        let ids = session.ids();
        if ids.is_empty() || session.cache().bytes_used() > self.budget_bytes {
            return;
        }
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.session.ids().starts_with(ids))
        {
            e.last_used = self.tick;
            return;
        }
        self.entries.retain(|e| !ids.starts_with(e.session.ids()));
        self.entries.push(Entry {
            session: Arc::new(session),
            last_used: self.tick,
        });
        while self.bytes() > self.budget_bytes {
            let Some((oldest, _)) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
            else {
                break;
            };
            self.entries.swap_remove(oldest);
        }
    }
}

/// A session ready to generate from `prompt`: a copy of the best kept session cut to
/// the shared prefix, or a copy of `empty`. Returns it and the number of prompt tokens
/// reused; the caller prefills `prompt[reused..]` (never empty).
///
/// `empty` is an empty session of the model with the capacity wanted (the context
/// length). Copying it rather than calling `Session::new` each time matters for memory:
/// `Session::new` reserves buffers for the whole context up front, while a copy
/// allocates only what it holds and grows as tokens arrive, so kept sessions cost what
/// they hold.
///
/// # Errors
/// A cache eviction out of range (cannot happen for a hit from [`PrefixCache::lookup`]).
pub fn start_session(
    hit: Option<Hit>,
    empty: &Session,
) -> Result<(Session, usize), fak_kv::SessionError> {
    match hit {
        Some(Hit { session, reuse }) => {
            let mut s = Session::clone(&session);
            let tail = s.len() - reuse;
            if tail > 0 {
                // A tail eviction: nothing after the span, so the cache is exactly the
                // prefix's.
                s.evict(reuse, tail)?;
            }
            Ok((s, reuse))
        }
        None => Ok((empty.clone(), 0)),
    }
}
