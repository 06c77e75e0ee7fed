//! The decoder-only transformer: weights per layer and the forward pass (exact path).
//!
//! Mirrors HF's `modeling_llama.py` top to bottom: `embed_tokens` → for each
//! `LlamaDecoderLayer`: `input_layernorm` → self-attention (q/k/v projections, RoPE,
//! GQA with a causal mask, `o_proj`) → residual add → `post_attention_layernorm` →
//! SwiGLU MLP (`down(silu(gate(x)) * up(x))`) → residual add; then `norm` and `lm_head`.
//! All math is `f32` with the fixed reduction order of fak-tensor, so a token's output
//! does not depend on how many tokens share its forward pass or on the thread count.

use crate::attention::{decode_attention, DecodeShape};
use crate::kv::{window_start, KvStore};
use crate::source::{MappedF32, QuantMatrix, WeightSource};
use crate::{Activation, Config, ModelError};
use fak_tensor::pool::Disjoint;
use fak_tensor::quant::{
    matmul_threads, matvec_many, matvec_threads, quantize_activation_into, vec_dot, ActKind,
    Matvec, QType, QuantError, QuantizedActs,
};
use fak_tensor::{
    add_assign, dot, dot_strided, dot_strided_multi, matmul, matmul_group, parallel_chunks,
    rms_norm, rope_rotate_half, softmax_in_place, softmax_rows_in_place, weighted_rows_accumulate,
    Linear, RopeTable, Threads,
};
use std::path::Path;

/// RMSNorm of every `[h]` row of `rows`, in place (`tmp` is scratch, resized to `h`).
fn norm_rows(rows: &mut [f32], g: &[f32], c: &Config, h: usize, tmp: &mut Vec<f32>) {
    tmp.resize(h, 0.0);
    for row in rows.chunks_exact_mut(h) {
        rms_norm(row, g, c.norm_weight_offset, c.rms_norm_eps, tmp);
        row.copy_from_slice(tmp);
    }
}

/// How a model keeps its large matrices, chosen at load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WeightMode {
    /// Every weight dequantized or widened to `f32` at load; activations `f32`. The
    /// path proven against HF (`docs/design.md`, numerics contract).
    #[default]
    Exact,
    /// The fast path: the linear layers' matrices (attention q/k/v/o, MLP
    /// gate/up/down, the output head or tied embedding) stay in their GGUF block format
    /// inside the memory map when their type has a quantized dot product
    /// (`fak_tensor::quant::QType`); each product quantizes its input row once
    /// (Q8_0, Q8_1 or Q8_K, as the weight type pairs with) and runs the quantized
    /// matvec. Embedding rows are dequantized on lookup. A GGUF's F32 matrices are read
    /// in place from the memory map too ([`MappedF32`], no copy; a `llama` file's Q/K
    /// row order undone on each product's output) and run the exact path's `f32`
    /// kernels, so they give the exact path's bits; F32 data that cannot be borrowed
    /// (not 4-byte aligned, a big-endian host) is copied as in exact mode. Norms,
    /// biases and matrices of other types (F16 and BF16, which need widening, block
    /// types without a kernel, anything from safetensors) are `f32` copies. Every
    /// token goes through the same per-row kernels whether it is in a prefill or a
    /// decode step, and the thread split never touches a reduction, so decode ==
    /// prefill and thread-count independence still hold bit for bit; against
    /// [`WeightMode::Exact`] the logits differ by the activation rounding of the
    /// quantized products (measured in `tests/native.rs`).
    Native,
}

impl WeightMode {
    /// `"exact"` or `"native"`.
    pub fn name(self) -> &'static str {
        match self {
            WeightMode::Exact => "exact",
            WeightMode::Native => "native",
        }
    }
}

/// A matrix [`WeightMode::Native`] reads from the memory map instead of an `f32` copy.
#[derive(Clone, Debug)]
enum NativeMatrix {
    /// In its GGUF block format, through the quantized kernels.
    Quant(QuantMatrix),
    /// F32 read in place, through the `f32` kernels.
    F32(MappedF32),
}

impl NativeMatrix {
    fn quant(&self) -> Option<&QuantMatrix> {
        match self {
            NativeMatrix::Quant(q) => Some(q),
            NativeMatrix::F32(_) => None,
        }
    }

    /// Bytes of the matrix in the map.
    fn byte_len(&self) -> usize {
        match self {
            NativeMatrix::Quant(q) => q.bytes().len(),
            NativeMatrix::F32(m) => m.byte_len(),
        }
    }
}

/// The matrices of one block held in the memory map in [`WeightMode::Native`] (`None`:
/// that matrix is in [`LayerWeights`] as `f32`).
#[derive(Clone, Debug, Default)]
struct NativeLayer {
    q: Option<NativeMatrix>,
    k: Option<NativeMatrix>,
    v: Option<NativeMatrix>,
    o: Option<NativeMatrix>,
    gate: Option<NativeMatrix>,
    up: Option<NativeMatrix>,
    down: Option<NativeMatrix>,
}

impl NativeLayer {
    fn all(&self) -> [&Option<NativeMatrix>; 7] {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
    }
}

/// `out[t][r] = file_order[t][order[r]]` for every token's `rows` outputs: a product
/// computed in the file's row order, put back in HF's (a permutation, so exact).
fn rows_in_hf_order(out: &mut [f32], file_order: &[f32], order: &[u32], rows: usize) {
    for (ot, ft) in out
        .chunks_exact_mut(rows)
        .zip(file_order.chunks_exact(rows))
    {
        for (o, &src) in ot.iter_mut().zip(order) {
            *o = ft[src as usize];
        }
    }
}

/// [`rows_in_hf_order`] in place: `out` holds every token's `rows` outputs in the
/// file's row order and is left in HF's, one token's row copied aside at a time into
/// `file_row` (scratch, resized to `rows`).
fn rows_to_hf_order_in_place(out: &mut [f32], order: &[u32], rows: usize, file_row: &mut Vec<f32>) {
    file_row.resize(rows, 0.0);
    for ot in out.chunks_exact_mut(rows) {
        file_row.copy_from_slice(ot);
        for (o, &src) in ot.iter_mut().zip(order) {
            *o = file_row[src as usize];
        }
    }
}

/// The buffers of the matrix products, kept between forward passes
/// ([`ForwardScratch`]): each activation kind's quantized rows, and outputs computed in
/// the file's row order before they are put in HF's.
#[derive(Default)]
struct ProductScratch {
    /// Quantized rows per activation kind; the first `fresh` hold the current input,
    /// the rest are buffers kept for reuse.
    made: Vec<(ActKind, Vec<QuantizedActs>)>,
    fresh: usize,
    /// Outputs in the file's row order, one buffer per product of a group.
    file_order: Vec<Vec<f32>>,
}

