//! `fak bench --concurrency 1,2,4,8`: many streams at once through continuous batching.
//!
//! Per level N, N sessions on N threads attach to one [`fak_kv::Batcher`] (the
//! scheduler `fak serve --parallel` runs), start together, prefill their prompts and
//! decode `--gen-tokens` greedy tokens each. Half the streams (the even ones) share one
//! prompt; the others each have their own (the same length, other ids). Printed per
//! level: the aggregate decode rate (every stream's decode tokens over the span from
//! the first stream's first token to the last stream's last), the decode rate while all
//! N streams decode (the window after the last stream's first token and up to the first
//! stream's last, without the ramp at either end), the median stream's own
//! decode rate, TTFT and inter-token latency p50 and p99 over all streams, the mean and
//! largest batch, and the process's peak RSS so far. With `--late-prompt-tokens T`, one
//! more stream arrives a quarter of the way into the others' decoding with a prompt of T
//! tokens (the long prompt that must not stall them); it is left out of the figures.

use crate::{fail, outln, CliError, Format};
use fak_kv::{BatchPolicy, Batcher, KvType};
use fak_model::{argmax, Model};
use serde::Serialize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// One level's figures (`--format json`: one object per line).
#[derive(Serialize)]
pub(crate) struct Level {
    pub concurrency: usize,
    pub aggregate_decode_tokens_per_s: f64,
    /// The decode rate while every stream of the level decodes (`None` when no step
    /// falls in that window).
    pub all_decoding_tokens_per_s: Option<f64>,
    pub per_stream_decode_tokens_per_s: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p99: f64,
    pub itl_ms_p50: f64,
    pub itl_ms_p99: f64,
    pub mean_batch: f64,
    pub max_batch: usize,
    pub peak_rss_mb: Option<f64>,
}

/// Marks stream 0 finished when dropped (the late stream waits for its progress).
struct Release<'a>(&'a AtomicUsize);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.0.store(usize::MAX, Ordering::Relaxed);
    }
}

/// What one stream saw, in seconds from the common start.
struct Stream {
    first_token: f64,
    /// When each decode step's token came.
    steps: Vec<f64>,
}

/// The `q`-quantile (0..=1) of `v` by the nearest rank.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// The decode rate while every stream decodes, as `llama-batched-bench`'s S_TG measures
/// a batch of sequences (the aggregate over the whole span also holds the ramp: the
/// first streams decode in small batches while the last ones' prompts are prefilled,
/// and the last ones finish alone). The window runs from the last stream's first token
/// to the first stream's last; the rate is the decode tokens that came inside it (after
/// its start, up to its end) over its length. `None` when the window holds no token.
fn all_decoding_rate(streams: &[Stream]) -> Option<f64> {
    let start = streams
        .iter()
        .map(|s| s.first_token)
        .fold(f64::NEG_INFINITY, f64::max);
    let end = streams
        .iter()
        .map(|s| s.steps.last().copied().unwrap_or(f64::NEG_INFINITY))
        .fold(f64::INFINITY, f64::min);
    let inside = streams
        .iter()
        .flat_map(|s| s.steps.iter())
        .filter(|&&t| t > start && t <= end)
        .count();
    (inside > 0 && end > start).then(|| inside as f64 / (end - start))
}

