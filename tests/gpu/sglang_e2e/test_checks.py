"""The SGLang GPU runner's CPU-checkable parts: arguments, log findings,
comparisons with native, the summary (no GPU, no SGLang)."""

from __future__ import annotations

import json

import pytest

from tests.gpu.e2e_run import failed_checks
from tests.gpu.sglang_e2e import checks as ck
from tests.gpu.sglang_e2e.__main__ import parse


def _reply(tokens: list[str], top: list[dict[str, float]] | None = None, cached: int = 0) -> dict:
    return {
        "status": 200,
        "tokens": tokens,
        "top": top if top is not None else [{t: -0.1} for t in tokens],
        "completion_tokens": len(tokens),
        "cached_tokens": cached,
    }


def _phases(cached: int = 5, token: str = "a") -> dict:
    return {
        "gen_seq": [_reply([token, "b"])],
        "gen_conc": [_reply([token, "b"])],
        "reset_status": 200,
        **{f"apc_{i}": [_reply(["c"], cached=cached * i)] for i in range(3)},
        "apc_conc": [_reply(["c"], cached=cached)],
    }


def test_server_args_are_the_plans_and_the_bundles() -> None:
    argv = ck.server_args(model="/m", name="n", port=30001, context_length=4096,
                          mem_fraction=0.8, max_running=32, graphs=False)  # fmt: skip

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--model-path") == "/m" and value("--served-model-name") == "n"
    assert value("--port") == "30001" and value("--mem-fraction-static") == "0.8"
    assert value("--attention-backend") == "triton" and value("--sampling-backend") == "pytorch"
    assert value("--random-seed") == "42" and value("--grammar-backend") == "none"
    assert "--enable-cache-report" in argv and argv[-1] == "--disable-cuda-graph"
    with_graphs = ck.server_args(model="/m", name="n", port=1, context_length=8, mem_fraction=0.5,
                                 max_running=1, graphs=True)  # fmt: skip
    assert "--disable-cuda-graph" not in with_graphs


@pytest.mark.parametrize("bad", [{"mem_fraction": 0.0}, {"mem_fraction": 1.0}, {"max_running": 0}])
def test_server_args_refuse_what_sglang_would_misread(bad: dict) -> None:
    kw = dict(model="/m", name="n", port=1, context_length=8, mem_fraction=0.5, max_running=1,
              graphs=False)  # fmt: skip
    with pytest.raises(ValueError, match=next(iter(bad))):
        ck.server_args(**{**kw, **bad})


def test_parse_defaults_and_refusals(tmp_path) -> None:
    args = parse(["--out", str(tmp_path)])
    assert args.cases == ["models", "limit", "elastic", "serve"] and args.kinds == list(ck.KINDS)
    assert args.make_model == ".gpu/sglang/make_model.py" and not args.logs.startswith(
        str(tmp_path)
    )
    assert parse(["--out", "x", "--cases", "limit"]).cases == ["limit"]
    with pytest.raises(SystemExit):
        parse(["--out", "x", "--kv-fraction", "1.5"])
    assert parse(["--out", "x", "--cases", "mixed"]).cases == ["mixed"]  # only when asked
    with pytest.raises(SystemExit):
        parse(["--out", "x", "--cases", "everything"])


def test_engines_listed_needs_each_instance_with_its_engine() -> None:
    rows = [{"name": "v", "engine": "vllm"}, {"name": "s", "engine": "sglang"}]
    assert ck.engines_listed(rows, {"v": "vllm", "s": "sglang"})
    assert not ck.engines_listed(rows[:1], {"v": "vllm", "s": "sglang"})
    assert not ck.engines_listed([{"name": "s", "engine": "kvcached"}], {"s": "sglang"})
    assert not ck.engines_listed(rows, {})


KV_LOG = """\
[kvcached] INFO SGLang 0.5.17: kvcached 0.2.0 patch on (groups: pools, scheduler)
[kvcached] INFO KV cache sized from a virtual budget of 60.00 GiB (total x 0.8 - 1.00 GiB resident)
[2026-12-06 08:00:00] max_total_num_tokens=5242880, chunked_prefill_size=8192, max_prefill_tokens=16384
"""


def test_log_findings_kvcached_and_native() -> None:
    found = ck.log_findings(KV_LOG, kvcached=True)
    assert found["kvcached_active"] and found["no_traceback_or_cuda_error"] and not found["bad"]
    # patched but the pools stayed native: not active, and a failure line
    native_pools = KV_LOG.replace("KV cache sized from a virtual budget", "x") + (
        "[kvcached] WARNING SGLang's KV pools stay native: hybrid SWA pools\n"
    )
    found = ck.log_findings(native_pools, kvcached=True)
    assert not found["kvcached_active"] and found["bad"] == ["KV pools stay native"]
    undone = KV_LOG + "[kvcached] ERROR patch group 'scheduler' failed and was undone; ...\n"
    assert not ck.log_findings(undone, kvcached=True)["kvcached_active"]
    assert ck.log_findings("plain log\n", kvcached=False)["no_kvcached_line"]
    assert not ck.log_findings(KV_LOG, kvcached=False)["no_kvcached_line"]
    crashed = ck.log_findings("Traceback (most recent call last):\n", kvcached=False)
    assert not crashed["no_traceback_or_cuda_error"]


