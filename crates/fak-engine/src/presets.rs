//! Policy manifests for known agents, shipped in the binary (`fak policy presets`,
//! `--policy preset:NAME`). Each is a `fak-policy/1` manifest (the format in
//! [`crate::policy`]) kept as a file under `crates/fak-engine/presets/`; what each
//! allows is spelled out in `docs/ctxmmu.md`, "Presets". The built-in default
//! ([`crate::policy::Policy::builtin`]) stays deny-all but read-shaped names; a preset
//! is only ever chosen by name.
//!
//! Tool names and argument names are the agent's own: Claude Code's were read from the
//! `tools` array of the requests `@anthropic-ai/claude-code` 2.1.332 (`claude -p`,
//! default settings) sends, and from the input types of its `sdk-tools.d.ts`.

use crate::policy::{Policy, PolicyError};

/// One shipped manifest.
#[derive(Debug)]
pub struct Preset {
    /// The name after `preset:`.
    pub name: &'static str,
    /// One line saying what it allows.
    pub summary: &'static str,
    /// The manifest, JSON text.
    pub manifest: &'static str,
}

impl Preset {
    /// The policy, `{cwd}` standing for this process's working directory.
    ///
    /// # Errors
    /// [`PolicyError`] (a shipped manifest is checked by the tests; only an unreadable
    /// working directory can fail here).
    pub fn policy(&self) -> Result<Policy, PolicyError> {
        Policy::from_json(self.manifest)
    }
}

/// Every preset, by name.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "claude-code",
        summary: "Claude Code: read-only tools; Edit/Write/MultiEdit/NotebookEdit inside the working directory; Bash except destructive commands (rm -rf, git push --force, curl | sh, ...); WebFetch/WebSearch until the conversation holds tool output",
        manifest: include_str!("../presets/claude-code.json"),
    },
    Preset {
        name: "claude-code-readonly",
        summary: "Claude Code, read-only: Read, Glob, Grep, LS, TodoWrite, ToolSearch, ListAgents, CronList; edits and Bash denied (POLICY_BLOCK), the rest by default",
        manifest: include_str!("../presets/claude-code-readonly.json"),
    },
];

/// The preset named `name`.
pub fn find(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}
