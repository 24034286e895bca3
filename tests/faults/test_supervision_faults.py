"""Background loops that must not die (a crash is counted and the loop restarts), and
liveness that means sampling (a stale loop reports down), driven through the real code paths.

- the real gRPC PodResources server (``exporter/sim/podresources_server.py``) answers a
  ``List`` whose bytes do not decode, once, then good answers, while the source's real
  refresh task runs;
- the kernel log the exporter reads (``--kmsg-path``, the simulated node's file) holds a
  record the reader's parser cannot take, so an exception escapes its loop;
- the simulated NVML library makes one call block (``call_errors[].delay_s``) while the
  agent's real sample loop runs and the real HTTP server answers /healthz and /readyz.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from exporter.sim.podresources_server import start_podresources_server
from exporter.sources.kmsg import KmsgReader
from tests.faults.conftest import RecordFault
from tests.harness import Harness, Scrape, simulated_exporter
from tests.test_podresources import sock, sock_dir

__all__ = ["sock", "sock_dir"]  # fixtures, shared with test_podresources

SCENARIO = "single-gpu"  # one H100, one pod holding it through the device plugin
ALLOCATED = "gpu_container_allocated"


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> float:
    """Seconds until ``predicate`` held; fails after ``timeout_s``."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - began


async def scraped(h: Harness) -> Scrape:
    await h.cycle()
    return await h.scrape()


def up(scrape: Scrape, source: str) -> float:
    return scrape.get("gpu_exporter_source_up", source=source)


def errors(scrape: Scrape, source: str) -> float:
    return scrape.get("gpu_exporter_errors_total", source=source)


def last_success(scrape: Scrape, source: str) -> float:
    return scrape.get("gpu_exporter_source_last_success_timestamp_seconds", source=source)


@pytest.mark.slow  # waits on the refresh task's real retry (the first is 0.8-1 s)
async def test_kubelet_undecodable_answer(
    sock: Path, caplog: pytest.LogCaptureFixture, record_fault: RecordFault
) -> None:
    caplog.set_level(logging.INFO)
    async with simulated_exporter(SCENARIO, argv=["--pod-resources-socket", str(sock)]) as h:
        source = h.pod_resources
        node = h.env.node
        server = await start_podresources_server(
            sock,
            lambda: (node.container_devices(), node.allocatable_devices(), node.claim_devices()),
            undecodable_lists=1,
        )
        before = source.errors_total  # the socket was missing when the harness primed it
        refreshing = asyncio.create_task(source.run())  # the agent's refresh task
        try:
            await wait_until(lambda: source.errors_total > before, "the bad answer")
            down = await scraped(h)
            reason = source.status().error or ""
            recovered_s = await wait_until(lambda: source.status().up, "a good answer")
            back = await scraped(h)
            assert not refreshing.done(), "the refresh task ended"
        finally:
            refreshing.cancel()
            await asyncio.gather(refreshing, return_exceptions=True)
            await server.stop(None)

    assert up(down, "podresources") == 0
    assert errors(down, "podresources") >= before + 1
    assert "could not be decoded" in reason, reason
    assert ALLOCATED not in down.values  # no allocation served from a failed refresh
    assert up(back, "podresources") == 1
    assert len(back.series(ALLOCATED)) == 1
    assert last_success(back, "podresources") > 0
    crashes = [r for r in caplog.records if "source loop failed" in r.getMessage()]
    assert crashes == []  # the client said why; nothing escaped to the supervisor

    record_fault(
        "kubelet-undecodable-answer",
        expected="A List answer that does not decode is a failed refresh: podresources is "
        "down with the reason and counted, no allocation is served from it, and the "
        "refresh task goes on; the next good answer brings attribution back.",
        figure=f"source down with {reason!r}; errors +{errors(down, 'podresources') - before:.0f}; "
        f"back up {recovered_s:.2f} s later (first retry) with "
        f"{len(back.series(ALLOCATED))} allocation series",
    )


