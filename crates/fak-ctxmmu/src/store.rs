//! The page-out store: originals of paged-out and quarantined results, kept in memory
//! and, when given a folder, on disk (one JSON file per item) so they survive a restart.

use crate::detect::Reason;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Why an item is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoredKind {
    /// A large benign result, readable any time.
    PagedOut,
    /// A quarantined result, readable only after an operator clear.
    Quarantined,
}

/// One stored original.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredItem {
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
    /// The original content.
    pub content: String,
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
}

/// Originals by id, optionally persisted in a folder.
#[derive(Debug, Default)]
pub struct PageStore {
    dir: Option<PathBuf>,
    items: BTreeMap<String, StoredItem>,
    next: u64,
}

impl PageStore {
    /// A store kept in memory only.
    pub fn in_memory() -> Self {
        PageStore::default()
    }

    /// A store persisted in `dir` (created if missing); items already there are loaded.
    ///
    /// # Errors
    /// [`StoreError::Io`] / [`StoreError::Corrupt`].
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut items = BTreeMap::new();
        let mut next = 0;
        for e in std::fs::read_dir(dir).map_err(io(dir))? {
            let p = e.map_err(io(dir))?.path();
            if p.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let text = std::fs::read_to_string(&p).map_err(io(&p))?;
            let item: StoredItem =
                serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                    path: p.clone(),
                    reason: e.to_string(),
                })?;
            if let Ok(n) = item.id[1..].parse::<u64>() {
                next = next.max(n + 1);
            }
            items.insert(item.id.clone(), item);
        }
        Ok(PageStore {
            dir: Some(dir.to_path_buf()),
            items,
            next,
        })
    }

    /// Writes `item` to a temporary file of this process in `dir`; returns it and the
    /// item's final path.
    fn write_tmp(dir: &Path, item: &StoredItem) -> Result<(PathBuf, PathBuf), StoreError> {
        let path = dir.join(format!("{}.json", item.id));
        let tmp = dir.join(format!(".{}.{}.json.tmp", item.id, std::process::id()));
        let json = serde_json::to_string(item).map_err(|e| StoreError::Corrupt {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        std::fs::write(&tmp, json).map_err(|source| StoreError::Io {
            path: tmp.clone(),
            source,
        })?;
        Ok((tmp, path))
    }

    /// Rewrites an item already stored (atomically: write, then rename over it).
    fn persist(&self, item: &StoredItem) -> Result<(), StoreError> {
        let Some(dir) = &self.dir else { return Ok(()) };
        let (tmp, path) = Self::write_tmp(dir, item)?;
        std::fs::rename(&tmp, &path).map_err(|source| StoreError::Io { path, source })
    }

    /// Stores an original and returns its id.
    ///
    /// In a folder shared by several processes (two servers with one `FAK_HOME`), an id
    /// is claimed atomically: the item is written to a temporary file and hard-linked to
    /// its final name, which fails if another process took that id first; then the next
    /// number is tried. No item ever overwrites another.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the item cannot be persisted (nothing is kept then).
    pub fn put(&mut self, mut item: StoredItem) -> Result<String, StoreError> {
        let prefix = match item.kind {
            StoredKind::PagedOut => 'p',
            StoredKind::Quarantined => 'q',
        };
        loop {
            item.id = format!("{prefix}{}", self.next);
            self.next += 1;
            if self.items.contains_key(&item.id) {
                continue;
            }
            if self.claim(&item)? {
                break;
            }
        }
        let id = item.id.clone();
        self.items.insert(id.clone(), item);
        Ok(id)
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

    /// Every stored item, in id order (`p` before `q`, then by number: q2 before q10).
    pub fn list(&self) -> impl Iterator<Item = &StoredItem> {
        let mut v: Vec<&StoredItem> = self.items.values().collect();
        v.sort_by_key(|i| {
            let n = i.id.get(1..).and_then(|n| n.parse::<u64>().ok());
            (i.id.chars().next(), n, i.id.clone())
        });
        v.into_iter()
    }

    /// The item's record (content included) for an operator's eyes.
    pub fn get(&self, id: &str) -> Option<&StoredItem> {
        self.items.get(id)
    }

    /// The content of `id` for the model's context: paged-out items always, quarantined
    /// ones only after [`PageStore::clear`].
    ///
    /// # Errors
    /// [`StoreError::NotFound`], [`StoreError::NotCleared`].
    pub fn read(&self, id: &str) -> Result<&str, StoreError> {
        let item = self
            .items
            .get(id)
            .ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        if item.kind == StoredKind::Quarantined && !item.cleared {
            return Err(StoreError::NotCleared(id.to_string()));
        }
        Ok(&item.content)
    }

    /// An operator clears a quarantined item for reading.
    ///
    /// # Errors
    /// [`StoreError::NotFound`]; [`StoreError::Io`] if it cannot be persisted.
    pub fn clear(&mut self, id: &str) -> Result<(), StoreError> {
        let mut item = self
            .items
            .get(id)
            .cloned()
            .ok_or_else(|| StoreError::NotFound(id.to_string()))?;
        item.cleared = true;
        self.persist(&item)?;
        self.items.insert(id.to_string(), item);
        Ok(())
    }
}
