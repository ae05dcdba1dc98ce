"""Dependencies point one way: HTTP layer -> engine -> batching and models; everything may
use telemetry; batching imports nothing of the project; no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.server import ROOT

PACKAGES = ("app", "engine", "batching", "models", "telemetry")
# What each package may import of the others (itself always).
ALLOWED = {
    "app": {"engine", "models", "telemetry"},
    "engine": {"batching", "models", "telemetry"},
    "batching": set(),
    "models": {"batching", "telemetry"},
    "telemetry": set(),
}


def _imports(path: Path) -> set[str]:
    """The project modules a file imports, at any depth (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from a import b` imports module a.b where there is one, else a itself.
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in (*PACKAGES, "training", "bench"))
    return found


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    graph = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            graph[_module(path)] = _imports(path)
    return graph


def test_each_package_imports_only_what_it_may() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if (home := module.split(".")[0]) != (other := target.split(".")[0])
        and other not in ALLOWED[home]
    ]
    assert not wrong, wrong


def test_the_served_packages_have_no_import_cycles() -> None:
    graph = _graph()
    modules = set(graph)

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    edges = {m: {r for t in ts if (r := resolve(t)) and r != m} for m, ts in graph.items()}
    # Package __init__ re-exports are edges too; a cycle through them is still a cycle.
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(trail[trail.index(nxt) :] + [nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles
