"""benchmarks/vllm_step.py's pure pieces (the engines themselves need vLLM)."""

from __future__ import annotations

import argparse

import pytest

import vllm_step


def _proc(median: float, parts: dict[str, float]) -> dict:
    return {"median_step_us": median, "mean_step_us": median, "parts_us": parts}


def test_summarize_is_kvcached_against_native_per_pair() -> None:
    native = dict.fromkeys(vllm_step.PARTS, 100.0)
    pairs = [
        {"native": _proc(2000.0, native),
         "kvcached": _proc(2100.0, {**native, "schedule": 140.0})},
        {"native": _proc(2000.0, native),
         "kvcached": _proc(2040.0, {**native, "schedule": 120.0})},
    ]  # fmt: skip
    got = vllm_step.summarize(pairs)
    assert got["step_ratio"] == {"median": pytest.approx(1.035), "min": 1.02, "max": 1.05}
    assert got["part_delta_us"]["schedule"] == {"median": 30.0, "min": 20.0, "max": 40.0}
    assert got["part_delta_us"]["execute_model"]["max"] == 0.0
    assert got["native_parts_us"]["schedule"] == 100.0


def test_batches_are_seeded_and_sized() -> None:
    args = argparse.Namespace(seed=3, rounds=2, concurrency=4, min_prompt=8, max_prompt=16)
    first = vllm_step.batches(args, 500)
    assert first == vllm_step.batches(args, 500)
    assert len(first) == 3 and all(len(b) == 4 for b in first)
    assert all(8 <= len(p) <= 16 and max(p) < 500 for b in first for p in b)


@pytest.mark.parametrize(
    ("argv", "names"),
    [(["--pairs", "0"], "--pairs 0"), (["--min-prompt", "9", "--max-prompt", "8"], "--min-prompt")],
)
def test_bad_arguments_are_named(
    argv: list[str], names: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit):
        vllm_step.main(argv)
    assert names in capsys.readouterr().err