/// The rows quantized for `kind` among `made` (a [`ProductScratch`]'s current ones).
fn acts_of(made: &[(ActKind, Vec<QuantizedActs>)], kind: ActKind) -> Option<&[QuantizedActs]> {
    made.iter().find(|(k, _)| *k == kind).map(|(_, a)| &a[..])
}

/// Buffer `i` of `bufs` (added if missing), resized to `len`.
fn kept_buffer(bufs: &mut Vec<Vec<f32>>, i: usize, len: usize) -> &mut Vec<f32> {
    if bufs.len() <= i {
        bufs.resize_with(i + 1, Vec::new);
    }
    let b = &mut bufs[i];
    b.resize(len, 0.0);
    b
}

impl ProductScratch {
    /// The `i`-th file-order buffer, `len` long.
    fn file_order(&mut self, i: usize, len: usize) -> &mut Vec<f32> {
        kept_buffer(&mut self.file_order, i, len)
    }
}

/// The quantized forms of one input (`n` rows of `cols`), made once per activation
/// kind and shared by every product that reads that input (q/k/v, gate/up): the
/// same function of the same row gives the same blocks, so sharing changes no bit.
/// The blocks are written into `scratch`'s buffers, so once they have grown a
/// one-token input allocates nothing.
struct SharedActs<'a> {
    x: &'a [f32],
    cols: usize,
    n: usize,
    /// Threads the rows of a many-token input are quantized on.
    th: Threads,
    scratch: &'a mut ProductScratch,
}

impl<'a> SharedActs<'a> {
    fn new(
        x: &'a [f32],
        cols: usize,
        n: usize,
        th: Threads,
        scratch: &'a mut ProductScratch,
    ) -> Self {
        scratch.fresh = 0;
        SharedActs {
            x: &x[..n * cols],
            cols,
            n,
            th,
            scratch,
        }
    }

    /// The rows quantized for `ty` weights (quantized on first use).
    fn for_type(&mut self, ty: QType) -> Result<&[QuantizedActs], QuantError> {
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
        if self.n >= 16 && self.th.get() > 1 {
            let per = self.n.div_ceil(self.th.get().saturating_mul(4)).max(1);
            let error = std::sync::Mutex::new(None);
            let rows = Disjoint::new(&mut acts[..]);
            parallel_chunks(self.n.div_ceil(per), self.th, &|c| {
                let r = c * per..((c + 1) * per).min(rows.len());
                let x = &x[r.start * cols..r.end * cols];
                // SAFETY: the pool calls each chunk index once, and chunk `c` alone
                // holds rows `r` (consecutive, disjoint ranges).
                let part = unsafe { rows.part(r) };
                for (a, xt) in part.iter_mut().zip(x.chunks_exact(cols)) {
                    if let Err(e) = quantize_activation_into(ty, xt, a) {
                        *error
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                    }
                }
            });
            if let Some(e) = error
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
            {
                return Err(e);
            }
        } else {
            for (a, xt) in acts.iter_mut().zip(x.chunks_exact(cols)) {
                quantize_activation_into(ty, xt, a)?;
            }
        }
        sc.fresh += 1;
        Ok(&sc.made[at].1)
    }
}

/// `out = x · wᵀ` for `n` rows of `x` (`[n, cols]` → `[n, rows]`): over the matrix in
/// the map when `q` holds one (the quantized product, or [`matmul`] over mapped F32),
/// else the exact `f32` [`matmul`] over `w`. `scratch` holds the quantized input.
#[allow(clippy::too_many_arguments)]
fn linear(
    w: &[f32],
    q: Option<&NativeMatrix>,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    th: Threads,
    scratch: &mut ProductScratch,
) -> Result<(), ModelError> {
    let mut x = SharedActs::new(x, cols, n, th, scratch);
    linear_shared(w, q, rows, &mut x, out, th)
}

/// The values of a mapped F32 matrix used as `[rows, cols]`, or an error when its
/// shape is another.
fn mapped_f32_as(m: &MappedF32, rows: usize, cols: usize) -> Result<&[f32], ModelError> {
    let w = m.as_f32();
    if m.rows != rows || m.cols != cols || w.len() != rows * cols {
        return Err(ModelError::Unsupported(format!(
            "a mapped [{}, {}] f32 matrix ({} values) used as [{rows}, {cols}]",
            m.rows,
            m.cols,
            w.len()
        )));
    }
    Ok(w)
}

/// [`linear`] reading its input from `x`, whose quantized rows other products of the
/// same input reuse.
fn linear_shared(
    w: &[f32],
    q: Option<&NativeMatrix>,
    rows: usize,
    x: &mut SharedActs<'_>,
    out: &mut [f32],
    th: Threads,
) -> Result<(), ModelError> {
    let (cols, n) = (x.cols, x.n);
    let q = match q {
        None => {
            matmul(w, rows, cols, x.x, n, out, th);
            return Ok(());
        }
        Some(NativeMatrix::F32(m)) => {
            // The same kernel on the same values as the copied form: the same bits.
            let w = mapped_f32_as(m, rows, cols)?;
            matmul(w, rows, cols, x.x, n, out, th);
            if let Some(order) = &m.row_order {
                let tmp = x.scratch.file_order(0, rows);
                rows_to_hf_order_in_place(&mut out[..n * rows], order, rows, tmp);
            }
            return Ok(());
        }
        Some(NativeMatrix::Quant(q)) => q,
    };
    let qerr = |e| ModelError::Unsupported(format!("quantized {} product: {e}", q.ty));
    let out = &mut out[..n * rows];
    let Some(order) = &q.row_order else {
        let acts = x.for_type(q.ty).map_err(qerr)?;
        if n == 1 {
            return matvec_threads(q.ty, q.bytes(), &acts[0], out, th).map_err(qerr);
        }
        return matmul_threads(q.ty, q.bytes(), acts, out, th).map_err(qerr);
    };
    // Rows in the file's order, then each token's outputs put back in HF's order.
    x.for_type(q.ty).map_err(qerr)?;
    let ProductScratch {
        made,
        fresh,
        file_order,
    } = &mut *x.scratch;
    let acts = acts_of(&made[..*fresh], q.ty.act_kind())
        .ok_or_else(|| ModelError::Unsupported("activation not quantized".into()))?;
    let file_order = kept_buffer(file_order, 0, n * rows);
    if n == 1 {
        matvec_threads(q.ty, q.bytes(), &acts[0], file_order, th).map_err(qerr)?;
    } else {
        matmul_threads(q.ty, q.bytes(), acts, file_order, th).map_err(qerr)?;
    }
    rows_in_hf_order(out, file_order, order, rows);
    Ok(())
}

