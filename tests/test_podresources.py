"""PodResources client against the simulator's real gRPC server on a real unix socket."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from exporter.kubelet_api import api_pb2, api_pb2_grpc
from exporter.model import AllocatableDevices, ClaimDevice, ContainerDevices
from exporter.sim.podresources_server import (
    Allocations,
    PodResourcesProvider,
    PodResourcesServicer,
    build_pod_resources,
    start_podresources_server,
)
from exporter.sources.backoff import Backoff
from exporter.sources.podresources.client import (
    DEFAULT_DRA_DRIVERS,
    DEFAULT_RESOURCE_NAMES,
    INLINE_DECODE_BYTES,
    MAX_RECEIVE_MESSAGE_BYTES,
    PodResourcesClient,
    resource_name_matches,
)
from exporter.sources.podresources.source import PodResourcesSource

GPU0 = "GPU-8a1b2c3d-0000-1111-2222-333344445555"
GPU1 = "GPU-8a1b2c3d-0000-1111-2222-333344446666"
GPU2 = "GPU-8a1b2c3d-0000-1111-2222-333344447777"
MIG0 = "MIG-0b6a8f3e-1c2d-5e4f-9a8b-7c6d5e4f3a21"
MIG1 = "MIG-0b6a8f3e-1c2d-5e4f-9a8b-7c6d5e4f3a22"

CONTAINERS = (
    ContainerDevices("ml", "trainer-0", "main", "nvidia.com/gpu", (GPU0, GPU1)),
    ContainerDevices("ml", "trainer-0", "sidecar", "example.com/foo", ("foo-1",)),
    ContainerDevices("ml", "infer-7", "server", "nvidia.com/gpu.shared", (f"{GPU2}::2",)),
    ContainerDevices("ml", "infer-7", "server", "example.com/foo", ("foo-2",)),
    ContainerDevices("dev", "notebook", "jupyter", "nvidia.com/gpu.shared", (f"{GPU2}::0",)),
    ContainerDevices("dev", "mig-job", "work", "nvidia.com/mig-1g.10gb", (MIG0,)),
    ContainerDevices("dev", "mig-job", "work", "nvidia.com/mig-3g.40gb", (MIG1,)),
)
ALLOCATABLE = (
    AllocatableDevices("nvidia.com/gpu", (GPU0, GPU1)),
    AllocatableDevices("nvidia.com/gpu.shared", tuple(f"{GPU2}::{i}" for i in range(4))),
    AllocatableDevices("nvidia.com/mig-1g.10gb", (MIG0,)),
    AllocatableDevices("nvidia.com/mig-3g.40gb", (MIG1,)),
    AllocatableDevices("example.com/foo", ("foo-1", "foo-2")),
)

ServerFactory = Callable[..., Awaitable[grpc.aio.Server]]


def static(
    containers: Sequence[ContainerDevices], allocatable: Sequence[AllocatableDevices]
) -> Callable[[], Allocations]:
    return lambda: (containers, allocatable)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # pytest's tmp_path can exceed the 108-byte sun_path limit; /tmp keeps it short.
    path = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sock(sock_dir: Path) -> Path:
    return sock_dir / "kubelet.sock"


@pytest.fixture
async def start_server(sock: Path) -> AsyncIterator[ServerFactory]:
    servers: list[grpc.aio.Server] = []

    async def start(provider: PodResourcesProvider, **kwargs: bool) -> grpc.aio.Server:
        server = await start_podresources_server(sock, provider, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop(grace=None)


@pytest.fixture
async def client(sock: Path) -> AsyncIterator[PodResourcesClient]:
    c = PodResourcesClient(sock)
    yield c
    await c.close()


@contextlib.asynccontextmanager
async def _running(source: PodResourcesSource) -> AsyncIterator[asyncio.Task[None]]:
    """``source``'s refresh task, as the agent runs it, cancelled on the way out."""
    task = asyncio.create_task(source.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---------------------------------------------------------------------------
# resource name matching
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("nvidia.com/gpu", True),
        ("nvidia.com/gpu.shared", True),
        ("nvidia.com/mig-1g.10gb", True),
        ("nvidia.com/mig-7g.80gb", True),
        ("nvidia.com/gpux", False),
        ("nvidia.com/mig", False),
        ("example.com/foo", False),
        ("amd.com/gpu", False),
    ],
)
def test_default_resource_names_match_exactly_or_by_trailing_wildcard(
    name: str, expected: bool
) -> None:
    assert resource_name_matches(name, DEFAULT_RESOURCE_NAMES) is expected


def test_wildcard_is_only_special_at_the_end() -> None:
    assert resource_name_matches("a*b", ["a*b"])
    assert not resource_name_matches("axb", ["a*b"])
    assert resource_name_matches("anything", ["*"])


