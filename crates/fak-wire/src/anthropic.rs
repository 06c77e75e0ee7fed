//! The Anthropic Messages API (`POST /v1/messages`), its token counting
//! (`POST /v1/messages/count_tokens`) and Models API (`GET /v1/models`), as serde types.
//!
//! Source: Anthropic's API reference and the `anthropic` Python SDK 2.14.0
//! (`anthropic/types/`): each type names the SDK type it follows. Request types follow
//! the SDK's `*Param` TypedDicts, response types its pydantic models.
//!
//! **Fields accepted and not acted on.** A request's fields that fak parses but that do
//! not change what it generates are listed in [`IGNORED_REQUEST_FIELDS`] (top level).
//! Inside content blocks, `cache_control` and `citations` are accepted and ignored (fak's
//! own prefix cache needs no markers). Every other top-level field lands in
//! [`CountTokensRequest::other`], which the server answers with a 400 naming the field
//! ([`CountTokensRequest::unsupported_field`]): a field fak does not know could change
//! the output, and a silently different answer is worse than a clear refusal.

use crate::de::Tagged;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// Top-level request fields accepted and ignored, each with why ignoring it leaves the
/// answer what the client asked for:
///
/// - `metadata` (`user_id`): an end-user id for abuse detection, no effect on output.
/// - `service_tier`, `speed`, `inference_geo`: capacity, latency and region choices.
/// - `cache_control`: a prompt-cache marker; fak reuses cached prefixes without one.
/// - `diagnostics`: asks for prompt-cache diagnostics, which fak does not produce.
/// - `context_management`: server-side clearing of old tool results (a beta); fak serves
///   the conversation as sent.
/// - `thinking`: extended thinking; the served models have no thinking mode, so the
///   reply is what they produce without one (no `thinking` blocks), as with `disabled`.
/// - `container`: the code-execution container of server tools, which fak does not
///   offer (a server tool in `tools` is a 400).
pub const IGNORED_REQUEST_FIELDS: &[&str] = &[
    "metadata",
    "service_tier",
    "speed",
    "inference_geo",
    "cache_control",
    "diagnostics",
    "context_management",
    "container",
];

/// A `POST /v1/messages` request (SDK: `MessageCreateParamsBase`).
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct MessagesRequest {
    /// Most tokens to generate (required; the real API takes 0 to only warm the cache,
    /// which fak refuses as it keeps no cache across requests by marker).
    pub max_tokens: i64,
    /// Whether to answer with server-sent [`StreamEvent`]s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Strings that end generation (the reply's `stop_reason` is then `stop_sequence`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_sequences: Option<Vec<String>>,
    /// Sampling temperature, 0 to 1 (the API's default is 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Top-k sampling (0 or absent: off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// vLLM's prefix-cache salt, taken on this wire too: only requests with the same
    /// salt (and API key) share a cached prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// fak's extension: what to do when the conversation outgrows the context window
    /// ([`crate::ContextOverflow`]; default: the server's `--context-overflow`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_overflow: Option<crate::ContextOverflow>,
    /// What is rendered into the prompt (shared with count_tokens).
    #[serde(flatten)]
    pub prompt: CountTokensRequest,
}

/// A `POST /v1/messages/count_tokens` request (SDK: `MessageCountTokensParams`): the
/// fields that make up the prompt. [`MessagesRequest`] holds these too.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct CountTokensRequest {
    /// The model id.
    pub model: String,
    /// The conversation (roles `user`, `assistant`, and `system` as this SDK allows).
    pub messages: Vec<MessageParam>,
    /// The system prompt: a string or text blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<SystemPrompt>,
    /// Tools the model may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    /// Which calls the model may or must make.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// Extended-thinking configuration (accepted, ignored: see [`IGNORED_REQUEST_FIELDS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<ThinkingConfig>,
    /// Structured-output and effort settings (SDK: `OutputConfigParam`): `format`
    /// constrains the reply to a JSON schema, `effort` is ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_config: Option<OutputConfig>,
    /// The structured-outputs beta's form of `output_config.format` (SDK:
    /// `anthropic.types.beta` `MessageCreateParams.output_format`, sent with
    /// `anthropic-beta: structured-outputs-2025-11-13`). Giving both is a 400.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_format: Option<JsonOutputFormat>,
    /// Every other top-level field: [`IGNORED_REQUEST_FIELDS`] or a 400.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

