//! Dequantization of ggml block formats to f32.
//!
//! Each format is a plain `#[repr(C)]` block struct whose layout and size follow
//! ggml's `ggml-common.h`, and one scalar function that expands a slice of blocks.
//! The arithmetic reproduces gguf-py's `gguf.quants.dequantize` (`gguf-py/gguf/quants.py`)
//! bit for bit: f16 scales are widened exactly to f32, every product and sum is a
//! single f32 operation in the same order as the numpy expression (no fused
//! multiply-add), so NaN, infinite and subnormal scales give the same bits.
//!
//! All block structs are made of byte arrays only (alignment 1), so a byte slice of
//! any alignment can be viewed as a block slice without copying.

use crate::ggml_type::{GgmlType, QK_K};
use bytemuck::{Pod, Zeroable};
use fak_tensor::quant::k4_scale_min;
use std::mem::size_of;

/// Why a buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// This crate has no dequantizer for the type (i-quants, ternary, MXFP4, integer
    /// types, Q8_1).
    #[error("dequantization of {0} is not supported")]
    Unsupported(GgmlType),
    /// The output length is not a whole number of blocks.
    #[error("{ty}: {n_elements} output elements is not a multiple of the block size {block_size}")]
    NotBlockMultiple {
        /// The type being dequantized.
        ty: GgmlType,
        /// Requested output elements.
        n_elements: usize,
        /// Elements per block of `ty`.
        block_size: usize,
    },
    /// The input byte length does not equal the bytes needed for the output length.
    #[error("{ty}: {got} input bytes, but {n_elements} elements need exactly {expected} bytes")]
    LengthMismatch {
        /// The type being dequantized.
        ty: GgmlType,
        /// Requested output elements.
        n_elements: usize,
        /// Bytes required for `n_elements` of `ty`.
        expected: usize,
        /// Bytes supplied.
        got: usize,
    },
}

/// Widen IEEE binary16 bits to f32 exactly, as numpy's `astype(np.float32)` does
/// (subnormals normalized; NaN sign and payload shifted into place, and a signalling
/// NaN stays signalling, unlike `half::f16::to_f32` and torch, which set the quiet
/// bit; see [`crate::widen_f16`] for that variant).
///
/// This is the conversion gguf-py applies to every f16 scale and to F16 tensors; it is
/// fak-tensor's [`fak_tensor::quant::f16_to_f32`], the widening of the quantized dot
/// products too, defined once there.
pub use fak_tensor::quant::f16_to_f32 as f16_bits_to_f32;

#[inline]
fn f16_le(b: [u8; 2]) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes(b))
}

/// Q4_0 block (ggml `block_q4_0`, 18 bytes): `d` (f16), `qs` 16 bytes holding 32
/// 4-bit quants, element `j < 16` in the low nibble of `qs[j]`, element `j + 16` in
/// the high nibble.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// Scale, IEEE f16 little-endian.
    pub d: [u8; 2],
    /// Packed nibbles.
    pub qs: [u8; 16],
}
const _: () = assert!(size_of::<BlockQ4_0>() == 18);

/// Q4_1 block (ggml `block_q4_1`, 20 bytes): `d`, `m` (f16), `qs` as in [`BlockQ4_0`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// Scale, f16.
    pub d: [u8; 2],
    /// Minimum (offset), f16.
    pub m: [u8; 2],
    /// Packed nibbles.
    pub qs: [u8; 16],
}
const _: () = assert!(size_of::<BlockQ4_1>() == 20);

/// Q5_0 block (ggml `block_q5_0`, 22 bytes): `d` (f16), `qh` the fifth bit of
/// element `j` at bit `j` of a little-endian u32, `qs` the low nibbles as in Q4_0.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// Scale, f16.
    pub d: [u8; 2],
    /// High bits, u32 little-endian.
    pub qh: [u8; 4],
    /// Low nibbles.
    pub qs: [u8; 16],
}
const _: () = assert!(size_of::<BlockQ5_0>() == 22);

