//! The `inkernel` driver: the model runs in this process.
//!
//! The model, tokenizer and chat template are loaded once (in the background: the
//! driver reports [`Readiness::Loading`] until done) and shared by `Arc`. `parallel`
//! worker threads take jobs from a FIFO queue of at most `max_queue` waiting requests
//! (more are [`EngineError::Overloaded`]). Each job starts from the longest cached
//! prefix of its prompt ([`PrefixCache`]), prefills the rest, streams its text through
//! the job's channel, and stops within one token once the stream is dropped. Its final
//! session is then kept for later requests, within `kv_budget_bytes`.

use crate::prefix::{start_session, PrefixCache, Span};
use crate::tools::{prepare, template_renders_tools, ToolCallParser};
use crate::{
    budget, check_model, event_channel, Done, EngineConfig, EngineDriver, EngineError, EngineEvent,
    EngineStats, EventSink, EventStream, FinishReason, GenerateRequest, ModelInfo, PieceSender,
    Prompt, Readiness, Revocation, RevokeReport,
};
use fak_kv::{generate_text_with_logprobs, TextParams};
use fak_model::{load_text, ChatTemplate, Model, Tokenizer, WeightMode};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// The registry entry: needs [`EngineConfig::model_path`].
pub const SPEC: crate::registry::DriverSpec = crate::registry::DriverSpec {
    id: "inkernel",
    about: "the model in this process, with KV reuse across requests (default)",
    build: |cfg: &EngineConfig| {
        let path = cfg.model_path.clone().ok_or_else(|| {
            EngineError::InvalidRequest("the inkernel engine needs a model path".into())
        })?;
        Ok(Arc::new(InKernelDriver::start(path, cfg.clone())) as Arc<dyn EngineDriver>)
    },
};

/// What loading produced.
struct Loaded {
    model: Arc<Model>,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    /// An empty session whose clones start new conversations (see
    /// [`crate::prefix::start_session`]).
    empty: fak_kv::Session,
}

impl Loaded {
    fn new(model: Arc<Model>, tokenizer: Tokenizer, template: ChatTemplate) -> Self {
        let empty = fak_kv::Session::new(Arc::clone(&model));
        Loaded {
            model,
            tokenizer,
            template,
            empty,
        }
    }
}

enum LoadState {
    Loading,
    Ready(Arc<Loaded>),
    Failed(String),
}

struct Job {
    ids: Vec<u32>,
    params: TextParams,
    sink: EventSink,
    /// For a chat request: the reply's forced head (may be empty), for the tool-call
    /// parser. Every chat reply is parsed, tools offered or not, so that call markup never
    /// reaches a client unjudged (a call of a tool not offered is denied above).
    tools: Option<String>,
    /// Where the prompt's tool results sit, kept with the session.
    ledger: Vec<Span>,
}

struct Shared {
    id: String,
    config: EngineConfig,
    state: Mutex<LoadState>,
    queue: Mutex<VecDeque<Job>>,
    wake: Condvar,
    shutdown: AtomicBool,
    active: AtomicUsize,
    prefix: Mutex<PrefixCache>,
}

/// Locks a mutex, taking the data even if a worker panicked while holding it (every
/// critical section here leaves the data consistent).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The in-kernel driver. Dropping it stops its workers once their current job ends.
pub struct InKernelDriver {
    shared: Arc<Shared>,
}

impl InKernelDriver {
    /// Starts loading the model at `path` on a background thread and returns at once;
    /// the workers start when the load is done.
    pub fn start(path: PathBuf, config: EngineConfig) -> Self {
        let id = model_id(&path, &config);
        let shared = Self::shared(id, config);
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("fak-load".into())
            .spawn(move || {
                let loaded = load(&path, &s.id, s.config.threads, s.config.weights);
                match loaded {
                    Ok(l) => {
                        *lock(&s.state) = LoadState::Ready(Arc::new(l));
                        spawn_workers(&s);
                    }
                    Err(e) => *lock(&s.state) = LoadState::Failed(e),
                }
            })
            .map_or_else(
                |e| {
                    *lock(&shared.state) = LoadState::Failed(format!("starting the loader: {e}"));
                },
                |_| (),
            );
        InKernelDriver { shared }
    }

