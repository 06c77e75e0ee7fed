//! The rung ladder of `docs/design.md`, run on a model a user has: what `fak prove` prints.
//!
//! Each rung measures one claim against a witness and gives a verdict:
//!
//! | rung | claim | witness |
//! |---|---|---|
//! | R1 | embedding exact, layer cosine >= 0.999999, logits max\|Δ\| <= 1e-4, argmax equal | HF oracle files (when present) |
//! | R2b | greedy continuation equal | HF `generate` (oracle files) |
//! | R2a | prefill + 4 decode steps == prefill of all (cache and logits) | the R1-proven prefill |
//! | R3 | write-time eviction == never-saw; negative controls | HF greedy of the never-saw sequence (R3 oracle files) and our own never-saw run |
//! | R3-rot | every moved survivor's K == one rotation of its k_raw at its new position | `Model::rope_in_place` |
//! | R14 | `from_prefix` == full recompute, prefix not recomputed | the R2a-proven recompute |
//! | W | sliding-window boundary table; wide window == causal; narrow window changes output | definition / full causal run |
//!
//! On a model loaded with [`WeightMode::Native`] and quantized matrices, the rungs whose
//! witness is HF with the exact path's tolerances (R1, R2b, and R3's comparisons with HF's
//! continuations and logits) do not apply: 8-bit activations move the logits by more than
//! 1e-4 and can flip near-tied greedy choices. They are listed with the verdict
//! [`Verdict::Skip`] and the reason, never left out. The invariants (R2a, R3 against our
//! own never-saw run with its controls, R3-rot, R14, W) apply to both paths unchanged.
//!
//! Each rung that computed something also records a [`Rung::digest`] of the bits it
//! compared, so two runs (say with 1 and 2 threads) can be checked for identical results.

use crate::oracle::{measure, oracle_files_in, Oracle};
use fak_kv::{GenerateParams, KvCache, Session};
use fak_model::{window_start, KvType, Model, WeightMode};
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;

/// A rung's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The claim holds.
    Pass,
    /// The claim does not hold (or could not be measured).
    Fail,
    /// The claim does not apply to this model as loaded (the measured column says why),
    /// e.g. an HF-tolerance rung on native weights.
    Skip,
}

/// One row of the report.
#[derive(Clone, Debug, Serialize)]
pub struct Rung {
    /// Rung id (`R2a`, ...).
    pub rung: String,
    /// What is claimed.
    pub claim: String,
    /// What it is checked against.
    pub witness: String,
    /// The figure measured (max|Δ|, agreement counts).
    pub measured: String,
    /// Pass, fail or skip.
    pub verdict: Verdict,
    /// FNV-1a (64-bit) of the bits the rung computed and compared (logits, cache,
    /// generated ids), as 16 hex digits; two runs of the same rung with the same digest
    /// produced identical results. None for rungs that computed nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// The whole ladder for one model.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The model proven (path or catalog name).
    pub model: String,
    /// How the model kept its weights: `exact` or `native`.
    pub weights: String,
    /// The type the rungs' caches stored their rows in (`f32`, `f16`, `q8_0`).
    pub kv_type: String,
    /// The rungs, in ladder order.
    pub rungs: Vec<Rung>,
}

impl Report {
    /// Whether no rung failed (a skipped rung does not apply, see [`Verdict::Skip`]).
    pub fn passed(&self) -> bool {
        self.rungs.iter().all(|r| r.verdict != Verdict::Fail)
    }

    /// The rung `id`'s rows.
    pub fn rung(&self, id: &str) -> Vec<&Rung> {
        self.rungs.iter().filter(|r| r.rung == id).collect()
    }

