//! Replays recorded tool calls through a `fak-policy/1` manifest with taint tracking, as
//! a fully compromised model would make them, and writes what passed.
//!
//! `cargo run --release -p fak-engine --example policy_replay -- MANIFEST|builtin TASKS OUT`
//!
//! - `MANIFEST`: a manifest file, or `builtin` for [`Policy::default_manifest`];
//! - `TASKS`: a JSON array of `{"id", "kind": "user"|"injection", "calls": [{"name",
//!   "arguments"}]}` (`arguments` as JSON text), as `scripts/agentdojo_check.py export`
//!   writes them;
//! - `OUT`: a JSON object `{"user", "user_allowed", "injection", "injection_blocked",
//!   "deny_reasons": {REASON: calls}, "tasks": [{"id", "kind", "allowed", "denied":
//!   [[tool, REASON]]}]}`.
//!
//! A user task's first call is decided on a clean conversation and the rest on a tainted
//! one (the first result has entered the context); it counts as allowed when every call
//! is. An injection task's calls are decided on a tainted conversation (the injection
//! came in a tool result); its goal counts as blocked when any call is denied. Each task
//! is its own conversation, so rate limits do not carry between tasks.

use fak_engine::policy::{Policy, Taint, ToolCall};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Deserialize)]
struct Call {
    name: String,
    arguments: String,
}

#[derive(Deserialize)]
struct Task {
    id: String,
    kind: String,
    calls: Vec<Call>,
}

#[derive(Serialize)]
struct TaskResult {
    id: String,
    kind: String,
    allowed: bool,
    denied: Vec<(String, &'static str)>,
}

#[derive(Serialize, Default)]
struct Report {
    user: usize,
    user_allowed: usize,
    injection: usize,
    injection_blocked: usize,
    deny_reasons: BTreeMap<&'static str, usize>,
    tasks: Vec<TaskResult>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [manifest, tasks, out] = args.as_slice() else {
        return Err("usage: policy_replay MANIFEST|builtin TASKS OUT".into());
    };
    let load = || -> Result<Policy, Box<dyn std::error::Error>> {
        Ok(if manifest == "builtin" {
            Policy::builtin()
        } else {
            Policy::from_json(&std::fs::read_to_string(manifest)?)?
        })
    };
    let tasks: Vec<Task> = serde_json::from_str(&std::fs::read_to_string(tasks)?)?;
    let mut policy = load()?;
    let mut r = Report::default();
    for (n, t) in tasks.iter().enumerate() {
        let conversation = format!("task-{n}");
        let mut denied = Vec::new();
        for (i, c) in t.calls.iter().enumerate() {
            let taint = if t.kind == "user" && i == 0 {
                Taint::clean()
            } else {
                Taint::tainted()
            };
            let v = policy.adjudicate_with(
                &conversation,
                &ToolCall {
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                },
                &taint,
            );
            if let Some(reason) = v.reason {
                *r.deny_reasons.entry(reason.as_str()).or_default() += 1;
                denied.push((c.name.clone(), reason.as_str()));
            }
        }
        let allowed = denied.is_empty();
        match t.kind.as_str() {
            "user" => {
                r.user += 1;
                r.user_allowed += allowed as usize;
            }
            "injection" => {
                r.injection += 1;
                r.injection_blocked += !allowed as usize;
            }
            k => return Err(format!("task {}: kind '{k}'", t.id).into()),
        }
        r.tasks.push(TaskResult {
            id: t.id.clone(),
            kind: t.kind.clone(),
            allowed,
            denied,
        });
    }
    std::fs::write(out, serde_json::to_string_pretty(&r)?)?;
    println!(
        "{manifest}: user tasks allowed {}/{}, attacker goals blocked {}/{}",
        r.user_allowed, r.user, r.injection_blocked, r.injection
    );
    Ok(())
}
