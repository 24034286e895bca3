"""gpu_pod_owner_info: what the pod watch reads of a pod's owner (bounded), the rules that
resolve it to a workload (analysis/owners.py), and the series on the simulated node."""

from __future__ import annotations

import re
from typing import Any

import pytest

from exporter.analysis.owners import pod_owners, resolve_owner
from exporter.model import (
    Allocation,
    Attribution,
    ContainerGpuUsage,
    ContainerRef,
    DeviceRef,
    PodMeta,
    PodMetaSnapshot,
    PodOwner,
)
from exporter.sim.kube_api import pod_dict
from exporter.sim.scenario import ScenarioError, load_scenario, parse_scenario
from exporter.sources.kube import MAX_OWNER_REFERENCES, pod_meta_from_dict
from tests.harness import simulated_exporter

NODE = "node-a"
DEVICE = DeviceRef(0, "GPU-0")
NOW = 1_767_225_600.0  # 2026-01-01T00:00:00Z, the snapshot's time


def pod(
    name: str = "web-5d8f7c9b4f-x2x7q",
    kind: str | None = None,
    owner: str | None = None,
    template_hash: str | None = None,
    *,
    namespace: str = "ml",
    uid: str = "u1",
    deleting: bool = False,
) -> PodMeta:
    return PodMeta(
        uid=uid,
        namespace=namespace,
        name=name,
        owner_kind=kind,
        owner_name=owner,
        pod_template_hash=template_hash,
        deletion_timestamp=1.0 if deleting else None,
    )


def read(**metadata: Any) -> PodMeta:
    """A pod as the API serialises it, with ``metadata`` over pod_dict's, read by the
    pod watch's converter."""
    raw = pod_dict("ml", "p", "u1", NODE)
    raw["metadata"].update(metadata)
    meta = pod_meta_from_dict(raw)
    assert meta is not None
    return meta


def controller(kind: Any = "ReplicaSet", name: Any = "web-5d8f7c9b4f") -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": "o1", "controller": True}


# -- the rules -------------------------------------------------------------------------


def test_a_replicaset_whose_name_ends_in_the_pods_template_hash_is_its_deployment() -> None:
    assert resolve_owner(
        pod(kind="ReplicaSet", owner="web-5d8f7c9b4f", template_hash="5d8f7c9b4f"),
        now=NOW,
    ) == (
        "Deployment",
        "web",
    )
    dashed = pod(kind="ReplicaSet", owner="llm-chat-api-7c9b4f", template_hash="7c9b4f")
    assert resolve_owner(dashed, now=NOW) == ("Deployment", "llm-chat-api")


@pytest.mark.parametrize(
    ("owner", "template_hash"),
    [
        ("web-5d8f7c9b4f", "6f9c8d7b5c"),  # the hash of another template
        ("web-5d8f7c9b4f", None),  # no pod-template-hash label: a ReplicaSet made by hand
        ("5d8f7c9b4f", "5d8f7c9b4f"),  # the hash alone: no Deployment name before it
        ("-5d8f7c9b4f", "5d8f7c9b4f"),
        ("web5d8f7c9b4f", "5d8f7c9b4f"),  # no '-' before the hash
    ],
)
def test_a_replicaset_without_the_deployment_naming_stays_a_replicaset(
    owner: str, template_hash: str | None
) -> None:
    got = resolve_owner(pod(kind="ReplicaSet", owner=owner, template_hash=template_hash), now=NOW)
    assert got == ("ReplicaSet", owner)


def test_a_job_named_cronjob_dash_scheduled_minutes_is_its_cronjob() -> None:
    assert resolve_owner(pod(kind="Job", owner="etl-embed-29145600"), now=NOW) == (
        "CronJob",
        "etl-embed",
    )
    # the controller before Kubernetes 1.21 wrote seconds since the epoch
    assert resolve_owner(pod(kind="Job", owner="nightly-1748736000"), now=NOW) == (
        "CronJob",
        "nightly",
    )


@pytest.mark.parametrize(
    "job",
    [
        "etl-embed-2914560a",  # a non-digit suffix
        "etl-embed-abcdefgh",
        "train-2",  # too few digits for a time: a Job made by hand
        "train-20240101123",  # too many
        "etl-29145600x",
        "29145600",  # no CronJob name before it
        "etl-\N{SUPERSCRIPT TWO}9145600",  # not an ASCII digit
        "etl-\N{ARABIC-INDIC DIGIT ONE}" * 8,
    ],
)
def test_a_job_without_the_cronjob_naming_stays_a_job(job: str) -> None:
    assert resolve_owner(pod(kind="Job", owner=job), now=NOW) == ("Job", job)


