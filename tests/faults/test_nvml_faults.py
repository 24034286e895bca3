"""The NVML rows of the fault matrix: each fault injected in the simulated libnvidia-ml
(scenario ``call_errors``, ``nvml_init_error``, ``unsupported``, the timeline), the real
exporter scraped over HTTP (tests/harness.py), the behaviour asserted and a figure
measured for docs/reliability.md."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from collections.abc import Callable

import pytest

from exporter.model import OCCUPANCY_FIELDS
from exporter.sim.nvml_library import SimNvmlLibrary
from exporter.sources.kmsg import KmsgReader
from tests.faults.conftest import RecordFault
from tests.harness import Harness, Scrape, simulated_exporter

NVML = {"source": "nvml"}
XID = {"source": "xid"}
# Every entry point the simulated driver answers per device handle, but the identity
# (the UUID): what a GPU may refuse or not support while it is still the same GPU.
OPTIONAL_CALLS = sorted(
    name
    for name, member in vars(SimNvmlLibrary).items()
    if hasattr(member, "__wrapped__") and name != "nvmlDeviceGetUUID"
)
# What a GPU serves while NVML answers it, whatever it refuses: its state and identity.
ALWAYS = {"gpu_up", "gpu_info", "gpu_healthy"}
# GPM's gauges, their counters, and the seconds their windows covered
GPM_SERIES = {
    *(f"gpu_{field}_ratio" for field in OCCUPANCY_FIELDS),
    *(f"gpu_{field}_seconds_total" for field in OCCUPANCY_FIELDS),
    "gpu_activity_sampled_seconds_total",
}


def gpu_series(scrape: Scrape, gpu: str) -> dict[str, int]:
    """Series per metric name that carry ``gpu=<gpu>``."""
    found: dict[str, int] = {}
    for name, series in scrape.values.items():
        n = sum(1 for labels in series if ("gpu", gpu) in labels)
        if n:
            found[name] = n
    return found


async def until(
    h: Harness, done: Callable[[Scrape], bool], what: str, timeout_s: float = 10.0
) -> tuple[Scrape, int, float]:
    """Cycle (1 s of simulated time each) until ``done``: the scrape, cycles, seconds."""
    started, cycles = time.monotonic(), 0
    while True:
        scrape = await h.scrape()
        if done(scrape):
            return scrape, cycles, time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
        await h.advance(1)
        cycles += 1


def exporter_bytes() -> int:
    """Traced memory allocated by the exporter's own code and still reachable (not the
    simulator's, which keeps every XID it raised)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        (
            tracemalloc.Filter(True, "*/exporter/*"),
            tracemalloc.Filter(False, "*/exporter/sim/*"),
        )
    )
    return sum(stat.size for stat in snapshot.statistics("filename"))


def kmsg_reader(h: Harness) -> KmsgReader:
    reader = h.source("kmsg")
    assert isinstance(reader, KmsgReader)
    return reader


def xid_total(scrape: Scrape, **labels: str) -> float:
    return sum(v for _, v in scrape.find("gpu_xid_errors_total", **labels))


