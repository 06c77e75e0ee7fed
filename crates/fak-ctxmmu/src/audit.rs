//! The audit log: one JSON line per admission decision.
//!
//! A file log is appended by whole lines: each record is serialized with its newline
//! into one buffer and handed to the kernel in one `write` on a file opened `O_APPEND`,
//! under an exclusive advisory lock (`flock`) of that file, so two servers on one
//! `FAK_HOME` never interleave parts of their lines. A write that fails part-way (a full
//! disk) is cut back to the line boundary it started at, so the file never holds a
//! half line. Past [`AuditConfig::max_bytes`] the file is rotated (`audit.jsonl` ->
//! `audit.jsonl.1` -> ... -> `audit.jsonl.N`, the oldest dropped), so the log on disk
//! stays under about `(keep + 1) * max_bytes`.
//!
//! A record that cannot be written is counted ([`AuditLog::failures`]) and reported on
//! stderr; whether the decision it records may still take effect is the caller's choice
//! ([`AuditConfig::fail_closed`]).

use serde::Serialize;
use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// One decision.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
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
    /// `Some(false)` when the content was quarantined but its original could not be kept
    /// (the store was full of quarantined originals awaiting an operator); omitted
    /// otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept: Option<bool>,
}

/// Limits and failure policy of an [`AuditLog`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditConfig {
    /// Rotate the file before a record would take it past this many bytes; `None`: never
    /// rotate (the file grows without bound).
    pub max_bytes: Option<u64>,
    /// Rotated files kept (`PATH.1` newest .. `PATH.N` oldest); 0 drops the full file.
    pub keep: usize,
    /// When set, a decision whose record cannot be written must not take effect (the
    /// screen returns [`crate::ScreenError::Audit`], and the server refuses the request
    /// with a 503); when not, it takes effect and the failure is only counted and
    /// reported.
    pub fail_closed: bool,
    /// Most records also kept in memory (the newest; older ones leave memory, not the
    /// file).
    pub memory_records: usize,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            max_bytes: Some(100 << 20),
            keep: 5,
            fail_closed: false,
            memory_records: 1024,
        }
    }
}

/// A record that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("audit log {path}: {source}")]
pub struct AuditError {
    /// The log file.
    pub path: PathBuf,
    /// The OS error (`WriteZero` for a write the disk took only part of).
    pub source: std::io::Error,
}

/// Where audit records go: memory (the newest [`AuditConfig::memory_records`]) and,
/// optionally, an append-only file (see the module docs).
#[derive(Debug)]
pub struct AuditLog {
    file: Option<Appender>,
    config: AuditConfig,
    records: VecDeque<AuditRecord>,
    failures: u64,
}

impl Default for AuditLog {
    fn default() -> Self {
        AuditLog::in_memory()
    }
}

impl AuditLog {
    /// A log kept in memory only.
    pub fn in_memory() -> Self {
        AuditLog {
            file: None,
            config: AuditConfig::default(),
            records: VecDeque::new(),
            failures: 0,
        }
    }

    /// A log that also appends JSON lines to `path`, with the default [`AuditConfig`].
    pub fn to_file(path: &Path) -> Self {
        Self::to_file_with(path, AuditConfig::default())
    }

    /// A log that also appends JSON lines to `path` (opened at the first record).
    pub fn to_file_with(path: &Path, config: AuditConfig) -> Self {
        AuditLog {
            file: Some(Appender::new(path, config.max_bytes, config.keep)),
            config,
            records: VecDeque::new(),
            failures: 0,
        }
    }

    /// Records a decision: kept in memory, and written to the file as one whole line.
    ///
    /// # Errors
    /// [`AuditError`] when the file write failed (counted in [`AuditLog::failures`] and
    /// reported on stderr; nothing of the line stays in the file).
    pub fn record(&mut self, r: AuditRecord) -> Result<(), AuditError> {
        let res = match &mut self.file {
            Some(f) => {
                let mut line = serde_json::to_vec(&r).unwrap_or_default();
                line.push(b'\n');
                f.append(&line).map_err(|source| AuditError {
                    path: f.path.clone(),
                    source,
                })
            }
            None => Ok(()),
        };
        if let Err(e) = &res {
            self.failures += 1;
            eprintln!("fak: {e}");
        }
        if self.config.memory_records > 0 {
            if self.records.len() >= self.config.memory_records {
                self.records.pop_front();
            }
            self.records.push_back(r);
        }
        res
    }

