"""KubeWriteClient (real ``kubernetes`` client) against FakeKubeApi's write side over
loopback HTTP: Events, the Node condition patch, DeviceTaintRules, and what a down,
refusing, silent or slow API server does to a call (it fails within its deadline).

The fake runs on its own event loop in a background thread; the client's calls block
the test thread, as they block the exporter's writer thread.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from exporter.reporting.kube_client import KubeWriteClient, KubeWriteError
from exporter.sim.environment import SimEnvironment
from exporter.sim.kube_api import FakeKubeApi, write_kubeconfig
from exporter.sim.kube_writes import node_dict
from exporter.sim.scenario import load_scenario

NODE = "gpu-node-1"
CONTROLLER = "gpu-occupancy-exporter"


def micro(epoch: float) -> str:
    """RFC3339 with exactly six fraction digits (metav1.MicroTime)."""
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def pod_event(
    name: str = "trainer.17f0", reason: str = "GPUFatalXID", **extra: Any
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ml"},
        "eventTime": micro(1_700_000_000.25),
        "reportingController": CONTROLLER,
        "reportingInstance": NODE,
        "action": "Checked",
        "reason": reason,
        "regarding": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "trainer",
            "namespace": "ml",
            "uid": "uid-1",
        },
        "related": {"apiVersion": "v1", "kind": "Node", "name": NODE},
        "note": "XID 79 (fatal: fallen off the bus) on GPU 0 GPU-aaaa",
        "type": "Warning",
    }
    event.update(extra)
    return event


def wait_for(probe: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def fake() -> Iterator[FakeKubeApi]:
    api = FakeKubeApi()
    yield api
    api.writes.set_write_fault(None)  # release a held request before stopping
    api.stop_in_thread()


@pytest.fixture
def kubeconfig(fake: FakeKubeApi, tmp_path: Path) -> str:
    return str(write_kubeconfig(tmp_path / "kubeconfig", fake.start_in_thread()))


@pytest.fixture
def client(kubeconfig: str) -> Iterator[KubeWriteClient]:
    c = KubeWriteClient(kubeconfig, deadline_s=2.0)
    yield c
    c.close()


def failure(call: Callable[[], object]) -> KubeWriteError:
    with pytest.raises(KubeWriteError) as caught:
        call()
    return caught.value


# -- events ------------------------------------------------------------------------------


def test_create_then_patch_series_then_list_by_field_selector(
    fake: FakeKubeApi, client: KubeWriteClient
) -> None:
    client.create_event(pod_event())
    client.create_event(pod_event("trainer.17f1", reason="GPULost"))
    series = {"count": 250, "lastObservedTime": micro(1_700_000_060.5)}
    client.patch_event("ml", "trainer.17f0", {"series": series})

    (fatal,) = fake.writes.events(field_selector="reason=GPUFatalXID")
    assert fatal["series"] == series
    assert fatal["regarding"]["name"] == "trainer"
    assert fatal["metadata"]["namespace"] == "ml" and fatal["metadata"]["uid"]
    assert [e["reason"] for e in fake.writes.events_regarding("Pod", "ml", "trainer")] == [
        "GPUFatalXID",
        "GPULost",
    ]
    assert fake.writes.events_regarding("Pod", "ml", "other") == []
    writes = [(w.method, w.content_type, w.status) for w in fake.writes.write_log]
    assert writes == [
        ("POST", "application/json", 201),
        ("POST", "application/json", 201),
        ("PATCH", "application/merge-patch+json", 200),
    ]


def test_cluster_wide_list_and_node_events_in_default(
    fake: FakeKubeApi, client: KubeWriteClient
) -> None:
    node_ref = {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid"}
    client.create_event(
        pod_event(f"{NODE}.1", reason="GPUOrphanedMemory", regarding=node_ref, related=None)
        | {"metadata": {"name": f"{NODE}.1", "namespace": "default"}}
    )
    client.create_event(pod_event())
    writes = fake.writes
    assert [e["reason"] for e in writes.events("regarding.kind=Node")] == ["GPUOrphanedMemory"]
    assert [e["metadata"]["namespace"] for e in writes.events("type=Warning")] == ["default", "ml"]
    assert len(writes.events(f"reportingController={CONTROLLER},regarding.name={NODE}")) == 1


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"reportingController": ""}, "reportingController: Required value"),
        ({"action": ""}, "action: Required value"),
        ({"reason": "R" * 129}, "reason: Invalid value"),
        ({"note": "é" * 513}, "message: Invalid value"),  # 1026 bytes: Go counts bytes
        ({"type": "Error"}, "has invalid value: Error"),
        ({"series": {"count": 1, "lastObservedTime": micro(1.0)}}, "should be at least 2"),
        ({"regarding": {"kind": "Node", "name": NODE}}, "does not match event.namespace"),
        ({"eventTime": None}, "eventTime: Required value"),
    ],
)
def test_invalid_events_are_refused_with_422_and_the_servers_message(
    fake: FakeKubeApi, client: KubeWriteClient, change: dict[str, Any], expected: str
) -> None:
    error = failure(lambda: client.create_event(pod_event() | change))
    assert error.status == 422
    assert expected in error.reason
    assert error.reason.startswith("create event in ml: HTTP 422: Event.events.k8s.io")
    assert "\n" not in error.reason
    assert fake.writes.events() == []


def test_event_decode_conflict_and_immutable_errors(
    fake: FakeKubeApi, client: KubeWriteClient
) -> None:
    # eventTime must be RFC3339 with six fraction digits: a decode error, 400
    error = failure(lambda: client.create_event(pod_event(eventTime="2024-05-01T12:00:00Z")))
    assert error.status == 400 and "parsing time" in error.reason
    client.create_event(pod_event())
    assert failure(lambda: client.create_event(pod_event())).status == 409  # AlreadyExists
    # only series may change on update
    error = failure(lambda: client.patch_event("ml", "trainer.17f0", {"note": "other"}))
    assert error.status == 422 and "message: Invalid value" in error.reason
    assert failure(lambda: client.patch_event("ml", "nope", {"series": None})).status == 404


def test_namespace_of_the_body_must_be_the_paths(fake: FakeKubeApi, kubeconfig: str) -> None:
    """The client posts to body.metadata.namespace; another namespace in the body than
    in the path is the real server's 400."""
    body = json.dumps(pod_event() | {"metadata": {"name": "x", "namespace": "other"}}).encode()
    url = _server_url(kubeconfig) + "/apis/events.k8s.io/v1/namespaces/ml/events"
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    assert caught.value.code == 400
    assert "does not match the namespace" in json.loads(caught.value.read())["message"]


