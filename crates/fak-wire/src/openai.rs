//! The OpenAI Chat Completions, Completions and error wires.
//!
//! Shapes follow the OpenAI API reference and the `openai` Python SDK (3.57): requests
//! as `openai.types.chat.completion_create_params` and
//! `openai.types.completion_create_params`, responses as `ChatCompletion`,
//! `ChatCompletionChunk` and `Completion` (whose type the SDK also uses for the
//! Completions stream's chunks), usage as `CompletionUsage`.
//!
//! Each type is used both ways: fak-gateway parses client requests into them and writes
//! its answers from them; the upstream driver writes its requests to another
//! OpenAI-compatible server from them and parses that server's answers. So request
//! fields that are unset are left out when written (`None` fields are skipped), and
//! every response field is optional on the way in (servers differ in what they send).
//!
//! **Fields fak takes but does not act on** are in one place each:
//! - [`Ignored`]: accepted at any value, because they never change the output
//!   (`user`, `metadata`, `store`, ...), each documented there;
//! - [`NeutralOnly`]: sampling controls fak does not implement, accepted only at the
//!   value that changes nothing (what a client sends when it spells out OpenAI's
//!   defaults); [`NeutralOnly::check`] names the field otherwise;
//! - [`Unimplemented`]: fields that would change the output in a way fak cannot
//!   honour; [`Unimplemented::check`] names the first one set.
//!
//! The sampling fields both generation requests share are one struct, [`SamplingParams`]
//! (with the controls vLLM and llama.cpp add, [`SamplingExtensions`], acted on), flattened
//! into each. Fields no version of the API defines otherwise are ignored by the parser.

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fmt;

// ---------------------------------------------------------------------------------------
// Shared pieces

/// `stop`: one string or a list (up to 4 at OpenAI; the gateway takes up to 16).
/// SDK: `stop: Union[Optional[str], SequenceNotStr[str], None]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl<'de> Deserialize<'de> for Stop {
    /// A string or an array of strings; anything else is an error saying so.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::de::str_or_seq(d, "a string or an array of strings", Stop::One, Stop::Many)
    }
}

impl Stop {
    /// The strings, in order.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`. SDK: `ChatCompletionStreamOptionsParam`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamOptions {
    /// When true, a last chunk with empty `choices` carries the whole request's
    /// [`Usage`] (and every other chunk `"usage": null`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
    /// Random padding against length side channels (accepted, not acted on: fak pads
    /// nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_obfuscation: Option<bool>,
}

/// Token counts of one request. SDK: `openai.types.CompletionUsage`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the prompt (after templating, for chat).
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
    /// Their sum (taken as 0 when a server leaves it out).
    #[serde(default)]
    pub total_tokens: u64,
    /// Breakdown of the prompt tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    /// Usage of `prompt` tokens (of which `cached` read from a cache) and `completion`
    /// generated ones.
    pub fn new(prompt: u64, completion: u64, cached: u64) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: Some(PromptTokensDetails {
                cached_tokens: Some(cached),
            }),
        }
    }

    /// `prompt_tokens_details.cached_tokens`, 0 when absent.
    pub fn cached_tokens(&self) -> u64 {
        self.prompt_tokens_details
            .as_ref()
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0)
    }
}

/// SDK: `openai.types.completion_usage.PromptTokensDetails`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens read from a cache (fak: whose KV entries were reused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
}

/// Why a choice ended. SDK: `finish_reason` literals of `Choice`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the end of the context window.
    Length,
    /// The reply is tool calls.
    ToolCalls,
    /// Filtered (never sent by fak).
    ContentFilter,
    /// The deprecated `function_call` (never sent by fak).
    FunctionCall,
    /// Another word some OpenAI-compatible servers send (vLLM's and SGLang's `abort`),
    /// read from an upstream as a plain stop; never sent by fak.
    #[serde(other)]
    Other,
}

/// The `type` of a tool, tool call or named tool choice: only `"function"` is
/// defined for chat tool calls fak handles.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FunctionType {
    /// `"function"`.
    #[default]
    Function,
}

// ---------------------------------------------------------------------------------------
// The error envelope

/// An error response: `{"error": {"message", "type", "param", "code"}}`.
/// SDK: the body `openai.APIStatusError` reads (`body["error"]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// The error.
    pub error: ErrorObject,
}

/// The inner object of [`ErrorResponse`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorObject {
    /// What was wrong, for a person (empty when a server sends none).
    #[serde(default)]
    pub message: String,
    /// The type word (`invalid_request_error`, `authentication_error`, ...; empty when
    /// a server sends none).
    #[serde(rename = "type", default)]
    pub kind: String,
    /// The request field at fault, when known (`null` otherwise).
    #[serde(default)]
    pub param: Option<String>,
    /// A machine-readable code, when there is one (`null` otherwise). vLLM and
    /// llama.cpp's server send the HTTP status here as an integer, read as its text.
    #[serde(default, deserialize_with = "crate::de::code_text")]
    pub code: Option<String>,
}

/// An error as another server sends it, read by the upstream driver: an error body
/// (any status), or an error event inside a stream (`data: {"error": ...}`, as vLLM and
/// llama.cpp's server send one mid-reply). The message is under `error` (OpenAI, vLLM,
/// llama.cpp's server, and Anthropic, whose `error` has the same `type` and `message`),
/// `message`, or `detail` (FastAPI's); each as an [`ErrorObject`] or a bare string.
/// Other members are ignored. Read only: fak writes [`ErrorResponse`].
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ServerError {
    /// `error`: OpenAI's and Anthropic's place.
    #[serde(default)]
    pub error: Option<ErrorDetail>,
    /// `message`: a bare message (some servers).
    #[serde(default)]
    pub message: Option<ErrorDetail>,
    /// `detail`: FastAPI's (a string, or a list of validation errors).
    #[serde(default)]
    pub detail: Option<ErrorDetail>,
}

