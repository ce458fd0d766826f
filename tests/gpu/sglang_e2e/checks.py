"""The SGLang GPU cases' check logic: server arguments, log findings, comparisons
with native and the summary (pure functions: no GPU, no SGLang, tested in CI).

The seed plan's checks, per server: HTTP 200 with tokens on every request, alive
after the load, a clean exit, no traceback, CUDA error or kvcached patch failure
in its log, kvcached active (or, natively, no ``[kvcached]`` line at all), no GPU
process left; per kvcached server against native: greedy tokens equal, top-5
logprobs within :data:`LOGPROB_TOL`, ``cached_tokens`` of the prefix-cache phases
equal (and some cached).
"""

from __future__ import annotations

from typing import Any

from benchmarks.kvharness.gpu_server import BAD_LINES, error_lines
from tests.gpu.e2e_cases import ok_replies

LOGPROB_TOL = 0.05

#: The seed plan's three SGLang kinds. kvcached's SGLang pools always use the
#: per-layer layout (SGLang indexes a layer's K and V as strided token rows), so
#: the two kvcached kinds differ only in the variable they set, which the plan
#: names as its cases ``kv_c1`` / ``kv_c0``; both must serve as native does.
KINDS: dict[str, dict[str, str]] = {
    "kv_c1": {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "true"},
    "kv_c0": {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false"},
    "native": {"ENABLE_KVCACHED": "false"},
}

#: What the gpu-sglang bundle serves with (tools/gpu-sglang/README.md): Triton
#: attention (no FlashAttention 3 in the bundle), torch sampling (no FlashInfer
#: kernels), no grammar backend (no xgrammar library).
BUNDLE_ARGS = (
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
)

#: kvcached's own failure lines: a patch group undone, a version not supported,
#: pools left native.
KVCACHED_BAD = (
    "failed and was undone",
    "is not supported by kvcached",
    "keeps SGLang's own KV buffers",
    "KV pools stay native",
)
#: kvcached's lines that prove it serves SGLang: the patch (every process) and the
#: cache sized from kvcached's virtual budget (the scheduler, where pools are built).
KVCACHED_ACTIVE = ("patch on", "virtual budget")


def engine_args(
    *,
    context_length: int,
    mem_fraction: float,
    max_running: int,
    graphs: bool,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """A case server's ``sglang.launch_server`` arguments after its model, name,
    host and port (what a ``kvcached serve`` entry's ``args`` take): the seed
    plan's (``--random-seed 42 --enable-cache-report``, context length, batch
    limit, memory fraction) and the bundle's."""
    if not 0 < mem_fraction < 1:
        raise ValueError(f"mem_fraction={mem_fraction}: a fraction in (0, 1)")
    if max_running < 1 or context_length < 1:
        raise ValueError(f"max_running={max_running}, context_length={context_length}: both >= 1")
    argv = [
        "--random-seed",
        "42",
        "--enable-cache-report",
        "--dtype",
        "bfloat16",
        "--context-length",
        str(context_length),
        "--max-running-requests",
        str(max_running),
        "--mem-fraction-static",
        str(mem_fraction),
        *BUNDLE_ARGS,
    ]
    if not graphs:
        argv.append("--disable-cuda-graph")
    return argv + list(extra)


def server_args(*, model: str, name: str, port: int, **engine: Any) -> list[str]:  # noqa: ANN401
    """``python -m sglang.launch_server`` arguments of one case's server: its
    model, served name and port on loopback, then :func:`engine_args`."""
    launch = ["--model-path", model, "--served-model-name", name, "--host", "127.0.0.1"]
    return [*launch, "--port", str(port), *engine_args(**engine)]


def log_findings(text: str, kvcached: bool, shutdown: str = "") -> dict[str, Any]:
    """What one server's log shows: bad lines, kvcached's lines, and the one
    verdict this kind needs (``kvcached_active`` or ``no_kvcached_line``).
    ``shutdown`` is what it wrote after the harness' stop signal: SGLang's
    children print a ``KeyboardInterrupt`` traceback there on every Ctrl-C,
    so only a CUDA error counts in it (:func:`~benchmarks.kvharness.gpu_server.error_lines`,
    which vLLM's runner applies after vLLM's own ``[shutdown]`` line)."""
    bad = error_lines(text, shutdown)
    kv_lines = [ln for ln in (text + shutdown).splitlines() if "[kvcached]" in ln]
    kv_bad = [b for b in KVCACHED_BAD if any(b in ln for ln in kv_lines)]
    found: dict[str, Any] = {
        "no_traceback_or_cuda_error": not bad,
        "bad": bad + kv_bad,
        "kvcached_lines": kv_lines[:12],
        "shutdown_tracebacks": shutdown.count(BAD_LINES[0]),
    }
    if kvcached:
        active = all(any(a in ln for ln in kv_lines) for a in KVCACHED_ACTIVE)
        found["kvcached_active"] = active and not kv_bad
    else:
        found["no_kvcached_line"] = not kv_lines
    return found


def kv_tokens(text: str) -> int | None:
    """SGLang's KV capacity from its scheduler's ``max_total_num_tokens=N`` line."""
    for line in text.splitlines():
        if "max_total_num_tokens=" in line:
            tail = line.split("max_total_num_tokens=", 1)[1]
            digits = "".join(ch for ch in tail.split(",", 1)[0] if ch.isdigit())
            if digits:
                return int(digits)
    return None


def compare(ours: list[dict], native: list[dict]) -> tuple[bool, float, bool]:
    """(tokens equal, largest top-5 logprob gap over shared tokens, top-5 sets equal);
    replies of different counts are unequal."""
    if len(ours) != len(native):
        return False, float("inf"), False
    equal, worst, sets = True, 0.0, True
    for a, b in zip(ours, native, strict=True):
        if a.get("tokens") != b.get("tokens") or not a.get("tokens"):
            equal = False
        top_a, top_b = a.get("top") or [], b.get("top") or []
        if len(top_a) != len(top_b):
            sets = False
        for ta, tb in zip(top_a, top_b, strict=False):
            if set(ta) != set(tb):
                sets = False
            for tok in set(ta) & set(tb):
                worst = max(worst, abs(ta[tok] - tb[tok]))
    return equal, worst, sets


def server_checks(result: dict[str, Any], found: dict[str, Any], kvcached: bool) -> dict[str, bool]:
    """One server's own checks from its run (``ready_s``, ``phases``,
    ``alive_after_load``, ``exit_s``, ``gpu_process_left``) and log findings."""
    phases = result.get("phases") or {}
    replies = [x for v in phases.values() if isinstance(v, list) for x in v]
    key = "kvcached_active" if kvcached else "no_kvcached_line"
    return {
        "server_ready": result.get("ready_s") is not None,
        "every_request_200_with_tokens": ok_replies(replies),
        "alive_after_load": bool(result.get("alive_after_load")),
        "clean_exit_within_90s": result.get("exit_s") is not None,
        "no_traceback_cuda_error_or_patch_failure": bool(
            found["no_traceback_or_cuda_error"] and not found["bad"]
        ),
        key: bool(found.get(key)),
        "no_gpu_process_left": result.get("gpu_process_left") is False,
    }


def native_checks(ours: dict[str, Any], native: dict[str, Any]) -> dict[str, Any]:
    """A kvcached server's phases against native's: the checks and two figures
    (``max_logprob_gap``, ``cached_tokens``), keys starting with ``_``."""
    seq_eq, seq_gap, seq_sets = compare(ours.get("gen_seq", []), native.get("gen_seq", []))
    apc_eq, apc_gap, apc_sets = True, 0.0, True
    for i in range(3):
        key = f"apc_{i}"
        e, g, s = compare(ours.get(key, []), native.get(key, []))
        apc_eq, apc_gap, apc_sets = apc_eq and e, max(apc_gap, g), apc_sets and s
    cached = [[x.get("cached_tokens") for x in ours.get(f"apc_{i}", [])] for i in range(3)]
    ncached = [[x.get("cached_tokens") for x in native.get(f"apc_{i}", [])] for i in range(3)]
    gap = max(seq_gap, apc_gap)
    return {
        "gen_seq_tokens_equal_native": seq_eq,
        "apc_tokens_equal_native": apc_eq,
        "top5_logprobs_within_tol": gap <= LOGPROB_TOL and seq_sets and apc_sets,
        "cached_tokens_equal_native": cached == ncached
        and any((v or 0) > 0 for row in cached for v in row),
        "_max_logprob_gap": gap,
        "_cached_tokens": cached,
    }


#: Co-started capacities may differ by this share of the larger: the virtual
#: budget subtracts each process' own resident bytes, which can differ by a few
#: MiB between two processes of one model (far less than what a server that
#: counted the other's memory as its own would lose).
CO_START_TOLERANCE = 1 / 1000


def co_start_checks(tokens: list[int | None]) -> dict[str, bool]:
    """Two kvcached servers started at once must each be sized as if alone
    (kvcached's virtual budget ignores what the other holds): equal KV capacity,
    within :data:`CO_START_TOLERANCE`."""
    sized = len(tokens) == 2 and all(t is not None for t in tokens)
    equal = sized and abs(tokens[0] - tokens[1]) <= max(tokens) * CO_START_TOLERANCE
    return {"both_sized": sized, "kv_capacity_equal": bool(equal)}


def engines_listed(rows: list[dict[str, Any]], want: dict[str, str]) -> bool:
    """``kvctl list --json`` shows every instance of ``want`` (name -> engine)
    with that engine named."""
    seen = {r.get("name"): r.get("engine") for r in rows}
    return bool(want) and all(seen.get(name) == engine for name, engine in want.items())
