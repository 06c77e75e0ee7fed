//! The element types a KV cache stores its rows in ([`KvType`]), the growable row
//! buffers of each ([`RowBuf`]) and borrowed runs of them ([`Run`]), with the one
//! widening each type is read through.
//!
//! A compact cache ([`KvType::F16`], [`KvType::Q8_0`]) holds two arrays per layer: K
//! before RoPE and V, rounded to the type when written. Attention widens a run of rows
//! to `f32` (exactly: binary16 → `f32`, and Q8_0's `d · q` in one rounding, ggml's
//! `dequantize_row_q8_0`) and rotates each key at its entry's position as it reads it
//! ([`super::RopeAtRead`]), then runs the `f32` kernels on the widened rows. So every
//! path that reads a stored row (a decode step, a prefill, a batched decode) sees the
//! same `f32` values, and renumbering entries (an eviction, a context shift) changes
//! only their positions: the key is rotated once, at read, at its current position, the
//! arithmetic a forward pass at that position performs on the rounded key.
//!
//! An `f32` cache ([`KvType::F32`]) holds K after RoPE as well, written by the forward
//! pass and read as it is.

use fak_tensor::quant::{f16_to_f32, f32_to_f16, quantize_q8_0_into, BlockQ8_0};
#[cfg(target_arch = "x86_64")]
use fak_tensor::F16;
use std::ops::Range;

/// Values per Q8_0 block (ggml `QK8_0`).
const QK: usize = 32;

/// How a KV cache stores its rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvType {
    /// `f32` K after RoPE, K before RoPE and V: the values the forward pass computed
    /// (`3 × 4` bytes per element of a row).
    #[default]
    F32,
    /// IEEE binary16 K before RoPE and V, rounded to nearest even (`2 × 2` bytes per
    /// element: llama.cpp's default `f16` K and V).
    F16,
    /// ggml's Q8_0 blocks (one binary16 scale per 32 values, `d = max|x| / 127`,
    /// `q = round(x / d)`, `quantize_row_q8_0_ref`) for K before RoPE and V (`2 × 34/32`
    /// bytes per element). Needs rows of a multiple of 32 values.
    Q8_0,
}

