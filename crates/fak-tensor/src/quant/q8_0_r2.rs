//! Q8_0 weights repacked at load in row pairs ([`QType::Q8_0R2`]): the layout the
//! AVX-512 tiles read without preparing them ([`super::transposed`]), the same size as
//! the file's blocks, so no second copy of the matrix is kept.
//!
//! # Layout
//!
//! A `[rows, cols]` Q8_0 matrix (`rows` even, `nb = cols / 32` blocks a row) becomes
//! `rows / 2` pairs of `nb` blocks of [`R2_BLOCK`] = 68 bytes (two Q8_0 blocks' 2 × 34):
//! pair `p` holds file rows `2p` and `2p + 1`, its block `b` at byte `(p · nb + b) · 68`:
//!
//! | bytes | what |
//! |---|---|
//! | 0..2, 2..4 | the two rows' scales `d` (f16, little-endian), as in the file |
//! | 4..68 | per lane `m = 0..8` (the grouping of `avx2::Block32::act_lanes`; for Q8_0 elements `2m, 2m+1, 2m+16, 2m+17`): row `2p`'s four quants of lane `m`, then row `2p + 1`'s, each as the unsigned byte `q + 128` |
//!
//! So rows `r0..r1` of the matrix, `r0` and `r1` even, are bytes
//! `r0 · rb .. r1 · rb` (`rb = 34 · nb`), as in the file: row ranges cut at even rows
//! slice the repacked matrix as they slice the file's. The quants' `+ 128` (exact for
//! every `i8`) is what the tiles' `vpdpbusd` reads, its `−128 · Σ a` correction on the
//! activation side (`transposed` module docs).
//!
//! Every product over the repacked matrix gives the bits of the same product over the
//! file's blocks: the kernels perform the canonical order on the same quants and
//! scales. The scalar path ([`matvec_ref`]) unpacks each row back to its Q8_0 bytes
//! ([`row_to_q8_0`]) and runs the Q8_0 kernel on it.

use super::{dequantize_q8_0, BlockQ8_0, QType, QuantError, QuantizedActs, QK};

/// Bytes of one repacked block: two rows' Q8_0 blocks (2 × 34).
pub const R2_BLOCK: usize = 68;

/// Bytes of one Q8_0 block.
const Q8_0_BLOCK: usize = 34;

/// Which element of a 32-quant Q8_0 block is byte `k` of lane `m`.
fn lane_element(m: usize, k: usize) -> usize {
    2 * m + (k & 1) + 16 * (k >> 1)
}

