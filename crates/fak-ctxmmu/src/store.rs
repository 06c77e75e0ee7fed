//! The page-out store: originals of paged-out and quarantined results, in memory or, when
//! given a folder, on disk (one JSON file per item, `<id>.json`) so they survive a
//! restart.
//!
//! **Lazy.** A persisted store keeps only an index in memory ([`StoredMeta`]: id, kind,
//! reason, digest, length, and for a paged-out item its 200-character preview); an
//! item's content is read from its file when asked for ([`PageStore::get`],
//! [`PageStore::read`]). At open, a file that cannot be read or parsed, or whose id or
//! name is not one the store writes, is skipped and reported ([`PageStore::damaged`]),
//! never a reason to stop; temporary files older than [`STALE_TMP`] (left by a process
//! killed mid-write) are removed.
//!
//! **Bounded** by [`StoreLimits`] (items and bytes of content). When an item would take
//! the store past either bound, room is made by evicting, oldest first, paged-out items,
//! then quarantined items an operator has cleared. A quarantined original not yet
//! cleared is never evicted: when only those remain, [`PageStore::put`] fails with
//! [`StoreError::Full`] and nothing is stored (the screen then still quarantines the
//! content, without keeping its original, and says so in the audit record; see
//! [`crate::Screen`]). The bounds count the items this process knows (those found at
//! open and those it stored); two servers on one folder each keep to them over their
//! own view.

use crate::detect::Reason;
use crate::revoked::{Revocations, MAX_REVOCATIONS, REVOKED_FILE};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Temporary files older than this at open are left over from a crash and removed.
pub const STALE_TMP: Duration = Duration::from_secs(60);

/// Characters of a paged-out item's preview.
pub const PREVIEW_CHARS: usize = 200;

/// Why an item is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoredKind {
    /// A large benign result, readable any time.
    PagedOut,
    /// A quarantined result, readable only after an operator clear.
    Quarantined,
}

/// What a stored item is, apart from its content: the part the index keeps in memory
/// ([`StoredMeta::head`]) and the file's fields other than `content` ([`StoredItem::head`],
/// flattened, so the file is one flat JSON object).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredHead {
    /// `p<n>` for paged-out items, `q<n>` for quarantined ones.
    pub id: String,
    /// Why it is stored.
    pub kind: StoredKind,
    /// The quarantine reason.
    pub reason: Option<Reason>,
    /// The detector that quarantined it.
    pub detector: Option<String>,
    /// Conversation it arrived in.
    pub conversation: String,
    /// Tool that produced it.
    pub tool: String,
    /// sha256 of the content, hex.
    pub digest: String,
    /// Whether an operator cleared it for reading.
    pub cleared: bool,
}

/// One stored original (the file's content).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredItem {
    /// Everything but the content.
    #[serde(flatten)]
    pub head: StoredHead,
    /// The original content.
    pub content: String,
}

/// What the index keeps of an item: all but its content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredMeta {
    /// The item's fields other than its content.
    pub head: StoredHead,
    /// Length of the content, bytes.
    pub len: usize,
    /// A paged-out item's first [`PREVIEW_CHARS`] characters (empty for a quarantined
    /// one: its content is not shown before a clear).
    pub preview: String,
}

impl StoredMeta {
    fn of(i: &StoredItem) -> Self {
        StoredMeta {
            head: i.head.clone(),
            len: i.content.len(),
            preview: match i.head.kind {
                StoredKind::PagedOut => i.content.chars().take(PREVIEW_CHARS).collect(),
                StoredKind::Quarantined => String::new(),
            },
        }
    }
}

/// Bounds of a store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    /// Most items.
    pub max_items: usize,
    /// Most bytes of content, summed over the items.
    pub max_bytes: u64,
}

