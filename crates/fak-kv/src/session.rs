//! `Session`: a model shared by `Arc` and a KV cache it owns, filled by prefill and
//! decode steps.

use crate::cache::{KvCache, KvError};
use fak_model::{argmax, ForwardScratch, LogitsWanted, Model, ModelError};
use std::sync::Arc;

/// Errors of session operations.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The forward pass refused the input (out-of-range id, context overflow, ...).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A cache operation was out of range.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// `generate` was called with no logits to start from (nothing prefilled since the
    /// session began or since the last eviction).
    #[error("no logits to continue from: prefill a token first")]
    NoLogits,
    /// A prefix session belongs to another model.
    #[error("the prefix session was filled by a different model")]
    ModelMismatch,
    /// `drop_oldest` would drop an entry that a layer can still attend to (a global
    /// layer reaches every entry; a sliding layer the `window - 1` positions before the
    /// next query's), which would change the outputs; nothing was dropped.
    #[error("dropping the {n} oldest entries would remove position {position}, which {reach} can still attend to from position {next}")]
    StillInWindow {
        /// Entries asked to be dropped.
        n: usize,
        /// The newest position among them.
        position: u32,
        /// The next query's position.
        next: u32,
        /// Which layer reaches it: "layer L (global)" or "layer L (window W)".
        reach: String,
    },
    /// The forward pass produced NaN logits (a corrupt weight, e.g. a NaN scale); the
    /// tokens were rolled back out of the cache.
    #[error("the model produced NaN logits (a corrupt weight?); nothing was kept")]
    NanLogits,
}

/// Parameters of [`Session::generate`]. Greedy for now; sampling arrives with the text
/// interface.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    /// Most new tokens.
    pub max_new_tokens: usize,
    /// Stop after (and include) a token in the model's EOS ids.
    pub stop_at_eos: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_new_tokens: 16,
            stop_at_eos: true,
        }
    }
}

/// A conversation's attention state and the model it runs on.
///
/// `Clone` is a byte-exact deep copy of the cache (the model is shared).
#[derive(Clone, Debug)]
pub struct Session {
    model: Arc<Model>,
    cache: KvCache,
    /// Logits of the last token run, `[vocab]`; `None` after an eviction.
    last_logits: Option<Vec<f32>>,
    /// Positions this session has run through the model (its own, not a prefix's).
    positions_computed: u64,
    /// The token id of every cache entry, `[len]`.
    ids: Vec<u32>,
    /// What a forward pass works in, kept so a decode step allocates nothing.
    buffers: Buffers,
    /// The batcher its passes run in, if attached ([`Session::attach`]).
    member: Membership,
}

/// A session's membership of a batcher; a clone is not attached.
#[derive(Debug, Default)]
struct Membership(Option<crate::batch::Member>);

impl Clone for Membership {
    fn clone(&self) -> Self {
        Membership(None)
    }
}

/// A session's forward-pass scratch and the logits buffer the next step writes into
/// (swapped with the last logits when the step succeeds, so a failed step leaves them
/// as they were). Holds no state: a clone is new and empty.
#[derive(Debug, Default)]
struct Buffers {
    scratch: ForwardScratch,
    spare: Vec<f32>,
}

impl Clone for Buffers {
    fn clone(&self) -> Self {
        Buffers::default()
    }
}

impl Session {
    /// A new empty session whose cache holds up to the model's context length.
    pub fn new(model: Arc<Model>) -> Self {
        let cap = model.config().max_position_embeddings;
        Self::with_capacity(model, cap)
    }

    /// A new empty session whose cache holds up to `capacity` tokens (a caller's memory
    /// budget: `capacity * cache().bytes_per_token()` bytes).
    pub fn with_capacity(model: Arc<Model>, capacity: usize) -> Self {
        let cache = KvCache::new(model.config(), capacity);
        Self::over(model, cache)
    }

    /// [`Session::with_capacity`] with its cache's rows stored in `ty`
    /// ([`KvCache::with_type`]).
    ///
    /// # Errors
    /// [`KvError::KvType`] when the model's rows cannot be stored in `ty`.
    pub fn with_kv_type(
        model: Arc<Model>,
        capacity: usize,
        ty: fak_model::KvType,
    ) -> Result<Self, KvError> {
        let cache = KvCache::with_type(model.config(), capacity, ty)?;
        Ok(Self::over(model, cache))
    }

