"""Writes sdk_stream.sse and sdk_message.json: an Anthropic Messages stream and the
message it adds up to, each value built and validated by the `anthropic` Python SDK's
own types (anthropic==2.14.0, `anthropic.types`) and written by the SDK's pydantic
models, so that fak's reader is checked against the SDK's shapes, not its own.

The reply holds what the real API sends with extended thinking and server tools: a
`thinking` block (`thinking_delta`, `signature_delta`), a `redacted_thinking` block, a
`server_tool_use` block and its `web_search_tool_result`, a text block with a
`citations_delta`, and a `tool_use` block (`input_json_delta`).

    python make_sdk_stream.py   # in a venv with anthropic==2.14.0
"""

import json

from anthropic.types import (
    Message,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
)

USAGE = {
    "input_tokens": 12,
    "cache_creation_input_tokens": 3,
    "cache_read_input_tokens": 40,
    "output_tokens": 1,
}
SEARCH_RESULT = {
    "type": "web_search_tool_result",
    "tool_use_id": "srvtoolu_1",
    "content": [
        {
            "type": "web_search_result",
            "url": "https://example.com/w",
            "title": "Weather",
            "encrypted_content": "enc",
            "page_age": None,
        }
    ],
}
CITATION = {
    "type": "web_search_result_location",
    "url": "https://example.com/w",
    "title": "Weather",
    "encrypted_index": "idx",
    "cited_text": "sunny",
}

# (block at its start, deltas, block when whole)
BLOCKS = [
    (
        {"type": "thinking", "thinking": "", "signature": ""},
        [
            {"type": "thinking_delta", "thinking": "The user asks "},
            {"type": "thinking_delta", "thinking": "about the weather."},
            {"type": "signature_delta", "signature": "EqQBCgIYAhIM"},
        ],
        {"type": "thinking", "thinking": "The user asks about the weather.", "signature": "EqQBCgIYAhIM"},
    ),
    ({"type": "redacted_thinking", "data": "EmwKAhgB"}, [], {"type": "redacted_thinking", "data": "EmwKAhgB"}),
    (
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
        [{"type": "input_json_delta", "partial_json": '{"query": "weather"}'}],
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "weather"}},
    ),
    (SEARCH_RESULT, [], SEARCH_RESULT),
    (
        {"type": "text", "text": "", "citations": None},
        [
            {"type": "text_delta", "text": "It is "},
            {"type": "citations_delta", "citation": CITATION},
            {"type": "text_delta", "text": "sunny."},
        ],
        {"type": "text", "text": "It is sunny.", "citations": [CITATION]},
    ),
    (
        {"type": "tool_use", "id": "toolu_1", "name": "get_forecast", "input": {}},
        [
            {"type": "input_json_delta", "partial_json": '{"city": '},
            {"type": "input_json_delta", "partial_json": '"Paris"}'},
        ],
        {"type": "tool_use", "id": "toolu_1", "name": "get_forecast", "input": {"city": "Paris"}},
    ),
]


def message(content, stop_reason, usage):
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage,
    }


def main():
    events = [RawMessageStartEvent.model_validate({"type": "message_start", "message": message([], None, USAGE)})]
    for i, (start, deltas, _) in enumerate(BLOCKS):
        events.append(RawContentBlockStartEvent.model_validate({"type": "content_block_start", "index": i, "content_block": start}))
        for d in deltas:
            events.append(RawContentBlockDeltaEvent.model_validate({"type": "content_block_delta", "index": i, "delta": d}))
        events.append(RawContentBlockStopEvent.model_validate({"type": "content_block_stop", "index": i}))
    events.append(
        RawMessageDeltaEvent.model_validate(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": 87},
            }
        )
    )
    events.append(RawMessageStopEvent.model_validate({"type": "message_stop"}))
    with open("sdk_stream.sse", "w") as f:
        for e in events:
            f.write(f"event: {e.type}\ndata: {e.model_dump_json()}\n\n")
    whole = Message.model_validate(message([b for _, _, b in BLOCKS], "tool_use", dict(USAGE, output_tokens=87)))
    with open("sdk_message.json", "w") as f:
        f.write(whole.model_dump_json(indent=1) + "\n")


if __name__ == "__main__":
    main()
