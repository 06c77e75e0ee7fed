//! Quantized dot products: a weight row kept in its GGUF block format times an
//! activation row quantized per block to 8 bits, the pairing ggml uses for its CPU
//! `vec_dot` kernels.
//!
//! | weight type | activation type | block (elements) |
//! |---|---|---|
//! | Q4_0, Q5_0, Q8_0 | [`BlockQ8_0`] | 32 |
//! | Q4_1, Q5_1 | [`BlockQ8_1`] (carries `d * Σq`) | 32 |
//! | Q4_K, Q5_K, Q6_K | [`BlockQ8K`] (f32 scale, 16-element sums) | 256 |
//!
//! Weight block layouts are ggml's `ggml-common.h` (the GGUF tensor data), the same
//! ones `fak_weights::dequant` documents; a weight row is passed as its raw bytes.
//! Activation quantizers follow ggml's reference functions `quantize_row_q8_0_ref`,
//! `quantize_row_q8_1_ref` and `quantize_row_q8_K_ref` (`ggml/src/ggml-quants.c`).
//!
//! # Canonical order
//!
//! Every integer product sum inside a block is exact (bounds below), so only the
//! float combination can depend on order. It is fixed, and the scalar reference
//! (`*_ref`) and the AVX2 kernel perform it with the same operations in the same
//! order, so they agree bit for bit (non-NaN results; a NaN result is NaN in both).
//! f16 scales are widened exactly in both (the AVX2 kernels use the F16C instruction,
//! which gives the same `f32` for every non-NaN f16):
//!
//! 1. Each block contributes eight exact `i32` lane sums `L[m]`, `m = 0..8`; which
//!    elements feed lane `m` is stated per type below (it mirrors the AVX2 register
//!    layout: `maddubs`+`madd` pair adjacent elements, so lane `m` holds elements
//!    `4m..4m+4` of a 32-element chunk).
//! 2. Eight `f32` lane accumulators start at `+0.0`; per block, in block order,
//!    `acc[m] = acc[m] + d * (L[m] as f32)` with `d` the block's combined scale (a
//!    product rounded once, then a multiply and an add rounded separately; no FMA).
//! 3. The lanes are reduced by [`crate::dot::reduce_lanes`]
//!    (`((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`).
//! 4. Types with a minimum/offset term keep one scalar `summ`, accumulated in block
//!    order, and the result is `reduced + summ` (Q4_1, Q5_1) or `reduced - summ`
//!    (Q4_K, Q5_K).
//!
//! Per type (`w` the weight quant with its offset removed, `a` the activation quant,
//! `e` an element index inside the block):
//!
//! - Q4_0 (`w = q - 8`), Q5_0 (`w = q - 16`): `L[m] = Σ_{e=4m}^{4m+3} w_e a_e`,
//!   `d = f16(d_w) * f16(d_a)`.
//! - Q8_0: `L[m] = Σ_{e ∈ {2m, 2m+1, 2m+16, 2m+17}} w_e a_e` (the AVX2 kernel widens to
//!   i16, so that weights and activations of −128 are exact; the AVX-VNNI kernel
//!   reorders the bytes so that `vpdpbusd` sums exactly these four), `d` as Q4_0.
//! - Q4_1, Q5_1 (`w = q`, unsigned): `L` as Q4_0, `d = f16(d_w) * f16(d_a)`,
//!   `summ += f16(m_w) * f16(s_a)`.
//! - Q4_K, Q5_K: `L[m] = Σ_{g=0}^{7} sc_g Σ_{k<4} w_{32g+4m+k} a_{32g+4m+k}`,
//!   `d = d_a * f16(d_w)`; `summ += (d_a * f16(dmin_w)) * (Σ_g mn_g (bsum_{2g} +
//!   bsum_{2g+1})) as f32`.
//! - Q6_K (`w = q - 32`): `L[m] = Σ_{c=0}^{7} sc_{2c + m/4} Σ_{k<4} w_{32c+4m+k}
//!   a_{32c+4m+k}` (i8 scales), `d = d_a * f16(d_w)`.
//!
//! Integer bounds (any bytes, any activation block): a Q6_K lane reaches at most
//! `8 · 128 · 4 · 32 · 128 ≈ 1.7e7`, the largest of all types, far inside `i32`. A
//! lane above `2^24` (reachable only by Q6_K with extreme data) rounds when converted
//! to `f32`, identically in both kernels.

use crate::dot::reduce_lanes;
use std::fmt;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod transposed;
#[cfg(target_arch = "x86_64")]
mod transposed_k;

/// Elements per block of the 32-element types (Q4_0 … Q8_1).
pub const QK: usize = 32;
/// Elements per super-block of the K types (`QK_K` in ggml).
pub const QK_K: usize = 256;

// ---------------------------------------------------------------------------------
// f16 conversions
// ---------------------------------------------------------------------------------

/// Widen IEEE binary16 bits to `f32` exactly (subnormals normalized, NaN payload
/// shifted into place and kept signalling; the same bits as `fak_weights`'
/// `f16_bits_to_f32` and numpy's `astype(np.float32)`).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x03ff) as u32;
    let bits = match exp {
        1..=30 => sign | ((exp + 127 - 15) << 23) | (man << 13),
        0 if man == 0 => sign,
        0 => {
            // Subnormal: man * 2^-24; move the top set bit to bit 10.
            let shift = man.leading_zeros() - 21;
            sign | ((127 - 15 + 1 - shift) << 23) | (((man << shift) & 0x03ff) << 13)
        }
        _ => sign | 0x7f80_0000 | (man << 13),
    };
    f32::from_bits(bits)
}

/// Round an `f32` to the nearest IEEE binary16, ties to even (the rounding of the
/// F16C instruction `vcvtps2ph` and of ggml's `GGML_FP32_TO_FP16`); values at or above
/// 65520 in magnitude become ±infinity; a NaN stays a NaN (quiet, top payload bits
/// kept).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x007f_ffff;
    if exp == 0xff {
        let nan = if man != 0 {
            0x0200 | (man >> 13) as u16
        } else {
            0
        };
        return sign | 0x7c00 | nan;
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // f16 subnormal (or zero): count units of 2^-24.
        if e < -10 {
            return sign; // below 2^-25: rounds to zero (2^-25 itself ties to even 0)
        }
        let m = man | 0x0080_0000;
        let shift = (14 - e) as u32; // 14..=24
        let q = m >> shift;
        let rem = m & ((1 << shift) - 1);
        let half = 1u32 << (shift - 1);
        let q = if rem > half || (rem == half && q & 1 == 1) {
            q + 1
        } else {
            q
        };
        return sign | q as u16; // a carry to 0x400 is the smallest normal, correctly
    }
    let q = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    let q = if rem > 0x1000 || (rem == 0x1000 && q & 1 == 1) {
        q + 1 // a carry into the exponent is correct, up to infinity (0x7c00)
    } else {
        q
    };
    sign | q as u16
}

#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

// ---------------------------------------------------------------------------------
// Activation blocks
// ---------------------------------------------------------------------------------

/// Q8_0 block (ggml `block_q8_0`, 34 bytes on little-endian targets): 32 elements
/// `x_e ≈ f16(d) * qs[e]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ8_0 {
    /// Scale, IEEE f16 bits.
    pub d: u16,
    /// Quants.
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

/// Q8_1 block (ggml `block_q8_1`, 36 bytes on little-endian targets): as Q8_0 plus
/// `s = f16(Σ qs · d)`, which lets a Q4_1/Q5_1 dot product apply the weight minimum
/// once per block.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ8_1 {
    /// Scale, IEEE f16 bits.
    pub d: u16,
    /// `d · Σ qs` (with the unrounded `f32` scale), IEEE f16 bits.
    pub s: u16,
    /// Quants.
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 36);

/// Q8_K super-block (ggml `block_q8_K`, 292 bytes): 256 elements `x_e ≈ d * qs[e]`
/// with an `f32` scale and the sums of each 16 consecutive quants.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8K {
    /// Scale.
    pub d: f32,
    /// Quants.
    pub qs: [i8; QK_K],
    /// `bsums[j] = Σ qs[16j .. 16j + 16]` (the K dot products use it for the mins).
    pub bsums: [i16; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);

// ---------------------------------------------------------------------------------
// Errors and the weight types
// ---------------------------------------------------------------------------------

/// A weight type with a quantized dot product here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QType {
    /// ggml Q4_0 (18-byte blocks of 32).
    Q4_0,
    /// ggml Q4_1 (20-byte blocks of 32).
    Q4_1,
    /// ggml Q5_0 (22-byte blocks of 32).
    Q5_0,
    /// ggml Q5_1 (24-byte blocks of 32).
    Q5_1,
    /// ggml Q8_0 (34-byte blocks of 32).
    Q8_0,
    /// ggml Q4_K (144-byte super-blocks of 256).
    Q4K,
    /// ggml Q5_K (176-byte super-blocks of 256).
    Q5K,
    /// ggml Q6_K (210-byte super-blocks of 256).
    Q6K,
}

/// Which activation block type a weight type pairs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActKind {
    /// [`BlockQ8_0`].
    Q8_0,
    /// [`BlockQ8_1`].
    Q8_1,
    /// [`BlockQ8K`].
    Q8K,
}

impl QType {
    /// Every type, in ggml's type-id order.
    pub const ALL: [QType; 8] = [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q4K,
        QType::Q5K,
        QType::Q6K,
    ];

    /// Elements per block (32, or 256 for the K types).
    pub fn block_elems(self) -> usize {
        match self {
            QType::Q4K | QType::Q5K | QType::Q6K => QK_K,
            _ => QK,
        }
    }

