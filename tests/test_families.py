"""--families-disable / --families-enable: which metric families are served."""

from __future__ import annotations

import pytest

from exporter.config import SERVER_ONLY_FLAGS, ConfigError, build_parser, parse_config
from exporter.model.families import (
    CATALOGUE,
    DEFAULT_FAMILIES,
    DEFAULT_OFF,
    SELF_PREFIX,
    FamilySelectionError,
    matching,
    select_families,
    selectable,
)
from tests.harness import simulated_exporter
from tests.test_alert_rules import (
    CHART_RECORDED,
    PROMETHEUS_METRICS,
    all_rules,
    recorded_names,
    referenced_metrics,
)
from tests.test_dashboards import all_boards, queries, substitute

FP = {"gpu_fp64_active_ratio", "gpu_fp32_active_ratio", "gpu_fp16_active_ratio"}
PER_PROCESS = {"gpu_process_memory_used_bytes", "gpu_process_sm_utilization_ratio"}


def served_by_default(metric: str) -> bool:
    """Whether the family of a queried name (counters with _total, histogram series with
    their suffix) is in the default set; the exporter's own are always served."""
    if metric.startswith(SELF_PREFIX):
        return True
    for suffix in ("", "_total", "_bucket", "_sum", "_count"):
        name = metric.removesuffix(suffix) if suffix else metric
        if name in CATALOGUE:
            return name in DEFAULT_FAMILIES
    raise AssertionError(f"{metric} is not a family the exporter serves")


def shipped_queries() -> dict[str, set[str]]:
    """Where each metric the shipped alerts, recording rules and dashboards read is read."""
    readers: dict[str, set[str]] = {}
    for rule in all_rules():
        where = rule.get("alert") or rule.get("record")
        for metric in referenced_metrics(rule["expr"]):
            readers.setdefault(metric, set()).add(f"rule {where}")
    for name, board in all_boards():
        for where, expr in queries(board):
            for metric in referenced_metrics(substitute(expr)):
                readers.setdefault(metric, set()).add(f"{name}: {where}")
    return readers


def test_the_default_set_serves_every_metric_the_shipped_rules_and_dashboards_read() -> None:
    readers = shipped_queries()
    exporter_metrics = set(readers) - recorded_names() - CHART_RECORDED - PROMETHEUS_METRICS
    assert "gpu_clock_event_active" in exporter_metrics  # the reader found what it should
    off = {
        metric: sorted(readers[metric])
        for metric in exporter_metrics
        if not served_by_default(metric)
    }
    assert not off, f"read by shipped rules or dashboards but off by default: {off}"


def test_by_default_only_the_per_process_series_are_off() -> None:
    assert set(selectable()) - DEFAULT_FAMILIES == PER_PROCESS
    assert all(matching(pattern, selectable()) for pattern in DEFAULT_OFF)


def test_per_process_metrics_turns_the_per_process_families_on() -> None:
    assert select_families(per_process=True) == DEFAULT_FAMILIES | PER_PROCESS


def test_disable_takes_globs_and_enable_wins_where_both_match() -> None:
    served = select_families(disable="gpu_clock_event_*, gpu_memory_*,")
    assert "gpu_clock_event_active" not in served and "gpu_memory_used_bytes" not in served
    assert "gpu_sm_active_ratio" in served
    only = select_families(enable="gpu_memory_used_bytes,gpu_fp*", disable="*")
    assert only - {n for n in CATALOGUE if n.startswith(SELF_PREFIX)} == {
        "gpu_memory_used_bytes",
        *FP,
        *(f"{name.removesuffix('_ratio')}_seconds" for name in FP),  # their counters
    }
    # --per-process-metrics is a default: --families-disable still takes it away
    assert not select_families(disable="gpu_process_*", per_process=True) & PER_PROCESS


def test_the_exporters_own_families_are_always_served() -> None:
    own = {n for n in CATALOGUE if n.startswith(SELF_PREFIX)}
    assert own and own <= select_families(disable="*")
    assert own <= select_families(disable="gpu_*")