/// Q5_1 block (ggml `block_q5_1`, 24 bytes): `d`, `m` (f16), `qh`, `qs` as in Q5_0.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_1 {
    /// Scale, f16.
    pub d: [u8; 2],
    /// Minimum, f16.
    pub m: [u8; 2],
    /// High bits, u32 little-endian.
    pub qh: [u8; 4],
    /// Low nibbles.
    pub qs: [u8; 16],
}
const _: () = assert!(size_of::<BlockQ5_1>() == 24);

/// Q8_0 block (ggml `block_q8_0`, 34 bytes): `d` (f16) and 32 signed bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// Scale, f16.
    pub d: [u8; 2],
    /// Quants, i8 stored as bytes.
    pub qs: [u8; 32],
}
const _: () = assert!(size_of::<BlockQ8_0>() == 34);

/// Q2_K super-block (ggml `block_q2_K`, 84 bytes, 256 elements in 16 groups of 16).
///
/// `scales[k]`: low nibble scales group `k`, high nibble is its min. Element `e`
/// (half `e / 128`, shift `(e % 128) / 32`, lane `e % 32`) is 2 bits of
/// `qs[half * 32 + lane] >> (2 * shift)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ2K {
    /// Per-group 4-bit scale (low) and min (high).
    pub scales: [u8; QK_K / 16],
    /// 2-bit quants.
    pub qs: [u8; QK_K / 4],
    /// Super-block scale for the scales, f16.
    pub d: [u8; 2],
    /// Super-block scale for the mins, f16.
    pub dmin: [u8; 2],
}
const _: () = assert!(size_of::<BlockQ2K>() == 84);

/// Q3_K super-block (ggml `block_q3_K`, 110 bytes, 256 elements in 16 groups of 16).
///
/// Element `e` takes 2 low bits from `qs` as in Q2_K and subtracts 4 when bit
/// `e / 32` of `hmask[e % 32]` is clear. The 16 6-bit scales are packed in 12 bytes:
/// low nibbles from `scales[k % 8]` (`k < 8` low, else high nibble), high 2 bits
/// from `scales[8 + k % 4] >> (2 * (k / 4))`; each scale is biased by 32.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ3K {
    /// High bit of each quant (inverted: clear means subtract 4).
    pub hmask: [u8; QK_K / 8],
    /// Low 2 bits of each quant.
    pub qs: [u8; QK_K / 4],
    /// Packed 6-bit scales.
    pub scales: [u8; 12],
    /// Super-block scale, f16.
    pub d: [u8; 2],
}
const _: () = assert!(size_of::<BlockQ3K>() == 110);

/// Q4_K super-block (ggml `block_q4_K`, 144 bytes, 256 elements in 8 groups of 32).
///
/// Group `g = 2c + h` takes nibble `h` (0 low, 1 high) of `qs[32c .. 32c + 32]`.
/// Scales and mins are 6-bit, packed in 12 bytes as in ggml's `get_scale_min_k4`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4K {
    /// Super-block scale for the scales, f16.
    pub d: [u8; 2],
    /// Super-block scale for the mins, f16.
    pub dmin: [u8; 2],
    /// Packed 6-bit scales and mins.
    pub scales: [u8; 12],
    /// 4-bit quants.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(size_of::<BlockQ4K>() == 144);

/// Q5_K super-block (ggml `block_q5_K`, 176 bytes): as Q4_K plus a fifth bit for
/// group `g` at bit `g` of `qh[lane]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5K {
    /// Super-block scale for the scales, f16.
    pub d: [u8; 2],
    /// Super-block scale for the mins, f16.
    pub dmin: [u8; 2],
    /// Packed 6-bit scales and mins.
    pub scales: [u8; 12],
    /// Fifth bits.
    pub qh: [u8; QK_K / 8],
    /// Low 4 bits.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(size_of::<BlockQ5K>() == 176);

/// Q6_K super-block (ggml `block_q6_K`, 210 bytes, 256 elements in 16 groups of 16).
///
/// Element `e` (half `e / 128`, `r = e % 128`): low 4 bits are nibble `r / 64` of
/// `ql[64 * half + r % 64]`, high 2 bits are `qh[32 * half + r % 32] >> (2 * (r / 32))`;
/// the 6-bit value is biased by 32; `scales` are i8.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ6K {
    /// Low 4 bits.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits.
    pub qh: [u8; QK_K / 4],
    /// Per-group scales, i8.
    pub scales: [u8; QK_K / 16],
    /// Super-block scale, f16.
    pub d: [u8; 2],
}
const _: () = assert!(size_of::<BlockQ6K>() == 210);

