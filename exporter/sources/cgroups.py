"""CPU throttling and pressure stall counters of the containers that hold or use a GPU.

The most common reason an allocated GPU sits idle in a busy pod is a data loader starved
of CPU: the container ran out of its CFS quota, or waited on I/O. The kernel keeps both
facts in the container's cgroup (docs/why-idle.md):

- ``cpu.stat``: ``nr_periods`` (enforcement periods with runnable tasks), ``nr_throttled``
  (periods the quota ran out) and ``throttled_usec`` (time throttled); cgroup v1's
  ``cpu.stat`` spells the last ``throttled_time``, in nanoseconds (kernel
  Documentation/admin-guide/cgroup-v2.rst "cpu.stat";
  Documentation/scheduler/sched-bwc.rst "Statistics");
- ``cpu.pressure``, ``io.pressure``, ``memory.pressure`` (cgroup v2 only): a ``some`` and a
  ``full`` line each, whose ``total=`` is the cumulative stall time in microseconds
  (Documentation/accounting/psi.rst, "Pressure interface"; "Cgroup2 interface").

Only GPU containers are read, so the cost is bounded by them, not by the node's pods:
every container a GPU process runs in (its cgroup path as ``/proc/<pid>/cgroup`` named
it, from procfs), and every container PodResources lists with a GPU, found through the
pod watch (pod UID, container id) by a bounded search of the names the kubelet gives
cgroups (:func:`candidate_dirs`). At most ``MAX_CONTAINERS`` found a cycle (and at most
``MAX_LOOKUPS`` looked for), each file read to at most ``READ_LIMIT`` bytes; over the cap
the window of containers read turns each cycle, so none is starved for good.

Nothing from the tree may stall the cycle or break it: a file is opened non-blocking and
read only when it is a regular file (a FIFO or device in its place is no reading), a
path longer than the kernel's limits is not looked up, a counter that is not 1 to 20
ASCII digits under 2^64 (what the kernel prints for a u64) is no reading, and a
directory the exporter may not search costs that container its reading (or, at the
root, puts the source down with the reason), never the cycle.

Absence is never zero. A file that is missing or that the kernel refuses
(``EOPNOTSUPP``: PSI compiled in but off, ``psi=0``) leaves its fields None and is logged
once per distinct cause; a container whose cgroup cannot be found is left out (no
reading: unknown); a root that holds no cgroup hierarchy at all puts the source down with
the reason, which is another thing than "this container has no such file".

Reads are blocking and run in the agent's worker thread with the other sampled sources.
The registry orders this source after procfs, PodResources and the pod watch, whose
readings it takes from ``Cycle.readings``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum, auto
from pathlib import Path
from typing import ClassVar, Final

from exporter.model import (
    CgroupSnapshot,
    CgroupStats,
    PodMetaSnapshot,
    PodResourcesSnapshot,
    Pressure,
    ProcessIdentity,
    SourceName,
    SourceStatus,
)
from exporter.sources.base import Cycle, Source
from exporter.sources.procfs import KERNEL_FILE_FLAGS

log = logging.getLogger(__name__)

DEFAULT_CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
# Containers read per cycle at most: far above any node's GPU containers (a node with 8
# GPUs split 7 ways by MIG and 4 by time-slicing has 224), so only a fault reaches it.
MAX_CONTAINERS: Final = 1024
# Containers looked for per cycle at most, found or not: keys whose cgroups are gone
# must not take the slots of those that exist, nor make the cycle's lookups unbounded.
MAX_LOOKUPS: Final = 2 * MAX_CONTAINERS
# Linux's PATH_MAX and NAME_MAX (include/uapi/linux/limits.h): a longer hint is no path
# the kernel could have written, and looking it up fails with ENAMETOOLONG.
PATH_MAX: Final = 4096
NAME_MAX: Final = 255
READ_LIMIT: Final = 64 * 1024  # a real cpu.stat is under 300 bytes; bound a corrupt one
# Where cgroup v1 mounts the hierarchy holding the cpu controller: a co-mount with
# cpuacct on systemd hosts (``cpu`` is a symlink to it there), ``cpu`` alone elsewhere.
V1_CPU_DIRS: Final = ("cpu,cpuacct", "cpu")
PRESSURE_FILES: Final = ("cpu.pressure", "io.pressure", "memory.pressure")
QOS_CLASSES: Final = ("burstable", "besteffort")  # guaranteed pods sit right in kubepods
# Runtime prefixes of a container's cgroup: systemd scopes (``<prefix>-<id>.scope``) and
# the cgroupfs driver's leaves (the bare id, or CRI-O's ``crio-<id>``).
SCOPE_PREFIXES: Final = ("cri-containerd", "crio", "docker")

# The kernel prints these counters as u64 in decimal ("%llu"): 1 to 20 ASCII digits.
# Anything else (a Unicode digit, hundreds of digits) is no reading, never a number
# that breaks the analysis (a float overflow) or int() (its 4,300-digit limit).
_COUNTER: Final = re.compile(r"[0-9]{1,20}", re.ASCII)
_PSI_TOTAL: Final = re.compile(r"(?<![^ ])total=([0-9]+)(?![^ ])", re.ASCII)
_HEX64: Final = re.compile(r"[0-9a-f]{64}")

Key = tuple[str, str]  # (pod UID, bare container id)


class _Absent(Enum):
    """Why a file gave no text: not there, or the kernel does not support it."""

    MISSING = auto()
    UNSUPPORTED = auto()
    NOT_REGULAR = auto()  # a FIFO, device, directory or symlink where a file should be


@dataclass(frozen=True, slots=True)
class Layout:
    """The cgroup hierarchy under the root: its version and the directory under which
    container paths are looked up (the root on v2, the cpu hierarchy on v1)."""

    version: int
    base: Path


def parse_cpu_stat(text: str, version: int) -> tuple[int | None, int | None, int | None]:
    """``(nr_periods, nr_throttled, throttled_usec)`` from ``cpu.stat``; a line that is
    absent or not ``<key> <non-negative integer>`` gives None for its field. v1 counts
    throttled time in nanoseconds (``throttled_time``), v2 in microseconds."""
    values: dict[str, int] = {}
    for line in _lines(text):
        parts = line.split()
        if len(parts) == 2 and parts[0] not in values:
            value = counter(parts[1])
            if value is not None:
                values[parts[0]] = value
    throttled = values.get("throttled_usec")
    if version == 1 or throttled is None:
        nanoseconds = values.get("throttled_time")
        throttled = nanoseconds // 1000 if nanoseconds is not None else None
    return values.get("nr_periods"), values.get("nr_throttled"), throttled


def parse_pressure(text: str) -> Pressure | None:
    """The ``some`` and ``full`` lines' ``total=`` (µs); None when neither is there.
    An old kernel's ``cpu.pressure`` has no ``full`` line (added in 5.13): None there.
    A total that is no u64 (:func:`counter`) leaves its line's field None."""
    totals: dict[str, int | None] = {}
    for line in _lines(text):
        kind, _, rest = line.partition(" ")
        match = _PSI_TOTAL.search(rest)
        if kind in ("some", "full") and match and kind not in totals:
            totals[kind] = counter(match.group(1))
    if not totals:
        return None
    return Pressure(some_us=totals.get("some"), full_us=totals.get("full"))


