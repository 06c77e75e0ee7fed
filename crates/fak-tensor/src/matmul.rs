//! Matrix products `out = x · wᵀ` (torch's `F.linear` without bias), threaded by rows.
//!
//! Every output element is one canonical dot product (crate docs), so the result does
//! not depend on how many tokens are in the batch, how rows are tiled, or how many
//! threads share the work: each (row, token) pair is always reduced in the same order.

use crate::cpu::has_avx2_fma;
use crate::dot::dot_ref;
use crate::pool::{Disjoint, Pool};
use crate::WeightElem;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, TryLockError};

/// How many OS threads a product may use (at least 1).
///
/// This is an upper bound, not a promise: [`matmul`] runs at most
/// `min(threads, 2 × available_parallelism, ceil(rows / 8))` chunks at once (see
/// [`max_useful_threads`]), one of them on the calling thread, so a huge count such as
/// `Threads::new(100_000)` costs no more than the machine can use. Results never
/// depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Threads(usize);

impl Threads {
    /// `n` threads; `0` is taken as 1. Not capped here: [`Threads::get`] returns `n`,
    /// and [`matmul`] applies its cap per product.
    pub fn new(n: usize) -> Self {
        Threads(n.max(1))
    }
    /// One thread per available core (`std::thread::available_parallelism`).
    pub fn available() -> Self {
        Threads::new(available_parallelism())
    }
    /// The thread count as given.
    pub fn get(self) -> usize {
        self.0
    }
    /// The most threads a product runs on with this setting:
    /// `min(n, max_useful_threads())` (what a report should say was used).
    pub fn used(self) -> usize {
        self.0.min(max_useful_threads())
    }
}

impl Default for Threads {
    fn default() -> Self {
        Threads::available()
    }
}

/// `std::thread::available_parallelism`, or 1 when unknown; read once per process
/// (on Linux it reads cgroup files, too slow to repeat for every product).
fn available_parallelism() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Most threads one product ever uses: twice the available parallelism. Past the core
/// count extra threads only add wake-up cost to compute-bound work; the factor 2 leaves
/// room for cores the OS reports conservatively (cgroup quotas, SMT).
pub fn max_useful_threads() -> usize {
    available_parallelism().saturating_mul(2)
}

/// Fewest rows per chunk worth a thread of its own (one 8-row micro-kernel pass).
const MIN_ROWS_PER_CHUNK: usize = 8;

/// Below this many multiply-adds a product runs on the calling thread only.
const PARALLEL_MIN_MACS: usize = 1 << 16;

/// Reference product: `out[t*rows + r] = dot_ref(w[r], x[t])`, one pair at a time.
///
/// Shapes: `w` is `[rows, cols]` (`f32`, or [`F16`](crate::F16) widened exactly), `x` is
/// `[n, cols]`, `out` is `[n, rows]`.
///
/// # Panics
/// If a slice is shorter than its shape (a programming error).
pub fn matmul_ref<W: WeightElem>(
    w: &[W],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    check_shapes(w, rows, cols, x, n, out);
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            out[t * rows + r] = dot_ref(&w[r * cols..(r + 1) * cols], xt);
        }
    }
}

fn check_shapes<W>(w: &[W], rows: usize, cols: usize, x: &[f32], n: usize, out: &[f32]) {
    assert!(
        w.len() >= rows * cols,
        "matmul: w has {} < {rows}x{cols}",
        w.len()
    );
    assert!(
        x.len() >= n * cols,
        "matmul: x has {} < {n}x{cols}",
        x.len()
    );
    assert!(
        out.len() >= n * rows,
        "matmul: out has {} < {n}x{rows}",
        out.len()
    );
}

/// Product `out[t*rows + r] = dot(w[r], x[t])`, bit-identical to [`matmul_ref`] for any
/// `threads` and any `n`.
///
/// Shapes: `w` is `[rows, cols]` (row-major, like `nn.Linear.weight`; `f32`, or
/// [`F16`](crate::F16), which the kernels widen exactly as they load it: the bits of the
/// matrix widened beforehand, reading half the bytes), `x` is `[n, cols]`, `out` is
/// `[n, rows]`. The work is split by outputs, never along the
/// reduction, so the split cannot change a result: a many-token input by chunks of
/// tokens ([`matmul_group`] of one product), one token by contiguous row ranges (a
/// multiple of 8 rows each where possible).
///
/// Threads (one token): at most `min(threads, max_useful_threads(), ceil(rows / 8))` ranges, run on
/// a persistent [`Pool`] of that many parts (created on first use and kept for the
/// process, so a product costs a wake-up, not a thread spawn); the calling thread
/// computes the first range. Products under 65,536 multiply-adds stay on the calling
/// thread. When the OS refused some of the pool's threads, or the pool is busy with
/// another caller's product, the calling thread computes the ranges left over: the
/// product is slower, never wrong, and never panics or blocks on the other caller.
///
/// # Panics
/// If a slice is shorter than its shape (a programming error); a panic in a worker
/// (none is expected) is resumed on the calling thread.
pub fn matmul<W: WeightElem>(
    w: &[W],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    threads: Threads,
) {
    check_shapes(w, rows, cols, x, n, out);
    if n > 1 {
        matmul_group(&mut [Linear { w, rows, out }], cols, x, n, threads);
        return;
    }
    let nt = parallel_ranges(rows, cols, n, threads);
    if nt <= 1 {
        matmul_serial(w, rows, cols, x, n, out, rows);
        return;
    }
    let shared = shared_pool(nt);
    // A pool busy with another caller's product (two sessions sharing a model): run
    // this one on the calling thread rather than wait; the bits are the same.
    let mut guard = lock_unless_busy(&shared);
    matvec_on(w, rows, cols, x, out, nt, guard.as_deref_mut());
}

