//! Quantized matrix-vector product throughput, one thread: GB/s of weight bytes
//! streamed, scalar reference vs the dispatched (AVX2) kernel, per weight type.
//!
//! Shapes are SmolLM2-135M's MLP: `[1536, 576]` (ffn_up/gate) for the 32-element
//! types; the K types need rows that are a multiple of 256 elements, so they use
//! `[576, 1536]` (ffn_down). "hot" repeats one matrix (it stays in cache); "stream"
//! cycles through copies totalling at least 64 MiB, so the weights come from memory as
//! in decode. Each figure is the median of the repeats. The f32 line is the existing
//! `matmul` (n = 1, one thread) on the same shape, for comparison.
//!
//! Run: `cargo run --release -p fak-tensor --example qdot_bench [repeats]`

use fak_tensor::quant::{self, QType};
use fak_tensor::{matmul, matmul_ref, Threads};
use std::hint::black_box;
use std::time::Instant;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 16
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 24) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `f(i)` over `repeats` calls (`i` = call index).
fn time(repeats: usize, mut f: impl FnMut(usize)) -> f64 {
    f(0); // warm-up
    median(
        (0..repeats)
            .map(|i| {
                let t = Instant::now();
                f(i);
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

const STREAM_BYTES: usize = 64 << 20;

/// GB/s of a plain read of [`STREAM_BYTES`] (a wrapping sum of `u64` words, which the
/// compiler vectorizes) on 1 and on 2 threads, each thread summing one contiguous half:
/// the memory's own rate, the ceiling for a decode step that reads every weight once.
/// Median of `repeats` passes.
fn memory_read_gbs(repeats: usize) -> [f64; 2] {
    let words: Vec<u64> = (0..STREAM_BYTES / 8).map(|i| i as u64).collect();
    let sum = |w: &[u64]| w.iter().fold(0u64, |a, &b| a.wrapping_add(b));
    let rate = |threads: usize| {
        let s = time(repeats, |_| {
            let part = words.len().div_ceil(threads);
            let total = std::thread::scope(|sc| {
                let hs: Vec<_> = words
                    .chunks(part)
                    .map(|c| sc.spawn(move || sum(c)))
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().expect("a summing thread"))
                    .fold(0u64, u64::wrapping_add)
            });
            black_box(total);
        });
        STREAM_BYTES as f64 / s / 1e9
    };
    [rate(1), rate(2)]
}

fn main() {
    let repeats: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(101);
    println!(
        "AVX2 kernels: {}; one thread; median of {repeats}; GB/s = weight bytes / time",
        if quant::has_avx2_f16c() {
            "yes"
        } else {
            "NO (both columns scalar)"
        }
    );
    println!(
        "{:<5} {:>11} {:>9} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6}",
        "type", "shape", "MiB", "hot ref", "hot simd", "x", "strm ref", "strm simd", "x"
    );
    let mut r = Rng(1);
    for ty in QType::ALL {
        let (rows, cols) = if ty.block_elems() == 256 {
            (576, 1536)
        } else {
            (1536, 576)
        };
        let bytes = rows * cols / ty.block_elems() * ty.block_bytes();
        let copies = STREAM_BYTES.div_ceil(bytes);
        let mut w: Vec<u8> = (0..bytes * copies).map(|_| (r.next() >> 8) as u8).collect();
        // Ordinary f16 scales so the sums are ordinary numbers (speed does not depend
        // on values, but NaNs could).
        let scale_at: &[usize] = match ty {
            QType::Q6K => &[208],
            QType::Q4_0 | QType::Q5_0 | QType::Q8_0 => &[0],
            _ => &[0, 2],
        };
        for b in w.chunks_exact_mut(ty.block_bytes()) {
            for &at in scale_at {
                b[at..at + 2].copy_from_slice(&quant::f32_to_f16(0.01).to_le_bytes());
            }
        }
        let x: Vec<f32> = (0..cols).map(|_| r.unit()).collect();
        let act = quant::quantize_activation(ty, &x).expect("cols is a block multiple");
        let mut out = vec![0f32; rows];
        let mut run = |simd: bool, stream: bool| {
            let s = time(repeats, |i| {
                let c = if stream { i % copies } else { 0 };
                let m = &w[c * bytes..(c + 1) * bytes];
                let res = if simd {
                    quant::matvec(ty, m, &act, &mut out)
                } else {
                    quant::matvec_ref(ty, m, &act, &mut out)
                };
                res.expect("shapes are consistent");
                black_box(&out);
            });
            bytes as f64 / s / 1e9
        };
        let (hr, hs) = (run(false, false), run(true, false));
        let (sr, ss) = (run(false, true), run(true, true));
        println!(
            "{:<5} {:>11} {:>9.2} | {:>9.2} {:>9.2} {:>6.1} | {:>9.2} {:>9.2} {:>6.1}",
            ty.name(),
            format!("{rows}x{cols}"),
            bytes as f64 / (1 << 20) as f64,
            hr,
            hs,
            hs / hr,
            sr,
            ss,
            ss / sr
        );
    }
    // Thread scaling of the pooled product in the streamed case: the same matrices on
    // 1 and 2 threads of the shared pool (as decode runs them). [1536, 576] is an MLP
    // matrix; [49152, 576] is SmolLM2's output head (30 MB in Q8_0).
    println!("stream, pooled (`matvec_threads`), GB/s: 1 thread | 2 threads | ratio");
    let plain = memory_read_gbs(repeats);
    println!(
        "{:<5} {:>11} {:>9.2} | {:>9.2} | {:>5.2}   (a plain sum over {} MiB: the memory's rate)",
        "-",
        "-",
        plain[0],
        plain[1],
        plain[1] / plain[0],
        STREAM_BYTES >> 20
    );
    for (ty, rows, cols) in [
        (QType::Q4_1, 1536, 576),
        (QType::Q8_0, 1536, 576),
        (QType::Q4_1, 49152, 576),
        (QType::Q8_0, 49152, 576),
        (QType::Q8_0, 262144, 640),
    ] {
        let bytes = rows * cols / ty.block_elems() * ty.block_bytes();
        let copies = STREAM_BYTES.div_ceil(bytes);
        let w: Vec<u8> = (0..bytes * copies).map(|_| (r.next() >> 8) as u8).collect();
        let x: Vec<f32> = (0..cols).map(|_| r.unit()).collect();
        let act = quant::quantize_activation(ty, &x).expect("cols is a block multiple");
        let mut out = vec![0f32; rows];
        let mut run = |threads: usize| {
            let s = time(repeats * 10, |i| {
                let c = i % copies;
                let m = &w[c * bytes..(c + 1) * bytes];
                quant::matvec_threads(ty, m, &act, &mut out, Threads::new(threads))
                    .expect("shapes are consistent");
                black_box(&out);
            });
            bytes as f64 / s / 1e9
        };
        let (one, two) = (run(1), run(2));
        println!(
            "{:<5} {:>11} {one:>9.2} | {two:>9.2} | {:>5.2}",
            ty.name(),
            format!("{rows}x{cols}"),
            two / one
        );
    }
    // The f32 product (`matmul` with one token, as the F32 file's decode runs it) on
    // the same shapes.
    for (rows, cols) in [(1536, 576), (49152, 576)] {
        let elems = rows * cols;
        let copies = (STREAM_BYTES / 4).div_ceil(elems);
        let w: Vec<f32> = (0..elems * copies).map(|_| r.unit()).collect();
        let x: Vec<f32> = (0..cols).map(|_| r.unit()).collect();
        let mut out = vec![0f32; rows];
        let mut run = |threads: usize| {
            let s = time(repeats * 10, |i| {
                let c = i % copies;
                let m = &w[c * elems..(c + 1) * elems];
                matmul(m, rows, cols, &x, 1, &mut out, Threads::new(threads));
                black_box(&out);
            });
            (elems * 4) as f64 / s / 1e9
        };
        let (one, two) = (run(1), run(2));
        println!(
            "{:<5} {:>11} {one:>9.2} | {two:>9.2} | {:>5.2}",
            "F32",
            format!("{rows}x{cols}"),
            two / one
        );
    }
    // Prefill: the multi-token tiles, 64 tokens at once on one thread, against the
    // scalar reference per token; the weights stay in cache (as a 32 KB chunk of a
    // pooled product does), so GB/s counts every token's pass over the weights.
    let n = 64;
    println!("multi-token (`matmul_threads`, {n} tokens, one thread), weight GB/s x tokens:");
    println!(
        "{:<5} {:>11} | {:>9} {:>9} {:>6}",
        "type", "shape", "ref", "simd", "x"
    );
    for ty in [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
    ] {
        let (rows, cols) = (1536, 576);
        let bytes = rows * cols / ty.block_elems() * ty.block_bytes();
        let mut w: Vec<u8> = (0..bytes).map(|_| (r.next() >> 8) as u8).collect();
        for b in w.chunks_exact_mut(ty.block_bytes()) {
            b[0..2].copy_from_slice(&quant::f32_to_f16(0.01).to_le_bytes());
        }
        let acts: Vec<_> = (0..n)
            .map(|_| {
                let x: Vec<f32> = (0..cols).map(|_| r.unit()).collect();
                quant::quantize_activation(ty, &x).expect("cols is a block multiple")
            })
            .collect();
        let mut out = vec![0f32; rows * n];
        let reps = (repeats / 10).max(3);
        let s = time(reps, |_| {
            quant::matmul_threads(ty, &w, &acts, &mut out, Threads::new(1))
                .expect("shapes are consistent");
            black_box(&out);
        });
        let r1 = time(reps, |_| {
            for (a, o) in acts.iter().zip(out.chunks_exact_mut(rows)) {
                quant::matvec_ref(ty, &w, a, o).expect("shapes are consistent");
            }
            black_box(&out);
        });
        let gbs = |s: f64| (bytes * n) as f64 / s / 1e9;
        println!(
            "{:<5} {:>11} | {:>9.2} {:>9.2} {:>6.1}",
            ty.name(),
            format!("{rows}x{cols}"),
            gbs(r1),
            gbs(s),
            r1 / s
        );
    }
    // The f32 tiles (the F32 file's and the exact path's prefill), the MLP's two
    // shapes, the same token count: weight GB/s x tokens as above, and GFLOP/s (2 per
    // weight per token).
    for (rows, cols) in [(1536, 576), (576, 1536)] {
        let w: Vec<f32> = (0..rows * cols).map(|_| r.unit()).collect();
        let x: Vec<f32> = (0..n * cols).map(|_| r.unit()).collect();
        let mut out = vec![0f32; rows * n];
        let reps = (repeats / 10).max(3);
        let s = time(reps, |_| {
            matmul(&w, rows, cols, &x, n, &mut out, Threads::new(1));
            black_box(&out);
        });
        let r1 = time(reps, |_| {
            matmul_ref(&w, rows, cols, &x, n, &mut out);
            black_box(&out);
        });
        let gbs = |s: f64| (rows * cols * 4 * n) as f64 / s / 1e9;
        println!(
            "{:<5} {:>11} | {:>9.2} {:>9.2} {:>6.1}   ({:.1} GFLOP/s)",
            "F32",
            format!("{rows}x{cols}"),
            gbs(r1),
            gbs(s),
            r1 / s,
            (2 * rows * cols * n) as f64 / s / 1e9
        );
    }
    // f32 for comparison (the exact path's kernel), same ffn_up shape.
    let (rows, cols) = (1536, 576);
    let bytes = rows * cols * 4;
    let copies = STREAM_BYTES.div_ceil(bytes);
    let w: Vec<f32> = (0..rows * cols * copies).map(|_| r.unit()).collect();
    let x: Vec<f32> = (0..cols).map(|_| r.unit()).collect();
    let mut out = vec![0f32; rows];
    let mut run = |stream: bool| {
        let s = time(repeats, |i| {
            let c = if stream { i % copies } else { 0 };
            let m = &w[c * rows * cols..(c + 1) * rows * cols];
            matmul(m, rows, cols, &x, 1, &mut out, Threads::new(1));
            black_box(&out);
        });
        bytes as f64 / s / 1e9
    };
    let (h, s) = (run(false), run(true));
    println!(
        "{:<5} {:>11} {:>9.2} | {:>9} {:>9.2} {:>6} | {:>9} {:>9.2} {:>6}",
        "F32",
        format!("{rows}x{cols}"),
        bytes as f64 / (1 << 20) as f64,
        "",
        h,
        "",
        "",
        s,
        ""
    );
}