def counter(text: str) -> int | None:
    """A cumulative counter as the kernel prints a u64, else None (module doc)."""
    if _COUNTER.fullmatch(text) is None:
        return None
    value = int(text)
    return value if value < 1 << 64 else None


def _lines(text: str) -> Iterator[str]:
    """Complete lines only: a file cut at ``READ_LIMIT`` may end mid-line."""
    body = text if text.endswith("\n") or len(text) < READ_LIMIT else text[: text.rfind("\n")]
    for line in body.splitlines():
        stripped = line.strip()
        if stripped:
            yield stripped


def find_layout(root: Path) -> Layout | str:
    """The hierarchy under ``root``, or why there is none to read (one line)."""
    try:
        return _find_layout(root)
    except OSError as exc:  # EACCES: a root the exporter's user may not search
        return (
            f"cgroup root {root} cannot be read ({os.strerror(exc.errno or 0)}): give the "
            "exporter read access to the host's /sys/fs/cgroup mounted there, or set "
            "--cgroup-root off"
        )


def _find_layout(root: Path) -> Layout | str:
    if not root.is_dir():
        return (
            f"cgroup root {root} is not a readable directory: mount the host's "
            "/sys/fs/cgroup read-only there, or set --cgroup-root off"
        )
    if (root / "cgroup.controllers").is_file():
        return Layout(2, root)
    for name in V1_CPU_DIRS:
        if (root / name).is_dir():
            return Layout(1, root / name)
    return (
        f"cgroup root {root} holds neither a cgroup v2 hierarchy (no cgroup.controllers) "
        "nor a v1 cpu hierarchy (no cpu,cpuacct or cpu directory): point --cgroup-root "
        "at the host's /sys/fs/cgroup, or set it off"
    )