/// The `[rows, cols]` Q8_0 matrix `raw` (the file's row-major blocks) in the row-pair
/// layout of [`QType::Q8_0R2`] (module docs), the same number of bytes.
///
/// # Errors
/// [`QuantError::MatrixShape`] when `rows` is odd, `cols` is not a multiple of 32, or
/// `raw` is not `rows × cols / 32` blocks.
pub fn repack_q8_0_r2(raw: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>, QuantError> {
    let mut out = vec![0u8; raw.len()];
    repack_q8_0_r2_into(raw, rows, cols, &mut out)?;
    Ok(out)
}

/// [`repack_q8_0_r2`] into `out` (exactly `raw.len()` bytes), so a caller can repack a
/// large matrix a range of row pairs at a time.
///
/// # Errors
/// As [`repack_q8_0_r2`], and [`QuantError::MatrixShape`] when `out.len() != raw.len()`.
pub fn repack_q8_0_r2_into(
    raw: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [u8],
) -> Result<(), QuantError> {
    let nb = check_shape(raw.len(), rows, cols)?;
    if out.len() != raw.len() {
        return Err(QuantError::MatrixShape {
            detail: format!("{} bytes to repack into {}", raw.len(), out.len()),
        });
    }
    let rb = nb * Q8_0_BLOCK;
    for (src, dst) in raw.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2 * rb)) {
        let (ra, rb_) = src.split_at(rb);
        for (b, blk) in dst.chunks_exact_mut(R2_BLOCK).enumerate() {
            let wa = &ra[b * Q8_0_BLOCK..(b + 1) * Q8_0_BLOCK];
            let wb = &rb_[b * Q8_0_BLOCK..(b + 1) * Q8_0_BLOCK];
            blk[0..2].copy_from_slice(&wa[0..2]);
            blk[2..4].copy_from_slice(&wb[0..2]);
            for m in 0..8 {
                for (h, w) in [wa, wb].into_iter().enumerate() {
                    for k in 0..4 {
                        blk[4 + 8 * m + 4 * h + k] = w[2 + lane_element(m, k)] ^ 0x80;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks a Q8_0 matrix shape for the row-pair layout; returns the blocks per row.
fn check_shape(bytes: usize, rows: usize, cols: usize) -> Result<usize, QuantError> {
    let nb = cols / QK;
    let ok = rows.is_multiple_of(2)
        && cols.is_multiple_of(QK)
        && rows.checked_mul(nb).and_then(|b| b.checked_mul(Q8_0_BLOCK)) == Some(bytes);
    if !ok {
        return Err(QuantError::MatrixShape {
            detail: format!(
                "Q8_0 row pairs: {bytes} bytes is not an even number of rows ({rows}) of {cols} \
                 elements in blocks of {QK}"
            ),
        });
    }
    Ok(nb)
}

/// The Q8_0 blocks of row `r` of a [`QType::Q8_0R2`] matrix `w` (`rb` = the row's Q8_0
/// bytes, `34 · nb`), each rebuilt on the stack as the file stored it.
///
/// # Errors
/// [`QuantError::MatrixShape`] when `rb` is not whole blocks, `w` is not whole row
/// pairs of `rb`, or row `r` is outside it.
fn row_blocks(
    w: &[u8],
    rb: usize,
    r: usize,
) -> Result<impl Iterator<Item = BlockQ8_0> + '_, QuantError> {
    let bad = || QuantError::MatrixShape {
        detail: format!(
            "row {r} of a Q8_0 row-pair matrix of {} bytes in rows of {rb}",
            w.len()
        ),
    };
    if rb == 0 || !rb.is_multiple_of(Q8_0_BLOCK) || !w.len().is_multiple_of(2 * rb) {
        return Err(bad());
    }
    let (p, h) = (r / 2, r % 2);
    let pair = w.get(p * 2 * rb..(p + 1) * 2 * rb).ok_or_else(bad)?;
    Ok(pair.chunks_exact(R2_BLOCK).map(move |blk| {
        let mut b = BlockQ8_0 {
            d: u16::from_le_bytes([blk[2 * h], blk[2 * h + 1]]),
            qs: [0; QK],
        };
        for m in 0..8 {
            for k in 0..4 {
                b.qs[lane_element(m, k)] = (blk[4 + 8 * m + 4 * h + k] ^ 0x80) as i8;
            }
        }
        b
    }))
}

/// Row `r` of a [`QType::Q8_0R2`] matrix `w` (`rb` = the row's Q8_0 bytes, `34 · nb`) as
/// the file stored it: `nb` Q8_0 blocks, appended to `out` (cleared first).
///
/// # Errors
/// [`QuantError::MatrixShape`] when `rb` is not whole blocks, `w` is not whole row
/// pairs of `rb`, or row `r` is outside it.
pub fn row_to_q8_0(w: &[u8], rb: usize, r: usize, out: &mut Vec<u8>) -> Result<(), QuantError> {
    let blocks = row_blocks(w, rb, r)?;
    out.clear();
    for b in blocks {
        out.extend_from_slice(&b.d.to_le_bytes());
        out.extend(b.qs.iter().map(|&q| q as u8));
    }
    Ok(())
}

/// Row `r` of a [`QType::Q8_0R2`] matrix `w` (`rb` = the row's Q8_0 bytes) dequantized
/// into `out` (`32 · nb` values): each block rebuilt on the stack and widened by
/// [`dequantize_q8_0`], the values of the file's row, with nothing allocated (an
/// embedding lookup per decoded token).
///
/// # Errors
/// As [`row_to_q8_0`], and [`QuantError::MatrixShape`] when `out` is not the row's
/// length.
pub fn dequantize_row_q8_0_r2(
    w: &[u8],
    rb: usize,
    r: usize,
    out: &mut [f32],
) -> Result<(), QuantError> {
    super::repacked::dequantize_row(
        QType::Q8_0,
        (rb, r),
        row_blocks(w, rb, r),
        dequantize_q8_0,
        out,
    )
}

/// Row `r` of the [`QType::Q8_0R2`] matrix `w` times `act`: [`vec_dot`](super::vec_dot)
/// of the row's Q8_0 blocks ([`row_to_q8_0`]), the bits every product over `w` gives for that
/// row.
///
/// # Errors
/// As [`row_to_q8_0`] and [`vec_dot`](super::vec_dot).
pub fn vec_dot_row(w: &[u8], r: usize, act: &QuantizedActs) -> Result<f32, QuantError> {
    super::repacked::vec_dot_row(QType::Q8_0, row_to_q8_0, w, r, act)
}

/// The product over a [`QType::Q8_0R2`] matrix row by row through the Q8_0 kernel
/// (`simd`) or its scalar reference: the path without the AVX-512 kernels, and the
/// reference the tests hold them to.
///
/// # Errors
/// As [`super::matvec`].
pub(super) fn matvec_ref(
    w: &[u8],
    act: &QuantizedActs,
    out: &mut [f32],
    simd: bool,
) -> Result<(), QuantError> {
    let types = (QType::Q8_0R2, QType::Q8_0);
    super::repacked::matvec_ref(types, row_to_q8_0, w, act, out, simd)
}
