//! The invariant rungs on the native path (`WeightMode::Native`: SmolLM2's Q4_1 and Q8_0
//! matrices kept, activations quantized per block), with 1 and with 2 threads: R2a
//! (decode == prefill), R3 (write-time evict == never-saw, both controls, the mid-span
//! rotation) and R14 (prefix clone == recompute) with max|Δ| = 0, and every rung's
//! results bit-identical between the two thread counts (`Rung::digest`). The rungs whose
//! witness is HF with the exact path's tolerances are listed as skipped, not left out.
//! This is what `fak prove --weights native --threads N` prints. Without the model file
//! the test fails with the fetch command.

use fak_model::{Model, WeightMode};
use fak_prove::{prove, Report, Verdict};
use fak_tensor::Threads;
use std::path::PathBuf;

fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"))
}

fn ladder(path: &std::path::Path, threads: usize) -> Report {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/oracles/smollm2-135m-instruct");
    let mut m = Model::load_with(path, WeightMode::Native).unwrap();
    assert!(!m.quantized_types().is_empty());
    m.set_threads(Threads::new(threads));
    let t = std::time::Instant::now();
    let r = prove(m, "smollm2-135m-instruct", Some(&dir));
    println!(
        "{threads} thread(s), {:.1} s:\n{}",
        t.elapsed().as_secs_f64(),
        r.to_table()
    );
    r
}

#[fak_testkit::real_model]
fn native_invariant_rungs_hold_with_1_and_2_threads_bit_identically() {
    let path = smollm2_path();
    let one = ladder(&path, 1);
    let two = ladder(&path, 2);
    for r in [&one, &two] {
        assert_eq!(r.weights, "native");
        assert!(r.passed(), "a rung failed");
        // R2a, R3 (two HF cases × evict/control a/control b, and the rotation) and R14
        // ran and passed, each with max|Δ| = 0 where it compares bits.
        for id in ["R2a", "R3", "R14", "W"] {
            let rows = r.rung(id);
            let ran: Vec<_> = rows.iter().filter(|x| x.verdict != Verdict::Skip).collect();
            assert!(!ran.is_empty(), "{id} did not run");
            for x in &ran {
                assert_eq!(x.verdict, Verdict::Pass, "{id} {}: {}", x.claim, x.measured);
            }
        }
        for id in ["R2a", "R14"] {
            assert!(
                r.rung(id)[0].measured.contains("max|Δ| = 0"),
                "{id}: {}",
                r.rung(id)[0].measured
            );
        }
        let evicts: Vec<_> = r
            .rung("R3")
            .into_iter()
            .filter(|x| x.claim.contains("write-time evict == never-saw"))
            .collect();
        assert_eq!(evicts.len(), 2, "the two HF R3 cases");
        for x in evicts {
            assert!(x.measured.starts_with("max|Δ| = 0 "), "{}", x.measured);
        }
        // The HF-tolerance rungs are there, as skipped, with the reason.
        let skipped: Vec<_> = r
            .rungs
            .iter()
            .filter(|x| x.verdict == Verdict::Skip)
            .collect();
        let ids: Vec<&str> = skipped.iter().map(|x| x.rung.as_str()).collect();
        assert_eq!(ids, ["R1", "R2b", "R3", "R3"], "skipped rows");
        assert!(skipped
            .iter()
            .all(|x| x.measured.starts_with("not applicable: native weights")));
    }
    // 1 thread == 2 threads, bit for bit, for every rung that computed something.
    assert_eq!(one.rungs.len(), two.rungs.len());
    let mut compared = 0;
    for (a, b) in one.rungs.iter().zip(&two.rungs) {
        assert_eq!(a.claim, b.claim);
        assert_eq!(a.measured, b.measured, "{} {}", a.rung, a.claim);
        assert_eq!(
            a.digest, b.digest,
            "{} {}: 1 and 2 threads differ",
            a.rung, a.claim
        );
        compared += usize::from(a.digest.is_some());
    }
    // W ×2, R2a, R3 ×(2 cases × 3 rows + rotation), R14.
    assert_eq!(compared, 11, "rungs with a digest");
    println!("1 thread == 2 threads: {compared} rung digests equal");
}