/// Q8_K super-block (ggml `block_q8_K`, 292 bytes): f32 `d`, 256 i8 quants and 16
/// i16 group sums (unused when dequantizing).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8K {
    /// Scale, f32 little-endian.
    pub d: [u8; 4],
    /// Quants, i8.
    pub qs: [u8; QK_K],
    /// Sums of each group of 16 quants, i16 little-endian (ignored here).
    pub bsums: [u8; QK_K / 8],
}
const _: () = assert!(size_of::<BlockQ8K>() == 292);

/// Dequantize `data` holding `out.len()` elements of type `ty` into `out`
/// (row-major, element order as stored).
///
/// Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
/// Q6_K (bit-exact with gguf-py `gguf.quants.dequantize`) and Q8_K (ggml
/// `dequantize_row_q8_K`: `d * q`).
///
/// # Errors
/// [`DequantError::Unsupported`] for other types; [`DequantError::NotBlockMultiple`]
/// when `out.len()` is not a multiple of `ty.block_size()`;
/// [`DequantError::LengthMismatch`] when `data.len()` differs from the bytes needed
/// for `out.len()` elements. `out` is untouched on error.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    use GgmlType::*;
    if !matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
    ) {
        return Err(DequantError::Unsupported(ty));
    }
    let n = out.len();
    let bs = ty.block_size();
    if !n.is_multiple_of(bs) {
        return Err(DequantError::NotBlockMultiple {
            ty,
            n_elements: n,
            block_size: bs,
        });
    }
    let expected = (n / bs).checked_mul(ty.type_size());
    if expected != Some(data.len()) {
        return Err(DequantError::LengthMismatch {
            ty,
            n_elements: n,
            expected: expected.unwrap_or(usize::MAX),
            got: data.len(),
        });
    }
    match ty {
        F32 => dequantize_f32(data, out),
        F16 => dequantize_f16(data, out),
        BF16 => dequantize_bf16(data, out),
        Q4_0 => dequantize_q4_0(blocks(data), out),
        Q4_1 => dequantize_q4_1(blocks(data), out),
        Q5_0 => dequantize_q5_0(blocks(data), out),
        Q5_1 => dequantize_q5_1(blocks(data), out),
        Q8_0 => dequantize_q8_0(blocks(data), out),
        Q2_K => dequantize_q2_k(blocks(data), out),
        Q3_K => dequantize_q3_k(blocks(data), out),
        Q4_K => dequantize_q4_k(blocks(data), out),
        Q5_K => dequantize_q5_k(blocks(data), out),
        Q6_K => dequantize_q6_k(blocks(data), out),
        Q8_K => dequantize_q8_k(blocks(data), out),
        _ => return Err(DequantError::Unsupported(ty)),
    }
    Ok(())
}

/// View bytes as blocks. The caller has checked that `data.len()` is a whole number
/// of blocks; blocks have alignment 1, so the cast cannot fail (an empty slice is
/// returned if it somehow did, and the output is then left as is).
fn blocks<B: Pod>(data: &[u8]) -> &[B] {
    bytemuck::try_cast_slice(data).unwrap_or(&[])
}

/// F32: little-endian copy. `out.len() * 4 == data.len()`.
pub fn dequantize_f32(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// F16: exact widening with [`f16_bits_to_f32`] (gguf-py: `view(np.float16).astype(np.float32)`).
pub fn dequantize_f16(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
        *o = f16_le([b[0], b[1]]);
    }
}

