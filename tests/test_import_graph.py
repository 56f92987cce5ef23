"""The package's import graph, read from the source (ast, nothing imported): no import cycle between
modules, no import from a higher layer into a lower one, no private name (`_x`) imported from another
module, and few imports inside functions, each saying why it is there (docs/architecture.md,
"Layers"). Imports inside functions count as edges like any other: hiding one in a function does not
take it out of the graph."""
from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from collections import defaultdict
from typing import Dict, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# {folder: the package it installs as}: the zoo's folder models/ is moetrain.models (setup.py)
PACKAGES = {"moetrain": "moetrain", "models": "moetrain.models"}

# The layers, lowest first. A module may import modules of its own layer (without a cycle) and of the
# layers below. Each entry is a module or a package (its modules); the longest entry that names a
# module decides its layer. The same order is written down in docs/architecture.md ("Layers").
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("base", ("moetrain", "moetrain.compat", "moetrain.errors", "moetrain.env", "moetrain.family", "moetrain.fileio", "moetrain.layout", "moetrain.devices",
              "moetrain.kernels")),
    ("data, config", ("moetrain.data", "moetrain.registry", "moetrain.config")),
    ("primitives", ("moetrain.distributed", "moetrain.testing", "moetrain.faults", "moetrain.param_init", "moetrain.layers", "moetrain.modeling",
                    "moetrain.kv_cache", "moetrain.optim", "moetrain.logger")),
    ("moe", ("moetrain.moe",)),
    ("models", ("moetrain.models",)),
    ("parallel", ("moetrain.parallel",)),
    ("checkpoint", ("moetrain.checkpoint",)),
    ("build, planner", ("moetrain.build", "moetrain.planner")),
    ("trainer", ("moetrain.trainer",)),
    ("commands", ("moetrain.evaluate", "moetrain.forward", "moetrain.generate", "moetrain.cli")),
]

# Issue 31: 116 imports inside functions when it was filed; at most half of that remain, each with a
# comment saying why (an optional dependency, or a heavy import kept off the start-up path).
MAX_IN_FUNCTION = 58


def package_modules(root: str = ROOT) -> Dict[str, str]:
    """Dotted module name -> file, for every module of `PACKAGES`."""
    found = {}
    for top, package in PACKAGES.items():
        for folder, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    inside = os.path.relpath(path, os.path.join(root, top))[:-3].replace(os.sep, ".")
                    module = package + "." + inside
                    found[module[:-len(".__init__")] if module.endswith(".__init__") else module] = path
    return found


class Import:
    """One import statement's edge to a module of the packages."""

    def __init__(self, importer: str, target: str, name: str, line: int, in_function: bool):
        self.importer, self.target, self.name, self.line, self.in_function = importer, target, name, line, in_function

    def where(self) -> str:
        return f"{self.importer}:{self.line}"


def read_imports(modules: Dict[str, str]) -> Tuple[List[Import], List[Tuple[str, int, str, str]]]:
    """`(edges to package modules, in-function imports)`: the second lists `(module, line, statement,
    source line)` for every import inside a function, of any module (standard library included)."""
    edges, in_function = [], []
    for module, path in sorted(modules.items()):
        with open(path) as fh:
            source = fh.read()
        lines = source.splitlines()
        tree = ast.parse(source, path)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

        def inside_function(node) -> bool:
            while node in parents:
                node = parents[node]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    return True
            return False

        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(alias.name, "") for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                # `from pkg import sub` imports the module pkg.sub; `from mod import name` a name of mod
                targets = [(f"{base}.{alias.name}", "") if f"{base}.{alias.name}" in modules else (base, alias.name)
                           for alias in node.names]
            else:
                continue
            nested = inside_function(node)
            if nested:
                in_function.append((module, node.lineno, ast.unparse(node), lines))
            for target, name in targets:
                while target and target not in modules:       # a.b.c -> the module a.b that holds it
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.append(Import(module, target, name, node.lineno, nested))
    return edges, in_function