/// One product of a [`linear_group`]: exact weights, the matrix in the map if held,
/// output rows, output.
type GroupItem<'a> = (&'a [f32], Option<&'a NativeMatrix>, usize, &'a mut [f32]);

/// Several products of one input: q, k and v, or gate and up. A one-token input with
/// every matrix quantized runs as one [`matvec_many`]: one hand-off to the threads
/// instead of one per product. An input with every matrix `f32` (exact mode, or an F32
/// file read in place) runs as one [`matmul_group`], which makes it one hand-off for
/// many tokens, and for one token where its products would be shared from both ends by
/// two threads (not on AMD), else one per product. Anything else runs
/// [`linear_shared`] per product. Either way each output is the same bits.
fn linear_group<const N: usize>(
    items: &mut [GroupItem<'_>; N],
    x: &mut SharedActs<'_>,
    th: Threads,
) -> Result<(), ModelError> {
    let all_native = items
        .iter()
        .all(|(_, q, _, _)| q.and_then(NativeMatrix::quant).is_some());
    let all_f32 = items
        .iter()
        .all(|(_, q, _, _)| q.and_then(NativeMatrix::quant).is_none());
    if all_f32 {
        // f32 weights (exact mode, or an F32 file read in place): one hand-off for the
        // group ([`matmul_group`]), each thread claiming chunks of tokens, or of rows
        // for one token.
        let (cols, n) = (x.cols, x.n);
        // The weights of each product, checked first; then the products in an array, so
        // that a decode step allocates nothing.
        let mut ws: [&[f32]; N] = [&[]; N];
        for ((w, q, rows, _), slot) in items.iter().zip(ws.iter_mut()) {
            *slot = match q {
                Some(NativeMatrix::F32(m)) => mapped_f32_as(m, *rows, cols)?,
                _ => w,
            };
        }
        let mut it = items.iter_mut().zip(ws);
        let mut products: [Linear<'_>; N] = std::array::from_fn(|_| {
            let ((_, _, rows, out), w) = it.next().expect("one weight per product");
            Linear {
                w,
                rows: *rows,
                out: &mut out[..n * *rows],
            }
        });
        matmul_group(&mut products, cols, x.x, n, th);
        for (_, q, rows, out) in items.iter_mut() {
            if let Some(NativeMatrix::F32(m)) = q {
                if let Some(order) = &m.row_order {
                    let tmp = x.scratch.file_order(0, *rows);
                    rows_to_hf_order_in_place(&mut out[..n * *rows], order, *rows, tmp);
                }
            }
        }
        return Ok(());
    }
    if x.n != 1 || !all_native || th.get() <= 1 {
        for (w, q, rows, out) in items.iter_mut() {
            linear_shared(w, *q, *rows, x, out, th)?;
        }
        return Ok(());
    }
    let qerr = |e| ModelError::Unsupported(format!("quantized product: {e}"));
    let mut quant = [None; N];
    for ((_, q, _, _), slot) in items.iter().zip(quant.iter_mut()) {
        let q = q
            .and_then(NativeMatrix::quant)
            .ok_or_else(|| ModelError::Unsupported("unquantized matrix".into()))?;
        x.for_type(q.ty).map_err(qerr)?;
        *slot = Some(q);
    }
    // Outputs in the file's row order where the matrix has one, put back after: each
    // product's buffer in the scratch, so nothing is allocated once they have grown.
    for (i, (q, (_, _, rows, _))) in quant.iter().zip(items.iter()).enumerate() {
        let len = if q.is_some_and(|q| q.row_order.is_some()) {
            *rows
        } else {
            0
        };
        x.scratch.file_order(i, len);
    }
    {
        let ProductScratch {
            made,
            fresh,
            file_order,
        } = &mut *x.scratch;
        let made = &made[..*fresh];
        let mut slots = items.iter_mut().zip(file_order.iter_mut()).zip(&quant);
        let mut products: [Matvec<'_>; N] = std::array::from_fn(|_| {
            let (((_, _, rows, out), fo), q) = slots.next().expect("N items");
            let q = q.expect("checked above");
            let act = &acts_of(made, q.ty.act_kind()).expect("quantized above")[0];
            let out: &mut [f32] = if fo.is_empty() {
                &mut out[..*rows]
            } else {
                &mut fo[..]
            };
            Matvec {
                ty: q.ty,
                w: q.bytes(),
                act,
                out,
            }
        });
        matvec_many(&mut products, th).map_err(qerr)?;
    }
    for (i, ((_, _, _, out), q)) in items.iter_mut().zip(&quant).enumerate() {
        if let Some(order) = q.and_then(|q| q.row_order.as_ref()) {
            let fo = &x.scratch.file_order[i];
            rows_in_hf_order(&mut out[..order.len()], fo, order, order.len());
        }
    }
    Ok(())
}

/// `gate[i] = act(gate[i]) · up[i]` (SwiGLU's `silu`, GeGLU's tanh GELU) over `[n, ff]`
/// rows. A many-token input is split by token rows between the threads; each element
/// is the same scalar function whichever thread computes it, so the bits do not depend
/// on the thread count. (Serial, this was ~6% of a 2-thread prefill.)
fn gated_activation(act: Activation, gate: &mut [f32], up: &[f32], ff: usize, th: Threads) {
    let apply = |g: &mut [f32], u: &[f32]| match act {
        Activation::Silu => fak_tensor::exp::silu_mul_in_place(g, u),
        Activation::GeluTanh => fak_tensor::tanh::gelu_tanh_mul_in_place(g, u),
    };
    let n = gate.len() / ff.max(1);
    // Tokens per chunk: a few chunks per thread, so a late thread holds up little.
    const MIN_TOKENS: usize = 8;
    if n < 2 * MIN_TOKENS || th.get() <= 1 {
        apply(gate, up);
        return;
    }
    let per = n.div_ceil(th.get().saturating_mul(4)).max(MIN_TOKENS) * ff;
    let parts: Vec<std::sync::Mutex<&mut [f32]>> =
        gate.chunks_mut(per).map(std::sync::Mutex::new).collect();
    parallel_chunks(parts.len(), th, &|i| {
        let mut g = parts[i]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let u = &up[i * per..i * per + g.len()];
        apply(&mut g, u);
    });
}

/// The `c`-th chunk claimed of `n` taken alternately from the front and the back
/// (`0, n−1, 1, n−2, …`; a permutation of `0..n`). Two threads claiming a prefill's
/// (token block, query head) chunks in turn then work from opposite ends, each on
/// consecutive query heads, so a KV head's rows are mostly read by one thread and the
/// group's other query heads find them in that core's cache. (A decode step goes by
/// GQA group instead: `crate::attention`.)
fn front_back(c: usize, n: usize) -> usize {
    if c.is_multiple_of(2) {
        c / 2
    } else {
        n - 1 - c / 2
    }
}

