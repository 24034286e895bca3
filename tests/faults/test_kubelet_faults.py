"""The kubelet's PodResources socket misbehaving, driven through the real gRPC client.

The exporter runs in-process (``tests/harness.py``) with ``--pod-resources-socket``
pointing at a path the test owns: the simulated kubelet (the real gRPC server of
``exporter/sim/podresources_server.py`` serving the scenario's allocations), a raw unix
socket server that misbehaves below gRPC, or nothing at all. Refreshes are the test's
(``Harness.refresh_pod_resources``), except where the retry schedule itself is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import grpc.aio
import pytest

from exporter.sim.podresources_server import start_podresources_server
from exporter.sources.base import Cycle
from exporter.sources.podresources.client import MAX_RECEIVE_MESSAGE_BYTES, PodResourcesClient
from exporter.sources.podresources.source import PodResourcesSource
from tests.faults.conftest import RecordFault
from tests.harness import Harness, Scrape, simulated_exporter
from tests.test_podresources import sock, sock_dir

__all__ = ["sock", "sock_dir"]  # fixtures, shared with test_podresources

SCENARIO = "single-gpu"  # one H100, one pod holding it through the device plugin
SOURCE_LOG = "exporter.sources.podresources.source"
ALLOCATED = "gpu_container_allocated"
MEMORY = "gpu_container_memory_used_bytes"


@asynccontextmanager
async def exporter_on(path: Path) -> AsyncIterator[Harness]:
    """The exporter on the single-GPU node (pod watch on), its kubelet socket at ``path``."""
    argv = ["--pod-resources-socket", str(path)]
    async with simulated_exporter(SCENARIO, argv=argv) as h:
        yield h


async def sim_kubelet(h: Harness, path: Path) -> grpc.aio.Server:
    """The simulated node's kubelet serving at ``path`` (a stale socket file is replaced,
    as a restarting kubelet does)."""
    node = h.env.node
    return await start_podresources_server(
        path,
        lambda: (node.container_devices(), node.allocatable_devices(), node.claim_devices()),
    )


async def scraped(h: Harness) -> Scrape:
    await h.cycle()
    return await h.scrape()


def up(scrape: Scrape) -> float:
    return scrape.get("gpu_exporter_source_up", source="podresources")


def errors(scrape: Scrape) -> float:
    return scrape.get("gpu_exporter_errors_total", source="podresources")


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == SOURCE_LOG and r.levelno >= logging.WARNING
    ]


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    began = time.monotonic()
    await call()
    return time.monotonic() - began


@asynccontextmanager
async def raw_unix_server(
    path: Path, handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
) -> AsyncIterator[list[int]]:
    """A unix socket server below gRPC; yields a list counting accepted connections."""
    accepted: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handle(reader, writer)
            await reader.read()  # hold the connection until the client gives up on it
        finally:
            writer.close()

    server = await asyncio.start_unix_server(serve, path=str(path))
    try:
        yield accepted
    finally:
        server.close()
        path.unlink(missing_ok=True)


async def say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accept, read what the client sends (its HTTP/2 preface), never answer."""


