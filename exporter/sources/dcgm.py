"""Optional DCGM source: profiling occupancy and health watches through DCGM's Python bindings.

DCGM is not on PyPI: its bindings (``pydcgm``, ``dcgm_structs``, ``dcgm_fields``, ...)
ship with the DCGM packages, so they are imported lazily, in ``open()``, from
``--dcgm-bindings-path`` (or the packages' default directories). Nothing is imported
when ``--dcgm off``.

Connection modes (``--dcgm``):

- ``HOST:PORT``: a standalone ``nv-hostengine`` only (``DcgmHandle(ipAddress=...)``).
- ``auto``: host engines first, in the order ``DcgmMode.hostengines`` gives
  (``DCGM_REMOTE_HOSTENGINE_INFO``, the GPU Operator's ``nvidia-dcgm`` Service,
  ``127.0.0.1:5555``), then an embedded host engine in this process
  (``DcgmHandle(ipAddress=None)``). Host engines come first because on pre-Hopper GPUs
  one profiling client at a time owns a GPU's performance counters: an embedded engine
  next to dcgm-exporter's (or Nsight) makes one of them fail. When it must start one
  on such GPUs, it says so in a warning before it watches any profiling field.
- ``off``: disabled.

Failure isolation mirrors the NVML source: ``sample()`` never raises. Missing bindings,
a missing ``libdcgm``, an unreachable host engine or a DCGM error mid-run give
``DcgmSnapshot(ok=False)`` with a one-line error and a reconnect after backoff. A
feature DCGM answers "unavailable" for (profiling on an unsupported GPU, profiling
counters held by another tool, a module not loaded) only drops that feature and is
reported as ``error`` on an ``ok`` snapshot.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from exporter.model import (
    DcgmHealthIncident,
    DcgmMode,
    DcgmSnapshot,
    Occupancy,
    OccupancyField,
    SourceName,
    SourceStatus,
)
from exporter.sources.backoff import Backoff
from exporter.sources.base import Cycle, Source
from exporter.text import one_line

log = logging.getLogger(__name__)

# Where the DCGM 4 and DCGM 3 packages install the bindings.
DEFAULT_BINDINGS_DIRS = (
    "/usr/share/datacenter-gpu-manager-4/bindings/python3",
    "/usr/local/dcgm/bindings/python3",
)
# DCGM 4 retries a refused or unresolvable address every 50 ms until the timeout
# (DcgmClientHandler::GetConnHandleForHostEngine), so every absent host engine costs the
# whole timeout: auto, which probes several, uses a shorter one.
CONNECT_TIMEOUT_MS = 2000
AUTO_CONNECT_TIMEOUT_MS = 1000

# Occupancy attribute -> DCGM field id. By number: DCGM 4.6 renamed these fields
# (DCGM_FI_PROF_SM_ACTIVE -> DCGM_FI_PROF_SM_UTIL_RATIO, ...), the ids never changed.
# All are doubles, already ratios 0..1 (DCGM divides the GPM percentages by 100).
PROFILING_FIELDS: dict[OccupancyField, int] = {
    "graphics_active": 1001,  # DCGM_FI_PROF_GR_ENGINE_ACTIVE
    "sm_active": 1002,  # DCGM_FI_PROF_SM_ACTIVE
    "sm_occupancy": 1003,  # DCGM_FI_PROF_SM_OCCUPANCY
    "tensor_active": 1004,  # DCGM_FI_PROF_PIPE_TENSOR_ACTIVE
    "dram_active": 1005,  # DCGM_FI_PROF_DRAM_ACTIVE
    "fp64_active": 1006,  # DCGM_FI_PROF_PIPE_FP64_ACTIVE
    "fp32_active": 1007,  # DCGM_FI_PROF_PIPE_FP32_ACTIVE
    "fp16_active": 1008,  # DCGM_FI_PROF_PIPE_FP16_ACTIVE
}
# How long close() waits for a DCGM call in flight (a connect attempt takes at most its
# timeout, 2 s) before leaving it to the process's exit.
CLOSE_WAIT_S = 5.0
# Reads on a connection before a GPU that gave no profiling value counts as not profiled
# by DCGM: the first reads after a watch is set up may be blank (DCGM refreshes a watched
# field once per update interval), which says nothing yet.
SETTLE_READS = 3
# Pre-Hopper GPUs multiplex profiling counters in passes, and a watch needing too many
# passes fails with DCGM_ST_PROFILING_MULTI_PASS (DCGM's test_prof.py): then the
# activity/occupancy core is watched alone, without the per-pipe FP fields.
PROFILING_FALLBACK_FIELDS: tuple[int, ...] = (1001, 1002, 1003, 1004, 1005)
# dcgmvalue.DCGM_FP64_BLANK: doubles at or above it are "blank", "not found",
# "not supported" or "not permissioned" sentinels, never measurements.
FP64_BLANK = 140737488355328.0

HEALTH_SYSTEMS: dict[int, str] = {  # dcgm_structs.DCGM_HEALTH_WATCH_*
    0x1: "pcie",
    0x2: "nvlink",
    0x4: "pmu",
    0x8: "mcu",
    0x10: "mem",
    0x20: "sm",
    0x40: "inforom",
    0x80: "thermal",
    0x100: "power",
    0x200: "driver",
    0x400: "nvswitch_nonfatal",
    0x800: "nvswitch_fatal",
    0x1000: "connectx",
}
HEALTH_RESULTS: dict[int, str] = {0: "pass", 10: "warn", 20: "fail"}  # DCGM_HEALTH_RESULT_*

# DCGM answers, but cannot provide this feature here: drop the feature, keep the source.
_UNAVAILABLE_STATUSES = (
    "DCGM_ST_NOT_SUPPORTED",
    "DCGM_ST_PROFILING_NOT_SUPPORTED",
    "DCGM_ST_PROFILING_MULTI_PASS",
    "DCGM_ST_PROFILING_LIBRARY_ERROR",  # counters held by another profiler (Nsight, DCGM)
    "DCGM_ST_MODULE_NOT_LOADED",
    "DCGM_ST_REQUIRES_ROOT",
    "DCGM_ST_NO_PERMISSION",
    "DCGM_ST_INSUFFICIENT_DRIVER_VERSION",
    "DCGM_ST_GPU_NOT_SUPPORTED",
    "DCGM_ST_GROUP_INCOMPATIBLE",  # profiling wants one GPU SKU per group
    "DCGM_ST_IN_USE",
)
# ... and of those, the answers meaning another profiling client holds the counters
# (dcgmproftester's message for IN_USE: "Another process is already using the profiling
# infrastructure"; NVIDIA/DCGM#56, #106 for the library error next to Nsight/CUPTI).
_HELD_STATUSES = ("DCGM_ST_IN_USE", "DCGM_ST_PROFILING_LIBRARY_ERROR")
HELD_HINT = (
    "the profiling counters are held by another client (dcgm-exporter's own host "
    "engine, Nsight, another DCGM); share one host engine, see docs/dcgm.md"
)

EMBEDDED = "embedded host engine"

_names = itertools.count(1)


class DcgmUnavailable(Exception):
    """DCGM cannot be used right now; the message is the snapshot's one-line error."""


