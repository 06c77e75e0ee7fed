#!/usr/bin/env python3
"""A load of N concurrent streaming clients on an OpenAI-compatible /v1/completions.

Each of --concurrency clients sends --requests completions one after another, streamed,
at temperature 0 with --max-tokens. Half the clients (the even ones) share one long
preamble (a system prompt and tool list, as agents' requests do); the others each have
their own of the same length. Prints one JSON object: the aggregate rate (completion
tokens of all requests over the load's wall time), TTFT p50/p99 and inter-token latency
p50/p99 (ms, over every gap between two streamed tokens of a request), completion
tokens, and failed requests. Standard library only; loopback only.
"""

import argparse
import http.client
import json
import statistics
import threading
import time

TOPICS = ["rivers", "bridges", "volcanoes", "libraries", "satellites", "glaciers",
          "orchards", "lighthouses", "deserts", "harbors", "forests", "comets",
          "canals", "islands", "markets", "observatories"]


def preamble(i, words):
    """The shared preamble for even clients; its own for odd ones."""
    seed = 0 if i % 2 == 0 else i
    tools = ", ".join(f"tool_{(seed * 7 + k) % 97}(query, limit)" for k in range(words // 6))
    return (f"You are agent {seed}. You may call these tools: {tools}. "
            "Answer in full sentences.\n")


def quantile(v, q):
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, max(0, int(-(-q * len(v) // 1)) - 1))]


def one(port, model, prompt, max_tokens, out):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        out["failed"] += 1
        r.read()
        return
    times, usage = [], None
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"].get("completion_tokens")
        for c in ev.get("choices") or []:
            if c.get("text"):
                times.append(time.monotonic() - t0)
    conn.close()
    if not times:
        out["failed"] += 1
        return
    out["ttft"].append(times[0] * 1e3)
    out["itl"].extend((b - a) * 1e3 for a, b in zip(times, times[1:]))
    out["tokens"] += usage if usage is not None else len(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="model")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--preamble-words", type=int, default=240)
    a = ap.parse_args()
    out = {"ttft": [], "itl": [], "tokens": 0, "failed": 0}
    lock = threading.Lock()

    def client(i):
        mine = {"ttft": [], "itl": [], "tokens": 0, "failed": 0}
        for k in range(a.requests):
            topic = TOPICS[(i + k) % len(TOPICS)]
            prompt = preamble(i, a.preamble_words) + f"Write a long essay about {topic}.\n"
            try:
                one(a.port, a.model, prompt, a.max_tokens, mine)
            except (OSError, ValueError, http.client.HTTPException):
                mine["failed"] += 1
        with lock:
            for key in ("ttft", "itl"):
                out[key].extend(mine[key])
            out["tokens"] += mine["tokens"]
            out["failed"] += mine["failed"]

    t0 = time.monotonic()
    ts = [threading.Thread(target=client, args=(i,)) for i in range(a.concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    print(json.dumps({
        "concurrency": a.concurrency,
        "aggregate_tokens_per_s": out["tokens"] / wall if wall > 0 else 0.0,
        "completion_tokens": out["tokens"],
        "failed": out["failed"],
        "ttft_ms_p50": quantile(out["ttft"], 0.5),
        "ttft_ms_p99": quantile(out["ttft"], 0.99),
        "itl_ms_p50": statistics.median(out["itl"]) if out["itl"] else float("nan"),
        "itl_ms_p99": quantile(out["itl"], 0.99),
        "wall_s": wall,
    }))


if __name__ == "__main__":
    main()
