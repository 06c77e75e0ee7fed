//! `KvCache`: the attention state, owned by the kernel as plain buffers.

use fak_model::{Config, KvStore, Model};

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
}

/// Per layer: post-RoPE `k`, pre-RoPE `k_raw` and `v` as flat row-major buffers
/// `[position, kv_heads * head_dim]`, and one shared `pos` vector holding each entry's
/// absolute RoPE position.
///
/// Keeping `k_raw` is what makes eviction exact: a survivor that must move to a new
/// position gets its K re-derived from `k_raw` in a single rotation, the arithmetic a
/// forward pass at that position performs, instead of a second rotation composed on the
/// first (which drifts by rounding and flips greedy tokens).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KvCache {
    n_layers: usize,
    kv_dim: usize,
    capacity: usize,
    pos: Vec<u32>,
    k: Vec<Vec<f32>>,
    k_raw: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
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
        let capacity = capacity.min(config.max_position_embeddings);
        let reserved = capacity.min(Self::RESERVED_TOKENS);
        let kv_dim = config.kv_dim();
        let n = config.num_hidden_layers;
        let buf = || {
            (0..n)
                .map(|_| Vec::with_capacity(reserved.saturating_mul(kv_dim)))
                .collect()
        };
        KvCache {
            n_layers: n,
            kv_dim,
            capacity,
            pos: Vec::with_capacity(reserved),
            k: buf(),
            k_raw: buf(),
            v: buf(),
        }
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

    /// Post-RoPE K of `layer`, `[len, kv_dim]`.
    pub fn k(&self, layer: usize) -> &[f32] {
        &self.k[layer]
    }

    /// Pre-RoPE K of `layer`, `[len, kv_dim]`.
    pub fn k_raw(&self, layer: usize) -> &[f32] {
        &self.k_raw[layer]
    }

    /// V of `layer`, `[len, kv_dim]`.
    pub fn v(&self, layer: usize) -> &[f32] {
        &self.v[layer]
    }

    /// Bytes one entry occupies: K, K before RoPE and V for every layer (`f32`), plus its
    /// position (`u32`).
    pub fn bytes_per_token(&self) -> usize {
        3 * self.n_layers * self.kv_dim * std::mem::size_of::<f32>() + std::mem::size_of::<u32>()
    }

    /// Bytes held by the entries now in the cache.
    pub fn bytes_used(&self) -> usize {
        self.len() * self.bytes_per_token()
    }

    /// Bytes reserved (allocated capacity of every buffer).
    pub fn bytes_reserved(&self) -> usize {
        let f: usize = self
            .k
            .iter()
            .chain(&self.k_raw)
            .chain(&self.v)
            .map(|b| b.capacity() * 4)
            .sum();
        f + self.pos.capacity() * 4
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
        let d = self.kv_dim;
        for l in 0..self.n_layers {
            for buf in [&mut self.k[l], &mut self.k_raw[l], &mut self.v[l]] {
                buf.drain(from * d..end * d);
            }
        }
        self.pos.drain(from..end);
        if shift > 0 {
            for j in from..self.pos.len() {
                self.pos[j] -= shift;
            }
            for l in 0..self.n_layers {
                let (k, k_raw) = (&mut self.k[l], &self.k_raw[l]);
                for j in from..self.pos.len() {
                    let row = &mut k[j * d..(j + 1) * d];
                    row.copy_from_slice(&k_raw[j * d..(j + 1) * d]);
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
        let d = self.kv_dim;
        for l in 0..self.n_layers {
            for buf in [&mut self.k[l], &mut self.k_raw[l], &mut self.v[l]] {
                buf.truncate(keep * d);
            }
        }
        self.pos.truncate(keep);
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
        let d = self.kv_dim;
        for l in 0..self.n_layers {
            for buf in [&mut self.k[l], &mut self.k_raw[l], &mut self.v[l]] {
                buf.drain(..n * d);
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
    fn append_layer(&mut self, layer: usize, k_raw: &[f32], k: &[f32], v: &[f32]) {
        self.k_raw[layer].extend_from_slice(k_raw);
        self.k[layer].extend_from_slice(k);
        self.v[layer].extend_from_slice(v);
    }
    fn keys(&self, layer: usize) -> &[f32] {
        &self.k[layer]
    }
    fn values(&self, layer: usize) -> &[f32] {
        &self.v[layer]
    }
}
