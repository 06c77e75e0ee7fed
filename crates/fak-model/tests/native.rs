//! The fast path (`WeightMode::Native`): its own invariants bit for bit, and its
//! distance from the exact path measured on the real SmolLM2-135M-Instruct (Q4_1
//! matrices, Q8_0 tied embedding). The model file comes from
//! `fak model pull smollm2-135m-instruct`; without it these tests fail with that
//! command (see `common::smollm2_path`).

mod common;
use common::*;
use fak_model::{load_text, KvStore, LogitsWanted, Model, VecKvCache, WeightMode};
use fak_tensor::Threads;
use std::sync::OnceLock;

fn native() -> Option<&'static Model> {
    static M: OnceLock<Option<Model>> = OnceLock::new();
    M.get_or_init(|| {
        smollm2_path().map(|p| Model::load_with(&p, WeightMode::Native).expect("load SmolLM2"))
    })
    .as_ref()
}

/// Logits of `ids` run through `m` in the given chunk sizes (each chunk one forward
/// pass over the same cache), every position's row, `[ids.len(), vocab]`.
fn run_in_chunks(m: &Model, ids: &[u32], chunks: &[usize]) -> Vec<f32> {
    let mut kv = VecKvCache::new(m.config().num_hidden_layers, ids.len());
    let mut out = Vec::new();
    let mut at = 0;
    for &c in chunks {
        let pos: Vec<u32> = (at as u32..(at + c) as u32).collect();
        out.extend(
            m.forward(&ids[at..at + c], &pos, &mut kv, LogitsWanted::All, None)
                .unwrap(),
        );
        at += c;
    }
    assert_eq!(at, ids.len());
    assert_eq!(kv.len(), ids.len());
    out
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

const PROMPT: [u32; 12] = [1, 504, 3575, 282, 4649, 314, 7042, 30, 198, 504, 2988, 314];

#[test]
fn native_keeps_the_matrices_quantized() {
    let Some(m) = native() else { return };
    assert_eq!(m.weight_mode(), WeightMode::Native);
    // 30 layers × 7 Q4_1 matrices, and the tied Q8_0 embedding that is also the head.
    assert_eq!(m.quantized_types(), vec![("Q4_1", 210), ("Q8_0", 1)]);
    // What it reads per token is the file's matrices, not their f32 copies
    // (134.5 M parameters would be 538 MB in f32).
    let mb = m.weight_bytes() as f64 / 1e6;
    println!("native weight bytes: {mb:.1} MB");
    assert!(mb < 120.0, "{mb} MB");
}

#[test]
fn native_decode_equals_prefill_bitwise() {
    let Some(m) = native() else { return };
    let full = run_in_chunks(m, &PROMPT, &[PROMPT.len()]);
    let steps = run_in_chunks(m, &PROMPT, &[1; PROMPT.len()]);
    let mixed = run_in_chunks(m, &PROMPT, &[5, 1, 4, 2]);
    assert!(same_bits(&full, &steps), "prefill != token-by-token decode");
    assert!(same_bits(&full, &mixed), "prefill != chunked prefill");
}

#[test]
fn native_is_bit_identical_for_any_thread_count() {
    let Some(p) = smollm2_path() else { return };
    let mut m = Model::load_with(&p, WeightMode::Native).unwrap();
    m.set_threads(Threads::new(1));
    let one = run_in_chunks(&m, &PROMPT, &[7, 5]);
    for th in [2usize, 3] {
        m.set_threads(Threads::new(th));
        let got = run_in_chunks(&m, &PROMPT, &[7, 5]);
        assert!(same_bits(&one, &got), "{th} threads differ from 1");
    }
}

#[test]
fn native_on_f32_weights_is_the_exact_path() {
    // A safetensors model has no block-format matrices: native mode keeps every
    // weight f32 and must give the exact path's bits.
    let dir = testdata().join("tiny/llama-tied");
    let exact = Model::load(&dir).unwrap();
    let native = Model::load_with(&dir, WeightMode::Native).unwrap();
    assert!(native.quantized_types().is_empty());
    let ids = [1u32, 7, 42, 99, 3];
    assert!(same_bits(
        &run_in_chunks(&exact, &ids, &[5]),
        &run_in_chunks(&native, &ids, &[5])
    ));
}

/// A text of a few hundred tokens for teacher forcing (written for this test).
const TEXT: &str = "The lighthouse keeper woke before dawn, as he had every morning for \
thirty years. He climbed the spiral stairs, counting them out of habit, and checked the \
lamp, the lens and the clockwork that turned it. The sea was calm, grey and flat under a \
low sky, and a fishing boat was already heading out past the rocks. After breakfast he \
wrote in the log: wind from the north-west, light rain expected by noon, visibility good. \
Then he walked down to the village to buy bread, flour, two lemons and a tin of coffee. \
The baker asked whether the storm last week had damaged the station. It had not, he said, \
although the door of the oil store had blown open and a gull had spent the night inside. \
In the afternoon he repainted the railing on the gallery, which the salt air strips every \
winter, and he listened to the radio: a report on the price of fish, a programme about \
old ships, and a concert of music for strings. When the sun went down he lit the lamp, \
wound the clock, and sat by the window with a book about the history of navigation, \
from the first charts of the coast to the satellites that guide ships today. Outside, \
the beam swept across the water every ten seconds, steady and patient, as it always had.";

#[test]
fn native_agrees_with_exact_teacher_forced() {
    let Some(p) = smollm2_path() else { return };
    let Some(native) = native() else { return };
    let exact = Model::load(&p).unwrap();
    let (tok, _) = load_text(&p, exact.config()).unwrap();
    let ids = tok.encode_prompt(TEXT).unwrap();
    assert!(ids.len() >= 200, "{} tokens", ids.len());
    let v = exact.config().vocab_size;
    let le = run_in_chunks(&exact, &ids, &[ids.len()]);
    let ln = run_in_chunks(native, &ids, &[ids.len()]);
    let (mut agree, mut kl_sum, mut kl_max, mut max_abs) = (0usize, 0f64, 0f64, 0f32);
    for (re, rn) in le.chunks_exact(v).zip(ln.chunks_exact(v)) {
        let am = |r: &[f32]| fak_model::argmax(r);
        agree += usize::from(am(re) == am(rn));
        let logp = |r: &[f32]| {
            let m = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let z: f64 = r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
            r.iter().map(|&x| x as f64 - z).collect::<Vec<f64>>()
        };
        let (pe, pn) = (logp(re), logp(rn));
        let kl: f64 = pe.iter().zip(&pn).map(|(a, b)| a.exp() * (a - b)).sum();
        kl_sum += kl;
        kl_max = kl_max.max(kl);
        for (a, b) in re.iter().zip(rn) {
            max_abs = max_abs.max((a - b).abs());
        }
    }
    let n = ids.len();
    let top1 = agree as f64 / n as f64;
    let kl_mean = kl_sum / n as f64;
    println!(
        "native vs exact, {n} teacher-forced positions: top-1 agreement {top1:.4} ({agree}/{n}), \
         mean KL(exact || native) {kl_mean:.5} nats, max KL {kl_max:.4}, max |Δlogit| {max_abs:.3}"
    );
    // The native path really ran (quantized activations change the logits) ...
    assert!(
        max_abs > 0.0,
        "native logits equal exact ones: no quantized product ran"
    );
    // ... and stays close to the exact one: loose sanity floors, not a tuned fit.
    assert!(top1 >= 0.90, "top-1 agreement {top1}");
    assert!(kl_mean <= 0.05, "mean KL {kl_mean}");
}
