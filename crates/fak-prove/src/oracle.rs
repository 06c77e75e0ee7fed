//! HF oracle fixtures and the R1/R2b comparison against them.
//!
//! An oracle file is a safetensors file written by `oracle-export/export_oracle.py` from
//! HF transformers (never by fak): `prompt_ids`, `positions`, `embed`, `hidden`
//! (`[layers, positions, hidden]`, the residual stream after each decoder layer, from
//! forward hooks), `final_norm`, `logits_positions` + `logits`, `topk_ids`, and
//! `greedy_ids` (HF `generate(do_sample=False)`). [`measure`] runs a model on the oracle's
//! prompt and reports the figures docs/design.md bounds; the callers judge them.

use fak_model::{generate_greedy, ForwardTrace, LogitsWanted, Model, VecKvCache};
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Errors reading an oracle file.
#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    /// The file could not be read.
    #[error("cannot read oracle {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not a valid safetensors file or lacks a tensor.
    #[error("oracle {path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// One oracle file written by `oracle-export/export_oracle.py` (HF-authored).
#[derive(Clone, Debug)]
pub struct Oracle {
    /// Where it was read from.
    pub file: PathBuf,
    /// F32 tensors: name -> (shape, values).
    pub f32s: HashMap<String, (Vec<usize>, Vec<f32>)>,
    /// I64 tensors: name -> (shape, values).
    pub i64s: HashMap<String, (Vec<usize>, Vec<i64>)>,
    /// The safetensors `__metadata__` strings (prompt text, regenerating command, ...).
    pub metadata: HashMap<String, String>,
}

impl Oracle {
    /// Reads an oracle file (F32 and I64 tensors, and the string metadata).
    ///
    /// # Errors
    /// [`OracleError`] for an unreadable or malformed file or another dtype.
    pub fn load(file: PathBuf) -> Result<Oracle, OracleError> {
        let bytes = std::fs::read(&file).map_err(|source| OracleError::Io {
            path: file.clone(),
            source,
        })?;
        let bad = |reason: String| OracleError::Format {
            path: file.clone(),
            reason,
        };
        let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
        let metadata = meta.metadata().clone().unwrap_or_default();
        let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        let mut f32s = HashMap::new();
        let mut i64s = HashMap::new();
        for (name, view) in st.tensors() {
            let shape = view.shape().to_vec();
            match view.dtype() {
                Dtype::F32 => {
                    let v = view
                        .data()
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    f32s.insert(name, (shape, v));
                }
                Dtype::I64 => {
                    let v = view
                        .data()
                        .chunks_exact(8)
                        .map(|b| {
                            i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
                        })
                        .collect();
                    i64s.insert(name, (shape, v));
                }
                d => return Err(bad(format!("unexpected dtype {d:?} for {name}"))),
            }
        }
        Ok(Oracle {
            file,
            f32s,
            i64s,
            metadata,
        })
    }

    /// F32 tensor `name` as (shape, values).
    ///
    /// # Errors
    /// [`OracleError::Format`] if absent.
    pub fn f32(&self, name: &str) -> Result<&(Vec<usize>, Vec<f32>), OracleError> {
        self.f32s.get(name).ok_or_else(|| self.missing(name))
    }

    /// I64 tensor `name` as token ids.
    ///
    /// # Errors
    /// [`OracleError::Format`] if absent or a value is not a valid id.
    pub fn ids(&self, name: &str) -> Result<Vec<u32>, OracleError> {
        self.i64s
            .get(name)
            .ok_or_else(|| self.missing(name))?
            .1
            .iter()
            .map(|&x| u32::try_from(x).map_err(|_| self.missing(name)))
            .collect()
    }

    fn missing(&self, name: &str) -> OracleError {
        OracleError::Format {
            path: self.file.clone(),
            reason: format!("lacks a valid tensor '{name}'"),
        }
    }
}

