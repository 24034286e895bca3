"""Fleet scale: a real Prometheus scraping N simulated nodes with the shipped rules.

1. Capture: each fleet scenario runs the real exporter in-process
   (``tests.harness.simulated_exporter``) on the golden schedule
   (``tests/golden/record.py``: 32 cycles 5 s apart, past every shipped timeline), with
   the default flags (what the chart serves), and once with every family on
   (``tests/cardinality.py``'s ``EVERYTHING``) for the table of what each family costs;
   the last /metrics text of each is kept.
2. Serve: ``benchmarks/fleet_server.py`` serves N copies from one process, one port per
   node, each with its own GPU UUIDs and pod names and counters that advance.
3. Scrape: Debian's ``prometheus`` (as the e2e test, ``tests/e2e/stack.py``) scrapes every
   node under the chart's job name with a ``node`` target label, and evaluates every
   shipped rule file (``alerts/*.yaml``: recording, alerting, chargeback when present).
4. Measure, after a warm-up of three scrape intervals: head series (per node, per GPU),
   Prometheus' RSS (per node, and the slope over the fleet sizes), each rule group's
   evaluation time (``prometheus_rule_group_last_duration_seconds``, sampled every
   interval), and the latency of each query of the waste dashboard
   (``dashboards/gpu-waste.json``; the other boards where it does not exist yet) as
   instant queries, median and p99.
5. Write ``benchmarks/results/fleet.json`` and ``fleet.md`` (machine, date, figures, a
   linear extrapolation to 5,000 nodes).

Usage: ``python benchmarks/fleet.py --nodes 100,250,500 [--duration 120] [--interval 15]``
(docs/fleet.md quotes the recorded run). Every child process runs under coreutils'
``timeout`` and is stopped (SIGTERM, then SIGKILL) before the next fleet size starts.
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import logging
import math
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # run from a checkout without installing

import yaml  # noqa: E402
from processes import summarise  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from run import machine  # noqa: E402

from exporter.exposition.families import SELF_PREFIX  # noqa: E402
from exporter.sim.scenario import SHIPPED  # noqa: E402
from tests.cardinality import EVERYTHING  # noqa: E402
from tests.e2e.stack import (  # noqa: E402
    JOB,
    Child,
    PromApi,
    free_port,
    http_get,
    prometheus_config,
    start_prometheus,
    wait_until,
)
from tests.golden.record import CYCLES, STEP_S, on_schedule  # noqa: E402
from tests.harness import simulated_exporter  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
ALERTS = ROOT / "alerts"
DASHBOARDS = ROOT / "dashboards"
WASTE_DASHBOARD = DASHBOARDS / "gpu-waste.json"
EXTRAPOLATE_TO = 5000
START_TIMEOUT_S = 120  # Prometheus ready and every target scraped once, on a busy machine
WARMUP_INTERVALS = 3  # rate windows hold two samples, every rule group has run
# Globs a fleet might turn off (docs/metrics.md, "Choosing families"), measured besides
# the largest single families.
CANDIDATE_GLOBS = ("gpu_clock_event_*", "gpu_nvlink_*", "gpu_process_*", "gpu_container_*")
GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


# -- 1. capture ---------------------------------------------------------------------------


async def capture(scenario: str, argv: Sequence[str] = ()) -> str:
    """The exporter's /metrics text after the golden schedule on ``scenario``."""
    async with simulated_exporter(scenario, argv=argv) as h:
        async for _ in on_schedule(h):
            pass
        async with h.session.get(h.url + "/metrics") as response:
            assert response.status == 200, await response.text()
            return await response.text()


def family_series(text: str) -> dict[str, int]:
    """Series per family as ``--families-disable`` names them (counters without _total)."""
    return {f.name: len(f.samples) for f in text_string_to_metric_families(text)}


def gpus_in(text: str) -> int:
    """Whole GPUs the node serves: distinct ``uuid="GPU-…"`` values."""
    return len(set(re.findall(r'\buuid="(GPU-[^"]+)"', text)))