@pytest.mark.parametrize(
    "job",
    [
        "backup-20240501",  # a date a person wrote: minutes -> 2008, seconds -> 1970
        "backup-2024050112",  # YYYYMMDDHH: seconds -> 2034, minutes -> 5818
        "nightly-23667839",  # a minute before 2015-01-01
        "nightly-29530000",  # minutes -> 2026-02-23: past the snapshot's day
        "nightly-1767398400",  # seconds -> 2026-01-03: past the snapshot's day
        "nightly-029145600",  # a leading zero: the controller writes %d
    ],
)
def test_a_job_number_that_is_no_plausible_scheduled_time_stays_a_job(job: str) -> None:
    assert resolve_owner(pod(kind="Job", owner=job), now=NOW) == ("Job", job)
    # the edges: 2015-01-01 in minutes, and a day after the snapshot in seconds
    assert resolve_owner(pod(kind="Job", owner="a-23667840"), now=NOW) == ("CronJob", "a")
    assert resolve_owner(pod(kind="Job", owner="a-1767312000"), now=NOW) == ("CronJob", "a")


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("StatefulSet", "llm-pretrain"),
        ("DaemonSet", "dcgm-5d8f7c9b4f"),
        ("RayCluster", "ray-12345678"),  # an operator's kind: whatever its name looks like
        ("ReplicationController", "web-1"),
    ],
)
def test_other_controllers_are_given_as_they_are(kind: str, name: str) -> None:
    assert resolve_owner(pod(kind=kind, owner=name, template_hash="5d8f7c9b4f"), now=NOW) == (
        kind,
        name,
    )


def test_a_pod_without_a_controller_is_its_own_owner_and_an_unreadable_one_is_unknown() -> None:
    assert resolve_owner(pod(name="leaky-shell"), now=NOW) == ("Pod", "leaky-shell")
    assert (
        resolve_owner(pod(kind="", owner=""), now=NOW) is None
    )  # names one that could not be read
    assert resolve_owner(pod(kind="ReplicaSet", owner=None), now=NOW) is None


# -- what the pod watch reads ----------------------------------------------------------


def test_the_watch_reads_the_controller_entry_and_the_template_hash_label() -> None:
    refs = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "cm", "uid": "o0"},
        {**controller("Node", "n"), "controller": False},
        controller(),
    ]
    meta = read(ownerReferences=refs, labels={"app": "web", "pod-template-hash": "5d8f7c9b4f"})
    assert (meta.owner_kind, meta.owner_name) == ("ReplicaSet", "web-5d8f7c9b4f")
    assert meta.pod_template_hash == "5d8f7c9b4f"
    assert resolve_owner(meta, now=NOW) == ("Deployment", "web")


def test_a_pod_with_no_controller_entry_reads_as_bare() -> None:
    for refs in (
        None,
        [],
        [{**controller(), "controller": False}],
        [{**controller(), "controller": "true"}],
    ):
        meta = read(ownerReferences=refs) if refs is not None else read()
        assert (meta.owner_kind, meta.owner_name) == (None, None), refs
        assert resolve_owner(meta, now=NOW) == ("Pod", "p")


@pytest.mark.parametrize(
    "refs",
    [
        [controller(name="x" * 254)],  # longer than any object name (253)
        [controller(name="w" * 10_000_000)],
        [controller(kind="K" * 64)],  # longer than any kind (63)
        [controller(kind=None)],
        [controller(name=7)],
        [controller(name="")],
        [controller(name="web\n5d8f")],  # not printable
        [{"controller": True}],
        "ReplicaSet/web",  # not a list
        {"kind": "ReplicaSet"},
        # more entries than are looked through, and no controller among the first
        [{"kind": "ConfigMap", "name": f"c{i}"} for i in range(MAX_OWNER_REFERENCES)]
        + [controller()],
        [{"kind": "ConfigMap", "name": "c"}] * 100_000,
    ],
)
def test_a_controller_that_cannot_be_read_is_unknown_not_bare(refs: Any) -> None:
    meta = read(ownerReferences=refs)
    assert meta.owner_kind == ""
    assert resolve_owner(meta, now=NOW) is None


def test_only_the_first_controller_entry_is_taken() -> None:
    meta = read(ownerReferences=[controller("StatefulSet", "a"), controller("Job", "b")])
    assert (meta.owner_kind, meta.owner_name) == ("StatefulSet", "a")


@pytest.mark.parametrize("labels", [{"pod-template-hash": "h" * 64}, {"pod-template-hash": 5}, "x"])
def test_a_template_hash_label_out_of_bounds_is_not_read(labels: Any) -> None:
    meta = read(ownerReferences=[controller()], labels=labels)
    assert meta.pod_template_hash is None
    assert resolve_owner(meta, now=NOW) == ("ReplicaSet", "web-5d8f7c9b4f")


# -- which pods get an owner -----------------------------------------------------------


def allocation(pod_name: str) -> Allocation:
    container = ContainerRef("ml", pod_name, "main")
    return Allocation(container, DEVICE, "GPU-0", "nvidia.com/gpu", shared=False)


def usage(pod_name: str) -> ContainerGpuUsage:
    return ContainerGpuUsage(ContainerRef("ml", pod_name, "main"), DEVICE, 1 << 30, 0.5, 1)


def watched(*pods: PodMeta, ok: bool = True) -> PodMetaSnapshot:
    return PodMetaSnapshot(ok=ok, timestamp=0.0, pods=pods)


