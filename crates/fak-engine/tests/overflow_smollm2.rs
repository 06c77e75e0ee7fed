//! Past the context wall ([`fak_engine::ContextOverflow`]) on the real
//! SmolLM2-135M-Instruct (native weights, its window held to 2,048 tokens by
//! [`EngineConfig::context_length`] so that the wall is passed three times in a minute;
//! `scripts/context-wall` runs the same through `fak serve` at the model's own 8,192):
//! a 60-turn conversation, each request sending the whole history, passes the window
//! without an error in `rebuild` and in `shift` mode, and its full history is refused
//! in `error` mode. At the end the
//! pinned system turn's KV is bit-identical to its first prefill in both modes;
//! `rebuild`'s kept cache equals a fresh prefill of its tokens, `shift`'s does not (the
//! approximation it is labelled as), and `shift` reused the cached turns where
//! `rebuild` prefilled them anew. Without the model file this fails with the fetch
//! command.

use fak_engine::inkernel::InKernelDriver;
use fak_engine::{ContextOverflow, EngineConfig, EngineDriver, GenerateRequest, Message};
use fak_kv::Session;
use fak_model::{load_text, Model, WeightMode};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAK_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    fak_catalog::require_cached("smollm2-135m-instruct").unwrap_or_else(|m| panic!("{m}"))
}

fn model() -> (PathBuf, Arc<Model>) {
    static M: OnceLock<(PathBuf, Arc<Model>)> = OnceLock::new();
    M.get_or_init(|| {
        let path = smollm2_path();
        let m = Arc::new(Model::load_with(&path, WeightMode::Native).unwrap());
        (path, m)
    })
    .clone()
}

/// The window served.
const CONTEXT: usize = 2048;

fn driver(mode: ContextOverflow) -> InKernelDriver {
    let (path, m) = model();
    let (tok, tmpl) = load_text(&path, m.config()).unwrap();
    let cfg = EngineConfig {
        kv_budget_bytes: 1 << 30,
        context_overflow: mode,
        context_length: Some(CONTEXT),
        ..EngineConfig::default()
    };
    InKernelDriver::from_loaded(m, tok, tmpl, "smollm2-135m-instruct", cfg)
}

const SYSTEM: &str = "You are a careful assistant for a team of field geologists. Answer briefly.";

/// A user message of about 50 tokens, different each turn.
fn user(i: usize) -> String {
    let words = [
        "granite",
        "basalt",
        "schist",
        "quartz",
        "feldspar",
        "mica",
        "sandstone",
        "shale",
        "limestone",
        "gneiss",
        "obsidian",
        "pumice",
        "slate",
        "marble",
        "dolomite",
        "chert",
    ];
    let mut s = format!("Field note {i}: today we logged");
    for k in 0..30 {
        s.push(' ');
        s.push_str(words[(i * 7 + k * 3) % words.len()]);
    }
    s.push_str(". Which rock did we log most often?");
    s
}

/// Runs 60 turns on `d`; returns each turn's (prompt tokens, cached tokens) and the
/// whole history, or the first error with its turn.
#[allow(clippy::type_complexity)]
fn converse(d: &InKernelDriver) -> Result<(Vec<(usize, usize)>, Vec<Message>), (usize, String)> {
    let mut history = vec![Message::new("system", SYSTEM)];
    let mut out = Vec::new();
    for i in 0..60 {
        history.push(Message::new("user", &user(i)));
        let mut req = GenerateRequest::chat(history.clone());
        req.max_tokens = Some(16);
        let c = d
            .submit(req)
            .map_err(|e| (i, e.to_string()))?
            .blocking_collect()
            .map_err(|e| (i, e.to_string()))?;
        out.push((c.prompt_tokens, c.cached_tokens));
        history.push(Message::new("assistant", &c.text));
    }
    Ok((out, history))
}

