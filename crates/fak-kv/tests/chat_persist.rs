//! A chat saved to a session file and restored ([`ChatSession::save`],
//! [`ChatSession::restore`]) continues as if never interrupted: on the real default
//! model, SmolLM2-135M-Instruct (the tiny test models carry no tokenizer or template),
//! three turns, a save, a restore into a new `ChatSession`, and the fourth turn gives
//! the uninterrupted chat's tokens, text and logits bit for bit, reusing the whole
//! restored cache and prefilling only the new tokens. Files of another model or weight
//! mode, damaged or truncated ones, and ones whose conversation does not match their
//! cache are refused. Without the model file these fail with the fetch command
//! (`FAK_SKIP_REAL_MODEL=1` reports them as ignored, never in CI).

mod common;

use fak_kv::persist::{self, ModelIdentity, PersistError};
use fak_kv::{ChatFile, ChatRestoreError, ChatSession, TextParams, TurnStats};
use fak_model::{ChatTemplate, Message, Model, Tokenizer, WeightMode};
use std::path::{Path, PathBuf};
use std::sync::Arc;

struct Fixture {
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
    tmpl: Arc<ChatTemplate>,
    identity: ModelIdentity,
    params: TextParams,
}

fn fixture() -> Fixture {
    let path = common::smollm2_path();
    let (model, tok, tmpl) = common::load(WeightMode::Exact);
    let identity = ModelIdentity::of(&path, &model).unwrap();
    assert_eq!(identity.weights, "exact");
    let params = TextParams {
        sampling: Default::default(),
        max_tokens: 40,
        stop: vec![],
        stop_ids: tmpl.stop_token_ids(&tok),
        logprobs: None,
        grammar: None,
    };
    Fixture {
        model,
        tok: Arc::new(tok),
        tmpl: Arc::new(tmpl),
        identity,
        params,
    }
}

impl Fixture {
    fn chat(&self, system: Option<&str>) -> ChatSession {
        ChatSession::new(
            Arc::clone(&self.model),
            Arc::clone(&self.tok),
            Arc::clone(&self.tmpl),
            system,
        )
    }

    fn restore(&self, file: &Path) -> Result<ChatSession, ChatRestoreError> {
        ChatSession::restore(
            file,
            Arc::clone(&self.model),
            Arc::clone(&self.tok),
            Arc::clone(&self.tmpl),
            &self.identity,
        )
    }

    fn turn(&self, chat: &mut ChatSession, user: &str) -> TurnStats {
        let mut streamed = String::new();
        let stats = chat
            .turn(user, &self.params, None, &mut |p| streamed.push_str(p))
            .unwrap();
        assert_eq!(streamed, stats.output.text);
        stats
    }
}

/// A fresh folder for this test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fak-chat-persist-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

const QUESTIONS: [&str; 3] = [
    "What is the capital of France?",
    "And of Germany?",
    "Name three colors.",
];
const FOURTH: &str = "Which of them is the color of the sky?";