def candidate_dirs(pod_uid: str, container_id: str) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Where the kubelet and the runtime put a container's cgroup, relative to the
    hierarchy: each pod directory with the container leaves to look for in it.

    systemd driver: ``kubepods.slice/[kubepods-<qos>.slice/]kubepods[-<qos>]-pod<uid with
    _>.slice/<prefix>-<id>.scope``; cgroupfs driver: ``kubepods/[<qos>/]pod<uid>/<id>``
    (CRI-O: ``crio-<id>``). The kubelet's pod cgroup names: pkg/kubelet/cm
    (cgroup_manager_linux.go, ``ConvertCgroupNameToSystemd``; qos_container_manager).
    """
    escaped = pod_uid.replace("-", "_")
    scopes = tuple(f"{prefix}-{container_id}.scope" for prefix in SCOPE_PREFIXES)
    yield f"kubepods.slice/kubepods-pod{escaped}.slice", scopes
    for qos in QOS_CLASSES:
        yield f"kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{escaped}.slice", scopes
    leaves = (container_id, f"crio-{container_id}")
    yield f"kubepods/pod{pod_uid}", leaves
    for qos in QOS_CLASSES:
        yield f"kubepods/{qos}/pod{pod_uid}", leaves


def search(layout: Layout, pod_uid: str, container_id: str) -> Path | None:
    """The container's cgroup directory found by :func:`candidate_dirs` (at most 6 pod
    directories and 5 leaves looked at), or None. A candidate that cannot be looked at
    (EACCES) does not stop the others; when none is found, its error is raised: the
    container is unknown for that reason, not "not there"."""
    error: OSError | None = None
    for pod_dir, leaves in candidate_dirs(pod_uid, container_id):
        pod = layout.base / pod_dir
        try:
            if not pod.is_dir():
                continue
            for leaf in leaves:
                if (pod / leaf).is_dir():
                    return pod / leaf
        except OSError as exc:
            error = error or exc
    if error is not None:
        raise error
    return None


def from_hint(layout: Layout, path: str, version: int, container_id: str) -> Path | None:
    """The container's directory as ``/proc/<pid>/cgroup`` named it, when it is usable
    here: of this hierarchy's version, free of ``..`` (a path seen through another
    cgroup namespace) and of containerd's ``slice:prefix:id`` notation, within the
    kernel's path limits (a longer one fails with ENAMETOOLONG), and present. A process
    in a sub-cgroup of its container (a nested leaf) names the leaf: the path is cut at
    the container's own segment, where the CPU quota and so the throttling are (no such
    segment: None, the search decides). An ``OSError`` (EACCES) is raised."""
    if version != layout.version or ":" in path:
        return None
    parts = [part for part in path.split("/") if part]
    if ".." in parts or "." in parts:
        return None
    prefixes = "|".join(SCOPE_PREFIXES)
    own = re.compile(rf"(?:(?:{prefixes})-)?{re.escape(container_id)}(?:\.scope)?", re.I)
    cut = next((i for i, part in enumerate(parts) if own.fullmatch(part)), None)
    if cut is None:
        return None
    parts = parts[: cut + 1]
    if sum(len(part) + 1 for part in parts) > PATH_MAX or max(map(len, parts)) > NAME_MAX:
        return None
    found = layout.base.joinpath(*parts)
    return found if found.is_dir() else None


def _read(path: Path) -> str | _Absent | OSError:
    """A cgroup file's text, read to ``READ_LIMIT``. Opened non-blocking and without
    following a symlink, and read only when it is a regular file (cgroupfs files are):
    a FIFO in its place would block the cycle for good, a device would read forever."""
    try:
        fd = os.open(path, KERNEL_FILE_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return _Absent.MISSING
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            return _Absent.UNSUPPORTED
        if exc.errno == errno.ELOOP:  # a symlink (O_NOFOLLOW)
            return _Absent.NOT_REGULAR
        return exc
    try:
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return _Absent.NOT_REGULAR
            data = handle.read(READ_LIMIT)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            return _Absent.UNSUPPORTED
        return exc
    return data.decode("utf-8", errors="replace")


def _is_dir(path: Path) -> bool:
    """``Path.is_dir`` that answers False where it would raise (EACCES)."""
    try:
        return path.is_dir()
    except OSError:
        return False


class CgroupReader(Source):
    """The cgroups source: one ``CgroupStats`` per GPU container a cycle."""

    name: ClassVar[SourceName] = "cgroups"

    def __init__(self, root: Path, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self._clock = clock
        self._found: dict[Key, Path] = {}  # last cycle's containers' directories
        self._logged: set[str] = set()  # causes logged once (a bounded set: file x kind)
        self._error: str | None = None  # why the root cannot be read, while it cannot
        self._errors_total = 0
        self._resume: Key | None = None  # over the cap: the first key of the next window

    @property
    def errors_total(self) -> int:
        """Cycles the root could not be read, files unreadable for another reason than
        absence, containers whose cgroup could not be looked for (EACCES), and
        containers left unread over ``MAX_CONTAINERS`` or ``MAX_LOOKUPS``."""
        return self._errors_total

    def status(self) -> SourceStatus:
        return SourceStatus(self.name, self._error is None, self._error)

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.cgroups = self.read(cycle)

    def read(self, cycle: Cycle) -> CgroupSnapshot:
        layout = find_layout(self.root)
        if isinstance(layout, str):
            if layout != self._error:
                log.warning("%s; CPU starvation of GPU containers is unknown until it is", layout)
            self._error = layout
            self._errors_total += 1
            self._found = {}
            return CgroupSnapshot(ok=False, timestamp=self._clock(), error=layout)
        if self._error is not None:
            log.info("cgroup root %s is readable again (cgroup v%d)", self.root, layout.version)
            self._error = None
        wanted = gpu_containers(
            cycle.readings.processes, cycle.readings.pod_resources, cycle.readings.pod_meta
        )
        found: dict[Key, Path] = {}
        stats: list[CgroupStats] = []
        order = self._rotated(sorted(wanted))
        for looked, key in enumerate(order):
            if len(found) == MAX_CONTAINERS or looked == MAX_LOOKUPS:
                self._over_cap(key, len(order), len(order) - looked)
                break
            directory = self._locate_logged(layout, key, wanted[key])
            if directory is not None:
                found[key] = directory
                stats.append(self._stats(layout, key, directory))
        else:
            self._resume = None
        self._found = found
        stats.sort(key=lambda row: (row.pod_uid, row.container_id))
        return CgroupSnapshot(ok=True, timestamp=self._clock(), containers=tuple(stats))

    def _rotated(self, keys: list[Key]) -> list[Key]:
        """The keys from where the last capped cycle stopped, wrapping around: over the
        cap each cycle reads the next window, so no container is starved for good."""
        if self._resume is None:
            return keys
        start = next((i for i, key in enumerate(keys) if key >= self._resume), 0)
        return keys[start:] + keys[:start]

    def _over_cap(self, resume: Key, wanted: int, left: int) -> None:
        self._resume = resume
        self._errors_total += left
        self._once(
            "cap",
            "%d GPU containers this cycle, over the %d found (or %d looked for) a cycle: "
            "%d have no cgroup counters this cycle; the next cycle starts with them",
            wanted,
            MAX_CONTAINERS,
            MAX_LOOKUPS,
            left,
        )

    def _locate_logged(self, layout: Layout, key: Key, hint: tuple[str, int] | None) -> Path | None:
        """:meth:`_locate`, its failures logged once per cause: not found, or not
        searchable (counted: that container's reading is unknown, the others' are not)."""
        try:
            directory = self._locate(layout, key, hint)
        except OSError as exc:
            self._errors_total += 1
            self._once(
                f"search-{errno.errorcode.get(exc.errno or 0, 'error')}",
                "cannot look for the cgroup of GPU container %s of pod %s under %s: %s; its "
                "series are absent (give the exporter read access to the cgroup tree)",
                key[1],
                key[0],
                layout.base,
                os.strerror(exc.errno or 0),
            )
            return None
        if directory is None:
            self._once("not-found", "no cgroup found for GPU container %s of pod %s", *key[::-1])
        return directory

    def _locate(self, layout: Layout, key: Key, hint: tuple[str, int] | None) -> Path | None:
        """The container's directory: last cycle's, the one its process named, or the
        search's. An ``OSError`` of the hint is raised only when the search finds
        nothing either."""
        known = self._found.get(key)
        if known is not None and _is_dir(known):
            return known
        error: OSError | None = None
        if hint is not None:
            try:
                found = from_hint(layout, hint[0], hint[1], key[1])
            except OSError as exc:
                error, found = exc, None
            if found is not None:
                return found
        found = search(layout, *key)
        if found is None and error is not None:
            raise error
        return found

    def _stats(self, layout: Layout, key: Key, directory: Path) -> CgroupStats:
        periods = throttled = throttled_usec = None
        text = self._file(directory, "cpu.stat")
        if text is not None:
            periods, throttled, throttled_usec = parse_cpu_stat(text, layout.version)
            if periods is None or throttled is None:
                self._once(
                    "cpu.stat-lines",
                    "%s/cpu.stat has no nr_periods/nr_throttled line with a counter (1 to "
                    "20 ASCII digits, under 2^64); those series are absent",
                    directory,
                )
        pressures: list[Pressure | None] = [None, None, None]
        if layout.version == 2:
            for i, name in enumerate(PRESSURE_FILES):
                text = self._file(directory, name)
                pressure = parse_pressure(text) if text is not None else None
                pressures[i] = pressure
                if text is not None and (pressure is None or pressure.some_us is None):
                    self._once(
                        f"{name}-lines",
                        "%s/%s has no 'some' line with a total (1 to 20 ASCII digits, under "
                        "2^64); its series are absent",
                        directory,
                        name,
                    )
        return CgroupStats(
            pod_uid=key[0],
            container_id=key[1],
            cgroup_version=layout.version,
            nr_periods=periods,
            nr_throttled=throttled,
            throttled_usec=throttled_usec,
            cpu_pressure=pressures[0],
            io_pressure=pressures[1],
            memory_pressure=pressures[2],
        )

    def _file(self, directory: Path, name: str) -> str | None:
        """A file's text, or None with its cause logged once (never a zero)."""
        text = _read(directory / name)
        if isinstance(text, str):
            return text
        if text is _Absent.MISSING:
            if _is_dir(directory):  # else the container just went: nothing to say
                why = (
                    "the kernel has no PSI (CONFIG_PSI) or it is off (psi=0)"
                    if name in PRESSURE_FILES
                    else "no cpu controller enabled for this cgroup"
                )
                self._once(
                    f"{name}-missing",
                    "%s has no %s (%s); its series are absent",
                    directory,
                    name,
                    why,
                )
        elif text is _Absent.NOT_REGULAR:
            self._errors_total += 1
            self._once(
                f"{name}-not-regular",
                "%s/%s is not a regular file (a FIFO, device or link: not a cgroup file); "
                "its series are absent",
                directory,
                name,
            )
        elif text is _Absent.UNSUPPORTED:
            self._once(
                f"{name}-unsupported",
                "%s/%s: not supported by this kernel (PSI off: boot with psi=1); its series "
                "are absent",
                directory,
                name,
            )
        else:
            self._errors_total += 1
            code = errno.errorcode.get(text.errno or 0, "error")
            self._once(
                f"{name}-{code}",
                "cannot read %s/%s: %s; its series are absent",
                directory,
                name,
                os.strerror(text.errno or 0),
            )
        return None

    def _once(self, cause: str, message: str, *args: object) -> None:
        """Log ``message`` the first time ``cause`` happens (the set of causes is small:
        a few per file name); later times at debug level."""
        if cause in self._logged:
            log.debug(message, *args)
            return
        self._logged.add(cause)
        log.warning(message, *args)


