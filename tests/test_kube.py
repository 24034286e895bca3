"""PodWatcher (real ``kubernetes`` client) against FakeKubeApi over loopback HTTP.

The fake runs on its own event loop in a background thread because the watcher does
blocking HTTP from its thread; the test thread drives both and polls ``snapshot()``.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest

from exporter.model import PodMeta, PodMetaSnapshot, SourceStatus
from exporter.sim.kube_api import FakeKubeApi, LoggedRequest, pod_dict, write_kubeconfig
from exporter.sources.base import Cycle
from exporter.sources.kube import PodWatcher, pod_meta_from_dict
from exporter.sources.kube_watch import KubeWatchSource, WatchSnapshot

NODE = "gpu-node-1"
CID_A = "a" * 64
CID_B = "b" * 64
CID_C = "c" * 64


def wait_for(probe: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll until ``probe()`` holds; bounded so a broken watcher fails, not hangs."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


S = TypeVar("S", bound=WatchSnapshot)


def wait_snapshot(
    watcher: KubeWatchSource[Any, Any, S], holds: Callable[[S], bool], what: str
) -> S:
    """The first snapshot for which ``holds`` is true (one read, so no torn checks);
    for any list + watch source (pods here, ResourceSlices in test_resourceslices)."""
    seen: list[S] = []

    def probe() -> bool:
        seen.append(snap := watcher.snapshot())
        return holds(snap)

    wait_for(probe, what=what)
    return seen[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def by_name(snap: PodMetaSnapshot) -> dict[str, PodMeta]:
    return {p.name: p for p in snap.pods}


def lists(fake: FakeKubeApi) -> int:
    return sum(1 for r in fake.requests if not r.watch)


@pytest.fixture
def fake() -> Iterator[FakeKubeApi]:
    api = FakeKubeApi()
    yield api
    api.stop_in_thread()


W = TypeVar("W", bound=KubeWatchSource[Any, Any, Any])


def watcher_factory(kind: type[W], tmp_path: Path) -> Iterator[Callable[..., W]]:
    """Body of a ``make_watcher`` fixture: ``make(url, **kwargs)`` starts a ``kind``
    watcher for NODE against ``url``; all are closed when the test ends."""
    started: list[W] = []

    def make(url: str, **kwargs: Any) -> W:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url)
        watcher = kind(NODE, kubeconfig=str(kubeconfig), **kwargs)
        watcher.start()
        started.append(watcher)
        return watcher

    yield make
    for watcher in started:
        watcher.close()


@pytest.fixture
def make_watcher(tmp_path: Path) -> Iterator[Callable[..., PodWatcher]]:
    yield from watcher_factory(PodWatcher, tmp_path)


def synced(watcher: PodWatcher, n_pods: int) -> PodMetaSnapshot:
    return wait_snapshot(
        watcher, lambda s: s.ok and len(s.pods) == n_pods, f"ok snapshot with {n_pods} pods"
    )


def watching_one_pod(fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]) -> PodWatcher:
    """A pod watch that has listed this node's one pod and holds its watch open."""
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE))
    watcher = make_watcher(fake.start_in_thread())
    synced(watcher, 1)
    wait_for(lambda: fake.watcher_count == 1, what="watch open")
    return watcher


# -- conversion ------------------------------------------------------------------------


def test_pod_meta_strips_runtime_scheme_and_skips_containers_without_id() -> None:
    pod = pod_dict(
        "ml",
        "trainer",
        "0F1E2D3C-0000-4000-8000-000000000001",
        NODE,
        containers=[("main", f"containerd://{CID_A}"), ("pending", "")],
        init_containers=[("init", f"cri-o://{CID_B}")],
        ephemeral_containers=[("debug", f"docker://{CID_C}")],
    )
    meta = pod_meta_from_dict(pod)
    assert meta == PodMeta(
        uid="0f1e2d3c-0000-4000-8000-000000000001",
        namespace="ml",
        name="trainer",
        phase="Running",
        deletion_timestamp=None,
        containers=((CID_A, "main"), (CID_B, "init"), (CID_C, "debug")),
    )


