"""Attacks on the DeviceTaintRule watch and its use in capacity (an adversary's tests).

Some of these FAIL on purpose: each failing one shows a bug found by attacking
``exporter/sources/device_taint_rules.py`` / ``analysis/capacity.py`` (the docstring of
each says what it holds and why). The rest pin behaviour worth keeping.

Discovery answers no API server gives (garbage, a version listed whose collection 404s)
come from a few lines of aiohttp here (``Stub``); the rest from the API stand-in
(``exporter/sim/kube_api.py``). The real ``kubernetes`` client runs throughout.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from exporter.analysis.capacity import node_capacity
from exporter.model import (
    DeviceCapacity,
    DeviceTaintRuleSnapshot,
    GpuHealth,
    GpuSample,
    HealthReason,
    NodeScheduling,
    NodeSchedulingSnapshot,
    PodResourcesSnapshot,
    ResourceSliceSnapshot,
    SliceDevice,
)
from exporter.model.readings import AllocatableDevices
from exporter.sim.kube_api import FakeKubeApi, write_kubeconfig
from exporter.sources.device_taint_rules import DeviceTaintRuleWatcher, rule_selector

DRIVER = "gpu.nvidia.com"
POOL = "node-a"
WAITING = "waiting for the first DeviceTaintRule list"


def rule_dict(name: str, effect: str = "NoSchedule", selector: Any = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"taint": {"key": "example.com/maintenance", "effect": effect}}
    if selector is not None:
        spec["deviceSelector"] = selector
    return {"metadata": {"name": name}, "spec": spec}


def until(predicate: Callable[[], bool], timeout_s: float = 8.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Stub:
    """GET /apis/resource.k8s.io[/<version>[/devicetaintrules]] as the test sets them."""

    def __init__(self) -> None:
        self.group: Any = {"kind": "APIGroup", "versions": [{"version": "v1alpha3"}]}
        self.group_status = 200
        self.resources: dict[str, Any] = {"v1alpha3": {"resources": [{"name": "devicetaintrules"}]}}
        self.list_status = 200
        self.items: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    async def _group(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        if self.group_status != 200:
            status = {"kind": "Status", "code": self.group_status, "message": "not found"}
            return web.json_response(status, status=self.group_status)
        return web.json_response(self.group)

    async def _version(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        doc = self.resources.get(request.match_info["version"])
        if doc is None:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response(doc)

    async def _rules(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path_qs)
        if self.list_status != 200:
            status = {"kind": "Status", "code": self.list_status, "message": "not found"}
            return web.json_response(status, status=self.list_status)
        if request.query.get("watch") in ("true", "1"):
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await asyncio.sleep(float(request.query.get("timeoutSeconds", "5")))
            await resp.write_eof()
            return resp
        body = {"kind": "List", "metadata": {"resourceVersion": "5"}, "items": self.items}
        return web.Response(body=json.dumps(body), content_type="application/json")

    def start(self) -> str:
        app = web.Application()
        app.router.add_get("/apis/resource.k8s.io", self._group)
        app.router.add_get("/apis/resource.k8s.io/{version}", self._version)
        app.router.add_get("/apis/resource.k8s.io/{version}/devicetaintrules", self._rules)
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

        async def up() -> str:
            self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

        return asyncio.run_coroutine_threadsafe(up(), self._loop).result(10)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[tuple[Stub, str]]:
    server = Stub()
    url = server.start()
    try:
        yield server, str(write_kubeconfig(tmp_path / "kubeconfig", url))
    finally:
        server.stop()


def watching(kubeconfig: str, retry_s: float = 300.0) -> DeviceTaintRuleWatcher:
    watcher = DeviceTaintRuleWatcher(
        "node-a", kubeconfig=kubeconfig, drivers=(DRIVER,), not_served_retry_s=retry_s
    )
    watcher.start()
    return watcher


# -- discovery -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("garbage", [{}, None, [], {"kind": "APIGroup"}])
def test_a_discovery_answer_that_is_not_an_api_group_is_not_evidence_of_no_rules(
    stub: tuple[Stub, str], garbage: Any
) -> None:
    """BUG: a 200 whose body is not an APIGroup (a proxy's ``{}``, ``null``) is taken as
    "DeviceTaintRules are not served": the source is up with no rules, so a rule that
    taints a free GPU is ignored and the GPU served as allocatable. Only a 404 says the
    group is not served; garbage is unknown (down)."""
    server, kubeconfig = stub
    server.group = garbage
    server.items = [rule_dict("drain", selector={"driver": DRIVER})]
    watcher = watching(kubeconfig)
    try:
        assert until(lambda: watcher.snapshot().error != WAITING)
        time.sleep(0.2)
        snap = watcher.snapshot()
    finally:
        watcher.stop()
    assert not (snap.ok and snap.rules == ()), "garbage discovery read as 'not served'"


@pytest.mark.slow
def test_a_version_document_without_resources_is_not_evidence_of_no_rules(
    stub: tuple[Stub, str],
) -> None:
    """BUG: the same for the version's APIResourceList: a 200 without a ``resources``
    list falls through to "not served" (up, no rules)."""
    server, kubeconfig = stub
    server.resources = {"v1alpha3": {"oops": True}}
    server.items = [rule_dict("drain", selector={"driver": DRIVER})]
    watcher = watching(kubeconfig)
    try:
        assert until(lambda: watcher.snapshot().error != WAITING)
        time.sleep(0.2)
        snap = watcher.snapshot()
    finally:
        watcher.stop()
    assert not (snap.ok and snap.rules == ())


@pytest.mark.slow
def test_a_list_404_after_discovery_found_the_version_is_not_up_with_no_rules(
    stub: tuple[Stub, str],
) -> None:
    """BUG: discovery says v1alpha3 serves devicetaintrules, its LIST answers 404 (an HA
    API server mid-upgrade: the two answers came from different servers). The source is
    up with no rules for NOT_SERVED_RETRY_S (5 minutes) before it asks again: a
    contradiction read as evidence that nothing is tainted."""
    server, kubeconfig = stub
    server.list_status = 404
    watcher = watching(kubeconfig)
    try:
        assert until(lambda: watcher.snapshot().error != WAITING)
        time.sleep(0.2)
        snap = watcher.snapshot()
    finally:
        watcher.stop()
    assert not (snap.ok and snap.rules == ()), "a LIST 404 right after discovery read as none"


@pytest.mark.slow
def test_a_discovery_404_does_not_poison_the_next_request(stub: tuple[Stub, str]) -> None:
    """BUG: ``_discover_get`` releases a 404 answer to the pool without reading or closing
    it; the next request on that connection fails (``ResponseNotReady: Request-sent``),
    so a cluster without the API flaps the source down (a WARNING and a counted error)
    on every other retry, and the DRA capacity goes unknown meanwhile."""
    server, kubeconfig = stub
    server.group_status = 404
    server.items = [rule_dict("drain", selector={"driver": DRIVER})]
    watcher = watching(kubeconfig, retry_s=0.1)
    try:
        assert until(lambda: watcher.status().up)
        server.group_status = 200  # the feature switched on
        assert until(lambda: len(watcher.snapshot().rules) == 1)
        errors = watcher.errors_total
    finally:
        watcher.stop()
    assert errors == 0, "a request failed on a connection a 404 left unread"


# -- size ------------------------------------------------------------------------------

_CHILD = """
import resource, sys, time
from exporter.sources.device_taint_rules import DeviceTaintRuleWatcher
import kubernetes  # noqa: F401 -- loaded before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
w = DeviceTaintRuleWatcher("n", kubeconfig=sys.argv[1], drivers=("gpu.nvidia.com",))
w.start()
deadline = time.monotonic() + 60
while w.snapshot().error == "waiting for the first DeviceTaintRule list":
    assert time.monotonic() < deadline
    time.sleep(0.05)
print(w.snapshot().ok, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
w.stop()
"""


@pytest.mark.slow
def test_other_drivers_rules_cannot_blow_up_every_exporters_memory(
    stub: tuple[Stub, str],
) -> None:
    """BUG: MAX_RULES (5000) counts only the rules kept; the LIST is read whole (up to
    MAX_LIST_BYTES, 64 MiB) and parsed before anything is dropped. 100,000 rules of
    another driver (~50 MiB: a NIC health monitor's, one per device of the cluster)
    cost every GPU node's exporter ~260 MiB of extra peak RSS per LIST (measured
    here: +263 MiB), over the chart's 256Mi limit; and the source stays up. Every
    node does it again every resync (300 s)."""
    server, kubeconfig = stub
    server.items = [
        {
            "metadata": {
                "name": f"nic-rule-{i:06d}",
                "uid": f"{i:032x}",
                "resourceVersion": str(i),
                "labels": {"app.kubernetes.io/managed-by": "nic-health"},
            },
            "spec": {
                "deviceSelector": {
                    "driver": "nic.example.com",
                    "pool": f"node-{i % 5000:05d}",
                    "device": f"nic-{i % 8}",
                },
                "taint": {"key": "example.com/unhealthy", "value": "down", "effect": "NoSchedule"},
            },
        }
        for i in range(100_000)
    ]
    out = subprocess.run(
        ["timeout", "90", sys.executable, "-c", _CHILD, kubeconfig],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout.split()
    _ok, grown_mib = out[0], int(out[1])
    assert grown_mib < 128, f"one LIST of other drivers' rules grew the exporter {grown_mib} MiB"


# -- what a rule means (the API's words) ----------------------------------------------


def test_a_selector_field_this_code_does_not_know_makes_the_rule_opaque() -> None:
    """BUG (forward compatibility): the version picked is the newest served, v1 included
    (not yet released). A selector field added there (as 1.33-1.34 had
    ``deviceClassName`` and CEL ``selectors``) narrows the rule further, but it is
    ignored and the rule read as selecting every device its exact fields match: free
    GPUs counted disrupted that are not. Unknown selector fields: opaque."""
    read = rule_selector(
        rule_dict("r", selector={"driver": DRIVER, "attributeSelector": {"model": "H200"}})
    )
    assert read is not None and read.opaque


def test_effects_are_exact_and_selectors_follow_the_api() -> None:
    """Pinned: effect names are case-sensitive ("Consumers must treat unknown effects
    like None"), an empty selector selects every device of every driver, a ``pool``
    alone selects that pool of any driver, and no selector selects nothing."""
    snap = capacity_with(rule_dict("lower", "noschedule", {"driver": DRIVER}))
    assert (snap.disrupted, snap.allocatable) == (0, 1)
    assert capacity_with(rule_dict("every", "NoSchedule", {})).allocatable == 0
    assert capacity_with(rule_dict("pool", "NoExecute", {"pool": POOL})).allocatable == 0
    assert capacity_with(rule_dict("other-pool", "NoExecute", {"pool": "x"})).allocatable == 1
    assert capacity_with(rule_dict("none", "NoSchedule")).allocatable == 1


def test_the_writers_own_rule_on_an_unhealthy_gpu_is_not_counted_twice() -> None:
    """Pinned: the rule --dra-device-taints writes for an unhealthy GPU (NoSchedule with
    --dra-device-taint-effect) selects a device that is already not healthy: it counts
    as unhealthy only, never also as disrupted."""
    health = [
        GpuHealth(0, "GPU-0"),
        GpuHealth(1, "GPU-1", (HealthReason("xid", "unhealthy", "Xid 79"),)),
    ]
    selector = {"driver": DRIVER, "pool": POOL, "device": "gpu-1"}
    cap = capacity_with(rule_dict("ours", "NoSchedule", selector), health=health)
    assert (cap.healthy, cap.unhealthy, cap.allocated) == (1, 1, 1)
    assert (cap.disrupted, cap.allocatable) == (0, 0)
    assert dict(cap.disrupted_by)["device_taint"] == 0


GPUS = [GpuSample(index=i, uuid=f"GPU-{i}") for i in range(2)]
SLICES = ResourceSliceSnapshot(
    ok=True,
    timestamp=0.0,
    devices=tuple(SliceDevice(DRIVER, POOL, f"gpu-{i}", (("uuid", f"GPU-{i}"),)) for i in range(2)),
)


def capacity_with(obj: dict[str, Any], health: list[GpuHealth] | None = None) -> DeviceCapacity:
    """gpu-0 allocated, gpu-1 free; the one rule ``obj`` as the watch would keep it."""
    from exporter.model import Allocation, ContainerRef, DeviceRef

    read = rule_selector(obj)
    assert read is not None
    (cap,) = [
        c
        for c in node_capacity(
            GPUS,
            health or [GpuHealth(i, f"GPU-{i}") for i in range(2)],
            PodResourcesSnapshot(
                ok=True,
                timestamp=0.0,
                allocatable=(AllocatableDevices("nvidia.com/gpu", ()),),
                allocatable_ok=True,
            ),
            [
                Allocation(
                    ContainerRef("ml", "t", "m"),
                    DeviceRef(0, "GPU-0", None),
                    f"{POOL}/gpu-0",
                    DRIVER,
                    False,
                )
            ],
            SLICES,
            nvml_ok=True,
            scheduling=NodeSchedulingSnapshot(ok=True, timestamp=0.0, node=NodeScheduling()),
            taint_rules=DeviceTaintRuleSnapshot(ok=True, timestamp=0.0, rules=(read,)),
        )
        if c.resource == DRIVER
    ]
    return cap


# -- the watch against the API stand-in ---------------------------------------------------


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[FakeKubeApi, str]]:
    api = FakeKubeApi()
    url = api.start_in_thread()
    try:
        yield api, str(write_kubeconfig(tmp_path / "kubeconfig", url))
    finally:
        api.stop_in_thread()


@pytest.mark.slow
def test_a_rule_flipped_to_none_and_back_and_deletes_of_unknown_rules(
    fake: tuple[FakeKubeApi, str],
) -> None:
    """Pinned: MODIFIED events carry the effect through (NoSchedule -> None ->
    NoExecute), a DELETED event for a rule never seen is a no-op, and over MAX_RULES
    kept rules the source is down with nothing (unknown), never a part."""
    api, kubeconfig = fake
    selector = {"driver": DRIVER, "device": "gpu-1"}
    api.writes.set_device_taint_rule(rule_dict("flip", "NoSchedule", selector))
    watcher = watching(kubeconfig)
    try:
        assert until(lambda: watcher.snapshot().ok)

        def effect() -> str | None:
            rules = watcher.snapshot().rules
            return rules[0].effect if rules else None

        api.writes.set_device_taint_rule(rule_dict("flip", "None", selector))
        assert until(lambda: effect() == "None"), "effect None not seen"
        api.writes.set_device_taint_rule(rule_dict("flip", "NoExecute", selector))
        assert until(lambda: effect() == "NoExecute"), "effect NoExecute not seen"
        ghost = {
            "type": "DELETED",
            "object": {"metadata": {"name": "ghost", "resourceVersion": "1"}},
        }
        assert api.send_raw(json.dumps(ghost).encode()) == 1
        time.sleep(0.3)
        snap = watcher.snapshot()
        assert snap.ok and [r.name for r in snap.rules] == ["flip"]
    finally:
        watcher.stop()
