"""Ready means it sees GPUs (exporter/exposition/readiness.py): /readyz answers 503 with
the likely cause once NVML has been down, or has listed no GPU while the kubelet
advertises some, for --ready-grace seconds; /healthz is not affected."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from exporter.exposition.readiness import HARDENED_TOOLKIT, Readiness, likely_cause
from tests.exporter_process import start, terminate, wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nvml_down_past_the_grace_is_not_ready_with_its_likely_cause() -> None:
    clock = Clock()
    readiness = Readiness(grace_s=60, clock=clock)
    error = "LibraryNotFound: libnvidia-ml.so.1"
    readiness.observe(nvml_ok=False, nvml_error=error, gpus=0, advertised=8)
    clock.now += 59
    readiness.observe(nvml_ok=False, nvml_error=error, gpus=0, advertised=8)
    assert readiness.problem() is None  # within the grace: a driver may still be loading
    clock.now += 1
    problem = readiness.problem()
    assert problem is not None and "NVML is down (LibraryNotFound" in problem
    assert "runtimeClassName: nvidia" in problem
    readiness.observe(nvml_ok=True, nvml_error=None, gpus=8, advertised=8)
    assert readiness.problem() is None  # seen again: ready at once


def test_no_gpu_listed_while_the_kubelet_advertises_some_is_not_ready() -> None:
    clock = Clock()
    readiness = Readiness(grace_s=30, clock=clock)
    readiness.observe(nvml_ok=True, nvml_error=None, gpus=0, advertised=2)
    clock.now += 30
    problem = readiness.problem()
    assert problem is not None and HARDENED_TOOLKIT in problem
    assert "advertises 2 GPU device(s)" in problem


def test_a_node_without_advertised_gpus_and_a_seeing_exporter_are_ready() -> None:
    clock = Clock()
    readiness = Readiness(grace_s=0, clock=clock)
    readiness.observe(nvml_ok=True, nvml_error=None, gpus=0, advertised=0)
    assert readiness.problem() is None  # nothing says the node has GPUs
    readiness.observe(nvml_ok=True, nvml_error=None, gpus=1, advertised=2)
    assert readiness.problem() is None  # sees some: the rest is capacity's business


@pytest.mark.parametrize(
    ("error", "words"),
    [
        ("DriverNotLoaded", "no NVIDIA kernel driver"),
        ("NoPermission", "may not open /dev/nvidia*"),
        ("Unknown: whatever", "see the exporter's log"),
        (None, "see the exporter's log"),
    ],
)
def test_each_nvml_error_names_its_likely_cause(error: str | None, words: str) -> None:
    assert words in likely_cause(error)


def status(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""  # not listening yet


@pytest.fixture
def scenario(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "hardened.yaml"
    yield path


@pytest.mark.slow  # a real exporter process past --ready-grace
@pytest.mark.parametrize(
    ("root", "cause"),
    [
        ({"nvml_sees_no_gpu": True}, "hardened NVIDIA container toolkit"),
        ({"nvml_init_error": "LIBRARY_NOT_FOUND"}, "runtimeClassName: nvidia"),
        ({}, None),  # the control: a node whose GPUs are seen stays ready
    ],
)
def test_the_exporter_on_a_node_whose_gpus_it_cannot_see_is_not_ready(
    scenario: Path, root: dict[str, object], cause: str | None
) -> None:
    """Through the real exporter on the simulated node, the kubelet advertising two GPUs:
    a hardened toolkit (NVML lists none) or no driver library in the container makes
    /readyz 503 after --ready-grace (2 s here), naming the cause; /healthz stays 200."""
    scenario.write_text(yaml.safe_dump({"gpus": [{}, {}], **root}))
    url, process = start(
        ["--simulate", str(scenario), "--kube-api", "off", "--interval", "1", "--ready-grace", "2"]
    )
    try:
        wait_for(lambda: status(url + "/healthz")[0] == 200, process)
        code, text = 0, ""
        until = time.monotonic() + 8  # 6 s past the grace
        while time.monotonic() < until and not (cause is not None and code == 503):
            time.sleep(0.2)
            code, text = status(url + "/readyz")
        health = status(url + "/healthz")[0]
    finally:
        terminate(process)
    assert health == 200
    if cause is None:
        assert code == 200, text
    else:
        assert code == 503 and cause in text, (code, text)
