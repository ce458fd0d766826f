"""The ledger's rules, one process: grants, refunds, limits, dead owners, calibration."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from kvcached.errors import InstanceNotFoundError, LedgerError
from kvcached.ledger import (
    REFUND_FLUSH_BYTES,
    Calibrator,
    Ledger,
    LimitStatus,
    PoolBudget,
    _hooks,
    layout,
)
from kvcached.ledger import ledger as ledger_module
from kvcached.ledger import pool as pool_module
from kvcached.ledger.locks import ByteLock
from kvcached.memory.budget import PhysicalBudget
from kvcached.units import GIB, MIB

from .conftest import FakeDevice, data_lock_is_free

BUDGET = 7 * GIB  # 8 GiB free - 1 GiB margin (10% of 10 GiB)


def test_new_file_starts_from_the_sample(ledger, device):
    snap = ledger.snapshot()
    assert snap.header.budget == BUDGET
    assert snap.header.safety_margin == GIB
    assert snap.header.total_bytes == 10 * GIB
    assert snap.header.charged == 0
    assert snap.header.layout_version == layout.LAYOUT_VERSION
    assert snap.header.device_id == "fake-0"
    assert snap.pools == () and snap.instances == ()
    assert os.path.basename(ledger.path) == "kvcached-ledger-fake-0"


def test_file_is_created_with_the_umask(ledger_dir, device):
    old = os.umask(0o007)
    try:
        led = Ledger.open("umask-0", device, directory=ledger_dir)
    finally:
        os.umask(old)
    try:
        assert os.stat(led.path).st_mode & 0o777 == 0o660
        assert [n for n in os.listdir(ledger_dir) if n.endswith(".tmp")] == []
    finally:
        led.close()


def test_a_second_open_shares_the_same_file(ledger, ledger_dir):
    other = Ledger.open("fake-0", FakeDevice(free=GIB), directory=ledger_dir)
    try:
        pool = ledger.register_pool("a")
        assert pool.grant(10 * MIB)
        assert other.snapshot().header.charged == 10 * MIB
        assert other.budget == BUDGET  # not re-created from the second sample
        pool.close()
    finally:
        other.close()


def test_pool_satisfies_the_physical_budget_protocol(ledger):
    with ledger.register_pool("a") as pool:
        assert isinstance(pool, PhysicalBudget)
        assert isinstance(pool, PoolBudget)


def test_grants_stop_exactly_at_the_budget(ledger):
    a, b = ledger.register_pool("a"), ledger.register_pool("b")
    assert a.headroom() == BUDGET
    assert a.grant(BUDGET - 4 * MIB)
    assert not b.grant(6 * MIB)  # would pass the budget: denied, nothing charged
    assert b.charged == 0
    assert b.grant(4 * MIB)
    assert not a.grant(1)
    assert ledger.snapshot().header.charged == BUDGET
    assert a.headroom() == 0
    a.refund(BUDGET - 4 * MIB)
    a.flush()
    assert b.grant(64 * MIB)


def test_small_refunds_are_batched_and_flushed_at_64_mib(ledger):
    pool = ledger.register_pool("a")
    assert pool.grant(128 * MIB)
    for i in range(31):
        pool.refund(2 * MIB)
        assert pool.pending_refund == 2 * MIB * (i + 1)
        assert ledger.snapshot().header.charged == 128 * MIB  # not written yet
    assert pool.headroom() == BUDGET - 128 * MIB + 62 * MIB  # a grant would fold them in
    pool.refund(2 * MIB)  # the batch reaches 64 MiB: flushed
    assert pool.pending_refund == 0
    assert ledger.snapshot().header.charged == 64 * MIB


def test_a_big_handle_refunds_at_once(ledger):
    pool = ledger.register_pool("a")
    assert pool.grant(REFUND_FLUSH_BYTES + 2 * MIB)
    pool.refund(REFUND_FLUSH_BYTES)
    assert pool.pending_refund == 0
    assert ledger.snapshot().header.charged == 2 * MIB


def _break_data_lock(m: pytest.MonkeyPatch) -> None:
    """Every flock of the data lock raises, the pool's inline grant path included."""
    m.setattr(ledger_module, "_flock", _broken_flock)
    m.setattr(pool_module, "_flock", _broken_flock)


