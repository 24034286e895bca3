"""The benchmark's memory floor (benchmarks/memory_floor.py) starts gRPC core as the
exporter does, and refuses a floor whose PodResources round failed (a floor without gRPC
core started would be ~4 MiB too low and pass the target falsely)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bench_scripts import load

memory_floor = load("memory_floor")
processes = load("processes")

MODULES = ["grpc", "exporter.sources.podresources.client"]


@pytest.fixture(scope="module")
def node_socket() -> Iterator[Path]:
    node = processes.NodeServer("node-8gpu", kube_api=False)
    try:
        yield Path(node.description["pod_resources_socket"])
    finally:
        node.stop()


def test_the_floor_starts_grpc_core_with_one_podresources_round(node_socket: Path) -> None:
    floor = memory_floor.import_floor(MODULES, node_socket)
    started = floor["grpc_started"]
    assert floor["round_ok"] is True
    assert floor["not_importable"] == 0
    # gRPC core's code pages, mapped by its first channel: megabytes, not noise
    assert started["file"] - floor["file"] > 1.0, floor
    assert started["rss"] >= floor["rss"]
    # and nothing else: a round that kept its answer, or loaded more than gRPC core's
    # code, would raise the floor and flatter the exporter (3.8 MiB file-backed and
    # 0.1-0.2 MiB anonymous on the benchmark's VM)
    assert started["file"] - floor["file"] < 6.0, floor
    assert started["anon"] - floor["anon"] < 1.0, floor


def test_a_floor_whose_round_failed_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"PodResources round failed.*does not exist"):
        memory_floor.import_floor(MODULES, tmp_path / "no-kubelet.sock")
