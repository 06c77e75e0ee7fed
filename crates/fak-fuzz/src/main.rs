//! `fak-fuzz`: runs fak's fuzz targets for a bounded time each, on stable Rust (see the
//! library docs). Prints per target the inputs run, distinct outcomes and crashes, then
//! a closing `N passed, N failed` line over the targets; exits 1 when any input crashed
//! (2 on a hang, 3 on unbounded memory, from the guards).
//!
//! ```text
//! fak-fuzz [--secs N] [--seed N] [--max-len BYTES] [--timeout-secs N] [--mem-mb N]
//!          [--out DIR] [TARGET...]          # targets: gguf safetensors tokenizer chat gateway
//! fak-fuzz --replay FILE TARGET             # run one saved input
//! ```

use clap::Parser;
use fak_fuzz::{targets, LimitedAlloc, Options};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[global_allocator]
static ALLOC: LimitedAlloc = LimitedAlloc;

/// Fuzz fak's parsers, tokenizers, chat templates and gateway for a bounded time.
#[derive(Parser)]
#[command(name = "fak-fuzz")]
struct Args {
    /// Seconds each target runs.
    #[arg(long, default_value_t = 30.0)]
    secs: f64,
    /// Seed of the mutations (the same seed and build give the same inputs).
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Longest input, bytes.
    #[arg(long, default_value_t = 16 << 10)]
    max_len: usize,
    /// Seconds one input may run before it counts as a hang.
    #[arg(long, default_value_t = 10.0)]
    timeout_secs: f64,
    /// Live heap limit, MiB, past which an input counts as unbounded memory.
    #[arg(long, default_value_t = 2048)]
    mem_mb: usize,
    /// Folder for crashing inputs (default: `fuzz/` beside the binary).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Runs this one saved input through the single TARGET given, and prints its outcome.
    #[arg(long)]
    replay: Option<PathBuf>,
    /// Targets to run (default: all).
    targets: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let names: Vec<String> = if args.targets.is_empty() {
        targets::NAMES.iter().map(|s| s.to_string()).collect()
    } else {
        args.targets.clone()
    };
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if !positive(args.secs) || !positive(args.timeout_secs) {
        eprintln!("fak-fuzz: --secs and --timeout-secs must be positive numbers of seconds");
        return ExitCode::FAILURE;
    }
    if let Some(file) = &args.replay {
        let [name] = names.as_slice() else {
            eprintln!("fak-fuzz: --replay takes exactly one TARGET");
            return ExitCode::FAILURE;
        };
        let input = match std::fs::read(file) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("fak-fuzz: {}: {e}", file.display());
                return ExitCode::FAILURE;
            }
        };
        let mut t = match targets::by_name(name) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("fak-fuzz: {e}");
                return ExitCode::FAILURE;
            }
        };
        return match fak_fuzz::replay(&mut t, &input) {
            Ok(label) => {
                println!("fak-fuzz {name}: ok ({label})");
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("fak-fuzz {name}: CRASH: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let opts = Options {
        duration: Duration::from_secs_f64(args.secs),
        seed: args.seed,
        max_len: args.max_len,
        timeout: Duration::from_secs_f64(args.timeout_secs),
        mem_limit: args.mem_mb << 20,
        out_dir: args.out.clone().unwrap_or_else(fak_fuzz::default_out_dir),
    };
    let (mut passed, mut failed) = (0, 0);
    for name in &names {
        let mut t = match targets::by_name(name) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("fak-fuzz {name}: cannot start: {e}");
                failed += 1;
                continue;
            }
        };
        match fak_fuzz::fuzz(&mut t, &opts) {
            Ok(r) => {
                println!(
                    "fak-fuzz {name}: {} inputs in {:.0} s, {} distinct outcomes, corpus {}, {} crashes",
                    r.inputs,
                    opts.duration.as_secs_f64(),
                    r.outcomes,
                    r.corpus,
                    r.crashes
                );
                if r.crashes == 0 {
                    passed += 1;
                } else {
                    failed += 1;
                }
            }
            Err(e) => {
                eprintln!("fak-fuzz {name}: {e}");
                failed += 1;
            }
        }
    }
    println!("fuzz: {passed} passed, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