    /// Bytes per block (ggml `type_size`).
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q5_0 => 22,
            QType::Q5_1 => 24,
            QType::Q8_0 => 34,
            QType::Q4K => 144,
            QType::Q5K => 176,
            QType::Q6K => 210,
        }
    }

    /// The activation block type this weight type is multiplied with.
    pub fn act_kind(self) -> ActKind {
        match self {
            QType::Q4_0 | QType::Q5_0 | QType::Q8_0 => ActKind::Q8_0,
            QType::Q4_1 | QType::Q5_1 => ActKind::Q8_1,
            QType::Q4K | QType::Q5K | QType::Q6K => ActKind::Q8K,
        }
    }

    /// ggml's name ("Q4_0", "Q4_K", ...).
    pub fn name(self) -> &'static str {
        match self {
            QType::Q4_0 => "Q4_0",
            QType::Q4_1 => "Q4_1",
            QType::Q5_0 => "Q5_0",
            QType::Q5_1 => "Q5_1",
            QType::Q8_0 => "Q8_0",
            QType::Q4K => "Q4_K",
            QType::Q5K => "Q5_K",
            QType::Q6K => "Q6_K",
        }
    }
}

impl fmt::Display for QType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a quantization or a quantized product was refused. No function in this module
/// panics on bad lengths; it returns one of these.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuantError {
    /// An activation length is not a whole number of blocks.
    NotBlockMultiple {
        /// Elements given.
        len: usize,
        /// Elements per block.
        block: usize,
    },
    /// A weight row's byte length does not hold exactly one block per activation block.
    RowLength {
        /// Weight type.
        ty: QType,
        /// Weight bytes given.
        bytes: usize,
        /// Bytes needed: `activation blocks × block_bytes`.
        expected: usize,
    },
    /// The activation blocks are not the kind this weight type pairs with.
    ActKind {
        /// Weight type.
        ty: QType,
        /// The kind given.
        got: ActKind,
    },
    /// A matrix or output buffer does not match `rows × row bytes` / `rows`.
    MatrixShape {
        /// What was wrong, with the sizes.
        detail: String,
    },
}

impl fmt::Display for QuantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantError::NotBlockMultiple { len, block } => {
                write!(
                    f,
                    "{len} elements is not a multiple of the block size {block}"
                )
            }
            QuantError::RowLength {
                ty,
                bytes,
                expected,
            } => write!(
                f,
                "{ty}: weight row has {bytes} bytes, the activation needs exactly {expected}"
            ),
            QuantError::ActKind { ty, got } => write!(
                f,
                "{ty} weights pair with {:?} activations, got {got:?}",
                ty.act_kind()
            ),
            QuantError::MatrixShape { detail } => write!(f, "quantized matvec: {detail}"),
        }
    }
}

impl std::error::Error for QuantError {}

fn check_row(ty: QType, bytes: usize, blocks: usize) -> Result<(), QuantError> {
    let expected = blocks.checked_mul(ty.block_bytes());
    if expected == Some(bytes) {
        Ok(())
    } else {
        Err(QuantError::RowLength {
            ty,
            bytes,
            expected: expected.unwrap_or(usize::MAX),
        })
    }
}

fn check_multiple(len: usize, block: usize) -> Result<(), QuantError> {
    if len.is_multiple_of(block) {
        Ok(())
    } else {
        Err(QuantError::NotBlockMultiple { len, block })
    }
}

// ---------------------------------------------------------------------------------
// Activation quantizers (ggml reference rounding)
// ---------------------------------------------------------------------------------

/// `amax = MAX(amax, |v|)` over a block, with C's `MAX(a, b) = a > b ? a : b`, so a
/// NaN element makes `amax` NaN exactly as in ggml.
fn c_amax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |m, v| if m > v.abs() { m } else { v.abs() })
}

/// Shared body of the Q8_0/Q8_1 quantizers: `(d, qs)` with `d = amax / 127`,
/// `qs = roundf(x / d)` (ties away from zero), `qs = 0` when `d == 0`. The vector
/// quantizers (`avx2::quantize_q8_0`, `avx2::quantize_q8_1`) are tested against it.
fn q8_block_ref(x: &[f32]) -> (f32, [i8; QK]) {
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

/// Quantize activations to Q8_1 (ggml `quantize_row_q8_1_ref`): as
/// [`quantize_q8_0`], plus `s = f16((Σ qs) as f32 · d)` with the unrounded `f32` `d`.
///
/// # Errors
/// [`QuantError::NotBlockMultiple`] when `x.len() % 32 != 0`.
pub fn quantize_q8_1(x: &[f32]) -> Result<Vec<BlockQ8_1>, QuantError> {
    let mut out = Vec::new();
    quantize_q8_1_into(x, &mut out)?;
    Ok(out)
}

/// [`quantize_q8_1`] into `out` (cleared first, capacity reused, as
/// [`quantize_q8_0_into`]).
///
/// # Errors
/// As [`quantize_q8_1`]; `out` is untouched on error.
pub fn quantize_q8_1_into(x: &[f32], out: &mut Vec<BlockQ8_1>) -> Result<(), QuantError> {
    check_multiple(x.len(), QK)?;
    out.clear();
    #[cfg(target_arch = "x86_64")]
    if has_avx2_f16c() {
        // SAFETY: AVX2 and F16C were detected.
        unsafe { avx2::quantize_q8_1(x, out) };
        return Ok(());
    }
    out.extend(x.chunks_exact(QK).map(|c| {
        let (d, qs) = q8_block_ref(c);
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        BlockQ8_1 {
            d: f32_to_f16(d),
            s: f32_to_f16(sum as f32 * d),
            qs,
        }
    }));
    Ok(())
}

/// Quantize activations to Q8_K (ggml `quantize_row_q8_K_ref`): per 256 elements,
/// `max` is the element of largest magnitude (first one on ties), `iscale = -127 /
/// max`, `qs = min(127, nearest_int(iscale · x))` (ties to even, as ggml's
/// `nearest_int`), `d = 1 / iscale`, `bsums[j] = Σ qs[16j..16j+16]`; an all-zero block
/// gets `d = 0` and zero quants.
///
/// Shapes: `x` is `[n]` with `n` a multiple of 256; returns `n / 256` blocks.
///
/// # Errors
/// [`QuantError::NotBlockMultiple`] when `n % 256 != 0`.
pub fn quantize_q8_k(x: &[f32]) -> Result<Vec<BlockQ8K>, QuantError> {
    let mut out = Vec::new();
    quantize_q8_k_into(x, &mut out)?;
    Ok(out)
}

/// [`quantize_q8_k`] into `out` (cleared first, capacity reused, as
/// [`quantize_q8_0_into`]).
///
/// # Errors
/// As [`quantize_q8_k`]; `out` is untouched on error.
pub fn quantize_q8_k_into(x: &[f32], out: &mut Vec<BlockQ8K>) -> Result<(), QuantError> {
    check_multiple(x.len(), QK_K)?;
    out.clear();
    out.extend(x.chunks_exact(QK_K).map(|c| {
        #[cfg(target_arch = "x86_64")]
        if has_avx2_f16c() {
            // SAFETY: AVX2 and F16C were detected.
            if let Some(b) = c
                .try_into()
                .ok()
                .and_then(|c| unsafe { avx2::q8k_block(c) })
            {
                return b;
            }
        }
        q8k_block_ref(c)
    }));
    Ok(())
}

/// Scalar block of [`quantize_q8_k`] (the reference the vector form is tested
/// against).
fn q8k_block_ref(c: &[f32]) -> BlockQ8K {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in c {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    let mut b = BlockQ8K {
        d: 0.0,
        qs: [0; QK_K],
        bsums: [0; QK_K / 16],
    };
    if amax == 0.0 {
        return b;
    }
    let iscale = -127.0 / max;
    for (q, &v) in b.qs.iter_mut().zip(c) {
        let n = (iscale * v).round_ties_even() as i32;
        *q = n.clamp(-128, 127) as i8;
    }
    for (s, g) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
        *s = g.iter().map(|&q| q as i16).sum();
    }
    b.d = 1.0 / iscale;
    b
}

// ---------------------------------------------------------------------------------
// Weight unpacking shared by the scalar references (and the K scale tables by AVX2)
// ---------------------------------------------------------------------------------

/// The 32 4-bit quants of a Q4_0/Q4_1 `qs` field, element order.
fn nibbles(qs: &[u8]) -> [i32; QK] {
    let mut q = [0i32; QK];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0f) as i32;
        q[j + 16] = (qs[j] >> 4) as i32;
    }
    q
}

/// The 32 5-bit quants of a Q5_0/Q5_1 block: nibbles plus bit `e` of `qh` as bit 4.
fn five_bit(qh: &[u8], qs: &[u8]) -> [i32; QK] {
    let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = nibbles(qs);
    for (e, v) in q.iter_mut().enumerate() {
        *v |= (((h >> e) & 1) << 4) as i32;
    }
    q
}

/// The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block (ggml `get_scale_min_k4`).
pub(crate) fn k4_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// `Σ_g mn_g (bsum_{2g} + bsum_{2g+1})`, exact in `i32` (|·| ≤ 8·63·65534).
pub(crate) fn k_mins(mn: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    let mut s = 0i32;
    for g in 0..8 {
        s += mn[g] as i32 * (bsums[2 * g] as i32 + bsums[2 * g + 1] as i32);
    }
    s
}

/// Lane sums of one 32-element chunk: `L[m] = Σ_{k<4} w[4m+k] a[4m+k]`.
fn lanes4(w: &[i32; QK], a: &[i8]) -> [i32; 8] {
    let mut l = [0i32; 8];
    for (m, lm) in l.iter_mut().enumerate() {
        for k in 0..4 {
            *lm += w[4 * m + k] * a[4 * m + k] as i32;
        }
    }
    l
}

/// `acc[m] = acc[m] + d * (L[m] as f32)`: step 2 of the canonical order.
#[inline(always)]
fn accumulate(acc: &mut [f32; 8], d: f32, l: &[i32; 8]) {
    for m in 0..8 {
        acc[m] += d * l[m] as f32;
    }
}

// ---------------------------------------------------------------------------------
// Scalar references
// ---------------------------------------------------------------------------------