def layer_of(module: str) -> int:
    best, layer = -1, None
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            exact_only = entry == "moetrain"       # the root package's __init__, not everything under it
            if module == entry or (not exact_only and module.startswith(entry + ".")):
                if len(entry) > best:
                    best, layer = len(entry), index
    if layer is None:
        raise AssertionError(f"module {module} is in no layer: add it to LAYERS in tests/test_import_graph.py "
                             f"and to docs/architecture.md")
    return layer


def find_cycles(edges: List[Import]) -> List[List[str]]:
    """One cycle (a list of modules, first repeated at the end) per strongly connected component."""
    graph: Dict[str, Set[str]] = defaultdict(set)
    for edge in edges:
        graph[edge.importer].add(edge.target)
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v: str) -> None:       # Tarjan; the package has ~100 modules, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(list(graph)):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:       # a shortest way back to the start, inside the component
        start = min(component)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            if start in graph[path[-1]] and len(path) > 1:
                cycles.append(path + [start])
                break
            for w in sorted(graph[path[-1]] & component):
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return cycles


def has_reason(lines: List[str], line: int) -> bool:
    """A comment on the import's line, or on the line above its block of imports."""
    if "#" in lines[line - 1]:
        return True
    above = line - 2
    while above >= 0 and lines[above].strip().startswith(("import ", "from ")):
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


@functools.lru_cache(maxsize=None)     # parsed once for the four checks
def graph():
    modules = package_modules()
    return modules, *read_imports(modules)


def describe(edge: Import) -> str:
    return f"{edge.where()} imports {edge.target}{' (in a function)' if edge.in_function else ''}"


# ---------------------------------------------------------------------------------------------
def test_no_import_cycle():
    _, edges, _ = graph()
    cycles = find_cycles(edges)
    detail = []
    for cycle in cycles:
        hops = []
        for a, b in zip(cycle, cycle[1:]):
            edge = next(e for e in edges if e.importer == a and e.target == b)
            hops.append(describe(edge))
        detail.append(" -> ".join(cycle) + "\n      " + "\n      ".join(hops))
    assert not cycles, f"{len(cycles)} import cycle(s):\n  " + "\n  ".join(detail)


def test_no_upward_import():
    modules, edges, _ = graph()
    upward = [edge for edge in edges if layer_of(edge.target) > layer_of(edge.importer)]
    lines = dict.fromkeys(f"{describe(e)}: layer '{LAYERS[layer_of(e.importer)][0]}' below "
                          f"'{LAYERS[layer_of(e.target)][0]}'" for e in upward)     # one line per statement
    assert not upward, "imports from a higher layer (tests/test_import_graph.py LAYERS):\n  " + "\n  ".join(lines)


def test_no_private_name_across_modules():
    _, edges, _ = graph()
    private = [e for e in edges if e.name.startswith("_") and not e.name.startswith("__")]
    assert not private, "private names imported from another module (make them public, or keep them home):\n  " + \
        "\n  ".join(f"{e.where()} imports {e.target}.{e.name}" for e in private)


def test_few_in_function_imports_each_with_a_reason():
    _, _, nested = graph()
    unexplained = [f"{module}:{line} {statement}" for module, line, statement, lines in nested
                   if not has_reason(lines, line)]
    assert len(nested) <= MAX_IN_FUNCTION, (
        f"{len(nested)} imports inside functions (at most {MAX_IN_FUNCTION}): import at module level unless the "
        f"import is optional or heavy and off the start-up path")
    assert not unexplained, ("imports inside functions without a comment saying why (on the line, or above the "
                             "block):\n  " + "\n  ".join(unexplained))


