"""``--kmsg`` on the simulated node, whose kernel log stamps records on printk's clock.

printk's clock (sched_clock) stops while a machine is suspended and is not disciplined by
NTP; /proc/uptime is CLOCK_BOOTTIME. The scenario's ``kernel_log.clock_lag_s`` is how
far the first lags the second, so a record's stamp converted through /proc/uptime lands
that far before the XID was raised (docs/xid.md, docs/simulator.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from exporter.sim.environment import SimEnvironment
from exporter.sim.kernel_log import SimKernelLogWriter
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.scenario import ScenarioError, parse_scenario
from exporter.sources.kmsg import boot_epoch, parse_kmsg_record, parse_xid_attribution
from tests.harness import simulated_exporter

LAGGING: dict[str, Any] = {
    # ten days up, 40 s of which the node spent suspended (or its clocks drifted apart)
    "kernel_log": {"uptime_s": 864_000, "clock_lag_s": 40},
    "gpus": [{}, {"mig": [{"profile": "3g.40gb", "gpu_instance_id": 1}]}],
    "timeline": [
        # ten minutes before the exporter started: only the kernel log has it
        {"at": -600, "xid": {"gpu": 1, "code": 48}},
        {"at": 60, "xid": {"gpu": 0, "code": 31}},
        {"at": 90, "xid": {"gpu": 1, "code": 43, "gpu_instance_id": 1}},
    ],
}


async def test_an_xid_from_nvml_and_the_kernel_log_is_counted_once_when_printk_lags() -> None:
    async with simulated_exporter(LAGGING, argv=["--kmsg"]) as h:
        await h.advance(61)
        await h.advance(30)
        scrape = await h.scrape()
    assert scrape.get("gpu_xid_errors_total", gpu="0", xid="31", **{"class": "application"}) == 1
    assert scrape.get("gpu_xid_errors_total", gpu="1", xid="43", gpu_instance="1") == 1
    assert scrape.get("gpu_exporter_source_up", source="kmsg") == 1


async def test_backlog_xids_are_history_not_new_errors() -> None:
    """The fatal XID from before start is not counted as new (GPUFatalXID selects only
    gpu_xid_errors_total{class="fatal"}), is exported as history, and still makes
    the GPU unhealthy while it is within --health-xid-window."""
    async with simulated_exporter(LAGGING, argv=["--kmsg"]) as h:
        await h.advance(5)
        scrape = await h.scrape()
    assert scrape.find("gpu_xid_errors_total", **{"class": "fatal"}) == []
    assert scrape.find("gpu_xid_errors_total") == []
    assert scrape.get("gpu_xid_errors_before_start", gpu="1", xid="48", **{"class": "fatal"}) == 1
    assert scrape.get("gpu_health_reason", gpu="1", reason="fatal_xid") == 1
    assert scrape.get("gpu_healthy", gpu="0") == 1


async def test_without_kmsg_the_backlog_is_not_seen_and_live_xids_count_once() -> None:
    async with simulated_exporter(LAGGING) as h:
        await h.advance(61)
        scrape = await h.scrape()
    assert scrape.get("gpu_xid_errors_total", gpu="0", xid="31") == 1
    assert scrape.find("gpu_xid_errors_before_start") == []
    assert scrape.get("gpu_healthy", gpu="1") == 1


# -- the simulated kernel log itself ------------------------------------------------------


def records(path: Path) -> list[tuple[int, float, str]]:
    parsed = (parse_kmsg_record(line) for line in path.read_text().splitlines())
    return [r for r in parsed if r is not None]


async def test_the_kernel_log_stamps_xids_on_a_clock_behind_proc_uptime() -> None:
    clock = ManualClock()
    env = SimEnvironment(parse_scenario(LAGGING, "lagging"), clock=clock, kube_api=False)
    paths = await env.start()
    try:
        clock.advance(95)
        env.sync()
        xids = [(seq, t, m) for seq, t, m in records(paths.kmsg) if "Xid" in m]
        boot = boot_epoch(paths.proc_root, env.node.wall_time())
    finally:
        await env.stop()
    assert [t for _, t, _ in xids] == pytest.approx(
        [864_000 - 600 - 40, 864_060 - 40, 864_090 - 40]
    )
    assert [seq for seq, _, _ in xids] == sorted(seq for seq, _, _ in xids)
    assert xids[0][2].startswith("NVRM: Xid (PCI:0000:28:00): 48, pid=")
    assert parse_xid_attribution(xids[2][2]) == (1, None)
    # through /proc/uptime, the live XID at t=60 converts to 40 s before it was raised
    assert boot is not None
    assert boot + xids[1][1] == pytest.approx(env.node.wall_time(60) - 40)


@pytest.mark.parametrize(
    ("kernel_log", "timeline", "fragment"),
    [
        ({"uptime_s": -1}, [], "kernel_log.uptime_s: -1 is not a number of seconds"),
        ({"clock_lag_s": "a lot"}, [], "kernel_log.clock_lag_s: 'a lot'"),
        ({"drift": 3}, [], "kernel_log: unknown key 'drift'"),
        ({"uptime_s": 30, "clock_lag_s": 40}, [], "logged before boot"),
        ({"uptime_s": 300}, [{"at": -600, "xid": {"gpu": 0, "code": 79}}], "before boot"),
    ],
)
def test_bad_kernel_log_settings_are_one_line(
    kernel_log: dict[str, Any], timeline: list[dict[str, Any]], fragment: str
) -> None:
    with pytest.raises(ScenarioError, match=None) as caught:
        parse_scenario({"gpus": [{}], "kernel_log": kernel_log, "timeline": timeline}, "bad")
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


# -- overruns: records the kernel's ring overwrote before the reader read them -------------

OVERRUN: dict[str, Any] = {
    "gpus": [{}],
    "timeline": [
        {"at": 10, "kmsg_overrun": 500},  # a flood wrapped the ring past the reader
        {"at": 10, "xid": {"gpu": 0, "code": 31}},  # logged after the flood: still read
    ],
}


async def test_a_kernel_log_overrun_is_served_and_counted_as_an_error() -> None:
    async with simulated_exporter(OVERRUN, argv=["--kmsg"]) as h:
        await h.advance(5)
        before = await h.scrape()
        await h.advance(10)
        after = await h.scrape()
    assert before.get("gpu_exporter_kmsg_overruns_total") == 0  # present from the start
    assert before.get("gpu_exporter_errors_total", source="kmsg") == 0
    assert after.get("gpu_exporter_kmsg_overruns_total") == 1
    assert after.get("gpu_exporter_errors_total", source="kmsg") == 1
    assert after.get("gpu_xid_errors_total", gpu="0", xid="31") == 1
    assert after.get("gpu_exporter_source_up", source="kmsg") == 1  # lost records, log read


async def test_without_kmsg_no_overrun_counter_is_served() -> None:
    async with simulated_exporter(OVERRUN) as h:
        await h.advance(15)
        scrape = await h.scrape()
    assert scrape.find("gpu_exporter_kmsg_overruns_total") == []


def test_the_simulated_kernel_log_leaves_the_overwritten_sequence_numbers_out(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    node = SimNode(parse_scenario(OVERRUN, "overrun"), clock=clock)
    writer = SimKernelLogWriter(node, tmp_path / "kmsg", tmp_path)
    writer.start()
    clock.advance(11)
    with node.lock:
        node.advance()
        writer.sync()
    seqs = [seq for seq, _, _ in records(tmp_path / "kmsg")]
    assert seqs == [1, 2, 3, 504, 505]  # boot lines and banner, 500 lost, the flood's last, XID


@pytest.mark.parametrize(
    ("event", "fragment"),
    [
        ({"at": 5, "kmsg_overrun": 0}, "timeline[0].kmsg_overrun: 0 is not a number of records"),
        ({"at": 5, "kmsg_overrun": "many"}, "'many' is not a number of records"),
        ({"at": 0, "kmsg_overrun": 3}, "timeline[0].kmsg_overrun: 'at' must be after start"),
    ],
)
def test_bad_overruns_are_one_line(event: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario({"gpus": [{}], "timeline": [event]}, "bad")
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
