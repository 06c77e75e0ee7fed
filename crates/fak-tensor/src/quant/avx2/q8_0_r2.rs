//! The one-token AVX-512 kernel of Q8_0 weights repacked in row pairs
//! (`quant::QType::Q8_0R2`, layout in `quant/q8_0_r2.rs`): one 512-bit load holds a
//! block of both rows of a pair, lane `2m + h` = row `h`'s lane `m`, so the
//! token's lanes are laid out twice over ([`R2Act`]) and one `vpdpbusd` sums both rows'
//! eight lanes. Integer adds total each row's lanes into its block sum `S`, and each row
//! then performs the canonical order (module docs of `quant`): `d = f16(d_w) · f16(d_a)`
//! rounded once, `acc + d · S` as a rounded multiply and a rounded add, block by block:
//! the bits of the Q8_0 kernels on the file's blocks.
//!
//! Integer exactness as in `vnni_acts`' Q8_0 form: the weight byte is `q + 128`
//! (unsigned), each lane starts at the activation's `−128 · Σ a` over its four bytes,
//! so it ends at `Σ q a` exactly.

use super::{h2f, nta_prefetch, prefetch_weights, PREFETCH_BYTES};
use crate::quant::BlockQ8_0;
use std::arch::x86_64::*;

/// One activation block in the form of the row-pair kernel: lane `m`'s four quants (in
/// the Q8_0 VNNI order, `q8_0_vnni_order`) in dwords `2m` and `2m + 1`, the start values
/// `−128 · Σ a` laid out alike, and the widened scale `f16(d_a)`: `vnni_acts`' Q8_0
/// form, each lane twice, made as the kernel reads the block (nothing allocated).
#[derive(Clone, Copy)]
struct R2Act {
    q: __m512i,
    base: __m512i,
    d: f32,
}

/// Block `b` in [`R2Act`] form.
///
/// # Safety
/// AVX2, F16C, AVX-512F/BW/VL and AVX512-VNNI (the caller has them enabled).
#[inline(always)]
unsafe fn r2_act(b: &BlockQ8_0) -> R2Act {
    // Word 2m = old word m, word 2m+1 = old word m+8: lane m's elements 2m, 2m+1,
    // 2m+16, 2m+17 (`unpack_vnni512`'s order).
    let idx = _mm256_setr_epi16(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    let qs = _mm256_permutexvar_epi16(idx, _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i));
    // 128 · Σ_{k<4} qs[4m+k]: |sum| <= 4 · 128 · 128 = 65536, exact in i32.
    let sum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(-128), qs);
    let bias = _mm256_sub_epi32(_mm256_setzero_si256(), sum);
    let twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    R2Act {
        q: _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(qs)),
        base: _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(bias)),
        d: h2f(b.d),
    }
}

/// Rows of the row-pair matrix `w` (whole pairs of `nb = a.len()` blocks of 68 bytes)
/// times one token's Q8_0 blocks `a` into `out` (`w.len() / (34 · nb)` values, even),
/// [`PAIRS`] pairs at a time, then one at a time.
///
/// # Safety
/// AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI; `w.len() == out.len() · 34 · a.len()`,
/// `out.len()` even.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(in crate::quant) unsafe fn rows_r2_512(w: &[u8], a: &[BlockQ8_0], out: &mut [f32]) {
    let nb = a.len();
    assert!(nb > 0 && out.len().is_multiple_of(2) && w.len() == out.len() / 2 * 68 * nb);
    if nb <= STACK_ACTS {
        // The token's blocks in `R2Act` form once for all rows, on the stack (a decode
        // step allocates nothing).
        let mut buf = [std::mem::MaybeUninit::<R2Act>::uninit(); STACK_ACTS];
        for (slot, b) in buf.iter_mut().zip(a) {
            slot.write(r2_act(b));
        }
        // SAFETY: the first `nb` slots were written just above.
        let acts = std::slice::from_raw_parts(buf.as_ptr() as *const R2Act, nb);
        rows_with(w, nb, |b| acts[b], out);
    } else {
        // A longer row: each block's form made as it is read (per group of pairs).
        rows_with(w, nb, |b| r2_act(&a[b]), out);
    }
}

/// Blocks of the token's [`R2Act`]s held on the stack (24 KB): rows up to 4,096
/// elements.
const STACK_ACTS: usize = 128;

