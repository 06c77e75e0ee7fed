//! A multi-turn conversation whose KV cache is kept between turns: each turn prefills
//! only the tokens its rendering adds past what the cache already holds.
//!
//! A conversation outlives the process through a session file ([`crate::persist`]):
//! [`ChatSession::save`] writes the cache with the messages as the file's metadata
//! ([`ChatFile`]), [`ChatSession::restore`] reads both back, and the restored chat's next
//! turn is the uninterrupted chat's next turn, bit for bit, prefilling only its new
//! tokens.

use crate::persist::{self, ModelIdentity, PersistError};
use crate::text::{generate_text, TextOutput, TextParams};
use crate::{Session, SessionError};
use fak_model::{ChatError, ChatTemplate, Message, Model, Tokenizer};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Errors of a chat turn.
#[derive(Debug, thiserror::Error)]
pub enum ChatTurnError {
    /// Rendering or encoding the conversation failed.
    #[error(transparent)]
    Chat(#[from] ChatError),
    /// The forward pass failed (e.g. the conversation outgrew the context).
    #[error(transparent)]
    Session(#[from] SessionError),
}

/// Why a chat was not restored from a session file ([`ChatSession::restore`]).
#[derive(Debug, thiserror::Error)]
pub enum ChatRestoreError {
    /// The file could not be read, or is not a session file, or is damaged, truncated,
    /// of another model or weight mode, or does not fit this model.
    #[error(transparent)]
    Persist(#[from] PersistError),
    /// Rendering the file's messages with the chat template failed.
    #[error("rendering the session file's messages: {0}")]
    Chat(#[from] ChatError),
    /// The file's messages are not a conversation [`ChatSession`] keeps, or its cache
    /// does not hold them.
    #[error("the session file's conversation does not match its cache: {0}")]
    Mismatch(String),
}

/// The metadata of a chat's session file (the header's `meta`, [`crate::persist`]): the
/// conversation whose rendering the file's cache holds. JSON:
/// `{"messages": [{"role": "user", "content": "..."}, ...]}`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ChatFile {
    /// The system message first if there is one, then user and assistant messages in
    /// turn, the last an assistant reply (or none: no turn yet).
    pub messages: Vec<Message>,
}

/// [`ChatFile`] borrowing the messages, to write one without copying them.
#[derive(Serialize)]
struct ChatFileRef<'a> {
    messages: &'a [Message],
}

/// What one turn cost.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnStats {
    /// Tokens of the rendered conversation found already in the cache.
    pub reused: usize,
    /// Tokens prefilled for this turn (the rest of the rendering).
    pub prefilled: usize,
    /// Entries evicted from the cache's tail because the re-rendered history differed
    /// from what was cached there (e.g. the template re-tokenized the last reply).
    pub evicted: usize,
    /// The generation.
    pub output: TextOutput,
    /// Cache entries after the turn.
    pub cache_len: usize,
}

/// A conversation: messages, the template that renders them, and a session whose cache
/// holds the rendered tokens so far.
pub struct ChatSession {
    session: Session,
    tokenizer: Arc<Tokenizer>,
    template: Arc<ChatTemplate>,
    messages: Vec<Message>,
    system: Option<String>,
}

impl ChatSession {
    /// A new conversation, optionally with a system message.
    pub fn new(
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        template: Arc<ChatTemplate>,
        system: Option<&str>,
    ) -> Self {
        let mut s = ChatSession {
            session: Session::new(model),
            tokenizer,
            template,
            messages: Vec::new(),
            system: system.map(str::to_string),
        };
        s.reset();
        s
    }

    /// Forgets every turn (the system message stays) and empties the cache.
    pub fn reset(&mut self) {
        self.messages = self
            .system
            .iter()
            .map(|s| Message::new("system", s))
            .collect();
        self.session = Session::new(Arc::clone(self.session.model()));
    }

    /// The conversation so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The system message, kept across [`ChatSession::reset`], if any.
    pub fn system(&self) -> Option<&str> {
        self.system.as_deref()
    }

    /// Writes the conversation to the session file `path`: the cache's ids and rows,
    /// with the messages as its metadata ([`ChatFile`]), under `identity` (the model's
    /// digest and weight mode, [`ModelIdentity::of`]). The file is written to a temporary
    /// file in the same folder and renamed into place, so `path` always holds a whole
    /// file: the previous one or this one. Returns the bytes written.
    ///
    /// # Errors
    /// [`PersistError`] when writing fails (the previous file, if any, is left as it
    /// was).
    pub fn save(&self, path: &Path, identity: &ModelIdentity) -> Result<u64, PersistError> {
        let meta = ChatFileRef {
            messages: &self.messages,
        };
        persist::save_session(path, &self.session, identity, &meta)
    }

