//! `fak bench`: prefill and decode speed of one model, printed as figures.
//!
//! Each repeat runs a fresh session: a prefill of `--prompt-tokens` ids (one forward
//! pass; its time is the TTFT, first logits included), then `--gen-tokens` greedy
//! decode steps of one token each. One warm-up repeat is run first and discarded; the
//! prefill and decode times are medians over `--repeats`, and the rates are the token
//! counts over those medians (so prompt tokens / TTFT is the prefill rate).
//!
//! `--context N` measures decode after a long context instead: the N-token context is
//! prefilled once (its time is the prefill figure and the TTFT), and each repeat (the
//! warm-up too) decodes `--gen-tokens` steps after it, the decoded entries then cut off
//! the end of the cache again ([`Session::evict`] of the tail), so every repeat starts
//! from the same N entries and an 8,192-token context is prefilled once, not per repeat.
//!
//! `--profile` runs one more repeat after the timed ones with the model's per-op
//! profile on ([`fak_model::OpProfile`]) and prints where a prefill's and a decode
//! step's wall time went: each named step of the forward pass, the sampling (argmax)
//! and the rest (the session's bookkeeping outside the pass). The timed figures come
//! from the repeats before it, so the profile's clock reads never touch them. With
//! `--context` its prefill is the context's, run once more.

use crate::{
    fail, load_model_with, outln, parse_threads, resolve_or_pull, CliError, Format, WeightsArg,
};
use fak_catalog::DEFAULT_MODEL;
use fak_kv::{KvError, KvType, Session};
use fak_model::{argmax, Model, OpTimes};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub(crate) struct BenchArgs {
    /// A GGUF file, a safetensors folder, or a catalog name (fetched if not cached).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Threads for the matrix products (default: all cores).
    #[arg(long, value_parser = parse_threads)]
    threads: Option<usize>,
    /// Prompt length in tokens (a fixed, deterministic id sequence).
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Decode after a context of this many tokens (the same id sequence), prefilled
    /// once and shared by every repeat, instead of a fresh prompt per repeat.
    #[arg(long, conflicts_with_all = ["prompt_tokens", "concurrency"])]
    context: Option<usize>,
    /// Decode steps per repeat.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Timed repeats (after one warm-up, at most 10,000); the figures are their medians.
    /// Not with --concurrency, whose levels run once each.
    #[arg(long, default_value_t = 5, conflicts_with = "concurrency")]
    repeats: usize,
    /// Weights: `native` (quantized matrices, the fast path) or `exact` (f32).
    #[arg(long, value_enum, default_value_t = WeightsArg::Native)]
    weights: WeightsArg,
    /// How the KV cache stores its rows (as `fak serve --kv-type`).
    #[arg(long, value_enum, default_value_t = crate::KvTypeArg::F32)]
    kv_type: crate::KvTypeArg,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// After the timed repeats, one more with the per-op profile on: where a prefill's
    /// and a decode step's time went (products, attention, norms, RoPE, head, sampling).
    #[arg(long)]
    profile: bool,
    /// Streams at once, a list (1,2,4,8,16): instead of the single-stream figures, per
    /// level the streams decode together through continuous batching (the scheduler
    /// `fak serve --parallel` runs) and the aggregate and per-stream decode rates, TTFT,
    /// inter-token latency p50/p99, batch sizes and peak RSS are printed (with
    /// --format json, one object per level, one per line). Each level runs once. Half
    /// the streams share one prompt.
    #[arg(long, value_delimiter = ',', value_parser = parse_threads)]
    concurrency: Option<Vec<usize>>,
    /// With --concurrency: one more stream arrives a quarter of the way into the
    /// others' decoding with a prompt of this many tokens (left out of the rates, TTFT
    /// and latencies; its passes count in the batch sizes), so the inter-token latency
    /// shows what a long prompt arriving mid-run costs them.
    #[arg(long, requires = "concurrency")]
    late_prompt_tokens: Option<usize>,
}

/// Most timed repeats `fak bench` takes: medians settle long before, and the samples
/// are kept in memory (a count near `usize::MAX` used to abort on their allocation).
const MAX_REPEATS: usize = 10_000;

/// One repeat's timings, in seconds. With `--context`, `prefill_s` is the one prefill
/// every repeat continues from.
#[derive(Serialize)]
struct Sample {
    prefill_s: f64,
    decode_s: f64,
}