def test_a_grant_within_the_batch_re_uses_it_without_the_lock(ledger, monkeypatch):
    pool = ledger.register_pool("a")
    assert pool.grant(BUDGET)
    pool.refund(8 * MIB)
    with monkeypatch.context() as m:
        _break_data_lock(m)  # any use of the data lock raises
        assert pool.grant(6 * MIB)  # fits only thanks to the batch, and takes from it
        assert (pool.pending_refund, pool.charged) == (2 * MIB, BUDGET)
        assert pool.headroom() == 2 * MIB
    assert ledger.snapshot().header.charged == BUDGET  # the record never moved
    ledger.set_limit("a", BUDGET - 4 * MIB, 1)  # now over its limit: no re-use either
    assert not pool.grant(2 * MIB)
    assert pool.pending_refund == 0 and pool.charged == BUDGET - 2 * MIB  # folded, denied


def test_a_grant_beyond_the_batch_folds_it_into_its_write(ledger):
    pool = ledger.register_pool("a")
    assert pool.grant(BUDGET - 2 * MIB)
    pool.refund(4 * MIB)
    assert pool.grant(6 * MIB)  # 4 MiB from the batch, 2 MiB new: one write
    assert pool.pending_refund == 0
    assert pool.charged == BUDGET
    assert ledger.snapshot().header.charged == BUDGET


def test_refund_and_grant_reject_bad_sizes(ledger):
    pool = ledger.register_pool("a")
    assert pool.grant(4 * MIB)
    with pytest.raises(ValueError, match="holds only"):
        pool.refund(6 * MIB)
    pool.refund(4 * MIB)
    with pytest.raises(ValueError, match="holds only"):
        pool.refund(2 * MIB)  # a double refund
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="nbytes"):
            pool.grant(bad)
        with pytest.raises(ValueError, match="nbytes"):
            pool.refund(bad)
    assert pool.grant(0) is True
    assert (pool.charged, pool.pending_refund) == (4 * MIB, 4 * MIB)  # batched, not lost


def _broken_flock(fd, op):
    """Stands in for the data lock's flock: fails like a kernel out of locks."""
    raise OSError(errno.ENOLCK, "No locks available")


def test_a_ledger_that_replaces_the_data_lock_is_called_through(ledger_dir, device):
    """The pool's grant takes the data lock inline only where it is the ledger's
    own flock: a subclass's lock (the benchmark's baseline) is never bypassed."""
    calls = []

    class Counted(Ledger):
        def lock_fd(self, fd: int, timeout: float | None = None) -> None:
            calls.append("lock")
            super().lock_fd(fd, timeout)

        def unlock_fd(self, fd: int) -> None:
            calls.append("unlock")
            super().unlock_fd(fd)

    with Counted.open("fake-0", device, directory=ledger_dir, gpu_utilization=0.9) as led:
        pool = led.register_pool("a")
        calls.clear()
        assert pool.grant(2 * MIB)
        assert calls == ["lock", "unlock"]
        pool.close()


def test_the_inline_grant_runs_what_follows_the_lock(ledger, monkeypatch):
    """A grant that takes the lock inline still runs the lock's hooks (and journal check)."""
    pool = ledger.register_pool("a")
    seen = []
    monkeypatch.setattr(ledger_module._hooks, "point", seen.append)
    assert pool.grant(2 * MIB)
    assert seen[:2] == ["data-locked", "grant-decided"] and seen[-1] == "data-unlocking"


def test_a_failed_flush_keeps_its_backlog(ledger, monkeypatch):
    pool = ledger.register_pool("a")
    assert pool.grant(256 * MIB)
    with monkeypatch.context() as m:
        _break_data_lock(m)
        pool.refund(64 * MIB)  # logged, not raised: the release already happened
        assert pool.pending_refund == 64 * MIB
        with pytest.raises(OSError):
            pool.flush()
        assert pool.pending_refund == 64 * MIB
        with pytest.raises(OSError):
            pool.grant(128 * MIB)  # needs the ledger
        assert pool.pending_refund == 64 * MIB
        assert pool.grant(2 * MIB)  # served from the kept batch, no lock needed
        assert pool.pending_refund == 62 * MIB
    pool.flush()
    assert pool.pending_refund == 0
    assert ledger.snapshot().header.charged == 194 * MIB