def _kmsg_xid(seq: int, pci_bus_id: str, code: int) -> str:
    """A record as the driver prints an XID into /dev/kmsg (exporter/sources/kmsg.py)."""
    domain, bus, rest = pci_bus_id.split(":")
    where = f"PCI:{int(domain, 16):04x}:{bus.lower()}:{rest.split('.')[0].lower()}"
    return f"3,{seq},{seq * 1_000_000},-;NVRM: Xid ({where}): {code}, pid=1, name=python\n"


@pytest.mark.slow  # waits on the supervisor's real backoff (1 s, then 2 s)
async def test_source_loop_exception(
    caplog: pytest.LogCaptureFixture, record_fault: RecordFault
) -> None:
    """The kernel-log reader's parser raises ValueError on a record whose sequence number
    has more digits than Python converts (4,300); its own handling expects OSError only,
    so the exception escapes its loop. A real kernel prints a u64 there: the record stands
    for any answer nobody foresaw, and the row holds as long as one escapes."""
    caplog.set_level(logging.INFO)
    async with simulated_exporter(SCENARIO, argv=["--kmsg"]) as h:
        reader = h.source("kmsg")
        assert isinstance(reader, KmsgReader)
        log_path = h.env.paths.kmsg
        healthy = await scraped(h)
        assert up(healthy, "kmsg") == 1 and errors(healthy, "kmsg") == 0
        good = log_path.read_text(encoding="utf-8")
        with log_path.open("a", encoding="utf-8") as f:
            f.write(f"4,{'9' * 5000},1,-;NVRM: a record the parser cannot take\n")
        await wait_until(lambda: reader.errors_total >= 1, "the exception to be counted")
        down_status = reader.status()
        down = await _scrape_kmsg(h)
        assert reader.alive, "the reader's thread ended"
        # The kernel's ring buffer moves past the record; a new XID follows it.
        pci = h.env.node.gpus[0].pci_bus_id
        replaced = time.monotonic()
        log_path.write_text(good + _kmsg_xid(10_000, pci, 31), encoding="utf-8")
        await wait_until(lambda: reader.status().up, "the reader to work again")
        recovered_s = time.monotonic() - replaced
        await wait_until(lambda: reader.events_total >= 1, "the XID after the record")
        back = await _scrape_kmsg(h)

    assert up(healthy, "kmsg") == 1
    assert not down_status.up and (down_status.error or "").startswith("loop failed: ValueError")
    assert up(down, "kmsg") == 0 and errors(down, "kmsg") >= 1
    assert up(back, "kmsg") == 1
    assert sum(v for _, v in back.find("gpu_xid_errors_total", xid="31")) == 1
    crashes = [r for r in caplog.records if "kmsg source loop failed" in r.getMessage()]
    assert len(crashes) == 1, [r.getMessage() for r in crashes]  # once per distinct error
    assert any("kmsg source loop working again" in r.getMessage() for r in caplog.records)

    record_fault(
        "source-loop-exception",
        expected="An exception escaping a background source's loop is counted in "
        "gpu_exporter_errors_total, logged once per distinct error, and the source is down "
        "with the reason; the loop starts again after a backoff and the source comes back "
        "up once the input is good.",
        figure=f"kernel-log reader: {errors(down, 'kmsg'):.0f} exception(s) counted, "
        f"{len(crashes)} log line, thread alive throughout; up again "
        f"{recovered_s:.2f} s after the record was gone, and the next XID counted",
    )


async def _scrape_kmsg(h: Harness) -> Scrape:
    """A cycle and a scrape, without the harness's wait for the simulator's XIDs to be
    read (the reader may be in its backoff)."""
    await asyncio.to_thread(h.env.sync)
    await h.agent.cycle()
    return await h.scrape()


async def _status(h: Harness, path: str) -> tuple[int, str]:
    async with h.session.get(h.url + path) as response:
        return response.status, await response.text()


