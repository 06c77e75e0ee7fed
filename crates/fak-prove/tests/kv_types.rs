//! The invariant rungs on the compact kv types (`f16`, `q8_0`: K before RoPE and V
//! rounded when written, keys rotated at read), on the real SmolLM2 and Gemma 3 with
//! exact and native weights: R2a (decode == prefill), R3 (write-time evict ==
//! never-saw, both controls, the renumbered survivors), R14 (prefix clone ==
//! recompute) and W (a window wider than the sequence == causal), each at max|Δ| = 0.
//! On Gemma 3 the same claims are also checked on a sequence longer than its sliding
//! window (512), so its sliding layers and its global layers both read the compact
//! cache past the window's edge. Without the model files these fail with the fetch
//! command.

use fak_kv::{KvType, Session};
use fak_model::{Model, WeightMode};
use fak_prove::ladder::{cache_max_abs_diff, max_abs_diff, synthetic_ids};
use fak_prove::{prove_kv, Report, Verdict};
use std::path::PathBuf;
use std::sync::Arc;

const COMPACT: [KvType; 2] = [KvType::F16, KvType::Q8_0];

fn model_path(name: &str) -> PathBuf {
    fak_catalog::require_cached(name).unwrap_or_else(|m| panic!("{m}"))
}

fn oracle_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/oracles")
        .join(name)
}

/// Every invariant rung ran and passed at max|Δ| = 0; the HF rungs are skipped.
fn check(r: &Report, kv: KvType) {
    println!(
        "{} {} kv {}:\n{}",
        r.model,
        r.weights,
        r.kv_type,
        r.to_table()
    );
    assert_eq!(r.kv_type, kv.name());
    assert!(r.passed(), "a rung failed");
    for id in ["R2a", "R3", "R14", "W"] {
        let ran: Vec<_> = r
            .rung(id)
            .into_iter()
            .filter(|x| x.verdict != Verdict::Skip)
            .collect();
        assert!(!ran.is_empty(), "{id} did not run");
        assert!(ran.iter().all(|x| x.verdict == Verdict::Pass));
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
    assert!(!evicts.is_empty());
    for x in evicts {
        assert!(x.measured.starts_with("max|Δ| = 0 "), "{}", x.measured);
    }
    assert!(r
        .rung("R3")
        .iter()
        .any(|x| x.claim.contains("positions renumbered") && x.verdict == Verdict::Pass));
    assert!(r
        .rungs
        .iter()
        .all(|x| x.verdict != Verdict::Skip || x.measured.starts_with("not applicable: ")));
}

fn ladder(name: &str, mode: WeightMode) {
    let path = model_path(name);
    for kv in COMPACT {
        let m = Model::load_with(&path, mode).unwrap();
        check(&prove_kv(m, name, Some(&oracle_dir(name)), kv), kv);
    }
}

#[fak_testkit::real_model]
fn smollm2_exact_invariants_hold_on_every_compact_kv_type() {
    ladder("smollm2-135m-instruct", WeightMode::Exact);
}

#[fak_testkit::real_model]
fn smollm2_native_invariants_hold_on_every_compact_kv_type() {
    ladder("smollm2-135m-instruct", WeightMode::Native);
}

#[fak_testkit::real_model]
fn gemma3_native_invariants_hold_on_every_compact_kv_type() {
    ladder("gemma3-270m", WeightMode::Native);
}

#[fak_testkit::real_model]
fn gemma3_exact_invariants_hold_on_every_compact_kv_type() {
    ladder("gemma3-270m", WeightMode::Exact);
}

/// Past Gemma 3's 512-token sliding window, on each compact type: decode == prefill,
/// write-time evict == never-saw and prefix clone == recompute, bit for bit, and the
/// compact cache is not the f32 one (non-vacuous: its rows are rounded).
#[fak_testkit::real_model]
fn gemma3_past_its_sliding_window_keeps_the_invariants_on_compact_kv_types() {
    for mode in [WeightMode::Native, WeightMode::Exact] {
        past_the_window(mode);
    }
}

fn past_the_window(mode: WeightMode) {
    let m = Arc::new(Model::load_with(&model_path("gemma3-270m"), mode).unwrap());
    let window = m.config().sliding_window.iter().flatten().copied().min();
    assert_eq!(window, Some(512), "Gemma 3 270M's sliding layers");
    assert!(
        m.config().sliding_window.iter().any(Option::is_none),
        "and global layers"
    );
    let vocab = m.config().vocab_size;
    let mut ids = vec![2u32];
    ids.extend(synthetic_ids(560, vocab, 7));
    let n = ids.len();
    let (prefix, poison, query) = (&ids[..520], &synthetic_ids(9, vocab, 9), &ids[520..n - 4]);
    for kv in COMPACT {
        let new = || Session::with_kv_type(Arc::clone(&m), n + 16, kv).unwrap();
        // decode == prefill: 4 decode steps after the sequence's start.
        let mut inc = new();
        let mut logits = vec![inc.prefill(&ids[..n - 4]).unwrap()];
        for &id in &ids[n - 4..] {
            logits.push(inc.step(id).unwrap());
        }
        let mut full = new();
        let all = full.prefill_all_logits(&ids).unwrap();
        let mut d = cache_max_abs_diff(inc.cache(), full.cache());
        for (i, l) in logits.iter().enumerate() {
            let row = n - 5 + i;
            d = d.max(max_abs_diff(l, &all[row * vocab..(row + 1) * vocab]));
        }
        assert_eq!(d, 0.0, "{kv}: decode != prefill past the window");
        assert!(inc.cache() == full.cache());
        // write-time evict == never-saw, the poison past the window's edge.
        let mut ev = new();
        ev.prefill(prefix).unwrap();
        ev.prefill(poison).unwrap();
        ev.evict(prefix.len(), poison.len()).unwrap();
        let ev_logits = ev.prefill(query).unwrap();
        let mut ns = new();
        ns.prefill(prefix).unwrap();
        let ns_logits = ns.prefill(query).unwrap();
        assert_eq!(
            max_abs_diff(&ev_logits, &ns_logits),
            0.0,
            "{kv}: evict != never-saw"
        );
        assert!(ev.cache() == ns.cache());
        // prefix clone == recompute.
        let mut head = new();
        head.prefill(&ids[..300]).unwrap();
        let cloned = Session::from_prefix(&head, &ids[300..]).unwrap();
        assert_eq!(cloned.positions_computed(), (n - 300) as u64);
        assert_eq!(
            max_abs_diff(cloned.last_logits().unwrap(), &all[(n - 1) * vocab..]),
            0.0,
            "{kv}: from_prefix != recompute"
        );
        assert!(cloned.cache() == full.cache());
        // Non-vacuous: the compact cache's logits are not the f32 cache's.
        let mut f32s = Session::with_capacity(Arc::clone(&m), n);
        let f = f32s.prefill(&ids).unwrap();
        let dq = max_abs_diff(&f, &all[(n - 1) * vocab..]);
        assert!(dq > 0.0, "{kv}: the same logits as the f32 cache");
        println!("{} {kv}: past the window, invariants at max|Δ| = 0; last logits vs f32 cache max|Δ| {dq:.3e}", mode.name());
    }
}