/// The rows of a `[entries, kvd]` cache slice from entry `j` on (empty past the end,
/// where no row is read).
fn rows_from(kvd: usize, rows: &[f32], j: usize) -> &[f32] {
    &rows[(j * kvd).min(rows.len())..]
}

/// The weights of one decoder block, row-major `f32` (HF names in the comments). In
/// [`WeightMode::Native`] a matrix read from the memory map (held quantized, or an F32
/// GGUF matrix read in place) is an empty `Vec` here.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// `input_layernorm.weight`, `[hidden]`.
    pub input_norm: Vec<f32>,
    /// `self_attn.q_proj.weight`, `[q_dim, hidden]`.
    pub q_proj: Vec<f32>,
    /// `self_attn.k_proj.weight`, `[kv_dim, hidden]`.
    pub k_proj: Vec<f32>,
    /// `self_attn.v_proj.weight`, `[kv_dim, hidden]`.
    pub v_proj: Vec<f32>,
    /// `self_attn.o_proj.weight`, `[hidden, q_dim]`.
    pub o_proj: Vec<f32>,
    /// `self_attn.{q,k,v}_proj.bias` (Qwen2), `[q_dim]`, `[kv_dim]`, `[kv_dim]`.
    pub qkv_bias: Option<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    /// `self_attn.q_norm.weight` and `self_attn.k_norm.weight` (Qwen3, Gemma 3), each
    /// `[head_dim]`, applied per head before RoPE.
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// Gemma's `post_attention_layernorm.weight` on the attention output, `[hidden]`.
    pub attn_out_norm: Option<Vec<f32>>,
    /// The norm before the MLP, `[hidden]`: Llama/Qwen `post_attention_layernorm`, Gemma
    /// `pre_feedforward_layernorm`.
    pub mlp_norm: Vec<f32>,
    /// Gemma's `post_feedforward_layernorm.weight` on the MLP output, `[hidden]`.
    pub mlp_out_norm: Option<Vec<f32>>,
    /// `mlp.gate_proj.weight`, `[intermediate, hidden]`.
    pub gate_proj: Vec<f32>,
    /// `mlp.up_proj.weight`, `[intermediate, hidden]`.
    pub up_proj: Vec<f32>,
    /// `mlp.down_proj.weight`, `[hidden, intermediate]`.
    pub down_proj: Vec<f32>,
}

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

/// Default of [`Model::set_prefill_chunk`]: most tokens one batch of a forward pass
/// runs through the layers at once (llama.cpp's default micro-batch, `n_ubatch`, is
/// also 512). A pass's activations take ~28 KB a token for SmolLM2 (hidden 576, MLP
/// 1536), so a 4,096-token prompt in one batch held ~115 MB of them. Batches bound that
/// memory without costing speed on long prompts; smaller batches make a prompt slower,
/// since each batch reads every weight again, so prompts up to 512 tokens run as one.
/// Measured figures: docs/performance.md, "Why it is fast".
pub const PREFILL_CHUNK: usize = 512;

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

/// The buffers a forward pass works in, kept by the caller between passes
/// ([`Model::forward_into`]; a session keeps one per conversation), so that a decode
/// step allocates nothing once they have grown: the residual stream, the
/// normed input, q/k/v and the unrotated k, the attention output and scores, the MLP's
/// gate and up, the RoPE rows, each product's quantized input and its outputs in the
/// file's row order.
///
/// After a pass of more than one token (a prefill) the buffers are released, so a
/// conversation does not keep a long prompt's activations (tens of MB for a few
/// thousand tokens); the next decode step grows them again to one token's size, once.
/// The attention scores (`heads × entries`) grow as a `Vec` does, to twice their size
/// when full, so a growing context regrows them only each time it doubles.
///
/// It holds no state that changes a result: any scratch, new or used, gives the same
/// bits. `Clone` gives a new, empty one.
#[derive(Default)]
pub struct ForwardScratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    k_raw: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// A head's or a row's RMSNorm output before it is copied back.
    norm: Vec<f32>,
    /// Per distinct RoPE table used by this pass: (first layer using it, cos rows, sin
    /// rows); entries past `rope_used` are kept buffers.
    rope: Vec<(usize, Vec<f32>, Vec<f32>)>,
    rope_used: usize,
    /// Decode attention's `[heads, entries]` scores.
    scores: Vec<f32>,
    products: ProductScratch,
}

impl ForwardScratch {
    /// An empty scratch (nothing allocated until a pass uses it).
    pub fn new() -> Self {
        Self::default()
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
        ]
        .into_iter()
        .map(f)
        .sum::<usize>()
            + self.rope.iter().map(|(_, c, s)| f(c) + f(s)).sum::<usize>()
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

/// A loaded model: config, weights, RoPE tables and the thread count its products use.
/// Immutable after load: share it between sessions with `Arc<Model>`.
pub struct Model {
    config: Config,
    embed_tokens: Vec<f32>,
    layers: Vec<LayerWeights>,
    norm: Vec<f32>,
    /// `None` when the head is tied to `embed_tokens`.
    lm_head: Option<Vec<f32>>,
    rope: Vec<RopeTable>,
    threads: Threads,
    /// Most tokens one batch of a pass runs at once ([`Model::set_prefill_chunk`]).
    prefill_chunk: usize,
    mode: WeightMode,
    /// Per layer, the matrices held in the memory map (all `None` in exact mode).
    native: Vec<NativeLayer>,
    /// `embed_tokens` held in the map (then `embed_tokens` is empty).
    embed_native: Option<NativeMatrix>,
    /// An untied `lm_head` held in the map (then `lm_head` is `Some(empty)`).
    head_native: Option<NativeMatrix>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Loads a model from a GGUF file or a safetensors folder (see [`WeightSource::open`]),
    /// dequantizing or widening every weight to `f32` (the exact path).
    ///
    /// # Errors
    /// Any [`ModelError`] from reading the files, the config, or a missing / misshapen
    /// tensor.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::load_with(path, WeightMode::Exact)
    }

    /// [`Model::load`] keeping the weights as `mode` says ([`WeightMode::Native`]: the
    /// large matrices stay in the memory map, quantized or F32).
    ///
    /// # Errors
    /// As [`Model::load`].
    pub fn load_with(path: &Path, mode: WeightMode) -> Result<Self, ModelError> {
        let (src, cfg) = WeightSource::open(path)?;
        Self::from_source_with(&src, cfg, mode)
    }

