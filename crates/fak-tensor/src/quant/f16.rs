//! IEEE binary16 ↔ `f32`: the exact widening every f16 scale of a weight block goes
//! through (numpy's `astype(np.float32)`, the F16C instruction for non-NaN values) and
//! the round-to-nearest-even narrowing of the activation quantizers.

/// Widen IEEE binary16 bits to `f32` exactly (subnormals normalized, NaN payload
/// shifted into place and kept signalling; the bits of numpy's `astype(np.float32)`;
/// `fak_weights` re-exports it as `f16_bits_to_f32`, the widening of its dequantizers).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x03ff) as u32;
    let bits = match exp {
        1..=30 => sign | ((exp + 127 - 15) << 23) | (man << 13),
        0 if man == 0 => sign,
        0 => {
            // Subnormal: man * 2^-24; move the top set bit to bit 10.
            let shift = man.leading_zeros() - 21;
            sign | ((127 - 15 + 1 - shift) << 23) | (((man << shift) & 0x03ff) << 13)
        }
        _ => sign | 0x7f80_0000 | (man << 13),
    };
    f32::from_bits(bits)
}

/// Round an `f32` to the nearest IEEE binary16, ties to even (the rounding of the
/// F16C instruction `vcvtps2ph` and of ggml's `GGML_FP32_TO_FP16`); values at or above
/// 65520 in magnitude become ±infinity; a NaN stays a NaN (quiet, top payload bits
/// kept).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x007f_ffff;
    if exp == 0xff {
        let nan = if man != 0 {
            0x0200 | (man >> 13) as u16
        } else {
            0
        };
        return sign | 0x7c00 | nan;
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // f16 subnormal (or zero): count units of 2^-24.
        if e < -10 {
            return sign; // below 2^-25: rounds to zero (2^-25 itself ties to even 0)
        }
        let m = man | 0x0080_0000;
        let shift = (14 - e) as u32; // 14..=24
        let q = m >> shift;
        let rem = m & ((1 << shift) - 1);
        let half = 1u32 << (shift - 1);
        let q = if rem > half || (rem == half && q & 1 == 1) {
            q + 1
        } else {
            q
        };
        return sign | q as u16; // a carry to 0x400 is the smallest normal, correctly
    }
    let q = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    let q = if rem > 0x1000 || (rem == 0x1000 && q & 1 == 1) {
        q + 1 // a carry into the exponent is correct, up to infinity (0x7c00)
    } else {
        q
    };
    sign | q as u16
}

#[inline(always)]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// The little-endian f16 `b` (a block's scale field) widened by [`f16_to_f32`].
#[inline]
pub(crate) fn f16_le(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}
