//! A persistent thread pool for row-parallel products: `n - 1` workers plus the
//! calling thread, so a decode step pays a hand-off per product instead of a thread
//! spawn ([`crate::matmul()`] and the quantized products run on it).
//!
//! [`Pool::run_chunks`] calls a job once per chunk index `0..chunks`; the calling
//! thread and the workers *claim* chunks from a shared counter until none are left,
//! and the call returns when every chunk has finished. [`Pool::run`] is the same with
//! one chunk per thread. Callers split their *output rows* into contiguous chunks
//! (e.g. with [`part_range`]); every output element is computed by the same
//! single-row kernel whichever thread claims its chunk, so results are bit-identical
//! for any thread count and any schedule (tests check 1, 2, 3 and more).
//!
//! A chunk writes its own output rows through a [`Disjoint`]: one exclusively borrowed
//! slice whose parts the chunks take by index, with no per-job list of locked slices, so
//! a decode step's products and attention allocate nothing.
//!
//! Claiming instead of assigning is what keeps a busy machine from stalling a
//! product: a worker that the OS has not scheduled yet simply claims nothing, and the
//! caller computes the chunks itself instead of waiting for it.
//!
//! Hand-off: after a job a worker watches for the next one for up to [`SPIN`]
//! (spinning, and yielding its core to the OS between polls, so on a loaded machine
//! another process runs instead), then parks on a condition variable. A decode step
//! issues its products tens of microseconds apart, so during generation the workers
//! stay awake and a hand-off costs well under a microsecond; an idle pool costs
//! nothing after [`SPIN`].

use std::cell::UnsafeCell;
use std::ops::Range;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a worker keeps watching for the next job before it parks.
pub const SPIN: Duration = Duration::from_millis(2);

/// Most chunks one generation can hold (the claim counter's 16-bit fields);
/// [`Pool::run_chunks`] runs larger jobs as several generations.
const MAX_CHUNKS: usize = 0xffff;

/// The `i`-th of `parts` contiguous, near-equal ranges covering `0..len` (the first
/// `len % parts` ranges are one longer). Empty when `i >= parts` or `parts == 0`.
pub fn part_range(len: usize, parts: usize, i: usize) -> Range<usize> {
    if parts == 0 || i >= parts {
        return len..len;
    }
    let (base, extra) = (len / parts, len % parts);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// A mutable slice whose pairwise disjoint parts are written by the calls of one
/// chunked job ([`Pool::run_chunks`], [`crate::parallel_chunks`]): each call takes the
/// part its chunk index names, with no lock and no list of the parts built per job (a
/// decode step hands out tens of such jobs, and the issue this serves asks for no
/// allocation per token).
///
/// It holds the slice's exclusive borrow for `'a`, so nothing else reads or writes the
/// slice while parts are handed out.
pub struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: a `Disjoint` is a `&mut [T]` handed to several threads one disjoint part
// each (`part`'s contract), which is what sending `&mut [T]`'s parts would be: sound
// when `T: Send`.
unsafe impl<T: Send> Send for Disjoint<'_, T> {}
// SAFETY: as for `Send`; shared use only hands out parts under `part`'s contract.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    /// Takes `slice`'s exclusive borrow for the parts to be handed out.
    pub fn new(slice: &'a mut [T]) -> Self {
        Disjoint {
            ptr: slice.as_mut_ptr(),
            len: slice.len(),
            _borrow: std::marker::PhantomData,
        }
    }

    /// Elements of the whole slice.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements `range` of the slice.
    ///
    /// # Safety
    /// While the returned slice is alive, no other slice returned by this `Disjoint`
    /// may overlap it. A job whose chunk `c` takes a range that is a function of `c`,
    /// disjoint from every other chunk's, meets this: the pool calls each chunk index
    /// exactly once.
    ///
    /// # Panics
    /// If `range` is not within `0..len()` (checked before any access).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, range: Range<usize>) -> &mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "part {range:?} of a slice of {}",
            self.len
        );
        // SAFETY: in bounds (checked above) of the slice borrowed exclusively for 'a;
        // no other live part overlaps it (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

/// A job as the workers see it: the caller's closure with its lifetime erased, and
/// the offset added to a claimed chunk index.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync + 'static),
    offset: usize,
}

/// The claim counter: `generation << 32 | chunks << 16 | next`.
fn pack(generation: u64, chunks: usize, next: usize) -> u64 {
    (generation << 32) | ((chunks as u64) << 16) | next as u64
}

fn unpack(v: u64) -> (u64, usize, usize) {
    (
        v >> 32,
        ((v >> 16) & 0xffff) as usize,
        (v & 0xffff) as usize,
    )
}

