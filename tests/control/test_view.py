"""Rows and screens built from snapshots and ledgers (no processes needed)."""

from __future__ import annotations

from kvcached.control.snapshot import Snapshot
from kvcached.control.view import (
    DEAD,
    LIVE,
    OVER,
    gpu_rows,
    instance_rows,
    render_gpus,
    render_status,
    render_table,
    render_top,
    usage_bar,
)
from kvcached.ledger.snapshot import HeaderView, InstanceView, LedgerSnapshot, PoolView

MIB = 1 << 20


def ledger(instances, pools) -> LedgerSnapshot:
    head = HeaderView(
        path="/l/kvcached-ledger-host-9",
        device_id="host-9",
        layout_version=1,
        total_bytes=1024 * MIB,
        safety_margin=51 * MIB,
        budget=973 * MIB,
        calibration_seq=5,
        calibration_time_ns=1_700_000_000 * 10**9,
        calibration_free=900 * MIB,
        created_ns=0,
        charged=sum(p.charged for p in pools),
        released=0,
    )
    return LedgerSnapshot(head, tuple(pools), tuple(instances))


def pool(slot, instance, charged, alive=True, pid=100):
    return PoolView(
        slot=slot,
        token=1,
        pid=pid + slot,
        start_time=0,
        instance=instance,
        charged=charged,
        registered_ns=0,
        released=0,
        alive=alive,
    )


def inst(slot, name, charged, limit=0, revision=0, pools=1):
    return InstanceView(
        slot=slot,
        name=name,
        limit=limit,
        revision=revision,
        pid=1,
        start_time=0,
        created_ns=0,
        limit_set_ns=0,
        charged=charged,
        pools=pools,
    )


def snap(name, pid, alive=True, **pool_fields):
    entry = {"gpu": "host-9", "backend": "host", "bytes_mapped": 0} | pool_fields
    return Snapshot(
        name,
        pid,
        alive,
        {"engine": "vllm", "started_at": 0, "pools": [entry]},
        f"/kvcached.snap.{name}.{pid}",
    )


def test_processes_of_one_instance_fold_into_one_row_and_the_ledger_is_the_truth():
    snaps = [
        snap(
            "srv",
            1,
            bytes_mapped=30 * MIB,
            bytes_reserved=4 * MIB,
            blocks_used=10,
            limit_bytes=None,
        ),
        snap("srv", 2, bytes_mapped=20 * MIB, blocks_used=5),
    ]
    led = ledger(
        [inst(0, "srv", 50 * MIB, limit=40 * MIB, revision=3, pools=2)],
        [pool(0, "srv", 30 * MIB), pool(1, "srv", 20 * MIB)],
    )
    (row,) = instance_rows(snaps, [led])
    assert (row.used_bytes, row.reserved_bytes, row.blocks_used) == (50 * MIB, 4 * MIB, 15)
    assert row.pids == [1, 2] and row.pools == 2
    assert (row.limit_bytes, row.limit_revision, row.charged_bytes) == (40 * MIB, 3, 50 * MIB)
    assert row.state == OVER  # 50 MiB held, 40 MiB allowed: releasing
    assert "over-limit" in render_table([row]) and "revision 3" in render_status([row])


def test_the_page_size_comes_from_the_mapped_bytes_and_pages():
    (row,) = instance_rows([snap("s", 1, bytes_mapped=3 * 128 * MIB, pages_mapped=3)])
    assert row.page_bytes == 128 * MIB
    (row,) = instance_rows([snap("s", 1)])  # nothing mapped: not known
    assert row.page_bytes == 0


def test_an_instance_without_a_snapshot_is_listed_from_the_ledger_and_dead_ones_are_not():
    led = ledger(
        [inst(0, "bare", 8 * MIB), inst(1, "gone", 4 * MIB)],
        [pool(0, "bare", 8 * MIB), pool(1, "gone", 4 * MIB, alive=False)],
    )
    rows = instance_rows([], [led])
    assert [(r.name, r.used_bytes, r.state) for r in rows] == [("bare", 8 * MIB, LIVE)]


def test_a_dead_process_is_shown_dead_unless_another_of_its_instance_lives():
    rows = instance_rows(
        [snap("a", 1, alive=False), snap("b", 2, alive=False), snap("b", 3, alive=True)]
    )
    assert {r.name: r.state for r in rows} == {"a": DEAD, "b": LIVE}


def test_gpu_rows_and_table():
    led = ledger([inst(0, "x", 8 * MIB)], [pool(0, "x", 8 * MIB), pool(1, "y", 0, alive=False)])
    (g,) = gpu_rows([led])
    assert (g.pools, g.dead_pools, g.instances, g.headroom_bytes) == (1, 1, ["x"], 965 * MIB)
    table = render_gpus([g])
    assert "host-9" in table and "1 (+1 dead)" in table and "#5," in table


def test_usage_bar_marks_used_reserved_and_limit():
    assert usage_bar(50, 10, None, 100, 10) == "[####+.....]"
    assert usage_bar(50, 10, 80, 100, 10) == "[####+...|.]"
    assert usage_bar(500, 0, None, 100, 4) == "[####]"  # clamped, never wider


def test_top_screen_fits_its_width_and_height():
    led = ledger(
        [inst(0, "a-long-instance-name", 300 * MIB, limit=400 * MIB)],
        [pool(0, "a-long-instance-name", 300 * MIB)],
    )
    rows = instance_rows([snap("a-long-instance-name", 1, bytes_mapped=300 * MIB)], [led])
    screen = render_top(rows, gpu_rows([led]), width=90, height=8, footer=["hello"])
    lines = screen.split("\n")
    assert len(lines) <= 8 and all(len(line) <= 90 for line in lines)
    assert any(line.startswith("a-long-instance-name") and "|" in line for line in lines)
    assert "no kvcached instance is running" in render_top([], [])