@pytest.mark.parametrize(
    ("flag", "text", "message"),
    [
        (
            "disable",
            "gpu_clock_event_*,gpu_temprature_celsius",
            "--families-disable: 'gpu_temprature_celsius' matches no metric family",
        ),
        (
            "enable",
            "gpu_energy_joules_total",
            "counters are named without _total (use 'gpu_energy_joules')",
        ),
        (
            "disable",
            "gpu_exporter_source_up",
            "names only the exporter's own metrics (gpu_exporter_*), which are always served",
        ),
        ("disable", "gpu_exporter_build_info", "always served"),  # the agent's own
        ("enable", "gpu_fp.*", "'gpu_fp.*' is not a glob over metric family names"),
    ],
)
def test_a_pattern_that_selects_nothing_is_refused_by_name(
    flag: str, text: str, message: str
) -> None:
    with pytest.raises(FamilySelectionError) as caught:
        if flag == "enable":
            select_families(enable=text)
        else:
            select_families(disable=text)
    line = str(caught.value)
    assert message in line and "\n" not in line
    assert line.startswith(f"--families-{flag}: ")


def test_flags_and_environment_reach_the_config() -> None:
    config = parse_config(["--families-disable", "gpu_clock_event_*"], env={})
    assert "gpu_clock_event_active" not in config.families
    env = {"GPU_EXPORTER_FAMILIES_ENABLE": "gpu_process_sm_*"}
    assert "gpu_process_sm_utilization_ratio" in parse_config([], env=env).families
    assert parse_config([], env={}).families == DEFAULT_FAMILIES
    with pytest.raises(ConfigError, match="--families-enable: 'gpu_nope' matches no"):
        parse_config([], env={"GPU_EXPORTER_FAMILIES_ENABLE": "gpu_nope"})


def test_snapshot_does_not_offer_them_it_prints_no_metrics() -> None:
    assert {"--families-disable", "--families-enable"} <= SERVER_ONLY_FLAGS
    text = build_parser({}, snapshot=True).format_help()
    assert "--families" not in text


async def test_disabled_families_are_not_served_and_enabled_ones_are() -> None:
    argv = [
        "--families-disable",
        "gpu_clock_event_*,gpu_memory_*,gpu_fp*",
        "--families-enable",
        "gpu_process_*",
    ]
    async with simulated_exporter("single-gpu", argv=argv) as h:
        await h.advance(5)
        served = (await h.scrape()).names()
    assert not {n for n in served if n.startswith(("gpu_clock_event_", "gpu_memory_", "gpu_fp"))}
    assert served >= PER_PROCESS
    assert {"gpu_sm_active_ratio", "gpu_exporter_source_up", "gpu_exporter_errors"} <= served


async def test_by_default_every_family_but_the_per_process_ones_is_served() -> None:
    async with simulated_exporter("single-gpu") as h:
        await h.advance(5)
        served = (await h.scrape()).names()
    assert served >= FP | {"gpu_clock_event_active", "gpu_memory_used_bytes"}
    assert not PER_PROCESS & served


async def test_disabling_everything_leaves_only_the_exporters_own_families() -> None:
    async with simulated_exporter("single-gpu", argv=["--families-disable", "*"]) as h:
        await h.advance(5)
        served = (await h.scrape()).names()
    assert served and all(n.startswith(SELF_PREFIX) for n in served)


async def test_every_served_help_and_type_line_is_ascii() -> None:
    """One character past ASCII anywhere in the exposition makes Python join the whole
    body as a two-byte string and encode it the slow way: ~16x the time of an ASCII join
    (126 vs 8 us for node-8gpu's 192 KiB, measured), in every render. Label values come
    from outside and may need it; the texts the exporter writes itself must not."""
    async with simulated_exporter("node-8gpu") as h:
        await h.advance(5)
        async with h.session.get(h.url + "/metrics") as response:
            body = await response.read()
    comments = [line for line in body.split(b"\n") if line.startswith(b"#")]
    assert len(comments) > 100
    assert [line for line in comments if not line.isascii()] == []
