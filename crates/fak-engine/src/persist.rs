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
//! A revocation at run time also removes the files of the sessions it matches, so
//! revoked content does not stay on the disk until the next shutdown. At shutdown the
//! folder is rewritten: the kept sessions' files are written (each atomically) and
//! every other session file there is removed, so the folder never holds more than the
//! budget.

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
}

/// What a kept session's file carries beside its KV.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KeptMeta {
    /// Where its tool results sit (for revocations).
    pub ledger: Vec<Span>,
    /// The cache partition it was kept in.
    pub partition: Partition,
    /// Its rank in the least-recently-used order when written (0: the most recent).
    pub rank: usize,
}

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
}

/// The persistence of one in-kernel driver: its folder and the model's identity.
pub(crate) struct Persist {
    dir: PathBuf,
    identity: ModelIdentity,
    max_bytes: u64,
    /// Files read at start not yet rewritten, with their ledgers (a revocation removes
    /// the ones it matches).
    restored: std::sync::Mutex<Vec<(PathBuf, Vec<Span>)>>,
}

impl Persist {
    /// The persistence of `model_path` under `weights` in `config.dir`: computes the
    /// model's digest (reads the model's bytes once) and creates the folder.
    ///
    /// # Errors
    /// The model cannot be read or the folder cannot be created, as a message.
    pub(crate) fn open(
        config: &KvPersistConfig,
        model_path: &Path,
        weights: &str,
    ) -> Result<Persist, String> {
        let digest = persist::model_digest(model_path)
            .map_err(|e| format!("--kv-persist: reading the model to identify it: {e}"))?;
        let dir = config.dir.join(format!("{}-{weights}", &digest[..16]));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("--kv-persist: creating {}: {e}", dir.display()))?;
        Ok(Persist {
            dir,
            identity: ModelIdentity {
                digest,
                weights: weights.into(),
            },
            max_bytes: config.max_bytes,
            restored: std::sync::Mutex::new(Vec::new()),
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
            match persist::load_session::<KeptMeta>(&path, model, &self.identity, capacity, bytes) {
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
        // Oldest (highest rank) first, so the most recent ends most recently used.
        read.sort_by_key(|r| std::cmp::Reverse(r.2.rank));
        let mut restored = Vec::new();
        for (path, session, meta, bytes) in read {
            report.sessions += 1;
            report.bytes += bytes;
            restored.push((path, meta.ledger.clone()));
            cache.insert_in(&meta.partition, session, meta.ledger);
        }
        *self.lock_restored() = restored;
        report
    }

    fn lock_restored(&self) -> std::sync::MutexGuard<'_, Vec<(PathBuf, Vec<Span>)>> {
        self.restored.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Removes the restored files holding a span `r` matches (their sessions in memory
    /// were cut; what is left of them is written at shutdown).
    pub(crate) fn revoke(&self, r: &Revocation) {
        let mut restored = self.lock_restored();
        restored.retain(|(path, ledger)| {
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
    /// folder.
    pub(crate) fn save(&self, kept: Vec<(Arc<Session>, Vec<Span>, Partition)>) -> PersistReport {
        let mut report = PersistReport::default();
        let mut written = std::collections::HashSet::new();
        for (rank, (session, ledger, partition)) in kept.into_iter().enumerate() {
            let need = session.cache().bytes_used() as u64;
            if report.bytes + need > self.max_bytes {
                report.skipped += 1;
                continue;
            }
            let path = self
                .dir
                .join(format!("{}.{EXTENSION}", name(&partition, session.ids())));
            let meta = KeptMeta {
                ledger,
                partition,
                rank,
            };
            match persist::save_session(&path, &session, &self.identity, &meta) {
                Ok(n) => {
                    report.sessions += 1;
                    report.bytes += n;
                    written.insert(path);
                }
                Err(e) => {
                    tracing::warn!("--kv-persist: writing {}: {e}", path.display());
                    report.skipped += 1;
                }
            }
        }
        for path in self.files() {
            if !written.contains(&path) {
                let _ = std::fs::remove_file(&path);
            }
        }
        self.lock_restored().clear();
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
