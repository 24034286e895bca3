"""Map host pids to pod UID and container ID from ``<proc-root>/<pid>/cgroup``.

The cgroup path is the only place the kernel records which container a process runs
in, and its spelling depends on the cgroup version (v1 lines per controller, one v2
``0::`` line), the kubelet cgroup driver (systemd slices with ``_`` in the UID, or
cgroupfs directories), the container runtime (``cri-containerd-``, ``crio-``,
``docker-`` prefixes) and on nesting (kind, cgroup namespaces). The parser accepts
all of them but only attributes a pod when the path really looks like kubepods, so a
garbled line can leave a process unattributed but never hand it to the wrong pod.

Reads are blocking. :class:`ProcessReader` is the procfs source: the agent calls its
``read`` with the cycle's other source reads in a worker thread. :func:`read_process`
reads one pid uncached (the holder scan uses it).

One pid's unreadable file leaves that pid's fields unknown. /proc failing wholesale (the
exporter out of file descriptors: every open is EMFILE) is another matter: when more than
half of the live pids of a cycle had no readable file, the source is down with a reason,
and the cycle reads no identities, so every GPU process's owner is unknown (never dead,
never an orphan) until /proc answers again.

"No ``<proc-root>/<pid>``" means the process exited only where the tree is a live /proc
of the pid namespace NVML's pids live in: the host's, since the driver knows processes by
their pid in the initial pid namespace (https://github.com/matpool/mpu, README.md). So
each cycle first checks two things only that /proc shows (:func:`host_view_problem`):
pid 1 is there (an empty directory, a lost hostPath mount, has none), and pid 2 is
``kthreadd``, the kernel's thread spawner, which the kernel starts second at boot
(``rest_init`` in init/main.c: ``kernel_init`` is pid 1, ``kthreadd`` pid 2) and which,
like every kernel thread, only the initial pid namespace sees (a pod's own /proc, or one
mounted with ``hidepid``, has no such pid 2). Where either check fails the source is
down with the reason, and no pid is read at all: owners unknown, never dead.

A cgroup file read whole but in no form the kernel writes (every line
``<hierarchy-id>:<controllers>:<path>``, the path absolute) is no evidence of where the
process runs: it is not a host process, its owner is unknown, and it is counted like an
unreadable one (``ProcessIdentity.cgroup_parsed``).
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum, auto
from pathlib import Path
from typing import ClassVar, Final

from exporter.model import ProcessIdentity, SourceName, SourceStatus
from exporter.sources.base import Cycle, Source

# A cgroup line: hierarchy id, controller list, path. The path may itself contain
# colons (containerd's ``slice:prefix:id`` notation), hence maxsplit=2 below.
_HIERARCHY_ID: Final = re.compile(r"[0-9]+")

_HEX = "[0-9a-fA-F]"
# Pod UIDs: an RFC 4122 UUID, or 32 hex digits for static pods (the config hash).
_UID_DASHED = rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
_UID_UNDERSCORED = rf"{_HEX}{{8}}_{_HEX}{{4}}_{_HEX}{{4}}_{_HEX}{{4}}_{_HEX}{{12}}"
_UID_STATIC = rf"{_HEX}{{32}}"

# systemd driver: ``[<root>-]kubepods[-<qos>]-pod<uid>.slice``; systemd reserves "-"
# for nesting, so the kubelet writes the UID's dashes as underscores.
_SYSTEMD_POD: Final = re.compile(
    rf"(?:[\w.]+-)*kubepods(?:-burstable|-besteffort)?"
    rf"-pod(?P<uid>{_UID_UNDERSCORED}|{_UID_STATIC})\.slice"
)
# cgroupfs driver: a plain ``pod<uid>`` directory below ``kubepods[/<qos>]``.
_CGROUPFS_POD: Final = re.compile(rf"pod(?P<uid>{_UID_DASHED}|{_UID_STATIC})")
_QOS_DIRS: Final = frozenset({"burstable", "besteffort"})

# The container's cgroup, directly below the pod's. systemd scopes carry the runtime
# prefix; cgroupfs uses the bare id (containerd, docker) or ``crio-<id>``. CRI-O's
# ``crio-conmon-<id>`` monitor is deliberately not matched: it is not the container.
_CONTAINER: Final = re.compile(
    rf"(?:(?:cri-containerd|crio|docker)-)?(?P<id>{_HEX}{{64}})(?:\.scope)?"
)
# Without a pod segment only a runtime-prefixed scope is trusted as a container.
_PREFIXED_CONTAINER: Final = re.compile(
    rf"(?:cri-containerd|crio|docker)-(?P<id>{_HEX}{{64}})\.scope"
)
# containerd's systemd cgroupsPath notation ``<parent>.slice:<prefix>:<id>``.
_SLICE_NOTATION: Final = re.compile(
    rf"(?P<slice>[^:]+\.slice):(?P<prefix>cri-containerd|crio|docker):(?P<id>{_HEX}{{64}})"
)
# cgroup v2 marks a removed cgroup this way (e.g. for an exiting process).
_DELETED_SUFFIX: Final = " (deleted)"

_READ_LIMIT: Final = 64 * 1024  # real files are tiny; bound a corrupt fake one
# /proc fails wholesale when more than this share of a cycle's live pids has no readable
# file: a few unreadable pids are those pids' problem, most of them is the reader's.
WHOLESALE_SHARE: Final = 0.5

# The advice every "not the host's /proc" reason ends with (docs/install.md, hostPID).
_HOST_VIEW_FIX: Final = "mount the host's /proc and run with hostPID"
_KTHREADD: Final = "kthreadd"

# Why it failed, in the source's status and its log line: the numbers are arguments, so
# the log's flood control (exporter/logs.py) counts a changing figure as one fault.
_FAILURE: Final = "%s: %d of %d reads failed, %d of %d pids unreadable (%s)"

log = logging.getLogger(__name__)

Attribution = tuple[str | None, str | None]
_NOTHING: Final[Attribution] = (None, None)


def parse_cgroup(text: str) -> Attribution:
    """Return ``(pod_uid, container_id)`` from a ``/proc/<pid>/cgroup`` file.

    The v2 line (``0::``) wins when it names a pod or container, because in hybrid
    mode it is what the kubelet and runtime manage; otherwise the first v1 line that
    names a pod (one with a container id preferred). A pod without a recognisable
    container (pod-level cgroup, CRI-O's conmon) gives ``(uid, None)``; a container
    seen only through a private cgroup namespace (``0::/../cri-containerd-<id>.scope``)
    gives ``(None, id)``; host processes and garbage give ``(None, None)``.
    """
    best: Attribution = _NOTHING
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or not _HIERARCHY_ID.fullmatch(parts[0]):
            continue
        found = _parse_path(parts[2])
        if found == _NOTHING:
            continue
        if parts[0] == "0" and parts[1] == "":
            return found
        if _rank(found) > _rank(best):
            best = found
    return best


Location = tuple[str, int]  # (cgroup path as the file names it, cgroup version)


def cgroup_location(text: str) -> Location | None:
    """The cgroup whose counters belong to the container ``text`` attributes the process
    to: the v2 ``0::`` path when that line names the pod or container (as
    :func:`parse_cgroup` prefers it), else the path of the v1 line holding the ``cpu``
    controller when it does (``cpu.stat`` lives in that hierarchy); None otherwise (a
    host process, a file that names no pod). A ``(deleted)`` suffix is dropped."""
    v1: Location | None = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or not _HIERARCHY_ID.fullmatch(parts[0]):
            continue
        path = parts[2].removesuffix(_DELETED_SUFFIX)
        if _parse_path(path) == _NOTHING:
            continue
        if parts[0] == "0" and parts[1] == "":
            return path, 2
        if v1 is None and "cpu" in parts[1].split(","):
            v1 = path, 1
    return v1


def cgroup_well_formed(text: str) -> bool:
    """Whether ``text`` is in the form the kernel writes ``/proc/<pid>/cgroup`` in: at
    least one line, each ``<hierarchy-id>:<controllers>:<absolute path>``
    (cgroups(7), "/proc/[pid]/cgroup"). Only such a file that names no pod is evidence
    of a host process; a file of junk (a corrupt or foreign tree) names nobody."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return bool(lines) and all(_well_formed_line(line) for line in lines)


def _well_formed_line(line: str) -> bool:
    parts = line.split(":", 2)
    return (
        len(parts) == 3
        and _HIERARCHY_ID.fullmatch(parts[0]) is not None
        and parts[2].startswith("/")
    )


def _rank(found: Attribution) -> tuple[bool, bool]:
    return (found[0] is not None, found[1] is not None)


def _parse_path(path: str) -> Attribution:
    """Attribute one cgroup path; see :func:`parse_cgroup` for the rules."""
    if path.endswith(_DELETED_SUFFIX):
        path = path[: -len(_DELETED_SUFFIX)]
    if not path.startswith("/"):
        return _NOTHING
    segments = _split_segments(path)
    for index, segment in enumerate(segments):
        uid = _pod_uid(segment, segments[:index])
        if uid is None:
            continue
        child = segments[index + 1] if index + 1 < len(segments) else ""
        container = _CONTAINER.fullmatch(child)
        return uid, container["id"].lower() if container else None
    # Private cgroup namespace: a sibling container of the reader shows up as
    # ``/../<scope>``, with the pod above the namespace root and so invisible.
    if len(segments) >= 2 and all(s == ".." for s in segments[:-1]):
        container = _PREFIXED_CONTAINER.fullmatch(segments[-1])
        if container:
            return None, container["id"].lower()
    return _NOTHING


def _split_segments(path: str) -> list[str]:
    """Split a path, expanding ``parent.slice:prefix:id`` into its two levels."""
    segments: list[str] = []
    for segment in path.split("/"):
        if not segment:
            continue
        notation = _SLICE_NOTATION.fullmatch(segment)
        if notation:
            segments.append(notation["slice"])
            segments.append(f"{notation['prefix']}-{notation['id']}.scope")
        else:
            segments.append(segment)
    return segments


def _pod_uid(segment: str, ancestors: list[str]) -> str | None:
    """The normalised pod UID if ``segment`` is a pod's cgroup, else None."""
    systemd = _SYSTEMD_POD.fullmatch(segment)
    if systemd:
        return systemd["uid"].replace("_", "-").lower()
    cgroupfs = _CGROUPFS_POD.fullmatch(segment)
    if cgroupfs and _under_kubepods(ancestors):
        return cgroupfs["uid"].lower()
    return None


def _under_kubepods(ancestors: list[str]) -> bool:
    """A bare ``pod<uid>`` directory counts only as ``kubepods[/<qos>]/pod<uid>``.

    ``..`` stands in for a parent hidden by a cgroup namespace.
    """
    parents = ancestors[:-1] if ancestors and ancestors[-1] in _QOS_DIRS else ancestors
    return bool(parents) and parents[-1] in {"kubepods", ".."}


class _Vanished(Enum):
    """A read showed the pid is gone: ENOENT/ENOTDIR, or ESRCH from the kernel."""

    GONE = auto()


@dataclass
class _Tally:
    """One cycle's reads: enough to tell a few unreadable pids from /proc failing."""

    reads: int = 0
    failed: int = 0
    errors: Counter[int] = field(default_factory=Counter)  # errno -> failed reads
    live: int = 0  # pids not found gone
    unreadable: int = 0  # live pids with no readable file

    def failure(self) -> tuple[str, int, int, int, int, str] | None:
        """Why /proc failed wholesale this cycle (``_FAILURE``'s arguments), or None."""
        if not self.live or self.unreadable <= WHOLESALE_SHARE * self.live:
            return None
        code = self.errors.most_common(1)[0][0] if self.errors else 0
        name = errno.errorcode.get(code, "error")
        strerror = os.strerror(code) if code else "unknown error"
        return name, self.failed, self.reads, self.unreadable, self.live, strerror


def _pid_dir(proc_root: Path, pid: int) -> str:
    """``<proc_root>/<pid>`` as a plain string, not a ``Path``: Python 3.11's pathlib
    interns every component it parses (``sys.intern``), and each new pid's name taking a
    slot in the interpreter's interned-string table grew that table under process churn
    (one doubling, ~1.9 MiB resident, that a process which only imports never makes:
    benchmarks/memory_floor.py)."""
    return f"{proc_root}/{pid}"


def _read_text(path: str | Path, tally: _Tally | None = None) -> str | _Vanished | None:
    """File contents; None when unreadable for another reason (permission, I/O)."""
    if tally is not None:
        tally.reads += 1
    try:
        data = read_file_start(path, _READ_LIMIT + 1)
        if len(data) > _READ_LIMIT:  # a part of a file is no evidence of what the rest says
            raise OSError(errno.EFBIG, f"longer than {_READ_LIMIT} bytes")
    except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
        return _Vanished.GONE
    except OSError as exc:
        if tally is not None:
            tally.failed += 1
            tally.errors[exc.errno or 0] += 1
        return None
    return data.decode("utf-8", errors="replace")


# How a file of a kernel tree (/proc, cgroupfs) is opened, should a fake tree hold
# something else in its place: never waiting for a FIFO's writer to open, never following
# a symlink, never taking a terminal as the controlling one (cgroups.py opens with these
# too).
KERNEL_FILE_FLAGS: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY


def read_file_start(path: str | Path, limit: int) -> bytes:
    """The file's first ``limit`` bytes (all of it when shorter), read to its end.

    ``os.open``/``os.read`` rather than ``open()``: a buffered file object costs three
    more system calls (fstat, the isatty ioctl, lseek) and twice the time per file, and
    this runs for every GPU process every cycle. The flags keep what is not a /proc file
    from stalling or hijacking the exporter (a real /proc has none of it): a FIFO opens
    at once (``O_NONBLOCK``) and with no writer reads as empty, a symlink fails with
    ELOOP (``O_NOFOLLOW``), a terminal never becomes the controlling one (``O_NOCTTY``).
    A FIFO that a writer holds open is read as a pipe is, to its end: a process that
    plants one and keeps it open can hold the read (a fault test does, to stop a read
    between two files).
    """
    fd = os.open(path, KERNEL_FILE_FLAGS)
    try:
        data = b""
        while len(data) < limit:
            try:
                more = os.read(fd, limit - len(data))
            except BlockingIOError:  # a FIFO whose writer has not written (yet)
                os.set_blocking(fd, True)
                continue
            if not more:
                break
            data += more
        return data
    finally:
        os.close(fd)


def _parse_stat(text: str) -> tuple[str | None, str | None]:
    """``(comm, state)`` from ``/proc/<pid>/stat``.

    comm is free text in parentheses and may contain ``)`` itself, so the state is
    the field after the *last* ``)``.
    """
    start, end = text.find("("), text.rfind(")")
    if start < 0 or end < start:
        return None, None
    fields = text[end + 1 :].split(maxsplit=1)
    state = fields[0] if fields and len(fields[0]) == 1 and fields[0].isalpha() else None
    return text[start + 1 : end], state


# (start time, parsed cgroup identity, the cgroup that identity came from)
_Known = tuple[str, Attribution, Location | None]


def _identify(
    pid_dir: str, pid: int, known: _Known | None, tally: _Tally | None = None
) -> tuple[ProcessIdentity, _Known | None]:
    """Read one pid; ``known`` is its cgroup identity from an earlier read, reused when
    the start time shows it is still the same process. Returns the identity and what
    to remember for the next read (None: nothing worth remembering).

    A real pid directory always holds both files, so a missing one (or ESRCH) means
    the process exited, possibly between the two reads: the pid is dead. Checking the
    directory again instead would mistake a reused pid for the old process. A file
    unreadable for any other reason (permission, I/O) only leaves its fields unknown.
    """
    stat = _read_text(f"{pid_dir}/stat", tally)
    if stat is _Vanished.GONE:
        return ProcessIdentity(pid=pid, alive=False), None
    start = _start_time(stat) if isinstance(stat, str) else None
    remember: _Known | None
    cgroup_read = cgroup_parsed = True
    location: Location | None = None
    if start is not None and known is not None and known[0] == start:
        ids, location, remember = known[1], known[2], known
    else:
        cgroup = _read_text(f"{pid_dir}/cgroup", tally)
        if cgroup is _Vanished.GONE or not _still_running(pid_dir, start):
            return ProcessIdentity(pid=pid, alive=False), None
        cgroup_read = isinstance(cgroup, str)
        ids = parse_cgroup(cgroup) if isinstance(cgroup, str) else _NOTHING
        location = cgroup_location(cgroup) if isinstance(cgroup, str) else None
        # Naming no pod makes a host process only if the file is a real cgroup file.
        cgroup_parsed = not isinstance(cgroup, str) or ids != _NOTHING or cgroup_well_formed(cgroup)
        # an unreadable or unparsed cgroup file is tried again next time
        understood = isinstance(cgroup, str) and cgroup_parsed
        remember = (start, ids, location) if start is not None and understood else None
    if tally is not None:
        tally.live += 1
        tally.unreadable += not (cgroup_read or isinstance(stat, str))
    comm, state = _parse_stat(stat) if isinstance(stat, str) else (None, None)
    identity = ProcessIdentity(
        pid=pid,
        alive=True,
        pod_uid=ids[0],
        container_id=ids[1],
        comm=comm,
        state=state,
        cgroup_read=cgroup_read,
        cgroup_parsed=cgroup_parsed,
        cgroup_path=location[0] if location else None,
        cgroup_version=location[1] if location else None,
    )
    return identity, remember


def _still_running(pid_dir: str, start: str | None) -> bool:
    """Whether the process whose ``stat`` was read still holds the pid after its
    ``cgroup`` was read. If it died and the pid went to a new process in between, that
    cgroup is the new one's: a second ``stat`` shows another start time (or none), and
    the process read first is dead. Unknown start times are not evidence of a change."""
    if start is None:
        return True
    again = _read_text(f"{pid_dir}/stat")
    if again is _Vanished.GONE:
        return False
    return not isinstance(again, str) or _start_time(again) in {start, None}


def host_view_problem(proc_root: Path) -> str | None:
    """Why ``proc_root`` is not a live /proc of the host's pid namespace, or None.

    Only positive evidence fails the check: pid 1 absent, or a pid 2 that reads as
    another process than ``kthreadd`` (the module says why both hold on the host). A
    file that cannot be read (EMFILE, EACCES) or parsed proves nothing either way; the
    reads of the pids that follow then judge /proc as they always do.
    """
    if not proc_root.is_dir():
        return f"proc root {proc_root} is not a directory: {_HOST_VIEW_FIX}"
    if _read_text(proc_root / "1" / "stat") is _Vanished.GONE:
        return f"proc root {proc_root} shows no pid 1: not a live /proc of the host; " + (
            _HOST_VIEW_FIX
        )
    spawner = _read_text(proc_root / "2" / "stat")
    if spawner is _Vanished.GONE:
        return (
            f"proc root {proc_root} shows no pid 2 (kthreadd): the /proc of another pid "
            f"namespace, or mounted with hidepid; {_HOST_VIEW_FIX}"
        )
    seen = _comm_and_ppid(spawner) if isinstance(spawner, str) else None
    if seen is not None and seen != (_KTHREADD, "0"):
        return (
            f"proc root {proc_root} shows pid 2 as {seen[0]!r}, not kthreadd: the /proc of "
            f"another pid namespace; {_HOST_VIEW_FIX}"
        )
    return None


def shows_host_kthreadd(proc_root: Path) -> bool:
    """Positive evidence of the host's /proc: pid 2's stat reads as ``kthreadd`` with
    parent 0 (``host_view_problem`` fails only on evidence against; this is the
    evidence for, which a report of "ok" needs)."""
    spawner = _read_text(proc_root / "2" / "stat")
    return isinstance(spawner, str) and _comm_and_ppid(spawner) == (_KTHREADD, "0")


def _comm_and_ppid(stat: str) -> tuple[str, str] | None:
    """``(comm, ppid)`` from a ``stat`` in the kernel's format, else None."""
    comm, state = _parse_stat(stat)
    fields = stat[stat.rfind(")") + 1 :].split()
    if comm is None or state is None or len(fields) < 2 or not fields[1].isdigit():
        return None
    return comm, fields[1]


def read_process(proc_root: Path, pid: int) -> ProcessIdentity:
    """What ``<proc_root>/<pid>`` says about ``pid``; never raises for a per-pid problem."""
    return _identify(_pid_dir(proc_root, pid), pid, None)[0]


def _start_time(stat: str) -> str | None:
    """Field 22 of ``stat`` (start time in clock ticks): with the pid, it names one
    process for its whole life, so a reused pid is never mistaken for the old one."""
    fields = stat[stat.rfind(")") + 1 :].split()
    return fields[19] if len(fields) > 19 else None


class ProcessReader(Source):
    """The procfs source: who each pid NVML listed this cycle is.

    A pid's cgroup does not change while it lives, so its parsed identity is kept
    (keyed by pid and start time) and later cycles read only ``stat`` — for state,
    comm and liveness. Only pids asked about in the last call are remembered, so the
    cache is bounded by the GPU process count.
    """

    name: ClassVar[SourceName] = "procfs"

    def __init__(self, proc_root: Path) -> None:
        self.proc_root = proc_root
        self._known: dict[int, _Known] = {}
        self._unreadable_total = 0  # pids whose cgroup could not be read, per read
        self._failure: str | None = None  # why the last read failed wholesale
        self._not_host: str | None = None  # why the last cycle's tree was not host /proc

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.processes = self.read(cycle)

    def read(self, cycle: Cycle) -> tuple[ProcessIdentity, ...]:
        problem = host_view_problem(self.proc_root)
        if problem != self._not_host:  # logged once when it starts, once when it ends
            if problem is not None:
                log.warning("%s; the owners of GPU processes are unknown until it is", problem)
            else:
                log.info("proc root %s is a live /proc of the host again", self.proc_root)
            self._not_host = problem
        if problem is not None:
            # Without the host's tree every pid would read as exited and its memory as a
            # dead process's orphan; say nothing instead (status() reports the source down).
            return ()
        return self.identify(cycle.gpu_pids())

    def status(self) -> SourceStatus:
        if self._not_host is not None:
            return SourceStatus(self.name, False, self._not_host)
        return SourceStatus(self.name, self._failure is None, self._failure)

    def identify(self, pids: Iterable[int]) -> tuple[ProcessIdentity, ...]:
        """Every pid's identity; none at all when /proc fails wholesale (see the module)."""
        known: dict[int, _Known] = {}
        out = []
        tally = _Tally()
        for pid in sorted(set(pids)):
            identity, remember = _identify(
                _pid_dir(self.proc_root, pid), pid, self._known.get(pid), tally
            )
            if remember is not None:
                known[pid] = remember
            out.append(identity)
        self._unreadable_total += sum(
            1 for identity in out if not (identity.cgroup_read and identity.cgroup_parsed)
        )
        failure = tally.failure()
        if failure is not None:
            # A warning each cycle: logs.RepeatFilter lets one a minute through.
            log.warning(
                "reading %s failed wholesale: " + _FAILURE + "; the owners of GPU "
                "processes are unknown until it reads again",
                self.proc_root,
                *failure,
            )
            self._failure = _FAILURE % failure
            return ()  # not one identity: a "gone" read beside failures is no evidence
        if self._failure is not None:
            log.info("reading %s works again", self.proc_root)
            self._failure = None
        self._known = known
        return tuple(out)

    @property
    def errors_total(self) -> int:
        """A pid whose cgroup is unreadable (a non-root exporter, say) or in no known form
        counts each cycle."""
        return self._unreadable_total
