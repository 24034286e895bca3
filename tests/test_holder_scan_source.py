"""The holder scan as a scheduled source: when it walks, how walks continue and merge,
and that it answers last cycle's request over a real proc tree."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from exporter.model import (
    DeviceHolder,
    GpuProcess,
    GpuSample,
    HolderScan,
    HolderScanRequest,
    MigInstance,
    NvmlSnapshot,
    Readings,
)
from exporter.sim.proctree import gpu_fds, host_cgroup, write_process
from exporter.sources.base import Cycle
from exporter.sources.holder_scan import (
    HolderScanSource,
    ScanLedger,
    record_scan,
    scan_due,
    start_pid,
)
from exporter.sources.holders import scan_device_holders

T0 = 1_700_000_000.0
GIB = 1024**3


def uuid_of(index: int) -> str:
    return f"GPU-0000000{index}-0000-0000-0000-000000000000"


def request(*gpus: int) -> HolderScanRequest:
    return HolderScanRequest(tuple((g, uuid_of(g), g) for g in gpus))


def recorded(
    ledger: ScanLedger,
    gpus: Sequence[int],
    holders: Sequence[DeviceHolder] = (),
    *,
    at: float,
    complete: bool = True,
) -> ScanLedger:
    scan = HolderScan(minors=tuple(gpus), holders=tuple(holders), truncated=not complete)
    return record_scan(ledger, scan, request(*gpus), 0, at)


# ---------------------------------------------------------------------------
# The schedule (pure)
# ---------------------------------------------------------------------------


def test_a_scan_covers_every_requested_gpu_and_is_not_repeated_until_rescan_s() -> None:
    assert scan_due(ScanLedger(), request(3, 4), T0, rescan_s=60)
    ledger = recorded(ScanLedger(), [3, 4], at=T0)
    assert not scan_due(ledger, request(3, 4), T0 + 59, rescan_s=60)
    assert scan_due(ledger, request(3, 4), T0 + 60, rescan_s=60)


def test_a_newly_requested_gpu_triggers_a_scan_before_rescan_s() -> None:
    ledger = recorded(ScanLedger(), [3], at=T0)
    assert scan_due(ledger, request(3, 5), T0 + 1, rescan_s=60)


def test_a_truncated_scan_is_continued_next_cycle_and_merged_until_complete() -> None:
    child = DeviceHolder(100, (3,), "pt_data_worker", "holder")
    cut = HolderScan((3, 4), (child,), scanned_pids=50, truncated=True, resume_pid=101)
    ledger = record_scan(ScanLedger(), cut, request(3, 4), 0, T0)
    assert ledger.shown is not None and not ledger.shown.complete

    assert scan_due(ledger, request(3, 4), T0 + 10, rescan_s=60)
    assert start_pid(ledger, request(3, 4)) == 101
    daemon = DeviceHolder(812, (3, 4), "nvidia-persiste", "management")
    rest = HolderScan(minors=(3, 4), holders=(daemon,), scanned_pids=20)
    ledger = record_scan(ledger, rest, request(3, 4), 101, T0 + 10)
    merged = ledger.shown
    assert merged is not None and merged.complete and merged.scanned_pids == 70
    assert [h.pid for h in merged.holders] == [100, 812]
    assert merged.gpus == request(3, 4).gpus
    assert not scan_due(ledger, request(3, 4), T0 + 20, rescan_s=60)


def test_a_continuation_restarts_from_the_first_pid_when_the_gpus_changed() -> None:
    cut = HolderScan(minors=(3,), truncated=True, resume_pid=101)
    ledger = record_scan(ScanLedger(), cut, request(3), 0, T0)
    assert start_pid(ledger, request(3, 4)) == 0
    assert start_pid(ledger, request(3)) == 101


def test_a_cut_short_rescan_keeps_the_last_finished_walk_shown_until_it_completes() -> None:
    daemon = DeviceHolder(812, (4,), "nvidia-persiste", "management")
    ledger = recorded(ScanLedger(), [4], [daemon], at=T0)
    first = ledger.shown

    assert scan_due(ledger, request(4), T0 + 60, rescan_s=60)  # rescan due
    assert start_pid(ledger, request(4)) == 0
    cut = HolderScan((4,), (), scanned_pids=10, truncated=True, resume_pid=500)
    ledger = record_scan(ledger, cut, request(4), 0, T0 + 60)
    assert ledger.shown == first and ledger.shown_at == T0  # still the last one

    assert scan_due(ledger, request(4), T0 + 70, rescan_s=60)  # go on at once
    assert start_pid(ledger, request(4)) == 500
    child = DeviceHolder(900, (4,), "python3", "holder")
    more = HolderScan((4,), (child,), scanned_pids=5)
    ledger = record_scan(ledger, more, request(4), 500, T0 + 70)
    assert ledger.pending is None and ledger.shown_at == T0 + 70
    assert ledger.shown is not None and [h.pid for h in ledger.shown.holders] == [900]
    assert not scan_due(ledger, request(4), T0 + 80, rescan_s=60)


# ---------------------------------------------------------------------------
# The source over a real proc tree
# ---------------------------------------------------------------------------


def nvml_listing(*pids: int) -> NvmlSnapshot:
    """GPU 3 lists ``pids`` on a MIG instance: the scan must leave them out too."""
    mig = MigInstance(
        0,
        "MIG-a",
        1,
        0,
        "3g.40gb",
        40 * GIB,
        GIB,
        tuple(GpuProcess(p, GIB, "compute") for p in pids),
    )
    return NvmlSnapshot(
        ok=True,
        timestamp=T0,
        gpus=(GpuSample(3, uuid_of(3), minor_number=3, mig_instances=(mig,)),),
    )


def cycle(at: float, holder_request: HolderScanRequest | None, *pids: int) -> Cycle:
    return Cycle(at, holder_request=holder_request, readings=Readings(nvml=nvml_listing(*pids)))


def test_the_source_answers_last_cycles_request_and_skips_the_pids_nvml_lists(
    tmp_path: Path,
) -> None:
    for pid, minors in ((10, [3]), (11, [3]), (12, [5])):
        write_process(
            tmp_path, pid, comm="python3", cgroup=host_cgroup("x.service"), fds=gpu_fds(minors)
        )
    source = HolderScanSource(tmp_path)

    assert source.read(cycle(T0, None, 10)) is None  # nothing asked: no walk
    scan = source.read(cycle(T0 + 5, request(3), 10))

    assert scan is not None and scan.complete
    assert [h.pid for h in scan.holders] == [11]  # 10 is listed by NVML, 12 holds GPU 5
    assert scan.gpus == request(3).gpus
    assert source.read(cycle(T0 + 10, request(3), 10)) is scan  # not walked again yet


def test_the_source_forgets_its_walks_once_nothing_is_requested(tmp_path: Path) -> None:
    write_process(tmp_path, 11, comm="python3", cgroup=host_cgroup("x.service"), fds=gpu_fds([3]))
    source = HolderScanSource(tmp_path)
    assert source.read(cycle(T0, request(3))) is not None
    assert source.read(cycle(T0 + 5, None)) is None
    assert source.ledger == ScanLedger()


def test_a_bounded_walk_goes_on_over_the_next_cycles(tmp_path: Path) -> None:
    for pid in range(20, 26):
        write_process(
            tmp_path, pid, comm="python3", cgroup=host_cgroup("x.service"), fds=gpu_fds([3])
        )
    source = HolderScanSource(tmp_path, walk=functools.partial(scan_device_holders, max_pids=2))

    seen = [source.read(cycle(T0 + i, request(3))) for i in range(3)]

    assert [s.scanned_pids if s else None for s in seen] == [2, 4, 6]
    final = seen[-1]
    assert final is not None and final.complete
    assert [h.pid for h in final.holders] == list(range(20, 26))


def test_an_unreadable_proc_root_is_counted_as_an_error(tmp_path: Path) -> None:
    source = HolderScanSource(tmp_path / "missing")
    scan = source.read(cycle(T0, request(3)))
    assert scan is not None and scan.error is not None and not scan.complete
    assert source.errors_total == 1
