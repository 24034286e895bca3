"""Both exporters at Python's NVML cost and at a hardware-like one, side by side.

The simulated NVML library answers in Python, so over it a call costs what Python spends
on it; on an H200 a few calls cost milliseconds of driver time (docs/validation.md, "What
NVML costs, call by call"). Each case here runs a simulated node in its own process twice:
``--cost none`` ("Python cost") and ``--cost h200`` ("hardware-like cost": every NVML
call of every attached exporter first spends the H200's figure of CPU outside the GIL,
exporter/sim/cost_model.py). Our exporter and nvitop-exporter (benchmarks/peer.py) run
over it side by side, each scraped every 5 s as whole_process.py does; figures: CPU
milliseconds per second of each whole process, the ratio nvitop-exporter / ours, RSS.

Cases: (a) ``benchmarks/scenarios/h200-4gpu.yaml`` (4 H200s, 7 GPU processes), both at
``--interval 1``; (b) the same node at each exporter's default interval (ours:
``--interval`` in exporter/config.py; nvitop-exporter's: 1 s, benchmarks/peer.py);
(c) ``benchmarks/scenarios/h200-idle.yaml`` (one idle H200, no processes), both at
``--interval 1``. First it measures the cost model itself: what ``spend(2 ms)`` spends.

Usage: ``python benchmarks/hardware_cost.py [--quick]``; writes
``benchmarks/results/hardware-cost[-quick].{json,md}``. ``run.py`` runs it as a section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # run from a checkout without installing

from machine import machine_line  # noqa: E402
from peer import peer_available, peer_command  # noqa: E402
from processes import (  # noqa: E402
    OPENMETRICS_ACCEPT,
    ROOT,
    ExporterProcess,
    NodeServer,
    PeriodicScraper,
    all_sources_up,
    cpu_per_second,
    exporter_argv,
    free_port,
    memory_mib,
    percentile,
    running,
)

from exporter.config import FLAG_GROUPS  # noqa: E402
from exporter.sim.cost_model import PROFILES, spend  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
SCENARIOS = HERE / "scenarios"
PROFILE = "h200"
MODES = {"python": "none", "hardware": PROFILE}  # mode -> the node's --cost
PEER_DEFAULT_INTERVAL_S = 1.0  # nvitop-exporter 1.7.2's --interval default (peer.py)
SCRAPE_EVERY_S = 5.0

# Targets printed beside the figures (benchmarks, not tests; benchmarks/README.md).
TARGET_RSS_MIB = 81.0  # ours, every case


@dataclass(frozen=True)
class Case:
    key: str
    title: str
    scenario: str
    ours_interval_s: float | None  # None: our default (no --interval flag)
    peer_interval_s: float
    target_ratio: float  # nvitop-exporter's CPU over ours, at least


CASES = (
    Case("a", "4 H200s, 7 processes, both --interval 1", "h200-4gpu.yaml", 1.0, 1.0, 3.0),
    Case(
        "b",
        "4 H200s, 7 processes, each at its default interval",
        "h200-4gpu.yaml",
        None,
        PEER_DEFAULT_INTERVAL_S,
        10.0,
    ),
    Case("c", "1 idle H200, no processes, both --interval 1", "h200-idle.yaml", 1.0, 1.0, 1.0),
)


@dataclass(frozen=True)
class Plan:
    warmup_s: float  # after both serve, before CPU is measured
    window_s: float  # a multiple of the longest interval, so each covers whole cycles
    spends: int  # calls of spend(2 ms) to measure the model's accuracy


FULL = Plan(warmup_s=10, window_s=40, spends=1000)
QUICK = Plan(warmup_s=3, window_s=10, spends=1000)


def our_default_interval_s() -> float:
    """``--interval``'s default, from the flag table the exporter parses."""
    for group in FLAG_GROUPS:
        for flag in group.flags:
            if flag.name == "--interval" and isinstance(flag.default, str):
                return float(flag.default)
    raise RuntimeError("exporter/config.py has no --interval default")


