#!/usr/bin/env python3
"""A conversation past the model's context window through `fak serve`, on loopback only.

For each mode of --modes (default `rebuild,shift`), starts `fak serve --context-overflow
MODE --kv-persist DIR` (the binary given by --fak, the default model unless --model,
--weights native unless told) and holds a conversation of --turns turns (default 60)
through /v1/chat/completions at temperature 0: a short system message, then each turn a
user message of about 165 tokens (generated below, deterministic, different each turn)
and `max_tokens` --max-tokens (default 32), each request sending the whole history with
the assistant's replies. The history passes the window (8,192 tokens for SmolLM2) a
dozen or more turns before the end. Each turn records usage.prompt_tokens,
usage.prompt_tokens_details.cached_tokens, completion_tokens, the request's wall time,
and the whole history's length (/v1/messages/count_tokens of the same conversation,
which does not cut it). A turn whose prompt is shorter than the previous turn's is a
turn where the cut moved (the server dropped more of the oldest turns).

Then the control: a server started with `--context-overflow error` is sent the whole
history of the first turn where the rebuild run's cut moved; it must refuse it (HTTP
400, its message naming the numbers). The same history with the request field
`"context_overflow": "rebuild"` to that server must succeed with the prompt the rebuild
run had at that turn (the per-request field overriding the server's default).

Prints a table per mode (the turns where the cut moved and the turn before each), the
largest prompt, the median request time before and after the wall, and shift against
rebuild at the cut turns. Exits non-zero on any HTTP error in a conversation, if the
history never passes the window, if no cut is seen, if a turn after the wall that is
not a cut reuses less than the conversation the last cut kept (the cut did not stick: the
turn prefilled the kept turns again), if a server does not exit 0 on SIGTERM, or if
the control is not refused with a 400.

Standard library only; every loop is bounded in count and time; every address is
127.0.0.1. Each server's log is kept under the run's temporary folder, printed on a
failure.
"""

import argparse
import glob
import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

KEY = "context-wall-key"
SERVERS = []  # every server started, stopped on the way out

SYSTEM = "You are Quarry, the assistant of a team of field geologists. Answer in one or two sentences."

SITES = ["north ridge", "river cut", "old quarry", "east slope", "salt flat", "glacier toe", "fault scarp", "dry wash"]
ROCKS = ["granite", "basalt", "schist", "quartzite", "feldspar", "mica", "sandstone", "shale",
         "limestone", "gneiss", "obsidian", "pumice", "slate", "marble", "dolomite", "chert"]
COLOURS = ["grey", "pink", "black", "white", "red", "green", "buff", "banded"]
GRAINS = ["fine", "medium", "coarse", "glassy"]
QUESTIONS = [
    "Which rock did we log most often today, and what does that suggest about the site?",
    "Which of today's samples would you send to the laboratory first, and why?",
    "What is the most likely order in which these layers were laid down?",
    "Which observation today surprises you most, given the earlier field notes?",
    "What should the team look for tomorrow to confirm today's reading of the outcrop?",
]


def user_message(i):
    """Turn `i`'s user message: about 165 tokens of field notes and a question, the
    same for the same `i` and different for each."""
    site = SITES[i % len(SITES)]
    parts = [f"Field note {i}, {site}, station {100 + 7 * i}:"]
    for k in range(6):
        rock = ROCKS[(i * 5 + k * 3) % len(ROCKS)]
        colour = COLOURS[(i + k) % len(COLOURS)]
        grain = GRAINS[(i * 3 + k) % len(GRAINS)]
        depth = (i * 13 + k * 29) % 90 + 1
        dip = (i * 17 + k * 11) % 60 + 5
        parts.append(f"sample {k + 1} is {colour} {grain}-grained {rock} at {depth} cm, dipping {dip} degrees;")
    parts.append(QUESTIONS[i % len(QUESTIONS)])
    return " ".join(parts)


def log_tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


class HttpError(Exception):
    def __init__(self, status, body):
        super().__init__(f"HTTP {status}: {body[:400]!r}")
        self.status = status
        self.body = body


