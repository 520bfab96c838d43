"""No import circles between the files of ``engine/``.

The graph counts every ``import``/``from ... import`` in a file, at module level and inside
functions alike (a lazy import hides a circle from Python, not from a reader), with relative
imports resolved and ``from pkg import name`` taken as an import of the submodule ``pkg.name``
when that is a module, else of ``pkg``. A package's ``__init__`` importing its own submodules
is an edge like any other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root/package``, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that the module ``name`` imports, anywhere in it."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()

    def owner(dotted: str) -> str | None:
        # the longest prefix of ``dotted`` that is one of our modules
        parts = dotted.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in modules:
                return candidate
            parts.pop()
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (m := owner(alias.name)) is not None:
                    found.add(m)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else list(here)
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            for alias in node.names:
                sub = f"{base_name}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif (m := owner(base_name)) is not None:
                    found.add(m)
    found.discard(name)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = module_names(root, package)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = _imports(tree, name, path.name == "__init__.py", modules)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative, sorted for stable output)."""
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
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return sorted(out)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, as a path that ends where it began."""
    inside = set(component)
    start = component[0]
    # breadth-first from start back to start, within the component
    paths = {m: [start, m] for m in sorted(graph[start] & inside)}
    frontier = list(paths)
    seen = set(frontier)
    while start not in paths:
        nxt = []
        for m in frontier:
            for n in sorted(graph[m] & inside):
                if n == start:
                    return paths[m] + [start]
                if n not in seen:
                    seen.add(n)
                    paths[n] = paths[m] + [n]
                    nxt.append(n)
        frontier = nxt
    return paths[start]


def describe_cycles(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{{{', '.join(c)}}}: {' -> '.join(cycle_path(graph, c))}"
        for c in strongly_connected(graph)
    ]


def test_engine_has_no_import_circles():
    graph = import_graph(ROOT, "engine")
    assert len(graph) > 50 and graph["engine"], "the graph should see engine's modules"
    cycles = describe_cycles(graph)
    for line in cycles:
        print(line)
    assert not cycles, "import circles in engine/:\n" + "\n".join(cycles)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_graph_finds_a_circle_made_of_lazy_and_relative_imports(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import thing\n",
            "pkg/a.py": "def thing():\n    from .sub import b\n    return b\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "def f():\n    from ..c import g\n",
            "pkg/c.py": "import os\n\ndef g():\n    import pkg.a\n",
            "pkg/d.py": "from pkg import c\nfrom pkg.sub import nothing\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.c", "pkg.sub"}
    assert strongly_connected(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert describe_cycles(graph) == [
        "{pkg.a, pkg.c, pkg.sub.b}: pkg.a -> pkg.sub.b -> pkg.c -> pkg.a"
    ]


def test_graph_of_files_without_circles_is_clean(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import x\n",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "import json\n",
        },
    )
    assert strongly_connected(import_graph(tmp_path, "pkg")) == []
