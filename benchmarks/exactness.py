"""Exactness of the activity counters: a real Prometheus scrapes the exporter on a node
busy in bursts at three scrape intervals; ``rate(x[5m])`` of every activity counter is set
against the scenario's true mean, the matching gauge's sampled mean beside it.

The node (tests/e2e/node-exactness.yaml): GPU 0 busy 10 s of every 30 s, GPU 1 in 100 ms
bursts (period 1 s, busy 0.1), every GPM level, GPU-Util and one pod process's SM share
set by the scenario. The truth of each counter is level x busy share, worked out from the
file: the rate window (300 s) is a whole number of both duty periods, so the mean over
any such window is exactly that, wherever it starts.

One Prometheus (Debian's ``/usr/bin/prometheus``), three scrape jobs on the same exporter,
every 15 s, 30 s and 60 s. After the window has filled, ``rate(x[300s])``,
``avg_over_time(gauge[300s])`` and ``rate(x) / rate(gpu_activity_sampled_seconds_total)``
are read as range queries at evaluation instants every 1 s over ``EVAL_SPAN`` (60 s: a
whole number of GPU 0's duty period, of the 60 s scrape and of two 15 s scrapes), so
the mean over the instants is the mean over every phase of the scrapes against the
workload; the minimum and maximum are what a single instant can show.

``--quick`` (and tests/e2e/test_activity_exactness.py) runs 10x faster: GPU 0 busy 1 s
of every 3 s, ``--interval 0.5 --gpm-interval 1 --process-utilization-interval 1``,
scrapes every 1.5 s, 3 s and 6 s, ``rate(x[30s])``. GPU 1's 100 ms bursts once a second
are NOT scaled (``KEEP_PERIOD_S``): at 10 ms every 100 ms they would fill every 1/6 s
GPU-Util sample period, and the sparse sample buffer of a bursty GPU would go untested
(1 s divides the 30 s window and the 6 s of instants, so the truth is unchanged).

Usage: ``python benchmarks/exactness.py [--quick]``: writes
``benchmarks/results/exactness.{json,md,png}`` (``exactness-quick.*`` with ``--quick``);
about 9 minutes (quick: about 1 minute).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from exporter.model import OCCUPANCY_FIELDS  # noqa: E402
from tests.e2e.stack import (  # noqa: E402
    Child,
    PromApi,
    free_port,
    http_get,
    start_prometheus,
    wait_until,
)

SCENARIO = ROOT / "tests" / "e2e" / "node-exactness.yaml"
RESULTS_DIR = ROOT / "benchmarks" / "results"
GPM = OCCUPANCY_FIELDS  # the GPM metrics, as the exporter names them
UTILIZATION = "gpu_utilization_seconds_total"
CONTAINER = "gpu_container_sm_seconds_total"
SAMPLED = "gpu_activity_sampled_seconds_total"
# counter -> (the gauge beside it, the gpu_activity_sampled_seconds_total signal or None)
COUNTERS: dict[str, tuple[str, str | None]] = {
    **{f"gpu_{m}_seconds_total": (f"gpu_{m}_ratio", m) for m in GPM},
    UTILIZATION: ("gpu_utilization_ratio", "utilization"),
    CONTAINER: ("gpu_container_sm_utilization_ratio", None),
}
BOUND = 0.02  # the claim: rate() of each counter within 2 % of the true mean


@dataclass(frozen=True)
class Scale:
    """Real time (``factor`` 1) or ``factor`` times faster: every period and interval
    divided by it."""

    factor: int = 1
    interval_s: float = 5.0  # the exporter's defaults at factor 1
    gpm_interval_s: float = 10.0
    process_interval_s: float = 10.0
    scrapes_s: tuple[float, ...] = (15.0, 30.0, 60.0)
    window_s: float = 300.0
    eval_span_s: float = 60.0
    eval_step_s: float = 1.0

    @classmethod
    def of(cls, factor: int) -> Scale:
        base = cls()
        return cls(
            factor,
            base.interval_s / factor,
            base.gpm_interval_s / factor,
            base.process_interval_s / factor,
            tuple(s / factor for s in base.scrapes_s),
            base.window_s / factor,
            base.eval_span_s / factor,
            base.eval_step_s / factor,
        )

    def job(self, scrape_s: float) -> str:
        return f"exactness-{round(scrape_s * 1000)}ms"


# Bursts (a duty period of at most this) are not scaled: NVML's GPU-Util samples come
# every 1/6 s (the simulator's period, docs/simulator.md, fixed), and a period with no
# activity holds no sample. 100 ms bursts once a second leave most sample periods empty,
# as on a real bursty GPU; scaled to 10 ms every 100 ms they would fill every period and
# the sparse buffer would never be read.
KEEP_PERIOD_S = 1.0


def scaled_scenario(doc: dict[str, Any], factor: int) -> dict[str, Any]:
    """The scenario with every duty period longer than ``KEEP_PERIOD_S`` (and its offset)
    divided by ``factor``; bursts, busy shares, levels and everything else unchanged."""
    out: dict[str, Any] = json.loads(json.dumps(doc))
    for gpu in out["gpus"]:
        duty = gpu.get("duty")
        if duty and duty["period_s"] > KEEP_PERIOD_S:
            gpu["duty"] = {
                **duty,
                "period_s": duty["period_s"] / factor,
                **({"offset_s": duty["offset_s"] / factor} if "offset_s" in duty else {}),
            }
    return out


def truths(doc: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(counter, gpu index) -> the true mean of rate(counter) over a whole number of duty
    periods: level x busy share. GPM: the scenario's ``gpm`` percentages; GPU-Util: its
    ``utilization_gpu``; a container: the sum of its processes' ``sm`` on that GPU."""
    out: dict[tuple[str, str], float] = {}
    for index, gpu in enumerate(doc["gpus"]):
        busy = float(gpu["duty"]["busy"]) if gpu.get("duty") else 1.0
        for metric in GPM:
            out[(f"gpu_{metric}_seconds_total", str(index))] = gpu["gpm"][metric] / 100 * busy
        out[(UTILIZATION, str(index))] = gpu["utilization_gpu"] / 100 * busy
    for pod in doc.get("pods", []):
        for container in pod["containers"]:
            for proc in container.get("processes", []):
                key = (CONTAINER, str(proc["gpu"]))
                out[key] = out.get(key, 0.0) + proc["sm"] / 100 * float(
                    doc["gpus"][proc["gpu"]].get("duty", {}).get("busy", 1.0)
                )
    return out


