"""The served exposition over real HTTP: values equal the scenario's, failures show as
``*_up 0`` and missing series (never zeros), and scrapes are served from a per-cycle cache."""

from __future__ import annotations

import asyncio
import gzip
import platform
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from multidict import CIMultiDictProxy
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.registry import Collector, CollectorRegistry

from exporter import __version__
from exporter.exposition.server import MetricsCache
from exporter.sim.events import SimEvent
from exporter.sim.scenario import load_scenario
from tests.harness import Harness, Scrape, parse_exposition, simulated_exporter

GiB = 1024**3
MiB = 1024**2
TEXT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_1_0_0 = "application/openmetrics-text; version=1.0.0; charset=utf-8"
NO_GZIP = {"Accept-Encoding": "identity"}


@dataclass
class Response:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes  # as sent on the wire (not decompressed)


async def fetch(h: Harness, path: str, headers: dict[str, str] | None = None) -> Response:
    async with h.session.get(h.url + path, headers=headers or {}, auto_decompress=False) as r:
        return Response(r.status, r.headers, await r.read())


async def scrape_text(h: Harness) -> Scrape:
    response = await fetch(h, "/metrics", NO_GZIP)
    assert response.status == 200
    return parse_exposition(response.body.decode())


def gpu_series(scrape: Scrape, gpu: str) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    """Every (sample name, labels) that belongs to one GPU."""
    return {
        (name, labels)
        for name, samples in scrape.values.items()
        for labels in samples
        if ("gpu", gpu) in labels
    }


# -- values ------------------------------------------------------------------------------


async def test_node_8gpu_serves_the_scenarios_identity_memory_util_and_power() -> None:
    scenario = load_scenario("node-8gpu")
    async with simulated_exporter("node-8gpu", kube_api=False) as h:
        s = await scrape_text(h)
    assert s.types["gpu_info"] == "gauge"
    infos = s.find("gpu_info")
    assert len(infos) == 8
    for labels, value in infos:
        gpu = scenario.gpus[int(labels["gpu"])]
        assert value == 1
        assert labels == {
            "gpu": str(gpu.index),
            "uuid": gpu.uuid,
            "model": "NVIDIA H100 80GB HBM3",
            "pci_bus_id": gpu.pci_bus_id,
            "minor_number": str(gpu.index),
            "driver_version": "580.65.06",
            "cuda_driver_version": "13.0",
        }
    assert scenario.gpus[0].pci_bus_id == "00000000:18:00.0"

    used_gpu0 = 62 * GiB + 9 * 600 * MiB  # the trainer plus nine data workers
    assert s.get("gpu_memory_total_bytes", gpu="0") == 80 * GiB
    assert s.get("gpu_memory_reserved_bytes", gpu="0") == 512 * MiB
    assert s.get("gpu_memory_used_bytes", gpu="0") == used_gpu0
    assert s.get("gpu_memory_free_bytes", gpu="0") == 80 * GiB - 512 * MiB - used_gpu0

    utilization = {labels["gpu"]: v for labels, v in s.find("gpu_utilization_ratio")}
    assert utilization == {  # GPU 3 is in MIG mode: no GPU-Util series at all
        str(g.index): g.utilization_gpu / 100
        for g in scenario.gpus
        if g.utilization_gpu is not None
    }
    assert "3" not in utilization and utilization["0"] == 0.98 and utilization["4"] == 1.0
    assert s.get("gpu_memory_utilization_ratio", gpu="0") == 0.63
    power = {labels["gpu"]: v for labels, v in s.find("gpu_power_watts")}
    assert power == {str(g.index): g.power_mw / 1000 for g in scenario.gpus}
    assert power["0"] == 612
    assert s.get("gpu_power_limit_watts", gpu="0") == 700
    temperature = {labels["gpu"]: v for labels, v in s.find("gpu_temperature_celsius")}
    assert temperature == {str(g.index): g.temperature for g in scenario.gpus}
    # GPU 1 is thermally throttled in the scenario (reason bit 0x20)
    assert s.get("gpu_clock_event_active", gpu="1", reason="sw_thermal_slowdown") == (
        1 if scenario.gpus[1].clock_event_reasons & 0x20 else 0
    )
    assert s.get("gpu_clock_event_active", gpu="0", reason="sw_thermal_slowdown") == 0
    assert s.get("gpu_sm_clock_hertz", gpu="0") == 1980e6
    assert s.get("gpu_energy_joules_total", gpu="0") == 1000  # 1e6 mJ at t=0
    assert s.get("gpu_processes", gpu="5", kind="mps") == 20  # 10 embedder pods x 2
    assert s.get("gpu_processes", gpu="5", kind="compute") == 1  # the MPS control daemon
    assert s.get("gpu_processes", gpu="5", kind="graphics") == 0
    assert s.get("gpu_processes", gpu="0", kind="compute") == 10


