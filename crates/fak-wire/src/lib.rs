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

/// fak's extension field `context_overflow` (Chat Completions and Messages): what the
/// in-kernel engine does when the conversation, with room for the reply, no longer
/// fits the model's context window. `error`: refused (400), as without the field;
/// `shift`: the oldest whole turns dropped from the cached conversation in place
/// (fast; an approximation, as llama.cpp's context shift); `rebuild`: the oldest whole
/// turns dropped and the rest prefilled anew (exact). A leading system turn and the
/// last turn are never dropped.
#[derive(serde::Serialize, serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ContextOverflow {
    /// Refuse the request.
    Error,
    /// Drop the oldest turns from the cached conversation in place (approximate).
    Shift,
    /// Drop the oldest turns and prefill the rest anew (exact).
    Rebuild,
}

/// The full path and message of a deserialization error: `path` is where
/// `serde_path_to_error` stopped (`.` for the top, `content[1]`, ...), `message` the
/// error's text. Inside the wire's tagged unions (stream events, content blocks, deltas:
/// read without serde's buffer, see the types' docs) the message starts with the rest of
/// the path, `` at `input.x`: ``; the two are joined here. Returns (`.` or the path,
/// the message without the path).
pub fn error_path(path: &str, message: &str) -> (String, String) {
    let Some((rest, message)) = message
        .strip_prefix("at `")
        .and_then(|m| m.split_once("`: "))
    else {
        return (path.to_string(), message.to_string());
    };
    (join_path(path, rest), message.to_string())
}

/// `inner`, a path inside the value at `outer` (`.`: the top), as one path.
fn join_path(outer: &str, inner: &str) -> String {
    if outer == "." {
        inner.to_string()
    } else if inner == "." {
        outer.to_string()
    } else if inner.starts_with('[') {
        format!("{outer}{inner}")
    } else {
        format!("{outer}.{inner}")
    }
}