@pytest.mark.slow
async def test_nvml_init_fails_then_succeeds(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "nvml_init_error": "DRIVER_NOT_LOADED",
        "gpus": [{"power_mw": 150_000}, {}],
        "timeline": [{"at": 60, "xid": {"gpu": 1, "code": 48}}],
    }
    async with simulated_exporter(scenario) as h:
        down = await h.scrape()
        assert down.get("gpu_exporter_source_up", **NVML) == 0
        assert down.get("gpu_exporter_nvml_up") == 0
        assert down.series("gpu_info") == {}  # NVML down, not "a node without GPUs"
        assert down.get("gpu_exporter_source_up", **XID) == 0
        assert down.get("gpu_exporter_errors_total", **NVML) >= 1

        h.env.node.scenario.nvml_init_error = None  # the driver loads
        up, _, seconds = await until(
            h, lambda s: s.get("gpu_exporter_nvml_up") == 1, "NVML to come up"
        )
        assert len(up.series("gpu_info")) == 2
        assert up.get("gpu_up", gpu="1") == 1
        assert up.get("gpu_power_watts", gpu="0") == 150.0
        listener = h.xid_listener
        _, _, xid_seconds = await until(
            h, lambda s: listener.registered == (0, 1), "the XID listener to register"
        )
        h.clock.now = 59.0
        await h.advance(1)  # the XID at t=60 is delivered by the re-created event set
        listening = await h.scrape()
        assert listening.get("gpu_exporter_source_up", **XID) == 1
        assert xid_total(listening, gpu="1", xid="48") == 1

    record_fault(
        "nvml-init-fails-then-succeeds",
        expected="While nvmlInit fails NVML is served as down (gpu_exporter_nvml_up 0, no "
        "GPU series, errors counted), never as a node without GPUs; once the driver loads, "
        "the GPUs, their values and XID events come back without a restart.",
        figure=f"GPUs served again {seconds:.1f} s after the driver loaded (the init is "
        f"retried after a backoff of 1 s doubling to 60 s); the XID listener registered "
        f"{seconds + xid_seconds:.1f} s after it; the first XID after that counted 1/1.",
    )


async def test_nvml_gpu_lost_and_back(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "gpus": [{"power_mw": 100_000}, {"power_mw": 200_000}],
        "host_processes": [{"pid": 4242, "gpu": 1, "memory": "2GiB"}],
        "timeline": [
            {"at": 10, "lose": 1},
            {"at": 30, "set": {"gpu": 1, "lost": False}},  # back, behind a new handle
            {"at": 40, "xid": {"gpu": 1, "code": 13}},
        ],
    }
    async with simulated_exporter(scenario) as h:
        await h.advance(5)
        before = await h.scrape()
        uuid = dict(before.find("gpu_info", gpu="1")[0][0])["uuid"]
        served_before = sum(gpu_series(before, "1").values())
        errors_before = before.get("gpu_exporter_errors_total", **NVML)

        lost_cycles = 0
        for _ in range(4):  # t = 10, 15, 20, 25: every cycle while it is lost
            await h.advance(5)
            lost_cycles += 1
            lost = await h.scrape()
            assert lost.get("gpu_up", gpu="1", uuid=uuid) == 0
            assert lost.find("gpu_power_watts", gpu="1") == []
            assert lost.get("gpu_power_watts", gpu="0") == 100.0  # the other GPU carries on
            assert lost.get("gpu_exporter_source_up", **NVML) == 1
        served_lost = sum(gpu_series(lost, "1").values())
        counted = lost.get("gpu_exporter_errors_total", **NVML) - errors_before
        assert counted == lost_cycles  # one failed GPU per cycle, no more

        await h.advance(5)  # t=30: it is back
        back = await h.scrape()
        assert back.get("gpu_up", gpu="1", uuid=uuid) == 1  # same identity
        assert back.get("gpu_power_watts", gpu="1") == 200.0  # read through the new handle
        assert back.get("gpu_exporter_errors_total", **NVML) == errors_before + counted
        served_back = sum(gpu_series(back, "1").values())
        late = sorted(set(gpu_series(before, "1")) - set(gpu_series(back, "1")))
        _, cycles, _ = await until(
            h, lambda s: gpu_series(s, "1") == gpu_series(before, "1"), "every series back"
        )
        await h.advance(10)  # t=40: its XIDs still reach the listener and name it
        assert xid_total(await h.scrape(), gpu="1", uuid=uuid, xid="13") == 1

    record_fault(
        "nvml-gpu-lost-and-back",
        expected="A lost GPU is served as down (gpu_up 0, its values absent) under its last "
        "known identity while the other GPUs carry on; when it comes back behind a new "
        "handle it is re-opened on the first cycle, with the same UUID and all its series.",
        figure=f"up with its values on the first cycle after its return; series of the GPU: "
        f"{served_before} before, {served_lost} while lost, {served_back} on that cycle, all "
        f"{served_before} {cycles} cycle(s) later ({', '.join(late)} wait for a second "
        f"sample); {counted:.0f} errors counted over {lost_cycles} lost cycles; an XID "
        f"after the return counted 1/1 under the same UUID.",
    )


