//! The attention state a forward pass reads and appends to.
//!
//! [`KvStore`] is the seam between the model and the cache that owns the attention
//! state: fak-kv's `KvCache` (span eviction, prefix clone, sliding window) implements it,
//! and so does the plain [`VecKvCache`] here, which the model's own tests and simple
//! callers use. `compact` holds the element types rows may be stored in ([`KvType`]).

mod compact;

pub use compact::{KvType, RowBuf, Run};

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
///
/// A store is `Send`: a batched pass appends each decode sequence's rows on the pool
/// thread that computes that sequence's attention.
pub trait KvStore: Send {
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
    /// Hints that `rows` entries of layer `layer` are about to be appended
    /// ([`KvStore::append_layer`]), so a store can fetch the memory they go to for
    /// writing meanwhile. A hint only: nothing stored changes. Default: nothing.
    fn prefetch_append(&self, layer: usize, rows: usize) {
        let _ = (layer, rows);
    }
    /// All K rows (post-RoPE) of `layer`, `[len, kv_dim]`, as one or more runs.
    fn keys(&self, layer: usize) -> KvRows<'_>;
    /// All V rows of `layer`, `[len, kv_dim]`, as one or more runs.
    fn values(&self, layer: usize) -> KvRows<'_>;
}

/// The rotation a compact cache's keys get as they are read ([`KvRows::with_rope`]):
/// each entry `j`'s key is rotated at `positions[j]` with that row of the tables, by
/// [`fak_tensor::rope_rotate_half`] per head, the arithmetic of the forward pass.
#[derive(Clone, Copy, Debug)]
pub struct RopeAtRead<'a> {
    /// `cos` of every position the entries may hold, `[positions, half]`.
    pub cos: &'a [f32],
    /// `sin`, as `cos`.
    pub sin: &'a [f32],
    /// Half the rotary dimension: the length of one position's `cos` and `sin` rows.
    pub half: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// The entries' absolute positions, `[len]`.
    pub positions: &'a [u32],
}

impl<'a> RopeAtRead<'a> {
    /// The `cos` and `sin` rows (`half` values each) of entry `j`'s position.
    ///
    /// # Panics
    /// If `j` is not an entry, or its position lies past the tables.
    pub fn at(&self, j: usize) -> (&'a [f32], &'a [f32]) {
        let p = self.positions[j] as usize;
        let r = p * self.half..(p + 1) * self.half;
        (&self.cos[r.clone()], &self.sin[r])
    }
}

/// Most values one piece of widened rows holds ([`KvRows::for_cols`]): 16 KiB of `f32`
/// on the reader's stack (one row wider than that gets a piece of its own).
const PIECE: usize = 4096;

/// One layer's K (or V) rows of a [`KvStore`], `[len, kv_dim]`, held as up to
/// [`KvRows::MAX_RUNS`] contiguous runs of whole rows in entry order: a cache whose
/// oldest entries are shared with other caches (a common prefix stored once) holds
/// them in runs of their own. The rows are stored in one [`KvType`]; a compact type's
/// keys are stored before RoPE and rotated as they are read ([`KvRows::with_rope`]).
///
/// A decode step's attention reads the rows a piece at a time as `f32`
/// ([`KvRows::for_cols`]); a prefill over a compact type widens them whole once
/// ([`KvRows::widen_into`]), the same values. Every key's dot is computed alone and
/// every weighted sum runs over the keys in ascending order, a sum split into
/// consecutive ranges giving the same bits ([`fak_tensor::weighted_rows_accumulate`]),
/// so where the runs and pieces break changes no bit.
#[derive(Clone, Copy, Debug)]
pub struct KvRows<'a> {
    runs: [Run<'a>; KvRows::MAX_RUNS],
    /// Entries up to the end of each run (cumulative).
    ends: [usize; KvRows::MAX_RUNS],
    n_runs: usize,
    kv_dim: usize,
    ty: KvType,
    /// Keys stored before RoPE, to be rotated at read.
    pre_rope: bool,
    rope: Option<RopeAtRead<'a>>,
}

impl<'a> KvRows<'a> {
    /// Most runs one layer's rows may be held in.
    pub const MAX_RUNS: usize = 8;

    /// No rows yet, of type `ty`.
    pub fn empty(ty: KvType, kv_dim: usize) -> Self {
        KvRows {
            runs: [Run::F32(&[]); Self::MAX_RUNS],
            ends: [0; Self::MAX_RUNS],
            n_runs: 0,
            kv_dim,
            ty,
            pre_rope: false,
            rope: None,
        }
    }

    /// One run of `f32` rows: `rows` is `[len, kv_dim]`.
    pub fn contiguous(rows: &'a [f32], kv_dim: usize) -> Self {
        let mut r = Self::empty(KvType::F32, kv_dim);
        r.push(rows);
        r
    }

