"""The metric contract on real output (docs/metrics.md, "The metric contract" and "Sums
that are safe"): every shipped scenario is served through its whole timeline with every
family on (tests/cardinality.py's ``EVERYTHING``, on the golden schedule), and after every
cycle

- no label is served with an empty value;
- every label a family serves is documented in that family's row of docs/metrics.md;
- memory by owner (``gpu_container_memory_used_bytes`` + ``gpu_unattributed_memory_used_bytes``)
  is at most the GPU's ``gpu_memory_used_bytes``, and no more than its processes hold;
- ``gpu_orphaned_memory_bytes`` is a view across it, never a further owner: ``dead_process``
  is exactly ``owner="dead"``, ``stuck_process`` + ``deleted_pod`` lie within memory by
  owner, and ``unattributed`` within what no listed process accounts for.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.sim.scenario import SHIPPED
from tests.cardinality import EVERYTHING
from tests.golden.record import on_schedule
from tests.harness import simulated_exporter
from tests.test_metrics_doc import DOC, family_name

MIG_LABELS = ("gpu_instance", "compute_instance", "mig_profile", "mig_uuid")
# A row: name, type, labels (the third column).
ROW = re.compile(r"^\| `(gpu_[a-z0-9_]+)` \| (gauge|counter|histogram) \| ([^|]+) \|", re.MULTILINE)
AS_ANOTHER = re.compile(r"as `(gpu_[a-z0-9_]+)` without (\w+)(?:, \+ (\w+))?$")
# Labels the exposition format adds to a family's samples (a histogram's buckets).
FORMAT_LABELS = frozenset({"le"})

Series = tuple[str, dict[str, str], float]  # family, labels, value


def documented_labels() -> dict[str, frozenset[str]]:
    """Family (as served, counters without _total) -> the labels its row names."""
    rows = {name: (kind, cell.strip()) for name, kind, cell in ROW.findall(DOC.read_text())}
    resolved: dict[str, frozenset[str]] = {}

    def labels_of(name: str) -> frozenset[str]:
        _, cell = rows[name]
        another = AS_ANOTHER.fullmatch(cell)
        if another:
            base, without, plus = another.groups()
            return (labels_of(base) - {without}) | ({plus} if plus else set())
        names: set[str] = set()
        if "[+ MIG labels]" in cell:
            names |= set(MIG_LABELS)
            cell = cell.replace("[+ MIG labels]", "")
        for part in cell.replace("[+", ",").replace("]", "").split(","):
            part = part.strip()
            if part and part != "\N{EM DASH}":
                names.add(part)
        return frozenset(names)

    for name, (kind, _) in rows.items():
        resolved[family_name(name, kind)] = labels_of(name)
    return resolved


def test_the_label_column_is_read_as_written() -> None:
    labels = documented_labels()
    assert labels["gpu_info"] >= {"gpu", "uuid", "model", "driver_version"}
    assert labels["gpu_memory_used_bytes"] == {"gpu", "uuid", *MIG_LABELS}
    assert labels["gpu_container_allocated_idle"] == labels["gpu_container_allocated"] - {
        "resource"
    }
    assert "cause" in labels["gpu_container_idle_gpu_seconds"]
    assert "state" not in labels["gpu_container_idle_gpu_seconds"]
    assert labels["gpu_xid_errors"] >= {"xid", "class", "gpu_instance", "compute_instance"}
    assert labels["gpu_exporter_last_sample_timestamp_seconds"] == set()


def test_the_sum_rule_catches_a_byte_counted_twice() -> None:
    gpu = {"gpu": "0", "uuid": "GPU-a"}
    gib = float(2**30)
    good: list[Series] = [
        ("gpu_info", gpu, 1.0),
        ("gpu_memory_used_bytes", gpu, 10 * gib),
        ("gpu_container_memory_used_bytes", {**gpu, "pod": "p"}, 4 * gib),
        ("gpu_unattributed_memory_used_bytes", {**gpu, "owner": "dead"}, 3 * gib),
        ("gpu_orphaned_memory_bytes", {**gpu, "kind": "dead_process"}, 3 * gib),
        ("gpu_orphaned_memory_bytes", {**gpu, "kind": "unattributed"}, 3 * gib),
    ]
    assert sum_violations(good, 1) == []
    # A dead process's memory served as a further owner: over what the GPU uses.
    twice = [*good, ("gpu_unattributed_memory_used_bytes", {**gpu, "owner": "host"}, 4 * gib)]
    assert any("memory by owner" in v for v in sum_violations(twice, 1))
    # The orphaned view disagreeing with the owner it is a view of.
    apart = [s for s in good if s[1].get("kind") != "dead_process"]
    apart.append(("gpu_orphaned_memory_bytes", {**gpu, "kind": "dead_process"}, 2 * gib))
    assert any("dead_process" in v for v in sum_violations(apart, 1))


@dataclass
class Findings:
    """What one scenario served over its timeline that breaks the contract."""

    labels: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    empty: set[tuple[str, str]] = field(default_factory=set)
    sums: list[str] = field(default_factory=list)


# (the family's "# TYPE" line, a sample line up to its value) -> (family, labels): a
# scrape repeats most of the last one's series, and parsing them anew was most of the time
_SERIES: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}


def _value(text: str) -> float:
    """A sample's value as prometheus_client's parser reads it."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse(text: str) -> list[Series]:
    """Every sample of a scrape, as ``text_string_to_metric_families`` reads it: a line's
    family and labels are parsed the first time the line's series is met (with its
    family's TYPE line, which decides the family), its value every time."""
    series: list[Series] = []
    type_line = ""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            if line.startswith("# TYPE "):
                type_line = line
            continue
        head, _, value_text = line.rpartition(" ")
        value = _value(value_text)
        known = _SERIES.get((type_line, head))
        if known is None:
            (family,) = text_string_to_metric_families(f"{type_line}\n{line}\n")
            (sample,) = family.samples
            # no timestamp: the text after the last space is the value
            assert sample.timestamp is None, line
            assert sample.value == value or (math.isnan(sample.value) and math.isnan(value)), line
            known = _SERIES[type_line, head] = (family.name, dict(sample.labels))
        series.append((known[0], dict(known[1]), value))
    return series


