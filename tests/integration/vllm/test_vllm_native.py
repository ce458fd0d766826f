"""The seed PR's basic checks against a real native vLLM CPU server.

These are the checks a kvcached server must pass too; the native record is also
the reference a kvcached run is compared with, request by request.
"""

from __future__ import annotations

import pytest

from kvharness.vllm_server import STOP_GRACE_S
from tests.engines import require_engine_version
from tests.integration.vllm.vllm_cases import (
    APC_DOCUMENT_TOKENS,
    APC_PHASES,
    APC_ROUNDS,
    GEN_PHASES,
    GEN_PROMPTS,
    CaseRecord,
    cached_tokens,
    same_tokens,
)

VLLM_VERSION = require_engine_version("vllm")
pytestmark = pytest.mark.slow

BLOCK = 32  # ServerOptions().block_size


def test_server_ready(native_case: CaseRecord) -> None:
    assert native_case.start_error is None, native_case.start_error
    assert native_case.ready_s is not None


@pytest.mark.parametrize("phase", GEN_PHASES + APC_PHASES)
def test_phase_ok(native_case: CaseRecord, phase: str) -> None:
    """``<phase>_ok``: every request returns HTTP 200 with output tokens."""
    failed = [(i, c.status, c.error) for i, c in enumerate(native_case.phase(phase)) if not c.ok]
    assert not failed, f"{phase}: failed requests {failed}; log {native_case.log_path}"


def test_prefix_cache_reset(native_case: CaseRecord) -> None:
    """The reset endpoint succeeds and really empties the cache: the longest
    prompt hit the cache before it and misses after it."""
    assert native_case.reset_ok is True
    longest = len(GEN_PROMPTS) - 1
    before = native_case.phase("gen_conc")[longest].cached_tokens
    after = native_case.phase("reset_probe")[0].cached_tokens
    assert before is not None and before > 0, "gen_conc should hit what gen_seq cached"
    assert after == 0, f"{after} tokens still cached after the reset"


def test_cached_tokens_recorded(native_case: CaseRecord) -> None:
    """Every APC request reports cached_tokens, and prefix caching works: after
    the first request of apc_0 the shared document is served from the cache."""
    document_blocks = APC_DOCUMENT_TOKENS // BLOCK * BLOCK
    for phase in APC_PHASES:
        counts = cached_tokens(native_case.phase(phase))
        assert all(isinstance(n, int) for n in counts), f"{phase}: {counts}"
    first, *rest = cached_tokens(native_case.phase("apc_0"))
    assert first == 0, "the document is new after the reset"
    assert all(n is not None and n >= document_blocks for n in rest), rest
    for phase in APC_ROUNDS[1:]:
        counts = cached_tokens(native_case.phase(phase))
        assert all(n is not None and n >= document_blocks for n in counts), (phase, counts)


def test_server_alive_after_load(native_case: CaseRecord) -> None:
    assert native_case.alive_after_load is True


def test_clean_exit_on_signal(native_case: CaseRecord) -> None:
    stop = native_case.stop
    assert stop is not None, native_case.start_error
    assert stop.clean, f"no exit within {STOP_GRACE_S:.0f} s of SIGINT; killed"
    assert stop.exit_s < STOP_GRACE_S


def test_no_process_left(native_case: CaseRecord) -> None:
    """After the stop, no process of the server's group (engine core, workers)
    is left."""
    assert native_case.stop is not None
    assert native_case.stop.leftover_pids == ()


def test_no_error_signatures(native_case: CaseRecord) -> None:
    assert native_case.error_signatures == [], native_case.error_signatures


def test_kvcached_inactive(native_case: CaseRecord) -> None:
    """A native server (ENABLE_KVCACHED=false) writes no [kvcached] line."""
    assert native_case.kvcached_lines == []


def test_greedy_deterministic_across_servers(
    native_case: CaseRecord, native_case_again: CaseRecord
) -> None:
    """Two fresh servers with the same seed give the same greedy tokens and the
    same cached_tokens for every sequential request. Without this, comparing a
    kvcached server with a native one token by token would prove nothing."""
    for phase in ("gen_seq", *APC_ROUNDS):
        a, b = native_case.phase(phase), native_case_again.phase(phase)
        assert all(same_tokens(a, b)), (phase, same_tokens(a, b))
        assert cached_tokens(a) == cached_tokens(b), phase


def test_tp2_serves_like_tp1(native_case: CaseRecord, native_tp2_case: CaseRecord) -> None:
    """Two CPU tensor-parallel workers serve every phase, stop cleanly, log no
    error, and cache exactly the same prefixes as one worker (block accounting
    lives in the scheduler and does not depend on TP). Their tokens may differ
    from TP=1: the split changes the order of floating-point sums."""
    tp2 = native_tp2_case
    assert tp2.start_error is None, tp2.start_error
    for phase in GEN_PHASES + APC_PHASES:
        assert all(c.ok for c in tp2.phase(phase)), phase
    for phase in APC_PHASES:
        assert cached_tokens(tp2.phase(phase)) == cached_tokens(native_case.phase(phase)), phase
    assert tp2.reset_ok is True and tp2.alive_after_load is True
    assert tp2.stop is not None and tp2.stop.clean and tp2.stop.leftover_pids == ()
    assert tp2.error_signatures == [], tp2.error_signatures