/// Runs level `n`: `prompts(i)` is stream `i`'s prompt. With `late` tokens, one more
/// stream arrives once stream 0 has decoded a quarter of its tokens, with a prompt of
/// that many tokens, and decodes 4; it is not counted in the figures (it is the load
/// the others' latencies are measured under).
fn level(
    model: &Arc<Model>,
    kv: KvType,
    n: usize,
    prompts: &(dyn Fn(usize) -> Vec<u32> + Sync),
    gen: usize,
    late: Option<&[u32]>,
) -> Result<Level, CliError> {
    let batcher =
        Batcher::new(Arc::clone(model), BatchPolicy::default()).map_err(|e| fail(e.to_string()))?;
    let start = Barrier::new(n + 1);
    let progress = AtomicUsize::new(0);
    let streams: Vec<Result<Stream, String>> = std::thread::scope(|scope| {
        if let Some(ids) = late {
            let (b, progress) = (&batcher, &progress);
            scope.spawn(move || -> Result<(), String> {
                let mut s =
                    crate::bench::session(model, kv, ids.len() + 4).map_err(|e| e.to_string())?;
                s.attach(b).map_err(|e| e.to_string())?;
                while progress.load(Ordering::Relaxed) < gen / 4 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                let mut next = argmax(&s.prefill(ids).map_err(|e| e.to_string())?);
                for _ in 0..4 {
                    next = argmax(s.decode(next).map_err(|e| e.to_string())?);
                }
                Ok(())
            });
        }
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let (b, start, progress) = (&batcher, &start, &progress);
                scope.spawn(move || -> Result<(Stream, Instant), String> {
                    // However stream 0 ends, the late stream stops waiting for it.
                    let _release = (i == 0).then(|| Release(progress));
                    let prompt = prompts(i);
                    let mut s = crate::bench::session(model, kv, prompt.len() + gen)
                        .map_err(|e| e.to_string())?;
                    s.attach(b).map_err(|e| e.to_string())?;
                    start.wait();
                    let t0 = Instant::now();
                    let mut next = argmax(&s.prefill(&prompt).map_err(|e| e.to_string())?);
                    let first_token = t0.elapsed().as_secs_f64();
                    let mut steps = Vec::with_capacity(gen);
                    for _ in 0..gen {
                        next = argmax(s.decode(next).map_err(|e| e.to_string())?);
                        steps.push(t0.elapsed().as_secs_f64());
                        if i == 0 {
                            progress.store(steps.len(), Ordering::Relaxed);
                        }
                    }

                    Ok((Stream { first_token, steps }, t0))
                })
            })
            .collect();
        start.wait();
        let origin = Instant::now();
        hs.into_iter()
            .map(|h| {
                let (s, t0) = h.join().map_err(|_| "a stream panicked".to_string())??;
                // Times from the common origin (each thread's own clock started at
                // the barrier too, a few microseconds apart).
                let shift = t0.saturating_duration_since(origin).as_secs_f64();
                Ok(Stream {
                    first_token: s.first_token + shift,
                    steps: s.steps.iter().map(|t| t + shift).collect(),
                })
            })
            .collect()
    });
    let streams: Vec<Stream> = streams
        .into_iter()
        .collect::<Result<_, _>>()
        .map_err(fail)?;
    let st = batcher.stats();
    let first = streams
        .iter()
        .map(|s| s.first_token)
        .fold(f64::INFINITY, f64::min);
    let last = streams
        .iter()
        .filter_map(|s| s.steps.last().copied())
        .fold(0.0, f64::max);
    let tokens = (n * gen) as f64;
    let all_decoding = all_decoding_rate(&streams);
    let mut ttft: Vec<f64> = streams.iter().map(|s| s.first_token * 1e3).collect();
    let mut itl: Vec<f64> = streams
        .iter()
        .flat_map(|s| {
            std::iter::once(s.first_token)
                .chain(s.steps.iter().copied())
                .collect::<Vec<_>>()
                .windows(2)
                .map(|w| (w[1] - w[0]) * 1e3)
                .collect::<Vec<_>>()
        })
        .collect();
    let mut per_stream: Vec<f64> = streams
        .iter()
        .map(|s| gen as f64 / (s.steps.last().copied().unwrap_or(0.0) - s.first_token).max(1e-12))
        .collect();
    Ok(Level {
        concurrency: n,
        aggregate_decode_tokens_per_s: tokens / (last - first).max(1e-12),
        all_decoding_tokens_per_s: all_decoding,
        per_stream_decode_tokens_per_s: quantile(&mut per_stream, 0.5),
        ttft_ms_p50: quantile(&mut ttft, 0.5),
        ttft_ms_p99: quantile(&mut ttft, 0.99),
        itl_ms_p50: quantile(&mut itl, 0.5),
        itl_ms_p99: quantile(&mut itl, 0.99),
        mean_batch: st.sequences as f64 / st.passes.max(1) as f64,
        max_batch: st.max_sequences,
        peak_rss_mb: crate::bench::peak_rss_mb(),
    })
}

