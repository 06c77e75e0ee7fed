#!/usr/bin/env python3
"""A conversation that outlives a restart of `fak serve --kv-persist DIR`, on loopback only.

Starts `fak serve --kv-persist DIR` (the binary given by --fak, the default model unless
--model, --weights native unless told), holds a conversation of --turns turns (default
10) through /v1/chat/completions at temperature 0, each turn sending the whole history
(a system prompt of a few hundred tokens and substantive questions, fixed below), then
stops the server with SIGTERM (it must exit 0 and leave a *.fakkv file in DIR) and sends
the next turn, N+1, to servers started again on a copy of DIR as it was left:

  * restarted: three fresh servers, each on its own copy of DIR, each sent turn N+1
    streamed (time to the first content chunk: TTFT), and one more sent it not streamed
    (its reply and usage.prompt_tokens_details.cached_tokens). Each starts from the
    same files, so each measured request meets the same cache;
  * uninterrupted: a server (fresh DIR) that holds the same N turns without stopping and
    is sent turn N+1 streamed: its reply and cached_tokens (the stream's usage chunk),
    the reference, and its TTFT (one sample, for information);
  * cold: three fresh servers (fresh DIR each, no history), each sent turn N+1 streamed:
    the TTFT of prefilling the whole prompt.

Prints the prompt tokens of turn N+1, cached_tokens after the restart and without it,
the median TTFT restarted and cold, and their ratio. Exits non-zero if the restarted
reply differs from the uninterrupted one, if their cached_tokens differ, if the
restarted server reused less than the whole of turn N's prompt and reply (prompt_tokens
+ completion_tokens of turn N, less one: the reply's last token, sampled but not yet run
through the model), or if the ratio is below --min-ratio (default 10).

Standard library only; every loop is bounded in count and time; every address is
127.0.0.1. Each server's log is kept under the run's temporary folder, printed on a
failure.
"""

import argparse
import glob
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

KEY = "restart-ttft-key"
SERVERS = []  # every server started, stopped on the way out

SYSTEM = (
    "You are Harbor, the assistant of a small engineering team that runs a fleet of "
    "build and test machines for an open-source systems project. The team writes most "
    "of its code in Rust, keeps its infrastructure scripts in Python and shell, and "
    "deploys to Linux servers in two data centres, one in Frankfurt and one in "
    "Virginia. Every machine is described in a single inventory file with its role, "
    "its operating system release, its disk layout and the date of its last "
    "maintenance window. Builds run on eight large machines with sixty-four cores "
    "each; tests run on twenty smaller machines, some of them with graphics cards for "
    "the numerical test suites. Releases happen every six weeks, on a Tuesday, after a "
    "freeze of one week during which only fixes for regressions are merged.\n\n"
    "When you answer, be concrete and brief: name the command, the file or the setting "
    "that matters, and say why. Prefer plain explanations to lists when a short "
    "paragraph does. If a question depends on something you were not told, say what "
    "you would need to know rather than inventing it. Never suggest disabling a test "
    "to make a build pass, never suggest storing a secret in the repository, and "
    "remind the reader to check the change log when a question is about a dependency "
    "upgrade. When you mention a time, use UTC. When you mention a size, use binary "
    "units (MiB, GiB). The team values reproducible builds, small commits with clear "
    "messages, and measurements taken on a quiet machine, reported with the machine's "
    "name and the date. Keep answers under a hundred words unless asked for more."
)

QUESTIONS = [
    "Our nightly build on the Frankfurt machines has become twenty minutes slower since "
    "last week. What would you look at first, and in what order?",
    "How should we pin the Rust toolchain so that every machine builds with exactly the "
    "same compiler version?",
    "A test that uses the graphics card fails about one time in fifty. How do we find "
    "out whether it is the test, the driver or the hardware?",
    "We want to cache compiled dependencies between builds. What are the risks of a "
    "shared cache across the two data centres?",
    "Explain how we could make our release tarballs reproducible, byte for byte.",
    "The disks of the test machines fill up every few days with old build folders. "
    "Suggest a cleanup policy that does not delete anything a running job still needs.",
    "How do we roll out a kernel update to the twenty test machines without stopping "
    "the test queue?",
    "One of our dependencies published a new major version with breaking changes. How "
    "should we plan the upgrade during the six-week cycle?",
    "What should a good commit message for a fix of a data race in our scheduler say?",
    "How would you measure whether the new build machines are actually faster than the "
    "old ones, fairly?",
    "Summarize in three sentences what we discussed and what we should do first.",
    "Which of these changes would you postpone until after the next release, and why?",
]
FINAL = "Given all of that, write a short checklist for the release freeze week."


