"""The one seam between sources and analysis is typed: each source's ``fill`` assigns
its reading to a typed field of ``Readings``, and ``Readings.snapshot`` builds the
``NodeSnapshot`` field by field (no ``**dict`` that mypy cannot see)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from exporter.model import NvmlSnapshot, Readings, SourceStatus

ROOT = Path(__file__).resolve().parents[1]


def test_a_cycle_whose_nvml_was_never_read_is_nvml_down_not_a_crash() -> None:
    snapshot = Readings().snapshot("node-a", 12.0, (SourceStatus("nvml", False, "boom"),))
    assert snapshot.nvml == NvmlSnapshot(ok=False, timestamp=12.0, error="NVML not read")
    assert snapshot.node_name == "node-a" and snapshot.timestamp == 12.0


def test_every_snapshot_field_but_the_cycles_own_is_a_reading() -> None:
    """A field added to NodeSnapshot must be added to Readings (and its snapshot())."""
    from dataclasses import fields

    from exporter.model import NodeSnapshot

    # the cycle's own: its node, its wall and monotonic times, its sources' statuses
    own = {"node_name", "timestamp", "monotonic", "sources"}
    assert {f.name for f in fields(NodeSnapshot)} - own == {f.name for f in fields(Readings)}


@pytest.mark.slow
def test_mypy_refuses_a_source_that_fills_a_field_with_the_wrong_type(tmp_path: Path) -> None:
    from mypy import api

    bad = tmp_path / "bad_source.py"
    bad.write_text(
        textwrap.dedent(
            """
            from exporter.model import ProcessIdentity
            from exporter.sources.base import Cycle, Source

            class Wrong(Source):
                def read(self, cycle: Cycle) -> tuple[ProcessIdentity, ...]:
                    return ()

                def fill(self, cycle: Cycle) -> None:
                    cycle.readings.nvml = self.read(cycle)
            """
        )
    )
    out, _, status = api.run([str(bad), "--no-incremental", "--follow-imports=silent"])
    assert status == 1
    assert "Incompatible types in assignment" in out and "NvmlSnapshot" in out
