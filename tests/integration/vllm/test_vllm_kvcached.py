"""The seed PR's basic checks against a kvcached vLLM CPU server, compared with
the native server of ``test_vllm_native.py`` request by request.

The kvcached server is the native one started with ``ENABLE_KVCACHED=true``:
vLLM loads kvcached through its ``vllm.general_plugins`` entry point, which
exists only when kvcached is installed (``pip install -e .``). Until
``kvcached.integrations.vllm`` exists these tests skip, saying so.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest

from kvharness.vllm_server import ServerOptions
from tests.engines import require_engine_version
from tests.integration.vllm.vllm_cases import (
    APC_PHASES,
    APC_ROUNDS,
    GEN_PHASES,
    CaseRecord,
    cached_tokens,
    run_basic_case,
    same_tokens,
)

VLLM_VERSION = require_engine_version("vllm")
if not any(
    ep.value.startswith("kvcached")
    for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
):
    pytest.fail(
        "kvcached's vllm.general_plugins entry point is not installed for this "
        "interpreter, so vLLM cannot load kvcached: run `pip install -e .` first",
        pytrace=False,
    )
pytestmark = pytest.mark.slow

#: The lines docs/vllm-integration.md (section 2) promises: one per process role.
ENGINE_PATCHED = re.compile(r"\[kvcached\].*vLLM \S+ engine core: .*patched.*blocks")
WORKER_PATCHED = re.compile(r"\[kvcached\].*vLLM \S+ worker rank \d+: .*allocate_kv_cache patched")


def kvcached_options(workdir: Path, name: str, **kwargs: object) -> ServerOptions:
    """A kvcached server on a ledger directory and host device of its own, so
    nothing else on the machine shares its budget."""
    env = {"KVCACHED_LEDGER_DIR": str(workdir / f"{name}-ledger"), "KVCACHED_HOST_DEVICE": "41"}
    (workdir / f"{name}-ledger").mkdir(parents=True, exist_ok=True)
    return ServerOptions(kvcached=True, ipc_name=name, extra_env=env, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def kvcached_case(tiny_llama_dir: Path, vllm_workdir: Path) -> CaseRecord:
    return run_basic_case(
        "kvcached", tiny_llama_dir, vllm_workdir, kvcached_options(vllm_workdir, "ci-vllm-basic")
    )


@pytest.fixture(scope="session")
def kvcached_tp2_case(tiny_llama_dir: Path, vllm_workdir: Path) -> CaseRecord:
    """Two tensor-parallel CPU workers: one planner, two executors, every page
    op applied by both ranks (which agree on each growth step over vLLM's TP
    CPU group)."""
    return run_basic_case(
        "kvcached-tp2",
        tiny_llama_dir,
        vllm_workdir,
        kvcached_options(vllm_workdir, "ci-vllm-tp2", tensor_parallel=2),
    )


def test_server_ready(kvcached_case: CaseRecord) -> None:
    assert kvcached_case.start_error is None, kvcached_case.start_error


def test_kvcached_active(kvcached_case: CaseRecord) -> None:
    """kvcached applied its patches in the engine core and in the worker."""
    lines = kvcached_case.kvcached_lines
    assert any(ENGINE_PATCHED.search(line) for line in lines), lines
    assert any(WORKER_PATCHED.search(line) for line in lines), lines


@pytest.mark.parametrize("phase", GEN_PHASES + APC_PHASES)
def test_phase_ok(kvcached_case: CaseRecord, phase: str) -> None:
    failed = [(i, c.status, c.error) for i, c in enumerate(kvcached_case.phase(phase)) if not c.ok]
    assert not failed, f"{phase}: {failed}; log {kvcached_case.log_path}"


@pytest.mark.parametrize("phase", ("gen_seq", *APC_ROUNDS))
def test_tokens_equal(native_case: CaseRecord, kvcached_case: CaseRecord, phase: str) -> None:
    """``<phase>_tokens_equal``: every sequential request gives native's greedy
    tokens (stricter than the seed's "more than half": two native servers agree
    on all of them, see test_greedy_deterministic_across_servers)."""
    equal = same_tokens(native_case.phase(phase), kvcached_case.phase(phase))
    assert all(equal), (phase, equal)


@pytest.mark.parametrize("phase", APC_PHASES)
def test_cached_tokens_equal(
    native_case: CaseRecord, kvcached_case: CaseRecord, phase: str
) -> None:
    """``apc_<n>_cached_tokens_equal``: the same prefix hits as native."""
    assert cached_tokens(kvcached_case.phase(phase)) == cached_tokens(native_case.phase(phase))


def test_prefix_cache_reset(kvcached_case: CaseRecord) -> None:
    assert kvcached_case.reset_ok is True
    assert kvcached_case.phase("reset_probe")[0].cached_tokens == 0


def test_server_alive_after_load(kvcached_case: CaseRecord) -> None:
    assert kvcached_case.alive_after_load is True


def test_clean_exit_and_nothing_left(kvcached_case: CaseRecord) -> None:
    stop = kvcached_case.stop
    assert stop is not None and stop.clean, stop
    assert stop.leftover_pids == ()


def test_no_error_signatures(kvcached_case: CaseRecord) -> None:
    assert kvcached_case.error_signatures == [], kvcached_case.error_signatures


def test_tp2_serves_like_native_tp2(
    native_tp2_case: CaseRecord, kvcached_tp2_case: CaseRecord
) -> None:
    """With two ranks kvcached gives native TP=2's tokens and prefix hits for
    every sequential request; both workers hold the KV cache; the server
    serves every phase, resets, stops cleanly and logs no error."""
    tp2 = kvcached_tp2_case
    assert tp2.start_error is None, tp2.start_error
    lines = tp2.kvcached_lines
    assert any(ENGINE_PATCHED.search(line) and "2 ranks" in line for line in lines), lines
    for rank in (0, 1):
        assert any(
            re.search(rf"worker rank {rank}: .*allocate_kv_cache patched", line) for line in lines
        ), (rank, lines)
    for phase in GEN_PHASES + APC_PHASES:
        assert all(c.ok for c in tp2.phase(phase)), phase
    for phase in ("gen_seq", *APC_ROUNDS):
        assert all(same_tokens(native_tp2_case.phase(phase), tp2.phase(phase))), phase
    for phase in APC_PHASES:
        assert cached_tokens(tp2.phase(phase)) == cached_tokens(native_tp2_case.phase(phase))
    assert tp2.reset_ok is True and tp2.alive_after_load is True
    assert tp2.stop is not None and tp2.stop.clean and tp2.stop.leftover_pids == ()
    assert tp2.error_signatures == [], tp2.error_signatures
