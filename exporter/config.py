"""Flags and environment variables -> a validated ``Config``.

Every flag ``--some-flag`` can also be set with ``GPU_EXPORTER_SOME_FLAG``; the flag wins.
Bad input never half-starts the exporter: ``ConfigError`` carries one line saying what
was wrong and how to fix it, and the CLI exits with status 2.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from exporter import __version__
from exporter.model import (
    DCGM_HOSTENGINE_PORT,
    DEFAULT_GPM_INTERVAL_S,
    DEFAULT_PROCESS_UTILIZATION_INTERVAL_S,
    DEFAULT_SLOW_INTERVAL_S,
    GPU_DRA_DRIVERS,
    GPU_OPERATOR_NAMESPACES,
    GPU_RESOURCE_NAMES,
    KUBELET_POD_RESOURCES_SOCKET,
    DcgmMode,
)
from exporter.model.families import DEFAULT_OFF, FamilySelectionError, select_families
from exporter.model.vocabulary import (
    DEFAULT_READY_GRACE_S,
    LIVENESS_DEFAULT_CYCLES,
    LIVENESS_MAX_CYCLES,
    LIVENESS_MIN_CYCLES,
    LIVENESS_STARTUP_GRACE_S,
    SIMULATE_SPEED_MAX,
    SIMULATE_SPEED_MIN,
    SIMULATE_START_MAX_S,
)
from exporter.model.xid_classes import parse_overrides

ENV_PREFIX = "GPU_EXPORTER_"
# The host engine dcgm-exporter is pointed at (its -r flag's variable); the GPU Operator
# sets it to its nvidia-dcgm Service when it runs a standalone host engine.
DCGM_REMOTE_HOSTENGINE_INFO = "DCGM_REMOTE_HOSTENGINE_INFO"
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 3600.0
LOG_LEVELS = ("debug", "info", "warning", "error")
# The shipped scenarios are the YAML files beside the simulator; listed, not imported,
# so parsing flags never loads the simulator.
SHIPPED_SCENARIOS = tuple(
    sorted(p.stem for p in (Path(__file__).parent / "sim" / "scenarios").glob("*.yaml"))
)


class ConfigError(ValueError):
    """One line for the operator: what was wrong and how to fix it."""


@dataclass(frozen=True)
class Config:
    listen_host: str
    listen_port: int
    interval_s: float
    proc_root: Path
    pod_resources_socket: Path
    pod_resources_interval_s: float
    resource_names: tuple[str, ...]
    node_name: str
    kube_api: str  # "auto" | "off"
    kubeconfig: str | None
    simulate: str | None
    simulated_node: Path | None
    per_process_metrics: bool
    families: frozenset[str]  # the metric families served (exporter/model/families.py)
    xid_classes: dict[int, str]  # --xid-class overrides
    health_xid_window_s: float
    retired_pages_limit: int
    idle_threshold: float
    orphan_threshold_bytes: int
    orphan_cycles: int
    deleted_pod_grace_s: float
    kmsg: bool
    kmsg_path: Path
    dcgm: DcgmMode
    dcgm_bindings_path: str | None
    dcgm_library_path: str | None
    dra_drivers: tuple[str, ...]
    log_level: str
    log_format: str  # "text" | "json"
    capacity_tolerated_taints: tuple[str, ...] = ()
    snapshot: bool = False  # the `snapshot` subcommand, not the server
    snapshot_json: bool = False  # snapshot subcommand only
    snapshot_window_s: float = 1.0
    doctor: bool = False  # the `doctor` subcommand: check what the exporter depends on
    doctor_json: bool = False
    doctor_timeout_s: float = 10.0  # each check's deadline
    http_header_timeout_s: float = 10.0
    http_max_connections: int = 128
    web_config_file: Path | None = None
    liveness_cycles: int = LIVENESS_DEFAULT_CYCLES
    ready_grace_s: float = DEFAULT_READY_GRACE_S
    kube_events: str = "auto"  # "auto" | "off": Events where API credentials exist
    node_condition: bool = False
    dra_device_taints: bool = False
    dra_device_taint_effect: str = "None"  # "None" | "NoSchedule"
    # --kube-writes: the kinds of write (KUBE_WRITE_KINDS) computed and counted but not
    # sent; empty: every write is sent ("on")
    kube_writes_shadow: frozenset[str] = frozenset()
    # one writer per node (exporter/reporting/lease.py): the Lease's namespace and
    # duration; 0 s: no lease, every exporter on the node writes
    kube_writer_lease_namespace: str = "default"
    kube_writer_lease_duration_s: int = 30
    cgroup_root: Path | None = None  # --cgroup-root; None: off (no cgroup source)
    why_idle_throttled_ratio: float = 0.2  # analysis/why_idle.py
    why_idle_pressure_ratio: float = 0.2
    simulate_start_s: float = 0.0  # --simulate-start: the simulated clock's first reading
    simulate_speed: float = 1.0  # --simulate-speed: simulated seconds per real second
    slow_interval_s: float = DEFAULT_SLOW_INTERVAL_S  # --slow-interval (nvml_cadence.py)
    gpm_interval_s: float = DEFAULT_GPM_INTERVAL_S  # --gpm-interval (nvml_cadence.py)
    # --process-utilization-interval (nvml_cadence.py)
    process_utilization_interval_s: float = DEFAULT_PROCESS_UTILIZATION_INTERVAL_S


UNRECOGNIZED = "unrecognized arguments: "  # argparse's words for flags it does not know


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line instead of usage + message, suggests the
    flag meant where one is unknown, and knows how to parse each flag's environment
    variable (``from_env``: dest -> parser), which ``resolve_env`` does only for flags
    not given: the flag wins. ``command``: the subcommand (``snapshot``, ``doctor``) or
    None; ``not_offered``: the exporter's flags it does not take."""

    def __init__(
        self,
        *,
        command: str | None = None,
        not_offered: frozenset[str] = frozenset(),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.command = command
        self.not_offered = not_offered
        self.from_env: dict[str, Callable[[_FromEnv], object]] = {}
        self.given_by_env: dict[str, str] = {}  # dest -> the variable its value came from

    def error(self, message: str) -> NoReturn:
        see = "see --help"
        if message.startswith(UNRECOGNIZED):
            hint, abbreviated = self.did_you_mean(message.removeprefix(UNRECOGNIZED).split(" "))
            message += hint
            see = f"flags are not abbreviated; {see}" if abbreviated else see
        raise ConfigError(f"{message} ({see})")

    def did_you_mean(self, words: Sequence[str]) -> tuple[str, bool]:
        """``; did you mean --interval?`` for the unknown flags among ``words`` (as given,
        ``--flag=value`` too): the flags an abbreviation starts, else the closest name;
        and whether one was an abbreviation (argparse took those once)."""
        offered = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        guesses: list[tuple[str, str]] = []  # (given, the flags meant)
        notes: list[str] = []
        abbreviated = False
        for word in words:
            given = word.partition("=")[0]
            if not given.startswith("--") or given == "--" or given in offered:
                continue
            if given in self.not_offered:
                notes.append(f"{given} is the server's, not {self.command}'s")
                continue
            starts = [o for o in offered if o.startswith(given)]
            if 0 < len(starts) <= MAX_GUESSES:
                abbreviated = True
                guesses.append((given, _either(starts)))
            elif close := difflib.get_close_matches(given, offered, n=1):
                guesses.append((given, close[0]))
        if len(guesses) == 1:
            notes.insert(0, f"did you mean {guesses[0][1]}?")
        elif guesses:
            meant = ", ".join(f"{flags} for {given}" for given, flags in guesses)
            notes.insert(0, f"did you mean {meant}?")
        return "".join(f"; {note}" for note in notes), abbreviated

    def resolve_env(self, args: argparse.Namespace) -> None:
        """Parse the variables of the flags that were not given (a variable overridden
        by its flag is never parsed, so a bad one there is no error)."""
        for dest, parse in self.from_env.items():
            value = getattr(args, dest, None)
            if isinstance(value, _FromEnv):
                setattr(args, dest, parse(value))
                self.given_by_env[dest] = value.variable

    def named(self, flag: str) -> str:
        """``flag``, or the environment variable its value came from."""
        return self.given_by_env.get(flag.lstrip("-").replace("-", "_"), flag)

    def shown(self, flag: str, value: object) -> str:
        """``flag`` and ``value`` as the operator gave them: ``--flag 2`` from the command
        line or the default, ``GPU_EXPORTER_FLAG=2`` from the environment, so an error
        about values checked together names what to change."""
        name = self.named(flag)
        return f"{flag} {value}" if name == flag else f"{name}={value}"


@dataclass(frozen=True)
class _FromEnv:
    """A flag's default from its environment variable, still text: not a ``str``, so
    argparse leaves it alone; parsed by ``_Parser.resolve_env`` if the flag is absent."""

    text: str
    variable: str

    def __str__(self) -> str:  # as --help shows the default
        return self.text


def _at_least_interval(
    args: argparse.Namespace,
    parser: _Parser,
    env: Mapping[str, str],
    argv: Sequence[str],
    flag: str,
    what: str,
) -> None:
    """A cadence flag's value, at least --interval: a default shorter than a longer
    --interval follows it; a value given shorter is refused in one line."""
    dest = flag[2:].replace("-", "_")
    value = getattr(args, dest)
    given = _env_name(flag) in env or any(a == flag or a.startswith(flag + "=") for a in argv)
    if value < args.interval and not given:
        setattr(args, dest, args.interval)  # the default follows a longer --interval
    elif value < args.interval:
        raise ConfigError(
            f"{parser.shown(flag, _plain(value))} is shorter than "
            f"{parser.shown('--interval', _plain(args.interval))}: {what} at most once per "
            f"cycle; give {parser.shown(flag, _plain(args.interval))} or more"
        )


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


MAX_GUESSES = 4  # an abbreviation of more flags than this gets the closest name instead


def _either(flags: Sequence[str]) -> str:
    """``--a``, ``--a or --b``, ``--a, --b or --c``."""
    return " or ".join(filter(None, (", ".join(flags[:-1]), flags[-1])))


# Flags of the server alone: the snapshot subcommand neither offers nor needs them.
SERVER_ONLY_FLAGS = frozenset(
    {
        "--listen",
        "--interval",
        "--slow-interval",
        "--gpm-interval",
        "--process-utilization-interval",
        "--liveness-cycles",
        "--ready-grace",
        "--web-config-file",
        "--http-header-timeout",
        "--http-max-connections",
        "--pod-resources-interval",
        "--per-process-metrics",
        "--families-disable",
        "--families-enable",
        "--kube-events",
        "--node-condition",
        "--dra-device-taints",
        "--dra-device-taint-effect",
        "--kube-writes",
        "--kube-writer-lease-namespace",
        "--kube-writer-lease-duration",
    }
)

DOCTOR_USAGE = "%(prog)s [--json] [--timeout SECONDS] [every exporter flag]"


@dataclass(frozen=True)
class Bounds:
    """The values a numeric flag accepts: a finite number in ``low..high``, a whole one
    when ``whole``. Every numeric flag (and its variable) is parsed by one, given as
    its ``Flag``'s ``bounds``: inf, nan, 1e400 and values out of range stop the
    exporter with one line, instead of freezing the sample loop (``--interval inf``) or
    failing later with a traceback; ``--help`` states the range."""

    low: float
    high: float
    unit: str = ""  # "seconds", "MiB": how --help and errors name the value
    whole: bool = False

    def __str__(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"{_plain(self.low)}..{_plain(self.high)}{unit}"

    def check(self, text: str) -> float:
        """``text`` as a number in range (an ``int`` when whole); the error's text is
        one line for argparse or a variable's name to prefix."""
        try:
            value: float = int(text) if self.whole else float(text)
        except ValueError:
            kind = "a whole number" if self.whole else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind} in {self}") from None
        if not (math.isfinite(value) and self.low <= value <= self.high):
            raise argparse.ArgumentTypeError(f"{text} is not in the range {self}")
        return value


def _plain(number: float) -> str:
    """1048576, not 1.04858e+06; 0.1, not 0.1000."""
    return str(int(number)) if float(number).is_integer() else str(number)


TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


@dataclass(frozen=True)
class Flag:
    """One row of the flag table: ``--some-flag`` (dest ``some_flag``, variable
    ``GPU_EXPORTER_SOME_FLAG``), its help text and how its value is read."""

    name: str
    help: str
    # text as on the command line (numbers too: ``bounds`` parses them), None for none,
    # or a function of the environment (``--node-name``: $NODE_NAME, else the hostname)
    default: str | Callable[[Mapping[str, str]], str] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    bounds: Bounds | None = None  # a number, in this range
    switch: bool = False  # on when given (store_true); its variable is true/false


@dataclass(frozen=True)
class FlagGroup:
    """Flags of one concern: a section of --help and of README.md's flag table."""

    title: str
    description: str  # one line under the title in --help
    flags: tuple[Flag, ...]


def _node_name(env: Mapping[str, str]) -> str:
    return env.get("NODE_NAME") or socket.gethostname()


def _pod_namespace(env: Mapping[str, str]) -> str:
    return env.get("POD_NAMESPACE") or "default"


_SERVING_FLAGS = (
    Flag(
        "--listen",
        "HOST:PORT to serve /metrics, /healthz and /readyz on.",
        default="0.0.0.0:9445",
        metavar="HOST:PORT",
    ),
    Flag(
        "--web-config-file",
        "TLS, client certificates, basic auth and response headers, in the Prometheus "
        "exporter-toolkit web config format (docs/security.md); re-read when it or its "
        "certificates change. /healthz and /readyz stay open for probes.",
        default="",
        metavar="PATH",
    ),
    Flag(
        "--http-header-timeout",
        "Seconds a client may take to send a request's header; slower connections are closed.",
        default="10",
        metavar="SECONDS",
        bounds=Bounds(0.1, 600, "seconds"),
    ),
    Flag(
        "--http-max-connections",
        "Open HTTP connections at most; beyond it a new connection replaces one of the "
        "client address holding the most (stalled or idle first, oldest first), or is "
        "refused when every other one is being answered.",
        default="128",
        metavar="N",
        bounds=Bounds(1, 10_000, whole=True),
    ),
    Flag(
        "--liveness-cycles",
        f"/healthz and /readyz answer 503 (and the kubelet's liveness probe restarts the "
        f"exporter) once no sample cycle has completed for this many intervals, e.g. an "
        f"NVML call that never returns; at least {LIVENESS_STARTUP_GRACE_S:g} s before the first "
        "cycle.",
        default=str(LIVENESS_DEFAULT_CYCLES),
        metavar="N",
        bounds=Bounds(LIVENESS_MIN_CYCLES, LIVENESS_MAX_CYCLES, whole=True),
    ),
    Flag(
        "--ready-grace",
        "/readyz answers 503, naming the likely cause, once the exporter has not seen the "
        "node's GPUs for this many seconds: NVML down (no driver library in the container, "
        "no driver, no permission), or NVML listing no GPU while the kubelet advertises "
        "some (an unprivileged pod on a hardened NVIDIA container toolkit). /healthz is "
        "not affected (a restart would not help).",
        default=_plain(DEFAULT_READY_GRACE_S),
        metavar="SECONDS",
        bounds=Bounds(0, 86_400, "seconds"),
    ),
    Flag(
        "--per-process-metrics",
        "Also export per-pid series (cardinality grows with processes).",
        switch=True,
    ),
    Flag(
        "--families-disable",
        "Comma-separated globs over metric family names (as served: counters without "
        "_total) not to serve, e.g. 'gpu_clock_event_*,gpu_memory_clock_hertz'. "
        "--families-enable wins where both match; gpu_exporter_* is always served; a "
        "pattern that matches nothing is an error (docs/metrics.md, 'Choosing families').",
        default="",
        metavar="LIST",
    ),
    Flag(
        "--families-enable",
        "Comma-separated globs over metric family names to serve besides the default set, "
        f"which leaves out {', '.join(DEFAULT_OFF)} (e.g. 'gpu_process_*'; '*': every "
        "family).",
        default="",
        metavar="LIST",
    ),
)

_SOURCES_FLAGS = (
    Flag(
        "--interval",
        "Seconds between sample cycles.",
        default="5",
        metavar="SECONDS",
        bounds=Bounds(MIN_INTERVAL_S, MAX_INTERVAL_S, "seconds"),
    ),
    Flag(
        "--slow-interval",
        "Seconds between reads of the NVML facts that change once in days or weeks (ECC "
        "and row-remap counters, retired pages, PCIe replays and best link, NVLink states "
        "and error counters, fans, power limit), the counters that cost milliseconds a read "
        "(energy, clock-event time) and re-reads of the MIG layout; served as "
        "last read in between, so they may be this old (docs/metrics.md, 'Cadence'). At "
        "least --interval (the default follows a longer --interval).",
        default=_plain(DEFAULT_SLOW_INTERVAL_S),
        metavar="SECONDS",
        bounds=Bounds(MIN_INTERVAL_S, MAX_INTERVAL_S, "seconds"),
    ),
    Flag(
        "--gpm-interval",
        "Seconds per GPM window: how often SM activity, occupancy, tensor, DRAM and FP pipe "
        "activity are computed (nvmlGpmMetricsGet cost 1.9 ms a read on an H200). The "
        "gauges are the last window's mean; the *_seconds_total counters add every window, "
        "so rate() over a longer span is exact whatever this is (docs/metrics.md, "
        "'Activity counters'). At least --interval (the default follows a longer "
        "--interval).",
        default=_plain(DEFAULT_GPM_INTERVAL_S),
        metavar="SECONDS",
        bounds=Bounds(MIN_INTERVAL_S, MAX_INTERVAL_S, "seconds"),
    ),
    Flag(
        "--process-utilization-interval",
        "Seconds between reads of the per-process SM samples "
        "(nvmlDeviceGetProcessUtilization, 2.1-2.4 ms a call on an H200): every sample "
        "since the last read is taken, so gpu_container_sm_seconds_total misses nothing "
        "the driver kept; the per-container SM gauges are the last read's. At least "
        "--interval (the default follows a longer --interval).",
        default=_plain(DEFAULT_PROCESS_UTILIZATION_INTERVAL_S),
        metavar="SECONDS",
        bounds=Bounds(MIN_INTERVAL_S, MAX_INTERVAL_S, "seconds"),
    ),
    Flag(
        "--proc-root",
        "Where the host's /proc is mounted; pids are read under it.",
        default="/proc",
        metavar="PATH",
    ),
    Flag(
        "--cgroup-root",
        "Where the host's cgroup filesystem is mounted (read-only is enough): the CPU "
        "throttling (cpu.stat) and pressure stall (cpu/io/memory.pressure, cgroup v2 only) "
        "counters of containers that hold or use a GPU are read under it, to tell a GPU "
        "starved of CPU or I/O (docs/why-idle.md); 'off': not read.",
        default="/sys/fs/cgroup",
        metavar="PATH",
    ),
    Flag(
        "--pod-resources-socket",
        "The kubelet PodResources API unix socket.",
        default=KUBELET_POD_RESOURCES_SOCKET,
        metavar="PATH",
    ),
    Flag(
        "--pod-resources-interval",
        "Seconds between scheduled PodResources refreshes; with cycles further apart, one "
        "refresh a second before each cycle instead; a GPU process in a new "
        "container asks for one at once (at most one every 2 s).",
        default="30",
        metavar="SECONDS",
        bounds=Bounds(1, 3600, "seconds"),
    ),
    Flag(
        "--resource-names",
        "Comma-separated extended resource names that are GPUs; a trailing * matches a prefix.",
        default=",".join(GPU_RESOURCE_NAMES),
        metavar="LIST",
    ),
    Flag(
        "--dra-drivers",
        "Comma-separated DRA drivers whose devices are GPUs; their ResourceSlices on this "
        "node are watched to resolve claimed devices ('' turns the watch off).",
        default=",".join(GPU_DRA_DRIVERS),
        metavar="LIST",
    ),
    Flag(
        "--kmsg",
        "Also read 'NVRM: Xid' lines from the kernel log, so XIDs raised while the "
        "exporter was down are counted.",
        switch=True,
    ),
    Flag("--kmsg-path", "The kernel log device.", default="/dev/kmsg", metavar="PATH"),
    Flag(
        "--dcgm",
        "DCGM profiling fields and health: 'auto' tries the host engine named by "
        f"${DCGM_REMOTE_HOSTENGINE_INFO}, the GPU Operator's nvidia-dcgm Service, then "
        f"127.0.0.1:{DCGM_HOSTENGINE_PORT}, and only then starts an embedded host engine; "
        "'off' never; HOST:PORT that host engine only.",
        default="auto",
        metavar="MODE",
    ),
    Flag(
        "--dcgm-bindings-path",
        "Directory holding DCGM's Python bindings (installed with "
        "DCGM, e.g. /usr/local/dcgm/bindings/python3).",
        default=None,
        metavar="PATH",
    ),
    Flag(
        "--dcgm-library-path",
        "Directory holding libdcgm.so.4 (DCGM 3: libdcgm.so.3), loaded from there before "
        "the bindings look in /usr/lib/<arch>-linux-gnu and /usr/lib64; the chart's "
        "init container copies it out of NVIDIA's DCGM image to such a directory.",
        default=None,
        metavar="PATH",
    ),
    Flag(
        "--dcgm-operator-namespace",
        "Comma-separated namespaces where --dcgm auto looks for the GPU Operator's "
        f"nvidia-dcgm Service (nvidia-dcgm.<ns>.svc:{DCGM_HOSTENGINE_PORT}); 'auto': "
        f"{', '.join(GPU_OPERATOR_NAMESPACES)}; '' none.",
        default="auto",
        metavar="LIST",
    ),
)

_KUBERNETES_FLAGS = (
    Flag(
        "--node-name",
        "This node's Kubernetes name (default: $NODE_NAME, else the hostname).",
        default=_node_name,
        metavar="NAME",
    ),
    Flag(
        "--kube-api",
        "Watch this node's pods through the Kubernetes API for pod and "
        "container names ('off': never contact it).",
        default="auto",
        choices=("auto", "off"),
    ),
    Flag(
        "--kubeconfig",
        "Kubeconfig for the pod watch; default: in-cluster config, else ~/.kube/config.",
        default=None,
        metavar="PATH",
    ),
    Flag(
        "--capacity-tolerated-taints",
        "Comma-separated Node taint keys GPU pods tolerate, whatever the effect. Any other "
        "NoSchedule or NoExecute taint counts the node's free GPUs as disrupted, not "
        "allocatable, except a NoSchedule taint keyed by the GPU's resource name "
        "(nvidia.com/gpu for nvidia.com/gpu devices: docs/capacity.md).",
        default="",
        metavar="LIST",
    ),
    Flag(
        "--kube-events",
        "Record Kubernetes Events (events.k8s.io/v1) on the pods and the Node a GPU fault "
        "hits: GPUFatalXID, GPULost, GPUUnhealthy, GPUHealthy, GPUIsolationLeak, "
        "GPUOrphanedMemory; aggregated and rate-limited (docs/kubernetes-events.md). "
        "'auto': where Kubernetes API credentials exist and --kube-api is not off.",
        default="auto",
        choices=("auto", "off"),
    ),
    Flag(
        "--node-condition",
        "Keep a GPUUnhealthy condition on this Node's status: True while a GPU is "
        "unhealthy or lost, False when all are healthy, left alone when NVML cannot "
        "tell. Needs patch on nodes/status.",
        switch=True,
    ),
    Flag(
        "--dra-device-taints",
        "Create a DRA DeviceTaintRule (resource.k8s.io, KEP-5055) for each unhealthy GPU "
        "a DRA driver publishes on this node, and delete it when the GPU is healthy "
        "again, or when the device it selects is replaced (a new UUID under its name) "
        "or gone. Needs get, list, create, delete on devicetaintrules.",
        switch=True,
    ),
    Flag(
        "--dra-device-taint-effect",
        "The taints' effect; default: None, which shows the taint and changes nothing "
        "(Kubernetes 1.35+); NoSchedule keeps new claims off the GPU.",
        default="None",
        choices=("None", "NoSchedule"),
    ),
    Flag(
        "--kube-writes",
        "'on': send the Events, the node condition and the DeviceTaintRules the flags "
        "above ask for. 'shadow': compute every one of them and count it "
        "(gpu_exporter_kube_writes_shadowed_total{kind,reason}) and log it, but send "
        "none (reads still happen), to compare fleet-wide before switching writes on. "
        "'shadow=KIND,...' shadows only those kinds (event, node_condition, "
        "device_taint_rule). Rollout: shadow, then on for a canary node pool, then on "
        "everywhere (docs/install.md).",
        default="on",
        metavar="on|shadow|shadow=KIND,...",
    ),
    Flag(
        "--kube-writer-lease-namespace",
        "Namespace of the node's writer Lease (coordination.k8s.io/v1, named "
        "gpu-occupancy-exporter-<node>): of the exporters on one node only its holder "
        "writes Events, the condition and taints; the others count them as shadowed "
        "(default: $POD_NAMESPACE, else default).",
        default=_pod_namespace,
        metavar="NAMESPACE",
    ),
    Flag(
        "--kube-writer-lease-duration",
        "Seconds the writer Lease is held unrenewed before another exporter on the node "
        "may take it (renewed every third of it; released at a clean shutdown). 0: no "
        "lease, every exporter on the node writes.",
        default="30",
        bounds=Bounds(0, 3600, "seconds", whole=True),
    ),
)

_HEALTH_FLAGS = (
    Flag(
        "--xid-class",
        "Override the XID class table (docs/xid.md): comma-separated "
        "CODE=CLASS with CODE 1..65535 and CLASS application, warning or fatal, e.g. "
        "'13=fatal,94=warning'.",
        default="",
        metavar="LIST",
    ),
    Flag(
        "--xid-severity",
        "Deprecated: the old name of --xid-class (the served label is `class`); "
        "still accepted, to be removed no earlier than two releases on.",
        default="",
        metavar="LIST",
    ),
    Flag(
        "--health-xid-window",
        "Seconds a fatal XID keeps its GPU unhealthy.",
        default="3600",
        metavar="SECONDS",
        bounds=Bounds(1, 7 * 86400, "seconds"),
    ),
    Flag(
        "--retired-pages-limit",
        "Retired memory pages at which a GPU is unhealthy.",
        default="60",
        metavar="N",
        bounds=Bounds(1, 100_000, whole=True),
    ),
    Flag(
        "--idle-threshold",
        "SM activity below which an allocated GPU counts as idle.",
        default="0.05",
        metavar="RATIO",
        bounds=Bounds(0, 1),
    ),
    Flag(
        "--why-idle-throttled-ratio",
        "Share of a GPU container's CFS periods throttled (cpu.stat nr_throttled / "
        "nr_periods, over one cycle) above which its idle GPU time counts as cause "
        "cpu_throttled. 0.2: a data loader throttled in 1 period in 5 is losing a fifth of "
        "its CPU turns, enough to leave a GPU waiting; a few percent is the noise of a "
        "limit set close to the mean. A correlation, not a proof (docs/why-idle.md).",
        default="0.2",
        metavar="RATIO",
        bounds=Bounds(0.01, 0.99),
    ),
    Flag(
        "--why-idle-pressure-ratio",
        "Stall share (cpu.pressure / io.pressure 'some', seconds per second over one "
        "cycle) above which a GPU container's idle GPU time counts as cause cpu_pressure "
        "/ io_pressure. 0.2, as for throttling: some task of the container waited a "
        "fifth of the cycle for a CPU or for I/O, time its GPU work could not be fed; "
        "on the 'some' line, not 'full', since one starved loader thread is enough to "
        "idle a GPU. A correlation, not a proof (docs/why-idle.md).",
        default="0.2",
        metavar="RATIO",
        bounds=Bounds(0.01, 0.99),
    ),
    Flag(
        "--orphan-threshold",
        "MiB of device memory no listed process accounts for before "
        "it is reported as orphaned ('unattributed').",
        default="256",
        metavar="MIB",
        bounds=Bounds(0, 2**20, "MiB"),
    ),
    Flag(
        "--orphan-cycles",
        "Consecutive cycles unaccounted memory, a process stuck in state D/Z, or "
        "a process NVML lists with no /proc entry must persist before it is reported.",
        default="3",
        metavar="N",
        bounds=Bounds(1, 10_000, whole=True),
    ),
    Flag(
        "--deleted-pod-grace",
        "Seconds after a pod's deletion deadline before its live "
        "processes count as orphaned ('deleted_pod').",
        default="60",
        metavar="SECONDS",
        bounds=Bounds(0, 7 * 86400, "seconds"),
    ),
)

_SIMULATOR_FLAGS = (
    Flag(
        "--simulate",
        "Run on a simulated GPU node instead of the real NVML: a shipped "
        f"scenario ({', '.join(SHIPPED_SCENARIOS)}) or a YAML file.",
        default=None,
        metavar="SCENARIO",
    ),
    Flag(
        "--simulated-node",
        "Run on a simulated node that another process serves ('python -m exporter.sim "
        "SCENARIO --dir DIR'): only its NVML library is loaded here, as libnvidia-ml is "
        "on a real node, so this process's CPU and memory are the exporter's own.",
        default=None,
        metavar="DIR",
    ),
    Flag(
        "--simulate-start",
        "With --simulate: start the scenario's clock at this simulated second, its "
        "timeline's events up to it applied at once, as if the node had been running "
        "(e.g. 140 on node-8gpu: its XIDs, orphans and hog within a minute; README.md).",
        default="0",
        metavar="SECONDS",
        bounds=Bounds(0, SIMULATE_START_MAX_S, "seconds"),
    ),
    Flag(
        "--simulate-speed",
        "With --simulate: simulated seconds per real second. Counters grow per simulated "
        "second, so rates over real time read this many times higher (docs/simulator.md).",
        default="1",
        metavar="FACTOR",
        bounds=Bounds(SIMULATE_SPEED_MIN, SIMULATE_SPEED_MAX),
    ),
)

_LOGGING_FLAGS = (
    Flag("--log-level", "Log verbosity.", default="info", choices=LOG_LEVELS),
    Flag("--log-format", "Log line format.", default="text", choices=("text", "json")),
)

FLAG_GROUPS = (
    FlagGroup(
        "serving",
        "The HTTP endpoint: address, TLS and auth, limits, probes, metric families.",
        _SERVING_FLAGS,
    ),
    FlagGroup(
        "sources",
        "What is read and how often: NVML, DCGM, PodResources, /proc, cgroups, kmsg.",
        _SOURCES_FLAGS,
    ),
    FlagGroup(
        "Kubernetes",
        "The pod watch, and the writes: Events, Node condition, DRA taints, Lease.",
        _KUBERNETES_FLAGS,
    ),
    FlagGroup(
        "health and thresholds",
        "XID classes; when a GPU counts as unhealthy, idle, starved or orphaned.",
        _HEALTH_FLAGS,
    ),
    FlagGroup(
        "simulator",
        "A simulated GPU node instead of the real NVML (docs/simulator.md).",
        _SIMULATOR_FLAGS,
    ),
    FlagGroup("logging", "Log lines, on stderr.", _LOGGING_FLAGS),
)


def build_parser(
    env: Mapping[str, str], *, snapshot: bool = False, doctor: bool = False
) -> _Parser:
    if doctor:
        prog, usage = "gpu-occupancy-exporter doctor", DOCTOR_USAGE
    elif snapshot:
        prog, usage = (
            "gpu-occupancy-exporter snapshot",
            "%(prog)s [--json] [--window SECONDS] [flags]",
        )
    else:
        prog = "gpu-occupancy-exporter"
        usage = (
            "%(prog)s [snapshot|doctor] [flags]  (snapshot --help, doctor --help: the subcommands)"
        )
    parser = _Parser(
        prog=prog,
        usage=usage,
        description=(
            "Node-level GPU telemetry for Kubernetes: true SM occupancy next to GPU-Util, "
            "GPU memory and time per pod and container, orphaned memory and GPU health, "
            "served to Prometheus. Every flag can also be set with the environment "
            f"variable shown after it ({ENV_PREFIX}<FLAG>); the flag wins."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Check, on this node, everything the exporter with these flags depends on: one "
            "line per check (ok / degraded / missing, with the fix), or JSON; exit status 0 "
            "when none is missing, 1 otherwise (docs/doctor.md)."
            if doctor
            else "Print one analysed sample of the node (no server) with the same flags and "
            "code path: gpu-occupancy-exporter snapshot [--json] [--window S] [flags]"
            if snapshot
            else "subcommands: 'gpu-occupancy-exporter snapshot --help' prints one analysed "
            "sample as tables or JSON, for an operator on the node; 'gpu-occupancy-exporter "
            "doctor --help' checks what the exporter depends on. Docs: README.md, docs/."
        ),
        allow_abbrev=False,  # --interv is refused with a suggestion, not taken as --interval
        command="snapshot" if snapshot else "doctor" if doctor else None,
        not_offered=SERVER_ONLY_FLAGS if snapshot else frozenset(),
    )
    if snapshot:
        own = parser.add_argument_group(
            "snapshot", "Its own flags; the exporter's flags below choose what it reads."
        )
        own.add_argument("--json", action="store_true", help="Print JSON, not tables.")
        window = Bounds(0.1, 60, "seconds")
        own.add_argument(
            "--window",
            default="1",
            type=window.check,
            metavar="SECONDS",
            help="Seconds between the two samples GPM occupancy needs "
            f"(default: %(default)s; range {window}).",
        )
    if doctor:
        own = parser.add_argument_group(
            "doctor", "Its own flags; the exporter's flags below say what to check."
        )
        own.add_argument("--json", action="store_true", help="Print JSON, not lines.")
        deadline = Bounds(0.5, 120, "seconds")
        own.add_argument(
            "--timeout",
            default="10",
            type=deadline.check,
            metavar="SECONDS",
            help="Seconds each check may take before it counts as failed (a silent "
            f"socket or API server) (default: %(default)s; range {deadline}).",
        )
    for group in FLAG_GROUPS:
        offered = [f for f in group.flags if not (snapshot and f.name in SERVER_ONLY_FLAGS)]
        section = parser.add_argument_group(group.title, group.description) if offered else None
        for flag in group.flags:
            _add_flag(parser, section, flag, env, snapshot=snapshot)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def _add_flag(
    parser: _Parser,
    section: argparse._ArgumentGroup | None,
    flag: Flag,
    env: Mapping[str, str],
    *,
    snapshot: bool,
) -> None:
    """``flag`` in ``section`` with its variable, which is parsed after argparse, only
    if the flag is not given; a flag of the server alone is not offered by ``snapshot``,
    but parsed as its default."""
    name = _env_name(flag.name)
    dest = flag.name.lstrip("-").replace("-", "_")
    bounds = flag.bounds
    default: object = (
        False if flag.switch else flag.default(env) if callable(flag.default) else flag.default
    )
    if name in env:
        default = _FromEnv(env[name], name)
        if flag.switch:
            parser.from_env[dest] = lambda v: parse_boolean(v.text, v.variable)
        elif bounds is not None:  # named by the variable, not the flag
            parser.from_env[dest] = _variable_in(bounds)
        else:
            parser.from_env[dest] = lambda v: v.text
    if section is None or (snapshot and flag.name in SERVER_ONLY_FLAGS):
        if bounds is not None and isinstance(default, str):
            default = bounds.check(default)
        parser.set_defaults(**{dest: default})
        return
    if flag.switch:
        words = f"{'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}"
        section.add_argument(
            flag.name,
            action="store_true",
            default=default,
            help=f"{flag.help} [env {name}: {words}]",
        )
        return
    help_text = flag.help
    kwargs: dict[str, Any] = {"default": default}
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    if flag.choices is not None:
        kwargs["choices"] = flag.choices
        help_text += " Choices: %(choices)s."
    if bounds is not None:
        kwargs["type"] = bounds.check  # argparse applies it to string defaults too
    # One default per flag: none shown where there is none, or the text says it.
    shown = default not in (None, "") and "default:" not in help_text
    notes = ["default: %(default)s"] if shown else []
    notes += [f"range {bounds}"] if bounds is not None else []
    said = f" ({'; '.join(notes)})" if notes else ""
    section.add_argument(flag.name, help=f"{help_text}{said} [env {name}]", **kwargs)


def parse_boolean(text: str, name: str) -> bool:
    """A boolean variable, strictly: a typo ("yes-please", "ture") is an error, not a
    silent false. Empty is unset (false), as charts render an unset value."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS or not word:
        return False
    raise ConfigError(
        f"{name}: {text!r} is not a boolean; use one of {', '.join(TRUE_WORDS + FALSE_WORDS)}"
    )


def _variable_in(bounds: Bounds) -> Callable[[_FromEnv], float]:
    return lambda value: _check_variable(bounds, value.text, value.variable)


def _check_variable(bounds: Bounds, text: str, name: str) -> float:
    try:
        return bounds.check(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def parse_host_port(
    text: str, flag: str = "--listen", example: str = "0.0.0.0:9445", *, need_host: bool = False
) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` too) -> (host without brackets, port)."""
    host, sep, port_text = text.rpartition(":")
    if (
        not sep
        or not port_text.isdigit()
        or not 0 <= int(port_text) <= 65535
        or (need_host and (not host or int(port_text) == 0))
    ):
        raise ConfigError(f"{flag}: {text!r} is not HOST:PORT (e.g. {example})")
    return host.strip("[]"), int(port_text)


def parse_dcgm_mode(
    text: str,
    *,
    remote_info: str | None = None,
    operator_namespaces: str = "auto",
    named: Callable[[str], str] = lambda flag: flag,
) -> DcgmMode:
    """``auto`` | ``off`` | ``HOST:PORT`` of a DCGM host engine.

    ``remote_info`` is DCGM_REMOTE_HOSTENGINE_INFO (``HOST:PORT``, or ``HOST`` for
    DCGM's default port), ``operator_namespaces`` the --dcgm-operator-namespace list;
    both only shape ``auto``'s search. ``named`` says how an error names a flag: the
    environment variable instead where the value came from there.
    """
    value = text.strip()
    if value.lower() == "off":
        return DcgmMode(kind="off")
    if value.lower() == "auto":
        names = operator_namespaces.strip()
        namespaces = (
            GPU_OPERATOR_NAMESPACES
            if names.lower() == "auto"
            else tuple(n.strip() for n in names.split(",") if n.strip())
        )
        for namespace in namespaces:
            if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", namespace):
                raise ConfigError(
                    f"{named('--dcgm-operator-namespace')}: {namespace!r} is not a namespace name"
                )
        return DcgmMode(
            kind="auto",
            remote_info=_remote_info(remote_info) if remote_info else None,
            operator_namespaces=namespaces,
        )
    try:
        parse_host_port(value, "--dcgm", "localhost:5555", need_host=True)
    except ConfigError:
        raise ConfigError(
            f"{named('--dcgm')} must be 'auto', 'off' or HOST:PORT, got {text!r} "
            "(e.g. localhost:5555)"
        ) from None
    return DcgmMode(kind="hostengine", address=value)


def _remote_info(text: str) -> str:
    """DCGM_REMOTE_HOSTENGINE_INFO as HOST:PORT: DCGM connects a bare HOST to its
    default port (dcgm_agent.h, dcgmConnect), so the port is made explicit."""
    value = text.strip()
    if value and ":" not in value:
        value = f"{value}:{DCGM_HOSTENGINE_PORT}"
    try:
        parse_host_port(value, DCGM_REMOTE_HOSTENGINE_INFO, "nvidia-dcgm:5555", need_host=True)
    except ConfigError:
        raise ConfigError(
            f"{DCGM_REMOTE_HOSTENGINE_INFO}: {text!r} is not HOST:PORT "
            "(e.g. nvidia-dcgm.gpu-operator.svc:5555 or [::1]:5555)"
        ) from None
    return value


KUBE_WRITE_KINDS = ("event", "node_condition", "device_taint_rule")


def parse_kube_writes(value: str, named: str = "--kube-writes") -> frozenset[str]:
    """``on`` (nothing shadowed), ``shadow`` (every kind) or ``shadow=KIND,...``."""
    text = value.strip()
    if text == "on":
        return frozenset()
    if text == "shadow":
        return frozenset(KUBE_WRITE_KINDS)
    head, eq, tail = text.partition("=")
    kinds = {k.strip() for k in tail.split(",") if k.strip()}
    unknown = sorted(kinds - set(KUBE_WRITE_KINDS))
    if head.strip() != "shadow" or not eq or not kinds or unknown:
        raise ConfigError(
            f"{named}: {value!r} is not on, shadow or shadow=KIND,... "
            f"(kinds: {', '.join(KUBE_WRITE_KINDS)})"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
        )
    return frozenset(kinds)


def parse_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Config:
    """Exporter flags; ``snapshot`` or ``doctor`` as the first argument selects that
    subcommand's flags (``doctor`` takes every exporter flag: it checks what the exporter
    with them would use)."""
    env = os.environ if env is None else env
    argv = list(argv)
    snapshot = bool(argv) and argv[0] == "snapshot"
    doctor = bool(argv) and argv[0] == "doctor"
    parser = build_parser(env, snapshot=snapshot, doctor=doctor)
    args = parser.parse_args(argv[1:] if snapshot or doctor else argv)
    parser.resolve_env(args)
    for flag, choices in (
        ("kube_api", ("auto", "off")),
        ("kube_events", ("auto", "off")),
        ("dra_device_taint_effect", ("None", "NoSchedule")),
        ("log_level", LOG_LEVELS),
        ("log_format", ("text", "json")),
    ):
        value = getattr(args, flag)
        if value not in choices:  # an environment variable bypasses argparse's check
            raise ConfigError(
                f"{_env_name('--' + flag.replace('_', '-'))}: {value!r} is not "
                f"one of {', '.join(choices)}"
            )
    kube_writes_shadow = parse_kube_writes(args.kube_writes, parser.named("--kube-writes"))
    if args.simulate and args.simulated_node:
        raise ConfigError(
            "--simulate and --simulated-node both given: pick one (--simulate runs the "
            "whole simulated node in this process)"
        )
    _check_simulated_clock(args)
    for flag in ("--dcgm-bindings-path", "--dcgm-library-path"):
        if getattr(args, flag[2:].replace("-", "_")) == "":
            raise ConfigError(
                f"{parser.named(flag)} is empty: give the directory (an empty path would be "
                "the working directory), or leave the flag out"
            )
    for flag, what in (
        ("--slow-interval", "the slow tier is read"),
        ("--gpm-interval", "a GPM window closes"),
        ("--process-utilization-interval", "the per-process samples are read"),
    ):
        _at_least_interval(args, parser, env, argv, flag, what)
    host, port = parse_host_port(args.listen)
    try:
        classes = args.xid_class or args.xid_severity  # the new name wins
        xid_classes = parse_overrides(classes) if classes else {}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    dcgm = parse_dcgm_mode(
        args.dcgm,
        remote_info=env.get(DCGM_REMOTE_HOSTENGINE_INFO) or None,
        operator_namespaces=args.dcgm_operator_namespace,
        named=parser.named,
    )
    names = tuple(n.strip() for n in args.resource_names.split(",") if n.strip())
    try:
        families = select_families(
            args.families_enable,
            args.families_disable,
            per_process=bool(args.per_process_metrics),
        )
    except FamilySelectionError as exc:
        raise ConfigError(str(exc)) from None
    if not names:
        raise ConfigError("--resource-names: give at least one resource name")
    return Config(
        listen_host=host,
        listen_port=port,
        # numbers: parsed and range-checked by their flags' Bounds (build_parser)
        interval_s=args.interval,
        slow_interval_s=args.slow_interval,
        # a snapshot is one look of about a second: every read at every cycle
        gpm_interval_s=0.0 if snapshot else args.gpm_interval,
        process_utilization_interval_s=0.0 if snapshot else args.process_utilization_interval,
        http_header_timeout_s=args.http_header_timeout,
        http_max_connections=args.http_max_connections,
        liveness_cycles=args.liveness_cycles,
        ready_grace_s=args.ready_grace,
        kube_events=args.kube_events,
        node_condition=bool(args.node_condition),
        dra_device_taints=bool(args.dra_device_taints),
        dra_device_taint_effect=args.dra_device_taint_effect,
        kube_writes_shadow=kube_writes_shadow,
        kube_writer_lease_namespace=args.kube_writer_lease_namespace,
        kube_writer_lease_duration_s=int(args.kube_writer_lease_duration),
        web_config_file=Path(args.web_config_file) if args.web_config_file else None,
        proc_root=Path(args.proc_root),
        cgroup_root=_cgroup_root(args.cgroup_root),
        pod_resources_socket=Path(args.pod_resources_socket),
        pod_resources_interval_s=args.pod_resources_interval,
        resource_names=names,
        node_name=args.node_name,
        kube_api=args.kube_api,
        kubeconfig=args.kubeconfig,
        simulate=args.simulate,
        simulated_node=Path(args.simulated_node) if args.simulated_node else None,
        per_process_metrics=bool(args.per_process_metrics),
        families=families,
        xid_classes=xid_classes,
        health_xid_window_s=args.health_xid_window,
        retired_pages_limit=args.retired_pages_limit,
        idle_threshold=args.idle_threshold,
        why_idle_throttled_ratio=args.why_idle_throttled_ratio,
        why_idle_pressure_ratio=args.why_idle_pressure_ratio,
        orphan_threshold_bytes=int(args.orphan_threshold * 2**20),
        orphan_cycles=args.orphan_cycles,
        deleted_pod_grace_s=args.deleted_pod_grace,
        kmsg=bool(args.kmsg),
        kmsg_path=Path(args.kmsg_path),
        dcgm=dcgm,
        dcgm_bindings_path=args.dcgm_bindings_path,
        dcgm_library_path=args.dcgm_library_path,
        dra_drivers=tuple(d.strip() for d in args.dra_drivers.split(",") if d.strip()),
        capacity_tolerated_taints=tuple(
            k.strip() for k in args.capacity_tolerated_taints.split(",") if k.strip()
        ),
        log_level=args.log_level,
        log_format=args.log_format,
        snapshot=snapshot,
        snapshot_json=snapshot and bool(args.json),
        snapshot_window_s=getattr(args, "window", 1.0),
        doctor=doctor,
        doctor_json=doctor and bool(args.json),
        doctor_timeout_s=getattr(args, "timeout", 10.0),
        simulate_start_s=args.simulate_start,
        simulate_speed=args.simulate_speed,
    )


def _check_simulated_clock(args: argparse.Namespace) -> None:
    """--simulate-start and --simulate-speed set the clock of a simulator in this
    process: without --simulate there is none (a --simulated-node's clock is its own)."""
    if args.simulate or (args.simulate_start == 0 and args.simulate_speed == 1):
        return
    fix = (
        "give them to 'python -m exporter.sim', which owns that node's clock"
        if args.simulated_node
        else "add --simulate SCENARIO"
    )
    raise ConfigError(f"--simulate-start/--simulate-speed move a simulated clock: {fix}")


def _cgroup_root(text: str) -> Path | None:
    """``--cgroup-root``: a path, or ``off`` (also ``''``, as a chart renders unset)."""
    value = text.strip()
    if value.lower() in ("off", ""):
        return None
    return Path(value)


def fail(message: str) -> NoReturn:
    print(f"gpu-occupancy-exporter: error: {message}", file=sys.stderr)
    raise SystemExit(2)
