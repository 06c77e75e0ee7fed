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

/// Checks the shape of a `[rows, cols]` matrix of `file` blocks (`bytes` long) for a
/// layout in groups of `group` rows; returns the blocks per row.
///
/// # Errors
/// [`QuantError::MatrixShape`] when `rows` is not a multiple of `group`, `cols` not a
/// multiple of 32, or `bytes` not `rows × cols / 32` blocks.
pub(super) fn check_groups(
    file: QType,
    bytes: usize,
    rows: usize,
    cols: usize,
    group: usize,
) -> Result<usize, QuantError> {
    let nb = cols / QK;
    let ok = rows.is_multiple_of(group)
        && cols.is_multiple_of(QK)
        && rows
            .checked_mul(nb)
            .and_then(|b| b.checked_mul(file.block_bytes()))
            == Some(bytes);
    if !ok {
        return Err(QuantError::MatrixShape {
            detail: format!(
                "{file} in groups of {group} rows: {bytes} bytes is not a multiple of {group} \
                 rows ({rows}) of {cols} elements in blocks of {QK}"
            ),
        });
    }
    Ok(nb)
}

/// The group of `group` rows of the repacked matrix `w` (`rb` bytes of `file` blocks a
/// row) that holds row `r`, and `r`'s place in it.
///
/// # Errors
/// [`QuantError::MatrixShape`] when `rb` is not whole blocks, `w` is not whole groups of
/// `rb`-byte rows, or row `r` is outside it.
pub(super) fn group_of(
    file: QType,
    w: &[u8],
    rb: usize,
    r: usize,
    group: usize,
) -> Result<(&[u8], usize), QuantError> {
    let bad = || QuantError::MatrixShape {
        detail: format!(
            "row {r} of a {file} matrix in groups of {group} rows, {} bytes in rows of {rb}",
            w.len()
        ),
    };
    let whole = rb > 0 && rb.is_multiple_of(file.block_bytes());
    if !whole || !w.len().is_multiple_of(group * rb) {
        return Err(bad());
    }
    let g = w
        .get(r / group * group * rb..(r / group + 1) * group * rb)
        .ok_or_else(bad)?;
    Ok((g, r % group))
}
