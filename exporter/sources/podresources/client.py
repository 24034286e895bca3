"""kubelet PodResources client: which container holds which GPU, and what the node advertises.

Talks ``v1.PodResourcesLister`` over the kubelet's unix socket with a ``grpc.aio``
channel of its own for each refresh, closed when the refresh is done. While any channel
is open, gRPC core runs threads of its own (four event-engine pollers, a timer and a
lifeguard) that wake ~35 times a second: ~1.4 ms/s of CPU on an idle node between
refreshes, most of the exporter's idle floor (benchmarks/README.md, "Idle floor"). With
no channel open those threads end. What a channel per refresh costs instead is a
``connect()`` on a local socket and the HTTP/2 preface, ~1 ms of CPU every
``--pod-resources-interval``; the kubelet does not count it, since its rate limit counts
calls, not connections (a unary server interceptor, 100 calls/s with a burst of 10:
kubernetes/kubernetes pkg/kubelet/apis/podresources/grpc/ratelimit.go). A refresh after
a failed one starts afresh by construction, never waiting out gRPC's reconnect backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
import grpc.aio

from exporter.kubelet_api import api_pb2
from exporter.model import (
    GPU_DRA_DRIVERS,
    GPU_RESOURCE_NAMES,
    KUBELET_POD_RESOURCES_SOCKET,
    AllocatableDevices,
    PodResourcesSnapshot,
)
from exporter.sources.podresources.answer import (
    MAX_ADVERTISED_IDS,
    MAX_GPU_ALLOCATIONS,
    OverCeiling,
    Undecodable,
    allocatable_answer,
    list_answer,
)
from exporter.sources.podresources.answer import (
    resource_name_matches as resource_name_matches,  # re-exported: callers import it here
)
from exporter.text import one_line

DEFAULT_SOCKET_PATH = KUBELET_POD_RESOURCES_SOCKET
DEFAULT_RESOURCE_NAMES = GPU_RESOURCE_NAMES
DEFAULT_DRA_DRIVERS = GPU_DRA_DRIVERS  # NVIDIA's driver; its MIG devices included
# A node with thousands of pods overflows gRPC's 4 MiB default receive limit; 16 MiB is
# what Kubernetes' own podresources client helper allows.
MAX_RECEIVE_MESSAGE_BYTES = 16 * 1024 * 1024
# Answers up to this size are decoded on the event loop: ~50 us per KiB (a node of
# node-8gpu's size answers ~2 KiB, decoded in ~0.1 ms), less than handing the work to a
# worker thread costs in wake-ups (~0.4 ms per hand-over on a small VM, two per refresh:
# benchmarks/README.md, "Idle floor"). Larger answers go to a worker thread, so a 16 MiB
# one never holds up a scrape or a probe.
INLINE_DECODE_BYTES = 4096

_Decoded = TypeVar("_Decoded")

_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
    # Our own subchannel, so a replaced channel never inherits a shared subchannel that
    # is still backing off from the previous kubelet's death.
    ("grpc.use_local_subchannel_pool", 1),
    # Retries are ours to decide (the agent's Backoff), not the channel's.
    ("grpc.enable_retries", 0),
)


# File descriptors a channel needs before its first call (the socket, gRPC core's epoll
# sets and wake-up fds), with room to spare: with 14-16 free, a refresh already worked
# or failed by turns (an adversarial review), never with fewer than ~13.
CHANNEL_DESCRIPTORS = 32


def _descriptor_problem() -> str | None:
    """A reason when this process has too few file descriptors free for a channel.

    gRPC core does not fail a channel it cannot give an epoll set: it aborts the process
    (``ev_epoll1_linux.cc``: "Check failed: init_epoll1_linux()", SIGABRT), and with no
    channel open it makes one anew for each refresh. Out of descriptors (RLIMIT_NOFILE
    reached: a flood of connections, a leak elsewhere), the refresh fails as a kubelet
    that does not answer would, and the next one tries again. Opening and closing
    ``CHANNEL_DESCRIPTORS`` descriptors of /dev/null costs ~60 us.
    """
    opened: list[int] = []
    try:
        for _ in range(CHANNEL_DESCRIPTORS):
            opened.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as err:
        return one_line(
            f"PodResources not asked: too few file descriptors free for a gRPC channel "
            f"({errno.errorcode.get(err.errno or 0, err.errno)}: {err.strerror}); gRPC "
            "core would abort the process"
        )
    finally:
        for fd in opened:
            os.close(fd)
    return None


class _Lister:
    """The two calls this client makes, each answering its message's bytes undecoded.

    Decoding happens in ``answer.py``, in a worker thread and within its ceilings: a
    16 MiB answer decoded whole on the event loop took ~0.1 s and ~150 MB before any of
    it was looked at (the generated stub decodes in gRPC's callback, on the loop).
    """

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.list = channel.unary_unary(
            "/v1.PodResourcesLister/List",
            request_serializer=api_pb2.ListPodResourcesRequest.SerializeToString,
            response_deserializer=None,  # the bytes, as received
        )
        self.allocatable = channel.unary_unary(
            "/v1.PodResourcesLister/GetAllocatableResources",
            request_serializer=api_pb2.AllocatableResourcesRequest.SerializeToString,
            response_deserializer=None,
        )


def _answer_bytes(answer: object) -> bytes:
    if not isinstance(answer, bytes):
        raise Undecodable()
    return answer


async def _decode(decode: Callable[..., _Decoded], answer: bytes, *args: object) -> _Decoded:
    """``decode(answer, *args)``: here if the answer is small, else in a worker thread."""
    if len(answer) <= INLINE_DECODE_BYTES:
        return decode(answer, *args)
    return await asyncio.to_thread(decode, answer, *args)


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
        max_gpu_allocations: int = MAX_GPU_ALLOCATIONS,
        max_advertised_ids: int = MAX_ADVERTISED_IDS,
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
        self._lister: _Lister | None = None
        self._channels_created = 0
        self._max_allocations = max_gpu_allocations
        self._max_advertised = max_advertised_ids

    @property
    def socket_path(self) -> Path:
        return self._socket_path

    @property
    def channels_created(self) -> int:
        """How many channels (connections) this client has opened: one per ``fetch()``
        that reached the socket."""
        return self._channels_created

    @property
    def channel_open(self) -> bool:
        """Whether a channel is open now: only during a ``fetch()``."""
        return self._channel is not None

    async def fetch(self) -> PodResourcesSnapshot:
        """One ``List`` + ``GetAllocatableResources`` round; failures become ``ok=False``.

        Each call has its own ``timeout_s`` deadline. If the allocatable call fails after
        ``List`` succeeded, the snapshot stays ``ok=True`` with ``allocatable_ok=False``;
        ``error`` then explains why unless the kubelet simply does not offer that call.
        The round's channel is closed when it returns, whatever happened (the module
        says why), so the next ``fetch()`` connects afresh.

        An answer over ``INLINE_DECODE_BYTES`` is decoded in a worker thread, so probes
        and scrapes never wait on it; a small one is decoded here, in less time than the
        hand-over to a thread costs. An answer over a ceiling of ``answer.py`` (GPU
        allocations in ``List``, advertised GPU ids in ``GetAllocatableResources``) fails
        the whole round: no allocations are handed over, as when the kubelet is down,
        rather than a part.
        """
        try:
            return await self._round(time.time())
        finally:
            await self._drop_channel()

    async def _round(self, timestamp: float) -> PodResourcesSnapshot:
        missing = self._socket_problem() or _descriptor_problem()
        if missing is not None:
            return PodResourcesSnapshot(ok=False, timestamp=timestamp, error=missing)

        try:
            listed = _answer_bytes(
                await self._get_lister().list(
                    api_pb2.ListPodResourcesRequest(), timeout=self._timeout_s
                )
            )
            answer = await _decode(
                list_answer, listed, self._resource_names, self._dra_drivers, self._max_allocations
            )
            del listed  # up to 16 MiB: not held while GetAllocatableResources is asked
        except OverCeiling as err:  # the connection is fine, the answer is not
            return PodResourcesSnapshot(
                ok=False, timestamp=timestamp, error=f"PodResources List: {err}"
            )
        except grpc.aio.AioRpcError as err:
            return PodResourcesSnapshot(
                ok=False, timestamp=timestamp, error=_rpc_error_text("List", err)
            )
        except Undecodable as err:
            return PodResourcesSnapshot(
                ok=False, timestamp=timestamp, error=f"PodResources List: {err}"
            )
        except Exception as err:  # never raise into the agent: one readable line instead
            return PodResourcesSnapshot(
                ok=False,
                timestamp=timestamp,
                error=one_line(f"PodResources List: {type(err).__name__}: {err}"),
            )

        allocatable: tuple[AllocatableDevices, ...] = ()
        allocatable_ok = False
        error: str | None = None
        try:
            response = _answer_bytes(
                await self._get_lister().allocatable(
                    api_pb2.AllocatableResourcesRequest(), timeout=self._timeout_s
                )
            )
            allocatable = await _decode(
                allocatable_answer, response, self._resource_names, self._max_advertised
            )
            allocatable_ok = True
        except OverCeiling as err:
            return PodResourcesSnapshot(
                ok=False,
                timestamp=timestamp,
                error=f"PodResources GetAllocatableResources: {err}",
            )
        except grpc.aio.AioRpcError as err:
            if not _allocatable_unsupported(err):
                error = _rpc_error_text("GetAllocatableResources", err)
        except Undecodable as err:
            error = f"PodResources GetAllocatableResources: {err}"
        except Exception as err:
            error = one_line(f"PodResources GetAllocatableResources: {type(err).__name__}: {err}")

        return PodResourcesSnapshot(
            ok=True,
            timestamp=timestamp,
            error=error,
            containers=answer.containers,
            allocatable=allocatable,
            allocatable_ok=allocatable_ok,
            claims=answer.claims,
            listed=answer.listed,
            claims_reported=answer.claims_reported,
            other_devices=answer.other_devices,
        )

    async def close(self) -> None:
        """Close a channel left open (a ``fetch()`` cancelled mid-round closes its own on
        the way out; this is for shutdown's sake)."""
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

    def _get_lister(self) -> _Lister:
        # Only after _descriptor_problem() found descriptors free: gRPC core aborts the
        # whole process when it cannot create its epoll set.
        if self._lister is None:
            self._channel = grpc.aio.insecure_channel(self._target, options=_CHANNEL_OPTIONS)
            self._lister = _Lister(self._channel)
            self._channels_created += 1
        return self._lister

    async def _drop_channel(self) -> None:
        channel, self._channel, self._lister = self._channel, None, None
        if channel is not None:
            with contextlib.suppress(Exception):
                await channel.close(grace=None)
