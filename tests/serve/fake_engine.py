"""A small engine for the router's unit tests: real HTTP on loopback, the
endpoint shapes of vLLM's and SGLang's servers, every request it gets logged.

``python fake_engine.py PORT LOGFILE [--slow-start S] [--fail-start CODE]``
(``--fail-start``: print a few lines, as an engine that cannot start would, and
exit with CODE; ``--fail-traceback``: die of a chained exception, a real
traceback; ``--warnings N``: print N deprecation warnings before either;
``--kvcached``: see :func:`act_as_kvcached`). Each
request is appended to LOGFILE as one JSON line: method, path, query string,
body. Routes:

* ``GET /health``; ``GET /v1/models``;
* ``POST /v1/completions`` and ``/v1/chat/completions``: echo the request
  (``"stream": true``: ``chunks`` SSE chunks, three by default,
  ``chunk_delay`` seconds apart, then ``[DONE]``); ``"fail": N`` answers status N with an OpenAI-style error body;
* vLLM's ``POST /sleep`` (level read from the query string, as vLLM does),
  ``POST /wake_up`` (``?tags=weights`` wakes only the weights: it stays asleep
  until the KV cache is woken too), ``POST /collective_rpc`` (``--fail-reload``:
  answers 500, as vLLM does when its loader cannot reload), ``GET /is_sleeping``;
  SGLang's ``POST /release_memory_occupation`` and ``/resume_memory_occupation``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from aiohttp import web


def warn_first(args: list[str]) -> None:
    """``--warnings N``: N deprecation warnings first, as vLLM's start prints them."""
    for i in range(int(args[args.index("--warnings") + 1]) if "--warnings" in args else 0):
        print(f"/site-packages/engine/api_{i}.py:24: DeprecationWarning: this entrypoint is ")
        print("  warnings.warn(", flush=True)


def load_model() -> None:
    def check(config: dict[str, int]) -> None:
        raise ValueError(f"max_model_len ({config['len']}) is greater than the model's (2048)")

    try:
        check({"len": 100000})
    except ValueError as exc:
        raise RuntimeError("Engine core initialization failed. See root cause above.") from exc


class _Device:
    """The ledger's view of a device: a fixed 1 GiB, all free."""

    def mem_info(self) -> tuple[int, int]:
        return 1 << 30, 1 << 30


def act_as_kvcached() -> object:
    """``--kvcached``: what a kvcached engine leaves where serve and kvctl look,
    as instance ``KVCACHED_IPC_NAME``: a snapshot, and a ledger pool (device
    ``fake-serve-0`` in ``KVCACHED_LEDGER_DIR``) charged 8 MiB. SIGINT ends the
    process at once, the pool never closed, as vLLM's shutdown SIGKILLs its
    workers."""
    import os
    import signal

    from kvcached.control.snapshot import SnapshotPublisher
    from kvcached.ledger import Ledger

    name = os.environ["KVCACHED_IPC_NAME"]
    ledger = Ledger.open(
        "fake-serve-0",
        _Device(),
        directory=os.environ["KVCACHED_LEDGER_DIR"],
        gpu_utilization=1.0,
    )
    pool = ledger.register_pool(name)
    assert pool.grant(8 << 20), "the fake device's budget has room for 8 MiB"
    snapshot = SnapshotPublisher(name)
    snapshot.publish({"instance": name, "pid": os.getpid(), "engine": "fake", "pools": []})
    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    return (ledger, pool, snapshot)  # held for the process' life


def main() -> None:
    port, log_path = int(sys.argv[1]), sys.argv[2]
    args = sys.argv[3:]
    slow_start = float(args[args.index("--slow-start") + 1]) if "--slow-start" in args else 0
    state = {"sleeping": False, "level": 0}
    if "--fail-start" in args:
        print("fake engine: starting", flush=True)
        warn_first(args)
        print("fake engine: error: the model cannot be loaded (asked to fail)", flush=True)
        sys.exit(int(args[args.index("--fail-start") + 1]))
    if "--fail-traceback" in args:
        warn_first(args)
        load_model()  # raises: a real traceback, and exit status 1

    def record(request: web.Request, body: bytes) -> None:
        with open(log_path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "method": request.method,
                        "path": request.path,
                        "query": request.query_string,
                        "body": body.decode(errors="replace"),
                        "t": time.time(),
                    }
                )
                + "\n"
            )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        record(request, body)
        doc = json.loads(body)
        if doc.get("fail"):
            return web.json_response(
                {
                    "object": "error",
                    "message": "asked to fail",
                    "type": "BadRequestError",
                    "code": doc["fail"],
                },
                status=int(doc["fail"]),
                headers={"X-Fake": "1"},
            )
        if state["sleeping"]:
            return web.json_response({"message": "asleep"}, status=500)
        if not doc.get("stream"):
            return web.json_response({"echo": doc, "port": port}, headers={"X-Fake": "1"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(int(doc.get("chunks", 3))):
            await resp.write(f"data: {json.dumps({'i': i, 'model': doc['model']})}\n\n".encode())
            await asyncio.sleep(float(doc.get("chunk_delay", 0)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def sleep(request: web.Request) -> web.Response:
        record(request, await request.read())
        state["sleeping"], state["level"] = True, int(request.query.get("level", "1"))
        return web.json_response({"status": "sleeping", "level": state["level"]})

    async def wake(request: web.Request) -> web.Response:
        record(request, await request.read())
        if request.query.get("tags") != "weights":
            state["sleeping"] = False
        return web.json_response({"status": "awake"})

    async def collective_rpc(request: web.Request) -> web.Response:
        record(request, await request.read())
        if "--fail-reload" in args:
            return web.json_response({"error": "reload failed (asked to fail)"}, status=500)
        return web.json_response({"results": [None]})

    async def is_sleeping(request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": state["sleeping"]})

    app = web.Application()
    app.add_routes(
        [
            web.get("/health", health),
            web.post("/v1/completions", completions),
            web.post("/v1/chat/completions", completions),
            web.post("/sleep", sleep),
            web.post("/wake_up", wake),
            web.post("/collective_rpc", collective_rpc),
            web.get("/is_sleeping", is_sleeping),
            web.post("/release_memory_occupation", sleep),
            web.post("/resume_memory_occupation", wake),
        ]
    )
    kvcached = act_as_kvcached() if "--kvcached" in args else None
    time.sleep(slow_start)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=kvcached is None)


if __name__ == "__main__":
    main()
