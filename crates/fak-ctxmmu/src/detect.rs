//! Detectors: each inspects a tool result (raw and normalized) and reports at most one
//! finding. They sit behind the [`Detector`] trait so better ones can plug in.

use crate::normalize::{normalize, Normalized};
use base64::Engine as _;
use regex::Regex;
use serde::Serialize;

/// Why a result was quarantined: a closed vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Reason {
    /// Instructions aimed at the model (prompt injection).
    TrustViolation,
    /// Text imitating the chat template's control tokens or role headers.
    ControlTokenForgery,
    /// A credential (API key, private key, token, password) that must not enter context.
    SecretLeak,
    /// Larger than the screen accepts at all.
    Oversized,
    /// An operator revoked this content (by digest or tool call id).
    Revoked,
}

impl Reason {
    /// The reason's wire name (`TRUST_VIOLATION`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TrustViolation => "TRUST_VIOLATION",
            Reason::ControlTokenForgery => "CONTROL_TOKEN_FORGERY",
            Reason::SecretLeak => "SECRET_LEAK",
            Reason::Oversized => "OVERSIZED",
            Reason::Revoked => "REVOKED",
        }
    }
}

/// What a detector found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// The detector's name.
    pub detector: &'static str,
    /// The reason it gives.
    pub reason: Reason,
    /// A short excerpt of what matched (at most 80 characters; secrets are masked).
    pub detail: String,
}

/// A screening rule.
pub trait Detector: Send + Sync {
    /// A short stable name, recorded in the audit log.
    fn name(&self) -> &'static str;
    /// Inspects `raw` (the result as received) and `norm` (its normalized forms).
    fn inspect(&self, raw: &str, norm: &Normalized) -> Option<Finding>;
}

fn excerpt(s: &str) -> String {
    let mut e: String = s.chars().take(80).collect();
    if s.chars().count() > 80 {
        e.push('…');
    }
    e
}

/// Prompt-injection phrasing: instructions aimed at the model, matched on the normalized
/// text with short gaps allowed between the key words (so instructions split across
/// fields or padded with junk still match), on the squashed form (spacing tricks), and
/// on base64 / hex / percent-encoded segments decoded once.
pub struct InjectionDetector {
    patterns: Vec<Regex>,
    squashed: Vec<&'static str>,
}

const GAP: &str = r"[^.!?\n]{0,40}?";

