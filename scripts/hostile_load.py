#!/usr/bin/env python3
"""Normal load on `fak serve` while hostile clients attack it, on loopback only.

Starts `fak serve` (the binary given by --fak, the default model unless --model), then for a
bounded time runs, all at once:

  * N normal clients (default 8) sending M chat requests each (default 20), short replies;
  * one client sending a 10,000-message request (every other message a tool result);
  * 300 connections that trickle a request's headers one byte at a time, slowly;
  * a client that opens streams and disconnects after the first chunk, repeatedly;
  * a /health poller (every 50 ms) timing each answer;
  * a sampler of the server's resident memory (VmRSS, from /proc).

Prints what each did and the figures, then exits non-zero if a normal request failed, if
/health ever took 50 ms or more, or if the server's RSS grew past --max-rss-mb. Standard
library only; every loop is bounded in count and time; every address is 127.0.0.1.
"""

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

KEY = "hostile-load-key"
MODEL = None  # the served model id, read from /v1/models


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def start_server(fak, extra):
    proc = subprocess.Popen(
        [fak, "serve", "--port", "0", "--api-key-env", "FAK_HOSTILE_KEY", *extra],
        stdout=subprocess.PIPE,
        stderr=open(os.environ.get("FAK_HOSTILE_LOG", os.devnull), "w"),
        env={**os.environ, "FAK_HOSTILE_KEY": KEY},
        text=True,
    )
    port = None
    deadline = time.time() + 300
    while time.time() < deadline and port is None:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                sys.exit(f"fak serve exited with {proc.returncode}")
            continue
        if "listening on http://" in line:
            port = int(line.split("listening on http://")[1].split()[0].rsplit(":", 1)[1].rstrip("/"))
    if port is None:
        proc.kill()
        sys.exit("fak serve never said where it listens")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("fak serve never became healthy")


def post(port, path, body, timeout=300, stream=False):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body).encode()
    c.request(
        "POST",
        path,
        body=data,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    return c, c.getresponse()


def normal_client(port, i, n, max_tokens, out):
    for j in range(n):
        t0 = time.time()
        try:
            c, r = post(
                port,
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"Say a word about the number {i * 100 + j}."}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                },
            )
            body = r.read()
            c.close()
            if r.status != 200:
                out["errors"].append(f"client {i} request {j}: HTTP {r.status} {body[:200]!r}")
                continue
            usage = json.loads(body)["usage"]
            out["completion_tokens"] += usage["completion_tokens"]
            out["latency"].append(time.time() - t0)
        except Exception as e:  # noqa: BLE001 - every failure counts as an error
            out["errors"].append(f"client {i} request {j}: {e!r}")


def huge_request(port, n_messages, out):
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for k in range(n_messages // 2):
        msgs.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": f"c{k}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
                ],
            }
        )
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": f"result {k}"})
    msgs.append({"role": "user", "content": "Summarize."})
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    t0 = time.time()
    try:
        c, r = post(port, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "tools": tools, "max_tokens": 4}, timeout=120)
        r.read()
        c.close()
        out["huge"] = (r.status, time.time() - t0)
    except Exception as e:  # noqa: BLE001
        out["huge"] = (repr(e), time.time() - t0)


def tricklers(port, n, seconds, out):
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.setblocking(False)
            socks.append(s)
        except OSError as e:
            out["trickle_connect_errors"] += 1
            out["trickle_last_error"] = repr(e)
    req = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 4096
    end = time.time() + seconds
    k = 0
    alive = set(range(len(socks)))
    while time.time() < end and alive:
        for idx in list(alive):
            try:
                socks[idx].send(req[k % len(req) : k % len(req) + 1])
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                alive.discard(idx)
        k += 1
        time.sleep(0.5)
    out["trickle_closed_by_server"] = len(socks) - len(alive)
    out["trickle_opened"] = len(socks)
    for s in socks:
        s.close()


def disconnecter(port, rounds, out):
    for _ in range(rounds):
        try:
            c, r = post(
                port,
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
                    "max_tokens": 200,
                    "stream": True,
                },
            )
            r.readline()
            c.sock.shutdown(socket.SHUT_RDWR)
            c.close()
            out["disconnects"] += 1
        except Exception as e:  # noqa: BLE001
            out["disconnect_errors"].append(repr(e))
        time.sleep(0.5)


