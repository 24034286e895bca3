"""Attribution end to end: the exporter's served metrics checked against the scenario.

The real exporter runs on the simulated node (``tests.harness``); every expected value
is derived here from the scenario object (pods, containers, device references,
processes with their memory), never copied from the exporter's own output.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from exporter.model import PodMetaSnapshot
from exporter.sim.events import SimEvent
from exporter.sim.proctree import remove_process
from exporter.sim.scenario import (
    Scenario,
    SimProcess,
    load_scenario,
    parse_scenario,
)
from exporter.sources.base import Cycle
from tests.harness import Harness, Labels, Scrape, simulated_exporter

NODE = "node-8gpu"
PER_PROCESS = ("--per-process-metrics",)
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
SHARED_SUFFIX = ".shared"
REPLICA_SEPARATOR = "::"
# The reasons the exporter serves on gpu_unattributed_* (a label contract, so literal).
REASON_NO_POD_META = "no pod metadata"
REASON_POD_NOT_ON_NODE = "pod not on this node"
REASON_SHARED_NO_META = "shared GPU without pod metadata"
REASON_AMBIGUOUS_NO_META = "several pods on an exclusive GPU without pod metadata"
WATCH_TIMEOUT_S = 5.0

Device = dict[str, str]  # gpu, uuid and, on MIG, mig_uuid/gpu_instance/compute_instance/profile
ContainerKey = tuple[str, str, str]  # namespace, pod, container


# ---------------------------------------------------------------------------
# Expectations, derived from the scenario
# ---------------------------------------------------------------------------


def device_labels(scenario: Scenario, gpu_index: int, mig_index: int | None = None) -> Device:
    gpu = scenario.gpus[gpu_index]
    labels = {"gpu": str(gpu.index), "uuid": gpu.uuid}
    if mig_index is not None:
        mig = gpu.mig[mig_index]
        labels |= {
            "mig_uuid": mig.uuid,
            "gpu_instance": str(mig.gpu_instance_id),
            "compute_instance": str(mig.compute_instance_id),
            "mig_profile": mig.profile,
        }
    return labels


def device_key(device: Device) -> tuple[str, str | None]:
    return device["uuid"], device.get("mig_uuid")


def listings(scenario: Scenario) -> Iterator[tuple[SimProcess, Device]]:
    """Every (process, device) NVML lists: a process appears once per device it uses."""
    for proc in scenario.processes:
        if not proc.listed:
            continue
        yield proc, device_labels(scenario, proc.gpu, proc.mig)
        for extra in proc.extra_gpus:
            yield proc, device_labels(scenario, extra)


def pod_names(scenario: Scenario) -> set[str]:
    return {f"{pod.namespace}/{pod.name}" for pod in scenario.pods}


def container_of(proc: SimProcess) -> ContainerKey:
    assert proc.pod is not None and proc.container is not None
    namespace, pod = proc.pod.split("/", 1)
    return namespace, pod, proc.container


def container_of_or_none(proc: SimProcess) -> ContainerKey | None:
    return container_of(proc) if proc.pod is not None else None


def frozen(labels: dict[str, str]) -> Labels:
    """A label set as served: a label without a value is not served (docs/metrics.md)."""
    return frozenset((k, v) for k, v in labels.items() if v)


@dataclass(frozen=True)
class Allocated:
    container: ContainerKey
    resource: str
    device_id: str
    device: Device

    @property
    def shared(self) -> bool:
        return REPLICA_SEPARATOR in self.device_id or self.resource.endswith(SHARED_SUFFIX)

    def covers(self, device: Device) -> bool:
        """A whole-GPU (or replica) allocation covers the GPU and its MIG instances."""
        uuid, mig_uuid = device_key(self.device)
        return uuid == device["uuid"] and mig_uuid in (None, device.get("mig_uuid"))


def resolve_reference(scenario: Scenario, ref: str) -> tuple[str, Device]:
    """``gpu3``, ``gpu3/mig1`` or ``gpu2::1`` -> (kubelet device id, device labels)."""
    base, separator, replica = ref.partition(REPLICA_SEPARATOR)
    gpu_part, _, mig_part = base.partition("/")
    gpu_index = int(gpu_part.removeprefix("gpu"))
    if mig_part:
        mig_index = int(mig_part.removeprefix("mig"))
        return scenario.gpus[gpu_index].mig[mig_index].uuid, device_labels(
            scenario, gpu_index, mig_index
        )
    uuid = scenario.gpus[gpu_index].uuid
    return (f"{uuid}{REPLICA_SEPARATOR}{replica}" if separator else uuid), device_labels(
        scenario, gpu_index
    )


def allocations(scenario: Scenario) -> list[Allocated]:
    """What the kubelet allocated to the containers of pods not in a terminal phase."""
    return [
        Allocated((pod.namespace, pod.name, container.name), resource, *resolved)
        for pod in scenario.pods
        if pod.phase not in TERMINAL_PHASES
        for container in pod.containers
        for resource, refs in container.devices.items()
        for resolved in (resolve_reference(scenario, ref) for ref in refs)
    ]


def expected_allocated_series(scenario: Scenario) -> dict[Labels, float]:
    return {
        frozen(
            {
                "namespace": a.container[0],
                "pod": a.container[1],
                "container": a.container[2],
                **a.device,
                "device_id": a.device_id,
                "resource": a.resource,
            }
        ): 1.0
        for a in allocations(scenario)
    }


@dataclass(frozen=True)
class Owner:
    owner: str
    namespace: str = ""
    pod: str = ""
    container: str = ""
    reason: str = ""


def owner_with_pod_metadata(scenario: Scenario, proc: SimProcess) -> Owner:
    if not proc.alive:
        return Owner("dead")
    if proc.pod is None:
        return Owner("host")
    if proc.pod not in pod_names(scenario):
        return Owner("unknown", reason=REASON_POD_NOT_ON_NODE)
    return Owner("pod", *container_of(proc))


def owner_without_pod_metadata(scenario: Scenario, proc: SimProcess, device: Device) -> Owner:
    """DESIGN step 3 is optional: then only an exclusive allocation names the pod."""
    if not proc.alive:
        return Owner("dead")
    if proc.pod is None:
        return Owner("host")
    covering = [a for a in allocations(scenario) if a.covers(device)]
    if not covering:
        return Owner("unknown", reason=REASON_NO_POD_META)
    holders = {a.container for a in covering}
    if len(holders) > 1 or any(a.shared for a in covering):
        return Owner("unknown", reason=REASON_SHARED_NO_META)
    users = {
        container_of(p)
        for p, d in listings(scenario)
        if p.alive and p.pod is not None and device_key(d) == device_key(device)
    }
    if len(users) > 1:
        return Owner("unknown", reason=REASON_AMBIGUOUS_NO_META)
    (holder,) = holders
    return Owner("pod", *holder)


def process_labels(proc: SimProcess, device: Device, owner: Owner) -> Labels:
    return frozen(
        {
            **device,
            "pid": str(proc.pid),
            "kind": proc.kind,
            "owner": owner.owner,
            "namespace": owner.namespace,
            "pod": owner.pod,
            "container": owner.container,
        }
    )


def expected_process_series(
    scenario: Scenario, owner_of: Callable[[SimProcess, Device], Owner]
) -> dict[Labels, float]:
    return {
        process_labels(proc, device, owner_of(proc, device)): float(proc.memory)
        for proc, device in listings(scenario)
    }


@dataclass
class Usage:
    memory: int = 0
    processes: int = 0
    sm_percent: int = 0
    sampled: bool = False  # the simulated driver samples busy processes on non-MIG GPUs

    @property
    def sm_ratio(self) -> float | None:
        return min(self.sm_percent / 100.0, 1.0) if self.sampled else None


def container_labels(container: ContainerKey, device: Device) -> Labels:
    namespace, pod, name = container
    return frozen({"namespace": namespace, "pod": pod, "container": name, **device})


def expected_container_usage(scenario: Scenario) -> dict[Labels, Usage]:
    """Per (container, device): the live processes a pod container owns there."""
    usage: dict[Labels, Usage] = defaultdict(Usage)
    for proc, device in listings(scenario):
        owner = owner_with_pod_metadata(scenario, proc)
        if owner.owner != "pod":
            continue
        row = usage[container_labels(container_of(proc), device)]
        row.memory += proc.memory
        row.processes += 1
        if proc.sm > 0 and "mig_uuid" not in device:
            row.sm_percent += proc.sm
            row.sampled = True
    return dict(usage)


def expected_unallocated_use(scenario: Scenario) -> dict[Labels, float]:
    """Memory a pod container's live processes hold on devices it was not allocated."""
    leaks: dict[Labels, float] = defaultdict(float)
    allocated = allocations(scenario)
    for proc, device in listings(scenario):
        if owner_with_pod_metadata(scenario, proc).owner != "pod":
            continue
        container = container_of(proc)
        if not any(a.container == container and a.covers(device) for a in allocated):
            leaks[container_labels(container, device)] += proc.memory
    return dict(leaks)