def gpu_containers(
    processes: tuple[ProcessIdentity, ...],
    pod_resources: PodResourcesSnapshot | None,
    pod_meta: PodMetaSnapshot | None,
) -> dict[Key, tuple[str, int] | None]:
    """Every container that uses or holds a GPU, with the cgroup path its processes named
    (None: found by search): GPU processes' containers, then containers PodResources
    lists with a GPU device or claim, named by the pod watch (UID, container id)."""
    wanted: dict[Key, tuple[str, int] | None] = {}
    for identity in processes:
        if not identity.alive or identity.pod_uid is None or identity.container_id is None:
            continue
        key = (identity.pod_uid, identity.container_id)
        if identity.cgroup_path is not None and identity.cgroup_version is not None:
            wanted[key] = (identity.cgroup_path, identity.cgroup_version)
        else:
            wanted.setdefault(key, None)
    if pod_resources is None or not pod_resources.ok or pod_meta is None:
        return wanted
    pods = {(pod.namespace, pod.name): pod for pod in pod_meta.pods}
    holders = {(c.namespace, c.pod, c.container) for c in pod_resources.containers if c.device_ids}
    holders |= {(c.namespace, c.pod, c.container) for c in pod_resources.claims}
    for namespace, pod_name, container in sorted(holders):
        pod = pods.get((namespace, pod_name))
        if pod is None:
            continue
        for container_id, name in pod.containers:
            if name == container and _HEX64.fullmatch(container_id):
                wanted.setdefault((pod.uid, container_id), None)
    return wanted