    /// A plain-text table: rung, claim, witness, measured, verdict.
    pub fn to_table(&self) -> String {
        let head = ["rung", "claim", "witness", "measured", "verdict"];
        let rows: Vec<[String; 5]> = self
            .rungs
            .iter()
            .map(|r| {
                [
                    r.rung.clone(),
                    r.claim.clone(),
                    r.witness.clone(),
                    r.measured.clone(),
                    match r.verdict {
                        Verdict::Pass => "pass".into(),
                        Verdict::Fail => "FAIL".into(),
                        Verdict::Skip => "skip".into(),
                    },
                ]
            })
            .collect();
        let mut w = head.map(str::len);
        for r in &rows {
            for (i, c) in r.iter().enumerate() {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::from("|");
            for (i, c) in cells.iter().enumerate() {
                s.push_str(&format!(" {c:<width$} |", width = w[i]));
            }
            s.push('\n');
            s
        };
        let mut out = format!("model: {}\n", self.model);
        if self.weights != "exact" {
            out = format!("model: {} ({} weights)\n", self.model, self.weights);
        }
        out.push_str(&line(&head.map(String::from)));
        let sep: Vec<String> = w.iter().map(|&n| "-".repeat(n)).collect();
        out.push_str(&line(&sep).replace(' ', "-"));
        for r in &rows {
            out.push_str(&line(r));
        }
        let count = |v: Verdict| self.rungs.iter().filter(|r| r.verdict == v).count();
        let skipped = count(Verdict::Skip);
        out.push_str(&format!(
            "{} of {} rungs pass\n",
            count(Verdict::Pass),
            self.rungs.len() - skipped
        ));
        if skipped > 0 {
            out.push_str(&format!(
                "{skipped} skipped: they do not apply to {} weights (see their rows)\n",
                self.weights
            ));
        }
        out
    }
}

fn rung(id: &str, claim: &str, witness: &str, measured: String, pass: bool) -> Rung {
    Rung {
        rung: id.into(),
        claim: claim.into(),
        witness: witness.into(),
        measured,
        verdict: if pass { Verdict::Pass } else { Verdict::Fail },
        digest: None,
    }
}

fn skip(id: &str, claim: &str, witness: &str, why: &str) -> Rung {
    Rung {
        rung: id.into(),
        claim: claim.into(),
        witness: witness.into(),
        measured: format!("not applicable: {why}"),
        verdict: Verdict::Skip,
        digest: None,
    }
}

/// Why the HF-tolerance rungs do not apply to native weights.
const NATIVE_SKIP: &str = "native weights: 8-bit activations move logits past HF's 1e-4 bound \
and can flip near-tied greedy steps; measured against the exact path instead (F-q, F-g)";

/// Why the HF-tolerance rungs do not apply to a compact kv type.
const KV_SKIP: &str = "compact kv type: K and V rounded to it move logits past HF's 1e-4 \
bound; measured against the f32 cache instead (kv_quality)";

/// FNV-1a, 64 bits, over a stream of words.
#[derive(Clone, Copy)]
struct Digest(u64);

impl Digest {
    fn new() -> Self {
        Digest(0xcbf2_9ce4_8422_2325)
    }
    fn word(mut self, w: u32) -> Self {
        for b in w.to_le_bytes() {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        self
    }
    fn f32s(self, v: &[f32]) -> Self {
        v.iter()
            .fold(self.word(v.len() as u32), |d, x| d.word(x.to_bits()))
    }
    fn u32s(self, v: &[u32]) -> Self {
        v.iter().fold(self.word(v.len() as u32), |d, &x| d.word(x))
    }
    fn cache(self, c: &KvCache) -> Self {
        (0..c.n_layers()).fold(self.u32s(c.positions()), |d, l| {
            d.f32s(&c.k(l).to_vec())
                .f32s(&c.k_raw(l).to_vec())
                .f32s(&c.v(l).to_vec())
        })
    }
    fn hex(self) -> Option<String> {
        Some(format!("{:016x}", self.0))
    }
}

fn with_digest(mut r: Rung, d: Digest) -> Rung {
    r.digest = d.hex();
    r
}

fn fail(id: &str, claim: &str, witness: &str, why: impl std::fmt::Display) -> Rung {
    rung(id, claim, witness, format!("error: {why}"), false)
}

/// Largest |a - b| over two equal-length slices, or infinity when lengths differ. Two
/// NaNs in the same place count as equal only if their bits are.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.to_bits() == y.to_bits() {
                0.0
            } else {
                let d = (x - y).abs();
                if d.is_nan() {
                    f32::INFINITY
                } else {
                    d
                }
            }
        })
        .fold(0f32, f32::max)
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Largest |Δ| between two caches over K, K before RoPE and V of every layer, or
/// infinity if their positions or shapes differ.
pub fn cache_max_abs_diff(a: &KvCache, b: &KvCache) -> f32 {
    if a.positions() != b.positions() || a.n_layers() != b.n_layers() || a.kv_type() != b.kv_type()
    {
        return f32::INFINITY;
    }
    (0..a.n_layers())
        .map(|l| {
            max_abs_diff(&a.k(l).to_vec(), &b.k(l).to_vec())
                .max(max_abs_diff(&a.k_raw(l).to_vec(), &b.k_raw(l).to_vec()))
                .max(max_abs_diff(&a.v(l).to_vec(), &b.v(l).to_vec()))
        })
        .fold(0f32, f32::max)
}