async def test_nvml_not_supported_everywhere(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "gpus": [{"unsupported": OPTIONAL_CALLS}, {}],
        "host_processes": [
            {"pid": 1001, "gpu": 0, "memory": "10GiB"},
            {"pid": 1002, "gpu": 1, "memory": "10GiB"},
        ],
    }
    async with simulated_exporter(scenario) as h:
        first = await h.scrape()
        errors = first.get("gpu_exporter_errors_total", **NVML)
        for _ in range(4):  # past the orphan hysteresis (3 cycles)
            await h.advance(5)
        scrape = await h.scrape()
        bare, full = gpu_series(scrape, "0"), gpu_series(scrape, "1")
        # absent, never a zero standing in for "unsupported"; and NVML's own word that GPM
        # is not supported there says where its occupancy comes from: nowhere
        assert set(bare) == ALWAYS | {"gpu_occupancy_source"}
        assert scrape.get("gpu_occupancy_source", gpu="0", source="none") == 1
        assert scrape.get("gpu_up", gpu="0") == 1
        assert scrape.get("gpu_healthy", gpu="0") == 1
        assert scrape.get("gpu_exporter_source_up", **NVML) == 1
        assert scrape.get("gpu_exporter_errors_total", **NVML) == errors == 0
        # 10 GiB used by a process NVML cannot list is not an orphan (it was: a false leak)
        assert scrape.find("gpu_orphaned_memory_bytes", gpu="0") == []
        assert scrape.get("gpu_exporter_source_up", **XID) == 1
        assert h.xid_listener.registered == (1,)  # registering events is optional too

    record_fault(
        "nvml-not-supported-everywhere",
        expected="A GPU that answers NOT_SUPPORTED to every optional call is served up and "
        "healthy with only its identity: every value is absent (never 0), nothing is counted "
        "as an error, and its unlistable processes raise no orphaned-memory finding.",
        figure=f"{len(OPTIONAL_CALLS)} entry points NOT_SUPPORTED: {sum(bare.values())} series "
        f"served for that GPU ({', '.join(sorted(bare))}) against {sum(full.values())} for a "
        f"full GPU; 0 errors counted over 5 cycles; fixed on the way: gpu_processes 0 and "
        f"10 GiB of false unattributed orphan memory were served for it.",
    )


