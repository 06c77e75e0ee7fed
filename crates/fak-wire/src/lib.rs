//! fak-wire: the HTTP APIs fak speaks, as serde types — one definition per shape.
//!
//! The gateway (fak-gateway) parses requests into these types and writes its responses
//! and stream events from them; the upstream drivers (when fak fronts another server)
//! write their requests and parse the upstream's replies with the same types. No other
//! crate spells a wire shape by hand.
//!
//! - [`openai`]: the OpenAI Chat Completions, Completions and Models APIs.
//! - [`responses`]: the OpenAI Responses API.
//! - [`anthropic`]: the Anthropic Messages, count_tokens and Models APIs.
//!
//! Each type's docs name the API reference (and the official SDK type) it follows.
//! Fields fak accepts but does not act on are listed in one place per API, so a
//! request that would change the output in a way fak cannot honour is a 400 naming the
//! field rather than a silently different answer.

pub mod anthropic;
pub mod openai;
pub mod responses;

mod de;
