"""The simulated node's state over time: a scenario plus a clock and its timeline.

Everything the simulator exposes (the NVML library object, the proc tree, the
PodResources server, the Kubernetes API stand-in) reads this one object, so the views
always agree. The timeline is applied lazily whenever someone looks (``advance``).
"""

from __future__ import annotations

import copy
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from exporter.model import REPLICA_SEPARATOR, AllocatableDevices, ClaimDevice, ContainerDevices
from exporter.sim.events import SimEvent
from exporter.sim.scenario import (
    GPM_METRICS,
    Scenario,
    ScenarioError,
    SimContainer,
    SimDuty,
    SimGpu,
    SimMig,
    SimPod,
    SimProcess,
    derived_container_id,
    derived_uuid,
    parse_migs,
    parse_size,
)
from exporter.sim.wakeups import Wakers

GPU_RESOURCE = "nvidia.com/gpu"
SHARED_RESOURCE = "nvidia.com/gpu.shared"
DRA_DRIVER = "gpu.nvidia.com"  # NVIDIA's DRA driver (k8s-dra-driver-gpu)
DRA_API_VERSION = "resource.k8s.io/v1"
MIN_REPLICAS = 4  # replicas a time-shared GPU advertises when the pods use fewer
# /proc start times: the simulated node booted ~5 hours before simulated time 0, and the
# kernel counts in USER_HZ ticks (100 per second on every architecture Linux ships).
BOOT_TICKS = 1_843_265
USER_HZ = 100
# GPU-instance profile ids (nvidia-smi mig -lgip "ID") by slice count; the DRA driver
# names MIG devices by them. 1g.<2x memory> (REV2) is 15 and +me profiles are 20.
_GI_PROFILE_IDS = {1: 19, 2: 14, 3: 9, 4: 5, 7: 0}
# Memory slices a GPU instance of N compute slices spans, and so its placement stride.
_PLACEMENT_SPAN = {1: 1, 2: 2, 3: 4, 4: 4, 7: 8}
_MEMORY_SLICES = 8
# Clock-event bits (NVML nvmlClocksEventReason*) during which each simulated duration
# counter grows, by the counter's reason: the six performance-policy counters
# (NVML_FI_DEV_PERF_POLICY_*) and R580's per-reason ones. "thermal" is any thermal
# slowdown; low utilisation is modelled as the GPU-idle bit; board limit and reliability
# have no bit here (R615 added theirs) and stay 0.
CLOCK_EVENT_BITS = {
    "sw_power_cap": 0x4,
    "thermal": 0x20 | 0x40,
    "sync_boost": 0x10,
    "board_limit": 0,
    "low_utilization": 0x1,
    "reliability": 0,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
}
_ARCHITECTURES = (  # (name substring, NVML architecture name, CUDA compute capability)
    ("B200", "Blackwell", "10.0.0"),
    ("H100", "Hopper", "9.0.0"),
    ("H200", "Hopper", "9.0.0"),
    ("L40", "Ada Lovelace", "8.9.0"),
    ("L4", "Ada Lovelace", "8.9.0"),
    ("A100", "Ampere", "8.0.0"),
    ("A10", "Ampere", "8.6.0"),
    ("T4", "Turing", "7.5.0"),
    ("V100", "Volta", "7.0.0"),
)


@dataclass(frozen=True)
class DeviceReference:
    """A scenario's ``gpuN``, ``gpuN/migM`` or ``gpuN[/migM]::k`` (replica k)."""

    ref: str
    gpu: SimGpu
    mig: SimMig | None
    replica: int | None

    @property
    def shared(self) -> bool:
        return self.replica is not None


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


def monotonic_clock(
    start_s: float = 0.0, speed: float = 1.0, *, origin: float | None = None
) -> Callable[[], float]:
    """Simulated seconds on the real clock: ``start_s`` at ``origin`` (a
    ``time.monotonic()`` reading; default now), then ``speed`` simulated seconds per real
    second (``--simulate-start``, ``--simulate-speed``: a demo need not wait for its
    story). Every simulated counter is a function of this one clock, so a start offset or
    a speed moves them all together and none ever runs backwards."""
    t0 = time.monotonic() if origin is None else origin
    clock = lambda: start_s + (time.monotonic() - t0) * speed  # noqa: E731
    _RUNNING_ALONE[clock] = speed
    return clock


