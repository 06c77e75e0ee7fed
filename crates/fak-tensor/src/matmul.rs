//! Matrix products `out = x · wᵀ` (torch's `F.linear` without bias), threaded by rows.
//!
//! Every output element is one canonical dot product (crate docs), so the result does
//! not depend on how many tokens are in the batch, how rows are tiled, or how many
//! threads share the work: each (row, token) pair is always reduced in the same order.

use crate::dot::{dot_ref, has_avx2_fma};

/// How many OS threads a product may use (at least 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Threads(usize);

impl Threads {
    /// `n` threads; `0` is taken as 1.
    pub fn new(n: usize) -> Self {
        Threads(n.max(1))
    }
    /// One thread per available core (`std::thread::available_parallelism`).
    pub fn available() -> Self {
        Threads::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
    /// The thread count.
    pub fn get(self) -> usize {
        self.0
    }
}

impl Default for Threads {
    fn default() -> Self {
        Threads::available()
    }
}

/// Below this many multiply-adds a product runs on the calling thread only.
const PARALLEL_MIN_MACS: usize = 1 << 16;

/// Reference product: `out[t*rows + r] = dot_ref(w[r], x[t])`, one pair at a time.
///
/// Shapes: `w` is `[rows, cols]`, `x` is `[n, cols]`, `out` is `[n, rows]`.
///
/// # Panics
/// If a slice is shorter than its shape (a programming error).
pub fn matmul_ref(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    check_shapes(w, rows, cols, x, n, out);
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            out[t * rows + r] = dot_ref(&w[r * cols..(r + 1) * cols], xt);
        }
    }
}

fn check_shapes(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize, out: &[f32]) {
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
/// Shapes: `w` is `[rows, cols]` (row-major, like `nn.Linear.weight`), `x` is
/// `[n, cols]`, `out` is `[n, rows]`. Rows are split into contiguous ranges, one per
/// thread.
///
/// # Panics
/// If a slice is shorter than its shape (a programming error).
pub fn matmul(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    threads: Threads,
) {
    check_shapes(w, rows, cols, x, n, out);
    let nt = threads.get().min(rows.max(1));
    if nt <= 1 || rows * cols * n < PARALLEL_MIN_MACS {
        matmul_serial(w, rows, cols, x, n, out, rows);
        return;
    }
    // Contiguous row ranges, a multiple of 8 rows each where possible.
    let per = rows.div_ceil(nt).div_ceil(8) * 8;
    let ranges: Vec<(usize, usize)> = (0..rows)
        .step_by(per)
        .map(|r0| (r0, (r0 + per).min(rows)))
        .collect();
    if n == 1 {
        // The output of one token is one row: give each thread its own sub-slice.
        std::thread::scope(|s| {
            let mut rest = &mut out[..rows];
            for &(r0, r1) in &ranges {
                let (mine, tail) = rest.split_at_mut(r1 - r0);
                rest = tail;
                let wr = &w[r0 * cols..r1 * cols];
                s.spawn(move || matmul_serial(wr, r1 - r0, cols, x, 1, mine, r1 - r0));
            }
        });
        return;
    }
    // Several tokens: each thread fills a private [n, chunk] block, copied in after.
    let blocks: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranges
            .iter()
            .map(|&(r0, r1)| {
                let wr = &w[r0 * cols..r1 * cols];
                s.spawn(move || {
                    let mut buf = vec![0f32; n * (r1 - r0)];
                    matmul_serial(wr, r1 - r0, cols, x, n, &mut buf, r1 - r0);
                    buf
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("matmul worker panicked"))
            .collect()
    });
    for (&(r0, r1), buf) in ranges.iter().zip(&blocks) {
        let m = r1 - r0;
        for t in 0..n {
            out[t * rows + r0..t * rows + r1].copy_from_slice(&buf[t * m..(t + 1) * m]);
        }
    }
}

/// Single-threaded product writing `out[t*ldo + r]`.
fn matmul_serial(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    ldo: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time; shapes were checked by the
        // caller (`w` holds `rows*cols`, `x` holds `n*cols`, `out` holds `(n-1)*ldo+rows`).
        unsafe { serial_avx2(w, rows, cols, x, n, out, ldo) };
        return;
    }
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            out[t * ldo + r] = dot_ref(&w[r * cols..(r + 1) * cols], xt);
        }
    }
}

/// Rows per cache block: the block of weights reused across all tokens of a prefill.
#[cfg(target_arch = "x86_64")]
const ROW_BLOCK: usize = 64;

/// # Safety
/// AVX2 and FMA available; shapes as in [`matmul_serial`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn serial_avx2(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    ldo: usize,
) {
    use crate::dot::avx2::{dot_rows, dot_tile};
    if n == 1 {
        let mut r = 0;
        while r + 8 <= rows {
            dot_rows::<8>(&w[r * cols..], cols, x, &mut out[r..]);
            r += 8;
        }
        while r < rows {
            dot_rows::<1>(&w[r * cols..], cols, x, &mut out[r..]);
            r += 1;
        }
        return;
    }
    const R: usize = 4;
    const T: usize = 3;
    let mut rb = 0;
    while rb < rows {
        let re = (rb + ROW_BLOCK).min(rows);
        let mut t = 0;
        while t < n {
            let tn = (n - t).min(T);
            let xt = &x[t * cols..];
            let o = &mut out[t * ldo..];
            let mut r = rb;
            while r + R <= re {
                let wr = &w[r * cols..];
                let o = &mut o[r..];
                match tn {
                    3 => dot_tile::<R, 3>(wr, xt, cols, o, ldo),
                    2 => dot_tile::<R, 2>(wr, xt, cols, o, ldo),
                    _ => dot_tile::<R, 1>(wr, xt, cols, o, ldo),
                }
                r += R;
            }
            while r < re {
                let wr = &w[r * cols..];
                let o = &mut o[r..];
                match tn {
                    3 => dot_tile::<1, 3>(wr, xt, cols, o, ldo),
                    2 => dot_tile::<1, 2>(wr, xt, cols, o, ldo),
                    _ => dot_tile::<1, 1>(wr, xt, cols, o, ldo),
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
}