/// One product of a [`matmul_group`]: `out = x · wᵀ` with `w` `[rows, cols]` and `out`
/// `[n, rows]` (as [`matmul`]).
#[derive(Debug)]
pub struct Linear<'a, W: WeightElem = f32> {
    /// `[rows, cols]` weights, row-major.
    pub w: &'a [W],
    /// Output rows (`out_features`).
    pub rows: usize,
    /// `[n, rows]` outputs.
    pub out: &'a mut [f32],
}

/// Fewest tokens per chunk of a [`matmul_group`] over a many-token input (a multiple
/// of the 512-bit tile's 8 tokens). Each chunk reads every weight of the group once
/// (from cache for all but the first), so a chunk must be long enough for the tiles
/// to reuse each weight block over many tokens, and short enough that the threads
/// claiming the chunks finish together.
const GROUP_MIN_TOKENS: usize = 32;

/// Several products of one `[n, cols]` input (q, k and v; gate and up) in one hand-off
/// to the threads, each output bit-identical to [`matmul`] on its own (and so to
/// [`matmul_ref`]).
///
/// A many-token input (a prefill) is cut into chunks of consecutive tokens, at least
/// 32 (`GROUP_MIN_TOKENS`) each and about four per thread; a thread claims a chunk and
/// computes every row of every product for its tokens, writing its own contiguous
/// rows of each output. Claiming evens out a thread that starts late or runs slowly,
/// where a fixed split into one row range per thread leaves the others waiting for it,
/// and the outputs need no copying back. A one-token input on two threads, where each
/// product would be shared from both ends, runs as one job over all the products' row
/// chunks (`one_token_group`); otherwise [`matmul`] per product (its rows split between
/// the threads). Small groups run on the calling thread.
///
/// # Panics
/// If a slice is shorter than its shape (a programming error).
pub fn matmul_group<W: WeightElem>(
    items: &mut [Linear<'_, W>],
    cols: usize,
    x: &[f32],
    n: usize,
    threads: Threads,
) {
    for it in items.iter() {
        check_shapes(it.w, it.rows, cols, x, n, it.out);
    }
    if n == 1 {
        if !one_token_group(items, cols, x, threads) {
            for it in items.iter_mut() {
                matmul(it.w, it.rows, cols, x, n, it.out, threads);
            }
        }
        return;
    }
    let total: usize = items.iter().map(|it| it.rows).sum();
    let parts = threads.get().min(max_useful_threads());
    if parts <= 1 || total * cols * n < PARALLEL_MIN_MACS {
        for it in items.iter_mut() {
            matmul_serial(it.w, it.rows, cols, x, n, it.out, it.rows);
        }
        return;
    }
    let per = n.div_ceil(4 * parts).max(GROUP_MIN_TOKENS).div_ceil(8) * 8;
    let chunks = n.div_ceil(per);
    let ws: Vec<(&[W], usize)> = items.iter().map(|it| (it.w, it.rows)).collect();
    // slots[c][i]: chunk c's rows of item i's output.
    let mut slots: Vec<Vec<Mutex<&mut [f32]>>> = (0..chunks).map(|_| Vec::new()).collect();
    // Every chunk gets a slot of every item (empty for a product of zero rows), so
    // `slots[c]` lines up with `ws`.
    for it in items.iter_mut() {
        let mut rest = &mut it.out[..n * it.rows];
        for slot in slots.iter_mut() {
            let (mine, tail) = rest.split_at_mut((per * it.rows).min(rest.len()));
            rest = tail;
            slot.push(Mutex::new(mine));
        }
    }
    parallel_chunks(chunks, threads, &|c| {
        let t0 = c * per;
        let m = per.min(n - t0);
        for ((w, rows), slot) in ws.iter().zip(&slots[c]) {
            let mut o = slot.lock().unwrap_or_else(PoisonError::into_inner);
            matmul_serial(
                w,
                *rows,
                cols,
                &x[t0 * cols..(t0 + m) * cols],
                m,
                &mut o,
                *rows,
            );
        }
    });
}

/// How many row ranges a product is split into: 1 (serial) for small products, else
/// `min(threads, max_useful_threads(), ceil(rows / 8))`.
pub(crate) fn parallel_ranges(rows: usize, cols: usize, n: usize, threads: Threads) -> usize {
    let nt = threads
        .get()
        .min(max_useful_threads())
        .min(rows.div_ceil(MIN_ROWS_PER_CHUNK));
    if rows * cols * n < PARALLEL_MIN_MACS {
        1
    } else {
        nt.max(1)
    }
}

/// Call `job(c)` once for every `c in 0..chunks` on up to `threads` threads of the
/// process-wide pool that the products use ([`Pool::run_chunks`]), returning when all
/// calls have returned. With one thread, one chunk, or the pool busy with another
/// caller, every call runs on the calling thread, in order.
///
/// Meant for independent pieces of work whose results do not depend on which thread
/// computes them (e.g. one attention head each), so the outcome is the same bits for
/// any thread count.
///
/// # Panics
/// A panicking call is resumed on the calling thread after all calls have finished.
pub fn parallel_chunks(chunks: usize, threads: Threads, job: &(dyn Fn(usize) + Sync)) {
    let parts = threads.get().min(max_useful_threads()).min(chunks);
    if parts <= 1 {
        (0..chunks).for_each(job);
        return;
    }
    let shared = shared_pool(parts);
    let guard = lock_unless_busy(&shared);
    match guard {
        Some(mut pool) => pool.run_chunks(chunks, job),
        None => (0..chunks).for_each(job),
    }
}

/// `pool` locked for this caller, or `None` while another caller (another session on the
/// same model) holds it: that caller's product is not waited for, and this one runs on
/// the calling thread instead (the same bits). A lock poisoned by an earlier panic is
/// taken all the same, as each caller did when it wrote this match itself.
pub(crate) fn lock_unless_busy(pool: &Mutex<Pool>) -> Option<std::sync::MutexGuard<'_, Pool>> {
    match pool.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// The process-wide pool with `parts` parts (one per distinct count, at most
/// `max_useful_threads()` of them), created on first use.
pub(crate) fn shared_pool(parts: usize) -> Arc<Mutex<Pool>> {
    type Pools = HashMap<usize, Arc<Mutex<Pool>>>;
    static POOLS: OnceLock<Mutex<Pools>> = OnceLock::new();
    let pools = POOLS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut pools = pools.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(
        pools
            .entry(parts)
            .or_insert_with(|| Arc::new(Mutex::new(Pool::new(parts)))),
    )
}

/// [`matmul`] of one token (`x` is `[cols]`, `out` `[rows]`) split into `ranges`
/// contiguous row ranges run on `pool` (range `i` on part `i mod pool.threads()`);
/// without a pool every range runs on the calling thread.
fn matvec_on<W: WeightElem>(
    w: &[W],
    rows: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
    ranges: usize,
    pool: Option<&mut Pool>,
) {
    check_shapes(w, rows, cols, x, 1, out);
    let parts = pool.as_ref().map_or(1, |p| p.threads());
    // (A chunk count over 32 bits, a matrix of 128 GiB or more, takes the ranges.)
    if parts == 2
        && ranges == 2
        && !crate::cpu::tuned_for_amd()
        && rows.div_ceil(two_ended_chunk_rows::<W>(cols)) <= u32::MAX as usize
    {
        matvec_two_ended(&mut [Linear { w, rows, out }], cols, x, pool);
        return;
    }
    // Contiguous row ranges, a multiple of 8 rows each where possible; range `i` is
    // rows `i * per ..` and goes to part `i mod parts`. Nothing is allocated: each
    // range's output rows are handed to its part as a `Disjoint` part.
    let per = (rows.div_ceil(ranges.max(1)).div_ceil(8) * 8).max(1);
    let count = rows.div_ceil(per);
    let outs = Disjoint::new(&mut out[..rows]);
    let job = |part: usize| {
        for i in (part..count).step_by(parts) {
            let (r0, r1) = (i * per, ((i + 1) * per).min(rows));
            // SAFETY: the job is called once per part, range `i` is visited only by
            // part `i mod parts`, and the ranges are disjoint.
            let mine = unsafe { outs.part(r0..r1) };
            let m = r1 - r0;
            matmul_serial(&w[r0 * cols..r1 * cols], m, cols, x, 1, mine, m);
        }
    };
    run_parts(pool, &job);
}

/// Bytes of weights per chunk of [`matvec_two_ended`] (as whole rows: the rows that
/// fit, then rounded up to a multiple of 8): large enough that each of the eight runs
/// [`one_token_rows`] cuts a chunk into is several rows long (56 rows of SmolLM2's 576
/// columns, runs of 7; 32 KB chunks gave runs of two rows and lost the long streams'
/// gain). Of the sizes measured, 32 KB to 512 KB, 128 KB and 256 KB were the fastest,
/// level with each other.
const TWO_ENDED_CHUNK_BYTES: usize = 128 * 1024;

/// Rows per chunk of [`matvec_two_ended`]: `TWO_ENDED_CHUNK_BYTES` of `cols`-long rows
/// of `W`, rounded up to a multiple of 8 rows.
fn two_ended_chunk_rows<W>(cols: usize) -> usize {
    (TWO_ENDED_CHUNK_BYTES / (cols * std::mem::size_of::<W>()).max(1))
        .max(1)
        .div_ceil(8)
        * 8
}

/// [`matvec_on`] for two threads that share the rows from both ends, for one product or
/// for several of the same one-token input ([`one_token_group`]; at most
/// `MAX_ONE_TOKEN_GROUP`): each product's rows are cut into chunks of about 128 KB
/// (`TWO_ENDED_CHUNK_BYTES`, a multiple of 8 rows), the products' chunks are laid end to
/// end in one list, part 0 claims chunks from the first on, part 1 from the last back,
/// and they meet wherever the faster one has got to. Each thread still reads one region
/// of the matrix in order (part 1's chunks one after another downwards), as with one
/// fixed range per thread, but neither waits for the other at the end when one runs
/// slower (a busy host's other tenants, a late wake-up). Every row is computed by the
/// same kernel whichever thread claims it: the same bits.
///
/// Chosen where [`crate::cpu::tuned_for_amd`] is false: measured faster than one fixed
/// range per thread on an Intel Xeon. On an AMD Zen 5, claimed chunks taken in order
/// were slower than one range per thread, and this form was not measured there
/// (docs/performance.md, "Why it is fast" and "Tried and kept out").
fn matvec_two_ended<W: WeightElem>(
    items: &mut [Linear<'_, W>],
    cols: usize,
    x: &[f32],
    pool: Option<&mut Pool>,
) {
    assert!(
        items.len() <= MAX_ONE_TOKEN_GROUP,
        "matvec_two_ended: too many products"
    );
    let per = two_ended_chunk_rows::<W>(cols);
    let len = items.len();
    // Item `i`'s chunks are `first[i]..first[i + 1]` of the one list both ends claim
    // from; its output rows are `outs[i]`. Fixed arrays: a decode step allocates nothing.
    let mut first = [0usize; MAX_ONE_TOKEN_GROUP + 1];
    let mut ws: [(&[W], usize); MAX_ONE_TOKEN_GROUP] = [(&[], 0); MAX_ONE_TOKEN_GROUP];
    let mut outs: [Option<Disjoint<'_, f32>>; MAX_ONE_TOKEN_GROUP] = Default::default();
    for (i, it) in items.iter_mut().enumerate() {
        first[i + 1] = first[i] + it.rows.div_ceil(per);
        ws[i] = (it.w, it.rows);
        outs[i] = Some(Disjoint::new(&mut it.out[..it.rows]));
    }
    let count = first[len];
    // `front << 32 | back`: chunks `front..back` are unclaimed (the caller checked
    // that the count fits in 32 bits).
    let claim = std::sync::atomic::AtomicU64::new(count as u64);
    let work = |g: usize| {
        // The item holding chunk `g` (an item of no rows holds no chunk).
        let i = (0..len).find(|&i| g < first[i + 1]);
        let Some(i) = i else { return };
        let (w, rows) = ws[i];
        let c = g - first[i];
        let (r0, r1) = (c * per, ((c + 1) * per).min(rows));
        let Some(outs) = &outs[i] else { return };
        // SAFETY: chunk `g` was claimed by this call alone (`claim_from_end` moves
        // `front` past it or `back` below it exactly once), and an item's chunks are
        // disjoint row ranges of its own output.
        let mine = unsafe { outs.part(r0..r1) };
        let m = r1 - r0;
        matmul_serial(&w[r0 * cols..r1 * cols], m, cols, x, 1, mine, m);
    };
    let job = |part: usize| {
        while let Some(g) = claim_from_end(&claim, part == 0) {
            work(g)
        }
    };
    run_parts(pool, &job);
}

/// Most products [`one_token_group`] runs in one hand-off (q, k and v are three).
const MAX_ONE_TOKEN_GROUP: usize = 4;

/// [`matmul_group`] of a one-token input as one [`matvec_two_ended`] job over all its
/// products (one hand-off to the threads, and one wait for the slower thread, instead of
/// one per product), where [`matvec_on`] would run each product two-ended: two threads
/// asked for, not [`crate::cpu::tuned_for_amd`], and every product large enough to be
/// split. Returns `false`, having computed nothing, where that does not hold. (Where the
/// OS refused the pool's second thread, the job runs on the calling thread alone, as
/// one product's would.) Each output is the bits of [`matmul`] on its own, as every row
/// is computed by the same kernel on the same input.
///
/// What it saves is less the hand-off itself (under a microsecond) than the wait for
/// the slower thread's last chunk, which each job has once: two jobs a layer (q, k, v;
/// gate, up) instead of five.
fn one_token_group<W: WeightElem>(
    items: &mut [Linear<'_, W>],
    cols: usize,
    x: &[f32],
    threads: Threads,
) -> bool {
    if items.len() < 2 || items.len() > MAX_ONE_TOKEN_GROUP || crate::cpu::tuned_for_amd() {
        return false;
    }
    let per = two_ended_chunk_rows::<W>(cols);
    let chunks: usize = items.iter().map(|it| it.rows.div_ceil(per)).sum();
    if chunks > u32::MAX as usize
        || items
            .iter()
            .any(|it| parallel_ranges(it.rows, cols, 1, threads) != 2)
    {
        return false;
    }
    let shared = shared_pool(2);
    // A pool busy with another caller's product runs the group on the calling thread.
    let mut guard = lock_unless_busy(&shared);
    matvec_two_ended(items, cols, x, guard.as_deref_mut());
    true
}

/// Claims the next chunk of [`matvec_two_ended`]: `claim` holds `front << 32 | back`
/// (chunks `front..back` unclaimed); the first unclaimed chunk when `from_front`, else
/// the last. `None` when none is left.
fn claim_from_end(claim: &std::sync::atomic::AtomicU64, from_front: bool) -> Option<usize> {
    use std::sync::atomic::Ordering::SeqCst;
    let mut v = claim.load(SeqCst);
    loop {
        let (front, back) = (v >> 32, v & 0xffff_ffff);
        if front >= back {
            return None;
        }
        let (next, i) = if from_front {
            (((front + 1) << 32) | back, front)
        } else {
            ((front << 32) | (back - 1), back - 1)
        };
        match claim.compare_exchange_weak(v, next, SeqCst, SeqCst) {
            Ok(_) => return Some(i as usize),
            Err(now) => v = now,
        }
    }
}

/// `job(0..parts)` on the pool, or `job(0)` on the calling thread without one.
fn run_parts(pool: Option<&mut Pool>, job: &(dyn Fn(usize) + Sync)) {
    match pool {
        Some(p) => p.run(job),
        None => job(0),
    }
}

/// Single-threaded product writing `out[t*ldo + r]`.
fn matmul_serial<W: WeightElem>(
    w: &[W],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    ldo: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2, FMA and F16C were detected at run time; shapes were checked by the
        // caller (`w` holds `rows*cols`, `x` holds `n*cols`, `out` holds `(n-1)*ldo+rows`).
        unsafe {
            serial_avx2(
                w,
                rows,
                cols,
                x,
                n,
                out,
                ldo,
                crate::cpu::has_avx512_f32(),
                one_token_rows(),
            )
        };
        return;
    }
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            out[t * ldo + r] = dot_ref(&w[r * cols..(r + 1) * cols], xt);
        }
    }
}

/// How many weight rows the one-token f32 product streams side by side (each with its
/// own accumulator chain, each in the canonical order: the same bits): 1 where
/// [`crate::cpu::tuned_for_amd`], else 8.
///
/// One row at a time keeps the weights one forward stream; its one chain of fused
/// multiply-adds (a 576-element row is 72 dependent steps) then bounds a row's time.
/// Eight chains side by side hide that latency: faster on an Intel Xeon on 1 and 2
/// threads, no faster on an AMD Zen 5.
///
/// The eight rows are not adjacent: the rows of each serial piece of a product (a
/// thread's range, or a chunk of [`matvec_two_ended`]) are cut into eight runs of
/// `rows / 8` adjacent rows, and each step takes the next row of every run, so the
/// weights are read as eight long forward streams, one per run; the last `rows % 8`
/// rows follow one at a time. Eight adjacent rows made eight streams of one row each
/// (2.3 KB for SmolLM2's 576 columns), interleaved within a few 4 KB pages, each one
/// restarting the hardware prefetcher; long runs read faster on 1 and 2 threads (with
/// [`matvec_two_ended`]'s chunks at 128 KB). Figures: docs/performance.md, "Why it is
/// fast".
fn one_token_rows() -> usize {
    if crate::cpu::tuned_for_amd() {
        1
    } else {
        8
    }
}

/// How far ahead (bytes) of each of its eight streams the one-token f32 product asks
/// for the weights (`prefetcht0`, [`crate::dot::avx2::dot_rows_strided`]'s `AHEAD`).
/// The hardware prefetchers follow eight interleaved streams less far ahead than one,
/// so the kernel asks for each stream's next lines itself; 512 B to 1 KB ahead read
/// fastest of the distances measured (256 B to 4 KB), closer to a plain sum's rate.
/// Only taken where [`one_token_rows`] is 8 (not on AMD).
#[cfg(target_arch = "x86_64")]
const STREAM_AHEAD: usize = 512;

/// Rows per cache block: the block of weights reused across all tokens of a prefill.
#[cfg(target_arch = "x86_64")]
const ROW_BLOCK: usize = 64;

/// Rows and token pairs of one 512-bit f32 tile ([`crate::dot::avx2::dot_tile_512`]:
/// `ZMM_R` rows × `2 * ZMM_P` tokens, 24 accumulator registers of the 32). Six rows
/// load each token pair once for 6 fused multiply-adds where four rows did for 4, which
/// pays with the pairs laid out once by [`crate::dot::avx2::pair_tokens`] (a 6-row tile
/// that inserted the pairs at each step was no faster than 4 rows).
/// A block's last rows run as 4-row and then 1-row tiles.
#[cfg(target_arch = "x86_64")]
const ZMM_R: usize = 6;
#[cfg(target_arch = "x86_64")]
const ZMM_P: usize = 4;

/// `side_by_side` is [`one_token_rows`]'s choice (1 or 8; any other value is taken
/// as 1) for one token.
///
/// # Safety
/// AVX2, FMA and F16C available, and AVX-512F/DQ when `zmm`; shapes as in
/// [`matmul_serial`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn serial_avx2<W: WeightElem>(
    w: &[W],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    ldo: usize,
    zmm: bool,
    side_by_side: usize,
) {
    use crate::dot::avx2::{dot_rows_strided, dot_tile, dot_tile_512, pair_tokens};
    if n == 1 && side_by_side == 8 {
        // Eight rows, eight accumulator chains, the rows as eight streams, each a
        // contiguous run of `per` rows: step `s` takes row `g * per + s` of each
        // stream `g` (see `one_token_rows`).
        let per = rows / 8;
        let mut o = [0f32; 8];
        for s in 0..per {
            // The eight rows at stride `per * cols` from row `s` end at row
            // `7 * per + s < 8 * per <= rows`, so `w` holds them (this function's
            // safety conditions give the CPU features).
            dot_rows_strided::<8, STREAM_AHEAD, W>(&w[s * cols..], per * cols, &x[..cols], &mut o);
            for (g, v) in o.iter().enumerate() {
                out[g * per + s] = *v;
            }
        }
        let mut r = 8 * per;
        while r < rows {
            dot_rows_strided::<1, 0, W>(&w[r * cols..], cols, &x[..cols], &mut out[r..]);
            r += 1;
        }
        return;
    }
    if n == 1 {
        // One row at a time, so the weights are read as one forward stream. Eight rows
        // interleaved (eight independent chains, eight streams 1-6 KB long) were no
        // faster on AMD; 2, 3, 4 and 6 rows, 512-bit row pairs and a software prefetch
        // were slower or level.
        for r in 0..rows {
            dot_rows_strided::<1, 0, W>(&w[r * cols..], cols, &x[..cols], &mut out[r..]);
        }
        return;
    }
    const R: usize = 4;
    const T: usize = 3;
    // The token pairs of the 512-bit tiles, laid out once for every row block.
    let mut pairs = Vec::new();
    let mut at = 0;
    if zmm && n >= 2 * ZMM_P {
        at = pair_tokens(x, n, cols, &mut pairs);
    }
    let pairs = &pairs[at..];
    let n8 = cols / 8 * 8;
    let mut rb = 0;
    while rb < rows {
        let re = (rb + ROW_BLOCK).min(rows);
        let mut t = 0;
        // Full 512-bit tiles first (two tokens per register), the rest as below.
        while zmm && n - t >= 2 * ZMM_P {
            let xt = &x[t * cols..];
            let pt = &pairs[t / 2 * 2 * n8..];
            let o = &mut out[t * ldo..];
            let mut r = rb;
            while r + ZMM_R <= re {
                dot_tile_512::<ZMM_R, ZMM_P, W>(&w[r * cols..], pt, xt, cols, &mut o[r..], ldo);
                r += ZMM_R;
            }
            while r + 4 <= re {
                dot_tile_512::<4, ZMM_P, W>(&w[r * cols..], pt, xt, cols, &mut o[r..], ldo);
                r += 4;
            }
            while r < re {
                dot_tile_512::<1, ZMM_P, W>(&w[r * cols..], pt, xt, cols, &mut o[r..], ldo);
                r += 1;
            }
            t += 2 * ZMM_P;
        }
        while t < n {
            let tn = (n - t).min(T);
            let xt = &x[t * cols..];
            let o = &mut out[t * ldo..];
            let mut r = rb;
            while r + R <= re {
                let wr = &w[r * cols..];
                let o = &mut o[r..];
                match tn {
                    3 => dot_tile::<R, 3, W>(wr, xt, cols, o, ldo),
                    2 => dot_tile::<R, 2, W>(wr, xt, cols, o, ldo),
                    _ => dot_tile::<R, 1, W>(wr, xt, cols, o, ldo),
                }
                r += R;
            }
            while r < re {
                let wr = &w[r * cols..];
                let o = &mut o[r..];
                match tn {
                    3 => dot_tile::<1, 3, W>(wr, xt, cols, o, ldo),
                    2 => dot_tile::<1, 2, W>(wr, xt, cols, o, ldo),
                    _ => dot_tile::<1, 1, W>(wr, xt, cols, o, ldo),
                }
                r += 1;
            }
            t += tn;
        }
        rb = re;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// [`matmul_group`] of products with `shapes` rows on `n` tokens, on 1-3 threads:
    /// every output must be [`matmul_ref`]'s bits (and nothing may panic).
    /// Products of `shapes` rows × `cols` columns (weights made from `seed`) of one
    /// `[n, cols]` input, computed by `run`: each output must be [`matmul_ref`]'s bits.
    /// `what` names the case in a failure.
    fn assert_products_are_reference(
        shapes: &[usize],
        cols: usize,
        n: usize,
        seed: u64,
        what: &str,
        run: &mut dyn FnMut(&mut [Linear<'_>], &[f32]),
    ) {
        let ws: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &r)| data(r * cols, seed + i as u64))
            .collect();
        let x = data(n * cols, seed + 100);
        let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&r| vec![f32::NAN; n * r]).collect();
        let mut items: Vec<Linear<'_>> = shapes
            .iter()
            .zip(&ws)
            .zip(outs.iter_mut())
            .map(|((&rows, w), out)| Linear { w, rows, out })
            .collect();
        run(&mut items, &x);
        drop(items);
        for ((&rows, w), got) in shapes.iter().zip(&ws).zip(&outs) {
            let mut want = vec![0f32; n * rows];
            matmul_ref(w, rows, cols, &x, n, &mut want);
            assert_same_bits(got, &want, &format!("rows={rows}, n={n}, {what}"));
        }
    }

    fn assert_group_is_reference(shapes: &[usize], cols: usize, n: usize, seed: u64) {
        for th in [1usize, 2, 3] {
            let what = format!("threads={th}");
            assert_products_are_reference(shapes, cols, n, seed, &what, &mut |items, x| {
                matmul_group(items, cols, x, n, Threads::new(th))
            });
        }
    }

    #[test]
    fn matmul_group_equals_reference_for_any_batch_and_threads() {
        // Three products of one input, token counts around the chunk length (and one
        // chunk's worth of remainder).
        for n in [2usize, 31, 33, 64, 65, 100, 131] {
            assert_group_is_reference(&[13, 67, 200], 72, n, 10);
        }
    }

    #[test]
    fn one_token_group_equals_reference_for_any_threads() {
        // Products each large enough for two threads (one two-ended job for the group;
        // rows not a multiple of a chunk's 56 or of 8), one too small to split (each
        // product on its own), and more than `MAX_ONE_TOKEN_GROUP` products.
        assert_group_is_reference(&[200, 131, 300], 576, 1, 30);
        assert_group_is_reference(&[200, 13, 300], 576, 1, 31);
        assert_group_is_reference(&[128, 129, 128, 127, 128], 576, 1, 32);
    }

    #[test]
    fn two_ended_job_over_several_products_gives_each_the_reference_bits() {
        // Products of zero rows among them (they hold no chunk), rows not a multiple of
        // a chunk, and rows shorter than a register; on two threads and on the caller.
        for (cols, shapes) in [(576usize, [0usize, 131, 0, 300]), (7, [3, 0, 40_000, 1])] {
            let mut pool = Pool::new(2);
            for on_pool in [true, false] {
                let what = format!("cols={cols}, pool {on_pool}");
                assert_products_are_reference(&shapes, cols, 1, 60, &what, &mut |items, x| {
                    matvec_two_ended(items, cols, x, on_pool.then_some(&mut pool))
                });
            }
        }
    }

    #[test]
    fn a_one_token_group_runs_as_one_job_where_each_product_would_run_two_ended() {
        let cols = 576;
        let expected = max_useful_threads() >= 2 && !crate::cpu::tuned_for_amd();
        assert_products_are_reference(&[200, 131, 300], cols, 1, 40, "group", &mut |items, x| {
            let ran = one_token_group(items, cols, x, Threads::new(2));
            assert_eq!(ran, expected);
            // One product, or one thread: not a group job (nothing computed).
            assert!(!one_token_group(&mut items[..1], cols, x, Threads::new(2)));
            assert!(!one_token_group(items, cols, x, Threads::new(1)));
            if !ran {
                // Where the group declines, compare the per-product form instead.
                matmul_group(items, cols, x, 1, Threads::new(2));
            }
        });
    }

    #[test]
    fn matmul_group_with_an_empty_product_equals_reference() {
        // A product of zero rows in a group large enough to be split between threads.
        assert_group_is_reference(&[200, 0, 67], 64, 100, 20);
    }

    #[test]
    fn matmul_equals_reference_for_any_batch_and_threads() {
        for &(rows, cols) in &[(1usize, 8usize), (13, 20), (67, 64), (200, 576), (9, 7)] {
            let w = data(rows * cols, 1);
            let x = data(11 * cols, 2);
            for n in [1usize, 2, 3, 4, 5, 11] {
                let mut want = vec![0f32; n * rows];
                matmul_ref(&w, rows, cols, &x, n, &mut want);
                for th in [1usize, 2, 3] {
                    let mut got = vec![f32::NAN; n * rows];
                    matmul(&w, rows, cols, &x, n, &mut got, Threads::new(th));
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "rows={rows} cols={cols} n={n} threads={th}");
                }
            }
        }
    }

    #[fak_testkit::cpu("avx2", "fma")]
    #[cfg(target_arch = "x86_64")]
    fn f32_tiles_with_256_bit_registers_give_the_reference_bits() {
        f32_tiles_give_the_reference_bits(false);
    }

    #[fak_testkit::cpu("avx2", "fma", "avx512f", "avx512dq")]
    #[cfg(target_arch = "x86_64")]
    fn f32_tiles_with_512_bit_registers_give_the_reference_bits() {
        f32_tiles_give_the_reference_bits(true);
    }

    /// 6-row × 8-token 512-bit tiles (`zmm`), their 4-row and 1-row edges, and the
    /// 256-bit tiles for the tokens after them; lengths with and without an 8-element
    /// tail.
    #[cfg(target_arch = "x86_64")]
    fn f32_tiles_give_the_reference_bits(zmm: bool) {
        assert!(crate::cpu::has_avx2_fma(), "this CPU lacks AVX2/FMA");
        assert!(
            !zmm || crate::cpu::has_avx512_f32(),
            "this CPU lacks AVX-512F/DQ (or FAK_NO_AVX512=1 is set)"
        );
        // 6-row tiles, then a block's 4-row and 1-row edge (blocks of 64 rows: 130 is
        // two blocks and 2 rows); one token with one row or eight rows side by side
        // (eight runs of `rows / 8` rows, then the rest one at a time).
        for &(rows, cols) in &[
            (9usize, 64usize),
            (13, 20),
            (66, 577),
            (130, 64),
            (48, 64),
            (7, 5),
        ] {
            let w = data(rows * cols, 5);
            let x = data(19 * cols, 6);
            for n in [1usize, 2, 8, 9, 16, 19] {
                let mut want = vec![0f32; n * rows];
                matmul_ref(&w, rows, cols, &x, n, &mut want);
                for side_by_side in [1, 8] {
                    let mut got = vec![f32::NAN; n * rows];
                    // SAFETY: AVX2 and FMA were detected (AVX-512F/DQ when `zmm`);
                    // `w`, `x` and `got` hold `rows * cols`, `n * cols`, `n * rows`.
                    unsafe {
                        serial_avx2(&w, rows, cols, &x, n, &mut got, rows, zmm, side_by_side)
                    };
                    let what = format!("{rows}x{cols} n={n} zmm={zmm} rows={side_by_side}");
                    assert_same_bits(&got, &want, &what);
                }
            }
        }
    }

    #[test]
    fn threads_used_is_capped_at_the_useful_count() {
        assert_eq!(Threads::new(1).used(), 1);
        assert_eq!(Threads::new(0).used(), 1);
        assert_eq!(Threads::new(1_000_000).used(), max_useful_threads());
        assert_eq!(Threads::new(1_000_000).get(), 1_000_000);
    }

    #[test]
    fn two_ended_claims_take_every_chunk_once_from_each_end() {
        // Claims from the two ends in several interleavings: the front claims count up
        // from 0, the back claims down from the last, and together they take each chunk
        // exactly once.
        for count in [0usize, 1, 2, 5, 8] {
            for pattern in [0b0u32, 0b1, 0b01, 0b10, 0b0110, 0b1101_0011] {
                let claim = std::sync::atomic::AtomicU64::new(count as u64);
                let (mut fronts, mut backs) = (Vec::new(), Vec::new());
                for step in 0.. {
                    let from_front = (pattern >> (step % 8)) & 1 == 0;
                    match claim_from_end(&claim, from_front) {
                        Some(i) if from_front => fronts.push(i),
                        Some(i) => backs.push(i),
                        None => break,
                    }
                }
                assert_eq!(fronts, (0..fronts.len()).collect::<Vec<_>>());
                let back_want: Vec<usize> = (fronts.len()..count).rev().collect();
                assert_eq!(backs, back_want, "count {count} pattern {pattern:b}");
                assert_eq!(claim_from_end(&claim, true), None);
                assert_eq!(claim_from_end(&claim, false), None);
            }
        }
    }

    #[test]
    fn two_ended_one_token_product_gives_the_reference_bits() {
        // Chunk counts odd and even, a last chunk shorter than the others, chunks of 8
        // rows (long rows) and of more; on a pool of two and on the calling thread.
        for &(rows, cols) in &[
            (4000usize, 576usize),
            (57, 1536),
            (40, 4096),
            (3000, 64),
            (3, 7),
        ] {
            let w = data(rows * cols, 7);
            let x = data(cols, 8);
            let mut want = vec![0f32; rows];
            matmul_ref(&w, rows, cols, &x, 1, &mut want);
            let mut pool = Pool::new(2);
            for _ in 0..3 {
                let mut got = vec![f32::NAN; rows];
                let out = &mut got;
                matvec_two_ended(
                    &mut [Linear { w: &w, rows, out }],
                    cols,
                    &x,
                    Some(&mut pool),
                );
                assert_same_bits(&got, &want, &format!("{rows}x{cols} on 2 threads"));
            }
            let mut got = vec![f32::NAN; rows];
            let out = &mut got;
            matvec_two_ended(&mut [Linear { w: &w, rows, out }], cols, &x, None);
            assert_same_bits(&got, &want, &format!("{rows}x{cols} on the caller"));
        }
    }

    #[test]
    fn token_result_is_independent_of_batch() {
        // Row r of token t must be the same bits whether t is computed alone or in a batch.
        let (rows, cols) = (300, 576);
        let w = data(rows * cols, 3);
        let x = data(7 * cols, 4);
        let mut batch = vec![0f32; 7 * rows];
        matmul(&w, rows, cols, &x, 7, &mut batch, Threads::new(2));
        for t in 0..7 {
            let mut one = vec![0f32; rows];
            matmul(
                &w,
                rows,
                cols,
                &x[t * cols..(t + 1) * cols],
                1,
                &mut one,
                Threads::new(2),
            );
            let row = &batch[t * rows..(t + 1) * rows];
            assert!(row
                .iter()
                .zip(&one)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
        let same = got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}");
    }

    /// `F16` weights through every product path (one token, two-ended or ranged;
    /// many tokens through the 512-bit pair tiles and the 256-bit tiles; groups) give
    /// exactly the bits of the same matrix widened to `f32` first, through
    /// [`matmul_ref`] (each value widened by `f16_to_f32`, which `quant`'s tests check
    /// against numpy's): half the bytes read, the same products.
    #[test]
    fn f16_weights_give_the_bits_of_the_widened_matrix() {
        use crate::{WeightElem, F16};
        // Narrowed from random f32 (so every f16 exponent range appears), plus the
        // edge values; cols with and without a tail past the 8-lane steps.
        let edges = [
            0x0000u16, 0x8000, 0x0001, 0x03ff, 0x0400, 0x7bff, 0xfbff, 0x3c00,
        ];
        for (rows, cols) in [(200usize, 72usize), (67, 61), (1536, 576), (9, 5)] {
            let w: Vec<F16> = data(rows * cols, 7)
                .iter()
                .enumerate()
                .map(|(i, v)| match i % 97 {
                    k if k < edges.len() => F16(edges[k]),
                    _ => F16(crate::quant::f32_to_f16(v * 4.0)),
                })
                .collect();
            let wide: Vec<f32> = w.iter().map(|h| h.to_f32()).collect();
            for n in [1usize, 2, 7, 8, 9, 33, 64] {
                let x = data(n * cols, 11 + n as u64);
                let mut want = vec![0f32; n * rows];
                matmul_ref(&wide, rows, cols, &x, n, &mut want);
                let mut from_f16 = vec![0f32; n * rows];
                matmul_ref(&w, rows, cols, &x, n, &mut from_f16);
                assert_same_bits(&from_f16, &want, &format!("ref {rows}x{cols} n={n}"));
                for th in [1usize, 2, 3] {
                    let mut got = vec![f32::NAN; n * rows];
                    matmul(&w, rows, cols, &x, n, &mut got, Threads::new(th));
                    let what = format!("{rows}x{cols} n={n} threads={th}");
                    assert_same_bits(&got, &want, &what);
                    // As two products of one group.
                    let (mut a, mut b) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
                    let mut items = [
                        Linear {
                            w: &w[..],
                            rows,
                            out: &mut a,
                        },
                        Linear {
                            w: &w[..],
                            rows,
                            out: &mut b,
                        },
                    ];
                    matmul_group(&mut items, cols, &x, n, Threads::new(th));
                    assert_same_bits(&a, &want, &format!("group {what}"));
                    assert_same_bits(&b, &want, &format!("group {what}"));
                }
            }
        }
    }

    #[test]
    fn huge_thread_count_is_capped_and_bit_identical() {
        // 100,000 threads asked for: at most min(2 × cores, rows / 8) ranges run.
        let (rows, cols) = (1000, 96);
        let w = data(rows * cols, 5);
        let x = data(5 * cols, 6);
        for n in [1usize, 5] {
            let mut want = vec![0f32; n * rows];
            matmul_ref(&w, rows, cols, &x, n, &mut want);
            let mut one = vec![f32::NAN; n * rows];
            matmul(&w, rows, cols, &x, n, &mut one, Threads::new(1));
            let mut many = vec![f32::NAN; n * rows];
            matmul(&w, rows, cols, &x, n, &mut many, Threads::new(100_000));
            assert_same_bits(
                &many,
                &want,
                &format!("n={n}: 100000 threads vs matmul_ref"),
            );
            assert_same_bits(&many, &one, &format!("n={n}: 100000 threads vs 1 thread"));
        }
        assert_eq!(Threads::new(100_000).get(), 100_000);
        assert!(max_useful_threads() >= 2);
    }

    #[test]
    fn refused_threads_run_on_the_caller() {
        // A pool with fewer threads than ranges (the OS refused some, or none at all):
        // the calling thread computes the ranges left over, with the same bits.
        let (rows, cols) = (203, 384); // above PARALLEL_MIN_MACS even for n = 1
        let w = data(rows * cols, 7);
        let x = data(cols, 8);
        let mut want = vec![0f32; rows];
        matmul_ref(&w, rows, cols, &x, 1, &mut want);
        for (ranges, pool_threads) in [(4usize, 1usize), (4, 2), (4, 3), (3, 4), (5, 0)] {
            let mut got = vec![f32::NAN; rows];
            if pool_threads == 0 {
                matvec_on(&w, rows, cols, &x, &mut got, ranges, None);
            } else {
                let mut pool = Pool::new(pool_threads);
                matvec_on(&w, rows, cols, &x, &mut got, ranges, Some(&mut pool));
            }
            assert_same_bits(&got, &want, &format!("ranges={ranges} pool={pool_threads}"));
        }
    }

    #[test]
    fn a_busy_pool_falls_back_to_the_caller() {
        // Hold the shared pool as another caller would; the product still completes
        // on the calling thread with the same bits.
        let (rows, cols) = (256, 384);
        let w = data(rows * cols, 9);
        let x = data(2 * cols, 10);
        let mut want = vec![0f32; 2 * rows];
        matmul_ref(&w, rows, cols, &x, 2, &mut want);
        let shared = shared_pool(2);
        let held = shared.lock().unwrap();
        let mut got = vec![f32::NAN; 2 * rows];
        matmul(&w, rows, cols, &x, 2, &mut got, Threads::new(2));
        drop(held);
        assert_same_bits(&got, &want, "busy pool");
        assert_eq!(parallel_ranges(rows, cols, 2, Threads::new(2)), 2);
    }
}
