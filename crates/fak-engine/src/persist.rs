//! Kept conversations that outlive the process (`fak serve --kv-persist DIR`): at
//! shutdown the in-kernel driver writes the sessions its KV reuse cache keeps
//! ([`crate::prefix::PrefixCache`]), most recently used first within a byte budget, one
//! session file each ([`fak_kv::persist`]); at start it reads them back into the cache,
//! so a returning agent's next turn prefills only its new tokens, with the bits of a
//! server that never stopped.
//!
//! The files sit in a folder per model and weight mode under `DIR`
//! (`<first 16 hex digits of the model's sha256>-<exact|native>`), so servers of
//! different models may share `DIR`. Each file also carries the model's digest and
//! weight mode, its ledger (where its tool results sit) and its cache partition
//! ([`KeptMeta`]). At start:
//!
//! - a file that is damaged, truncated, of another model or weight mode, or of a shape
//!   this model cannot hold is refused whole (never half-loaded), logged with the
//!   reason, and renamed to `*.rejected` so it is not read again;
//! - every revocation in force (the ones persisted by the quarantine store,
//!   [`crate::EngineConfig::revoked`]) cuts a restored session before the first span it
//!   matches, as it cuts a live one: a revoked result is never restored;
//! - sessions beyond the KV reuse budget are dropped oldest first, as at run time.
//!
//! A revocation (at run time, or in force at start) also removes the files of the
//! sessions it matches at once, so revoked content does not stay on the disk. Every
//! [`KvPersistConfig::flush_interval`] while running and at shutdown the folder is brought up to date:
//! the kept sessions not on the disk yet are written (each atomically), every other
//! session file there is removed, and `index.json` records their least-recently-used
//! order, so the folder never holds more than the budget and a crash loses at most the
//! conversations of the last interval.

use crate::prefix::{Partition, PrefixCache, Span};
use crate::Revocation;
use fak_kv::persist::{self, ModelIdentity};
use fak_kv::Session;
use fak_model::Model;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `fak serve --kv-persist`: where kept conversations are written and read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPersistConfig {
    /// The folder (created if missing); the files go in a subfolder per model.
    pub dir: PathBuf,
    /// Most bytes of session files written at shutdown (and read at start).
    pub max_bytes: u64,
    /// How often a running server brings the folder up to date ([`FLUSH_INTERVAL`] in
    /// `fak serve`).
    pub flush_interval: std::time::Duration,
}

/// An exclusive hold on a `--kv-persist` folder for as long as it lives: two servers
/// writing one folder would each remove the other's files.
#[derive(Debug)]
pub struct DirLock {
    _file: std::fs::File,
}

/// Makes `dir` ready for `--kv-persist` before the server starts: creates it, checks
/// that files can be written there, and takes its lock (`.lock` inside it, an advisory
/// exclusive lock the OS releases when the process ends, however it ends).
///
/// # Errors
/// The folder cannot be created or written, or another process holds its lock; a
/// message naming the folder.
pub fn prepare_dir(dir: &Path) -> Result<DirLock, String> {
    std::fs::create_dir_all(dir).map_err(|e| {
        format!(
            "--kv-persist {}: cannot create the folder: {e}",
            dir.display()
        )
    })?;
    let probe = dir.join(format!(".write-test-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| format!("--kv-persist {}: cannot write there: {e}", dir.display()))?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".lock"))
        .map_err(|e| {
            format!(
                "--kv-persist {}: cannot open its lock file: {e}",
                dir.display()
            )
        })?;
    match file.try_lock() {
        Ok(()) => Ok(DirLock { _file: file }),
        Err(std::fs::TryLockError::WouldBlock) => Err(format!(
            "--kv-persist {}: another process (a fak serve?) is using this folder; give each server its own",
            dir.display()
        )),
        Err(std::fs::TryLockError::Error(e)) => Err(format!(
            "--kv-persist {}: cannot lock the folder: {e}",
            dir.display()
        )),
    }
}

/// What a kept session's file carries beside its KV.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KeptMeta {
    /// Where its tool results sit (for revocations).
    pub ledger: Vec<Span>,
    /// The cache partition it was kept in.
    pub partition: Partition,
}

/// `index.json` in the folder: the session files' names, most recently used first, as
/// of the last save (a file it does not list is restored as the oldest).
#[derive(Serialize, Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct Index {
    recent_first: Vec<String>,
}

/// The name of the folder's index.
const INDEX: &str = "index.json";

/// How often `fak serve` brings the folder up to date while running.
pub const FLUSH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// The extension of session files.
pub const EXTENSION: &str = "fakkv";