async def test_mig_series_carry_instance_and_profile_labels() -> None:
    scenario = load_scenario("node-8gpu")
    migs = scenario.gpus[3].mig
    async with simulated_exporter("node-8gpu", kube_api=False) as h:
        s = await scrape_text(h)
    assert s.get("gpu_mig_mode_enabled", gpu="3") == 1
    assert s.get("gpu_mig_mode_enabled", gpu="0") == 0
    info = {labels["mig_uuid"]: labels for labels, _ in s.find("gpu_mig_info", gpu="3")}
    assert info == {
        m.uuid: {
            "gpu": "3",
            "uuid": scenario.gpus[3].uuid,
            "gpu_instance": str(m.gpu_instance_id),
            "compute_instance": str(m.compute_instance_id),
            "mig_profile": m.profile,
            "mig_uuid": m.uuid,
        }
        for m in migs
    }
    assert s.get("gpu_memory_total_bytes", gpu="3", gpu_instance="1") == 40 * GiB
    assert s.get("gpu_memory_total_bytes", gpu="3", gpu_instance="5") == 20 * GiB
    assert s.get("gpu_memory_total_bytes", gpu="3", mig_profile="1g.10gb") == 10 * GiB
    assert s.get("gpu_memory_used_bytes", gpu="3", gpu_instance="13") == 6 * GiB + 300 * MiB
    assert (
        s.get("gpu_processes", gpu="3", gpu_instance="1", compute_instance="0", kind="compute") == 2
    )


async def test_unsupported_queries_produce_no_series_rather_than_zero() -> None:
    scenario: dict[str, object] = {
        "gpus": [
            {"unsupported": ["nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature"]},
            {"power_mw": 250_000, "temperature": 0},
        ]
    }
    async with simulated_exporter(scenario, kube_api=False) as h:
        s = await scrape_text(h)
    assert {labels["gpu"] for labels, _ in s.find("gpu_power_watts")} == {"1"}
    assert {labels["gpu"] for labels, _ in s.find("gpu_temperature_celsius")} == {"1"}
    assert s.get("gpu_temperature_celsius", gpu="1") == 0  # a real zero is still served
    assert s.get("gpu_up", gpu="0") == 1
    assert s.get("gpu_memory_total_bytes", gpu="0") == 80 * GiB
    assert s.get("gpu_exporter_errors_total", source="nvml") == 0


async def test_a_lost_gpu_reads_down_while_the_others_keep_every_series() -> None:
    scenario = load_scenario("node-8gpu")
    # the shipped timeline's own events come before start (kernel log only) or later
    assert all(e.at <= 0 or e.at > 30 for e in scenario.timeline)
    lose = SimEvent(at=30, action="lose", args={"value": 6})
    scenario.timeline = sorted([*scenario.timeline, lose], key=lambda e: e.at)
    uuid6 = scenario.gpus[6].uuid
    async with simulated_exporter(scenario, kube_api=False) as h:
        await h.advance(10)  # a second cycle, so GPM occupancy series exist too
        before = await scrape_text(h)
        await h.advance(20)
        after = await scrape_text(h)
    assert before.get("gpu_up", gpu="6", uuid=uuid6) == 1
    assert after.get("gpu_up", gpu="6", uuid=uuid6) == 0
    # its identity stays on gpu_info; what it can no longer say is absent, not zero
    (info,) = after.find("gpu_info", gpu="6")
    assert info[0]["uuid"] == uuid6 and info[0]["model"] == "NVIDIA H100 80GB HBM3"
    assert after.find("gpu_memory_used_bytes", gpu="6") == []
    assert after.find("gpu_power_watts", gpu="6") == []
    for gpu in ("0", "1", "2", "3", "4", "5", "7"):
        assert after.get("gpu_up", gpu=gpu) == 1
        assert gpu_series(after, gpu) == gpu_series(before, gpu), f"GPU {gpu} lost series"
    assert after.get("gpu_exporter_nvml_up") == 1


async def test_no_driver_serves_nvml_down_and_no_gpu_series() -> None:
    async with simulated_exporter("no-gpu", kube_api=False) as h:
        s = await scrape_text(h)
    assert s.get("gpu_exporter_nvml_up") == 0
    assert s.get("gpu_exporter_source_up", source="nvml") == 0
    assert s.find("gpu_info") == []
    assert s.find("gpu_up") == []
    assert s.get("gpu_exporter_errors_total", source="nvml") == 1


# -- content negotiation and compression --------------------------------------------------