    /// A session over the empty `cache`.
    fn over(model: Arc<Model>, cache: KvCache) -> Self {
        let ids = Vec::with_capacity(cache.capacity().min(KvCache::RESERVED_TOKENS));
        Session {
            model,
            cache,
            last_logits: None,
            positions_computed: 0,
            ids,
            buffers: Buffers::default(),
            member: Membership::default(),
        }
    }

    /// A session over `cache` (filled for `model`) whose entries are the tokens `ids`:
    /// a session read back from a file ([`crate::persist`]). No logits yet: the next
    /// prefill gives them.
    pub(crate) fn restored(model: Arc<Model>, cache: KvCache, ids: Vec<u32>) -> Self {
        debug_assert_eq!(cache.len(), ids.len());
        Session {
            model,
            cache,
            last_logits: None,
            positions_computed: 0,
            ids,
            buffers: Buffers::default(),
            member: Membership::default(),
        }
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The KV cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Makes the cache's entries so far shared ([`KvCache::freeze`]): clones of this
    /// session (a kept conversation's later turns, `n` completions of one prompt) then
    /// hold them once instead of a copy each. Changes no bit of anything.
    pub fn freeze(&mut self) {
        self.cache.freeze();
    }

    /// Tokens held in the cache.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Absolute RoPE positions of the cached tokens.
    pub fn positions(&self) -> &[u32] {
        self.cache.positions()
    }

    /// The token id of every cached entry, in cache order.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Positions this session ran through the model itself (a clone starts at 0), so a
    /// test can prove a reused prefix was not recomputed.
    pub fn positions_computed(&self) -> u64 {
        self.positions_computed
    }

    /// Logits of the last token run, `[vocab]`, if any.
    pub fn last_logits(&self) -> Option<&[f32]> {
        self.last_logits.as_deref()
    }

    /// Runs `ids` through the model at the next positions, appending to the cache, and
    /// returns the last token's logits `[vocab]`.
    ///
    /// # Errors
    /// [`SessionError::Model`] for an empty batch, an out-of-range id or a context /
    /// capacity overflow; the session is unchanged on error.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<Vec<f32>, SessionError> {
        let start = self.cache.next_position();
        let positions: Vec<u32> = (0..ids.len() as u32).map(|i| start + i).collect();
        self.run_last(ids, &positions, None)?;
        Ok(self.last_logits.clone().unwrap_or_default())
    }

    /// Runs `ids` at `positions`, keeping the last token's logits in `last_logits`
    /// (only the rows `head_rows` when given, the rest `-inf`). When they take a
    /// longrope model's sequence past its original context, the cached tokens and `ids`
    /// run again as one pass into an empty cache ([`Session::recompute_with`]).
    fn run_last(
        &mut self,
        ids: &[u32],
        positions: &[u32],
        head_rows: Option<&[u32]>,
    ) -> Result<(), SessionError> {
        match self.run_last_in_cache(ids, positions, head_rows) {
            Err(SessionError::Model(ModelError::RopeRegimeChange { .. }))
                if self.recomputable() =>
            {
                self.recompute_with(ids, positions, |s, ids, positions| {
                    s.run_last_in_cache(ids, positions, head_rows)
                })
            }
            r => r,
        }
    }

    /// [`Session::run_last`] appending to the cache as it is.
    fn run_last_in_cache(
        &mut self,
        ids: &[u32],
        positions: &[u32],
        head_rows: Option<&[u32]>,
    ) -> Result<(), SessionError> {
        let before = self.cache.len();
        let Buffers { scratch, spare } = &mut self.buffers;
        let mut logits = std::mem::take(spare);
        let cache = &mut self.cache;
        let want = LogitsWanted::Last;
        let mut ran: Result<(), SessionError> = match (&self.member.0, head_rows) {
            (Some(m), rows) => m.run(ids, positions, cache, want, rows, &mut logits),
            (None, None) => {
                self.model
                    .forward_into(ids, positions, cache, want, None, scratch, &mut logits)
            }
            (None, Some(rows)) => {
                self.model
                    .forward_rows_into(ids, positions, cache, rows, scratch, &mut logits)
            }
        }
        .map_err(Into::into);
        if ran.is_ok() {
            ran = self.check_finite(&logits, ids.len());
        } else {
            self.roll_back_to(before);
        }
        if let Err(e) = ran {
            self.buffers.spare = logits;
            return Err(e);
        }
        self.positions_computed += ids.len() as u64;
        self.ids.extend_from_slice(ids);
        self.buffers.spare = self.last_logits.replace(logits).unwrap_or_default();
        Ok(())
    }

