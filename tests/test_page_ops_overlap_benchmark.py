"""benchmarks/page_ops_overlap.py: its op schedule, and one short run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import page_ops_overlap
from kvcached.integrations.vllm import worker
from kvcached.memory.planned import MAP, UNMAP


def test_schedule_maps_and_releases_and_leaves_nothing_mapped() -> None:
    plan = page_ops_overlap.schedule(200, 4, 8)
    mapped: set[int] = set()
    most = 0
    for k, ops in enumerate(plan[:200]):
        assert len(ops) == (1 if k % 4 == 0 and k else 0)
        for kind, page, count in ops:
            assert count == 1 and 1 <= page < 8
            if kind == MAP:
                assert page not in mapped
                mapped.add(page)
            else:
                assert kind == UNMAP and page in mapped
                mapped.remove(page)
        most = max(most, len(mapped))
    assert most == page_ops_overlap.KEEP_MAPPED + 1
    for ops in plan[200:]:
        ((kind, page, _),) = ops
        assert kind == UNMAP
        mapped.remove(page)
    assert not mapped


def test_a_short_run_compares_every_mode_and_cleans_up(tmp_path: Path) -> None:
    from kvcached.integrations.vllm import executor

    interval = executor.OVERLAP_SWITCH_INTERVAL_S
    out = tmp_path / "r.json"
    argv = ["--steps", "24", "--rounds", "3", "--step-ms", "1", "--lanes", "2"]
    assert page_ops_overlap.main([*argv, "--driver-delays", "none", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got["step_ms"]) == {"sync", "overlap", "overlap_long", "wait_rule"}
    assert got["step_time_ratio"] > 0 and got["long_interval_ratio"] > 0
    assert got["wait_rule_ratio"] > 0
    assert len(got["rounds"]) == 3 and "provenance" in got
    assert [list(r)[:4] for r in got["rounds"]][:2] == [
        ["sync", "overlap", "overlap_long", "wait_rule"],
        ["overlap", "overlap_long", "wait_rule", "sync"],
    ]  # every mode takes every place in turn
    assert worker.WORKER.executor is None
    assert interval == executor.OVERLAP_SWITCH_INTERVAL_S, "the executor's setting is put back"


def test_the_wait_rule_mode_waits_only_beside_steps_max_steps_after_ops(monkeypatch) -> None:
    import torch

    from kvcached.integrations.vllm.planner import BESIDE_STEPS_MAX

    seen: list[tuple[bool, bool]] = []
    monkeypatch.setattr(
        worker,
        "apply_step_ops",
        lambda out: seen.append((bool(out.kvcached_ops), out.kvcached_wait)),
    )
    monkeypatch.setattr(worker, "_apply_ops", lambda ops: None)
    plan = page_ops_overlap.schedule(40, 8, 8)[:40]
    page_ops_overlap.run_steps(plan, "wait_rule", 1, torch.zeros(1))
    with_ops = [k for k, (ops, _) in enumerate(seen) if ops]
    waits = [k for k, (_, wait) in enumerate(seen) if wait]
    assert with_ops == [8, 16, 24, 32]
    assert waits == [k + BESIDE_STEPS_MAX for k in with_ops if k + BESIDE_STEPS_MAX < 40]
