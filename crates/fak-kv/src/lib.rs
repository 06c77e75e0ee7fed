//! fak-kv: the attention state fak owns, and the session that fills it.
//!
//! One job: hold each conversation's KV cache as plain buffers the kernel controls, so
//! that operations other engines can only approximate are exact here:
//!
//! - **decode == prefill** (rung R2a): a token's K/V rows and logits are the same bits
//!   whether it was decoded step by step or prefilled in a batch (fak-tensor's fixed
//!   reduction order);
//! - **write-time eviction == never-saw** (R3): [`Session::evict`] removes a span from
//!   every layer and renumbers the survivors, re-deriving each moved K from its stored
//!   pre-RoPE `k_raw` in one rotation, so the cache equals one that never held the span;
//! - **prefix clone == recompute** (R14): [`Session::from_prefix`] deep-copies a cache and
//!   prefills only the suffix;
//! - **sliding windows** are found from the stored absolute positions
//!   ([`fak_model::window_start`]), so they stay right after an eviction, and a bounded
//!   mode drops entries no window can reach ([`Session::drop_oldest`]);
//! - **a decode step allocates nothing** ([`Session::decode`]): the forward pass works in
//!   buffers the session keeps, and the logits are written into a kept row
//!   (`tests/decode_alloc.rs` counts the heap allocations of such steps: zero).
//!
//! - **batch invariance**: sessions attached to a [`Batcher`] run their passes together
//!   ([`fak_model::Model::forward_batch`]: one pass over the weights for all of them),
//!   each with the bits of its solo run ([`batch`]);
//! - **shared prefixes stored once**: [`KvCache::freeze`] makes a cache's entries an
//!   immutable reference-counted block that clones read in place (copy on write from
//!   the first entry an eviction renumbers), with the bits of private copies
//!   (`tests/shared_prefix.rs`).
//!
//! On top of the session: [`sampling`] (greedy, temperature, top-k/p, min-p, repetition
//! penalty, seeded), [`grammar`] (constrained decoding: a JSON schema's or a Lark
//! grammar's allowed tokens mask each step's logits, through llguidance), [`logprobs`] (log-softmax of the raw logits per generated token),
//! [`stop`] (stop strings held back until decided), [`text`]
//! (streaming text generation with TTFT and tokens/s) and [`chat`] (a conversation whose
//! cache is kept between turns, so a turn prefills only its new tokens).
//!
//! The fak-prove crate runs these rungs (and R1 against a committed HF oracle) on any
//! model and reports a table: it is what `fak prove` prints.

pub mod batch;
mod cache;
pub mod chat;
pub mod grammar;
pub mod logprobs;
pub mod persist;
pub mod sampling;
mod session;
pub mod stop;
pub mod text;

pub use batch::{BatchPolicy, BatchStats, Batcher, BATCH_SIZE_BOUNDS};
pub use cache::{KvCache, KvError};
pub use chat::{ChatFile, ChatRestoreError, ChatSession, ChatTurnError, TurnStats};
pub use fak_model::{window_start, KvType};
pub use grammar::{Grammar, GrammarCompiler, GrammarError, GrammarSpec};
pub use logprobs::{TokenLogprob, TopLogprob};
pub use sampling::{Sampler, SamplingParams};
pub use session::{GenerateParams, Session, SessionError};
pub use stop::StopStrings;
pub use text::{generate_text, generate_text_with_logprobs, FinishReason, TextOutput, TextParams};