/// Deterministic token ids for rungs without an oracle: `n` ids spread over the
/// vocabulary (skipping the first 4 ids, which are usually special tokens).
pub fn synthetic_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let span = vocab.saturating_sub(4).max(1) as u64;
    (0..n as u64)
        .map(|i| {
            (4 + (i
                .wrapping_mul(7919)
                .wrapping_add(seed.wrapping_mul(104_729))
                % span)) as u32
        })
        .collect()
}

/// Runs the whole ladder. `oracle_dir` is the model's folder of HF oracle files
/// (`testdata/oracles/<name>`); without it R1/R2b are reported as failed-to-measure and
/// R3 uses synthetic ids against our own never-saw run only.
///
/// The model is taken by value because the window rungs set a window on it temporarily.
pub fn prove(model: Model, name: &str, oracle_dir: Option<&Path>) -> Report {
    prove_kv(model, name, oracle_dir, KvType::F32)
}

/// [`prove`] with every cache the rungs make storing its rows in `kv`. The invariant
/// rungs (R2a, R3's write-time eviction and controls, R14, W) hold on every type with
/// max|Δ| = 0; on a compact type the HF-tolerance rungs (R1, R2b, R3's HF rows) are
/// skipped, as on native weights: rounding K and V moves the logits past HF's bound
/// (the compact types' agreement with `f32` is measured by `fak-kv`'s `kv_quality`
/// example instead).
pub fn prove_kv(mut model: Model, name: &str, oracle_dir: Option<&Path>, kv: KvType) -> Report {
    let mut rungs = Vec::new();
    // Native weights with at least one quantized matrix (on an all-f32 model native mode
    // is the exact path, and every rung applies).
    let native = model.weight_mode() == WeightMode::Native && !model.quantized_types().is_empty();
    let approx = native || kv != KvType::F32;
    let why = if native { NATIVE_SKIP } else { KV_SKIP };
    // Every oracle file must load: a file that does not is a failed rung, never skipped.
    let mut bad_oracles = Vec::new();
    let mut oracles: Vec<Oracle> = Vec::new();
    if let Some(d) = oracle_dir {
        match oracle_files_in(d) {
            Ok(files) => {
                for f in files {
                    match Oracle::load(f) {
                        Ok(o) => oracles.push(o),
                        Err(e) => bad_oracles.push(e.to_string()),
                    }
                }
            }
            Err(e) => bad_oracles.push(e.to_string()),
        }
    }
    let vocab = model.config().vocab_size;
    let base_ids: Vec<u32> = oracles
        .first()
        .and_then(|o| o.ids("prompt_ids").ok())
        .filter(|ids| ids.len() >= 8)
        .unwrap_or_else(|| synthetic_ids(24, vocab, 1));

    rungs.extend(window_rungs(&mut model, &base_ids, kv));
    let model = Arc::new(model);
    for e in &bad_oracles {
        rungs.push(fail(
            "R1",
            "every HF oracle file loads",
            "HF oracle files",
            e,
        ));
    }
    if approx {
        let (c1, w1, c2, w2) = r1_texts();
        rungs.push(skip("R1", c1, w1, why));
        rungs.push(skip("R2b", c2, w2, why));
    } else {
        rungs.extend(r1_rungs(&model, &oracles, oracle_dir));
    }
    rungs.push(r2a(&model, &base_ids, approx, kv));
    rungs.extend(r3_rungs(&model, oracle_dir, (approx, why), kv));
    rungs.push(r3_rotation(&model, &base_ids, kv));
    rungs.push(r14(&model, &base_ids, kv));
    Report {
        model: name.to_string(),
        weights: match model.weight_mode() {
            WeightMode::Exact => "exact",
            WeightMode::Native => "native",
        }
        .to_string(),
        kv_type: kv.name().to_string(),
        rungs,
    }
}

/// R1's and R2b's claim and witness texts.
fn r1_texts() -> (&'static str, &'static str, &'static str, &'static str) {
    (
        "embedding exact; layer cosine >= 0.999999; logits max|Δ| <= 1e-4; argmax equal",
        "HF transformers forward (oracle files)",
        "16-token greedy continuation equal",
        "HF generate(do_sample=False)",
    )
}