def test_limits_apply_to_the_sum_of_an_instance_s_pools(ledger):
    a1, a2, b = (ledger.register_pool(n) for n in ("a", "a", "b"))
    assert ledger.set_limit("a", 100 * MIB, 1) is LimitStatus.APPLIED
    assert a1.grant(60 * MIB)
    assert not a2.grant(50 * MIB)
    assert a2.grant(40 * MIB)
    assert not a1.grant(1)
    assert b.grant(500 * MIB)  # another instance is not bound by it
    assert a1.limit == 100 * MIB and a1.limit_revision == 1
    assert a1.instance_charged() == 100 * MIB
    a1.refund(10 * MIB)  # batched; a grant folds it in and fits
    assert a1.grant(10 * MIB)
    # lowering below usage blocks growth but takes nothing back
    assert ledger.set_limit("a", 50 * MIB, 2) is LimitStatus.APPLIED
    assert not a1.grant(2 * MIB)
    assert ledger.snapshot().instance("a").charged == 100 * MIB
    assert ledger.set_limit("a", None, 3) is LimitStatus.APPLIED
    assert a1.grant(2 * MIB)


def test_limit_revisions(ledger):
    pool = ledger.register_pool("a")  # kept: a dropped pool reads as dead
    assert ledger.set_limit("a", 10 * MIB, 5) is LimitStatus.APPLIED
    assert ledger.set_limit("a", 10 * MIB, 5) is LimitStatus.APPLIED  # a retry
    assert ledger.set_limit("a", 20 * MIB, 5) is LimitStatus.CONFLICT
    assert ledger.set_limit("a", 30 * MIB, 4) is LimitStatus.STALE
    inst = ledger.snapshot().instance("a")
    assert (inst.limit, inst.revision) == (10 * MIB, 5)
    assert LimitStatus.STALE == "stale" and LimitStatus.DEFERRED.value == "deferred"
    with pytest.raises(InstanceNotFoundError, match="'zzz'.*instances there: \\['a'\\]"):
        ledger.set_limit("zzz", 1, 1)
    for bad in ((-1, 6), (1, 0), (1.5, 6)):
        with pytest.raises(ValueError):
            ledger.set_limit("a", *bad)
    with pytest.raises(ValueError, match="instance name"):
        ledger.set_limit("x" * 49, 1, 1)
    with pytest.raises(ValueError, match="instance name"):
        ledger.register_pool("bad name")
    pool.close()


def test_instance_record_lives_while_a_pool_refers_to_it(ledger):
    a1, a2 = ledger.register_pool("a"), ledger.register_pool("a")
    ledger.set_limit("a", 10 * MIB, 1)
    a1.close()
    assert ledger.snapshot().instance("a").limit == 10 * MIB
    a2.close()
    assert ledger.snapshot().instance("a") is None
    with pytest.raises(InstanceNotFoundError):
        ledger.set_limit("a", 1, 2)


def test_a_dead_owner_is_retired_without_creating_credit(ledger):
    a, b = ledger.register_pool("a"), ledger.register_pool("b")
    assert a.grant(BUDGET - 100 * MIB)
    assert b.grant(50 * MIB)
    a._abandon()  # what SIGKILL leaves: the record, and a free owner lease
    snap = ledger.snapshot()
    assert [p.alive for p in snap.pools] == [False, True]
    b.refresh()
    before = b.headroom()
    assert before == 50 * MIB
    assert ledger.retire_dead() == 1
    snap = ledger.snapshot()
    assert snap.header.charged == 50 * MIB
    assert snap.header.budget == 100 * MIB  # the dead charge left the budget too
    b.refresh()
    assert b.headroom() == before  # no spendable credit appeared
    assert not b.grant(before + 2 * MIB)
    assert ledger.retire_dead() == 0


def test_registration_retires_dead_owners(ledger):
    a = ledger.register_pool("a")
    assert a.grant(GIB)
    a._abandon()
    b = ledger.register_pool("b")
    assert b.slot == 0  # the dead record was retired and its slot reused
    snap = ledger.snapshot()
    assert snap.header.budget == BUDGET - GIB
    assert [p.instance for p in snap.pools] == ["b"]
    assert snap.instance("a") is None


def test_a_live_pool_of_another_descriptor_is_never_retired(ledger, ledger_dir):
    other = Ledger.open("fake-0", FakeDevice(), directory=ledger_dir)
    try:
        pool = other.register_pool("a")
        assert pool.grant(GIB)
        assert ledger.retire_dead() == 0
        assert ledger.calibrate().retired == 0
        assert ledger.snapshot().pools[0].alive
        pool.close()
    finally:
        other.close()


