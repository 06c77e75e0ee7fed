//! A seeded mutational fuzzer that runs on stable Rust, and fak's fuzz targets.
//!
//! Each [`Target`] has seed inputs and a function that runs one input and returns a short
//! outcome label (`"ok"`, or the kind of error it gave). [`fuzz`] mutates seeds (bit
//! flips, interesting integers at every width, deletions, duplications, splices and
//! target-specific dictionary words) for a fixed time and counts:
//!
//! - **crashes**: a panic on any thread while an input runs (a panic hook counts them,
//!   so a panic inside a spawned task or a worker thread counts too), or a run that
//!   returns `Err` (a broken property, e.g. a 5xx answer);
//! - **hangs**: one input running longer than [`Options::timeout`]; a watchdog thread
//!   saves the input and ends the process (exit status 2);
//! - **memory**: the live heap passing [`Options::mem_limit`]; the allocator saves the
//!   input and ends the process (exit status 3) before the allocation is made.
//!
//! Every crashing input is written to [`Options::out_dir`] as
//! `<target>-crash-<n>.bin` (hangs and memory: `<target>-hang.bin`,
//! `<target>-oom.bin`) and can be replayed with `fak-fuzz --replay FILE TARGET`.
//!
//! It is coverage-less: there is no instrumentation, so the build is the ordinary
//! release build the tests already made, and it runs on stable. Instead of coverage, an
//! input whose outcome label has not been seen before is kept in the corpus and mutated
//! further, which steers the search past the first error each parser gives.
//!
//! The targets are in [`targets`].

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub mod targets;

/// What a target's run function returns: `Ok(label)` (a short outcome label; an input
/// with a label not seen before joins the corpus), `Err(message)` for a broken property
/// (counted as a crash).
pub type Outcome = Result<String, String>;

/// A target's run function: one input in, its outcome out.
pub type RunFn = Box<dyn FnMut(&[u8]) -> Outcome>;

/// One fuzz target.
pub struct Target {
    /// Name used on the command line and in file names.
    pub name: &'static str,
    /// Seed inputs (at least one).
    pub seeds: Vec<Vec<u8>>,
    /// Words a mutation may insert (control tokens, JSON syntax, template syntax).
    pub dictionary: Vec<Vec<u8>>,
    /// Runs one input.
    pub run: RunFn,
}

/// Settings of one fuzz run.
#[derive(Clone, Debug)]
pub struct Options {
    /// How long each target runs.
    pub duration: Duration,
    /// Seed of the mutation generator (the same seed and build give the same inputs).
    pub seed: u64,
    /// Longest input, bytes.
    pub max_len: usize,
    /// Longest one input may run before it counts as a hang.
    pub timeout: Duration,
    /// Largest live heap, bytes, before an input counts as unbounded memory.
    pub mem_limit: usize,
    /// Where crashing inputs are written.
    pub out_dir: PathBuf,
}

/// What one target's run counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Inputs run (the seeds included).
    pub inputs: u64,
    /// Inputs that panicked or broke a property.
    pub crashes: u64,
    /// Distinct outcome labels seen.
    pub outcomes: usize,
    /// Inputs kept in the corpus (seeds and new outcomes).
    pub corpus: usize,
    /// Files the crashing inputs were written to (the first 16).
    pub crash_files: Vec<PathBuf>,
}

// ---------------------------------------------------------------------------------
// The process-wide guards: panics counted, the current input saved on a hang or when
// the heap passes its limit.

/// Panics seen since the start (any thread).
static PANICS: AtomicU64 = AtomicU64::new(0);
/// The last panic's message.
static LAST_PANIC: Mutex<String> = Mutex::new(String::new());
/// Live heap bytes.
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The heap limit; 0 = none.
static LIMIT: AtomicUsize = AtomicUsize::new(0);
/// The input running now (pointer and length; null when none) and the NUL-terminated
/// path its bytes go to when the heap limit is passed.
static CURRENT_PTR: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static CURRENT_LEN: AtomicUsize = AtomicUsize::new(0);
static OOM_PATH: AtomicPtr<libc::c_char> = AtomicPtr::new(std::ptr::null_mut());
/// Set while the allocator reports (so its own writes are not limited again).
static REPORTING: AtomicBool = AtomicBool::new(false);

/// The global allocator of the fuzz binary: the system allocator, counting live bytes
/// and refusing to pass [`Options::mem_limit`] (it saves the running input and exits
/// with status 3 instead).
pub struct LimitedAlloc;