fn r1_rungs(model: &Model, oracles: &[Oracle], dir: Option<&Path>) -> Vec<Rung> {
    let (c1, w1, c2, w2) = r1_texts();
    if oracles.is_empty() {
        let why = match dir {
            Some(d) => format!("no oracle files in {}", d.display()),
            None => "no oracle folder for this model".into(),
        };
        return vec![fail("R1", c1, w1, &why), fail("R2b", c2, w2, &why)];
    }
    let mut figs = Vec::new();
    for o in oracles {
        match measure(model, o) {
            Ok(f) => figs.push(f),
            Err(e) => return vec![fail("R1", c1, w1, &e), fail("R2b", c2, w2, &e)],
        }
    }
    let min_cos = figs
        .iter()
        .map(|f| f.min_layer_cosine.min(f.final_norm_cosine))
        .fold(f64::INFINITY, f64::min);
    let max_d = figs
        .iter()
        .map(|f| f.logits_max_abs_diff)
        .fold(0f32, f32::max);
    let agree: usize = figs.iter().map(|f| f.argmax_agree).sum();
    let total: usize = figs.iter().map(|f| f.positions).sum();
    let embed = figs.iter().all(|f| f.embed_exact);
    let greedy_ok = figs.iter().filter(|f| f.r2b_holds()).count();
    let tokens: usize = figs.iter().map(|f| f.hf_greedy.len()).sum();
    vec![
        rung(
            "R1",
            c1,
            w1,
            format!(
                "{} prompts: embedding {}, min cosine 1-{:.1e}, logits max|Δ| {:.2e}, argmax {agree}/{total}",
                figs.len(),
                if embed { "exact" } else { "DIFFERS" },
                1.0 - min_cos,
                max_d
            ),
            figs.iter().all(|f| f.r1_holds()),
        ),
        rung(
            "R2b",
            c2,
            w2,
            format!("{greedy_ok}/{} prompts equal ({tokens} HF tokens)", figs.len()),
            greedy_ok == figs.len(),
        ),
    ]
}

fn r2a(model: &Arc<Model>, ids: &[u32], approx: bool, kv: KvType) -> Rung {
    let claim = "prefill N then 4 decode steps == prefill of N+4 (k, k_raw, v, pos, logits)";
    let witness = if approx {
        "full prefill, same native weights"
    } else {
        "R1-proven full prefill"
    };
    let run = || -> Result<Rung, fak_kv::SessionError> {
        let total = ids.len().min(model.config().max_position_embeddings);
        if total < 5 {
            return Ok(fail("R2a", claim, witness, "prompt too short"));
        }
        let n = total - 4;
        let mut inc = Session::with_kv_type(Arc::clone(model), total, kv)?;
        let mut step_logits = vec![inc.prefill(&ids[..n])?];
        for &id in &ids[n..total] {
            step_logits.push(inc.step(id)?);
        }
        let mut full = Session::with_kv_type(Arc::clone(model), total, kv)?;
        let all = full.prefill_all_logits(&ids[..total])?;
        let v = model.config().vocab_size;
        let mut d = cache_max_abs_diff(inc.cache(), full.cache());
        let mut dig = Digest::new().cache(inc.cache());
        for (i, l) in step_logits.iter().enumerate() {
            let row = n - 1 + i;
            d = d.max(max_abs_diff(l, &all[row * v..(row + 1) * v]));
            dig = dig.f32s(l);
        }
        Ok(with_digest(
            rung(
                "R2a",
                claim,
                witness,
                format!(
                    "N={n}: max|Δ| = {d} over {} layers' cache and 5 logit rows",
                    model.config().num_hidden_layers
                ),
                d == 0.0 && inc.cache() == full.cache(),
            ),
            dig,
        ))
    };
    run().unwrap_or_else(|e| fail("R2a", claim, witness, e))
}

/// One R3 case: token ids and, when HF authored it, HF's two continuations.
struct R3Case {
    name: String,
    prefix: Vec<u32>,
    poison: Vec<u32>,
    query: Vec<u32>,
    hf_clean: Option<Vec<u32>>,
    hf_poisoned: Option<Vec<u32>>,
    /// HF's logits at the last position of prefix+query, `[vocab]`.
    hf_clean_logits: Option<Vec<f32>>,
}