    /// A driver over an already loaded model, ready at once (tests, library users).
    pub fn from_loaded(
        model: Arc<Model>,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        id: &str,
        config: EngineConfig,
    ) -> Self {
        let shared = Self::shared(id.to_string(), config);
        *lock(&shared.state) = LoadState::Ready(Arc::new(Loaded::new(model, tokenizer, template)));
        spawn_workers(&shared);
        InKernelDriver { shared }
    }

    fn shared(id: String, config: EngineConfig) -> Arc<Shared> {
        Arc::new(Shared {
            id,
            state: Mutex::new(LoadState::Loading),
            queue: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            prefix: Mutex::new(PrefixCache::new(config.kv_budget_bytes)),
            config,
        })
    }

    fn loaded(&self) -> Result<Arc<Loaded>, EngineError> {
        match &*lock(&self.shared.state) {
            LoadState::Ready(l) => Ok(Arc::clone(l)),
            LoadState::Loading => Err(EngineError::NotReady("the model is loading".into())),
            LoadState::Failed(m) => Err(EngineError::NotReady(format!("loading failed: {m}"))),
        }
    }

    /// Drops every kept session (a cold cache).
    pub fn clear_kv_cache(&self) {
        lock(&self.shared.prefix).clear();
    }

    /// The kept sessions, most recently used first (for inspection and tests).
    pub fn kept_sessions(&self) -> Vec<Arc<fak_kv::Session>> {
        lock(&self.shared.prefix).sessions()
    }
}

impl Drop for InKernelDriver {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.wake.notify_all();
    }
}

/// The served id: `config.model_id`, else the file (or folder) name without extension.
fn model_id(path: &Path, config: &EngineConfig) -> String {
    config.model_id.clone().unwrap_or_else(|| {
        path.file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
    })
}

/// Loads the model; an error names the model by `id` and carries no server path (it
/// reaches clients through `/health` and 503s; the operator knows the path).
fn load(
    path: &Path,
    id: &str,
    threads: Option<usize>,
    weights: WeightMode,
) -> Result<Loaded, String> {
    load_at(path, threads, weights)
        .map_err(|e| format!("loading the model '{id}': {}", without_paths(&e, path)))
}

/// `msg` with `path` and its ancestors' names replaced by `<model file>`,
/// `<model dir>` and `<dir>` (deepest first), so it can go to clients.
fn without_paths(msg: &str, path: &Path) -> String {
    let mut out = msg.to_string();
    let mut names: Vec<(String, &str)> = vec![(path.display().to_string(), "<model file>")];
    for (i, a) in path.ancestors().skip(1).enumerate() {
        let a = a.display().to_string();
        if a.len() > 1 {
            names.push((a, if i == 0 { "<model dir>" } else { "<dir>" }));
        }
    }
    for (name, with) in names {
        out = out.replace(&name, with);
    }
    out
}

fn load_at(path: &Path, threads: Option<usize>, weights: WeightMode) -> Result<Loaded, String> {
    let mut model = Model::load_with(path, weights).map_err(|e| e.to_string())?;
    if let Some(n) = threads {
        model.set_threads(fak_tensor::Threads::new(n));
    }
    let (tokenizer, template) =
        load_text(path, model.config()).map_err(|e| format!("loading the tokenizer: {e}"))?;
    Ok(Loaded::new(Arc::new(model), tokenizer, template))
}

/// How much lower than the HTTP threads the generation threads run (a nice value, 0 to
/// 19): inference takes every core it is given, and the server's own threads must still
/// answer `/health`, `/metrics` and new connections at once.
const WORKER_NICENESS: i32 = 5;

/// Lowers the calling thread's scheduling priority by [`WORKER_NICENESS`] (threads it
/// spawns inherit it: the matrix products' threads too). Best effort: where it is not
/// supported nothing changes.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: setpriority takes plain integers and touches no memory of ours; on
        // Linux, PRIO_PROCESS with id 0 applies to the calling thread only. A failure
        // (e.g. a seccomp filter) only leaves the priority as it was.
        let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, WORKER_NICENESS) };
    }
}

fn spawn_workers(shared: &Arc<Shared>) {
    for i in 0..shared.config.parallel.max(1) {
        let s = Arc::clone(shared);
        // A slot that cannot get a thread is simply not there; the others serve.
        let _ = std::thread::Builder::new()
            .name(format!("fak-worker-{i}"))
            .spawn(move || {
                lower_priority();
                worker(&s)
            });
    }
}

