//! The tool-call policy: a default-deny manifest every proposed tool call is checked
//! against before a client may act on it.
//!
//! Manifest (JSON, `"version": "fak-policy/1"`):
//!
//! ```json
//! {
//!   "version": "fak-policy/1",
//!   "posture": "fail_closed",
//!   "allow": ["get_weather"],
//!   "allow_prefix": ["read_", "search"],
//!   "deny": {"delete_all": "POLICY_BLOCK", "edit_policy": "SELF_MODIFY"},
//!   "args": {"http_get": {"url": {"type": "string", "pattern": "^https://", "max_len": 2048, "required": true}},
//!            "write_file": {"path": {"type": "string", "required": true, "within": "{cwd}"}},
//!            "shell": {"cmd": {"forbid": [{"pattern": "\\brm\\s+-rf\\b", "why": "recursive delete"}]}}},
//!   "rate_limit": {"calls": 20, "window_s": 60},
//!   "capabilities": {"get_weather": ["read"], "http_get": ["read", "egress"]},
//!   "tainted": {"write": "deny", "egress": "deny", "execute": "require_flag"}
//! }
//! ```
//!
//! Order of decision: malformed arguments (not a JSON object) → `MALFORMED`; an explicit
//! `deny` entry → its reason; not in `allow` / `allow_prefix` → `DEFAULT_DENY`; an
//! argument rule broken → `MALFORMED` (a path outside its rule's `within` directory, or a
//! value matching a `forbid` pattern → `POLICY_BLOCK` with the rule's reason); a sink tool on a tainted conversation →
//! `TAINTED_SINK`; a credential in the arguments → `SECRET_EXFIL`; over the
//! per-conversation rate → `RATE_LIMITED`; else allowed. Unknown keys, unknown reasons,
//! capabilities or actions, an unknown version or posture are load errors: a manifest is
//! never half understood.
//!
//! **Taint tracking** (`capabilities`, `tainted`; both optional, so a manifest without
//! them decides as before). A conversation is *tainted* once it has admitted untrusted
//! tool output (any tool result in its history: the caller says so in [`Taint`]).
//! `capabilities` labels each tool with what it can do ([`Capability`]: `read`, `write`,
//! `egress`, `execute`); `tainted` maps a capability to what happens to a call of a tool
//! holding it on a tainted conversation ([`TaintAction`]: `deny`, or `require_flag`: denied
//! unless the caller flagged the tool as confirmed, [`Taint::flags`]). When a manifest has
//! a `tainted` rule, a tool it does not label is taken to hold every capability (fail
//! closed: label read-only tools `["read"]`). The rule does not depend on detecting
//! anything in the tool output: an injection the screen misses still cannot drive a sink
//! tool. Source of the idea: the "dual LLM" / information-flow defenses (Willison 2023;
//! CaMeL, Debenedetti et al. 2025; FIDES, Costa et al. 2025).

use fak_ctxmmu::{normalize, Detector};
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// The manifest version this code reads.
pub const POLICY_VERSION: &str = "fak-policy/1";

/// Why a call was denied: a closed vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DenyReason {
    /// Forbidden by the manifest.
    PolicyBlock,
    /// The call would modify the agent's own configuration or policy.
    SelfModify,
    /// The arguments carry a credential out.
    SecretExfil,
    /// The tool is unknown to the manifest (deny entries may use it explicitly).
    UnknownTool,
    /// The arguments are not a JSON object or break an argument rule.
    Malformed,
    /// The reply's token budget (`max_tokens` or the context's end) ran out inside the
    /// call, before its arguments were whole ([`crate::ToolCall::truncated`]): not a
    /// call the model wrote wrong, and not the call it meant (never passed on).
    Truncated,
    /// Too many calls in this conversation's window.
    RateLimited,
    /// Not allowed by any rule: the default.
    DefaultDeny,
    /// A sink tool (by its capabilities) called on a conversation that has admitted
    /// untrusted tool output, which the manifest's `tainted` rule forbids (or allows
    /// only with the caller's flag, which was absent).
    TaintedSink,
}

