//! `fak serve`: the HTTP APIs of fak-gateway over a fak-engine driver. Wiring only.

use crate::{fail, parse_threads, resolve_or_pull, CliError, WeightsArg};
use fak_catalog::DEFAULT_MODEL;
use fak_engine::alias::{Alias, AliasedDriver};
use fak_engine::registry::Registry;
use fak_engine::route::{Route, RoutedDriver};
use fak_engine::{upstream, EngineConfig, EngineDriver, Readiness};
use fak_gateway::{router_with_metrics, Boundary, GatewayConfig};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// A GGUF file, a safetensors folder, or a catalog name (fetched if not cached).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Address to bind (loopback by default; use 0.0.0.0 to serve the network, ideally
    /// with --api-key-env).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Engine driver id: inkernel (the model in this process; the default),
    /// openai-upstream (another server's OpenAI-compatible API generates, behind this
    /// server's boundary; needs --base-url), anthropic-upstream (another server's
    /// Anthropic Messages API generates; /v1/messages requests are forwarded as the
    /// client sent them, with its x-api-key; needs --base-url) or mock (no model; tests).
    #[arg(long)]
    engine: Option<String>,
    /// Serve several engines side by side, chosen by each request's `model`:
    /// MODEL=ENGINE, repeatable, the first the default (e.g. --route smollm2=inkernel
    /// --route big=openai-upstream). MODEL is the id clients send and the engine serves
    /// it under: the inkernel engine serves --model as MODEL, an upstream engine the
    /// upstream's model MODEL at --base-url, or at its own URL with MODEL=ENGINE@URL.
    /// Excludes --engine.
    #[arg(long = "route", value_name = "MODEL=ENGINE[@URL]", value_parser = parse_route)]
    routes: Vec<Route>,
    /// Upstream engines: an upstream server, http://HOST:PORT (its /v1 URL works too).
    /// Repeat it for several: each request goes to the least-loaded healthy one.
    #[arg(long)]
    base_url: Vec<String>,
    /// Upstream engines without --route: the one model to serve, by the upstream's name
    /// for it (default: every model the upstream's /v1/models lists).
    #[arg(long)]
    upstream_model: Option<String>,
    /// Upstream engines: name of an environment variable holding the operator's key for
    /// the upstream (openai-upstream: sent as `Authorization: Bearer KEY`;
    /// anthropic-upstream: sent as `x-api-key: KEY` in place of the client's).
    #[arg(long)]
    upstream_api_key_env: Option<String>,
    /// Upstream engines: longest wait to connect and get the response head, seconds.
    #[arg(long, default_value_t = 300)]
    upstream_timeout_s: u64,
    /// Upstream engines: longest silence mid-reply, seconds, before the request fails.
    #[arg(long, default_value_t = 120)]
    upstream_idle_timeout_s: u64,
    /// Upstream engines: extra attempts after a connection failure, a 5xx or a timeout,
    /// while nothing has reached the client yet.
    #[arg(long, default_value_t = 2)]
    upstream_retries: u32,
    /// Upstream engines: seconds between health checks of each upstream (GET /health,
    /// where a 404 passes too; /v1/models until its models are known); a failing one is
    /// out of rotation until a check passes.
    #[arg(long, default_value_t = 5)]
    upstream_health_interval_s: u64,
    /// Requests generated at once (worker slots); more wait in a queue. With more than
    /// one, their forward passes run batched (continuous batching): one pass over the
    /// weights advances every slot that is decoding, and long prompts are prefilled in
    /// pieces between decode steps. Each reply is the same bits as alone. The default,
    /// 4, is llama.cpp's server's (`--parallel -1`, auto); 1 runs one request at a time.
    #[arg(long, default_value_t = 4, value_parser = parse_threads)]
    parallel: usize,
    /// Requests that may wait for a slot; beyond this, 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Memory budget of the KV reuse cache (recent conversations kept between
    /// requests), MB; 0 disables reuse. Not a limit of one generation (--max-kv-mb).
    #[arg(long, default_value_t = 512)]
    kv_budget_mb: usize,
    /// Keep conversations across restarts: at shutdown and every 30 s, write the KV
    /// reuse cache's kept conversations (most recent first, within --kv-budget-mb) to
    /// session files in this folder (a subfolder per model and weight mode), and read
    /// them back at start, so a returning client's next turn prefills only its new tokens. A file
    /// that is damaged or of another model is refused (logged, renamed *.rejected);
    /// revoked tool results are never restored.
    #[arg(long, value_name = "DIR")]
    kv_persist: Option<std::path::PathBuf>,
    /// When a chat conversation, with room for its reply (max_tokens; on the Anthropic
    /// wire at most a quarter of the window; 512 when not given), outgrows the context
    /// window: `error` (a
    /// 400), `rebuild` (drop the oldest whole turns, keep the leading system turn and
    /// the last turn, prefill the rest anew: exact) or `shift` (drop them from the
    /// cached conversation in place and prefill only the new tokens: fast, an
    /// approximation, as llama.cpp's context shift). A request's `context_overflow`
    /// field overrides it.
    #[arg(long, value_enum, default_value_t = ContextOverflowArg::Error)]
    context_overflow: ContextOverflowArg,
    /// Serve a context window of at most this many tokens (default: the model's
    /// trained context), as llama.cpp's -c and vLLM's --max-model-len.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    context_length: Option<u64>,
    /// How the KV cache stores its rows: f32 (the values the forward pass computed,
    /// 69 KB a token for SmolLM2), f16 (23 KB, llama.cpp's default) or q8_0 (12 KB).
    /// Every exact guarantee of the cache (decode == prefill, evict == never-saw,
    /// prefix clone == recompute) holds on each, for its rounded rows; the compact
    /// types move the output slightly from f32's (docs/performance.md). f32 is the
    /// default as the cache the HF proof holds for; f16 reads half the bytes a step,
    /// which makes long-context decode faster.
    #[arg(long, value_enum, default_value_t = crate::KvTypeArg::F32)]
    kv_type: crate::KvTypeArg,
    /// Most KV cache one generation may hold (its prompt and reply), MB: a prompt
    /// needing more gets 400, a reply reaching it ends as at the context's end
    /// (finish_reason "length", stop_reason "max_tokens"). Default: a quarter of the
    /// machine's memory divided by --parallel.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_kv_mb: Option<u64>,
    /// Name of an environment variable holding an API key, or several separated by
    /// commas; when given, /v1/* requires `Authorization: Bearer KEY` or `x-api-key:
    /// KEY` with one of them. Each key is its own KV cache partition: requests made with
    /// different keys never share a cached prefix.
    #[arg(long)]
    api_key_env: Option<String>,
    /// Name of an environment variable holding the operator key: when given, the
    /// operator routes (/v1/fak/revoke, /v1/fak/policy/reload) require it instead of the
    /// API key, so API clients cannot revoke content or reload the policy.
    #[arg(long)]
    admin_key_env: Option<String>,
    /// Largest request body, MB; larger ones get 413.
    #[arg(long, default_value_t = 8)]
    max_body_mb: usize,
    /// Longest wait for a response, seconds, after which the request gets 504 and its
    /// generation is cancelled (for a stream: the wait until it starts); 0: no limit.
    #[arg(long, default_value_t = 600)]
    request_timeout_s: u64,
    /// Longest wait for a whole request head, seconds, from a connection's opening or
    /// its previous response (so also the keep-alive idle limit); then the connection
    /// is closed. 0: no limit.
    #[arg(long, default_value_t = 10)]
    header_timeout_s: u64,
    /// Longest wait on a stalled client mid-request, seconds: a request body's next
    /// bytes (then 400) or the client reading a response (then the connection is
    /// closed and the generation cancelled). A stream the client reads is never cut.
    /// 0: no limit.
    #[arg(long, default_value_t = 60)]
    idle_timeout_s: u64,
    /// Most connections open at once; at the cap, new ones wait in the listen backlog
    /// until one closes.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_connections: u64,
    /// On SIGTERM or SIGINT: seconds requests in flight may go on (requests still
    /// queued for a worker get 503 at once); then a waiting request gets 503 and a
    /// stream a final error event, every generation still running is cancelled, and the
    /// process exits 0. A second signal exits at once.
    #[arg(long, default_value_t = 10)]
    shutdown_grace_s: u64,
    /// The sampling seed of requests that carry none (a request's own `seed` wins).
    /// Default: a fresh random seed per request, so a repeated request gets another
    /// sample, as OpenAI's and Anthropic's APIs do; with a seed, a repeated request gets
    /// the same reply (Anthropic's Messages and OpenAI's Responses API have no `seed`
    /// field, and refuse one). 0 to 18446744073709551615: a request's `seed`, an i64 on
    /// the wire, is taken as its 64 bits, so a request's -1 is this 18446744073709551615.
    #[arg(long)]
    seed: Option<u64>,
    /// Threads for the matrix products (default: all cores).
    #[arg(long, value_parser = parse_threads)]
    threads: Option<usize>,
    /// Weights of the in-kernel engine: `exact` (f32, proven against HF) or `native`
    /// (quantized matrices kept in the file's block format; faster, logits differ
    /// slightly).
    #[arg(long, value_enum, default_value_t = WeightsArg::Exact)]
    weights: WeightsArg,
    /// Tool-call policy: a manifest file (fak-policy/1 JSON; see `fak policy dump`),
    /// reloadable with POST /v1/fak/policy/reload, or `preset:NAME`, a manifest shipped
    /// in the binary (`fak policy presets`). Default: the built-in policy.
    #[arg(long, value_parser = crate::kernel::parse_policy_arg)]
    policy: Option<crate::kernel::PolicyArg>,
    /// Serve a model under another id too: NAME=MODEL, repeatable (e.g. --alias
    /// 'claude-*=smollm2-135m-instruct'); `*` in NAME matches any run of characters.
    /// A request naming NAME is served by MODEL and answered with the id it asked for;
    /// a served model's own id always wins; /v1/models lists the aliases without `*`.
    #[arg(long = "alias", value_name = "NAME=MODEL", value_parser = parse_alias)]
    aliases: Vec<Alias>,
    /// Do not cut revoked or newly quarantined tool results out of cached
    /// conversations (then a cached prefix may still hold them).
    #[arg(long)]
    no_kv_evict: bool,
    /// Audit log of every screened tool result and adjudicated tool call (JSON lines,
    /// appended). Default: $FAK_HOME/audit.jsonl.
    #[arg(long)]
    audit_log: Option<std::path::PathBuf>,
    /// Rotate the audit log past this many MB (to AUDIT.1 .. AUDIT.N, see --audit-keep);
    /// 0: never rotate.
    #[arg(long, default_value_t = 100)]
    audit_max_mb: u64,
    /// Rotated audit logs kept.
    #[arg(long, default_value_t = 5)]
    audit_keep: usize,
    /// Refuse (503) a request whose audit record cannot be written, and deny its proposed
    /// calls. Default: fail open (the request proceeds; the failure is logged and
    /// counted in /metrics as fak_audit_write_failures_total).
    #[arg(long)]
    audit_fail_closed: bool,
    /// Most items in the page-out/quarantine store; past it, paged-out items are evicted
    /// oldest first, then cleared quarantined ones; quarantined originals awaiting a
    /// clear never are (a quarantine into a store full of those keeps no original).
    #[arg(long, default_value_t = 10_000)]
    store_max_items: usize,
    /// Most MB of content in the page-out/quarantine store (evicted as --store-max-items).
    #[arg(long, default_value_t = 1024)]
    store_max_mb: u64,
    /// Tool results larger than this many KiB reach the model as a stub with a
    /// 200-character preview (the original is kept in the store); at most 4096 (larger
    /// results are quarantined OVERSIZED).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=4096))]
    max_tool_result_kb: u64,
}

