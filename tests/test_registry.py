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
    ("argv", "expected_s"),
    [
        ([], 30.0),  # --interval 5: the flag's own period
        (["--pod-resources-interval", "10", "--interval", "1"], 10.0),
        # cycles further apart than the refreshes: one refresh per cycle's interval, not
        # twenty that no cycle reads
        (["--interval", "600"], 600.0),
        (["--pod-resources-interval", "45", "--interval", "60"], 60.0),
    ],
)
def test_pod_resources_are_refreshed_no_more_often_than_cycles_run(
    argv: list[str], expected_s: float
) -> None:
    assert pod_resources(argv).interval_s == expected_s
