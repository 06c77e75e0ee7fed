//! The matrix products of the forward pass: `out = x · wᵀ` over `f32` weights, F32 or
//! F16 values as the GGUF file stores them, or a quantized block format, one at a time
//! ([`linear`], [`linear_shared`]) or several of one input ([`linear_group`]).

use super::scratch::{acts_of, kept_buffer, ProductScratch, SharedActs};
use super::weights::Weight;
use crate::source::{Mapped, MappedElem};
use crate::ModelError;
use fak_tensor::quant::{
    matmul_many, matmul_threads, matmul_threads_into, matvec_many, matvec_threads, Matmul, Matvec,
};
use fak_tensor::{matmul, matmul_group, Linear, Threads, WeightElem, F16};

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

/// `out = x · wᵀ` for `n` rows of `x` (`[n, cols]` → `[n, rows]`): the quantized
/// product over [`Weight::Quant`], else the exact `f32` [`matmul`] over the values of
/// [`Weight::Dense`], [`Weight::Mapped`] or [`Weight::MappedF16`] (widened as loaded). `scratch` holds the quantized input.
#[allow(clippy::too_many_arguments)]
pub(super) fn linear(
    w: &Weight,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    th: Threads,
    scratch: &mut ProductScratch,
) -> Result<(), ModelError> {
    let mut x = SharedActs::new(x, cols, n, th, scratch);
    linear_shared(w, rows, &mut x, out, th)
}

/// [`linear`] with each of the `n` rows' outputs in a slice of its own (`outs[t]`,
/// `[rows]`), the same bits: one row, or a quantized matrix in HF's row order, writes
/// straight into them (a batched decode step's head, one sequence's logits each); any
/// other goes through `tmp` (`[n, rows]`, resized here) and is copied.
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_into_slices(
    w: &Weight,
    rows: usize,
    cols: usize,
    x: &[f32],
    outs: &mut [&mut [f32]],
    th: Threads,
    scratch: &mut ProductScratch,
    tmp: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let n = outs.len();
    let mut xs = SharedActs::new(x, cols, n, th, scratch);
    if let [one] = outs {
        return linear_shared(w, rows, &mut xs, one, th);
    }
    if let Weight::Quant(q) = w {
        if q.row_order.is_none() {
            let qerr = |e| ModelError::Unsupported(format!("quantized {} product: {e}", q.ty));
            let acts = xs.for_type(q.ty).map_err(qerr)?;
            return matmul_threads_into(q.ty, q.bytes(), acts, outs, th).map_err(qerr);
        }
    }
    tmp.clear();
    tmp.resize(n * rows, 0.0);
    linear_shared(w, rows, &mut xs, tmp, th)?;
    for (o, t) in outs.iter_mut().zip(tmp.chunks_exact(rows)) {
        o.copy_from_slice(t);
    }
    Ok(())
}

/// The values of an F32 or F16 matrix kept as the file stores it ([`Mapped`]) used as
/// `[rows, cols]`, or an error when its shape is another.
pub(super) fn mapped_as<W: MappedElem>(
    m: &Mapped<W>,
    rows: usize,
    cols: usize,
) -> Result<&[W], ModelError> {
    let w = m.values();
    if m.rows != rows || m.cols != cols || w.len() != rows * cols {
        return Err(ModelError::Unsupported(format!(
            "a mapped [{}, {}] matrix ({} values) used as [{rows}, {cols}]",
            m.rows,
            m.cols,
            w.len()
        )));
    }
    Ok(w)
}