def test_pod_meta_parses_deletion_timestamp_with_fraction_and_skips_pods_without_uid() -> None:
    pod = pod_dict("ns", "p", "u1", NODE)
    pod["metadata"]["deletionTimestamp"] = "2024-05-01T12:00:00.250000Z"
    meta = pod_meta_from_dict(pod)
    assert meta is not None
    assert meta.deletion_timestamp == datetime(2024, 5, 1, 12, 0, 0, 250000, UTC).timestamp()
    assert pod_meta_from_dict({"metadata": {"name": "no-uid"}}) is None


def test_importing_kube_sources_does_not_import_kubernetes() -> None:
    code = (
        "import sys\n"
        "import exporter.sources.kube as k\n"
        "import exporter.sources.resourceslices as r\n"
        "w = k.PodWatcher('n')\n"
        "w.snapshot()\n"
        "r.ResourceSliceWatcher('n').snapshot()\n"
        "bad = sorted(m for m in sys.modules if m == 'kubernetes' or m.startswith('kubernetes.'))\n"
        "print(','.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, f"kubernetes imported: {done.stdout} {done.stderr}"


# -- against the fake API server -------------------------------------------------------


def test_initial_list_gives_this_nodes_pods_with_container_names_and_bare_ids(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE, containers=[("main", CID_A)]))
    fake.set_pod(
        pod_dict(
            "infer",
            "server",
            "uid-2",
            NODE,
            containers=[("triton", f"cri-o://{CID_B}"), ("sidecar", f"docker://{CID_C}")],
        )
    )
    fake.set_pod(pod_dict("ml", "elsewhere", "uid-3", "other-node", containers=[("x", "d" * 64)]))
    watcher = make_watcher(fake.start_in_thread())

    snap = synced(watcher, 2)
    assert snap.error is None
    pods = by_name(snap)
    assert set(pods) == {"trainer", "server"}
    assert pods["trainer"] == PodMeta("uid-1", "ml", "trainer", "Running", None, ((CID_A, "main"),))
    assert pods["server"].namespace == "infer"
    assert pods["server"].containers == ((CID_B, "triton"), (CID_C, "sidecar"))
    first = fake.requests[0]
    assert not first.watch
    assert first.params["fieldSelector"] == f"spec.nodeName={NODE}"
    # Unchanged state hands out the same frozen object: no rebuild per call.
    assert watcher.snapshot() is watcher.snapshot()


def test_watch_applies_added_modified_and_deleted_pods_of_this_node_only(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE, containers=[("main", CID_A)]))
    watcher = make_watcher(fake.start_in_thread())
    synced(watcher, 1)
    wait_for(lambda: fake.watcher_count == 1, what="watch stream open")

    fake.set_pod(pod_dict("ml", "other", "uid-x", "other-node", containers=[("m", CID_C)]))
    fake.set_pod(pod_dict("ml", "new", "uid-2", NODE, phase="Pending", containers=[("m", "")]))
    snap = synced(watcher, 2)
    assert by_name(snap)["new"].phase == "Pending"
    assert by_name(snap)["new"].containers == ()

    fake.set_pod(pod_dict("ml", "new", "uid-2", NODE, containers=[("m", CID_B)]))
    wait_for(
        lambda: by_name(watcher.snapshot())["new"].containers == ((CID_B, "m"),),
        what="MODIFIED applied",
    )
    assert by_name(watcher.snapshot())["new"].phase == "Running"

    fake.delete_pod("uid-1")
    snap = synced(watcher, 1)
    assert set(by_name(snap)) == {"new"}
    assert "other" not in by_name(snap)
    assert lists(fake) == 1  # all of it through the one watch, no relist


def test_deletion_timestamp_from_watch_is_epoch_seconds(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE, containers=[("main", CID_A)]))
    watcher = make_watcher(fake.start_in_thread())
    assert synced(watcher, 1).pods[0].deletion_timestamp is None

    when = 1_714_564_800.0  # 2024-05-01T12:00:00Z
    fake.set_pod(
        pod_dict(
            "ml", "trainer", "uid-1", NODE, containers=[("main", CID_A)], deletion_timestamp=when
        )
    )
    wait_for(
        lambda: watcher.snapshot().pods[0].deletion_timestamp == when,
        what="deletion timestamp",
    )