def duty_of(doc: dict[str, Any], gpu: str) -> tuple[float, float]:
    """(period, busy seconds per period) of a GPU's duty cycle."""
    duty = doc["gpus"][int(gpu)]["duty"]
    return float(duty["period_s"]), float(duty["period_s"]) * float(duty["busy"])


def read_interval(scale: Scale, counter: str) -> float:
    """How often the exporter adds to ``counter``: its window."""
    if counter == UTILIZATION:
        return scale.interval_s
    if counter == CONTAINER:
        return scale.process_interval_s
    return scale.gpm_interval_s


def instant_bound(
    scale: Scale, doc: dict[str, Any], counter: str, gpu: str, scrape_s: float
) -> float:
    """The most one instant's ``rate(x[w])`` can be off the true mean (relative), by
    construction. Prometheus' rate() sees the increase between the first and the last
    sample in the range, ``span = w - scrape`` apart, extrapolated to ``w``; the counter
    at a scrape holds the windows closed by then, so the increase covers ``span + d``
    seconds of the workload, ``|d|`` at most one window of the counter plus one exporter
    cycle (late cycles). Over any stretch of a duty cycle (period P, busy B) the busy time
    is off its mean share by at most B(P-B)/P, i.e. (P-B)/span of the mean. Sum:
    (window + cycle + P - B) / span."""
    period, busy = duty_of(doc, gpu)
    span = scale.window_s - scrape_s
    return (read_interval(scale, counter) + scale.interval_s + period - busy) / span


