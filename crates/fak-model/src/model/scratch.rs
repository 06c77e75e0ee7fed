//! The buffers of a forward pass, kept between passes: [`ForwardScratch`], and the
//! matrix products' quantized inputs and file-order outputs.

use crate::Config;
use fak_tensor::quant::{quantize_activation_into, ActKind, QType, QuantError, QuantizedActs};
use fak_tensor::Threads;

/// The buffers of the matrix products, kept between forward passes
/// ([`ForwardScratch`]): each activation kind's quantized rows, and outputs computed in
/// the file's row order before they are put in HF's.
#[derive(Default)]
pub(super) struct ProductScratch {
    /// Quantized rows per activation kind; the first `fresh` hold the current input,
    /// the rest are buffers kept for reuse.
    pub(super) made: Vec<(ActKind, Vec<QuantizedActs>)>,
    pub(super) fresh: usize,
    /// The input (its rows' address and length) whose quantized rows the step that
    /// made them wrote ([`ProductScratch::prepare`]), for the next
    /// [`SharedActs::continuing`] of that same input to read; taken by the next
    /// [`SharedActs`] whatever its input, and cleared at the start of every pass
    /// ([`ProductScratch::start_pass`]), so rows a failed step left are never read.
    prepared: Option<(usize, usize)>,
    /// Outputs in the file's row order, one buffer per product of a group.
    pub(super) file_order: Vec<Vec<f32>>,
}

/// The rows quantized for `kind` among `made` (a [`ProductScratch`]'s current ones).
pub(super) fn acts_of(
    made: &[(ActKind, Vec<QuantizedActs>)],
    kind: ActKind,
) -> Option<&[QuantizedActs]> {
    made.iter().find(|(k, _)| *k == kind).map(|(_, a)| &a[..])
}

/// Buffer `i` of `bufs` (added if missing), resized to `len`.
pub(super) fn kept_buffer(bufs: &mut Vec<Vec<f32>>, i: usize, len: usize) -> &mut Vec<f32> {
    if bufs.len() <= i {
        bufs.resize_with(i + 1, Vec::new);
    }
    let b = &mut bufs[i];
    b.resize(len, 0.0);
    b
}

impl ProductScratch {
    /// The `i`-th file-order buffer, `len` long.
    pub(super) fn file_order(&mut self, i: usize, len: usize) -> &mut Vec<f32> {
        kept_buffer(&mut self.file_order, i, len)
    }

    /// Forgets any prepared rows ([`ProductScratch::prepare`]): a pass starts with none.
    pub(super) fn start_pass(&mut self) {
        self.prepared = None;
    }

    /// Starts a new input whose `n` rows the step that makes them quantizes as it
    /// goes (the residual add and RMSNorm before a sublayer's products, one hand-off
    /// for all of it): the kept buffer of `kind` (or a new one) becomes the input's
    /// only quantized form, `n` rows, returned to be filled, each row with
    /// [`quantize_activation_into`] of the row the products will read from `of` (the
    /// buffer the step writes, `[n, cols]`). [`SharedActs::continuing`] over that same
    /// buffer then uses them instead of quantizing again.
    pub(super) fn prepare(&mut self, kind: ActKind, n: usize, of: &[f32]) -> &mut [QuantizedActs] {
        match self.made.iter().position(|(k, _)| *k == kind) {
            Some(i) => self.made.swap(0, i),
            None => {
                self.made.push((kind, Vec::new()));
                let last = self.made.len() - 1;
                self.made.swap(0, last);
            }
        }
        self.fresh = 1;
        self.prepared = Some((of.as_ptr() as usize, of.len()));
        let acts = &mut self.made[0].1;
        acts.truncate(n);
        acts.resize_with(n, || QuantizedActs::Q8_0(Vec::new()));
        acts
    }
}

