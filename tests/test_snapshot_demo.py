"""The README's demo snapshot (node-8gpu at 200 s, --kmsg): the lost GPU, the fatal XID,
the tiny-kernels pod's SM and a why-idle cause, as an operator reads them."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache

import pytest

from exporter.analysis.xid import XidLedger, normalize_pci_bus_id
from exporter.model import GpuSample, XidEvent
from exporter.sim.scenario import load_scenario
from exporter.snapshot import _xid_lines

DEMO = ("--simulate", "node-8gpu", "--simulate-start", "200", "--kmsg", "--window", "1")


def _run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "snapshot", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@cache
def demo_text() -> str:
    return _run(*DEMO)


@cache
def demo_json() -> dict:  # type: ignore[type-arg]
    return json.loads(_run(*DEMO, "--json"))


def section(text: str, title: str) -> list[str]:
    """The table under ``title``: its header line first."""
    return text.split(f"\n{title}\n")[1].split("\n\n")[0].splitlines()


def gpu7_bus_id() -> str:
    bus = load_scenario("node-8gpu").gpus[7].pci_bus_id
    normal = normalize_pci_bus_id(bus)
    assert normal is not None
    return normal


# -- the lost GPU ----------------------------------------------------------------------


@pytest.mark.slow  # a snapshot process on the 8-GPU simulated node (~4 s)
def test_a_gpu_lost_before_start_reads_unknown_not_a_cut_placeholder() -> None:
    """GPU 7 fell off the bus at 151 s, before this exporter started (200 s): NVML never
    gave its UUID, so it is unknown — printed so, not as 'unknown-gpu-' (the placeholder
    unknown-gpu-7 cut to the UUID column's 12 characters, which reads as a broken UUID)."""
    rows = section(demo_text(), "GPUS")[1:]
    lost = next(r for r in rows if r.startswith("7 "))
    assert lost.split()[1] == "unknown"
    assert "unknown-gpu-" not in demo_text()
    assert "UNHEALTHY: gpu_lost" in lost
    # the JSON keeps the placeholder the metrics carry
    health = {h["gpu"]: h for h in demo_json()["health"]}
    assert health[7]["uuid"] == "unknown-gpu-7"


@pytest.mark.slow  # a snapshot process on the 8-GPU simulated node (~4 s)
def test_a_gpu_seen_before_it_is_lost_keeps_its_uuid_in_the_snapshot() -> None:
    """Started at 148 s: the first cycle reads GPU 7, the second (4 s later, past its fall
    at 151 s) finds it lost; it keeps the UUID it had, and its XID 79 (150 s) names it."""
    text = _run("--simulate", "node-8gpu", "--simulate-start", "148", "--kmsg", "--window", "4")
    uuid = load_scenario("node-8gpu").gpus[7].uuid
    lost = next(r for r in section(text, "GPUS")[1:] if r.startswith("7 "))
    assert lost.split()[1] == uuid[:12] and "gpu_lost" in lost
    xids = section(text, "XID ERRORS SINCE START")[1:]
    assert any(r.split()[:2] == ["7", "79"] for r in xids)


# -- the fatal XID ---------------------------------------------------------------------


@pytest.mark.slow  # a snapshot process on the 8-GPU simulated node (~4 s)
def test_the_fatal_xid_of_a_gpu_never_listed_names_it_by_its_pci_address() -> None:
    """The kernel log names the GPU of XID 79 by its PCI address; NVML never listed GPU 7
    (lost before start), so its index is unknown, but the row names the address, not '-'."""
    rows = section(demo_text(), "XID ERRORS BEFORE START (kernel log)")[1:]
    row = next(r for r in rows if r.split()[1] == "79")
    assert row.split()[0] == f"PCI:{gpu7_bus_id()}"
    counts = [x for x in demo_json()["xid_counts_before_start"] if x["xid"] == 79]
    assert [(x["gpu"], x["uuid"], x["pci_bus_ids"]) for x in counts] == [
        (None, None, [gpu7_bus_id()])
    ]


def test_unresolved_xids_keep_the_pci_addresses_they_came_from() -> None:
    """Two kernel-log XIDs of devices NVML does not list: one count (one series: the
    labels name no GPU), the addresses both kept; a resolved one carries none."""
    listed = GpuSample(index=0, uuid="GPU-a", pci_bus_id="00000000:18:00.0")
    events = [
        XidEvent(timestamp=1.0, gpu=None, uuid=None, xid=79, source="kmsg", pci_bus_id=bus)
        for bus in ("0000:3b:00", "0000:86:00", "0000:18:00")
    ]
    ledger = XidLedger().record(events, now=2.0, bus_ids={"00000000:18:00.0": (0, "GPU-a")})
    counts = {(k.gpu, k.uuid): n for k, n in ledger.counts.items()}
    assert counts == {(None, None): 2, (0, "GPU-a"): 1}
    assert ledger.unresolved_pci == {
        next(k for k in ledger.counts if k.gpu is None): frozenset({"0000:3b:00", "0000:86:00"})
    }
    assert listed.index == 0


def test_unresolved_addresses_are_bounded_over_all_counts() -> None:
    """A hostile kernel log: 2,000 XID numbers from 40 addresses no GPU has. The counts
    are the log's; the addresses kept stay bounded, per count and in all (an adversarial review)."""
    from exporter.analysis.xid import MAX_UNRESOLVED_PCI, MAX_UNRESOLVED_PCI_TOTAL

    events = [
        XidEvent(
            timestamp=1.0,
            gpu=None,
            uuid=None,
            xid=xid,
            source="kmsg",
            pci_bus_id=f"0000:{b:02x}:00",
        )
        for xid in range(2000)
        for b in range(40)
    ]
    ledger = XidLedger().record(events, now=2.0, bus_ids={})
    assert sum(ledger.counts.values()) == 80_000
    kept = [len(named) for named in ledger.unresolved_pci.values()]
    assert max(kept) <= MAX_UNRESOLVED_PCI
    assert sum(kept) == MAX_UNRESOLVED_PCI_TOTAL
    again = ledger.record(events[:400], now=3.0, bus_ids={})
    assert sum(len(n) for n in again.unresolved_pci.values()) == MAX_UNRESOLVED_PCI_TOTAL


def test_an_xid_row_without_gpu_or_address_reads_unknown() -> None:
    from exporter.model import XidCount

    class _A:
        xid_counts = (XidCount(None, None, 79, "fatal", None, None, 1),)
        xid_counts_before_start = ()

    lines = _xid_lines(_A())  # type: ignore[arg-type]
    assert lines[-1].split()[0] == "unknown"


# -- SM: one figure in both tables -----------------------------------------------------


@pytest.mark.slow  # a snapshot process on the 8-GPU simulated node (~4 s)
def test_tiny_kernels_reads_the_same_sm_in_the_gpu_and_the_pods_table() -> None:
    """GPU 4 is tiny-kernels' alone: the SM its processes had (PODS) is the GPU's SM
    activity (GPUS), 2 %, also after its loader was killed at 90 s."""
    text = demo_text()
    gpu4 = next(r for r in section(text, "GPUS")[1:] if r.startswith("4 "))
    assert section(text, "PODS")[0].split()[-2:] == ["SM", "PROCS"]
    pod = next(r for r in section(text, "PODS")[1:] if " tiny-kernels " in r).split()
    assert pod[-2] == "2%"
    assert gpu4.split()[-4] == "2%"  # SM-ACTIVE


# -- why idle --------------------------------------------------------------------------


@pytest.mark.slow  # a snapshot process on the 8-GPU simulated node (~4 s)
def test_the_demo_shows_an_idle_cause_that_is_not_unknown() -> None:
    rows = section(demo_text(), "ALLOCATED BUT IDLE")
    why = rows[0].index("WHY IDLE")
    causes = {r.split()[1]: r[why:].strip() for r in rows[1:]}
    assert causes["tiny-kernels"].startswith("cpu throttled ")
    # the starved chat pods: measured, no CPU or I/O cause (their GPU's turns go to the hog)
    assert causes["chat-a"].startswith("unknown (cpu throttled 0%")
    reasons = {r["pod"]: r["cause"] for r in demo_json()["why_idle"]}
    assert reasons["tiny-kernels"] == "cpu_throttled"


def test_the_demo_scenario_gives_every_container_a_cgroup() -> None:
    scenario = load_scenario("node-8gpu")
    assert all(c.cgroup is not None for p in scenario.pods for c in p.containers)
