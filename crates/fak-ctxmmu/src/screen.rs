//! `Screen`: the admission decision for one tool result.

use crate::audit::{AuditLog, AuditRecord};
use crate::detect::{default_detectors, Detector, Finding, Reason};
use crate::normalize::normalize;
use crate::store::{PageStore, StoreError, StoredItem, StoredKind};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::HashSet;

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

/// Detectors, the store, the audit log and the revoked digests.
pub struct Screen {
    detectors: Vec<Box<dyn Detector>>,
    config: ScreenConfig,
    store: PageStore,
    audit: AuditLog,
    revoked: HashSet<String>,
    revoked_calls: HashSet<String>,
}

/// sha256 hex of `s`.
pub(crate) fn digest(s: &str) -> String {
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
        Screen {
            detectors,
            config,
            store,
            audit,
            revoked,
            revoked_calls: HashSet::new(),
        }
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
        self.revoked.insert(digest.to_ascii_lowercase());
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
        let dig = digest(r.content);
        let revoked = self.revoked.contains(&dig)
            || r.tool_call_id
                .is_some_and(|c| self.revoked_calls.contains(c));
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
                let stub = json!({"_quarantined": true, "id": id, "reason": f.reason.as_str(), "len": r.content.len()}).to_string();
                Verdict::Quarantine {
                    id,
                    reason: f.reason,
                    detector: f.detector,
                    stub,
                }
            }
            None if r.content.len() > self.config.page_out_bytes => {
                let id = self.store.put(item(StoredKind::PagedOut, None))?;
                let preview: String = r.content.chars().take(200).collect();
                let stub = json!({"_paged_out": true, "id": id, "len": r.content.len(), "preview": preview}).to_string();
                Verdict::PageOut { id, stub }
            }
            None => Verdict::Admit,
        };
        let (name, id, reason, detector) = match &verdict {
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
            detector,
            id,
            bytes: r.content.len(),
            digest: dig,
        });
        Ok(verdict)
    }
}
