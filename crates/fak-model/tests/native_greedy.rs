//! Greedy 32-token continuations of every HF oracle prompt on the exact and the native
//! path, against HF transformers' own (`testdata/oracles/<name>/greedy32.json`, made by
//! `oracle-export/export_oracle.py greedy32`; EOS does not stop them, so every case has
//! 32 tokens). The exact path must equal HF token for token on every prompt. The native
//! path (8-bit activations) may part from it, but only where the exact path's own choice
//! was close: at its first divergence the exact path's top-1/top-2 logit margin must be
//! small, and most prompts must not diverge at all. The table is printed
//! (`--nocapture`).

mod common;
use common::*;
use fak_model::{LogitsWanted, Model, VecKvCache, WeightMode};
use serde_json::Value;

/// One greedy run: the new ids and, for every step, the logit row's top-1/top-2 margin
/// and its runner-up id.
struct Greedy {
    ids: Vec<u32>,
    margins: Vec<f32>,
    second: Vec<u32>,
}

fn top2(row: &[f32]) -> (u32, f32, u32, f32) {
    let (mut i1, mut v1, mut i2, mut v2) = (0u32, f32::NEG_INFINITY, 0u32, f32::NEG_INFINITY);
    for (i, &x) in row.iter().enumerate() {
        if x > v1 {
            (i2, v2) = (i1, v1);
            (i1, v1) = (i as u32, x);
        } else if x > v2 {
            (i2, v2) = (i as u32, x);
        }
    }
    (i1, v1, i2, v2)
}

/// `n` greedy tokens after `prompt` (one prefill, then one decode step per token).
fn greedy(m: &Model, prompt: &[u32], n: usize) -> Greedy {
    let mut kv = VecKvCache::new(m.config().num_hidden_layers, prompt.len() + n);
    let pos: Vec<u32> = (0..prompt.len() as u32).collect();
    let mut row = m
        .forward(prompt, &pos, &mut kv, LogitsWanted::Last, None)
        .unwrap();
    let mut g = Greedy {
        ids: Vec::new(),
        margins: Vec::new(),
        second: Vec::new(),
    };
    for step in 0..n {
        let (i1, v1, i2, v2) = top2(&row);
        // The argmax the rest of fak uses (ties to the lowest id, as here).
        assert_eq!(i1, fak_model::argmax(&row));
        g.ids.push(i1);
        g.margins.push(v1 - v2);
        g.second.push(i2);
        if step + 1 < n {
            let p = (prompt.len() + step) as u32;
            row = m
                .forward(&[i1], &[p], &mut kv, LogitsWanted::Last, None)
                .unwrap();
        }
    }
    g
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// What one model's table shows, for the assertions.
struct Outcome {
    cases: usize,
    native_equal: usize,
    /// The exact path's top-1/top-2 margin at each native divergence.
    divergence_margins: Vec<f32>,
    /// Divergences where the native token is not the exact path's runner-up.
    not_runner_up: Vec<String>,
}

fn greedy_table(name: &str, path: &std::path::Path) -> Outcome {
    let file = testdata().join("oracles").join(name).join("greedy32.json");
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| {
        panic!(
            "{}: {e}\nregenerate with: python oracle-export/export_oracle.py greedy32 (see oracle-export/README.md)",
            file.display()
        )
    });
    let oracle: Value = serde_json::from_str(&text).unwrap();
    let n = oracle["n_new"].as_u64().unwrap() as usize;
    assert_eq!(n, 32);
    let exact = Model::load(path).unwrap();
    let native = Model::load_with(path, WeightMode::Native).unwrap();
    let cases = oracle["cases"].as_array().unwrap();
    assert!(cases.len() >= 3, "{} cases", cases.len());
    println!("{name}: greedy {n} tokens, exact and native paths against HF generate");
    println!(
        "| prompt | prompt ids | exact == HF | native == exact | first divergence | exact margin there (HF's) | exact top-1 / top-2 there | native chose | HF's first EOS |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut out = Outcome {
        cases: cases.len(),
        native_equal: 0,
        divergence_margins: Vec::new(),
        not_runner_up: Vec::new(),
    };
    let mut exact_bad = Vec::new();
    for c in cases {
        let cname = c["name"].as_str().unwrap();
        let prompt = ids(&c["prompt_ids"]);
        let hf = ids(&c["greedy_ids"]);
        let hf_margins: Vec<f64> = c["margins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(hf.len(), n);
        let e = greedy(&exact, &prompt, n);
        let nv = greedy(&native, &prompt, n);
        if e.ids != hf {
            exact_bad.push(cname.to_string());
        }
        let first = e.ids.iter().zip(&nv.ids).position(|(a, b)| a != b);
        let eos = c["first_eos_index"]
            .as_u64()
            .map_or("-".to_string(), |i| i.to_string());
        match first {
            None => {
                out.native_equal += 1;
                println!(
                    "| {cname} | {} | {} | yes | - | (min over 32 steps: {:.4} ({:.4})) | - | - | {eos} |",
                    prompt.len(),
                    e.ids == hf,
                    e.margins.iter().fold(f32::INFINITY, |a, &b| a.min(b)),
                    hf_margins.iter().fold(f64::INFINITY, |a, &b| a.min(b)),
                );
            }
            Some(i) => {
                out.divergence_margins.push(e.margins[i]);
                if nv.ids[i] != e.second[i] {
                    out.not_runner_up.push(format!("{cname} at token {i}"));
                }
                println!(
                    "| {cname} | {} | {} | no | token {i} | {:.4} ({:.4}) | {} / {} | {} | {eos} |",
                    prompt.len(),
                    e.ids == hf,
                    e.margins[i],
                    hf_margins[i],
                    e.ids[i],
                    e.second[i],
                    nv.ids[i],
                );
            }
        }
    }
    println!();
    assert!(
        exact_bad.is_empty(),
        "{name}: the exact path's greedy continuation differs from HF generate on {exact_bad:?}"
    );
    out
}

/// The assertions both models share; prints the summary line.
fn check(label: &str, o: &Outcome) {
    let worst = o.divergence_margins.iter().fold(0f32, |a, &b| a.max(b));
    println!(
        "{label}: native == exact over all 32 tokens on {}/{} prompts; largest exact margin at a divergence {worst:.4}",
        o.native_equal, o.cases
    );
    assert!(
        o.not_runner_up.is_empty(),
        "{label}: native took a token other than the exact path's runner-up: {:?}",
        o.not_runner_up
    );
    assert!(
        worst < 0.5,
        "{label}: native parted from exact where the exact margin was {worst}"
    );
}

#[fak_testkit::real_model]
fn smollm2_greedy_32_exact_equals_hf_native_parts_only_on_near_ties() {
    let p = smollm2_path();
    check("SmolLM2", &greedy_table("smollm2-135m-instruct", &p));
}

#[fak_testkit::real_model]
fn gemma3_greedy_32_exact_equals_hf_native_parts_only_on_near_ties() {
    let p = real_model("gemma3-270m");
    check("Gemma 3", &greedy_table("gemma3-270m", &p));
}
