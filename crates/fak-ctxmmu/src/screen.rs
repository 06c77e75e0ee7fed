//! `Screen`: the admission decision for one tool result.

use crate::audit::{AuditLog, AuditRecord};
use crate::detect::{default_detectors, Detector, Finding, Reason};
use crate::normalize::normalize;
use crate::store::{PageStore, StoreError, StoredItem, StoredKind};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};

/// A tool result as it arrives, before tokenization.
#[derive(Clone, Copy, Debug)]
pub struct ToolResult<'a> {
    /// The conversation it belongs to (for the audit log).
    pub conversation: &'a str,
    /// The tool that produced it.
    pub tool: &'a str,
    /// The call it answers, if known.
    pub tool_call_id: Option<&'a str>,
    /// The text.
    pub content: &'a str,
}

/// The decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The content enters the context unchanged.
    Admit,
    /// A large benign result: `stub` stands in the context; the original is in the
    /// store under `id`.
    PageOut {
        /// Store id (`p<n>`).
        id: String,
        /// The pointer text that replaces the content.
        stub: String,
    },
    /// `stub` replaces the content in place; the original is in the store under `id`,
    /// readable only after an operator clear.
    Quarantine {
        /// Store id (`q<n>`).
        id: String,
        /// Why.
        reason: Reason,
        /// The detector that decided.
        detector: &'static str,
        /// `{"_quarantined":true,"id":...,"reason":...,"len":...}`.
        stub: String,
    },
}

impl Verdict {
    /// The text that enters the model's context for a result with `content`.
    pub fn context_text<'a>(&'a self, content: &'a str) -> &'a str {
        match self {
            Verdict::Admit => content,
            Verdict::PageOut { stub, .. } | Verdict::Quarantine { stub, .. } => stub,
        }
    }
}

/// Limits of the screen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScreenConfig {
    /// Results longer than this many bytes are paged out (if benign).
    pub page_out_bytes: usize,
    /// Results longer than this are quarantined as `OVERSIZED` without inspection.
    pub max_bytes: usize,
}

impl Default for ScreenConfig {
    fn default() -> Self {
        ScreenConfig {
            page_out_bytes: 32 * 1024,
            max_bytes: 4 * 1024 * 1024,
        }
    }
}

/// Detectors, the store, the audit log, the revoked digests, and the decisions made so
/// far.
///
/// Decisions are remembered by content digest: a conversation re-sends its whole
/// history every turn, and the same result must get the same decision and the same stub
/// every time (so the turns' prompts, and the KV prefixes cached for them, agree), and
/// must not be stored or logged again. A revocation overrides a remembered admission.
/// Quarantined and paged-out items found in a persisted store are remembered from the
/// start, so their stubs survive a restart.
pub struct Screen {
    detectors: Vec<Box<dyn Detector>>,
    config: ScreenConfig,
    store: PageStore,
    audit: AuditLog,
    revoked: HashSet<String>,
    revoked_calls: HashSet<String>,
    decided: HashMap<String, Verdict>,
    /// (digest, tool_call_id) pairs already in the audit log.
    logged: HashSet<(String, Option<String>)>,
}

/// Most remembered admissions; past it they are forgotten (and screened again when
/// they come back), while stubs are always remembered.
const MAX_REMEMBERED_ADMITS: usize = 100_000;

