//! Hostile and malformed GGUF input: every case must give its typed error quickly,
//! never a panic or a huge allocation. Also checks that a valid file round-trips.

mod common;
use common::{f32_bytes, gstr, tiny_valid, vt, Builder};
use fak_weights::{GgmlType, GgufError, GgufFile, MetaValue};

fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(bytes)
}

fn err(bytes: Vec<u8>) -> GgufError {
    match parse(bytes) {
        Ok(f) => panic!("expected an error, parsed {f:?}"),
        Err(e) => e,
    }
}

#[test]
fn tiny_valid_file_round_trips() {
    let f = parse(tiny_valid().build()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.metadata().len(), 14);
    assert_eq!(f.metadata()[1].0, "t.u8");
    assert_eq!(f.get("t.u8"), Some(&MetaValue::U8(200)));
    assert_eq!(f.get("t.i8"), Some(&MetaValue::I8(-2)));
    assert_eq!(f.get("t.u16"), Some(&MetaValue::U16(60000)));
    assert_eq!(f.get("t.i16"), Some(&MetaValue::I16(-300)));
    assert_eq!(f.get_u64("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get("t.i32"), Some(&MetaValue::I32(-7)));
    assert_eq!(f.get_f32("t.f32").unwrap(), 1.5);
    assert!(f.get_bool("t.bool").unwrap());
    assert_eq!(f.get_u64("t.u64").unwrap(), u64::MAX);
    assert_eq!(f.get("t.i64"), Some(&MetaValue::I64(-1)));
    assert_eq!(f.get_f32("t.f64").unwrap(), 0.25);
    assert_eq!(
        f.get("t.nested"),
        Some(&MetaValue::Array(vec![
            MetaValue::Array(vec![MetaValue::I16(1), MetaValue::I16(2)]),
            MetaValue::Array(vec![MetaValue::I16(3)]),
        ]))
    );
    let strs = f.get_array("t.strs").unwrap();
    assert_eq!(strs[1].as_str(), Some("bé"));

    // Typed getters name the key on failure.
    match f.get_u64("t.i64") {
        Err(GgufError::WrongType { key, found, .. }) => {
            assert_eq!((key.as_str(), found), ("t.i64", "i64"))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(f.get_str("nope"), Err(GgufError::MissingKey(k)) if k == "nope"));
    assert!(f.get_bool("t.u8").unwrap_err().to_string().contains("t.u8"));

    assert_eq!(f.tensors().len(), 3);
    let embd = f.tensor("embd.weight").unwrap();
    assert_eq!(embd.ggml_type, GgmlType::Q8_0);
    assert_eq!(embd.dims, vec![32, 2]);
    assert_eq!(embd.shape_hf(), vec![2, 32]);
    assert_eq!((embd.n_elements, embd.n_bytes), (64, 68));
    assert_eq!(f.tensor_data(embd).len(), 68);
    let x = f.tensor_f32("embd.weight").unwrap();
    for j in 0..32 {
        assert_eq!(x[j], j as f32 - 16.0);
        assert_eq!(x[32 + j], 0.5 * ((j as u8).wrapping_mul(7) as i8) as f32);
    }
    assert_eq!(f.tensor_f32("norm.weight").unwrap(), vec![1.0, -2.0, 0.5]);
    let h = f.tensor_f32("half.weight").unwrap();
    assert_eq!(h, vec![1.0, -2.0, 2f32.powi(-24), f32::INFINITY]);
    assert!(matches!(f.tensor_f32("missing"), Err(GgufError::NotFound(n)) if n == "missing"));
}

#[test]
fn version_2_and_custom_alignment_parse() {
    let b = Builder {
        version: 2,
        ..Builder::default()
    }
    .alignment(64)
    .tensor("a", &[32], 2, vec![0u8; 18])
    .tensor("b", &[4], 0, vec![0u8; 16]);
    let f = parse(b.build()).unwrap();
    assert_eq!((f.version(), f.alignment()), (2, 64));
    assert_eq!(f.data_start() % 64, 0);
    assert_eq!(f.tensor("b").unwrap().offset, 64);
}

#[test]
fn zero_tensors_no_padding_is_fine() {
    let f = parse(Builder::default().kv_u32("x", 1).build()).unwrap();
    assert!(f.tensors().is_empty());
}

#[test]
fn empty_file() {
    assert!(matches!(err(vec![]), GgufError::Truncated { what, .. } if what == "magic"));
}

#[test]
fn bad_magic() {
    let b = Builder {
        magic: *b"GGML",
        ..Builder::default()
    };
    assert!(matches!(err(b.build()), GgufError::BadMagic { found } if &found == b"GGML"));
}

#[test]
fn version_1_and_99_unsupported() {
    for v in [1, 99, 0x0300_0000] {
        let b = Builder {
            version: v,
            ..Builder::default()
        };
        assert!(matches!(err(b.build()), GgufError::UnsupportedVersion(x) if x == v));
    }
}

#[test]
fn every_truncation_errors() {
    let full = tiny_valid().build();
    assert!(parse(full.clone()).is_ok());
    for len in 0..full.len() {
        let r = parse(full[..len].to_vec());
        assert!(r.is_err(), "prefix of {len} bytes parsed");
    }
}

#[test]
fn string_length_larger_than_file() {
    let b = Builder::default().kv("k", vt::STRING, (1u64 << 40).to_le_bytes().to_vec());
    match err(b.build()) {
        GgufError::StringTooLong { what, len, .. } => {
            assert_eq!(len, 1 << 40);
            assert!(what.contains("'k'"), "{what}");
        }
        e => panic!("{e:?}"),
    }
    // Also a key length.
    let mut bytes = Builder {
        kv_count: Some(1),
        ..Builder::default()
    }
    .build();
    bytes.truncate(24); // header only, no padding
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    bytes.extend_from_slice(&[0; 16]);
    assert!(
        matches!(err(bytes.clone()), GgufError::StringTooLong { ref what, len: u64::MAX, available: 16 } if what == "metadata key #0"),
        "{}",
        err(bytes)
    );
}

#[test]
fn array_count_2_pow_62() {
    for elem in [vt::U8, vt::STRING, vt::ARRAY, vt::F64] {
        let mut v = elem.to_le_bytes().to_vec();
        v.extend_from_slice(&(1u64 << 62).to_le_bytes());
        let b = Builder::default().kv("big", vt::ARRAY, v);
        match err(b.build()) {
            GgufError::TooMany { what, count, .. } => {
                assert_eq!(count, 1 << 62);
                assert!(what.contains("'big'"), "{what}");
            }
            e => panic!("{e:?}"),
        }
    }
}

/// An array value: element type, count, then the encoded elements.
fn array_value(elem: u32, count: u64, elements: &[u8]) -> Vec<u8> {
    let mut v = elem.to_le_bytes().to_vec();
    v.extend_from_slice(&count.to_le_bytes());
    v.extend_from_slice(elements);
    v
}

#[test]
fn metadata_array_elements_are_capped_per_file() {
    const CAP: u64 = fak_weights::gguf::MAX_METADATA_ARRAY_ELEMENTS;
    // 20M u8 elements, all present in the file: parsed, they would take ~640 MB.
    let n = 20_000_000u64;
    let b = Builder::default().kv(
        "big",
        vt::ARRAY,
        array_value(vt::U8, n, &vec![7; n as usize]),
    );
    match err(b.build()) {
        GgufError::TooMany { what, count, max } => {
            assert!(what.starts_with("metadata array elements"), "{what}");
            assert!(what.contains("'big'"), "{what}");
            assert_eq!((count, max), (n, CAP));
        }
        e => panic!("{e:?}"),
    }

    // The cap is for the whole file: two arrays under it alone, over it together,
    // the second (nested, counting its inner elements) named.
    let half = CAP / 2 + 1;
    let mut nested = array_value(vt::ARRAY, 1, &[]);
    nested.extend_from_slice(&array_value(
        vt::I8,
        half - 1,
        &vec![0; (half - 1) as usize],
    ));
    let b = Builder::default()
        .kv(
            "a",
            vt::ARRAY,
            array_value(vt::U8, half, &vec![1; half as usize]),
        )
        .kv("b", vt::ARRAY, nested);
    let e = err(b.build());
    assert!(
        matches!(&e, GgufError::TooMany { what, count, max }
            if what.contains("'b'") && *count == 2 * half && *max == CAP),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("exceeds the limit of 16777216"),
        "{e}"
    );

    // Exactly at the cap parses, and the values are all there.
    let rest = CAP - half;
    let b = Builder::default()
        .kv(
            "a",
            vt::ARRAY,
            array_value(vt::U8, half, &vec![1; half as usize]),
        )
        .kv(
            "b",
            vt::ARRAY,
            array_value(vt::U8, rest, &vec![2; rest as usize]),
        );
    let f = parse(b.build()).unwrap();
    assert_eq!(f.get_array("a").unwrap().len() as u64, half);
    assert_eq!(
        f.get_array("b").unwrap()[rest as usize - 1],
        MetaValue::U8(2)
    );
}

#[test]
fn hostile_header_counts() {
    let b = Builder {
        tensor_count: Some(1 << 60),
        ..Builder::default()
    };
    assert!(matches!(err(b.build()), GgufError::TooMany { count, .. } if count == 1 << 60));
    let b = Builder {
        kv_count: Some(u64::MAX),
        ..Builder::default()
    };
    assert!(matches!(err(b.build()), GgufError::TooMany { .. }));
}

#[test]
fn unknown_metadata_value_type() {
    let b = Builder::default().kv("weird", 13, vec![0; 8]);
    assert!(
        matches!(err(b.build()), GgufError::UnknownValueType { key, type_id: 13 } if key == "weird")
    );
    let mut v = 99u32.to_le_bytes().to_vec();
    v.extend_from_slice(&1u64.to_le_bytes());
    let b = Builder::default().kv("arr", vt::ARRAY, v);
    assert!(matches!(
        err(b.build()),
        GgufError::UnknownValueType { type_id: 99, .. }
    ));
}

#[test]
fn invalid_bool_and_utf8_and_duplicate_key() {
    let b = Builder::default().kv("b", vt::BOOL, vec![2]);
    assert!(matches!(
        err(b.build()),
        GgufError::InvalidBool { value: 2, .. }
    ));
    let b = Builder::default().kv("s", vt::STRING, {
        let mut v = 2u64.to_le_bytes().to_vec();
        v.extend_from_slice(&[0xff, 0xfe]);
        v
    });
    assert!(matches!(err(b.build()), GgufError::InvalidUtf8 { what } if what.contains("'s'")));
    let b = Builder::default().kv_u32("dup", 1).kv_u32("dup", 2);
    assert!(matches!(err(b.build()), GgufError::DuplicateKey(k) if k == "dup"));
}

#[test]
fn deeply_nested_arrays_are_refused() {
    let mut v = Vec::new();
    for _ in 0..100_000 {
        v.extend_from_slice(&vt::ARRAY.to_le_bytes());
        v.extend_from_slice(&1u64.to_le_bytes());
    }
    v.extend_from_slice(&vt::U8.to_le_bytes());
    v.extend_from_slice(&0u64.to_le_bytes());
    let b = Builder::default().kv("deep", vt::ARRAY, v);
    assert!(matches!(err(b.build()), GgufError::NestingTooDeep { key, .. } if key == "deep"));
}

#[test]
fn unknown_ggml_type_id() {
    let b = Builder::default().tensor("t", &[4], 4, vec![0; 16]);
    assert!(
        matches!(err(b.build()), GgufError::UnknownGgmlType { tensor, type_id: 4 } if tensor == "t")
    );
}

fn bad_tensor(b: Builder, needle: &str) {
    match err(b.build()) {
        GgufError::BadTensor { tensor, reason } => {
            assert_eq!(tensor, "t");
            assert!(reason.contains(needle), "{reason}");
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn n_dims_0_and_5() {
    bad_tensor(
        Builder::default().tensor("t", &[], 0, vec![0; 4]),
        "0 dimensions",
    );
    bad_tensor(
        Builder::default().tensor("t", &[1, 1, 1, 1, 1], 0, vec![0; 4]),
        "5 dimensions",
    );
}

#[test]
fn zero_dimension() {
    bad_tensor(Builder::default().tensor("t", &[4, 0], 0, vec![]), "is 0");
}

#[test]
fn tensor_data_past_end_of_file() {
    let mut b = Builder::default().tensor("t", &[8], 0, vec![0; 32]);
    let mut bytes = b.build();
    bytes.truncate(bytes.len() - 1);
    assert!(matches!(err(bytes), GgufError::DataOutOfBounds { tensor, .. } if tensor == "t"));
    // Offset far past the end (aligned), and an offset that overflows u64.
    for off in [1u64 << 40, u64::MAX - 31] {
        b.tensors[0].offset = Some(off);
        assert!(matches!(
            err(b.build_no_data()),
            GgufError::DataOutOfBounds { .. }
        ));
    }
}

trait NoData {
    fn build_no_data(&self) -> Vec<u8>;
}
impl NoData for Builder {
    /// Build with tensor data omitted (for offsets that cannot be materialized).
    fn build_no_data(&self) -> Vec<u8> {
        let mut b = self.clone();
        for t in &mut b.tensors {
            t.data.clear();
        }
        b.build()
    }
}

#[test]
fn misaligned_offset() {
    let mut b = Builder::default().tensor("t", &[4], 0, vec![0; 16]);
    b.tensors[0].offset = Some(4);
    bad_tensor(b, "not a multiple of the alignment");
}

#[test]
fn alignment_0_and_3() {
    for a in [0u32, 3, 48] {
        let b = Builder::default().kv_u32("general.alignment", a);
        assert!(matches!(err(b.build()), GgufError::BadAlignment(x) if x == a));
    }
    let b = Builder::default().kv("general.alignment", vt::U64, 32u64.to_le_bytes().to_vec());
    assert!(
        matches!(err(b.build()), GgufError::WrongType { key, found: "u64", .. } if key == "general.alignment")
    );
}

#[test]
fn row_length_not_multiple_of_block_size() {
    bad_tensor(
        Builder::default().tensor("t", &[33, 2], 2, vec![0; 36]),
        "not a multiple of the Q4_0 block size 32",
    );
}

#[test]
fn duplicate_tensor_name() {
    let b = Builder::default()
        .tensor("t", &[4], 0, vec![0; 16])
        .tensor("t", &[4], 0, vec![0; 16]);
    assert!(matches!(err(b.build()), GgufError::DuplicateTensor(n) if n == "t"));
}

#[test]
fn dims_product_overflow() {
    bad_tensor(
        Builder::default().tensor("t", &[1 << 32, 1 << 32], 0, vec![]),
        "overflows",
    );
    // Elements fit but bytes overflow.
    bad_tensor(
        Builder::default().tensor("t", &[1 << 62, 2], 0, vec![]),
        "overflows",
    );
}

#[test]
fn overlapping_tensors() {
    let mut b = Builder::default()
        .tensor("a", &[16], 0, vec![0; 64])
        .tensor("t", &[8], 0, vec![0; 32]);
    b.tensors[1].offset = Some(32);
    bad_tensor(b, "overlaps tensor 'a'");
}

#[test]
fn display_names_the_culprit() {
    let e = err(Builder::default()
        .tensor("blk.0.attn_q.weight", &[3], 2, vec![])
        .build());
    assert!(e.to_string().contains("blk.0.attn_q.weight"), "{e}");
    // header 24 + key (8 + 12) + type 4 + value (8 + 1): cut the value's last byte.
    let mut bytes = Builder::default().kv_str("general.name", "x").build();
    bytes.truncate(24 + 20 + 4 + 8);
    let e = err(bytes);
    assert!(
        e.to_string()
            .contains("metadata key #0 'general.name' value"),
        "{e}"
    );
}

#[test]
fn unsupported_dequant_names_the_tensor() {
    // IQ2_XXS (id 16): 66 bytes per 256 elements.
    let f = parse(
        Builder::default()
            .tensor("iq", &[256], 16, vec![0; 66])
            .build(),
    )
    .unwrap();
    let e = f.tensor_f32("iq").unwrap_err();
    assert!(matches!(&e, GgufError::Dequant { tensor, .. } if tensor == "iq"));
    assert!(e.to_string().contains("IQ2_XXS"), "{e}");
}

#[test]
fn key_and_string_helpers() {
    assert_eq!(gstr("ab"), vec![2, 0, 0, 0, 0, 0, 0, 0, b'a', b'b']);
}

#[test]
fn f32_in_place_only_for_aligned_f32_data_of_this_file() {
    // Alignment 2 and a 2-byte F16 tensor between two F32 ones: their data addresses
    // differ by 14 bytes, so at most one of them is 4-byte aligned, whatever address
    // the buffer has.
    let b = Builder::default()
        .alignment(2)
        .tensor("a", &[3], 0, f32_bytes(&[1.0, -2.0, 0.5]))
        .tensor("h", &[1], 1, 0x3c00u16.to_le_bytes().to_vec())
        .tensor("b", &[2], 0, f32_bytes(&[3.0, f32::MIN_POSITIVE]));
    let f = parse(b.build()).unwrap();
    assert_eq!(f.tensor("b").unwrap().offset, 14);
    let mut borrowed = 0;
    for name in ["a", "b"] {
        let t = f.tensor(name).unwrap();
        let aligned = (f.tensor_data(t).as_ptr() as usize).is_multiple_of(4);
        match f.tensor_f32_in_place(t) {
            Some(x) => {
                assert!(aligned && cfg!(target_endian = "little"), "{name}");
                assert_eq!(x.as_ptr().cast::<u8>(), f.tensor_data(t).as_ptr());
                assert_eq!(x, f.tensor_f32(name).unwrap().as_slice());
                borrowed += 1;
            }
            None => assert!(!aligned || cfg!(target_endian = "big"), "{name}"),
        }
    }
    assert!(borrowed <= 1);
    // Not F32.
    assert!(f.tensor_f32_in_place(f.tensor("h").unwrap()).is_none());
    let v = parse(tiny_valid().build()).unwrap();
    assert!(v
        .tensor_f32_in_place(v.tensor("embd.weight").unwrap())
        .is_none());
    // An info whose data is not in this file, or whose length does not match its type.
    let mut far = f.tensor("a").unwrap().clone();
    far.offset = 1 << 40;
    assert!(f.tensor_f32_in_place(&far).is_none());
    let mut short = f.tensor("a").unwrap().clone();
    short.n_elements = 2;
    assert!(f.tensor_f32_in_place(&short).is_none());
}
