//! Constrained decoding: a grammar's allowed-token set masks each step's logits.
//!
//! The engine is [llguidance](https://github.com/guidance-ai/llguidance) (MIT; the
//! constrained-decoding library behind llama.cpp's and mistral.rs's structured outputs):
//! it compiles a JSON Schema or a Lark grammar to an Earley parser over a lexer, and
//! walks a token trie of the served vocabulary to find, at each step, which tokens the
//! grammar can still accept.
//!
//! - [`GrammarCompiler`] holds the token trie, built once per tokenizer from each
//!   token's raw bytes ([`Tokenizer::token_bytes`]; a control token is marked with a
//!   leading `0xFF` byte, which no UTF-8 text contains, so a grammar's text never
//!   produces one). Lark's special-token syntax (`<|im_end|>`, `<[id]>`) could name one
//!   directly, so the mask also removes every control token except the caller's stop
//!   ids where the grammar can end: a grammar that needs a control token mid-reply is a
//!   dead end there, never a role marker written into the reply.
//! - A grammar or schema is at most [`GRAMMAR_MAX_BYTES`] and compiles on a thread of
//!   its own with a [`COMPILE_STACK_BYTES`] stack: llguidance's compiler recurses along
//!   chains of `$ref`s and Lark rules (a chain of ~1,000 overflowed a 2 MiB stack, which
//!   aborts the process), and the size cap bounds the chain.
//! - [`GrammarCompiler::compile`] turns a request's [`GrammarSpec`] into a [`Grammar`],
//!   or a [`GrammarError`] naming what did not compile (an unsupported schema keyword,
//!   a Lark syntax error, a grammar past [`compile_limits`]), before any token is
//!   generated. It takes the calling thread's time: the caller bounds how many compile
//!   at once (the in-kernel engine compiles in its worker slots).
//! - [`Grammar::start`] gives a [`Constraint`], the per-reply state: [`Constraint::allowed`]
//!   is the step's allowed set, [`Constraint::accept`] advances it by the chosen token.
//! - [`mask_logits`] copies a step's logits with every disallowed row set to `-inf`
//!   (no probability under any sampling setting) and every allowed row's bits unchanged;
//!   the KV cache never sees the mask (it masks the logits a step produced, after the
//!   step wrote its K/V rows).
//!
//! A **lazy** grammar ([`Grammar::lazy`]) constrains nothing until the generated text
//! reaches its trigger (e.g. a tool call's opening tag): the steps before are exactly
//! unconstrained (no mask is computed or applied), and from the trigger on each step is
//! masked as above, the grammar taking the text after the trigger, as llama.cpp's lazy
//! grammars do ([`crate::text`] runs it).
//!
//! Stopping: when the grammar can end (its start symbol is complete), the caller's stop
//! ids (EOS, end of turn) are allowed, and choosing one ends the reply as it does
//! unconstrained. A grammar with no allowed token at its first step, or one whose forced
//! text has no end, does not compile ([`GrammarError::Empty`]); a later step with no allowed token is a [`DeadEnd`]: the
//! reply ends there (see [`crate::FinishReason::GrammarDeadEnd`], llguidance's message
//! in [`crate::TextOutput::dead_end`]), never a hang.

use fak_model::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{
    InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv,
};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use std::sync::Arc;

/// What a request constrains its reply to.
///
/// Sources: OpenAI Chat Completions `response_format` (`{"type": "json_object"}`,
/// `{"type": "json_schema", "json_schema": {"schema": ..., "strict": ...}}`; SDK type
/// `ResponseFormatJSONObject` / `ResponseFormatJSONSchema`) and llguidance's Lark
/// dialect for a user's own grammar.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI's JSON mode).
    JsonObject,
    /// A JSON value valid for a JSON Schema. An unsupported keyword is an error at
    /// compile time, not ignored.
    JsonSchema {
        /// The schema (a JSON object; drafts 4 to 2020-12 as llguidance reads them,
        /// local `$ref`s included).
        schema: serde_json::Value,
        /// The format's name as the request gave it (Chat Completions
        /// `json_schema.name`, Responses `text.format.name`; Anthropic's format has
        /// none). Not read by constrained decoding; an upstream is sent it.
        name: Option<String>,
        /// The format's `description`, as the request gave it (likewise).
        description: Option<String>,
        /// The format's `strict`, as the request gave it (likewise: the in-kernel
        /// engine enforces the schema either way).
        strict: Option<bool>,
    },
    /// A grammar in llguidance's Lark syntax (`start: ...`).
    Lark(String),
}

