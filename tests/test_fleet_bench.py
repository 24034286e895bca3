"""The fleet benchmark (benchmarks/fleet.py, benchmarks/fleet_server.py): each simulated
node's copy of the exporter's text has identities of its own and counters that keep
advancing; and, with a real Prometheus, the whole run works end to end on two nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.bench_scripts import load
from tests.harness import Labels, parse_exposition, simulated_exporter
from tests.system_tools import VICTORIA_METRICS_HINT, require_tool

ROOT = Path(__file__).resolve().parent.parent
server = load("fleet_server")


@pytest.fixture(scope="module")
def node_8gpu_text() -> str:
    """What the exporter serves on node-8gpu after its first cycle."""
    import asyncio

    async def scrape() -> str:
        async with (
            simulated_exporter("node-8gpu") as h,
            h.session.get(h.url + "/metrics") as response,
        ):
            return await response.text()

    return asyncio.run(scrape())


def label_values(text: str, key: str) -> set[str]:
    scrape = parse_exposition(text)
    return {dict(k)[key] for series in scrape.values.values() for k in series if dict(k).get(key)}


def test_each_node_has_its_own_gpus_and_pods_and_keeps_the_namespaces(node_8gpu_text):
    a = server.distinct(node_8gpu_text, server.node_name(1))
    b = server.distinct(node_8gpu_text, server.node_name(2))
    for key in ("uuid", "mig_uuid", "device_id", "pod"):
        original = label_values(node_8gpu_text, key)
        assert original, f"node-8gpu serves no {key}"
        assert not label_values(a, key) & label_values(b, key), key
        assert not label_values(a, key) & original, key
        assert len(label_values(a, key)) == len(original), key
    assert label_values(a, "namespace") == label_values(node_8gpu_text, "namespace")
    served = parse_exposition(node_8gpu_text).values
    assert {n: len(s) for n, s in parse_exposition(a).values.items()} == {
        n: len(s) for n, s in served.items()
    }


def _values(text: str) -> dict[tuple[str, Labels], float]:
    scrape = parse_exposition(text)
    return {(n, k): v for n, series in scrape.values.items() for k, v in series.items()}


def _types(text: str) -> dict[str, str]:
    """Each sample name's family type."""
    return {s.name: f.type for f in text_string_to_metric_families(text) for s in f.samples}


def test_counters_advance_buckets_stay_cumulative_gauges_stay(node_8gpu_text):
    template = server.template(node_8gpu_text)
    types = _types(node_8gpu_text)
    first = _values(template.render(0.0, template.reference).decode())
    later = _values(template.render(80.0, template.reference + 80.0).decode())
    assert first == _values(node_8gpu_text)  # t=0 is the text as captured
    assert first.keys() == later.keys()
    moving = {"counter", "histogram", "summary"}
    grew = 0
    for (name, labels), before in first.items():
        after = later[(name, labels)]
        if types[name] in moving:
            assert after >= before, name
            grew += after > before
        elif name.endswith("_timestamp_seconds"):
            assert after == pytest.approx(before + 80.0), name
        else:
            assert after == before or (after != after and before != before), name  # NaN
    assert grew >= 10  # every non-zero counter after one cycle (22 on node-8gpu)
    buckets: dict[Labels, list[tuple[float, float]]] = {}
    for (name, labels), value in later.items():
        if name.endswith("_bucket"):
            rest = frozenset(kv for kv in labels if kv[0] != "le")
            buckets.setdefault(rest, []).append((float(dict(labels)["le"]), value))
    assert buckets
    for series in buckets.values():
        counts = [v for _, v in sorted(series)]
        assert counts == sorted(counts)


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    for argv in (["--nodes", "0"], ["--scenarios", "nope"], ["--out", str(tmp_path / "none")]):
        done = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "fleet.py"), *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (argv, done.stderr)
        assert "error:" in done.stderr.splitlines()[-1], done.stderr


