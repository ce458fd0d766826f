"""Session-wide vLLM cases: each server start (15-45 s on two cores) is paid
once and its record serves every check that needs it, in any test module.

A case fixture runs its whole case (start, phases, stop) the first time a test
asks for it and returns the :class:`CaseRecord`; no server outlives its fixture.
Logs and per-case JSON (every request's tokens) go to one directory:
``$KVCACHED_TEST_ARTIFACTS/vllm`` when that variable names a directory (CI keeps
it as an artifact), else pytest's temporary directory.

This folder is the package ``tests.integration.vllm`` (pytest's importlib mode puts
no test folder on the import path, so it never stands in for the real ``vllm``). The
server harness and the tiny model it shares with the benchmarks live in
``benchmarks/kvharness``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvharness.vllm_model import write_tiny_llama
from kvharness.vllm_server import ServerOptions
from tests.integration.vllm.vllm_cases import CaseRecord, run_basic_case


@pytest.fixture(scope="session")
def vllm_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    artifacts = os.environ.get("KVCACHED_TEST_ARTIFACTS")
    if artifacts:
        path = Path(artifacts) / "vllm"
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def tiny_llama_dir(vllm_workdir: Path) -> Path:
    return write_tiny_llama(vllm_workdir / "tiny-llama", weights_seed=0)


@pytest.fixture(scope="session")
def native_case(tiny_llama_dir: Path, vllm_workdir: Path) -> CaseRecord:
    """The basic case on a native vLLM server."""
    return run_basic_case("native", tiny_llama_dir, vllm_workdir, ServerOptions())


@pytest.fixture(scope="session")
def native_case_again(tiny_llama_dir: Path, vllm_workdir: Path) -> CaseRecord:
    """The same case on a second, fresh native server: the baseline that makes
    token-by-token comparisons between servers meaningful."""
    return run_basic_case("native-again", tiny_llama_dir, vllm_workdir, ServerOptions())


@pytest.fixture(scope="session")
def native_tp2_case(tiny_llama_dir: Path, vllm_workdir: Path) -> CaseRecord:
    """The basic case on a native server with two tensor-parallel CPU workers:
    the scheduler in the engine core, the KV tensors split over two processes."""
    return run_basic_case(
        "native-tp2", tiny_llama_dir, vllm_workdir, ServerOptions(tensor_parallel=2)
    )