/// The system turn's tokens as its first prefill computed them: rows 0..n of every
/// layer, bit for bit.
fn system_turn_unchanged(kept: &Session) {
    let (path, m) = model();
    let (tok, tmpl) = load_text(&path, m.config()).unwrap();
    let sys = tmpl
        .encode(&tok, &[Message::new("system", SYSTEM)], false, None)
        .unwrap();
    assert_eq!(
        &kept.ids()[..sys.len()],
        &sys[..],
        "the system turn was dropped"
    );
    let mut first = Session::with_capacity(Arc::clone(&m), CONTEXT);
    first.prefill(&sys).unwrap();
    let d = first.cache().kv_dim();
    for l in 0..first.cache().n_layers() {
        for (a, b) in [
            (kept.cache().k(l).to_vec(), first.cache().k(l).to_vec()),
            (
                kept.cache().k_raw(l).to_vec(),
                first.cache().k_raw(l).to_vec(),
            ),
            (kept.cache().v(l).to_vec(), first.cache().v(l).to_vec()),
        ] {
            let n = sys.len() * d;
            assert!(
                a[..n]
                    .iter()
                    .zip(&b[..n])
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "layer {l}: the system turn's KV changed"
            );
        }
    }
    assert_eq!(&kept.positions()[..sys.len()], first.positions());
}

fn fresh_prefill_equals(kept: &Session) -> bool {
    let (_, m) = model();
    let mut s = Session::with_capacity(m, CONTEXT);
    s.prefill(kept.ids()).unwrap();
    s.cache() == kept.cache()
}

#[fak_testkit::real_model]
fn a_60_turn_conversation_passes_the_window_in_rebuild_and_shift_mode() {
    let rebuild = driver(ContextOverflow::Rebuild);
    let (r, history) = converse(&rebuild).unwrap_or_else(|(i, e)| panic!("rebuild, turn {i}: {e}"));
    let shift = driver(ContextOverflow::Shift);
    let (s, _) = converse(&shift).unwrap_or_else(|(i, e)| panic!("shift, turn {i}: {e}"));

    // Error mode (the control): the whole history is refused.
    let mut req = GenerateRequest::chat(history);
    req.max_tokens = Some(16);
    let Err(e) = driver(ContextOverflow::Error).submit(req) else {
        panic!("the whole history passed the window in error mode");
    };
    assert!(e.to_string().contains("context"), "{e}");

    // The turns where the cut moved: the prompt shrank.
    let walls = |t: &[(usize, usize)]| -> Vec<usize> {
        (1..t.len()).filter(|&i| t[i].0 < t[i - 1].0).collect()
    };
    let (rw, sw) = (walls(&r), walls(&s));
    assert!(rw.len() >= 2, "rebuild cut at turns {rw:?}");
    assert!(!sw.is_empty(), "shift cut at turns {sw:?}");
    for (name, turns) in [("rebuild", &r), ("shift", &s)] {
        assert!(
            turns.iter().all(|&(p, _)| p + 16 <= CONTEXT),
            "{name}: {turns:?}"
        );
    }
    // Before the first wall the two are the same conversation.
    assert_eq!(r[..rw[0]], s[..rw[0]]);
    assert_eq!(rw[0], sw[0]);
    for &w in &rw {
        // Rebuild prefilled the kept turns anew (the system turn reused, and less
        // than a turn more).
        let (p, c) = r[w];
        assert!(c < 150, "rebuild at turn {w}: reused {c} of {p}");
    }
    for &w in &sw {
        // Shift cut the cached conversation in place: only the new tokens prefilled.
        let (p, c) = s[w];
        assert!(c > p * 3 / 4, "shift at turn {w}: reused {c} of {p}");
    }
    // Between the walls both reuse the cut conversation.
    for (name, turns, w) in [("rebuild", &r, &rw), ("shift", &s, &sw)] {
        let (p, c) = turns[w[0] + 2];
        assert!(
            c > p * 3 / 4,
            "{name}, turn {}: reused {c} of {p}",
            w[0] + 2
        );
    }

    let rk = rebuild.kept_sessions();
    let sk = shift.kept_sessions();
    system_turn_unchanged(&rk[0]);
    system_turn_unchanged(&sk[0]);
    assert!(
        fresh_prefill_equals(&rk[0]),
        "rebuild's cache differs from a fresh prefill of its tokens"
    );
    assert!(
        !fresh_prefill_equals(&sk[0]),
        "shift's cache equals a fresh prefill: it was not shifted"
    );
    eprintln!("rebuild cut at turns {rw:?}, shift at {sw:?}");
    for (i, ((rp, rc), (sp, sc))) in r.iter().zip(&s).enumerate() {
        eprintln!("turn {i}: rebuild prompt {rp} cached {rc}; shift prompt {sp} cached {sc}");
    }
}
