//! The fast path (`WeightMode::Native`) on the real Gemma 3 270M (Q4_K_M: Q5_0, Q8_0,
//! Q4_K and Q6_K matrices, a Q8_0 tied embedding, F32 norms): every matrix type has a
//! kernel, decode equals prefill and any thread count gives the same bits, and the
//! distance from the exact path (the one proven against HF) is measured. The file comes
//! from `fak model pull gemma3-270m`; without it these tests fail with that command.

mod common;
use common::*;
use fak_model::{load_text, KvStore, LogitsWanted, Model, VecKvCache, WeightMode};
use fak_tensor::Threads;
use std::sync::OnceLock;

fn native() -> Option<&'static Model> {
    static M: OnceLock<Option<Model>> = OnceLock::new();
    M.get_or_init(|| {
        real_model("gemma3-270m")
            .map(|p| Model::load_with(&p, WeightMode::Native).expect("load Gemma 3 270M"))
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

/// Gemma 3's `<bos>` and a few ordinary ids.
const PROMPT: [u32; 12] = [
    2, 818, 5279, 529, 7001, 563, 9079, 236764, 107, 818, 3207, 563,
];

#[test]
fn gemma3_native_keeps_every_matrix_quantized() {
    let Some(m) = native() else { return };
    assert_eq!(m.weight_mode(), WeightMode::Native);
    // 18 layers × 7 matrices and the tied embedding, none widened to f32: the file's
    // types as `fak model inspect` lists them (F32 tensors are the norms).
    assert_eq!(
        m.quantized_types(),
        vec![("Q4_K", 27), ("Q5_0", 81), ("Q6_K", 9), ("Q8_0", 10)]
    );
    println!(
        "native weight bytes: {:.1} MB",
        m.weight_bytes() as f64 / 1e6
    );
}

#[test]
fn gemma3_native_decode_equals_prefill_bitwise() {
    let Some(m) = native() else { return };
    let full = run_in_chunks(m, &PROMPT, &[PROMPT.len()]);
    let steps = run_in_chunks(m, &PROMPT, &[1; PROMPT.len()]);
    let mixed = run_in_chunks(m, &PROMPT, &[5, 1, 4, 2]);
    assert!(same_bits(&full, &steps), "prefill != token-by-token decode");
    assert!(same_bits(&full, &mixed), "prefill != chunked prefill");
}

#[test]
fn gemma3_native_is_bit_identical_for_one_and_two_threads() {
    let Some(p) = real_model("gemma3-270m") else {
        return;
    };
    let mut m = Model::load_with(&p, WeightMode::Native).unwrap();
    m.set_threads(Threads::new(1));
    let one = run_in_chunks(&m, &PROMPT, &[7, 5]);
    m.set_threads(Threads::new(2));
    let two = run_in_chunks(&m, &PROMPT, &[7, 5]);
    assert!(same_bits(&one, &two), "2 threads differ from 1");
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
fn gemma3_native_agrees_with_exact_teacher_forced() {
    let Some(p) = real_model("gemma3-270m") else {
        return;
    };
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
        "Gemma 3 270M native vs exact, {n} teacher-forced positions: top-1 agreement {top1:.4} ({agree}/{n}), \
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
