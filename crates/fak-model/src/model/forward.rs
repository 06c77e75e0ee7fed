//! The forward pass: [`Model::forward`] and its variants, checking the input and
//! running it through the layers in batches of at most [`Model::prefill_chunk`] tokens.

use super::linear::{linear_group, linear_into_slices, linear_shared};
use super::scratch::SharedActs;
use super::{CosSinRows, ForwardScratch, LayerWeights, Model, Op, RopeRegime, Weight};
use crate::attention::{decode_attention, prefill_attention, AttentionShape, Scores};
use crate::kv::{window_start, KvRows, KvStore, KvType, RopeAtRead};
use crate::{Activation, ModelError};
use fak_tensor::pool::{part_range, Disjoint};
use fak_tensor::quant::{quantize_activation_into, QType, QuantError, QuantizedActs};
use fak_tensor::{add_assign, parallel_chunks, rms_norm, rope_rotate_half, Threads};
use std::sync::PoisonError;

/// Which rows of logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill whose output is not needed).
    None,
    /// The last new token's row only, `[1, vocab]`.
    Last,
    /// Every new token's row, `[n_new, vocab]`.
    All,
}

/// Intermediate activations of one forward pass, for proofs against HF's hooks.
/// Every buffer is `[n_new, hidden]`, row-major.
#[derive(Clone, Debug, Default)]
pub struct ForwardTrace {
    /// Output of `embed_tokens` (times the embedding scale, if the family has one).
    pub embed: Vec<f32>,
    /// Residual stream after each decoder layer, `[num_layers][n_new * hidden]`.
    pub layers: Vec<Vec<f32>>,
    /// Output of the final `norm`.
    pub final_norm: Vec<f32>,
}

/// Most rows in all of a [`Model::forward_batch`] whose buffers are kept for the next
/// (a decode step of that many sequences); a batch of more releases them, as a prefill
/// does.
const KEEP_SCRATCH_ROWS: usize = 64;

/// The fewest rows (a batched decode step's tokens) whose per-row work outside the
/// products (the residual add and norms with the quantization of a product's input,
/// the gated activation) is split between the threads, one part each; from 16 rows it
/// is split in a few parts per thread.
const FEW_ROWS_SPLIT: usize = 4;

/// Rows per part when `n` rows of per-row work are split between `th` threads: `None`
/// (one part, on the calling thread) under [`FEW_ROWS_SPLIT`] rows or on one thread;
/// one part per thread under 16 rows; from 16, four parts per thread of at least
/// `min_rows` rows each, so a late thread holds up little.
pub(super) fn rows_per_part(n: usize, th: Threads, min_rows: usize) -> Option<usize> {
    match n {
        _ if n < FEW_ROWS_SPLIT || th.get() <= 1 => None,
        ..16 => Some(n.div_ceil(th.get())),
        _ => Some(n.div_ceil(th.get().saturating_mul(4)).max(min_rows)),
    }
}

/// The work of one part of [`rows_in_parts`]: its rows and their quantized rows.
type RowsJob<'a> =
    dyn Fn(std::ops::Range<usize>, &mut [QuantizedActs]) -> Result<(), QuantError> + Sync + 'a;

/// Per-row work over the rows `0..n` of a pass, split as [`rows_per_part`] says
/// (`min_rows` as there): `f(r, part)` once per part of consecutive rows `r`, on the
/// pool's threads (the whole on the calling thread when it is one part), `part` those
/// rows of `acts`, which holds a quantized row for each row or none (then every part is
/// empty). Each row's work must be a function of that row alone, so the split changes
/// no bit. Every part runs; the result is an error one of them returned.
pub(super) fn rows_in_parts(
    n: usize,
    th: Threads,
    min_rows: usize,
    acts: &mut [QuantizedActs],
    f: &RowsJob<'_>,
) -> Result<(), QuantError> {
    let Some(per) = rows_per_part(n, th, min_rows) else {
        return f(0..n, acts);
    };
    let all = Disjoint::new(acts);
    let error = std::sync::Mutex::new(None);
    parallel_chunks(n.div_ceil(per), th, &|c| {
        let r = c * per..((c + 1) * per).min(n);
        let mine = if all.is_empty() { 0..0 } else { r.clone() };
        // SAFETY: the pool calls each chunk index once, and chunk `c` alone names rows
        // `r` (consecutive, disjoint ranges); with no quantized rows every chunk takes
        // the empty part, which overlaps nothing.
        let part = unsafe { all.part(mine) };
        if let Err(e) = f(r, part) {
            *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
        }
    });
    error
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
        .map_or(Ok(()), Err)
}

/// One sequence of a batched pass ([`Model::forward_batch`]): its new tokens, its own
/// KV cache, and the logits it wants.
pub struct BatchSeq<'a> {
    /// The new tokens, `[n]` (at least one).
    pub ids: &'a [u32],
    /// Their absolute positions, `[n]`, strictly increasing past `kv`'s last.
    pub positions: &'a [u32],
    /// The sequence's own attention state: the new tokens attend to it and are appended.
    pub kv: &'a mut dyn KvStore,
    /// Which rows of logits to return.
    pub want: LogitsWanted,
    /// With [`LogitsWanted::Last`]: only these rows of the head, the rest `-inf`
    /// ([`Model::forward_rows_into`]).
    pub head_rows: Option<&'a [u32]>,
    /// The output, resized to `[rows, vocab]` (emptied for [`LogitsWanted::None`]).
    pub logits: &'a mut Vec<f32>,
}

/// A sequence's share of a pass over concatenated rows: rows `rows` of the batch, its
/// cache, and where its logits go.
struct Seg<'s> {
    rows: std::ops::Range<usize>,
    kv: &'s mut dyn KvStore,
    want: LogitsWanted,
    head_rows: Option<&'s [u32]>,
    logits: &'s mut Vec<f32>,
    /// Where in `logits` this pass's rows go (what it held before is kept).
    logits_from: usize,
}

/// A layer's new rows of a batched decode step, every sequence's side by side
/// (`[rows, kv_dim]` for K before and after RoPE and V, `[rows, q_dim]` for the
/// queries), q and K not yet rotated: each sequence's chunk rotates its own rows with
/// the pass's `cos`/`sin` rows (`[rows, head_dim / 2]` each).
struct NewRows<'a> {
    k_raw: &'a [f32],
    k: Disjoint<'a, f32>,
    v: &'a [f32],
    q: Disjoint<'a, f32>,
    cos: &'a [f32],
    sin: &'a [f32],
}