/// [`linear`] reading its input from `x`, whose quantized rows other products of the
/// same input reuse.
pub(super) fn linear_shared(
    w: &Weight,
    rows: usize,
    x: &mut SharedActs<'_>,
    out: &mut [f32],
    th: Threads,
) -> Result<(), ModelError> {
    let (cols, n) = (x.cols, x.n);
    let q = match w {
        Weight::Dense(w) => {
            matmul(w, rows, cols, x.x, n, out, th);
            return Ok(());
        }
        Weight::Mapped(m) => return mapped_product(m, rows, x, out, th),
        Weight::MappedF16(m) => return mapped_product(m, rows, x, out, th),
        Weight::Quant(q) => q,
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
        ..
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

/// [`linear_shared`] over an F32 or F16 matrix as the file stores it ([`Mapped`]): the
/// same kernel on the same values as the exact path's `f32` copy (for F16, widened), so
/// the same bits; a `llama` file's Q/K rows put back in HF's order after.
fn mapped_product<W: MappedElem>(
    m: &Mapped<W>,
    rows: usize,
    x: &mut SharedActs<'_>,
    out: &mut [f32],
    th: Threads,
) -> Result<(), ModelError> {
    let (cols, n) = (x.cols, x.n);
    let w = mapped_as(m, rows, cols)?;
    matmul(w, rows, cols, x.x, n, out, th);
    if let Some(order) = &m.row_order {
        let tmp = x.scratch.file_order(0, rows);
        rows_to_hf_order_in_place(&mut out[..n * rows], order, rows, tmp);
    }
    Ok(())
}

/// [`linear_group`] over matrices of `f32` or F16 values `ws` (as stored or owned): one
/// [`matmul_group`], then each output whose matrix has a row order (`orders`, a `llama`
/// file's Q/K rows) put back in HF's order.
fn float_group<W: WeightElem, const N: usize>(
    ws: [&[W]; N],
    orders: [Option<&[u32]>; N],
    items: &mut [GroupItem<'_>; N],
    x: &mut SharedActs<'_>,
    th: Threads,
) -> Result<(), ModelError> {
    let (cols, n) = (x.cols, x.n);
    let mut it = items.iter_mut().zip(ws);
    let mut products: [Linear<'_, W>; N] = std::array::from_fn(|_| {
        let ((_, rows, out), w) = it.next().expect("one weight per product");
        Linear {
            w,
            rows: *rows,
            out: &mut out[..n * *rows],
        }
    });
    matmul_group(&mut products, cols, x.x, n, th);
    for ((_, rows, out), order) in items.iter_mut().zip(orders) {
        if let Some(order) = order {
            let tmp = x.scratch.file_order(0, *rows);
            rows_to_hf_order_in_place(&mut out[..n * *rows], order, *rows, tmp);
        }
    }
    Ok(())
}

/// The most tokens a [`linear_group`] of quantized matrices runs in one hand-off
/// ([`matmul_many`], one token [`matvec_many`]): a batched decode step's rows. More
/// (a prefill) run one product at a time, each with its own many-token tiles.
const GROUP_TOKENS: usize = 16;

/// One product of a [`linear_group`]: the weight, output rows, output.
type GroupItem<'a> = (&'a Weight, usize, &'a mut [f32]);

/// Several products of one input: q, k and v, or gate and up. A one-token input with
/// every matrix quantized runs as one [`matvec_many`], and one of up to
/// [`GROUP_TOKENS`] tokens (a batched decode step) as one [`matmul_many`]: one hand-off
/// to the threads instead of one per product. An input with every matrix `f32` (exact mode, or an F32
/// file's matrices as stored), or every matrix F16 as stored, runs as one
/// [`matmul_group`], which makes it one hand-off for many tokens, and for one token where
/// its products would be shared from both ends by two threads (not on AMD), else one per
/// product. Anything else runs [`linear_shared`] per product. Either way each output is
/// the same bits.
pub(super) fn linear_group<const N: usize>(
    items: &mut [GroupItem<'_>; N],
    x: &mut SharedActs<'_>,
    th: Threads,
) -> Result<(), ModelError> {
    let all_native = items.iter().all(|(w, _, _)| w.quant().is_some());
    // f32 weights (exact mode, or an F32 file's matrices as stored), or F16 as stored: one
    // hand-off for the group ([`matmul_group`]), each thread claiming chunks of tokens,
    // or of rows for one token. The weights of each product are checked first; then
    // the products go in an array, so that a decode step allocates nothing.
    let cols = x.cols;
    let mut f32s: [&[f32]; N] = [&[]; N];
    let mut f16s: [&[F16]; N] = [&[]; N];
    let mut orders: [Option<&[u32]>; N] = [None; N];
    let (mut n32, mut n16) = (0, 0);
    for (i, (w, rows, _)) in items.iter().enumerate() {
        match *w {
            Weight::Dense(w) => (f32s[i], n32) = (w, n32 + 1),
            Weight::Mapped(m) => {
                (f32s[i], n32) = (mapped_as(m, *rows, cols)?, n32 + 1);
                orders[i] = m.row_order.as_deref();
            }
            Weight::MappedF16(m) => {
                (f16s[i], n16) = (mapped_as(m, *rows, cols)?, n16 + 1);
                orders[i] = m.row_order.as_deref();
            }
            Weight::Quant(_) => {}
        }
    }
    if n32 == N {
        return float_group(f32s, orders, items, x, th);
    }
    if n16 == N {
        return float_group(f16s, orders, items, x, th);
    }
    let n = x.n;
    if !(1..=GROUP_TOKENS).contains(&n) || !all_native || th.get() <= 1 {
        for (w, rows, out) in items.iter_mut() {
            linear_shared(w, *rows, x, out, th)?;
        }
        return Ok(());
    }
    let qerr = |e| ModelError::Unsupported(format!("quantized product: {e}"));
    let mut quant = [None; N];
    for ((w, _, _), slot) in items.iter().zip(quant.iter_mut()) {
        let q = w
            .quant()
            .ok_or_else(|| ModelError::Unsupported("unquantized matrix".into()))?;
        x.for_type(q.ty).map_err(qerr)?;
        *slot = Some(q);
    }
    // Outputs in the file's row order where the matrix has one, put back after: each
    // product's buffer in the scratch, so nothing is allocated once they have grown.
    for (i, (q, (_, rows, _))) in quant.iter().zip(items.iter()).enumerate() {
        let len = if q.is_some_and(|q| q.row_order.is_some()) {
            n * *rows
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
            ..
        } = &mut *x.scratch;
        let made = &made[..*fresh];
        let mut slots = items.iter_mut().zip(file_order.iter_mut()).zip(&quant);
        let mut products: [Matmul<'_>; N] = std::array::from_fn(|_| {
            let (((_, rows, out), fo), q) = slots.next().expect("N items");
            let q = q.expect("checked above");
            let acts = acts_of(made, q.ty.act_kind()).expect("quantized above");
            let out: &mut [f32] = if fo.is_empty() {
                &mut out[..n * *rows]
            } else {
                &mut fo[..]
            };
            Matmul {
                ty: q.ty,
                w: q.bytes(),
                acts,
                out,
            }
        });
        if n == 1 {
            let mut one = products.map(|p| Matvec {
                ty: p.ty,
                w: p.w,
                act: &p.acts[0],
                out: p.out,
            });
            matvec_many(&mut one, th).map_err(qerr)?;
        } else {
            matmul_many(&mut products, th).map_err(qerr)?;
        }
    }
    for (i, ((_, _, out), q)) in items.iter_mut().zip(&quant).enumerate() {
        if let Some(order) = q.and_then(|q| q.row_order.as_ref()) {
            let fo = &x.scratch.file_order[i];
            rows_in_hf_order(&mut out[..n * order.len()], fo, order, order.len());
        }
    }
    Ok(())
}
