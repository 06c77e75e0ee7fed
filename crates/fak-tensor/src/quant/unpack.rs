//! Weight unpacking shared by the scalar references (and the K scale tables by AVX2),
//! and the two steps of the canonical order every reference shares ([`super`] docs).

use super::QK;

/// The 32 4-bit quants of a Q4_0/Q4_1 `qs` field, element order.
/// The blocks of one row of weights as they lie in the file, each read by value: a
/// weight row may start at any byte, so the blocks are copied out rather than viewed
/// in place (the scalar references' reading; the SIMD kernels read the bytes).
pub(crate) fn weight_blocks<B: bytemuck::Pod>(w: &[u8]) -> impl Iterator<Item = B> + '_ {
    w.chunks_exact(std::mem::size_of::<B>())
        .map(bytemuck::pod_read_unaligned)
}

pub(crate) fn nibbles(qs: &[u8]) -> [i32; QK] {
    let mut q = [0i32; QK];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0f) as i32;
        q[j + 16] = (qs[j] >> 4) as i32;
    }
    q
}

/// The 32 5-bit quants of a Q5_0/Q5_1 block: nibbles plus bit `e` of `qh` as bit 4.
pub(crate) fn five_bit(qh: &[u8], qs: &[u8]) -> [i32; QK] {
    let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = nibbles(qs);
    for (e, v) in q.iter_mut().enumerate() {
        *v |= (((h >> e) & 1) << 4) as i32;
    }
    q
}

/// The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block (ggml `get_scale_min_k4`)
/// from its 12-byte `scales` field; also the dequantizers'
/// ([`super::dequantize_q4_k`], [`super::dequantize_q5_k`]).
///
/// Shapes: `s` is the block's `scales` field, bytes 4..16 of the block; only `s[..12]`
/// is read, and a slice shorter than 12 bytes panics (every caller passes the field).
pub fn k4_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// `Σ_g mn_g (bsum_{2g} + bsum_{2g+1})`, exact in `i32` (|·| ≤ 8·63·65534).
pub(crate) fn k_mins(mn: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    let mut s = 0i32;
    for g in 0..8 {
        s += mn[g] as i32 * (bsums[2 * g] as i32 + bsums[2 * g + 1] as i32);
    }
    s
}

/// Lane sums of one 32-element chunk of a K super-block: `L[m] = Σ_{k<4} w[4m+k] a[4m+k]`.
pub(crate) fn lanes4(w: &[i32; QK], a: &[i8]) -> [i32; 8] {
    let mut l = [0i32; 8];
    for (m, lm) in l.iter_mut().enumerate() {
        for k in 0..4 {
            *lm += w[4 * m + k] * a[4 * m + k] as i32;
        }
    }
    l
}

/// The exact product sum of one 32-element block, `S = Σ_e w_e a_e`: step 1 of the
/// 32-element types' canonical order (`|S| ≤ 32 · 128 · 128 = 2^19`, exact in `i32` and
/// in `f32`).
pub(crate) fn block_sum(w: &[i32; QK], a: &[i8]) -> i32 {
    w.iter().zip(a).map(|(&w, &a)| w * a as i32).sum()
}

/// `acc + d * (s as f32)`, a rounded multiply then a rounded add (no FMA): step 2 of the
/// 32-element types' canonical order.
#[inline(always)]
pub(crate) fn accumulate_block(acc: f32, d: f32, s: i32) -> f32 {
    acc + d * s as f32
}

/// `acc[m] = acc[m] + d * (L[m] as f32)`: step 2 of the K types' canonical order.
#[inline(always)]
pub(crate) fn accumulate(acc: &mut [f32; 8], d: f32, l: &[i32; 8]) {
    for m in 0..8 {
        acc[m] += d * l[m] as f32;
    }
}

/// The 5-bit quant of element `j` (0..32) of a Q5_0/Q5_1 block, unbiased.
#[inline]
pub(crate) fn q5_value(qh: u32, qs: &[u8; 16], j: usize) -> u8 {
    let lo = if j < 16 {
        qs[j] & 0x0f
    } else {
        qs[j - 16] >> 4
    };
    let hi = ((qh >> j) & 1) as u8;
    lo | (hi << 4)
}
