"""The multi-model benchmark's sampler (benchmarks/multi_model_client.py): per kvcached
model, what of its mapped KV no running request holds (idle reserve pages and idle
prefix-cached blocks), so that a neighbour's miss at the knee can be told from a full GPU."""

from __future__ import annotations

from pathlib import Path

import multi_model_client as mmc

GIB = 1 << 30
ROWS = [
    {"name": "mm-a", "state": "live", "used_bytes": 8 * GIB, "reserved_bytes": GIB // 2,
     "prefix_cache_bytes": GIB, "misses": 0},
    {"name": "mm-b", "state": "live", "used_bytes": 10 * GIB, "reserved_bytes": 0,
     "prefix_cache_bytes": 0, "misses": 31},
    {"name": "old", "state": "dead", "used_bytes": GIB, "reserved_bytes": 0, "misses": 0},
]  # fmt: skip


def test_a_kvcached_sample_splits_each_models_memory_into_held_and_idle(monkeypatch):
    monkeypatch.setattr(mmc, "_kvctl_json", lambda *args: ROWS)
    monkeypatch.setattr(mmc, "kvctl_ledger", lambda *args: {"headroom_bytes": 0})
    metrics = {"num_requests_running": 21.0, "num_requests_waiting": 0.0}
    monkeypatch.setattr(mmc, "engine_metrics", lambda port: metrics)
    targets = [mmc.Target(m, m, 8000 + i, 8000 + i, 0) for i, m in enumerate(("mm-a", "mm-b"))]
    sampler = mmc.Sampler("kvcached", targets, Path("/nonexistent"), 1.0, 0)
    row = sampler.sample()
    assert row["ledger"] == {"headroom_bytes": 0}
    a, b = row["mm-a"], row["mm-b"]
    assert (a["kv_bytes"], a["reserved_bytes"], a["prefix_cache_bytes"]) == (8 * GIB, GIB // 2, GIB)
    assert (b["kv_bytes"], b["reserved_bytes"], b["prefix_cache_bytes"], b["misses"]) == (
        10 * GIB, 0, 0, 31,
    )  # fmt: skip
    assert a["running"] == 21.0
    # a kvctl row without the prefix figure (an older instance) reads as none cached
    assert mmc.kvctl_used(Path("/x"), ["old"]) == {}  # dead: left out
    monkeypatch.setattr(mmc, "_kvctl_json", lambda *args: [{**ROWS[1], "prefix_cache_bytes": None}])
    assert mmc.kvctl_used(Path("/x"), ["mm-b"])["mm-b"]["prefix_cache_bytes"] == 0