def expected_unattributed(
    scenario: Scenario, owner_of: Callable[[SimProcess, Device], Owner]
) -> tuple[dict[Labels, float], dict[Labels, float]]:
    """(memory, process count) per device, owner kind and reason, for non-pod owners."""
    memory: dict[Labels, float] = defaultdict(float)
    count: dict[Labels, float] = defaultdict(float)
    for proc, device in listings(scenario):
        owner = owner_of(proc, device)
        if owner.owner == "pod":
            continue
        key = frozen({**device, "owner": owner.owner, "reason": owner.reason})
        memory[key] += proc.memory
        count[key] += 1
    return dict(memory), dict(count)


def with_meta(scenario: Scenario) -> Callable[[SimProcess, Device], Owner]:
    return lambda proc, _device: owner_with_pod_metadata(scenario, proc)


def without_meta(scenario: Scenario) -> Callable[[SimProcess, Device], Owner]:
    return lambda proc, device: owner_without_pod_metadata(scenario, proc, device)


def pod_processes(scenario: Scenario, pod: str) -> list[SimProcess]:
    return [p for p in scenario.processes if p.pod == pod and p.listed]


# ---------------------------------------------------------------------------
# Served values
# ---------------------------------------------------------------------------


def served(scrape: Scrape, name: str, **labels: str) -> dict[Labels, float]:
    return {frozen(found): value for found, value in scrape.find(name, **labels)}


