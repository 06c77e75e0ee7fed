//! Q8_0 (ggml `block_q8_0`): the activation block of Q4_0, Q5_0 and Q8_0 weights, its
//! quantizer (ggml `quantize_row_q8_0_ref`), and Q8_0 weights × Q8_0 activations.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::unpack::{accumulate_block, block_sum, weight_blocks};
use super::{check_multiple, check_row, f16_to_f32, f32_to_f16, has_avx2_f16c};
use super::{QType, QuantError, QK};
use bytemuck::{Pod, Zeroable};

/// Q8_0 block (ggml `block_q8_0`, 34 bytes on little-endian targets): 32 elements
/// `x_e ≈ f16(d) * qs[e]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// Scale, IEEE f16 bits.
    pub d: u16,
    /// Quants.
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

/// `amax = MAX(amax, |v|)` over a block, with C's `MAX(a, b) = a > b ? a : b`, so a
/// NaN element makes `amax` NaN exactly as in ggml.
pub(crate) fn c_amax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |m, v| if m > v.abs() { m } else { v.abs() })
}

/// Shared body of the Q8_0/Q8_1 quantizers: `(d, qs)` with `d = amax / 127`,
/// `qs = roundf(x / d)` (ties away from zero), `qs = 0` when `d == 0`. The vector
/// quantizers (`avx2::quantize_q8_0`, `avx2::quantize_q8_1`) are tested against it.
pub(crate) fn q8_block_ref(x: &[f32]) -> (f32, [i8; QK]) {
    let d = c_amax(x) / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        // |v * id| <= 127 up to rounding, so `round` lands in -127..=127; `as`
        // saturates anything else (non-finite input) instead of being undefined.
        *q = (v * id).round() as i8;
    }
    (d, qs)
}

/// Quantize activations to Q8_0, block by block (ggml `quantize_row_q8_0_ref`):
/// `d = max|x| / 127`, `qs = roundf(x · (1/d))` (ties away from zero), stored
/// `d` rounded to f16. Quants stay in `-127..=127`.
///
/// Shapes: `x` is `[n]` with `n` a multiple of 32; returns `n / 32` blocks.
/// Non-finite inputs give meaningless (but defined) blocks.
///
/// # Errors
/// [`QuantError::NotBlockMultiple`] when `n % 32 != 0`.
pub fn quantize_q8_0(x: &[f32]) -> Result<Vec<BlockQ8_0>, QuantError> {
    let mut out = Vec::new();
    quantize_q8_0_into(x, &mut out)?;
    Ok(out)
}

/// [`quantize_q8_0`] into `out` (cleared first; its capacity is reused, so a caller
/// that keeps `out` allocates nothing once it has grown to `x.len() / 32` blocks).
///
/// # Errors
/// As [`quantize_q8_0`]; `out` is untouched on error.
pub fn quantize_q8_0_into(x: &[f32], out: &mut Vec<BlockQ8_0>) -> Result<(), QuantError> {
    check_multiple(x.len(), QK)?;
    out.clear();
    #[cfg(target_arch = "x86_64")]
    if has_avx2_f16c() {
        // SAFETY: AVX2 and F16C were detected.
        unsafe { avx2::quantize_q8_0(x, out) };
        return Ok(());
    }
    out.extend(x.chunks_exact(QK).map(|c| {
        let (d, qs) = q8_block_ref(c);
        BlockQ8_0 {
            d: f32_to_f16(d),
            qs,
        }
    }));
    Ok(())
}

/// Scalar reference of Q8_0 × Q8_0 in the canonical order ([`super`] docs).
///
/// Shapes: `w` is one row of `a.len()` Q8_0 blocks (`34 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q8_0_q8_0_ref(w: &[u8], a: &[BlockQ8_0]) -> Result<f32, QuantError> {
    check_row(QType::Q8_0, w.len(), a.len())?;
    let mut acc = 0f32;
    for (wb, ab) in weight_blocks::<BlockQ8_0>(w).zip(a) {
        // A weight block's f16 scale is little-endian in the file.
        let d = f16_to_f32(u16::from_le(wb.d)) * f16_to_f32(ab.d);
        acc = accumulate_block(acc, d, block_sum(&wb.qs.map(i32::from), &ab.qs));
    }
    Ok(acc)
}

dispatch!(
    /// Q8_0 weights × Q8_0 activations, one row.
    vec_dot_q8_0_q8_0, vec_dot_q8_0_q8_0_ref, dot_q8_0_q8_0, QType::Q8_0, BlockQ8_0
);

/// Q8_0: `x = q * d` (gguf-py `Q8_0.dequantize_blocks`). `out.len() == 32 * blocks.len()`.
pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_to_f32(b.d);
        for (x, &q) in o.iter_mut().zip(b.qs.iter()) {
            *x = q as f32 * d;
        }
    }
}
