"""Every snapshot example in the docs comes from a command the doc gives, and the README's
demo shows its story at once: an XID, zombie memory with its holder and a hog within a
minute. Each test runs the doc's own command, as written there, and checks the
example's lines (or the README's claims) against what it prints or serves."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from exporter.config import ConfigError, parse_config
from exporter.sim.node import ManualClock, SimNode, monotonic_clock
from exporter.sim.scenario import load_scenario
from tests.exporter_process import start, terminate

ROOT = Path(__file__).parent.parent
EXE = "gpu-occupancy-exporter"
EXE_ARGV = [sys.executable, "-m", "exporter"]
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def doc_command(doc: str, contains: str) -> tuple[list[str], list[str]]:
    """The doc's ``sh`` block whose command contains ``contains``, as argv for this
    Python, and the lines of the fenced block right after it (its example output)."""
    blocks = _BLOCK.findall((ROOT / doc).read_text())
    for i, (lang, body) in enumerate(blocks):
        if lang == "sh" and contains in body:
            words = shlex.split(body)
            at = next(n for n, w in enumerate(words) if w.endswith(EXE))
            example = blocks[i + 1][1].splitlines() if i + 1 < len(blocks) else []
            return [*EXE_ARGV, *words[at + 1 :]], example
    raise AssertionError(f"{doc} gives no command containing {contains!r}")


def run(argv: list[str]) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def assert_example_printed(doc: str, contains: str) -> None:
    """Each line of the doc's example is a line of the output; "…" marks rows left out."""
    argv, example = doc_command(doc, contains)
    printed = {line.rstrip() for line in run(argv).splitlines()}
    missing = [ln for ln in example if ln.strip() and not ln.startswith("…") and ln not in printed]
    assert example and not missing, f"{doc}: not printed by {shlex.join(argv[3:])}: {missing}"


@pytest.mark.slow  # a snapshot process, ~4 s
def test_orphans_doc_example_with_its_holders_table_is_reproduced() -> None:
    assert_example_printed("docs/orphans.md", "snapshot --simulate orphans")


@pytest.mark.slow  # a snapshot process, ~4 s
def test_shared_gpus_doc_example_is_reproduced() -> None:
    assert_example_printed("docs/shared-gpus.md", "snapshot --simulate node-8gpu")


@pytest.mark.slow  # a snapshot process, ~4 s
def test_why_idle_doc_example_is_reproduced() -> None:
    assert_example_printed("docs/why-idle.md", "snapshot --simulate why-idle")


@pytest.mark.slow  # a snapshot process, ~4 s
def test_readme_snapshot_demo_shows_xids_zombie_memory_its_holder_and_the_hog() -> None:
    argv, _ = doc_command("README.md", "snapshot --simulate node-8gpu")
    rows = [line.split() for line in run(argv).splitlines()]
    assert ["XID", "ERRORS", "BEFORE", "START", "(kernel", "log)"] in rows
    # GPU 7 fell off the bus before start: its index unknown, the kernel log's address named
    assert ["PCI:0000:88:00", "79", "fatal", "1"] in rows
    assert ["0", "154", "warning", "1"] in rows  # GPU 0 asked for a reset
    assert ["1", "dead_process", "61.0", "1"] in rows  # the SIGKILLed trainer (zombie)
    assert ["4", "unattributed", "3.0", "0"] in rows  # what tiny-kernels left...
    assert ["4", "31337", "python3", "research", "tiny-kernels", "main", "holder"] in rows
    assert ["2", "5", "5", "2.2", "inference/batch-hog/main", "90%"] in rows  # the hog


def _series(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        return str(response.read().decode())


@pytest.mark.slow  # serves until the hog at t=170 s: ~35 s
def test_readme_serve_demo_shows_xid_zombie_holder_and_hog_within_a_minute() -> None:
    argv, _ = doc_command("README.md", "--simulate node-8gpu --simulate-start")
    wanted = {
        "xid": re.compile(r'^gpu_xid_errors_total\{[^}]*xid="79"[^}]*\} 1', re.M),
        "zombie": re.compile(r'^gpu_orphaned_memory_bytes\{[^}]*gpu="1"[^}]*dead_process', re.M),
        "holder": re.compile(r'^gpu_orphaned_holder_info\{[^}]*pid="31337"', re.M),
        "hog": re.compile(
            r'^gpu_container_sm_time_share_ratio\{[^}]*pod="batch-hog"[^}]*\} 0\.(8|9)', re.M
        ),
    }
    url, process = start([*argv[3:], "--log-level", "warning"])
    began, seen = time.monotonic(), dict[str, int]()
    try:
        while len(seen) < len(wanted) and time.monotonic() - began < 60:
            assert process.poll() is None, process.communicate()[1]
            try:
                text = _series(url)
            except OSError:
                text = ""
            for name, pattern in wanted.items():
                if name not in seen and pattern.search(text):
                    seen[name] = round(time.monotonic() - began)
            time.sleep(0.5)
    finally:
        terminate(process)
    assert set(seen) == set(wanted), f"seen within a minute: {seen}"


def test_a_late_start_integrates_counters_from_time_zero() -> None:
    """Started at 170 s, the node reads as if it had run since 0: GPU 1, thermally
    throttled all along, has 170 s of throttle time, and every event up to 170 s applied."""
    node = SimNode(load_scenario("node-8gpu"), ManualClock(170.0))
    assert node.clock_event_time(1)["sw_thermal_slowdown"] == pytest.approx(170e9)
    assert node.gpm_counters(0, None)["sm_active"] == pytest.approx(91 * 170)
    assert node.gpus[7].lost and [x.code for x in node.xids] == [13, 31, 154, 79]


def test_the_monotonic_clock_starts_late_and_runs_fast() -> None:
    origin = time.monotonic() - 2.0  # two real seconds ago
    clock = monotonic_clock(140.0, 10.0, origin=origin)
    assert 160.0 <= clock() < 170.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--simulate", "node-8gpu", "--simulate-speed", "500"], "not in the range 0.1..100"),
        (["--simulate", "node-8gpu", "--simulate-speed", "0"], "not in the range 0.1..100"),
        (["--simulate", "node-8gpu", "--simulate-start", "-5"], "not in the range 0..604800"),
        (["--simulate-start", "170"], "add --simulate SCENARIO"),
        (["--simulated-node", "/tmp", "--simulate-speed", "2"], "python -m exporter.sim"),
    ],
)
def test_bad_simulated_clock_flags_are_one_line_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(argv, env={})


def test_bad_speed_exits_2_with_one_line() -> None:
    result = subprocess.run(
        [*EXE_ARGV, "snapshot", "--simulate", "orphans", "--simulate-speed", "1000"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--simulate-speed" in result.stderr
