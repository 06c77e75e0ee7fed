//! The logits head: over every row ([`Model::logits_from_normed`]) or over a subset of
//! its rows ([`Model::logits_rows_from_normed`], the head of [`Model::forward_rows_into`]).

use super::linear::{linear, mapped_as};
use super::scratch::{ProductScratch, SharedActs};
use super::{LogitsWanted, Model, Weight};
use crate::ModelError;
use fak_tensor::{dot, matmul, Threads};

/// Most rows for which [`Model::forward_rows_into`]'s head is used in place of the
/// full head ([`Model::head_rows_pay`]). Each row of the subset is a scattered read
/// that the full head streams, so the subset's cost per row rises with its size; the
/// crossover with the full head, measured by fak-kv's `head_rows` example on SmolLM2's
/// `[49152, 576]` head, lies above this bound on both weight paths, with room for a
/// faster full head (an idle machine's), which moves the crossover down (figures:
/// docs/performance.md, "Constrained decoding: the mask and the reachable-rows head").
pub const HEAD_ROWS_MAX: usize = 4096;

/// [`Model::head_rows_pay`]'s bound as a fraction of the vocabulary: at most
/// `vocab / HEAD_ROWS_FRACTION` rows.
pub const HEAD_ROWS_FRACTION: usize = 8;

