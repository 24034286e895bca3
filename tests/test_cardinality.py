"""docs/metrics.md's cardinality tables are the measurement of tests/cardinality.py."""

from __future__ import annotations

import difflib

import pytest

from tests.cardinality import documented, measure_all, render, unit_of


def test_series_are_put_in_the_scope_their_labels_name() -> None:
    gpu = {"gpu": "0", "uuid": "GPU-a"}
    assert unit_of(gpu) == ("GPU", ("GPU-a",))
    assert unit_of({**gpu, "mig_uuid": "MIG-b", "gpu_instance": "1"}) == (
        "MIG instance",
        ("GPU-a", "1"),
    )
    pod = {"namespace": "ns", "pod": "p", "container": "c"}
    assert unit_of({**gpu, **pod}) == ("container", ("ns", "p", "c"))
    owner = {"namespace": "ns", "pod": "p", "owner_kind": "Pod", "owner_name": "p"}
    assert unit_of(owner) == ("pod", ("ns", "p"))
    assert unit_of({**gpu, **pod, "pid": "7"}) == ("process", ("GPU-a", "", "7"))
    assert unit_of({**gpu, "namespace": "", "pod": "", "container": ""}) == ("GPU", ("GPU-a",))
    assert unit_of({"resource": "nvidia.com/gpu", "uuid": ""}) == ("node", ())


@pytest.mark.slow  # every shipped scenario twice through its timeline (~15 s)
async def test_the_cardinality_tables_in_docs_metrics_md_are_measured() -> None:
    measured = render(await measure_all())
    doc = documented()
    diff = "\n".join(
        difflib.unified_diff(doc.splitlines(), measured.splitlines(), "docs", "measured", n=0)
    )
    assert doc == measured, (
        f"docs/metrics.md's cardinality tables are stale:\n{diff}\n"
        "regenerate with: .venv/bin/python tests/cardinality.py"
    )