pub(crate) fn serve(args: ServeArgs) -> Result<(), CliError> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let mut built = build(&args, None)?;
    let driver = std::sync::Arc::clone(&built.driver);
    // Held until the last write at exit.
    let kv_lock = built.kv_lock.take();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| fail(format!("starting the runtime: {e}")))?;
    let served = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .map_err(|e| fail(format!("binding {}:{}: {e}", args.host, args.port)))?;
        run(built, listener, true, shutdown_signal()).await
    });
    // Generations still running on blocking threads are not waited for.
    rt.shutdown_timeout(Duration::from_millis(500));
    persist_at_exit(driver.as_ref());
    drop(kv_lock);
    if served.is_ok() {
        tracing::info!("shut down");
    }
    served
}

/// `--context-overflow` (see [`fak_engine::ContextOverflow`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ContextOverflowArg {
    /// Refuse the request (400).
    Error,
    /// Drop the oldest turns from the cached conversation in place (approximate).
    Shift,
    /// Drop the oldest turns and prefill the rest anew (exact).
    Rebuild,
}

/// At the end of a shutdown: once the generations cancelled by it have ended (each
/// within a token, keeping its session; waited for at most 5 s), writes the kept
/// conversations (`--kv-persist`) and logs what was written.
pub(crate) fn persist_at_exit(driver: &dyn EngineDriver) {
    if let Some(r) = driver.persist_kv(Duration::from_secs(5)) {
        tracing::info!(
            "--kv-persist: wrote {} kept conversation(s), {:.1} MB{}",
            r.sessions,
            r.bytes as f64 / (1u64 << 20) as f64,
            if r.skipped > 0 {
                format!(
                    " ({} left out: over --kv-budget-mb or not writable)",
                    r.skipped
                )
            } else {
                String::new()
            }
        );
    }
}