impl LimitedAlloc {
    #[cold]
    fn over_limit(size: usize) -> ! {
        if REPORTING.swap(true, Ordering::SeqCst) {
            // SAFETY: _exit ends the process without running anything else.
            unsafe { libc::_exit(3) }
        }
        let msg = b"\nfak-fuzz: an input passed the heap limit (unbounded memory); input saved\n";
        // SAFETY: plain system calls on valid buffers; nothing here allocates. The
        // current input's pointer and length are those of a live `&[u8]` that `fuzz`
        // set before the run and clears after it; it is only read here.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
            let _ = size;
            let path = OOM_PATH.load(Ordering::SeqCst);
            let ptr = CURRENT_PTR.load(Ordering::SeqCst);
            if !path.is_null() && !ptr.is_null() {
                let fd = libc::open(path, libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC, 0o644);
                if fd >= 0 {
                    libc::write(fd, ptr.cast(), CURRENT_LEN.load(Ordering::SeqCst));
                    libc::close(fd);
                }
            }
            libc::_exit(3)
        }
    }
}

// SAFETY: every method forwards to `System` with the same layout and pointer; the
// bookkeeping only adds and subtracts the sizes of successful allocations.
unsafe impl GlobalAlloc for LimitedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let limit = LIMIT.load(Ordering::Relaxed);
        if limit != 0 && LIVE.load(Ordering::Relaxed).saturating_add(layout.size()) > limit {
            Self::over_limit(layout.size());
        }
        // SAFETY: the caller's layout is passed on unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let limit = LIMIT.load(Ordering::Relaxed);
        if limit != 0 && LIVE.load(Ordering::Relaxed).saturating_add(layout.size()) > limit {
            Self::over_limit(layout.size());
        }
        // SAFETY: as in `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let limit = LIMIT.load(Ordering::Relaxed);
        if limit != 0
            && new_size > layout.size()
            && LIVE
                .load(Ordering::Relaxed)
                .saturating_add(new_size - layout.size())
                > limit
        {
            Self::over_limit(new_size);
        }
        // SAFETY: `ptr` came from this allocator with `layout`; `new_size` is the
        // caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(new_size, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

/// Installs the panic hook that counts panics (once per process) and keeps the message.
fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            let loc = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()))
                .unwrap_or_default();
            let msg = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_default();
            if let Ok(mut last) = LAST_PANIC.lock() {
                *last = format!("panic at {loc}: {msg}");
            }
        }));
    });
}

/// The running input, shared with the watchdog.
struct Running {
    since: Option<Instant>,
    input: Vec<u8>,
}

/// Starts the watchdog of one target: when an input has run longer than `timeout`, it
/// writes the input to `path`, reports, and ends the process with status 2.
fn watchdog(running: Arc<Mutex<Running>>, timeout: Duration, name: &'static str, path: PathBuf) {
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(50).min(timeout));
        let r = running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(since) = r.since {
            if since.elapsed() > timeout {
                let _ = std::fs::write(&path, &r.input);
                eprintln!(
                    "\nfak-fuzz {name}: an input ran longer than {:.1} s (hang); saved to {}",
                    timeout.as_secs_f64(),
                    path.display()
                );
                std::process::exit(2);
            }
        }
    });
}

// ---------------------------------------------------------------------------------
// Mutation.

/// A small fast generator (SplitMix64): the fuzzer needs speed and reproducibility, not
/// statistical quality.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Integers that break length and offset arithmetic, as 64-bit values (written at
/// widths 1, 2, 4 and 8).
const INTERESTING: [u64; 16] = [
    0,
    1,
    2,
    7,
    0x10,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    0x1_0000_0000,
    0x7fff_ffff_ffff_ffff,
    u64::MAX,
];

/// Applies 1 to 8 random mutations to `data`, in place, keeping it at most `max_len`
/// bytes. `other` is a corpus entry to splice from.
pub fn mutate(data: &mut Vec<u8>, other: &[u8], dict: &[Vec<u8>], rng: &mut Rng, max_len: usize) {
    let n = 1 + rng.below(8);
    for _ in 0..n {
        let len = data.len();
        match rng.below(10) {
            0 if len > 0 => {
                let i = rng.below(len);
                data[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                data[i] = rng.next_u64() as u8;
            }
            2 | 3 if len > 0 => {
                let width = [1usize, 2, 4, 8][rng.below(4)];
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let v = if rng.below(4) == 0 {
                    v.wrapping_add(rng.below(5) as u64).wrapping_sub(2)
                } else {
                    v
                };
                let i = rng.below(len);
                let bytes = v.to_le_bytes();
                let end = (i + width).min(len);
                data[i..end].copy_from_slice(&bytes[..end - i]);
            }
            4 if len > 1 => {
                let i = rng.below(len);
                let k = 1 + rng.below((len - i).min(64));
                data.drain(i..i + k);
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let k = 1 + rng.below((len - i).min(64));
                let chunk = data[i..i + k].to_vec();
                let at = rng.below(len + 1);
                data.splice(at..at, chunk);
            }
            6 if !dict.is_empty() => {
                let w = &dict[rng.below(dict.len())];
                let at = rng.below(len + 1);
                if rng.below(2) == 0 || at + w.len() > len {
                    data.splice(at..at, w.iter().copied());
                } else {
                    data[at..at + w.len()].copy_from_slice(w);
                }
            }
            7 if !other.is_empty() => {
                let i = rng.below(other.len());
                let k = 1 + rng.below((other.len() - i).min(256));
                let at = rng.below(len + 1);
                data.splice(at..at, other[i..i + k].iter().copied());
            }
            8 if len > 0 => {
                data.truncate(rng.below(len));
            }
            _ => {
                let at = rng.below(len + 1);
                let k = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..k).map(|_| rng.next_u64() as u8).collect();
                data.splice(at..at, bytes);
            }
        }
        data.truncate(max_len);
    }
}

