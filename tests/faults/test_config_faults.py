"""Rows of the fault matrix for flags and the exporter's own limits: numeric flags that
are not finite or out of range, booleans spelled wrong, and a real exporter process that
runs out of file descriptors (RLIMIT_NOFILE lowered under it with prlimit(2)) on a
simulated node served by another process."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import re
import resource
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.cli import main
from exporter.config import (
    FALSE_WORDS,
    TRUE_WORDS,
    Bounds,
    ConfigError,
    build_parser,
    parse_config,
)
from exporter.sim.external import NodeProcess
from tests import exporter_process
from tests.faults.conftest import RecordFault

BAD_NUMBERS = ("inf", "nan", "-1", "1e400")


def _env_name(flag: str) -> str:
    return "GPU_EXPORTER_" + flag[2:].replace("-", "_").upper()


def _looks_numeric(default: object) -> bool:
    try:
        float(str(default))
    except ValueError:
        return False
    return True


def numeric_flags() -> list[tuple[bool, str, argparse.Action]]:
    """(snapshot?, flag, action) for every numeric flag of both parsers: those with
    Bounds, and any whose default is a number (a new flag that forgot its range)."""
    found: list[tuple[bool, str, argparse.Action]] = []
    for snapshot in (False, True):
        for action in build_parser({}, snapshot=snapshot)._actions:
            flag = action.option_strings[-1] if action.option_strings else ""
            bounded = isinstance(getattr(action.type, "__self__", None), Bounds)
            numeric = bounded or _looks_numeric(action.default)
            known = any(f == flag for s, f, _ in found if not s)  # a server flag
            if flag.startswith("--") and numeric and not (snapshot and known):
                found.append((snapshot, flag, action))
    return found


def boolean_flags() -> list[str]:
    return [
        action.option_strings[-1]
        for action in build_parser({})._actions
        if isinstance(action, argparse._StoreTrueAction)
    ]


def refused_in_one_line(
    argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> str:
    """The CLI's answer to bad input: exit 2, one line on stderr, nothing started.
    parse_config is asked first, so input that is accepted fails here instead of
    starting a server."""
    with pytest.raises(ConfigError):
        parse_config(argv, env=env)
    with pytest.MonkeyPatch.context() as patch:  # main() reads os.environ
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(SystemExit) as exit_:
            main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("gpu-occupancy-exporter: error: ")
    return line


def test_non_finite_or_out_of_range_numbers_are_refused_for_every_numeric_flag(
    capsys: pytest.CaptureFixture[str], record_fault: RecordFault
) -> None:
    flags = numeric_flags()
    assert len(flags) >= 12  # today's 11 of the server and --window of the snapshot
    unbounded = [flag for _, flag, action in flags if not isinstance(action.type.__self__, Bounds)]  # type: ignore[union-attr]
    assert not unbounded, f"numeric flags without Bounds (config.add(..., bounds=)): {unbounded}"
    refused = 0
    for snapshot, flag, action in flags:
        bounds: Bounds = action.type.__self__  # type: ignore[union-attr]
        assert f"range {bounds}" in (action.help or ""), f"{flag}: --help states no range"
        prefix = ["snapshot"] if snapshot else []
        for value in BAD_NUMBERS:
            line = refused_in_one_line([*prefix, f"{flag}={value}"], {}, capsys)
            assert flag in line and str(bounds) in line, line
            refused += 1
            if snapshot:
                continue  # --window has no variable
            line = refused_in_one_line([*prefix], {_env_name(flag): value}, capsys)
            assert _env_name(flag) in line and str(bounds) in line, line
            refused += 1
        # the edges of the range are accepted (the simulated clock's flags with a
        # simulated node: without one they are refused for that reason, not the range)
        context = ["--simulate=single-gpu"] if flag.startswith("--simulate-") else []
        # the cadences are never shorter than --interval (refused in one line)
        if flag in ("--slow-interval", "--gpm-interval", "--process-utilization-interval"):
            context = ["--interval=0.1"]
        for edge in (bounds.low, bounds.high):
            text = str(int(edge)) if bounds.whole else str(edge)
            parse_config([*prefix, *context, f"{flag}={text}"], env={})
    server = sum(1 for snapshot, _, _ in flags if not snapshot)
    record_fault(
        "config-non-finite-flags",
        expected="every numeric flag (found in the parser) and its variable refuse inf, "
        "nan, -1 and 1e400 with one line naming the flag or variable and its range, "
        "exit status 2; --help states every range",
        figure=f"{refused} of {refused} bad values refused ({len(flags)} numeric flags, "
        f"{server} with a variable), each in one line with exit 2",
    )


def test_a_boolean_variable_with_an_unknown_value_is_refused(
    capsys: pytest.CaptureFixture[str], record_fault: RecordFault
) -> None:
    flags = boolean_flags()
    assert {"--per-process-metrics", "--kmsg"} <= set(flags)
    dest = {flag: flag[2:].replace("-", "_") for flag in flags}
    for flag in flags:
        name = _env_name(flag)
        line = refused_in_one_line([], {name: "yes-please"}, capsys)
        assert f"{name}: 'yes-please' is not a boolean" in line
        assert all(word in line for word in TRUE_WORDS + FALSE_WORDS), line
        for words, value in ((TRUE_WORDS, True), (FALSE_WORDS, False)):
            for word in (*words, *(w.upper() for w in words)):
                config = parse_config([], env={name: word})
                assert getattr(config, dest[flag]) is value, (name, word)
    record_fault(
        "config-unknown-boolean",
        expected="a boolean variable set to anything but true/false, 1/0, yes/no or "
        "on/off (any case) stops the exporter with one line naming the variable and "
        "the accepted values, exit status 2",
        figure=f"{len(flags)} of {len(flags)} boolean variables refused 'yes-please' in "
        f"one line ({', '.join(_env_name(f) for f in flags)}); "
        f"{2 * len(TRUE_WORDS + FALSE_WORDS)} spellings each accepted",
    )


# -- the exporter out of file descriptors ---------------------------------------------

FAULT_S = 5.0
# Log records and physical lines (a traceback is several) the exporter may write in
# FAULT_S while every open and accept fails: the procfs warning, asyncio's accept error
# with its traceback, each once.
MAX_RECORDS = 6
MAX_LINES = 40
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


@contextlib.contextmanager
def node_process(tmp_path: Path) -> Iterator[NodeProcess]:
    node = NodeProcess("node-8gpu", tmp_path, kube_api=False)
    try:
        yield node
    finally:
        node.process.kill()
        node.process.join(10)


def scrape(conn: http.client.HTTPConnection) -> str:
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200
    return response.read().decode()


def value(body: str, series: str) -> float | None:
    for line in body.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


@pytest.mark.slow
def test_proc_failing_wholesale_is_procfs_down_without_orphans_or_a_log_flood(
    tmp_path: Path, record_fault: RecordFault
) -> None:
    with node_process(tmp_path) as _:
        url, process = exporter_process.start(
            [
                f"--simulated-node={tmp_path}",
                "--interval=0.2",
                "--per-process-metrics",
                "--dcgm=off",
                "--http-header-timeout=60",  # the kept-alive scrape connection stays open
            ]
        )
        stderr: list[tuple[float, str]] = []
        assert process.stderr is not None
        pipe = process.stderr
        reader = threading.Thread(
            target=lambda: stderr.extend((time.monotonic(), line) for line in pipe),
            daemon=True,
        )
        reader.start()
        try:
            exporter_process.wait_for(lambda: exporter_process.ready(url), process)
            port = int(url.rsplit(":", 1)[1])
            # Open before the fault: a connection the exporter already holds still works.
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            before = scrape(conn)
            assert value(before, 'gpu_exporter_source_up{source="procfs"}') == 1
            gpu_processes = before.count("gpu_process_memory_used_bytes{")
            assert gpu_processes > 0

            soft, hard = resource.prlimit(process.pid, resource.RLIMIT_NOFILE)
            # Below every fd it holds: each open, socket and accept is EMFILE from now.
            resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (3, hard))
            began, logged_before = time.monotonic(), len(stderr)
            attempts = 0
            while time.monotonic() - began < FAULT_S:  # scrapers keep trying to connect
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                attempts += 1
                time.sleep(0.02)
            during = [line for _, line in stderr[logged_before:]]
            body = scrape(conn)

            resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (soft, hard))
            restored = time.monotonic()
            conn.close()
            # A new connection from here: the connections the scrapers queued during the
            # fault are accepted now, and at the connection cap an idle kept-alive one is
            # evicted to make room (exporter/exposition/connections.py): the one held
            # through the fault was, in one CI run (a reset). That it served during the
            # fault is what was to be shown.
            fresh = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            exporter_process.wait_for(
                lambda: value(scrape(fresh), 'gpu_exporter_source_up{source="procfs"}') == 1,
                process,
            )
            fresh.close()
            recovered_s = time.monotonic() - restored
        finally:
            process.terminate()  # stderr is the reader's: not communicate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            reader.join(10)

    records = [line for line in during if RECORD.match(line)]
    assert value(body, 'gpu_exporter_source_up{source="procfs"}') == 0
    reasons = [line for line in during if "failed wholesale: EMFILE" in line]
    assert reasons, during
    reason = reasons[0].split("failed wholesale: ", 1)[1].split(";")[0]
    assert re.fullmatch(
        r"EMFILE: (\d+) of \1 reads failed, (\d+) of \2 pids unreadable "
        r"\(Too many open files\)",
        reason,
    ), reason
    # Owner unknown: never dead, so never an orphan.
    assert "gpu_orphaned_memory_bytes{" not in body
    owners = re.findall(r'gpu_process_memory_used_bytes\{[^}]*owner="(\w+)"', body)
    assert len(owners) == gpu_processes and set(owners) == {"unknown"}, owners
    assert any("socket.accept() out of system resource" in line for line in during)
    assert len(records) <= MAX_RECORDS and len(during) <= MAX_LINES, "".join(during)
    record_fault(
        "proc-fd-exhaustion",
        expected="a real exporter process out of file descriptors (RLIMIT_NOFILE lowered "
        "below its open fds): procfs up=0 with a reason, every GPU process's owner "
        f"unknown, no orphan series, at most {MAX_RECORDS} log records "
        f"({MAX_LINES} lines) in {FAULT_S:.0f} s (repeats logged once a minute with a "
        "count); procfs up again once fds are free",
        figure=f"procfs 1 -> 0 ({reason}); {len(owners)} of {gpu_processes} processes "
        f"owner=unknown, 0 orphan series; {len(records)} log records, {len(during)} "
        f"lines in {FAULT_S:.0f} s while {attempts} connection attempts went unaccepted; "
        f"up again {recovered_s:.1f} s after the limit was restored",
    )
