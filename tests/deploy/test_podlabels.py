"""The pod-label sidecar (kvcached/serve/podlabels.py) against a fake serve and a
fake Kubernetes API on loopback: what it reads, what it patches, and when."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvcached.serve import podlabels
from kvcached.serve.podlabels import PodPatcher, desired_labels, label_key


class _Fakes:
    """One loopback server playing serve's ``/ready`` and the API server's pod PATCH."""

    def __init__(self) -> None:
        self.ready: tuple[int, dict] = (503, {"models": {}})
        self.patches: list[tuple[str, dict[str, str], dict]] = []
        self.patch_status = 200
        fakes = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, status: int, doc: object) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                status, doc = fakes.ready
                self._answer(status, doc)

            def do_PATCH(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fakes.patches.append((self.path, dict(self.headers), body))
                self._answer(fakes.patch_status, {"kind": "Pod"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def fakes() -> Iterator[_Fakes]:
    f = _Fakes()
    yield f
    f.server.shutdown()
    f.server.server_close()


@pytest.fixture
def patcher(fakes: _Fakes, tmp_path) -> PodPatcher:
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    return PodPatcher("ns1", "serve-0", api_server=fakes.url, token_path=str(token))


def test_every_state_but_failed_is_routable() -> None:
    doc = {
        "models": {"a": "ready", "b": "sleeping", "c": "stopped", "d": "starting", "e": "failed"}
    }
    assert desired_labels(doc) == {
        "model.kvcached.io/a": "routable",
        "model.kvcached.io/b": "routable",
        "model.kvcached.io/c": "routable",
        "model.kvcached.io/d": "routable",
        "model.kvcached.io/e": "failed",
    }


def test_a_model_name_kubernetes_refuses_as_a_label_is_named() -> None:
    assert label_key("llama-3.1_8b") == "model.kvcached.io/llama-3.1_8b"
    with pytest.raises(ValueError, match=r"'llama-' cannot be a Kubernetes label name"):
        label_key("llama-")  # serve accepts it; a label name must end with a letter or digit


def test_patches_its_own_pod_once_per_change_with_a_fresh_token(fakes, patcher, tmp_path) -> None:
    fakes.ready = (503, {"models": {"a": "starting", "b": "stopped"}})  # 503 still carries JSON
    podlabels.run(fakes.url + "/ready", patcher, interval_s=0.01, iterations=3)
    assert len(fakes.patches) == 1  # three reads, one change
    path, headers, body = fakes.patches[0]
    assert path == "/api/v1/namespaces/ns1/pods/serve-0"
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert headers["Authorization"] == "Bearer tok-1"
    assert body == {
        "metadata": {
            "labels": {"model.kvcached.io/a": "routable", "model.kvcached.io/b": "routable"}
        }
    }
    (tmp_path / "token").write_text("tok-2")  # the kubelet rotated it
    fakes.ready = (200, {"models": {"a": "ready", "b": "failed"}})
    podlabels.run(fakes.url + "/ready", patcher, interval_s=0.01, iterations=1)
    _, headers, body = fakes.patches[-1]
    assert headers["Authorization"] == "Bearer tok-2"
    assert body["metadata"]["labels"]["model.kvcached.io/b"] == "failed"


def test_a_refused_patch_is_retried_and_silence_from_serve_changes_nothing(fakes, patcher) -> None:
    fakes.ready = (200, {"models": {"a": "ready"}})
    fakes.patch_status = 403  # no RBAC yet
    podlabels.run(fakes.url + "/ready", patcher, interval_s=0.01, iterations=2)
    assert len(fakes.patches) == 2  # not marked published: tried again
    fakes.server.shutdown()  # serve gone: nothing read, nothing patched
    fakes.server.server_close()
    before = len(fakes.patches)
    podlabels.run(fakes.url + "/ready", patcher, interval_s=0.01, iterations=2)
    assert len(fakes.patches) == before


def test_an_answer_that_is_not_serves_json_is_no_reading(fakes) -> None:
    fakes.ready = (503, ["not", "a", "ready", "document"])
    assert podlabels.read_ready(fakes.url + "/ready") is None
    with pytest.raises(ValueError, match="no 'models' object"):
        desired_labels({"ready": True})
    fakes.ready = (404, {})
    assert podlabels.read_ready(fakes.url + "/ready") is None


def test_main_names_the_downward_api_variables_it_lacks(monkeypatch, capsys) -> None:
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.setenv("POD_NAMESPACE", "ns1")
    assert podlabels.main([]) == 2
    assert "POD_NAME not set" in capsys.readouterr().err
