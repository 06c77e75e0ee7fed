//! Continuous batching: the forward passes of many sessions run together.
//!
//! A [`Batcher`] owns one thread that runs every pass of the sessions attached to it
//! ([`Session::attach`]): each session's prefill or decode call hands its tokens and
//! its cache (moved, not copied) to that thread and waits for them back. The thread
//! gathers the calls of all attached sessions into one [`Model::forward_batch`], so a
//! decode step of B conversations reads every weight once instead of B times. Sessions
//! join and leave between passes. Everything else (sampling, grammars, stop strings,
//! streaming) stays in the caller's own thread, per session, unchanged.
//!
//! Nothing a session computes depends on what shares its pass: the model's batch
//! invariance ([`Model::forward_batch`]) gives each sequence the bits of its solo run,
//! and a prompt split into pieces across passes gives the bits of one prefill
//! (decode == prefill). `tests/batch.rs` asserts both through sessions.
//!
//! Scheduling ([`BatchPolicy`]):
//! - a pass starts when every attached session has a call waiting, or
//!   [`BatchPolicy::gather`] after the first call of the pass arrived (a session busy
//!   sampling, or not generating, does not hold the others up longer);
//! - decode tokens (calls of one token) all go into the pass, oldest first, at most
//!   [`BatchPolicy::max_rows`] rows;
//! - prompts are prefilled in pieces: with decode tokens in the pass, or another
//!   attached session not in it (it may be between two decode steps), the rows left
//!   of [`BatchPolicy::max_rows`] (at least [`BatchPolicy::min_prefill_rows`]); when
//!   every attached session's call is a prompt in this pass (nobody is between two
//!   decode steps), up to [`BatchPolicy::max_prefill_rows`] rows of them together, so
//!   prompts that arrive together are prefilled together and their sessions decode
//!   together from their first token on. So a long prompt arriving delays the others'
//!   next token by a bounded amount, not by its whole prefill. Prompts are served in
//!   the order they arrived (FIFO).

use crate::cache::KvCache;
use crate::Session;
use fak_model::{BatchSeq, ForwardScratch, LogitsWanted, Model, ModelError};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How a [`Batcher`] forms its passes (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchPolicy {
    /// Most rows (tokens of all sessions) one pass runs while some session decodes.
    pub max_rows: usize,
    /// Rows a waiting prompt gets per pass even when decode tokens fill
    /// [`BatchPolicy::max_rows`].
    pub min_prefill_rows: usize,
    /// Longest a pass waits, after its first call, for the other attached sessions'.
    pub gather: Duration,
    /// Most prompt rows one pass runs when no session decodes (llama.cpp's server
    /// takes up to its `n_batch`, 2,048 tokens, of all waiting prompts in one pass):
    /// eight 64-token prompts arriving at once are one pass, and their sessions then
    /// decode together, where a pass of [`Model::prefill_chunk`] rows left half of them
    /// to be prefilled a few rows a pass beside the others' decode steps. The model
    /// runs a pass in batches of [`Model::prefill_chunk`] tokens, so this bounds how
    /// long a pass takes (what a session attaching meanwhile waits), not its memory.
    pub max_prefill_rows: usize,
}

impl Default for BatchPolicy {
    fn default() -> Self {
        BatchPolicy {
            max_rows: 32,
            min_prefill_rows: 16,
            gather: Duration::from_millis(2),
            max_prefill_rows: 1024,
        }
    }
}

/// Upper bounds of [`BatchStats::passes_within`]'s batch sizes (sequences in a pass).
pub const BATCH_SIZE_BOUNDS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

/// Counters of a [`Batcher`] since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Passes run.
    pub passes: u64,
    /// Sequences summed over the passes (divided by `passes`: the mean batch size).
    pub sequences: u64,
    /// Rows (tokens) summed over the passes.
    pub rows: u64,
    /// Most sequences one pass held.
    pub max_sequences: usize,
    /// Passes that held at most [`BATCH_SIZE_BOUNDS`]`[i]` sequences, per `i`
    /// (cumulative, as a Prometheus histogram's buckets; a pass of more than the last
    /// bound is counted in `passes` only).
    pub passes_within: [u64; BATCH_SIZE_BOUNDS.len()],
    /// Sessions attached now.
    pub attached: usize,
    /// Calls waiting now.
    pub waiting: usize,
}