/// `gate[i] = act(gate[i]) · up[i]` (SwiGLU's `silu`, GeGLU's tanh GELU) over `[n, ff]`
/// rows, and with `quantize` each row then quantized for the `down_proj` products of
/// that type into the buffers `ProductScratch::prepare` gave (read by
/// `SharedActs::continuing`). A many-token input is split by token rows between the
/// threads; each element is the same scalar function whichever thread computes it,
/// and each quantized row a function of its row alone, so the bits do not depend on
/// the thread count. (Serial, this was ~6% of a 2-thread prefill.)
///
/// # Errors
/// [`ModelError::Unsupported`] when a row cannot be quantized for that type.
fn gated_activation(
    act: Activation,
    (gate, up): (&mut [f32], &[f32]),
    ff: usize,
    quantize: Option<(QType, &mut [QuantizedActs])>,
    th: Threads,
) -> Result<(), ModelError> {
    let apply = |g: &mut [f32], u: &[f32]| match act {
        Activation::Silu => fak_tensor::exp::silu_mul_in_place(g, u),
        Activation::GeluTanh => fak_tensor::tanh::gelu_tanh_mul_in_place(g, u),
    };
    let n = gate.len() / ff.max(1);
    let (ty, acts) = match quantize {
        Some((ty, a)) => (Some(ty), a),
        None => (None, &mut [][..]),
    };
    let all_g = Disjoint::new(gate);
    // Tokens per part: from 16, a few parts per thread of at least 8 tokens.
    rows_in_parts(n, th, 8, acts, &|r, a| {
        // SAFETY: `rows_in_parts` gives each part of rows `r` to one call, the parts
        // disjoint.
        let g = unsafe { all_g.part(r.start * ff..r.end * ff) };
        apply(g, &up[r.start * ff..r.end * ff]);
        match ty {
            Some(ty) => g
                .chunks_exact(ff)
                .zip(a)
                .try_for_each(|(row, a)| quantize_activation_into(ty, row, a)),
            None => Ok(()),
        }
    })
    .map_err(|e| ModelError::Unsupported(format!("quantizing down_proj's input: {e}")))
}

impl Model {
    /// Runs `f` as the step `op` of a pass: its wall time goes to the model's profile
    /// when that is enabled.
    #[inline]
    fn timed<T>(&self, op: Op, f: impl FnOnce() -> T) -> T {
        let start = self.profile.start();
        let r = f();
        self.profile.stop(op, start);
        r
    }

