//! Element-wise and row-wise operations: RMSNorm, RoPE, softmax, SiLU, residual add.
//!
//! Each follows the operation order of HF transformers' PyTorch code (cited per item),
//! with reductions in the canonical order of [`crate::dot()`], so results depend only on
//! the row itself.

use crate::dot::dot;

/// RMSNorm of one row (Zhang & Sennrich 2019; HF `LlamaRMSNorm.forward`):
/// `out[i] = (weight[i] + weight_offset) * (x[i] * rsqrt(mean(x²) + eps))`.
///
/// `weight_offset` is 0 for Llama/Qwen and 1 for Gemma's `(1 + weight)` gain when the
/// stored weight does not already include it. Shapes: `x`, `weight`, `out` all `[dim]`.
///
/// # Panics
/// If the lengths differ (a programming error).
pub fn rms_norm(x: &[f32], weight: &[f32], weight_offset: f32, eps: f32, out: &mut [f32]) {
    assert!(
        x.len() == weight.len() && x.len() == out.len(),
        "rms_norm: lengths differ"
    );
    let mean = dot(x, x) / x.len() as f32;
    let inv = 1.0 / (mean + eps).sqrt();
    if weight_offset == 0.0 {
        for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(weight) {
            *o = wi * (xi * inv);
        }
    } else {
        for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(weight) {
            *o = (wi + weight_offset) * (xi * inv);
        }
    }
}

/// Rotary position embedding tables (Su et al. 2021, RoFormer), computed as HF's rope
/// init functions do (`transformers.modeling_rope_utils`): `inv_freq[i] = 1 / base^(2i/d)`
/// in `f32` (or `1 / (factor[i] · base^(2i/d))` for per-dimension scaling such as
/// `longrope`), `freq = pos * inv_freq[i]` as an `f32` product, then `cos`/`sin` of that
/// `f32` angle, each times the attention factor (1 unless the scaling sets one).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    inv_freq: Vec<f32>,
    attention_factor: f32,
}

impl RopeTable {
    /// Table for rotary dimension `rot_dim` (even; the head dimension for Llama) and
    /// base `theta` (HF `rope_theta`, GGUF `rope.freq_base`).
    pub fn new(rot_dim: usize, theta: f32) -> Self {
        let inv_freq = (0..rot_dim / 2)
            .map(|i| {
                let e = (2 * i) as f32 / rot_dim as f32;
                1.0 / theta.powf(e)
            })
            .collect();
        RopeTable {
            inv_freq,
            attention_factor: 1.0,
        }
    }

    /// Table with per-dimension frequency factors and an attention factor, as HF's
    /// `_compute_longrope_parameters` returns them: `inv_freq[i] = 1 / (factors[i] ·
    /// base^(2i/d))` (the product in `f32`, as torch computes it), and `cos`/`sin` each
    /// multiplied by `attention_factor`. `factors` has `rot_dim / 2` entries (HF
    /// `short_factor` or `long_factor`); `None` when it has not.
    pub fn scaled(
        rot_dim: usize,
        theta: f32,
        factors: &[f32],
        attention_factor: f32,
    ) -> Option<Self> {
        if factors.len() != rot_dim / 2 {
            return None;
        }
        let inv_freq = factors
            .iter()
            .enumerate()
            .map(|(i, &f)| {
                let e = (2 * i) as f32 / rot_dim as f32;
                1.0 / (f * theta.powf(e))
            })
            .collect();
        Some(RopeTable {
            inv_freq,
            attention_factor,
        })
    }

    /// Half the rotary dimension: the length of the `cos`/`sin` rows.
    pub fn half(&self) -> usize {
        self.inv_freq.len()
    }

    /// Writes `cos` and `sin` (each `[rot_dim/2]`) of the angles at absolute position `pos`,
    /// times the attention factor (an exact no-op when it is 1).
    pub fn cos_sin(&self, pos: u32, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        let m = self.attention_factor;
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let a = p * f;
            *c = ((a as f64).cos() as f32) * m;
            *s = ((a as f64).sin() as f32) * m;
        }
    }
}

