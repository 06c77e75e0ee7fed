//! The whole ladder on the tiny random-init models (testdata/tiny) with their HF oracles,
//! and a garbage oracle failing its rung. (The window proofs that need an independent
//! reference, the bounded mode and bad input are fak-kv's, in its `tests/tiny.rs`.)

use fak_model::Model;
use fak_prove::{prove, Verdict};
use std::path::PathBuf;

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

fn tiny(name: &str) -> Model {
    Model::load(&testdata().join("tiny").join(name)).unwrap()
}

/// The whole ladder on every tiny model (Llama tied/untied, Qwen2, Qwen3, Gemma 3 with
/// its sliding and global layers and their own RoPE bases, OLMo 2), with their HF oracles (R1,
/// R2b, and R3 against HF where eviction oracles exist, else against our never-saw run):
/// every rung passes, including the mid-span eviction whose survivors' K must equal one
/// rotation under their own layer's base.
#[test]
fn ladder_passes_on_tiny_models() {
    for name in [
        "llama-tied",
        "llama-untied",
        "qwen2",
        "qwen3",
        "gemma3",
        "olmo2",
    ] {
        let dir = testdata().join("oracles").join(format!("tiny-{name}"));
        let report = prove(tiny(name), name, Some(&dir));
        println!("{}", report.to_table());
        for r in &report.rungs {
            assert_eq!(
                r.verdict,
                Verdict::Pass,
                "{name}: {} {} — {}",
                r.rung,
                r.claim,
                r.measured
            );
        }
        for id in ["R1", "R2b", "R2a", "R3", "R14", "W"] {
            assert!(!report.rung(id).is_empty(), "{name}: rung {id} missing");
        }
    }
}

/// The whole ladder on the tiny Phi-3 (fused projections, longrope, a window of 16 on
/// every layer) with all its HF oracles: the rand prompts and the r3 eviction cases
/// within the original context, long64 and cross40 past it.
#[test]
fn ladder_passes_on_tiny_phi3() {
    let src = testdata().join("oracles/tiny-phi3");
    let report = prove(tiny("phi3"), "phi3", Some(&src));
    println!("{}", report.to_table());
    for r in &report.rungs {
        assert_eq!(
            r.verdict,
            Verdict::Pass,
            "phi3: {} {} — {}",
            r.rung,
            r.claim,
            r.measured
        );
    }
    for id in ["R1", "R2b", "R2a", "R3", "R14", "W"] {
        assert!(!report.rung(id).is_empty(), "phi3: rung {id} missing");
    }
}

/// A garbage oracle file is a failed rung naming the file, never silently skipped; a
/// missing R3 field likewise.
#[test]
fn prove_fails_on_unreadable_oracles() {
    let src = testdata().join("oracles/tiny-llama-tied");
    let dir = tempfile::tempdir().unwrap();
    for f in ["rand7.safetensors", "rand12.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(dir.path().join("rand12.safetensors"), b"garbage").unwrap();
    std::fs::create_dir(dir.path().join("r3")).unwrap();
    std::fs::write(dir.path().join("r3/bad.safetensors"), b"garbage").unwrap();
    let report = prove(tiny("llama-tied"), "tiny", Some(dir.path()));
    assert!(!report.passed());
    let failed: Vec<_> = report
        .rungs
        .iter()
        .filter(|r| r.verdict == Verdict::Fail)
        .collect();
    assert!(
        failed
            .iter()
            .any(|r| r.rung == "R1" && r.measured.contains("rand12")),
        "{failed:?}"
    );
    assert!(
        failed
            .iter()
            .any(|r| r.rung == "R3" && r.measured.contains("bad.safetensors")),
        "{failed:?}"
    );
    // No synthetic stand-in when the R3 folder exists but its files are bad.
    assert!(!report.rungs.iter().any(|r| r.claim.contains("[synthetic]")));
}