def _server_url(kubeconfig: str) -> str:
    text = Path(kubeconfig).read_text(encoding="utf-8")
    return next(line.split("server:")[1].strip() for line in text.splitlines() if "server:" in line)


# -- the node condition ---------------------------------------------------------------


def test_node_condition_is_merged_by_type_and_the_others_stay(
    fake: FakeKubeApi, client: KubeWriteClient
) -> None:
    fake.writes.set_node(node_dict(NODE))
    assert {c["type"] for c in client.node_conditions(NODE)} == {
        "Ready",
        "MemoryPressure",
        "DiskPressure",
        "PIDPressure",
    }
    gpu = {
        "type": "GPUUnhealthy",
        "status": "True",
        "reason": "GPULost",
        "message": "GPU 0 (GPU-aaaa) is lost",
        "lastHeartbeatTime": "2024-05-01T12:00:00Z",
        "lastTransitionTime": "2024-05-01T12:00:00Z",
    }
    client.patch_node_conditions(NODE, [gpu])
    client.patch_node_conditions(NODE, [gpu | {"status": "False", "reason": "GPUsHealthy"}])

    conditions = {c["type"]: c for c in client.node_conditions(NODE)}
    assert conditions["Ready"]["status"] == "True"  # the kubelet's, untouched
    assert conditions["GPUUnhealthy"]["status"] == "False"
    assert conditions["GPUUnhealthy"]["reason"] == "GPUsHealthy"
    assert len(conditions) == 5
    patch = fake.writes.write_log[-1]
    assert (patch.method, patch.path) == ("PATCH", f"/api/v1/nodes/{NODE}/status")
    assert patch.content_type == "application/strategic-merge-patch+json"
    assert patch.body == {
        "status": {"conditions": [gpu | {"status": "False", "reason": "GPUsHealthy"}]}
    }


