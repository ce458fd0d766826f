"""The ledger stays in parts a reader can find (issue #36): ``ledger.py`` holds
the mapping, the sums and the delegations, under 500 lines, and no function in
the package is over 80 lines (``pool.py``'s grant path is measured on its own)."""

from __future__ import annotations

import ast
from pathlib import Path

LEDGER = Path(__file__).resolve().parents[2] / "kvcached" / "ledger"


def long_functions(path: Path, limit: int = 80) -> list[str]:
    """``path:line name (lines)`` of every function of ``path`` over ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_ledger_py_is_at_most_500_lines():
    lines = len((LEDGER / "ledger.py").read_text().splitlines())
    assert lines <= 500, f"kvcached/ledger/ledger.py has {lines} lines: give the new job a module"


def test_no_ledger_function_is_over_80_lines():
    paths = [p for p in sorted(LEDGER.glob("*.py")) if p.name != "pool.py"]
    assert len(paths) >= 10
    found = [hit for p in paths for hit in long_functions(p)]
    assert not found, f"split these: {found}"


def test_the_check_sees_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    module = tmp_path / "m.py"
    module.write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}")
    assert long_functions(module) == ["m.py:5 long (81 lines)"]
