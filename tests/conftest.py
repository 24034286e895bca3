"""Shared fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from exporter.sources.nvml import NvmlSource

# Modules of DCGM's Python bindings (here: the fake in tests/fake_dcgm). Python caches
# imports process-wide, so each test starts and ends without them, as a fresh process.
DCGM_BINDING_MODULES = (
    "pydcgm",
    "dcgm_structs",
    "dcgm_fields",
    "dcgm_agent",
    "dcgmvalue",
    "dcgm_field_helpers",
)


@pytest.fixture(autouse=True)
def isolated_dcgm_bindings() -> Iterator[None]:
    saved_path = list(sys.path)
    for name in DCGM_BINDING_MODULES:
        sys.modules.pop(name, None)
    yield
    sys.path[:] = saved_path
    for name in DCGM_BINDING_MODULES:
        sys.modules.pop(name, None)


@pytest.fixture
def made() -> Iterator[list[NvmlSource]]:
    """The NVML sources a test builds over the simulated library, closed after it."""
    sources: list[NvmlSource] = []
    yield sources
    for source in sources:
        source.close()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a slow or e2e test run first, each file's tests together and in order.
    With ``--dist loadfile`` a worker takes a whole file: started last, the longest files
    (the soak, the e2e run, the image build) left one worker running them alone while the
    other had nothing left, minutes of the suite's time on 2 cores."""
    heavy = {
        item.path
        for item in items
        if item.get_closest_marker("slow") or item.get_closest_marker("e2e")
    }
    items.sort(key=lambda item: item.path not in heavy)  # stable: files stay whole


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker per core and one more for every two (3 on 2 cores). About
    half of the suite's wall time is spent waiting on real time (Prometheus' scrapes and
    rule evaluations, the simulated node's timelines, subprocesses starting): a worker
    per core left the cores half idle (the full suite used 54 % of 2 cores).
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still decides where it is set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0))
    return cores + max(1, cores // 2)