def served_pods(scrape: Scrape, name: str) -> set[str]:
    return {labels.get("pod", "") for labels, _ in scrape.find(name)}


def node_8gpu_with(*events: SimEvent) -> Scenario:
    scenario = load_scenario(NODE)
    scenario.timeline = sorted(events, key=lambda e: e.at)
    return scenario


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Bounded poll: the pod watch delivers API changes on its own thread."""
    deadline = time.monotonic() + WATCH_TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WATCH_TIMEOUT_S} s waiting for {what}")
        await asyncio.sleep(0.02)


def watched_pods(h: Harness) -> dict[str, str | None]:
    """``namespace/name`` -> phase, as the exporter's pod watch currently sees them."""
    snapshot = h.source("kube").read(Cycle(0.0))
    assert isinstance(snapshot, PodMetaSnapshot)
    return {f"{p.namespace}/{p.name}": p.phase for p in snapshot.pods}


async def scrape_node(*, kube_api: bool) -> tuple[Scenario, Scrape]:
    scenario = load_scenario(NODE)
    async with simulated_exporter(scenario, kube_api=kube_api, argv=PER_PROCESS) as h:
        # a leak is judged on an answer begun after its process was first seen (the
        # first cycle's): the refresh the agent asks for, then a cycle
        await h.refresh_pod_resources()
        await h.cycle()
        return scenario, await h.scrape()


# One exporter run serves every read-only check of a configuration: tests stay fast.
@pytest.fixture(scope="module")
def node_8gpu() -> tuple[Scenario, Scrape]:
    return asyncio.run(scrape_node(kube_api=True))


@pytest.fixture(scope="module")
def node_8gpu_without_kube_api() -> tuple[Scenario, Scrape]:
    return asyncio.run(scrape_node(kube_api=False))


# ---------------------------------------------------------------------------
# 1. node-8gpu with the pod watch and PodResources: the full picture
# ---------------------------------------------------------------------------


