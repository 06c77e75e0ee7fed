//! `fak bench`: prefill and decode speed of one model, printed as figures.
//!
//! Each repeat runs a fresh session: a prefill of `--prompt-tokens` ids (one forward
//! pass; its time is the TTFT, first logits included), then `--gen-tokens` greedy
//! decode steps of one token each. One warm-up repeat is run first and discarded; the
//! prefill and decode times are medians over `--repeats`, and the rates are the token
//! counts over those medians (so prompt tokens / TTFT is the prefill rate).

use crate::{
    fail, load_model_with, outln, parse_threads, resolve_or_pull, CliError, Format, WeightsArg,
};
use fak_catalog::DEFAULT_MODEL;
use fak_kv::Session;
use fak_model::{argmax, Model};
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

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
    /// Decode steps per repeat.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Timed repeats (after one warm-up, at most 10,000); the figures are their medians.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Weights: `native` (quantized matrices, the fast path) or `exact` (f32).
    #[arg(long, value_enum, default_value_t = WeightsArg::Native)]
    weights: WeightsArg,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

/// Most timed repeats `fak bench` takes: medians settle long before, and the samples
/// are kept in memory (a count near `usize::MAX` used to abort on their allocation).
const MAX_REPEATS: usize = 10_000;

/// One repeat's timings, in seconds.
struct Sample {
    prefill_s: f64,
    decode_s: f64,
}

/// The prompt: `n` ids spread over the vocabulary by a fixed stride (deterministic,
/// no special meaning; only the speed is measured).
fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    let lo = vocab.min(1000) / 2;
    let span = (vocab - lo).max(1);
    (0..n).map(|i| (lo + (i * 7919) % span) as u32).collect()
}

fn one_repeat(model: &Arc<Model>, prompt: &[u32], gen: usize) -> Result<Sample, CliError> {
    let mut s = Session::with_capacity(Arc::clone(model), prompt.len() + gen);
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
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0 / 1e6)
}

pub(crate) fn bench(args: BenchArgs) -> Result<(), CliError> {
    if args.prompt_tokens == 0 || args.gen_tokens == 0 || args.repeats == 0 {
        return Err(fail(
            "--prompt-tokens, --gen-tokens and --repeats must be at least 1",
        ));
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
    let total = args.prompt_tokens.checked_add(args.gen_tokens);
    if total.is_none_or(|t| t > c.max_position_embeddings) {
        return Err(fail(format!(
            "{} prompt + {} generated tokens exceed the context length {}",
            args.prompt_tokens, args.gen_tokens, c.max_position_embeddings
        )));
    }
    let prompt = prompt_ids(args.prompt_tokens, c.vocab_size);
    one_repeat(&model, &prompt, args.gen_tokens)?; // warm-up
    let mut samples = Vec::with_capacity(args.repeats);
    for _ in 0..args.repeats {
        samples.push(one_repeat(&model, &prompt, args.gen_tokens)?);
    }
    // Rates from the median times, so that prompt tokens / TTFT is the prefill rate
    // for an even number of repeats too (the median of the rates is not the rate of
    // the median time then).
    let prefill_s = median(samples.iter().map(|s| s.prefill_s).collect());
    let decode_s = median(samples.iter().map(|s| s.decode_s).collect());
    let prefill_tps = args.prompt_tokens as f64 / prefill_s.max(1e-12);
    let decode_tps = args.gen_tokens as f64 / decode_s.max(1e-12);
    let ttft_ms = prefill_s * 1e3;
    let rss = peak_rss_mb();
    let kv_bytes = 3 * c.num_hidden_layers * c.kv_dim() * std::mem::size_of::<f32>()
        + std::mem::size_of::<u32>();
    let mut formats: Vec<String> = model
        .quantized_types()
        .iter()
        .map(|(t, n)| format!("{t}×{n}"))
        .collect();
    // F32 matrices read in place from the file's map (native mode): not copies.
    let mapped = model.mapped_f32_matrices();
    if mapped > 0 {
        formats.push(format!("F32×{mapped} mapped"));
    }
    let weight_format = if formats.is_empty() {
        "f32".to_string()
    } else {
        formats.join(", ") + ", rest f32"
    };
    // The threads the products run on (a request above twice the cores is capped).
    let threads = model.threads().used();
    if args.format == Format::Json {
        let v = json!({
            "model": path,
            "weights": model.weight_mode().name(),
            "weight_format": weight_format,
            "weight_mb": model.weight_bytes() as f64 / 1e6,
            "weight_owned_mb": model.owned_weight_bytes() as f64 / 1e6,
            "threads": threads,
            "prompt_tokens": args.prompt_tokens,
            "gen_tokens": args.gen_tokens,
            "repeats": args.repeats,
            "prefill_tokens_per_s": prefill_tps,
            "decode_tokens_per_s": decode_tps,
            "ttft_ms": ttft_ms,
            "peak_rss_mb": rss,
            "kv_bytes_per_token": kv_bytes,
            "samples": samples.iter().map(|s| json!({
                "prefill_s": s.prefill_s,
                "decode_s": s.decode_s,
            })).collect::<Vec<_>>(),
        });
        outln!("{v}")?;
    } else {
        outln!("model            {}", path.display())?;
        outln!(
            "weights          {} ({weight_format}; {:.1} MB read per token, {:.1} MB of it in owned buffers)",
            model.weight_mode().name(),
            model.weight_bytes() as f64 / 1e6,
            model.owned_weight_bytes() as f64 / 1e6
        )?;
        outln!("threads          {threads}")?;
        outln!(
            "prompt           {} tokens, then {} decode steps; {} after 1 warm-up",
            args.prompt_tokens,
            args.gen_tokens,
            if args.repeats == 1 {
                "one timed repeat".to_string()
            } else {
                format!("medians of {} repeats", args.repeats)
            }
        )?;
        outln!("prefill          {prefill_tps:.1} tokens/s")?;
        outln!("decode           {decode_tps:.1} tokens/s")?;
        outln!("TTFT             {ttft_ms:.1} ms")?;
        match rss {
            Some(mb) => outln!("peak RSS         {mb:.1} MB")?,
            None => outln!("peak RSS         unknown")?,
        }
        outln!("KV bytes/token   {kv_bytes}")?;
    }
    Ok(())
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