impl KvType {
    /// Every type, smallest-rounding first.
    pub const ALL: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Q8_0];

    /// The type's name as the CLI and the session files spell it: `f32`, `f16`, `q8_0`.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// The type named `name` ([`KvType::name`]); `None` for another name.
    pub fn parse(name: &str) -> Option<KvType> {
        KvType::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Whether keys are stored before RoPE only and rotated as they are read.
    pub fn rotates_at_read(self) -> bool {
        self != KvType::F32
    }

    /// Arrays stored per layer: 3 for `f32` (K, K before RoPE, V), 2 otherwise.
    pub fn arrays(self) -> usize {
        if self.rotates_at_read() {
            2
        } else {
            3
        }
    }

    /// Bytes of one stored row of `kv_dim` values.
    pub fn row_bytes(self, kv_dim: usize) -> usize {
        match self {
            KvType::F32 => 4 * kv_dim,
            KvType::F16 => 2 * kv_dim,
            KvType::Q8_0 => kv_dim / QK * std::mem::size_of::<BlockQ8_0>(),
        }
    }

    /// Bytes one cache entry takes for a model of `n_layers` layers of `kv_dim`-value
    /// rows: every stored array of every layer, plus the entry's position (`u32`).
    pub fn bytes_per_token(self, n_layers: usize, kv_dim: usize) -> usize {
        self.arrays() * n_layers * self.row_bytes(kv_dim) + std::mem::size_of::<u32>()
    }

    /// Storage units (elements, or Q8_0 blocks) per row of `kv_dim` values.
    pub fn units_per_row(self, kv_dim: usize) -> usize {
        match self {
            KvType::Q8_0 => kv_dim / QK,
            _ => kv_dim,
        }
    }

    /// Bytes of one storage unit (an element, or a Q8_0 block).
    pub fn unit_bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
            KvType::Q8_0 => std::mem::size_of::<BlockQ8_0>(),
        }
    }

    /// Whether rows of `kv_dim` values can be stored in this type.
    ///
    /// # Errors
    /// A message when they cannot: Q8_0 needs a multiple of 32 values.
    pub fn check(self, kv_dim: usize) -> Result<(), String> {
        if self == KvType::Q8_0 && !kv_dim.is_multiple_of(QK) {
            return Err(format!(
                "kv type q8_0 needs rows of a multiple of {QK} values; this model's are {kv_dim}"
            ));
        }
        Ok(())
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One layer's K or V rows in a [`KvType`], growable: `rows × units_per_row` units
/// (elements, or Q8_0 blocks).
#[derive(Clone, Debug, PartialEq)]
pub enum RowBuf {
    /// `f32` values.
    F32(Vec<f32>),
    /// IEEE binary16 bits.
    F16(Vec<u16>),
    /// Q8_0 blocks.
    Q8_0(Vec<BlockQ8_0>),
}

impl RowBuf {
    /// An empty buffer of type `ty` with room for `units` units.
    pub fn with_capacity(ty: KvType, units: usize) -> RowBuf {
        match ty {
            KvType::F32 => RowBuf::F32(Vec::with_capacity(units)),
            KvType::F16 => RowBuf::F16(Vec::with_capacity(units)),
            KvType::Q8_0 => RowBuf::Q8_0(Vec::with_capacity(units)),
        }
    }

    /// The buffer's type.
    pub fn kv_type(&self) -> KvType {
        self.run().kv_type()
    }

    /// All rows held, borrowed.
    pub fn run(&self) -> Run<'_> {
        match self {
            RowBuf::F32(v) => Run::F32(v),
            RowBuf::F16(v) => Run::F16(v),
            RowBuf::Q8_0(v) => Run::Q8_0(v),
        }
    }

    /// Units held.
    pub fn units(&self) -> usize {
        self.run().units()
    }

    /// Hints that `units` more units are about to be appended ([`RowBuf::push_f32`]):
    /// the lines of the reserved memory they will go to are fetched for writing
    /// ([`fak_tensor::cpu::prefetch_for_write`]). Nothing when they do not fit in the
    /// reserved capacity (the push will move the buffer). Changes no value.
    pub fn prefetch_append(&self, units: usize) {
        fn ahead<T>(v: &Vec<T>, units: usize) {
            if v.capacity() - v.len() >= units {
                let end = v.as_ptr().wrapping_add(v.len()) as *const u8;
                // One line more: the rows need not start on a line boundary.
                fak_tensor::cpu::prefetch_for_write(end, units * std::mem::size_of::<T>() + 64);
            }
        }
        match self {
            RowBuf::F32(v) => ahead(v, units),
            RowBuf::F16(v) => ahead(v, units),
            RowBuf::Q8_0(v) => ahead(v, units),
        }
    }

    /// Appends whole rows given as `f32` values, rounded to the buffer's type.
    ///
    /// # Panics
    /// For Q8_0 when `x.len()` is not a multiple of 32 (the cache checks its row width
    /// when it is made, [`KvType::check`]).
    pub fn push_f32(&mut self, x: &[f32]) {
        match self {
            RowBuf::F32(v) => v.extend_from_slice(x),
            RowBuf::F16(v) => v.extend(x.iter().map(|&x| f32_to_f16(x))),
            RowBuf::Q8_0(v) => {
                // The blocks go through one buffer per thread, so a decode step's append
                // allocates nothing once it has grown to a row.
                thread_local! {
                    static BLOCKS: std::cell::RefCell<Vec<BlockQ8_0>> =
                        const { std::cell::RefCell::new(Vec::new()) };
                }
                BLOCKS.with_borrow_mut(|b| {
                    quantize_q8_0_into(x, b).expect("q8_0 rows of whole blocks");
                    v.extend_from_slice(b);
                });
            }
        }
    }

    /// Appends a run of the same type (its units copied as they are).
    ///
    /// # Panics
    /// If the run's type is another.
    pub fn extend_run(&mut self, run: Run<'_>) {
        match (self, run) {
            (RowBuf::F32(v), Run::F32(r)) => v.extend_from_slice(r),
            (RowBuf::F16(v), Run::F16(r)) => v.extend_from_slice(r),
            (RowBuf::Q8_0(v), Run::Q8_0(r)) => v.extend_from_slice(r),
            (b, r) => panic!("a {} run into a {} buffer", r.kv_type(), b.kv_type()),
        }
    }

    /// Appends units given as their bytes, as [`Run::as_bytes`] gives them (a session
    /// file's rows): little-endian values, or ggml's 34-byte `block_q8_0`s.
    ///
    /// # Panics
    /// If `bytes` is not whole units.
    pub fn extend_from_bytes(&mut self, bytes: &[u8]) {
        let unit = self.kv_type().unit_bytes();
        assert!(
            bytes.len().is_multiple_of(unit),
            "RowBuf: bytes that are not whole units"
        );
        match self {
            RowBuf::F32(v) => v.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            RowBuf::F16(v) => v.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]])),
            ),
            RowBuf::Q8_0(v) => v.extend(
                bytes
                    .chunks_exact(unit)
                    .map(bytemuck::pod_read_unaligned::<BlockQ8_0>),
            ),
        }
    }

    /// Removes units `range`.
    pub fn drain_units(&mut self, range: Range<usize>) {
        match self {
            RowBuf::F32(v) => drop(v.drain(range)),
            RowBuf::F16(v) => drop(v.drain(range)),
            RowBuf::Q8_0(v) => drop(v.drain(range)),
        }
    }

    /// Keeps the first `units` units.
    pub fn truncate_units(&mut self, units: usize) {
        match self {
            RowBuf::F32(v) => v.truncate(units),
            RowBuf::F16(v) => v.truncate(units),
            RowBuf::Q8_0(v) => v.truncate(units),
        }
    }

    /// Bytes of the units held.
    pub fn bytes(&self) -> usize {
        self.run().as_bytes().len()
    }

    /// Bytes allocated.
    pub fn capacity_bytes(&self) -> usize {
        match self {
            RowBuf::F32(v) => v.capacity() * 4,
            RowBuf::F16(v) => v.capacity() * 2,
            RowBuf::Q8_0(v) => v.capacity() * std::mem::size_of::<BlockQ8_0>(),
        }
    }
}

