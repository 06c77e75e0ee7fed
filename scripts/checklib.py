"""What scripts/sdk_check.py and scripts/clients_check.py share: the servers they are
pointed at, the committed HF e2e fixture they compare with, and the check runner.

Environment (set by scripts/sdk-check): FAK_BASE (`fak serve` on the real
SmolLM2-135M-Instruct, http://HOST:PORT), FAK_MOCK_BASE (`fak serve --engine mock`) and
FAK_SDK_KEY (the key both were started with).
"""

import json
import os
import pathlib
import sys

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
