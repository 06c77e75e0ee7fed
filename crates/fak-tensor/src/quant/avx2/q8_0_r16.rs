//! The AVX-512 kernels of Q8_0 weights repacked in groups of 16 rows
//! (`quant::QType::Q8_0R16`, layout in `quant/q8_0_r16.rs`), for one token (decode, the
//! logits head) and for several (a batched decode step, prefill) alike.
//!
//! One 512-bit load holds four quants of one run of a block for all 16 rows of a group
//! (dword `r` = row `r`, each quant stored as the unsigned byte `q + 128`). `vpdpbusd`
//! multiplies them by a token's four signed activation bytes of the same positions,
//! broadcast from memory, so one instruction adds four products to each of the 16 rows'
//! block sums for that token; each sum starts at `−128 · Σ a` (the token's block), so
//! after the eight runs it is the exact integer `S = Σ q a` (|S| ≤ 32 · 128 · 128, and
//! every partial sum stays inside `i32`). Up to [`PASS`] tokens share each loaded
//! weight register. No lane is ever added to another: where the row-pair layout
//! (`q8_0_r2.rs`) reduces each block's lanes to its rows' sums, here a row is a lane.
//! Then each (row, token) lane performs the canonical order (module docs of `quant`,
//! `quant::vec_dot_q8_0_q8_0_ref`): `d = f16(d_w) · f16(d_a)` rounded once, `acc + d · S`
//! as a rounded multiply and a rounded add, block by block. So every result is the bits
//! of the Q8_0 kernels on the file's blocks.

use super::h2f;
use crate::quant::{BlockQ8_0, Q8_0_R16_BLOCK as BLOCK, R16_ROWS as ROWS};
use std::arch::x86_64::*;

// A group's rows are the `i32` lanes of a `zmm` register.
const _: () = assert!(ROWS == 16);

/// The most tokens that share one pass over the weights: their accumulators and
/// integer sums (16 registers), the loaded runs and scales fit the 32 vector registers.
const PASS: usize = 8;

// `r16_pass!` runs passes of 8.
const _: () = assert!(PASS == 8);

/// Bytes of weights per chunk of rows: every pass of tokens over a chunk finds it in the
/// cache.
const CHUNK_BYTES: usize = 16 * 1024;

/// Blocks ahead that each block of a pass of several tokens prefetches into the
/// first-level cache (its nine lines). A one-token pass prefetches the weights
/// `PREFETCH_BYTES` ahead instead, as the row-pair kernel does (non-temporally on AMD,
/// `nta_prefetch`): on the 178 MB head of Gemma 3 that was faster on 2 threads than
/// leaving its stream to the hardware's prefetchers (decode 97.0 / 97.5 / 103.4 against
/// 87.9 / 93.4 / 102.5 tokens/s, Zen 4); a layer-sized Q8_0 matrix went the other way,
/// which is one reason layers are not repacked (`Weight::repacked_layer_for_cpu`).
const PREFETCH_BLOCKS: usize = 8;

/// Per-block activation values held on the stack: `PASS` tokens' worth of rows up to
/// 4,096 elements, or one token's up to 32,768 (a decode step allocates nothing).
const STACK_BLOCKS: usize = PASS * 128;

/// `out[t][r]` = row `r` of the repacked matrix `w` (`rb = 34 · nb` bytes a row, `nb =
/// a[t].len()`) times token `a[t]`, every token and every row of `w`.
///
/// # Safety
/// AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI; every `a[t]` is `nb` blocks, `rb == 34
/// · nb`, `w.len()` is a multiple of `16 · rb`, and every `out[t]` holds `w.len() / rb`
/// values.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(in crate::quant) unsafe fn rows_r16_q8_0_512(
    w: &[u8],
    rb: usize,
    a: &[&[BlockQ8_0]],
    out: &mut [&mut [f32]],
) {
    let nb = rb / 34;
    let rows = w.len() / rb.max(1);
    assert!(
        nb > 0
            && rb == 34 * nb
            && rows.is_multiple_of(ROWS)
            && a.len() == out.len()
            && a.iter().all(|t| t.len() == nb)
            && out.iter().all(|o| o.len() == rows)
    );
    // Each token's blocks once: the widened scale and the sum's start `−128 · Σ a`.
    let need = nb * a.len();
    let (mut stack_d, mut stack_s) = ([0f32; STACK_BLOCKS], [0i32; STACK_BLOCKS]);
    let (mut heap_d, mut heap_s) = (Vec::new(), Vec::new());
    let (d, s): (&mut [f32], &mut [i32]) = if need <= STACK_BLOCKS {
        (&mut stack_d[..need], &mut stack_s[..need])
    } else {
        heap_d.resize(need, 0f32);
        heap_s.resize(need, 0i32);
        (&mut heap_d, &mut heap_s)
    };
    for (t, blocks) in a.iter().enumerate() {
        let (d, s) = (&mut d[nb * t..nb * (t + 1)], &mut s[nb * t..nb * (t + 1)]);
        for ((d, s), b) in d.iter_mut().zip(s.iter_mut()).zip(blocks.iter()) {
            *d = h2f(b.d);
            *s = -128 * b.qs.iter().map(|&q| i32::from(q)).sum::<i32>();
        }
    }
    let (d, s) = (&*d, &*s);
    let groups = rows / ROWS;
    let chunk = (CHUNK_BYTES / (ROWS * rb)).max(1);
    for g0 in (0..groups).step_by(chunk) {
        let g1 = (g0 + chunk).min(groups);
        let mut t0 = 0;
        while t0 < a.len() {
            let left = a.len() - t0;
            let pass = Pass {
                w: w.as_ptr().add(g0 * ROWS * rb),
                groups: g1 - g0,
                nb,
                a: &a[t0..],
                d: &d[nb * t0..],
                start: &s[nb * t0..],
            };
            let o = &mut out[t0..];
            let r0 = g0 * ROWS;
            t0 += r16_pass!(left, pass, o, r0);
        }
    }
}

