"""The import graph of `planner` and `runtime` has no circles, and it runs profile -> plan -> run:
the runtime may import the planner, the planner never imports the runtime (except `planner.cli`,
which dispatches `plan run` to `runtime.cli`).

Every `import` / `from ... import` in a file counts, wherever it is: inside functions (a lazy import
still makes a circle, only a later one) and inside `if TYPE_CHECKING:` blocks (a circle of types is
still a circle of modules). Built from the source with `ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("planner", "runtime")
# The one planner module allowed to import the runtime: the `plan` CLI dispatching `plan run`.
PLANNER_TO_RUNTIME_ALLOWED = {"planner.cli"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package __init__)."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join(parts)] = (path, is_pkg)
    return mods


def _owner(name: str, mods: dict) -> str | None:
    """The module `name` is, or the innermost of ours that holds it (`planner.x.func` -> `planner.x`)."""
    while name not in mods:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets: list[str] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    package = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join(package + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets.append(base)  # `from X import Y` runs X
                targets += [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in mods]
        for target in targets:
            owner = _owner(target, mods)
            if owner is not None and owner != mod:
                graph[mod].add(owner)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}  # 1: on the DFS path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_graph_sees_the_packages():
    graph = import_graph()
    assert "planner.cli" in graph and "runtime.worker" in graph
    assert "runtime.types" in graph["runtime.preflight"]  # edges are found


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_planner_does_not_import_runtime():
    graph = import_graph()
    bad = sorted(
        f"{mod} -> {target}"
        for mod, targets in graph.items() if mod.startswith("planner") and mod not in PLANNER_TO_RUNTIME_ALLOWED
        for target in targets if target == "runtime" or target.startswith("runtime.")
    )
    assert not bad, "the planner imports the runtime (profile -> plan -> run): " + "; ".join(bad)
