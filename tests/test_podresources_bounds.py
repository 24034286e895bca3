"""What one kubelet answer may bring in: ceilings, the event loop, memory, the log.

gRPC's 16 MiB receive cap bounds an answer's bytes, not the work after it: 100,000
containers fit in 4.4 MB. These tests drive the real PodResources gRPC server
(``exporter/sim/podresources_server.py``; in its own process where the exporter's event
loop is measured) through the real client and source, in the real exporter where the
served metrics or the log are the point. docs/reliability.md, "What one kubelet answer
may bring in", states the ceilings these tests hold.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

from exporter.agent import UNRESOLVED_SHAPES_LOGGED
from exporter.model import AllocatableDevices, ContainerDevices
from exporter.sim.podresources_server import start_podresources_server
from exporter.sources.base import Cycle
from exporter.sources.podresources.answer import MAX_ADVERTISED_IDS, MAX_GPU_ALLOCATIONS
from exporter.sources.podresources.client import PodResourcesClient
from tests.harness import Harness, Scrape, simulated_exporter
from tests.test_podresources import sock, sock_dir

__all__ = ["sock", "sock_dir"]  # fixtures, shared with test_podresources

SCENARIO = "single-gpu"  # one H100, one pod holding it through the device plugin
AGENT_LOG = "exporter.agent"
ALLOCATED = "gpu_container_allocated"
DEVICES = "gpu_node_devices"
GPU = "nvidia.com/gpu"
UNRESOLVED_LINE = "names no GPU this exporter can resolve"
SHAPES_FULL_LINE = "further shapes are not logged"
MiB = 1024 * 1024


# -- helpers -------------------------------------------------------------------------


@asynccontextmanager
async def exporter_serving(
    sock: Path, extra: list[ContainerDevices] | None = None, *, synthetic_containers: int = 0
) -> AsyncIterator[Harness]:
    """The exporter on the single-GPU node, its kubelet the real gRPC server at ``sock``
    answering the node's allocations plus ``extra`` containers, and that many synthetic
    containers holding one unresolvable GPU id each."""
    async with simulated_exporter(SCENARIO, argv=["--pod-resources-socket", str(sock)]) as h:
        node = h.env.node
        grpc_server = await start_podresources_server(
            sock,
            lambda: (
                [*node.container_devices(), *(extra or [])],
                node.allocatable_devices(),
                node.claim_devices(),
            ),
            synthetic_containers=synthetic_containers,
        )
        try:
            yield h
        finally:
            await grpc_server.stop(None)


async def refreshed(h: Harness) -> Scrape:
    await h.refresh_pod_resources()
    await h.cycle()
    return await h.scrape()


def up(scrape: Scrape) -> float:
    return scrape.get("gpu_exporter_source_up", source="podresources")


def errors(scrape: Scrape) -> float:
    return scrape.get("gpu_exporter_errors_total", source="podresources")


def states(scrape: Scrape) -> dict[str, float]:
    return {labels["state"]: v for labels, v in scrape.find(DEVICES, resource=GPU)}


def rss_anon() -> int:
    """This process's anonymous resident memory (RssAnon, bytes): the heap, not the
    shared libraries, so an answer's objects show in it."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def agent_warnings(caplog: pytest.LogCaptureFixture, needle: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == AGENT_LOG and r.levelno >= logging.WARNING and needle in r.getMessage()
    ]


_LETTERS = "ghijklmnopqrstuvwxyz"  # neither digits nor hex: id_shape keeps them


def distinct_shape(i: int, salt: str) -> str:
    """A device id of a shape no other ``i`` has (letters only, so id_shape keeps it)."""
    word = ""
    while True:
        i, digit = divmod(i, len(_LETTERS))
        word += _LETTERS[digit]
        if i == 0:
            return f"{salt}-{word}"


def holding(ids: list[str], pod: str = "bulk") -> list[ContainerDevices]:
    """One container per id (pods ``<pod>-<n>``), each holding that id as a GPU."""
    return [ContainerDevices("ml", f"{pod}-{n}", "main", GPU, (i,)) for n, i in enumerate(ids)]


# -- the ceilings ----------------------------------------------------------------------


async def test_an_answer_over_the_allocation_ceiling_is_a_failed_refresh(sock: Path) -> None:
    """One allocation over the ceiling: source down saying how many and the ceiling,
    counted, and nothing of the answer served: no allocation, no allocated count."""
    over = MAX_GPU_ALLOCATIONS  # + the node's own pod = one over the ceiling
    async with exporter_serving(sock, synthetic_containers=over) as h:
        before = errors(await h.scrape())
        s = await refreshed(h)
        reason = h.pod_resources.status().error or ""
        snapshot = h.pod_resources.read(Cycle(timestamp=time.time()))  # what a cycle gets

    assert up(s) == 0
    assert errors(s) == before + 1
    assert f"{over + 1:,} GPU allocations" in reason, reason
    assert f"ceiling of {MAX_GPU_ALLOCATIONS:,}" in reason, reason
    assert "\n" not in reason
    assert snapshot.ok is False and snapshot.containers == () and snapshot.claims == ()
    assert ALLOCATED not in s.values  # not the node's own pod either: no partial picture
    found = states(s)
    assert "allocated" not in found and "allocatable" not in found  # unknown, as kubelet down


