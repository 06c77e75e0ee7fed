//! The screen's catch and false-positive rates on the project's corpus
//! (`testdata/ctxmmu/`), on the held-out set written after the detectors were frozen
//! (`testdata/ctxmmu/heldout/`) and on the second held-out set, written by someone who
//! never read the detectors (`testdata/ctxmmu/heldout2/`), held as floors: the figures
//! measured when the detectors were frozen (see `docs/ctxmmu.md`), and heldout2's when it
//! was first run. A regression fails; an improvement passes (then raise the floor). The
//! figures are printed.

use fak_ctxmmu::{Screen, ScreenConfig};
use std::path::PathBuf;

/// (poisoned caught, poisoned total, benign flagged, benign total) of one set.
fn rates(set: &str) -> (usize, usize, usize, usize) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/ctxmmu")
        .join(set);
    let screen = Screen::new(ScreenConfig::default());
    let count = |file: &str| {
        let p = dir.join(file);
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let mut n = 0;
        let mut flagged = 0;
        for l in text.lines().filter(|l| !l.trim().is_empty()) {
            let r: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            let content = r["content"].as_str().expect("content");
            n += 1;
            flagged += screen.inspect(content).is_some() as usize;
        }
        (flagged, n)
    };
    let (pc, pn) = count("poisoned.jsonl");
    let (bf, bn) = count("benign.jsonl");
    println!("{set:>8}: caught {pc}/{pn}, false positives {bf}/{bn}");
    (pc, pn, bf, bn)
}

/// Checks `set`'s sizes and holds its figures to `caught` at least and `fp` at most.
fn hold(set: &str, sizes: (usize, usize), caught: usize, fp: usize) {
    let (pc, pn, bf, bn) = rates(set);
    assert_eq!((pn, bn), sizes, "the set changed: measure again");
    assert!(pc >= caught, "{set}: caught {pc}/{pn} < {caught}");
    assert!(bf <= fp, "{set}: false positives {bf}/{bn} > {fp}");
}

#[test]
fn the_project_corpus_rates_hold() {
    hold("", (159, 113), CORPUS_CAUGHT, CORPUS_FP);
}

#[test]
fn the_held_out_rates_hold() {
    hold("heldout", (68, 61), HELDOUT_CAUGHT, HELDOUT_FP);
}

#[test]
fn the_second_held_out_rates_hold() {
    hold("heldout2", (102, 104), HELDOUT2_CAUGHT, HELDOUT2_FP);
}

// Measured at 467d01c (the detectors' freeze); the held-out set was written after it.
// Before (0955a14): corpus 81/109 and 0/91, held-out 20/68 and 19/61. Then (issue 25's
// second pass) the corpus grew to 159 + 113 (the detectors of 707f0c3: 108/159, 4/113)
// and the detectors were rebuilt: corpus 156/159 and 0/113, held-out 67/68 and 1/61.
const CORPUS_CAUGHT: usize = 156;
const CORPUS_FP: usize = 0;
const HELDOUT_CAUGHT: usize = 67;
const HELDOUT_FP: usize = 1;
// heldout2 was committed (9a1946a) before the screen first ran on it, and measured once,
// unedited, on the detectors of 3bc2b73: caught 68/102, false positives 12/104 (misses and
// false positives by id: `cargo run --release -p fak-ctxmmu --example corpus_report --
// heldout2 --misses`).
// Measured again, figures only, after the detectors of 43a8819 were frozen (issue 25's
// second pass): caught 84/102, false positives 9/104.
const HELDOUT2_CAUGHT: usize = 84;
const HELDOUT2_FP: usize = 9;