/// A gateway ready to serve: what [`build`] made of the flags.
pub(crate) struct Built {
    app: axum::Router,
    gateway: GatewayConfig,
    pub(crate) driver: std::sync::Arc<dyn EngineDriver>,
    routed: Option<std::sync::Arc<RoutedDriver>>,
    routes: Vec<Route>,
    aliases: Vec<Alias>,
    model_path: Option<std::path::PathBuf>,
    /// What the start log says of the boundary.
    policy_name: String,
    /// `--kv-persist`'s folder lock, held while the process lives.
    pub(crate) kv_lock: Option<fak_engine::persist::DirLock>,
    store_dir: std::path::PathBuf,
    audit_path: std::path::PathBuf,
    screen_damaged: Vec<(std::path::PathBuf, String)>,
    kv_evict: bool,
    /// Every request and boundary decision, counted (`/metrics` reads them too).
    pub(crate) metrics: std::sync::Arc<fak_gateway::metrics::Metrics>,
    t0: Instant,
}

/// The engines `--engine` and `--route` name, the default first: the in-kernel one,
/// the upstream ones, the mock.
fn registry() -> Registry {
    let mut r = Registry::empty();
    r.add(fak_engine::inkernel::SPEC);
    fak_upstream::register(&mut r);
    r.add(fak_engine::mock::SPEC);
    r
}

