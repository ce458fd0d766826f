"""Snapshots: published by a live process, read without a device, cleaned up after death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

from kvcached.control.metrics import prometheus
from kvcached.control.snapshot import SnapshotPublisher, read_snapshots
from kvcached.control.view import InstanceRow, instance_rows, render_table


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_publish_and_read_back():
    name = unique("t")
    with SnapshotPublisher(name) as pub:
        pub.publish({"pools": [{"gpu": "host-0", "bytes_mapped": 4 << 20}], "engine": "test"})
        mine = [s for s in read_snapshots() if s.instance == name]
        assert len(mine) == 1 and mine[0].alive and mine[0].pid == os.getpid()
        assert mine[0].data["pools"][0]["bytes_mapped"] == 4 << 20
        pub.publish({"pools": [], "engine": "test", "n": 2})
        assert [s.data.get("n") for s in read_snapshots() if s.instance == name] == [2]
    assert not [s for s in read_snapshots() if s.instance == name]


def test_killed_publisher_is_seen_dead_and_cleaned_up():
    name = unique("k")
    script = textwrap.dedent(f"""
        import sys
        from kvcached.control.snapshot import SnapshotPublisher
        p = SnapshotPublisher({name!r})
        p.publish({{"pools": [{{"gpu": "host-0", "bytes_mapped": 1}}]}})
        print("up", flush=True)
        sys.stdin.readline()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "up"
    assert [s.alive for s in read_snapshots() if s.instance == name] == [True]
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    seen = [s for s in read_snapshots(cleanup=False) if s.instance == name]
    assert [s.alive for s in seen] == [False]
    read_snapshots()  # cleans up
    assert not [s for s in read_snapshots(cleanup=False) if s.instance == name]


def test_rows_table_and_metrics():
    name = unique("m")
    with SnapshotPublisher(name) as pub:
        pub.publish({"engine": "vllm", "pools": [
            {"gpu": "host-0", "bytes_mapped": 6 << 20, "bytes_reserved": 2 << 20,
             "blocks_used": 3, "limit_bytes": 8 << 20, "limit_revision": 2},
        ]})
        rows = [r for r in instance_rows(read_snapshots()) if r.name == name]
    assert len(rows) == 1
    row = rows[0]
    assert (row.used_bytes, row.reserved_bytes, row.limit_bytes) == (6 << 20, 2 << 20, 8 << 20)
    table = render_table(rows)
    assert name in table and "6.00 MiB" in table and "8.00 MiB" in table and "live" in table
    text = prometheus([row], [])
    assert f'kvcached_instance_used_bytes{{instance="{name}",gpu="host-0"}} {6 << 20}' in text
    assert "# TYPE kvcached_instance_misses_total counter" in text


def test_prometheus_escapes_labels():
    row = InstanceRow(name='a"b', gpu="g\\1")
    assert 'instance="a\\"b",gpu="g\\\\1"' in prometheus([row], [])
