//! `fak model inspect`: what a checkpoint holds, whether or not fak can run it.

use crate::{fail, outln, CliError, Format};
use fak_model::WeightSource;
use fak_weights::{GgufFile, MetaValue};
use serde::Serialize;
use serde_json::{Map, Value};

/// `fak model inspect --format json`: one object, keys in this order.
#[derive(Serialize)]
struct InspectReport<'a> {
    path: &'a std::path::Path,
    architecture: &'a str,
    runnable: bool,
    not_runnable_because: Option<&'a String>,
    config: &'a Option<fak_model::Config>,
    /// Each metadata key's value ([`meta_json`]).
    metadata: Map<String, Value>,
    tensors: Vec<TensorRow<'a>>,
    n_tensors: usize,
    n_params: u64,
}

/// One tensor of [`InspectReport`]: its HF name (or the file's), the file's name, its
/// type and its shape in HF's order.
#[derive(Serialize)]
struct TensorRow<'a> {
    name: &'a str,
    file_name: &'a str,
    dtype: &'a str,
    shape: &'a [usize],
}

/// A metadata array of more than 64 items: its length and its first 8.
#[derive(Serialize)]
struct CutArray {
    length: usize,
    first: Vec<Value>,
}

/// A metadata value as JSON (arrays longer than 64 items are cut, with their length).
fn meta_json(v: &MetaValue) -> Value {
    match v {
        MetaValue::U8(x) => Value::from(*x),
        MetaValue::I8(x) => Value::from(*x),
        MetaValue::U16(x) => Value::from(*x),
        MetaValue::I16(x) => Value::from(*x),
        MetaValue::U32(x) => Value::from(*x),
        MetaValue::I32(x) => Value::from(*x),
        MetaValue::U64(x) => Value::from(*x),
        MetaValue::I64(x) => Value::from(*x),
        MetaValue::F32(x) => Value::from(*x),
        MetaValue::F64(x) => Value::from(*x),
        MetaValue::Bool(x) => Value::from(*x),
        MetaValue::String(s) => Value::from(s.as_str()),
        MetaValue::Array(a) if a.len() > 64 => {
            let cut = CutArray {
                length: a.len(),
                first: a.iter().take(8).map(meta_json).collect(),
            };
            serde_json::to_value(cut).unwrap_or(Value::Null)
        }
        MetaValue::Array(a) => Value::Array(a.iter().map(meta_json).collect()),
    }
}

/// A metadata value in one line, long arrays and strings cut to `max` characters.
fn summarize(v: &MetaValue, max: usize) -> String {
    let s = match v {
        MetaValue::Array(a) => {
            let head: Vec<String> = a.iter().take(8).map(|x| summarize(x, 24)).collect();
            format!(
                "[{} items: {}{}]",
                a.len(),
                head.join(", "),
                if a.len() > 8 { ", ..." } else { "" }
            )
        }
        other => meta_json(other).to_string(),
    };
    if s.chars().count() > max {
        let cut: String = s.chars().take(max).collect();
        format!("{cut}...")
    } else {
        s
    }
}