class CostNode(NodeServer):
    """``python -m exporter.sim SCENARIO --dir DIR --cost NAME``: NodeServer with the
    cost profile every exporter attached to the node applies."""

    def __init__(self, scenario: str, cost: str) -> None:
        self.scenario = scenario
        self._tmp = tempfile.TemporaryDirectory(prefix="gpusim-cost-")
        self.dir = Path(self._tmp.name)
        self._log = tempfile.TemporaryFile()  # noqa: SIM115  # closed with the process
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "exporter.sim",
                scenario,
                "--dir",
                str(self.dir),
                "--cost",
                cost,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        deadline = time.monotonic() + 60
        while not (self.dir / "node.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._tmp.cleanup()
                raise RuntimeError(f"simulated node {scenario!r} did not start: {self.log()}")
            time.sleep(0.05)
        self.description = json.loads((self.dir / "node.json").read_text())


def model_accuracy(spends: int) -> dict[str, Any]:
    """Thread CPU that ``spend(2 ms)`` actually spends, ``spends`` times."""
    spend(10)  # the first call maps and faults in the buffer it hashes
    spent = []
    for _ in range(spends):
        started = time.thread_time_ns()
        spend(2000)
        spent.append((time.thread_time_ns() - started) / 1000)
    return {
        "asked_us": 2000,
        "n": spends,
        "median_us": statistics.median(spent),
        "p99_us": percentile(spent, 99),
        "max_us": max(spent),
    }


def measure_case(case: Case, mode: str, plan: Plan, log: list[str]) -> dict[str, Any]:
    node = CostNode(str(SCENARIOS / case.scenario), MODES[mode])
    try:
        ours_port, peer_port = free_port(), free_port()
        argv = exporter_argv(node.dir, ours_port, case.ours_interval_s or 1.0)
        if case.ours_interval_s is None:  # the default: drop --interval 1
            at = argv.index("--interval")
            del argv[at : at + 2]
        ours = ExporterProcess(
            argv, ours_port, ready_when=all_sources_up(), name="gpu-occupancy-exporter"
        )
        peer = ExporterProcess(
            peer_command(node.dir, peer_port, case.peer_interval_s),
            peer_port,
            name="nvitop-exporter",
        )
        with running(ours, peer, log=log):
            time.sleep(plan.warmup_s)
            with (
                PeriodicScraper(ours.port, SCRAPE_EVERY_S, OPENMETRICS_ACCEPT),
                PeriodicScraper(peer.port, SCRAPE_EVERY_S, {}),
            ):
                cpu = cpu_per_second({"ours": ours.pid, "peer": peer.pid}, plan.window_s)
            memory = {"ours": memory_mib(ours.pid), "peer": memory_mib(peer.pid)}
    finally:
        node.stop()
    ours_ms, peer_ms = cpu["ours"]["cpu_ms_per_s"], cpu["peer"]["cpu_ms_per_s"]
    return {
        "node_cost": node.description.get("cost"),
        "cpu": cpu,
        "memory": memory,
        "ratio": peer_ms / ours_ms if ours_ms > 0 else None,
    }


def measure(plan: Plan) -> dict[str, Any]:
    started = time.monotonic()
    result: dict[str, Any] = {
        "profile": PROFILE,
        "profile_source": PROFILES[PROFILE].source,
        "plan": asdict(plan),
        "our_default_interval_s": our_default_interval_s(),
        "peer_default_interval_s": PEER_DEFAULT_INTERVAL_S,
        "model": model_accuracy(plan.spends),
        "cases": {},
    }
    unavailable = peer_available()
    if unavailable is not None:
        result["peer_unavailable"] = unavailable
        return result
    log: list[str] = []
    for case in CASES:
        result["cases"][case.key] = {
            "case": asdict(case),
            **{mode: measure_case(case, mode, plan, log) for mode in MODES},
        }
        print(f"  case ({case.key}) measured", flush=True)
    result["stderr"] = [line for line in log if "WARNING" in line or "ERROR" in line][-20:]
    result["duration_s"] = time.monotonic() - started
    return result


# -- report ----------------------------------------------------------------------------


Figure = tuple[str, float, str, float | None, bool]  # name, value, unit, target, at least
LABELS = {"python": "Python cost", "hardware": "hardware-like cost"}


def _figures(r: dict[str, Any], target_ratio: float) -> list[Figure]:
    """One mode's figures of one case."""
    cpu, memory = r["cpu"], r["memory"]
    return [
        ("CPU per second, ours", cpu["ours"]["cpu_ms_per_s"], "ms", None, False),
        ("CPU per second, nvitop-exporter", cpu["peer"]["cpu_ms_per_s"], "ms", None, False),
        ("CPU nvitop-exporter / ours", r["ratio"] or 0.0, "x", target_ratio, True),
        ("RSS, ours", memory["ours"]["rss"], "MiB", TARGET_RSS_MIB, False),
        ("RSS, nvitop-exporter", memory["peer"]["rss"], "MiB", None, False),
    ]


def rows(result: dict[str, Any]) -> list[Figure]:
    """Every figure as (figure, value, unit, target, at_least): what run.py's Row takes."""
    model = result["model"]
    out: list[Figure] = [
        ("cost model: spend(2 ms) median", model["median_us"] / 1000, "ms", None, False),
        ("cost model: spend(2 ms) p99", model["p99_us"] / 1000, "ms", None, False),
    ]
    for key, case in result["cases"].items():
        for mode, label in LABELS.items():
            out += [
                (f"({key}) {label}: {name}", value, unit, target, at_least)
                for name, value, unit, target, at_least in _figures(
                    case[mode], case["case"]["target_ratio"]
                )
            ]
    return out


def _cell(value: float, unit: str, target: float | None, at_least: bool) -> str:
    if target is None:
        return f"{value:.2f} {unit}"
    ok = value >= target if at_least else value <= target
    return f"{value:.2f} {unit} ({'pass' if ok else 'FAIL'})"


def markdown(result: dict[str, Any]) -> str:
    model = result["model"]
    lines = [
        "## Hardware-like NVML cost (benchmarks/hardware_cost.py)",
        "",
        f"Profile `{result['profile']}`: {result['profile_source']}. Each case runs twice, "
        "the node's `--cost none` (Python cost) and `--cost h200` (hardware-like cost); "
        "both exporters over the same simulated node, scraped every 5 s; "
        f"{result['plan']['window_s']:g} s of CPU after {result['plan']['warmup_s']:g} s.",
        "",
        f"The model itself: `spend(2 ms)` x {model['n']} spent {model['median_us']:.0f} µs "
        f"median, {model['p99_us']:.0f} µs p99 of thread CPU (max {model['max_us']:.0f}).",
        "",
    ]
    if "peer_unavailable" in result:
        return "\n".join([*lines, f"nvitop-exporter unavailable: {result['peer_unavailable']}"])
    lines += [
        "| case | figure | Python cost | hardware-like cost | target |",
        "|---|---|---:|---:|---|",
    ]
    for key, case in result["cases"].items():
        c = case["case"]
        ours_at = c["ours_interval_s"] or result["our_default_interval_s"]
        title = (
            f"({key}) {c['title']} (ours {ours_at:g} s, nvitop-exporter {c['peer_interval_s']:g} s)"
        )
        python = _figures(case["python"], c["target_ratio"])
        hardware = _figures(case["hardware"], c["target_ratio"])
        for i, (py, hw) in enumerate(zip(python, hardware, strict=True)):
            name, value, unit, target, at_least = py
            bound = "—" if target is None else f"{'≥' if at_least else '≤'} {target:g} {unit}"
            lines.append(
                f"| {title if i == 0 else ''} | {name} | {_cell(value, unit, target, at_least)} "
                f"| {_cell(hw[1], unit, target, at_least)} | {bound} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short windows (under ~2 minutes)")
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS_DIR,
        metavar="DIR",
        help="where to write hardware-cost[-quick].{json,md} (default benchmarks/results)",
    )
    args = parser.parse_args()
    now = datetime.now(UTC)
    print(f"hardware-like NVML cost ({'quick' if args.quick else 'full'} run), {machine_line()}")
    result = {
        "mode": "quick" if args.quick else "full",
        "started": now.isoformat(timespec="seconds"),
        "machine": machine_line(),
        **measure(QUICK if args.quick else FULL),
    }
    text = markdown(result)
    print()
    print(text)
    for line in result.get("stderr", []):
        print(f"stderr: {line}")
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / ("hardware-cost-quick" if args.quick else "hardware-cost")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(f"# {text.removeprefix('## ')}\n\n{result['machine']}\n")
    print(f"wrote {stem}.{{json,md}}")
    return 2 if "peer_unavailable" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
