"""The grant's written-out paths against the code they copy, on the same inputs.

:meth:`PoolBudget.grant` keeps two copies for speed (see its comments):

* the lock-free re-use of batched refunds writes out :meth:`Ledger.room`, the
  admission test that the locked grant and :meth:`PoolBudget.refresh` call;
* the locked grant takes the data lock with a bare ``flock`` (and releases
  it) instead of calling :meth:`Ledger.lock_fd` / :meth:`Ledger.unlock_fd`.

Each is run here beside its reference, and results and side effects (the
pool's figures, the ledger's words, the test hooks passed) must agree.
"""

from __future__ import annotations

import tempfile

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvcached.ledger import Ledger, _hooks
from kvcached.ledger.layout import (
    H_BUDGET,
    H_PUB_BUDGET,
    H_PUB_FREE,
    H_PUB_PENDING,
    H_PUB_SEQ,
    H_PUB_TIME,
    H_SEQ,
    H_WINDOW,
    H_WINDOW_GRANTED,
)
from kvcached.units import MIB

from .conftest import FakeDevice

SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
MIBS = st.integers(min_value=0, max_value=256)


def _open(directory: str) -> Ledger:
    return Ledger.open("paths-0", FakeDevice(), directory=directory, gpu_utilization=0.9)


def _set_budget(led: Ledger, nbytes: int) -> None:
    with led.locked():
        led.i64[H_BUDGET] = nbytes


def _words(led: Ledger, pool) -> tuple[int, int, int, int]:
    """What the file says of ``pool`` and the header words a grant may move."""
    return (
        led.charges[pool.slot],
        led.released[pool.slot],
        led.i64[H_BUDGET],
        led.i64[H_WINDOW_GRANTED],
    )


@SETTINGS
# The cases each copy must get right, beside hypothesis' own: a batch re-used;
# re-use refused by the instance's limit (the sibling's charge counts), then by
# the budget; an open calibration window, which no re-use may bypass.
@example(budget=512, other=0, sibling=0, granted=8, refunded=8, limit=0, ask=4, window=False)
@example(budget=512, other=0, sibling=60, granted=64, refunded=8, limit=120, ask=8, window=False)
@example(budget=100, other=40, sibling=0, granted=64, refunded=8, limit=0, ask=8, window=False)
@example(budget=512, other=0, sibling=0, granted=8, refunded=8, limit=0, ask=4, window=True)
@given(
    budget=st.integers(min_value=0, max_value=640),
    other=MIBS,
    sibling=st.integers(min_value=0, max_value=128),
    granted=st.integers(min_value=1, max_value=256),
    refunded=st.integers(min_value=0, max_value=63),
    limit=st.one_of(st.just(0), st.integers(min_value=1, max_value=640)),
    ask=st.integers(min_value=1, max_value=72),
    window=st.booleans(),
)
def test_the_lock_free_re_use_decides_as_ledger_room(
    budget, other, sibling, granted, refunded, limit, ask, window
):
    refunded = min(refunded, granted)
    with tempfile.TemporaryDirectory(prefix="kvcached-paths-") as d:
        led = _open(d)
        try:
            # Charges: another instance, a sibling pool of this instance, this pool
            # (each held alive: a pool dropped is a dead owner, retired).
            held = [led.register_pool(name) for name in ("b", "a")]
            for p, size in zip(held, (other, sibling), strict=True):
                assert p.grant(size * MIB)
            pool = led.register_pool("a")
            assert pool.grant(granted * MIB)
            if refunded:
                pool.refund(refunded * MIB)  # batched: below 64 MiB
            if limit:
                led.set_limit("a", limit * MIB, 1)
            _set_budget(led, budget * MIB)
            if window:
                with led.locked():
                    led.u32[H_WINDOW] = 1
            with led.locked():
                room = led.room(pool.instance_slot)  # the reference, on the same state
                assert led.charged_total() == (other + sibling + granted) * MIB
            mine = sibling + granted  # the instance's charges
            rule = budget - other - mine if not limit else min(budget - other - mine, limit - mine)
            assert room == rule * MIB  # the reference itself, from the test's own figures
            charged, pending, nbytes = pool.charged, pool.pending_refund, ask * MIB
            assert (charged, pending) == (granted * MIB, refunded * MIB)
            window_before = led.i64[H_WINDOW_GRANTED]
            seen: list[str] = []
            _hooks.point = seen.append
            try:
                got = pool.grant(nbytes)
            finally:
                _hooks.point = None
            want = nbytes <= room + pending
            assert got is want
            if nbytes <= pending and not window and want:  # re-used: no lock, no charge moves
                assert seen == []
                assert (pool.charged, pool.pending_refund) == (charged, pending - nbytes)
                assert _words(led, pool) == (charged, pending - nbytes, budget * MIB, 0)
                assert pool.headroom() == max(0, room + pending - nbytes)
            else:  # decided under the lock, the batch folded into its write
                assert "grant-decided" in seen
                now = charged - pending + (nbytes if want else 0)
                grown = nbytes if want and window else 0
                assert (pool.charged, pool.pending_refund) == (now, 0)
                assert _words(led, pool) == (now, 0, budget * MIB, window_before + grown)
                assert pool.headroom() == max(0, room + pending - (nbytes if want else 0))
        finally:
            led.close()


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("grant"), st.integers(min_value=0, max_value=96)),
        st.tuples(st.just("refund"), st.integers(min_value=0, max_value=96)),
        st.tuples(st.just("flush"), st.just(0)),
        st.tuples(st.just("limit"), st.integers(min_value=0, max_value=512)),
        st.tuples(st.just("budget"), st.integers(min_value=0, max_value=512)),
        st.tuples(st.just("journal"), st.integers(min_value=0, max_value=512)),
        st.tuples(st.just("hooks"), st.booleans()),
    ),
    max_size=30,
)