/// sha256 of `s`, lowercase hex: the digest the audit log, the store and revocations
/// name content by.
pub fn digest(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Screen {
    /// A screen with the default detectors, an in-memory store and log.
    pub fn new(config: ScreenConfig) -> Self {
        Self::with(
            default_detectors(),
            config,
            PageStore::in_memory(),
            AuditLog::in_memory(),
        )
    }

    /// A screen from parts (custom detectors, a persisted store, a log file).
    pub fn with(
        detectors: Vec<Box<dyn Detector>>,
        config: ScreenConfig,
        store: PageStore,
        audit: AuditLog,
    ) -> Self {
        let revoked = store
            .list()
            .filter(|i| i.reason == Some(Reason::Revoked))
            .map(|i| i.digest.clone())
            .collect();
        let decided = store
            .list()
            .filter(|i| !i.cleared)
            .map(|i| (i.digest.clone(), stored_verdict(i)))
            .collect();
        Screen {
            detectors,
            config,
            store,
            audit,
            revoked,
            revoked_calls: HashSet::new(),
            decided,
            logged: HashSet::new(),
        }
    }

    /// The audit log, to record decisions made outside the screen (tool-call
    /// adjudications) in the same log.
    pub fn audit_mut(&mut self) -> &mut AuditLog {
        &mut self.audit
    }

    /// The page-out store.
    pub fn store(&self) -> &PageStore {
        &self.store
    }

    /// The page-out store, for operator actions (clear).
    pub fn store_mut(&mut self) -> &mut PageStore {
        &mut self.store
    }

    /// The audit log.
    pub fn audit(&self) -> &AuditLog {
        &self.audit
    }

    /// Revokes content by its sha256 digest: the same content arriving again is
    /// quarantined as `REVOKED`.
    pub fn revoke_digest(&mut self, digest: &str) {
        let d = digest.to_ascii_lowercase();
        if matches!(self.decided.get(&d), Some(Verdict::Admit)) {
            self.decided.remove(&d);
        }
        self.revoked.insert(d);
    }

    /// Revokes whatever answers `tool_call_id`.
    pub fn revoke_call(&mut self, tool_call_id: &str) {
        self.revoked_calls.insert(tool_call_id.to_string());
    }

    /// Runs the detectors only (no store, no log): the first finding, if any.
    pub fn inspect(&self, content: &str) -> Option<Finding> {
        let norm = normalize(content);
        self.detectors
            .iter()
            .find_map(|d| d.inspect(content, &norm))
    }

    /// Decides whether `r` may enter the context (see the crate docs), storing the
    /// original of anything not admitted and logging the decision.
    ///
    /// # Errors
    /// [`StoreError`] when the original cannot be stored; nothing is admitted then.
    pub fn admit(&mut self, r: &ToolResult<'_>) -> Result<Verdict, StoreError> {
        Ok(self.admit_fresh(r)?.0)
    }

    /// As [`Screen::admit`], also saying whether this is a new arrival (`true`: logged):
    /// content not seen before, or seen before but now answering another tool call (the
    /// remembered decision is logged again, detector `remembered`, nothing stored
    /// again). A conversation re-sending its history (same content, same call) is not
    /// a new arrival (`false`: not logged again).
    ///
    /// # Errors
    /// As [`Screen::admit`].
    pub fn admit_fresh(&mut self, r: &ToolResult<'_>) -> Result<(Verdict, bool), StoreError> {
        let dig = digest(r.content);
        let revoked = self.revoked.contains(&dig)
            || r.tool_call_id
                .is_some_and(|c| self.revoked_calls.contains(c));
        let key = (dig.clone(), r.tool_call_id.map(str::to_string));
        match self.decided.get(&dig) {
            Some(v) if !revoked || matches!(v, Verdict::Quarantine { .. }) => {
                let v = v.clone();
                if self.logged.contains(&key) {
                    return Ok((v, false));
                }
                self.log(r, &v, &dig, Some("remembered"));
                self.logged.insert(key);
                return Ok((v, true));
            }
            _ => {}
        }
        let finding = if revoked {
            Some(Finding {
                detector: "revocation",
                reason: Reason::Revoked,
                detail: "revoked by an operator".into(),
            })
        } else if r.content.len() > self.config.max_bytes {
            Some(Finding {
                detector: "size",
                reason: Reason::Oversized,
                detail: format!("{} bytes > {}", r.content.len(), self.config.max_bytes),
            })
        } else {
            self.inspect(r.content)
        };
        let item = |kind, f: Option<&Finding>| StoredItem {
            id: String::new(),
            kind,
            reason: f.map(|f| f.reason),
            detector: f.map(|f| f.detector.to_string()),
            conversation: r.conversation.to_string(),
            tool: r.tool.to_string(),
            digest: dig.clone(),
            cleared: false,
            content: r.content.to_string(),
        };
        let verdict = match &finding {
            Some(f) => {
                let id = self.store.put(item(StoredKind::Quarantined, Some(f)))?;
                let stub = quarantine_stub(&id, f.reason, r.content.len());
                Verdict::Quarantine {
                    id,
                    reason: f.reason,
                    detector: f.detector,
                    stub,
                }
            }
            None if r.content.len() > self.config.page_out_bytes => {
                let id = self.store.put(item(StoredKind::PagedOut, None))?;
                let stub = page_out_stub(&id, r.content);
                Verdict::PageOut { id, stub }
            }
            None => Verdict::Admit,
        };
        self.log(r, &verdict, &dig, None);
        self.logged.insert(key);
        if verdict == Verdict::Admit && self.decided.len() >= MAX_REMEMBERED_ADMITS {
            self.decided.retain(|_, v| *v != Verdict::Admit);
        }
        self.decided.insert(dig, verdict.clone());
        Ok((verdict, true))
    }
}

impl Screen {
    /// Writes one audit line for `verdict` on `r` (`detector` overrides the verdict's).
    fn log(
        &mut self,
        r: &ToolResult<'_>,
        verdict: &Verdict,
        dig: &str,
        detector: Option<&'static str>,
    ) {
        let (name, id, reason, det) = match verdict {
            Verdict::Admit => ("admit", None, None, None),
            Verdict::PageOut { id, .. } => ("page_out", Some(id.clone()), None, None),
            Verdict::Quarantine {
                id,
                reason,
                detector,
                ..
            } => (
                "quarantine",
                Some(id.clone()),
                Some(reason.as_str()),
                Some(*detector),
            ),
        };
        self.audit.record(AuditRecord {
            time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            conversation: r.conversation.to_string(),
            tool: r.tool.to_string(),
            verdict: name,
            reason,
            detector: detector.or(det),
            id,
            bytes: r.content.len(),
            digest: dig.to_string(),
        });
    }
}

/// The verdict a stored item stands for (its stub rebuilt as it was made).
fn stored_verdict(i: &StoredItem) -> Verdict {
    match i.kind {
        StoredKind::Quarantined => {
            let reason = i.reason.unwrap_or(Reason::Revoked);
            Verdict::Quarantine {
                id: i.id.clone(),
                reason,
                detector: "store",
                stub: quarantine_stub(&i.id, reason, i.content.len()),
            }
        }
        StoredKind::PagedOut => Verdict::PageOut {
            id: i.id.clone(),
            stub: page_out_stub(&i.id, &i.content),
        },
    }
}

fn quarantine_stub(id: &str, reason: Reason, len: usize) -> String {
    json!({"_quarantined": true, "id": id, "reason": reason.as_str(), "len": len}).to_string()
}

fn page_out_stub(id: &str, content: &str) -> String {
    let preview: String = content.chars().take(200).collect();
    json!({"_paged_out": true, "id": id, "len": content.len(), "preview": preview}).to_string()
}