/// Applies rotate-half RoPE (GPT-NeoX layout, HF `apply_rotary_pos_emb`) to one head
/// `x` of `[head_dim]`, in place: for `i < h = len(cos)`,
/// `x'[i] = x[i]·cos[i] − x[i+h]·sin[i]`, `x'[i+h] = x[i+h]·cos[i] + x[i]·sin[i]`.
/// Dimensions past `2h` (partial rotary) are left unchanged.
///
/// # Panics
/// If `x.len() < 2 * cos.len()` or `cos.len() != sin.len()`.
///
/// Each value is two rounded products and a rounded sum, never fused; eight lanes at a
/// time with AVX2 where the CPU has it, the same operations lane by lane and so the
/// same bits. (A compact KV cache rotates every key as attention reads it, so this runs
/// once per cached key and head in each decode step.)
pub fn rope_rotate_half(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let h = cos.len();
    assert!(sin.len() == h && x.len() >= 2 * h, "rope: bad lengths");
    let (a, b) = x.split_at_mut(h);
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if h >= 8 && crate::cpu::has_avx2_f16c() {
        // SAFETY: AVX2 was detected; `a`, `b`, `cos` and `sin` each hold `h` elements.
        i = unsafe { rope_rotate_half_avx2(&mut a[..h], &mut b[..h], cos, sin) };
    }
    for i in i..h {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] - x2 * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

/// [`rope_rotate_half`]'s first `h / 8 * 8` pairs with AVX2 (mul, mul, sub and mul,
/// mul, add per lane: no fused multiply-add); returns how many it rotated.
///
/// # Safety
/// The CPU supports AVX2. `a`, `b`, `cos` and `sin` have the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rope_rotate_half_avx2(a: &mut [f32], b: &mut [f32], cos: &[f32], sin: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let h = cos.len();
    debug_assert!(a.len() == h && b.len() == h && sin.len() == h);
    let mut i = 0;
    while i + 8 <= h {
        // SAFETY: `i + 8 <= h` elements of each slice are in bounds (the caller's
        // equal lengths); AVX2 is enabled on this function.
        unsafe {
            let (pa, pb) = (a.as_mut_ptr().add(i), b.as_mut_ptr().add(i));
            let (x1, x2) = (_mm256_loadu_ps(pa), _mm256_loadu_ps(pb));
            let c = _mm256_loadu_ps(cos.as_ptr().add(i));
            let s = _mm256_loadu_ps(sin.as_ptr().add(i));
            _mm256_storeu_ps(
                pa,
                _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)),
            );
            _mm256_storeu_ps(
                pb,
                _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)),
            );
        }
        i += 8;
    }
    i
}

/// Softmax of a row in place: `x[i] = exp(x[i] - max) / Σ exp(x[j] - max)`, summed in
/// ascending `j`. An empty row is left empty; a row of `-inf` becomes NaN as in torch.
pub fn softmax_in_place(x: &mut [f32]) {
    softmax_rows_in_place([x]);
}

/// [`softmax_in_place`] of `N` rows (of any lengths) at once, each row's values exactly
/// those of [`softmax_in_place`] on it alone.
///
/// The sum of a row is a chain of dependent adds in ascending order (the order is part
/// of the result); summing `N` rows side by side runs `N` chains at a time. The
/// exponentials are [`crate::exp::exp_in_place`]'s (the bits of `f32::exp`) of the
/// rounded differences `x[i] − max`, and the maximum is taken sixteen lanes at a time:
/// a maximum does not depend on the order it is taken in, except which zero of `±0` it
/// returns, and `x − (+0)` and `x − (−0)` have the same exponential. The subtraction
/// and the division are each one rounding per element at any vector width.
pub fn softmax_rows_in_place<const N: usize>(mut rows: [&mut [f32]; N]) {
    for x in rows.iter_mut() {
        let max = max_skipping_nan(x);
        crate::exp::exp_sub_in_place(x, max);
    }
    let common = rows.iter().map(|r| r.len()).min().unwrap_or(0);
    let mut sums = [0f32; N];
    for j in 0..common {
        for (s, r) in sums.iter_mut().zip(rows.iter()) {
            *s += r[j];
        }
    }
    for (s, x) in sums.iter_mut().zip(rows.iter_mut()) {
        for v in x[common..].iter() {
            *s += *v;
        }
        div_in_place(x, *s);
    }
}