impl GrammarSpec {
    /// A [`GrammarSpec::JsonSchema`] of `schema` with no name, description or `strict`.
    pub fn json_schema(schema: serde_json::Value) -> Self {
        GrammarSpec::JsonSchema {
            schema,
            name: None,
            description: None,
            strict: None,
        }
    }
}

/// A grammar or a token trie that could not be built; the message names the cause as
/// llguidance reports it (e.g. `Unimplemented keys: ["not"]`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The request's grammar or schema does not compile.
    #[error("the grammar does not compile: {0}")]
    Compile(String),
    /// The grammar passed one of the [`compile_limits`] (its size in grammar symbols,
    /// its lexer's size; the message is llguidance's, naming the limit) or its text
    /// passed [`GRAMMAR_MAX_BYTES`].
    #[error("the grammar is too large to compile: {0}")]
    TooLarge(String),
    /// The token trie could not be built from the tokenizer.
    #[error("cannot build the token trie: {0}")]
    Trie(String),
    /// The grammar compiles but no reply can complete it from its first step: no token
    /// (and no end) is allowed there, or the text it forces from there has no end, as
    /// for a rule that recurses with no base case (Lark `start: a` / `a: "x" a`, a JSON
    /// schema whose object requires itself), where llguidance's forced-text walk stops
    /// at its item limit; or llguidance's per-step limits stop its first step (an
    /// object schema of ~2,000 optional properties). The message is llguidance's, or
    /// says which.
    #[error("the grammar accepts no output: its first step allows no token ({0})")]
    Empty(String),
}

/// Why a constrained reply cannot go on: no token is allowed at this step, or the
/// parser failed. The message is llguidance's, or says which.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadEnd(pub String);

/// The served vocabulary as llguidance needs it: the token trie plus a way to tokenize
/// text (used by llguidance to force whole tokens; our own tokenizer).
struct Vocab {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tokenizer
                .encode(text)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles request grammars against one model's vocabulary.
///
/// Build it once per loaded model ([`GrammarCompiler::new`]): its cost is the token
/// trie and llguidance's per-vocabulary slices (measured on SmolLM2-135M's 49,152
/// tokens in `tests/grammar_smollm2.rs`, printed by that test).
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// The control tokens' ids (ascending), never allowed but as stop ids.
    special: Arc<[u32]>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish()
    }
}

