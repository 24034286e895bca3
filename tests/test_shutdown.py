"""SIGTERM to a real ``--simulate`` process: NVML is shut down and the process is gone
promptly. A GPU Operator driver upgrade deletes the exporter's pod and waits until no
process holds /dev/nvidia*; the kubelet sends SIGTERM, SIGKILL only after the grace
period. The simulated library's reference count (``SimNvmlLibrary.initialised``,
logged when the simulated node stops) says whether every nvmlInit met its nvmlShutdown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real processes, real connect timeouts

FAKE_BINDINGS = str(Path(__file__).parent / "fake_dcgm")
EXE = [sys.executable, "-m", "exporter", "--simulate", "single-gpu", "--kube-api", "off"]
EXE += ["--interval", "0.2"]
RELEASED = "simulated NVML library at stop: not initialised (every nvmlInit was matched"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen[str]]:
    port = free_port()
    process = subprocess.Popen(
        [*EXE, "--listen", f"127.0.0.1:{port}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return f"http://127.0.0.1:{port}", process


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def wait_for(
    condition: Callable[[], bool], process: subprocess.Popen[str], timeout_s: float = 20
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        if condition():
            return
        time.sleep(0.02)
    process.kill()
    raise AssertionError(f"timed out; stderr: {process.communicate()[1]}")


def terminate(process: subprocess.Popen[str]) -> tuple[float, str]:
    """SIGTERM, then the seconds until the process was gone, and its stderr."""
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        _, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
    return time.monotonic() - sent, stderr


def test_sigterm_releases_nvml_and_exits() -> None:
    url, process = start(["--dcgm", "off"])
    wait_for(lambda: ready(url), process)
    seconds, stderr = terminate(process)
    assert process.returncode == 0, stderr
    assert seconds < 3, stderr
    assert RELEASED in stderr


def test_sigterm_while_dcgm_probes_absent_host_engines_still_exits_promptly(
    tmp_path: Path,
) -> None:
    """Each absent host engine costs DCGM 4 its whole connect timeout (1 s in auto); with
    ten on the list, shutdown used to wait for all of them before closing DCGM. Now the
    cycle in flight gets 2 s, then closing DCGM ends the list after the current attempt."""
    calls = tmp_path / "dcgm-calls.jsonl"
    state = tmp_path / "dcgm-state.json"
    state.write_text(
        json.dumps(
            {
                "hostengines": [],
                "failed_connect_waits": True,
                "embedded": False,
                "calls_log": str(calls),
            }
        )
    )
    _, process = start(
        [
            *("--dcgm", "auto", "--dcgm-bindings-path", FAKE_BINDINGS),
            *("--dcgm-operator-namespace", "a,b,c,d,e,f,g,h,i"),  # + 127.0.0.1: 10 s
        ],
        env={"FAKE_DCGM_STATE": str(state)},
    )
    wait_for(lambda: calls.exists() and "dcgmConnect_v3" in calls.read_text(), process)
    seconds, stderr = terminate(process)
    assert process.returncode == 0, stderr
    assert seconds < 5, stderr  # grace, then one attempt: not the remaining nine
    assert RELEASED in stderr
    attempts = [json.loads(line)["fn"] for line in calls.read_text().splitlines()]
    assert attempts.count("dcgmConnect_v3") <= 5 and "dcgmStartEmbedded" not in attempts
