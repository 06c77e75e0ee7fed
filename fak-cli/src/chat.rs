//! `fak chat`: an interactive conversation whose KV cache is kept between turns.

use crate::run::SamplingArgs;
use crate::{load_model_with, parse_threads, resolve_or_pull, CliError, WeightsArg};
use fak_catalog::DEFAULT_MODEL;
use fak_kv::persist::ModelIdentity;
use fak_kv::{ChatSession, TurnStats};
use fak_model::load_text;
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(clap::Args)]
pub(crate) struct ChatArgs {
    /// A GGUF file, a safetensors folder, or a catalog name (fetched if not cached).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// A system message for the conversation.
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Threads for the matrix products (default: all cores).
    #[arg(long, value_parser = parse_threads)]
    threads: Option<usize>,
    /// Weights: `exact` (f32, proven against HF) or `native` (quantized matrices kept
    /// in the file's block format; faster, logits differ slightly).
    #[arg(long, value_enum, default_value_t = WeightsArg::Exact)]
    weights: WeightsArg,
    /// A session file (fak's KV session format): resumes the conversation saved there,
    /// or starts one when it does not exist; saved again (atomically) after every turn
    /// and every /reset. A file of another model or weight mode, or a damaged one, is
    /// refused.
    #[arg(long, value_name = "FILE")]
    session: Option<PathBuf>,
}

const HELP: &str = "commands: /stats (cache position and the last turn's cost), /reset (start over), /quit; Ctrl-C stops a reply";

fn stats_line(s: &ChatSession, last: Option<&TurnStats>) -> String {
    let cache = s.session().len();
    match last {
        None => format!("cache: {cache} tokens; no turn yet"),
        Some(t) => format!(
            "cache: {cache} tokens (next position {}); last turn: reused {}, prefilled {} new, evicted {}, generated {}; TTFT {:.0} ms, decode {:.1} tokens/s, finish {}",
            s.session().cache().next_position(),
            t.reused,
            t.prefilled,
            t.evicted,
            t.output.completion_ids.len(),
            t.output.ttft_s * 1e3,
            t.output.decode_steps as f64 / t.output.decode_s.max(1e-9),
            serde_json::to_value(t.output.finish_reason).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
        ),
    }
}

