//! Revocations: content digests and tool-call ids an operator revoked, kept in memory and,
//! for a persisted store, in `revoked.jsonl` in the store's folder (one JSON line per
//! revocation, `{"digest":"<sha256 hex>"}` or `{"tool_call_id":"..."}`), appended whole
//! and flushed to the disk before the revocation is acknowledged, and read back at start.
//!
//! Bounded: at most [`MAX_REVOCATIONS`] entries (digests and call ids together). Past it a
//! new revocation is refused ([`RevokeError::Full`]) rather than an old one dropped: a
//! revocation is never forgotten silently. A damaged line (a crash mid-write, a hand
//! edit) is skipped and counted ([`Revocations::damaged`]).

use crate::audit::Appender;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// Most revocations kept (digests and tool-call ids together).
pub const MAX_REVOCATIONS: usize = 100_000;

/// The file name of the persisted revocations, in the store's folder.
pub const REVOKED_FILE: &str = "revoked.jsonl";

/// One line of `revoked.jsonl`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    #[serde(skip_serializing_if = "Option::is_none")]
    digest: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<String>,
}

/// A revocation that was not recorded.
#[derive(Debug, thiserror::Error)]
pub enum RevokeError {
    /// The list holds `max` revocations already; nothing was added.
    #[error(
        "the revocation list is full ({max} entries); nothing was revoked (revocations are never dropped to make room)"
    )]
    Full {
        /// The bound.
        max: usize,
    },
    /// The revocation is in force in this process but could not be written to the disk,
    /// so it would not survive a restart.
    #[error("the revocation is in force but could not be persisted to {path}: {source}")]
    Io {
        /// The revocations file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// The revoked digests and tool-call ids (see the module docs).
#[derive(Debug)]
pub struct Revocations {
    file: Option<Appender>,
    digests: HashSet<String>,
    calls: HashSet<String>,
    max: usize,
    damaged: usize,
}

impl Default for Revocations {
    fn default() -> Self {
        Revocations::in_memory(MAX_REVOCATIONS)
    }
}

impl Revocations {
    /// Revocations kept in memory only, at most `max`.
    pub fn in_memory(max: usize) -> Self {
        Revocations {
            file: None,
            digests: HashSet::new(),
            calls: HashSet::new(),
            max,
            damaged: 0,
        }
    }

    /// Revocations persisted in `path` (created at the first one), those already there
    /// loaded (at most `max`; damaged lines skipped and counted).
    ///
    /// # Errors
    /// The OS error when `path` exists but cannot be read.
    pub fn open(path: &Path, max: usize) -> std::io::Result<Self> {
        let mut r = Revocations {
            file: Some(Appender::durable(path)),
            ..Self::in_memory(max)
        };
        let f = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(r),
            Err(e) => return Err(e),
        };
        for line in std::io::BufReader::new(f).split(b'\n') {
            let line = line?;
            if line.is_empty() {
                continue;
            }
            match serde_json::from_slice::<Line>(&line) {
                Ok(Line {
                    digest: Some(d),
                    tool_call_id: None,
                }) if is_digest(&d) => {
                    r.digests.insert(d.to_ascii_lowercase());
                }
                Ok(Line {
                    digest: None,
                    tool_call_id: Some(c),
                }) if !c.is_empty() => {
                    r.calls.insert(c);
                }
                _ => r.damaged += 1,
            }
        }
        if r.len() > max {
            // Loaded anyway (never forgotten); new ones are refused until below `max`.
            eprintln!(
                "fak: {} holds {} revocations, more than the bound of {max}",
                path.display(),
                r.len()
            );
        }
        Ok(r)
    }

    /// Revocations in force (digests and call ids).
    pub fn len(&self) -> usize {
        self.digests.len() + self.calls.len()
    }

    /// Whether none are in force.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Damaged lines skipped at load.
    pub fn damaged(&self) -> usize {
        self.damaged
    }

    /// Whether `digest` (lowercase hex) is revoked.
    pub fn has_digest(&self, digest: &str) -> bool {
        self.digests.contains(digest)
    }

    /// Whether `tool_call_id` is revoked.
    pub fn has_call(&self, tool_call_id: &str) -> bool {
        self.calls.contains(tool_call_id)
    }

    /// The revoked digests (lowercase hex), in no order.
    pub fn digests(&self) -> impl Iterator<Item = &str> {
        self.digests.iter().map(String::as_str)
    }

    /// The revoked tool-call ids, in no order.
    pub fn calls(&self) -> impl Iterator<Item = &str> {
        self.calls.iter().map(String::as_str)
    }

    /// Revokes a digest (lowercased); `Ok(false)` if it was revoked already.
    ///
    /// # Errors
    /// [`RevokeError::Full`] (not added), [`RevokeError::Io`] (in force, not persisted).
    pub fn add_digest(&mut self, digest: &str) -> Result<bool, RevokeError> {
        let d = digest.to_ascii_lowercase();
        if self.digests.contains(&d) {
            return Ok(false);
        }
        self.check_room()?;
        let line = Line {
            digest: Some(d.clone()),
            tool_call_id: None,
        };
        self.digests.insert(d);
        self.persist(&line).map(|()| true)
    }

    /// Revokes a tool-call id; `Ok(false)` if it was revoked already.
    ///
    /// # Errors
    /// As [`Revocations::add_digest`].
    pub fn add_call(&mut self, tool_call_id: &str) -> Result<bool, RevokeError> {
        if self.calls.contains(tool_call_id) {
            return Ok(false);
        }
        self.check_room()?;
        let line = Line {
            digest: None,
            tool_call_id: Some(tool_call_id.to_string()),
        };
        self.calls.insert(tool_call_id.to_string());
        self.persist(&line).map(|()| true)
    }

    fn check_room(&self) -> Result<(), RevokeError> {
        if self.len() >= self.max {
            return Err(RevokeError::Full { max: self.max });
        }
        Ok(())
    }

    fn persist(&mut self, line: &Line) -> Result<(), RevokeError> {
        let Some(f) = &mut self.file else {
            return Ok(());
        };
        let mut bytes = serde_json::to_vec(line).unwrap_or_default();
        bytes.push(b'\n');
        f.append(&bytes).map_err(|source| RevokeError::Io {
            path: f.path().to_path_buf(),
            source,
        })
    }
}

fn is_digest(d: &str) -> bool {
    d.len() == 64 && d.bytes().all(|c| c.is_ascii_hexdigit())
}
