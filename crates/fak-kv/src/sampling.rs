//! Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p and a
//! repetition penalty, with a seeded generator so the same seed gives the same text.
//!
//! The processors run in HF `generate`'s order: repetition penalty (CTRL, Keskar et al.
//! 2019: a seen token's positive logit is divided by the penalty, a negative one
//! multiplied), then temperature, then top-k, top-p (nucleus, Holtzman et al. 2019: the
//! smallest set of most likely tokens whose probability reaches p) and min-p (tokens
//! below `min_p` times the top probability are dropped). Temperature 0 is greedy: the
//! argmax after the penalty, no randomness.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sampling parameters. The defaults are greedy decoding.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Drop tokens below `min_p * p_max`; 0 disables.
    pub min_p: f32,
    /// Repetition penalty (> 0); 1 disables.
    pub repetition_penalty: f32,
    /// Seed of the generator (ChaCha8).
    pub seed: u64,
    /// `Some`: the reply must match this grammar (JSON mode, a JSON Schema, a Lark
    /// grammar); the engine compiles it before any token is generated and masks each
    /// step's logits to the tokens it allows ([`crate::grammar`]), before the
    /// processors above. `None`: unconstrained.
    pub grammar: Option<crate::grammar::GrammarSpec>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
            grammar: None,
        }
    }
}

impl SamplingParams {
    /// Checks every parameter is in range.
    ///
    /// # Errors
    /// A message naming the parameter and its allowed range.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "temperature {} must be a finite number >= 0",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!(
                "repetition_penalty {} must be a finite number > 0",
                self.repetition_penalty
            ));
        }
        Ok(())
    }

    /// Whether these parameters decode greedily.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// A sampler: parameters plus its generator state.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// The logits over the temperature, `[vocab]`.
    scaled: Vec<f32>,
    /// `exp(scaled − max)`, `[vocab]`.
    weights: Vec<f32>,
    /// The head of the candidates in sampling order ([`Ranked`]).
    head: Vec<(f32, u32)>,
}

impl Sampler {
    /// A sampler seeded with `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Sampler {
            params,
            rng,
            scaled: Vec::new(),
            weights: Vec::new(),
            head: Vec::new(),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token from `logits` (`[vocab]`), penalising ids in `history`.
    ///
    /// Past the penalty and the temperature: the candidates are the non-NaN ids in
    /// sampling order (scaled logit descending, lower id first on ties); each has weight
    /// `w = exp(l/T − max)` (an `f32` exponential, [`fak_tensor::exp::exp_sub_in_place`])
    /// and probability `w / total`, `total` the `f64` sum of the weights in id order
    /// (`weight_total`; of the first `top_k` in sampling order when top-k cuts); top-p keeps the
    /// shortest head whose cumulative probability reaches `top_p`, min-p the head at
    /// least `min_p` times the first; one uniform draw `u` in `[0, mass)` (`mass` the
    /// kept probability, 1 when nothing is cut) picks the first candidate whose
    /// cumulative probability exceeds `u`. Only as much of the order is sorted as these
    /// steps read (`Ranked`): a 262,144-token vocabulary was sorted whole for every
    /// token, ~8 ms a token on a Zen 5. With no finite or an infinite largest scaled
    /// logit the first id holding it is taken (a session refuses NaN logits before).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let mut adjusted;
        let logits = if p.repetition_penalty != 1.0 && !history.is_empty() {
            adjusted = logits.to_vec();
            let mut seen = history.to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &id in &seen {
                if let Some(l) = adjusted.get_mut(id as usize) {
                    *l = if *l < 0.0 {
                        *l * p.repetition_penalty
                    } else {
                        *l / p.repetition_penalty
                    };
                }
            }
            &adjusted[..]
        } else {
            logits
        };
        if p.is_greedy() {
            return fak_model::argmax(logits);
        }
        let s = &mut self.scaled;
        s.clear();
        s.extend(logits.iter().map(|&l| l / p.temperature));
        let max = fak_tensor::max_skipping_nan(s);
        if !max.is_finite() {
            // The scaled logits overflowed (a temperature so small that `l / T` is
            // infinite): the distribution at that temperature is all on the largest
            // logit, greedy's token. The argmax of the unscaled logits, not of the
            // scaled ones, where every overflowed logit ties at +inf and the lowest id
            // among them would win.
            return fak_model::argmax(logits);
        }
        let w = &mut self.weights;
        w.clear();
        w.extend_from_slice(s);
        fak_tensor::exp::exp_sub_in_place(w, max);
        let (n, total_all) = weight_total(w);
        let mut r = Ranked::new(s, max, &mut self.head);
        let limit = if p.top_k > 0 && p.top_k < n {
            p.top_k
        } else {
            n
        };
        let total = if limit < n {
            r.ensure(limit);
            r.head[..limit]
                .iter()
                .fold(0f64, |t, &(_, i)| t + w[i as usize] as f64)
        } else {
            total_all
        };
        let q = |head: &[(f32, u32)], i: usize| w[head[i].1 as usize] as f64 / total;
        let mut keep = limit;
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for i in 0..limit {
                r.ensure(i + 1);
                cum += q(r.head, i);
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            r.ensure(1);
            let floor = q(r.head, 0) * p.min_p as f64;
            let mut i = 1;
            while i < keep && r.ensure(i + 1) && q(r.head, i) >= floor {
                i += 1;
            }
            keep = keep.min(i);
        }
        let mass = if keep < n {
            r.ensure(keep);
            (0..keep).fold(0f64, |m, i| m + q(r.head, i))
        } else {
            1.0
        };
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * mass;
        let mut cum = 0.0;
        for i in 0..keep {
            r.ensure(i + 1);
            cum += q(r.head, i);
            if u < cum {
                return r.head[i].1;
            }
        }
        r.ensure(keep);
        r.head[keep - 1].1
    }
}

