"""A real kubelet PodResources gRPC server on a unix socket, for the simulated node.

The exporter's client talks to it exactly as to a kubelet (same proto, same socket
transport), so tests and demos exercise the real client code path. Allocations come
from a provider called on every request, so a simulator timeline can move devices
between pods while the server runs. A provider returns (containers, allocatable) or,
with DRA claims, (containers, allocatable, claims), or with the containers List names
that hold no device (the kubelet lists every regular container), (containers,
allocatable, claims, listed).

``undecodable_lists`` makes the first so many ``List`` answers bytes that are no
``ListPodResourcesResponse`` (a corrupt wire format), as a kubelet with a broken
encoder or a mangling proxy would send: the client's gRPC receives a successful call
whose message does not decode.

``synthetic_containers`` appends that many pods to every ``List`` answer, each with one
container holding one ``nvidia.com/gpu`` device id that names no GPU
(``synthetic-<i>``): the bulk of a kubelet answer that brings in far more than any node
has, built and serialised once, so that serving it costs the server almost nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeAlias

import grpc
import grpc.aio

from exporter.kubelet_api import api_pb2, api_pb2_grpc
from exporter.model import AllocatableDevices, ClaimDevice, ContainerDevices

# (namespace, pod, container): a container List names with no device (sim.node)
ListedContainer: TypeAlias = tuple[str, str, str]
Allocations: TypeAlias = (
    tuple[Sequence[ContainerDevices], Sequence[AllocatableDevices]]
    | tuple[Sequence[ContainerDevices], Sequence[AllocatableDevices], Sequence[ClaimDevice]]
    | tuple[
        Sequence[ContainerDevices],
        Sequence[AllocatableDevices],
        Sequence[ClaimDevice],
        Sequence[ListedContainer],
    ]
)
# Sync providers run inline on the event loop (they should be cheap); an async one lets
# a test stall a request without blocking the loop the client shares.
PodResourcesProvider: TypeAlias = Callable[[], Allocations | Awaitable[Allocations]]

# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_SOCKET_PATH_BYTES = 107
# Field 1 (pod_resources), length-delimited, whose length varint never ends: protobuf's
# parser answers "Wire format was corrupt".
UNDECODABLE = b"\x0a\xff"
SYNTHETIC_RESOURCE = "nvidia.com/gpu"


def synthetic_pods(count: int) -> bytes:
    """``count`` pods in ``ListPodResourcesResponse`` wire format: a repeated field's
    entries concatenate, so these bytes can follow any answer's own."""
    return api_pb2.ListPodResourcesResponse(
        pod_resources=[
            api_pb2.PodResources(
                namespace="synthetic",
                name=f"synthetic-{i}",
                containers=[
                    api_pb2.ContainerResources(
                        name="c",
                        devices=[
                            api_pb2.ContainerDevices(
                                resource_name=SYNTHETIC_RESOURCE, device_ids=[f"synthetic-{i}"]
                            )
                        ],
                    )
                ],
            )
            for i in range(count)
        ]
    ).SerializeToString()


def _device_entries(
    resource_name: str, device_ids: Sequence[str], split: bool
) -> list[api_pb2.ContainerDevices]:
    if split:
        return [
            api_pb2.ContainerDevices(resource_name=resource_name, device_ids=[device_id])
            for device_id in device_ids
        ]
    return [api_pb2.ContainerDevices(resource_name=resource_name, device_ids=list(device_ids))]


def _claim_entries(claims: Sequence[ClaimDevice]) -> list[api_pb2.DynamicResource]:
    """One ``DynamicResource`` per claim, its devices in first-seen order."""
    by_claim: dict[tuple[str, str], list[api_pb2.ClaimResource]] = {}
    for claim in claims:
        by_claim.setdefault((claim.claim_namespace, claim.claim_name), []).append(
            api_pb2.ClaimResource(
                cdi_devices=[api_pb2.CDIDevice(name=name) for name in claim.cdi_devices],
                driver_name=claim.driver,
                pool_name=claim.pool,
                device_name=claim.device,
                share_id=claim.share_id,  # None leaves the optional field unset
            )
        )
    return [
        api_pb2.DynamicResource(
            claim_name=name, claim_namespace=namespace, claim_resources=resources
        )
        for (namespace, name), resources in by_claim.items()
    ]


