//! The Anthropic Messages API over the mock engine: what Claude Code and the real API's
//! clients send (system messages in `messages`, `max_tokens: 32000`, prefills, thinking
//! blocks, images in tool results), the real API's validation, `count_tokens`, streams
//! whose blocks are exactly the non-streamed reply's, and `x-should-retry` on errors.

mod common;

use common::{post, request, start, start_with_policy, Resp};
use fak_engine::mock::{MockDriver, MOCK_CONTEXT};
use fak_engine::policy::Policy;
use fak_engine::{
    EngineDriver, EngineError, EventStream, GenerateRequest, ModelInfo, Prompt, Readiness,
};
use fak_gateway::GatewayConfig;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

/// The mock, recording each request it is given.
#[derive(Default)]
struct Recording {
    mock: MockDriver,
    seen: Mutex<Vec<GenerateRequest>>,
}

impl EngineDriver for Recording {
    fn id(&self) -> &'static str {
        "recording"
    }
    fn models(&self) -> Vec<ModelInfo> {
        self.mock.models()
    }
    fn readiness(&self) -> Readiness {
        self.mock.readiness()
    }
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        self.seen.lock().unwrap().push(req.clone());
        self.mock.submit(req)
    }
    fn count_tokens(&self, req: &GenerateRequest) -> Result<usize, EngineError> {
        self.mock.count_tokens(req)
    }
}

impl Recording {
    fn last(&self) -> GenerateRequest {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("a request")
    }
}

fn recording() -> (Arc<Recording>, common::Server) {
    let d = Arc::new(Recording::default());
    let srv = start(d.clone(), GatewayConfig::default());
    (d, srv)
}

fn chat_of(r: &GenerateRequest) -> Vec<(String, String)> {
    match &r.prompt {
        Prompt::Chat(ms) => ms
            .iter()
            .map(|m| (m.role.clone(), m.content.clone()))
            .collect(),
        Prompt::Text(_) | Prompt::Tokens(_) => panic!("not a chat prompt"),
    }
}

fn anthropic_error(r: &Resp, status: u16, needle: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(needle), "{msg:?} does not name {needle:?}");
    assert_eq!(r.header("x-should-retry"), Some("false"));
}

