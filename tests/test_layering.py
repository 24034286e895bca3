"""Data flows one way (docs: /work/shared/DESIGN.md, CONTRIBUTING.md): the imports say so.

Every ``import`` in exporter/ is read with ``ast`` (also those inside functions and under
``TYPE_CHECKING``), relative imports resolved, and held to these rules:

- ``exporter.analysis.*`` imports only ``exporter.model`` and ``exporter.analysis``;
- ``exporter.sources.*`` imports only ``exporter.model``, its own package
  (``exporter.sources.*``: base, backoff, threaded, ...), the neutral ``exporter.text``
  and the kubelet's protocol ``exporter.kubelet_api``;
- ``exporter.config`` imports neither ``exporter.sim`` nor ``exporter.sources``;
- ``exporter.sim`` is the node outside the exporter: it imports only ``exporter.model``,
  ``exporter.kubelet_api`` (the protocol its kubelet serves) and itself;
- ``exporter.reporting.*`` (Events, the node condition, device taints) imports only
  ``exporter.model``, ``exporter.analysis`` (pure), ``exporter.text``, itself and the
  bounded HTTP of ``exporter.sources.kube_http``;
- nothing in exporter/ but ``exporter.cli`` (and the simulator itself) imports
  ``exporter.sim``.

A violation reads ``file:line imports X``. A violation that cannot be fixed at once
goes into ``KNOWN`` with the reason; once the import is gone, the test that checks the
table fails until its entry is deleted too.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
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


RULES = [
    Rule(
        "analysis imports only model",
        lambda m: _within(m, "exporter.analysis"),
        _only("exporter.model", "exporter.analysis"),
    ),
    Rule(
        "sources import only model, sources, text and the kubelet API",
        lambda m: _within(m, "exporter.sources"),
        _only("exporter.model", "exporter.sources", "exporter.text", "exporter.kubelet_api"),
    ),
    Rule(
        "config imports neither sim nor sources",
        lambda m: m == "exporter.config",
        lambda _m, t: not (_within(t, "exporter.sim") or _within(t, "exporter.sources")),
    ),
    Rule(
        "sim imports only model, sim and the kubelet API",
        lambda m: _within(m, "exporter.sim"),
        _only("exporter.model", "exporter.sim", "exporter.kubelet_api"),
    ),
    Rule(
        "reporting (writes to Kubernetes) imports only model, analysis, text, itself and "
        "the watches' bounded HTTP",
        lambda m: _within(m, "exporter.reporting"),
        _only(
            "exporter.model",
            "exporter.analysis",
            "exporter.text",
            "exporter.reporting",
            "exporter.sources.kube_http",
        ),
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
