//! GGUF reader over a memory map (or an owned buffer).
//!
//! Format: the GGUF specification (`ggml/docs/gguf.md` in ggml-org/ggml), versions 2
//! and 3, little-endian. Layout: magic `"GGUF"`, `u32` version, `u64` tensor count,
//! `u64` metadata count, the metadata key/value pairs, the tensor infos, padding to
//! `general.alignment` (default 32), then the tensor data section. Version 1 (with
//! `u32` counts) and big-endian files are rejected.
//!
//! Every count and length read from the file is checked against the bytes left
//! before anything is allocated for it, so a hostile header errors quickly. Parsed
//! metadata takes more memory than its encoding (each array element becomes a 32-byte
//! [`MetaValue`], even a one-byte `u8`), so the array elements of a whole file are also
//! capped at [`MAX_METADATA_ARRAY_ELEMENTS`]: a 90-million-element `u8` array is refused
//! instead of costing 2.9 GB.

use crate::dequant::{dequantize, DequantError};
use crate::ggml_type::GgmlType;
use fak_tensor::F16;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The four magic bytes at the start of every GGUF file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and tensor offsets when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a ggml tensor can have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of metadata arrays accepted (the spec allows nesting; no known
/// writer goes past 1).
pub const MAX_ARRAY_DEPTH: usize = 16;
/// The metadata key holding the alignment (`u32`).
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Most metadata array elements accepted across the whole file, nested arrays
/// included: 16 Mi (16,777,216). Each element is held as a 32-byte [`MetaValue`]
/// (plus its bytes, for strings), so this bounds parsed arrays to about 512 MiB
/// whatever the file says. Real models stay far below it: the largest vocabularies
/// (Gemma 3's 262,144 tokens with their scores and types, or a BPE vocabulary with its
/// merges) total under a million. More gives [`GgufError::TooMany`] whose `what`
/// starts with `"metadata array elements"`, before anything is allocated for it.
pub const MAX_METADATA_ARRAY_ELEMENTS: u64 = 16 * 1024 * 1024;
/// The start of [`GgufError::TooMany`]'s `what` when [`MAX_METADATA_ARRAY_ELEMENTS`]
/// is exceeded.
const METADATA_ARRAY_ELEMENTS: &str = "metadata array elements";

/// Everything that can go wrong opening or reading a GGUF file. Each message names
/// the offending metadata key or tensor.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened, sized or mapped.
    #[error("cannot read GGUF file {}: {source}", path.display())]
    Io {
        /// The path given to [`GgufFile::open`].
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The first four bytes are not `"GGUF"`.
    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\"")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// The version is not 2 or 3 (1 used 32-bit counts; a big-endian file reads as a
    /// huge version here).
    #[error("GGUF version {0} is not supported (this reader handles versions 2 and 3)")]
    UnsupportedVersion(u32),
    /// The file ended inside an item.
    #[error("GGUF file truncated in {what}: needs {needed} bytes, {available} left")]
    Truncated {
        /// The item being read, e.g. `metadata key #12 'general.name' value`.
        what: String,
        /// Bytes the item needs.
        needed: u64,
        /// Bytes left in the file.
        available: u64,
    },
    /// A string's length prefix exceeds the bytes left in the file.
    #[error("{what}: string length {len} exceeds the {available} bytes left in the file")]
    StringTooLong {
        /// The string being read.
        what: String,
        /// The length prefix.
        len: u64,
        /// Bytes left after the prefix.
        available: u64,
    },
    /// A count (tensors, metadata pairs, array elements) is larger than the rest of
    /// the file could hold, given the smallest size of one item; or the file's metadata
    /// arrays hold more than [`MAX_METADATA_ARRAY_ELEMENTS`] elements in all (then
    /// `what` starts with `"metadata array elements"` and names the key that crossed
    /// the limit).
    #[error("{what}: count {count} {}", too_many_reason(.what, *.max))]
    TooMany {
        /// What was being counted.
        what: String,
        /// The count read; for the element cap, the file's running total of array
        /// elements including the array that crossed it.
        count: u64,
        /// The most items the remaining bytes could hold, or the cap.
        max: u64,
    },
    /// A key, string value or tensor name is not UTF-8.
    #[error("{what} is not valid UTF-8")]
    InvalidUtf8 {
        /// The string being read.
        what: String,
    },
    /// A metadata value (or array element) type id is not one of the 13 GGUF types.
    #[error("metadata key '{key}': unknown value type id {type_id}")]
    UnknownValueType {
        /// The key.
        key: String,
        /// The type id read.
        type_id: u32,
    },
    /// A bool byte other than 0 or 1 (the spec calls anything else invalid).
    #[error("metadata key '{key}': bool byte is {value}, expected 0 or 1")]
    InvalidBool {
        /// The key.
        key: String,
        /// The byte read.
        value: u8,
    },
    /// Arrays nested deeper than [`MAX_ARRAY_DEPTH`].
    #[error("metadata key '{key}': arrays nested deeper than {max}")]
    NestingTooDeep {
        /// The key.
        key: String,
        /// The limit.
        max: usize,
    },
    /// The same metadata key appears twice.
    #[error("metadata key '{0}' appears more than once")]
    DuplicateKey(String),
    /// `general.alignment` is 0 or not a power of two.
    #[error("general.alignment is {0}; it must be a nonzero power of two")]
    BadAlignment(u32),
    /// A tensor's ggml type id is unknown.
    #[error("tensor '{tensor}': unknown ggml type id {type_id}")]
    UnknownGgmlType {
        /// The tensor name.
        tensor: String,
        /// The type id read.
        type_id: u32,
    },
    /// A tensor info is inconsistent: dimension count not 1..=4, a zero dimension,
    /// element or byte count overflow, row length not a multiple of the block size,
    /// misaligned offset, or data overlapping another tensor's.
    #[error("tensor '{tensor}': {reason}")]
    BadTensor {
        /// The tensor name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The same tensor name appears twice.
    #[error("tensor '{0}' appears more than once")]
    DuplicateTensor(String),
    /// A tensor's data runs past the end of the file.
    #[error(
        "tensor '{tensor}': data at offset {offset} (+{n_bytes} bytes) in the data section \
         starting at byte {data_start} runs past the end of the {file_len}-byte file"
    )]
    DataOutOfBounds {
        /// The tensor name.
        tensor: String,
        /// Offset relative to the data section.
        offset: u64,
        /// Bytes of data the tensor needs.
        n_bytes: u64,
        /// Absolute file offset of the data section.
        data_start: u64,
        /// File length in bytes.
        file_len: u64,
    },
    /// A required metadata key is absent.
    #[error("metadata key '{0}' is missing")]
    MissingKey(String),
    /// A metadata value has a type the caller cannot use.
    #[error("metadata key '{key}' holds {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// What the caller wanted.
        expected: &'static str,
        /// [`MetaValue::type_name`] of what the file holds.
        found: &'static str,
    },
    /// No tensor of that name.
    #[error("tensor '{0}' not found")]
    NotFound(String),
    /// The tensor's type cannot be dequantized (or its data length is inconsistent).
    #[error("tensor '{tensor}': {source}")]
    Dequant {
        /// The tensor name.
        tensor: String,
        /// The dequantization error.
        source: DequantError,
    },
}