@SETTINGS
@given(ops=OPS)
def test_the_inline_data_lock_acts_as_the_called_one(ops):
    """Two ledgers, one pool each, the same operations: one pool takes the data
    lock inline (as shipped), the other calls :meth:`Ledger.lock_fd` and
    :meth:`Ledger.unlock_fd`. Every answer, figure, word and hook must agree,
    including a publication journal left pending (a calibrator killed
    halfway), which only the code after the lock applies."""
    with (
        tempfile.TemporaryDirectory(prefix="kvcached-inline-") as da,
        tempfile.TemporaryDirectory(prefix="kvcached-called-") as db,
    ):
        leds = [_open(da), _open(db)]
        try:
            pools = [led.register_pool("a") for led in leds]
            assert pools[0]._inline_lock
            pools[1]._inline_lock = False
            for led in leds:
                led.register_pool("b").grant(64 * MIB)  # another instance's charge
                _set_budget(led, 256 * MIB)
            revision = 0
            hooks = False
            for op, arg in ops:
                if op == "limit":
                    revision += 1
                out = []
                for led, pool in zip(leds, pools, strict=True):
                    seen: list[str] = []
                    _hooks.point = seen.append if hooks else None
                    try:
                        if op == "grant":
                            result: object = pool.grant(arg * MIB)
                        elif op == "refund":
                            result = pool.refund(arg * MIB)
                        elif op == "flush":
                            result = pool.flush()
                        elif op == "limit":
                            result = led.set_limit("a", arg * MIB, revision)
                        elif op == "budget":
                            result = _set_budget(led, arg * MIB)
                        elif op == "journal":  # published, not applied: the next holder applies it
                            i64, u64 = led.i64, led.u64
                            i64[H_PUB_BUDGET], i64[H_PUB_FREE] = arg * MIB, 0
                            u64[H_PUB_TIME], u64[H_PUB_SEQ] = 1, u64[H_SEQ] + 1
                            led.u32[H_PUB_PENDING] = 1
                            result = None
                        else:
                            result = None
                    except ValueError as exc:  # a refund of more than the pool holds
                        result = type(exc)
                    finally:
                        _hooks.point = None
                    out.append(
                        (
                            result,
                            pool.charged,
                            pool.pending_refund,
                            pool.headroom(),
                            _words(led, pool),
                            led.u32[H_PUB_PENDING],
                            seen,
                        )
                    )
                if op == "hooks":
                    hooks = arg
                assert out[0] == out[1], (op, arg)
        finally:
            _hooks.point = None
            for led in leds:
                led.close()
