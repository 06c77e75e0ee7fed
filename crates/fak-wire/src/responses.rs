//! The OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`): the
//! request, the Response object and the stream events, as the official `openai` Python
//! SDK (3.57) types them in `openai/types/responses/` — `response_create_params.py`
//! ([`CreateResponse`]), `response_input_item_param.py` ([`InputItem`]), `response.py`
//! ([`Response`]), `response_output_item.py` ([`OutputItem`]), `response_usage.py`
//! ([`Usage`]), `function_tool_param.py` ([`FunctionTool`]) and
//! `response_stream_event.py` with its event files ([`StreamEvent`]).
//!
//! Parsing is permissive where the API is wide: an input item, content part, tool or
//! `tool_choice` of a kind fak does not serve parses into an `Unsupported` variant
//! carrying its `type`, so the server can answer a 400 that names it and where it is,
//! instead of a generic parse error.
//!
//! **Fields accepted but not acted on** ([`CreateResponse::INERT`]): `metadata`, `user`,
//! `safety_identifier`, `service_tier`, `prompt_cache_key`, `prompt_cache_retention`,
//! `prompt_cache_options`, `stream_options`, `parallel_tool_calls` (several calls per
//! reply are always allowed), `reasoning` (no served model reasons; no reasoning items are
//! produced), `include` (fak has no encrypted reasoning or hosted-tool outputs
//! to include), `text.verbosity`, a function tool's `strict` beyond its use by the
//! in-kernel call grammar (a schema it cannot constrain is a 400 for a strict tool; a
//! call whose arguments break its schema is denied `MALFORMED` by the boundary either
//! way), and `reasoning` input
//! items (dropped: they carry no text a non-reasoning model can use). `truncation`
//! is acted on by the in-kernel engine: `auto` drops the oldest whole turns of a
//! conversation over the window (fak's `context_overflow: rebuild`, exact),
//! `disabled` refuses it, absent is the server's `--context-overflow`. Every other field
//! that would change the output (`background`, `conversation`, `prompt`,
//! `max_tool_calls`, `top_logprobs` other than 0, `context_management`, …) is refused
//! with a 400 naming it; an unknown field too
//! ([`CreateResponse::other`]).

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// `POST /v1/responses` body (`ResponseCreateParamsBase`, plus `stream`).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CreateResponse {
    /// Model id. Required by the API; an `Option` so that the gateway can answer a
    /// request without one with the API's own 400 (`missing_required_parameter`).
    pub model: Option<String>,
    /// The input: a string (one user message) or a list of items.
    pub input: Option<Input>,
    /// A system (developer) message put first. Not carried over from a
    /// `previous_response_id`'s response (as the API documents).
    pub instructions: Option<String>,
    /// Tools the model may call; only `function` tools are served.
    pub tools: Option<Vec<Tool>>,
    /// Which tools the model may or must call.
    pub tool_choice: Option<ToolChoice>,
    /// Continue the conversation of this kept response.
    pub previous_response_id: Option<String>,
    /// Whether the response is kept for `previous_response_id` / `GET` (default true).
    pub store: Option<bool>,
    /// Stream server-sent events ([`StreamEvent`]).
    pub stream: Option<bool>,
    /// Most output tokens (at least 1); reaching it ends the response `incomplete`.
    pub max_output_tokens: Option<i64>,
    /// Sampling temperature (default 1; 0 is greedy).
    pub temperature: Option<f32>,
    /// Nucleus sampling mass (default 1).
    pub top_p: Option<f32>,
    /// Inert (see the module docs).
    pub parallel_tool_calls: Option<bool>,
    /// Inert: up to 16 string pairs, echoed in the Response.
    pub metadata: Option<BTreeMap<String, String>>,
    /// Output text format: plain text (the default), `json_schema` or `json_object`
    /// ([`TextFormat`]).
    pub text: Option<TextConfig>,
    /// Inert (see the module docs).
    pub reasoning: Option<Value>,
    /// Inert: `auto` or `disabled`.
    pub truncation: Option<String>,
    /// Inert (see the module docs).
    pub include: Option<Vec<String>>,
    /// Inert: the end user's id.
    pub user: Option<String>,
    /// vLLM's prefix-cache salt (fak's extension on every generation route): only
    /// requests with the same salt (and API key) share a cached prefix or a kept response.
    pub cache_salt: Option<String>,
    /// Every other field, by name: those in [`CreateResponse::INERT`] are accepted, the
    /// rest refused unless `null`.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

