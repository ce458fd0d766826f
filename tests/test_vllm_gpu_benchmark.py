"""benchmarks/vllm_gpu.py's pure pieces (the GPU run itself needs a GPU and vLLM)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import vllm_gpu  # noqa: E402


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


def test_halves_merge_lists_and_average_scalars() -> None:
    halves = [
        {"wall_s": 10.0, "ttft_ms": [1.0, 2.0]},
        {"wall_s": 12.0, "ttft_ms": [3.0]},
    ]
    assert vllm_gpu.merge_halves(halves) == {"wall_s": 11.0, "ttft_ms": [1.0, 2.0, 3.0]}