#[test]
fn system_messages_in_messages_merge_into_the_system_turn_in_order() {
    let (d, srv) = recording();
    for stream in [false, true] {
        let body = json!({"model": "mock", "max_tokens": 20, "stream": stream, "system": "top",
            "messages": [
                {"role": "system", "content": "first"},
                {"role": "user", "content": "echo hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "system", "content": [{"type": "text", "text": "second"}]},
                {"role": "user", "content": "echo bye"}]});
        let r = post(srv.addr, "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let got = chat_of(&d.last());
        let want: Vec<(String, String)> = [
            ("system", "top\n\nfirst\n\nsecond"),
            ("user", "echo hi"),
            ("assistant", "hello"),
            ("user", "echo bye"),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        assert_eq!(got, want);
    }
}

#[test]
fn max_tokens_beyond_the_window_is_capped_with_stop_reason_max_tokens() {
    let (d, srv) = recording();
    // A reply longer than the window: the cap ends it.
    let body = json!({"model": "mock", "max_tokens": 32000,
        "messages": [{"role": "user", "content": "count 5000"}]});
    let r = post(srv.addr, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let u = &v["usage"];
    let prompt =
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(
        u["output_tokens"].as_u64().unwrap() + prompt,
        MOCK_CONTEXT as u64
    );
    assert!(d.last().cap_max_tokens);
    // Streamed.
    let mut b = body.clone();
    b["stream"] = json!(true);
    let ev = post(srv.addr, "/v1/messages", &b).sse();
    let delta: Value = serde_json::from_str(
        &ev.iter()
            .find(|(n, _)| n == "message_delta")
            .expect("message_delta")
            .1,
    )
    .unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(
        delta["usage"]["output_tokens"].as_u64().unwrap() + prompt,
        MOCK_CONTEXT as u64
    );
    // A short reply under a large max_tokens ends on its own.
    let body = json!({"model": "mock", "max_tokens": 32000,
        "messages": [{"role": "user", "content": "count 3"}]});
    let v = post(srv.addr, "/v1/messages", &body).json();
    assert_eq!(v["stop_reason"], "end_turn");
    // A prompt that alone fills the window is still a 400, saying the prompt's size
    // and the window (before: "max_tokens is 1", a limit the client never set).
    let long = "w ".repeat(MOCK_CONTEXT);
    let body = json!({"model": "mock", "max_tokens": 32000,
        "messages": [{"role": "user", "content": long}]});
    for stream in [false, true] {
        let mut b = body.clone();
        b["stream"] = json!(stream);
        let r = post(srv.addr, "/v1/messages", &b);
        anthropic_error(&r, 400, "the prompt has ");
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        let counted: usize = msg
            .split("the prompt has ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no token count in {msg:?}"));
        // The mock counts a word a token: the prompt's words and more (the template).
        assert!(counted >= MOCK_CONTEXT, "{msg}");
        assert!(
            msg.contains(&format!("context window of {MOCK_CONTEXT} tokens"))
                && !msg.contains("max_tokens"),
            "{msg}"
        );
    }
    // The OpenAI wire keeps refusing, as OpenAI's API does.
    let body = json!({"model": "mock", "max_tokens": 32000,
        "messages": [{"role": "user", "content": "count 3"}]});
    let r = post(srv.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(!d.last().cap_max_tokens);
}

#[test]
fn a_final_assistant_message_is_continued() {
    let (d, srv) = recording();
    for stream in [false, true] {
        let body = json!({"model": "mock", "max_tokens": 20, "stream": stream, "messages": [
            {"role": "user", "content": "echo hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}]});
        let r = post(srv.addr, "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let last = d.last();
        assert!(last.continue_final_message);
        assert_eq!(
            chat_of(&last).last().unwrap(),
            &("assistant".to_string(), "The answer is".to_string())
        );
    }
    // A conversation ending on a user turn is not a prefill.
    let body = json!({"model": "mock", "max_tokens": 20,
        "messages": [{"role": "user", "content": "echo hi"}]});
    assert_eq!(post(srv.addr, "/v1/messages", &body).status, 200);
    assert!(!d.last().continue_final_message);
}

#[test]
fn thinking_blocks_are_accepted_and_not_shown_to_the_model() {
    let (d, srv) = recording();
    let body = json!({"model": "mock", "max_tokens": 20, "messages": [
        {"role": "user", "content": "echo hi"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "secret plan", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "hello"}]},
        {"role": "user", "content": "echo bye"}]});
    let r = post(srv.addr, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let got = chat_of(&d.last());
    assert_eq!(got[1], ("assistant".to_string(), "hello".to_string()));
    assert!(!format!("{got:?}").contains("secret plan"));
}

fn tool_use_turns(result_content: Value) -> Value {
    json!([
        {"role": "user", "content": "echo look"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_page", "input": {"url": "u"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": result_content},
            {"type": "text", "text": "echo done"}]}
    ])
}

#[test]
fn images_and_documents_in_tool_results_become_stubs() {
    let (d, srv) = recording();
    let content = json!([
        {"type": "text", "text": "page text "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}}]);
    for stream in [false, true] {
        let body = json!({"model": "mock", "max_tokens": 20, "stream": stream,
            "messages": tool_use_turns(content.clone())});
        let r = post(srv.addr, "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let got = chat_of(&d.last());
        let tool = got
            .iter()
            .find(|(r, _)| r == "tool")
            .expect("a tool message");
        assert_eq!(
            tool.1,
            concat!(
                "page text ",
                r#"{"_withheld":true,"type":"image","reason":"UNSCREENABLE_CONTENT"}"#,
                r#"{"_withheld":true,"type":"document","reason":"UNSCREENABLE_CONTENT"}"#
            )
        );
        assert!(!tool.1.contains("iVBORw0KGgo"));
    }
    // An image the user sends directly is refused by name (the model reads text only).
    let body = json!({"model": "mock", "max_tokens": 20, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]});
    anthropic_error(&post(srv.addr, "/v1/messages", &body), 400, "'image'");
}

#[test]
fn the_real_apis_validation_is_a_400_in_its_shape() {
    let (_, srv) = recording();
    let send = |messages: Value| {
        post(
            srv.addr,
            "/v1/messages",
            &json!({"model": "mock", "max_tokens": 20, "messages": messages}),
        )
    };
    anthropic_error(
        &send(json!([{"role": "user", "content": ""}])),
        400,
        "messages[0].content is empty",
    );
    anthropic_error(
        &send(json!([{"role": "user", "content": []}])),
        400,
        "messages[0].content is empty",
    );
    anthropic_error(
        &send(json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}])),
        400,
        "messages[1].content is empty",
    );
    // A tool_result naming no earlier tool_use.
    let mut m = tool_use_turns(json!("ok"));
    m[2]["content"][0]["tool_use_id"] = json!("toolu_nope");
    anthropic_error(&send(m), 400, "toolu_nope");
    // A tool_use not answered in the next user message.
    let mut m = tool_use_turns(json!("ok"));
    m[2]["content"] = json!("echo ignoring the call");
    anthropic_error(&send(m), 400, "toolu_1");
    // ... nor when the conversation ends on it.
    let mut m = tool_use_turns(json!("ok"));
    m.as_array_mut().unwrap().pop();
    anthropic_error(&send(m), 400, "toolu_1");
    // Answered: fine.
    assert_eq!(send(tool_use_turns(json!("ok"))).status, 200);
    // A field that would change the output is named.
    let r = post(
        srv.addr,
        "/v1/messages",
        &json!({"model": "mock", "max_tokens": 20, "mcp_servers": [],
            "messages": [{"role": "user", "content": "hi"}]}),
    );
    anthropic_error(&r, 400, "mcp_servers");
    // A seed (not in the Messages API) is named with where the seed is set.
    let r = post(
        srv.addr,
        "/v1/messages",
        &json!({"model": "mock", "max_tokens": 20, "seed": 7,
            "messages": [{"role": "user", "content": "hi"}]}),
    );
    anthropic_error(&r, 400, "`seed` is not supported");
    anthropic_error(&r, 400, "fak serve --seed N");
    // Fields accepted and ignored.
    let r = post(
        srv.addr,
        "/v1/messages",
        &json!({"model": "mock", "max_tokens": 20, "metadata": {"user_id": "u"},
            "thinking": {"type": "enabled", "budget_tokens": 2048}, "service_tier": "auto",
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
            "tools": [{"name": "t", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn the_real_apis_field_checks_are_400s_naming_the_field() {
    let (d, srv) = recording();
    let seen = || d.seen.lock().unwrap().len();
    for stream in [false, true] {
        let send = |extra: Value, messages: Value| {
            let mut b = json!({"model": "mock", "max_tokens": 20, "stream": stream,
                "messages": messages});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            post(srv.addr, "/v1/messages", &b)
        };
        let hi = json!([{"role": "user", "content": "echo hi"}]);
        let before = seen();
        // temperature in [0, 1], the API's range.
        for t in [1.5, -0.1] {
            anthropic_error(
                &send(json!({"temperature": t}), hi.clone()),
                400,
                "temperature",
            );
        }
        // Two tool_use blocks with one id.
        let mut m = tool_use_turns(json!("ok"));
        let call = m[1]["content"][0].clone();
        m[1]["content"].as_array_mut().unwrap().push(call);
        anthropic_error(&send(json!({}), m), 400, "`tool_use` ids must be unique");
        // A tool_use's input that is not an object.
        let mut m = tool_use_turns(json!("ok"));
        m[1]["content"][0]["input"] = json!("{\"url\": \"u\"}");
        anthropic_error(
            &send(json!({}), m),
            400,
            "messages[1].content[0].tool_use.input must be an object",
        );
        // Image data that is not base64: in a user message and in a tool result (the
        // API refuses both; a valid one in a tool result becomes the stub).
        let bad_image = json!({"type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "not base64!"}});
        anthropic_error(
            &send(
                json!({}),
                json!([{"role": "user", "content": [bad_image.clone()]}]),
            ),
            400,
            "messages[0].content[0].image.source.data: invalid base64 data",
        );
        anthropic_error(
            &send(json!({}), tool_use_turns(json!([bad_image.clone()]))),
            400,
            "messages[2].content[0].tool_result.content[0].image.source.data: invalid base64",
        );
        // A thinking block is the assistant's.
        anthropic_error(
            &send(
                json!({}),
                json!([{"role": "user", "content": [
                    {"type": "thinking", "thinking": "x", "signature": "s"},
                    {"type": "text", "text": "echo hi"}]}]),
            ),
            400,
            "messages[0].content[0]: a 'thinking' block may only be in an assistant message",
        );
        assert_eq!(seen(), before, "a refused request reached the engine");
        // The edges of the range are fine.
        for t in [0.0, 1.0] {
            let r = send(json!({"temperature": t}), hi.clone());
            assert_eq!(r.status, 200, "{}", r.body);
        }
    }
}

#[test]
fn consecutive_turns_of_one_role_are_combined_as_the_api_does() {
    let (d, srv) = recording();
    let pairs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    };
    for stream in [false, true] {
        // Two assistant messages at the end: one prefill of both.
        let body = json!({"model": "mock", "max_tokens": 20, "stream": stream, "messages": [
            {"role": "user", "content": "echo hi"},
            {"role": "assistant", "content": "The answer"},
            {"role": "assistant", "content": [{"type": "text", "text": "is"}]}]});
        let r = post(srv.addr, "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let last = d.last();
        assert!(last.continue_final_message);
        assert_eq!(
            chat_of(&last),
            pairs(&[("user", "echo hi"), ("assistant", "The answer\n\nis")])
        );
        // Two user messages: one turn.
        let body = json!({"model": "mock", "max_tokens": 20, "stream": stream, "messages": [
            {"role": "user", "content": "echo hi"},
            {"role": "user", "content": "echo bye"}]});
        let r = post(srv.addr, "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            chat_of(&d.last()),
            pairs(&[("user", "echo hi\n\necho bye")])
        );
    }
}

#[test]
fn count_tokens_equals_the_prompt_of_the_same_messages_request() {
    let srv = start(Arc::new(MockDriver::new()), GatewayConfig::default());
    let prompt = json!({"model": "mock", "system": "be brief",
        "tools": [{"name": "get_page", "input_schema": {"type": "object"}}],
        "messages": tool_use_turns(json!("the page"))});
    let r = post(srv.addr, "/v1/messages/count_tokens", &prompt);
    assert_eq!(r.status, 200, "{}", r.body);
    let counted = r.json()["input_tokens"].as_u64().unwrap();
    let mut body = prompt.clone();
    body["max_tokens"] = json!(20);
    let v = post(srv.addr, "/v1/messages", &body).json();
    let u = &v["usage"];
    assert_eq!(
        counted,
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap()
    );
    // The mock's documented count: a word per role, the words of each content.
    // <system> be brief | <user> echo look | <assistant> | <tool> the page | <user> echo done
    assert_eq!(counted, 3 + 3 + 1 + 3 + 3);
    // Errors in Anthropic's shape.
    let r = post(
        srv.addr,
        "/v1/messages/count_tokens",
        &json!({"model": "mock", "messages": []}),
    );
    anthropic_error(&r, 400, "at least one message");
    let r = post(
        srv.addr,
        "/v1/messages/count_tokens",
        &json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "not_found_error");
}

/// The content a stream's events assemble, block by block.
fn assembled(ev: &[(String, String)]) -> Vec<Value> {
    let mut blocks: Vec<Value> = Vec::new();
    let mut json_parts: Vec<String> = Vec::new();
    for (name, data) in ev {
        let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
        match name.as_str() {
            "content_block_start" => {
                assert_eq!(v["index"].as_u64().unwrap() as usize, blocks.len());
                blocks.push(v["content_block"].clone());
                json_parts.push(String::new());
            }
            "content_block_delta" => {
                let i = v["index"].as_u64().unwrap() as usize;
                let d = &v["delta"];
                match d["type"].as_str().unwrap() {
                    "text_delta" => {
                        let t = blocks[i]["text"].as_str().unwrap().to_string();
                        blocks[i]["text"] = json!(t + d["text"].as_str().unwrap());
                    }
                    "input_json_delta" => {
                        json_parts[i].push_str(d["partial_json"].as_str().unwrap())
                    }
                    other => panic!("unexpected delta {other}"),
                }
            }
            "content_block_stop" => {
                let i = v["index"].as_u64().unwrap() as usize;
                if blocks[i]["type"] == "tool_use" && !json_parts[i].is_empty() {
                    blocks[i]["input"] = serde_json::from_str(&json_parts[i]).unwrap();
                }
            }
            _ => {}
        }
    }
    blocks
}

#[test]
fn a_streams_blocks_are_exactly_the_non_streamed_content() {
    let manifest = r#"{"version": "fak-policy/1", "allow": ["get_weather"]}"#;
    let srv = start_with_policy(
        Arc::new(MockDriver::new()),
        GatewayConfig::default(),
        Policy::from_json(manifest).unwrap(),
    );
    let call = r#"<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>"#;
    let denied = r#"<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>"#;
    let cases = [
        ("text only", "echo sunny and warm".to_string()),
        ("tool only", format!("echo {call}")),
        ("text and tool", format!("echo let me look {call}")),
        ("denied and allowed", format!("echo {denied} {call}")),
    ];
    let tools = json!([
        {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
        {"name": "rm_rf", "input_schema": {"type": "object"}}]);
    for (what, directive) in cases {
        let body = json!({"model": "mock", "max_tokens": 100, "tools": tools,
            "messages": [{"role": "user", "content": directive}]});
        let whole = post(srv.addr, "/v1/messages", &body).json();
        let mut b = body.clone();
        b["stream"] = json!(true);
        let r = post(srv.addr, "/v1/messages", &b);
        assert_eq!(r.status, 200, "{what}: {}", r.body);
        let mut got = assembled(&r.sse());
        let mut want = whole["content"].as_array().unwrap().clone();
        // Ids are per response; compare the rest.
        for b in got.iter_mut().chain(want.iter_mut()) {
            if b["type"] == "tool_use" {
                b["id"] = json!("toolu_X");
            }
        }
        assert_eq!(got, want, "{what}");
        if what != "text only" {
            assert!(
                !want.iter().any(|b| b["type"] == "text" && b["text"] == ""),
                "{what}: an empty text block"
            );
        }
    }
}

#[test]
fn errors_say_whether_a_retry_can_help_on_both_wires() {
    let srv = start(
        Arc::new(MockDriver::new()),
        GatewayConfig {
            api_key: Some("sekret".into()),
            ..GatewayConfig::default()
        },
    );
    let key = [("x-api-key", "sekret")];
    let a = srv.addr;
    let chat = br#"{"model":"mock","messages":[{"role":"user","content":"hi"}]}"#;
    let msg = br#"{"model":"mock","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;
    for (path, body) in [
        ("/v1/chat/completions", &chat[..]),
        ("/v1/messages", &msg[..]),
    ] {
        // 401: a wrong key.
        let r = request(a, "POST", path, &[("x-api-key", "wrong")], body);
        assert_eq!(
            (r.status, r.header("x-should-retry")),
            (401, Some("false")),
            "{path}"
        );
        // 400: a bad body.
        let r = request(a, "POST", path, &key, b"{");
        assert_eq!(
            (r.status, r.header("x-should-retry")),
            (400, Some("false")),
            "{path}"
        );
        // 404: an unknown model.
        let nope = String::from_utf8_lossy(body).replace("\"mock\"", "\"nope\"");
        let r = request(a, "POST", path, &key, nope.as_bytes());
        assert_eq!(
            (r.status, r.header("x-should-retry")),
            (404, Some("false")),
            "{path}"
        );
    }
    // 429: the engine is busy; a retry can pass.
    let busy = start(
        Arc::new(MockDriver::new().with_max_active(0)),
        GatewayConfig::default(),
    );
    for (path, body) in [
        ("/v1/chat/completions", &chat[..]),
        ("/v1/messages", &msg[..]),
    ] {
        let r = request(busy.addr, "POST", path, &[], body);
        assert_eq!(
            (r.status, r.header("x-should-retry")),
            (429, Some("true")),
            "{path}"
        );
    }
}
