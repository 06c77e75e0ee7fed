//! The proof ladder on the real default model, SmolLM2-135M-Instruct: R1/R2b against
//! HF, R2a, R3 against HF's never-saw greedy continuation (with both negative controls),
//! R14 and the window rungs. Without the model file this fails with the fetch command
//! (`FAK_SKIP_REAL_MODEL=1` reports it as ignored, never in CI).

use fak_model::Model;
use fak_prove::{prove, Verdict};
use std::path::PathBuf;

fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"))
}

#[fak_testkit::real_model]
fn ladder_passes_on_smollm2_with_hf_witnesses() {
    let path = smollm2_path();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/oracles/smollm2-135m-instruct");
    let r3_files = fak_prove::oracle::oracle_files_in(&dir.join("r3")).unwrap_or_default();
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
