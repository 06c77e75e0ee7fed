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
    scratch: Vec<(f32, u32)>,
}

impl Sampler {
    /// A sampler seeded with `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Sampler {
            params,
            rng,
            scratch: Vec::new(),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token from `logits` (`[vocab]`), penalising ids in `history`.
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
        // Candidates sorted by logit, highest first (ties: lower id first).
        let c = &mut self.scratch;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan())
                .map(|(i, &l)| (l / p.temperature, i as u32)),
        );
        if c.is_empty() {
            return 0;
        }
        c.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        if p.top_k > 0 && p.top_k < c.len() {
            c.truncate(p.top_k);
        }
        // Softmax over the survivors (in f64 for a stable cumulative sum).
        let max = c[0].0 as f64;
        let mut probs: Vec<f64> = c.iter().map(|(l, _)| (*l as f64 - max).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, q) in probs.iter().enumerate() {
                cum += q;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        let mass: f64 = probs[..keep].iter().sum();
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * mass;
        let mut cum = 0.0;
        for (i, q) in probs[..keep].iter().enumerate() {
            cum += q;
            if u < cum {
                return c[i].1;
            }
        }
        c[keep - 1].1
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
