"""The exporter as a real process (``python -m exporter ...`` on a free port), for tests
of what only a process has: signals, exit statuses, ports, users, its own fds and RSS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence

EXE = [sys.executable, "-m", "exporter"]
# The simulated single-GPU node, no API server, a fast cycle.
SIMULATED = ["--simulate", "single-gpu", "--kube-api", "off", "--interval", "0.2"]
RELEASED = "simulated NVML library at stop: not initialised (every nvmlInit was matched"


def usage_error(*args: str) -> tuple[str, str]:
    """``python -m exporter ARGS``, refused: asserts it exits 2 with one line on stderr;
    that line, and stdout."""
    result = subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0], result.stdout


def free_port() -> int:
    """A port below the kernel's ephemeral range (tests/e2e/stack.py says why)."""
    from tests.e2e.stack import free_port as below_ephemeral

    return below_ephemeral()


def start(
    args: Sequence[str],
    env: dict[str, str] | None = None,
    *,
    port: int | None = None,
    prefix: Sequence[str] = (),
) -> tuple[str, subprocess.Popen[str]]:
    """``[*prefix, python -m exporter, *args, --listen 127.0.0.1:<port>]``; its base URL."""
    port = port or free_port()
    process = subprocess.Popen(
        [*prefix, *EXE, *args, "--listen", f"127.0.0.1:{port}"],
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


def terminate(
    process: subprocess.Popen[str], sig: signal.Signals = signal.SIGTERM
) -> tuple[float, str]:
    """Send ``sig``, then the seconds until the process was gone, and its stderr."""
    sent = time.monotonic()
    process.send_signal(sig)
    try:
        _, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
    return time.monotonic() - sent, stderr


def rss_bytes(pid: int) -> int:
    """Resident set size, from /proc/<pid>/status (VmRSS, in kB)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