/// Scalar reference of Q4_0 × Q8_0 in the canonical order (module docs).
///
/// Shapes: `w` is one row of `a.len()` Q4_0 blocks (`18 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q4_0_q8_0_ref(w: &[u8], a: &[BlockQ8_0]) -> Result<f32, QuantError> {
    check_row(QType::Q4_0, w.len(), a.len())?;
    let mut acc = [0f32; 8];
    for (wb, ab) in w.chunks_exact(18).zip(a) {
        let d = f16_at(wb, 0) * f16_to_f32(ab.d);
        let q = nibbles(&wb[2..18]).map(|v| v - 8);
        accumulate(&mut acc, d, &lanes4(&q, &ab.qs));
    }
    Ok(reduce_lanes(&acc))
}

/// Scalar reference of Q4_1 × Q8_1 in the canonical order (module docs).
///
/// Shapes: `w` is one row of `a.len()` Q4_1 blocks (`20 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q4_1_q8_1_ref(w: &[u8], a: &[BlockQ8_1]) -> Result<f32, QuantError> {
    check_row(QType::Q4_1, w.len(), a.len())?;
    let mut acc = [0f32; 8];
    let mut summ = 0f32;
    for (wb, ab) in w.chunks_exact(20).zip(a) {
        let d = f16_at(wb, 0) * f16_to_f32(ab.d);
        accumulate(&mut acc, d, &lanes4(&nibbles(&wb[4..20]), &ab.qs));
        summ += f16_at(wb, 2) * f16_to_f32(ab.s);
    }
    Ok(reduce_lanes(&acc) + summ)
}

/// Scalar reference of Q5_0 × Q8_0 in the canonical order (module docs).
///
/// Shapes: `w` is one row of `a.len()` Q5_0 blocks (`22 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q5_0_q8_0_ref(w: &[u8], a: &[BlockQ8_0]) -> Result<f32, QuantError> {
    check_row(QType::Q5_0, w.len(), a.len())?;
    let mut acc = [0f32; 8];
    for (wb, ab) in w.chunks_exact(22).zip(a) {
        let d = f16_at(wb, 0) * f16_to_f32(ab.d);
        let q = five_bit(&wb[2..6], &wb[6..22]).map(|v| v - 16);
        accumulate(&mut acc, d, &lanes4(&q, &ab.qs));
    }
    Ok(reduce_lanes(&acc))
}

/// Scalar reference of Q5_1 × Q8_1 in the canonical order (module docs).
///
/// Shapes: `w` is one row of `a.len()` Q5_1 blocks (`24 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q5_1_q8_1_ref(w: &[u8], a: &[BlockQ8_1]) -> Result<f32, QuantError> {
    check_row(QType::Q5_1, w.len(), a.len())?;
    let mut acc = [0f32; 8];
    let mut summ = 0f32;
    for (wb, ab) in w.chunks_exact(24).zip(a) {
        let d = f16_at(wb, 0) * f16_to_f32(ab.d);
        accumulate(
            &mut acc,
            d,
            &lanes4(&five_bit(&wb[4..8], &wb[8..24]), &ab.qs),
        );
        summ += f16_at(wb, 2) * f16_to_f32(ab.s);
    }
    Ok(reduce_lanes(&acc) + summ)
}

/// Scalar reference of Q8_0 × Q8_0 in the canonical order (module docs; lane `m`
/// holds elements `2m, 2m+1, 2m+16, 2m+17`).
///
/// Shapes: `w` is one row of `a.len()` Q8_0 blocks (`34 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q8_0_q8_0_ref(w: &[u8], a: &[BlockQ8_0]) -> Result<f32, QuantError> {
    check_row(QType::Q8_0, w.len(), a.len())?;
    let mut acc = [0f32; 8];
    for (wb, ab) in w.chunks_exact(34).zip(a) {
        let d = f16_at(wb, 0) * f16_to_f32(ab.d);
        let q = &wb[2..34];
        let mut l = [0i32; 8];
        for (m, lm) in l.iter_mut().enumerate() {
            for e in [2 * m, 2 * m + 1, 2 * m + 16, 2 * m + 17] {
                *lm += (q[e] as i8) as i32 * ab.qs[e] as i32;
            }
        }
        accumulate(&mut acc, d, &l);
    }
    Ok(reduce_lanes(&acc))
}

/// Scalar reference shared by Q4_K and Q5_K: `q(wb, e)` gives the unsigned quant of
/// element `e`.
fn k45_ref(w: &[u8], a: &[BlockQ8K], bytes: usize, q: impl Fn(&[u8], usize) -> i32) -> f32 {
    let mut acc = [0f32; 8];
    let mut summ = 0f32;
    for (wb, ab) in w.chunks_exact(bytes).zip(a) {
        let (sc, mn) = k4_scale_min(&wb[4..16]);
        let mut l = [0i32; 8];
        for (g, &s) in sc.iter().enumerate() {
            let mut wg = [0i32; QK];
            for (lane, v) in wg.iter_mut().enumerate() {
                *v = q(wb, 32 * g + lane);
            }
            let lg = lanes4(&wg, &ab.qs[32 * g..32 * g + 32]);
            for m in 0..8 {
                l[m] += s as i32 * lg[m];
            }
        }
        let d = ab.d * f16_at(wb, 0);
        let dmin = ab.d * f16_at(wb, 2);
        accumulate(&mut acc, d, &l);
        summ += dmin * k_mins(&mn, &ab.bsums) as f32;
    }
    reduce_lanes(&acc) - summ
}

/// Scalar reference of Q4_K × Q8_K in the canonical order (module docs).
///
/// Shapes: `w` is one row of `a.len()` Q4_K super-blocks (`144 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q4_k_q8_k_ref(w: &[u8], a: &[BlockQ8K]) -> Result<f32, QuantError> {
    check_row(QType::Q4K, w.len(), a.len())?;
    // Element e: group g = e / 32 = 2c + h takes nibble h of qs[32c + e % 32].
    Ok(k45_ref(w, a, 144, |wb, e| {
        let (g, lane) = (e / 32, e % 32);
        ((wb[16 + 32 * (g / 2) + lane] >> (4 * (g % 2))) & 0x0f) as i32
    }))
}

/// Scalar reference of Q5_K × Q8_K in the canonical order (module docs).
///
/// Shapes: `w` is one row of `a.len()` Q5_K super-blocks (`176 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q5_k_q8_k_ref(w: &[u8], a: &[BlockQ8K]) -> Result<f32, QuantError> {
    check_row(QType::Q5K, w.len(), a.len())?;
    // As Q4_K (qs at 48), plus bit g of qh[e % 32] as bit 4.
    Ok(k45_ref(w, a, 176, |wb, e| {
        let (g, lane) = (e / 32, e % 32);
        let lo = (wb[48 + 32 * (g / 2) + lane] >> (4 * (g % 2))) & 0x0f;
        let hi = (wb[16 + lane] >> g) & 1;
        (lo | (hi << 4)) as i32
    }))
}

/// Scalar reference of Q6_K × Q8_K in the canonical order (module docs).
///
/// Shapes: `w` is one row of `a.len()` Q6_K super-blocks (`210 · a.len()` bytes).
///
/// # Errors
/// [`QuantError::RowLength`] when the byte length does not match.
pub fn vec_dot_q6_k_q8_k_ref(w: &[u8], a: &[BlockQ8K]) -> Result<f32, QuantError> {
    check_row(QType::Q6K, w.len(), a.len())?;
    let mut acc = [0f32; 8];
    for (wb, ab) in w.chunks_exact(210).zip(a) {
        let (ql, qh, scales) = (&wb[0..128], &wb[128..192], &wb[192..208]);
        let mut l = [0i32; 8];
        for c in 0..8 {
            // Element e (half e / 128, r = e % 128): low nibble r / 64 of
            // ql[64 half + r % 64], high bits 2 (r / 32) of qh[32 half + r % 32].
            let mut wc = [0i32; QK];
            for (lane, v) in wc.iter_mut().enumerate() {
                let e = 32 * c + lane;
                let (half, r) = (e / 128, e % 128);
                let lo = (ql[64 * half + r % 64] >> (4 * (r / 64))) & 0x0f;
                let hi = (qh[32 * half + r % 32] >> (2 * (r / 32))) & 0x03;
                *v = (lo | (hi << 4)) as i32 - 32;
            }
            let lc = lanes4(&wc, &ab.qs[32 * c..32 * c + 32]);
            for m in 0..8 {
                l[m] += (scales[2 * c + m / 4] as i8) as i32 * lc[m];
            }
        }
        accumulate(&mut acc, ab.d * f16_at(wb, 208), &l);
    }
    Ok(reduce_lanes(&acc))
}

// ---------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------

/// Whether the SIMD kernels run on this CPU: they need AVX2 and F16C (every AVX2 CPU
/// has F16C; the scale widening uses it). Detected once per process.
#[inline]
pub fn has_avx2_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has AVX-VNNI (`vpdpbusd` on 256-bit registers), which the
/// 32-element kernels use for their integer lane sums when present (same bits).
/// Detected once per process; `FAK_NO_VNNI=1` turns it off (for comparing the two).
#[inline]
pub fn has_avx_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx2_f16c()
                && std::is_x86_feature_detected!("avxvnni")
                && std::env::var_os("FAK_NO_VNNI").is_none_or(|v| v != "1")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the 512-bit kernels run (Q4_0, Q4_1, Q5_0 and Q5_1: two rows per register
/// in a matvec; the 32-element types' multi-token tiles): AVX-512F/BW/DQ/VL and
/// AVX512-VNNI detected at run time, and neither `FAK_NO_AVX512=1` nor `FAK_NO_VNNI=1`
/// set. They give the same bits as the 256-bit kernels (tests compare all three with
/// the reference).
pub fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx_vnni()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512dq")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512vnni")
                && std::env::var_os("FAK_NO_AVX512").is_none_or(|v| v != "1")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has AVX-512BW and AVX-512VL, which the 256-bit multi-token tiles use