/// The oracle files (`*.safetensors`) directly inside `dir`, sorted by name.
///
/// # Errors
/// [`OracleError::Io`] if the folder cannot be listed.
pub fn oracle_files_in(dir: &Path) -> Result<Vec<PathBuf>, OracleError> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| OracleError::Io {
            path: dir.to_path_buf(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    Ok(v)
}

/// Cosine similarity in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += x as f64 * y as f64;
        aa += x as f64 * x as f64;
        bb += y as f64 * y as f64;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

fn argmax(v: &[f32]) -> usize {
    fak_model::argmax(v) as usize
}

/// Figures of one oracle comparison.
#[derive(Clone, Debug)]
pub struct Figures {
    /// The oracle file.
    pub name: String,
    /// Whether the embedding rows are bit-identical to HF's.
    pub embed_exact: bool,
    /// Smallest cosine similarity of a layer's hidden state with HF's, over the stored
    /// positions.
    pub min_layer_cosine: f64,
    /// Smallest cosine of the final norm's output with HF's.
    pub final_norm_cosine: f64,
    /// Largest |ours - HF| over the stored logit rows and the top-k logits HF stored at
    /// every position.
    pub logits_max_abs_diff: f32,
    /// Positions whose argmax equals HF's top-1.
    pub argmax_agree: usize,
    /// Prompt length.
    pub positions: usize,
    /// Our greedy continuation (16 tokens, stopping at EOS).
    pub greedy: Vec<u32>,
    /// HF `generate`'s.
    pub hf_greedy: Vec<u32>,
}

impl Figures {
    /// Whether docs/design.md's R1 bounds hold: embedding exact, cosines >= 0.999999, logits
    /// max|Δ| <= 1e-4, argmax equal at every position.
    pub fn r1_holds(&self) -> bool {
        self.embed_exact
            && self.min_layer_cosine >= 0.999999
            && self.final_norm_cosine >= 0.999999
            && self.logits_max_abs_diff <= 1e-4
            && self.argmax_agree == self.positions
    }

    /// Whether R2b holds: the greedy continuation equals HF's token for token.
    pub fn r2b_holds(&self) -> bool {
        self.greedy == self.hf_greedy
    }
}

/// Measures rungs R1 (embedding, per-layer cosine, logits max|Δ|, argmax at every
/// position) and R2b (greedy continuation) of `model` against one HF oracle, without
/// judging them.
///
/// # Errors
/// [`OracleError::Format`] when the oracle lacks a tensor or its shapes do not fit the
/// model; a forward-pass failure is reported the same way (naming the error).
pub fn measure(model: &Model, oracle: &Oracle) -> Result<Figures, OracleError> {
    let bad = |reason: String| OracleError::Format {
        path: oracle.file.clone(),
        reason,
    };
    let c = model.config();
    let h = c.hidden_size;
    let v = c.vocab_size;
    let ids = oracle.ids("prompt_ids")?;
    let t = ids.len();
    let pos: Vec<u32> = (0..t as u32).collect();
    let mut kv = VecKvCache::new(c.num_hidden_layers, c.max_position_embeddings);
    let mut trace = ForwardTrace::default();
    model
        .forward(&ids, &pos, &mut kv, LogitsWanted::None, Some(&mut trace))
        .map_err(|e| bad(format!("forward pass failed: {e}")))?;
    let name = oracle.file.display().to_string();

    // Rows of the hidden-state tensors refer to these prompt positions.
    let rows: Vec<usize> = oracle
        .ids("positions")?
        .iter()
        .map(|&p| p as usize)
        .collect();
    let (eshape, embed) = oracle.f32("embed")?;
    if eshape != &vec![rows.len(), h] || rows.iter().any(|&p| p >= t) {
        return Err(bad(format!(
            "embed shape {eshape:?} does not fit the model"
        )));
    }
    let embed_exact = rows.iter().enumerate().all(|(i, &p)| {
        let ours = &trace.embed[p * h..(p + 1) * h];
        let theirs = &embed[i * h..(i + 1) * h];
        ours.iter()
            .zip(theirs)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    });
    let (hshape, hidden) = oracle.f32("hidden")?;
    if hshape != &vec![c.num_hidden_layers, rows.len(), h] {
        return Err(bad(format!(
            "hidden shape {hshape:?} does not fit the model"
        )));
    }
    let mut min_cos = f64::INFINITY;
    for l in 0..c.num_hidden_layers {
        for (i, &p) in rows.iter().enumerate() {
            let ours = &trace.layers[l][p * h..(p + 1) * h];
            let off = (l * rows.len() + i) * h;
            min_cos = min_cos.min(cosine(ours, &hidden[off..off + h]));
        }
    }
    let (fshape, fnorm) = oracle.f32("final_norm")?;
    if fshape != eshape {
        return Err(bad(format!(
            "final_norm shape {fshape:?} does not fit the model"
        )));
    }
    let mut fn_cos = f64::INFINITY;
    for (i, &p) in rows.iter().enumerate() {
        let cos = cosine(
            &trace.final_norm[p * h..(p + 1) * h],
            &fnorm[i * h..(i + 1) * h],
        );
        fn_cos = fn_cos.min(cos);
    }

    let lpos: Vec<usize> = oracle
        .ids("logits_positions")?
        .iter()
        .map(|&p| p as usize)
        .collect();
    let (lshape, hf_logits) = oracle.f32("logits")?;
    if lshape != &vec![lpos.len(), v] || lpos.iter().any(|&p| p >= t) {
        return Err(bad(format!(
            "logits shape {lshape:?} does not fit the model"
        )));
    }
    // Our logits, a chunk of positions at a time (a 262144-word vocabulary over a
    // 1000-token prompt would be a gigabyte at once).
    let row_logits =
        |from: usize, to: usize| model.logits_from_normed(&trace.final_norm[from * h..to * h]);
    let mut max_d = 0f32;
    for (i, &p) in lpos.iter().enumerate() {
        let ours = row_logits(p, p + 1);
        max_d = max_d.max(max_abs_diff(&ours, &hf_logits[i * v..(i + 1) * v]));
    }

    let topk = oracle.ids("topk_ids")?;
    let k = topk.len() / t;
    if k == 0 || topk.len() != k * t {
        return Err(bad(format!(
            "topk_ids has {} values for {t} positions",
            topk.len()
        )));
    }
    // Argmax at every position, and the top-k logits HF stored there bound ours too.
    let (tshape, topk_logits) = oracle.f32("topk_logits")?;
    if tshape != &vec![t, k] {
        return Err(bad(format!(
            "topk_logits shape {tshape:?} does not fit topk_ids"
        )));
    }
    let mut agree = 0;
    const CHUNK: usize = 32;
    for from in (0..t).step_by(CHUNK) {
        let to = (from + CHUNK).min(t);
        let logits = row_logits(from, to);
        for p in from..to {
            let row = &logits[(p - from) * v..(p - from + 1) * v];
            agree += (argmax(row) == topk[p * k] as usize) as usize;
            for j in 0..k {
                let id = topk[p * k + j] as usize;
                if id >= v {
                    return Err(bad(format!("topk id {id} is outside the vocabulary")));
                }
                let d = (row[id] - topk_logits[p * k + j]).abs();
                max_d = max_d.max(if d.is_nan() { f32::INFINITY } else { d });
            }
        }
    }

    let hf_greedy = oracle.ids("greedy_ids")?;
    let g = generate_greedy(model, &ids, 16, true)
        .map_err(|e| bad(format!("generation failed: {e}")))?;
    Ok(Figures {
        name,
        embed_exact,
        min_layer_cosine: min_cos,
        final_norm_cosine: fn_cos,
        logits_max_abs_diff: max_d,
        argmax_agree: agree,
        positions: t,
        greedy: g.completion_ids,
        hf_greedy,
    })
}
