//! `fak bench` through the binary on the committed tiny Llama (safetensors, no
//! download), and `fak run --prompt-ids --weights` on the real default model. The
//! figures themselves are machine-dependent; these tests check that they are reported
//! and sane.

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

fn fak() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fak"))
}

fn tiny() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/tiny/llama-tied")
        .display()
        .to_string()
}

fn json_of(args: &[&str]) -> Value {
    let out = fak().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "fak {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn bench_reports_every_figure() {
    let m = tiny();
    for weights in ["exact", "native"] {
        let v = json_of(&[
            "bench",
            "--model",
            &m,
            "--threads",
            "2",
            "--prompt-tokens",
            "16",
            "--gen-tokens",
            "4",
            "--repeats",
            "4",
            "--weights",
            weights,
            "--format",
            "json",
        ]);
        assert_eq!(v["weights"], weights);
        assert_eq!(v["threads"], 2);
        assert_eq!(v["prompt_tokens"], 16);
        assert_eq!(v["samples"].as_array().unwrap().len(), 4);
        for k in ["prefill_tokens_per_s", "decode_tokens_per_s", "ttft_ms"] {
            let x = v[k].as_f64().unwrap_or_else(|| panic!("{k} missing"));
            assert!(x.is_finite() && x > 0.0, "{k} = {x}");
        }
        // The prefill rate is the prompt over the TTFT, an even repeat count included.
        let (tps, ttft) = (
            v["prefill_tokens_per_s"].as_f64().unwrap(),
            v["ttft_ms"].as_f64().unwrap(),
        );
        let rel = (tps * ttft / 1e3 / 16.0 - 1.0).abs();
        assert!(rel < 1e-9, "prefill {tps} tokens/s against TTFT {ttft} ms");
        let rss = v["peak_rss_mb"].as_f64().unwrap();
        assert!(rss > 1.0 && rss < 100_000.0, "peak RSS {rss} MB");
        // 3 (K, K before RoPE, V) × layers × kv_dim × 4 bytes + a 4-byte position.
        assert!(v["kv_bytes_per_token"].as_u64().unwrap() > 4);
    }
}

#[test]
fn bench_reports_the_threads_it_used() {
    // A request beyond twice the cores runs on twice the cores, and says so.
    let m = tiny();
    let v = json_of(&[
        "bench",
        "--model",
        &m,
        "--threads",
        "1000",
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        "1",
        "--repeats",
        "1",
        "--format",
        "json",
    ]);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(v["threads"].as_u64(), Some((2 * cores).min(1000) as u64));
}

/// The same figures on the real default model in native mode, where the quantized
/// kernels run (the tiny model is f32, so native mode there is the exact path).
#[fak_testkit::real_model]
fn bench_reports_every_figure_on_the_real_model_native() {
    let path =
        fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"));
    let v = json_of(&[
        "bench",
        "--model",
        &path.display().to_string(),
        "--threads",
        "1",
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "4",
        "--repeats",
        "1",
        "--weights",
        "native",
        "--format",
        "json",
    ]);
    assert_eq!(v["weights"], "native");
    assert_eq!(v["threads"], 1);
    assert!(
        v["weight_format"].as_str().unwrap().contains("Q4_1×210"),
        "{}",
        v["weight_format"]
    );
    for k in [
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "ttft_ms",
        "peak_rss_mb",
    ] {
        let x = v[k].as_f64().unwrap_or_else(|| panic!("{k} missing"));
        assert!(x.is_finite() && x > 0.0, "{k} = {x}");
    }
}

