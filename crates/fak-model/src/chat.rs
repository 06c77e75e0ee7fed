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
//! can emit control tokens: every string of the request the template renders (content,
//! roles, names, call ids, tool-call arguments, tool definitions, object keys) is encoded
//! with special-token parsing off.
//!
//! **Limits.** A template is code from the model file, so each render runs with a fuel
//! budget (minijinja's: one unit per instruction and per 64 bytes of data it creates,
//! which bounds both its time and its memory) and an output cap, both scaled to the
//! request's size ([`RenderLimits::for_input`]), and minijinja's recursion limit. A render
//! that exceeds one fails with [`ChatError::Limit`] naming it.

use crate::tokenizer::{Tokenizer, TokenizerError};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// ChatML, the fallback when a checkpoint carries no template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// End-of-turn tokens fak recognises in a template (ChatML, Gemma, Llama 3, Phi).
const END_OF_TURN_TOKENS: &[&str] = &["<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>"];

/// One chat message. `content` is plain text; `tool_calls` (an assistant's) and
/// `tool_call_id` / `name` (a tool result's) pass through to the template as given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
    /// The render exceeded one of its limits (see [`RenderLimits`]).
    #[error("chat template exceeded its {what} limit of {limit} {unit}")]
    Limit {
        /// `fuel` or `output`.
        what: &'static str,
        /// The limit this render had.
        limit: u64,
        /// Unit of `limit`: `units` of fuel (an instruction or 64 bytes of data), `bytes`.
        unit: &'static str,
    },
}

/// The limits of one render, scaled to the request: a fixed allowance for the template's
/// own work plus an allowance per byte and per value of request data.
///
/// Sized by measurement (see `docs/architecture.md`, "Chat template limits"): the real
/// templates fak was checked with use at most about 1/10 of these on conversations of
/// every size from 1 to 4,000 messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenderLimits {
    /// Fuel budget (minijinja units: an instruction, or 64 bytes of data created).
    pub fuel: u64,
    /// Maximum output, in bytes.
    pub output_bytes: u64,
}

impl RenderLimits {
    /// Fuel for the template's own work, whatever the request.
    pub const FUEL_BASE: u64 = 200_000;
    /// Fuel per value of request data (a message, a string, a JSON node).
    pub const FUEL_PER_VALUE: u64 = 400;
    /// Fuel per byte of request data.
    pub const FUEL_PER_BYTE: u64 = 2;
    /// Output for the template's own text, whatever the request, in bytes.
    pub const OUTPUT_BASE: u64 = 256 * 1024;
    /// Output per byte of request data (JSON escaping writes up to 6 bytes for one).
    pub const OUTPUT_PER_BYTE: u64 = 8;
    /// Output per value of request data, in bytes.
    pub const OUTPUT_PER_VALUE: u64 = 256;

    /// The limits for a request of `bytes` bytes of string data in `values` values.
    pub fn for_input(bytes: u64, values: u64) -> Self {
        RenderLimits {
            fuel: Self::FUEL_BASE
                .saturating_add(Self::FUEL_PER_VALUE.saturating_mul(values))
                .saturating_add(Self::FUEL_PER_BYTE.saturating_mul(bytes)),
            output_bytes: Self::OUTPUT_BASE
                .saturating_add(Self::OUTPUT_PER_BYTE.saturating_mul(bytes))
                .saturating_add(Self::OUTPUT_PER_VALUE.saturating_mul(values)),
        }
    }

    /// The limits for rendering `messages` and `tools`: their strings' bytes and their
    /// values counted as [`RenderLimits::for_input`] takes them.
    pub fn for_request(messages: &[Message], tools: Option<&serde_json::Value>) -> Self {
        let (mut bytes, mut values) = (0u64, 0u64);
        for m in messages {
            values += 1;
            for s in [
                Some(&m.role),
                Some(&m.content),
                m.tool_call_id.as_ref(),
                m.name.as_ref(),
            ]
            .into_iter()
            .flatten()
            {
                bytes += s.len() as u64;
                values += 1;
            }
            if let Some(tc) = &m.tool_calls {
                json_size(tc, &mut bytes, &mut values);
            }
        }
        if let Some(t) = tools {
            json_size(t, &mut bytes, &mut values);
        }
        Self::for_input(bytes, values)
    }
}

