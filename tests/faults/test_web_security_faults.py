"""The basic-auth and web-config rows of the fault matrix, against real ``python -m
exporter --simulate single-gpu --web-config-file ...`` processes: a flood of wrong
passwords, a bcrypt cost beyond the ceiling, and hostile or broken config files, at
start and while running."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp
import bcrypt
import pytest
import yaml

from exporter.exposition.web_config import BCRYPT_MAX_COST, MAX_DEPTH, MAX_FILE_BYTES
from tests.exporter_process import EXE, free_port, ready, start, terminate, wait_for
from tests.faults.conftest import RecordFault

pytestmark = pytest.mark.slow  # real exporter processes

MiB = 1024**2
INTERVAL_S = 1.0
NODE = ["--simulate", "single-gpu", "--kube-api", "off", "--interval", str(INTERVAL_S)]
PASSWORD = "s3cret-scrape"
# A well-formed bcrypt hash of cost 31 (2^31 rounds: days of CPU per check), written by
# hand: nothing here ever hashes at that cost.
COST_31 = "$2b$31$N9qo8uLOickgx2ZMRZoMyeIjZAgcfl7p92ldGxad68LJZdL17lhWy"
NOSNIFF = {"http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}}}


def hashed(password: str, cost: int) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=cost)).decode()


def write_config(path: Path, body: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump(body), encoding="utf-8")
    return path


def sample_timestamp(body: str) -> float:
    for line in body.splitlines():
        if line.startswith("gpu_exporter_last_sample_timestamp_seconds "):
            return float(line.split()[1])
    raise AssertionError("no gpu_exporter_last_sample_timestamp_seconds in /metrics")


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


async def get(
    session: aiohttp.ClientSession, url: str, user: str, password: str
) -> tuple[int, str, float]:
    """GET /metrics with basic auth: status, body, seconds."""
    began = time.perf_counter()
    async with session.get(
        url + "/metrics",
        headers=basic(user, password),
        timeout=aiohttp.ClientTimeout(15),
    ) as response:
        return response.status, await response.text(), time.perf_counter() - began


# A change is applied once it looks the same at two looks a second apart, and looks
# happen on requests: requests for this long see any change applied (or refused).
LOOKED_TWICE_S = 2.5


async def looked_twice(session: aiohttp.ClientSession, url: str) -> None:
    """Probe requests every 0.1 s for LOOKED_TWICE_S: past two once-a-second looks."""
    deadline = time.monotonic() + LOOKED_TWICE_S
    while time.monotonic() < deadline:
        async with session.get(url + "/healthz") as response:
            await response.read()
        await asyncio.sleep(0.1)


# --- a flood of wrong passwords ---------------------------------------------------------


async def test_a_flood_of_wrong_passwords_neither_stalls_sampling_nor_shutdown(
    tmp_path: Path, record_fault: RecordFault
) -> None:
    """120 clients send wrong passwords as fast as they are answered for 5 s while a
    scraper whose password was verified once scrapes every 0.25 s and reads the age of
    the sample it gets; then SIGTERM while the flood goes on."""
    config = write_config(
        tmp_path / "web.yml", {"basic_auth_users": {"prometheus": hashed(PASSWORD, 10)}}
    )
    url, process = start([*NODE, "--web-config-file", str(config)])
    try:
        wait_for(lambda: ready(url), process)
        statuses: Counter[int] = Counter()
        ages: list[float] = []
        scraper_statuses: Counter[int] = Counter()
        stop = asyncio.Event()
        terminating = asyncio.Event()  # connections refused from here on are expected
        connector = aiohttp.TCPConnector(limit=0)
        async with (
            aiohttp.ClientSession(connector=connector) as flood,
            aiohttp.ClientSession() as own,
        ):
            status, _, _ = await get(own, url, "prometheus", PASSWORD)  # verified once
            assert status == 200

            async def intruder(n: int) -> None:
                while not stop.is_set():
                    try:
                        status, _, _ = await get(flood, url, "prometheus", f"guess-{n}")
                    except (aiohttp.ClientError, TimeoutError):
                        status = 0
                    if not terminating.is_set():
                        statuses[status] += 1

            async def scraper() -> None:
                while not stop.is_set():
                    sent = time.time()
                    status, body, _ = await get(own, url, "prometheus", PASSWORD)
                    scraper_statuses[status] += 1
                    if status == 200:
                        ages.append(sent - sample_timestamp(body))
                    await asyncio.sleep(0.25)

            tasks = [asyncio.create_task(intruder(n)) for n in range(120)]
            watch = asyncio.create_task(scraper())
            await asyncio.sleep(5)
            # SIGTERM while the flood goes on and password checks are queued
            terminating.set()
            stopped_s, stderr = await asyncio.to_thread(terminate, process)
            stop.set()
            await asyncio.gather(*tasks, watch, return_exceptions=True)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert scraper_statuses[200] >= 10, scraper_statuses
    assert set(scraper_statuses) == {200}, scraper_statuses  # a verified scraper gets in
    worst = max(ages)
    assert worst <= 2.5 * INTERVAL_S, f"sample ages {sorted(ages)[-5:]} at --interval 1"
    assert set(statuses) <= {401, 429, 503}, statuses  # no 200, no 500, nothing hung
    assert stopped_s < 5, f"SIGTERM took {stopped_s:.1f} s"
    answered = ", ".join(f"{n} x {s or 'connection error'}" for s, n in sorted(statuses.items()))
    record_fault(
        "http-basic-auth-flood",
        expected=(
            "120 clients sending wrong passwords neither stall sampling nor delay SIGTERM: "
            "password checks run one at a time on their own worker, at a pace for failed "
            "checks in all, behind a queue fair across addresses (one check per address, "
            "a second gets 429; full: 503 at once), failed logins have a budget per client "
            "(over it: 429 without hashing), and a scraper whose password was verified is "
            "served from the cache of verified passwords."
        ),
        figure=(
            f"sample age at most {worst:.2f} s (median {sorted(ages)[len(ages) // 2]:.2f} s) "
            f"over {len(ages)} scrapes in 5 s at --interval 1, every one 200; the flood got "
            f"{answered}; SIGTERM done in {stopped_s:.2f} s during the flood"
        ),
    )


# --- bcrypt cost ---------------------------------------------------------------------


def run_to_exit(args: list[str], timeout_s: float = 30) -> tuple[int | None, str]:
    """Run the exporter until it exits on its own: (exit status, stderr); None and the
    process killed when it was still running after ``timeout_s``."""
    process = subprocess.Popen(
        [*EXE, *args, "--listen", f"127.0.0.1:{free_port()}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = process.communicate(timeout=timeout_s)
        return process.returncode, stderr
    except subprocess.TimeoutExpired:
        process.kill()
        return None, process.communicate()[1]


async def test_a_bcrypt_cost_above_the_ceiling_is_refused_at_start_and_at_reload(
    tmp_path: Path, record_fault: RecordFault
) -> None:
    config = write_config(tmp_path / "web.yml", {"basic_auth_users": {"slow": COST_31}})
    began = time.monotonic()
    status, stderr = run_to_exit([*NODE, "--web-config-file", str(config)], timeout_s=20)
    start_s = time.monotonic() - began
    assert status == 2, f"exit status {status} for a cost-31 hash; stderr: {stderr}"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "basic_auth_users.slow" in lines[0] and "cost 31" in lines[0], lines[0]
    said = lines[0].split(f"{config}: ", 1)[1].split(";")[0]
    assert f"ceiling of {BCRYPT_MAX_COST}" in lines[0], lines[0]

    # While running: the change is refused, the last good users stay, nothing hashes at 31.
    write_config(config, {"basic_auth_users": {"good": hashed(PASSWORD, 4)}})
    url, process = start([*NODE, "--web-config-file", str(config)])
    try:
        wait_for(lambda: ready(url), process)
        async with aiohttp.ClientSession() as session:
            assert (await get(session, url, "good", PASSWORD))[0] == 200
            time.sleep(0.05)  # a later mtime, whatever the file system's resolution
            write_config(config, {"basic_auth_users": {"slow": COST_31}})
            await looked_twice(session, url)
            kept, _, _ = await get(session, url, "good", PASSWORD)
            assert kept == 200, "the last good users were dropped"
            slow, _, slow_s = await get(session, url, "slow", "anything")
            assert slow == 401 and slow_s < 2, (slow, slow_s)
    finally:
        _, log = terminate(process)
    assert f"cost 31 is above the ceiling of {BCRYPT_MAX_COST}" in log, log
    assert "keeping the previous one" in log, log
    record_fault(
        "config-bcrypt-cost-ceiling",
        expected=(
            f"A bcrypt hash of cost 31 (above the ceiling of {BCRYPT_MAX_COST}) is refused at "
            "start with one line and exit status 2; written while running, the change is "
            "refused with one log line and the last good users are kept."
        ),
        figure=(
            f"exit 2 in {start_s:.1f} s with one line ('{said}'); at reload the old user "
            f"still 200, the cost-31 user 401 in {slow_s * 1000:.0f} ms (never hashed at cost 31)"
        ),
    )


# --- hostile files ----------------------------------------------------------------------


def exit_and_peak_rss(args: list[str], limit_bytes: int) -> tuple[int, str, int]:
    """Run the exporter to its exit under an address-space limit (so a regression cannot
    eat the machine): exit status, stderr and peak RSS in bytes (wait4's ru_maxrss)."""
    stderr_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"web-config-{os.getpid()}.err"
    prefix = [shutil.which("prlimit") or "prlimit", f"--as={limit_bytes}", "--"]
    with stderr_path.open("w+") as err:
        process = subprocess.Popen(
            [*prefix, *EXE, *args, "--listen", f"127.0.0.1:{free_port()}"],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        watchdog = threading.Timer(60, process.kill)
        watchdog.start()
        try:
            _, wait_status, usage = os.wait4(process.pid, 0)
        finally:
            watchdog.cancel()
        process.returncode = os.waitstatus_to_exitcode(wait_status)
        err.seek(0)
        stderr = err.read()
    stderr_path.unlink()
    return process.returncode, stderr, usage.ru_maxrss * 1024


def test_hostile_web_config_files_are_one_line_and_exit_2_in_bounded_memory(
    tmp_path: Path, record_fault: RecordFault
) -> None:
    binary = tmp_path / "binary.yml"
    binary.write_bytes(b"\xff\xfe\x00" + bytes(range(256)) * 64)
    nested = tmp_path / "nested.yml"
    nested.write_text("basic_auth_users: " + "[" * 10_000 + "]" * 10_000 + "\n")
    big = tmp_path / "big.yml"
    with big.open("wb") as f:
        f.truncate(100 * MiB)  # sparse: 100 MiB of NUL bytes
    small_bad = write_config(tmp_path / "small.yml", {"basic_auth_users": {"u": "plain"}})
    hostile = {
        "binary": (binary, "not UTF-8"),
        "10,000-deep nesting": (nested, "nest"),
        "/dev/zero": (Path("/dev/zero"), "not a regular file"),
        "100 MiB": (big, f"larger than {MAX_FILE_BYTES / MiB:g} MiB"),
    }
    limit = 2048 * MiB
    status, stderr, baseline = exit_and_peak_rss(
        [*NODE, "--web-config-file", str(small_bad)], limit
    )
    assert status == 2, stderr
    seen: dict[str, tuple[str, int]] = {}
    for name, (path, needle) in hostile.items():
        status, stderr, peak = exit_and_peak_rss([*NODE, "--web-config-file", str(path)], limit)
        assert "Traceback" not in stderr, f"{name}: {stderr[-2000:]}"
        lines = stderr.strip().splitlines()
        assert status == 2 and len(lines) == 1, f"{name}: exit {status}, stderr {stderr[-2000:]}"
        assert needle in lines[0] and str(path) in lines[0], f"{name}: {lines[0]}"
        assert peak < baseline + 16 * MiB, f"{name}: peak RSS {peak / MiB:.0f} MiB"
        said = lines[0].split(f"{path}:", 1)[1].split(";")[0].strip()
        seen[name] = (said, peak)
    said = "; ".join(f"{name}: '{said}'" for name, (said, _) in seen.items())
    peaks = ", ".join(f"{name} {peak / MiB:.0f} MiB" for name, (_, peak) in seen.items())
    record_fault(
        "config-web-config-hostile-file",
        expected=(
            "A binary, 10,000 levels deep, endless (/dev/zero) or 100 MiB web-config file "
            "stops the exporter at start with one line and exit status 2, no traceback and no "
            f"more memory than a small bad file: at most {MAX_FILE_BYTES / MiB:g} MiB is read, "
            f"a regular file only, nested at most {MAX_DEPTH} levels."
        ),
        figure=(
            f"4 of 4 exit 2 with one line ({said}); peak RSS {peaks} against "
            f"{baseline / MiB:.0f} MiB for a one-line bad file"
        ),
    )


# --- broken while running ---------------------------------------------------------------


async def test_a_web_config_broken_while_running_keeps_the_last_good_settings(
    tmp_path: Path, record_fault: RecordFault
) -> None:
    config = write_config(
        tmp_path / "web.yml", {"basic_auth_users": {"a": hashed(PASSWORD, 4)}, **NOSNIFF}
    )
    broken = {
        "binary": b"\xff\xfe\x00" + bytes(range(256)) * 64,
        "deep": ("basic_auth_users: " + "[" * 10_000 + "]" * 10_000 + "\n").encode(),
        "big": b"#" * (2 * MAX_FILE_BYTES),
        "half-written": b"basic_auth_users:\n  a: '$2y$",
    }
    url, process = start([*NODE, "--web-config-file", str(config)])
    answers: Counter[int] = Counter()
    try:
        wait_for(lambda: ready(url), process)
        async with aiohttp.ClientSession() as session:
            assert (await get(session, url, "a", PASSWORD))[0] == 200
            for body in broken.values():
                time.sleep(0.05)
                config.write_bytes(body)
                deadline = time.monotonic() + LOOKED_TWICE_S
                while time.monotonic() < deadline:
                    async with session.get(
                        url + "/metrics", headers=basic("a", PASSWORD)
                    ) as response:
                        answers[response.status] += 1
                        assert response.status == 200, f"{response.status} after a broken file"
                        assert response.headers.get("X-Content-Type-Options") == "nosniff"
                    await asyncio.sleep(0.1)
            # a good file again is taken
            write_config(config, {"basic_auth_users": {"b": hashed("next", 4)}})
            await looked_twice(session, url)
            assert (await get(session, url, "b", "next"))[0] == 200
            assert (await get(session, url, "a", PASSWORD))[0] == 401
    finally:
        _, log = terminate(process)
    refused = [line for line in log.splitlines() if "not reloaded" in line]
    assert len(refused) == len(broken), log  # one line per broken version, not per request
    assert "Traceback" not in log, log
    record_fault(
        "config-web-config-broken-at-reload",
        expected=(
            "The web-config file written binary, 10,000 levels deep, oversized or half-"
            "written while the exporter runs: every request is still answered with the "
            "last good users and headers (never 500), one error line per broken version, "
            "and the next good file is taken."
        ),
        figure=(
            f"{answers[200]} of {sum(answers.values())} requests 200 over 4 broken versions "
            f"({len(refused)} log lines); a good file afterwards applied within "
            f"{LOOKED_TWICE_S} s"
        ),
    )