def test_a_merge_patch_would_have_replaced_the_conditions(
    fake: FakeKubeApi, kubeconfig: str
) -> None:
    """Why the client sends a strategic merge patch: the stand-in, like the real server,
    replaces a list whole under a JSON merge patch."""
    fake.writes.set_node(node_dict(NODE))
    url = _server_url(kubeconfig) + f"/api/v1/nodes/{NODE}/status"
    body = json.dumps({"status": {"conditions": [{"type": "GPUUnhealthy", "status": "True"}]}})
    request = urllib.request.Request(
        url, body.encode(), {"Content-Type": "application/merge-patch+json"}, method="PATCH"
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.status == 200
    node = fake.writes.node(NODE)
    assert node is not None
    assert [c["type"] for c in node["status"]["conditions"]] == ["GPUUnhealthy"]


def test_unknown_node_is_404(fake: FakeKubeApi, client: KubeWriteClient) -> None:
    assert failure(lambda: client.node_conditions("no-such-node")).status == 404
    assert failure(lambda: client.patch_node_conditions("no-such-node", [])).status == 404


# -- DRA device taint rules -----------------------------------------------------------


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        (("v1alpha3",), "v1alpha3"),  # Kubernetes 1.33-1.35, when enabled
        (("v1",), "v1"),
        (("v1alpha3", "v1beta2"), "v1beta2"),  # the newest served
        ((), None),  # resource.k8s.io/v1 is served, without devicetaintrules
    ],
)
def test_device_taint_rule_version_from_discovery(
    fake: FakeKubeApi, client: KubeWriteClient, versions: tuple[str, ...], expected: str | None
) -> None:
    fake.writes.set_device_taint_versions(versions)
    assert client.device_taint_rule_version() == expected


def test_no_resource_group_at_all_is_none(fake: FakeKubeApi, client: KubeWriteClient) -> None:
    fake.set_resource_slices_served(False)
    fake.writes.set_device_taint_versions(())
    assert client.device_taint_rule_version() is None


def taint_rule(node: str, device: str, value: str = "XID79") -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"gpu-occupancy-exporter-{node}-{device}",
            "labels": {
                "app.kubernetes.io/managed-by": "gpu-occupancy-exporter",
                "gpu-occupancy-exporter/node": node,
            },
        },
        "spec": {
            "deviceSelector": {"driver": "gpu.nvidia.com", "pool": node, "device": device},
            "taint": {"key": "gpu.nvidia.com/unhealthy", "value": value, "effect": "None"},
        },
    }


def test_device_taint_rules_create_list_delete(fake: FakeKubeApi, client: KubeWriteClient) -> None:
    version = client.device_taint_rule_version()
    assert version == "v1alpha3"
    client.create_device_taint_rule(version, taint_rule(NODE, "gpu-0"))
    client.create_device_taint_rule(version, taint_rule("other-node", "gpu-0"))
    mine = "app.kubernetes.io/managed-by=gpu-occupancy-exporter,gpu-occupancy-exporter/node=" + NODE
    (rule,) = client.list_device_taint_rules(version, mine)
    assert rule["spec"]["taint"]["effect"] == "None"
    assert rule["spec"]["taint"]["timeAdded"]  # set by the server
    assert len(client.list_device_taint_rules(version, "")) == 2

    client.delete_device_taint_rule(version, rule["metadata"]["name"])
    client.delete_device_taint_rule(version, rule["metadata"]["name"])  # 404: already gone
    assert client.list_device_taint_rules(version, mine) == []
    assert [r["metadata"]["name"] for r in fake.writes.device_taint_rules()] == [
        "gpu-occupancy-exporter-other-node-gpu-0"
    ]
    # a taint value must be a label value; a version not served is 404
    error = failure(
        lambda: client.create_device_taint_rule(version, taint_rule(NODE, "gpu-1", "XID 79"))
    )
    assert error.status == 422 and "spec.taint.value" in error.reason
    assert failure(lambda: client.list_device_taint_rules("v1", "")).status == 404


# -- faults: refused, down, silent, slow ---------------------------------------------------


def test_forbidden_is_403_with_the_servers_message(
    fake: FakeKubeApi, client: KubeWriteClient
) -> None:
    fake.writes.set_write_fault("forbidden")
    error = failure(lambda: client.create_event(pod_event()))
    assert error.status == 403 and "forbidden" in error.reason
    assert failure(lambda: client.node_conditions(NODE)).status == 403


