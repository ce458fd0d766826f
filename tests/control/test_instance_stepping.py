"""The control thread leaves a stepping engine's thread alone: while the engine
steps (``Instance.note_step``), the step looks at the limit revisions and the
control thread wakes only at its tick; idle, the thread polls them itself."""

from __future__ import annotations

import threading
import time

import pytest

from kvcached.control import instance as control
from kvcached.control.instance import Instance
from kvcached.control.limits import set_limit
from tests.control.host_pool import host_pool


@pytest.fixture
def ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    from kvcached import config

    config.reload_config()
    yield str(tmp_path)
    config.reload_config()


def _steps(instance: Instance, seconds: float, every_s: float = 0.002) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        instance.note_step()
        time.sleep(every_s)


def test_while_the_engine_steps_the_control_thread_wakes_only_at_its_tick(ledger_dir):
    instance = Instance("stepping-test", engine="test", tick_s=0.2)
    try:
        time.sleep(0.3)
        before = instance.wakeups
        time.sleep(1.0)  # idle: it polls the revisions every REVISION_POLL_S (20 ms)
        idle = instance.wakeups - before
        _steps(instance, 0.3)  # into the stepping window
        before = instance.wakeups
        _steps(instance, 1.0)
        stepping = instance.wakeups - before
    finally:
        instance.close()
    assert idle >= 0.5 / control.REVISION_POLL_S, idle
    assert stepping <= 1.0 / 0.2 + 2, stepping


def test_a_stepping_engine_acts_on_a_new_limit_within_the_poll_not_the_tick(ledger_dir):
    """With a 30 s tick the control thread would sleep through the limit; the
    step's own look wakes it, and the pool's cap releases idle pages at once."""
    stop = threading.Event()
    with host_pool(
        ledger_dir, "stepping-limit", index=30, min_reserved=0, max_reserved=8, tick_s=30.0
    ) as pool:
        cache, instance = pool.cache, pool.instance

        def engine_loop() -> None:
            while not stop.is_set():
                instance.note_step()
                time.sleep(0.002)

        loop = threading.Thread(target=engine_loop, daemon=True)
        try:
            page = cache.geometry.page_bytes
            ids = cache.alloc(256 * 6)
            assert ids is not None
            cache.free(ids[256:])  # one page in use, five idle (kept in the reserve)
            assert cache.usage().bytes_mapped >= 6 * page
            loop.start()
            time.sleep(0.1)
            start = time.monotonic()
            set_limit("stepping-limit", 2 * page, directory=ledger_dir)
            while cache.usage().bytes_mapped > 2 * page and time.monotonic() - start < 5:
                time.sleep(0.005)
            took = time.monotonic() - start
            assert cache.usage().bytes_mapped <= 2 * page
            assert took < 2.0, took
            cache.free(ids[:256])
        finally:
            stop.set()
            if loop.is_alive():
                loop.join()