def test_every_listed_process_is_served_with_its_device_owner_pod_and_memory(
    node_8gpu: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu

    expected = expected_process_series(scenario, with_meta(scenario))
    assert len(expected) == sum(1 for _ in listings(scenario)) > 0
    assert served(scrape, "gpu_process_memory_used_bytes") == expected


def test_container_memory_is_the_sum_of_its_served_processes(
    node_8gpu: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu

    per_process: dict[Labels, float] = defaultdict(float)
    for labels, value in scrape.find("gpu_process_memory_used_bytes", owner="pod"):
        device = {k: v for k, v in labels.items() if k not in {"pid", "kind", "owner"}}
        per_process[frozen(device)] += value
    containers = served(scrape, "gpu_container_memory_used_bytes")
    assert containers == dict(per_process)
    assert containers == {k: float(u.memory) for k, u in expected_container_usage(scenario).items()}


def test_every_pod_container_with_processes_serves_its_process_count(
    node_8gpu: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu

    expected = {k: float(u.processes) for k, u in expected_container_usage(scenario).items()}
    assert served(scrape, "gpu_container_processes") == expected
    # the SIGKILLed process still holds memory but is no longer the container's
    killed = [p for p in scenario.processes if not p.alive and p.pod is not None]
    assert killed, "node-8gpu should have a killed pod process"
    for proc in killed:
        labels = container_labels(container_of(proc), device_labels(scenario, proc.gpu, proc.mig))
        alive = [
            p
            for p in pod_processes(scenario, proc.pod or "")
            if p.alive and p.container == proc.container and p.gpu == proc.gpu
        ]
        assert scrape.series("gpu_container_processes")[labels] == len(alive)


def test_time_sliced_pods_on_one_gpu_each_serve_their_own_memory_and_sm(
    node_8gpu: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu
    shared_gpu = 2
    sharers = sorted(
        {
            container_of(p)
            for p in scenario.processes
            if p.gpu == shared_gpu and p.alive and p.pod is not None
        }
    )
    assert len(sharers) == 3
    device = device_labels(scenario, shared_gpu)
    usage = expected_container_usage(scenario)

    memory = served(scrape, "gpu_container_memory_used_bytes", gpu=str(shared_gpu))
    sm = served(scrape, "gpu_container_sm_utilization_ratio", gpu=str(shared_gpu))
    for container in sharers:
        key = container_labels(container, device)
        own = [p for p in scenario.processes if p.alive and container_of_or_none(p) == container]
        assert memory[key] == sum(p.memory for p in own) == usage[key].memory
        assert sm[key] == pytest.approx(min(sum(p.sm for p in own) / 100, 1.0))
    # distinct values per pod: no sharer overwrote another's series
    assert len(set(memory.values())) == len(sharers)
    assert len(set(sm.values())) == len(sharers)
    per_pid_sm = served(scrape, "gpu_process_sm_utilization_ratio", gpu=str(shared_gpu))
    assert {dict(k)["pid"]: v for k, v in per_pid_sm.items()} == pytest.approx(
        {
            str(p.pid): p.sm / 100
            for p in scenario.processes
            if p.gpu == shared_gpu and p.alive and p.sm > 0
        }
    )


def test_mig_pods_carry_their_instance_uuid_gpu_instance_and_profile_labels(
    node_8gpu: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu
    mig_gpu = next(g for g in scenario.gpus if g.mig)
    on_mig = {
        container_labels(container_of(p), device_labels(scenario, p.gpu, p.mig))
        for p in scenario.processes
        if p.gpu == mig_gpu.index and p.pod is not None and p.alive
    }
    assert {dict(k)["mig_uuid"] for k in on_mig} == {m.uuid for m in mig_gpu.mig}

    gpu = str(mig_gpu.index)
    assert set(served(scrape, "gpu_container_memory_used_bytes", gpu=gpu)) == on_mig
    allocated_here = {
        k: v for k, v in expected_allocated_series(scenario).items() if ("gpu", gpu) in k
    }
    assert served(scrape, "gpu_container_allocated", gpu=gpu) == allocated_here
    for labels, _ in scrape.find("gpu_process_memory_used_bytes", gpu=gpu):
        mig = next(m for m in mig_gpu.mig if m.uuid == labels["mig_uuid"])
        assert (labels["gpu_instance"], labels["compute_instance"], labels["mig_profile"]) == (
            str(mig.gpu_instance_id),
            str(mig.compute_instance_id),
            mig.profile,
        )


def test_mps_clients_sharing_a_gpu_are_attributed_to_their_own_pods(
    node_8gpu: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu
    mps = [p for p in scenario.processes if p.kind == "mps" and p.pod is not None]
    usage = expected_container_usage(scenario)
    assert len({container_of(p) for p in mps}) > 1

    memory = served(scrape, "gpu_container_memory_used_bytes")
    for proc in mps:
        device = device_labels(scenario, proc.gpu)
        key = container_labels(container_of(proc), device)
        assert memory[key] == usage[key].memory
        owner = owner_with_pod_metadata(scenario, proc)
        assert scrape.series("gpu_process_memory_used_bytes")[
            process_labels(proc, device, owner)
        ] == float(proc.memory)
        assert owner.owner == "pod"


def test_host_processes_are_owner_host_and_the_killed_process_is_owner_dead(
    node_8gpu: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu
    host = [p for p in scenario.processes if p.pod is None and p.alive]
    dead = [p for p in scenario.processes if not p.alive]
    assert host and dead

    by_pid = {labels["pid"]: labels for labels, _ in scrape.find("gpu_process_memory_used_bytes")}
    for proc in host:
        assert (by_pid[str(proc.pid)]["owner"], by_pid[str(proc.pid)].get("pod")) == ("host", None)
    for proc in dead:
        assert (by_pid[str(proc.pid)]["owner"], by_pid[str(proc.pid)].get("pod")) == ("dead", None)
    memory, count = expected_unattributed(scenario, with_meta(scenario))
    assert served(scrape, "gpu_unattributed_memory_used_bytes") == memory
    assert served(scrape, "gpu_unattributed_processes") == count


def test_process_on_a_gpu_its_container_was_not_allocated_is_unallocated_use(
    node_8gpu: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu

    expected = expected_unallocated_use(scenario)
    assert expected, "node-8gpu should have a container using a GPU it was not allocated"
    assert served(scrape, "gpu_unallocated_use_memory_bytes") == expected


def test_every_device_allocated_to_a_pod_container_is_served_as_allocated(
    node_8gpu: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu

    expected = expected_allocated_series(scenario)
    resources = {dict(k)["resource"] for k in expected}
    assert {"nvidia.com/gpu", "nvidia.com/gpu.shared"} <= resources
    assert any(r.startswith("nvidia.com/mig-") for r in resources)
    assert served(scrape, "gpu_container_allocated") == expected


IDLE_ALLOCATION: dict[str, object] = {
    "node_name": "sim-node-idle",
    "gpus": [{}, {}, {}],
    "pods": [
        {
            "namespace": "ml",
            "name": "trainer",
            "containers": [
                {
                    "name": "main",
                    "devices": {"nvidia.com/gpu": ["gpu0", "gpu1"]},
                    "processes": [{"gpu": 0, "memory": "4GiB", "sm": 30}],
                },
                {"name": "sidecar", "devices": {"nvidia.com/gpu": ["gpu2"]}, "processes": []},
            ],
        }
    ],
}


async def test_allocated_devices_without_processes_are_still_served_as_allocated() -> None:
    scenario = parse_scenario(IDLE_ALLOCATION, "idle-allocation")
    async with simulated_exporter(scenario, argv=PER_PROCESS) as h:
        scrape = await h.scrape()

    allocated = expected_allocated_series(scenario)
    used = expected_container_usage(scenario)
    idle = {k for k in allocated if not any(set(u) <= k for u in used)}
    assert len(idle) == 2  # the sidecar's GPU and main's second GPU
    assert served(scrape, "gpu_container_allocated") == allocated
    assert set(served(scrape, "gpu_container_memory_used_bytes")) == set(used)


# ---------------------------------------------------------------------------
# 2. --kube-api off: PodResources alone
# ---------------------------------------------------------------------------


def test_without_kube_api_exclusively_allocated_gpus_still_name_their_pods(
    node_8gpu_without_kube_api: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu_without_kube_api
    expected = expected_process_series(scenario, without_meta(scenario))
    attributed = {dict(k)["pod"] for k in expected if ("owner", "pod") in k}
    assert {"llm-pretrain-0", "alice-jupyter"} <= attributed  # whole GPU and MIG instance

    assert served(scrape, "gpu_process_memory_used_bytes") == expected
    assert served(scrape, "gpu_container_allocated") == expected_allocated_series(scenario)


def test_without_kube_api_time_sliced_gpu_processes_are_unknown_as_shared(
    node_8gpu_without_kube_api: tuple[Scenario, Scrape],
) -> None:
    scenario, scrape = node_8gpu_without_kube_api
    gpu = "2"
    on_shared = [p for p, d in listings(scenario) if d["gpu"] == gpu and p.pod and p.alive]
    assert on_shared

    shared = {"owner": "unknown", "reason": REASON_SHARED_NO_META}
    key = frozen({**device_labels(scenario, 2), **shared})
    assert scrape.series("gpu_unattributed_processes")[key] == len(on_shared)
    assert scrape.series("gpu_unattributed_memory_used_bytes")[key] == sum(
        p.memory for p in on_shared
    )
    assert served(scrape, "gpu_container_memory_used_bytes", gpu=gpu) == {}
    memory, count = expected_unattributed(scenario, without_meta(scenario))
    assert served(scrape, "gpu_unattributed_memory_used_bytes") == memory
    assert served(scrape, "gpu_unattributed_processes") == count


ONE_REPLICA_HELD: dict[str, object] = {
    "node_name": "sim-node-one-replica",
    "gpus": [{}],
    "pods": [
        {
            "namespace": "inference",
            "name": "solo",
            "containers": [
                {
                    "name": "main",
                    "devices": {"nvidia.com/gpu.shared": ["gpu0::3"]},
                    "processes": [{"gpu": 0, "memory": "5GiB", "sm": 20}],
                }
            ],
        }
    ],
}


async def test_without_kube_api_a_replica_held_by_one_pod_is_still_not_guessed() -> None:
    scenario = parse_scenario(ONE_REPLICA_HELD, "one-replica")
    async with simulated_exporter(scenario, kube_api=False, argv=PER_PROCESS) as h:
        scrape = await h.scrape()

    memory, count = expected_unattributed(scenario, without_meta(scenario))
    assert {dict(k)["reason"] for k in memory} == {REASON_SHARED_NO_META}
    assert served(scrape, "gpu_unattributed_memory_used_bytes") == memory
    assert served(scrape, "gpu_unattributed_processes") == count
    assert "gpu_container_memory_used_bytes" not in scrape.values


def test_without_kube_api_no_kube_source_is_reported(
    node_8gpu_without_kube_api: tuple[Scenario, Scrape],
) -> None:
    _, scrape = node_8gpu_without_kube_api

    sources = {labels["source"]: v for labels, v in scrape.find("gpu_exporter_source_up")}
    assert "kube" not in sources
    assert {name: sources.get(name) for name in ("nvml", "procfs", "podresources")} == {
        "nvml": 1.0,
        "procfs": 1.0,
        "podresources": 1.0,
    }


# ---------------------------------------------------------------------------
# 3. PodResources unavailable: pod watch + cgroups only
# ---------------------------------------------------------------------------


def assert_attributed_without_allocations(scenario: Scenario, scrape: Scrape) -> None:
    assert scrape.get("gpu_exporter_source_up", source="podresources") == 0
    assert scrape.get("gpu_exporter_errors_total", source="podresources") > 0
    assert len(scrape.series("gpu_info")) == len(scenario.gpus)
    assert served(scrape, "gpu_container_memory_used_bytes") == {
        k: float(u.memory) for k, u in expected_container_usage(scenario).items()
    }
    assert served(scrape, "gpu_process_memory_used_bytes") == expected_process_series(
        scenario, with_meta(scenario)
    )
    assert "gpu_container_allocated" not in scrape.values
    assert "gpu_unallocated_use_memory_bytes" not in scrape.values  # no leak guessed


async def test_missing_pod_resources_socket_keeps_attribution_by_cgroup_and_pod_watch(
    tmp_path: Path,
) -> None:
    scenario = load_scenario(NODE)
    missing = tmp_path / "kubelet.sock"
    argv = [*PER_PROCESS, "--pod-resources-socket", str(missing)]
    async with simulated_exporter(scenario, argv=argv) as h:
        await h.refresh_pod_resources()
        await h.advance(1)
        scrape = await h.scrape()

    assert_attributed_without_allocations(scenario, scrape)


async def test_kubelet_going_down_drops_allocations_but_keeps_pod_attribution() -> None:
    scenario = load_scenario(NODE)
    async with simulated_exporter(scenario, argv=PER_PROCESS) as h:
        before = await h.scrape()
        assert before.get("gpu_exporter_source_up", source="podresources") == 1
        assert before.series("gpu_container_allocated")
        # The simulator offers no public way to stop its kubelet; its gRPC server is it.
        await h.env._grpc.stop(None)
        await h.refresh_pod_resources()
        await h.advance(1)
        scrape = await h.scrape()

    assert_attributed_without_allocations(scenario, scrape)


# ---------------------------------------------------------------------------
# 4. A pid exiting between the NVML listing and the /proc read
# ---------------------------------------------------------------------------


async def assert_race_victim_is_dead(h: Harness, scenario: Scenario, victim: SimProcess) -> None:
    errors_before = (await h.scrape()).get("gpu_exporter_errors_total", source="agent")
    await h.agent.cycle()  # not h.cycle(): no simulator sync between listing and read
    scrape = await h.scrape()

    device = device_labels(scenario, victim.gpu, victim.mig)
    assert served(scrape, "gpu_process_memory_used_bytes", pid=str(victim.pid)) == {
        process_labels(victim, device, Owner("dead")): float(victim.memory)
    }
    assert scrape.get("gpu_exporter_errors_total", source="agent") == errors_before
    container = container_labels(container_of(victim), device)
    usage = expected_container_usage(scenario)[container]
    assert scrape.series("gpu_container_memory_used_bytes")[container] == (
        usage.memory - victim.memory
    )
    assert scrape.series("gpu_container_processes")[container] == usage.processes - 1
    dead_key = frozen({**device, "owner": "dead", "reason": ""})
    assert scrape.series("gpu_unattributed_memory_used_bytes")[dead_key] == victim.memory


def race_victim(scenario: Scenario) -> SimProcess:
    """The biggest live pod process on the time-sliced GPU."""
    return max(
        (p for p in scenario.processes if p.gpu == 2 and p.alive and p.pod is not None),
        key=lambda p: p.memory,
    )


async def test_pid_gone_from_proc_while_nvml_still_lists_it_is_attributed_dead() -> None:
    scenario = load_scenario(NODE)
    victim = race_victim(scenario)
    async with simulated_exporter(scenario, argv=PER_PROCESS) as h:
        remove_process(h.env.paths.proc_root, victim.pid)
        await assert_race_victim_is_dead(h, scenario, victim)


async def test_pid_exiting_between_the_cgroup_and_stat_reads_is_attributed_dead() -> None:
    scenario = load_scenario(NODE)
    victim = race_victim(scenario)
    async with simulated_exporter(scenario, argv=PER_PROCESS) as h:
        (h.env.paths.proc_root / str(victim.pid) / "stat").unlink()
        await assert_race_victim_is_dead(h, scenario, victim)


# ---------------------------------------------------------------------------
# 5. and 6. The timeline: pods deleted, processes started, pods finished
# ---------------------------------------------------------------------------


async def test_deleted_pod_leaves_the_pod_watch_and_its_container_series() -> None:
    gone = "inference/chat-c"
    scenario = node_8gpu_with(SimEvent(at=10, action="delete_pod", args={"value": gone}))
    name = gone.split("/", 1)[1]
    async with simulated_exporter(scenario, argv=PER_PROCESS) as h:
        before = await h.scrape()
        assert name in served_pods(before, "gpu_container_memory_used_bytes")
        assert name in served_pods(before, "gpu_container_allocated")

        await h.advance(10)
        await wait_until(lambda: gone not in watched_pods(h), f"{gone} to leave the pod watch")
        await h.refresh_pod_resources()
        await h.advance(1)
        scrape = await h.scrape()

    after = [p for p in scenario.pods if f"{p.namespace}/{p.name}" != gone]
    assert len(after) == len(scenario.pods) - 1
    scenario.pods = after  # the node as the timeline left it
    for metric in (
        "gpu_container_memory_used_bytes",
        "gpu_container_processes",
        "gpu_container_sm_utilization_ratio",
        "gpu_container_allocated",
    ):
        assert name not in served_pods(scrape, metric), metric
    # its processes still hold memory: now a deleted pod's, owned by no known pod
    assert served(scrape, "gpu_process_memory_used_bytes") == expected_process_series(
        scenario, with_meta(scenario)
    )
    lingering = pod_processes(scenario, gone)
    orphaned = {"owner": "unknown", "reason": REASON_POD_NOT_ON_NODE}
    key = frozen({**device_labels(scenario, 2), **orphaned})
    assert scrape.series("gpu_unattributed_memory_used_bytes")[key] == sum(
        p.memory for p in lingering
    )
    assert served(scrape, "gpu_container_allocated") == expected_allocated_series(scenario)


async def test_process_started_later_in_a_pod_is_attributed_after_the_next_cycle() -> None:
    base = load_scenario(NODE)
    started = SimProcess(
        pid=max(p.pid for p in base.processes) + 1000,
        gpu=2,
        memory=3 * 1024**3,
        sm=9,
        kind="compute",
        comm="tritonserver",
        pod="inference/chat-a",
        container="main",
    )
    start = {
        key: getattr(started, key)
        for key in ("pid", "gpu", "memory", "sm", "kind", "comm", "pod", "container")
    }
    scenario = node_8gpu_with(SimEvent(at=5, action="start", args=start))
    pid = str(started.pid)
    async with simulated_exporter(scenario, argv=PER_PROCESS) as h:
        assert served(await h.scrape(), "gpu_process_memory_used_bytes", pid=pid) == {}
        await h.advance(5)
        scrape = await h.scrape()
        # its SM share: once the driver has a sample of it (a period that ended after it
        # started) and the GPU's per-process samples are read again (every 10 s by
        # default, GPU 2 of 8 at 2.5 s into each: at 15 s here)
        await h.advance(10)
        later = await h.scrape()

    scenario.processes.append(started)  # the node as the timeline left it
    device = device_labels(scenario, started.gpu)
    owner = owner_with_pod_metadata(scenario, started)
    assert owner.owner == "pod"
    assert served(scrape, "gpu_process_memory_used_bytes", pid=pid) == {
        process_labels(started, device, owner): float(started.memory)
    }
    container = container_labels(container_of(started), device)
    usage = expected_container_usage(scenario)[container]
    assert scrape.series("gpu_container_memory_used_bytes")[container] == usage.memory
    assert scrape.series("gpu_container_processes")[container] == usage.processes
    assert later.series("gpu_container_sm_utilization_ratio")[container] == pytest.approx(
        usage.sm_ratio
    )


async def test_pod_in_a_terminal_phase_has_its_allocated_series_dropped() -> None:
    finished = "research/tiny-kernels"
    base = load_scenario(NODE)
    events = [
        SimEvent(at=10, action="set_pod_phase", args={"pod": finished, "phase": "Succeeded"}),
        # a Succeeded pod's containers have exited
        *(
            SimEvent(at=10, action="exit", args={"value": p.pid})
            for p in pod_processes(base, finished)
        ),
    ]
    scenario = node_8gpu_with(*events)
    namespace, name = finished.split("/")
    async with simulated_exporter(scenario, argv=PER_PROCESS) as h:
        assert name in served_pods(await h.scrape(), "gpu_container_allocated")

        await h.advance(10)
        await wait_until(
            lambda: watched_pods(h).get(finished) == "Succeeded", f"{finished} to succeed"
        )
        await h.refresh_pod_resources()
        await h.advance(1)
        scrape = await h.scrape()
        # the kubelet still lists the finished pod's devices: dropping them is the exporter's
        still_listed = {(c.namespace, c.pod) for c in h.pod_resources.read(Cycle(0.0)).containers}
        assert (namespace, name) in still_listed

    for pod in scenario.pods:
        if (pod.namespace, pod.name) == (namespace, name):
            pod.phase = "Succeeded"
    scenario.processes = [p for p in scenario.processes if p.pod != finished]
    assert name not in served_pods(scrape, "gpu_container_allocated")
    assert served(scrape, "gpu_container_allocated") == expected_allocated_series(scenario)