impl ServerError {
    /// The first message found (`error`, then `message`, then `detail`); `None` when
    /// none of them carries one.
    pub fn text(&self) -> Option<&str> {
        [&self.error, &self.message, &self.detail]
            .into_iter()
            .flatten()
            .find_map(ErrorDetail::text)
    }
}

/// One place of a [`ServerError`]: an object with a `message`, a string, or anything
/// else (kept as no message).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum ErrorDetail {
    /// A bare message.
    Text(String),
    /// OpenAI's error object (Anthropic's reads as one too).
    Object(ErrorObject),
    /// Something else (a FastAPI validation list, a number): no message.
    Other(serde::de::IgnoredAny),
}

impl ErrorDetail {
    /// The message, when there is a non-empty one.
    pub fn text(&self) -> Option<&str> {
        match self {
            ErrorDetail::Text(t) => Some(t.as_str()),
            ErrorDetail::Object(o) => Some(o.message.as_str()),
            ErrorDetail::Other(_) => None,
        }
        .filter(|t| !t.trim().is_empty())
    }
}

// ---------------------------------------------------------------------------------------
// Fields taken and not acted on

/// A field fak refuses: its name and why, for a 400 naming it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// The request field, as spelled on the wire.
    pub field: &'static str,
    /// The whole message for the client (it names the field).
    pub message: String,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Request fields accepted at any value and not acted on, because none changes the
/// generated output. Shared by both generation requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Ignored {
    /// An end-user id for abuse monitoring (deprecated by OpenAI for
    /// `safety_identifier`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Up to 16 key-value pairs stored with the response at OpenAI (fak stores none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
    /// Whether OpenAI should store the completion (fak stores none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<bool>,
    /// OpenAI's processing tier (`auto`, `default`, `flex`, ...): one tier here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_tier: Option<String>,
    /// OpenAI's prompt-cache routing key (fak's KV reuse needs none; its partitions are
    /// the API key and `cache_salt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_cache_key: Option<String>,
    /// OpenAI's prompt-cache retention (`in-memory`, `24h`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_cache_retention: Option<String>,
    /// A stable end-user id for abuse monitoring.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safety_identifier: Option<String>,
    /// OpenAI's explicit prompt-cache breakpoints and lifetime (`{ttl, ...}`): fak
    /// caches by prefix on its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_cache_options: Option<Value>,
}

/// Sampling controls fak does not implement, accepted only at the value that changes
/// nothing: `null`, an empty `logit_bias`, a penalty of 0, `best_of` 1.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NeutralOnly {
    /// Token id (as a string) → bias added to its logit, -100..=100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// -2.0..=2.0: penalises tokens by how often they appeared so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    /// -2.0..=2.0: penalises tokens that appeared so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    /// Completions: generate this many server-side and return the best.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_of: Option<i64>,
}

impl NeutralOnly {
    /// # Errors
    /// [`Refused`] naming the first field set to a value other than its neutral one.
    pub fn check(&self) -> Result<(), Refused> {
        let refuse = |field: &'static str, got: String| {
            Err(Refused {
                field,
                message: format!(
                    "`{field}` is not supported yet (only its neutral value; got {got})"
                ),
            })
        };
        if let Some(b) = self.logit_bias.as_ref().filter(|b| !b.is_empty()) {
            return refuse("logit_bias", format!("{} entries", b.len()));
        }
        for (field, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if let Some(v) = v.filter(|&v| v != 0.0) {
                return refuse(field, v.to_string());
            }
        }
        if let Some(n) = self.best_of.filter(|&n| n != 1) {
            return refuse("best_of", n.to_string());
        }
        Ok(())
    }
}

/// Sampling controls that vLLM, SGLang and llama.cpp's server take beyond OpenAI's (not
/// in OpenAI's API reference; the `openai` SDK sends them through `extra_body`). fak
/// acts on them: the gateway passes them to the sampler, the upstream driver sends them
/// when set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingExtensions {
    /// Keep the `top_k` most likely tokens; 0 disables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    /// Drop tokens below `min_p` times the most likely one's probability; 0 disables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Divides positive logits (multiplies negative ones) of tokens already seen; 1
    /// disables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
}

/// The sampling and length fields Chat Completions and Completions share (the names of
/// vLLM's `SamplingParams`), flattened into [`ChatCompletionRequest`] and
/// [`CompletionRequest`]. SDK: the same-named fields of both `completion_create_params`.
///
/// Its `Deserialize` is written out rather than derived: inside a `#[serde(flatten)]`
/// a derived struct's errors lose the field's name (the flattened values are
/// re-read from a buffer that `serde_path_to_error` does not see), so each error here
/// starts with the field and the path inside it (`temperature: invalid type: string
/// "hot", expected f32`, ``stop[1]: invalid type: integer `5`, expected a string``). A
/// field given twice is an error naming it, as a derived struct's is.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SamplingParams {
    /// Most tokens to generate. Chat: deprecated by OpenAI for `max_completion_tokens`,
    /// which wins; Completions: default 16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    /// 0..=2, default 1; 0 is greedy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass, default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Sampling seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    /// Choices to generate (Completions: per prompt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<i64>,
    /// vLLM / llama.cpp sampling controls.
    #[serde(flatten)]
    pub extensions: SamplingExtensions,
}

