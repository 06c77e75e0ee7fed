//! What the layouts repacked at load share (`q8_0_r2.rs`, `q4_1_r16.rs`): products
//! over a repacked matrix row by row, each row rebuilt in the file's form and run
//! through the file type's kernel or its scalar reference.

use super::{check_matvec, vec_dot, QType, QuantError, QuantizedActs, QK};

/// Rebuilds row `r` of a repacked matrix `w` (`rb` bytes a row) in the file's form into
/// `out` (cleared first).
pub(super) type RowToFile = fn(&[u8], usize, usize, &mut Vec<u8>) -> Result<(), QuantError>;

/// Row `r` of the repacked matrix `w` times `act`: [`vec_dot`] of type `file` on the
/// row rebuilt by `row`, the bits every product over `w` gives for that row.
///
/// # Errors
/// As `row` and [`vec_dot`].
pub(super) fn vec_dot_row(
    file: QType,
    row: RowToFile,
    w: &[u8],
    r: usize,
    act: &QuantizedActs,
) -> Result<f32, QuantError> {
    let rb = act.blocks() * file.block_bytes();
    let mut bytes = Vec::with_capacity(rb);
    row(w, rb, r, &mut bytes)?;
    vec_dot(file, &bytes, act)
}

/// The product over the repacked matrix `w` of type `ty` row by row: each row rebuilt
/// by `row` and run through type `file`'s kernel (`simd`) or its scalar reference. The
/// path without the layout's own kernels, and the reference the tests hold them to.
///
/// # Errors
/// As [`super::matvec`].
pub(super) fn matvec_ref(
    (ty, file): (QType, QType),
    row: RowToFile,
    w: &[u8],
    act: &QuantizedActs,
    out: &mut [f32],
    simd: bool,
) -> Result<(), QuantError> {
    let rb = check_matvec(ty, w, act, out.len())?;
    let mut bytes = Vec::with_capacity(rb);
    for (r, o) in out.iter_mut().enumerate() {
        row(w, rb, r, &mut bytes)?;
        *o = if simd {
            vec_dot(file, &bytes, act)?
        } else {
            super::vec_dot_ref(file, &bytes, act)?
        };
    }
    Ok(())
}

/// Row `r` of a repacked matrix (`rb` bytes a row of type `file`) dequantized into `out`
/// (`32 · nb` values): each of its `blocks` (rebuilt on the stack as the file stored
/// them) widened by `widen`, with nothing allocated (an embedding lookup per decoded
/// token).
///
/// # Errors
/// [`QuantError::MatrixShape`] when `out` is not the row's length; `blocks`' error.
pub(super) fn dequantize_row<B>(
    file: QType,
    (rb, r): (usize, usize),
    blocks: Result<impl Iterator<Item = B>, QuantError>,
    widen: fn(&[B], &mut [f32]),
    out: &mut [f32],
) -> Result<(), QuantError> {
    if out.len() != rb / file.block_bytes() * QK {
        return Err(QuantError::MatrixShape {
            detail: format!(
                "row {r} of a repacked {file} matrix in rows of {rb} bytes into {} values",
                out.len()
            ),
        });
    }
    for (b, o) in blocks?.zip(out.chunks_exact_mut(QK)) {
        widen(std::slice::from_ref(&b), o);
    }
    Ok(())
}
