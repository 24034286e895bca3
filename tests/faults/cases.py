"""The fault matrix: every fault the exporter must survive, one row each.

Each case has exactly one test in ``tests/faults/`` that drives the fault through the
real code path, asserts the expected behaviour (so it fails if that regresses) and
records what it measured with the ``record_fault`` fixture. ``tests/faults/report.py``
runs the suite and writes the table in ``docs/reliability.md`` from those records;
``test_matrix_complete.py`` fails while a case here has no test, or a test records a
case that is not here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    id: str
    area: str
    fault: str


CASES: tuple[Case, ...] = (
    # -- the kubelet's PodResources socket
    Case("kubelet-socket-missing-at-start", "Kubelet", "socket missing at start"),
    Case("kubelet-socket-appears-later", "Kubelet", "socket appears later"),
    Case("kubelet-restart", "Kubelet", "socket removed and recreated (kubelet restart)"),
    Case("kubelet-never-answers", "Kubelet", "accepts and never answers"),
    Case("kubelet-garbage-bytes", "Kubelet", "answers garbage bytes"),
    Case("kubelet-100mib-response", "Kubelet", "a 100 MiB response"),
    Case("kubelet-permission-denied", "Kubelet", "permission denied on the socket"),
    # -- the Kubernetes API server (pod and ResourceSlice watches)
    Case("api-unreachable", "API server", "unreachable"),
    Case("api-401", "API server", "401 Unauthorized"),
    Case("api-403", "API server", "403 Forbidden"),
    Case("api-410-gone", "API server", "410 Gone on a watch"),
    Case("api-watch-drops", "API server", "a watch that drops every second"),
    Case("api-malformed-events", "API server", "malformed watch events"),
    Case(
        "api-pod-recreated-same-name",
        "API server",
        "a pod deleted and recreated with the same name",
    ),
    # -- NVML
    Case("nvml-init-fails-then-succeeds", "NVML", "nvmlInit fails, then succeeds"),
    Case("nvml-gpu-lost-and-back", "NVML", "a GPU lost and coming back (new handle, same UUID)"),
    Case("nvml-not-supported-everywhere", "NVML", "NOT_SUPPORTED from every optional call"),
    Case("nvml-no-permission", "NVML", "NO_PERMISSION"),
    Case("nvml-xid-storm", "NVML", "an XID storm of thousands of events"),
    Case("nvml-event-set-error", "NVML", "an event-set error mid-run"),
    # -- /proc
    Case("proc-unreadable-files", "/proc", "unreadable files"),
    Case("proc-pids-vanish-mid-read", "/proc", "pids vanishing mid-read"),
    Case("proc-50000-pids", "/proc", "50,000 pids"),
    # -- HTTP
    Case("http-200-concurrent-scrapers", "HTTP", "200 concurrent scrapers"),
    Case("http-2000-idle-connections", "HTTP", "2,000 idle or half-sent connections held open"),
    Case("http-oversized-headers", "HTTP", "oversized headers"),
    Case("http-malformed-requests", "HTTP", "malformed requests"),
    Case("http-slow-reader", "HTTP", "a slow reader of a big response"),
    # -- the process
    Case("process-sigterm-mid-cycle", "Process", "SIGTERM mid-cycle"),
    Case("process-sigint", "Process", "SIGINT"),
    Case("process-port-in-use", "Process", "a second instance on the same port"),
    Case(
        "process-non-root-proc-partly-unreadable",
        "Process",
        "non-root user, /proc partly unreadable",
    ),
    # -- what the data says during faults
    Case("data-xid-while-kubelet-down", "Data", "an XID raised while the kubelet is down"),
    Case("data-xid-during-slow-cycle", "Data", "an XID raised while a cycle is slow"),
    Case("data-lost-gpu-not-fresh", "Data", "a lost GPU's series are not served as if fresh"),
    Case(
        "data-source-outage-no-false-alerts",
        "Data",
        "each source outage vs. the orphan and leak alerts",
    ),
)

BY_ID = {case.id: case for case in CASES}
