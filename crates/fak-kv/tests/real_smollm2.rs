//! The proof ladder on the real default model, SmolLM2-135M-Instruct: R1/R2b against
//! HF, R2a, R3 against HF's never-saw greedy continuation (with both negative controls),
//! R14 and the window rungs. Without the model file this fails with the fetch command
//! (`FAK_SKIP_REAL_MODEL=1` opts out locally, never in CI).

use fak_kv::prove::{prove, Verdict};
use fak_model::{catalog, Model};
use std::path::PathBuf;

fn smollm2_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        return Some(PathBuf::from(p));
    }
    if let Some(p) = catalog::cached("smollm2-135m-instruct") {
        return Some(p);
    }
    if std::env::var("FAK_SKIP_REAL_MODEL").as_deref() == Ok("1") && std::env::var("CI").is_err() {
        eprintln!("NOTE: FAK_SKIP_REAL_MODEL=1: real-model test NOT RUN");
        return None;
    }
    panic!("the real model is not cached; fetch it with: cargo run --release -p fak-cli -- model pull smollm2-135m-instruct");
}

#[test]
fn ladder_passes_on_smollm2_with_hf_witnesses() {
    let Some(path) = smollm2_path() else { return };
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/oracles/smollm2-135m-instruct");
    let r3_files = fak_model::oracle::oracle_files_in(&dir.join("r3")).unwrap_or_default();
    assert!(
        r3_files.len() >= 2,
        "R3 needs HF eviction oracles in {}/r3 (python oracle-export/export_oracle.py r3)",
        dir.display()
    );
    let report = prove(
        Model::load(&path).unwrap(),
        "smollm2-135m-instruct",
        Some(&dir),
    );
    println!("{}", report.to_table());
    for r in &report.rungs {
        assert_eq!(
            r.verdict,
            Verdict::Pass,
            "{} {} — {}",
            r.rung,
            r.claim,
            r.measured
        );
    }
    // R3 is witnessed by HF on the real model, not only by our own never-saw run.
    let hf_r3 = report
        .rung("R3")
        .iter()
        .filter(|r| r.witness.contains("HF"))
        .count();
    assert!(
        hf_r3 >= 2 * r3_files.len(),
        "R3 rows witnessed by HF: {hf_r3}"
    );
    for id in ["R1", "R2b", "R2a", "R14", "W"] {
        assert!(!report.rung(id).is_empty(), "rung {id} missing");
    }
}

/// Text generation that reaches the end of the context stops as `length` and keeps its
/// text (the tiny model's context of 256 tokens, with the real model's tokenizer).
#[test]
fn text_generation_stops_at_the_context_end() {
    use fak_kv::{generate_text, FinishReason, Session, TextParams};
    use std::sync::Arc;
    let Some(path) = smollm2_path() else { return };
    let g = fak_weights::GgufFile::open(&path).unwrap();
    let tok = fak_model::Tokenizer::from_gguf(&g).unwrap();
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tiny/llama-tied");
    let m = Arc::new(Model::load(&tiny).unwrap());
    let mut s = Session::new(m);
    let params = TextParams {
        sampling: Default::default(),
        max_tokens: 100,
        stop: vec![],
        stop_ids: vec![],
    };
    let out = generate_text(&mut s, &tok, &[40; 250], &params, None, &mut |_| {}).unwrap();
    assert_eq!(out.finish_reason, FinishReason::Length);
    assert_eq!(
        out.completion_ids.len(),
        7,
        "250 prompt + 6 run + 1 sampled"
    );
    assert_eq!(s.len(), 256);
    assert!(!out.text.is_empty());
}
