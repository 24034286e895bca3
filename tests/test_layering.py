"""Data flows one way (CONTRIBUTING.md, "Layout: data flows one way"): the imports say so.

Every ``import`` in exporter/ is read with ``ast`` (also those inside functions and under
``TYPE_CHECKING``), relative imports resolved, and held to these rules:

- ``exporter.analysis.*`` imports only ``exporter.model`` and ``exporter.analysis``;
- ``exporter.sources.*`` imports only ``exporter.model``, its own package
  (``exporter.sources.*``: base, backoff, threaded, ...), the neutral ``exporter.text``
  and ``exporter.token_bucket``, and the kubelet's protocol ``exporter.kubelet_api``;
- ``exporter.config`` is a leaf: it imports only ``exporter.model`` (and the package, for
  its version), so parsing flags loads no analysis, exposition or prometheus_client;
- ``exporter.sim`` is the node outside the exporter: it imports only ``exporter.model``,
  ``exporter.kubelet_api`` (the protocol its kubelet serves) and itself;
- ``exporter.reporting.*`` (Events, the node condition, device taints) imports only
  ``exporter.model``, ``exporter.analysis`` (pure), the neutral ``exporter.text`` and
  ``exporter.token_bucket``, itself and the bounded HTTP of ``exporter.sources.kube_http``;
- the neutral helpers ``exporter.text`` and ``exporter.token_bucket`` import nothing
  from the exporter (any layer may import them);
- nothing in exporter/ but ``exporter.cli`` (and the simulator itself) imports
  ``exporter.sim``;
- no module of exporter/ imports itself back through others (no import cycle), counting
  imports inside functions and under ``TYPE_CHECKING`` too: an import moved into a
  function to get past a cycle still leaves the two modules needing each other.

A violation reads ``file:line imports X``. A violation that cannot be fixed at once
goes into ``KNOWN`` with the reason; once the import is gone, the test that checks the
table fails until its entry is deleted too.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "exporter"
GENERATED = ("api_pb2.py", "api_pb2_grpc.py")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. exporter.sources.nvml
    path: str  # relative to the repository root
    line: int
    target: str  # the imported module, resolved

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts
    }


MODULES = _modules()


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _imports(module: str, path: Path) -> Iterator[Import]:
    text = path.read_text(encoding="utf-8")
    return imports_in(text, module, str(path.relative_to(ROOT)), path.name == "__init__.py")


def imports_in(text: str, module: str, rel: str, is_package: bool = False) -> Iterator[Import]:
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(text, rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, rel, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                # ``from exporter.sources import nvml`` imports the module exporter.sources.nvml
                submodule = f"{source}.{alias.name}"
                yield Import(
                    module, rel, node.lineno, submodule if submodule in MODULES else source
                )


ALL_IMPORTS = [
    imp
    for module, path in MODULES.items()
    if path.name not in GENERATED  # protoc's output is not ours to layer
    for imp in _imports(module, path)
    if _within(imp.target, "exporter")
]


@dataclass(frozen=True)
class Rule:
    name: str
    applies: Callable[[str], bool]  # to the importing module
    allowed: Callable[[str, str], bool]  # (importing module, target)


def _only(*packages: str) -> Callable[[str, str], bool]:
    return lambda _module, target: any(_within(target, p) for p in packages)


# Helpers any layer may use: they import nothing from the exporter.
NEUTRAL = ("exporter.text", "exporter.token_bucket")

RULES = [
    Rule(
        "analysis imports only model",
        lambda m: _within(m, "exporter.analysis"),
        _only("exporter.model", "exporter.analysis"),
    ),
    Rule(
        "sources import only model, sources, the neutral helpers and the kubelet API",
        lambda m: _within(m, "exporter.sources"),
        _only("exporter.model", "exporter.sources", *NEUTRAL, "exporter.kubelet_api"),
    ),
    Rule(
        "config is a leaf: it imports only model",
        lambda m: m == "exporter.config",
        lambda _m, t: t == "exporter" or _within(t, "exporter.model"),
    ),
    Rule(
        "sim imports only model, sim and the kubelet API",
        lambda m: _within(m, "exporter.sim"),
        _only("exporter.model", "exporter.sim", "exporter.kubelet_api"),
    ),
    Rule(
        "reporting (writes to Kubernetes) imports only model, analysis, text, token_bucket, "
        "itself and the watches' bounded HTTP",
        lambda m: _within(m, "exporter.reporting"),
        _only(
            "exporter.model",
            "exporter.analysis",
            "exporter.text",
            "exporter.token_bucket",
            "exporter.reporting",
            "exporter.sources.kube_http",
        ),
    ),
    Rule(
        "the neutral helpers (text, token_bucket) import nothing from the exporter",
        lambda m: m in NEUTRAL,
        lambda _m, _t: False,
    ),
    Rule(
        "only cli imports sim",
        lambda m: not (m == "exporter.cli" or _within(m, "exporter.sim")),
        lambda _m, t: not _within(t, "exporter.sim"),
    ),
]

# (importing file, imported module) -> why it is still there. Delete an entry once fixed.
KNOWN: dict[tuple[str, str], str] = {}


def violations(rule: Rule) -> list[Import]:
    found = (
        imp
        for imp in ALL_IMPORTS
        if rule.applies(imp.module) and not rule.allowed(imp.module, imp.target)
    )
    return list(dict.fromkeys(found))  # one line per (file, line, module)


def import_cycles(imports: Iterable[Import]) -> list[list[Import]]:
    """One cycle per strongly connected group of modules (Tarjan's algorithm over the
    graph importing module -> imported module), each as the imports that close it,
    starting at the group's first module by name. A module naming itself is no cycle."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if imp.target != imp.module:
            edges.setdefault(imp.module, {}).setdefault(imp.target, imp)
    groups = _strongly_connected(edges)
    return [_cycle_through(sorted(group), edges) for group in groups if len(group) > 1]


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's strongly connected components, without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges.get(target, {})))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                groups.append(group)
    return groups