    /// Like [`Session::prefill`] but returns the logits of every token, `[n, vocab]`.
    ///
    /// # Errors
    /// As [`Session::prefill`].
    pub fn prefill_all_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>, SessionError> {
        let start = self.cache.next_position();
        let positions: Vec<u32> = (0..ids.len() as u32).map(|i| start + i).collect();
        match self.all_logits_in_cache(ids, &positions) {
            Err(SessionError::Model(ModelError::RopeRegimeChange { .. }))
                if self.recomputable() =>
            {
                let v = self.model.config().vocab_size;
                let cached = self.cache.len();
                let mut all = self.recompute_with(ids, &positions, Self::all_logits_in_cache)?;
                Ok(all.split_off(cached * v))
            }
            r => r,
        }
    }

    /// [`Session::prefill_all_logits`] at `positions`, appending to the cache as it is.
    fn all_logits_in_cache(
        &mut self,
        ids: &[u32],
        positions: &[u32],
    ) -> Result<Vec<f32>, SessionError> {
        let before = self.cache.len();
        let ran = self
            .model
            .forward(ids, positions, &mut self.cache, LogitsWanted::All, None);
        let logits = ran.inspect_err(|_| self.roll_back_to(before))?;
        self.check_finite(&logits, ids.len())?;
        self.positions_computed += ids.len() as u64;
        self.ids.extend_from_slice(ids);
        let v = self.model.config().vocab_size;
        self.last_logits = Some(logits[logits.len() - v..].to_vec());
        Ok(logits)
    }

    /// Whether running the session's tokens again from an empty cache gives its cache:
    /// no entry was dropped by [`Session::drop_oldest`] (dropped entries were attended
    /// to by later ones), so the first position is 0.
    fn recomputable(&self) -> bool {
        self.cache.positions().first().is_none_or(|&p| p == 0)
    }

    /// Runs the cached tokens followed by `ids` (at their positions, then `positions`)
    /// as one pass through `run` into an empty cache of the same capacity: what HF's
    /// `generate` does when a longrope model's (Phi-3's) sequence first crosses its
    /// original context, since the long factors then apply to every entry. On error the
    /// session is as it was.
    fn recompute_with<T>(
        &mut self,
        ids: &[u32],
        positions: &[u32],
        run: impl FnOnce(&mut Self, &[u32], &[u32]) -> Result<T, SessionError>,
    ) -> Result<T, SessionError> {
        let all_ids: Vec<u32> = self.ids.iter().chain(ids).copied().collect();
        let cached = self.cache.positions().iter();
        let all_positions: Vec<u32> = cached.chain(positions).copied().collect();
        let empty = self.cache.emptied();
        let cache = std::mem::replace(&mut self.cache, empty);
        let kept_ids = std::mem::take(&mut self.ids);
        let ran = run(self, &all_ids, &all_positions);
        if ran.is_err() {
            self.cache = cache;
            self.ids = kept_ids;
        }
        ran
    }

    /// Takes the cache back to its first `len` entries after a failed pass. The model
    /// refuses a bad input before it changes the cache; this covers a product's own
    /// error, which could leave part of a pass appended (positions, or some layers'
    /// rows: `drop_newest` truncates every buffer to the kept length).
    fn roll_back_to(&mut self, len: usize) {
        let appended = self.cache.len().saturating_sub(len);
        self.cache.drop_newest(appended);
    }

    /// Rolls the last `n` cache entries back out when `logits` hold a NaN.
    fn check_finite(&mut self, logits: &[f32], n: usize) -> Result<(), SessionError> {
        if fak_tensor::has_nan(logits) {
            let len = self.cache.len();
            self.cache.drop_newest(n);
            debug_assert_eq!(self.cache.len(), len - n);
            return Err(SessionError::NanLogits);
        }
        Ok(())
    }