impl<'de> Deserialize<'de> for SamplingParams {
    /// The fields above from a map (the request's remaining fields, under `flatten`);
    /// other keys are left to the request's other parts.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SamplingParams;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a request object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SamplingParams, A::Error> {
                /// `key`'s value, its error prefixed with its path from `key` (`stop[1]: ...`);
                /// an error if seen before.
                fn take<'de, A: MapAccess<'de>, T: Deserialize<'de>>(
                    map: &mut A,
                    slot: &mut Option<T>,
                    key: &str,
                ) -> Result<(), A::Error> {
                    if slot.is_some() {
                        // `null` then a value would pass; serde's derive has the same gap.
                        return Err(de::Error::custom(format_args!("duplicate field `{key}`")));
                    }
                    *slot = map.next_value_seed(Field::<T>(key, std::marker::PhantomData))?;
                    Ok(())
                }
                /// The value of field `.0` as `Option<T>`, read through
                /// `serde_path_to_error` so that an error inside it (an element of a
                /// list) keeps its path under the field.
                struct Field<'k, T>(&'k str, std::marker::PhantomData<T>);
                impl<'de, T: Deserialize<'de>> de::DeserializeSeed<'de> for Field<'_, T> {
                    type Value = Option<T>;
                    fn deserialize<D: Deserializer<'de>>(
                        self,
                        d: D,
                    ) -> Result<Option<T>, D::Error> {
                        serde_path_to_error::deserialize(d).map_err(|e| {
                            let path = crate::join_path(self.0, &e.path().to_string());
                            de::Error::custom(format_args!("{path}: {}", e.into_inner()))
                        })
                    }
                }
                let mut p = SamplingParams::default();
                let x = &mut p.extensions;
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    match &*key {
                        "max_tokens" => take(&mut map, &mut p.max_tokens, &key)?,
                        "temperature" => take(&mut map, &mut p.temperature, &key)?,
                        "top_p" => take(&mut map, &mut p.top_p, &key)?,
                        "seed" => take(&mut map, &mut p.seed, &key)?,
                        "stop" => take(&mut map, &mut p.stop, &key)?,
                        "n" => take(&mut map, &mut p.n, &key)?,
                        "top_k" => take(&mut map, &mut x.top_k, &key)?,
                        "min_p" => take(&mut map, &mut x.min_p, &key)?,
                        "repetition_penalty" => take(&mut map, &mut x.repetition_penalty, &key)?,
                        _ => {
                            map.next_value::<de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(p)
            }
        }
        d.deserialize_map(V)
    }
}

/// Chat request fields that would change the output in a way fak cannot honour:
/// any value but `null` is refused ([`Unimplemented::check`]). Their shapes are kept
/// as JSON until fak implements them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Unimplemented {
    /// The deprecated function-calling form (`tools` replaces it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub functions: Option<Value>,
    /// The deprecated function-calling form (`tool_choice` replaces it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function_call: Option<Value>,
    /// Audio output settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio: Option<Value>,
    /// Predicted output (speculative decoding against given text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prediction: Option<Value>,
    /// Web search.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub web_search_options: Option<Value>,
    /// A reasoning model's effort (fak's models have no reasoning mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<Value>,
    /// Reply length control of newer models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<Value>,
    /// Moderation of the input and output (which may block a reply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moderation: Option<Value>,
}

impl Unimplemented {
    /// # Errors
    /// [`Refused`] naming the first field that is set (not `null`).
    pub fn check(&self) -> Result<(), Refused> {
        let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
        for (field, v) in [
            ("functions", &self.functions),
            ("function_call", &self.function_call),
        ] {
            if set(v) {
                return Err(Refused {
                    field,
                    message: format!("`{field}` (the deprecated function-calling form) is not supported; use `tools` and `tool_choice`"),
                });
            }
        }
        for (field, v) in [
            ("audio", &self.audio),
            ("prediction", &self.prediction),
            ("web_search_options", &self.web_search_options),
            ("reasoning_effort", &self.reasoning_effort),
            ("verbosity", &self.verbosity),
            ("moderation", &self.moderation),
        ] {
            if set(v) {
                return Err(Refused {
                    field,
                    message: format!("`{field}` is not supported yet"),
                });
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Chat Completions: request

/// `POST /v1/chat/completions`. SDK: `CompletionCreateParamsBase`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    /// The model id.
    pub model: String,
    /// The conversation, oldest first.
    pub messages: Vec<ChatMessage>,
    /// Most tokens to generate; wins over `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<i64>,
    /// Stream server-sent events of [`ChatCompletionChunk`]s, ending `data: [DONE]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Stream settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Tools the model may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    /// Which tool calls the model may or must make.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// Whether the model may make several calls in one reply (accepted; fak always
    /// allows several).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// Return each generated token's logprob.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    /// With `logprobs`: that many most likely alternatives per token, 0..=20.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<i64>,
    /// The reply's format (`text`, `json_object`, `json_schema`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
    /// Output modalities; fak produces `["text"]` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modalities: Option<Vec<String>>,
    /// vLLM's prefix-cache salt: only requests with the same salt share a cached prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// fak's extension: what to do when the conversation outgrows the context window
    /// ([`crate::ContextOverflow`]; default: the server's `--context-overflow`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_overflow: Option<crate::ContextOverflow>,
    /// A grammar the reply must follow, in llguidance's Lark syntax (`start: ...`; the
    /// field's name is llama.cpp's server's, which takes GBNF there: GBNF is refused
    /// with a 400, llguidance converts it only in its Python tools). Not with a
    /// `response_format` other than `text`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammar: Option<String>,
    /// `max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n` and vLLM's controls.
    #[serde(flatten)]
    pub sampling: SamplingParams,
    /// Fields accepted and not acted on.
    #[serde(flatten)]
    pub ignored: Ignored,
    /// Sampling controls accepted only at their neutral value.
    #[serde(flatten)]
    pub neutral: NeutralOnly,
    /// Fields refused when set.
    #[serde(flatten)]
    pub unimplemented: Unimplemented,
}

/// A message's author. SDK: the `role` literals of `ChatCompletionMessageParam`'s
/// members (the deprecated `function` role is not taken).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Instructions (older models).
    System,
    /// Instructions (newer models; the same as `system` for fak).
    Developer,
    /// The user.
    User,
    /// The model.
    Assistant,
    /// A tool's result.
    Tool,
}

impl Role {
    /// The role as spelled on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One message of a conversation: the union of the SDK's
/// `ChatCompletion{System,Developer,User,Assistant,Tool}MessageParam` as one struct
/// (which fields a role may carry is checked by the gateway).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// The author.
    pub role: Role,
    /// A string or content parts; `null` for an assistant message with tool calls.
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// A participant name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `tool` messages: the call answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// `assistant` messages: the calls made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// `assistant` messages: a refusal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
}

/// A message's content: a string or a list of parts.
/// SDK: `content: Union[str, Iterable[ChatCompletionContentPartParam]]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Parts, in order.
    Parts(Vec<ContentPart>),
}

impl<'de> Deserialize<'de> for MessageContent {
    /// A string or an array of parts, with a part's own error (rather than "did not
    /// match any variant") when a part is wrong.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MessageContent;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(MessageContent::Text(s.to_string()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(MessageContent::Text(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element()? {
                    parts.push(p);
                }
                Ok(MessageContent::Parts(parts))
            }
        }
        d.deserialize_any(V)
    }
}