def test_client_rejects_a_bare_string_of_resource_names(sock: Path) -> None:
    with pytest.raises(TypeError):
        PodResourcesClient(sock, resource_names="nvidia.com/gpu")


# ---------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------


async def test_round_trip_keeps_gpu_mig_and_replica_ids_and_drops_other_resources(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    await start_server(static(CONTAINERS, ALLOCATABLE))

    snap = await client.fetch()

    assert snap.ok is True
    assert snap.error is None
    assert snap.containers == (
        ContainerDevices("dev", "mig-job", "work", "nvidia.com/mig-1g.10gb", (MIG0,)),
        ContainerDevices("dev", "mig-job", "work", "nvidia.com/mig-3g.40gb", (MIG1,)),
        ContainerDevices("dev", "notebook", "jupyter", "nvidia.com/gpu.shared", (f"{GPU2}::0",)),
        ContainerDevices("ml", "infer-7", "server", "nvidia.com/gpu.shared", (f"{GPU2}::2",)),
        ContainerDevices("ml", "trainer-0", "main", "nvidia.com/gpu", (GPU0, GPU1)),
    )
    assert snap.allocatable_ok is True
    assert snap.allocatable == (
        AllocatableDevices("nvidia.com/gpu", (GPU0, GPU1)),
        AllocatableDevices("nvidia.com/gpu.shared", tuple(f"{GPU2}::{i}" for i in range(4))),
        AllocatableDevices("nvidia.com/mig-1g.10gb", (MIG0,)),
        AllocatableDevices("nvidia.com/mig-3g.40gb", (MIG1,)),
    )
    assert abs(snap.timestamp - time.time()) < 5


async def test_custom_resource_names_select_what_is_kept(
    start_server: ServerFactory, sock: Path
) -> None:
    await start_server(static(CONTAINERS, ALLOCATABLE))
    client = PodResourcesClient(sock, resource_names=["example.com/foo"])
    try:
        snap = await client.fetch()
    finally:
        await client.close()

    assert [(c.pod, c.device_ids) for c in snap.containers] == [
        ("infer-7", ("foo-2",)),
        ("trainer-0", ("foo-1",)),
    ]
    assert snap.allocatable == (AllocatableDevices("example.com/foo", ("foo-1", "foo-2")),)


async def test_kubelet_style_one_entry_per_device_is_merged_per_container_and_resource(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    # A real kubelet sends one ContainerDevices per device (and per NUMA node), so the
    # same id can arrive twice; the snapshot has one entry per resource, ids unique.
    containers = (
        ContainerDevices("ml", "big", "main", "nvidia.com/gpu", (GPU1, GPU0)),
        ContainerDevices("ml", "big", "main", "nvidia.com/gpu", (GPU0, GPU2)),
    )
    await start_server(static(containers, ALLOCATABLE), split_devices=True)

    snap = await client.fetch()

    assert snap.containers == (
        ContainerDevices("ml", "big", "main", "nvidia.com/gpu", (GPU0, GPU1, GPU2)),
    )


async def test_provider_is_called_per_request_so_allocations_can_change(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    state: dict[str, tuple[ContainerDevices, ...]] = {
        "now": (ContainerDevices("ml", "a", "c", "nvidia.com/gpu", (GPU0,)),)
    }
    await start_server(lambda: (state["now"], ALLOCATABLE))

    first = await client.fetch()
    state["now"] = (ContainerDevices("ml", "b", "c", "nvidia.com/gpu", (GPU0,)),)
    second = await client.fetch()

    assert [c.pod for c in first.containers] == ["a"]
    assert [c.pod for c in second.containers] == ["b"]


async def test_empty_node_is_ok_with_no_containers(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    await start_server(static((), ()))

    snap = await client.fetch()

    assert snap.ok is True
    assert snap.containers == ()
    assert snap.allocatable == ()
    assert snap.allocatable_ok is True


# ---------------------------------------------------------------------------
# the simulator server's message shape (checked with a raw stub)
# ---------------------------------------------------------------------------


async def test_server_groups_by_pod_container_and_resource_name(
    start_server: ServerFactory, sock: Path
) -> None:
    await start_server(static(CONTAINERS, ALLOCATABLE))
    async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
        stub = api_pb2_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
        listed = await stub.List(api_pb2.ListPodResourcesRequest(), timeout=1)

    shape = {
        (pod.namespace, pod.name): {
            container.name: [(d.resource_name, list(d.device_ids)) for d in container.devices]
            for container in pod.containers
        }
        for pod in listed.pod_resources
    }
    assert len(listed.pod_resources) == 4
    assert shape[("ml", "trainer-0")] == {
        "main": [("nvidia.com/gpu", [GPU0, GPU1])],
        "sidecar": [("example.com/foo", ["foo-1"])],
    }
    assert shape[("ml", "infer-7")] == {
        "server": [("nvidia.com/gpu.shared", [f"{GPU2}::2"]), ("example.com/foo", ["foo-2"])]
    }
    assert shape[("dev", "mig-job")] == {
        "work": [("nvidia.com/mig-1g.10gb", [MIG0]), ("nvidia.com/mig-3g.40gb", [MIG1])]
    }


async def test_server_get_returns_one_pod_and_not_found_for_unknown_pods(
    start_server: ServerFactory, sock: Path
) -> None:
    await start_server(static(CONTAINERS, ALLOCATABLE))
    async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
        stub = api_pb2_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
        got = await stub.Get(
            api_pb2.GetPodResourcesRequest(pod_name="infer-7", pod_namespace="ml"), timeout=1
        )
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Get(
                api_pb2.GetPodResourcesRequest(pod_name="infer-7", pod_namespace="dev"),
                timeout=1,
            )

    assert got.pod_resources.name == "infer-7"
    assert got.pod_resources.namespace == "ml"
    assert [c.name for c in got.pod_resources.containers] == ["server"]
    assert [d.resource_name for d in got.pod_resources.containers[0].devices] == [
        "nvidia.com/gpu.shared",
        "example.com/foo",
    ]
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_proto_field_numbers_match_the_kubelet_wire_format() -> None:
    """Wire compatibility with a real kubelet depends on these numbers, not on names."""

    def numbers(message: type[object]) -> dict[str, int]:
        descriptor = message.DESCRIPTOR  # type: ignore[attr-defined]
        return {f.name: f.number for f in descriptor.fields}

    assert api_pb2.DESCRIPTOR.package == "v1"
    service = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert [m.name for m in service.methods] == ["List", "GetAllocatableResources", "Get"]
    assert numbers(api_pb2.ListPodResourcesResponse) == {"pod_resources": 1}
    assert numbers(api_pb2.PodResources) == {
        "name": 1,
        "namespace": 2,
        "containers": 3,
        "cpu_ids": 4,
        "memory": 5,
    }
    assert numbers(api_pb2.ContainerResources) == {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    }
    assert numbers(api_pb2.ContainerDevices) == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert numbers(api_pb2.AllocatableResourcesResponse) == {
        "devices": 1,
        "cpu_ids": 2,
        "memory": 3,
    }
    assert numbers(api_pb2.GetPodResourcesRequest) == {"pod_name": 1, "pod_namespace": 2}


# ---------------------------------------------------------------------------
# degraded kubelets
# ---------------------------------------------------------------------------


async def test_allocatable_unimplemented_keeps_the_snapshot_ok(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    await start_server(static(CONTAINERS, ALLOCATABLE), allocatable_implemented=False)

    snap = await client.fetch()
    again = await client.fetch()

    assert snap.ok is True
    assert snap.allocatable_ok is False
    assert snap.allocatable == ()
    assert snap.error is None
    assert len(snap.containers) == 5
    # UNIMPLEMENTED is an answer, not a broken connection: the next round is as good.
    assert again.ok is True and again.allocatable_ok is False and again.error is None
    assert client.channels_created == 2  # a channel per round (the client module says why)


class _GateOffServicer(PodResourcesServicer):
    """A 1.21/1.22 kubelet with KubeletPodResourcesGetAllocatable off: a plain Go error."""

    async def GetAllocatableResources(
        self, request: api_pb2.AllocatableResourcesRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.AllocatableResourcesResponse:
        await context.abort(
            grpc.StatusCode.UNKNOWN, "PodResources API GetAllocatableResources disabled"
        )
        raise AssertionError("abort() raises")


async def test_allocatable_disabled_by_feature_gate_counts_as_unsupported(
    client: PodResourcesClient, sock: Path
) -> None:
    server = grpc.aio.server()
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(  # type: ignore[no-untyped-call]
        _GateOffServicer(static(CONTAINERS, ALLOCATABLE)), server
    )
    server.add_insecure_port(f"unix://{sock}")
    await server.start()
    try:
        snap = await client.fetch()
    finally:
        await server.stop(grace=None)

    assert snap.ok is True
    assert snap.allocatable_ok is False
    assert snap.error is None
    assert len(snap.containers) == 5


async def test_path_that_is_not_a_socket_is_reported(sock_dir: Path) -> None:
    path = sock_dir / "regular-file"
    path.write_text("")
    client = PodResourcesClient(path)

    snap = await client.fetch()

    assert snap.ok is False
    assert snap.error is not None
    assert "not a unix socket" in snap.error


async def test_stale_socket_left_by_a_crashed_kubelet_fails_then_recovers(
    start_server: ServerFactory, client: PodResourcesClient, sock: Path
) -> None:
    # A bound socket that nobody listens on: connect() gets ECONNREFUSED.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))
    stale.close()

    failed = await client.fetch()
    await start_server(static(CONTAINERS, ALLOCATABLE))
    recovered = await client.fetch()

    assert failed.ok is False
    assert failed.error is not None
    assert failed.error.startswith("PodResources List: UNAVAILABLE:")
    assert "\n" not in failed.error
    assert recovered.ok is True
    assert len(recovered.containers) == 5


async def test_each_fetch_opens_a_channel_and_closes_it_before_returning(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    """No channel is open between refreshes: gRPC core's threads run only while one is
    (test_grpc_threads_end_between_refreshes); the kubelet counts calls, not channels."""
    calls = 0

    def provider() -> Allocations:
        nonlocal calls
        calls += 1
        return CONTAINERS, ALLOCATABLE

    await start_server(provider)

    snaps = []
    for _ in range(25):
        snaps.append(await client.fetch())
        assert not client.channel_open

    assert all(s.ok and s.allocatable_ok for s in snaps)
    assert calls == 50  # every fetch really reached the server (List + Allocatable)
    assert client.channels_created == 25


class _CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The event loop's default executor (where asyncio.to_thread runs), counting."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.submitted += 1
        return super().submit(*args, **kwargs)


async def test_a_small_answer_is_decoded_on_the_loop_and_a_large_one_in_a_thread(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    """Handing a 2 KiB answer to a worker thread cost more wake-ups than decoding it
    (the idle floor between cycles, benchmarks/README.md); an answer over
    INLINE_DECODE_BYTES still goes to a thread, so the loop never decodes a big one."""
    executor = _CountingExecutor()
    asyncio.get_running_loop().set_default_executor(executor)
    answer: list[tuple[ContainerDevices, ...]] = [CONTAINERS]
    await start_server(lambda: (answer[0], ALLOCATABLE))
    small = api_pb2.ListPodResourcesResponse(pod_resources=build_pod_resources(CONTAINERS))
    assert small.ByteSize() <= INLINE_DECODE_BYTES

    snap = await client.fetch()

    assert snap.ok and snap.allocatable_ok and len(snap.containers) == 5
    assert executor.submitted == 0

    answer[0] = _many_pods(200, gpu_pods=20)
    big = api_pb2.ListPodResourcesResponse(pod_resources=build_pod_resources(answer[0]))
    assert big.ByteSize() > INLINE_DECODE_BYTES

    snap = await client.fetch()

    assert snap.ok and len(snap.containers) == 20
    assert executor.submitted == 1  # List; the allocatable answer is small


async def test_a_failed_round_closes_its_channel_too(
    client: PodResourcesClient, sock: Path
) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))  # bound, never listening: connect() is refused
    stale.close()

    failed = await client.fetch()

    assert failed.ok is False and client.channels_created == 1
    assert not client.channel_open


async def test_close_then_fetch_opens_a_new_channel(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    await start_server(static(CONTAINERS, ALLOCATABLE))
    await client.fetch()
    await client.close()

    snap = await client.fetch()

    assert snap.ok is True
    assert client.channels_created == 2
    assert not client.channel_open


def _many_pods(count: int, gpu_pods: int) -> tuple[ContainerDevices, ...]:
    """``count`` pods of six devices each; the first ``gpu_pods`` hold GPU replicas, the
    rest another device plugin's devices (a GPU answer this large would be over the
    ceiling on GPU allocations, see test_podresources_bounds.py)."""
    return tuple(
        ContainerDevices(
            f"namespace-{i % 50:03d}",
            f"inference-deployment-7d9f8c6b5d-{i:06d}",
            "model-server",
            "nvidia.com/gpu.shared" if i < gpu_pods else "example.com/sriov-nic",
            tuple(f"GPU-8a1b2c3d-0000-1111-2222-{i % 8:012d}::{r}" for r in range(6)),
        )
        for i in range(count)
    )


@pytest.mark.slow  # builds and sends a >4 MiB response
async def test_response_larger_than_grpc_default_4mib_is_received(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    containers = _many_pods(15_000, gpu_pods=1_500)
    size = api_pb2.ListPodResourcesResponse(
        pod_resources=build_pod_resources(containers)
    ).ByteSize()
    assert 4 * 1024 * 1024 < size < MAX_RECEIVE_MESSAGE_BYTES
    await start_server(static(containers, ALLOCATABLE))

    snap = await client.fetch()

    assert snap.ok is True, snap.error
    assert len(snap.containers) == 1_500
    assert snap.containers[0].device_ids[0].startswith("GPU-8a1b2c3d-")


async def test_allocatable_failure_after_list_keeps_list_data_and_says_why(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    calls = 0

    async def slow_second_call() -> Allocations:
        nonlocal calls
        calls += 1
        if calls % 2 == 0:  # every GetAllocatableResources
            await asyncio.sleep(30)
        return CONTAINERS, ALLOCATABLE

    await start_server(slow_second_call)

    snap = await client.fetch()

    assert snap.ok is True
    assert len(snap.containers) == 5
    assert snap.allocatable_ok is False
    assert snap.error is not None
    assert snap.error.startswith("PodResources GetAllocatableResources: DEADLINE_EXCEEDED")


def test_client_rejects_non_positive_timeout(sock: Path) -> None:
    with pytest.raises(ValueError):
        PodResourcesClient(sock, timeout_s=0)


# ---------------------------------------------------------------------------
# backoff
# ---------------------------------------------------------------------------


def test_backoff_doubles_from_one_second_up_to_sixty() -> None:
    backoff = Backoff(rng=lambda: 0.0)  # no jitter drawn: the bare schedule

    delays = [backoff.next_delay() for _ in range(9)]

    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert backoff.failures == 9


def test_backoff_reset_starts_over() -> None:
    backoff = Backoff(rng=lambda: 0.0)
    for _ in range(5):
        backoff.next_delay()

    backoff.reset()

    assert backoff.failures == 0
    assert backoff.next_delay() == 1.0


def test_backoff_jitter_shortens_by_at_most_the_jitter_fraction() -> None:
    low = Backoff(jitter=0.2, rng=lambda: 0.999999)
    assert [round(low.next_delay(), 3) for _ in range(3)] == [0.8, 1.6, 3.2]

    real = Backoff()
    delays = [real.next_delay() for _ in range(12)]
    bases = [1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60]
    assert all(0.8 * b <= d <= b for d, b in zip(delays, bases, strict=True))
    assert max(delays) <= 60.0


def test_backoff_survives_very_long_outages() -> None:
    backoff = Backoff(rng=lambda: 0.0)
    for _ in range(5000):
        delay = backoff.next_delay()
    assert delay == 60.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_s": 0},
        {"initial_s": 10, "max_s": 5},
        {"factor": 0.5},
        {"jitter": 1.0},
        {"jitter": -0.1},
    ],
)
def test_backoff_rejects_nonsense_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# DRA claims (dynamic_resources)
# ---------------------------------------------------------------------------

NV = "gpu.nvidia.com"


def claim(
    pod: str,
    container: str,
    name: str,
    device: str,
    *,
    driver: str = NV,
    share_id: str | None = None,
    namespace: str = "ml",
) -> ClaimDevice:
    return ClaimDevice(
        namespace,
        pod,
        container,
        namespace,
        name,
        driver,
        "node-1",
        device,
        (f"k8s.{driver}/claim=0d3c7e1a-{device}",),
        share_id,
    )


def test_nvidias_dra_driver_is_the_default_and_a_bare_string_is_rejected(sock: Path) -> None:
    assert DEFAULT_DRA_DRIVERS == ("gpu.nvidia.com",)
    with pytest.raises(TypeError):
        PodResourcesClient(sock, dra_drivers="gpu.nvidia.com")


async def test_claim_devices_of_the_gpu_driver_arrive_sorted_and_other_drivers_are_dropped(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    claims = (
        claim("trainer-0", "main", "trainer-0-main-gpu", "gpu-1"),
        claim("trainer-0", "main", "trainer-0-main-gpu", "gpu-0"),
        claim("trainer-0", "main", "trainer-0-nic", "eth1", driver="sriovnetwork.k8s.io"),
        claim("infer-7", "server", "infer-7-server-gpu", "gpu-2-mig-1g10gb-19-0"),
    )
    await start_server(lambda: (CONTAINERS, ALLOCATABLE, claims))

    snap = await client.fetch()

    assert snap.ok is True, snap.error
    assert snap.claims == (claims[3], claims[1], claims[0])


async def test_a_claim_shared_by_two_containers_is_listed_for_each_with_its_share_id(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    shared = (
        claim("chat-a", "main", "gpu1-shared", "gpu-1"),
        claim("chat-b", "main", "gpu1-shared", "gpu-1"),
        claim("embed", "main", "embed-gpu", "gpu-2", share_id="b8f3a3c2-share"),
    )
    await start_server(lambda: ((), (), shared))

    snap = await client.fetch()

    assert [(c.pod, c.claim_name, c.device, c.share_id) for c in snap.claims] == [
        ("chat-a", "gpu1-shared", "gpu-1", None),  # absent share_id: None, not ""
        ("chat-b", "gpu1-shared", "gpu-1", None),
        ("embed", "embed-gpu", "gpu-2", "b8f3a3c2-share"),
    ]


async def test_an_empty_share_id_reads_as_unshared(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    await start_server(lambda: ((), (), (claim("a", "main", "a-gpu", "gpu-0", share_id=""),)))

    snap = await client.fetch()

    assert [c.share_id for c in snap.claims] == [None]


async def test_a_claim_device_sent_twice_is_one_claim_device_and_snapshots_compare_equal(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    # The kubelet walks Go maps: order differs from call to call, and a device can repeat.
    orders = iter(
        [
            (claim("b", "main", "b-gpu", "gpu-1"), claim("a", "main", "a-gpu", "gpu-0")),
            (
                claim("a", "main", "a-gpu", "gpu-0"),
                claim("b", "main", "b-gpu", "gpu-1"),
                claim("a", "main", "a-gpu", "gpu-0"),
            ),
        ]
    )
    # A pre-1.21 kubelet (no GetAllocatableResources): one provider call per fetch.
    await start_server(lambda: ((), (), next(orders)), allocatable_implemented=False)

    first, second = await client.fetch(), await client.fetch()

    assert first.claims == second.claims
    assert [c.pod for c in first.claims] == ["a", "b"]


async def test_a_container_with_devices_and_claims_keeps_both(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    claims = (claim("trainer-0", "main", "trainer-0-extra", "gpu-7"),)
    await start_server(lambda: (CONTAINERS, ALLOCATABLE, claims), split_devices=True)

    snap = await client.fetch()

    assert ContainerDevices("ml", "trainer-0", "main", "nvidia.com/gpu", (GPU0, GPU1)) in (
        snap.containers
    )
    assert snap.claims == claims


async def test_dra_drivers_select_whose_claims_are_kept(
    start_server: ServerFactory, sock: Path
) -> None:
    claims = (
        claim("a", "main", "a-gpu", "gpu-0"),
        claim("b", "main", "b-gpu", "gpu-0", driver="gpu.example.com"),
    )
    await start_server(lambda: ((), (), claims))
    client = PodResourcesClient(sock, dra_drivers=["gpu.example.com"])
    try:
        snap = await client.fetch()
    finally:
        await client.close()

    assert [c.driver for c in snap.claims] == ["gpu.example.com"]


async def test_claims_are_grouped_per_container_and_claim_on_the_wire(
    start_server: ServerFactory, sock: Path
) -> None:
    # What the kubelet sends: one DynamicResource per claim, its devices inside.
    claims = (
        claim("t", "main", "t-main-gpu", "gpu-0"),
        claim("t", "main", "t-main-gpu", "gpu-1"),
        claim("t", "side", "t-side-gpu", "gpu-2"),
    )
    await start_server(lambda: ((), (), claims))
    async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
        stub = api_pb2_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
        listed = await stub.List(api_pb2.ListPodResourcesRequest(), timeout=5)
        got = await stub.Get(
            api_pb2.GetPodResourcesRequest(pod_name="t", pod_namespace="ml"), timeout=5
        )

    (pod,) = listed.pod_resources
    assert got.pod_resources == pod
    shape = {
        c.name: [
            (d.claim_namespace, d.claim_name, [r.device_name for r in d.claim_resources])
            for d in c.dynamic_resources
        ]
        for c in pod.containers
    }
    assert shape == {
        "main": [("ml", "t-main-gpu", ["gpu-0", "gpu-1"])],
        "side": [("ml", "t-side-gpu", ["gpu-2"])],
    }
    assert not pod.containers[0].dynamic_resources[0].claim_resources[0].HasField("share_id")


async def test_agent_start_fetches_once_and_says_connected_once(
    start_server: ServerFactory, client: PodResourcesClient, caplog: pytest.LogCaptureFixture
) -> None:
    # The agent starts every source's run() and then primes them: the first fetch is
    # run()'s, and prime() waits for it instead of racing it with a second one.
    calls: list[int] = []

    def provider() -> tuple[tuple[ContainerDevices, ...], tuple[AllocatableDevices, ...]]:
        calls.append(1)
        return (ContainerDevices("ml", "a", "c", "nvidia.com/gpu", (GPU0,)),), ALLOCATABLE

    await start_server(provider)
    await client.fetch()
    per_fetch = len(calls)  # the provider answers each RPC of a fetch
    calls.clear()
    caplog.set_level(logging.INFO, logger="exporter.sources.podresources.source")
    source = PodResourcesSource(client, interval_s=60)
    async with _running(source):
        await source.prime(5.0)
        assert source.status().up
        assert len(calls) == per_fetch
        connected = [r for r in caplog.records if "connected" in r.getMessage()]
        assert len(connected) == 1


async def test_prime_without_run_fetches_itself(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    await start_server(static((), ()))
    source = PodResourcesSource(client)
    await source.prime(5.0)  # the test harness primes without a refresh task
    assert source.status().up


# A client in a process of its own (no gRPC server or other channel in it), against the
# simulated node's kubelet in another: which of gRPC core's threads (event_engine, the
# global timer, lifeguard) are running after a refresh, and while a channel is held.
_GRPC_THREADS_SCRIPT = """
import asyncio, os, sys, time
import grpc.aio
from exporter.sources.podresources.client import PodResourcesClient

def grpc_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{tid}/comm").read().strip())
        except OSError:
            pass
    return sorted(n for n in names if n.startswith(("event_engine", "grpc_", "lifeguard")))

def settled(want_none, within_s=10.0):
    deadline = time.monotonic() + within_s
    while (bool(grpc_threads()) == want_none) and time.monotonic() < deadline:
        time.sleep(0.05)
    return grpc_threads()

async def main(sock, hold):
    client = PodResourcesClient(sock)
    snap = await client.fetch()
    assert snap.ok, snap.error
    if hold == "hold":  # the control: a channel left open keeps gRPC core's threads
        channel = grpc.aio.insecure_channel(f"unix://{sock}")
        await channel.channel_ready()
        print(",".join(settled(want_none=False)))
        await channel.close()
    else:
        print(",".join(settled(want_none=True)))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _client_alone(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` run in a Python process of its own (no gRPC server or other channel in
    it) with the PodResources socket of a simulated node served by another, and ``args``."""
    from exporter.sim.external import NodeProcess

    node = NodeProcess("single-gpu", tmp_path, kube_api=False)
    try:
        sock = json.loads((tmp_path / "node.json").read_text())["pod_resources_socket"]
        return subprocess.run(
            [sys.executable, "-c", script, sock, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        node.stop()


@pytest.mark.parametrize("hold", ["after-refresh", "hold"])
def test_grpc_threads_end_between_refreshes(tmp_path: Path, hold: str) -> None:
    """The idle floor's known part: with a channel open, gRPC core's threads wake ~35
    times a second (benchmarks/README.md); after a refresh none of them is left."""
    done = _client_alone(tmp_path, _GRPC_THREADS_SCRIPT, hold)
    assert done.returncode == 0, done.stderr
    threads = [t for t in done.stdout.strip().split(",") if t]
    if hold == "hold":
        assert any(t.startswith("event_engine") for t in threads), threads
    else:
        assert threads == []


# A client in a process of its own whose file descriptors run out between two refreshes
# (RLIMIT_NOFILE lowered below every fd it holds). In the exporter's process that made
# gRPC core abort the whole process ("epoll_create1 unavailable ... Check failed:
# init_epoll1_linux()", SIGABRT: tests/faults/test_config_faults.py, proc-fd-exhaustion);
# here, alone, the channel fails with OSError instead. Either way the refresh must fail
# with the reason, before gRPC is asked for a channel, and the next one must work.
_OUT_OF_DESCRIPTORS_SCRIPT = """
import asyncio, resource, sys
from exporter.sources.podresources.client import PodResourcesClient

async def main(sock):
    client = PodResourcesClient(sock)
    first = await client.fetch()
    assert first.ok, first.error
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))
    starved = await client.fetch()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    again = await client.fetch()
    print(starved.ok, again.ok)
    print(starved.error)

asyncio.run(main(sys.argv[1]))
"""


def test_a_refresh_out_of_file_descriptors_fails_instead_of_aborting(tmp_path: Path) -> None:
    done = _client_alone(tmp_path, _OUT_OF_DESCRIPTORS_SCRIPT)
    assert done.returncode == 0, done.stderr[-2000:]
    verdicts, error = done.stdout.strip().split("\n")
    assert verdicts == "False True"  # down while starved, up again once fds are free
    assert "too few file descriptors free" in error and "EMFILE" in error, error


# ---------------------------------------------------------------------------
# refreshes asked for (a GPU process in a new container)
# ---------------------------------------------------------------------------


class _Counting:
    """A provider whose answers change on request, counting the calls (each fetch calls
    it once per RPC: List and GetAllocatableResources)."""

    def __init__(self) -> None:
        self.containers: tuple[ContainerDevices, ...] = ()
        self.calls = 0
        self.on_call: Callable[[int], None] = lambda number: None

    def __call__(self) -> tuple[tuple[ContainerDevices, ...], tuple[AllocatableDevices, ...]]:
        self.calls += 1
        answer = self.containers, ALLOCATABLE
        self.on_call(self.calls)
        return answer


async def _until(condition: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


@contextlib.asynccontextmanager
async def _answering(
    start_server: ServerFactory, client: PodResourcesClient, gap_s: float
) -> AsyncIterator[tuple[_Counting, PodResourcesSource]]:
    """A kubelet answering from a counting provider, and a source on an hour-long
    schedule whose refresh task runs and has answered once."""
    provider = _Counting()
    await start_server(provider)
    source = PodResourcesSource(client, interval_s=3600, min_requested_gap_s=gap_s)
    async with _running(source):
        assert await _until(lambda: source.status().up, 5.0)
        yield provider, source


async def test_a_requested_refresh_answers_a_new_pod_long_before_the_schedule(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    async with _answering(start_server, client, 0.2) as (provider, source):
        provider.containers = (ContainerDevices("ml", "new", "main", "nvidia.com/gpu", (GPU0,)),)
        await asyncio.sleep(0.3)
        assert source.read(None).containers == ()  # type: ignore[arg-type]  # the hour-long schedule
        asked = time.monotonic()
        threading.Thread(target=source.request_refresh).start()  # from the sample thread
        assert await _until(lambda: bool(source.read(None).containers), 5.0)  # type: ignore[arg-type]
        assert time.monotonic() - asked < 2.0
        assert source.requests_total == 1


async def test_requests_are_answered_at_most_once_per_gap(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    async with _answering(start_server, client, 0.5) as (provider, source):
        per_fetch = provider.calls  # the first fetch's
        started = time.monotonic()
        while time.monotonic() - started < 1.6:  # a flood: asked every 10 ms
            source.request_refresh()
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        fetches = provider.calls // per_fetch - 1
        # one per 0.5 s gap, counted from when each began: 3 or 4 in 1.7 s, never 160
        assert 2 <= fetches <= 4, fetches
        assert source.requests_total >= 100


async def test_a_request_during_a_refresh_gets_a_refresh_that_begins_after_it(
    start_server: ServerFactory, client: PodResourcesClient
) -> None:
    async with _answering(start_server, client, 0.1) as (provider, source):
        per_fetch = provider.calls

        def during_second_fetch(number: int) -> None:
            # the second fetch's first RPC has taken its (old) answer: the pod starts
            # now, and the sample thread asks while that fetch is still under way
            if number == per_fetch + 1:
                provider.containers = (
                    ContainerDevices("ml", "new", "main", "nvidia.com/gpu", (GPU0,)),
                )
                asking = threading.Thread(target=source.request_refresh)
                asking.start()
                asking.join()

        provider.on_call = during_second_fetch
        source.request_refresh()  # starts the second fetch
        # the second answered from before the pod; a third, begun after the ask, has it
        assert await _until(lambda: bool(source.read(None).containers), 5.0)  # type: ignore[arg-type]
        assert provider.calls == 3 * per_fetch
        assert source.requests_total == 2


async def test_requests_do_not_cut_the_backoff_of_a_failing_kubelet(sock: Path) -> None:
    client = PodResourcesClient(sock, timeout_s=0.5)  # no server at this socket
    source = PodResourcesSource(client, interval_s=3600, min_requested_gap_s=0.05)
    try:
        async with _running(source):
            assert await _until(lambda: source.errors_total >= 1, 5.0)
            for _ in range(50):
                source.request_refresh()
                await asyncio.sleep(0.01)
            # the backoff's first wait is about 1 s: no retry within 0.5 s, however asked
            assert source.errors_total == 1
    finally:
        await client.close()


def test_a_request_before_run_or_after_the_loop_closed_is_a_no_op(sock: Path) -> None:
    source = PodResourcesSource(PodResourcesClient(sock))
    source.request_refresh()  # before run(): nothing to wake, nothing raised
    assert source.requests_total == 0

    async def run_briefly() -> None:
        async with _running(source):
            await asyncio.sleep(0.05)

    asyncio.run(run_briefly())
    source.request_refresh()  # its loop is closed: ignored, as while stopping
    assert source.requests_total == 0


def test_a_source_run_again_on_a_new_event_loop_still_answers_requests(sock: Path) -> None:
    """Each run() waits on an event of its own loop (one made in __init__ would be bound
    to the first loop that waited on it, and end the refresh task on the next)."""
    provider = _Counting()
    source = PodResourcesSource(PodResourcesClient(sock), interval_s=3600, min_requested_gap_s=0.05)

    async def phase() -> int:
        server = await start_podresources_server(sock, provider)
        try:
            async with _running(source) as task:
                assert await _until(lambda: source.status().up, 5.0)
                await asyncio.sleep(0.1)  # into the hour-long pause
                before = provider.calls
                source.request_refresh()
                assert await _until(lambda: provider.calls > before, 5.0)
                assert not task.done()
                return provider.calls - before
        finally:
            await source.client.close()
            await server.stop(grace=None)

    assert asyncio.run(phase()) > 0
    assert asyncio.run(phase()) > 0
    assert source.errors_total == 0
