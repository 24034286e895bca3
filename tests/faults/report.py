"""Run the fault matrix and write its table into docs/reliability.md.

``python tests/faults/report.py`` runs ``pytest tests/faults`` with
``GPU_EXPORTER_FAULTS_REPORT`` set, so each case's test records what it asserted and
measured (``record_fault``), then replaces the table between the markers in
docs/reliability.md with one row per case of ``tests/faults/cases.py``, in its order.
A case whose test did not record (failed, or skipped for want of promtool) is listed as
such, so the table never claims more than the run showed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import machine_line  # noqa: E402
from tests.faults.cases import CASES  # noqa: E402
from tests.faults.conftest import REPORT_ENV  # noqa: E402

DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"


def table(records: dict[str, dict[str, str]], outcome: str) -> str:
    lines = [
        f"Run {datetime.now(UTC):%Y-%m-%d} on {machine_line()} (`python tests/faults/report.py`; "
        f"pytest: {outcome}).",
        "",
        "| area | fault | expected behaviour (asserted) | measured |",
        "|---|---|---|---|",
    ]
    for case in CASES:
        record = records.get(case.id)
        if record is None:
            lines.append(
                f"| {case.area} | {case.fault} | (no record: the test failed or was skipped) | — |"
            )
            continue
        expected, figure = (record[k].replace("|", "\\|") for k in ("expected", "figure"))
        lines.append(f"| {case.area} | {case.fault} | {expected} | {figure} |")
    return "\n".join(lines)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.json"
        run = subprocess.run(
            [
                *(sys.executable, "-m", "pytest", "tests/faults", "-q", "-p", "no:cacheprovider"),
                # the check of this table, which reads it while it is being rewritten
                "--deselect",
                "tests/faults/test_matrix_complete.py::test_the_reliability_doc_has_a_row_for_every_case",
            ],
            cwd=ROOT,
            env={**os.environ, REPORT_ENV: str(report)},
            capture_output=True,
            text=True,
        )
        records = json.loads(report.read_text()) if report.exists() else {}
    outcome = (run.stdout.strip().splitlines() or ["no output"])[-1].strip("= ")
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(f"{head}{BEGIN}\n{table(records, outcome)}\n{END}{tail}")
    print(f"{len(records)} of {len(CASES)} cases recorded; pytest: {outcome}")
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0 if run.returncode == 0 and len(records) == len(CASES) else 1


if __name__ == "__main__":
    raise SystemExit(main())
