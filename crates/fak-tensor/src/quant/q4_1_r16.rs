//! Q4_1 weights repacked at load in groups of 16 rows ([`QType::Q4_1R16`]): the layout
//! the AVX-512 kernels (`avx2/q4_1_r16.rs`) read as 16 rows per 512-bit register, with
//! nothing prepared per product, the same size as the file's blocks, so no second copy
//! of the matrix is kept.
//!
//! # Layout
//!
//! A `[rows, cols]` Q4_1 matrix (`rows` a multiple of 16, `nb = cols / 32` blocks a row)
//! becomes `rows / 16` groups of `nb` blocks of [`R16_BLOCK`] = 320 bytes (sixteen Q4_1
//! blocks' 16 × 20): group `g` holds file rows `16g .. 16g + 16`, its block `b` at byte
//! `(g · nb + b) · 320`:
//!
//! | bytes | what |
//! |---|---|
//! | 0..32 | the 16 rows' scales `d` (f16, little-endian), row `r` at `2r` |
//! | 32..64 | the 16 rows' minimums `m` (f16), row `r` at `32 + 2r` |
//! | 64..320 | four runs `j = 0..4` of 64 bytes: bytes `4r..4r + 4` of run `j` are row `r`'s `qs[4j..4j + 4]`, the file's bytes |
//!
//! So the low nibbles of run `j` are, for each row, elements `4j..4j + 4` of its block
//! and the high nibbles elements `16 + 4j..16 + 4j + 4` (ggml's Q4_1 packs element `k`
//! in the low and `k + 16` in the high nibble of `qs[k]`, gguf-py `Q4_1.dequantize_blocks`).
//! Rows `r0..r1` of the matrix, both multiples of 16, are bytes `r0 · rb .. r1 · rb`
//! (`rb = 20 · nb`), as in the file: row ranges cut at multiples of 16 slice the
//! repacked matrix as they slice the file's.
//!
//! Every product over the repacked matrix gives the bits of the same product over the
//! file's blocks: the kernels perform the canonical order (module docs of `quant`) on the
//! same quants and scales. The scalar path ([`matvec_ref`]) rebuilds each row's Q4_1
//! bytes ([`row_to_q4_1`]) and runs the Q4_1 kernel on it.

use super::{dequantize_q4_1, BlockQ4_1, QType, QuantError, QuantizedActs};

/// Rows per group.
pub const R16_ROWS: usize = 16;

/// Bytes of one repacked block: sixteen rows' Q4_1 blocks (16 × 20).
pub const R16_BLOCK: usize = 320;

/// Bytes of one Q4_1 block.
const Q4_1_BLOCK: usize = 20;

/// The `[rows, cols]` Q4_1 matrix `raw` (the file's row-major blocks) in the layout of
/// [`QType::Q4_1R16`] (module docs), into `out` (exactly `raw.len()` bytes), so a
/// caller can repack a large matrix a group of rows at a time.
///
/// # Errors
/// [`QuantError::MatrixShape`] when `rows` is not a multiple of 16, `cols` is not a
/// multiple of 32, `raw` is not `rows × cols / 32` blocks, or `out.len() != raw.len()`.
pub fn repack_q4_1_r16_into(
    raw: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [u8],
) -> Result<(), QuantError> {
    let nb = super::repacked::check_groups(QType::Q4_1, raw.len(), rows, cols, R16_ROWS)?;
    if out.len() != raw.len() {
        return Err(QuantError::MatrixShape {
            detail: format!("{} bytes to repack into {}", raw.len(), out.len()),
        });
    }
    let rb = nb * Q4_1_BLOCK;
    for (src, dst) in raw
        .chunks_exact(R16_ROWS * rb)
        .zip(out.chunks_exact_mut(R16_ROWS * rb))
    {
        for (b, blk) in dst.chunks_exact_mut(R16_BLOCK).enumerate() {
            for r in 0..R16_ROWS {
                let w = &src[r * rb + b * Q4_1_BLOCK..][..Q4_1_BLOCK];
                blk[2 * r..2 * r + 2].copy_from_slice(&w[0..2]);
                blk[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&w[2..4]);
                for j in 0..4 {
                    blk[64 + 64 * j + 4 * r..][..4].copy_from_slice(&w[4 + 4 * j..8 + 4 * j]);
                }
            }
        }
    }
    Ok(())
}