/// `fak bench --format json`: one object.
#[derive(Serialize)]
struct Report<'a> {
    model: &'a PathBuf,
    weights: &'static str,
    weight_format: &'a str,
    weight_mb: f64,
    weight_owned_mb: f64,
    threads: usize,
    /// Tokens prefilled before the decode steps (the context with `--context`).
    prompt_tokens: usize,
    /// `--context`: the tokens every repeat's decode steps came after (= `prompt_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    context_tokens: Option<usize>,
    gen_tokens: usize,
    repeats: usize,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    ttft_ms: f64,
    peak_rss_mb: Option<f64>,
    /// The KV cache's storage type (`--kv-type`).
    kv_type: &'static str,
    /// Bytes the KV cache holds per token (all layers, K and V, positions) in that type.
    kv_bytes_per_token: usize,
    samples: &'a [Sample],
    #[serde(skip_serializing_if = "Option::is_none")]
    profile: Option<&'a Profile>,
}

/// `--profile`'s extra repeat: the prefill and the decode steps.
#[derive(Serialize)]
struct Profile {
    prefill: Phase,
    decode: Phase,
}

/// One phase of the profiled repeat: its wall time, split into the forward pass's
/// steps (`ops`, in the order a pass runs them), the sampling and the rest.
#[derive(Serialize)]
struct Phase {
    /// Forward passes in the phase (1 for the prefill, the decode steps for decode).
    passes: usize,
    wall_ms: f64,
    ops: Vec<OpRow>,
    /// argmax over each pass's logits.
    sampling_ms: f64,
    /// The wall time outside the ops and the sampling: the session's bookkeeping.
    other_ms: f64,
}

/// One step of the forward pass over the phase: total milliseconds, calls, and its
/// share of the phase's wall time.
#[derive(Serialize)]
struct OpRow {
    op: &'static str,
    ms: f64,
    calls: u64,
    share: f64,
}