# Clocks made by monotonic_clock(), with their speed: nobody moves them, so a wait for
# the timeline's next event can sleep until it is due. Any other (a test's ManualClock,
# another process's SharedClock) is looked at again now and then (nvml_library.py,
# EVENT_WAIT_STEP_S).
_RUNNING_ALONE: weakref.WeakKeyDictionary[Callable[[], float], float] = weakref.WeakKeyDictionary()


def speed_alone(clock: Callable[[], float]) -> float | None:
    """Simulated seconds per real second of a clock that moves only with real time
    (``monotonic_clock``); None for a clock that something else moves."""
    return _RUNNING_ALONE.get(clock)


class SimNode:
    def __init__(self, scenario: Scenario, clock: Callable[[], float] | None = None) -> None:
        self.scenario = copy.deepcopy(scenario)
        self.clock = clock or monotonic_clock()
        self.lock = threading.RLock()
        # nvmlEventSetWait sleeps until the timeline moves (wakeups.py says why not a
        # threading.Condition: a signal must cut the sleep short, as it does the driver's)
        self.wakers = Wakers(self.lock)
        self.xids: list[XidRecord] = []
        self.kmsg_overwritten = 0  # kernel-log records lost unread so far (kmsg_overrun)
        self._next_event = 0
        self._pid_seq = 90_000
        # simulated time until which the kubelet, just restarted, answers List with no
        # pods (its pod list not filled yet); None: never restarted
        self.kubelet_empty_until: float | None = None
        # The Node object's spec and labels as the timeline's `node:` events left them
        # (environment.py publishes them to the API stand-in): cordon, taints, labels.
        self.node_spec: dict[str, Any] = {}
        self.node_labels: dict[str, str] = {}
        self._last_start_time = BOOT_TICKS - 1
        for proc in self.scenario.processes:
            proc.start_time = self._start_time(0.0)
        # GPM counters: per GPU (and per MIG GPU instance, which is what GPM measures on
        # MIG), per metric, the time integral of the percentage, like hardware counters
        # that only ever grow; metrics are their slope between samples.
        self.gpm_integral: dict[tuple[int, int | None], dict[str, float]] = {
            (gpu.index, gi): dict.fromkeys(GPM_METRICS, 0.0)
            for gpu in self.scenario.gpus
            for gi in [None, *(m.gpu_instance_id for m in gpu.mig)]
        }
        # Nanoseconds each GPU's clocks spent held down, per reason (CLOCK_EVENT_BITS),
        # integrated like the GPM counters.
        self.clock_event_ns: dict[int, dict[str, float]] = {
            gpu.index: dict.fromkeys(CLOCK_EVENT_BITS, 0.0) for gpu in self.scenario.gpus
        }
        # Integrated from simulated time 0 (not from the clock's start): a node started
        # at --simulate-start T has counters as if it had run since 0, the timeline's
        # events applied in turn on the first look.
        self._integrated_to = min(0.0, self.clock())
        self._applied = 0  # timeline events applied: the version of the node's state
        self._rates_at = -1
        self._rates_cache: dict[tuple[int, int | None], dict[str, float]] = {}
        # Epoch seconds at simulated time 0, so API timestamps read like real ones.
        self.epoch = time.time() - self.clock()

    # -- time -------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock()

    def wall_time(self, at: float | None = None) -> float:
        """The node's wall clock at simulated time ``at`` (default: now), epoch seconds:
        the API server's time plus how far the scenario's ``node_clock`` puts it ahead."""
        at = self.clock() if at is None else at
        return self.api_time(at) + self.scenario.node_clock.ahead_at(at)

    def api_time(self, at: float | None = None) -> float:
        """The API server's clock (the true time) at simulated time ``at``: what it
        stamps objects with and serves in its ``Date`` header."""
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
                self._applied += 1
                applied = True
            if applied:
                self.wakers.wake()

    def seconds_to_next_event(self) -> float | None:
        """Simulated seconds until the next timeline event is due (None: none left)."""
        with self.lock:
            timeline = self.scenario.timeline
            if self._next_event >= len(timeline):
                return None
            return max(0.0, timeline[self._next_event].at - self.clock())

    def gpm_counters(self, gpu: int, gpu_instance: int | None) -> dict[str, float]:
        """The GPM counters of a GPU (or one of its MIG GPU instances) as of now."""
        with self.lock:
            self.advance()
            self._integrate(self.clock())
            return dict(self._gpm_integral((gpu, gpu_instance)))

    def _gpm_integral(self, key: tuple[int, int | None]) -> dict[str, float]:
        """A GPU (instance)'s GPM counters; a MIG instance created mid-run starts at 0."""
        if key not in self.gpm_integral:
            self.gpm_integral[key] = dict.fromkeys(GPM_METRICS, 0.0)
            self._rates_at = -1  # its rates are worked out from now on
        return self.gpm_integral[key]

    def clock_event_time(self, gpu: int) -> dict[str, float]:
        """Nanoseconds the GPU's clocks were held down so far, per reason."""
        with self.lock:
            self.advance()
            self._integrate(self.clock())
            return dict(self.clock_event_ns[gpu])

    def _integrate(self, until: float) -> None:
        dt = until - self._integrated_to
        if dt <= 0:
            return
        for key, rates in self._rates().items():
            acc = self.gpm_integral[key]
            duty = self.gpus[key[0]].duty  # bursts: only the busy part of [from, until)
            active = dt if duty is None else duty.busy_time(self._integrated_to, until)
            for metric, percent in rates.items():
                acc[metric] += percent * active
        for gpu in self.gpus:
            held = self.clock_event_ns[gpu.index]
            for reason, bits in CLOCK_EVENT_BITS.items():
                if gpu.clock_event_reasons & bits:
                    held[reason] += dt * 1e9
        self._integrated_to = until

    def _rates(self) -> dict[tuple[int, int | None], dict[str, float]]:
        """GPM percentages of every GPU and GPU instance. They change only when a timeline
        event is applied, so they are worked out once per event, not at every GPM or
        clock-event read (on the real clock, every read integrates a little further)."""
        if self._rates_at != self._applied:
            self._rates_cache = {
                (index, gi): self.gpm_percent(self.gpus[index], gi)
                for index, gi in self.gpm_integral
            }
            self._rates_at = self._applied
        return self._rates_cache

    def gpm_percent(self, gpu: SimGpu, gpu_instance: int | None = None) -> dict[str, float]:
        """Current GPM percentages of a GPU (or one MIG GPU instance): scenario values for
        the whole GPU, else derived from the SM shares of the processes running there (in
        every compute instance of the GPU instance, each share of the GPU instance)."""
        procs = [
            p
            for p in self.listed_processes(gpu.index)
            if p.alive
            and (
                gpu_instance is None
                or (
                    p.gpu == gpu.index
                    and p.mig is not None
                    and gpu.mig[p.mig].gpu_instance_id == gpu_instance
                )
            )
        ]
        sm = float(min(100, sum(p.sm for p in procs)))
        derived = {
            "graphics_active": float(self.utilization_gpu(gpu)),
            "sm_active": sm,
            "sm_occupancy": sm * 0.6,
            "tensor_active": sm * 0.5,
            "dram_active": sm * 0.3,
            "fp64_active": 0.0,
            "fp32_active": sm * 0.2,
            "fp16_active": sm * 0.1,
        }
        return derived if gpu_instance is not None else {**derived, **gpu.gpm}

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

    @property
    def allocator(self) -> str:
        return self.scenario.allocator

    def reference(self, ref: str) -> DeviceReference | None:
        """Parse a scenario device reference; None for a literal device id."""
        base, separator, replica = ref.partition(REPLICA_SEPARATOR)
        gpu_part, _, mig_part = base.partition("/")
        if not gpu_part.startswith("gpu"):
            return None
        try:
            gpu = self.gpus[int(gpu_part[3:])]
            mig = gpu.mig[int(mig_part.removeprefix("mig"))] if mig_part else None
            number = int(replica) if separator else None
        except (ValueError, IndexError) as exc:
            raise ScenarioError(f"device reference {ref!r} names no GPU/MIG instance") from exc
        if mig_part and not mig_part.startswith("mig"):
            raise ScenarioError(f"device reference {ref!r}: write gpuN/migM for a MIG instance")
        return DeviceReference(ref, gpu, mig, number)

    def resolve_device(self, ref: str) -> str:
        """Turn ``gpu3``, ``gpu1/mig0`` or ``gpu2::1`` into NVIDIA's device-plugin id."""
        found = self.reference(ref)
        if found is None:
            return ref  # a literal device id
        device = found.mig.uuid if found.mig else found.gpu.uuid
        return f"{device}{REPLICA_SEPARATOR}{found.replica}" if found.shared else device

    def gke_device(self, ref: str) -> str:
        """The same reference in GKE's device-plugin form, ``nvidia<minor>[/gi<id>][/vgpu<k>]``."""
        found = self.reference(ref)
        if found is None:
            return ref
        device = f"nvidia{found.gpu.minor}"
        if found.mig is not None:
            device += f"/gi{found.mig.gpu_instance_id}"
        return f"{device}/vgpu{found.replica}" if found.shared else device

    def container_devices(self) -> list[ContainerDevices]:
        """Device-plugin allocations in the allocator's words; under DRA only literal
        ids remain here (GPU references become claims, see ``claim_devices``)."""
        with self.lock:
            self.advance()
            allocations: list[ContainerDevices] = []
            if self._kubelet_empty():
                return allocations
            for pod in self.pods:
                for c in pod.containers:
                    if c.init:  # List names spec.containers only
                        continue
                    by_resource: dict[str, list[str]] = {}
                    for resource, refs in c.devices.items():
                        for ref in refs:
                            found = self._device_plugin_id(resource, ref)
                            if found is not None:
                                ids = by_resource.setdefault(found[0], [])
                                if found[1] not in ids:
                                    ids.append(found[1])
                    allocations += [
                        ContainerDevices(pod.namespace, pod.name, c.name, resource, tuple(ids))
                        for resource, ids in by_resource.items()
                    ]
            return allocations

    def listed_containers(self) -> list[tuple[str, str, str]]:
        """(namespace, pod, container) of every container List names: the kubelet lists
        each of ``spec.containers`` of the pods it knows, devices or none (init
        containers are not among them); none while it is restarting."""
        with self.lock:
            self.advance()
            if self._kubelet_empty():
                return []
            return [
                (pod.namespace, pod.name, c.name)
                for pod in self.pods
                for c in pod.containers
                if not c.init
            ]

    def _kubelet_empty(self) -> bool:
        until = self.kubelet_empty_until
        return until is not None and self.clock() < until

    def _device_plugin_id(self, resource: str, ref: str) -> tuple[str, str] | None:
        if self.reference(ref) is None or self.allocator == "nvidia":
            return resource, self.resolve_device(ref)
        if self.allocator == "gke":  # GKE's plugin advertises everything as nvidia.com/gpu
            return GPU_RESOURCE, self.gke_device(ref)
        return None  # dra

    def allocatable_devices(self) -> list[AllocatableDevices]:
        """What the device plugin advertises: whole GPUs, MIG instances, and replicas of
        time-shared GPUs (at least 4, more if the pods use more). DRA devices are not
        device-plugin devices, so a DRA node advertises none."""
        with self.lock:
            self.advance()
            if self.allocator == "dra":
                return []
            replicas = self._replicas_used()
            if self.allocator == "gke":
                return [AllocatableDevices(GPU_RESOURCE, tuple(self._gke_allocatable(replicas)))]
            by_resource: dict[str, list[str]] = {GPU_RESOURCE: []}
            for gpu in self.gpus:
                used = replicas.get((gpu.index, None))
                if gpu.mig:
                    for m in gpu.mig:
                        by_resource.setdefault(f"nvidia.com/mig-{m.profile}", []).append(m.uuid)
                elif used:
                    by_resource.setdefault(SHARED_RESOURCE, []).extend(
                        f"{gpu.uuid}{REPLICA_SEPARATOR}{r}" for r in range(_replica_count(used))
                    )
                else:
                    by_resource[GPU_RESOURCE].append(gpu.uuid)
            return [AllocatableDevices(r, tuple(ids)) for r, ids in by_resource.items()]

    def _gke_allocatable(self, replicas: dict[tuple[int, int | None], set[int]]) -> list[str]:
        devices: list[str] = []
        for gpu in self.gpus:
            slots: list[tuple[int | None, str]] = (
                [(m, f"nvidia{gpu.minor}/gi{mig.gpu_instance_id}") for m, mig in enumerate(gpu.mig)]
                if gpu.mig
                else [(None, f"nvidia{gpu.minor}")]
            )
            for slot, device in slots:
                used = replicas.get((gpu.index, slot))
                if used:
                    devices += [f"{device}/vgpu{k}" for k in range(_replica_count(used))]
                else:
                    devices.append(device)
        return devices

    def _replicas_used(self) -> dict[tuple[int, int | None], set[int]]:
        """Replica numbers the pods use, per (GPU index, MIG slot or None)."""
        used: dict[tuple[int, int | None], set[int]] = {}
        for pod in self.pods:
            for c in pod.containers:
                for refs in c.devices.values():
                    for ref in refs:
                        found = self.reference(ref)
                        if found is not None and found.replica is not None:
                            slot = found.gpu.mig.index(found.mig) if found.mig else None
                            used.setdefault((found.gpu.index, slot), set()).add(found.replica)
        return used

    # -- DRA ----------------------------------------------------------------------------

    def dra_device_name(self, gpu: SimGpu, mig: SimMig | None = None) -> str:
        """NVIDIA's DRA driver's device name: ``gpu-<minor>`` or, for MIG,
        ``gpu-<minor>-mig-<profile>-<GI profile id>-<placement start>``; the GPU's
        ``dra_name``, where set, stands for ``gpu-<minor>`` (a renumbered driver)."""
        base = gpu.dra_name or f"gpu-{gpu.minor}"
        if mig is None:
            return base
        profile = re.sub(r"[^a-z0-9]", "", mig.profile.lower())
        start = _placement_starts(gpu)[gpu.mig.index(mig)]
        return f"{base}-mig-{profile}-{_gi_profile_id(gpu, mig)}-{start}"

    def claim_devices(self) -> list[ClaimDevice]:
        """DRA claim devices per container, as the kubelet reports them (DRA nodes only).

        A replica reference ``gpuN[/migM]::k`` becomes one claim shared by every container
        of the namespace using that device (``gpuN[-migM]-shared``), as a ResourceClaim
        several pods reference; other references become one claim per container
        (``<pod>-<container>-gpu``), as from a ResourceClaimTemplate.
        """
        with self.lock:
            self.advance()
            if self.allocator != "dra" or not self.scenario.kubelet_reports_claims:
                return []
            if self._kubelet_empty():
                return []
            node = self.scenario.node_name
            claims: list[ClaimDevice] = []
            for pod in self.pods:
                for c in pod.containers:
                    if c.init:
                        continue
                    for refs in c.devices.values():
                        for ref in refs:
                            found = self.reference(ref)
                            if found is None:
                                continue
                            claim = _claim_name(pod, c, found)
                            device = self.dra_device_name(found.gpu, found.mig)
                            claim_uid = derived_uuid(node, "claim", pod.namespace, claim)
                            entry = ClaimDevice(
                                namespace=pod.namespace,
                                pod=pod.name,
                                container=c.name,
                                claim_namespace=pod.namespace,
                                claim_name=claim,
                                driver=DRA_DRIVER,
                                pool=node,
                                device=device,
                                cdi_devices=(f"k8s.{DRA_DRIVER}/claim={claim_uid}-{device}",),
                            )
                            if entry not in claims:
                                claims.append(entry)
            return claims

    def resource_claims(self, pod: SimPod) -> list[str]:
        """The ResourceClaims a DRA node's pod names in ``spec.resourceClaims`` (the
        claims ``claim_devices`` reports, whether or not the kubelet reports them)."""
        if self.allocator != "dra":
            return []
        return sorted(
            {
                _claim_name(pod, c, found)
                for c in pod.containers
                for refs in c.devices.values()
                for ref in refs
                if (found := self.reference(ref)) is not None
            }
        )

    def resource_slices(self) -> list[dict[str, Any]]:
        """The ResourceSlice NVIDIA's DRA driver publishes for this node (DRA nodes only),
        as the API serves ``resource.k8s.io/v1``: one pool named after the node, whole
        GPUs and, for a GPU in MIG mode, only its MIG devices. A lost GPU stays listed:
        the driver does not notice a GPU falling off the bus."""
        with self.lock:
            self.advance()
            if self.allocator != "dra":
                return []
            node = self.scenario.node_name
            devices: list[dict[str, Any]] = []
            for gpu in self.gpus:
                if not gpu.mig:
                    devices.append(self._slice_device(gpu, None))
                devices += [self._slice_device(gpu, mig) for mig in gpu.mig]
            # Imported here: the NVML library object imports this module inside the
            # exporter, which must not pay for the API stand-in's aiohttp.
            from exporter.sim.kube_api import resource_slice_dict

            prefix = f"{node}-{DRA_DRIVER}-"  # the driver's generateName
            name = prefix + derived_uuid(node, "resourceslice")[:5]
            obj = resource_slice_dict(name, node, devices, driver=DRA_DRIVER)
            obj["metadata"]["generateName"] = prefix
            obj["metadata"]["uid"] = derived_uuid(node, "resourceslice", name)
            return [obj]

    def _slice_device(self, gpu: SimGpu, mig: SimMig | None) -> dict[str, Any]:
        architecture, capability = _architecture(gpu.name)
        scenario = self.scenario
        cuda = scenario.cuda_driver_version
        attributes: dict[str, dict[str, Any]] = {
            "type": {"string": "mig" if mig else "gpu"},
            "uuid": {"string": mig.uuid if mig else gpu.uuid},
            "productName": {"string": gpu.name},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": architecture},
            "cudaComputeCapability": {"version": capability},
            "driverVersion": {"version": _semver(scenario.driver_version)},
            "cudaDriverVersion": {"version": f"{cuda // 1000}.{cuda % 1000 // 10}.0"},
            "resource.kubernetes.io/pciBusID": {"string": _pci_address(gpu.pci_bus_id)},
        }
        if mig is not None:
            attributes["parentUUID"] = {"string": gpu.uuid}
            attributes["profile"] = {"string": mig.profile}
        return {"name": self.dra_device_name(gpu, mig), "attributes": attributes}

    def listed_processes(self, gpu: int) -> list[SimProcess]:
        return [p for p in self.processes if p.listed and (p.gpu == gpu or gpu in p.extra_gpus)]

    def memory_used(self, gpu: SimGpu) -> int:
        """Device memory in use, v2 semantics (driver-reserved memory excluded)."""
        listed = sum(p.memory for p in self.processes if p.gpu == gpu.index)
        return min(listed + gpu.unaccounted_memory, gpu.memory_total - gpu.memory_reserved)

    def pcie_link(self, gpu: SimGpu) -> tuple[int, int]:
        """Current (generation, width): the scenario's, else the best one while the GPU
        is busy and generation 1 while idle (NVIDIA: current generation and width "may
        be reduced when the GPU is not in use", nvidia-smi(1))."""
        busy = self.utilization_gpu(gpu) > 0
        generation = gpu.pcie_generation or (gpu.pcie_max_generation if busy else 1)
        return generation, gpu.pcie_width or gpu.pcie_max_width

    def busy_now(self, gpu: SimGpu) -> bool:
        """False in the idle part of a GPU's duty cycle (``duty:``): then the driver
        reports no activity at all, as a GPU waiting on its input does."""
        return gpu.duty is None or gpu.duty.busy_at(self.clock())

    def last_event_at(self) -> float | None:
        """Simulated time of the latest timeline event applied so far (None: none yet):
        where a change the NVML sample buffers notice at their next read began."""
        with self.lock:
            if self._next_event == 0:
                return None
            return self.scenario.timeline[self._next_event - 1].at

    @staticmethod
    def busy_seconds(gpu_duty: SimDuty | None, start: float, end: float) -> float:
        """Seconds of ``[start, end)`` a GPU with duty cycle ``gpu_duty`` (None: always
        busy) spent busy, exactly: the weight of a sample's activity in the buffers."""
        if end <= start:
            return 0.0
        return end - start if gpu_duty is None else gpu_duty.busy_time(start, end)

    @staticmethod
    def last_busy_instant(gpu_duty: SimDuty | None, start: float, end: float) -> float | None:
        """The end of the last busy stretch within ``[start, end]`` (``end`` itself when
        busy then), or None when the GPU was idle throughout."""
        if SimNode.busy_seconds(gpu_duty, start, end) <= 0:
            return None
        if gpu_duty is None:
            return end
        phase = (end - gpu_duty.offset_s) % gpu_duty.period_s
        busy_part = gpu_duty.busy * gpu_duty.period_s
        return end if phase <= busy_part else end - (phase - busy_part)

    def utilization_now(self, gpu: SimGpu) -> int:
        """GPU-Util as the driver reports it now (0 in a duty cycle's idle part)."""
        return self.utilization_gpu(gpu) if self.busy_now(gpu) else 0

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
            gpu = self.gpus[int(args["gpu"])]
            for key, val in _fields(args, "gpu"):
                if not hasattr(gpu, key):
                    raise ScenarioError(f"timeline set: GPU has no field {key!r}")
                if key == "mig":  # nvidia-smi mig -dci/-dgi/-cgi: no XID, same GPU handle
                    where = f"timeline set at {event.at}"
                    gpu.mig = parse_migs(val, where, (self.scenario.node_name, "mig", event.at))
                    continue
                sized = key in {"memory_total", "memory_reserved", "unaccounted_memory"}
                setattr(gpu, key, parse_size(val, f"timeline set {key}") if sized else val)
        elif event.action == "set_process":
            proc = self._process(args["pid"])
            for key, val in _fields(args, "pid"):
                setattr(proc, key, parse_size(val, key) if key == "memory" else val)
        elif event.action == "start":
            self._start(args, event.at)
        elif event.action == "lose":
            self.gpus[int(str(value))].lost = True
        elif event.action == "restore":  # back on the bus after a reset: same UUID
            self.gpus[int(str(value))].lost = False
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
            self._fork_orphan(args, event.at)
        elif event.action == "kmsg_overrun":  # the ring wrapped past the reader
            self.kmsg_overwritten += int(str(value))
        elif event.action == "kubelet_restart":  # its List is empty for a while
            empty_for = args.get("empty_for", value if value is not None else 0.0)
            self.kubelet_empty_until = event.at + float(str(empty_for))
        elif event.action == "node":  # kubectl cordon/taint/label, the GPU Operator's label
            if "unschedulable" in args:
                self.node_spec["unschedulable"] = bool(args["unschedulable"])
            if "taints" in args:
                self.node_spec["taints"] = [dict(t) for t in args["taints"] or ()]
            for key, val in (args.get("labels") or {}).items():
                if val is None:
                    self.node_labels.pop(str(key), None)
                else:
                    self.node_labels[str(key)] = str(val)
        elif event.action == "terminate_pod":  # deletion requested, containers still run
            pod = self._pod(args.get("pod", value))
            grace = float(args.get("grace_s", 30))
            pod.deletion_at = event.at + grace  # the API sets request time + grace
            pod.deletion_grace_s = grace

    def _start_time(self, at: float) -> int:
        """A start time for a process started at simulated second ``at``: later than any
        before it, so a reused pid never shows its previous process's."""
        self._last_start_time = max(self._last_start_time + 1, BOOT_TICKS + round(at * USER_HZ))
        return self._last_start_time

    def _fork_orphan(self, args: Mapping[str, object], at: float) -> None:
        """The parent dies after forking and the child keeps the device files open, so
        the parent's memory stays. It leaves /proc; NVML either drops it too (its memory
        then unaccounted) or, with ``parent_listed``, keeps listing the dead pid with its
        memory, as an H200 on driver 580.159.04 did (docs/orphans.md)."""
        parent = self._process(args["pid"])
        if args.get("parent_listed") is True:
            parent.alive = False  # as `kill`: listed, memory held, no /proc entry
            parent.sm = 0
        else:
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
                start_time=self._start_time(at),
            )
        )

    def _start(self, args: Mapping[str, object], at: float) -> None:
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
                start_time=self._start_time(at),
            )
        )

    def _add_pod(self, args: Mapping[str, object]) -> None:
        """A new pod: its UID and container ids (unless ``uid``/``id`` name them) derive
        from its name and this event's place in the timeline, so a pod deleted and added
        again under the same name is a new incarnation, as a recreated pod is."""
        namespace, name = str(args["pod"]).split("/", 1)
        key = f"{namespace}/{name}"
        node, event = self.scenario.node_name, self._next_event
        containers = [
            SimContainer(
                str(c["name"]),
                str(c.get("id") or derived_container_id(node, key, c["name"], event)),
                {k: list(v) for k, v in c.get("devices", {}).items()},
                {str(k): str(v) for k, v in (c.get("limits") or {}).items()},
                cgroup=c.get("cgroup"),  # parsed at load (scenario._added_pod_cgroups)
                init=c.get("init") is True,
            )
            for c in args.get("containers", [])  # type: ignore[attr-defined]
        ]
        self.scenario.pods.append(
            SimPod(
                namespace,
                name,
                str(args.get("uid") or derived_uuid(node, "pod", key, event)),
                str(args.get("qos", "burstable")),
                "Running",
                containers,
            )
        )


