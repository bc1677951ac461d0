"""The maxmoe package's imports go downward through the layers maxmoe/__init__.py draws, and its
import graph has no cycle, counting imports inside functions too.

A cycle works only while every module in it happens to import the others' names late; one
import moved to the top of a file then breaks at start-up. An upward import is a cycle waiting
to happen and makes the layers impossible to draw. The graph is read with `ast`, so this test
imports nothing it checks.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections import deque
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "maxmoe"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of `package` (a package is its __init__.py)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _known(name: str, modules) -> str | None:
    """`name`, else its longest dotted prefix that is a module of ours, else None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(source: str, module: str, is_package: bool, modules) -> dict[str, int]:
    """The modules of ours that `module` imports anywhere in `source` (top level, functions,
    classes) -> the line of the first such import. `from a.b import c` counts as `a.b.c` when
    that is a module, else as `a.b`; relative imports are resolved against `module`."""
    found: dict[str, int] = {}
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [_known(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [_known(f"{base}.{alias.name}", modules) or _known(base, modules)
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target is not None and target != module:
                found.setdefault(target, node.lineno)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """Module -> {imported module of ours: line} for every module of `package`."""
    modules = module_names(package)
    return {name: imports_of(path.read_text(), name, path.name == "__init__.py", modules)
            for name, path in modules.items()}


def cycles(graph) -> list[list[str]]:
    """One cycle [a, b, ..., a] per strongly connected component of `graph` (node -> iterable
    of nodes) that has one, each as short as a breadth-first search from its smallest node
    finds; [] when the graph is acyclic. Tarjan's algorithm, iterative."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        components.append(component)
    found = []
    for component in components:
        start = min(component)
        parent, queue = {start: None}, deque([start])
        while queue:
            node = queue.popleft()
            if start in graph.get(node, ()):
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                found.append([*reversed(path), start])
                break
            for succ in sorted(graph.get(node, ())):
                if succ in component and succ not in parent:
                    parent[succ] = node
                    queue.append(succ)
    return sorted(found)


def describe(cycle: list[str], graph, package: Path = PACKAGE) -> str:
    """`a -> b (a's file:line) -> ... -> a`: where each import of the cycle is."""
    files = module_names(package)
    steps = [cycle[0]]
    for a, b in itertools.pairwise(cycle):
        steps.append(f"{b} ({files[a].relative_to(package.parent)}:{graph[a][b]})")
    return " -> ".join(steps)


def test_cycle_finder_finds_every_cycle_and_only_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"a", "f"}, "f": {"e"},
             "g": {"g"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"], ["g", "g"]]


def test_imports_inside_functions_and_relative_imports_count():
    modules = {"maxmoe", "maxmoe.config", "maxmoe.malloc", "maxmoe.model", "maxmoe.model.layers",
               "maxmoe.model.rope", "maxmoe.sharding", "maxmoe.model.mla"}
    source = ("import os\nfrom maxmoe.config import ConfigError\n"
              "def f():\n    from maxmoe import malloc\n    import maxmoe.model.layers\n"
              "class C:\n    def g(self):\n        from . import rope\n"
              "        from ..sharding import shard\n")
    assert imports_of(source, "maxmoe.model.mla", False, modules) == {
        "maxmoe.config": 2, "maxmoe.malloc": 4, "maxmoe.model.layers": 5,
        "maxmoe.model.rope": 8, "maxmoe.sharding": 9}


def layers(package: Path = PACKAGE) -> list[str]:
    """The packages and top-level modules of the layer list in `package`'s __init__.py
    docstring, lowest first: its indented lines `    name   what it holds`."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    names = [m.group(1) for m in re.finditer(r"^    ([a-z_]+)  +\S", doc, re.MULTILINE)]
    return names[::-1]


def layer_of(module: str) -> str:
    """maxmoe.train.loop -> train; maxmoe.bench -> bench; maxmoe -> maxmoe."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph, order: list[str], files) -> list[str]:
    """`importer file:line imports module (layer a above layer b)` for each import of a module
    in a higher layer than its importer's; a module of no listed layer is reported as such."""
    rank = {name: i for i, name in enumerate(order)}
    rank["maxmoe"] = len(order)  # the package's own __init__ sits above everything
    found = [f"{files[m].relative_to(PACKAGE.parent)}: module of no layer ({layer_of(m)!r} is "
             "not in maxmoe/__init__.py's list)" for m in graph if layer_of(m) not in rank]
    for importer, targets in sorted(graph.items()):
        here = rank.get(layer_of(importer), -1)
        for target, line in sorted(targets.items()):
            there = rank.get(layer_of(target), -1)
            if there > here:
                found.append(f"{files[importer].relative_to(PACKAGE.parent)}:{line} imports "
                             f"{target} (layer {layer_of(target)} is above {layer_of(importer)})")
    return found


def name_lookups(source: str) -> list[int]:
    """Lines that import a module by its name at run time (importlib.import_module,
    __import__): such a lookup hides a dependency from the layer check."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Call) and (getattr(node.func, "attr", None)
                                                     or getattr(node.func, "id", None))
                  in ("import_module", "__import__"))


def test_layer_list_names_every_package_once():
    order = layers()
    assert len(order) == len(set(order)) and order[0] == "config" and order[-1] == "cli", order
    present = {layer_of(m) for m in module_names(PACKAGE)} - {"maxmoe"}
    assert present == set(order), (present - set(order), set(order) - present)


def test_imports_go_down_the_layers():
    """Every import of a maxmoe module, top-level or inside a function, is of its own package
    or a lower layer of maxmoe/__init__.py's list."""
    found = upward_imports(import_graph(), layers(), module_names(PACKAGE))
    assert not found, "imports that go up maxmoe's layers:\n" + "\n".join(found)


def test_upward_import_check_can_fail():
    graph = {"maxmoe.model.moe": {"maxmoe.train.step": 7, "maxmoe.config": 3},
             "maxmoe.train.step": {"maxmoe.model.moe": 2}, "maxmoe.nowhere": {}}
    files = {m: PACKAGE / Path(*m.split(".")[1:]).with_suffix(".py") for m in graph}
    assert upward_imports(graph, ["config", "model", "train"], files) == [
        "maxmoe/nowhere.py: module of no layer ('nowhere' is not in maxmoe/__init__.py's list)",
        "maxmoe/model/moe.py:7 imports maxmoe.train.step (layer train is above model)"]


def test_no_module_is_imported_by_name():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             for line in name_lookups(path.read_text())]
    assert not found, "modules imported by name (import them, so the layers show):\n" + \
        "\n".join(found)
    assert name_lookups("import importlib\nm = importlib.import_module('maxmoe.train')\n"
                        "n = __import__('os')\nimportlib.util.find_spec('wandb')\n") == [2, 3]


def test_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert "maxmoe.cli" in graph and graph["maxmoe.cli"], "the graph reads no imports"
    found = cycles(graph)
    assert not found, "import cycles in maxmoe:\n" + "\n".join(describe(c, graph) for c in found)


def unexplained_late_imports(source: str) -> list[int]:
    """Lines of imports inside functions that no comment explains. A run of consecutive import
    statements is one block: its first line, or the line above it, carries the comment."""
    lines = source.splitlines()
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        blocks = [getattr(n, field) for n in ast.walk(func) for field in ("body", "orelse")
                  if isinstance(getattr(n, field, None), list)]
        for block in blocks:  # the function's own body and every nested if/with/for body
            previous_was_import = False
            for node in block:
                is_import = isinstance(node, (ast.Import, ast.ImportFrom))
                if is_import and not previous_was_import:
                    here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                    if "#" not in here and not above.startswith("#"):
                        found.append(node.lineno)
                previous_was_import = is_import
    return sorted(set(found))


def test_late_imports_say_why():
    """Imports go at the top of a file; one inside a function defers a heavy import on purpose
    and says so (issue 29)."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for line in unexplained_late_imports(path.read_text())]
    assert not found, "imports inside functions with no comment saying why:\n" + "\n".join(found)


def test_late_import_check_can_fail():
    source = ("def f():\n    import json\n    return json\n\n"
              "def g():\n    # late: heavy\n    import jax\n    import numpy\n\n"
              "def h():\n    x = 1\n    import os  # late: why\n    import re\n    return x\n\n"
              "def k(a):\n    if a:\n        import sys\n")
    assert unexplained_late_imports(source) == [2, 18]
