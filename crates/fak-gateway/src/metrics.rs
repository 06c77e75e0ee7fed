//! Counters for `GET /metrics`, in the Prometheus text format (version 0.0.4).

use fak_engine::EngineStats;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Request and token counters, shared by every handler.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    cached_tokens: AtomicU64,
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

    /// The exposition text: `fak_requests_total{route,status}`, the token counters,
    /// and the engine's gauges (`fak_queue_depth`, `fak_active_generations`,
    /// `fak_kv_cache_entries`, `fak_kv_cache_bytes`, `fak_engine_ready`).
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
                "Bytes of KV entries kept for reuse.",
                stats.kv_bytes,
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
        s
    }
}