@pytest.mark.slow  # real seconds: a 3 s NVML call under a 0.25 s interval
async def test_nvml_hung_call(caplog: pytest.LogCaptureFixture, record_fault: RecordFault) -> None:
    interval_s, cycles, hang_s = 0.25, 4, 3.0
    limit_s = interval_s * cycles
    scenario: dict[str, object] = {
        "gpus": [{"power_mw": 250_000}],
        # from t=10 (simulated) the temperature query blocks, as a driver wedged on a GPU
        # does (power is a field value now: nvmlDeviceGetFieldValues)
        "call_errors": [
            {"call": "nvmlDeviceGetTemperature", "delay_s": hang_s, "from": 10, "until": 11}
        ],
    }
    caplog.set_level(logging.INFO, logger="exporter.exposition.liveness")
    argv = ["--interval", str(interval_s), "--liveness-cycles", str(cycles)]
    async with simulated_exporter(scenario, argv=argv) as h:
        running = asyncio.create_task(h.agent.run())  # the real sample loop
        try:
            await wait_until(lambda: h.agent.cache.cycles >= 3, "the sample loop to run")
            assert await _status(h, "/healthz") == (200, "ok\n")
            assert (await _status(h, "/readyz"))[0] == 200
            h.clock.now = 10.0  # the next cycle's temperature query blocks for hang_s
            hung_at = time.monotonic()
            rendered = h.agent.cache.cycles
            codes: list[tuple[float, int, str]] = []
            readyz_during: tuple[int, str] | None = None
            stale: Scrape | None = None
            while time.monotonic() - hung_at < hang_s + 3 * interval_s + 2:
                status, text = await _status(h, "/healthz")
                codes.append((time.monotonic() - hung_at, status, text))
                if status == 503 and readyz_during is None:
                    h.clock.now = 11.0  # the calls after the hung one answer at once
                    readyz_during = await _status(h, "/readyz")
                    stale = await h.scrape()  # what a scrape says while the cycle is stuck
                if status == 200 and readyz_during is not None:
                    break
                await asyncio.sleep(0.05)
            readyz_after = await _status(h, "/readyz")
        finally:
            h.agent.stop()
            await asyncio.wait({running}, timeout=10)

    failing = [c for c in codes if c[1] == 503]
    assert failing, f"/healthz never failed: {codes[-3:]}"
    first_503 = failing[0][0]
    recovered = [c for c in codes if c[1] == 200 and c[0] > first_503]
    assert recovered, f"/healthz did not recover: {codes[-3:]}"
    # The last cycle completed within an interval of hung_at (before, or in flight); the
    # limit later /healthz fails (plus a probe period and a slow machine's slack).
    assert limit_s - interval_s <= first_503 <= limit_s + interval_s + 1.0, first_503
    reason = failing[0][2]
    assert reason.startswith("no sample cycle has completed for") and reason.count("\n") == 1
    assert recovered[0][0] >= hang_s - 0.5  # back once the call returned
    assert rendered >= 3
    assert readyz_during is not None and readyz_during[0] == 503
    assert readyz_after[0] == 200
    assert stale is not None  # the served bytes still say what the last cycle said
    assert stale.get("gpu_exporter_source_up", source="nvml") == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "exporter.exposition.liveness"]
    assert len([m for m in logged if m.startswith("not live")]) == 1, logged
    assert len([m for m in logged if m.startswith("live again")]) == 1, logged

    record_fault(
        "nvml-hung-call",
        expected="While a sample cycle is stuck in an NVML call, /healthz and /readyz answer "
        "503 with a one-line reason once no cycle has completed for --liveness-cycles "
        "intervals (so the kubelet restarts the exporter), logged once; both answer 200 "
        "again, logged once, after the call returns.",
        figure=f"limit {limit_s:.2f} s ({cycles} x {interval_s} s): /healthz 503 "
        f"{first_503:.2f} s after the call blocked, 200 again {recovered[0][0]:.2f} s after "
        f"(the call took {hang_s:.0f} s); {len(failing)} probes answered 503 "
        f"({reason.strip()!r})",
    )