def build_pod_resources(
    containers: Sequence[ContainerDevices],
    claims: Sequence[ClaimDevice] = (),
    *,
    split_devices: bool = False,
    listed: Sequence[ListedContainer] = (),
) -> list[api_pb2.PodResources]:
    """Group flat allocations as the kubelet does: pod > container > resource name, and
    pod > container > claim for DRA devices.

    One ``PodResources`` per (namespace, pod), one ``ContainerResources`` per container,
    one ``ContainerDevices`` per resource name (device ids merged, first-seen order) —
    or, with ``split_devices``, one per device, which is what a real kubelet sends —
    and one ``DynamicResource`` per claim the container uses.
    """
    devices: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
    dynamic: dict[tuple[str, str], dict[str, list[ClaimDevice]]] = {}
    for namespace, pod, container in listed:  # every container, as the kubelet lists
        devices.setdefault((namespace, pod), {}).setdefault(container, {})
        dynamic.setdefault((namespace, pod), {}).setdefault(container, [])
    for entry in containers:
        by_resource = devices.setdefault((entry.namespace, entry.pod), {}).setdefault(
            entry.container, {}
        )
        ids = by_resource.setdefault(entry.resource_name, [])
        ids.extend(d for d in entry.device_ids if d not in ids)
        dynamic.setdefault((entry.namespace, entry.pod), {}).setdefault(entry.container, [])
    for claim in claims:
        devices.setdefault((claim.namespace, claim.pod), {}).setdefault(claim.container, {})
        dynamic.setdefault((claim.namespace, claim.pod), {}).setdefault(claim.container, []).append(
            claim
        )
    return [
        api_pb2.PodResources(
            namespace=namespace,
            name=pod,
            containers=[
                api_pb2.ContainerResources(
                    name=container,
                    devices=[
                        entry
                        for resource_name, ids in by_resource.items()
                        for entry in _device_entries(resource_name, ids, split_devices)
                    ],
                    dynamic_resources=_claim_entries(dynamic[(namespace, pod)][container]),
                )
                for container, by_resource in by_container.items()
            ],
        )
        for (namespace, pod), by_container in devices.items()
    ]


_Unpacked: TypeAlias = tuple[
    Sequence[ContainerDevices],
    Sequence[AllocatableDevices],
    Sequence[ClaimDevice],
    Sequence[ListedContainer],
]


def _unpack(allocations: Allocations) -> _Unpacked:
    if len(allocations) == 4:
        return allocations
    if len(allocations) == 3:
        return (*allocations, ())
    containers, allocatable = allocations
    return containers, allocatable, (), ()