    /// Appends a run of whole `f32` rows ([`KvRows::push_run`]).
    ///
    /// # Panics
    /// As [`KvRows::push_run`].
    pub fn push(&mut self, rows: &'a [f32]) {
        self.push_run(Run::F32(rows));
    }

    /// Appends a run of whole rows (an empty one is skipped).
    ///
    /// # Panics
    /// If [`KvRows::MAX_RUNS`] runs are held already, or `run` is of another type or not
    /// a whole number of rows (a programming error of the store).
    pub fn push_run(&mut self, run: Run<'a>) {
        if run.units() == 0 {
            return;
        }
        assert!(
            self.n_runs < Self::MAX_RUNS,
            "KvRows: more than {} runs",
            Self::MAX_RUNS
        );
        assert_eq!(run.kv_type(), self.ty, "KvRows: a run of another type");
        let upr = self.ty.units_per_row(self.kv_dim);
        assert!(
            upr > 0 && run.units().is_multiple_of(upr),
            "KvRows: {} units are not whole rows of {}",
            run.units(),
            upr
        );
        let before = self.len();
        self.runs[self.n_runs] = run;
        self.ends[self.n_runs] = before + run.units() / upr;
        self.n_runs += 1;
    }

    /// Marks the rows as keys stored before RoPE: [`KvRows::for_cols`] then needs the
    /// rotation ([`KvRows::with_rope`]).
    pub fn pre_rope(mut self) -> Self {
        self.pre_rope = true;
        self
    }

    /// Whether these are keys stored before RoPE, rotated at read.
    pub fn is_pre_rope(&self) -> bool {
        self.pre_rope
    }

    /// The rotation applied to pre-RoPE keys as they are read.
    pub fn with_rope(mut self, rope: RopeAtRead<'a>) -> Self {
        self.rope = Some(rope);
        self
    }