@pytest.mark.slow
async def test_nvml_no_permission(record_fault: RecordFault) -> None:
    refused = [c for c in OPTIONAL_CALLS if c not in {"nvmlDeviceGetMemoryInfo"}]
    scenario: dict[str, object] = {
        "gpus": [{"gpm": {"sm_active": 40}}, {"gpm": {"sm_active": 40}}],
        "host_processes": [{"pid": 1001, "gpu": 0, "memory": "10GiB"}],
        "call_errors": [
            {"call": c, "error": "NO_PERMISSION", "gpu": 0, "from": 10, "until": 40}
            for c in refused
        ],
    }
    # Every cycle a slow-tier read (exporter/sources/nvml_cadence.py), so every refused
    # query is asked, refused and counted each cycle; with the default 30 s the slow facts
    # read before the refusal would be served as last read until the next slow read.
    async with simulated_exporter(scenario, argv=["--slow-interval", "5"]) as h:
        await h.advance(5)
        before = await h.scrape()
        full = gpu_series(before, "0")
        assert before.get("gpu_sm_active_ratio", gpu="0") == 0.4
        errors_before = before.get("gpu_exporter_errors_total", **NVML)

        per_cycle = []
        for _ in range(4):  # t = 10 .. 25, refused
            errors = (await h.scrape()).get("gpu_exporter_errors_total", **NVML)
            await h.advance(5)
            scrape = await h.scrape()
            per_cycle.append(scrape.get("gpu_exporter_errors_total", **NVML) - errors)
        shown = gpu_series(scrape, "0")
        # absent, not zero; GPM, refused for now, is still where its occupancy comes from
        assert set(shown) == ALWAYS | {"gpu_occupancy_source"}
        assert scrape.get("gpu_occupancy_source", gpu="0", source="gpm") == 1
        assert all(n > 0 for n in per_cycle)  # counted every cycle (GPM: at each retry)
        assert scrape.get("gpu_up", gpu="0") == 1 and scrape.get("gpu_healthy", gpu="0") == 1
        assert scrape.get("gpu_exporter_source_up", **NVML) == 1  # NVML itself answers
        assert scrape.find("gpu_orphaned_memory_bytes", gpu="0") == []
        assert gpu_series(scrape, "1") == gpu_series(before, "1")  # the other GPU: all there

        h.clock.now = 39.0  # permission granted at 40
        await h.advance(1)
        first = gpu_series(await h.scrape(), "0")
        # GPM waits for its retry, GPU-Util's counter for the window its first read starts
        assert {n for n in full if n not in first} <= GPM_SERIES | {"gpu_utilization_seconds_total"}
        back, _, seconds = await until(
            h,
            lambda s: gpu_series(s, "0") == full and s.get("gpu_sm_active_ratio", gpu="0") == 0.4,
            "every series to come back",
        )
        assert back.get("gpu_processes", gpu="0", kind="compute") == 1
    assert errors_before == 0

    record_fault(
        "nvml-no-permission",
        expected="Queries refused with NO_PERMISSION are absent (not 0) and counted as "
        "errors every cycle, never switched off; the GPU stays up and healthy, NVML stays "
        "up, no false orphan is raised, and every series comes back once permission is "
        "granted.",
        figure=f"{len(refused)} entry points refused on one GPU: {min(per_cycle):.0f} to "
        f"{max(per_cycle):.0f} errors counted per cycle over {len(per_cycle)} cycles; "
        f"{sum(shown.values())} of {sum(full.values())} series served meanwhile; "
        f"{sum(first.values())} back on the first cycle after permission came back, the GPM "
        f"occupancy ones {seconds:.1f} s later (GPM retries after a backoff).",
    )


@pytest.mark.slow
async def test_nvml_xid_storm(record_fault: RecordFault) -> None:
    storm, storms, codes = 3000, 4, (13, 31, 43, 94, 48)
    timeline = [
        {"at": 10 * n + 5 + i / storm, "xid": {"gpu": i % 2, "code": codes[i % len(codes)]}}
        for n in range(storms)
        for i in range(storm)
    ]
    async with simulated_exporter({"gpus": [{}, {}], "timeline": timeline}, argv=["--kmsg"]) as h:
        started = time.perf_counter()
        await h.advance(10)  # storm 1, delivered by NVML and the kernel log: timed
        storm_s = time.perf_counter() - started
        tracemalloc.start()  # the next storms, traced: the last must leave nothing more
        try:
            for n in range(storms - 1):
                # Only the last storm's leftovers are judged, so only it is bracketed by
                # snapshots (about a second each, the whole test process traced).
                last = n == storms - 2
                before = exporter_bytes() if last else 0
                tracemalloc.reset_peak()
                await h.advance(10)
                peak = tracemalloc.get_traced_memory()[1]
            left_behind = exporter_bytes() - before
        finally:
            tracemalloc.stop()
        scrape = await h.scrape()
        total = storms * storm
        assert h.xid_listener.events_total == kmsg_reader(h).events_total == total
        assert xid_total(scrape) == total  # every one counted, and counted once
        for code in codes:
            assert xid_total(scrape, xid=str(code)) == total / len(codes)
        assert scrape.get("gpu_healthy", gpu="0") == 0  # XID 48 is fatal
        ledger = h.agent.state.xids
        kept = max(len(entries) for entries in ledger.recent.values())
        assert kept <= ledger.max_recent_per_gpu
        assert left_behind < 32 * 1024  # a further storm leaves (almost) nothing behind
        assert storm_s < 2.0  # was 6 s of analysis for 8,000 from both sources (quadratic)

    record_fault(
        "nvml-xid-storm",
        expected="Every XID of a storm is counted exactly once although NVML and the kernel "
        "log both deliver it; memory stays bounded (recent events capped per GPU) and the "
        "storm's cycle stays short.",
        figure=f"{storms} storms of {storm:,} XIDs within 1 s, each delivered by both sources: "
        f"{xid_total(scrape):,.0f} of {total:,} counted; the storm's delivery and cycle took "
        f"{storm_s:.2f} s; traced peak {peak / 2**20:.1f} MiB during a storm (simulator "
        f"included), exporter memory left behind by the last {left_behind / 2**10:+.0f} "
        f"KiB; {kept} recent events kept per GPU (cap {ledger.max_recent_per_gpu}). Fixed "
        f"on the way: de-duplication was quadratic (6 s of one cycle's analysis for 8,000 "
        f"XIDs from both sources).",
    )