/// Three turns, a save, a restore into a new `ChatSession`: the restored chat holds the
/// same messages and the same cache bit for bit, and its fourth turn equals the
/// uninterrupted chat's fourth turn (tokens, text, logits, cache), reusing the whole
/// restored cache and prefilling only the tokens the fourth question adds.
#[fak_testkit::real_model]
fn restored_chat_continues_bit_for_bit() {
    let f = fixture();
    let dir = scratch("continue");
    let file = dir.join("chat.fakkv");
    let mut chat = f.chat(Some("You are a terse assistant."));
    for q in QUESTIONS {
        f.turn(&mut chat, q);
    }
    let written = chat.save(&file, &f.identity).unwrap();
    assert_eq!(written, std::fs::metadata(&file).unwrap().len());
    // The file's metadata is the conversation, typed.
    let (_, meta): (_, ChatFile) =
        persist::load_session(&file, &f.model, &f.identity, usize::MAX, u64::MAX).unwrap();
    assert_eq!(meta.messages, chat.messages());
    assert_eq!(meta.messages.len(), 1 + 2 * QUESTIONS.len());

    let mut back = f.restore(&file).unwrap();
    assert_eq!(back.messages(), chat.messages());
    assert_eq!(back.system(), Some("You are a terse assistant."));
    assert_eq!(back.session().ids(), chat.session().ids());
    assert!(back.session().cache() == chat.session().cache());
    let cached = back.session().len();
    assert!(cached > 0);

    // The fourth question as the next turn renders it.
    let mut history = chat.messages().to_vec();
    history.push(Message::new("user", FOURTH));
    let full = f.tmpl.encode(&f.tok, &history, true, None).unwrap();
    assert!(full.starts_with(chat.session().ids()));

    let a = f.turn(&mut chat, FOURTH);
    let b = f.turn(&mut back, FOURTH);
    assert_eq!(b.reused, cached, "the whole restored cache is reused");
    assert_eq!(b.prefilled, full.len() - cached, "only the new tokens run");
    assert_eq!(b.evicted, 0);
    assert_eq!(
        (a.reused, a.prefilled, a.evicted),
        (b.reused, b.prefilled, b.evicted)
    );
    assert!(!b.output.completion_ids.is_empty());
    assert_eq!(b.output.completion_ids, a.output.completion_ids);
    assert_eq!(b.output.text, a.output.text);
    assert_eq!(b.output.finish_reason, a.output.finish_reason);
    assert_eq!(b.cache_len, a.cache_len);
    assert_eq!(back.messages(), chat.messages());
    assert_eq!(back.session().ids(), chat.session().ids());
    assert!(back.session().cache() == chat.session().cache());
    assert!(same_bits(
        back.session().last_logits().unwrap(),
        chat.session().last_logits().unwrap()
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A reset chat saves an empty cache with the system message kept; restored, its next
/// turn is a fresh chat's first turn, and a restore of a file saved after a reset
/// replaces the earlier conversation.
#[fak_testkit::real_model]
fn a_reset_chat_restores_empty_and_answers_as_a_fresh_one() {
    let f = fixture();
    let dir = scratch("reset");
    let file = dir.join("chat.fakkv");
    let mut chat = f.chat(Some("Be brief."));
    f.turn(&mut chat, QUESTIONS[0]);
    chat.save(&file, &f.identity).unwrap();
    chat.reset();
    chat.save(&file, &f.identity).unwrap();
    let mut back = f.restore(&file).unwrap();
    assert_eq!(back.messages(), [Message::new("system", "Be brief.")]);
    assert_eq!(back.session().len(), 0);
    let mut fresh = f.chat(Some("Be brief."));
    let a = f.turn(&mut fresh, QUESTIONS[1]);
    let b = f.turn(&mut back, QUESTIONS[1]);
    assert_eq!((b.reused, b.prefilled), (0, a.prefilled));
    assert_eq!(b.output.completion_ids, a.output.completion_ids);
    assert_eq!(b.output.text, a.output.text);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A chat's file is refused under another model's identity, under the other weight
/// mode, truncated, with one byte flipped, and when its metadata is not a chat's; and
/// a file whose conversation does not match its cache is refused as a mismatch.
#[fak_testkit::real_model]
fn chat_files_of_another_model_or_damaged_or_mismatched_are_refused() {
    let f = fixture();
    let dir = scratch("refused");
    let file = dir.join("chat.fakkv");
    let mut chat = f.chat(None);
    for q in &QUESTIONS[..2] {
        f.turn(&mut chat, q);
    }
    chat.save(&file, &f.identity).unwrap();
    let restore_as = |identity: &ModelIdentity, file: &Path| {
        ChatSession::restore(
            file,
            Arc::clone(&f.model),
            Arc::clone(&f.tok),
            Arc::clone(&f.tmpl),
            identity,
        )
    };
    // Another model: a tiny test model's digest.
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tiny/llama-tied");
    let other = ModelIdentity {
        digest: persist::model_digest(&tiny).unwrap(),
        weights: "exact".into(),
    };
    assert_ne!(other.digest, f.identity.digest);
    let e = restore_as(&other, &file).err().unwrap();
    assert!(
        matches!(
            e,
            ChatRestoreError::Persist(PersistError::OtherModel { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("another model"), "{e}");
    // The same file under the other weight mode.
    let native = ModelIdentity {
        digest: f.identity.digest.clone(),
        weights: "native".into(),
    };
    let e = restore_as(&native, &file).err().unwrap();
    assert!(
        matches!(
            e,
            ChatRestoreError::Persist(PersistError::OtherModel { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("native weights"), "{e}");
    // Truncated, and one byte flipped.
    let bytes = std::fs::read(&file).unwrap();
    let cut = dir.join("cut.fakkv");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = f.restore(&cut).err().unwrap();
    assert!(
        matches!(e, ChatRestoreError::Persist(PersistError::Damaged(_))),
        "{e}"
    );
    let mut flipped = bytes.clone();
    let at = bytes.len() - 100;
    flipped[at] ^= 1;
    let flip = dir.join("flip.fakkv");
    std::fs::write(&flip, &flipped).unwrap();
    let e = f.restore(&flip).err().unwrap();
    assert!(
        matches!(e, ChatRestoreError::Persist(PersistError::Damaged(_))),
        "{e}"
    );
    // A session file whose metadata is not a chat's.
    let foreign = dir.join("foreign.fakkv");
    persist::save_session(
        &foreign,
        chat.session(),
        &f.identity,
        &vec!["x".to_string()],
    )
    .unwrap();
    let e = f.restore(&foreign).err().unwrap();
    assert!(
        matches!(e, ChatRestoreError::Persist(PersistError::Damaged(_))),
        "{e}"
    );
    // The chat's cache with a conversation that does not render to it: an earlier
    // question changed, a reply missing, a cache with no reply to hold.
    let mismatched = |messages: Vec<Message>| {
        let path = dir.join("mismatch.fakkv");
        persist::save_session(&path, chat.session(), &f.identity, &ChatFile { messages }).unwrap();
        f.restore(&path).err().unwrap()
    };
    let mut changed = chat.messages().to_vec();
    changed[0].content = "What is the capital of Spain?".into();
    let e = mismatched(changed);
    assert!(matches!(e, ChatRestoreError::Mismatch(_)), "{e}");
    assert!(e.to_string().contains("differs from them at token"), "{e}");
    let mut no_reply = chat.messages().to_vec();
    no_reply.pop();
    let e = mismatched(no_reply);
    assert!(matches!(e, ChatRestoreError::Mismatch(_)), "{e}");
    let e = mismatched(vec![]);
    assert!(matches!(e, ChatRestoreError::Mismatch(_)), "{e}");
    assert!(e.to_string().contains("with no reply"), "{e}");
    // The unchanged file still restores.
    assert!(f.restore(&file).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}
