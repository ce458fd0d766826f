"""benchmarks/vllm_gpu.py's pure pieces (the GPU run itself needs a GPU and vLLM)."""

from __future__ import annotations

import os

import pytest

import vllm_gpu
from kvcached.control.instance import Instance, PoolUsage


def test_candidate_env_pairs() -> None:
    got = vllm_gpu.parse_env(["KVCACHED_MIN_RESERVED_PAGES=20", "KVCACHED_MAX_CACHED_TOKENS=-1"])
    assert got == {"KVCACHED_MIN_RESERVED_PAGES": "20", "KVCACHED_MAX_CACHED_TOKENS": "-1"}
    assert vllm_gpu.parse_env(["A=x=y"]) == {"A": "x=y"}


@pytest.mark.parametrize("bad", ["KVCACHED_X", "=1", "not a name=1"])
def test_a_malformed_candidate_env_names_itself(bad: str) -> None:
    with pytest.raises(SystemExit, match="--candidate-env"):
        vllm_gpu.parse_env([bad])


def test_ratios_are_candidate_over_baseline_per_round() -> None:
    def side(tput: float) -> dict:
        return {"throughput_tok_s": tput, "p95_ttft_s": 1.0, "p95_tpot_s": 1.0}

    rounds = [
        {"baseline": side(100.0), "candidate": side(99.0), "control": side(101.0)},
        {"baseline": side(100.0), "candidate": side(97.0), "control": side(100.0)},
        {"baseline": side(100.0), "candidate": side(98.0), "control": side(102.0)},
    ]
    got = vllm_gpu.ratios(rounds, "candidate")["throughput_ratio"]
    assert got == {"median": 0.98, "min": 0.97, "max": 0.99}


def _side(ttfts: list[float]) -> dict:
    return {"ttft_ms": ttfts, "tpot_ms": [10.0] * len(ttfts)}


def test_pooled_pairs_requests_across_rounds() -> None:
    base = [float(i) for i in range(1, 41)]
    rounds = [
        {"baseline": _side(base[:20]), "candidate": _side([v + 2 for v in base[:20]]),
         "control": _side(base[:20])},
        {"baseline": _side(base[20:]), "candidate": _side([v + 2 for v in base[20:]]),
         "control": _side(base[20:])},
    ]  # fmt: skip
    got = vllm_gpu.pooled(rounds, "candidate")
    assert got["requests"] == 40
    assert got["paired_ttft_delta_ms"]["median"] == 2.0
    assert got["paired_ttft_delta_ms"]["p5"] == pytest.approx(2.0)
    assert got["p95_ttft_ratio"] == pytest.approx(
        vllm_gpu.p95([v + 2 for v in base]) / vllm_gpu.p95(base)
    )
    assert got["p95_tpot_ratio"] == 1.0
    control = vllm_gpu.pooled(rounds, "control")
    assert control["paired_ttft_delta_ms"]["mean"] == 0.0
    assert control["mean_ttft_ratio"] == 1.0


def test_start_order_names_each_role_once() -> None:
    assert vllm_gpu.parse_order("control, baseline,candidate") == (
        "control",
        "baseline",
        "candidate",
    )
    for bad in ("candidate,baseline", "candidate,candidate,control", "kv,baseline,control"):
        with pytest.raises(SystemExit, match="--start-order"):
            vllm_gpu.parse_order(bad)


def test_per_round_differences_keep_each_rounds_sign() -> None:
    def side(tpot: float) -> dict:
        return {"ttft_ms": [40.0, 42.0], "tpot_ms": [tpot, tpot + 1.0]}

    rounds = [
        {"baseline": side(14.0), "candidate": side(14.25), "control": side(13.5)},
        {"baseline": side(13.0), "candidate": side(13.5), "control": side(13.25)},
    ]
    got = vllm_gpu.per_round(rounds, "candidate")
    assert got["mean_tpot_ms_over_baseline"] == pytest.approx([0.25, 0.5])
    assert got["mean_ttft_ms_over_baseline"] == [0.0, 0.0]
    assert vllm_gpu.per_round(rounds, "control")["mean_tpot_ms_over_baseline"] == pytest.approx(
        [-0.5, 0.25]
    )


def test_halves_merge_lists_and_average_scalars() -> None:
    halves = [
        {"wall_s": 10.0, "ttft_ms": [1.0, 2.0]},
        {"wall_s": 12.0, "ttft_ms": [3.0]},
    ]
    assert vllm_gpu.merge_halves(halves) == {"wall_s": 11.0, "ttft_ms": [1.0, 2.0, 3.0]}