/// The end of [`GgufError::TooMany`]'s message: which limit `max` is.
fn too_many_reason(what: &str, max: u64) -> String {
    if what.starts_with(METADATA_ARRAY_ELEMENTS) {
        format!("exceeds the limit of {max} per file")
    } else {
        format!("cannot fit in the rest of the file (at most {max})")
    }
}

/// A GGUF metadata value (spec: `gguf_metadata_value_type` 0..=12).
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7 (one byte, 0 or 1).
    Bool(bool),
    /// Type 8 (`u64` length, UTF-8 bytes, no terminator).
    String(String),
    /// Type 9 (`u32` element type, `u64` count, elements); elements share one type,
    /// arrays may nest.
    Array(Vec<MetaValue>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl MetaValue {
    /// The value as `u64` if it is an integer type holding a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as `i64` if it is an integer type whose value fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as `f32`: F32 as is, F64 rounded to nearest, integers converted
    /// (rounded to nearest when not exactly representable).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            MetaValue::F32(v) => Some(v),
            MetaValue::F64(v) => Some(v as f32),
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v as f32),
            MetaValue::I32(v) => Some(v as f32),
            MetaValue::U64(v) => Some(v as f32),
            MetaValue::I64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// The value as a string slice if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements if the value is an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The value if it is a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The GGUF type name: `"u8"`, `"i8"`, `"u16"`, `"i16"`, `"u32"`, `"i32"`,
    /// `"f32"`, `"bool"`, `"string"`, `"array"`, `"u64"`, `"i64"`, `"f64"`.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::F32(_) => "f32",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F64(_) => "f64",
        }
    }
}

