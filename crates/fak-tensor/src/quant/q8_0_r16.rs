//! Q8_0 weights repacked at load in groups of 16 rows ([`QType::Q8_0R16`]): the layout
//! the AVX-512 kernels (`avx2/q8_0_r16.rs`) read as 16 rows per 512-bit register, with
//! no reduction across lanes and nothing prepared per product, the same size as the
//! file's blocks, so no second copy of the matrix is kept.
//!
//! # Layout
//!
//! A `[rows, cols]` Q8_0 matrix (`rows` a multiple of 16, `nb = cols / 32` blocks a row)
//! becomes `rows / 16` groups of `nb` blocks of [`Q8_0_R16_BLOCK`] = 544 bytes (sixteen
//! Q8_0 blocks' 16 × 34): group `g` holds file rows `16g .. 16g + 16`, its block `b` at
//! byte `(g · nb + b) · 544`:
//!
//! | bytes | what |
//! |---|---|
//! | 0..32 | the 16 rows' scales `d` (f16, little-endian), row `r` at `2r` |
//! | 32..544 | eight runs `j = 0..8` of 64 bytes: bytes `4r..4r + 4` of run `j` are row `r`'s quants `qs[4j..4j + 4]`, each as the unsigned byte `q + 128` |
//!
//! Rows `r0..r1` of the matrix, both multiples of 16, are bytes `r0 · rb .. r1 · rb`
//! (`rb = 34 · nb`), as in the file: row ranges cut at multiples of 16 slice the
//! repacked matrix as they slice the file's. The quants' `+ 128` (exact for every `i8`)
//! is what `vpdpbusd` multiplies as unsigned bytes; the kernels start each block's sum
//! at `−128 · Σ a` (the token's quants of that block), so the sum is `Σ q a` exactly.
//!
//! Every product over the repacked matrix gives the bits of the same product over the
//! file's blocks: the kernels perform the canonical order (module docs of `quant`) on the
//! same quants and scales. The scalar path ([`matvec_ref`]) rebuilds each row's Q8_0
//! bytes ([`row_to_q8_0_r16`]) and runs the Q8_0 kernel on it.

use super::{dequantize_q8_0, BlockQ8_0, QType, QuantError, QuantizedActs, QK, R16_ROWS};

/// Bytes of one repacked block: sixteen rows' Q8_0 blocks (16 × 34).
pub const Q8_0_R16_BLOCK: usize = 544;

/// Bytes of one Q8_0 block.
const Q8_0_BLOCK: usize = 34;

/// The `[rows, cols]` Q8_0 matrix `raw` (the file's row-major blocks) in the layout of
/// [`QType::Q8_0R16`] (module docs), into `out` (exactly `raw.len()` bytes), so a
/// caller can repack a large matrix a group of rows at a time.
///
/// # Errors
/// [`QuantError::MatrixShape`] when `rows` is not a multiple of 16, `cols` is not a
/// multiple of 32, `raw` is not `rows × cols / 32` blocks, or `out.len() != raw.len()`.
pub fn repack_q8_0_r16_into(
    raw: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [u8],
) -> Result<(), QuantError> {
    let nb = super::repacked::check_groups(QType::Q8_0, raw.len(), rows, cols, R16_ROWS)?;
    if out.len() != raw.len() {
        return Err(QuantError::MatrixShape {
            detail: format!("{} bytes to repack into {}", raw.len(), out.len()),
        });
    }
    let rb = nb * Q8_0_BLOCK;
    for (src, dst) in raw
        .chunks_exact(R16_ROWS * rb)
        .zip(out.chunks_exact_mut(R16_ROWS * rb))
    {
        for (b, blk) in dst.chunks_exact_mut(Q8_0_R16_BLOCK).enumerate() {
            for r in 0..R16_ROWS {
                let w = &src[r * rb + b * Q8_0_BLOCK..][..Q8_0_BLOCK];
                blk[2 * r..2 * r + 2].copy_from_slice(&w[0..2]);
                for j in 0..8 {
                    for k in 0..4 {
                        blk[32 + 64 * j + 4 * r + k] = w[2 + 4 * j + k] ^ 0x80;
                    }
                }
            }
        }
    }
    Ok(())
}