async def test_an_answer_at_the_allocation_ceiling_is_taken_whole(sock: Path) -> None:
    at = MAX_GPU_ALLOCATIONS - 1  # + the node's own pod
    async with exporter_serving(sock, synthetic_containers=at) as h:
        await h.refresh_pod_resources()
        status = h.pod_resources.status()
        snapshot = h.pod_resources.read(Cycle(timestamp=time.time()))

    assert status.up, status.error
    assert snapshot.ok and len(snapshot.containers) == MAX_GPU_ALLOCATIONS


async def test_advertised_ids_over_their_ceiling_fail_the_refresh(sock: Path) -> None:
    """GetAllocatableResources advertising more GPU ids than any node has: the whole
    refresh fails (its List answer included), and capacity is not counted from it."""
    bogus = tuple(f"vendor.example/dev-{i:05d}" for i in range(MAX_ADVERTISED_IDS))
    async with simulated_exporter(SCENARIO, argv=["--pod-resources-socket", str(sock)]) as h:
        node = h.env.node

        def answer() -> tuple[object, ...]:
            advertised = [
                AllocatableDevices(a.resource_name, (*a.device_ids, *bogus))
                for a in node.allocatable_devices()
            ]
            return (node.container_devices(), advertised, node.claim_devices())

        server = await start_podresources_server(sock, answer)  # type: ignore[arg-type]
        try:
            s = await refreshed(h)
            reason = h.pod_resources.status().error or ""
        finally:
            await server.stop(None)

    assert up(s) == 0
    assert f"{MAX_ADVERTISED_IDS + 1:,} advertised GPU device ids" in reason, reason
    assert f"ceiling of {MAX_ADVERTISED_IDS:,}" in reason, reason
    assert ALLOCATED not in s.values
    found = states(s)
    assert "allocated" not in found and "allocatable" not in found
    assert found.get("unknown", 0) == 0  # none of the 50,001 ids counted anywhere


async def test_the_ceilings_count_as_sent_and_refuse_one_over(sock: Path) -> None:
    """The client's ceilings are exact: at N taken, at N + 1 refused."""
    ids = [f"GPU-00000000-0000-0000-0000-{i:012d}" for i in range(5)]
    server = await start_podresources_server(
        sock, lambda: (holding(ids), [AllocatableDevices(GPU, tuple(ids))])
    )
    try:
        at = PodResourcesClient(sock, max_gpu_allocations=5, max_advertised_ids=5)
        one_under = PodResourcesClient(sock, max_gpu_allocations=4)
        advertised_under = PodResourcesClient(sock, max_advertised_ids=4)
        taken, refused, refused_advertised = (
            await at.fetch(),
            await one_under.fetch(),
            await advertised_under.fetch(),
        )
        for client in (at, one_under, advertised_under):
            await client.close()
    finally:
        await server.stop(None)

    assert taken.ok and len(taken.containers) == 5 and taken.allocatable_ok
    assert not refused.ok and refused.containers == ()
    assert refused.error == (
        "PodResources List: 5 GPU allocations in one answer, over the ceiling of 4 (far "
        "beyond any real node: the answer is refused whole, see docs/reliability.md)"
    )
    assert not refused_advertised.ok and refused_advertised.containers == ()
    assert "5 advertised GPU device ids" in (refused_advertised.error or "")


# -- the event loop and memory ---------------------------------------------------------