/// `x[i] *= s` for every element, each one rounded product (the same bits at any
/// vector width). Attention scales its scores with it.
pub fn scale_in_place(x: &mut [f32], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // SAFETY: AVX-512F was detected at run time.
        unsafe { avx512_rows::scale(x, s) };
        return;
    }
    x.iter_mut().for_each(|v| *v *= s);
}

/// `x[i] /= d` for every element, each one rounded quotient.
fn div_in_place(x: &mut [f32], d: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // SAFETY: AVX-512F was detected at run time.
        unsafe { avx512_rows::div(x, d) };
        return;
    }
    x.iter_mut().for_each(|v| *v /= d);
}

/// The index of the first element `== v` (so `−0` and `+0` match each other; NaN
/// matches nothing), sixteen at a time with AVX-512. The greedy sampler's second pass
/// over a vocabulary's logits.
pub fn first_equal(x: &[f32], v: f32) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // SAFETY: AVX-512F was detected at run time.
        return unsafe { avx512_rows::first_equal(x, v) };
    }
    x.iter().position(|&e| e == v)
}

/// Whether any element is NaN, sixteen at a time with AVX-512 (a session checks every
/// logits row it is given).
pub fn has_nan(x: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // SAFETY: AVX-512F was detected at run time.
        return unsafe { avx512_rows::has_nan(x) };
    }
    x.iter().any(|e| e.is_nan())
}

/// The largest element (`-inf` for an empty row or a row of NaN: NaN elements are
/// skipped, as `f32::max` skips them; which zero of `±0` it returns is not
/// specified), sixteen lanes at a time with AVX-512, else eight.
pub fn max_skipping_nan(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // SAFETY: AVX-512F was detected at run time.
        return unsafe { avx512_rows::max(x) };
    }
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = l.max(v);
        }
    }
    let tail = chunks.remainder().iter().copied();
    lanes
        .into_iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, f32::max)
}

/// The element-wise passes of a softmax row with 512-bit registers: the same one
/// rounding per element as the scalar loops, so the same bits.
#[cfg(target_arch = "x86_64")]
mod avx512_rows {
    use std::arch::x86_64::*;

