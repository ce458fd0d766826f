"""Hypothesis stateful test: the ledger against a model of its rules, one process.

The model keeps what the ledger must agree with after every step: each live
or dead pool's charge and batched refunds, the budget, each instance's limit
and revision. Deaths are simulated the way SIGKILL leaves them (the owner
lease dropped, nothing else), and a retirement interrupted halfway is
simulated with a hook that raises between its journal and its writes.
"""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvcached.errors import InstanceNotFoundError
from kvcached.ledger import REFUND_FLUSH_BYTES, Ledger, LimitStatus, _hooks
from kvcached.units import GIB, MIB

from .conftest import FakeDevice

MARGIN = GIB
INSTANCES = ("a", "b", "c")
SIZES = st.sampled_from([2 * MIB, 4 * MIB, 6 * MIB, 32 * MIB, 64 * MIB, 96 * MIB, 512 * MIB])


class _Pool:
    """The model of one pool."""

    def __init__(self, real, instance: str) -> None:
        self.real = real
        self.instance = instance
        self.charged = 0  # what its ledger record charges
        self.pending = 0  # refunds batched in the process
        self.alive = True


class LedgerMachine(RuleBasedStateMachine):
    pools = Bundle("pools")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory(prefix="kvcached-ledger-")
        self.device = FakeDevice(free=2 * GIB + MARGIN, total=10 * MIB * 1024)
        self.ledger = Ledger.open(
            "model-0", self.device, directory=self.dir.name, gpu_utilization=0.9
        )
        self.budget = 2 * GIB
        self.model: list[_Pool] = []  # registered and not retired
        self.limits: dict[str, tuple[int, int]] = {}

    def teardown(self) -> None:
        _hooks.point = None
        self.ledger.close()
        self.dir.cleanup()

    # -- model helpers ------------------------------------------------------------------
    def _sum(self, instance: str | None = None) -> int:
        return sum(p.charged for p in self.model if instance in (None, p.instance))

    def _retire(self, pool: _Pool) -> None:
        self.budget = max(0, self.budget - pool.charged)
        self.model.remove(pool)
        if not any(p.instance == pool.instance for p in self.model):
            self.limits.pop(pool.instance, None)

    def _retire_dead(self) -> None:
        for pool in [p for p in self.model if not p.alive]:
            self._retire(pool)

    def _room(self, pool: _Pool) -> int:
        room = self.budget - self._sum() + pool.pending
        limit = self.limits.get(pool.instance, (0, 0))[0]
        if limit:
            room = min(room, limit - self._sum(pool.instance) + pool.pending)
        return room

    # -- rules ------------------------------------------------------------------------------
    @precondition(lambda self: len(self.model) < 6)
    @rule(target=pools, instance=st.sampled_from(INSTANCES))
    def register(self, instance):
        self._retire_dead()
        pool = _Pool(self.ledger.register_pool(instance), instance)
        self.model.append(pool)
        self.limits.setdefault(instance, (0, 0))
        assert pool.real.headroom() == max(0, self._room(pool))
        return pool

    @rule(pool=pools, nbytes=SIZES)
    def grant(self, pool, nbytes):
        if not pool.alive or pool not in self.model:
            return
        room = self._room(pool)
        expected = nbytes <= room
        assert pool.real.grant(nbytes) is expected
        if expected and nbytes <= pool.pending:  # re-uses batched refunds: nothing written
            pool.pending -= nbytes
        else:  # goes to the ledger, folding the batch into its write
            pool.charged -= pool.pending
            pool.pending = 0
            if expected:
                pool.charged += nbytes
        if expected:
            room -= nbytes
        assert pool.real.headroom() == max(0, room)

    @rule(pool=pools)
    def fill(self, pool):
        """Grant exactly the room left, then one byte more."""
        if not pool.alive or pool not in self.model:
            return
        room = self._room(pool)
        if room > 0:
            self.grant(pool, room)
            self.grant(pool, 1)

    @rule(pool=pools, data=st.data())
    def refund(self, pool, data):
        if not pool.alive or pool not in self.model or pool.charged == pool.pending:
            return
        held = pool.charged - pool.pending
        nbytes = data.draw(
            st.integers(1, held // MIB).map(lambda k: k * MIB) if held >= MIB else st.just(held)
        )
        before = pool.real.headroom()
        pool.real.refund(nbytes)
        pool.pending += nbytes
        if pool.pending >= REFUND_FLUSH_BYTES:
            pool.charged -= pool.pending
            pool.pending = 0
        assert pool.real.headroom() == before + nbytes

    @rule(pool=pools)
    def flush(self, pool):
        if not pool.alive or pool not in self.model:
            return
        pool.real.flush()
        pool.charged -= pool.pending
        pool.pending = 0

    @rule(
        instance=st.sampled_from(INSTANCES),
        limit=st.sampled_from([None, 0, 4 * MIB, 64 * MIB, 300 * MIB, GIB, 3 * GIB]),
        bump=st.integers(-1, 2),
    )
    def set_limit(self, instance, limit, bump):
        if instance not in self.limits:
            try:
                self.ledger.set_limit(instance, limit, 1)
            except InstanceNotFoundError:
                return
            raise AssertionError(f"set_limit({instance!r}) found an instance with no pool")
        stored_limit, stored_rev = self.limits[instance]
        revision = stored_rev + bump
        if revision < 1:
            return
        value = limit or 0
        if revision > stored_rev:
            expected = LimitStatus.APPLIED
            self.limits[instance] = (value, revision)
        elif revision < stored_rev:
            expected = LimitStatus.STALE
        else:
            expected = LimitStatus.APPLIED if value == stored_limit else LimitStatus.CONFLICT
        assert self.ledger.set_limit(instance, limit, revision) is expected

    @rule(pool=consumes(pools))
    def close(self, pool):
        if pool not in self.model or not pool.alive:
            return
        pool.real.close()
        pool.charged -= pool.pending
        pool.pending = 0
        self._retire(pool)

    @rule(pool=consumes(pools), point=st.sampled_from(["retire-journaled", "retire-applying"]))
    def close_interrupted(self, pool, point):
        """A retirement stopped between its journal and its writes is finished
        by the next holder of the data lock, exactly once."""
        if pool not in self.model or not pool.alive:
            return

        def stop(name: str) -> None:
            if name == point:
                _hooks.point = None
                raise KeyboardInterrupt(point)

        _hooks.point = stop
        try:
            pool.real.close()
            raise AssertionError("the hook did not fire")
        except KeyboardInterrupt:
            pass
        finally:
            _hooks.point = None
        pool.charged -= pool.pending
        pool.pending = 0
        self._retire(pool)

    @rule(pool=pools)
    def die(self, pool):
        if pool not in self.model or not pool.alive:
            return
        pool.real._abandon()  # batched refunds die with the process; its record stays
        pool.alive = False

    @rule()
    def retire_dead(self):
        dead = sum(1 for p in self.model if not p.alive)
        assert self.ledger.retire_dead() == dead
        self._retire_dead()

    @rule(free=st.sampled_from([0, MARGIN // 2, MARGIN, MARGIN + 100 * MIB, MARGIN + 3 * GIB]))
    def calibrate(self, free):
        self.device.free = free
        result = self.ledger.calibrate()
        assert result.published
        self._retire_dead()
        released = sum(p.pending for p in self.model)
        self.budget = max(0, self._sum() - released + free - MARGIN)
        assert result.budget == self.budget
        for pool in self.model:
            if pool.alive:
                assert pool.real.headroom() == max(0, self._room(pool))

    # -- what must always hold ----------------------------------------------------------------
    @invariant()
    def matches_the_model(self):
        snap = self.ledger.snapshot()
        assert snap.header.budget == self.budget
        assert snap.header.charged == self._sum()
        got = sorted((p.token, p.charged, p.released, p.alive) for p in snap.pools)
        want = sorted((p.real.token, p.charged, p.pending, p.alive) for p in self.model)
        assert got == want
        for pool in self.model:
            if pool.alive:
                assert pool.real.charged == pool.charged
                assert pool.real.pending_refund == pool.pending
        names = {i.name: (i.limit, i.revision) for i in snap.instances}
        assert names == self.limits


TestLedgerModel = pytest.mark.slow(LedgerMachine.TestCase)
TestLedgerModel.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
