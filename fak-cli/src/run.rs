//! `fak run`: one prompt in, the answer streamed out.

use crate::{
    fail, load_model_with, outln, parse_threads, resolve_or_pull, CliError, Format, WeightsArg,
};
use fak_catalog::DEFAULT_MODEL;
use fak_kv::{generate_text, SamplingParams, Session, TextParams};
use fak_model::{load_text, Message};

/// `fak run --format json`: one line, keys in this order.
#[derive(serde::Serialize)]
struct RunReport<'a> {
    model: &'a std::path::Path,
    prompt_ids: &'a [u32],
    completion_ids: &'a [u32],
    text: &'a str,
    finish_reason: fak_kv::FinishReason,
    threads: usize,
    weights: &'a str,
    timings: RunTimings,
}

/// [`RunReport`]'s times (ms) and rates (tokens/s); `null` where there was no first
/// token or no decode step.
#[derive(serde::Serialize)]
struct RunTimings {
    load_ms: f64,
    ttft_ms: Option<f64>,
    prefill_ms: f64,
    decode_ms: f64,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: Option<f64>,
}
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

/// Sampling flags shared by `run` and `chat`.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct SamplingArgs {
    /// Softmax temperature; 0 is greedy (the default: deterministic).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling mass in (0, 1] (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Drop tokens below MIN_P times the top probability (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repetition_penalty: f32,
    /// Seed of the sampler; the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop before this text (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Most new tokens.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
}

impl SamplingArgs {
    pub(crate) fn sampling(&self) -> Result<SamplingParams, CliError> {
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            grammar: None,
        };
        p.validate().map_err(fail)?;
        Ok(p)
    }

    pub(crate) fn text_params(&self, stop_ids: Vec<u32>) -> Result<TextParams, CliError> {
        Ok(TextParams {
            sampling: self.sampling()?,
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            stop_ids,
            logprobs: None,
            grammar: None,
        })
    }
}

/// The value of `--prompt-ids`: one argument holding all the ids (a newtype, so clap
/// does not take a `Vec` field for a repeated flag of single ids).
#[derive(Clone, Debug)]
pub(crate) struct PromptIds(pub(crate) Vec<u32>);

/// `--prompt-ids 1,2,3`: comma-separated token ids (spaces around them allowed). An
/// empty entry (`1,,2`, a trailing comma) or anything but decimal digits (`+5`, `0x10`)
/// is an error naming it, rather than dropped or read loosely.
pub(crate) fn parse_ids(s: &str) -> Result<PromptIds, String> {
    if s.trim().is_empty() {
        return Err("no token ids given".into());
    }
    let mut ids = Vec::new();
    for (i, t) in s.split(',').map(str::trim).enumerate() {
        if t.is_empty() {
            return Err(format!("token id {} is empty (in '{s}')", i + 1));
        }
        if !t.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("token id {} '{t}' is not a decimal number", i + 1));
        }
        ids.push(
            t.parse::<u32>()
                .map_err(|e| format!("token id {} '{t}': {e}", i + 1))?,
        );
    }
    Ok(PromptIds(ids))
}

#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// The prompt. With the chat template (default) it is the user message.
    prompt: Option<String>,
    /// A GGUF file, a safetensors folder, or a catalog name (fetched if not cached).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// The prompt as token ids instead of text, e.g. `1,9690,28` (no template applied).
    #[arg(long, value_parser = parse_ids, conflicts_with = "prompt")]
    prompt_ids: Option<PromptIds>,
    /// Plain completion: no chat template (BOS added when the model asks for it).
    #[arg(long)]
    raw: bool,
    /// A system message (chat template only).
    #[arg(long, conflicts_with = "raw")]
    system: Option<String>,
    /// Keep generating past EOS and end-of-turn tokens.
    #[arg(long)]
    ignore_eos: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Threads for the matrix products (default: all cores). Results do not depend on it.
    #[arg(long, value_parser = parse_threads)]
    threads: Option<usize>,
    /// Weights: `exact` (f32, proven against HF) or `native` (quantized matrices kept
    /// in the file's block format; faster, logits differ slightly).
    #[arg(long, value_enum, default_value_t = WeightsArg::Exact)]
    weights: WeightsArg,
    /// Output format: streamed text, or one JSON object at the end.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

