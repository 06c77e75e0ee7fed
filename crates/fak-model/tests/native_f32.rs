//! Native weights on an F32 or F16 GGUF: the matrices are read as the file stores them
//! (copied once at load, F16 not widened: the kernels widen each value exactly as they
//! load it) and give the exact path's bits.
//!
//! Fixtures: `testdata/tiny-gguf/*.gguf`, the tiny Llama models of `testdata/tiny/`
//! written by gguf-py as llama.cpp's converter writes an F32 file (Q/K rows permuted
//! for interleaved RoPE), each checked by transformers' GGUF loader to load back to
//! exactly the safetensors model's parameters (`oracle-export/export_oracle.py
//! tiny-gguf`, oracle-export/README.md). The witness for the bits is the exact path on
//! the HF-written safetensors, which `tests/tiny_oracle.rs` proves against HF.

mod common;
use common::*;
use fak_model::{Model, WeightMode};
use fak_tensor::Threads;
use fak_weights::GgufFile;
use std::path::PathBuf;

/// A prompt of the tiny vocabulary (256), long enough for the multi-token kernels.
const IDS: [u32; 12] = [17, 200, 3, 255, 0, 91, 42, 128, 7, 64, 199, 33];

/// How each run splits [`IDS`]: one prefill, token-by-token decode, mixed chunks.
const CHUNKS: [&[usize]; 3] = [&[12], &[1; 12], &[5, 1, 4, 2]];

fn gguf(file: &str) -> PathBuf {
    testdata().join("tiny-gguf").join(file)
}

/// Bytes of the RMSNorm gains of a Llama model (the only weights not in a matrix).
fn norm_bytes(m: &Model) -> usize {
    let c = m.config();
    4 * (2 * c.num_hidden_layers + 1) * c.hidden_size
}

/// Every run of `m` over [`IDS`] gives the bits of the exact path on the safetensors
/// model the GGUF was made from.
fn assert_same_bits_as_safetensors(m: &Model, tiny: &str, label: &str) {
    let st = Model::load(&testdata().join("tiny").join(tiny)).unwrap();
    let want = run_in_chunks(&st, &IDS, &[IDS.len()]);
    for chunks in CHUNKS {
        let got = run_in_chunks(m, &IDS, chunks);
        let max = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            same_bits(&want, &got),
            "{label}, chunks {chunks:?}: logits differ from the safetensors exact path (max|Δ| {max:e})"
        );
    }
    // The head on its own, as a session's logits call it.
    let c = m.config();
    let normed: Vec<f32> = (0..2 * c.hidden_size)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    assert!(
        same_bits(
            &st.logits_from_normed(&normed),
            &m.logits_from_normed(&normed)
        ),
        "{label}: logits_from_normed differs"
    );
}

/// Native mode reads every matrix of an aligned F32 file as the file stores it, copied
/// once at load: it holds the file's matrix bytes and the norms, reads the same bytes
/// per token as the exact path, and its logits
/// (prefill, decode, mixed; 1 and 2 threads) are the exact path's bits, the llama Q/K
/// row order undone on the products' outputs.
fn native_borrows_and_matches(file: &str, tiny: &str, matrices: usize) {
    let path = gguf(file);
    let exact = Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut native = Model::load_with(&path, WeightMode::Native).unwrap();
    assert!(native.quantized_types().is_empty());
    assert_eq!(native.mapped_f32_matrices(), matrices, "{file}");
    assert_eq!(exact.mapped_f32_matrices(), 0);
    // One copy of the file's matrix bytes (the same size as the exact path's f32
    // matrices, F32 being F32) and the norms ...
    let matrix_bytes = exact.owned_weight_bytes() - norm_bytes(&exact);
    let file_bytes: usize = GgufFile::open(&path)
        .unwrap()
        .tensors()
        .iter()
        .filter(|t| t.shape_hf().len() == 2)
        .map(|t| 4 * t.n_elements as usize)
        .sum();
    assert_eq!(native.copied_weight_bytes(), file_bytes, "{file}");
    assert_eq!(native.copied_weight_bytes(), matrix_bytes, "{file}");
    assert_eq!(
        native.owned_weight_bytes(),
        norm_bytes(&native) + matrix_bytes,
        "{file}"
    );
    // ... read once per token.
    assert_eq!(native.weight_bytes(), exact.weight_bytes());
    println!(
        "{file}: native holds {} B of weights (exact {} B), {matrices} matrices in the file's layout",
        native.owned_weight_bytes(),
        exact.owned_weight_bytes()
    );
    assert_same_bits_as_safetensors(&exact, tiny, &format!("{file} exact"));
    for th in [1, 2] {
        native.set_threads(Threads::new(th));
        assert_same_bits_as_safetensors(&native, tiny, &format!("{file} native, {th} threads"));
    }
}

