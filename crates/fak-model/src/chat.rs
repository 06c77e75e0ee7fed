//! The chat template that travels with the checkpoint, rendered with `minijinja`.
//!
//! The template is the checkpoint's own Jinja source (GGUF `tokenizer.chat_template`, or
//! `chat_template` in a `tokenizer_config.json`), rendered as HF's `apply_chat_template`
//! does: `trim_blocks` and `lstrip_blocks` on, with `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token` and `tools`, Python string methods (`minijinja-contrib`'s
//! pycompat) and `raise_exception`. A checkpoint without a template falls back to ChatML,
//! and says so ([`ChatTemplate::is_fallback`]).
//!
//! [`ChatTemplate::encode`] turns a conversation into token ids so that only the template
//! can emit control tokens: message content is encoded with special-token parsing off.

use crate::tokenizer::{Tokenizer, TokenizerError};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

/// ChatML, the fallback when a checkpoint carries no template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// End-of-turn tokens fak recognises in a template (ChatML, Gemma, Llama 3, Phi).
const END_OF_TURN_TOKENS: &[&str] = &["<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>"];

/// One chat message. `content` is plain text; `tool_calls` (an assistant's) and
/// `tool_call_id` / `name` (a tool result's) pass through to the template as given.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
    /// Tool calls an assistant made (OpenAI shape), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// Id of the call a tool message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Name of the tool a tool message comes from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message with just a role and text.
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// Errors rendering or encoding a conversation.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The template failed to parse or render (its message names the line).
    #[error("chat template: {0}")]
    Template(String),
    /// Tokenization failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The conversation cannot be encoded safely (see [`ChatTemplate::encode`]).
    #[error("unsafe conversation: {0}")]
    Unsafe(String),
}

fn tmpl_err(e: Error) -> ChatError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    ChatError::Template(msg)
}