@dataclass
class Row:
    job: str
    scrape_s: float
    counter: str
    gpu: str
    truth: float
    instants: int = 0
    rate_mean: float = math.nan
    rate_min: float = math.nan
    rate_max: float = math.nan
    measured_mean: float = math.nan  # rate(x) / rate(sampled)
    measured_min: float = math.nan
    measured_max: float = math.nan
    gauge_mean: float = math.nan  # avg_over_time(gauge[w]), averaged over the instants
    gauge_min: float = math.nan
    gauge_max: float = math.nan
    instant_bound: float = math.nan

    @property
    def err_mean(self) -> float:
        return self.rate_mean / self.truth - 1

    @property
    def err_worst(self) -> float:
        lo, hi = self.rate_min / self.truth - 1, self.rate_max / self.truth - 1
        return hi if abs(hi) >= abs(lo) else lo

    @property
    def gauge_err(self) -> float:
        return self.gauge_mean / self.truth - 1

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "err_mean": self.err_mean,
            "err_worst_instant": self.err_worst,
            "gauge_err": self.gauge_err,
        }


@dataclass
class Run:
    scale: Scale
    scenario: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    sim_t0: float = math.nan
    eval_start: float = math.nan
    eval_end: float = math.nan
    wall_s: float = math.nan
    prometheus_version: str = ""
    commit: str = ""
    exporter_changes: list[str] = field(default_factory=list)  # not committed, at start
    notes: list[str] = field(default_factory=list)


def exporter_argv(scenario: Path, port: int, scale: Scale) -> list[str]:
    return [
        sys.executable,
        "-m",
        "exporter",
        "--simulate",
        str(scenario),
        "--listen",
        f"127.0.0.1:{port}",
        "--interval",
        f"{scale.interval_s:g}",
        "--gpm-interval",
        f"{scale.gpm_interval_s:g}",
        "--process-utilization-interval",
        f"{scale.process_interval_s:g}",
        "--pod-resources-interval",
        "2",
        "--dcgm",
        "off",
    ]


def prometheus_config(port: int, scale: Scale) -> dict[str, Any]:
    """One job per scrape interval, all on the same exporter."""
    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "scrape_configs": [
            {
                "job_name": scale.job(s),
                "scrape_interval": f"{round(s * 1000)}ms",
                "scrape_timeout": f"{round(min(s, 10.0) * 1000)}ms",
                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
            }
            for s in scale.scrapes_s
        ],
    }


def prometheus_version(binary: str) -> str:
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    first = (out.stdout or out.stderr).splitlines()
    return first[0] if first else "unknown"


@contextmanager
def stack(
    binary: str, tmp: Path, scale: Scale, doc: dict[str, Any], lifetime_s: float
) -> Iterator[tuple[PromApi, Child, Child]]:
    """The exporter on the (scaled) scenario and Prometheus scraping it, both bounded by
    coreutils' timeout and stopped on the way out."""
    scenario = tmp / "node-exactness.yaml"
    scenario.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    exporter_port, prom_port = free_port(), free_port()
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(exporter_port, scale)), encoding="utf-8")
    children: list[Child] = []
    try:
        exporter = Child(
            "exporter",
            exporter_argv(scenario, exporter_port, scale),
            tmp / "exporter.log",
            lifetime_s=lifetime_s,
        )
        children.append(exporter)

        def exporter_ready() -> bool:
            exporter.check_alive()
            return http_get(f"http://127.0.0.1:{exporter_port}/readyz", timeout=2)[0] == 200

        wait_until(exporter_ready, timeout_s=30, what="the exporter's /readyz")
        prometheus = start_prometheus(
            binary, config, tmp / "tsdb", prom_port, tmp / "prom.log", lifetime_s=lifetime_s
        )
        children.append(prometheus)
        api = PromApi(prom_port)

        def prometheus_ready() -> bool:
            prometheus.check_alive()
            return api.ready()

        wait_until(prometheus_ready, timeout_s=30, what="Prometheus' /-/ready")
        yield api, exporter, prometheus
    finally:
        for child in reversed(children):
            child.stop()


def _range(
    api: PromApi, expr: str, start: float, end: float, step: float
) -> dict[str, list[float]]:
    """gpu -> values of a range query (one series per gpu)."""
    data = api.query_range(expr, start, end, step)
    if data.get("status") != "success":
        raise AssertionError(f"query {expr!r} failed: {data.get('error')}")
    out: dict[str, list[float]] = {}
    for series in data["data"]["result"]:
        gpu = series["metric"].get("gpu", "")
        if gpu in out:
            raise AssertionError(f"{expr!r}: more than one series for gpu {gpu}")
        out[gpu] = [float(v) for _, v in series["values"]]
    return out


