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
//! ([`fak_engine::EngineDriver::revoke`]). A store failure fails the request (500; 503
//! when the store is full of quarantined originals and a result must be paged out):
//! nothing unscreened goes through. With `--audit-fail-closed`, a result or a call whose
//! audit record cannot be written is refused: the request gets 503, a proposed call is
//! denied `POLICY_BLOCK`.
//!
//! Each proposed call is decided in order: a call the model wrote malformed is denied
//! `MALFORMED` (fail closed: it never reaches the client as a callable call); a call of
//! a tool the request did not offer is denied `UNKNOWN_TOOL`; the rest go to the policy
//! ([`fak_engine::policy::Policy::adjudicate`]: deny entries, allow lists, argument
//! rules, a sink tool on a tainted conversation, credentials in arguments, the
//! per-conversation rate). A request is *tainted* when its history holds any tool result
//! (OpenAI `role: "tool"`, Anthropic `tool_result`), whatever the screen made of it; the
//! `x-fak-allow-tainted` header (tool names, comma-separated, or `*`) is the client's
//! flag for the manifest's `require_flag` rules ([`request_taint`]). Only allowed calls are
//! returned as calls; the response's `fak` extension field lists every proposed call
//! with its verdict and reason, so a client (or its operator) can see what was removed
//! and why.

use crate::anthropic::UNSCREENABLE;
use crate::error::{ApiError, Flavor};
use crate::{parse_body, AppState};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use fak_ctxmmu::{AuditRecord, RevokeError, ScreenError, ToolResult, Verdict};
use fak_engine::policy::{CallVerdict, Taint, ToolCall as PolicyCall};
use fak_engine::{Message, Revocation, ToolCall, ToolChoice, ToolSpec};
use serde_json::{Map, Value};
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

/// Most tools one request may offer (OpenAI's own limit).
pub(crate) const MAX_TOOLS: usize = 128;

