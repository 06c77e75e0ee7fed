//! A multi-turn conversation whose KV cache is kept between turns: each turn prefills
//! only the tokens its rendering adds past what the cache already holds.

use crate::text::{generate_text, TextOutput, TextParams};
use crate::{Session, SessionError};
use fak_model::{ChatError, ChatTemplate, Message, Model, Tokenizer};
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
