"""The chart's doctor init container (docs/doctor.md): what it runs, and that it runs.

Real Helm renders it; its rendered command then runs here, through /bin/sh where the
chart asks for it, with the exporter installed in this virtualenv standing in for the
image's entrypoint: on this machine (no /host/proc, no kubelet socket: checks missing)
and on the simulated node (extraArgs --simulate: nothing missing).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_helm_chart import container, pod_spec

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent  # gpu-occupancy-exporter, the image's entrypoint


def doctor(values: dict[str, Any]) -> dict[str, Any] | None:
    found = [c for c in pod_spec(values).get("initContainers", []) if c["name"] == "doctor"]
    return found[0] if found else None


def on(**initContainer: Any) -> dict[str, Any]:
    return {"doctor": {"initContainer": {"enabled": True, **initContainer}}}


def run(init: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """The container's command as the runtime runs it: command + args, or the image's
    entrypoint + args when no command is set."""
    argv = (
        [*init["command"], *init["args"]]
        if "command" in init
        else [
            "gpu-occupancy-exporter",
            *init["args"],
        ]
    )
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "NODE_NAME": "sim-single"}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_off_by_default() -> None:
    assert doctor({}) is None


def test_it_sees_what_the_exporter_sees() -> None:
    init = doctor(on())
    assert init is not None
    exporter = container(on())
    assert init["image"] == exporter["image"]
    assert init["args"] == ["--timeout=10", *exporter["args"]]
    assert init["env"] == exporter["env"]
    assert init["volumeMounts"] == exporter["volumeMounts"]
    assert init["securityContext"] == exporter["securityContext"]
    # after the DCGM copy, whose volume it checks through
    names = [c["name"] for c in pod_spec(on())["initContainers"]]
    assert names == ["dcgm-bindings", "doctor"]


def test_a_node_missing_everything_reports_and_still_lets_the_exporter_start() -> None:
    done = run(doctor(on(timeout=3)) or {})
    assert done.returncode == 0, done.stderr
    assert "MISSING   proc" in done.stdout  # no /host/proc on this machine
    assert "MISSING   podresources" in done.stdout
    assert "doctor: exit 1 (doctor.initContainer.enforce is false" in done.stdout


def test_enforce_keeps_the_exporter_from_starting_on_such_a_node() -> None:
    init = doctor(on(enforce=True, timeout=3))
    assert init is not None and "command" not in init and init["args"][0] == "doctor"
    done = run(init)
    assert done.returncode == 1
    assert "MISSING   proc" in done.stdout


def test_enforce_passes_on_a_node_that_has_what_the_exporter_needs() -> None:
    values = {**on(enforce=True), "extraArgs": ["--simulate", "single-gpu"]}
    done = run(doctor(values) or {})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 missing: the exporter with these flags would work" in done.stdout