impl CountTokensRequest {
    /// The first field the server cannot honour, as a 400 message naming it, or `None`.
    pub fn unsupported_field(&self) -> Option<String> {
        if let Some(k) = self
            .other
            .keys()
            .find(|k| !IGNORED_REQUEST_FIELDS.contains(&k.as_str()))
        {
            // The Messages API has no seed; the server's is set at its start.
            let hint = if k == "seed" {
                "; `fak serve --seed N` fixes the sampling seed of requests that give none"
            } else {
                ""
            };
            return Some(format!(
                "`{k}` is not supported by this server (it would change the output){hint}"
            ));
        }
        if self.output_format.is_some() && self.output_config_format().is_some() {
            return Some("give `output_config.format` or `output_format`, not both".into());
        }
        None
    }

    /// The JSON output format asked for: `output_config.format`, or the beta's
    /// `output_format`; `None` for free text.
    pub fn output_format(&self) -> Option<&JsonOutputFormat> {
        self.output_config_format().or(self.output_format.as_ref())
    }

    fn output_config_format(&self) -> Option<&JsonOutputFormat> {
        self.output_config.as_ref().and_then(|o| o.format.as_ref())
    }
}

/// `output_config` (SDK: `OutputConfigParam`).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct OutputConfig {
    /// How much effort to spend (`low`, `medium`, `high`, ...): ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effort: Option<String>,
    /// The reply's JSON format (`null` or absent: free text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<JsonOutputFormat>,
}

/// A JSON output format (SDK: `JSONOutputFormatParam`, `{"type": "json_schema",
/// "schema": {...}}`): the reply's text is JSON valid for `schema`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct JsonOutputFormat {
    /// Always `json_schema`.
    #[serde(rename = "type")]
    pub kind: JsonSchemaType,
    /// The JSON Schema, an object.
    pub schema: serde_json::Map<String, Value>,
}

/// The word `json_schema`, the one output format type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JsonSchemaType {
    /// `json_schema`.
    JsonSchema,
}

/// A message's role (SDK: `MessageParam`, a union of `UserMessageParam`,
/// `AssistantMessageParam` and `SystemMessageParam`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The user (and tool results).
    User,
    /// The model (and its tool calls).
    Assistant,
    /// Instructions; servers merge these into the system turn in order.
    System,
}

impl Role {
    /// [`Role::Assistant`], a reply's role (serde's default for [`Message::role`]).
    pub fn assistant() -> Self {
        Role::Assistant
    }
}

/// One message of `messages`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct MessageParam {
    /// Who wrote it.
    pub role: Role,
    /// A string (one text block) or content blocks.
    pub content: MessageContent,
}

/// A message's `content`: a string is shorthand for one `text` block.
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// One text block's text.
    Text(String),
    /// Content blocks.
    Blocks(Vec<ContentBlockParam>),
}

impl MessageContent {
    /// Whether it holds nothing: an empty string or no blocks (the real API's 400).
    pub fn is_empty(&self) -> bool {
        match self {
            MessageContent::Text(t) => t.is_empty(),
            MessageContent::Blocks(b) => b.is_empty(),
        }
    }
}

/// The top-level `system`: a string or `text` blocks (SDK: `Union[str,
/// Iterable[TextBlockParam]]`).
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum SystemPrompt {
    /// The prompt.
    Text(String),
    /// Text blocks, concatenated.
    Blocks(Vec<TextBlockParam>),
}

impl SystemPrompt {
    /// The text: the string, or the blocks' texts concatenated.
    pub fn text(&self) -> String {
        match self {
            SystemPrompt::Text(t) => t.clone(),
            SystemPrompt::Blocks(b) => b.iter().map(|b| b.text.as_str()).collect(),
        }
    }
}

/// A `text` block (SDK: `TextBlockParam`; `cache_control` and `citations` ignored).
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct TextBlockParam {
    /// Always `text`.
    #[serde(rename = "type")]
    pub kind: TextType,
    /// The text.
    pub text: String,
}

/// The one-word `type` of a text block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum TextType {
    /// `text`.
    #[default]
    #[serde(rename = "text")]
    Text,
}