/// (with AVX-VNNI, see [`has_avx_vnni`]) for 32 vector registers and one-instruction
/// word permutes (same bits). Detected once per process; `FAK_NO_AVX512=1` turns it off.
#[inline]
pub(crate) fn has_avx512_bw_vl() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::env::var_os("FAK_NO_AVX512").is_none_or(|v| v != "1")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident, $reference:ident, $simd:ident, $ty:expr, $act:ty) => {
        $(#[$doc])*
        ///
        /// Uses the AVX2 kernel when the CPU has AVX2 and F16C, else the scalar reference; the two
        /// agree bit for bit (canonical order in the module docs).
        ///
        /// # Errors
        /// [`QuantError::RowLength`] when `w.len()` is not `a.len()` blocks.
        #[inline]
        pub fn $name(w: &[u8], a: &[$act]) -> Result<f32, QuantError> {
            check_row($ty, w.len(), a.len())?;
            #[cfg(target_arch = "x86_64")]
            if has_avx2_f16c() {
                // SAFETY: AVX2 and F16C were detected at run time, and `w` holds exactly
                // `a.len()` blocks of this type (checked above), which is all the
                // kernel reads.
                return Ok(unsafe { avx2::$simd(w, a) });
            }
            $reference(w, a)
        }
    };
}

dispatch!(
    /// Q4_0 weights × Q8_0 activations, one row: `Σ_e w_e x_e` over the row.
    vec_dot_q4_0_q8_0, vec_dot_q4_0_q8_0_ref, dot_q4_0_q8_0, QType::Q4_0, BlockQ8_0
);
dispatch!(
    /// Q4_1 weights × Q8_1 activations, one row.
    vec_dot_q4_1_q8_1, vec_dot_q4_1_q8_1_ref, dot_q4_1_q8_1, QType::Q4_1, BlockQ8_1
);
dispatch!(
    /// Q5_0 weights × Q8_0 activations, one row.
    vec_dot_q5_0_q8_0, vec_dot_q5_0_q8_0_ref, dot_q5_0_q8_0, QType::Q5_0, BlockQ8_0
);
dispatch!(
    /// Q5_1 weights × Q8_1 activations, one row.
    vec_dot_q5_1_q8_1, vec_dot_q5_1_q8_1_ref, dot_q5_1_q8_1, QType::Q5_1, BlockQ8_1
);
dispatch!(
    /// Q8_0 weights × Q8_0 activations, one row.
    vec_dot_q8_0_q8_0, vec_dot_q8_0_q8_0_ref, dot_q8_0_q8_0, QType::Q8_0, BlockQ8_0
);
dispatch!(
    /// Q4_K weights × Q8_K activations, one row.
    vec_dot_q4_k_q8_k, vec_dot_q4_k_q8_k_ref, dot_q4_k_q8_k, QType::Q4K, BlockQ8K
);
dispatch!(
    /// Q5_K weights × Q8_K activations, one row.
    vec_dot_q5_k_q8_k, vec_dot_q5_k_q8_k_ref, dot_q5_k_q8_k, QType::Q5K, BlockQ8K
);
dispatch!(
    /// Q6_K weights × Q8_K activations, one row.
    vec_dot_q6_k_q8_k, vec_dot_q6_k_q8_k_ref, dot_q6_k_q8_k, QType::Q6K, BlockQ8K
);

// ---------------------------------------------------------------------------------
// Type-generic entry points
// ---------------------------------------------------------------------------------

/// An activation row quantized for one weight type ([`quantize_activation`]).
#[derive(Clone, Debug, PartialEq)]
pub enum QuantizedActs {
    /// For Q4_0, Q5_0, Q8_0 weights.
    Q8_0(Vec<BlockQ8_0>),
    /// For Q4_1, Q5_1 weights.
    Q8_1(Vec<BlockQ8_1>),
    /// For Q4_K, Q5_K, Q6_K weights.
    Q8K(Vec<BlockQ8K>),
}

impl QuantizedActs {
    /// The block kind held.
    pub fn kind(&self) -> ActKind {
        match self {
            QuantizedActs::Q8_0(_) => ActKind::Q8_0,
            QuantizedActs::Q8_1(_) => ActKind::Q8_1,
            QuantizedActs::Q8K(_) => ActKind::Q8K,
        }
    }

    /// Number of blocks held.
    pub fn blocks(&self) -> usize {
        match self {
            QuantizedActs::Q8_0(v) => v.len(),
            QuantizedActs::Q8_1(v) => v.len(),
            QuantizedActs::Q8K(v) => v.len(),
        }
    }
}

/// Quantize an activation row `x` (`[cols]`) for a product with `ty` weights: Q8_0,
/// Q8_1 or Q8_K as [`QType::act_kind`] says.
///
/// # Errors
/// [`QuantError::NotBlockMultiple`] when `cols` is not a multiple of
/// `ty.block_elems()`.
pub fn quantize_activation(ty: QType, x: &[f32]) -> Result<QuantizedActs, QuantError> {
    Ok(match ty.act_kind() {
        ActKind::Q8_0 => QuantizedActs::Q8_0(quantize_q8_0(x)?),
        ActKind::Q8_1 => QuantizedActs::Q8_1(quantize_q8_1(x)?),
        ActKind::Q8K => QuantizedActs::Q8K(quantize_q8_k(x)?),
    })
}

/// [`quantize_activation`] into `out`, the same blocks: when `out` already holds the
/// kind `ty` needs, its buffer is reused (no allocation once it has grown to the row's
/// blocks), else it is replaced.
///
/// # Errors
/// As [`quantize_activation`]; `out` is untouched on error.
pub fn quantize_activation_into(
    ty: QType,
    x: &[f32],
    out: &mut QuantizedActs,
) -> Result<(), QuantError> {
    use QuantizedActs as A;
    match (ty.act_kind(), out) {
        (ActKind::Q8_0, A::Q8_0(v)) => quantize_q8_0_into(x, v),
        (ActKind::Q8_1, A::Q8_1(v)) => quantize_q8_1_into(x, v),
        (ActKind::Q8K, A::Q8K(v)) => quantize_q8_k_into(x, v),
        (_, out) => {
            *out = quantize_activation(ty, x)?;
            Ok(())
        }
    }
}

/// One row of `ty` weights (`w`, raw GGUF bytes) times `act`, fast kernel when
/// `simd` and the CPU allows, else the scalar reference (identical results).
fn dot_any(ty: QType, w: &[u8], act: &QuantizedActs, simd: bool) -> Result<f32, QuantError> {
    use QuantizedActs as A;
    match (ty, act, simd) {
        (QType::Q4_0, A::Q8_0(a), true) => vec_dot_q4_0_q8_0(w, a),
        (QType::Q4_0, A::Q8_0(a), false) => vec_dot_q4_0_q8_0_ref(w, a),
        (QType::Q5_0, A::Q8_0(a), true) => vec_dot_q5_0_q8_0(w, a),
        (QType::Q5_0, A::Q8_0(a), false) => vec_dot_q5_0_q8_0_ref(w, a),
        (QType::Q8_0, A::Q8_0(a), true) => vec_dot_q8_0_q8_0(w, a),
        (QType::Q8_0, A::Q8_0(a), false) => vec_dot_q8_0_q8_0_ref(w, a),
        (QType::Q4_1, A::Q8_1(a), true) => vec_dot_q4_1_q8_1(w, a),
        (QType::Q4_1, A::Q8_1(a), false) => vec_dot_q4_1_q8_1_ref(w, a),
        (QType::Q5_1, A::Q8_1(a), true) => vec_dot_q5_1_q8_1(w, a),
        (QType::Q5_1, A::Q8_1(a), false) => vec_dot_q5_1_q8_1_ref(w, a),
        (QType::Q4K, A::Q8K(a), true) => vec_dot_q4_k_q8_k(w, a),
        (QType::Q4K, A::Q8K(a), false) => vec_dot_q4_k_q8_k_ref(w, a),
        (QType::Q5K, A::Q8K(a), true) => vec_dot_q5_k_q8_k(w, a),
        (QType::Q5K, A::Q8K(a), false) => vec_dot_q5_k_q8_k_ref(w, a),
        (QType::Q6K, A::Q8K(a), true) => vec_dot_q6_k_q8_k(w, a),
        (QType::Q6K, A::Q8K(a), false) => vec_dot_q6_k_q8_k_ref(w, a),
        _ => Err(QuantError::ActKind {
            ty,
            got: act.kind(),
        }),
    }
}

/// One row of `ty` weights (raw GGUF block bytes) · `act`, dispatched to the AVX2
/// kernel when available; bit-identical to [`vec_dot_ref`].
///
/// # Errors
/// [`QuantError::ActKind`] when `act` is not the kind `ty` pairs with;
/// [`QuantError::RowLength`] when `w` is not exactly `act.blocks()` blocks.
pub fn vec_dot(ty: QType, w: &[u8], act: &QuantizedActs) -> Result<f32, QuantError> {
    dot_any(ty, w, act, true)
}

/// Scalar reference of [`vec_dot`].
///
/// # Errors
/// As [`vec_dot`].
pub fn vec_dot_ref(ty: QType, w: &[u8], act: &QuantizedActs) -> Result<f32, QuantError> {
    dot_any(ty, w, act, false)
}

/// Bytes of one weight row of `ty` against `act`, after checking the pairing.
fn row_bytes(ty: QType, act: &QuantizedActs) -> Result<usize, QuantError> {
    if act.kind() != ty.act_kind() {
        return Err(QuantError::ActKind {
            ty,
            got: act.kind(),
        });
    }
    Ok(act.blocks() * ty.block_bytes())
}

/// Check that `w` is `out.len()` rows against `act`; returns the row byte length.
pub(crate) fn check_matvec(
    ty: QType,
    w: &[u8],
    act: &QuantizedActs,
    rows: usize,
) -> Result<usize, QuantError> {
    let rb = row_bytes(ty, act)?;
    if rb.checked_mul(rows) != Some(w.len()) {
        return Err(QuantError::MatrixShape {
            detail: format!(
                "{ty}: {} weight bytes is not {rows} rows of {rb} bytes",
                w.len()
            ),
        });
    }
    Ok(rb)
}

