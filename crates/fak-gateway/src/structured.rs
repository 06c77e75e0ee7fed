//! Structured outputs: the grammar ([`GrammarSpec`]) each wire's format field asks for,
//! and the one check that the engine serving the request can enforce it.
//!
//! - Chat Completions `response_format` (SDK: `ResponseFormatJSONObject` /
//!   `ResponseFormatJSONSchema`; the schema under `json_schema.schema`).
//! - Responses `text.format` (SDK: `ResponseFormatTextJSONSchemaConfigParam` /
//!   `ResponseFormatJSONObjectParam`; the schema beside `type`).
//! - Anthropic `output_config.format` (SDK: `OutputConfigParam.format`,
//!   `JSONOutputFormatParam`, what `messages.parse(output_format=Model)` sends) and the
//!   beta's top-level `output_format` (`anthropic-beta: structured-outputs-2025-11-13`),
//!   both `{"type": "json_schema", "schema": {...}}`.
//!
//! `strict` is not read by the in-kernel engine: it enforces a schema either way. The
//! schema's keywords are llguidance's to accept or refuse (a 400 naming the keyword,
//! from the engine, before any token is generated). A format's `name`, `description`
//! and `strict` ride along in the [`GrammarSpec`] as the client gave them, for an
//! upstream driver, which forwards JSON mode and schemas to its server and checks the
//! reply (see the `fak-upstream` crate); a Lark `grammar` has no portable upstream
//! form and is a 400 there ([`fak_engine::EngineDriver::accepts_grammar`]).

use crate::error::{ApiError, Flavor};
use crate::AppState;
use fak_engine::GrammarSpec;
use serde_json::{Map, Value};

/// A reply's `fak` field with `finish_detail` ([`crate::tools::finish_detail`]) and, at
/// a grammar's dead end, `grammar_error`: why the grammar allowed no next token
/// ([`fak_engine::Done::dead_end`], llguidance's message), so a client can tell a format
/// it cannot be given from a token limit.
pub(crate) fn dead_end_detail(fak: Option<Value>, done: &fak_engine::Done) -> Option<Value> {
    let mut fak = crate::tools::finish_detail(fak, done.finish_reason);
    if let (Some(v), Some(why)) = (fak.as_mut(), done.dead_end.as_deref()) {
        v["grammar_error"] = Value::from(why);
    }
    fak
}

/// `spec`, asked for by the request field `field`, when the engine serving `model` can
/// enforce it (`None` passes through).
///
/// # Errors
/// A 400 naming `field` and why when the engine can neither constrain its output to
/// `spec` nor forward it ([`fak_engine::EngineDriver::accepts_grammar`]): a reply that
/// silently ignored the format would look like an answer to the request and not be one.
pub(crate) fn enforced(
    s: &AppState,
    model: &str,
    field: &str,
    spec: Option<GrammarSpec>,
    flavor: Flavor,
) -> Result<Option<GrammarSpec>, ApiError> {
    if let Some(g) = &spec {
        if let Err(why) = s.driver.accepts_grammar(Some(model), g) {
            return Err(ApiError::bad_request(format!(
                "`{field}` other than plain text is not supported by this engine: {why}"
            ))
            .with_flavor(flavor));
        }
    }
    Ok(spec)
}

/// The grammar of a JSON Schema given as an object, with no name (Anthropic's
/// `JSONOutputFormatParam` has none).
pub(crate) fn schema(m: Map<String, Value>) -> GrammarSpec {
    GrammarSpec::json_schema(Value::Object(m))
}

/// The grammar of a Chat Completions `response_format.json_schema` (SDK:
/// `ResponseFormatJSONSchema.JSONSchema`): its `schema` (any JSON value when absent),
/// with its `name`, `description` and `strict`.
pub(crate) fn chat_schema(f: fak_wire::openai::JsonSchemaFormat) -> GrammarSpec {
    GrammarSpec::JsonSchema {
        schema: Value::Object(f.schema.unwrap_or_default()),
        name: Some(f.name),
        description: f.description,
        strict: f.strict,
    }
}

/// The grammar of a Responses request's `text.format` (`None`: plain text).
pub(crate) fn text_format(f: Option<&fak_wire::responses::TextFormat>) -> Option<GrammarSpec> {
    use fak_wire::responses::TextFormat;
    match f? {
        TextFormat::Text => None,
        TextFormat::JsonObject => Some(GrammarSpec::JsonObject),
        TextFormat::JsonSchema(j) => Some(GrammarSpec::JsonSchema {
            schema: Value::Object(j.schema.clone()),
            name: Some(j.name.clone()),
            description: j.description.clone(),
            strict: j.strict,
        }),
    }
}

/// The grammar of a Chat Completions or Completions request: its own `grammar` field
/// (llguidance's Lark syntax) or `format`, the grammar its `response_format` asked for
/// (already checked by [`enforced`]); at most one of them.
///
/// # Errors
/// A 400 when both are given, when `grammar` is empty or is GBNF (llama.cpp's syntax,
/// `name ::= ...` rules: llguidance's Rust library does not convert it; its Python
/// tools' `gbnf_to_lark` does), or when the engine cannot constrain its output. A Lark
/// grammar that does not compile is the engine's 400, naming the error.
pub(crate) fn with_grammar(
    s: &AppState,
    model: &str,
    grammar: Option<String>,
    format: Option<GrammarSpec>,
    flavor: Flavor,
) -> Result<Option<GrammarSpec>, ApiError> {
    let Some(text) = grammar else {
        return Ok(format);
    };
    let bad = |m: &str| Err(ApiError::bad_request(m.to_string()).with_flavor(flavor));
    if format.is_some() {
        return bad("give `grammar` or a `response_format` other than `text`, not both");
    }
    if text.trim().is_empty() {
        return bad("`grammar` is empty");
    }
    if is_gbnf(&text) {
        return bad(
            "`grammar` is GBNF (`name ::= ...` rules): only llguidance's Lark syntax is taken \
             (`start: ...`, rules `name: ...`, tokens `NAME: ...`)",
        );
    }
    enforced(s, model, "grammar", Some(GrammarSpec::Lark(text)), flavor)
}

/// Whether `text` has a GBNF rule: a line `name ::= ...` (Lark writes `name: ...`).
fn is_gbnf(text: &str) -> bool {
    text.lines().any(|l| {
        l.split_once("::=").is_some_and(|(name, _)| {
            let name = name.trim();
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        })
    })
}

#[cfg(test)]
mod tests {
    use super::is_gbnf;

    /// llama.cpp's own example grammar (`grammars/json.gbnf`'s first rule) is GBNF; a
    /// Lark grammar, even one whose string literal holds `::=`, is not.
    #[test]
    fn gbnf_is_told_from_lark() {
        assert!(is_gbnf("root   ::= object\nvalue  ::= object | array"));
        assert!(is_gbnf("# c\nroot-rule ::= \"a\""));
        assert!(!is_gbnf("start: \"yes\" | \"no\""));
        assert!(!is_gbnf("start: x\nx: \"a ::= b\""));
    }
}