/// Borrowed units of a [`RowBuf`].
#[derive(Clone, Copy, Debug)]
pub enum Run<'a> {
    /// `f32` values.
    F32(&'a [f32]),
    /// IEEE binary16 bits.
    F16(&'a [u16]),
    /// Q8_0 blocks.
    Q8_0(&'a [BlockQ8_0]),
}

impl<'a> Run<'a> {
    /// The run's type.
    pub fn kv_type(&self) -> KvType {
        match self {
            Run::F32(_) => KvType::F32,
            Run::F16(_) => KvType::F16,
            Run::Q8_0(_) => KvType::Q8_0,
        }
    }

    /// Units held.
    pub fn units(&self) -> usize {
        match self {
            Run::F32(r) => r.len(),
            Run::F16(r) => r.len(),
            Run::Q8_0(r) => r.len(),
        }
    }

    /// Units `range` of the run.
    ///
    /// # Panics
    /// If `range` reaches past the run.
    pub fn slice(&self, range: Range<usize>) -> Run<'a> {
        match *self {
            Run::F32(r) => Run::F32(&r[range]),
            Run::F16(r) => Run::F16(&r[range]),
            Run::Q8_0(r) => Run::Q8_0(&r[range]),
        }
    }

    /// The units' bytes, in memory order (little-endian values on the hosts fak runs
    /// on; a Q8_0 block is ggml's 34-byte `block_q8_0`).
    pub fn as_bytes(&self) -> &'a [u8] {
        match *self {
            Run::F32(r) => bytemuck::cast_slice(r),
            Run::F16(r) => bytemuck::cast_slice(r),
            Run::Q8_0(r) => bytemuck::cast_slice(r),
        }
    }

    /// Writes values `cols` of row `j` (rows of `kv_dim` values) as `f32` to `out`
    /// (`[cols.len()]`): copied, widened exactly (binary16), or `d · q` (Q8_0, ggml's
    /// `dequantize_row_q8_0`).
    ///
    /// # Panics
    /// If the row or the columns lie outside the run, or `out` is shorter.
    pub fn widen_row(&self, j: usize, kv_dim: usize, cols: Range<usize>, out: &mut [f32]) {
        let out = &mut out[..cols.len()];
        match *self {
            Run::F32(r) => out.copy_from_slice(&r[j * kv_dim + cols.start..j * kv_dim + cols.end]),
            Run::F16(r) => widen_f16(&r[j * kv_dim + cols.start..j * kv_dim + cols.end], out),
            Run::Q8_0(r) => {
                let row = &r[j * (kv_dim / QK)..(j + 1) * (kv_dim / QK)];
                for (o, c) in out.iter_mut().zip(cols) {
                    let b = &row[c / QK];
                    *o = f16_to_f32(b.d) * b.qs[c % QK] as f32;
                }
            }
        }
    }
}