impl DenyReason {
    /// The wire name (`POLICY_BLOCK`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            DenyReason::PolicyBlock => "POLICY_BLOCK",
            DenyReason::SelfModify => "SELF_MODIFY",
            DenyReason::SecretExfil => "SECRET_EXFIL",
            DenyReason::UnknownTool => "UNKNOWN_TOOL",
            DenyReason::Malformed => "MALFORMED",
            DenyReason::Truncated => "TRUNCATED",
            DenyReason::RateLimited => "RATE_LIMITED",
            DenyReason::DefaultDeny => "DEFAULT_DENY",
            DenyReason::TaintedSink => "TAINTED_SINK",
        }
    }
}

/// A rule for one argument.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArgRule {
    /// JSON type: `string`, `number`, `integer`, `boolean`, `object`, `array`.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// A regex a string value must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// Most characters of a string value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_len: Option<usize>,
    /// The allowed values.
    #[serde(rename = "enum", default, skip_serializing_if = "Option::is_none")]
    pub one_of: Option<Vec<serde_json::Value>>,
    /// Whether the argument must be present.
    #[serde(default)]
    pub required: bool,
    /// A directory a path value must lie inside (the directory itself included), or
    /// `{cwd}` for the working directory of the process that loads the policy. The path
    /// is resolved lexically, never on the file system: a relative path is taken from
    /// the directory of `{cwd}`, `.` and `..` are folded, a path starting with `~` is
    /// outside, and symlinks are not followed (the decision is made on the call's text,
    /// before the tool runs and maybe on another machine; see `docs/ctxmmu.md`).
    /// Outside → `POLICY_BLOCK`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub within: Option<String>,
    /// Patterns a string value must not match, each with the reason given when it does
    /// (`POLICY_BLOCK`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forbid: Vec<Forbid>,
}

/// A pattern an argument must not match ([`ArgRule::forbid`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Forbid {
    /// A regex (Rust `regex` syntax) searched for in the value.
    pub pattern: String,
    /// Why a match is denied, for the verdict's detail.
    pub why: String,
}

/// The placeholder of [`ArgRule::within`] for the working directory.
pub const CWD_PLACEHOLDER: &str = "{cwd}";

/// `path` with `.` and `..` folded and, when relative, taken from `base`; lexical only
/// (no file system access, symlinks not followed). `..` at the root stays at the root.
pub fn normalize_path(base: &std::path::Path, path: &std::path::Path) -> std::path::PathBuf {
    use std::path::Component;
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    };
    let mut out = std::path::PathBuf::new();
    for c in joined.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                // Never above the root: `pop` on `/` leaves it.
                if out.parent().is_some() {
                    out.pop();
                }
            }
            c => out.push(c.as_os_str()),
        }
    }
    out
}

/// Calls allowed per conversation per window.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// Calls allowed in a window.
    pub calls: usize,
    /// Window length in seconds.
    pub window_s: u64,
}

/// What a tool can do, the label taint tracking keys on (`read`, `write`, `egress`,
/// `execute` in a manifest).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Capability {
    /// Reads data and returns it (a search, a file read, a lookup).
    Read,
    /// Changes state the user owns (a file, a calendar, a setting, a payment).
    Write,
    /// Sends data out of the user's control (an e-mail, a message, a web request).
    Egress,
    /// Runs code or commands.
    Execute,
}

impl Capability {
    /// Every capability, the labels of a tool the manifest does not label.
    pub const ALL: [Capability; 4] = [
        Capability::Read,
        Capability::Write,
        Capability::Egress,
        Capability::Execute,
    ];

    /// The manifest name (`read`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Read => "read",
            Capability::Write => "write",
            Capability::Egress => "egress",
            Capability::Execute => "execute",
        }
    }
}

/// What a `tainted` rule does to a call of a tool holding its capability on a tainted
/// conversation (`deny`, `require_flag` in a manifest).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaintAction {
    /// Allowed only when the caller flagged the tool ([`Taint::flags`]).
    RequireFlag,
    /// Always denied.
    Deny,
}