def measure(run: Run, api: PromApi, start: float) -> None:
    """The rows: every counter x GPU x scrape job, over the instants from ``start``."""
    scale, doc = run.scale, run.scenario
    w = f"{round(scale.window_s * 1000)}ms"
    end = start + scale.eval_span_s - scale.eval_step_s / 2
    run.eval_start, run.eval_end = start, end
    truth = truths(doc)
    expected = round(scale.eval_span_s / scale.eval_step_s)
    for scrape_s in scale.scrapes_s:
        job = scale.job(scrape_s)
        for counter, (gauge, signal) in COUNTERS.items():
            sel = f'{{job="{job}"}}'
            rates = _range(api, f"rate({counter}{sel}[{w}])", start, end, scale.eval_step_s)
            gauges = _range(api, f"avg_over_time({gauge}{sel}[{w}])", start, end, scale.eval_step_s)
            measured: dict[str, list[float]] = {}
            if signal is not None:
                sampled = f'{SAMPLED}{{job="{job}",signal="{signal}"}}'
                measured = _range(
                    api,
                    f"rate({counter}{sel}[{w}]) / ignoring(signal) rate({sampled}[{w}])",
                    start,
                    end,
                    scale.eval_step_s,
                )
            for gpu in sorted({g for c, g in truth if c == counter}):
                row = Row(job, scrape_s, counter, gpu, truth[(counter, gpu)])
                row.instant_bound = instant_bound(scale, doc, counter, gpu, scrape_s)
                values = rates.get(gpu, [])
                row.instants = len(values)
                if len(values) == expected:  # a missing instant: the row stays NaN
                    row.rate_mean = statistics.fmean(values)
                    row.rate_min, row.rate_max = min(values), max(values)
                if gauges.get(gpu):
                    g = gauges[gpu]
                    row.gauge_mean, row.gauge_min, row.gauge_max = (
                        statistics.fmean(g),
                        min(g),
                        max(g),
                    )
                if measured.get(gpu):
                    m = measured[gpu]
                    row.measured_mean = statistics.fmean(m)
                    row.measured_min, row.measured_max = min(m), max(m)
                run.rows.append(row)


def execute(scale: Scale, binary: str, log: Any = print) -> Run:
    """Start the stack, wait for the window to fill, measure, stop."""
    doc = scaled_scenario(yaml.safe_load(SCENARIO.read_text(encoding="utf-8")), scale.factor)
    run = Run(scale, doc, prometheus_version=prometheus_version(binary))
    # what the exporter runs: the tree as it is when it starts
    run.commit = _git("rev-parse", "HEAD")
    run.exporter_changes = _git("status", "--porcelain", "exporter/").splitlines()
    began = time.monotonic()
    settle = scale.window_s + 2 * max(scale.scrapes_s)
    lifetime = settle + scale.eval_span_s + 120
    with (
        tempfile.TemporaryDirectory(prefix="exactness-") as tmp_name,
        stack(binary, Path(tmp_name), scale, doc, lifetime) as (api, exporter, prometheus),
    ):
        jobs = [scale.job(s) for s in scale.scrapes_s]

        def all_up() -> bool:
            exporter.check_alive()
            prometheus.check_alive()
            up = api.series("up == 1 and on(job) gpu_container_sm_seconds_total")
            return {s["metric"]["job"] for s in up} >= set(jobs)

        wait_until(
            all_up,
            timeout_s=30 + 2 * max(scale.scrapes_s),
            what="a scrape with the container counter by every job",
            diagnostics=lambda: exporter.log_tail() + "\n" + prometheus.log_tail(),
        )
        start = time.time() + settle
        log(
            f"[exactness] every job scraped; measuring from {settle:.0f} s on "
            f"for {scale.eval_span_s:g} s"
        )
        while time.time() < start + scale.eval_span_s + 1:
            exporter.check_alive()
            prometheus.check_alive()
            time.sleep(min(1.0, max(0.05, start + scale.eval_span_s + 1 - time.time())))
        measure(run, api, start)
    run.wall_s = time.monotonic() - began
    return run


# --- the report ---------------------------------------------------------------------


def _pace(scale: Scale) -> str:
    return "real time" if scale.factor == 1 else f"{scale.factor}x faster"


