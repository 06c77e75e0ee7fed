//! Tool calling: the tools offered to the model, how they reach its prompt, and how its
//! tool calls are read back out of its text.
//!
//! **Format.** fak reads and writes tool calls in the Hermes format, the one Qwen 2.5,
//! Qwen 3, Hermes and SmolLM3 templates use: each call is a JSON object
//! `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, and a
//! tool result goes back inside `<tool_response>` … `</tool_response>` in a user turn.
//!
//! **Prompt side** ([`prepare`]). A template that renders `tools` itself in this format
//! (its source mentions both `tools` and `<tool_call>`) gets the tools as the `tools`
//! variable (OpenAI's `{"type": "function", "function": {...}}` shape, as HF's
//! `apply_chat_template(tools=...)` takes it) and the messages with their `tool_calls`,
//! arguments as JSON objects. Any other template (SmolLM2's, Gemma's, ChatML) is not
//! asked to do what it cannot: fak writes the tool signatures and the call format into
//! the system message, an assistant's earlier calls into its content as `<tool_call>`
//! blocks, and tool results as user turns wrapped in `<tool_response>`.
//!
//! **`tool_choice`.** `none` offers no tools and reads no calls; `auto` lets the model
//! choose; `required` and a named tool start the reply with the call's opening text
//! (`<tool_call>\n{"name": "` or the whole head up to `"arguments": `), which the model
//! continues. That forced head is part of the prompt (it is counted in the prompt
//! tokens) and is fed to the parser first, so the call reads whole.
//!
//! **Output side** ([`ToolCallParser`]). Text outside calls streams through (a tail that
//! could be the start of `<tool_call>` is held until it is not; whitespace-only text is
//! held until something follows it, and dropped after a call). A call's JSON is read when
//! `</tool_call>` arrives, or at the end of the reply when the model ends its turn
//! without closing the tag but the JSON is whole. A call whose JSON cannot be read is
//! still reported, marked [`ToolCall::malformed`], so the layer above can fail closed on
//! it; it is never passed off as text.

use fak_model::Message;
use serde::Serialize;
use serde_json::{Map, Value};
use std::sync::atomic::{AtomicU64, Ordering};

/// Opening tag of a call.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// Closing tag of a call.
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// A tool the client offers (OpenAI `tools[].function`, Anthropic `tools[]`).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    /// The function name the model calls it by.
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// JSON Schema of its arguments (an object schema; `{}` when none was given).
    pub parameters: Value,
    /// The client asked for strict schema adherence (OpenAI `function.strict`,
    /// Anthropic `strict`): a schema the engine cannot constrain is then the request's
    /// error instead of a fallback to any JSON object
    /// ([`crate::tool_grammar::ToolGrammar::check_strict`]).
    pub strict: bool,
}

/// Which calls the model may or must make.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// No tools are offered and no calls are read.
    None,
    /// The model decides (the default when tools are given).
    #[default]
    Auto,
    /// The reply must be a call (OpenAI `required`, Anthropic `any`).
    Required,
    /// The reply must be a call of this tool.
    Named(String),
}

/// One tool call read from the model's reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// A fresh id (`call_…`), unique within the process.
    pub id: String,
    /// The tool's name (empty when it could not be read).
    pub name: String,
    /// The arguments as compact JSON text (an object), or the raw text the model wrote
    /// when [`ToolCall::malformed`] is set.
    pub arguments: String,
    /// Why the call could not be read (not JSON, no `name`, arguments not an object);
    /// `None` for a well-formed call.
    pub malformed: Option<String>,
    /// The reply's token budget (`max_tokens`, or the context's end) ran out inside this
    /// call, before `</tool_call>`, and what arrived does not read as a call (`malformed`
    /// is set): the layer above denies it `TRUNCATED` rather than `MALFORMED`.
    pub truncated: bool,
}

/// The prompt of a tool-using chat request, ready for the template.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolPrompt {
    /// The messages to render (rewritten for templates that do not render tools).
    pub messages: Vec<Message>,
    /// The `tools` variable for a template that renders them, else `None`.
    pub tools: Option<Value>,
    /// Text the reply starts with (the forced head of a call), `""` for none. It goes
    /// into the prompt after the generation prompt, and into the parser first.
    pub assistant_prefix: String,
}

/// Whether a template renders `tools` itself in the Hermes format (see the module docs).
pub fn template_renders_tools(source: &str) -> bool {
    source.contains("tools") && source.contains(TOOL_CALL_OPEN)
}