#[test]
fn native_f32_gguf_untied_is_read_as_stored_with_exact_bits() {
    // 3 layers × 7 matrices, the embedding and the untied lm_head.
    native_borrows_and_matches("llama-untied.f32.gguf", "llama-untied", 3 * 7 + 2);
}

#[test]
fn native_f32_gguf_tied_is_read_as_stored_with_exact_bits() {
    // 2 layers × 7 matrices and the tied embedding (also the head).
    native_borrows_and_matches("llama-tied.f32.gguf", "llama-tied", 2 * 7 + 1);
}

/// A file whose F32 data is not 4-byte aligned (`general.alignment` 2, data section at
/// 2 mod 4) cannot be read as `&[f32]` in place: native mode copies it as the exact path
/// does, without an error or a panic, and gives the same bits.
#[test]
fn native_f32_gguf_misaligned_is_copied_with_exact_bits() {
    let path = gguf("llama-tied.f32.align2.gguf");
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.alignment(), 2);
    for t in g.tensors() {
        // A mapped file starts on a page boundary, so the data's address is 2 mod 4.
        assert_eq!((g.data_start() + t.offset) % 4, 2, "{}", t.name);
        assert!(g.tensor_f32_in_place(t).is_none(), "{}", t.name);
    }
    let exact = Model::load(&path).unwrap();
    let native = Model::load_with(&path, WeightMode::Native).unwrap();
    assert_eq!(native.mapped_f32_matrices(), 0);
    assert_eq!(native.owned_weight_bytes(), exact.owned_weight_bytes());
    assert_same_bits_as_safetensors(&native, "llama-tied", "misaligned native");
}

/// OLMo 2's F32 GGUF (gguf-py, llama.cpp's `olmo2` names and keys; transformers cannot
/// load it, so the witness is the HF-written safetensors model it was made from, itself
/// proven against HF in `tests/tiny_oracle.rs`): read through the family's GGUF mapping,
/// exact and native give that model's bits.
#[test]
fn olmo2_f32_gguf_gives_the_safetensors_bits() {
    let path = gguf("olmo2.f32.gguf");
    let exact = Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(exact.config().family, fak_model::Family::Olmo2);
    let mut native = Model::load_with(&path, WeightMode::Native).unwrap();
    // 2 layers × 7 matrices, the embedding and the untied lm_head.
    assert_eq!(native.mapped_f32_matrices(), 2 * 7 + 2);
    assert_same_bits_as_safetensors(&exact, "olmo2", "olmo2 exact");
    for th in [1, 2] {
        native.set_threads(Threads::new(th));
        assert_same_bits_as_safetensors(&native, "olmo2", &format!("olmo2 native, {th} threads"));
    }
}

