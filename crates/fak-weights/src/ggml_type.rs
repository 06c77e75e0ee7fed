//! The ggml tensor element types a GGUF file can name, with their block geometry.
//!
//! Ids, names, block sizes and byte sizes follow ggml's `ggml_type` enum and
//! `type_traits` table (`ggml/src/ggml.c`) and gguf-py's `GGMLQuantizationType` /
//! `GGML_QUANT_SIZES` (`gguf-py/gguf/constants.py`). Ids that ggml retired (4, 5,
//! 31–33, 36–38) are not accepted.

use std::fmt;

/// A ggml tensor element type, as stored in a GGUF tensor info (`u32` type id).
///
/// Quantized types pack `block_size()` elements into `type_size()` bytes; the row
/// length of a tensor (its innermost dimension) must be a multiple of the block size.
/// Variant names are gguf-py's (`GGMLQuantizationType`). Only the types listed in
/// [`crate::dequantize`]'s docs can be dequantized; the rest are recognised so a file
/// that holds them still opens, and dequantizing them gives
/// [`crate::DequantError::Unsupported`].
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// IEEE-754 binary32, 1 element per 4 bytes.
    F32,
    /// IEEE-754 binary16, 1 element per 2 bytes.
    F16,
    /// 32 elements: f16 scale `d`, 16 bytes of 4-bit quants; `x = d * (q - 8)`.
    Q4_0,
    /// 32 elements: f16 `d`, f16 `m`, 16 bytes of 4-bit quants; `x = d * q + m`.
    Q4_1,
    /// 32 elements: f16 `d`, 32 high bits, 16 bytes of low nibbles; `x = d * (q - 16)`.
    Q5_0,
    /// 32 elements: f16 `d`, f16 `m`, 32 high bits, 16 bytes of low nibbles; `x = d * q + m`.
    Q5_1,
    /// 32 elements: f16 `d`, 32 signed bytes; `x = d * q`.
    Q8_0,
    /// 32 elements: f16 `d`, f16 sum `s`, 32 signed bytes (an activation format).
    Q8_1,
    /// 256-element super-block, 2-bit quants with 4-bit scales and mins.
    Q2_K,
    /// 256-element super-block, 3-bit quants with 6-bit signed scales.
    Q3_K,
    /// 256-element super-block, 4-bit quants with 6-bit scales and mins.
    Q4_K,
    /// 256-element super-block, 5-bit quants with 6-bit scales and mins.
    Q5_K,
    /// 256-element super-block, 6-bit quants with 8-bit signed scales.
    Q6_K,
    /// 256-element super-block, f32 `d`, 256 signed bytes, 16 i16 block sums.
    Q8_K,
    /// i-quant, 2.06 bits per weight.
    IQ2_XXS,
    /// i-quant, 2.31 bits per weight.
    IQ2_XS,
    /// i-quant, 3.06 bits per weight.
    IQ3_XXS,
    /// i-quant, 1.56 bits per weight.
    IQ1_S,
    /// i-quant, 4.5 bits per weight, 32-element blocks.
    IQ4_NL,
    /// i-quant, 3.44 bits per weight.
    IQ3_S,
    /// i-quant, 2.5 bits per weight.
    IQ2_S,
    /// i-quant, 4.25 bits per weight.
    IQ4_XS,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// IEEE-754 binary64.
    F64,
    /// i-quant, 1.75 bits per weight.
    IQ1_M,
    /// bfloat16 (the top 16 bits of an f32), 1 element per 2 bytes.
    BF16,
    /// Ternary, 1.69 bits per weight.
    TQ1_0,
    /// Ternary, 2.06 bits per weight.
    TQ2_0,
    /// OCP microscaling FP4: 32 elements, an E8M0 scale byte and 16 bytes of E2M1.
    MXFP4,
}

/// Every known type, in id order (used by `from_id` and by tests).
const ALL: [GgmlType; 32] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ3_XXS,
    GgmlType::IQ1_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ3_S,
    GgmlType::IQ2_S,
    GgmlType::IQ4_XS,
    GgmlType::I8,
    GgmlType::I16,
    GgmlType::I32,
    GgmlType::I64,
    GgmlType::F64,
    GgmlType::IQ1_M,
    GgmlType::BF16,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::MXFP4,
];

