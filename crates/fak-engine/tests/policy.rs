//! Default deny: each verdict path of the tool-call policy, and manifests that must not
//! load.

use fak_engine::policy::{DenyReason, Policy, ToolCall, POLICY_VERSION};

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
