//! `fak policy`, `fak preflight` and `fak quarantine`: the kernel boundary from the shell.

use crate::{fail, outln, CliError};
use fak_ctxmmu::{PageStore, StoredKind};
use fak_engine::policy::{Policy, Taint, ToolCall};
use std::path::{Path, PathBuf};

#[derive(clap::Subcommand)]
pub(crate) enum PolicyCmd {
    /// Print a manifest: the built-in default (allows only read-shaped tools), or a
    /// shipped preset's (`fak policy dump claude-code`).
    Dump {
        /// A preset's name (see `fak policy presets`).
        preset: Option<String>,
    },
    /// List the manifests shipped in the binary for known agents, one line each (use
    /// one with `--policy preset:NAME`).
    Presets,
    /// Load a manifest and say whether it is valid (exit 1 with the reason if not).
    Check {
        /// The manifest: a file (JSON, "version": "fak-policy/1") or `preset:NAME`, as
        /// `--policy` takes it.
        #[arg(value_name = "FILE|preset:NAME", value_parser = parse_policy_arg)]
        policy: PolicyArg,
    },
}

#[derive(clap::Args)]
pub(crate) struct PreflightArgs {
    /// Tool name the model would call.
    #[arg(long)]
    tool: String,
    /// Its arguments, as JSON text.
    #[arg(long, default_value = "{}")]
    args: String,
    /// A manifest file or `preset:NAME` (default: the built-in one).
    #[arg(long, value_parser = parse_policy_arg)]
    policy: Option<PolicyArg>,
    /// Decide the call for a conversation that has admitted tool output (the manifest's
    /// `tainted` rules apply).
    #[arg(long)]
    tainted: bool,
    /// A tool the caller confirms for a tainted conversation (`require_flag` rules);
    /// repeatable, `*` for all.
    #[arg(long = "flag")]
    flags: Vec<String>,
}

#[derive(clap::Subcommand)]
pub(crate) enum QuarantineCmd {
    /// List quarantined and paged-out results.
    List,
    /// Show one item's record (the content only once cleared).
    Show {
        /// Item id (`q3`, `p1`).
        id: String,
    },
    /// Clear a quarantined item so it can be read (an operator decision).
    Clear {
        /// Item id.
        id: String,
    },
}

/// The quarantine store folder: `$FAK_HOME/quarantine`.
pub(crate) fn store_dir() -> PathBuf {
    fak_catalog::fak_home().join("quarantine")
}

/// A `--policy` value: a manifest file, or `preset:NAME`, a manifest shipped in the
/// binary ([`fak_engine::presets`]).
#[derive(Clone, Debug)]
pub(crate) enum PolicyArg {
    /// A manifest file.
    File(PathBuf),
    /// A shipped preset.
    Preset(&'static fak_engine::presets::Preset),
}

impl PolicyArg {
    /// Loads the policy (a preset's `{cwd}` is this process's working directory).
    pub(crate) fn load(&self) -> Result<Policy, CliError> {
        match self {
            PolicyArg::File(f) => load_policy(f),
            PolicyArg::Preset(p) => p
                .policy()
                .map_err(|e| fail(format!("preset:{}: {e}", p.name))),
        }
    }

    /// The file, when it is one (what a policy reload reads again).
    pub(crate) fn file(&self) -> Option<&Path> {
        match self {
            PolicyArg::File(f) => Some(f),
            PolicyArg::Preset(_) => None,
        }
    }
}

impl std::fmt::Display for PolicyArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyArg::File(p) => write!(f, "{}", p.display()),
            PolicyArg::Preset(p) => write!(f, "preset:{}", p.name),
        }
    }
}

