"""The label budget: no series the exporter serves carries more than ``LABEL_BUDGET``
labels, on any shipped scenario with every family and source on.

Why 20: Grafana Mimir refuses a series with more than 30 label names by default
(``-validation.max-label-names-per-series``, default 30, counting ``__name__``:
https://grafana.com/docs/mimir/latest/configure/configuration-parameters/ , the
``limits`` block; grafana/mimir pkg/util/validation/limits.go), and a whole dcgm-exporter
deployment went dark there (NVIDIA/dcgm-exporter#585, which asks for fewer than 20 "to
leave space for users to add their own custom labels"). On the way to such a backend a
series gains ``__name__``, ``job`` and ``instance``, the chart's ``node`` and often
``namespace``/``pod``/``container`` of the exporter's own pod (renamed ``exported_*`` where
they collide), a ``cluster`` or ``replica`` external label and whatever the user relabels:
20 served labels leave 10 for all of that.

Each scenario runs on the golden schedule (tests/cardinality.py's ``measure``: every
series served at any cycle counts), with ``EVERYTHING`` on.
"""

from __future__ import annotations

import pytest

from exporter.sim.scenario import SHIPPED
from tests.cardinality import EVERYTHING, measure

LABEL_BUDGET = 20
MIMIR_DEFAULT_LIMIT = 30  # -validation.max-label-names-per-series, __name__ included
ADDED_ON_THE_WAY = ("__name__", "job", "instance", "node")
# Of Mimir's 30, what the widest served series leaves after ADDED_ON_THE_WAY must keep at
# least this many for a cluster/replica label, the exporter pod's own labels and the
# user's relabelling (module doc).
ROOM_KEPT = 5


@pytest.mark.slow  # every shipped scenario on the golden schedule, everything on
@pytest.mark.parametrize("scenario", SHIPPED)
async def test_no_served_series_exceeds_the_label_budget(scenario):
    measured = await measure(scenario, EVERYTHING)
    assert measured.total() > 0, f"{scenario}: nothing was served"
    widest = max(
        (
            (len(labels), family, name, labels)
            for family, series in measured.series.items()
            for name, labels in series
        ),
        key=lambda row: row[0],
    )
    count, family, name, labels = widest
    assert count <= LABEL_BUDGET, (
        f"{scenario}: {name} (family {family}) carries {count} labels, over the budget of "
        f"{LABEL_BUDGET}: {sorted(k for k, _ in labels)}"
    )
    # What the backend counts: the served labels (no __name__ among them) and those the
    # series gains on the way there.
    counted = count + len(ADDED_ON_THE_WAY)
    assert counted <= MIMIR_DEFAULT_LIMIT - ROOM_KEPT, (
        f"{scenario}: {name} reaches a backend with {counted} label names, leaving "
        f"{MIMIR_DEFAULT_LIMIT - counted} of Mimir's {MIMIR_DEFAULT_LIMIT} (want {ROOM_KEPT})"
    )