def _fields(args: Mapping[str, Any], subject: str) -> list[tuple[str, Any]]:
    """A ``set``/``set_process`` event's fields to change: its arguments but the one that
    names what they change. The event itself stays as it was (it is read, never consumed)."""
    return [(key, val) for key, val in args.items() if key != subject]


def _replica_count(used: set[int]) -> int:
    return max(MIN_REPLICAS, max(used) + 1)


def _claim_name(pod: SimPod, container: SimContainer, ref: DeviceReference) -> str:
    if not ref.shared:
        return f"{pod.name}-{container.name}-gpu"
    mig = f"-mig{ref.gpu.mig.index(ref.mig)}" if ref.mig else ""
    return f"gpu{ref.gpu.index}{mig}-shared"


def _slices(profile: str) -> int:
    """Compute slices of a MIG profile (``3g.40gb`` -> 3); 1 if the name says none."""
    match = re.match(r"(\d+)g\.", profile)
    return int(match.group(1)) if match else 1


def _gi_profile_id(gpu: SimGpu, mig: SimMig) -> int:
    slices = _slices(mig.profile)
    if "+me" in mig.profile:
        return 20
    if slices == 1 and mig.memory_total * _MEMORY_SLICES > gpu.memory_total * 1.5:
        return 15  # 1g with two memory slices (e.g. 1g.20gb on an 80 GB GPU)
    return _GI_PROFILE_IDS.get(slices, 19)