class Server:
    """One `fak serve` on a free loopback port (--port 0), its stderr in `log`."""

    def __init__(self, fak, extra, log):
        self.log = log
        SERVERS.append(self)
        self.proc = subprocess.Popen(
            [fak, "serve", "--host", "127.0.0.1", "--port", "0", "--api-key-env", "FAK_WALL_KEY", *extra],
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            env={**os.environ, "FAK_WALL_KEY": KEY},
            text=True,
        )
        self.port = None
        deadline = time.time() + 300
        while time.time() < deadline and self.port is None:
            line = self.proc.stdout.readline()
            if not line:
                if self.proc.poll() is not None:
                    self.fail(f"fak serve exited with {self.proc.returncode}")
                continue
            if "listening on http://" in line:
                self.port = int(line.split("listening on http://")[1].split()[0].rsplit(":", 1)[1].rstrip("/"))
        if self.port is None:
            self.proc.kill()
            self.fail("fak serve never said where it listens")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        # /health answers 200 once the model is loaded.
        while time.time() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/health")
                r = c.getresponse()
                data = r.read()
                c.close()
                if r.status == 200:
                    self.model = json.loads(data)["models"][0]
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                self.fail(f"fak serve exited with {self.proc.returncode}")
            time.sleep(0.1)
        self.proc.kill()
        self.fail("fak serve never became healthy")

    def fail(self, why):
        sys.exit(f"{why}\n--- {self.log} ---\n{log_tail(self.log)}")

    def stop(self, timeout=120):
        """SIGTERM, then the exit code (killed after `timeout` seconds: None)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return None

    def post(self, path, body):
        """(status, parsed body or raw bytes, seconds)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        t0 = time.perf_counter()
        c.request("POST", path, body=json.dumps(body).encode(), headers=headers())
        r = c.getresponse()
        data = r.read()
        dt = time.perf_counter() - t0
        c.close()
        try:
            data = json.loads(data)
        except ValueError:
            pass
        return r.status, data, dt

    def chat(self, messages, max_tokens, overflow=None):
        """A non-streamed chat completion: (response, seconds); HttpError unless 200."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        if overflow:
            body["context_overflow"] = overflow
        status, data, dt = self.post("/v1/chat/completions", body)
        if status != 200:
            raise HttpError(status, json.dumps(data) if isinstance(data, dict) else data)
        return data, dt

    def count(self, messages):
        """The whole conversation's prompt tokens (Anthropic count_tokens: never cut)."""
        body = {
            "model": self.model,
            "system": messages[0]["content"],
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages[1:]],
        }
        status, data, _ = self.post("/v1/messages/count_tokens", body)
        if status != 200:
            raise HttpError(status, json.dumps(data) if isinstance(data, dict) else data)
        return data["input_tokens"]


def headers():
    return {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}


def cached(usage):
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def fakkv_files(d):
    return sorted(glob.glob(os.path.join(d, "**", "*.fakkv"), recursive=True))


def converse(server, args, label):
    """The conversation: one record per turn, and the message lists sent."""
    messages = [{"role": "system", "content": SYSTEM}]
    rows, sent = [], []
    t_start = time.time()
    for i in range(1, args.turns + 1):
        messages.append({"role": "user", "content": user_message(i)})
        full = server.count(messages)
        try:
            resp, dt = server.chat(messages, args.max_tokens)
        except HttpError as e:
            server.fail(f"{label}: turn {i} (whole history {full} tokens): {e}")
        usage = resp["usage"]
        reply = resp["choices"][0]["message"]["content"]
        sent.append(list(messages))
        messages.append({"role": "assistant", "content": reply})
        rows.append({
            "turn": i,
            "full": full,
            "prompt": usage["prompt_tokens"],
            "cached": cached(usage),
            "completion": usage["completion_tokens"],
            "seconds": dt,
            "reply": reply,
        })
        if args.verbose:
            r = rows[-1]
            print(f"  {label} turn {i:3}: history {full:5}  prompt {r['prompt']:5}  cached {r['cached']:5}  "
                  f"reply {r['completion']:3}  {dt * 1000:8.1f} ms", flush=True)
    print(f"{label}: {args.turns} turns in {time.time() - t_start:.1f} s", flush=True)
    return rows, sent


def cuts(rows):
    """Indices of the turns whose prompt is shorter than the previous turn's."""
    return [j for j in range(1, len(rows)) if rows[j]["prompt"] < rows[j - 1]["prompt"]]


def ms(x):
    return f"{x * 1000:,.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fak", required=True, help="the fak binary")
    ap.add_argument("--model", help="model name or path (default: fak's default model)")
    ap.add_argument("--weights", default="native", choices=["native", "exact"])
    ap.add_argument("--modes", default="rebuild,shift", help="comma-separated: rebuild, shift")
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, help="fak serve --threads")
    ap.add_argument("--kv-budget-mb", type=int, help="fak serve --kv-budget-mb (default: fak's, 512)")
    ap.add_argument("--json", help="write every turn's figures to this file")
    ap.add_argument("--verbose", action="store_true", help="print each turn as it ends")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("rebuild", "shift") for m in modes):
        sys.exit("--modes: rebuild and/or shift")
    if not 2 <= args.turns <= 500:
        sys.exit("--turns must be 2..500")

    extra = ["--weights", args.weights]
    if args.model:
        extra += ["--model", args.model]
    if args.threads:
        extra += ["--threads", str(args.threads)]
    if args.kv_budget_mb is not None:
        extra += ["--kv-budget-mb", str(args.kv_budget_mb)]

    tmp = tempfile.mkdtemp(prefix="fak-context-wall-")
    ok = False
    try:
        ok = run(args, modes, extra, tmp)
    finally:
        for s in SERVERS:
            if s.proc.poll() is None:
                s.stop(timeout=30)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs and folders kept in {tmp}")
    sys.exit(0 if ok else 1)