async def test_default_scrape_is_prometheus_text_0_0_4() -> None:
    async with simulated_exporter("single-gpu", kube_api=False) as h:
        r = await fetch(h, "/metrics", NO_GZIP)
    assert r.status == 200
    assert r.headers["Content-Type"] == TEXT_0_0_4
    assert "Content-Encoding" not in r.headers
    text = r.body.decode()
    assert "# EOF" not in text
    assert "# TYPE gpu_info gauge" in text
    assert parse_exposition(text).get("gpu_up", gpu="0") == 1


async def test_openmetrics_accept_header_gets_openmetrics_with_eof() -> None:
    accept = "application/openmetrics-text; version=1.0.0"
    async with simulated_exporter("single-gpu", kube_api=False) as h:
        r = await fetch(h, "/metrics", {"Accept": accept, **NO_GZIP})
        # what Prometheus itself sends: OpenMetrics preferred, text as fallback
        prom = await fetch(
            h,
            "/metrics",
            {
                "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,"
                "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
                **NO_GZIP,
            },
        )
        refused = await fetch(
            h, "/metrics", {"Accept": "application/openmetrics-text;q=0", **NO_GZIP}
        )
    assert r.status == 200
    assert r.headers["Content-Type"] == OPENMETRICS_1_0_0
    text = r.body.decode()
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in parse_openmetrics(text)}  # type: ignore[no-untyped-call]
    assert families["gpu_info"].samples[0].value == 1
    assert prom.headers["Content-Type"] == OPENMETRICS_1_0_0
    assert refused.headers["Content-Type"] == TEXT_0_0_4


async def test_gzip_is_sent_only_when_the_client_accepts_it() -> None:
    async with simulated_exporter("single-gpu", kube_api=False) as h:
        plain = await fetch(h, "/metrics", NO_GZIP)
        for accept_encoding in ("gzip", "gzip, deflate", "br;q=1.0, gzip;q=0.5"):
            zipped = await fetch(h, "/metrics", {"Accept-Encoding": accept_encoding})
            assert zipped.headers["Content-Encoding"] == "gzip", accept_encoding
            assert zipped.headers["Content-Type"] == TEXT_0_0_4
            assert zipped.body[:2] == b"\x1f\x8b"
            assert gzip.decompress(zipped.body) == plain.body
        for refusing in ("gzip;q=0", "deflate", ""):
            r = await fetch(h, "/metrics", {"Accept-Encoding": refusing})
            assert "Content-Encoding" not in r.headers, refusing
            assert r.body == plain.body
    assert plain.body.startswith(b"# HELP")


# -- endpoints ----------------------------------------------------------------------------


async def test_healthy_at_once_but_ready_and_serving_only_after_the_first_cycle() -> None:
    async with simulated_exporter("single-gpu", kube_api=False, first_cycle=False) as h:
        assert (await fetch(h, "/readyz")).status == 503
        assert (await fetch(h, "/metrics")).status == 503
        assert (await fetch(h, "/healthz")).status == 200  # alive, just not ready
        await h.cycle()
        assert (await fetch(h, "/readyz")).status == 200
        assert (await fetch(h, "/metrics")).status == 200


async def test_landing_page_links_to_metrics() -> None:
    async with simulated_exporter("single-gpu", kube_api=False) as h:
        r = await fetch(h, "/")
    assert r.status == 200
    assert r.headers["Content-Type"].startswith("text/html")
    page = r.body.decode()
    assert 'href="/metrics"' in page
    assert "sim-single" in page  # the node name
    assert __version__ in page
    assert "/docs/metrics.md" in page and "/docs/runbooks.md" in page


# -- caching ------------------------------------------------------------------------------


async def test_scrapes_within_a_cycle_get_the_same_bytes_rendered_once() -> None:
    async with simulated_exporter("single-gpu", kube_api=False) as h:
        assert h.agent.cache.cycles == 1
        bodies = [(await fetch(h, "/metrics", NO_GZIP)).body for _ in range(3)]
        zipped = [(await fetch(h, "/metrics")).body for _ in range(2)]
        assert bodies[0] == bodies[1] == bodies[2]
        assert zipped[0] == zipped[1]
        assert h.agent.cache.cycles == 1  # scrapes never render
        await h.advance(10)
        assert h.agent.cache.cycles == 2
        plain = (await fetch(h, "/metrics", NO_GZIP)).body
        zipped_after = (await fetch(h, "/metrics")).body
        after = parse_exposition(plain.decode())
    assert plain != bodies[0]
    assert gzip.decompress(zipped_after) == plain  # the compressed copy is the new cycle's too
    # the new cycle's render is served: it counts one more cycle (energy, which once showed
    # this, is read every --slow-interval now and need not move in 10 s)
    before = parse_exposition(bodies[0].decode())
    cycles = "gpu_exporter_sample_duration_seconds_count"
    assert after.get(cycles) - before.get(cycles) == 1


