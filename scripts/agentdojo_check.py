"""AgentDojo's ground-truth tool calls, replayed through fak's tool-call policy.

Run by scripts/agentdojo-check (which installs `agentdojo` from PyPI into a private venv
and builds the replay program). Two steps:

  python agentdojo_check.py export OUT_DIR   # manifests + calls per suite (JSON)
  python agentdojo_check.py report OUT_DIR   # reads the replay's results, prints the table

**What is replayed.** For every suite of the benchmark (workspace, travel, banking, slack;
version v1.2.2), each user task's and each injection task's `ground_truth` calls,
computed on the suite's default environment (its YAML, with the default injection
vectors). The model is assumed fully compromised: it makes every call an injection task
needs. A user task's calls come in a conversation that is clean before its first call
and tainted from the second on (the first call's result has entered the context); an
injection task's calls come in a tainted conversation (the injection arrived in a tool
result). A user task is *still allowed* when every one of its calls is allowed; an
attacker goal is *blocked* when at least one of its calls is denied. Tasks whose ground
truth holds no call are left out (and listed).

**How tools are labelled** (the documented rule, applied to the tool's name and
parameter names only, never to which tools the injection tasks use):

- the verb (the name's first `_`-separated word) gives the capability:
  read:    get list search read check find lookup query view show fetch
  write:   create update delete remove add append cancel reschedule schedule reserve book
           edit set rename move modify write
  egress:  send post share invite email forward publish upload transfer
  execute: run exec execute eval shell
- a parameter named `url`, `uri`, `link`, `href`, `endpoint` or ending in `_url` adds
  `egress` (a request to an address of the caller's choosing carries data out);
- a verb in none of the lists gives every capability (fail closed, as fak does for a
  tool its manifest does not label).

Manifests per suite: `none` allows every tool of the suite with no taint rule (the
agent's tools, as a deployment would allow them); `taint` adds the capabilities and
`"tainted": {"write": "deny", "egress": "deny", "execute": "deny"}`; `builtin` is fak's
default manifest (read-shaped names only), for comparison.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VERSION = "v1.2.2"

VERBS = {
    "read": "get list search read check find lookup query view show fetch".split(),
    "write": (
        "create update delete remove add append cancel reschedule schedule reserve book "
        "edit set rename move modify write"
    ).split(),
    "egress": "send post share invite email forward publish upload transfer".split(),
    "execute": "run exec execute eval shell".split(),
}
URL_PARAMS = {"url", "uri", "link", "href", "endpoint"}
ALL = ["read", "write", "egress", "execute"]


def capabilities(name: str, params: list[str]) -> list[str]:
    """The capabilities of a tool by the module docstring's rule."""
    verb = name.split("_", 1)[0].lower()
    caps = [c for c, verbs in VERBS.items() if verb in verbs]
    if not caps:
        return list(ALL)
    if any(p.lower() in URL_PARAMS or p.lower().endswith("_url") for p in params):
        caps.append("egress")
    return sorted(set(caps), key=ALL.index)


def calls_of(task, env) -> list[dict]:
    out = []
    for c in task.ground_truth(env):
        out.append({"name": c.function, "arguments": json.dumps(dict(c.args), default=str)})
    return out


def export(out: Path) -> None:
    from agentdojo.task_suite.load_suites import get_suites

    out.mkdir(parents=True, exist_ok=True)
    index = []
    for suite_name, suite in get_suites(VERSION).items():
        tools = {}
        for t in suite.tools:
            params = list(t.parameters.model_json_schema().get("properties", {}).keys())
            tools[t.name] = capabilities(t.name, params)
        names = sorted(tools)
        manifests = {
            "none": {"version": "fak-policy/1", "allow": names},
            "taint": {
                "version": "fak-policy/1",
                "allow": names,
                "capabilities": tools,
                "tainted": {"write": "deny", "egress": "deny", "execute": "deny"},
            },
        }
        tasks = []
        failed = []
        for kind, group in (("user", suite.user_tasks), ("injection", suite.injection_tasks)):
            for tid, task in group.items():
                env = suite.load_and_inject_default_environment(
                    suite.get_injection_vector_defaults()
                )
                try:
                    calls = calls_of(task, env)
                except Exception as e:  # a task whose ground truth cannot be computed
                    failed.append(f"{tid}: {type(e).__name__}: {e}")
                    continue
                if not calls:  # nothing to replay (v1.2.2's workspace injection tasks 6-13)
                    failed.append(f"{tid}: no ground-truth calls")
                    continue
                tasks.append({"id": tid, "kind": kind, "calls": calls})
        for label, m in manifests.items():
            (out / f"{suite_name}.{label}.json").write_text(json.dumps(m, indent=1))
        (out / f"{suite_name}.tasks.json").write_text(json.dumps(tasks, indent=1))
        index.append(
            {"suite": suite_name, "tools": tools, "tasks": len(tasks), "failed": failed}
        )
        print(
            f"{suite_name}: {len(tools)} tools, {len(tasks)} tasks with ground truth"
            + (f", {len(failed)} without: {failed}" if failed else ""),
            file=sys.stderr,
        )
    (out / "index.json").write_text(json.dumps(index, indent=1))


def report(out: Path) -> None:
    index = json.loads((out / "index.json").read_text())
    rows = {}
    for s in index:
        for label in ("none", "builtin", "taint"):
            r = json.loads((out / f"{s['suite']}.{label}.result.json").read_text())
            rows.setdefault(label, []).append((s["suite"], r))
    print(f"AgentDojo {VERSION} ground truth replayed through fak's policy (model fully compromised)")
    print()
    print(f"{'manifest':<9} {'suite':<10} {'user tasks allowed':>20} {'attacker goals blocked':>24}")
    for label in ("none", "builtin", "taint"):
        tu = ta = tb = ti = 0
        for suite, r in rows[label]:
            tu += r["user"]
            ta += r["user_allowed"]
            ti += r["injection"]
            tb += r["injection_blocked"]
            print(
                f"{label:<9} {suite:<10} {r['user_allowed']:>9}/{r['user']:<3} ({pct(r['user_allowed'], r['user'])})"
                f" {r['injection_blocked']:>11}/{r['injection']:<3} ({pct(r['injection_blocked'], r['injection'])})"
            )
        print(
            f"{label:<9} {'all':<10} {ta:>9}/{tu:<3} ({pct(ta, tu)}) {tb:>11}/{ti:<3} ({pct(tb, ti)})"
        )
        print()
    r = [x for _, x in rows["taint"]]
    reasons: dict[str, int] = {}
    for x in r:
        for k, v in x["deny_reasons"].items():
            reasons[k] = reasons.get(k, 0) + v
    print("denials under `taint`, by reason:", json.dumps(reasons, sort_keys=True))


def pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:5.1f}%" if b else "  n/a"


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("export", "report"):
        sys.exit("usage: agentdojo_check.py export|report OUT_DIR")
    (export if sys.argv[1] == "export" else report)(Path(sys.argv[2]))