/// What a save or a restore did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PersistReport {
    /// Sessions written or read back.
    pub sessions: usize,
    /// Their bytes on the disk.
    pub bytes: u64,
    /// Files refused (restore) or sessions left out for the budget (save).
    pub skipped: usize,
    /// Restored sessions cut before a revoked result (their files removed).
    pub cut: usize,
}

/// The persistence of one in-kernel driver: its folder and the model's identity.
pub(crate) struct Persist {
    dir: PathBuf,
    identity: ModelIdentity,
    /// The kv type the server's caches store their rows in: files of another are
    /// refused.
    kv_type: fak_kv::KvType,
    max_bytes: u64,
    /// [`KvPersistConfig::flush_interval`].
    pub(crate) flush_interval: std::time::Duration,
    /// The session files on the disk with their ledgers (a revocation removes the
    /// ones it matches); also the lock that keeps two saves from overlapping.
    on_disk: std::sync::Mutex<Vec<(PathBuf, Vec<Span>)>>,
}

impl Persist {
    /// The persistence of `model_path` under `weights` and `kv_type` in `config.dir`:
    /// computes the model's digest (reads the model's bytes once) and creates the
    /// folder.
    ///
    /// # Errors
    /// The model cannot be read or the folder cannot be created, as a message.
    pub(crate) fn open(
        config: &KvPersistConfig,
        model_path: &Path,
        weights: &str,
        kv_type: fak_kv::KvType,
    ) -> Result<Persist, String> {
        let digest = persist::model_digest(model_path)
            .map_err(|e| format!("--kv-persist: reading the model to identify it: {e}"))?;
        // A folder per model, weight mode and (past the default f32) kv type: a file
        // is only ever restored into the computation that wrote it.
        let kv = match kv_type {
            fak_kv::KvType::F32 => String::new(),
            t => format!("-kv-{t}"),
        };
        let dir = config.dir.join(format!("{}-{weights}{kv}", &digest[..16]));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("--kv-persist: creating {}: {e}", dir.display()))?;
        Ok(Persist {
            dir,
            identity: ModelIdentity {
                digest,
                weights: weights.into(),
            },
            kv_type,
            max_bytes: config.max_bytes,
            flush_interval: config.flush_interval,
            on_disk: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// The folder the files go in.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    fn files(&self) -> Vec<PathBuf> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut v: Vec<PathBuf> = rd
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == EXTENSION))
            .collect();
        v.sort();
        v
    }

    /// Reads every session file of the folder into `cache` (sessions of at most
    /// `capacity` tokens; files past [`KvPersistConfig::max_bytes`] in all are left
    /// out), oldest first so that the least-recently-used order survives. A file that
    /// cannot be read is logged and renamed to `*.rejected`.
    pub(crate) fn restore(
        &self,
        model: &Arc<Model>,
        capacity: usize,
        revoked: &[Revocation],
        cache: &mut PrefixCache,
    ) -> PersistReport {
        let mut report = PersistReport::default();
        let mut read: Vec<(PathBuf, Session, KeptMeta, u64)> = Vec::new();
        let mut left = self.max_bytes;
        for path in self.files() {
            let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
            if bytes > left {
                // Not damaged, only over what is left of the budget: not read, and
                // removed at the next save.
                tracing::warn!(
                    "--kv-persist: {} left out: {bytes} bytes, {left} left of the budget of session files",
                    path.display()
                );
                report.skipped += 1;
                continue;
            }
            let loaded =
                persist::load_session::<KeptMeta>(&path, model, &self.identity, capacity, bytes)
                    .and_then(|(s, meta)| match s.cache().kv_type() {
                        t if t == self.kv_type => Ok((s, meta)),
                        t => Err(persist::PersistError::Shape(format!(
                            "kv type {t}; this server stores {}",
                            self.kv_type
                        ))),
                    });
            match loaded {
                Ok((s, meta)) => {
                    left -= bytes;
                    read.push((path, s, meta, bytes));
                }
                Err(e) => {
                    let to = path.with_extension("rejected");
                    let moved = std::fs::rename(&path, &to).is_ok();
                    tracing::warn!(
                        "--kv-persist: refused {}: {e}{}",
                        path.display(),
                        if moved {
                            format!(" (renamed to {})", to.display())
                        } else {
                            String::new()
                        }
                    );
                    report.skipped += 1;
                }
            }
        }
        // Oldest first (files the index does not list before all), so the most recent
        // ends most recently used.
        let index: Index = std::fs::read(self.dir.join(INDEX))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let age = |p: &Path| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            index
                .recent_first
                .iter()
                .position(|n| Some(n) == name.as_ref())
                .unwrap_or(usize::MAX)
        };
        read.sort_by_key(|r| std::cmp::Reverse(age(&r.0)));
        let revoked = crate::prefix::Revoked::of(revoked);
        let mut restored = Vec::new();
        for (path, session, meta, bytes) in read {
            report.sessions += 1;
            report.bytes += bytes;
            let holds_revoked = meta.ledger.iter().any(|s| revoked.matches(s));
            if holds_revoked {
                // The cache cuts it below; the file must not keep the revoked content.
                let _ = std::fs::remove_file(&path);
                report.cut += 1;
                tracing::info!(
                    "--kv-persist: {} holds a result revoked since it was written: cut before it, the file removed",
                    path.display()
                );
            } else {
                restored.push((path, meta.ledger.clone()));
            }
            cache.insert_in(&meta.partition, session, meta.ledger);
        }
        *self.lock_on_disk() = restored;
        report
    }

    fn lock_on_disk(&self) -> std::sync::MutexGuard<'_, Vec<(PathBuf, Vec<Span>)>> {
        self.on_disk.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Removes the files holding a span `r` matches (their sessions in memory were
    /// cut; what is left of them is written at the next save).
    pub(crate) fn revoke(&self, r: &Revocation) {
        let mut on_disk = self.lock_on_disk();
        on_disk.retain(|(path, ledger)| {
            let hit = ledger.iter().any(|s| s.matches(r));
            if hit {
                if let Err(e) = std::fs::remove_file(path) {
                    tracing::warn!(
                        "--kv-persist: could not remove {} after a revocation: {e}",
                        path.display()
                    );
                }
            }
            !hit
        });
    }

    /// Writes `kept` (most recently used first) while the files fit
    /// [`KvPersistConfig::max_bytes`], then removes every other session file of the
    /// folder and writes the index. A session whose file is there already is not
    /// written again: a file's name is the digest of its partition and token ids, and a
    /// kept session with those ids holds the same rows (a cut changes its ids).
    pub(crate) fn save(&self, kept: Vec<(Arc<Session>, Vec<Span>, Partition)>) -> PersistReport {
        let mut on_disk = self.lock_on_disk();
        let mut report = PersistReport::default();
        let mut written = Vec::new();
        let mut names = Vec::new();
        for (session, ledger, partition) in kept {
            let need = session.cache().bytes_used() as u64;
            if report.bytes + need > self.max_bytes {
                report.skipped += 1;
                continue;
            }
            let name = format!("{}.{EXTENSION}", name(&partition, session.ids()));
            let path = self.dir.join(&name);
            if let Some(len) = on_disk
                .iter()
                .any(|(p, _)| *p == path)
                .then(|| std::fs::metadata(&path).map(|m| m.len()).ok())
                .flatten()
            {
                report.sessions += 1;
                report.bytes += len;
                written.push((path, ledger));
                names.push(name);
                continue;
            }
            let meta = KeptMeta { ledger, partition };
            match persist::save_session(&path, &session, &self.identity, &meta) {
                Ok(n) => {
                    report.sessions += 1;
                    report.bytes += n;
                    written.push((path, meta.ledger));
                    names.push(name);
                }
                Err(e) => {
                    tracing::warn!("--kv-persist: writing {}: {e}", path.display());
                    report.skipped += 1;
                }
            }
        }
        for path in self.files() {
            if !written.iter().any(|(p, _)| *p == path) {
                let _ = std::fs::remove_file(&path);
            }
        }
        let index = Index {
            recent_first: names,
        };
        if let Ok(b) = serde_json::to_vec(&index) {
            let tmp = self.dir.join(".index.json.tmp");
            if std::fs::write(&tmp, b).is_ok() {
                let _ = std::fs::rename(&tmp, self.dir.join(INDEX));
            }
        }
        *on_disk = written;
        report
    }
}

/// A session's file name: the first 32 hex digits of the sha256 of its partition and
/// token ids.
fn name(partition: &Partition, ids: &[u32]) -> String {
    let mut s = serde_json::to_string(partition).unwrap_or_default();
    for id in ids {
        s.push(',');
        s.push_str(&id.to_string());
    }
    fak_ctxmmu::digest(&s)[..32].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_is_held_by_one_process_and_must_be_writable() {
        let dir = std::env::temp_dir().join(format!("fak-kvlock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let held = prepare_dir(&dir).unwrap();
        let e = prepare_dir(&dir).unwrap_err();
        assert!(e.contains("another process"), "{e}");
        drop(held);
        // Released with its holder.
        let again = prepare_dir(&dir).unwrap();
        drop(again);
        // A file where the folder should be.
        let file = dir.join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let e = prepare_dir(&file).unwrap_err();
        assert!(e.contains("cannot create"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
