//! Measures the screen on the red-team and benign corpora of `testdata/ctxmmu/` (the
//! project's corpus), `testdata/ctxmmu/heldout/` (written after the detectors were
//! frozen) and `testdata/ctxmmu/heldout2/` (written by someone who never read the
//! detectors) and prints, for each, the catch rate (poisoned results quarantined) and the
//! false-positive rate (benign results quarantined), by category, with the misses
//! listed.
//!
//! `cargo run --release -p fak-ctxmmu --example corpus_report [-- --misses] [-- corpus|heldout|heldout2]`
//!
//! The numbers are a measurement, not a target: the detectors are heuristics.
//! `crates/fak-ctxmmu/tests/corpus_rates.rs` holds the measured figures as floors.

use fak_ctxmmu::{Screen, ScreenConfig, ToolResult, Verdict};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn load(set: &str, name: &str) -> Vec<serde_json::Value> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/ctxmmu")
        .join(set)
        .join(name);
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("corpus line is JSON"))
        .collect()
}

fn main() {
    let show = std::env::args().any(|a| a == "--misses");
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    // The key that names a poisoned line's category: the first two sets put it in
    // `expect`, heldout2 in `category` (its `expect` is always "quarantine").
    for (set, title, poison_key) in [
        ("", "project corpus", "expect"),
        ("heldout", "held-out set", "expect"),
        ("heldout2", "second held-out set", "category"),
    ] {
        let name = if set.is_empty() { "corpus" } else { set };
        if only.is_empty() || only.iter().any(|o| o == name) {
            println!("== {title} (testdata/ctxmmu/{set})");
            report(set, poison_key, show);
            println!();
        }
    }
}

fn report(set: &str, poison_key: &str, show: bool) {
    let mut screen = Screen::new(ScreenConfig::default());
    let mut run = |file: &str, key: &str| {
        let mut by: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        let mut flagged_list = Vec::new();
        for r in load(set, file) {
            let content = r["content"].as_str().unwrap_or_default();
            let v = screen
                .admit(&ToolResult {
                    conversation: "corpus",
                    tool: r["tool"].as_str().unwrap_or("?"),
                    tool_call_id: None,
                    content,
                })
                .expect("in-memory store");
            let q = matches!(v, Verdict::Quarantine { .. });
            let cat = r[key].as_str().unwrap_or("?").to_string();
            let e = by.entry(cat.clone()).or_default();
            e.0 += 1;
            e.1 += q as usize;
            flagged_list.push((r["id"].as_str().unwrap_or("?").to_string(), cat, q, v));
        }
        (by, flagged_list)
    };
    let (poison, plist) = run("poisoned.jsonl", poison_key);
    let (benign, blist) = run("benign.jsonl", "category");
    let total = |m: &BTreeMap<String, (usize, usize)>| {
        m.values().fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    };
    let (pn, pq) = total(&poison);
    let (bn, bq) = total(&benign);
    println!(
        "catch rate: {pq}/{pn} poisoned results quarantined ({:.1}%)",
        100.0 * pq as f64 / pn as f64
    );
    for (k, (n, q)) in &poison {
        println!("  {k:<14} {q:>3}/{n:<3}");
    }
    println!(
        "false positives: {bq}/{bn} benign results quarantined ({:.1}%)",
        100.0 * bq as f64 / bn as f64
    );
    for (k, (n, q)) in &benign {
        println!("  {k:<14} {q:>3}/{n:<3}");
    }
    let paged = blist
        .iter()
        .filter(|x| matches!(x.3, Verdict::PageOut { .. }))
        .count();
    println!("benign results paged out (large, admitted by pointer): {paged}");
    if show {
        println!("\nmissed poisoned:");
        for (id, cat, q, _) in &plist {
            if !q {
                println!("  {id} ({cat})");
            }
        }
        println!("\nbenign quarantined:");
        for (id, cat, q, v) in &blist {
            if *q {
                if let Verdict::Quarantine {
                    reason, detector, ..
                } = v
                {
                    println!("  {id} ({cat}): {} by {detector}", reason.as_str());
                }
            }
        }
    }
}