    /// Builds the model from an opened source (exact path).
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] / [`ModelError::ShapeMismatch`] / reader errors.
    pub fn from_source(src: &WeightSource, config: Config) -> Result<Self, ModelError> {
        Self::from_source_with(src, config, WeightMode::Exact)
    }

    /// Builds the model from an opened source, keeping the weights as `mode` says.
    ///
    /// # Errors
    /// As [`Model::from_source`].
    pub fn from_source_with(
        src: &WeightSource,
        config: Config,
        mode: WeightMode,
    ) -> Result<Self, ModelError> {
        let c = &config;
        // A matrix in native mode: quantized when its type has a kernel, read in place
        // when it is F32 that can be borrowed, else an f32 copy.
        let mat = |name: &str,
                   shape: [usize; 2]|
         -> Result<(Vec<f32>, Option<NativeMatrix>), ModelError> {
            if mode == WeightMode::Native {
                if let Some(q) = src.quantized(name, shape, c)? {
                    return Ok((Vec::new(), Some(NativeMatrix::Quant(q))));
                }
                if let Some(m) = src.mapped_f32(name, shape, c)? {
                    return Ok((Vec::new(), Some(NativeMatrix::F32(m))));
                }
            }
            Ok((src.load(name, &shape, c)?, None))
        };
        let mut native = Vec::new();
        let (h, v) = (c.hidden_size, c.vocab_size);
        let (embed_tokens, embed_native) = mat("model.embed_tokens.weight", [v, h])?;
        // The family's per-layer tensor list gives every shape loaded below; each name
        // loaded must be on it and every name on it loaded (counted per layer), and the
        // unused-tensor check below uses the same list.
        let listed = c.family.spec().layer_tensors(c);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let loaded = std::cell::Cell::new(0usize);
            let shape = |s: &str| -> Result<&[usize], ModelError> {
                loaded.set(loaded.get() + 1);
                listed
                    .iter()
                    .find(|(n, _)| *n == s)
                    .map(|(_, d)| d.as_slice())
                    .ok_or_else(|| {
                        ModelError::Unsupported(format!(
                            "'{s}' is not in the {} tensor list",
                            c.family.name()
                        ))
                    })
            };
            let tensor = |s: &str| src.load(&p(s), shape(s)?, c);
            let matrix = |s: &str| match *shape(s)? {
                [rows, cols] => mat(&p(s), [rows, cols]),
                _ => Err(ModelError::Unsupported(format!(
                    "'{s}' is not a matrix in the {} tensor list",
                    c.family.name()
                ))),
            };
            let qkv_bias = if c.attention_bias {
                Some((
                    tensor("self_attn.q_proj.bias")?,
                    tensor("self_attn.k_proj.bias")?,
                    tensor("self_attn.v_proj.bias")?,
                ))
            } else {
                None
            };
            let qk_norm = if c.qk_norm {
                Some((
                    tensor("self_attn.q_norm.weight")?,
                    tensor("self_attn.k_norm.weight")?,
                ))
            } else {
                None
            };
            let (attn_out_norm, mlp_norm, mlp_out_norm) = if c.post_norms {
                (
                    Some(tensor("post_attention_layernorm.weight")?),
                    tensor("pre_feedforward_layernorm.weight")?,
                    Some(tensor("post_feedforward_layernorm.weight")?),
                )
            } else {
                (None, tensor("post_attention_layernorm.weight")?, None)
            };
            let (q_proj, nq) = matrix("self_attn.q_proj.weight")?;
            let (k_proj, nk) = matrix("self_attn.k_proj.weight")?;
            let (v_proj, nv) = matrix("self_attn.v_proj.weight")?;
            let (o_proj, no) = matrix("self_attn.o_proj.weight")?;
            let (gate_proj, ng) = matrix("mlp.gate_proj.weight")?;
            let (up_proj, nu) = matrix("mlp.up_proj.weight")?;
            let (down_proj, nd) = matrix("mlp.down_proj.weight")?;
            let input_norm = tensor("input_layernorm.weight")?;
            if loaded.get() != listed.len() {
                return Err(ModelError::Unsupported(format!(
                    "the loader read {} of the {} tensors the {} list names per layer",
                    loaded.get(),
                    listed.len(),
                    c.family.name()
                )));
            }
            native.push(NativeLayer {
                q: nq,
                k: nk,
                v: nv,
                o: no,
                gate: ng,
                up: nu,
                down: nd,
            });
            layers.push(LayerWeights {
                input_norm,
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                qkv_bias,
                qk_norm,
                attn_out_norm,
                mlp_norm,
                mlp_out_norm,
                gate_proj,
                up_proj,
                down_proj,
            });
        }
        let norm = src.load("model.norm.weight", &[h], c)?;
        let (lm_head, head_native) = if src.contains("lm_head.weight") && !c.tie_word_embeddings {
            let (w, q) = mat("lm_head.weight", [v, h])?;
            (Some(w), q)
        } else if c.tie_word_embeddings {
            (None, None)
        } else {
            return Err(ModelError::MissingTensor("lm_head.weight".into()));
        };
        // Every tensor in the file must be one the architecture uses: a tensor fak would
        // silently ignore (a bias, an extra layer) means the model is not what fak runs.
        let mut used: Vec<String> = vec![
            "model.embed_tokens.weight".into(),
            "model.norm.weight".into(),
        ];
        if lm_head.is_some() {
            used.push("lm_head.weight".into());
        }
        for l in 0..c.num_hidden_layers {
            for (s, _) in &listed {
                used.push(format!("model.layers.{l}.{s}"));
            }
        }
        let used: std::collections::HashSet<String> = used.into_iter().collect();
        // A tied checkpoint may still store lm_head (a copy of the embedding) and HF
        // rotary buffers may be saved; both are harmless.
        let harmless = |n: &str| n == "lm_head.weight" || n.ends_with("rotary_emb.inv_freq");
        if let Some(extra) = src
            .entries()
            .into_iter()
            .find(|e| !used.contains(&e.name) && !harmless(&e.name))
        {
            return Err(ModelError::Unsupported(format!(
                "tensor '{}' is not used by the {} architecture with this config (fak would ignore it)",
                extra.name,
                c.family.name()
            )));
        }
        let rope = c
            .rope_theta
            .iter()
            .map(|&t| RopeTable::new(c.head_dim, t))
            .collect();
        Ok(Model {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            threads: Threads::available(),
            prefill_chunk: PREFILL_CHUNK,
            mode,
            native,
            embed_native,
            head_native,
        })
    }

    /// How this model keeps its weights.
    pub fn weight_mode(&self) -> WeightMode {
        self.mode
    }

    /// Every matrix held in the memory map ([`WeightMode::Native`]).
    fn held(&self) -> impl Iterator<Item = &NativeMatrix> {
        let layers = self.native.iter().flat_map(|l| l.all());
        layers
            .chain([&self.embed_native, &self.head_native])
            .flatten()
    }

    /// The block types of the matrices held quantized, with how many matrices of each
    /// (empty in [`WeightMode::Exact`]), e.g. `[("Q4_1", 210), ("Q8_0", 1)]`. F32
    /// matrices read from the map are not here: see [`Model::mapped_f32_matrices`].
    pub fn quantized_types(&self) -> Vec<(&'static str, usize)> {
        let mut counts: std::collections::BTreeMap<&'static str, usize> = Default::default();
        for q in self.held().filter_map(NativeMatrix::quant) {
            *counts.entry(q.ty.name()).or_default() += 1;
        }
        counts.into_iter().collect()
    }

    /// How many F32 matrices are read in place from a GGUF file's memory map instead of
    /// being copied (0 in [`WeightMode::Exact`] and for files without F32 matrices),
    /// e.g. 211 for an all-F32 SmolLM2 file: 30 × 7 linear layers and the tied
    /// embedding.
    pub fn mapped_f32_matrices(&self) -> usize {
        self.held()
            .filter(|m| matches!(m, NativeMatrix::F32(_)))
            .count()
    }

    /// The output head held in the map (an untied `lm_head`, or the tied embedding).
    fn head_native(&self) -> Option<&NativeMatrix> {
        if self.lm_head.is_some() {
            self.head_native.as_ref()
        } else {
            self.embed_native.as_ref()
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Sets the sliding attention window of every layer (`None` = full causal
    /// attention), e.g. to run the window proofs on a model that has none.
    ///
    /// # Errors
    /// [`ModelError::InvalidInput`] if `windows.len()` is not the layer count or a window
    /// is 0.
    pub fn set_sliding_windows(&mut self, windows: Vec<Option<usize>>) -> Result<(), ModelError> {
        if windows.len() != self.config.num_hidden_layers {
            return Err(ModelError::InvalidInput(format!(
                "{} windows for {} layers",
                windows.len(),
                self.config.num_hidden_layers
            )));
        }
        if windows.contains(&Some(0)) {
            return Err(ModelError::InvalidInput(
                "a sliding window of 0 tokens".into(),
            ));
        }
        self.config.sliding_window = windows;
        Ok(())
    }

    /// Sets the context length in tokens (e.g. to run a long bounded-window test on a
    /// tiny model). RoPE has no table to outgrow, so any length is computable; the
    /// model's training length is what makes longer contexts meaningful.
    pub fn set_max_position_embeddings(&mut self, n: usize) {
        self.config.max_position_embeddings = n.max(1);
    }

    /// The decoder blocks' weights, in layer order.
    pub fn layer_weights(&self) -> &[LayerWeights] {
        &self.layers
    }

    /// Mutable access to the decoder blocks' weights (for experiments and negative
    /// controls; the shapes must stay as the config implies). A matrix held in the
    /// memory map in [`WeightMode::Native`] is an empty `Vec` here, and the forward
    /// pass does not read it.
    pub fn layer_weights_mut(&mut self) -> &mut [LayerWeights] {
        &mut self.layers
    }

    /// Applies layer `layer`'s RoPE at absolute position `pos` to `row`, a `[heads *
    /// head_dim]` row of K (or Q) laid out head after head, in place: one rotation, the
    /// same arithmetic the forward pass uses, so re-deriving K from `k_raw` at a new
    /// position gives the bits a forward pass at that position would have given.
    ///
    /// # Panics
    /// If `layer` is out of range or `row.len()` is not a multiple of `head_dim`.
    pub fn rope_in_place(&self, layer: usize, pos: u32, row: &mut [f32]) {
        let hd = self.config.head_dim;
        assert!(
            row.len().is_multiple_of(hd),
            "rope_in_place: row is not whole heads"
        );
        let half = hd / 2;
        let mut cos = vec![0f32; half];
        let mut sin = vec![0f32; half];
        self.rope[layer].cos_sin(pos, &mut cos, &mut sin);
        for head in row.chunks_exact_mut(hd) {
            rope_rotate_half(head, &cos, &sin);
        }
    }

    /// Threads used by the matrix products.
    pub fn threads(&self) -> Threads {
        self.threads
    }

    /// Sets the threads used by the matrix products. Results are bit-identical for any
    /// count.
    pub fn set_threads(&mut self, threads: Threads) {
        self.threads = threads;
    }

    /// Most tokens a forward pass runs through the layers at once (at least 1). A longer
    /// pass runs as consecutive batches of this many tokens, each appending its K/V rows
    /// before the next attends to them, so its activations take memory for one batch,
    /// not the whole prompt. Every token's result is computed by the same operations in
    /// the same order whatever the batch (the products' and attention's reduction orders
    /// do not depend on how many tokens run together), so the bits are those of one
    /// batch: a test checks logits and K/V rows for several sizes. A pass that fills a
    /// [`ForwardTrace`] runs as one batch. Default [`PREFILL_CHUNK`].
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens.max(1);
    }

    /// Most tokens a forward pass runs through the layers at once
    /// ([`Model::set_prefill_chunk`]).
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Bytes of weights the model reads: its own `f32` buffers
    /// ([`Model::owned_weight_bytes`]) plus, in [`WeightMode::Native`], the matrices
    /// read from the memory map (quantized, or F32 in place).
    pub fn weight_bytes(&self) -> usize {
        let mapped: usize = self.held().map(NativeMatrix::byte_len).sum();
        mapped + self.owned_weight_bytes()
    }

    /// Bytes of weights the model holds in its own heap buffers (`f32` copies made at
    /// load): every weight in [`WeightMode::Exact`]; in [`WeightMode::Native`] only what
    /// is not read from the memory map (norms, biases, matrices of types without a
    /// kernel or that need widening). The map's pages are not counted here.
    pub fn owned_weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|w| {
                w.input_norm.len()
                    + w.q_proj.len()
                    + w.k_proj.len()
                    + w.v_proj.len()
                    + w.o_proj.len()
                    + w.mlp_norm.len()
                    + w.attn_out_norm.as_ref().map_or(0, Vec::len)
                    + w.mlp_out_norm.as_ref().map_or(0, Vec::len)
                    + w.qk_norm.as_ref().map_or(0, |(a, b)| a.len() + b.len())
                    + w.qkv_bias
                        .as_ref()
                        .map_or(0, |(a, b, c)| a.len() + b.len() + c.len())
                    + w.gate_proj.len()
                    + w.up_proj.len()
                    + w.down_proj.len()
            })
            .sum();
        4 * (l
            + self.embed_tokens.len()
            + self.norm.len()
            + self.lm_head.as_ref().map_or(0, Vec::len))
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
        let head = self.lm_head.as_deref().unwrap_or(&self.embed_tokens);
        let mut logits = vec![0f32; n * c.vocab_size];
        let r = linear(
            head,
            self.head_native(),
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
        let head = self.lm_head.as_deref().unwrap_or(&self.embed_tokens);
        let file_row =
            |order: &Option<Vec<u32>>, r: usize| order.as_ref().map_or(r, |o| o[r] as usize);
        match self.head_native() {
            None => {
                for &r in sel {
                    let r = r as usize;
                    out[r] = dot(&head[r * h..(r + 1) * h], x);
                }
            }
            Some(NativeMatrix::F32(m)) => {
                let w = mapped_f32_as(m, v, h)?;
                for &r in sel {
                    let f = file_row(&m.row_order, r as usize);
                    out[r as usize] = dot(&w[f * h..(f + 1) * h], x);
                }
            }
            Some(NativeMatrix::Quant(q)) => {
                let qerr = |e| ModelError::Unsupported(format!("quantized {} head: {e}", q.ty));
                let mut xs = SharedActs::new(x, h, 1, th, products);
                let act = &xs.for_type(q.ty).map_err(qerr)?[0];
                let w = q.bytes();
                let rb = w.len() / v.max(1);
                for &r in sel {
                    let f = file_row(&q.row_order, r as usize);
                    out[r as usize] = vec_dot(q.ty, &w[f * rb..(f + 1) * rb], act).map_err(qerr)?;
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
    /// would reach the context length or the entries would exceed the cache's capacity.
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

        logits.clear();
        let chunk = self.prefill_chunk;
        if trace.is_some() || n <= chunk {
            return self.run_batch(ids, positions, kv, want, head_rows, trace, scratch, logits);
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
            self.run_batch(ids, positions, kv, part, rows, None, scratch, logits)?;
            at = end;
        }
        Ok(())
    }

    /// [`Model::forward_in`]'s pass over one batch of already validated tokens, appending
    /// the logits `want` asks for to `logits`.
    #[allow(clippy::too_many_arguments)]
    fn run_batch(
        &self,
        ids: &[u32],
        positions: &[u32],
        kv: &mut dyn KvStore,
        want: LogitsWanted,
        head_rows: Option<&[u32]>,
        mut trace: Option<&mut ForwardTrace>,
        scratch: &mut ForwardScratch,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let n = ids.len();
        let (hd, h) = (c.head_dim, c.hidden_size);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let (qd, kvd, ff) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        let group = nh / nkv;
        let th = self.threads;
        let ForwardScratch {
            x,
            xn,
            q,
            k,
            k_raw,
            v,
            attn,
            proj,
            gate,
            up,
            norm,
            rope: rope_rows,
            rope_used,
            scores,
            products,
        } = scratch;
        for (b, len) in [
            (&mut *x, n * h),
            (&mut *xn, n * h),
            (&mut *q, n * qd),
            (&mut *k, n * kvd),
            (&mut *v, n * kvd),
            (&mut *attn, n * qd),
            (&mut *proj, n * h),
            (&mut *gate, n * ff),
            (&mut *up, n * ff),
        ] {
            b.clear();
            b.resize(len, 0.0);
        }

        for (row, &id) in x.chunks_exact_mut(h).zip(ids) {
            match &self.embed_native {
                Some(NativeMatrix::Quant(e)) => e.dequantize_row(id as usize, row)?,
                Some(NativeMatrix::F32(e)) => e.copy_row(id as usize, row)?,
                None => {
                    row.copy_from_slice(&self.embed_tokens[id as usize * h..(id as usize + 1) * h])
                }
            }
            if let Some(s) = c.embedding_scale {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        if let Some(t) = trace.as_deref_mut() {
            t.embed = x.clone();
            t.layers.clear();
        }

        kv.append_positions(positions);
        let half = hd / 2;
        // The tokens' RoPE rows per distinct table (keyed by the first layer that uses
        // it): layers with equal tables share them (Gemma 3 has two, the Llamas one).
        *rope_used = 0;
        let scale = c.attention_scale;

        for (l, (w, nw)) in self.layers.iter().zip(&self.native).enumerate() {
            let slot = match rope_rows[..*rope_used]
                .iter()
                .position(|r| self.rope[r.0] == self.rope[l])
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
                        self.rope[l].cos_sin(
                            p,
                            &mut cos[t * half..(t + 1) * half],
                            &mut sin[t * half..(t + 1) * half],
                        );
                    }
                    *rope_used += 1;
                    *rope_used - 1
                }
            };
            let (_, cos, sin) = &rope_rows[slot];
            // Self-attention.
            for (o, r) in xn.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
                rms_norm(r, &w.input_norm, c.norm_weight_offset, c.rms_norm_eps, o);
            }
            // q, k and v read one input: it is quantized once for the three.
            let mut xq = SharedActs::new(xn, h, n, th, products);
            linear_group(
                &mut [
                    (&w.q_proj, nw.q.as_ref(), qd, &mut q[..]),
                    (&w.k_proj, nw.k.as_ref(), kvd, &mut k[..]),
                    (&w.v_proj, nw.v.as_ref(), kvd, &mut v[..]),
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
            if let Some((nq, nk)) = &w.qk_norm {
                norm.resize(hd, 0.0);
                for (rows, g) in [(&mut *q, nq), (&mut *k, nk)] {
                    for head in rows.chunks_exact_mut(hd) {
                        rms_norm(head, g, c.norm_weight_offset, c.rms_norm_eps, norm);
                        head.copy_from_slice(norm);
                    }
                }
            }
            k_raw.clear();
            k_raw.extend_from_slice(k);
            for t in 0..n {
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
            kv.append_layer(l, k_raw, k, v);
            let keys = kv.keys(l);
            let vals = kv.values(l);
            let pos = kv.positions();
            let m = pos.len();
            let window = c.sliding_window[l];
            // One chunk per (block of up to QB consecutive tokens, query head): each writes
            // its own output slices, with the same kernels in the same order whichever
            // thread runs it. In a block the tokens share every K and V row load over the
            // keys they all see; each (token, key) still gets exactly the canonical dot
            // and each output the ascending sum, so the bits are those of one token at
            // a time (decode == prefill).
            if n == 1 {
                let shape = DecodeShape {
                    heads: nh,
                    group,
                    head_dim: hd,
                    kv_dim: kvd,
                    scale,
                };
                let first = window_start(pos, m - 1, window);
                decode_attention(shape, q, keys, vals, first, m, scores, attn, th);
            } else {
                const QB: usize = 4;
                let outs: Vec<std::sync::Mutex<&mut [f32]>> = attn[..n * qd]
                    .chunks_exact_mut(hd)
                    .map(std::sync::Mutex::new)
                    .collect();
                let blocks = n.div_ceil(QB);
                parallel_chunks(blocks * nh, th, &|c| {
                    let c = front_back(c, blocks * nh);
                    let (tb, hq) = (c / nh, c % nh);
                    let g = hq / group;
                    let (k_at, v_at) = (&keys[g * hd..], &vals[g * hd..]);
                    let tokens = tb * QB..((tb + 1) * QB).min(n);
                    // Token t attends to entries start..=end (end: its own entry).
                    let ranges: Vec<(usize, usize)> = tokens
                        .clone()
                        .map(|t| {
                            let end = m - n + t;
                            (window_start(pos, end, window), end)
                        })
                        .collect();
                    let qs: Vec<&[f32]> = tokens
                        .clone()
                        .map(|t| &q[t * qd + hq * hd..t * qd + (hq + 1) * hd])
                        .collect();
                    let mut scores: Vec<Vec<f32>> =
                        ranges.iter().map(|&(s, e)| vec![0f32; e + 1 - s]).collect();
                    let mut out: Vec<std::sync::MutexGuard<'_, &mut [f32]>> = tokens
                        .clone()
                        .map(|t| {
                            outs[t * nh + hq]
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                        })
                        .collect();
                    // The keys every token of a full block sees: [lo, hi].
                    let lo = ranges.iter().map(|r| r.0).max().unwrap_or(0);
                    let hi = ranges.iter().map(|r| r.1).min().unwrap_or(0);
                    let shared = ranges.len() == QB && lo <= hi;
                    // q · k_j for every key each token sees (each one canonical dot).
                    for (i, (&(s, _), sc)) in ranges.iter().zip(scores.iter_mut()).enumerate() {
                        if shared {
                            dot_strided(rows_from(kvd, k_at, s), kvd, qs[i], &mut sc[..lo - s]);
                            dot_strided(
                                rows_from(kvd, k_at, hi + 1),
                                kvd,
                                qs[i],
                                &mut sc[hi + 1 - s..],
                            );
                        } else {
                            dot_strided(rows_from(kvd, k_at, s), kvd, qs[i], sc);
                        }
                    }
                    if shared {
                        let [s0, s1, s2, s3] = &mut scores[..] else {
                            unreachable!("a full block has QB tokens")
                        };
                        let r = &ranges;
                        dot_strided_multi(
                            rows_from(kvd, k_at, lo),
                            kvd,
                            [qs[0], qs[1], qs[2], qs[3]],
                            [
                                &mut s0[lo - r[0].0..hi + 1 - r[0].0],
                                &mut s1[lo - r[1].0..hi + 1 - r[1].0],
                                &mut s2[lo - r[2].0..hi + 1 - r[2].0],
                                &mut s3[lo - r[3].0..hi + 1 - r[3].0],
                            ],
                        );
                    }
                    for sc in scores.iter_mut() {
                        sc.iter_mut().for_each(|s| *s *= scale);
                    }
                    // A full block's four rows side by side (the same bits as one by one).
                    match &mut scores[..] {
                        [s0, s1, s2, s3] => softmax_rows_in_place([s0, s1, s2, s3]),
                        rows => rows.iter_mut().for_each(|sc| softmax_in_place(sc)),
                    }
                    // Σ_j p_j · v_j, ascending j, per element: the keys before the shared
                    // range, the shared range (four tokens at a time), the keys after it.
                    for o in out.iter_mut() {
                        o.fill(0.0);
                    }
                    for ((&(s, e), sc), o) in ranges.iter().zip(&scores).zip(out.iter_mut()) {
                        let head = if shared { lo - s } else { e + 1 - s };
                        weighted_rows_accumulate(
                            [&sc[..head]],
                            rows_from(kvd, v_at, s),
                            kvd,
                            [&mut o[..]],
                        );
                    }
                    if shared {
                        let r = &ranges;
                        let p: [&[f32]; QB] =
                            std::array::from_fn(|i| &scores[i][lo - r[i].0..hi + 1 - r[i].0]);
                        let [o0, o1, o2, o3] = &mut out[..] else {
                            unreachable!("a full block has QB tokens")
                        };
                        weighted_rows_accumulate(
                            p,
                            rows_from(kvd, v_at, lo),
                            kvd,
                            [&mut o0[..], &mut o1[..], &mut o2[..], &mut o3[..]],
                        );
                        for ((&(s, _), sc), o) in ranges.iter().zip(&scores).zip(out.iter_mut()) {
                            weighted_rows_accumulate(
                                [&sc[hi + 1 - s..]],
                                rows_from(kvd, v_at, hi + 1),
                                kvd,
                                [&mut o[..]],
                            );
                        }
                    }
                });
                drop(outs);
            }
            let o_proj = nw.o.as_ref();
            linear(&w.o_proj, o_proj, h, qd, attn, n, proj, th, products)?;
            if let Some(g) = &w.attn_out_norm {
                norm_rows(proj, g, c, h, norm);
            }
            add_assign(x, proj);
            // MLP (SwiGLU or GeGLU).
            for (o, r) in xn.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
                rms_norm(r, &w.mlp_norm, c.norm_weight_offset, c.rms_norm_eps, o);
            }
            // gate and up read one input: it is quantized once for the two.
            let mut xq = SharedActs::new(xn, h, n, th, products);
            linear_group(
                &mut [
                    (&w.gate_proj, nw.gate.as_ref(), ff, &mut gate[..]),
                    (&w.up_proj, nw.up.as_ref(), ff, &mut up[..]),
                ],
                &mut xq,
                th,
            )?;
            gated_activation(c.hidden_act, &mut gate[..n * ff], &up[..n * ff], ff, th);
            let down = nw.down.as_ref();
            linear(&w.down_proj, down, h, ff, gate, n, proj, th, products)?;
            if let Some(g) = &w.mlp_out_norm {
                norm_rows(proj, g, c, h, norm);
            }
            add_assign(x, proj);
            if let Some(t) = trace.as_deref_mut() {
                t.layers.push(x.clone());
            }
        }

        if want == LogitsWanted::None && trace.is_none() {
            return Ok(());
        }
        for (o, r) in xn.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
            rms_norm(r, &self.norm, c.norm_weight_offset, c.rms_norm_eps, o);
        }
        if let Some(t) = trace {
            t.final_norm = xn.clone();
        }
        let rows: &[f32] = match want {
            LogitsWanted::None => return Ok(()),
            LogitsWanted::Last => &xn[(n - 1) * h..],
            LogitsWanted::All => xn,
        };
        let nr = rows.len() / h;
        if let (Some(sel), 1) = (head_rows, nr) {
            let from = logits.len();
            logits.resize(from + c.vocab_size, 0.0);
            return self.head_rows_into(rows, sel, &mut logits[from..], th, products);
        }
        let head = self.lm_head.as_deref().unwrap_or(&self.embed_tokens);
        let from = logits.len();
        logits.resize(from + nr * c.vocab_size, 0.0);
        let head_native = self.head_native();
        linear(
            head,
            head_native,
            c.vocab_size,
            h,
            rows,
            nr,
            &mut logits[from..],
            th,
            products,
        )
    }
}