impl Run<'_> {
    /// [`Run::widen_row`] of `n` consecutive rows from row `j`, into `out` at a stride
    /// of `cols.len()` (`out[i * cols.len()..]` is row `j + i`'s): the same values, the
    /// type and the CPU's kernel chosen once for the rows rather than per row
    /// (AVX2/F16C eight values at a time where the columns are whole eights, else per
    /// value; both give the same bits). Each row 32 ahead is asked for as a row is
    /// widened.
    ///
    /// # Panics
    /// If the rows or the columns lie outside the run, or `out` holds fewer than
    /// `n · cols.len()` values.
    pub fn widen_rows(
        &self,
        j: usize,
        n: usize,
        kv_dim: usize,
        cols: Range<usize>,
        out: &mut [f32],
    ) {
        let nc = cols.len();
        let out = &mut out[..n * nc];
        assert!(
            cols.end <= kv_dim,
            "widen_rows: columns {cols:?} of {kv_dim}"
        );
        let units = self.units();
        let upr = self.kv_type().units_per_row(kv_dim);
        assert!(
            (j + n) * upr <= units,
            "widen_rows: rows {j}..{} of {}",
            j + n,
            units / upr.max(1)
        );
        #[cfg(target_arch = "x86_64")]
        if fak_tensor::cpu::has_avx2_f16c() && cols.start.is_multiple_of(8) && nc.is_multiple_of(8)
        {
            // SAFETY: AVX2 and F16C were detected; rows `j..j + n` lie inside the run
            // and `cols` inside a row (both asserted above), `out` holds `n` rows of
            // `nc`, and the columns are whole groups of eight.
            unsafe { widen_rows_avx2(*self, j, kv_dim, cols, out) };
            return;
        }
        for (i, o) in out.chunks_exact_mut(nc.max(1)).enumerate() {
            self.widen_row(j + i, kv_dim, cols.clone(), o);
        }
    }

    /// [`Run::widen_rows`] of keys stored before RoPE, each row's heads then rotated at
    /// its entry's position: `rot(i)` is the `cos` and `sin` rows (`half` values each)
    /// of row `j + i`'s position, and every head of `head_dim` values in `cols` gets
    /// [`fak_tensor::rope_rotate_half`] with them. With AVX2/F16C and whole eights
    /// (`half` and `head_dim − 2·half`), widening and rotation are one pass in
    /// registers; otherwise the rows are widened, then rotated. The same bits either
    /// way.
    ///
    /// # Panics
    /// As [`Run::widen_rows`]; or if `cols` is not whole heads, or `rot` gives rows of
    /// another length than `half` or `2·half > head_dim`.
    #[allow(clippy::too_many_arguments)]
    pub fn widen_rows_rotated<'t>(
        &self,
        j: usize,
        n: usize,
        kv_dim: usize,
        cols: Range<usize>,
        (head_dim, half): (usize, usize),
        rot: &dyn Fn(usize) -> (&'t [f32], &'t [f32]),
        out: &mut [f32],
    ) {
        let nc = cols.len();
        assert!(
            head_dim > 0
                && 2 * half <= head_dim
                && cols.start.is_multiple_of(head_dim)
                && nc.is_multiple_of(head_dim),
            "widen_rows_rotated: columns {cols:?} are not whole heads of {head_dim} (rotary half {half})"
        );
        #[cfg(target_arch = "x86_64")]
        if fak_tensor::cpu::has_avx2_f16c()
            && half.is_multiple_of(8)
            && (head_dim - 2 * half).is_multiple_of(8)
            && cols.end <= kv_dim
            && (j + n) * self.kv_type().units_per_row(kv_dim) <= self.units()
            && out.len() >= n * nc
        {
            let checked = |i: usize| {
                let (c, s) = rot(i);
                assert!(
                    c.len() == half && s.len() == half,
                    "widen_rows_rotated: rotation rows of {} and {}, not {half}",
                    c.len(),
                    s.len()
                );
                (c, s)
            };
            // SAFETY: AVX2 and F16C were detected; the rows lie inside the run, `cols`
            // inside a row, `out` holds `n` rows of `nc` (checked above); `cols` is
            // whole heads and so whole eights, and `checked` gives rows of `half`.
            unsafe {
                widen_rows_rotated_avx2(*self, j, kv_dim, cols, head_dim, half, &checked, out)
            };
            return;
        }
        self.widen_rows(j, n, kv_dim, cols, out);
        for (i, row) in out[..n * nc].chunks_exact_mut(nc.max(1)).enumerate() {
            let (c, s) = rot(i);
            for head in row.chunks_exact_mut(head_dim) {
                fak_tensor::rope_rotate_half(head, c, s);
            }
        }
    }
}

/// Rows ahead of the one being widened that [`Run::widen_rows`] asks the memory for:
/// a decode step reads a long cache in entry order, and without it the widening waited
/// on each row's load (the `f32` kernels prefetch the same way, `fak_tensor::dot`).
const PREFETCH_ROWS: usize = 32;

/// [`Run::widen_rows`] with AVX2 and F16C, eight values at a time ([`Eights`]):
/// binary16 widened by `vcvtph2ps` (exact, as [`f16_to_f32`] for every non-NaN value),
/// Q8_0's `d · q` as an exactly widened integer times the block's widened scale in one
/// rounded product, ggml's `dequantize_row_q8_0`, lane by lane. So the same bits as the
/// scalar path.
///
/// # Safety
/// The CPU supports AVX2 and F16C. Rows `j..j + out.len() / cols.len()` lie inside
/// `run`, `cols` inside a row of `kv_dim` values, and `cols.start` and `cols.len()`
/// are multiples of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_rows_avx2(
    run: Run<'_>,
    j: usize,
    kv_dim: usize,
    cols: Range<usize>,
    out: &mut [f32],
) {
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn go<E: Eights>(e: E, j: usize, cols: Range<usize>, out: &mut [f32]) {
        let nc = cols.len();
        for (i, o) in out.chunks_exact_mut(nc).enumerate() {
            e.prefetch(j + i + PREFETCH_ROWS, cols.clone());
            // SAFETY: row `j + i` lies inside the run and `cols` inside a row (the
            // caller's contract), `o` holds `nc` values; AVX2 and F16C are enabled.
            unsafe { e.widen(j + i, cols.clone(), o.as_mut_ptr()) };
        }
    }
    // SAFETY (each arm): the caller's contract, passed on.
    match run {
        Run::F32(r) => unsafe { go(Flat(r, kv_dim), j, cols, out) },
        Run::F16(r) => unsafe { go(Flat(F16::from_bits_slice(r), kv_dim), j, cols, out) },
        Run::Q8_0(r) => unsafe { go(Q8Rows(r, kv_dim / QK), j, cols, out) },
    }
}