    /// [`Model::forward_into`] of a decode step whose output head computes only the
    /// rows `rows` of the last token's logits: `logits` becomes `[vocab]` with each row
    /// in `rows` the same bits as [`Model::forward_into`] with [`LogitsWanted::Last`]
    /// gives (one dot product per row with the full head's kernel) and every other row
    /// `-inf`, as a constrained-decoding mask would leave it (see fak-kv's `grammar`).
    /// Everything before the head, and so the K/V rows appended to `kv`, is the same
    /// pass. A step whose mask allows few tokens (a grammar's reachable rows) saves most
    /// of the head's product; [`Model::head_rows_pay`] says when it is faster.
    ///
    /// # Errors
    /// As [`Model::forward_into`], and [`ModelError::InvalidInput`] for a row not below
    /// the vocabulary size (found before anything changes).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_rows_into(
        &self,
        ids: &[u32],
        positions: &[u32],
        kv: &mut dyn KvStore,
        rows: &[u32],
        scratch: &mut ForwardScratch,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let want = LogitsWanted::Last;
        let r = self.forward_in(ids, positions, kv, want, Some(rows), None, scratch, logits);
        if ids.len() > 1 {
            *scratch = ForwardScratch::new();
        }
        r
    }

    /// Runs the new tokens `ids` at absolute positions `positions` through the model,
    /// attending to everything already in `kv` and appending the new K/V rows to it.
    ///
    /// Returns logits as chosen by `want`: `[rows, vocab]` row-major (`rows` = 0, 1 or
    /// `ids.len()`). Fills `trace` when given. More tokens than
    /// [`Model::prefill_chunk`] run as consecutive batches of that many (one batch when
    /// `trace` is given), the bits of one batch; the whole input is checked before any
    /// batch runs.
    ///
    /// # Errors
    /// [`ModelError::InvalidInput`] for an empty batch, mismatched lengths or positions
    /// that do not strictly increase past the cache's last position;
    /// [`ModelError::TokenOutOfRange`]; [`ModelError::ContextOverflow`] when a position
    /// would reach the context length or the entries would exceed the cache's capacity;
    /// [`ModelError::RopeRegimeChange`] when a longrope model's sequence would cross its
    /// original context length with entries cached below it ([`Model::rope_regime`]: the
    /// pass's RoPE table is chosen by its largest position, as HF's is per call).
    /// These are found before anything changes, so `kv` is then unchanged. A product's
    /// own [`ModelError::Unsupported`] (shapes and types are checked at load, so no input
    /// reaches one) could leave part of the pass appended; `fak_kv::Session` rolls its
    /// cache back on any error.
    pub fn forward(
        &self,
        ids: &[u32],
        positions: &[u32],
        kv: &mut dyn KvStore,
        want: LogitsWanted,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut logits = Vec::new();
        let mut scratch = ForwardScratch::new();
        self.forward_into(ids, positions, kv, want, trace, &mut scratch, &mut logits)?;
        Ok(logits)
    }

    /// [`Model::forward`] working in the caller's `scratch` and writing the logits into
    /// `logits` (resized to `[rows, vocab]`; emptied for [`LogitsWanted::None`]), the same
    /// bits. With a scratch kept between steps and a `logits` buffer that already holds
    /// a vocabulary row, a decode step (one token, `trace` `None`) allocates nothing:
    /// a test counts the heap allocations of such steps and asserts there are none.
    ///
    /// # Errors
    /// As [`Model::forward`] (a refused input leaves `kv` unchanged); on error `logits`
    /// is unspecified.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_into(
        &self,
        ids: &[u32],
        positions: &[u32],
        kv: &mut dyn KvStore,
        want: LogitsWanted,
        trace: Option<&mut ForwardTrace>,
        scratch: &mut ForwardScratch,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let r = self.forward_in(ids, positions, kv, want, None, trace, scratch, logits);
        if ids.len() > 1 {
            // A prefill's buffers are released rather than kept for the conversation.
            *scratch = ForwardScratch::new();
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_in(
        &self,
        ids: &[u32],
        positions: &[u32],
        kv: &mut dyn KvStore,
        want: LogitsWanted,
        head_rows: Option<&[u32]>,
        trace: Option<&mut ForwardTrace>,
        scratch: &mut ForwardScratch,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let regime = self.check_pass(ids, positions, &*kv, head_rows)?;
        let (c, n) = (&self.config, ids.len());
        logits.clear();
        let chunk = self.prefill_chunk;
        if trace.is_some() || n <= chunk {
            return self.run_batch(
                ids, positions, regime, kv, want, head_rows, trace, scratch, logits,
            );
        }
        // Validated as a whole above, so no batch is refused part way through.
        if want == LogitsWanted::All {
            logits.reserve(n * c.vocab_size);
        }
        let mut at = 0;
        while at < n {
            let end = (at + chunk).min(n);
            let part = match want {
                LogitsWanted::All => LogitsWanted::All,
                LogitsWanted::Last if end == n => LogitsWanted::Last,
                _ => LogitsWanted::None,
            };
            let (ids, positions) = (&ids[at..end], &positions[at..end]);
            let rows = head_rows.filter(|_| end == n);
            self.run_batch(
                ids, positions, regime, kv, part, rows, None, scratch, logits,
            )?;
            at = end;
        }
        Ok(())
    }

    /// [`Model::forward`]'s checks of a pass before anything changes, and the RoPE
    /// table it uses: a non-empty batch with one position per id, ids and `head_rows`
    /// in the vocabulary, positions strictly increasing past the cache's last, within
    /// the context length and the cache's capacity, and (for a longrope model) on the
    /// same side of the original context as the cached entries.
    fn check_pass(
        &self,
        ids: &[u32],
        positions: &[u32],
        kv: &dyn KvStore,
        head_rows: Option<&[u32]>,
    ) -> Result<RopeRegime, ModelError> {
        let c = &self.config;
        let n = ids.len();
        if n == 0 {
            return Err(ModelError::InvalidInput("no tokens to run".into()));
        }
        if positions.len() != n {
            return Err(ModelError::InvalidInput(format!(
                "{} token ids but {} positions",
                n,
                positions.len()
            )));
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(ModelError::TokenOutOfRange {
                id,
                vocab: c.vocab_size,
            });
        }
        if let Some(&r) = head_rows.and_then(|r| r.iter().find(|&&r| r as usize >= c.vocab_size)) {
            return Err(ModelError::InvalidInput(format!(
                "logits row {r} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let mut prev = kv.positions().last().map(|&p| p as i64).unwrap_or(-1);
        for &p in positions {
            if p as i64 <= prev {
                return Err(ModelError::InvalidInput(format!(
                    "position {p} does not follow position {prev}"
                )));
            }
            prev = p as i64;
        }
        // Positions are bounded by the context length, entries by the cache's capacity
        // (in bounded mode old entries are dropped, so positions may outrun entries).
        let last_pos = prev as usize + 1;
        if last_pos > c.max_position_embeddings {
            return Err(ModelError::ContextOverflow {
                needed: last_pos,
                limit: c.max_position_embeddings,
            });
        }
        if kv.len() + n > kv.capacity_tokens() {
            return Err(ModelError::ContextOverflow {
                needed: kv.len() + n,
                limit: kv.capacity_tokens(),
            });
        }
        // One RoPE table for the whole pass, chosen by the sequence's end; cached entries
        // computed with the other table would have to be computed again.
        let regime = self.rope_regime(last_pos);
        if let Some(&p) = kv.positions().last() {
            if self.rope_regime(p as usize + 1) != regime {
                let original = self.rope_long.as_ref().map_or(0, |(o, _)| *o);
                return Err(ModelError::RopeRegimeChange {
                    needed: last_pos,
                    original,
                });
            }
        }
        Ok(regime)
    }

    /// Runs several sequences' new tokens through the model in one pass over the
    /// weights: every sequence's rows go through each matrix product together (a decode
    /// step of B sequences reads each weight once, not B times), while each attends to
    /// its own cache only (its own length, positions and windows) and gets its own
    /// logits. This is continuous batching's step; prefill chunks and decode tokens may
    /// share it.
    ///
    /// Batch invariance: each sequence's logits and appended K/V rows are bit-identical
    /// to [`Model::forward_into`] of that sequence alone, whatever else shares the batch
    /// (any sizes, lengths, windows), on both weight paths and for any thread count.
    /// Each row's products reduce in a fixed order that does not depend on the number
    /// of rows (the same property that makes a decode step equal a prefill), attention
    /// runs per sequence with the same kernels, and the norms and activations are per
    /// row. The test `batch::batched_steps_equal_solo_runs` asserts it.
    ///
    /// Sequences run in passes of at most [`Model::prefill_chunk`] rows in all, grouped
    /// in order; a sequence of more rows runs alone in batches of that many. A
    /// longrope model's sequences on either side of the original context run in
    /// separate passes (each pass has one RoPE table).
    ///
    /// Returns one result per sequence, in order.
    ///
    /// # Errors
    /// Per sequence, as [`Model::forward_into`]: a refused input (found before anything
    /// runs) leaves that sequence's cache unchanged and the others run. A product's own
    /// [`ModelError::Unsupported`] fails every sequence of its pass.
    pub fn forward_batch(
        &self,
        seqs: &mut [BatchSeq<'_>],
        scratch: &mut ForwardScratch,
    ) -> Vec<Result<(), ModelError>> {
        let mut results: Vec<Result<(), ModelError>> = Vec::with_capacity(seqs.len());
        let mut regimes = Vec::with_capacity(seqs.len());
        let chunk = self.prefill_chunk.max(1);
        let vocab = self.config.vocab_size;
        for s in seqs.iter_mut() {
            let r = self.check_pass(s.ids, s.positions, &*s.kv, s.head_rows);
            // A decode token's logits overwrite the buffer in place when it already
            // holds one row (a session's spare row holds its previous step's): clearing
            // it would have it zeroed again first, 8 × 192 KB a step for SmolLM2's eight
            // streams.
            let in_place = r.is_ok()
                && s.want == LogitsWanted::Last
                && s.head_rows.is_none()
                && s.ids.len() <= chunk
                && s.logits.len() == vocab;
            if !in_place {
                s.logits.clear();
            }
            regimes.push(r.as_ref().ok().copied());
            results.push(r.map(|_| ()));
        }
        // Groups in order: consecutive valid sequences of one RoPE regime whose rows
        // fit in one pass; a sequence longer than a pass runs alone.
        let mut group: Vec<usize> = Vec::new();
        let (mut rows, mut regime) = (0, RopeRegime::Short);
        for j in 0..seqs.len() {
            let Some(r) = regimes[j] else { continue };
            let n = seqs[j].ids.len();
            if n > chunk {
                let s = &mut seqs[j];
                results[j] = self.forward_in(
                    s.ids,
                    s.positions,
                    &mut *s.kv,
                    s.want,
                    s.head_rows,
                    None,
                    scratch,
                    s.logits,
                );
                continue;
            }
            if !group.is_empty() && (r != regime || rows + n > chunk) {
                self.run_group(seqs, &group, regime, scratch, &mut results);
                group.clear();
                rows = 0;
            }
            group.push(j);
            rows += n;
            regime = r;
        }
        if !group.is_empty() {
            self.run_group(seqs, &group, regime, scratch, &mut results);
        }
        // A batch of many rows releases its buffers as a prefill does; decode steps
        // of a few sequences keep them.
        if seqs.iter().map(|s| s.ids.len()).sum::<usize>() > KEEP_SCRATCH_ROWS {
            *scratch = ForwardScratch::new();
        }
        results
    }

    /// One pass of [`Model::forward_batch`] over the sequences `group` of `seqs`
    /// (validated, of one RoPE regime, at most a pass's rows in all).
    fn run_group(
        &self,
        seqs: &mut [BatchSeq<'_>],
        group: &[usize],
        regime: RopeRegime,
        scratch: &mut ForwardScratch,
        results: &mut [Result<(), ModelError>],
    ) {
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut segs = Vec::with_capacity(group.len());
        let mut g = 0;
        for (i, s) in seqs.iter_mut().enumerate() {
            if group.get(g) != Some(&i) {
                continue;
            }
            g += 1;
            let at = ids.len();
            ids.extend_from_slice(s.ids);
            positions.extend_from_slice(s.positions);
            segs.push(Seg {
                rows: at..ids.len(),
                kv: &mut *s.kv,
                want: s.want,
                head_rows: s.head_rows,
                logits: &mut *s.logits,
                logits_from: 0,
            });
        }
        if let Err(e) = self.run_segments(&ids, &positions, regime, &mut segs, None, scratch) {
            let msg = e.to_string();
            for &g in group {
                results[g] = Err(ModelError::Unsupported(msg.clone()));
            }
        }
    }

    /// [`Model::forward_in`]'s pass over one batch of already validated tokens of one
    /// sequence, appending the logits `want` asks for to `logits`.
    #[allow(clippy::too_many_arguments)]
    fn run_batch(
        &self,
        ids: &[u32],
        positions: &[u32],
        regime: RopeRegime,
        kv: &mut dyn KvStore,
        want: LogitsWanted,
        head_rows: Option<&[u32]>,
        trace: Option<&mut ForwardTrace>,
        scratch: &mut ForwardScratch,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let logits_from = logits.len();
        let mut segs = [Seg {
            rows: 0..ids.len(),
            kv,
            want,
            head_rows,
            logits,
            logits_from,
        }];
        self.run_segments(ids, positions, regime, &mut segs, trace, scratch)
    }

    /// The pass over the concatenated rows `ids` of one or more sequences (`segs`, each
    /// with its rows, cache and logits): the embedding, then per layer the attention
    /// block (attention per sequence) and the MLP block, the final norm and the head,
    /// each sequence's logits appended to its own buffer. `trace` only with one
    /// sequence.
    fn run_segments(
        &self,
        ids: &[u32],
        positions: &[u32],
        regime: RopeRegime,
        segs: &mut [Seg<'_>],
        mut trace: Option<&mut ForwardTrace>,
        scratch: &mut ForwardScratch,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let n = ids.len();
        scratch.size_for(n, c);
        scratch.products.start_pass();
        self.timed(Op::Embedding, || self.embed(ids, &mut scratch.x))?;
        if let Some(t) = trace.as_deref_mut() {
            t.embed = scratch.x.clone();
            t.layers.clear();
        }

        for s in segs.iter_mut() {
            s.kv.append_positions(&positions[s.rows.clone()]);
        }
        // The tokens' RoPE rows per distinct table (keyed by the first layer that uses
        // it): layers with equal tables share them (Gemma 3 has two, the Llamas one).
        scratch.rope_used = 0;
        // A sublayer's output waits in `scratch.proj` to be added to the residual stream
        // by the next sublayer's first step (with its norm and quantization, one
        // hand-off; [`Model::residual_then_norm`]).
        let mut pending = None;
        for (l, w) in self.layers.iter().enumerate() {
            let rope = self.timed(Op::Rope, || self.rope_rows(l, positions, regime, scratch));
            pending =
                Some(self.attention_block(l, w, (rope, regime), segs, (n, pending), scratch)?);
            pending = Some(self.mlp_block(w, (n, pending), scratch)?);
            if let Some(t) = trace.as_deref_mut() {
                self.residual_then_norm(pending.take(), None, None, n, scratch)?;
                t.layers.push(scratch.x.clone());
            }
        }

        if segs.iter().all(|s| s.want == LogitsWanted::None) && trace.is_none() {
            return Ok(());
        }
        self.residual_then_norm(pending, Some(Some(&self.norm)), None, n, scratch)?;
        let ForwardScratch {
            xn,
            proj,
            batch_logits,
            products,
            ..
        } = scratch;
        if let Some(t) = trace {
            t.final_norm = xn.clone();
        }
        let h = c.hidden_size;
        if let [s] = segs {
            let rows = &xn[s.rows.start * h..s.rows.end * h];
            return self.timed(Op::Head, || {
                self.head_into(
                    rows,
                    (s.want, s.head_rows),
                    (s.logits, s.logits_from),
                    products,
                )
            });
        }
        // Several sequences: the rows they want of the full head in one product (each
        // row's bits are those of a product of that row alone), written straight into
        // their logits; then one row each for those that want only some of the head's
        // rows.
        let v = c.vocab_size;
        let th = self.threads;
        self.timed(Op::Head, || {
            let mut gathered = 0;
            let mut outs: Vec<&mut [f32]> = Vec::new();
            for s in segs.iter_mut().filter(|s| s.head_rows.is_none()) {
                let take = match s.want {
                    LogitsWanted::None => continue,
                    LogitsWanted::Last => s.rows.end - 1..s.rows.end,
                    LogitsWanted::All => s.rows.clone(),
                };
                let len = take.len() * h;
                proj[gathered..gathered + len].copy_from_slice(&xn[take.start * h..take.end * h]);
                gathered += len;
                let (from, end) = (s.logits_from, s.logits_from + take.len() * v);
                if s.logits.len() < end {
                    s.logits.resize(end, 0.0);
                }
                s.logits.truncate(end);
                outs.extend(s.logits[from..].chunks_exact_mut(v));
            }
            if !outs.is_empty() {
                let rows = &proj[..gathered];
                linear_into_slices(
                    self.head(),
                    v,
                    h,
                    rows,
                    &mut outs,
                    th,
                    products,
                    batch_logits,
                )?;
            }
            drop(outs);
            for s in segs.iter_mut().filter(|s| s.head_rows.is_some()) {
                let take = match s.want {
                    LogitsWanted::None => continue,
                    LogitsWanted::Last => s.rows.end - 1..s.rows.end,
                    LogitsWanted::All => s.rows.clone(),
                };
                let rows = &xn[take.start * h..take.end * h];
                let into = (&mut *s.logits, s.logits_from);
                self.head_into(rows, (LogitsWanted::Last, s.head_rows), into, products)?;
            }
            Ok(())
        })
    }

    /// `embed_tokens`' rows of `ids` into `x` (`[n, hidden]`), each times the family's
    /// embedding scale if it has one (Gemma's `sqrt(hidden)`).
    fn embed(&self, ids: &[u32], x: &mut [f32]) -> Result<(), ModelError> {
        let c = &self.config;
        let h = c.hidden_size;
        for (row, &id) in x.chunks_exact_mut(h).zip(ids) {
            match &self.embed_tokens {
                Weight::Quant(e) => e.dequantize_row(id as usize, row)?,
                Weight::Mapped(e) => e.copy_row(id as usize, row)?,
                Weight::MappedF16(e) => e.copy_row(id as usize, row)?,
                Weight::Dense(embed_tokens) => {
                    row.copy_from_slice(&embed_tokens[id as usize * h..(id as usize + 1) * h])
                }
            }
            if let Some(s) = c.embedding_scale {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        Ok(())
    }

    /// The index in `scratch`'s RoPE rows of layer `l`'s cos and sin rows in `regime`
    /// for the tokens at `positions` (`[n, head_dim / 2]` each): those of an earlier layer of
    /// this pass with an equal table, else computed into the next kept buffer.
    fn rope_rows(
        &self,
        l: usize,
        positions: &[u32],
        regime: RopeRegime,
        scratch: &mut ForwardScratch,
    ) -> usize {
        let ForwardScratch {
            rope: rope_rows,
            rope_used,
            ..
        } = scratch;
        let n = positions.len();
        let half = self.config.head_dim / 2;
        match rope_rows[..*rope_used]
            .iter()
            .position(|r| self.rope_table(r.0, regime) == self.rope_table(l, regime))
        {
            Some(i) => i,
            None => {
                if rope_rows.len() == *rope_used {
                    rope_rows.push((l, Vec::new(), Vec::new()));
                }
                let (first, cos, sin) = &mut rope_rows[*rope_used];
                *first = l;
                cos.resize(n * half, 0.0);
                sin.resize(n * half, 0.0);
                for (t, &p) in positions.iter().enumerate() {
                    self.rope_table(l, regime).cos_sin(
                        p,
                        &mut cos[t * half..(t + 1) * half],
                        &mut sin[t * half..(t + 1) * half],
                    );
                }
                *rope_used += 1;
                *rope_used - 1
            }
        }
    }

    /// Layer `l`'s self-attention block over the residual stream `scratch.x`
    /// (`[n, hidden]`), HF's `input_layernorm` → `self_attn`: first the previous
    /// sublayer's output added (`pending`, [`Model::residual_then_norm`], with the
    /// input norm and the quantization of its rows), then the q/k/v products
    /// ([`Model::qkv`]), RoPE with the rows at `rope` in `scratch` (K kept unrotated
    /// too), each sequence's K/V rows appended to its cache and its attention over it
    /// ([`Model::attention`]; a batched step's decode tokens in one hand-off,
    /// [`Model::decode_attention_batch`]), `o_proj` over all rows into `scratch.proj`.
    /// Returns the gain of the norm `o_proj`'s output gets before it is added to the
    /// residual stream by the next sublayer (Gemma's `post_attention_layernorm`; `None`
    /// without one).
    fn attention_block<'w>(
        &self,
        l: usize,
        w: &'w LayerWeights,
        (rope, regime): (usize, RopeRegime),
        segs: &mut [Seg<'_>],
        (n, pending): (usize, Option<Option<&[f32]>>),
        scratch: &mut ForwardScratch,
    ) -> Result<Option<&'w [f32]>, ModelError> {
        let c = &self.config;
        let h = c.hidden_size;
        let th = self.threads;
        let input = Some(w.input_norm.as_deref());
        self.residual_then_norm(pending, input, w.q_proj.quant().map(|q| q.ty), n, scratch)?;
        // A decode token's K, pre-RoPE K and V rows go to memory last written a step
        // ago, out of the cache by now: their lines are fetched for writing while the
        // products run, or the appends below wait for them line by line (SmolLM2, 8
        // streams on the Zen 4: the appends 0.81–0.95 → 0.62–0.64 ms a step).
        for s in segs.iter().filter(|s| s.rows.len() == 1) {
            s.kv.prefetch_append(l, 1);
        }
        self.qkv(w, n, scratch)?;
        // Several sequences' decode tokens: each one's q and K rows rotated, its rows
        // appended, its attention and (when every row of the pass is such a token) its
        // output quantized for `o_proj`, in one hand-off, a sequence per chunk; the
        // rest (a prefill, a lone decode token) rotated and appended here and attended
        // one sequence at a time.
        let decoding = segs.iter().filter(|s| s.rows.len() == 1).count();
        let batched = |rows: &std::ops::Range<usize>| decoding > 1 && rows.len() == 1;
        self.timed(Op::Rope, || {
            let here = segs
                .iter()
                .filter(|s| !batched(&s.rows))
                .map(|s| s.rows.clone());
            self.rope_qk(rope, here, scratch)
        });
        let ForwardScratch {
            q,
            k,
            k_raw,
            v,
            attn,
            proj,
            scores,
            key_tiles,
            batch_scores,
            products,
            rope: rope_rows,
            ..
        } = scratch;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        for s in segs
            .iter_mut()
            .filter(|s| decoding <= 1 || s.rows.len() > 1)
        {
            let kr = s.rows.start * kvd..s.rows.end * kvd;
            self.timed(Op::KvAppend, || {
                s.kv.append_layer(l, &k_raw[kr.clone()], &k[kr.clone()], &v[kr.clone()])
            });
        }
        self.timed(Op::Attention, || {
            if decoding > 1 {
                let (_, cos, sin) = &rope_rows[rope];
                let new = NewRows {
                    k_raw,
                    k: Disjoint::new(&mut k[..]),
                    v,
                    q: Disjoint::new(&mut q[..]),
                    cos,
                    sin,
                };
                // The outputs quantized for `o_proj` as they are made, when they are
                // all of the pass's rows.
                let o_ty = w.o_proj.quant().map(|q| q.ty).filter(|_| decoding == n);
                let of = &attn[..n * qd];
                let acts = o_ty.map(|ty| (ty, products.prepare(ty.act_kind(), n, of)));
                self.decode_attention_batch(
                    l,
                    regime,
                    segs,
                    new,
                    (&mut *attn, acts),
                    batch_scores,
                )?;
            }
            for s in segs.iter().filter(|s| decoding <= 1 || s.rows.len() > 1) {
                let qr = s.rows.start * qd..s.rows.end * qd;
                self.attention(
                    (l, regime),
                    &*s.kv,
                    s.rows.len(),
                    &q[qr.clone()],
                    (scores, key_tiles),
                    &mut attn[qr],
                );
            }
            Ok::<(), ModelError>(())
        })?;
        self.timed(Op::OProj, || {
            let mut x = SharedActs::continuing(attn, qd, n, th, products);
            linear_shared(&w.o_proj, h, &mut x, proj, th)
        })?;
        Ok(w.attn_out_norm.as_deref())
    }

    /// q, k and v (`[n, q_dim]`, `[n, kv_dim]`, `[n, kv_dim]`) of the normed input
    /// `scratch.xn`: the three products of one input (quantized once for the three),
    /// then Qwen2's biases and the per-head QK-norm (Qwen3, Gemma 3) where the family
    /// has them.
    fn qkv(
        &self,
        w: &LayerWeights,
        n: usize,
        scratch: &mut ForwardScratch,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let h = c.hidden_size;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let th = self.threads;
        let ForwardScratch {
            xn,
            q,
            k,
            v,
            norm,
            products,
            ..
        } = scratch;
        // q, k and v read one input: it is quantized once for the three.
        let start = self.profile.start();
        let mut xq = SharedActs::continuing(xn, h, n, th, products);
        linear_group(
            &mut [
                (&w.q_proj, qd, &mut q[..]),
                (&w.k_proj, kvd, &mut k[..]),
                (&w.v_proj, kvd, &mut v[..]),
            ],
            &mut xq,
            th,
        )?;
        if let Some((bq, bk, bv)) = &w.qkv_bias {
            for (rows, b) in [(&mut *q, bq), (&mut *k, bk), (&mut *v, bv)] {
                for row in rows.chunks_exact_mut(b.len()) {
                    add_assign(row, b);
                }
            }
        }
        self.profile.stop(Op::QkvProducts, start);
        if let Some((nq, nk)) = &w.qk_norm {
            let start = self.profile.start();
            // Each span of the gain's length: a head ([head_dim]) or a whole row.
            for (rows, g) in [(&mut *q, nq), (&mut *k, nk)] {
                norm.resize(g.len(), 0.0);
                for head in rows.chunks_exact_mut(g.len()) {
                    rms_norm(head, g, c.norm_weight_offset, c.rms_norm_eps, norm);
                    head.copy_from_slice(norm);
                }
            }
            self.profile.stop(Op::Norm, start);
        }
        Ok(())
    }

    /// RoPE (rotate-half) of every head of the token rows `rows` of `scratch.q` and
    /// `scratch.k` with the cos and sin rows at `rope` in `scratch`, after the unrotated
    /// k is kept in `scratch.k_raw` (the cache stores both; every row's is kept, rotated
    /// here or not).
    fn rope_qk(
        &self,
        rope: usize,
        rows: impl Iterator<Item = std::ops::Range<usize>>,
        scratch: &mut ForwardScratch,
    ) {
        let c = &self.config;
        let hd = c.head_dim;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let half = hd / 2;
        let ForwardScratch {
            q,
            k,
            k_raw,
            rope: rope_rows,
            ..
        } = scratch;
        let (_, cos, sin) = &rope_rows[rope];
        k_raw.clear();
        k_raw.extend_from_slice(k);
        for t in rows.flatten() {
            let (cs, sn) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            for head in q[t * qd..(t + 1) * qd].chunks_exact_mut(hd) {
                rope_rotate_half(head, cs, sn);
            }
            for head in k[t * kvd..(t + 1) * kvd].chunks_exact_mut(hd) {
                rope_rotate_half(head, cs, sn);
            }
        }
    }

    /// Attention of the batch's `n` queries `q` (`[n, q_dim]`, RoPE applied) over layer
    /// `l`'s cache in `kv` (the batch's rows already appended, the layer's sliding window
    /// applied) into `attn` (`[n, q_dim]`): a decode step's by GQA group
    /// ([`decode_attention`], `scores` its scratch), a prefill's by token block and
    /// query head ([`prefill_attention`], `tiles` its keys' scratch), the same bits
    /// either way. A prefill over a compact cache widens the rows its tokens see once,
    /// into `scores`, and reads them in place ([`KvRows::widen_into`]: the values
    /// reading through the pieces gives).
    fn attention(
        &self,
        (l, regime): (usize, RopeRegime),
        kv: &dyn KvStore,
        n: usize,
        q: &[f32],
        (scores, tiles): (&mut Vec<f32>, &mut Vec<f32>),
        attn: &mut [f32],
    ) {
        let c = &self.config;
        let th = self.threads;
        let pos = kv.positions();
        let table = self.read_rope_for(l, regime, kv);
        let keys = self.keys_at_read(kv.keys(l), table.as_deref(), pos);
        let vals = kv.values(l);
        let m = pos.len();
        let window = c.sliding_window[l];
        let shape = AttentionShape::of(c);
        if n == 1 {
            let first = window_start(pos, m - 1, window);
            decode_attention(shape, q, keys, vals, first, m, scores, attn, th);
        } else if keys.kv_type() == KvType::F32 && vals.kv_type() == KvType::F32 {
            let by = Scores::for_cpu();
            prefill_attention(shape, q, keys, vals, pos, window, n, attn, tiles, th, by);
        } else {
            // A compact cache: the entries the new tokens see (from the first one's
            // window start), widened once into `scores` (the prefill does not need it
            // for scores) and read in place, the same values `for_cols` would give.
            let lo = window_start(pos, m - n, window);
            let kvd = c.kv_dim();
            let rows = m - lo;
            scores.clear();
            scores.resize(2 * rows * kvd, 0.0);
            let (kw, vw) = scores.split_at_mut(rows * kvd);
            widen_in_parts(keys, lo..m, kw, th);
            widen_in_parts(vals, lo..m, vw, th);
            let (keys, vals) = (KvRows::contiguous(kw, kvd), KvRows::contiguous(vw, kvd));
            let (pos, by) = (&pos[lo..], Scores::for_cpu());
            prefill_attention(shape, q, keys, vals, pos, window, n, attn, tiles, th, by);
        }
    }

    /// The `cos`/`sin` rows layer `l`'s keys in `kv` are rotated with as they are read,
    /// when `kv` stores them before RoPE (a compact cache); `None` for an `f32` cache.
    fn read_rope_for(
        &self,
        l: usize,
        regime: RopeRegime,
        kv: &dyn KvStore,
    ) -> Option<std::sync::Arc<CosSinRows>> {
        let last = *kv.positions().last()?;
        kv.keys(l)
            .is_pre_rope()
            .then(|| self.read_rope(l, regime, last))
    }

    /// `keys` with their rotation at read attached when they are stored before RoPE
    /// (`table` from [`Model::read_rope_for`]); `pos` the entries' positions.
    fn keys_at_read<'a>(
        &self,
        keys: KvRows<'a>,
        table: Option<&'a CosSinRows>,
        pos: &'a [u32],
    ) -> KvRows<'a> {
        match table {
            Some(t) => keys.with_rope(RopeAtRead {
                cos: &t.cos,
                sin: &t.sin,
                half: t.cos.len() / t.rows,
                head_dim: self.config.head_dim,
                positions: pos,
            }),
            None => keys,
        }
    }

    /// Layer `l`'s attention step for the one-token sequences among `segs` (decode
    /// tokens of a batched pass), each over its own cache, into its rows of `attn`: one
    /// hand-off, the sequences claimed by the threads, each sequence on one thread: its
    /// q and K rows rotated (RoPE, `rope_rotate_half` per head with its row of the
    /// pass's cos/sin), its rows appended ([`KvStore::append_layer`]), its
    /// [`decode_attention`], and with `acts` its output row quantized for `o_proj`
    /// (the buffers `ProductScratch::prepare` gave). So the appends (whose fresh memory
    /// costs page faults) run side by side too, and each sequence's new rows are still
    /// in the core's cache when its attention reads them. The bits are those of the
    /// steps one sequence at a time (each cache is its own; decode attention's bits do
    /// not depend on its thread count). `scores` holds one scratch row set per
    /// sequence.
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] when an output row cannot be quantized for that type.
    fn decode_attention_batch(
        &self,
        l: usize,
        regime: RopeRegime,
        segs: &mut [Seg<'_>],
        new: NewRows<'_>,
        (attn, acts): (&mut [f32], Option<(QType, &mut [QuantizedActs])>),
        scores: &mut Vec<Vec<f32>>,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let (qd, kvd, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let half = hd / 2;
        let shape = AttentionShape::of(c);
        let window = c.sliding_window[l];
        // The decode sequences' caches and rows, one item each.
        let mut items: Vec<(&mut dyn KvStore, usize)> = segs
            .iter_mut()
            .filter(|s| s.rows.len() == 1)
            .map(|s| (&mut *s.kv, s.rows.start))
            .collect();
        if scores.len() < items.len() {
            scores.resize_with(items.len(), Vec::new);
        }
        let n = items.len();
        let outs = Disjoint::new(attn);
        let rows = Disjoint::new(&mut scores[..n]);
        let all = Disjoint::new(&mut items[..]);
        let (o_ty, acts) = match acts {
            Some((ty, a)) => (Some(ty), a),
            None => (None, &mut [][..]),
        };
        let acts = Disjoint::new(acts);
        let error = std::sync::Mutex::new(None);
        parallel_chunks(n, self.threads, &|i| {
            // SAFETY: the pool calls each chunk index once; chunk `i` alone takes item
            // `i` (its sequence's cache) and score buffer `i`, and the sequences' rows
            // `t` of the batch (so of `q`, `k`, `attn` and the quantized outputs) are
            // disjoint.
            let ((kv, t), sc) =
                unsafe { (&mut all.part(i..i + 1)[0], &mut rows.part(i..i + 1)[0]) };
            let t = *t;
            let (kr, r) = (t * kvd..(t + 1) * kvd, t * qd..(t + 1) * qd);
            // SAFETY: as above, row `t` of `q` and `k` is this sequence's alone.
            let (q, k) = unsafe { (new.q.part(r.clone()), new.k.part(kr.clone())) };
            let (cs, sn) = (
                &new.cos[t * half..(t + 1) * half],
                &new.sin[t * half..(t + 1) * half],
            );
            for head in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
                rope_rotate_half(head, cs, sn);
            }
            kv.append_layer(l, &new.k_raw[kr.clone()], k, &new.v[kr]);
            let kv = &**kv;
            let table = self.read_rope_for(l, regime, kv);
            let pos = kv.positions();
            let m = pos.len();
            let first = window_start(pos, m - 1, window);
            let keys = self.keys_at_read(kv.keys(l), table.as_deref(), pos);
            // SAFETY: as above, rows `r` are this sequence's alone.
            let out = unsafe { outs.part(r) };
            decode_attention(
                shape,
                q,
                keys,
                kv.values(l),
                first,
                m,
                sc,
                out,
                Threads::new(1),
            );
            if let Some(ty) = o_ty {
                // SAFETY: as above, quantized row `t` is this sequence's alone.
                let a = unsafe { &mut acts.part(t..t + 1)[0] };
                if let Err(e) = quantize_activation_into(ty, out, a) {
                    *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                }
            }
        });
        match error.into_inner().unwrap_or_else(PoisonError::into_inner) {
            Some(e) => Err(ModelError::Unsupported(format!(
                "quantizing o_proj's input: {e}"
            ))),
            None => Ok(()),
        }
    }

    /// The MLP block over the residual stream `scratch.x` (`[n, hidden]`): the
    /// attention's output added (`pending`, [`Model::residual_then_norm`]) with HF's
    /// `post_attention_layernorm` (Gemma's `pre_feedforward_layernorm`) after it, then
    /// the gated MLP `down(act(gate(x)) * up(x))` (SwiGLU or GeGLU) into `scratch.proj`.
    /// Returns the gain of the norm that output gets before the next sublayer adds it
    /// (Gemma's `post_feedforward_layernorm`; `None` without one).
    fn mlp_block<'w>(
        &self,
        w: &'w LayerWeights,
        (n, pending): (usize, Option<Option<&[f32]>>),
        scratch: &mut ForwardScratch,
    ) -> Result<Option<&'w [f32]>, ModelError> {
        let c = &self.config;
        let (h, ff) = (c.hidden_size, c.intermediate_size);
        let th = self.threads;
        let gate_ty = w.gate_proj.quant().map(|q| q.ty);
        self.residual_then_norm(pending, Some(w.mlp_norm.as_deref()), gate_ty, n, scratch)?;
        let ForwardScratch {
            xn,
            proj,
            gate,
            up,
            products,
            ..
        } = scratch;
        self.timed(Op::GateUpProducts, || {
            // gate and up read one input: it is quantized once for the two (as the
            // norm before made it, where it did).
            let mut xq = SharedActs::continuing(xn, h, n, th, products);
            linear_group(
                &mut [
                    (&w.gate_proj, ff, &mut gate[..]),
                    (&w.up_proj, ff, &mut up[..]),
                ],
                &mut xq,
                th,
            )
        })?;
        self.timed(Op::Activation, || {
            let down = w.down_proj.quant().map(|q| q.ty);
            let of = &gate[..n * ff];
            let quantize = down.map(|ty| (ty, products.prepare(ty.act_kind(), n, of)));
            let rows = (&mut gate[..n * ff], &up[..n * ff]);
            gated_activation(c.hidden_act, rows, ff, quantize, th)
        })?;
        self.timed(Op::DownProj, || {
            let mut x = SharedActs::continuing(gate, ff, n, th, products);
            linear_shared(&w.down_proj, h, &mut x, proj, th)
        })?;
        Ok(w.mlp_out_norm.as_deref())
    }

    /// The first step of a sublayer, for each of the `n` rows of the residual stream
    /// `scratch.x` on its own: a waiting sublayer output added (`pending`: `Some(g)`
    /// when `scratch.proj` holds one, `g` the gain of the RMSNorm it gets first, Gemma's
    /// `post_attention_layernorm` / `post_feedforward_layernorm`), then `pre` (when
    /// `Some`): `scratch.xn` = the RMSNorm of the row with gain `g` (HF's
    /// `input_layernorm`, the norm before the MLP, the final `norm`), or the row itself
    /// for `None`, and, with `quantize_for`, that row quantized for the products of that
    /// weight type (`ProductScratch::prepare`, read by `SharedActs::continuing`).
    /// One hand-off, the rows split between the threads from [`FEW_ROWS_SPLIT`] rows on
    /// ([`rows_per_part`]); every value is the function of its own row that the steps
    /// one at a time give (the norms' and the add's order within a row), so the same
    /// bits on any thread count.
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] when a row cannot be quantized for that type.
    fn residual_then_norm(
        &self,
        pending: Option<Option<&[f32]>>,
        pre: Option<Option<&[f32]>>,
        quantize_for: Option<QType>,
        n: usize,
        scratch: &mut ForwardScratch,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let h = c.hidden_size;
        let (offset, eps) = (c.norm_weight_offset, c.rms_norm_eps);
        let ForwardScratch {
            x,
            xn,
            proj,
            products,
            ..
        } = scratch;
        let (x, xn, proj) = (&mut x[..n * h], &mut xn[..n * h], &proj[..n * h]);
        let quantize_for = quantize_for.filter(|_| pre.is_some());
        let acts = match quantize_for {
            Some(ty) => products.prepare(ty.act_kind(), n, xn),
            None => &mut [],
        };
        let (ax, axn) = (Disjoint::new(x), Disjoint::new(xn));
        let rows = |r: std::ops::Range<usize>, acts: &mut [QuantizedActs]| {
            // SAFETY: `rows_in_parts` gives each part of rows `r` to one call, the parts
            // disjoint.
            let (x, xn) = unsafe {
                (
                    ax.part(r.start * h..r.end * h),
                    axn.part(r.start * h..r.end * h),
                )
            };
            for (i, t) in r.enumerate() {
                let (xt, xnt) = (&mut x[i * h..(i + 1) * h], &mut xn[i * h..(i + 1) * h]);
                if let Some(post) = pending {
                    let pt = &proj[t * h..(t + 1) * h];
                    match post {
                        // The output normed into `xn` (free until the pre-norm below).
                        Some(g) => {
                            rms_norm(pt, g, offset, eps, xnt);
                            add_assign(xt, xnt);
                        }
                        None => add_assign(xt, pt),
                    }
                }
                match pre {
                    Some(Some(g)) => rms_norm(xt, g, offset, eps, xnt),
                    Some(None) => xnt.copy_from_slice(xt),
                    None => {}
                }
                if let (Some(ty), Some(a)) = (quantize_for, acts.get_mut(i)) {
                    quantize_activation_into(ty, xnt, a)?;
                }
            }
            Ok(())
        };
        self.timed(Op::Norm, || rows_in_parts(n, self.threads, 1, acts, &rows))
            .map_err(|e| ModelError::Unsupported(format!("quantizing a product's input: {e}")))
    }
}

/// [`KvRows::widen_into`] of entries `range` into `out` (`[range.len(), kv_dim]`), the
/// entries split in consecutive parts among the threads (each entry's values do not
/// depend on who widens it).
fn widen_in_parts(rows: KvRows<'_>, range: std::ops::Range<usize>, out: &mut [f32], th: Threads) {
    let (kvd, n) = (rows.kv_dim(), range.len());
    let parts = th.get().max(1).min(n.max(1));
    let all = Disjoint::new(&mut out[..n * kvd]);
    parallel_chunks(parts, th, &|c| {
        let r = part_range(n, parts, c);
        // SAFETY: chunk `c` alone takes entries `r` (the chunks' ranges are disjoint),
        // whose rows are one consecutive part of `out`.
        let o = unsafe { all.part(r.start * kvd..r.end * kvd) };
        rows.widen_into(range.start + r.start..range.start + r.end, o);
    });
}