/// A content block of a request message (SDK: `ContentBlockParam`, and the blocks a
/// `tool_result`'s content may hold). Which blocks fak uses, and how, is the gateway's
/// business; here each is parsed.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlockParam {
    /// Text (SDK: `TextBlockParam`).
    Text {
        /// The text.
        text: String,
    },
    /// An image (SDK: `ImageBlockParam`): `source` is base64 data, a URL or a file id.
    Image {
        /// Where the image is.
        source: Value,
    },
    /// A document (SDK: `DocumentBlockParam`): a PDF, plain text or content blocks.
    Document {
        /// Where the document is.
        source: Value,
        /// Its title.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        title: Option<String>,
        /// Context about it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        context: Option<String>,
    },
    /// A search result (SDK: `SearchResultBlockParam`).
    SearchResult {
        /// Its text blocks.
        content: Vec<TextBlockParam>,
        /// Where it came from.
        source: String,
        /// Its title.
        title: String,
    },
    /// A tool call the assistant made (SDK: `ToolUseBlockParam`).
    ToolUse {
        /// The call's id (`toolu_...`), which its `tool_result` names.
        id: String,
        /// The tool.
        name: String,
        /// The arguments, a JSON object.
        input: Value,
    },
    /// A tool's result, in a user message (SDK: `ToolResultBlockParam`).
    ToolResult {
        /// The `id` of the `tool_use` it answers.
        tool_use_id: String,
        /// A string or blocks (text, image, document, search result); absent: empty.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        content: Option<ToolResultContent>,
        /// Whether the tool failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        is_error: Option<bool>,
    },
    /// The model's reasoning in an earlier turn (SDK: `ThinkingBlockParam`).
    Thinking {
        /// The reasoning.
        thinking: String,
        /// Its signature.
        #[serde(default)]
        signature: String,
    },
    /// Encrypted reasoning (SDK: `RedactedThinkingBlockParam`).
    RedactedThinking {
        /// The opaque data.
        data: String,
    },
    /// A server tool's call (SDK: `ServerToolUseBlockParam`).
    ServerToolUse {
        /// Its id.
        id: String,
        /// The server tool.
        name: String,
        /// Its arguments.
        input: Value,
    },
    /// A web search's result (SDK: `WebSearchToolResultBlockParam`).
    WebSearchToolResult {
        /// The `id` of the `server_tool_use` it answers.
        tool_use_id: String,
        /// The results or an error.
        content: Value,
    },
    /// A web fetch's result (SDK: `WebFetchToolResultBlockParam`).
    WebFetchToolResult {
        /// The `id` of the `server_tool_use` it answers.
        tool_use_id: String,
        /// The page or an error.
        content: Value,
    },
}

impl ContentBlockParam {
    /// The block's `type` word.
    pub fn type_name(&self) -> &'static str {
        match self {
            ContentBlockParam::Text { .. } => "text",
            ContentBlockParam::Image { .. } => "image",
            ContentBlockParam::Document { .. } => "document",
            ContentBlockParam::SearchResult { .. } => "search_result",
            ContentBlockParam::ToolUse { .. } => "tool_use",
            ContentBlockParam::ToolResult { .. } => "tool_result",
            ContentBlockParam::Thinking { .. } => "thinking",
            ContentBlockParam::RedactedThinking { .. } => "redacted_thinking",
            ContentBlockParam::ServerToolUse { .. } => "server_tool_use",
            ContentBlockParam::WebSearchToolResult { .. } => "web_search_tool_result",
            ContentBlockParam::WebFetchToolResult { .. } => "web_fetch_tool_result",
        }
    }
}

/// A `tool_result`'s `content`: a string, or blocks (SDK: `ToolResultBlockParam.content`).
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum ToolResultContent {
    /// The result as text.
    Text(String),
    /// The result as blocks.
    Blocks(Vec<ContentBlockParam>),
}

