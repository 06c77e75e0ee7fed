//! `KvCache`: the attention state, owned by the kernel as plain buffers.

use fak_model::{Config, KvRows, KvStore, KvType, Model, RowBuf};
use std::sync::Arc;

/// Errors of cache operations. Each names the offending numbers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// `evict(from, n)` with a span that does not lie inside the cache.
    #[error("span [{from}, {from}+{n}) is out of range for a cache of {len} entries")]
    SpanOutOfRange {
        /// First entry of the span.
        from: usize,
        /// Entries in the span.
        n: usize,
        /// Entries in the cache.
        len: usize,
    },
    /// The cache and the model disagree on their shape.
    #[error("cache has {cache_layers} layers x {cache_kv_dim} kv_dim, the model {model_layers} x {model_kv_dim}")]
    ShapeMismatch {
        /// Layers of the cache.
        cache_layers: usize,
        /// Row width of the cache.
        cache_kv_dim: usize,
        /// Layers of the model.
        model_layers: usize,
        /// Row width of the model.
        model_kv_dim: usize,
    },
    /// The eviction would shorten a longrope model's (Phi-3's) sequence from past its
    /// original context to within it, where the other RoPE factors apply to every
    /// entry ([`fak_model::Model::rope_regime`]): the survivors must be computed again,
    /// which the cache cannot do without their tokens (`Session::evict` does).
    #[error("evicting would take the sequence from {from_len} to {to_len} positions, across the model's original context: the entries must be recomputed")]
    RopeRegimeChange {
        /// Positions the sequence spans before the eviction.
        from_len: usize,
        /// Positions it would span after.
        to_len: usize,
    },
    /// The model's rows cannot be stored in the requested kv type.
    #[error("{0}")]
    KvType(String),
}

/// Entries of a cache made immutable and shareable by [`KvCache::freeze`]: the first
/// `parent.1` entries of the parent block (if any), then this block's own rows.
#[derive(Debug)]
struct Frozen {
    /// The block these entries continue, and how many of its entries come first.
    parent: Option<(Arc<Frozen>, usize)>,
    /// Blocks in the chain, this one included.
    depth: usize,
    /// Own rows per layer, `[len − parent part, kv_dim]` (K after RoPE empty in a
    /// compact type).
    k: Vec<RowBuf>,
    k_raw: Vec<RowBuf>,
    v: Vec<RowBuf>,
}

impl Frozen {
    /// Entries that come from the parent.
    fn parent_len(&self) -> usize {
        self.parent.as_ref().map_or(0, |p| p.1)
    }

    /// Pushes the runs of the first `upto` entries of `which` (0: K, 1: K before RoPE,
    /// 2: V) of `layer`, oldest first.
    fn push_runs<'a>(&'a self, upto: usize, layer: usize, which: usize, rows: &mut KvRows<'a>) {
        let pl = self.parent_len();
        if let Some((p, _)) = &self.parent {
            p.push_runs(upto.min(pl), layer, which, rows);
        }
        if upto > pl {
            let own = match which {
                0 => &self.k[layer],
                1 => &self.k_raw[layer],
                _ => &self.v[layer],
            };
            let upr = rows.kv_type().units_per_row(rows.kv_dim());
            rows.push_run(own.run().slice(0..(upto - pl) * upr));
        }
    }

    /// Bytes of the own rows' buffers.
    fn own_bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.k_raw)
            .chain(&self.v)
            .map(RowBuf::bytes)
            .sum()
    }
}