impl GrammarCompiler {
    /// The trie of `tokenizer`'s tokens over a vocabulary of `vocab_size` ids (the
    /// model's logits length, `[vocab]`; ids past the tokenizer's own vocabulary get
    /// no bytes and are never allowed). The tokenizer's EOS ids are the trie's EOS set.
    ///
    /// # Errors
    /// [`GrammarError::Trie`] for a tokenizer without an EOS id or larger than
    /// `vocab_size`, or if llguidance refuses the vocabulary.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize) -> Result<Self, GrammarError> {
        let eos = tokenizer.eos().to_vec();
        let Some(&first_eos) = eos.first() else {
            return Err(GrammarError::Trie("the tokenizer has no EOS id".into()));
        };
        if tokenizer.vocab_size() > vocab_size || eos.iter().any(|&e| e as usize >= vocab_size) {
            return Err(GrammarError::Trie(format!(
                "the tokenizer's {} tokens do not fit the model's vocabulary of {vocab_size}",
                tokenizer.vocab_size()
            )));
        }
        let n = u32::try_from(vocab_size)
            .map_err(|_| GrammarError::Trie(format!("vocabulary of {vocab_size} ids")))?;
        let words: Vec<Vec<u8>> = (0..n)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id);
                if tokenizer.is_special(id) {
                    let mut w = Vec::with_capacity(bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(bytes);
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(n, first_eos);
        info.tok_bos = tokenizer.bos();
        let built = llguidance::panic_utils::catch_unwind(|| {
            Ok(TokTrie::from(&info, &words).with_eos_tokens(&eos))
        });
        let trie = built.map_err(|e| GrammarError::Trie(e.to_string()))?;
        let env: TokEnv = Arc::new(Vocab {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| GrammarError::Trie(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = compile_limits();
        let special: Arc<[u32]> = (0..n).filter(|&id| tokenizer.is_special(id)).collect();
        Ok(GrammarCompiler { factory, special })
    }

    /// The vocabulary size the trie covers (`[vocab]`).
    pub fn vocab_size(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }

    /// Compiles `spec`. JSON is constrained to compact separators (`, ` and `: `) with
    /// no other whitespace between tokens, so a small model cannot loop on blank lines;
    /// an `x-guidance` key in a schema is replaced by these options. The grammar's size
    /// and the parser's work per step are bounded by [`compile_limits`].
    ///
    /// # Errors
    /// [`GrammarError::Compile`] naming the cause: a schema that is not a JSON object,
    /// an unsupported keyword, an unsatisfiable schema, a Lark syntax error;
    /// [`GrammarError::TooLarge`] naming the limit a grammar passed;
    /// [`GrammarError::Empty`] when no reply can complete the grammar from its first
    /// step (its language is empty).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar, GrammarError> {
        let bytes = match spec {
            GrammarSpec::JsonObject => 0,
            GrammarSpec::JsonSchema { schema, .. } => schema.to_string().len(),
            GrammarSpec::Lark(text) => text.len(),
        };
        if bytes > GRAMMAR_MAX_BYTES {
            return Err(GrammarError::TooLarge(format!(
                "the grammar is {bytes} bytes; at most {GRAMMAR_MAX_BYTES} are compiled"
            )));
        }
        let top = match spec {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(json_options(serde_json::Value::Object(
                    [("type".to_string(), serde_json::Value::from("object"))]
                        .into_iter()
                        .collect(),
                ))?)
            }
            GrammarSpec::JsonSchema { schema, .. } => {
                TopLevelGrammar::from_json_schema(json_options(schema.clone())?)
            }
            GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let factory = &self.factory;
        // On a thread with a deep stack (see the module docs); a panic inside
        // llguidance is caught there and is a compile error like any other.
        let compiled = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("fak-grammar".into())
                .stack_size(COMPILE_STACK_BYTES)
                .spawn_scoped(scope, || {
                    llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        factory.create_parser(top)
                    }))
                    .map(|parser| Matcher::new(Ok(parser)))
                })
                .map_err(|e| GrammarError::Compile(format!("cannot start the compiler: {e}")))?
                .join()
                .map_err(|_| GrammarError::Compile("the compiler panicked".into()))
        })?;
        let matcher = compiled.map_err(|e| compile_error(e.to_string()))?;
        if let Some(e) = matcher.get_error() {
            return Err(compile_error(e));
        }
        let grammar = Grammar {
            spec: spec.clone(),
            matcher,
            vocab_size: self.vocab_size(),
            special: Arc::clone(&self.special),
            trigger: None,
        };
        // A grammar with nothing to write at its first step (and no end there) would
        // give every reply an empty dead end: it is the request's error instead, before
        // any token is generated. One mask and one forced-bytes computation, on a fresh
        // constraint.
        if let Err(DeadEnd(why)) = grammar.start().check_start() {
            return Err(GrammarError::Empty(clip(why)));
        }
        Ok(grammar)
    }
}

/// The most symbols a compiled grammar may have (llguidance's
/// [`ParserLimits::max_grammar_size`](llguidance::api::ParserLimits), 500,000 by
/// default). llguidance checks it as it builds the grammar, so it also bounds the time
/// a hostile schema takes to be refused. Measured on SmolLM2-135M's vocabulary (one
/// core of a loaded 2-core machine): an object schema of 2,000 optional string
/// properties compiles in 0.8 s within it (its first step then passes llguidance's
/// per-step limits: [`GrammarError::Empty`]); one of 6,000 is refused after ~4 s (it compiled in
/// ~24 s with the default); the structured-output and tool-call schemas of
/// `scripts/structured-check` and the gateway's `tool_calls_check` example use a few
/// hundred symbols.
pub const GRAMMAR_MAX_SYMBOLS: usize = 20_000;

