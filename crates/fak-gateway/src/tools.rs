//! The kernel boundary on the wire: the `tools` / `tool_choice` fields of both wires,
//! the screening of every inbound tool result before the engine sees it, the
//! adjudication of every call the model proposes before a client sees it, and the
//! operator routes (`/v1/fak/revoke`, `/v1/fak/policy/reload`).
//!
//! **Screening** ([`screen_messages`]): each `tool` message goes through
//! [`fak_ctxmmu::Screen::admit_fresh`]; a quarantined or paged-out result is replaced by
//! its stub before tokenization, so it never enters the KV cache. A result quarantined
//! for the first time may still sit in conversations cached before (admitted then,
//! caught now after a revocation), so the engine is told to cut it out
//! ([`fak_engine::EngineDriver::revoke`]). A store failure fails the request (500):
//! nothing unscreened goes through.
//!
//! Each proposed call is decided in order: a call the model wrote malformed is denied
//! `MALFORMED` (fail closed: it never reaches the client as a callable call); a call of
//! a tool the request did not offer is denied `UNKNOWN_TOOL`; the rest go to the policy
//! ([`fak_engine::policy::Policy::adjudicate`]: deny entries, allow lists, argument
//! rules, credentials in arguments, the per-conversation rate). Only allowed calls are
//! returned as calls; the response's `fak` extension field lists every proposed call
//! with its verdict and reason, so a client (or its operator) can see what was removed
//! and why.

use crate::error::{ApiError, Flavor};
use crate::{parse_body, AppState};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use fak_ctxmmu::{AuditRecord, ToolResult, Verdict};
use fak_engine::policy::{CallVerdict, ToolCall as PolicyCall};
use fak_engine::{Message, Revocation, ToolCall, ToolChoice, ToolSpec};
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
    let mut audit = Vec::with_capacity(calls.len());
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
        let word = if verdict.allowed { "allow" } else { "deny" };
        let reason = verdict.reason.map(|r| r.as_str());
        s.metrics.count_tool_call(word, reason.unwrap_or(""));
        audit.push(AuditRecord {
            time: now_s(),
            conversation: conversation.to_string(),
            tool: call.name.clone(),
            verdict: word,
            reason,
            detector: Some(if call.malformed.is_some() {
                "parser"
            } else if reason == Some("UNKNOWN_TOOL") {
                "offer"
            } else {
                "policy"
            }),
            id: Some(call.id.clone()),
            bytes: call.arguments.len(),
            digest: fak_ctxmmu::digest(&call.arguments),
        });
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
    drop(policy);
    let mut screen = s.screen.lock().unwrap_or_else(|p| p.into_inner());
    for r in audit {
        screen.audit_mut().record(r);
    }
    out.report = Some(json!({ "tool_calls": report }));
    out
}

fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The name of the tool whose call `id` answers: from the assistant `tool_calls`
/// earlier in the conversation, else the message's own `name`, else `unknown`.
fn tool_name(messages: &[Message], i: usize) -> String {
    let m = &messages[i];
    let from_call = m.tool_call_id.as_deref().and_then(|id| {
        messages[..i].iter().rev().find_map(|a| {
            a.tool_calls.as_ref()?.as_array()?.iter().find_map(|c| {
                (c.get("id")?.as_str()? == id)
                    .then(|| c.pointer("/function/name")?.as_str().map(str::to_string))
                    .flatten()
            })
        })
    });
    from_call
        .or_else(|| m.name.clone())
        .unwrap_or_else(|| "unknown".into())
}

/// Screens every `tool` message of `messages` in place (see the module docs) and
/// returns the `fak.tool_results` entries of those not admitted as they were.
///
/// # Errors
/// 500 when the page-out store cannot keep an original (nothing is admitted then).
pub(crate) fn screen_messages(
    s: &AppState,
    conversation: &str,
    messages: &mut [Message],
    flavor: Flavor,
) -> Result<Vec<Value>, ApiError> {
    let mut report = Vec::new();
    let mut revoke = Vec::new();
    {
        let mut screen = s.screen.lock().unwrap_or_else(|p| p.into_inner());
        for i in 0..messages.len() {
            if messages[i].role != "tool" {
                continue;
            }
            let tool = tool_name(messages, i);
            let m = &messages[i];
            let (verdict, fresh) = screen
                .admit_fresh(&ToolResult {
                    conversation,
                    tool: &tool,
                    tool_call_id: m.tool_call_id.as_deref(),
                    content: &m.content,
                })
                .map_err(|e| {
                    ApiError::internal(format!("screening a tool result: {e}")).with_flavor(flavor)
                })?;
            let (word, reason, id) = match &verdict {
                Verdict::Admit => ("admit", None, None),
                Verdict::PageOut { id, .. } => ("page_out", None, Some(id.clone())),
                Verdict::Quarantine { id, reason, .. } => {
                    ("quarantine", Some(reason.as_str()), Some(id.clone()))
                }
            };
            if fresh {
                s.metrics.count_tool_result(word, reason.unwrap_or(""));
                if word == "quarantine" {
                    revoke.push(Revocation {
                        digest: Some(fak_ctxmmu::digest(&m.content)),
                        tool_call_id: None,
                    });
                }
            }
            if word != "admit" {
                let stub = verdict.context_text(&m.content).to_string();
                report.push(json!({
                    "tool_call_id": m.tool_call_id, "tool": tool, "verdict": word,
                    "reason": reason, "id": id, "stub": stub,
                }));
                messages[i].content = stub;
            }
        }
    }
    for r in revoke {
        let k = s.driver.revoke(&r);
        if k.sessions > 0 {
            tracing::info!(
                target: "fak::boundary",
                "quarantined content cut out of {} cached conversation(s), {} KV positions",
                k.sessions,
                k.tokens_dropped
            );
        }
    }
    Ok(report)
}