/// One content part. SDK: `ChatCompletionContentPartParam` (text, image_url,
/// input_audio, file) and the assistant's refusal part.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// `{"type": "text", "text"}`.
    Text {
        /// The text.
        text: String,
    },
    /// `{"type": "image_url", "image_url": {"url", "detail"}}`.
    ImageUrl {
        /// The image's URL (or `data:` URL) and detail level.
        image_url: Value,
    },
    /// `{"type": "input_audio", "input_audio": {"data", "format"}}`.
    InputAudio {
        /// Base64 audio and its format.
        input_audio: Value,
    },
    /// `{"type": "file", "file": {"file_data", "file_id", "filename"}}`.
    File {
        /// The file.
        file: Value,
    },
    /// `{"type": "refusal", "refusal"}` (assistant messages).
    Refusal {
        /// The refusal text.
        refusal: String,
    },
}

impl ContentPart {
    /// The part's `type` as spelled on the wire.
    pub fn kind(&self) -> &'static str {
        match self {
            ContentPart::Text { .. } => "text",
            ContentPart::ImageUrl { .. } => "image_url",
            ContentPart::InputAudio { .. } => "input_audio",
            ContentPart::File { .. } => "file",
            ContentPart::Refusal { .. } => "refusal",
        }
    }
}

/// A function tool. SDK: `ChatCompletionFunctionToolParam`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: FunctionType,
    /// The function.
    pub function: FunctionDefinition,
}

/// SDK: `openai.types.shared_params.FunctionDefinition`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionDefinition {
    /// `^[a-zA-Z0-9_-]{1,64}$` at OpenAI.
    pub name: String,
    /// What it does, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema object of the arguments; absent means no arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Map<String, Value>>,
    /// Strict schema adherence: on the in-kernel engine a schema its call grammar cannot
    /// constrain is then a 400 naming the tool and the construct (without it, that
    /// tool's arguments fall back to any JSON object); fak checks arguments against the
    /// schema either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice`. SDK: `ChatCompletionToolChoiceOptionParam`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ToolChoice {
    /// `"none"`, `"auto"` or `"required"`.
    Mode(ToolChoiceMode),
    /// `{"type": "function", "function": {"name"}}`.
    Named(NamedToolChoice),
}

impl<'de> Deserialize<'de> for ToolChoice {
    /// A mode string or a named function object, each with its own error (an unknown
    /// mode lists the modes; an object missing `function` says so); anything else is an
    /// error naming both forms.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ToolChoice;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    r#""none", "auto", "required" or {"type": "function", "function": {"name": ...}}"#,
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                ToolChoiceMode::deserialize(de::value::StrDeserializer::<E>::new(s))
                    .map(ToolChoice::Mode)
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                NamedToolChoice::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(ToolChoice::Named)
            }
        }
        d.deserialize_any(V)
    }
}

/// SDK: the string literals of `ChatCompletionToolChoiceOptionParam`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoiceMode {
    /// No calls.
    None,
    /// The model decides.
    Auto,
    /// At least one call.
    Required,
}

/// SDK: `ChatCompletionNamedToolChoiceParam`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NamedToolChoice {
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: FunctionType,
    /// The function that must be called.
    pub function: FunctionName,
}

/// `{"name"}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionName {
    /// The function's name.
    pub name: String,
}

/// A tool call, in an assistant message of the history or of a reply.
/// SDK: `ChatCompletionMessageFunctionToolCall(Param)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, which the `tool` message answering it names.
    pub id: String,
    /// Always `"function"` (taken as that when absent).
    #[serde(rename = "type", default)]
    pub kind: FunctionType,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// SDK: `openai.types.chat.chat_completion_message_function_tool_call.Function`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// The arguments as a JSON text (a string, not an object).
    pub arguments: String,
}

/// `response_format`. SDK: `ResponseFormatText | ResponseFormatJSONObject |
/// ResponseFormatJSONSchema` (`openai.types.shared_params`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text (the default).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON matching a schema.
    JsonSchema {
        /// The schema and its name.
        json_schema: JsonSchemaFormat,
    },
}

/// SDK: `openai.types.shared_params.response_format_json_schema.JSONSchema`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JsonSchemaFormat {
    /// The format's name.
    pub name: String,
    /// What it is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON Schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Map<String, Value>>,
    /// Strict adherence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

// ---------------------------------------------------------------------------------------
// Chat Completions: response and stream

/// The `object` of a [`ChatCompletion`].
pub const CHAT_COMPLETION_OBJECT: &str = "chat.completion";
/// The `object` of a [`ChatCompletionChunk`].
pub const CHAT_COMPLETION_CHUNK_OBJECT: &str = "chat.completion.chunk";
/// The `object` of a [`Completion`] (and of its stream's chunks).
pub const TEXT_COMPLETION_OBJECT: &str = "text_completion";