/// One tensor's entry in the GGUF tensor-info table, validated at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name as stored (llama.cpp naming, e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in GGUF (ggml `ne`) order: `dims[0]` is the innermost, contiguous
    /// dimension, i.e. the row length. 1 to 4 entries, each ≥ 1.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Byte offset of the data relative to the start of the data section; a multiple
    /// of the file's alignment.
    pub offset: u64,
    /// Product of `dims`.
    pub n_elements: u64,
    /// Bytes of data: `(dims[0] / block_size * type_size) * dims[1] * ...`.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// The shape in row-major (torch / HF) order: `dims` reversed, so the last entry
    /// is the row length. A `[hidden, vocab]` GGUF embedding gives `[vocab, hidden]`.
    /// Dimensions larger than `usize::MAX` saturate (impossible for a file that
    /// fits in memory).
    pub fn shape_hf(&self) -> Vec<usize> {
        self.dims
            .iter()
            .rev()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
            .collect()
    }
}

enum Backing {
    /// The map, the file it maps (for [`GgufFile::read_tensor_data`]) and its path.
    Mmap(memmap2::Mmap, std::fs::File, std::path::PathBuf),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m, ..) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// An opened, fully validated GGUF file: metadata parsed into memory, tensor data
/// left in the map and handed out as zero-copy slices.
pub struct GgufFile {
    backing: Backing,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("data_start", &self.data_start)
            .field("file_len", &self.backing.bytes().len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-map and parse the file at `path`.
    ///
    /// # Errors
    /// [`GgufError::Io`] if it cannot be opened or mapped; any parse or validation
    /// error of [`GgufFile::from_bytes`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let backing = if len == 0 {
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and lives as long as `self`. Memory-mapping
            // is only unsound if another process truncates or rewrites the file while
            // it is mapped; model files are treated as immutable while open, the same
            // contract llama.cpp, safetensors and candle rely on. All reads go through
            // bounds-checked slices of the map.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
            Backing::Mmap(map, file, path.to_path_buf())
        };
        Self::from_backing(backing)
    }

    /// Parse a GGUF file held in memory (tests, fuzzing, embedded models).
    ///
    /// # Errors
    /// Any [`GgufError`] except `Io`, `MissingKey`, `WrongType` (other than for
    /// `general.alignment`), `NotFound` and `Dequant`.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::from_backing(Backing::Owned(bytes))
    }

    fn from_backing(backing: Backing) -> Result<Self, GgufError> {
        let p = parse(backing.bytes())?;
        Ok(GgufFile {
            backing,
            version: p.version,
            alignment: p.alignment,
            meta_index: p
                .metadata
                .iter()
                .enumerate()
                .map(|(i, (k, _))| (k.clone(), i))
                .collect(),
            metadata: p.metadata,
            tensor_index: p
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            tensors: p.tensors,
            data_start: p.data_start,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment in bytes of the data section and of every tensor offset
    /// (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute byte offset of the tensor data section in the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// All metadata pairs in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// The value of a metadata key, if present.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn wrong(key: &str, expected: &'static str, v: &MetaValue) -> GgufError {
        GgufError::WrongType {
            key: key.to_string(),
            expected,
            found: v.type_name(),
        }
    }

    /// A non-negative integer value (any integer type; see [`MetaValue::as_u64`]).
    ///
    /// # Errors
    /// `MissingKey(key)`, or `WrongType` naming the key if the value is not a
    /// non-negative integer.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| Self::wrong(key, "a non-negative integer", v))
    }

    /// A float value (f32, f64 or an integer; see [`MetaValue::as_f32`]).
    ///
    /// # Errors
    /// `MissingKey(key)`, or `WrongType` naming the key.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f32().ok_or_else(|| Self::wrong(key, "a number", v))
    }

    /// A string value.
    ///
    /// # Errors
    /// `MissingKey(key)`, or `WrongType` naming the key.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong(key, "string", v))
    }

    /// A bool value.
    ///
    /// # Errors
    /// `MissingKey(key)`, or `WrongType` naming the key.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| Self::wrong(key, "bool", v))
    }

    /// An array value.
    ///
    /// # Errors
    /// `MissingKey(key)`, or `WrongType` naming the key.
    pub fn get_array(&self, key: &str) -> Result<&[MetaValue], GgufError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| Self::wrong(key, "array", v))
    }

    /// `general.architecture` (e.g. `"llama"`, `"gemma3"`).
    ///
    /// # Errors
    /// `MissingKey` / `WrongType` naming `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor info of that name, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor's data (zero-copy; `t.n_bytes` long). Bounds were
    /// validated at open for this file's own infos; for a `TensorInfo` that does not
    /// come from this file and lies outside it, an empty slice is returned.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let bytes = self.backing.bytes();
        let range = self
            .data_start
            .checked_add(t.offset)
            .and_then(|s| Some((s, s.checked_add(t.n_bytes)?)))
            .and_then(|(s, e)| Some(usize::try_from(s).ok()?..usize::try_from(e).ok()?));
        range.and_then(|r| bytes.get(r)).unwrap_or(&[])
    }

    /// Drops the process's mappings of `t`'s data pages (`MADV_DONTNEED` on a mapped
    /// file; nothing for a file held in memory): for a tensor whose data a caller read
    /// with [`GgufFile::read_tensor_data`] and keeps its own copy of, the pages the
    /// kernel mapped anyway (fault-around when a neighbouring small tensor was read
    /// through the map) leave the resident set. A later read through the map sees the
    /// same bytes (the file's, faulted in again). Errors of `madvise` are ignored: the
    /// pages then stay mapped, which costs memory, never correctness.
    pub fn release_mapped_pages(&self, t: &TensorInfo) {
        let data = self.tensor_data(t);
        let off = data.as_ptr() as usize - self.bytes().as_ptr() as usize;
        self.release_range(off, data.len());
    }

    /// Drops the process's mappings of the header's pages (the metadata and the tensor
    /// infos, parsed into owned values at [`open`](Self::open)), as
    /// [`release_mapped_pages`](Self::release_mapped_pages) drops a tensor's: for a
    /// caller done reading the header through [`bytes`](Self::bytes) (a tokenizer's
    /// vocabulary is most of it: ~1.7 MB of SmolLM2's file).
    pub fn release_header_pages(&self) {
        let end = usize::try_from(self.data_start).unwrap_or(usize::MAX);
        self.release_range(0, end.min(self.bytes().len()));
    }

    /// `MADV_DONTNEED` on bytes `off..off + len` of a mapped file (widened to page
    /// bounds by the kernel); nothing for a file held in memory or an empty range.
    fn release_range(&self, off: usize, len: usize) {
        #[cfg(unix)]
        if let Backing::Mmap(map, ..) = &self.backing {
            if len == 0 || off.checked_add(len).is_none_or(|e| e > map.len()) {
                return;
            }
            // SAFETY: the map is a read-only shared mapping of a file that is treated as
            // immutable while open (`open`'s contract): `MADV_DONTNEED` only removes the
            // page-table entries, and any later read of these bytes, through a borrow
            // that outlives this call or a new one, faults the file's same bytes back
            // in. No byte any borrow can observe changes. The range is inside the map
            // (checked above; `madvise` widens it to page bounds, which only unmaps
            // neighbouring pages the same way).
            let _ =
                unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, off, len) };
        }
        #[cfg(not(unix))]
        let _ = (off, len);
    }

    /// Copies bytes `at..at + buf.len()` of `t`'s data into `buf`, read from the file
    /// (positional reads) rather than through the memory map when the file is mapped, so
    /// the pages read do not join the process's resident set (a caller that keeps its
    /// own copy, e.g. a repacked one, then holds the data once); from memory otherwise.
    ///
    /// # Errors
    /// [`GgufError::Io`] when the range is outside the tensor's data or the read fails.
    pub fn read_tensor_data(
        &self,
        t: &TensorInfo,
        at: usize,
        buf: &mut [u8],
    ) -> Result<(), GgufError> {
        let data = self.tensor_data(t);
        let outside = || GgufError::Io {
            path: std::path::PathBuf::new(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "bytes {at}..+{} of tensor '{}' ({} bytes)",
                    buf.len(),
                    t.name,
                    data.len()
                ),
            ),
        };
        let src = at
            .checked_add(buf.len())
            .and_then(|end| data.get(at..end))
            .ok_or_else(outside)?;
        #[cfg(unix)]
        if let Backing::Mmap(_, file, path) = &self.backing {
            use std::os::unix::fs::FileExt;
            // The data's offset in the file: its address in the map (which starts at
            // the file's first byte) less the map's.
            let off = src.as_ptr() as usize - self.backing.bytes().as_ptr() as usize;
            return file
                .read_exact_at(buf, off as u64)
                .map_err(|source| GgufError::Io {
                    path: path.clone(),
                    source,
                });
        }
        buf.copy_from_slice(src);
        Ok(())
    }

    /// An F32 tensor's data read in place as `&[f32]` (zero-copy): `n_elements` values,
    /// row-major in [`TensorInfo::shape_hf`] order, the same values
    /// [`dequantize_tensor`](Self::dequantize_tensor) would copy out.
    ///
    /// `None`, and the caller copies with `dequantize_tensor` instead, when the tensor is
    /// not F32; when its data is not `4 × n_elements` bytes of this file (a `TensorInfo`
    /// from another file); when the data's address is not a multiple of 4 (possible when
    /// `general.alignment` is 1 or 2, or for bytes given to
    /// [`from_bytes`](Self::from_bytes)); or on a big-endian host (GGUF data is
    /// little-endian; `dequantize_tensor` converts it). The alignment and the length are
    /// checked here, on every call, by `bytemuck::try_cast_slice`, so no file can make
    /// this read out of bounds or unaligned. A memory-mapped file's pages are shared
    /// with the page cache and mapped read-only (see [`open`](Self::open)); the slice
    /// borrows `self`, so the map outlives it.
    pub fn tensor_f32_in_place(&self, t: &TensorInfo) -> Option<&[f32]> {
        if t.ggml_type != GgmlType::F32 || !cfg!(target_endian = "little") {
            return None;
        }
        let data = self.tensor_data(t);
        if t.n_elements.checked_mul(4) != Some(data.len() as u64) {
            return None;
        }
        bytemuck::try_cast_slice(data).ok()
    }

    /// An F16 tensor's data read in place as binary16 values (zero-copy), as
    /// [`tensor_f32_in_place`](Self::tensor_f32_in_place) reads an F32 tensor: `None`
    /// when the tensor is not F16, its data is not `2 × n_elements` bytes of this file,
    /// its address is odd, or the host is big-endian. Widening each value with
    /// `fak_tensor::quant::f16_to_f32` gives what
    /// [`dequantize_tensor`](Self::dequantize_tensor) copies out.
    pub fn tensor_f16_in_place(&self, t: &TensorInfo) -> Option<&[F16]> {
        if t.ggml_type != GgmlType::F16 || !cfg!(target_endian = "little") {
            return None;
        }
        let data = self.tensor_data(t);
        if t.n_elements.checked_mul(2) != Some(data.len() as u64) {
            return None;
        }
        bytemuck::try_cast_slice::<u8, u16>(data)
            .ok()
            .map(F16::from_bits_slice)
    }

    /// The tensor dequantized to f32, `n_elements` long, row-major in
    /// [`TensorInfo::shape_hf`] order.
    ///
    /// # Errors
    /// `NotFound(name)`; `Dequant { tensor, .. }` if its type has no dequantizer.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let t = self
            .tensor(name)
            .ok_or_else(|| GgufError::NotFound(name.to_string()))?;
        self.dequantize_tensor(t)
    }

    /// Like [`tensor_f32`](Self::tensor_f32) for an info already in hand.
    ///
    /// # Errors
    /// `Dequant { tensor, .. }` if the type has no dequantizer or the info's sizes do
    /// not match its data.
    pub fn dequantize_tensor(&self, t: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        let derr = |source| GgufError::Dequant {
            tensor: t.name.clone(),
            source,
        };
        // Check support before allocating the output.
        dequantize(t.ggml_type, &[], &mut []).map_err(derr)?;
        let data = self.tensor_data(t);
        let n = usize::try_from(t.n_elements).unwrap_or(usize::MAX);
        if t.ggml_type.row_bytes(t.n_elements) != Some(data.len() as u64) {
            return Err(derr(DequantError::LengthMismatch {
                ty: t.ggml_type,
                n_elements: n,
                expected: t
                    .ggml_type
                    .row_bytes(t.n_elements)
                    .and_then(|b| usize::try_from(b).ok())
                    .unwrap_or(usize::MAX),
                got: data.len(),
            }));
        }
        // A mapped file's bytes are read with positional reads, not through the map: its
        // pages then never join the process's resident set (the caller keeps the f32
        // copy; a norm vector read through the map would bring 64 KB of the matrices
        // around it with it).
        // A read that fails falls back to the map (as a matrix whose copy fails does).
        let mut read = Vec::new();
        let data = if cfg!(unix) && matches!(self.backing, Backing::Mmap(..)) {
            read.resize(data.len(), 0u8);
            match self.read_tensor_data(t, 0, &mut read) {
                Ok(()) => &read[..],
                Err(_) => data,
            }
        } else {
            data
        };
        let mut out = vec![0f32; n];
        dequantize(t.ggml_type, data, &mut out).map_err(derr)?;
        Ok(out)
    }
}

