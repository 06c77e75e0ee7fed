//! Model aliases (`fak serve --alias NAME=MODEL`, repeatable): a client's own model ids
//! (`claude-sonnet-4-5`, `gpt-4o`) served by a model this server has.
//!
//! An [`Alias`] is written `NAME=MODEL`. NAME is a model id, or a pattern where `*`
//! stands for any run of characters (none included): `claude-*` matches every id that
//! starts with `claude-`. No other character is special (model ids hold no `?` or `[`
//! in practice, and a plain matcher over `*` is all this needs; a glob crate's classes
//! and alternations would only add ways to write a surprising pattern).
//!
//! [`AliasedDriver`] wraps a driver. A request's `model`:
//! - that the inner driver serves is served as it is (an alias never shadows a model);
//! - else that the first matching alias (in the order given) names is served by its
//!   MODEL: the request reaches the inner driver with `model` = MODEL. A forwarded
//!   Anthropic body ([`crate::RawRequest`]) gets its top-level `model` value replaced
//!   by MODEL at its byte span (every other byte stays the client's), so the upstream
//!   is asked for a model it serves;
//! - else it is the inner driver's [`EngineError::UnknownModel`].
//!
//! The gateway answers with the id the client asked for (responses' `model` field is
//! the request's), as OpenAI-compatible proxies (LiteLLM's `model_alias_map`, vLLM's
//! `--served-model-name`) do: a client that checks the echoed id sees its own.
//! `models()` lists the inner driver's models, then each alias without `*` whose MODEL
//! is served (described as its MODEL: context length, owner); a pattern is not listed,
//! it names no one id. [`EngineDriver::resolve_model`] tells the gateway what an id is
//! served as (`GET /v1/models/{id}` finds `claude-opus-4` through `claude-*`); an id
//! holding `*` (a pattern's own text) is no model. At start, [`AliasedDriver::check`]
//! refuses a name given twice and a MODEL that is not served; a request whose alias's
//! MODEL is not served (any more) is the 404 of the id the client sent.

use crate::{
    EngineDriver, EngineError, EngineStats, EventStream, GenerateRequest, ModelInfo, Readiness,
    Revocation, RevokeReport,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::sync::Arc;

/// One `--alias NAME=MODEL`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alias {
    /// The id (or `*` pattern) clients send.
    pub name: String,
    /// The served model that answers it.
    pub target: String,
}

impl Alias {
    /// Parses `NAME=MODEL`.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] naming what is wrong: no `=`, an empty name or
    /// model, whitespace in either, a `*` in the model.
    pub fn parse(s: &str) -> Result<Alias, EngineError> {
        let bad = |why: &str| EngineError::InvalidRequest(format!("alias '{s}': {why}"));
        let (name, target) = s
            .split_once('=')
            .ok_or_else(|| bad("write it NAME=MODEL, e.g. 'claude-*=smollm2-135m-instruct'"))?;
        let (name, target) = (name.trim(), target.trim());
        for (what, v) in [("name", name), ("model", target)] {
            if v.is_empty() || v.chars().any(char::is_whitespace) {
                return Err(bad(&format!(
                    "the {what} must be non-empty and hold no whitespace"
                )));
            }
        }
        if target.contains('*') {
            return Err(bad("the model must be one served model id, not a pattern"));
        }
        Ok(Alias {
            name: name.into(),
            target: target.into(),
        })
    }

    /// Whether the name is a pattern (holds `*`).
    pub fn is_pattern(&self) -> bool {
        self.name.contains('*')
    }

    /// Whether `id` is this alias's name, or matches its pattern.
    pub fn matches(&self, id: &str) -> bool {
        star_match(&self.name, id)
    }
}