/// Builds the engine, the boundary and the router from `args` (a bad flag, policy,
/// store or model stops here). `extra_key`: one more API key the gateway requires (and
/// takes first): `fak guard`'s per-run key.
pub(crate) fn build(args: &ServeArgs, extra_key: Option<String>) -> Result<Built, CliError> {
    if !args.routes.is_empty() && args.engine.is_some() {
        return Err(fail(
            "--engine and --route exclude each other: name each route's engine (--route MODEL=ENGINE)",
        ));
    }
    let engine = args
        .engine
        .as_deref()
        .unwrap_or(fak_engine::inkernel::SPEC.id);
    let registry = registry();
    let spec = *registry.get(engine).map_err(|e| fail(e.to_string()))?;
    for r in &args.routes {
        registry
            .get(&r.engine)
            .map_err(|e| fail(format!("route {}={}: {e}", r.model, r.engine)))?;
    }
    // The engines in use: the one --engine, or each route's.
    let engines: Vec<&str> = if args.routes.is_empty() {
        vec![spec.id]
    } else {
        args.routes.iter().map(|r| r.engine.as_str()).collect()
    };
    let is_upstream = |e: &str| fak_upstream::SPECS.iter().any(|s| s.id == e);
    let mut api_keys = api_keys(key_from_env("--api-key-env", args.api_key_env.as_deref())?)?;
    if let Some(k) = extra_key {
        api_keys.insert(0, k);
    }
    let api_key = (!api_keys.is_empty()).then(|| api_keys.remove(0));
    let upstream_key = key_from_env(
        "--upstream-api-key-env",
        args.upstream_api_key_env.as_deref(),
    )?;
    let admin_key = key_from_env("--admin-key-env", args.admin_key_env.as_deref())?;
    let mut config = EngineConfig {
        parallel: args.parallel,
        max_queue: args.max_queue,
        kv_budget_bytes: args.kv_budget_mb.saturating_mul(1 << 20),
        max_kv_bytes: args
            .max_kv_mb
            .map(|m| usize::try_from(m.saturating_mul(1 << 20)).unwrap_or(usize::MAX)),
        threads: args.threads,
        weights: args.weights.into(),
        kv_evict: !args.no_kv_evict,
        kv_type: args.kv_type.into(),
        context_length: args
            .context_length
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        context_overflow: match args.context_overflow {
            ContextOverflowArg::Error => fak_engine::ContextOverflow::Error,
            ContextOverflowArg::Shift => fak_engine::ContextOverflow::Shift,
            ContextOverflowArg::Rebuild => fak_engine::ContextOverflow::Rebuild,
        },
        ..EngineConfig::default()
    };
    // The boundary first: a bad policy or an unreadable store stops the start.
    let policy = match &args.policy {
        Some(p) => p.load()?,
        None => fak_engine::policy::Policy::builtin(),
    };
    let store_dir = crate::kernel::store_dir();
    let store = fak_ctxmmu::PageStore::open_with(
        &store_dir,
        fak_ctxmmu::StoreLimits {
            max_items: args.store_max_items,
            max_bytes: args.store_max_mb.saturating_mul(1 << 20),
        },
    )
    .map_err(|e| fail(format!("the quarantine store: {e}")))?;
    let audit_path = args
        .audit_log
        .clone()
        .unwrap_or_else(|| fak_catalog::fak_home().join("audit.jsonl"));
    let audit = fak_ctxmmu::AuditLog::to_file_with(
        &audit_path,
        fak_ctxmmu::AuditConfig {
            max_bytes: (args.audit_max_mb > 0).then(|| args.audit_max_mb.saturating_mul(1 << 20)),
            keep: args.audit_keep,
            fail_closed: args.audit_fail_closed,
            ..fak_ctxmmu::AuditConfig::default()
        },
    );
    let screen_config = fak_ctxmmu::ScreenConfig {
        page_out_bytes: (args.max_tool_result_kb as usize) << 10,
        ..fak_ctxmmu::ScreenConfig::default()
    };
    let screen_damaged = store.damaged().to_vec();
    let mut kv_lock = None;
    let screen =
        fak_ctxmmu::Screen::with(fak_ctxmmu::default_detectors(), screen_config, store, audit);
    if let Some(dir) = &args.kv_persist {
        // Checked and locked before anything starts: an unusable folder, or one another
        // server writes, stops the start rather than losing conversations later.
        kv_lock = Some(fak_engine::persist::prepare_dir(dir).map_err(fail)?);
        config.kv_persist = Some(fak_engine::persist::KvPersistConfig {
            dir: dir.clone(),
            max_bytes: config.kv_budget_bytes as u64,
            flush_interval: fak_engine::persist::FLUSH_INTERVAL,
        });
        // Restored conversations are cut before any result revoked so far.
        let r = screen.revocations();
        config.revoked = r
            .digests()
            .map(|d| fak_engine::Revocation {
                digest: Some(d.to_string()),
                tool_call_id: None,
            })
            .chain(r.calls().map(|c| fak_engine::Revocation {
                digest: None,
                tool_call_id: Some(c.to_string()),
            }))
            .collect();
    }
    if engines.iter().any(|e| is_upstream(e)) {
        if args.routes.is_empty() && args.base_url.is_empty() {
            return Err(fail(format!(
                "--engine {} needs --base-url http://HOST:PORT",
                spec.id
            )));
        }
        if let Some(r) = args
            .routes
            .iter()
            .find(|r| is_upstream(&r.engine) && r.base_url.is_none() && args.base_url.is_empty())
        {
            return Err(fail(format!(
                "--route {}={} needs --base-url http://HOST:PORT (or its own: {}={}@http://HOST:PORT)",
                r.model, r.engine, r.model, r.engine
            )));
        }
        if !args.routes.is_empty() && args.upstream_model.is_some() {
            return Err(fail(
                "--upstream-model is for --engine; with --route, each route names its model",
            ));
        }
        if args.upstream_timeout_s == 0
            || args.upstream_idle_timeout_s == 0
            || args.upstream_health_interval_s == 0
        {
            return Err(fail(
                "--upstream-timeout-s, --upstream-idle-timeout-s and --upstream-health-interval-s must be at least 1",
            ));
        }
        config.upstream = upstream::UpstreamConfig {
            base_urls: args.base_url.clone(),
            model: args.upstream_model.clone(),
            api_key: upstream_key,
            timeout: Duration::from_secs(args.upstream_timeout_s),
            idle_timeout: Duration::from_secs(args.upstream_idle_timeout_s),
            retries: args.upstream_retries,
            health_interval: Duration::from_secs(args.upstream_health_interval_s),
        };
    } else if !args.base_url.is_empty() || args.upstream_model.is_some() {
        return Err(fail(format!(
            "--base-url and --upstream-model are for the upstream engines (openai-upstream, anthropic-upstream), not {}",
            engines.join(", ")
        )));
    }
    if engines.contains(&fak_engine::inkernel::SPEC.id) {
        config.model_path = Some(resolve_or_pull(&args.model)?);
        config.model_id = fak_catalog::find(&args.model).map(|e| e.name.to_string());
    }
    let t0 = Instant::now();
    // Kept as the router too (when routing), to say which routes are down at start.
    let routed = if args.routes.is_empty() {
        None
    } else {
        Some(std::sync::Arc::new(RoutedDriver::build(
            &args.routes,
            &config,
            &registry,
        )?))
    };
    let mut driver: std::sync::Arc<dyn EngineDriver> = match &routed {
        Some(r) => std::sync::Arc::clone(r) as std::sync::Arc<dyn EngineDriver>,
        None => (spec.build)(&config)?,
    };
    if !args.aliases.is_empty() {
        AliasedDriver::check(&args.aliases, &driver.models()).map_err(|e| fail(e.to_string()))?;
        driver = std::sync::Arc::new(AliasedDriver::new(driver, args.aliases.clone()));
    }
    let gateway = GatewayConfig {
        api_key,
        api_keys,
        admin_key,
        max_body_bytes: args.max_body_mb.saturating_mul(1 << 20),
        request_timeout: (args.request_timeout_s > 0)
            .then(|| Duration::from_secs(args.request_timeout_s)),
        policy_path: args.policy.as_ref().and_then(|p| p.file().map(Into::into)),
        header_timeout: (args.header_timeout_s > 0)
            .then(|| Duration::from_secs(args.header_timeout_s)),
        idle_timeout: (args.idle_timeout_s > 0).then(|| Duration::from_secs(args.idle_timeout_s)),
        max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
        shutdown_grace: Duration::from_secs(args.shutdown_grace_s),
        default_seed: args.seed,
        ..GatewayConfig::default()
    };
    let metrics = std::sync::Arc::new(fak_gateway::metrics::Metrics::default());
    let mut app = router_with_metrics(
        std::sync::Arc::clone(&driver),
        gateway.clone(),
        Boundary { policy, screen },
        std::sync::Arc::clone(&metrics),
    );
    if let Some(r) = &routed {
        // `/health` names the routes that are down (failed) while others serve.
        let r = std::sync::Arc::clone(r);
        app = fak_gateway::report_models_down(app, std::sync::Arc::new(move || r.not_ready()));
    }
    Ok(Built {
        app,
        gateway,
        driver,
        routed,
        routes: args.routes.clone(),
        aliases: args.aliases.clone(),
        model_path: config.model_path,
        policy_name: args
            .policy
            .as_ref()
            .map_or_else(|| "built-in".to_string(), ToString::to_string),
        store_dir,
        audit_path,
        screen_damaged,
        kv_evict: !args.no_kv_evict,
        metrics,
        t0,
        kv_lock,
    })
}

