//! fak-tensor's quantized dot products against an independent route: the weight row
//! dequantized by this crate (bit-exact with gguf-py, rung R1a) times the dequantized
//! Q8 activations, summed in f64.
//!
//! The two routes compute the same mathematical sum `Σ_e W_e A_e` of the same
//! dequantized values; they differ only in f32 rounding (the kernel's float
//! combination, the dequantizer's own rounding of `W_e`) and, for Q4_1/Q5_1, in the
//! Q8_1 block's stored sum `s` (an f16 of `d · Σq` with the unrounded scale). The
//! tolerance is derived from those sources alone:
//!
//! - Rounding (standard bound, Higham §3.1): every product term of the kernel passes
//!   through at most `nb + 8` roundings of unit `u = 2^-24` (combined scale, int→f32,
//!   product: 3; one lane addition per block: `nb`; the 3-level lane tree; the final
//!   `± summ`; and the dequantizer's rounding of `W_e`: 1), so the difference is at
//!   most `γ_k · S` with `k = nb + 8`, `γ_k = k u / (1 - k u)`, and `S` the sum of the
//!   magnitudes of all terms. The kernel's terms are `d q_w · a` (where `d q_w` is
//!   `W_e` plus at most the block's min magnitude `M_e`) and the min terms (at most
//!   `M_e |A_e|` in total), so `S ≤ Σ_e (|W_e| + 2 M_e) |A_e|`, with `M_e = |m|`
//!   (Q4_1, Q5_1), `63 |dmin|` (Q4_K, Q5_K, 6-bit mins) and 0 otherwise.
//! - Q8_1's `s`: `|s - f16(d) Σq| ≤ (2^-11 + 2^-11 + 2^-23) |Σq| |d| ≤ 2^-10 (1 + 2^-8)
//!   |Σq| |f16(d)|` (one f16 rounding of `s`, one of `d`, one f32 rounding of
//!   `Σq · d`) plus `2^-25` when `s` is an f16 subnormal; each block adds `|m|` times
//!   that.
//!
//! A negative control shows the tolerance is tight enough to catch a layout error:
//! swapping the two 16-element halves of every 32-element chunk of the dequantized
//! row (a nibble-order bug) lands far outside it.

use fak_tensor::quant::{self, QType, QuantizedActs};
use fak_weights::{dequantize, f16_bits_to_f32, GgmlType};

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

fn ggml(ty: QType) -> GgmlType {
    match ty {
        QType::Q4_0 => GgmlType::Q4_0,
        // Row groups hold Q4_1 blocks (their own test: fak-tensor's quant tests).
        QType::Q4_1 | QType::Q4_1R16 => GgmlType::Q4_1,
        QType::Q5_0 => GgmlType::Q5_0,
        QType::Q5_1 => GgmlType::Q5_1,
        // Row pairs and row groups hold Q8_0 blocks (their own tests: fak-tensor's quant
        // tests).
        QType::Q8_0 | QType::Q8_0R2 | QType::Q8_0R16 => GgmlType::Q8_0,
        QType::Q4K => GgmlType::Q4_K,
        QType::Q5K => GgmlType::Q5_K,
        QType::Q6K => GgmlType::Q6_K,
    }
}

fn f16_le(b: &[u8], at: usize) -> f64 {
    f16_bits_to_f32(u16::from_le_bytes([b[at], b[at + 1]])) as f64
}