/// The [`llguidance::api::ParserLimits`] every [`GrammarCompiler`] compiles within:
/// llguidance's defaults (lexer fuel, lexer states, Earley items per step), with the
/// grammar's size held to [`GRAMMAR_MAX_SYMBOLS`].
pub fn compile_limits() -> llguidance::api::ParserLimits {
    llguidance::api::ParserLimits {
        max_grammar_size: GRAMMAR_MAX_SYMBOLS,
        ..llguidance::api::ParserLimits::default()
    }
}

/// llguidance's compile error `msg` (clipped) as a [`GrammarError`]: a limit passed
/// (llguidance's messages say "limit for this grammar", or name the lexer's fuel) is
/// [`GrammarError::TooLarge`], anything else [`GrammarError::Compile`].
fn compile_error(msg: String) -> GrammarError {
    let msg = clip(msg);
    if msg.contains("limit for this grammar") || msg.contains("limits.initial_lexer_fuel") {
        GrammarError::TooLarge(msg)
    } else {
        GrammarError::Compile(msg)
    }
}

/// The largest grammar or schema [`GrammarCompiler::compile`] takes, in bytes (a
/// schema as compact JSON text): 512 KiB, four times OpenAI's documented limit on a
/// structured-output schema's names, enum values and consts (120,000 characters).
pub const GRAMMAR_MAX_BYTES: usize = 512 << 10;

/// The compiling thread's stack: 256 MiB of address space (pages are committed only as
/// the recursion touches them). A 2 MiB stack held chains of ~900 `$ref`s or Lark rules;
/// [`GRAMMAR_MAX_BYTES`] of chain (~30 bytes a link) needs about 40 MiB.
pub const COMPILE_STACK_BYTES: usize = 256 << 20;

/// The longest compile error passed on, in bytes: llguidance quotes the offending input,
/// which can be the whole grammar.
const ERROR_MAX_BYTES: usize = 1024;

/// `msg` on one line (its lines trimmed, blank ones dropped, joined by `; `: llguidance
/// puts context such as the offending source line on lines of their own), cut to
/// [`ERROR_MAX_BYTES`] (at a character boundary) with `…` appended.
fn clip(msg: String) -> String {
    let mut msg = msg
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    if msg.len() > ERROR_MAX_BYTES {
        let mut end = ERROR_MAX_BYTES;
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        msg.truncate(end);
        msg.push('…');
    }
    msg
}

/// `schema` with the JSON options [`GrammarCompiler::compile`] uses (compact `, ` and
/// `: ` separators, no other whitespace) set in its `x-guidance` key, every
/// integer without bounds bounded to the interoperable range ([`bound_integers`]) and
/// every object that lists its properties closed to others ([`close_objects`]): for
/// a schema embedded in a Lark grammar (`%json { ... }`), so it is written as a
/// [`GrammarSpec::JsonSchema`] would be.
///
/// # Errors
/// [`GrammarError::Compile`] when `schema` is not a JSON object.
pub fn json_options(mut schema: serde_json::Value) -> Result<serde_json::Value, GrammarError> {
    if !schema.is_object() {
        return Err(GrammarError::Compile(format!(
            "a JSON schema must be a JSON object, not {schema}"
        )));
    }
    bound_integers(&mut schema);
    close_objects(&mut schema);
    let opts = JsonCompileOptions {
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        whitespace_flexible: false,
        ..JsonCompileOptions::default()
    };
    opts.apply_to(&mut schema);
    Ok(schema)
}

/// The largest integer JSON parsers agree on: 2^53 − 1 (RFC 8259, section 6: integers
/// in `[-(2^53)+1, (2^53)-1]` are interoperable; JavaScript's `Number.MAX_SAFE_INTEGER`).
pub const INTEROPERABLE_INT_MAX: i64 = (1 << 53) - 1;