/// A tool definition (SDK: `ToolParam`; `cache_control`, `defer_loading`,
/// `input_examples`, `eager_input_streaming` ignored). A server tool (`type` other than
/// `custom`, e.g. `web_search_20250305`) parses too, for the server to refuse by name.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Tool {
    /// `custom` or absent for a client tool; a server tool's versioned type otherwise.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The tool's name.
    pub name: String,
    /// What it does, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema of its `input` (required for a client tool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<Value>,
    /// Strict schema adherence of the tool's name and `input` (SDK: `ToolParam.strict`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice` (SDK: `ToolChoiceParam`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides.
    Auto {
        /// At most one call per reply.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must call some tool.
    Any {
        /// Exactly one call per reply.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must call the named tool.
    Tool {
        /// The tool.
        name: String,
        /// Exactly one call per reply.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// No calls.
    None,
}

impl ToolChoice {
    /// Whether at most one call per reply was asked for.
    pub fn disable_parallel_tool_use(&self) -> bool {
        match self {
            ToolChoice::Auto {
                disable_parallel_tool_use,
            }
            | ToolChoice::Any {
                disable_parallel_tool_use,
            }
            | ToolChoice::Tool {
                disable_parallel_tool_use,
                ..
            } => disable_parallel_tool_use.unwrap_or(false),
            ToolChoice::None => false,
        }
    }
}

/// `thinking` (SDK: `ThinkingConfigParam`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ThinkingConfig {
    /// Think, with a budget in tokens (at least 1024 in the real API).
    Enabled {
        /// Tokens the reasoning may use (part of `max_tokens`).
        budget_tokens: i64,
    },
    /// No thinking.
    Disabled,
    /// The model decides.
    Adaptive,
}

/// The response of `POST /v1/messages` (SDK: `Message`), and the `message` of a
/// `message_start` event (with empty `content` and `stop_reason: null`).
///
/// Read from an upstream, only `content` is required (as fak's reader always needed
/// it); the other fields may be missing (empty, `assistant`, no counts) and fields the
/// API does not define are ignored. `content` blocks of types fak does not know are
/// [`ContentBlock::Unknown`].
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct Message {
    /// `msg_...`.
    #[serde(default)]
    pub id: String,
    /// Always `message`.
    #[serde(rename = "type", default)]
    pub kind: MessageType,
    /// Always `assistant`.
    #[serde(default = "Role::assistant")]
    pub role: Role,
    /// The model that answered.
    #[serde(default)]
    pub model: String,
    /// The reply's blocks.
    pub content: Vec<ContentBlock>,
    /// Why generation ended (`null` in `message_start`).
    #[serde(default)]
    pub stop_reason: Option<StopReason>,
    /// The stop sequence that ended it, if one did.
    #[serde(default)]
    pub stop_sequence: Option<String>,
    /// Token counts (all 0 when absent).
    #[serde(default)]
    pub usage: Usage,
    /// fak's extension: the boundary's verdicts on tool results and calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fak: Option<Value>,
}

/// The one-word `type` of a [`Message`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum MessageType {
    /// `message`.
    #[default]
    #[serde(rename = "message")]
    Message,
}

/// Why generation ended (SDK: `StopReason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model ended its turn.
    EndTurn,
    /// `max_tokens` (or the room left in the context) was reached.
    MaxTokens,
    /// A stop sequence was generated.
    StopSequence,
    /// The reply ends with tool calls.
    ToolUse,
    /// A long server-tool turn was paused.
    PauseTurn,
    /// The model refused.
    Refusal,
    /// The context window was filled.
    ModelContextWindowExceeded,
    /// A reason fak does not know, read from an upstream (the API adds reasons over
    /// time). Never written: serializing it is an error.
    #[serde(other, skip_serializing)]
    Unknown,
}

/// A block of a reply (SDK: `ContentBlock`: `TextBlock`, `ToolUseBlock`,
/// `ThinkingBlock`, `RedactedThinkingBlock`; the server tools' blocks are
/// [`ContentBlock::Unknown`]).
///
/// Read with [`Deserialize`] by its `type`: a known type's fields are checked (a field
/// of the wrong type is an error naming its path, see [`crate::error_path`]; fields the
/// SDK has and fak does not use, like a text block's `citations`, are ignored), an
/// unknown type is [`ContentBlock::Unknown`] whatever its fields.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// A tool call.
    ToolUse {
        /// `toolu_...`.
        id: String,
        /// The tool.
        name: String,
        /// The arguments, a JSON object (`{}` in a stream's `content_block_start`).
        input: Value,
    },
    /// Reasoning.
    Thinking {
        /// The reasoning.
        thinking: String,
        /// Its signature.
        signature: String,
    },
    /// Encrypted reasoning.
    RedactedThinking {
        /// The opaque data.
        data: String,
    },
    /// A block of a type fak does not know (`server_tool_use`, `web_search_tool_result`,
    /// and types the API adds later), read from an upstream and skipped.
    #[serde(skip_serializing)]
    Unknown(UnknownType),
}

/// The `type` word of a tagged value fak read but does not know (an upstream's
/// [`StreamEvent`], [`ContentBlock`] or [`BlockDelta`] of a type added to the API
/// later). Only reading makes one: its field is private, so the gateway cannot write an
/// `Unknown` variant, and serializing one is an error (serde's `skip_serializing`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownType {
    kind: String,
}

impl UnknownType {
    /// The `type` word as it came.
    pub fn type_name(&self) -> &str {
        &self.kind
    }
}

/// Token counts of a reply (SDK: `Usage`). `input_tokens` counts the prompt tokens
/// neither read from nor written to a cache; the prompt is the sum of the three.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct Usage {
    /// Prompt tokens not read from and not written to a cache (0 when absent).
    #[serde(default)]
    pub input_tokens: u64,
    /// Prompt tokens written to a cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_creation_input_tokens: Option<u64>,
    /// Prompt tokens read from a cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_input_tokens: Option<u64>,
    /// Generated tokens (0 when absent).
    #[serde(default)]
    pub output_tokens: u64,
}