def test_only_pods_that_hold_or_use_a_gpu_have_an_owner() -> None:
    pods = watched(
        pod("holder", "StatefulSet", "holder"),
        pod("user", "Job", "user-29145600", uid="u2"),
        pod("bystander", "ReplicaSet", "web-5d8f7c9b4f", "5d8f7c9b4f", uid="u3"),
    )
    attribution = Attribution(allocations=(allocation("holder"),), containers=(usage("user"),))
    assert pod_owners(pods, attribution, now=NOW) == (
        PodOwner("ml", "holder", "StatefulSet", "holder"),
        PodOwner("ml", "user", "CronJob", "user"),
    )


def test_no_owner_while_the_pod_watch_is_down_or_does_not_run() -> None:
    attribution = Attribution(allocations=(allocation("holder"),))
    assert pod_owners(watched(pod("holder"), ok=False), attribution, now=NOW) == ()
    assert pod_owners(None, attribution, now=NOW) == ()
    # a pod the watch does not list has no owner to tell (PodResources alone names it)
    assert pod_owners(watched(), attribution, now=NOW) == ()


def test_two_pods_of_one_name_with_different_owners_leave_it_unknown() -> None:
    attribution = Attribution(allocations=(allocation("w"),))
    first = pod("w", "StatefulSet", "a", uid="u1")
    second = pod("w", "StatefulSet", "b", uid="u2")
    assert pod_owners(watched(first, second), attribution, now=NOW) == ()
    # the one being deleted gives way to the one that is not
    deleting = pod("w", "StatefulSet", "a", uid="u1", deleting=True)
    assert pod_owners(watched(deleting, second), attribution, now=NOW) == (
        PodOwner("ml", "w", "StatefulSet", "b"),
    )
    # the same owner twice (a StatefulSet's pod made again) is that owner
    again = pod("w", "StatefulSet", "b", uid="u3")
    assert pod_owners(watched(second, again), attribution, now=NOW) == (
        PodOwner("ml", "w", "StatefulSet", "b"),
    )


# -- the simulator ---------------------------------------------------------------------


def test_a_scenario_pod_declares_its_owner_and_labels_and_the_api_serves_them() -> None:
    scenario = load_scenario("node-8gpu")
    chat = next(p for p in scenario.pods if p.name == "chat-a")
    assert chat.owner == ("ReplicaSet", "chat-5d8f7c9b4f")
    assert chat.labels["pod-template-hash"] == "5d8f7c9b4f"
    raw = pod_dict("ml", "p", "u1", NODE, owner=chat.owner, labels=chat.labels)
    (ref,) = raw["metadata"]["ownerReferences"]
    assert ref["controller"] is True and ref["apiVersion"] == "apps/v1"
    assert raw["metadata"]["labels"] == chat.labels


@pytest.mark.parametrize(
    ("owner", "message"),
    [
        ({"kind": "Job"}, "pods[0].owner: an owner needs a kind and a name"),
        ({"kind": "Job", "name": "j", "uid": "x"}, "pods[0].owner: unknown key 'uid'"),
        ("Job/j", "pods[0].owner"),
    ],
)
def test_a_scenario_owner_without_kind_and_name_is_refused_in_one_line(
    owner: object, message: str
) -> None:
    data = {"gpus": [{}], "pods": [{"name": "p", "owner": owner}]}
    with pytest.raises(ScenarioError, match="^" + re.escape(message)) as info:
        parse_scenario(data, "t")
    assert "\n" not in str(info.value)


# -- the served series -----------------------------------------------------------------


async def test_node_8gpu_serves_the_owners_of_its_gpu_pods_resolved() -> None:
    async with simulated_exporter("node-8gpu") as h:
        await h.advance(5)
        scrape = await h.scrape()
    owners = {
        (labels["namespace"], labels["pod"]): (labels["owner_kind"], labels["owner_name"])
        for labels, value in scrape.find("gpu_pod_owner_info")
        if value == 1
    }
    assert owners[("inference", "chat-a")] == ("Deployment", "chat")
    assert owners[("inference", "chat-c")] == ("Deployment", "chat")
    assert owners[("batch", "etl-embed")] == ("CronJob", "etl-embed")
    assert owners[("train", "llm-pretrain-1")] == ("StatefulSet", "llm-pretrain")
    assert owners[("debug", "leaky-shell")] == ("Pod", "leaky-shell")
    # batch/idle-reservation holds no GPU and runs nothing on one: no series
    assert ("batch", "idle-reservation") not in owners
    gpu_pods = {
        (labels["namespace"], labels["pod"]) for labels, _ in scrape.find("gpu_container_allocated")
    }
    assert set(owners) == gpu_pods


async def test_without_the_pod_watch_no_owner_is_served() -> None:
    async with simulated_exporter("node-8gpu", kube_api=False) as h:
        await h.advance(5)
        scrape = await h.scrape()
    assert scrape.find("gpu_container_allocated")  # PodResources still names the pods
    assert scrape.find("gpu_pod_owner_info") == []
