//! Quantized products on several threads: one-token products (decode) cut into one row
//! range per thread, several products in one hand-off, and multi-token products
//! (prefill) in chunks of rows; every row is the one-thread kernel, so the bits do not
//! depend on the thread count.

use super::tiles::{TileActs, TileIsa};
use super::{check_matvec, matvec, matvec_with, QType, QuantError, QuantizedActs};

/// Output rows per chunk of a pooled multi-token product: a multiple of 4 (the
/// row-group kernel's width) and of the type's [`QType::row_group`], covering about
/// `chunk_bytes` of weights ([`MATMUL_CHUNK_BYTES`]), so that a product is split into
/// several chunks and a slow thread holds up little.
fn chunk_rows(row_bytes: usize, chunk_bytes: usize, group: usize) -> usize {
    let step = row_step(group);
    (chunk_bytes / row_bytes.max(1)).div_ceil(step).max(1) * step
}

/// The least common multiple of 4 (the row-group kernel's width) and `group` (a type's
/// [`QType::row_group`]): what a thread's or a chunk's rows are a multiple of.
fn row_step(group: usize) -> usize {
    let (mut a, mut b) = (4usize, group.max(1));
    while b != 0 {
        (a, b) = (b, a % b);
    }
    4 / a * group.max(1)
}

/// Output rows per range of a pooled matrix-vector product (decode) split among
/// `parts` threads: one contiguous range per thread, a multiple of 4 rows (the
/// row-group kernel's width) and of the type's [`QType::row_group`] (`group`), the last
/// range the shortest.
///
/// One long range per thread, rather than many small chunks claimed in turn, because a
/// one-token product is bound by streaming its weights from memory: each chunk is a
/// claim on a counter both threads write and a new stream for the prefetchers to pick
/// up, and chunks claimed alternately leave each thread's reads jumping over the
/// other's (Gemma 3's 262,144-row head was ~1,300 chunks of 128 KB). One range per
/// thread was faster on every model file measured (docs/performance.md, "Why it is
/// fast"). The claims still hand a range to whichever thread is free, so a late thread
/// delays a product by at most one range.
pub(crate) fn matvec_range_rows(rows: usize, parts: usize, group: usize) -> usize {
    let step = row_step(group);
    rows.div_ceil(parts.max(1)).div_ceil(step).max(1) * step
}

/// Weight bytes per chunk of a pooled multi-token product (prefill). Each chunk's
/// weights are read once for all tokens, so the work per byte is many times a
/// matvec's and small chunks balance the threads better (128 KB chunks were slower).
const MATMUL_CHUNK_BYTES: usize = 32 * 1024;

/// The most tokens for which a pooled multi-token product is cut, as a matvec is, into
/// one row range per thread rather than [`MATMUL_CHUNK_BYTES`] chunks: a batched decode
/// step's few rows read each weight byte only a few times, so they stream the weights
/// as a matvec does, and each chunk restarted the tiles' weight preparation and its
/// prefetch. `batch_bench` (weights streamed, 2 threads, a Zen 5, µs per product, chunks
/// → ranges): 8 tokens Q4_1 76 → 58–67, Q8_0 87 → 59–60, Q4_K 83 → 63–64; 16 tokens
/// Q4_1 94 → 71–82, Q8_0 113 → 76–77, Q4_K level.
const FEW_TOKENS: usize = 16;

/// [`matvec`] with the output rows split into one contiguous range per thread of the
/// pool (a multiple of 4 rows each, the last the shortest), claimed by the pool's
/// threads ([`crate::pool::Pool::run_chunks`]). One long range per thread rather than
/// many small chunks: a one-token product streams its weights from memory, and every
/// chunk would cost a claim and restart the prefetchers' stream. Each row is the same
/// single-row kernel as in [`matvec`], so the result is bit-identical to [`matvec`] for
/// any thread count.
///
/// # Errors
/// As [`matvec`]; `out` is untouched on error.
pub fn matvec_pool(
    pool: &mut crate::pool::Pool,
    ty: QType,
    w: &[u8],
    act: &QuantizedActs,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let parts = pool.threads();
    chunked(&mut [Matvec { ty, w, act, out }], parts, &mut |n, job| {
        pool.run_chunks(n, job)
    })
}

