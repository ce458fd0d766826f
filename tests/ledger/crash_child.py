"""A process that uses the ledger and SIGKILLs itself at a named hook point.

``python crash_child.py DIR ACTION POINT``; see test_ledger_crash.py. Exit code
2 means the point was never reached (the test fails on it).
"""

from __future__ import annotations

import os
import signal
import sys

from kvcached.ledger import Ledger, _hooks
from kvcached.units import GIB, MIB


class Device:
    def mem_info(self):
        return 3 * GIB, 10 * GIB


def arm(point: str) -> None:
    def hook(name: str) -> None:
        if name == point:
            os.kill(os.getpid(), signal.SIGKILL)

    _hooks.point = hook


def main() -> None:
    directory, action, point = sys.argv[1:4]
    ledger = Ledger.open("fake-0", Device(), directory=directory, gpu_utilization=0.9)
    if action == "hold":  # die holding 10 MiB, outside any lock
        pool = ledger.register_pool("victim")
        pool.grant(10 * MIB)
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "grant":
        pool = ledger.register_pool("victim")
        pool.grant(10 * MIB)
        arm(point)
        pool.grant(6 * MIB)
    elif action == "refund":
        pool = ledger.register_pool("victim")
        pool.grant(100 * MIB)
        arm(point)
        pool.refund(64 * MIB)
    elif action == "register":
        arm(point)
        ledger.register_pool("victim")
    elif action == "retire":  # registration retires an earlier victim, and dies doing it
        arm(point)
        ledger.register_pool("retirer")
    elif action == "calibrate":
        pool = ledger.register_pool("victim")
        pool.grant(10 * MIB)
        arm(point)
        ledger.calibrate()
    elif action == "limit":
        pool = ledger.register_pool("victim")
        arm(point)
        ledger.set_limit("victim", 5 * MIB, 7)
    sys.exit(2)


if __name__ == "__main__":
    main()