struct Shared {
    /// See [`pack`]. A chunk is claimed by a compare-exchange that bumps `next`, so a
    /// claim can only succeed for the generation it was read in.
    claim: AtomicU64,
    /// The current generation's job. Written by the caller before it publishes the
    /// generation in `claim`, read by a worker only after a successful claim.
    job: UnsafeCell<Option<Job>>,
    /// Chunks of the current generation that have finished (or panicked).
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

// SAFETY: `job` is the only non-`Sync` field. It is written only by the thread that
// holds `&mut Pool` while no chunk of any generation is claimable (before the new
// generation is published with a SeqCst store), and read by workers only after a
// successful SeqCst claim of that generation, which happens-after the write; the
// caller does not return (so cannot write it again) until every claimed chunk is done.
unsafe impl Sync for Shared {}
// SAFETY: the raw pointer inside `job` refers to a `Sync` closure (see above).
unsafe impl Send for Shared {}

/// Claims the next chunk of generation `generation`: `Some(index)`, or `None` when
/// the generation has none left (or is over).
fn claim(shared: &Shared, generation: u64) -> Option<usize> {
    let mut v = shared.claim.load(SeqCst);
    loop {
        let (g, chunks, next) = unpack(v);
        if g != generation || next >= chunks {
            return None;
        }
        match shared
            .claim
            .compare_exchange_weak(v, pack(g, chunks, next + 1), SeqCst, SeqCst)
        {
            Ok(_) => return Some(next),
            Err(now) => v = now,
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs claimed chunks of `generation` until none are left; panics are caught and
    /// kept for the caller.
    fn work(&self, generation: u64) {
        while let Some(c) = claim(self, generation) {
            // SAFETY: a successful claim of `generation` means the caller published it
            // after writing `job`, and will not return before this chunk is counted
            // in `done` below, so the closure is alive.
            let job = unsafe { *self.job.get() };
            if let Some(Job { f, offset }) = job {
                let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*f)(offset + c) }));
                if let Err(p) = r {
                    self.panic
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .get_or_insert(p);
                }
            }
            self.done.fetch_add(1, SeqCst);
        }
    }
}

/// A fixed set of worker threads plus the caller (see the module docs).
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    generation: u64,
}

