//! Session files: a [`Session`]'s token ids and KV cache written to a file and read
//! back bit for bit, so a conversation outlives the process (`fak chat --session`,
//! `fak serve --kv-persist`) and its next turn prefills only its new tokens.
//!
//! # Format (version 1)
//!
//! All integers little-endian.
//!
//! | bytes | content |
//! |---|---|
//! | 8 | magic `FAKKVSES` |
//! | 4 | format version, `u32` ([`FORMAT_VERSION`]) |
//! | 4 | header length `H`, `u32`, at most [`MAX_HEADER_BYTES`] |
//! | `H` | header: JSON ([`Header`]): the model's digest, the weight mode, the kv type, the cache's shape, the token count, and the caller's metadata |
//! | `4n` | token ids, `u32` |
//! | `4n` | RoPE positions, `u32` |
//! | per layer, per stored array | the rows in the kv type, as they are in memory: `f32` K (after RoPE), K before RoPE and V (`4 · n · kv_dim` bytes each); `f16` or `q8_0` K before RoPE and V (`n · kv_dim · 2`, or `n · kv_dim / 32 · 34`: ggml's `block_q8_0`) |
//! | 32 | sha256 of every byte before it |
//!
//! Shared prefixes ([`crate::KvCache::freeze`]) are written out whole: a file holds
//! its session alone.
//!
//! # Reading
//!
//! [`read_session`] checks, before it builds anything: the magic, the version, the
//! header, that the file's length is exactly what the header implies (so a truncated
//! or padded file is refused, and no allocation exceeds what the model's context
//! bounds), the checksum, then that the header names this model (digest and weight
//! mode), its cache shape and a token count within the session's capacity. A file that
//! fails any check is refused with an error naming it ([`PersistError`]); nothing is
//! half-loaded. The rows are then appended to an empty cache as a forward pass would,
//! so the restored session equals the saved one bit for bit (`PartialEq`). The session
//! gets the file's kv type ([`fak_model::KvType`]); a caller that keeps one type
//! compares it ([`crate::KvCache::kv_type`]).

use crate::{KvCache, Session};
use fak_model::{KvStore, KvType, Model};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;

/// The first bytes of every session file.
pub const MAGIC: &[u8; 8] = b"FAKKVSES";

/// The format version written; the only one read.
pub const FORMAT_VERSION: u32 = 1;

/// Largest header accepted, bytes (its metadata included).
pub const MAX_HEADER_BYTES: usize = 16 << 20;

/// What a session file says of its contents, before the rows.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Header<M> {
    /// The model it was computed by ([`ModelIdentity::digest`]).
    pub model_digest: String,
    /// The weight mode it was computed with ([`ModelIdentity::weights`]).
    pub weights: String,
    /// How K and V are stored ([`fak_model::KvType::name`]).
    pub kv_type: String,
    /// Layers of the cache.
    pub layers: usize,
    /// Width of one row, `kv_heads · head_dim`.
    pub kv_dim: usize,
    /// Entries (tokens).
    pub tokens: usize,
    /// The caller's metadata (a conversation's messages, a kept session's ledger).
    pub meta: M,
}

/// Which computation a cache belongs to: a file written under one identity is refused
/// under any other, since its rows would not be the bits that model computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// sha256 (lowercase hex) of the model's files ([`model_digest`]).
    pub digest: String,
    /// The weight mode (`exact` or `native`): the same file gives other rows in each.
    pub weights: String,
}

impl ModelIdentity {
    /// The identity of `model` loaded from `path`: [`model_digest`] of the file or
    /// folder and the model's weight mode ([`fak_model::WeightMode::name`]).
    ///
    /// # Errors
    /// The file or folder cannot be read.
    pub fn of(path: &Path, model: &Model) -> std::io::Result<Self> {
        Ok(ModelIdentity {
            digest: model_digest(path)?,
            weights: model.weight_mode().name().to_string(),
        })
    }
}

