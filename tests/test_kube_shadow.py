"""``--kube-writes shadow``: every write computed, counted and logged, none sent.

The same scenario runs twice on the simulated node and the API stand-in, once with
writes on and once in shadow: the shadow run sends nothing (the stand-in's write log
stays empty), and its counter and log lines name every write the run with writes on
sent, kind by kind and reason by reason.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any

import pytest

from exporter.config import ConfigError, parse_kube_writes
from tests.exporter_process import usage_error
from tests.harness import Harness, simulated_exporter
from tests.kube_writes import dra_with_a_reset, settle
from tests.test_kube_events import api, quiet, step, until

ARGV = ["--node-condition", "--dra-device-taints"]
SHADOW_LINE = re.compile(r"shadow: would (\w+) (\w+) (\S+) \(reason (\S+)\); not sent")


def sent_writes(h: Harness) -> Counter[tuple[str, str, str]]:
    """(verb, kind, reason) of every write the stand-in received; a rule's delete
    carries no reason on the wire and is named by the rule instead."""
    writes: Counter[tuple[str, str, str]] = Counter()
    event_reasons: dict[str, str] = {}
    for w in api(h).write_log:
        body: Any = w.body
        if "/events" in w.path and w.method == "POST":
            event_reasons[body["metadata"]["name"]] = body["reason"]
            writes[("create", "event", body["reason"])] += 1
        elif "/events/" in w.path and w.method == "PATCH":
            writes[("patch", "event", event_reasons[w.path.rsplit("/", 1)[1]])] += 1
        elif w.path.endswith("/status") and w.method == "PATCH":
            (condition,) = body["status"]["conditions"]
            writes[("patch", "node_condition", condition["reason"])] += 1
        elif "devicetaintrules" in w.path and w.method == "POST":
            writes[("create", "device_taint_rule", body["spec"]["taint"]["value"])] += 1
        elif "devicetaintrules" in w.path and w.method == "DELETE":
            writes[("delete", "device_taint_rule", w.path.rsplit("/", 1)[1])] += 1
        else:
            raise AssertionError(f"a write this test does not know: {w.method} {w.path}")
    return writes


def shadow_lines(caplog: pytest.LogCaptureFixture) -> Counter[tuple[str, str, str]]:
    """The same triples, from the shadow run's log lines."""
    found: Counter[tuple[str, str, str]] = Counter()
    for record in caplog.records:
        m = SHADOW_LINE.fullmatch(record.getMessage())
        if m:
            verb, kind, name, reason = m.groups()
            found[(verb, kind, name if verb == "delete" else reason)] += 1
    return found


async def run(argv: list[str]) -> tuple[Counter[tuple[str, str, str]], Harness]:
    """The dra scenario: GPU 0 asks for a reset at 15 s, done at 35 s; cycles to 50 s."""
    async with simulated_exporter(dra_with_a_reset(), argv=argv) as h:
        await quiet(h)
        for _ in range(4):
            await step(h)
            await quiet(h)
        await settle(h)
        return sent_writes(h), h


async def test_shadow_sends_nothing_and_names_every_write_that_on_mode_sends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.reporting.writer")
    on, _ = await run(ARGV)
    kinds = {kind for _, kind, _ in on}
    assert kinds == {"event", "node_condition", "device_taint_rule"}, on  # all three
    caplog.clear()
    shadow_sent, h = await run([*ARGV, "--kube-writes", "shadow"])
    assert shadow_sent == Counter()  # the stand-in received no write at all
    assert shadow_lines(caplog) == on
    assert h.agent.reporter is not None
    counted = h.agent.reporter.shadow_counts()
    by_kind: Counter[str] = Counter()
    for (kind, _reason), n in counted.items():
        by_kind[kind] += n
    assert by_kind == Counter(
        {kind: sum(n for (_, k, _), n in on.items() if k == kind) for kind in kinds}
    )
    creates = {(kind, reason) for verb, kind, reason in on if verb != "delete"}
    assert creates <= set(counted)  # each Event, condition and taint reason is named


async def test_shadow_per_kind_sends_the_other_kinds() -> None:
    sent, h = await run([*ARGV, "--kube-writes", "shadow=node_condition,device_taint_rule"])
    assert {kind for _, kind, _ in sent} == {"event"}
    assert h.agent.reporter is not None
    shadowed = {kind for kind, _ in h.agent.reporter.shadow_counts()}
    assert shadowed == {"node_condition", "device_taint_rule"}
    assert api(h).device_taint_rules() == []


async def test_the_shadow_counter_is_served_with_kind_and_reason() -> None:
    argv = ["--node-condition", "--kube-writes", "shadow"]
    async with simulated_exporter(dra_with_a_reset(), argv=argv) as h:
        await until(lambda: bool(h.agent.reporter and h.agent.reporter.shadow_counts()), "a write")
        await step(h)
        scrape = await h.scrape()
        assert scrape.types["gpu_exporter_kube_writes_shadowed"] == "counter"
        name = "gpu_exporter_kube_writes_shadowed_total"
        assert scrape.get(name, kind="node_condition", reason="GPUsHealthy") == 1
        assert api(h).write_log == []


@pytest.mark.parametrize(
    ("value", "shadowed"),
    [
        ("on", frozenset()),
        ("shadow", frozenset({"event", "node_condition", "device_taint_rule"})),
        ("shadow=event", frozenset({"event"})),
        ("shadow=node_condition, device_taint_rule", {"node_condition", "device_taint_rule"}),
    ],
)
def test_kube_writes_values(value: str, shadowed: frozenset[str]) -> None:
    assert parse_kube_writes(value) == shadowed


@pytest.mark.parametrize("value", ["off", "shadow=", "shadow=pods", "Shadow", "on,shadow"])
def test_a_bad_kube_writes_value_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="--kube-writes"):
        parse_kube_writes(value)


def test_a_bad_kube_writes_flag_is_one_line_and_exit_2() -> None:
    line, _ = usage_error("--kube-writes", "shadow=pods", "--listen", "127.0.0.1:0")
    assert line.startswith("gpu-occupancy-exporter: error: --kube-writes: 'shadow=pods'")
    assert "unknown: pods" in line