/// The number of non-NaN weights and their `f64` sum: eight partial sums, weight `i`
/// into sum `i mod 8` in id order, added as `((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7))`
/// (eight chains of adds in flight instead of one over the whole vocabulary).
fn weight_total(w: &[f32]) -> (usize, f64) {
    let mut sums = [0f64; 8];
    let mut nan = 0usize;
    let mut chunks = w.chunks_exact(8);
    for c in &mut chunks {
        for (s, &x) in sums.iter_mut().zip(c) {
            nan += x.is_nan() as usize;
            *s += if x.is_nan() { 0.0 } else { x as f64 };
        }
    }
    for (s, &x) in sums.iter_mut().zip(chunks.remainder()) {
        nan += x.is_nan() as usize;
        *s += if x.is_nan() { 0.0 } else { x as f64 };
    }
    let total =
        ((sums[0] + sums[4]) + (sums[2] + sums[6])) + ((sums[1] + sums[5]) + (sums[3] + sums[7]));
    (w.len() - nan, total)
}

/// The candidates of [`Sampler::sample`] in sampling order, sorted only as far as
/// asked: the ids whose scaled logit is at least `max − 4`, sorted; then, each time more
/// are read, those between `max − 8` (then `− 16`, `− 32`, `− 64`, then all) and the
/// last threshold, sorted and appended. Every candidate below a threshold sorts after
/// every one at or above it, so each head is the start of the whole order, and no id
/// is sorted twice.
struct Ranked<'a> {
    scaled: &'a [f32],
    max: f32,
    /// Thresholds tried so far.
    step: usize,
    /// The last threshold: the head holds exactly the candidates at or above it.
    above: f32,
    /// The sorted head.
    head: &'a mut Vec<(f32, u32)>,
    /// The head holds every candidate.
    complete: bool,
}

impl<'a> Ranked<'a> {
    fn new(scaled: &'a [f32], max: f32, head: &'a mut Vec<(f32, u32)>) -> Self {
        head.clear();
        Ranked {
            scaled,
            max,
            step: 0,
            above: f32::INFINITY,
            head,
            complete: false,
        }
    }