/// [`rows_r2_512`] with block `b`'s activation form from `act(b)`: [`PAIRS`] pairs at a
/// time, then one at a time.
///
/// # Safety
/// As [`rows_r2_512`] (`nb` its blocks).
#[inline(always)]
unsafe fn rows_with(w: &[u8], nb: usize, act: impl Fn(usize) -> R2Act, out: &mut [f32]) {
    let pb = 68 * nb;
    let pairs = out.len() / 2;
    let nta = nta_prefetch();
    let mut p = 0;
    while p + PAIRS <= pairs {
        let o = &mut out[2 * p..2 * (p + PAIRS)];
        pairs_r2::<PAIRS>(w.as_ptr().add(p * pb), pb, nb, &act, o, nta);
        p += PAIRS;
    }
    while p < pairs {
        let o = &mut out[2 * p..2 * (p + 1)];
        pairs_r2::<1>(w.as_ptr().add(p * pb), pb, nb, &act, o, nta);
        p += 1;
    }
}

/// Pairs per step of [`rows_r2_512`]: their block sums are totalled in one register.
const PAIRS: usize = 2;

/// `P` (1 or 2) consecutive pairs at `w` (`pb` bytes each, `nb` blocks) times the token
/// whose block `b` is `act(b)`, into `out` (`2P` rows).
///
/// # Safety
/// As [`rows_r2_512`]; `w` points at `P` whole pairs of `nb` blocks, `out.len() == 2P`.
#[inline(always)]
unsafe fn pairs_r2<const P: usize>(
    w: *const u8,
    pb: usize,
    nb: usize,
    act: &impl Fn(usize) -> R2Act,
    out: &mut [f32],
    nta: bool,
) {
    const { assert!(P == 1 || P == 2) };
    // Pair j's row h in lane 8j + h (and the lanes 8j + 2i + h beside it, equal).
    let mut acc = _mm512_setzero_ps();
    // The weights `PREFETCH_BYTES` (at least these pairs) ahead, asked for in address
    // order, `P · 68` bytes a block: over the blocks, the next `P` pairs' bytes, once.
    let step = 68 * P;
    let next = w.wrapping_add((P * pb).max(PREFETCH_BYTES));
    for b in 0..nb {
        prefetch_weights(next.wrapping_add(b * step), step, nta);
        let ab = act(b);
        let mut l = [_mm512_setzero_si512(); 2];
        let mut d16 = [0i32; 2];
        for j in 0..P {
            let blk = w.add(j * pb + 68 * b);
            // Pair `j`'s block `b`: inside the `P` pairs at `w` (the contract).
            d16[j] = std::ptr::read_unaligned(blk as *const i32);
            let wq = _mm512_loadu_si512(blk.add(4) as *const __m512i);
            // Exact: start + Σ (q + 128) a = Σ q a per lane (module docs).
            l[j] = _mm512_dpbusd_epi32(ab.base, wq, ab.q);
        }
        // Each 128-bit quarter's halves added (pair 0's from `l[0]`, pair 1's from
        // `l[1]`), then its two lanes of each row, then the pair's two quarters: row h
        // of pair j's block sum in lanes 8j + h (+ 2i). Exact integer adds.
        let x = _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0b10_00_10_00>(l[0], l[1]),
            _mm512_shuffle_i32x4::<0b11_01_11_01>(l[0], l[1]),
        );
        let x = _mm512_add_epi32(x, _mm512_shuffle_epi32::<_MM_PERM_BADC>(x));
        let s = _mm512_add_epi32(x, _mm512_shuffle_i32x4::<0b10_11_00_01>(x, x));
        // [dw_a, dw_b] four times per pair, widened, times d_a: the one rounded product
        // per (row, block) of the scalar code.
        let dw =
            _mm256_blend_epi32::<0b1111_0000>(_mm256_set1_epi32(d16[0]), _mm256_set1_epi32(d16[1]));
        let d = _mm512_mul_ps(_mm512_cvtph_ps(dw), _mm512_set1_ps(ab.d));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
    }
    let mut v = [0f32; 16];
    _mm512_storeu_ps(v.as_mut_ptr(), acc);
    for j in 0..P {
        out[2 * j..2 * j + 2].copy_from_slice(&v[8 * j..8 * j + 2]);
    }
}
