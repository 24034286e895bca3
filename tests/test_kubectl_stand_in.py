"""What the API stand-in serves for a real client besides the exporter's own requests:
discovery, one pod by name, and the core/v1 view of the events.k8s.io/v1 Events.
(tests/test_kubectl_reads_exporter_writes.py runs kubectl itself against it.)"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from exporter.sim.kube_api import FakeKubeApi, pod_dict
from exporter.sim.kube_core_events import core_event, event_row, human_duration
from exporter.sim.kube_writes import node_dict

V1_EVENT: dict[str, Any] = {
    "apiVersion": "events.k8s.io/v1",
    "kind": "Event",
    "metadata": {"name": "train.1", "namespace": "ml"},
    "eventTime": "2026-11-28T10:00:00.000000Z",
    "series": {"count": 4, "lastObservedTime": "2026-11-28T10:02:00.000000Z"},
    "reportingController": "gpu-occupancy-exporter",
    "reportingInstance": "node-a",
    "action": "Sampled",
    "reason": "GPUFatalXID",
    "type": "Warning",
    "note": "XID 79 on GPU 0",
    "regarding": {"kind": "Pod", "namespace": "ml", "name": "train", "uid": "u-1"},
    "related": {"kind": "Node", "name": "node-a"},
}


@pytest.fixture
def api() -> Iterator[tuple[FakeKubeApi, str]]:
    fake = FakeKubeApi()
    fake.writes.set_node(node_dict("node-a"))
    fake.set_pod(pod_dict("ml", "train", "u-1", "node-a", containers=[("main", "c1")]))
    url = fake.start_in_thread()
    try:
        yield fake, url
    finally:
        fake.stop_in_thread()


def _get(url: str, accept: str = "application/json") -> tuple[int, Any]:
    request = urllib.request.Request(url, headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _post_event(url: str, event: dict[str, Any]) -> None:
    request = urllib.request.Request(
        f"{url}/apis/events.k8s.io/v1/namespaces/{event['metadata']['namespace']}/events",
        data=json.dumps(event).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 201


def test_core_event_renames_the_fields_conversion_go_renames_and_keeps_the_rest() -> None:
    core = core_event(V1_EVENT)
    assert (core["apiVersion"], core["kind"]) == ("v1", "Event")
    assert core["involvedObject"] == V1_EVENT["regarding"]
    assert core["message"] == "XID 79 on GPU 0"
    assert core["reportingComponent"] == "gpu-occupancy-exporter"  # json name of the field
    assert core["reportingInstance"] == "node-a"
    assert core["series"] == V1_EVENT["series"]
    assert core["related"] == V1_EVENT["related"]
    assert (core["firstTimestamp"], core["lastTimestamp"]) == (None, None)  # no omitempty
    assert core["source"] == {}
    assert "count" not in core  # int32 omitempty, 0
    assert not {"note", "regarding", "reportingController"} & core.keys()


def test_human_duration_follows_apimachinery() -> None:
    cases = {-5: "<invalid>", -1: "0s", 0: "0s", 119: "119s", 120: "2m", 175: "2m55s"}
    cases |= {600: "10m", 3 * 3600: "3h", 3 * 3600 + 60: "3h1m", 30 * 3600: "30h"}
    cases |= {49 * 3600: "2d1h", 30 * 86400: "30d"}
    assert {s: human_duration(s) for s in cases} == cases


def test_a_series_event_row_shows_the_series_count_and_its_last_observed_time() -> None:
    now = 1795860000.0  # 2026-11-28T10:00:00Z
    row = event_row(core_event(V1_EVENT), now + 150)
    assert row == [
        "30s",
        "Warning",
        "GPUFatalXID",
        "pod/train",
        "",
        "gpu-occupancy-exporter, node-a",
        "XID 79 on GPU 0",
        "2m30s",
        4,
        "train.1",
    ]


def test_discovery_lists_core_v1_events_pods_and_nodes_and_the_served_groups(api) -> None:
    fake, url = api
    status, versions = _get(f"{url}/api")
    assert (status, versions["kind"], versions["versions"]) == (200, "APIVersions", ["v1"])
    _, core = _get(f"{url}/api/v1")
    names = {r["name"]: r for r in core["resources"]}
    assert {"events", "pods", "nodes"} <= names.keys()
    assert names["pods"]["namespaced"] and not names["nodes"]["namespaced"]
    _, groups = _get(f"{url}/apis")
    listed = {g["name"]: [v["version"] for v in g["versions"]] for g in groups["groups"]}
    assert listed == {"events.k8s.io": ["v1"], "resource.k8s.io": ["v1", "v1alpha3"]}
    fake.set_resource_slices_served(False)
    fake.writes.set_device_taint_versions(())
    _, groups = _get(f"{url}/apis")
    assert [g["name"] for g in groups["groups"]] == ["events.k8s.io"]
    status, version = _get(f"{url}/version")
    assert (status, version["major"], version["minor"]) == (200, "1", "35")


def test_a_pod_is_served_by_namespace_and_name_and_a_missing_one_is_404(api) -> None:
    _, url = api
    status, pod = _get(f"{url}/api/v1/namespaces/ml/pods/train")
    assert (status, pod["kind"], pod["metadata"]["uid"]) == (200, "Pod", "u-1")
    status, body = _get(f"{url}/api/v1/namespaces/other/pods/train")
    assert (status, body["reason"]) == (404, "NotFound")


def test_core_v1_events_are_selected_by_involved_object_as_kubectl_describe_asks(api) -> None:
    _, url = api
    _post_event(url, V1_EVENT)
    other = {**V1_EVENT, "metadata": {"name": "other.1", "namespace": "ml"}}
    other["regarding"] = {**V1_EVENT["regarding"], "name": "other", "uid": "u-2"}
    _post_event(url, other)
    selector = (
        "involvedObject.name%3Dtrain%2CinvolvedObject.namespace%3Dml%2CinvolvedObject.uid%3Du-1"
    )
    status, listed = _get(f"{url}/api/v1/namespaces/ml/events?fieldSelector={selector}&limit=500")
    assert (status, listed["kind"], listed["apiVersion"]) == (200, "EventList", "v1")
    assert [e["metadata"]["name"] for e in listed["items"]] == ["train.1"]
    assert listed["items"][0]["message"] == "XID 79 on GPU 0"
    _, everywhere = _get(f"{url}/api/v1/events")
    assert len(everywhere["items"]) == 2
    status, one = _get(f"{url}/api/v1/namespaces/ml/events/other.1")
    assert (status, one["involvedObject"]["name"]) == (200, "other")


def test_a_core_v1_field_label_the_server_does_not_know_is_refused_with_400(api) -> None:
    _, url = api
    status, body = _get(f"{url}/api/v1/events?fieldSelector=regarding.name%3Dtrain")
    assert (status, body["reason"]) == (400, "BadRequest")


def test_get_events_asked_for_a_table_gets_the_servers_columns_and_row_metadata(api) -> None:
    _, url = api
    _post_event(url, V1_EVENT)
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
    status, table = _get(f"{url}/api/v1/events?limit=500", accept)
    assert (status, table["kind"], table["apiVersion"]) == (200, "Table", "meta.k8s.io/v1")
    shown = [c["name"] for c in table["columnDefinitions"] if c["priority"] == 0]
    assert shown == ["Last Seen", "Type", "Reason", "Object", "Message"]
    (row,) = table["rows"]
    assert row["cells"][2:4] == ["GPUFatalXID", "pod/train"]
    assert row["object"]["kind"] == "PartialObjectMetadata"
    assert row["object"]["metadata"]["namespace"] == "ml"


def test_the_event_tables_ages_count_on_the_api_servers_clock(api) -> None:
    fake, url = api
    _post_event(url, V1_EVENT)
    fake.server_time = lambda: 1795860000.0 + 150  # 10:02:30, series last seen 10:02:00
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
    _, table = _get(f"{url}/api/v1/namespaces/ml/events", accept)
    (row,) = table["rows"]
    assert (row["cells"][0], row["cells"][7]) == ("30s", "2m30s")
