//! Shared helpers of fak-model's proof tests: fixture paths, oracle reading, the real
//! model's location, and the comparison figures (cosine, max|Δ|).
#![allow(dead_code)]

use fak_model::catalog;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::PathBuf;

/// The repository's `testdata/` folder.
pub fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

/// One oracle file written by `oracle-export/export_oracle.py` (HF-authored).
pub struct Oracle {
    pub file: PathBuf,
    pub f32s: HashMap<String, (Vec<usize>, Vec<f32>)>,
    pub i64s: HashMap<String, (Vec<usize>, Vec<i64>)>,
    pub metadata: HashMap<String, String>,
}

impl Oracle {
    pub fn load(file: PathBuf) -> Oracle {
        let bytes = std::fs::read(&file).unwrap_or_else(|e| {
            panic!(
                "cannot read oracle {}: {e}\nregenerate with: python oracle-export/export_oracle.py (see oracle-export/README.md)",
                file.display()
            )
        });
        let (_, meta) = SafeTensors::read_metadata(&bytes).expect("oracle header");
        let metadata = meta.metadata().clone().unwrap_or_default();
        let st = SafeTensors::deserialize(&bytes).expect("oracle safetensors");
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
                        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                        .collect();
                    i64s.insert(name, (shape, v));
                }
                d => panic!("{}: unexpected dtype {d:?} for {name}", file.display()),
            }
        }
        Oracle {
            file,
            f32s,
            i64s,
            metadata,
        }
    }

    pub fn f32(&self, name: &str) -> &(Vec<usize>, Vec<f32>) {
        self.f32s
            .get(name)
            .unwrap_or_else(|| panic!("{} lacks tensor {name}", self.file.display()))
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        self.i64s
            .get(name)
            .unwrap_or_else(|| panic!("{} lacks tensor {name}", self.file.display()))
            .1
            .iter()
            .map(|&x| u32::try_from(x).expect("id fits u32"))
            .collect()
    }
}

/// Every `*.safetensors` oracle under `testdata/oracles/<name>/`, sorted. Fails when
/// there are none.
pub fn oracle_files(name: &str) -> Vec<PathBuf> {
    let dir = testdata().join("oracles").join(name);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            panic!(
                "no oracle folder {}: {e}\nregenerate with: python oracle-export/export_oracle.py (see oracle-export/README.md)",
                dir.display()
            )
        })
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no oracle files in {}", dir.display());
    v
}

/// Path of the real SmolLM2 GGUF: `$FAK_SMOLLM2_GGUF`, else the model cache. Fails with
/// the fetch command when it is missing; `FAK_SKIP_REAL_MODEL=1` opts out locally (never
/// in CI), returning `None` with a loud note.
pub fn smollm2_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "FAK_SMOLLM2_GGUF={} is not a file",
            p.display()
        );
        return Some(p);
    }
    if let Some(p) = catalog::cached("smollm2-135m-instruct") {
        return Some(p);
    }
    if std::env::var("FAK_SKIP_REAL_MODEL").as_deref() == Ok("1") && std::env::var("CI").is_err() {
        eprintln!("NOTE: FAK_SKIP_REAL_MODEL=1: real-model test NOT RUN");
        return None;
    }
    panic!(
        "the real model smollm2-135m-instruct is not in the cache ({}).\nFetch it with: cargo run --release -p fak-cli -- model pull smollm2-135m-instruct",
        catalog::cache_path(catalog::find("smollm2-135m-instruct").unwrap()).display()
    );
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

/// Index of the largest value (first on ties), as torch.argmax.
pub fn argmax(v: &[f32]) -> usize {
    fak_model::argmax(v) as usize
}

/// Figures of one oracle comparison.
#[derive(Debug)]
pub struct Figures {
    pub name: String,
    /// Whether the embedding rows are bit-identical to HF's.
    pub embed_exact: bool,
    pub min_layer_cosine: f64,
    pub final_norm_cosine: f64,
    pub logits_max_abs_diff: f32,
    pub argmax_agree: usize,
    pub positions: usize,
    pub greedy: Vec<u32>,
    pub hf_greedy: Vec<u32>,
}

