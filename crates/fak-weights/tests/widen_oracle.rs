//! R1a: BF16 and F16 widening to f32 is bit-exact against torch's `.float()` over
//! every 16-bit pattern (fixture `testdata/widen/widen.safetensors`, made by
//! `oracle-export/export_oracle.py widen`). Read through our own
//! [`SafetensorsFile`], so the reader's F32/BF16/F16 paths are exercised too.

use fak_weights::{widen_bf16, widen_f16, SafetensorsFile};
use std::path::PathBuf;

fn fixture() -> SafetensorsFile {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/widen/widen.safetensors");
    if !path.exists() {
        panic!(
            "fixture {} is missing; `python oracle-export/export_oracle.py widen` regenerates it",
            path.display()
        );
    }
    SafetensorsFile::open(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn compare(what: &str, got: &[f32], expected: &[f32], input: &[u8]) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != expected[i].to_bits())
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} differ; first at element {i} (input bits {:#06x}): got {:#010x}, \
             expected {:#010x}",
            bad.len(),
            got.len(),
            u16::from_le_bytes([input[2 * i], input[2 * i + 1]]),
            got[i].to_bits(),
            expected[i].to_bits()
        );
    }
}

#[test]
fn bf16_widening_matches_torch() {
    let f = fixture();
    assert_eq!(f.dtype("bf16_in").unwrap(), safetensors::Dtype::BF16);
    let input = f.tensor_bytes("bf16_in").unwrap();
    let expected = f.tensor_f32("bf16_out").unwrap();
    let mut got = vec![0f32; input.len() / 2];
    assert_eq!(widen_bf16(input, &mut got), got.len());
    compare("bf16", &got, &expected, input);
    // The reader's own BF16 path gives the same bits.
    compare(
        "bf16 via tensor_f32",
        &f.tensor_f32("bf16_in").unwrap(),
        &expected,
        input,
    );
}

#[test]
fn f16_widening_matches_torch() {
    let f = fixture();
    assert_eq!(f.dtype("f16_in").unwrap(), safetensors::Dtype::F16);
    let input = f.tensor_bytes("f16_in").unwrap();
    let expected = f.tensor_f32("f16_out").unwrap();
    let mut got = vec![0f32; input.len() / 2];
    assert_eq!(widen_f16(input, &mut got), got.len());
    compare("f16", &got, &expected, input);
    compare(
        "f16 via tensor_f32",
        &f.tensor_f32("f16_in").unwrap(),
        &expected,
        input,
    );
}

#[test]
fn other_dtypes_are_refused_naming_the_tensor() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/dequant/Q4_0.safetensors");
    let f = SafetensorsFile::open(&path).unwrap_or_else(|e| {
        panic!("{e}; `python oracle-export/export_oracle.py dequant` regenerates it")
    });
    let e = f.tensor_f32("blocks").unwrap_err().to_string();
    assert!(e.contains("blocks") && e.contains("U8"), "{e}");
    assert!(f.names().contains(&"expected".to_string()));
    assert!(f.tensor_f32("nope").is_err());
}