/// Serves `b` on `listener` until `shutdown` resolves (see
/// [`fak_gateway::serve_with`]). `announce`: print the `listening on` line on stdout
/// (`fak serve`; `fak guard` leaves stdout to its command and logs it).
pub(crate) async fn run(
    b: Built,
    listener: tokio::net::TcpListener,
    announce: bool,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), CliError> {
    let Built {
        app,
        gateway,
        driver,
        routed,
        routes,
        aliases,
        model_path,
        policy_name,
        store_dir,
        audit_path,
        screen_damaged,
        kv_evict,
        t0,
        ..
    } = b;
    let damaged = screen_damaged.len();
    let engine_id = driver.id();
    {
        let addr = listener.local_addr()?;
        if announce {
            // One line on stdout that scripts can wait for; the rest is logged on stderr.
            crate::outln!("fak serve: listening on http://{addr} (engine {engine_id})")?;
        } else {
            tracing::info!("listening on http://{addr} (engine {engine_id})");
        }
        for a in &aliases {
            tracing::info!("alias: model {} -> {}", a.name, a.target);
        }
        for r in &routes {
            tracing::info!(
                "route: model {} -> engine {}{}",
                r.model,
                r.engine,
                r.base_url
                    .as_ref()
                    .map_or_else(String::new, |u| format!(" at {u}"))
            );
        }
        for (p, why) in screen_damaged.iter().take(20) {
            tracing::warn!(
                "quarantine store: skipped damaged entry {}: {why}",
                p.display()
            );
        }
        if damaged > 0 {
            tracing::warn!(
                "quarantine store: {damaged} damaged entries skipped (fak_store_damaged_entries)"
            );
        }
        tracing::info!(
            "policy: {policy_name}; quarantine store: {}; audit log: {}; KV eviction on revoke: {}",
            store_dir.display(),
            audit_path.display(),
            if kv_evict { "on" } else { "off" }
        );
        let d = std::sync::Arc::clone(&driver);
        // Clients see the model's id in a load error, never its path; the log has both.
        tokio::spawn(async move {
            let mut said_failed = false;
            loop {
                match d.readiness() {
                    Readiness::Loading => tokio::time::sleep(Duration::from_millis(100)).await,
                    Readiness::Ready => {
                        let ids: Vec<String> = d.models().into_iter().map(|m| m.id).collect();
                        tracing::info!(
                            "ready in {:.1} s: serving {}",
                            t0.elapsed().as_secs_f64(),
                            ids.join(", ")
                        );
                        for (m, why) in routed.iter().flat_map(|r| r.not_ready()) {
                            tracing::error!(
                                "route '{m}' is not ready ({why}); its requests get 503 until it is"
                            );
                        }
                        break;
                    }
                    Readiness::Failed(m) => {
                        // An upstream may still come up: keep watching, say it once.
                        if !said_failed {
                            match &model_path {
                                Some(p) => tracing::error!(
                                    "the engine is not ready: {m} (model file: {})",
                                    p.display()
                                ),
                                None => tracing::error!("the engine is not ready: {m}"),
                            }
                            said_failed = true;
                        }
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        });
        fak_gateway::serve_engine(listener, app, driver, &gateway, shutdown)
            .await
            .map_err(|e| fail(format!("serving: {e}")))
    }
}

/// Resolves at the first SIGTERM or SIGINT; a second one exits the process at once
/// (status 130).
pub(crate) async fn shutdown_signal() {
    let name = first_signal().await;
    tracing::info!("{name}: shutting down (a second signal exits at once)");
    tokio::spawn(async {
        first_signal().await;
        std::process::exit(130);
    });
}

#[cfg(unix)]
async fn first_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = tokio::signal::ctrl_c() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        Err(e) => {
            tracing::warn!("SIGTERM handler: {e}; only SIGINT shuts down gracefully");
            let _ = tokio::signal::ctrl_c().await;
            "SIGINT"
        }
    }
}

#[cfg(not(unix))]
async fn first_signal() -> &'static str {
    let _ = tokio::signal::ctrl_c().await;
    "Ctrl-C"
}