/// `--context`: the context is prefilled once and each repeat decodes after it, on the
/// real default model (its native quantized kernels, as `scripts/bench-context` runs).
#[fak_testkit::real_model]
fn bench_context_decodes_after_a_context_prefilled_once() {
    let path =
        fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"));
    let v = json_of(&[
        "bench",
        "--model",
        &path.display().to_string(),
        "--context",
        "64",
        "--gen-tokens",
        "4",
        "--repeats",
        "1",
        "--format",
        "json",
    ]);
    assert_eq!(v["context_tokens"], 64, "{v}");
    assert_eq!(v["prompt_tokens"], 64, "{v}");
    assert_eq!(v["gen_tokens"], 4, "{v}");
    let decode = v["decode_tokens_per_s"].as_f64().unwrap();
    assert!(
        decode.is_finite() && decode > 0.0,
        "decode {decode} tokens/s"
    );
    assert!(v["kv_bytes_per_token"].as_u64().unwrap() > 4, "{v}");
    let samples = v["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 1, "{v}");
    // The prefill figure is the one prefill of the context.
    let (tps, ttft) = (
        v["prefill_tokens_per_s"].as_f64().unwrap(),
        v["ttft_ms"].as_f64().unwrap(),
    );
    assert!((tps * ttft / 1e3 / 64.0 - 1.0).abs() < 1e-9, "{v}");
}

/// A plain bench reports no `context_tokens`.
#[test]
fn bench_without_context_reports_no_context_tokens() {
    let v = json_of(&[
        "bench",
        "--model",
        &tiny(),
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        "1",
        "--repeats",
        "1",
        "--format",
        "json",
    ]);
    assert!(v.get("context_tokens").is_none(), "{v}");
    assert_eq!(v["prompt_tokens"], 4);
}

/// `--context` every repeat decodes after, on the tiny model: several repeats, each
/// starting from the same context (a rollback that failed would overflow the cache,
/// whose room is the context plus one repeat's tokens).
#[test]
fn bench_context_repeats_from_the_same_context() {
    let v = json_of(&[
        "bench",
        "--model",
        &tiny(),
        "--context",
        "200",
        "--gen-tokens",
        "56",
        "--repeats",
        "3",
        "--format",
        "json",
    ]);
    assert_eq!(v["context_tokens"], 200);
    let samples = v["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 3);
    // One prefill, shared: every sample carries the same prefill time.
    assert!(samples
        .iter()
        .all(|s| s["prefill_s"] == samples[0]["prefill_s"]));
    assert!(v["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
}

/// `--concurrency` runs each level once: `--repeats` with it is refused, not ignored.
#[test]
fn bench_concurrency_refuses_repeats() {
    let out = fak()
        .args(["bench", "--model", &tiny(), "--concurrency", "1,2"])
        .args(["--repeats", "3"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--repeats")
            && err.contains("--concurrency")
            && err.contains("cannot be used"),
        "{err}"
    );
}

/// `--context` excludes `--prompt-tokens` and `--concurrency`, and must fit the model's
/// context with its decode steps.
#[test]
fn bench_context_refuses_a_prompt_length_and_an_overflow() {
    let m = tiny();
    for other in [["--prompt-tokens", "8"], ["--concurrency", "1,2"]] {
        let out = fak()
            .args(["bench", "--model", &m, "--context", "8"])
            .args(other)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{other:?}: {err}");
        assert!(
            err.contains("--context") && err.contains(other[0]) && err.contains("cannot be used"),
            "{other:?}: {err}"
        );
    }
    // The tiny model's context is 256 tokens.
    let out = fak()
        .args([
            "bench",
            "--model",
            &m,
            "--context",
            "250",
            "--gen-tokens",
            "7",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("250 context + 7 generated tokens exceed the context length 256"),
        "{err}"
    );
    let out = fak()
        .args(["bench", "--model", &m, "--context", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--context, --gen-tokens and --repeats must be at least 1"),
        "{err}"
    );
}

#[test]
fn bench_refuses_a_prompt_past_the_context() {
    let out = fak()
        .args(["bench", "--model", &tiny(), "--prompt-tokens", "100000000"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("context length"));
}

#[fak_testkit::real_model]
fn run_takes_prompt_ids_and_a_weight_mode() {
    // `fak run` needs a tokenizer, which the tiny model lacks: the real default model.
    let path =
        fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"));
    let m = path.display().to_string();
    for weights in ["exact", "native"] {
        let v = json_of(&[
            "run",
            "--model",
            &m,
            "--prompt-ids",
            "504, 3575,282",
            "--max-tokens",
            "3",
            "--ignore-eos",
            "--weights",
            weights,
            "--format",
            "json",
        ]);
        assert_eq!(v["prompt_ids"], serde_json::json!([504, 3575, 282]));
        assert_eq!(v["weights"], weights);
        assert_eq!(v["completion_ids"].as_array().unwrap().len(), 3);
    }
}

#[fak_testkit::real_model]
fn run_without_a_first_token_or_a_decode_step_reports_no_such_figure() {
    // `--max-tokens 0`: a prefill but no token, so no TTFT and no decode rate;
    // `--max-tokens 1`: a TTFT but no decode step. Null, not a 0 that reads as measured.
    let path =
        fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"));
    let m = path.display().to_string();
    for (max, ttft, decode) in [("0", false, false), ("1", true, false), ("3", true, true)] {
        let v = json_of(&[
            "run",
            "--model",
            &m,
            "--prompt-ids",
            "504,3575,282",
            "--max-tokens",
            max,
            "--ignore-eos",
            "--format",
            "json",
        ]);
        let t = &v["timings"];
        assert!(
            t["prefill_tokens_per_s"].as_f64().unwrap() > 0.0,
            "{max}: {t}"
        );
        assert_eq!(
            t["ttft_ms"].as_f64().is_some_and(|x| x > 0.0),
            ttft,
            "{max}: {t}"
        );
        assert_eq!(t["ttft_ms"].is_null(), !ttft, "{max}: {t}");
        let d = &t["decode_tokens_per_s"];
        assert_eq!(d.as_f64().is_some_and(|x| x > 0.0), decode, "{max}: {t}");
        assert_eq!(d.is_null(), !decode, "{max}: {t}");
    }
}

#[test]
fn bench_refuses_zero_decode_steps() {
    let out = fak()
        .args(["bench", "--model", &tiny(), "--gen-tokens", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--gen-tokens"), "{err}");
}

/// A repeat count past the limit is refused before anything is loaded or allocated (a
/// count near `usize::MAX` used to abort on the samples' allocation).
#[test]
fn bench_refuses_too_many_repeats() {
    let max = u64::MAX.to_string();
    for r in ["10001", "4000000000000", max.as_str()] {
        let out = fak()
            .args(["bench", "--model", &tiny(), "--repeats", r])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{r}: {err}");
        assert!(
            err.contains(&format!("--repeats {r} is more than 10000")),
            "{r}: {err}"
        );
    }
}

/// Token counts whose sum overflows are refused as over the context, with the counts
/// as given, not wrapped into a small sum (a panic on allocation) or a wrong limit.
#[test]
fn bench_refuses_token_counts_whose_sum_overflows() {
    let max = u64::MAX.to_string();
    for (p, g) in [
        (max.as_str(), "1"),
        ("100", max.as_str()),
        ("1", max.as_str()),
    ] {
        let out = fak()
            .args([
                "bench",
                "--model",
                &tiny(),
                "--prompt-tokens",
                p,
                "--gen-tokens",
                g,
            ])
            .args(["--repeats", "1"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{p} + {g}: {err}");
        assert!(
            err.contains(&format!(
                "{p} prompt + {g} generated tokens exceed the context length 256"
            )),
            "{p} + {g}: {err}"
        );
    }
}

/// A negative number after a sampling flag is read as its value (and refused by the
/// sampler with a clear message), not taken for an unknown flag.
#[test]
fn run_reads_a_negative_temperature_as_its_value() {
    let out = fak()
        .args([
            "run",
            "--model",
            &tiny(),
            "--temperature",
            "-1",
            "--prompt-ids",
            "1,2,3",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("temperature -1 must be"), "{err}");
}

/// `--profile`: the extra repeat's split of each phase adds up to its wall time, every
/// step of the pass is counted as often as the pass runs it (the tiny Llama's layers
/// once each per pass; the head once per pass), and the timed figures are still there.
#[test]
fn bench_profile_splits_each_phase_into_the_steps_of_the_pass() {
    let m = tiny();
    let v = json_of(&[
        "bench",
        "--model",
        &m,
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "4",
        "--repeats",
        "1",
        "--profile",
        "--format",
        "json",
    ]);
    let layers = {
        let cfg: Value =
            serde_json::from_slice(&std::fs::read(PathBuf::from(&m).join("config.json")).unwrap())
                .unwrap();
        cfg["num_hidden_layers"].as_u64().unwrap()
    };
    assert!(v["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    for (phase, passes) in [("prefill", 1u64), ("decode", 4)] {
        let p = &v["profile"][phase];
        assert_eq!(p["passes"], passes, "{phase}");
        let ops = p["ops"].as_array().unwrap();
        let names: Vec<&str> = ops.iter().map(|o| o["op"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "embedding",
                "rms_norm",
                "qkv_proj",
                "rope",
                "kv_append",
                "attention",
                "o_proj",
                "gate_up_proj",
                "activation",
                "down_proj",
                "lm_head"
            ]
        );
        let calls = |name: &str| {
            ops.iter().find(|o| o["op"] == name).unwrap()["calls"]
                .as_u64()
                .unwrap()
        };
        for name in [
            "qkv_proj",
            "attention",
            "o_proj",
            "gate_up_proj",
            "down_proj",
        ] {
            assert_eq!(calls(name), passes * layers, "{phase} {name}");
        }
        assert_eq!(calls("lm_head"), passes, "{phase}");
        assert_eq!(calls("rms_norm"), passes * (2 * layers + 1), "{phase}");
        let sum: f64 = ops.iter().map(|o| o["ms"].as_f64().unwrap()).sum::<f64>()
            + p["sampling_ms"].as_f64().unwrap()
            + p["other_ms"].as_f64().unwrap();
        let wall = p["wall_ms"].as_f64().unwrap();
        assert!(
            wall > 0.0 && (sum - wall).abs() <= 1e-6 * wall.max(1.0),
            "{phase}: {sum} vs {wall}"
        );
    }
}

/// `--concurrency` prints one JSON object per level, with the keys scripts read, and
/// its streams did run batched (a pass held every stream of a level at least once).
#[test]
fn bench_concurrency_reports_each_level_batched() {
    let m = tiny();
    let args = [
        "bench",
        "--model",
        &m,
        "--threads",
        "2",
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "24",
        "--concurrency",
        "1,4",
        "--format",
        "json",
    ];
    let out = fak().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let levels: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(levels.len(), 2);
    for (v, n) in levels.iter().zip([1u64, 4]) {
        assert_eq!(v["concurrency"], n);
        for k in [
            "aggregate_decode_tokens_per_s",
            "per_stream_decode_tokens_per_s",
            "ttft_ms_p50",
            "itl_ms_p50",
            "itl_ms_p99",
        ] {
            let x = v[k].as_f64().unwrap_or_else(|| panic!("{k} missing"));
            assert!(x.is_finite() && x > 0.0, "{k} = {x}");
        }
        assert_eq!(v["max_batch"], n, "{v}");
        assert!(v["itl_ms_p99"].as_f64() >= v["itl_ms_p50"].as_f64());
        // The rate while all streams decode: one stream's is its whole decode, the
        // aggregate; with more, a positive rate or null (no window), never missing.
        let all = &v["all_decoding_tokens_per_s"];
        if n == 1 {
            assert_eq!(all, &v["aggregate_decode_tokens_per_s"], "{v}");
        } else {
            assert!(
                all.is_null() || all.as_f64().is_some_and(|x| x > 0.0),
                "{v}"
            );
        }
    }
}

/// `--kv-type`: the decode after a context runs on each cache type, and the report names
/// the type and its bytes per token, from the model's HF config (2 layers, 2 KV heads of
/// 16): K, K before RoPE and V in f32; K before RoPE and V in binary16; or in Q8_0
/// blocks of 34 bytes per 32 values. Each adds the entry's 4-byte position.
#[test]
fn bench_context_on_each_kv_type_reports_its_bytes_per_token() {
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(PathBuf::from(tiny()).join("config.json")).unwrap(),
    )
    .unwrap();
    let layers = cfg["num_hidden_layers"].as_u64().unwrap();
    let kv_dim = cfg["num_key_value_heads"].as_u64().unwrap() * cfg["head_dim"].as_u64().unwrap();
    for (ty, row_bytes, arrays) in [
        ("f32", 4 * kv_dim, 3),
        ("f16", 2 * kv_dim, 2),
        ("q8_0", kv_dim / 32 * 34, 2),
    ] {
        let v = json_of(&[
            "bench",
            "--model",
            &tiny(),
            "--context",
            "100",
            "--gen-tokens",
            "20",
            "--repeats",
            "2",
            "--kv-type",
            ty,
            "--format",
            "json",
        ]);
        assert_eq!(v["kv_type"], ty, "{v}");
        assert_eq!(
            v["kv_bytes_per_token"].as_u64().unwrap(),
            arrays * layers * row_bytes + 4,
            "{ty}: {v}"
        );
        assert!(
            v["decode_tokens_per_s"].as_f64().unwrap() > 0.0,
            "{ty}: {v}"
        );
    }
}
