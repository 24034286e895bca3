"""``build_sources``: what the flags make of each source."""

from __future__ import annotations

import pytest

from exporter.config import parse_config
from exporter.registry import build_sources
from exporter.sources.podresources.source import PodResourcesSource


def pod_resources(argv: list[str]) -> PodResourcesSource:
    config = parse_config([*argv, "--kube-api", "off"], env={})
    found = [s for s in build_sources(config) if isinstance(s, PodResourcesSource)]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize(
    ("argv", "schedule_s", "period_s"),
    [
        ([], 30.0, 30.0),  # --interval 5
        (["--pod-resources-interval", "10", "--interval", "1"], 10.0, 10.0),
        # cycles further apart than the schedule: a refresh per cycle, so a working
        # source goes a cycle's interval between refreshes and is stale only after three
        (["--interval", "600"], 30.0, 600.0),
        (["--pod-resources-interval", "45", "--interval", "60"], 45.0, 60.0),
    ],
)
def test_the_pod_resources_schedule_and_staleness_period_follow_both_intervals(
    argv: list[str], schedule_s: float, period_s: float
) -> None:
    source = pod_resources(argv)
    assert (source.interval_s, source.period_s) == (schedule_s, period_s)