pub(crate) fn chat(args: ChatArgs) -> Result<(), CliError> {
    let path = resolve_or_pull(&args.model)?;
    let model = Arc::new(load_model_with(&path, args.threads, args.weights.into())?);
    let (tok, template) = load_text(&path, model.config())?;
    if template.is_fallback() {
        eprintln!("note: this model carries no chat template; using ChatML");
    }
    let params = args.sampling.text_params(template.stop_token_ids(&tok))?;
    let (tok, template) = (Arc::new(tok), Arc::new(template));
    let saving = match &args.session {
        Some(file) => Some(Saving::open(file, &path, &model)?),
        None => None,
    };
    let resume = match &saving {
        Some(s) => s
            .file
            .try_exists()
            .map_err(|e| crate::fail(format!("--session {}: {e}", s.file.display())))?,
        None => false,
    };
    let mut chat = match &saving {
        Some(s) if resume => {
            let chat = ChatSession::restore(
                &s.file,
                Arc::clone(&model),
                tok,
                template,
                &s.identity,
            )
            .map_err(|e| {
                crate::fail(format!(
                    "cannot resume the chat in {}: {e} (move the file away to start a new conversation there)",
                    s.file.display()
                ))
            })?;
            if let Some(system) = args.system.as_deref() {
                if chat.system() != Some(system) {
                    return Err(crate::fail(format!(
                        "--system differs from the system message of the conversation in {} ({}); drop --system to resume it, or use another session file",
                        s.file.display(),
                        match chat.system() {
                            Some(_) => "it has another one",
                            None => "it has none",
                        }
                    )));
                }
            }
            let n = chat.messages().len();
            eprintln!(
                "resumed {n} message{}, {} tokens cached from {}",
                if n == 1 { "" } else { "s" },
                chat.session().len(),
                s.file.display()
            );
            chat
        }
        _ => ChatSession::new(Arc::clone(&model), tok, template, args.system.as_deref()),
    };
    if let Some(s) = saving.as_ref().filter(|_| !resume) {
        // A new session file is written at once, so a path that cannot be written is
        // said before the first turn, not after it.
        let empty_chat = &chat;
        if let Some(e) = empty_chat.save(&s.file, &s.identity).err() {
            return Err(crate::fail(format!(
                "--session {}: cannot write the session file: {e}",
                s.file.display()
            )));
        }
    }
    let cancel = Arc::new(AtomicBool::new(false));
    {
        let c = Arc::clone(&cancel);
        // Ctrl-C stops the reply being generated, not the program.
        ctrlc::set_handler(move || c.store(true, Ordering::Relaxed))
            .map_err(|e| crate::fail(format!("installing the Ctrl-C handler: {e}")))?;
    }
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("fak chat: {} ({HELP})", path.display());
    }
    let mut last: Option<TurnStats> = None;
    // The error of the last save, when it failed: reported at once, and again as the
    // exit status if no later save succeeded.
    let mut unsaved: Option<String> = None;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|e| crate::fail(format!("reading stdin: {e}")))?;
        let text = line.trim_end_matches(['\r', '\n']);
        match text.trim() {
            "" => continue,
            "/quit" | "/exit" => break,
            "/help" => {
                eprintln!("{HELP}");
                continue;
            }
            "/stats" => {
                crate::outln!("{}", stats_line(&chat, last.as_ref()))?;
                continue;
            }
            "/reset" => {
                chat.reset();
                last = None;
                crate::outln!("(conversation reset)")?;
                if let Some(s) = &saving {
                    unsaved = s.save(&chat);
                }
                continue;
            }
            _ => {}
        }
        cancel.store(false, Ordering::Relaxed);
        let mut write_err = None;
        let result = chat.turn(text, &params, Some(&cancel), &mut |piece| {
            if write_err.is_none() {
                let mut o = std::io::stdout().lock();
                if let Err(e) = o.write_all(piece.as_bytes()).and_then(|_| o.flush()) {
                    write_err = Some(e);
                }
            }
        });
        if let Some(e) = write_err {
            return Err(CliError::Io(e));
        }
        match result {
            Ok(stats) => {
                crate::outln!()?;
                if cancel.load(Ordering::Relaxed) {
                    eprintln!("(stopped)");
                }
                last = Some(stats);
                if let Some(s) = &saving {
                    unsaved = s.save(&chat);
                }
            }
            // A failed turn (e.g. the context is full) is reported; the chat goes on.
            Err(e) => eprintln!("fak: error: {e}"),
        }
    }
    match unsaved {
        Some(e) => Err(crate::fail(e)),
        None => Ok(()),
    }
}

/// Where `--session` saves the conversation, and the model identity its file carries.
struct Saving {
    file: PathBuf,
    identity: ModelIdentity,
}

impl Saving {
    /// The session file `file` for the model loaded from `model_path`; reads the model's
    /// files once for their digest.
    fn open(file: &Path, model_path: &Path, model: &fak_model::Model) -> Result<Self, CliError> {
        if file.is_dir() {
            return Err(crate::fail(format!(
                "--session {}: a folder, not a session file",
                file.display()
            )));
        }
        let identity = ModelIdentity::of(model_path, model).map_err(|e| {
            crate::fail(format!(
                "reading {} for its digest: {e}",
                model_path.display()
            ))
        })?;
        Ok(Saving {
            file: file.to_path_buf(),
            identity,
        })
    }

    /// Saves `chat`; on failure prints the error and returns it.
    fn save(&self, chat: &ChatSession) -> Option<String> {
        let e = chat.save(&self.file, &self.identity).err()?;
        let msg = format!(
            "saving the chat to {}: {e} (the file holds the last save that succeeded)",
            self.file.display()
        );
        eprintln!("fak: error: {msg}");
        Some(msg)
    }
}
