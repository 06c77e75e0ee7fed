//! Where weights come from: a GGUF file or a folder of safetensors, both addressed by
//! HF tensor names (`model.layers.0.self_attn.q_proj.weight`) and both yielding `f32`
//! ([`WeightSource::load`], a copy). For the native path a GGUF's matrices can stay in
//! the file's type instead: [`QuantMatrix`] for the block formats with a quantized
//! kernel, [`Mapped`] for F32 and F16 (F16 widened by the kernels as they load it). Both
//! start as views of the file's memory map; the loader copies each once, with
//! positional reads, into the source's [`WeightArena`] (huge pages:
//! [`QuantMatrix::repacked_for_cpu`], [`Mapped::copied_for_cpu`]), and a matrix whose
//! copy cannot be made is read from the map, with the same bits. BF16 matrices need
//! widening and safetensors are not read this way: those are always copied to `f32`.

use crate::arena::{ArenaBytes, WeightArena};
use crate::{family, Config, ModelError};
use fak_tensor::quant::QType;
use fak_tensor::{WeightElem, F16};
use fak_weights::{GgmlType, GgufFile, SafetensorsFile};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One tensor of a checkpoint as HF names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// HF name, e.g. `model.layers.0.mlp.up_proj.weight`.
    pub name: String,
    /// Row-major shape, as torch reports it.
    pub shape: Vec<usize>,
    /// Storage type in the file (`Q4_1`, `F32`, `BF16`, ...).
    pub dtype: String,
    /// Name in the file when it differs from `name` (GGUF's `blk.0.ffn_up.weight`).
    pub file_name: String,
}

/// A GGUF tensor found by name: its file, its index in `file.tensors()` and the arena
/// its copy goes to.
type GgufTensor<'a> = (&'a Arc<GgufFile>, usize, &'a Arc<WeightArena>);

/// Rearranges `rows` rows of `cols` columns of one block layout into another, from the
/// source bytes into the destination (a [`fak_tensor::quant`] repacking).
type Repack = fn(&[u8], usize, usize, &mut [u8]) -> Result<(), fak_tensor::quant::QuantError>;

/// An opened checkpoint: its config and a way to read each tensor as `f32`.
pub enum WeightSource {
    /// A GGUF file (memory-mapped).
    Gguf {
        /// The parsed file (shared with the native matrices made from it, which read its
        /// map when their copy at load cannot be made).
        file: Arc<GgufFile>,
        /// HF name -> index into `file.tensors()`.
        by_hf: HashMap<String, usize>,
        /// Where the native path's matrices are copied at load (huge pages).
        arena: Arc<WeightArena>,
    },
    /// One or more safetensors files (memory-mapped) with their `config.json`.
    Safetensors {
        /// The files, in name order.
        files: Vec<SafetensorsFile>,
        /// HF name -> index into `files`.
        by_name: HashMap<String, usize>,
    },
}

