//! Quantized products of a few activation rows (a batched decode step's shapes): µs per
//! product and per row for 1 to 16 rows, per weight type, on 1 and 2 threads, the
//! weights streamed from memory (cycled copies of at least 64 MiB) as in decode. Then
//! the shape of Gemma 3's head (Q8_0 repacked in row pairs, 262,144 × 640, 178 MB, on 2
//! threads) and in groups of 16 rows (as the model repacks it now), 1 and 2 threads: ms
//! per product, the weights' GB/s and the multiply-adds' rate.
//!
//! Run: `cargo run --release -p fak-tensor --example batch_bench [repeats]`

use fak_tensor::quant::{self, QType};
use fak_tensor::Threads;
use std::time::Instant;

const STREAM_BYTES: usize = 64 << 20;

fn main() {
    let repeats: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(201);
    let mut seed = 1u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        seed >> 16
    };
    println!("type     threads  rows  µs/product  µs/row  (median of {repeats})");
    // Q4_1_R16: the Q4_1 matrix as the model repacks it at load with AVX-512 VNNI.
    for ty in [
        QType::Q4_1,
        QType::Q4_1R16,
        QType::Q8_0,
        QType::Q8_0R16,
        QType::Q4K,
        QType::Q6K,
    ] {
        let (rows, cols) = if ty.block_elems() == 256 {
            (576, 1536)
        } else {
            (1536, 576)
        };
        let bytes = rows * cols / ty.block_elems() * ty.block_bytes();
        let copies = STREAM_BYTES.div_ceil(bytes);
        let mut w: Vec<u8> = (0..bytes * copies).map(|_| (next() >> 8) as u8).collect();
        // Ordinary f16 scales (0x3c00 = 1.0) at each block's start so sums stay finite.
        let bb = ty.block_bytes();
        for b in w.chunks_exact_mut(bb) {
            let at = match ty {
                QType::Q6K => 208,
                _ => 0,
            };
            b[at] = 0x00;
            b[at + 1] = 0x3c;
            if matches!(ty, QType::Q4_1 | QType::Q4_1R16) {
                b[2] = 0x00;
                b[3] = 0x3c;
            }
        }
        if ty == QType::Q4_1R16 {
            for c in w.chunks_exact_mut(bytes) {
                let raw = c.to_vec();
                quant::repack_q4_1_r16_into(&raw, rows, cols, c).unwrap();
            }
        }
        if ty == QType::Q8_0R16 {
            for c in w.chunks_exact_mut(bytes) {
                let raw = c.to_vec();
                quant::repack_q8_0_r16_into(&raw, rows, cols, c).unwrap();
            }
        }
        for threads in [1usize, 2] {
            for n in [1usize, 2, 3, 4, 8, 16] {
                let acts: Vec<_> = (0..n)
                    .map(|_| {
                        let x: Vec<f32> = (0..cols)
                            .map(|_| (next() >> 40) as f32 / 8388608.0 - 1.0)
                            .collect();
                        quant::quantize_activation(ty, &x).unwrap()
                    })
                    .collect();
                let (th, mut out) = (Threads::new(threads), vec![0f32; n * rows]);
                let med = median_s(repeats, |i| {
                    let c = i % copies;
                    product(ty, &w[c * bytes..(c + 1) * bytes], &acts, &mut out, th)
                }) * 1e6;
                println!(
                    "{:<8} {threads:>7} {n:>5} {med:>11.1} {:>7.1}",
                    ty.name(),
                    med / n as f64
                );
            }
        }
    }
    head(repeats.min(21), &mut next);
}

/// Gemma 3's head shape (262,144 rows × 640, Q8_0 in row pairs as the model repacks it at
/// load) for 1, 2, 4, 8 and 16 tokens on 2 threads: one copy of 178 MB, read from memory each
/// time (it outgrows every cache).
fn head(repeats: usize, next: &mut impl FnMut() -> u64) {
    let (rows, cols) = (262_144usize, 640usize);
    let bytes = rows * cols / 32 * 34;
    let mut raw: Vec<u8> = (0..bytes).map(|_| (next() >> 8) as u8).collect();
    for b in raw.chunks_exact_mut(34) {
        (b[0], b[1]) = (0x00, 0x3c);
    }
    let layouts = [
        (
            QType::Q8_0R2,
            quant::repack_q8_0_r2(&raw, rows, cols).unwrap(),
        ),
        (
            QType::Q8_0R16,
            quant::repack_q8_0_r16(&raw, rows, cols).unwrap(),
        ),
    ];
    drop(raw);
    println!("Q8_0 head, {rows} x {cols} (median of {repeats})");
    println!("layout    threads  tokens  ms/product  weight GB/s  GMAC/s");
    for threads in [1usize, 2] {
        for n in [1usize, 2, 4, 8, 16] {
            let acts: Vec<_> = (0..n)
                .map(|_| {
                    let x: Vec<f32> = (0..cols)
                        .map(|_| (next() >> 40) as f32 / 8388608.0 - 1.0)
                        .collect();
                    quant::quantize_activation(QType::Q8_0, &x).unwrap()
                })
                .collect();
            let (th, mut out) = (Threads::new(threads), vec![0f32; n * rows]);
            // The two layouts alternately, so a noisy host weighs on both alike.
            let mut ms = [Vec::new(), Vec::new()];
            for _ in 0..3 {
                for (i, (ty, w)) in layouts.iter().enumerate() {
                    ms[i].push(
                        median_s(repeats / 3 + 1, |_| product(*ty, w, &acts, &mut out, th)) * 1e3,
                    );
                }
            }
            for (i, (ty, _)) in layouts.iter().enumerate() {
                ms[i].sort_by(f64::total_cmp);
                let ms = ms[i][1];
                println!(
                    "{:<9} {threads:>7} {n:>7} {ms:>11.2} {:>12.1} {:>7.1}",
                    ty.name(),
                    bytes as f64 / ms / 1e6,
                    (rows * cols * n) as f64 / ms / 1e6
                );
            }
        }
    }
}

/// `acts` times the rows of `w` into `out` (`[tokens, rows]`): the one-token product for
/// one token, else the multi-token one, as a decode step calls them; returns the seconds
/// it took.
fn product(
    ty: QType,
    w: &[u8],
    acts: &[quant::QuantizedActs],
    out: &mut [f32],
    th: Threads,
) -> f64 {
    let t = Instant::now();
    if acts.len() == 1 {
        quant::matvec_threads(ty, w, &acts[0], out, th).unwrap();
    } else {
        quant::matmul_threads(ty, w, acts, out, th).unwrap();
    }
    t.elapsed().as_secs_f64()
}

/// The median of `repeats` timings `run(i)` (seconds) after one untimed warm-up, `i` the
/// repeat's number (0 the warm-up).
fn median_s(repeats: usize, mut run: impl FnMut(usize) -> f64) -> f64 {
    let mut times: Vec<f64> = (0..repeats + 1).map(&mut run).skip(1).collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