/// The R3 cases of `dir/r3` (or one synthetic case when there is no such folder), and
/// the files that could not be used, with why.
fn r3_cases(model: &Model, dir: Option<&Path>) -> (Vec<R3Case>, Vec<String>) {
    let r3 = dir.map(|d| d.join("r3")).filter(|d| d.is_dir());
    let mut bad = Vec::new();
    let files = match &r3 {
        Some(d) => oracle_files_in(d).unwrap_or_else(|e| {
            bad.push(e.to_string());
            Vec::new()
        }),
        None => Vec::new(),
    };
    let mut cases = Vec::new();
    for f in files {
        let o = match Oracle::load(f.clone()) {
            Ok(o) => o,
            Err(e) => {
                bad.push(e.to_string());
                continue;
            }
        };
        let get = |k: &str| o.ids(k).ok();
        let (Some(prefix), Some(poison), Some(query)) =
            (get("prefix_ids"), get("poison_ids"), get("query_ids"))
        else {
            bad.push(format!(
                "{}: lacks prefix_ids, poison_ids or query_ids",
                f.display()
            ));
            continue;
        };
        {
            cases.push(R3Case {
                name: f
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                prefix,
                poison,
                query,
                hf_clean: get("clean_greedy_ids"),
                hf_poisoned: get("poisoned_greedy_ids"),
                hf_clean_logits: o.f32("clean_last_logits").ok().map(|(_, v)| v.clone()),
            });
        }
    }
    if cases.is_empty() && r3.is_none() {
        let v = model.config().vocab_size;
        cases.push(R3Case {
            name: "synthetic".into(),
            prefix: synthetic_ids(8, v, 2),
            poison: synthetic_ids(6, v, 3),
            query: synthetic_ids(4, v, 4),
            hf_clean: None,
            hf_poisoned: None,
            hf_clean_logits: None,
        });
    }
    (cases, bad)
}

fn r3_rungs(
    model: &Arc<Model>,
    dir: Option<&Path>,
    (approx, why): (bool, &str),
    kv: KvType,
) -> Vec<Rung> {
    let mut out = Vec::new();
    let (cases, bad) = r3_cases(model, dir);
    for e in bad {
        out.push(fail(
            "R3",
            "every R3 oracle file loads",
            "HF R3 oracle files",
            e,
        ));
    }
    for mut case in cases {
        if approx && (case.hf_clean.is_some() || case.hf_poisoned.is_some()) {
            out.push(skip(
                "R3",
                &format!(
                    "[{}] greedy == HF's (never-saw and poisoned); last logits within 1e-4 of HF's",
                    case.name
                ),
                "HF greedy and logits (R3 oracle files)",
                why,
            ));
            // The rows below then compare with our own (native) never-saw run only.
            case.hf_clean = None;
            case.hf_poisoned = None;
            case.hf_clean_logits = None;
        }
        out.extend(r3_case(model, &case, approx, kv));
    }
    out
}

