//! fak-ctxmmu: the context MMU. One job: decide, before tokenization, whether a tool
//! result may enter a model's context.
//!
//! Every inbound tool result (OpenAI `role: "tool"`, Anthropic `tool_result`) goes through
//! [`Screen::admit`], which runs the [`Detector`]s over the text and its normalized forms
//! ([`normalize`]: NFKC, case, zero-width characters, homoglyphs, spacing) and returns a
//! [`Verdict`]:
//!
//! - [`Verdict::Admit`]: the text enters the context as is;
//! - [`Verdict::PageOut`]: a large benign result is replaced by a short pointer stub and
//!   kept in the page-out store, retrievable by id;
//! - [`Verdict::Quarantine`]: the content is replaced in place by a stub such as
//!   `{"_quarantined":true,"id":"q7","reason":"TRUST_VIOLATION","len":1234}`; the original
//!   is kept in the store, readable only after an explicit operator clear.
//!
//! Every decision is written to an [`AuditLog`] (JSON lines: time, conversation, tool,
//! verdict, reason, detector, byte length, digest; one whole line per `write`, rotated by
//! size, optionally fail-closed). A digest can be revoked ([`Screen::revoke_digest`]):
//! the same content arriving again is quarantined; revocations are persisted with a
//! folder store ([`Revocations`]). The store, the revocations and the screen's maps are
//! all bounded ([`PageStore`], [`Screen`]).
//!
//! The detectors are heuristics: they catch the shapes in the red-team corpus under
//! `testdata/ctxmmu` and more, and they will miss attacks no pattern anticipates. The
//! catch and false-positive rates are measured and reported, never tuned to a threshold
//! (`docs/ctxmmu.md`).

mod audit;
mod detect;
mod normalize;
mod revoked;
mod screen;
mod store;

pub use audit::{AuditConfig, AuditError, AuditLog, AuditRecord};
pub use detect::{
    default_detectors, ControlTokenDetector, Detector, Finding, InjectionDetector, Reason,
    SecretDetector,
};
pub use normalize::{normalize, squash, Normalized};
pub use revoked::{Revocations, RevokeError, MAX_REVOCATIONS, REVOKED_FILE};
pub use screen::{
    digest, Screen, ScreenConfig, ScreenError, ToolResult, Verdict, MAX_REMEMBERED, UNKEPT,
};
pub use store::{
    PageStore, StoreError, StoreLimits, StoredHead, StoredItem, StoredKind, StoredMeta,
    PREVIEW_CHARS, STALE_TMP,
};