fn worker(s: &Shared) {
    loop {
        let job = {
            let mut q = lock(&s.queue);
            loop {
                if s.shutdown.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(j) = q.pop_front() {
                    break j;
                }
                q = s.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        let Ok(loaded) = (match &*lock(&s.state) {
            LoadState::Ready(l) => Ok(Arc::clone(l)),
            _ => Err(()),
        }) else {
            continue;
        };
        s.active.fetch_add(1, Ordering::SeqCst);
        let sink = job.sink.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_job(s, &loaded, job)));
        if r.is_err() {
            sink.send(EngineEvent::Error(EngineError::Internal(
                "the generation panicked".into(),
            )));
        }
        s.active.fetch_sub(1, Ordering::SeqCst);
    }
}

fn run_job(s: &Shared, l: &Loaded, job: Job) {
    let Job {
        ids,
        params,
        sink,
        tools,
        ledger,
    } = job;
    if sink.is_closed() {
        return; // the client left while queued
    }
    let hit = if s.config.kv_budget_bytes > 0 {
        lock(&s.prefix).lookup(&ids)
    } else {
        None
    };
    let (mut session, reused) = match start_session(hit, &l.empty) {
        Ok(x) => x,
        Err(e) => {
            sink.send(EngineEvent::Error(EngineError::Internal(e.to_string())));
            return;
        }
    };
    if !sink.send(EngineEvent::Start {
        prompt_tokens: ids.len(),
        cached_tokens: reused,
    }) {
        return;
    }
    let cancel = AtomicBool::new(false);
    let mut sender = PieceSender::new(&sink, tools.as_deref().map(ToolCallParser::new));
    let out = generate_text_with_logprobs(
        &mut session,
        &l.tokenizer,
        &ids[reused..],
        &params,
        Some(&cancel),
        &mut |t, records| {
            if !sender.piece(t, records) {
                cancel.store(true, Ordering::Relaxed);
            }
        },
    );
    match out {
        Ok(out) => {
            if s.config.kv_budget_bytes > 0 {
                lock(&s.prefix).insert(session, ledger);
            }
            if out.finish_reason == FinishReason::Cancelled {
                return;
            }
            if !sender.finish() {
                return;
            }
            let stop_sequence = stop_sequence_hit(&out, &params, &l.tokenizer);
            sink.send(EngineEvent::Done(Done {
                completion_tokens: out.completion_ids.len(),
                completion_ids: out.completion_ids,
                finish_reason: out.finish_reason,
                stop_sequence,
                ttft_s: out.ttft_s,
                decode_s: out.decode_s,
                prompt_usage: None,
            }));
        }
        Err(e) => {
            sink.send(EngineEvent::Error(EngineError::Internal(e.to_string())));
        }
    }
}

/// Where each tool result of `messages` sits in `ids` (the whole prompt): the start of
/// message `i` is the length of the prefix `ids` shares with the conversation cut
/// before `i` (rendered without a generation prompt). That is never after the first
/// token that can depend on message `i`, which is all a revocation needs (a cut too
/// early only recomputes more). A cut that cannot be rendered (a template that refuses
/// the shorter conversation) counts from 0.
fn tool_spans(
    l: &Loaded,
    messages: &[fak_model::Message],
    req: &GenerateRequest,
    ids: &[u32],
) -> Vec<Span> {
    let renders = template_renders_tools(l.template.source());
    messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == "tool")
        .map(|(i, m)| {
            let start = if i == 0 {
                0
            } else {
                let prep = prepare(&messages[..i], &req.tools, &req.tool_choice, renders);
                l.template
                    .encode(&l.tokenizer, &prep.messages, false, prep.tools.as_ref())
                    .map_or(0, |head| {
                        head.iter().zip(ids).take_while(|(a, b)| a == b).count()
                    })
            };
            Span {
                digest: fak_ctxmmu::digest(&m.content),
                tool_call_id: m.tool_call_id.clone(),
                start,
            }
        })
        .collect()
}

