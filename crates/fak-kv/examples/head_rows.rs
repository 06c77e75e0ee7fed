//! The output head over a subset of its rows against the full head, for subset sizes
//! from 1 row to the whole vocabulary, on the exact and the native weight paths: the
//! time of one head (median of many, microseconds), the ratio, and the largest measured
//! size at which the subset is still faster (the crossover `fak_model::HEAD_ROWS_MAX`
//! is chosen from). The rows are scattered over the vocabulary, as a grammar's allowed
//! tokens are. The input is a real final-norm row (a prompt's last token).
//!
//! `cargo run --release -p fak-kv --example head_rows -- MODEL.gguf [REPS]`

use fak_model::{ForwardTrace, LogitsWanted, Model, VecKvCache, WeightMode};
use fak_tensor::Threads;
use std::time::Instant;

/// Median of `reps` timings of `f`, in microseconds (after one warm-up call).
fn median_us(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Medians (microseconds) of `reps` timings each of `a` and `b`, run alternately.
fn interleaved(reps: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    a();
    b();
    let (mut ta, mut tb) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for _ in 0..reps {
        let t0 = Instant::now();
        a();
        ta.push(t0.elapsed().as_secs_f64() * 1e6);
        let t0 = Instant::now();
        b();
        tb.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    ta.sort_by(f64::total_cmp);
    tb.sort_by(f64::total_cmp);
    (ta[reps / 2], tb[reps / 2])
}

/// `n` distinct rows of `0..vocab`, scattered (a fixed pseudo-random pick), ascending
/// as a grammar's allowed ids are.
fn scattered(n: usize, vocab: usize) -> Vec<u32> {
    let mut taken = vec![false; vocab];
    let mut rows = Vec::with_capacity(n);
    let mut s: u64 = 0x9E37_79B9_7F4A_7C15;
    while rows.len() < n.min(vocab) {
        s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let r = ((s >> 33) as usize) % vocab;
        if !taken[r] {
            taken[r] = true;
            rows.push(r as u32);
        }
    }
    rows.sort_unstable();
    rows
}

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: head_rows MODEL.gguf [REPS]");
        std::process::exit(2);
    };
    let reps: usize = args.next().and_then(|r| r.parse().ok()).unwrap_or(101);
    let path = std::path::PathBuf::from(path);
    for mode in [WeightMode::Native, WeightMode::Exact] {
        let mut model = Model::load_with(&path, mode).expect("model");
        let c = model.config().clone();
        let mut kv = VecKvCache::new(c.num_hidden_layers, 64);
        let mut trace = ForwardTrace::default();
        let ids: Vec<u32> = (1..17).collect();
        let pos: Vec<u32> = (0..16).collect();
        model
            .forward(&ids, &pos, &mut kv, LogitsWanted::Last, Some(&mut trace))
            .expect("forward");
        let h = c.hidden_size;
        let x = trace.final_norm[trace.final_norm.len() - h..].to_vec();
        for threads in [2, 1] {
            model.set_threads(Threads::new(threads));
            let full_alone = median_us(reps, || {
                std::hint::black_box(model.logits_from_normed(&x));
            });
            println!(
                "{} head [{}, {h}], {threads} threads: full {full_alone:.0} us",
                mode.name(),
                c.vocab_size,
            );
            let mut crossover = 0;
            let mut n = 1;
            while n <= c.vocab_size {
                let rows = scattered(n, c.vocab_size);
                // The full head timed again beside each size, so a change in the
                // machine's load between sizes moves both.
                let (full, t) = interleaved(
                    reps,
                    || {
                        std::hint::black_box(model.logits_from_normed(&x));
                    },
                    || {
                        std::hint::black_box(
                            model.logits_rows_from_normed(&x, &rows).expect("rows"),
                        );
                    },
                );
                println!(
                    "  {n:>6} rows: {t:8.1} us against {full:8.1} us ({:.3} of the full head)",
                    t / full
                );
                if t < full {
                    crossover = n;
                }
                n = if n < c.vocab_size && n * 2 > c.vocab_size {
                    c.vocab_size
                } else {
                    n * 2
                };
            }
            println!(
                "  {} {threads} threads: the subset is faster up to {crossover} rows of the \
                 sizes measured (head_rows_pay: up to {} rows)",
                mode.name(),
                (1..=c.vocab_size)
                    .take_while(|&n| model.head_rows_pay(n))
                    .last()
                    .unwrap_or(0)
            );
        }
    }
}
