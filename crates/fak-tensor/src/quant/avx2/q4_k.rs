//! Q4_K × Q8_K with AVX2 (reference: `vec_dot_q4_k_q8_k_ref`), and what Q5_K shares
//! with it: the multi-token kernel and the quant unpacking.

use super::*;

/// See `vec_dot_q4_k_q8_k_ref`.
///
/// # Safety
/// AVX2 and F16C; `w.len() == 144 * a.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(in crate::quant) unsafe fn dot_q4_k_q8_k(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let [v] = k_tokens_one(w, a, KQuant::Q4);
    v
}

/// Q4_K or Q5_K (they share everything but the quant unpacking: the 4-bit quants start
/// at byte `qs_at` of a block of `bytes`, and Q5_K's fifth bits are the 32 bytes at
/// `qh_at`, bit `g` of byte `lane` for group `g`) of one weight row with `T` tokens'
/// activations, in the canonical order of `vec_dot_q4_k_q8_k_ref`. Each super-block's
/// quants and scales are unpacked once for the `T` tokens (a prefill reads every weight
/// row for many tokens); every token gets the same operations in the same order (the
/// integer lane sums, `d = ad · wd` and `dmin = ad · wmin` rounded once, [`accumulate`],
/// the minimum sum, [`hsum`]), so each result is the bits of `T = 1` (the one-token
/// kernels [`dot_q4_k_q8_k`], [`dot_q5_k_q8_k`]).
///
/// # Safety
/// AVX2 and F16C; `w.len() == bytes * a[t].len()` for every `t`; `qs_at + 128 <= bytes`,
/// `qh_at + 32 <= bytes`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn dot_k45_tokens<const T: usize>(
    w: &[u8],
    a: [&[BlockQ8K]; T],
    bytes: usize,
    qs_at: usize,
    qh_at: Option<usize>,
) -> [f32; T] {
    let mut acc = [_mm256_setzero_ps(); T];
    let mut summ = [0f32; T];
    for (b, wb) in w.chunks_exact(bytes).enumerate() {
        let (sc, mn) = k4_scale_min(&wb[4..16]);
        let q = unpack_k45(wb, qs_at, qh_at);
        let (wd, wmin) = (f16_at(wb, 0), f16_at(wb, 2));
        for t in 0..T {
            let ab = &a[t][b];
            let aq = ab.qs.as_ptr() as *const u8;
            let mut sumi = _mm256_setzero_si256();
            for c in 0..4 {
                let p0 = _mm256_madd_epi16(
                    pairs(q[2 * c], load32(aq.add(64 * c))),
                    _mm256_set1_epi16(sc[2 * c] as i16),
                );
                let p1 = _mm256_madd_epi16(
                    pairs(q[2 * c + 1], load32(aq.add(64 * c + 32))),
                    _mm256_set1_epi16(sc[2 * c + 1] as i16),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
            }
            acc[t] = accumulate(acc[t], ab.d * wd, sumi);
            summ[t] += ab.d * wmin * k_mins(&mn, &ab.bsums) as f32;
        }
    }
    std::array::from_fn(|t| hsum(acc[t]) - summ[t])
}

/// The 256 quants of one Q4_K/Q5_K super-block `wb` as unsigned bytes in element
/// order: register `g` holds elements `32g..32g + 32` (group `g`, the nibble `g % 2` of
/// the 32 bytes at `qs_at + 32 (g / 2)`, and for Q5_K bit `g` of the 32 bytes at
/// `qh_at` as bit 4; `vec_dot_q4_k_q8_k_ref`, `vec_dot_q5_k_q8_k_ref`).
///
/// # Safety
/// AVX2 and F16C; `qs_at + 128 <= wb.len()`, `qh_at + 32 <= wb.len()`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(in crate::quant) unsafe fn unpack_k45(
    wb: &[u8],
    qs_at: usize,
    qh_at: Option<usize>,
) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0f);
    let sixteen = _mm256_set1_epi8(0x10);
    let qh = match qh_at {
        Some(at) => load32(wb[at..at + 32].as_ptr()),
        None => _mm256_setzero_si256(),
    };
    let mut q = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        let raw = load32(wb[qs_at + 32 * c..qs_at + 32 * c + 32].as_ptr());
        let mut q0 = _mm256_and_si256(raw, m4);
        let mut q1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        if qh_at.is_some() {
            let b0 = _mm256_set1_epi8((1u8 << (2 * c)) as i8);
            let b1 = _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8);
            let h0 = _mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0);
            let h1 = _mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1);
            q0 = _mm256_or_si256(q0, _mm256_and_si256(h0, sixteen));
            q1 = _mm256_or_si256(q1, _mm256_and_si256(h1, sixteen));
        }
        q[2 * c] = q0;
        q[2 * c + 1] = q1;
    }
    q
}