def test_the_checks_see_what_they_check(tmp_path):
    """The walker on a made-up package: a cycle through an in-function import, an upward import, a
    private name and an unexplained in-function import are all found."""
    pkg = tmp_path / "moetrain"
    (pkg / "parallel").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "layout.py").write_text("def f():\n    from moetrain.parallel import runner\n")
    (pkg / "parallel" / "__init__.py").write_text("")
    (pkg / "parallel" / "runner.py").write_text("from moetrain.layout import _hidden\nfrom . import other\n")
    (pkg / "parallel" / "other.py").write_text("import os\n\n\ndef g():\n    # optional\n    import json\n")
    (tmp_path / "models" / "toy").mkdir(parents=True)     # the zoo's folder is the package moetrain.models
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "toy" / "__init__.py").write_text("from .model import Toy\n")
    (tmp_path / "models" / "toy" / "model.py").write_text("from moetrain.layout import ModelShape\n")
    modules = package_modules(str(tmp_path))
    assert {"moetrain.models", "moetrain.models.toy", "moetrain.models.toy.model"} <= set(modules)
    edges, nested = read_imports(modules)
    assert ("moetrain.models.toy", "moetrain.models.toy.model") in [(e.importer, e.target) for e in edges]
    edges = [e for e in edges if not e.importer.startswith("moetrain.models")]
    assert find_cycles(edges) == [["moetrain.layout", "moetrain.parallel.runner", "moetrain.layout"]]
    assert [(e.importer, e.target) for e in edges if layer_of(e.target) > layer_of(e.importer)] == \
        [("moetrain.layout", "moetrain.parallel.runner")]
    assert [(e.importer, e.name) for e in edges if e.name.startswith("_")] == [("moetrain.parallel.runner", "_hidden")]
    assert ("moetrain.parallel.runner", "moetrain.parallel.other") in [(e.importer, e.target) for e in edges]
    assert [(m, line, has_reason(lines, line)) for m, line, _, lines in nested] == \
        [("moetrain.layout", 2, False), ("moetrain.parallel.other", 6, True)]


def test_the_zoo_installs_inside_the_package(tmp_path):
    """The folder models/ is the package `moetrain.models` (setup.py), never a top-level `models` that
    would collide with another on a user's path: seen from a folder outside the repository."""
    probe = ("import importlib.util as u, os; spec = u.find_spec('moetrain.models.gpt'); "
             "print(os.path.dirname(os.path.dirname(spec.origin))); print(u.find_spec('models'))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=str(tmp_path), env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    zoo, top_level = out.stdout.split("\n")[:2]
    assert os.path.basename(zoo) == "models" and top_level == "None", out.stdout    # editable: ROOT/models


SLICE_KERNEL_CALLS = ("ops.slice(", "ops.narrow(", "ops.Slice(", "P.Slice(")


def slice_kernel_calls(modules: Dict[str, str]) -> List[str]:
    """Where the package calls MindSpore's `Slice` kernel."""
    found = []
    for module, path in sorted(modules.items()):
        with open(path) as fh:
            for number, line in enumerate(fh, 1):
                code = line.split("#", 1)[0]
                found += [f"{module}:{number} {call}" for call in SLICE_KERNEL_CALLS if call in code]
    return found


def test_no_slice_kernel_where_a_tensor_may_pass_2_gib(tmp_path):
    """MindSpore 2.10's CPU Slice kernel refuses inputs over 2**31 - 1 bytes (the 671B head's 3.7 GB
    gradient, sliced in column pieces by ZeRO-2, stopped its dry run: docs/parallel_engine.md); the
    package slices with `x[a:b]` (StridedSlice), which takes them. The scan sees a call it is shown."""
    assert not slice_kernel_calls(package_modules()), slice_kernel_calls(package_modules())
    planted = tmp_path / "moetrain" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("def f(x, ops):\n    return ops.slice(x, (0,), (2,))  # a piece\n")
    assert slice_kernel_calls(package_modules(str(tmp_path))) == ["moetrain.planted:2 ops.slice("]
