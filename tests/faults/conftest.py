"""``record_fault``: how a fault test reports what it measured.

A test calls ``record_fault(case_id, expected=..., figure=...)`` once, after its
assertions pass: ``expected`` is the behaviour it asserted (one sentence, as it should
read in docs/reliability.md) and ``figure`` what it measured (time to recover, series
kept or dropped, counts lost). With ``GPU_EXPORTER_FAULTS_REPORT=<file>`` in the
environment the records of the run are written there as JSON at the end of the session
(``tests/faults/report.py`` does this and regenerates the table).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.faults.cases import BY_ID

REPORT_ENV = "GPU_EXPORTER_FAULTS_REPORT"
_records: dict[str, dict[str, str]] = {}

RecordFault = Callable[..., None]


@pytest.fixture
def record_fault(request: pytest.FixtureRequest) -> Iterator[RecordFault]:
    def record(case_id: str, *, expected: str, figure: str) -> None:
        assert case_id in BY_ID, f"{case_id!r} is not a case in tests/faults/cases.py"
        assert expected.strip() and figure.strip(), "say what was expected and measured"
        _records[case_id] = {
            "expected": " ".join(expected.split()),
            "figure": " ".join(figure.split()),
            "test": request.node.nodeid,
        }

    yield record


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get(REPORT_ENV)
    if target and _records:
        Path(target).write_text(json.dumps(_records, indent=2, sort_keys=True) + "\n")
