//! Logprobs of generated tokens (`TextParams::logprobs`) on the real SmolLM2 weights:
//! against HF's logits, and the mapping of records to released text.
//!
//! Oracle check: every HF oracle of the model that holds logits at its prompt's last
//! position (`<prompt>.safetensors`: `logits`; `r3/<case>.safetensors`:
//! `clean_last_logits` / `poisoned_last_logits`) gives the distribution of the first
//! generated token. Tolerance, derived: `logprob_i = z_i - LSE(z)` and LSE is
//! 1-Lipschitz in the max norm, so `|Δlogprob| <= |Δz_i| + |ΔLSE| <= 2·max|Δz|`; the
//! design bounds max|Δz| by 1e-4 (exact path), and the test holds each logprob to twice
//! the max|Δz| measured on that prompt (plus 1e-9 for f64 rounding). HF's log-softmax is
//! computed here directly as `z - ln Σ exp(z)` in f64, not with fak's function.
//!
//! Without the model file this fails with the fetch command (`FAK_SKIP_REAL_MODEL=1`
//! reports them as ignored, never in CI).

mod common;

use common::smollm2_path;
use fak_kv::{generate_text_with_logprobs, FinishReason, Session, TextParams, TokenLogprob};
use fak_model::{Model, StreamDecoder, Tokenizer};
use fak_prove::oracle::{oracle_files_in, Oracle};
use std::path::PathBuf;
use std::sync::Arc;

fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

fn tokenizer(path: &PathBuf) -> Tokenizer {
    let g = fak_weights::GgufFile::open(path).unwrap();
    Tokenizer::from_gguf(&g).unwrap()
}

fn params(temperature: f32, seed: u64, max_tokens: usize, top: usize) -> TextParams {
    TextParams {
        sampling: fak_kv::SamplingParams {
            temperature,
            seed,
            ..Default::default()
        },
        max_tokens,
        stop: vec![],
        stop_ids: vec![],
        logprobs: Some(top),
        grammar: None,
    }
}

/// Runs a generation, returning its output and the (text, records) of every piece.
fn run(
    s: &mut Session,
    tok: &Tokenizer,
    ids: &[u32],
    p: &TextParams,
) -> (fak_kv::TextOutput, Vec<(String, Vec<TokenLogprob>)>) {
    let mut pieces = Vec::new();
    let out = generate_text_with_logprobs(s, tok, ids, p, None, &mut |t, r| {
        pieces.push((t.to_string(), r.to_vec()))
    })
    .unwrap();
    (out, pieces)
}

/// HF's log-softmax, directly: `z - ln Σ exp(z)` in f64.
fn hf_log_softmax(z: &[f32]) -> Vec<f64> {
    let ln_z = z.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
    z.iter().map(|&x| x as f64 - ln_z).collect()
}