/// Adds a JSON value's string bytes (keys included) and node count.
fn json_size(v: &serde_json::Value, bytes: &mut u64, values: &mut u64) {
    use serde_json::Value as J;
    *values += 1;
    match v {
        J::String(s) => *bytes += s.len() as u64,
        J::Array(a) => a.iter().for_each(|x| json_size(x, bytes, values)),
        J::Object(o) => o.iter().for_each(|(k, x)| {
            *bytes += k.len() as u64;
            json_size(x, bytes, values)
        }),
        J::Number(n) => *bytes += n.to_string().len() as u64,
        _ => {}
    }
}

/// An output that refuses to grow past `cap` bytes.
struct CappedOutput {
    buf: Vec<u8>,
    cap: usize,
    over: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(b.len()) > self.cap {
            self.over = true;
            return Err(std::io::Error::other("output limit"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Brackets a placeholder for request text set aside from the render (private-use
/// characters; a client's own use of them is set aside too).
const MARK_OPEN: char = '\u{F8F0}';
const MARK_CLOSE: char = '\u{F8F1}';

/// Request strings with their control-token text replaced by placeholders, and the
/// texts the placeholders stand for.
#[derive(Default)]
struct Guarded {
    table: Vec<String>,
}

impl Guarded {
    /// `s` with each of [`Tokenizer::control_text_ranges`] (and each placeholder
    /// character) replaced by a placeholder.
    fn string(&mut self, tok: &Tokenizer, s: &str) -> String {
        let mut ranges = tok.control_text_ranges(s);
        if s.contains([MARK_OPEN, MARK_CLOSE]) {
            ranges.extend(
                s.char_indices()
                    .filter(|&(_, c)| c == MARK_OPEN || c == MARK_CLOSE)
                    .map(|(i, c)| i..i + c.len_utf8()),
            );
            ranges.sort_by_key(|r| r.start);
        }
        if ranges.is_empty() {
            return s.to_string();
        }
        let mut out = String::with_capacity(s.len() + 8 * ranges.len());
        let mut at = 0;
        for r in ranges {
            if r.start < at {
                // Overlaps the previous range (already set aside up to `at`).
                if r.end > at {
                    if let Some(last) = self.table.last_mut() {
                        last.push_str(&s[at..r.end]);
                    }
                    at = r.end;
                }
                continue;
            }
            out.push_str(&s[at..r.start]);
            out.push(MARK_OPEN);
            out.push_str(&self.table.len().to_string());
            out.push(MARK_CLOSE);
            self.table.push(s[r.clone()].to_string());
            at = r.end;
        }
        out.push_str(&s[at..]);
        out
    }

    /// Every string of `v` (object keys included) through [`Guarded::string`].
    fn value(&mut self, tok: &Tokenizer, v: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value as J;
        match v {
            J::String(s) => J::String(self.string(tok, s)),
            J::Array(a) => J::Array(a.iter().map(|x| self.value(tok, x)).collect()),
            J::Object(o) => J::Object(
                o.iter()
                    .map(|(k, x)| (self.string(tok, k), self.value(tok, x)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    fn message(&mut self, tok: &Tokenizer, m: &Message) -> Message {
        Message {
            role: self.string(tok, &m.role),
            content: self.string(tok, &m.content),
            tool_calls: m.tool_calls.as_ref().map(|v| self.value(tok, v)),
            tool_call_id: m.tool_call_id.as_ref().map(|s| self.string(tok, s)),
            name: m.name.as_ref().map(|s| self.string(tok, s)),
        }
    }

    /// `s` with each placeholder replaced by its text.
    ///
    /// # Errors
    /// [`ChatError::Unsafe`] when a placeholder was cut or altered by the template.
    fn restore(&self, s: &str) -> Result<String, ChatError> {
        let broken = || {
            ChatError::Unsafe(
                "the template cut or changed a request string that holds control-token text, so that text cannot be kept apart from the template's own tokens".into(),
            )
        };
        let mut out = String::with_capacity(s.len());
        let mut rest = s;
        while let Some(p) = rest.find([MARK_OPEN, MARK_CLOSE]) {
            out.push_str(&rest[..p]);
            let after = rest[p..].strip_prefix(MARK_OPEN).ok_or_else(broken)?;
            let q = after.find(MARK_CLOSE).ok_or_else(broken)?;
            let i: usize = after[..q].parse().map_err(|_| broken())?;
            out.push_str(self.table.get(i).ok_or_else(broken)?);
            rest = &after[q + MARK_CLOSE.len_utf8()..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

/// Python's `json.dumps` separators without an indent (`, ` and `: `).
struct PySpaced;

impl serde_json::ser::Formatter for PySpaced {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// The `tojson` filter as HF's chat templates have it (`json.dumps(x,
/// ensure_ascii=False, indent=indent)`): `, ` and `: ` between items, or an `indent`
/// (spaces, `,` and `: `), and no HTML escaping (minijinja's own escapes `<`, `>`, `&`
/// and `'`, so the text would differ from what the model was trained on). Keyword
/// `ensure_ascii` may only be false; `sort_keys` is accepted (keys arrive sorted).
fn tojson(
    value: &Value,
    indent: Option<usize>,
    kwargs: minijinja::value::Kwargs,
) -> Result<Value, Error> {
    use serde::Serialize;
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    if kwargs.get::<Option<bool>>("ensure_ascii")? == Some(true) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: ensure_ascii=true is not supported",
        ));
    }
    let _ = kwargs.get::<Option<bool>>("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let res = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let f = serde_json::ser::PrettyFormatter::with_indent(&pad);
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, f))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out, PySpaced,
        )),
    };
    res.map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "tojson: cannot serialize").with_source(e)
    })?;
    let text = String::from_utf8(out)
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "tojson: not UTF-8"))?;
    Ok(Value::from_safe_string(text))
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
        env.add_filter("tojson", tojson);
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
    /// The render runs within [`RenderLimits::for_request`] of this request.
    ///
    /// # Errors
    /// [`ChatError::Template`] when rendering fails (e.g. the template raises on a role
    /// order it does not accept); [`ChatError::Limit`] when it exceeds its fuel or
    /// output limit.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, ChatError> {
        let limits = RenderLimits::for_request(messages, tools);
        self.render_within(messages, add_generation_prompt, tools, limits)
            .map(|(text, _)| text)
    }

    /// [`ChatTemplate::render`] with explicit limits, also returning the fuel the render
    /// consumed (to size limits by measurement).
    ///
    /// # Errors
    /// As [`ChatTemplate::render`].
    pub fn render_within(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        limits: RenderLimits,
    ) -> Result<(String, u64), ChatError> {
        let mut env = self.env.clone();
        env.set_fuel(Some(limits.fuel));
        let t = env.get_template("chat").map_err(tmpl_err)?;
        let ctx = minijinja::context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => tools.map(|t| Value::from(minijinja::value::Serde(t))),
        };
        let mut out = CappedOutput {
            buf: Vec::new(),
            cap: usize::try_from(limits.output_bytes).unwrap_or(usize::MAX),
            over: false,
        };
        let fuel = match t.render_captured_to(ctx, &mut out) {
            Ok(c) => c.state().fuel_levels().map_or(0, |(used, _)| used),
            Err(_) if out.over => {
                return Err(ChatError::Limit {
                    what: "output",
                    limit: limits.output_bytes,
                    unit: "bytes",
                })
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                return Err(ChatError::Limit {
                    what: "fuel",
                    limit: limits.fuel,
                    unit: "units",
                })
            }
            Err(e) => return Err(tmpl_err(e)),
        };
        let text = String::from_utf8(out.buf)
            .map_err(|_| ChatError::Template("the render is not UTF-8".into()))?;
        Ok((text, fuel))
    }

    /// Encodes a conversation to token ids so that only the template emits control tokens.
    ///
    /// Every string the request gives the template (each message's role, content, name
    /// and call id, its `tool_calls`, and `tools`, object keys included) is rendered with
    /// each control token's text in it (and a head or tail that template text could
    /// complete into one, see [`Tokenizer::control_text_ranges`]) replaced by a
    /// placeholder. A control token in that render is the template's own. When no
    /// placeholder was needed the ids are the render's, as
    /// `apply_chat_template(tokenize=True)` gives them. Otherwise the render is cut at
    /// the template's control tokens and the text between them, placeholders restored to
    /// the text they stand for, is encoded with control-token parsing off.
    ///
    /// # Errors
    /// [`ChatError::Template`] or [`ChatError::Limit`] on a render failure;
    /// [`ChatError::Unsafe`] when the template cut or altered a placeholder (it
    /// transforms a request string that holds control-token text).
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, ChatError> {
        let mut g = Guarded::default();
        let guarded: Vec<Message> = messages.iter().map(|m| g.message(tokenizer, m)).collect();
        let tools = tools.map(|t| g.value(tokenizer, t));
        let text = self.render(&guarded, add_generation_prompt, tools.as_ref())?;
        encode_guarded(tokenizer, &g, &text)
    }

    /// [`ChatTemplate::encode`] with the final message left open, to be continued (an
    /// assistant prefill): the conversation rendered without a generation prompt and cut
    /// right after the final message's content, as HF transformers'
    /// `apply_chat_template(..., continue_final_message=True)` does (it finds the last
    /// occurrence of the content, whitespace-stripped, in the render, and cuts after it,
    /// keeping the content's trailing whitespace when the template kept it).
    ///
    /// # Errors
    /// As [`ChatTemplate::encode`]; [`ChatError::Template`] when `messages` is empty or
    /// the render does not hold the final message's content.
    pub fn encode_continuing(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, ChatError> {
        let mut g = Guarded::default();
        let guarded: Vec<Message> = messages.iter().map(|m| g.message(tokenizer, m)).collect();
        let tools = tools.map(|t| g.value(tokenizer, t));
        let last = guarded
            .last()
            .ok_or_else(|| ChatError::Template("no message to continue".into()))?;
        let text = self.render(&guarded, false, tools.as_ref())?;
        let content = last.content.as_str();
        let stripped = content.trim();
        let at = text.rfind(stripped).ok_or_else(|| {
            ChatError::Template("the render does not hold the final message's content".into())
        })?;
        let kept = content.trim_start();
        let end = if text[at..].starts_with(kept) {
            at + kept.len()
        } else {
            at + stripped.len()
        };
        encode_guarded(tokenizer, &g, &text[..end])
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

/// The ids of `text`, a render of guarded strings (see [`ChatTemplate::encode`]).
fn encode_guarded(tokenizer: &Tokenizer, g: &Guarded, text: &str) -> Result<Vec<u32>, ChatError> {
    let (ids, offsets) = tokenizer.encode_with_special_offsets(text)?;
    if g.table.is_empty() {
        return Ok(ids);
    }
    let mut out = Vec::with_capacity(ids.len());
    let mut at = 0;
    for (&id, &(s, e)) in ids.iter().zip(&offsets) {
        if tokenizer.is_special(id) {
            out.extend(tokenizer.encode(&g.restore(&text[at..s])?)?);
            out.push(id);
            at = e;
        }
    }
    out.extend(tokenizer.encode(&g.restore(&text[at..])?)?);
    Ok(out)
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