impl CreateResponse {
    /// Fields of the API that fak accepts in [`CreateResponse::other`] without acting on
    /// them (see the module docs for why each changes nothing here).
    pub const INERT: &'static [&'static str] = &[
        "safety_identifier",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "stream_options",
    ];

    /// The first field of [`CreateResponse::other`] that fak does not serve (not inert,
    /// not `null`; `top_logprobs: 0` and `background: false` count as absent), with its
    /// value.
    pub fn unsupported_field(&self) -> Option<(&str, &Value)> {
        self.other
            .iter()
            .map(|(k, v)| (k.as_str(), v))
            .find(|(k, v)| {
                let neutral = match *k {
                    "top_logprobs" => v.as_u64() == Some(0),
                    "background" => v.as_bool() == Some(false),
                    _ => false,
                };
                !(v.is_null() || neutral || Self::INERT.contains(k))
            })
    }
}

/// `input`: a string (one user message) or a list of items. Anything else is an error
/// saying so; an item's own error names the item (`input[2]`).
#[derive(Clone, Debug)]
pub enum Input {
    /// One user message.
    Text(String),
    /// Conversation items, in order.
    Items(Vec<InputItem>),
}

impl<'de> Deserialize<'de> for Input {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::de::str_or_seq(
            d,
            "a string or an array of input items",
            Input::Text,
            Input::Items,
        )
    }
}

/// One input item (`ResponseInputItemParam`). An item without `type` is a message
/// (`EasyInputMessageParam`).
#[derive(Clone, Debug, PartialEq)]
pub enum InputItem {
    /// `message` (`EasyInputMessageParam`, `Message`, or an earlier output's
    /// `ResponseOutputMessageParam`).
    Message(MessageItem),
    /// `function_call`: a call the model made earlier (`ResponseFunctionToolCallParam`).
    FunctionCall(FunctionCall),
    /// `function_call_output`: a tool's result (`FunctionCallOutput`).
    FunctionCallOutput(FunctionCallOutput),
    /// `reasoning`: accepted and dropped (see the module docs).
    Reasoning,
    /// Any other item type (hosted tools' calls, `item_reference`, …), by its `type`.
    Unsupported(String),
}

impl<'de> Deserialize<'de> for InputItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Map::<String, Value>::deserialize(d)?;
        let kind = match v.get("type") {
            None | Some(Value::Null) => "message".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(t) => {
                return Err(D::Error::custom(format!(
                    "input item type {t} is not a string"
                )))
            }
        };
        let obj = Value::Object(v);
        fn typed<T: serde::de::DeserializeOwned, E: serde::de::Error>(
            what: &str,
            obj: Value,
        ) -> Result<T, E> {
            serde_json::from_value(obj).map_err(|e| E::custom(format!("{what} item: {e}")))
        }
        Ok(match kind.as_str() {
            "message" => InputItem::Message(typed("message", obj)?),
            "function_call" => InputItem::FunctionCall(typed("function_call", obj)?),
            "function_call_output" => {
                InputItem::FunctionCallOutput(typed("function_call_output", obj)?)
            }
            "reasoning" => InputItem::Reasoning,
            _ => InputItem::Unsupported(kind),
        })
    }
}