/// Bounds every `"type": "integer"` subschema of `schema` that gives no bound of its own
/// to `[-INTEROPERABLE_INT_MAX, INTEROPERABLE_INT_MAX]` (`minimum` / `maximum`; a bound
/// the schema states, inclusive or exclusive, is kept and only the missing side is
/// added).
///
/// Why: JSON Schema's `integer` has no size limit, so its grammar allows any number of
/// digits, and a sampled reply (a small model at temperature 1) can write digits until
/// `max_tokens` cuts the JSON off. With the bound an integer has at most 16 digits, as
/// llama.cpp's JSON-schema grammars allow (their integral part is at most 16 digits),
/// and every integer the grammar lets through survives a round trip through any JSON
/// parser. The walk descends into every subschema keyword (`properties`, `items`,
/// `anyOf`, `$defs`, ...) and never into values that are data (`const`, `enum`,
/// `default`, `examples`). Numbers (`"type": "number"`) are left as they are.
pub fn bound_integers(schema: &mut serde_json::Value) {
    use serde_json::Value;
    visit_subschemas(schema, &mut |m| {
        let is_integer = match m.get("type") {
            Some(Value::String(t)) => t == "integer",
            Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
            _ => false,
        };
        if is_integer {
            if !m.contains_key("minimum") && !m.contains_key("exclusiveMinimum") {
                m.insert("minimum".into(), Value::from(-INTEROPERABLE_INT_MAX));
            }
            if !m.contains_key("maximum") && !m.contains_key("exclusiveMaximum") {
                m.insert("maximum".into(), Value::from(INTEROPERABLE_INT_MAX));
            }
        }
    });
}

/// Gives every object subschema of `schema` that lists `properties` and says nothing of
/// extra ones (no `additionalProperties`, `patternProperties` or
/// `unevaluatedProperties`) `"additionalProperties": false`: the reply writes the
/// declared properties and no others. What it writes still validates against the
/// client's schema (a closed object is one of the objects the open one allows).
///
/// Why: with extra properties open, a small model can invent keys (a `"genres"` list
/// the schema never asked for) and loop inside them until `max_tokens` cuts the JSON
/// off; OpenAI's strict mode requires `additionalProperties: false` on every object.
/// Left open: an object whose `required` names a property it does not list (closing it
/// would leave no valid reply), and the whole schema when it uses `allOf` or a `$ref`
/// beside `properties` (subschemas that combine must stay open to combine).
pub fn close_objects(schema: &mut serde_json::Value) {
    use serde_json::Value;
    let mut combines = false;
    visit_subschemas(schema, &mut |m| {
        combines |=
            m.contains_key("allOf") || (m.contains_key("$ref") && m.contains_key("properties"));
    });
    if combines {
        return;
    }
    visit_subschemas(schema, &mut |m| {
        let Some(Value::Object(props)) = m.get("properties") else {
            return;
        };
        let listed = match m.get("required") {
            Some(Value::Array(req)) => req
                .iter()
                .all(|r| r.as_str().is_some_and(|r| props.contains_key(r))),
            _ => true,
        };
        let open = [
            "additionalProperties",
            "patternProperties",
            "unevaluatedProperties",
        ]
        .iter()
        .any(|k| m.contains_key(*k));
        if listed && !open {
            m.insert("additionalProperties".into(), Value::Bool(false));
        }
    });
}

/// Calls `f` on `schema` (when it is an object) and on each of its subschemas, found
/// through JSON Schema's applicator keywords (draft 4 to 2020-12): the maps
/// `properties`, `patternProperties`, `$defs`, `definitions`, `dependentSchemas`,
/// `dependencies`; the lists `allOf`, `anyOf`, `oneOf`, `prefixItems`; and `items`
/// (a schema or a list), `additionalItems`, `additionalProperties`,
/// `unevaluatedProperties`, `unevaluatedItems`, `contains`, `propertyNames`, `not`,
/// `if`, `then`, `else`. Values that are data (`const`, `enum`, `default`,
/// `examples`) and unknown keywords are not walked, nor is a property *named* like a
/// keyword mistaken for one.
fn visit_subschemas(
    schema: &mut serde_json::Value,
    f: &mut dyn FnMut(&mut serde_json::Map<String, serde_json::Value>),
) {
    use serde_json::Value;
    let Value::Object(m) = schema else {
        return;
    };
    f(m);
    for (k, v) in m.iter_mut() {
        match (k.as_str(), v) {
            (
                "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas"
                | "dependencies",
                Value::Object(named),
            ) => named.values_mut().for_each(|s| visit_subschemas(s, f)),
            ("allOf" | "anyOf" | "oneOf" | "prefixItems" | "items", Value::Array(list)) => {
                list.iter_mut().for_each(|s| visit_subschemas(s, f))
            }
            (
                "items"
                | "additionalItems"
                | "additionalProperties"
                | "unevaluatedProperties"
                | "unevaluatedItems"
                | "contains"
                | "propertyNames"
                | "not"
                | "if"
                | "then"
                | "else",
                s,
            ) => visit_subschemas(s, f),
            _ => {}
        }
    }
}