impl Usage {
    /// Anthropic's split of a prompt of `prompt` tokens of which `cached` were read from
    /// and `created` written to a cache.
    pub fn split(prompt: usize, cached: usize, created: usize, output: usize) -> Self {
        Usage {
            input_tokens: prompt.saturating_sub(cached).saturating_sub(created) as u64,
            cache_creation_input_tokens: Some(created as u64),
            cache_read_input_tokens: Some(cached as u64),
            output_tokens: output as u64,
        }
    }
}

/// One server-sent event of a streamed reply (SDK: `RawMessageStreamEvent`, plus the
/// `ping` and `error` events the API sends). The SSE event name is
/// [`StreamEvent::event_name`], the data this value as JSON.
///
/// Read with [`Deserialize`] by its `type` as [`ContentBlock`] is: an event of a type
/// fak does not know is [`StreamEvent::Unknown`]; a `message_delta` without `usage`
/// reads as zero usage ([`DeltaUsage::default`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    /// The reply begins: a [`Message`] with no content and usage so far.
    MessageStart {
        /// The message.
        message: Message,
    },
    /// A block begins (text empty, tool input `{}`).
    ContentBlockStart {
        /// The block's index in `content`.
        index: usize,
        /// The block's start.
        content_block: ContentBlock,
    },
    /// More of a block.
    ContentBlockDelta {
        /// The block's index.
        index: usize,
        /// The addition.
        delta: BlockDelta,
    },
    /// A block is complete.
    ContentBlockStop {
        /// The block's index.
        index: usize,
    },
    /// Top-level changes at the end: the stop reason and the final usage.
    MessageDelta {
        /// The changes.
        delta: MessageDelta,
        /// Cumulative usage (SDK: `MessageDeltaUsage`).
        usage: DeltaUsage,
        /// fak's extension, as in [`Message::fak`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fak: Option<Value>,
    },
    /// The reply is over.
    MessageStop,
    /// Keep-alive.
    Ping,
    /// An error after the stream began.
    Error {
        /// What went wrong.
        error: ErrorDetail,
    },
    /// An event of a type fak does not know, read from an upstream and skipped.
    #[serde(skip_serializing)]
    Unknown(UnknownType),
}

impl StreamEvent {
    /// The SSE `event:` name: the `type` word.
    pub fn event_name(&self) -> &str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
            StreamEvent::Ping => "ping",
            StreamEvent::Error { .. } => "error",
            StreamEvent::Unknown(u) => u.type_name(),
        }
    }
}

/// A `content_block_delta`'s `delta` (SDK: `RawContentBlockDelta`; its
/// `citations_delta`, and types added later, are [`BlockDelta::Unknown`]). Read as
/// [`ContentBlock`] is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    /// More text.
    TextDelta {
        /// The text.
        text: String,
    },
    /// More of a tool call's `input`, as JSON text.
    InputJsonDelta {
        /// The JSON text.
        partial_json: String,
    },
    /// More reasoning.
    ThinkingDelta {
        /// The reasoning.
        thinking: String,
    },
    /// A thinking block's signature.
    SignatureDelta {
        /// The signature.
        signature: String,
    },
    /// A delta of a type fak does not know, read from an upstream and skipped.
    #[serde(skip_serializing)]
    Unknown(UnknownType),
}

/// A `message_delta`'s `delta` (SDK: `RawMessageDeltaEvent.Delta`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct MessageDelta {
    /// Why generation ended.
    pub stop_reason: Option<StopReason>,
    /// The stop sequence that ended it, if one did.
    pub stop_sequence: Option<String>,
}

/// A `message_delta`'s `usage` (SDK: `MessageDeltaUsage`): cumulative counts; the
/// prompt's are present when only known at the end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct DeltaUsage {
    /// Prompt tokens neither read from nor written to a cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    /// Prompt tokens written to a cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_creation_input_tokens: Option<u64>,
    /// Prompt tokens read from a cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_input_tokens: Option<u64>,
    /// Generated tokens so far (0 when absent).
    #[serde(default)]
    pub output_tokens: u64,
}

impl From<Usage> for DeltaUsage {
    fn from(u: Usage) -> Self {
        DeltaUsage {
            input_tokens: Some(u.input_tokens),
            cache_creation_input_tokens: u.cache_creation_input_tokens,
            cache_read_input_tokens: u.cache_read_input_tokens,
            output_tokens: u.output_tokens,
        }
    }
}