    /// Whether one more token fits: the cache has room and the next position is inside
    /// the model's context length.
    pub fn has_room(&self) -> bool {
        self.cache.len() < self.cache.capacity()
            && (self.cache.next_position() as usize) < self.model.config().max_position_embeddings
    }

    /// One decode step: runs token `id` and returns its logits `[vocab]` (a copy of
    /// what [`Session::decode`] returns).
    ///
    /// # Errors
    /// As [`Session::prefill`].
    pub fn step(&mut self, id: u32) -> Result<Vec<f32>, SessionError> {
        self.decode(id).map(<[f32]>::to_vec)
    }

    /// One decode step without a heap allocation: runs token `id` at the next position
    /// and returns its logits `[vocab]`, borrowed from the session (they are
    /// [`Session::last_logits`] until the next step). The forward pass works in
    /// buffers the session keeps ([`fak_model::ForwardScratch`]) and writes the logits
    /// into a buffer kept from the step before, so once the buffers have grown (after
    /// the first step that follows a prefill) a step allocates nothing; the test
    /// `decode_steps_allocate_nothing` counts. The same bits as [`Session::prefill`]
    /// of the one token.
    ///
    /// # Errors
    /// As [`Session::prefill`]; the session is unchanged on error.
    pub fn decode(&mut self, id: u32) -> Result<&[f32], SessionError> {
        let position = [self.cache.next_position()];
        self.run_last(&[id], &position, None)?;
        Ok(self.last_logits.as_deref().unwrap_or(&[]))
    }

    /// [`Session::decode`] computing only the rows `rows` of the output head
    /// ([`fak_model::Model::forward_rows_into`]): the returned logits `[vocab]` (also
    /// [`Session::last_logits`] until the next step) hold, for each id in `rows`, the
    /// same bits [`Session::decode`] gives, and `-inf` for every other id; the cache
    /// gets the same K/V rows. For a constrained step whose allowed set is `rows`
    /// (the rows a mask would keep), so a sampler over them picks as over the masked
    /// full logits.
    ///
    /// # Errors
    /// As [`Session::decode`], and [`SessionError::Model`] for a row not below the
    /// vocabulary size; the session is unchanged on error.
    pub fn decode_rows(&mut self, id: u32, rows: &[u32]) -> Result<&[f32], SessionError> {
        let position = [self.cache.next_position()];
        self.run_last(&[id], &position, Some(rows))?;
        Ok(self.last_logits.as_deref().unwrap_or(&[]))
    }

    /// Greedy generation from the last logits: takes the argmax token, runs it, repeats;
    /// stops after `max_new_tokens` or after an EOS id when `stop_at_eos`. Returns the
    /// new tokens. The last token produced is not run through the model (its logits are
    /// not needed), so the cache ends one token short of the returned text.
    ///
    /// # Errors
    /// [`SessionError::NoLogits`] when nothing has been prefilled since the start or the
    /// last eviction; forward-pass errors (context overflow).
    pub fn generate(&mut self, params: &GenerateParams) -> Result<Vec<u32>, SessionError> {
        let mut next = argmax(self.last_logits().ok_or(SessionError::NoLogits)?);
        let eos = self.model.config().eos_token_ids.clone();
        let mut out = Vec::new();
        while out.len() < params.max_new_tokens {
            out.push(next);
            if (params.stop_at_eos && eos.contains(&next)) || out.len() == params.max_new_tokens {
                break;
            }
            next = argmax(self.decode(next)?);
        }
        Ok(out)
    }

    /// Removes cached tokens `[from, from + n)` (see [`KvCache::evict`]): at write time,
    /// the session is then bit-identical to one that never saw them. When that takes a
    /// longrope model's sequence from past its original context to within it, the
    /// survivors run again (the other RoPE factors apply to all of them), so that holds
    /// there too. The last logits are
    /// dropped (they were computed with the span present); prefill the next token to go on.
    ///
    /// # Errors
    /// [`SessionError::Kv`] for a span out of range; the session is unchanged.
    pub fn evict(&mut self, from: usize, n: usize) -> Result<(), SessionError> {
        match self.cache.evict(&self.model, from, n) {
            Err(KvError::RopeRegimeChange { .. }) if self.recomputable() => {
                self.recompute_without(from, n)?
            }
            r => {
                r?;
                self.ids.drain(from..from + n);
            }
        }
        if n > 0 {
            self.last_logits = None;
        }
        Ok(())
    }