impl Phase {
    fn new(passes: usize, wall: Duration, ops: &OpTimes, sampling: Duration) -> Phase {
        let wall_ms = ms(wall);
        let share = |d: Duration| ms(d) / wall_ms.max(1e-12);
        Phase {
            passes,
            wall_ms,
            ops: ops
                .0
                .iter()
                .map(|&(op, d, calls)| OpRow {
                    op: op.name(),
                    ms: ms(d),
                    calls,
                    share: share(d),
                })
                .collect(),
            sampling_ms: ms(sampling),
            other_ms: ms(wall.saturating_sub(ops.total() + sampling)),
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One repeat as [`one_repeat`]'s, with the model's per-op profile on; the argmax of
/// each pass timed on its own.
fn profile_repeat(
    model: &Arc<Model>,
    kv: KvType,
    prompt: &[u32],
    gen: usize,
) -> Result<Profile, CliError> {
    let p = model.profile();
    let mut s = session(model, kv, prompt.len() + gen)?;
    p.take();
    p.set_enabled(true);
    let t0 = Instant::now();
    let logits = s.prefill(prompt)?;
    let ts = Instant::now();
    let mut next = argmax(&logits);
    let prefill_sampling = ts.elapsed();
    let prefill_wall = t0.elapsed();
    let prefill_ops = p.take();
    let mut decode_sampling = Duration::ZERO;
    let t1 = Instant::now();
    for _ in 0..gen {
        let logits = s.decode(next)?;
        let ts = Instant::now();
        next = argmax(logits);
        decode_sampling += ts.elapsed();
    }
    let decode_wall = t1.elapsed();
    let decode_ops = p.take();
    p.set_enabled(false);
    Ok(Profile {
        prefill: Phase::new(1, prefill_wall, &prefill_ops, prefill_sampling),
        decode: Phase::new(gen, decode_wall, &decode_ops, decode_sampling),
    })
}

/// The prompt: `n` ids spread over the vocabulary by a fixed stride (deterministic,
/// no special meaning; only the speed is measured).
pub(crate) fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    let lo = vocab.min(1000) / 2;
    let span = (vocab - lo).max(1);
    (0..n).map(|i| (lo + (i * 7919) % span) as u32).collect()
}

/// An empty session over `model` with room for `capacity` tokens, its cache's rows
/// stored in `kv`.
pub(crate) fn session(model: &Arc<Model>, kv: KvType, capacity: usize) -> Result<Session, KvError> {
    Session::with_kv_type(Arc::clone(model), capacity, kv)
}

fn one_repeat(
    model: &Arc<Model>,
    kv: KvType,
    prompt: &[u32],
    gen: usize,
) -> Result<Sample, CliError> {
    let mut s = session(model, kv, prompt.len() + gen)?;
    let t0 = Instant::now();
    let logits = s.prefill(prompt)?;
    let mut next = argmax(&logits);
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for _ in 0..gen {
        next = argmax(s.decode(next)?);
    }
    Ok(Sample {
        prefill_s,
        decode_s: t1.elapsed().as_secs_f64(),
    })
}

/// `--context`: a session holding the context `ids`, with room for `gen` more tokens;
/// the token its logits pick (where decoding starts); the prefill's time in seconds.
fn context_prefill(
    model: &Arc<Model>,
    kv: KvType,
    ids: &[u32],
    gen: usize,
) -> Result<(Session, u32, f64), CliError> {
    let mut s = session(model, kv, ids.len() + gen)?;
    let t0 = Instant::now();
    let first = argmax(&s.prefill(ids)?);
    Ok((s, first, t0.elapsed().as_secs_f64()))
}

/// `--context`: one repeat's decode, `gen` steps from `first` after the context in `s`,
/// in seconds; the decoded entries are then cut off the end of the cache, so `s` holds
/// the context alone again.
fn context_repeat(s: &mut Session, first: u32, gen: usize) -> Result<f64, CliError> {
    let context = s.len();
    let t1 = Instant::now();
    let mut next = first;
    for _ in 0..gen {
        next = argmax(s.decode(next)?);
    }
    let decode_s = t1.elapsed().as_secs_f64();
    s.evict(context, s.len() - context)?;
    Ok(decode_s)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Peak resident set size in MB (`VmHWM` of `/proc/self/status`; `None` where that
/// file does not exist).
pub(crate) fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0 / 1e6)
}

pub(crate) fn bench(args: BenchArgs) -> Result<(), CliError> {
    let (prompt_tokens, what) = match args.context {
        Some(n) => (n, ("--context", "context")),
        None => (args.prompt_tokens, ("--prompt-tokens", "prompt")),
    };
    if prompt_tokens == 0 || args.gen_tokens == 0 || args.repeats == 0 {
        return Err(fail(format!(
            "{}, --gen-tokens and --repeats must be at least 1",
            what.0
        )));
    }
    if args.repeats > MAX_REPEATS {
        return Err(fail(format!(
            "--repeats {} is more than {MAX_REPEATS}",
            args.repeats
        )));
    }
    let path = resolve_or_pull(&args.model)?;
    let model = Arc::new(load_model_with(&path, args.threads, args.weights.into())?);
    let c = model.config();
    let kv: KvType = args.kv_type.into();
    let total = prompt_tokens.checked_add(args.gen_tokens);
    if total.is_none_or(|t| t > c.max_position_embeddings) {
        return Err(fail(format!(
            "{prompt_tokens} {} + {} generated tokens exceed the context length {}",
            what.1, args.gen_tokens, c.max_position_embeddings
        )));
    }
    if let Some(levels) = &args.concurrency {
        return crate::bench_concurrency::run(
            &model,
            kv,
            levels,
            args.prompt_tokens,
            args.gen_tokens,
            args.format,
            args.profile,
            args.late_prompt_tokens,
        );
    }
    let prompt = prompt_ids(prompt_tokens, c.vocab_size);
    let mut samples = Vec::with_capacity(args.repeats);
    if args.context.is_some() {
        let (mut s, first, prefill_s) = context_prefill(&model, kv, &prompt, args.gen_tokens)?;
        context_repeat(&mut s, first, args.gen_tokens)?; // warm-up
        for _ in 0..args.repeats {
            let decode_s = context_repeat(&mut s, first, args.gen_tokens)?;
            samples.push(Sample {
                prefill_s,
                decode_s,
            });
        }
    } else {
        one_repeat(&model, kv, &prompt, args.gen_tokens)?; // warm-up
        for _ in 0..args.repeats {
            samples.push(one_repeat(&model, kv, &prompt, args.gen_tokens)?);
        }
    }
    // Rates from the median times, so that prompt tokens / TTFT is the prefill rate
    // for an even number of repeats too (the median of the rates is not the rate of
    // the median time then).
    let prefill_s = median(samples.iter().map(|s| s.prefill_s).collect());
    let decode_s = median(samples.iter().map(|s| s.decode_s).collect());
    let prefill_tps = prompt_tokens as f64 / prefill_s.max(1e-12);
    let decode_tps = args.gen_tokens as f64 / decode_s.max(1e-12);
    let ttft_ms = prefill_s * 1e3;
    let rss = peak_rss_mb();
    let kv_bytes = kv.bytes_per_token(c.num_hidden_layers, c.kv_dim());
    let mut formats: Vec<String> = model
        .quantized_types()
        .iter()
        .map(|(t, n)| format!("{t}×{n}"))
        .collect();
    // F32 and F16 matrices read as the file stores them (native mode): not widened.
    let as_stored = [
        ("F32", model.mapped_f32_matrices()),
        ("F16", model.mapped_f16_matrices()),
    ];
    for (ty, count) in as_stored.into_iter().filter(|m| m.1 > 0) {
        formats.push(format!("{ty}×{count}"));
    }
    let weight_format = if formats.is_empty() {
        "f32".to_string()
    } else {
        formats.join(", ") + ", rest f32"
    };
    // The threads the products run on (a request above twice the cores is capped).
    let threads = model.threads().used();
    let profile = if args.profile {
        Some(profile_repeat(&model, kv, &prompt, args.gen_tokens)?)
    } else {
        None
    };
    if args.format == Format::Json {
        let report = Report {
            model: &path,
            weights: model.weight_mode().name(),
            weight_format: &weight_format,
            weight_mb: model.weight_bytes() as f64 / 1e6,
            weight_owned_mb: model.owned_weight_bytes() as f64 / 1e6,
            threads,
            prompt_tokens,
            context_tokens: args.context,
            gen_tokens: args.gen_tokens,
            repeats: args.repeats,
            prefill_tokens_per_s: prefill_tps,
            decode_tokens_per_s: decode_tps,
            ttft_ms,
            peak_rss_mb: rss,
            kv_type: kv.name(),
            kv_bytes_per_token: kv_bytes,
            samples: &samples,
            profile: profile.as_ref(),
        };
        let line = serde_json::to_string(&report).map_err(|e| fail(e.to_string()))?;
        outln!("{line}")?;
    } else {
        outln!("model            {}", path.display())?;
        outln!(
            "weights          {} ({weight_format}; {:.1} MB read per token, {:.1} MB of it in owned buffers)",
            model.weight_mode().name(),
            model.weight_bytes() as f64 / 1e6,
            model.owned_weight_bytes() as f64 / 1e6
        )?;
        outln!("threads          {threads}")?;
        let repeats = if args.repeats == 1 {
            "one timed repeat".to_string()
        } else {
            format!("medians of {} repeats", args.repeats)
        };
        if args.context.is_some() {
            outln!(
                "context          {prompt_tokens} tokens prefilled once, then {} decode steps after them per repeat; {repeats} after 1 warm-up",
                args.gen_tokens,
            )?;
        } else {
            outln!(
                "prompt           {prompt_tokens} tokens, then {} decode steps; {repeats} after 1 warm-up",
                args.gen_tokens,
            )?;
        }
        outln!("prefill          {prefill_tps:.1} tokens/s")?;
        outln!("decode           {decode_tps:.1} tokens/s")?;
        outln!("TTFT             {ttft_ms:.1} ms")?;
        match rss {
            Some(mb) => outln!("peak RSS         {mb:.1} MB")?,
            None => outln!("peak RSS         unknown")?,
        }
        outln!("KV cache         {}, {kv_bytes} bytes/token", kv.name())?;
        if let Some(p) = &profile {
            print_profile(p)?;
        }
    }
    Ok(())
}

/// `--profile`'s table: per step, the prefill's milliseconds and the decode's
/// microseconds per step, each with its share of the phase's wall time.
fn print_profile(p: &Profile) -> Result<(), CliError> {
    let (pre, dec) = (&p.prefill, &p.decode);
    let steps = dec.passes.max(1) as f64;
    outln!("profile          one more repeat, per-op wall time on the calling thread (products and attention include the thread pool's hand-offs)")?;
    outln!(
        "  {:<14} {:>12} {:>7} {:>15} {:>7}",
        "op",
        "prefill ms",
        "share",
        "decode µs/step",
        "share"
    )?;
    let row = |name: &str, a: f64, b: f64| {
        outln!(
            "  {name:<14} {a:>12.2} {:>6.1}% {:>15.1} {:>6.1}%",
            100.0 * a / pre.wall_ms.max(1e-12),
            1e3 * b / steps,
            100.0 * b / dec.wall_ms.max(1e-12)
        )
    };
    for (a, b) in pre.ops.iter().zip(&dec.ops) {
        row(a.op, a.ms, b.ms)?;
    }
    row("sampling", pre.sampling_ms, dec.sampling_ms)?;
    row("other", pre.other_ms, dec.other_ms)?;
    row("total", pre.wall_ms, dec.wall_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_ids_stay_in_the_vocabulary() {
        for vocab in [1usize, 256, 49_152] {
            let ids = prompt_ids(600, vocab);
            assert_eq!(ids.len(), 600);
            assert!(ids.iter().all(|&i| (i as usize) < vocab), "vocab {vocab}");
        }
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }
}