// ---------------------------------------------------------------------------------
// The loop.

/// Runs one input under the guards: `Ok(label)`, or `Err(message)` for a panic (on any
/// thread) or a broken property.
fn run_one(target: &mut Target, input: &[u8], running: &Mutex<Running>) -> Outcome {
    {
        let mut r = running.lock().unwrap_or_else(|p| p.into_inner());
        r.input.clear();
        r.input.extend_from_slice(input);
        r.since = Some(Instant::now());
    }
    CURRENT_LEN.store(input.len(), Ordering::SeqCst);
    CURRENT_PTR.store(input.as_ptr().cast_mut(), Ordering::SeqCst);
    let before = PANICS.load(Ordering::SeqCst);
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| (target.run)(input)));
    CURRENT_PTR.store(std::ptr::null_mut(), Ordering::SeqCst);
    running.lock().unwrap_or_else(|p| p.into_inner()).since = None;
    let panicked = PANICS.load(Ordering::SeqCst) != before;
    match result {
        Ok(_) | Err(_) if panicked => Err(LAST_PANIC
            .lock()
            .map(|m| m.clone())
            .unwrap_or_else(|_| "panic".into())),
        Ok(outcome) => outcome,
        Err(_) => Err("panic (no message)".into()),
    }
}

/// Fuzzes `target` for `opts.duration`: every seed first, then mutations of the corpus.
/// Prints one line per crash; returns the counts. A hang or a heap past the limit ends
/// the process (see the module docs).
///
/// # Errors
/// I/O errors creating `opts.out_dir` or writing a crashing input.
pub fn fuzz(target: &mut Target, opts: &Options) -> std::io::Result<Report> {
    install_panic_hook();
    std::fs::create_dir_all(&opts.out_dir)?;
    let oom_path = std::ffi::CString::new(
        opts.out_dir
            .join(format!("{}-oom.bin", target.name))
            .to_string_lossy()
            .into_owned(),
    )
    .map_err(std::io::Error::other)?;
    // Leaked on purpose: the allocator may read it at any time until the process ends.
    OOM_PATH.store(oom_path.into_raw(), Ordering::SeqCst);
    LIMIT.store(
        LIVE.load(Ordering::SeqCst).saturating_add(opts.mem_limit),
        Ordering::SeqCst,
    );
    let running = Arc::new(Mutex::new(Running {
        since: None,
        input: Vec::new(),
    }));
    watchdog(
        Arc::clone(&running),
        opts.timeout,
        target.name,
        opts.out_dir.join(format!("{}-hang.bin", target.name)),
    );
    let mut rng = Rng::new(opts.seed ^ fnv(target.name.as_bytes()));
    let mut report = Report::default();
    let mut seen: HashSet<String> = HashSet::new();
    let mut corpus: Vec<Vec<u8>> = Vec::new();
    let start = Instant::now();
    let name = target.name;
    let mut record =
        |input: &[u8], outcome: Outcome, report: &mut Report| -> std::io::Result<bool> {
            report.inputs += 1;
            match outcome {
                Ok(label) => Ok(seen.insert(label)),
                Err(msg) => {
                    report.crashes += 1;
                    let path = opts
                        .out_dir
                        .join(format!("{name}-crash-{}.bin", report.crashes));
                    std::fs::write(&path, input)?;
                    println!(
                        "fak-fuzz {name}: CRASH {}: {} (input {} bytes saved to {})",
                        report.crashes,
                        msg.lines().next().unwrap_or(""),
                        input.len(),
                        path.display()
                    );
                    if report.crash_files.len() < 16 {
                        report.crash_files.push(path);
                    }
                    Ok(false)
                }
            }
        };
    let seeds = std::mem::take(&mut target.seeds);
    for s in &seeds {
        let s = &s[..s.len().min(opts.max_len)];
        let out = run_one(target, s, &running);
        record(s, out, &mut report)?;
        corpus.push(s.to_vec());
    }
    target.seeds = seeds;
    let dict = std::mem::take(&mut target.dictionary);
    let mut input = Vec::with_capacity(opts.max_len);
    while start.elapsed() < opts.duration && !corpus.is_empty() {
        let base = rng.below(corpus.len());
        let other = rng.below(corpus.len());
        input.clear();
        input.extend_from_slice(&corpus[base]);
        mutate(&mut input, &corpus[other], &dict, &mut rng, opts.max_len);
        let out = run_one(target, &input, &running);
        if record(&input, out, &mut report)? && corpus.len() < 4096 {
            corpus.push(input.clone());
        }
    }
    target.dictionary = dict;
    // Stop the watchdog from reading a stale entry, and lift the limit.
    LIMIT.store(0, Ordering::SeqCst);
    report.outcomes = seen.len();
    report.corpus = corpus.len();
    Ok(report)
}

