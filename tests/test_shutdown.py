"""SIGTERM to a real ``--simulate`` process: NVML is shut down and the process is gone
promptly. A GPU Operator driver upgrade deletes the exporter's pod and waits until no
process holds /dev/nvidia*; the kubelet sends SIGTERM, SIGKILL only after the grace
period. The simulated library's reference count (``SimNvmlLibrary.initialised``,
logged when the simulated node stops) says whether every nvmlInit met its nvmlShutdown.
SIGTERM in the middle of a slow cycle is the fault matrix's
(tests/faults/test_process_faults.py).
"""

from __future__ import annotations

import pytest

from tests.exporter_process import RELEASED, SIMULATED, ready, start, terminate, wait_for

pytestmark = pytest.mark.slow  # a real process


def test_sigterm_releases_nvml_and_exits() -> None:
    url, process = start([*SIMULATED, "--dcgm", "off"])
    wait_for(lambda: ready(url), process)
    seconds, stderr = terminate(process)
    assert process.returncode == 0, stderr
    assert seconds < 3, stderr
    assert RELEASED in stderr
