"""Drive `fak serve` with the official `openai` and `anthropic` Python SDKs.

Run by scripts/sdk-check (which starts the servers; the environment it sets:
scripts/checklib.py). Checks, on the real
SmolLM2-135M-Instruct at temperature 0, against the committed HF e2e fixture:
non-streaming and streaming chat (the streamed text concatenated equals the whole
text), usage equal to the tokenizer's counts, cached tokens on a repeated request,
`logprobs=True, top_logprobs=3` (one entry per generated token, their tokens spelling the
content, each the top of its three alternatives), `chat.completions.parse` with a pydantic
`response_format` and JSON mode (constrained decoding), /v1/completions with the prompt as HF's
token ids (HF's text; a list of two prompts as two choices; an id outside the vocabulary a
400), `n=3` streamed and not (three choices by index, each HF's greedy text, the prompt
counted once in usage; sampled with a seed, choice 0 equal to the `n=1` request, text and
logprobs), /v1/models, and the error cases (status and SDK exception class). On the real model, a
forced tool call that the 135M model writes malformed fails closed (no tool call, the
`fak` field says MALFORMED). Against FAK_MOCK_BASE (`fak serve --engine mock`, whose
replies go through the same tool-call parser): tool calls parsed into the SDKs' types on
both wires, streaming and not, a denied call removed with its reason, and the tool
result sent back. Anthropic: a system message inside `messages`, `max_tokens=32000`
(capped to what fits), a prefill continued, `messages.count_tokens`. The Responses API: `responses.create` plain text on the real model
(streamed and not, the streamed text equal to the whole), `previous_response_id` reusing
the KV cache (`cached_tokens` > 0 on the follow-up); and against the mock, the OpenAI
Agents SDK with its default model class (OpenAIResponsesModel) running a function-tool
round trip with `Runner.run` and `Runner.run_streamed`. Prints one `sdk: N passed, M failed`
line and exits non-zero on any failure.
"""

import asyncio
import json

import agents
import anthropic
import openai
import pydantic

from checklib import (
    CASE,
    MESSAGES,
    MOCK_BASE,
    MODEL,
    TEXT,
    anthropic_client,
    call_directive,
    check,
    eq,
    finish,
    openai_client,
    raises,
)

N_PROMPT = len(CASE["prompt_ids"])
N_COMPLETION = len(CASE["completion_ids"])


oa = openai_client()
an = anthropic_client()
om = openai_client(MOCK_BASE)
am = anthropic_client(MOCK_BASE)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OA_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "delete_files", "parameters": {"type": "object"}}},
]
AN_TOOLS = [
    {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA},
    {"name": "delete_files", "input_schema": {"type": "object"}},
]


# This anthropic SDK has no `temperature` argument; the API field goes in the body.
GREEDY = {"temperature": 0}


def openai_chat():
    r = oa.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    eq(r.choices[0].message.content, TEXT)
    eq(r.choices[0].finish_reason, "stop")
    eq(r.usage.prompt_tokens, N_PROMPT)
    eq(r.usage.completion_tokens, N_COMPLETION)
    eq(r.usage.total_tokens, N_PROMPT + N_COMPLETION)


def openai_stream():
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    eq(text, TEXT)
    eq(chunks[-1].usage.completion_tokens, N_COMPLETION)
    eq(chunks[-1].usage.prompt_tokens, N_PROMPT)


def openai_cached():
    r = oa.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    eq(r.choices[0].message.content, TEXT)
    # The same prompt again: all but its last token come from the KV cache.
    eq(r.usage.prompt_tokens_details.cached_tokens, N_PROMPT - 1)


def openai_logprobs():
    r = oa.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    eq(c.message.content, TEXT)
    content = c.logprobs.content
    # Every generated token except the final end-of-turn token.
    eq(len(content), N_COMPLETION - 1)
    eq("".join(t.token for t in content), TEXT)
    for t in content:
        eq(len(t.top_logprobs), 3)
        eq(t.top_logprobs[0].token, t.token)  # greedy: the chosen token is the argmax
        assert t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob, t
    raises(openai.BadRequestError, 400, lambda: oa.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=21))