/// Matrix-vector product `out[r] = vec_dot(ty, w[r], act)` on the calling thread.
///
/// Shapes: `w` is `[rows, cols]` in `ty` blocks (row-major, `rows = out.len()`,
/// each row `act.blocks() · ty.block_bytes()` bytes, as a GGUF tensor stores
/// `nn.Linear.weight`); `act` is the quantized `[cols]` activation.
///
/// # Errors
/// [`QuantError::ActKind`] for a wrong activation kind; [`QuantError::MatrixShape`]
/// when `w.len()` is not `out.len()` rows. `out` is untouched on error.
pub fn matvec(ty: QType, w: &[u8], act: &QuantizedActs, out: &mut [f32]) -> Result<(), QuantError> {
    matvec_with(ty, w, act, out, true)
}

/// Scalar reference of [`matvec`] (same results, bit for bit).
///
/// # Errors
/// As [`matvec`].
pub fn matvec_ref(
    ty: QType,
    w: &[u8],
    act: &QuantizedActs,
    out: &mut [f32],
) -> Result<(), QuantError> {
    matvec_with(ty, w, act, out, false)
}

fn matvec_with(
    ty: QType,
    w: &[u8],
    act: &QuantizedActs,
    out: &mut [f32],
    simd: bool,
) -> Result<(), QuantError> {
    matvec_isa(ty, w, act, out, simd, has_avx_vnni(), has_avx512_vnni())
}