    /// The conversation saved to `path` by [`ChatSession::save`], for `model` under
    /// `identity`, continued with `tokenizer` and `template` (the model's own). The cache
    /// is the saved one bit for bit and the messages are the saved ones, so the next
    /// turn reuses what an uninterrupted chat's next turn would (the whole cache, when
    /// the last reply re-renders to the tokens generated) and gives the same tokens.
    /// The system message is the file's (kept across [`ChatSession::reset`]).
    ///
    /// Besides the file checks of [`persist::read_session`] (at most the model's context
    /// is read), the conversation is checked against the cache: the messages must be an
    /// optional system message, then user and assistant messages in turn ending with a
    /// reply; the cache's positions must run 0, 1, 2, ... (a chat only drops its tail);
    /// and the cache must begin with the last turn's prompt as the template renders it
    /// from the messages now (or be empty when there is no reply yet).
    ///
    /// # Errors
    /// [`ChatRestoreError::Persist`] for a file that cannot be read, is damaged or
    /// truncated, or is for another model or weight mode; [`ChatRestoreError::Chat`] when
    /// the messages do not render; [`ChatRestoreError::Mismatch`] when the conversation
    /// and the cache do not belong together. Nothing is half-restored.
    pub fn restore(
        path: &Path,
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        template: Arc<ChatTemplate>,
        identity: &ModelIdentity,
    ) -> Result<Self, ChatRestoreError> {
        let capacity = model.config().max_position_embeddings;
        // `read_session` bounds every allocation by the capacity before reading rows,
        // and refuses a file longer than its header says, so no byte limit is needed.
        let (session, file): (Session, ChatFile) =
            persist::load_session(path, &model, identity, capacity, u64::MAX)?;
        let messages = file.messages;
        let system = match messages.first() {
            Some(m) if m.role == "system" => Some(m.content.clone()),
            _ => None,
        };
        let first_turn = usize::from(system.is_some());
        for (i, m) in messages.iter().enumerate().skip(first_turn) {
            let want = if (i - first_turn) % 2 == 0 {
                "user"
            } else {
                "assistant"
            };
            if m.role != want {
                return Err(ChatRestoreError::Mismatch(format!(
                    "message {i} is a {:?} message where a {want:?} one belongs (a chat is an optional system message, then user and assistant messages in turn)",
                    m.role
                )));
            }
            if m.tool_calls.is_some() || m.tool_call_id.is_some() || m.name.is_some() {
                return Err(ChatRestoreError::Mismatch(format!(
                    "message {i} carries tool fields, which a chat never writes"
                )));
            }
        }
        let turns = messages.len() - first_turn;
        if turns % 2 == 1 {
            return Err(ChatRestoreError::Mismatch(
                "the last message is a user message with no reply".into(),
            ));
        }
        let cached = session.ids();
        if let Some(i) = session
            .cache()
            .positions()
            .iter()
            .enumerate()
            .position(|(i, &p)| p as usize != i)
        {
            return Err(ChatRestoreError::Mismatch(format!(
                "cache entry {i} is at position {}, not {i} (a chat's cache has no gaps)",
                session.cache().positions()[i]
            )));
        }
        if turns == 0 {
            if !cached.is_empty() {
                return Err(ChatRestoreError::Mismatch(format!(
                    "{} tokens cached for a conversation with no reply",
                    cached.len()
                )));
            }
        } else {
            // After a turn the cache is that turn's prompt and then its reply's tokens.
            let prompt =
                template.encode(&tokenizer, &messages[..messages.len() - 1], true, None)?;
            if !cached.starts_with(&prompt) {
                let at = cached
                    .iter()
                    .zip(&prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                return Err(ChatRestoreError::Mismatch(format!(
                    "the last turn's prompt renders to {} tokens, and the cache ({} tokens) differs from them at token {at}",
                    prompt.len(),
                    cached.len()
                )));
            }
        }
        Ok(ChatSession {
            session,
            tokenizer,
            template,
            messages,
            system,
        })
    }

    /// The session (its cache and ids).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Adds a user message and generates the assistant's reply, streaming its text to
    /// `on_text`. The reply is appended to the conversation.
    ///
    /// # Errors
    /// [`ChatTurnError`]; on error the user message is removed again.
    pub fn turn(
        &mut self,
        user: &str,
        params: &TextParams,
        cancel: Option<&AtomicBool>,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<TurnStats, ChatTurnError> {
        self.messages.push(Message::new("user", user));
        let result = self.turn_inner(params, cancel, on_text);
        match result {
            Ok(stats) => {
                self.messages
                    .push(Message::new("assistant", &stats.output.text));
                Ok(stats)
            }
            Err(e) => {
                self.messages.pop();
                Err(e)
            }
        }
    }

    fn turn_inner(
        &mut self,
        params: &TextParams,
        cancel: Option<&AtomicBool>,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<TurnStats, ChatTurnError> {
        let ids = self
            .template
            .encode(&self.tokenizer, &self.messages, true, None)?;
        let cached = self.session.ids();
        let mut common = cached.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        // At least one token must run to produce logits for the reply.
        if common == ids.len() {
            common = common.saturating_sub(1);
        }
        let evicted = cached.len() - common;
        if evicted > 0 {
            // A tail eviction: nothing after it to renumber, so the cache is exactly the
            // common prefix's.
            self.session.evict(common, evicted)?;
        }
        let output = generate_text(
            &mut self.session,
            &self.tokenizer,
            &ids[common..],
            params,
            cancel,
            on_text,
        )?;
        Ok(TurnStats {
            reused: common,
            prefilled: ids.len() - common,
            evicted,
            cache_len: self.session.len(),
            output,
        })
    }
}