/// A compiled grammar, ready to constrain replies ([`Grammar::start`]). Cloning it is
/// cheap (the compiled grammar is shared); two are equal when their specs are.
#[derive(Clone)]
pub struct Grammar {
    spec: GrammarSpec,
    matcher: Matcher,
    vocab_size: usize,
    special: Arc<[u32]>,
    /// The text that starts the constraint of a lazy grammar ([`Grammar::lazy`]).
    trigger: Option<String>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("spec", &self.spec)
            .field("trigger", &self.trigger)
            .finish()
    }
}

impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
            && self.vocab_size == other.vocab_size
            && self.trigger == other.trigger
    }
}

impl Grammar {
    /// The spec it was compiled from.
    pub fn spec(&self) -> &GrammarSpec {
        &self.spec
    }

    /// This grammar made lazy: a reply is unconstrained until its text contains
    /// `trigger` (bytes of the generated tokens, control tokens excluded), and the
    /// grammar constrains the text after the trigger's first occurrence, starting with
    /// the bytes the token that completed the trigger carries past it (see
    /// [`crate::text::TextParams::grammar`]). An empty `trigger` starts at once.
    #[must_use]
    pub fn lazy(mut self, trigger: impl Into<String>) -> Grammar {
        self.trigger = Some(trigger.into());
        self
    }

    /// The trigger of a lazy grammar ([`Grammar::lazy`]); `None` for one that
    /// constrains from the first token.
    pub fn trigger(&self) -> Option<&str> {
        self.trigger.as_deref()
    }

    /// A fresh constraint at the grammar's start, for one reply.
    pub fn start(&self) -> Constraint {
        Constraint {
            matcher: self.matcher.clone(),
            allowed: SimpleVob::new(),
            vocab_size: self.vocab_size,
            special: Arc::clone(&self.special),
        }
    }
}

/// One reply's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
    /// The last step's allowed set (llguidance's mask, adjusted for stop ids).
    allowed: SimpleVob,
    vocab_size: usize,
    /// The control tokens' ids: never allowed but as stop ids.
    special: Arc<[u32]>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("allowed", &self.allowed.num_set())
            .finish()
    }
}

/// A step's allowed tokens (a bit set over `[vocab]`).
#[derive(Clone, Copy, Debug)]
pub struct Allowed<'a>(&'a SimpleVob);

impl Allowed<'_> {
    /// Whether `id` is allowed.
    pub fn contains(&self, id: u32) -> bool {
        (id as usize) < self.0.len() && self.0.is_allowed(id)
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }

    /// The allowed ids, ascending.
    pub fn ids(&self) -> Vec<u32> {
        self.0.to_list()
    }

    /// The allowed ids, ascending, written into `out` (cleared first; reused across
    /// steps, so no allocation once it has grown).
    pub fn ids_into(&self, out: &mut Vec<u32>) {
        out.clear();
        self.0.iter_set_entries(|i| out.push(i as u32));
    }
}