/// `--alias`: `NAME=MODEL`.
fn parse_alias(s: &str) -> Result<Alias, String> {
    Alias::parse(s).map_err(|e| e.to_string())
}

/// `--route`: `MODEL=ENGINE[@URL]`.
fn parse_route(s: &str) -> Result<Route, String> {
    Route::parse(s).map_err(|e| e.to_string())
}

/// The value of the environment variable a `--*-env` flag names (`None` without the flag).
/// The keys of `--api-key-env`'s variable: split at commas, each trimmed.
///
/// # Errors
/// An empty key in the list (two commas in a row, a trailing comma).
fn api_keys(var: Option<String>) -> Result<Vec<String>, CliError> {
    let Some(v) = var else {
        return Ok(Vec::new());
    };
    let keys: Vec<String> = v.split(',').map(|k| k.trim().to_string()).collect();
    if keys.iter().any(String::is_empty) {
        return Err(fail(
            "--api-key-env: the list holds an empty key (keys are separated by single commas)",
        ));
    }
    Ok(keys)
}

fn key_from_env(flag: &str, var: Option<&str>) -> Result<Option<String>, CliError> {
    match var {
        None => Ok(None),
        Some(var) => match std::env::var(var) {
            Ok(k) if !k.is_empty() => Ok(Some(k)),
            _ => Err(fail(format!(
                "{flag} {var}: the variable is unset or empty"
            ))),
        },
    }
}
