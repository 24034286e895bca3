"""docs/install.md's compatibility table stays true: each row names the tests that hold
it, and each of those tests exists (a renamed or deleted test fails here, not silently)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "docs" / "install.md"
COMPONENTS = {"Kubernetes", "NVIDIA GPU Operator", "NVIDIA driver", "GPU", "DCGM", "GKE", "Helm"}


def table() -> list[list[str]]:
    text = INSTALL.read_text()
    section = text.split("## Compatibility\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def defined_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.update(re.findall(r"^(?:async )?def (test_\w+)\(", path.read_text(), re.M))
    return names


def test_the_table_has_every_component_with_a_minimum_and_a_test() -> None:
    rows = table()
    assert {r[0] for r in rows} == COMPONENTS
    for component, minimum, lost, _source, tests in rows:
        assert minimum and lost and tests, component


def test_every_test_a_row_names_exists() -> None:
    known = defined_tests()
    for row in table():
        named = re.findall(r"`(test_\w+)`", row[-1])
        assert named, row[0]
        missing = [name for name in named if name not in known]
        assert not missing, f"{row[0]}: {missing}"


def test_the_kubernetes_minimum_is_the_one_the_chart_is_validated_against() -> None:
    from tests.test_helm_chart import KUBE_VERSIONS

    (kubernetes,) = [r for r in table() if r[0] == "Kubernetes"]
    assert kubernetes[1] == KUBE_VERSIONS[0]