def openai_n_choices():
    # n=3 greedy: three choices by index, each HF's text; the prompt counted once.
    r = oa.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, n=3)
    eq([c.index for c in r.choices], [0, 1, 2])
    eq([(c.message.content, c.finish_reason) for c in r.choices], [(TEXT, "stop")] * 3)
    eq(r.usage.prompt_tokens, N_PROMPT)
    eq(r.usage.completion_tokens, 3 * N_COMPLETION)
    # Sampled with a seed: choice 0 is the n=1 request with that seed.
    kw = dict(model=MODEL, messages=MESSAGES, temperature=1, seed=42, max_tokens=16, logprobs=True)
    r3 = oa.chat.completions.create(n=3, **kw)
    r1 = oa.chat.completions.create(**kw)
    eq(len(r3.choices), 3)
    eq(r3.choices[0].message.content, r1.choices[0].message.content)
    eq(
        [(t.token, t.logprob) for t in r3.choices[0].logprobs.content],
        [(t.token, t.logprob) for t in r1.choices[0].logprobs.content],
    )
    eq(r3.usage.prompt_tokens, r1.usage.prompt_tokens)


def openai_n_choices_stream():
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=0,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finishes = {}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes.setdefault(ch.index, []).append(ch.finish_reason)
    eq(texts, {0: TEXT, 1: TEXT, 2: TEXT})
    eq(finishes, {0: ["stop"], 1: ["stop"], 2: ["stop"]})
    # One usage chunk, the last, with no choices.
    eq([i for i, c in enumerate(chunks) if c.usage], [len(chunks) - 1])
    eq(chunks[-1].choices, [])
    eq(chunks[-1].usage.prompt_tokens, N_PROMPT)
    eq(chunks[-1].usage.completion_tokens, 3 * N_COMPLETION)


class Person(pydantic.BaseModel):
    name: str
    age: int


def openai_parse():
    # Structured outputs by constrained decoding: the SDK validates each reply with
    # pydantic (`message.parsed`), at temperature 0 and 1.
    for i, q in enumerate(["Describe a famous scientist.", "Invent a pirate captain.", "Who wrote Hamlet?"]):
        r = oa.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": q}], response_format=Person, temperature=i % 2, seed=i
        )
        assert isinstance(r.choices[0].message.parsed, Person), r
    r = oa.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, temperature=0, max_tokens=200
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict), r


def openai_models():
    ids = [m.id for m in oa.models.list()]
    assert MODEL in ids, ids


def models_retrieve():
    m = oa.models.retrieve(MODEL)
    eq((m.id, m.object), (MODEL, "model"))
    raises(openai.NotFoundError, 404, lambda: oa.models.retrieve("nope"))
    a = an.models.retrieve(MODEL)
    eq((a.id, a.type, a.display_name), (MODEL, "model", MODEL))
    assert a.created_at.tzinfo is not None, a
    page = an.models.list()
    eq(([x.id for x in page.data][0], page.has_more, page.first_id), (MODEL, False, MODEL))
    raises(anthropic.NotFoundError, 404, lambda: an.models.retrieve("nope"))


def openai_errors():
    raises(openai.NotFoundError, 404, lambda: oa.chat.completions.create(model="nope", messages=MESSAGES))
    raises(openai.BadRequestError, 400, lambda: oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0))
    raises(openai.BadRequestError, 400, lambda: oa.chat.completions.create(model=MODEL, messages=MESSAGES, n=17), "1..=16")
    raises(
        openai.BadRequestError,
        400,
        lambda: oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1_000_000),
        needle="1000000",
    )
    raises(openai.BadRequestError, 400, lambda: oa.chat.completions.create(model=MODEL, messages=[]))
    huge = [{"role": "user", "content": "x" * (9 << 20)}]  # over the 8 MB default limit
    raises(openai.APIStatusError, 413, lambda: oa.chat.completions.create(model=MODEL, messages=huge))
    bad = openai_client(key="wrong")
    raises(openai.AuthenticationError, 401, lambda: bad.models.list())


def openai_completions():
    r = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.choices[0].text, r
    eq(r.usage.completion_tokens, 5)


def openai_completions_token_ids():
    # HF's token ids of the chat-templated prompt (control tokens included) give HF's
    # greedy text; a list of two id lists gives two choices by index; an id outside the
    # vocabulary is a 400 naming it.
    r = oa.completions.create(model=MODEL, prompt=CASE["prompt_ids"], max_tokens=N_COMPLETION + 4, temperature=0)
    eq(r.choices[0].text, TEXT)
    eq(r.usage.prompt_tokens, N_PROMPT)
    r = oa.completions.create(model=MODEL, prompt=[CASE["prompt_ids"], CASE["prompt_ids"]], max_tokens=N_COMPLETION + 4, temperature=0)
    eq([(c.index, c.text) for c in r.choices], [(0, TEXT), (1, TEXT)])
    raises(openai.BadRequestError, 400, lambda: oa.completions.create(model=MODEL, prompt=[1, 10**6], max_tokens=1), "1000000")