    /// See [`super::max_skipping_nan`]. `vmaxps` returns its second operand when either is NaN,
    /// so with the running maximum second a NaN element is skipped, as `f32::max`
    /// skips it; the lanes start at `-inf`, so they never hold NaN.
    ///
    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max(x: &[f32]) -> f32 {
        let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut chunks = x.chunks_exact(16);
        for c in &mut chunks {
            // SAFETY: `c` holds sixteen `f32`.
            acc = _mm512_max_ps(unsafe { _mm512_loadu_ps(c.as_ptr()) }, acc);
        }
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` holds sixteen `f32`.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        lanes
            .into_iter()
            .chain(chunks.remainder().iter().copied())
            .fold(f32::NEG_INFINITY, f32::max)
    }

    /// See [`super::first_equal`].
    ///
    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn first_equal(x: &[f32], v: f32) -> Option<usize> {
        let vv = _mm512_set1_ps(v);
        let mut chunks = x.chunks_exact(16);
        for (i, c) in (&mut chunks).enumerate() {
            // SAFETY: `c` holds sixteen `f32`.
            let m = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(unsafe { _mm512_loadu_ps(c.as_ptr()) }, vv);
            if m != 0 {
                return Some(16 * i + m.trailing_zeros() as usize);
            }
        }
        let base = x.len() / 16 * 16;
        chunks
            .remainder()
            .iter()
            .position(|&e| e == v)
            .map(|j| base + j)
    }

    /// See [`super::has_nan`].
    ///
    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn has_nan(x: &[f32]) -> bool {
        let mut any: __mmask16 = 0;
        let mut chunks = x.chunks_exact(16);
        for c in &mut chunks {
            // SAFETY: `c` holds sixteen `f32`.
            let e = unsafe { _mm512_loadu_ps(c.as_ptr()) };
            any |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(e, e);
        }
        any != 0 || chunks.remainder().iter().any(|e| e.is_nan())
    }

    /// See [`super::scale_in_place`].
    ///
    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scale(x: &mut [f32], s: f32) {
        let sv = _mm512_set1_ps(s);
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: `c` holds sixteen `f32`.
            unsafe {
                _mm512_storeu_ps(
                    c.as_mut_ptr(),
                    _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), sv),
                )
            };
        }
        chunks.into_remainder().iter_mut().for_each(|v| *v *= s);
    }

    /// See [`super::div_in_place`].
    ///
    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn div(x: &mut [f32], d: f32) {
        let dv = _mm512_set1_ps(d);
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: `c` holds sixteen `f32`.
            unsafe {
                _mm512_storeu_ps(
                    c.as_mut_ptr(),
                    _mm512_div_ps(_mm512_loadu_ps(c.as_ptr()), dv),
                )
            };
        }
        chunks.into_remainder().iter_mut().for_each(|v| *v /= d);
    }
}

/// SiLU (swish) as torch computes it: `x / (1 + exp(-x))`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `β = √(2/π)` of [`gelu_tanh`], as torch forms it (`√2 · (2/√π) · 0.5`, rounded to `f32`).
pub(crate) const GELU_BETA: f32 =
    (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
/// `κ` of [`gelu_tanh`].
pub(crate) const GELU_KAPPA: f32 = 0.044715;

/// GELU with the tanh approximation as torch computes it (`gelu(approximate="tanh")`,
/// HF `gelu_pytorch_tanh`): `0.5·x·(1 + tanh(β·(x + κ·x³)))`, `β = √2·(2/√π)·0.5`,
/// `κ = 0.044715`, in that operation order.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let cube = x * x * x;
    let inner = GELU_BETA * (x + GELU_KAPPA * cube);
    0.5 * x * (1.0 + inner.tanh())
}

/// `acc[i] += x[i]` (the residual connection).
///
/// # Panics
/// If the lengths differ.
pub fn add_assign(acc: &mut [f32], x: &[f32]) {
    assert_eq!(acc.len(), x.len(), "add_assign: lengths differ");
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// Attention's weighted sum of value rows: `out[i] = Σ_j p[j] · rows[j * stride + i]`,
/// `j` ascending from `out[i] = +0.0`, each step a rounded multiply then a rounded add
/// (no fused multiply-add). The order is per element, so every vector width gives the
/// same bits; the kernels keep up to 64 outputs in registers across all rows
/// ([`weighted_rows_accumulate`]).
///
/// Shapes: `p` is `[n]`, `rows` holds `n` rows of at least `out.len()` elements at
/// `stride`.
///
/// # Panics
/// If `stride < out.len()` or `rows` is shorter than `(n - 1) * stride + out.len()` (a
/// programming error, not bad input).
pub fn weighted_rows_sum(p: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    out.fill(0.0);
    weighted_rows_accumulate([p], rows, stride, [out]);
}

/// [`weighted_rows_sum`] without the zeroing, for `Q` sums over the same rows:
/// `out[q][i] += Σ_j p[q][j] · rows[j * stride + i]`, `j` ascending, each step a rounded
/// multiply then a rounded add. A sum split into consecutive ranges of `j`, each added
/// into `out` by this function in turn, gives exactly [`weighted_rows_sum`]'s bits
/// (the running value is stored and reloaded exactly). With AVX-512, each row is
/// loaded once for the `Q` sums (a prefill's consecutive tokens against one KV head).
///
/// # Panics
/// If the `p` differ in length or the `out` in length, or as [`weighted_rows_sum`].
pub fn weighted_rows_accumulate<const Q: usize>(
    p: [&[f32]; Q],
    rows: &[f32],
    stride: usize,
    mut out: [&mut [f32]; Q],
) {
    let (n, len) = (p[0].len(), out[0].len());
    assert!(
        p.iter().all(|x| x.len() == n) && out.iter().all(|o| o.len() == len),
        "weighted_rows_accumulate: weights or outputs of different lengths"
    );
    if n == 0 {
        return;
    }
    assert!(
        stride >= len,
        "weighted_rows_accumulate: stride {stride} < {len}"
    );
    assert!(
        rows.len() >= (n - 1) * stride + len,
        "weighted_rows_accumulate: {} elements for {n} rows at stride {stride}",
        rows.len()
    );
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_f32() {
        // The keys in blocks of `SUM_KEY_BLOCK`, every column of a block before the
        // next block: a block's rows come from memory once, for its first columns, and
        // are read from the core's cache for the rest. Each element's sum still runs
        // over `j` in ascending order, carried from block to block through `out`.
        let mut j0 = 0;
        while j0 < n {
            let j1 = (j0 + SUM_KEY_BLOCK).min(n);
            let pb: [&[f32]; Q] = std::array::from_fn(|q| &p[q][j0..j1]);
            let rb = &rows[j0 * stride..];
            let mut c = 0;
            // SAFETY (both calls): AVX-512F was detected; the bounds were checked above
            // (rows `j0..j1` of `rows` are rows `0..j1 - j0` of `rb`) and
            // `c + 16 K <= len`.
            while c + 64 <= len {
                unsafe { weighted_rows_accumulate_512::<Q, 4>(pb, rb, stride, &mut out, c) };
                c += 64;
            }
            while c + 16 <= len {
                unsafe { weighted_rows_accumulate_512::<Q, 1>(pb, rb, stride, &mut out, c) };
                c += 16;
            }
            if c < len {
                for (pq, oq) in pb.iter().zip(out.iter_mut()) {
                    weighted_rows_sum_ref(pq, &rb[c..], stride, &mut oq[c..]);
                }
            }
            j0 = j1;
        }
        return;
    }
    for (pq, oq) in p.iter().zip(out.iter_mut()) {
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::has_avx2_fma() {
            // SAFETY: AVX2 was detected; the bounds were checked above.
            unsafe { weighted_rows_accumulate_avx2(pq, rows, stride, oq) };
            continue;
        }
        weighted_rows_sum_ref(pq, rows, stride, oq);
    }
}

/// Keys per block of [`weighted_rows_accumulate`]'s 512-bit path: every column of a
/// block's value rows is summed before the next block, so the rows come from memory once
/// (32 rows of Gemma 3's 256-element heads are 32 KB, the size of an L1), where one pass
/// per 64 columns over every row had read each row's lines in four strided passes
/// (figures: docs/performance.md, "Why it is fast").
#[cfg(target_arch = "x86_64")]
const SUM_KEY_BLOCK: usize = 32;

/// How many rows ahead the decode attention kernels ([`weighted_rows_accumulate`]'s
/// and [`crate::dot_strided_multi`]'s 512-bit loops) prefetch the K and V rows they
/// are about to read: a row of one KV head is a few cache lines in every `kv_dim`-wide
/// cache entry, a strided pattern the hardware prefetchers follow only part of the way.
/// The distance was chosen by measuring decode at short and long contexts (12 rows
/// ahead gained nothing; figures in docs/performance.md, "Why it is fast").
#[cfg(target_arch = "x86_64")]
pub(crate) const PREFETCH_ROWS: usize = 32;

/// Outputs `c..c + 16 K` of [`weighted_rows_accumulate`], in `K` registers per sum,
/// each row's `16 K` values loaded once for the `Q` sums.
///
/// # Safety
/// AVX-512F; `c + 16 K <= out[q].len()`, and the bounds of [`weighted_rows_accumulate`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn weighted_rows_accumulate_512<const Q: usize, const K: usize>(
    p: [&[f32]; Q],
    rows: &[f32],
    stride: usize,
    out: &mut [&mut [f32]; Q],
    c: usize,
) {
    use std::arch::x86_64::*;
    let rp = rows.as_ptr().add(c);
    let mut acc = [[_mm512_setzero_ps(); K]; Q];
    for (aq, oq) in acc.iter_mut().zip(out.iter()) {
        for (r, a) in aq.iter_mut().enumerate() {
            *a = _mm512_loadu_ps(oq.as_ptr().add(c + 16 * r));
        }
    }
    let l1 = crate::dot::attention_prefetch_l1();
    for j in 0..p[0].len() {
        let base = rp.add(j * stride);
        // A prefetch never faults: rows past the end are harmless. Into L1 or L2 as
        // `crate::dot::attention_prefetch_l1` says.
        let ahead = base.wrapping_add(PREFETCH_ROWS * stride) as *const i8;
        for r in 0..K {
            if l1 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * r));
            } else {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64 * r));
            }
        }
        let v: [__m512; K] = std::array::from_fn(|r| _mm512_loadu_ps(base.add(16 * r)));
        for (aq, pq) in acc.iter_mut().zip(&p) {
            let pv = _mm512_set1_ps(*pq.get_unchecked(j));
            for (a, vr) in aq.iter_mut().zip(&v) {
                *a = _mm512_add_ps(*a, _mm512_mul_ps(pv, *vr));
            }
        }
    }
    for (aq, oq) in acc.iter().zip(out.iter_mut()) {
        for (r, a) in aq.iter().enumerate() {
            _mm512_storeu_ps(oq.as_mut_ptr().add(c + 16 * r), *a);
        }
    }
}

/// Scalar reference of [`weighted_rows_sum`] (`out` already zeroed), and of
/// [`weighted_rows_accumulate`] for one sum.
fn weighted_rows_sum_ref(p: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    for (j, &pj) in p.iter().enumerate() {
        for (o, &v) in out.iter_mut().zip(&rows[j * stride..]) {
            *o += pj * v;
        }
    }
}

/// [`weighted_rows_accumulate`] for one sum with AVX2 registers (8 outputs each, up to
/// 64 kept across the rows).
///
/// # Safety
/// AVX2 available; `stride >= out.len()`, `rows.len() >= (p.len() - 1) * stride +
/// out.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_rows_accumulate_avx2(p: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    const W: usize = 8; // registers of 8 outputs kept across the rows
    let len = out.len();
    let rp = rows.as_ptr();
    let mut c = 0;
    while c + 8 <= len {
        let k = ((len - c) / 8).min(W);
        let mut acc = [_mm256_setzero_ps(); W];
        for (r, a) in acc.iter_mut().enumerate().take(k) {
            *a = _mm256_loadu_ps(out.as_ptr().add(c + 8 * r));
        }
        for (j, &pj) in p.iter().enumerate() {
            let pv = _mm256_set1_ps(pj);
            let base = rp.add(j * stride + c);
            for (r, a) in acc.iter_mut().enumerate().take(k) {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(pv, _mm256_loadu_ps(base.add(8 * r))));
            }
        }
        for (r, a) in acc.iter().enumerate().take(k) {
            _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * r), *a);
        }
        c += 8 * k;
    }
    if c < len {
        for (j, &pj) in p.iter().enumerate() {
            for (o, &v) in out[c..].iter_mut().zip(&rows[j * stride + c..]) {
                *o += pj * v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_at_position_zero_is_identity() {
        let t = RopeTable::new(8, 10000.0);
        let (mut c, mut s) = (vec![0f32; 4], vec![0f32; 4]);
        t.cos_sin(0, &mut c, &mut s);
        let mut x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        let before = x.clone();
        rope_rotate_half(&mut x, &c, &s);
        assert_eq!(x, before);
    }

    #[test]
    fn scaled_rope_divides_each_frequency_and_scales_cos_sin() {
        let plain = RopeTable::new(8, 10000.0);
        assert_eq!(
            RopeTable::scaled(8, 10000.0, &[1.0; 4], 1.0),
            Some(plain.clone())
        );
        assert_eq!(RopeTable::scaled(8, 10000.0, &[1.0; 3], 1.0), None);
        // Factor 2 on the first dimension: its angle at position 2 is the plain one at 1.
        let t = RopeTable::scaled(8, 10000.0, &[2.0, 1.0, 1.0, 1.0], 1.5).unwrap();
        let (mut c, mut s, mut pc, mut ps) = ([0f32; 4], [0f32; 4], [0f32; 4], [0f32; 4]);
        t.cos_sin(2, &mut c, &mut s);
        plain.cos_sin(1, &mut pc, &mut ps);
        assert_eq!((c[0], s[0]), (pc[0] * 1.5, ps[0] * 1.5));
        plain.cos_sin(2, &mut pc, &mut ps);
        assert_eq!((c[1], s[1]), (pc[1] * 1.5, ps[1] * 1.5));
    }

    #[test]
    fn rope_rotates_pairs_i_and_i_plus_half() {
        // First frequency is 1 rad per position: pair (x0, x4) turns by `pos` radians.
        let t = RopeTable::new(8, 10000.0);
        let (mut c, mut s) = (vec![0f32; 4], vec![0f32; 4]);
        t.cos_sin(1, &mut c, &mut s);
        let mut x = vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        rope_rotate_half(&mut x, &c, &s);
        assert!((x[0] - 1f32.cos()).abs() < 1e-7 && (x[4] - 1f32.sin()).abs() < 1e-7);
    }

    #[test]
    fn rope_rotate_half_equals_the_unfused_formula_bitwise() {
        // The SIMD lanes and the scalar tail against the formula written out, for
        // halves below, at and past a multiple of 8, and past `2h` left alone.
        let mut seed = 11u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 7.0
        };
        for h in [1usize, 7, 8, 9, 16, 32, 37, 128] {
            let x: Vec<f32> = (0..2 * h + 3).map(|_| next()).collect();
            let cos: Vec<f32> = (0..h).map(|_| next()).collect();
            let sin: Vec<f32> = (0..h).map(|_| next()).collect();
            let mut want = x.clone();
            for i in 0..h {
                let (x1, x2) = (x[i], x[i + h]);
                want[i] = x1 * cos[i] - x2 * sin[i];
                want[i + h] = x2 * cos[i] + x1 * sin[i];
            }
            let mut got = x.clone();
            rope_rotate_half(&mut got, &cos, &sin);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "h {h}");
            assert_ne!(bits(&got[..2 * h]), bits(&x[..2 * h]), "h {h}: rotated");
        }
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, -4.0];
        let w = [1.0f32, 0.5, 2.0, 1.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &w, 0.0, 1e-6, &mut out);
        let rms = ((1.0 + 4.0 + 9.0 + 16.0) / 4.0f64 + 1e-6).sqrt();
        for i in 0..4 {
            assert!((out[i] as f64 - w[i] as f64 * x[i] as f64 / rms).abs() < 1e-6);
        }
    }

    #[test]
    fn softmax_sums_to_one_and_orders() {
        let mut x = [1.0f32, 2.0, 3.0, -1e9];
        softmax_in_place(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0] && x[3] == 0.0);
    }

    /// Softmax as the scalar steps: the maximum by `f32::max` in index order, each
    /// `x − max` rounded, `f32::exp`, the ascending sum, each quotient.
    fn softmax_scalar(x: &mut [f32]) {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        x.iter_mut().for_each(|v| *v = (*v - max).exp());
        let sum = x.iter().fold(0f32, |s, v| s + v);
        x.iter_mut().for_each(|v| *v /= sum);
    }

    #[test]
    fn softmax_rows_and_scaling_equal_the_scalar_steps_bitwise() {
        let mut seed = 11u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 60.0
        };
        let same = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        for len in [0usize, 1, 7, 15, 16, 17, 33, 100, 257] {
            let mut rows: Vec<Vec<f32>> = (0..4)
                .map(|r| (0..len + r).map(|_| next()).collect())
                .collect();
            // Values the lanes must treat as the scalar fold does: NaN (skipped), the
            // maximum at either zero, -inf, and exponentials that underflow or overflow
            // the fast path.
            if len >= 17 {
                // The row's maximum in lane 0, then NaN in lane 0 of a later block.
                rows[0][0] = 100.0;
                rows[0][3] = f32::NAN;
                rows[0][16] = f32::NAN;
                rows[1].iter_mut().for_each(|v| *v = -v.abs());
                rows[1][5] = -0.0;
                rows[1][9] = 0.0;
                rows[2][0] = f32::NEG_INFINITY;
                rows[3][len / 2] = 200.0;
            }
            // The maximum itself (the softmax of a row with NaN is NaN whatever it is):
            // as the scalar fold, up to which zero of ±0.
            for r in &rows {
                let fold = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(max_skipping_nan(r), fold, "maximum of {r:?}");
            }
            let scale = 0.125f32;
            let mut want = rows.clone();
            for w in want.iter_mut() {
                w.iter_mut().for_each(|v| *v *= scale);
                softmax_scalar(w);
            }
            let mut got = rows.clone();
            for g in got.iter_mut() {
                scale_in_place(g, scale);
            }
            let [a, b, c, d] = &mut got[..] else {
                unreachable!()
            };
            softmax_rows_in_place([&mut a[..], b, c, d]);
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    same(g, w),
                    "four rows side by side: row {r}, length {}",
                    w.len()
                );
            }
            let mut one = rows[0].clone();
            scale_in_place(&mut one, scale);
            softmax_in_place(&mut one);
            assert!(same(&one, &want[0]), "one row of {len}");
        }
        // A row of only NaN or -inf, and an empty row.
        for x in [vec![f32::NAN; 20], vec![f32::NEG_INFINITY; 19], vec![]] {
            let (mut got, mut want) = (x.clone(), x);
            softmax_in_place(&mut got);
            softmax_scalar(&mut want);
            assert!(same(&got, &want), "{want:?}");
        }
    }

    #[test]
    fn first_equal_and_has_nan_match_the_scalar_scans() {
        for len in [0usize, 1, 15, 16, 17, 40, 100] {
            let base: Vec<f32> = (0..len).map(|i| (i % 7) as f32 - 3.0).collect();
            // A NaN at each place in turn (and none), then a -0 and +0 search.
            for nan_at in std::iter::once(None).chain((0..len).map(Some)) {
                let mut x = base.clone();
                if let Some(i) = nan_at {
                    x[i] = f32::NAN;
                }
                assert_eq!(
                    has_nan(&x),
                    nan_at.is_some(),
                    "len {len}, NaN at {nan_at:?}"
                );
                for v in [-3.0f32, 0.0, -0.0, 3.0, 9.0, f32::NAN] {
                    let want = x.iter().position(|&e| e == v);
                    assert_eq!(
                        first_equal(&x, v),
                        want,
                        "len {len}, {v}, NaN at {nan_at:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn weighted_rows_sum_equals_the_scalar_loop_bitwise() {
        let mut seed = 5u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for (len, stride, n) in [
            (64usize, 192usize, 37usize),
            (128, 128, 5),
            (12, 20, 9),
            (3, 3, 4),
            (64, 64, 0),
            (256, 512, 7),
            (37, 40, 11),
            (24, 24, 3),
        ] {
            let rows: Vec<f32> = (0..stride * n.max(1)).map(|_| next()).collect();
            let p: Vec<f32> = (0..n).map(|_| next().abs()).collect();
            let mut want = vec![0f32; len];
            weighted_rows_sum_ref(&p, &rows, stride, &mut want);
            let mut got = vec![f32::NAN; len];
            weighted_rows_sum(&p, &rows, stride, &mut got);
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same(&got, &want), "len={len} stride={stride} n={n}");
            // The AVX2 kernel too (the machine may have taken the 512-bit one above).
            #[cfg(target_arch = "x86_64")]
            if crate::cpu::has_avx2_fma() && n > 0 {
                let mut got = vec![0f32; len];
                // SAFETY: AVX2 was detected; the shapes are those checked above.
                unsafe { weighted_rows_accumulate_avx2(&p, &rows, stride, &mut got) };
                assert!(same(&got, &want), "avx2: len={len} stride={stride} n={n}");
            }
            // The same sum in three consecutive ranges of rows, four sums at a time
            // (the other three over other weights), equals it bit for bit.
            let ps: Vec<Vec<f32>> = (0..3)
                .map(|_| (0..n).map(|_| next().abs()).collect())
                .collect();
            let mut outs = vec![vec![0f32; len]; 4];
            for (a, b) in [(0, n / 3), (n / 3, n / 2), (n / 2, n)] {
                let [o0, o1, o2, o3] = &mut outs[..] else {
                    unreachable!()
                };
                weighted_rows_accumulate(
                    [&p[a..b], &ps[0][a..b], &ps[1][a..b], &ps[2][a..b]],
                    &rows[a * stride..],
                    stride,
                    [o0, o1, o2, o3],
                );
            }
            assert!(
                same(&outs[0], &want),
                "accumulate: len={len} stride={stride} n={n}"
            );
            for (q, pq) in ps.iter().enumerate() {
                let mut w = vec![0f32; len];
                weighted_rows_sum_ref(pq, &rows, stride, &mut w);
                assert!(same(&outs[q + 1], &w), "accumulate q={q}: len={len} n={n}");
            }
        }
    }
}