/// The `[rows, cols]` Q4_1 matrix `raw` repacked ([`repack_q4_1_r16_into`]) into a new
/// buffer.
///
/// # Errors
/// As [`repack_q4_1_r16_into`].
pub fn repack_q4_1_r16(raw: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>, QuantError> {
    let mut out = vec![0u8; raw.len()];
    repack_q4_1_r16_into(raw, rows, cols, &mut out)?;
    Ok(out)
}

/// The Q4_1 blocks of row `r` of a [`QType::Q4_1R16`] matrix `w` (`rb` = the row's Q4_1
/// bytes, `20 · nb`), each rebuilt on the stack as the file stored it.
///
/// # Errors
/// [`QuantError::MatrixShape`] when `rb` is not whole blocks, `w` is not whole groups
/// of 16 rows of `rb`, or row `r` is outside it.
fn row_blocks(
    w: &[u8],
    rb: usize,
    r: usize,
) -> Result<impl Iterator<Item = BlockQ4_1> + '_, QuantError> {
    let (group, h) = super::repacked::group_of(QType::Q4_1, w, rb, r, R16_ROWS)?;
    Ok(group.chunks_exact(R16_BLOCK).map(move |blk| {
        let mut b = BlockQ4_1 {
            d: [blk[2 * h], blk[2 * h + 1]],
            m: [blk[32 + 2 * h], blk[32 + 2 * h + 1]],
            qs: [0; 16],
        };
        for j in 0..4 {
            b.qs[4 * j..4 * j + 4].copy_from_slice(&blk[64 + 64 * j + 4 * h..][..4]);
        }
        b
    }))
}

/// Row `r` of a [`QType::Q4_1R16`] matrix `w` (`rb` = the row's Q4_1 bytes, `20 · nb`)
/// as the file stored it: `nb` Q4_1 blocks, appended to `out` (cleared first).
///
/// # Errors
/// As `row_blocks`: `rb` not whole blocks, `w` not whole groups of 16 rows of `rb`, or
/// row `r` outside it.
pub fn row_to_q4_1(w: &[u8], rb: usize, r: usize, out: &mut Vec<u8>) -> Result<(), QuantError> {
    let blocks = row_blocks(w, rb, r)?;
    out.clear();
    for b in blocks {
        out.extend_from_slice(&b.d);
        out.extend_from_slice(&b.m);
        out.extend_from_slice(&b.qs);
    }
    Ok(())
}

/// Row `r` of a [`QType::Q4_1R16`] matrix `w` (`rb` = the row's Q4_1 bytes) dequantized
/// into `out` (`32 · nb` values): each block rebuilt on the stack and widened by
/// [`dequantize_q4_1`], the values of the file's row, with nothing allocated.
///
/// # Errors
/// As [`row_to_q4_1`], and [`QuantError::MatrixShape`] when `out` is not the row's
/// length.
pub fn dequantize_row_q4_1_r16(
    w: &[u8],
    rb: usize,
    r: usize,
    out: &mut [f32],
) -> Result<(), QuantError> {
    super::repacked::dequantize_row(
        QType::Q4_1,
        (rb, r),
        row_blocks(w, rb, r),
        dequantize_q4_1,
        out,
    )
}

/// Row `r` of the [`QType::Q4_1R16`] matrix `w` times `act`: [`vec_dot`](super::vec_dot)
/// of the row's Q4_1 blocks ([`row_to_q4_1`]), the bits every product over `w` gives for that
/// row.
///
/// # Errors
/// As [`row_to_q4_1`] and [`vec_dot`](super::vec_dot).
pub fn vec_dot_row_q4_1_r16(w: &[u8], r: usize, act: &QuantizedActs) -> Result<f32, QuantError> {
    super::repacked::vec_dot_row(QType::Q4_1, row_to_q4_1, w, r, act)
}

/// The product over a [`QType::Q4_1R16`] matrix row by row through the Q4_1 kernel
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
    let types = (QType::Q4_1R16, QType::Q4_1);
    super::repacked::matvec_ref(types, row_to_q4_1, w, act, out, simd)
}