/// The quantized forms of one input (`n` rows of `cols`), made once per activation
/// kind and shared by every product that reads that input (q/k/v, gate/up): the
/// same function of the same row gives the same blocks, so sharing changes no bit.
/// The blocks are written into `scratch`'s buffers, so once they have grown a
/// one-token input allocates nothing.
pub(super) struct SharedActs<'a> {
    pub(super) x: &'a [f32],
    pub(super) cols: usize,
    pub(super) n: usize,
    /// Threads the rows of a many-token input are quantized on.
    th: Threads,
    pub(super) scratch: &'a mut ProductScratch,
}

impl<'a> SharedActs<'a> {
    /// The `n` rows of `cols` values of `x`, quantized as each product asks
    /// ([`SharedActs::for_type`]).
    pub(super) fn new(
        x: &'a [f32],
        cols: usize,
        n: usize,
        th: Threads,
        scratch: &'a mut ProductScratch,
    ) -> Self {
        scratch.prepared = None;
        Self::continuing(x, cols, n, th, scratch)
    }

    /// [`SharedActs::new`] of the rows `x` whose quantized form the step that made them
    /// wrote ([`ProductScratch::prepare`] for this same buffer and `n`), which it then
    /// reads rather than quantizing `x` again; without one, as [`SharedActs::new`].
    pub(super) fn continuing(
        x: &'a [f32],
        cols: usize,
        n: usize,
        th: Threads,
        scratch: &'a mut ProductScratch,
    ) -> Self {
        let x = &x[..n * cols];
        let prepared = scratch.prepared.take() == Some((x.as_ptr() as usize, x.len()))
            && scratch.fresh == 1
            && scratch.made[0].1.len() == n;
        if !prepared {
            scratch.fresh = 0;
        }
        SharedActs {
            x,
            cols,
            n,
            th,
            scratch,
        }
    }

    /// The rows quantized for `ty` weights (quantized on first use).
    pub(super) fn for_type(&mut self, ty: QType) -> Result<&[QuantizedActs], QuantError> {
        let kind = ty.act_kind();
        let sc = &mut *self.scratch;
        if let Some(i) = sc.made[..sc.fresh].iter().position(|(k, _)| *k == kind) {
            return Ok(&sc.made[i].1);
        }
        // A kept buffer of this kind if there is one, else a new one, moved to `fresh`.
        let at = sc.fresh;
        match sc.made[at..].iter().position(|(k, _)| *k == kind) {
            Some(i) => sc.made.swap(at, at + i),
            None => {
                sc.made.push((kind, Vec::new()));
                let last = sc.made.len() - 1;
                sc.made.swap(at, last);
            }
        }
        let acts = &mut sc.made[at].1;
        acts.truncate(self.n);
        acts.resize_with(self.n, || QuantizedActs::Q8_0(Vec::new()));
        // Each row on its own (a pure function of the row), so splitting the rows
        // between threads changes no bit.
        let (x, cols) = (self.x, self.cols);
        super::forward::rows_in_parts(self.n, self.th, 1, acts, &|r, part| {
            let x = &x[r.start * cols..r.end * cols];
            part.iter_mut()
                .zip(x.chunks_exact(cols))
                .try_for_each(|(a, xt)| quantize_activation_into(ty, xt, a))
        })?;
        sc.fresh += 1;
        Ok(&sc.made[at].1)
    }
}