impl Model {
    /// The output head's `[vocab, hidden]` matrix: an untied `lm_head`, or the tied
    /// embedding.
    pub(super) fn head(&self) -> &Weight {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// The logits `want` asks for of a batch's rows after the final norm, `xn`
    /// (`[n, hidden]`), written to `logits` from element `from` on (`[rows, vocab]`;
    /// `logits` then ends there, what it held before `from` kept): over the full head,
    /// or for one row with `head_rows`, over those rows of it only
    /// ([`Model::forward_rows_into`]). Only the part past its old length is zeroed
    /// first, so a buffer that already held a row is overwritten in place.
    pub(super) fn head_into(
        &self,
        xn: &[f32],
        (want, head_rows): (LogitsWanted, Option<&[u32]>),
        (logits, from): (&mut Vec<f32>, usize),
        products: &mut ProductScratch,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let h = c.hidden_size;
        let n = xn.len() / h;
        let th = self.threads;
        let rows: &[f32] = match want {
            LogitsWanted::None => return Ok(()),
            LogitsWanted::Last => &xn[(n - 1) * h..],
            LogitsWanted::All => xn,
        };
        let nr = rows.len() / h;
        let end = from + nr * c.vocab_size;
        if logits.len() < end {
            logits.resize(end, 0.0);
        }
        logits.truncate(end);
        if let (Some(sel), 1) = (head_rows, nr) {
            return self.head_rows_into(rows, sel, &mut logits[from..], th, products);
        }
        linear(
            self.head(),
            c.vocab_size,
            h,
            rows,
            nr,
            &mut logits[from..],
            th,
            products,
        )
    }

    /// Applies the logits head to rows that already went through the final norm:
    /// `normed` is `[n, hidden]`, the result `[n, vocab]`.
    ///
    /// # Panics
    /// If `normed.len()` is not a multiple of `hidden_size`.
    pub fn logits_from_normed(&self, normed: &[f32]) -> Vec<f32> {
        let c = &self.config;
        assert!(
            normed.len().is_multiple_of(c.hidden_size),
            "rows are not whole"
        );
        let n = normed.len() / c.hidden_size;
        let mut logits = vec![0f32; n * c.vocab_size];
        let r = linear(
            self.head(),
            c.vocab_size,
            c.hidden_size,
            normed,
            n,
            &mut logits,
            self.threads,
            &mut ProductScratch::default(),
        );
        if let Err(e) = r {
            // Shapes and types were checked at load; no input reaches this.
            panic!("logits head: {e}");
        }
        logits
    }

    /// The output head over a subset of its rows, on one row that already went through
    /// the final norm: `normed` is `[hidden]`, the result `[vocab]` with row `r` the
    /// same bits as [`Model::logits_from_normed`]'s row `r` for every `r` in `rows`, and
    /// `-inf` for every other row (not computed). See [`Model::forward_rows_into`].
    ///
    /// # Errors
    /// [`ModelError::InvalidInput`] when `normed` is not `[hidden]` or a row is not below
    /// the vocabulary size.
    pub fn logits_rows_from_normed(
        &self,
        normed: &[f32],
        rows: &[u32],
    ) -> Result<Vec<f32>, ModelError> {
        let c = &self.config;
        if normed.len() != c.hidden_size {
            return Err(ModelError::InvalidInput(format!(
                "{} values are not one [{}] row",
                normed.len(),
                c.hidden_size
            )));
        }
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= c.vocab_size) {
            return Err(ModelError::InvalidInput(format!(
                "logits row {r} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let mut logits = vec![0f32; c.vocab_size];
        let mut products = ProductScratch::default();
        self.head_rows_into(normed, rows, &mut logits, self.threads, &mut products)?;
        Ok(logits)
    }

    /// The head's rows `sel` of one normed row `x` (`[hidden]`) into `out` (`[vocab]`),
    /// every other row `-inf`. Each row is one dot product with the kernel of the full
    /// head's product, so it is the full head's bits: over `f32` weights [`dot`] (the
    /// canonical order [`matmul`] reproduces for every row, any tiling or thread
    /// count), over quantized weights [`vec_dot`] of the same quantized input
    /// (`matvec_threads`' rows are that single-row order, any grouping or thread
    /// count). Runs on the calling thread; `sel` holds ids below the vocabulary size
    /// (checked by the callers).
    fn head_rows_into(
        &self,
        x: &[f32],
        sel: &[u32],
        out: &mut [f32],
        th: Threads,
        products: &mut ProductScratch,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let (v, h) = (c.vocab_size, c.hidden_size);
        let out = &mut out[..v];
        out.fill(f32::NEG_INFINITY);
        let file_row =
            |order: &Option<Vec<u32>>, r: usize| order.as_ref().map_or(r, |o| o[r] as usize);
        match self.head() {
            Weight::Dense(head) => {
                for &r in sel {
                    let r = r as usize;
                    out[r] = dot(&head[r * h..(r + 1) * h], x);
                }
            }
            Weight::Mapped(m) => {
                let w = mapped_as(m, v, h)?;
                for &r in sel {
                    let f = file_row(&m.row_order, r as usize);
                    out[r as usize] = dot(&w[f * h..(f + 1) * h], x);
                }
            }
            Weight::MappedF16(m) => {
                // One row of the product: the canonical dot with each value widened as
                // loaded, the full head's bits.
                let w = mapped_as(m, v, h)?;
                for &r in sel {
                    let (f, r) = (file_row(&m.row_order, r as usize), r as usize);
                    let one = Threads::new(1);
                    matmul(&w[f * h..(f + 1) * h], 1, h, x, 1, &mut out[r..r + 1], one);
                }
            }
            Weight::Quant(q) => {
                let qerr = |e| ModelError::Unsupported(format!("quantized {} head: {e}", q.ty));
                let mut xs = SharedActs::new(x, h, 1, th, products);
                let act = &xs.for_type(q.ty).map_err(qerr)?[0];
                for &r in sel {
                    let f = file_row(&q.row_order, r as usize);
                    out[r as usize] = q.dot_row(f, act).map_err(qerr)?;
                }
            }
        }
        Ok(())
    }

    /// Whether a step's head over `rows` rows ([`Model::forward_rows_into`]) is faster
    /// than the full head: at most [`HEAD_ROWS_MAX`] rows, or the vocabulary over
    /// [`HEAD_ROWS_FRACTION`] if that is less (a vocabulary smaller than the ones
    /// measured).
    pub fn head_rows_pay(&self, rows: usize) -> bool {
        rows <= HEAD_ROWS_MAX.min(self.config.vocab_size / HEAD_ROWS_FRACTION)
    }
}