def anthropic_message():
    r = an.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES, extra_body=GREEDY)
    eq(r.content[0].text, TEXT)
    eq(r.stop_reason, "end_turn")
    eq(r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0), N_PROMPT)
    eq(r.usage.output_tokens, N_COMPLETION)


def anthropic_stream():
    with an.messages.stream(model=MODEL, max_tokens=64, messages=MESSAGES, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    eq(text, TEXT)
    eq(final.stop_reason, "end_turn")
    eq(final.usage.output_tokens, N_COMPLETION)


def anthropic_system_and_stop():
    r = an.messages.create(
        model=MODEL,
        max_tokens=64,
        extra_body=GREEDY,
        system="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        messages=[{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}],
        stop_sequences=[" Paris"],
    )
    eq(r.content[0].text, "The capital of France is")
    eq(r.stop_reason, "stop_sequence")
    eq(r.stop_sequence, " Paris")


def anthropic_errors():
    raises(anthropic.NotFoundError, 404, lambda: an.messages.create(model="nope", max_tokens=5, messages=MESSAGES))
    raises(anthropic.BadRequestError, 400, lambda: an.messages.create(model=MODEL, max_tokens=0, messages=MESSAGES))
    # A max_tokens beyond the window is capped (anthropic_max_tokens_32000); a prompt
    # that alone overflows it is a 400.
    raises(
        anthropic.BadRequestError,
        400,
        lambda: an.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "word " * 9000}]),
        needle="context window",
    )
    bad = anthropic_client(key="wrong")
    raises(anthropic.AuthenticationError, 401, lambda: bad.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES))


SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def anthropic_system_in_messages():
    # Claude Code sends a system message inside `messages`: merged into the system turn.
    msgs = [{"role": "system", "content": SMOL_SYSTEM}] + MESSAGES
    r = an.messages.create(model=MODEL, max_tokens=64, messages=msgs, extra_body=GREEDY)
    eq(r.content[0].text, TEXT)
    eq(r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0), N_PROMPT)


def anthropic_max_tokens_32000():
    # Claude Code asks for 32000 (streamed): capped to what fits, the reply as before.
    # Without a stream the SDK itself refuses a max_tokens this large unless the request
    # sets its own timeout.
    with an.messages.stream(model=MODEL, max_tokens=32000, messages=MESSAGES, extra_body=GREEDY) as s:
        r = s.get_final_message()
    eq(r.content[0].text, TEXT)
    eq(r.stop_reason, "end_turn")
    r = an.messages.create(model=MODEL, max_tokens=32000, messages=MESSAGES, extra_body=GREEDY, timeout=120)
    eq(r.content[0].text, TEXT)
    eq(r.stop_reason, "end_turn")


def anthropic_prefill():
    # A trailing assistant message is continued: the reply is what follows it.
    prefix = "The capital of France is"
    assert TEXT.startswith(prefix)
    msgs = MESSAGES + [{"role": "assistant", "content": prefix}]
    r = an.messages.create(model=MODEL, max_tokens=64, messages=msgs, extra_body=GREEDY)
    eq(r.content[0].text, TEXT[len(prefix):])
    eq(r.stop_reason, "end_turn")


def anthropic_count_tokens():
    n = an.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens
    eq(n, N_PROMPT)
    r = an.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES, extra_body=GREEDY)
    eq(r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0), n)


def real_model_forced_call_is_well_formed():
    # A forced call is constrained to the offered tools' call grammar (issue 27): the
    # 135M model, which cannot write the call format unaided, names the tool and gives
    # arguments valid for its schema; the policy still adjudicates it.
    r = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=OA_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=40,
    )
    calls = r.choices[0].message.tool_calls
    eq(len(calls), 1)
    eq(calls[0].function.name, "get_weather")
    args = json.loads(calls[0].function.arguments)
    eq(sorted(args), ["city"])
    eq(type(args["city"]), str)
    verdicts = r.model_extra["fak"]["tool_calls"]
    eq([(v["name"], v["verdict"]) for v in verdicts], [("get_weather", "allow")])


