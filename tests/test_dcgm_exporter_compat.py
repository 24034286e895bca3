"""dcgm-exporter compatibility: alerts/compat/dcgm-exporter.recording.yaml (names up to
4.8) and alerts/compat/dcgm-exporter-4.9.recording.yaml (4.9's), their mapping in
docs/migrating-from-dcgm-exporter.md, and the copy of NVIDIA's dashboard the e2e run reads.

The conversions themselves are proven by promtool (alerts/tests/dcgm-exporter-compat.test.yaml
and dcgm-exporter-4.9-compat.test.yaml, run by tests/test_alert_rules.py), NVIDIA's dashboard
working on them by the e2e run.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from tests.test_alert_rules import COMPAT, load_yaml, referenced_metrics
from tests.test_dashboards import load, queries

ROOT = Path(__file__).resolve().parent.parent
COMPAT_RULES = COMPAT / "dcgm-exporter.recording.yaml"
COMPAT_RULES_4_9 = COMPAT / "dcgm-exporter-4.9.recording.yaml"
DOC = ROOT / "docs" / "migrating-from-dcgm-exporter.md"
DASHBOARD = ROOT / "tests" / "e2e" / "dcgm-exporter-dashboard.json"
DASHBOARD_SOURCE = DASHBOARD.with_suffix(".md")

# The fields dcgm-exporter collects by default: the uncommented lines of
# etc/default-counters.csv (the binary's default -f) and etc/dcp-metrics-included.csv (the
# GPU Operator's DCGM_EXPORTER_COLLECTORS), identical in NVIDIA/dcgm-exporter at 691c927.
DEFAULT_COUNTERS = {
    "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DRIVER_VERSION", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_PCIE_TX_BYTES",
    "DCGM_FI_PROF_PCIE_RX_BYTES",
}  # fmt: skip


def recorded_dcgm_series(path: Path = COMPAT_RULES) -> set[str]:
    rules = [r for g in load_yaml(path)["groups"] for r in g["rules"]]
    return {r["record"] for r in rules if r["record"].startswith("DCGM_")}


def mapping_rows() -> dict[str, str]:
    """DCGM field -> the last cell of its row in the doc's mapping tables (section "Field
    by field")."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## Field by field\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(DCGM_\w+)`[^\n]*\| ([^|\n]*) \|$", section, re.MULTILINE)
    assert len(rows) == len(dict(rows)), "a field has two rows"
    return dict(rows)


def v4_9_cells() -> dict[str, str]:
    """DCGM field -> its cell in the mapping tables' column "dcgm-exporter 4.9" (the one
    before the last)."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## Field by field\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(DCGM_\w+)` \|([^\n]*)\|$", section, re.MULTILINE)
    cells = {name: rest.split(" | ")[-2].strip() for name, rest in rows}
    assert len(cells) == len(rows) == len(mapping_rows())
    return cells


def v4_9_recorded_in_the_doc() -> set[str]:
    """The 4.9 names the doc marks `recorded` (a cell "`NEW`, unit [source]: recorded")."""
    marked = set()
    for cell in v4_9_cells().values():
        if cell.endswith(": recorded"):
            (name,) = re.findall(r"`(DCGM_\w+)`", cell)
            marked.add(name)
    return marked


def test_the_doc_maps_every_field_dcgm_exporter_collects_by_default() -> None:
    assert sorted(DEFAULT_COUNTERS - set(mapping_rows())) == []


def test_the_doc_marks_exactly_the_recorded_fields_as_recorded() -> None:
    marked = {name for name, rule in mapping_rows().items() if rule.startswith("recorded")}
    assert marked == recorded_dcgm_series()


def test_every_series_nvidia_dashboard_reads_is_recorded() -> None:
    read = {m for _, expr in queries(load(DASHBOARD)) for m in referenced_metrics(expr)}
    assert read == {
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    }
    assert read <= recorded_dcgm_series()


def test_the_dashboard_copy_is_the_one_its_source_note_names() -> None:
    digest = hashlib.sha256(DASHBOARD.read_bytes()).hexdigest()
    assert f"`{digest}`" in DASHBOARD_SOURCE.read_text(encoding="utf-8")


def test_the_doc_marks_exactly_the_recorded_4_9_names_as_recorded() -> None:
    assert v4_9_recorded_in_the_doc() == recorded_dcgm_series(COMPAT_RULES_4_9)


def test_the_4_9_file_records_no_name_the_older_file_records() -> None:
    """With both files loaded (as the chart does), a name recorded by both would be two
    series (different driver-version labels) and every sum over it would count twice."""
    assert recorded_dcgm_series(COMPAT_RULES_4_9) & recorded_dcgm_series() == set()


def test_every_default_field_has_its_4_9_name_or_says_it_kept_it() -> None:
    """4.9 renamed fields of its default set: each default row names its 4.9 name (or
    label), or says the name is unchanged; only fields outside it are opt-in."""
    cells = v4_9_cells()
    for name in DEFAULT_COUNTERS:
        cell = cells[name]
        assert cell.startswith(("`", "label `", "unchanged")), f"{name}: {cell}"
    assert {n for n, c in cells.items() if c == "opt-in"}.isdisjoint(DEFAULT_COUNTERS)
