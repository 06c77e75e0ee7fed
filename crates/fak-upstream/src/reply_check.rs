//! Checking an upstream's reply against the structured output the request asked for.
//!
//! The upstream is sent the request's format (OpenAI `response_format`, Anthropic
//! `output_config.format`) and is trusted to enforce it no more than any other reply:
//! fak checks what comes back. A reply whose text is not JSON, or not a JSON object
//! in JSON mode, or not valid for the request's JSON Schema, ends with an
//! [`EngineError::Upstream`] naming the first failure instead of its `Done`: the
//! gateway answers a non-streamed request with a 502 in its wire's error shape, and
//! ends a stream, whose text has already gone out, with its wire's error event in
//! place of the normal finish.
//!
//! Not checked: a reply cut short (`Done` with [`FinishReason::Length`], which the
//! client sees as `length` / `max_tokens` / `incomplete`: the text is incomplete by
//! design, not wrong), and a reply that is a tool call (a format constrains the
//! message's text, and a call has none).
//!
//! Schemas are read by the [`jsonschema`] crate (drafts 4 to 2020-12, `format`
//! keywords not asserted: its defaults), the one already used to check tool-call
//! arguments against their tools' schemas; one it cannot read is refused before the
//! request is sent.

use fak_engine::{EngineError, EngineEvent, EventSink, EventStream, FinishReason, GrammarSpec};
use serde_json::Value;

/// What the reply's text must be.
pub(crate) enum ReplyCheck {
    /// A JSON object (JSON mode).
    Object,
    /// A JSON value valid for this schema.
    Schema(Box<jsonschema::Validator>),
}

impl ReplyCheck {
    /// The check of `spec`'s replies; `None` for a Lark grammar (never forwarded).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] naming the cause when `spec`'s schema cannot be
    /// read as a JSON Schema.
    pub(crate) fn new(spec: &GrammarSpec) -> Result<Option<Self>, EngineError> {
        match spec {
            GrammarSpec::JsonObject => Ok(Some(ReplyCheck::Object)),
            GrammarSpec::JsonSchema { schema, .. } => jsonschema::validator_for(schema)
                .map(|v| Some(ReplyCheck::Schema(Box::new(v))))
                .map_err(|e| {
                    EngineError::InvalidRequest(format!(
                        "the response format's schema cannot be read as a JSON Schema: {e}"
                    ))
                }),
            GrammarSpec::Lark(_) => Ok(None),
        }
    }

    /// Why `text`, a whole reply, fails the check (`None`: it passes).
    pub(crate) fn failure(&self, text: &str) -> Option<String> {
        let value: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => return Some(format!("the reply is not JSON ({e})")),
        };
        match self {
            ReplyCheck::Object if value.is_object() => None,
            ReplyCheck::Object => Some(format!(
                "the reply is not a JSON object but {}",
                kind(&value)
            )),
            ReplyCheck::Schema(v) => fak_engine::schema::first_schema_error(
                v,
                &value,
                "the reply does not match the schema",
            ),
        }
    }
}

/// The JSON type of `v`, as a sentence names it.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Relays `from`'s events to `to`, checking the reply's text when it is done (see the
/// module docs). Ends when `from` ends or `to`'s stream is dropped (which drops `from`,
/// cancelling the upstream request). The text kept for the check is bounded by
/// `max_bytes`; a longer reply fails the check.
pub(crate) async fn relay(
    mut from: EventStream,
    to: EventSink,
    check: ReplyCheck,
    max_bytes: usize,
) {
    let mut text = String::new();
    let mut over = false;
    let mut called = false;
    loop {
        let e = tokio::select! {
            () = to.closed() => return,
            e = from.next() => e,
        };
        let Some(e) = e else {
            return;
        };
        let e = match e {
            EngineEvent::Text(t) => {
                if text.len() + t.len() > max_bytes {
                    over = true;
                } else {
                    text.push_str(&t);
                }
                EngineEvent::Text(t)
            }
            EngineEvent::ToolCall(c) => {
                called = true;
                EngineEvent::ToolCall(c)
            }
            EngineEvent::Done(d) if d.finish_reason != FinishReason::Length && !called => {
                let failure = if over {
                    Some(format!("the reply is longer than {max_bytes} bytes"))
                } else {
                    check.failure(&text)
                };
                match failure {
                    Some(why) => EngineEvent::Error(EngineError::Upstream(format!(
                        "the upstream's reply does not follow the requested response format: {why}"
                    ))),
                    None => EngineEvent::Done(d),
                }
            }
            e => e,
        };
        if !to.send(e) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema_check() -> ReplyCheck {
        ReplyCheck::new(&GrammarSpec::json_schema(json!({
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        })))
        .unwrap()
        .unwrap()
    }

    /// A valid reply passes; each kind of failure is named, the schema's with the
    /// path of the first failing value.
    #[test]
    fn failures_name_the_first_problem() {
        let c = schema_check();
        assert_eq!(c.failure(r#"{"name": "Ann", "age": 3}"#), None);
        let m = c.failure(r#"{"name": "Ann", "age": "three"}"#).unwrap();
        assert!(m.contains("at /age") && m.contains("integer"), "{m}");
        let m = c.failure(r#"{"name": "Ann"}"#).unwrap();
        assert!(m.contains("\"age\" is a required property"), "{m}");
        let m = c.failure(r#"{"name": "Ann", "#).unwrap();
        assert!(m.starts_with("the reply is not JSON"), "{m}");
        let o = ReplyCheck::new(&GrammarSpec::JsonObject).unwrap().unwrap();
        assert_eq!(o.failure(" {} "), None);
        assert_eq!(
            o.failure("[1]").as_deref(),
            Some("the reply is not a JSON object but an array")
        );
    }

    /// A schema the checker cannot read is the request's error, before anything is
    /// sent; a Lark grammar has no check (it is never forwarded).
    #[test]
    fn an_unreadable_schema_is_a_bad_request() {
        let e = ReplyCheck::new(&GrammarSpec::json_schema(json!({"type": 5})))
            .err()
            .unwrap();
        assert!(matches!(e, EngineError::InvalidRequest(_)), "{e}");
        assert!(ReplyCheck::new(&GrammarSpec::Lark("start: \"a\"".into()))
            .unwrap()
            .is_none());
    }
}
