//! The audit log: one JSON line per admission decision.

use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// One decision.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AuditRecord {
    /// Seconds since the Unix epoch.
    pub time: f64,
    /// The conversation the result arrived in.
    pub conversation: String,
    /// The tool that produced it.
    pub tool: String,
    /// `admit`, `page_out` or `quarantine`.
    pub verdict: &'static str,
    /// The quarantine reason, if any.
    pub reason: Option<&'static str>,
    /// The detector that decided, if any.
    pub detector: Option<&'static str>,
    /// The id in the page-out store, if stored.
    pub id: Option<String>,
    /// Length of the content in bytes.
    pub bytes: usize,
    /// sha256 of the content, hex.
    pub digest: String,
}

/// Where audit records go: memory (always) and, optionally, an append-only file.
#[derive(Debug, Default)]
pub struct AuditLog {
    path: Option<PathBuf>,
    records: Vec<AuditRecord>,
}

impl AuditLog {
    /// A log kept in memory only.
    pub fn in_memory() -> Self {
        AuditLog::default()
    }

    /// A log that also appends JSON lines to `path`.
    pub fn to_file(path: &Path) -> Self {
        AuditLog {
            path: Some(path.to_path_buf()),
            records: Vec::new(),
        }
    }

    /// Records a decision (a failed file write is reported on stderr, never lost from
    /// memory).
    pub fn record(&mut self, r: AuditRecord) {
        if let Some(p) = &self.path {
            let line = serde_json::to_string(&r).unwrap_or_default();
            let res = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .and_then(|mut f| writeln!(f, "{line}"));
            if let Err(e) = res {
                eprintln!("fak: audit log {}: {e}", p.display());
            }
        }
        self.records.push(r);
    }

    /// The records so far.
    pub fn records(&self) -> &[AuditRecord] {
        &self.records
    }
}
