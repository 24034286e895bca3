"""System programs some tests need (Debian's ``prometheus`` package: ``promtool`` and
the ``prometheus`` server; ``kubectl``, Debian's ``kubernetes-client``, run against the
API stand-in). Outside CI a missing one skips its tests with a one-line reason, so the
README's test command passes on a fresh machine with only Python; CI
(``.ci/run`` sets ``GPU_EXPORTER_REQUIRE_SYSTEM_TOOLS=1``) makes it a failure instead."""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "GPU_EXPORTER_REQUIRE_SYSTEM_TOOLS"
INSTALL_HINT = "apt-get install -y prometheus (Debian's package ships promtool too)"
KUBECTL_HINT = "apt-get install -y kubernetes-client (Debian's kubectl)"
VICTORIA_METRICS_HINT = (
    "apt-get install -y victoria-metrics (Debian's package ships vmagent and vmalert too)"
)


def require_tool(name: str, hint: str = INSTALL_HINT) -> str:
    """The path of ``name`` on PATH; else skip (fail where CI requires it)."""
    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} not found on PATH; install it: {hint}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: required here)", pytrace=False)
    pytest.skip(reason)