/// The response of `POST /v1/messages/count_tokens` (SDK: `MessageTokensCount`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct CountTokensResponse {
    /// Tokens of the prompt the same request to `/v1/messages` would have.
    pub input_tokens: u64,
}

/// An error response: `{"type": "error", "error": {"type", "message"}}` (Anthropic's
/// API reference, "Errors").
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct ErrorResponse {
    /// Always `error`.
    #[serde(rename = "type")]
    pub kind: ErrorType,
    /// What went wrong.
    pub error: ErrorDetail,
}

/// The one-word `type` of an [`ErrorResponse`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum ErrorType {
    /// `error`.
    #[default]
    #[serde(rename = "error")]
    Error,
}

/// An error's `type` word (`invalid_request_error`, `authentication_error`,
/// `permission_error`, `not_found_error`, `request_too_large`, `rate_limit_error`,
/// `api_error`, `overloaded_error`, `timeout_error`) and message.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct ErrorDetail {
    /// The type word.
    #[serde(rename = "type")]
    pub kind: String,
    /// What was wrong, for a person.
    pub message: String,
}

impl ErrorResponse {
    /// The envelope of an error of type `kind`.
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        ErrorResponse {
            kind: ErrorType::Error,
            error: ErrorDetail {
                kind: kind.into(),
                message: message.into(),
            },
        }
    }
}

/// A model as the Anthropic Models API describes it (SDK: `ModelInfo`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct ModelInfo {
    /// Always `model`.
    #[serde(rename = "type")]
    pub kind: ModelType,
    /// The id requests name.
    pub id: String,
    /// A name for people.
    pub display_name: String,
    /// When it was released, RFC 3339 (fak: when the server started).
    pub created_at: String,
}

/// The one-word `type` of a [`ModelInfo`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum ModelType {
    /// `model`.
    #[default]
    #[serde(rename = "model")]
    Model,
}

/// A page of the Anthropic Models list (`GET /v1/models`; SDK: `SyncPage[ModelInfo]` in
/// `pagination.py`). The SDK asks for the next page with `after_id` = `last_id` (or,
/// when it was paging backwards, `before_id` = `first_id`) while `has_more` is true.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct ModelList {
    /// The page's models, in list order.
    pub data: Vec<ModelInfo>,
    /// Whether more models lie beyond this page in the direction asked (after it, or
    /// before it with `before_id`).
    pub has_more: bool,
    /// The page's first id (`null` when the page is empty).
    pub first_id: Option<String>,
    /// The page's last id (`null` when the page is empty).
    pub last_id: Option<String>,
}

/// The query of `GET /v1/models` (SDK: `ModelListParams`). Other query parameters (the
/// SDK's `lifecycle`) are not read: every model fak serves is active.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct ModelListParams {
    /// The page after this model id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_id: Option<String>,
    /// The page before this model id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before_id: Option<String>,
    /// Models per page, [`MODEL_LIST_LIMIT_MIN`] to [`MODEL_LIST_LIMIT_MAX`]; absent:
    /// [`MODEL_LIST_LIMIT_DEFAULT`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<i64>,
}

/// [`ModelListParams::limit`]'s default (the API reference's).
pub const MODEL_LIST_LIMIT_DEFAULT: i64 = 20;
/// [`ModelListParams::limit`]'s least value.
pub const MODEL_LIST_LIMIT_MIN: i64 = 1;
/// [`ModelListParams::limit`]'s greatest value.
pub const MODEL_LIST_LIMIT_MAX: i64 = 1000;

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        string_or_blocks::<D, ContentBlockParam>(d, "A message's `content`").map(|c| match c {
            Either::Text(t) => MessageContent::Text(t),
            Either::Blocks(b) => MessageContent::Blocks(b),
        })
    }
}

impl<'de> Deserialize<'de> for SystemPrompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        string_or_blocks::<D, TextBlockParam>(d, "`system`").map(|c| match c {
            Either::Text(t) => SystemPrompt::Text(t),
            Either::Blocks(b) => SystemPrompt::Blocks(b),
        })
    }
}

impl<'de> Deserialize<'de> for ToolResultContent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        string_or_blocks::<D, ContentBlockParam>(d, "A `tool_result`'s `content`").map(
            |c| match c {
                Either::Text(t) => ToolResultContent::Text(t),
                Either::Blocks(b) => ToolResultContent::Blocks(b),
            },
        )
    }
}

