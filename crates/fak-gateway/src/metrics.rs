//! Counters for `GET /metrics`, in the Prometheus text format (version 0.0.4).

use fak_engine::{Done, EngineStats};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Upper bounds (seconds) of the latency histograms' buckets.
pub const BUCKETS_S: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A Prometheus histogram over [`BUCKETS_S`] (counts per bucket, sum, count).
#[derive(Debug, Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    n: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS_S.len()];
        }
        for (c, &le) in self.counts.iter_mut().zip(BUCKETS_S) {
            if v <= le {
                *c += 1;
            }
        }
        self.sum += v;
        self.n += 1;
    }

    fn render(&self, s: &mut String, name: &str, help: &str) {
        let counts = (0..BUCKETS_S.len()).map(|i| self.counts.get(i).copied().unwrap_or(0));
        render_histogram(
            s,
            name,
            help,
            BUCKETS_S.iter().zip(counts),
            self.sum,
            self.n,
        );
    }
}

/// Appends a histogram in the exposition format: its `le` buckets (upper bound and
/// cumulative count), the `+Inf` bucket (`n`), `_sum` and `_count`.
fn render_histogram<L: std::fmt::Display>(
    s: &mut String,
    name: &str,
    help: &str,
    buckets: impl Iterator<Item = (L, u64)>,
    sum: impl std::fmt::Display,
    n: u64,
) {
    let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (le, c) in buckets {
        let _ = writeln!(s, "{name}_bucket{{le=\"{le}\"}} {c}");
    }
    let _ = writeln!(s, "{name}_bucket{{le=\"+Inf\"}} {n}");
    let _ = writeln!(s, "{name}_sum {sum}\n{name}_count {n}");
}

/// The boundary's durable state, for `/metrics` (read from the screen at each scrape).
#[derive(Clone, Copy, Debug, Default)]
pub struct BoundaryStats {
    /// Audit records whose file write failed since start.
    pub audit_write_failures: u64,
    /// Items in the page-out store.
    pub store_items: usize,
    /// Bytes of content in the page-out store.
    pub store_bytes: u64,
    /// Store files skipped at start as damaged.
    pub store_damaged: usize,
    /// Revocations in force.
    pub revocations: usize,
}

impl BoundaryStats {
    /// Appends `fak_audit_write_failures_total` (counter) and the gauges
    /// `fak_store_items`, `fak_store_bytes`, `fak_store_damaged_entries`,
    /// `fak_revocations` to `s`.
    pub fn render(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "# HELP fak_audit_write_failures_total Audit records that could not be written to the log file.\n# TYPE fak_audit_write_failures_total counter\nfak_audit_write_failures_total {}",
            self.audit_write_failures
        );
        for (name, help, v) in [
            (
                "fak_store_items",
                "Items in the page-out store.",
                self.store_items as u64,
            ),
            (
                "fak_store_bytes",
                "Bytes of content in the page-out store.",
                self.store_bytes,
            ),
            (
                "fak_store_damaged_entries",
                "Page-out store files skipped at start as damaged.",
                self.store_damaged as u64,
            ),
            (
                "fak_revocations",
                "Revocations in force.",
                self.revocations as u64,
            ),
        ] {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
    }
}

/// Request and token counters, shared by every handler.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    ttft: Mutex<Histogram>,
    per_token: Mutex<Histogram>,
    /// Every gap between two generated tokens ([`fak_engine::Done::token_gaps_s`]).
    inter_token: Mutex<Histogram>,
    /// Tool results screened, by verdict (`admit`, `page_out`, `quarantine`) and reason.
    tool_results: Mutex<BTreeMap<(String, String), u64>>,
    /// Proposed tool calls adjudicated, by verdict (`allow`, `deny`) and reason.
    tool_calls: Mutex<BTreeMap<(String, String), u64>>,
}

impl Metrics {
    /// Counts one finished request by route (the matched path, `other` when none
    /// matched) and status.
    pub fn count_request(&self, route: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((route.to_string(), status)).or_default() += 1;
    }

