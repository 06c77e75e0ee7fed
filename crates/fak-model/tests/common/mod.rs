//! Shared helpers of fak-model's proof tests: fixture paths, the real model's location,
//! and the asserting wrapper of `fak_prove::oracle::measure`.
#![allow(dead_code)]

pub mod chatml;

use fak_model::KvStore;
pub use fak_prove::oracle::{measure, Figures, Oracle};
use std::path::PathBuf;

/// The repository's `testdata/` folder.
pub fn testdata() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

/// Reads an oracle file or fails naming the command that regenerates it.
pub fn load_oracle(file: PathBuf) -> Oracle {
    Oracle::load(file).unwrap_or_else(|e| {
        panic!("{e}\nregenerate with: python oracle-export/export_oracle.py (see oracle-export/README.md)")
    })
}

/// Every `*.safetensors` oracle under `testdata/oracles/<name>/`, sorted. Fails when
/// there are none.
pub fn oracle_files(name: &str) -> Vec<PathBuf> {
    let dir = testdata().join("oracles").join(name);
    let v = fak_prove::oracle::oracle_files_in(&dir).unwrap_or_else(|e| {
        panic!("{e}\nregenerate with: python oracle-export/export_oracle.py (see oracle-export/README.md)")
    });
    assert!(!v.is_empty(), "no oracle files in {}", dir.display());
    v
}

/// Path of the real SmolLM2 GGUF (`$FAK_SMOLLM2_GGUF`, else the model cache); fails with
/// the fetch command when it is missing (see `fak_catalog::require_cached`).
pub fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "FAK_SMOLLM2_GGUF={} is not a file",
            p.display()
        );
        return p;
    }
    real_model("smollm2-135m-instruct")
}

/// A Llama-like layer's seven matrices (HF names after `model.layers.{l}.`) with their
/// `[out, in]` shapes from `cfg`.
pub fn layer_matrices(cfg: &fak_model::Config) -> [(&'static str, [usize; 2]); 7] {
    let (h, q, kv, f) = (
        cfg.hidden_size,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.intermediate_size,
    );
    [
        ("self_attn.q_proj.weight", [q, h]),
        ("self_attn.k_proj.weight", [kv, h]),
        ("self_attn.v_proj.weight", [kv, h]),
        ("self_attn.o_proj.weight", [h, q]),
        ("mlp.gate_proj.weight", [f, h]),
        ("mlp.up_proj.weight", [f, h]),
        ("mlp.down_proj.weight", [h, f]),
    ]
}

/// Bytes of a GGUF file's matrices (its 2-D tensors' data, as stored): what a native
/// load copies into the model's huge pages.
pub fn file_matrix_bytes(path: &std::path::Path) -> usize {
    let file = fak_weights::GgufFile::open(path).unwrap();
    file.tensors()
        .iter()
        .filter(|t| t.shape_hf().len() == 2)
        .map(|t| file.tensor_data(t).len())
        .sum()
}

/// The cached file of catalog model `name`, or a failure naming the fetch command.
pub fn real_model(name: &str) -> PathBuf {
    fak_catalog::require_cached(name).unwrap_or_else(|m| panic!("{m}"))
}

/// [`measure`], then asserts docs/design.md's bounds and prints the figures.
pub fn check_oracle(model: &fak_model::Model, oracle: &Oracle) -> Figures {
    let f = measure(model, oracle).unwrap_or_else(|e| panic!("{e}"));
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
    assert!(f.r1_holds() && f.r2b_holds());
    f
}

/// R0: the checkpoint's tensor table (HF names, shapes) equals HF's `named_parameters()`
/// recorded in `<oracle_dir>/state_dict.json`, and so does the parameter count, which is
/// returned.
pub fn check_tensor_table(src: &fak_model::WeightSource, oracle_dir: &std::path::Path) -> u64 {
    let text = std::fs::read_to_string(oracle_dir.join("state_dict.json")).unwrap();
    let hf: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut theirs: Vec<(String, Vec<usize>)> = hf["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let shape = e[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (e[0].as_str().unwrap().to_string(), shape)
        })
        .collect();
    theirs.sort();
    let ours: Vec<(String, Vec<usize>)> = src
        .entries()
        .into_iter()
        .map(|e| (e.name, e.shape))
        .collect();
    assert_eq!(ours, theirs, "tensor table differs from HF's");
    let n: u64 = ours
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as u64)
        .sum();
    assert_eq!(
        n,
        hf["n_params"].as_u64().unwrap(),
        "parameter count differs from HF's"
    );
    n
}

