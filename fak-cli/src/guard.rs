//! `fak guard [serve options] -- CMD ARGS...`: runs an agent's command line with fak in
//! front of it. Wiring only.
//!
//! The gateway of `fak serve` (same options, same engines, same boundary) starts in this
//! process on a free loopback port, with a fresh API key for this run that it requires
//! (besides any `--api-key-env` keys). The command then runs with, in its environment
//! only, `ANTHROPIC_BASE_URL=http://127.0.0.1:PORT`, `OPENAI_BASE_URL=http://127.0.0.1:PORT/v1`
//! and the key in `ANTHROPIC_API_KEY` and `OPENAI_API_KEY` (the variables the official
//! SDKs and the agents built on them read; `ANTHROPIC_AUTH_TOKEN` is removed, as Claude
//! Code would send it in the key's place). stdin, stdout and stderr are the command's;
//! the server logs only warnings, to stderr (or everything to `--log-file`). SIGTERM
//! is passed on to the command, and SIGINT too unless this process is in the
//! terminal's foreground process group (then the terminal has sent it to the command
//! already). When the command ends, the server shuts down, a summary of what the
//! boundary did goes to stderr, and the exit status is the command's (128 + the signal
//! number when a signal ended it; 127 when it cannot be started). fak guard's own
//! errors before the command runs (usage, option values, the server not starting) exit
//! 2, clap's code for a usage error, with the reason on stderr ([`EXIT_STATUS`]).

use crate::serve::{build, run, ServeArgs};
use crate::{fail, CliError};
use fak_engine::Readiness;
use fak_gateway::metrics::Metrics;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// The exit statuses, as `fak guard --help` lists them.
pub(crate) const EXIT_STATUS: &str = "\
Exit status:
  the command's own status when it ran and exited
  128+N  the command was ended by signal N
  2      fak guard's own error before the command ran: a usage error (no `--`, no
         command, an unknown or bad option) or the server could not start (the reason
         is on stderr, prefixed `fak: error:`)
  126    the command could not be run (e.g. not executable)
  127    the command was not found";

/// fak guard's own failure before the command runs: the reason on stderr, exit 2.
fn own_error(e: CliError) -> CliError {
    match e {
        CliError::Msg(m) => {
            eprintln!("fak: error: {m}");
            CliError::Status(2)
        }
        CliError::Io(e) => {
            eprintln!("fak: error: {e}");
            CliError::Status(2)
        }
        e => e,
    }
}

#[derive(clap::Args)]
#[command(after_help = EXIT_STATUS)]
pub(crate) struct GuardArgs {
    #[command(flatten)]
    serve: ServeArgs,
    /// Write the server's log (every request line included) to this file instead of
    /// printing its warnings on stderr.
    #[arg(long)]
    log_file: Option<PathBuf>,
    /// Longest wait for the engine to become ready before the command starts, seconds
    /// (the command starts then anyway, and its requests get 503 until it is).
    #[arg(long, default_value_t = 300)]
    ready_timeout_s: u64,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

/// A fresh key: 32 random bytes as hex.
fn fresh_key() -> Result<String, CliError> {
    use std::io::Read as _;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| fail(format!("reading /dev/urandom for the run's key: {e}")))?;
    let mut s = String::from("fak-guard-");
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    Ok(s)
}

fn init_logging(log_file: Option<&PathBuf>) -> Result<(), CliError> {
    let base = tracing_subscriber::fmt().with_target(false);
    match log_file {
        Some(p) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| fail(format!("--log-file {}: {e}", p.display())))?;
            base.with_writer(std::sync::Mutex::new(f))
                .with_ansi(false)
                .init();
        }
        None => base
            .with_writer(std::io::stderr)
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .init(),
    }
    Ok(())
}

pub(crate) fn guard(a: GuardArgs) -> Result<(), CliError> {
    let started = start(&a).map_err(own_error)?;
    run_command(&a.command, started)
}

