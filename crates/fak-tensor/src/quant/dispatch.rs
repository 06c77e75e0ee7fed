//! Type-generic entry points: an activation row quantized for a weight type, and one row
//! or one matrix of any weight type times it, through the fast kernels or the scalar
//! references (the same bits).

#[cfg(target_arch = "x86_64")]
use super::avx2;
#[cfg(target_arch = "x86_64")]
use super::tiles::{rows4, rows4_512};
use super::*;

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
        // A row-pair matrix's row is not consecutive bytes (`q8_0_r2::vec_dot_row`).
        (QType::Q8_0R2, A::Q8_0(_), _) => Err(QuantError::MatrixShape {
            detail: "Q8_0_R2 rows are interleaved in pairs: no single-row product".into(),
        }),
        // Nor is a 16-row group's (`q4_1_r16::vec_dot_row_q4_1_r16`).
        (QType::Q4_1R16, A::Q8_1(_), _) => Err(QuantError::MatrixShape {
            detail: "Q4_1_R16 rows are interleaved in groups of 16: no single-row product".into(),
        }),
        (QType::Q8_0R16, A::Q8_0(_), _) => Err(QuantError::MatrixShape {
            detail: "Q8_0_R16 rows are interleaved in groups of 16: no single-row product".into(),
        }),
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
    if !rows.is_multiple_of(ty.row_group()) {
        return Err(QuantError::MatrixShape {
            detail: format!(
                "{ty}: {rows} rows, not whole groups of {} rows",
                ty.row_group()
            ),
        });
    }
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

pub(crate) fn matvec_with(
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
pub(crate) fn matvec_isa(
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
    if ty == QType::Q8_0R2 {
        #[cfg(target_arch = "x86_64")]
        if let (true, true, QuantizedActs::Q8_0(a)) = (simd && has_avx2_f16c(), zmm, act) {
            // SAFETY: AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI were detected
            // (`zmm` implies the AVX-512 set: `has_avx512_vnni`); `check_matvec` checked
            // `w` is `out.len()` (even) rows of `rb = 34 · a.len()` bytes.
            unsafe { super::tiles::r2_one_token(w, rb, a, out) };
            return Ok(());
        }
        return super::q8_0_r2::matvec_ref(w, act, out, simd);
    }
    if ty == QType::Q4_1R16 {
        #[cfg(target_arch = "x86_64")]
        if let (true, true, QuantizedActs::Q8_1(a)) = (simd && has_avx2_f16c(), zmm, act) {
            // SAFETY: AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI were detected
            // (`zmm` implies the AVX-512 set: `has_avx512_vnni`); `check_matvec` checked
            // `w` is `out.len()` (a multiple of 16) rows of `rb = 20 · a.len()` bytes.
            unsafe { avx2::rows_r16_512(w, rb, &[&a[..]], &mut [out]) };
            return Ok(());
        }
        return super::q4_1_r16::matvec_ref(w, act, out, simd);
    }
    if ty == QType::Q8_0R16 {
        #[cfg(target_arch = "x86_64")]
        if let (true, true, QuantizedActs::Q8_0(a)) = (simd && has_avx2_f16c(), zmm, act) {
            // SAFETY: AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI were detected
            // (`zmm` implies the AVX-512 set: `has_avx512_vnni`); `check_matvec` checked
            // `w` is `out.len()` (a multiple of 16) rows of `rb = 34 · a.len()` bytes.
            unsafe { avx2::rows_r16_q8_0_512(w, rb, &[&a[..]], &mut [out]) };
            return Ok(());
        }
        return super::q8_0_r16::matvec_ref(w, act, out, simd);
    }
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx2_f16c() {
        use QuantizedActs as A;
        // SAFETY (all arms): AVX2 and F16C were detected (AVX-VNNI too when `vnni`,
        // AVX-512F/BW/DQ/VL and AVX512-VNNI when `zmm`); `check_matvec` established that `act`
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
