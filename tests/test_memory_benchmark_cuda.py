"""benchmarks/memory.py --backend cuda (the GPU command's memory figures),
benchmarks/grow_overhead.py and benchmarks/driver_threads.py run end to end on
the fake libcuda, so the H200 run cannot fail on a typo; the figures
themselves mean nothing here."""

from __future__ import annotations

import json

import pytest

from tests.test_driver_cuda import _run_with_fake, fake_libcuda  # noqa: F401 (fixture)

# Benchmark scripts run end to end (3-18 s each on 2 cores): CI runs them, the
# developer loop (-m "not slow") does not.
pytestmark = pytest.mark.slow

FAKE = {"FAKE_CUDA_NOOP": "1", "FAKE_CUDA_TOTAL": str(4 << 30)}


def run_benchmark(fake_libcuda, out, script: str, *args: str) -> dict:  # noqa: F811
    """Run ``benchmarks/<script>`` on the fake libcuda, writing ``out``; its JSON."""
    result = _run_with_fake(
        fake_libcuda,
        [f"benchmarks/{script}", "--backend", "cuda", *args, "--out", str(out)],
        **FAKE,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    prov = data[
        "provenance"
    ]  # benchmarks/_provenance.py: every result file says where it came from
    assert prov["command"].startswith(f"python benchmarks/{script} --backend cuda"), prov
    assert prov["commit"] and prov["machine"]["cpus"] >= 1, prov
    assert len(prov["load_average_start"]) == len(prov["load_average_end"]) == 3, prov
    return data


def test_memory_benchmark_runs_on_the_fake_driver(fake_libcuda, tmp_path):  # noqa: F811
    data = run_benchmark(
        fake_libcuda, tmp_path / "memory.json", "memory.py", "--repeats", "1", "--grow-mib", "64"
    )
    assert data["device"]["name"] == "Fake CUDA Device 0"
    for key in (
        "grow_ratio",
        "grow_ratio_batched_32",
        "grow_ratio_coalesced_64mib",
        "grow_ratio_pooled",
        "grow_ratio_llama3_8b",
        "grow_ratio_llama3_8b_contiguous",
        "grow_ratio_llama3_8b_same_addresses",
        "shrink_ratio_batched_32",
        "raw_us_per_2mib",
        "allocator_us_per_2mib",
        "available_size_us",
    ):
        assert data[key] > 0, key
    assert data["llama3_8b"]["handles_per_page"] == 64
    assert set(data["paired_round_median"]) >= {
        "grow_ratio",
        "grow_ratio_pooled",
        "shrink_ratio_batched_32",
    }
    assert data["grow_lock"]["locked_over_unlocked_paired_median"] > 0
    assert isinstance(data["grow_lock"]["keep"], bool)
    assert data["commit"] and len(data["load_average_before"]) == 3
    rounds = data["rounds"]
    assert all(len(ms) == rounds for ms in data["round_ms"].values())
    split = data["grow_split_us_per_page"]
    for loop in ("raw", "allocator"):
        assert split[loop]["calls_per_page"] == {"create": 1.0, "map": 1.0, "set_access": 1.0}
        assert split[loop]["total"] >= split[loop]["create"] + split[loop]["set_access"]
    assert data["grow_python_overhead"]["allocator_python_us_per_page"] > 0
    explained = data["grow_explained"]
    assert 0 < explained["ratio_python_alone_allows"] < 1
    assert set(explained["driver_calls_slower_in_allocator_us"]) == {"create", "map", "set_access"}


def test_grow_overhead_runs_with_the_null_and_the_fake_driver(fake_libcuda, tmp_path):  # noqa: F811
    data = run_benchmark(
        fake_libcuda,
        tmp_path / "grow.json",
        "grow_overhead.py",
        "--rounds",
        "2",
        "--pages",
        "32",
        "--pages-per-take",
        "4",
    )
    assert data["null"]["pages_per_take"] == 4
    assert data["null"]["allocator_null_us_per_page"] > data["null"]["raw_null_us_per_page"]
    assert data["split_us_per_page"]["allocator"]["calls_per_page"]["create"] == 1.0


def test_driver_threads_runs_on_the_fake_driver(fake_libcuda, tmp_path):  # noqa: F811
    data = run_benchmark(
        fake_libcuda,
        tmp_path / "threads.json",
        "driver_threads.py",
        "--mib",
        "256",
        "--rounds",
        "1",
    )
    assert set(data["ratio_over_serial_best"]) == {
        "serial",
        "threads_2",
        "threads_4",
        "pipeline",
        "lanes_64",
        "runs_32",
    }
    assert isinstance(data["two_threads_slower_in_the_median"], bool)
    assert data["ratio_over_serial_best"]["serial"] == 1.0


def test_driver_runs_runs_on_the_fake_driver(fake_libcuda, tmp_path):  # noqa: F811
    data = run_benchmark(
        fake_libcuda, tmp_path / "runs.json", "driver_runs.py", "--mib", "256", "--rounds", "1"
    )
    assert (
        data["paired_over_per_page"]["grow_k1"] == data["paired_over_per_page"]["shrink_k1"] == 1.0
    )
    assert {"grow_k32", "grow_k32_split", "shrink_k64"} <= set(data["us_per_page_best"])