impl InjectionDetector {
    /// The built-in patterns.
    pub fn new() -> Self {
        let g = GAP;
        let p = [
            format!(r"\b(ignore|disregard|forget|override|bypass|skip){g}\b(previous|prior|above|earlier|preceding|initial|original|all|any|your|system|developer)\b{g}\b(instructions?|directions?|prompts?|rules|guidelines|guidance|context|constraints|policies|orders)\b"),
            r"\b(new|updated|revised|real|actual|additional|override|emergency|urgent|hidden|secret|important)\s+(system\s+|admin\s+|developer\s+)?(instructions?|directives?|orders|task)\s*[:\-]".to_string(),
            r"\byou are now\b".to_string(),
            r"\b(act|behave|respond) as (if you (are|were)|an? )(unrestricted|jailbroken|evil|different|new)".to_string(),
            r"\b(from now on|henceforth|going forward),? (you|ignore|always|only|never|respond|answer|reply)\b".to_string(),
            format!(r"\b(do not|don'?t|never|must not){g}\b(tell|inform|alert|notify|reveal|mention|disclose|show)\b{g}\b(the user|the human|anyone|your user)\b"),
            format!(r"\b(reveal|print|output|repeat|leak|show|dump|disclose|display)\b{g}\b(system prompt|hidden prompt|initial prompt|your instructions|your prompt|the instructions above)\b"),
            format!(r"\b(send|forward|post|upload|exfiltrate|transmit|e-?mail|leak|copy){g}\b(credentials?|passwords?|api ?keys?|tokens?|secrets?|cookies?|session|private keys?|ssh keys?|conversation|chat history|personal data)\b{g}\b(to|at|into)\b"),
            format!(r"\b(call|invoke|execute|run|trigger|use)\b{g}\b(delete|drop|wipe|destroy|rm -rf|transfer|wire|payment|send_email|exec|shell)\w*\b{g}\b(tool|function|command)\b"),
            r"\b(jailbreak|developer mode|dan mode|do anything now)\b".to_string(),
            r"\b(reply|respond|answer|say)\b[^.!?\n]{0,20}\bonly\b[^.!?\n]{0,20}\b(with|the word)\b".to_string(),
            r"(^|\n| )(system|assistant|admin)\s*(prompt|message|override)?\s*:\s*(you|ignore|new|from now|always|never|forget|disregard)\b".to_string(),
            r"\bimportant\b[^.!?\n]{0,20}\b(ai|assistant|model|llm|agent)s?\b[^.!?\n]{0,40}\b(must|should|need to|have to)\b".to_string(),
            // Text that addresses the reading AI and then orders it about.
            r"\b(if you are|if you're|for|attention|note to|hint for|message for|dear|to|calling all)\s+(an?\s+|any\s+|all\s+|the\s+)?(ai|llm|automated|language model|large language model|assistant|coding agent|agent|chatbot|copilot)s?\b[^\n]{0,160}?\b(must|should|shall|need to|have to|are required|is required|immediately|do not|don't|never|always|please)\b".to_string(),
            r"\b(ai|llm|automated) (agents?|assistants?|models?|systems?)\b[^.!?\n]{0,80}\b(must|should|shall|are required to|are instructed to|need to)\b".to_string(),
            // Claims that the model's instructions changed.
            r"\b(previous|prior|earlier|original|existing|all|old|current)\b[^.!?\n]{0,30}\b(instructions|guidelines|guidance|rules|directives|policies)\b[^.!?\n]{0,30}\b(are|is|were|have been|has been)\b[^.!?\n]{0,20}\b(revoked|void|cancell?ed|obsolete|replaced|superseded|invalid|no longer|lifted|suspended)\b".to_string(),
            r"\b(your|the assistant'?s|the model'?s)\s+(real|true|new|actual|updated|revised)\s+(instructions|task|objective|goal|orders)\b".to_string(),
            r"\b(instruction|prompt|policy) override\b".to_string(),
            format!(r"\bforget\b{g}\b(guidance|instructions|rules|everything|all of the above)\b"),
            r"\b(never|do not|don'?t)\s+(reveal|mention|disclose|repeat)\s+(this|these)\s+(instructions?|messages?|notes?|requests?|hints?)\b".to_string(),
            r"\b(do not|don'?t|never|without)\s+ask(ing)?\s+(the\s+user\s+)?for\s+(confirmation|permission|approval)\b".to_string(),
            r"\bbefore (replying|responding|answering)\b[^.!?\n]{0,40}\b(do not|don'?t|never)\b|\b(do this|run this|execute this) before (replying|responding|answering)\b".to_string(),
        ];
        InjectionDetector {
            patterns: p
                .iter()
                .map(|s| Regex::new(s).expect("built-in pattern"))
                .collect(),
            squashed: vec![
                "ignorepreviousinstructions",
                "ignoreallpreviousinstructions",
                "ignoreallpriorinstructions",
                "ignorepriorinstructions",
                "ignoreaboveinstructions",
                "ignoretheaboveinstructions",
                "ignoreyourinstructions",
                "disregardpreviousinstructions",
                "disregardallpreviousinstructions",
                "forgetpreviousinstructions",
                "forgetallpreviousinstructions",
                "forgeteverythingabove",
                "youarenowdan",
                "donottelltheuser",
                "dontelltheuser",
                "revealyoursystemprompt",
                "newsysteminstructions",
            ],
        }
    }

    fn scan(&self, norm: &Normalized) -> Option<String> {
        for re in &self.patterns {
            if let Some(m) = re.find(&norm.text) {
                return Some(m.as_str().to_string());
            }
        }
        self.squashed
            .iter()
            .find(|k| norm.squashed.contains(*k))
            .map(|k| k.to_string())
    }
}

impl Default for InjectionDetector {
    fn default() -> Self {
        Self::new()
    }
}