/// A fresh tool call id: `call_` then time and a counter in hex, unique within the
/// process.
pub fn new_call_id() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("call_{t:x}{:06x}", N.fetch_add(1, Ordering::Relaxed))
}

/// A tool as chat templates take it (the `tools` variable, and the JSON fak writes
/// into the system text): OpenAI's `{"type": "function", "function": {...}}` shape,
/// keys in this order.
#[derive(Serialize)]
struct TemplateTool<'a> {
    /// Always `"function"`.
    #[serde(rename = "type")]
    kind: &'static str,
    function: TemplateFunction<'a>,
}

/// [`TemplateTool`]'s function.
#[derive(Serialize)]
struct TemplateFunction<'a> {
    name: &'a str,
    /// The arguments' JSON Schema.
    parameters: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a str>,
}

/// A call of an assistant message as chat templates take it: the arguments as a JSON
/// value (templates write them with `tojson`), not OpenAI's string of JSON; the id
/// kept when the client gave one.
#[derive(Serialize)]
struct TemplateCall<'a> {
    /// Always `"function"`.
    #[serde(rename = "type")]
    kind: &'static str,
    function: TemplateCallFunction,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a Value>,
}

/// [`TemplateCall`]'s function.
#[derive(Serialize)]
struct TemplateCallFunction {
    name: String,
    arguments: Value,
}

/// A template-side shape as a JSON value (serializing these structs cannot fail: their
/// maps have string keys).
fn template_value(x: impl Serialize) -> Value {
    serde_json::to_value(x).unwrap_or(Value::Null)
}

/// The tools in OpenAI's `{"type": "function", "function": {...}}` shape.
fn tools_json(tools: &[ToolSpec]) -> Vec<Value> {
    tools
        .iter()
        .map(|t| {
            template_value(TemplateTool {
                kind: "function",
                function: TemplateFunction {
                    name: &t.name,
                    parameters: &t.parameters,
                    description: t.description.as_deref(),
                },
            })
        })
        .collect()
}

/// The system text fak adds for a template that does not render tools.
fn tools_system_text(tools: &[ToolSpec]) -> String {
    let mut s = String::from(
        "You can call functions (tools) to answer. Their signatures, as JSON, are inside <tools></tools>:\n<tools>\n",
    );
    for t in tools_json(tools) {
        s.push_str(&t.to_string());
        s.push('\n');
    }
    s.push_str(
        "</tools>\nTo call a function, reply with a JSON object inside <tool_call></tool_call> tags, one block per call:\n<tool_call>\n{\"name\": \"function name\", \"arguments\": {\"argument name\": \"value\"}}\n</tool_call>\nFunction results come back to you inside <tool_response></tool_response> tags.",
    );
    s
}

/// An assistant message's calls (OpenAI shape: `[{id, type, function: {name,
/// arguments}}]`) as `(name, arguments)` with arguments as JSON values: a string of JSON
/// is parsed, anything else kept as given.
fn calls_of(v: &Value) -> Vec<(String, Value)> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    let f = c.get("function").unwrap_or(c);
                    let name = f
                        .get("name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    let args = match f.get("arguments") {
                        Some(Value::String(s)) => {
                            serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
                        }
                        Some(v) => v.clone(),
                        None => Value::Object(Map::new()),
                    };
                    (name, args)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The reply's forced head for `choice`.
fn forced_prefix(choice: &ToolChoice) -> String {
    match choice {
        ToolChoice::Required => format!("{TOOL_CALL_OPEN}\n{{\"name\": \""),
        ToolChoice::Named(n) => format!(
            "{TOOL_CALL_OPEN}\n{{\"name\": {}, \"arguments\": ",
            Value::String(n.clone())
        ),
        _ => String::new(),
    }
}