def test_calibration_publishes_charges_plus_free_minus_margin(ledger, device):
    pool = ledger.register_pool("a")
    assert pool.grant(3 * GIB)
    device.free = 2 * GIB
    result = ledger.calibrate()
    assert result.published and result.reason == "published"
    assert result.budget == 3 * GIB + 2 * GIB - GIB
    assert ledger.budget == 4 * GIB
    assert pool.headroom() == GIB  # refreshed by the calibration
    assert ledger.snapshot().header.calibration_free == 2 * GIB
    device.free = GIB // 2  # less free than the margin: negative headroom ...
    result = ledger.calibrate()
    assert result.budget == 3 * GIB - GIB // 2
    assert not pool.grant(2 * MIB)
    assert pool.headroom() == 0
    pool.refund(3 * GIB)
    pool.flush()
    device.free = 0
    assert ledger.calibrate().budget == 0  # ... clamped at 0


def test_calibration_counts_released_but_unrefunded_memory_once(ledger, device):
    a, b = ledger.register_pool("a"), ledger.register_pool("b")
    assert a.grant(3 * GIB)
    a.refund(40 * MIB)  # released, refund batched in the process
    snap = ledger.snapshot()
    assert [p.released for p in snap.pools] == [40 * MIB, 0]
    assert snap.header.charged == 3 * GIB and snap.header.released == 40 * MIB
    # The driver already sees those 40 MiB as free: the budget must not offer them
    # to b while a can re-use them without asking.
    device.free = 2 * GIB
    assert ledger.calibrate().budget == 3 * GIB - 40 * MIB + 2 * GIB - GIB
    b.refresh()
    assert b.headroom() == GIB - 40 * MIB
    assert a.headroom() == GIB  # a's own batch is its own to re-use
    assert a.grant(40 * MIB)  # re-used: nothing written but the released word
    assert ledger.snapshot().pools[0].released == 0
    a.refund(8 * MIB)
    a.flush()
    snap = ledger.snapshot()
    assert (snap.pools[0].charged, snap.pools[0].released) == (3 * GIB - 8 * MIB, 0)


def test_calibration_sequence_rejects_an_older_sample(ledger):
    seq = ledger.calibration_seq
    assert ledger._publish(seq, 5 * GIB).published
    old = ledger._publish(seq, 100 * GIB)  # sampled before the publication above
    assert not old.published and old.reason == "stale"
    assert ledger.budget == 4 * GIB
    assert ledger.calibration_seq == seq + 1


def test_only_one_calibrator_at_a_time(ledger, ledger_dir):
    other_fd = os.open(ledger.path, os.O_RDWR)
    try:
        lease = ByteLock(other_fd, layout.CALIBRATOR_LEASE_BYTE, "test")
        assert lease.acquire(wait=False)
        result = ledger.calibrate()
        assert not result.published and result.reason == "busy"
        lease.release()
        assert ledger.calibrate().published
    finally:
        os.close(other_fd)


def test_no_driver_call_under_the_data_lock(ledger):
    probe_fd = os.open(ledger.path, os.O_RDWR)
    seen = []

    class Sampler:
        def mem_info(self):
            seen.append(data_lock_is_free(probe_fd))
            return 4 * GIB, 10 * GIB

    try:
        ledger.register_pool("a")
        ledger.calibrate(Sampler())
        cal = Calibrator(ledger, Sampler(), interval_s=0.01).start()
        time.sleep(0.1)
        cal.stop()
        assert len(seen) >= 3 and all(seen)
        assert not cal.running and cal.published >= 2
    finally:
        os.close(probe_fd)


def test_calibrator_thread_refreshes_headroom(ledger, ledger_dir, device):
    pool = ledger.register_pool("a")
    other = Ledger.open("fake-0", FakeDevice(), directory=ledger_dir)
    try:
        other_pool = other.register_pool("b")
        assert other_pool.grant(GIB)
        assert pool.headroom() == BUDGET  # stale: another process granted since
        device.free = 6 * GIB
        with Calibrator(ledger, device, interval_s=0.02) as cal:
            deadline = time.monotonic() + 5
            while pool.headroom() == BUDGET and time.monotonic() < deadline:
                time.sleep(0.01)
        assert cal.ticks >= 1 and cal.published >= 1
        assert pool.headroom() == 5 * GIB  # budget 1 + 6 - 1 GiB, 1 GiB charged
        device.free = 4 * GIB
        cal.tick()
        assert pool.headroom() == 3 * GIB
    finally:
        other.close()


def test_headroom_is_cheap(ledger):
    pool = ledger.register_pool("a")
    assert pool.grant(2 * MIB)
    n = 200_000
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            pool.headroom()
        best = min(best, (time.perf_counter() - t) / n)
    assert best < 1e-6, f"headroom() took {best * 1e9:.0f} ns"


