"""Drive `fak serve` with agent frameworks as their users write them: pydantic-ai, LangChain
(`langchain-openai`) and `llm`, each pointed at fak's OpenAI-compatible API by base URL.

Run by scripts/sdk-check (which starts the servers and installs the pinned packages);
expects FAK_BASE (`fak serve` on the real SmolLM2-135M-Instruct), FAK_MOCK_BASE (`fak serve
--engine mock`) and FAK_SDK_KEY. Checks, for each framework:

- chat on the real model at temperature 0: the reply equals the committed HF e2e fixture's
  text (testdata/text/smollm2-135m-instruct/e2e.json), streamed and not where the
  framework streams;
- a tool round trip on the mock engine (whose replies go through the same tool-call parser
  as the in-kernel driver's): the framework's own tool-calling loop runs a Python tool with
  the arguments the model proposed, sends its result back, and returns the final answer
  (the mock's default reply);
- a call the policy denies (`delete_files`, DEFAULT_DENY under the built-in policy) never
  reaches the framework's tool.

Prints one `N passed, M failed` line and exits non-zero on any failure.
"""

import json
import os
import pathlib
import sys
import tempfile

BASE = os.environ["FAK_BASE"]
MOCK_BASE = os.environ["FAK_MOCK_BASE"]
KEY = os.environ["FAK_SDK_KEY"]
MODEL = "smollm2-135m-instruct"
ROOT = pathlib.Path(__file__).resolve().parent.parent
CASE = json.loads((ROOT / "testdata/text/smollm2-135m-instruct/e2e.json").read_text())["cases"][0]
QUESTION = CASE["messages"][0]["content"]
assert [m["role"] for m in CASE["messages"]] == ["user"], "the fixture is one user turn"
TEXT = CASE["text"]
MOCK_REPLY = "Hello from the mock engine."

passed, failed = 0, 0


def check(name, fn):
    global passed, failed
    try:
        fn()
        passed += 1
        print(f"ok   {name}")
    except Exception as e:  # noqa: BLE001 - report every failure and go on
        failed += 1
        print(f"FAIL {name}: {type(e).__name__}: {e}")


def eq(a, b):
    assert a == b, f"{a!r} != {b!r}"


def call_directive(name, args):
    """A mock prompt whose reply is one tool call."""
    return "echo Let me look. <tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


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


def pydantic_agent(base, model, tools=()):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    m = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client))
    return Agent(m, tools=list(tools), model_settings={"temperature": 0})


def pydantic_chat():
    r = pydantic_agent(BASE, MODEL).run_sync(QUESTION)
    eq(r.output, TEXT)


def pydantic_chat_stream():
    import asyncio

    async def go():
        async with pydantic_agent(BASE, MODEL).run_stream(QUESTION) as s:
            return await s.get_output()

    eq(asyncio.run(go()), TEXT)


def pydantic_tool_round_trip():
    ran.clear()
    r = pydantic_agent(MOCK_BASE, "mock", [get_weather]).run_sync(call_directive("get_weather", {"city": "Paris"}))
    eq(ran, [("get_weather", "Paris")])
    eq(r.output, MOCK_REPLY)


def pydantic_denied():
    ran.clear()
    r = pydantic_agent(MOCK_BASE, "mock", [get_weather, delete_files]).run_sync(
        call_directive("delete_files", {"path": "/"})
    )
    eq(ran, [])
    # The denied call is removed from the reply (its verdict is in the `fak` field, which
    # pydantic-ai does not surface); the text before it is the answer.
    eq(r.output, "Let me look.")


# ---------------------------------------------------------------- LangChain


def chat_openai(base, model):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model, base_url=f"{base}/v1", api_key=KEY, temperature=0, max_retries=0)


def langchain_chat():
    eq(chat_openai(BASE, MODEL).invoke(QUESTION).content, TEXT)


def langchain_chat_stream():
    eq("".join(c.content for c in chat_openai(BASE, MODEL).stream(QUESTION)), TEXT)


def langchain_tool_round_trip():
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool

    ran.clear()
    weather = tool(get_weather)
    llm = chat_openai(MOCK_BASE, "mock").bind_tools([weather])
    msgs = [HumanMessage(call_directive("get_weather", {"city": "Oslo"}))]
    ai = llm.invoke(msgs)
    eq([(c["name"], c["args"]) for c in ai.tool_calls], [("get_weather", {"city": "Oslo"})])
    msgs.append(ai)
    for c in ai.tool_calls:
        msgs.append(weather.invoke(c))  # a ToolMessage carrying the call's id
    eq(ran, [("get_weather", "Oslo")])
    eq(llm.invoke(msgs).content, MOCK_REPLY)


def langchain_tool_stream():
    from langchain_core.tools import tool

    llm = chat_openai(MOCK_BASE, "mock").bind_tools([tool(get_weather)])
    acc = None
    for c in llm.stream(call_directive("get_weather", {"city": "Rome"})):
        acc = c if acc is None else acc + c
    eq([(c["name"], c["args"]) for c in acc.tool_calls], [("get_weather", {"city": "Rome"})])


def langchain_denied():
    from langchain_core.tools import tool

    llm = chat_openai(MOCK_BASE, "mock").bind_tools([tool(get_weather), tool(delete_files)])
    ai = llm.invoke(call_directive("delete_files", {"path": "/"}))
    eq(ai.tool_calls, [])
    eq(ai.response_metadata.get("finish_reason"), "stop")


# ---------------------------------------------------------------- llm


def llm_models():
    """Registers fak's two servers as OpenAI-compatible models in a fresh llm user dir
    (llm's documented `extra-openai-models.yaml`), with the key in its keys.json."""
    d = tempfile.mkdtemp(prefix="llm-user-")
    os.environ["LLM_USER_PATH"] = d
    pathlib.Path(d, "keys.json").write_text(json.dumps({"fak": KEY}))
    pathlib.Path(d, "extra-openai-models.yaml").write_text(
        f"- model_id: fak-real\n  model_name: {MODEL}\n  api_base: {BASE}/v1\n  api_key_name: fak\n"
        f"  supports_tools: true\n"
        f"- model_id: fak-mock\n  model_name: mock\n  api_base: {MOCK_BASE}/v1\n  api_key_name: fak\n"
        f"  supports_tools: true\n"
    )


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
        ("langchain chat", langchain_chat),
        ("langchain chat streamed", langchain_chat_stream),
        ("langchain tool round trip", langchain_tool_round_trip),
        ("langchain tool call streamed", langchain_tool_stream),
        ("langchain denied call never proposed", langchain_denied),
        ("llm chat", llm_chat),
        ("llm chat streamed", llm_chat_stream),
        ("llm tool round trip", llm_tool_round_trip),
    ]:
        check(name, fn)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
