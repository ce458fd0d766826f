"""One worker of the multi-process ledger stress (see test_ledger_stress.py).

``python stress_worker.py LEDGER_DIR JOURNAL SEED``. The worker registers a
pool and grants and refunds random sizes until the supervisor sets ``STOP``
in its journal, or kills it. The journal is a small mmap'd file of 64-bit
words that the worker updates around every step without any syscall, so
whatever the worker holds, and where it was, can be read after a SIGKILL:

* ``HELD``: bytes granted and not released (a grant counts once it returned
  and was "materialised"; a release counts once it is confirmed, before the
  refund call);
* ``IN_LOCK``: 1 between taking and dropping the ledger's data lock (set by
  the ledger's test hooks), ``LOCKS`` how often it took it;
* ``STAGE``: 1 between a granted grant and its materialisation, 2 between a
  confirmed release and its refund, 3 inside a calibration;
* ``VIOLATIONS``: times it saw, under the data lock, a granted grant leave
  ``sum(charges) > budget``, or the sum raised past the budget while it held
  the lock (it checks at every grant and every unlock; ``CHECKS`` counts them).
"""

from __future__ import annotations

import mmap
import os
import random
import sys
import time

from kvcached.ledger import Ledger, _hooks
from kvcached.units import MIB

DEVICE_ID = "stress-0"
MARGIN = 64 * MIB
TOTAL = 640 * MIB  # with gpu_utilization 0.9: margin 64 MiB
SIZES = (2 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 64 * MIB, 96 * MIB)
SLEEP_IN_LOCK_P = 0.002  # sometimes linger inside the data lock, to be killed there

(
    PID,
    STATE,
    HELD,
    PENDING_GRANT,
    PENDING_REFUND,
    IN_LOCK,
    OPS,
    VIOLATIONS,
    LOCKS,
    SLOT,
    TOKEN,
    STAGE,
    CALIBRATIONS,
    DENIALS,
    STOP,
    EXIT,
    CHECKS,
) = range(17)
WORDS = 32
STARTING, RUNNING, QUIESCED = 0, 1, 2


class Sampler:
    """A device whose used memory is what the ledger charges minus what pools
    released and have not refunded yet (read without the lock, as a driver
    reports it at some recent moment), never reporting less free than the
    margin. A calibration may still publish a budget below the charges (when
    refunds land between its sample and its publication, exactly as on a GPU);
    what must never happen is a lock holder *raising* the sum past the budget."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ledger: Ledger | None = None

    def mem_info(self) -> tuple[int, int]:
        led = self.ledger
        used = led.charged_total() - led.released_total() if led is not None else 0
        free = max(MARGIN, TOTAL - used) + self.rng.randrange(0, 64 * MIB, 2 * MIB)
        return free, TOTAL


def open_journal(path: str) -> tuple[mmap.mmap, memoryview]:
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, WORDS * 8)
    finally:
        os.close(fd)
    return mm, memoryview(mm).cast("q")


def main() -> None:
    directory, journal, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    _mm, j = open_journal(journal)
    j[PID] = os.getpid()

    opened: list[Ledger | None] = [None]
    at_lock = [0]

    def hook(name: str) -> None:
        led = opened[0]
        if name == "data-locked":
            j[IN_LOCK] = 1
            j[LOCKS] += 1
            if led is not None:
                at_lock[0] = led.charged_total()
            if rng.random() < SLEEP_IN_LOCK_P:
                time.sleep(rng.uniform(0.0005, 0.003))
        elif name == "data-unlocking":
            # Every holder checks, as it leaves the lock, that nobody raised the
            # sum of charges past the budget while it held it (its own grant, or a
            # process that wrote without the lock).
            if led is not None:
                j[CHECKS] += 1
                total = led.charged_total()
                if total > led.budget and total > at_lock[0]:
                    j[VIOLATIONS] += 1
            j[IN_LOCK] = 0
        elif name == "grant-charged" and led is not None:
            j[CHECKS] += 1
            if led.charged_total() > led.budget:  # a granted grant is within the budget
                j[VIOLATIONS] += 1
        elif name == "grant-decided" and rng.random() < SLEEP_IN_LOCK_P * 5:
            time.sleep(rng.uniform(0.0005, 0.003))  # between a grant's check and its write

    _hooks.point = hook
    sampler = Sampler(rng)
    ledger = Ledger.open(DEVICE_ID, sampler, directory=directory, gpu_utilization=0.9)
    sampler.ledger = opened[0] = ledger
    pool = ledger.register_pool(f"inst{seed % 3}")
    j[SLOT], j[TOKEN] = pool.slot, pool.token
    j[STATE] = RUNNING
    handles: list[int] = []
    while not j[STOP]:
        r = rng.random()
        if r < 0.5 or (r < 0.95 and not handles):
            n = rng.choice(SIZES)
            j[PENDING_GRANT] = n
            if pool.grant(n):
                j[STAGE] = 1
                if rng.random() < 0.02:  # the driver creating and mapping the memory
                    time.sleep(rng.uniform(0.0002, 0.002))
                handles.append(n)
                j[HELD] += n
                j[STAGE] = 0
            else:
                j[DENIALS] += 1
            j[PENDING_GRANT] = 0
        elif r < 0.95:
            n = handles.pop(rng.randrange(len(handles)))
            j[STAGE] = 2
            j[PENDING_REFUND] = n
            j[HELD] -= n  # the release is confirmed; now refund it
            pool.refund(n)
            j[PENDING_REFUND] = 0
            j[STAGE] = 0
        else:
            j[STAGE] = 3
            if ledger.calibrate().published:
                j[CALIBRATIONS] += 1
            j[STAGE] = 0
        j[OPS] += 1
    pool.flush()
    j[STATE] = QUIESCED
    while not j[EXIT]:
        time.sleep(0.005)
    for n in handles:
        pool.refund(n)
    j[HELD] = 0
    pool.close()
    ledger.close()


if __name__ == "__main__":
    main()