def log_tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


class Server:
    """One `fak serve` on a free loopback port (--port 0), its stderr in `log`."""

    def __init__(self, fak, extra, log):
        self.log = log
        SERVERS.append(self)
        self.proc = subprocess.Popen(
            [fak, "serve", "--host", "127.0.0.1", "--port", "0", "--api-key-env", "FAK_RESTART_KEY", *extra],
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            env={**os.environ, "FAK_RESTART_KEY": KEY},
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
        # /health answers 200 once the model is loaded and the kept conversations read.
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

    def stop(self, timeout=60):
        """SIGTERM, then the exit code (killed after `timeout` seconds: None)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return None

    def chat(self, body):
        """A non-streamed chat completion: the parsed response."""
        body = {"model": self.model, **body}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        c.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=headers())
        r = c.getresponse()
        data = r.read()
        c.close()
        if r.status != 200:
            self.fail(f"HTTP {r.status}: {data[:300]!r}")
        return json.loads(data)

    def chat_stream(self, body):
        """A streamed chat completion: (TTFT in seconds, reply text, usage or None)."""
        body = {"model": self.model, **body, "stream": True, "stream_options": {"include_usage": True}}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        c.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=headers())
        r = c.getresponse()
        if r.status != 200:
            self.fail(f"HTTP {r.status}: {r.read()[:300]!r}")
        ttft = None
        text = []
        usage = None
        for _ in range(100_000):  # far more lines than a 48-token reply sends
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
        c.close()
        if ttft is None:
            self.fail("the stream sent no content")
        return ttft, "".join(text), usage


def headers():
    return {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}


def cached(usage):
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def request(messages, max_tokens):
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0}


def converse(server, turns, max_tokens):
    """Turns 1..N, each with the whole history: (messages, the last turn's usage)."""
    messages = [{"role": "system", "content": SYSTEM}]
    usage = None
    for q in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": q})
        resp = server.chat(request(messages, max_tokens))
        messages.append({"role": "assistant", "content": resp["choices"][0]["message"]["content"]})
        usage = resp["usage"]
    return messages, usage


def fakkv_files(d):
    return sorted(glob.glob(os.path.join(d, "**", "*.fakkv"), recursive=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fak", required=True, help="the fak binary")
    ap.add_argument("--model", help="model name or path (default: fak's default model)")
    ap.add_argument("--weights", default="native", choices=["native", "exact"])
    ap.add_argument("--turns", type=int, default=10, help=f"turns before the restart (1..{len(QUESTIONS)})")
    ap.add_argument("--threads", type=int, help="fak serve --threads")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="TTFT measurements each, restarted and cold")
    ap.add_argument("--min-ratio", type=float, default=10.0)
    args = ap.parse_args()
    if not 1 <= args.turns <= len(QUESTIONS):
        sys.exit(f"--turns must be 1..{len(QUESTIONS)}")
    if not 1 <= args.repeats <= 20:
        sys.exit("--repeats must be 1..20")

    extra = ["--weights", args.weights]
    if args.model:
        extra += ["--model", args.model]
    if args.threads:
        extra += ["--threads", str(args.threads)]

    tmp = tempfile.mkdtemp(prefix="fak-restart-ttft-")
    ok = False
    try:
        ok = run(args, extra, tmp)
    finally:
        for s in SERVERS:
            if s.proc.poll() is None:
                s.stop(timeout=30)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs and folders kept in {tmp}")
    sys.exit(0 if ok else 1)


def run(args, extra, tmp):
    n = args.turns
    failures = []
    logs = iter(range(1000))

    def start(kv_dir, *more):
        return Server(args.fak, [*extra, "--kv-persist", kv_dir, *more], os.path.join(tmp, f"serve-{next(logs)}.log"))

    # 1. The conversation, then SIGTERM.
    saved = os.path.join(tmp, "kv-saved")
    first = start(saved)
    t0 = time.time()
    history, usage_n = converse(first, n, args.max_tokens)
    print(f"turns 1..{n}: {time.time() - t0:.1f} s; turn {n}: prompt {usage_n['prompt_tokens']} tokens, "
          f"reply {usage_n['completion_tokens']}, cached {cached(usage_n)}")
    rc = first.stop()
    files = fakkv_files(saved)
    print(f"SIGTERM: exit {rc}; {saved} holds {len(files)} *.fakkv file(s), "
          f"{sum(os.path.getsize(f) for f in files) / (1 << 20):.1f} MiB")
    if rc != 0:
        first.fail(f"the server did not exit 0 after SIGTERM (exit {rc})")
    if not files:
        first.fail(f"no *.fakkv file in {saved} after SIGTERM: {os.listdir(saved) if os.path.isdir(saved) else 'no folder'}")

    final = request([*history, {"role": "user", "content": FINAL}], args.max_tokens)

    # 2. Restarted: each server on its own copy of the saved folder.
    def restarted():
        d = os.path.join(tmp, f"kv-restart-{next(logs)}")
        shutil.copytree(saved, d)
        return start(d)

    s = restarted()
    resp = s.chat(final)
    s.stop()
    r_text = resp["choices"][0]["message"]["content"]
    r_usage = resp["usage"]
    prompt = r_usage["prompt_tokens"]
    r_cached = cached(r_usage)
    restored = [l.split("--kv-persist: ", 1)[1].strip() for l in log_tail(s.log, 1000).splitlines() if "--kv-persist: restored" in l]
    print(f"restart: {restored[0] if restored else 'no restore line in ' + s.log}")
    r_ttft = []
    for _ in range(args.repeats):
        s = restarted()
        ttft, text, usage = s.chat_stream(final)
        s.stop()
        r_ttft.append(ttft)
        if text != r_text:
            failures.append(f"restarted: the streamed reply differs from the non-streamed one: {text!r} vs {r_text!r}")
        if usage and cached(usage) != r_cached:
            failures.append(f"restarted: streamed cached_tokens {cached(usage)} != {r_cached} not streamed")

    # 3. Uninterrupted: the same turns on a server that never stops.
    u = start(os.path.join(tmp, "kv-uninterrupted"))
    u_history, _ = converse(u, n, args.max_tokens)
    u_ttft, u_text, usage = u.chat_stream(final)
    u.stop()
    if usage is None:
        u.fail("the uninterrupted server's stream sent no usage (stream_options.include_usage)")
    u_cached = cached(usage)
    if u_history != history:
        failures.append("the uninterrupted server's turns 1..N differ from the first server's")

    # 4. Cold: fresh servers, no history.
    c_ttft = []
    c_text = None
    for _ in range(args.repeats):
        s = start(os.path.join(tmp, f"kv-cold-{next(logs)}"))
        ttft, c_text, usage = s.chat_stream(final)
        s.stop()
        c_ttft.append(ttft)
        if usage and cached(usage) != 0:
            failures.append(f"cold: cached_tokens {cached(usage)}, expected 0")

    need = usage_n["prompt_tokens"] + usage_n["completion_tokens"] - 1
    r_med = statistics.median(r_ttft)
    c_med = statistics.median(c_ttft)
    ratio = c_med / r_med
    print()
    print(f"turn {n + 1} prompt tokens:           {prompt}")
    print(f"cached_tokens after restart:     {r_cached}  (uninterrupted: {u_cached}; at least {need} required)")
    print(f"TTFT restarted (median of {args.repeats}):    {r_med * 1000:.1f} ms  ({', '.join(f'{t * 1000:.1f}' for t in r_ttft)})")
    print(f"TTFT cold (median of {args.repeats}):         {c_med * 1000:.1f} ms  ({', '.join(f'{t * 1000:.1f}' for t in c_ttft)})")
    print(f"TTFT uninterrupted (1 request):  {u_ttft * 1000:.1f} ms")
    print(f"ratio cold / restarted:          {ratio:.1f}x")
    print(f"reply after restart == uninterrupted: {r_text == u_text}")
    print(f"reply cold == after restart (not required): {c_text == r_text}")
    print(f"reply after restart: {r_text!r}")

    if r_text != u_text:
        failures.append(f"the restarted reply differs from the uninterrupted one:\n  restarted:     {r_text!r}\n  uninterrupted: {u_text!r}")
    if r_cached != u_cached:
        failures.append(f"cached_tokens after restart {r_cached} != uninterrupted {u_cached}")
    if r_cached < need:
        failures.append(f"cached_tokens after restart {r_cached} < {need} (turn {n}'s prompt and reply)")
    if ratio < args.min_ratio:
        failures.append(f"ratio {ratio:.1f} below {args.min_ratio}")
    for f in failures:
        print(f"FAIL: {f}")
    print("PASS" if not failures else f"{len(failures)} failure(s)")
    return not failures


if __name__ == "__main__":
    main()
