"""Test-only hook points.

The ledger calls ``point(name)`` at a few named places when a test has set
:data:`point` (``None`` in production: the cost is one attribute test). Crash
tests use them to die at an exact place (inside the data lock, between a grant
and its materialisation, halfway through a retirement) and the stress test to
record that a process was killed inside the data lock.

Names: ``data-locked``, ``data-unlocking``, ``grant-decided``, ``grant-charged``,
``refund-flushed``, ``register-leased``, ``register-written``,
``retire-journaled``, ``retire-applying``, ``calibrate-sampled`` (the sample
window is open, the driver sampled, nothing published), ``calibrate-journaled``
(the publication committed to its journal, not yet applied),
``calibrate-published``, ``limit-written``.
"""

from __future__ import annotations

from collections.abc import Callable

point: Callable[[str], None] | None = None
