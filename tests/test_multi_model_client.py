"""The multi-model benchmark's request client against a local server that
streams like vLLM and then stalls: a request is cut at the run's deadline
however long the stream had been quiet, and keeps the TTFT it had."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import multi_model_client as mc
from kvharness.vllm_server import chunk_token_ids, completion_chunks


class Stalling(BaseHTTPRequestHandler):
    """One token chunk at once, a second after ``gap`` s, then silence for 5 s."""

    gap = 0.6

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(2):
            chunk = {"choices": [{"token_ids": [7]}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
            time.sleep(self.gap)
        time.sleep(5.0)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def port():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stalling)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_a_stalled_stream_is_cut_at_the_deadline_not_a_read_timeout_later(port):
    began = time.monotonic()
    # The first read's timeout would be 1.0 s, and each chunk resets a per-read timeout:
    # without a bound per read the stall after the second chunk would hold it ~1.6 s more.
    out = mc.send(port, [5, 6], 4, deadline=began + 1.0)
    took = time.monotonic() - began
    assert out["cut"] and not out["ok"] and out["tokens"] == 2, out
    assert out["ttft_s"] is not None and out["ttft_s"] < 0.5
    assert took < 1.4, took


def test_completion_chunks_stop_at_done_and_skip_what_is_not_an_event():
    lines = [
        b": keep-alive\n",
        b'data: {"choices": [{"token_ids": [1, 2]}, {"token_ids": [3]}]}\n',
        b"\n",
        b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n',
        b"data: [DONE]\n",
        b'data: {"choices": [{"token_ids": [9]}]}\n',
    ]
    chunks = list(completion_chunks(lines))
    assert [chunk_token_ids(c) for c in chunks] == [[1, 2, 3], []]
