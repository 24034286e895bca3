"""XID severity and the XID ledger (pure): what an XID means for the GPU that raised it.

The severity classes answer one operator question, "what does this XID do to the GPU?":

- ``application``: a fault of (or contained to) one application; the GPU stays healthy.
- ``warning``: the GPU still serves work but recorded something an operator should
  watch (corrected/contained memory errors, remap events, firmware hiccups).
- ``fatal``: the GPU must be reset (or the node rebooted) before it can be trusted.
- ``unknown``: a code this table does not list. It is counted and shown as such, never
  silently dropped or guessed; health treats it like ``warning`` (no capacity taken
  away on a code nobody classified) and ``--xid-class`` can classify it.

The table is our own reading of NVIDIA's Xid catalog (Ampere and newer, "Resolution
Bucket (Immediate Action)": RESTART_APP -> application, IGNORE -> warning, RESET_GPU /
RESTART_BM / reset workflows -> fatal) checked against DCGM's health watch
(modules/health/DcgmHealthWatch.cpp: its "devastating" XIDs 48, 74, 79, 95, 119, 120,
140 fail a GPU) and the k8s-device-plugin's ignored XIDs (internal/rm/health.go: 13, 31,
43, 45, 68 -- all application here -- and, since v0.18.0, 109, which stays fatal here
because the catalog's immediate action for it is RESET_GPU). docs/xid.md lists every row
with its meaning and what to do, and the judgement calls.

The ledger turns a stream of ``XidEvent`` into a true counter per (gpu, uuid, xid,
severity) and a short memory of recent events per GPU for the health verdict. Its
windows (de-duplication, retention, the health verdict's fatal-XID window) run on the
monotonic clock (``XidEvent.monotonic``; ``now`` and ``since_ts`` on the same clock): a
wall-clock step would otherwise clear a true fault at once, or hold one for hours. XIDs the
kernel log held from before the exporter started (``XidEvent.backlog``) are counted
apart: they are history, not new errors, so nothing that alerts on new XIDs sees them.
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from exporter.model import GpuSample, XidCount, XidEvent
from exporter.model.xid_classes import (
    APPLICATION,
    FATAL,
    UNKNOWN,
    WARNING,
)

# code -> (class, meaning). Meanings follow the catalog's descriptions, shortened.
XID_CATALOG: dict[int, tuple[str, str]] = {
    8: (APPLICATION, "GPU stopped processing (channel idle timeout)"),
    11: (APPLICATION, "Invalid or corrupted push buffer stream"),
    13: (APPLICATION, "Graphics engine exception (e.g. out-of-range access, illegal instruction)"),
    25: (APPLICATION, "Invalid or illegal push buffer stream"),
    31: (APPLICATION, "GPU memory page fault (MMU fault)"),
    32: (APPLICATION, "Invalid or corrupted push buffer stream (PBDMA)"),
    38: (WARNING, "Driver firmware error (FECS watchdog timeout)"),
    39: (APPLICATION, "Copy engine exception (CE0)"),
    40: (APPLICATION, "Copy engine exception (CE1)"),
    41: (APPLICATION, "Copy engine exception (CE2)"),
    43: (APPLICATION, "GPU stopped processing (reset channel verification)"),
    44: (WARNING, "Graphics engine fault during context switch"),
    45: (APPLICATION, "Preemptive cleanup, due to previous errors"),
    46: (FATAL, "GPU stopped processing (GPU timeout)"),
    48: (FATAL, "Double-bit ECC error"),
    54: (WARNING, "Auxiliary power is not connected to the GPU board"),
    60: (APPLICATION, "Video processor exception (SEC2)"),
    62: (FATAL, "Internal micro-controller halt"),
    63: (WARNING, "GPU memory remapping event (row remap / page retirement recorded)"),
    64: (FATAL, "GPU memory remapping failure"),
    66: (WARNING, "Illegal access by driver (register access violation)"),
    67: (WARNING, "Illegal access by driver (verification violation)"),
    68: (APPLICATION, "NVDEC0 exception (video decoder)"),
    69: (APPLICATION, "Graphics engine class error"),
    74: (FATAL, "NVLink error"),
    79: (FATAL, "GPU has fallen off the bus"),
    80: (APPLICATION, "Corrupted data sent to GPU (push buffer CRC mismatch)"),
    92: (WARNING, "High single-bit ECC error rate"),
    93: (WARNING, "InfoROM wear limit exceeded (non-fatal)"),
    94: (WARNING, "Contained memory error (only the affected application is stopped)"),
    95: (FATAL, "Uncontained memory error"),
    109: (FATAL, "Context switch timeout"),
    110: (FATAL, "Security fault error"),
    119: (FATAL, "GSP RPC timeout"),
    120: (FATAL, "GSP error"),
    121: (WARNING, "C2C link corrected error"),
    136: (FATAL, "NVLink link training failed"),
    137: (WARNING, "NVLink privilege error"),
    140: (FATAL, "Unrecovered ECC error"),
    143: (FATAL, "GPU initialization error"),
    144: (WARNING, "NVLink SAW error (decode intrinfo; some sub-codes need a reset)"),
    145: (WARNING, "NVLink RLW error (decode intrinfo; some sub-codes need a reset)"),
    146: (WARNING, "NVLink TLW error (decode intrinfo; some sub-codes need a reset)"),
    147: (WARNING, "NVLink TREX error (decode intrinfo; some sub-codes need a reset)"),
    148: (WARNING, "NVLink NVLPW_CTRL error (decode intrinfo; some sub-codes need a reset)"),
    149: (WARNING, "NVLink NETIR error (decode intrinfo; some sub-codes need a reset)"),
    150: (WARNING, "NVLink MSE error (decode intrinfo; some sub-codes need a reset)"),
    154: (WARNING, "GPU recovery action changed (the message names the action)"),
    155: (FATAL, "NVLink software-defined error"),
    156: (FATAL, "Resource retirement event (reset to apply)"),
    157: (WARNING, "Resource retirement failure"),
    158: (FATAL, "GPU fatal timeout"),
    167: (FATAL, "PCIe fatal timeout"),
    169: (FATAL, "Internal micro-controller halt (SEC2)"),
    171: (FATAL, "Uncorrectable DRAM error (detail for XID 48)"),
    172: (FATAL, "Uncorrectable SRAM error (detail for XID 48)"),
}
XID_SEVERITY: dict[int, str] = {code: sev for code, (sev, _) in XID_CATALOG.items()}
XID_DESCRIPTION: dict[int, str] = {code: text for code, (_, text) in XID_CATALOG.items()}

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (pynvml NVML_GPU_RECOVERY_ACTION_*); kept
# here as plain ints so analysis needs no NVML import. A test pins them to pynvml.
RECOVERY_ACTIONS: dict[int, str] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}
_PCI = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"(?:\.[0-7])?$"
)


def classify(xid: int, overrides: Mapping[int, str] | None = None) -> str:
    """The class of one XID: an operator override, else the table, else "unknown"."""
    if overrides and xid in overrides:
        return overrides[xid]
    return XID_SEVERITY.get(xid, UNKNOWN)


def recovery_action_name(value: int) -> str:
    """Label for a ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` value."""
    return RECOVERY_ACTIONS.get(value, "unknown")


@functools.lru_cache(maxsize=1024)  # a node has a few addresses; a storm repeats them
def normalize_pci_bus_id(bus_id: str) -> str | None:
    """One spelling for both sides of de-duplication: "dddd:bb:dd" lower case.

    NVML says "00000000:3B:00.0", the kernel log "0000:3b:00"; a PCI function is
    dropped because the driver logs per device.
    """
    match = _PCI.match(bus_id.strip().removeprefix("PCI:"))
    if match is None:
        return None
    domain = int(match.group("domain") or "0", 16)
    return f"{domain:04x}:{int(match.group('bus'), 16):02x}:{int(match.group('dev'), 16):02x}"


def bus_id_map(gpus: Iterable[GpuSample]) -> dict[str, tuple[int, str]]:
    """PCI bus id -> (index, uuid) for ``XidLedger.record``, from this cycle's GPUs.

    A GPU that failed this cycle still carries the bus id it was last opened with (the
    NVML source keeps a lost GPU's identity), so the XID 79 that arrives after it fell
    off the bus still names it; a GPU NVML never opened has no bus id and is skipped.
    """
    out: dict[str, tuple[int, str]] = {}
    for gpu in gpus:
        key = normalize_pci_bus_id(gpu.pci_bus_id) if gpu.pci_bus_id else None
        if key is not None:
            out[key] = (gpu.index, gpu.uuid)
    return out


# PCI addresses kept per count that names no GPU: more than a node has GPUs, fewer than a
# kernel log of garbage bus ids could make (outside input is bounded).
MAX_UNRESOLVED_PCI = 32
# ... and over all counts: XID numbers and MIG ids in the kernel log are free integers, so
# the counts that name no GPU are as many as a hostile log makes; their addresses are not.
MAX_UNRESOLVED_PCI_TOTAL = 256


class XidKey(NamedTuple):
    """One ``gpu_xid_errors_total`` series; MIG XIDs also name their instance."""

    gpu: int | None
    uuid: str | None
    xid: int
    severity: str
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(frozen=True, slots=True)
class RecordedXid:
    """An event as the ledger keeps it: GPU resolved, classified, sources merged.

    ``historical``: a kernel-log backlog record (raised before the exporter started).
    It is counted in ``counts_before_start``, and still weighs in the health verdict
    while its (approximate) time is within the window: a restart must not forget a GPU
    that needs a reset.
    """

    event: XidEvent
    severity: str
    sources: frozenset[str]
    historical: bool = False


@dataclass(frozen=True, slots=True)
class XidLedger:
    """Immutable accumulator: ``record()`` returns a new ledger, the old one is unchanged.

    The mappings are never mutated after construction; each ``record()`` copies what it
    changes, so a ledger handed to exposition stays consistent while the next is built.
    """

    overrides: Mapping[int, str] = field(default_factory=dict)
    dedup_window_s: float = 5.0
    retention_s: float = 3600.0
    max_recent_per_gpu: int = 512  # bounds memory through an XID storm
    counts: Mapping[XidKey, int] = field(default_factory=dict)  # raised while we ran
    counts_before_start: Mapping[XidKey, int] = field(default_factory=dict)  # backlog
    recent: Mapping[str | None, tuple[RecordedXid, ...]] = field(default_factory=dict)
    # A count that names no GPU (a kernel-log record whose bus id no GPU NVML listed has)
    # -> the PCI addresses (normalised) its records named: where NVML never gave the
    # GPU's index or UUID, the kernel log's address is what there is to say which GPU.
    unresolved_pci: Mapping[XidKey, frozenset[str]] = field(default_factory=dict)

    def record(
        self,
        events: Iterable[XidEvent],
        now: float,
        bus_ids: Mapping[str, tuple[int, str]] | None = None,
    ) -> XidLedger:
        """Count ``events`` once each, de-duplicating NVML against kmsg.

        ``bus_ids`` maps a PCI bus id (any spelling ``normalize_pci_bus_id`` accepts)
        to (gpu index, uuid); it lets a kernel-log event name its GPU. An event that
        cannot be resolved is still counted, with gpu and uuid None. Backlog events go
        to ``counts_before_start``; one that NVML also reports was raised after start
        after all (the backlog was still being read) and moves to ``counts``.
        """
        resolver = {
            normal: target
            for raw, target in (bus_ids or {}).items()
            if (normal := normalize_pci_bus_id(raw)) is not None
        }
        counts = dict(self.counts)
        before = dict(self.counts_before_start)
        unresolved = dict(self.unresolved_pci)
        stored = sum(len(named) for named in unresolved.values())
        recent = {uuid: list(entries) for uuid, entries in self.recent.items()}
        twins: dict[str | None, _TwinIndex] = {}
        for raw_event in events:
            event = _resolve(raw_event, resolver)
            entries = recent.setdefault(event.uuid, [])
            index = twins.get(event.uuid)
            if index is None:
                index = twins[event.uuid] = _TwinIndex(entries)
            twin = index.find(event, self.dedup_window_s)
            if twin is not None:
                seen = entries[twin]
                if seen.historical and not event.backlog:
                    key = _key(seen.event, seen.severity)
                    before[key] -= 1
                    if not before[key]:
                        del before[key]
                    counts[key] = counts.get(key, 0) + 1
                entries[twin] = replace(
                    seen,
                    sources=seen.sources | {event.source},
                    historical=seen.historical and event.backlog,
                )
                index.merged(twin, event.source)
                continue
            severity = classify(event.xid, self.overrides)
            key = _key(event, severity)
            tally = before if event.backlog else counts
            tally[key] = tally.get(key, 0) + 1
            if event.uuid is None and event.pci_bus_id is not None:
                bus = normalize_pci_bus_id(event.pci_bus_id)
                named = unresolved.get(key, frozenset())
                if (
                    bus is not None
                    and bus not in named
                    and len(named) < MAX_UNRESOLVED_PCI
                    and stored < MAX_UNRESOLVED_PCI_TOTAL
                ):
                    unresolved[key] = named | {bus}
                    stored += 1
            entries.append(RecordedXid(event, severity, frozenset({event.source}), event.backlog))
            index.appended()
        horizon = now - self.retention_s
        pruned: dict[str | None, tuple[RecordedXid, ...]] = {}
        for uuid, entries in recent.items():
            kept = sorted(
                (e for e in entries if _at(e.event) >= horizon),
                key=lambda e: _at(e.event),
            )[-self.max_recent_per_gpu :]
            if kept:
                pruned[uuid] = tuple(kept)
        return replace(
            self,
            counts=counts,
            counts_before_start=before,
            recent=pruned,
            unresolved_pci=unresolved,
        )

    def events_since(
        self, gpu_uuid: str, since_ts: float, severity: str | None = None
    ) -> list[RecordedXid]:
        """Recent events of one GPU at or after ``since_ts``, oldest first."""
        return [
            e
            for e in self.recent.get(gpu_uuid, ())
            if _at(e.event) >= since_ts and (severity is None or e.severity == severity)
        ]

    def fatal_since(self, gpu_uuid: str, since_ts: float) -> list[XidEvent]:
        """Fatal XIDs of one GPU at or after ``since_ts`` (within the retention window)."""
        return [e.event for e in self.events_since(gpu_uuid, since_ts, FATAL)]

    def recent_fatal(self, since_ts: float) -> dict[str, list[int]]:
        """GPU UUID -> fatal XID codes since ``since_ts``: the shape health.assess takes."""
        out: dict[str, list[int]] = {}
        for uuid in self.recent:
            if uuid is None:
                continue
            codes = [e.xid for e in self.fatal_since(uuid, since_ts)]
            if codes:
                out[uuid] = codes
        return out


def xid_counts(ledger: XidLedger, counts: Mapping[XidKey, int]) -> tuple[XidCount, ...]:
    """``counts`` (the ledger's ``counts`` or ``counts_before_start``) as findings; one
    that names no GPU carries the PCI addresses its kernel-log records named."""
    return tuple(
        XidCount(*key, count, tuple(sorted(ledger.unresolved_pci.get(key, ()))))
        for key, count in counts.items()
    )


class _TwinIndex:
    """Where the other source's sighting of an XID may be, for one GPU's entries.

    Per (xid, source): the entries that source has not yet merged into, in time order,
    so an event's twin is a bisect and a short walk outwards instead of a pass over every
    entry: in an XID storm (thousands in one cycle, from NVML and the kernel log) that
    pass made ``record()`` quadratic, seconds of a cycle for 8,000 events. The twin is
    the compatible entry closest in time within the window, the earliest on a tie.
    """

    def __init__(self, entries: list[RecordedXid]) -> None:
        self._entries = entries
        # xid -> its entries' positions, and xid -> source -> the lists built so far:
        # a new entry and a new list touch only their own xid's, so a log of thousands
        # of distinct XID numbers is not a pass over every entry (or list) per event.
        self._by_xid: dict[int, list[int]] = {}
        for i, e in enumerate(entries):
            self._by_xid.setdefault(e.event.xid, []).append(i)
        self._lacking: dict[int, dict[str, list[tuple[float, int]]]] = {}

    def _list(self, xid: int, source: str) -> list[tuple[float, int]]:
        lists = self._lacking.setdefault(xid, {})
        found = lists.get(source)
        if found is None:
            found = lists[source] = sorted(
                (_at(self._entries[i].event), i)
                for i in self._by_xid.get(xid, ())
                if source not in self._entries[i].sources
            )
        return found

    def find(self, event: XidEvent, window_s: float) -> int | None:
        lacking = self._list(event.xid, event.source)
        ts = _at(event)
        right = bisect.bisect_left(lacking, (ts, -1))
        left = right - 1
        best: tuple[float, int] | None = None
        while True:
            gap_left = ts - lacking[left][0] if left >= 0 else math.inf
            gap_right = lacking[right][0] - ts if right < len(lacking) else math.inf
            gap = min(gap_left, gap_right)
            if gap > window_s or (best is not None and gap > best[0]):
                return None if best is None else best[1]
            # One run of equal stamps at a time, earliest entry first: a storm stamped
            # within one clock tick is one run, not thousands of steps.
            if gap_left <= gap_right:
                stamp = lacking[left][0]
                run = range(bisect.bisect_left(lacking, (stamp, -1), 0, left + 1), left + 1)
                left = run.start - 1
            else:
                stamp = lacking[right][0]
                run = range(right, bisect.bisect_right(lacking, (stamp, math.inf), right))
                right = run.stop
            for at in run:
                index = lacking[at][1]
                seen = self._entries[index].event
                if _compatible(seen.gpu_instance_id, event.gpu_instance_id) and _compatible(
                    seen.compute_instance_id, event.compute_instance_id
                ):
                    if best is None or (gap, index) < best:
                        best = (gap, index)
                    break

    def appended(self) -> None:
        """The last entry is new: every list of its xid whose source it lacks gets it."""
        index = len(self._entries) - 1
        entry = self._entries[index]
        self._by_xid.setdefault(entry.event.xid, []).append(index)
        for source, lacking in self._lacking.get(entry.event.xid, {}).items():
            if source not in entry.sources:
                bisect.insort(lacking, (_at(entry.event), index))

    def merged(self, index: int, source: str) -> None:
        """Entry ``index`` now has ``source``: it is no longer a twin for that source."""
        entry = self._entries[index]
        lacking = self._lacking.get(entry.event.xid, {}).get(source)
        if lacking is None:
            return
        at = bisect.bisect_left(lacking, (_at(entry.event), index))
        if at < len(lacking) and lacking[at][1] == index:
            del lacking[at]


def _at(event: XidEvent) -> float:
    """When an event was raised, on the clock the ledger's windows run on: the monotonic
    clock where the source stamped it (a wall-clock step then moves no window), else its
    wall-clock timestamp (a ledger fed only wall-clock times, as in unit tests)."""
    return event.monotonic if event.monotonic is not None else event.timestamp


def _key(event: XidEvent, severity: str) -> XidKey:
    return XidKey(
        event.gpu,
        event.uuid,
        event.xid,
        severity,
        event.gpu_instance_id,
        event.compute_instance_id,
    )


def _resolve(event: XidEvent, resolver: Mapping[str, tuple[int, str]]) -> XidEvent:
    if event.uuid is not None or event.pci_bus_id is None:
        return event
    key = normalize_pci_bus_id(event.pci_bus_id)
    target = resolver.get(key) if key is not None else None
    if target is None:
        return event
    return replace(event, gpu=target[0], uuid=target[1])


def _compatible(a: int | None, b: int | None) -> bool:
    """MIG ids match unless both sides know them and they differ."""
    return a is None or b is None or a == b