class _Pool:
    def __init__(self, maps: int, unmaps: int, overlapped: int, waits: int = 0) -> None:
        self.usage = PoolUsage(
            name="vllm-kv",
            gpu="host-0",
            backend="host",
            bytes_mapped=4 << 20,
            page_maps=maps,
            page_unmaps=unmaps,
            page_ops_overlapped=overlapped,
            page_op_waits=waits,
        )

    def pool_usage(self) -> PoolUsage:
        return self.usage

    def apply_limit(self, limit_bytes: int | None) -> None:
        pass

    def reclaim(self, nbytes: int) -> int:
        return 0


def test_page_ops_come_from_the_candidates_published_snapshot() -> None:
    name = f"bench-test-{os.getpid()}"
    instance = Instance(name, start=False)
    try:
        instance.add_pool(_Pool(10, 4, 3, waits=2))
        instance.add_pool(_Pool(2, 1, 0, waits=1))
        got = vllm_gpu.page_ops(name)
        assert got == {
            "page_maps": 12,
            "page_unmaps": 5,
            "page_ops_overlapped": 3,
            "page_op_waits": 3,
            "bytes_mapped": 8 << 20,
        }
        assert vllm_gpu.page_ops(name + "-none")["page_maps"] == 0
    finally:
        instance.close()


def test_page_ops_per_request_count_from_after_warmup() -> None:
    before = {"page_maps": 10, "page_unmaps": 4, "page_ops_overlapped": 0, "bytes_mapped": 1}
    rounds = [
        {"page_ops": {"page_maps": 50, "page_unmaps": 30, "page_ops_overlapped": 0}},
        {"page_ops": {"page_maps": 90, "page_unmaps": 84, "page_ops_overlapped": 8, "x": 0}},
    ]
    got = vllm_gpu.per_request(before, rounds, 256)
    assert got == {"page_maps": 80 / 256, "page_unmaps": 80 / 256, "page_ops_overlapped": 8 / 256}
    assert vllm_gpu.per_request(before, [], 0) == {}


def _args(**over: object):
    import argparse

    base = {"native_util": 0.28, "native_kv_gib": None, "candidate_env": {"KVCACHED_X": "1"}}
    return argparse.Namespace(**{**base, **over})


def test_native_servers_get_a_fixed_kv_cache_when_asked_and_kvcached_none() -> None:
    extra, env = vllm_gpu.server_setup("baseline", _args(native_kv_gib=6.07), together=False)
    assert extra == ["--gpu-memory-utilization", "0.28", "--kv-cache-memory-bytes",
                     str(int(6.07 * 2**30))]  # fmt: skip
    assert env["ENABLE_KVCACHED"] == "false" and "KVCACHED_X" not in env
    assert "VLLM_CACHE_ROOT" not in env  # started alone, the servers share vLLM's cache
    extra, env = vllm_gpu.server_setup("candidate", _args(), together=True)
    assert extra == [] and env["ENABLE_KVCACHED"] == "true" and env["KVCACHED_X"] == "1"
    roots = {
        vllm_gpu.server_setup(r, _args(native_kv_gib=6.0), together=True)[1]["VLLM_CACHE_ROOT"]
        for r in vllm_gpu.ROLES
    }
    assert len(roots) == 3  # together, none reads another's half-written compile cache


class _FakeServer:
    def __init__(self, role: str, events: list[str], ready: float | None = 1.0) -> None:
        self.role, self.events, self.ready, self.log = role, events, ready, f"/logs/{role}.log"

    def start(self) -> None:
        self.events.append(f"start {self.role}")

    def wait_ready(self, timeout: float) -> float | None:
        self.events.append(f"ready {self.role}")
        return self.ready


def test_servers_start_one_after_another_or_all_at_once() -> None:
    events: list[str] = []
    servers = {r: _FakeServer(r, events) for r in vllm_gpu.ROLES}
    order = ("control", "baseline", "candidate")
    assert vllm_gpu.start_servers(servers, order) == dict.fromkeys(order, 1.0)
    assert events == [f"{e} {r}" for r in order for e in ("start", "ready")]
    events.clear()
    vllm_gpu.start_servers(servers, vllm_gpu.parse_order("together"))
    assert events[:3] == [f"start {r}" for r in vllm_gpu.ROLES]
    assert sorted(events[3:]) == [f"ready {r}" for r in vllm_gpu.ROLES]
    servers["candidate"].ready = None
    with pytest.raises(RuntimeError, match="candidate did not start; log /logs/candidate.log"):
        vllm_gpu.start_servers(servers, ("together",))


def test_starting_together_needs_the_natives_kv_size(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--start-order together needs --native-kv-gib"):
        vllm_gpu.main(["--start-order", "together", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="--native-kv-gib -1.0: must be a size in GiB"):
        vllm_gpu.main(["--native-kv-gib", "-1", "--out", str(tmp_path / "x.json")])