impl Default for StoreLimits {
    /// 10,000 items, 1 GiB.
    fn default() -> Self {
        StoreLimits {
            max_items: 10_000,
            max_bytes: 1 << 30,
        }
    }
}

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Reading or writing the store folder failed.
    #[error("page-out store {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A stored file is not valid.
    #[error("page-out store {path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No item has this id.
    #[error("no stored item '{0}'")]
    NotFound(String),
    /// A quarantined item was read before an operator cleared it.
    #[error("'{0}' is quarantined; an operator must clear it before it can be read")]
    NotCleared(String),
    /// No room: the store is at a bound and holds only quarantined originals awaiting an
    /// operator clear (which are never evicted). Nothing was stored.
    #[error(
        "page-out store full ({items} items, {bytes} bytes; bounds {max_items} items, {max_bytes} bytes) of quarantined originals awaiting an operator clear"
    )]
    Full {
        /// Items held.
        items: usize,
        /// Bytes held.
        bytes: u64,
        /// The item bound.
        max_items: usize,
        /// The byte bound.
        max_bytes: u64,
    },
}

/// An index key: (`p` or `q`, number), so that iteration is in id order.
type Key = (char, u64);

fn key_of(id: &str) -> Option<Key> {
    let mut c = id.chars();
    let p = c.next().filter(|p| *p == 'p' || *p == 'q')?;
    let n = c.as_str();
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) || (n.len() > 1 && n.starts_with('0'))
    {
        return None;
    }
    Some((p, n.parse().ok()?))
}

/// Originals by id, optionally persisted in a folder (see the module docs).
#[derive(Debug, Default)]
pub struct PageStore {
    dir: Option<PathBuf>,
    items: BTreeMap<Key, StoredMeta>,
    /// Contents of an in-memory store (a persisted one reads its files).
    contents: HashMap<Key, String>,
    bytes: u64,
    next: u64,
    limits: StoreLimits,
    damaged: Vec<(PathBuf, String)>,
    /// Digests of items evicted since the last [`PageStore::take_evicted`].
    evicted: Vec<String>,
    revocations: Option<Revocations>,
}

impl PageStore {
    /// A store kept in memory only, with the default [`StoreLimits`].
    pub fn in_memory() -> Self {
        PageStore::default()
    }

    /// A store kept in memory only, within `limits`.
    pub fn in_memory_with(limits: StoreLimits) -> Self {
        PageStore {
            limits,
            ..PageStore::default()
        }
    }