def families_table(default: dict[str, int], everything: dict[str, int]) -> list[dict[str, Any]]:
    """What ``--families-disable`` of each glob saves per node: the largest families
    served by default, the candidate globs (with every family on too, as the process
    families are off by default), and the exporter's own, which are always served."""
    total = sum(default.values())
    rows = []
    optional = [f for f in default if not f.startswith(SELF_PREFIX)]
    largest = sorted(optional, key=lambda f: (-default[f], f))[:10]
    for glob in [*largest, *CANDIDATE_GLOBS, f"{SELF_PREFIX}*"]:
        on_default = sum(n for f, n in default.items() if fnmatch.fnmatchcase(f, glob))
        on_everything = sum(n for f, n in everything.items() if fnmatch.fnmatchcase(f, glob))
        rows.append(
            {
                "glob": glob,
                "default": on_default,
                "share": on_default / total if total else 0.0,
                "everything": on_everything,
            }
        )
    return rows


# -- 2./3. serve and scrape ---------------------------------------------------------------


def rule_files() -> list[Path]:
    """Every shipped rule file: alerts/*.yaml with a top-level ``groups`` list."""
    files = []
    for path in sorted(ALERTS.glob("*.yaml")):
        data = yaml.safe_load(path.read_text("utf-8"))
        if isinstance(data, dict) and isinstance(data.get("groups"), list):
            files.append(path)
    return files


def fleet_config(ports: dict[str, int], rules: Sequence[Path], interval_s: int) -> dict[str, Any]:
    """The e2e test's config (job, a ``node`` label per target) at the fleet's interval."""
    config = prometheus_config(ports, rules)
    config["global"] = {
        "scrape_interval": f"{interval_s}s",
        "evaluation_interval": f"{interval_s}s",
    }
    job = config["scrape_configs"][0]
    job["scrape_interval"] = f"{interval_s}s"
    job["scrape_timeout"] = f"{min(interval_s, 10)}s"
    return config


def start_server(
    texts: Sequence[Path], nodes: int, ports_file: Path, log: Path, lifetime_s: float
) -> Child:
    argv = [sys.executable, str(HERE / "fleet_server.py"), "--nodes", str(nodes)]
    argv += ["--ports-file", str(ports_file)]
    for text in texts:
        argv += ["--text", str(text)]
    return Child("fleet server", argv, log, lifetime_s=lifetime_s)


# -- 4. measure ---------------------------------------------------------------------------


def dashboard_queries() -> tuple[str, list[tuple[str, str]]]:
    """(board, [(where, expr)]) of the waste dashboard, or of every board before it exists."""
    boards = [WASTE_DASHBOARD] if WASTE_DASHBOARD.exists() else sorted(DASHBOARDS.glob("*.json"))
    found = []
    for path in boards:
        board = json.loads(path.read_text("utf-8"))
        for panel in [p for top in board["panels"] for p in (top, *top.get("panels", []))]:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append(
                        (f"{path.stem}: {panel['title']} {target['refId']}", target["expr"])
                    )
    return ", ".join(p.name for p in boards), found


def substitute(expr: str, interval_s: int, range_s: int) -> str:
    """Grafana's variables: every filter `.*` (the whole fleet), $__rate_interval as
    Grafana computes it for this scrape interval (4 x), $__range the run."""
    values = {
        "__rate_interval": f"{4 * interval_s}s",
        "__interval": f"{interval_s}s",
        "__range": f"{range_s}s",
    }
    return GRAFANA_VARIABLE.sub(lambda m: values.get(m.group(1) or m.group(2), ".*"), expr)


