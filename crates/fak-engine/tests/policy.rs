//! Default deny: each verdict path of the tool-call policy, and manifests that must not
//! load.

use fak_engine::policy::{
    Capability, DenyReason, Policy, Taint, TaintAction, ToolCall, POLICY_VERSION,
};

const MANIFEST: &str = r#"{
  "version": "fak-policy/1",
  "posture": "fail_closed",
  "allow": ["get_weather", "http_get", "send_note"],
  "allow_prefix": ["read_"],
  "deny": {"delete_all": "POLICY_BLOCK", "edit_policy": "SELF_MODIFY", "read_secrets": "SECRET_EXFIL"},
  "args": {"http_get": {"url": {"type": "string", "pattern": "^https://", "max_len": 64, "required": true},
                        "method": {"enum": ["GET", "HEAD"]}}},
  "rate_limit": {"calls": 3, "window_s": 60}
}"#;

fn call(name: &str, args: &str) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments: args.into(),
    }
}

fn reason(p: &mut Policy, conv: &str, name: &str, args: &str) -> Option<DenyReason> {
    let v = p.adjudicate(conv, &call(name, args));
    assert_eq!(v.allowed, v.reason.is_none());
    v.reason
}

#[test]
fn allow_and_allow_prefix() {
    let mut p = Policy::from_json(MANIFEST).unwrap();
    assert_eq!(
        reason(&mut p, "a", "get_weather", r#"{"city":"Paris"}"#),
        None
    );
    assert_eq!(
        reason(&mut p, "b", "read_file", r#"{"path":"README.md"}"#),
        None
    );
    assert_eq!(
        reason(
            &mut p,
            "c",
            "http_get",
            r#"{"url":"https://example.org/x","method":"GET"}"#
        ),
        None
    );
}

#[test]
fn explicit_deny_carries_its_reason_and_beats_allow_prefix() {
    let mut p = Policy::from_json(MANIFEST).unwrap();
    assert_eq!(
        reason(&mut p, "a", "delete_all", "{}"),
        Some(DenyReason::PolicyBlock)
    );
    assert_eq!(
        reason(&mut p, "a", "edit_policy", "{}"),
        Some(DenyReason::SelfModify)
    );
    assert_eq!(
        reason(&mut p, "a", "read_secrets", "{}"),
        Some(DenyReason::SecretExfil)
    );
}

#[test]
fn anything_not_allowed_is_default_deny() {
    let mut p = Policy::from_json(MANIFEST).unwrap();
    for name in ["rm_rf", "get_weatherX", "READ_file", "", "shell"] {
        assert_eq!(
            reason(&mut p, "a", name, "{}"),
            Some(DenyReason::DefaultDeny),
            "{name:?}"
        );
    }
}

#[test]
fn malformed_arguments_fail_closed() {
    let mut p = Policy::from_json(MANIFEST).unwrap();
    for (name, args) in [
        ("get_weather", "{not json"),
        ("get_weather", "[1,2]"),
        ("get_weather", "\"a string\""),
        ("http_get", r#"{"url":"http://plain.example"}"#),
        (
            "http_get",
            r#"{"url":"https://example.org/a-very-long-path-that-goes-on-and-on-and-on-and-on"}"#,
        ),
        ("http_get", r#"{"url":42}"#),
        ("http_get", r#"{"method":"GET"}"#),
        (
            "http_get",
            r#"{"url":"https://x.example","method":"DELETE"}"#,
        ),
    ] {
        assert_eq!(
            reason(&mut p, "a", name, args),
            Some(DenyReason::Malformed),
            "{name} {args}"
        );
    }
}

#[test]
fn credentials_in_arguments_are_secret_exfil() {
    let mut p = Policy::from_json(MANIFEST).unwrap();
    let args = r#"{"text":"here you go: AKIAZ7QH3KXV4PL2MNBT"}"#;
    assert_eq!(
        reason(&mut p, "a", "send_note", args),
        Some(DenyReason::SecretExfil)
    );
    assert_eq!(
        reason(&mut p, "a", "send_note", r#"{"text":"see you at 5"}"#),
        None
    );
}

#[test]
fn rate_limit_is_per_conversation() {
    let mut p = Policy::from_json(MANIFEST).unwrap();
    for _ in 0..3 {
        assert_eq!(reason(&mut p, "busy", "get_weather", "{}"), None);
    }
    assert_eq!(
        reason(&mut p, "busy", "get_weather", "{}"),
        Some(DenyReason::RateLimited)
    );
    assert_eq!(reason(&mut p, "other", "get_weather", "{}"), None);
}

#[test]
fn bad_manifests_do_not_load() {
    for (m, what) in [
        (r#"{"version":"fak-policy/2"}"#, "version"),
        (
            r#"{"version":"fak-policy/1","posture":"fail_open"}"#,
            "posture",
        ),
        (r#"{"version":"fak-policy/1","alow":["x"]}"#, "alow"),
        (
            r#"{"version":"fak-policy/1","deny":{"x":"NOT_A_REASON"}}"#,
            "NOT_A_REASON",
        ),
        (
            r#"{"version":"fak-policy/1","args":{"t":{"a":{"pattern":"("}}}}"#,
            "pattern",
        ),
        (
            r#"{"version":"fak-policy/1","args":{"t":{"a":{"type":"strnig"}}}}"#,
            "strnig",
        ),
        (
            r#"{"version":"fak-policy/1","args":{"t":{"a":{"maxlen":3}}}}"#,
            "maxlen",
        ),
        (
            r#"{"version":"fak-policy/1","rate_limit":{"calls":0,"window_s":1}}"#,
            "rate_limit",
        ),
        ("not json", "expected"),
        (
            r#"{"version":"fak-policy/1","capabilities":{"t":["teleport"]}}"#,
            "teleport",
        ),
        (
            r#"{"version":"fak-policy/1","capabilities":{"t":[]}}"#,
            "capabilities.t",
        ),
        (
            r#"{"version":"fak-policy/1","tainted":{"egress":"warn"}}"#,
            "warn",
        ),
        (
            r#"{"version":"fak-policy/1","tainted":{"network":"deny"}}"#,
            "network",
        ),
    ] {
        let e = Policy::from_json(m)
            .err()
            .unwrap_or_else(|| panic!("{m} loaded"));
        assert!(e.to_string().contains(what), "{m}: {e}");
    }
}

#[test]
fn the_default_manifest_allows_nothing_irreversible() {
    let mut p = Policy::new(Policy::default_manifest()).unwrap();
    assert_eq!(p.manifest().version, POLICY_VERSION);
    assert_eq!(reason(&mut p, "a", "get_time", "{}"), None);
    assert_eq!(reason(&mut p, "a", "search_web", r#"{"q":"rust"}"#), None);
    for name in [
        "delete_file",
        "send_email",
        "transfer_funds",
        "write_file",
        "exec",
    ] {
        assert_eq!(
            reason(&mut p, "a", name, "{}"),
            Some(DenyReason::DefaultDeny),
            "{name}"
        );
    }
}

/// A manifest with taint rules: egress and write denied on a tainted conversation,
/// execute allowed only with the caller's flag; `note` is not labelled.
const TAINT: &str = r#"{
  "version": "fak-policy/1",
  "allow": ["read_file", "send_email", "write_file", "run_script", "note", "fetch_url"],
  "capabilities": {"read_file": ["read"], "send_email": ["egress"], "write_file": ["write"],
                   "run_script": ["execute"], "fetch_url": ["read", "egress"]},
  "tainted": {"egress": "deny", "write": "deny", "execute": "require_flag"}
}"#;

fn decide(p: &mut Policy, name: &str, taint: &Taint) -> Option<DenyReason> {
    let v = p.adjudicate_with("c", &call(name, "{}"), taint);
    assert_eq!(v.allowed, v.reason.is_none());
    if v.reason == Some(DenyReason::TaintedSink) {
        assert!(v.detail.contains(name), "{}", v.detail);
    }
    v.reason
}

#[test]
fn a_sink_is_allowed_on_a_clean_conversation_and_denied_on_a_tainted_one() {
    let mut p = Policy::from_json(TAINT).unwrap();
    for name in [
        "read_file",
        "send_email",
        "write_file",
        "run_script",
        "note",
        "fetch_url",
    ] {
        assert_eq!(decide(&mut p, name, &Taint::clean()), None, "{name}");
        // `adjudicate` is the clean case.
        assert_eq!(reason(&mut p, "c", name, "{}"), None, "{name}");
    }
    let t = Taint::tainted();
    assert_eq!(decide(&mut p, "read_file", &t), None);
    for name in ["send_email", "write_file", "run_script", "fetch_url"] {
        assert_eq!(
            decide(&mut p, name, &t),
            Some(DenyReason::TaintedSink),
            "{name}"
        );
    }
    // Unlabelled under a `tainted` rule: every capability, so denied (fail closed).
    assert_eq!(decide(&mut p, "note", &t), Some(DenyReason::TaintedSink));
    assert_eq!(DenyReason::TaintedSink.as_str(), "TAINTED_SINK");
}

#[test]
fn require_flag_allows_only_the_flagged_tool() {
    let mut p = Policy::from_json(TAINT).unwrap();
    let flagged = |names: &[&str]| Taint {
        tainted: true,
        flags: names.iter().map(|s| s.to_string()).collect(),
    };
    let v = p.adjudicate_with("c", &call("run_script", "{}"), &Taint::tainted());
    assert_eq!(v.reason, Some(DenyReason::TaintedSink));
    assert!(v.detail.contains("flag"), "{}", v.detail);
    assert_eq!(
        decide(&mut p, "run_script", &flagged(&["send_email"])),
        Some(DenyReason::TaintedSink)
    );
    assert_eq!(
        decide(&mut p, "run_script", &flagged(&["run_script"])),
        None
    );
    assert_eq!(decide(&mut p, "run_script", &flagged(&["*"])), None);
    // A flag does not lift a `deny` rule.
    assert_eq!(
        decide(&mut p, "send_email", &flagged(&["*"])),
        Some(DenyReason::TaintedSink)
    );
    // The strictest action over a tool's capabilities wins.
    assert_eq!(
        p.taint_rule("fetch_url"),
        Some((Capability::Egress, TaintAction::Deny))
    );
    assert_eq!(p.taint_rule("note").map(|r| r.1), Some(TaintAction::Deny));
    assert_eq!(p.taint_rule("read_file"), None);
}

#[test]
fn a_manifest_without_taint_rules_decides_as_before() {
    // The taint of the conversation changes nothing without a `tainted` rule, and the
    // new keys are not written out when absent (old manifests round-trip unchanged).
    let mut p = Policy::from_json(MANIFEST).unwrap();
    assert_eq!(decide(&mut p, "send_note", &Taint::tainted()), None);
    assert_eq!(
        decide(&mut p, "rm_rf", &Taint::tainted()),
        Some(DenyReason::DefaultDeny)
    );
    let text = serde_json::to_string(p.manifest()).unwrap();
    assert!(
        !text.contains("capabilities") && !text.contains("tainted"),
        "{text}"
    );
    let d = serde_json::to_string(&Policy::default_manifest()).unwrap();
    assert!(!d.contains("tainted"), "{d}");
    // Denial order: a manifest `deny` entry and the allow list come first.
    let mut q = Policy::from_json(TAINT).unwrap();
    assert_eq!(
        decide(&mut q, "shell", &Taint::tainted()),
        Some(DenyReason::DefaultDeny)
    );
}
