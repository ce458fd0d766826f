"""A GPU configuration's logs are read after its servers stopped (benchmarks/multi_model.py):
what a server writes on its way out (vLLM's shutdown traceback) is in the findings."""

from __future__ import annotations

import argparse
from pathlib import Path

import multi_model as mm
from kvharness.gpu_server import SHUTDOWN_MARK, log_findings

SHUTDOWN_TRACEBACK = (
    f"INFO {SHUTDOWN_MARK} MPClient: complete\n"
    "ERROR Traceback (most recent call last):\n"
    "ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
)


class ServersThatLogOnTheirWayOut:
    """GpuServers' two calls, on a real log file that the stop appends to."""

    def __init__(self, log: Path) -> None:
        self.log = log
        log.write_text("INFO ready\n")

    def close(self) -> dict[str, float | None]:
        with self.log.open("a") as f:
            f.write(SHUTDOWN_TRACEBACK)
        return {"mm-a": 0.4}

    def findings(self) -> dict[str, dict]:
        return {"mm-a": log_findings(self.log, kvcached=False)}


def test_the_findings_hold_what_the_servers_wrote_while_stopping(tmp_path):
    conf = mm.Configuration(argparse.Namespace(device="gpu"), "native", tmp_path, "native-r0")
    conf._gpu = ServersThatLogOnTheirWayOut(tmp_path / "native-r0-mm-a.log")
    conf.close()
    found = conf.record["findings"]["mm-a"]
    assert found["shutdown_tracebacks"] == 1
    assert found["no_traceback_or_cuda_error"]  # after the mark: shutdown noise, not a failure
    assert conf.record["stop_s"] == {"mm-a": 0.4}