/// The `[rows, cols]` Q8_0 matrix `raw` repacked ([`repack_q8_0_r16_into`]) into a new
/// buffer.
///
/// # Errors
/// As [`repack_q8_0_r16_into`].
pub fn repack_q8_0_r16(raw: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>, QuantError> {
    let mut out = vec![0u8; raw.len()];
    repack_q8_0_r16_into(raw, rows, cols, &mut out)?;
    Ok(out)
}

/// The Q8_0 blocks of row `r` of a [`QType::Q8_0R16`] matrix `w` (`rb` = the row's Q8_0
/// bytes, `34 · nb`), each rebuilt on the stack as the file stored it.
///
/// # Errors
/// [`QuantError::MatrixShape`] when `rb` is not whole blocks, `w` is not whole groups
/// of 16 rows of `rb`, or row `r` is outside it.
fn row_blocks(
    w: &[u8],
    rb: usize,
    r: usize,
) -> Result<impl Iterator<Item = BlockQ8_0> + '_, QuantError> {
    let (group, h) = super::repacked::group_of(QType::Q8_0, w, rb, r, R16_ROWS)?;
    Ok(group.chunks_exact(Q8_0_R16_BLOCK).map(move |blk| {
        let mut b = BlockQ8_0 {
            d: u16::from_le_bytes([blk[2 * h], blk[2 * h + 1]]),
            qs: [0; QK],
        };
        for j in 0..8 {
            for k in 0..4 {
                b.qs[4 * j + k] = (blk[32 + 64 * j + 4 * h + k] ^ 0x80) as i8;
            }
        }
        b
    }))
}

/// Row `r` of a [`QType::Q8_0R16`] matrix `w` (`rb` = the row's Q8_0 bytes, `34 · nb`)
/// as the file stored it: `nb` Q8_0 blocks, appended to `out` (cleared first).
///
/// # Errors
/// As `row_blocks`: `rb` not whole blocks, `w` not whole groups of 16 rows of `rb`, or
/// row `r` outside it.
pub fn row_to_q8_0_r16(w: &[u8], rb: usize, r: usize, out: &mut Vec<u8>) -> Result<(), QuantError> {
    let blocks = row_blocks(w, rb, r)?;
    out.clear();
    for b in blocks {
        out.extend_from_slice(&b.d.to_le_bytes());
        out.extend(b.qs.iter().map(|&q| q as u8));
    }
    Ok(())
}

/// Row `r` of a [`QType::Q8_0R16`] matrix `w` (`rb` = the row's Q8_0 bytes) dequantized
/// into `out` (`32 · nb` values): each block rebuilt on the stack and widened by
/// [`dequantize_q8_0`], the values of the file's row, with nothing allocated (an
/// embedding lookup per decoded token).
///
/// # Errors
/// As [`row_to_q8_0_r16`], and [`QuantError::MatrixShape`] when `out` is not the row's
/// length.
pub fn dequantize_row_q8_0_r16(
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

/// Row `r` of the [`QType::Q8_0R16`] matrix `w` times `act`: [`vec_dot`](super::vec_dot)
/// of the row's Q8_0 blocks ([`row_to_q8_0_r16`]), the bits every product over `w` gives
/// for that row.
///
/// # Errors
/// As [`row_to_q8_0_r16`] and [`vec_dot`](super::vec_dot).
pub fn vec_dot_row_q8_0_r16(w: &[u8], r: usize, act: &QuantizedActs) -> Result<f32, QuantError> {
    super::repacked::vec_dot_row(QType::Q8_0, row_to_q8_0_r16, w, r, act)
}

/// The product over a [`QType::Q8_0R16`] matrix row by row through the Q8_0 kernel
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
    let types = (QType::Q8_0R16, QType::Q8_0);
    super::repacked::matvec_ref(types, row_to_q8_0_r16, w, act, out, simd)
}
