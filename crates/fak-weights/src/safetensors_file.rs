//! safetensors reader over a memory map, with exact widening of BF16/F16 to f32.
//!
//! Format: HuggingFace safetensors (an 8-byte little-endian header length, a JSON
//! header of `name -> {dtype, shape, data_offsets}`, then the data), parsed and
//! validated by HF's `safetensors` crate. The header metadata is kept by value, so
//! no self-referencing borrow of the map is needed.

use safetensors::tensor::{Metadata, TensorInfo as StInfo};
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

/// Everything that can go wrong opening or reading a safetensors file.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    /// The file could not be opened or mapped.
    #[error("cannot read safetensors file {}: {source}", path.display())]
    Io {
        /// The path given to [`SafetensorsFile::open`].
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The header is malformed or inconsistent with the data (reported by the
    /// `safetensors` crate).
    #[error("invalid safetensors file {}: {source}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// The crate's error.
        source: safetensors::SafeTensorError,
    },
    /// No tensor of that name.
    #[error("tensor '{0}' not found")]
    NotFound(String),
    /// The tensor's dtype cannot be converted to f32 by this crate.
    #[error("tensor '{tensor}' has dtype {dtype}; only F32, BF16 and F16 convert to f32")]
    UnsupportedDtype {
        /// The tensor name.
        tensor: String,
        /// Its dtype.
        dtype: Dtype,
    },
}

enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// An opened, validated safetensors file.
pub struct SafetensorsFile {
    backing: Backing,
    path: PathBuf,
    /// Absolute offset of the data section (8 + header length).
    data_start: usize,
    metadata: Metadata,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("n_tensors", &self.metadata.tensors().len())
            .finish()
    }
}

impl SafetensorsFile {
    /// Memory-map and validate the file at `path` (header JSON, dtype/shape/offset
    /// consistency, data exactly covering the rest of the file).
    ///
    /// # Errors
    /// [`SafetensorsError::Io`] or [`SafetensorsError::Format`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, SafetensorsError> {
        let path = path.as_ref();
        let io = |source| SafetensorsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let backing = if len == 0 {
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: read-only map owned by `self`; only unsound if another process
            // truncates or rewrites the file while it is mapped (checkpoints are
            // treated as immutable while open, as HF's loaders also assume). All
            // accesses are bounds-checked slices.
            Backing::Mmap(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?)
        };
        Self::from_backing(backing, path.to_path_buf())
    }

    /// Parse a safetensors file held in memory; `label` names it in errors.
    ///
    /// # Errors
    /// [`SafetensorsError::Format`].
    pub fn from_bytes(bytes: Vec<u8>, label: impl Into<PathBuf>) -> Result<Self, SafetensorsError> {
        Self::from_backing(Backing::Owned(bytes), label.into())
    }

    fn from_backing(backing: Backing, path: PathBuf) -> Result<Self, SafetensorsError> {
        let (n, metadata) = SafeTensors::read_metadata(backing.bytes()).map_err(|source| {
            SafetensorsError::Format {
                path: path.clone(),
                source,
            }
        })?;
        Ok(SafetensorsFile {
            backing,
            path,
            data_start: 8 + n,
            metadata,
        })
    }

    fn info(&self, name: &str) -> Result<&StInfo, SafetensorsError> {
        self.metadata
            .info(name)
            .ok_or_else(|| SafetensorsError::NotFound(name.to_string()))
    }

    /// Tensor names in data (offset) order.
    pub fn names(&self) -> Vec<String> {
        self.metadata.offset_keys()
    }

    /// The free-form `__metadata__` string map of the header, if any.
    pub fn user_metadata(&self) -> Option<&std::collections::HashMap<String, String>> {
        self.metadata.metadata().as_ref()
    }

    /// Row-major shape of a tensor (torch order).
    ///
    /// # Errors
    /// [`SafetensorsError::NotFound`].
    pub fn shape(&self, name: &str) -> Result<Vec<usize>, SafetensorsError> {
        Ok(self.info(name)?.shape.clone())
    }

    /// Element type of a tensor.
    ///
    /// # Errors
    /// [`SafetensorsError::NotFound`].
    pub fn dtype(&self, name: &str) -> Result<Dtype, SafetensorsError> {
        Ok(self.info(name)?.dtype)
    }

    /// The raw little-endian bytes of a tensor (zero-copy).
    ///
    /// # Errors
    /// [`SafetensorsError::NotFound`].
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], SafetensorsError> {
        let (s, e) = self.info(name)?.data_offsets;
        // Offsets were validated against the file length at open; `get` keeps this
        // panic-free regardless.
        Ok(self
            .backing
            .bytes()
            .get(self.data_start + s..self.data_start + e)
            .unwrap_or(&[]))
    }

    /// The tensor as f32, row-major: F32 copied, BF16 and F16 widened exactly
    /// ([`widen_bf16`], [`widen_f16`]).
    ///
    /// # Errors
    /// [`SafetensorsError::NotFound`]; [`SafetensorsError::UnsupportedDtype`] naming
    /// the tensor and dtype for any other dtype.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, SafetensorsError> {
        let dtype = self.info(name)?.dtype;
        let bytes = self.tensor_bytes(name)?;
        type Widen = fn(&[u8], &mut [f32]) -> usize;
        let (width, widen): (usize, Widen) = match dtype {
            Dtype::F32 => (4, copy_f32),
            Dtype::BF16 => (2, widen_bf16),
            Dtype::F16 => (2, widen_f16),
            dtype => {
                return Err(SafetensorsError::UnsupportedDtype {
                    tensor: name.to_string(),
                    dtype,
                })
            }
        };
        let mut out = vec![0f32; bytes.len() / width];
        widen(bytes, &mut out);
        Ok(out)
    }
}

fn copy_f32(src: &[u8], out: &mut [f32]) -> usize {
    let mut n = 0;
    for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        n += 1;
    }
    n
}

/// Widen little-endian bfloat16 values to f32 exactly: the 16 bits become the top
/// half of the f32, NaN payloads and signalling bits untouched, as torch's
/// `bfloat16.to(float32)` (`c10::BFloat16` widening) and gguf-py do. (`half`'s
/// `bf16::to_f32` sets the quiet bit of a signalling NaN, so it is not used here.)
///
/// Converts `min(src.len() / 2, out.len())` elements and returns that count; a
/// trailing odd byte is ignored.
pub fn widen_bf16(src: &[u8], out: &mut [f32]) -> usize {
    let mut n = 0;
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
        n += 1;
    }
    n
}

/// Widen little-endian IEEE binary16 values to f32 exactly with `half` (normals,
/// subnormals and infinities exact; NaNs quieted with payload kept, as torch and
/// x86 F16C do).
///
/// Converts `min(src.len() / 2, out.len())` elements and returns that count; a
/// trailing odd byte is ignored.
pub fn widen_f16(src: &[u8], out: &mut [f32]) -> usize {
    let mut n = 0;
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        n += 1;
    }
    n
}