/// A chat reply. SDK: `openai.types.chat.ChatCompletion`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletion {
    /// `chatcmpl-...`.
    pub id: String,
    /// [`CHAT_COMPLETION_OBJECT`].
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The model id.
    pub model: String,
    /// The backend configuration's fingerprint (`"fak"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
    /// One per generated choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// fak's own field (not OpenAI's): the boundary's verdicts on the reply's tool calls
    /// and the request's tool results, as fak-gateway's `tools` module writes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fak: Option<Value>,
}

/// SDK: `openai.types.chat.chat_completion.Choice`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// The choice's index.
    pub index: u32,
    /// The reply.
    pub message: AssistantMessage,
    /// The tokens' logprobs, when asked for (`null` otherwise).
    #[serde(default)]
    pub logprobs: Option<ChoiceLogprobs>,
    /// Why it ended.
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    /// fak's own field (not OpenAI's), only in a reply of several choices (`n > 1`):
    /// what is this choice's alone, `finish_detail` and `grammar_error` at a grammar's
    /// dead end (the reply's `fak` says it for a one-choice reply). Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fak: Option<Value>,
}

/// A reply message. SDK: `openai.types.chat.ChatCompletionMessage`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: Role,
    /// The text; `null` when the reply is only tool calls.
    #[serde(default)]
    pub content: Option<String>,
    /// A refusal (`null`: none).
    #[serde(default)]
    pub refusal: Option<String>,
    /// The calls the client should run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// A choice's `logprobs`. SDK: `openai.types.chat.chat_completion.ChoiceLogprobs`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChoiceLogprobs {
    /// One entry per content token.
    #[serde(default)]
    pub content: Option<Vec<TokenLogprob>>,
    /// One entry per refusal token (`null`: fak never refuses).
    #[serde(default)]
    pub refusal: Option<Vec<TokenLogprob>>,
}

/// SDK: `openai.types.chat.ChatCompletionTokenLogprob`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Natural log of its probability.
    pub logprob: f64,
    /// Its exact bytes (UTF-8 of part of a character, possibly).
    #[serde(default)]
    pub bytes: Option<Vec<u8>>,
    /// The most likely tokens at its position, highest first (`null` read as none).
    #[serde(default, deserialize_with = "crate::de::null_as_default")]
    pub top_logprobs: Vec<TopLogprob>,
}

/// SDK: `openai.types.chat.chat_completion_token_logprob.TopLogprob`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Natural log of its probability.
    pub logprob: f64,
    /// Its exact bytes.
    #[serde(default)]
    pub bytes: Option<Vec<u8>>,
}

/// One server-sent event of a chat stream. SDK: `openai.types.chat.ChatCompletionChunk`.
///
/// Read from an upstream, every field may be missing (empty, 0) and fields the API does
/// not define are ignored: llama.cpp's server adds `timings`, and `reasoning_content`
/// to the delta; vLLM adds `stop_reason` to the choice (kept: [`ChunkChoice::stop_reason`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    /// The same on every chunk of a stream.
    #[serde(default)]
    pub id: String,
    /// [`CHAT_COMPLETION_CHUNK_OBJECT`].
    #[serde(default)]
    pub object: String,
    /// Unix seconds, the same on every chunk.
    #[serde(default)]
    pub created: u64,
    /// The model id.
    #[serde(default)]
    pub model: String,
    /// `"fak"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
    /// The choices' deltas (empty on the usage chunk; absent or `null` read as empty).
    #[serde(default, deserialize_with = "crate::de::null_as_default")]
    pub choices: Vec<ChunkChoice>,
    /// Absent unless `stream_options.include_usage`; then `null` on every chunk but the
    /// last, which has empty `choices` and the request's usage.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "present_or_null"
    )]
    pub usage: Option<Option<Usage>>,
    /// fak's own field, on the chunk with the `finish_reason`: see [`ChatCompletion::fak`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fak: Option<Value>,
}

/// SDK: `openai.types.chat.chat_completion_chunk.Choice`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkChoice {
    /// The choice's index (0 when a server leaves it out).
    #[serde(default)]
    pub index: u32,
    /// What this chunk adds (nothing when absent).
    #[serde(default)]
    pub delta: Delta,
    /// The logprobs of the tokens this chunk's text releases, when asked for.
    #[serde(default)]
    pub logprobs: Option<ChoiceLogprobs>,
    /// Set on the choice's last chunk.
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    /// vLLM's extension: what stopped the choice (see [`StopReason`]); never sent by fak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<StopReason>,
}

/// vLLM's `stop_reason` on a choice (`Union[int, str, None]` in its protocol): the stop
/// string that ended the choice, or the id of the stop token (`stop_token_ids`);
/// `null` when it ended at an end-of-sequence token or the length limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopReason {
    /// A stop string of the request.
    Sequence(String),
    /// A stop token's id.
    Token(u64),
}

impl StopReason {
    /// The stop string, when it was one.
    pub fn sequence(&self) -> Option<&str> {
        match self {
            StopReason::Sequence(s) => Some(s),
            StopReason::Token(_) => None,
        }
    }
}

/// SDK: `openai.types.chat.chat_completion_chunk.ChoiceDelta`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    /// On the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// Text to append.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Refusal text to append.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    /// Tool-call pieces (fak sends each call whole, in one piece).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// SDK: `openai.types.chat.chat_completion_chunk.ChoiceDeltaToolCall`: the call at
/// `index`, in pieces whose `arguments` concatenate.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    /// Which call of the reply (0 when a server leaves it out).
    #[serde(default)]
    pub index: u32,
    /// On the call's first piece.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `"function"`, on the call's first piece.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<FunctionType>,
    /// The function's name (first piece) and a piece of its arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<FunctionCallDelta>,
}

/// SDK: `openai.types.chat.chat_completion_chunk.ChoiceDeltaToolCallFunction`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FunctionCallDelta {
    /// The function's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A piece of the arguments' JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

