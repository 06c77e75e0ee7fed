//! `fak chat --session FILE` through the `fak` binary on the real default model
//! (SmolLM2-135M-Instruct, greedy): a conversation split over two runs answers as one
//! uninterrupted run does, the second run says it resumed and reuses the whole saved
//! cache; a file of the other weight mode, a damaged one, and `--system` against a
//! file's other system message are refused with a non-zero exit, the file untouched.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn fak() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fak"))
}

/// Fails naming the fetch command when the real model is not cached.
fn need_model(name: &str) {
    fak_catalog::require_cached(name).unwrap_or_else(|m| panic!("{m}"));
}

/// `fak chat --max-tokens 48 ARGS...` with `input` on stdin.
fn chat(args: &[&str], input: &str) -> Output {
    let mut child = fak()
        .args(["chat", "--max-tokens", "48"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8(b.to_vec()).unwrap()
}

fn ok(out: &Output) -> (String, String) {
    assert!(out.status.success(), "{}", text(&out.stderr));
    (text(&out.stdout), text(&out.stderr))
}

/// A fresh folder for this test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fak-chat-session-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The number after `key` in a `/stats` line.
fn stat(line: &str, key: &str) -> usize {
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
}

/// The stdout lines that are not `/stats` lines (the replies).
fn replies(stdout: &str) -> String {
    stdout
        .lines()
        .filter(|l| !l.starts_with("cache:"))
        .map(|l| format!("{l}\n"))
        .collect()
}

const Q1: &str = "What is the capital of France?";
const Q2: &str = "And what is the capital of Germany?";

#[fak_testkit::real_model]
fn chat_session_resumes_across_runs_as_one_run() {
    need_model("smollm2-135m-instruct");
    let dir = scratch("resume");
    let file = dir.join("talk.fakkv");
    let f = file.to_str().unwrap();
    let (whole, _) = ok(&chat(&[], &format!("{Q1}\n{Q2}\n")));

    // First run: no file yet, so a new conversation, saved after the turn.
    let (first, err) = ok(&chat(&["--session", f], &format!("{Q1}\n/stats\n")));
    assert!(!err.contains("resumed"), "{err}");
    assert!(file.is_file());
    let cache1 = stat(
        first.lines().find(|l| l.starts_with("cache:")).unwrap(),
        "cache:",
    );
    assert!(cache1 > 0);

    // Second run: resumed, the whole saved cache reused, the reply the one-run reply.
    let (second, err) = ok(&chat(&["--session", f], &format!("{Q2}\n/stats\n")));
    assert!(
        err.contains(&format!(
            "resumed 2 messages, {cache1} tokens cached from {f}"
        )),
        "{err}"
    );
    let line = second.lines().find(|l| l.starts_with("cache:")).unwrap();
    assert_eq!(stat(line, "reused"), cache1, "{line}");
    assert_eq!(stat(line, "evicted"), 0, "{line}");
    assert!(stat(line, "prefilled") < 30, "{line}");
    assert_eq!(replies(&first) + &replies(&second), whole);
    assert!(whole.contains("Berlin"), "{whole}");

    // A third run sees both turns.
    let (_, err) = ok(&chat(&["--session", f], "/quit\n"));
    assert!(err.contains("resumed 4 messages"), "{err}");

    // /reset empties the file's conversation.
    let (_, _) = ok(&chat(&["--session", f], "/reset\n"));
    let (_, err) = ok(&chat(&["--session", f], "/quit\n"));
    assert!(err.contains("resumed 0 messages, 0 tokens cached"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn refused(args: &[&str], file: &Path, why: &str) {
    let before = std::fs::read(file).unwrap();
    let out = chat(args, &format!("{Q2}\n"));
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        out.stdout.is_empty(),
        "no conversation starts: {}",
        text(&out.stdout)
    );
    assert!(err.contains(&file.display().to_string()), "{err}");
    assert!(err.contains(why), "{err}");
    assert_eq!(
        std::fs::read(file).unwrap(),
        before,
        "the file is left as it was"
    );
}

#[fak_testkit::real_model]
fn chat_session_refuses_other_weights_damage_and_another_system() {
    need_model("smollm2-135m-instruct");
    let dir = scratch("refuse");
    let file = dir.join("talk.fakkv");
    let f = file.to_str().unwrap();
    ok(&chat(
        &["--session", f, "--system", "Be brief."],
        &format!("{Q1}\n"),
    ));

    refused(
        &["--session", f, "--weights", "native"],
        &file,
        "another model or weight mode",
    );
    refused(
        &["--session", f, "--system", "Be verbose."],
        &file,
        "--system differs",
    );
    // The same system message is accepted.
    let (_, err) = ok(&chat(&["--session", f, "--system", "Be brief."], "/quit\n"));
    assert!(err.contains("resumed 3 messages"), "{err}");

    let bytes = std::fs::read(&file).unwrap();
    let cut = dir.join("cut.fakkv");
    std::fs::write(&cut, &bytes[..bytes.len() - 1]).unwrap();
    refused(&["--session", cut.to_str().unwrap()], &cut, "damaged");
    let flip = dir.join("flip.fakkv");
    let mut flipped = bytes;
    let at = flipped.len() / 2;
    flipped[at] ^= 0x10;
    std::fs::write(&flip, &flipped).unwrap();
    refused(
        &["--session", flip.to_str().unwrap()],
        &flip,
        "checksum does not match",
    );
    let _ = std::fs::remove_dir_all(&dir);
}