/// Runs one saved input through `target` (for triage): its outcome.
pub fn replay(target: &mut Target, input: &[u8]) -> Outcome {
    install_panic_hook();
    let running = Mutex::new(Running {
        since: None,
        input: Vec::new(),
    });
    run_one(target, input, &running)
}

/// FNV-1a of `b` (mixes a target's name into the seed).
fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The default folder for crashing inputs: `<target dir>/fuzz` beside the binary when it
/// can be found, else `fuzz-out` in the working folder.
pub fn default_out_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .map(|p| p.join("fuzz"))
        .unwrap_or_else(|| PathBuf::from("fuzz-out"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The panic counter is one per process, so the tests that panic on purpose run one
    /// at a time (libtest runs tests in parallel threads of one process; a panic of one
    /// test would otherwise count as a crash of the other's input).
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn opts(dir: &Path) -> Options {
        Options {
            duration: Duration::from_millis(300),
            seed: 1,
            max_len: 64,
            timeout: Duration::from_secs(30),
            mem_limit: usize::MAX / 2,
            out_dir: dir.to_path_buf(),
        }
    }

    /// A target that panics on inputs with a 0xff byte: the fuzzer finds it, counts it
    /// and writes the input, so a CI run with a crash fails.
    #[test]
    fn a_panicking_input_is_counted_and_saved() {
        let _serial = one_at_a_time();
        let dir = std::env::temp_dir().join(format!("fak-fuzz-test-{}", std::process::id()));
        let mut t = Target {
            name: "panics",
            seeds: vec![b"abc".to_vec()],
            dictionary: vec![],
            run: Box::new(|d| {
                assert!(!d.contains(&0xff), "found the byte");
                Ok(format!("len {}", d.len().min(4)))
            }),
        };
        let r = fuzz(&mut t, &opts(&dir)).unwrap();
        assert!(r.inputs > 100, "{r:?}");
        assert!(r.crashes > 0, "{r:?}");
        let saved = std::fs::read(&r.crash_files[0]).unwrap();
        assert!(saved.contains(&0xff));
        assert!(replay(&mut t, &saved).is_err());
        assert_eq!(replay(&mut t, b"abc"), Ok("len 3".into()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A broken property (`Err`) counts as a crash; a panic on another thread counts too.
    #[test]
    fn errors_and_panics_on_other_threads_are_crashes() {
        let _serial = one_at_a_time();
        let mut t = Target {
            name: "props",
            seeds: vec![],
            dictionary: vec![],
            run: Box::new(|d| match d.first() {
                Some(1) => Err("property broken".into()),
                Some(2) => {
                    let _ = std::thread::spawn(|| panic!("in a worker")).join();
                    Ok("joined".into())
                }
                _ => Ok("fine".into()),
            }),
        };
        assert_eq!(replay(&mut t, &[0]), Ok("fine".into()));
        assert_eq!(replay(&mut t, &[1]), Err("property broken".into()));
        let e = replay(&mut t, &[2]).unwrap_err();
        assert!(e.contains("in a worker"), "{e}");
    }

    /// Mutations stay within the length limit and change the input.
    #[test]
    fn mutations_respect_max_len() {
        let mut rng = Rng::new(7);
        let mut changed = 0;
        for _ in 0..2000 {
            let mut d = b"hello world".to_vec();
            mutate(&mut d, b"other", &[b"<|im_end|>".to_vec()], &mut rng, 16);
            assert!(d.len() <= 16);
            changed += usize::from(d != b"hello world");
        }
        assert!(changed > 1800, "{changed}");
    }
}