async def cycle_without_nvml_xids(h: Harness) -> None:
    """``h.cycle()`` for a time when NVML cannot deliver the XIDs due (the harness waits
    for them): the simulator synced and the kernel log read, then the agent's cycle."""
    await asyncio.to_thread(h.env.sync)
    kmsg, logged = kmsg_reader(h), h.env.kernel_log.xids_written
    deadline = time.monotonic() + 10
    while kmsg.events_total < logged:
        assert time.monotonic() < deadline, "kernel-log XIDs not read"
        await asyncio.sleep(0.02)
    await h.agent.cycle()


@pytest.mark.slow
async def test_nvml_event_set_error(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "gpus": [{}],
        "call_errors": [
            {"call": "nvmlEventSetWait_v2", "error": "UNKNOWN", "from": 10, "until": 20}
        ],
        "timeline": [{"at": at, "xid": {"gpu": 0, "code": 43}} for at in (5, 15, 30)],
    }
    async with simulated_exporter(scenario, argv=["--kmsg"]) as h:
        listener = h.xid_listener
        await h.advance(5)
        assert xid_total(await h.scrape()) == 1

        h.clock.now = 10.0  # the event set fails mid-run
        deadline = time.monotonic() + 5
        while listener.errors_total == 0:
            assert time.monotonic() < deadline, "the listener never saw the error"
            await asyncio.sleep(0.02)
        await cycle_without_nvml_xids(h)
        failing = await h.scrape()
        assert failing.get("gpu_exporter_source_up", **XID) == 0
        assert failing.get("gpu_exporter_errors_total", **XID) >= 1
        assert listener.alive  # backing off, not dead

        h.clock.now = 15.0  # an XID while no event set listens: only the kernel log has it
        await cycle_without_nvml_xids(h)
        assert xid_total(await h.scrape()) == 2

        h.clock.now = 20.0  # the driver answers again
        answered = time.monotonic()
        while listener.registered != (0,) or listener.last_error is not None:
            assert time.monotonic() - answered < 10, "the listener did not come back"
            await asyncio.sleep(0.02)
        recovered_s = time.monotonic() - answered
        h.clock.now = 30.0  # delivered by the new event set, and by the kernel log
        nvml_before = listener.events_total
        await cycle_without_nvml_xids(h)
        deadline = time.monotonic() + 5
        while listener.events_total == nvml_before:
            assert time.monotonic() < deadline, "the new event set delivered nothing"
            await asyncio.sleep(0.02)
        await cycle_without_nvml_xids(h)
        scrape = await h.scrape()
        assert scrape.get("gpu_exporter_source_up", **XID) == 1
        assert xid_total(scrape) == 3  # the last one seen twice, counted once
        errors = scrape.get("gpu_exporter_errors_total", **XID)
        nvml_seen = listener.events_total

    record_fault(
        "nvml-event-set-error",
        expected="An event-set error mid-run marks the XID source down and counts it; the "
        "listener backs off, re-creates the set and listens again; an XID raised meanwhile "
        "is still counted from the kernel log, and none is counted twice.",
        figure=f"listening again {recovered_s:.1f} s after the driver answered (backoff from "
        f"1 s doubling); {errors:.0f} error(s) counted over a 10 s outage; XIDs counted 3 of "
        f"3 (the event set delivered {nvml_seen}; the one raised during the outage came from "
        f"the kernel log only).",
    )
