//! A persistent thread pool for row-parallel products: `n - 1` parked workers plus the
//! calling thread, so a decode step pays a wake-up per product instead of a thread
//! spawn ([`crate::matmul()`] and the quantized `matvec_pool` run on it).
//!
//! [`Pool::run`] calls a job once per part index `0..n` (part 0 on the calling thread)
//! and returns when all have finished. Callers split their *output rows* into
//! contiguous parts with [`part_range`]; every output element is computed by the same
//! single-row kernel whichever part it lands in, so results are bit-identical for any
//! thread count (tests check 1, 2, 3 and more).
//!
//! Workers park on a condition variable between jobs (no spinning, so an idle pool
//! costs nothing; a wake-up costs a few microseconds).

use std::ops::Range;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

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

/// A job as the workers see it: the caller's closure with its lifetime erased.
#[derive(Clone, Copy)]
struct Job(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the pointee is `Sync`, so calling it from another thread through a shared
// pointer is sound; `Pool::run` keeps it alive until every worker has finished with it.
unsafe impl Send for Job {}

struct State {
    generation: u64,
    job: Option<Job>,
    /// Workers that have not yet finished the current generation.
    pending: usize,
    panic: Option<Box<dyn std::any::Any + Send>>,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic never happens while the lock is held (jobs run outside it), but do
        // not let a poisoned lock turn into a second panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A fixed set of parked worker threads plus the caller (see the module docs).
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    /// A pool of `threads` parts: the calling thread plus `threads - 1` workers
    /// (`0` is taken as 1). If the OS refuses a thread, the pool keeps the workers it
    /// got ([`Pool::threads`] says how many parts there are); it never panics.
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                generation: 0,
                job: None,
                pending: 0,
                panic: None,
                shutdown: false,
            }),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        let mut workers = Vec::new();
        for i in 1..threads.max(1) {
            let s = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("fak-pool-{i}"))
                .spawn(move || worker(&s, i));
            match spawned {
                Ok(h) => workers.push(h),
                Err(_) => break,
            }
        }
        Pool { shared, workers }
    }

    /// Number of parts a [`Pool::run`] job is called with (workers + the caller).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Call `job(i)` for every `i in 0..self.threads()`, `i = 0` on the calling thread
    /// and the others on the workers, and return when all calls have returned.
    ///
    /// `&mut self` makes one job run at a time per pool.
    ///
    /// # Panics
    /// If a call panics, the panic is resumed on the calling thread after every other
    /// call has finished (the pool stays usable).
    pub fn run(&mut self, job: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() {
            job(0);
            return;
        }
        // SAFETY: only the lifetime is erased (same fat-pointer layout). The pointer is
        // dereferenced by workers only between publishing this generation and their
        // decrement of `pending`; `WaitAll` below blocks (on return and on unwind)
        // until `pending == 0`, so `job` outlives every use.
        let erased: *const (dyn Fn(usize) + Sync + 'static) = unsafe {
            std::mem::transmute::<
                *const (dyn Fn(usize) + Sync + '_),
                *const (dyn Fn(usize) + Sync + 'static),
            >(job as *const _)
        };
        {
            let mut st = self.shared.lock();
            st.generation += 1;
            st.job = Some(Job(erased));
            st.pending = self.workers.len();
            st.panic = None;
        }
        self.shared.work.notify_all();
        let wait = WaitAll(&self.shared);
        job(0);
        drop(wait);
        let panic = {
            let mut st = self.shared.lock();
            st.job = None;
            st.panic.take()
        };
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }
}

/// Waits until every worker has finished the current generation, also when the
/// caller's own part unwinds.
struct WaitAll<'a>(&'a Shared);

impl Drop for WaitAll<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        while st.pending > 0 {
            st = self.0.done.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

fn worker(shared: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let job = {
            let mut st = shared.lock();
            while st.generation == seen && !st.shutdown {
                st = shared.work.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
            if st.shutdown {
                return;
            }
            seen = st.generation;
            st.job
        };
        let result = match job {
            // SAFETY: `Pool::run` published this job for generation `seen` and waits
            // for our decrement of `pending` below before the closure can go away.
            Some(Job(f)) => catch_unwind(AssertUnwindSafe(|| unsafe { (*f)(index) })),
            None => Ok(()),
        };
        let mut st = shared.lock();
        if let Err(p) = result {
            st.panic.get_or_insert(p);
        }
        st.pending -= 1;
        if st.pending == 0 {
            shared.done.notify_all();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
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