def openai_tool_call():
    msgs = [{"role": "user", "content": call_directive("get_weather", {"city": "Paris"})}]
    r = om.chat.completions.create(model="mock", messages=msgs, tools=OA_TOOLS)
    c = r.choices[0]
    eq(c.finish_reason, "tool_calls")
    eq(c.message.content, "Let me look.")
    eq(len(c.message.tool_calls), 1)
    call = c.message.tool_calls[0]
    eq(call.function.name, "get_weather")
    eq(json.loads(call.function.arguments), {"city": "Paris"})
    eq(r.model_extra["fak"]["tool_calls"][0]["verdict"], "allow")
    # The result goes back; the next turn is served.
    msgs += [c.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    r2 = om.chat.completions.create(model="mock", messages=msgs, tools=OA_TOOLS)
    eq(r2.choices[0].finish_reason, "stop")


def openai_tool_call_stream():
    msgs = [{"role": "user", "content": call_directive("get_weather", {"city": "Oslo"})}]
    calls, text, finish = {}, "", None
    for ch in om.chat.completions.create(model="mock", messages=msgs, tools=OA_TOOLS, stream=True):
        d = ch.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            e["name"] += tc.function.name or ""
            e["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    eq(text, "Let me look.")
    eq(finish, "tool_calls")
    eq([(c["name"], json.loads(c["arguments"])) for c in calls.values()], [("get_weather", {"city": "Oslo"})])


def openai_denied_and_forced():
    r = om.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": call_directive("delete_files", {"path": "/"})}], tools=OA_TOOLS
    )
    eq(r.choices[0].message.tool_calls, None)
    eq(r.choices[0].finish_reason, "stop")
    eq(r.model_extra["fak"]["tool_calls"][0]["reason"], "DEFAULT_DENY")
    r = om.chat.completions.create(
        model="mock",
        messages=[{"role": "user", "content": "hello"}],
        tools=OA_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    eq(r.choices[0].message.tool_calls[0].function.name, "get_weather")


def anthropic_tool_use():
    msgs = [{"role": "user", "content": call_directive("get_weather", {"city": "Paris"})}]
    r = am.messages.create(model="mock", max_tokens=100, messages=msgs, tools=AN_TOOLS)
    eq(r.stop_reason, "tool_use")
    eq([b.type for b in r.content], ["text", "tool_use"])
    use = r.content[1]
    eq((use.name, use.input), ("get_weather", {"city": "Paris"}))
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]},
    ]
    r2 = am.messages.create(model="mock", max_tokens=100, messages=msgs, tools=AN_TOOLS)
    eq(r2.stop_reason, "end_turn")


def anthropic_tool_use_stream():
    msgs = [{"role": "user", "content": call_directive("get_weather", {"city": "Oslo"})}]
    with am.messages.stream(model="mock", max_tokens=100, messages=msgs, tools=AN_TOOLS) as s:
        final = s.get_final_message()
    eq(final.stop_reason, "tool_use")
    uses = [b for b in final.content if b.type == "tool_use"]
    eq([(u.name, u.input) for u in uses], [("get_weather", {"city": "Oslo"})])
    # A denied call: no tool_use, an explanatory text block.
    msgs = [{"role": "user", "content": call_directive("delete_files", {})}]
    with am.messages.stream(model="mock", max_tokens=100, messages=msgs, tools=AN_TOOLS) as s:
        final = s.get_final_message()
    eq(final.stop_reason, "end_turn")
    eq([b.type for b in final.content if b.type == "tool_use"], [])
    assert "DEFAULT_DENY" in "".join(b.text for b in final.content if b.type == "text"), final


def responses_plain():
    r = oa.responses.create(model=MODEL, input=MESSAGES[0]["content"], temperature=0)
    eq(r.status, "completed")
    eq(r.output_text, TEXT)
    eq(r.usage.input_tokens, N_PROMPT)
    eq(r.usage.output_tokens, N_COMPLETION)
    eq(r.usage.total_tokens, N_PROMPT + N_COMPLETION)
    got = oa.responses.retrieve(r.id)
    eq(got.output_text, TEXT)


