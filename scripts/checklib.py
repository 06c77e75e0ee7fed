"""What scripts/sdk_check.py, scripts/clients_check.py and scripts/structured_check.py
share: the servers they are pointed at, the clients made for them (each client's own
constructor, with fak's key and no retries), the committed HF e2e fixture they compare
with, and the check runner.

Environment (set by scripts/sdk-check): FAK_BASE (`fak serve` on the real
SmolLM2-135M-Instruct, http://HOST:PORT), FAK_MOCK_BASE (`fak serve --engine mock`) and
FAK_SDK_KEY (the key both were started with).
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
# HF's greedy reply to one user turn (testdata/text/smollm2-135m-instruct/e2e.json).
CASE = json.loads((ROOT / "testdata/text/smollm2-135m-instruct/e2e.json").read_text())["cases"][0]
MESSAGES = CASE["messages"]
TEXT = CASE["text"]
# The mock engine's reply to a turn that asks for nothing in particular.
MOCK_REPLY = "Hello from the mock engine."

passed, failed = 0, 0


def openai_client(base=BASE, key=KEY, async_=False):
    """The official SDK's client (`openai.OpenAI`, `openai.AsyncOpenAI` when `async_`) on
    `base`'s OpenAI-compatible API."""
    import openai

    cls = openai.AsyncOpenAI if async_ else openai.OpenAI
    return cls(base_url=f"{base}/v1", api_key=key, max_retries=0)


def anthropic_client(base=BASE, key=KEY):
    """The official SDK's `anthropic.Anthropic` on `base`'s Messages API."""
    import anthropic

    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def pydantic_model(base, model, responses=False):
    """A pydantic-ai model on fak (`OpenAIChatModel`, or with `responses` its Responses
    API class `OpenAIResponsesModel`), over the SDK's async client."""
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    cls = OpenAIResponsesModel if responses else OpenAIChatModel
    return cls(model, provider=OpenAIProvider(openai_client=openai_client(base, async_=True)))


def chat_openai(base, model, responses=False, **kwargs):
    """LangChain's `ChatOpenAI` on fak at temperature 0; `responses`:
    `use_responses_api=True`, whose message content is a list of blocks (`.text` joins
    their text). `kwargs` go to `ChatOpenAI` (e.g. `max_tokens`)."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=model,
        base_url=f"{base}/v1",
        api_key=KEY,
        temperature=0,
        max_retries=0,
        use_responses_api=responses,
        **kwargs,
    )


def llm_models():
    """Registers fak's two servers as OpenAI-compatible models of the `llm` CLI and
    library in a fresh llm user dir (llm's documented `extra-openai-models.yaml`), with
    the key in its keys.json: `fak-real` (tools, and `supports_schema` so that `--schema`
    is sent as `response_format`) and `fak-mock`. Does nothing when LLM_USER_PATH is set
    (a caller already made one)."""
    if os.environ.get("LLM_USER_PATH"):
        return
    d = tempfile.mkdtemp(prefix="llm-user-")
    os.environ["LLM_USER_PATH"] = d
    pathlib.Path(d, "keys.json").write_text(json.dumps({"fak": KEY}))
    pathlib.Path(d, "extra-openai-models.yaml").write_text(
        f"- model_id: fak-real\n  model_name: {MODEL}\n  api_base: {BASE}/v1\n  api_key_name: fak\n"
        f"  supports_tools: true\n  supports_schema: true\n"
        f"- model_id: fak-mock\n  model_name: mock\n  api_base: {MOCK_BASE}/v1\n  api_key_name: fak\n"
        f"  supports_tools: true\n"
    )


def check(name, fn):
    """Runs one check; an exception fails it (printed) and the run goes on."""
    global passed, failed
    try:
        fn()
        passed += 1
        print(f"ok   {name}")
    except Exception as e:  # noqa: BLE001 - report every failure and go on
        failed += 1
        print(f"FAIL {name}: {type(e).__name__}: {e}")


def finish(label):
    """Prints `LABEL: N passed, M failed` and exits non-zero on any failure."""
    print(f"{label}: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


def eq(a, b):
    assert a == b, f"{a!r} != {b!r}"


def raises(exc, status, fn, needle=None):
    """`fn()` must raise `exc` with HTTP `status` (and `needle` in its message)."""
    try:
        fn()
    except exc as e:
        eq(e.status_code, status)
        if needle is not None:
            assert needle in str(e), f"{needle!r} not in {e}"
        return
    raise AssertionError(f"expected {exc.__name__}")


def call_directive(name, args):
    """A mock prompt whose reply is `Let me look.` and one tool call."""
    return "echo Let me look. <tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