/// The public-domain text of `testdata/quality/eighty-days.txt` (see the README there).
pub fn quality_text() -> String {
    let p = testdata().join("quality/eighty-days.txt");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Native path against the exact one over a teacher-forced text.
#[derive(Clone, Copy, Debug)]
pub struct Quality {
    /// Positions compared (every token of the text).
    pub n: usize,
    /// Positions where the two argmaxes agree.
    pub agree: usize,
    /// Mean over positions of KL(exact ‖ native), nats.
    pub kl_mean: f64,
    /// Largest KL(exact ‖ native) at one position, nats.
    pub kl_max: f64,
    /// Largest |exact − native| over every logit of every position.
    pub max_abs: f32,
    /// Seconds of the exact forward passes.
    pub secs_exact: f64,
    /// Seconds of the native forward passes.
    pub secs_native: f64,
}

impl Quality {
    /// Top-1 agreement, in [0, 1].
    pub fn top1(&self) -> f64 {
        self.agree as f64 / self.n as f64
    }
}

/// Log-softmax of one logit row, in f64.
fn log_softmax(r: &[f32]) -> Vec<f64> {
    let m = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z: f64 = r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    r.iter().map(|&x| x as f64 - z).collect()
}

/// Teacher-forces `ids` through both models (one prefill each, run in chunks of `chunk`
/// positions over the same cache so only `chunk` logit rows are held at once: chunked
/// prefill gives the bits of a single prefill, which `*_decode_equals_prefill_bitwise`
/// checks) and compares every position's logits.
pub fn teacher_forced(
    exact: &fak_model::Model,
    native: &fak_model::Model,
    ids: &[u32],
    chunk: usize,
) -> Quality {
    use fak_model::{LogitsWanted, VecKvCache};
    let v = exact.config().vocab_size;
    let layers = exact.config().num_hidden_layers;
    let (mut ke, mut kn) = (
        VecKvCache::new(layers, ids.len()),
        VecKvCache::new(layers, ids.len()),
    );
    let mut q = Quality {
        n: ids.len(),
        agree: 0,
        kl_mean: 0.0,
        kl_max: 0.0,
        max_abs: 0.0,
        secs_exact: 0.0,
        secs_native: 0.0,
    };
    let mut kl_sum = 0f64;
    let mut at = 0;
    while at < ids.len() {
        let end = (at + chunk).min(ids.len());
        let pos: Vec<u32> = (at as u32..end as u32).collect();
        let t = std::time::Instant::now();
        let le = exact
            .forward(&ids[at..end], &pos, &mut ke, LogitsWanted::All, None)
            .unwrap();
        q.secs_exact += t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        let ln = native
            .forward(&ids[at..end], &pos, &mut kn, LogitsWanted::All, None)
            .unwrap();
        q.secs_native += t.elapsed().as_secs_f64();
        for (re, rn) in le.chunks_exact(v).zip(ln.chunks_exact(v)) {
            q.agree += usize::from(fak_model::argmax(re) == fak_model::argmax(rn));
            let (pe, pn) = (log_softmax(re), log_softmax(rn));
            let kl: f64 = pe.iter().zip(&pn).map(|(a, b)| a.exp() * (a - b)).sum();
            kl_sum += kl;
            q.kl_max = q.kl_max.max(kl);
            for (a, b) in re.iter().zip(rn) {
                q.max_abs = q.max_abs.max((a - b).abs());
            }
        }
        at = end;
    }
    q.kl_mean = kl_sum / ids.len() as f64;
    q
}

/// Logits of `ids` run through `m` in the given chunk sizes (each chunk one forward
/// pass over the same cache), every position's row, `[ids.len(), vocab]`.
pub fn run_in_chunks(m: &fak_model::Model, ids: &[u32], chunks: &[usize]) -> Vec<f32> {
    let mut kv = fak_model::VecKvCache::new(m.config().num_hidden_layers, ids.len());
    let mut out = Vec::new();
    let mut at = 0;
    for &c in chunks {
        let pos: Vec<u32> = (at as u32..(at + c) as u32).collect();
        out.extend(
            m.forward(
                &ids[at..at + c],
                &pos,
                &mut kv,
                fak_model::LogitsWanted::All,
                None,
            )
            .unwrap(),
        );
        at += c;
    }
    assert_eq!(at, ids.len());
    assert_eq!(kv.len(), ids.len());
    out
}

/// Whether two rows hold the same `f32` bits.
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
