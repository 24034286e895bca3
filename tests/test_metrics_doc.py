"""docs/metrics.md and the exporter's real output stay in step."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from exporter.agent import SelfMetrics
from exporter.model.families import CATALOGUE, stability
from tests.harness import simulated_exporter

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(gpu_[a-z0-9_]+)` \| (gauge|counter|histogram) \|", re.MULTILINE)
ROW_LINE = re.compile(r"^\| `(gpu_[a-z0-9_]+)` \| (gauge|counter|histogram) \|.*$", re.MULTILINE)
STABILITY = re.compile(r"Stability: (stable|experimental|deprecated)\b")
SELF_INSTRUMENTS = {
    "gpu_exporter_build_info",
    "gpu_exporter_errors",
    "gpu_exporter_events",  # while Events are on (exporter/agent.py)
    "gpu_exporter_kube_writes",
    "gpu_exporter_kube_writes_shadowed",  # with --kube-writes shadow
    "gpu_exporter_kube_writer_leader",  # with the writer Lease (the default)
    "gpu_exporter_kube_writer_lease_state",
    "gpu_exporter_sample_duration_seconds",
    "gpu_exporter_source_read_seconds",
    "gpu_exporter_start_timestamp_seconds",
}
# Families node-8gpu's H100s cannot show, each with the smallest node that does: data-centre
# GPUs are passively cooled, so NVML has no fan to report (NOT_SUPPORTED: no series).
# The cgroup families (gpu_container_cpu_*, gpu_container_*_pressure_seconds) come from
# node-8gpu's containers (docs/simulator.md, `cgroup:`) and again from one small node.
ELSEWHERE: dict[str, dict[str, object]] = {
    # a GPU allocated under a resource name outside --resource-names
    "gpu_exporter_podresources_other_resource_devices": {
        "gpus": [{}],
        "pods": [
            {"name": "o", "containers": [{"name": "c", "devices": {"example.com/gpu": ["gpu0"]}}]}
        ],
    },
    "gpu_fan_speed_ratio": {"gpus": [{"name": "NVIDIA RTX 6000 Ada Generation", "fans": [38]}]},
    "gpu_container_cpu_* and gpu_container_*_pressure_seconds": {
        "gpus": [{}],
        "pods": [
            {
                "name": "p",
                "containers": [
                    {
                        "name": "c",
                        "devices": {"nvidia.com/gpu": ["gpu0"]},
                        "cgroup": {"throttled": 0.3, "cpu_pressure": 0.2},
                        "processes": [{"gpu": 0, "sm": 10}],
                    }
                ],
            }
        ],
    },
}


def documented() -> dict[str, str]:
    rows = dict(ROW.findall(DOC.read_text(encoding="utf-8")))
    assert rows, "no metric rows found in docs/metrics.md"
    return rows


def family_name(documented_name: str, kind: str) -> str:
    return documented_name.removesuffix("_total") if kind == "counter" else documented_name


async def test_every_emitted_metric_is_documented_and_every_documented_one_is_emitted() -> None:
    """Run node-8gpu through its whole timeline (zombie, XIDs, a kernel-log backlog, a
    lost GPU), every family on, and collect every metric family served along the way."""
    emitted: dict[str, str] = {}
    # the node condition computed but not sent: gpu_exporter_kube_writes_shadowed
    argv = ["--kmsg", "--families-enable", "*"]
    argv += ["--node-condition", "--kube-writes", "shadow=node_condition"]
    async with simulated_exporter("node-8gpu", argv=argv) as h:
        for step in (5, 60, 30, 30, 30, 30):
            # the refresh the agent's task makes: a leak (gpu_unallocated_use_*) is judged
            # on an answer begun after its process was first seen (docs/attribution.md)
            await h.refresh_pod_resources()
            await h.advance(step)
            scrape = await h.scrape()
            emitted.update(scrape.types)
    for scenario in ELSEWHERE.values():
        async with simulated_exporter(scenario, kube_api=False) as h:
            await h.advance(5)
            emitted.update((await h.scrape()).types)
    doc = {family_name(name, kind): kind for name, kind in documented().items()}
    assert sorted(set(emitted) - set(doc)) == [], "emitted but not in docs/metrics.md"
    assert sorted(set(doc) - set(emitted)) == [], "documented but never emitted"
    assert {name: doc[name] for name in emitted} == emitted, "documented type differs"


def test_the_catalogue_and_the_document_list_the_same_metrics() -> None:
    doc = {family_name(name, kind) for name, kind in documented().items()}
    assert doc == set(CATALOGUE) | SELF_INSTRUMENTS


def documented_levels() -> dict[str, list[str]]:
    """Family -> every *Stability:* its row states (one expected)."""
    text = DOC.read_text(encoding="utf-8")
    return {
        family_name(m.group(1), m.group(2)): STABILITY.findall(m.group(0))
        for m in ROW_LINE.finditer(text)
    }


def served_help() -> dict[str, str]:
    """Every family's HELP text: the catalogue's, and the agent's own instruments'."""
    texts = {name: doc for name, (_, doc) in CATALOGUE.items()}
    registry = CollectorRegistry()
    self_metrics = SelfMetrics.register(registry)
    self_metrics.register_shadowed(registry)
    self_metrics.register_lease(registry)
    texts.update((metric.name, metric.documentation) for metric in registry.collect())
    return texts


def test_every_family_has_one_stability_level_in_its_help_and_the_same_in_its_row() -> None:
    helps = served_help()
    assert set(helps) == set(CATALOGUE) | SELF_INSTRUMENTS
    no_prefix = sorted(name for name, text in helps.items() if stability(text) is None)
    assert no_prefix == [], "HELP must start with [STABLE], [EXPERIMENTAL] or [DEPRECATED]"
    rows = documented_levels()
    in_help = {name: [stability(text)] for name, text in helps.items()}
    assert {name: rows.get(name, []) for name in helps} == in_help, (
        "docs/metrics.md's 'Stability:' differs from the HELP text's level"
    )


def test_a_deprecated_family_names_its_replacement() -> None:
    for name, text in served_help().items():
        if stability(text) == "deprecated":
            assert re.search(r"\buse gpu_[a-z_]+", text, re.IGNORECASE), name


CADENCE = re.compile(r"Cadence: (slow tier|on change)\b")


def test_every_row_states_the_cadence_of_its_nvml_reads() -> None:
    """A family read in the slow or on-change tier (exporter/sources/nvml_cadence.py)
    says so in its row, and so how old it can be; no other row claims a tier."""
    from exporter.sources.nvml_cadence import FAMILY_TIERS

    words = {"slow tier": "slow", "on change": "change"}
    found: dict[str, str] = {}
    for line in ROW_LINE.finditer(DOC.read_text(encoding="utf-8")):
        name, kind = line.group(1), line.group(2)
        tier = CADENCE.search(line.group(0))
        if tier is not None:
            found[family_name(name, kind)] = words[tier.group(1)]
    assert found == FAMILY_TIERS