/// A compiled chat template plus the token texts it is given.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    fallback: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("fallback", &self.fallback)
            .field("bytes", &self.source.len())
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` (Jinja). `None` selects the ChatML fallback.
    ///
    /// # Errors
    /// [`ChatError::Template`] if the source does not parse.
    pub fn new(source: Option<&str>, tokenizer: &Tokenizer) -> Result<Self, ChatError> {
        let fallback = source.is_none();
        let source = source.unwrap_or(CHATML_TEMPLATE).to_string();
        let mut env = Environment::new();
        let syntax = env
            .syntax()
            .to_builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(tmpl_err)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |_fmt: String| -> String { String::new() });
        env.add_template_owned("chat", source.clone())
            .map_err(tmpl_err)?;
        let tok_text = |id: Option<u32>| {
            id.and_then(|i| tokenizer.id_to_token(i))
                .unwrap_or_default()
        };
        Ok(ChatTemplate {
            env,
            source,
            bos_token: tok_text(tokenizer.bos()),
            eos_token: tok_text(tokenizer.eos().first().copied()),
            fallback,
        })
    }

    /// The template of a GGUF file (`tokenizer.chat_template`), or ChatML if it has none.
    ///
    /// # Errors
    /// [`ChatError::Template`] if the template does not parse.
    pub fn from_gguf(g: &fak_weights::GgufFile, tokenizer: &Tokenizer) -> Result<Self, ChatError> {
        let src = g.get("tokenizer.chat_template").and_then(|v| v.as_str());
        Self::new(src, tokenizer)
    }

    /// Whether this is the ChatML fallback (the checkpoint carried no template).
    pub fn is_fallback(&self) -> bool {
        self.fallback
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation to text, as `apply_chat_template(tokenize=False)`.
    ///
    /// # Errors
    /// [`ChatError::Template`] when rendering fails (e.g. the template raises on a role
    /// order it does not accept).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, ChatError> {
        let t = self.env.get_template("chat").map_err(tmpl_err)?;
        let ctx = minijinja::context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => tools.map(|t| Value::from(minijinja::value::Serde(t))),
        };
        t.render(ctx).map_err(tmpl_err)
    }

    /// Encodes a conversation to token ids so that only the template emits control tokens.
    ///
    /// The rendered text is tokenized as HF does (control-token text parsed), with byte
    /// offsets; the byte ranges that hold message content are located by rendering once
    /// more with unique placeholders. A control token whose bytes lie inside a message's
    /// content was typed by someone, not emitted by the template (`<|im_end|>` in a user
    /// message): then the text is cut at the template's own control tokens only, and the
    /// text between them (template text and content together) is encoded with
    /// control-token parsing off. For every conversation without such text the ids equal
    /// `apply_chat_template(tokenize=True)`.
    ///
    /// # Errors
    /// [`ChatError::Template`] on a render failure; [`ChatError::Unsafe`] when the template
    /// transforms message content (so content cannot be located in the render) and some
    /// content holds control-token text.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, ChatError> {
        let text = self.render(messages, add_generation_prompt, tools)?;
        let (ids, offsets) = tokenizer.encode_with_special_offsets(&text)?;
        let Some(ranges) = self.content_ranges(messages, add_generation_prompt, tools, &text)?
        else {
            // Content cannot be located: refuse if any of it holds control-token text.
            for m in messages {
                let typed = tokenizer.encode_with_special(&m.content)?;
                if typed.iter().any(|&id| tokenizer.is_special(id)) {
                    return Err(ChatError::Unsafe(format!(
                        "a {} message holds control-token text and this template transforms message content, so it cannot be kept apart from the template's own tokens",
                        m.role
                    )));
                }
            }
            return Ok(ids);
        };
        let inside = |(s, e): (usize, usize)| ranges.iter().any(|&(a, b)| s < b && a < e);
        let forged = ids
            .iter()
            .zip(&offsets)
            .any(|(&id, &span)| tokenizer.is_special(id) && inside(span));
        if !forged {
            return Ok(ids);
        }
        let mut out = Vec::with_capacity(ids.len());
        let mut at = 0;
        for (&id, &(s, e)) in ids.iter().zip(&offsets) {
            if tokenizer.is_special(id) && !inside((s, e)) {
                out.extend(tokenizer.encode(&text[at..s])?);
                out.push(id);
                at = e;
            }
        }
        out.extend(tokenizer.encode(&text[at..])?);
        Ok(out)
    }

    /// Byte ranges of the rendered `text` holding each non-empty message content, found
    /// by a render with placeholders. `None` when the template transforms content (the
    /// placeholder render does not reproduce `text`).
    fn content_ranges(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        text: &str,
    ) -> Result<Option<Vec<(usize, usize)>>, ChatError> {
        const OPEN: char = '\u{F8F0}';
        const CLOSE: char = '\u{F8F1}';
        let marked: Vec<Message> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| Message {
                content: format!("{OPEN}{i}{CLOSE}"),
                ..m.clone()
            })
            .collect();
        let Ok(skeleton) = self.render(&marked, add_generation_prompt, tools) else {
            return Ok(None);
        };
        // Rebuild the real text from the skeleton, noting where each content lands.
        let mut rebuilt = String::with_capacity(text.len());
        let mut ranges = Vec::new();
        let mut rest = skeleton.as_str();
        while let Some(p) = rest.find(OPEN) {
            rebuilt.push_str(&rest[..p]);
            let after = &rest[p + OPEN.len_utf8()..];
            let Some(q) = after.find(CLOSE) else {
                return Ok(None);
            };
            let Ok(i) = after[..q].parse::<usize>() else {
                return Ok(None);
            };
            let Some(m) = messages.get(i) else {
                return Ok(None);
            };
            let start = rebuilt.len();
            rebuilt.push_str(&m.content);
            if !m.content.is_empty() {
                ranges.push((start, rebuilt.len()));
            }
            rest = &after[q + CLOSE.len_utf8()..];
        }
        rebuilt.push_str(rest);
        Ok((rebuilt == text).then_some(ranges))
    }

    /// Token ids that end a reply: the model's EOS ids plus the template's end-of-turn
    /// token (`<|im_end|>`, `<end_of_turn>`, ...) when the template uses one that the
    /// vocabulary holds as a single token.
    pub fn stop_token_ids(&self, tokenizer: &Tokenizer) -> Vec<u32> {
        let mut ids = tokenizer.eos().to_vec();
        for t in END_OF_TURN_TOKENS {
            if self.source.contains(t) {
                if let Some(id) = tokenizer.token_to_id(t) {
                    if !ids.contains(&id) {
                        ids.push(id);
                    }
                }
            }
        }
        ids
    }
}

/// Loads the tokenizer and chat template that travel with the checkpoint at `path`: from
/// a GGUF file's metadata, or from `tokenizer.json` (and `tokenizer_config.json`'s
/// `chat_template`, if any) in a safetensors folder.
///
/// # Errors
/// [`ChatError::Tokenizer`] when the tokenizer cannot be built or read;
/// [`ChatError::Template`] when the template does not parse.
pub fn load_text(
    path: &std::path::Path,
    config: &crate::Config,
) -> Result<(Tokenizer, ChatTemplate), ChatError> {
    if path.is_dir() {
        let tok = Tokenizer::from_file(
            &path.join("tokenizer.json"),
            config.bos_token_id,
            config.eos_token_ids.clone(),
        )?;
        let src = std::fs::read_to_string(path.join("tokenizer_config.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .and_then(|v| {
                v.get("chat_template")
                    .and_then(|t| t.as_str())
                    .map(str::to_string)
            });
        let tmpl = ChatTemplate::new(src.as_deref(), &tok)?;
        return Ok((tok, tmpl));
    }
    let g = fak_weights::GgufFile::open(path)
        .map_err(|e| ChatError::Tokenizer(TokenizerError::Metadata(e.to_string())))?;
    let tok = Tokenizer::from_gguf(&g)?;
    let tmpl = ChatTemplate::from_gguf(&g, &tok)?;
    Ok((tok, tmpl))
}
