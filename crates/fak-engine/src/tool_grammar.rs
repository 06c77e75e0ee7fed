//! The grammar of a tool call: what a reply may be when `tool_choice` forces a call,
//! and what a call the model opens under `tool_choice` `auto` may be.
//!
//! **`auto`** (or no `tool_choice`, with tools offered; [`auto_call_grammar`]). The
//! reply is free text until the model writes `<tool_call>` (text, not a token, in
//! SmolLM2's and Gemma 3's vocabularies); from there the rest of the call is
//! constrained as below, the grammar being lazy ([`fak_kv::Grammar::lazy`]): the steps
//! before the tag are exactly the unconstrained steps. After `</tool_call>` only the
//! end of the turn is allowed, as for a forced call, whatever `parallel_tool_calls`
//! says (the engine request does not carry it): SmolLM2-135M, allowed more, repeats
//! its call until `max_tokens` cuts the last one off (as found for forced calls), and
//! one whole call serves a client better than a truncated second.
//! A request with a `response_format` (or `grammar`) keeps that grammar instead, and
//! its calls are not constrained.
//!
//! For `tool_choice` `required` (Anthropic `any`) or a named tool, the reply is
//! constrained from its first token ([`fak_kv::grammar`]) to one call in the format of
//! [`crate::tools`]:
//!
//! ```text
//! <tool_call>
//! {"name": "NAME", "arguments": ARGUMENTS}
//! </tool_call>
//! ```
//!
//! naming an offered tool (the named one for a named choice) with `ARGUMENTS` a JSON
//! object valid for that tool's `parameters` schema
//! (OpenAI `tools[].function.parameters`, Anthropic `tools[].input_schema`). The reply
//! starts after the forced head that [`crate::tools::prepare`] writes into the prompt
//! ([`crate::tools::ToolPrompt::assistant_prefix`]), so the grammar is the rest of the
//! call: for `required` from the tool's name on, for a named tool from its arguments on.
//! The grammar ends after `</tool_call>`, where only the end of the turn is allowed:
//! one call, not several. (Allowed more, SmolLM2-135M repeats its call until
//! `max_tokens` cuts the last one off, which the boundary must then deny `MALFORMED`.)
//! Within the token budget a call is always whole; a call that `max_tokens` cuts off is
//! denied `TRUNCATED` ([`crate::policy::DenyReason::Truncated`]), never passed on.
//!
//! The grammar is written in llguidance's Lark dialect, each tool's arguments as a
//! `%json { ... }` schema, with the same compact separators as a `json_schema`
//! response format ([`fak_kv::grammar::json_options`]).
//!
//! **Schemas as clients send them** ([`arguments_schema`]). A call's arguments are a
//! JSON object whatever the schema says, so a schema without `type` gets
//! `"type": "object"`; a schema that lists `properties` and says nothing of
//! `additionalProperties` gets `"additionalProperties": false` at its top level (the
//! model writes the declared arguments rather than invent others; what it writes still
//! validates against the client's schema). A schema llguidance cannot compile (a
//! keyword it does not implement, such as `not`) does not fail the request: that tool's
//! arguments fall back to any JSON object and a warning names the tool and the cause
//! ([`ToolGrammar::fallbacks`]), unless the tool is `strict`: then the request is a 400
//! naming the tool and the cause ([`ToolGrammar::check_strict`]). Constrained means
//! well-formed, not allowed: the policy
//! above still adjudicates every call.

use crate::tools::{ToolChoice, ToolSpec, TOOL_CALL_CLOSE};
use serde_json::{Map, Value};

/// The grammar of the rest of a forced call, and what it had to relax.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolGrammar {
    /// The grammar, in llguidance's Lark syntax (`start: ...`), of the reply after the
    /// forced head.
    pub lark: String,
    /// `(tool name, why)` for each tool whose schema did not compile, whose arguments
    /// are constrained to any JSON object instead.
    pub fallbacks: Vec<(String, String)>,
}

impl ToolGrammar {
    /// Refuses a fallback for a tool the client marked `strict` ([`ToolSpec::strict`]):
    /// its schema must be enforced as given, so one the grammar cannot constrain is the
    /// request's error, not "any JSON object". Tools without `strict` keep the fallback.
    ///
    /// # Errors
    /// The first strict tool of [`ToolGrammar::fallbacks`]: a message naming the tool
    /// and why its schema cannot be constrained (llguidance's message, naming the
    /// construct).
    pub fn check_strict(&self, tools: &[ToolSpec]) -> Result<(), String> {
        match self
            .fallbacks
            .iter()
            .find(|(name, _)| tools.iter().any(|t| t.strict && &t.name == name))
        {
            None => Ok(()),
            Some((name, why)) => Err(format!(
                "tool '{name}' is `strict` but its schema cannot be constrained: {why}"
            )),
        }
    }
}