/// A session's call handed to the batcher thread: its new tokens, its cache (moved in,
/// handed back) and where the logits go.
struct Call {
    ids: Vec<u32>,
    positions: Vec<u32>,
    /// Rows of `ids` already run (a prompt runs in pieces).
    done: usize,
    want: LogitsWanted,
    head_rows: Option<Vec<u32>>,
    cache: KvCache,
    logits: Vec<f32>,
    /// The first error of its pieces (the rest do not run).
    result: Result<(), ModelError>,
    reply: Arc<Reply>,
    /// When it was handed over (the order prompts are served in).
    seq: u64,
    /// The session's cancel flag ([`Session::attach_cancellable`]): once set, the
    /// call's remaining pieces do not run.
    cancel: Option<Arc<AtomicBool>>,
}

/// What a finished call hands back.
type Returned = (KvCache, Vec<f32>, Result<(), ModelError>);

/// Where a session waits for its call to come back.
#[derive(Default)]
struct Reply {
    slot: Mutex<Option<Returned>>,
    ready: Condvar,
}

#[derive(Default)]
struct State {
    waiting: Vec<Call>,
    attached: usize,
    next_seq: u64,
    shutdown: bool,
    stats: BatchStats,
}

struct Inner {
    model: Arc<Model>,
    policy: BatchPolicy,
    state: Mutex<State>,
    /// Signalled when a call arrives or a session detaches.
    arrived: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The handle of a batching thread for one model (cheap to clone; the thread stops
/// when the last handle and the last attached session are gone).
#[derive(Clone)]
pub struct Batcher {
    inner: Arc<Inner>,
    /// Stops the thread when the last handle drops.
    _owner: Arc<Owner>,
}

/// Tells the thread to stop when dropped (held by the [`Batcher`] handles only).
struct Owner(Arc<Inner>);

impl Drop for Owner {
    fn drop(&mut self) {
        lock(&self.0.state).shutdown = true;
        self.0.arrived.notify_all();
    }
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Batcher {
    /// Starts the batching thread for `model` with `policy`.
    ///
    /// # Errors
    /// The OS's error when the thread cannot be spawned.
    pub fn new(model: Arc<Model>, policy: BatchPolicy) -> std::io::Result<Batcher> {
        let inner = Arc::new(Inner {
            model,
            policy,
            state: Mutex::new(State::default()),
            arrived: Condvar::new(),
        });
        let run = Arc::clone(&inner);
        std::thread::Builder::new()
            .name("fak-batch".into())
            .spawn(move || run.serve())?;
        Ok(Batcher {
            _owner: Arc::new(Owner(Arc::clone(&inner))),
            inner,
        })
    }

    /// The model its sessions must run.
    pub fn model(&self) -> &Arc<Model> {
        &self.inner.model
    }

    /// Counters since it started, and the sessions attached and waiting now.
    pub fn stats(&self) -> BatchStats {
        let st = lock(&self.inner.state);
        BatchStats {
            attached: st.attached,
            waiting: st.waiting.len(),
            ..st.stats
        }
    }
}

/// A session's membership of a batcher ([`Session::attach`]): counted as attached until
/// dropped.
pub(crate) struct Member {
    batcher: Batcher,
    reply: Arc<Reply>,
    cancel: Option<Arc<AtomicBool>>,
}

impl Member {
    pub(crate) fn join(batcher: &Batcher, cancel: Option<Arc<AtomicBool>>) -> Member {
        lock(&batcher.inner.state).attached += 1;
        Member {
            batcher: batcher.clone(),
            reply: Arc::new(Reply::default()),
            cancel,
        }
    }

    /// Runs `ids` at `positions` over `cache` in the batcher's passes, writing the logits
    /// `want` asks for into `logits` (as [`Model::forward_into`] or, with `head_rows`,
    /// [`Model::forward_rows_into`] would), and waits for it.
    pub(crate) fn run(
        &self,
        ids: &[u32],
        positions: &[u32],
        cache: &mut KvCache,
        want: LogitsWanted,
        head_rows: Option<&[u32]>,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let inner = &self.batcher.inner;
        {
            let mut st = lock(&inner.state);
            if st.shutdown {
                return Err(ModelError::InvalidInput("the batcher has stopped".into()));
            }
            let seq = st.next_seq;
            st.next_seq += 1;
            st.waiting.push(Call {
                ids: ids.to_vec(),
                positions: positions.to_vec(),
                done: 0,
                want,
                head_rows: head_rows.map(<[u32]>::to_vec),
                cache: std::mem::take(cache),
                logits: std::mem::take(logits),
                result: Ok(()),
                reply: Arc::clone(&self.reply),
                seq,
                cancel: self.cancel.clone(),
            });
        }
        inner.arrived.notify_all();
        let mut slot = lock(&self.reply.slot);
        loop {
            if let Some((c, l, r)) = slot.take() {
                *cache = c;
                *logits = l;
                return r;
            }
            slot = self
                .reply
                .ready
                .wait(slot)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let inner = &self.batcher.inner;
        let mut st = lock(&inner.state);
        st.attached = st.attached.saturating_sub(1);
        drop(st);
        inner.arrived.notify_all();
    }
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Member")
    }
}

/// A piece of a call in one pass: the call's index and the rows it runs.
struct Piece {
    call: usize,
    rows: std::ops::Range<usize>,
}

impl Inner {
    /// The batching thread: gathers calls, runs a pass, hands back the calls that
    /// finished, until shut down (calls still waiting then fail).
    fn serve(&self) {
        let mut scratch = ForwardScratch::new();
        let mut st = lock(&self.state);
        let mut first: Option<Instant> = None;
        loop {
            if st.shutdown && st.attached == 0 {
                for c in st.waiting.drain(..) {
                    let stopped = ModelError::InvalidInput("the batcher has stopped".into());
                    finish(c, Err(stopped));
                }
                return;
            }
            if st.waiting.is_empty() {
                first = None;
                st = self
                    .arrived
                    .wait(st)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            let since = *first.get_or_insert_with(Instant::now);
            let all_here = st.waiting.len() >= st.attached;
            let left = self.policy.gather.saturating_sub(since.elapsed());
            if !all_here && !left.is_zero() {
                st = self
                    .arrived
                    .wait_timeout(st, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
                continue;
            }
            first = None;
            let mut calls: Vec<Call> = Vec::new();
            // A cancelled call goes back at once, its pieces that ran with it (the
            // session rolls them back).
            for c in std::mem::take(&mut st.waiting) {
                if c.cancel.as_ref().is_some_and(|f| f.load(Ordering::Relaxed)) {
                    finish(c, Err(ModelError::InvalidInput(CANCELLED.into())));
                } else {
                    calls.push(c);
                }
            }
            if calls.is_empty() {
                continue;
            }
            calls.sort_by_key(|c| c.seq);
            let pieces = self.plan(&calls, st.attached);
            drop(st);
            // A panic in a pass fails its calls (their sessions roll back) instead of
            // leaving them waiting for a thread that is gone.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.run_pass(&mut calls, &pieces, &mut scratch)
            }));
            if ran.is_err() {
                scratch = ForwardScratch::new();
                for c in &mut calls {
                    c.result = Err(ModelError::InvalidInput("the batched pass panicked".into()));
                }
            }
            st = lock(&self.state);
            st.stats.passes += 1;
            st.stats.sequences += pieces.len() as u64;
            st.stats.rows += pieces.iter().map(|p| p.rows.len() as u64).sum::<u64>();
            st.stats.max_sequences = st.stats.max_sequences.max(pieces.len());
            for (n, &bound) in st.stats.passes_within.iter_mut().zip(&BATCH_SIZE_BOUNDS) {
                *n += u64::from(pieces.len() <= bound);
            }
            // Calls not finished (a prompt with pieces left) wait for the next pass,
            // before any that arrived meanwhile.
            let mut kept: VecDeque<Call> = VecDeque::new();
            for mut c in calls {
                if c.done < c.ids.len() && c.result.is_ok() {
                    kept.push_back(c);
                } else {
                    let r = std::mem::replace(&mut c.result, Ok(()));
                    finish(c, r);
                }
            }
            let arrived = std::mem::take(&mut st.waiting);
            st.waiting = kept.into_iter().chain(arrived).collect();
        }
    }

    /// Which rows of which calls the next pass runs (see the module docs), `attached`
    /// sessions being attached now.
    fn plan(&self, calls: &[Call], attached: usize) -> Vec<Piece> {
        let p = &self.policy;
        let mut pieces = Vec::new();
        let mut rows = 0;
        for (i, c) in calls.iter().enumerate() {
            if c.ids.len() == 1 && rows < p.max_rows.max(1) {
                pieces.push(Piece {
                    call: i,
                    rows: 0..1,
                });
                rows += 1;
            }
        }
        // A session attached but not in this pass may be between two decode steps
        // (sampling, streaming, a grammar's mask): its next token must not wait behind
        // a whole chunk of someone's prompt either.
        let decoding = rows > 0 || attached > calls.len();
        let mut budget = if decoding {
            p.max_rows
                .saturating_sub(rows)
                .max(p.min_prefill_rows.max(1))
        } else {
            p.max_prefill_rows.max(1)
        };
        for (i, c) in calls.iter().enumerate() {
            if c.ids.len() == 1 || budget == 0 {
                continue;
            }
            let n = (c.ids.len() - c.done).min(budget);
            pieces.push(Piece {
                call: i,
                rows: c.done..c.done + n,
            });
            budget -= n;
        }
        pieces
    }

    /// Runs the pieces as one [`Model::forward_batch`]; each call's logits gather in
    /// its buffer (a prompt's last piece gives the rows its call wants).
    fn run_pass(&self, calls: &mut [Call], pieces: &[Piece], scratch: &mut ForwardScratch) {
        let mut outs: Vec<Vec<f32>> = pieces.iter().map(|_| Vec::new()).collect();
        {
            let mut refs: Vec<Option<&mut Call>> = calls.iter_mut().map(Some).collect();
            let mut seqs: Vec<BatchSeq<'_>> = Vec::with_capacity(pieces.len());
            for (p, out) in pieces.iter().zip(outs.iter_mut()) {
                let Some(c) = refs[p.call].take() else {
                    continue;
                };
                let last = p.rows.end == c.ids.len();
                let (want, head_rows) = match c.want {
                    LogitsWanted::All => (LogitsWanted::All, None),
                    LogitsWanted::Last if last => (LogitsWanted::Last, c.head_rows.as_deref()),
                    _ => (LogitsWanted::None, None),
                };
                // A call's single piece writes straight into its own buffer.
                let logits = if p.rows.start == 0 && last {
                    &mut c.logits
                } else {
                    out
                };
                seqs.push(BatchSeq {
                    ids: &c.ids[p.rows.clone()],
                    positions: &c.positions[p.rows.clone()],
                    kv: &mut c.cache,
                    want,
                    head_rows,
                    logits,
                });
            }
            let results = self.model.forward_batch(&mut seqs, scratch);
            drop(seqs);
            for (p, r) in pieces.iter().zip(results) {
                let c = &mut calls[p.call];
                if let Err(e) = r {
                    c.result = Err(e);
                }
            }
        }
        for (p, out) in pieces.iter().zip(outs) {
            let c = &mut calls[p.call];
            if !(p.rows.start == 0 && p.rows.end == c.ids.len()) {
                if p.rows.start == 0 {
                    c.logits.clear();
                }
                c.logits.extend_from_slice(&out);
            }
            c.done = p.rows.end;
        }
    }
}

/// The message of a call handed back because its session's cancel flag was set.
const CANCELLED: &str = "cancelled";

/// Hands a finished call back to its session.
fn finish(c: Call, r: Result<(), ModelError>) {
    let Call {
        cache,
        logits,
        reply,
        ..
    } = c;
    *lock(&reply.slot) = Some((cache, logits, r));
    reply.ready.notify_all();
}

impl Session {
    /// Runs this session's forward passes in `batcher`'s passes from now on, together
    /// with the other sessions attached to it, until [`Session::detach`] (or the
    /// session is dropped). The results are the same bits (batch invariance); what
    /// changes is that B sessions decoding at once read the weights once per step.
    ///
    /// # Errors
    /// [`crate::SessionError::ModelMismatch`] when the batcher runs another model.
    pub fn attach(&mut self, batcher: &Batcher) -> Result<(), crate::SessionError> {
        if !Arc::ptr_eq(batcher.model(), self.model()) {
            return Err(crate::SessionError::ModelMismatch);
        }
        self.set_member(Some(Member::join(batcher, None)));
        Ok(())
    }

    /// [`Session::attach`] with a cancel flag: once `cancel` is set, a call of this
    /// session still waiting in the batcher (a prompt whose pieces run over several
    /// passes beside other sessions' decode steps) is handed back before its next
    /// piece, failing as [`crate::SessionError::Model`] and rolled back like any failed
    /// call, so a client that goes away frees its rows within one pass rather than at
    /// the end of its prefill chunk. [`crate::generate_text`] given the same flag
    /// reports [`crate::FinishReason::Cancelled`].
    ///
    /// # Errors
    /// As [`Session::attach`].
    pub fn attach_cancellable(
        &mut self,
        batcher: &Batcher,
        cancel: Arc<AtomicBool>,
    ) -> Result<(), crate::SessionError> {
        if !Arc::ptr_eq(batcher.model(), self.model()) {
            return Err(crate::SessionError::ModelMismatch);
        }
        self.set_member(Some(Member::join(batcher, Some(cancel))));
        Ok(())
    }

    /// Runs this session's passes on its own again (see [`Session::attach`]).
    pub fn detach(&mut self) {
        self.set_member(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inner() -> Inner {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tiny/llama-tied");
        let model = Arc::new(Model::load(&dir).unwrap());
        Inner {
            model,
            policy: BatchPolicy::default(),
            state: Mutex::new(State::default()),
            arrived: Condvar::new(),
        }
    }

    fn call(m: &Model, n: usize, seq: u64) -> Call {
        Call {
            ids: vec![1; n],
            positions: (0..n as u32).collect(),
            done: 0,
            want: LogitsWanted::Last,
            head_rows: None,
            cache: KvCache::new(m.config(), 256),
            logits: Vec::new(),
            result: Ok(()),
            reply: Arc::new(Reply::default()),
            seq,
            cancel: None,
        }
    }

    fn rows(p: &[Piece]) -> usize {
        p.iter().map(|p| p.rows.len()).sum()
    }

    /// Prompts alone take up to `max_prefill_rows` together; beside decode tokens, or
    /// with another session attached that may be between two decode steps, a pass
    /// stays within `max_rows`.
    #[test]
    fn prompts_fill_a_pass_only_when_nobody_else_may_be_decoding() {
        let inner = inner();
        let m = Arc::clone(&inner.model);
        let (max, most) = (inner.policy.max_rows, inner.policy.max_prefill_rows);
        let prompt = [call(&m, 200, 0)];
        assert_eq!(rows(&inner.plan(&prompt, 1)), 200.min(most));
        assert_eq!(rows(&inner.plan(&prompt, 2)), max);
        // Eight prompts arriving together: every row of them in one pass, in arrival
        // order, up to `max_prefill_rows`.
        let eight: Vec<Call> = (0..8).map(|i| call(&m, 64, i)).collect();
        let p = inner.plan(&eight, 8);
        assert_eq!(rows(&p), (8 * 64).min(most));
        assert!(p.iter().zip(0..).all(|(p, i)| p.call == i));
        let long: Vec<Call> = (0..3).map(|i| call(&m, most, i)).collect();
        let p = inner.plan(&long, 3);
        assert_eq!((rows(&p), p.len()), (most, 1));
        let mixed = [call(&m, 200, 0), call(&m, 1, 1), call(&m, 1, 2)];
        let p = inner.plan(&mixed, 3);
        assert_eq!(rows(&p), max);
        assert!(p.iter().any(|p| p.call == 1) && p.iter().any(|p| p.call == 2));
        // Decode tokens beyond `max_rows` leave a prompt its minimum.
        let many: Vec<Call> = (0..40)
            .map(|i| call(&m, 1, i))
            .chain([call(&m, 200, 40)])
            .collect();
        let p = inner.plan(&many, 41);
        assert_eq!(rows(&p), max + inner.policy.min_prefill_rows);
    }
}