def test_snapshot_describes_pools_and_instances(ledger):
    a = ledger.register_pool("inst-a")
    b = ledger.register_pool("inst-b")
    assert a.grant(10 * MIB) and b.grant(20 * MIB)
    ledger.set_limit("inst-b", GIB, 1)
    snap = ledger.snapshot()
    assert [(p.slot, p.instance, p.charged, p.pid, p.alive) for p in snap.pools] == [
        (0, "inst-a", 10 * MIB, os.getpid(), True),
        (1, "inst-b", 20 * MIB, os.getpid(), True),
    ]
    assert all(p.start_time > 0 and p.token and p.registered_ns for p in snap.pools)
    inst = snap.instance("inst-b")
    assert (inst.limit, inst.revision, inst.charged, inst.pools, inst.pid) == (
        GIB,
        1,
        20 * MIB,
        1,
        os.getpid(),
    )
    assert snap.header.charged == 30 * MIB
    assert snap.header.headroom == BUDGET - 30 * MIB


def test_close_is_idempotent_and_gives_the_record_back(ledger):
    pool = ledger.register_pool("a")
    assert pool.grant(4 * MIB)
    pool.refund(2 * MIB)  # batched: close flushes it before retiring
    pool.close()
    pool.close()
    assert pool.closed
    snap = ledger.snapshot()
    assert snap.pools == () and snap.header.charged == 0
    assert snap.header.budget == BUDGET - 2 * MIB  # the unrefunded 2 MiB left with it
    with pytest.raises(LedgerError, match="closed"):
        pool.grant(2 * MIB)
    with pytest.raises(LedgerError, match="closed"):
        pool.refund(2 * MIB)


def test_a_dropped_pool_reads_as_dead_and_is_retired(ledger):
    pool = ledger.register_pool("a")
    assert pool.grant(4 * MIB)
    del pool
    import gc

    gc.collect()
    assert [p.alive for p in ledger.snapshot().pools] == [False]  # its lease was dropped
    assert ledger.retire_dead() == 1
    assert ledger.snapshot().pools == ()
    assert ledger.budget == BUDGET - 4 * MIB