def responses_stream():
    text, kinds, final = "", [], None
    for ev in oa.responses.create(model=MODEL, input=MESSAGES[0]["content"], temperature=0, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            final = ev.response
    eq(text, TEXT)
    eq(final.output_text, TEXT)
    eq(kinds[:2], ["response.created", "response.in_progress"])
    eq(final.usage.output_tokens, N_COMPLETION)
    # The SDK's own stream helper accumulates the same Response.
    with oa.responses.stream(model=MODEL, input=MESSAGES[0]["content"], temperature=0) as s:
        eq(s.get_final_response().output_text, TEXT)


def responses_previous_id_reuses_the_cache():
    first = oa.responses.create(model=MODEL, input="What is 2 + 2?", temperature=0, max_output_tokens=16)
    r = oa.responses.create(
        model=MODEL, input="And 3 + 3?", previous_response_id=first.id, temperature=0, max_output_tokens=16
    )
    assert r.usage.input_tokens > first.usage.input_tokens, (r.usage, first.usage)
    # The kept conversation's prompt is read from the KV cache: only the new items are prefilled.
    assert r.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1, r.usage
    try:
        oa.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
        raise AssertionError("expected BadRequestError")
    except openai.BadRequestError as e:
        eq((e.status_code, e.code, e.param), (400, "previous_response_not_found", "previous_response_id"))


WEATHER_CALLS = []


@agents.function_tool
def get_weather(city: str) -> str:
    """Weather for a city."""
    WEATHER_CALLS.append(city)
    return f"18 C in {city}"


def agent():
    agents.set_tracing_disabled(True)
    client = openai_client(MOCK_BASE, async_=True)
    agents.set_default_openai_client(client, use_for_tracing=False)
    # A model id string: the SDK's default provider and model class (Responses API).
    a = agents.Agent(name="weather", instructions="Use the tool.", model="mock", tools=[get_weather])
    return a


def agents_round_trip():
    a = agent()
    WEATHER_CALLS.clear()
    res = asyncio.run(agents.Runner.run(a, call_directive("get_weather", {"city": "Paris"})))
    eq(WEATHER_CALLS, ["Paris"])
    kinds = [type(i).__name__ for i in res.new_items]
    eq(kinds, ["MessageOutputItem", "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"])
    eq(res.new_items[2].output, "18 C in Paris")
    # The mock's reply to a turn ending in a tool result.
    eq(res.final_output, "Hello from the mock engine.")
    eq(len(res.raw_responses), 2)
    # Served by the Responses API (ids `resp_…`), through the default model class.
    assert all(r.response_id.startswith("resp_") for r in res.raw_responses), res.raw_responses
    eq(type(agents.OpenAIProvider().get_model("mock")).__name__, "OpenAIResponsesModel")


def agents_round_trip_streamed():
    a = agent()
    WEATHER_CALLS.clear()

    async def go():
        r = agents.Runner.run_streamed(a, call_directive("get_weather", {"city": "Oslo"}))
        deltas = []
        async for ev in r.stream_events():
            if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta":
                deltas.append(ev.data.delta)
        return r, "".join(deltas)

    res, text = asyncio.run(go())
    eq(WEATHER_CALLS, ["Oslo"])
    eq(text, "Let me look.Hello from the mock engine.")
    eq(res.final_output, "Hello from the mock engine.")
    eq([type(i).__name__ for i in res.new_items][1:3], ["ToolCallItem", "ToolCallOutputItem"])


for name, fn in [
    ("openai chat", openai_chat),
    ("openai chat stream == whole text, usage", openai_stream),
    ("openai cached_tokens on a repeat", openai_cached),
    ("openai logprobs + top_logprobs", openai_logprobs),
    ("openai parse(response_format=Model) and json_object", openai_parse),
    ("openai models.list", openai_models),
    ("models.retrieve and Anthropic models.list, both SDKs", models_retrieve),
    ("openai errors (404, 400 x4, 413, 401)", openai_errors),
    ("openai completions", openai_completions),
    ("openai completions, prompt as token ids", openai_completions_token_ids),
    ("openai n=3: choices by index, greedy alike, seeded choice 0 == n=1, usage", openai_n_choices),
    ("openai n=3 streamed: choices by index, one usage chunk", openai_n_choices_stream),
    ("anthropic messages", anthropic_message),
    ("anthropic stream == whole text", anthropic_stream),
    ("anthropic system + stop_sequences", anthropic_system_and_stop),
    ("anthropic errors (404, 400 x2, 401)", anthropic_errors),
    ("anthropic system message in messages", anthropic_system_in_messages),
    ("anthropic max_tokens=32000 capped to what fits", anthropic_max_tokens_32000),
    ("anthropic prefill continued", anthropic_prefill),
    ("anthropic count_tokens == usage of the same messages", anthropic_count_tokens),
    ("real model: a forced tool call is well-formed", real_model_forced_call_is_well_formed),
    ("mock: openai tool call, result sent back", openai_tool_call),
    ("mock: openai tool call streamed", openai_tool_call_stream),
    ("mock: openai denied call removed, forced tool_choice", openai_denied_and_forced),
    ("mock: anthropic tool_use, tool_result sent back", anthropic_tool_use),
    ("mock: anthropic tool_use streamed, denied call explained", anthropic_tool_use_stream),
    ("responses.create plain text, retrieve", responses_plain),
    ("responses.create streamed == whole text", responses_stream),
    ("responses previous_response_id: cached_tokens on the follow-up", responses_previous_id_reuses_the_cache),
    ("mock: agents SDK (Responses model) tool round trip, Runner.run", agents_round_trip),
    ("mock: agents SDK tool round trip, Runner.run_streamed", agents_round_trip_streamed),
]:
    check(name, fn)

finish("sdk")