/// [`matvec`] on up to `threads` threads of the process-wide pool that
/// [`crate::matmul()`] also uses: the output rows are split into contiguous parts as in
/// [`matvec_pool`], so the result is bit-identical to [`matvec`] for any count.
///
/// Small products (under 65,536 weight elements) and products that find the pool busy
/// with another caller run on the calling thread, with the same bits.
///
/// # Errors
/// As [`matvec`]; `out` is untouched on error.
pub fn matvec_threads(
    ty: QType,
    w: &[u8],
    act: &QuantizedActs,
    out: &mut [f32],
    threads: crate::Threads,
) -> Result<(), QuantError> {
    check_matvec(ty, w, act, out.len())?;
    let cols = act.blocks() * ty.block_elems();
    let parts = crate::matmul::parallel_ranges(out.len(), cols, 1, threads);
    if parts <= 1 {
        return matvec(ty, w, act, out);
    }
    matvec_many(
        &mut [Matvec { ty, w, act, out }],
        crate::Threads::new(parts),
    )
}

/// One product of [`matvec_many`]: `out = w · act` as in [`matvec`].
#[derive(Debug)]
pub struct Matvec<'a> {
    /// Weight type of `w`.
    pub ty: QType,
    /// `[out.len(), cols]` weights in `ty` blocks (raw GGUF bytes).
    pub w: &'a [u8],
    /// The quantized `[cols]` input.
    pub act: &'a QuantizedActs,
    /// `[rows]` outputs.
    pub out: &'a mut [f32],
}

