"""Snapshots: published by a live process, read without a device, cleaned up after death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest

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
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
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
        pub.publish(
            {
                "engine": "vllm",
                "pools": [
                    {
                        "gpu": "host-0",
                        "bytes_mapped": 6 << 20,
                        "bytes_reserved": 2 << 20,
                        "blocks_used": 3,
                        "limit_bytes": 8 << 20,
                        "limit_revision": 2,
                    },
                ],
            }
        )
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


def _exit_run(script: str, name: str, tmp_path) -> list[str]:
    env = dict(
        os.environ,
        KVCACHED_IPC_NAME=name,
        KVCACHED_LEDGER_DIR=str(tmp_path),
        KVCACHED_LOG_LEVEL="WARNING",
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split()


@pytest.mark.slow
def test_a_process_that_exits_leaves_no_segment(tmp_path):
    """open_kv_cache, close_kv_cache, exit: the instance is never closed, yet its
    segment is gone (unlinked at interpreter exit)."""
    from tests.control.kvctl_helpers import unique_index

    name = unique("exit")
    (segment,) = _exit_run(
        f"""
        import torch
        from kvcached.config import get_config
        from kvcached.control.instance import close_kv_cache, current_instance, open_kv_cache
        from kvcached.driver.host import HostDriver
        from kvcached.memory.spec import KVCacheSpec
        spec = KVCacheSpec(num_layers=1, block_size=16, num_heads=2, head_dim=64,
                           dtype=torch.float16)
        driver = HostDriver(index={unique_index()}, capacity=64 << 20)
        cache = open_kv_cache(spec, engine="test", driver=driver, capacity_bytes=16 << 20,
                              max_handle_bytes=0, config=get_config())
        print("/dev/shm" + current_instance()._publisher.name, flush=True)
        close_kv_cache(cache)
    """,
        name,
        tmp_path,
    )
    assert f"/kvcached.snap.{name}." in segment
    assert not os.path.exists(segment)
    assert not [s for s in read_snapshots(cleanup=False) if s.instance == name]


def test_a_forked_childs_exit_leaves_its_parents_segment(tmp_path):
    name = unique("fork")
    segment, after_fork = _exit_run(
        f"""
        import os, sys
        from kvcached.control.snapshot import SnapshotPublisher
        pub = SnapshotPublisher({name!r})
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal interpreter exit, finalizers and all
        os.waitpid(pid, 0)
        path = "/dev/shm" + pub.name
        print(path, os.path.exists(path), flush=True)
    """,
        name,
        tmp_path,
    )
    assert after_fork == "True"  # the child did not unlink its parent's segment
    assert not os.path.exists(segment)  # the parent's own exit did