    /// The newest records (at most [`AuditConfig::memory_records`]), oldest first.
    pub fn records(&self) -> Vec<&AuditRecord> {
        self.records.iter().collect()
    }

    /// Records whose file write failed since start.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// Whether a decision whose record failed must not take effect.
    pub fn fail_closed(&self) -> bool {
        self.config.fail_closed
    }
}

/// Appends whole lines to a file, rotating it by size (see the module docs).
#[derive(Debug)]
pub(crate) struct Appender {
    path: PathBuf,
    file: Option<File>,
    max_bytes: Option<u64>,
    keep: usize,
    /// fsync after each line (durable, slower).
    sync: bool,
}

impl Appender {
    /// An appender to `path` (opened at the first line).
    pub(crate) fn new(path: &Path, max_bytes: Option<u64>, keep: usize) -> Self {
        Appender {
            path: path.to_path_buf(),
            file: None,
            max_bytes,
            keep,
            sync: false,
        }
    }

    /// As [`Appender::new`], never rotated, each line flushed to the disk before
    /// [`Appender::append`] returns.
    pub(crate) fn durable(path: &Path) -> Self {
        Appender {
            sync: true,
            ..Self::new(path, None, 0)
        }
    }

    /// The file appended to.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn open(&self) -> std::io::Result<File> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
    }

    /// Appends `line` (a whole line, newline included) in one `write` under the file's
    /// lock. On any error, nothing of it stays in the file.
    pub(crate) fn append(&mut self, line: &[u8]) -> std::io::Result<()> {
        // Lock the file the path names now: another process may have rotated it since
        // it was opened here (then the handle held names the old file).
        let mut f = loop {
            let f = match self.file.take() {
                Some(f) => f,
                None => self.open()?,
            };
            lock(&f)?;
            match std::fs::metadata(&self.path) {
                Ok(m) if same_file(&m, &f.metadata()?) => break f,
                _ => drop(f),
            }
        };
        let res = self.append_locked(&mut f, line);
        let _ = f.unlock();
        if res.is_ok() {
            self.file = Some(f);
        }
        res
    }

    fn append_locked(&mut self, f: &mut File, line: &[u8]) -> std::io::Result<()> {
        let mut start = f.metadata()?.len();
        if let Some(max) = self.max_bytes {
            if start > 0 && start + line.len() as u64 > max {
                self.rotate()?;
                let g = self.open()?;
                lock(&g)?;
                // The old file's lock goes with it; waiters find a new file and retry.
                let _ = f.unlock();
                *f = g;
                start = f.metadata()?.len();
            }
        }
        let res = match f.write(line) {
            Ok(n) if n == line.len() => Ok(()),
            Ok(n) => Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                format!("the disk took {n} of the line's {} bytes", line.len()),
            )),
            Err(e) => Err(e),
        };
        let res = res.and_then(|()| if self.sync { f.sync_data() } else { Ok(()) });
        if res.is_err() {
            // Cut a partial line back off (under the lock no one wrote after it).
            let _ = f.set_len(start);
        }
        res
    }

    /// `PATH.(k)` -> `PATH.(k+1)` for the kept files, `PATH` -> `PATH.1` (or removed
    /// when none are kept).
    fn rotate(&self) -> std::io::Result<()> {
        let nth = |k: usize| {
            let mut p = self.path.clone().into_os_string();
            p.push(format!(".{k}"));
            PathBuf::from(p)
        };
        if self.keep == 0 {
            return std::fs::remove_file(&self.path);
        }
        let _ = std::fs::remove_file(nth(self.keep));
        for k in (1..self.keep).rev() {
            match std::fs::rename(nth(k), nth(k + 1)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        std::fs::rename(&self.path, nth(1))
    }
}

/// An exclusive advisory lock of `f`; a file system without locks (`Unsupported`) is
/// written without one (each line is still one `O_APPEND` write).
fn lock(f: &File) -> std::io::Result<()> {
    match f.lock() {
        Err(e) if e.kind() == std::io::ErrorKind::Unsupported => Ok(()),
        r => r,
    }
}

#[cfg(unix)]
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(not(unix))]
fn same_file(_: &std::fs::Metadata, _: &std::fs::Metadata) -> bool {
    true
}
