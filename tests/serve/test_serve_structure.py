"""How serve is put together: no import circle among its modules (type-only
imports included), and the snapshot it publishes keeps its start time."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcached.serve

SERVE = Path(kvcached.serve.__file__).parent


def _module_level_imports(tree: ast.Module) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):  # if TYPE_CHECKING: counts too
            out += [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return out


def _graph() -> dict[str, set[str]]:
    mods = {p.stem for p in SERVE.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in mods:
        tree = ast.parse((SERVE / f"{name}.py").read_text())
        deps: set[str] = set()
        for node in _module_level_imports(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "kvcached.serve":
                    deps |= {a.name for a in node.names if a.name in mods}
                elif node.module.startswith("kvcached.serve."):
                    deps.add(node.module.rsplit(".", 1)[1])
            elif isinstance(node, ast.Import):
                deps |= {
                    a.name.rsplit(".", 1)[1]
                    for a in node.names
                    if a.name.startswith("kvcached.serve.")
                }
        graph[name] = deps & mods
    return graph


def test_no_import_circle_in_serve():
    graph = _graph()
    assert "app" not in graph["router"], "the router must not import app (it knows a Front)"
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, "import circle: " + " -> ".join((*path, node))
        if node in done:
            return
        for dep in graph[node]:
            visit(dep, (*path, node))
        done.add(node)

    for node in graph:
        visit(node, ())


def test_the_published_started_at_is_the_routers_start():
    from kvcached.control.snapshot import read_snapshots
    from kvcached.serve.state import ModelRecord, StatePublisher

    pub = StatePublisher()
    try:
        record = ModelRecord(name="structure-probe")
        pub.publish(record)
        first = _mine(read_snapshots(cleanup=False))
        record.state = "starting"
        pub.publish(record)
        second = _mine(read_snapshots(cleanup=False))
    finally:
        pub.close()
    assert first["serve"]["state"] == "stopped" and second["serve"]["state"] == "starting"
    assert first["started_at"] == second["started_at"]
    assert second["updated_at"] >= first["updated_at"]


def _mine(snaps: list) -> dict:  # type: ignore[type-arg]
    import os

    return next(s.data for s in snaps if s.instance == "structure-probe" and s.pid == os.getpid())
