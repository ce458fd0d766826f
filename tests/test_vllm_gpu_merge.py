"""benchmarks/vllm_gpu_merge.py: pooling vllm_gpu.py calls of opposite start orders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vllm_gpu_merge

FORWARD = ["candidate", "baseline", "control"]
MIRROR = ["control", "baseline", "candidate"]


def _side(ttft: float, tpot: float, n: int = 4) -> dict:
    return {"ttft_ms": [ttft] * n, "tpot_ms": [tpot] * n, "throughput_tok_s": 1000.0 / tpot,
            "p95_ttft_s": ttft / 1000, "p95_tpot_s": tpot / 1000}  # fmt: skip


def _part(tmp_path: Path, name: str, order: list[str], rounds: int, **over: object) -> Path:
    # A start place costs its server 0.2 ms of TPOT for each server started after
    # it; kvcached costs nothing of its own.
    place = {role: 0.2 * (2 - order.index(role)) for role in order}
    result = {
        "complete": True,
        "start_order": order,
        "rounds": [{role: _side(50.0, 14.0 + place[role]) for role in order}] * rounds,
        "model": "llama-3.1-8b",
        "trace": {"requests": 96, "rate": 10.0},
        "candidate_env": {},
        "provenance": {
            "commit": "a" * 40,
            "command": "python benchmarks/vllm_gpu.py --device-args=--enforce-eager "
            "--native-util 0.28",
            "machine": {"device": "NVIDIA H100 80GB HBM3"},
        },
        **over,
    }
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return path


def test_mirrored_orders_cancel_a_start_place_cost(tmp_path: Path) -> None:
    fwd = _part(tmp_path, "fwd.json", FORWARD, 2)
    rev = _part(tmp_path, "rev.json", MIRROR, 2)
    alone = vllm_gpu_merge.pooled(json.loads(fwd.read_text())["rounds"], "candidate")
    assert alone["mean_tpot_ratio"] > 1.01  # kvcached first looks slower on its own
    got = vllm_gpu_merge.merge([fwd, rev])
    assert got["balanced"] is True
    assert got["rounds_by_start_order"] == {",".join(FORWARD): 2, ",".join(MIRROR): 2}
    cand, ctrl = got["pooled"]["candidate"], got["pooled"]["control"]
    assert cand["mean_tpot_ratio"] == pytest.approx(ctrl["mean_tpot_ratio"])
    assert [p["start_order"] for p in got["parts"]] == [FORWARD, MIRROR]


def test_equal_rounds_trims_the_longer_order(tmp_path: Path) -> None:
    fwd = _part(tmp_path, "fwd.json", FORWARD, 5)
    rev = _part(tmp_path, "rev.json", MIRROR, 3)
    assert vllm_gpu_merge.merge([fwd, rev])["balanced"] is False
    got = vllm_gpu_merge.merge([fwd, rev], equal_rounds=True)
    assert got["rounds_by_start_order"] == {",".join(FORWARD): 3, ",".join(MIRROR): 3}
    assert got["balanced"] is True and len(got["rounds"]) == 6


@pytest.mark.parametrize(
    ("over", "names"),
    [
        ({"trace": {"requests": 64, "rate": 10.0}}, "trace"),
        ({"model": "qwen2.5-0.5b"}, "model"),
        ({"provenance": {"commit": "b" * 40, "command": "python benchmarks/vllm_gpu.py "
          "--device-args=--enforce-eager --native-util 0.28",
          "machine": {"device": "NVIDIA H100 80GB HBM3"}}}, "commit"),
        ({"provenance": {"commit": "a" * 40, "command": "python benchmarks/vllm_gpu.py "
          "--native-util 0.28", "machine": {"device": "NVIDIA H100 80GB HBM3"}}},
         "server arguments"),
        ({"provenance": {"commit": "a" * 40, "command": "python benchmarks/vllm_gpu.py "
          "--device-args=--enforce-eager --native-util 0.28",
          "machine": {"device": "NVIDIA H200"}}}, "device"),
    ],
)  # fmt: skip
def test_a_part_unlike_the_first_is_named(tmp_path: Path, over: dict, names: str) -> None:
    fwd = _part(tmp_path, "fwd.json", FORWARD, 2)
    odd = _part(tmp_path, "odd.json", MIRROR, 2, **over)
    with pytest.raises(ValueError, match=f"odd.json: .*{names}"):
        vllm_gpu_merge.merge([fwd, odd])


def test_one_part_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="two results or more"):
        vllm_gpu_merge.merge([_part(tmp_path, "fwd.json", FORWARD, 2)])


def test_main_writes_the_parts_commit(tmp_path: Path) -> None:
    fwd = _part(tmp_path, "fwd.json", FORWARD, 2)
    rev = _part(tmp_path, "rev.json", MIRROR, 2)
    out = tmp_path / "merged.json"
    assert vllm_gpu_merge.main([str(out), str(fwd), str(rev)]) == 0
    written = json.loads(out.read_text())
    assert written["provenance"]["commit"] == "a" * 40
    assert written["provenance"]["machine"]["device"] == "NVIDIA H100 80GB HBM3"
    assert written["provenance"]["merged_by"].endswith(f"{fwd} {rev}")


def test_main_writes_the_parts_provenance(tmp_path: Path) -> None:
    """The merged block is the parts' (their commands, their load, dirty if
    any part was), as multi_model_merge's is; a part without one is refused."""
    fwd = _part(tmp_path, "fwd.json", FORWARD, 2)
    dirty = json.loads(fwd.read_text())["provenance"] | {"tree_dirty": True}
    rev = _part(tmp_path, "rev.json", MIRROR, 2, provenance=dirty)
    out = tmp_path / "merged.json"
    assert vllm_gpu_merge.main([str(out), str(fwd), str(rev)]) == 0
    block = json.loads(out.read_text())["provenance"]
    assert block["tree_dirty"] is True and block["merged_from"] == ["fwd.json", "rev.json"]
    assert block["command"].count("benchmarks/vllm_gpu.py") == 2
    bare = [_part(tmp_path, f"bare-{i}.json", o, 2, provenance=None)
            for i, o in enumerate((FORWARD, MIRROR))]  # fmt: skip
    with pytest.raises(SystemExit, match="provenance block"):
        vllm_gpu_merge.main([str(out), *map(str, bare)])


def test_servers_started_together_have_no_place_to_balance(tmp_path: Path) -> None:
    together = _part(tmp_path, "together.json", FORWARD, 2, start_order=["together"])
    again = _part(tmp_path, "again.json", FORWARD, 1, start_order=["together"])
    got = vllm_gpu_merge.merge([together, again])
    assert got["balanced"] is True and got["rounds_by_start_order"] == {"together": 3}
    fwd = _part(tmp_path, "fwd.json", FORWARD, 2)
    assert vllm_gpu_merge.merge([together, fwd])["balanced"] is False