class PodResourcesServicer(api_pb2_grpc.PodResourcesListerServicer):
    """``v1.PodResourcesLister`` backed by a provider.

    ``allocatable_implemented=False`` answers GetAllocatableResources with UNIMPLEMENTED,
    as a pre-1.21 kubelet does.
    """

    def __init__(
        self,
        provider: PodResourcesProvider,
        *,
        allocatable_implemented: bool = True,
        split_devices: bool = False,
        undecodable_lists: int = 0,
        synthetic_containers: int = 0,
    ) -> None:
        self._provider = provider
        self._allocatable_implemented = allocatable_implemented
        self._split_devices = split_devices
        self.undecodable_lists = undecodable_lists  # List answers still to corrupt
        self._synthetic = synthetic_pods(synthetic_containers) if synthetic_containers else b""

    def serialize_list(self, response: api_pb2.ListPodResourcesResponse) -> bytes:
        """The List answer's bytes (with the synthetic pods), or undecodable ones while
        ``undecodable_lists`` > 0."""
        if self.undecodable_lists > 0:
            self.undecodable_lists -= 1
            return UNDECODABLE
        return response.SerializeToString() + self._synthetic

    async def _allocations(self) -> _Unpacked:
        result = self._provider()
        if inspect.isawaitable(result):
            return _unpack(await result)
        return _unpack(result)

    async def List(
        self, request: api_pb2.ListPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ListPodResourcesResponse:
        containers, _, claims, listed = await self._allocations()
        return api_pb2.ListPodResourcesResponse(
            pod_resources=build_pod_resources(
                containers, claims, split_devices=self._split_devices, listed=listed
            )
        )

    async def GetAllocatableResources(
        self, request: api_pb2.AllocatableResourcesRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.AllocatableResourcesResponse:
        if not self._allocatable_implemented:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "Method GetAllocatableResources not implemented"
            )
        _, allocatable, _, _ = await self._allocations()
        merged: dict[str, dict[str, None]] = {}  # insertion-ordered sets: linear in ids
        for entry in allocatable:
            merged.setdefault(entry.resource_name, {}).update(dict.fromkeys(entry.device_ids))
        return api_pb2.AllocatableResourcesResponse(
            devices=[
                device
                for name, ids in merged.items()
                for device in _device_entries(name, list(ids), self._split_devices)
            ]
        )

    async def Get(
        self, request: api_pb2.GetPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.GetPodResourcesResponse:
        containers, _, claims, _ = await self._allocations()
        key = (request.pod_namespace, request.pod_name)
        wanted = [c for c in containers if (c.namespace, c.pod) == key]
        wanted_claims = [c for c in claims if (c.namespace, c.pod) == key]
        if not wanted and not wanted_claims:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        (pod,) = build_pod_resources(wanted, wanted_claims, split_devices=self._split_devices)
        return api_pb2.GetPodResourcesResponse(pod_resources=pod)


async def start_podresources_server(
    socket_path: Path,
    provider: PodResourcesProvider,
    *,
    allocatable_implemented: bool = True,
    split_devices: bool = False,
    undecodable_lists: int = 0,
    synthetic_containers: int = 0,
) -> grpc.aio.Server:
    """Serve ``v1.PodResourcesLister`` on ``socket_path``; stop with ``server.stop(None)``.

    A stale socket file at the path is replaced, as the kubelet does on restart.
    """
    path = Path(socket_path).absolute()
    if len(str(path).encode()) > _MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"unix socket path is {len(str(path).encode())} bytes, the limit is "
            f"{_MAX_SOCKET_PATH_BYTES}: {path}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    server = grpc.aio.server()
    servicer = PodResourcesServicer(
        provider,
        allocatable_implemented=allocatable_implemented,
        split_devices=split_devices,
        undecodable_lists=undecodable_lists,
        synthetic_containers=synthetic_containers,
    )
    _add_servicer(servicer, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server


def _add_servicer(servicer: PodResourcesServicer, server: grpc.aio.Server) -> None:
    """``api_pb2_grpc.add_PodResourcesListerServicer_to_server``, with List's answer
    serialised by the servicer (so that it can corrupt it)."""
    handlers = {
        "List": grpc.unary_unary_rpc_method_handler(
            servicer.List,
            request_deserializer=api_pb2.ListPodResourcesRequest.FromString,
            response_serializer=servicer.serialize_list,
        ),
        "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
            servicer.GetAllocatableResources,
            request_deserializer=api_pb2.AllocatableResourcesRequest.FromString,
            response_serializer=api_pb2.AllocatableResourcesResponse.SerializeToString,
        ),
        "Get": grpc.unary_unary_rpc_method_handler(
            servicer.Get,
            request_deserializer=api_pb2.GetPodResourcesRequest.FromString,
            response_serializer=api_pb2.GetPodResourcesResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("v1.PodResourcesLister", handlers),)
    )
    server.add_registered_method_handlers("v1.PodResourcesLister", handlers)
