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
    Case(
        "kubelet-undecodable-answer", "Kubelet", "an answer that cannot be decoded, then good ones"
    ),
    Case(
        "kubelet-unresolvable-device-ids",
        "Kubelet",
        "20,000 advertised device ids that resolve to nothing",
    ),
    Case("source-loop-exception", "Kubelet", "an exception escaping a background source's loop"),
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
    Case("api-garbage-event-stream", "API server", "an endless stream of malformed events"),
    Case("api-bookmark-410-loop", "API server", "BOOKMARK then 410 Gone, over and over"),
    Case("api-huge-watch-line", "API server", "a single 300 MiB watch line"),
    # -- NVML
    Case("nvml-init-fails-then-succeeds", "NVML", "nvmlInit fails, then succeeds"),
    Case("nvml-gpu-lost-and-back", "NVML", "a GPU lost and coming back (new handle, same UUID)"),
    Case("nvml-not-supported-everywhere", "NVML", "NOT_SUPPORTED from every optional call"),
    Case("nvml-no-permission", "NVML", "NO_PERMISSION"),
    Case("nvml-xid-storm", "NVML", "an XID storm of thousands of events"),
    Case("nvml-event-set-error", "NVML", "an event-set error mid-run"),
    Case("nvml-hung-call", "NVML", "an NVML call that never returns"),
    Case("nvml-down-capacity-unknown", "NVML", "NVML down: advertised devices not counted healthy"),
    Case("nvml-gpu-lost-before-start", "NVML", "a GPU lost before the exporter starts"),
    # -- a hardware verdict needs hardware evidence
    Case(
        "nvml-unknown-error-one-query",
        "NVML",
        "one cycle of NVML_ERROR_UNKNOWN from one query (nvmlDeviceGetTemperature)",
    ),
    Case("nvml-binding-type-error", "NVML", "a TypeError inside pynvml for one GPU"),
    Case("nvml-uuid-fails-at-open", "NVML", "a GPU's UUID read fails at its first open"),
    Case(
        "nvml-lost-at-start-then-reset", "NVML", "a GPU lost at start (GPU_IS_LOST), reset at 30 s"
    ),
    Case("nvml-no-permission-at-open", "NVML", "NO_PERMISSION opening a GPU"),
    Case("two-gpus-one-uuid-lost", "NVML", "two GPUs answer one UUID; one is lost, then back"),
    Case("nvml-reset-required", "NVML", "NVML_ERROR_RESET_REQUIRED on a whole GPU; TIMEOUT"),
    Case("lost-gpu-replaced-same-index", "NVML", "a lost GPU replaced by a new UUID at its index"),
    # -- /proc
    Case("proc-unreadable-files", "/proc", "unreadable files"),
    Case("proc-pids-vanish-mid-read", "/proc", "pids vanishing mid-read"),
    Case("proc-50000-pids", "/proc", "50,000 pids"),
    Case("proc-fd-exhaustion", "/proc", "every read fails (file descriptors exhausted)"),
    # -- the cgroup tree (--cgroup-root)
    Case("cgroup-root-missing", "cgroups", "--cgroup-root missing, then mounted"),
    Case("cgroup-huge-number", "cgroups", "a counter of hundreds of digits or Unicode digits"),
    Case("cgroup-fifo", "cgroups", "a FIFO or a device where a cgroup file should be"),
    Case("cgroup-permission-denied", "cgroups", "a pod directory or the root not searchable"),
    Case("cgroup-long-path", "cgroups", "a GPU process's cgroup path longer than PATH_MAX"),
    Case("cgroup-counter-reset", "cgroups", "counters going back (container restarted)"),
    Case("cgroup-over-the-cap", "cgroups", "1,030 GPU containers, over the 1,024 read a cycle"),
    # -- HTTP
    Case("http-200-concurrent-scrapers", "HTTP", "200 concurrent scrapers"),
    Case("http-2000-idle-connections", "HTTP", "2,000 idle or half-sent connections held open"),
    Case("http-oversized-headers", "HTTP", "oversized headers"),
    Case("http-malformed-requests", "HTTP", "malformed requests"),
    Case("http-slow-reader", "HTTP", "a slow reader of a big response"),
    Case("http-unread-responses", "HTTP", "128 connections that never read their answers"),
    Case("http-basic-auth-flood", "HTTP", "a flood of wrong passwords"),
    # -- the process
    Case("process-sigterm-mid-cycle", "Process", "SIGTERM mid-cycle"),
    Case("process-sigint", "Process", "SIGINT"),
    Case("process-port-in-use", "Process", "a second instance on the same port"),
    Case(
        "process-non-root-proc-partly-unreadable",
        "Process",
        "non-root user, /proc partly unreadable",
    ),
    Case("config-bcrypt-cost-ceiling", "Config", "a bcrypt hash of cost 31"),
    Case(
        "config-web-config-hostile-file",
        "Config",
        "a binary, deeply nested or endless web-config file",
    ),
    Case(
        "config-web-config-broken-at-reload", "Config", "the web-config file broken while running"
    ),
    Case("config-non-finite-flags", "Config", "non-finite or out-of-range numeric flags"),
    Case(
        "config-unknown-boolean", "Config", "a boolean environment variable with an unknown value"
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
    Case("data-capacity-kubelet-down", "Data", "kubelet down: nothing counted allocatable"),
    # -- what the exporter writes to Kubernetes (Events, node condition, DeviceTaintRules)
    Case("kube-writes-api-down", "Kubernetes writes", "the API server down while Events are due"),
    Case("kube-writes-403", "Kubernetes writes", "403 Forbidden on every write (RBAC missing)"),
    Case("kube-writes-slow", "Kubernetes writes", "writes answered 1 s late"),
    Case("kube-writes-hang", "Kubernetes writes", "a write the API server never answers"),
    Case(
        "kube-writes-condition-nvml-down",
        "Kubernetes writes",
        "NVML down under a GPUUnhealthy node condition left True",
    ),
    Case(
        "kube-writes-no-device-taint-api",
        "Kubernetes writes",
        "--dra-device-taints on a cluster without the DeviceTaintRule API",
    ),
    # -- alerts: critical alerts hold through the exporter's absence
    Case(
        "exporter-killed-during-critical-alert",
        "Alerts",
        "the exporter SIGKILLed while critical alerts fire (Prometheus -> Alertmanager)",
    ),
    Case("fatal-xid-pages-once", "Alerts", "a fatal XID 79, the GPU then lost"),
    Case(
        "exporter-crash-looping-on-unhealthy-gpu",
        "Alerts",
        "the exporter crash-looping (up 0 0 0 0 1) on a lost GPU, or dead inside its for:",
    ),
    # -- leaks (not listed by the kubelet is unknown, not unallocated)
    Case(
        "kubelet-restart-empty-list",
        "Kubelet",
        "a kubelet just restarted answers List with no pods (20 s)",
    ),
    Case(
        "new-pod-before-allocation-refresh",
        "Kubelet",
        "a pod's GPU process seen before the next PodResources answer",
    ),
    Case("init-container-uses-gpu", "Kubelet", "an init container runs on a GPU"),
    Case(
        "dra-claims-not-reported",
        "Kubelet",
        "DRA pods on a kubelet without KubeletPodResourcesDynamicResources",
    ),
    Case(
        "gpu-under-unlisted-resource-name",
        "Kubelet",
        "GPUs allocated under a resource name outside --resource-names",
    ),
    Case("mps-control-daemon", "Kubelet", "the device plugin's MPS daemon on shared GPUs"),
    Case(
        "operator-cuda-validator",
        "Kubelet",
        "the GPU Operator's nvidia-cuda-validator (vectorAdd in an init container)",
    ),
    # -- static pods and clocks: no false Warning from a UID or a clock step
    Case(
        "static-pod-uses-gpu",
        "Kubernetes writes",
        "a static pod using a GPU (its mirror pod's UID is not its cgroup's)",
    ),
    Case(
        "wall-clock-steps-after-fatal-xid",
        "Kubernetes writes",
        "the wall clock steps +2 h 20 s (and back) after a fatal XID",
    ),
    Case(
        "node-clock-ahead-of-api-server",
        "Kubernetes writes",
        "the node's clock 3 min ahead of the API server during a pod's graceful stop",
    ),
    Case(
        "terminating-pod-across-wall-clock-step",
        "Kubernetes writes",
        "the wall clock steps 2 h either way during a pod's graceful stop",
    ),
    Case(
        "terminating-pod-without-a-usable-date",
        "Kubernetes writes",
        "the API server's Date header absent, garbage or a year off during a pod's "
        "graceful stop, the node's clock 3 min ahead",
    ),
    Case(
        "writer-hold-survives-wall-clock-step",
        "Kubernetes writes",
        "the wall clock steps +2 h while an earlier run's True condition is held",
    ),
    # -- one writer per node (the writer Lease)
    Case(
        "two-exporters-one-node",
        "Kubernetes writes",
        "two exporters on one node (a rolling update with maxSurge, two releases)",
    ),
    Case(
        "writer-lease-api-refused",
        "Kubernetes writes",
        "the writer Lease refused (403: the RBAC for leases missing)",
    ),
    Case(
        "writer-lease-api-unreachable",
        "Kubernetes writes",
        "the writer Lease API answers 500 for good, the rest of the API server up",
    ),
    Case(
        "writer-lease-outage-keeps-warnings",
        "Kubernetes writes",
        "the writer Lease API answers 500 for 60 s across a fatal XID, holder and standby",
    ),
    # -- writer (taint ownership, write budgets)
    Case(
        "taint-on-replaced-gpu",
        "Kubernetes writes",
        "a tainted GPU replaced (same minor and DRA device name, new UUID)",
    ),
    Case(
        "taints-after-mig-recreated",
        "Kubernetes writes",
        "a MIG GPU reset and its layout re-created (new MIG UUIDs, same device names)",
    ),
    Case(
        "flapping-gpu-write-budget",
        "Kubernetes writes",
        "a GPU unhealthy every other cycle at --interval 1 (condition and taints on)",
    ),
    Case(
        "taint-on-renamed-dra-device",
        "Kubernetes writes",
        "a tainted GPU's DRA device renamed (the driver renumbers gpu-2 and gpu-0)",
    ),
)

BY_ID = {case.id: case for case in CASES}