/// One pass of up to [`PASS`] tokens over a chunk of groups.
struct Pass<'a> {
    /// The chunk's first group.
    w: *const u8,
    groups: usize,
    nb: usize,
    /// The pass's tokens first.
    a: &'a [&'a [BlockQ8_0]],
    /// Per token from the pass's first, `nb` each: the widened scales `d_a`.
    d: &'a [f32],
    /// The same for the sums' starts `−128 · Σ a`.
    start: &'a [i32],
}

impl Pass<'_> {
    /// The first `T` tokens over the chunk's groups, into `out[t][r0..]`; returns `T`.
    ///
    /// # Safety
    /// As [`rows_r16_q8_0_512`]; `self.w` holds `self.groups` whole groups of `self.nb`
    /// blocks, `T <= self.a.len()`, and `out[t]` holds rows `r0..r0 + 16 · groups`.
    #[inline(always)]
    unsafe fn run<const T: usize>(&self, out: &mut [&mut [f32]], r0: usize) -> usize {
        let nb = self.nb;
        let ap: [*const u8; T] = std::array::from_fn(|t| self.a[t].as_ptr() as *const u8);
        // Two integer chains per token (the even and the odd runs) when few tokens leave
        // `vpdpbusd`'s latency exposed, one when `T` tokens already interleave.
        let split = T <= 4;
        let nta = super::nta_prefetch();
        for g in 0..self.groups {
            let wg = self.w.add(g * nb * BLOCK);
            let mut acc = [_mm512_setzero_ps(); T];
            for b in 0..nb {
                let wb = wg.add(b * BLOCK);
                // Hints: any address may be prefetched (it is never dereferenced).
                if T == 1 {
                    super::prefetch_weights(wb.wrapping_add(super::PREFETCH_BYTES), BLOCK, nta);
                } else {
                    for l in 0..BLOCK.div_ceil(64) {
                        _mm_prefetch::<_MM_HINT_T0>(
                            wb.wrapping_add(PREFETCH_BLOCKS * BLOCK + 64 * l) as *const i8,
                        );
                    }
                }
                let wd = _mm512_cvtph_ps(_mm256_loadu_si256(wb as *const __m256i));
                let mut even: [__m512i; T] =
                    std::array::from_fn(|t| _mm512_set1_epi32(self.start[nb * t + b]));
                let mut odd = [_mm512_setzero_si512(); T];
                for j in 0..8 {
                    let v = _mm512_loadu_si512(wb.add(32 + 64 * j) as *const __m512i);
                    for t in 0..T {
                        // Token `t`'s block `b`: `d` (2 bytes), then 32 quants.
                        let q = ap[t].add(34 * b + 2 + 4 * j);
                        let x = _mm512_set1_epi32(std::ptr::read_unaligned(q as *const i32));
                        if split && j % 2 == 1 {
                            odd[t] = _mm512_dpbusd_epi32(odd[t], v, x);
                        } else {
                            even[t] = _mm512_dpbusd_epi32(even[t], v, x);
                        }
                    }
                }
                for t in 0..T {
                    let s = if split {
                        _mm512_add_epi32(even[t], odd[t])
                    } else {
                        even[t]
                    };
                    let d = _mm512_mul_ps(wd, _mm512_set1_ps(self.d[nb * t + b]));
                    acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
                }
            }
            for t in 0..T {
                let o = &mut out[t][r0 + g * ROWS..r0 + (g + 1) * ROWS];
                _mm512_storeu_ps(o.as_mut_ptr(), acc[t]);
            }
        }
        T
    }
}