@pytest.mark.slow  # waits on real watch/retry timers (~1 s)
def test_watch_window_end_rewatches_from_last_version_without_relisting(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE, containers=[("main", CID_A)]))
    watcher = make_watcher(fake.start_in_thread(), watch_timeout_s=1)
    synced(watcher, 1)
    wait_for(lambda: fake.watcher_count == 1, what="first watch")
    rv = fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE, phase="Succeeded"))
    wait_for(lambda: watcher.snapshot().pods[0].phase == "Succeeded", what="MODIFIED")

    def watches() -> list[LoggedRequest]:
        return [r for r in fake.requests if r.watch]

    wait_for(
        lambda: any(r.params["resourceVersion"] == rv for r in watches()),
        timeout=4,
        what="a watch window resuming from the MODIFIED event's version",
    )
    assert all(r.params["timeoutSeconds"] == "1" for r in watches())
    assert watches()[0].outcome == "timeout"
    assert lists(fake) == 1
    assert watcher.snapshot().ok


@pytest.mark.slow  # waits on real watch/retry timers (~1 s)
def test_resync_relists_even_when_the_watch_is_healthy(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE, containers=[("main", CID_A)]))
    watcher = make_watcher(fake.start_in_thread(), resync_s=1)
    synced(watcher, 1)
    wait_for(lambda: lists(fake) >= 2, timeout=4, what="periodic relist")
    assert watcher.snapshot().ok
    assert watcher.errors_total == 0


def test_stop_closes_an_open_watch_promptly(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    watcher = make_watcher(fake.start_in_thread(), watch_timeout_s=60)
    synced(watcher, 0)
    wait_for(lambda: fake.watcher_count == 1, what="watch stream open")

    began = time.monotonic()
    watcher.stop()
    assert time.monotonic() - began < 2.0
    assert not any(t.name == "pod-watcher" and t.is_alive() for t in threading.enumerate())
    wait_for(lambda: fake.watcher_count == 0, what="server saw the stream close")
    assert [r.outcome for r in fake.requests if r.watch] == ["closed"]


async def test_fake_serves_from_the_callers_event_loop_as_the_simulator_runs_it(
    tmp_path: Path,
) -> None:
    fake = FakeKubeApi()
    url = await fake.start()
    watcher = PodWatcher(NODE, kubeconfig=str(write_kubeconfig(tmp_path / "kc", url)))
    watcher.start()
    try:
        fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE, containers=[("main", CID_A)]))
        deadline = time.monotonic() + 5
        while not (snap := watcher.snapshot()).pods and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert [(p.name, p.containers) for p in snap.pods] == [("trainer", ((CID_A, "main"),))]
    finally:
        await asyncio.to_thread(watcher.stop)
        await fake.stop()


def test_pod_watcher_is_the_kube_source_filling_pod_meta(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    idle = PodWatcher(NODE)
    assert idle.name == "kube"
    filled = Cycle(timestamp=time.time())
    idle.fill(filled)
    assert filled.readings.pod_meta is idle.snapshot()
    assert idle.status() == SourceStatus("kube", False, "not started")
    assert idle.errors_total == 0

    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE, containers=[("main", CID_A)]))
    watcher = make_watcher(fake.start_in_thread())
    snap = synced(watcher, 1)
    assert watcher.read(Cycle(timestamp=time.time())) is watcher.snapshot() is snap
    assert watcher.status() == SourceStatus("kube", True, None)
    watcher.close()
    assert not any(t.name == "pod-watcher" and t.is_alive() for t in threading.enumerate())


async def test_prime_waits_for_the_first_list_and_returns_at_once_when_not_started(
    tmp_path: Path,
) -> None:
    fake = FakeKubeApi()
    url = await fake.start()
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE, containers=[("main", CID_A)]))
    watcher = PodWatcher(NODE, kubeconfig=str(write_kubeconfig(tmp_path / "kc", url)))
    try:
        began = time.monotonic()
        await watcher.prime(5.0)  # not started: nothing to wait for
        assert time.monotonic() - began < 0.5
        watcher.start()
        await watcher.prime(5.0)
        assert [p.name for p in watcher.snapshot().pods] == ["trainer"]
    finally:
        await watcher.aclose()
        await fake.stop()
