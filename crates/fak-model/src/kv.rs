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
    /// All K rows (post-RoPE) of `layer`, `[len, kv_dim]`, as one or more runs.
    fn keys(&self, layer: usize) -> KvRows<'_>;
    /// All V rows of `layer`, `[len, kv_dim]`, as one or more runs.
    fn values(&self, layer: usize) -> KvRows<'_>;
}

/// One layer's K (or V) rows of a [`KvStore`], `[len, kv_dim]`, held as up to
/// [`KvRows::MAX_RUNS`] contiguous runs of whole rows in entry order: a cache whose
/// oldest entries are shared with other caches (a common prefix stored once) holds
/// them in runs of their own.
///
/// Attention reads the rows a run at a time ([`KvRows::for_runs`]). Every key's dot is
/// computed alone and every weighted sum runs over the keys in ascending order, a sum
/// split into consecutive ranges giving the same bits
/// ([`fak_tensor::weighted_rows_accumulate`]), so where the runs break changes no bit.
#[derive(Clone, Copy, Debug)]
pub struct KvRows<'a> {
    runs: [&'a [f32]; KvRows::MAX_RUNS],
    /// Entries up to the end of each run (cumulative).
    ends: [usize; KvRows::MAX_RUNS],
    n_runs: usize,
    kv_dim: usize,
}

impl<'a> KvRows<'a> {
    /// Most runs one layer's rows may be held in.
    pub const MAX_RUNS: usize = 8;

    /// One run: `rows` is `[len, kv_dim]`.
    pub fn contiguous(rows: &'a [f32], kv_dim: usize) -> Self {
        let mut r = KvRows {
            runs: [&[]; Self::MAX_RUNS],
            ends: [0; Self::MAX_RUNS],
            n_runs: 0,
            kv_dim,
        };
        r.push(rows);
        r
    }

    /// Appends a run of whole rows (an empty one is skipped).
    ///
    /// # Panics
    /// If [`KvRows::MAX_RUNS`] runs are held already, or `rows` is not a whole number
    /// of rows (a programming error of the store).
    pub fn push(&mut self, rows: &'a [f32]) {
        if rows.is_empty() {
            return;
        }
        assert!(
            self.n_runs < Self::MAX_RUNS,
            "KvRows: more than {} runs",
            Self::MAX_RUNS
        );
        assert!(
            self.kv_dim > 0 && rows.len().is_multiple_of(self.kv_dim),
            "KvRows: {} elements are not whole rows of {}",
            rows.len(),
            self.kv_dim
        );
        let before = self.len();
        self.runs[self.n_runs] = rows;
        self.ends[self.n_runs] = before + rows.len() / self.kv_dim;
        self.n_runs += 1;
    }

    /// Entries (rows) held.
    pub fn len(&self) -> usize {
        if self.n_runs == 0 {
            0
        } else {
            self.ends[self.n_runs - 1]
        }
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Width of one row.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Number of runs.
    pub fn runs(&self) -> usize {
        self.n_runs
    }

    /// The rows of entries `range`, run by run in ascending order: `f(rows, sub)` for
    /// each maximal piece `sub` of `range` inside one run, `rows` that run's rows from
    /// entry `sub.start` to the run's end (`[.., kv_dim]`, so a row's slice from an
    /// offset within it is whole). Nothing is allocated.
    ///
    /// # Panics
    /// If `range` ends past [`KvRows::len`].
    pub fn for_runs(
        &self,
        range: std::ops::Range<usize>,
        mut f: impl FnMut(&'a [f32], std::ops::Range<usize>),
    ) {
        assert!(
            range.end <= self.len(),
            "KvRows: entries {range:?} of {}",
            self.len()
        );
        let mut start = 0;
        for i in 0..self.n_runs {
            let end = self.ends[i];
            let (lo, hi) = (range.start.max(start), range.end.min(end));
            if lo < hi {
                f(&self.runs[i][(lo - start) * self.kv_dim..], lo..hi);
            }
            start = end;
            if start >= range.end {
                break;
            }
        }
    }

    /// Row `j`, `[kv_dim]`.
    ///
    /// # Panics
    /// If `j >= len`.
    pub fn row(&self, j: usize) -> &'a [f32] {
        let mut out: &'a [f32] = &[];
        self.for_runs(j..j + 1, |rows, _| out = &rows[..self.kv_dim]);
        out
    }

    /// All rows copied into one buffer, `[len, kv_dim]`.
    pub fn to_vec(&self) -> Vec<f32> {
        let mut v = Vec::with_capacity(self.len() * self.kv_dim);
        for r in &self.runs[..self.n_runs] {
            v.extend_from_slice(r);
        }
        v
    }
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

    /// `kv_dim`, from the rows held (1 when empty: no row is read then).
    fn row_width(&self, layer: usize) -> usize {
        match self.pos.len() {
            0 => 1,
            n => self.k[layer].len() / n,
        }
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
    fn keys(&self, layer: usize) -> KvRows<'_> {
        KvRows::contiguous(&self.k[layer], self.row_width(layer))
    }
    fn values(&self, layer: usize) -> KvRows<'_> {
        KvRows::contiguous(&self.v[layer], self.row_width(layer))
    }
}
