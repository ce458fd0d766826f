#!/usr/bin/env python3
"""A stdlib client for an OpenAI-compatible server, vLLM's or SGLang's (gpu-sglang bundle, device side;
a copy of gpu-vllm's client.py).

  client.py wait PORT [TIMEOUT_S=300] [PID]   exit 0 once /health answers 200; 1 if PID died or time ran out
  client.py complete PORT PROMPT [MAX_TOKENS=32]   POST /v1/completions, greedy
  client.py chat PORT MESSAGE [MAX_TOKENS=32]      POST /v1/chat/completions, greedy
The model is the first one /v1/models lists. complete/chat print one JSON line: the text,
the finish reason, token counts, latency and decode rate; exit 1 on an HTTP error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request


def _get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def wait(port: int, timeout: float, pid: int | None) -> int:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pid is not None:
            try:
                os.kill(pid, 0)
            except OSError:
                print(f"wait: server pid {pid} died after {time.time() - t0:.1f} s")
                return 1
        try:
            if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                print(f"wait: port {port} healthy after {time.time() - t0:.1f} s")
                return 0
        except Exception:
            pass
        time.sleep(0.5)
    print(f"wait: port {port} not healthy after {timeout:.0f} s")
    return 1


def ask(port: int, kind: str, text: str, max_tokens: int) -> int:
    base = f"http://127.0.0.1:{port}"
    model = json.loads(_get(base + "/v1/models")[1])["data"][0]["id"]
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if kind == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
    else:
        path = "/v1/completions"
        body["prompt"] = text
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t = time.time()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            d = json.load(r)
    except urllib.error.HTTPError as e:
        print(f"{kind}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}")
        return 1
    dt = time.time() - t
    ch = d["choices"][0]
    out = ch["message"]["content"] if kind == "chat" else ch["text"]
    n = d["usage"]["completion_tokens"]
    print(
        json.dumps(
            {
                "kind": kind,
                "model": model,
                "text": out,
                "finish_reason": ch.get("finish_reason"),
                "prompt_tokens": d["usage"]["prompt_tokens"],
                "completion_tokens": n,
                "latency_s": round(dt, 3),
                "tok_per_s": round(n / dt, 1) if dt > 0 else None,
            }
        )
    )
    return 0


def main(a: list[str]) -> int:
    if len(a) >= 2 and a[0] == "wait":
        return wait(
            int(a[1]), float(a[2]) if len(a) > 2 else 300, int(a[3]) if len(a) > 3 else None
        )
    if len(a) >= 3 and a[0] in ("complete", "chat"):
        return ask(int(a[1]), a[0], a[2], int(a[3]) if len(a) > 3 else 32)
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
