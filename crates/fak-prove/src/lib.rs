//! fak-prove: the proof ladder's runner, what `fak prove` prints.
//!
//! One job: measure a model fak loaded against witnesses it did not write, and report
//! each claim of `docs/proof-ladder.md` with a verdict.
//!
//! - [`oracle`]: reads the HF transformers oracle fixtures (safetensors files written by
//!   `oracle-export/export_oracle.py`, never by fak; committed under
//!   `testdata/oracles/<model>/`) and [`oracle::measure`]s a model against one: the
//!   embedding, every layer's hidden state, the final norm, the logits and argmax at each
//!   position (R1), and the greedy continuation of HF `generate` (R2b).
//! - [`prove`]: the ladder on one model, a [`Report`] of [`Rung`]s: R1 and R2b against
//!   the oracle files when given, then the KV-cache rungs on fak-kv's
//!   [`Session`](fak_kv::Session): R2a (decode == prefill), R3 (write-time evict ==
//!   never-saw, against HF's never-saw continuation where R3 oracles exist, with both
//!   negative controls, and the mid-span rotation), R14 (prefix clone == recompute) and
//!   the sliding-window rungs (W).
//!
//! This crate sits above fak-model and fak-kv and below the CLI; lower crates use it only
//! as a dev-dependency, in their integration tests.

pub mod ladder;
pub mod oracle;

pub use ladder::{prove, prove_kv, Report, Rung, Verdict};