// ---------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------

struct Parsed {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<TensorInfo>,
    data_start: u64,
}

/// A cursor over the file bytes; every read is bounds-checked.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: usize, what: impl FnOnce() -> String) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                what: what(),
                needed: n as u64,
                available: self.remaining(),
            }),
        }
    }

    fn array<const N: usize>(
        &mut self,
        what: impl FnOnce() -> String,
    ) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A GGUF string: `u64` length then that many UTF-8 bytes.
    fn string(&mut self, what: impl Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(|| format!("{} length", what()))?;
        if len > self.remaining() {
            return Err(GgufError::StringTooLong {
                what: what(),
                len,
                available: self.remaining(),
            });
        }
        // len <= remaining <= usize::MAX.
        let bytes = self.take(len as usize, &what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => Err(GgufError::InvalidUtf8 { what: what() }),
        }
    }

    /// Check that `count` items of at least `min_size` bytes each fit in the rest of
    /// the file, so that `Vec::with_capacity(count)` is bounded by the file length.
    fn check_count(
        &self,
        count: u64,
        min_size: u64,
        what: impl FnOnce() -> String,
    ) -> Result<usize, GgufError> {
        let max = self.remaining() / min_size.max(1);
        if count > max {
            return Err(GgufError::TooMany {
                what: what(),
                count,
                max,
            });
        }
        // count <= remaining <= usize::MAX.
        Ok(count as usize)
    }
}