/// The taint of the conversation a call is decided for: what the caller knows of its
/// history.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Taint {
    /// Whether the conversation has admitted untrusted tool output (any tool result,
    /// whatever the screen's verdict on it).
    pub tainted: bool,
    /// Tools the caller confirms may run on a tainted conversation under a
    /// `require_flag` rule (a tool name, or `*` for all). Set by the client (e.g. after
    /// asking its user), never by the model.
    pub flags: BTreeSet<String>,
}

impl Taint {
    /// A conversation that has admitted no tool output.
    pub fn clean() -> Self {
        Taint::default()
    }

    /// A conversation that has admitted tool output, with no flags.
    pub fn tainted() -> Self {
        Taint {
            tainted: true,
            flags: BTreeSet::new(),
        }
    }

    fn flagged(&self, tool: &str) -> bool {
        self.flags.contains(tool) || self.flags.contains("*")
    }
}

/// The manifest as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Must be [`POLICY_VERSION`].
    pub version: String,
    /// Must be `fail_closed`.
    #[serde(default = "fail_closed")]
    pub posture: String,
    /// Tool names allowed exactly.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Tool name prefixes allowed.
    #[serde(default)]
    pub allow_prefix: Vec<String>,
    /// Tool names denied, with the reason.
    #[serde(default)]
    pub deny: BTreeMap<String, DenyReason>,
    /// Argument rules per tool.
    #[serde(default)]
    pub args: BTreeMap<String, BTreeMap<String, ArgRule>>,
    /// Per-conversation rate limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimit>,
    /// What each tool can do (taint tracking; see the module docs). A tool not listed
    /// holds every capability when a `tainted` rule exists.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub capabilities: BTreeMap<String, Vec<Capability>>,
    /// What happens to a call of a tool holding a capability on a tainted conversation.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tainted: BTreeMap<Capability, TaintAction>,
}

fn fail_closed() -> String {
    "fail_closed".into()
}

/// Errors loading a manifest.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// Not valid JSON, an unknown key or reason, a wrong type (serde's message).
    #[error("policy manifest: {0}")]
    Parse(String),
    /// A value is out of its vocabulary or range.
    #[error("policy manifest: {0}")]
    Invalid(String),
}

/// A tool call the model proposed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// Tool name.
    pub name: String,
    /// Arguments as the JSON text the model wrote.
    pub arguments: String,
}

/// The decision on one call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CallVerdict {
    /// Whether the client may act on it.
    pub allowed: bool,
    /// Why not.
    pub reason: Option<DenyReason>,
    /// A human-readable detail (which rule, which argument).
    pub detail: String,
}

impl CallVerdict {
    fn allow(detail: impl Into<String>) -> Self {
        CallVerdict {
            allowed: true,
            reason: None,
            detail: detail.into(),
        }
    }
    fn deny(reason: DenyReason, detail: impl Into<String>) -> Self {
        CallVerdict {
            allowed: false,
            reason: Some(reason),
            detail: detail.into(),
        }
    }
}

/// A loaded, validated policy plus its per-conversation call history.
pub struct Policy {
    manifest: Manifest,
    patterns: HashMap<(String, String), Regex>,
    /// Each `forbid` list, compiled.
    forbids: HashMap<(String, String), Vec<(Regex, String)>>,
    /// Each `within` directory, `{cwd}` resolved and normalized.
    roots: HashMap<(String, String), std::path::PathBuf>,
    /// The working directory `{cwd}` stands for, and relative paths start from.
    cwd: std::path::PathBuf,
    history: HashMap<String, VecDeque<Instant>>,
    secrets: fak_ctxmmu::SecretDetector,
}