def test_threads_of_one_process_keep_exact_sums(ledger):
    pools = [ledger.register_pool("a"), ledger.register_pool("b")]
    held = [[0] * 4 for _ in pools]

    def work(p: int, t: int) -> None:
        pool = pools[p]
        for i in range(400):
            if i % 3 != 2 and pool.grant(2 * MIB):
                held[p][t] += 2 * MIB
            elif held[p][t]:
                pool.refund(2 * MIB)
                held[p][t] -= 2 * MIB

    threads = [threading.Thread(target=work, args=(p, t)) for p in range(2) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for pool in pools:
        pool.flush()
    snap = ledger.snapshot()
    assert [p.charged for p in snap.pools] == [sum(h) for h in held]


def test_pools_of_one_process_exclude_each_other_through_their_own_descriptors(ledger):
    """Each pool takes the data lock through its own descriptor (no thread lock
    between pools): flock must still exclude them, or two threads could both see
    the room of the instance's limit and both take it."""
    pools = [ledger.register_pool("a"), ledger.register_pool("a")]
    assert ledger.set_limit("a", 64 * MIB, 1) is LimitStatus.APPLIED
    _hooks.point = lambda name: time.sleep(0.0005) if name == "grant-decided" else None
    granted = [0] * 4

    def work(t: int) -> None:
        pool = pools[t % 2]
        while pool.grant(2 * MIB):
            granted[t] += 2 * MIB

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    _hooks.point = None
    assert sum(granted) == 64 * MIB == ledger.snapshot().instance("a").charged


def test_a_forked_child_drops_its_copies_without_touching_the_parent_s_pools(ledger):
    pool = ledger.register_pool("a")
    assert pool.grant(8 * MIB)
    pid = os.fork()
    if pid == 0:  # child: the inherited pool is unusable and its exit retires nothing
        code = 0
        try:
            pool.grant(2 * MIB)
            code = 3
        except LedgerError:
            pass
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    snap = ledger.snapshot()
    assert [(p.charged, p.alive) for p in snap.pools] == [(8 * MIB, True)]
    assert ledger.retire_dead() == 0
    assert pool.grant(2 * MIB)


def test_a_retirement_interrupted_halfway_is_finished_by_the_next_lock_holder(ledger):
    a, b = ledger.register_pool("a"), ledger.register_pool("b")
    assert a.grant(GIB) and b.grant(GIB)
    for point in ("retire-journaled", "retire-applying"):
        victim = a if point == "retire-journaled" else b

        def die(name: str, point=point) -> None:
            if name == point:
                _hooks.point = None
                raise KeyboardInterrupt(point)

        _hooks.point = die
        with pytest.raises(KeyboardInterrupt):
            victim.close()
        assert ledger.u32[ledger_header_word("retire_slot")] == victim.slot + 1  # journal left
        snap = ledger.snapshot()  # the next data-lock holder finishes it
        assert ledger.u32[ledger_header_word("retire_slot")] == 0
        assert victim.slot not in [p.slot for p in snap.pools]
    snap = ledger.snapshot()
    assert snap.pools == () and snap.instances == ()
    assert snap.header.budget == BUDGET - 2 * GIB  # each charge left the budget exactly once


def ledger_header_word(field: str) -> int:
    return getattr(layout.Header, field).offset // 4


def test_ofd_lock_errors_are_sorted(monkeypatch, ledger):
    import fcntl

    lock = ByteLock(ledger.file.fd, 7, "test lock")

    def fail(code):
        def fcntl_(*a):
            raise OSError(code, os.strerror(code))

        return fcntl_

    monkeypatch.setattr(fcntl, "fcntl", fail(errno.EAGAIN))
    assert lock.acquire(wait=False) is False
    monkeypatch.setattr(fcntl, "fcntl", fail(errno.EINVAL))
    with pytest.raises(LedgerError, match="OFD byte-range locks.*KVCACHED_LEDGER_DIR"):
        lock.acquire()
    with pytest.raises(LedgerError, match="OFD"):
        lock.held_elsewhere()
    monkeypatch.setattr(fcntl, "fcntl", fail(errno.EIO))
    with pytest.raises(OSError) as info:
        lock.acquire()
    assert info.value.errno == errno.EIO and not isinstance(info.value, LedgerError)


def test_open_pool_budget_on_the_host_backend(ledger_dir):
    """The factory the memory layer calls, on a real backend: grant, create, map,
    release, refund; the process' calibrator runs while its pools are open."""
    from kvcached.driver.host import HostDriver
    from kvcached.ledger import open_ledger, open_pool_budget

    driver = HostDriver(0, capacity=256 * MIB)
    pool = open_pool_budget(driver, "host-test", directory=ledger_dir)
    other = open_pool_budget(driver, "host-test", directory=ledger_dir)
    ledger = open_ledger(driver, directory=ledger_dir)
    try:
        assert isinstance(pool, PhysicalBudget)
        assert os.path.basename(ledger.path) == "kvcached-ledger-host-0"
        assert ledger._calibrator is not None and ledger._calibrator.running
        va = driver.reserve(64 * MIB)
        assert pool.grant(2 * MIB)
        handle = driver.create(2 * MIB)
        driver.map(va, 2 * MIB, handle)
        driver.set_access(va, 2 * MIB)
        driver.unmap(va, 2 * MIB)
        driver.release(handle)
        pool.refund(2 * MIB)
        driver.free_reservation(va, 64 * MIB)
        snap = ledger.snapshot()
        assert [(p.instance, p.charged, p.released) for p in snap.pools] == [
            ("host-test", 2 * MIB, 2 * MIB),
            ("host-test", 0, 0),
        ]
        util = __import__("kvcached.config").config.get_config().gpu_utilization
        assert snap.header.safety_margin == round(256 * MIB * (1 - util))
        pool.close()
        assert ledger._calibrator is not None  # still used by `other`
        other.close()
        assert ledger._calibrator is None
        assert ledger.snapshot().pools == ()
    finally:
        ledger.close()


def test_full_tables_are_a_clear_error_and_leak_nothing(ledger):
    from kvcached.errors import LedgerFullError

    fds_before = len(os.listdir("/proc/self/fd"))
    names = [ledger.register_pool(f"i{k}") for k in range(layout.INSTANCE_SLOTS)]
    with pytest.raises(LedgerFullError, match="instance records"):
        ledger.register_pool("one-too-many")
    same = [ledger.register_pool("i0") for _ in range(layout.POOL_SLOTS - len(names))]
    with pytest.raises(LedgerFullError, match="pool records"):
        ledger.register_pool("i0")
    assert len(os.listdir("/proc/self/fd")) == fds_before + layout.POOL_SLOTS
    for pool in names + same:
        pool.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert ledger.register_pool("one-too-many").slot == 0
