"""The holder scan as a scheduled source: last cycle's request in, a walk out.

Analysis finds GPUs with unattributed memory and asks, in ``Analysis.holder_request``,
who holds their device files. The next cycle this source answers, in
``NodeSnapshot.holder_scan``, so data still flows one way. The walk itself
(``exporter.sources.holders``) reads every fd link on the node, so this source decides
how seldom to run it:

- only while a request is open (some GPU has unattributed memory);
- when a requested GPU is not covered by the walk shown, that walk is ``rescan_s`` old,
  or a walk was cut short by its bound (then it goes on from ``resume_pid`` on the next
  cycles until it has seen every pid, and the parts are merged);
- while a rescan of the same GPUs is still cut short, the last finished walk stays the
  one shown, so verdicts do not blink out every ``rescan_s`` on a large node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from exporter.model import HolderScan, HolderScanRequest, SourceName
from exporter.sources.base import Cycle, Source
from exporter.sources.holders import scan_device_holders

DEFAULT_RESCAN_S = 60.0


@dataclass(frozen=True, slots=True)
class ScanLedger:
    """What the source carries between cycles."""

    shown: HolderScan | None = None  # the last finished walk, or a first cut-short one
    shown_at: float | None = None
    pending: HolderScan | None = None  # a rescan cut short, still going on

    def unfinished(self) -> HolderScan | None:
        """The walk a continuation extends: a rescan in progress, or a cut-short first."""
        if self.pending is not None:
            return self.pending
        shown = self.shown
        return shown if shown is not None and shown.resume_pid is not None else None


def scan_due(ledger: ScanLedger, request: HolderScanRequest, now: float, rescan_s: float) -> bool:
    """True when the requested GPUs need a walk now; False on most cycles."""
    shown = ledger.shown
    fresh = (
        shown is not None
        and ledger.unfinished() is None
        and ledger.shown_at is not None
        and now - ledger.shown_at < rescan_s
    )
    covered = {uuid for _, uuid, _ in shown.gpus} if shown is not None else set()
    return not (fresh and covered.issuperset(uuid for _, uuid, _ in request.gpus))


def start_pid(ledger: ScanLedger, request: HolderScanRequest) -> int:
    """Where to walk from: where the last walk stopped if it was cut short for the same
    GPUs, else the beginning."""
    chain = ledger.unfinished()
    same = ledger.shown is not None and ledger.shown.gpus == request.gpus
    if chain is None or chain.resume_pid is None or not same:
        return 0
    return chain.resume_pid


def record_scan(
    ledger: ScanLedger, scan: HolderScan, request: HolderScanRequest, started_at: int, now: float
) -> ScanLedger:
    """The ledger with this walk recorded; a continuation is merged into the walk it
    continues (the newer entry wins for a pid seen twice)."""
    scan = replace(scan, gpus=request.gpus)
    chain = ledger.unfinished()
    if started_at > 0 and chain is not None:
        holders = {h.pid: h for h in (*chain.holders, *scan.holders)}
        scan = replace(
            scan,
            holders=tuple(holders[pid] for pid in sorted(holders)),
            scanned_pids=chain.scanned_pids + scan.scanned_pids,
            unreadable_pids=chain.unreadable_pids + scan.unreadable_pids,
            duration_s=chain.duration_s + scan.duration_s,
            error=scan.error or chain.error,
        )
    shown = ledger.shown
    if (
        scan.resume_pid is not None
        and shown is not None
        and shown.resume_pid is None
        and shown.gpus == request.gpus
    ):
        return replace(ledger, pending=scan)
    return ScanLedger(shown=scan, shown_at=now, pending=None)


class HolderScanSource(Source):
    """Walks ``<proc-root>/*/fd`` for the requested GPUs' device files, seldom."""

    name: ClassVar[SourceName] = "holders"

    def __init__(
        self,
        proc_root: Path,
        *,
        rescan_s: float = DEFAULT_RESCAN_S,
        walk: Callable[..., HolderScan] = scan_device_holders,
    ) -> None:
        self._proc_root = proc_root
        self._rescan_s = rescan_s
        self._walk = walk
        self._ledger = ScanLedger()
        self._errors_total = 0

    @property
    def ledger(self) -> ScanLedger:
        return self._ledger

    @property
    def errors_total(self) -> int:
        return self._errors_total

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.holder_scan = self.read(cycle)

    def read(self, cycle: Cycle) -> HolderScan | None:
        request = cycle.holder_request
        if request is None:  # nothing unattributed: forget the walks
            self._ledger = ScanLedger()
            return None
        if scan_due(self._ledger, request, cycle.timestamp, self._rescan_s):
            start = start_pid(self._ledger, request)
            scan = self._walk(
                self._proc_root,
                request.minors,
                exclude_pids=cycle.gpu_pids(),
                start_pid=start,
            )
            if scan.error:
                self._errors_total += 1
            self._ledger = record_scan(self._ledger, scan, request, start, cycle.timestamp)
        return self._ledger.shown