/// Smallest encoded size in bytes of a value of GGUF type `ty` (known types only).
fn min_value_size(ty: u32) -> u64 {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,       // u64 length
        9 => 4 + 8,   // element type + count
        10..=12 => 8, // u64 / i64 / f64
        _ => 1,
    }
}

/// Read one value of type `ty`. `elements` is the number of metadata array elements
/// read so far in the file; arrays add to it and are refused past
/// [`MAX_METADATA_ARRAY_ELEMENTS`].
fn read_value(
    r: &mut Reader<'_>,
    ty: u32,
    key: &str,
    ctx: &dyn Fn() -> String,
    depth: usize,
    elements: &mut u64,
) -> Result<MetaValue, GgufError> {
    Ok(match ty {
        0 => MetaValue::U8(r.array::<1>(ctx)?[0]),
        1 => MetaValue::I8(r.array::<1>(ctx)?[0] as i8),
        2 => MetaValue::U16(u16::from_le_bytes(r.array(ctx)?)),
        3 => MetaValue::I16(i16::from_le_bytes(r.array(ctx)?)),
        4 => MetaValue::U32(u32::from_le_bytes(r.array(ctx)?)),
        5 => MetaValue::I32(i32::from_le_bytes(r.array(ctx)?)),
        6 => MetaValue::F32(f32::from_le_bytes(r.array(ctx)?)),
        7 => match r.array::<1>(ctx)?[0] {
            0 => MetaValue::Bool(false),
            1 => MetaValue::Bool(true),
            value => {
                return Err(GgufError::InvalidBool {
                    key: key.to_string(),
                    value,
                })
            }
        },
        8 => MetaValue::String(r.string(ctx)?),
        9 => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(GgufError::NestingTooDeep {
                    key: key.to_string(),
                    max: MAX_ARRAY_DEPTH,
                });
            }
            let elem_ty = r.u32(|| format!("{} array element type", ctx()))?;
            if elem_ty > 12 {
                return Err(GgufError::UnknownValueType {
                    key: key.to_string(),
                    type_id: elem_ty,
                });
            }
            let count = r.u64(|| format!("{} array length", ctx()))?;
            let n = r.check_count(count, min_value_size(elem_ty), || {
                format!("{} array length", ctx())
            })?;
            // n <= bytes left, so the sum cannot overflow.
            let total = *elements + n as u64;
            if total > MAX_METADATA_ARRAY_ELEMENTS {
                return Err(GgufError::TooMany {
                    what: format!("{METADATA_ARRAY_ELEMENTS} (through {} array)", ctx()),
                    count: total,
                    max: MAX_METADATA_ARRAY_ELEMENTS,
                });
            }
            *elements = total;
            let mut items = Vec::with_capacity(n);
            for i in 0..n {
                let elem_ctx = || format!("{} element #{i}", ctx());
                items.push(read_value(r, elem_ty, key, &elem_ctx, depth + 1, elements)?);
            }
            MetaValue::Array(items)
        }
        10 => MetaValue::U64(u64::from_le_bytes(r.array(ctx)?)),
        11 => MetaValue::I64(i64::from_le_bytes(r.array(ctx)?)),
        12 => MetaValue::F64(f64::from_le_bytes(r.array(ctx)?)),
        type_id => {
            return Err(GgufError::UnknownValueType {
                key: key.to_string(),
                type_id,
            })
        }
    })
}

