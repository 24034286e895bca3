"""The simulated node's state over time: a scenario plus a clock and its timeline.

Everything the simulator exposes (the NVML library object, the proc tree, the
PodResources server, the Kubernetes API stand-in) reads this one object, so the views
always agree. The timeline is applied lazily whenever someone looks (``advance``).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from exporter.model import AllocatableDevices, ContainerDevices
from exporter.sim.scenario import (
    GPM_METRICS,
    Scenario,
    ScenarioError,
    SimContainer,
    SimEvent,
    SimGpu,
    SimPod,
    SimProcess,
    derived_container_id,
    derived_uuid,
    parse_size,
)

GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class XidRecord:
    """An XID the simulated driver raised, for the event-set API."""

    seq: int
    at: float
    gpu: int
    code: int
    gpu_instance_id: int
    compute_instance_id: int


class ManualClock:
    """A clock tests move by hand, so the timeline is deterministic."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def monotonic_clock() -> Callable[[], float]:
    """Seconds since the simulation started, on the real clock."""
    start = time.monotonic()
    return lambda: time.monotonic() - start


class SimNode:
    def __init__(self, scenario: Scenario, clock: Callable[[], float] | None = None) -> None:
        self.scenario = copy.deepcopy(scenario)
        self.clock = clock or monotonic_clock()
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.xids: list[XidRecord] = []
        self._next_event = 0
        self._pid_seq = 90_000
        # GPM counters: per GPU, per metric, the time integral of the percentage, like
        # hardware counters that only ever grow; metrics are their slope between samples.
        self.gpm_integral: dict[tuple[int, int | None], dict[str, float]] = {
            (gpu.index, slot): dict.fromkeys(GPM_METRICS, 0.0)
            for gpu in self.scenario.gpus
            for slot in [None, *range(len(gpu.mig))]
        }
        self._integrated_to = self.clock()
        # Epoch seconds at simulated time 0, so API timestamps read like real ones.
        self.epoch = time.time() - self.clock()

    # -- time -------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock()

    def wall_time(self, at: float | None = None) -> float:
        """Epoch seconds of simulated time ``at`` (default: now)."""
        return self.epoch + (self.clock() if at is None else at)

    def advance(self) -> None:
        """Apply every timeline event that is due.

        GPM counters are integrated up to each event (the values are piecewise constant
        between events), and up to "now" only when a GPM sample is taken, so ordinary
        NVML calls stay cheap.
        """
        with self.lock:
            now = self.clock()
            timeline = self.scenario.timeline
            applied = False
            while self._next_event < len(timeline) and timeline[self._next_event].at <= now:
                self._integrate(max(timeline[self._next_event].at, self._integrated_to))
                self._apply(timeline[self._next_event])
                self._next_event += 1
                applied = True
            if applied:
                self.changed.notify_all()

    def gpm_counters(self, gpu: int, slot: int | None) -> dict[str, float]:
        """The GPM counters of a GPU (or MIG slot) as of now."""
        with self.lock:
            self.advance()
            self._integrate(self.clock())
            return dict(self.gpm_integral[(gpu, slot)])

    def _integrate(self, until: float) -> None:
        dt = until - self._integrated_to
        if dt <= 0:
            return
        for (index, slot), acc in self.gpm_integral.items():
            for metric, percent in self.gpm_percent(self.gpus[index], slot).items():
                acc[metric] += percent * dt
        self._integrated_to = until

    def gpm_percent(self, gpu: SimGpu, slot: int | None = None) -> dict[str, float]:
        """Current GPM percentages of a GPU (or one MIG instance): scenario values for the
        whole GPU, else derived from the SM shares of the processes running there."""
        procs = [
            p
            for p in self.listed_processes(gpu.index)
            if p.alive and (slot is None or p.mig == slot)
        ]
        sm = float(min(100, sum(p.sm for p in procs)))
        derived = {
            "graphics": float(self.utilization_gpu(gpu)),
            "sm_active": sm,
            "sm_occupancy": sm * 0.6,
            "tensor_active": sm * 0.5,
            "dram_active": sm * 0.3,
            "fp64_active": 0.0,
            "fp32_active": sm * 0.2,
            "fp16_active": sm * 0.1,
        }
        return derived if slot is not None else {**derived, **gpu.gpm}

    # -- views ------------------------------------------------------------------------

    @property
    def gpus(self) -> list[SimGpu]:
        return self.scenario.gpus

    @property
    def processes(self) -> list[SimProcess]:
        return self.scenario.processes

    @property
    def pods(self) -> list[SimPod]:
        return self.scenario.pods

    def resolve_device(self, ref: str) -> str:
        """Turn ``gpu3``, ``gpu1/mig0`` or ``gpu2::1`` into the kubelet's device id."""
        base, _, replica = ref.partition("::")
        gpu_part, _, mig_part = base.partition("/")
        if not gpu_part.startswith("gpu"):
            return ref  # a literal device id
        try:
            gpu = self.gpus[int(gpu_part[3:])]
            device = gpu.mig[int(mig_part[3:])].uuid if mig_part else gpu.uuid
        except (ValueError, IndexError) as exc:
            raise ScenarioError(f"device reference {ref!r} names no GPU/MIG instance") from exc
        return f"{device}::{replica}" if replica else device

    def container_devices(self) -> list[ContainerDevices]:
        with self.lock:
            self.advance()
            return [
                ContainerDevices(
                    pod.namespace,
                    pod.name,
                    c.name,
                    resource,
                    tuple(self.resolve_device(ref) for ref in refs),
                )
                for pod in self.pods
                for c in pod.containers
                for resource, refs in c.devices.items()
            ]

    def allocatable_devices(self) -> list[AllocatableDevices]:
        """What the device plugin advertises: whole GPUs, MIG instances by profile, and
        replicas of time-sliced GPUs (at least 4, more if the pods use more)."""
        with self.lock:
            self.advance()
            by_resource: dict[str, list[str]] = {GPU_RESOURCE: []}
            used = {d for cd in self.container_devices() for d in cd.device_ids}
            for gpu in self.gpus:
                replicas = [
                    int(d.rpartition("::")[2]) for d in used if d.startswith(f"{gpu.uuid}::")
                ]
                if gpu.mig:
                    for m in gpu.mig:
                        by_resource.setdefault(f"nvidia.com/mig-{m.profile}", []).append(m.uuid)
                elif replicas:
                    count = max(4, max(replicas) + 1)
                    by_resource.setdefault("nvidia.com/gpu.shared", []).extend(
                        f"{gpu.uuid}::{r}" for r in range(count)
                    )
                else:
                    by_resource[GPU_RESOURCE].append(gpu.uuid)
            return [AllocatableDevices(r, tuple(ids)) for r, ids in by_resource.items()]

    def listed_processes(self, gpu: int) -> list[SimProcess]:
        return [p for p in self.processes if p.listed and (p.gpu == gpu or gpu in p.extra_gpus)]

    def memory_used(self, gpu: SimGpu) -> int:
        """Device memory in use, v2 semantics (driver-reserved memory excluded)."""
        listed = sum(p.memory for p in self.processes if p.gpu == gpu.index)
        return min(listed + gpu.unaccounted_memory, gpu.memory_total - gpu.memory_reserved)

    def utilization_gpu(self, gpu: SimGpu) -> int:
        if gpu.utilization_gpu is not None:
            return gpu.utilization_gpu
        busy = [p.sm for p in self.listed_processes(gpu.index) if p.sm > 0]
        return min(100, max(busy) + 5 * (len(busy) - 1)) if busy else 0

    # -- timeline ---------------------------------------------------------------------

    def _process(self, pid: object) -> SimProcess:
        for proc in self.processes:
            if proc.pid == pid:
                return proc
        raise ScenarioError(f"timeline names pid {pid!r}, which the scenario does not have")

    def _pod(self, key: object) -> SimPod:
        for pod in self.pods:
            if f"{pod.namespace}/{pod.name}" == key:
                return pod
        raise ScenarioError(f"timeline names pod {key!r}, which the scenario does not have")

    def _apply(self, event: SimEvent) -> None:
        args = event.args
        value = args.get("value")
        if event.action == "exit":  # clean exit: memory freed, gone everywhere
            proc = self._process(value)
            self.scenario.processes.remove(proc)
        elif event.action == "kill":  # SIGKILL, memory still held and still listed
            proc = self._process(value)
            proc.alive = False
            proc.sm = 0
        elif event.action == "orphan":  # gone from /proc and NVML, memory stays
            proc = self._process(value)
            self.scenario.processes.remove(proc)
            self.gpus[proc.gpu].unaccounted_memory += proc.memory
        elif event.action == "set":
            gpu = self.gpus[int(args.pop("gpu"))]
            for key, val in args.items():
                if not hasattr(gpu, key):
                    raise ScenarioError(f"timeline set: GPU has no field {key!r}")
                sized = key in {"memory_total", "memory_reserved", "unaccounted_memory"}
                setattr(gpu, key, parse_size(val, f"timeline set {key}") if sized else val)
        elif event.action == "set_process":
            proc = self._process(args.pop("pid"))
            for key, val in args.items():
                setattr(proc, key, parse_size(val, key) if key == "memory" else val)
        elif event.action == "start":
            self._start(args)
        elif event.action == "lose":
            self.gpus[int(str(value))].lost = True
        elif event.action == "xid":
            self.xids.append(
                XidRecord(
                    seq=len(self.xids) + 1,
                    at=event.at,
                    gpu=int(args["gpu"]),
                    code=int(args["code"]),
                    gpu_instance_id=int(args.get("gpu_instance_id", 0xFFFFFFFF)),
                    compute_instance_id=int(args.get("compute_instance_id", 0xFFFFFFFF)),
                )
            )
        elif event.action == "delete_pod":
            self.scenario.pods.remove(self._pod(value))
        elif event.action == "set_pod_phase":
            self._pod(args["pod"]).phase = str(args["phase"])
        elif event.action == "add_pod":
            self._add_pod(args)
        elif event.action == "fork_orphan":
            self._fork_orphan(args)
        elif event.action == "terminate_pod":  # deletion requested, containers still run
            pod = self._pod(args.get("pod", value))
            grace = float(args.get("grace_s", 30))
            pod.deletion_at = event.at + grace  # the API sets request time + grace

    def _fork_orphan(self, args: dict[str, object]) -> None:
        """The parent dies after forking: it leaves /proc and NVML, its memory stays
        (no listed process accounts for it) and the child keeps the device files open."""
        parent = self._process(args["pid"])
        self.scenario.processes.remove(parent)
        self.gpus[parent.gpu].unaccounted_memory += parent.memory
        self._pid_seq += 13
        self.scenario.processes.append(
            SimProcess(
                pid=int(args.get("child_pid", self._pid_seq)),  # type: ignore[call-overload]
                gpu=parent.gpu,
                memory=0,
                sm=0,
                kind=parent.kind,
                comm=str(args.get("comm", parent.comm)),
                listed=False,
                pod=parent.pod,
                container=parent.container,
                holds_devices=(
                    parent.holds_devices
                    if parent.holds_devices is not None
                    else [parent.gpu, *parent.extra_gpus]
                ),
            )
        )

    def _start(self, args: dict[str, object]) -> None:
        self._pid_seq += 13
        pod = args.get("pod")
        self.scenario.processes.append(
            SimProcess(
                pid=int(args.get("pid", self._pid_seq)),  # type: ignore[call-overload]
                gpu=int(args["gpu"]),  # type: ignore[call-overload]
                memory=parse_size(args.get("memory", 0), "start.memory"),
                sm=int(args.get("sm", 0)),  # type: ignore[call-overload]
                kind=str(args.get("kind", "compute")),
                comm=str(args.get("comm", "python3")),
                pod=str(pod) if pod else None,
                container=str(args["container"]) if args.get("container") else None,
            )
        )

    def _add_pod(self, args: dict[str, object]) -> None:
        namespace, name = str(args["pod"]).split("/", 1)
        key = f"{namespace}/{name}"
        containers = [
            SimContainer(
                str(c["name"]),
                derived_container_id(self.scenario.node_name, key, c["name"]),
                {k: list(v) for k, v in c.get("devices", {}).items()},
            )
            for c in args.get("containers", [])  # type: ignore[attr-defined]
        ]
        self.scenario.pods.append(
            SimPod(
                namespace,
                name,
                derived_uuid(self.scenario.node_name, "pod", key),
                str(args.get("qos", "burstable")),
                "Running",
                containers,
            )
        )