    /// Adds one generation's tokens.
    pub fn add_tokens(&self, prompt: usize, completion: usize, cached: usize) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
    }

    /// Counts one screened tool result (reason `""` when admitted or paged out).
    pub fn count_tool_result(&self, verdict: &str, reason: &str) {
        let mut m = self.tool_results.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((verdict.to_string(), reason.to_string()))
            .or_default() += 1;
    }

    /// Counts one adjudicated tool call (reason `""` when allowed).
    pub fn count_tool_call(&self, verdict: &str, reason: &str) {
        let mut m = self.tool_calls.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((verdict.to_string(), reason.to_string()))
            .or_default() += 1;
    }

    /// The tool calls adjudicated so far: `(verdict, reason)` → count (`allow` with
    /// reason `""`; `deny` with the policy's reason, `MALFORMED`, ...).
    pub fn tool_calls(&self) -> BTreeMap<(String, String), u64> {
        self.tool_calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The tool results screened so far: `(verdict, reason)` → count (`admit`,
    /// `page_out`, `quarantine` with its reason).
    pub fn tool_results(&self) -> BTreeMap<(String, String), u64> {
        self.tool_results
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The requests answered so far: `(route, status)` → count.
    pub fn requests(&self) -> BTreeMap<(String, u16), u64> {
        self.requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records one generation's latencies: time to first token, the mean time of each
    /// later token (`decode_s / (completion_tokens - 1)`, when there are any), and each
    /// gap between two tokens the driver timed ([`Done::token_gaps_s`]).
    pub fn observe_latency(&self, done: &Done) {
        self.ttft
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(done.ttft_s);
        if done.completion_tokens > 1 {
            self.per_token
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .observe(done.decode_s / (done.completion_tokens - 1) as f64);
        }
        let mut h = self.inter_token.lock().unwrap_or_else(|p| p.into_inner());
        for &gap in &done.token_gaps_s {
            h.observe(f64::from(gap));
        }
    }

    /// The exposition text: `fak_requests_total{route,status}`,
    /// `fak_tool_results_total{verdict,reason}`, `fak_tool_calls_total{verdict,reason}`,
    /// the token counters,
    /// and the engine's gauges (`fak_queue_depth`, `fak_active_generations`,
    /// `fak_kv_cache_entries`, `fak_kv_cache_bytes`, `fak_kv_cache_held_bytes`, `fak_engine_ready`, the batching
    /// counters `fak_batch_passes_total`, `fak_batch_sequences_total` and
    /// `fak_batch_max_sequences`, and with an
    /// upstream driver `fak_upstreams` and `fak_upstreams_healthy`), and the
    /// histograms `fak_batch_size` (sequences per batched pass),
    /// `fak_time_to_first_token_seconds`, `fak_time_per_output_token_seconds` (one
    /// observation per generation) and `fak_inter_token_latency_seconds` (one per gap
    /// between two tokens, in-kernel generations only).
    pub fn render(&self, stats: EngineStats, ready: bool) -> String {
        let mut s = String::new();
        s.push_str("# HELP fak_requests_total HTTP requests by route and status.\n");
        s.push_str("# TYPE fak_requests_total counter\n");
        let m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        for ((route, status), n) in m.iter() {
            let route = route.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                s,
                "fak_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        drop(m);
        for (name, help, map) in [
            (
                "fak_tool_results_total",
                "Inbound tool results screened, by verdict and reason.",
                &self.tool_results,
            ),
            (
                "fak_tool_calls_total",
                "Proposed tool calls adjudicated, by verdict and reason.",
                &self.tool_calls,
            ),
        ] {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter");
            let m = map.lock().unwrap_or_else(|p| p.into_inner());
            for ((verdict, reason), n) in m.iter() {
                let _ = writeln!(s, "{name}{{verdict=\"{verdict}\",reason=\"{reason}\"}} {n}");
            }
        }
        let counters = [
            (
                "fak_prompt_tokens_total",
                "Prompt tokens of finished generations.",
                &self.prompt_tokens,
            ),
            (
                "fak_completion_tokens_total",
                "Generated tokens.",
                &self.completion_tokens,
            ),
            (
                "fak_cached_tokens_total",
                "Prompt tokens reused from the KV cache.",
                &self.cached_tokens,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                s,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        let gauges = [
            (
                "fak_queue_depth",
                "Requests waiting for a worker slot.",
                stats.queue_depth,
            ),
            (
                "fak_active_generations",
                "Generations running now.",
                stats.active,
            ),
            (
                "fak_kv_cache_entries",
                "Sessions kept for KV reuse.",
                stats.kv_entries,
            ),
            (
                "fak_kv_cache_bytes",
                "Bytes of KV entries kept for reuse, each session counted whole.",
                stats.kv_bytes,
            ),
            (
                "fak_kv_cache_held_bytes",
                "Bytes of memory the kept KV takes, a prefix shared by several sessions counted once.",
                stats.kv_bytes_held,
            ),
            (
                "fak_engine_ready",
                "1 when the model is loaded and serving.",
                usize::from(ready),
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        for (name, help, v) in [
            (
                "fak_batch_passes_total",
                "Batched forward passes (continuous batching over the worker slots).",
                stats.batch_passes,
            ),
            (
                "fak_batch_sequences_total",
                "Sequences summed over the batched passes (over the passes: the mean batch size).",
                stats.batch_sequences,
            ),
        ] {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let _ = writeln!(
            s,
            "# HELP fak_batch_max_sequences Sequences in the largest batched pass so far.\n# TYPE fak_batch_max_sequences gauge\nfak_batch_max_sequences {}",
            stats.batch_max_sequences
        );
        render_histogram(
            &mut s,
            "fak_batch_size",
            "Sequences per batched forward pass.",
            fak_engine::BATCH_SIZE_BOUNDS
                .iter()
                .zip(stats.batch_passes_within),
            stats.batch_sequences,
            stats.batch_passes,
        );
        if stats.upstreams > 0 {
            for (name, help, v) in [
                (
                    "fak_upstreams",
                    "Upstream servers configured.",
                    stats.upstreams,
                ),
                (
                    "fak_upstreams_healthy",
                    "Upstream servers in rotation (their last health check passed).",
                    stats.upstreams_healthy,
                ),
            ] {
                let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
            }
        }
        self.ttft.lock().unwrap_or_else(|p| p.into_inner()).render(
            &mut s,
            "fak_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token (its wait in the queue included).",
        );
        self.per_token
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .render(
                &mut s,
                "fak_time_per_output_token_seconds",
                "Mean seconds per generated token after the first, per request.",
            );
        self.inter_token
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .render(
                &mut s,
                "fak_inter_token_latency_seconds",
                "Seconds between two generated tokens of a generation (each gap one observation).",
            );
        s
    }
}
