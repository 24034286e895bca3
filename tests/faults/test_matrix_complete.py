"""Every case of the matrix has exactly one test that records it, and no test records a
case the matrix does not list (read from the source, so it holds without running them)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.faults.cases import BY_ID, CASES

HERE = Path(__file__).parent


def recorded_case_ids() -> Counter[str]:
    found: Counter[str] = Counter()
    for path in sorted(HERE.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "record_fault"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found[str(node.args[0].value)] += 1
    return found


def test_case_ids_are_unique() -> None:
    assert len(BY_ID) == len(CASES)


def test_every_case_has_one_test_and_every_test_a_case() -> None:
    found = recorded_case_ids()
    missing = sorted(set(BY_ID) - set(found))
    unknown = sorted(set(found) - set(BY_ID))
    twice = sorted(case for case, n in found.items() if n > 1)
    assert not missing, f"cases without a test: {missing}"
    assert not unknown, f"tests record cases not in tests/faults/cases.py: {unknown}"
    assert not twice, f"cases recorded by more than one test: {twice}"


def test_the_reliability_doc_has_a_row_for_every_case() -> None:
    """docs/reliability.md's table comes from tests/faults/report.py: regenerate it when a
    case is added or renamed."""
    doc = (HERE.parents[1] / "docs" / "reliability.md").read_text()
    table = doc.partition("<!-- fault-matrix:begin -->")[2].partition("<!-- fault-matrix:end -->")[
        0
    ]
    missing = [c.fault for c in CASES if f"| {c.area} | {c.fault} |" not in table]
    assert not missing, f"run python tests/faults/report.py; rows missing for {missing}"