# -- self-metrics -------------------------------------------------------------------------


async def test_self_metrics_describe_the_exporter_and_its_cycles() -> None:
    async with simulated_exporter("single-gpu", kube_api=False) as h:
        await h.advance(10)
        second = await scrape_text(h)
        await h.advance(10)
        s = await scrape_text(h)
        cycle_started = h.agent.wall_clock()  # the manual clock has not moved since
    assert s.get("gpu_exporter_build_info") == 1
    (build,) = s.find("gpu_exporter_build_info")
    assert build[0] == {"version": __version__, "python_version": platform.python_version()}
    assert s.types["gpu_exporter_sample_duration_seconds"] == "histogram"
    assert s.get("gpu_exporter_sample_duration_seconds_count") == 3
    assert s.get("gpu_exporter_sample_duration_seconds_bucket", le="+Inf") == 3
    assert s.get("gpu_exporter_sample_duration_seconds_sum") > 0
    assert s.types["gpu_exporter_errors"] == "counter"
    errors = {labels["source"]: v for labels, v in s.find("gpu_exporter_errors_total")}
    # one series per registered source (no Kubernetes API, no --kmsg here) and the agent
    assert set(errors) == {"nvml", "dcgm", "procfs", "holders", "xid", "podresources", "agent"}
    assert errors["nvml"] == 0 and errors["agent"] == 0
    reads = {labels["source"] for labels, _ in s.find("gpu_exporter_source_read_seconds")}
    assert reads == set(errors) - {"agent"}
    last = s.get("gpu_exporter_last_sample_timestamp_seconds")
    assert last == cycle_started
    previous = second.get("gpu_exporter_last_sample_timestamp_seconds")
    assert last - previous == pytest.approx(10, abs=1e-3)
    assert s.get("gpu_exporter_nvml_up") == 1


async def test_only_formats_scrapers_ask_for_are_rendered_each_cycle() -> None:
    async with simulated_exporter("single-gpu") as h:
        cache = h.agent.cache
        assert cache.cached("openmetrics") is None  # nobody asked yet: text only
        om = "application/openmetrics-text; version=1.0.0"
        async with h.session.get(h.url + "/metrics", headers={"Accept": om}) as response:
            body = await response.read()  # rendered on demand, once
        assert body.endswith(b"# EOF\n")
        await h.advance(1)
        assert cache.cached("openmetrics") is not None  # now rendered eagerly each cycle
        # Nobody asks for OpenMetrics any more: it stops within about 10 cycles (the demand
        # counts cycles by their real-time period, which varies here; 40 at most).
        for _ in range(40):
            await h.advance(1)
            await h.scrape()  # text
            if cache._rendered.keys() == {"text"}:
                break
        assert cache._rendered.keys() == {"text"}


async def test_a_first_request_for_a_format_renders_off_the_sampling_executor() -> None:
    """The sample cycle's reads run on the default executor; a scrape that has to render
    (OpenMetrics or gzip not yet rendered this cycle) runs on the cache's own worker, so
    neither waits on the other. Here every default worker is held by the test itself,
    and the scrape is still answered."""
    async with simulated_exporter("single-gpu", kube_api=False) as h:
        await h.cycle()
        release = threading.Event()
        loop = asyncio.get_running_loop()
        held = [loop.run_in_executor(None, release.wait, 10.0) for _ in range(64)]
        try:
            accept = {"Accept": "application/openmetrics-text", "Accept-Encoding": "gzip"}
            response = await asyncio.wait_for(fetch(h, "/metrics", accept), timeout=5.0)
        finally:
            release.set()
            await asyncio.gather(*held)
    assert response.status == 200 and response.headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(response.body).endswith(b"# EOF\n")


def test_the_cache_is_never_locked_while_a_request_renders() -> None:
    """cached() runs on the event loop; render_now() renders a format on the request
    worker. A render that takes long (a big node) must not hold the lock cached() waits
    on, or every request on the loop would wait with it."""
    entered, release = threading.Event(), threading.Event()

    class Slow(Collector):
        def collect(self) -> Iterator[Metric]:
            entered.set()
            release.wait(10.0)
            yield GaugeMetricFamily("slow_render", "held until released", value=1)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Slow())
    cache = MetricsCache()
    release.set()
    cache.render(registry)  # the cycle's own render (text)
    release.clear()
    entered.clear()
    worker = threading.Thread(target=cache.render_now, args=("openmetrics",))
    worker.start()
    try:
        assert entered.wait(5.0)
        began = time.monotonic()
        assert cache.cached("openmetrics") is None and cache.cached("text") is not None
        assert time.monotonic() - began < 0.5
    finally:
        release.set()
        worker.join(5.0)
    assert cache.cached("openmetrics") is not None