impl<'de> Deserialize<'de> for StreamEvent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut t = Tagged::read(d, "a stream event")?;
        Ok(match t.kind() {
            "message_start" => StreamEvent::MessageStart {
                message: t.take("message")?,
            },
            "content_block_start" => StreamEvent::ContentBlockStart {
                index: t.take("index")?,
                content_block: t.take("content_block")?,
            },
            "content_block_delta" => StreamEvent::ContentBlockDelta {
                index: t.take("index")?,
                delta: t.take("delta")?,
            },
            "content_block_stop" => StreamEvent::ContentBlockStop {
                index: t.take("index")?,
            },
            "message_delta" => StreamEvent::MessageDelta {
                delta: t.take("delta")?,
                usage: t.take_or_default("usage")?,
                fak: t.take_or_default("fak")?,
            },
            "message_stop" => StreamEvent::MessageStop,
            "ping" => StreamEvent::Ping,
            "error" => StreamEvent::Error {
                error: t.take("error")?,
            },
            _ => StreamEvent::Unknown(UnknownType {
                kind: t.into_kind(),
            }),
        })
    }
}

impl<'de> Deserialize<'de> for ContentBlock {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut t = Tagged::read(d, "a content block")?;
        Ok(match t.kind() {
            "text" => ContentBlock::Text {
                text: t.take("text")?,
            },
            "tool_use" => ContentBlock::ToolUse {
                id: t.take("id")?,
                name: t.take("name")?,
                input: t.take("input")?,
            },
            "thinking" => ContentBlock::Thinking {
                thinking: t.take("thinking")?,
                signature: t.take("signature")?,
            },
            "redacted_thinking" => ContentBlock::RedactedThinking {
                data: t.take("data")?,
            },
            _ => ContentBlock::Unknown(UnknownType {
                kind: t.into_kind(),
            }),
        })
    }
}

impl<'de> Deserialize<'de> for BlockDelta {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut t = Tagged::read(d, "a delta")?;
        Ok(match t.kind() {
            "text_delta" => BlockDelta::TextDelta {
                text: t.take("text")?,
            },
            "input_json_delta" => BlockDelta::InputJsonDelta {
                partial_json: t.take("partial_json")?,
            },
            "thinking_delta" => BlockDelta::ThinkingDelta {
                thinking: t.take("thinking")?,
            },
            "signature_delta" => BlockDelta::SignatureDelta {
                signature: t.take("signature")?,
            },
            _ => BlockDelta::Unknown(UnknownType {
                kind: t.into_kind(),
            }),
        })
    }
}

enum Either<B> {
    Text(String),
    Blocks(Vec<B>),
}