_KUBELET = """
import asyncio, sys
from exporter.sim.podresources_server import start_podresources_server

async def main() -> None:
    server = await start_podresources_server(
        sys.argv[1], lambda: ((), ()), synthetic_containers=int(sys.argv[2])
    )
    print("serving", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


@contextmanager
def kubelet_process(sock: Path, containers: int) -> Iterator[None]:
    """The simulated kubelet in a process of its own (as the real one is): building and
    sending its answer costs the exporter's process nothing."""
    child = subprocess.Popen(
        [sys.executable, "-c", _KUBELET, str(sock), str(containers)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "serving"
        yield
    finally:
        child.kill()
        child.wait(10)


class Heartbeat:
    """Ticks on the event loop every ``period_s``; records how late each tick came, and
    the largest RssAnon seen."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.worst_late_s = 0.0
        self.peak_rss = rss_anon()
        self.ticks = 0

    async def run(self) -> None:
        while True:
            due = time.monotonic() + self.period_s
            await asyncio.sleep(self.period_s)
            self.worst_late_s = max(self.worst_late_s, time.monotonic() - due)
            self.peak_rss = max(self.peak_rss, rss_anon())
            self.ticks += 1


RSS_GROWTH_BOUND = 48 * MiB


@pytest.mark.slow  # a kubelet process and a 4.4 MB answer
async def test_a_100k_container_answer_leaves_the_loop_responsive_and_memory_bounded(
    sock: Path,
) -> None:
    """The adversary's answer: 100,000 containers (4.4 MB, well under the 16 MiB cap).
    Before, parsing it ran on the event loop (~1 s here, /healthz unanswered) and its
    allocations took hundreds of MB; now it is parsed in a worker thread, refused at
    the ceiling, and the event loop ticks on time throughout."""
    containers = 100_000
    with kubelet_process(sock, containers):
        async with simulated_exporter(SCENARIO, argv=["--pod-resources-socket", str(sock)]) as h:
            await h.refresh_pod_resources()  # connected; the first answer (allocator warm)
            await h.cycle()
            heartbeat = Heartbeat()
            before = rss_anon()
            beating = asyncio.create_task(heartbeat.run())
            await asyncio.sleep(0.1)
            began = time.monotonic()
            probe = asyncio.create_task(h.get("/healthz"))
            await h.refresh_pod_resources()
            refresh_s = time.monotonic() - began
            healthz = await probe
            await h.cycle()
            s = await h.scrape()
            beating.cancel()
            after = max(heartbeat.peak_rss, rss_anon())
            reason = h.pod_resources.status().error or ""

    assert heartbeat.ticks > 0
    assert heartbeat.worst_late_s < 0.5, (
        f"the event loop stalled {heartbeat.worst_late_s:.2f} s during a {refresh_s:.2f} s refresh"
    )
    assert healthz.status == 200
    assert after - before < RSS_GROWTH_BOUND, f"RssAnon grew {(after - before) / MiB:.0f} MiB"
    assert up(s) == 0 and f"{containers:,} GPU allocations" in reason, reason
    assert ALLOCATED not in s.values
    print(
        f"refresh {refresh_s:.2f} s, loop late at most {heartbeat.worst_late_s * 1000:.0f} ms,"
        f" RssAnon +{(after - before) / MiB:.1f} MiB"
    )


# -- the log ---------------------------------------------------------------------------


@pytest.mark.slow  # two cycles of 5,000 containers each
async def test_unresolved_shapes_are_logged_in_bounded_lines(
    sock: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """5,000 new shapes of unresolvable id, then 5,000 more: 256 lines and one saying
    that no more are logged, while the counter counts every unresolved allocation."""
    caplog.set_level(logging.WARNING, logger=AGENT_LOG)
    extra = holding([distinct_shape(i, "first") for i in range(5_000)])
    async with exporter_serving(sock, extra) as h:
        first = await refreshed(h)
        extra[:] = holding([distinct_shape(i, "second") for i in range(5_000)])
        second = await refreshed(h)

    assert up(first) == 1 and up(second) == 1
    for s in (first, second):
        assert s.get("gpu_exporter_unresolved_allocations", resource=GPU) == 5_000
    assert len(agent_warnings(caplog, UNRESOLVED_LINE)) == UNRESOLVED_SHAPES_LOGGED
    assert len(agent_warnings(caplog, SHAPES_FULL_LINE)) == 1


async def test_kubelet_text_reaches_the_log_as_one_bounded_line(
    sock: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A device id with a newline cannot forge a log line; NUL and a 5,000-character id
    are not written raw."""
    forged = "x\n2026-01-01 00:00:00,000 WARNING exporter: FORGED"
    nul = "uni\u2603\x00x"
    long = "y" * 5_000
    caplog.set_level(logging.WARNING, logger=AGENT_LOG)
    extra = [
        ContainerDevices("ml\nns", "pod\r\nforged", "main", GPU, (forged,)),
        ContainerDevices("ml", "nul", "main", GPU, (nul,)),
        ContainerDevices("ml", "long", "main", GPU, (long,)),
    ]
    async with exporter_serving(sock, extra) as h:
        s = await refreshed(h)

    assert s.get("gpu_exporter_unresolved_allocations", resource=GPU) == 3
    lines = [r.getMessage() for r in agent_warnings(caplog, UNRESOLVED_LINE)]
    assert len(lines) == 3  # three shapes, one line each
    for line in lines:
        assert "\n" not in line and "\r" not in line and "\x00" not in line
        assert len(line) < 1_000
    (forged_line,) = [line for line in lines if "FORGED" in line]
    assert "of ml ns/pod forged" in forged_line
    assert any("\\x00" in line for line in lines)  # NUL written as its escape
    assert not any(long in line for line in lines)
