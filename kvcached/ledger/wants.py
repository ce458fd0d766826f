"""Calls for memory between the instances of one device: the pool records' ``wanted`` words.

The budget decides who may grow, but it cannot take back what another
instance holds idle: reserved pages and unreferenced prefix-cache blocks stay
mapped (and charged) until their owner lets them go. An instance whose
allocations miss because the *device's* budget is spent therefore posts a
call in its pool record: ``wanted`` (the bytes it lacked) and ``wanted_seq``
(bumped with every call). The other instances' control threads read the calls
on every pass and release idle memory where one is new and the device's room
does not cover it (:mod:`kvcached.control.yielding`).

Rules:

* only the owner writes its record's two words, without the data lock (one
  writer, like ``released``); ``wanted`` first, ``wanted_seq`` last, so a reader
  that sees a new count sees at least that call's bytes (or a newer call's);
* a call is posted only where neighbours releasing memory would help: not
  when the device has the room (the next grant gets it), and not when the
  instance's own limit is what stops it;
* the words are advisory: reading them takes no lock, a call read late or
  twice moves only idle memory, and nothing charged or refunded depends on
  them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcached.ledger.layout import H_HIGH_WATER, i_limit, p_wanted, p_wanted_seq


@dataclass(frozen=True)
class Want:
    """One pool's latest call: ``nbytes`` lacked, the ``seq``-th call of the
    pool record ``slot`` while held by ``token``."""

    slot: int
    token: int
    seq: int
    nbytes: int

    @property
    def key(self) -> tuple[int, int]:
        """What a reader remembers to tell a new call from one already seen."""
        return (self.token, self.seq)


def device_room(led: Any) -> int:
    """The device's budget less every pool's charge (read without the lock)."""
    return led.budget - led.charged_total()


def post_want(led: Any, slot: int, instance_slot: int, nbytes: int, pending: int = 0) -> bool:
    """Post a call for ``nbytes`` in pool record ``slot`` (its owner's only), unless
    the device's room (plus the pool's own batched refunds, ``pending``) covers it or
    instance ``instance_slot``'s limit is what is short. Returns whether it posted."""
    if nbytes <= 0:
        raise ValueError(f"nbytes={nbytes!r}: a call for memory asks for a positive size")
    if device_room(led) + pending >= nbytes:
        return False
    limit = led.i64[i_limit(instance_slot)]
    if limit and limit - led.instance_charged(instance_slot) < nbytes:
        return False
    led.i64[p_wanted(slot)] = nbytes
    led.u64[p_wanted_seq(slot)] += 1
    return True


def neighbour_wants(led: Any, instance_slot: int) -> list[Want]:
    """The latest call of every pool in use that is not instance ``instance_slot``'s."""
    ref = instance_slot + 1
    hw = led.u32[H_HIGH_WATER]
    out = []
    for slot, (token, inst) in enumerate(zip(led.tokens[:hw], led.instances[:hw], strict=True)):
        if not token or inst == ref:
            continue
        seq = led.u64[p_wanted_seq(slot)]
        if seq:
            out.append(Want(slot, token, seq, led.i64[p_wanted(slot)]))
    return out