/// A message item's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The user.
    User,
    /// Instructions (as `developer`).
    System,
    /// Instructions.
    Developer,
    /// An earlier reply of the model.
    Assistant,
}

/// A `message` input item.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct MessageItem {
    /// Who wrote it.
    pub role: Role,
    /// Its text, or a list of parts.
    pub content: MessageContent,
    /// An earlier output message's id (ignored).
    pub id: Option<String>,
}

/// A message's `content`: a string or a list of content parts (anything else is an
/// error saying so).
#[derive(Clone, Debug, PartialEq)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::de::str_or_seq(
            d,
            "a string or an array of content parts",
            MessageContent::Text,
            MessageContent::Parts,
        )
    }
}

/// One content part of a message (`ResponseInputContentParam` / an output message's
/// `Content`).
#[derive(Clone, Debug, PartialEq)]
pub enum ContentPart {
    /// `input_text` or `output_text`: text.
    Text(String),
    /// `refusal`: an earlier refusal's text.
    Refusal(String),
    /// Any other part (`input_image`, `input_file`, `input_audio`, …), by its `type`.
    Unsupported(String),
}

impl<'de> Deserialize<'de> for ContentPart {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Raw {
            #[serde(rename = "type")]
            kind: String,
            text: Option<String>,
            refusal: Option<String>,
        }
        let r = Raw::deserialize(d)?;
        match r.kind.as_str() {
            "input_text" | "output_text" | "text" => r
                .text
                .map(ContentPart::Text)
                .ok_or_else(|| D::Error::custom(format!("a {} part without `text`", r.kind))),
            "refusal" => r
                .refusal
                .map(ContentPart::Refusal)
                .ok_or_else(|| D::Error::custom("a refusal part without `refusal`")),
            _ => Ok(ContentPart::Unsupported(r.kind)),
        }
    }
}

/// A `function_call` item: in a request, a call the model made earlier; in a
/// [`Response`], a call the model makes now (`ResponseFunctionToolCall`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct FunctionCall {
    /// The item's id (`fc_…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The call's id, which its `function_call_output` names.
    pub call_id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments, a JSON object as text.
    pub arguments: String,
    /// `in_progress`, `completed` or `incomplete`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ItemStatus>,
}

/// A `function_call_output` item: a tool's result.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct FunctionCallOutput {
    /// The call it answers.
    pub call_id: String,
    /// The result: text, or parts of which only text is served.
    pub output: MessageContent,
}

/// A tool of a request (`ToolParam`).
#[derive(Clone, Debug, PartialEq)]
pub enum Tool {
    /// `function`.
    Function(FunctionTool),
    /// Any other tool type (`web_search`, `file_search`, `mcp`, …), by its `type`.
    Unsupported(String),
}

impl<'de> Deserialize<'de> for Tool {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Map::<String, Value>::deserialize(d)?;
        match v.get("type").and_then(Value::as_str) {
            Some("function") => serde_json::from_value(Value::Object(v))
                .map(Tool::Function)
                .map_err(|e| D::Error::custom(format!("function tool: {e}"))),
            Some(other) => Ok(Tool::Unsupported(other.to_string())),
            None => Err(D::Error::custom("a tool without a string `type`")),
        }
    }
}

impl Serialize for Tool {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Tool::Function(f) => f.serialize(s),
            Tool::Unsupported(k) => TypeOnly { kind: k }.serialize(s),
        }
    }
}

/// `{"type": KIND}`.
#[derive(Serialize)]
struct TypeOnly<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
}

/// A function tool (`FunctionToolParam`, `type: "function"`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct FunctionTool {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: FunctionType,
    /// The name the model calls it by.
    pub name: String,
    /// What it does, for the model.
    #[serde(default)]
    pub description: Option<String>,
    /// JSON Schema of its arguments (`None`: no arguments).
    #[serde(default)]
    pub parameters: Option<Map<String, Value>>,
    /// Strict schema adherence: as Chat Completions' `function.strict` (see the module
    /// docs).
    #[serde(default)]
    pub strict: Option<bool>,
}