    /// The type the rows are stored in.
    pub fn kv_type(&self) -> KvType {
        self.ty
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

    /// The stored units of entries `range`, run by run in ascending order:
    /// `f(run, sub)` for each maximal piece `sub` of `range` inside one run, `run`
    /// exactly those entries' units. Nothing is allocated.
    ///
    /// # Panics
    /// If `range` ends past [`KvRows::len`].
    pub fn for_stored(
        &self,
        range: std::ops::Range<usize>,
        mut f: impl FnMut(Run<'a>, std::ops::Range<usize>),
    ) {
        assert!(
            range.end <= self.len(),
            "KvRows: entries {range:?} of {}",
            self.len()
        );
        let upr = self.ty.units_per_row(self.kv_dim);
        let mut start = 0;
        for i in 0..self.n_runs {
            let end = self.ends[i];
            let (lo, hi) = (range.start.max(start), range.end.min(end));
            if lo < hi {
                f(
                    self.runs[i].slice((lo - start) * upr..(hi - start) * upr),
                    lo..hi,
                );
            }
            start = end;
            if start >= range.end {
                break;
            }
        }
    }

    /// Values `cols` of the rows of entries `range` as `f32`, in ascending pieces:
    /// `f(rows, stride, sub)` for consecutive pieces `sub` of `range`, `rows` holding
    /// entry `sub.start`'s values from `cols.start` on and each next entry's `stride`
    /// further. `f32` rows are the stored ones (`stride = kv_dim`); a compact type's
    /// are widened into a buffer on the stack (`stride = cols.len()`), keys rotated at
    /// their entries' positions. Nothing is allocated.
    ///
    /// # Panics
    /// If `range` ends past [`KvRows::len`] or `cols` past `kv_dim`; for pre-RoPE keys,
    /// if no rotation was given or `cols` is not whole heads.
    pub fn for_cols(
        &self,
        range: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        mut f: impl FnMut(&[f32], usize, std::ops::Range<usize>),
    ) {
        assert!(
            cols.end <= self.kv_dim,
            "KvRows: columns {cols:?} of {}",
            self.kv_dim
        );
        if range.is_empty() {
            return;
        }
        let (kvd, nc) = (self.kv_dim, cols.len());
        let rope = if self.pre_rope {
            let r = self
                .rope
                .expect("KvRows: pre-RoPE keys read without their rotation");
            assert!(
                cols.start.is_multiple_of(r.head_dim) && nc.is_multiple_of(r.head_dim),
                "KvRows: rotated columns {cols:?} are not whole heads"
            );
            Some(r)
        } else {
            None
        };
        // Rows per piece: as many whole rows as PIECE values hold, in eights from 16 on
        // (the dot kernels take rows eight at a time), at least one.
        let per = match PIECE / nc.max(1) {
            0 => 1,
            n if n >= 16 => n / 8 * 8,
            n => n,
        };
        // The piece's buffer, on the stack: zeroed once per call, and only when rows
        // are widened (a thread-local one would allocate in a decode step the first
        // time a thread widens, and a decode step allocates nothing).
        let mut buf: Option<[f32; PIECE]> = None;
        let mut wide: Vec<f32> = Vec::new();
        self.for_stored(range, |run, sub| {
            if let (Run::F32(r), None) = (run, rope) {
                return f(&r[cols.start..], kvd, sub);
            }
            let mut p0 = sub.start;
            while p0 < sub.end {
                let p1 = (p0 + per).min(sub.end);
                let need = (p1 - p0) * nc;
                let rows = if need <= PIECE {
                    &mut buf.get_or_insert([0.0; PIECE])[..need]
                } else {
                    // One row wider than a piece (no model fak loads has one): on the heap.
                    wide.resize(need, 0.0);
                    &mut wide[..]
                };
                let rel = p0 - sub.start..p1 - sub.start;
                widen_run(run, rel, p0, (kvd, cols.clone()), rope, rows);
                f(rows, nc, p0..p1);
                p0 = p1;
            }
        });
    }

    /// Row `j` of `f32` rows, `[kv_dim]`, borrowed.
    ///
    /// # Panics
    /// If `j >= len` or the rows are of a compact type (read them with
    /// [`KvRows::for_cols`]).
    pub fn row(&self, j: usize) -> &'a [f32] {
        let mut out: &'a [f32] = &[];
        self.for_stored(j..j + 1, |run, _| match run {
            Run::F32(r) => out = r,
            _ => panic!("KvRows::row of {} rows", self.ty),
        });
        out
    }

    /// All rows as `f32` in one buffer, `[len, kv_dim]` ([`KvRows::widen_into`]: a
    /// compact type's widened, pre-RoPE keys rotated when a rotation was given and left
    /// unrotated otherwise).
    pub fn to_vec(&self) -> Vec<f32> {
        let mut v = vec![0f32; self.len() * self.kv_dim];
        let mut rows = *self;
        if rows.rope.is_none() {
            rows.pre_rope = false;
        }
        rows.widen_into(0..self.len(), &mut v);
        v
    }

    /// The rows of entries `range` as `f32` into `out` (`[range.len(), kv_dim]`): the
    /// values [`KvRows::for_cols`] gives for every column (`f32` rows copied, a compact
    /// type's widened, pre-RoPE keys rotated at their entries' positions), the same bits,
    /// written straight into `out` rather than through pieces on the stack. A prefill
    /// widens its layer's compact rows once this way and runs attention over them
    /// in place, where reading through [`KvRows::for_cols`] would widen each key again
    /// for every block of tokens and every query head.
    ///
    /// # Panics
    /// If `range` ends past [`KvRows::len`], `out` holds fewer than
    /// `range.len() · kv_dim` values, or pre-RoPE keys have no rotation.
    pub fn widen_into(&self, range: std::ops::Range<usize>, out: &mut [f32]) {
        let kvd = self.kv_dim;
        let out = &mut out[..range.len() * kvd];
        let rope = self.pre_rope.then(|| {
            self.rope
                .expect("KvRows: pre-RoPE keys read without their rotation")
        });
        let start = range.start;
        self.for_stored(range, |run, sub| {
            let o = &mut out[(sub.start - start) * kvd..(sub.end - start) * kvd];
            match (run, rope) {
                (Run::F32(r), None) => o.copy_from_slice(r),
                _ => widen_run(run, 0..sub.len(), sub.start, (kvd, 0..kvd), rope, o),
            }
        });
    }

    /// The stored bytes of every row, in entry order ([`Run::as_bytes`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.for_stored(0..self.len(), |run, _| v.extend_from_slice(run.as_bytes()));
        v
    }
}

/// Rows `rows` of `run` (columns `cols` of rows of `kv_dim` values) widened into `out`
/// at a stride of `cols.len()`, and with `rope` rotated at their entries' positions, row
/// `rows.start` being entry `entry` ([`Run::widen_rows`], [`Run::widen_rows_rotated`]).
fn widen_run(
    run: Run<'_>,
    rows: std::ops::Range<usize>,
    entry: usize,
    (kv_dim, cols): (usize, std::ops::Range<usize>),
    rope: Option<RopeAtRead<'_>>,
    out: &mut [f32],
) {
    let (j, n) = (rows.start, rows.len());
    match rope {
        Some(r) => {
            let rot = |i: usize| r.at(entry + i);
            run.widen_rows_rotated(j, n, kv_dim, cols, (r.head_dim, r.half), &rot, out);
        }
        None => run.widen_rows(j, n, kv_dim, cols, out),
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
