"""Drive `fak serve` with agent frameworks as their users write them: pydantic-ai, LangChain
(`langchain-openai`) and `llm`, each pointed at fak's OpenAI-compatible API by base URL.

Run by scripts/sdk-check (which starts the servers and installs the pinned packages; the
environment it sets: scripts/checklib.py). pydantic-ai and LangChain run in both their
OpenAI modes: Chat Completions (`OpenAIChatModel`, `ChatOpenAI`) and the Responses API
(`OpenAIResponsesModel`, `ChatOpenAI(use_responses_api=True)`; each of their replies must
carry a `resp_` id: it came from `/v1/responses`). Checks, for each framework and mode:

- chat on the real model at temperature 0: the reply equals the committed HF e2e fixture's
  text (testdata/text/smollm2-135m-instruct/e2e.json), streamed and not where the
  framework streams;
- a tool round trip on the mock engine (whose replies go through the same tool-call parser
  as the in-kernel driver's): the framework's own tool-calling loop runs a Python tool with
  the arguments the model proposed, sends its result back, and returns the final answer
  (the mock's default reply);
- a call the policy denies (`delete_files`, DEFAULT_DENY under the built-in policy) never
  reaches the framework's tool.

Then structured outputs through every client (scripts/structured_check.py's, pydantic-ai
`NativeOutput`, LangChain `with_structured_output` json_schema and json_mode, `llm
--schema`, the SDKs' `parse`) on two prompts each, every output checked against its schema.

Prints one `clients: N passed, M failed` line and exits non-zero on any failure.
"""

import asyncio

import structured_check
from checklib import (
    BASE,
    MESSAGES,
    MOCK_BASE,
    MOCK_REPLY,
    MODEL,
    TEXT,
    call_directive,
    chat_openai,
    check,
    eq,
    finish,
    llm_models,
    pydantic_model,
)

QUESTION = MESSAGES[0]["content"]
assert [m["role"] for m in MESSAGES] == ["user"], "the fixture is one user turn"


# What the tools saw: each framework's loop must call them with the model's arguments.
ran = []


def get_weather(city: str) -> str:
    """Weather for a city."""
    ran.append(("get_weather", city))
    return f"18 C in {city}"


def delete_files(path: str) -> str:
    """Delete files under a path."""
    ran.append(("delete_files", path))
    return "deleted"


# ---------------------------------------------------------------- pydantic-ai


def pydantic_agent(base, model, tools=(), responses=False):
    """An Agent on fak; `responses`: pydantic-ai's Responses API model class."""
    from pydantic_ai import Agent

    m = pydantic_model(base, model, responses)
    return Agent(m, tools=list(tools), model_settings={"temperature": 0})


def pydantic_served_by(result, responses):
    """Every model reply of the run came from the API of the mode: `resp_…` ids from
    /v1/responses, `chatcmpl-…` from /v1/chat/completions."""
    from pydantic_ai.messages import ModelResponse

    ids = [m.provider_response_id for m in result.all_messages() if isinstance(m, ModelResponse)]
    prefix = "resp_" if responses else "chatcmpl-"
    assert ids and all(i and i.startswith(prefix) for i in ids), ids


def pydantic_chat(responses=False):
    r = pydantic_agent(BASE, MODEL, responses=responses).run_sync(QUESTION)
    eq(r.output, TEXT)
    pydantic_served_by(r, responses)


def pydantic_chat_stream(responses=False):
    async def go():
        async with pydantic_agent(BASE, MODEL, responses=responses).run_stream(QUESTION) as s:
            return await s.get_output()

    eq(asyncio.run(go()), TEXT)


def pydantic_tool_round_trip(responses=False):
    ran.clear()
    agent = pydantic_agent(MOCK_BASE, "mock", [get_weather], responses=responses)
    r = agent.run_sync(call_directive("get_weather", {"city": "Paris"}))
    eq(ran, [("get_weather", "Paris")])
    eq(r.output, MOCK_REPLY)
    pydantic_served_by(r, responses)


def pydantic_denied(responses=False):
    ran.clear()
    r = pydantic_agent(MOCK_BASE, "mock", [get_weather, delete_files], responses=responses).run_sync(
        call_directive("delete_files", {"path": "/"})
    )
    eq(ran, [])
    # The denied call is removed from the reply (its verdict is in the `fak` field, which
    # pydantic-ai does not surface); the answer is the text before it and the sentence
    # saying why the call was not passed on.
    eq(
        r.output,
        "Let me look.\n\n[fak] The tool call 'delete_files' was not passed on: "
        "DEFAULT_DENY (no rule allows 'delete_files').",
    )


# ---------------------------------------------------------------- LangChain


