"""The SGLang GPU runner's orchestration of the model cases, on stand-in servers
(no GPU, no SGLang): summary.json's shape, and a kvcached server that answers
other tokens than native fails its comparison and the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu import e2e_cases
from tests.gpu.sglang_e2e import __main__ as runner
from tests.gpu.sglang_e2e.test_checks import KV_LOG


class FakeProc:
    pid = 999_999


class FakeServer:
    """Answers every prompt with the same two tokens (``wrong``: other tokens)."""

    wrong = ""

    def __init__(self, name: str, port: int, args: list[str], env: dict, log: Path) -> None:
        self.name, self.log, self.env, self.proc = name, log, env, FakeProc()
        self.kvcached = env.get("ENABLE_KVCACHED") == "true"
        self.log_bytes_at_stop: int | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text(KV_LOG if self.kvcached else "native log\nmax_total_num_tokens=1\n")

    def wait_ready(self, timeout: float) -> float:
        return 1.0

    def alive(self) -> bool:
        return True

    def stop(self) -> float:
        self.log_bytes_at_stop = self.log.stat().st_size if self.log.exists() else None
        return 0.5

    def reset_prefix_cache(self) -> int:
        return 200

    def complete_all(self, prompts: list[str], max_tokens: int, concurrent: bool) -> list[dict]:
        tok = FakeServer.wrong if self.kvcached and FakeServer.wrong else "a"
        return [
            {
                "status": 200,
                "tokens": [tok, "b"],
                "top": [{tok: -0.1}, {"b": -0.2}],
                "completion_tokens": 2,
                "cached_tokens": 7,
            }  # fmt: skip
            for _ in prompts
        ]


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "SGLangServer", FakeServer)
    monkeypatch.setattr(e2e_cases, "gpu_pids", set)
    monkeypatch.setattr(runner, "make_model", lambda name, out, script: out)
    monkeypatch.setattr(runner.time, "sleep", lambda s: None)
    FakeServer.wrong = ""
    return ["--out", str(tmp_path / "out"), "--logs", str(tmp_path / "logs"), "--cases", "models"]


def test_model_cases_write_every_check(fake, tmp_path) -> None:
    assert runner.main(fake) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    cases = summary["cases"]
    assert set(cases) == {
        "sglang-qwen2.5-0.5b-kv_c1",
        "sglang-qwen2.5-0.5b-kv_c0",
        "sglang-qwen2.5-0.5b-native",
        "sglang-qwen2.5-0.5b-co-started",
    }
    assert cases["sglang-qwen2.5-0.5b-kv_c1"]["cached_tokens_equal_native"] is True
    assert cases["sglang-qwen2.5-0.5b-native"]["no_kvcached_line"] is True
    assert all(v is True for c in cases.values() for v in c.values())
    assert summary["command"].startswith("python -m tests.gpu.sglang_e2e")
    assert {"commit", "device", "sglang_version", "date"} <= set(summary)
    assert (tmp_path / "out" / "logs.tar.gz").is_file()


def test_a_kvcached_server_with_other_tokens_fails_the_run(fake, tmp_path) -> None:
    FakeServer.wrong = "z"
    assert runner.main(fake) == 1
    cases = json.loads((tmp_path / "out" / "summary.json").read_text())["cases"]
    c = cases["sglang-qwen2.5-0.5b-kv_c0"]
    assert c["gen_seq_tokens_equal_native"] is False and c["top5_logprobs_within_tol"] is False
    assert cases["sglang-qwen2.5-0.5b-native"]["every_request_200_with_tokens"] is True


def test_a_case_that_breaks_off_records_its_error_and_stops_its_servers(
    fake, tmp_path, monkeypatch
) -> None:
    def no_ledger(*args: str) -> None:
        raise RuntimeError("kvctl: no ledger")

    monkeypatch.setattr(e2e_cases, "kvctl", no_ledger)
    argv = [*fake[:-1], "elastic"]
    assert runner.main(argv) == 1
    out = tmp_path / "out"
    c = json.loads((out / "summary.json").read_text())["cases"]["sglang-qwen2.5-0.5b/elastic"]
    assert c["servers_ready"] is True and c["no_error"] is False
    assert c["clean_exit_within_90s"] is True and "a_load_ok" not in c
    details = json.loads((out / "details.json").read_text())["elastic"]
    assert "no ledger" in details["error"] and details["exit_s"] == {"a": 0.5, "b": 0.5}