/// A tool's `parameters` schema as the grammar constrains its arguments (see the module
/// docs): `type` defaults to `object`; with `properties` listed, `additionalProperties`
/// defaults to `false`. A schema whose `type` excludes `object` cannot describe call
/// arguments (a JSON object) and is returned as `None`.
pub fn arguments_schema(parameters: &Value) -> Option<Value> {
    let Value::Object(m) = parameters else {
        return None;
    };
    let mut m = m.clone();
    match m.get("type") {
        None => {
            m.insert("type".into(), Value::String("object".into()));
        }
        Some(Value::String(t)) if t == "object" => {}
        Some(Value::Array(ts)) if ts.iter().any(|t| t == "object") => {
            m.insert("type".into(), Value::String("object".into()));
        }
        Some(_) => return None,
    }
    let lists_properties = m
        .get("properties")
        .and_then(Value::as_object)
        .is_some_and(|p| !p.is_empty());
    if lists_properties && !m.contains_key("additionalProperties") {
        m.insert("additionalProperties".into(), Value::Bool(false));
    }
    Some(Value::Object(m))
}

/// Any JSON object: the fallback for a schema that cannot be constrained.
fn any_object() -> Value {
    let mut m = Map::new();
    m.insert("type".into(), Value::String("object".into()));
    Value::Object(m)
}

/// A Lark string literal of `text` (Lark string literals are JSON strings).
fn lit(text: &str) -> String {
    Value::String(text.into()).to_string()
}

/// `name` as it sits inside a JSON string (escaped, without the quotes).
fn json_inner(name: &str) -> String {
    let quoted = Value::String(name.into()).to_string();
    quoted[1..quoted.len() - 1].to_string()
}

/// The rules of each offered tool's call (`arguments_i`, its arguments; `rest_i`, its
/// call from the name on, through `</tool_call>`), with the fallbacks they needed.
fn call_rules(
    offered: &[&ToolSpec],
    compiles: &dyn Fn(&Value) -> Result<(), String>,
) -> (String, Vec<(String, String)>) {
    let mut fallbacks = Vec::new();
    let mut rules = String::new();
    for (i, t) in offered.iter().enumerate() {
        let schema = match arguments_schema(&t.parameters) {
            None => Err("its type does not allow a JSON object".to_string()),
            Some(s) => match fak_kv::grammar::json_options(s) {
                Ok(s) => compiles(&s).map(|()| s),
                Err(e) => Err(e.to_string()),
            },
        };
        let schema = schema.unwrap_or_else(|why| {
            fallbacks.push((t.name.clone(), why));
            fak_kv::grammar::json_options(any_object()).unwrap_or_else(|_| any_object())
        });
        rules.push_str(&format!("arguments_{i}: %json {schema}\n"));
        rules.push_str(&format!(
            "rest_{i}: {} arguments_{i} {}\n",
            lit(&format!("{}\", \"arguments\": ", json_inner(&t.name))),
            lit(&format!("}}\n{TOOL_CALL_CLOSE}"))
        ));
    }
    (rules, fallbacks)
}

/// `rest_0 | rest_1 | ...` over `n` tools.
fn any_rest(n: usize) -> String {
    (0..n)
        .map(|i| format!("rest_{i}"))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The grammar of the reply after the forced head for `choice` over `tools`, or `None`
/// when `choice` forces no call (`auto`, `none`) or names no offered tool.
///
/// `compiles` tells whether a tool's arguments schema (as [`arguments_schema`] gives
/// it, with [`fak_kv::grammar::json_options`] applied) compiles; a tool whose schema
/// does not (or that [`arguments_schema`] refuses) is listed in
/// [`ToolGrammar::fallbacks`] and its arguments are any JSON object.
pub fn forced_call_grammar(
    tools: &[ToolSpec],
    choice: &ToolChoice,
    compiles: &dyn Fn(&Value) -> Result<(), String>,
) -> Option<ToolGrammar> {
    let offered: Vec<&ToolSpec> = match choice {
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).take(1).collect(),
        ToolChoice::Auto | ToolChoice::None => return None,
    };
    if offered.is_empty() {
        return None;
    }
    let (rules, fallbacks) = call_rules(&offered, compiles);
    let start = match choice {
        // One call, from its name on.
        ToolChoice::Required => format!("start: {}\n", any_rest(offered.len())),
        // The one call, from its arguments on.
        _ => format!(
            "start: arguments_0 {}\n",
            lit(&format!("}}\n{TOOL_CALL_CLOSE}"))
        ),
    };
    Some(ToolGrammar {
        lark: format!("{start}{rules}"),
        fallbacks,
    })
}

