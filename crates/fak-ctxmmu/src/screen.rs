//! `Screen`: the admission decision for one tool result.

use crate::audit::{AuditError, AuditLog, AuditRecord};
use crate::detect::{default_detectors, Detector, Finding, Reason};
use crate::normalize::normalize;
use crate::revoked::{Revocations, RevokeError};
use crate::store::{
    PageStore, StoreError, StoredHead, StoredItem, StoredKind, StoredMeta, PREVIEW_CHARS,
};
use serde::Serialize;
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
        /// Store id (`q<n>`), or [`UNKEPT`] when the store had no room for the original.
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

/// The id in a quarantine stub whose original was not kept: the store was full of
/// quarantined originals awaiting an operator clear (see [`crate::PageStore`]).
pub const UNKEPT: &str = "unkept";

/// Why [`Screen::admit`] failed; nothing was admitted.
#[derive(Debug, thiserror::Error)]
pub enum ScreenError {
    /// The page-out store could not keep a paged-out original (full, or a disk error),
    /// or a quarantined one (a disk error).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The decision's audit record could not be written and the log is fail-closed.
    #[error("the audit record could not be written (the audit log is fail-closed): {0}")]
    Audit(#[from] AuditError),
}

/// Limits of the screen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScreenConfig {
    /// Results longer than this many bytes are paged out (if benign): the model sees a
    /// stub with a [`PREVIEW_CHARS`]-character preview (`fak serve
    /// --max-tool-result-kb`).
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
/// start, so their stubs survive a restart, and so are the revocations persisted with it.
///
/// Every map is bounded, whatever clients send:
/// - revocations: at most [`crate::MAX_REVOCATIONS`]; past it a new one is refused,
///   never an old one dropped;
/// - remembered decisions: stubs of stored items are bounded by the store's limits (an
///   evicted item's decision is forgotten with it); admissions and stubs of unkept
///   originals by [`MAX_REMEMBERED`]: past it they are forgotten and the content is
///   screened again when it comes back (same detectors, so the same verdict; revoked
///   content is caught by the revocation list, which is never trimmed);
/// - the arrivals already logged: at most [`MAX_REMEMBERED`]; past it the set starts
///   over, and a re-sent result is logged once more (as `remembered`).
pub struct Screen {
    detectors: Vec<Box<dyn Detector>>,
    config: ScreenConfig,
    store: PageStore,
    audit: AuditLog,
    revoked: Revocations,
    /// Digests of stored `REVOKED` quarantines (revocations made before they were
    /// persisted on their own).
    stored_revoked: HashSet<String>,
    decided: HashMap<String, Verdict>,
    /// (digest, tool_call_id) pairs already in the audit log.
    logged: HashSet<(String, Option<String>)>,
}

/// Most remembered admissions (and unkept quarantines), and most remembered logged
/// arrivals; see [`Screen`].
pub const MAX_REMEMBERED: usize = 100_000;

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
    ///
    /// The revocations persisted with a folder store are taken from it.
    pub fn with(
        detectors: Vec<Box<dyn Detector>>,
        config: ScreenConfig,
        mut store: PageStore,
        audit: AuditLog,
    ) -> Self {
        let revoked = store.take_revocations().unwrap_or_default();
        let stored_revoked = store
            .list()
            .filter(|i| i.head.reason == Some(Reason::Revoked))
            .map(|i| i.head.digest.clone())
            .collect();
        let decided = store
            .list()
            .filter(|i| !i.head.cleared)
            .map(|i| (i.head.digest.clone(), stored_verdict(i)))
            .collect();
        Screen {
            detectors,
            config,
            store,
            audit,
            revoked,
            stored_revoked,
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

    /// The revocations in force.
    pub fn revocations(&self) -> &Revocations {
        &self.revoked
    }

    /// Revokes content by its sha256 digest: the same content arriving again is
    /// quarantined as `REVOKED`. Persisted (flushed to the disk) with a folder store.
    ///
    /// # Errors
    /// [`RevokeError::Full`]: not revoked; [`RevokeError::Io`]: revoked in this process
    /// but not persisted.
    pub fn revoke_digest(&mut self, digest: &str) -> Result<(), RevokeError> {
        let d = digest.to_ascii_lowercase();
        let res = self.revoked.add_digest(&d);
        if !matches!(res, Err(RevokeError::Full { .. }))
            && matches!(self.decided.get(&d), Some(Verdict::Admit))
        {
            self.decided.remove(&d);
        }
        res.map(drop)
    }

    /// Revokes whatever answers `tool_call_id`.
    ///
    /// # Errors
    /// As [`Screen::revoke_digest`].
    pub fn revoke_call(&mut self, tool_call_id: &str) -> Result<(), RevokeError> {
        self.revoked.add_call(tool_call_id).map(drop)
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
    /// A quarantine still quarantines when the store has no room for its original (full
    /// of quarantined originals awaiting an operator clear): the stub names the id
    /// [`UNKEPT`], and the audit record says `"kept": false`.
    ///
    /// # Errors
    /// [`ScreenError::Store`] when a paged-out original cannot be stored (the store is
    /// full, or a disk error) or a quarantined one cannot be written;
    /// [`ScreenError::Audit`] when the record cannot be written and the log is
    /// fail-closed. Nothing is admitted then.
    pub fn admit(&mut self, r: &ToolResult<'_>) -> Result<Verdict, ScreenError> {
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
    pub fn admit_fresh(&mut self, r: &ToolResult<'_>) -> Result<(Verdict, bool), ScreenError> {
        let dig = digest(r.content);
        let revoked = self.revoked.has_digest(&dig)
            || self.stored_revoked.contains(&dig)
            || r.tool_call_id.is_some_and(|c| self.revoked.has_call(c));
        let key = (dig.clone(), r.tool_call_id.map(str::to_string));
        match self.decided.get(&dig) {
            Some(v) if !revoked || matches!(v, Verdict::Quarantine { .. }) => {
                let v = v.clone();
                if self.logged.contains(&key) {
                    return Ok((v, false));
                }
                self.log(r, &v, &dig, Some("remembered"), None)?;
                self.remember_logged(key);
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
            head: StoredHead {
                id: String::new(),
                kind,
                reason: f.map(|f| f.reason),
                detector: f.map(|f| f.detector.to_string()),
                conversation: r.conversation.to_string(),
                tool: r.tool.to_string(),
                digest: dig.clone(),
                cleared: false,
            },
            content: r.content.to_string(),
        };
        let mut kept = None;
        let verdict = match &finding {
            Some(f) => {
                let id = match self.store.put(item(StoredKind::Quarantined, Some(f))) {
                    Ok(id) => id,
                    Err(StoreError::Full { .. }) => {
                        kept = Some(false);
                        UNKEPT.to_string()
                    }
                    Err(e) => return Err(e.into()),
                };
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
                let preview: String = r.content.chars().take(PREVIEW_CHARS).collect();
                let stub = page_out_stub(&id, r.content.len(), &preview);
                Verdict::PageOut { id, stub }
            }
            None => Verdict::Admit,
        };
        for d in self.store.take_evicted() {
            if !matches!(self.decided.get(&d), Some(Verdict::Admit)) {
                self.decided.remove(&d);
            }
        }
        let unbounded = |v: &Verdict| match v {
            Verdict::Admit => true,
            Verdict::Quarantine { id, .. } => id == UNKEPT,
            Verdict::PageOut { .. } => false,
        };
        if unbounded(&verdict) && self.decided.len() >= MAX_REMEMBERED + self.store.len() {
            self.decided.retain(|_, v| !unbounded(v));
        }
        self.decided.insert(dig.clone(), verdict.clone());
        self.log(r, &verdict, &dig, None, kept)?;
        self.remember_logged(key);
        Ok((verdict, true))
    }

    /// Number of remembered decisions and of logged arrivals (both bounded; see
    /// [`Screen`]).
    pub fn remembered(&self) -> (usize, usize) {
        (self.decided.len(), self.logged.len())
    }

    fn remember_logged(&mut self, key: (String, Option<String>)) {
        if self.logged.len() >= MAX_REMEMBERED {
            self.logged.clear();
        }
        self.logged.insert(key);
    }
}

impl Screen {
    /// Writes one audit line for `verdict` on `r` (`detector` overrides the verdict's).
    ///
    /// # Errors
    /// The write's error, when the log is fail-closed (else it is only counted).
    fn log(
        &mut self,
        r: &ToolResult<'_>,
        verdict: &Verdict,
        dig: &str,
        detector: Option<&'static str>,
        kept: Option<bool>,
    ) -> Result<(), AuditError> {
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
        let res = self.audit.record(AuditRecord {
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
            kept,
        });
        match res {
            Err(e) if self.audit.fail_closed() => Err(e),
            _ => Ok(()),
        }
    }
}

/// The verdict a stored item stands for (its stub rebuilt as it was made).
fn stored_verdict(i: &StoredMeta) -> Verdict {
    match i.head.kind {
        StoredKind::Quarantined => {
            let reason = i.head.reason.unwrap_or(Reason::Revoked);
            Verdict::Quarantine {
                id: i.head.id.clone(),
                reason,
                detector: "store",
                stub: quarantine_stub(&i.head.id, reason, i.len),
            }
        }
        StoredKind::PagedOut => Verdict::PageOut {
            id: i.head.id.clone(),
            stub: page_out_stub(&i.head.id, i.len, &i.preview),
        },
    }
}

/// The text that stands for a quarantined result.
#[derive(Serialize)]
struct QuarantineStub<'a> {
    _quarantined: bool,
    id: &'a str,
    reason: &'static str,
    len: usize,
}

/// The text that stands for a paged-out result.
#[derive(Serialize)]
struct PageOutStub<'a> {
    _paged_out: bool,
    id: &'a str,
    len: usize,
    preview: &'a str,
}

fn quarantine_stub(id: &str, reason: Reason, len: usize) -> String {
    serde_json::to_string(&QuarantineStub {
        _quarantined: true,
        id,
        reason: reason.as_str(),
        len,
    })
    .unwrap_or_default()
}

fn page_out_stub(id: &str, len: usize, preview: &str) -> String {
    serde_json::to_string(&PageOutStub {
        _paged_out: true,
        id,
        len,
        preview,
    })
    .unwrap_or_default()
}
