//! Q8_1 (ggml `block_q8_1`): the activation block of Q4_1 and Q5_1 weights (Q8_0 plus
//! the scaled sum of its quants) and its quantizer (ggml `quantize_row_q8_1_ref`).

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::{check_multiple, f32_to_f16, has_avx2_f16c, q8_block_ref, QuantError, QK};

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

/// Quantize activations to Q8_1 (ggml `quantize_row_q8_1_ref`): as
/// [`quantize_q8_0`](super::quantize_q8_0), plus `s = f16((Σ qs) as f32 · d)` with the unrounded `f32` `d`.
///
/// # Errors
/// [`QuantError::NotBlockMultiple`] when `x.len() % 32 != 0`.
pub fn quantize_q8_1(x: &[f32]) -> Result<Vec<BlockQ8_1>, QuantError> {
    let mut out = Vec::new();
    quantize_q8_1_into(x, &mut out)?;
    Ok(out)
}

/// [`quantize_q8_1`] into `out` (cleared first, capacity reused, as
/// [`quantize_q8_0_into`](super::quantize_q8_0_into)).
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