/// The grammar of a call the model opens under `tool_choice` `auto` (or none given)
/// over `tools`: the text after `<tool_call>` ([`crate::tools::TOOL_CALL_OPEN`], the lazy grammar's
/// trigger, [`fak_kv::Grammar::lazy`]), i.e. optional blanks (the prompt's format puts
/// a newline there), then `{"name": "` and one offered tool's call through
/// `</tool_call>`, then the end of the turn: one call, as for a forced call. `None`
/// when no tool is offered. `compiles` and the fallbacks as in [`forced_call_grammar`].
pub fn auto_call_grammar(
    tools: &[ToolSpec],
    compiles: &dyn Fn(&Value) -> Result<(), String>,
) -> Option<ToolGrammar> {
    if tools.is_empty() {
        return None;
    }
    let offered: Vec<&ToolSpec> = tools.iter().collect();
    let (rules, fallbacks) = call_rules(&offered, compiles);
    let start = format!(
        "start: blank? {} ({})\nblank: /[ \\t]*\\n[ \\t]*|[ \\t]+/\n",
        lit("{\"name\": \""),
        any_rest(offered.len())
    );
    Some(ToolGrammar {
        lark: format!("{start}{rules}"),
        fallbacks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn client_schemas_become_object_schemas() {
        assert_eq!(
            arguments_schema(&json!({})),
            Some(json!({"type": "object"}))
        );
        assert_eq!(
            arguments_schema(&json!({"properties": {"a": {"type": "string"}}})),
            Some(
                json!({"type": "object", "properties": {"a": {"type": "string"}},
                "additionalProperties": false})
            )
        );
        // The client's own additionalProperties stands.
        assert_eq!(
            arguments_schema(&json!({"type": "object", "properties": {"a": {}},
                "additionalProperties": true})),
            Some(json!({"type": "object", "properties": {"a": {}}, "additionalProperties": true}))
        );
        assert_eq!(
            arguments_schema(&json!({"type": ["object", "null"]})),
            Some(json!({"type": "object"}))
        );
        assert_eq!(arguments_schema(&json!({"type": "string"})), None);
        assert_eq!(arguments_schema(&json!(true)), None);
    }

    fn tool(name: &str, parameters: Value) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: None,
            parameters,
            strict: false,
        }
    }

    #[test]
    fn only_forced_choices_get_a_grammar() {
        let tools = vec![tool("a", json!({}))];
        let ok = |_: &Value| Ok(());
        assert!(forced_call_grammar(&tools, &ToolChoice::Auto, &ok).is_none());
        assert!(forced_call_grammar(&tools, &ToolChoice::None, &ok).is_none());
        assert!(forced_call_grammar(&tools, &ToolChoice::Named("b".into()), &ok).is_none());
        assert!(forced_call_grammar(&[], &ToolChoice::Required, &ok).is_none());
        let g = forced_call_grammar(&tools, &ToolChoice::Named("a".into()), &ok).unwrap();
        assert!(g.lark.starts_with("start: arguments_0 "), "{}", g.lark);
        assert!(g.fallbacks.is_empty());
    }

    #[test]
    fn an_auto_call_starts_after_the_tag_and_names_any_offered_tool() {
        let tools = vec![tool("a", json!({})), tool("b", json!({}))];
        let ok = |_: &Value| Ok(());
        assert!(auto_call_grammar(&[], &ok).is_none());
        let g = auto_call_grammar(&tools, &ok).unwrap();
        assert!(
            g.lark
                .starts_with("start: blank? \"{\\\"name\\\": \\\"\" (rest_0 | rest_1)\n"),
            "{}",
            g.lark
        );
        assert!(
            g.lark.contains("rest_1: \"b\\\", \\\"arguments\\\": \""),
            "{}",
            g.lark
        );
    }

    #[test]
    fn a_schema_that_does_not_compile_falls_back_to_any_object() {
        let tools = vec![
            tool(
                "a",
                json!({"type": "object", "properties": {"x": {"not": {}}}}),
            ),
            tool("b", json!({"type": "string"})),
            tool("c", json!({"type": "object"})),
        ];
        let compiles = |s: &Value| {
            if s.to_string().contains("\"not\"") {
                Err("Unimplemented keys: [\"not\"]".to_string())
            } else {
                Ok(())
            }
        };
        let g = forced_call_grammar(&tools, &ToolChoice::Required, &compiles).unwrap();
        let names: Vec<&str> = g.fallbacks.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert!(g.fallbacks[0].1.contains("not"));
        assert!(!g.lark.contains("\"not\""), "{}", g.lark);
    }
}