fn r3_case(model: &Arc<Model>, c: &R3Case, approx: bool, kv: KvType) -> Vec<Rung> {
    let claim = format!(
        "[{}] write-time evict == never-saw (logits, cache, 16 greedy tokens)",
        c.name
    );
    let witness = if c.hf_clean.is_some() {
        "HF greedy of prefix+query; our never-saw run"
    } else if approx {
        "our never-saw run, same native weights"
    } else {
        "our never-saw run (R1-proven forward)"
    };
    let claim_a = format!(
        "[{}] control (a): without eviction the poison changes the output",
        c.name
    );
    let claim_b = format!(
        "[{}] control (b): evicting after later tokens attended != never-saw",
        c.name
    );
    let params = GenerateParams {
        max_new_tokens: 16,
        stop_at_eos: true,
    };
    let total = c.prefix.len() + c.poison.len() + c.query.len() + 16;
    let run = || -> Result<Vec<Rung>, fak_kv::SessionError> {
        let new = || Session::with_kv_type(Arc::clone(model), total, kv);
        // Write-time eviction: the poison is removed before anything attends to it.
        let mut ev = new()?;
        ev.prefill(&c.prefix)?;
        ev.prefill(&c.poison)?;
        ev.evict(c.prefix.len(), c.poison.len())?;
        let ev_logits = ev.prefill(&c.query)?;
        let ev_cache = ev.cache().clone();
        let ev_gen = ev.generate(&params)?;
        // Never-saw.
        let mut ns = new()?;
        ns.prefill(&c.prefix)?;
        let ns_logits = ns.prefill(&c.query)?;
        let ns_cache = ns.cache().clone();
        let ns_gen = ns.generate(&params)?;
        let d = max_abs_diff(&ev_logits, &ns_logits).max(cache_max_abs_diff(&ev_cache, &ns_cache));
        let hf_d = c
            .hf_clean_logits
            .as_ref()
            .map(|h| max_abs_diff(&ev_logits, h));
        let hf_ok =
            c.hf_clean.as_ref().is_none_or(|h| *h == ev_gen) && hf_d.is_none_or(|d| d <= 1e-4);
        let dig = Digest::new()
            .f32s(&ev_logits)
            .cache(&ev_cache)
            .u32s(&ev_gen);
        let main = with_digest(
            rung(
                "R3",
                &claim,
                witness,
                format!(
                    "max|Δ| = {d} (logits + cache); greedy {} never-saw{}{}",
                    if ev_gen == ns_gen { "==" } else { "!=" },
                    match &c.hf_clean {
                        Some(h) => format!(
                            ", {} HF ({} tokens)",
                            if *h == ev_gen { "==" } else { "!=" },
                            h.len()
                        ),
                        None => String::new(),
                    },
                    match hf_d {
                        Some(d) => format!("; last logits vs HF max|Δ| {d:.2e}"),
                        None => String::new(),
                    }
                ),
                d == 0.0 && ev_gen == ns_gen && hf_ok,
            ),
            dig,
        );
        // Control (a): no eviction.
        let mut po = new()?;
        po.prefill(&c.prefix)?;
        po.prefill(&c.poison)?;
        po.prefill(&c.query)?;
        let po_gen = po.generate(&params)?;
        let hf_po_ok = c.hf_poisoned.as_ref().is_none_or(|h| *h == po_gen);
        let first_diff = po_gen.iter().zip(&ns_gen).position(|(a, b)| a != b);
        let a = with_digest(
            rung(
                "R3",
                &claim_a,
                if c.hf_poisoned.is_some() {
                    "HF greedy of prefix+poison+query"
                } else {
                    "our never-saw run"
                },
                format!(
                    "poisoned greedy {} never-saw (first difference at token {}){}",
                    if po_gen != ns_gen { "!=" } else { "==" },
                    first_diff.map_or("-".into(), |i| i.to_string()),
                    match &c.hf_poisoned {
                        Some(h) => format!("; == HF poisoned: {}", *h == po_gen),
                        None => String::new(),
                    }
                ),
                po_gen != ns_gen && hf_po_ok,
            ),
            Digest::new().u32s(&po_gen).u32s(&ns_gen),
        );
        // Control (b): evict after the query attended to the poison.
        let mut late = new()?;
        late.prefill(&c.prefix)?;
        late.prefill(&c.poison)?;
        late.prefill(&c.query)?;
        late.evict(c.prefix.len(), c.poison.len())?;
        let same_positions = late.positions() == ns_cache.positions();
        let dv = (0..late.cache().n_layers())
            .map(|l| max_abs_diff(&late.cache().v(l).to_vec(), &ns_cache.v(l).to_vec()))
            .fold(0f32, f32::max);
        let b = with_digest(rung(
            "R3",
            &claim_b,
            "our never-saw cache",
            format!("positions equal: {same_positions}; survivors' V max|Δ| = {dv:.3e} > 0: quarantine must happen at write time"),
            same_positions && dv > 0.0,
        ), Digest::new().cache(late.cache()));
        Ok(vec![main, a, b])
    };
    run().unwrap_or_else(|e| vec![fail("R3", &claim, witness, e)])
}