/// BF16: the 16 bits become the top half of an f32 (gguf-py: `int16 << 16`), NaNs
/// untouched.
pub fn dequantize_bf16(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

/// Q4_0: `x = d * (q - 8)` (gguf-py `Q4_0.dequantize_blocks`). `out.len() == 32 * blocks.len()`.
pub fn dequantize_q4_0(blocks: &[BlockQ4_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_le(b.d);
        for j in 0..16 {
            let lo = (b.qs[j] & 0x0f) as i8 - 8;
            let hi = (b.qs[j] >> 4) as i8 - 8;
            o[j] = d * lo as f32;
            o[j + 16] = d * hi as f32;
        }
    }
}

/// Q4_1: `x = (d * q) + m` (gguf-py `Q4_1.dequantize_blocks`).
pub fn dequantize_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_le(b.d);
        let m = f16_le(b.m);
        for j in 0..16 {
            let lo = (b.qs[j] & 0x0f) as f32;
            let hi = (b.qs[j] >> 4) as f32;
            o[j] = d * lo + m;
            o[j + 16] = d * hi + m;
        }
    }
}

/// The 5-bit quant of element `j` (0..32) of a Q5_0/Q5_1 block, unbiased.
#[inline]
fn q5_value(qh: u32, qs: &[u8; 16], j: usize) -> u8 {
    let lo = if j < 16 {
        qs[j] & 0x0f
    } else {
        qs[j - 16] >> 4
    };
    let hi = ((qh >> j) & 1) as u8;
    lo | (hi << 4)
}

/// Q5_0: `x = d * (q - 16)` (gguf-py `Q5_0.dequantize_blocks`).
pub fn dequantize_q5_0(blocks: &[BlockQ5_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_le(b.d);
        let qh = u32::from_le_bytes(b.qh);
        for (j, x) in o.iter_mut().enumerate() {
            let q = q5_value(qh, &b.qs, j) as i8 - 16;
            *x = d * q as f32;
        }
    }
}

/// Q5_1: `x = (d * q) + m` (gguf-py `Q5_1.dequantize_blocks`).
pub fn dequantize_q5_1(blocks: &[BlockQ5_1], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_le(b.d);
        let m = f16_le(b.m);
        let qh = u32::from_le_bytes(b.qh);
        for (j, x) in o.iter_mut().enumerate() {
            let q = q5_value(qh, &b.qs, j) as f32;
            *x = d * q + m;
        }
    }
}

/// Q8_0: `x = q * d` (gguf-py `Q8_0.dequantize_blocks`).
pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = f16_le(b.d);
        for (x, &q) in o.iter_mut().zip(b.qs.iter()) {
            *x = (q as i8) as f32 * d;
        }
    }
}

/// Q2_K: per group of 16, `dl = d * (scale & 15)`, `ml = dmin * (scale >> 4)`,
/// `x = (dl * q) - ml` (gguf-py `Q2_K.dequantize_blocks`).
pub fn dequantize_q2_k(blocks: &[BlockQ2K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_le(b.d);
        let dmin = f16_le(b.dmin);
        for (e, x) in o.iter_mut().enumerate() {
            let sc = b.scales[e / 16];
            let dl = d * (sc & 0x0f) as f32;
            let ml = dmin * (sc >> 4) as f32;
            let (half, shift, lane) = (e / 128, (e % 128) / 32, e % 32);
            let q = (b.qs[half * 32 + lane] >> (2 * shift)) & 3;
            *x = dl * q as f32 - ml;
        }
    }
}

/// The 16 signed 6-bit scales of a Q3_K block, bias 32 removed.
fn q3_k_scales(s: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (k, o) in out.iter_mut().enumerate() {
        let lo = if k < 8 { s[k] & 0x0f } else { s[k - 8] >> 4 };
        let hi = (s[8 + k % 4] >> (2 * (k / 4))) & 0x03;
        *o = (lo | (hi << 4)) as i8 - 32;
    }
    out
}

/// Q3_K: per group of 16, `dl = d * scale`, `x = dl * q` with `q` in -4..=3
/// (gguf-py `Q3_K.dequantize_blocks`).
pub fn dequantize_q3_k(blocks: &[BlockQ3K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_le(b.d);
        let scales = q3_k_scales(&b.scales);
        for (e, x) in o.iter_mut().enumerate() {
            let dl = d * scales[e / 16] as f32;
            let (half, shift, lane) = (e / 128, (e % 128) / 32, e % 32);
            let low = ((b.qs[half * 32 + lane] >> (2 * shift)) & 3) as i8;
            let high_set = (b.hmask[lane] >> (e / 32)) & 1 == 1;
            let q = if high_set { low } else { low - 4 };
            *x = dl * q as f32;
        }
    }
}