/// Whether `text` matches `pattern`, where `*` is any run of characters and every
/// other character is itself.
fn star_match(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        // No `*`: the whole text must be the pattern.
        return rest.is_empty();
    };
    for p in middle {
        match rest.find(p) {
            Some(at) => rest = &rest[at + p.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// A driver whose models are also served under aliases (see the module docs).
pub struct AliasedDriver {
    inner: Arc<dyn EngineDriver>,
    aliases: Vec<Alias>,
}

impl AliasedDriver {
    /// `inner` with `aliases` (tried in order).
    pub fn new(inner: Arc<dyn EngineDriver>, aliases: Vec<Alias>) -> Self {
        AliasedDriver { inner, aliases }
    }

    /// The aliases, in order.
    pub fn aliases(&self) -> &[Alias] {
        &self.aliases
    }

    /// Checks `aliases` against the models a driver serves, before serving them: each
    /// name given once, and each MODEL one of `served`'s ids. An empty `served` (an
    /// upstream that has not listed its models yet, or fronts any model) checks the
    /// names only: the upstream answers for the model when a request names it.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] naming the alias: a name given twice, or a MODEL
    /// that is not served (with the served ids).
    pub fn check(aliases: &[Alias], served: &[ModelInfo]) -> Result<(), EngineError> {
        for (i, a) in aliases.iter().enumerate() {
            if let Some(b) = aliases[..i].iter().find(|b| b.name == a.name) {
                return Err(EngineError::InvalidRequest(format!(
                    "alias '{}={}': the name '{}' is already an alias (of '{}'); give each name once",
                    a.name, a.target, a.name, b.target
                )));
            }
            if !served.is_empty() && !served.iter().any(|m| m.id == a.target) {
                return Err(EngineError::InvalidRequest(format!(
                    "alias '{}={}': model '{}' is not served here (served: {})",
                    a.name,
                    a.target,
                    a.target,
                    served
                        .iter()
                        .map(|m| m.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        Ok(())
    }

    /// An [`EngineError::UnknownModel`] restated as the client sees the server: about
    /// `id`, the model the client asked for, when it was about `target` (an alias's
    /// MODEL the inner driver no longer serves), and listing what `models()` lists (the
    /// aliases too, as `GET /v1/models/{id}`'s 404 does), not only the inner driver's
    /// models. Any other error is returned as it is.
    fn as_asked(&self, e: EngineError, id: &str, target: Option<&str>) -> EngineError {
        match e {
            EngineError::UnknownModel { requested, .. } => EngineError::UnknownModel {
                requested: if Some(requested.as_str()) == target {
                    id.to_string()
                } else {
                    requested
                },
                available: self.models().into_iter().map(|m| m.id).collect(),
            },
            e => e,
        }
    }
}

/// The top-level `model` of a request body, borrowed as its raw JSON text.
#[derive(Deserialize)]
struct ModelField<'a> {
    #[serde(borrow)]
    model: &'a RawValue,
}

/// `body` with its top-level `model` value replaced by `model` (a JSON string), every
/// other byte unchanged.
///
/// # Errors
/// A message when the body is not UTF-8 JSON with one top-level `model`.
fn replace_model(body: &[u8], model: &str) -> Result<Vec<u8>, String> {
    let text = std::str::from_utf8(body).map_err(|e| format!("the body is not UTF-8: {e}"))?;
    let f: ModelField<'_> =
        serde_json::from_str(text).map_err(|e| format!("reading the body's model: {e}"))?;
    let raw = f.model.get();
    let at = (raw.as_ptr() as usize)
        .checked_sub(text.as_ptr() as usize)
        .filter(|&at| text.get(at..at + raw.len()) == Some(raw))
        .ok_or("the model's span lies outside the body")?;
    let value = serde_json::to_string(model).map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(body.len() + value.len());
    out.extend_from_slice(&body[..at]);
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(&body[at + raw.len()..]);
    Ok(out)
}

impl EngineDriver for AliasedDriver {
    fn id(&self) -> &'static str {
        self.inner.id()
    }

    fn models(&self) -> Vec<ModelInfo> {
        let mut models = self.inner.models();
        for a in self.aliases.iter().filter(|a| !a.is_pattern()) {
            if models.iter().any(|m| m.id == a.name) {
                continue;
            }
            if let Some(t) = models.iter().find(|m| m.id == a.target) {
                let listed = ModelInfo {
                    id: a.name.clone(),
                    ..t.clone()
                };
                models.push(listed);
            }
        }
        models
    }

    fn readiness(&self) -> Readiness {
        self.inner.readiness()
    }

    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        crate::single(self.submit_n(req, 1)?)
    }

    /// The inner driver's `submit_n`, the model resolved as for `submit`.
    fn submit_n(
        &self,
        mut req: GenerateRequest,
        n: usize,
    ) -> Result<Vec<EventStream>, EngineError> {
        let inner = |req: GenerateRequest| {
            if n == 1 {
                self.inner.submit(req).map(|s| vec![s])
            } else {
                self.inner.submit_n(req, n)
            }
        };
        let Some(asked) = req.model.clone() else {
            return inner(req);
        };
        let Some(target) = self.resolve_model(&asked) else {
            return inner(req).map_err(|e| self.as_asked(e, &asked, None));
        };
        if let Some(raw) = &mut req.raw {
            raw.body = replace_model(&raw.body, &target)
                .map_err(|e| {
                    EngineError::InvalidRequest(format!("aliasing the request's model: {e}"))
                })?
                .into();
        }
        req.model = Some(target.clone());
        inner(req).map_err(|e| self.as_asked(e, &asked, Some(&target)))
    }

    fn stats(&self) -> EngineStats {
        self.inner.stats()
    }

    fn revoke(&self, r: &Revocation) -> RevokeReport {
        self.inner.revoke(r)
    }

    fn drain(&self) {
        self.inner.drain();
    }

    fn persist_kv(&self, wait: std::time::Duration) -> Option<crate::persist::PersistReport> {
        self.inner.persist_kv(wait)
    }

    fn cancel_all(&self) {
        self.inner.cancel_all();
    }

    fn count_tokens(&self, req: &GenerateRequest) -> Result<usize, EngineError> {
        match req.model.as_deref().and_then(|m| self.resolve_model(m)) {
            Some(target) => self
                .inner
                .count_tokens(&GenerateRequest {
                    model: Some(target.clone()),
                    ..req.clone()
                })
                .map_err(|e| self.as_asked(e, req.model.as_deref().unwrap_or(""), Some(&target))),
            None => self
                .inner
                .count_tokens(req)
                .map_err(|e| self.as_asked(e, req.model.as_deref().unwrap_or(""), None)),
        }
    }

    fn forwards_client_body(&self, model: Option<&str>) -> bool {
        let target = model.and_then(|m| self.resolve_model(m));
        self.inner.forwards_client_body(target.as_deref().or(model))
    }

    fn constrains_output(&self, model: Option<&str>) -> bool {
        let target = model.and_then(|m| self.resolve_model(m));
        self.inner.constrains_output(target.as_deref().or(model))
    }

    fn accepts_grammar(
        &self,
        model: Option<&str>,
        spec: &crate::GrammarSpec,
    ) -> Result<(), String> {
        let target = model.and_then(|m| self.resolve_model(m));
        self.inner
            .accepts_grammar(target.as_deref().or(model), spec)
    }

    fn resolve_model(&self, id: &str) -> Option<String> {
        // A `*` in an id is a pattern's text (`claude-*` itself), not a model a client
        // names: it resolves to nothing, so `GET /v1/models/claude-*` is a 404.
        if id.contains('*') || self.inner.models().iter().any(|m| m.id == id) {
            return None;
        }
        self.aliases
            .iter()
            .find(|a| a.matches(id))
            .map(|a| a.target.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::MockDriver;
    use crate::{Message, RawRequest};
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn aliases_parse_with_clear_errors() {
        assert_eq!(
            Alias::parse("claude-*=mock").unwrap(),
            Alias {
                name: "claude-*".into(),
                target: "mock".into()
            }
        );
        for bad in ["claude", "=mock", "a=", "a b=mock", "a=b*", "a= "] {
            let e = Alias::parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{bad:?}: {e}");
        }
    }

    #[test]
    fn star_matches_any_run() {
        let m = |p: &str, t: &str| star_match(p, t);
        assert!(m("claude-*", "claude-sonnet-4-5"));
        assert!(m("claude-*", "claude-"));
        assert!(!m("claude-*", "claude"));
        assert!(!m("claude-*", "xclaude-3"));
        assert!(m("*", ""));
        assert!(m("gpt-4o", "gpt-4o"));
        assert!(!m("gpt-4o", "gpt-4o-mini"));
        assert!(m("*-mini", "gpt-4o-mini"));
        assert!(m("a*b*c", "abc"));
        assert!(m("a*b*c", "a-b-b-c"));
        assert!(!m("a*b*c", "a-c-b"));
        // The suffix may not reuse characters the prefix took.
        assert!(!m("ab*ba", "aba"));
        // `?` and `[` are themselves.
        assert!(m("a?[1]*", "a?[1]x"));
        assert!(!m("a?*", "ab"));
    }

    fn chat(model: &str) -> GenerateRequest {
        GenerateRequest {
            model: Some(model.into()),
            ..GenerateRequest::chat(vec![Message::new("user", "echo hi")])
        }
    }

    #[test]
    fn an_alias_is_served_by_its_target_and_a_model_wins() {
        let d = AliasedDriver::new(
            Arc::new(MockDriver::new()),
            vec![
                Alias::parse("claude-*=mock").unwrap(),
                Alias::parse("gpt-4o=mock").unwrap(),
                Alias::parse("mock=elsewhere").unwrap(),
                Alias::parse("dangling=nowhere").unwrap(),
            ],
        );
        let ids: Vec<String> = d.models().into_iter().map(|m| m.id).collect();
        // Patterns and aliases of unserved models are not listed.
        assert_eq!(ids, ["mock", "gpt-4o"]);
        assert_eq!(d.models()[1].context_length, crate::mock::MOCK_CONTEXT);
        assert_eq!(d.resolve_model("claude-opus-4-1").as_deref(), Some("mock"));
        assert_eq!(d.resolve_model("mock"), None);
        assert_eq!(d.resolve_model("llama"), None);
        // The pattern's own text is no model (before: it matched itself).
        assert_eq!(d.resolve_model("claude-*"), None);
        assert_eq!(d.resolve_model("claude-x*"), None);
        for id in ["claude-opus-4-1", "gpt-4o", "mock"] {
            let text = d.submit(chat(id)).unwrap().blocking_collect().unwrap().text;
            assert_eq!(text, "hi", "{id}");
        }
        // An alias whose model is not (or no longer) served: the 404 names the id the
        // client sent (before: the alias's MODEL, an id the client never used).
        match d.submit(chat("dangling")) {
            Err(EngineError::UnknownModel { requested, .. }) => assert_eq!(requested, "dangling"),
            other => panic!("{:?}", other.err()),
        }
        match d.count_tokens(&chat("dangling")) {
            Err(EngineError::UnknownModel { requested, .. }) => assert_eq!(requested, "dangling"),
            other => panic!("{other:?}"),
        }
        // An unknown id: the error lists what the server lists, aliases included.
        match d.submit(chat("llama")) {
            Err(EngineError::UnknownModel {
                requested,
                available,
            }) => {
                assert_eq!(requested, "llama");
                assert_eq!(available, ["mock", "gpt-4o"]);
            }
            other => panic!("{:?}", other.err()),
        }
        match d.count_tokens(&chat("llama")) {
            Err(EngineError::UnknownModel { available, .. }) => {
                assert_eq!(available, ["mock", "gpt-4o"])
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_duplicate_name_or_an_unserved_model_is_an_error_naming_the_alias() {
        let served = MockDriver::new().models();
        let ok = |v: &[&str]| {
            let a: Vec<Alias> = v.iter().map(|s| Alias::parse(s).unwrap()).collect();
            AliasedDriver::check(&a, &served)
        };
        assert!(ok(&["claude-*=mock", "gpt-4o=mock"]).is_ok());
        let e = ok(&["claude-*=mock", "gpt-4o=nowhere"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'gpt-4o=nowhere'") && e.contains("not served") && e.contains("mock"),
            "{e}"
        );
        let e = ok(&["gpt-4o=mock", "claude-*=mock", "gpt-4o=mock"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("'gpt-4o=mock'") && e.contains("already"), "{e}");
        // A driver that lists no models yet (an upstream): names are still checked.
        let a = [Alias::parse("x=anything").unwrap()];
        assert!(AliasedDriver::check(&a, &[]).is_ok());
        let a = [a[0].clone(), a[0].clone()];
        assert!(AliasedDriver::check(&a, &[]).is_err());
    }

    #[test]
    fn counting_draining_and_cancelling_reach_the_served_driver() {
        // Before: the trait's defaults answered for the wrapper — count_tokens said the
        // engine cannot count, and shutdown's drain / cancel_all did nothing.
        struct Inner {
            mock: MockDriver,
            drained: AtomicUsize,
            cancelled: AtomicUsize,
        }
        impl EngineDriver for Inner {
            fn id(&self) -> &'static str {
                "inner"
            }
            fn models(&self) -> Vec<ModelInfo> {
                self.mock.models()
            }
            fn readiness(&self) -> Readiness {
                Readiness::Ready
            }
            fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
                self.mock.submit(req)
            }
            fn drain(&self) {
                self.drained.fetch_add(1, Ordering::SeqCst);
            }
            fn cancel_all(&self) {
                self.cancelled.fetch_add(1, Ordering::SeqCst);
            }
            fn count_tokens(&self, req: &GenerateRequest) -> Result<usize, EngineError> {
                self.mock.count_tokens(req)
            }
        }
        let inner = Arc::new(Inner {
            mock: MockDriver::new(),
            drained: AtomicUsize::new(0),
            cancelled: AtomicUsize::new(0),
        });
        let d = AliasedDriver::new(inner.clone(), vec![Alias::parse("claude-*=mock").unwrap()]);
        let want = inner.mock.count_tokens(&chat("mock")).unwrap();
        assert!(want > 0);
        assert_eq!(d.count_tokens(&chat("mock")).unwrap(), want);
        assert_eq!(d.count_tokens(&chat("claude-x")).unwrap(), want);
        assert!(matches!(
            d.count_tokens(&chat("llama")),
            Err(EngineError::UnknownModel { .. })
        ));
        d.drain();
        d.cancel_all();
        assert_eq!(inner.drained.load(Ordering::SeqCst), 1);
        assert_eq!(inner.cancelled.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_forwarded_body_gets_the_target_model_and_nothing_else_changes() {
        let body = br#"{ "max_tokens" :5,"model" : "claude-x\u0031","messages":[{"role":"user","content":"model"}]}"#;
        let out = replace_model(body, "smollm2").unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{ "max_tokens" :5,"model" : "smollm2","messages":[{"role":"user","content":"model"}]}"#
        );
        assert!(replace_model(br#"{"model":"a","model":"b"}"#, "x").is_err());
        assert!(replace_model(br#"{"messages":[]}"#, "x").is_err());
        // Through the driver: the inner driver sees the target in the body.
        let mut req = chat("claude-x");
        req.raw = Some(RawRequest {
            body: body.to_vec().into(),
            headers: Vec::new(),
            stream: false,
        });
        struct Spy(std::sync::Mutex<Option<GenerateRequest>>);
        impl EngineDriver for Spy {
            fn id(&self) -> &'static str {
                "spy"
            }
            fn models(&self) -> Vec<ModelInfo> {
                vec![ModelInfo {
                    id: "smollm2".into(),
                    context_length: 1,
                    owned_by: "spy".into(),
                }]
            }
            fn readiness(&self) -> Readiness {
                Readiness::Ready
            }
            fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
                *self.0.lock().unwrap() = Some(req);
                Err(EngineError::NotReady("spy".into()))
            }
        }
        let spy = Arc::new(Spy(std::sync::Mutex::new(None)));
        let d = AliasedDriver::new(
            Arc::clone(&spy) as Arc<dyn EngineDriver>,
            vec![Alias::parse("claude-*=smollm2").unwrap()],
        );
        let _ = d.submit(req);
        let seen = spy.0.lock().unwrap().take().unwrap();
        assert_eq!(seen.model.as_deref(), Some("smollm2"));
        assert!(std::str::from_utf8(&seen.raw.unwrap().body)
            .unwrap()
            .contains(r#""model" : "smollm2""#));
    }
}