def test_kv_tokens_reads_the_schedulers_line() -> None:
    assert ck.kv_tokens(KV_LOG) == 5242880
    assert ck.kv_tokens("no such line") is None
    assert ck.co_start_checks([10, 10]) == {"both_sized": True, "kv_capacity_equal": True}
    assert ck.co_start_checks([10, 11])["kv_capacity_equal"] is False
    assert ck.co_start_checks([100_000, 99_950])["kv_capacity_equal"] is True  # a few MiB apart
    assert ck.co_start_checks([100_000, 50_000])["kv_capacity_equal"] is False  # counted the other
    assert ck.co_start_checks([None, 10]) == {"both_sized": False, "kv_capacity_equal": False}


def test_compare_catches_tokens_logprobs_and_count() -> None:
    a = [_reply(["x", "y"], [{"x": -0.1, "z": -2.0}, {"y": -0.2}])]
    assert ck.compare(a, a) == (True, 0.0, True)
    moved = [_reply(["x", "y"], [{"x": -0.3, "z": -2.0}, {"y": -0.2}])]
    equal, gap, sets = ck.compare(moved, a)
    assert equal and sets and gap == pytest.approx(0.2)
    other_set = [_reply(["x", "y"], [{"x": -0.1, "w": -2.0}, {"y": -0.2}])]
    assert ck.compare(other_set, a)[2] is False
    assert ck.compare([_reply(["x", "q"])], a)[0] is False
    assert ck.compare([], a)[0] is False
    assert ck.compare([{"status": 200, "tokens": []}], [{"status": 200, "tokens": []}])[0] is False


def test_native_checks_pass_alike_and_fail_each_way() -> None:
    c = ck.native_checks(_phases(), _phases())
    assert all(v is True for k, v in c.items() if not k.startswith("_")), c
    assert ck.native_checks(_phases(token="z"), _phases())["gen_seq_tokens_equal_native"] is False
    assert ck.native_checks(_phases(cached=3), _phases())["cached_tokens_equal_native"] is False
    # equal but nothing ever cached: the prefix cache did not work on either
    assert (
        ck.native_checks(_phases(cached=0), _phases(cached=0))["cached_tokens_equal_native"]
        is False
    )


def test_server_checks_every_check_can_fail() -> None:
    good = {"ready_s": 30.0, "phases": _phases(), "alive_after_load": True, "exit_s": 3.0,
            "gpu_process_left": False}  # fmt: skip
    found = ck.log_findings(KV_LOG, kvcached=True)
    c = ck.server_checks(good, found, kvcached=True)
    assert set(c.values()) == {True}, c
    broken = {"ready_s": None, "phases": {"gen_seq": [{"status": 500}]}, "alive_after_load": False,
              "exit_s": None, "gpu_process_left": True}  # fmt: skip
    bad_log = ck.log_findings("Traceback (most recent call last)\n", kvcached=True)
    c = ck.server_checks(broken, bad_log, kvcached=True)
    assert set(c.values()) == {False}, c
    unknown = ck.server_checks({**good, "gpu_process_left": None}, found, kvcached=True)
    assert unknown["no_gpu_process_left"] is False  # not measured is not a pass


def test_failed_checks_and_the_summary_shape() -> None:
    cases = {"a": {"x": True, "y": False}, "b": {}, "c": {"z": None}}
    assert failed_checks(cases) == [("a", "y"), ("c", "z"), ("b", "(no checks)")]
    assert failed_checks({"a": {"x": True}}) == []
    json.dumps({"cases": cases})  # what summary.json holds is plain JSON


def test_a_traceback_after_the_stop_signal_is_shutdown_noise_a_cuda_error_is_not() -> None:
    """SGLang 0.5.17's detokenizer prints a KeyboardInterrupt traceback on every
    Ctrl-C (the first GPU run failed its native server on it): after the stop
    only a CUDA error counts; before it a traceback still fails."""
    interrupt = "Traceback (most recent call last):\n  KeyboardInterrupt\n"
    quiet = ck.log_findings(KV_LOG, kvcached=True, shutdown=interrupt)
    assert quiet["no_traceback_or_cuda_error"] and quiet["shutdown_tracebacks"] == 1
    cuda = ck.log_findings(KV_LOG, kvcached=True, shutdown="CUDA error: an illegal access\n")
    assert not cuda["no_traceback_or_cuda_error"]
    early = ck.log_findings(KV_LOG + interrupt, kvcached=True, shutdown="")
    assert not early["no_traceback_or_cuda_error"]


def test_findings_split_the_log_where_the_stop_signal_went_out(tmp_path) -> None:
    from types import SimpleNamespace as NS

    from tests.gpu.sglang_e2e.__main__ import findings

    log = tmp_path / "s.log"
    before = KV_LOG
    log.write_text(before + "Traceback (most recent call last):\n  KeyboardInterrupt\n")
    stopped = NS(log=log, log_bytes_at_stop=len(before.encode()))
    assert findings(stopped, True)["no_traceback_or_cuda_error"]
    never_stopped = NS(log=log, log_bytes_at_stop=None)
    assert not findings(never_stopped, True)["no_traceback_or_cuda_error"]
