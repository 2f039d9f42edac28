"""The package's imports: no cycles, and every module imports downward only
(docs/architecture.md, "Packages and what each may import").

What counts as an import: every ``import`` / ``from ... import`` statement that names a module of
``visionserve``, wherever it stands: at module level, under ``if TYPE_CHECKING:``, or inside a
function. A function-local import written to dodge a cycle is still a cycle of the design, and a
type-only import still says that the importer knows the imported. Relative imports are resolved;
``from . import x`` imports the submodule ``x`` where there is one, else the package itself (its
``__init__``). The command line's dispatch is no import statement and is not counted:
``cli.COMMANDS`` names each command's module as a string and imports only the one that runs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "visionserve"

#: Lowest first. A module may import its own layer and the layers below it, never one above.
#: The first part of a module's name below ``visionserve`` says its layer: a package's modules
#: all sit in the package's layer.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("foundation", frozenset({"", "errors", "config", "plugins", "logs", "metrics", "latency",
                              "extras", "process", "threads", "storage", "framing", "audit"})),
    ("frames and devices", frozenset({"imaging", "gpu"})),
    ("models", frozenset({"backends", "tasks", "repository", "verdicts", "recipes"})),
    ("data plane", frozenset({"dataplane", "batching", "execution", "engine", "oip", "served",
                              "admission", "enginestats", "lifecycle", "livefeed",
                              "preview", "cameras"})),
    ("front ends", frozenset({"http", "grpc", "frontends", "security", "users"})),
    ("services", frozenset({"guard", "plc", "ops", "records", "loop", "console"})),
    ("assembly", frozenset({"runtime", "cli", "__main__"})),
)
#: Packages of one layer that never import one another: each front end translates on its own
#: (security is the middleware they share); the guard, the PLC servers and ops are independent.
SIBLINGS = (frozenset({"http", "grpc", "frontends"}), frozenset({"guard", "plc", "ops"}))
#: Web and RPC frameworks: only the front ends and what stands above them import these; the
#: data plane and everything below it run under any front end, or none.
FRAMEWORKS = ("fastapi", "starlette", "uvicorn", "grpc", "tritonclient")
#: Tooling (benchmarks, acceptance runs, synthetic images, training): the server never imports it.
#: ``visionserve bench`` reaches it through the command line's dispatch, by name.
TOOLING = ("visionserve_tools", "visionserve.bench", "visionserve.benchgpu",
           "visionserve.benchguard", "visionserve.benchclient", "visionserve.synthetic")
#: Known breaches of that rule, each with its reason; the test fails when one is gone, so that
#: its line goes too.
TOOLING_USERS: dict[str, str] = {}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int

    def where(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package)"""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path, is_package)
    return out


MODULES = _modules()


def _ours(name: str, prefix: str = PACKAGE) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The modules an import statement names (absolute, any package)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join([*base, node.module] if node.module else base)
    else:
        target = node.module or ""
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        yield sub if sub in MODULES else target


def _imports(module: str) -> Iterator[tuple[str, int]]:
    path, is_package = MODULES[module]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(module, is_package, node):
                yield target, node.lineno


def _within(target: str) -> str | None:
    """The module of this package that ``target`` names (a function or class imported from it
    names its module); None for another package."""
    if not _ours(target):
        return None
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target if target in MODULES else None


def _graph() -> dict[str, list[Edge]]:
    graph: dict[str, list[Edge]] = {m: [] for m in MODULES}
    for module in MODULES:
        for target, line in _imports(module):
            inner = _within(target)
            if inner is not None and inner != module:
                graph[module].append(Edge(module, inner, line))
    return graph


GRAPH = _graph()


