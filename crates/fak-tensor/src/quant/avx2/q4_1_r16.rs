//! The AVX-512 kernels of Q4_1 weights repacked in groups of 16 rows
//! (`quant::QType::Q4_1R16`, layout in `quant/q4_1_r16.rs`), for one token (decode) and
//! for several (a batched decode step, prefill) alike.
//!
//! One 512-bit load holds four bytes of one run of a block for all 16 rows of a group
//! (dword `r` = row `r`); its low nibbles are each row's lane `j` (elements `4j..4j + 4`)
//! and its high nibbles lane `j + 4` (elements `16 + 4j..`), unpacked with one `and` and
//! one shift. `vpdpbusd` multiplies those unsigned quants (`[0, 15]`) by a token's four
//! signed activation bytes of the same lane, broadcast from memory, so one instruction
//! adds four products to each of the 16 rows' block sums for that token: per block and
//! token, eight instructions give the 16 rows' exact integer sums `S = Σ q a` (each
//! product in `[−1920, 1905]`, 32 of them, no overflow). Up to [`PASS`] tokens share each
//! unpacked weight register. Then each (row, token) lane performs the canonical order
//! (module docs of `quant`, `quant::vec_dot_q4_1_q8_1_ref`): `d = f16(d_w) · f16(d_a)`
//! rounded once, `acc + d · S` as a rounded multiply and a rounded add, block by block;
//! the minimum term `summ + f16(m_w) · f16(s_a)`, a rounded multiply and a rounded add in
//! block order, runs in a second loop over the group's blocks (its scales then in the
//! cache), so the first loop's registers hold only the sums; the result is `acc + summ`.
//! So every result is the bits of the Q4_1 kernels on the file's blocks.

use super::h2f;
use crate::quant::{BlockQ8_1, R16_BLOCK as BLOCK, R16_ROWS as ROWS};
use std::arch::x86_64::*;

// A group's rows are the `i32` lanes of a `zmm` register.
const _: () = assert!(ROWS == 16);

/// The most tokens that share one pass over the weights: their accumulators and
/// integer sums (16 registers), the unpacked runs and scales fit the 32 vector
/// registers.
const PASS: usize = 8;

// `r16_pass!` runs passes of 8.
const _: () = assert!(PASS == 8);

/// Bytes of weights per chunk of rows: every pass of tokens over a chunk finds it in the
/// cache.
const CHUNK_BYTES: usize = 16 * 1024;

/// Blocks ahead that each block of a pass of several tokens prefetches into the
/// first-level cache (its five lines). A one-token pass prefetches nothing: the
/// hardware's prefetchers keep up with its stream. `batch_bench`'s `[1536, 576]`, a Zen
/// 4, µs per product (1 / 2 threads), 4 rounds: 8 tokens 50.2–58.6 / 26.5–28.2 without,
/// 47.2–47.7 / 25.2–28.0 at 4 blocks, 45.3–47.3 / 24.0–26.7 at 16; one token 18.4–25.9 /
/// 13.2–17.2 without, 23.1–25.9 / 15.4–22.0 at 4.
const PREFETCH_BLOCKS: usize = 16;

/// Widened activation scales held on the stack: `2 · PASS` tokens' worth of rows up to
/// 4,096 elements, or one token's up to 32,768 (a decode step allocates nothing).
const STACK_SCALES: usize = 2 * PASS * 128;

/// `out[t][r]` = row `r` of the repacked matrix `w` (`rb = 20 · nb` bytes a row, `nb =
/// a[t].len()`) times token `a[t]`, every token and every row of `w`.
///
/// # Safety
/// AVX2, F16C, AVX-512F/BW/DQ/VL and AVX512-VNNI; every `a[t]` is `nb` blocks, `rb == 20
/// · nb`, `w.len()` is a multiple of `16 · rb`, and every `out[t]` holds `w.len() / rb`
/// values.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
pub(in crate::quant) unsafe fn rows_r16_512(
    w: &[u8],
    rb: usize,
    a: &[&[BlockQ8_1]],
    out: &mut [&mut [f32]],
) {
    let nb = rb / 20;
    let rows = w.len() / rb.max(1);
    assert!(
        nb > 0
            && rb == 20 * nb
            && rows.is_multiple_of(ROWS)
            && a.len() == out.len()
            && a.iter().all(|t| t.len() == nb)
            && out.iter().all(|o| o.len() == rows)
    );
    // Each token's scales widened once: `d` then `s`, `nb` each.
    let need = 2 * nb * a.len();
    let mut stack = [0f32; STACK_SCALES];
    let mut heap = Vec::new();
    let scales: &mut [f32] = if need <= STACK_SCALES {
        &mut stack[..need]
    } else {
        heap.resize(need, 0f32);
        &mut heap
    };
    for (t, blocks) in a.iter().enumerate() {
        let (d, s) = scales[2 * nb * t..2 * nb * (t + 1)].split_at_mut(nb);
        for ((d, s), b) in d.iter_mut().zip(s.iter_mut()).zip(blocks.iter()) {
            (*d, *s) = (h2f(b.d), h2f(b.s));
        }
    }
    let scales = &*scales;
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
                scales: &scales[2 * nb * t0..],
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
    a: &'a [&'a [BlockQ8_1]],
    /// Per token from the pass's first: `d` (`nb`), then `s` (`nb`).
    scales: &'a [f32],
}

