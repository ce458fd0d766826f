"""kvctl shows the state kvcached serve publishes beside the engine's memory."""

from __future__ import annotations

from kvcached.control.metrics import prometheus
from kvcached.control.snapshot import Snapshot
from kvcached.control.view import instance_rows, render_status, render_table, render_top


def engine(name: str, pid: int, used: int) -> Snapshot:
    return Snapshot(
        name,
        pid,
        True,
        {
            "engine": "vllm",
            "started_at": 0,
            "pools": [{"gpu": "host-9", "backend": "host", "bytes_mapped": used}],
        },
        f"/kvcached.snap.{name}.{pid}",
    )


def served(name: str, state: str, pid: int = 7, alive: bool = True) -> Snapshot:
    return Snapshot(
        name,
        pid,
        alive,
        {"engine": "kvcached-serve", "pools": [], "serve": {"state": state, "engine_pid": 0}},
        f"/kvcached.snap.{name}.{pid}",
    )


def test_serve_state_joins_the_engines_rows_and_stopped_models_get_one():
    rows = instance_rows(
        [
            engine("a", 11, 0),
            served("a", "sleeping"),
            served("b", "stopped"),
            engine("c", 12, 5),
            served("c", "ready", alive=False),
        ]
    )
    by = {r.name: r for r in rows}
    assert by["a"].serve_state == "sleeping" and by["a"].gpu == "host-9"
    assert by["b"].serve_state == "stopped" and by["b"].gpu == "-" and by["b"].used_bytes == 0
    assert by["c"].serve_state == ""  # a dead router's state is not shown
    table = render_table(rows)
    assert table.splitlines()[0].split()[-1] == "SERVE"
    assert "sleeping" in table and "stopped" in table
    assert "(kvcached serve: sleeping)" in render_status([by["a"]])
    assert "live (sleeping)" in render_top(rows, [], width=200)
    text = prometheus(rows, [])
    assert 'kvcached_instance_serve_state{instance="a",gpu="host-9",state="sleeping"} 1' in text


def test_no_serve_column_without_kvcached_serve():
    assert render_table(instance_rows([engine("a", 11, 0)])).split()[6] == "STATE"
    assert "SERVE" not in render_table(instance_rows([engine("a", 11, 0)])).split()
