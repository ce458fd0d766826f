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