/// The word `function`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum FunctionType {
    /// `function`.
    #[default]
    #[serde(rename = "function")]
    Function,
}

/// `tool_choice` (`ToolChoiceOptions` or `ToolChoiceFunctionParam`).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ToolChoice {
    /// `none`: no calls.
    None,
    /// `auto` (the default).
    #[default]
    Auto,
    /// `required`: the reply must be a call.
    Required,
    /// `{"type": "function", "name": NAME}`: the reply must call NAME.
    Function(String),
    /// Any other form (`allowed_tools`, a hosted tool, …), by its `type` (or the word).
    Unsupported(String),
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Value::deserialize(d)? {
            Value::String(w) => match w.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                _ => ToolChoice::Unsupported(w),
            },
            Value::Object(m) => match (m.get("type").and_then(Value::as_str), m.get("name")) {
                (Some("function"), Some(Value::String(n))) => ToolChoice::Function(n.clone()),
                (Some(t), _) => ToolChoice::Unsupported(t.to_string()),
                (None, _) => return Err(D::Error::custom("tool_choice object without a `type`")),
            },
            other => {
                return Err(D::Error::custom(format!(
                    "tool_choice {other} is neither a word nor an object"
                )))
            }
        })
    }
}

impl Serialize for ToolChoice {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Named<'a> {
            #[serde(rename = "type")]
            kind: &'static str,
            name: &'a str,
        }
        match self {
            ToolChoice::None => s.serialize_str("none"),
            ToolChoice::Auto => s.serialize_str("auto"),
            ToolChoice::Required => s.serialize_str("required"),
            ToolChoice::Function(n) => Named {
                kind: "function",
                name: n,
            }
            .serialize(s),
            ToolChoice::Unsupported(k) => s.serialize_str(k),
        }
    }
}

/// `text` (`ResponseTextConfigParam`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct TextConfig {
    /// The output format; `None` is plain text.
    #[serde(default)]
    pub format: Option<TextFormat>,
    /// Inert (see the module docs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<String>,
}

/// `text.format` (SDK: `ResponseFormatTextConfigParam`, a union of
/// `ResponseFormatTextParam`, `ResponseFormatTextJSONSchemaConfigParam` and
/// `ResponseFormatJSONObjectParam`): plain text, a JSON value valid for a schema (what
/// the SDK's `responses.parse(text_format=Model)` sends), or any JSON object. Another
/// `type` does not parse (a 400 naming the accepted ones).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TextFormat {
    /// Free text (the default).
    Text,
    /// JSON valid for a schema.
    JsonSchema(JsonSchemaTextFormat),
    /// Any JSON object (JSON mode).
    JsonObject,
}

/// `text.format` of type `json_schema` (SDK: `ResponseFormatTextJSONSchemaConfigParam`).
/// Unlike Chat Completions' `response_format`, the fields sit beside `type`, not under
/// a `json_schema` key.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct JsonSchemaTextFormat {
    /// The format's name (the API takes `[a-zA-Z0-9_-]`, at most 64).
    pub name: String,
    /// The JSON Schema, an object.
    pub schema: Map<String, Value>,
    /// What the format is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Strict adherence (fak enforces the schema whether set or not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

impl TextConfig {
    /// Plain text, as a Response echoes it when the request named no format.
    pub fn plain() -> Self {
        TextConfig {
            format: Some(TextFormat::Text),
            verbosity: None,
        }
    }
}

/// A Response's, item's or message's status (`ResponseStatus`; items use the first
/// three).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemStatus {
    /// Still being generated (stream events before the end).
    InProgress,
    /// Finished.
    Completed,
    /// Ended early (`max_output_tokens`).
    Incomplete,
    /// Failed (a Response only; see [`Response::error`]).
    Failed,
}

