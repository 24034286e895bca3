"""The process rows of the fault matrix: signals, a taken port and a non-root user,
each against a real ``python -m exporter --simulate`` process (tests/exporter_process.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.exporter_process import (
    EXE,
    RELEASED,
    SIMULATED,
    open_fds,
    ready,
    rss_bytes,
    start,
    terminate,
    wait_for,
)
from tests.faults.conftest import RecordFault
from tests.harness import Scrape, parse_exposition

pytestmark = pytest.mark.slow  # real processes

FAKE_BINDINGS = str(Path(__file__).parent.parent / "fake_dcgm")
NOBODY = 65534
MiB = 1024**2


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        assert response.status == 200
        return parse_exposition(response.read().decode())


def test_sigterm_mid_cycle_exits_0_within_the_grace(
    tmp_path: Path, record_fault: RecordFault
) -> None:
    """The cycle in flight is stuck in DCGM: each absent host engine costs DCGM 4 its
    whole connect timeout (1 s in auto), ten on the list. Shutdown gives the cycle 2 s,
    then closing DCGM ends the list after the current attempt."""
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
            *SIMULATED,
            *("--dcgm", "auto", "--dcgm-bindings-path", FAKE_BINDINGS),
            *("--dcgm-operator-namespace", "a,b,c,d,e,f,g,h,i"),  # + 127.0.0.1: 10 s
        ],
        env={"FAKE_DCGM_STATE": str(state)},
    )
    wait_for(lambda: calls.exists() and "dcgmConnect_v3" in calls.read_text(), process)
    before = connects(calls)  # a connect is in flight: each takes 1 s, logged as it starts
    seconds, stderr = terminate(process)
    after = connects(calls) - before
    assert process.returncode == 0, stderr
    # the 2 s grace starts at most 2 more 1 s connects (3 if one starts at its edge),
    # the one in flight when it ends is the last: not the rest of the ten
    assert after <= 3 and before + after < 10, (before, after)
    assert seconds < 5, stderr  # 2 s grace + 1 s connect + a loaded machine's margin
    assert RELEASED in stderr
    fns = [json.loads(line)["fn"] for line in calls.read_text().splitlines()]
    assert "dcgmStartEmbedded" not in fns
    record_fault(
        "process-sigterm-mid-cycle",
        expected=(
            "SIGTERM while a cycle is stuck in 1 s DCGM connects (ten queued) exits 0 in "
            "under 5 s: the cycle gets a 2 s grace, then closing DCGM ends the list after "
            "the connect in flight, so at most 3 connects start after the signal; every "
            "nvmlInit is matched by nvmlShutdown."
        ),
        figure=(
            f"exit status {process.returncode} {seconds:.2f} s after SIGTERM; "
            f"{before} connect(s) started before it and {after} after, "
            f"{before + after} of 10 host engines tried; NVML released."
        ),
    )


def connects(calls: Path) -> int:
    """``dcgmConnect_v3`` calls the fake DCGM has logged (each as it starts)."""
    lines = calls.read_text().splitlines()
    return sum(1 for line in lines if json.loads(line)["fn"] == "dcgmConnect_v3")


def test_sigint_exits_0_quietly_and_releases_nvml(record_fault: RecordFault) -> None:
    url, process = start([*SIMULATED, "--dcgm", "off"])
    wait_for(lambda: ready(url), process)
    seconds, stderr = terminate(process, signal.SIGINT)
    assert process.returncode == 0, stderr
    assert seconds < 3, stderr
    assert RELEASED in stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    record_fault(
        "process-sigint",
        expected=(
            "SIGINT (Ctrl-C) stops the exporter like SIGTERM: exit status 0, no "
            "traceback, NVML shut down."
        ),
        figure=f"exit status {process.returncode} {seconds:.2f} s after SIGINT; NVML released.",
    )


def test_a_second_instance_on_the_same_port_exits_2_with_one_line(
    record_fault: RecordFault,
) -> None:
    url, first = start(SIMULATED)
    try:
        wait_for(lambda: ready(url), first)
        port = url.rsplit(":", 1)[1]
        began = time.monotonic()
        second = subprocess.run(
            [*EXE, *SIMULATED, "--listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        seconds = time.monotonic() - began
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2, second.stderr
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith("gpu-occupancy-exporter: error: ")
        assert f"--listen: cannot listen on 127.0.0.1:{port}" in lines[0]
        assert "simulated node" not in second.stderr  # nothing half-started
        assert scrape(url).get("gpu_exporter_source_up", source="nvml") == 1  # first serves on
    finally:
        terminate(first)
    record_fault(
        "process-port-in-use",
        expected=(
            "A second instance on a taken port exits 2 with one line naming the address, "
            "before starting anything; the first keeps serving."
        ),
        figure=f"exit status 2 after {seconds:.2f} s (interpreter start included): {lines[0]!r}",
    )


def test_as_nobody_on_a_partly_unreadable_proc_it_serves_and_says_unknown(
    record_fault: RecordFault,
) -> None:
    """Every third pid directory of the simulated /proc made unreadable (mode 000) for a
    non-root exporter: those processes are owner unknown, not host and not dead."""
    as_root = os.geteuid() == 0
    setpriv = shutil.which("setpriv")
    assert setpriv or not as_root, "setpriv (util-linux) is needed to drop root here"
    prefix = (
        [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if as_root else []
    )
    url, process = start(
        ["--simulate", "node-8gpu", "--kube-api", "off", "--interval", "0.2"],
        prefix=[p for p in prefix if p],
    )
    locked: list[Path] = []
    try:
        assert process.stderr is not None
        root = None
        while root is None:  # the simulated node logs where its proc tree is, first
            line = process.stderr.readline()
            assert line, "the exporter exited before logging its proc root"
            if "proc root " in line:
                root = Path(line.rsplit("proc root ", 1)[1].strip())
        wait_for(lambda: ready(url), process)
        time.sleep(1.0)  # five cycles: the scenario's dead pid confirmed (--orphan-cycles 3)
        before = scrape(url)
        pids = sorted((d for d in root.iterdir() if d.name.isdigit()), key=lambda d: int(d.name))
        locked = pids[::3]
        for pid_dir in locked:
            pid_dir.chmod(0)
        time.sleep(1.0)  # five cycles
        after = scrape(url)
        assert process.poll() is None
        fds, rss = open_fds(process.pid), rss_bytes(process.pid)
    finally:
        for pid_dir in locked:
            pid_dir.chmod(0o755)  # so the exporter (not root) can remove its tree
        seconds, stderr = terminate(process)
    assert process.returncode == 0, stderr

    def unattributed(s: Scrape, owner: str, reason: str = "") -> float:
        return sum(
            v
            for labels, v in s.find("gpu_unattributed_memory_used_bytes", owner=owner)
            if labels.get("reason", "") == reason
        )

    unknown = unattributed(after, "unknown", "process not read from /proc")
    assert unattributed(before, "unknown", "process not read from /proc") == 0
    assert unknown > 0
    assert unattributed(after, "host") <= unattributed(before, "host")  # none became host
    assert after.get("gpu_exporter_source_up", source="procfs") == 1
    assert after.get("gpu_exporter_errors_total", source="procfs") > 0
    orphans = {
        (labels["gpu"], labels["kind"]) for labels, _ in after.find("gpu_orphaned_memory_bytes")
    }
    assert orphans == {
        (labels["gpu"], labels["kind"]) for labels, _ in before.find("gpu_orphaned_memory_bytes")
    }  # no new dead_process orphan
    before_pods = len(before.find("gpu_container_memory_used_bytes"))
    after_pods = len(after.find("gpu_container_memory_used_bytes"))
    # Without pod metadata an unreadable process may be anyone's: it never leaves another
    # pod's process looking like the allocated one's (no container series appears).
    assert after_pods <= before_pods
    record_fault(
        "process-non-root-proc-partly-unreadable",
        expected=(
            "Run as an unprivileged user with a third of the pid directories unreadable, "
            "the exporter keeps serving; those processes' memory is owner unknown "
            "(reason 'process not read from /proc') and counted as procfs errors, never "
            "a host process, a dead process's orphan or a reason to name a pod, and it "
            "exits 0 on SIGTERM."
        ),
        figure=(
            f"uid {os.getuid() if not as_root else NOBODY}, {len(locked)} of {len(pids)} pid "
            f"directories mode 000: {unknown / 2**30:.1f} GiB served as unknown, container "
            f"series {before_pods} -> {after_pods}, orphan series unchanged "
            f"({len(orphans)}), procfs errors "
            f"{after.get('gpu_exporter_errors_total', source='procfs'):.0f} after 1 s; "
            f"{fds} fds, RSS {rss / MiB:.0f} MiB; exit 0 in {seconds:.2f} s."
        ),
    )
