"""The package has no import circles, counting the imports hidden inside functions.

A function-level import hides a circle from Python (the import runs late, after both modules finished
loading) but not from a reader: two modules that import each other are one module split in two files.
This test parses every retrace/**/*.py with `ast`, takes every `import` and `from ... import` anywhere in
the file (module level, function level, class level, under `if`/`try`), resolves relative imports, maps
`from a.b import c` to the module a.b.c when that is a module (else to a.b), keeps the edges that stay
inside the package and fails on any strongly connected component larger than one module, naming one
shortest circle through it. Importing a submodule also runs its parent packages' ``__init__``; those
implicit edges are not counted (a package's ``__init__`` re-exporting its submodules is not a circle).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "retrace"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package (a package is its ``__init__``)."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from X import ...` names (relative levels resolved against `module`)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
    return {_nearest_module(t, modules) for t in targets if t == PACKAGE or t.startswith(PACKAGE + ".")} - {
        module, None}


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    """`name` itself when it is a module, else its longest prefix that is one (`import a.b.C`-style)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components (iterative), each sorted; only those with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module, as [m0, m1, ..., m0]."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no circle through {start} in {component}")


def describe_cycles(graph: dict[str, set[str]], skip=()) -> list[str]:
    """One line per circle (component), leaving out the components listed in `skip`."""
    return [f"{' -> '.join(shortest_cycle(graph, comp))} (component: {', '.join(comp)})"
            for comp in strongly_connected(graph) if tuple(comp) not in skip]


# Circles another branch removes, each with what removes it; the test fails when one is no longer found,
# so that its entry goes when that branch merges. retrace.serve.cli imports build_runtime and
# runtime_options from retrace.cli, which registers the serve command: the `opts` branch moves both into
# retrace/cli_options.py (click only), which both commands import.
PENDING: dict[tuple[str, ...], str] = {}  # circles known and being removed elsewhere (none)


def test_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 100, "the walk found too few modules: is ROOT right?"
    cycles = describe_cycles(graph, skip=PENDING)
    assert not cycles, "import circles (function-level imports included):\n" + "\n".join(cycles)
    found = {tuple(comp) for comp in strongly_connected(graph)}
    gone = [f"{' <-> '.join(k)} ({why})" for k, why in PENDING.items() if k not in found]
    assert not gone, "these circles are gone: remove them from PENDING in this test: " + "; ".join(gone)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_walk_finds_a_circle_hidden_in_a_function(tmp_path):
    """The checker itself: a function-level, relative `from . import` circle is found and named."""
    _write(tmp_path, {
        "retrace/__init__.py": "",
        "retrace/a/__init__.py": "from retrace.a.b import thing\n",  # a package re-export: not a circle
        "retrace/a/b.py": "from .c import helper\nthing = 1\n",
        "retrace/a/c.py": "def helper():\n    from . import b\n    return b\n",
        "retrace/d.py": "import os\nfrom retrace.a import b\n",
    })
    graph = import_graph(tmp_path)
    assert graph["retrace.a.b"] == {"retrace.a.c"}
    assert graph["retrace.a.c"] == {"retrace.a.b"}
    assert graph["retrace.d"] == {"retrace.a.b"}  # `from retrace.a import b` names the module a.b
    assert graph["retrace.a"] == {"retrace.a.b"}
    assert describe_cycles(graph) == [
        "retrace.a.b -> retrace.a.c -> retrace.a.b (component: retrace.a.b, retrace.a.c)"]


def test_walk_maps_names_to_their_module(tmp_path):
    """`from pkg import name` where name is not a module points at pkg; `import a.b.C` at a.b."""
    _write(tmp_path, {
        "retrace/__init__.py": "",
        "retrace/p/__init__.py": "from retrace.p.q import X\n",
        "retrace/p/q.py": "X = 1\n",
        "retrace/r.py": "from retrace.p import X\nimport retrace.p.q.X\n",
    })
    graph = import_graph(tmp_path)
    assert graph["retrace.r"] == {"retrace.p", "retrace.p.q"}


@pytest.mark.parametrize("src, expected", [
    ("from . import x", "retrace.pkg"),
    ("from .. import x", "retrace"),
    ("from .m import x", "retrace.pkg.m"),
])
def test_relative_imports_resolve(src, expected):
    """Relative levels count from the importing module's package (a package's own for ``__init__``)."""
    node = ast.parse(src).body[0]
    assert _resolve(node, "retrace.pkg.mod", is_package=False) == expected
    assert _resolve(node, "retrace.pkg", is_package=True) == expected


def test_a_longer_circle_is_named_in_import_order():
    graph = {"m.a": {"m.b"}, "m.b": {"m.c"}, "m.c": {"m.a", "m.d"}, "m.d": set(), "m.e": {"m.a"}}
    assert describe_cycles(graph) == ["m.a -> m.b -> m.c -> m.a (component: m.a, m.b, m.c)"]
    assert describe_cycles(graph, skip={("m.a", "m.b", "m.c"): "elsewhere"}) == []