/// `fak bench --concurrency`: every level in `levels`, printed as it finishes; with
/// `profile`, each level's batched passes' per-op wall time (text format) after it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    model: &Arc<Model>,
    kv: KvType,
    levels: &[usize],
    prompt_tokens: usize,
    gen: usize,
    format: Format,
    profile: bool,
    late_prompt_tokens: Option<usize>,
) -> Result<(), CliError> {
    let vocab = model.config().vocab_size;
    let shared = crate::bench::prompt_ids(prompt_tokens, vocab);
    let prompts = move |i: usize| -> Vec<u32> {
        if i.is_multiple_of(2) {
            shared.clone()
        } else {
            shared
                .iter()
                .map(|&id| ((id as usize + 97 * i) % vocab) as u32)
                .collect()
        }
    };
    let late: Option<Vec<u32>> = late_prompt_tokens.map(|t| {
        crate::bench::prompt_ids(t, vocab)
            .iter()
            .map(|&id| ((id as usize + 31) % vocab) as u32)
            .collect()
    });
    // A warm-up stream (page faults, the pool's threads).
    level(model, kv, 1, &prompts, gen.min(8), None)?;
    if format == Format::Text {
        outln!(
            "streams  aggregate tok/s  all decoding tok/s  per-stream tok/s  TTFT p50/p99 ms   ITL p50/p99 ms   batch mean/max  peak RSS MB"
        )?;
    }
    for &n in levels {
        let p = model.profile();
        p.take();
        p.set_enabled(profile);
        let l = level(model, kv, n, &prompts, gen, late.as_deref());
        p.set_enabled(false);
        let ops = p.take();
        let l = l?;
        match format {
            Format::Json => {
                let line = serde_json::to_string(&l).map_err(|e| fail(e.to_string()))?;
                outln!("{line}")?;
            }
            Format::Text => outln!(
                "{:>7}  {:>15.1}  {:>18}  {:>16.1}  {:>7.1} / {:<7.1}  {:>6.1} / {:<7.1}  {:>5.1} / {:<4}  {}",
                l.concurrency,
                l.aggregate_decode_tokens_per_s,
                l.all_decoding_tokens_per_s
                    .map_or("-".into(), |r| format!("{r:.1}")),
                l.per_stream_decode_tokens_per_s,
                l.ttft_ms_p50,
                l.ttft_ms_p99,
                l.itl_ms_p50,
                l.itl_ms_p99,
                l.mean_batch,
                l.max_batch,
                l.peak_rss_mb.map_or("unknown".into(), |m| format!("{m:.1}"))
            )?,
        }
        if profile && format == Format::Text {
            let total = ops.total().as_secs_f64().max(1e-12);
            let parts: Vec<String> = ops
                .0
                .iter()
                .filter(|(_, d, _)| !d.is_zero())
                .map(|(op, d, _)| format!("{} {:.0}%", op.name(), 100.0 * d.as_secs_f64() / total))
                .collect();
            outln!(
                "         ops: {:.0} ms in all: {}",
                total * 1e3,
                parts.join(", ")
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(first_token: f64, steps: &[f64]) -> Stream {
        Stream {
            first_token,
            steps: steps.to_vec(),
        }
    }

    #[test]
    fn the_all_decoding_window_leaves_out_the_ramps() {
        // Stream a decodes from 0; b's first token comes at 1.0; a ends at 3.0, b at 4.0.
        let a = stream(0.0, &[0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
        let b = stream(1.0, &[1.5, 2.0, 2.5, 3.0, 3.5, 4.0]);
        // Inside (1.0, 3.0]: a's 1.5, 2.0, 2.5, 3.0 and b's 1.5, 2.0, 2.5, 3.0.
        let r = all_decoding_rate(&[a, b]).unwrap();
        assert!((r - 8.0 / 2.0).abs() < 1e-12, "{r}");
        // One stream: its whole decode after the first token.
        let r = all_decoding_rate(&[stream(1.0, &[2.0, 3.0, 5.0])]).unwrap();
        assert!((r - 3.0 / 4.0).abs() < 1e-12, "{r}");
        // No overlap: the second stream starts after the first ended.
        let (a, b) = (stream(0.0, &[1.0, 2.0]), stream(3.0, &[4.0]));
        assert_eq!(all_decoding_rate(&[a, b]), None);
    }
}