/// Segments of `raw` that decode (base64, hex, percent-encoding) to readable text.
fn decoded_segments(raw: &str) -> Vec<String> {
    static B64: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    static HEX: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let b64 = B64.get_or_init(|| Regex::new(r"[A-Za-z0-9+/_-]{20,}={0,2}").expect("pattern"));
    let hex =
        HEX.get_or_init(|| Regex::new(r"(?i)\b(?:[0-9a-f]{2}[ :]?){12,}\b").expect("pattern"));
    let readable = |b: &[u8]| -> Option<String> {
        let s = std::str::from_utf8(b).ok()?;
        let printable = s
            .chars()
            .filter(|c| !c.is_control() || c.is_whitespace())
            .count();
        (s.chars().count() >= 8 && printable * 10 >= s.chars().count() * 9 && s.contains(' '))
            .then(|| s.to_string())
    };
    let mut out = Vec::new();
    for m in b64.find_iter(raw).take(64) {
        let t = m.as_str().trim_end_matches('=');
        for engine in [
            &base64::engine::general_purpose::STANDARD_NO_PAD,
            &base64::engine::general_purpose::URL_SAFE_NO_PAD,
        ] {
            if let Some(s) = engine.decode(t).ok().and_then(|b| readable(&b)) {
                out.push(s);
                break;
            }
        }
    }
    for m in hex.find_iter(raw).take(64) {
        let digits: String = m
            .as_str()
            .chars()
            .filter(|c| c.is_ascii_hexdigit())
            .collect();
        let bytes: Option<Vec<u8>> = (0..digits.len() / 2)
            .map(|i| u8::from_str_radix(&digits[2 * i..2 * i + 2], 16).ok())
            .collect();
        if let Some(s) = bytes.and_then(|b| readable(&b)) {
            out.push(s);
        }
    }
    if raw.matches('%').count() >= 4 {
        let mut bytes = Vec::with_capacity(raw.len());
        let b = raw.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' && i + 2 < b.len() {
                let hexval = |x: u8| (x as char).to_digit(16);
                if let (Some(h), Some(l)) = (hexval(b[i + 1]), hexval(b[i + 2])) {
                    bytes.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
            }
            bytes.push(if b[i] == b'+' { b' ' } else { b[i] });
            i += 1;
        }
        if let Ok(s) = String::from_utf8(bytes) {
            if s != raw {
                out.push(s);
            }
        }
    }
    out
}

impl Detector for InjectionDetector {
    fn name(&self) -> &'static str {
        "injection"
    }
    fn inspect(&self, raw: &str, norm: &Normalized) -> Option<Finding> {
        let found = |detail: String, how: &str| Finding {
            detector: "injection",
            reason: Reason::TrustViolation,
            detail: excerpt(&format!("{how}{detail}")),
        };
        if let Some(m) = self.scan(norm) {
            return Some(found(m, ""));
        }
        for seg in decoded_segments(raw) {
            if let Some(m) = self.scan(&normalize(&seg)) {
                return Some(found(m, "decoded: "));
            }
        }
        None
    }
}

/// Text imitating chat-template control tokens or role headers of the common templates
/// (ChatML, Gemma, Llama 2/3, Anthropic's legacy `Human:`/`Assistant:` turns), and the
/// Hermes tool tags (`<tool_response>`, `<tool_call>`, `<tools>`) that tool results and
/// calls are framed with.
pub struct ControlTokenDetector {
    tokens: Vec<&'static str>,
    headers: Regex,
}

impl ControlTokenDetector {
    /// The built-in token list.
    pub fn new() -> Self {
        ControlTokenDetector {
            tokens: vec![
                "<|im_start|>",
                "<|im_end|>",
                "<|endoftext|>",
                "<start_of_turn>",
                "<end_of_turn>",
                "<|eot_id|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|begin_of_text|>",
                "<|system|>",
                "<|user|>",
                "<|assistant|>",
                "<|end|>",
                "[inst]",
                "[/inst]",
                "<<sys>>",
                "<</sys>>",
                // The Hermes tool-call format fak itself writes results and calls in.
                "<tool_response>",
                "</tool_response>",
                "<tool_call>",
                "</tool_call>",
                "<tools>",
                "</tools>",
            ],
            headers: Regex::new(r"(?m)(\n\n|^)(human|assistant)\s*:").expect("pattern"),
        }
    }
}

impl Default for ControlTokenDetector {
    fn default() -> Self {
        Self::new()
    }
}

impl Detector for ControlTokenDetector {
    fn name(&self) -> &'static str {
        "control_token"
    }
    fn inspect(&self, raw: &str, norm: &Normalized) -> Option<Finding> {
        let compact: String = norm.text.chars().filter(|c| !c.is_whitespace()).collect();
        if let Some(t) = self.tokens.iter().find(|t| compact.contains(*t)) {
            return Some(Finding {
                detector: "control_token",
                reason: Reason::ControlTokenForgery,
                detail: (*t).to_string(),
            });
        }
        let lower = raw.to_lowercase();
        if self
            .headers
            .find_iter(&lower)
            .filter(|m| m.as_str().contains("\n\n") || m.start() == 0)
            .count()
            >= 2
        {
            return Some(Finding {
                detector: "control_token",
                reason: Reason::ControlTokenForgery,
                detail: "Human:/Assistant: turn headers".into(),
            });
        }
        None
    }
}