/// Per layer: post-RoPE `k`, pre-RoPE `k_raw` and `v`, rows `[position, kv_heads *
/// head_dim]`, and one `pos` vector holding each entry's absolute RoPE position.
///
/// Keeping `k_raw` is what makes eviction exact: a survivor that must move to a new
/// position gets its K re-derived from `k_raw` in a single rotation, the arithmetic a
/// forward pass at that position performs, instead of a second rotation composed on the
/// first (which drifts by rounding and flips greedy tokens).
///
/// **Kv types.** The rows are stored in one [`KvType`] chosen when the cache is made
/// ([`KvCache::with_type`]). `f32` holds all three arrays. A compact type (`f16`,
/// `q8_0`) holds `k_raw` and `v` only, rounded when written, and attention rotates each
/// key at its entry's position as it reads it: renumbering survivors then changes only
/// their positions, and every reader sees the same values, so the exact guarantees
/// below hold on every type (with the rounded values, not the `f32` ones).
///
/// **Shared prefixes.** The oldest entries may sit in immutable, reference-counted
/// blocks shared with other caches ([`KvCache::freeze`]): a system prompt that many
/// conversations start with is held once, each conversation's own entries after it in
/// private buffers. A clone copies only the private rows. Nothing ever writes a shared
/// block: a cache that must change shared entries (an eviction that renumbers them,
/// [`KvCache::drop_oldest`]) first copies the entries from the first one changed on
/// into its private buffers (copy on write), and the entries before that stay shared;
/// cutting entries off the end ([`KvCache::drop_newest`], a tail eviction) only
/// shortens its view. So no operation on one cache changes another's bits. Attention
/// reads the rows as runs ([`KvRows`]), which gives the bits of one contiguous buffer.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    n_layers: usize,
    kv_dim: usize,
    capacity: usize,
    ty: KvType,
    pos: Vec<u32>,
    /// The shared block the first `shared_len` entries come from.
    shared: Option<Arc<Frozen>>,
    shared_len: usize,
    /// Private rows: entries `shared_len..len` (K after RoPE empty in a compact type).
    k: Vec<RowBuf>,
    k_raw: Vec<RowBuf>,
    v: Vec<RowBuf>,
}

/// Two caches are equal when they hold the same entries with the same bits, however
/// those are split between shared blocks and private rows.
impl PartialEq for KvCache {
    fn eq(&self, other: &Self) -> bool {
        let same =
            |a: KvRows<'_>, b: KvRows<'_>| a.len() == b.len() && a.to_bytes() == b.to_bytes();
        self.n_layers == other.n_layers
            && self.kv_dim == other.kv_dim
            && self.capacity == other.capacity
            && self.ty == other.ty
            && self.pos == other.pos
            && (0..self.n_layers).all(|l| {
                self.arrays()
                    .all(|w| same(self.stored(l, w), other.stored(l, w)))
            })
    }
}

impl KvCache {
    /// Most entries [`KvCache::new`] reserves buffers for up front.
    pub const RESERVED_TOKENS: usize = 8192;

    /// An empty cache shaped for `config`, holding at most `capacity` tokens.
    /// `capacity` is capped at the model's context length, past which no entry can be
    /// added. Buffers for at most [`KvCache::RESERVED_TOKENS`] entries are reserved up
    /// front (the pages are touched only as entries arrive); past that they grow as
    /// entries arrive, so a model claiming a huge context (2^24 tokens) costs nothing
    /// until tokens come.
    pub fn new(config: &Config, capacity: usize) -> Self {
        Self::with_type(config, capacity, KvType::F32).expect("f32 rows of any width")
    }

    /// [`KvCache::new`] storing its rows in `ty`.
    ///
    /// # Errors
    /// [`KvError::KvType`] when the model's rows cannot be stored in `ty` (Q8_0 needs
    /// a multiple of 32 values, [`KvType::check`]).
    pub fn with_type(config: &Config, capacity: usize, ty: KvType) -> Result<Self, KvError> {
        let capacity = capacity.min(config.max_position_embeddings);
        let reserved = capacity.min(Self::RESERVED_TOKENS);
        let kv_dim = config.kv_dim();
        ty.check(kv_dim).map_err(KvError::KvType)?;
        let n = config.num_hidden_layers;
        let units = reserved.saturating_mul(ty.units_per_row(kv_dim));
        let buf = |used: bool| {
            (0..n)
                .map(|_| RowBuf::with_capacity(ty, if used { units } else { 0 }))
                .collect()
        };
        Ok(KvCache {
            n_layers: n,
            kv_dim,
            capacity,
            ty,
            pos: Vec::with_capacity(reserved),
            shared: None,
            shared_len: 0,
            k: buf(!ty.rotates_at_read()),
            k_raw: buf(true),
            v: buf(true),
        })
    }

    /// An empty cache of the same shape, capacity and type.
    pub fn emptied(&self) -> KvCache {
        let bufs = || vec![RowBuf::with_capacity(self.ty, 0); self.n_layers];
        KvCache {
            n_layers: self.n_layers,
            kv_dim: self.kv_dim,
            capacity: self.capacity,
            ty: self.ty,
            pos: Vec::new(),
            shared: None,
            shared_len: 0,
            k: bufs(),
            k_raw: bufs(),
            v: bufs(),
        }
    }