/// Elements per K-quant super-block (ggml's `QK_K`), fak-tensor's constant.
pub use fak_tensor::quant::QK_K;

impl GgmlType {
    /// Every type this crate knows, in id order.
    pub fn all() -> &'static [GgmlType] {
        &ALL
    }

    /// The type for a GGUF tensor-info type id (ggml's `enum ggml_type`), or `None`
    /// for an id that is unknown or retired.
    pub fn from_id(id: u32) -> Option<Self> {
        ALL.iter().copied().find(|t| t.id() == id)
    }

    /// The GGUF / ggml type id of this type.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
        }
    }

    /// The type's name as gguf-py spells it (`"Q4_K"`, `"BF16"`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
        }
    }

    /// Elements per block (1 for the plain types, 32 or 256 for quantized ones).
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => QK_K,
        }
    }

    /// Bytes per block, as ggml's `sizeof(block_*)`.
    ///
    /// Q8_1 is 36 bytes (two f16 then 32 bytes), as in ggml's `block_q8_1`; gguf-py's
    /// table lists 40, which no ggml build writes.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 | F64 => 8,
            Q4_0 => 2 + 16,
            Q4_1 => 2 + 2 + 16,
            Q5_0 => 2 + 4 + 16,
            Q5_1 => 2 + 2 + 4 + 16,
            Q8_0 => 2 + 32,
            Q8_1 => 2 + 2 + 32,
            Q2_K => 2 + 2 + QK_K / 16 + QK_K / 4,
            Q3_K => 2 + QK_K / 4 + QK_K / 8 + 12,
            Q4_K => 2 + 2 + 12 + QK_K / 2,
            Q5_K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            Q6_K => 2 + QK_K / 2 + QK_K / 4 + QK_K / 16,
            Q8_K => 4 + QK_K + QK_K / 8,
            IQ2_XXS => 2 + QK_K / 4,
            IQ2_XS => 2 + QK_K / 4 + QK_K / 32,
            IQ3_XXS => 2 + QK_K / 4 + QK_K / 8,
            IQ1_S => 2 + QK_K / 8 + QK_K / 16,
            IQ4_NL => 2 + 16,
            IQ3_S => 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4,
            IQ2_S => 2 + QK_K / 4 + QK_K / 16,
            IQ4_XS => 2 + 2 + QK_K / 2 + QK_K / 64,
            IQ1_M => QK_K / 8 + QK_K / 16 + QK_K / 32,
            TQ1_0 => 2 + 4 * 13,
            TQ2_0 => 2 + 64,
            MXFP4 => 1 + 16,
        }
    }

    /// Bytes taken by `n_elements` elements of this type, or `None` when
    /// `n_elements` is not a multiple of [`block_size`](Self::block_size) or the
    /// byte count overflows `u64`.
    pub fn row_bytes(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size() as u64)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for &t in GgmlType::all() {
            assert_eq!(GgmlType::from_id(t.id()), Some(t), "{t}");
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 40, 1000, u32::MAX] {
            assert_eq!(GgmlType::from_id(retired), None);
        }
    }

    #[test]
    fn sizes_match_ggml() {
        use GgmlType::*;
        let expect = [
            (Q4_0, 32, 18),
            (Q4_1, 32, 20),
            (Q5_0, 32, 22),
            (Q5_1, 32, 24),
            (Q8_0, 32, 34),
            (Q2_K, 256, 84),
            (Q3_K, 256, 110),
            (Q4_K, 256, 144),
            (Q5_K, 256, 176),
            (Q6_K, 256, 210),
            (Q8_K, 256, 292),
            (BF16, 1, 2),
            (F16, 1, 2),
            (F32, 1, 4),
        ];
        for (t, bs, ts) in expect {
            assert_eq!((t.block_size(), t.type_size()), (bs, ts), "{t}");
        }
        assert_eq!(Q4_0.row_bytes(64), Some(36));
        assert_eq!(Q4_0.row_bytes(33), None);
        assert_eq!(F32.row_bytes(u64::MAX), None);
    }
}
