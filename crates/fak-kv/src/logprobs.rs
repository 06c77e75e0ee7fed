//! Log-probabilities of generated tokens (OpenAI's `logprobs` / `top_logprobs`).
//!
//! A token's logprob is the log-softmax of the model's **raw** logits at the position
//! that chose it: before the repetition penalty, temperature, top-k, top-p or min-p
//! (so it describes the model, not the sampler; vLLM's default, `raw_logprobs`). With
//! `z` the logits (`[vocab]`) and `m = max_j z_j`, computed in f64:
//!
//! ```text
//! logprob(i) = (z_i - m) - ln( Σ_j exp(z_j - m) )
//! ```
//!
//! The max-subtraction keeps every `exp` in `(0, 1]`, so the sum cannot overflow and is
//! at least 1 (the max's own term); NaN logits are left out of the max and the sum (a
//! NaN token gets a NaN logprob and is never among the top). At temperature 0 the chosen
//! token is the argmax, so its logprob is the highest of its position.

use fak_model::Tokenizer;
use serde::Serialize;

/// The most alternatives a request may ask for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One candidate token and its logprob.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TopLogprob {
    /// Token id.
    pub id: u32,
    /// The token's exact bytes (its text may be part of a UTF-8 character).
    pub bytes: Vec<u8>,
    /// Natural-log probability under the raw logits (see the module docs).
    pub logprob: f64,
}

/// One generated token: its logprob and the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// Token id.
    pub id: u32,
    /// The token's exact bytes.
    pub bytes: Vec<u8>,
    /// Natural-log probability under the raw logits (see the module docs).
    pub logprob: f64,
    /// The `n` most likely tokens of the position, highest first (ties: lower id first).
    /// It holds the chosen token only when that is among the `n`.
    pub top: Vec<TopLogprob>,
}

impl TopLogprob {
    /// The token's text: its bytes as UTF-8, a partial character as U+FFFD.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }
}

impl TokenLogprob {
    /// The token's text: its bytes as UTF-8, a partial character as U+FFFD.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }
}

/// `ln Σ exp(z_j - m)` and `m` over the non-NaN logits, in f64. `None` when every
/// logit is NaN (or there are none).
fn log_normalizer(logits: &[f32]) -> Option<(f64, f64)> {
    let m = logits
        .iter()
        .filter(|l| !l.is_nan())
        .fold(f64::NEG_INFINITY, |a, &l| a.max(l as f64));
    if m == f64::NEG_INFINITY {
        return None; // no logits, or every one NaN or -inf
    }
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| (l as f64 - m).exp())
        .sum();
    Some((m, sum.ln()))
}

/// The log-softmax of `logits` (`[vocab]`) at every id, in f64 (see the module docs).
/// Every value is NaN when no logit is a finite number or +inf.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    match log_normalizer(logits) {
        Some((m, ln_z)) => logits.iter().map(|&l| (l as f64 - m) - ln_z).collect(),
        None => vec![f64::NAN; logits.len()],
    }
}

/// The record of token `id` chosen from `logits` (`[vocab]`), with the `top_n` most
/// likely tokens (at most [`MAX_TOP_LOGPROBS`] are kept, and no more than the vocabulary).
/// Bytes come from `tokenizer`; an id it does not know has empty bytes.
pub fn token_logprob(logits: &[f32], id: u32, top_n: usize, tokenizer: &Tokenizer) -> TokenLogprob {
    let bytes = |i: u32| {
        if (i as usize) < tokenizer.vocab_size() {
            tokenizer.token_bytes(i).to_vec()
        } else {
            Vec::new()
        }
    };
    let norm = log_normalizer(logits);
    let lp = |i: u32| match (norm, logits.get(i as usize)) {
        (Some((m, ln_z)), Some(&l)) => (l as f64 - m) - ln_z,
        _ => f64::NAN,
    };
    TokenLogprob {
        id,
        bytes: bytes(id),
        logprob: lp(id),
        top: top_ids(logits, top_n.min(MAX_TOP_LOGPROBS))
            .into_iter()
            .map(|i| TopLogprob {
                id: i,
                bytes: bytes(i),
                logprob: lp(i),
            })
            .collect(),
    }
}

/// The ids of the `n` largest non-NaN logits, highest first, ties by lower id.
pub fn top_ids(logits: &[f32], n: usize) -> Vec<u32> {
    if n == 0 {
        return Vec::new();
    }
    // A bounded list kept sorted: one pass over the vocabulary, O(V·n) at worst.
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(n + 1);
    let better = |a: &(f32, u32), b: &(f32, u32)| a.0 > b.0 || (a.0 == b.0 && a.1 < b.1);
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        let c = (l, i as u32);
        if best.len() == n && !best.last().is_some_and(|w| better(&c, w)) {
            continue;
        }
        let at = best
            .iter()
            .position(|b| better(&c, b))
            .unwrap_or(best.len());
        best.insert(at, c);
        best.truncate(n);
    }
    best.into_iter().map(|(_, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_the_formula_and_normalizes() {
        let z = [1.0f32, 3.0, 2.5, -1.0, 0.5, 2.9];
        let lp = log_softmax(&z);
        // By hand: ln Σ exp(z) directly (small values, no overflow here).
        let ln_z = z.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        for (a, &x) in lp.iter().zip(&z) {
            assert!(
                (a - (x as f64 - ln_z)).abs() < 1e-12,
                "{a} vs {}",
                x as f64 - ln_z
            );
        }
        let total: f64 = lp.iter().map(|x| x.exp()).sum();
        assert!((total - 1.0).abs() < 1e-12, "{total}");
        // Huge logits do not overflow (max-subtraction).
        let big = log_softmax(&[1e30, 1e30]);
        assert!((big[0] - (0.5f64).ln()).abs() < 1e-12, "{big:?}");
        // NaN is left out of the sum and the top.
        let with_nan = log_softmax(&[0.0, f32::NAN, 0.0]);
        assert!((with_nan[0] - (0.5f64).ln()).abs() < 1e-12);
        assert!(with_nan[1].is_nan());
        assert!(log_softmax(&[f32::NAN]).iter().all(|x| x.is_nan()));
        assert!(log_softmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY])
            .iter()
            .all(|x| x.is_nan()));
        assert!(log_softmax(&[]).is_empty());
    }

    #[test]
    fn top_ids_are_sorted_with_ties_by_id() {
        let z = [1.0f32, 3.0, 2.5, f32::NAN, 3.0, 2.9];
        assert_eq!(top_ids(&z, 3), vec![1, 4, 5]);
        assert_eq!(top_ids(&z, 0), Vec::<u32>::new());
        assert_eq!(top_ids(&z, 100), vec![1, 4, 5, 2, 0]);
        // Against a full sort on a longer, pseudo-random vector.
        let z: Vec<f32> = (0..1000u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % 977) as f32 * 0.01)
            .collect();
        let mut all: Vec<u32> = (0..1000).collect();
        all.sort_by(|&a, &b| z[b as usize].total_cmp(&z[a as usize]).then(a.cmp(&b)));
        assert_eq!(top_ids(&z, 20), all[..20].to_vec());
    }
}