async def say_garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer the HTTP/2 preface with bytes that are no HTTP/2 frame."""
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" + bytes(range(256)))
    await writer.drain()


# ---------------------------------------------------------------------------


async def test_socket_missing_at_start(
    sock: Path, caplog: pytest.LogCaptureFixture, record_fault: RecordFault
) -> None:
    caplog.set_level(logging.INFO, logger=SOURCE_LOG)
    async with exporter_on(sock) as h:
        refresh_s = await timed(h.refresh_pod_resources)
        scrape = await scraped(h)
        status = h.pod_resources.status()
        snap = h.pod_resources.read(Cycle(timestamp=time.time()))

    assert up(scrape) == 0
    assert errors(scrape) >= 1
    assert status.error is not None
    assert str(sock) in status.error and "does not exist" in status.error
    assert "\n" not in status.error
    assert snap.containers == () and snap.allocatable_ok is False
    # The node is still served: the GPU and its memory by cgroup, only allocations missing.
    assert len(scrape.series("gpu_info")) == 1
    assert scrape.series(MEMORY)
    assert ALLOCATED not in scrape.values
    assert refresh_s < 0.05  # a stat of the path, no connect attempt
    logged = warnings(caplog)
    assert len(logged) == 1 and "does not exist" in logged[0], logged

    record_fault(
        "kubelet-socket-missing-at-start",
        expected="The exporter starts and serves the GPU with memory attributed by cgroup; "
        "source_up{source=podresources} is 0 with the missing path named in one warning.",
        figure=f"each refresh failed in {refresh_s * 1000:.1f} ms (a stat, no connect); "
        f"{len(scrape.series(MEMORY))} container memory series served, "
        f"0 allocation series; {len(logged)} warning line",
    )


@pytest.mark.slow  # waits on the real retry schedule (the first retry is 0.8-1 s)
async def test_socket_appears_later(
    sock: Path, caplog: pytest.LogCaptureFixture, record_fault: RecordFault
) -> None:
    caplog.set_level(logging.INFO, logger=SOURCE_LOG)
    async with exporter_on(sock) as h:
        source = h.pod_resources
        assert up(await scraped(h)) == 0
        retrying = asyncio.create_task(source.run())  # the agent's refresh task
        try:
            await asyncio.sleep(0.05)  # its first attempt fails too
            server = await sim_kubelet(h, sock)
            appeared = time.monotonic()
            while not source.status().up and time.monotonic() - appeared < 5:
                await asyncio.sleep(0.01)
            recovered_s = time.monotonic() - appeared
            scrape = await scraped(h)
        finally:
            retrying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await retrying
        await server.stop(None)

    assert up(scrape) == 1
    assert len(scrape.series(ALLOCATED)) == 1
    assert recovered_s < 1.5  # the first retry of the 1 s backoff, not a later one
    connected = [r.getMessage() for r in caplog.records if "connected" in r.getMessage()]
    assert len(connected) == 1

    record_fault(
        "kubelet-socket-appears-later",
        expected="The refresh task retries with backoff (1 s doubling, at most 6 "
        "intervals) and the source comes up at the first retry after the socket appears, "
        "allocations served again.",
        figure=f"recovered {recovered_s:.2f} s after the socket appeared (first retry); "
        f"{len(scrape.series(ALLOCATED))} allocation series back",
    )


async def test_kubelet_restart(
    sock: Path, caplog: pytest.LogCaptureFixture, record_fault: RecordFault
) -> None:
    caplog.set_level(logging.INFO, logger=SOURCE_LOG)
    async with exporter_on(sock) as h:
        server = await sim_kubelet(h, sock)  # after start-up's refresh found none
        await h.refresh_pod_resources()
        before = await scraped(h)
        client = h.pod_resources.client
        channels_before = client.channels_created
        caplog.clear()

        # A restart between two refreshes (the usual case: the kubelet is back within
        # seconds, the refresh interval is 10 s) loses nothing.
        await server.stop(None)
        assert not sock.exists()  # the old kubelet's socket is gone...
        server = await sim_kubelet(h, sock)  # ...and a new one is there
        quick_s = await timed(h.refresh_pod_resources)
        quick = await scraped(h)
        quick_channels = client.channels_created

        # A refresh while it is down fails; the first one after it is back recovers.
        await server.stop(None)
        await h.refresh_pod_resources()
        during = await scraped(h)
        during_error = h.pod_resources.status().error
        server = await sim_kubelet(h, sock)
        recover_s = await timed(h.refresh_pod_resources)
        after = await scraped(h)
        channels = client.channels_created
        await server.stop(None)

    assert up(before) == 1 and len(before.series(ALLOCATED)) == 1
    assert up(quick) == 1 and quick.series(ALLOCATED) == before.series(ALLOCATED)
    assert errors(quick) == errors(before)
    assert quick_channels == channels_before + 1  # each refresh has a channel of its own
    assert up(during) == 0 and errors(during) == errors(before) + 1
    assert during_error is not None and "\n" not in during_error
    assert ALLOCATED not in during.values  # allocations unknown, not stale
    assert during.series(MEMORY) == before.series(MEMORY)  # attribution by cgroup kept
    assert up(after) == 1 and after.series(ALLOCATED) == before.series(ALLOCATED)
    assert channels == quick_channels + 1  # none while the socket was gone, one to recover
    assert not client.channel_open  # none left open between refreshes
    assert len(warnings(caplog)) == 1

    record_fault(
        "kubelet-restart",
        expected="A kubelet restart between refreshes loses no refresh; one during a "
        "refresh makes that refresh fail (source down, allocations dropped, memory kept) "
        "and the next one recovers on a new channel.",
        figure=f"restart between refreshes: 0 refreshes lost, next refresh "
        f"{quick_s * 1000:.1f} ms (a channel per refresh); restart during one: 1 refresh lost, "
        f"recovered on the next in {recover_s * 1000:.1f} ms; "
        f"{len(before.series(ALLOCATED))} allocation series dropped then back, "
        f"{len(before.series(MEMORY))} memory series kept",
    )


@pytest.mark.slow  # waits out the 1 s call deadline twice
async def test_kubelet_accepts_and_never_answers(sock: Path, record_fault: RecordFault) -> None:
    async with exporter_on(sock) as h:
        # Below gRPC: the connection is accepted, the HTTP/2 handshake never answered.
        async with raw_unix_server(sock, say_nothing) as accepted:
            began = time.monotonic()
            refreshing = asyncio.create_task(h.refresh_pod_resources())
            await asyncio.sleep(0.2)
            scrape_s = await timed(h.scrape)  # the event loop is not blocked meanwhile
            await refreshing
            silent_s = time.monotonic() - began
            silent = await scraped(h)
            silent_error = h.pod_resources.status().error

        # Above it: a kubelet that takes the call and never returns from it.
        async def hung() -> tuple[tuple[()], tuple[()]]:
            await asyncio.sleep(30)
            return (), ()

        server = await start_podresources_server(sock, hung)
        try:
            hung_s = await timed(h.refresh_pod_resources)
            hung_error = h.pod_resources.status().error
        finally:
            await server.stop(None)

    assert accepted
    assert up(silent) == 0
    assert silent_error is not None and "DEADLINE_EXCEEDED" in silent_error
    assert hung_error is not None and "DEADLINE_EXCEEDED" in hung_error
    assert 0.9 <= silent_s < 1.5
    assert 0.9 <= hung_s < 1.5
    assert scrape_s < 0.2

    record_fault(
        "kubelet-never-answers",
        expected="Each PodResources call has a 1 s deadline: a socket that accepts and "
        "never speaks HTTP/2, or a kubelet that never returns from List, fails the refresh "
        "with DEADLINE_EXCEEDED; scrapes are served meanwhile.",
        figure=f"refresh failed after {silent_s:.2f} s (silent socket) and {hung_s:.2f} s "
        f"(hung List); a scrape during it took {scrape_s * 1000:.1f} ms",
    )


async def test_kubelet_answers_garbage_bytes(sock: Path, record_fault: RecordFault) -> None:
    async with exporter_on(sock) as h:
        errors_before = errors(await h.scrape())  # start-up found no socket
        async with raw_unix_server(sock, say_garbage) as accepted:
            failed_s = await timed(h.refresh_pod_resources)
            failed = await scraped(h)
            error = h.pod_resources.status().error
        server = await sim_kubelet(h, sock)
        recover_s = await timed(h.refresh_pod_resources)
        after = await scraped(h)
        await server.stop(None)

    assert accepted
    assert up(failed) == 0 and errors(failed) == errors_before + 1
    assert error is not None
    assert error.startswith("PodResources List: UNAVAILABLE:") and "HTTP/2" in error
    assert "\n" not in error
    assert failed_s < 0.5  # refused as soon as the first frame is wrong, no deadline wait
    assert up(after) == 1 and len(after.series(ALLOCATED)) == 1

    record_fault(
        "kubelet-garbage-bytes",
        expected="Bytes that are not HTTP/2 fail the refresh at once with UNAVAILABLE "
        "naming the HTTP/2 parse error; a real kubelet at the path is picked up by the "
        "next refresh.",
        figure=f"refused in {failed_s * 1000:.1f} ms; recovered on the next refresh in "
        f"{recover_s * 1000:.1f} ms",
    )


# The simulated kubelet (a subprocess, so its memory is not the client's): List answers
# a pre-serialised ListPodResourcesResponse of about argv[2] bytes (copies of one pod
# entry: a repeated field's entries concatenate on the wire).
BIG_KUBELET = """
import sys
from concurrent import futures
import grpc
from exporter.kubelet_api import api_pb2
path, size = sys.argv[1], int(sys.argv[2])
device = api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-0"])
container = api_pb2.ContainerResources(name="main", devices=[device])
pod = api_pb2.PodResources(name="p" * 200, namespace="ml", containers=[container])
one = api_pb2.ListPodResourcesResponse(pod_resources=[pod]).SerializeToString()
blob = one * (size // len(one) + 1)
methods = {"List": grpc.unary_unary_rpc_method_handler(lambda request, context: blob)}
server = grpc.server(futures.ThreadPoolExecutor(2))
server.add_generic_rpc_handlers(
    (grpc.method_handlers_generic_handler("v1.PodResourcesLister", methods),)
)
server.add_insecure_port(f"unix://{path}")
server.start()
print(len(blob), flush=True)
server.wait_for_termination()
"""


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_kubelet_100mib_response(sock: Path, record_fault: RecordFault) -> None:
    kubelet = subprocess.Popen(
        [sys.executable, "-c", BIG_KUBELET, str(sock), str(100 * 1024 * 1024)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert kubelet.stdout is not None
        size = int(await asyncio.to_thread(kubelet.stdout.readline))
        source = PodResourcesSource(PodResourcesClient(sock))
        baseline = peak = resident_bytes()
        done = threading.Event()

        def watch_memory() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, resident_bytes())
                time.sleep(0.002)

        watcher = threading.Thread(target=watch_memory)
        watcher.start()
        try:
            refresh_s = await timed(source.refresh)
        finally:
            done.set()
            watcher.join()
            await source.aclose()
    finally:
        kubelet.kill()
        kubelet.wait()

    status = source.status()
    grown_mib = (peak - baseline) / 2**20
    assert size >= 100 * 1024 * 1024 > MAX_RECEIVE_MESSAGE_BYTES
    assert not status.up and source.errors_total == 1
    assert status.error is not None
    assert status.error.startswith("PodResources List: RESOURCE_EXHAUSTED:")
    assert f"({size} vs. {MAX_RECEIVE_MESSAGE_BYTES})" in status.error  # both sizes named
    assert grown_mib < 32  # refused from the length prefix, never buffered whole
    assert refresh_s < 1.0

    record_fault(
        "kubelet-100mib-response",
        expected="A 100 MiB List response, over the 16 MiB receive limit, fails the refresh "
        "in under a second with RESOURCE_EXHAUSTED naming the response's size and the "
        "limit; the source is down with one error counted, and the client's memory grows "
        "by under 32 MiB: the message is never held whole.",
        figure=f"{size / 2**20:.0f} MiB response refused in {refresh_s * 1000:.0f} ms; "
        f"client resident memory grew {grown_mib:.1f} MiB at peak",
    )


# The exporter's client in a process of its own, without root's override of file
# permissions (CAP_DAC_OVERRIDE): refreshes once, waits for a line on stdin, refreshes
# again; prints each status as JSON.
UNPRIVILEGED_CLIENT = """
import asyncio, json, sys, time
from exporter.sources.podresources.client import PodResourcesClient
from exporter.sources.podresources.source import PodResourcesSource
async def main():
    source = PodResourcesSource(PodResourcesClient(sys.argv[1]))
    for _ in range(2):
        began = time.monotonic()
        await source.refresh()
        status = source.status()
        print(json.dumps({"up": status.up, "error": status.error,
                          "seconds": time.monotonic() - began}), flush=True)
        sys.stdin.readline()
    await source.aclose()
asyncio.run(main())
"""


def unprivileged(argv: list[str]) -> list[str]:
    """As root, drop the capabilities that bypass file permissions (util-linux setpriv)."""
    if os.geteuid() != 0:
        return argv
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *argv]


async def test_kubelet_permission_denied(sock: Path, record_fault: RecordFault) -> None:
    server = await start_podresources_server(sock, lambda: ((), ()))
    os.chmod(sock, 0o000)  # connecting needs write permission on the socket (unix(7))
    client = subprocess.Popen(
        unprivileged([sys.executable, "-c", UNPRIVILEGED_CLIENT, str(sock)]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert client.stdin is not None and client.stdout is not None
        denied = json.loads(await asyncio.to_thread(client.stdout.readline))
        os.chmod(sock, 0o660)  # the operator fixes the mode (or the exporter's user)
        client.stdin.write("\n")
        client.stdin.flush()
        allowed = json.loads(await asyncio.to_thread(client.stdout.readline))
        client.stdin.write("\n")
        client.stdin.close()
        await asyncio.to_thread(client.wait, 10)
    finally:
        if client.poll() is None:
            client.kill()
        await server.stop(None)

    assert not denied["up"]
    assert denied["error"].startswith("PodResources List: UNAVAILABLE:")
    assert "Permission denied" in denied["error"] and "\n" not in denied["error"]
    assert denied["seconds"] < 0.5
    assert allowed["up"] and allowed["error"] is None

    record_fault(
        "kubelet-permission-denied",
        expected="A socket the exporter may not connect to fails the refresh at once with "
        "UNAVAILABLE ending in 'Permission denied', source down; once the mode allows it "
        "the next refresh succeeds.",
        figure=f"refused in {denied['seconds'] * 1000:.1f} ms; recovered on the next "
        f"refresh in {allowed['seconds'] * 1000:.1f} ms",
    )