/// The buffers a forward pass works in, kept by the caller between passes
/// ([`Model::forward_into`](super::Model::forward_into); a session keeps one per
/// conversation), so that a decode step allocates nothing once they have grown: the
/// residual stream, the normed input, q/k/v and the unrotated k, the attention output
/// and scores, the MLP's gate and up, the RoPE rows, each product's quantized input and
/// its outputs in the file's row order.
///
/// After a pass of more than one token (a prefill) the buffers are released, so a
/// conversation does not keep a long prompt's activations (tens of MB for a few
/// thousand tokens); the next decode step grows them again to one token's size, once.
/// The attention scores (`heads × entries`) grow as a `Vec` does, to twice their size
/// when full, so a growing context regrows them only each time it doubles.
///
/// It holds no state that changes a result: any scratch, new or used, gives the same
/// bits (the quantized rows a step prepares for the products after it are read only by
/// those products, in the same pass, `ProductScratch::prepare`). `Clone` gives a new,
/// empty one.
#[derive(Default)]
pub struct ForwardScratch {
    pub(super) x: Vec<f32>,
    pub(super) xn: Vec<f32>,
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) k_raw: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) attn: Vec<f32>,
    pub(super) proj: Vec<f32>,
    pub(super) gate: Vec<f32>,
    pub(super) up: Vec<f32>,
    /// A head's or a row's QK-norm output before it is copied back.
    pub(super) norm: Vec<f32>,
    /// Per distinct RoPE table used by this pass: (first layer using it, cos rows, sin
    /// rows); entries past `rope_used` are kept buffers.
    pub(super) rope: Vec<(usize, Vec<f32>, Vec<f32>)>,
    pub(super) rope_used: usize,
    /// Decode attention's `[heads, entries]` scores; in a prefill over a compact
    /// cache, the layer's K and V rows the new tokens see, widened
    /// (`[2, entries, kv_dim]`: at most twice a layer's rows as `f32`).
    pub(super) scores: Vec<f32>,
    /// A prefill's keys laid out in tiles for its attention scores (grown, never
    /// shrunk; `attention::prefill`'s `key_tiles`).
    pub(super) key_tiles: Vec<f32>,
    /// Decode attention's scores per sequence of a batched pass
    /// ([`Model::forward_batch`](super::Model::forward_batch)).
    pub(super) batch_scores: Vec<Vec<f32>>,
    /// A batched pass's logits of several sequences before each gets its rows
    /// ([`Model::forward_batch`](super::Model::forward_batch)), when the head is not a
    /// quantized matrix (a quantized head writes into each sequence's buffer).
    pub(super) batch_logits: Vec<f32>,
    pub(super) products: ProductScratch,
}

impl ForwardScratch {
    /// An empty scratch (nothing allocated until a pass uses it).
    pub fn new() -> Self {
        Self::default()
    }

    /// Sizes the activation buffers for a batch of `n` tokens of a model with config
    /// `c`, zeroed: `x`, `xn`, `proj` `[n, hidden]`; `q`, `attn` `[n, q_dim]`; `k`, `v`
    /// `[n, kv_dim]`; `gate`, `up` `[n, intermediate]`.
    pub(super) fn size_for(&mut self, n: usize, c: &Config) {
        let h = c.hidden_size;
        let (qd, kvd, ff) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        for (b, len) in [
            (&mut self.x, n * h),
            (&mut self.xn, n * h),
            (&mut self.q, n * qd),
            (&mut self.k, n * kvd),
            (&mut self.v, n * kvd),
            (&mut self.attn, n * qd),
            (&mut self.proj, n * h),
            (&mut self.gate, n * ff),
            (&mut self.up, n * ff),
        ] {
            b.clear();
            b.resize(len, 0.0);
        }
    }

    /// Bytes held by the buffers (their capacity; the quantized inputs by length).
    pub fn bytes(&self) -> usize {
        let f = |v: &Vec<f32>| 4 * v.capacity();
        let p = &self.products;
        [
            &self.x,
            &self.xn,
            &self.q,
            &self.k,
            &self.k_raw,
            &self.v,
            &self.attn,
            &self.proj,
            &self.gate,
            &self.up,
            &self.norm,
            &self.scores,
            &self.batch_logits,
        ]
        .into_iter()
        .map(f)
        .sum::<usize>()
            + self.rope.iter().map(|(_, c, s)| f(c) + f(s)).sum::<usize>()
            + self.batch_scores.iter().map(f).sum::<usize>()
            + p.file_order.iter().map(f).sum::<usize>()
            + p.made
                .iter()
                .flat_map(|(_, rows)| rows)
                .map(|a| match a {
                    QuantizedActs::Q8_0(b) => std::mem::size_of_val(&b[..]),
                    QuantizedActs::Q8_1(b) => std::mem::size_of_val(&b[..]),
                    QuantizedActs::Q8K(b) => std::mem::size_of_val(&b[..]),
                })
                .sum::<usize>()
    }
}

impl Clone for ForwardScratch {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for ForwardScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardScratch")
            .field("bytes", &self.bytes())
            .finish()
    }
}