impl WeightSource {
    /// Opens `path`: a `.gguf` file, or a folder holding `config.json` and one or more
    /// `*.safetensors` files. Returns the source and the config it implies.
    ///
    /// # Errors
    /// [`ModelError::UnknownFormat`] if `path` is neither; the reader's and the config's
    /// errors otherwise (a GGUF tensor whose name fak cannot map is
    /// [`ModelError::Unsupported`]).
    pub fn open(path: &Path) -> Result<(Self, Config), ModelError> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if meta.is_dir() {
            if !path.join("config.json").exists() {
                // Not a safetensors model folder: say so, naming any GGUF file inside
                // (the file itself is what to give).
                let mut ggufs: Vec<String> = std::fs::read_dir(path)
                    .map_err(io)?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
                    .map(|p| p.display().to_string())
                    .collect();
                ggufs.sort();
                if ggufs.is_empty() {
                    return Err(ModelError::UnknownFormat(path.to_path_buf()));
                }
                return Err(ModelError::InvalidInput(format!(
                    "{}: a folder without config.json; give the GGUF file itself: {}",
                    path.display(),
                    ggufs.join(", ")
                )));
            }
            let cfg = Config::from_hf_json(&path.join("config.json"))?;
            let mut paths: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(io)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            paths.sort();
            if paths.is_empty() {
                return Err(ModelError::UnknownFormat(path.to_path_buf()));
            }
            let mut files = Vec::new();
            let mut by_name: HashMap<String, usize> = HashMap::new();
            for (i, p) in paths.iter().enumerate() {
                if !p.is_file() {
                    return Err(ModelError::UnknownFormat(p.clone()));
                }
                let f = SafetensorsFile::open(p)?;
                for n in f.names() {
                    if let Some(&j) = by_name.get(&n) {
                        return Err(ModelError::Unsupported(format!(
                            "tensor '{n}' appears in both {} and {}",
                            paths[j].display(),
                            p.display()
                        )));
                    }
                    by_name.insert(n, i);
                }
                files.push(f);
            }
            return Ok((WeightSource::Safetensors { files, by_name }, cfg));
        }
        if !meta.is_file() {
            return Err(ModelError::UnknownFormat(path.to_path_buf()));
        }
        if path.extension().is_some_and(|x| x == "safetensors") {
            return Err(ModelError::InvalidInput(format!(
                "{}: give the folder that holds config.json and the .safetensors files, not one file",
                path.display()
            )));
        }
        let file = Arc::new(GgufFile::open(path)?);
        let cfg = Config::from_gguf(&file, path)?;
        let mut by_hf = HashMap::new();
        for (i, t) in file.tensors().iter().enumerate() {
            if cfg.family.spec().gguf_config_tensor(&t.name) {
                continue;
            }
            let hf = family::gguf_to_hf_name(cfg.family, &t.name).ok_or_else(|| {
                ModelError::Unsupported(format!(
                    "GGUF tensor '{}' has no known HF name for architecture '{}'",
                    t.name,
                    cfg.family.name()
                ))
            })?;
            by_hf.insert(hf, i);
        }
        Ok((
            WeightSource::Gguf {
                arena: Arc::new(WeightArena::with_capacity(file.bytes().len())),
                file,
                by_hf,
            },
            cfg,
        ))
    }

    /// Every tensor, by HF name, sorted by name.
    pub fn entries(&self) -> Vec<TensorEntry> {
        let mut v: Vec<TensorEntry> = match self {
            WeightSource::Gguf { file, by_hf, .. } => by_hf
                .iter()
                .map(|(hf, &i)| {
                    let t = &file.tensors()[i];
                    TensorEntry {
                        name: hf.clone(),
                        shape: t.shape_hf(),
                        dtype: t.ggml_type.name().to_string(),
                        file_name: t.name.clone(),
                    }
                })
                .collect(),
            WeightSource::Safetensors { files, by_name } => by_name
                .iter()
                .map(|(n, &i)| TensorEntry {
                    name: n.clone(),
                    shape: files[i].shape(n).unwrap_or_default(),
                    dtype: files[i]
                        .dtype(n)
                        .map(|d| format!("{d:?}"))
                        .unwrap_or_default(),
                    file_name: n.clone(),
                })
                .collect(),
        };
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Whether a tensor of this HF name exists.
    pub fn contains(&self, name: &str) -> bool {
        match self {
            WeightSource::Gguf { by_hf, .. } => by_hf.contains_key(name),
            WeightSource::Safetensors { by_name, .. } => by_name.contains_key(name),
        }
    }

    /// Returns memory only loading needed, called once the model is loaded: what the
    /// copies made at load did not use of their last huge page ([`WeightArena::trim`])
    /// and a GGUF file's header pages ([`GgufFile::release_header_pages`]; its
    /// metadata was parsed at open). Nothing is lost: a later read through the map
    /// faults the same bytes back in.
    pub fn release_load_pages(&self) {
        if let WeightSource::Gguf { arena, file, .. } = self {
            arena.trim();
            file.release_header_pages();
        }
    }

    /// A GGUF file's tensor `name` (the file, the tensor's index and the arena its
    /// copies go to) after checking its shape is `expected`; `None` for safetensors.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`].
    fn gguf_tensor(
        &self,
        name: &str,
        expected: [usize; 2],
    ) -> Result<Option<GgufTensor<'_>>, ModelError> {
        let WeightSource::Gguf { file, by_hf, arena } = self else {
            return Ok(None);
        };
        let i = *by_hf
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let found = file.tensors()[i].shape_hf();
        if found != expected {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                found,
            });
        }
        Ok(Some((file, i, arena)))
    }

    /// Tensor `name` as a matrix kept in its GGUF block format, when the file stores it
    /// in a type with a quantized dot product (`fak_tensor::quant::QType`) and a `llama`
    /// Q/K row permutation (if any) can be undone ([`QuantMatrix::row_order`]); `None` for every
    /// other type (F32 and F16, which [`Self::mapped`] gives; BF16, other block types)
    /// and for safetensors, which then stay on the `f32` path. The matrix is a view of
    /// the file's memory map until [`QuantMatrix::repacked_for_cpu`] or
    /// [`QuantMatrix::copied_for_cpu`] copies it.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] and [`ModelError::ShapeMismatch`] as [`Self::load`];
    /// [`ModelError::Unsupported`] when a permuted matrix does not split into heads.
    pub fn quantized(
        &self,
        name: &str,
        expected: [usize; 2],
        cfg: &Config,
    ) -> Result<Option<QuantMatrix>, ModelError> {
        let Some((file, i, arena)) = self.gguf_tensor(name, expected)? else {
            return Ok(None);
        };
        let t = &file.tensors()[i];
        let ty = match t.ggml_type {
            GgmlType::Q4_0 => QType::Q4_0,
            GgmlType::Q4_1 => QType::Q4_1,
            GgmlType::Q5_0 => QType::Q5_0,
            GgmlType::Q5_1 => QType::Q5_1,
            GgmlType::Q8_0 => QType::Q8_0,
            GgmlType::Q4_K => QType::Q4K,
            GgmlType::Q5_K => QType::Q5K,
            GgmlType::Q6_K => QType::Q6K,
            _ => return Ok(None),
        };
        let [rows, cols] = expected;
        if cols == 0 || !cols.is_multiple_of(ty.block_elems()) {
            return Ok(None);
        }
        let row_order = qk_row_order(name, rows, cfg)?;
        Ok(Some(QuantMatrix {
            file: Arc::clone(file),
            tensor: i,
            first_row: 0,
            ty,
            rows,
            cols,
            row_order,
            arena: Arc::clone(arena),
            copy: None,
        }))
    }

    /// Tensor `name` as an F32 or F16 matrix kept in the file's type (no `f32` copy),
    /// when the file stores it as `W`'s type and its data can be borrowed from the GGUF
    /// file's memory map as `&[W]` ([`MappedElem::in_place`]: aligned, the right length,
    /// a little-endian host): a view of the map until [`Mapped::copied_for_cpu`] copies
    /// it. `None` for every other type (BF16 needs widening, the block types have
    /// [`Self::quantized`]), for data that cannot be borrowed, and for safetensors: the
    /// caller then copies with [`Self::load`], which gives the same values. A `llama`
    /// GGUF's Q/K row permutation is kept as [`Mapped::row_order`]: undone once as
    /// [`Mapped::copied_for_cpu`] copies the rows, else on each product's output.
    ///
    /// Only for the matrices that [`Self::load`] reads unchanged apart from that row
    /// order: the linear layers and the embedding (a Gemma norm, which `load` shifts by
    /// one, must go through `load`).
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] and [`ModelError::ShapeMismatch`] as [`Self::load`];
    /// [`ModelError::Unsupported`] when a permuted matrix does not split into heads.
    pub fn mapped<W: MappedElem>(
        &self,
        name: &str,
        expected: [usize; 2],
        cfg: &Config,
    ) -> Result<Option<Mapped<W>>, ModelError> {
        let Some((file, i, arena)) = self.gguf_tensor(name, expected)? else {
            return Ok(None);
        };
        let t = &file.tensors()[i];
        let [rows, cols] = expected;
        match W::in_place(file, t) {
            Some(w) if Some(w.len()) == rows.checked_mul(cols) => {}
            _ => return Ok(None),
        }
        let row_order = qk_row_order(name, rows, cfg)?;
        Ok(Some(Mapped {
            file: Arc::clone(file),
            tensor: i,
            first_row: 0,
            rows,
            cols,
            row_order,
            arena: Arc::clone(arena),
            copy: None,
            elem: std::marker::PhantomData,
        }))
    }

    /// Reads tensor `name` as row-major `f32` after checking its shape is `expected`.
    /// For a `llama` GGUF the rows of `q_proj` / `k_proj` are un-permuted back to HF's
    /// rotate-half order (llama.cpp's converter permutes them for interleaved RoPE).
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`], reader errors.
    pub fn load(
        &self,
        name: &str,
        expected: &[usize],
        cfg: &Config,
    ) -> Result<Vec<f32>, ModelError> {
        let found = match self {
            WeightSource::Gguf { file, by_hf, .. } => {
                let i = *by_hf
                    .get(name)
                    .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
                file.tensors()[i].shape_hf()
            }
            WeightSource::Safetensors { files, by_name } => {
                let i = *by_name
                    .get(name)
                    .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
                files[i].shape(name)?
            }
        };
        if found != expected {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                found,
            });
        }
        match self {
            WeightSource::Gguf { file, by_hf, .. } => {
                let t = &file.tensors()[by_hf[name]];
                let w = file.tensor_f32(&t.name)?;
                // The family's load-time fix: Gemma's norm gains lose the +1 the file
                // folds in, Llama's Q/K rows go back to rotate-half order.
                cfg.family.spec().fix_gguf_f32(name, w, expected, cfg)
            }
            WeightSource::Safetensors { files, by_name } => {
                Ok(files[by_name[name]].tensor_f32(name)?)
            }
        }
    }
}

/// A `[rows, cols]` matrix kept in its GGUF block format (the fast path's resident
/// weights: no `f32` copy): a view of the file's memory map until copied at load into
/// the source's [`WeightArena`] ([`QuantMatrix::repacked_for_cpu`],
/// [`QuantMatrix::copied_for_cpu`]), as the loader copies every one, and read from the
/// map only when that copy cannot be made. Row `r` of the file is
/// `cols / ty.block_elems()` consecutive blocks.
#[derive(Clone)]
pub struct QuantMatrix {
    file: Arc<GgufFile>,
    tensor: usize,
    /// The file row this matrix starts at: 0, or where its rows begin inside a fused
    /// tensor ([`QuantMatrix::row_range`]).
    first_row: usize,
    /// The block type.
    pub ty: QType,
    /// Output features (HF `out_features`).
    pub rows: usize,
    /// Input features (HF `in_features`), a multiple of the block size.
    pub cols: usize,
    /// For a `llama` GGUF's Q/K projections read from the map: HF row `r` is the
    /// file's row `row_order[r]` (undone on each product's output, which is exact).
    /// `None` once the matrix is copied at load, which puts its rows in HF's order.
    pub row_order: Option<Vec<u32>>,
    /// Where [`QuantMatrix::repacked_for_cpu`] and [`QuantMatrix::copied_for_cpu`]
    /// put the matrix (the source's [`WeightArena`]).
    arena: Arc<WeightArena>,
    /// The matrix copied at load into huge pages, repacked ([`QuantMatrix::repacked_for_cpu`];
    /// then `ty` is [`QType::Q8_0R16`], [`QType::Q8_0R2`] or [`QType::Q4_1R16`]) or as the
    /// file has it ([`QuantMatrix::copied_for_cpu`]); its bytes in the map are not read
    /// again. `None`: the bytes stay in the map.
    copy: Option<ArenaBytes>,
}

impl QuantMatrix {
    /// The matrix's block bytes (`rows × cols / block_elems × block_bytes`): the
    /// tensor's in the map, its rows' slice of a fused tensor, or the copy made at load.
    pub fn bytes(&self) -> &[u8] {
        if let Some(r) = &self.copy {
            return r.bytes();
        }
        self.file_bytes()
    }

    /// The matrix's bytes as the file stores them (in the map).
    fn file_bytes(&self) -> &[u8] {
        let all = self.file.tensor_data(&self.file.tensors()[self.tensor]);
        let rb = self.row_bytes();
        all.get(self.first_row * rb..(self.first_row + self.rows) * rb)
            .unwrap_or(&[])
    }

    /// This matrix in the layout this CPU's kernels read fastest, copied into the
    /// model's huge pages ([`WeightArena`]): on a CPU with AVX-512 VNNI
    /// ([`fak_tensor::quant::has_avx512_vnni`]), a Q8_0 or Q4_1 matrix of a multiple of
    /// 16 rows is repacked in groups of 16 ([`QType::Q8_0R16`],
    /// [`fak_tensor::quant::repack_q8_0_r16`]; [`QType::Q4_1R16`],
    /// [`fak_tensor::quant::repack_q4_1_r16`]) and another Q8_0 matrix of an even number
    /// of rows in row pairs ([`QType::Q8_0R2`], [`fak_tensor::quant::repack_q8_0_r2`]):
    /// the same size, the same products' bits, and their multi-token products skip
    /// preparing the weights. Any other matrix is copied as the file has it
    /// ([`QuantMatrix::copied_for_cpu`]). The file's bytes are read with positional
    /// reads ([`GgufFile::read_tensor_data`]), not through the map, into the memory
    /// that then holds the matrix, so it is held once; a `llama` file's Q/K rows are
    /// put in HF's order as they are copied ([`QuantMatrix::row_order`] then `None`),
    /// so no product's output is permuted after. A matrix whose read fails, or for
    /// which no memory can be mapped, is returned as it is (read from the map).
    pub fn repacked_for_cpu(self) -> Self {
        use fak_tensor::quant::{
            repack_q4_1_r16_into, repack_q8_0_r16_into, repack_q8_0_r2_into, R16_ROWS,
        };
        let vnni = fak_tensor::quant::has_avx512_vnni();
        match self.ty {
            QType::Q8_0 if vnni && self.rows.is_multiple_of(R16_ROWS) => {
                self.copied_as(R16_ROWS, QType::Q8_0R16, repack_q8_0_r16_into)
            }
            QType::Q8_0 if vnni && self.rows.is_multiple_of(2) => {
                self.copied_as(2, QType::Q8_0R2, repack_q8_0_r2_into)
            }
            QType::Q4_1 if vnni && self.rows.is_multiple_of(R16_ROWS) => {
                self.copied_as(R16_ROWS, QType::Q4_1R16, repack_q4_1_r16_into)
            }
            _ => self.copied_for_cpu(),
        }
    }

    /// This matrix copied as the file has it into the model's huge pages
    /// ([`WeightArena`]: a decode step streams it with one TLB miss per 2 MB instead
    /// of per 4 KB), read with positional reads as [`QuantMatrix::repacked_for_cpu`]
    /// reads, a `llama` file's Q/K rows put in HF's order as they are copied
    /// ([`QuantMatrix::row_order`] then `None`); returned as it is when the read fails
    /// or no memory can be mapped.
    pub fn copied_for_cpu(self) -> Self {
        let ty = self.ty;
        self.copied_as(1, ty, |_, _, _, _| Ok(()))
    }

    /// The matrix's file bytes read into the arena, then each group of `group` rows
    /// rearranged in place by `repack` (from a copy of the group) into type `to`.
    fn copied_as(mut self, group: usize, to: QType, repack: Repack) -> Self {
        let rb = self.row_bytes();
        let (len, base) = (rb * self.rows, self.first_row * rb);
        if self.copy.is_some() || self.file_bytes().len() != len || len == 0 {
            return self;
        }
        let cols = self.cols;
        let order = self.row_order.as_deref();
        let copy = copy_to_arena(&self.file, self.tensor, &self.arena, base, len, |out| {
            if let Some(order) = order {
                in_hf_row_order(out, rb, order);
            }
            if group == 1 {
                return true;
            }
            let mut rows = vec![0u8; group * rb];
            out.chunks_exact_mut(group * rb).all(|dst| {
                rows.copy_from_slice(dst);
                repack(&rows, group, cols, dst).is_ok()
            })
        });
        if let Some(copy) = copy {
            self.copy = Some(copy);
            self.ty = to;
            self.row_order = None;
        }
        self
    }

    /// For a matrix copied at load, drops the process's mappings of the file's copy of
    /// its bytes ([`GgufFile::release_mapped_pages`]): never read again, they are mapped
    /// only when the kernel maps pages around a small tensor read through the map
    /// (SmolLM2's 60 norm vectors between its Q4_1 matrices held ~4 MB so). Called once
    /// the whole model is loaded. Nothing for a matrix that reads the map.
    pub fn release_file_pages(&self) {
        release_if_copied(&self.file, self.tensor, &self.copy);
    }

    /// Whether the matrix was copied at load ([`QuantMatrix::repacked_for_cpu`],
    /// [`QuantMatrix::copied_for_cpu`]), repacked or not.
    pub fn is_copied(&self) -> bool {
        self.copy.is_some()
    }

    /// Stored row `f` of this matrix (the file's row, or HF's once the copy put the
    /// rows in HF's order, [`QuantMatrix::row_order`]) times `act` ([`fak_tensor::quant::vec_dot`], or
    /// [`fak_tensor::quant::vec_dot_row`] for a repacked matrix): the bits every product
    /// over the matrix gives for that row.
    ///
    /// # Errors
    /// As those functions (a row outside the matrix, a wrong activation).
    pub fn dot_row(
        &self,
        f: usize,
        act: &fak_tensor::quant::QuantizedActs,
    ) -> Result<f32, fak_tensor::quant::QuantError> {
        let w = self.bytes();
        match self.ty {
            QType::Q8_0R2 => return fak_tensor::quant::vec_dot_row(w, f, act),
            QType::Q4_1R16 => return fak_tensor::quant::vec_dot_row_q4_1_r16(w, f, act),
            QType::Q8_0R16 => return fak_tensor::quant::vec_dot_row_q8_0_r16(w, f, act),
            _ => {}
        }
        let rb = self.row_bytes();
        let row = w.get(f * rb..(f + 1) * rb).unwrap_or(&[]);
        fak_tensor::quant::vec_dot(self.ty, row, act)
    }

    /// Rows `first..first + rows` of this matrix as a matrix of their own, in place: one
    /// part of a fused tensor (Phi-3's `qkv_proj`, `gate_up_proj`).
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] when the range is not inside the matrix, its rows
    /// are permuted or it was already copied at load.
    pub fn row_range(mut self, first: usize, rows: usize) -> Result<Self, ModelError> {
        if self.row_order.is_some()
            || self.copy.is_some()
            || first.checked_add(rows).is_none_or(|e| e > self.rows)
        {
            return Err(ModelError::Unsupported(format!(
                "rows {first}..+{rows} of a [{}, {}] matrix",
                self.rows, self.cols
            )));
        }
        self.first_row += first;
        self.rows = rows;
        Ok(self)
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_elems() * self.ty.block_bytes()
    }

    /// HF row `r` dequantized to `f32` into `out` (`[cols]`): the embedding lookup of
    /// a tied or quantized `embed_tokens`.
    ///
    /// # Errors
    /// [`ModelError::InvalidInput`] when `r >= rows` or `out.len() != cols`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), ModelError> {
        if r >= self.rows || out.len() != self.cols {
            return Err(ModelError::InvalidInput(format!(
                "row {r} of a [{}, {}] matrix into {} elements",
                self.rows,
                self.cols,
                out.len()
            )));
        }
        let fr = self.row_order.as_ref().map_or(r, |o| o[r] as usize);
        let rb = self.row_bytes();
        let t = &self.file.tensors()[self.tensor];
        let err =
            |e: String| ModelError::Unsupported(format!("dequantizing a row of '{}': {e}", t.name));
        if self.ty == QType::Q8_0R2 {
            // The file's Q8_0 values, read from the row pairs (nothing allocated).
            return fak_tensor::quant::dequantize_row_q8_0_r2(self.bytes(), rb, fr, out)
                .map_err(|e| err(e.to_string()));
        }
        if self.ty == QType::Q4_1R16 {
            return fak_tensor::quant::dequantize_row_q4_1_r16(self.bytes(), rb, fr, out)
                .map_err(|e| err(e.to_string()));
        }
        if self.ty == QType::Q8_0R16 {
            return fak_tensor::quant::dequantize_row_q8_0_r16(self.bytes(), rb, fr, out)
                .map_err(|e| err(e.to_string()));
        }
        fak_weights::dequantize(t.ggml_type, &self.bytes()[fr * rb..(fr + 1) * rb], out)
            .map_err(|e| err(e.to_string()))
    }
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("permuted", &self.row_order.is_some())
            .finish()
    }
}

/// Bytes `base..base + len` of tensor `tensor`'s data read with positional reads
/// ([`GgufFile::read_tensor_data`], not through the map) into `arena`, then `finish` run
/// on them in place (a repacking, a check): the copy of a [`QuantMatrix`] or a
/// [`Mapped`]; `None` when the read, the memory or `finish` fails (the arena then holds
/// nothing of it, [`WeightArena::copy_in`]).
fn copy_to_arena(
    file: &GgufFile,
    tensor: usize,
    arena: &WeightArena,
    base: usize,
    len: usize,
    finish: impl FnOnce(&mut [u8]) -> bool,
) -> Option<ArenaBytes> {
    let t = &file.tensors()[tensor];
    arena.copy_in(len, |out| {
        file.read_tensor_data(t, base, out).is_ok() && finish(out)
    })
}

/// The rows of `bytes` (`rb` bytes each, in the file's order) put in HF's order in place:
/// row `r` becomes the file's row `order[r]` (a `llama` GGUF's Q/K permutation undone
/// once at load, so no product's output needs it undone). Each output row is computed
/// from its own row's bytes by the same kernel wherever the row sits, so the products
/// give the bits they gave with the permutation undone on their outputs.
fn in_hf_row_order(bytes: &mut [u8], rb: usize, order: &[u32]) {
    let file = bytes.to_vec();
    for (dst, &f) in bytes.chunks_exact_mut(rb).zip(order) {
        let f = f as usize;
        dst.copy_from_slice(&file[f * rb..(f + 1) * rb]);
    }
}

/// Drops the process's mappings of tensor `tensor`'s pages in the file when the matrix
/// reading it holds a `copy` ([`GgufFile::release_mapped_pages`]); nothing otherwise.
fn release_if_copied(file: &GgufFile, tensor: usize, copy: &Option<ArenaBytes>) {
    if copy.is_some() {
        file.release_mapped_pages(&file.tensors()[tensor]);
    }
}

/// For a GGUF matrix kept in the file: HF row `r` is the file's row `order[r]`, the
/// family's row order (a `llama` GGUF's `q_proj` / `k_proj`, the row-index form of
/// [`fak_weights::unpermute_qk_rows`]); `None` when the rows are in HF order.
fn qk_row_order(name: &str, rows: usize, cfg: &Config) -> Result<Option<Vec<u32>>, ModelError> {
    cfg.family.spec().gguf_row_order(name, rows, cfg)
}

/// An element type a GGUF matrix is kept as, not widened ([`Mapped`]): `f32` (an F32
/// tensor) or [`F16`] (an F16 tensor, widened exactly as the products load it).
pub trait MappedElem: WeightElem {
    /// The tensor's data as values of this type, borrowed from the map, or `None` when
    /// it is of another type or cannot be borrowed (see
    /// [`GgufFile::tensor_f32_in_place`], [`GgufFile::tensor_f16_in_place`]).
    fn in_place<'a>(file: &'a GgufFile, t: &fak_weights::TensorInfo) -> Option<&'a [Self]>;

    /// Little-endian bytes as values of this type, `None` when they are misaligned, of
    /// a length that is not a whole number of values, or the host is big-endian.
    fn from_bytes(bytes: &[u8]) -> Option<&[Self]>;
}

impl MappedElem for f32 {
    fn in_place<'a>(file: &'a GgufFile, t: &fak_weights::TensorInfo) -> Option<&'a [f32]> {
        file.tensor_f32_in_place(t)
    }

    fn from_bytes(bytes: &[u8]) -> Option<&[f32]> {
        cfg!(target_endian = "little")
            .then(|| bytemuck::try_cast_slice(bytes).ok())
            .flatten()
    }
}

impl MappedElem for F16 {
    fn in_place<'a>(file: &'a GgufFile, t: &fak_weights::TensorInfo) -> Option<&'a [F16]> {
        file.tensor_f16_in_place(t)
    }

    fn from_bytes(bytes: &[u8]) -> Option<&[F16]> {
        cfg!(target_endian = "little")
            .then(|| bytemuck::try_cast_slice::<u8, u16>(bytes).ok())
            .flatten()
            .map(F16::from_bits_slice)
    }
}

/// A `[rows, cols]` F32 or F16 matrix of a GGUF file kept in the file's type: the
/// native path's form of such a file's linear layers and embedding, so the weights are
/// not widened into a `Vec<f32>`. Made by [`WeightSource::mapped`] as a view of the
/// file's memory map (it checked that the data borrows as `&[W]`), then copied once at
/// load into the source's [`WeightArena`] ([`Mapped::copied_for_cpu`]), after which the
/// process holds that copy only; read from the map when the copy cannot be made.
/// Products on it run the `f32` kernels on the same values as the exact path's `f32`
/// copy (for F16, widened), widening F16 exactly as it is loaded
/// ([`fak_tensor::WeightElem`]), so results are the same bits.
pub struct Mapped<W: MappedElem> {
    /// Keeps the map alive as long as the handle.
    file: Arc<GgufFile>,
    tensor: usize,
    /// The file row this matrix starts at (see [`QuantMatrix::row_range`]).
    first_row: usize,
    /// Output features (HF `out_features`; `vocab` for the embedding).
    pub rows: usize,
    /// Input features (HF `in_features`; `hidden` for the embedding).
    pub cols: usize,
    /// For a `llama` GGUF's Q/K projections read from the map: HF row `r` is the
    /// file's row `row_order[r]` (undone on each product's output, which is exact).
    /// `None` once the matrix is copied at load, which puts its rows in HF's order.
    pub row_order: Option<Vec<u32>>,
    /// Where [`Mapped::copied_for_cpu`] puts the matrix (the source's [`WeightArena`]).
    arena: Arc<WeightArena>,
    /// The matrix copied at load into huge pages ([`Mapped::copied_for_cpu`]); its
    /// bytes in the map are not read again. `None`: the values are read from the map.
    copy: Option<ArenaBytes>,
    elem: std::marker::PhantomData<W>,
}

/// An F32 matrix kept as F32 ([`Mapped`]).
pub type MappedF32 = Mapped<f32>;
/// An F16 matrix kept as F16 ([`Mapped`]).
pub type MappedF16 = Mapped<F16>;

impl<W: MappedElem> Clone for Mapped<W> {
    fn clone(&self) -> Self {
        Mapped {
            file: Arc::clone(&self.file),
            tensor: self.tensor,
            first_row: self.first_row,
            rows: self.rows,
            cols: self.cols,
            row_order: self.row_order.clone(),
            arena: Arc::clone(&self.arena),
            copy: self.copy.clone(),
            elem: std::marker::PhantomData,
        }
    }
}

impl<W: MappedElem> Mapped<W> {
    /// The matrix as row-major `[rows, cols]` values, rows in the file's order while
    /// [`Mapped::row_order`] is `Some` (read from the map) and in HF's once copied,
    /// borrowed from the copy made at load
    /// ([`MappedElem::from_bytes`]) or, without one, from the memory map
    /// ([`MappedElem::in_place`]); either checks alignment and length again on every
    /// call. Always `rows × cols` long for a handle made by [`WeightSource::mapped`]:
    /// neither the copy nor the map moves or changes while the handle holds it.
    pub fn values(&self) -> &[W] {
        if let Some(copy) = &self.copy {
            return W::from_bytes(copy.bytes()).unwrap_or(&[]);
        }
        let all = W::in_place(&self.file, &self.file.tensors()[self.tensor]).unwrap_or(&[]);
        all.get(self.first_row * self.cols..(self.first_row + self.rows) * self.cols)
            .unwrap_or(&[])
    }

    /// This matrix copied as the file has it into the model's huge pages
    /// ([`WeightArena`]: a decode step streams it with one TLB miss per 2 MB instead
    /// of per 4 KB), read with positional reads ([`GgufFile::read_tensor_data`]) so
    /// it is held once, a `llama` file's Q/K rows put in HF's order as they are copied
    /// ([`Mapped::row_order`] then `None`); returned as it is when the read fails or no
    /// memory can be mapped. The same values, so products on it give the same bits.
    pub fn copied_for_cpu(mut self) -> Self {
        let len = self.byte_len();
        let base = self.first_row * self.cols * std::mem::size_of::<W>();
        if self.copy.is_some() || self.values().len() != self.rows * self.cols || len == 0 {
            return self;
        }
        let (order, rb) = (
            self.row_order.as_deref(),
            self.cols * std::mem::size_of::<W>(),
        );
        self.copy = copy_to_arena(&self.file, self.tensor, &self.arena, base, len, |out| {
            if let Some(order) = order {
                in_hf_row_order(out, rb, order);
            }
            W::from_bytes(out).is_some()
        });
        if self.copy.is_some() {
            self.row_order = None;
        }
        self
    }

    /// For a matrix copied at load, drops the process's mappings of the file's copy of
    /// its bytes (as [`QuantMatrix::release_file_pages`]).
    pub fn release_file_pages(&self) {
        release_if_copied(&self.file, self.tensor, &self.copy);
    }

    /// Whether the matrix was copied at load ([`Mapped::copied_for_cpu`]).
    pub fn is_copied(&self) -> bool {
        self.copy.is_some()
    }

    /// Rows `first..first + rows` of this matrix as a matrix of their own, in place (as
    /// [`QuantMatrix::row_range`]).
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] when the range is not inside the matrix, its rows
    /// are permuted or it was already copied at load.
    pub fn row_range(mut self, first: usize, rows: usize) -> Result<Self, ModelError> {
        if self.row_order.is_some()
            || self.copy.is_some()
            || first.checked_add(rows).is_none_or(|e| e > self.rows)
        {
            return Err(ModelError::Unsupported(format!(
                "rows {first}..+{rows} of a [{}, {}] matrix",
                self.rows, self.cols
            )));
        }
        self.first_row += first;
        self.rows = rows;
        Ok(self)
    }

    /// Bytes of the matrix (`size_of::<W>() × rows × cols`), in its copy or the map.
    pub fn byte_len(&self) -> usize {
        std::mem::size_of::<W>() * self.rows * self.cols
    }

    /// HF row `r` into `out` (`[cols]`), widened to `f32`: the embedding lookup.
    ///
    /// # Errors
    /// [`ModelError::InvalidInput`] when `r >= rows` or `out.len() != cols`.
    pub fn copy_row(&self, r: usize, out: &mut [f32]) -> Result<(), ModelError> {
        let fr = match &self.row_order {
            Some(o) => o.get(r).map(|&x| x as usize),
            None => Some(r),
        };
        let src = fr.and_then(|fr| self.values().get(fr * self.cols..(fr + 1) * self.cols));
        match src {
            Some(src) if r < self.rows && out.len() == self.cols => {
                for (o, v) in out.iter_mut().zip(src) {
                    *o = v.to_f32();
                }
                Ok(())
            }
            _ => Err(ModelError::InvalidInput(format!(
                "row {r} of a [{}, {}] matrix into {} elements",
                self.rows,
                self.cols,
                out.len()
            ))),
        }
    }
}

impl<W: MappedElem> std::fmt::Debug for Mapped<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapped")
            .field("elem", &std::any::type_name::<W>())
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("permuted", &self.row_order.is_some())
            .finish()
    }
}