/// [`matvec_with`] with the AVX-VNNI lane sums and the 512-bit row pairs on or off
/// (each ignored without its CPU features), so tests can compare the kernels on one
/// machine.
fn matvec_isa(
    ty: QType,
    w: &[u8],
    act: &QuantizedActs,
    out: &mut [f32],
    simd: bool,
    vnni: bool,
    zmm: bool,
) -> Result<(), QuantError> {
    let vnni = vnni && has_avx_vnni();
    let zmm = zmm && has_avx512_vnni();
    let rb = check_matvec(ty, w, act, out.len())?;
    if rb == 0 {
        out.fill(0.0);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx2_f16c() {
        use QuantizedActs as A;
        // SAFETY (all arms): AVX2 and F16C were detected (AVX-VNNI too when `vnni`,
        // AVX-VNNI, AVX-512F/BW/DQ/VL and AVX512-VNNI when `zmm`); `check_matvec` established that `act`
        // is the kind `ty` pairs with, `rb == ty.block_bytes() * act.blocks()` and
        // `w.len() == rb * out.len()`.
        let done = match (ty, act) {
            (QType::Q4_0, A::Q8_0(a)) if zmm => unsafe { rows4_512::<avx2::Q4_0>(w, rb, a, out) },
            (QType::Q4_1, A::Q8_1(a)) if zmm => unsafe { rows4_512::<avx2::Q4_1>(w, rb, a, out) },
            (QType::Q5_0, A::Q8_0(a)) if zmm => unsafe { rows4_512::<avx2::Q5_0>(w, rb, a, out) },
            (QType::Q5_1, A::Q8_1(a)) if zmm => unsafe { rows4_512::<avx2::Q5_1>(w, rb, a, out) },
            (QType::Q4_0, A::Q8_0(a)) => unsafe { rows4::<avx2::Q4_0>(w, rb, a, out, vnni) },
            (QType::Q4_1, A::Q8_1(a)) => unsafe { rows4::<avx2::Q4_1>(w, rb, a, out, vnni) },
            (QType::Q5_0, A::Q8_0(a)) => unsafe { rows4::<avx2::Q5_0>(w, rb, a, out, vnni) },
            (QType::Q5_1, A::Q8_1(a)) => unsafe { rows4::<avx2::Q5_1>(w, rb, a, out, vnni) },
            (QType::Q8_0, A::Q8_0(a)) => unsafe { rows4::<avx2::Q8_0>(w, rb, a, out, vnni) },
            _ => false,
        };
        if done {
            return Ok(());
        }
    }
    // Row by row (the K-quants'; the rest without AVX2): on CPUs whose weights are
    // prefetched with `T0` the row 8 KB ahead is asked for as each row starts
    // (`avx2::prefetch_row_ahead`).
    #[cfg(target_arch = "x86_64")]
    let ahead = simd && !avx2::nta_prefetch();
    for (i, (o, row)) in out.iter_mut().zip(w.chunks_exact(rb)).enumerate() {
        #[cfg(target_arch = "x86_64")]
        if ahead {
            avx2::prefetch_row_ahead(w, i * rb, rb);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = i;
        *o = dot_any(ty, row, act, simd)?;
    }
    Ok(())
}

/// The 32-element types' matvec: four rows at a time through the interleaved AVX2
/// kernel (each row in exactly its single-row order), the last `rows % 4` one by one;
/// with AVX-VNNI lane sums when the CPU has them and the type asks for them
/// (`Block32::VNNI_ROWS`; the same bits). Returns `true` (it always handles the
/// product).
///
/// # Safety
/// AVX2 and F16C are available, and AVX-VNNI when `vnni`; `rb == K::BYTES * a.len()`;
/// `w.len() == rb * out.len()`.
#[cfg(target_arch = "x86_64")]
unsafe fn rows4<K: avx2::Block32>(
    w: &[u8],
    rb: usize,
    a: &[K::Act],
    out: &mut [f32],
    vnni: bool,
) -> bool
where
    K::Act: avx2::ActBlock,
{
    let scales = avx2::ActScales::new(a);
    let sc = scales.get();
    let va = (vnni && K::VNNI_ROWS).then(|| avx2::vnni_acts::<K>(a));
    let mut outs = out.chunks_exact_mut(4);
    let mut ws = w.chunks_exact(4 * rb);
    for (o, wc) in (&mut outs).zip(&mut ws) {
        match &va {
            Some(va) => avx2::rows_vnni::<K, 4>(wc, rb, va, sc, o),
            None => avx2::rows::<K, 4>(wc, rb, a, sc, o),
        }
    }
    let rest = outs.into_remainder();
    for (o, wr) in rest
        .chunks_exact_mut(1)
        .zip(ws.remainder().chunks_exact(rb))
    {
        match &va {
            Some(va) => avx2::rows_vnni::<K, 1>(wr, rb, va, sc, o),
            None => avx2::rows::<K, 1>(wr, rb, a, sc, o),
        }
    }
    true
}

/// [`rows4`] with the 512-bit kernel for the 4-row groups (two rows per register; the
/// same bits); the last `rows % 4` rows go through the 256-bit VNNI kernel.
///
/// # Safety
/// AVX2, F16C, AVX-VNNI, AVX-512F/BW/DQ/VL and AVX512-VNNI are available;
/// `rb == K::BYTES * a.len()`; `w.len() == rb * out.len()`.
#[cfg(target_arch = "x86_64")]
unsafe fn rows4_512<K: avx2::Tile512>(w: &[u8], rb: usize, a: &[K::Act], out: &mut [f32]) -> bool
where
    K::Act: avx2::ActBlock,
{
    let scales = avx2::ActScales::new(a);
    let sc = scales.get();
    let va = avx2::vnni_acts::<K>(a);
    let mut outs = out.chunks_exact_mut(4);
    let mut ws = w.chunks_exact(4 * rb);
    for (o, wc) in (&mut outs).zip(&mut ws) {
        avx2::rows_pairs_512::<K>(wc, rb, &va, sc, o);
    }
    let rest = outs.into_remainder();
    for (o, wr) in rest
        .chunks_exact_mut(1)
        .zip(ws.remainder().chunks_exact(rb))
    {
        avx2::rows_vnni::<K, 1>(wr, rb, &va, sc, o);
    }
    true
}

/// Output rows per chunk of a pooled multi-token product: a multiple of 4 (the
/// row-group kernel's width) covering about `chunk_bytes` of weights
/// ([`MATMUL_CHUNK_BYTES`]), so that a product is split into several chunks and a slow
/// thread holds up little.
fn chunk_rows(row_bytes: usize, chunk_bytes: usize) -> usize {
    (chunk_bytes / row_bytes.max(1)).div_ceil(4).max(1) * 4
}

/// Output rows per range of a pooled matrix-vector product (decode) split among
/// `parts` threads: one contiguous range per thread, a multiple of 4 rows (the
/// row-group kernel's width), the last range the shortest.
///
/// One long range per thread, rather than many small chunks claimed in turn, because a
/// one-token product is bound by streaming its weights from memory: each chunk is a
/// claim on a counter both threads write and a new stream for the prefetchers to pick
/// up, and chunks claimed alternately leave each thread's reads jumping over the
/// other's (Gemma 3's 262,144-row head was ~1,300 chunks of 128 KB). One range per
/// thread was faster on every model file measured (docs/performance.md, "Why it is
/// fast"). The claims still hand a range to whichever thread is free, so a late thread
/// delays a product by at most one range.
fn matvec_range_rows(rows: usize, parts: usize) -> usize {
    rows.div_ceil(parts.max(1)).div_ceil(4).max(1) * 4
}

/// Weight bytes per chunk of a pooled multi-token product (prefill). Each chunk's
/// weights are read once for all tokens, so the work per byte is many times a
/// matvec's and small chunks balance the threads better (128 KB chunks were slower).
const MATMUL_CHUNK_BYTES: usize = 32 * 1024;

/// [`matvec`] with the output rows split into one contiguous range per thread of the
/// pool (a multiple of 4 rows each, the last the shortest), claimed by the pool's
/// threads ([`crate::pool::Pool::run_chunks`]). One long range per thread rather than
/// many small chunks: a one-token product streams its weights from memory, and every
/// chunk would cost a claim and restart the prefetchers' stream. Each row is the same
/// single-row kernel as in [`matvec`], so the result is bit-identical to [`matvec`] for
/// any thread count.
///
/// # Errors
/// As [`matvec`]; `out` is untouched on error.
pub fn matvec_pool(
    pool: &mut crate::pool::Pool,
    ty: QType,
    w: &[u8],
    act: &QuantizedActs,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let parts = pool.threads();
    chunked(&mut [Matvec { ty, w, act, out }], parts, &mut |n, job| {
        pool.run_chunks(n, job)
    })
}

/// [`matvec`] on up to `threads` threads of the process-wide pool that
/// [`crate::matmul()`] also uses: the output rows are split into contiguous parts as in
/// [`matvec_pool`], so the result is bit-identical to [`matvec`] for any count.
///
/// Small products (under 65,536 weight elements) and products that find the pool busy
/// with another caller run on the calling thread, with the same bits.
///
/// # Errors
/// As [`matvec`]; `out` is untouched on error.
pub fn matvec_threads(
    ty: QType,
    w: &[u8],
    act: &QuantizedActs,
    out: &mut [f32],
    threads: crate::Threads,
) -> Result<(), QuantError> {
    check_matvec(ty, w, act, out.len())?;
    let cols = act.blocks() * ty.block_elems();
    let parts = crate::matmul::parallel_ranges(out.len(), cols, 1, threads);
    if parts <= 1 {
        return matvec(ty, w, act, out);
    }
    matvec_many(
        &mut [Matvec { ty, w, act, out }],
        crate::Threads::new(parts),
    )
}

/// One product of [`matvec_many`]: `out = w · act` as in [`matvec`].
#[derive(Debug)]
pub struct Matvec<'a> {
    /// Weight type of `w`.
    pub ty: QType,
    /// `[out.len(), cols]` weights in `ty` blocks (raw GGUF bytes).
    pub w: &'a [u8],
    /// The quantized `[cols]` input.
    pub act: &'a QuantizedActs,
    /// `[rows]` outputs.
    pub out: &'a mut [f32],
}

/// Several [`matvec`]s in one hand-off to up to `threads` threads of the process-wide
/// pool: every product's rows are cut into one range per thread (as in
/// [`matvec_pool`]) and all the ranges are claimed from one list, so products that read
/// the same input (q, k and v; gate and up) cost one synchronisation instead of one
/// each. Each row is the same single-row kernel as in [`matvec`]: the same bits for any
/// thread count.
///
/// # Errors
/// As [`matvec`], for the first product that fails its shape check; no output is
/// written then.
pub fn matvec_many(products: &mut [Matvec<'_>], threads: crate::Threads) -> Result<(), QuantError> {
    let parts = threads.get().min(crate::matmul::max_useful_threads());
    chunked(products, parts, &mut |n, job| {
        crate::matmul::parallel_chunks(n, threads, job)
    })
}

/// A job over chunk indices, as [`crate::pool::Pool::run_chunks`] takes it.
type ChunkJob<'a> = &'a (dyn Fn(usize) + Sync);

/// Products per hand-off in [`chunked`]: its per-product state lives on the stack, so
/// no list is allocated per call (a decode step makes tens of these calls). q, k and v
/// are three; a longer list runs as several hand-offs.
const CHUNKED_PRODUCTS: usize = 4;

/// Each product's rows cut into `parts` ranges ([`matvec_range_rows`]), every range
/// computed by `run` (which calls the job once per range index, on whichever threads
/// it has). The ranges are numbered product by product, so the threads take a
/// product's ranges together before the next product's. Nothing is allocated: a range's
/// product and rows follow from its index, and its output rows are handed out as
/// [`crate::pool::Disjoint`] parts.
fn chunked(
    products: &mut [Matvec<'_>],
    parts: usize,
    run: &mut dyn FnMut(usize, ChunkJob<'_>),
) -> Result<(), QuantError> {
    use crate::pool::Disjoint;
    use std::sync::{Mutex, PoisonError};
    let mut rbs = [0usize; CHUNKED_PRODUCTS];
    for (p, rb) in products.iter().zip(rbs.iter_mut()) {
        *rb = check_matvec(p.ty, p.w, p.act, p.out.len())?;
    }
    if products.len() > CHUNKED_PRODUCTS {
        // Every shape is checked before any output is written.
        for p in &products[CHUNKED_PRODUCTS..] {
            check_matvec(p.ty, p.w, p.act, p.out.len())?;
        }
        let (head, tail) = products.split_at_mut(CHUNKED_PRODUCTS);
        chunked(head, parts, run)?;
        return chunked(tail, parts, run);
    }
    // Per product: the inputs, the output handed out in parts, rows per range, ranges.
    type Slot<'s> = (
        QType,
        &'s [u8],
        &'s QuantizedActs,
        Disjoint<'s, f32>,
        usize,
        usize,
    );
    let mut slots: [Option<Slot<'_>>; CHUNKED_PRODUCTS] = Default::default();
    let mut total = 0;
    for (p, slot) in products.iter_mut().zip(slots.iter_mut()) {
        let rows = p.out.len();
        let per = matvec_range_rows(rows, parts);
        let ranges = rows.div_ceil(per);
        total += ranges;
        *slot = Some((p.ty, p.w, p.act, Disjoint::new(&mut *p.out), per, ranges));
    }
    let error = Mutex::new(None);
    run(total, &|c| {
        // Range `c`'s product and its first range index.
        let mut first = 0;
        for (&rb, slot) in rbs.iter().zip(&slots) {
            let Some((ty, w, act, out, per, ranges)) = slot else {
                return;
            };
            if c >= first + ranges {
                first += ranges;
                continue;
            }
            let r0 = (c - first) * per;
            let r1 = (r0 + per).min(out.len());
            // SAFETY: the pool calls each index once, and index `c` is the only one
            // naming rows `r0..r1` of this product (the ranges of a product are
            // consecutive and disjoint).
            let o = unsafe { out.part(r0..r1) };
            // Cannot fail after `check_matvec`; kept as an error rather than a panic.
            if let Err(e) = matvec_with(*ty, &w[r0 * rb..r1 * rb], act, o, true) {
                *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
            }
            return;
        }
    });
    match error.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Quantized matrix times several activation rows (a prefill's tokens):
/// `out[t * rows + r] = vec_dot(ty, w[r], acts[t])`, bit-identical to [`matvec`] run
/// on each token alone, for any thread count.
///
/// Shapes: `w` is `[rows, cols]` in `ty` blocks with `rows = out.len() / acts.len()`;
/// `acts` holds `n` quantized `[cols]` rows; `out` is `[n, rows]`. For the 32-element
/// types the AVX2 path unpacks each weight block once for four tokens (and reads the
/// weights once per four tokens); with AVX-512 and AVX512-VNNI, each chunk's weight
/// blocks are prepared once and every 16 tokens run as the token-transposed tiles
/// (one register holds one canonical lane of 16 tokens), the rest as 4-token tiles.
/// The K-quants (Q4_K, Q5_K, Q6_K) run every 16 tokens as token-transposed tiles too
/// with AVX-512 and AVX512-VNNI (`transposed_k`: `vpmaddubsw` and `vpdpwssd` form a
/// lane's scaled integer sum for 16 tokens), and the rest several tokens at a time
/// against each row, each super-block unpacked once for them: four with AVX2, eight
/// where AVX-512VL gives 32 vector registers (`avx2::k_tokens`, `avx2::k_tokens_wide`;
/// each result the one-token kernel's bits). Without AVX2 every type runs [`matvec`]
/// per token. Rows are split between the pool's threads as in [`matvec_threads`].
///
/// # Errors
/// [`QuantError::ActKind`] for a wrong activation kind; [`QuantError::MatrixShape`]
/// when `acts` is empty, the rows differ in length, `out.len()` is not a multiple of
/// `acts.len()`, or `w` is not `rows` rows. `out` is untouched on error.
pub fn matmul_threads(
    ty: QType,
    w: &[u8],
    acts: &[QuantizedActs],
    out: &mut [f32],
    threads: crate::Threads,
) -> Result<(), QuantError> {
    use std::sync::{Mutex, PoisonError};
    let n = acts.len();
    let shape = |detail: String| QuantError::MatrixShape { detail };
    if n == 0 || !out.len().is_multiple_of(n) {
        return Err(shape(format!(
            "{} outputs for {n} activation rows",
            out.len()
        )));
    }
    let rows = out.len() / n;
    let rb = check_matvec(ty, w, &acts[0], rows)?;
    if let Some(a) = acts
        .iter()
        .find(|a| a.kind() != acts[0].kind() || a.blocks() != acts[0].blocks())
    {
        return Err(shape(format!(
            "activation rows of {} and {} blocks",
            acts[0].blocks(),
            a.blocks()
        )));
    }
    let cols = acts[0].blocks() * ty.block_elems();
    let parts = crate::matmul::parallel_ranges(rows, cols, n, threads);
    let shared = (parts > 1).then(|| crate::matmul::shared_pool(parts));
    let mut guard = shared
        .as_ref()
        .and_then(|p| crate::matmul::lock_unless_busy(p));
    // The tokens' tile forms once for the whole product, not once per chunk.
    let tile = TileActs::new(ty, acts, TileIsa::Zmm);
    let Some(pool) = guard.as_deref_mut() else {
        // One thread: all rows at once, straight into `out` (in chunks through a buffer,
        // as below, was slower: every chunk re-reads all tokens' tile forms).
        let mut by_token: Vec<&mut [f32]> = out.chunks_mut(rows).collect();
        return matmul_rows(ty, w, rb, acts, tile.as_ref(), &mut by_token);
    };
    let per = chunk_rows(rb, MATMUL_CHUNK_BYTES);
    let chunks = rows.div_ceil(per);
    // slots[c][t]: chunk c's rows of token t's output. The chunk's kernels write a
    // buffer of its own, `[n, m]`, copied into them after (written straight into the
    // output, Gemma 3's 2-thread prefill was slower; the cause is not pinned down).
    let mut slots: Vec<Vec<&mut [f32]>> = (0..chunks).map(|_| Vec::with_capacity(n)).collect();
    for row in out.chunks_mut(rows) {
        for (c, part) in row.chunks_mut(per).enumerate() {
            slots[c].push(part);
        }
    }
    let slots: Vec<Mutex<Vec<&mut [f32]>>> = slots.into_iter().map(Mutex::new).collect();
    let error = Mutex::new(None);
    pool.run_chunks(chunks, &|c| {
        let r = c * per..((c + 1) * per).min(rows);
        let wc = &w[r.start * rb..r.end * rb];
        let m = r.len();
        let mut buf = vec![0f32; n * m];
        let mut by_token: Vec<&mut [f32]> = buf.chunks_mut(m).collect();
        // Cannot fail after `check_matvec` (so `out` is untouched on every error).
        match matmul_rows(ty, wc, rb, acts, tile.as_ref(), &mut by_token) {
            Ok(()) => {
                let mut slot = slots[c].lock().unwrap_or_else(PoisonError::into_inner);
                for (o, b) in slot.iter_mut().zip(buf.chunks_exact(m)) {
                    o.copy_from_slice(b);
                }
            }
            Err(e) => *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e),
        }
    });
    match error.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The rows of `w` (each `rb` bytes) times every activation row, on the calling
/// thread, into `out` (per activation row, one slice of `w`'s row count): through the
/// AVX2 tiles with `tile` (the activation rows prepared by [`TileActs::new`] from these
/// `acts`), else [`matvec`] per token. Shapes were checked by the caller.
fn matmul_rows(
    ty: QType,
    w: &[u8],
    rb: usize,
    acts: &[QuantizedActs],
    tile: Option<&TileActs<'_>>,
    out: &mut [&mut [f32]],
) -> Result<(), QuantError> {
    // The row count from the output: with zero-length rows (`rb == 0`) every output is
    // the empty sum, which `matvec` writes.
    let m = out.first().map_or(0, |o| o.len());
    if let (Some(tile), true) = (tile, m > 0 && rb > 0) {
        // SAFETY: `tile` holds `acts`, which the caller checked are `rb / ty.block_bytes()`
        // blocks each, of the kind `ty` pairs with (`TileActs::new` re-checked the kind
        // and the type); `w.len() == m * rb` and `out` holds `acts.len()` slices of `m`.
        unsafe { tile.run(w, rb, out) };
        return Ok(());
    }
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        matvec_with(ty, w, a, &mut o[..m], true)?;
    }
    Ok(())
}

/// The multi-token K-quant kernel's form of `ty` (`None`: not a K-quant).
#[cfg(target_arch = "x86_64")]
fn k_quant(ty: QType) -> Option<avx2::KQuant> {
    use avx2::KQuant;
    match ty {
        QType::Q4K => Some(KQuant::Q4),
        QType::Q5K => Some(KQuant::Q5),
        QType::Q6K => Some(KQuant::Q6),
        _ => None,
    }
}

/// [`matmul_rows`] with the tile kernels of `isa` (or the best the CPU has below it),
/// so tests can compare them on one machine.
#[cfg(test)]
fn matmul_rows_isa(
    ty: QType,
    w: &[u8],
    rb: usize,
    acts: &[QuantizedActs],
    out: &mut [f32],
    isa: TileIsa,
) -> Result<(), QuantError> {
    let tile = TileActs::new(ty, acts, isa);
    let m = w.len() / rb;
    let mut by_token: Vec<&mut [f32]> = out.chunks_mut(m).collect();
    matmul_rows(ty, w, rb, acts, tile.as_ref(), &mut by_token)
}

/// Which lane sums the multi-token tiles compute (all give the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum TileIsa {
    /// AVX2 `maddubs`/`madd`.
    Avx2,
    /// AVX-VNNI `vpdpbusd` ([`has_avx_vnni`]).
    Vnni,
    /// AVX-VNNI in code compiled with AVX-512BW and AVX-512VL too
    /// ([`has_avx512_bw_vl`]).
    Vnni512,
    /// As `Vnni512`, and for Q4_1, Q5_0 and Q5_1 the 512-bit tiles holding two tokens
    /// per register ([`tiles_512`], [`has_avx512_vnni`]).
    Zmm,
}

impl TileIsa {
    /// The best this CPU has, at most `cap`.
    fn at_most(cap: TileIsa) -> TileIsa {
        let best = match (has_avx_vnni(), has_avx512_bw_vl()) {
            (true, true) if has_avx512_vnni() => TileIsa::Zmm,
            (true, true) => TileIsa::Vnni512,
            (true, false) => TileIsa::Vnni,
            _ => TileIsa::Avx2,
        };
        best.min(cap)
    }
}

/// A multi-token product's activation rows in the forms the tiles of its weight type
/// read (for the 32-element types scales widened and the AVX-VNNI form when used; the
/// token-transposed forms with AVX-512), prepared once per product rather than once
/// per chunk of rows.
enum TileActs<'a> {
    #[cfg(target_arch = "x86_64")]
    Q4_0(Tiled<'a, avx2::Q4_0>),
    #[cfg(target_arch = "x86_64")]
    Q4_1(Tiled<'a, avx2::Q4_1>),
    #[cfg(target_arch = "x86_64")]
    Q5_0(Tiled<'a, avx2::Q5_0>),
    #[cfg(target_arch = "x86_64")]
    Q5_1(Tiled<'a, avx2::Q5_1>),
    #[cfg(target_arch = "x86_64")]
    Q8_0(Tiled<'a, avx2::Q8_0>),
    /// Q4_K, Q5_K, Q6_K.
    #[cfg(target_arch = "x86_64")]
    K(KTiled<'a>),
    /// (No tiles elsewhere.)
    #[cfg(not(target_arch = "x86_64"))]
    #[allow(dead_code)]
    Never(std::convert::Infallible, std::marker::PhantomData<&'a ()>),
}

/// [`TileActs`] of one type: every token's blocks, their [`avx2::act_scales`] and, with
/// AVX-VNNI, their [`avx2::vnni_acts`].
#[cfg(target_arch = "x86_64")]
struct Tiled<'a, K: avx2::Block32> {
    a: Vec<&'a [K::Act]>,
    sc: Vec<Vec<[f32; 2]>>,
    va: Option<Vec<std::borrow::Cow<'a, [K::VAct]>>>,
    /// [`TileIsa::Vnni512`] or above (with `va`).
    wide: bool,
    /// [`TileIsa::Zmm`]: the 512-bit tiles of [`tiles_512`] (for the types that have
    /// them).
    zmm: bool,
    /// [`TileIsa::Zmm`] and 16 tokens or more: the first multiple of 16 tokens in the
    /// form of the token-transposed tiles ([`transposed`]).
    tt: Option<transposed::Acts>,
}

#[cfg(target_arch = "x86_64")]
impl<'a, K: avx2::Block32> Tiled<'a, K>
where
    K::Act: avx2::ActBlock,
{
    /// # Safety
    /// AVX2 and F16C are available, and what `isa` needs ([`TileIsa::at_most`]).
    unsafe fn new(a: Vec<&'a [K::Act]>, isa: TileIsa) -> Self {
        let sc = a.iter().map(|at| avx2::act_scales(at)).collect();
        let va =
            (isa >= TileIsa::Vnni).then(|| a.iter().map(|at| avx2::vnni_acts::<K>(at)).collect());
        let wide = isa >= TileIsa::Vnni512;
        let zmm = isa == TileIsa::Zmm;
        // The token-transposed form needs AVX2 and F16C (this function's contract); its
        // tiles, which need AVX-512 and AVX512-VNNI, run only when `zmm`.
        let tt = if zmm {
            transposed::Acts::new::<K>(&a)
        } else {
            None
        };
        Tiled {
            a,
            sc,
            va,
            wide,
            zmm,
            tt,
        }
    }
}

/// [`TileActs`] of a K-quant: every token's Q8_K blocks and, with [`TileIsa::Zmm`] and
/// 16 tokens or more, the first multiple of 16 in the form of the token-transposed
/// tiles ([`transposed_k`]); the rest run several tokens at a time against each row
/// ([`avx2::k_tokens`], or [`avx2::k_tokens_wide`] when `wide`).
#[cfg(target_arch = "x86_64")]
struct KTiled<'a> {
    kind: avx2::KQuant,
    a: Vec<&'a [BlockQ8K]>,
    /// AVX-512F/BW/VL ([`has_avx512_bw_vl`]).
    wide: bool,
    tt: Option<transposed_k::Acts>,
}

impl<'a> TileActs<'a> {
    /// The prepared rows, or `None` when the tiles do not apply (no AVX2 and F16C, or
    /// activations of another kind than `ty` pairs with).
    fn new(ty: QType, acts: &'a [QuantizedActs], isa: TileIsa) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if has_avx2_f16c() {
            fn q8_0s(a: &[QuantizedActs]) -> Option<Vec<&[BlockQ8_0]>> {
                a.iter()
                    .map(|q| match q {
                        QuantizedActs::Q8_0(v) => Some(&v[..]),
                        _ => None,
                    })
                    .collect()
            }
            fn q8_1s(a: &[QuantizedActs]) -> Option<Vec<&[BlockQ8_1]>> {
                a.iter()
                    .map(|q| match q {
                        QuantizedActs::Q8_1(v) => Some(&v[..]),
                        _ => None,
                    })
                    .collect()
            }
            let isa = TileIsa::at_most(isa);
            // SAFETY (all arms): AVX2 and F16C were detected, and what `isa` needs
            // (`at_most` gives only what was detected).
            return match ty {
                QType::Q4_0 => q8_0s(acts).map(|a| TileActs::Q4_0(unsafe { Tiled::new(a, isa) })),
                QType::Q5_0 => q8_0s(acts).map(|a| TileActs::Q5_0(unsafe { Tiled::new(a, isa) })),
                QType::Q8_0 => q8_0s(acts).map(|a| TileActs::Q8_0(unsafe { Tiled::new(a, isa) })),
                QType::Q4_1 => q8_1s(acts).map(|a| TileActs::Q4_1(unsafe { Tiled::new(a, isa) })),
                QType::Q5_1 => q8_1s(acts).map(|a| TileActs::Q5_1(unsafe { Tiled::new(a, isa) })),
                QType::Q4K | QType::Q5K | QType::Q6K => {
                    let a: Vec<&[BlockQ8K]> = acts
                        .iter()
                        .map(|q| match q {
                            QuantizedActs::Q8K(v) => Some(&v[..]),
                            _ => None,
                        })
                        .collect::<Option<_>>()?;
                    let tt = if isa == TileIsa::Zmm {
                        transposed_k::Acts::new(&a)
                    } else {
                        None
                    };
                    Some(TileActs::K(KTiled {
                        kind: k_quant(ty)?,
                        a,
                        wide: has_avx512_bw_vl(),
                        tt,
                    }))
                }
            };
        }
        let _ = (ty, acts, isa);
        None
    }

    /// `out[t][r] = dot(row r of w, token t)` through the tiles.
    ///
    /// # Safety
    /// Every token is `rb / K::BYTES` blocks (`K` the held type); `w.len()` is a
    /// multiple of `rb`; `out` holds one slice of `w.len() / rb` outputs per token.
    unsafe fn run(&self, w: &[u8], rb: usize, out: &mut [&mut [f32]]) {
        // SAFETY of the calls: a `TileActs` exists only when AVX2 and F16C were detected
        // (and AVX-VNNI when it holds the VNNI form, AVX-512BW and AVX-512VL too when
        // `wide`, AVX-512F/DQ and AVX512-VNNI too when `zmm`); the shapes are this
        // function's contract.
        match self {
            #[cfg(target_arch = "x86_64")]
            TileActs::Q4_0(t) => {
                let t0 = tiles_transposed(w, rb, t, out);
                tiles(w, rb, t, out, t0)
            }
            #[cfg(target_arch = "x86_64")]
            TileActs::Q4_1(t) => tiles_any(w, rb, t, out),
            #[cfg(target_arch = "x86_64")]
            TileActs::Q5_0(t) => tiles_any(w, rb, t, out),
            #[cfg(target_arch = "x86_64")]
            TileActs::Q5_1(t) => tiles_any(w, rb, t, out),
            #[cfg(target_arch = "x86_64")]
            TileActs::Q8_0(t) => tiles_any(w, rb, t, out),
            #[cfg(target_arch = "x86_64")]
            TileActs::K(t) => {
                let t0 = match &t.tt {
                    Some(tt) => {
                        transposed_k::tiles(w, rb, t.kind, tt, out);
                        tt.tokens()
                    }
                    None => 0,
                };
                let (rest, out) = (&t.a[t0..], &mut out[t0..]);
                if t.wide {
                    avx2::k_tokens_wide(w, rb, rest, t.kind, out);
                } else {
                    avx2::k_tokens(w, rb, rest, t.kind, out);
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            TileActs::Never(never, _) => match *never {},
        }
    }
}

/// The token-transposed tiles ([`transposed::tiles`]) for the first multiple of 16
/// tokens when `p` holds their form; returns the first token they did not cover.
///
/// # Safety
/// As [`tiles`], and AVX-512F/BW/DQ/VL and AVX512-VNNI when `p.tt` is set.
#[cfg(target_arch = "x86_64")]
unsafe fn tiles_transposed<K: avx2::Block32>(
    w: &[u8],
    rb: usize,
    p: &Tiled<'_, K>,
    out: &mut [&mut [f32]],
) -> usize
where
    K::Act: avx2::ActBlock,
{
    match &p.tt {
        Some(tt) => {
            transposed::tiles::<K>(w, rb, tt, out);
            tt.tokens()
        }
        None => 0,
    }
}

/// Every token through the best tiles `p` allows: the token-transposed ones for the
/// first multiple of 16, then [`tiles_512`] or [`tiles`].
///
/// # Safety
/// As [`tiles_512`] when `p.zmm`, else as [`tiles`].
#[cfg(target_arch = "x86_64")]
unsafe fn tiles_any<K: avx2::Tile512>(w: &[u8], rb: usize, p: &Tiled<'_, K>, out: &mut [&mut [f32]])
where
    K::Act: avx2::ActBlock,
{
    let t0 = tiles_transposed(w, rb, p, out);
    if p.zmm {
        tiles_512(w, rb, p, out, t0)
    } else {
        tiles(w, rb, p, out, t0)
    }
}

/// `TILE_R`-row × `TILE_T`-token tiles of [`avx2::rows_tokens`] (or
/// [`avx2::rows_tokens_vnni`] / [`avx2::rows_tokens_vnni512`] when `p` holds the VNNI
/// form) over all of `w` and the tokens of `p` from `t0` on, with 1-row and 1-token
/// tiles at the edges; `out` is `[tokens, rows of w]` (rows of tokens before `t0`
/// untouched).
///
/// # Safety
/// AVX2 and F16C (and AVX-VNNI when `p.va` is set, AVX-512BW and AVX-512VL too when
/// `p.wide`); every `p.a[t]` is `rb / K::BYTES`
/// blocks; `w.len()` is a multiple of `rb`; `out.len() == p.a.len() * w.len() / rb`.
#[cfg(target_arch = "x86_64")]
unsafe fn tiles<K: avx2::Block32>(
    w: &[u8],
    rb: usize,
    p: &Tiled<'_, K>,
    out: &mut [&mut [f32]],
    t0: usize,
) {
    let (a, sc) = (&p.a, &p.sc);
    let (m, n) = (w.len() / rb, a.len());
    let mut r = 0;
    while r < m {
        let wr = &w[r * rb..];
        let rr = if m - r >= TILE_R { TILE_R } else { 1 };
        let mut t = t0;
        while t < n {
            let tt = if n - t >= TILE_T { TILE_T } else { 1 };
            macro_rules! tile {
                ($r:expr, $t:expr) => {{
                    let mut o = [[0f32; $r]; $t];
                    let ss: [&[[f32; 2]]; $t] = std::array::from_fn(|j| &sc[t + j][..]);
                    if let Some(va) = &p.va {
                        let ts: [&[K::VAct]; $t] = std::array::from_fn(|j| &va[t + j][..]);
                        if p.wide {
                            avx2::rows_tokens_vnni512::<K, $r, $t>(wr, rb, ts, ss, &mut o);
                        } else {
                            avx2::rows_tokens_vnni::<K, $r, $t>(wr, rb, ts, ss, &mut o);
                        }
                    } else {
                        let ts: [&[K::Act]; $t] = std::array::from_fn(|j| a[t + j]);
                        avx2::rows_tokens::<K, $r, $t>(wr, rb, ts, ss, &mut o);
                    }
                    for (j, oj) in o.iter().enumerate() {
                        out[t + j][r..r + $r].copy_from_slice(oj);
                    }
                }};
            }
            match (rr, tt) {
                (TILE_R, TILE_T) => tile!(TILE_R, TILE_T),
                (TILE_R, _) => tile!(TILE_R, 1),
                (_, TILE_T) => tile!(1, TILE_T),
                _ => tile!(1, 1),
            }
            t += tt;
        }
        r += rr;
    }
}

/// [`tiles`] with the 512-bit kernel ([`avx2::rows_tokens_512`]: `TILE512_R` rows ×
/// `2 * TILE512_P` tokens, two tokens per register, 1-row tiles at the row edge) for
/// the tokens from `t0` on; the last `(n - t0) % (2 * TILE512_P)` go through
/// [`tiles`]. The same bits as [`tiles`].
///
/// # Safety
/// As [`tiles`], and AVX-512F/BW/DQ/VL and AVX512-VNNI ([`TileIsa::Zmm`]).
#[cfg(target_arch = "x86_64")]
unsafe fn tiles_512<K: avx2::Tile512>(
    w: &[u8],
    rb: usize,
    p: &Tiled<'_, K>,
    out: &mut [&mut [f32]],
    t0: usize,
) where
    K::Act: avx2::ActBlock,
{
    const T: usize = 2 * TILE512_P;
    let Some(a) = &p.va else {
        return tiles(w, rb, p, out, t0);
    };
    let sc = &p.sc;
    let (m, n) = (w.len() / rb, a.len());
    let n_main = n - (n - t0.min(n)) % T;
    let mut r = 0;
    while r < m {
        let wr = &w[r * rb..];
        let rr = if m - r >= TILE512_R { TILE512_R } else { 1 };
        for t in (t0.min(n_main)..n_main).step_by(T) {
            macro_rules! tile {
                ($r:expr) => {{
                    let mut o = [[[0f32; $r]; 2]; TILE512_P];
                    let ts: [[&[K::VAct]; 2]; TILE512_P] =
                        std::array::from_fn(|p| [&a[t + 2 * p][..], &a[t + 2 * p + 1][..]]);
                    let ss: [[&[[f32; 2]]; 2]; TILE512_P] =
                        std::array::from_fn(|p| [&sc[t + 2 * p][..], &sc[t + 2 * p + 1][..]]);
                    avx2::rows_tokens_512::<K, $r, TILE512_P>(wr, rb, ts, ss, &mut o);
                    for (p, op) in o.iter().enumerate() {
                        for (h, oh) in op.iter().enumerate() {
                            let tj = t + 2 * p + h;
                            out[tj][r..r + $r].copy_from_slice(oh);
                        }
                    }
                }};
            }
            if rr == TILE512_R {
                tile!(TILE512_R)
            } else {
                tile!(1)
            }
        }
        r += rr;
    }
    if n_main < n {
        tiles(w, rb, p, out, n_main);
    }
}

/// Rows and token pairs of one 512-bit multi-token tile (see [`tiles_512`]).
#[cfg(target_arch = "x86_64")]
const TILE512_R: usize = 4;
#[cfg(target_arch = "x86_64")]
const TILE512_P: usize = 2;

/// Rows × tokens of one multi-token tile (see [`tiles`]). 2 × 4 keeps the eight
/// accumulators and the activations of a block in registers; in `qdot_bench`'s
/// multi-token section it beat the earlier 8 × 2 for every 32-element type, and 1 × 8,
/// 4 × 2, 2 × 3, 2 × 6, 3 × 3, 3 × 4 and 4 × 3 were slower for Q8_0.
#[cfg(target_arch = "x86_64")]
const TILE_R: usize = 2;
#[cfg(target_arch = "x86_64")]
const TILE_T: usize = 4;

#[cfg(test)]
mod tests;