/// The response's `fak` field: the screened results and the adjudicated calls, or
/// `None` when there is nothing to say.
pub(crate) fn fak_field(results: &[Value], a: &Adjudicated) -> Option<Value> {
    let mut v = a.report.clone().unwrap_or_else(|| json!({}));
    if !results.is_empty() {
        v["tool_results"] = Value::Array(results.to_vec());
    }
    (v.as_object().is_some_and(|o| !o.is_empty())).then_some(v)
}

/// `POST /v1/fak/revoke` body.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RevokeBody {
    tool_call_id: Option<String>,
    digest: Option<String>,
}

/// `POST /v1/fak/revoke`: from now on the named content is quarantined (`REVOKED`)
/// wherever it arrives, and it is cut out of every cached conversation now (unless the
/// engine runs with `--no-kv-evict`). Answers what was cut.
pub(crate) async fn revoke(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let f = Flavor::OpenAi;
    let b: RevokeBody = parse_body(&s, body, f)?;
    if b.tool_call_id.is_none() && b.digest.is_none() {
        return Err(
            ApiError::bad_request("name a `tool_call_id` or a `digest` to revoke").with_flavor(f),
        );
    }
    if let Some(d) = &b.digest {
        if d.len() != 64 || !d.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(ApiError::bad_request(
                "digest must be the sha256 of the content, 64 hex digits",
            )
            .with_flavor(f));
        }
    }
    {
        let mut screen = s.screen.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = &b.digest {
            screen.revoke_digest(d);
        }
        if let Some(c) = &b.tool_call_id {
            screen.revoke_call(c);
        }
    }
    let r = Revocation {
        digest: b.digest.map(|d| d.to_ascii_lowercase()),
        tool_call_id: b.tool_call_id,
    };
    let driver = std::sync::Arc::clone(&s.driver);
    let rr = r.clone();
    let k = tokio::task::spawn_blocking(move || driver.revoke(&rr))
        .await
        .map_err(|e| ApiError::internal(format!("revoke failed: {e}")).with_flavor(f))?;
    tracing::info!(
        target: "fak::boundary",
        "revoked {:?}: {} cached conversation(s) cut, {} KV positions",
        r,
        k.sessions,
        k.tokens_dropped
    );
    Ok(Json(json!({
        "revoked": {"tool_call_id": r.tool_call_id, "digest": r.digest},
        "kv": {"sessions": k.sessions, "tokens_dropped": k.tokens_dropped},
    })))
}

/// `POST /v1/fak/policy/reload`: reads the `--policy` file again. An unreadable or
/// invalid manifest is a 400 saying why, and the policy in force stays.
pub(crate) async fn reload_policy(State(s): State<AppState>) -> Result<Json<Value>, ApiError> {
    let f = Flavor::OpenAi;
    let Some(path) = s.config.policy_path.clone() else {
        return Err(ApiError::bad_request(
            "no policy file to reload: the server runs the built-in policy (start it with --policy FILE)",
        )
        .with_flavor(f));
    };
    let text = std::fs::read_to_string(&path).map_err(|e| {
        ApiError::bad_request(format!(
            "reading {}: {e}; the policy in force stays",
            path.display()
        ))
        .with_flavor(f)
    })?;
    let p = fak_engine::policy::Policy::from_json(&text).map_err(|e| {
        ApiError::bad_request(format!("{e}; the policy in force stays")).with_flavor(f)
    })?;
    let m = p.manifest().clone();
    *s.policy.lock().unwrap_or_else(|p| p.into_inner()) = p;
    tracing::info!(target: "fak::boundary", "policy reloaded from {}", path.display());
    Ok(Json(
        json!({"reloaded": true, "path": path.display().to_string(), "manifest": m}),
    ))
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