    /// Eviction of `[from, from + n)` by running the survivors again, at the positions
    /// [`KvCache::evict`] gives them, into an empty cache: for a longrope model whose
    /// sequence the eviction takes back within its original context, where the short
    /// factors apply to every entry. On error the session is as it was.
    fn recompute_without(&mut self, from: usize, n: usize) -> Result<(), SessionError> {
        let end = from + n;
        let pos = self.cache.positions();
        let shift = pos.get(end).map_or(0, |&p| p - pos[from]);
        let positions: Vec<u32> = pos[..from]
            .iter()
            .copied()
            .chain(pos[end..].iter().map(|&p| p - shift))
            .collect();
        let ids: Vec<u32> = self.ids[..from]
            .iter()
            .chain(&self.ids[end..])
            .copied()
            .collect();
        let empty = self.cache.emptied();
        let cache = std::mem::replace(&mut self.cache, empty);
        let kept_ids = std::mem::take(&mut self.ids);
        let ran = self.run_last_in_cache(&ids, &positions, None);
        if ran.is_err() {
            self.cache = cache;
            self.ids = kept_ids;
        }
        ran
    }

    /// Drops the `n` oldest tokens without renumbering (bounded mode of sliding-window
    /// models; see [`KvCache::drop_oldest`]): only entries that no layer can attend to
    /// again, so no output changes. Every layer must have a sliding window, and the
    /// dropped positions must lie before every window of the next query (position `p`
    /// with window `w` reaches positions `>= p - w + 1`; later queries reach less).
    ///
    /// # Errors
    /// [`SessionError::Kv`] if `n > len`; [`SessionError::StillInWindow`] if a layer could
    /// still attend to a dropped entry. The session is unchanged on error.
    pub fn drop_oldest(&mut self, n: usize) -> Result<(), SessionError> {
        if n > 0 && n <= self.cache.len() {
            let next = self.cache.next_position();
            let position = self.cache.positions()[n - 1];
            let windows = &self.model.config().sliding_window;
            let reached = windows.iter().enumerate().find_map(|(l, w)| match w {
                None => Some(format!("layer {l} (global)")),
                Some(w) => {
                    let lo = i64::from(next) - (*w).max(1) as i64 + 1;
                    (i64::from(position) >= lo).then(|| format!("layer {l} (window {w})"))
                }
            });
            if let Some(reach) = reached {
                return Err(SessionError::StillInWindow {
                    n,
                    position,
                    next,
                    reach,
                });
            }
        }
        self.cache.drop_oldest(n)?;
        self.ids.drain(..n);
        Ok(())
    }

    /// Whether its passes run in a batcher ([`Session::attach`]).
    pub fn is_attached(&self) -> bool {
        self.member.0.is_some()
    }

    pub(crate) fn set_member(&mut self, member: Option<crate::batch::Member>) {
        self.member = Membership(member);
    }

    /// Drops the buffers the forward pass works in and the spare logits row (a session
    /// kept only to be copied, as a server's prefix cache keeps them, does not need
    /// them; the next step grows them again).
    pub fn release_buffers(&mut self) {
        self.buffers = Buffers::default();
    }

    /// A new session that starts from a byte-exact copy of `prefix`'s cache and then
    /// prefills `suffix` only. Its [`Session::positions_computed`] counts the suffix
    /// alone. An empty suffix gives a plain clone (with the prefix's last logits).
    ///
    /// # Errors
    /// Forward-pass errors of the suffix prefill.
    pub fn from_prefix(prefix: &Session, suffix: &[u32]) -> Result<Session, SessionError> {
        let mut s = Session {
            model: Arc::clone(&prefix.model),
            cache: prefix.cache.clone(),
            last_logits: prefix.last_logits.clone(),
            positions_computed: 0,
            ids: prefix.ids.clone(),
            buffers: Buffers::default(),
            member: Membership::default(),
        };
        if !suffix.is_empty() {
            s.prefill(suffix)?;
        }
        Ok(s)
    }
}