def _cycles(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """One cycle (as its edges) for each strongly connected component of more than one module
    (Tarjan), so that every knot is reported once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph[v]:
            if e.target not in index:
                visit(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on_stack:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_a_cycle(graph, component) for component in components]


def _a_cycle(graph: dict[str, list[Edge]], component: set[str]) -> list[Edge]:
    """The shortest way round from the component's first module back to it."""
    start = min(component)
    paths: dict[str, list[Edge]] = {start: []}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in graph[v]:
                if e.target == start:
                    return [*paths[v], e]
                if e.target in component and e.target not in paths:
                    paths[e.target] = [*paths[v], e]
                    nxt.append(e.target)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def _part(module: str) -> str:
    """``visionserve.http.app`` -> ``http``; the package itself -> ``""``."""
    rest = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    return rest.split(".", 1)[0]


def _layer(module: str) -> int:
    for i, (_, parts) in enumerate(LAYERS):
        if _part(module) in parts:
            return i
    raise KeyError(module)


def _edges() -> Iterator[Edge]:
    for edges in GRAPH.values():
        yield from edges


# --- the rules ------------------------------------------------------------------------------------

def test_the_walk_sees_the_package():
    """The walk itself: it finds the modules and resolves what they import."""
    assert {"visionserve.engine", "visionserve.http.app", "visionserve.cli"} <= set(MODULES)
    app = {e.target for e in GRAPH["visionserve.http.app"]}
    assert {"visionserve.dataplane", "visionserve.http.common", "visionserve.http.v2"} <= app
    assert "visionserve" in app  # from .. import __version__: the package's __init__


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(
        "  " + " -> ".join([c[0].source, *(f"{e.target} (line {e.line})" for e in c)])
        for c in cycles)


def test_every_module_has_a_layer():
    missing = []
    for module in MODULES:
        try:
            _layer(module)
        except KeyError:
            missing.append(module)
    assert not missing, (f"modules in no layer: {missing}; add them to LAYERS "
                         "here and to docs/architecture.md")


def test_imports_go_downward_only():
    names = [name for name, _ in LAYERS]
    upward = [f"{e.where()}: {names[_layer(e.source)]} imports {names[_layer(e.target)]}"
              for e in _edges() if _layer(e.target) > _layer(e.source)]
    assert not upward, "imports of a higher layer:\n  " + "\n  ".join(upward)


def test_sibling_packages_do_not_import_each_other():
    crossing = [e.where() for e in _edges() for group in SIBLINGS
                if {_part(e.source), _part(e.target)} <= group
                and _part(e.source) != _part(e.target)]
    assert not crossing, "siblings that import each other:\n  " + "\n  ".join(crossing)


def test_web_and_rpc_frameworks_stay_in_the_front_ends():
    front = [name for name, _ in LAYERS].index("front ends")
    found = sorted({f"{m} imports {target} (line {line})" for m in MODULES if _layer(m) < front
                    for target, line in _imports(m) if any(_ours(target, f) for f in FRAMEWORKS)})
    assert not found, "\n  ".join(["below the front ends:", *found])


def test_the_server_never_imports_the_tooling():
    users = {m: sorted({f"{m} imports {target} (line {line})" for target, line in _imports(m)
                        if any(_ours(target, t) for t in TOOLING)}) for m in MODULES}
    found = [line for m, lines in sorted(users.items()) if m not in TOOLING_USERS for line in lines]
    assert not found, "\n  ".join(["the server imports tooling:", *found])
    gone = [m for m in TOOLING_USERS if not users.get(m)]
    assert not gone, f"no longer import the tooling: {gone}; remove them from TOOLING_USERS"


@pytest.mark.parametrize("source, expected", [
    ("import visionserve.engine\n", {"visionserve.engine"}),
    ("from ..errors import ConfigError\n", {"visionserve.errors"}),
    ("from . import app\n", {"visionserve.http.app"}),
    ("from .. import __version__\n", {"visionserve"}),
    ("def f():\n    from .common import read_body\n", {"visionserve.http.common"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine import Engine\n",
     {"visionserve.engine"}),
    ("import numpy\nfrom visionserve_tools import bench\n", set()),
])
def test_what_counts_as_an_import(source, expected):
    """As if the statements stood in visionserve/http/inspect.py."""
    tree = ast.parse(source)
    found = {_within(t) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for t in _targets("visionserve.http.inspect", False, node)}
    assert found - {None} == expected


def test_a_cycle_is_found_and_printed():
    graph = {"a": [Edge("a", "b", 1)], "b": [Edge("b", "c", 2)], "c": [Edge("c", "a", 3)],
             "d": [Edge("d", "a", 4)]}
    (cycle,) = _cycles(graph)
    assert [e.where() for e in cycle] == ["a -> b (line 1)", "b -> c (line 2)", "c -> a (line 3)"]