/// The Response object (`openai.types.responses.Response`), `object: "response"`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct Response {
    /// `resp_…`.
    pub id: String,
    /// Always `response`.
    pub object: ResponseObject,
    /// Unix seconds.
    pub created_at: u64,
    /// `in_progress` (stream events before the end), `completed`, `incomplete` or
    /// `failed`.
    pub status: ItemStatus,
    /// The model that answered (as the request named it).
    pub model: String,
    /// The output items in order: at most one message, then the allowed function calls.
    pub output: Vec<OutputItem>,
    /// Token counts (`None` until the end of a stream).
    pub usage: Option<Usage>,
    /// Why the response is `incomplete`.
    pub incomplete_details: Option<IncompleteDetails>,
    /// Why the response `failed`.
    pub error: Option<ResponseError>,
    /// Echoed request fields.
    pub instructions: Option<String>,
    /// Echoed.
    pub max_output_tokens: Option<u64>,
    /// Echoed (empty when not given).
    pub metadata: BTreeMap<String, String>,
    /// Echoed (default true).
    pub parallel_tool_calls: bool,
    /// Echoed.
    pub previous_response_id: Option<String>,
    /// Echoed (default true): whether the response is kept.
    pub store: bool,
    /// Echoed (default 1).
    pub temperature: f32,
    /// Echoed (default 1).
    pub top_p: f32,
    /// Echoed (default `auto`).
    pub tool_choice: ToolChoice,
    /// Echoed function tools.
    pub tools: Vec<FunctionTool>,
    /// Echoed (`{"format": {"type": "text"}}` when the request named none).
    pub text: TextConfig,
    /// Echoed (default `disabled`).
    pub truncation: String,
    /// Echoed.
    pub user: Option<String>,
    /// Echoed.
    pub reasoning: Option<Value>,
    /// fak's extension: the boundary's verdicts on this response's proposed calls and
    /// the request's screened tool results (see fak-gateway's `tools` module); absent
    /// when there is nothing to say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fak: Option<Value>,
}

/// The word `response`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum ResponseObject {
    /// `response`.
    #[default]
    #[serde(rename = "response")]
    Response,
}

/// An output item (`ResponseOutputItem`: the two kinds fak produces).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// `message` (`ResponseOutputMessage`).
    Message(OutputMessage),
    /// `function_call` (`ResponseFunctionToolCall`).
    FunctionCall(FunctionCall),
}

/// An output message (`ResponseOutputMessage`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct OutputMessage {
    /// `msg_…`.
    pub id: String,
    /// Always `assistant`.
    pub role: Role,
    /// `in_progress`, `completed` or `incomplete`.
    pub status: ItemStatus,
    /// Its text parts (one).
    pub content: Vec<OutputText>,
}

/// An `output_text` part (`ResponseOutputText`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct OutputText {
    /// Always `output_text`.
    #[serde(rename = "type")]
    pub kind: OutputTextType,
    /// The text.
    pub text: String,
    /// Citations; fak has none (always empty).
    pub annotations: Vec<Value>,
}

/// The word `output_text`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum OutputTextType {
    /// `output_text`.
    #[default]
    #[serde(rename = "output_text")]
    OutputText,
}

impl OutputText {
    /// An `output_text` part with `text`.
    pub fn new(text: impl Into<String>) -> Self {
        OutputText {
            kind: OutputTextType::OutputText,
            text: text.into(),
            annotations: Vec::new(),
        }
    }
}

/// `usage` (`ResponseUsage`), tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct Usage {
    /// Prompt tokens after templating.
    pub input_tokens: usize,
    /// Of those, cached.
    pub input_tokens_details: InputTokensDetails,
    /// Generated tokens (including a final stop token).
    pub output_tokens: usize,
    /// Of those, reasoning (always 0).
    pub output_tokens_details: OutputTokensDetails,
    /// `input_tokens + output_tokens`.
    pub total_tokens: usize,
}