/// Checks a tool list (at most [`MAX_TOOLS`], no duplicate names, each schema a valid
/// JSON Schema) and a `tool_choice` against it.
pub(crate) fn check_tools(tools: &[ToolSpec], choice: &ToolChoice) -> Result<(), ApiError> {
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::bad_request(format!(
            "tools holds {} tools; at most {MAX_TOOLS}",
            tools.len()
        )));
    }
    let mut seen = std::collections::HashSet::with_capacity(tools.len());
    for t in tools {
        if !seen.insert(t.name.as_str()) {
            return Err(ApiError::bad_request(format!(
                "tools holds '{}' twice",
                t.name
            )));
        }
        if let Err(e) = jsonschema::validator_for(&t.parameters) {
            return Err(ApiError::bad_request(format!(
                "the schema of tool '{}' is not a valid JSON Schema: {e}",
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

/// The request header naming the tools the client confirms may run on a tainted
/// conversation (`require_flag` rules): tool names separated by commas, or `*`.
pub(crate) const ALLOW_TAINTED_HEADER: &str = "x-fak-allow-tainted";

/// The taint of a request: tainted when its history holds a tool result (any message of
/// role `tool`, which Anthropic `tool_result` blocks become), with the flags of the
/// [`ALLOW_TAINTED_HEADER`] header (at most [`MAX_TOOLS`] names are read).
pub(crate) fn request_taint(headers: &HeaderMap, messages: &[Message]) -> Taint {
    let flags = headers
        .get_all(ALLOW_TAINTED_HEADER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .take(MAX_TOOLS)
        .map(str::to_string)
        .collect();
    Taint {
        tainted: messages.iter().any(|m| m.role == "tool"),
        flags,
    }
}

/// The decisions on one response's proposed calls.
#[derive(Clone, Debug, Default)]
pub(crate) struct Adjudicated {
    /// The calls the client may act on, in order.
    pub allowed: Vec<ToolCall>,
    /// Denied calls and why.
    pub denied: Vec<(ToolCall, CallVerdict)>,
    /// The `fak.tool_calls` entries, one per proposed call in order (empty when none
    /// was proposed).
    pub report: Vec<CallReport>,
}

/// One entry of a reply's `fak.tool_calls`: the boundary's decision on one proposed
/// call. fak's own extension (no API reference has it); see docs/ctxmmu.md.
#[derive(Clone, Debug, serde::Serialize)]
pub(crate) struct CallReport {
    /// The call's id, as the reply gives it to the client.
    pub id: String,
    /// The tool named by the call.
    pub name: String,
    /// `allow` or `deny`.
    pub verdict: &'static str,
    /// The deny reason (`DEFAULT_DENY`, `MALFORMED`, `UNKNOWN_TOOL`, ...); `null` when
    /// allowed.
    pub reason: Option<&'static str>,
    /// Why, in words.
    pub detail: String,
    /// In a reply of several choices (`n > 1`), the `index` of the choice that proposed
    /// the call; absent in a one-choice reply.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub choice: Option<u32>,
}

/// One entry of a reply's `fak.tool_results`: a tool result of the request that the
/// screen did not admit as it was (admitted results are not listed). fak's own
/// extension; see docs/ctxmmu.md.
#[derive(Clone, Debug, serde::Serialize)]
pub(crate) struct ResultReport {
    /// The `tool_call_id` / `tool_use_id` the result answered, `null` when it had none.
    pub tool_call_id: Option<String>,
    /// The tool that produced it (from the call it answers), `unknown` when not named.
    pub tool: String,
    /// `page_out` or `quarantine`.
    pub verdict: &'static str,
    /// The quarantine reason (`TRUST_VIOLATION`, ..., [`UNSCREENABLE`]); `null` for a
    /// page-out.
    pub reason: Option<&'static str>,
    /// The page-out store's id of the original (`null` for a withheld block's result).
    pub id: Option<String>,
    /// The text the model sees in the result's place.
    pub stub: String,
}

/// A reply's `fak` field (fak's extension to each wire's reply): what the boundary did
/// on this request. Each list is left out when empty; `finish_detail` is added by
/// [`finish_detail`].
#[derive(serde::Serialize)]
struct FakField<'a> {
    /// The decisions on the reply's proposed calls.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    tool_calls: &'a [CallReport],
    /// The request's tool results not admitted as they were.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    tool_results: &'a [ResultReport],
}

/// Decides every proposed call (see the module docs). Always returns quickly: the
/// policy lock is held only for the decisions.
pub(crate) fn adjudicate(
    s: &AppState,
    conversation: &str,
    taint: &Taint,
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
                reason: Some(if call.truncated {
                    fak_engine::policy::DenyReason::Truncated
                } else {
                    fak_engine::policy::DenyReason::Malformed
                }),
                detail: why.clone(),
            }
        } else if let Some(t) = offered.iter().find(|t| t.name == call.name) {
            match schema_error(t, &call) {
                Some(why) => CallVerdict {
                    allowed: false,
                    reason: Some(fak_engine::policy::DenyReason::Malformed),
                    detail: why,
                },
                None => policy.adjudicate_with(
                    conversation,
                    &PolicyCall {
                        name: call.name.clone(),
                        arguments: call.arguments.clone(),
                    },
                    taint,
                ),
            }
        } else {
            CallVerdict {
                allowed: false,
                reason: Some(fak_engine::policy::DenyReason::UnknownTool),
                detail: format!("'{}' is not among the tools the request offered", call.name),
            }
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
            kept: None,
        });
        report.push(CallReport {
            id: call.id.clone(),
            name: call.name.clone(),
            verdict: word,
            reason,
            detail: verdict.detail.clone(),
            choice: None,
        });
        if verdict.allowed {
            out.allowed.push(call);
        } else {
            out.denied.push((call, verdict));
        }
    }
    drop(policy);
    let mut screen = s.screen.lock().unwrap_or_else(|p| p.into_inner());
    let mut unlogged = false;
    for r in audit {
        unlogged |= screen.audit_mut().record(r).is_err();
    }
    if unlogged && screen.audit().fail_closed() {
        // Fail-closed: a call whose decision is not in the log is not passed on.
        drop(screen);
        for call in std::mem::take(&mut out.allowed) {
            let v = CallVerdict {
                allowed: false,
                reason: Some(fak_engine::policy::DenyReason::PolicyBlock),
                detail: "the audit log cannot be written and the server is fail-closed (--audit-fail-closed)".into(),
            };
            if let Some(e) = report.iter_mut().find(|e| e.id == call.id) {
                e.verdict = "deny";
                e.reason = v.reason.map(|r| r.as_str());
                e.detail.clone_from(&v.detail);
            }
            out.denied.push((call, v));
        }
    }
    out.report = report;
    out
}

/// Most bytes of a policy manifest file.
const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// The manifest file's text: a regular file of at most [`MAX_MANIFEST_BYTES`].
fn read_manifest(path: &std::path::Path) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_MANIFEST_BYTES {
        return Err(format!(
            "{} bytes; a manifest may have at most {MAX_MANIFEST_BYTES}",
            meta.len()
        ));
    }
    std::fs::read_to_string(path).map_err(|e| e.to_string())
}

