//! Issue 7's "no per-token allocation in decode": a counting global allocator around
//! decode steps ([`Session::decode`]) on the real models, every thread of the process
//! counted (the pool's workers too), and the count must be zero.
//!
//! Configurations: SmolLM2-135M-Instruct native (Q4_1 and Q8_0 matrices in the map) and
//! exact (every weight `f32`), and Gemma 3 270M native (Q5_0, Q8_0, Q4_K and Q6_K;
//! sliding windows, q/k norms, norms after attention and MLP), each on 1, 2 and 3
//! threads. A few steps after the prefill grow the session's buffers first (the
//! forward pass's scratch, the spare logits row, the pools), then 8 steps are counted.
//! The logits of the last counted step must also be bit-identical to a prefill of the
//! same tokens with fresh buffers ([`Model::forward`]), so reused buffers change no bit.
//!
//! One test function in its own binary: the allocator is global to the process, and
//! another test running beside it would be counted. Without the model files the test
//! fails with the command that fetches them (`FAK_SKIP_REAL_MODEL=1` reports it as
//! ignored, never in CI).

use fak_kv::Session;
use fak_kv::{KvCache, KvType};
use fak_model::{LogitsWanted, Model, WeightMode};
use fak_tensor::Threads;
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

/// [`System`], counting the allocations (and reallocations) made while [`ARMED`].
struct Counting;

static ARMED: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);

fn count(size: usize) {
    if ARMED.load(SeqCst) {
        ALLOCS.fetch_add(1, SeqCst);
        BYTES.fetch_add(size, SeqCst);
    }
}

// SAFETY: every call is forwarded to `System` with the same arguments; the counting
// touches only atomics and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn cached(name: &str) -> PathBuf {
    fak_catalog::require_cached(name).unwrap_or_else(|m| panic!("{m}"))
}

/// Prefills `prompt`, warms up with 3 decode steps, then counts 8 more; returns the
/// allocations and bytes counted. Checks the last step's logits against a prefill of
/// every token with fresh buffers.
fn counted_steps(m: &Arc<Model>, prompt: &[u32], kv: KvType) -> (usize, usize) {
    let mut s = Session::with_kv_type(Arc::clone(m), prompt.len() + 16, kv).expect("kv type");
    let logits = s.prefill(prompt).expect("prefill");
    let mut next = fak_model::argmax(&logits);
    for _ in 0..3 {
        next = fak_model::argmax(s.decode(next).expect("decode"));
    }
    ALLOCS.store(0, SeqCst);
    BYTES.store(0, SeqCst);
    ARMED.store(true, SeqCst);
    for _ in 0..8 {
        match s.decode(next) {
            Ok(logits) => next = fak_model::argmax(logits),
            Err(e) => {
                ARMED.store(false, SeqCst);
                panic!("decode: {e}");
            }
        }
    }
    ARMED.store(false, SeqCst);
    let counted = (ALLOCS.load(SeqCst), BYTES.load(SeqCst));

    // The same tokens in one prefill, with a new scratch: the same bits.
    let ids = s.ids().to_vec();
    let c = m.config();
    let mut cache = KvCache::with_type(c, ids.len(), kv).expect("kv type");
    let pos: Vec<u32> = (0..ids.len() as u32).collect();
    let want = m
        .forward(&ids, &pos, &mut cache, LogitsWanted::Last, None)
        .expect("prefill");
    let got = s.last_logits().expect("logits");
    assert_eq!(got.len(), c.vocab_size);
    let same = got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "decode with kept buffers != prefill with fresh ones");
    counted
}

#[fak_testkit::real_model]
fn decode_steps_allocate_nothing() {
    let smollm2 = cached("smollm2-135m-instruct");
    let gemma3 = cached("gemma3-270m");
    // SmolLM2: `<|im_start|>user\n` and ordinary ids; Gemma 3: `<bos>` and ordinary ids.
    let smol_prompt: Vec<u32> = [1, 4093, 198, 504, 3575, 282, 4649, 314, 253, 3458]
        .into_iter()
        .cycle()
        .take(40)
        .collect();
    let gemma_prompt: Vec<u32> = [2, 818, 5279, 529, 7001, 563, 9079, 236764, 107, 818]
        .into_iter()
        .cycle()
        .take(40)
        .collect();
    let mut failures = Vec::new();
    for (name, path, mode, prompt) in [
        ("SmolLM2 native", &smollm2, WeightMode::Native, &smol_prompt),
        ("SmolLM2 exact", &smollm2, WeightMode::Exact, &smol_prompt),
        ("Gemma 3 native", &gemma3, WeightMode::Native, &gemma_prompt),
    ] {
        let mut m = Model::load_with(path, mode).expect("load");
        for (threads, kv) in [1, 2, 3]
            .into_iter()
            .flat_map(|t| KvType::ALL.map(|k| (t, k)))
        {
            m.set_threads(Threads::new(threads));
            let shared = Arc::new(m);
            let (allocs, bytes) = counted_steps(&shared, prompt, kv);
            println!("{name}, kv {kv}, {threads} thread(s): {allocs} allocations ({bytes} bytes) in 8 decode steps");
            if allocs != 0 {
                failures.push(format!(
                    "{name}, kv {kv}, {threads} thread(s): {allocs} allocations"
                ));
            }
            m = Arc::try_unwrap(shared).unwrap_or_else(|_| panic!("the model is still shared"));
        }
    }
    assert!(failures.is_empty(), "decode steps allocated: {failures:?}");
}
