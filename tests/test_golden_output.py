"""The served /metrics of every shipped scenario matches its golden copy in tests/golden/.

The golden files were recorded by ``tests/golden/record.py`` (a fixed schedule of cycles on
the manual clock; timing- and machine-dependent values left out). A failure lists the
missing and extra series and the changed values. If the change is intended, review the
difference and re-record::

    .venv/bin/python tests/golden/record.py            # shows the diff, writes nothing
    .venv/bin/python tests/golden/record.py --accept   # writes it
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.golden.record import GOLDEN_DIR, REQUIRED, Golden, load, normalise, served_text

RERECORD = (
    "if the change is intended, see the diff with .venv/bin/python tests/golden/record.py "
    "and write it with --accept"
)
GOLDEN_FILES = sorted(GOLDEN_DIR.glob("*.json"))

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


def _series(golden: Golden, family: str) -> dict[SeriesKey, object]:
    return {
        (name, tuple(sorted(labels.items()))): value
        for name, labels, value in golden[family]["samples"]
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _show(key: SeriesKey) -> str:
    name, labels = key
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


def differences(expected: Golden, actual: Golden) -> list[str]:
    """Readable lines, one per difference; empty when the two agree."""
    lines: list[str] = []
    lines += [f"missing family {f}" for f in sorted(expected.keys() - actual.keys())]
    lines += [f"extra family {f}" for f in sorted(actual.keys() - expected.keys())]
    for family in sorted(expected.keys() & actual.keys()):
        if expected[family]["type"] != actual[family]["type"]:
            lines.append(f"{family}: type {expected[family]['type']} -> {actual[family]['type']}")
        want, got = _series(expected, family), _series(actual, family)
        lines += [f"missing series {_show(k)} = {want[k]}" for k in sorted(want.keys() - got)]
        lines += [f"extra series {_show(k)} = {got[k]}" for k in sorted(got.keys() - want)]
        lines += [
            f"changed {_show(k)}: {want[k]} -> {got[k]}"
            for k in sorted(want.keys() & got.keys())
            if not _same(want[k], got[k])
        ]
    return lines


def test_every_required_scenario_has_a_golden_copy() -> None:
    missing = [s for s in REQUIRED if not (GOLDEN_DIR / f"{s}.json").is_file()]
    assert not missing, (
        f"no golden copy for {missing}; record with tests/golden/record.py <scenario> --accept"
    )


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[p.stem for p in GOLDEN_FILES])
async def test_served_metrics_match_the_golden_copy(path: Path) -> None:
    actual = normalise(await served_text(path.stem))
    lines = differences(load(path), actual)
    assert not lines, (
        f"{path.stem}: /metrics differs from {path.name} in {len(lines)} place(s):\n  "
        + "\n  ".join(lines[:200])
        + ("\n  ..." if len(lines) > 200 else "")
        + f"\n{RERECORD}"
    )


def test_the_comparison_reports_missing_extra_and_changed_series() -> None:
    expected: Golden = {
        "a": {"type": "gauge", "samples": [["a", {"gpu": "0"}, 1.0], ["a", {"gpu": "1"}, 2.0]]},
        "b": {"type": "counter", "samples": []},
    }
    actual: Golden = {
        "a": {"type": "gauge", "samples": [["a", {"gpu": "0"}, 1.5], ["a", {"gpu": "2"}, 2.0]]},
        "c": {"type": "gauge", "samples": []},
    }
    assert differences(expected, actual) == [
        "missing family b",
        "extra family c",
        'missing series a{gpu="1"} = 2.0',
        'extra series a{gpu="2"} = 2.0',
        'changed a{gpu="0"}: 1.0 -> 1.5',
    ]
    assert differences(expected, expected) == []