pub(crate) fn inspect(model: &str, format: Format) -> Result<(), CliError> {
    let path = fak_catalog::resolve(model)?;
    if path.is_dir() && !path.join("config.json").is_file() {
        return Err(fail(format!(
            "{} is a folder without config.json; give a .gguf file or a safetensors model folder",
            path.display()
        )));
    }
    // Whether fak can run it, and its HF-named tensor table if so.
    let opened = WeightSource::open(&path);
    let gguf = if path.is_file() {
        Some(GgufFile::open(&path)?)
    } else {
        None
    };
    let (runnable, config, entries) = match &opened {
        Ok((src, cfg)) => (Ok(()), Some(cfg.clone()), Some(src.entries())),
        Err(e) => (Err(e.to_string()), None, None),
    };
    if gguf.is_none() {
        if let Err(e) = &runnable {
            return Err(fail(e.clone()));
        }
    }
    // The tensor table: HF names when fak can map them, else the file's own.
    let rows: Vec<(String, String, String, Vec<usize>)> = match (&entries, &gguf) {
        (Some(es), _) => es
            .iter()
            .map(|e| {
                (
                    e.name.clone(),
                    e.file_name.clone(),
                    e.dtype.clone(),
                    e.shape.clone(),
                )
            })
            .collect(),
        (None, Some(g)) => g
            .tensors()
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.name.clone(),
                    t.ggml_type.name().to_string(),
                    t.shape_hf(),
                )
            })
            .collect(),
        (None, None) => Vec::new(),
    };
    let n_params: u64 = rows
        .iter()
        .map(|r| r.3.iter().product::<usize>() as u64)
        .sum();
    let architecture = match (&config, &gguf) {
        (Some(c), _) => c.family.name().to_string(),
        (None, Some(g)) => g
            .architecture()
            .map(str::to_string)
            .unwrap_or_else(|_| "?".into()),
        _ => "?".into(),
    };
    let metadata: Vec<(String, &MetaValue)> = gguf
        .as_ref()
        .map(|g| g.metadata().iter().map(|(k, v)| (k.clone(), v)).collect())
        .unwrap_or_default();

    if format == Format::Json {
        let v = InspectReport {
            path: &path,
            architecture: &architecture,
            runnable: runnable.is_ok(),
            not_runnable_because: runnable.as_ref().err(),
            config: &config,
            metadata: metadata
                .iter()
                .map(|(k, v)| (k.clone(), meta_json(v)))
                .collect(),
            tensors: rows
                .iter()
                .map(|(n, f, d, s)| TensorRow {
                    name: n,
                    file_name: f,
                    dtype: d,
                    shape: s,
                })
                .collect(),
            n_tensors: rows.len(),
            n_params,
        };
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    outln!("path:          {}", path.display())?;
    outln!("architecture:  {architecture}")?;
    match (&config, &runnable) {
        (Some(c), _) => {
            outln!(
                "layers {}  hidden {}  ffn {}  heads {}/{} (q/kv)  head_dim {}  vocab {}  context {}",
                c.num_hidden_layers,
                c.hidden_size,
                c.intermediate_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.vocab_size,
                c.max_position_embeddings
            )?;
            let id = |x: Option<u32>| x.map_or("none".to_string(), |i| i.to_string());
            let eos: Vec<String> = c.eos_token_ids.iter().map(u32::to_string).collect();
            outln!(
                "rope_theta {}  rms_norm_eps {:e}  tied head {}  bos {}  eos {}",
                rope_bases(&c.rope_theta),
                c.rms_norm_eps,
                if c.tie_word_embeddings { "yes" } else { "no" },
                id(c.bos_token_id),
                if eos.is_empty() {
                    "none".into()
                } else {
                    eos.join(",")
                }
            )?;
        }
        (None, Err(e)) => outln!("fak cannot run this model: {e}")?,
        (None, Ok(())) => {}
    }
    if !metadata.is_empty() {
        outln!("\nmetadata ({} keys):", metadata.len())?;
        for (k, v) in &metadata {
            outln!("  {k:<44} {}", summarize(v, 80))?;
        }
    }
    outln!("\ntensors ({}):", rows.len())?;
    for (name, _, dtype, shape) in &rows {
        outln!("  {name:<52} {dtype:<6} {shape:?}")?;
    }
    outln!("\nparameters: {n_params}")?;
    Ok(())
}

/// The per-layer RoPE bases (`Config::rope_theta`) as text: the one value when every
/// layer has it, else each distinct value with how many layers use it, in the order
/// first seen (Gemma 3 270M: `10000 (15 layers), 1000000 (3 layers)`, HF's
/// `rope_parameters` of its sliding-window and its full-attention layers).
fn rope_bases(thetas: &[f32]) -> String {
    let mut seen: Vec<(f32, usize)> = Vec::new();
    for &t in thetas {
        match seen.iter_mut().find(|(v, _)| *v == t) {
            Some((_, n)) => *n += 1,
            None => seen.push((t, 1)),
        }
    }
    match seen.as_slice() {
        [] => "none".into(),
        [(t, _)] => t.to_string(),
        _ => seen
            .iter()
            .map(|(t, n)| format!("{t} ({n} layers)"))
            .collect::<Vec<_>>()
            .join(", "),
    }
}