fn bad(tensor: &str, reason: String) -> GgufError {
    GgufError::BadTensor {
        tensor: tensor.to_string(),
        reason,
    }
}

/// Read and validate one tensor info (all but the file-bounds and overlap checks).
fn read_tensor_info(r: &mut Reader<'_>, i: u64, alignment: u64) -> Result<TensorInfo, GgufError> {
    let name = r.string(|| format!("tensor #{i} name"))?;
    let ctx = |field: &str| format!("tensor #{i} '{name}' {field}");
    let n_dims = r.u32(|| ctx("dimension count"))?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return Err(bad(
            &name,
            format!("has {n_dims} dimensions; ggml allows 1 to {MAX_DIMS}"),
        ));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        dims.push(r.u64(|| ctx(&format!("dimension #{d}")))?);
    }
    let type_id = r.u32(|| ctx("type"))?;
    let offset = r.u64(|| ctx("offset"))?;
    let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownGgmlType {
        tensor: name.clone(),
        type_id,
    })?;
    if let Some(d) = dims.iter().position(|&d| d == 0) {
        return Err(bad(&name, format!("dimension #{d} is 0 (dims {dims:?})")));
    }
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            bad(
                &name,
                format!("element count of dims {dims:?} overflows u64"),
            )
        })?;
    let bs = ggml_type.block_size() as u64;
    if !dims[0].is_multiple_of(bs) {
        return Err(bad(
            &name,
            format!(
                "row length {} is not a multiple of the {ggml_type} block size {bs}",
                dims[0]
            ),
        ));
    }
    let n_bytes = ggml_type
        .row_bytes(dims[0])
        .and_then(|row| dims[1..].iter().try_fold(row, |acc, &d| acc.checked_mul(d)))
        .ok_or_else(|| bad(&name, format!("byte size of dims {dims:?} overflows u64")))?;
    if !offset.is_multiple_of(alignment) {
        return Err(bad(
            &name,
            format!("data offset {offset} is not a multiple of the alignment {alignment}"),
        ));
    }
    Ok(TensorInfo {
        name,
        dims,
        ggml_type,
        offset,
        n_elements,
        n_bytes,
    })
}