/// Several [`matvec`]s in one hand-off to up to `threads` threads of the process-wide
/// pool: every product's rows are cut into one range per thread (as in
/// [`matvec_pool`]) and all the ranges are claimed from one list, so products that read
/// the same input (q, k and v; gate and up) cost one synchronisation instead of one
/// each. Each row is the same single-row kernel as in [`matvec`]: the same bits for any
/// thread count.
///
/// # Errors
/// As [`matvec`], for the first product that fails its shape check; no output is
/// written then.
pub fn matvec_many(products: &mut [Matvec<'_>], threads: crate::Threads) -> Result<(), QuantError> {
    let parts = threads.get().min(crate::matmul::max_useful_threads());
    chunked(products, parts, &mut |n, job| {
        crate::matmul::parallel_chunks(n, threads, job)
    })
}

/// A job over chunk indices, as [`crate::pool::Pool::run_chunks`] takes it.
type ChunkJob<'a> = &'a (dyn Fn(usize) + Sync);

/// Products per hand-off in [`chunked`]: its per-product state lives on the stack, so
/// no list is allocated per call (a decode step makes tens of these calls). q, k and v
/// are three; a longer list runs as several hand-offs.
const CHUNKED_PRODUCTS: usize = 4;

/// Each product's rows cut into `parts` ranges ([`matvec_range_rows`]), every range
/// computed by `run` (which calls the job once per range index, on whichever threads
/// it has). The ranges are numbered product by product, so the threads take a
/// product's ranges together before the next product's. Nothing is allocated: a range's
/// product and rows follow from its index, and its output rows are handed out as
/// [`crate::pool::Disjoint`] parts.
fn chunked(
    products: &mut [Matvec<'_>],
    parts: usize,
    run: &mut dyn FnMut(usize, ChunkJob<'_>),
) -> Result<(), QuantError> {
    use crate::pool::Disjoint;
    use std::sync::{Mutex, PoisonError};
    let mut rbs = [0usize; CHUNKED_PRODUCTS];
    for (p, rb) in products.iter().zip(rbs.iter_mut()) {
        *rb = check_matvec(p.ty, p.w, p.act, p.out.len())?;
    }
    if products.len() > CHUNKED_PRODUCTS {
        // Every shape is checked before any output is written.
        for p in &products[CHUNKED_PRODUCTS..] {
            check_matvec(p.ty, p.w, p.act, p.out.len())?;
        }
        let (head, tail) = products.split_at_mut(CHUNKED_PRODUCTS);
        chunked(head, parts, run)?;
        return chunked(tail, parts, run);
    }
    // Per product: the inputs, the output handed out in parts, rows per range, ranges.
    type Slot<'s> = (
        QType,
        &'s [u8],
        &'s QuantizedActs,
        Disjoint<'s, f32>,
        usize,
        usize,
    );
    let mut slots: [Option<Slot<'_>>; CHUNKED_PRODUCTS] = Default::default();
    let mut total = 0;
    for (p, slot) in products.iter_mut().zip(slots.iter_mut()) {
        let rows = p.out.len();
        let per = matvec_range_rows(rows, parts, p.ty.row_group());
        let ranges = rows.div_ceil(per);
        total += ranges;
        *slot = Some((p.ty, p.w, p.act, Disjoint::new(&mut *p.out), per, ranges));
    }
    let error = Mutex::new(None);
    run(total, &|c| {
        // Range `c`'s product and its first range index.
        let mut first = 0;
        for (&rb, slot) in rbs.iter().zip(&slots) {
            let Some((ty, w, act, out, per, ranges)) = slot else {
                return;
            };
            if c >= first + ranges {
                first += ranges;
                continue;
            }
            let r0 = (c - first) * per;
            let r1 = (r0 + per).min(out.len());
            // SAFETY: the pool calls each index once, and index `c` is the only one
            // naming rows `r0..r1` of this product (the ranges of a product are
            // consecutive and disjoint).
            let o = unsafe { out.part(r0..r1) };
            // Cannot fail after `check_matvec`; kept as an error rather than a panic.
            if let Err(e) = matvec_with(*ty, &w[r0 * rb..r1 * rb], act, o, true) {
                *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
            }
            return;
        }
    });
    match error.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// One product of [`matmul_many`]: `out[t * rows + r] = w[r] · acts[t]`, as
/// [`matmul_threads`] computes it.
#[derive(Debug)]
pub struct Matmul<'a> {
    /// Weight type of `w`.
    pub ty: QType,
    /// `[rows, cols]` weights in `ty` blocks.
    pub w: &'a [u8],
    /// The quantized `[cols]` rows of the input, `n` of them (the same `n` for every
    /// product of one call).
    pub acts: &'a [QuantizedActs],
    /// `[n, rows]` outputs, token by token.
    pub out: &'a mut [f32],
}

/// Several [`matmul_threads`] over the same few tokens (a batched decode step's rows:
/// q, k and v; gate and up) in one hand-off to up to `threads` threads of the
/// process-wide pool: every product's rows are cut into one range per thread, as
/// [`matmul_threads`] cuts them for up to 16 tokens, and all the ranges are claimed
/// from one list, as [`matvec_many`] does for one token, so the products cost one
/// synchronisation instead of one each. Each range runs the kernels [`matmul_threads`]
/// runs on it (the tiles formed once per product), so every output is the same bits.
/// Past 16 tokens, past four products, or on one thread, each product is its own
/// [`matmul_threads`].
///
/// # Errors
/// As [`matmul_threads`], for the first product that fails its checks (the products
/// differing in their number of tokens among them); no output is written then.
pub fn matmul_many(products: &mut [Matmul<'_>], threads: crate::Threads) -> Result<(), QuantError> {
    use crate::pool::Disjoint;
    use std::sync::{Mutex, PoisonError};
    let shape = |detail: String| QuantError::MatrixShape { detail };
    let n = products.first().map_or(0, |p| p.acts.len());
    let mut dims = [(0usize, 0usize); CHUNKED_PRODUCTS];
    for (i, p) in products.iter().enumerate() {
        if p.acts.len() != n || n == 0 || !p.out.len().is_multiple_of(n) {
            return Err(shape(format!(
                "{} outputs for {} activation rows (the group's first has {n})",
                p.out.len(),
                p.acts.len()
            )));
        }
        let rows = p.out.len() / n;
        let rb = check_matvec(p.ty, p.w, &p.acts[0], rows)?;
        if let Some(a) = p
            .acts
            .iter()
            .find(|a| a.kind() != p.acts[0].kind() || a.blocks() != p.acts[0].blocks())
        {
            return Err(shape(format!(
                "activation rows of {} and {} blocks",
                p.acts[0].blocks(),
                a.blocks()
            )));
        }
        if let Some(d) = dims.get_mut(i) {
            *d = (rows, rb);
        }
    }
    let parts = threads.get().min(crate::matmul::max_useful_threads());
    if n > FEW_TOKENS || products.len() > CHUNKED_PRODUCTS || parts <= 1 {
        for p in products.iter_mut() {
            matmul_threads(p.ty, p.w, p.acts, p.out, threads)?;
        }
        return Ok(());
    }
    // Per product: the inputs, their tiles, the output handed out in parts, rows per
    // range, ranges.
    type Slot<'s> = (
        QType,
        &'s [u8],
        &'s [QuantizedActs],
        Option<TileActs<'s>>,
        Disjoint<'s, f32>,
        usize,
        usize,
    );
    let mut slots: [Option<Slot<'_>>; CHUNKED_PRODUCTS] = Default::default();
    let mut total = 0;
    for ((p, slot), &(rows, _)) in products.iter_mut().zip(slots.iter_mut()).zip(&dims) {
        let per = matvec_range_rows(rows, parts, p.ty.row_group());
        let ranges = rows.div_ceil(per.max(1));
        total += ranges;
        let tile = TileActs::new(p.ty, p.acts, TileIsa::Zmm);
        *slot = Some((
            p.ty,
            p.w,
            p.acts,
            tile,
            Disjoint::new(&mut *p.out),
            per,
            ranges,
        ));
    }
    let error = Mutex::new(None);
    crate::matmul::parallel_chunks(total, threads, &|c| {
        // Range `c`'s product and its first range index.
        let mut first = 0;
        for (&(rows, rb), slot) in dims.iter().zip(&slots) {
            let Some((ty, w, acts, tile, out, per, ranges)) = slot else {
                return;
            };
            if c >= first + ranges {
                first += ranges;
                continue;
            }
            let r0 = (c - first) * per;
            let r1 = (r0 + per).min(rows);
            // SAFETY: the pool calls each index once, and index `c` is the only one
            // naming rows `r0..r1` of this product, which are, for each token `t`,
            // outputs `t * rows + r0..t * rows + r1` (the ranges of a product are
            // consecutive and disjoint, and so are the tokens' rows).
            let mut o: [&mut [f32]; FEW_TOKENS] = std::array::from_fn(|t| {
                if t < n {
                    unsafe { out.part(t * rows + r0..t * rows + r1) }
                } else {
                    &mut []
                }
            });
            // Cannot fail after the checks above; kept as an error rather than a panic.
            if let Err(e) = matmul_rows(
                *ty,
                &w[r0 * rb..r1 * rb],
                rb,
                acts,
                tile.as_ref(),
                &mut o[..n],
            ) {
                *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
            }
            return;
        }
    });
    match error.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Quantized matrix times several activation rows (a prefill's tokens, a batched decode
/// step's rows):
/// `out[t * rows + r] = vec_dot(ty, w[r], acts[t])`, bit-identical to [`matvec`] run
/// on each token alone, for any thread count.
///
/// Shapes: `w` is `[rows, cols]` in `ty` blocks with `rows = out.len() / acts.len()`;
/// `acts` holds `n` quantized `[cols]` rows; `out` is `[n, rows]`. For the 32-element
/// types the AVX2 path unpacks each weight block once for four tokens (and reads the
/// weights once per four tokens); with AVX-512 and AVX512-VNNI, each chunk's weight
/// blocks are prepared once and every 16 tokens run as the token-transposed tiles
/// (one register holds the accumulators of 16 tokens), then every 8 as pair tiles
/// (two rows times eight tokens a register; the last 3 to 7 padded to 8), and the rest,
/// or a product of fewer than 5 tokens, a token at a time through the one-token kernel
/// over chunks of rows held in the cache.
/// The K-quants (Q4_K, Q5_K, Q6_K) run every 16 tokens as token-transposed tiles too
/// with AVX-512 and AVX512-VNNI (`transposed_k`: `vpmaddubsw` and `vpdpwssd` form a
/// lane's scaled integer sum for 16 tokens), and the rest several tokens at a time
/// against each row, each super-block unpacked once for them: four with AVX2, eight
/// where AVX-512VL gives 32 vector registers (`avx2::k_tokens`, `avx2::k_tokens_wide`;
/// each result the one-token kernel's bits). Without AVX2 every type runs [`matvec`]
/// per token. Rows are split between the pool's threads: for up to 16 tokens in one
/// range per thread as [`matvec_threads`] does, for more in chunks of about 32 KB of
/// weights.
///
/// # Errors
/// [`QuantError::ActKind`] for a wrong activation kind; [`QuantError::MatrixShape`]
/// when `acts` is empty, the rows differ in length, `out.len()` is not a multiple of
/// `acts.len()`, or `w` is not `rows` rows. `out` is untouched on error.
pub fn matmul_threads(
    ty: QType,
    w: &[u8],
    acts: &[QuantizedActs],
    out: &mut [f32],
    threads: crate::Threads,
) -> Result<(), QuantError> {
    let n = acts.len();
    if n == 0 || !out.len().is_multiple_of(n) {
        return Err(QuantError::MatrixShape {
            detail: format!("{} outputs for {n} activation rows", out.len()),
        });
    }
    let rows = out.len() / n;
    let mut by_token: Vec<&mut [f32]> = out.chunks_mut(rows).collect();
    matmul_threads_into(ty, w, acts, &mut by_token, threads)
}

/// [`matmul_threads`] with each activation row's outputs in a slice of its own:
/// `out[t]` (`rows` values, the same length for every `t`) receives `w · acts[t]`, the
/// same bits. A batched decode step's logits go straight into each sequence's buffer.
///
/// # Errors
/// As [`matmul_threads`], and [`QuantError::MatrixShape`] when `out` does not hold one
/// slice per activation row, all of one length. `out` is untouched on error.
pub fn matmul_threads_into(
    ty: QType,
    w: &[u8],
    acts: &[QuantizedActs],
    out: &mut [&mut [f32]],
    threads: crate::Threads,
) -> Result<(), QuantError> {
    use std::sync::{Mutex, PoisonError};
    let n = acts.len();
    let shape = |detail: String| QuantError::MatrixShape { detail };
    let rows = out.first().map_or(0, |o| o.len());
    if n == 0 || out.len() != n || out.iter().any(|o| o.len() != rows) {
        return Err(shape(format!(
            "{} output slices of {:?} values for {n} activation rows",
            out.len(),
            out.iter().map(|o| o.len()).collect::<Vec<_>>()
        )));
    }
    let rb = check_matvec(ty, w, &acts[0], rows)?;
    if let Some(a) = acts
        .iter()
        .find(|a| a.kind() != acts[0].kind() || a.blocks() != acts[0].blocks())
    {
        return Err(shape(format!(
            "activation rows of {} and {} blocks",
            acts[0].blocks(),
            a.blocks()
        )));
    }
    let cols = acts[0].blocks() * ty.block_elems();
    let parts = crate::matmul::parallel_ranges(rows, cols, n, threads);
    let shared = (parts > 1).then(|| crate::matmul::shared_pool(parts));
    let mut guard = shared
        .as_ref()
        .and_then(|p| crate::matmul::lock_unless_busy(p));
    // The tokens' tile forms once for the whole product, not once per chunk.
    let tile = TileActs::new(ty, acts, TileIsa::Zmm);
    let Some(pool) = guard.as_deref_mut() else {
        // One thread: all rows at once, straight into `out` (in chunks through a buffer,
        // as below, was slower: every chunk re-reads all tokens' tile forms).
        return matmul_rows(ty, w, rb, acts, tile.as_ref(), out);
    };
    let per = match n {
        ..=FEW_TOKENS => matvec_range_rows(rows, parts, ty.row_group()),
        _ => chunk_rows(rb, MATMUL_CHUNK_BYTES, ty.row_group()),
    };
    let chunks = rows.div_ceil(per);
    // slots[c][t]: chunk c's rows of token t's output. Past `FEW_TOKENS` tokens the
    // chunk's kernels write a buffer of its own, `[n, m]`, copied into them after
    // (written straight into the output, Gemma 3's 2-thread prefill was slower; the
    // cause is not pinned down).
    let mut slots: Vec<Vec<&mut [f32]>> = (0..chunks).map(|_| Vec::with_capacity(n)).collect();
    for row in out.iter_mut() {
        for (c, part) in row.chunks_mut(per).enumerate() {
            slots[c].push(part);
        }
    }
    let slots: Vec<Mutex<Vec<&mut [f32]>>> = slots.into_iter().map(Mutex::new).collect();
    let error = Mutex::new(None);
    pool.run_chunks(chunks, &|c| {
        let r = c * per..((c + 1) * per).min(rows);
        let wc = &w[r.start * rb..r.end * rb];
        let m = r.len();
        if n <= FEW_TOKENS {
            // A decode step's few tokens: straight into the output (a thread's one range
            // of rows; through a buffer, the 8-token head of Gemma 3 allocated, zeroed
            // and copied 4 MB per thread per step).
            let mut slot = slots[c].lock().unwrap_or_else(PoisonError::into_inner);
            // Cannot fail after `check_matvec` (so `out` is untouched on every error).
            if let Err(e) = matmul_rows(ty, wc, rb, acts, tile.as_ref(), &mut slot) {
                *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
            }
            return;
        }
        let mut buf = vec![0f32; n * m];
        let mut by_token: Vec<&mut [f32]> = buf.chunks_mut(m).collect();
        // Cannot fail after `check_matvec` (so `out` is untouched on every error).
        match matmul_rows(ty, wc, rb, acts, tile.as_ref(), &mut by_token) {
            Ok(()) => {
                let mut slot = slots[c].lock().unwrap_or_else(PoisonError::into_inner);
                for (o, b) in slot.iter_mut().zip(buf.chunks_exact(m)) {
                    o.copy_from_slice(b);
                }
            }
            Err(e) => *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e),
        }
    });
    match error.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The rows of `w` (each `rb` bytes) times every activation row, on the calling
/// thread, into `out` (per activation row, one slice of `w`'s row count): through the
/// AVX2 tiles with `tile` (the activation rows prepared by [`TileActs::new`] from these
/// `acts`), else [`matvec`] per token. Shapes were checked by the caller.
fn matmul_rows(
    ty: QType,
    w: &[u8],
    rb: usize,
    acts: &[QuantizedActs],
    tile: Option<&TileActs<'_>>,
    out: &mut [&mut [f32]],
) -> Result<(), QuantError> {
    // The row count from the output: with zero-length rows (`rb == 0`) every output is
    // the empty sum, which `matvec` writes.
    let m = out.first().map_or(0, |o| o.len());
    if let (Some(tile), true) = (tile, m > 0 && rb > 0) {
        // SAFETY: `tile` holds `acts`, which the caller checked are `rb / ty.block_bytes()`
        // blocks each, of the kind `ty` pairs with (`TileActs::new` re-checked the kind
        // and the type); `w.len() == m * rb` and `out` holds `acts.len()` slices of `m`.
        unsafe { tile.run(w, rb, out) };
        return Ok(());
    }
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        matvec_with(ty, w, a, &mut o[..m], true)?;
    }
    Ok(())
}

/// [`matmul_rows`] with the tile kernels of `isa` (or the best the CPU has below it),
/// so tests can compare them on one machine.
#[cfg(test)]
pub(crate) fn matmul_rows_isa(
    ty: QType,
    w: &[u8],
    rb: usize,
    acts: &[QuantizedActs],
    out: &mut [f32],
    isa: TileIsa,
) -> Result<(), QuantError> {
    let tile = TileActs::new(ty, acts, isa);
    let m = w.len() / rb;
    let mut by_token: Vec<&mut [f32]> = out.chunks_mut(m).collect();
    matmul_rows(ty, w, rb, acts, tile.as_ref(), &mut by_token)
}