/// Prepares a tool-using conversation for a template (see the module docs).
/// `renders_tools` is [`template_renders_tools`] of the template's source. With no tools
/// or [`ToolChoice::None`] the messages are still made renderable (earlier calls and
/// tool results written as text when the template cannot render them) but no tools are
/// offered.
pub fn prepare(
    messages: &[Message],
    tools: &[ToolSpec],
    choice: &ToolChoice,
    renders_tools: bool,
) -> ToolPrompt {
    let offer = !tools.is_empty() && *choice != ToolChoice::None;
    let assistant_prefix = if offer {
        forced_prefix(choice)
    } else {
        String::new()
    };
    if renders_tools {
        let messages = messages
            .iter()
            .map(|m| {
                let mut m = m.clone();
                if let Some(tc) = &m.tool_calls {
                    let calls: Vec<Value> = calls_of(tc)
                        .into_iter()
                        .zip(tc.as_array().into_iter().flatten())
                        .map(|((name, arguments), orig)| {
                            template_value(TemplateCall {
                                kind: "function",
                                function: TemplateCallFunction { name, arguments },
                                id: orig.get("id"),
                            })
                        })
                        .collect();
                    m.tool_calls = Some(Value::Array(calls));
                }
                m
            })
            .collect();
        return ToolPrompt {
            messages,
            tools: offer.then(|| Value::Array(tools_json(tools))),
            assistant_prefix,
        };
    }
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    for m in messages {
        let mut m = m.clone();
        if let Some(tc) = m.tool_calls.take() {
            for (name, args) in calls_of(&tc) {
                if !m.content.is_empty() {
                    m.content.push('\n');
                }
                m.content.push_str(&format!(
                    "{TOOL_CALL_OPEN}\n{}\n{TOOL_CALL_CLOSE}",
                    call_json(&name, &args)
                ));
            }
        }
        if m.role == "tool" {
            m = Message::new(
                "user",
                &format!("<tool_response>\n{}\n</tool_response>", m.content),
            );
        }
        out.push(m);
    }
    if offer {
        let text = tools_system_text(tools);
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{text}", first.content);
            }
            _ => out.insert(0, Message::new("system", &text)),
        }
    }
    ToolPrompt {
        messages: out,
        tools: None,
        assistant_prefix,
    }
}

/// What the parser releases: text to stream, or a whole call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// Text outside calls.
    Text(String),
    /// A call, whole.
    Call(ToolCall),
}

/// Splits a streamed reply into text and tool calls (see the module docs).
#[derive(Debug, Default)]
pub struct ToolCallParser {
    /// Text not yet released (outside a call), or the call body so far (inside one).
    pending: String,
    in_call: bool,
    calls: usize,
}

/// The longest suffix of `s` that is a proper prefix of `tag` (a tag maybe arriving).
fn partial_tag_len(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

fn release(text: &str, out: &mut Vec<Parsed>) {
    if !text.is_empty() {
        out.push(Parsed::Text(text.to_string()));
    }
}

/// A call as the model is asked to write it: `{"name": ..., "arguments": ...}`.
fn call_json(name: &str, args: &Value) -> String {
    format!(
        "{{\"name\": {}, \"arguments\": {args}}}",
        Value::String(name.into())
    )
}

/// Where `body` (a call's text after [`TOOL_CALL_OPEN`]) has its [`TOOL_CALL_CLOSE`]:
/// the first one outside a JSON string. A string argument may contain the close tag's
/// text (a schema's enum can even require it), and the call does not end there.
/// Strings are tracked as JSON writes them: `"` opens and closes, `\` escapes the next
/// character inside one.
fn close_at(body: &str) -> Option<usize> {
    let (mut in_string, mut escaped) = (false, false);
    for (i, c) in body.char_indices() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if body[i..].starts_with(TOOL_CALL_CLOSE) {
            return Some(i);
        }
    }
    None
}

/// Reads one call body (the text between the tags).
fn read_call(body: &str) -> ToolCall {
    let fail = |why: &str, name: String| ToolCall {
        id: new_call_id(),
        name,
        arguments: body.trim().to_string(),
        malformed: Some(why.to_string()),
        truncated: false,
    };
    let v: Value = match serde_json::from_str(body.trim()) {
        Ok(v) => v,
        Err(e) => {
            // Name the tool if its name can be seen, for the audit.
            let name = body
                .split_once("\"name\"")
                .and_then(|(_, r)| r.split('"').nth(1))
                .unwrap_or("")
                .to_string();
            return fail(&format!("the call is not JSON: {e}"), name);
        }
    };
    let Some(name) = v.get("name").and_then(Value::as_str) else {
        return fail("the call has no string `name`", String::new());
    };
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(a @ Value::Object(_)) => a,
            _ => {
                return fail(
                    "`arguments` is a string that is not a JSON object",
                    name.into(),
                )
            }
        },
        Some(a @ Value::Object(_)) => a.clone(),
        Some(_) => return fail("`arguments` is not a JSON object", name.into()),
    };
    ToolCall {
        id: new_call_id(),
        name: name.to_string(),
        arguments: args.to_string(),
        malformed: None,
        truncated: false,
    }
}

impl ToolCallParser {
    /// A parser for a reply that begins with `prefix` (the forced head from
    /// [`ToolPrompt::assistant_prefix`], or `""`).
    pub fn new(prefix: &str) -> Self {
        let mut p = ToolCallParser::default();
        let released = p.push(prefix);
        debug_assert!(released.is_empty());
        p
    }