#[fak_testkit::real_model]
fn first_token_logprobs_equal_hf_log_softmax_within_twice_the_logit_error() {
    let path = smollm2_path();
    let model = Arc::new(Model::load(&path).unwrap());
    let tok = tokenizer(&path);
    let dir = testdata().join("oracles/smollm2-135m-instruct");
    let mut cases: Vec<(String, Vec<u32>, Vec<f32>)> = Vec::new();
    for f in oracle_files_in(&dir).unwrap() {
        let o = Oracle::load(f.clone()).unwrap();
        let (shape, logits) = o.f32("logits").unwrap();
        let ids = o.ids("prompt_ids").unwrap();
        let pos = o.ids("logits_positions").unwrap();
        // Only the last position's row is the first generated token's distribution.
        assert_eq!(pos.last().copied(), Some(ids.len() as u32 - 1));
        let v = shape[1];
        let name = f.file_stem().unwrap().to_string_lossy().into_owned();
        cases.push((name, ids, logits[logits.len() - v..].to_vec()));
    }
    for f in oracle_files_in(&dir.join("r3")).unwrap() {
        let o = Oracle::load(f.clone()).unwrap();
        let (p, x, q) = (
            o.ids("prefix_ids").unwrap(),
            o.ids("poison_ids").unwrap(),
            o.ids("query_ids").unwrap(),
        );
        let name = f.file_stem().unwrap().to_string_lossy().into_owned();
        let clean: Vec<u32> = p.iter().chain(&q).copied().collect();
        let poisoned: Vec<u32> = p.iter().chain(&x).chain(&q).copied().collect();
        let l = |k: &str| o.f32(k).unwrap().1.clone();
        cases.push((format!("r3/{name} clean"), clean, l("clean_last_logits")));
        cases.push((
            format!("r3/{name} poisoned"),
            poisoned,
            l("poisoned_last_logits"),
        ));
    }
    assert!(
        cases.len() >= 7,
        "expected 3 prompt + 4 r3 rows, found {}",
        cases.len()
    );
    for (name, ids, hf) in &cases {
        let mut s = Session::new(Arc::clone(&model));
        let ours = s.prefill(ids).unwrap();
        let max_dz = ours
            .iter()
            .zip(hf)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max) as f64;
        assert!(
            max_dz <= 1e-4,
            "{name}: logits max|Δ| {max_dz:e} over the design's 1e-4"
        );
        let bound = 2.0 * max_dz + 1e-9;
        let hf_lp = hf_log_softmax(hf);
        // Greedy from the prefilled session (new_ids empty: its last logits).
        let (out, _) = run(&mut s, &tok, &[], &params(0.0, 0, 1, 20));
        let r = &out.logprobs[0];
        assert_eq!(r.id, out.completion_ids[0]);
        let mut worst = (r.logprob - hf_lp[r.id as usize]).abs();
        assert_eq!(r.top.len(), 20);
        assert_eq!(r.top[0].id, r.id, "{name}: greedy is the top logprob");
        for t in &r.top {
            worst = worst.max((t.logprob - hf_lp[t.id as usize]).abs());
        }
        // The k-th largest values agree too (order statistics are 1-Lipschitz), so no
        // token HF ranks in its top 20 is missing from ours beyond the tolerance.
        let mut hf_sorted = hf_lp.clone();
        hf_sorted.sort_by(|a, b| b.total_cmp(a));
        for (k, t) in r.top.iter().enumerate() {
            worst = worst.max((t.logprob - hf_sorted[k]).abs());
        }
        eprintln!(
            "{name}: token {:?} logprob {:.6} (HF {:.6}); logits max|Δ| {max_dz:.2e}, \
             logprob max|Δ| {worst:.2e} (bound {bound:.2e})",
            r.text(),
            r.logprob,
            hf_lp[r.id as usize]
        );
        assert!(
            worst <= bound,
            "{name}: logprob max|Δ| {worst:e} > {bound:e}"
        );
    }
}

/// Token starts (bytes of decoded text before each token), as generate_text decodes.
fn starts(tok: &Tokenizer, ids: &[u32]) -> Vec<usize> {
    let mut d = StreamDecoder::new(true);
    let mut at = 0;
    ids.iter()
        .map(|&id| {
            let s = at;
            at += d.push(tok, id).len();
            s
        })
        .collect()
}

