"""No import circle inside the kvcached package.

Each module's imports are read with :mod:`ast`, not by importing it: at the
top, inside functions and under ``if TYPE_CHECKING:`` alike. A function-level
import only defers a circle to the first call, and a type-only one is still a
circle to a type checker and to a reader who follows it; both are how the
circles this test first found had been hidden. Only edges between kvcached's
own modules count. Importing ``a.b.c`` also runs the packages ``a`` and
``a.b``, but that is Python's package structure, not an edge: an edge goes to
the module named (``from a.b import c`` names ``a.b.c`` when ``c`` is a
module, else ``a.b``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Circles tolerated for now (none since serve's app/router circle was cut). An
# entry excuses a circle only among its own modules: a circle that reaches one
# more module fails.
_KNOWN: frozenset[frozenset[str]] = frozenset()

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the import}


def modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """``name -> (path, is a package)`` for every module of ``package`` under ``root``."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def _imports(name: str, path: Path, is_package: bool, known: set[str]) -> dict[str, int]:
    here = name.split(".") if is_package else name.split(".")[:-1]
    out: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target and target not in known:  # `import a.b.C` where C is no module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in known else source, node.lineno)
    return out


def import_graph(root: Path, package: str) -> Graph:
    """Every module of ``package`` and the modules of ``package`` it imports."""
    mods = modules(root, package)
    names = set(mods)
    return {name: _imports(name, path, is_pkg, names) for name, (path, is_pkg) in mods.items()}


def circles(graph: Graph) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's
    algorithm, iterative: the package is deep enough to make recursion fragile)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def a_cycle(graph: Graph, component: frozenset[str]) -> list[str]:
    """One closed path through ``component``, as ``[a, b, ..., a]`` (breadth
    first from its first module, so the shortest such path)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*paths[node], start]
            if nxt in component and nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"invariant: {sorted(component)} is strongly connected")


def describe(graph: Graph, component: frozenset[str]) -> str:
    cycle = a_cycle(graph, component)
    steps = [f"{a} -> {b} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    return f"{sorted(component)}:\n    " + "\n    ".join(steps)


def test_the_package_has_no_import_circle():
    graph = import_graph(ROOT, "kvcached")
    assert len(graph) > 50 and "kvcached.ledger.pool" in graph  # the walk found the package
    new = [c for c in circles(graph) if not any(c <= known for known in _KNOWN)]
    assert not new, "import circles in kvcached:\n" + "\n".join(describe(graph, c) for c in new)


def test_the_cut_circles_stay_cut():
    """The circles issue #27 names, one edge each that must not come back."""
    graph = import_graph(ROOT, "kvcached")
    for module, must_not_import in [
        ("kvcached.ledger.pool", "kvcached.ledger.ledger"),
        ("kvcached.ledger.calibrator", "kvcached.ledger.ledger"),
        ("kvcached.integrations.sglang.groups", "kvcached.integrations.sglang.patch"),
        ("kvcached.integrations.sglang.pools", "kvcached.integrations.sglang.patch"),
        ("kvcached.integrations.sglang.elastic_kv", "kvcached.integrations.sglang.control"),
    ]:
        assert must_not_import not in graph[module], (module, must_not_import)


def test_hidden_imports_are_found(tmp_path):
    """The reader sees function-level, type-only and relative imports, and the
    report names the path and its lines."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.c import C\n")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import c\n"
    )
    (pkg / "sub" / "c.py").write_text("import pkg.a\nC = 1\n")
    (pkg / "d.py").write_text("from pkg.sub import C\nimport pkg.a\n")  # no circle through d
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b": 2}
    assert graph["pkg.b"] == {"pkg.sub.c": 3}
    assert graph["pkg.d"] == {"pkg.sub": 1, "pkg.a": 2}
    found = circles(graph)
    assert found == [frozenset({"pkg.a", "pkg.b", "pkg.sub.c"})]
    assert a_cycle(graph, found[0]) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    assert "pkg.b -> pkg.sub.c (line 3)" in describe(graph, found[0])