/// The gateway, started for the command.
struct Started {
    key: String,
    rt: tokio::runtime::Runtime,
    addr: std::net::SocketAddr,
    stop_tx: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), CliError>>,
    metrics: std::sync::Arc<Metrics>,
    /// Its kept conversations are written at the end (`--kv-persist`).
    driver: std::sync::Arc<dyn fak_engine::EngineDriver>,
    /// `--kv-persist`'s folder lock, held until that write.
    kv_lock: Option<fak_engine::persist::DirLock>,
}

/// Everything before the command runs: its errors are fak guard's own.
fn start(a: &GuardArgs) -> Result<Started, CliError> {
    if a.command.is_empty() {
        return Err(fail(
            "no command given (fak guard [options] -- CMD ARGS...)",
        ));
    }
    init_logging(a.log_file.as_ref())?;
    let key = fresh_key()?;
    let mut built = build(&a.serve, Some(key.clone()))?;
    let metrics = std::sync::Arc::clone(&built.metrics);
    let kv_lock = built.kv_lock.take();
    let driver = std::sync::Arc::clone(&built.driver);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| fail(format!("starting the runtime: {e}")))?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(("127.0.0.1", 0)))
        .map_err(|e| fail(format!("binding a loopback port: {e}")))?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(run(built, listener, false, async {
        let _ = stop_rx.await;
    }));
    // The command's first request should find the engine ready.
    let deadline = Instant::now() + Duration::from_secs(a.ready_timeout_s);
    while driver.readiness() == Readiness::Loading && Instant::now() < deadline {
        if server.is_finished() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if server.is_finished() {
        return match rt.block_on(server) {
            Ok(Err(e)) => Err(e),
            _ => Err(fail("the server stopped before the command started")),
        };
    }
    if let Readiness::Failed(m) = driver.readiness() {
        eprintln!("fak guard: warning: the engine is not ready ({m}); starting the command anyway");
    }
    Ok(Started {
        key,
        rt,
        addr,
        stop_tx,
        server,
        metrics,
        driver,
        kv_lock,
    })
}

/// Runs the command in front of the started gateway, then stops it; the command's
/// status is the result.
fn run_command(command: &[String], started: Started) -> Result<(), CliError> {
    let Started {
        key,
        rt,
        addr,
        stop_tx,
        server,
        metrics,
        driver,
        kv_lock,
    } = started;
    let key = key.as_str();
    let t0 = Instant::now();
    let Some((program, args)) = command.split_first() else {
        return Err(fail(
            "no command given (fak guard [options] -- CMD ARGS...)",
        ));
    };
    let child = Command::new(program)
        .args(args)
        .env("ANTHROPIC_BASE_URL", format!("http://{addr}"))
        .env("OPENAI_BASE_URL", format!("http://{addr}/v1"))
        .env("ANTHROPIC_API_KEY", key)
        .env("OPENAI_API_KEY", key)
        // A bearer token of the user's would be sent instead of the run's key (and be
        // refused): the command authenticates with the run's key only.
        .env_remove("ANTHROPIC_AUTH_TOKEN")
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fak guard: error: running {program}: {e}");
            let _ = stop_tx.send(());
            let _ = rt.block_on(server);
            return Err(CliError::Status(
                if e.kind() == std::io::ErrorKind::NotFound {
                    127
                } else {
                    126
                },
            ));
        }
    };
    let forward = rt.spawn(forward_signals(child.id()));
    let status = child.wait();
    forward.abort();
    let _ = stop_tx.send(());
    let _ = rt.block_on(server);
    rt.shutdown_timeout(Duration::from_millis(500));
    crate::serve::persist_at_exit(driver.as_ref());
    drop(kv_lock);
    let status = status.map_err(|e| fail(format!("waiting for {program}: {e}")))?;
    let code = exit_code(&status);
    eprint!(
        "{}",
        summary(program, code, &status, t0.elapsed(), &metrics)
    );
    match code {
        0 => Ok(()),
        n => Err(CliError::Status(n)),
    }
}