    /// The type the rows are stored in.
    pub fn kv_type(&self) -> KvType {
        self.ty
    }

    /// The arrays stored (0: K after RoPE, 1: K before RoPE, 2: V): all three for
    /// `f32`, the last two for a compact type.
    fn arrays(&self) -> std::ops::Range<usize> {
        if self.ty.rotates_at_read() {
            1..3
        } else {
            0..3
        }
    }

    /// The stored arrays of `layer` in the order a session file holds them (K after
    /// RoPE for `f32`, then K before RoPE, then V).
    pub(crate) fn stored_arrays(&self, layer: usize) -> impl Iterator<Item = KvRows<'_>> {
        self.arrays().map(move |w| self.stored(layer, w))
    }

    /// The arrays stored, by index (0: K after RoPE, 1: K before RoPE, 2: V).
    pub(crate) fn array_kinds(&self) -> std::ops::Range<usize> {
        self.arrays()
    }

    /// Appends stored units read from a session file to array `which` of `layer`
    /// (private rows): `bytes` as [`fak_model::Run::as_bytes`] gives them. A restore
    /// appends every array of every layer after [`KvStore::append_positions`].
    ///
    /// # Panics
    /// If `bytes` is not whole units of the type (the reader checked the length).
    pub(crate) fn push_stored(&mut self, layer: usize, which: usize, bytes: &[u8]) {
        let buf = match which {
            0 => &mut self.k[layer],
            1 => &mut self.k_raw[layer],
            _ => &mut self.v[layer],
        };
        buf.extend_from_bytes(bytes);
    }

    /// Storage units (elements, or Q8_0 blocks) per row.
    fn upr(&self) -> usize {
        self.ty.units_per_row(self.kv_dim)
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Width of one row: `num_key_value_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Entries (tokens) held.
    pub fn len(&self) -> usize {
        self.pos.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }

    /// Most entries this cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Absolute RoPE position of each entry, `[len]`.
    pub fn positions(&self) -> &[u32] {
        &self.pos
    }

    /// The position the next token takes: one past the last entry's, or 0 when empty.
    pub fn next_position(&self) -> u32 {
        self.pos.last().map_or(0, |&p| p + 1)
    }

    /// The stored rows of array `which` (0: K, 1: K before RoPE, 2: V) of `layer`: the
    /// shared runs, then the private one.
    fn stored(&self, layer: usize, which: usize) -> KvRows<'_> {
        let mut rows = KvRows::empty(self.ty, self.kv_dim);
        if let Some(f) = &self.shared {
            f.push_runs(self.shared_len, layer, which, &mut rows);
        }
        let own = match which {
            0 => &self.k,
            1 => &self.k_raw,
            _ => &self.v,
        };
        if let Some(own) = own.get(layer) {
            rows.push_run(own.run());
        }
        rows
    }

    /// The keys attention reads: K after RoPE (`f32`), or K before RoPE marked to be
    /// rotated at read (a compact type).
    fn rows_k(&self, layer: usize) -> KvRows<'_> {
        if self.ty.rotates_at_read() {
            self.stored(layer, 1).pre_rope()
        } else {
            self.stored(layer, 0)
        }
    }

    /// The keys of `layer` as attention reads them, `[len, kv_dim]`, in runs: K after
    /// RoPE in an `f32` cache ([`KvRows::to_vec`] copies it into one buffer); in a
    /// compact one the stored K before RoPE, marked to be rotated at read
    /// ([`KvRows::is_pre_rope`]).
    pub fn k(&self, layer: usize) -> KvRows<'_> {
        self.rows_k(layer)
    }

    /// Pre-RoPE K of `layer`, `[len, kv_dim]`, in runs.
    pub fn k_raw(&self, layer: usize) -> KvRows<'_> {
        self.stored(layer, 1)
    }

    /// V of `layer`, `[len, kv_dim]`, in runs.
    pub fn v(&self, layer: usize) -> KvRows<'_> {
        self.stored(layer, 2)
    }

    /// Bytes one entry occupies: every stored array of every layer in the cache's type,
    /// plus its position (`u32`) ([`KvType::bytes_per_token`]).
    pub fn bytes_per_token(&self) -> usize {
        self.ty.bytes_per_token(self.n_layers, self.kv_dim)
    }

    /// Bytes held by the entries now in the cache, shared or not: what the cache would
    /// take alone.
    pub fn bytes_used(&self) -> usize {
        self.len() * self.bytes_per_token()
    }

    /// Entries read from shared blocks ([`KvCache::freeze`]): the first `shared_len()`
    /// entries.
    pub fn shared_len(&self) -> usize {
        self.shared_len
    }

    /// Bytes of this cache's own rows and positions (what a clone copies), not counting
    /// the shared blocks.
    pub fn bytes_private(&self) -> usize {
        let row = self.ty.arrays() * self.n_layers * self.ty.row_bytes(self.kv_dim);
        (self.len() - self.shared_len) * row + self.len() * 4
    }

    /// Bytes of memory held by a set of caches together: each one's own rows and
    /// positions, plus every shared block any of them reads counted once (whole blocks:
    /// rows no cache reads any more stay in memory while the block lives).
    pub fn bytes_held<'a>(caches: impl IntoIterator<Item = &'a KvCache>) -> usize {
        let mut seen: std::collections::HashSet<*const Frozen> = Default::default();
        let mut total = 0;
        for c in caches {
            total += c.bytes_private();
            let mut block = c.shared.as_ref();
            while let Some(b) = block {
                // A block seen before: it and the blocks it continues are counted.
                if !seen.insert(Arc::as_ptr(b)) {
                    break;
                }
                total += b.own_bytes();
                block = b.parent.as_ref().map(|p| &p.0);
            }
        }
        total
    }

    /// Bytes reserved (allocated capacity of every private buffer).
    pub fn bytes_reserved(&self) -> usize {
        let f: usize = self
            .k
            .iter()
            .chain(&self.k_raw)
            .chain(&self.v)
            .map(RowBuf::capacity_bytes)
            .sum();
        f + self.pos.capacity() * 4
    }

    /// Makes every entry held so far shared: the private rows move (no copy) into an
    /// immutable reference-counted block after the shared ones, so clones of this cache
    /// hold them once. What this cache and its clones append afterwards is private to
    /// each. A chain of blocks longer than [`KvRows::MAX_RUNS`] − 1 is copied into one
    /// block instead (the old ones are freed when no other cache reads them). Changes
    /// no entry and no bit.
    pub fn freeze(&mut self) {
        let private = self.len() - self.shared_len;
        if private == 0 {
            return;
        }
        let depth = self.shared.as_ref().map_or(0, |f| f.depth);
        let (n, ty) = (self.n_layers, self.ty);
        let empty = || vec![RowBuf::with_capacity(ty, 0); n];
        let (parent, k, k_raw, v) = if depth + 1 < KvRows::MAX_RUNS {
            let parent = self.shared.take().map(|f| (f, self.shared_len));
            let take = |b: &mut Vec<RowBuf>| std::mem::replace(b, empty());
            (
                parent,
                take(&mut self.k),
                take(&mut self.k_raw),
                take(&mut self.v),
            )
        } else {
            let arrays = self.arrays();
            let all = |which: usize| -> Vec<RowBuf> {
                (0..n)
                    .map(|l| {
                        let mut b = RowBuf::with_capacity(ty, 0);
                        if arrays.contains(&which) {
                            let rows = self.stored(l, which);
                            rows.for_stored(0..rows.len(), |run, _| b.extend_run(run));
                        }
                        b
                    })
                    .collect()
            };
            let (k, k_raw, v) = (all(0), all(1), all(2));
            self.shared = None;
            for b in [&mut self.k, &mut self.k_raw, &mut self.v] {
                *b = empty();
            }
            (None, k, k_raw, v)
        };
        let depth = parent.as_ref().map_or(0, |p| p.0.depth) + 1;
        self.shared = Some(Arc::new(Frozen {
            parent,
            depth,
            k,
            k_raw,
            v,
        }));
        self.shared_len = self.len();
    }

    /// Copy on write: entries `from..shared_len` are copied out of the shared blocks into
    /// the front of the private rows, so that every entry from `from` on is private. The
    /// entries before `from` stay shared. Changes no bit.
    fn unshare_from(&mut self, from: usize) {
        if from >= self.shared_len {
            return;
        }
        let upr = self.upr();
        for l in 0..self.n_layers {
            for which in self.arrays() {
                let mut rows = RowBuf::with_capacity(self.ty, (self.len() - from) * upr);
                self.stored(l, which)
                    .for_stored(from..self.shared_len, |run, _| rows.extend_run(run));
                let own = match which {
                    0 => &mut self.k[l],
                    1 => &mut self.k_raw[l],
                    _ => &mut self.v[l],
                };
                rows.extend_run(own.run());
                *own = rows;
            }
        }
        self.shared_len = from;
        self.trim_shared();
    }

    /// Lets go of the shared blocks this cache reads less than half of: while the newest
    /// block's own rows that the cache reads are fewer than half of them, those rows are
    /// copied into the private ones ([`KvCache::unshare_from`]) and the block is let go
    /// (freed when no other cache reads it). A view shortened to a short prefix of a long
    /// kept conversation (a request that shares its first tokens) would otherwise keep
    /// the whole block alive while counting only the prefix: with this, every block a
    /// cache holds is at least half read by it, so the caches of a set hold at most
    /// twice the bytes they read ([`KvCache::bytes_held`] ≤ 2 × Σ
    /// [`KvCache::bytes_used`]). Changes no bit.
    fn release_sparse_blocks(&mut self) {
        let upr = self.upr();
        while let Some(f) = &self.shared {
            let from = f.parent_len();
            let own = f.v.first().map_or(0, |b| b.units() / upr.max(1));
            if 2 * (self.shared_len - from) >= own {
                return;
            }
            self.unshare_from(from);
        }
    }

    /// Points `shared` at the newest block that holds any of the first `shared_len`
    /// entries (a block whose own rows all lie past them is let go), so chains grow
    /// only with blocks in use: conversations that each start from the last one's
    /// shared system prompt all continue the same block.
    fn trim_shared(&mut self) {
        while let Some(f) = &self.shared {
            if self.shared_len > f.parent_len() {
                return;
            }
            self.shared = f.parent.as_ref().map(|p| Arc::clone(&p.0));
        }
        self.shared_len = 0;
    }

    fn check_model(&self, model: &Model) -> Result<(), KvError> {
        let c = model.config();
        if c.num_hidden_layers != self.n_layers || c.kv_dim() != self.kv_dim {
            return Err(KvError::ShapeMismatch {
                cache_layers: self.n_layers,
                cache_kv_dim: self.kv_dim,
                model_layers: c.num_hidden_layers,
                model_kv_dim: c.kv_dim(),
            });
        }
        Ok(())
    }

    /// Removes entries `[from, from + n)` from every layer and from `pos`, and renumbers
    /// the survivors after the span so the next token lands where it would had the span
    /// never existed: the first survivor after the span takes the span's first position
    /// and the others keep their spacing. Each moved survivor's K is re-derived from its
    /// `k_raw` by one rotation at its new position ([`Model::rope_in_place`]).
    ///
    /// When the span is removed before any later entry attended to it (write-time
    /// eviction, e.g. a quarantined tool result evicted as soon as it was prefilled), the
    /// cache is then bit-identical to one that never saw the span. A later entry that did
    /// attend to the span keeps what it absorbed: eviction cannot undo attention.
    ///
    /// `n = 0` is a no-op.
    ///
    /// # Errors
    /// [`KvError::SpanOutOfRange`] if `from + n > len`; [`KvError::ShapeMismatch`] if
    /// `model` is not the model this cache was filled by; [`KvError::RopeRegimeChange`]
    /// if a longrope model's sequence would shrink across its original context. The
    /// cache is unchanged on error.
    pub fn evict(&mut self, model: &Model, from: usize, n: usize) -> Result<(), KvError> {
        let len = self.len();
        let end = from.checked_add(n).filter(|&e| e <= len);
        let Some(end) = end else {
            return Err(KvError::SpanOutOfRange { from, n, len });
        };
        self.check_model(model)?;
        if n == 0 {
            return Ok(());
        }
        let shift = if end < len {
            self.pos[end] - self.pos[from]
        } else {
            0
        };
        let old_end = self.next_position() as usize;
        let new_end = if end < len {
            old_end - shift as usize
        } else if from > 0 {
            self.pos[from - 1] as usize + 1
        } else {
            0
        };
        let regime = model.rope_regime(new_end);
        if new_end > 0 && regime != model.rope_regime(old_end) {
            return Err(KvError::RopeRegimeChange {
                from_len: old_end,
                to_len: new_end,
            });
        }
        if end == len {
            // Nothing after the span: no survivor moves, the cache is cut short.
            self.drop_newest(n);
            return Ok(());
        }
        self.unshare_from(from);
        self.release_sparse_blocks();
        let (d, s0, upr) = (self.kv_dim, self.shared_len, self.upr());
        for l in 0..self.n_layers {
            for buf in [&mut self.k[l], &mut self.k_raw[l], &mut self.v[l]] {
                if buf.units() > 0 {
                    buf.drain_units((from - s0) * upr..(end - s0) * upr);
                }
            }
        }
        self.pos.drain(from..end);
        if shift > 0 {
            for j in from..self.pos.len() {
                self.pos[j] -= shift;
            }
            // A compact type rotates keys at read: the new positions are all it takes.
            for l in 0..self.n_layers {
                let (RowBuf::F32(k), RowBuf::F32(k_raw)) = (&mut self.k[l], &self.k_raw[l]) else {
                    continue;
                };
                for j in from..self.pos.len() {
                    let r = (j - s0) * d..(j - s0 + 1) * d;
                    let row = &mut k[r.clone()];
                    row.copy_from_slice(&k_raw[r]);
                    model.rope_in_place(l, self.pos[j], regime, row);
                }
            }
        }
        Ok(())
    }

    /// Removes the `n` newest entries (a rollback of the last forward pass); `n` larger
    /// than the length empties the cache.
    pub fn drop_newest(&mut self, n: usize) {
        let keep = self.len().saturating_sub(n);
        if keep < self.shared_len {
            // Only the view of the shared blocks shortens.
            self.shared_len = keep;
            self.trim_shared();
        }
        let upr = self.upr();
        for l in 0..self.n_layers {
            for buf in [&mut self.k[l], &mut self.k_raw[l], &mut self.v[l]] {
                buf.truncate_units((keep - self.shared_len) * upr);
            }
        }
        self.pos.truncate(keep);
        // After the private rows are cut: a block let go copies only the entries kept.
        self.release_sparse_blocks();
    }

    /// Drops the `n` oldest entries *without* renumbering anyone: for the bounded mode of
    /// sliding-window models, where entries older than every layer's window can never be
    /// attended again, so dropping them changes no output. The cache does not know the
    /// model's windows, so that is the caller's to ensure; [`crate::Session::drop_oldest`]
    /// checks it.
    ///
    /// # Errors
    /// [`KvError::SpanOutOfRange`] if `n > len`.
    pub fn drop_oldest(&mut self, n: usize) -> Result<(), KvError> {
        if n > self.len() {
            return Err(KvError::SpanOutOfRange {
                from: 0,
                n,
                len: self.len(),
            });
        }
        self.unshare_from(0);
        let upr = self.upr();
        for l in 0..self.n_layers {
            for buf in [&mut self.k[l], &mut self.k_raw[l], &mut self.v[l]] {
                if buf.units() > 0 {
                    buf.drain_units(0..n * upr);
                }
            }
        }
        self.pos.drain(..n);
        Ok(())
    }
}

impl KvStore for KvCache {
    fn len(&self) -> usize {
        self.pos.len()
    }
    fn positions(&self) -> &[u32] {
        &self.pos
    }
    fn capacity_tokens(&self) -> usize {
        self.capacity
    }
    fn append_positions(&mut self, pos: &[u32]) {
        self.pos.extend_from_slice(pos);
    }
    fn prefetch_append(&self, layer: usize, rows: usize) {
        let units = rows * self.ty.units_per_row(self.kv_dim);
        self.k_raw[layer].prefetch_append(units);
        if !self.ty.rotates_at_read() {
            self.k[layer].prefetch_append(units);
        }
        self.v[layer].prefetch_append(units);
    }
    fn append_layer(&mut self, layer: usize, k_raw: &[f32], k: &[f32], v: &[f32]) {
        self.k_raw[layer].push_f32(k_raw);
        if !self.ty.rotates_at_read() {
            self.k[layer].push_f32(k);
        }
        self.v[layer].push_f32(v);
    }
    fn keys(&self, layer: usize) -> KvRows<'_> {
        self.rows_k(layer)
    }
    fn values(&self, layer: usize) -> KvRows<'_> {
        self.stored(layer, 2)
    }
}