/// Measures rungs R1 (embedding, per-layer cosine, logits max|Δ|, argmax at every
/// position) and R2b (greedy continuation) of `model` against one HF oracle, without
/// judging them.
pub fn measure(model: &fak_model::Model, oracle: &Oracle) -> Figures {
    use fak_model::{ForwardTrace, LogitsWanted, VecKvCache};
    let c = model.config();
    let h = c.hidden_size;
    let v = c.vocab_size;
    let ids = oracle.ids("prompt_ids");
    let t = ids.len();
    let pos: Vec<u32> = (0..t as u32).collect();
    let mut kv = VecKvCache::new(c.num_hidden_layers, c.max_position_embeddings);
    let mut trace = ForwardTrace::default();
    let logits = model
        .forward(&ids, &pos, &mut kv, LogitsWanted::All, Some(&mut trace))
        .expect("forward");
    let name = oracle.file.display().to_string();

    // Rows of the hidden-state tensors refer to these prompt positions.
    let rows: Vec<usize> = oracle
        .ids("positions")
        .iter()
        .map(|&p| p as usize)
        .collect();
    let (eshape, embed) = oracle.f32("embed");
    assert_eq!(eshape, &vec![rows.len(), h], "{name}: embed shape");
    let embed_exact = rows.iter().enumerate().all(|(i, &p)| {
        let ours = &trace.embed[p * h..(p + 1) * h];
        let theirs = &embed[i * h..(i + 1) * h];
        ours.iter()
            .zip(theirs)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    });
    let (hshape, hidden) = oracle.f32("hidden");
    assert_eq!(
        hshape,
        &vec![c.num_hidden_layers, rows.len(), h],
        "{name}: hidden shape"
    );
    let mut min_cos = f64::INFINITY;
    for l in 0..c.num_hidden_layers {
        for (i, &p) in rows.iter().enumerate() {
            let ours = &trace.layers[l][p * h..(p + 1) * h];
            let off = (l * rows.len() + i) * h;
            min_cos = min_cos.min(cosine(ours, &hidden[off..off + h]));
        }
    }
    let (_, fnorm) = oracle.f32("final_norm");
    let mut fn_cos = f64::INFINITY;
    for (i, &p) in rows.iter().enumerate() {
        let cos = cosine(
            &trace.final_norm[p * h..(p + 1) * h],
            &fnorm[i * h..(i + 1) * h],
        );
        fn_cos = fn_cos.min(cos);
    }

    let lpos: Vec<usize> = oracle
        .ids("logits_positions")
        .iter()
        .map(|&p| p as usize)
        .collect();
    let (lshape, hf_logits) = oracle.f32("logits");
    assert_eq!(lshape, &vec![lpos.len(), v], "{name}: logits shape");
    let mut max_d = 0f32;
    for (i, &p) in lpos.iter().enumerate() {
        let d = max_abs_diff(&logits[p * v..(p + 1) * v], &hf_logits[i * v..(i + 1) * v]);
        max_d = max_d.max(d);
    }

    let topk = oracle.ids("topk_ids");
    let k = topk.len() / t;
    let agree = (0..t)
        .filter(|&p| argmax(&logits[p * v..(p + 1) * v]) == topk[p * k] as usize)
        .count();

    let hf_greedy = oracle.ids("greedy_ids");
    let g = fak_model::generate_greedy(model, &ids, 16, true).expect("generate");
    Figures {
        name,
        embed_exact,
        min_layer_cosine: min_cos,
        final_norm_cosine: fn_cos,
        logits_max_abs_diff: max_d,
        argmax_agree: agree,
        positions: t,
        greedy: g.completion_ids,
        hf_greedy,
    }
}

/// [`measure`], then asserts DESIGN.md's bounds and prints the figures.
pub fn check_oracle(model: &fak_model::Model, oracle: &Oracle) -> Figures {
    let f = measure(model, oracle);
    println!(
        "{}: embedding exact {}, min layer cosine 1-{:.2e}, final norm cosine 1-{:.2e}, logits max|Δ| {:.3e}, argmax {}/{}, greedy {}/{} tokens equal",
        f.name,
        f.embed_exact,
        1.0 - f.min_layer_cosine,
        1.0 - f.final_norm_cosine,
        f.logits_max_abs_diff,
        f.argmax_agree,
        f.positions,
        f.greedy.iter().zip(&f.hf_greedy).take_while(|(a, b)| a == b).count(),
        f.hf_greedy.len()
    );
    assert!(
        f.embed_exact,
        "{}: embedding is not bit-identical to HF's",
        f.name
    );
    assert!(
        f.min_layer_cosine >= 0.999999,
        "{}: a layer's cosine is {} < 0.999999",
        f.name,
        f.min_layer_cosine
    );
    assert!(
        f.final_norm_cosine >= 0.999999,
        "{}: final norm cosine {}",
        f.name,
        f.final_norm_cosine
    );
    assert!(
        f.logits_max_abs_diff <= 1e-4,
        "{}: logits max|Δ| = {:e} > 1e-4",
        f.name,
        f.logits_max_abs_diff
    );
    assert_eq!(
        f.argmax_agree, f.positions,
        "{}: argmax differs at some position",
        f.name
    );
    assert_eq!(
        f.greedy, f.hf_greedy,
        "{}: greedy continuation differs from HF generate",
        f.name
    );
    f
}