/// [`Run::widen_rows_rotated`] with AVX2 and F16C in one pass: each head's two halves
/// widened eight values at a time ([`Eights`]) and rotated in registers, `x1·cos −
/// x2·sin` and `x2·cos + x1·sin` (each two rounded products and a rounded sum, as
/// [`fak_tensor::rope_rotate_half`] does lane by lane), the columns past the rotary
/// part copied as widened. So the same bits as [`widen_rows_avx2`] followed by
/// `rope_rotate_half` of each head, without writing and re-reading the rows between.
///
/// # Safety
/// As [`widen_rows_avx2`]; moreover `head_dim` divides `cols.start` and `cols.len()`,
/// `rot(i)` gives two slices of `half` values with `half` and `head_dim − 2·half`
/// multiples of 8 (and `2·half <= head_dim`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn widen_rows_rotated_avx2<'t>(
    run: Run<'_>,
    j: usize,
    kv_dim: usize,
    cols: Range<usize>,
    head_dim: usize,
    half: usize,
    rot: &dyn Fn(usize) -> (&'t [f32], &'t [f32]),
    out: &mut [f32],
) {
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn go<'t, E: Eights>(
        e: E,
        (j, cols): (usize, Range<usize>),
        (head_dim, half): (usize, usize),
        rot: &dyn Fn(usize) -> (&'t [f32], &'t [f32]),
        out: &mut [f32],
    ) {
        use std::arch::x86_64::*;
        let nc = cols.len();
        for (i, o) in out.chunks_exact_mut(nc).enumerate() {
            let (row, (cos, sin)) = (j + i, rot(i));
            debug_assert!(cos.len() == half && sin.len() == half);
            e.prefetch(row + PREFETCH_ROWS, cols.clone());
            for (h, oh) in o.chunks_exact_mut(head_dim).enumerate() {
                let at = cols.start + h * head_dim;
                let op = oh.as_mut_ptr();
                // The scales of the blocks the two halves' current eights lie in
                // (Q8_0), taken anew where an eight starts a block.
                let (mut d1, mut d2) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut c = 0;
                while c < half {
                    // SAFETY: `c + 8 <= half`, so columns `at + c..` and
                    // `at + half + c..` (eight each) lie inside this head of the row,
                    // and `cos`/`sin` hold `half` values; AVX2 and F16C are enabled.
                    unsafe {
                        if E::SCALED && (c == 0 || (at + c).is_multiple_of(QK)) {
                            d1 = e.scale(row, at + c);
                        }
                        if E::SCALED && (c == 0 || (at + half + c).is_multiple_of(QK)) {
                            d2 = e.scale(row, at + half + c);
                        }
                        let x1 = e.load8_scaled(row, at + c, d1);
                        let x2 = e.load8_scaled(row, at + half + c, d2);
                        let cv = _mm256_loadu_ps(cos.as_ptr().add(c));
                        let sv = _mm256_loadu_ps(sin.as_ptr().add(c));
                        let a = _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv));
                        let b = _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv));
                        _mm256_storeu_ps(op.add(c), a);
                        _mm256_storeu_ps(op.add(half + c), b);
                    }
                    c += 8;
                }
                let mut c = 2 * half;
                while c < head_dim {
                    // SAFETY: `c + 8 <= head_dim` (the caller's multiples of 8).
                    unsafe { _mm256_storeu_ps(op.add(c), e.load8(row, at + c)) };
                    c += 8;
                }
            }
        }
    }
    let (jc, hh) = ((j, cols), (head_dim, half));
    // SAFETY (each arm): the caller's contract, passed on.
    match run {
        Run::F32(r) => unsafe { go(Flat(r, kv_dim), jc, hh, rot, out) },
        Run::F16(r) => unsafe { go(Flat(F16::from_bits_slice(r), kv_dim), jc, hh, rot, out) },
        Run::Q8_0(r) => unsafe { go(Q8Rows(r, kv_dim / QK), jc, hh, rot, out) },
    }
}

/// Rows of one stored type read as `f32`, eight values at a time: the loads that the
/// AVX2 widening kernels are generic over, so each type's kernel is compiled on its own
/// with no per-load dispatch.
#[cfg(target_arch = "x86_64")]
trait Eights: Copy {
    /// Values `col..col + 8` of row `row`, widened.
    ///
    /// # Safety
    /// AVX2 and F16C; the row lies inside the rows, `col + 8` inside a row, and for
    /// Q8_0 `col` is a multiple of 8 (the eight lie in one block).
    unsafe fn load8(self, row: usize, col: usize) -> std::arch::x86_64::__m256;
    /// Whether the values are scaled per block ([`Eights::scale`]).
    const SCALED: bool = false;
    /// The scale of the block holding column `col` of row `row`, in every lane (a
    /// type without scales: unused zeros).
    ///
    /// # Safety
    /// As [`Eights::load8`].
    #[inline(always)]
    unsafe fn scale(self, _row: usize, _col: usize) -> std::arch::x86_64::__m256 {
        // SAFETY: AVX, enabled by the caller's AVX2.
        unsafe { std::arch::x86_64::_mm256_setzero_ps() }
    }
    /// [`Eights::load8`] given the block's [`Eights::scale`] (ignored by a type without
    /// scales).
    ///
    /// # Safety
    /// As [`Eights::load8`]; `d` is the scale of the block holding `col`.
    #[inline(always)]
    unsafe fn load8_scaled(
        self,
        row: usize,
        col: usize,
        _d: std::arch::x86_64::__m256,
    ) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { self.load8(row, col) }
    }
    /// Asks for the lines of row `row`'s values `cols` ([`prefetch`]; a row past the
    /// end is harmless).
    fn prefetch(self, row: usize, cols: Range<usize>);
    /// Values `cols` of row `row` widened to `out[..cols.len()]`, eight at a time.
    ///
    /// # Safety
    /// As [`Eights::load8`] for every eight of `cols` (whole eights); `out` is valid
    /// for `cols.len()` writes.
    #[inline(always)]
    unsafe fn widen(self, row: usize, cols: Range<usize>, out: *mut f32) {
        let mut c = cols.start;
        while c < cols.end {
            // SAFETY: the caller's contract, for the eight at `c`.
            unsafe {
                std::arch::x86_64::_mm256_storeu_ps(out.add(c - cols.start), self.load8(row, c))
            };
            c += 8;
        }
    }
}