def langchain_from_responses(ai):
    """The reply came from /v1/responses (a Response's `resp_…` id)."""
    rid = ai.response_metadata.get("id")
    assert rid and rid.startswith("resp_"), ai.response_metadata


def langchain_chat(responses=False):
    ai = chat_openai(BASE, MODEL, responses).invoke(QUESTION)
    eq(ai.text, TEXT)
    if responses:
        langchain_from_responses(ai)


def langchain_chat_stream(responses=False):
    eq("".join(c.text for c in chat_openai(BASE, MODEL, responses).stream(QUESTION)), TEXT)


def langchain_tool_round_trip(responses=False):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool

    ran.clear()
    weather = tool(get_weather)
    llm = chat_openai(MOCK_BASE, "mock", responses).bind_tools([weather])
    msgs = [HumanMessage(call_directive("get_weather", {"city": "Oslo"}))]
    ai = llm.invoke(msgs)
    eq([(c["name"], c["args"]) for c in ai.tool_calls], [("get_weather", {"city": "Oslo"})])
    msgs.append(ai)
    for c in ai.tool_calls:
        msgs.append(weather.invoke(c))  # a ToolMessage carrying the call's id
    eq(ran, [("get_weather", "Oslo")])
    final = llm.invoke(msgs)
    eq(final.text, MOCK_REPLY)
    if responses:
        langchain_from_responses(ai)
        langchain_from_responses(final)


def langchain_tool_stream(responses=False):
    from langchain_core.tools import tool

    llm = chat_openai(MOCK_BASE, "mock", responses).bind_tools([tool(get_weather)])
    acc = None
    for c in llm.stream(call_directive("get_weather", {"city": "Rome"})):
        acc = c if acc is None else acc + c
    eq([(c["name"], c["args"]) for c in acc.tool_calls], [("get_weather", {"city": "Rome"})])
    eq(acc.text, "Let me look.")


def langchain_denied(responses=False):
    from langchain_core.tools import tool

    llm = chat_openai(MOCK_BASE, "mock", responses).bind_tools([tool(get_weather), tool(delete_files)])
    ai = llm.invoke(call_directive("delete_files", {"path": "/"}))
    eq(ai.tool_calls, [])
    if responses:
        eq(ai.response_metadata.get("status"), "completed")
    else:
        eq(ai.response_metadata.get("finish_reason"), "stop")


# ---------------------------------------------------------------- llm


def llm_chat():
    import llm

    eq(llm.get_model("fak-real").prompt(QUESTION, temperature=0, stream=False).text(), TEXT)


def llm_chat_stream():
    import llm

    eq("".join(llm.get_model("fak-real").prompt(QUESTION, temperature=0)), TEXT)


def llm_tool_round_trip():
    import llm

    ran.clear()
    chain = llm.get_model("fak-mock").chain(call_directive("get_weather", {"city": "Lima"}), tools=[get_weather])
    # llm's chain joins the two replies' text with a space.
    eq(chain.text(), "Let me look. " + MOCK_REPLY)
    eq(ran, [("get_weather", "Lima")])


def main():
    llm_models()
    for name, fn in [
        ("pydantic-ai chat", pydantic_chat),
        ("pydantic-ai chat streamed", pydantic_chat_stream),
        ("pydantic-ai tool round trip", pydantic_tool_round_trip),
        ("pydantic-ai denied call never runs", pydantic_denied),
        ("pydantic-ai responses: chat", lambda: pydantic_chat(responses=True)),
        ("pydantic-ai responses: chat streamed", lambda: pydantic_chat_stream(responses=True)),
        ("pydantic-ai responses: tool round trip", lambda: pydantic_tool_round_trip(responses=True)),
        ("pydantic-ai responses: denied call never runs", lambda: pydantic_denied(responses=True)),
        ("langchain chat", langchain_chat),
        ("langchain chat streamed", langchain_chat_stream),
        ("langchain tool round trip", langchain_tool_round_trip),
        ("langchain tool call streamed", langchain_tool_stream),
        ("langchain denied call never proposed", langchain_denied),
        ("langchain responses: chat", lambda: langchain_chat(responses=True)),
        ("langchain responses: chat streamed", lambda: langchain_chat_stream(responses=True)),
        ("langchain responses: tool round trip", lambda: langchain_tool_round_trip(responses=True)),
        ("langchain responses: tool call streamed", lambda: langchain_tool_stream(responses=True)),
        ("langchain responses: denied call never proposed", lambda: langchain_denied(responses=True)),
        ("llm chat", llm_chat),
        ("llm chat streamed", llm_chat_stream),
        ("llm tool round trip", llm_tool_round_trip),
    ]:
        check(name, fn)
    # Structured outputs through each client, on a few prompts (the full run:
    # scripts/structured-check).
    structured_check.run_in_ci(check)
    finish("clients")


if __name__ == "__main__":
    main()
