//! R0 on a real checkpoint: SmolLM2-135M-Instruct Q4_1 (GGUF v3, Llama arch).
//! Our parse is cross-checked against the independent `ggus` reader (metadata keys,
//! types and value bytes; tensor names, types, shapes, offsets and data slices), and
//! the tensor table against HF's parameter count.
//!
//! The file comes from `$FAK_SMOLLM2_GGUF`, else
//! `$FAK_HOME/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf`
//! (`FAK_HOME` defaults to the user cache dir + `/fak`). If neither exists the test
//! fails with the command that fetches it, unless `FAK_SKIP_REAL_MODEL=1` (then it is reported as ignored).

use fak_weights::{gguf_to_hf_name, GgmlType, GgufFile, MetaValue};
use std::collections::HashSet;
use std::path::PathBuf;

const FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const PULL: &str = "cargo run --release -p fak-cli -- model pull smollm2-135m-instruct";

fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "FAK_SMOLLM2_GGUF={} does not exist; unset it or run `{PULL}`",
            p.display()
        );
        return p;
    }
    let home = std::env::var_os("FAK_HOME")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("fak")));
    let candidate = home.map(|h| h.join("models/smollm2-135m-instruct").join(FILE));
    if let Some(p) = &candidate {
        if p.is_file() {
            return p.clone();
        }
    }
    panic!(
        "real model not found: set FAK_SMOLLM2_GGUF or place it at {}; fetch it with `{PULL}` \
         (or set FAK_SKIP_REAL_MODEL=1 to report this test as ignored)",
        candidate.map_or("$FAK_HOME/models/smollm2-135m-instruct/".into(), |p| p
            .display()
            .to_string())
    );
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

/// Re-encode a parsed value in GGUF form, to compare with the bytes `ggus` found.
fn encode(v: &MetaValue, out: &mut Vec<u8>) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => {
            out.extend_from_slice(&(s.len() as u64).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        MetaValue::Array(items) => {
            // Element type of an empty array is not kept; callers compare those apart.
            let ty = items.first().map_or(0, type_id);
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                encode(it, out);
            }
        }
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

#[fak_testkit::real_model]
fn smollm2_q4_1_matches_ggus_and_hf_param_count() {
    let path = model_path();
    let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let g = ggus::GGuf::new(f.bytes()).unwrap_or_else(|e| panic!("ggus: {e}"));

    // Header.
    assert_eq!(f.version(), 3);
    assert_eq!(g.header.version, 3);
    assert_eq!(f.alignment(), g.alignment as u64);
    assert_eq!(f.architecture().unwrap(), "llama");

    // Metadata: same keys in the same order, same types, same value bytes.
    assert_eq!(f.metadata().len(), g.meta_kvs.len());
    for ((key, value), (gkey, gkv)) in f.metadata().iter().zip(&g.meta_kvs) {
        assert_eq!(key, gkey);
        assert_eq!(type_id(value), gkv.ty() as u32, "type of {key}");
        let mut enc = Vec::new();
        encode(value, &mut enc);
        match value {
            MetaValue::Array(items) if items.is_empty() => {
                assert_eq!(&enc[4..], &gkv.value_bytes()[4..], "empty array {key}")
            }
            _ => assert_eq!(enc, gkv.value_bytes(), "value bytes of {key}"),
        }
    }

    // Tensors: same names, order, types, shapes, offsets, sizes and data.
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(g.tensors.len(), 272);
    for (t, (gname, gmeta)) in f.tensors().iter().zip(&g.tensors) {
        let gi = gmeta.to_info();
        assert_eq!(&t.name, gname);
        assert_eq!(t.ggml_type.id(), gi.ty() as u32, "{gname} type");
        assert_eq!(t.dims, gi.shape(), "{gname} dims");
        assert_eq!(t.offset, gi.offset() as u64, "{gname} offset");
        assert_eq!(t.n_bytes, gi.nbytes() as u64, "{gname} n_bytes");
        let ours = f.tensor_data(t);
        assert_eq!(
            ours,
            &g.data[gi.offset()..gi.offset() + gi.nbytes()],
            "{gname} data"
        );
    }

    // HF's parameter count (token_embd is the tied lm_head, so counted once).
    let total: u64 = f.tensors().iter().map(|t| t.n_elements).sum();
    assert_eq!(total, 134_515_008);

    // Types as docs/design.md describes the file.
    let count = |ty| f.tensors().iter().filter(|t| t.ggml_type == ty).count();
    assert_eq!(count(GgmlType::Q4_1), 210);
    assert_eq!(
        f.tensor("token_embd.weight").unwrap().ggml_type,
        GgmlType::Q8_0
    );
    assert_eq!(count(GgmlType::F32), 61);
    assert_eq!(
        f.tensor("token_embd.weight").unwrap().shape_hf(),
        vec![49152, 576]
    );
    assert!(f.tensor("output.weight").is_none());

    // Every name maps to a distinct HF name.
    let hf: HashSet<String> = f
        .tensors()
        .iter()
        .map(|t| gguf_to_hf_name(&t.name).unwrap_or_else(|| panic!("unmapped {}", t.name)))
        .collect();
    assert_eq!(hf.len(), 272);
    assert!(hf.contains("model.layers.29.self_attn.k_proj.weight"));

    // Every tensor dequantizes, to finite values.
    for t in f.tensors() {
        let x = f.tensor_f32(&t.name).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(x.len() as u64, t.n_elements);
        assert!(
            x.iter().all(|v| v.is_finite()),
            "{} has non-finite values",
            t.name
        );
    }
}
