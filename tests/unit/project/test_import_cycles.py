"""No import circle between the package's modules.

The graph is read from the source with `ast`: every `import` and `from ... import` that names a
`slime_async` module, at module level and inside functions alike (a function-level import that
closes a circle is a circle too, only a later one). Imports under `if TYPE_CHECKING:` are left
out: they never run, they only name types for annotations.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "slime_async"

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of its first import}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` (their `else` is kept)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> dict[str, int]:
    """The modules of `known` that `module`'s source imports, each with its first line."""
    out: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target != module and target in known:
            out[target] = min(line, out.get(target, line))

    package = module if is_package else module.rpartition(".")[0]
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` levels above this one's
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node.lineno)
    return out


def package_graph() -> Graph:
    paths = {module_name(p): p for p in PKG.rglob("*.py")}
    known = set(paths)
    return {
        mod: imports_of(path.read_text(), mod, path.name == "__init__.py", known)
        for mod, path in paths.items()
    }


def cycles(graph: Graph) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan), as a closed path
    `[a, b, ..., a]`, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_circle_in(graph, group) for group in groups)


def _circle_in(graph: Graph, group: set[str]) -> list[str]:
    """A shortest circle through the group's first module (breadth-first inside the group)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in group or w in came_from:
                    continue
                came_from[w] = v
                if w == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(came_from[path[-1]])
                    return path[::-1]
                nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is strongly connected but has no circle")


def describe(graph: Graph, circle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in itertools.pairwise(circle)]
    return "\n  ".join(steps)


def test_the_package_has_no_import_circle():
    graph = package_graph()
    assert "slime_async.models" in graph and any(graph.values())  # the graph was read
    found = cycles(graph)
    assert not found, f"{len(found)} import circle(s):\n" + "\n".join(
        "  " + describe(graph, c) for c in found
    )


def test_circles_are_found_at_function_level_and_through_relative_imports():
    """The reader sees function-level and relative imports and skips TYPE_CHECKING blocks; each
    group of modules that import each other is named by one circle."""
    known = {"p", "p.a", "p.b", "p.c", "p.d"}
    sources = {
        "p": "",
        "p.a": "from p import b\n",
        "p.b": "def f():\n    from p.c import g\n",
        "p.c": "from . import a\nif TYPE_CHECKING:\n    from p import d\n",
        "p.d": "import p.c\n",
    }
    graph = {m: imports_of(s, m, m == "p", known) for m, s in sources.items()}
    assert graph["p.b"] == {"p.c": 2} and graph["p.c"] == {"p.a": 1}
    assert cycles(graph) == [["p.a", "p.b", "p.c", "p.a"]]
    two = {"x": {"y": 1}, "y": {"x": 3}, "z": {"w": 1}, "w": {"z": 1, "x": 2}}
    assert cycles(two) == [["w", "z", "w"], ["x", "y", "x"]]
    assert describe(two, ["x", "y", "x"]) == "x (line 1) -> y\n  y (line 3) -> x"