@pytest.mark.slow  # a real Prometheus scraping two nodes for 6 s (~20 s in all)
def test_two_nodes_end_to_end_with_a_real_prometheus(tmp_path):
    require_tool("prometheus")
    # The shortest run fleet.py accepts at a 1 s interval is 3 intervals; 6 s: a 2 s
    # warm-up (a third), then 4 s of samples, each rule group evaluated ~4 times. Each
    # dashboard query timed twice (the benchmark's default is 5): it must answer, its
    # latency is not asserted.
    argv = [
        *("--nodes", "2", "--duration", "6", "--interval", "1", "--repeats", "2"),
        *("--scenarios", "single-gpu"),
    ]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fleet.py"), *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "fleet.json").read_text("utf-8"))
    (fleet,) = results["fleets"]
    captured = results["captured"]["single-gpu"]
    assert fleet["nodes"] == 2 and fleet["gpus"] == 2 * captured["gpus"]
    # every node's series made it, each node's own (no two nodes' series merged)
    assert fleet["scraped_series"] == 2 * captured["series"]
    assert fleet["head_series"] >= fleet["scraped_series"] + fleet["recorded_series"]
    assert fleet["recorded_series"] > 0
    assert fleet["rss_bytes"]["max"] > 0 and fleet["rule_iterations_missed"] == 0
    rule_files = [ROOT / f for f in results["settings"]["rule_files"]]
    assert ROOT / "alerts" / "gpu-occupancy-exporter.rules.yaml" in rule_files
    assert len(fleet["rule_groups_ms"]) >= 4
    queries = fleet["queries"]["by_query"]
    assert queries and not [w for w, q in queries.items() if q["error"]]
    assert fleet["server"]["scrapes"] > 0
    assert "2 |" in (tmp_path / "fleet.md").read_text("utf-8")


@pytest.mark.slow  # victoria-metrics, vmagent and vmalert on two nodes for 6 s (~25 s in all)
def test_two_nodes_end_to_end_on_victoriametrics(tmp_path):
    for name in ("victoria-metrics", "vmagent", "vmalert"):
        require_tool(name, VICTORIA_METRICS_HINT)
    argv = [
        *("--nodes", "2", "--duration", "6", "--interval", "1", "--repeats", "2"),
        *("--scenarios", "single-gpu", "--backend", "victoriametrics"),
    ]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fleet.py"), *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "fleet.json").read_text("utf-8"))
    assert results["fleets"] == []  # Prometheus not run
    (fleet,) = results["vm_fleets"]
    captured = results["captured"]["single-gpu"]
    assert fleet["nodes"] == 2 and fleet["gpus"] == 2 * captured["gpus"]
    # vmagent scraped every node's series into victoria-metrics, vmalert recorded
    assert fleet["scraped_series"] == 2 * captured["series"]
    assert fleet["recorded_series"] > 0
    assert fleet["series_count"] >= fleet["scraped_series"] + fleet["recorded_series"]
    for process in ("victoria-metrics", "vmagent", "vmalert"):
        assert fleet["rss_bytes"][process]["max"] > 0, process
        assert fleet["cpu_cores"][process] >= 0, process
    assert sum(fleet["cpu_cores"].values()) > 0  # from /proc: the three did some work
    assert len(fleet["rule_groups_ms"]) >= 4 and fleet["rule_iterations_missed"] == 0
    queries = fleet["queries"]["by_query"]
    assert queries and not [w for w, q in queries.items() if q["error"]]
    assert len(fleet["loadavg_before"]) == 3 and len(fleet["loadavg_after"]) == 3
    assert "On VictoriaMetrics" in (tmp_path / "fleet.md").read_text("utf-8")
    assert results["vm_failed"] == []


def test_a_size_victoriametrics_could_not_carry_is_reported_not_lost():
    fleet = load("fleet")
    results = {
        "settings": {"victoriametrics": "1.79.5"},
        "vm_fleets": [],
        "vm_failed": [{"nodes": 500, "error": "timed out", "load": [7.5, 6.0, 4.25]}],
    }
    lines = fleet.vm_lines(results)
    assert (
        "Not measured on VictoriaMetrics at 500 nodes: timed out (load average 7.5 / 6.0 / 4.2)."
        in lines
    )
    assert fleet.vm_lines({"settings": {}, "vm_fleets": [], "vm_failed": []}) == []


def test_usage_is_read_from_proc_of_the_binary_not_of_its_timeout_wrapper(tmp_path):
    """RSS and CPU come from /proc/<pid>/stat of the binary itself (a saturated process
    may not answer its own /metrics), found under the coreutils timeout that runs it."""
    fleet = load("fleet")
    from tests.e2e.stack import Child

    child = Child("sleeper", ["sleep", "30"], tmp_path / "sleep.log")
    try:
        pid = fleet.binary_pid(child)
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "sleep"
    finally:
        child.stop()
    rss, cpu = fleet.proc_usage(os.getpid())
    sum(i * i for i in range(2_000_000))  # ~0.1 s of CPU here
    later = fleet.proc_usage(os.getpid())[1]
    assert rss > 10 * 2**20 and later > cpu, (rss, cpu, later)