def prometheus_metrics(api: PromApi) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus' own /metrics, by sample name."""
    status, body = http_get(f"{api.base}/metrics")
    assert status == 200, f"Prometheus /metrics answered {status}"
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def one(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


def scalar(api: PromApi, expr: str) -> float:
    result = api.series(expr)
    return float(result[0]["value"][1]) if result else math.nan


def time_queries(api: PromApi, queries: Sequence[tuple[str, str]], repeats: int) -> dict[str, Any]:
    """Each query ``repeats`` times as an instant query: wall time of the HTTP call."""
    each: dict[str, Any] = {}
    every: list[float] = []
    for where, expr in queries:
        times, series, error = [], 0, ""
        for _ in range(repeats):
            began = time.perf_counter()
            data = api.query(expr)
            times.append((time.perf_counter() - began) * 1000)
            if data.get("status") != "success":
                error = str(data.get("error", "?"))
            else:
                series = len(data["data"]["result"])
        every += times
        each[where] = {"expr": expr, "ms": summarise(times), "series": series, "error": error}
    return {"by_query": each, "ms": summarise(every) if every else {}}


def sample_window(api: PromApi, seconds: float, every_s: float) -> dict[str, Any]:
    """Prometheus' RSS, heap and each rule group's last duration, every ``every_s``."""
    rss: list[float] = []
    heap: list[float] = []
    groups: dict[str, list[float]] = {}
    deadline = time.monotonic() + seconds
    while True:
        m = prometheus_metrics(api)
        rss.append(one(m, "process_resident_memory_bytes"))
        heap.append(one(m, "go_memstats_heap_inuse_bytes"))
        for labels, value in m.get("prometheus_rule_group_last_duration_seconds", []):
            groups.setdefault(labels["rule_group"].rpartition(";")[2], []).append(value * 1000)
        if time.monotonic() + every_s > deadline:
            break
        time.sleep(every_s)
    final = prometheus_metrics(api)
    missed = one(final, "prometheus_rule_group_iterations_missed_total")
    return {
        "rss_bytes": summarise(rss),
        "heap_inuse_bytes": summarise(heap),
        "rule_groups_ms": {g: summarise(v) for g, v in sorted(groups.items())},
        "rule_iterations_missed": missed,
        "head_series": one(final, "prometheus_tsdb_head_series"),
    }


def measure_fleet(
    binary: str,
    texts: Sequence[Path],
    gpus_per_text: Sequence[int],
    nodes: int,
    args: argparse.Namespace,
    work: Path,
) -> dict[str, Any]:
    lifetime = START_TIMEOUT_S + args.duration + 300
    ports_file = work / "ports.json"
    server = start_server(texts, nodes, ports_file, work / "server.log", lifetime)
    children = [server]
    try:

        def listening() -> dict[str, int] | None:
            server.check_alive()
            return json.loads(ports_file.read_text()) if ports_file.exists() else None

        ports = wait_until(
            listening,
            timeout_s=START_TIMEOUT_S,
            what=f"the fleet server to listen for {nodes} nodes",
            diagnostics=server.log_tail,
        )
        config = work / "prometheus.yml"
        config.write_text(yaml.safe_dump(fleet_config(ports, rule_files(), args.interval)), "utf-8")
        port = free_port()
        prometheus = start_prometheus(
            binary, config, work / "tsdb", port, work / "prom.log", lifetime
        )
        children.append(prometheus)
        api = PromApi(port)

        def ready() -> bool:
            prometheus.check_alive()
            return api.ready()

        wait_until(
            ready,
            timeout_s=START_TIMEOUT_S,
            what="Prometheus' /-/ready",
            diagnostics=prometheus.log_tail,
        )
        up = f'count(up{{job="{JOB}"}} == 1)'
        wait_until(
            lambda: scalar(api, up) == nodes,
            timeout_s=START_TIMEOUT_S,
            what=f"all {nodes} targets up",
            interval_s=1.0,
            diagnostics=prometheus.log_tail,
        )
        began = time.time()
        warmup = min(WARMUP_INTERVALS * args.interval, args.duration / 3)
        print(
            f"[fleet] {nodes} nodes up; warm-up {warmup:.0f} s, then {args.duration - warmup:.0f} s"
        )
        time.sleep(warmup)
        window = sample_window(api, args.duration - warmup, args.interval)
        board, queries = dashboard_queries()
        range_s = math.ceil(time.time() - began)
        substituted = [(w, substitute(e, args.interval, range_s)) for w, e in queries]
        latency = time_queries(api, substituted, args.repeats)
        gpus = sum(gpus_per_text[i % len(texts)] for i in range(nodes))
        scraped = scalar(api, f'sum(scrape_samples_post_metric_relabeling{{job="{JOB}"}})')
        recorded = scalar(api, 'count({__name__=~".+:.+"})')
        scrape_ms = [
            float(s["value"][1]) * 1000
            for s in api.series(f'scrape_duration_seconds{{job="{JOB}"}}')
        ]
        status, body = http_get(f"http://127.0.0.1:{next(iter(ports.values()))}/stats")
        head = window["head_series"]
        return {
            "nodes": nodes,
            "gpus": gpus,
            "head_series": head,
            "series_per_node": head / nodes,
            "series_per_gpu": head / gpus if gpus else math.nan,
            "scraped_series": scraped,
            "recorded_series": recorded,
            "rss_per_node_bytes": window["rss_bytes"]["max"] / nodes,
            **window,
            "scrape_ms": summarise(scrape_ms),
            "queries_board": board,
            "queries": latency,
            "server": json.loads(body) if status == 200 else {},
            "measured_s": time.time() - began,
        }
    finally:
        for child in reversed(children):
            child.stop()


# -- 5. report ----------------------------------------------------------------------------


def fit(points: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Least-squares line y = intercept + slope x (one point: through the origin)."""
    if len(points) == 1:
        x, y = points[0]
        return {"slope": y / x, "intercept": 0.0}
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return {"slope": slope, "intercept": my - slope * mx}


def extrapolate(fleets: Sequence[dict[str, Any]]) -> dict[str, Any]:
    series = fit([(f["nodes"], f["head_series"]) for f in fleets])
    rss = fit([(f["nodes"], f["rss_bytes"]["max"]) for f in fleets])
    return {
        "nodes": EXTRAPOLATE_TO,
        "series_fit": series,
        "rss_fit": rss,
        "head_series": series["intercept"] + series["slope"] * EXTRAPOLATE_TO,
        "rss_bytes": rss["intercept"] + rss["slope"] * EXTRAPOLATE_TO,
    }


def _mib(value: float) -> str:
    return f"{value / 2**20:,.0f} MiB"


def _ms(summary: dict[str, float], key: str) -> str:
    return f"{summary[key]:.1f}" if summary else "—"


def markdown(results: dict[str, Any]) -> str:
    m, s = results["machine"], results["settings"]
    lines = [
        "# Fleet benchmark",
        "",
        f"Run {results['started']} in {results['duration_s']:.0f} s; regenerate with "
        f"`{results['command']}` (docs/fleet.md).",
        "",
        "| machine | |",
        "|---|---|",
        f"| CPU | {m['cpu']} |",
        f"| cores | {m['cores']} ({m['usable_cores']} usable) |",
        f"| memory | {m['memory_gib']} GiB |",
        f"| Python | {m['python']} |",
        f"| Prometheus | {s['prometheus']} |",
        f"| exporter | {m['exporter']} ({m['commit']}) |",
        "",
        f"Each node serves `{'`, `'.join(s['scenarios'])}` as captured (default flags), "
        f"scraped every {s['interval_s']} s for {s['duration_s']} s per fleet size; rule "
        f"files: {', '.join(f'`{r}`' for r in s['rule_files'])}; queries: "
        f"{results['fleets'][0]['queries_board'] if results['fleets'] else '—'} "
        f"({s['repeats']} instant queries each).",
        "",
        "| nodes | GPUs | head series | per node | per GPU | Prometheus RSS (max) | RSS per node "
        "| slowest rule group p50 / max (ms) | query p50 / p99 (ms) | scrape p50 / max (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for f in results["fleets"]:
        groups = f["rule_groups_ms"]
        slowest = max(groups, key=lambda g: groups[g]["max"]) if groups else None
        rule = f"{groups[slowest]['p50']:.1f} / {groups[slowest]['max']:.1f}" if slowest else "—"
        q = f["queries"]["ms"]
        lines.append(
            f"| {f['nodes']} | {f['gpus']} | {f['head_series']:,.0f} | {f['series_per_node']:,.0f} "
            f"| {f['series_per_gpu']:,.0f} | {_mib(f['rss_bytes']['max'])} "
            f"| {f['rss_per_node_bytes'] / 2**10:,.0f} KiB | {rule} "
            f"| {_ms(q, 'p50')} / {_ms(q, 'p99')} | {_ms(f['scrape_ms'], 'p50')} / "
            f"{_ms(f['scrape_ms'], 'max')} |"
        )
    if results["fleets"]:
        lines += ["", "Rule groups, evaluation time p50 / max (ms):", ""]
        names = sorted({g for f in results["fleets"] for g in f["rule_groups_ms"]})
        lines += [
            "| group | " + " | ".join(f"{f['nodes']} nodes" for f in results["fleets"]) + " |"
        ]
        lines += ["|---|" + "---|" * len(results["fleets"])]
        for g in names:
            cells = [
                f"{f['rule_groups_ms'][g]['p50']:.1f} / {f['rule_groups_ms'][g]['max']:.1f}"
                if g in f["rule_groups_ms"]
                else "—"
                for f in results["fleets"]
            ]
            lines.append(f"| `{g}` | " + " | ".join(cells) + " |")
        largest = results["fleets"][-1]
        lines += ["", f"Queries at {largest['nodes']} nodes, p50 / p99 (ms), series returned:", ""]
        lines += ["| query | p50 / p99 | series | error |", "|---|---|---:|---|"]
        for where, q in largest["queries"]["by_query"].items():
            lines.append(
                f"| {where} | {q['ms']['p50']:.1f} / {q['ms']['p99']:.1f} | {q['series']} "
                f"| {q['error'] or '—'} |"
            )
        e = results["extrapolation"]
        lines += [
            "",
            f"Linear fit over the fleet sizes, at {e['nodes']:,} nodes: "
            f"{e['head_series']:,.0f} head series ({e['series_fit']['slope']:,.0f} per node), "
            f"Prometheus RSS {e['rss_bytes'] / 2**30:,.1f} GiB "
            f"({e['rss_fit']['slope'] / 2**10:,.0f} KiB per node + "
            f"{_mib(e['rss_fit']['intercept'])}).",
        ]
    lines += ["", "What `--families-disable` of each saves, series per node:", ""]
    for scenario, table in results["families"].items():
        total = results["captured"][scenario]["series"]
        lines += [
            f"`{scenario}` ({total:,} series with the default flags):",
            "",
            "| glob | default flags | share | every family on |",
            "|---|---:|---:|---:|",
        ]
        for row in table:
            always = " (always served)" if row["glob"].startswith(SELF_PREFIX) else ""
            lines.append(
                f"| `{row['glob']}`{always} | {row['default']} | {100 * row['share']:.1f} % "
                f"| {row['everything']} |"
            )
        lines.append("")
    return "\n".join(lines)


def parse_nodes(text: str) -> list[int]:
    try:
        nodes = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        nodes = []
    if not nodes or min(nodes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give node counts like 100,250,500")
    return sorted(set(nodes))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--nodes",
        type=parse_nodes,
        default=[100, 250, 500],
        help="comma-separated fleet sizes, each scraped by a fresh Prometheus "
        "(default: 100,250,500)",
    )
    p.add_argument(
        "--duration",
        type=int,
        default=120,
        help="seconds Prometheus scrapes each fleet size once every target is up; the first "
        f"{WARMUP_INTERVALS} intervals (at most a third) are warm-up (default: %(default)s)",
    )
    p.add_argument(
        "--interval",
        type=int,
        default=15,
        help="scrape and rule-evaluation interval in seconds (default: %(default)s)",
    )
    p.add_argument(
        "--scenarios",
        default="node-8gpu",
        help="comma-separated shipped scenarios the nodes serve in turn (default: %(default)s, "
        "an 8-GPU node with MIG, time-slicing and MPS)",
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="times each dashboard query is timed (default: 5)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR,
        help="where fleet.json and fleet.md go (default: benchmarks/results)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in scenarios if s not in SHIPPED]
    if not scenarios or unknown:
        p.error(f"--scenarios {args.scenarios}: use shipped ones ({', '.join(SHIPPED)})")
    if args.interval < 1 or args.duration < 3 * args.interval or args.repeats < 1:
        p.error("--interval at least 1, --duration at least 3 intervals, --repeats at least 1")
    if not args.out.is_dir():
        p.error(f"--out {args.out}: not a directory; create it or name another")
    binary = shutil.which("prometheus")
    if binary is None:
        print(
            "prometheus not found on PATH; install it: apt-get install -y prometheus",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started, now = time.monotonic(), datetime.now(UTC)
    version = _prometheus_version(binary)
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        work = Path(tmp)
        captured: dict[str, Any] = {}
        families: dict[str, Any] = {}
        texts = []
        for scenario in scenarios:
            print(f"[fleet] capturing {scenario}", flush=True)
            default = asyncio.run(capture(scenario))
            everything = asyncio.run(capture(scenario, EVERYTHING))
            path = work / f"{scenario}.txt"
            path.write_text(default, "utf-8")
            texts.append(path)
            counts = family_series(default)
            captured[scenario] = {
                "series": sum(counts.values()),
                "gpus": gpus_in(default),
                "bytes": len(default.encode()),
                "families": counts,
                "max_labels": _max_labels(everything),
            }
            families[scenario] = families_table(counts, family_series(everything))
        fleets = []
        for nodes in args.nodes:
            fleet_dir = work / f"n{nodes}"
            fleet_dir.mkdir()
            print(f"[fleet] {nodes} nodes", flush=True)
            gpus = [captured[s]["gpus"] for s in scenarios]
            fleets.append(measure_fleet(binary, texts, gpus, nodes, args, fleet_dir))
            shutil.rmtree(fleet_dir / "tsdb", ignore_errors=True)
    results: dict[str, Any] = {
        "started": now.isoformat(timespec="seconds"),
        "command": "python benchmarks/fleet.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "settings": {
            "nodes": args.nodes,
            "interval_s": args.interval,
            "duration_s": args.duration,
            "repeats": args.repeats,
            "scenarios": scenarios,
            "prometheus": version,
            "rule_files": [str(p.relative_to(ROOT)) for p in rule_files()],
            "capture": f"golden schedule: {CYCLES} cycles {STEP_S:g} s apart",
        },
        "captured": captured,
        "families": families,
        "fleets": fleets,
        "extrapolation": extrapolate(fleets) if fleets else {},
    }
    results["duration_s"] = time.monotonic() - started
    (args.out / "fleet.json").write_text(json.dumps(results, indent=2) + "\n", "utf-8")
    (args.out / "fleet.md").write_text(markdown(results) + "\n", "utf-8")
    print(markdown(results))
    print(f"[fleet] wrote {args.out / 'fleet.json'} and {args.out / 'fleet.md'}")
    return 0


def _max_labels(text: str) -> dict[str, Any]:
    most, family = 0, ""
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if len(s.labels) > most:
                most, family = len(s.labels), f.name
    return {"labels": most, "family": family}


def _prometheus_version(binary: str) -> str:
    import subprocess

    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    first = (out.stdout or out.stderr).splitlines()
    return first[0].removeprefix("prometheus, ") if first else "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