/// `rows` random weight rows of `cols` elements: random bytes (every quant, scale
/// and min code) with ordinary f16 scales, like a real checkpoint's.
fn weight_rows(r: &mut Rng, ty: QType, rows: usize, cols: usize) -> Vec<u8> {
    let bb = ty.block_bytes();
    let n = rows * cols / ty.block_elems();
    let mut w: Vec<u8> = (0..n * bb).map(|_| (r.next() >> 8) as u8).collect();
    let fields: &[usize] = match ty {
        QType::Q4_0 | QType::Q5_0 | QType::Q8_0 | QType::Q8_0R2 | QType::Q8_0R16 => &[0],
        QType::Q4_1 | QType::Q4_1R16 | QType::Q5_1 | QType::Q4K | QType::Q5K => &[0, 2],
        QType::Q6K => &[208],
    };
    for b in w.chunks_exact_mut(bb) {
        for &at in fields {
            let v = half::f16::from_f32(r.unit() * 0.02).to_bits();
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    w
}

/// The dequantized activations `A_e` (exact in f64) and, for Q8_1, the per-block bound
/// on `|s - f16(d) Σq|`.
fn act_values(act: &QuantizedActs) -> (Vec<f64>, Vec<f64>) {
    let mut a = Vec::new();
    let mut s_err = Vec::new();
    match act {
        QuantizedActs::Q8_0(v) => {
            for b in v {
                let d = f16_bits_to_f32(b.d) as f64;
                a.extend(b.qs.iter().map(|&q| d * q as f64));
            }
        }
        QuantizedActs::Q8_1(v) => {
            for b in v {
                let d = f16_bits_to_f32(b.d) as f64;
                a.extend(b.qs.iter().map(|&q| d * q as f64));
                let sum: i32 = b.qs.iter().map(|&q| q as i32).sum();
                let sub = if (b.s & 0x7c00) == 0 {
                    2f64.powi(-25)
                } else {
                    0.0
                };
                s_err.push(2f64.powi(-10) * (1.0 + 2f64.powi(-8)) * (sum as f64 * d).abs() + sub);
            }
        }
        QuantizedActs::Q8K(v) => {
            for b in v {
                a.extend(b.qs.iter().map(|&q| b.d as f64 * q as f64));
            }
        }
    }
    (a, s_err)
}

/// `M_e` of the module docs for every element of one row.
fn min_magnitudes(ty: QType, row: &[u8]) -> Vec<f64> {
    let per_block = |b: &[u8]| match ty {
        QType::Q4_1 | QType::Q5_1 => f16_le(b, 2).abs(),
        QType::Q4K | QType::Q5K => 63.0 * f16_le(b, 2).abs(),
        _ => 0.0,
    };
    row.chunks_exact(ty.block_bytes())
        .flat_map(|b| std::iter::repeat_n(per_block(b), ty.block_elems()))
        .collect()
}

#[test]
fn quantized_dot_matches_dequantized_f64_within_derived_bound() {
    let mut r = Rng(2024);
    let (rows, cols) = (16, 1536);
    let u = 2f64.powi(-24);
    for ty in QType::ALL {
        let nb = cols / ty.block_elems();
        let k = (nb + 8) as f64;
        let gamma = k * u / (1.0 - k * u);
        let w = weight_rows(&mut r, ty, rows, cols);
        let x: Vec<f32> = (0..cols).map(|_| r.unit() * 2.0).collect();
        let act = quant::quantize_activation(ty, &x).unwrap();
        let (a, s_err) = act_values(&act);
        let mut worst_ratio = 0f64;
        let mut control_ratio = f64::INFINITY;
        for row in w.chunks_exact(nb * ty.block_bytes()) {
            let mut wf = vec![0f32; cols];
            dequantize(ggml(ty), row, &mut wf).unwrap();
            let exact: f64 = wf.iter().zip(&a).map(|(&w, &a)| w as f64 * a).sum();
            let mins = min_magnitudes(ty, row);
            let s_mag: f64 = wf
                .iter()
                .zip(&a)
                .zip(&mins)
                .map(|((&w, &a), &m)| ((w as f64).abs() + 2.0 * m) * a.abs())
                .sum();
            let block_m: Vec<f64> = mins.iter().step_by(ty.block_elems()).copied().collect();
            let s_term: f64 = block_m.iter().zip(&s_err).map(|(m, e)| m * e).sum();
            let tol = gamma * s_mag + s_term;

            let got = quant::vec_dot_ref(ty, row, &act).unwrap() as f64;
            let fast = quant::vec_dot(ty, row, &act).unwrap() as f64;
            assert_eq!(got.to_bits(), fast.to_bits(), "{ty}");
            assert!(
                (got - exact).abs() <= tol,
                "{ty}: kernel {got:e}, dequantized f64 {exact:e}, |diff| {:e} > tol {tol:e}",
                (got - exact).abs()
            );
            worst_ratio = worst_ratio.max((got - exact).abs() / tol);

            // Negative control: the halves of each 32-element chunk swapped.
            let swapped: f64 = (0..cols).map(|e| wf[e ^ 16] as f64 * a[e]).sum();
            control_ratio = control_ratio.min((got - swapped).abs() / tol);
        }
        println!(
            "{ty}: worst |diff| / tol = {worst_ratio:.3}; control min |diff| / tol = {control_ratio:.0}"
        );
        assert!(
            control_ratio > 10.0,
            "{ty}: the control is not caught ({control_ratio})"
        );
    }
}