fn parse(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut r = Reader { buf, pos: 0 };
    let magic: [u8; 4] = r.array(|| "magic".to_string())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = r.u32(|| "version".to_string())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let tensor_count = r.u64(|| "tensor count".to_string())?;
    let kv_count = r.u64(|| "metadata count".to_string())?;

    // Each pair needs at least a key length (8), a value type (4) and 1 value byte.
    let n_kv = r.check_count(kv_count, 8 + 4 + 1, || "metadata count".to_string())?;
    let mut metadata: Vec<(String, MetaValue)> = Vec::with_capacity(n_kv);
    let mut seen: HashSet<String> = HashSet::with_capacity(n_kv);
    let mut array_elements = 0u64;
    for i in 0..n_kv {
        let key = r.string(|| format!("metadata key #{i}"))?;
        let ty = r.u32(|| format!("metadata key #{i} '{key}' value type"))?;
        let ctx = || format!("metadata key #{i} '{key}' value");
        let value = read_value(&mut r, ty, &key, &ctx, 0, &mut array_elements)?;
        if !seen.insert(key.clone()) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some((_, MetaValue::U32(a))) => {
            if *a == 0 || !a.is_power_of_two() {
                return Err(GgufError::BadAlignment(*a));
            }
            u64::from(*a)
        }
        Some((_, v)) => {
            return Err(GgufError::WrongType {
                key: ALIGNMENT_KEY.to_string(),
                expected: "u32",
                found: v.type_name(),
            })
        }
    };

    // A tensor info is at least: name length 8, n_dims 4, one dim 8, type 4, offset 8.
    let n_tensors = r.check_count(tensor_count, 8 + 4 + 8 + 4 + 8, || {
        "tensor count".to_string()
    })?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors);
    let mut names: HashSet<String> = HashSet::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let t = read_tensor_info(&mut r, i as u64, alignment)?;
        if !names.insert(t.name.clone()) {
            return Err(GgufError::DuplicateTensor(t.name));
        }
        tensors.push(t);
    }

    // The data section starts at the next multiple of the alignment.
    let file_len = buf.len() as u64;
    let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
    for t in &tensors {
        let end = data_start
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.n_bytes));
        if end.is_none_or(|e| e > file_len) {
            return Err(GgufError::DataOutOfBounds {
                tensor: t.name.clone(),
                offset: t.offset,
                n_bytes: t.n_bytes,
                data_start,
                file_len,
            });
        }
    }
    // No two tensors may share bytes.
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        let (a, b) = (w[0], w[1]);
        // In bounds above, so no overflow.
        if a.offset + a.n_bytes > b.offset {
            return Err(bad(
                &b.name,
                format!(
                    "data [{}, {}) overlaps tensor '{}' at [{}, {})",
                    b.offset,
                    b.offset + b.n_bytes,
                    a.name,
                    a.offset,
                    a.offset + a.n_bytes
                ),
            ));
        }
    }

    Ok(Parsed {
        version,
        alignment,
        metadata,
        tensors,
        data_start,
    })
}