/// Why a session file was not written or not read.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// Reading or writing the file failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The file does not start with [`MAGIC`].
    #[error("not a fak session file (no FAKKVSES magic)")]
    NotASessionFile,
    /// The file is of another format version.
    #[error("session file format version {found}; this build reads version {FORMAT_VERSION}")]
    Version {
        /// The version in the file.
        found: u32,
    },
    /// The file is truncated, padded, or its bytes differ from what was written.
    #[error("damaged session file: {0}")]
    Damaged(String),
    /// The file was written for another model or weight mode.
    #[error("the session file is for another model or weight mode ({file}); the model loaded is {running}")]
    OtherModel {
        /// The file's model digest and weight mode.
        file: String,
        /// This model's.
        running: String,
    },
    /// The file's cache does not fit this model or session.
    #[error("the session file does not fit: {0}")]
    Shape(String),
}

/// sha256 (lowercase hex) of a model: of the file's bytes, or, for a folder (a
/// safetensors checkpoint), of its regular files' names and sha256s in name order.
/// Reads every byte once.
///
/// # Errors
/// The file or folder cannot be read.
pub fn model_digest(path: &Path) -> std::io::Result<String> {
    fn file_sha(path: &Path) -> std::io::Result<[u8; 32]> {
        let mut f = std::fs::File::open(path)?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        Ok(h.finalize().into())
    }
    let sha = if path.is_dir() {
        let mut names: Vec<_> = std::fs::read_dir(path)?
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .map(|e| e.file_name())
            .collect();
        names.sort();
        let mut h = Sha256::new();
        for name in names {
            let bytes = name.as_encoded_bytes();
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
            h.update(file_sha(&path.join(&name))?);
        }
        h.finalize().into()
    } else {
        file_sha(path)?
    };
    Ok(hex(&sha))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `session` (its ids and every KV row) with `meta` to `w` in the format of the
/// module docs, and returns the bytes written.
///
/// # Errors
/// [`PersistError::Io`] when writing fails; the header cannot fail to serialize for
/// metadata made of plain data.
pub fn write_session<M: Serialize>(
    w: &mut impl Write,
    session: &Session,
    identity: &ModelIdentity,
    meta: &M,
) -> Result<u64, PersistError> {
    let cache = session.cache();
    let header = Header {
        model_digest: identity.digest.clone(),
        weights: identity.weights.clone(),
        kv_type: cache.kv_type().name().into(),
        layers: cache.n_layers(),
        kv_dim: cache.kv_dim(),
        tokens: cache.len(),
        meta,
    };
    let json = serde_json::to_vec(&header)
        .map_err(|e| PersistError::Io(std::io::Error::other(e.to_string())))?;
    if json.len() > MAX_HEADER_BYTES {
        return Err(PersistError::Shape(format!(
            "the header would be {} bytes, above the {MAX_HEADER_BYTES} a file may carry",
            json.len()
        )));
    }
    let mut out = Hashing {
        inner: w,
        sha: Sha256::new(),
        bytes: 0,
    };
    out.put(MAGIC)?;
    out.put(&FORMAT_VERSION.to_le_bytes())?;
    out.put(&(json.len() as u32).to_le_bytes())?;
    out.put(&json)?;
    out.put_le(session.ids(), u32::to_le_bytes)?;
    out.put_le(cache.positions(), u32::to_le_bytes)?;
    for layer in 0..cache.n_layers() {
        for rows in cache.stored_arrays(layer) {
            let mut err = None;
            rows.for_stored(0..rows.len(), |run, _| {
                if err.is_none() {
                    err = out.put(run.as_bytes()).err();
                }
            });
            if let Some(e) = err {
                return Err(e.into());
            }
        }
    }
    let sha: [u8; 32] = out.sha.clone().finalize().into();
    out.inner.write_all(&sha)?;
    Ok(out.bytes + 32)
}

/// A writer that hashes what passes through it.
struct Hashing<'a, W: Write> {
    inner: &'a mut W,
    sha: Sha256,
    bytes: u64,
}

