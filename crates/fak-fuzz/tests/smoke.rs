//! The `fak-fuzz` binary as CI runs it, for a second per target: it starts every target,
//! runs inputs, reports `0 crashes` for each and exits 0. (Building this test is also
//! what makes `cargo test --workspace` build the binary that `scripts/fuzz` runs, with
//! the same features, so CI's fuzz step compiles nothing more.)

use std::process::Command;

/// Runs `fak-fuzz --secs 1` on `targets`; returns its stdout after checking its exit
/// status and each target's report line.
fn fuzz(targets: &[&str]) -> String {
    let dir = std::env::temp_dir().join(format!("fak-fuzz-smoke-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_fak-fuzz"))
        .args(["--secs", "1", "--out"])
        .arg(&dir)
        .args(targets)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for t in targets {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("fak-fuzz {t}: ")))
            .unwrap_or_else(|| panic!("no report for {t}:\n{stdout}\n{stderr}"));
        assert!(line.ends_with(" 0 crashes"), "{line}");
        let inputs: u64 = line
            .split_whitespace()
            .nth(2)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        assert!(inputs > 10, "{line}");
    }
    assert!(
        stdout.contains(&format!("fuzz: {} passed, 0 failed", targets.len())),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    stdout
}

#[test]
fn the_file_and_gateway_targets_run_without_a_crash() {
    fuzz(&["gguf", "safetensors", "gateway"]);
}

#[fak_testkit::real_model]
fn the_tokenizer_chat_and_template_targets_run_without_a_crash() {
    fuzz(&["tokenizer", "chat", "template"]);
}

#[test]
fn an_unknown_target_fails_naming_the_targets() {
    let out = Command::new(env!("CARGO_BIN_EXE_fak-fuzz"))
        .args(["--secs", "1", "nope"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unknown fuzz target 'nope'"), "{stderr}");
    assert!(
        stderr.contains("gguf, safetensors, tokenizer, chat, template, gateway"),
        "{stderr}"
    );
}
