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
    let src = testdata().join("tiny/llama-tied");
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