/// Parses `--policy`: `preset:NAME` (a preset that exists) or a file path.
pub(crate) fn parse_policy_arg(s: &str) -> Result<PolicyArg, String> {
    match s.strip_prefix("preset:") {
        Some(name) => fak_engine::presets::find(name)
            .map(PolicyArg::Preset)
            .ok_or_else(|| {
                format!(
                    "no preset '{name}' (known: {}; see `fak policy presets`)",
                    fak_engine::presets::PRESETS
                        .iter()
                        .map(|p| p.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }),
        None => Ok(PolicyArg::File(PathBuf::from(s))),
    }
}

pub(crate) fn load_policy(file: &Path) -> Result<Policy, CliError> {
    let text =
        std::fs::read_to_string(file).map_err(|e| fail(format!("{}: {e}", file.display())))?;
    Policy::from_json(&text).map_err(|e| fail(format!("{}: {e}", file.display())))
}

pub(crate) fn policy(cmd: PolicyCmd) -> Result<(), CliError> {
    match cmd {
        PolicyCmd::Dump { preset: None } => outln!(
            "{}",
            serde_json::to_string_pretty(&Policy::default_manifest())?
        )?,
        PolicyCmd::Dump { preset: Some(name) } => {
            if let PolicyArg::Preset(p) = parse_policy_arg(&format!("preset:{name}"))? {
                outln!("{}", p.manifest.trim_end())?;
            }
        }
        PolicyCmd::Presets => {
            for p in fak_engine::presets::PRESETS {
                outln!("{:<28} {}", format!("preset:{}", p.name), p.summary)?;
            }
        }
        PolicyCmd::Check { policy } => {
            let p = policy.load()?;
            let m = p.manifest();
            outln!(
                "{policy}: valid ({} allowed, {} prefixes, {} denied, {} tools with argument rules)",
                m.allow.len(),
                m.allow_prefix.len(),
                m.deny.len(),
                m.args.len()
            )?;
        }
    }
    Ok(())
}

pub(crate) fn preflight(a: PreflightArgs) -> Result<(), CliError> {
    let mut p = match &a.policy {
        Some(f) => f.load()?,
        None => Policy::new(Policy::default_manifest())?,
    };
    let v = p.adjudicate_with(
        "preflight",
        &ToolCall {
            name: a.tool.clone(),
            arguments: a.args.clone(),
        },
        &Taint {
            tainted: a.tainted,
            flags: a.flags.into_iter().collect(),
        },
    );
    match v.reason {
        None => {
            outln!("allow {}: {}", a.tool, v.detail)?;
            Ok(())
        }
        Some(r) => {
            outln!("deny {} {}: {}", a.tool, r.as_str(), v.detail)?;
            Err(CliError::Status(3))
        }
    }
}

pub(crate) fn quarantine(cmd: QuarantineCmd) -> Result<(), CliError> {
    let dir = store_dir();
    let mut store = PageStore::open(&dir)?;
    match cmd {
        QuarantineCmd::List => {
            let mut n = 0;
            for i in store.list() {
                n += 1;
                let kind = match i.head.kind {
                    StoredKind::Quarantined if i.head.cleared => "quarantined (cleared)",
                    StoredKind::Quarantined => "quarantined",
                    StoredKind::PagedOut => "paged out",
                };
                outln!(
                    "{:<6} {:<22} {:<22} tool {:<16} {} bytes  conversation {}",
                    i.head.id,
                    kind,
                    i.head.reason.map_or("-", |r| r.as_str()),
                    i.head.tool,
                    i.len,
                    i.head.conversation
                )?;
            }
            if n == 0 {
                outln!("(nothing stored in {})", dir.display())?;
            }
            for (p, why) in store.damaged() {
                outln!("damaged, skipped: {}: {why}", p.display())?;
            }
        }
        QuarantineCmd::Show { id } => {
            let i = store.get(&id).map_err(|e| match e {
                fak_ctxmmu::StoreError::NotFound(_) => {
                    fail(format!("no stored item '{id}' in {}", dir.display()))
                }
                e => e.into(),
            })?;
            outln!("id: {}\nkind: {:?}\nreason: {}\ndetector: {}\ntool: {}\nconversation: {}\nsha256: {}\nbytes: {}\ncleared: {}",
                i.head.id, i.head.kind, i.head.reason.map_or("-", |r| r.as_str()), i.head.detector.as_deref().unwrap_or("-"), i.head.tool, i.head.conversation, i.head.digest, i.content.len(), i.head.cleared)?;
            match store.read(&id) {
                Ok(text) => outln!("---\n{text}")?,
                Err(e) => outln!("--- content withheld: {e} (fak quarantine clear {id})")?,
            }
        }
        QuarantineCmd::Clear { id } => {
            store.clear(&id)?;
            outln!("cleared {id}")?;
        }
    }
    Ok(())
}
