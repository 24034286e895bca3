"""kubelet PodResources client: which container holds which GPU, and what the node advertises.

Talks ``v1.PodResourcesLister`` over the kubelet's unix socket with one long-lived
``grpc.aio`` channel: a connection per refresh would cost a handshake each time against
a kubelet that rate-limits this API, so the channel is created on first use and
replaced only after a call on it failed.
"""

from __future__ import annotations

import contextlib
import stat
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc
import grpc.aio

from exporter.kubelet_api import api_pb2, api_pb2_grpc
from exporter.model import (
    GPU_DRA_DRIVERS,
    GPU_RESOURCE_NAMES,
    KUBELET_POD_RESOURCES_SOCKET,
    AllocatableDevices,
    ClaimDevice,
    ContainerDevices,
    PodResourcesSnapshot,
)
from exporter.text import one_line

DEFAULT_SOCKET_PATH = KUBELET_POD_RESOURCES_SOCKET
DEFAULT_RESOURCE_NAMES = GPU_RESOURCE_NAMES
DEFAULT_DRA_DRIVERS = GPU_DRA_DRIVERS  # NVIDIA's driver; its MIG devices included
# A node with thousands of pods overflows gRPC's 4 MiB default receive limit; 16 MiB is
# what Kubernetes' own podresources client helper allows.
MAX_RECEIVE_MESSAGE_BYTES = 16 * 1024 * 1024

_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
    # Our own subchannel, so a replaced channel never inherits a shared subchannel that
    # is still backing off from the previous kubelet's death.
    ("grpc.use_local_subchannel_pool", 1),
    # Retries are ours to decide (the agent's Backoff), not the channel's.
    ("grpc.enable_retries", 0),
)


def resource_name_matches(name: str, patterns: Iterable[str]) -> bool:
    """True if ``name`` equals a pattern, or starts with a pattern's text before a trailing ``*``.

    Only a trailing ``*`` is special: MIG resource names (``nvidia.com/mig-1g.10gb``)
    are open-ended, everything else is an exact name.
    """
    for pattern in patterns:
        if pattern.endswith("*"):
            if name.startswith(pattern[:-1]):
                return True
        elif name == pattern:
            return True
    return False


class _Undecodable(Exception):
    """An answer gRPC could not decode into the method's response message."""

    def __init__(self, answer: object) -> None:
        super().__init__(
            "the kubelet's answer could not be decoded"
            if answer is None
            else f"the kubelet answered a {type(answer).__name__}, not the expected message"
        )


def _rpc_error_text(method: str, err: grpc.aio.AioRpcError) -> str:
    code = err.code()
    name = code.name if code is not None else "UNKNOWN"
    return one_line(f"PodResources {method}: {name}: {err.details() or 'no details'}")


def _allocatable_unsupported(err: grpc.aio.AioRpcError) -> bool:
    """True when the kubelet does not offer GetAllocatableResources at all.

    Kubelets older than 1.21 lack the method (UNIMPLEMENTED); 1.21-1.22 kubelets with
    the KubeletPodResourcesGetAllocatable gate off answer a plain Go error
    ("... GetAllocatableResources disabled"), which gRPC carries as UNKNOWN.
    """
    if err.code() == grpc.StatusCode.UNIMPLEMENTED:
        return True
    return err.code() == grpc.StatusCode.UNKNOWN and "disabled" in (err.details() or "")