impl Usage {
    /// The usage of `input` prompt tokens (`cached` of them read from the KV cache) and
    /// `output` generated ones.
    pub fn new(input: usize, cached: usize, output: usize) -> Self {
        Usage {
            input_tokens: input,
            input_tokens_details: InputTokensDetails {
                cached_tokens: cached,
                cache_write_tokens: 0,
            },
            output_tokens: output,
            output_tokens_details: OutputTokensDetails::default(),
            total_tokens: input + output,
        }
    }
}

/// `usage.input_tokens_details`, tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct InputTokensDetails {
    /// Prompt tokens whose KV entries were reused from an earlier request.
    pub cached_tokens: usize,
    /// Tokens written to a prompt cache on request (fak: always 0; its KV reuse is
    /// implicit).
    #[serde(default)]
    pub cache_write_tokens: usize,
}

/// `usage.output_tokens_details`, tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct OutputTokensDetails {
    /// Reasoning tokens (always 0).
    pub reasoning_tokens: usize,
}

/// `incomplete_details`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct IncompleteDetails {
    /// `max_output_tokens` (the limit, or the end of the context window).
    pub reason: String,
}

/// `error` of a failed Response (`ResponseError`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct ResponseError {
    /// `server_error` for an engine failure.
    pub code: String,
    /// What went wrong.
    pub message: String,
}