def total(series: Iterable[Series], family: str, uuid: str, **labels: str) -> float | None:
    """The sum of a family's values on one physical GPU (None: no such series)."""
    values = [
        value
        for name, have, value in series
        if name == family
        and have.get("uuid") == uuid
        and all(have.get(k, "") == v for k, v in labels.items())
    ]
    return sum(values) if values else None


def sum_violations(series: list[Series], at: int) -> list[str]:
    """The sum rules of docs/metrics.md, per physical GPU, on one scrape."""
    found: list[str] = []
    uuids = {labels["uuid"] for name, labels, _ in series if name == "gpu_info"}
    for uuid in sorted(uuids):
        used = total(series, "gpu_memory_used_bytes", uuid, gpu_instance="")
        containers = total(series, "gpu_container_memory_used_bytes", uuid) or 0.0
        others = total(series, "gpu_unattributed_memory_used_bytes", uuid) or 0.0
        by_owner = containers + others
        where = f"cycle {at}, GPU {uuid}"
        if used is not None and by_owner > used:
            found.append(f"{where}: memory by owner {by_owner:.0f} > used {used:.0f}")
        processes = total(series, "gpu_process_memory_used_bytes", uuid)
        if processes is not None and by_owner > processes:
            found.append(f"{where}: memory by owner {by_owner:.0f} > its processes' {processes}")
        dead = total(series, "gpu_unattributed_memory_used_bytes", uuid, owner="dead")
        orphaned_dead = total(series, "gpu_orphaned_memory_bytes", uuid, kind="dead_process")
        if orphaned_dead is not None and orphaned_dead != dead:
            found.append(f"{where}: orphaned dead_process {orphaned_dead} != owner=dead {dead}")
        held = sum(
            total(series, "gpu_orphaned_memory_bytes", uuid, kind=kind) or 0.0
            for kind in ("dead_process", "stuck_process", "deleted_pod")
        )
        if held > by_owner:
            found.append(f"{where}: orphaned memory of processes {held} > memory by owner")
        rest = total(series, "gpu_orphaned_memory_bytes", uuid, kind="unattributed")
        if rest is not None and (used is None or rest > used - by_owner):
            found.append(f"{where}: orphaned unattributed {rest} > used - memory by owner")
    return found


async def served_over_the_timeline(scenario: str) -> Findings:
    findings = Findings()
    async with simulated_exporter(scenario, argv=EVERYTHING) as h:
        at = 0
        async for _ in on_schedule(h):
            at += 1
            async with h.session.get(h.url + "/metrics") as response:
                assert response.status == 200, await response.text()
                series = parse(await response.text())
            for family, labels, _ in series:
                findings.labels[family].update(labels)
                findings.empty.update((family, k) for k, v in labels.items() if v == "")
            findings.sums.extend(sum_violations(series, at))
    return findings


@pytest.mark.slow  # each shipped scenario through its timeline (about 2 s each)
@pytest.mark.parametrize("scenario", SHIPPED)
async def test_served_output_keeps_the_metric_contract(scenario: str) -> None:
    findings = await served_over_the_timeline(scenario)
    assert findings.labels, f"{scenario}: nothing was served"
    assert sorted(findings.empty) == [], f"{scenario}: labels served with an empty value"
    doc = documented_labels()
    undocumented = {
        family: sorted(labels - FORMAT_LABELS - doc.get(family, frozenset()))
        for family, labels in findings.labels.items()
        if labels - FORMAT_LABELS - doc.get(family, frozenset()) or family not in doc
    }
    assert undocumented == {}, f"{scenario}: served but not in docs/metrics.md's label column"
    assert findings.sums == [], f"{scenario}: " + "\n".join(findings.sums[:20])
