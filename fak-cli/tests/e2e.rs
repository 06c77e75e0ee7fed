//! End to end through the `fak` binary on the real default model, against HF
//! transformers' greedy generation from the same GGUF (`testdata/text/*/e2e.json`, made
//! by `oracle-export/export_text.py`): `fak run --format json` gives HF's prompt ids and
//! completion ids; `fak chat` keeps the cache between turns and answers a follow-up as HF
//! does.

use serde_json::Value;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn fak() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fak"))
}

/// Fails naming the fetch command when the real model is not cached.
fn need_model(name: &str) {
    fak_catalog::require_cached(name).unwrap_or_else(|m| panic!("{m}"));
}

fn e2e() -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/text/smollm2-135m-instruct/e2e.json");
    serde_json::from_str(
        &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[fak_testkit::real_model]
fn run_json_matches_hf_on_chat_prompts() {
    need_model("smollm2-135m-instruct");
    let oracle = e2e();
    let max_new = oracle["max_new_tokens"].as_u64().unwrap().to_string();
    let mut checked = 0;
    for c in oracle["cases"].as_array().unwrap() {
        let msgs = c["messages"].as_array().unwrap();
        if msgs.len() != 1 {
            continue;
        }
        let prompt = msgs[0]["content"].as_str().unwrap();
        let out = fak()
            .args([
                "run",
                "--format",
                "json",
                "--temperature",
                "0",
                "--max-tokens",
                &max_new,
                prompt,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let name = c["name"].as_str().unwrap();
        assert_eq!(
            ids(&v["prompt_ids"]),
            ids(&c["prompt_ids"]),
            "{name}: prompt ids"
        );
        assert_eq!(
            ids(&v["completion_ids"]),
            ids(&c["completion_ids"]),
            "{name}: completion ids"
        );
        assert_eq!(v["text"], c["text"], "{name}: text");
        let want_finish = if c["stopped_on_eos"].as_bool().unwrap() {
            "stop"
        } else {
            "length"
        };
        assert_eq!(v["finish_reason"], want_finish, "{name}");
        for k in ["ttft_ms", "prefill_tokens_per_s", "decode_tokens_per_s"] {
            assert!(
                v["timings"][k].as_f64().unwrap() > 0.0,
                "{name}: timings.{k}"
            );
        }
        checked += 1;
    }
    assert!(checked >= 4, "{checked} single-turn cases");
}

#[fak_testkit::real_model]
fn run_answers_paris() {
    need_model("smollm2-135m-instruct");
    let out = fak()
        .args(["run", "What is the capital of France?"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("Paris"), "{text}");
}

/// A raw prompt that encodes to no tokens (SmolLM2 adds no BOS to a plain completion)
/// is refused in the user's terms, not with the session's internal "prefill a token
/// first".
#[fak_testkit::real_model]
fn run_refuses_an_empty_raw_prompt() {
    need_model("smollm2-135m-instruct");
    let out = fak().args(["run", "--raw", ""]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the prompt encodes to no tokens, so there is nothing to continue from"),
        "{err}"
    );
}

/// Parses a `/stats` line: (reused, prefilled, evicted, cache).
fn stats(line: &str) -> (usize, usize, usize, usize) {
    let num = |key: &str| -> usize {
        let at = line
            .find(key)
            .unwrap_or_else(|| panic!("no '{key}' in {line}"))
            + key.len();
        line[at..]
            .trim_start()
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    (
        num("reused"),
        num("prefilled"),
        num("evicted"),
        num("cache:"),
    )
}

#[fak_testkit::real_model]
fn chat_keeps_the_cache_between_turns() {
    need_model("smollm2-135m-instruct");
    let oracle = e2e();
    let multi = oracle["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "multi_turn")
        .unwrap();
    let mut child = fak()
        .args(["chat", "--max-tokens", "48"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is the capital of France?\n/stats\nAnd what is the capital of Germany?\n/stats\nName three colors.\n/stats\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stat_lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("cache:")).collect();
    assert_eq!(stat_lines.len(), 3, "{stdout}");
    let turns: Vec<(usize, usize, usize, usize)> = stat_lines.iter().map(|l| stats(l)).collect();
    // Turn 1 prefills its whole prompt (HF's 37 ids); later turns reuse the cache and
    // prefill only what the new turn adds.
    assert_eq!(turns[0].0, 0);
    assert_eq!(turns[0].1, ids(&oracle["cases"][0]["prompt_ids"]).len());
    for k in 1..3 {
        assert_eq!(
            turns[k].0,
            turns[k - 1].3,
            "turn {}: reused must be the whole previous cache",
            k + 1
        );
        assert_eq!(turns[k].2, 0, "turn {}: nothing evicted", k + 1);
        assert!(
            turns[k].1 < 20,
            "turn {} prefilled {} tokens",
            k + 1,
            turns[k].1
        );
    }
    // The follow-up answers as HF does given the same history.
    assert!(stdout.contains(multi["text"].as_str().unwrap()), "{stdout}");
}

/// Gemma 3 270M (a base model: raw completion with BOS) through `fak run`: HF's prompt
/// ids and 32 greedy tokens for each committed prompt.
#[fak_testkit::real_model]
fn gemma3_run_matches_hf() {
    need_model("gemma3-270m");
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/text/gemma3-270m/e2e.json");
    let oracle: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let cases = oracle["cases"].as_array().unwrap();
    assert!(cases.len() >= 3);
    for c in cases {
        let n = ids(&c["completion_ids"]).len().to_string();
        let out = fak()
            .args([
                "run",
                "--model",
                "gemma3-270m",
                "--raw",
                "--format",
                "json",
                "--max-tokens",
                &n,
                c["prompt"].as_str().unwrap(),
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let name = c["name"].as_str().unwrap();
        assert_eq!(
            ids(&v["prompt_ids"]),
            ids(&c["prompt_ids"]),
            "{name}: prompt ids"
        );
        assert_eq!(
            ids(&v["completion_ids"]),
            ids(&c["completion_ids"]),
            "{name}: completion ids"
        );
        assert_eq!(v["text"], c["text"], "{name}");
    }
}

/// The Gemma 3 base model continues a few-shot prompt sensibly, and a chat request on it
/// says plainly that the file carries no template (ChatML is used).
#[fak_testkit::real_model]
fn gemma3_few_shot_and_no_template_note() {
    need_model("gemma3-270m");
    let out = fak()
        .args([
            "run",
            "--model",
            "gemma3-270m",
            "--raw",
            "--max-tokens",
            "6",
            "The capital of Japan is Tokyo. The capital of France is",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("Paris"), "{text}");
    let out = fak()
        .args(["run", "--model", "gemma3-270m", "--max-tokens", "2", "Hi"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no chat template") && err.contains("ChatML"),
        "{err}"
    );
}

/// `fak model inspect` names each RoPE base a model's layers use, as HF's config gives
/// them (`testdata/oracles/*/config.json`, saved by `oracle-export`): Gemma 3's
/// sliding-window layers and its full-attention layers have different bases, SmolLM2's
/// layers one.
#[fak_testkit::real_model]
fn model_inspect_names_each_rope_base_as_hf_config() {
    for name in ["gemma3-270m", "smollm2-135m-instruct"] {
        need_model(name);
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../testdata/oracles/{name}/config.json"));
        let hf: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let params = &hf["rope_parameters"];
        // Each layer's base, from its layer type's parameters or the one set of them.
        let bases: Vec<f64> = match hf["layer_types"].as_array() {
            Some(types) if params.get("rope_theta").is_none() => types
                .iter()
                .map(|t| params[t.as_str().unwrap()]["rope_theta"].as_f64().unwrap())
                .collect(),
            _ => vec![
                params["rope_theta"].as_f64().unwrap();
                hf["num_hidden_layers"].as_u64().unwrap() as usize
            ],
        };
        let mut seen: Vec<(f64, usize)> = Vec::new();
        for b in bases {
            match seen.iter_mut().find(|(v, _)| *v == b) {
                Some((_, n)) => *n += 1,
                None => seen.push((b, 1)),
            }
        }
        let want = match seen.as_slice() {
            [(b, _)] => format!("rope_theta {b}  "),
            _ => {
                let parts: Vec<String> = seen
                    .iter()
                    .map(|(b, n)| format!("{b} ({n} layers)"))
                    .collect();
                format!("rope_theta {}  ", parts.join(", "))
            }
        };
        let out = fak().args(["model", "inspect", name]).output().unwrap();
        assert!(out.status.success(), "{name}");
        let text = String::from_utf8(out.stdout).unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with("rope_theta "))
            .unwrap_or_else(|| panic!("{name}: no rope_theta line in\n{text}"));
        assert!(line.starts_with(&want), "{name}: {line:?}, want {want:?}");
    }
}
