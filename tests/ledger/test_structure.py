"""The ledger stays in parts a reader can find (issue #36): ``ledger.py`` holds
the mapping, the sums and the delegations to its parts, in at most 500 lines.
(No function over 80 lines: ``tests/test_function_lengths.py`` on the
house-hotpath branch checks the whole package.)"""

from __future__ import annotations

from pathlib import Path

LEDGER = Path(__file__).resolve().parents[2] / "kvcached" / "ledger"


def test_ledger_py_is_at_most_500_lines():
    lines = len((LEDGER / "ledger.py").read_text().splitlines())
    assert lines <= 500, f"kvcached/ledger/ledger.py has {lines} lines: give the new job a module"