impl Policy {
    /// The built-in default: allows only read-shaped tool names (`get_`, `list_`,
    /// `read_`, `search`, `lookup_`), nothing irreversible; 60 calls a minute.
    pub fn default_manifest() -> Manifest {
        Manifest {
            version: POLICY_VERSION.into(),
            posture: fail_closed(),
            allow: Vec::new(),
            allow_prefix: ["get_", "list_", "read_", "search", "lookup_"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            deny: BTreeMap::new(),
            args: BTreeMap::new(),
            rate_limit: Some(RateLimit {
                calls: 60,
                window_s: 60,
            }),
            capabilities: BTreeMap::new(),
            tainted: BTreeMap::new(),
        }
    }

    /// The policy of [`Policy::default_manifest`] (which has no patterns to compile, so
    /// building it cannot fail).
    pub fn builtin() -> Self {
        Policy {
            manifest: Self::default_manifest(),
            patterns: HashMap::new(),
            forbids: HashMap::new(),
            roots: HashMap::new(),
            cwd: std::path::PathBuf::from("/"),
            history: HashMap::new(),
            secrets: fak_ctxmmu::SecretDetector::new(),
        }
    }

    /// Parses and validates a manifest.
    ///
    /// # Errors
    /// [`PolicyError`] naming the key or value at fault.
    pub fn from_json(text: &str) -> Result<Self, PolicyError> {
        let m: Manifest =
            serde_json::from_str(text).map_err(|e| PolicyError::Parse(e.to_string()))?;
        Self::new(m)
    }

    /// Validates a manifest, `{cwd}` standing for this process's working directory.
    ///
    /// # Errors
    /// [`PolicyError::Invalid`] for an unknown version or posture, a bad regex, an
    /// unknown argument type, a zero rate limit, a relative `within` directory, or an
    /// unreadable working directory when a rule names `{cwd}`.
    pub fn new(m: Manifest) -> Result<Self, PolicyError> {
        let uses_cwd = m
            .args
            .values()
            .flat_map(|r| r.values())
            .any(|r| r.within.as_deref() == Some(CWD_PLACEHOLDER));
        let cwd = if uses_cwd {
            std::env::current_dir().map_err(|e| {
                PolicyError::Invalid(format!("the working directory ({{cwd}}): {e}"))
            })?
        } else {
            std::path::PathBuf::from("/")
        };
        Self::with_cwd(m, &cwd)
    }

    /// [`Policy::new`] with `{cwd}` standing for `cwd` (an absolute path).
    ///
    /// # Errors
    /// As [`Policy::new`].
    pub fn with_cwd(m: Manifest, cwd: &std::path::Path) -> Result<Self, PolicyError> {
        if !cwd.is_absolute() {
            return Err(PolicyError::Invalid(format!(
                "the working directory {} is not absolute",
                cwd.display()
            )));
        }
        let cwd = normalize_path(std::path::Path::new("/"), cwd);
        if m.version != POLICY_VERSION {
            return Err(PolicyError::Invalid(format!(
                "version '{}' (this fak reads '{POLICY_VERSION}')",
                m.version
            )));
        }
        if m.posture != "fail_closed" {
            return Err(PolicyError::Invalid(format!(
                "posture '{}' (only fail_closed exists)",
                m.posture
            )));
        }
        if let Some(r) = &m.rate_limit {
            if r.calls == 0 || r.window_s == 0 {
                return Err(PolicyError::Invalid(
                    "rate_limit needs calls >= 1 and window_s >= 1".into(),
                ));
            }
        }
        if let Some((tool, _)) = m.capabilities.iter().find(|(_, c)| c.is_empty()) {
            return Err(PolicyError::Invalid(format!(
                "capabilities.{tool} is empty (label a read-only tool [\"read\"])"
            )));
        }
        let mut patterns = HashMap::new();
        let mut forbids = HashMap::new();
        let mut roots = HashMap::new();
        for (tool, rules) in &m.args {
            for (arg, rule) in rules {
                if let Some(k) = &rule.kind {
                    if !["string", "number", "integer", "boolean", "object", "array"]
                        .contains(&k.as_str())
                    {
                        return Err(PolicyError::Invalid(format!(
                            "args.{tool}.{arg}.type '{k}'"
                        )));
                    }
                }
                if let Some(p) = &rule.pattern {
                    let re = Regex::new(p).map_err(|e| {
                        PolicyError::Invalid(format!("args.{tool}.{arg}.pattern: {e}"))
                    })?;
                    patterns.insert((tool.clone(), arg.clone()), re);
                }
                let mut list = Vec::with_capacity(rule.forbid.len());
                for (i, f) in rule.forbid.iter().enumerate() {
                    let re = Regex::new(&f.pattern).map_err(|e| {
                        PolicyError::Invalid(format!("args.{tool}.{arg}.forbid[{i}].pattern: {e}"))
                    })?;
                    list.push((re, f.why.clone()));
                }
                if !list.is_empty() {
                    forbids.insert((tool.clone(), arg.clone()), list);
                }
                if let Some(w) = &rule.within {
                    let dir = if w == CWD_PLACEHOLDER {
                        cwd.clone()
                    } else if std::path::Path::new(w).is_absolute() {
                        normalize_path(&cwd, std::path::Path::new(w))
                    } else {
                        return Err(PolicyError::Invalid(format!(
                            "args.{tool}.{arg}.within '{w}' is neither an absolute path nor {CWD_PLACEHOLDER}"
                        )));
                    };
                    roots.insert((tool.clone(), arg.clone()), dir);
                }
            }
        }
        Ok(Policy {
            manifest: m,
            patterns,
            forbids,
            roots,
            cwd,
            history: HashMap::new(),
            secrets: fak_ctxmmu::SecretDetector::new(),
        })
    }

    /// Takes over `old`'s per-conversation call history (a reloaded policy keeps
    /// counting the calls already made against its own rate limit).
    pub fn adopt_history(&mut self, old: &mut Policy) {
        self.history = std::mem::take(&mut old.history);
    }

    /// The manifest in force.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Decides one call for `conversation` as if it had admitted no tool output
    /// ([`Taint::clean`]; see [`Policy::adjudicate_with`]).
    pub fn adjudicate(&mut self, conversation: &str, call: &ToolCall) -> CallVerdict {
        self.adjudicate_with(conversation, call, &Taint::clean())
    }

    /// The capabilities `tool` holds: its `capabilities` entry, else all of them.
    pub fn capabilities_of(&self, tool: &str) -> &[Capability] {
        self.manifest
            .capabilities
            .get(tool)
            .map_or(&Capability::ALL[..], Vec::as_slice)
    }

    /// The `tainted` rule a call of `tool` on a tainted conversation meets, if any: the
    /// strictest action over the tool's capabilities, with the capability that set it.
    pub fn taint_rule(&self, tool: &str) -> Option<(Capability, TaintAction)> {
        self.capabilities_of(tool)
            .iter()
            .filter_map(|c| self.manifest.tainted.get(c).map(|a| (*c, *a)))
            .max_by_key(|(_, a)| *a)
    }

    /// Decides one call for `conversation`, whose taint is `taint` (see the module docs
    /// for the order). An allowed call counts against the conversation's rate limit.
    pub fn adjudicate_with(
        &mut self,
        conversation: &str,
        call: &ToolCall,
        taint: &Taint,
    ) -> CallVerdict {
        let m = &self.manifest;
        let args: serde_json::Value =
            match serde_json::from_str(if call.arguments.trim().is_empty() {
                "{}"
            } else {
                &call.arguments
            }) {
                Ok(v @ serde_json::Value::Object(_)) => v,
                Ok(_) => {
                    return CallVerdict::deny(
                        DenyReason::Malformed,
                        "arguments are not a JSON object",
                    )
                }
                Err(e) => {
                    return CallVerdict::deny(
                        DenyReason::Malformed,
                        format!("arguments are not JSON: {e}"),
                    )
                }
            };
        if let Some(r) = m.deny.get(&call.name) {
            return CallVerdict::deny(*r, format!("'{}' is denied by the manifest", call.name));
        }
        let allowed = m.allow.contains(&call.name)
            || m.allow_prefix
                .iter()
                .any(|p| call.name.starts_with(p.as_str()));
        if !allowed {
            return CallVerdict::deny(
                DenyReason::DefaultDeny,
                format!("no rule allows '{}'", call.name),
            );
        }
        if let Some(rules) = m.args.get(&call.name) {
            for (arg, rule) in rules {
                let v = args.get(arg);
                let bad = |why: String| {
                    CallVerdict::deny(DenyReason::Malformed, format!("argument '{arg}': {why}"))
                };
                let Some(v) = v else {
                    if rule.required {
                        return bad("required but absent".into());
                    }
                    continue;
                };
                if let Some(k) = &rule.kind {
                    let ok = match k.as_str() {
                        "string" => v.is_string(),
                        "number" => v.is_number(),
                        "integer" => v.is_i64() || v.is_u64(),
                        "boolean" => v.is_boolean(),
                        "object" => v.is_object(),
                        _ => v.is_array(),
                    };
                    if !ok {
                        return bad(format!("not a {k}"));
                    }
                }
                if let Some(s) = v.as_str() {
                    if rule.max_len.is_some_and(|n| s.chars().count() > n) {
                        return bad(format!(
                            "longer than {} characters",
                            rule.max_len.unwrap_or(0)
                        ));
                    }
                    if let Some(re) = self.patterns.get(&(call.name.clone(), arg.clone())) {
                        if !re.is_match(s) {
                            return bad(format!("does not match {}", re.as_str()));
                        }
                    }
                }
                if let Some(set) = &rule.one_of {
                    if !set.contains(v) {
                        return bad("not one of the allowed values".into());
                    }
                }
                let key = (call.name.clone(), arg.clone());
                if let (Some(s), Some(root)) = (v.as_str(), self.roots.get(&key)) {
                    let p = std::path::Path::new(s);
                    let inside =
                        !s.starts_with('~') && normalize_path(&self.cwd, p).starts_with(root);
                    if !inside {
                        return CallVerdict::deny(
                            DenyReason::PolicyBlock,
                            format!("argument '{arg}': {s} is outside {}", root.display()),
                        );
                    }
                }
                if let (Some(s), Some(list)) = (v.as_str(), self.forbids.get(&key)) {
                    if let Some((_, why)) = list.iter().find(|(re, _)| re.is_match(s)) {
                        return CallVerdict::deny(
                            DenyReason::PolicyBlock,
                            format!("argument '{arg}': {why}"),
                        );
                    }
                }
            }
        }
        if taint.tainted {
            if let Some((cap, action)) = self.taint_rule(&call.name) {
                let why = format!(
                    "'{}' can {} and the conversation holds untrusted tool output",
                    call.name,
                    cap.as_str()
                );
                match action {
                    TaintAction::Deny => {
                        return CallVerdict::deny(
                            DenyReason::TaintedSink,
                            format!("{why}; the manifest denies it"),
                        )
                    }
                    TaintAction::RequireFlag if !taint.flagged(&call.name) => {
                        return CallVerdict::deny(
                            DenyReason::TaintedSink,
                            format!("{why}; the manifest requires the caller's flag for it"),
                        )
                    }
                    TaintAction::RequireFlag => {}
                }
            }
        }
        let text = args.to_string();
        if let Some(f) = self.secrets.inspect(&text, &normalize(&text)) {
            return CallVerdict::deny(DenyReason::SecretExfil, f.detail);
        }
        if let Some(r) = m.rate_limit.clone() {
            let now = Instant::now();
            let h = self.history.entry(conversation.to_string()).or_default();
            while h
                .front()
                .is_some_and(|t| now.duration_since(*t) > Duration::from_secs(r.window_s))
            {
                h.pop_front();
            }
            if h.len() >= r.calls {
                return CallVerdict::deny(
                    DenyReason::RateLimited,
                    format!("{} calls in {} s", r.calls, r.window_s),
                );
            }
            h.push_back(now);
        }
        CallVerdict::allow("allowed")
    }
}
