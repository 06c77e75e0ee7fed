//! Tool calls at the boundary: the `tools` / `tool_choice` fields of both wires, and the
//! adjudication of every call the model proposes before a client sees it.
//!
//! Each proposed call is decided in order: a call the model wrote malformed is denied
//! `MALFORMED` (fail closed: it never reaches the client as a callable call); a call of
//! a tool the request did not offer is denied `UNKNOWN_TOOL`; the rest go to the policy
//! ([`fak_engine::policy::Policy::adjudicate`]: deny entries, allow lists, argument
//! rules, credentials in arguments, the per-conversation rate). Only allowed calls are
//! returned as calls; the response's `fak` extension field lists every proposed call
//! with its verdict and reason, so a client (or its operator) can see what was removed
//! and why.

use crate::error::ApiError;
use crate::AppState;
use axum::http::HeaderMap;
use fak_engine::policy::{CallVerdict, ToolCall as PolicyCall};
use fak_engine::{Message, ToolCall, ToolChoice, ToolSpec};
use serde_json::{json, Value};
use std::hash::{Hash, Hasher};

/// Tool names as OpenAI accepts them: 1 to 64 of `[A-Za-z0-9_-]`.
pub(crate) fn check_tool_name(name: &str, at: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "{at} '{name}' is not a valid tool name (1 to 64 letters, digits, '_' or '-')"
        )))
    }
}

/// Checks a tool list for duplicate names and a `tool_choice` against it.
pub(crate) fn check_tools(tools: &[ToolSpec], choice: &ToolChoice) -> Result<(), ApiError> {
    for (i, t) in tools.iter().enumerate() {
        if tools[..i].iter().any(|u| u.name == t.name) {
            return Err(ApiError::bad_request(format!(
                "tools holds '{}' twice",
                t.name
            )));
        }
    }
    match choice {
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(ApiError::bad_request(
            format!("tool_choice names '{n}', which is not in tools"),
        )),
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => Err(
            ApiError::bad_request("tool_choice requires a tool, but no tools were given"),
        ),
        _ => Ok(()),
    }
}

/// The conversation a request belongs to, for the per-conversation rate limit: the
/// `x-fak-conversation` header when the client sends one, else a hash of the
/// conversation's opening (its first system and first user message), which every turn
/// of one conversation repeats.
pub(crate) fn conversation_key(headers: &HeaderMap, messages: &[Message]) -> String {
    if let Some(v) = headers
        .get("x-fak-conversation")
        .and_then(|v| v.to_str().ok())
    {
        return v.to_string();
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for role in ["system", "user"] {
        if let Some(m) = messages.iter().find(|m| m.role == role) {
            m.content.hash(&mut h);
        }
    }
    format!("conv-{:016x}", h.finish())
}

/// The decisions on one response's proposed calls.
#[derive(Clone, Debug, Default)]
pub(crate) struct Adjudicated {
    /// The calls the client may act on, in order.
    pub allowed: Vec<ToolCall>,
    /// Denied calls and why.
    pub denied: Vec<(ToolCall, CallVerdict)>,
    /// The `fak` extension field (`None` when no call was proposed).
    pub report: Option<Value>,
}

/// Decides every proposed call (see the module docs). Always returns quickly: the
/// policy lock is held only for the decisions.
pub(crate) fn adjudicate(
    s: &AppState,
    conversation: &str,
    offered: &[ToolSpec],
    calls: Vec<ToolCall>,
) -> Adjudicated {
    if calls.is_empty() {
        return Adjudicated::default();
    }
    let mut out = Adjudicated::default();
    let mut report = Vec::with_capacity(calls.len());
    let mut policy = s.policy.lock().unwrap_or_else(|p| p.into_inner());
    for call in calls {
        let verdict = if let Some(why) = &call.malformed {
            CallVerdict {
                allowed: false,
                reason: Some(fak_engine::policy::DenyReason::Malformed),
                detail: why.clone(),
            }
        } else if !offered.iter().any(|t| t.name == call.name) {
            CallVerdict {
                allowed: false,
                reason: Some(fak_engine::policy::DenyReason::UnknownTool),
                detail: format!("'{}' is not among the tools the request offered", call.name),
            }
        } else {
            policy.adjudicate(
                conversation,
                &PolicyCall {
                    name: call.name.clone(),
                    arguments: call.arguments.clone(),
                },
            )
        };
        report.push(json!({
            "id": call.id,
            "name": call.name,
            "verdict": if verdict.allowed { "allow" } else { "deny" },
            "reason": verdict.reason.map(|r| r.as_str()),
            "detail": verdict.detail,
        }));
        if verdict.allowed {
            out.allowed.push(call);
        } else {
            out.denied.push((call, verdict));
        }
    }
    out.report = Some(json!({ "tool_calls": report }));
    out
}

/// The sentence a client sees for a denied call (Anthropic's explanatory text block).
pub(crate) fn denial_text(call: &ToolCall, v: &CallVerdict) -> String {
    format!(
        "[fak] The tool call '{}' was not passed on: {} ({}).",
        call.name,
        v.reason.map_or("DENIED", |r| r.as_str()),
        v.detail
    )
}

/// A JSON object from a call's arguments text (`{}` for anything else; only allowed,
/// hence well-formed, calls reach this).
pub(crate) fn arguments_object(call: &ToolCall) -> Value {
    match serde_json::from_str(&call.arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}