def _placement_starts(gpu: SimGpu) -> list[int]:
    """Placement start of each MIG instance: first fit in declaration order, as
    ``nvidia-smi mig -cgi`` places instances created one after another."""
    taken: set[int] = set()
    starts: list[int] = []
    for mig in gpu.mig:
        span = _PLACEMENT_SPAN.get(_slices(mig.profile), 1)
        candidates = [s for s in range(0, _MEMORY_SLICES - span + 1, span) if span > 1 or s < 7]
        start = next(
            (s for s in candidates if not taken & set(range(s, s + span))),
            _MEMORY_SLICES + len(starts),  # over-subscribed scenario: still a unique name
        )
        taken |= set(range(start, start + span))
        starts.append(start)
    return starts


def _architecture(name: str) -> tuple[str, str]:
    for marker, architecture, capability in _ARCHITECTURES:
        if marker in name:
            return architecture, capability
    return "Unknown", "0.0.0"


def _semver(version: str) -> str:
    """``550.90.07`` -> ``550.90.7``: DRA version attributes are semantic versions."""
    parts = [str(int(p)) if p.isdigit() else p for p in version.split(".")]
    return ".".join([*parts, "0", "0"][:3])


def _pci_address(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` as sysfs writes it, ``0000:18:00.0``."""
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower()