/// An audit line for an operator action (`revoke`, `policy_reload`).
fn operator_record(action: &'static str, id: Option<String>, digest: String) -> AuditRecord {
    AuditRecord {
        time: now_s(),
        conversation: "operator".into(),
        tool: String::new(),
        verdict: action,
        reason: None,
        detector: None,
        id,
        bytes: 0,
        digest,
        kept: None,
    }
}

fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The tools a reply may call: none when `tool_choice` is `none` (or no tools were
/// given), only the named one when it names one, else all offered.
pub(crate) fn offered_tools(req: &fak_engine::GenerateRequest) -> Vec<ToolSpec> {
    if !req.tools_active() {
        return Vec::new();
    }
    match &req.tool_choice {
        ToolChoice::Named(n) => req.tools.iter().filter(|t| &t.name == n).cloned().collect(),
        _ => req.tools.clone(),
    }
}

/// Tool names by call id, from the assistant messages' `tool_calls` (the last
/// assistant naming an id wins, as the nearest earlier call would).
fn call_names(messages: &[Message]) -> std::collections::HashMap<String, String> {
    let mut names = std::collections::HashMap::new();
    for a in messages {
        let Some(calls) = a.tool_calls.as_ref().and_then(Value::as_array) else {
            continue;
        };
        for c in calls {
            if let (Some(id), Some(name)) = (
                c.get("id").and_then(Value::as_str),
                c.pointer("/function/name").and_then(Value::as_str),
            ) {
                names.insert(id.to_string(), name.to_string());
            }
        }
    }
    names
}

/// Screens every `tool` message of `messages` (see the module docs), off the async
/// threads and in time linear in the conversation, and returns the messages as the
/// engine may see them with the `fak.tool_results` entries of those not admitted as
/// they were. The screen's lock is taken per result, so other requests interleave.
///
/// `withheld[k]`: whether the `k`-th tool message had content the screen cannot read
/// (an image, a document) replaced by a stub before it came here (the Anthropic route;
/// `&[]` elsewhere). Such a result, when the screen admits its text, is listed too:
/// verdict `quarantine`, reason [`UNSCREENABLE`].
///
/// # Errors
/// 500 when the page-out store cannot keep an original (nothing is admitted then).
pub(crate) async fn screen_messages(
    s: &AppState,
    conversation: &str,
    messages: Vec<Message>,
    withheld: &[bool],
    flavor: Flavor,
) -> Result<(Vec<Message>, Vec<ResultReport>), ApiError> {
    if !messages.iter().any(|m| m.role == "tool") {
        return Ok((messages, Vec::new()));
    }
    let st = s.clone();
    let conv = conversation.to_string();
    let withheld = withheld.to_vec();
    tokio::task::spawn_blocking(move || screen_blocking(&st, &conv, messages, &withheld, flavor))
        .await
        .map_err(|e| ApiError::internal(format!("screening failed: {e}")).with_flavor(flavor))?
}

fn screen_blocking(
    s: &AppState,
    conversation: &str,
    mut messages: Vec<Message>,
    withheld: &[bool],
    flavor: Flavor,
) -> Result<(Vec<Message>, Vec<ResultReport>), ApiError> {
    let mut report = Vec::new();
    let mut revoke = Vec::new();
    let names = call_names(&messages);
    {
        let mut k = 0;
        for m in messages.iter_mut() {
            if m.role != "tool" {
                continue;
            }
            let had_withheld = withheld.get(k).copied().unwrap_or(false);
            k += 1;
            let tool = m
                .tool_call_id
                .as_ref()
                .and_then(|id| names.get(id).cloned())
                .or_else(|| m.name.clone())
                .unwrap_or_else(|| "unknown".into());
            let mut screen = s.screen.lock().unwrap_or_else(|p| p.into_inner());
            let (verdict, fresh) = screen
                .admit_fresh(&ToolResult {
                    conversation,
                    tool: &tool,
                    tool_call_id: m.tool_call_id.as_deref(),
                    content: &m.content,
                })
                .map_err(|e| screen_error(&e).with_flavor(flavor))?;
            drop(screen);
            let (word, reason, id) = match &verdict {
                Verdict::Admit if had_withheld => ("quarantine", Some(UNSCREENABLE), None),
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
                // A withheld block's stub is inside the admitted text; the text is what
                // the model sees.
                let stub = verdict.context_text(&m.content).to_string();
                report.push(ResultReport {
                    tool_call_id: m.tool_call_id.clone(),
                    tool,
                    verdict: word,
                    reason,
                    id,
                    stub: stub.clone(),
                });
                m.content = stub;
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
    Ok((messages, report))
}

/// The response to a screening failure: 503 when the server's state refuses it (the
/// audit log fail-closed and unwritable, the store full), 500 otherwise.
fn screen_error(e: &ScreenError) -> ApiError {
    match e {
        ScreenError::Audit(_) | ScreenError::Store(fak_ctxmmu::StoreError::Full { .. }) => {
            ApiError::unavailable(format!("screening a tool result: {e}"))
        }
        ScreenError::Store(_) => ApiError::internal(format!("screening a tool result: {e}")),
    }
}

impl Adjudicated {
    /// Marks every report as choice `index`'s, in a reply of `n` choices (left unmarked
    /// when `n` is 1).
    pub(crate) fn of_choice(mut self, index: usize, n: usize) -> Self {
        if n > 1 {
            for r in &mut self.report {
                r.choice = Some(index as u32);
            }
        }
        self
    }
}

/// The response's `fak` field: the screened results and the adjudicated calls, or
/// `None` when there is nothing to say.
pub(crate) fn fak_field(results: &[ResultReport], a: &Adjudicated) -> Option<Value> {
    if results.is_empty() && a.report.is_empty() {
        return None;
    }
    serde_json::to_value(FakField {
        tool_calls: &a.report,
        tool_results: results,
    })
    .ok()
}

/// The word in a reply's `fak.finish_detail` when a grammar (`response_format`,
/// `text.format`, `output_format`, `grammar`) allowed no next token: the text so far
/// does not complete the requested format. The wire's own word is then the one for a
/// reply cut short (`length`, `max_tokens`, `incomplete`).
pub(crate) const GRAMMAR_DEAD_END: &str = "grammar_dead_end";

/// A reply's `fak` field with `finish_detail` set to [`GRAMMAR_DEAD_END`] when
/// generation ended at a grammar's dead end (`fak` unchanged otherwise): the wires'
/// finish words cannot tell it apart from a token limit.
pub(crate) fn finish_detail(fak: Option<Value>, finish: fak_engine::FinishReason) -> Option<Value> {
    if finish != fak_engine::FinishReason::GrammarDeadEnd {
        return fak;
    }
    let mut v = fak.unwrap_or_else(|| Value::Object(Map::new()));
    v["finish_detail"] = Value::from(GRAMMAR_DEAD_END);
    Some(v)
}

/// `POST /v1/fak/revoke` body.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RevokeBody {
    tool_call_id: Option<String>,
    digest: Option<String>,
}

/// `POST /v1/fak/revoke`'s reply: what was revoked (as named, the digest lowercased) and
/// what it cut out of the KV cache.
#[derive(serde::Serialize)]
pub(crate) struct RevokeReply {
    revoked: Revocation,
    kv: fak_engine::RevokeReport,
}

/// `POST /v1/fak/policy/reload`'s reply: the manifest now in force and where it was
/// read.
#[derive(serde::Serialize)]
pub(crate) struct ReloadReply {
    /// Always `true` (a failed reload is an error instead).
    reloaded: bool,
    /// The `--policy` file.
    path: String,
    manifest: fak_engine::policy::Manifest,
}

/// `POST /v1/fak/revoke`: from now on the named content is quarantined (`REVOKED`)
/// wherever it arrives, and it is cut out of every cached conversation now (unless the
/// engine runs with `--no-kv-evict`). Answers what was cut.
pub(crate) async fn revoke(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<RevokeReply>, ApiError> {
    let f = Flavor::OpenAi;
    let b: RevokeBody = parse_body(&s, body, f)?;
    if b.tool_call_id.is_none() && b.digest.is_none() {
        return Err(
            ApiError::bad_request("name a `tool_call_id` or a `digest` to revoke").with_flavor(f),
        );
    }
    if let Some(c) = &b.tool_call_id {
        if c.is_empty() || c.len() > 256 {
            return Err(ApiError::bad_request("tool_call_id must be 1 to 256 bytes").with_flavor(f));
        }
    }
    if let Some(d) = &b.digest {
        if d.len() != 64 || !d.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(ApiError::bad_request(
                "digest must be the sha256 of the content, 64 hex digits",
            )
            .with_flavor(f));
        }
    }
    // Not persisted: in force here, reported (503) once the cache is cut too.
    let mut unpersisted = None;
    {
        let mut screen = s.screen.lock().unwrap_or_else(|p| p.into_inner());
        for res in [
            b.digest.as_deref().map(|d| screen.revoke_digest(d)),
            b.tool_call_id.as_deref().map(|c| screen.revoke_call(c)),
        ]
        .into_iter()
        .flatten()
        {
            match res {
                Ok(()) => {}
                Err(e @ RevokeError::Full { .. }) => {
                    return Err(ApiError::unavailable(e.to_string()).with_flavor(f))
                }
                Err(e @ RevokeError::Io { .. }) => unpersisted = Some(e.to_string()),
            }
        }
        // An operator action is never refused for its audit record (a revocation is
        // always applied); a failed write is counted in /metrics and logged.
        let _ = screen.audit_mut().record(operator_record(
            "revoke",
            b.tool_call_id.clone(),
            b.digest.clone().unwrap_or_default().to_ascii_lowercase(),
        ));
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
    if let Some(e) = unpersisted {
        return Err(ApiError::unavailable(e).with_flavor(f));
    }
    Ok(Json(RevokeReply { revoked: r, kv: k }))
}

/// `POST /v1/fak/policy/reload`: reads the `--policy` file again. An unreadable or
/// invalid manifest is a 400 saying why, and the policy in force stays.
pub(crate) async fn reload_policy(
    State(s): State<AppState>,
) -> Result<Json<ReloadReply>, ApiError> {
    let f = Flavor::OpenAi;
    let Some(path) = s.config.policy_path.clone() else {
        return Err(ApiError::bad_request(
            "no policy file to reload: the server runs the built-in policy (start it with --policy FILE)",
        )
        .with_flavor(f));
    };
    // Off the async threads: a slow disk (or a FIFO in the file's place) must not stall
    // the server.
    let p2 = path.clone();
    let read = tokio::task::spawn_blocking(move || read_manifest(&p2))
        .await
        .map_err(|e| ApiError::internal(format!("reload failed: {e}")).with_flavor(f))?;
    let text = read.map_err(|e| {
        // The path stays in the server's log; the client learns what failed.
        tracing::warn!(target: "fak::boundary", "policy reload: reading {}: {e}", path.display());
        ApiError::bad_request(format!(
            "reading the policy file: {e}; the policy in force stays"
        ))
        .with_flavor(f)
    })?;
    let mut p = fak_engine::policy::Policy::from_json(&text).map_err(|e| {
        ApiError::bad_request(format!("{e}; the policy in force stays")).with_flavor(f)
    })?;
    let m = p.manifest().clone();
    {
        let mut old = s.policy.lock().unwrap_or_else(|p| p.into_inner());
        // The per-conversation call counts carry over: a reload is not a rate reset.
        p.adopt_history(&mut old);
        *old = p;
    }
    let _ = s
        .screen
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .audit_mut()
        .record(operator_record(
            "policy_reload",
            None,
            fak_ctxmmu::digest(&text),
        ));
    tracing::info!(target: "fak::boundary", "policy reloaded from {}", path.display());
    Ok(Json(ReloadReply {
        reloaded: true,
        path: path.display().to_string(),
        manifest: m,
    }))
}

/// Why `call`'s arguments break `tool`'s schema, if they do (the first error, with the
/// instance path).
fn schema_error(tool: &ToolSpec, call: &ToolCall) -> Option<String> {
    let args: Value = serde_json::from_str(&call.arguments).ok()?;
    let v = match jsonschema::validator_for(&tool.parameters) {
        Ok(v) => v,
        Err(e) => return Some(format!("the tool's schema cannot be used: {e}")),
    };
    fak_engine::schema::first_schema_error(&v, &args, "arguments do not match the tool's schema")
}

/// The sentence a client sees for a denied call: Anthropic's explanatory text block, and
/// on the OpenAI wires the reply's text ([`denial_suffix`]).
pub(crate) fn denial_text(call: &ToolCall, v: &CallVerdict) -> String {
    format!(
        "[fak] The tool call '{}' was not passed on: {} ({}).",
        call.name,
        v.reason.map_or("DENIED", |r| r.as_str()),
        v.detail
    )
}

/// What the OpenAI wires (chat `message.content`, a Responses message's text) append to
/// a reply's text for its denied calls: each call's [`denial_text`] (the sentence the
/// Anthropic route sends as a text block), after a blank line unless it opens the text.
/// `empty`: whether the text so far is empty. `""` when no call was denied.
pub(crate) fn denial_suffix(empty: bool, a: &Adjudicated) -> String {
    let mut out = String::new();
    for (c, v) in &a.denied {
        if !(empty && out.is_empty()) {
            out.push_str("\n\n");
        }
        out.push_str(&denial_text(c, v));
    }
    out
}

/// A JSON object from a call's arguments text (`{}` for anything else; only allowed,
/// hence well-formed, calls reach this).
pub(crate) fn arguments_object(call: &ToolCall) -> Value {
    match serde_json::from_str(&call.arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => Value::Object(Map::new()),
    }
}