/// Which stop string ended `out`, if one did: the earliest occurrence in the decoded
/// completion among `params.stop`.
fn stop_sequence_hit(
    out: &fak_kv::TextOutput,
    params: &TextParams,
    tok: &Tokenizer,
) -> Option<String> {
    if out.finish_reason != FinishReason::Stop || params.stop.is_empty() {
        return None;
    }
    if out
        .completion_ids
        .last()
        .is_some_and(|id| params.stop_ids.contains(id))
    {
        return None;
    }
    let full = tok.decode(&out.completion_ids, true).ok()?;
    params
        .stop
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| full.find(s.as_str()).map(|at| (at, s)))
        .min_by_key(|(at, _)| *at)
        .map(|(_, s)| s.clone())
}

impl EngineDriver for InKernelDriver {
    fn id(&self) -> &'static str {
        "inkernel"
    }

    fn models(&self) -> Vec<ModelInfo> {
        let context_length = match &*lock(&self.shared.state) {
            LoadState::Ready(l) => l.model.config().max_position_embeddings,
            _ => 0,
        };
        vec![ModelInfo {
            id: self.shared.id.clone(),
            context_length,
            owned_by: "fak".into(),
        }]
    }

    fn readiness(&self) -> Readiness {
        match &*lock(&self.shared.state) {
            LoadState::Loading => Readiness::Loading,
            LoadState::Ready(_) => Readiness::Ready,
            LoadState::Failed(m) => Readiness::Failed(m.clone()),
        }
    }

    fn revoke(&self, r: &Revocation) -> RevokeReport {
        if !self.shared.config.kv_evict {
            return RevokeReport::default();
        }
        lock(&self.shared.prefix).revoke(r)
    }

    fn stats(&self) -> EngineStats {
        let p = lock(&self.shared.prefix);
        EngineStats {
            queue_depth: lock(&self.shared.queue).len(),
            active: self.shared.active.load(Ordering::SeqCst),
            kv_entries: p.len(),
            kv_bytes: p.bytes(),
            ..EngineStats::default()
        }
    }

    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        let l = self.loaded()?;
        check_model(req.model.as_deref(), &self.models())?;
        req.validate()?;
        req.sampling
            .validate()
            .map_err(EngineError::InvalidRequest)?;
        let mut tools = None;
        let mut ledger = Vec::new();
        let (ids, stop_ids) = match &req.prompt {
            Prompt::Chat(messages) => {
                if messages.is_empty() {
                    return Err(EngineError::InvalidRequest(
                        "messages must hold at least one message".into(),
                    ));
                }
                let prep = prepare(
                    messages,
                    &req.tools,
                    &req.tool_choice,
                    template_renders_tools(l.template.source()),
                );
                let bad = |e: &dyn std::fmt::Display| EngineError::InvalidRequest(e.to_string());
                let mut ids = l
                    .template
                    .encode(&l.tokenizer, &prep.messages, true, prep.tools.as_ref())
                    .map_err(|e| bad(&e))?;
                if !prep.assistant_prefix.is_empty() {
                    ids.extend(
                        l.tokenizer
                            .encode(&prep.assistant_prefix)
                            .map_err(|e| bad(&e))?,
                    );
                }
                tools = Some(prep.assistant_prefix);
                ledger = tool_spans(&l, messages, &req, &ids);
                (ids, l.template.stop_token_ids(&l.tokenizer))
            }
            Prompt::Text(t) => {
                let ids = l
                    .tokenizer
                    .encode_prompt(t)
                    .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
                (ids, l.model.config().eos_token_ids.clone())
            }
        };
        if ids.is_empty() {
            return Err(EngineError::InvalidRequest(
                "the prompt is empty (no tokens)".into(),
            ));
        }
        let context = l.model.config().max_position_embeddings;
        let max_tokens = budget(ids.len(), req.max_tokens, context)?;
        let params = TextParams {
            sampling: req.sampling,
            max_tokens,
            stop: req.stop,
            stop_ids,
            logprobs: req.logprobs,
        };
        let (sink, stream) = event_channel();
        {
            let mut q = lock(&self.shared.queue);
            // A request waits here even when a slot is idle, so at least one may.
            if q.len() >= self.shared.config.max_queue.max(1) {
                return Err(EngineError::Overloaded {
                    queued: q.len(),
                    retry_after_s: 1,
                });
            }
            q.push_back(Job {
                ids,
                params,
                sink,
                tools,
                ledger,
            });
        }
        self.shared.wake.notify_one();
        Ok(stream)
    }
}
