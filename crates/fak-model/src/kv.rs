//! The attention state a forward pass reads and appends to.
//!
//! [`KvStore`] is the seam between the model and the cache that owns the attention
//! state: fak-kv's `KvCache` (span eviction, prefix clone, sliding window) implements it,
//! and so does the plain [`VecKvCache`] here, which the model's own tests and simple
//! callers use.

/// First entry a query may attend to under a sliding window.
///
/// `pos` holds the absolute RoPE positions of the entries (strictly increasing) and
/// `end` is the query's own entry. A query at absolute position `p = pos[end]` attends
/// the keys whose position is `>= p - window + 1` (HF's sliding-window mask, Mistral /
/// Gemma: the query and the `window - 1` positions before it), found from `pos`, so the
/// answer stays right after an eviction renumbers entries. `None` is full causal
/// attention (start 0). A window of 0 is treated as 1 (the query alone).
///
/// # Panics
/// If `end >= pos.len()`.
pub fn window_start(pos: &[u32], end: usize, window: Option<usize>) -> usize {
    match window {
        None => 0,
        Some(w) => {
            let lo = (pos[end] as i64 - w.max(1) as i64 + 1).max(0) as u32;
            pos[..=end].partition_point(|&pj| pj < lo)
        }
    }
}

/// Per-layer key/value rows plus the absolute RoPE position of each entry.
///
/// Row layout: every layer holds `len()` rows of `kv_dim = num_key_value_heads *
/// head_dim` floats for K (post-RoPE), K before RoPE (`k_raw`) and V. Entry `i` of every
/// layer is the token at absolute position `positions()[i]`; positions strictly increase.
pub trait KvStore {
    /// Number of entries (tokens) stored, including those appended by a forward pass in
    /// progress once `append_positions` has been called.
    fn len(&self) -> usize;
    /// Whether nothing is stored.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Absolute RoPE position of each entry, `[len]`.
    fn positions(&self) -> &[u32];
    /// Most entries this store can hold (tokens).
    fn capacity_tokens(&self) -> usize;
    /// Starts a forward pass over new tokens at `pos` (appended after the existing ones).
    fn append_positions(&mut self, pos: &[u32]);
    /// Appends layer `layer`'s rows for the new tokens: `k_raw` (pre-RoPE), `k`
    /// (post-RoPE) and `v`, each `[n_new, kv_dim]`.
    fn append_layer(&mut self, layer: usize, k_raw: &[f32], k: &[f32], v: &[f32]);
    /// All K rows (post-RoPE) of `layer`, `[len, kv_dim]`.
    fn keys(&self, layer: usize) -> &[f32];
    /// All V rows of `layer`, `[len, kv_dim]`.
    fn values(&self, layer: usize) -> &[f32];
}

/// A plain growable KV cache: one `Vec` per layer for K, K before RoPE and V.
#[derive(Clone, Debug, Default)]
pub struct VecKvCache {
    pos: Vec<u32>,
    k: Vec<Vec<f32>>,
    k_raw: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    capacity: usize,
}

impl VecKvCache {
    /// An empty cache for `n_layers` layers holding at most `capacity` tokens.
    pub fn new(n_layers: usize, capacity: usize) -> Self {
        VecKvCache {
            pos: Vec::new(),
            k: vec![Vec::new(); n_layers],
            k_raw: vec![Vec::new(); n_layers],
            v: vec![Vec::new(); n_layers],
            capacity,
        }
    }

    /// K rows before RoPE of `layer`, `[len, kv_dim]`.
    pub fn keys_raw(&self, layer: usize) -> &[f32] {
        &self.k_raw[layer]
    }
}

impl KvStore for VecKvCache {
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