    /// Calls read so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Feeds the next piece of the reply; returns what can be released now.
    pub fn push(&mut self, piece: &str) -> Vec<Parsed> {
        self.pending.push_str(piece);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(at) = close_at(&self.pending) else {
                    break;
                };
                let call = read_call(&self.pending[..at]);
                self.pending.drain(..at + TOOL_CALL_CLOSE.len());
                self.in_call = false;
                self.calls += 1;
                out.push(Parsed::Call(call));
                continue;
            }
            if let Some(at) = self.pending.find(TOOL_CALL_OPEN) {
                let before: String = self.pending.drain(..at).collect();
                release(before.trim_end(), &mut out);
                self.pending.drain(..TOOL_CALL_OPEN.len());
                self.in_call = true;
                continue;
            }
            // Hold a tail that may be the start of a tag, and trailing whitespace (it is
            // dropped if a call follows).
            let keep = partial_tag_len(&self.pending, TOOL_CALL_OPEN);
            let cut = self.pending[..self.pending.len() - keep].trim_end().len();
            let text: String = self.pending.drain(..cut).collect();
            release(&text, &mut out);
            break;
        }
        out
    }

    /// Ends the reply: an unclosed call is read from what arrived (malformed unless its
    /// JSON is whole); held text is released (whitespace only when no call was read).
    /// `budget_ran_out`: the reply ended at its token budget (finish reason `length`),
    /// so a malformed unclosed call is marked [`ToolCall::truncated`].
    pub fn finish(mut self, budget_ran_out: bool) -> Vec<Parsed> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        if self.in_call {
            let mut call = read_call(&rest);
            if let Some(why) = &mut call.malformed {
                *why = format!("the call was cut off before {TOOL_CALL_CLOSE}: {why}");
                call.truncated = budget_ran_out;
            }
            self.calls += 1;
            out.push(Parsed::Call(call));
        } else if !rest.trim().is_empty() || (self.calls == 0 && !rest.is_empty()) {
            out.push(Parsed::Text(rest));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(prefix: &str, pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut p = ToolCallParser::new(prefix);
        let mut all: Vec<Parsed> = pieces.iter().flat_map(|x| p.push(x)).collect();
        all.extend(p.finish(false));
        let mut text = String::new();
        let mut calls = Vec::new();
        for x in all {
            match x {
                Parsed::Text(t) => text.push_str(&t),
                Parsed::Call(c) => calls.push(c),
            }
        }
        (text, calls)
    }

    #[test]
    fn plain_text_passes_through_unchanged() {
        for pieces in [
            vec!["Hello", " world", "\n"],
            vec!["  lead", "ing <tool", "s> are < fine"],
            vec!["a <", "tool_cal", "l is not", " here"],
        ] {
            let (t, c) = run("", &pieces);
            assert_eq!(t, pieces.concat());
            assert!(c.is_empty());
        }
    }

    #[test]
    fn calls_split_across_pieces_are_read() {
        let (t, c) = run(
            "",
            &[
                "Let me check.\n<tool",
                "_call>\n{\"name\": \"get_weather\", \"argu",
                "ments\": {\"city\": \"Paris\"}}\n</tool_",
                "call>\n<tool_call>{\"name\":\"b\",\"arguments\":\"{\\\"x\\\":1}\"}</tool_call>\n",
            ],
        );
        assert_eq!(t, "Let me check.");
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].name, "get_weather");
        assert_eq!(c[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(c[1].name, "b");
        assert_eq!(c[1].arguments, r#"{"x":1}"#);
        assert!(c.iter().all(|c| c.malformed.is_none()));
        assert_ne!(c[0].id, c[1].id);
    }

    /// A string argument holding the close tag's text (here required by the schema's
    /// enum, so constrained decoding writes it) is part of the call, whole and in
    /// pieces split inside the tag; nothing of it reaches the text.
    #[test]
    fn a_close_tag_inside_a_string_does_not_end_the_call() {
        let body = r#"{"name": "get_weather", "arguments": {"city": "Paris</tool_call>Ly\"on"}}"#;
        for pieces in [
            vec!["<tool_call>\n", body, "\n</tool_call>"],
            vec![
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris</to",
                "ol_call>Ly\\\"on\"}}\n</tool",
                "_call>",
            ],
        ] {
            let (t, c) = run("", &pieces);
            assert_eq!(t, "", "{pieces:?}");
            assert_eq!(c.len(), 1, "{pieces:?}");
            assert!(c[0].malformed.is_none(), "{:?}", c[0].malformed);
            assert_eq!(c[0].arguments, r#"{"city":"Paris</tool_call>Ly\"on"}"#);
        }
        // After a forced head (which opens the name's string).
        let (t, c) = run(
            &forced_prefix(&ToolChoice::Named("get_weather".into())),
            &["{\"city\": \"a</tool_call>b\"}}\n</tool_call>"],
        );
        assert_eq!((t.as_str(), c.len()), ("", 1));
        assert_eq!(c[0].arguments, r#"{"city":"a</tool_call>b"}"#);
    }

    #[test]
    fn forced_heads_are_read_with_the_reply() {
        let (t, c) = run(
            &forced_prefix(&ToolChoice::Named("get_time".into())),
            &["{\"tz\": \"UTC\"}}\n</tool_call>"],
        );
        assert_eq!((t.as_str(), c.len()), ("", 1));
        assert_eq!(c[0].name, "get_time");
        assert_eq!(c[0].arguments, r#"{"tz":"UTC"}"#);
        let (_, c) = run(
            &forced_prefix(&ToolChoice::Required),
            &["x\", \"arguments\": {}}"],
        );
        // Unclosed but whole JSON (the model ended its turn): read.
        assert_eq!(c[0].name, "x");
        assert!(c[0].malformed.is_none());
    }

    #[test]
    fn malformed_calls_are_reported_not_passed_as_text() {
        for (body, name) in [
            ("{\"name\": \"rm\", \"arguments\": {\"p\": }", "rm"),
            ("{\"arguments\": {}}", ""),
            ("{\"name\": \"f\", \"arguments\": [1]}", "f"),
            ("{\"name\": \"f\", \"arguments\": \"not json\"}", "f"),
            ("not json at all", ""),
        ] {
            let (t, c) = run("", &["<tool_call>", body, "</tool_call>"]);
            assert_eq!(t, "");
            assert_eq!(c.len(), 1, "{body}");
            assert_eq!(c[0].name, name, "{body}");
            assert!(c[0].malformed.is_some(), "{body}");
        }
        let (_, c) = run("", &["<tool_call>{\"name\": \"f\", \"argum"]);
        assert!(c[0].malformed.as_deref().unwrap().contains("cut off"));
    }

    #[test]
    fn templates_without_tools_get_them_as_text() {
        let tools = vec![ToolSpec {
            name: "get_weather".into(),
            description: Some("Weather for a city".into()),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            strict: false,
        }];
        let mut asst = Message::new("assistant", "");
        asst.tool_calls = Some(json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]));
        let mut tool = Message::new("tool", "18 C");
        tool.tool_call_id = Some("call_1".into());
        let msgs = vec![Message::new("user", "weather?"), asst, tool];
        let p = prepare(&msgs, &tools, &ToolChoice::Auto, false);
        assert_eq!(p.tools, None);
        assert_eq!(p.assistant_prefix, "");
        assert_eq!(p.messages.len(), 4);
        assert_eq!(p.messages[0].role, "system");
        assert!(p.messages[0].content.contains("\"get_weather\""));
        assert_eq!(
            p.messages[2].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>"
        );
        assert_eq!(p.messages[2].tool_calls, None);
        assert_eq!(p.messages[3].role, "user");
        assert_eq!(
            p.messages[3].content,
            "<tool_response>\n18 C\n</tool_response>"
        );
        // `none`: nothing offered, history still renderable.
        let p = prepare(&msgs, &tools, &ToolChoice::None, false);
        assert_eq!(p.messages.len(), 3);
        // Tool-rendering templates get the variable and object arguments.
        let p = prepare(
            &msgs,
            &tools,
            &ToolChoice::Named("get_weather".into()),
            true,
        );
        assert_eq!(
            p.tools.as_ref().unwrap()[0]["function"]["name"],
            "get_weather"
        );
        assert_eq!(
            p.messages[1].tool_calls.as_ref().unwrap()[0]["function"]["arguments"]["city"],
            "Paris"
        );
        assert!(p.assistant_prefix.ends_with("\"arguments\": "));
    }

    #[test]
    fn partial_tags_respect_char_boundaries() {
        assert_eq!(partial_tag_len("abc<tool", TOOL_CALL_OPEN), 5);
        assert_eq!(partial_tag_len("é", TOOL_CALL_OPEN), 0);
        assert_eq!(partial_tag_len("<tool_call", TOOL_CALL_OPEN), 10);
        assert_eq!(partial_tag_len("", TOOL_CALL_OPEN), 0);
    }
}
