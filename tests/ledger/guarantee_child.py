"""A real process for the ledger's guarantee tests (see test_ledger_guarantees.py).

``python guarantee_child.py ACTION DIR [ARGS...]``; it prints one line when it
has done its part, then waits for its stdin to close (or to be killed):

* ``grow DIR INDEX CAPACITY NBYTES``: on host device ``INDEX`` (of CAPACITY
  bytes), register a pool, grant NBYTES and create them (a memfd handle);
  prints ``grown``;
* ``register DIR``: register a pool of ``newcomer`` on ``fake-0``; prints
  ``registered``;
* ``stop DIR``: register a pool of ``stopper`` on ``fake-0``, then stop itself
  (SIGSTOP) inside the data lock during a grant; after SIGCONT it prints
  ``continued``.
"""

from __future__ import annotations

import os
import signal
import sys

from kvcached.ledger import Ledger, _hooks
from kvcached.units import GIB, MIB


class Device:
    def mem_info(self):
        return 8 * GIB, 10 * GIB


def wait_for_stdin() -> None:
    sys.stdin.read()


def main() -> None:
    action, directory = sys.argv[1], sys.argv[2]
    if action == "grow":
        from kvcached.driver.host import HostDriver

        index, capacity, nbytes = (int(a) for a in sys.argv[3:6])
        driver = HostDriver(index, capacity)
        ledger = Ledger.open(
            driver.info().pci_bus_id, driver, directory=directory, gpu_utilization=0.9
        )
        pool = ledger.register_pool("grower")
        assert pool.grant(nbytes), "the grower's grant was refused"
        handle = driver.create(nbytes)
        print("grown", flush=True)
        wait_for_stdin()
        driver.release(handle)
        pool.refund(nbytes)
        pool.close()
    elif action == "register":
        ledger = Ledger.open("fake-0", Device(), directory=directory, gpu_utilization=0.9)
        pool = ledger.register_pool("newcomer")  # kept: a dropped pool drops its lease
        print("registered", flush=True)
        wait_for_stdin()
        pool.close()
    elif action == "stop":
        ledger = Ledger.open("fake-0", Device(), directory=directory, gpu_utilization=0.9)
        pool = ledger.register_pool("stopper")

        def hook(name: str) -> None:
            if name == "data-locked":
                _hooks.point = None
                os.kill(os.getpid(), signal.SIGSTOP)

        print("stopping", flush=True)
        _hooks.point = hook
        pool.grant(MIB)
        print("continued", flush=True)
        wait_for_stdin()
    else:
        sys.exit(f"unknown action {action!r}")


if __name__ == "__main__":
    main()
