//! Q8_K (ggml `block_q8_K`): the activation super-block of the K-quant weights (an `f32`
//! scale and the sums of each 16 quants) and its quantizer (ggml
//! `quantize_row_q8_K_ref`).

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::{check_multiple, has_avx2_f16c, QuantError, QK_K};
use bytemuck::{Pod, Zeroable};

/// Q8_K super-block (ggml `block_q8_K`, 292 bytes): 256 elements `x_e ≈ d * qs[e]`
/// with an `f32` scale and the sums of each 16 consecutive quants.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ8K {
    /// Scale.
    pub d: f32,
    /// Quants.
    pub qs: [i8; QK_K],
    /// `bsums[j] = Σ qs[16j .. 16j + 16]` (the K dot products use it for the mins).
    pub bsums: [i16; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);

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
/// [`quantize_q8_0_into`](super::quantize_q8_0_into)).
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
pub(crate) fn q8k_block_ref(c: &[f32]) -> BlockQ8K {
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

/// Q8_K: `x = d * q` (ggml `dequantize_row_q8_K`; gguf-py has no Q8_K dequantizer).
/// `out.len() == 256 * blocks.len()`.
pub fn dequantize_q8_k(blocks: &[BlockQ8K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d;
        for (x, &q) in o.iter_mut().zip(b.qs.iter()) {
            *x = d * q as f32;
        }
    }
}