/// Credentials by shape: cloud keys, private keys, tokens, passwords in configs and
/// connection strings. The excerpt masks the value.
pub struct SecretDetector {
    patterns: Vec<(&'static str, Regex)>,
}

impl SecretDetector {
    /// The built-in patterns.
    pub fn new() -> Self {
        let p: Vec<(&'static str, &str)> = vec![
            ("aws access key id", r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
            (
                "private key",
                r"-----BEGIN (RSA |EC |DSA |OPENSSH |ENCRYPTED |PGP )?PRIVATE KEY( BLOCK)?-----",
            ),
            (
                "github token",
                r"\b(ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36}\b|\bgithub_pat_[A-Za-z0-9_]{40,}\b",
            ),
            ("api key (sk-)", r"\bsk-(proj-|ant-)?[A-Za-z0-9_-]{20,}\b"),
            ("slack token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b"),
            ("google api key", r"\bAIza[0-9A-Za-z_-]{35}\b"),
            (
                "jwt",
                r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
            ),
            ("stripe key", r"\b(sk|rk)_(live|test)_[A-Za-z0-9]{16,}\b"),
            (
                "password assignment",
                r#"(?i)\b(password|passwd|pwd|secret|api_?key|access_?token|auth_?token)\b["']?\s*[:=]\s*["']?[^\s"'<>{}$]{6,}"#,
            ),
            (
                "credentials in a URL",
                r"(?i)\b[a-z][a-z0-9+.-]*://[^\s:/@]+:[^\s@/]{3,}@[^\s/]+",
            ),
        ];
        SecretDetector {
            patterns: p
                .into_iter()
                .map(|(n, s)| (n, Regex::new(s).expect("built-in pattern")))
                .collect(),
        }
    }
}

impl Default for SecretDetector {
    fn default() -> Self {
        Self::new()
    }
}

impl Detector for SecretDetector {
    fn name(&self) -> &'static str {
        "secret"
    }
    fn inspect(&self, raw: &str, _norm: &Normalized) -> Option<Finding> {
        for (what, re) in &self.patterns {
            for m in re.find_iter(raw) {
                let v = m.as_str();
                // Judge the secret part only: a URL's password, not its host name.
                let secret_part = if *what == "credentials in a URL" {
                    v.split("://")
                        .nth(1)
                        .and_then(|r| r.split('@').next())
                        .and_then(|u| u.split_once(':'))
                        .map_or(v, |(_, p)| p)
                } else {
                    v
                };
                if placeholder(secret_part) {
                    continue;
                }
                if *what == "password assignment" && !literal_secret(v) {
                    continue;
                }
                let shown: String = v.chars().take(12).collect();
                return Some(Finding {
                    detector: "secret",
                    reason: Reason::SecretLeak,
                    detail: format!("{what}: {shown}…"),
                });
            }
        }
        None
    }
}

/// Whether a matched credential is a placeholder, not a value: `${DB_PASSWORD}`,
/// `xoxb-your-token-here`, `<your key>`, `****`, `example`.
fn placeholder(v: &str) -> bool {
    let l = v.to_ascii_lowercase();
    [
        "${",
        "{{",
        "<",
        "your",
        "example",
        "placeholder",
        "here",
        "xxxx",
        "****",
        "changeme",
        "dummy",
        "redacted",
    ]
    .iter()
    .any(|p| l.contains(p))
}

/// Whether the value of a `password = value` match looks like a literal secret rather
/// than code or configuration plumbing: quoted, or holding both letters and digits,
/// and not an identifier path (`env::var(`, `var.db_password`, `string;`) or a file path.
fn literal_secret(m: &str) -> bool {
    let Some(at) = m.find(['=', ':']) else {
        return false;
    };
    let rest = m[at + 1..].trim_start_matches([' ', '=', ':']);
    let quoted = rest.starts_with(['"', '\'']);
    let value = rest.trim_matches(|c| c == '"' || c == '\'');
    if value.starts_with('/') || value.starts_with("http") {
        return false;
    }
    let identifier = value
        .split(['.', ':', '(', '[', ';', ','])
        .all(|part| part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        && value
            .chars()
            .any(|c| matches!(c, '.' | ':' | '(' | ';' | ','));
    let plain_word = value.chars().all(|c| c.is_ascii_alphabetic() || c == '_');
    if identifier || (plain_word && !quoted) {
        return false;
    }
    quoted
        || (value.chars().any(|c| c.is_ascii_digit())
            && value.chars().any(|c| c.is_ascii_alphabetic()))
}

/// The detectors `Screen` uses by default, in the order they are consulted.
pub fn default_detectors() -> Vec<Box<dyn Detector>> {
    vec![
        Box::new(ControlTokenDetector::new()),
        Box::new(SecretDetector::new()),
        Box::new(InjectionDetector::new()),
    ]
}