/// Phi-3's F32 GGUF (gguf-py, llama.cpp's `phi3` names and keys: fused `attn_qkv` and
/// `ffn_up`, the longrope factors as tensors, the window and attention factor as keys;
/// transformers loads its parameters but ignores its RoPE scaling and window, so the
/// witness is the HF-written safetensors model it was made from, proven against HF in
/// `tests/tiny_oracle.rs`): exact and native give that model's bits, the fused matrices
/// split by rows (in native mode each part copied at load from its rows of the file).
#[test]
fn phi3_f32_gguf_gives_the_safetensors_bits() {
    let path = gguf("phi3.f32.gguf");
    let exact = Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = Model::load(&testdata().join("tiny/phi3")).unwrap();
    assert_eq!(exact.config(), st.config());
    let mut native = Model::load_with(&path, WeightMode::Native).unwrap();
    // 2 layers × 7 row views (q, k, v of attn_qkv; gate, up of ffn_up; o; down), the
    // embedding and the untied lm_head.
    assert_eq!(native.mapped_f32_matrices(), 2 * 7 + 2);
    assert_same_bits_as_safetensors(&exact, "phi3", "phi3 exact");
    for th in [1, 2] {
        native.set_threads(Threads::new(th));
        assert_same_bits_as_safetensors(&native, "phi3", &format!("phi3 native, {th} threads"));
    }
}

/// An F16 GGUF (gguf-py, as llama.cpp's converter writes `--outtype f16`: every matrix
/// F16, the norms F32; transformers' GGUF loader reads it back to the safetensors
/// model's parameters with every matrix rounded to f16, oracle-export/README.md): native
/// mode keeps every matrix as F16, as the file stores it (copied once at load), half the
/// bytes a token of the exact path's widened copy, and its logits (prefill, decode,
/// mixed; 1 and 2 threads) and its head (full and by rows) are the exact path's bits, the
/// kernels widening each value as they load it.
#[test]
fn native_f16_gguf_is_read_as_stored_with_exact_bits() {
    let path = gguf("llama-untied.f16.gguf");
    let g = GgufFile::open(&path).unwrap();
    let f16 = g
        .tensors()
        .iter()
        .filter(|t| g.tensor_f16_in_place(t).is_some())
        .count();
    let exact = Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut native = Model::load_with(&path, WeightMode::Native).unwrap();
    // 3 layers × 7 matrices, the embedding and the untied lm_head: every F16 tensor.
    assert_eq!(native.mapped_f16_matrices(), 3 * 7 + 2);
    assert_eq!(f16, 3 * 7 + 2);
    assert_eq!(native.mapped_f32_matrices(), 0);
    assert!(native.quantized_types().is_empty());
    assert_eq!(exact.mapped_f16_matrices(), 0);
    // The model holds the norms and the file's F16 matrices, and reads each matrix in
    // half the bytes.
    let norms = norm_bytes(&exact);
    assert_eq!(
        native.owned_weight_bytes(),
        norms + native.copied_weight_bytes()
    );
    assert_eq!(
        2 * (native.weight_bytes() - norms),
        exact.weight_bytes() - norms
    );
    // The control: the f16 rounding is real, so these are not the f32 model's logits.
    let st = Model::load(&testdata().join("tiny").join("llama-untied")).unwrap();
    let want = run_in_chunks(&exact, &IDS, &[IDS.len()]);
    assert!(!same_bits(&want, &run_in_chunks(&st, &IDS, &[IDS.len()])));
    let c = exact.config();
    let normed: Vec<f32> = (0..c.hidden_size)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let head = exact.logits_from_normed(&normed);
    let rows: Vec<u32> = vec![0, 5, 77, 255];
    for th in [1, 2] {
        native.set_threads(Threads::new(th));
        for chunks in CHUNKS {
            let got = run_in_chunks(&native, &IDS, chunks);
            assert!(
                same_bits(&want, &got),
                "native F16, {th} threads, chunks {chunks:?}: logits differ from the exact path"
            );
        }
        assert!(same_bits(&head, &native.logits_from_normed(&normed)));
        let some = native.logits_rows_from_normed(&normed, &rows).unwrap();
        for &r in &rows {
            assert_eq!(
                some[r as usize].to_bits(),
                head[r as usize].to_bits(),
                "row {r}"
            );
        }
    }
}
