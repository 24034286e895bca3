"""ResourceSliceWatcher (real ``kubernetes`` client) against FakeKubeApi over loopback HTTP.

As in test_kube, the fake runs on its own event loop in a background thread and the
test polls ``snapshot()``; the devices are shaped like those NVIDIA's DRA driver
(``gpu.nvidia.com``) publishes: ``gpu-<minor>`` and MIG devices with their own UUIDs.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.model import ResourceSliceSnapshot, SliceDevice, SourceStatus
from exporter.sim.kube_api import (
    FakeKubeApi,
    pod_dict,
    resource_slice_dict,
    slice_device_dict,
    write_kubeconfig,
)
from exporter.sources.base import Cycle
from exporter.sources.kube import PodWatcher
from exporter.sources.resourceslices import (
    NOT_SERVED,
    ResourceSliceWatcher,
    slice_devices,
)
from tests.test_kube import fake, wait_for, wait_snapshot, watcher_factory

__all__ = ["fake"]  # a fixture, shared with test_kube

NODE = "gpu-node-1"
NVIDIA = "gpu.nvidia.com"
UUID_0 = "GPU-8d7f3c2a-1111-4a4a-9b9b-000000000000"
UUID_1 = "GPU-8d7f3c2a-1111-4a4a-9b9b-000000000001"
MIG_0 = "MIG-2ce7a541-c516-5dbc-a76e-26cc100d9b55"


def gpu(minor: int, uuid: str, **extra: str | int | bool) -> dict[str, object]:
    """A full GPU as the NVIDIA driver publishes it (unqualified names: its domain)."""
    return slice_device_dict(
        f"gpu-{minor}",
        {"type": "gpu", "uuid": uuid, "productName": "NVIDIA H100 80GB HBM3", **extra},
        versions={"driverVersion": "580.65.6", "cudaComputeCapability": "9.0"},
    )


def nvidia_slice(
    name: str, node: str = NODE, *devices: dict[str, object], **kw: object
) -> dict[str, Any]:
    return resource_slice_dict(name, node, devices or [gpu(0, UUID_0)], **kw)  # type: ignore[arg-type]


def uuids(snap: ResourceSliceSnapshot) -> dict[str, object]:
    return {d.name: d.attribute("uuid") for d in snap.devices}


def lists(fake: FakeKubeApi) -> int:
    return sum(1 for r in fake.requests if not r.watch and "resourceslices" in r.path)


@pytest.fixture
def make_watcher(tmp_path: Path) -> Iterator[Callable[..., ResourceSliceWatcher]]:
    yield from watcher_factory(ResourceSliceWatcher, tmp_path)


def watching(
    fake: FakeKubeApi, make_watcher: Callable[..., ResourceSliceWatcher], obj: dict[str, Any]
) -> ResourceSliceWatcher:
    """A watcher that has listed the slice ``obj`` and has its watch stream open."""
    fake.set_resource_slice(obj)
    watcher = make_watcher(fake.start_in_thread())
    synced(watcher, len(obj["spec"]["devices"]))
    wait_for(lambda: fake.watcher_count == 1, what="watch stream open")
    return watcher


def synced(watcher: ResourceSliceWatcher, n_devices: int) -> ResourceSliceSnapshot:
    return wait_snapshot(
        watcher,
        lambda s: s.ok and len(s.devices) == n_devices,
        f"ok snapshot with {n_devices} devices",
    )


def first_failure(watcher: ResourceSliceWatcher) -> ResourceSliceSnapshot:
    return wait_snapshot(
        watcher,
        lambda s: s.error not in (None, "not started", "waiting for the first ResourceSlice list"),
        "the first failed attempt",
    )


# -- conversion ------------------------------------------------------------------------


def test_attributes_flatten_to_python_values_with_the_drivers_domain_stripped() -> None:
    obj = resource_slice_dict(
        "s",
        NODE,
        [
            {
                "name": "gpu-0-mig-1g5gb-19-0",
                "attributes": {
                    "type": {"string": "mig"},
                    "gpu.nvidia.com/uuid": {"string": MIG_0},  # qualified with its own domain
                    "parentUUID": {"string": UUID_0},
                    "profile": {"string": "1g.5gb"},
                    "index": {"int": 3},
                    "gpu.nvidia.com/multiprocessor": {"bool": False},
                    "driverVersion": {"version": "580.65.6"},
                    "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},  # another domain
                    "notAnInt": {"int": True},  # ill-typed: a bool is not an int
                    "counts": {"ints": [1, 2]},  # alpha list form: no SliceAttribute
                    "empty": {},
                },
            },
            {"attributes": {"uuid": {"string": "nameless"}}},  # no name: skipped
        ],
    )
    assert slice_devices(obj) == (
        SliceDevice(
            NVIDIA,
            NODE,
            "gpu-0-mig-1g5gb-19-0",
            (
                ("driverVersion", "580.65.6"),
                ("index", 3),
                ("multiprocessor", False),
                ("parentUUID", UUID_0),
                ("profile", "1g.5gb"),
                ("resource.kubernetes.io/pcieRoot", "pci0000:00"),
                ("type", "mig"),
                ("uuid", MIG_0),
            ),
        ),
    )


def test_constructor_refuses_a_bare_driver_string_and_no_drivers() -> None:
    with pytest.raises(TypeError):
        ResourceSliceWatcher(NODE, drivers="gpu.nvidia.com")
    with pytest.raises(ValueError, match="at least one"):
        ResourceSliceWatcher(NODE, drivers=())
    with pytest.raises(ValueError, match="node_name"):
        ResourceSliceWatcher("")


# -- against the fake API server -------------------------------------------------------


def test_initial_list_gives_this_nodes_devices_of_the_gpu_drivers_only_sorted(
    fake: FakeKubeApi, make_watcher: Callable[..., ResourceSliceWatcher]
) -> None:
    fake.set_resource_slice(nvidia_slice("n1-gpu-b", NODE, gpu(1, UUID_1)))
    fake.set_resource_slice(nvidia_slice("n1-gpu-a", NODE, gpu(0, UUID_0)))
    fake.set_resource_slice(nvidia_slice("n2-gpu", "other-node", gpu(0, "GPU-other")))
    fake.set_resource_slice(
        resource_slice_dict(
            "n1-nic", NODE, [slice_device_dict("nic-0", {"uuid": "x"})], driver="nic.example.com"
        )
    )
    url = fake.start_in_thread()
    watcher = make_watcher(url)

    snap = synced(watcher, 2)
    assert snap.error is None
    assert [(d.driver, d.pool, d.name) for d in snap.devices] == [
        (NVIDIA, NODE, "gpu-0"),
        (NVIDIA, NODE, "gpu-1"),
    ]
    assert uuids(snap) == {"gpu-0": UUID_0, "gpu-1": UUID_1}
    assert snap.devices[0].attribute("driverVersion") == "580.65.6"
    first = fake.requests[0]
    assert (first.path, first.watch) == ("/apis/resource.k8s.io/v1/resourceslices", False)
    assert first.params["fieldSelector"] == f"spec.nodeName={NODE}"
    assert watcher.snapshot() is watcher.snapshot()  # unchanged: the same frozen object


def test_driver_filter_takes_the_configured_drivers(
    fake: FakeKubeApi, make_watcher: Callable[..., ResourceSliceWatcher]
) -> None:
    fake.set_resource_slice(nvidia_slice("n1-gpu", NODE, gpu(0, UUID_0)))
    fake.set_resource_slice(
        resource_slice_dict(
            "n1-other",
            NODE,
            [slice_device_dict("accel-0", {"uuid": "ACC-0"})],
            driver="accel.example.com",
        )
    )
    watcher = make_watcher(fake.start_in_thread(), drivers=("accel.example.com", NVIDIA))
    snap = synced(watcher, 2)
    assert {(d.driver, d.name) for d in snap.devices} == {
        ("accel.example.com", "accel-0"),
        (NVIDIA, "gpu-0"),
    }


def test_watch_applies_added_modified_and_deleted_slices_of_this_node_only(
    fake: FakeKubeApi, make_watcher: Callable[..., ResourceSliceWatcher]
) -> None:
    watcher = watching(fake, make_watcher, nvidia_slice("n1-a", NODE, gpu(0, UUID_0)))

    fake.set_resource_slice(nvidia_slice("n2-a", "other-node", gpu(5, "GPU-other")))
    fake.set_resource_slice(nvidia_slice("n1-b", NODE, gpu(1, UUID_1)))
    assert uuids(synced(watcher, 2)) == {"gpu-0": UUID_0, "gpu-1": UUID_1}

    # MODIFIED: gpu-1 partitioned into a MIG device, published in the same slice
    mig = slice_device_dict(
        "gpu-1-mig-1g5gb-19-0", {"type": "mig", "uuid": MIG_0, "parentUUID": UUID_1}
    )
    fake.set_resource_slice(nvidia_slice("n1-b", NODE, mig))
    wait_for(
        lambda: uuids(watcher.snapshot()) == {"gpu-0": UUID_0, "gpu-1-mig-1g5gb-19-0": MIG_0},
        what="MODIFIED applied",
    )

    fake.delete_resource_slice("n1-a")
    snap = synced(watcher, 1)
    assert [d.name for d in snap.devices] == ["gpu-1-mig-1g5gb-19-0"]
    assert snap.devices[0].attribute("parentUUID") == UUID_1
    assert lists(fake) == 1  # all of it through the one watch, no relist
    assert watcher.errors_total == 0


def test_only_the_newest_generation_of_a_pool_counts(
    fake: FakeKubeApi, make_watcher: Callable[..., ResourceSliceWatcher]
) -> None:
    fake.set_resource_slice(nvidia_slice("gen1", NODE, gpu(0, UUID_0), generation=1))
    watcher = make_watcher(fake.start_in_thread())
    synced(watcher, 1)
    # The driver republishes the pool: generation 2 appears before generation 1 goes.
    fake.set_resource_slice(nvidia_slice("gen2", NODE, gpu(0, UUID_1), generation=2))
    wait_for(lambda: uuids(watcher.snapshot()) == {"gpu-0": UUID_1}, what="generation 2 only")
    fake.delete_resource_slice("gen1")
    fake.set_resource_slice(nvidia_slice("other-pool", NODE, gpu(1, UUID_0), pool="pool-b"))
    snap = synced(watcher, 2)
    assert [(d.pool, d.name, d.attribute("uuid")) for d in snap.devices] == [
        (NODE, "gpu-0", UUID_1),
        ("pool-b", "gpu-1", UUID_0),
    ]


def test_pod_events_do_not_reach_the_slice_watch_and_share_one_resource_version(
    fake: FakeKubeApi, make_watcher: Callable[..., ResourceSliceWatcher], tmp_path: Path
) -> None:
    url = fake.start_in_thread()
    slices = make_watcher(url)
    pods = PodWatcher(NODE, kubeconfig=str(write_kubeconfig(tmp_path / "kc-pods", url)))
    pods.start()
    try:
        synced(slices, 0)
        wait_for(lambda: fake.watcher_count == 2, what="both watches open")
        fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE))
        rv = int(fake.set_resource_slice(nvidia_slice("n1-a", NODE, gpu(0, UUID_0))))
        wait_for(lambda: len(pods.snapshot().pods) == 1, what="pod through the pod watch")
        assert [d.name for d in synced(slices, 1).devices] == ["gpu-0"]
        assert rv == fake.resource_version  # one counter across both collections
        assert lists(fake) == 1  # the slice watch was not broken by a pod object
    finally:
        pods.close()


@pytest.mark.slow  # waits on real retry timers (~1 s)
def test_old_api_server_404_means_no_dra_is_up_and_empty_and_said_once(
    fake: FakeKubeApi,
    make_watcher: Callable[..., ResourceSliceWatcher],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A cluster before 1.34 has no DRA: not an outage (GPUExporterSourceDown must not
    # page on every node of it), one INFO line, asked again only after not_served_retry_s.
    fake.set_resource_slices_served(False)
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE))
    caplog.set_level(logging.INFO, logger="exporter.sources.kube_watch")
    url = fake.start_in_thread()
    watcher = make_watcher(url, not_served_retry_s=60.0)
    deadline = time.monotonic() + 10
    while not fake.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    snap = watcher.snapshot()
    while snap.error is not None and time.monotonic() < deadline:
        time.sleep(0.02)
        snap = watcher.snapshot()
    assert snap.ok
    assert snap.devices == ()
    assert watcher.status() == SourceStatus("resourceslices", True, None)
    assert NOT_SERVED == (
        "resource.k8s.io/v1 ResourceSlices are not served by this API server "
        "(Kubernetes before 1.34, or DRA disabled)"
    )
    said = [r.getMessage() for r in caplog.records if NOT_SERVED in r.getMessage()]
    assert said == [
        f"DRA ResourceSlice: list resourceslices ({url}): {NOT_SERVED}; "
        "nothing to watch, asking again later"
    ]
    assert [r.status for r in fake.requests] == [404]
    time.sleep(1.5)  # the ordinary backoff would have tried again by now
    assert lists(fake) == 1
    assert watcher.errors_total == 0


@pytest.mark.slow  # waits on real retry timers (~1 s)
def test_recovers_when_the_api_server_starts_serving_resource_slices(
    fake: FakeKubeApi, make_watcher: Callable[..., ResourceSliceWatcher]
) -> None:
    fake.set_resource_slices_served(False)
    fake.set_resource_slice(nvidia_slice("n1-a", NODE, gpu(0, UUID_0)))
    watcher = make_watcher(fake.start_in_thread(), not_served_retry_s=0.3)
    deadline = time.monotonic() + 10
    while not fake.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [r.status for r in fake.requests][:1] == [404]

    fake.set_resource_slices_served(True)  # upgraded to 1.34, or DRA enabled
    assert synced(watcher, 1).error is None


def test_is_the_resourceslices_source_and_close_stops_its_thread(
    fake: FakeKubeApi, make_watcher: Callable[..., ResourceSliceWatcher]
) -> None:
    idle = ResourceSliceWatcher(NODE)
    assert idle.name == "resourceslices"
    filled = Cycle(timestamp=0.0)
    idle.fill(filled)
    assert filled.readings.resource_slices is idle.snapshot()
    assert idle.status() == SourceStatus("resourceslices", False, "not started")
    assert idle.read(Cycle(timestamp=0.0)) == ResourceSliceSnapshot(
        ok=False, timestamp=idle.snapshot().timestamp, error="not started"
    )

    watcher = watching(fake, make_watcher, nvidia_slice("n1-a", NODE, gpu(0, UUID_0)))
    assert watcher.read(Cycle(timestamp=time.time())) is watcher.snapshot()
    assert watcher.status() == SourceStatus("resourceslices", True, None)

    began = time.monotonic()
    watcher.close()
    assert time.monotonic() - began < 2.0
    assert not any(
        t.name == "resourceslice-watcher" and t.is_alive() for t in threading.enumerate()
    )
    wait_for(lambda: fake.watcher_count == 0, what="server saw the stream close")
    assert [r.outcome for r in fake.requests if r.watch] == ["closed"]


def relisted(fake: FakeKubeApi, times: int) -> bool:
    return lists(fake) == times


@pytest.mark.slow  # real relist waits
def test_410_gone_twice_in_a_row_relists_each_time_and_never_marks_the_source_down(
    fake: FakeKubeApi,
    make_watcher: Callable[..., ResourceSliceWatcher],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One resourceVersion counter spans every collection: pods churning on a busy cluster
    # push a quiet ResourceSlice watch's version out of the server's history, so it can
    # be answered 410 Gone again right after its relist. A 410 is routine: the relist
    # that follows it is current data, so the source stays up and counts no error.
    caplog.set_level(logging.INFO, logger="exporter.sources.kube_watch")
    watcher = watching(fake, make_watcher, nvidia_slice("n1-a", NODE, gpu(0, UUID_0)))
    for round_ in (1, 2, 3):
        fake.expire_history()  # in-stream 410 on the open watch
        wait_for(functools.partial(relisted, fake, round_ + 1), what=f"relist {round_}")
        wait_for(lambda: fake.watcher_count == 1, what="watch reopened")
        assert watcher.status() == SourceStatus("resourceslices", True, None)
    assert watcher.errors_total == 0
    assert [d.name for d in watcher.snapshot().devices] == ["gpu-0"]
    down = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not down, down