def _short(counter: str) -> str:
    return counter.removeprefix("gpu_").removesuffix("_seconds_total")


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 100:+.2f} %"


def markdown(run: Run) -> str:
    scale = run.scale
    minutes = scale.window_s / 60
    window = f"{minutes:g}m" if minutes >= 1 else f"{scale.window_s:g}s"
    lines = [
        f"# Exactness of the activity counters ({_pace(scale)})",
        "",
        "- Node: `tests/e2e/node-exactness.yaml`"
        + (f", duty periods / {scale.factor}" if scale.factor != 1 else "")
        + "; "
        + "; ".join(
            f"GPU {i} busy {duty_of(run.scenario, str(i))[1]:g} s of every "
            f"{duty_of(run.scenario, str(i))[0]:g} s"
            for i in range(len(run.scenario["gpus"]))
        ),
        f"- Exporter on the simulator: `--interval {scale.interval_s:g} --gpm-interval "
        f"{scale.gpm_interval_s:g} --process-utilization-interval {scale.process_interval_s:g}`",
        f"- {run.prometheus_version}; jobs scraping every "
        + ", ".join(f"{s:g} s" for s in scale.scrapes_s)
        + f"; `rate(x[{window}])` and `avg_over_time(gauge[{window}])` at "
        f"{round(scale.eval_span_s / scale.eval_step_s)} instants, every {scale.eval_step_s:g} s "
        f"over {scale.eval_span_s:g} s",
        f"- Commit {run.commit[:7]}"
        + (
            f" (exporter/ changed: {', '.join(run.exporter_changes)})"
            if run.exporter_changes
            else ""
        )
        + f"; machine: {_machine()}; run took {run.wall_s:.0f} s, "
        f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        "error = measured / truth - 1. *rate, mean*: the mean of `rate()` over the instants; "
        "*worst instant*: the instant furthest off; *bound*: what one instant can be off by "
        "construction (benchmarks/exactness.py, `instant_bound`); *rate/sampled*: "
        "`rate(x) / rate(gpu_activity_sampled_seconds_total{signal})`, mean error; "
        "*gauge*: `avg_over_time` of the gauge beside the counter, mean over the instants "
        "(min..max of the instants).",
        "",
        "| scrape | GPU | counter | truth | rate, mean | error | worst instant | bound "
        "| rate/sampled | gauge sampled mean (min..max) | gauge error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in run.rows:
        sampled = "" if math.isnan(row.measured_mean) else _pct(row.measured_mean / row.truth - 1)
        lines.append(
            f"| {row.scrape_s:g} s | {row.gpu} | {_short(row.counter)} | {row.truth:.4f} | "
            f"{row.rate_mean:.4f} | {_pct(row.err_mean)} | {_pct(row.err_worst)} | "
            f"±{row.instant_bound * 100:.1f} % | {sampled} | {row.gauge_mean:.4f} "
            f"({row.gauge_min:.3f}..{row.gauge_max:.3f}) | {_pct(row.gauge_err)} |"
        )
    worst = max(run.rows, key=lambda r: abs(r.err_mean))
    worst_instant = max(run.rows, key=lambda r: abs(r.err_worst))
    lines += [
        "",
        f"- Largest error of the mean over the instants: {_pct(worst.err_mean)} "
        f"({_short(worst.counter)}, GPU {worst.gpu}, {worst.scrape_s:g} s scrape); "
        f"{sum(abs(r.err_mean) <= BOUND for r in run.rows)} of {len(run.rows)} rows within "
        f"{BOUND * 100:g} %.",
        f"- Largest error of one instant: {_pct(worst_instant.err_worst)} "
        f"({_short(worst_instant.counter)}, GPU {worst_instant.gpu}, "
        f"{worst_instant.scrape_s:g} s scrape); "
        f"{sum(abs(r.err_worst) <= BOUND for r in run.rows)} of {len(run.rows)} rows have "
        f"every instant within {BOUND * 100:g} %.",
        f"- Gauges' sampled mean: {sum(abs(r.gauge_err) > BOUND for r in run.rows)} of "
        f"{len(run.rows)} rows more than {BOUND * 100:g} % off the truth.",
        *(f"- {note}" for note in run.notes),
        "",
    ]
    return "\n".join(lines)


def _machine() -> str:
    """benchmarks/machine.py's line, imported as the other benchmarks import it (by its
    folder on sys.path): this module is also imported as ``benchmarks.exactness`` by the
    e2e test, and one file under two module names breaks ``mypy benchmarks``."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return str(importlib.import_module("machine").machine_line())


def _spread(mean: float, low: float, high: float, truth: float) -> list[list[float]]:
    """An error bar from the lowest to the highest instant, relative to the truth (never
    negative: the mean of equal values can round past them)."""
    return [[max(0.0, (mean - low) / truth)], [max(0.0, (high - mean) / truth)]]


def plot(run: Run, path: Path) -> bool:
    """Measured / truth per counter: the counter's rate (mean over the instants, bar from
    the lowest to the highest instant) and the gauge's sampled mean, one panel per GPU and
    scrape interval. False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = sorted({r.gpu for r in run.rows})
    scrapes = run.scale.scrapes_s
    counters = list(COUNTERS)
    fig, axes = plt.subplots(
        len(gpus), len(scrapes), figsize=(5 * len(scrapes), 4 * len(gpus)), squeeze=False
    )
    for i, gpu in enumerate(gpus):
        period, busy = duty_of(run.scenario, gpu)
        for j, scrape_s in enumerate(scrapes):
            ax = axes[i][j]
            rows = {r.counter: r for r in run.rows if r.gpu == gpu and r.scrape_s == scrape_s}
            xs = list(range(len(counters)))
            for x, counter in zip(xs, counters, strict=True):
                r = rows.get(counter)
                if r is None:
                    continue
                ax.errorbar(
                    x - 0.15,
                    r.rate_mean / r.truth,
                    yerr=_spread(r.rate_mean, r.rate_min, r.rate_max, r.truth),
                    fmt="o",
                    color="tab:blue",
                    label="counter: rate() (mean, instants' range)" if x == 0 else None,
                )
                ax.errorbar(
                    x + 0.15,
                    r.gauge_mean / r.truth,
                    yerr=_spread(r.gauge_mean, r.gauge_min, r.gauge_max, r.truth),
                    fmt="s",
                    color="tab:orange",
                    label="gauge: avg_over_time() (mean, range)" if x == 0 else None,
                )
            ax.axhline(1.0, color="black", linewidth=1, label="truth")
            ax.axhspan(1 - BOUND, 1 + BOUND, color="green", alpha=0.15, label="±2 %")
            ax.set_xticks(xs)
            ax.set_xticklabels([_short(c) for c in counters], rotation=60, ha="right", fontsize=8)
            ax.set_title(
                f"GPU {gpu} (busy {busy:g} s of {period:g} s), scrape {scrape_s:g} s", fontsize=10
            )
            ax.set_ylabel("measured / truth")
            ax.set_ylim(-0.1, 3.2)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Activity counters vs gauges against the truth ({_pace(run.scale)})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip()