def run(args, modes, extra, tmp):
    failures = []
    logs = iter(range(1000))

    def start(mode, kv_dir):
        return Server(args.fak, [*extra, "--context-overflow", mode, "--kv-persist", kv_dir],
                      os.path.join(tmp, f"serve-{next(logs)}-{mode}.log"))

    results = {}
    window = None
    for mode in modes:
        kv = os.path.join(tmp, f"kv-{mode}")
        s = start(mode, kv)
        if window is None:
            window = context_window(s)
        rows, sent = converse(s, args, mode)
        rc = s.stop()
        files = fakkv_files(kv)
        print(f"{mode}: SIGTERM: exit {rc}; {len(files)} *.fakkv file(s), "
              f"{sum(os.path.getsize(f) for f in files) / (1 << 20):.1f} MiB", flush=True)
        if rc != 0:
            failures.append(f"{mode}: the server did not exit 0 after SIGTERM (exit {rc}); log {s.log}")
        results[mode] = (rows, sent)

    # The control: the rebuild run's (else the first mode's) first cut turn, whole.
    ref_mode = "rebuild" if "rebuild" in results else modes[0]
    ref_rows, ref_sent = results[ref_mode]
    ref_cuts = cuts(ref_rows)
    control = None
    if ref_cuts:
        j = ref_cuts[0]
        e = start("error", os.path.join(tmp, "kv-error"))
        try:
            e.chat(ref_sent[j], args.max_tokens)
            refused = None
        except HttpError as err:
            refused = err
        try:
            resp, dt = e.chat(ref_sent[j], args.max_tokens, overflow="rebuild")
            override = (resp["usage"]["prompt_tokens"], resp["choices"][0]["message"]["content"], dt, None)
        except HttpError as err:
            override = (None, None, None, err)
        e.stop()
        control = (j, refused, override)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"window": window, "turns": {m: r for m, (r, _) in results.items()}}, f, indent=1)

    print()
    print(f"window: {window} tokens; {args.turns} turns; max_tokens {args.max_tokens}; temperature 0")
    for mode in modes:
        failures += report(mode, results[mode][0], window)

    if len(results) == 2 and "shift" in results and "rebuild" in results:
        compare(results["rebuild"][0], results["shift"][0])

    print()
    if control is None:
        failures.append(f"{ref_mode}: no cut, so no control request")
    else:
        j, refused, (o_prompt, o_reply, o_dt, o_err) = control
        r = ref_rows[j]
        if refused is None:
            failures.append(f"error mode: turn {j + 1}'s whole history ({r['full']} tokens) was not refused")
            print(f"control, --context-overflow error, turn {j + 1}'s whole history ({r['full']} tokens): accepted (expected a 400)")
        else:
            msg = refused.body
            try:
                msg = json.loads(msg)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            print(f"control, --context-overflow error, turn {j + 1}'s whole history ({r['full']} tokens): "
                  f"HTTP {refused.status}: {msg}")
            if refused.status != 400:
                failures.append(f"error mode: HTTP {refused.status}, expected 400")
        if o_err is not None:
            failures.append(f"error-mode server, request field context_overflow=rebuild: {o_err}")
            print(f"  same, \"context_overflow\": \"rebuild\" in the request: {o_err}")
        else:
            same = "the same" if o_reply == r["reply"] else "a different"
            print(f"  same, \"context_overflow\": \"rebuild\" in the request: 200, prompt {o_prompt} tokens "
                  f"(the {ref_mode} run: {r['prompt']}), {ms(o_dt)} ms, {same} reply as the {ref_mode} run's")
            if o_prompt != r["prompt"]:
                failures.append(f"the request field's rebuild kept {o_prompt} tokens, the {ref_mode} server {r['prompt']}")

    for f in failures:
        print(f"FAIL: {f}")
    print("PASS" if not failures else f"{len(failures)} failure(s)")
    return not failures


def context_window(server):
    """The served model's window, from /v1/models."""
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    c.request("GET", "/v1/models", headers=headers())
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    for m in data.get("data", []):
        if m.get("id") == server.model and m.get("context_length"):
            return int(m["context_length"])
    server.fail(f"/v1/models gave no context_length for {server.model}: {data}")


