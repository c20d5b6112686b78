"""The package's imports only point down DESIGN.md's layer list, never in a circle, and never from inside a
function; read from the source with `ast`, nothing imported."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

import pytest

PACKAGE = "glm5next"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)

LAYERS = ("config", "forward", "checkpoint", "kernels", "parallel", "model", "specialized_decode", "runtime",
          "server", "bench", "cli")
"""DESIGN.md's layout, bottom first: a module may import its own layer's modules and those below it. The
kernels sit below the model and the parallel layers: the stock modules call them on CUDA (the MoE's eager
path, the FP8 linears' widening), and a kernel's reference never imports the model."""

SAME_LAYER = {"tokenizer": "config", "__init__": "cli"}
"""Top-level modules DESIGN.md's list does not name, and the layer they belong to: the tokenizer is a leaf
like the config; the package root is the public facade (`from glm5next import LLM`) above everything."""

UPWARD_ALLOWED: set[tuple[str, str]] = set()
"""Upward imports that stay for now, each with its reason (none)."""

LAZY_ALLOWED = {("glm5next/__init__.py", "glm5next.runtime.engine")}
"""The function-local project imports that stay, each for a reason: the package root resolves `LLM` and
`SamplingParams` on first use (PEP 562), since importing any submodule runs the package root first and an
eager import would load the whole engine for `import glm5next.config`."""


@dataclass(frozen=True)
class Problem:
    """One broken rule: where (file:line) and what."""

    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def layer_of(module: str) -> int:
    """The rank in LAYERS of a dotted project module name (`glm5next.model.kda` -> rank of model)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return LAYERS.index(SAME_LAYER.get(top, top))


def module_name(relpath: str) -> str:
    """The dotted module name of a file path relative to the package's parent (`glm5next/model/kda.py`)."""
    parts = relpath[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(node: ast.ImportFrom | ast.Import, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The project modules one import statement loads (empty for other packages): `from .x import y` names
    module `x.y` where that is a module, else `x`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == PACKAGE or a.name.startswith(PACKAGE + ".")]
    if node.level:
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
        return []
    found = []
    for a in node.names:
        sub = f"{target}.{a.name}"
        found.append(sub if sub in modules else target)
    return sorted(set(found))


def _local_import_nodes(tree: ast.Module):
    """The import statements inside functions (at any depth)."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield node


def check_sources(sources: dict[str, str]) -> list[Problem]:
    """Every broken rule in `sources` ({path relative to the package's parent: source text})."""
    modules = {module_name(p) for p in sources}
    problems: list[Problem] = []
    edges: dict[str, dict[str, str]] = {m: {} for m in modules}  # importer -> {imported: where}
    for path, text in sorted(sources.items()):
        tree = ast.parse(text, filename=path)
        me = module_name(path)
        is_package = path.endswith("__init__.py")
        local = {id(n) for n in _local_import_nodes(tree)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            where = f"{path}:{node.lineno}"
            for target in resolve(node, me, is_package, modules):
                if id(node) in local:
                    if (path, target) not in LAZY_ALLOWED:
                        problems.append(Problem(where, f"function-local import of project module {target}"))
                    continue
                if layer_of(target) > layer_of(me) and (me, target) not in UPWARD_ALLOWED:
                    problems.append(Problem(where, f"upward import: {me} ({LAYERS[layer_of(me)]}) imports "
                                                   f"{target} ({LAYERS[layer_of(target)]})"))
                if target != me and target in modules:
                    edges[me].setdefault(target, where)
    problems += _cycles(edges)
    return problems


def _cycles(edges: dict[str, dict[str, str]]) -> list[Problem]:
    """One problem per import cycle between modules, naming each import along it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    problems = []
    for comp in components:
        members = set(comp)
        links = [f"{a} -> {b} ({edges[a][b]})" for a in comp for b in sorted(edges[a]) if b in members]
        problems.append(Problem(edges[comp[0]][next(b for b in sorted(edges[comp[0]]) if b in members)],
                                "import cycle: " + "; ".join(links)))
    return problems


def package_sources() -> dict[str, str]:
    """Every module of the package: {path relative to the package's parent: source}."""
    out = {}
    parent = os.path.dirname(ROOT)
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                full = os.path.join(dirpath, f)
                with open(full, encoding="utf-8") as fh:
                    out[os.path.relpath(full, parent).replace(os.sep, "/")] = fh.read()
    return out


def test_package_imports_point_down_without_cycles_or_local_imports():
    problems = check_sources(package_sources())
    assert not problems, "\n" + "\n".join(map(str, problems))


def test_every_top_level_module_has_a_layer():
    for path in package_sources():
        layer_of(module_name(path))  # raises ValueError for a module DESIGN.md's list does not place


@pytest.mark.parametrize("source, path, expected", [
    pytest.param("from ..runtime.cache import KVCache\n", "glm5next/model/kda.py",
                 "upward import: glm5next.model.kda (model) imports glm5next.runtime.cache (runtime)",
                 id="relative-upward"),
    pytest.param("import glm5next.server.api\n", "glm5next/kernels/pdl.py",
                 "upward import: glm5next.kernels.pdl (kernels) imports glm5next.server.api (server)",
                 id="absolute-upward"),
    pytest.param("from ...model.norm import rms_norm\n", "glm5next/kernels/linear/reference.py",
                 "upward import: glm5next.kernels.linear.reference (kernels) imports glm5next.model.norm (model)",
                 id="kernel-imports-model"),
    pytest.param("def f():\n    from ..config import Glm5NextConfig\n", "glm5next/model/kda.py",
                 "function-local import of project module glm5next.config", id="local-import"),
])
def test_checker_flags_counter_examples(source, path, expected):
    sources = {"glm5next/__init__.py": "", "glm5next/config.py": "", "glm5next/model/__init__.py": "",
               "glm5next/runtime/__init__.py": "", "glm5next/runtime/cache.py": "",
               "glm5next/kernels/__init__.py": "", "glm5next/server/__init__.py": "",
               "glm5next/server/api.py": "", "glm5next/model/norm.py": "", "glm5next/kernels/linear/__init__.py": "",
               path: source}
    problems = check_sources(sources)
    line = 2 if source.startswith("def") else 1
    assert [str(p) for p in problems] == [f"{path}:{line}: {expected}"]


def test_checker_flags_a_cycle_within_a_layer():
    sources = {"glm5next/__init__.py": "", "glm5next/model/__init__.py": "",
               "glm5next/model/a.py": "from . import b\n", "glm5next/model/b.py": "\nfrom .a import f\n"}
    problems = check_sources(sources)
    assert len(problems) == 1 and "import cycle" in problems[0].what
    assert "glm5next/model/a.py:1" in problems[0].what and "glm5next/model/b.py:2" in problems[0].what


def test_checker_accepts_downward_and_optional_local_imports():
    sources = {"glm5next/__init__.py": "", "glm5next/config.py": "", "glm5next/model/__init__.py": "",
               "glm5next/model/kda.py": "from ..config import X\nimport torch\ndef f():\n    import fla\n"}
    assert check_sources(sources) == []