/// The tiny random model with the real tokenizer samples ids 0..256 of SmolLM2's vocab:
/// control tokens (dropped from the text) and byte tokens that split UTF-8 characters.
/// Every token gets a record, each record goes with the piece that releases its last
/// byte, and a stop string drops exactly the tokens wholly inside it.
#[fak_testkit::real_model]
fn records_follow_the_text_they_release() {
    let path = smollm2_path();
    let tok = tokenizer(&path);
    let m = Arc::new(Model::load(&testdata().join("tiny/llama-tied")).unwrap());
    let mut held_back = 0;
    for seed in 0..12 {
        let p = params(1.5, seed, 60, 3);
        let (out, pieces) = run(&mut Session::new(Arc::clone(&m)), &tok, &[40, 41, 42], &p);
        assert_eq!(out.finish_reason, FinishReason::Length);
        let all: Vec<TokenLogprob> = pieces.iter().flat_map(|(_, r)| r.clone()).collect();
        assert_eq!(all, out.logprobs);
        let ids: Vec<u32> = all.iter().map(|r| r.id).collect();
        assert_eq!(
            ids, out.completion_ids,
            "seed {seed}: every token has a record"
        );
        let text: String = pieces.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(text, out.text);
        let mut released = String::new();
        let mut reported = Vec::new();
        for (k, (t, r)) in pieces.iter().enumerate() {
            assert!(
                !t.is_empty() || k + 1 == pieces.len(),
                "only the last piece may be empty"
            );
            released.push_str(t);
            reported.extend(r.iter().map(|x| x.id));
            // Every reported token's text is released...
            let dec = tok.decode(&reported, true).unwrap();
            assert!(
                released.starts_with(&dec),
                "seed {seed} piece {k}: {dec:?} vs {released:?}"
            );
            // ...and the next token's is not, wholly (its last byte is still held).
            if let Some(&next) = out.completion_ids.get(reported.len()) {
                let mut more = reported.clone();
                more.push(next);
                let dec_more = tok.decode(&more, true).unwrap();
                if dec_more.len() > dec.len() && !dec_more.contains('\u{FFFD}') {
                    assert!(!released.starts_with(&dec_more), "seed {seed} piece {k}");
                }
            }
            for x in r {
                held_back += usize::from(std::str::from_utf8(&x.bytes).is_err());
                // Sorted, normalized, the chosen token's value where it is listed.
                assert!(x.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
                assert!(x.top.iter().map(|t| t.logprob.exp()).sum::<f64>() <= 1.0 + 1e-9);
                assert!(x.logprob <= x.top[0].logprob);
                if let Some(t) = x.top.iter().find(|t| t.id == x.id) {
                    assert_eq!(t.logprob, x.logprob);
                }
            }
        }
        // A stop string in the middle: the records are those of the tokens with a byte
        // before it.
        let chars: Vec<(usize, char)> = out.text.char_indices().collect();
        if chars.len() < 10 {
            continue;
        }
        let from = chars[chars.len() / 2].0;
        let to = chars[chars.len() / 2 + 2].0;
        let stop = out.text[from..to].to_string();
        let at = out.text.find(&stop).unwrap();
        let mut ps = p.clone();
        ps.stop = vec![stop.clone()];
        let (so, spieces) = run(&mut Session::new(Arc::clone(&m)), &tok, &[40, 41, 42], &ps);
        assert_eq!(so.finish_reason, FinishReason::Stop);
        assert_eq!(so.text, out.text[..at]);
        let st = starts(&tok, &out.completion_ids);
        let expect: Vec<u32> = out
            .completion_ids
            .iter()
            .zip(&st)
            .filter(|(_, &s)| s < at)
            .map(|(&id, _)| id)
            .collect();
        let got: Vec<u32> = so.logprobs.iter().map(|r| r.id).collect();
        assert_eq!(got, expect, "seed {seed}, stop {stop:?}");
        let concat: Vec<TokenLogprob> = spieces.iter().flat_map(|(_, r)| r.clone()).collect();
        assert_eq!(concat, so.logprobs);
    }
    // The runs did exercise tokens that are part of a UTF-8 character.
    assert!(held_back > 0, "no split UTF-8 token sampled");
}

/// `logprobs: None` records nothing; `Some(0)` records the chosen tokens with no top.
#[fak_testkit::real_model]
fn off_records_nothing_and_zero_has_no_alternatives() {
    let path = smollm2_path();
    let tok = tokenizer(&path);
    let m = Arc::new(Model::load(&testdata().join("tiny/llama-tied")).unwrap());
    let mut p = params(0.0, 0, 8, 0);
    let (out, pieces) = run(&mut Session::new(Arc::clone(&m)), &tok, &[40, 41], &p);
    assert_eq!(out.logprobs.len(), 8);
    assert!(out
        .logprobs
        .iter()
        .all(|r| r.top.is_empty() && r.logprob <= 0.0));
    assert!(pieces.iter().any(|(_, r)| !r.is_empty()));
    p.logprobs = None;
    let (off, pieces) = run(&mut Session::new(m), &tok, &[40, 41], &p);
    assert!(off.logprobs.is_empty() && pieces.iter().all(|(_, r)| r.is_empty()));
    assert_eq!(off.completion_ids, out.completion_ids);
}
