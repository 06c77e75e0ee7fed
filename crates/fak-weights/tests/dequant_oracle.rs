//! R1a: dequantization of every supported ggml block type is bit-exact against
//! gguf-py's `gguf.quants.dequantize` (fixtures made by
//! `oracle-export/export_oracle.py dequant`; the witness is gguf-py, not us).
//!
//! Fixture `testdata/dequant/<TYPE>.safetensors`: `blocks` (U8, raw block bytes),
//! `expected` (F32, gguf-py output), `block_kind` (U8, how each block was made).

use fak_weights::{dequantize, GgmlType};
use safetensors::SafeTensors;
use std::path::PathBuf;

fn fixture_path(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata")
        .join(rel)
}

/// Read a fixture file, failing (never skipping) with the command that makes it.
pub fn read_fixture(rel: &str, subcommand: &str) -> Vec<u8> {
    let path = fixture_path(rel);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "fixture {} is missing ({e}); `python oracle-export/export_oracle.py {subcommand}` \
             regenerates it",
            path.display()
        )
    })
}

fn check(name: &str) {
    let ty = GgmlType::all()
        .iter()
        .copied()
        .find(|t| t.name() == name)
        .expect("known type");
    let rel = format!("dequant/{name}.safetensors");
    let bytes = read_fixture(&rel, "dequant");
    let st = SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("{rel}: {e}"));
    let blocks = st.tensor("blocks").expect("blocks tensor");
    let expected = st.tensor("expected").expect("expected tensor");
    let kinds = st.tensor("block_kind").ok().map(|k| k.data().to_vec());
    assert_eq!(blocks.dtype(), safetensors::Dtype::U8);
    assert_eq!(expected.dtype(), safetensors::Dtype::F32);
    let expected: Vec<u32> = expected
        .data()
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let raw = blocks.data();
    let (bs, ts) = (ty.block_size(), ty.type_size());
    assert_eq!(
        raw.len() % ts,
        0,
        "{name}: blocks not a multiple of {ts} bytes"
    );
    let n_blocks = raw.len() / ts;
    assert_eq!(expected.len(), n_blocks * bs, "{name}: expected length");

    let mut got = vec![0f32; expected.len()];
    dequantize(ty, raw, &mut got).unwrap();

    let mut mismatches = 0usize;
    let mut first = None;
    for (i, (g, &e)) in got.iter().zip(&expected).enumerate() {
        if g.to_bits() != e {
            mismatches += 1;
            first.get_or_insert((i, g.to_bits(), e));
        }
    }
    if let Some((i, g, e)) = first {
        let (block, elem) = (i / bs, i % bs);
        let kind = kinds.as_ref().and_then(|k| k.get(block).copied());
        panic!(
            "{name}: {mismatches} of {} values differ; first at block {block} (kind {kind:?}), \
             element {elem}: got {g:#010x} ({}), expected {e:#010x} ({}); block bytes {:02x?}",
            got.len(),
            f32::from_bits(g),
            f32::from_bits(e),
            &raw[block * ts..(block + 1) * ts],
        );
    }
    eprintln!("{name}: {n_blocks} blocks, {} values bit-exact", got.len());
}

macro_rules! oracle_tests {
    ($($fn_name:ident => $ty:literal),* $(,)?) => {
        $(#[test] fn $fn_name() { check($ty); })*
    };
}

oracle_tests! {
    dequant_f32 => "F32",
    dequant_f16 => "F16",
    dequant_bf16 => "BF16",
    dequant_q4_0 => "Q4_0",
    dequant_q4_1 => "Q4_1",
    dequant_q5_0 => "Q5_0",
    dequant_q5_1 => "Q5_1",
    dequant_q8_0 => "Q8_0",
    dequant_q2_k => "Q2_K",
    dequant_q3_k => "Q3_K",
    dequant_q4_k => "Q4_K",
    dequant_q5_k => "Q5_K",
    dequant_q6_k => "Q6_K",
}