fn r3_rotation(model: &Arc<Model>, ids: &[u32], kv: KvType) -> Rung {
    if kv.rotates_at_read() {
        return r3_renumber(model, ids, kv);
    }
    let claim =
        "mid-span evict: every moved survivor's K == one rotation of its k_raw at its new position";
    let witness = "Model::rope_in_place on k_raw";
    let run = || -> Result<Rung, fak_kv::SessionError> {
        let n = ids
            .len()
            .min(16)
            .min(model.config().max_position_embeddings);
        if n < 8 {
            return Ok(fail("R3", claim, witness, "prompt too short"));
        }
        let mut s = Session::with_capacity(Arc::clone(model), n);
        s.prefill(&ids[..n])?;
        let before = s.cache().k(0).to_vec();
        s.evict(3, 4)?;
        let cache = s.cache();
        let d = cache.kv_dim();
        let regime = model.rope_regime(cache.next_position() as usize);
        let mut maxd = 0f32;
        let mut moved = 0;
        for l in 0..cache.n_layers() {
            for j in 3..cache.len() {
                let mut want = cache.k_raw(l).row(j).to_vec();
                model.rope_in_place(l, cache.positions()[j], regime, &mut want);
                maxd = maxd.max(max_abs_diff(cache.k(l).row(j), &want));
                moved += 1;
            }
        }
        // Non-vacuous: the moved rows really changed (their position changed by 4).
        let changed = !bits_equal(cache.k(0).row(3), &before[7 * d..8 * d]);
        let pos_ok = cache.positions() == (0..(n - 4) as u32).collect::<Vec<_>>();
        Ok(with_digest(rung(
            "R3",
            claim,
            witness,
            format!("{moved} moved rows: max|Δ| = {maxd}; positions renumbered 0..{}: {pos_ok}; K changed: {changed}", n - 4),
            maxd == 0.0 && changed && pos_ok,
        ), Digest::new().cache(cache)))
    };
    run().unwrap_or_else(|e| fail("R3", claim, witness, e))
}

/// R3's mid-span eviction on a compact kv type, whose keys are stored before RoPE and
/// rotated at read: the survivors' stored rows are kept bit for bit and only their
/// positions are renumbered, so each key is rotated once, at its new position, when
/// it is read (that the result equals never having seen the span is R3's main row).
fn r3_renumber(model: &Arc<Model>, ids: &[u32], kv: KvType) -> Rung {
    let claim = "mid-span evict: survivors' stored K (before RoPE) and V kept bit for bit, positions renumbered (keys rotated at read)";
    let witness = "the stored rows before the eviction";
    let run = || -> Result<Rung, fak_kv::SessionError> {
        let n = ids
            .len()
            .min(16)
            .min(model.config().max_position_embeddings);
        if n < 8 {
            return Ok(fail("R3", claim, witness, "prompt too short"));
        }
        let mut s = Session::with_kv_type(Arc::clone(model), n, kv)?;
        s.prefill(&ids[..n])?;
        let layers = s.cache().n_layers();
        let rows = |c: &KvCache, l: usize| (c.k_raw(l).to_bytes(), c.v(l).to_bytes());
        let before: Vec<_> = (0..layers).map(|l| rows(s.cache(), l)).collect();
        s.evict(3, 4)?;
        let cache = s.cache();
        let row = cache.kv_type().row_bytes(cache.kv_dim());
        let kept = |b: &[u8]| [&b[..3 * row], &b[7 * row..]].concat();
        let same = (0..layers).all(|l| {
            let (k, v) = rows(cache, l);
            k == kept(&before[l].0) && v == kept(&before[l].1)
        });
        let pos_ok = cache.positions() == (0..(n - 4) as u32).collect::<Vec<_>>();
        Ok(with_digest(
            rung(
                "R3",
                claim,
                witness,
                format!(
                    "{} survivors × {layers} layers: rows equal: {same}; positions renumbered 0..{}: {pos_ok}",
                    n - 4,
                    n - 4
                ),
                same && pos_ok,
            ),
            Digest::new().cache(cache),
        ))
    };
    run().unwrap_or_else(|e| fail("R3", claim, witness, e))
}

fn r14(model: &Arc<Model>, ids: &[u32], kv: KvType) -> Rung {
    let claim = "from_prefix(prefix, suffix) == full recompute; prefix not recomputed";
    let witness = "R2a-proven full prefill";
    let run = || -> Result<Rung, fak_kv::SessionError> {
        let n = ids
            .len()
            .min(model.config().max_position_embeddings.saturating_sub(8));
        if n < 4 {
            return Ok(fail("R14", claim, witness, "prompt too short"));
        }
        let split = n / 2;
        let cap = n + 8;
        let mut prefix = Session::with_kv_type(Arc::clone(model), cap, kv)?;
        prefix.prefill(&ids[..split])?;
        let mut cloned = Session::from_prefix(&prefix, &ids[split..n])?;
        let mut full = Session::with_kv_type(Arc::clone(model), cap, kv)?;
        full.prefill(&ids[..n])?;
        let d = max_abs_diff(
            cloned.last_logits().unwrap_or(&[]),
            full.last_logits().unwrap_or(&[]),
        )
        .max(cache_max_abs_diff(cloned.cache(), full.cache()));
        let same_len = cloned.len() == full.len();
        let dig = Digest::new()
            .f32s(cloned.last_logits().unwrap_or(&[]))
            .cache(cloned.cache());
        let computed = cloned.positions_computed();
        let p = GenerateParams {
            max_new_tokens: 8,
            stop_at_eos: false,
        };
        let g1 = cloned.generate(&p)?;
        let g2 = full.generate(&p)?;
        let dig = dig.u32s(&g1);
        Ok(with_digest(rung(
            "R14",
            claim,
            witness,
            format!(
                "max|Δ| = {d}; 8 greedy tokens equal: {}; len {} == {}; positions computed {computed} (suffix {})",
                g1 == g2,
                cloned.len(),
                full.len(),
                n - split
            ),
            d == 0.0 && g1 == g2 && same_len && computed == (n - split) as u64,
        ), dig))
    };
    run().unwrap_or_else(|e| fail("R14", claim, witness, e))
}