impl Pool {
    /// A pool of `threads` parts: the calling thread plus `threads - 1` workers
    /// (`0` is taken as 1). If the OS refuses a thread, the pool keeps the workers it
    /// got ([`Pool::threads`] says how many parts there are); it never panics.
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            claim: AtomicU64::new(pack(0, 0, 0)),
            job: UnsafeCell::new(None),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let mut workers = Vec::new();
        for i in 1..threads.max(1) {
            let s = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("fak-pool-{i}"))
                .spawn(move || worker(&s));
            match spawned {
                Ok(h) => workers.push(h),
                Err(_) => break,
            }
        }
        Pool {
            shared,
            workers,
            generation: 0,
        }
    }

    /// Number of threads that run a job (workers + the caller).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Call `job(i)` once for every `i in 0..self.threads()`, each on whichever thread
    /// claims it (the caller included), and return when all calls have returned.
    ///
    /// # Panics
    /// As [`Pool::run_chunks`].
    pub fn run(&mut self, job: &(dyn Fn(usize) + Sync)) {
        let n = self.threads();
        self.run_chunks(n, job);
    }

    /// Call `job(c)` once for every chunk `c in 0..chunks`, on the calling thread and
    /// the workers as each claims the next chunk, and return when all calls have
    /// returned. `&mut self` makes one job run at a time per pool.
    ///
    /// # Panics
    /// If a call panics, the panic is resumed on the calling thread after every chunk
    /// has been run (the other chunks still run); the pool stays usable.
    pub fn run_chunks(&mut self, chunks: usize, job: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() || chunks <= 1 {
            (0..chunks).for_each(job);
            return;
        }
        let mut offset = 0;
        while offset < chunks {
            let n = (chunks - offset).min(MAX_CHUNKS);
            self.generation_run(offset, n, job);
            offset += n;
        }
    }

    fn generation_run(&mut self, offset: usize, chunks: usize, job: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        // SAFETY: only the lifetime is erased (same fat-pointer layout). Workers call it
        // only for a chunk they claimed in this generation, and this function does not
        // return (nor unwind) before `done` counts every claimed chunk.
        let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe {
            std::mem::transmute::<
                *const (dyn Fn(usize) + Sync + '_),
                *const (dyn Fn(usize) + Sync + 'static),
            >(job as *const _)
        };
        self.generation = (self.generation + 1) & 0xffff_ffff;
        let generation = self.generation;
        // SAFETY: the previous generation is over (every claimed chunk counted, none
        // claimable), so no worker reads `job` now (see `Shared`).
        unsafe { *s.job.get() = Some(Job { f, offset }) };
        s.done.store(0, SeqCst);
        s.claim.store(pack(generation, chunks, 0), SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _held = s.lock();
            s.wake.notify_all();
        }
        s.work(generation);
        // Every chunk has been claimed; wait for the ones still running elsewhere.
        let mut polls = 0u32;
        while s.done.load(SeqCst) < chunks {
            polls += 1;
            if polls.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if let Some(p) = s
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            resume_unwind(p);
        }
    }
}

fn worker(shared: &Shared) {
    let mut seen = unpack(shared.claim.load(SeqCst)).0;
    loop {
        // Watch for a new generation for up to `SPIN`, then park.
        let start = Instant::now();
        let mut polls = 0u32;
        let generation = loop {
            if shared.shutdown.load(SeqCst) {
                return;
            }
            let g = unpack(shared.claim.load(SeqCst)).0;
            if g != seen {
                break Some(g);
            }
            polls += 1;
            if polls.is_multiple_of(16) {
                if start.elapsed() > SPIN {
                    break None;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        };
        let generation = match generation {
            Some(g) => g,
            None => {
                let mut held = shared.lock();
                shared.sleepers.fetch_add(1, SeqCst);
                let g = loop {
                    let g = unpack(shared.claim.load(SeqCst)).0;
                    if g != seen || shared.shutdown.load(SeqCst) {
                        break g;
                    }
                    held = shared
                        .wake
                        .wait(held)
                        .unwrap_or_else(PoisonError::into_inner);
                };
                shared.sleepers.fetch_sub(1, SeqCst);
                if shared.shutdown.load(SeqCst) {
                    return;
                }
                g
            }
        };
        seen = generation;
        shared.work(generation);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        {
            let _held = self.shared.lock();
            self.shared.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            // A worker never panics outside `catch_unwind`; nothing to report if it did.
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disjoint_parts_written_by_chunks_cover_the_slice() {
        let mut v = vec![0u32; 1000];
        {
            let d = Disjoint::new(&mut v[..]);
            let mut pool = Pool::new(3);
            // 7 chunks of 150 elements (the last one 100): each writes its index + 1.
            pool.run_chunks(7, &|c| {
                let r = c * 150..((c + 1) * 150).min(d.len());
                // SAFETY: chunk `c` alone names range `r`; the pool calls it once.
                let part = unsafe { d.part(r) };
                part.iter_mut().for_each(|x| *x = c as u32 + 1);
            });
        }
        for (i, &x) in v.iter().enumerate() {
            assert_eq!(x, (i / 150) as u32 + 1, "element {i}");
        }
    }

    #[test]
    #[should_panic(expected = "part 5..11 of a slice of 10")]
    fn a_disjoint_part_past_the_end_panics_before_any_access() {
        let mut v = [0u8; 10];
        let d = Disjoint::new(&mut v[..]);
        // SAFETY: no other part is alive.
        let _ = unsafe { d.part(5..11) };
    }
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn part_ranges_tile_exactly() {
        for len in [0usize, 1, 7, 8, 100, 1536] {
            for parts in 1..6 {
                let mut next = 0;
                for i in 0..parts {
                    let r = part_range(len, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == len / parts || r.len() == len / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
        assert!(part_range(10, 0, 0).is_empty());
        assert!(part_range(10, 2, 5).is_empty());
    }

    #[test]
    fn every_part_runs_once_per_job_and_the_pool_is_reused() {
        let mut pool = Pool::new(3);
        assert_eq!(pool.threads(), 3);
        let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..200 {
            pool.run(&|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        for h in &hits {
            assert_eq!(h.load(Ordering::Relaxed), 200);
        }
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_after_all_parts_finish() {
        let mut pool = Pool::new(3);
        let finished = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|i| {
                if i == 2 {
                    panic!("part 2 fails");
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
                finished.fetch_add(1, Ordering::SeqCst);
            })
        }));
        assert!(r.is_err());
        assert_eq!(finished.load(Ordering::SeqCst), 2);
        // Still usable.
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(n.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn every_chunk_runs_once_beyond_one_generation() {
        let mut pool = Pool::new(2);
        for chunks in [0usize, 1, 2, 3, 1000, MAX_CHUNKS + 5] {
            let hits: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
            pool.run_chunks(chunks, &|c| {
                hits[c].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{chunks}"
            );
        }
    }

    #[test]
    fn workers_park_after_the_spin_and_wake_for_the_next_job() {
        let mut pool = Pool::new(3);
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::SeqCst);
        });
        std::thread::sleep(SPIN * 10);
        assert_eq!(pool.shared.sleepers.load(SeqCst), 2, "both workers parked");
        let threads = Mutex::new(std::collections::HashSet::new());
        for _ in 0..100 {
            pool.run_chunks(64, &|_| {
                n.fetch_add(1, Ordering::SeqCst);
                threads.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(Duration::from_micros(50));
            });
        }
        assert_eq!(n.load(Ordering::SeqCst), 3 + 6400);
        assert_eq!(
            threads.lock().unwrap().len(),
            3,
            "the woken workers took chunks"
        );
    }

    #[test]
    fn one_thread_runs_inline() {
        let mut pool = Pool::new(0);
        assert_eq!(pool.threads(), 1);
        let id = std::thread::current().id();
        pool.run(&|i| {
            assert_eq!(i, 0);
            assert_eq!(std::thread::current().id(), id);
        });
    }
}