impl<W: Write> Hashing<'_, W> {
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.sha.update(b);
        self.bytes += b.len() as u64;
        self.inner.write_all(b)
    }

    /// Writes `xs`, each as its 4 little-endian bytes (`le`), in pieces of 64 Ki.
    fn put_le<T: Copy>(&mut self, xs: &[T], le: impl Fn(T) -> [u8; 4]) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(4 * xs.len().min(1 << 16));
        for chunk in xs.chunks(1 << 16) {
            buf.clear();
            chunk.iter().for_each(|&x| buf.extend_from_slice(&le(x)));
            self.put(&buf)?;
        }
        Ok(())
    }
}

/// Writes `session` to `path` through a temporary file in the same folder renamed into
/// place (flushed to the disk first), so `path` is never seen half-written. Returns the
/// bytes written.
///
/// # Errors
/// As [`write_session`]; the temporary file is removed on failure.
pub fn save_session<M: Serialize>(
    path: &Path,
    session: &Session,
    identity: &ModelIdentity,
    meta: &M,
) -> Result<u64, PersistError> {
    let name = path
        .file_name()
        .ok_or_else(|| PersistError::Io(std::io::Error::other("a session file needs a name")))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    let result = (|| {
        let file = std::fs::File::create(&tmp)?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        let n = write_session(&mut w, session, identity, meta)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(n)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Reads a session written by [`write_session`] for `model` under `identity`: a session
/// whose cache holds at most `capacity` tokens (capped at the model's context), equal
/// bit for bit to the one written, and its metadata. At most `max_bytes` are read: a
/// longer file is refused before its rows are.
///
/// # Errors
/// Any check of the module docs that fails, as [`PersistError`].
pub fn read_session<M: DeserializeOwned>(
    r: &mut impl Read,
    model: &Arc<Model>,
    identity: &ModelIdentity,
    capacity: usize,
    max_bytes: u64,
) -> Result<(Session, M), PersistError> {
    read_checked(r, model, identity, capacity, max_bytes, None)
}

/// [`read_session`], and when `file_len` is known, a file of another length than its
/// header implies is refused before the rows are read (or allocated).
fn read_checked<M: DeserializeOwned>(
    r: &mut impl Read,
    model: &Arc<Model>,
    identity: &ModelIdentity,
    capacity: usize,
    max_bytes: u64,
    file_len: Option<u64>,
) -> Result<(Session, M), PersistError> {
    let mut sha = Sha256::new();
    let mut head = [0u8; 16];
    read_exact(r, &mut head, "the file ends inside its first 16 bytes")?;
    sha.update(head);
    if &head[..8] != MAGIC {
        return Err(PersistError::NotASessionFile);
    }
    let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
    if version != FORMAT_VERSION {
        return Err(PersistError::Version { found: version });
    }
    let hlen = u32::from_le_bytes([head[12], head[13], head[14], head[15]]) as usize;
    if hlen > MAX_HEADER_BYTES {
        return Err(PersistError::Damaged(format!(
            "a header of {hlen} bytes (at most {MAX_HEADER_BYTES})"
        )));
    }
    let mut json = vec![0u8; hlen];
    read_exact(r, &mut json, "the file ends inside its header")?;
    sha.update(&json);
    let header: Header<M> = serde_json::from_slice(&json)
        .map_err(|e| PersistError::Damaged(format!("its header: {e}")))?;
    let running = format!("{} ({} weights)", identity.digest, identity.weights);
    if header.model_digest != identity.digest || header.weights != identity.weights {
        return Err(PersistError::OtherModel {
            file: format!("{} ({} weights)", header.model_digest, header.weights),
            running,
        });
    }
    let Some(ty) = KvType::parse(&header.kv_type) else {
        return Err(PersistError::Shape(format!(
            "kv type {:?}; this build stores {}",
            header.kv_type,
            KvType::ALL.map(KvType::name).join(", ")
        )));
    };
    let config = model.config();
    let capacity = capacity.min(config.max_position_embeddings);
    let (layers, kv_dim, n) = (config.num_hidden_layers, config.kv_dim(), header.tokens);
    if header.layers != layers || header.kv_dim != kv_dim {
        return Err(PersistError::Shape(format!(
            "a cache of {} layers × {} per row; the model has {layers} × {kv_dim}",
            header.layers, header.kv_dim
        )));
    }
    ty.check(kv_dim).map_err(PersistError::Shape)?;
    if n > capacity {
        return Err(PersistError::Shape(format!(
            "{n} tokens; a session here holds at most {capacity}"
        )));
    }
    // Bounded by the capacity checked above, so this cannot overflow on 64 bits.
    let row_bytes = n * ty.row_bytes(kv_dim);
    let body = (8 * n + ty.arrays() * row_bytes * layers) as u64;
    let total = 16 + hlen as u64 + body + 32;
    match file_len {
        Some(len) if len < total => {
            return Err(PersistError::Damaged(format!(
                "the file is shorter than its header says ({len} bytes, not {total})"
            )))
        }
        Some(len) if len > total => {
            return Err(PersistError::Damaged(format!(
                "the file is longer than its header says ({len} bytes, not {total})"
            )))
        }
        _ => {}
    }
    if total > max_bytes {
        return Err(PersistError::Shape(format!(
            "{total} bytes, above the {max_bytes} allowed"
        )));
    }
    let mut bytes = vec![0u8; body as usize];
    read_exact(r, &mut bytes, "the file is shorter than its header says")?;
    sha.update(&bytes);
    let mut want = [0u8; 32];
    read_exact(r, &mut want, "the file ends before its checksum")?;
    let mut extra = [0u8; 1];
    if r.read(&mut extra)? != 0 {
        return Err(PersistError::Damaged(
            "bytes after the checksum (the file is longer than its header says)".into(),
        ));
    }
    let got: [u8; 32] = sha.finalize().into();
    if got != want {
        return Err(PersistError::Damaged("the checksum does not match".into()));
    }
    let ids = words(&bytes[..4 * n], u32::from_le_bytes);
    let pos = words(&bytes[4 * n..8 * n], u32::from_le_bytes);
    let vocab = config.vocab_size as u32;
    if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
        return Err(PersistError::Shape(format!(
            "token id {bad} is outside the vocabulary ({vocab})"
        )));
    }
    if pos.windows(2).any(|w| w[1] <= w[0]) {
        return Err(PersistError::Shape("positions that do not increase".into()));
    }
    if let Some(&last) = pos.last() {
        if last as usize >= config.max_position_embeddings {
            return Err(PersistError::Shape(format!(
                "position {last} is past the model's context ({})",
                config.max_position_embeddings
            )));
        }
    }
    let mut cache =
        KvCache::with_type(config, capacity, ty).map_err(|e| PersistError::Shape(e.to_string()))?;
    cache.append_positions(&pos);
    let mut at = 8 * n;
    for layer in 0..layers {
        for which in cache.array_kinds() {
            cache.push_stored(layer, which, &bytes[at..at + row_bytes]);
            at += row_bytes;
        }
    }
    Ok((
        Session::restored(Arc::clone(model), cache, ids),
        header.meta,
    ))
}

/// `b` read as 4-byte little-endian words (`from`).
fn words<T>(b: &[u8], from: impl Fn([u8; 4]) -> T) -> Vec<T> {
    b.chunks_exact(4)
        .map(|c| from([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn read_exact(r: &mut impl Read, buf: &mut [u8], short: &str) -> Result<(), PersistError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => PersistError::Damaged(short.into()),
        _ => PersistError::Io(e),
    })
}

/// [`read_session`] of the file at `path`, refused before reading when it is larger
/// than `max_bytes`.
///
/// # Errors
/// As [`read_session`].
pub fn load_session<M: DeserializeOwned>(
    path: &Path,
    model: &Arc<Model>,
    identity: &ModelIdentity,
    capacity: usize,
    max_bytes: u64,
) -> Result<(Session, M), PersistError> {
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    if len > max_bytes {
        return Err(PersistError::Shape(format!(
            "{len} bytes, above the {max_bytes} allowed"
        )));
    }
    let mut r = std::io::BufReader::with_capacity(1 << 20, file);
    read_checked(&mut r, model, identity, capacity, max_bytes, Some(len))
}