/// The window boundary function on a table of cases (position lists, query entry,
/// window, expected first attended entry).
pub const WINDOW_CASES: &[(&[u32], usize, Option<usize>, usize)] = &[
    (&[0, 1, 2, 3, 4], 4, Some(1), 4),
    (&[0, 1, 2, 3, 4], 4, Some(100), 0),
    (&[0, 1, 2, 3, 4], 4, None, 0),
    (&[0, 1, 2, 3, 4], 2, Some(2), 1),
    (&[0, 1, 2, 7, 8], 4, Some(3), 3),
    (&[0, 1, 2, 7, 8], 3, Some(6), 2),
    (&[0, 1, 2, 7, 8], 3, Some(7), 1),
    (&[5, 6, 9], 2, Some(4), 1),
];

fn window_rungs(model: &mut Model, ids: &[u32], kv: KvType) -> Vec<Rung> {
    let mut out = Vec::new();
    let bad: Vec<String> = WINDOW_CASES
        .iter()
        .filter(|(pos, end, w, want)| window_start(pos, *end, *w) != *want)
        .map(|(pos, end, w, want)| format!("{pos:?} end={end} W={w:?} want {want}"))
        .collect();
    out.push(rung(
        "W",
        "window boundary: query at p attends keys with pos >= p-W+1, from stored positions",
        "definition (table incl. pos=[0,1,2,7,8], W=3, p=8)",
        if bad.is_empty() {
            format!("{} cases agree", WINDOW_CASES.len())
        } else {
            format!("wrong: {}", bad.join("; "))
        },
        bad.is_empty(),
    ));
    let saved = model.config().sliding_window.clone();
    let n = ids.len().min(model.config().max_position_embeddings);
    let layers = model.config().num_hidden_layers;
    let run = |m: &Model| -> Result<Vec<f32>, fak_model::ModelError> {
        let mut cache = KvCache::with_type(m.config(), n, kv)
            .map_err(|e| fak_model::ModelError::InvalidInput(e.to_string()))?;
        let pos: Vec<u32> = (0..n as u32).collect();
        m.forward(
            &ids[..n],
            &pos,
            &mut cache,
            fak_model::LogitsWanted::All,
            None,
        )
    };
    let result = (|| -> Result<(Rung, Rung), fak_model::ModelError> {
        model.set_sliding_windows(vec![None; layers])?;
        let causal = run(model)?;
        model.set_sliding_windows(vec![Some(n + 5); layers])?;
        let wide = run(model)?;
        model.set_sliding_windows(vec![Some(2); layers])?;
        let narrow = run(model)?;
        let d_wide = max_abs_diff(&wide, &causal);
        let d_narrow = max_abs_diff(&narrow, &causal);
        Ok((
            with_digest(
                rung(
                    "W",
                    "a window wider than the sequence == full causal attention",
                    "full causal run",
                    format!("{n} positions, W={}: max|Δ| = {d_wide}", n + 5),
                    d_wide == 0.0,
                ),
                Digest::new().f32s(&wide).f32s(&causal),
            ),
            with_digest(
                rung(
                    "W",
                    "a narrow window changes the output (non-vacuous)",
                    "full causal run",
                    format!("W=2: logits max|Δ| = {d_narrow:.3e} > 0"),
                    d_narrow > 0.0,
                ),
                Digest::new().f32s(&narrow),
            ),
        ))
    })();
    let restored = model.set_sliding_windows(saved);
    match (result, restored) {
        (Ok((a, b)), Ok(())) => {
            out.push(a);
            out.push(b);
        }
        (Err(e), _) | (_, Err(e)) => out.push(fail("W", "window runs", "full causal run", e)),
    }
    out
}