// ---------------------------------------------------------------------------------------
// Completions

/// `POST /v1/completions`. SDK: `openai.types.completion_create_params`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// The model id.
    pub model: String,
    /// The prompt(s): text or token ids.
    pub prompt: CompletionPrompt,
    /// Stream server-sent events of [`Completion`] chunks, ending `data: [DONE]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Stream settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Return the prompt before the completion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    /// The legacy logprobs: that many most likely alternatives per token, 0..=5 at
    /// OpenAI (fak: 0..=20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<i64>,
    /// Text after the completion (insertion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suffix: Option<String>,
    /// As [`ChatCompletionRequest::cache_salt`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// As [`ChatCompletionRequest::grammar`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammar: Option<String>,
    /// As [`ChatCompletionRequest::response_format`]: not in OpenAI's Completions API,
    /// taken as vLLM's OpenAI-compatible server takes it on `/v1/completions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
    /// `max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n` and vLLM's controls.
    #[serde(flatten)]
    pub sampling: SamplingParams,
    /// Fields accepted and not acted on.
    #[serde(flatten)]
    pub ignored: Ignored,
    /// Sampling controls accepted only at their neutral value.
    #[serde(flatten)]
    pub neutral: NeutralOnly,
}

/// The Completions `prompt`: a string, a list of strings, a list of token ids, or a
/// list of lists of token ids. SDK: `prompt: Union[str, SequenceNotStr[str],
/// Iterable[int], Iterable[Iterable[int]], None]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum CompletionPrompt {
    /// One text prompt.
    Text(String),
    /// Several text prompts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// One prompt of a [`CompletionPrompt`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptInput {
    /// Text, tokenized by the server.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

impl CompletionPrompt {
    /// The prompts, in order (a list's order is the choices' `index` order).
    pub fn into_prompts(self) -> Vec<PromptInput> {
        match self {
            CompletionPrompt::Text(t) => vec![PromptInput::Text(t)],
            CompletionPrompt::Texts(v) => v.into_iter().map(PromptInput::Text).collect(),
            CompletionPrompt::Tokens(v) => vec![PromptInput::Tokens(v)],
            CompletionPrompt::TokenLists(v) => v.into_iter().map(PromptInput::Tokens).collect(),
        }
    }
}

