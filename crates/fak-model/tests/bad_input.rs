//! Bad input gets a clear, typed error and changes nothing: out-of-range ids, empty
//! prompts, positions that go backwards, context overflow, unknown architectures,
//! unsupported features, missing or misshapen tensors.

mod common;
use common::testdata;
use fak_model::{Config, KvStore, LogitsWanted, Model, ModelError, VecKvCache};
use std::path::Path;

fn tiny() -> Model {
    Model::load(&testdata().join("tiny/llama-tied")).unwrap()
}

#[test]
fn token_id_out_of_range_is_an_error() {
    let m = tiny();
    let mut kv = VecKvCache::new(2, 256);
    let e = m
        .forward(&[1, 256], &[0, 1], &mut kv, LogitsWanted::Last, None)
        .unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::TokenOutOfRange {
                id: 256,
                vocab: 256
            }
        ),
        "{e}"
    );
    assert_eq!(
        kv.len(),
        0,
        "a failed forward must leave the cache unchanged"
    );
}

/// A pass that runs as several batches (`set_prefill_chunk`) is checked as a whole
/// before any batch runs: a bad id or position in its last token leaves the cache as
/// it was.
#[test]
fn a_pass_in_batches_is_refused_before_any_batch_runs() {
    let mut m = tiny();
    m.set_prefill_chunk(1);
    let mut kv = VecKvCache::new(2, 256);
    let e = m
        .forward(
            &[1, 2, 3, 256],
            &[0, 1, 2, 3],
            &mut kv,
            LogitsWanted::All,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(e, ModelError::TokenOutOfRange { id: 256, .. }),
        "{e}"
    );
    assert_eq!(kv.len(), 0, "a batch ran before the last token was refused");
    let e = m
        .forward(
            &[1, 2, 3, 4],
            &[0, 1, 2, 2],
            &mut kv,
            LogitsWanted::All,
            None,
        )
        .unwrap_err();
    assert!(matches!(e, ModelError::InvalidInput(_)), "{e}");
    assert_eq!(
        kv.len(),
        0,
        "a batch ran before the last position was refused"
    );
    let logits = m
        .forward(
            &[1, 2, 3, 4],
            &[0, 1, 2, 3],
            &mut kv,
            LogitsWanted::All,
            None,
        )
        .unwrap();
    assert_eq!((kv.len(), logits.len()), (4, 4 * m.config().vocab_size));
}

#[test]
fn empty_prompt_and_bad_positions_are_errors() {
    let m = tiny();
    let mut kv = VecKvCache::new(2, 256);
    assert!(matches!(
        m.forward(&[], &[], &mut kv, LogitsWanted::Last, None),
        Err(ModelError::InvalidInput(_))
    ));
    assert!(matches!(
        m.forward(&[1, 2], &[0], &mut kv, LogitsWanted::Last, None),
        Err(ModelError::InvalidInput(_))
    ));
    m.forward(&[1, 2], &[0, 1], &mut kv, LogitsWanted::None, None)
        .unwrap();
    let e = m
        .forward(&[3], &[1], &mut kv, LogitsWanted::Last, None)
        .unwrap_err();
    assert!(matches!(e, ModelError::InvalidInput(_)), "{e}");
    assert_eq!(kv.len(), 2);
}

#[test]
fn context_overflow_is_an_error() {
    let m = tiny(); // max_position_embeddings = 256
    let mut kv = VecKvCache::new(2, 10_000);
    let ids = vec![1u32; 257];
    let pos: Vec<u32> = (0..257).collect();
    let e = m
        .forward(&ids, &pos, &mut kv, LogitsWanted::Last, None)
        .unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::ContextOverflow {
                needed: 257,
                limit: 256
            }
        ),
        "{e}"
    );
    let e = fak_model::generate_greedy(&m, &[1; 250], 100, false).unwrap_err();
    assert!(matches!(e, ModelError::ContextOverflow { .. }), "{e}");
    // A cache smaller than the context is a limit too.
    let mut small = VecKvCache::new(2, 4);
    let e = m
        .forward(
            &[1; 5],
            &[0, 1, 2, 3, 4],
            &mut small,
            LogitsWanted::Last,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::ContextOverflow {
                needed: 5,
                limit: 4
            }
        ),
        "{e}"
    );
}

/// Writes the tiny model's config.json with `edit` applied into a temp folder beside a
/// copy of its weights.
fn tiny_with_config(edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    tiny_model_with_config("llama-tied", edit)
}