def _cycle_through(group: list[str], edges: dict[str, dict[str, Import]]) -> list[Import]:
    """The shortest way from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    came_by: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for module in frontier:
            for target, imp in sorted(edges.get(module, {}).items()):
                if target == start:
                    path = [imp]
                    while path[0].module != start:
                        path.insert(0, came_by[path[0].module])
                    return path
                if target in members and target not in came_by:
                    came_by[target] = imp
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected group but on no cycle")


def test_the_scan_sees_relative_imports_and_imports_inside_functions() -> None:
    text = (
        "from . import nvml\n"
        "from ..model import GpuSample\n"
        "def f():\n"
        "    import exporter.sim.scenario\n"
        "    from exporter.sources import nothing_such\n"
    )
    found = list(imports_in(text, "exporter.sources.example", "exporter/sources/example.py"))
    assert [str(i) for i in found] == [
        "exporter/sources/example.py:1 imports exporter.sources.nvml",
        "exporter/sources/example.py:2 imports exporter.model",
        "exporter/sources/example.py:4 imports exporter.sim.scenario",
        "exporter/sources/example.py:5 imports exporter.sources",
    ]
    rule = next(r for r in RULES if r.name.startswith("sources"))
    assert [rule.allowed("exporter.sources.example", i.target) for i in found] == [
        True,
        True,
        False,
        True,
    ]


def test_the_scan_reads_the_whole_package() -> None:
    assert {"exporter.cli", "exporter.sources.nvml", "exporter.analysis.pipeline"} <= set(MODULES)
    assert any(
        i.module == "exporter.cli" and _within(i.target, "exporter.sim") for i in ALL_IMPORTS
    )


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_layering(rule: Rule) -> None:
    found = [v for v in violations(rule) if (v.path, v.target) not in KNOWN]
    assert not found, f"{rule.name}:\n  " + "\n  ".join(map(str, found))


def test_known_violations_are_still_there() -> None:
    """A fixed violation must leave ``KNOWN`` too, or the table would hide a new one."""
    present = {(imp.path, imp.target) for rule in RULES for imp in violations(rule)}
    fixed = [f"{path} -> {target}" for path, target in KNOWN if (path, target) not in present]
    assert not fixed, "no longer imported; delete from KNOWN: " + ", ".join(fixed)


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    """Three synthetic modules that need each other (one at the top, one inside a
    function, one under TYPE_CHECKING) beside two that do not: one cycle, in order."""
    modules = {
        "exporter.planted.a": "from exporter.planted.b import B\nimport exporter.planted.leaf\n",
        "exporter.planted.b": "def f():\n    from exporter.planted.c import C\n",
        "exporter.planted.c": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from exporter.planted.a import A\n"
        ),
        "exporter.planted.leaf": "import exporter.planted.leaf\n",  # itself: no cycle
        "exporter.planted.alone": "from exporter.planted.a import A\n",
    }
    found = [
        imp
        for module, text in modules.items()
        for imp in imports_in(text, module, module.replace(".", "/") + ".py")
    ]
    assert [[str(i) for i in cycle] for cycle in import_cycles(found)] == [
        [
            "exporter/planted/a.py:1 imports exporter.planted.b",
            "exporter/planted/b.py:2 imports exporter.planted.c",
            "exporter/planted/c.py:3 imports exporter.planted.a",
        ]
    ]
    without_the_function_import = [i for i in found if i.module != "exporter.planted.b"]
    assert import_cycles(without_the_function_import) == []


def test_no_import_cycles_in_exporter() -> None:
    found = import_cycles(i for i in ALL_IMPORTS if i.target in MODULES)
    assert not found, "import cycles (move what both need into a module of its own):\n  " + (
        "\n  ".join(" -> ".join(map(str, cycle)) for cycle in found)
    )


def test_importing_config_loads_no_exporter_module_outside_model() -> None:
    """What the rule above means at run time: a fresh interpreter, ``import exporter.config``."""
    import subprocess
    import sys

    code = (
        "import sys, exporter.config\n"
        "print(sorted(m for m in sys.modules if m.startswith('exporter')\n"
        "             and not m.startswith('exporter.model')))\n"
        "print('prometheus_client' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.splitlines()
    assert out == ["['exporter', 'exporter.config']", "False"]