/// The server-sent events of a streamed Response (`ResponseStreamEvent`: the kinds fak
/// sends), each with its `sequence_number` (0, 1, 2, … within a stream). The SSE
/// `event:` name is the same as `type` ([`StreamEvent::kind`]).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(tag = "type")]
pub enum StreamEvent {
    /// The Response, `in_progress`, no output yet.
    #[serde(rename = "response.created")]
    Created {
        /// The response so far.
        response: Box<Response>,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// As `Created`.
    #[serde(rename = "response.in_progress")]
    InProgress {
        /// The response so far.
        response: Box<Response>,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// An output item starts (`in_progress`; a message with no content yet, a call with
    /// empty arguments).
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        /// The item so far.
        item: OutputItem,
        /// Its index in `output`.
        output_index: usize,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// A message's text part starts (empty).
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        /// The message's id.
        item_id: String,
        /// The message's index in `output`.
        output_index: usize,
        /// The part's index in the message's `content`.
        content_index: usize,
        /// The part so far.
        part: OutputText,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// More text of a part.
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        /// The message's id.
        item_id: String,
        /// The message's index in `output`.
        output_index: usize,
        /// The part's index.
        content_index: usize,
        /// The new text.
        delta: String,
        /// Token logprobs (fak sends none here).
        logprobs: Vec<Value>,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// A part's whole text.
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        /// The message's id.
        item_id: String,
        /// The message's index in `output`.
        output_index: usize,
        /// The part's index.
        content_index: usize,
        /// The whole text.
        text: String,
        /// Token logprobs (fak sends none here).
        logprobs: Vec<Value>,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// A part is finished.
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        /// The message's id.
        item_id: String,
        /// The message's index in `output`.
        output_index: usize,
        /// The part's index.
        content_index: usize,
        /// The whole part.
        part: OutputText,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// A call's arguments (fak sends them whole, once the call is adjudicated).
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        /// The call item's id.
        item_id: String,
        /// The item's index in `output`.
        output_index: usize,
        /// The arguments text.
        delta: String,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// A call's whole arguments.
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        /// The call item's id.
        item_id: String,
        /// The item's index in `output`.
        output_index: usize,
        /// The whole arguments text.
        arguments: String,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// An output item is finished (as it appears in the final `output`).
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        /// The whole item.
        item: OutputItem,
        /// Its index in `output`.
        output_index: usize,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// The end: the whole Response, `completed`.
    #[serde(rename = "response.completed")]
    Completed {
        /// The whole response.
        response: Box<Response>,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// The end: the whole Response, `incomplete`.
    #[serde(rename = "response.incomplete")]
    Incomplete {
        /// The whole response.
        response: Box<Response>,
        /// Position in the stream.
        sequence_number: u64,
    },
    /// The end: the Response, `failed`, with its `error`.
    #[serde(rename = "response.failed")]
    Failed {
        /// The response, with its error.
        response: Box<Response>,
        /// Position in the stream.
        sequence_number: u64,
    },
}

impl StreamEvent {
    /// The event's `type` (also its SSE `event:` name).
    pub fn kind(&self) -> &'static str {
        match self {
            StreamEvent::Created { .. } => "response.created",
            StreamEvent::InProgress { .. } => "response.in_progress",
            StreamEvent::OutputItemAdded { .. } => "response.output_item.added",
            StreamEvent::ContentPartAdded { .. } => "response.content_part.added",
            StreamEvent::OutputTextDelta { .. } => "response.output_text.delta",
            StreamEvent::OutputTextDone { .. } => "response.output_text.done",
            StreamEvent::ContentPartDone { .. } => "response.content_part.done",
            StreamEvent::FunctionCallArgumentsDelta { .. } => {
                "response.function_call_arguments.delta"
            }
            StreamEvent::FunctionCallArgumentsDone { .. } => {
                "response.function_call_arguments.done"
            }
            StreamEvent::OutputItemDone { .. } => "response.output_item.done",
            StreamEvent::Completed { .. } => "response.completed",
            StreamEvent::Incomplete { .. } => "response.incomplete",
            StreamEvent::Failed { .. } => "response.failed",
        }
    }
}

/// `DELETE /v1/responses/{id}`'s answer (`ResponseDeleted`-like: `{id, object:
/// "response", deleted: true}`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct Deleted {
    /// The deleted response's id.
    pub id: String,
    /// Always `response`.
    pub object: ResponseObject,
    /// Always true.
    pub deleted: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn input_items_parse_by_type_and_name_what_is_not_served() {
        let r: CreateResponse = serde_json::from_value(json!({
            "model": "m",
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "yo", "annotations": []}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "web_search_call", "id": "ws"},
                {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": null, "strict": true},
                      {"type": "web_search"}],
            "tool_choice": {"type": "function", "name": "f"},
            "prompt_cache_key": "k",
            "background": true,
        }))
        .unwrap();
        let Some(Input::Items(items)) = &r.input else {
            panic!("items")
        };
        assert!(matches!(&items[0], InputItem::Message(m) if m.role == Role::User));
        assert!(matches!(&items[2], InputItem::FunctionCall(c) if c.call_id == "c1"));
        assert!(
            matches!(&items[3], InputItem::FunctionCallOutput(o) if o.output == MessageContent::Text("42".into()))
        );
        assert_eq!(items[4], InputItem::Reasoning);
        assert_eq!(items[5], InputItem::Unsupported("web_search_call".into()));
        assert!(matches!(&items[6], InputItem::Message(m)
            if m.content == MessageContent::Parts(vec![ContentPart::Unsupported("input_image".into())])));
        assert!(
            matches!(r.tools.as_deref(), Some([Tool::Function(_), Tool::Unsupported(k)]) if k == "web_search")
        );
        assert_eq!(r.tool_choice, Some(ToolChoice::Function("f".into())));
        // prompt_cache_key is inert; background: true is not.
        assert_eq!(r.unsupported_field().map(|(k, _)| k), Some("background"));
    }

    #[test]
    fn stream_events_carry_their_type() {
        let e = StreamEvent::OutputTextDelta {
            item_id: "msg".into(),
            output_index: 0,
            content_index: 0,
            delta: "a".into(),
            logprobs: Vec::new(),
            sequence_number: 3,
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["type"], e.kind());
        assert_eq!(v["sequence_number"], 3);
    }
}