def test_error_once_then_slow_answers(fake: FakeKubeApi, client: KubeWriteClient) -> None:
    fake.writes.set_node(node_dict(NODE))
    fake.writes.set_write_fault("error", times=1)
    assert failure(lambda: client.create_event(pod_event())).status == 500
    client.create_event(pod_event())  # the fault was for one request
    fake.writes.set_write_fault("slow", delay_s=0.2)
    began = time.monotonic()
    client.patch_node_conditions(NODE, [{"type": "GPUUnhealthy", "status": "False"}])
    assert time.monotonic() - began >= 0.2


def test_silent_server_fails_the_call_at_its_deadline(fake: FakeKubeApi, kubeconfig: str) -> None:
    client = KubeWriteClient(kubeconfig, deadline_s=0.5)
    fake.writes.set_write_fault("hang")
    began = time.monotonic()
    error = failure(lambda: client.create_event(pod_event()))
    took = time.monotonic() - began
    # The deadline's cut, or the socket's read timeout (set to the deadline too) when a
    # loaded machine runs it first: either way the call ends at its deadline.
    assert error.status is None and ("cut" in error.reason or "timed out" in error.reason)
    assert 0.45 <= took < 1.5, took
    client.close()


def test_cut_from_another_thread_ends_a_hung_request(fake: FakeKubeApi, kubeconfig: str) -> None:
    client = KubeWriteClient(kubeconfig, deadline_s=30.0)
    fake.writes.set_write_fault("hang")
    caught: list[BaseException] = []

    def call() -> None:
        try:
            client.create_event(pod_event())
        except BaseException as exc:
            caught.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: len(fake.writes.write_log) == 1, what="the request to arrive")
    began = time.monotonic()
    client.cut()
    caller.join(2.0)
    assert not caller.is_alive()
    assert time.monotonic() - began < 1.0
    (error,) = caught
    assert isinstance(error, KubeWriteError)
    assert error.status is None and "request cut" in error.reason
    client.close()


def test_stopped_api_server_is_no_answer(fake: FakeKubeApi, client: KubeWriteClient) -> None:
    client.create_event(pod_event())
    fake.stop_in_thread()
    began = time.monotonic()
    error = failure(lambda: client.create_event(pod_event("trainer.2")))
    assert error.status is None
    assert "Connection refused" in error.reason or "reset" in error.reason.lower()
    assert time.monotonic() - began < 1.5


def test_no_kubeconfig_is_no_answer(tmp_path: Path) -> None:
    client = KubeWriteClient(str(tmp_path / "missing"), deadline_s=0.5)
    error = failure(lambda: client.create_event(pod_event()))
    assert error.status is None and "configuration" in error.reason
    client.close()
    assert "closed" in failure(lambda: client.create_event(pod_event())).reason


def test_the_generated_api_classes_are_never_loaded(client: KubeWriteClient) -> None:
    """~20 MiB: the requests are built with param_serialize/call_api instead."""
    client.device_taint_rule_version()
    client.create_event(pod_event())
    loaded = [m for m in sys.modules if m.startswith("kubernetes.client.api.")]
    assert loaded == []


def test_constructing_the_client_imports_no_kubernetes() -> None:
    code = (
        "import sys\n"
        "from exporter.reporting.kube_client import KubeWriteClient\n"
        "KubeWriteClient(None).close()\n"
        "bad = sorted(m for m in sys.modules if m == 'kubernetes' or m.startswith('kubernetes.'))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr


async def test_the_simulated_node_has_its_node_object(tmp_path: Path) -> None:
    """SimEnvironment seeds the Node of its scenario, so a condition can be patched on it."""
    scenario = load_scenario("node-8gpu")
    env = SimEnvironment(scenario, nvml=False)
    paths = await env.start()
    try:
        assert paths.kubeconfig is not None
        client = KubeWriteClient(str(paths.kubeconfig), deadline_s=2.0)
        conditions = await asyncio.to_thread(client.node_conditions, scenario.node_name)
        ready = next(c for c in conditions if c["type"] == "Ready")
        assert ready["status"] == "True"
        client.close()
    finally:
        await env.stop()