    /// A store persisted in `dir` (created if missing), with the default limits.
    ///
    /// # Errors
    /// As [`PageStore::open_with`].
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::open_with(dir, StoreLimits::default())
    }

    /// A store persisted in `dir` (created if missing), within `limits`: the items
    /// already there are indexed (their contents stay on disk), damaged ones skipped
    /// and reported, stale temporary files removed, and the persisted revocations
    /// (`revoked.jsonl`) loaded. Items found beyond the limits are kept (never dropped
    /// at start); the limits apply from the next [`PageStore::put`].
    ///
    /// # Errors
    /// [`StoreError::Io`] when the folder (or the revocations file) cannot be read.
    pub fn open_with(dir: &Path, limits: StoreLimits) -> Result<Self, StoreError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let revoked = dir.join(REVOKED_FILE);
        let mut s = PageStore {
            dir: Some(dir.to_path_buf()),
            limits,
            revocations: Some(Revocations::open(&revoked, MAX_REVOCATIONS).map_err(io(&revoked))?),
            ..PageStore::default()
        };
        for e in std::fs::read_dir(dir).map_err(io(dir))? {
            let p = e.map_err(io(dir))?.path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if name.ends_with(".tmp") {
                let old = std::fs::metadata(&p)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age >= STALE_TMP);
                if old {
                    let _ = std::fs::remove_file(&p);
                }
                continue;
            }
            let Some(stem) = name.strip_suffix(".json") else {
                continue;
            };
            match Self::load_meta(&p, stem) {
                Ok((k, m)) => {
                    s.next = s.next.max(k.1 + 1);
                    s.bytes += m.len as u64;
                    s.items.insert(k, m);
                }
                Err(why) => s.damaged.push((p, why)),
            }
        }
        Ok(s)
    }

    /// Reads `p` for the index; why not, when it is damaged.
    fn load_meta(p: &Path, stem: &str) -> Result<(Key, StoredMeta), String> {
        let text = std::fs::read(p).map_err(|e| e.to_string())?;
        let item: StoredItem = serde_json::from_slice(&text).map_err(|e| e.to_string())?;
        let k = key_of(&item.head.id).ok_or_else(|| format!("bad id '{}'", item.head.id))?;
        if item.head.id != stem {
            return Err(format!("holds id '{}'", item.head.id));
        }
        let kind_ok = match item.head.kind {
            StoredKind::PagedOut => k.0 == 'p',
            StoredKind::Quarantined => k.0 == 'q',
        };
        if !kind_ok {
            return Err(format!(
                "id '{}' does not match kind {:?}",
                item.head.id, item.head.kind
            ));
        }
        Ok((k, StoredMeta::of(&item)))
    }

    /// Files skipped at open as damaged, and why.
    pub fn damaged(&self) -> &[(PathBuf, String)] {
        &self.damaged
    }

    /// The bounds.
    pub fn limits(&self) -> StoreLimits {
        self.limits
    }

    /// Bytes of content held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Number of items held.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the store holds no item.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The persisted revocations found at open (once; `None` for an in-memory store).
    pub fn take_revocations(&mut self) -> Option<Revocations> {
        self.revocations.take()
    }

    /// Digests of the items evicted since the last call.
    pub fn take_evicted(&mut self) -> Vec<String> {
        std::mem::take(&mut self.evicted)
    }

    fn path_of(dir: &Path, id: &str) -> PathBuf {
        dir.join(format!("{id}.json"))
    }

    /// Writes `item` to a temporary file of this process in `dir` (flushed to the disk);
    /// returns it and the item's final path. Nothing is left behind on failure.
    fn write_tmp(dir: &Path, item: &StoredItem) -> Result<(PathBuf, PathBuf), StoreError> {
        let path = Self::path_of(dir, &item.head.id);
        let tmp = dir.join(format!(".{}.{}.json.tmp", item.head.id, std::process::id()));
        let json = serde_json::to_vec(item).map_err(|e| StoreError::Corrupt {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let res = std::fs::File::create(&tmp).and_then(|mut f| {
            f.write_all(&json)?;
            f.sync_data()
        });
        if let Err(source) = res {
            let _ = std::fs::remove_file(&tmp);
            return Err(StoreError::Io { path: tmp, source });
        }
        Ok((tmp, path))
    }

    /// Rewrites an item already stored (atomically: write, then rename over it).
    fn persist(&self, item: &StoredItem) -> Result<(), StoreError> {
        let Some(dir) = &self.dir else { return Ok(()) };
        let (tmp, path) = Self::write_tmp(dir, item)?;
        std::fs::rename(&tmp, &path).map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            StoreError::Io { path, source }
        })
    }

    /// Stores an original and returns its id, first evicting what the bounds require
    /// (see the module docs).
    ///
    /// In a folder shared by several processes (two servers with one `FAK_HOME`), an id
    /// is claimed atomically: the item is written to a temporary file and hard-linked to
    /// its final name, which fails if another process took that id first; then the next
    /// number is tried. No item ever overwrites another.
    ///
    /// # Errors
    /// [`StoreError::Full`] when no room can be made; [`StoreError::Io`] when the item
    /// cannot be persisted. Nothing is kept then.
    pub fn put(&mut self, mut item: StoredItem) -> Result<String, StoreError> {
        self.make_room(item.content.len() as u64)?;
        let prefix = match item.head.kind {
            StoredKind::PagedOut => 'p',
            StoredKind::Quarantined => 'q',
        };
        let key = loop {
            let k = (prefix, self.next);
            item.head.id = format!("{prefix}{}", self.next);
            self.next += 1;
            if self.items.contains_key(&k) {
                continue;
            }
            if self.claim(&item)? {
                break k;
            }
        };
        let id = item.head.id.clone();
        self.bytes += item.content.len() as u64;
        self.items.insert(key, StoredMeta::of(&item));
        if self.dir.is_none() {
            self.contents.insert(key, item.content);
        }
        Ok(id)
    }

    /// Evicts until one more item of `size` bytes fits, or fails with
    /// [`StoreError::Full`] (having evicted what it could).
    fn make_room(&mut self, size: u64) -> Result<(), StoreError> {
        let fits =
            |s: &Self| s.items.len() < s.limits.max_items && s.bytes + size <= s.limits.max_bytes;
        while !fits(self) {
            let victim = self
                .items
                .iter()
                .find(|(_, m)| m.head.kind == StoredKind::PagedOut)
                .or_else(|| self.items.iter().find(|(_, m)| m.head.cleared))
                .map(|(k, _)| *k);
            let Some(k) = victim else {
                return Err(StoreError::Full {
                    items: self.items.len(),
                    bytes: self.bytes,
                    max_items: self.limits.max_items,
                    max_bytes: self.limits.max_bytes,
                });
            };
            let m = self.items.remove(&k).expect("victim in the index");
            self.contents.remove(&k);
            self.bytes -= m.len as u64;
            if let Some(dir) = &self.dir {
                let _ = std::fs::remove_file(Self::path_of(dir, &m.head.id));
            }
            self.evicted.push(m.head.digest);
        }
        Ok(())
    }

    /// Writes a new item under its id unless the id is taken on disk; `Ok(false)` when
    /// it is (always `Ok(true)` in memory).
    fn claim(&self, item: &StoredItem) -> Result<bool, StoreError> {
        let Some(dir) = &self.dir else {
            return Ok(true);
        };
        let (tmp, path) = Self::write_tmp(dir, item)?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(source) => Err(StoreError::Io { path, source }),
        }
    }

    /// Every stored item's index entry, in id order (`p` before `q`, then by number: q2
    /// before q10).
    pub fn list(&self) -> impl Iterator<Item = &StoredMeta> {
        self.items.values()
    }

    /// The index entry of `id`.
    pub fn meta(&self, id: &str) -> Option<&StoredMeta> {
        self.items.get(&key_of(id)?)
    }

    /// The item's record (content included, read from its file) for an operator's eyes.
    ///
    /// # Errors
    /// [`StoreError::NotFound`]; [`StoreError::Io`] / [`StoreError::Corrupt`] when its
    /// file cannot be read back.
    pub fn get(&self, id: &str) -> Result<StoredItem, StoreError> {
        let not_found = || StoreError::NotFound(id.to_string());
        let k = key_of(id).ok_or_else(not_found)?;
        let m = self.items.get(&k).ok_or_else(not_found)?;
        let Some(dir) = &self.dir else {
            return Ok(StoredItem {
                head: m.head.clone(),
                content: self.contents.get(&k).cloned().unwrap_or_default(),
            });
        };
        let path = Self::path_of(dir, id);
        let text = std::fs::read(&path).map_err(|source| StoreError::Io {
            path: path.clone(),
            source,
        })?;
        let mut item: StoredItem =
            serde_json::from_slice(&text).map_err(|e| StoreError::Corrupt {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        if item.head.id != id {
            return Err(StoreError::Corrupt {
                path,
                reason: format!("holds id '{}'", item.head.id),
            });
        }
        // A clear made by this process is in the index even if another rewrote the file.
        item.head.cleared |= m.head.cleared;
        Ok(item)
    }

    /// The content of `id` for the model's context: paged-out items always, quarantined
    /// ones only after [`PageStore::clear`].
    ///
    /// # Errors
    /// [`StoreError::NotFound`], [`StoreError::NotCleared`], and as [`PageStore::get`].
    pub fn read(&self, id: &str) -> Result<String, StoreError> {
        let m = self
            .meta(id)
            .ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        if m.head.kind == StoredKind::Quarantined && !m.head.cleared {
            return Err(StoreError::NotCleared(id.to_string()));
        }
        Ok(self.get(id)?.content)
    }

    /// An operator clears a quarantined item for reading.
    ///
    /// # Errors
    /// [`StoreError::NotFound`]; [`StoreError::Io`] if it cannot be persisted.
    pub fn clear(&mut self, id: &str) -> Result<(), StoreError> {
        let mut item = self.get(id)?;
        item.head.cleared = true;
        self.persist(&item)?;
        if let Some(m) = key_of(id).and_then(|k| self.items.get_mut(&k)) {
            m.head.cleared = true;
        }
        Ok(())
    }
}