@dataclass
class _Bindings:
    pydcgm: Any
    structs: Any
    fields: Any
    agent: Any
    unavailable: frozenset[int]
    held: frozenset[int]


@dataclass
class _Connection:
    """One DCGM handle with the group and watches made on it."""

    handle: Any
    where: str  # "host engine 127.0.0.1:5555" | EMBEDDED
    uuids: dict[int, str] = field(default_factory=dict)  # DCGM gpu id -> GPU UUID
    reads: int = 0  # reads on this connection (DcgmSnapshot.settled)
    occupancy_read_at: float | None = None  # source clock: the next window's start
    group: Any = None
    field_group: Any = None
    profiling_error: str | None = None
    health_error: str | None = None


class DcgmSource(Source):
    """Reads DCGM profiling occupancy and health once per cycle; see the module docstring.

    Under ``auto`` a node without DCGM is normal: the source reports itself (up or
    down) only once DCGM has answered, or from the start when a host engine was named.
    """

    name: ClassVar[SourceName] = "dcgm"

    def __init__(
        self,
        mode: DcgmMode,
        *,
        bindings_path: str | None = None,
        library_path: str | None = None,
        update_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        backoff: Backoff | None = None,
        read_deadline_s: float = 1.0,
    ) -> None:
        if update_interval_s <= 0:
            raise ValueError(f"update_interval_s must be > 0, got {update_interval_s}")
        self._mode = mode
        # A cycle waits at most this long for DCGM: connecting (each absent host engine of
        # auto costs its connect timeout) and reading run on a worker thread, one at a
        # time; one still running leaves DCGM's part of this cycle unknown.
        self._read_deadline_s = read_deadline_s
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._in_flight: concurrent.futures.Future[DcgmSnapshot] | None = None
        self._last: DcgmSnapshot | None = None
        self._seen_up = False
        self._errors_total = 0
        self._bindings_path = bindings_path
        self._library_path = library_path
        self._update_interval_s = update_interval_s
        self._clock = clock
        self._backoff = backoff or Backoff(initial_s=1.0, max_s=60.0)
        self._retry_at = 0.0
        self._bindings: _Bindings | None = None
        self._conn: _Connection | None = None
        self._error: str | None = None
        self._ever_connected = False
        # GPUs that gave a profiling value: DCGM is their occupancy source, also in a cycle
        # whose values are blank or while the host engine is down; kept across reconnects
        # and narrowed to the GPUs of each new connection (so bounded by the node's GPUs).
        # Replaced, never changed in place: the cycle's thread reads it while a sample on
        # the worker thread may be adding to it.
        self._profiled: frozenset[str] = frozenset()
        self._lock = threading.Lock()  # DCGM connection set-up/tear-down is not thread safe
        # Set by close() without the lock, so a connect sequence in flight (each absent
        # host engine costs its connect timeout) stops after its current attempt.
        self._closing = threading.Event()

    # -- state ------------------------------------------------------------------------

    @property
    def mode(self) -> DcgmMode:
        return self._mode

    @property
    def enabled(self) -> bool:
        return self._mode.kind != "off"

    @property
    def available(self) -> bool:
        """Connected to DCGM now (the last open or sample succeeded)."""
        return self._conn is not None

    @property
    def connected_to(self) -> str | None:
        """Where the data comes from, for logs: a host engine address or the embedded one."""
        conn = self._conn
        return conn.where if conn is not None else None

    # -- lifecycle --------------------------------------------------------------------

    def open(self) -> bool:
        """Import the bindings and connect now, ignoring backoff; False on failure, never raises."""
        with self._lock:
            return self._open()

    def close(self) -> None:
        """Disconnect (or stop the embedded engine); waits at most for one connect
        attempt in flight, which then ends the sequence (shutdown must be prompt)."""
        self._closing.set()
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
        # A DCGM call that never returns holds the lock: shutdown does not wait on it.
        if self._lock.acquire(timeout=CLOSE_WAIT_S):
            try:
                self._disconnect()
            finally:
                self._lock.release()
        else:
            log.warning("DCGM busy after %.0f s at shutdown; not waiting for it", CLOSE_WAIT_S)

    def _open(self) -> bool:
        if self._conn is not None:
            return True
        if self._mode.kind == "off":
            self._error = "DCGM disabled (--dcgm off)"
            return False
        if self._closing.is_set():
            self._error = "DCGM source closed"
            return False
        try:
            bindings = self._bindings or self._import_bindings()
            self._bindings = bindings
            self._conn = self._connect(bindings)
        except DcgmUnavailable as exc:
            self._failed(str(exc))
            return False
        except Exception as exc:  # the bindings wrap C; never let them take the agent down
            self._failed(f"DCGM set-up failed: {_describe(exc)}")
            return False
        self._backoff.reset()
        self._error = None
        self._ever_connected = True
        self._profiled = self._profiled & frozenset(self._conn.uuids.values())
        log.info(
            "DCGM connected via %s: %d GPU(s)%s",
            self._conn.where,
            len(self._conn.uuids),
            "".join(f"; {e}" for e in (self._conn.profiling_error, self._conn.health_error) if e),
        )
        return True

    def _failed(self, error: str) -> None:
        """Log each distinct failure once; repeats go to debug. Under ``auto``, DCGM
        missing from a node is normal (GPM is used), so that is said at info level."""
        delay = self._backoff.next_delay()
        self._retry_at = self._clock() + delay
        repeated = error == self._error
        self._error = error
        never_connected = self._bindings is None or self._conn is None
        if repeated or self._closing.is_set():
            level = logging.DEBUG
        elif self.mode.kind == "auto" and never_connected and not self._ever_connected:
            level = logging.INFO
        else:
            level = logging.WARNING
        log.log(level, "DCGM unavailable (%s); retrying in %.0f s", error, delay)

    # -- one cycle --------------------------------------------------------------------

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.dcgm = self.read(cycle)

    def read(self, cycle: Cycle) -> DcgmSnapshot:
        snapshot = self._sample_within_deadline()
        self._last = snapshot
        self._seen_up = self._seen_up or snapshot.ok
        if not snapshot.ok and self._reported():
            self._errors_total += 1
        return snapshot

    def _reported(self) -> bool:
        return self._seen_up or self._mode.kind == "hostengine"

    def status(self) -> SourceStatus | None:
        last = self._last
        if last is None or not self._reported():
            return None
        return SourceStatus(self.name, last.ok, last.error)

    @property
    def errors_total(self) -> int:
        return self._errors_total

    def _sample_within_deadline(self) -> DcgmSnapshot:
        """``sample()`` on the worker thread; what it gives within the deadline, else a
        snapshot that says DCGM is still busy (its result is taken by the next cycle)."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcgm")
        if self._in_flight is None:
            self._in_flight = self._worker.submit(self.sample)
        try:
            snapshot = self._in_flight.result(timeout=self._read_deadline_s)
        except concurrent.futures.TimeoutError:
            busy = (
                f"DCGM busy: no answer within {self._read_deadline_s:g} s "
                f"(connecting or reading; {self._error or 'no error yet'})"
            )
            return self._down(time.time(), error=busy, settled=False)
        finally:
            if self._in_flight is not None and self._in_flight.done():
                self._in_flight = None
        return snapshot

    def sample(self) -> DcgmSnapshot:
        """One blocking read of every GPU's profiling fields and the health watches."""
        started = time.time()
        with self._lock:
            if self._conn is None and (self._clock() < self._retry_at or not self._open()):
                return self._down(started)
            conn = self._conn
            assert conn is not None and self._bindings is not None
            try:
                return self._read(self._bindings, conn, started)
            except Exception as exc:
                self._disconnect()
                self._failed(f"DCGM via {conn.where} failed: {_describe(exc)}")
                return self._down(started)

    def _down(
        self, started: float, *, error: str | None = None, settled: bool | None = None
    ) -> DcgmSnapshot:
        """DCGM not answering (``error``: why, else the last failure). Under ``auto``,
        never having reached it settles that the node has none; a named host engine that
        is down, or one that answered before, leaves the GPUs it has not profiled unknown
        (not "none"), as does a sample still running (``settled`` False)."""
        if settled is None:
            settled = self._mode.kind == "auto" and not self._ever_connected
        return DcgmSnapshot(
            ok=False,
            timestamp=started,
            error=error or self._error,
            profiled=tuple(sorted(self._profiled)),
            settled=settled,
        )

    def _read(self, b: _Bindings, conn: _Connection, started: float) -> DcgmSnapshot:
        conn.reads += 1
        notes = [e for e in (conn.profiling_error, conn.health_error) if e]
        occupancy: tuple[tuple[str, Occupancy], ...] = ()
        incidents: tuple[DcgmHealthIncident, ...] = ()
        health: str | None = None
        if conn.group is not None and conn.profiling_error is None:
            try:
                occupancy = self._occupancy(conn)
            except b.structs.DCGMError as exc:
                if exc.value not in b.unavailable:
                    raise
                notes.append(f"profiling fields unavailable: {_describe(exc)}")
        if conn.group is not None and conn.health_error is None:
            try:
                incidents, health = self._health(b, conn)
            except b.structs.DCGMError as exc:
                if exc.value not in b.unavailable:
                    raise
                notes.append(f"health checks unavailable: {_describe(exc)}")
        return DcgmSnapshot(
            ok=True,
            timestamp=started,
            error="; ".join(notes) or None,
            occupancy=occupancy,
            profiled=tuple(sorted(self._profiled)),
            settled=conn.reads >= SETTLE_READS or conn.profiling_error is not None,
            incidents=incidents,
            health=health,
        )

    def _occupancy(self, conn: _Connection) -> tuple[tuple[str, Occupancy], ...]:
        """Latest value per GPU and field; GPUs where every field is blank are left out.

        The window a value stands for is the time since this connection's previous read
        (the activity counters add ratio x window once per read): DCGM's latest value is
        its average over its own update period, so the counters are exact where the
        watch's update period equals the read period, and a sampled mean otherwise. The
        first read of a connection has no window (None: no counter from it)."""
        values = conn.group.samples.GetLatest(conn.field_group).values  # [gpuId][fieldId][i]
        now = self._clock()
        previous, conn.occupancy_read_at = conn.occupancy_read_at, now
        window = None if previous is None else now - previous
        found = []
        for gpu_id, uuid in sorted(conn.uuids.items()):
            per_field = values.get(gpu_id) or {}
            ratios = {
                name: _ratio(per_field.get(field_id)) for name, field_id in PROFILING_FIELDS.items()
            }
            if any(v is not None for v in ratios.values()):
                found.append(
                    (uuid, Occupancy(source="dcgm", window_end=now, window_s=window, **ratios))
                )
                self._profiled = self._profiled | {uuid}
        return tuple(found)

    def _health(
        self, b: _Bindings, conn: _Connection
    ) -> tuple[tuple[DcgmHealthIncident, ...], str]:
        response = conn.group.health.Check()
        incidents = []
        for i in range(int(response.incidentCount)):  # the array is fixed-size: honour count
            incident = response.incidents[i]
            entity = incident.entityInfo
            is_gpu = int(entity.entityGroupId) == int(b.fields.DCGM_FE_GPU)
            system = int(incident.system)
            incidents.append(
                DcgmHealthIncident(
                    gpu_uuid=conn.uuids.get(int(entity.entityId)) if is_gpu else None,
                    system=HEALTH_SYSTEMS.get(system, f"system_{system:#x}"),
                    health=HEALTH_RESULTS.get(int(incident.health), "unknown"),
                    message=one_line(_text(incident.error.msg)),
                )
            )
        return tuple(incidents), HEALTH_RESULTS.get(int(response.overallHealth), "unknown")

    # -- bindings and connection --------------------------------------------------------

    def _import_bindings(self) -> _Bindings:
        """Import the bindings by module name: they import each other as top-level modules."""
        if self._bindings_path is not None:
            path = os.path.abspath(self._bindings_path)
            if not os.path.isdir(path):
                raise DcgmUnavailable(f"DCGM bindings path {path} is not a directory")
            if path not in sys.path:
                sys.path.insert(0, path)
        else:
            # Appended, not prepended: the bindings directory holds generic names
            # (``common``) that must not shadow anything else.
            for path in DEFAULT_BINDINGS_DIRS:
                if os.path.isdir(path) and path not in sys.path:
                    sys.path.append(path)
        importlib.invalidate_caches()
        try:
            pydcgm = importlib.import_module("pydcgm")
            structs = importlib.import_module("dcgm_structs")
            fields = importlib.import_module("dcgm_fields")
            agent = importlib.import_module("dcgm_agent")
        except ImportError as exc:
            where = self._bindings_path or " or ".join(DEFAULT_BINDINGS_DIRS)
            raise DcgmUnavailable(
                f"DCGM Python bindings not found in {where} ({exc}); install DCGM and "
                "point --dcgm-bindings-path at the directory holding pydcgm.py"
            ) from exc

        if self._library_path is not None:
            self._load_library(structs, self._library_path)

        def statuses(names: tuple[str, ...]) -> frozenset[int]:
            return frozenset(int(getattr(structs, n)) for n in names if hasattr(structs, n))

        return _Bindings(
            pydcgm=pydcgm,
            structs=structs,
            fields=fields,
            agent=agent,
            unavailable=statuses(_UNAVAILABLE_STATUSES),
            held=statuses(_HELD_STATUSES),
        )

    @staticmethod
    def _load_library(structs: Any, path: str) -> None:
        """Load libdcgm from ``path`` before any handle does: the bindings' own loader
        (``dcgm_structs._LoadDcgmLibrary``) looks in /usr/lib/<arch>-linux-gnu and
        /usr/lib64 unless given a directory (DCGM 4 also tries $LD_LIBRARY_PATH, DCGM 3
        does not), and loads once, so every later ``_dcgmInit()`` uses this one."""
        path = os.path.abspath(path)
        if not os.path.isdir(path):
            raise DcgmUnavailable(f"--dcgm-library-path {path} is not a directory")
        try:
            structs._LoadDcgmLibrary(path)
        except structs.DCGMError as exc:
            raise DcgmUnavailable(
                f"libdcgm could not be loaded from {path} ({_describe(exc)}): it needs "
                "libdcgm.so.4 (DCGM 4) or libdcgm.so.3 (DCGM 3) there, matching the bindings"
            ) from exc

    def _connect(self, b: _Bindings) -> _Connection:
        handle, where = self._handle(b)
        conn = _Connection(handle=handle, where=where)
        try:
            self._watch(b, conn)
        except Exception as exc:
            self._teardown(conn)
            raise DcgmUnavailable(f"DCGM set-up via {where} failed: {_describe(exc)}") from exc
        return conn

    def _handle(self, b: _Bindings) -> tuple[Any, str]:
        """A DCGM handle: the mode's host engines in order, then (auto only) embedded."""
        op_mode = b.structs.DCGM_OPERATION_MODE_AUTO  # DCGM samples on its own schedule
        auto = self._mode.kind == "auto"
        failed: list[str] = []
        for address in self._mode.hostengines:
            if self._closing.is_set():
                raise DcgmUnavailable("closing: " + "; ".join(failed))
            try:
                handle = b.pydcgm.DcgmHandle(
                    ipAddress=address,
                    opMode=op_mode,
                    timeoutMs=AUTO_CONNECT_TIMEOUT_MS if auto else CONNECT_TIMEOUT_MS,
                )
                return handle, f"host engine {address}"
            except b.structs.DCGMError as exc:
                if exc.value == _status(b, "LIBRARY_NOT_FOUND"):
                    # Every other attempt, embedded included, would fail the same way.
                    raise DcgmUnavailable(f"libdcgm: {_describe(exc)}") from exc
                failed.append(f"host engine {address}: {_describe(exc)}")
                log.debug("DCGM: no host engine at %s (%s)", address, _describe(exc))
        if not auto or self._closing.is_set():
            raise DcgmUnavailable("; ".join(failed))
        try:
            handle = b.pydcgm.DcgmHandle(ipAddress=None, opMode=op_mode)
        except b.structs.DCGMError as exc:
            failed.append(f"embedded host engine: {_describe(exc)}")
            raise DcgmUnavailable("; ".join(failed)) from exc
        log.info(
            "DCGM: no host engine answered (tried %s); started an embedded host engine",
            ", ".join(self._mode.hostengines),
        )
        return handle, EMBEDDED

    def _watch(self, b: _Bindings, conn: _Connection) -> None:
        """Group all supported GPUs, watch the profiling fields, enable all health watches."""
        system = conn.handle.GetSystem()
        for gpu_id in system.discovery.GetAllSupportedGpuIds():
            attributes = system.discovery.GetGpuAttributes(gpu_id)
            conn.uuids[int(gpu_id)] = _text(attributes.identifiers.uuid)
        if not conn.uuids:
            return  # nothing to watch; an empty group would only produce errors
        # Our own group, not DCGM_GROUP_ALL_GPUS: health watches are per group, and a
        # shared host engine's default group belongs to its other clients.
        name = f"gpu-occupancy-exporter-{os.getpid()}-{next(_names)}"
        conn.group = b.pydcgm.DcgmGroup(
            conn.handle, groupName=name, groupType=b.structs.DCGM_GROUP_EMPTY
        )
        for gpu_id in conn.uuids:
            conn.group.AddGpu(gpu_id)
        if conn.where == EMBEDDED:
            self._warn_if_exclusive(b, conn)
        self._start_profiling(b, conn, name)
        try:
            conn.group.health.Set(b.structs.DCGM_HEALTH_WATCH_ALL)
        except b.structs.DCGMError as exc:
            if exc.value not in b.unavailable:
                raise
            conn.health_error = f"health checks unavailable: {_describe(exc)}"
        system.UpdateAllFields(1)  # first values now, not one update period later
        if conn.health_error is None:
            # dcgm_agent.h: the first dcgmHealthCheck only creates state and reports
            # nothing. (4.x sources evaluate a trailing minute instead; either way
            # this one spare call makes the first cycle's check a real one.)
            conn.group.health.Check()

    def _warn_if_exclusive(self, b: _Bindings, conn: _Connection) -> None:
        """Say so before an embedded engine takes pre-Hopper profiling counters.

        Ampere and older GPUs serve profiling through DCGM's profiling module, where
        metric groups compete for the same hardware and one client at a time holds them;
        Hopper and newer read GPM with no such limit (dcgm_agent.h,
        dcgmProfGetSupportedMetricGroups). Architecture comes from
        dcgmGetGpuChipArchitecture (DCGM 4.2.3+); where DCGM cannot tell, assume the limit.
        """
        hopper = int(getattr(b.structs, "DCGM_CHIP_ARCH_HOPPER", 9))
        exclusive = []
        for gpu_id, uuid in sorted(conn.uuids.items()):
            try:
                architecture = int(b.agent.dcgmGetGpuChipArchitecture(conn.handle.handle, gpu_id))
            except (AttributeError, b.structs.DCGMError):  # bindings or libdcgm before 4.2.3
                architecture = None
            if architecture is None or architecture < hopper:
                exclusive.append(uuid)
        if exclusive:
            log.warning(
                "DCGM: watching profiling fields through an embedded host engine on "
                "pre-Hopper (or unidentified) GPU(s) %s: there, one profiling client at a "
                "time holds the counters, so dcgm-exporter with its own embedded engine "
                "(the GPU Operator's default), Nsight or another DCGM on this node will "
                "fail or take them from this exporter. Let both use one host engine "
                "(GPU Operator: dcgm.enabled=true, found by --dcgm auto), or --dcgm off "
                "(docs/dcgm.md)",
                ", ".join(exclusive),
            )

    def _start_profiling(self, b: _Bindings, conn: _Connection, name: str) -> None:
        """All eight fields; on too many passes the core five; else note why there are none."""
        try:
            try:
                self._watch_profiling(b, conn, name, tuple(PROFILING_FIELDS.values()))
            except b.structs.DCGMError as exc:
                if exc.value != _status(b, "PROFILING_MULTI_PASS"):
                    raise
                log.info("DCGM: the FP64/FP32/FP16 pipe fields need too many passes here")
                self._watch_profiling(b, conn, f"{name}-core", PROFILING_FALLBACK_FIELDS)
        except b.structs.DCGMError as exc:
            if exc.value not in b.unavailable:
                raise
            hint = f" ({HELD_HINT})" if exc.value in b.held else ""
            conn.profiling_error = f"profiling fields unavailable: {_describe(exc)}{hint}"

    def _watch_profiling(
        self, b: _Bindings, conn: _Connection, name: str, field_ids: tuple[int, ...]
    ) -> None:
        if conn.field_group is not None:  # the set that did not fit
            conn.field_group.Delete()
            conn.field_group = None
        conn.field_group = b.pydcgm.DcgmFieldGroup(conn.handle, name=name, fieldIds=list(field_ids))
        conn.group.samples.WatchFields(
            conn.field_group,
            int(self._update_interval_s * 1_000_000),  # usec
            max(30.0, 10 * self._update_interval_s),  # max keep age, s
            0,  # no sample-count limit: the age bounds it
        )

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._teardown(conn)

    @staticmethod
    def _teardown(conn: _Connection) -> None:
        """Best effort: after a lost connection every call fails, and that is fine."""
        for release in (
            getattr(conn.field_group, "Delete", None),
            getattr(conn.group, "Delete", None),
            getattr(conn.handle, "Shutdown", None),
        ):
            if release is None:
                continue
            try:
                release()
            except Exception as exc:
                log.debug("DCGM teardown: %s", _describe(exc))


def _status(b: _Bindings, name: str) -> int | None:
    value = getattr(b.structs, f"DCGM_ST_{name}", None)
    return int(value) if value is not None else None


def _ratio(series: Any) -> float | None:
    """The latest value of one field as a ratio, or None when blank or missing."""
    if series is None or len(series) == 0:
        return None
    latest = series[-1]
    value = getattr(latest, "value", None)
    if getattr(latest, "isBlank", False) or value is None:
        return None
    ratio = float(value)
    if not math.isfinite(ratio) or ratio >= FP64_BLANK:
        return None
    return min(max(ratio, 0.0), 1.0)


def _text(value: Any) -> str:
    """The bindings decode ``c_char`` fields to ``str``; older ones may give ``bytes``."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _describe(exc: BaseException) -> str:
    """``DCGMError_ConnectionNotValid: The connection ...``: class and message, one line."""
    message = one_line(str(exc))
    name = type(exc).__name__
    return f"{name}: {message}" if message else name