def to_json(run: Run) -> dict[str, Any]:
    return {
        "commit": run.commit,
        "exporter_changes_not_committed": run.exporter_changes,
        "scale": asdict(run.scale),
        "scenario": run.scenario,
        "prometheus": run.prometheus_version,
        "machine": _machine(),
        "wall_s": run.wall_s,
        "eval_start": run.eval_start,
        "eval_end": run.eval_end,
        "rows": [r.summary() for r in run.rows],
        "notes": run.notes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10x faster (about 1 minute)")
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "/usr/bin/prometheus")
    args = parser.parse_args(argv)
    scale = Scale.of(10 if args.quick else 1)
    run = execute(scale, args.prometheus)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / ("exactness-quick" if args.quick else "exactness")
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(to_json(run), indent=2) + "\n", encoding="utf-8")
    try:
        if not plot(run, stem.with_suffix(".png")):
            run.notes.append("matplotlib is not installed: no plot")
    except Exception as exc:  # the figures are measured: keep them whatever the plot does
        run.notes.append(f"the plot failed: {exc!r}")
    text = markdown(run)
    print(text)
    stem.with_suffix(".md").write_text(text, encoding="utf-8")
    json_path.write_text(json.dumps(to_json(run), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {stem.relative_to(ROOT)}.{{md,json,png}}")
    return 0 if all(abs(r.err_mean) <= BOUND for r in run.rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
