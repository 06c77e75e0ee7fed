//! How fast the 2-D F32 matrices of a GGUF file are read where they lie in its memory
//! map: a plain read (each thread summing one contiguous half of every matrix) against
//! fak's one-token f32 product (`fak_tensor::matmul` with one token, the F32 file's
//! decode kernel) over the same matrices, on 1 and 2 threads, in GB/s of weights.
//!
//! Both read the same page-cache pages through the same mapping, so the plain read is
//! the ceiling a decode step's weight reads can expect on this machine (a decode step
//! reads every matrix once); `docs/performance.md` compares the two. Medians of the
//! passes (default 7, after one warm-up pass); files without 2-D F32 matrices are
//! refused.
//!
//! Run: `cargo run --release -p fak-weights --example mapped_read_bench -- FILE.gguf [passes]`
//! (an F32 file, e.g. one converted by llama.cpp's quantize with `f32`, as
//! `scripts/bench-vs-llamacpp --type f32` does).

use fak_tensor::{matmul, Threads};
use fak_weights::GgufFile;
use std::hint::black_box;
use std::time::Instant;

/// Median seconds of `passes` calls of `f`, after one warm-up call.
fn median_secs(passes: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..passes)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// A wrapping sum of the values' bits (integer adds, which the compiler vectorizes).
fn sum_bits(v: &[f32]) -> u32 {
    v.iter().fold(0u32, |a, x| a.wrapping_add(x.to_bits()))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: mapped_read_bench FILE.gguf [passes]")?;
    let passes: usize = match args.next() {
        Some(p) => p.parse().map_err(|e| format!("passes {p:?}: {e}"))?,
        None => 7,
    };
    let file = GgufFile::open(&path)?;
    // (weights [rows, cols] in place, rows, cols) of every 2-D F32 matrix.
    let mats: Vec<(&[f32], usize, usize)> = file
        .tensors()
        .iter()
        .filter(|t| t.dims.len() == 2)
        .filter_map(|t| {
            let w = file.tensor_f32_in_place(t)?;
            Some((w, t.dims[1] as usize, t.dims[0] as usize))
        })
        .collect();
    if mats.is_empty() {
        return Err(format!("{path}: no 2-D F32 matrix to read in place").into());
    }
    let bytes: usize = mats.iter().map(|(w, _, _)| w.len() * 4).sum();
    println!(
        "{path}: {} F32 matrices, {:.1} MB; medians of {passes} passes, GB/s of weights",
        mats.len(),
        bytes as f64 / 1e6
    );
    println!("threads | plain read | one-token f32 product | product / read");
    let max_cols = mats.iter().map(|m| m.2).max().unwrap_or(0);
    let max_rows = mats.iter().map(|m| m.1).max().unwrap_or(0);
    let x: Vec<f32> = (0..max_cols)
        .map(|i| (i % 7) as f32 * 0.25 - 0.75)
        .collect();
    let mut out = vec![0f32; max_rows];
    for threads in [1usize, 2] {
        let read = median_secs(passes, || {
            let total = std::thread::scope(|s| {
                let parts: Vec<_> = (0..threads)
                    .map(|part| {
                        let mats = &mats;
                        s.spawn(move || {
                            mats.iter().fold(0u32, |a, (w, _, _)| {
                                let per = w.len().div_ceil(threads);
                                let mine =
                                    &w[(part * per).min(w.len())..((part + 1) * per).min(w.len())];
                                a.wrapping_add(sum_bits(mine))
                            })
                        })
                    })
                    .collect();
                parts
                    .into_iter()
                    .map(|h| h.join().expect("a summing thread"))
                    .fold(0u32, u32::wrapping_add)
            });
            black_box(total);
        });
        let product = median_secs(passes, || {
            for (w, rows, cols) in &mats {
                let o = &mut out[..*rows];
                matmul(w, *rows, *cols, &x[..*cols], 1, o, Threads::new(threads));
                black_box(&o);
            }
        });
        let gbs = |s: f64| bytes as f64 / s / 1e9;
        println!(
            "{threads:>7} | {:>10.1} | {:>21.1} | {:>14.2}",
            gbs(read),
            gbs(product),
            read / product
        );
    }
    Ok(())
}