/// Rows of `kv_dim` values of one element type (`f32`, or binary16 as
/// [`fak_tensor::F16`]), widened by the type's own eight-lane load.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Flat<'a, W>(&'a [W], usize);
/// Q8_0 rows of the given number of blocks.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Q8Rows<'a>(&'a [BlockQ8_0], usize);

#[cfg(target_arch = "x86_64")]
impl<W: fak_tensor::WeightElem> Eights for Flat<'_, W> {
    #[inline(always)]
    unsafe fn load8(self, row: usize, col: usize) -> std::arch::x86_64::__m256 {
        // SAFETY: the trait's contract: eight values inside the rows; AVX2 and F16C
        // are enabled by the caller.
        unsafe { W::load8(self.0.as_ptr().add(row * self.1 + col)) }
    }
    #[inline(always)]
    fn prefetch(self, row: usize, cols: Range<usize>) {
        prefetch(self.0, row * self.1 + cols.start, cols.len());
    }
}

#[cfg(target_arch = "x86_64")]
impl Eights for Q8Rows<'_> {
    #[inline(always)]
    unsafe fn load8(self, row: usize, col: usize) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.load8_scaled(row, col, self.scale(row, col)) }
    }
    const SCALED: bool = true;
    #[inline(always)]
    unsafe fn scale(self, row: usize, col: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the trait's contract: the block lies inside the rows; F16C is
        // enabled by the caller.
        unsafe {
            let b = &*self.0.as_ptr().add(row * self.1 + col / QK);
            _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(b.d as i32))))
        }
    }
    #[inline(always)]
    unsafe fn load8_scaled(
        self,
        row: usize,
        col: usize,
        d: std::arch::x86_64::__m256,
    ) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the trait's contract: `col % QK + 8 <= QK` (a multiple of 8), so the
        // 8-byte load stays inside the block's `qs`; AVX2 is enabled by the caller.
        unsafe {
            let b = &*self.0.as_ptr().add(row * self.1 + col / QK);
            let q = _mm_loadl_epi64(b.qs.as_ptr().add(col % QK) as *const __m128i);
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)))
        }
    }
    #[inline(always)]
    fn prefetch(self, row: usize, cols: Range<usize>) {
        let blocks = cols.start / QK..cols.end.div_ceil(QK);
        prefetch(self.0, row * self.1 + blocks.start, blocks.len());
    }
    /// Block by block: each block's scale widened once for its eights.
    #[inline(always)]
    unsafe fn widen(self, row: usize, cols: Range<usize>, out: *mut f32) {
        use std::arch::x86_64::*;
        let mut c = cols.start;
        while c < cols.end {
            let end = cols.end.min((c / QK + 1) * QK);
            // SAFETY: the trait's contract: the block lies inside the rows, each eight
            // `c..c + 8 <= end` inside its `qs`, and `out` is valid for the columns.
            unsafe {
                let d = self.scale(row, c);
                while c < end {
                    _mm256_storeu_ps(out.add(c - cols.start), self.load8_scaled(row, c, d));
                    c += 8;
                }
            }
        }
    }
}