pub(crate) fn run(args: RunArgs) -> Result<(), CliError> {
    if args.prompt.is_none() && args.prompt_ids.is_none() {
        return Err(fail("give a PROMPT (text) or --prompt-ids"));
    }
    let sampling = args.sampling.sampling()?;
    let path = resolve_or_pull(&args.model)?;
    let t0 = Instant::now();
    let model = Arc::new(load_model_with(&path, args.threads, args.weights.into())?);
    let (tok, template) = load_text(&path, model.config())?;
    let load_s = t0.elapsed().as_secs_f64();
    let prompt_ids = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.0.clone(),
        (None, Some(text)) if args.raw => tok.encode_prompt(text)?,
        (None, Some(text)) => {
            if template.is_fallback() {
                eprintln!("note: this model carries no chat template; using ChatML (use --raw for plain completion)");
            }
            let mut messages = Vec::new();
            if let Some(s) = &args.system {
                messages.push(Message::new("system", s));
            }
            messages.push(Message::new("user", text));
            template.encode(&tok, &messages, true, None)?
        }
        (None, None) => unreachable!("checked above"),
    };
    if prompt_ids.is_empty() {
        return Err(fail(
            "the prompt encodes to no tokens, so there is nothing to continue from",
        ));
    }
    let stop_ids = if args.ignore_eos {
        Vec::new()
    } else if args.raw || args.prompt_ids.is_some() {
        model.config().eos_token_ids.clone()
    } else {
        template.stop_token_ids(&tok)
    };
    let mut params = args.sampling.text_params(stop_ids)?;
    params.sampling = sampling;
    let ctx = model.config().max_position_embeddings;
    if prompt_ids.len() >= ctx {
        return Err(fail(format!(
            "the prompt has {} tokens; the context length is {ctx}",
            prompt_ids.len()
        )));
    }
    params.max_tokens = params.max_tokens.min(ctx - prompt_ids.len());
    let mut session =
        Session::with_capacity(Arc::clone(&model), prompt_ids.len() + params.max_tokens);
    let stream = args.format == Format::Text;
    let mut write_err = None;
    let out = generate_text(
        &mut session,
        &tok,
        &prompt_ids,
        &params,
        None,
        &mut |piece| {
            if stream && write_err.is_none() {
                let mut o = std::io::stdout().lock();
                if let Err(e) = o.write_all(piece.as_bytes()).and_then(|_| o.flush()) {
                    write_err = Some(e);
                }
            }
        },
    )?;
    if let Some(e) = write_err {
        return Err(CliError::Io(e));
    }
    let prefill_tps = out.prefill_tokens as f64 / out.prefill_s.max(1e-9);
    // No first token (`--max-tokens 0`), no TTFT; no decode step (one token), no
    // decode rate: JSON null and "n/a", not a 0 that reads as a measurement.
    let ttft_ms = (!out.completion_ids.is_empty()).then_some(out.ttft_s * 1e3);
    let decode_tps =
        (out.decode_steps > 0).then(|| out.decode_steps as f64 / out.decode_s.max(1e-9));
    let shown = |x: Option<f64>, digits: usize| {
        x.map_or_else(|| "n/a".to_string(), |x| format!("{x:.digits$}"))
    };
    // The threads the products run on (a request above twice the cores is capped).
    let threads = model.threads().used();
    if args.format == Format::Json {
        let v = RunReport {
            model: &path,
            prompt_ids: &prompt_ids,
            completion_ids: &out.completion_ids,
            text: &out.text,
            finish_reason: out.finish_reason,
            threads,
            weights: model.weight_mode().name(),
            timings: RunTimings {
                load_ms: load_s * 1e3,
                ttft_ms,
                prefill_ms: out.prefill_s * 1e3,
                decode_ms: out.decode_s * 1e3,
                prefill_tokens_per_s: prefill_tps,
                decode_tokens_per_s: decode_tps,
            },
        };
        let v = serde_json::to_string(&v)?;
        outln!("{v}")?;
    } else {
        outln!()?;
        eprintln!(
            "[{}: {} prompt tokens, {} generated; TTFT {} ms; prefill {prefill_tps:.1} tokens/s; decode {} tokens/s; {threads} thread{}]",
            serde_json::to_value(out.finish_reason).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
            prompt_ids.len(),
            out.completion_ids.len(),
            shown(ttft_ms, 0),
            shown(decode_tps, 1),
            if threads == 1 { "" } else { "s" }
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_ids;

    #[test]
    fn prompt_ids_parse_strictly() {
        assert_eq!(parse_ids(" 1, 9690 ,28").unwrap().0, vec![1, 9690, 28]);
        for (bad, says) in [
            ("", "no token ids"),
            (" ", "no token ids"),
            ("1,,2", "token id 2 is empty"),
            ("1,2,", "token id 3 is empty"),
            (",1", "token id 1 is empty"),
            ("+5", "not a decimal number"),
            ("1,-2", "not a decimal number"),
            ("0x10", "not a decimal number"),
            ("4294967296", "too large"),
        ] {
            let e = parse_ids(bad).map(|p| p.0).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
