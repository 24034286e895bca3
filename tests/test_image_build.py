"""The image, built and run: image/build-and-run.sh with Debian's buildah and mmdebstrap.

tests/test_dockerfile.py replays the Dockerfile's install in a virtualenv wherever Python
runs; this test builds the real image (a base made by mmdebstrap from Debian's packages,
``buildah build --isolation chroot --pull=never``), runs its entrypoint on the simulated
8-GPU node with ``buildah run`` and scrapes /metrics. It needs root, buildah and
mmdebstrap: without them it skips with one line, and fails instead in CI
(GPU_EXPORTER_REQUIRE_SYSTEM_TOOLS=1, where .ci/run installs both). About a minute on an
empty image store, half that when the base image is already there.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.system_tools import REQUIRE_ENV, require_tool

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "image" / "build-and-run.sh"
CONSTRAINTS = ROOT / "image" / "constraints.txt"
HINT = "apt-get install -y buildah mmdebstrap (Debian's packages)"


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        name, sep, version = line.partition("#")[0].strip().partition("==")
        if sep:
            pins[canonicalize_name(name)] = version
    return pins


def test_every_runtime_dependency_is_pinned_within_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    for line in project["dependencies"]:
        req = Requirement(line)
        pin = pins.get(canonicalize_name(req.name))
        assert pin, f"{req.name} has no pin in image/constraints.txt: run image/lock.py"
        assert req.specifier.contains(pin, prereleases=True), (
            f"{req.name}=={pin} (image/constraints.txt) is outside pyproject's {req.specifier}"
        )


def test_the_image_builds_runs_and_serves_metrics() -> None:
    for tool in ("buildah", "mmdebstrap"):
        require_tool(tool, HINT)
    if os.geteuid() != 0:
        reason = "buildah --isolation chroot and mmdebstrap here need root"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1: required here)", pytrace=False)
        pytest.skip(reason)
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=540, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"image/build-and-run.sh failed:\n{output[-6000:]}"
    print(output)  # the size and the scrape, in the log with -s / on failure
    assert re.search(r"^image size: \d+(\.\d+)? [kMG]B uncompressed", output, re.M), output
    assert re.search(r"^pins: \d+ packages, all as pinned$", output, re.M), output
    assert "scrape: ok" in output
    assert re.search(r'gpu_exporter_build_info\{python_version="3\.11\.\d+"', output), output