class PodResourcesClient:
    """Reads GPU allocations from the kubelet; ``fetch()`` never raises.

    Terminal-phase pods are deliberately *not* filtered here: the v1 API carries no pod
    phase (a completed pod keeps its devices listed until the kubelet forgets it), so
    analysis decides with the pod metadata from the Kubernetes API.

    The kubelet reports one ``ContainerDevices`` per device per NUMA node, in Go map
    order; ``fetch()`` merges them into one entry per (namespace, pod, container,
    resource name) with de-duplicated, sorted device ids, so consecutive snapshots of
    an unchanged node compare equal. DRA claim devices (``dynamic_resources``) of the
    ``dra_drivers`` are flattened to one ``ClaimDevice`` per container, claim and device,
    de-duplicated and sorted for the same reason.
    """

    def __init__(
        self,
        socket_path: str | Path,
        *,
        resource_names: Sequence[str] = DEFAULT_RESOURCE_NAMES,
        dra_drivers: Sequence[str] = DEFAULT_DRA_DRIVERS,
        timeout_s: float = 1.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if isinstance(resource_names, str):
            # A bare string would be matched character by character.
            raise TypeError("resource_names must be a sequence of names, not a str")
        if isinstance(dra_drivers, str):
            raise TypeError("dra_drivers must be a sequence of driver names, not a str")
        self._dra_drivers = frozenset(dra_drivers)
        self._socket_path = Path(socket_path).absolute()
        self._target = f"unix://{self._socket_path}"
        self._resource_names = tuple(resource_names)
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: api_pb2_grpc.PodResourcesListerStub | None = None
        self._channels_created = 0

    @property
    def socket_path(self) -> Path:
        return self._socket_path

    @property
    def channels_created(self) -> int:
        """How many channels (connections) this client has opened; 1 while all is well."""
        return self._channels_created

    async def fetch(self) -> PodResourcesSnapshot:
        """One ``List`` + ``GetAllocatableResources`` round; failures become ``ok=False``.

        Each call has its own ``timeout_s`` deadline. If the allocatable call fails after
        ``List`` succeeded, the snapshot stays ``ok=True`` with ``allocatable_ok=False``;
        ``error`` then explains why unless the kubelet simply does not offer that call.
        After any other failure the channel is closed, so the next ``fetch()`` connects
        afresh instead of waiting out gRPC's own reconnect backoff.
        """
        timestamp = time.time()
        missing = self._socket_problem()
        if missing is not None:
            await self._drop_channel()
            return PodResourcesSnapshot(ok=False, timestamp=timestamp, error=missing)

        try:
            listed = await self._get_stub().List(
                api_pb2.ListPodResourcesRequest(), timeout=self._timeout_s
            )
            if not isinstance(listed, api_pb2.ListPodResourcesResponse):
                # grpc.aio logs "Exception deserializing message!" and hands over None
                # for an answer that does not decode (grpc/_common.py deserialize, from
                # UnaryUnaryCall._invoke in grpc/aio/_call.py)
                raise _Undecodable(listed)
            containers = self._containers(listed)
            claims = self._claims(listed)
        except grpc.aio.AioRpcError as err:
            await self._drop_channel()
            return PodResourcesSnapshot(
                ok=False, timestamp=timestamp, error=_rpc_error_text("List", err)
            )
        except _Undecodable as err:
            await self._drop_channel()
            return PodResourcesSnapshot(
                ok=False, timestamp=timestamp, error=f"PodResources List: {err}"
            )
        except Exception as err:  # never raise into the agent: one readable line instead
            await self._drop_channel()
            return PodResourcesSnapshot(
                ok=False,
                timestamp=timestamp,
                error=one_line(f"PodResources List: {type(err).__name__}: {err}"),
            )

        allocatable: tuple[AllocatableDevices, ...] = ()
        allocatable_ok = False
        error: str | None = None
        try:
            response = await self._get_stub().GetAllocatableResources(
                api_pb2.AllocatableResourcesRequest(), timeout=self._timeout_s
            )
            if not isinstance(response, api_pb2.AllocatableResourcesResponse):
                raise _Undecodable(response)
            allocatable = self._allocatable(response)
            allocatable_ok = True
        except grpc.aio.AioRpcError as err:
            if not _allocatable_unsupported(err):
                # Unexpected: the connection may be broken, start afresh next time.
                await self._drop_channel()
                error = _rpc_error_text("GetAllocatableResources", err)
        except _Undecodable as err:
            await self._drop_channel()
            error = f"PodResources GetAllocatableResources: {err}"
        except Exception as err:
            await self._drop_channel()
            error = one_line(f"PodResources GetAllocatableResources: {type(err).__name__}: {err}")

        return PodResourcesSnapshot(
            ok=True,
            timestamp=timestamp,
            error=error,
            containers=containers,
            allocatable=allocatable,
            allocatable_ok=allocatable_ok,
            claims=claims,
        )

    async def close(self) -> None:
        """Close the channel; a later ``fetch()`` would open a new one."""
        await self._drop_channel()

    # -- internals ---------------------------------------------------------------------

    def _socket_problem(self) -> str | None:
        """A readable reason when the socket cannot work, instead of gRPC's connect error.

        A single ``stat`` of a local path: cheap enough for the event loop.
        """
        try:
            mode = self._socket_path.stat().st_mode
        except FileNotFoundError:
            return (
                f"PodResources socket {self._socket_path} does not exist "
                "(kubelet not running, or the pod-resources directory is not mounted)"
            )
        except OSError as err:
            return one_line(f"PodResources socket {self._socket_path}: {err.strerror or err}")
        if not stat.S_ISSOCK(mode):
            return f"PodResources socket {self._socket_path} is not a unix socket"
        return None

    def _get_stub(self) -> api_pb2_grpc.PodResourcesListerStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self._target, options=_CHANNEL_OPTIONS)
            # The generated gRPC module is untyped.
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)  # type: ignore[no-untyped-call]
            self._channels_created += 1
        return self._stub

    async def _drop_channel(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            with contextlib.suppress(Exception):
                await channel.close(grace=None)

    def _containers(
        self, response: api_pb2.ListPodResourcesResponse
    ) -> tuple[ContainerDevices, ...]:
        merged: dict[tuple[str, str, str, str], set[str]] = {}
        for pod in response.pod_resources:
            for container in pod.containers:
                for devices in container.devices:
                    if not resource_name_matches(devices.resource_name, self._resource_names):
                        continue
                    key = (pod.namespace, pod.name, container.name, devices.resource_name)
                    merged.setdefault(key, set()).update(devices.device_ids)
        return tuple(
            ContainerDevices(
                namespace=namespace,
                pod=pod_name,
                container=container_name,
                resource_name=resource_name,
                device_ids=tuple(sorted(ids)),
            )
            for (namespace, pod_name, container_name, resource_name), ids in sorted(merged.items())
        )

    def _claims(self, response: api_pb2.ListPodResourcesResponse) -> tuple[ClaimDevice, ...]:
        """Claim devices of the wanted DRA drivers; other drivers' devices (NICs,
        other vendors' GPUs) are not ours to attribute."""
        found: set[ClaimDevice] = set()
        for pod in response.pod_resources:
            for container in pod.containers:
                for dynamic in container.dynamic_resources:
                    for resource in dynamic.claim_resources:
                        if resource.driver_name not in self._dra_drivers:
                            continue
                        found.add(
                            ClaimDevice(
                                namespace=pod.namespace,
                                pod=pod.name,
                                container=container.name,
                                claim_namespace=dynamic.claim_namespace,
                                claim_name=dynamic.claim_name,
                                driver=resource.driver_name,
                                pool=resource.pool_name,
                                device=resource.device_name,
                                cdi_devices=tuple(sorted({c.name for c in resource.cdi_devices})),
                                # an empty share_id is what a pre-1.35 kubelet sends: unshared
                                share_id=resource.share_id or None,
                            )
                        )
        return tuple(sorted(found, key=_claim_order))

    def _allocatable(
        self, response: api_pb2.AllocatableResourcesResponse
    ) -> tuple[AllocatableDevices, ...]:
        merged: dict[str, set[str]] = {}
        for devices in response.devices:
            if resource_name_matches(devices.resource_name, self._resource_names):
                merged.setdefault(devices.resource_name, set()).update(devices.device_ids)
        return tuple(
            AllocatableDevices(resource_name=name, device_ids=tuple(sorted(ids)))
            for name, ids in sorted(merged.items())
        )


def _claim_order(claim: ClaimDevice) -> tuple[str, ...]:
    return (
        claim.namespace,
        claim.pod,
        claim.container,
        claim.claim_namespace,
        claim.claim_name,
        claim.driver,
        claim.pool,
        claim.device,
        claim.share_id or "",
        *claim.cdi_devices,
    )
