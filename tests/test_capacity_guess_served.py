"""Capacity served by the real exporter when the kubelet cannot say what it advertises
(docs/health.md, "Unknown"): the simulated node's kubelet replaced by the real gRPC
PodResources server answering GetAllocatableResources with UNIMPLEMENTED, as kubelets
before 1.21 (and 1.21-1.22 with the feature gate off) do."""

from __future__ import annotations

from exporter.sim.podresources_server import start_podresources_server
from tests.harness import Scrape, simulated_exporter

DEVICES = "gpu_node_devices"


def shared(name: str, gpu: int) -> dict[str, object]:
    """A pod holding one time-sliced replica of a GPU (nvidia.com/gpu.shared)."""
    return {
        "namespace": "inference",
        "name": name,
        "containers": [
            {
                "name": "main",
                "devices": {"nvidia.com/gpu.shared": [f"gpu{gpu}::0"]},
                "processes": [{"gpu": gpu, "memory": "2GiB", "comm": "tritonserver"}],
            }
        ],
    }


def states(scrape: Scrape, resource: str) -> dict[str, float]:
    return {labels["state"]: v for labels, v in scrape.find(DEVICES, resource=resource)}


async def test_a_fully_shared_node_under_an_older_kubelet_is_never_served_all_allocatable() -> None:
    scenario: dict[str, object] = {
        "gpus": [{}, {}, {}, {}],
        "pods": [shared(f"s{i}", i) for i in range(4)],
    }
    async with simulated_exporter(scenario) as h:
        node = h.env.node
        # The simulator offers no public way to swap its kubelet; its gRPC server is it.
        await h.env._grpc.stop(None)
        h.env._grpc = await start_podresources_server(
            h.env.paths.pod_resources_socket,
            lambda: (node.container_devices(), node.allocatable_devices(), node.claim_devices()),
            allocatable_implemented=False,
        )
        await h.refresh_pod_resources()
        await h.advance(5)
        scrape = await h.scrape()

    assert scrape.get("gpu_exporter_source_up", source="podresources") == 1
    # Four replicas allocated, the kubelet's List says so ...
    assert len(scrape.find("gpu_container_memory_used_bytes")) == 4
    # ... but what it advertises is a guess: NVML's GPUs and their health, no allocation
    # counts (before: allocated 0, allocatable 4 on a node with nothing free).
    assert states(scrape, "nvidia.com/gpu") == {
        "advertised": 4,
        "healthy": 4,
        "unhealthy": 0,
        "unknown": 0,
    }
    assert states(scrape, "nvidia.com/gpu.shared") == {}