/// A copy of the tiny model `name` with its `config.json` edited by `edit`.
fn tiny_model_with_config(
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let src = testdata().join("tiny").join(name);
    let dir = tempfile::tempdir().unwrap();
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
    std::fs::copy(
        src.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    dir
}

#[test]
fn unknown_architecture_is_refused() {
    let d = tiny_with_config(|v| v["model_type"] = "mamba".into());
    let e = Model::load(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::UnknownArchitecture(a) if a == "mamba"),
        "{e}"
    );
}

#[test]
fn unsupported_rope_scaling_is_refused() {
    let d = tiny_with_config(|v| {
        v["rope_parameters"] =
            serde_json::json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    });
    let e = Model::load(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::Unsupported(s) if s.contains("yarn")),
        "{e}"
    );
    let d = tiny_with_config(|v| {
        v["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0})
    });
    assert!(matches!(
        Model::load(d.path()),
        Err(ModelError::Unsupported(_))
    ));
}

/// Phi-3's RoPE object: a scaling type other than longrope, a key fak does not know,
/// or longrope without its long factors is refused, never read as plain RoPE.
#[test]
fn phi3_rope_it_does_not_implement_is_refused() {
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, Edit); 3] = [
        ("yarn", |v| {
            v["rope_parameters"]["rope_type"] = "yarn".into()
        }),
        ("mscale", |v| v["rope_parameters"]["mscale"] = 1.0.into()),
        ("long_factor", |v| {
            let r = v["rope_parameters"].as_object_mut().unwrap();
            r.remove("long_factor");
        }),
    ];
    for (named, edit) in edits {
        let d = tiny_model_with_config("phi3", edit);
        let e = Model::load(d.path()).unwrap_err();
        assert!(e.to_string().contains(named), "{named}: {e}");
    }
}

#[test]
fn shape_mismatch_and_bad_config_are_errors() {
    let d = tiny_with_config(|v| v["intermediate_size"] = 128.into());
    let e = Model::load(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::ShapeMismatch { name, .. } if name.contains("gate_proj")),
        "{e}"
    );
    let d = tiny_with_config(|v| v["num_key_value_heads"] = 3.into());
    assert!(matches!(
        Model::load(d.path()),
        Err(ModelError::Config { .. })
    ));
    let d = tiny_with_config(|v| {
        v.as_object_mut().unwrap().remove("hidden_size");
    });
    let e = Model::load(d.path()).unwrap_err();
    assert!(e.to_string().contains("hidden_size"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let d = tiny_with_config(|v| v["num_hidden_layers"] = 3.into());
    let e = Model::load(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::MissingTensor(n) if n.starts_with("model.layers.2.")),
        "{e}"
    );
}

#[test]
fn not_a_model_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    assert!(Model::load(d.path()).is_err());
    assert!(Model::load(Path::new("/nonexistent/model.gguf")).is_err());
    let f = d.path().join("x.gguf");
    std::fs::write(&f, b"not a gguf file at all").unwrap();
    assert!(matches!(Model::load(&f), Err(ModelError::Gguf(_))));
    let _ = Config::from_hf_json(&d.path().join("config.json")).unwrap_err();
}

#[test]
fn features_fak_does_not_implement_are_refused_not_ignored() {
    for (key, val) in [
        ("attention_bias", serde_json::json!(true)),
        ("mlp_bias", serde_json::json!(true)),
        ("partial_rotary_factor", serde_json::json!(0.5)),
        ("rope_scaling", serde_json::json!({"factor": 8.0})),
        ("rope_scaling", serde_json::json!("linear")),
        ("rope_scaling", serde_json::json!(true)),
        ("rope_parameters", serde_json::json!("default")),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}),
        ),
        ("hidden_act", serde_json::json!("gelu")),
        ("hidden_act", serde_json::json!(5)),
        ("num_local_experts", serde_json::json!(8)),
    ] {
        let d = tiny_with_config(|v| v[key] = val.clone());
        let e = Model::load(d.path()).unwrap_err();
        assert!(matches!(e, ModelError::Unsupported(_)), "{key}={val}: {e}");
    }
    // A zero expert count means no experts.
    let d = tiny_with_config(|v| v["num_local_experts"] = 0.into());
    Model::load(d.path()).unwrap();
}