    /// Sorts at least the first `k` candidates if there are that many; whether there
    /// are.
    fn ensure(&mut self, k: usize) -> bool {
        const BELOW_MAX: [f32; 5] = [4.0, 8.0, 16.0, 32.0, 64.0];
        while self.head.len() < k && !self.complete {
            let tau = BELOW_MAX
                .get(self.step)
                .map_or(f32::NEG_INFINITY, |d| self.max - d);
            self.step += 1;
            self.complete = tau == f32::NEG_INFINITY;
            let (above, from) = (self.above, self.head.len());
            // The band [tau, above): NaN is in no band, so never a candidate. The
            // largest value (`max`, finite) is below the first `above` (+inf).
            self.head.extend(
                self.scaled
                    .iter()
                    .enumerate()
                    .filter(|(_, &v)| v >= tau && v < above)
                    .map(|(i, &v)| (v, i as u32)),
            );
            self.head[from..].sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            self.above = tau;
        }
        self.head.len() >= k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 0.5, 2.9]
    }

    fn draw(p: SamplingParams, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(p);
        (0..n).map(|_| s.sample(&logits(), &[])).collect()
    }

    #[test]
    fn temperature_zero_is_argmax() {
        assert!(draw(SamplingParams::default(), 10).iter().all(|&t| t == 1));
    }

    /// A positive temperature so small that every positive logit over it is +inf:
    /// the largest logit's token, as greedy (before: the lowest id of those that
    /// overflowed, id 0 here).
    #[test]
    fn a_vanishing_temperature_is_argmax() {
        for temperature in [1e-38, 1e-40, f32::from_bits(1)] {
            let mut s = Sampler::new(SamplingParams {
                temperature,
                ..Default::default()
            });
            assert_eq!(
                s.sample(&[5.0, 30.0, 20.0, -4.0], &[]),
                1,
                "{temperature:e}"
            );
        }
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let p = |seed| SamplingParams {
            temperature: 1.5,
            seed,
            ..Default::default()
        };
        assert_eq!(draw(p(7), 200), draw(p(7), 200));
        assert_ne!(draw(p(7), 200), draw(p(8), 200));
    }

    #[test]
    fn truncations_keep_only_the_head() {
        let hot = SamplingParams {
            temperature: 2.0,
            seed: 3,
            ..Default::default()
        };
        // top-k 2: only ids 1 and 5 (logits 3.0 and 2.9).
        let k2 = draw(
            SamplingParams {
                top_k: 2,
                ..hot.clone()
            },
            300,
        );
        assert!(k2.iter().all(|&t| t == 1 || t == 5));
        assert!(k2.contains(&1) && k2.contains(&5));
        // top-p tiny / min-p 1 / top-k 1: always the argmax.
        for p in [
            SamplingParams {
                top_p: 1e-6,
                ..hot.clone()
            },
            SamplingParams {
                min_p: 1.0,
                ..hot.clone()
            },
            SamplingParams {
                top_k: 1,
                ..hot.clone()
            },
        ] {
            assert!(draw(p, 50).iter().all(|&t| t == 1));
        }
        // Untruncated at high temperature every token appears.
        let all = draw(hot, 2000);
        assert!((0..6).all(|t| all.contains(&t)));
    }

    /// [`Sampler::sample`]'s steps (no penalty) with the whole vocabulary sorted first,
    /// from the raw draw `x`.
    fn sample_sorting_all(p: &SamplingParams, logits: &[f32], x: u64) -> u32 {
        let s: Vec<f32> = logits.iter().map(|&l| l / p.temperature).collect();
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return s.iter().position(|&v| v == max).unwrap_or(0) as u32;
        }
        let w = |i: u32| (s[i as usize] - max).exp();
        let mut c: Vec<(f32, u32)> = (0..s.len() as u32)
            .filter(|&i| !s[i as usize].is_nan())
            .map(|i| (s[i as usize], i))
            .collect();
        c.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let n = c.len();
        let total: f64 = if p.top_k > 0 && p.top_k < n {
            c.truncate(p.top_k);
            c.iter().fold(0.0, |t, &(_, i)| t + w(i) as f64)
        } else {
            // Eight partial sums in id order (`weight_total`'s order), NaN as 0.
            let mut sums = [0f64; 8];
            for i in 0..s.len() as u32 {
                if !s[i as usize].is_nan() {
                    sums[i as usize % 8] += w(i) as f64;
                }
            }
            ((sums[0] + sums[4]) + (sums[2] + sums[6]))
                + ((sums[1] + sums[5]) + (sums[3] + sums[7]))
        };
        let q: Vec<f64> = c.iter().map(|&(_, i)| w(i) as f64 / total).collect();
        let mut keep = q.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            if let Some(i) = q.iter().position(|x| {
                cum += x;
                cum >= p.top_p as f64
            }) {
                keep = i + 1;
            }
        }
        if p.min_p > 0.0 {
            let floor = q[0] * p.min_p as f64;
            keep = keep.min(q.iter().take_while(|&&x| x >= floor).count().max(1));
        }
        let mass = if keep < n {
            q[..keep].iter().fold(0.0, |m, x| m + x)
        } else {
            1.0
        };
        let u = (x >> 11) as f64 / (1u64 << 53) as f64 * mass;
        let mut cum = 0.0;
        for (i, x) in q[..keep].iter().enumerate() {
            cum += x;
            if u < cum {
                return c[i].1;
            }
        }
        c[keep - 1].1
    }

    #[test]
    fn sorting_only_the_head_picks_what_sorting_all_picks() {
        let mut state = 0x51u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            state >> 11
        };
        for vocab in [1usize, 2, 7, 100, 3000] {
            for spread in [0.5f32, 8.0, 60.0, 400.0] {
                let mut logits: Vec<f32> = (0..vocab)
                    .map(|_| (next() % 10_000) as f32 / 10_000.0 * spread - spread / 2.0)
                    .collect();
                if vocab > 10 {
                    // Ties, NaN and -inf among the candidates.
                    logits[3] = logits[5];
                    logits[7] = f32::NAN;
                    logits[9] = f32::NEG_INFINITY;
                }
                for (t, k, tp, mp) in [
                    (1.0f32, 0usize, 1.0f32, 0.0f32),
                    (0.7, 0, 0.9, 0.0),
                    (1.3, 40, 0.95, 0.05),
                    (2.0, 0, 1.0, 0.1),
                    (0.5, 5, 1.0, 0.0),
                    (1.0, 0, 0.999_999, 0.0),
                ] {
                    let p = SamplingParams {
                        temperature: t,
                        top_k: k,
                        top_p: tp,
                        min_p: mp,
                        seed: next(),
                        ..Default::default()
                    };
                    let mut sampler = Sampler::new(p.clone());
                    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
                    for _ in 0..20 {
                        let want = sample_sorting_all(&p, &logits, rng.next_u64());
                        assert_eq!(
                            sampler.sample(&logits, &[]),
                            want,
                            "vocab {vocab}, spread {spread}, {p:?}"
                        );
                    }
                }
            }
        }
        // No finite logit: the first id holding the largest.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            ..Default::default()
        });
        assert_eq!(
            s.sample(&[f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY], &[]),
            1
        );
        assert_eq!(s.sample(&[1.0, f32::INFINITY, f32::INFINITY], &[]), 1);
        assert_eq!(s.sample(&[f32::NAN; 3], &[]), 0);
    }

    #[test]
    fn repetition_penalty_follows_ctrl() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        // id 1 (3.0) penalised to 1.5 and id 5 (2.9) to 1.45: id 2 (2.5) wins.
        assert_eq!(s.sample(&logits(), &[1, 5, 1]), 2);
        // A negative logit is multiplied: id 3 (-1.0) becomes -2.0, still not chosen.
        assert_eq!(s.sample(&[-1.0, -1.5], &[0]), 1);
    }

    #[test]
    fn bad_parameters_are_rejected() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                min_p: -0.1,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
        ] {
            assert!(p.validate().is_err(), "{p:?}");
        }
    }
}