def health_poller(port, stop, out):
    while not stop.is_set():
        t0 = time.time()
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            st = c.getresponse().status
            c.close()
            out["health"].append((time.time() - t0) * 1000)
            if st != 200:
                out["health_non200"] += 1
        except Exception as e:  # noqa: BLE001
            out["health_errors"].append(repr(e))
        time.sleep(0.05)


def rss_sampler(pid, stop, out):
    while not stop.is_set():
        r = rss_mb(pid)
        if r is not None:
            out["rss"].append(r)
        time.sleep(0.2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fak", required=True, help="the fak binary")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument("--tricklers", type=int, default=300)
    ap.add_argument("--max-rss-mb", type=float, default=1500)
    ap.add_argument("--health-limit-ms", type=float, default=50)
    ap.add_argument("serve_args", nargs="*", help="extra `fak serve` arguments (after --)")
    a = ap.parse_args()

    proc, port = start_server(a.fak, a.serve_args)
    global MODEL
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    MODEL = json.loads(c.getresponse().read())["data"][0]["id"]
    out = {
        "errors": [],
        "latency": [],
        "completion_tokens": 0,
        "health": [],
        "health_non200": 0,
        "health_errors": [],
        "rss": [],
        "trickle_connect_errors": 0,
        "disconnects": 0,
        "disconnect_errors": [],
    }
    stop = threading.Event()
    bg = [
        threading.Thread(target=health_poller, args=(port, stop, out)),
        threading.Thread(target=rss_sampler, args=(proc.pid, stop, out)),
    ]
    for t in bg:
        t.start()
    rss0 = rss_mb(proc.pid)
    t0 = time.time()
    workers = [threading.Thread(target=normal_client, args=(port, i, a.requests, a.max_tokens, out)) for i in range(a.clients)]
    hostile = [
        threading.Thread(target=huge_request, args=(port, a.messages, out)),
        threading.Thread(target=tricklers, args=(port, a.tricklers, 60, out)),
        threading.Thread(target=disconnecter, args=(port, 10, out)),
    ]
    for t in hostile + workers:
        t.start()
    for t in workers:
        t.join(timeout=900)
    wall = time.time() - t0
    for t in hostile:
        t.join(timeout=120)
    stop.set()
    for t in bg:
        t.join()
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()

    h = out["health"]
    n_ok = len(out["latency"])
    print(f"normal: {a.clients} clients x {a.requests} requests: {n_ok} ok, {len(out['errors'])} errors, "
          f"{out['completion_tokens']} completion tokens in {wall:.1f} s ({out['completion_tokens'] / wall:.1f} tokens/s), "
          f"latency p50 {pct(out['latency'], 50):.2f} s p99 {pct(out['latency'], 99):.2f} s")
    for e in out["errors"][:5]:
        print("  error:", e)
    print(f"huge request ({a.messages} messages): {out.get('huge')}")
    print(f"tricklers: {out.get('trickle_opened')} opened, {out.get('trickle_closed_by_server')} closed by the server, "
          f"{out['trickle_connect_errors']} refused ({out.get('trickle_last_error', '-')})")
    print(f"disconnects mid-stream: {out['disconnects']} ({len(out['disconnect_errors'])} errors)")
    print(f"/health: {len(h)} polls, p50 {pct(h, 50):.1f} ms, p99 {pct(h, 99):.1f} ms, max {max(h) if h else float('nan'):.1f} ms, "
          f"{out['health_non200']} non-200, {len(out['health_errors'])} errors")
    print(f"server RSS: start {rss0:.0f} MB, max {max(out['rss']):.0f} MB")
    ok = (
        not out["errors"]
        and n_ok == a.clients * a.requests
        and h
        and max(h) < a.health_limit_ms
        and not out["health_errors"]
        and out["health_non200"] == 0
        and max(out["rss"]) < a.max_rss_mb
    )
    print("hostile-load:", "pass" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