def report(mode, rows, window):
    """Prints one mode's figures; returns its failures."""
    failures = []
    over = [r for r in rows if r["full"] + r["completion"] > window]
    cut_idx = cuts(rows)
    print()
    print(f"== {mode} ==")
    if not over:
        failures.append(f"{mode}: the whole history never passed the window ({max(r['full'] for r in rows)} tokens at most)")
    else:
        print(f"the whole history (+ reply) first passes {window} tokens at turn {over[0]['turn']} "
              f"({over[0]['full']} + {over[0]['completion']}); at turn {rows[-1]['turn']} it is {rows[-1]['full']} tokens")
    if not cut_idx:
        failures.append(f"{mode}: no turn's prompt shrank: no cut seen")
        return failures
    print(f"turns where the cut moved: {', '.join(str(rows[j]['turn']) for j in cut_idx)}")
    print(f"{'turn':>5} {'history':>8} {'prompt':>7} {'cached':>7} {'prefilled':>9} {'reply':>6} {'time ms':>10}")
    for j in cut_idx:
        for r in (rows[j - 1], rows[j]):
            mark = "  <- cut" if r is rows[j] else ""
            print(f"{r['turn']:>5} {r['full']:>8,} {r['prompt']:>7,} {r['cached']:>7,} "
                  f"{r['prompt'] - r['cached']:>9,} {r['completion']:>6} {ms(r['seconds']):>10}{mark}")
    print(f"max prompt tokens: {max(r['prompt'] for r in rows):,} (turn {max(rows, key=lambda r: r['prompt'])['turn']})")
    first = cut_idx[0]
    before = [r["seconds"] for r in rows[:first]]
    last10 = [r["seconds"] for r in rows[max(0, first - 10):first]]
    after = [rows[j]["seconds"] for j in range(first + 1, len(rows)) if j not in cut_idx]
    print(f"median request time: before the wall {ms(statistics.median(before))} ms "
          f"(turns 1-{first}; the 10 before it: {ms(statistics.median(last10))} ms), "
          + (f"after it {ms(statistics.median(after))} ms (turns {first + 2}-{len(rows)}, cut turns left out)"
             if after else "no turn after it"))
    prefilled_after = [rows[j]["prompt"] - rows[j]["cached"] for j in range(first + 1, len(rows)) if j not in cut_idx]
    if prefilled_after:
        print(f"tokens prefilled per turn after the wall (cut turns left out): median "
              f"{statistics.median(prefilled_after):.0f}, max {max(prefilled_after)}")
    # The cut sticks: a turn after the wall that does not move the cut reuses at least
    # the conversation as the last cut left it (else it prefilled the kept turns again).
    short = []
    for j in range(first + 1, len(rows)):
        if j in cut_idx:
            continue
        r, p = rows[j], rows[j - 1]
        last_cut = rows[max(c for c in cut_idx if c < j)]
        if r["cached"] < last_cut["prompt"]:
            failures.append(f"{mode}: turn {r['turn']} reused {r['cached']} tokens, less than the kept conversation "
                            f"of turn {last_cut['turn']} ({last_cut['prompt']}): the cut did not stick")
        elif r["cached"] < p["prompt"]:
            short.append(f"{r['turn']} ({r['prompt'] - r['cached']} prefilled)")
    if short:
        print(f"turns after the wall that reused less than the previous turn's prompt (that conversation not "
              f"kept: more KV than --kv-budget-mb?): {', '.join(short)}")
    return failures


def compare(reb, sh):
    """Shift against rebuild at the turns where either's cut moved."""
    cr, cs = cuts(reb), cuts(sh)
    both = sorted(set(cr) | set(cs))
    print()
    print("== shift vs rebuild at the cut turns ==")
    print(f"{'turn':>5} {'rebuild prompt/cached':>22} {'ms':>10} {'shift prompt/cached':>20} {'ms':>10}")
    for j in both:
        if j >= len(reb) or j >= len(sh):
            continue
        a, b = reb[j], sh[j]
        print(f"{a['turn']:>5} {a['prompt']:>12,} / {a['cached']:>6,}{'*' if j in cr else ' '} {ms(a['seconds']):>10} "
              f"{b['prompt']:>10,} / {b['cached']:>6,}{'*' if j in cs else ' '} {ms(b['seconds']):>10}")
    print("(* the turn where that mode's cut moved)")
    wall = min(both) if both else len(reb)
    same_before = all(a["reply"] == b["reply"] for a, b in zip(reb[:wall], sh[:wall]))
    diff_after = sum(a["reply"] != b["reply"] for a, b in zip(reb[wall:], sh[wall:]))
    print(f"replies before the wall identical in both modes: {same_before}; "
          f"from the wall on, {diff_after} of {min(len(reb), len(sh)) - wall} differ (shift is an approximation)")


if __name__ == "__main__":
    main()