/// Q4_K: per group of 32, `dg = d * scale`, `mg = dmin * min`, `x = (dg * q) - mg`
/// (gguf-py `Q4_K.dequantize_blocks`).
pub fn dequantize_q4_k(blocks: &[BlockQ4K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_le(b.d);
        let dmin = f16_le(b.dmin);
        let (sc, mn) = k4_scale_min(&b.scales);
        for (g, og) in o.chunks_exact_mut(32).enumerate() {
            let dg = d * sc[g] as f32;
            let mg = dmin * mn[g] as f32;
            let (c, h) = (g / 2, g % 2);
            for (lane, x) in og.iter_mut().enumerate() {
                let q = (b.qs[c * 32 + lane] >> (4 * h)) & 0x0f;
                *x = dg * q as f32 - mg;
            }
        }
    }
}

/// Q5_K: as Q4_K with a fifth bit per quant (gguf-py `Q5_K.dequantize_blocks`).
pub fn dequantize_q5_k(blocks: &[BlockQ5K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_le(b.d);
        let dmin = f16_le(b.dmin);
        let (sc, mn) = k4_scale_min(&b.scales);
        for (g, og) in o.chunks_exact_mut(32).enumerate() {
            let dg = d * sc[g] as f32;
            let mg = dmin * mn[g] as f32;
            let (c, h) = (g / 2, g % 2);
            for (lane, x) in og.iter_mut().enumerate() {
                let lo = (b.qs[c * 32 + lane] >> (4 * h)) & 0x0f;
                let hi = (b.qh[lane] >> g) & 1;
                let q = lo | (hi << 4);
                *x = dg * q as f32 - mg;
            }
        }
    }
}

/// Q6_K: per group of 16, `dl = d * scale`, `x = dl * (q - 32)`
/// (gguf-py `Q6_K.dequantize_blocks`).
pub fn dequantize_q6_k(blocks: &[BlockQ6K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_le(b.d);
        for (e, x) in o.iter_mut().enumerate() {
            let dl = d * (b.scales[e / 16] as i8) as f32;
            let (half, r) = (e / 128, e % 128);
            let lo = (b.ql[64 * half + r % 64] >> (4 * (r / 64))) & 0x0f;
            let hi = (b.qh[32 * half + r % 32] >> (2 * (r / 32))) & 0x03;
            let q = (lo | (hi << 4)) as i8 - 32;
            *x = dl * q as f32;
        }
    }
}

/// Q8_K: `x = d * q` (ggml `dequantize_row_q8_K`; gguf-py has no Q8_K dequantizer).
pub fn dequantize_q8_k(blocks: &[BlockQ8K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = f32::from_le_bytes(b.d);
        for (x, &q) in o.iter_mut().zip(b.qs.iter()) {
            *x = d * (q as i8) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_widening_matches_half_on_every_non_nan() {
        for h in 0..=u16::MAX {
            let ours = f16_bits_to_f32(h);
            let theirs = half::f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}");
                // Quiet NaNs agree bit for bit; signalling NaNs keep their payload here.
                if h & 0x0200 != 0 {
                    assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
                }
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn q4_0_by_hand() {
        // d = 0.5 (f16 0x3800); qs[0] = 0x9F -> element 0 = 15-8 = 7, element 16 = 9-8 = 1.
        let mut block = [0u8; 18];
        block[0..2].copy_from_slice(&0x3800u16.to_le_bytes());
        block[2] = 0x9f;
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_0, &block, &mut out).unwrap();
        assert_eq!(out[0], 3.5);
        assert_eq!(out[16], 0.5);
        assert_eq!(out[1], -4.0);
    }

    #[test]
    fn length_errors() {
        let mut out = [0f32; 31];
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 18], &mut out),
            Err(DequantError::NotBlockMultiple { .. })
        ));
        let mut out = [0f32; 32];
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 17], &mut out),
            Err(DequantError::LengthMismatch { .. })
        ));
        assert_eq!(
            dequantize(GgmlType::IQ2_XXS, &[], &mut []),
            Err(DequantError::Unsupported(GgmlType::IQ2_XXS))
        );
    }
}