/// The status `fak guard` exits with: the command's code, or 128 + the signal that
/// ended it (as shells report it).
fn exit_code(s: &std::process::ExitStatus) -> u8 {
    if let Some(c) = s.code() {
        return u8::try_from(c & 0xff).unwrap_or(1);
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt as _;
        if let Some(sig) = s.signal() {
            return u8::try_from(128 + sig).unwrap_or(255);
        }
    }
    1
}

/// Passes SIGTERM (always) and SIGINT (unless the terminal delivered it to the command
/// already) on to process `pid`, until aborted.
#[cfg(unix)]
async fn forward_signals(pid: u32) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::warn!(
            "cannot watch SIGINT/SIGTERM; they end fak guard without reaching the command"
        );
        return;
    };
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    loop {
        let sig = tokio::select! {
            _ = int.recv() => {
                if in_terminal_foreground() {
                    continue;
                }
                libc::SIGINT
            }
            _ = term.recv() => libc::SIGTERM,
        };
        // SAFETY: kill(2) on the child's pid, which is ours until we reap it (the
        // forwarder is aborted before `wait` returns to the caller's next step).
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

#[cfg(not(unix))]
async fn forward_signals(_pid: u32) {
    let _ = tokio::signal::ctrl_c().await;
}

/// Whether this process is in its terminal's foreground process group (a Ctrl-C at the
/// terminal then reaches the command, which shares the group, without our help).
#[cfg(unix)]
fn in_terminal_foreground() -> bool {
    // SAFETY: plain queries of this process's state; -1 (no terminal) never equals a
    // process group id.
    unsafe { libc::tcgetpgrp(0) == libc::getpgrp() }
}

/// The one-screen account of the run: the command's status, requests by status, tool
/// calls allowed and denied (by reason), tool results screened (by verdict and reason).
fn summary(
    program: &str,
    code: u8,
    status: &std::process::ExitStatus,
    took: Duration,
    m: &Metrics,
) -> String {
    let mut s = String::new();
    let how = if status.code().is_some() {
        format!("exited with status {code}")
    } else {
        format!(
            "was killed by signal {} (status {code})",
            code.saturating_sub(128)
        )
    };
    let _ = writeln!(
        s,
        "fak guard: {program} {how} after {:.1} s",
        took.as_secs_f64()
    );
    let requests = m.requests();
    let total: u64 = requests.values().sum();
    let mut failed: Vec<String> = requests
        .iter()
        .filter(|((_, st), _)| *st >= 400)
        .map(|((route, st), n)| format!("{route} {st} x{n}"))
        .collect();
    failed.truncate(8);
    let _ = writeln!(
        s,
        "  requests: {total}{}",
        if failed.is_empty() {
            String::new()
        } else {
            format!(" (failed: {})", failed.join(", "))
        }
    );
    let calls = m.tool_calls();
    let allowed = count(&calls, "allow");
    let denied = count(&calls, "deny");
    let _ = writeln!(
        s,
        "  tool calls: {} proposed, {allowed} allowed, {denied} denied{}",
        allowed + denied,
        by_reason(&calls, "deny")
    );
    let results = m.tool_results();
    let admitted = count(&results, "admit");
    let paged = count(&results, "page_out");
    let quarantined = count(&results, "quarantine");
    let _ = writeln!(
        s,
        "  tool results: {} screened, {admitted} admitted, {paged} paged out, {quarantined} quarantined{}",
        admitted + paged + quarantined,
        by_reason(&results, "quarantine")
    );
    s
}

fn count(m: &BTreeMap<(String, String), u64>, verdict: &str) -> u64 {
    m.iter()
        .filter(|((v, _), _)| v == verdict)
        .map(|(_, n)| n)
        .sum()
}

/// ` (REASON n, ...)` of one verdict's counts; empty when there are none.
fn by_reason(m: &BTreeMap<(String, String), u64>, verdict: &str) -> String {
    let parts: Vec<String> = m
        .iter()
        .filter(|((v, _), _)| v == verdict)
        .map(|((_, r), n)| format!("{r} {n}"))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}