/// Asks for units `at..at + n` of `units` to be brought into the core's L2
/// (`prefetcht1`). A prefetch never faults, so units past the end are harmless: the
/// address is formed with wrapping arithmetic and never read.
#[inline(always)]
fn prefetch<T>(units: &[T], at: usize, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        // Every 64-byte line the units touch, from the one holding their first byte.
        let p = units.as_ptr().wrapping_add(at) as *const i8;
        let skew = p as usize % 64;
        let (first, bytes) = (p.wrapping_sub(skew), skew + n * std::mem::size_of::<T>());
        let mut b = 0;
        while b < bytes {
            // SAFETY: `prefetcht1` is SSE (every x86_64 CPU) and never faults or reads
            // into the program, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(first.wrapping_add(b)) };
            b += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (units, at, n);
}

/// Widens binary16 bits to `f32` exactly ([`f16_to_f32`]; eight at a time with F16C
/// where the CPU has it, which gives the same bits for every non-NaN value:
/// `fak_tensor::elem`).
fn widen_f16(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if fak_tensor::cpu::has_avx2_f16c() {
        // SAFETY: AVX2 and F16C were detected.
        unsafe { widen_f16c(src, dst) };
        return;
    }
    for (d, &h) in dst.iter_mut().zip(src) {
        *d = f16_to_f32(h);
    }
}

/// [`widen_f16`] with F16C.
///
/// # Safety
/// The CPU supports AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_f16c(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n` elements are readable in `src` and writable in `dst`;
        // F16C is enabled on this function.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for k in i..n {
        dst[k] = f16_to_f32(src[k]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_within_each_types_rounding() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.37).collect();
        for ty in KvType::ALL {
            let mut b = RowBuf::with_capacity(ty, 0);
            b.push_f32(&x);
            assert_eq!(b.units(), 2 * ty.units_per_row(32));
            let mut out = vec![0f32; 64];
            b.run().widen_row(0, 64, 0..64, &mut out);
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let tol = match ty {
                KvType::F32 => 0.0,
                KvType::F16 => amax / 1024.0,
                KvType::Q8_0 => amax / 127.0,
            };
            for (a, b) in out.iter().zip(&x) {
                assert!((a - b).abs() <= tol, "{ty}: {a} vs {b}");
            }
            // A column range gives the same values as the whole row.
            let mut part = vec![0f32; 40];
            b.run().widen_row(0, 64, 17..57, &mut part);
            assert_eq!(part, out[17..57]);
        }
    }

    /// Which `widen_rows` kernel a test runs.
    #[derive(Clone, Copy, Debug)]
    enum Widen {
        /// [`Run::widen_rows`] as dispatched on this CPU.
        Dispatched,
        #[cfg(target_arch = "x86_64")]
        Avx2,
    }

    /// `n` values in runs of 32 (a Q8_0 block each) of very different scales:
    /// binary16 subnormals, values up to binary16's largest, zeros of both signs.
    fn corner_rows(n: usize) -> Vec<f32> {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        (0..n)
            .map(|i| {
                let v = next();
                match (i / 32) % 5 {
                    0 => v * 1e-5,  // binary16 subnormals
                    1 => v * 1.2e5, // up to binary16's largest
                    2 if i % 7 == 0 => -0.0,
                    3 => v * 3.0,
                    _ => v * 1e-2,
                }
            })
            .collect()
    }

    /// 40 rows of 128 values (two 64-wide heads; more rows than the prefetch distance)
    /// of every type, with binary16 subnormals, values near binary16's largest, zeros
    /// of both signs and Q8_0 blocks of very different scales, widened a run at a
    /// time by `how` over column ranges of whole heads and of single eights, against
    /// each value's formula: `f16_to_f32` of the stored binary16, or
    /// `f16_to_f32(d) * q` of its block, bit for bit.
    fn widen_rows_give_the_formula_bits(how: Widen) {
        let (kv_dim, rows) = (128usize, 40usize);
        let x = corner_rows(rows * kv_dim);
        for ty in KvType::ALL {
            let mut b = RowBuf::with_capacity(ty, 0);
            b.push_f32(&x);
            let run = b.run();
            let want = |j: usize, c: usize| -> f32 {
                match run {
                    Run::F32(r) => r[j * kv_dim + c],
                    Run::F16(r) => f16_to_f32(r[j * kv_dim + c]),
                    Run::Q8_0(r) => {
                        let blk = &r[j * (kv_dim / QK) + c / QK];
                        f16_to_f32(blk.d) * blk.qs[c % QK] as f32
                    }
                }
            };
            for cols in [0..kv_dim, 64..128, 8..16, 96..104, 16..112] {
                for (j, n) in [(0usize, rows), (3, 29), (39, 1)] {
                    let nc = cols.len();
                    let mut out = vec![f32::NAN; n * nc];
                    match how {
                        Widen::Dispatched => run.widen_rows(j, n, kv_dim, cols.clone(), &mut out),
                        // SAFETY: the test's attribute ran it only on a CPU with these
                        // features; the rows and columns lie inside the run and the
                        // columns are whole groups of the kernel's width.
                        #[cfg(target_arch = "x86_64")]
                        Widen::Avx2 => unsafe {
                            widen_rows_avx2(run, j, kv_dim, cols.clone(), &mut out)
                        },
                    }
                    for (i, row) in out.chunks_exact(nc).enumerate() {
                        for (k, got) in row.iter().enumerate() {
                            let w = want(j + i, cols.start + k);
                            assert_eq!(
                                got.to_bits(),
                                w.to_bits(),
                                "{how:?} {ty}: row {} column {}: {got} vs {w}",
                                j + i,
                                cols.start + k
                            );
                        }
                    }
                }
            }
            // The data reached the corners the kernels treat differently.
            if let Run::F16(r) = run {
                assert!(
                    r.iter().any(|&h| h & 0x7c00 == 0 && h & 0x3ff != 0),
                    "no subnormal"
                );
                assert!(r.contains(&0x8000), "no -0");
            }
        }
    }

    #[test]
    fn widen_rows_as_dispatched_give_the_formula_bits() {
        widen_rows_give_the_formula_bits(Widen::Dispatched);
    }

    #[fak_testkit::cpu("avx2", "f16c")]
    #[cfg(target_arch = "x86_64")]
    fn widen_rows_with_avx2_give_the_formula_bits() {
        widen_rows_give_the_formula_bits(Widen::Avx2);
    }

    /// Keys widened and rotated a run at a time by `how` against the formula: each
    /// value widened alone ([`Run::widen_row`]), then each head's pairs `x1·cos − x2·sin`
    /// and `x2·cos + x1·sin` computed one value at a time, bit for bit; on every type,
    /// for full and partial rotary heads (the columns past the rotary part copied), over
    /// whole rows and single heads.
    fn widen_rows_rotated_give_the_formula_bits(how: Widen) {
        let (kv_dim, rows) = (128usize, 40usize);
        let x = corner_rows(rows * kv_dim);
        // (head_dim, half): full rotary on heads of 64 and 32 values, and partial
        // rotary on 64 (16 pairs rotated, the last 32 values copied).
        for (head_dim, half) in [(64usize, 32usize), (32, 16), (64, 16)] {
            // A position's rotation: different values per row and pair.
            let tables: Vec<(Vec<f32>, Vec<f32>)> = (0..rows)
                .map(|r| {
                    let th = |i: usize| (r as f32 + 1.0) * 0.37 / (i as f32 + 1.0);
                    (
                        (0..half).map(|i| th(i).cos()).collect(),
                        (0..half).map(|i| th(i).sin()).collect(),
                    )
                })
                .collect();
            for ty in KvType::ALL {
                let mut b = RowBuf::with_capacity(ty, 0);
                b.push_f32(&x);
                let run = b.run();
                for cols in [0..kv_dim, head_dim..2 * head_dim] {
                    for (j, n) in [(0usize, rows), (5, 33), (39, 1)] {
                        let nc = cols.len();
                        let rot = |i: usize| {
                            let (c, s) = &tables[j + i];
                            (&c[..], &s[..])
                        };
                        let mut got = vec![f32::NAN; n * nc];
                        let hh = (head_dim, half);
                        match how {
                            Widen::Dispatched => run.widen_rows_rotated(
                                j,
                                n,
                                kv_dim,
                                cols.clone(),
                                hh,
                                &rot,
                                &mut got,
                            ),
                            // SAFETY: the test's attribute ran it only on a CPU with
                            // these features; the rows and columns lie inside the run,
                            // the columns are whole heads, `half` and the copied rest
                            // whole eights, and `rot` gives rows of `half`.
                            #[cfg(target_arch = "x86_64")]
                            Widen::Avx2 => unsafe {
                                widen_rows_rotated_avx2(
                                    run,
                                    j,
                                    kv_dim,
                                    cols.clone(),
                                    head_dim,
                                    half,
                                    &rot,
                                    &mut got,
                                )
                            },
                        }
                        for i in 0..n {
                            let mut want = vec![0f32; nc];
                            run.widen_row(j + i, kv_dim, cols.clone(), &mut want);
                            let (c, s) = rot(i);
                            for head in want.chunks_exact_mut(head_dim) {
                                for k in 0..half {
                                    let (x1, x2) = (head[k], head[half + k]);
                                    head[k] = x1 * c[k] - x2 * s[k];
                                    head[half + k] = x2 * c[k] + x1 * s[k];
                                }
                            }
                            for (k, (g, w)) in
                                got[i * nc..(i + 1) * nc].iter().zip(&want).enumerate()
                            {
                                assert_eq!(
                                    g.to_bits(),
                                    w.to_bits(),
                                    "{how:?} {ty} head {head_dim}/{half}: row {} column {}: {g} vs {w}",
                                    j + i,
                                    cols.start + k
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn widen_rows_rotated_as_dispatched_give_the_formula_bits() {
        widen_rows_rotated_give_the_formula_bits(Widen::Dispatched);
    }

    #[fak_testkit::cpu("avx2", "f16c")]
    #[cfg(target_arch = "x86_64")]
    fn widen_rows_rotated_with_avx2_give_the_formula_bits() {
        widen_rows_rotated_give_the_formula_bits(Widen::Avx2);
    }

    #[test]
    fn bytes_per_token_of_smollm2() {
        // 30 layers of 3 KV heads × 64: llama.cpp's f16 K and V take 23,040 bytes.
        assert_eq!(KvType::F32.bytes_per_token(30, 192), 3 * 30 * 192 * 4 + 4);
        assert_eq!(KvType::F16.bytes_per_token(30, 192), 23_040 + 4);
        assert_eq!(KvType::Q8_0.bytes_per_token(30, 192), 2 * 30 * 6 * 34 + 4);
        assert!(KvType::Q8_0.check(48).is_err());
        assert_eq!(KvType::parse("q8_0"), Some(KvType::Q8_0));
        assert_eq!(KvType::parse("q4_0"), None);
    }
}
