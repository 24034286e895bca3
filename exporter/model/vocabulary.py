"""The domain's words that several layers share: kubelet and DRA names, setting types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

KUBELET_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
# A static pod's mirror pod carries the kubelet's UID of the pod (its config hash) in
# this annotation (kubetypes.ConfigMirrorAnnotationKey, pkg/kubelet/types/pod_update.go;
# set by CreateMirrorPod, pkg/kubelet/pod/mirror_client.go).
MIRROR_POD_ANNOTATION: Final = "kubernetes.io/config.mirror"


# Extended resources NVIDIA's device plugin (and GKE's: nvidia.com/gpu) advertises GPUs
# under; a trailing * matches a prefix (MIG resources are open-ended).
GPU_RESOURCE_NAMES: tuple[str, ...] = (
    "nvidia.com/gpu",
    "nvidia.com/gpu.shared",
    "nvidia.com/mig-*",
)


# DRA drivers whose devices are GPUs (NVIDIA's k8s-dra-driver-gpu).
GPU_DRA_DRIVERS: tuple[str, ...] = ("gpu.nvidia.com",)

# Why a healthy, unallocated device is no capacity now (gpu_node_disrupted_devices{reason},
# docs/capacity.md): the node is cordoned (spec.unschedulable, or the
# node.kubernetes.io/unschedulable taint the API server adds with it); a NoSchedule or
# NoExecute taint on the Node that GPU pods are not known to tolerate; a NoSchedule or
# NoExecute taint on the DRA device itself; the GPU Operator upgrading the node's driver.
DISRUPTION_REASONS: tuple[str, ...] = ("cordoned", "node_taint", "device_taint", "driver_upgrade")
# The GPU Operator's driver upgrade state label, and the states in which the node stays in
# service: NVIDIA/k8s-operator-libs pkg/upgrade/consts.go (UpgradeStateLabelKeyFmt with
# the driver name "gpu"; UpgradeStateUnknown "", UpgradeStateUpgradeRequired "No actions
# are performed at this stage", UpgradeStateDone). Every other value (cordon-required,
# wait-for-jobs-required, pod-deletion-required, drain-required, node-maintenance-required,
# post-maintenance-required, pod-restart-required, validation-required, uncordon-required,
# upgrade-failed, or one a newer operator adds) takes the node out of service.
DRIVER_UPGRADE_STATE_LABEL = "nvidia.com/gpu-driver-upgrade-state"
DRIVER_UPGRADE_IN_SERVICE: frozenset[str] = frozenset({"", "upgrade-required", "upgrade-done"})


# nv-hostengine's port (DCGM_HE_PORT_NUMBER), also the GPU Operator's nvidia-dcgm Service port.
DCGM_HOSTENGINE_PORT: Final = 5555
# The NVML slow tier's default period (--slow-interval; the tiers themselves are listed in
# exporter/sources/nvml_cadence.py): facts that change in weeks, read twice a minute.
DEFAULT_SLOW_INTERVAL_S: Final = 30.0
# --gpm-interval and --process-utilization-interval (exporter/sources/nvml_cadence.py)
DEFAULT_GPM_INTERVAL_S: Final = 10.0
DEFAULT_PROCESS_UTILIZATION_INTERVAL_S: Final = 10.0
# Where the GPU Operator is installed by default: its Helm chart's documented namespace,
# and the one OperatorHub suggests on OpenShift (gpu-operator README.md, bundle CSV).
GPU_OPERATOR_NAMESPACES: tuple[str, ...] = ("gpu-operator", "nvidia-gpu-operator")


@dataclass(frozen=True, slots=True)
class DcgmMode:
    """A parsed ``--dcgm`` value: never, where available, or a named host engine."""

    kind: Literal["off", "auto", "hostengine"]
    address: str | None = None  # "HOST:PORT" when kind is "hostengine"
    # auto only: DCGM_REMOTE_HOSTENGINE_INFO ("HOST:PORT"), as dcgm-exporter reads it
    remote_info: str | None = None
    # auto only: namespaces whose GPU Operator ``nvidia-dcgm`` Service may serve this node
    operator_namespaces: tuple[str, ...] = GPU_OPERATOR_NAMESPACES

    @property
    def hostengines(self) -> tuple[str, ...]:
        """Host engines to try, in order; ``auto`` starts an embedded one only after them.

        ``auto``: the one DCGM_REMOTE_HOSTENGINE_INFO names, then the GPU Operator's
        ``nvidia-dcgm`` Service (``internalTrafficPolicy: Local``: this node's host
        engine, reachable without hostNetwork), then one on this host's loopback.
        """
        if self.kind == "hostengine" and self.address:
            return (self.address,)
        if self.kind != "auto":
            return ()
        found = [self.remote_info] if self.remote_info else []
        found += [f"nvidia-dcgm.{ns}.svc:{DCGM_HOSTENGINE_PORT}" for ns in self.operator_namespaces]
        found.append(f"127.0.0.1:{DCGM_HOSTENGINE_PORT}")
        return tuple(dict.fromkeys(found))


# What GPU Performance Monitoring (NVML GPM) and DCGM's profiling fields measure: the
# fields of readings.Occupancy, served as gpu_<field>_ratio. One list for the NVML and
# DCGM sources, the exposition and the simulated library.
OccupancyField = Literal[
    "graphics_active",
    "sm_active",
    "sm_occupancy",
    "tensor_active",
    "dram_active",
    "fp64_active",
    "fp32_active",
    "fp16_active",
]
OCCUPANCY_FIELDS: Final[tuple[OccupancyField, ...]] = get_args(OccupancyField)

# NVIDIA's device plugin names a time-sliced or MPS replica <uuid>::<replica>
# (k8s-device-plugin internal/rm/devices.go "%s::%d"; docs/attribution.md).
REPLICA_SEPARATOR: Final = "::"

# The states of the GPU-hour ledger (analysis/ledger.py, docs/metrics.md): what an
# allocation's held time was spent on; the states of one allocation sum to its time held.
LedgerStateName = Literal["busy", "idle", "no_process", "unhealthy", "unknown"]
LEDGER_STATES: Final[tuple[LedgerStateName, ...]] = get_args(LedgerStateName)

# Likely causes of an allocation's idle and no_process time (analysis/why_idle.py,
# docs/why-idle.md), first that applies; a correlation with its container's cgroup
# counters over the same window, not a proof. ``unknown``: no cause seen, or no reading.
IdleCause = Literal["cpu_throttled", "cpu_pressure", "io_pressure", "unknown"]
IDLE_CAUSES: Final[tuple[IdleCause, ...]] = get_args(IdleCause)

# NVML process listings: nvmlDeviceGet{Compute,Graphics,MPSCompute}RunningProcesses
ProcessKind = Literal["compute", "graphics", "mps"]

# Who owns a GPU process (analysis/attribution.py)
Owner = Literal["pod", "host", "unknown", "dead"]
OWNER_POD: Final = "pod"  # a container of a pod on this node
OWNER_HOST: Final = "host"  # outside kubepods (a daemon, a user on the node)
OWNER_UNKNOWN: Final = "unknown"  # in kubepods, but the pod or container cannot be named
OWNER_DEAD: Final = "dead"  # NVML lists it, /proc does not

# Kinds of orphaned GPU memory (analysis/orphans.py, docs/orphans.md)
OrphanKind = Literal["dead_process", "deleted_pod", "stuck_process", "unattributed"]
KIND_DEAD_PROCESS: Final = "dead_process"
KIND_DELETED_POD: Final = "deleted_pod"
KIND_STUCK_PROCESS: Final = "stuck_process"
KIND_UNATTRIBUTED: Final = "unattributed"
ORPHAN_KINDS: Final = (KIND_DEAD_PROCESS, KIND_DELETED_POD, KIND_STUCK_PROCESS, KIND_UNATTRIBUTED)

# What a pid holding /dev/nvidia<N> does (sources/holders.py)
HolderRole = Literal["holder", "management"]
ROLE_HOLDER: Final = "holder"  # may keep memory alive (e.g. a forked child)
ROLE_MANAGEMENT: Final = "management"  # opens every GPU, allocates nothing (a daemon)

# The sources, as gpu_exporter_source_up{source} and gpu_exporter_errors{source} name them
SourceName = Literal[
    "nvml",
    "dcgm",
    "procfs",
    "holders",
    "xid",
    "kmsg",
    "podresources",
    "kube",
    "resourceslices",
    "node",
    "devicetaintrules",
    "cgroups",
]

TransitionKind = Literal[
    "gpu_lost",  # NVML answers GPU_IS_LOST or RESET_REQUIRED for a GPU (hardware evidence)
    "gpu_back",  # a lost GPU answers again
    "fatal_xid",  # fatal-class XIDs were raised since the last cycle
    "gpu_unhealthy",  # the verdict gained a reason that makes the GPU unhealthy
    "gpu_healthy",  # an unhealthy GPU's verdict is healthy again
    "isolation_leak",  # a container uses a GPU it was not allocated
    "orphaned_memory",  # GPU memory no running pod can free appeared
    "orphaned_memory_cleared",  # ... and is gone
    "source_down",  # a source stopped giving evidence
    "source_up",  # ... and gives it again
]
TRANSITION_KINDS: tuple[TransitionKind, ...] = (
    "gpu_lost",
    "gpu_back",
    "fatal_xid",
    "gpu_unhealthy",
    "gpu_healthy",
    "isolation_leak",
    "orphaned_memory",
    "orphaned_memory_cleared",
    "source_down",
    "source_up",
)

# /healthz fails when no cycle completed for this many intervals (--liveness-cycles),
# and never within the start-up grace: priming the sources and a first nvmlInit can
# take tens of seconds (exporter/exposition/liveness.py).
LIVENESS_DEFAULT_CYCLES: Final = 10
LIVENESS_MIN_CYCLES: Final = 2
LIVENESS_MAX_CYCLES: Final = 1000
LIVENESS_STARTUP_GRACE_S: Final = 60.0
# /readyz fails once the exporter has not seen the node's GPUs for this long
# (--ready-grace, exporter/exposition/readiness.py): a driver container or a first
# nvmlInit may take a minute on a node that has just booted.
DEFAULT_READY_GRACE_S: Final = 60.0


# --simulate-start and --simulate-speed (the simulator's clock, exporter/sim/node.py
# monotonic_clock): a start up to a week into a scenario; at most 100 simulated seconds
# per real one (beyond it a 5 s sample cycle would skip whole minutes of the timeline),
# at least 0.1.
SIMULATE_START_MAX_S: Final = 7 * 86400.0
SIMULATE_SPEED_MIN: Final = 0.1
SIMULATE_SPEED_MAX: Final = 100.0