impl Pass<'_> {
    /// The first `T` tokens over the chunk's groups, into `out[t][r0..]`; returns `T`.
    ///
    /// # Safety
    /// As [`rows_r16_512`]; `self.w` holds `self.groups` whole groups of `self.nb`
    /// blocks, `T <= self.a.len()`, and `out[t]` holds rows `r0..r0 + 16 · groups`.
    #[inline(always)]
    unsafe fn run<const T: usize>(&self, out: &mut [&mut [f32]], r0: usize) -> usize {
        let nb = self.nb;
        let mask = _mm512_set1_epi8(0x0f);
        let ap: [*const u8; T] = std::array::from_fn(|t| self.a[t].as_ptr() as *const u8);
        let sd: [*const f32; T] = std::array::from_fn(|t| self.scales[2 * nb * t..].as_ptr());
        // Two integer chains per token (low and high nibbles) when few tokens leave
        // `vpdpbusd`'s latency exposed, one when `T` tokens already interleave.
        let split = T <= 4;
        for g in 0..self.groups {
            let wg = self.w.add(g * nb * BLOCK);
            let mut acc = [_mm512_setzero_ps(); T];
            for b in 0..nb {
                let wb = wg.add(b * BLOCK);
                for l in 0..if T > 1 { BLOCK / 64 } else { 0 } {
                    // A hint: any address may be prefetched (it is never dereferenced).
                    _mm_prefetch::<_MM_HINT_T0>(
                        wb.wrapping_add(PREFETCH_BLOCKS * BLOCK + 64 * l) as *const i8
                    );
                }
                let wd = _mm512_cvtph_ps(_mm256_loadu_si256(wb as *const __m256i));
                let mut lo_sum = [_mm512_setzero_si512(); T];
                let mut hi_sum = [_mm512_setzero_si512(); T];
                for j in 0..4 {
                    let v = _mm512_loadu_si512(wb.add(64 + 64 * j) as *const __m512i);
                    let lo = _mm512_and_si512(v, mask);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
                    for t in 0..T {
                        // Token `t`'s block `b`: `d`, `s` (2 bytes each), then 32 quants.
                        let q = ap[t].add(36 * b + 4);
                        let x =
                            _mm512_set1_epi32(std::ptr::read_unaligned(q.add(4 * j) as *const i32));
                        let y = _mm512_set1_epi32(std::ptr::read_unaligned(
                            q.add(16 + 4 * j) as *const i32
                        ));
                        lo_sum[t] = _mm512_dpbusd_epi32(lo_sum[t], lo, x);
                        if split {
                            hi_sum[t] = _mm512_dpbusd_epi32(hi_sum[t], hi, y);
                        } else {
                            lo_sum[t] = _mm512_dpbusd_epi32(lo_sum[t], hi, y);
                        }
                    }
                }
                for t in 0..T {
                    let s = if split {
                        _mm512_add_epi32(lo_sum[t], hi_sum[t])
                    } else {
                        lo_sum[t]
                    };
                    let d = _mm512_mul_ps(wd, _mm512_set1_ps(*sd[t].add(b)));
                    acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
                }
            }
            let mut summ = [_mm512_setzero_ps(); T];
            for b in 0..nb {
                let wm =
                    _mm512_cvtph_ps(_mm256_loadu_si256(wg.add(b * BLOCK + 32) as *const __m256i));
                for t in 0..T {
                    let s = _mm512_set1_ps(*sd[t].add(nb + b));
                    summ[t] = _mm512_add_ps(summ[t], _mm512_mul_ps(wm, s));
                }
            }
            for t in 0..T {
                let o = &mut out[t][r0 + g * ROWS..r0 + (g + 1) * ROWS];
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_add_ps(acc[t], summ[t]));
            }
        }
        T
    }
}