impl Constraint {
    /// The tokens allowed at this step: those that continue the grammar, plus every id
    /// of `stop_ids` when the grammar can end here (and no other EOS).
    ///
    /// # Errors
    /// [`DeadEnd`] when the parser failed or nothing is allowed and the grammar cannot
    /// end; a grammar that is complete with no stop id to end on is not an error here:
    /// check [`Constraint::is_complete`] on an empty set.
    pub fn allowed(&mut self, stop_ids: &[u32]) -> Result<Allowed<'_>, DeadEnd> {
        let matcher = &mut self.matcher;
        let mask = llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| {
            matcher.compute_mask_or_eos()
        }))
        .map_err(|e| DeadEnd(e.to_string()))?;
        let trie_eos: Vec<u32> = self
            .matcher
            .tok_env()
            .map(|env| env.tok_trie().eos_tokens().to_vec())
            .unwrap_or_default();
        // The grammar can end where llguidance allows EOS and its input so far is
        // complete: a grammar that names the EOS token itself (Lark's `<|im_end|>`)
        // gets it allowed mid-reply, which is not an end.
        let can_end = trie_eos.iter().any(|&e| mask.is_allowed(e))
            && (self.matcher.is_accepting().unwrap_or(false) || self.matcher.is_stopped());
        self.allowed = mask;
        for &e in &trie_eos {
            self.allowed.disallow_token(e);
        }
        for &t in self.special.iter() {
            if (t as usize) < self.allowed.len() {
                self.allowed.disallow_token(t);
            }
        }
        for &s in stop_ids {
            if (s as usize) < self.vocab_size.min(self.allowed.len()) {
                self.allowed.set(s as usize, can_end);
            }
        }
        if self.allowed.is_zero() && !can_end {
            return Err(DeadEnd(
                self.matcher
                    .get_error()
                    .unwrap_or_else(|| "no token is allowed at this step".into()),
            ));
        }
        Ok(Allowed(&self.allowed))
    }

    /// The set the last [`Constraint::allowed`] computed (empty before the first).
    pub fn current(&self) -> Allowed<'_> {
        Allowed(&self.allowed)
    }

    /// Whether the grammar can end here (its output so far is complete).
    pub fn is_complete(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false) || self.matcher.is_stopped()
    }

    /// Advances past `id`, a token [`Constraint::allowed`] allowed (not a stop id).
    ///
    /// # Errors
    /// [`DeadEnd`] if the grammar refuses it.
    pub fn accept(&mut self, id: u32) -> Result<(), DeadEnd> {
        let matcher = &mut self.matcher;
        llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| {
            matcher.consume_token(id)
        }))
        .map_err(|e| DeadEnd(e.to_string()))
    }
}

impl Constraint {
    /// Whether a reply can start under this grammar: a token (or the end) is allowed at
    /// the first step, and the grammar takes the first allowed token (the lowest id)
    /// with no error: taking a token computes the text the grammar forces after it
    /// (llguidance's forced tokens), which for a grammar that forces an endless text
    /// fails at llguidance's parser limits, as it would at a reply's second step.
    fn check_start(&mut self) -> Result<(), DeadEnd> {
        let first = self.allowed(&[])?.ids().first().copied();
        match first {
            None => Ok(()),
            Some(id) => self.accept(id),
        }
    }

    /// Advances past `bytes` of text (as many tokens as the trie's greedy tokenization
    /// of them; the lexer reads bytes, so any tokenization leads to the same state):
    /// the text a lazy grammar's trigger token carried past the trigger.
    ///
    /// # Errors
    /// [`DeadEnd`] if the grammar refuses any of it (the constraint is then unusable).
    pub fn accept_bytes(&mut self, bytes: &[u8]) -> Result<(), DeadEnd> {
        if bytes.is_empty() {
            return Ok(());
        }
        let env = self.matcher.tok_env().map_err(|e| DeadEnd(e.to_string()))?;
        let ids = env.tok_trie().greedy_tokenize(bytes);
        let matcher = &mut self.matcher;
        let took = llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| {
            matcher.try_consume_tokens(&ids)
        }))
        .map_err(|e| DeadEnd(e.to_string()))?;
        if took == ids.len() {
            Ok(())
        } else {
            Err(DeadEnd(format!(
                "the grammar refuses the text {:?}",
                String::from_utf8_lossy(bytes)
            )))
        }
    }
}

/// Writes `logits` (`[vocab]`) into `out` with every row `allowed` does not contain
/// set to `-inf` and every allowed row copied bit for bit. `out` is reused across
/// steps (no allocation once it has grown to `[vocab]`).
pub fn mask_logits(logits: &[f32], allowed: Allowed<'_>, out: &mut Vec<f32>) {
    out.clear();
    out.resize(logits.len(), f32::NEG_INFINITY);
    allowed.0.iter_set_entries(|i| {
        if let (Some(o), Some(&l)) = (out.get_mut(i), logits.get(i)) {
            *o = l;
        }
    });
}