/// A string or an array of blocks, with a block's own error (e.g. serde's "unknown
/// variant `x`" naming a block type) kept rather than an untagged enum's "did not match
/// any variant".
fn string_or_blocks<'de, D: serde::Deserializer<'de>, B: serde::de::DeserializeOwned>(
    d: D,
    what: &str,
) -> Result<Either<B>, D::Error> {
    use serde::de::Error;
    match Value::deserialize(d)? {
        Value::String(s) => Ok(Either::Text(s)),
        Value::Array(a) => a
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                serde_json::from_value(b)
                    .map_err(|e| D::Error::custom(format!("{what}, block {i}: {e}")))
            })
            .collect::<Result<_, _>>()
            .map(Either::Blocks),
        _ => Err(D::Error::custom(format!(
            "{what} must be a string or an array of blocks"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_with_every_block_kind_parses() {
        let r: MessagesRequest = serde_json::from_str(
            r#"{"model":"m","max_tokens":32000,"stream":true,"metadata":{"user_id":"u"},
            "system":[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}}],
            "thinking":{"type":"enabled","budget_tokens":2048},
            "tool_choice":{"type":"auto","disable_parallel_tool_use":true},
            "tools":[{"name":"t","input_schema":{"type":"object"}}],
            "messages":[{"role":"system","content":"s"},
              {"role":"user","content":[{"type":"image","source":{"type":"url","url":"u"}}]},
              {"role":"assistant","content":[{"type":"thinking","thinking":"x","signature":"y"},
                 {"type":"redacted_thinking","data":"z"},
                 {"type":"tool_use","id":"toolu_1","name":"t","input":{}}]},
              {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1",
                 "content":[{"type":"text","text":"ok"},{"type":"image","source":{}}]}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens, 32000);
        assert_eq!(r.prompt.messages.len(), 4);
        assert_eq!(r.prompt.messages[0].role, Role::System);
        assert!(r
            .prompt
            .tool_choice
            .as_ref()
            .unwrap()
            .disable_parallel_tool_use());
        assert_eq!(r.prompt.unsupported_field(), None);
        assert_eq!(r.prompt.system.unwrap().text(), "a");
    }

    #[test]
    fn an_unknown_field_is_named() {
        let r: MessagesRequest = serde_json::from_str(
            r#"{"model":"m","max_tokens":1,"messages":[],"mcp_servers":[],"metadata":{}}"#,
        )
        .unwrap();
        let e = r.prompt.unsupported_field().unwrap();
        assert!(e.contains("`mcp_servers`"), "{e}");
    }

    #[test]
    fn an_unknown_block_type_is_an_error_naming_it() {
        let e = serde_json::from_str::<MessageParam>(
            r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"hologram"}]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("hologram"), "{e}");
    }

    /// A type the API added after fak's types (or one fak does not read) is the
    /// `Unknown` variant, whatever its fields; a known type keeps its fields wherever
    /// `type` is in the object (the SDK writes it last); the `Unknown` read cannot be
    /// written back.
    #[test]
    fn unknown_types_read_as_unknown_and_cannot_be_written() {
        let e: StreamEvent = serde_json::from_str(
            r#"{"delta":{"citation":{"type":"char_location"},"type":"citations_delta"},"index":2,"type":"content_block_delta"}"#,
        )
        .unwrap();
        let StreamEvent::ContentBlockDelta {
            index: 2,
            delta: BlockDelta::Unknown(u),
        } = &e
        else {
            panic!("{e:?}")
        };
        assert_eq!(u.type_name(), "citations_delta");
        assert!(serde_json::to_string(&e).is_err());
        let b: ContentBlock = serde_json::from_str(
            r#"{"type":"server_tool_use","id":"s","input":{},"name":"web_search"}"#,
        )
        .unwrap();
        assert!(matches!(&b, ContentBlock::Unknown(u) if u.type_name() == "server_tool_use"));
        assert!(serde_json::to_string(&b).is_err());
        let e: StreamEvent = serde_json::from_str(r#"{"type":"future","index":"x"}"#).unwrap();
        assert_eq!(e.event_name(), "future");
        let r: StopReason = serde_json::from_str(r#""future_reason""#).unwrap();
        assert_eq!(r, StopReason::Unknown);
        assert!(serde_json::to_string(&r).is_err());
        let m: Message = serde_json::from_str(
            r#"{"content":[{"signature":"s","thinking":"t","type":"thinking"},{"citations":null,"text":"a","type":"text"}],"usage":{"output_tokens":3}}"#,
        )
        .unwrap();
        assert_eq!(
            m.content,
            [
                ContentBlock::Thinking {
                    thinking: "t".into(),
                    signature: "s".into()
                },
                ContentBlock::Text { text: "a".into() }
            ]
        );
        assert_eq!((m.role, m.usage.output_tokens), (Role::Assistant, 3));
    }

    /// An error inside a tagged value names the field's path (serde's derived tagged
    /// enums lose it), joined by [`crate::error_path`] with the path outside.
    #[test]
    fn an_error_inside_a_tagged_value_names_its_path() {
        let e = serde_json::from_str::<StreamEvent>(
            r#"{"type":"message_start","message":{"content":[{"type":"text","text":"a"},{"type":"tool_use","id":"t","name":"f","input":{},"x":1},{"type":"text","text":false}]}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("at `message.content[2].text`: invalid type: boolean"),
            "{e}"
        );
        let e = serde_json::from_str::<StreamEvent>(r#"{"type":"content_block_stop"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field `index`"), "{e}");
        assert_eq!(
            crate::error_path("content[1]", "at `input.x`: bad"),
            ("content[1].input.x".to_string(), "bad".to_string())
        );
        assert_eq!(
            crate::error_path("message", "at `[0]`: bad"),
            ("message[0]".to_string(), "bad".to_string())
        );
        assert_eq!(
            crate::error_path("a", "bad"),
            ("a".to_string(), "bad".to_string())
        );
    }

    #[test]
    fn stream_events_carry_their_type() {
        let e = StreamEvent::ContentBlockDelta {
            index: 1,
            delta: BlockDelta::InputJsonDelta {
                partial_json: "{}".into(),
            },
        };
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{}"}}"#
        );
        assert_eq!(
            serde_json::to_string(&ErrorResponse::new("not_found_error", "x")).unwrap(),
            r#"{"type":"error","error":{"type":"not_found_error","message":"x"}}"#
        );
    }
}