#[test]
fn mistyped_and_out_of_range_values_are_errors() {
    for (key, val) in [
        ("tie_word_embeddings", serde_json::json!("true")),
        ("attention_bias", serde_json::json!("true")),
        ("eos_token_id", serde_json::json!(4294967337u64)),
        ("eos_token_id", serde_json::json!([2, 4294967337u64])),
        ("eos_token_id", serde_json::json!(300)),
        ("bos_token_id", serde_json::json!(256)),
        ("num_hidden_layers", serde_json::json!(1u64 << 40)),
        ("num_hidden_layers", serde_json::json!(0)),
    ] {
        let d = tiny_with_config(|v| v[key] = val.clone());
        let e = Model::load(d.path()).unwrap_err();
        assert!(matches!(e, ModelError::Config { .. }), "{key}={val}: {e}");
    }
}

#[test]
fn unused_and_duplicate_tensors_are_errors() {
    // One layer fewer in the config: layer 1's tensors would be ignored.
    let d = tiny_with_config(|v| v["num_hidden_layers"] = 1.into());
    let e = Model::load(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::Unsupported(m) if m.contains("model.layers.1.")),
        "{e}"
    );
    // A second shard holding a tensor the first already has.
    let d = tiny_with_config(|_| {});
    let zeros = vec![0u8; 64 * 4];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![64], &zeros).unwrap();
    safetensors::serialize_to_file(
        [("model.norm.weight", view)],
        None,
        &d.path().join("zz.safetensors"),
    )
    .unwrap();
    let e = Model::load(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::Unsupported(m) if m.contains("appears in both")),
        "{e}"
    );
    // A bias tensor the architecture does not use.
    let d = tiny_with_config(|_| {});
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![64], &zeros).unwrap();
    safetensors::serialize_to_file(
        [("model.layers.0.self_attn.q_proj.bias", view)],
        None,
        &d.path().join("zz.safetensors"),
    )
    .unwrap();
    let e = Model::load(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::Unsupported(m) if m.contains("q_proj.bias")),
        "{e}"
    );
}

#[test]
fn special_files_are_not_models() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("p.gguf");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success(), "mkfifo failed");
    assert!(matches!(
        Model::load(&fifo),
        Err(ModelError::UnknownFormat(_))
    ));
    let st = testdata().join("tiny/llama-tied/model.safetensors");
    assert!(matches!(Model::load(&st), Err(ModelError::InvalidInput(_))));
}

/// `testdata/tiny-gguf/llama-tied.f32.gguf` with the `u32` value of metadata key `key`
/// (an exact key, found with its length prefix) set to `value`, in a temporary folder.
fn tiny_gguf_with_u32(key: &str, value: u32) -> (tempfile::TempDir, std::path::PathBuf) {
    let mut bytes = std::fs::read(testdata().join("tiny-gguf/llama-tied.f32.gguf")).unwrap();
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(key.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .unwrap_or_else(|| panic!("no key {key} in the fixture"));
    let ty = at + needle.len();
    assert_eq!(bytes[ty..ty + 4], 4u32.to_le_bytes(), "{key} is not a u32");
    bytes[ty + 4..ty + 8].copy_from_slice(&value.to_le_bytes());
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("patched.gguf");
    std::fs::write(&path, bytes).unwrap();
    (d, path)
}

#[test]
fn impossible_gguf_widths_and_head_counts_are_named() {
    // A zero or huge head count or width is reported as out of range, not as the RoPE
    // mismatch that the head_dim derived from it would otherwise produce.
    for (key, value, named) in [
        (
            "llama.attention.head_count",
            0,
            "num_attention_heads = 0 is out of range",
        ),
        (
            "llama.attention.head_count",
            u32::MAX,
            "num_attention_heads = 4294967295 is out of range",
        ),
        (
            "llama.embedding_length",
            0,
            "hidden_size = 0 is out of range",
        ),
        (
            "llama.embedding_length",
            u32::MAX,
            "hidden_size = 4294967295 is out of range",
        ),
    ] {
        let (_d, path) = tiny_gguf_with_u32(key, value);
        let e = Model::load(&path).unwrap_err();
        assert!(
            matches!(e, ModelError::Config { .. }) && e.to_string().contains(named),
            "{key}={value}: {e}"
        );
    }
}

#[test]
fn a_folder_without_config_json_is_named_as_such() {
    // An empty folder is not a model; a folder holding a GGUF file names the file.
    let d = tempfile::tempdir().unwrap();
    let e = Model::load(d.path()).unwrap_err();
    assert!(matches!(e, ModelError::UnknownFormat(_)), "{e}");
    std::fs::copy(
        testdata().join("tiny-gguf/llama-tied.f32.gguf"),
        d.path().join("m.gguf"),
    )
    .unwrap();
    let e = Model::load(d.path()).unwrap_err().to_string();
    assert!(
        e.contains("without config.json") && e.contains("m.gguf"),
        "{e}"
    );
}
