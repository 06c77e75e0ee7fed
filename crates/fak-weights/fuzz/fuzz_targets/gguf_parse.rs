//! Fuzz the GGUF parser: any byte string must parse or give a typed error, never
//! panic, hang or allocate without bound; a file that parses must allow every
//! accessor, including dequantizing every tensor.
//!
//! Seed corpus: `cargo run -p fak-weights --example gguf_fuzz_seed -- fuzz/corpus/gguf_parse`
//! (from crates/fak-weights), then `cargo +nightly fuzz run gguf_parse`.
#![no_main]

use fak_weights::{gguf_to_hf_name, GgufFile, MetaValue};
use libfuzzer_sys::fuzz_target;

/// Most f32 outputs dequantized per input (bounds time and memory per run).
const MAX_ELEMENTS: u64 = 1 << 22;

fn touch(v: &MetaValue) -> u64 {
    let mut acc = v.type_name().len() as u64;
    acc ^= v.as_u64().unwrap_or(0);
    acc ^= v.as_i64().unwrap_or(0) as u64;
    acc ^= v.as_f32().map_or(0, f32::to_bits) as u64;
    acc ^= v.as_str().map_or(0, str::len) as u64;
    acc ^= v.as_bool().map_or(0, u64::from);
    if let Some(items) = v.as_array() {
        for it in items {
            acc = acc.wrapping_add(touch(it));
        }
    }
    acc
}

fuzz_target!(|data: &[u8]| {
    let f = match GgufFile::from_bytes(data.to_vec()) {
        Ok(f) => f,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let mut acc = f.version() as u64 ^ f.alignment();
    for (k, v) in f.metadata() {
        acc = acc.wrapping_add(touch(v));
        assert!(f.get(k).is_some());
        let _ = f.get_u64(k).map_err(|e| e.to_string());
        let _ = f.get_f32(k);
        let _ = f.get_str(k);
        let _ = f.get_bool(k);
    }
    let _ = f.architecture();
    let mut budget = MAX_ELEMENTS;
    for t in f.tensors() {
        assert_eq!(f.tensor(&t.name), Some(t));
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
        let _ = t.shape_hf();
        let _ = gguf_to_hf_name(&t.name);
        if t.n_elements > budget {
            continue;
        }
        budget -= t.n_elements;
        match f.tensor_f32(&t.name) {
            Ok(x) => {
                assert_eq!(x.len() as u64, t.n_elements);
                acc = acc.wrapping_add(x.iter().map(|v| v.to_bits() as u64).sum::<u64>());
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
    std::hint::black_box(acc);
});
