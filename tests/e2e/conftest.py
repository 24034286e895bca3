"""Everything under tests/e2e is the ``e2e`` tier (a real Prometheus, minutes of wall
time): ``pytest -m e2e`` runs it, ``pytest -m "not e2e and not slow"`` leaves it out."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The hook sees the whole session's items, so mark only the ones collected here.
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.e2e)
