"""Ask llama.cpp's server the same questions directly and through `fak serve --engine
openai-upstream`, with the official `openai` Python SDK, and check that the answers are
equal.

Run by scripts/llamacpp-server-check (which starts both servers); expects LLAMA_BASE and
FAK_BASE (http://HOST:PORT) and MODEL (the name llama.cpp serves the model under). For
each case, at temperature 0 with a fixed max_tokens: a chat completion without
streaming, then with streaming (`stream_options.include_usage` asked of both), each
sent first to llama.cpp and then through fak, after one uncompared request of the same
case so that llama.cpp's prompt cache is alike for all four. Checked: the texts equal (streamed text
concatenated) and the finish reasons equal, for each mode; without streaming, the
usage's `completion_tokens` equal. `prompt_tokens` is compared and reported, but a
difference is a known gap rather than a failure when fak reports 0: llama.cpp's Python
server sends no usage in a stream (it ignores `stream_options`), and fak always streams
from its upstream, so it never learns the prompt's length. One plain-prompt case goes to
/v1/completions the same way. Prints every text, then one `N passed, M failed` line;
exits non-zero on any failure.
"""

import os
import sys

import openai

LLAMA_BASE = os.environ["LLAMA_BASE"]
FAK_BASE = os.environ["FAK_BASE"]
MODEL = os.environ["MODEL"]
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "48"))

CHATS = [
    ("capital", [{"role": "user", "content": "What is the capital of France?"}]),
    ("haiku", [{"role": "user", "content": "Write a haiku about the sea."}]),
    ("colors", [{"role": "user", "content": "List three primary colors."}]),
    (
        "system",
        [
            {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    ),
    (
        "multi-turn",
        [
            {"role": "user", "content": "My name is Ada and I like chess."},
            {"role": "assistant", "content": "Nice to meet you, Ada! Chess is a great game."},
            {"role": "user", "content": "What is my name, and what game do I like?"},
        ],
    ),
    ("non-ascii", [{"role": "user", "content": "Translate « bonjour, ça va ? » into English."}]),
]
COMPLETION_PROMPT = "The three largest cities in Japan are"

direct = openai.OpenAI(base_url=f"{LLAMA_BASE}/v1", api_key="none", max_retries=0, timeout=300)
via = openai.OpenAI(base_url=f"{FAK_BASE}/v1", api_key="none", max_retries=0, timeout=300)

passed, failed, known = 0, 0, 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"ok   {name}")
    else:
        failed += 1
        print(f"FAIL {name}: {detail}")


def chat_whole(client, messages):
    r = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS
    )
    return r.choices[0].message.content or "", r.choices[0].finish_reason, r.usage


def chat_stream(client, messages):
    text, finish, usage = [], None, None
    for c in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            text.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    return "".join(text), finish, usage


def completion_whole(client):
    r = client.completions.create(
        model=MODEL, prompt=COMPLETION_PROMPT, temperature=0, max_tokens=MAX_TOKENS
    )
    return r.choices[0].text, r.choices[0].finish_reason, r.usage


def completion_stream(client):
    text, finish, usage = [], None, None
    for c in client.completions.create(
        model=MODEL,
        prompt=COMPLETION_PROMPT,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            text.append(ch.text or "")
            finish = ch.finish_reason or finish
    return "".join(text), finish, usage


def usage_str(u):
    return "none" if u is None else f"prompt {u.prompt_tokens}, completion {u.completion_tokens}"


def compare(name, mode, d, v):
    """d, v: (text, finish_reason, usage) from llama.cpp and through fak."""
    global known
    (dt, df, du), (vt, vf, vu) = d, v
    print(f"--- {name} ({mode})")
    print(f"llama.cpp: {dt!r}")
    print(f"via fak:   {vt!r}")
    print(f"usage: llama.cpp {usage_str(du)}; via fak {usage_str(vu)}")
    check(f"{name} {mode}: text equal", dt == vt, f"{dt!r} != {vt!r}")
    check(f"{name} {mode}: finish_reason equal", df == vf, f"{df!r} != {vf!r}")
    if du is None:
        return
    if vu is None:
        check(f"{name} {mode}: usage reported through fak", False, "fak sent no usage")
        return
    check(
        f"{name} {mode}: completion_tokens equal",
        du.completion_tokens == vu.completion_tokens,
        f"{du.completion_tokens} != {vu.completion_tokens}",
    )
    if du.prompt_tokens == vu.prompt_tokens:
        check(f"{name} {mode}: prompt_tokens equal", True)
    elif vu.prompt_tokens == 0:
        known += 1
        print(f"gap  {name} {mode}: prompt_tokens {du.prompt_tokens} from llama.cpp, 0 through fak "
              "(the upstream sends no usage in streams)")
    else:
        check(f"{name} {mode}: prompt_tokens equal", False, f"{du.prompt_tokens} != {vu.prompt_tokens}")


# Each case is asked once first, uncompared: llama.cpp's answer can depend on how much
# of the prompt its cache already holds (the whole prompt evaluated at once can end
# differently from its last token alone), so every compared request should find the
# same cache, the whole prompt in it.
for name, messages in CHATS:
    chat_whole(direct, messages)
    compare(name, "chat", chat_whole(direct, messages), chat_whole(via, messages))
    compare(name, "chat stream", chat_stream(direct, messages), chat_stream(via, messages))
completion_whole(direct)
compare("completion", "plain", completion_whole(direct), completion_whole(via))
compare("completion", "plain stream", completion_stream(direct), completion_stream(via))

print(f"{passed} passed, {failed} failed, {known} known usage gaps "
      f"({len(CHATS)} chat cases and 1 plain prompt, max_tokens {MAX_TOKENS}, temperature 0)")
sys.exit(1 if failed else 0)