impl<'de> Deserialize<'de> for CompletionPrompt {
    /// The four forms, with an error naming the element at fault (a negative or
    /// fractional token id, a list mixing forms).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Item {
            Text(String),
            Id(i64),
            Ids(Vec<i64>),
            Other(Value),
        }
        fn id<E: de::Error>(v: i64, at: &str) -> Result<u32, E> {
            u32::try_from(v).map_err(|_| {
                E::custom(format!(
                    "prompt{at} is {v}: a token id is an integer in 0..={}",
                    u32::MAX
                ))
            })
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CompletionPrompt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a list of strings, a list of token ids, or a list of lists of token ids")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(CompletionPrompt::Text(s.to_string()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(CompletionPrompt::Text(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut texts = Vec::new();
                let mut ids = Vec::new();
                let mut lists = Vec::new();
                let mut i = 0usize;
                while let Some(item) = seq.next_element::<Item>()? {
                    let forms = [!texts.is_empty(), !ids.is_empty(), !lists.is_empty()];
                    let this = match &item {
                        Item::Text(_) => 0,
                        Item::Id(_) => 1,
                        Item::Ids(_) => 2,
                        Item::Other(v) => {
                            return Err(de::Error::custom(format!(
                                "prompt[{i}] is {v}: expected a string, a token id (an integer) or a list of token ids"
                            )))
                        }
                    };
                    if forms.iter().enumerate().any(|(k, &f)| f && k != this) {
                        return Err(de::Error::custom(format!(
                            "prompt[{i}] is not of the same form as the elements before it (strings, token ids and lists of token ids do not mix)"
                        )));
                    }
                    match item {
                        Item::Text(t) => texts.push(t),
                        Item::Id(v) => ids.push(id(v, &format!("[{i}]"))?),
                        Item::Ids(v) => lists.push(
                            v.into_iter()
                                .enumerate()
                                .map(|(j, x)| id(x, &format!("[{i}][{j}]")))
                                .collect::<Result<Vec<u32>, _>>()?,
                        ),
                        Item::Other(_) => unreachable!("returned above"),
                    }
                    i += 1;
                }
                Ok(if !ids.is_empty() {
                    CompletionPrompt::Tokens(ids)
                } else if !lists.is_empty() {
                    CompletionPrompt::TokenLists(lists)
                } else {
                    CompletionPrompt::Texts(texts)
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// A Completions reply, and each chunk of its stream. SDK: `openai.types.Completion`.
/// Read from an upstream, as [`ChatCompletionChunk`]: fields may be missing, extras are
/// ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// `cmpl-...`, the same on every chunk.
    #[serde(default)]
    pub id: String,
    /// [`TEXT_COMPLETION_OBJECT`].
    #[serde(default)]
    pub object: String,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// The model id.
    #[serde(default)]
    pub model: String,
    /// The choices (of a chunk: their deltas; empty on the usage chunk; absent or
    /// `null` read as empty).
    #[serde(default, deserialize_with = "crate::de::null_as_default")]
    pub choices: Vec<CompletionChoice>,
    /// Token counts (of a stream: on its last chunk, with
    /// `stream_options.include_usage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// SDK: `openai.types.CompletionChoice`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// The text (of a chunk: the text to append; empty when absent).
    #[serde(default)]
    pub text: String,
    /// The choice's index: its prompt's position in the request's list of prompts (0
    /// when a server leaves it out).
    #[serde(default)]
    pub index: u32,
    /// The legacy logprobs, when asked for.
    #[serde(default)]
    pub logprobs: Option<CompletionLogprobs>,
    /// Why it ended (on the choice's last chunk).
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    /// vLLM's extension: see [`ChunkChoice::stop_reason`]; never sent by fak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<StopReason>,
}

/// The legacy logprobs. SDK: `openai.types.completion_choice.Logprobs`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    /// Each token's text.
    #[serde(default)]
    pub tokens: Vec<String>,
    /// Each token's logprob (a `null` entry, which OpenAI and vLLM send for a token
    /// without one, is read as `-inf`).
    #[serde(default, deserialize_with = "crate::de::logprobs_with_nulls")]
    pub token_logprobs: Vec<f64>,
    /// Per token: the most likely tokens' text → logprob (the chosen one included; a
    /// `null` entry is read as empty).
    #[serde(default, deserialize_with = "crate::de::list_with_nulls")]
    pub top_logprobs: Vec<BTreeMap<String, f64>>,
    /// Per token: its offset in the completion text, in characters.
    #[serde(default)]
    pub text_offset: Vec<usize>,
}

/// `usage` of a stream chunk: absent, `null`, or a value.
mod present_or_null {
    use super::Usage;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Option<Usage>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(inner) => inner.serialize(s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<Usage>>, D::Error> {
        Option::<Usage>::deserialize(d).map(Some)
    }
}

// ---------------------------------------------------------------------------------------
// Models

/// The `object` of a [`Model`].
pub const MODEL_OBJECT: &str = "model";
/// The `object` of a [`ModelList`].
pub const LIST_OBJECT: &str = "list";

/// One model (`GET /v1/models/{id}`, and each entry of the list). SDK:
/// `openai.types.Model`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Model {
    /// The id requests send as `model`.
    pub id: String,
    /// [`MODEL_OBJECT`].
    #[serde(default)]
    pub object: String,
    /// Unix seconds (fak: when the server started; 0 when a server leaves it out, as
    /// llama-cpp-python does).
    #[serde(default)]
    pub created: u64,
    /// Who serves it (fak: `fak` for the in-process model, else the engine's id).
    #[serde(default)]
    pub owned_by: String,
    /// fak's extension (as vLLM's `max_model_len`): the context window, tokens; 0 when
    /// the engine does not know it.
    #[serde(default)]
    pub context_length: u64,
    /// vLLM's extension: the context window, tokens (read from an upstream; fak writes
    /// [`Model::context_length`] instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u64>,
}

impl Model {
    /// The context window the entry states, tokens: `context_length` (fak), else
    /// `max_model_len` (vLLM), else 0 (unknown).
    pub fn window(&self) -> u64 {
        if self.context_length > 0 {
            self.context_length
        } else {
            self.max_model_len.unwrap_or(0)
        }
    }
}

/// The model list (`GET /v1/models`). SDK: `SyncPage[Model]` (one page, no cursor).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelList {
    /// [`LIST_OBJECT`].
    #[serde(default)]
    pub object: String,
    /// The models.
    pub data: Vec<Model>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body with `field` set to `v` (raw JSON) for each generation request.
    fn bodies(field: &str, v: &str) -> [String; 2] {
        [
            format!(r#"{{"model": "m", "messages": [], "{field}": {v}}}"#),
            format!(r#"{{"model": "m", "prompt": "p", "{field}": {v}}}"#),
        ]
    }

    /// The parse error of `body` as `T`, as the gateway words it: the path
    /// `serde_path_to_error` finds (none: `.`), then the message.
    fn error<T: serde::de::DeserializeOwned + fmt::Debug>(body: &str) -> String {
        let de = &mut serde_json::Deserializer::from_str(body);
        let e = serde_path_to_error::deserialize::<_, T>(de).unwrap_err();
        format!("{}: {}", e.path(), e.inner())
    }

    fn errors(field: &str, v: &str) -> [String; 2] {
        let [chat, completion] = bodies(field, v);
        [
            error::<ChatCompletionRequest>(&chat),
            error::<CompletionRequest>(&completion),
        ]
    }

    #[test]
    fn a_sampling_field_of_the_wrong_type_is_named_on_both_requests() {
        for (field, v) in [
            ("max_tokens", r#""many""#),
            ("temperature", r#""hot""#),
            ("top_p", "[]"),
            ("seed", "1.5"),
            ("stop", "3"),
            ("stop", r#"["a", 1]"#),
            ("n", "{}"),
            ("top_k", r#""x""#),
            ("min_p", "true"),
            ("repetition_penalty", r#""1""#),
        ] {
            for e in errors(field, v) {
                // By the path (`stop[1]: ...`), or, under `flatten`, by the message.
                let named = e
                    .strip_prefix(".: ")
                    .unwrap_or(&e)
                    .strip_prefix(field)
                    .is_some_and(|r| r.starts_with([':', '[']));
                assert!(named, "{field} = {v}: {e}");
            }
        }
    }

    #[test]
    fn an_error_inside_a_stop_list_names_the_element() {
        // Under `flatten` the path is the top (`.`); the message carries the rest.
        for e in errors("stop", r#"["a", 5]"#) {
            assert!(
                e.starts_with(".: stop[1]: invalid type: integer `5`, expected a string"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_sampling_field_given_twice_is_named() {
        for (field, v) in [("temperature", "0.5"), ("top_k", "3")] {
            for body in bodies(field, v) {
                let body = body.replace('}', &format!(r#", "{field}": {v}}}"#));
                let e = match body.contains("prompt") {
                    true => serde_json::from_str::<CompletionRequest>(&body).map(|_| ()),
                    false => serde_json::from_str::<ChatCompletionRequest>(&body).map(|_| ()),
                }
                .unwrap_err()
                .to_string();
                assert!(e.contains(&format!("duplicate field `{field}`")), "{e}");
            }
        }
    }

    #[test]
    fn both_requests_read_the_same_sampling_params_and_write_them_flat() {
        let fields = r#""max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
            "stop": ["x", "y"], "n": 1, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.1,
            "user": "u", "frequency_penalty": 0"#;
        let chat: ChatCompletionRequest =
            serde_json::from_str(&format!(r#"{{"model": "m", "messages": [], {fields}}}"#))
                .unwrap();
        let completion: CompletionRequest =
            serde_json::from_str(&format!(r#"{{"model": "m", "prompt": "p", {fields}}}"#)).unwrap();
        let want = SamplingParams {
            max_tokens: Some(7),
            temperature: Some(0.5),
            top_p: Some(0.9),
            seed: Some(3),
            stop: Some(Stop::Many(vec!["x".into(), "y".into()])),
            n: Some(1),
            extensions: SamplingExtensions {
                top_k: Some(4),
                min_p: Some(0.1),
                repetition_penalty: Some(1.1),
            },
        };
        assert_eq!(chat.sampling, want);
        assert_eq!(completion.sampling, want);
        // The other flattened parts still get their fields.
        assert_eq!(chat.ignored.user.as_deref(), Some("u"));
        assert_eq!(completion.neutral.frequency_penalty, Some(0.0));
        // Written flat, as the API has them, and read back the same.
        let v = serde_json::to_value(&chat).unwrap();
        assert_eq!(v["temperature"], 0.5);
        assert_eq!(v["top_k"], 4);
        assert!(
            v.get("sampling").is_none() && v.get("extensions").is_none(),
            "{v}"
        );
        let back: ChatCompletionRequest = serde_json::from_value(v).unwrap();
        assert_eq!(back, chat);
    }

    #[test]
    fn prompt_forms_parse_and_bad_ids_are_named() {
        let p = |s: &str| serde_json::from_str::<CompletionPrompt>(s);
        assert_eq!(p("\"hi\"").unwrap(), CompletionPrompt::Text("hi".into()));
        assert_eq!(p("[1, 2]").unwrap(), CompletionPrompt::Tokens(vec![1, 2]));
        assert_eq!(
            p("[[1], [2, 3]]").unwrap(),
            CompletionPrompt::TokenLists(vec![vec![1], vec![2, 3]])
        );
        assert_eq!(
            p("[\"a\", \"b\"]").unwrap(),
            CompletionPrompt::Texts(vec!["a".into(), "b".into()])
        );
        let e = p("[1, -2]").unwrap_err().to_string();
        assert!(e.contains("prompt[1] is -2"), "{e}");
        let e = p("[[1], [2, 5000000000]]").unwrap_err().to_string();
        assert!(e.contains("prompt[1][1] is 5000000000"), "{e}");
        let e = p("[1, \"a\"]").unwrap_err().to_string();
        assert!(e.contains("prompt[1]") && e.contains("mix"), "{e}");
        let e = p("[1.5]").unwrap_err().to_string();
        assert!(e.contains("prompt[0] is 1.5"), "{e}");
    }

    #[test]
    fn server_errors_read_in_each_servers_shape() {
        let text = |s: &str| {
            serde_json::from_str::<ServerError>(s)
                .unwrap()
                .text()
                .map(str::to_string)
        };
        // vLLM: the error object with its `object` and an integer `code`.
        let e: ErrorResponse = serde_json::from_str(
            r#"{"error": {"object": "error", "message": "bad", "type": "BadRequestError", "param": null, "code": 400}}"#,
        )
        .unwrap();
        assert_eq!(e.error.code.as_deref(), Some("400"));
        // Anthropic's error body (API reference, "Errors").
        assert_eq!(
            text(r#"{"type": "error", "error": {"type": "not_found_error", "message": "The requested resource could not be found."}}"#).as_deref(),
            Some("The requested resource could not be found.")
        );
        // FastAPI's 404 and its validation list (no message in it).
        assert_eq!(
            text(r#"{"detail": "Not Found"}"#).as_deref(),
            Some("Not Found")
        );
        assert_eq!(text(r#"{"detail": [{"loc": ["body"], "msg": "x"}]}"#), None);
        assert_eq!(text(r#"{"error": "boom"}"#).as_deref(), Some("boom"));
    }

    #[test]
    fn legacy_logprobs_take_nulls_and_unknown_finish_reasons_read_as_other() {
        // vLLM's CompletionLogProbs: `token_logprobs: list[Optional[float]]`,
        // `top_logprobs: list[Optional[dict[str, float]]]` (the first echoed prompt
        // token has neither).
        let c: Completion = serde_json::from_str(
            r#"{"choices": [{"index": 0, "text": "a b", "finish_reason": "abort", "logprobs": {"tokens": ["a", " b"], "token_logprobs": [null, -0.5], "top_logprobs": [null, {" b": -0.5}], "text_offset": [0, 1]}}]}"#,
        )
        .unwrap();
        let lp = c.choices[0].logprobs.as_ref().unwrap();
        assert_eq!(lp.token_logprobs, vec![f64::NEG_INFINITY, -0.5]);
        assert!(lp.top_logprobs[0].is_empty() && lp.top_logprobs[1][" b"] == -0.5);
        assert_eq!(c.choices[0].finish_reason, Some(FinishReason::Other));
    }

    #[test]
    fn chunk_usage_is_absent_null_or_set() {
        let mut c = ChatCompletionChunk {
            id: "c".into(),
            object: CHAT_COMPLETION_CHUNK_OBJECT.into(),
            created: 1,
            model: "m".into(),
            system_fingerprint: None,
            choices: Vec::new(),
            usage: None,
            fak: None,
        };
        let v = serde_json::to_value(&c).unwrap();
        assert!(v.get("usage").is_none(), "{v}");
        c.usage = Some(None);
        let v = serde_json::to_value(&c).unwrap();
        assert!(v.get("usage").is_some_and(Value::is_null), "{v}");
        c.usage = Some(Some(Usage::new(3, 2, 1)));
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["usage"]["total_tokens"], 5);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
    }
}
